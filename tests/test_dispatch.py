"""The all-to-all dispatcher against the single-device MoE stages: outputs and gradients for every
expert-parallel size and routings from balanced to every copy on one expert (its later rounds),
with expert-tensor parallelism, float8 rows, chunks, per-expert blocks; and what it sends."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmoe.config import DenseLayout, ExpertLayout, MoEConfig, ParallelConfig
from jmoe.moe.alltoall import AllToAllDispatcher
from jmoe.moe.dispatch import LocalDispatcher, on_expert_shards
from jmoe.moe.experts import ExpertCompute, ExpertWeights
from jmoe.moe.layer import moe_stages
from jmoe.ops.fp8 import E4M3, amax, quantize, scale_for
from jmoe.parallel import make_layout

T, D, E, K, F = 128, 32, 8, 2, 16  # T: all tokens, 16 per device on 8 devices
KEYS = jax.random.split(jax.random.key(0), 6)


def expert_weights(bias=False):
  w = ExpertWeights(w_in_ED2F=jax.random.normal(KEYS[1], (E, D, 2, F)) * 0.2,
                    w_out_EFD=jax.random.normal(KEYS[2], (E, F, D)) * 0.2)
  if bias:
    w = w.replace(b_in_E2F=jax.random.normal(KEYS[4], (E, 2, F)) * 0.1,
                  b_out_ED=jax.random.normal(KEYS[5], (E, D)) * 0.1)
  return w


def expert_ids(routing: str) -> jax.Array:
  if routing == "balanced":  # each device sends each peer the same number of copies
    return ((jnp.arange(T)[:, None] * K + jnp.arange(K)) % E).astype(jnp.int32)
  if routing == "one expert":  # every copy of every token to expert 0
    return jnp.zeros((T, K), jnp.int32)
  probs = jnp.array([0.5, 0.2, 0.1, 0.05, 0.05, 0.04, 0.03, 0.03])  # skewed
  return jax.random.choice(KEYS[4], E, (T, K), p=probs).astype(jnp.int32)


def layout_for(ep: int, etp: int = 1):
  return make_layout(ParallelConfig(DenseLayout(data=8),
                                    ExpertLayout(data=8 // (ep * etp), expert=ep, tensor=etp)))


def fp8_rows(x_TD):
  """The rows as the float8 exchange delivers them (one scale per row); gradients pass as is."""
  scales = scale_for(amax(x_TD, axis=1, keepdims=True), E4M3)
  q = quantize(x_TD, scales, E4M3).astype(jnp.float32) * scales
  return x_TD + jax.lax.stop_gradient(q - x_TD)


def run(layout, routing, *, factor=1.25, chunks=1, fp8=False, blocks=0.0, bias=False):
  """Loss, overflow rounds and gradients (in the tokens, routing weights, expert weights) of the
  MoE stages on `layout` with the all-to-all dispatcher, or on one device (`layout` None)."""
  cfg = MoEConfig(num_experts=E, top_k=K, d_ff_expert=F, gemm="ragged_dot", expert_blocks=blocks)
  compute = ExpertCompute.from_config(cfg)
  x = jax.random.normal(KEYS[0], (T, D))
  weights = jax.nn.softmax(jax.random.normal(KEYS[3], (T, K)), -1)
  ids = expert_ids(routing)
  if layout is None:
    make = lambda axes, n: LocalDispatcher(axes, n)
  else:
    make = lambda axes, n: AllToAllDispatcher(axes, n, fp8=fp8, dispatch_factor=factor)
  stages = moe_stages(make, compute, chunks)

  def loss(x, weights, w):
    if fp8 and layout is None:
      x = fp8_rows(x)
    y, _, rounds = on_expert_shards(layout, stages, x, ids, weights, w)
    return jnp.sum(y * jnp.cos(jnp.arange(D))), rounds

  with layout.active() if layout else contextlib.nullcontext():
    (value, rounds), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
        x, weights, expert_weights(bias))
  return value, int(rounds), grads


def assert_same(got, want, rtol=1e-5):
  np.testing.assert_allclose(got[0], want[0], rtol=rtol)
  for g, r in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
    np.testing.assert_allclose(g, r, rtol=rtol, atol=rtol * float(np.max(np.abs(r))))


@pytest.fixture(scope="module")
def reference():
  return {routing: run(None, routing) for routing in ("balanced", "skewed", "one expert")}


# Rounds after the first: 16 devices' tokens x 2 copies = 32 copies per device, in blocks of
# ceil(1.25 x 32 / EP) rows per peer.
@pytest.mark.parametrize("ep, routing, rounds", [
    (2, "balanced", 0), (2, "skewed", 1), (2, "one expert", 1),
    (4, "balanced", 0), (4, "skewed", 2), (4, "one expert", 3),
    (8, "balanced", 0), (8, "skewed", 4), (8, "one expert", 6)])
def test_alltoall_matches_one_device(ep, routing, rounds, reference):
  got = run(layout_for(ep), routing)
  assert got[1] == rounds
  assert_same(got, reference[routing])


def test_a_factor_of_ep_carries_everything_in_one_round(reference):
  got = run(layout_for(8), "one expert", factor=8)  # the worst case's buffers
  assert got[1] == 0
  assert_same(got, reference["one expert"])


@pytest.mark.parametrize("routing", ["skewed", "one expert"])
def test_alltoall_with_expert_tensor_parallelism(routing, reference):
  got = run(layout_for(4, etp=2), routing)
  assert got[1] > 0
  assert_same(got, reference[routing])


def test_alltoall_with_expert_biases_and_blocks():
  want = run(None, "skewed", blocks=1.25, bias=True)
  got = run(layout_for(4, etp=2), "skewed", blocks=1.25, bias=True)
  assert got[1] > 0
  assert_same(got, want)


def test_chunks_compute_what_one_piece_does(reference):
  got = run(layout_for(8), "skewed", chunks=4)
  assert got[1] > 0  # summed over the chunks
  assert_same(got, reference["skewed"])


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_fp8_rows_in_every_round(routing):
  """Float8 rows out in the first and the later rounds, full-precision gradients back: the same
  as one device computing on the float8-rounded rows."""
  got = run(layout_for(8), routing, fp8=True)
  assert (got[1] > 0) == (routing == "skewed")
  assert_same(got, run(None, routing, fp8=True))


@pytest.mark.parametrize("expert", [dict(data=-1), dict(data=-1, tensor=2)])
def test_without_expert_parallelism_both_dispatchers_are_one_program(expert):
  """With no expert axes (one GPU; or expert-tensor parallelism only) `alltoall` is the
  all-gather path: the same train step, so no slower."""
  from helpers import tiny_config
  from jmoe.train.optimizer import learning_rate, make_optimizer
  from jmoe.train.state import state_spec
  from jmoe.train.step import make_train_step

  def program(dispatcher):
    config = tiny_config(moe=dict(dispatcher=dispatcher),
                         parallel=dict(dense=dict(data=-1), expert=expert))
    layout = make_layout(config.parallel, jax.devices()[:2])
    optimizer = make_optimizer(config.train, config.precision.moments)
    spec = state_spec(config, layout, optimizer)
    step = make_train_step(spec.graphdef, config, optimizer, learning_rate(config.train))
    batch = {"tokens": jax.ShapeDtypeStruct((8, 33), jnp.int32)}
    with layout.active():
      return jax.jit(step).lower(spec.abstract, batch).as_text()

  allgather, alltoall = program("allgather"), program("alltoall")
  assert "all_to_all" not in alltoall and alltoall == allgather


def test_the_later_rounds_gradient_sums_start_and_end_in_their_own_layer():
  """The float32 sums of the later rounds' gradients start from a zero tied to the incoming
  gradient and are cast back inside the backward pass, each through an optimization barrier:
  from a plain constant, XLA made every layer's zeros in one kernel early in the backward pass
  and held them all (9 GiB of the Qwen3-30B-A3B EP-2 bench's 48, compiled for H200s:
  scripts/compile_for_gpu.py). The sums are still the rounds' (sum over r of r x w . x)."""
  from jmoe.moe.alltoall import late_rows
  from helpers import barriers
  x = jnp.ones((4, 8), jnp.bfloat16)
  w = jnp.full((8, 8), 0.5, jnp.bfloat16)
  one_round = lambda x, w, constant, r: (x @ w) * r.astype(x.dtype)
  loss = lambda x, w: late_rows(one_round, x, w, jnp.zeros((), jnp.int32),
                                jnp.asarray(3)).astype(jnp.float32).sum()
  grad = jax.grad(loss, (0, 1))
  found = barriers(grad, x, w)
  assert [((), jnp.float32), ((4, 8), jnp.bfloat16)] in found
  assert [((4, 8), jnp.bfloat16), ((8, 8), jnp.bfloat16)] in found
  dx, dw = grad(x, w)
  np.testing.assert_allclose(np.asarray(dw, np.float32), 6 * np.ones((8, 8)) * 4, rtol=1e-2)
  np.testing.assert_allclose(np.asarray(dx, np.float32), 6 * np.full((4, 8), 4.0), rtol=1e-2)
