"""The training loop: build or restore the state, run jitted steps, log, checkpoint."""

from __future__ import annotations

import json
import logging
import pathlib
import time

import jax

from jmoe.checkpoint import Checkpointer
from jmoe.config import Config, ConfigError, to_dict
from jmoe.data import make_sampler
from jmoe.parallel import Layout, make_layout
from jmoe.train.metrics import MetricsWriter, summarize
from jmoe.train.optimizer import learning_rate, make_optimizer
from jmoe.train.state import state_spec
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


def train(config: Config, workdir: str | pathlib.Path, *, progress: bool = True) -> list[dict]:
  """Trains to `config.train.steps`, resuming from the workdir's latest checkpoint if it has one.

  Returns the logged metric records (also in `<workdir>/metrics.jsonl`).
  """
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  layout = make_layout(config.parallel)
  check_batch_fits(config, layout)
  (workdir / "config.json").write_text(json.dumps(to_dict(config), indent=2))

  optimizer, schedule = make_optimizer(config.train), learning_rate(config.train)
  spec = state_spec(config, layout, optimizer)
  num_params = sum(x.size for x in jax.tree.leaves(spec.abstract.params))
  log.info("%.2fM parameters on %d %s device(s); layout:\n%s", num_params / 1e6,
           layout.mesh.devices.size, jax.default_backend(), layout.describe())
  checkpointer = Checkpointer(workdir / "checkpoints", keep=config.checkpoint.keep)
  start = checkpointer.latest_step()
  if start is None:
    start, state = 0, spec.init()
  else:
    log.info("resuming from %s at step %d", checkpointer.directory, start)
    state = checkpointer.restore(start, spec.abstract, spec.shardings)

  sampler = make_sampler(config.data, config.train.seed, config.model.vocab_size)
  batch_of = lambda step: jax.device_put(sampler.batch(step, config.train.batch_size),
                                         layout.batch)
  t0 = time.perf_counter()
  with layout.active():  # the model's sharding annotations read the layout while tracing
    step_fn = jax.jit(make_train_step(spec.graphdef, config, optimizer, schedule),
                      in_shardings=(spec.shardings, layout.batch),
                      out_shardings=(spec.shardings, layout.replicated),
                      donate_argnums=0).lower(state, batch_of(start)).compile()
  log.info("compiled the train step in %.1f s", time.perf_counter() - t0)

  tokens_per_step = config.train.batch_size * config.data.seq_len
  writer = MetricsWriter(workdir, config.train.steps, start_step=start, progress=progress)
  records, last_time, last_step = [], time.perf_counter(), start
  try:
    for step in range(start, config.train.steps):
      state, metrics = step_fn(state, batch_of(step))
      done = step + 1
      if done % config.train.log_every == 0 or done in (start + 1, config.train.steps):
        record = summarize(jax.device_get(metrics), done)
        now = time.perf_counter()
        record["tokens_per_s"] = tokens_per_step * (done - last_step) / (now - last_time)
        last_time, last_step = now, done
        writer.write(record)
        records.append(record)
      if config.checkpoint.every and done % config.checkpoint.every == 0:
        checkpointer.save(done, state)
    if checkpointer.latest_step() != config.train.steps:
      checkpointer.save(config.train.steps, state)
    checkpointer.wait()
  finally:
    writer.close()
    checkpointer.close()
  return records
