"""FP8 GEMMs against float32 and against an exact emulation of the quantization in NumPy; delayed
scaling's state; per-expert blocks against the grouped GEMM; FP8 training against bf16."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jmoe.config import ConfigError
from jmoe.moe.experts import ExpertWeights, blocked_expert_ffn, expert_ffn, gated_activation
from jmoe.ops.fp8 import Fp8Dot, Fp8Recipe, fp8_dot
from jmoe.ops.fp8_grouped import batched_fp8, grouped_fp8
from jmoe.ops.grouped_gemm import GEMM_BACKENDS, batched_gemm

FP8_BACKENDS = {name: backend.fp8 for name, backend in GEMM_BACKENDS.items()
                if backend.fp8 and backend.portable}
from jmoe.train.loop import train
from helpers import barriers, opaque, sixteen_bit, tiny_config, weight_copies_grown

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def emulate(x, dtype, amax=None):
  """x rounded through `dtype` with the per-tensor scale amax / max(dtype), in float64."""
  x = np.asarray(x, np.float32)
  scale = np.float32(np.abs(x).max() if amax is None else amax) / np.float32(
      ml_dtypes.finfo(dtype).max)
  limit = np.float32(ml_dtypes.finfo(dtype).max)
  q = np.clip(x / scale, -limit, limit).astype(dtype).astype(np.float64)
  return q * np.float64(scale)


def data(*shapes, seed=0):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(k, s, jnp.float32) * (1 + i) for i, (k, s) in enumerate(zip(keys, shapes))]


# FP8's own rounding: E4M3 keeps 3 mantissa bits (relative step 2^-3), E5M2 2; over a dot product of
# K random terms the errors average out to a few percent of the result's norm. A bf16 GEMM would
# be ~0.3% off, a wrong scale (a factor of 2) 50% or more.
FWD_TOL, GRAD_TOL = 0.05, 0.12


@pytest.mark.parametrize("recipe", [Fp8Recipe(), Fp8Recipe(grad_format="e4m3")])
def test_dense_fp8_gemm_matches_an_emulation_and_float32(recipe):
  x, w, dy = data((6, 10, 64), (64, 4, 8), (6, 10, 4, 8))
  site = Fp8Dot(recipe)
  y, vjp = jax.vjp(lambda x, w: site(x, w, 1), x, w)
  dx, dw = vjp(dy)
  xe, we = emulate(x, E4M3), emulate(w, E4M3)
  dye = emulate(dy, E5M2 if recipe.grad_format == "e5m2" else E4M3)
  np.testing.assert_allclose(y, np.einsum("bsd,dhk->bshk", xe, we), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(dx, np.einsum("bshk,dhk->bsd", dye, we), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(dw, np.einsum("bsd,bshk->dhk", xe, dye), rtol=2e-5, atol=2e-5)
  # and against float32, within what FP8 rounding allows
  ref_y, ref_vjp = jax.vjp(lambda x, w: jnp.einsum("bsd,dhk->bshk", x, w), x, w)
  assert 1e-3 < rel(y, ref_y) < FWD_TOL
  for got, want in zip((dx, dw), ref_vjp(dy)):
    assert 1e-3 < rel(got, want) < GRAD_TOL


def test_dense_fp8_contracting_two_axes():
  x, w = data((3, 5, 4, 8), (4, 8, 16))
  y = Fp8Dot(Fp8Recipe())(x, w, 2)
  np.testing.assert_allclose(y, np.einsum("bsha,had->bsd", emulate(x, E4M3), emulate(w, E4M3)),
                             rtol=2e-5, atol=2e-5)


def test_delayed_scaling_uses_the_history_and_pushes_this_steps_amax():
  x, w, dy = data((32, 16), (16, 8), (32, 8))
  site = Fp8Dot(Fp8Recipe(delayed=True, history=4))
  # A fresh (all-zero) history scales by 1.
  y0 = site(x, w, 1)
  ones = lambda a, dtype: np.clip(np.asarray(a, np.float32), -448, 448).astype(dtype).astype(
      np.float64)
  np.testing.assert_allclose(y0, ones(x, E4M3) @ ones(w, E4M3), rtol=2e-5, atol=2e-5)
  # With amaxes recorded, the scale is the history's maximum, not the current amax.
  history = np.zeros((3, 4), np.float32)
  history[:, 2] = [3.0 * np.abs(x).max(), 0.5 * np.abs(w).max(), 7.0]
  y, vjp = jax.vjp(lambda x, w, h: fp8_dot(x, w, h, site.recipe, 1), x, w, jnp.asarray(history))
  np.testing.assert_allclose(
      y, emulate(x, E4M3, amax=history[0, 2]) @ emulate(w, E4M3, amax=history[1, 2]),
      rtol=2e-5, atol=2e-5)  # w saturates at half its amax: delayed scaling clips
  _, _, new_history = vjp(dy)
  np.testing.assert_allclose(new_history[:, 0], [np.abs(x).max(), np.abs(w).max(),
                                                 np.abs(dy).max()], rtol=1e-6)
  np.testing.assert_array_equal(new_history[:, 1:], history[:, :-1])


def reference_grouped(x, w, sizes):
  ends = np.cumsum(sizes)
  y = np.zeros((x.shape[0], w.shape[2]))
  for e, (start, end) in enumerate(zip(ends - sizes, ends)):
    y[start:end] = np.asarray(x[start:end], np.float64) @ np.asarray(w[e], np.float64)
  return y


@pytest.mark.parametrize("kernels", sorted(FP8_BACKENDS))
def test_grouped_fp8_gemm_against_float32_loop(kernels):
  sizes = np.array([5, 0, 9, 3, 7])  # an expert with no rows, and rows past the groups
  x, w, dy = data((30, 32), (5, 32, 24), (30, 24), seed=1)
  gemm = grouped_fp8(FP8_BACKENDS[kernels])
  y, vjp = jax.vjp(lambda x, w: gemm(x, w, jnp.asarray(sizes)), x, w)
  dx, dw = vjp(dy)
  rows = sizes.sum()
  ref_y, ref_vjp = jax.vjp(lambda x, w: GEMM_BACKENDS["ragged_dot"](x, w, jnp.asarray(sizes)), x, w)
  ref_dx, ref_dw = ref_vjp(dy)
  np.testing.assert_allclose(ref_y[:rows], reference_grouped(x, w, sizes)[:rows], rtol=1e-4,
                             atol=1e-4)
  assert 1e-3 < rel(y[:rows], ref_y[:rows]) < FWD_TOL
  assert 1e-3 < rel(dx[:rows], ref_dx[:rows]) < GRAD_TOL
  assert 1e-3 < rel(dw, ref_dw) < GRAD_TOL
  np.testing.assert_array_equal(y[rows:], 0)
  np.testing.assert_array_equal(dx[rows:], 0)
  np.testing.assert_array_equal(dw[1], 0)


def test_fp8_weight_gradient_scale_comes_from_the_gradients_row_amaxes():
  """The FP8 weight gradient quantizes dy with x's row scales folded in under one scale, taken
  from dy's row amaxes rather than from a pass over the folded values: exactly the folded
  values' amax (a positive scale keeps each row's largest entry the largest), so the gradient is
  bit for bit the one computed from amax(folded), on rows whose magnitudes span 10^-6 to 10^6."""
  from jmoe.ops.fp8 import E4M3 as Q4, E5M2 as Q5, amax, quantize, scale_for
  from jmoe.ops.rows import row_groups
  sizes = jnp.asarray([5, 0, 9, 3, 7])
  x, w, dy = data((30, 32), (5, 32, 24), (30, 24), seed=3)
  spread = 10.0 ** jax.random.uniform(jax.random.key(4), (30, 1), minval=-6, maxval=6)
  x, dy = (x * spread).astype(jnp.bfloat16), (dy / spread).astype(jnp.bfloat16)
  kernels = FP8_BACKENDS["ragged_dot"]
  _, vjp = jax.vjp(lambda x, w: grouped_fp8(kernels, "e5m2", "fp8")(x, w, sizes), x,
                   w.astype(jnp.bfloat16))
  _, dw = vjp(dy)
  scale_X1 = scale_for(amax(x, axis=1, keepdims=True), Q4)
  in_groups = (row_groups(sizes, 30) < 5)[:, None]
  folded = jnp.where(in_groups, dy, 0).astype(jnp.float32) * scale_X1
  scale = scale_for(amax(folded), Q5)
  want = kernels.contract(quantize(x, scale_X1, Q4), quantize(folded, scale, Q5), sizes)
  want = jnp.where((sizes > 0)[:, None, None], want.astype(jnp.float32) * scale, 0)
  np.testing.assert_array_equal(np.asarray(dw), np.asarray(want.astype(jnp.bfloat16)))


def test_batched_fp8_gemm_against_float32():
  x, w, dy = data((4, 16, 32), (4, 32, 24), (4, 16, 24), seed=2)
  y, vjp = jax.vjp(batched_fp8("e5m2"), x, w)
  ref_y, ref_vjp = jax.vjp(batched_gemm(None), x, w)
  assert 1e-3 < rel(y, ref_y) < FWD_TOL
  for got, want in zip(vjp(dy), ref_vjp(dy)):
    assert 1e-3 < rel(got, want) < GRAD_TOL


def test_batched_fp8_does_not_hold_the_weights_float8_copy_until_the_backward_pass():
  """The expert blocks' FP8 GEMM quantizes the weights again in the backward pass rather than
  keeping each layer's float8 copy: 4 more layers grew the temporaries by 4.1 such copies that
  way, by 0.1 now with bf16 parameters; with float32 ones, by less than the 16-bit GEMM's. The
  batched contraction stands in opaque, as cuBLAS reads its operands."""
  def contract(a, b, a_axis, b_axis, out_dtype):
    return jax.lax.dot_general(a, b, (((a_axis,), (b_axis,)), ((0,), (0,))),
                               preferred_element_type=out_dtype)

  blocks = batched_fp8(contract=opaque(contract))
  gemm = lambda x, w, sizes: blocks(x.reshape(len(sizes), -1, x.shape[1]), w).reshape(
      x.shape[0], -1)
  assert weight_copies_grown(gemm, more_layers=4) < 1
  assert (weight_copies_grown(gemm, more_layers=4, param_dtype=jnp.float32)
          < weight_copies_grown(opaque(sixteen_bit), more_layers=4, param_dtype=jnp.float32))


@pytest.mark.parametrize("capacity", [16, 32, 64])
def test_expert_blocks_compute_what_the_grouped_gemm_does(capacity):
  # capacity 16: most experts overflow their blocks; 64: every row fits
  sizes = jnp.asarray([20, 0, 33, 1, 17, 16])
  x, w_in, w_out, dy = data((100, 8), (6, 8, 2, 12), (6, 12, 8), (100, 8), seed=3)
  act = gated_activation(tiny_config().moe)
  grouped = GEMM_BACKENDS["ragged_dot"]

  def run(fn):
    return jax.vjp(lambda x, w_in, w_out: fn(x, ExpertWeights(w_in_ED2F=w_in, w_out_EFD=w_out)),
                   x, w_in, w_out)

  # under jit, as in the model: what the blocks close over is traced
  y, vjp = run(jax.jit(lambda x, ws: blocked_expert_ffn(x, sizes, ws, capacity,
                                                         batched_gemm(None), grouped, act)))
  ref_y, ref_vjp = run(lambda x, ws: expert_ffn(x, sizes, ws, grouped, act))
  for got, want in zip((y, *vjp(dy)), (ref_y, *ref_vjp(dy))):  # float32 rounding only
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_blackwell_formats_are_refused_with_a_plan():
  for fmt in ("mxfp8", "nvfp4"):
    with pytest.raises(ConfigError, match=f"precision.gemm={fmt} .*Blackwell.*docs/FP8.md"):
      tiny_config(precision=dict(gemm=fmt))
  with pytest.raises(ConfigError, match="fp8_recipe"):
    tiny_config(precision=dict(gemm="fp8", fp8_recipe="sometimes"))


def losses(workdir):
  return [json.loads(line)["loss"] for line in open(workdir / "metrics.jsonl")]


FP8_DELAYED = dict(params="float32", compute="bfloat16", gemm="fp8", fp8_recipe="delayed",
                   fp8_amax_history=4, fp8_dense=True)


def test_delayed_scaling_history_is_checkpointed_resumed_and_not_carried_by_load_params(tmp_path):
  whole = tiny_config(precision=FP8_DELAYED, train=dict(steps=4, log_every=1, warmup_steps=1),
                      checkpoint=dict(every=2, async_save=False))
  train(whole, tmp_path / "whole", progress=False, devices=jax.devices()[:2])
  shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
  train(whole, tmp_path / "resumed", progress=False, devices=jax.devices()[:2])  # from step 2
  np.testing.assert_allclose(losses(tmp_path / "resumed"), losses(tmp_path / "whole"), rtol=1e-6)
  # Resuming with empty histories would scale step 3 by 1: the losses would differ.
  from jmoe.checkpoint.manager import Checkpointer
  from jmoe.parallel import make_layout
  from jmoe.train.optimizer import make_optimizer
  from jmoe.train.state import state_spec
  spec = state_spec(whole, make_layout(whole.parallel, jax.devices()[:2]),
                    make_optimizer(whole.train, whole.precision.moments))
  from jmoe.train.start import saved_part
  state, _ = Checkpointer(tmp_path / "whole" / "checkpoints", 3, async_save=False).restore(
      4, saved_part(whole, spec.abstract), saved_part(whole, spec.shardings))
  histories = [np.asarray(v) for path, v in jax.tree_util.tree_leaves_with_path(state.rest)
               if "history_3Z" in jax.tree_util.keystr(path)]
  assert histories
  for h in histories:  # [layers..., 3, 4]: four steps recorded, the newest first
    assert np.all(h[..., :, :4] > 0), h
  # A new run started from this one's model (load_params) starts with empty histories; the source
  # need not have any (a bf16 run's model has none).
  from jmoe.train.loop import initial_state
  fresh = tiny_config(precision=FP8_DELAYED, train=dict(steps=4, warmup_steps=1),
                      checkpoint=dict(load_params=str(tmp_path / "whole")))
  checkpointer = Checkpointer(tmp_path / "fresh", 1, async_save=False)
  step, started, _ = initial_state(fresh, spec, checkpointer)
  checkpointer.close()
  assert step == 0
  for name in ("params", "rest"):  # (the kept weight amaxes, never saved: test_fp8_weight_amax)
    leaves = jax.tree_util.tree_leaves_with_path(getattr(state, name))
    assert leaves
    for path, restored in leaves:
      value = dict(jax.tree_util.tree_leaves_with_path(getattr(started, name)))[path]
      if "history_3Z" in jax.tree_util.keystr(path):
        assert not np.any(np.asarray(value))
      else:
        np.testing.assert_array_equal(value, restored)


def test_fp8_training_follows_bf16(tmp_path):
  """150 steps of the tiny model (the loss from about 5.6 to 2.7): the FP8 run's final loss
  (the routed experts in FP8, the default) within 2% of the bf16 run's (0.27% when measured;
  0.07% with every GEMM in FP8, before 2026-12-04)."""
  common = dict(train=dict(steps=150, log_every=10, lr=3e-3, warmup_steps=10),
                moe=dict(expert_blocks=1.25))
  base = dict(params="float32", compute="bfloat16")
  end = {}
  # (delayed scaling, run the same way for 300 steps once: 2.4827 against bf16's 2.4763; its
  # state and resume are tested above)
  for name, precision in [("bf16", {}), ("current", dict(gemm="fp8"))]:
    records = train(tiny_config(precision=dict(base, **precision), **common), tmp_path / name,
                    progress=False, devices=jax.devices()[:1])
    end[name] = np.mean([r["loss"] for r in records[-3:]])
    if name == "bf16":
      assert end[name] < records[0]["loss"] - 2.0  # it learned
  print("final losses", end)
  assert abs(end["current"] - end["bf16"]) < 0.02 * end["bf16"], end


EP4 = dict(dense=dict(data=1, fsdp=-1), expert=dict(expert=4, data=-1))


@pytest.mark.parametrize("dense", [False, True])
def test_fp8_on_an_expert_parallel_layout_and_fp8_dispatch(dense):
  """`dense`: the dense GEMMs' per-tensor scales too, under FSDP (an amax over the devices)."""
  from test_train import first_step
  fp8 = dict(params="float32", compute="bfloat16", gemm="fp8", fp8_dense=dense)
  moe = dict(dispatcher="alltoall", expert_blocks=1.25, first_k_dense=0)
  model = dict(num_layers=1)
  one, _ = first_step(tiny_config(model=model, precision=fp8, moe=moe), jax.devices()[:1])
  # Row and expert scales do not depend on the layout: the sharded step computes the same loss, up
  # to the bf16 rounding of sharded sums (FP8 itself moves this loss by ~1e-3).
  sharded, _ = first_step(tiny_config(model=model, precision=dict(fp8, fp8_dispatch=True), moe=moe,
                                      parallel=EP4), jax.devices())
  np.testing.assert_allclose(sharded["loss"], one["loss"], rtol=2e-4)
  np.testing.assert_allclose(sharded["grad_norm"], one["grad_norm"], rtol=1e-2)


