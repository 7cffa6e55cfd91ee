"""What a run starts from, checked before anything is written: whether the layout fits the
config's sizes, the state (the workdir's latest checkpoint, checkpoint.load_params' model, or a
new one) and what its checkpoints record for a resume to hold (the model settings, LoRA's frozen
model)."""

from __future__ import annotations

import json
import logging
import pathlib

from flax import nnx

from jmoe.checkpoint import Checkpointer
from jmoe.checkpoint.params import fingerprint, read_variables
from jmoe.config import Config, ConfigError
from jmoe.config.resume import HELD, changed, model_settings, recorded, saved_with
from jmoe.ops.fp8 import Fp8History, WeightAmax
from jmoe.parallel import Layout
from jmoe.train.state import StateSpec, TrainState, frozen, placed_zeros

log = logging.getLogger("jmoe")


def check_batch_fits(config: Config, layout: Layout) -> None:
  """What a layout needs of the config's sizes, said before anything is built."""
  ffn, etp = config.moe.d_ff_expert, layout.folding.expert_sizes["tensor"]
  if ffn % etp:
    raise ConfigError(
        f"moe.d_ff_expert ({ffn}) must be a multiple of the expert-tensor size ({etp}, "
        f"parallel.expert.tensor): each device holds an equal slice of every expert's FFN")
  micro = config.train.micro_batch
  stage = layout.inside_stages()  # the MoE blocks' devices: one stage's (all without stages)
  if micro % stage.data_parallel_size:
    raise ConfigError(
        f"the micro-batch ({micro} sequences: train.micro_batch_size, or train.batch_size when it "
        f"is 0) must split evenly over the {stage.data_parallel_size} data x fsdp devices")
  if layout.stages > 1 and config.train.batch_size % layout.data_parallel_size:
    raise ConfigError(
        f"outside the pipeline's stages the batch ({config.train.batch_size} sequences) is split "
        f"over the {layout.data_parallel_size} stage x data x fsdp devices; choose "
        f"train.batch_size so that they divide it")
  devices = layout.mesh.devices.size // layout.stages
  if (micro * config.data.seq_len) % devices:
    raise ConfigError(
        f"the MoE layers split a micro-batch's {micro} x {config.data.seq_len} tokens over all "
        f"{devices} devices{' of a stage' if layout.stages > 1 else ''}; choose data.seq_len or "
        f"the micro-batch so that they divide")
  chunks = config.moe.dispatch_chunks
  if (micro * config.data.seq_len // devices) % chunks:
    raise ConfigError(
        f"moe.dispatch_chunks ({chunks}) must divide the {micro * config.data.seq_len // devices} "
        f"tokens each device holds in the MoE layers")


def saved_part(config: Config, state: TrainState) -> TrainState:
  """What a checkpoint of the run holds: the whole state, but for LoRA's frozen model (which is
  read from checkpoint.load_params again on resume) and the FP8 expert weights' kept amaxes
  (made from the parameters again on resume)."""
  return state.replace(rest=nnx.split_state(state.rest, frozen(config), WeightAmax, ...)[2])


def initial_state(config: Config, spec: StateSpec, checkpointer: Checkpointer
                  ) -> tuple[int, TrainState, dict | None]:
  """(step, train state, input position or None): the workdir's latest readable checkpoint;
  else fresh optimizer state on `checkpoint.load_params`' model, or on a new random model.
  With LoRA, the frozen model comes from load_params in both cases, new adapters start at zero."""
  check = lambda step: check_settings(config, checkpointer, step)  # before the arrays are read
  latest = checkpointer.restore_latest(saved_part(config, spec.abstract),
                                       saved_part(config, spec.shardings), check)
  if latest is not None:
    step, state, data = latest
    log.info("resuming from %s at step %d", checkpointer.directory / str(step), step)
    if config.lora.rank:
      state = state.replace(rest=nnx.merge_state(_frozen_model(config, spec), state.rest))
    return step, spec.with_weight_amax(state), data if data.get("streams") else None
  if config.checkpoint.load_params:
    # FP8 amax histories are run state, not model: they start empty, whatever the source had;
    # the kept weight amaxes (zero here) are made from the parameters read.
    run_state = lambda tree: nnx.split_state(tree, nnx.Any(Fp8History, WeightAmax), ...)
    started, rest = run_state(spec.abstract.rest)
    run_shardings, rest_shardings = run_state(spec.shardings.rest)
    started = placed_zeros(started, run_shardings)
    if config.lora.rank:  # the model's variables all in `rest`; the adapters new
      base = _frozen_model(config, spec, whole=True)
      state = spec.init_from(spec.init_adapters(), nnx.merge_state(base, started))
      return 0, spec.with_weight_amax(state), None
    abstract = nnx.merge_state(spec.abstract.params, rest)
    shardings = nnx.merge_state(spec.shardings.params, rest_shardings)
    variables = read_variables(config.checkpoint.load_params, abstract, shardings)
    log.info("starting from the model in %s", config.checkpoint.load_params)
    params, rest = nnx.split_state(variables, nnx.Param, ...)
    state = spec.init_from(params, nnx.merge_state(rest, started))
    return 0, spec.with_weight_amax(state), None
  return 0, spec.init(), None


def run_record(config: Config, state: TrainState) -> dict:
  """What the run's checkpoints record for a resume to check: the model settings its weights are
  trained with; with LoRA, the frozen model under the adapters (where it was read from, and a
  fingerprint of its values)."""
  record = {"settings": model_settings(config)}
  if config.lora.rank:
    base = nnx.split_state(state.rest, frozen(config), ...)[0]
    record["lora_base"] = {"path": str(pathlib.Path(config.checkpoint.load_params).absolute()),
                           "fingerprint": fingerprint(base)}
  return record


def check_settings(config: Config, checkpointer: Checkpointer, step: int) -> None:
  """Refuses to resume the checkpoint of `step` under other model settings than its weights were
  trained with (those RESUMABLE allows aside: jmoe/config/resume.py); run before its arrays are
  read, so that a change of shape is named by its setting too."""
  workdir = checkpointer.directory.parent
  where = f"the checkpoint of step {step} in {workdir}"
  now = model_settings(config)
  saved = (checkpointer.run_record(step) or {}).get("settings")
  if saved is None:
    log.warning("%s does not record the model settings it was trained with (an earlier jmoe "
                "saved it): resuming as if they were this config's%s", where,
                _differs_from_config_json(workdir, now))
    return
  saved = recorded(saved, now)
  names = changed(saved, now)
  if names:
    why = ("its optimizer state is another optimizer's" if set(names) <= set(HELD)
           else "its weights would compute something else")
    raise ConfigError(
        f"{saved_with(where, names, saved, now)}: {why}. "
        f"Set {'it' if len(names) == 1 else 'them'} back to resume, or train on from its model "
        f"with the new {'value' if len(names) == 1 else 'values'} in a new --workdir "
        f"(--config.checkpoint.load_params={workdir})")


def _differs_from_config_json(workdir: pathlib.Path, now: dict) -> str:
  """Where the workdir's config.json (the last start's config) differs from `now`, said in a
  few words; "" where it does not, or cannot be read."""
  try:
    saved = recorded(model_settings(json.loads((workdir / "config.json").read_text())), now)
  except (OSError, ValueError, AttributeError):
    return ""
  names = changed(saved, now)
  each = ", ".join(f"{name} {saved[name]!r} (now {now[name]!r})" for name in names[:4])
  return f" (its config.json has {each})" if names else ""


def check_record(checkpointer: Checkpointer, step: int, record: dict) -> None:
  """Refuses to resume the checkpoint of `step` on what differs from what it records: LoRA
  adapters on another frozen model than the one they were trained on."""
  now = record.get("lora_base")
  if now is None:
    return
  saved = (checkpointer.run_record(step) or {}).get("lora_base")
  where = checkpointer.directory / str(step)
  if saved is None:
    log.warning("%s does not record the model its LoRA adapters were trained on (an earlier "
                "jmoe saved it): make sure it is checkpoint.load_params, %s", where, now["path"])
  elif saved["fingerprint"] != now["fingerprint"]:
    raise ConfigError(
        f"the LoRA adapters in {where} were trained on the model in {saved['path']} (fingerprint "
        f"{saved['fingerprint']}), but checkpoint.load_params, {now['path']}, holds other weights "
        f"(fingerprint {now['fingerprint']}): resume with the model they were trained on, or "
        f"train new adapters in another --workdir")
  elif saved["path"] != now["path"]:
    log.info("the frozen model under the adapters is read from %s now (it was %s): the same "
             "weights", now["path"], saved["path"])


def _frozen_model(config: Config, spec: StateSpec, whole: bool = False) -> nnx.State:
  """LoRA's frozen model, read from checkpoint.load_params: its parameters (`whole`: every model
  variable of `rest` but the FP8 histories and kept amaxes, as a fresh run starts from)."""
  part = lambda tree: nnx.filter_state(tree, nnx.Not(nnx.Any(Fp8History, WeightAmax)))
  log.info("the frozen model under the adapters: %s", config.checkpoint.load_params)
  variables = read_variables(config.checkpoint.load_params, part(spec.abstract.rest),
                             part(spec.shardings.rest))
  return variables if whole else nnx.split_state(variables, frozen(config), ...)[0]
