"""The training loop: build or restore the state, run jitted steps, log, checkpoint."""

from __future__ import annotations

import json
import logging
import pathlib
import time
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.checkpoint import Checkpointer
from jmoe.config import Config, ConfigError, to_dict
from jmoe.data import DataPipeline
from jmoe.model.fp8 import Fp8History
from jmoe.parallel import Layout, make_layout
from jmoe.train.metrics import MetricsWriter, summarize
from jmoe.train.optimizer import learning_rate, make_optimizer
from jmoe.train.preemption import Interrupted, StopSignals
from jmoe.train.state import StateSpec, TrainState, state_spec
from jmoe.train.step import make_eval_step, make_train_step

log = logging.getLogger("jmoe")


def check_batch_fits(config: Config, layout: Layout) -> None:
  micro = config.train.micro_batch_size or config.train.batch_size
  if micro % layout.data_parallel_size:
    raise ConfigError(
        f"the micro-batch ({micro} sequences: train.micro_batch_size, or train.batch_size when it "
        f"is 0) must split evenly over the {layout.data_parallel_size} data x fsdp devices")
  devices = layout.mesh.devices.size
  if (micro * config.data.seq_len) % devices:
    raise ConfigError(
        f"the MoE layers split a micro-batch's {micro} x {config.data.seq_len} tokens over all "
        f"{devices} devices; choose data.seq_len or the micro-batch so that they divide")


def train(config: Config, workdir: str | pathlib.Path, *, progress: bool = True,
          devices: Sequence[jax.Device] | None = None) -> list[dict]:
  """Trains to `config.train.steps`, resuming from the workdir's latest checkpoint if it has one,
  on `devices` (default: all).

  Returns the logged metric records (also in `<workdir>/metrics.jsonl`). On SIGTERM or SIGINT it
  saves a checkpoint of the step it is at and raises `Interrupted`.
  """
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  layout = make_layout(config.parallel, devices)
  check_batch_fits(config, layout)
  lead = jax.process_index() == 0
  if lead:
    (workdir / "config.json").write_text(json.dumps(to_dict(config), indent=2))

  optimizer, schedule = make_optimizer(config.train), learning_rate(config.train)
  spec = state_spec(config, layout, optimizer)
  num_params = sum(x.size for x in jax.tree.leaves(spec.abstract.params))
  log.info("%.2fM parameters on %d %s device(s); layout:\n%s", num_params / 1e6,
           layout.mesh.devices.size, jax.default_backend(), layout.describe())
  data = DataPipeline(config, layout)  # first: bad data input stops before anything is loaded
  checkpointer = Checkpointer(workdir / "checkpoints", keep=config.checkpoint.keep,
                              async_save=config.checkpoint.async_save)
  start, state, data_state = initial_state(config, spec, checkpointer)
  if lead:
    drop_metrics_after(workdir / "metrics.jsonl", start)
  if data_state is not None:
    data.restore(data_state)
  elif start:
    log.warning("the checkpoint of step %d holds no input position; the data starts over", start)
  t0 = time.perf_counter()
  with layout.active():  # the model's sharding annotations read the layout while tracing
    step_fn = jax.jit(make_train_step(spec.graphdef, config, optimizer, schedule),
                      in_shardings=(spec.shardings, layout.batch),
                      out_shardings=(spec.shardings, layout.replicated),
                      donate_argnums=0).lower(state, data.batch_spec()).compile()
    eval_fn = (jax.jit(make_eval_step(spec.graphdef, config), out_shardings=layout.replicated)
               if config.train.eval_every else None)
  log.info("compiled the train step in %.1f s", time.perf_counter() - t0)

  tokens_per_step = config.train.batch_size * config.data.seq_len
  writer = MetricsWriter(workdir, config.train.steps, start_step=start,
                         progress=progress and lead, write=lead)
  records, last_time, last_step = [], time.perf_counter(), start
  signals = StopSignals()
  save = lambda step: checkpointer.save(step, state, data.state())
  try:
    with signals.installed():
      for step in range(start, config.train.steps):
        state, metrics = step_fn(state, data.next_batch())
        done = step + 1
        evaluate = config.train.eval_every and (done % config.train.eval_every == 0 or
                                                done == config.train.steps)
        if evaluate or done % config.train.log_every == 0 or done in (start + 1,
                                                                      config.train.steps):
          record = summarize(jax.device_get(metrics), done)
          now = time.perf_counter()
          record["tokens_per_s"] = tokens_per_step * (done - last_step) / (now - last_time)
          record.update(data.loader_stats())
          if evaluate:
            record["eval_loss"] = evaluation_loss(eval_fn, state, data.eval_batches())
          last_time, last_step = time.perf_counter(), done
          writer.write(record)
          records.append(record)
        if config.checkpoint.every and done % config.checkpoint.every == 0:
          save(done)
        if done < config.train.steps and signals.stop_requested(done):
          save(done)
          checkpointer.wait()
          raise Interrupted(done, signals.signum)
      save(config.train.steps)
      checkpointer.wait()
  finally:
    data.close()
    writer.close()
    checkpointer.close()
  return records


def evaluation_loss(eval_fn, state: TrainState, batches: list[dict]) -> float:
  """The mean next-token loss over every target of the held-out batches."""
  results = jax.device_get([eval_fn(state.params, state.rest, batch) for batch in batches])
  total = sum(float(count) for _, count in results)
  return sum(float(loss) * float(count) for loss, count in results) / max(total, 1.0)


def initial_state(config: Config, spec: StateSpec, checkpointer: Checkpointer
                  ) -> tuple[int, TrainState, dict | None]:
  """(step, train state, input position or None): the workdir's latest readable checkpoint;
  else fresh optimizer state on `checkpoint.load_params`' model, or on a new random model."""
  latest = checkpointer.restore_latest(spec.abstract, spec.shardings)
  if latest is not None:
    step, state, data = latest
    log.info("resuming from %s at step %d", checkpointer.directory / str(step), step)
    return step, state, data if data.get("streams") else None
  if config.checkpoint.load_params:
    from jmoe.checkpoint.params import read_variables
    # FP8 amax histories are run state, not model: they start empty, whatever the source had.
    histories, rest = nnx.split_state(spec.abstract.rest, Fp8History, ...)
    history_shardings, rest_shardings = nnx.split_state(spec.shardings.rest, Fp8History, ...)
    abstract = nnx.merge_state(spec.abstract.params, rest)
    shardings = nnx.merge_state(spec.shardings.params, rest_shardings)
    variables = read_variables(config.checkpoint.load_params, abstract, shardings)
    log.info("starting from the model in %s", config.checkpoint.load_params)
    params, rest = nnx.split_state(variables, nnx.Param, ...)
    histories = jax.tree.map(lambda a, s: jnp.zeros(a.shape, a.dtype, device=s), histories,
                             history_shardings)
    return 0, spec.init_from(params, nnx.merge_state(rest, histories)), None
  return 0, spec.init(), None


def drop_metrics_after(path: pathlib.Path, step: int) -> None:
  """Forgets logged steps after `step`: a run resumed from an earlier checkpoint logs them again."""
  if not path.exists():
    return
  lines = path.read_text().splitlines(keepends=True)
  kept = [line for line in lines if json.loads(line)["step"] <= step]
  if len(kept) < len(lines):
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)
