"""Folding two parallel layouts onto one mesh.

Each layout splits the device index into mixed-radix digits, innermost last:
  dense:  data x fsdp x context x tensor        expert: data x expert x tensor
A layout's role covers a contiguous range of digit strides. The mesh axes are the common refinement
of both: every stride boundary of either layout starts a new mesh axis, so each role of either layout
is a tuple of consecutive mesh axes. This needs each boundary to divide the next; otherwise the two
layouts cannot share the devices and the error says which sizes would.

With pipeline stages (`parallel.pipeline` = S) both layouts describe the devices of one stage,
and the mesh gets one more axis, `stage`, of size S, outermost.

Example, 16 devices, dense (data 4, tensor 4), expert (data 2, expert 8): boundaries 1, 4, 8, 16;
mesh axes (data/data 2, data/expert 2, tensor/expert 4); dense data = the first two, tensor = the
last; expert = the last two, expert data = the first.
"""

from __future__ import annotations

import dataclasses
import math

from jmoe.config import ConfigError, ParallelConfig

DENSE_ROLES = ("data", "fsdp", "context", "tensor")  # outermost first
EXPERT_ROLES = ("data", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class Folding:
  axis_names: tuple[str, ...]  # mesh axes, outermost first
  axis_sizes: tuple[int, ...]
  dense: dict[str, tuple[str, ...]]  # dense role -> mesh axes
  expert: dict[str, tuple[str, ...]]  # expert role -> mesh axes
  dense_sizes: dict[str, int]
  expert_sizes: dict[str, int]
  stage: tuple[str, ...] = ()  # the pipeline's mesh axis (none without stages)
  stages: int = 1
  repeats: int = 1  # layer groups per stage
  parallel: ParallelConfig = ParallelConfig()  # what was asked for (its layers per group)


def resolve(group: str, sizes: dict[str, int], num_devices: int, stages: int = 1
            ) -> dict[str, int]:
  """Replaces a -1 by the rest of the `num_devices` (of one stage); checks the product."""
  devices = (f"{num_devices} devices" if stages == 1 else
             f"{num_devices} devices in each of the {stages} pipeline stages")
  known = math.prod(v for v in sizes.values() if v != -1)
  if -1 in sizes.values():
    if num_devices % known:
      raise ConfigError(
          f"parallel.{group} {sizes}: the sizes other than -1 multiply to {known}, which does not "
          f"divide the {devices}")
    sizes = {k: (num_devices // known if v == -1 else v) for k, v in sizes.items()}
  if math.prod(sizes.values()) != num_devices:
    raise ConfigError(
        f"parallel.{group} {sizes} multiplies to {math.prod(sizes.values())}, but there are "
        f"{devices}; make the product {num_devices} or set one size to -1")
  return sizes


def _strides(roles: tuple[str, ...], sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
  """role -> (inner stride, outer stride) of its digit range."""
  out, stride = {}, 1
  for role in reversed(roles):
    out[role] = (stride, stride * sizes[role])
    stride *= sizes[role]
  return out


def fold(cfg: ParallelConfig, num_devices: int) -> Folding:
  stages = cfg.pipeline
  if stages < 1 or num_devices % stages:
    raise ConfigError(f"parallel.pipeline ({stages}) must divide the {num_devices} devices: each "
                      f"stage gets an equal share")
  num_devices //= stages
  dense = resolve("dense", dataclasses.asdict(cfg.dense), num_devices, stages)
  expert = resolve("expert", dataclasses.asdict(cfg.expert), num_devices, stages)
  dense_strides, expert_strides = _strides(DENSE_ROLES, dense), _strides(EXPERT_ROLES, expert)
  bounds = sorted({b for lo_hi in [*dense_strides.values(), *expert_strides.values()]
                   for b in lo_hi})
  for inner, outer in zip(bounds, bounds[1:]):
    if outer % inner:
      raise ConfigError(
          f"the dense layout {dense} and the expert layout {expert} cannot share "
          f"{num_devices} devices: tensor-innermost, their groups of {inner} and {outer} devices "
          f"do not nest. Choose sizes whose inner products divide each other, e.g. expert "
          f"tensor equal to (or a divisor or multiple of) dense tensor, and expert x expert-tensor "
          f"a multiple or divisor of context x tensor")

  def role_at(strides, lo):
    return next(role for role, (a, b) in strides.items() if a <= lo < b)

  names, sizes, dense_axes, expert_axes = [], [], {r: [] for r in DENSE_ROLES}, {
      r: [] for r in EXPERT_ROLES}
  for inner, outer in reversed(list(zip(bounds, bounds[1:]))):  # outermost first
    d_role, e_role = role_at(dense_strides, inner), role_at(expert_strides, inner)
    name = f"{d_role}/{e_role}"
    names.append(name)
    sizes.append(outer // inner)
    dense_axes[d_role].append(name)
    expert_axes[e_role].append(name)
  if not names:  # one device (per stage): a single axis of size 1 serves every role
    names, sizes = ["data/data"], [1]
    dense_axes["data"], expert_axes["data"] = list(names), list(names)
  stage = ("stage",) if stages > 1 else ()
  return Folding(axis_names=stage + tuple(names), axis_sizes=(stages,) * len(stage) + tuple(sizes),
                 dense={k: tuple(v) for k, v in dense_axes.items()},
                 expert={k: tuple(v) for k, v in expert_axes.items()},
                 dense_sizes=dense, expert_sizes=expert, stage=stage, stages=stages,
                 repeats=cfg.pipeline_repeats, parallel=cfg)
