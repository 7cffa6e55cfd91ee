"""Training-step speed: one JSON line per run, for docs/PERFORMANCE.md and docs/perf/records.jsonl.

  python scripts/benchmark.py --config configs/bench/NAME.py [--steps 10] [--warmup 3] [--settle S]
      [--balanced] [--packed] [--profile DIR] [--peer [transformers|torchtitan|all]]
      [--loop STEPS [--loop-probes 3]] [--record FILE]
      [--no-xla-flags] [--config.group.key=value ...]

Runs jmoe's own train step (the one `jmoe.train` compiles) on random tokens, one document per row as
published MoE benchmarks use, or with `--packed` on rows the data pipeline packs from several
documents (segment ids and positions: attention and loss stay within each document): warm-up
steps, then (with `--settle S`) untimed steps for S seconds, so that the timed ones run at the clock a
long run holds at the power cap, not at the higher one a GPU keeps for a few steps after a pause
(scripts/gpu_clocks.py; `settle_s`, `settle_steps`; the peers settle as long), then timed steps
with one device sync at the end. Reports tokens/s and model TFLOP/s per
device (Megatron's count: jmoe/train/flops.py), MFU against the datasheet's dense bf16 peak (989
TFLOP/s for H100/H200) and against a dense bf16 GEMM measured in the same process, the step time
and the peak device memory, and the GPUs' mean SM clock, power draw and share of time at their
power cap over the timed steps (`gpu_sm_clock_mhz`, `gpu_power_w`, `gpu_power_capped`; nvidia-smi,
where there is one). `--balanced` forces every expert to the same load
(moe.router.force_balanced), as NeMo AutoModel's published figures do. `--profile DIR` traces 3
more steps and adds the device time per kernel kind (scripts/profile_kernels.py). `--peer` then times a PyTorch peer on the
same config, each in a process of its own so that each gets the GPU alone, and adds its figures
and the ratio: `--peer` or `--peer transformers` the transformers model (scripts/hf_peer.py;
fields `peer`, `peer_step_ms`, ..., `vs_peer`), `--peer torchtitan` torchtitan's own model
(scripts/titan_peer.py, with `--balanced` its forced balance; fields `peer_torchtitan`,
`peer_torchtitan_step_ms`, ..., `vs_peer_torchtitan`), `--peer all` both. `--loop STEPS` then
runs the training command's own loop (jmoe.train's `Trainer`: the data pipeline, metrics, health
checks and checkpoints as the config sets them) for STEPS steps in a temporary workdir, as
`--config.train.steps=STEPS` would, and adds its tokens/s after the first `--warmup` steps,
counted over the rest of the run (saves and the last save's wait included), beside the bare
step's; and the bare step once more on the loop's last state (`loop_end_bare_step_ms`: a step's
time drifts as the model trains), to which `loop_steps_vs_end_step` compares the loop's steps,
and in the middle of each third of the run on a copy of its state (`loop_probe_bare_step_ms`),
whose mean `loop_steps_vs_mean_step` compares them with: the bare step over the same states
(scripts/loop_timing.py; `--loop-probes N` for N parts, 0 for none: each probe
takes a few seconds, and where the devices lack room for a copy of the state, a round trip of it
through host memory); with the GPUs' clocks over the loop's steps (`loop_gpu_sm_clock_mhz`,
...) and over each probe (`loop_probe_gpu_sm_clock_mhz`).
`--record FILE` appends the result to FILE as one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import pathlib
import subprocess
import sys
import time

from gpu_clocks import GpuClocks, add_settle_flag, settle
from loop_timing import loop_figures
from profile_kernels import kernel_breakdown

DATASHEET_TFLOPS = 989.0  # H100/H200 SXM, dense bf16
def dense_gemm_tflops(size: int = 8192, repeats: int = 10) -> float:
  import jax
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
  matmul = jax.jit(lambda a, b: a @ b)
  for _ in range(2):
    matmul(a, a).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(repeats):
    out = matmul(a, a)
  out.block_until_ready()
  return 2 * size**3 * repeats / (time.perf_counter() - t0) / 1e12


def packed_batch(config) -> dict:
  """One global batch of rows the data pipeline packs from the configured documents (by default
  the Python standard library's sources), with their segment ids and positions."""
  import dataclasses
  from jmoe.data import first_batches
  return first_batches(dataclasses.replace(
      config, data=dataclasses.replace(config.data, packing="concat")))[0]


def commit() -> str:
  """The checkout's commit (with "+changes" when its tracked files differ), or "" outside git."""
  root = pathlib.Path(__file__).parents[1]
  git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True)
  head = git("rev-parse", "--short", "HEAD")
  if head.returncode:
    return ""
  return head.stdout.strip() + ("+changes" if git("diff", "--quiet", "HEAD").returncode else "")


