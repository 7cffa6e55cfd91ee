"""The MoE layer against a per-expert Python loop, and each stage's own properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmoe.config import MoEConfig, RouterConfig
from jmoe.moe import MoE, combine, route, sort_by_expert
from jmoe.ops.grouped_gemm import GEMM_BACKENDS, grouped_gemm

D, E, F, T = 16, 8, 12, 40

# The Mosaic kernels run on Hopper GPUs only; scripts/check_gpu.py holds them to a float32
# reference there.
PORTABLE_BACKENDS = sorted(set(GEMM_BACKENDS) - {"mosaic"})


def reference_moe(x_TD, router_DE, w_in_ED2F, w_out_EFD, top_k, norm_topk_prob):
  """Per-expert loop: each expert applied to exactly the tokens that chose it."""
  probs_TE = jax.nn.softmax(x_TD @ router_DE, axis=-1)
  weights_TK, ids_TK = jax.lax.top_k(probs_TE, top_k)
  if norm_topk_prob:
    weights_TK = weights_TK / weights_TK.sum(-1, keepdims=True)
  y_TD = jnp.zeros_like(x_TD)
  for e in range(router_DE.shape[1]):
    gate_T = jnp.sum(jnp.where(ids_TK == e, weights_TK, 0.0), axis=-1)
    h = jnp.einsum("td,dcf->tcf", x_TD, w_in_ED2F[e])  # [T, 2, F]
    out = (jax.nn.silu(h[:, 0]) * h[:, 1]) @ w_out_EFD[e]
    y_TD = y_TD + gate_T[:, None] * out
  return y_TD


def make_layer(top_k=2, norm=True, gemm="ragged_dot", starve=()):
  cfg = MoEConfig(num_experts=E, top_k=top_k, d_ff_expert=F, gemm=gemm,
                  router=RouterConfig(norm_topk_prob=norm))
  layer = MoE(D, cfg, std=0.3, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(3))
  if starve:  # experts that no token chooses
    layer.router_DE[...] = layer.router_DE[...].at[:, list(starve)].set(-50.0)
  return layer


def x_input(seed=0):
  # Positive inputs so a large negative router column surely starves its expert.
  return jnp.abs(jax.random.normal(jax.random.key(seed), (1, T, D)))


@pytest.mark.parametrize("gemm", PORTABLE_BACKENDS)
@pytest.mark.parametrize("top_k, norm, starve", [(2, True, ()), (1, True, ()), (3, False, (2, 5)),
                                                 (8, True, ())])
def test_layer_matches_per_expert_loop(gemm, top_k, norm, starve):
  layer = make_layer(top_k, norm, gemm, starve)
  x = x_input()

  def ours(layer, x):
    y, _ = layer(x)
    return y

  def ref(layer, x):
    return reference_moe(x[0], layer.router_DE[...], layer.w_in_ED2F[...], layer.w_out_EFD[...],
                         top_k, norm)[None]

  np.testing.assert_allclose(ours(layer, x), ref(layer, x), rtol=1e-5, atol=1e-6)
  if starve:
    _, stats = layer(x)
    assert np.all(np.asarray(stats.load_E)[list(starve)] == 0)

  # Gradients with respect to every parameter and the input, through a random projection.
  probe = jax.random.normal(jax.random.key(1), (1, T, D))
  g_ours = nnx.grad(lambda m, x: jnp.sum(ours(m, x) * probe), argnums=(0, 1))(layer, x)
  g_ref = nnx.grad(lambda m, x: jnp.sum(ref(m, x) * probe), argnums=(0, 1))(layer, x)
  # Absolute tolerance on the scale of the largest gradient: some leaves are zero up to rounding
  # (e.g. the router's gradient when top_k=1 and the weight is renormalised to one).
  scale = max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(g_ref))
  for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)
  if starve:  # a starved expert gets exactly zero gradient
    assert np.all(np.asarray(g_ours[0]["w_in_ED2F"][...])[list(starve)] == 0)


@pytest.mark.parametrize("gemm", PORTABLE_BACKENDS)
def test_grouped_gemm_against_loop(gemm):
  rng = np.random.default_rng(0)
  sizes = np.array([3, 0, 5, 1, 0, 7, 2, 2], np.int32)  # 20 rows used of 24: 4 rows belong to none
  x = rng.normal(size=(24, D)).astype(np.float32)
  w = rng.normal(size=(E, D, F)).astype(np.float32)
  y = np.asarray(grouped_gemm(gemm)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes)))
  start = 0
  for e, n in enumerate(sizes):
    np.testing.assert_allclose(y[start:start + n], x[start:start + n] @ w[e], rtol=1e-5, atol=1e-5)
    start += n
  assert np.all(y[start:] == 0)


def test_dispatch_then_combine_is_identity_with_its_gradient():
  x_TD = jax.random.normal(jax.random.key(0), (T, D))
  ids_TK = jax.random.randint(jax.random.key(1), (T, 3), 0, E)
  weights_TK = jax.nn.softmax(jax.random.normal(jax.random.key(2), (T, 3)), axis=-1)

  def roundtrip(x):
    s = sort_by_expert(x, ids_TK, E)
    return combine(s.x_XD, s.order_X, s.inverse_X, weights_TK)

  np.testing.assert_allclose(roundtrip(x_TD), x_TD, rtol=1e-6, atol=1e-6)
  probe = jax.random.normal(jax.random.key(3), (T, D))
  grad = jax.grad(lambda x: jnp.sum(roundtrip(x) * probe))(x_TD)
  np.testing.assert_allclose(grad, probe, rtol=1e-6, atol=1e-6)


def test_dispatch_sorts_rows_by_expert_and_counts():
  ids_TK = jnp.array([[3, 1], [1, 0], [3, 2]], jnp.int32)
  x_TD = jnp.arange(3, dtype=jnp.float32)[:, None] * jnp.ones((3, 2))
  d = sort_by_expert(x_TD, ids_TK, 4)
  np.testing.assert_array_equal(d.group_sizes_E, [1, 2, 1, 2])
  # rows in expert order, and within an expert in token order: e0:t1, e1:t0,t1, e2:t2, e3:t0,t2
  np.testing.assert_array_equal(d.x_XD[:, 0], [1, 0, 1, 2, 0, 2])


@pytest.mark.parametrize("norm", [True, False])
def test_router_weights(norm):
  logits = jax.random.normal(jax.random.key(0), (T, E)) * 2
  r = route(logits, RouterConfig(norm_topk_prob=norm), top_k=3)
  probs = np.asarray(jax.nn.softmax(logits, axis=-1))
  top = np.sort(probs, axis=-1)[:, ::-1][:, :3]
  if norm:
    np.testing.assert_allclose(np.sum(r.weights_TK, -1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(r.weights_TK, top / top.sum(-1, keepdims=True), rtol=1e-6)
  else:
    np.testing.assert_allclose(r.weights_TK, top, rtol=1e-6)
  np.testing.assert_array_equal(np.take_along_axis(probs, np.asarray(r.expert_ids_TK), -1),
                                np.asarray(r.weights_TK) if not norm else top)


def test_balancing_terms_against_numpy():
  logits = np.asarray(jax.random.normal(jax.random.key(4), (T, E)) * 3)
  r = route(jnp.asarray(logits), RouterConfig(), top_k=2)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :2]
  load = np.bincount(chosen.ravel(), minlength=E) / (T * 2)
  np.testing.assert_allclose(r.stats.load_E, load, rtol=1e-6)
  np.testing.assert_allclose(r.stats.aux_loss, E * np.sum(load * probs.mean(0)), rtol=1e-5)
  lse = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(r.stats.z_loss, np.mean(lse ** 2), rtol=1e-5)


def test_aux_loss_is_one_when_scores_are_uniform():
  r = route(jnp.zeros((T, E)), RouterConfig(), top_k=2)
  np.testing.assert_allclose(r.stats.aux_loss, 1.0, rtol=1e-6)


@pytest.mark.parametrize("gemm", PORTABLE_BACKENDS)
def test_biased_clamped_experts_match_per_expert_loop(gemm):
  """GPT-OSS experts: biases on both projections, clamped SwiGLU, softmax over the top-k logits."""
  cfg = MoEConfig(num_experts=E, top_k=2, d_ff_expert=F, gemm=gemm, expert_bias=True,
                  activation="clamped_swiglu", swiglu_limit=0.5, swiglu_alpha=1.702,
                  router=RouterConfig(score="softmax_topk", bias=True))
  layer = MoE(D, cfg, std=0.5, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(4))
  keys = jax.random.split(jax.random.key(9), 3)
  layer.b_in_E2F[...] = jax.random.normal(keys[0], layer.b_in_E2F.shape)
  layer.b_out_ED[...] = jax.random.normal(keys[1], layer.b_out_ED.shape)
  layer.router_bias_E[...] = jax.random.normal(keys[2], (E,))
  x = x_input()

  def reference(layer, x):
    x_TD = x[0]
    logits = x_TD @ layer.router_DE[...] + layer.router_bias_E[...]
    top, ids = jax.lax.top_k(logits, 2)
    weights = jax.nn.softmax(top, axis=-1)
    y = jnp.zeros_like(x_TD)
    for e in range(E):
      gate_T = jnp.sum(jnp.where(ids == e, weights, 0.0), axis=-1)
      h = jnp.einsum("td,dcf->tcf", x_TD, layer.w_in_ED2F[...][e]) + layer.b_in_E2F[...][e]
      g, u = jnp.minimum(h[:, 0], 0.5), jnp.clip(h[:, 1], -0.5, 0.5)
      out = (g * jax.nn.sigmoid(1.702 * g) * (u + 1)) @ layer.w_out_EFD[...][e] + \
          layer.b_out_ED[...][e]
      y = y + gate_T[:, None] * out
    return y[None]

  np.testing.assert_allclose(layer(x)[0], reference(layer, x), rtol=1e-5, atol=1e-5)
  probe = jax.random.normal(jax.random.key(1), (1, T, D))
  g_ours = nnx.grad(lambda m: jnp.sum(m(x)[0] * probe))(layer)
  g_ref = nnx.grad(lambda m: jnp.sum(reference(m, x) * probe))(layer)
  scale = max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(g_ref))
  for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)


def test_row_gathers_differentiate_like_their_plain_forms():
  """The dispatch's gathers (whose gradients are gathers too) against jnp.take, whose gradient is
  a scatter-add: a sort of token copies, and a buffer with empty rows and dropped copies."""
  from jmoe.ops.rows import gather_copies, inverse_permutation, move_rows
  x_TD = jax.random.normal(jax.random.key(0), (T, D))
  ids_TK = jax.random.randint(jax.random.key(1), (T, 3), 0, E)
  order_X = jnp.argsort(ids_TK.reshape(-1), stable=True)
  inverse_X = inverse_permutation(order_X)
  np.testing.assert_array_equal(order_X[inverse_X], np.arange(3 * T))
  # A buffer of 150 rows holding some copies (the rest dropped), in a shuffled order.
  slot_X = np.full(3 * T, 150)
  kept = np.random.default_rng(0).permutation(3 * T)[:100]
  slot_X[kept] = np.random.default_rng(1).permutation(150)[:100]
  source_P = inverse_permutation(jnp.asarray(slot_X), 150)
  probe = jax.random.normal(jax.random.key(2), (150, D))
  cases = {
      "sorted copies": (lambda x: gather_copies(x, order_X, inverse_X.reshape(T, 3)),
                        lambda x: jnp.take(x, order_X // 3, axis=0), probe[:3 * T]),
      "buffer": (lambda x: gather_copies(x, source_P, jnp.asarray(slot_X).reshape(T, 3)),
                 lambda x: jnp.take(x, source_P // 3, axis=0, mode="fill", fill_value=0), probe),
      # copies (rows of x_XD) into the buffer, one to one
      "one to one": (lambda x: move_rows(x, source_P, jnp.asarray(slot_X)),
                     lambda x: jnp.take(x, source_P, axis=0, mode="fill", fill_value=0), probe),
  }
  x_XD = jax.random.normal(jax.random.key(3), (3 * T, D))
  for name, (ours, plain, p) in cases.items():
    x = x_XD if name == "one to one" else x_TD
    np.testing.assert_array_equal(ours(x), plain(x), err_msg=name)
    g_ours = jax.grad(lambda x: jnp.sum(ours(x) * p))(x)
    g_plain = jax.grad(lambda x: jnp.sum(plain(x) * p))(x)
    np.testing.assert_allclose(g_ours, g_plain, rtol=1e-6, atol=1e-6, err_msg=name)
