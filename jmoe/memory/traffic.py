"""Communication of a train step: the bytes each device sends per step, by collective kind, and
the all-to-all bytes against the bytes the routing must move.

Read from the compiled program (after XLA's optimizations, which move some collectives out of
loops), with each collective's dtype and kind as XLA had them right after SPMD partitioning: the
CPU build widens bfloat16 collectives to float32 and keeps all-reduces that a GPU build turns
into reduce-scatters, and the report is for GPUs. A collective over a group of n devices sends,
from each device:
  all-to-all          (n-1)/n of its operand (the block for itself stays)
  all-gather          (n-1)/n of the gathered result
  reduce-scatter      (n-1) x its result (also an all-reduce whose users only slice it, as the
                      GPU build makes one)
  all-reduce          2 (n-1)/n of its operand (a ring: reduce-scatter, then all-gather)
  collective-permute  its operand
Collectives in a loop count once per trip. The all-to-all dispatcher's later rounds run in loops
whose trip count depends on the routing: their bytes are reported apart, per round (one more
round in every MoE layer, forward and backward), as are those in conditionals (per-expert
blocks' overflow), as if taken. The exception: the 1F1B and interleaved pipeline loop's slots,
conditionals that run in a known share of the loop's ticks (`slot_shares`), count that often.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import tempfile

import jax
import numpy as np

from jmoe.config import Config
from jmoe.model.pipeline_1f1b import SLOTS
from jmoe.model.stages import Schedule
from jmoe.parallel import Layout

KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "s16": 2,
              "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
              "f64": 8, "c64": 8, "c128": 16}
SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
# The computations an instruction runs, by attribute, and how often: a loop's body once per
# trip, a conditional's branches if taken, the rest once.
CALLS = {"body": "loop", "branch_computations": "branch", "true_computation": "branch",
         "false_computation": "branch", "calls": "once", "to_apply": "once"}


@dataclasses.dataclass
class Traffic:
  """Bytes one device sends in a step, by collective kind (KINDS)."""
  every_step: dict[str, float]  # what every step sends
  per_round: dict[str, float]  # one more all-to-all dispatch round in every MoE layer
  if_taken: dict[str, float]  # in conditionals, when they are taken


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  type: str  # the result's HLO type
  op: str
  rest: str  # operands and attributes


def shape_bytes(text: str) -> int:
  """Bytes of the arrays an HLO type names, e.g. "(f32[10,32]{1,0}, s32[8])"."""
  total = 0
  for dtype, dims in SHAPE.findall(text):
    if dtype in ITEM_BYTES:
      total += ITEM_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def group_size(attributes: str) -> int:
  """The devices in each of a collective's replica groups (0: not given, every device)."""
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
  if mesh:  # mesh['a'=2,'b'=4] {'b'}
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", mesh.group(2)))
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attributes)
  if iota:  # [groups,size]<=[devices]
    return int(iota.group(2))
  listed = re.search(r"replica_groups=\{\{([^}]*)\}", attributes)
  return len(listed.group(1).split(",")) if listed else 0


def sent_bytes(kind: str, result_bytes: int, n: int) -> float:
  if n <= 1:
    return 0.0
  return {"all-to-all": result_bytes * (n - 1) / n, "all-gather": result_bytes * (n - 1) / n,
          "reduce-scatter": result_bytes * (n - 1), "all-reduce": 2 * result_bytes * (n - 1) / n,
          "collective-permute": float(result_bytes)}[kind]


def parse(hlo: str) -> tuple[dict[str, list[Instruction]], str]:
  """The computations of an HLO module's text, by name, and the entry computation's name."""
  computations: dict[str, list[Instruction]] = {}
  entry, current = "", None
  for line in hlo.splitlines():
    header = HEADER.match(line)
    if header:
      current = computations.setdefault(header.group(1), [])
      entry = header.group(1) if line.startswith("ENTRY") else entry
      continue
    m = INSTRUCTION.match(line)
    if m and current is not None:
      current.append(Instruction(*m.groups()))
  return computations, entry


