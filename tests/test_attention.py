"""Training attention (jmoe/ops/attention.py) against the plain softmax over every key, with the
sinks as one more key whose value is zero: outputs and every gradient, the sinks' own included."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import plain_attention as plain
from jmoe.ops import attention_kernels
from jmoe.ops.attention import attention, masked_attention


def inputs(seed=0, b=2, s=24, h=4, g=2, a=8, w=8):
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (b, s, h, a))
  k = jax.random.normal(keys[1], (b, s, g, a))
  v = jax.random.normal(keys[2], (b, s, g, w))
  sinks = jax.random.normal(keys[3], (h,))
  dout = jax.random.normal(keys[4], (b, s, h, w))
  return q, k, v, sinks, dout


SEGMENTS = jnp.asarray([[1] * 10 + [2] * 9 + [3] * 3 + [0] * 2,
                        [1] * 24], jnp.int32)


def compare(ours, reference, args, dout, rtol=2e-5):
  out, vjp = jax.vjp(ours, *args)
  out_ref, vjp_ref = jax.vjp(reference, *args)
  np.testing.assert_allclose(out, out_ref, rtol=rtol, atol=rtol)
  for got, want in zip(vjp(dout), vjp_ref(dout)):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("packed", [False, True])
def test_attention_equals_the_plain_softmax(sinks, window, packed):
  q, k, v, sink_H, dout = inputs()
  segments = SEGMENTS if packed else None
  mask = lambda o: o if segments is None else o * (segments > 0)[:, :, None, None]
  # Padding tokens belong to no document: zero outputs, no gradient (the sinks' included).
  ours = lambda q, k, v, s: attention(q, k, v, scale=0.3, kernel="xla", window=window,
                                      segment_ids=segments, sinks=s if sinks else None)
  ref = lambda q, k, v, s: mask(plain(q, k, v, s if sinks else None, scale=0.3, window=window,
                                      segments_BS=segments))
  compare(ours, ref, (q, k, v, sink_H), dout)


@pytest.mark.parametrize("window", [0, 5])
def test_blockwise_kernel_equals_the_plain_softmax(window):
  """The branch cuDNN's packed form falls back to (rows of more documents than it takes): XLA's
  kernel a block of queries at a time, the keys' gradients summed over the blocks."""
  q, k, v, _, dout = inputs()
  forward = functools.partial(attention_kernels.blockwise_forward, segment_ids_BS=SEGMENTS,
                              scale=0.3, window=window, block=8)
  backward = functools.partial(attention_kernels.blockwise_backward, segment_ids_BS=SEGMENTS,
                               scale=0.3, window=window, block=8)
  mask = lambda o: o * (SEGMENTS > 0)[:, :, None, None]
  out, lse = forward(q, k, v)
  want, vjp = jax.vjp(lambda q, k, v: mask(plain(q, k, v, None, scale=0.3, window=window,
                                                 segments_BS=SEGMENTS)), q, k, v)
  np.testing.assert_allclose(mask(out), want, rtol=2e-5, atol=2e-5)
  for got, ref in zip(backward(q, k, v, out, lse, mask(dout)), vjp(mask(dout))):
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def test_value_heads_may_be_narrower_than_query_heads():
  """Multi-head latent attention: queries and keys of 12 dims, values of 8, no padding."""
  q, k, v, _, dout = inputs(a=12, w=8)
  ours = lambda q, k, v: attention(q, k, v, scale=0.2, kernel="xla")
  ref = lambda q, k, v: plain(q, k, v, None, scale=0.2)
  compare(ours, ref, (q, k, v), dout)


def test_alternating_windows_chosen_by_a_traced_layer_index():
  """In a loop over layers the layer index is traced: even layers windowed, odd ones full."""
  q, k, v, sinks, dout = inputs()

  def layers(q, k, v, sinks, attend):
    def body(x, layer):
      return x, attend(q + x, k, v, sinks, layer % 2 == 0)
    return jax.lax.scan(body, jnp.zeros(()), jnp.arange(2))[1]  # [2, B, S, H, W]

  ours = functools.partial(layers, attend=lambda q, k, v, s, w: attention(
      q, k, v, scale=0.3, kernel="xla", window=3, windowed=w, sinks=s))
  ref = functools.partial(layers, attend=lambda q, k, v, s, w: jax.lax.cond(
      w, lambda: plain(q, k, v, s, scale=0.3, window=3), lambda: plain(q, k, v, s, scale=0.3)))
  compare(ours, ref, (q, k, v, sinks), jnp.stack([dout, 2 * dout]))
  out = ours(q, k, v, sinks)
  assert not np.allclose(out[0], out[1])  # the two layers did attend differently


