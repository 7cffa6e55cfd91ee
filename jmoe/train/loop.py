"""The training loop: build or restore the state, run jitted steps, log, checkpoint."""

from __future__ import annotations

import json
import logging
import pathlib
import time
from typing import Sequence

import jax
from flax import nnx

from jmoe.checkpoint import Checkpointer
from jmoe.config import Config, ConfigError, to_dict
from jmoe.data import make_sampler
from jmoe.parallel import Layout, make_layout
from jmoe.train.metrics import MetricsWriter, summarize
from jmoe.train.optimizer import learning_rate, make_optimizer
from jmoe.train.preemption import Interrupted, StopSignals
from jmoe.train.state import StateSpec, TrainState, state_spec
from jmoe.train.step import make_train_step

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
  checkpointer = Checkpointer(workdir / "checkpoints", keep=config.checkpoint.keep,
                              async_save=config.checkpoint.async_save)
  start, state, next_batch = initial_state(config, spec, checkpointer)
  if lead:
    drop_metrics_after(workdir / "metrics.jsonl", start)

  sampler = make_sampler(config.data, config.train.seed, config.model.vocab_size)
  batch_of = lambda index: jax.device_put(sampler.batch(index, config.train.batch_size),
                                          layout.batch)
  t0 = time.perf_counter()
  with layout.active():  # the model's sharding annotations read the layout while tracing
    step_fn = jax.jit(make_train_step(spec.graphdef, config, optimizer, schedule),
                      in_shardings=(spec.shardings, layout.batch),
                      out_shardings=(spec.shardings, layout.replicated),
                      donate_argnums=0).lower(state, batch_of(next_batch)).compile()
  log.info("compiled the train step in %.1f s", time.perf_counter() - t0)

  tokens_per_step = config.train.batch_size * config.data.seq_len
  writer = MetricsWriter(workdir, config.train.steps, start_step=start,
                         progress=progress and lead, write=lead)
  records, last_time, last_step = [], time.perf_counter(), start
  signals = StopSignals()
  save = lambda step: checkpointer.save(step, state, {"next_batch": next_batch})
  try:
    with signals.installed():
      for step in range(start, config.train.steps):
        state, metrics = step_fn(state, batch_of(next_batch))
        done, next_batch = step + 1, next_batch + 1
        if done % config.train.log_every == 0 or done in (start + 1, config.train.steps):
          record = summarize(jax.device_get(metrics), done)
          now = time.perf_counter()
          record["tokens_per_s"] = tokens_per_step * (done - last_step) / (now - last_time)
          last_time, last_step = now, done
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
    writer.close()
    checkpointer.close()
  return records


def initial_state(config: Config, spec: StateSpec, checkpointer: Checkpointer
                  ) -> tuple[int, TrainState, int]:
  """(step, train state, index of the next batch): the workdir's latest readable checkpoint;
  else fresh optimizer state on `checkpoint.load_params`' model, or on a new random model."""
  latest = checkpointer.restore_latest(spec.abstract, spec.shardings)
  if latest is not None:
    step, state, data = latest
    log.info("resuming from %s at step %d", checkpointer.directory / str(step), step)
    return step, state, int(data.get("next_batch", step))
  if config.checkpoint.load_params:
    from jmoe.checkpoint.params import read_variables
    abstract = nnx.merge_state(spec.abstract.params, spec.abstract.rest)
    shardings = nnx.merge_state(spec.shardings.params, spec.shardings.rest)
    variables = read_variables(config.checkpoint.load_params, abstract, shardings)
    log.info("starting from the model in %s", config.checkpoint.load_params)
    params, rest = nnx.split_state(variables, nnx.Param, ...)
    return 0, spec.init_from(params, rest), 0
  return 0, spec.init(), 0


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
