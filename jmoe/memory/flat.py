"""A traced program flattened for the memory walk: calls inlined, each equation marked with where
it runs (inside a fused kernel, in the backward pass) and what its values are, by name scope.

The kind of a value comes from the named scopes it is made under, never from file names: the MoE
layer's `dispatch` and `combine` stages make dispatch buffers, the train step's `optimizer` scope
the optimizer update (jmoe/moe/layer.py, jmoe/train/step.py); the rest are activations unless
the walk places them as gradients or weight copies.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from jax.extend.core import Literal
from jax.sharding import PartitionSpec as P

from jmoe.memory.gpu import FUSED_SCOPE

SCOPE_KINDS = {"dispatch": "dispatch buffers", "overflow": "dispatch buffers",
               "combine": "dispatch buffers", "optimizer": "optimizer update"}

# Op classes, as XLA's fusion treats them (the walk's rules read these).
ELEMENTWISE = {
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "div", "eq", "erf", "erf_inv",
    "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le",
    "lgamma", "digamma", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg",
    "nextafter", "not", "or", "pow", "real", "reduce_precision", "rem", "round", "rsqrt",
    "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin",
    "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor", "one_minus_square",
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "iota", "transpose", "pvary",
    "pcast", "bitcast_convert_type", "optimization_barrier", "add_any",
}
# Ops whose result is their operand's buffer, seen anew (a layout constraint, a reshape).
ALIASES = {"sharding_constraint", "reshape", "squeeze", "expand_dims", "pvary", "pcast",
            "optimization_barrier"}
# Ops that take fused elementwise producers as their inputs.
FUSING_CONSUMERS = ELEMENTWISE | {
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "argmax", "argmin", "slice", "dynamic_slice", "concatenate", "pad", "cumsum", "cumlogsumexp",
    "cummax", "cumprod",
}

# Ops that write into their first operand: the position of what they write.
UPDATES = {"scatter": 2, "scatter-add": 2, "scatter_add": 2, "dynamic_update_slice": 1}


# Kernels whose jaxpr describes one program instance, not memory: only their outputs count.
KERNELS = ("pallas_call", "triton_kernel_call", "mosaic_gpu_call")
# Walked as what they are; every other call (jit, custom derivatives, checkpoint) is inlined,
# as XLA inlines it, so that fusion sees across it.
STRUCTURED = ("scan", "while", "cond", "shard_map")


class Var:
  """A value of the flattened program (a jaxpr Var can appear in several inlined copies)."""
  __slots__ = ("aval",)

  def __init__(self, aval):
    self.aval = aval


@dataclasses.dataclass(frozen=True)
class Where:
  """Where an equation runs."""
  fused: bool = False  # inside a fused kernel (only what leaves it is stored)
  backward: bool = False  # part of the backward pass
  kind: str | None = None  # what its values are, from the named scopes (SCOPE_KINDS)

  def inside(self, name_stack: str) -> Where:
    """This place refined by an equation's name stack, e.g. "transpose(jvp(moe/dispatch))"."""
    scopes = re.split(r"[/()]", name_stack)
    kind = next((SCOPE_KINDS[s] for s in reversed(scopes) if s in SCOPE_KINDS), self.kind)
    return Where(fused=self.fused or FUSED_SCOPE in scopes,
                 backward=self.backward or "transpose" in scopes, kind=kind)


@dataclasses.dataclass
class Eqn:
  name: str
  params: dict
  invars: list  # Var or Literal
  outvars: list[Var]
  source: str
  where: Where
  subs: list  # the jaxprs of a structured op

  @property
  def fused(self) -> bool:
    return self.where.fused

  @property
  def backward(self) -> bool:
    return self.where.backward


@dataclasses.dataclass
class Flat:
  invars: list[Var]
  outvars: list  # Var or Literal
  eqns: list[Eqn]


def is_literal(v) -> bool:
  return isinstance(v, Literal)


def values(vs) -> list:
  return [v for v in vs if not is_literal(v)]


