"""Where a periodic save's cost on the steps beside it goes, read from a profiler trace.

  python scripts/save_timeline.py [--config configs/bench/qwen3_30b_a3b_1gpu.py]
      [--save-at 20] [--after 15] [--variants pinned,paced,pageable]
      [--dir /dev/shm/jmoe-save-timeline] [--out DIR] [--config.X=Y ...]

One jmoe.train `Trainer` on the config, `checkpoint.every=--save-at`, and a save traced for each
of `--variants` (at --save-at, twice --save-at, ...): the loop's steps up to three before it run
untraced (compilation, warm-up), then its own steps from there to `--after` steps past the save
are traced (jax.profiler, Python frames on), the save among them as the loop starts it. The
variants say how the save copies the state to the host: through page-locked memory (`pinned`,
Orbax's way on a GPU: every array's transfer started at once), the same one array at a time,
each waited for (`paced`: where the state was copied on the device), all at once but only
after the loop has launched `--lead` more steps (`lead`: so that the device has them queued
while the transfer holds the launches up), or into pageable memory.
Printed, a JSON line per variant (`timeline`): the device's idle gaps in the traced window (each
over 1 ms, the largest first, with when they began after the save was called and what the loop's
host thread was doing then), its busy share before the save, while the state went to the host and
after, and the device-to-host copies (their count, bytes, span and streams). `--out` keeps the
traces. The workdir `--dir` is removed at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import shutil
import sys
import tempfile
import time

from profile_kernels import trace_events

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SAVE_CALL = "jmoe_save_call"  # the loop's call of Checkpointer.save (host, main thread)
TO_HOST = "jmoe_save_to_host"  # Orbax's save up to the state on the host (its own thread)
SAVE_COPY_BYTES = 1 << 16  # the smallest copy to the host counted as the save's, not the step's


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
  """The union of [start, end) intervals, sorted and merged."""
  out: list[list[float]] = []
  for a, b in sorted(intervals):
    if out and a <= out[-1][1]:
      out[-1][1] = max(out[-1][1], b)
    else:
      out.append([a, b])
  return [(a, b) for a, b in out]


def busy_share(busy: list[tuple[float, float]], a: float, b: float) -> float | None:
  """The share of [a, b) that the merged intervals `busy` cover."""
  if b <= a:
    return None
  return sum(max(0.0, min(y, b) - max(x, a)) for x, y in busy) / (b - a)


def copied_bytes(event: dict) -> int:
  """A memcpy event's bytes: its `bytes` argument, or a number after `size`/`bytes` in one of
  its arguments' text (the profiler's forms differ by version); 0 where none is given."""
  found = event.get("args", {}).get("bytes")
  if found is None:
    text = " ".join(str(v) for v in event.get("args", {}).values())
    match = re.search(r"(?:size|bytes)\D{0,3}(\d+)", text)
    found = match.group(1) if match else 0
  return int(found)


def timeline(events: list[dict]) -> dict:
  """The figures printed (module docstring) from a Chrome-format trace's events, times in µs.
  Device events are those of processes named for a GPU; the host's, the rest."""
  names = {e["pid"]: str(e.get("args", {}).get("name", "")) for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  device = {pid for pid, name in names.items() if "gpu" in name.lower()}
  spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
  calls = [e for e in spans if e["name"] == SAVE_CALL]
  if not calls:
    return {"error": f"no {SAVE_CALL} event in the trace: the save did not fall in the window"}
  call = calls[0]
  t0 = float(call["ts"])
  to_host = [e for e in spans if e["name"] == TO_HOST]
  copies = [e for e in spans if e["pid"] in device and "memcpy" in e["name"].lower()
            and ("dtoh" in e["name"].lower() or "d2h" in e["name"].lower())]
  kernels = [e for e in spans if e["pid"] in device and "memcpy" not in e["name"].lower()]
  if not kernels:
    return {"error": "no device kernels in the trace (no GPU, or the device tracer was off)"}
  busy = merged([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels])
  start, end = busy[0][0], busy[-1][1]
  # The loop's host thread: the one that called the save. Its Python frames, innermost last.
  host = [e for e in spans if e["pid"] == call["pid"] and e["tid"] == call["tid"]]

  def doing(a: float, b: float) -> list[str]:
    """The host thread's innermost frames overlapping [a, b), the longest there first (3)."""
    inside = sorted((e for e in host if float(e["ts"]) < b
                     and float(e["ts"]) + float(e["dur"]) > a),
                    key=lambda e: (float(e["ts"]), -float(e["dur"])))
    stack, outer = [], set()
    for i, e in enumerate(inside):  # (frames nest: a frame holding another is no leaf)
      while stack and float(inside[stack[-1]]["ts"]) + float(inside[stack[-1]]["dur"]) <= float(
          e["ts"]):
        stack.pop()
      if stack:
        outer.add(stack[-1])
      stack.append(i)
    overlap = collections.Counter()
    for i, e in enumerate(inside):
      if i not in outer:
        ends = float(e["ts"]) + float(e["dur"])
        overlap[e["name"][:100]] += min(ends, b) - max(float(e["ts"]), a)
    return [f"{name} ({us / 1e3:.1f} ms)" for name, us in overlap.most_common(3)]

  gaps = [(a, b) for (_, a), (b, _) in zip(busy, busy[1:]) if b - a > 1e3]
  gaps.sort(key=lambda g: g[0] - g[1])
  # (the step's own copies to the host, its metrics, are a few bytes each: the save's span is
  # that of the copies of 64 KiB and more)
  large = [e for e in copies if copied_bytes(e) >= SAVE_COPY_BYTES]
  spanned = large or copies
  copy_span = ((min(float(e["ts"]) for e in spanned),
                max(float(e["ts"]) + float(e["dur"]) for e in spanned)) if spanned else None)
  host_span = ((float(to_host[0]["ts"]), float(to_host[0]["ts"]) + float(to_host[0]["dur"]))
               if to_host else None)
  during = copy_span or host_span
  ms = lambda us: round(us / 1e3, 2)
  return {
      "window_ms": ms(end - start),
      "device_idle_ms": ms((end - start) - sum(b - a for a, b in busy)),
      # (these two count the gaps over 1 ms only, each cut at the save call's start)
      "idle_before_save_ms": ms(sum(max(0.0, min(b, t0) - a) for a, b in gaps)),
      "idle_after_save_ms": ms(sum(max(0.0, b - max(a, t0)) for a, b in gaps)),
      "save_call_ms": ms(float(call["dur"])),
      "to_host_ms": [ms(host_span[0] - t0), ms(host_span[1] - t0)] if host_span else None,
      "busy_before": round(busy_share(busy, start, t0) or 0, 4),
      "busy_while_to_host": round(busy_share(busy, *during) or 0, 4) if during else None,
      "busy_after": round(busy_share(busy, during[1], end) or 0, 4) if during else None,
      "d2h_copies": len(copies),
      "d2h_gib": round(sum(copied_bytes(e) for e in copies) / 2**30, 3),
      "d2h_ms": [ms(copy_span[0] - t0), ms(copy_span[1] - t0)] if copy_span else None,
      "d2h_large": len(large),
      "d2h_streams": sorted({str(e["tid"]) for e in copies}),
      "d2h_first": [copies[0]["name"], copies[0].get("args")] if copies else None,
      "kernel_streams": collections.Counter(str(e["tid"]) for e in kernels).most_common(4),
      # the largest idle gaps: (ms after the save call began, length in ms, the host then)
      "gaps": [[ms(a - t0), ms(b - a), doing(a, b)] for a, b in gaps[:12]],
  }


def read_trace(trace_dir: str) -> list[dict]:
  events = trace_events(trace_dir)
  if events is None:
    raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
  return events


def annotated(checkpointer) -> None:
  """The checkpointer's save call and Orbax's save up to the state on the host, named in the
  trace (SAVE_CALL, TO_HOST)."""
  import jax
  save, start = checkpointer.save, checkpointer._start

  def annotated_save(*a, **k):
    with jax.profiler.TraceAnnotation(SAVE_CALL):
      return save(*a, **k)

  def annotated_start(*a, **k):
    with jax.profiler.TraceAnnotation(TO_HOST):
      return start(*a, **k)

  checkpointer.save, checkpointer._start = annotated_save, annotated_start


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/bench/qwen3_30b_a3b_1gpu.py")
  parser.add_argument("--save-at", type=int, default=20)
  parser.add_argument("--after", type=int, default=15)
  parser.add_argument("--variants", default="pinned,paced",
                      help="the traced saves, one each, in order: how each copies the state to "
                           "the host, `pinned` (Orbax's way on a GPU), `paced` (the same, an "
                           "array at a time), `lead` (pinned, after --lead steps) or `pageable`")
  parser.add_argument("--lead", type=int, default=8,
                      help="the `lead` variant's steps launched before the transfer starts")
  parser.add_argument("--dir", type=pathlib.Path,
                      default=pathlib.Path("/dev/shm/jmoe-save-timeline"))
  parser.add_argument("--out", type=pathlib.Path, help="keep the traces here")
  args, overrides = parser.parse_known_args(argv)
  variants = args.variants.split(",")
  if args.save_at < 4 or not 1 <= args.after <= args.save_at - 4:
    parser.error("--save-at must be 4 or more (three steps traced before each save) and --after "
                 "from 1 to --save-at - 4 (no other save in the window)")
  if any(v not in ("pinned", "paced", "lead", "pageable") for v in variants):
    parser.error(f"--variants: each is pinned, paced, lead or pageable, not {args.variants!r}")
  if "lead" in variants and not 1 <= args.lead < args.after:
    parser.error("--lead must be from 1 to --after - 1 (the transfer within the traced steps)")
  if args.dir.exists():
    parser.error(f"{args.dir} exists: give a directory that does not (it is removed at the end)")
  from jmoe.xla_flags import set_gpu_flags
  set_gpu_flags()
  import jax
  from jmoe.checkpoint import Checkpointer
  from jmoe.cli import setup_logging
  from jmoe.config import load_config
  from jmoe.train.loop import Trainer
  config = load_config(ROOT / args.config, [o.removeprefix("--config.") for o in overrides] + [
      "train.steps=1000000", f"checkpoint.every={args.save_at}", "checkpoint.keep=1",
      "checkpoint.async_save=true"])
  setup_logging()  # (the checkpointer says how a save takes the state to the host)
  traces = args.out or pathlib.Path(tempfile.mkdtemp(prefix="jmoe-trace-"))
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 1
  try:
    with Trainer(config, args.dir / "work", progress=False) as trainer:
      for i, variant in enumerate(variants, 1):
        trainer.checkpointer.wait_reserved()  # (page-locked memory, for all saves)
        trainer.checkpointer.close()
        trainer.checkpointer = Checkpointer(
            args.dir / f"v{i}_{variant}", keep=1, write_threads=config.checkpoint.write_threads,
            pinned_transfer=variant != "pageable", paced_transfer=variant == "paced",
            transfer_lead=args.lead if variant == "lead" else 0)
        annotated(trainer.checkpointer)
        trainer.train(args.save_at * i - 3 - trainer.step)
        jax.block_until_ready(trainer.state)
        began = time.perf_counter()
        jax.profiler.start_trace(str(traces / f"v{i}_{variant}"), profiler_options=options)
        try:
          trainer.train(3 + args.after)
          jax.block_until_ready(trainer.state)
        finally:
          jax.profiler.stop_trace()
        traced_s = time.perf_counter() - began
        trainer.checkpointer.wait()
        print(json.dumps({"variant": variant, "timeline": timeline(read_trace(str(
            traces / f"v{i}_{variant}"))), "config": args.config, "save_at": args.save_at * i,
            "traced_steps": 3 + args.after, "traced_s": round(traced_s, 2)}), flush=True)
  finally:
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.out is None:
      shutil.rmtree(traces, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
