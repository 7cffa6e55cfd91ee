"""The per-device memory estimate (jmoe/memory/, scripts/estimate_memory.py): against XLA's
compiled figure on CPU layouts, and its rules on small functions whose memory is known."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flags import xla_flags
from helpers import merge, tiny_config
from jmoe.memory import compiled_bytes, estimate, function_peak
from jmoe.memory.gpu import LIKE_FUSED_ATTENTION, gpu_kernels_replaced
from jmoe.parallel import make_layout
from jmoe.train.optimizer import make_optimizer
from jmoe.train.state import state_spec
from jmoe.train.step import compile_train_step

ROOT = pathlib.Path(__file__).parents[1]
# Proportions of a real layer (wide GEMMs, short sequences) at a size CPUs compile quickly.
BASE = dict(model=dict(d_model=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                       d_ff=1024),
            moe=dict(d_ff_expert=256), train=dict(batch_size=64), data=dict(seq_len=64))
LAYOUTS = {
    "data 8": {},
    "fsdp 8": dict(parallel=dict(dense=dict(data=1, fsdp=8))),
    "data 4 x tensor 2": dict(parallel=dict(dense=dict(data=4, tensor=2))),
    "data 4 x context 2": dict(parallel=dict(dense=dict(data=4, context=2))),
    "expert 8, all-to-all": dict(parallel=dict(expert=dict(data=1, expert=8)),
                                 moe=dict(dispatcher="alltoall")),
    "4 micro-batches": dict(train=dict(micro_batch_size=16)),
    # 4 MoE layers in 2 stages, 4 micro-batches through them
    "pipeline 2 x expert 4": dict(parallel=dict(pipeline=2, dense=dict(data=4),
                                                expert=dict(data=1, expert=4),
                                                pipeline_schedule="gpipe"),
                                  moe=dict(dispatcher="alltoall"), model=dict(num_layers=5),
                                  train=dict(micro_batch_size=16)),
}
MIB = 2**20


def config(**overrides):
  return tiny_config(**merge(BASE, overrides))


# Known gap (docs/MEMORY.md): with stages the estimate is 12% under XLA's CPU allocation (153.1
# against 174.7 MiB) while XLA's heap holds ~27% more than its live peak; on 8 mocked H200s the
# same model in bf16 was within 9%. Strict: the case fails the day it passes, to move it back.
KNOWN_GAPS = {"pipeline 2 x expert 4": "stages on CPU: XLA allocates 27% over its live peak"}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[name]))
    if name in KNOWN_GAPS else name for name in LAYOUTS])
def test_estimate_is_within_ten_percent_of_xla(name):
  cfg = config(**LAYOUTS[name])
  layout = make_layout(cfg.parallel)
  estimated = estimate(cfg, layout, platform="cpu").total
  compiled = compiled_bytes(cfg, layout)
  print(f"{name}: estimate {estimated / MIB:.1f} MiB, XLA {compiled / MIB:.1f} MiB, "
        f"{estimated / compiled - 1:+.1%}")
  assert abs(estimated / compiled - 1) < 0.10


def test_state_and_batch_are_exact():
  """Parameters, optimizer state and batch are placed by their shardings: they are XLA's
  argument bytes to the byte."""
  cfg = config(parallel=dict(dense=dict(data=1, fsdp=8), expert=dict(data=2, expert=4)))
  layout = make_layout(cfg.parallel)
  optimizer = make_optimizer(cfg.train, cfg.precision.moments)
  spec = state_spec(cfg, layout, optimizer)
  batch = {"tokens": jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.data.seq_len + 1), np.int32)}
  compiled = compile_train_step(cfg, layout, spec, optimizer, batch)
  c = estimate(cfg, layout, platform="cpu").by_category
  assert (c["parameters"] + c["optimizer state"] + c["batch"]
          == compiled.memory_analysis().argument_size_in_bytes)


def test_offloaded_activations_are_host_memory():
  import jmoe
  cfg = config(train=dict(remat="offload_attention_moe"))
  est = jmoe.estimate_memory(cfg, platform="cpu")  # the notebook's way: the same estimate
  m = cfg.model
  tokens = cfg.train.batch_size * cfg.data.seq_len // 8  # per device
  attention_out = m.num_layers * tokens * m.num_heads * m.head_dim * 4
  moe_input = (m.num_layers - cfg.moe.first_k_dense) * tokens * m.d_model * 4
  assert est.host == attention_out + moe_input
  kept = estimate(config(train=dict(remat="attention_moe")), make_layout(cfg.parallel),
                  platform="cpu")
  assert kept.host == 0


def test_walk_rules():
  x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)  # 4 MiB
  # Elementwise chains fuse into their reduction: nothing but the scalar is stored.
  assert function_peak(lambda x: jnp.sum(jnp.exp(jnp.exp(x) + 1)), x) == 4
  # A product's result is stored, and lives until its last use.
  assert function_peak(lambda x: jnp.sum((x @ x) @ x), x) == 8 * MIB
  assert function_peak(lambda x: jnp.sum(x @ x) + jnp.sum(x + 1), x) == 4 * MIB + 4
  # A loop's stacked outputs exist from its start; each step writes its slice in place.
  stacked = lambda x: jax.lax.scan(lambda c, _: (c, c @ c), x, None, length=4)[1]
  assert function_peak(stacked, x) == 4 * 4 * MIB
  # A function called inside is inlined: its elementwise result fuses into the caller's sum.
  inner = jax.jit(lambda x: jnp.exp(x) * 2)
  assert function_peak(lambda x: jnp.sum(inner(x)), x) == 4



def test_walk_places_values_with_what_they_go_with():
  """What pipeline stages make on 8 devices (2 stages x FSDP 4): a per-stage mask broadcast to
  a micro-batch's shape, a hand-off between stages (a shard_map manual over the stage axis
  only) and a buffer of micro-batches written into are split as the micro-batch is, over all 8
  devices, not only over the stages as their operands or specs alone would say (227 of the
  316 GiB first estimated for configs/plans/deepseek_v3_256gpu.py, docs/MEMORY.md)."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jmoe.memory.flat import flatten
  from jmoe.memory.liveness import Value
  from jmoe.memory.walk import Walker
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("stage", "fsdp"))
  pin = lambda a, *spec: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))

  def stages(x_SBD, on_S, buf_SMBD):
    x_SBD, on_S, buf_SMBD = pin(x_SBD, "stage", "fsdp"), pin(on_S, "stage"), pin(buf_SMBD, "stage")
    mask_SBD = jnp.broadcast_to(on_S[:, None, None], x_SBD.shape)
    handed_SBD = jax.shard_map(lambda b: jax.lax.ppermute(b, "stage", [(0, 1)]), mesh=mesh,
                               in_specs=P("stage"), out_specs=P("stage"),
                               axis_names={"stage"})(x_SBD)
    return mask_SBD, handed_SBD, buf_SMBD.at[:, 1].set(x_SBD), x_SBD * 2

  args = (jax.ShapeDtypeStruct((2, 8, 64), jnp.float32), jax.ShapeDtypeStruct((2,), bool),
          jax.ShapeDtypeStruct((2, 4, 8, 64), jnp.float32))
  jaxpr = flatten(jax.make_jaxpr(stages)(*args).jaxpr)
  env = {v: Value(0, 1, "batch") for v in jaxpr.invars}
  outs = Walker(dict(mesh.shape), {}, "gpu").walk(jaxpr, env).outs
  assert [value.d for value in outs] == [8, 8, 8, 8]
  assert [value.bytes for value in outs] == [2 * 8 * 64 // 8, 2 * 8 * 64 * 4 // 8,
                                             2 * 4 * 8 * 64 * 4 // 8, 2 * 8 * 64 * 4 // 8]

def test_fused_attention_stand_in_is_attention():
  """What GPU estimates trace for cuDNN's kernel is XLA's attention kernel, value for value and
  gradient for gradient (tests/test_attention.py holds that kernel to the plain softmax)."""
  from jmoe.ops import attention as attention_ops
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (2, 16, 4, 8)) for key in keys)
  xla = lambda q, k, v: attention_ops.attention(q, k, v, scale=8 ** -0.5, kernel="xla")

  def fused(q, k, v):
    with gpu_kernels_replaced():
      return attention_ops.attention(q, k, v, scale=8 ** -0.5, kernel="cudnn")

  assert attention_ops.ATTENTION_KERNELS["cudnn"] is not LIKE_FUSED_ATTENTION  # put back
  np.testing.assert_array_equal(fused(q, k, v), xla(q, k, v))
  loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
  grads = (jax.grad(loss(f), (0, 1, 2))(q, k, v) for f in (fused, xla))
  for a, b in zip(*grads):
    np.testing.assert_array_equal(a, b)
  # Walked, attention's forward and backward hold [B, H, S, S] scores while they run on CPUs,
  # and none on GPUs, where the scores are the fused kernel's own.
  q = jax.ShapeDtypeStruct((2, 320, 4, 8), jnp.bfloat16)
  scores = 2 * 4 * 320 * 320 * 4

  def step(kernel):
    return lambda q: jax.grad(lambda q: jnp.sum(attention_ops.attention(
        q, q, q, scale=0.3, kernel=kernel).astype(jnp.float32)))(q)

  assert function_peak(step("xla"), q, platform="cpu") >= 2 * scores
  with gpu_kernels_replaced():
    assert function_peak(step("cudnn"), q, platform="gpu") < scores / 4


