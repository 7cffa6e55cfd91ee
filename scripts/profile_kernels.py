"""The device time of a profiled train step by kernel, for `scripts/benchmark.py --profile DIR`:
per kernel kind, per kind and model scope (and pass), and every kernel in DIR/kernels.tsv with
its launches, output shape and the JAX op it came from (read from the compiled program)."""

from __future__ import annotations

import json
import pathlib
import re

# Device kernels by name, for the time breakdown of a profiled step (first match wins).
KERNEL_KINDS = (("attention", ("fmha", "cudnn", "flash", "attention")),
                ("grouped_gemm", ("ragged", "mosaic", "pallas", "gmm")),
                ("gemm", ("gemm", "cublas", "nvjet", "xmma", "cutlass", "matmul", "dot")),
                ("collective", ("nccl", "all-to-all", "all_to_all", "allreduce", "all-gather")),
                ("copy", ("memcpy", "memset", "copy")))


def kernel_sources(hlo: str) -> dict[str, str]:
  """XLA kernel name (as a profile shows it, `loop_convert_fusion_5`) -> the JAX op and source
  line it came from, from the compiled program's metadata."""
  sources = {}
  for match in re.finditer(r"%([\w.\-]+) = [^\n]*?metadata=\{([^}]*)\}", hlo):
    meta = dict(re.findall(r'(\w+)="?([^"\s]*)"?', match.group(2)))
    where = meta.get("op_name", "")
    if "source_file" in meta:
      where += f" @ {meta['source_file'].split('/jmoe/')[-1]}:{meta.get('source_line', '')}"
    sources[match.group(1).replace(".", "_").replace("-", "_")] = where
  return sources


def kernel_outputs(hlo: str) -> dict[str, str]:
  """XLA kernel name -> the shape of what it writes, layouts left out (`bf16[8,4096,28672]`, or a
  tuple for a fusion of several outputs), from the compiled program's text."""
  found = re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) [\w\-]+\(", hlo, re.M)
  return {m.group(1).replace(".", "_").replace("-", "_"):
          re.sub(r"\{[^}]*\}|/\*[^*]*\*/", "", m.group(2)) for m in found}


def trace_events(trace_dir: str) -> list[dict] | None:
  """The events of the newest profiler trace (`*.trace.json.gz`) under `trace_dir`, or None."""
  import glob
  import gzip
  paths = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
  return json.load(gzip.open(sorted(paths)[-1]))["traceEvents"] if paths else None


def kernel_breakdown(trace_dir: str, hlo: str = "") -> dict:
  """Device time per kernel kind, per kind and model scope (`scope_of`), and the 40 longest
  kernels (with the JAX op each came from, when `hlo` is given), from a profiler trace; every
  kernel goes to `trace_dir`/kernels.tsv."""
  import collections
  events = trace_events(trace_dir)
  if events is None:
    return {"error": f"no trace under {trace_dir}"}
  devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
             and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
  by_name, launches = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in devices:
      by_name[e["name"]] += float(e.get("dur", 0))
      launches[e["name"]] += 1
  total = sum(by_name.values()) or 1.0
  kinds = collections.Counter()
  kind_of = {}
  for name, us in by_name.items():
    low = name.lower()
    kind_of[name] = next((k for k, keys in KERNEL_KINDS if any(key in low for key in keys)),
                         "other")
    kinds[kind_of[name]] += us
  sources, outputs = (kernel_sources(hlo), kernel_outputs(hlo)) if hlo else ({}, {})
  key = lambda name: name.replace(".", "_").replace("-", "_")  # (as both tables name kernels)
  source = lambda name: sources.get(key(name), "")
  scopes = collections.Counter()
  rows = []
  for name, us in by_name.most_common():
    kind = kind_of[name]
    scopes[f"{kind} | {scope_of(source(name))}"] += us
    rows.append(f"{us / 1e3:.3f}\t{launches[name]}\t{us / total:.5f}\t{kind}\t{name}\t"
                f"{outputs.get(key(name), '')}\t{source(name)}")
  # Every kernel, for reading the step offline (time and launches over the traced steps, what
  # each writes); the compiled program beside it, for what each reads and computes.
  pathlib.Path(trace_dir, "kernels.tsv").write_text(
      "ms\tlaunches\tshare\tkind\tkernel\toutput\tsource\n" + "\n".join(rows) + "\n")
  if hlo:
    pathlib.Path(trace_dir, "step.hlo.txt").write_text(hlo)
  return {"device_ms": round(total / 1e3, 2),
          "share": {k: round(v / total, 4) for k, v in kinds.most_common()},
          # kind of kernel | the model's scope and pass it ran in, the largest first
          "by_scope": {k: round(v / total, 4) for k, v in scopes.most_common(24)},
          "top_kernels": [[n[:90], round(us / total, 4), source(n)[-110:]]
                          for n, us in by_name.most_common(40)]}


# The model's named scopes (jmoe/moe/layer.py, jmoe/train/step.py), innermost first wins.
SCOPES = ("optimizer", "route", "dispatch", "experts", "overflow", "combine")


def scope_of(op_name: str) -> str:
  """`jit(train_step)/transpose(jvp())/eval_jaxpr/experts/mul` -> `experts, backward`: the
  innermost of SCOPES in a kernel's JAX op name, and the pass (forward, backward) it ran in
  (what remat recomputes runs in the backward pass and counts there)."""
  if not op_name:
    return "unknown"
  parts = op_name.split(" @ ")[0].split("/")
  # (a scope right under a transform is written inside it: `transpose(jvp(experts))`)
  name = next((word for p in reversed(parts) for word in reversed(re.findall(r"\w+", p))
               if word in SCOPES), "rest")
  if name == "optimizer":
    return name
  step = ("backward" if any(p.startswith("transpose(") for p in parts)
          else "forward" if any(p.startswith("jvp(") for p in parts) else "")
  return f"{name}, {step}" if step else name