@pytest.mark.parametrize("taken", [True, False])
def test_run_if_and_move_rows_differentiate_like_their_plain_forms(taken):
  from jmoe.ops.rows import move_rows, run_if
  x, w = data((6, 4), (4, 4), seed=5)
  source = jnp.asarray([4, 0, 6, 2])  # slot 2 empty (6 is out of range)
  inverse = jnp.asarray([1, 6, 3, 6, 0, 6])  # rows 1, 3, 5 go nowhere
  f = lambda x, w: jnp.tanh(move_rows(x, source, inverse) @ w)
  plain = lambda x, w: jnp.tanh(jnp.take(x, source, axis=0, mode="fill", fill_value=0) @ w)

  def loss(fn, x, w, pred):
    padded = lambda x, w, rows: jnp.pad(fn(x, w), ((0, 2), (0, 0)))
    return jnp.sum(run_if(pred, padded, x, w, (source, inverse)) ** 2)

  got = jax.jit(jax.value_and_grad(lambda x, w, pred: loss(f, x, w, pred), (0, 1)))(
      x, w, jnp.asarray(taken))  # the condition is traced, as in the model
  want = jax.value_and_grad(lambda x, w: jnp.sum(jnp.pad(plain(x, w), ((0, 2), (0, 0))) ** 2)
                            * taken, (0, 1))(x, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_fp8_exchange_moves_float8_rows_and_full_precision_gradients():
  """The all-gather dispatcher's exchange: E4M3 rows out, the bf16 gradient back through the
  transpose (a reduce-scatter)."""
  from jax.sharding import PartitionSpec as P
  from jmoe.ops.exchange import all_gather
  mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])
  x, dy = data((16, 32), (16, 32), seed=6)

  def moved(fp8):
    gather = jax.jit(jax.shard_map(lambda a: all_gather(("x",), fp8)(a), mesh=mesh,
                                   in_specs=P("x"), out_specs=P(), check_vma=False))
    return jax.vjp(gather, x)

  (y8, vjp8), (y, vjp) = moved(True), moved(False)
  np.testing.assert_array_equal(y, x)  # every device gathered every row
  rows = np.stack([emulate(r, E4M3) for r in np.asarray(x)])  # one scale per row
  np.testing.assert_allclose(y8, rows, rtol=1e-6, atol=1e-6)
  assert rel(y8, x) > 1e-3
  np.testing.assert_allclose(vjp8(dy)[0], vjp(dy)[0], rtol=1e-6)


