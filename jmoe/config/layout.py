"""How a run uses its devices: the attention and dense layers' layout, the expert layers' layout
over the same devices ("parallel folding"), and the pipeline stages around both
(`parallel.*`, one frozen dataclass each, as in schema.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jmoe.errors import ConfigError


@dataclass(frozen=True)
class DenseLayout:
  """How attention and dense layers use the devices; the product is the device count (-1: the rest)."""
  data: int = -1  # replicas, each with a slice of the batch
  fsdp: int = 1  # like data, but parameters and optimizer state are sharded too
  context: int = 1  # the sequence split across devices
  tensor: int = 1  # heads and MLP width split across devices (with sequence-parallel norms)


@dataclass(frozen=True)
class ExpertLayout:
  """How expert layers use the same devices; the product is the device count (-1: the rest)."""
  data: int = -1  # expert-data parallelism: replicas of each expert (their parameters FSDP-sharded)
  expert: int = 1  # experts split across devices
  tensor: int = 1  # each expert's FFN width split across devices


@dataclass(frozen=True)
class ParallelConfig:
  dense: DenseLayout = field(default_factory=DenseLayout)
  expert: ExpertLayout = field(default_factory=ExpertLayout)
  # Pipeline stages: the MoE blocks split into this many groups of consecutive layers, each on
  # its own devices (the mesh's outermost axis); dense and expert layouts are those of one stage.
  pipeline: int = 1
  pipeline_repeats: int = 1  # layer groups per stage, visited in turn (circular stages)
  # How many MoE layers each of the pipeline x pipeline_repeats groups (virtual stages) holds, in
  # the order the layers run: group g = r * pipeline + s is stage s's repeat r. Either a list of
  # every group's count (summing to the MoE layers), or the first and last groups' counts (0: not
  # set) with the other groups as even as possible; by default all as even as possible, the
  # earlier groups taking one more layer where they cannot be equal (3 layers, 2 stages: 2 + 1).
  pipeline_layers: tuple[int, ...] = ()
  pipeline_first: int = 0
  pipeline_last: int = 0
  # auto | gpipe | 1f1b | interleaved (jmoe/model/pipeline.py): the order of the micro-batches'
  # forward and backward passes through the stages; auto: the fastest that fits, GPipe (no
  # recomputation) unless its compiled step needs more than the device's memory, then
  # `bounded_schedule` (jmoe/train/step.py: fitting_schedule).
  pipeline_schedule: str = "auto"

  @property
  def schedule(self) -> str:
    """The schedule `pipeline_schedule` names; auto: GPipe, its first choice (the compiled step
    decides whether it stays: jmoe/train/step.py)."""
    return "gpipe" if self.pipeline_schedule == "auto" else self.pipeline_schedule

  def bounded_schedule(self, micro_batches: int) -> str | None:
    """The schedule whose activation memory the stages bound rather than the micro-batches:
    1F1B, or interleaved with repeats (where the stages divide the micro-batches); None where
    neither runs (repeats over micro-batches the stages do not divide)."""
    if self.pipeline_repeats == 1:
      return "1f1b"
    return "interleaved" if micro_batches % self.pipeline == 0 else None

  def layer_groups(self, num_layers: int) -> tuple[int, ...]:
    """The MoE layers of each group (virtual stage), in order g = r * pipeline + s; a
    ConfigError says why `num_layers` cannot be split as asked."""
    groups = self.pipeline * self.pipeline_repeats
    where = f"parallel.pipeline x parallel.pipeline_repeats = {groups} groups"
    if self.pipeline_layers:
      counts = tuple(self.pipeline_layers)
      if self.pipeline_first or self.pipeline_last:
        raise ConfigError("parallel.pipeline_layers lists every group's layers: leave "
                          "parallel.pipeline_first and parallel.pipeline_last at 0 with it")
      if len(counts) != groups:
        raise ConfigError(f"parallel.pipeline_layers {list(counts)} has {len(counts)} entries for "
                          f"{where}: give one count per group")
      if min(counts) < 1:
        raise ConfigError(f"parallel.pipeline_layers {list(counts)}: every group needs at least "
                          f"one layer")
      if sum(counts) != num_layers:
        raise ConfigError(f"parallel.pipeline_layers {list(counts)} sums to {sum(counts)}, but "
                          f"the model has {num_layers} MoE layers")
      return counts
    if num_layers < groups:
      raise ConfigError(f"the {num_layers} MoE layers cannot fill {where}: each group needs at "
                        f"least one layer; use fewer stages or repeats")
    ends = {k: v for k, v in (("first", self.pipeline_first), ("last", self.pipeline_last)) if v}
    named = " + ".join(f"parallel.pipeline_{k} ({v})" for k, v in ends.items())
    middle, rest = groups - len(ends), num_layers - sum(ends.values())
    if rest < 0:
      raise ConfigError(f"{named} is more than the {num_layers} MoE layers")
    if middle == 0 and rest:
      raise ConfigError(f"{named} must sum to the {num_layers} MoE layers: the {groups} groups "
                        f"are the first and the last")
    if rest < middle:
      raise ConfigError(f"{named} leaves {rest} of the {num_layers} MoE layers for the other "
                        f"{middle} of the {where}, which need at least one each")
    even = [rest // middle + (i < rest % middle) for i in range(middle)] if middle else []
    return (*([ends["first"]] if "first" in ends else []), *even,
            *([ends["last"]] if "last" in ends else []))


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")  # parallel.pipeline_schedule