def op_name(instruction: Instruction) -> str:
  m = re.search(r'op_name="([^"]*)"', instruction.rest)
  return m.group(1) if m else ""


@dataclasses.dataclass(frozen=True)
class AsPartitioned:
  """A collective as it was right after partitioning."""
  kind: str  # reduce-scatter for an all-reduce whose users only slice it
  item_bytes: int  # of its dtype


def collective_key(i: Instruction) -> tuple[str, str, bool]:
  """A collective's op, source op name and whether it moves floats: the same before and after
  XLA's later passes (which may widen floats, or split an all-to-all into a tuple)."""
  dtypes = SHAPE.findall(i.type)
  return i.op, op_name(i), bool(dtypes) and dtypes[0][0][0] in "fb"


# Ops that only lay a value out anew: a reduction whose value reaches only slices through them
# is a reduce-scatter all the same.
RELAYOUTS = ("transpose", "copy", "reshape", "bitcast")


def as_partitioned(hlo: str) -> dict[tuple[str, str, bool], AsPartitioned]:
  """Kind and dtype size of the partitioned program's collectives, by `collective_key`."""
  facts = {}
  for instructions in parse(hlo)[0].values():
    def users(name):
      return [u for u in instructions if re.search(rf"%{re.escape(name)}(?![\w.\-])", u.rest)]

    def only_sliced(name, depth=4):
      found = users(name)
      return bool(found) and all(u.op == "dynamic-slice" or (
          u.op in RELAYOUTS and depth and only_sliced(u.name, depth - 1)) for u in found)

    for i in instructions:
      if i.op not in KINDS:
        continue
      slices = i.op == "all-reduce" and only_sliced(i.name)
      dtypes = SHAPE.findall(i.type)
      facts[collective_key(i)] = AsPartitioned(
          "reduce-scatter" if slices else i.op, ITEM_BYTES.get(dtypes[0][0], 0) if dtypes else 0)
  return facts


def matching(facts: dict[tuple[str, str, bool], AsPartitioned], key: tuple[str, str, bool]
             ) -> AsPartitioned | None:
  """The partitioned program's collective of this key: the same op and kind of values, with the
  longest op name that ends the compiled one's (inside `shard_map` the partitioned program
  names ops from the body's scopes, the compiled one from the whole step's)."""
  op, name, floats = key
  found = [(len(n), fact) for (o, n, f), fact in facts.items()
           if o == op and f == floats and n and (name == n or name.endswith("/" + n))]
  return max(found, key=lambda x: x[0])[1] if found else None


def combined(i: Instruction) -> list[tuple[str, str]]:
  """The (type, op name) of each collective a compiled one is made of: XLA's combiners join
  several into one of a tuple type, named "PREFIX/(a:b:...)" for PREFIX/a, PREFIX/b, ...;
  otherwise the instruction itself."""
  name = op_name(i)
  joined = re.fullmatch(r"(.*?)/\((.*)\)", name)
  types = [f"{dtype}[{dims}]" for dtype, dims in SHAPE.findall(i.type)]
  if joined and ":" in joined.group(2):
    names = [f"{joined.group(1)}/{n}" for n in joined.group(2).split(":")]
    if len(names) == len(types):
      return list(zip(types, names))
  return [(i.type, name)]


