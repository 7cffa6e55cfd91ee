"""The walk's values and its pass over one program's buffers (jmoe/memory/walk.py): which values
get a buffer of their own, when each dies, and the most bytes live at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jmoe.memory.flat import ALIASES, ELEMENTWISE, FUSING_CONSUMERS, Flat, is_literal, values


@dataclasses.dataclass
class Value:
  bytes: int  # per device, as stored (0: fused into its consumers, or in host memory)
  d: int | None  # devices it is split across (None: not known yet)
  kind: str
  what: str = ""  # its shape and where it is made, for the list of the largest
  const: bool = False  # made from constants alone


@dataclasses.dataclass
class Walk:
  peak: int  # the most bytes live at once, beyond the jaxpr's inputs
  at_peak: dict[str, int]  # those bytes by category
  host: int
  where: str
  outs: list[Value]
  largest: list[Value] = dataclasses.field(default_factory=list)  # live at the peak
  backward: bool = False  # whether the peak is in the backward pass


def written_in_place(jaxpr: Flat, in_place, uses: dict) -> set:
  """The values written straight into donated or loop buffers: the outputs said so, and what
  only elementwise ops (reshapes, converts) lie between them and such an output."""
  in_place = set(in_place)
  for eqn in reversed(jaxpr.eqns):
    if eqn.name in ELEMENTWISE and len(eqn.outvars) == 1 and eqn.outvars[0] in in_place:
      in_place.update(v for v in values(eqn.invars) if len(uses.get(v, [])) == 1)
  return in_place


def storage(jaxpr: Flat, env: dict, uses: dict) -> tuple[list[list[bool]], dict[Any, int]]:
  """Which outputs get a buffer of their own, and each value's last use: its last consumer or,
  when that consumer fuses into later ones, theirs (a fused op reads its inputs when the kernel
  it joins runs)."""
  eqns, outvars = jaxpr.eqns, set(values(jaxpr.outvars))
  made = set(jaxpr.invars)  # values with a buffer of their own so far

  def stored(i: int, v) -> bool:
    eqn = eqns[i]
    if eqn.name in ALIASES:  # its operand's buffer, unless an output that buffer is not
      return v in outvars and not (eqn.invars and eqn.invars[0] in made)
    if v in outvars:
      return True
    if env[v].const:
      return False
    users = uses.get(v, [])
    if eqn.fused:  # inside a fused kernel only what leaves it is stored
      return any(not eqns[j].fused for j in users)
    if eqn.name not in ELEMENTWISE:
      return True
    return any(eqns[j].name not in FUSING_CONSUMERS for j in users)

  kept = []
  for i, eqn in enumerate(eqns):
    kept.append([stored(i, v) for v in eqn.outvars])
    made.update(v for v, k in zip(eqn.outvars, kept[i]) if k)
  last_use: dict[Any, int] = {v: len(eqns) for v in outvars}
  for i in reversed(range(len(eqns))):
    until = i if any(kept[i]) else max([i] + [last_use.get(v, i) for v in eqns[i].outvars])
    for v in values(eqns[i].invars):
      last_use[v] = max(last_use.get(v, -1), until)
  return kept, last_use


def live(jaxpr: Flat, env: dict, inners: list[Walk], last_use: dict) -> Walk:
  """Runs the program over its buffers: the most bytes live at once, what they are, and where."""
  dies_after: dict[int, list] = {}
  for v, i in last_use.items():
    dies_after.setdefault(i, []).append(v)
  live: dict[Any, Value] = {}
  by_kind: dict[str, int] = {}
  current, peak, host, where, backward = 0, 0, 0, "", False
  at_peak: dict[str, int] = {}
  largest: list[Value] = []
  for i, (eqn, inner) in enumerate(zip(jaxpr.eqns, inners)):
    new = [env[v] for v in eqn.outvars]
    for value in new:
      if value.kind == "host":
        host, value.bytes = host + value.bytes, 0
    made = sum(value.bytes for value in new)
    # A loop's stacked outputs exist before its first step; a call's outputs are counted by its
    # own walk (they are made inside it).
    moment = current + (made + inner.peak if eqn.name in ("scan", "while")
                        else max(made, inner.peak))
    if moment > peak:
      peak, where = moment, inner.where or eqn.source
      backward = inner.backward or eqn.backward
      at_peak = dict(by_kind)
      for kind, b in list(inner.at_peak.items()) + [(x.kind, x.bytes) for x in new]:
        at_peak[kind] = at_peak.get(kind, 0) + b
      largest = sorted([*live.values(), *new, *inner.largest], key=lambda x: -x.bytes)[:40]
    host += inner.host
    for v in eqn.outvars:
      if env[v].bytes and v in last_use:
        live[v] = env[v]
        current += env[v].bytes
        by_kind[env[v].kind] = by_kind.get(env[v].kind, 0) + env[v].bytes
    for v in dies_after.get(i, ()):
      if v in live:
        value = live.pop(v)
        current -= value.bytes
        by_kind[value.kind] -= value.bytes
  outs = [Value(0, 1, "activations") if is_literal(v) else env[v] for v in jaxpr.outvars]
  return Walk(peak=peak, at_peak=at_peak, host=host, where=where, outs=outs, largest=largest,
               backward=backward)
