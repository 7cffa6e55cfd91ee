"""The route stage, token dropping and balancing against hand-written NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmoe.config import BalanceConfig, DenseLayout, ExpertLayout, MoEConfig, ParallelConfig, \
    RouterConfig
from jmoe.moe import MoE, apply_capacity, balance_loss, bias_step, route
from jmoe.moe.dispatch import LOCAL_AXES, LocalDispatcher
from jmoe.moe.experts import ExpertCompute, ExpertWeights
from jmoe.parallel import make_layout

T, E = 32, 8


def np_route(logits, cfg: RouterConfig, k, bias=None):
  """NumPy reference: (ids [T, k], weights [T, k]); ties to the lower index."""
  logits = np.asarray(logits, np.float64)
  if cfg.score == "sigmoid":
    scores = 1 / (1 + np.exp(-logits))
  else:
    p = np.exp(logits - logits.max(-1, keepdims=True))
    probs = p / p.sum(-1, keepdims=True)
    scores = logits if cfg.score == "softmax_topk" else probs
  select = scores + (0 if bias is None else np.asarray(bias))
  if cfg.num_groups > 1:
    g = select.reshape(len(select), cfg.num_groups, -1)
    group_score = -np.sort(-g, axis=-1)[..., :2].sum(-1)
    keep = np.argsort(-group_score, axis=-1, kind="stable")[:, :cfg.topk_groups]
    mask = np.zeros(group_score.shape, bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    select = np.where(mask[..., None], g, -np.inf).reshape(select.shape)
  ids = np.argsort(-select, axis=-1, kind="stable")[:, :k]
  w = np.take_along_axis(scores, ids, -1)
  if cfg.score == "softmax_topk":
    w = np.exp(w - w.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
  elif cfg.norm_topk_prob:
    w = w / w.sum(-1, keepdims=True)
  return ids, w * cfg.scaling_factor


def logits_fixed(seed=0, scale=2.0):
  return np.array(jax.random.normal(jax.random.key(seed), (T, E)) * scale, np.float32)


CASES = {
    "softmax": RouterConfig(),
    "softmax_unnormalised_scaled": RouterConfig(norm_topk_prob=False, scaling_factor=2.5),
    "softmax_topk": RouterConfig(score="softmax_topk"),
    "sigmoid_groups": RouterConfig(score="sigmoid", num_groups=4, topk_groups=2,
                                   scaling_factor=2.5),
    "sigmoid_groups_k3": RouterConfig(score="sigmoid", num_groups=2, topk_groups=1),
    "softmax_groups": RouterConfig(num_groups=4, topk_groups=3, norm_topk_prob=False),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("with_bias", [False, True])
def test_router_against_numpy(name, with_bias):
  cfg = CASES[name]
  k = 3
  logits = logits_fixed()
  bias = np.linspace(-0.3, 0.3, E).astype(np.float32) if with_bias else None
  r = route(jnp.asarray(logits), cfg, k, expert_bias_E=None if bias is None else jnp.asarray(bias))
  ids, w = np_route(logits, cfg, k, bias)
  np.testing.assert_array_equal(r.expert_ids_TK, ids)
  np.testing.assert_allclose(r.weights_TK, w, rtol=1e-5, atol=1e-7)


def test_ties_go_to_the_lower_index():
  logits = np.zeros((T, E), np.float32)
  logits[:, [2, 5, 6]] = 1.0  # three-way tie for the top
  r = route(jnp.asarray(logits), RouterConfig(), 2)
  assert np.all(np.asarray(r.expert_ids_TK) == [2, 5])
  np.testing.assert_allclose(r.weights_TK, 0.5, rtol=1e-6)


def test_a_group_with_no_winners():
  logits = logits_fixed()
  logits[:, 4:6] -= 20.0  # group 2 of 4 never wins, whatever its rival groups score
  cfg = RouterConfig(score="sigmoid", num_groups=4, topk_groups=2)
  r = route(jnp.asarray(logits), cfg, 2)
  assert not np.isin(np.asarray(r.expert_ids_TK), [4, 5]).any()
  ids, w = np_route(logits, cfg, 2)
  np.testing.assert_array_equal(r.expert_ids_TK, ids)
  np.testing.assert_allclose(r.weights_TK, w, rtol=1e-5)
  # Each token's experts lie in at most topk_groups groups.
  assert max(len(set(row // 2)) for row in np.asarray(r.expert_ids_TK)) <= 2


def test_all_tokens_to_one_expert():
  logits = logits_fixed(scale=0.1)
  logits[:, 3] += 10.0
  r = route(jnp.asarray(logits), RouterConfig(), 1)
  assert np.all(np.asarray(r.expert_ids_TK) == 3)
  load = np.zeros(E)
  load[3] = 1.0
  np.testing.assert_allclose(r.stats.load_E, load)
  # Balance loss: E * f_3 * p_3 with f_3 = 1.
  p3 = np.asarray(jax.nn.softmax(logits, -1))[:, 3].mean()
  np.testing.assert_allclose(r.stats.aux_loss, E * p3, rtol=1e-5)


def np_balance(probs, ids, groups):
  """Mean over equal contiguous token groups of E * sum_e f_e * p_e."""
  out = []
  for rows_p, rows_i in zip(np.split(np.asarray(probs, np.float64), groups),
                            np.split(np.asarray(ids), groups)):
    f = np.bincount(rows_i.ravel(), minlength=E) / rows_i.size
    out.append(E * np.sum(f * rows_p.mean(0)))
  return np.mean(out)


@pytest.mark.parametrize("groups", [1, 4, 32])
def test_balance_loss_over_groups_against_numpy(groups):
  logits = logits_fixed(3)
  probs = np.asarray(jax.nn.softmax(logits, -1))
  ids = np.argsort(-probs, -1, kind="stable")[:, :2]
  got = balance_loss(jnp.asarray(probs), jnp.asarray(ids), groups)
  np.testing.assert_allclose(got, np_balance(probs, ids, groups), rtol=1e-5)


def np_capacity(ids, w, capacity, policy):
  ids, w = ids.copy(), w.copy()
  for e in range(E):
    rows = np.argwhere(ids == e)  # (t, k) in token order
    if policy == "probability":
      rows = rows[np.argsort(-w[ids == e], kind="stable")]
    for t, k in rows[capacity:]:
      ids[t, k], w[t, k] = E, 0.0
  return ids, w


@pytest.mark.parametrize("policy", ["position", "probability"])
def test_capacity_drops_by_policy(policy):
  logits = logits_fixed(5)
  logits[:, 0] += 1.5  # expert 0 is over-subscribed
  r = route(jnp.asarray(logits), RouterConfig(), 2)
  capacity = int(np.ceil(1.0 * T * 2 / E))
  ids, w, dropped = apply_capacity(r.expert_ids_TK, r.weights_TK, E, 1.0, policy)
  ref_ids, ref_w = np_capacity(np.asarray(r.expert_ids_TK), np.asarray(r.weights_TK), capacity,
                               policy)
  np.testing.assert_array_equal(ids, ref_ids)
  np.testing.assert_allclose(w, ref_w)
  np.testing.assert_allclose(dropped, np.mean(ref_ids == E))
  assert 0 < float(dropped) < 0.5


def test_expert_bias_moves_load_towards_balance():
  """A skewed router (fixed logits) with aux-loss-free balancing: the bias alone evens the load."""
  logits = jnp.asarray(logits_fixed(7, scale=0.5) + np.linspace(2, 0, E, dtype=np.float32))
  cfg = RouterConfig(score="sigmoid")
  bias = jnp.zeros((E,))
  imbalance = []
  for _ in range(300):
    r = route(logits, cfg, 2, expert_bias_E=bias)
    imbalance.append(float(jnp.max(r.stats.load_E) * E))
    bias = bias_step(bias, r.stats.load_E, 0.01)
  assert imbalance[0] > 2.5
  assert max(imbalance[-20:]) < 1.5, imbalance[-20:]


def make_moe(**moe):
  cfg = MoEConfig(num_experts=E, top_k=2, d_ff_expert=8, **moe)
  return MoE(16, cfg, std=0.3, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0))


LAYOUTS = {
    "dp8": (DenseLayout(data=8), ExpertLayout(data=8)),
    "fsdp4_cp2_ep8": (DenseLayout(data=1, fsdp=4, context=2), ExpertLayout(data=1, expert=8)),
    "dp4_tp2_ep4_etp2": (DenseLayout(data=4, tensor=2), ExpertLayout(data=1, expert=4, tensor=2)),
}


def run_layer(layer, x, layout=None):
  fn = jax.jit(lambda x: layer(x))
  if layout is None:
    return fn(x)
  with layout.active():
    return fn(x)


@pytest.mark.parametrize("kind", ["global", "seq"])
def test_balance_losses_are_layout_independent(kind):
  layer = make_moe(balance=BalanceConfig(aux_loss_type=kind))
  x = jax.random.normal(jax.random.key(0), (8, 16, 16))
  _, ref = run_layer(layer, x)
  logits = np.asarray(x.reshape(-1, 16) @ layer.router_DE[...])
  probs = np.asarray(jax.nn.softmax(logits, -1))
  ids = np.argsort(-probs, -1, kind="stable")[:, :2]
  expected = np_balance(probs, ids, 1 if kind == "global" else 8)
  np.testing.assert_allclose(ref.aux_loss, expected, rtol=1e-5)
  for name, (dense, expert) in LAYOUTS.items():
    _, stats = run_layer(layer, x, make_layout(ParallelConfig(dense, expert)))
    np.testing.assert_allclose(stats.aux_loss, ref.aux_loss, rtol=1e-6, err_msg=name)


def test_micro_batch_balance_loss_is_per_data_parallel_rank():
  layer = make_moe(balance=BalanceConfig(aux_loss_type="micro_batch"))
  x = jax.random.normal(jax.random.key(0), (8, 16, 16))
  logits = jnp.asarray(x.reshape(-1, 16) @ layer.router_DE[...])
  for dense, expert, ranks in [(DenseLayout(data=8), ExpertLayout(data=8), 8),
                               (DenseLayout(data=2, tensor=4), ExpertLayout(expert=8, data=1), 2)]:
    _, stats = run_layer(layer, x, make_layout(ParallelConfig(dense, expert)))
    ids = route(logits, RouterConfig(), 2).expert_ids_TK
    expected = balance_loss(jax.nn.softmax(logits, -1), ids, ranks)
    np.testing.assert_allclose(stats.aux_loss, expected, rtol=1e-6)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("policy", ["position", "probability"])
def test_capacity_is_decided_per_device_and_matches_a_per_shard_reference(dispatcher, policy):
  layer = make_moe(capacity_factor=1.0, drop_policy=policy, dispatcher=dispatcher)
  layer.router_DE[...] = layer.router_DE[...].at[:, 0].add(0.5)  # skew: expert 0 overflows
  x = jax.random.normal(jax.random.key(1), (8, 16, 16))
  layout = make_layout(ParallelConfig(DenseLayout(data=8), ExpertLayout(data=1, expert=8)))
  y, stats = run_layer(layer, x, layout)
  # Reference: each device's 16 tokens on their own, with all experts local.
  x_TD = x.reshape(8, 16, 16)
  logits = jnp.einsum("ntd,de->nte", x_TD, layer.router_DE[...])
  ys, drops = [], []
  for n in range(8):
    r = route(logits[n], layer.cfg.router, 2)
    experts = ExpertWeights(w_in_ED2F=layer.w_in_ED2F[...], w_out_EFD=layer.w_out_EFD[...])
    dispatcher = LocalDispatcher(LOCAL_AXES, experts.num_experts, layer.cfg.capacity_factor,
                                 layer.cfg.drop_policy)
    rows, context = dispatcher.dispatch(x_TD[n], r.expert_ids_TK, r.weights_TK)
    y_XD = ExpertCompute.from_config(layer.cfg)(rows, experts, LOCAL_AXES)
    ys.append(dispatcher.combine(y_XD, context))
    drops.append(context.dropped_fraction)
  np.testing.assert_allclose(y.reshape(8, 16, 16), jnp.stack(ys), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stats.dropped_fraction, np.mean(drops), rtol=1e-6)
  assert float(stats.dropped_fraction) > 0.05


def test_jitter_only_with_a_key():
  layer = make_moe(router=RouterConfig(jitter=0.2))
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  y0, _ = layer(x)
  y1, _ = layer(x)
  y2, _ = layer(x, rng=jax.random.key(3))
  np.testing.assert_array_equal(y0, y1)
  assert not np.allclose(y0, y2)


def test_forced_balanced_routing_loads_every_expert_equally():
  logits = jax.random.normal(jax.random.key(0), (64, 8))
  routing = route(logits, RouterConfig(force_balanced=True), 2)
  np.testing.assert_allclose(routing.stats.load_E, np.full(8, 1 / 8))
  assert all(len(set(row)) == 2 for row in np.asarray(routing.expert_ids_TK))