def trip_count(loop: Instruction, computations: dict[str, list[Instruction]]) -> int | None:
  """A loop's trip count: XLA's annotation, or the constant a scan's condition compares its
  counter with (None when it compares with a value of the loop, as the rounds' loop does)."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.rest)
  if known:
    return int(known.group(1))
  condition = computations.get(re.search(r"\bcondition=%([\w.\-]+)", loop.rest).group(1), [])
  compares = [i for i in condition if i.op == "compare"]
  constants = {i.name: int(re.match(r"(-?\d+)", i.rest).group(1)) for i in condition
               if i.op == "constant" and i.type.startswith("s32[]")}
  if len(compares) != 1 or "direction=LT" not in compares[0].rest:
    return None
  operands = re.findall(r"%([\w.\-#]+)", compares[0].rest.split(")")[0])
  limits = [constants[o] for o in operands if o in constants]
  return limits[0] if len(limits) == 1 else None


def collective_traffic(hlo: str, num_devices: int, partitioned: str = "",
                       branch_share: dict[str, float] | None = None) -> Traffic:
  """The bytes per device of a compiled program's collectives (`hlo`: its optimized HLO text;
  `partitioned`: the same program right after SPMD partitioning, for dtypes and kinds).
  `branch_share`: for a conditional made directly under a named scope of these (its op_name),
  the share of the enclosing loop's trips in which it runs its branch: its collectives count in
  every step's bytes that often; other conditionals' (those nested in its branches too) count
  apart, once, as if taken."""
  computations, entry = parse(hlo)
  facts = as_partitioned(partitioned) if partitioned else {}
  traffic = Traffic({k: 0.0 for k in KINDS}, {k: 0.0 for k in KINDS}, {k: 0.0 for k in KINDS})

  def bytes_sent(i: Instruction) -> list[tuple[str, float]]:
    n, sent = group_size(i.rest) or num_devices, []
    for type_, name in combined(i):
      kind, result, dtypes = i.op, shape_bytes(type_), SHAPE.findall(type_)
      fact = matching(facts, (i.op, name, bool(dtypes) and dtypes[0][0][0] in "fb"))
      if fact and fact.item_bytes and dtypes and ITEM_BYTES.get(dtypes[0][0]):
        # Only the CPU build's widening is undone: later passes may also narrow a collective
        # (moving a cast before it), as a GPU build does too.
        result = result * min(1.0, fact.item_bytes / ITEM_BYTES[dtypes[0][0]])
      if fact and fact.kind == "reduce-scatter":  # each device keeps 1/n of the sum
        kind, result = "reduce-scatter", result / n
      sent.append((kind, sent_bytes(kind, result, n)))
    return sent

  def visit(name: str, times: float, bucket: dict[str, float]):
    for i in computations.get(name, ()):
      if i.op in KINDS:
        for kind, sent in bytes_sent(i):
          bucket[kind] += times * sent
        continue
      for attribute, how in CALLS.items():
        called = re.search(rf"\b{attribute}=(\{{[^}}]*\}}|%[\w.\-]+)", i.rest)
        for callee in re.findall(r"%([\w.\-]+)", called.group(1)) if called else ():
          if how == "loop":
            trips = trip_count(i, computations)
            if trips is None:  # a dispatch round loop: its bytes per trip
              visit(callee, times, traffic.per_round)
            else:
              visit(callee, times * trips, bucket)
          elif how == "branch":
            share = scope_share(i, branch_share or {})
            if share is None:
              visit(callee, times, traffic.if_taken)
            else:
              visit(callee, times * share, bucket)
          elif i.op not in ("reduce", "sort", "scatter", "reduce-window", "select-and-scatter"):
            visit(callee, times, bucket)

  visit(entry, 1.0, traffic.every_step)
  return traffic


def scope_share(i: Instruction, shares: dict[str, float]) -> float | None:
  """The share of `shares` whose scope holds the conditional itself (its op_name ends in
  SCOPE/cond), else None: conditionals nested in a slot's branch are not the slot's."""
  op_name = re.search(r'op_name="([^"]*)"', i.rest)
  scopes = op_name.group(1).split("/")[-2:] if op_name else []
  return next((share for scope, share in shares.items() if scopes == [scope, "cond"]), None)


def slot_shares(config: Config, layout: Layout) -> dict[str, float]:
  """Under the 1F1B and interleaved schedules, the share of the loop's ticks that run each slot
  (jmoe/model/pipeline_1f1b.py): forward and backward R M + S - 1 each, the loss M (each
  micro-batch once, as it leaves its last repeat); nothing under GPipe (no conditionals)."""
  if layout.stages == 1 or config.parallel.schedule == "gpipe":
    return {}
  m = config.train.num_micro_batches
  schedule = Schedule(layout.stages, config.parallel.pipeline_repeats, m,
                      kind=config.parallel.schedule)
  runs = (schedule.slots, m, schedule.slots)
  return {slot: n / schedule.iterations for slot, n in zip(SLOTS, runs)}


def compiled_texts(config: Config, layout: Layout) -> tuple[str, str]:
  """The config's train step on `layout`, compiled: its optimized HLO text, and the HLO text
  right after SPMD partitioning (dumped by the same compile to a temporary directory; empty on
  one device, where nothing is partitioned)."""
  return compiled_program(config, layout)[1:]


def compiled_program(config: Config, layout: Layout) -> tuple[Config, str, str]:
  """`compiled_texts`, after the config with its pipeline schedule resolved as training resolves
  it (`auto`: GPipe, or the bounded schedule where GPipe's step does not fit the device)."""
  from jmoe.memory.estimate import resolved_step
  from jax.experimental.compilation_cache import compilation_cache
  cached = jax.config.jax_enable_compilation_cache
  # A program from the persistent cache dumps nothing: compile afresh (the cache decides once
  # per process whether it is used, so it is reset on the way in and out).
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    with tempfile.TemporaryDirectory() as directory:
      config, compiled = resolved_step(config, layout, {
          "xla_dump_to": directory, "xla_dump_hlo_as_text": True,
          "xla_dump_hlo_pass_re": "spmd-partitioning"})
      dumps = sorted(pathlib.Path(directory).glob("*train_step*after_spmd-partitioning*.txt"))
      partitioned = dumps[-1].read_text() if dumps else ""
  finally:
    jax.config.update("jax_enable_compilation_cache", cached)
    compilation_cache.reset_cache()
  if layout.mesh.size > 1 and not partitioned:
    raise RuntimeError("XLA wrote no HLO after SPMD partitioning: the collectives' dtypes "
                       "cannot be read (is XLA_FLAGS' --xla_dump_to set elsewhere?)")
  return config, compiled.as_text(), partitioned


def routed_bytes(config: Config, layout: Layout) -> float:
  """Bytes per device per step of the token copies routed to other devices' experts (by a
  balanced routing: (EP-1)/EP of them), each crossing four times per MoE layer (to the experts
  and back, forward and backward), in the compute dtype."""
  axes = layout.expert_axes
  ep = axes.num_expert_shards
  tokens = config.train.batch_size * config.data.seq_len / layout.mesh.size
  copies = tokens * axes.num_tensor_shards * config.moe.top_k * (ep - 1) / ep
  moe_layers = config.moe_layers + config.model.mtp_depth
  item = np.dtype(jax.numpy.dtype(config.precision.compute)).itemsize
  return 4 * moe_layers * copies * config.model.d_model * item


def communication(config: Config, layout: Layout) -> dict:
  """Compiles the config's train step on `layout` and reports its collectives' bytes per device
  (one JSON-ready dict; `all_to_all_over_routed` is None without expert parallelism)."""
  resolved, optimized, partitioned = compiled_program(config, layout)
  traffic = collective_traffic(optimized, layout.mesh.size, partitioned,
                               slot_shares(resolved, layout))
  routed = routed_bytes(config, layout)
  return {
      "bytes_per_device": {k: round(v) for k, v in traffic.every_step.items()},
      "per_overflow_round": {k: round(v) for k, v in traffic.per_round.items() if v},
      "in_conditionals": {k: round(v) for k, v in traffic.if_taken.items() if v},
      "routed_bytes": round(routed),
      "all_to_all_over_routed": (round(traffic.every_step["all-to-all"] / routed, 4)
                                 if routed else None),
  }