def test_script_compares_with_xla(capsys):
  """The script on the model whose CPU accuracy docs/MEMORY.md tabulates (tiny_moe widened to a
  real layer's proportions, as BASE above). At tiny_moe's own widths (128) the CPU backend's
  dense expansion of each ragged dot, which GPUs do not make, is a large part of the step and
  the estimate is 12% low there (docs/MEMORY.md)."""
  sys.path.insert(0, str(ROOT / "scripts"))
  import estimate_memory
  widths = ["--config.model.d_model=256", "--config.model.head_dim=32",
            "--config.model.d_ff=1024", "--config.moe.d_ff_expert=256",
            "--config.train.batch_size=64", "--config.data.seq_len=64"]
  assert estimate_memory.main(["--config", str(ROOT / "configs/tiny_moe.py"), "--compare",
                               *widths]) == 0
  record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert record["devices"] == 8 and record["platform"] == "cpu"
  assert abs(record["error"]) < 0.10


def test_script_simulates_devices_it_lacks():
  """DeepSeek-V3 (671B) on 256 GPUs of 80 GB, the layout docs/MEMORY.md recommends: traced on
  256 simulated devices in a process of its own."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(8))
  out = subprocess.run(
      [sys.executable, str(ROOT / "scripts/estimate_memory.py"), "--config",
       str(ROOT / "configs/deepseek_v3.py"), "--devices", "256", "--device-memory-gib", "80",
       "--config.parallel.dense.data=1", "--config.parallel.dense.fsdp=32",
       "--config.parallel.dense.tensor=8", "--config.parallel.expert.data=32",
       "--config.parallel.expert.expert=8", "--config.train.batch_size=128",
       "--config.train.micro_batch_size=64", "--config.train.remat=full"],
      capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  record = json.loads(out.stdout.strip().splitlines()[-1])
  assert record["devices"] == 256 and record["platform"] == "gpu" and record["fits"]
  # 671B parameters, float32, spread evenly over 256 devices (the embeddings' norms aside)
  assert record["parameters_gib"] == pytest.approx(671e9 * 4 / 256 / 2**30, rel=0.03)


def test_eight_gpu_bench_config_fits_h200s():
  """configs/bench/qwen3_30b_a3b_8gpu.py (the whole Qwen3-30B-A3B, FSDP 8 + EP 8) on 8 GPUs of
  139 GiB, with room for the estimate's error; without recomputation it would not fit with that
  room (135.5 GiB by the estimate since RMSNorm keeps only its input for the backward pass, 3d948c4;
  more than 139 before)."""
  from jmoe.config import load_config
  cfg = load_config(ROOT / "configs/bench/qwen3_30b_a3b_8gpu.py")
  layout = make_layout(cfg.parallel)
  assert layout.mesh.size == 8
  assert estimate(cfg, layout, platform="gpu").total < 0.9 * 139 * 2**30
  everything_kept = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, remat="none"))
  assert estimate(everything_kept, layout, platform="gpu").total > 0.9 * 139 * 2**30


# --- XLA's own placement of a compiled program's temporaries (jmoe/memory/compiled.py) ---

_BUFFERS = """BufferAssignment:
allocation 0: size 4096, page 0, parameter 0, shape |f32[1024]| at ShapeIndex {}:
 value: <1 p.1 @0> (size=4096,offset=0): f32[1024]{0}