def test_fp8_dense_false_leaves_the_dense_gemms_in_bf16():
  """precision.fp8_dense=false: no FP8 site in attention (its projections in bf16), the routed
  experts in FP8; the attention weights' gradients then stay far closer to float32 than with
  every GEMM in FP8 (measured on this model: 0.011 against 0.073 relative; bf16 0.007)."""
  from flax import nnx
  from helpers import build
  tokens = jax.random.randint(jax.random.key(0), (2, 65), 0, 256)

  def grads(**precision):
    model = build(tiny_config(precision=dict(params="float32", **precision)), seed=0)

    def loss(m):
      logits, _ = m(tokens[:, :-1])
      logp = jax.nn.log_softmax(logits.astype(jnp.float32))
      return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
    return model, nnx.grad(loss)(model)

  _, exact = grads(compute="float32")
  _, bf16 = grads(compute="bfloat16")
  experts_only, g_experts = grads(compute="bfloat16", gemm="fp8", fp8_dense=False)
  _, g_all = grads(compute="bfloat16", gemm="fp8", fp8_dense=True)
  assert experts_only.moe_blocks.attn.fp8_q is None and experts_only.moe_blocks.attn.fp8_o is None

  def error(g, part):
    a, b = nnx.state(g)["moe_blocks"][part], nnx.state(exact)["moe_blocks"][part]
    pairs = list(zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return np.sqrt(sum(np.sum((np.asarray(x, np.float64) - y) ** 2) for x, y in pairs)
                   / sum(np.sum(np.asarray(y, np.float64) ** 2) for _, y in pairs))
  print({name: (error(g, "attn"), error(g, "mlp"))
         for name, g in (("bf16", bf16), ("experts", g_experts), ("all", g_all))})
  assert error(g_experts, "mlp") > 1.5 * error(bf16, "mlp")  # the experts are in FP8
  assert error(g_experts, "attn") < 0.5 * error(g_all, "attn")


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
@pytest.mark.parametrize("devices, parallel", [
    (1, {}), (8, dict(dense=dict(data=2, fsdp=4), expert=dict(data=2, expert=4)))])
def test_tokens_quantized_before_dispatch_give_the_same_step(monkeypatch, recipe, devices,
                                                             parallel):
  """In FP8 the dispatchers that gather on the device quantize each token once and gather its
  copies in float8 (`Rows.quantized`), instead of the GEMM quantizing every copy: the same
  values, so the step is the same bit for bit (loss, gradient norm, new parameters), alone and
  under expert parallelism (the all-gather dispatcher, inside shard_map)."""
  from test_train import first_step
  import jmoe.moe.dispatch as dispatch
  from jmoe.moe.experts import ExpertCompute
  config = tiny_config(precision=dict(gemm="fp8", fp8_recipe=recipe), parallel=parallel,
                       moe=dict(expert_blocks=0))
  made = []
  real = dispatch.rows_by_local_expert

  def recording(*args, **kwargs):
    rows, s = real(*args, **kwargs)
    made.append(rows.quantized is not None)
    return rows, s

  monkeypatch.setattr(dispatch, "rows_by_local_expert", recording)
  before, p_before = first_step(config, jax.devices()[:devices])
  assert made and all(made)
  made.clear()
  monkeypatch.setattr(ExpertCompute, "quantize_rows", lambda self, weights: None)
  after, p_after = first_step(config, jax.devices()[:devices])
  assert made and not any(made)
  assert before["loss"] == after["loss"] and before["grad_norm"] == after["grad_norm"]
  for a, b in zip(jax.tree.leaves(p_before), jax.tree.leaves(p_after)):
    np.testing.assert_array_equal(a, b)


def barrier_operands(fn, *args) -> list[list[tuple]]:
  """The operand shapes of each optimization barrier in fn's program, sorted."""
  return [sorted(shape for shape, _ in b) for b in barriers(fn, *args)]


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_each_layers_fp8_copies_wait_for_its_own_rows_and_gradient(recipe):
  """What XLA must not move, held by optimization barriers: the forward's float8 weight copy
  waits for the call's row scales, so it is made when its layer runs; the backward's weight
  copy and x dequantized (for a 16-bit weight gradient) wait for dy. Untied, the step compiled
  for an H200 made two or three layers' forward copies in one kernel and held them, and
  computed every layer's dequantized x in the forward pass and held it until the backward:
  1.9 GiB more temporaries than the bf16 step on the Qwen3-30B-A3B bench, 0.4 GiB fewer with
  both tied (scripts/compile_for_gpu.py)."""
  from jmoe.ops.fp8_blockwise import blockwise_grouped
  sizes = jnp.asarray([5, 0, 9, 3, 7])
  x, w, dy = data((30, 256), (5, 256, 128), (30, 128), seed=1)
  if recipe == "current":
    gemm = grouped_fp8(FP8_BACKENDS["ragged_dot"], "e5m2", "bf16")
    scales = [(5, 1, 1), (30, 1)]  # the experts' weights, the rows
  else:
    gemm = blockwise_grouped(GEMM_BACKENDS["ragged_dot"].gemm)
    scales = [(5, 2, 1), (30, 2)]  # 128 x 128 weight tiles, 1 x 128 row tiles
  forward = barrier_operands(lambda x, w: gemm(x, w, sizes), x, w)
  assert sorted(scales) in forward
  step = barrier_operands(lambda x, w, dy: jax.vjp(lambda x, w: gemm(x, w, sizes), x, w)[1](dy),
                          x, w, dy)
  assert sorted(scales + [(30, 128)]) in step
