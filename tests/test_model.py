"""Properties of the whole model: causality, variants, remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmoe.config.schema import ModelConfig
from jmoe.model.stack import run_stack
from jmoe.model.transformer import Transformer
from helpers import build, tiny_config


def tokens(seed=0, batch=2, seq=24):
  return jax.random.randint(jax.random.key(seed), (batch, seq), 0, 256)


@pytest.mark.parametrize("variant", [
    {},
    dict(model=dict(tie_embeddings=True), moe=dict(num_shared_experts=2, first_k_dense=0)),
])
def test_future_tokens_do_not_change_past_logits(variant):
  model = build(tiny_config(**variant))
  toks = tokens()
  logits, _ = model(toks)
  cut = 10
  changed = toks.at[:, cut:].set((toks[:, cut:] + 7) % 256)
  logits2, _ = model(changed)
  np.testing.assert_array_equal(logits[:, :cut], logits2[:, :cut])
  assert not np.allclose(logits[:, cut:], logits2[:, cut:])


def test_no_gradient_flows_from_the_future():
  model = build(tiny_config())
  x = model.embed(tokens())

  def logit_at(x_BSD, pos):
    # Run the stacks on embeddings directly so the gradient is taken w.r.t. each position's input.
    positions = jnp.broadcast_to(jnp.arange(x_BSD.shape[1]), x_BSD.shape[:2])
    h, _ = run_stack(model.dense_blocks, x_BSD, positions)
    h, _ = run_stack(model.moe_blocks, h, positions)
    return jnp.sum(h[:, pos])

  grad = jax.grad(logit_at)(x, 9)
  per_position = np.abs(np.asarray(grad)).sum(axis=(0, 2))
  assert np.all(per_position[10:] == 0)
  assert np.all(per_position[:10] > 0)


def test_router_stats_per_moe_layer():
  config = tiny_config()
  _, stats = build(config)(tokens())
  moe_layers = config.model.num_layers - config.moe.first_k_dense
  assert stats.router.load_E.shape == (moe_layers, config.moe.num_experts)
  np.testing.assert_allclose(np.sum(stats.router.load_E, axis=-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("remat, unroll", [("full", 1), ("attention_moe_experts", 1),
                                           ("offload_attention_moe", 1), ("none", 2),
                                           ("full", 3)])
def test_remat_and_unrolled_layers_equal_the_plain_loop(remat, unroll):
  def loss_and_grads(remat, unroll=1):
    model = build(tiny_config(train=dict(remat=remat), model=dict(scan_unroll=unroll)))

    def loss(m):
      logits, stats = m(tokens())
      return jnp.mean(jax.nn.logsumexp(logits, -1)) + jnp.sum(stats.router.aux_loss)

    return nnx.value_and_grad(loss)(model)

  (l0, g0), (l1, g1) = loss_and_grads("none"), loss_and_grads(remat, unroll)
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("remat, unroll", [("none", 5), ("full", 5), ("none", 2)])
def test_alternating_windows_are_fixed_when_unrolled_and_equal_the_branching_loop(
    monkeypatch, remat, unroll):
  """Windowed and full attention alternating (GPT-OSS): with every layer of a stack unrolled,
  each layer's kind is fixed when traced (no branch on the device); the same loss and
  gradients as the loop that branches on each layer's index, which a loop of fewer unrolled
  layers keeps. 5 layers, 1 dense."""
  config = tiny_config(model=dict(num_layers=5, sliding_window=4, full_attention_every=2,
                                  attention_sinks=True, scan_unroll=unroll),
                       train=dict(remat=remat))

  def run():
    model = build(config)

    def loss(m):
      logits, stats = m(tokens())
      return jnp.mean(jax.nn.logsumexp(logits, -1)) + jnp.sum(stats.router.aux_loss)

    def branches(name):  # in one stack's layers, as lowered
      x = jnp.zeros((2, 24, config.model.d_model))
      positions = jnp.broadcast_to(jnp.arange(24), (2, 24))
      first = 0 if name == "dense_blocks" else config.moe.first_k_dense
      forward = lambda x: run_stack(getattr(model, name), x, positions, first_layer=first,
                                    remat=remat, unroll=unroll,
                                    straight=config.model.layers_differ())
      return jax.jit(forward).lower(x).as_text().count("stablehlo.case")

    return (nnx.value_and_grad(loss)(model),
            [branches(name) for name in ("dense_blocks", "moe_blocks")])

  (l0, g0), (dense, moe) = run()
  assert dense == 0 and (moe == 0) == (unroll >= 4)  # (1 dense layer: always all unrolled)
  monkeypatch.setattr(ModelConfig, "layers_differ", lambda self: False)
  (l1, g1), (dense, moe) = run()
  assert dense > 0 and moe > 0  # (the check sees a branch where there is one)
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_bfloat16_compute_tracks_float32():
  toks = tokens()
  ref, _ = build(tiny_config())(toks)
  low, _ = build(tiny_config(precision=dict(compute="bfloat16")))(toks)
  assert low.dtype == jnp.float32  # logits come back in float32 whatever the compute dtype
  # bf16 has 8 bits of mantissa: differences of a few 1e-2 on O(1) logits, not more.
  assert float(jnp.max(jnp.abs(low - ref))) < 0.1
  assert float(jnp.max(jnp.abs(ref))) > 0.1


def test_parameter_count_matches_formula():
  config = tiny_config()
  m, moe = config.model, config.moe
  model = build(config)
  count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  attn = m.d_model * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
  dense_mlp = 3 * m.d_model * m.d_ff
  moe_mlp = m.d_model * moe.num_experts + 3 * moe.num_experts * m.d_model * moe.d_ff_expert
  norms = 2 * m.d_model
  expected = (2 * m.vocab_size * m.d_model + m.d_model
              + moe.first_k_dense * (attn + dense_mlp + norms)
              + (m.num_layers - moe.first_k_dense) * (attn + moe_mlp + norms))
  assert count == expected
  assert isinstance(model, Transformer)


def test_multi_token_prediction_heads_are_causal_and_leave_the_main_head_alone():
  config = tiny_config(model=dict(mtp_depth=2))
  model = build(config)
  from jmoe.train.loss import mtp_inputs
  window = jax.random.randint(jax.random.key(5), (2, 25), 0, 256)
  inputs, ahead = window[:, :-1], mtp_inputs(window, 2)
  h, mtp, stats = model.with_mtp(inputs, ahead)
  logits = jnp.einsum("bsd,dv->bsv", h, model.head_weights(h.dtype))
  np.testing.assert_allclose(logits, model(inputs)[0], rtol=1e-6)
  assert mtp.shape == (2, 2, 24, config.model.d_model)
  assert stats.router.load_E.shape[0] == config.model.num_layers - config.moe.first_k_dense + 2
  # Module k at position i sees tokens up to i + k + 1 of the window, never later ones.
  cut = 10
  changed = window.at[:, cut + 3:].set((window[:, cut + 3:] + 5) % 256)
  _, mtp2, _ = model.with_mtp(changed[:, :-1], mtp_inputs(changed, 2))
  np.testing.assert_array_equal(mtp[:, 1, :cut + 1], mtp2[:, 1, :cut + 1])  # k=1: up to i + 2
  np.testing.assert_array_equal(mtp[:, 0, :cut + 2], mtp2[:, 0, :cut + 2])  # k=0: up to i + 1
  assert not np.allclose(mtp[:, 0, cut + 2:], mtp2[:, 0, cut + 2:])


def test_mtp_loss_against_numpy():
  from jmoe.train.loss import mtp_loss, target_masks
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 6, 11)).astype(np.float32)
  window = rng.integers(0, 11, size=(2, 7))
  expected = 0.0
  for k in range(3):
    nll = []
    for b in range(2):
      for i in range(6 - k - 1):
        row = logits[b, k, i].astype(np.float64)
        nll.append(np.log(np.exp(row).sum()) - row[window[b, i + k + 2]])
    expected += np.sum(nll) / (2 * (6 - k - 1))
  _, mask = target_masks(jnp.asarray(window), None, 3)
  count = jnp.sum(mask, axis=(0, 2))
  np.testing.assert_array_equal(count, [2 * (6 - k - 1) for k in range(3)])
  got = mtp_loss(jnp.asarray(logits), jnp.asarray(window), mask, count, weight=0.3)
  np.testing.assert_allclose(got, 0.3 * expected / 3, rtol=1e-5)
