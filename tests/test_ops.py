"""Primitives of jmoe/ops against their plain forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmoe.ops.cross_entropy import linear_cross_entropy, num_chunks
from jmoe.train.loss import cross_entropy_sum
from helpers import barriers, recomputed_like


@pytest.mark.parametrize("chunks", [1, 4])
def test_linear_cross_entropy_is_the_loss_of_the_full_logits(chunks):
  keys = jax.random.split(jax.random.key(0), 4)
  h_BSD = jax.random.normal(keys[0], (3, 16, 8))
  w_DV = jax.random.normal(keys[1], (8, 40)) * 2
  targets_BS = jax.random.randint(keys[2], (3, 16), 0, 40)
  mask_BS = jax.random.bernoulli(keys[3], 0.7, (3, 16))
  ours = lambda h, w: linear_cross_entropy(h, w, targets_BS, mask_BS, chunks=chunks)
  plain = lambda h, w: cross_entropy_sum(jnp.einsum("bsd,dv->bsv", h, w), targets_BS, mask_BS)
  np.testing.assert_allclose(ours(h_BSD, w_DV), plain(h_BSD, w_DV), rtol=1e-6)
  for a, b in zip(jax.grad(ours, (0, 1))(h_BSD, w_DV), jax.grad(plain, (0, 1))(h_BSD, w_DV)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # Masked-out tokens get no gradient.
  dh = jax.grad(ours)(h_BSD, w_DV)
  assert np.all(np.asarray(dh)[~np.asarray(mask_BS)] == 0)


def test_the_head_gradient_is_made_where_its_float32_sums_end():
  """The head's gradient leaves the loss's backward pass through an optimization barrier, in
  the weight's dtype, tied to h's gradient (which the rest of the backward pass needs first):
  left to XLA, its sum and cast fused into the optimizer's update at the end of the step or ran
  there, and the [D, V] float32 sums were held through the whole backward pass (on the
  Qwen3-30B-A3B bench compiled for an H200: 0.9 GiB more at its peak)."""
  h_BSD = jnp.ones((2, 16, 8), jnp.bfloat16)
  w_DV = jnp.ones((8, 40), jnp.bfloat16)
  grad = lambda h, w: jax.grad(lambda h, w: linear_cross_entropy(
      h, w, jnp.zeros((2, 16), jnp.int32), chunks=4), (0, 1))(h, w)
  assert [((2, 16, 8), jnp.bfloat16), ((8, 40), jnp.bfloat16)] in barriers(grad, h_BSD, w_DV)


@pytest.mark.parametrize("splits", [(8, 1), (4, 2), (3, 1)])
def test_the_head_gradient_summed_over_devices_once_whatever_the_chunks(splits):
  """The batch split over 8 devices (or over 4 and the positions over 2): each device keeps its
  own partial sum of the head's gradient across the chunks, and the partials are summed once,
  so the bytes crossing devices do not grow with the chunks. The gradients are those of the
  whole logits on one device. (3, 1) does not divide the devices' split: still exact."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jmoe.memory.traffic import collective_traffic
  mesh = jax.make_mesh((4, 2), ("b", "s"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  batch_axes, seq_axes = (("b", "s"), None) if splits[1] == 1 else ("b", "s")
  keys = jax.random.split(jax.random.key(1), 4)
  h_BSD = jax.random.normal(keys[0], (24, 32, 16))
  w_DV = jax.random.normal(keys[1], (16, 256))
  targets_BS = jax.random.randint(keys[2], (24, 32), 0, 256)
  mask_BS = jax.random.bernoulli(keys[3], 0.8, (24, 32))
  specs = {"batch": batch_axes if splits != (3, 1) else None, "seq": seq_axes, "vocab": None}

  def place(x, axes):
    spec = P(*(specs.get(a) if a else None for a in axes))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

  def grads(chunks, splits):
    loss = lambda h, w: linear_cross_entropy(place(h, ("batch", "seq", None)), w, targets_BS,
                                             mask_BS, chunks=chunks, place=place, splits=splits)
    return jax.jit(jax.grad(loss, (0, 1)))

  plain = lambda h, w: cross_entropy_sum(jnp.einsum("bsd,dv->bsv", h, w), targets_BS, mask_BS)
  expected = jax.grad(plain, (0, 1))(h_BSD, w_DV)
  if splits == (3, 1):  # the batch's 24 rows in 3 parts, on one device: only the result counts
    for a, b in zip(grads(4, splits)(h_BSD, w_DV), expected):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    return
  reduced = []
  for chunks in (1, 4):
    step = grads(chunks, splits)
    for a, b in zip(step(h_BSD, w_DV), expected):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    traffic = collective_traffic(step.lower(h_BSD, w_DV).compile().as_text(), 8).every_step
    reduced.append(traffic["all-reduce"] + traffic["reduce-scatter"])
  head = 16 * 256 * 4
  assert reduced[0] == reduced[1] <= 2 * head * 7 / 8, reduced  # one all-reduce, at most


def test_the_head_gradient_crosses_the_devices_in_the_weights_dtype():
  """With bfloat16 weights the partial sums (float32 over the chunks on each device) are summed
  over the devices in bfloat16, as the other weights' gradients are: half the bytes of
  float32. The gradient is float32's up to bfloat16's rounding."""
  import pathlib
  import tempfile
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jmoe.memory.traffic import collective_traffic
  mesh = jax.make_mesh((8,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
  keys = jax.random.split(jax.random.key(2), 3)
  h_BSD = jax.random.normal(keys[0], (16, 32, 16)).astype(jnp.bfloat16)
  w_DV = jax.random.normal(keys[1], (16, 256)).astype(jnp.bfloat16)
  targets_BS = jax.random.randint(keys[2], (16, 32), 0, 256)

  def place(x, axes):
    spec = P(*("b" if a == "batch" else None for a in axes))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

  loss = lambda w: linear_cross_entropy(place(h_BSD, ("batch", None, None)), w, targets_BS,
                                        chunks=4, place=place, splits=(8, 1))
  step = jax.jit(jax.grad(loss))
  with tempfile.TemporaryDirectory() as directory:  # (XLA's CPU collectives run in float32)
    compiled = step.lower(w_DV).compile({"xla_dump_to": directory, "xla_dump_hlo_as_text": True,
                                         "xla_dump_hlo_pass_re": "spmd-partitioning"})
    partitioned = next(pathlib.Path(directory).glob("*after_spmd-partitioning*.txt")).read_text()
  traffic = collective_traffic(compiled.as_text(), 8, partitioned).every_step
  assert traffic["all-reduce"] + traffic["reduce-scatter"] <= 2 * 16 * 256 * 2 * 7 / 8, traffic
  plain = lambda w: cross_entropy_sum(jnp.einsum("bsd,dv->bsv", h_BSD.astype(jnp.float32), w),
                                      targets_BS)
  expected = jax.grad(plain)(w_DV.astype(jnp.float32))
  error = jnp.linalg.norm(step(w_DV).astype(jnp.float32) - expected) / jnp.linalg.norm(expected)
  assert error < 1e-2, error


def test_chunks_keep_the_logits_small():
  assert num_chunks(2, 4096, 151936) == 8  # [2, 512, V] float32: 0.6 GiB a chunk
  assert num_chunks(2, 64, 100) == 1
  assert num_chunks(8, 4096, 151936, devices=8) == 4  # [8, 1024, V] over 8 devices: 0.6 GiB each
  assert 4096 % num_chunks(3, 4096, 10**6) == 0


def test_packed_segments_describe_each_rows_documents():
  from jmoe.ops.attention_kernels import packed_segments
  segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0],
                          [1, 1, 1, 1, 1, 1, 1, 1],
                          [1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)
  lengths, offsets, documents = packed_segments(segments, 4)
  np.testing.assert_array_equal(lengths[:2], [[3, 2, 1, -1], [8, -1, -1, -1]])
  np.testing.assert_array_equal(offsets[:2], [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1]])
  np.testing.assert_array_equal(documents, [3, 1, 8])  # the last row has more than 4: masked


def _ragged_on_host(x_XD, w_EDF, sizes_E):
  """x . w[e] per group of rows, with numpy: a kernel JAX cannot batch."""
  y = np.zeros((x_XD.shape[0], w_EDF.shape[2]), np.float32)
  start = 0
  for e, n in enumerate(np.asarray(sizes_E)):
    y[start:start + n] = np.asarray(x_XD)[start:start + n] @ np.asarray(w_EDF)[e]
    start += n
  return y


def _host_kernel(x_XD, w_EDF, sizes_E):
  out = jax.ShapeDtypeStruct((x_XD.shape[0], w_EDF.shape[2]), jnp.float32)
  return jax.pure_callback(_ragged_on_host, out, x_XD, w_EDF, sizes_E)


@pytest.mark.parametrize("batch", [1, 3])
def test_one_call_per_batch_vmaps_a_kernel_without_a_batching_rule(batch):
  """The Mosaic grouped GEMMs cannot be vmapped (pipeline stages vmap their layers); wrapped,
  they run once per batch element. A host kernel stands in for them on CPU."""
  from jmoe.ops.mosaic_gemm import one_call_per_batch
  keys = jax.random.split(jax.random.key(0), 2)
  x_BXD = jax.random.normal(keys[0], (batch, 12, 4))
  w_EDF = jax.random.normal(keys[1], (3, 4, 5))
  sizes_BE = jnp.asarray([[4, 0, 6], [12, 0, 0], [1, 2, 3]][:batch], jnp.int32)
  with pytest.raises(NotImplementedError):
    jax.vmap(_host_kernel, in_axes=(0, None, 0))(x_BXD, w_EDF, sizes_BE)
  y_BXF = jax.jit(jax.vmap(one_call_per_batch(_host_kernel), in_axes=(0, None, 0)))(
      x_BXD, w_EDF, sizes_BE)
  for b in range(batch):
    np.testing.assert_allclose(y_BXF[b], _ragged_on_host(x_BXD[b], w_EDF, sizes_BE[b]),
                               rtol=1e-6, atol=1e-6)


def test_row_entries_take_their_gradient_without_a_scatter():
  """take_rows' gradient (each group's rows summed) equals the plain gather's, and is a GEMM, not
  a scatter-add (which serialises on GPUs when many rows share few groups)."""
  from jmoe.ops.rows import take_rows
  keys = jax.random.split(jax.random.key(0), 2)
  a_EF = jax.random.normal(keys[0], (5, 3, 4))
  group_X = jnp.asarray([0, 0, 1, 3, 3, 3, 4, 5, 5, 2, 0], jnp.int32)  # 5: no group
  dy_XF = jax.random.normal(keys[1], (11, 3, 4))
  plain = lambda a: jnp.take(a, group_X, axis=0, mode="fill", fill_value=0)
  np.testing.assert_array_equal(take_rows(a_EF, group_X), plain(a_EF))
  ours = jax.vjp(lambda a: take_rows(a, group_X), a_EF)[1](dy_XF)[0]
  np.testing.assert_allclose(ours, jax.vjp(plain, a_EF)[1](dy_XF)[0], rtol=1e-6, atol=1e-6)
  backward = str(jax.make_jaxpr(jax.grad(lambda a: jnp.sum(take_rows(a, group_X) * dy_XF)))(a_EF))
  assert "scatter" not in backward and "dot_general" in backward


@pytest.mark.parametrize("chunk,split", [(1, 1), (5, 1), (16, 1), (1024, 1), (1024, 2), (6, 4)])
@pytest.mark.parametrize("shape", [(3, 36), (36,), (2, 3, 12)])
def test_the_embedding_gradient_sums_repeated_tokens_as_the_plain_lookup_does(chunk, split, shape):
  """The summed scatter equals `take`'s gradient (float32) with most positions repeating a few
  tokens, chunks that do and do not divide the sequence (or its parts), tokens of any rank,
  negative ids read from the end and ids past the table dropped; the lookup itself is `take`."""
  from jmoe.ops.embedding import lookup, summed_scatter
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 6, shape).astype(np.int32).reshape(-1)
  ids[:5] = rng.integers(6, 50, 5)
  ids[7], ids[9] = 50, -1  # past the table: no gradient; -1: the last row
  ids = ids.reshape(shape)
  table = jnp.asarray(rng.standard_normal((50, 8)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((*shape, 8)), jnp.float32)
  plain = jax.vjp(lambda t: jnp.take(t, ids, axis=0), table)[1](g)[0]
  ours = summed_scatter(g, jnp.asarray(ids), 50, jnp.float32, chunk, split)
  np.testing.assert_allclose(ours, plain, rtol=1e-6, atol=1e-5)
  assert float(jnp.abs(plain[49]).max()) > 0
  bf16 = table.astype(jnp.bfloat16)
  np.testing.assert_array_equal(lookup(bf16, jnp.asarray(ids), chunk, split),
                                jnp.take(bf16, ids, axis=0))


def test_the_embedding_gradients_zeros_are_made_once_the_gradient_exists():
  """The table-sized zeros the embedding's scatter adds into come from a zero tied to the
  incoming gradient by an optimization barrier: as a plain constant, XLA made them at the start
  of the backward pass and held them to its end (the table's bytes: 1.4 GiB of the GPT-OSS-20B
  bench's peak, compiled for an H200)."""
  from jmoe.ops.embedding import lookup
  table = jnp.ones((50, 8), jnp.bfloat16)
  ids = jnp.zeros((2, 16), jnp.int32)
  grad = lambda t: jax.grad(lambda t: lookup(t, ids).astype(jnp.float32).sum())(t)
  assert [((), jnp.bfloat16), ((2, 16, 8), jnp.bfloat16)] in barriers(grad, table)


def test_the_embedding_gradient_of_a_16bit_table_is_summed_in_float32():
  """About 1,700 positions of one token into the model's bfloat16 embedding: each chunk's sum is
  taken in
  float32 and the few chunk sums added in bf16, a few roundings in all, where adding the rows one
  by one in bf16 (as a plain scatter-add into the table's dtype does) drifts far more."""
  from flax import nnx
  from jmoe.model.layers import Embed
  rng = np.random.default_rng(1)
  ids = np.zeros((2, 1000), np.int32)
  ids[:, ::7] = rng.integers(1, 30, ids[:, ::7].shape)
  g = rng.standard_normal((2, 1000, 16)).astype(np.float32) + 0.5
  exact = np.zeros((30, 16))
  np.add.at(exact, ids.reshape(-1), g.reshape(-1, 16).astype(np.float64))
  graphdef, state = nnx.split(Embed(30, 16, 0.02, param_dtype=jnp.bfloat16,
                                    dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
  grad = jax.jit(lambda s, g: jax.vjp(lambda s: nnx.merge(graphdef, s)(jnp.asarray(ids)),
                                      s)[1](g)[0])
  ours = np.asarray(grad(state, jnp.asarray(g, jnp.bfloat16))["table"][...], np.float64)
  # inputs rounded to bf16 (2^-9 each, averaging out), then the chunk sums added in bf16 (2
  # chunks of 1024 per row, 2 rows: three roundings of the running sum): a few bf16 ulps
  np.testing.assert_allclose(ours, exact, rtol=2e-2, atol=0.05)
  one_by_one = np.float32(0)
  for row in g.reshape(-1, 16)[ids.reshape(-1) == 0, 0]:
    one_by_one = np.float32(jnp.bfloat16(one_by_one + np.float32(jnp.bfloat16(row))))
  assert abs(one_by_one - exact[0, 0]) > 10 * abs(ours[0, 0] - exact[0, 0])


@pytest.mark.parametrize("table_split,chunk", [(None, 64), ("data", 64), (None, 1024)])
def test_the_embedding_gradient_stays_with_the_batch_split(table_split, chunk):
  """Under a batch split over 4 devices and the sequence over 2 (the table whole, or split by
  vocabulary as FSDP splits it; chunks shorter than a device's part of the sequence, or longer,
  cut to it) the lookup's gradient is the unsplit one's, and its compiled backward communicates
  as the plain lookup's does: the chunks stay where their tokens are (a first form, flattening
  them for the scatter, gathered the rows over the sequence's devices, as did a chunk longer than
  a device's part)."""
  import re
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jmoe.ops.embedding import lookup
  mesh = jax.make_mesh((4, 2), ("data", "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rng = np.random.default_rng(2)
  ids = jnp.asarray(rng.integers(0, 20, (8, 256)).astype(np.int32))
  table = jnp.asarray(rng.standard_normal((40, 64)), jnp.bfloat16)
  g = jnp.asarray(rng.standard_normal((8, 256, 64)), jnp.bfloat16)
  args = (jax.device_put(table, NamedSharding(mesh, P(table_split))),
          jax.device_put(ids, NamedSharding(mesh, P("data", "seq"))),
          jax.device_put(g, NamedSharding(mesh, P("data", "seq", None))))

  def collectives(take):
    grad = lambda t, i, g: jax.vjp(lambda t: take(t, i), t)[1](g)[0]
    compiled = jax.jit(grad, out_shardings=args[0].sharding).lower(*args).compile()
    ops = re.findall(r"= (\S+) (all-gather|all-to-all|collective-permute|all-reduce|"
                     r"reduce-scatter)\(", compiled.as_text())
    return compiled(*args), sorted(ops)

  ours, moved = collectives(lambda t, i: lookup(t, i, chunk, sequence_split=2))
  _, plain_moved = collectives(lambda t, i: jnp.take(t, i, axis=0))
  exact = jax.vjp(lambda t: jnp.take(t, ids, axis=0), table.astype(jnp.float32))[1](
      g.astype(jnp.float32))[0]
  np.testing.assert_allclose(np.asarray(ours, np.float32), exact, rtol=2e-2, atol=0.1)
  assert moved == plain_moved


def test_the_clamped_swiglu_keeps_only_gate_and_up_for_its_backward_pass():
  """GPT-OSS's gated activation is recomputed in its backward pass from gate and up, the only
  arrays it keeps (its steps' values and the clamps' masks were eight more arrays of that size:
  37 GiB a GPU of the GPT-OSS-20B 8-GPU plan, compiled for H200s); its values and gradients are
  those of the function as written, bit for bit, with values on both sides of the limits."""
  from jmoe.ops.activations import clamped_swiglu
  keys = jax.random.split(jax.random.key(0), 3)
  gate, up, dy = (8 * jax.random.normal(k, (16, 32), jnp.bfloat16) for k in keys)

  def written(gate, up):
    gate, up = jnp.minimum(gate, 7.0), jnp.clip(up, -7.0, 7.0)
    return gate * jax.nn.sigmoid(1.702 * gate) * (up + 1)

  assert recomputed_like(clamped_swiglu(7.0, 1.702), written, (gate, up), dy) == [
      "bf16[16,32] from the argument gate", "bf16[16,32] from the argument up"]
  assert bool(jnp.any(gate > 7)) and bool(jnp.any(jnp.abs(up) > 7))


def test_rms_norm_keeps_only_its_input_and_scale_for_its_backward_pass():
  """RMSNorm is recomputed in its backward pass from x and the scale, the only arrays it keeps
  (differentiated as written it kept x and x normalized in float32: 8.4 GiB a GPU of the
  GPT-OSS-20B 8-GPU plan, compiled for H200s); values and gradients bit for bit those of the
  norm as written."""
  from jmoe.model.layers import rms_norm
  keys = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(keys[0], (2, 8, 64), jnp.bfloat16)
  scale = 1 + 0.1 * jax.random.normal(keys[1], (64,), jnp.float32)
  dy = jax.random.normal(keys[2], (2, 8, 64), jnp.bfloat16)

  def written(x, scale):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (x32 * scale).astype(x.dtype)

  ours = lambda x, scale: rms_norm(x, scale, 1e-6)
  assert recomputed_like(ours, written, (x, scale), dy) == [
      "bf16[2,8,64] from the argument x", "f32[64] from the argument scale"]