allocation 1: size 9000, page 0, preallocated-temp:
 value: <2 a.1 @0> (size=4000,offset=0): f32[1000]{0}
 value: <3 b.2 @0> (size=3000,offset=4000): bf16[1500]{0}
 value: <4 t.3{} @0> (size=16,offset=8984): (f32[1000]{0}, bf16[1500]{0})
 value: <5 t.3{1} (phi) @0> (size=2000,offset=4000): f32[500]{0}
 value: <6 c.4 @0> (size=5000,offset=4000): f32[1250]{0}
 value: <7 z.5 @0> (size=0,offset=0): f32[0]{0}
"""
_RANGES = """HloLiveRange (max 6):
  InstructionSequence:
    0:p.1
    1:a.1
    2:b.2
    3:t.3
    4:c.4
    5:z.5
  BufferLiveRange:
    p.1{}:0-6
    a.1{}:1-4
    b.2{}:2-3
    t.3{}:3-3
    t.3{1}:3-3
    c.4{}:4-5
    z.5{}:5-5
"""


def write_dump(directory, buffers=_BUFFERS, ranges=_RANGES):
  directory.mkdir(exist_ok=True)
  name = "module_0001.jit_step.sm_9.0a_gpu_after_optimizations"
  (directory / f"{name}-buffer-assignment.txt").write_text(buffers)
  (directory / f"{name}-live-range.txt").write_text(ranges)
  return str(directory)


def test_temporaries_from_a_dump_find_the_live_peak_and_the_gaps(tmp_path):
  """The most bytes in use at once: a and c at position 4 (9,000 bytes, the whole allocation),
  not the four values live at 3, of which the tuple's element shares b's bytes (7,016 in use,
  not 9,016); the parameter and the empty value are not temporaries. Each buffer's op comes
  from the program's text. With the allocation twice as large, half of it is gaps."""
  from jmoe.memory.compiled import temporaries
  hlo = '  %a.1 = f32[1000]{0} sine(%p.1), metadata={op_name="jit(step)/sin"}\n'
  temp = temporaries(write_dump(tmp_path), hlo)
  assert (temp.allocation_bytes, temp.live_peak_bytes) == (9000, 9000)
  assert (temp.peak_position, temp.peak_instruction) == (4, "c.4")
  assert [b.name for b in temp.live_at_peak] == ["c.4{}", "a.1{}"]
  assert temp.live_at_peak[1].op == "jit(step)/sin" and temp.live_at_peak[0].op == ""
  assert temp.unplaced_bytes == 0
  assert temp.by_shape() == [("f32[1250]", 1, 5000), ("f32[1000]", 1, 4000)]
  late = _RANGES.replace("c.4{}:4-5", "c.4{}:5-5")  # a gone when c starts: 7,016 at 3 is the most
  temp = temporaries(write_dump(tmp_path / "late", ranges=late), hlo)
  assert (temp.live_peak_bytes, temp.peak_instruction, temp.unplaced_bytes) == (7016, "t.3", 1984)
  assert [b.name for b in temp.live_at_peak] == ["a.1{}", "b.2{}", "t.3{1}", "t.3{}"]


