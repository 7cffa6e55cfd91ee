"""Where a compiled program's temporary memory goes, read from XLA's dump of it.

XLA places every temporary buffer of a program at a fixed offset in one allocation, the
program's temporaries (`memory_analysis().temp_size_in_bytes`), which is as large as the highest
end of any buffer placed in it. Its dump (`--xla_dump_to`) writes, after optimization, the
buffer assignment (each buffer's size and offset) and the live ranges (the program order's
positions between which each buffer is live). From these, `temporaries`:

- the most bytes in use at once (the live peak: the bytes the live buffers cover, each once,
  since values that share a buffer overlap) and the position where that happens, with the
  largest buffers live there and the instruction that makes each;
- the allocation's size beside it: where it is larger, the difference is space the placement
  could not reuse (buffers of other sizes and lifetimes leave gaps), not data.

A buffer here is an HLO value: an instruction's output, or one element of a tuple it outputs.
The dump's text formats are XLA's; jmoe reads the lines it needs and names
the file when one is missing.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re

from jmoe.errors import ConfigError

_ALLOCATION = re.compile(r"allocation (\d+): size (\d+)(.*)")
_VALUE = re.compile(r"\s*value: <\d+ (\S+?)(\{[^}]*\})?(?: \(phi\))? @\d+> "
                    r"\(size=(\d+),offset=(\d+)\): (.*)")
_POSITION = re.compile(r"\s+(\d+):(\S+)$")
_RANGE = re.compile(r"\s+(\S+\{[^}]*\}):(\d+)-(\d+)$")
_INSTRUCTION = re.compile(r"\s+(?:ROOT )?%(\S+) = ")
_OP_NAME = re.compile(r"op_name=\"([^\"]*)\"")


@dataclasses.dataclass(frozen=True)
class Buffer:
  name: str  # instruction{tuple index}
  bytes: int
  shape: str
  start: int  # live from this position of the program order to `end`, both included
  end: int
  op: str = ""  # the JAX operation that made it (the instruction's op_name), when known
  offset: int = 0  # within the temporaries' allocation


@dataclasses.dataclass(frozen=True)
class Temporaries:
  allocation_bytes: int  # the temporaries' allocation as XLA placed it
  live_peak_bytes: int  # the most bytes in use at once
  peak_position: int
  peak_instruction: str  # the instruction at that position of the program order
  live_at_peak: tuple[Buffer, ...]  # largest first

  @property
  def unplaced_bytes(self) -> int:
    """The allocation beyond the live peak: gaps left by the placement."""
    return self.allocation_bytes - self.live_peak_bytes

  def by_shape(self) -> list[tuple[str, int, int]]:
    """(shape, count, bytes) of the buffers live at the peak, most bytes first."""
    groups = collections.defaultdict(lambda: [0, 0])
    for b in self.live_at_peak:
      key = b.shape.split("{")[0]
      groups[key][0] += 1
      groups[key][1] += b.bytes
    return sorted(((k, c, n) for k, (c, n) in groups.items()), key=lambda g: -g[2])


def dump_file(dump_dir: str, suffix: str) -> str:
  """The one file of `dump_dir` whose name ends with `suffix` (after optimizations)."""
  found = sorted(glob.glob(os.path.join(dump_dir, f"*after_optimizations{suffix}")))
  if not found:
    raise ConfigError(f"{dump_dir}: no XLA dump file ending in after_optimizations{suffix} "
                      "(compile with XLA_FLAGS=--xla_dump_to=DIR)")
  if len(found) > 1:
    raise ConfigError(f"{dump_dir}: several programs' dumps ({', '.join(map(os.path.basename, found))}); "
                      "dump one program per directory")
  return found[0]


def temporaries(dump_dir: str, hlo_text: str = "") -> Temporaries:
  """The temporaries of the one program dumped in `dump_dir` (see the module's docstring);
  `hlo_text`, the compiled program's text, names the JAX operation behind each buffer."""
  sizes, allocation = {}, 0
  in_temp = False
  with open(dump_file(dump_dir, "-buffer-assignment.txt")) as f:
    for line in f:
      m = _ALLOCATION.match(line)
      if m:
        in_temp = "preallocated-temp" in m.group(3)
        if in_temp:
          allocation = int(m.group(2))
        continue
      m = _VALUE.match(line)
      if m and in_temp and int(m.group(3)):
        sizes[m.group(1) + (m.group(2) or "{}")] = (int(m.group(3)), int(m.group(4)),
                                                     m.group(5))
  order, ranges = {}, {}
  with open(dump_file(dump_dir, "-live-range.txt")) as f:
    for line in f:
      m = _POSITION.match(line)
      if m:
        order[int(m.group(1))] = m.group(2)
        continue
      m = _RANGE.match(line)
      if m:
        ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
  missing = sorted(set(sizes) - set(ranges))
  if missing:
    raise ConfigError(f"{dump_dir}: the live ranges do not name {len(missing)} of the "
                      f"temporaries' buffers (first: {missing[0]}): not one program's dump?")
  ops = {m.group(1): (_OP_NAME.search(line) or [None, ""])[1]
         for line in hlo_text.splitlines() if (m := _INSTRUCTION.match(line))}
  buffers = [Buffer(name, size, shape, *ranges[name], op=ops.get(name.split("{")[0], ""),
                    offset=offset) for name, (size, offset, shape) in sizes.items()]
  starts = collections.defaultdict(list)
  for b in buffers:
    starts[b.start].append(b)
  live, peak, where = [], -1, 0
  for position in sorted(starts):  # the bytes in use can only grow where a buffer starts
    live = [b for b in live if b.end >= position] + starts[position]
    in_use = _covered(live)
    if in_use > peak:
      peak, where = in_use, position
  at_peak = sorted((b for b in buffers if b.start <= where <= b.end), key=lambda b: -b.bytes)
  return Temporaries(allocation, max(peak, 0), where, order.get(where, ""), tuple(at_peak))


def _covered(buffers: list[Buffer]) -> int:
  """Bytes of the allocation the buffers cover, each byte once (values that share a buffer, as a
  loop's state does, overlap)."""
  covered, reach = 0, 0
  for b in sorted(buffers, key=lambda b: b.offset):
    end = b.offset + b.bytes
    covered += max(0, end - max(b.offset, reach))
    reach = max(reach, end)
  return covered
