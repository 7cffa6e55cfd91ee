"""A config's train step compiled for an NVIDIA H100 or H200 on a host without one: XLA's own
memory figures for it, and where its temporaries peak, before renting the GPU.

  python scripts/compile_for_gpu.py --config configs/NAME.py [--gpu h200|h100] [--devices N]
      (N GPUs: one host's up to 8, or hosts of 8)
      [--packed [--any-documents]] [--hlo FILE] [--largest 20] [--config.group.key=value ...]

Needs JAX's CUDA plugin installed (`pip install "jax[cuda13]"`; no GPU, no driver): JAX compiles
for a GPU it is given a description of (TARGETS: compute capability, SMs, memory), as its
ahead-of-time compilation does. While the step is traced, jmoe and JAX's Pallas kernels are told
that the backend is that GPU, so they take their GPU paths (the Mosaic and Triton kernels
lowered, not interpreted; cuDNN attention). XLA's buffer assignment is the one the GPU gets:
on 2026-12-05 the Qwen3-30B-A3B and Mixtral-8x7B benches compiled here to within 0.5% of the
peak memory measured on an H200 (docs/MEMORY.md). Nothing is autotuned without the GPU (XLA
keeps its default GEMM and fusion choices) and nothing runs: speed is not measured here.

Prints XLA's bytes per device (arguments, outputs, aliased, temporaries; the peak as the train
command counts it), then the temporaries read from XLA's dump (jmoe/memory/compiled.py): their
live peak, the instruction there, the largest buffers live at it with the JAX operation that
made each, and how much of the allocation is gaps. Then one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

# Run from anywhere: the repository root (this file's parent's parent) is importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# XLA's description of each GPU (its GpuTargetConfig, in protobuf text): the datasheet's figures.
_TARGET = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }} registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 19 }}
runtime_version {{ major: 13 minor: 0 }}
device_description_str: "{name}"
"""
GPUS_PER_HOST = 8  # --devices beyond one host: hosts of 8 GPUs (HGX H100 / H200)
TARGETS = {
    "h200": dict(name="NVIDIA H200", memory=150_754_820_096, bandwidth=4_800_000_000_000),
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory=84_929_347_584,
                 bandwidth=3_352_320_000_000),
}


class TargetGpu:
  """What jmoe and JAX's Pallas kernels read of `jax.devices()[0]` to pick their GPU paths."""
  platform = "gpu"
  core_count = 132
  compute_capability = "9.0"

  def __init__(self, name: str):
    self.device_kind = name

  def memory_stats(self) -> dict:
    return {}


def target_config(gpu: str) -> str:
  return _TARGET.format(**TARGETS[gpu])