def test_temporaries_refuse_a_dump_without_its_files_or_ranges(tmp_path):
  from jmoe.config import ConfigError
  from jmoe.memory.compiled import temporaries
  with pytest.raises(ConfigError, match="no XLA dump file"):
    temporaries(str(tmp_path))
  short = _RANGES.replace("    c.4{}:4-5\n", "")
  with pytest.raises(ConfigError, match="do not name 1 of the temporaries' buffers .*c.4"):
    temporaries(write_dump(tmp_path / "short", ranges=short))


def test_temporaries_of_a_program_compiled_here_add_up(tmp_path):
  """A gradient compiled on this CPU with XLA's dump: the buffers listed at the live peak add
  up to it at least (values may share bytes), it fits in the allocation XLA reports, and each
  names the JAX operation behind it."""
  from jmoe.memory.compiled import temporaries

  def loss(x):
    y = jnp.sin(x) @ x
    return (jnp.cos(y) @ y @ x).sum()

  compiled = jax.jit(jax.grad(loss)).lower(jnp.ones((256, 256))).compile(
      {"xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": "NONE"})
  temp = temporaries(str(tmp_path), compiled.as_text())
  assert sum(b.bytes for b in temp.live_at_peak) >= temp.live_peak_bytes >= 3 * 256 * 256 * 4
  assert temp.live_peak_bytes <= temp.allocation_bytes
  assert temp.allocation_bytes == compiled.memory_analysis().temp_size_in_bytes
  assert all(b.op.startswith("jit(loss)/") for b in temp.live_at_peak)


def test_compile_for_gpu_names_what_it_needs_when_the_cuda_plugin_is_missing():
  import importlib.util
  if any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
    pytest.skip("JAX's CUDA plugin is installed here")
  done = subprocess.run([sys.executable, "scripts/compile_for_gpu.py", "--config",
                         "configs/tiny_moe.py"], capture_output=True, text=True,
                        cwd=pathlib.Path(__file__).parents[1])
  assert done.returncode == 2
  assert 'pip install "jax[cuda13]"' in done.stderr