def check_outputs(args: argparse.Namespace) -> int:
  """Refuses a --record or --profile that cannot be written (a directory as --record, a path
  under a file, no permission), so that no run is timed for nothing."""
  from jmoe.outputs import writable
  if args.record:
    writable(args.record, directory=False, flag="--record")
  if args.profile:
    writable(args.profile, directory=True, flag="--profile")
  return 0


def append_record(path: str, record: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def last_json(command: list[str]) -> tuple[dict | None, str]:
  """Runs a command; its last JSON line, and its output's tail when it has none or fails."""
  result = subprocess.run(command, capture_output=True, text=True)
  sys.stderr.write(result.stderr[-4000:])
  lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
  if result.returncode or not lines:
    return None, (result.stderr or result.stdout)[-800:]
  return json.loads(lines[-1]), ""


# Each peer: its script and the prefix of its fields in the record (the transformers peer keeps the
# fields that records before torchtitan's have).
PEERS = {"transformers": ("hf_peer.py", "peer"), "torchtitan": ("titan_peer.py", "peer_torchtitan")}


def with_peers(argv: list[str], args: argparse.Namespace, overrides: list[str]) -> int:
  """jmoe's step (this script with `argv`), then each peer's step on the same config, each in a
  process of its own so that each has the GPU (and JAX its preallocated memory) to itself; the
  ratios."""
  record, error = last_json([sys.executable, __file__, *argv])
  if record is None:
    print(error, file=sys.stderr)
    return 1
  failed = False
  for name in PEERS if args.peer == "all" else (args.peer,):
    script, prefix = PEERS[name]
    extra = ["--balanced"] if args.balanced and name == "torchtitan" else []
    extra += ["--settle", str(args.settle)] if args.settle else []
    figures, error = last_json([sys.executable, str(pathlib.Path(__file__).with_name(script)),
                                "--config", args.config, *extra, *overrides])
    if figures is None:
      record[f"{prefix}_error"], failed = error, True
    else:
      record.update(peer_fields(figures, record["tflops_per_device"], prefix))
  print(json.dumps(record), flush=True)
  if args.record:
    append_record(args.record, record)
  return 1 if failed else 0


def peer_fields(figures: dict, tflops: float, prefix: str = "peer") -> dict:
  fields = {prefix: figures["peer"], f"{prefix}_experts": figures["experts_implementation"],
            f"{prefix}_attention": figures["attention"],
            f"{prefix}_step_ms": figures["step_ms"],
            f"{prefix}_tokens_per_s_per_device": figures["tokens_per_s_per_device"],
            f"{prefix}_tflops_per_device": figures["tflops_per_device"],
            f"{prefix}_peak_memory_gib": figures["peak_memory_gib"],
            f"vs_{prefix}": round(tflops / figures["tflops_per_device"], 3)}
  # its settling and its GPU's clocks (where nvidia-smi sampled them), the torchtitan peer's own
  for key in ("settle_s", "settle_steps", "gpu_sm_clock_mhz", "gpu_power_w", "gpu_power_capped",
              "compile", "routing", "params"):
    if key in figures:
      fields[f"{prefix}_{key}"] = figures[key]
  return fields


def without_flag(argv: list[str], flag: str, values: tuple[str, ...] | None = None) -> list[str]:
  """`argv` without `flag`, as `flag=VALUE` or `flag VALUE`; with `values`, VALUE is optional
  and one of them, else it is always there."""
  kept, skip = [], False
  for i, arg in enumerate(argv):
    if skip:
      skip = False
    elif arg == flag:
      skip = i + 1 < len(argv) and (values is None or argv[i + 1] in values)
    elif not arg.startswith(flag + "="):
      kept.append(arg)
  return kept


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=3)
  add_settle_flag(parser, "untimed steps for SECONDS after the warm-up (each peer's too), so "
                          "that the timed steps run at the clock a long run holds")
  parser.add_argument("--balanced", action="store_true", help="force equal expert loads")
  parser.add_argument("--no-xla-flags", action="store_true", help="leave XLA_FLAGS as they are")
  parser.add_argument("--profile", metavar="DIR",
                      help="also trace 3 steps into DIR and print the device time per kernel kind")
  parser.add_argument("--packed", action="store_true",
                      help="rows packed from several documents by the data pipeline")
  parser.add_argument("--peer", nargs="?", const="transformers", choices=(*PEERS, "all"),
                      help="then time a PyTorch peer on the same config: transformers "
                      "(hf_peer.py, the default), torchtitan (titan_peer.py) or all")
  parser.add_argument("--loop", type=int, metavar="STEPS",
                      help="then time STEPS steps of jmoe.train's own loop on the same config")
  parser.add_argument("--loop-probes", type=int, default=3, metavar="N",
                      help="with --loop: time the bare step in the middle of each of N parts of "
                           "the loop (0: only at its end)")
  parser.add_argument("--record", metavar="FILE", help="append the result as a JSON line")
  parser.add_argument("--hlo", metavar="FILE",
                      help="also write the compiled step's program (XLA's HLO text) to FILE")
  from jmoe.cli import run, split_overrides
  argv = sys.argv[1:] if argv is None else argv
  rest, overrides = split_overrides(argv)
  args = parser.parse_args(rest)
  if args.loop_probes < 0:
    parser.error(f"--loop-probes {args.loop_probes}: give 0 or more")
  if args.loop is not None and args.loop <= args.warmup:
    parser.error(f"--loop {args.loop} leaves no step to time after --warmup {args.warmup}")
  refused = run(lambda: check_outputs(args))  # before anything is compiled or timed
  if refused:
    return refused
  if args.peer:  # this process only drives the measurements
    child = without_flag(without_flag(argv, "--peer", (*PEERS, "all")), "--record")
    return with_peers(child, args, overrides)
  if not args.no_xla_flags:
    from jmoe.xla_flags import set_gpu_flags
    set_gpu_flags()

  def command() -> int:
    import jax
    import numpy as np
    from jmoe.config import load_config
    from jmoe.ops.grouped_gemm import auto_gemm
    from jmoe.parallel import make_layout
    from jmoe.train.flops import model_flops_per_token
    from jmoe.train.optimizer import make_optimizer
    from jmoe.train.state import state_spec
    from jmoe.data.pipeline import most_documents
    from jmoe.train.step import compile_train_step, documents_bound
    config = load_config(args.config, overrides + (
        ["moe.router.force_balanced=true"] if args.balanced else []))
    layout = make_layout(config.parallel)
    optimizer = make_optimizer(config.train, config.precision.moments)
    spec = state_spec(config, layout, optimizer)
    state = spec.init()
    batch_size, seq = config.train.batch_size, config.data.seq_len
    if args.packed:
      batch = packed_batch(config)
    else:
      tokens = np.random.default_rng(0).integers(0, config.model.vocab_size,
                                                 (batch_size, seq + 1))
      batch = {"tokens": tokens.astype(np.int32)}
    # (packed rows: the step is compiled for as many documents as they hold, as jmoe.train's)
    documents = (documents_bound(config, most_documents(batch["segment_ids"]))
                 if "segment_ids" in batch else None)
    batch = {k: jax.device_put(v, layout.batch) for k, v in batch.items()}
    t0 = time.perf_counter()
    step = compile_train_step(config, layout, spec, optimizer, batch, documents=documents)
    compile_s = time.perf_counter() - t0
    hlo = step.as_text()
    if args.hlo:
      with open(args.hlo, "w") as f:
        f.write(hlo)
    first = None
    for _ in range(args.warmup):
      state, metrics = step(state, batch)
      first = first or jax.device_get({k: metrics[k] for k in ("loss", "grad_norm")})
    jax.block_until_ready(state)

    def untimed():
      nonlocal state
      state, _ = step(state, batch)
    settled = settle(untimed, lambda: jax.block_until_ready(state), args.settle)
    with GpuClocks() as clocks:
      t0 = time.perf_counter()
      for _ in range(args.steps):
        state, metrics = step(state, batch)
      jax.block_until_ready(state)
      step_s = (time.perf_counter() - t0) / args.steps
    metrics = jax.device_get(metrics)
    devices = layout.mesh.devices.size
    tokens_per_s = batch_size * seq / step_s / devices
    tflops = tokens_per_s * model_flops_per_token(config) / 1e12
    gemm = dense_gemm_tflops(8192 if jax.default_backend() == "gpu" else 512)
    memory = jax.devices()[0].memory_stats() or {}
    breakdown = None
    if args.profile:
      with jax.profiler.trace(args.profile, create_perfetto_trace=True):
        for _ in range(3):
          state, _ = step(state, batch)
        jax.block_until_ready(state)
      breakdown = kernel_breakdown(args.profile, hlo)
    load_LE = np.asarray(metrics["expert_load"])
    record = {
        "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
        "jmoe_commit": commit(),
        "config": args.config, "overrides": overrides, "devices": devices,
        "device_kind": jax.devices()[0].device_kind, "layers": config.model.num_layers,
        "batch": batch_size, "seq_len": seq, "routing": "balanced" if args.balanced else "real",
        "documents": "packed" if args.packed else "one per row",
        "gemm": auto_gemm() if config.moe.gemm == "auto" else config.moe.gemm,
        "expert_blocks": config.moe.expert_blocks, "precision": config.precision.gemm,
        "fp8_recipe": config.precision.fp8_recipe if config.precision.gemm == "fp8" else None,
        # which GEMMs FP8 covers (the dense ones by default until 2026-12-04)
        "fp8_experts": config.precision.fp8_experts if config.precision.gemm == "fp8" else None,
        "fp8_dense": config.precision.fp8_dense if config.precision.gemm == "fp8" else None,
        # GEMM library calls in the compiled step: cuBLASLt's FP8 GEMMs and the others
        "fp8_gemm_calls": hlo.count('custom_call_target="__cublas$lt$matmul$f8"'),
        "other_gemm_calls": hlo.count('custom_call_target="__cublas$lt$matmul"')
        + hlo.count('custom_call_target="__cublas$gemm"'),
        "remat": config.train.remat, "step_ms": round(step_s * 1e3, 2),
        "tokens_per_s_per_device": round(tokens_per_s),
        "tflops_per_device": round(tflops, 3),
        "mfu_datasheet": round(tflops / DATASHEET_TFLOPS, 4),
        "dense_gemm_tflops": round(gemm, 1), "mfu_measured_gemm": round(tflops / gemm, 4),
        "peak_memory_gib": round(memory.get("peak_bytes_in_use", 0) / 2**30, 2),
        "loss": round(float(metrics["loss"]), 4),
        # the first step's, from the same initial state: equal on every layout up to rounding
        "first_loss": round(float(first["loss"]), 5) if first else None,
        "first_grad_norm": round(float(first["grad_norm"]), 5) if first else None,
        "expert_load_max_over_mean": round(float(load_LE.max() * load_LE.shape[-1]), 3)
        if load_LE.size else None,
        "compile_s": round(compile_s, 1), **settled, **clocks.figures()}
    if breakdown is not None:
      record["profile"] = breakdown
    if args.loop:
      for x in jax.tree.leaves(state):  # the loop builds a state of its own
        x.delete()
      record.update(loop_figures(config, args.loop, args.warmup, args.loop_probes))
      record["loop_vs_step"] = round(record["loop_tokens_per_s"] / (tokens_per_s * devices), 3)
      record["loop_steps_vs_step"] = round(
          record["loop_tokens_per_s_steps"] / (tokens_per_s * devices), 3)
      record["loop_steps_vs_end_step"] = round(
          record["loop_tokens_per_s_steps"] / record["loop_end_bare_tokens_per_s"], 3)
    print(json.dumps(record), flush=True)
    if args.record:
      append_record(args.record, record)
    return 0

  logging.getLogger("jmoe").setLevel(logging.INFO)
  return run(command)


if __name__ == "__main__":
  sys.exit(main())
