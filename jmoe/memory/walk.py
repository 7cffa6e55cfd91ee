"""How a traced program holds memory: the walk behind jmoe.memory.estimate.

A jaxpr, its calls inlined (`flatten`, flat.py), is run over its buffers in program order as
XLA's buffer assignment would see it (`Walker`): a value that must exist in memory is allocated
by the op that makes it and freed after its last use. What the walk assumes of XLA:

- elementwise ops, broadcasts and converts fuse into the ops that read them when those can take
  them (elementwise ops, reductions), so their results are not stored; operands of GEMMs, sorts,
  gathers, scatters, collectives and loops are; reshapes and sharding constraints are their
  operand's buffer; values made from constants alone are folded;
- a fused kernel (cuDNN attention; what runs under the `fused_attention` name scope, gpu.py)
  keeps only the values that leave it;
- a loop allocates its stacked outputs before its first step and each step writes its slice in
  place; stacked weights its grouped GEMMs read transposed get one transposed copy of the stack;
  a carry is split as finely as its start or what a step makes of it, whichever is finer;
- per device, a value takes its global bytes over the number of devices it is split across: known
  exactly for the inputs, every `constrain`ed activation and everything inside `shard_map`;
  elsewhere taken from the value's operands or from what it feeds (weight-shaped values are
  placed like the weights);
- on CPUs, XLA's ragged dot is one dense product per group and 16-bit products run in float32.

Each stored value gets a category (jmoe.memory.estimate.CATEGORIES): from the named scope it is
made under (flat.py), or as a gradient or weight copy by its shape and dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from jmoe.memory.flat import (ALIASES, UPDATES, Eqn, Flat, Where, divisor, flatten, is_literal,
                              nbytes, operands_of, scan_counts, uses_of, values)
from jmoe.memory.liveness import Value, Walk, live, storage, written_in_place


class Walker:

  def __init__(self, mesh_shape: dict[str, int], weights: dict[tuple[int, ...], tuple[int, Any]],
               platform: str):
    self.mesh_shape = mesh_shape
    self.platform = platform
    self.num_devices = math.prod(mesh_shape.values())
    self.weights = weights

  def walk(self, jaxpr: Flat, env: dict, *, in_place=frozenset(), local: bool = False,
           outer_split: int = 1) -> Walk:
    """Walks `jaxpr` whose inputs `env` are allocated by the caller (and stay so). `local`: inside
    shard_map, where shapes are per device. `in_place`: outputs written over donated or loop
    buffers. `outer_split`: how finely the caller's values are split, for values nothing places."""
    uses = uses_of(jaxpr)
    in_place = written_in_place(jaxpr, in_place, uses)
    fallback = max([env[v].d or 1 for v in jaxpr.invars if v in env] + [outer_split])
    inners = self._place(jaxpr, env, uses, in_place, local, fallback)
    stored, last_use = storage(jaxpr, env, uses)
    for eqn, keep in zip(jaxpr.eqns, stored):
      for v, kept in zip(eqn.outvars, keep):
        env[v].bytes = nbytes(v.aval, env[v].d or fallback) if kept and v not in in_place else 0
    return live(jaxpr, env, inners, last_use)

  def _place(self, jaxpr: Flat, env: dict, uses: dict, in_place: set, local: bool,
             fallback: int) -> list[Walk]:
    """Puts each equation's outputs in `env` (split, category) and returns what each needs
    inside. A value nothing places takes the split of what it feeds, as XLA's sharding
    propagation goes both ways; failing that, the split of this jaxpr's inputs."""
    eqns, outvars = jaxpr.eqns, set(values(jaxpr.outvars))
    inners = []
    for eqn in eqns:
      outs, inner = self._eqn(eqn, [None if is_literal(v) else env.get(v) for v in eqn.invars],
                              local, fallback, [v in in_place for v in eqn.outvars])
      inners.append(inner)
      # A value made from constants alone is folded or made where it is used, never stored.
      const = not eqn.subs and all(is_literal(v) or (v in env and env[v].const)
                                   for v in eqn.invars)
      for v, value in zip(eqn.outvars, outs):
        env[v] = dataclasses.replace(value, what=f"{v.aval.str_short()} {eqn.source}",
                                     const=value.const or const)

    def fed(v, depth: int = 4) -> list[int]:  # the splits of what v feeds, a few steps on
      found = []
      for j in uses.get(v, []):
        for w in eqns[j].outvars:
          found += [env[w].d] if env[w].d is not None else fed(w, depth - 1) if depth else []
      return found

    # A broadcast (a mask) is split as its operand, what it feeds, or this program's values of
    # its shape, whichever is finest: XLA propagates the values' placement onto the mask.
    alike: dict[tuple, int] = {}
    for v in (w for eqn in eqns for w in eqn.outvars if env[w].d):
      alike[v.aval.shape] = max(alike.get(v.aval.shape, 1), env[v].d)
    for eqn in reversed(eqns):
      src = eqn.invars[0] if eqn.name == "broadcast_in_dim" else None
      x = None if src is None or is_literal(src) else env.get(src)
      floor = [x.d, alike.get(eqn.outvars[0].aval.shape, 1)] if x is not None and x.d else []
      for v in eqn.outvars:
        if env[v].d is None:  # an output of this jaxpr nothing places is left to the caller
          env[v].d = 1 if local else max(fed(v) + floor,
                                         default=None if v in outvars else fallback)
    return inners

  # -- one equation: its outputs' placement and kind, and what it needs inside
  def _eqn(self, eqn: Eqn, ins: list[Value | None], local: bool, split: int,
           out_in_place: list[bool]):
    name = eqn.name
    empty = Walk(0, {}, 0, "", [])
    if name == "shard_map":
      return self._shard_map(eqn, ins, out_in_place)
    if name == "scan":
      return self._scan(eqn, ins, local, split)
    subs = [] if eqn.fused else eqn.subs  # a fused kernel's insides are its own
    if subs:  # while, cond: the largest of the bodies or branches
      results = []
      for sub, sub_ins in zip(subs, operands_of(eqn, ins)):
        flat = flatten(sub, Where(backward=eqn.backward, kind=eqn.where.kind))
        sub_env = {v: (value or Value(0, None, "activations"))
                   for v, value in zip(flat.invars, sub_ins)}
        results.append(self.walk(flat, sub_env, local=local,
                                 outer_split=max(split, self._split_of(ins))))
      inner = max(results, key=lambda r: r.peak)
      if name == "while":
        inner = self._materialised(eqn, ins, inner)
      outs = []
      for k, v in enumerate(eqn.outvars):
        options = [r.outs[k] for r in results if k < len(r.outs)]
        value = max(options, key=lambda o: o.d or 0) if options else Value(0, 1, "activations")
        outs.append(Value(0, value.d, value.kind, const=value.const))
      return outs, inner
    if name == "ragged_dot_general" and self.platform == "cpu":
      empty = self._ragged_on_cpu(eqn, local, split)
    elif name == "dot_general" and self.platform == "cpu":
      empty = self._dot_on_cpu(eqn, ins, local, split)
    kind = self._kind(eqn)
    to_host = name == "device_put" and any(memory in str(eqn.params.get("devices"))
                                           for memory in ("Host", "pinned_host"))
    outs = []
    for v in eqn.outvars:
      value_kind = "host" if to_host else (
          self._weight_kind(v.aval, local) if kind == "activations" else kind)
      outs.append(Value(0, self._out_divisor(eqn, v, ins, local), value_kind))
    return outs, empty

  def _ragged_on_cpu(self, eqn, local: bool, split: int) -> Walk:
    """XLA's CPU backend runs a ragged dot as one dense float32 product per group over all the
    rows: each row-indexed operand and result exists once per group while it runs."""
    groups = eqn.invars[2].aval.shape[-1]  # [batch..., groups] where the dot is batched (vmap)
    _, (batch, _) = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
    rows = [v.aval for v in (*eqn.invars[:2], *eqn.outvars) if len(v.aval.shape) == 2 + len(batch)]
    # in float32, whatever the operands' type (as every CPU product)
    b = sum(groups * nbytes(aval, 1 if local else split) * 4 // np.dtype(aval.dtype).itemsize
            for aval in rows)
    return Walk(b, {"activations": b}, 0, eqn.source, [])

  def _dot_on_cpu(self, eqn, ins, local: bool, split: int) -> Walk:
    """XLA's CPU backend multiplies 16-bit floats in float32: operands and result are converted
    copies while the product runs."""
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
    if all(np.dtype(a.dtype).itemsize >= 4 for a in avals):
      return Walk(0, {}, 0, "", [])
    splits = [x.d if x is not None and x.d else split for x in ins] + [split]
    b = sum(nbytes(a, 1 if local else d) * 4 // np.dtype(a.dtype).itemsize
            for a, d in zip(avals, splits) if np.dtype(a.dtype).itemsize < 4)
    return Walk(b, {"activations": b}, 0, eqn.source, [])

  def _split_of(self, ins: list[Value | None]) -> int:
    return max([x.d for x in ins if x is not None and x.d is not None], default=1)

  def _weight_kind(self, aval, local: bool) -> str:
    """A weight-shaped value outside shard_map: a gradient (in the weights' dtype) or a copy of
    a weight in another dtype; anything else is an activation."""
    shape = tuple(getattr(aval, "shape", ()))
    if local or len(shape) < 2 or shape not in self.weights:
      return "activations"
    return "gradients" if np.dtype(aval.dtype) == np.dtype(self.weights[shape][1]) \
        else "weight copies"

  def _kind(self, eqn: Eqn) -> str:
    return eqn.where.kind or "activations"

  def _out_divisor(self, eqn, v, ins, local: bool) -> int:
    if local:
      return 1
    if eqn.name == "sharding_constraint":
      spec = eqn.params["sharding"].spec
      d = divisor(spec, self.mesh_shape)
      if any(entry is P.UNCONSTRAINED for entry in spec):  # the rest stays as it came
        d = max(d, self._split_of(ins))
      return d
    shape = tuple(getattr(v.aval, "shape", ()))
    if eqn.name == "iota":  # placed by what it feeds
      return None
    if len(shape) > 1 and shape in self.weights:
      return self.weights[shape][0]
    if eqn.name == "broadcast_in_dim" and math.prod(shape) > math.prod(eqn.invars[0].aval.shape):
      return None  # placed by what it feeds (a mask is split as the values it selects)
    if eqn.name in UPDATES:  # a buffer is split at least as finely as what is written into it
      return max([x.d for x in (ins[0], ins[UPDATES[eqn.name]]) if x and x.d] or [None])
    # A smaller input that is whole on every device (a mask, a scale) says nothing about where
    # what it is broadcast into lives.
    size = math.prod(shape)
    known = [(x, value.d) for x, value in zip(eqn.invars, ins)
             if value is not None and value.d is not None
             and (value.d > 1 or math.prod(getattr(x.aval, "shape", ())) >= size)]
    same = [d for x, d in known if tuple(getattr(x.aval, "shape", ())) == shape]
    if same:
      return max(same)
    return min(self.num_devices, max(d for _, d in known)) if known else None

  def _shard_map(self, eqn: Eqn, ins, out_in_place: list[bool]):
    body = flatten(eqn.subs[0], Where(backward=eqn.backward, kind=eqn.where.kind))
    # Inside, a value's shape is one device's over the manual axes; the other (auto) axes still
    # split it as they split the operands (a hand-off between pipeline stages, manual over the
    # stage axis only, keeps the stage's split).
    manual = eqn.params.get("newly_manual_axes") or set(self.mesh_shape)
    auto = math.prod(n for a, n in self.mesh_shape.items() if a not in manual)
    specs = eqn.params["in_specs"]
    env = {v: Value(0, 1 if auto == 1 else max(1, (value.d or 1) // divisor(spec, self.mesh_shape))
                    if value else None, value.kind if value else "activations")
           for v, value, spec in zip(body.invars, ins, specs)}
    kept = {v for v, flag in zip(body.outvars, out_in_place) if flag and not is_literal(v)}
    inner = self.walk(body, env, local=auto == 1, in_place=kept)
    outs = []
    for v, spec, value in zip(eqn.outvars, eqn.params["out_specs"], inner.outs):
      d = divisor(spec, self.mesh_shape) * (1 if auto == 1 else min(auto, value.d or 1))
      weight_kind = self._weight_kind(v.aval, False)  # expert gradients leave through here
      kind = value.kind if value.kind == "optimizer update" or weight_kind == "activations" \
          else weight_kind
      outs.append(Value(0, d, kind, const=value.const))
    return outs, inner

  def _materialised(self, eqn: Eqn, ins, inner: Walk) -> Walk:
    """A loop's operands are buffers of their own: the values that were fused into their
    consumers (a broadcast of zeros) or read in place (a layer's slice of a scan's stacks) are
    made in full before it, and live while it runs."""
    extra: dict[str, int] = {}
    seen = set()
    for v, value in zip(eqn.invars, ins):
      if is_literal(v) or v in seen or value is None or value.bytes or value.kind == "host":
        continue
      seen.add(v)
      kind = "weight copies" if value.kind == "parameters" else value.kind
      extra[kind] = extra.get(kind, 0) + nbytes(v.aval, value.d or 1)
    if not extra:
      return inner
    at_peak = dict(inner.at_peak)
    for kind, b in extra.items():
      at_peak[kind] = at_peak.get(kind, 0) + b
    return dataclasses.replace(inner, peak=inner.peak + sum(extra.values()), at_peak=at_peak)

  def _scan(self, eqn: Eqn, ins, local: bool, split: int):
    body = flatten(eqn.subs[0], Where(backward=eqn.backward, kind=eqn.where.kind))
    # Each step's stacked outputs are written straight into the loop's output buffers.
    length = eqn.params["length"]
    stacked = {v for v, out in zip(body.outvars, eqn.outvars)
               if not is_literal(v) and tuple(out.aval.shape) == (length, *v.aval.shape)}
    (first, count), ins = scan_counts(eqn.params), list(ins)
    for _ in range(2):  # a carry is placed as finely as its start or what a step makes of it
      env = {v: value or Value(0, None, "activations") for v, value in zip(body.invars, ins)}
      inner = self.walk(body, env, local=local, in_place=stacked,
                        outer_split=max(split, self._split_of(ins)))
      finer = [k for k in range(first, first + count) if ins[k] is not None
               and (inner.outs[k - first].d or 0) > (ins[k].d or 1)]
      if not finer:
        break
      ins = [x if k not in finer else dataclasses.replace(x, d=inner.outs[k - first].d)
             for k, x in enumerate(ins)]
    hoisted = self._transposed_stacks(body, ins, length, local, split)
    if hoisted:
      inner = dataclasses.replace(inner, peak=inner.peak + hoisted,
                                  at_peak={**inner.at_peak, "weight copies":
                                           inner.at_peak.get("weight copies", 0) + hoisted})
    return [Value(0, value.d, value.kind) for value in inner.outs], inner

  def _transposed_stacks(self, body: Flat, ins, length: int, local: bool, split: int) -> int:
    """Bytes of the stacked operands (a stack of layers' weights) that the loop reads in another
    layout: XLA lays such an operand out as its products want it, one transposed copy of the
    whole stack made before the loop."""
    copied = set()

    def visit(flat: Flat, origin: dict) -> None:  # origin: value -> index of the loop input
      for eqn in flat.eqns:
        known = lambda v: not is_literal(v) and v in origin
        if eqn.name in ALIASES and eqn.invars and known(eqn.invars[0]):
          origin[eqn.outvars[0]] = origin[eqn.invars[0]]
        if eqn.name == "shard_map":  # the stack's slice, and reshapes of it, in and out
          inner = flatten(eqn.subs[0])
          inner_origin = {w: origin[v] for v, w in zip(eqn.invars, inner.invars) if known(v)}
          visit(inner, inner_origin)
          origin.update((v, inner_origin[w]) for v, w in zip(eqn.outvars, inner.outvars)
                        if not is_literal(w) and w in inner_origin)
        rhs = None
        if eqn.name == "ragged_dot_general" and len(eqn.invars[1].aval.shape) == 3:
          (_, (contract,)), _ = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
          if contract == 2:  # read as [group, N, K]
            rhs = eqn.invars[1]
        elif eqn.name == "transpose" and not eqn.fused:
          rhs = eqn.invars[0]
        if rhs is not None and known(rhs):
          copied.add(origin[rhs])

    visit(body, dict(zip(body.invars, range(len(body.invars)))))
    copied = {k for k in copied if ins[k] is not None and len(body.invars[k].aval.shape) >= 2
              and ins[k].kind in ("parameters", "gradients", "weight copies")}
    return sum(length * nbytes(body.invars[k].aval, 1 if local else (ins[k].d or split))
               for k in copied)