def source(eqn) -> str:
  """The jmoe (or optax) line that made `eqn`, e.g. "jmoe/moe/experts.py:34"; else its op."""
  frames = getattr(getattr(eqn.source_info, "traceback", None), "frames", None) or ()
  for frame in frames:
    path = frame.file_name.replace("\\", "/")
    if path.endswith(("jmoe/train/step.py", "jmoe/memory/estimate.py")):
      continue  # the step's driver, not where a value comes from
    for root in ("/jmoe/", "/optax/"):
      if root in path:
        return f"{path[path.rfind(root) + 1:]}:{frame.line_num}"
  return eqn.primitive.name


def sub_jaxprs(eqn) -> list:
  if eqn.primitive.name in KERNELS:
    return []
  found = []
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr", "body_jaxpr", "cond_jaxpr", "branches"):
    value = eqn.params.get(key)
    if value is None:
      continue
    for item in (value if isinstance(value, (tuple, list)) else (value,)):
      found.append(getattr(item, "jaxpr", item))
  return found


def flatten(jaxpr, where: Where = Where()) -> Flat:
  """`jaxpr` with its calls inlined, over fresh values; `where`: where the whole of it runs."""
  invars = [Var(v.aval) for v in jaxpr.invars]
  eqns: list[Eqn] = []
  outvars = _inline(jaxpr, invars, where, eqns)
  return Flat(invars, outvars, eqns)


def _inline(jaxpr, args: list, where: Where, eqns: list[Eqn]) -> list:
  names: dict[Any, Any] = dict(zip(jaxpr.invars, args))
  names.update((v, Var(v.aval)) for v in jaxpr.constvars)
  name = lambda v: v if is_literal(v) else names[v]
  for eqn in jaxpr.eqns:
    here = where.inside(str(eqn.source_info.name_stack))
    ins = [name(v) for v in eqn.invars]
    subs = sub_jaxprs(eqn)
    if eqn.primitive.name not in STRUCTURED and len(subs) == 1:
      sub = subs[0]
      outs = _inline(sub, ins[len(ins) - len(sub.invars):], here, eqns)
      names.update(zip(eqn.outvars, outs))
      continue
    outs = [Var(v.aval) for v in eqn.outvars]
    names.update(zip(eqn.outvars, outs))
    eqns.append(Eqn(eqn.primitive.name, eqn.params, ins, outs, source(eqn), here, subs))
  return [name(v) for v in jaxpr.outvars]


def operands_of(eqn: Eqn, ins: list) -> list[list]:
  """What each of a structured op's bodies (`eqn.subs`, in their order) receives of its inputs:
  a loop's body its constants and carry, its condition its own constants and the carry; a
  conditional's branches its operands (not the branch index)."""
  if eqn.name == "while":
    cond, body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    by_jaxpr = {"body_jaxpr": ins[cond:], "cond_jaxpr": ins[:cond] + ins[cond + body:]}
    return [by_jaxpr[key] for key in ("body_jaxpr", "cond_jaxpr") if eqn.params.get(key)]
  if eqn.name == "cond":
    return [ins[1:]] * len(eqn.subs)
  return [ins] * len(eqn.subs)


def scan_counts(params: dict) -> tuple[int, int]:
  """A scan's number of constants and of carries (its operands: constants, carries, stacks)."""
  if "ft_in" in params:  # jax >= 0.11: the operands' trees, (constants, carries, stacks)
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts.vals)), len(list(carry.vals))
  return params["num_consts"], params["num_carry"]


def uses_of(jaxpr: Flat) -> dict[Any, list[int]]:
  """Each value's consumers, by equation index."""
  uses: dict[Any, list[int]] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in values(eqn.invars):
      uses.setdefault(v, []).append(i)
  return uses


def divisor(spec, mesh_shape) -> int:
  """How many pieces `spec` cuts an array into (dimensions left unconstrained: none)."""
  d = 1
  for entry in spec:
    for axis in (entry if isinstance(entry, tuple) else (entry,)):
      if axis is not None and axis is not P.UNCONSTRAINED:
        d *= mesh_shape[axis]
  return d


def nbytes(aval, d: int) -> int:
  shape = getattr(aval, "shape", None)
  if shape is None or not hasattr(aval, "dtype"):
    return 0
  size = math.prod(shape)
  itemsize = getattr(aval.dtype, "itemsize", 8)  # random keys: two uint32 words
  return -(-size * itemsize // max(1, min(d, size)))