def main(argv: list[str] | None = None) -> int:
  from jmoe.cli import layout_parser, run, split_overrides
  parser = layout_parser(__doc__.split("\n")[0])
  parser.add_argument("--gpu", choices=sorted(TARGETS), default="h200")
  parser.add_argument("--hlo", help="also write the compiled program (XLA's HLO text) to FILE")
  parser.add_argument("--largest", type=int, default=20,
                      help="list this many of the buffers live at the temporaries' peak")
  parser.add_argument("--packed", action="store_true",
                      help="the step for rows packed from several documents (segment ids and "
                           "positions beside the tokens), as benchmark.py --packed runs it")
  parser.add_argument("--any-documents", action="store_true",
                      help="(--packed) the step for any batch, which branches on the device "
                           "between cuDNN's packed attention and XLA's by the rows' documents, "
                           "as training compiles it on several hosts or once a batch has rows "
                           "of more than model.attention_max_documents; else, on one host, "
                           "the step for rows of at most that many, with no branch")
  rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(rest)

  def command() -> int:
    import importlib.util
    from jmoe.config import ConfigError, load_config
    if not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
      raise ConfigError('JAX\'s CUDA plugin is not installed: pip install "jax[cuda13]" (it '
                        "compiles for the GPU without one)")
    devices = args.devices or 1
    if devices < 1:
      raise ConfigError(f"--devices {devices}: give a positive number of GPUs")
    config = load_config(args.config, overrides)
    dump = tempfile.mkdtemp(prefix="jmoe-xla-dump-")
    # Before JAX starts its backends: XLA reads its flags once.
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                        f"--xla_dump_to={dump}",
                                        "--xla_dump_hlo_module_re=.*train_step.*",
                                        "--xla_dump_hlo_pass_re=NONE"]).strip()
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check against
    from jmoe.xla_flags import set_gpu_flags
    set_gpu_flags()
    import jax
    import numpy as np
    from jax.experimental import topologies
    if devices > GPUS_PER_HOST and devices % GPUS_PER_HOST:
      raise ConfigError(f"--devices {devices}: more than one host's {GPUS_PER_HOST} GPUs must be "
                        f"whole hosts (a multiple of {GPUS_PER_HOST})")
    hosts, per_host = ((devices // GPUS_PER_HOST, GPUS_PER_HOST) if devices > GPUS_PER_HOST
                       else (1, devices))
    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(args.gpu),
                                            topology=f"1x{hosts}x{per_host}")
    jax.default_backend = lambda: "gpu"
    gpu = TargetGpu(TARGETS[args.gpu]["name"])
    jax.devices = lambda *_: [gpu] * devices
    # JAX's cuDNN attention checks the GPU's compute capability on the backend at hand (this
    # host's CPU); it is told the target's (a private module: JAX has no hook for it).
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
    capability = lambda text: tuple(int(x) for x in text.split("."))
    target = capability(gpu.compute_capability)
    cudnn_attention.check_compute_capability = lambda c: target >= capability(c)
    cudnn_attention.is_cuda_compute_capability_equal = lambda c: target == capability(c)
    from jmoe.memory.compiled import temporaries
    from jmoe.parallel import make_layout
    from jmoe.train.optimizer import make_optimizer
    from jmoe.train.state import state_spec
    from jmoe.train.step import compile_train_step, compiled_peak, documents_bound
    layout = make_layout(config.parallel, list(topology.devices))
    optimizer = make_optimizer(config.train, config.precision.moments)
    spec = state_spec(config, layout, optimizer)
    rows = jax.ShapeDtypeStruct((config.train.batch_size, config.data.seq_len + 1), np.int32,
                                sharding=layout.batch)
    batch = {"tokens": rows, **({"segment_ids": rows, "positions": rows} if args.packed else {})}
    # (as jmoe.train compiles it; this process is one, whatever the hosts it compiles for)
    documents = None if args.any_documents or hosts > 1 else documents_bound(config)
    try:
      compiled = compile_train_step(config, layout, spec, optimizer, batch, documents=documents)
      hlo = compiled.as_text()
      temp = temporaries(dump, hlo)
    finally:
      shutil.rmtree(dump, ignore_errors=True)
    if args.hlo:
      with open(args.hlo, "w") as f:
        f.write(hlo)
    m = compiled.memory_analysis()
    gib = lambda b: b / 2**30
    print(f"{args.config} on {devices} x {gpu.device_kind}, per device (XLA, compiled here):\n"
          f"  arguments {gib(m.argument_size_in_bytes):8.2f} GiB\n"
          f"  outputs   {gib(m.output_size_in_bytes):8.2f} GiB ({gib(m.alias_size_in_bytes):.2f} "
          "of them in the arguments' buffers)\n"
          f"  temporaries {gib(m.temp_size_in_bytes):6.2f} GiB\n"
          f"  peak      {gib(compiled_peak(compiled)):8.2f} GiB")
    print(f"temporaries: {gib(temp.live_peak_bytes):.2f} GiB live at most, at {temp.peak_instruction} "
          f"(position {temp.peak_position}); {gib(temp.unplaced_bytes):.2f} GiB of the allocation "
          "are gaps between buffers")
    for b in temp.live_at_peak[:args.largest]:
      print(f"  {gib(b.bytes):8.3f} GiB  {b.shape.split('{')[0]:<32} {b.name:<36} {b.op}")
    print("  by shape: " + ", ".join(f"{count} x {shape} {gib(n):.2f} GiB"
                                      for shape, count, n in temp.by_shape()[:8]))
    print(json.dumps({
        "config": args.config, "overrides": overrides, "packed": args.packed,
        "documents_per_row": documents if args.packed else None,
        "gpu": gpu.device_kind,
        "devices": devices, "peak_gib": round(gib(compiled_peak(compiled)), 3),
        "temp_gib": round(gib(m.temp_size_in_bytes), 3),
        "live_peak_gib": round(gib(temp.live_peak_bytes), 3),
        "gaps_gib": round(gib(temp.unplaced_bytes), 3), "peak_at": temp.peak_instruction}))
    return 0

  return run(command)


if __name__ == "__main__":
  sys.exit(main())