def test_a_refused_case_runs_through_xla():
  """cuDNN's kernels refuse float32 (and everything off GPUs): `cudnn` then gives XLA's result."""
  q, k, v, sinks, _ = inputs()
  assert attention_kernels.CUDNN.refusal(q, k, v, None, 0) is not None
  np.testing.assert_array_equal(attention(q, k, v, scale=0.3, kernel="cudnn", sinks=sinks),
                                attention(q, k, v, scale=0.3, kernel="xla", sinks=sinks))


def test_masked_attention_is_the_plain_softmax():
  q, k, v, sinks, _ = inputs()
  pos = jnp.arange(24)
  allowed = ((pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 4))[None, None]
  np.testing.assert_allclose(
      masked_attention(q, k, v, jnp.broadcast_to(allowed, (2, 1, 24, 24)), scale=0.3,
                       sinks=sinks),
      plain(q, k, v, sinks, scale=0.3, window=4), rtol=2e-5, atol=2e-5)


def test_packed_statistics_index_follows_the_documents_of_every_row():
  """cuDNN's packed statistics hold the documents of all rows one after another, each from its
  own start: the index of every token there, against a loop over the rows."""
  segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0],
                          [1, 1, 1, 1, 1, 1, 1, 1],
                          [4, 4, 7, 7, 7, 7, 9, 0]], jnp.int32)
  _, offsets, documents = attention_kernels.packed_segments(segments, 4)
  document, within = attention_kernels._statistics_index(segments, offsets, documents)
  expected_document, expected_within, before = [], [], 0
  for row in np.asarray(segments):
    d, w, count, start = [], [], -1, 0
    for i, seg in enumerate(row):
      if seg > 0 and (i == 0 or row[i - 1] != seg):
        count, start = count + 1, i
      d.append(before + count if seg > 0 else 3 * 4)  # past the 3 rows x 4 documents
      w.append(i - start if seg > 0 else 0)
    before += count + 1
    expected_document.append(d)
    expected_within.append(w)
  np.testing.assert_array_equal(document, expected_document)
  np.testing.assert_array_equal(within, expected_within)


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_packed_rows_go_to_cudnn_one_per_device_at_a_time(shards):
  """`_by_rows` runs a kernel on one row of each of the `shards` blocks of the batch at a time
  (under a layout that splits the batch over `shards` devices: one row per device), and puts the
  results back in order: each row here gets the ids of the rows it was called with."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  rows_B = jnp.arange(8, dtype=jnp.int32)
  x_BS = jnp.broadcast_to(rows_B[:, None], (8, 3)).astype(jnp.float32)
  mesh = Mesh(np.asarray(jax.devices()).reshape(shards, 8 // shards), ("batch", "rest"))
  x_BS = jax.device_put(x_BS, NamedSharding(mesh, PartitionSpec("batch")))

  def kernel(ids_B, x_BS):  # per call: its rows' ids, and the rows' values doubled
    return jnp.broadcast_to(ids_B[None], (ids_B.shape[0],) * 2), 2 * x_BS

  called, doubled = jax.jit(lambda i, x: attention_kernels._by_rows(kernel, shards, i, x))(
      rows_B, x_BS)
  blocks = np.arange(8).reshape(shards, 8 // shards)
  want = np.stack([blocks[:, r % (8 // shards)] for r in range(8)])
  np.testing.assert_array_equal(called, want if shards < 8 else np.tile(np.arange(8), (8, 1)))
  np.testing.assert_array_equal(doubled, 2 * np.asarray(x_BS))
  # Each device works on its own rows: nothing moves between devices.
  hlo = jax.jit(lambda x: attention_kernels._by_rows(lambda x: 2 * x, shards, x)).lower(
      x_BS).compile().as_text()
  assert not any(c in hlo for c in ("all-gather", "all-to-all", "collective-permute",
                                     "all-reduce")), hlo


def test_values_padded_to_the_keys_width_under_vmap_change_nothing(monkeypatch):
  """Under the stages' vmap, values narrower than the keys go to a fused kernel padded with zeros
  to the keys' width (JAX's batching rule for cuDNN takes them equal) and the output is cut
  back: output and every gradient equal the unpadded call's, and the kernel saw the padding."""
  from jmoe.ops import attention as attention_module
  widths = []

  def forward(q, k, v, *args, **kw):
    widths.append(v.shape[-1])
    return attention_kernels.xla_forward(q, k, v, *args, **kw)

  fused = attention_kernels.AttentionKernel(forward, attention_kernels.xla_backward)
  monkeypatch.setitem(attention_module.ATTENTION_KERNELS, "cudnn", fused)
  q, k, v, sinks, dout = inputs(a=12, w=8)
  stack = lambda x: jnp.stack([x, 2 * x])  # two "stages"

  def loss(q, k, v, sinks, vmapped):
    run = lambda q, k, v: attention(q, k, v, scale=0.3, kernel="cudnn", sinks=sinks,
                                    segment_ids=SEGMENTS, vmapped=vmapped)
    out = jax.vmap(run)(q, k, v)
    return jnp.sum(out * stack(dout)), out

  grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
  (padded, out_padded), (plain_, out_plain) = [
      grad(stack(q), stack(k), stack(v), sinks, vmapped) for vmapped in (True, False)]
  assert 12 in widths and 8 in widths
  assert out_padded.shape == out_plain.shape == (2, *dout.shape)
  np.testing.assert_allclose(out_padded, out_plain, rtol=1e-6, atol=1e-6)
  for ours, want in zip(padded, plain_):
    assert ours.shape == want.shape
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("known", [None, 2, 3, 1])
def test_rows_known_to_fit_take_the_packed_kernel_with_no_branch_on_the_device(monkeypatch, known):
  """cuDNN's packed kernels (faked here by XLA's, counting their calls) branch on the device
  between themselves and the blockwise kernel by the rows' documents, unless the rows are known
  (`documents_per_row`, counted on the host) to hold at most the kernel's max_documents: then the
  program has no conditional (XLA's GPU runtime waits for the device at each one). SEGMENTS'
  rows hold 3 and 1 documents; a bound above max_documents keeps the branch. Forward and
  backward give the same as the branching program's, which takes the packed kernel (3 <= 3) or
  the blockwise one (max_documents 2 < 3)."""
  calls = []

  def fused_forward(q, k, v, ids, *, scale, window, max_documents):
    calls.append("forward")
    return attention_kernels.xla_forward(q, k, v, ids, scale=scale, window=window)

  def fused_backward(*args, scale, window, max_documents):
    calls.append("backward")
    return attention_kernels.xla_backward(*args, scale=scale, window=window)

  monkeypatch.setattr(attention_kernels, "_fused_forward", fused_forward)
  monkeypatch.setattr(attention_kernels, "_fused_backward", fused_backward)
  q, k, v, _, dout = inputs()

  @functools.partial(jax.jit, static_argnums=0)
  def run(max_documents, q, k, v, dout, segments):
    options = dict(scale=0.3, window=0, max_documents=max_documents)
    out, lse = attention_kernels._cudnn_forward(q, k, v, segments, **options)
    grads = attention_kernels._cudnn_backward(q, k, v, out, lse, dout, segments, **options)
    return out, lse, grads

  args = (q, k, v, dout, SEGMENTS)
  for max_documents in (3, 2):
    want = run(max_documents, *args)
    calls.clear()
    # (the same jitted function: the bound is part of JAX's cache keys, so it is traced again)
    with attention_kernels.documents_per_row(known):
      lowered = run.lower(max_documents, *args)
    fits = known is not None and known <= max_documents
    # (in the program as lowered: XLA's CPU compiler turns these branches into selects)
    assert ("stablehlo.case" in lowered.as_text()) == (not fits)
    compiled = lowered.compile()
    # Traced again under a bound, and not without one (the trace above is reused).
    assert set(calls) == ({"forward", "backward"} if known is not None else set())
    for got, expected in zip(jax.tree.leaves(compiled(*args)), jax.tree.leaves(want)):
      np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
