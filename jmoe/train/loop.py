"""The training loop: build or restore the state, run jitted steps, log, checkpoint."""

from __future__ import annotations

import functools
import json
import logging
import pathlib
import time
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from jmoe.checkpoint import Checkpointer
from jmoe.hf.families import check_family
from jmoe.hf.files import copy_tokenizer_files
from jmoe.checkpoint.params import with_saved_architecture
from jmoe.config import Config, ConfigError, to_dict
from jmoe.data import DataPipeline
from jmoe.errors import Diverged, Interrupted, choice
from jmoe.inference.score import score
from jmoe.moe import DISPATCHERS
from jmoe.parallel import make_layout
from jmoe.train.health import StepHealth, compile_finite_check, finite_flag
from jmoe.train.metrics import MetricsWriter, drop_metrics_after, summarize
from jmoe.train.optimizer import make_optimizer
from jmoe.train.preemption import StopSignals
from jmoe.train.state import state_spec
from jmoe.train.start import (check_batch_fits, check_record, initial_state, run_record,
                              saved_part)
from jmoe.train.pipelined import log_pipeline
from jmoe.train.step import (compiled_peak, documents_bound, evaluation_loss, fitting_schedule,
                             make_eval_step)
from jmoe.train.workdir import (WorkdirLock, check_workdir, make_workdir, not_written,
                                remove_made, workdir_path, write_atomic)

log = logging.getLogger("jmoe")


def train(config: Config, workdir: str | pathlib.Path, *, progress: bool = True,
          devices: Sequence[jax.Device] | None = None) -> list[dict]:
  """Trains to `config.train.steps`, resuming from the workdir's latest checkpoint if it has one,
  on `devices` (default: all).

  Returns the logged metric records (also in `<workdir>/metrics.jsonl`). On SIGTERM or SIGINT it
  saves a checkpoint of the step it is at and raises `Interrupted`.
  """
  with Trainer(config, workdir, progress=progress, devices=devices) as trainer:
    return trainer.run()


class Trainer:
  """A training run driven from Python: a notebook cell, a script, or `python -m jmoe.train`
  (which is `Trainer(config, workdir).run()`).

  Building one does what a run starts with: the layout, the data pipeline, the state (resumed
  from the workdir's latest checkpoint, on this config's layout, if there is one), and the
  compiled step. Then `train(n)` runs n steps and returns their logged records, as often as
  asked, without compiling again; `evaluate()`, `save()`, `expert_load()` and `score()` work on
  the current state. `close()` (or a `with` block) finishes pending saves and frees the devices.
  """

  def __init__(self, config: Config, workdir: str | pathlib.Path, *, progress: bool = True,
               devices: Sequence[jax.Device] | None = None):
    self.config = config = with_saved_architecture(config)
    self.workdir = workdir = workdir_path(workdir)
    # The registries config validation cannot see, checked before anything is built.
    check_family(config.model.family)
    choice("moe.dispatcher", config.moe.dispatcher, DISPATCHERS)
    self.layout = layout = make_layout(config.parallel, devices)
    check_batch_fits(config, layout)
    check_workdir(workdir)
    made = make_workdir(workdir)
    self._lead = jax.process_index() == 0
    try:
      self._lock = WorkdirLock(workdir).acquire()
      try:
        self._start(config, workdir, progress)
      except BaseException:
        self._lock.release()
        raise
    except BaseException:
      remove_made(workdir, made)  # a refused run leaves no empty workdir behind
      raise

  def _start(self, config: Config, workdir: pathlib.Path, progress: bool) -> None:
    """Every check a start can fail (the data, the checkpoint, the frozen model under LoRA
    adapters, the data position, the first batch, compiling), and only then the writes."""
    layout = self.layout
    optimizer = make_optimizer(config.train, config.precision.moments)
    self.spec = spec = state_spec(config, layout, optimizer)
    num_params = sum(x.size for x in jax.tree.leaves(spec.abstract.params))
    log.info("%.2fM parameters on %d %s device(s); layout:\n%s", num_params / 1e6,
             layout.mesh.devices.size, jax.default_backend(),
             layout.describe(config.moe_layers))
    if config.precision.gemm == "fp8":  # what FP8 covers (its default changed on 2026-12-04)
      p = config.precision
      covered = [name for name, on in (("the routed experts'", p.fp8_experts),
                                       ("the dense", p.fp8_dense)) if on]
      log.info("FP8 (%s recipe): %s GEMMs; %s in %s", p.fp8_recipe, " and ".join(covered),
               "the LM head" if p.fp8_dense else "the dense GEMMs (precision.fp8_dense=false) "
               "and the LM head", p.compute)
    self.data = DataPipeline(config, layout)  # first: bad data input stops before anything loads
    self.checkpointer = Checkpointer(workdir / "checkpoints", keep=config.checkpoint.keep,
                                     async_save=config.checkpoint.async_save,
                                     write_threads=config.checkpoint.write_threads,
                                     compress_waited=config.checkpoint.compress_waited,
                                     staging_gb=config.checkpoint.staging_gb)
    try:
      self.step, self.state, data_state = initial_state(config, spec, self.checkpointer)
      self._record = run_record(config, self.state)
      if self.step:
        check_record(self.checkpointer, self.step, self._record)
      if data_state is not None:  # refused here if this config reads other data from there
        self.data.restore(data_state, self.step, workdir)
      elif self.step:
        log.warning("the checkpoint of step %d holds no input position; the data starts over",
                    self.step)
      self.data.check_first_batch()  # unreadable documents stop the run before compiling
      self.checkpointer.reserve_host_memory(saved_part(config, self.state))  # while compiling
      compile_finite_check(self.state.params)  # (checked before each save)
      t0 = time.perf_counter()
      self._documents = documents_bound(config)
      scheduled, self._step_fn = fitting_schedule(config, layout, spec, optimizer,
                                                  self.data.batch_spec(),
                                                  documents=self._documents)
      self._compile_any = functools.partial(fitting_schedule, scheduled, layout, spec, optimizer,
                                            self.data.batch_spec())
      self._any_step = None  # the step for rows of more documents, compiled when one comes
      self.checkpointer.expect_step(compiled_peak(self._step_fn))  # (before the first step)
      self._eval_fn = jax.jit(make_eval_step(spec.graphdef, config),
                              out_shardings=layout.replicated)
      log.info("compiled the train step in %.1f s%s", time.perf_counter() - t0,
               "" if self._documents is None else
               f" for rows of up to {self._documents} documents (model.attention_max_documents:"
               f" counted per batch; a batch with more gets a second step)")
      if layout.stages > 1:
        log_pipeline(scheduled, layout)
      try:
        self._write_start(config, workdir)
        self._writer = MetricsWriter(workdir, config.train.steps, start_step=self.step,
                                     progress=progress and self._lead, write=self._lead)
      except OSError as e:  # (found writable a moment ago: a full disk, or changed since)
        raise not_written(e, workdir) from None
    except BaseException:
      self.data.close()
      self.checkpointer.close()
      raise
    self._last_metrics: dict | None = None
    self._saved = self.step if self.checkpointer.latest_step() == self.step else None
    self.health = StepHealth(config.train.max_bad_steps, config.train.lr)

  def _write_start(self, config: Config, workdir: pathlib.Path) -> None:
    """What a start writes once every check has passed: unreadable checkpoints moved aside, the
    saves a killed run left unfinished removed, the config, the metrics after the resumed step
    dropped, the tokenizer's files."""
    self.checkpointer.set_aside_unreadable()
    self.checkpointer.remove_unfinished()
    if self._lead:
      write_atomic(workdir / "config.json", json.dumps(to_dict(config), indent=2))
      drop_metrics_after(workdir / "metrics.jsonl", self.step)
      if self.data.tokenizer.path is not None:  # for generation and export from the workdir
        copy_tokenizer_files(self.data.tokenizer.path.parent, workdir, replace=False)

  def __enter__(self) -> "Trainer":
    return self

  def __exit__(self, exc_type, exc, traceback) -> None:
    """Closes the trainer; when the block raised, what closing raises (most often the same
    full disk, met again by the metrics' last write) is logged and the block's error goes on,
    since it names the cause."""
    try:
      self.close()
    except Exception as e:  # noqa: BLE001 - raised unless the block's error is under way
      if exc is None:
        raise
      log.warning("closing the run after the error below also failed: %s", e)

  def train(self, steps: int | None = None, *, signals: StopSignals | None = None,
            final_save: bool = False) -> list[dict]:
    """Runs `steps` more steps (default: up to `train.steps`), logging every `train.log_every`,
    evaluating every `train.eval_every`, checkpointing every `checkpoint.every`. Returns this
    call's logged records (dicts of floats and lists, as in metrics.jsonl). `final_save`: the
    caller saves the last step itself, waiting for it (as `run` does), so no periodic save is
    started there: one in the background would write with `checkpoint.write_threads` threads
    while nothing runs beside it, and the caller would wait for that slower write.

    A logged step's metrics are read once the next step is queued behind it, so that the device
    never waits for the host to write a record and launch the next step; the call's last step
    and a step that evaluates are read at once. A periodic save is made the same way where the
    devices have room for a copy of the state: the copy and the check that the parameters are
    finite are queued behind the step, and read (and the copy handed to the checkpointer) once
    the next step is launched; without that room the save is made before the next step."""
    cfg = self.config
    end = cfg.train.steps if steps is None else self.step + steps
    records, first = [], self.step + 1
    self._since = (time.perf_counter(), self.step)
    queued = None  # a logged step's (step, metrics), read after the next step is launched
    saving_copy = None  # what ends a save of the previous step's copy (`_save_from_copy`)
    try:
      while self.step < end:
        batch = self.data.next_batch()
        self.state, metrics = self.step_for(self.data.documents)(self.state, batch)
        self.checkpointer.stepped()
        self.step = done = self.step + 1
        self._last_metrics = metrics
        if queued is not None:
          records.append(self._log(*queued))
          queued = None
        if saving_copy is not None:
          # (before this step's flag is added: the save's health check then reads none of it)
          finish, saving_copy = saving_copy, None
          finish()
          del finish  # (it holds the state's copy: let go once the save is done with it)
        self.health.add(done, metrics["skipped"])
        evaluate = cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == end)
        # (asked of every process at every step: on several hosts it is a collective)
        stopping = done < end and signals is not None and signals.stop_requested(done)
        # The run's last step, and a step a stop signal ends the run at, are saved in the
        # foreground below (every core), not started in the background here.
        saving = (cfg.checkpoint.every and done % cfg.checkpoint.every == 0
                  and not (final_save and done == end) and not stopping)
        logged = done % cfg.train.log_every == 0 or done == first
        if evaluate or done == end:
          records.append(self._log(done, metrics, evaluate=bool(evaluate)))
        elif logged:
          queued = (done, metrics)
        if saving:
          saving_copy = self._save_from_copy()
          if saving_copy is None:  # (no copy: saved now, the step waited for)
            if queued is not None:  # (logged first: the save may stop the run)
              records.append(self._log(*queued))
              queued = None
            self.save()
        if stopping:
          if queued is not None:
            records.append(self._log(*queued))
          self.save(waited=True)
          self.checkpointer.wait()
          raise Interrupted(done, signals.signum)
    except BaseException:
      if saving_copy is not None:  # (the step whose copy was taken is saved all the same)
        try:
          saving_copy()
          self.checkpointer.wait()
        except Exception as e:  # noqa: BLE001 - the error under way names the cause
          log.warning("the checkpoint begun before the error below could not be saved: %s", e)
      raise
    if saving_copy is not None:  # (the call's last step)
      saving_copy()
    return records

  def step_for(self, documents: int | None) -> Callable:
    """The compiled step for a batch whose rows hold at most `documents` documents (counted on
    the host: DataPipeline.documents; None: not known). The step compiled at the start takes
    rows of up to model.attention_max_documents on one process on GPUs (no branch on the
    device: jmoe/train/step.py `documents_bound`); a batch with more gets, from its first, a
    step compiled for any batch."""
    if self._documents is None or (documents is not None and documents <= self._documents):
      return self._step_fn
    if self._any_step is None:
      log.info("a batch has rows of %s documents, more than model.attention_max_documents "
               "(%d): compiling the step that chooses the attention kernel on the device for "
               "such batches", documents, self._documents)
      self._any_step = self._compile_any()[1]
    return self._any_step

  def _log(self, step: int, metrics: dict, evaluate: bool = False) -> dict:
    """Step `step`'s record, written to metrics.jsonl: its metrics, the tokens/s since the last
    record, the loader's figures, and the held-out loss when `evaluate`."""
    self.health.check()
    record = summarize(jax.device_get(metrics), step)
    record["skipped_steps"] = self.health.total
    (since, since_step), now = self._since, time.perf_counter()
    tokens = self.config.train.batch_size * self.config.data.seq_len * (step - since_step)
    record["tokens_per_s"] = tokens / (now - since)
    record.update(self.data.loader_stats())
    if evaluate:
      record["eval_loss"] = self.evaluate()
    self._since = (time.perf_counter(), step)
    try:
      self._writer.write(record)
    except OSError as e:
      # A save in the background may have filled the disk: its failure, if so, says more
      # (which checkpoint is kept).
      self.checkpointer.wait()
      raise not_written(e, self.workdir / "metrics.jsonl") from None
    return record

  def run(self) -> list[dict]:
    """The command line's run: to `train.steps`, a checkpoint at the end; SIGTERM or SIGINT save
    the step reached and raise `Interrupted`."""
    if self.step >= self.config.train.steps:
      log.warning("the workdir's checkpoint is at step %d and train.steps is %d: nothing left to "
                  "do (raise --config.train.steps to train on)", self.step,
                  self.config.train.steps)
    signals = StopSignals()
    with signals.installed():
      records = self.train(signals=signals, final_save=True)
      self.save(waited=True)
      self.checkpointer.wait()
    return records

  def evaluate(self) -> float:
    """The mean next-token loss over the held-out batches (`data.eval_fraction`)."""
    if not self.config.data.eval_fraction:
      raise ConfigError("evaluation needs held-out documents: set data.eval_fraction (e.g. 0.01)")
    with self.layout.active():
      return evaluation_loss(self._eval_fn, self.state, self.data.eval_batches())

  def _save_from_copy(self) -> Callable[[], None] | None:
    """Starts the save of the current step beside the next one: the state's copy on its devices
    and the parameters' finiteness, both queued behind the step (Checkpointer.copy_for_save).
    Returns what ends the save, to be called once the next step is launched (it reads the
    health flags up to this step and the finiteness, and hands the copy to the checkpointer),
    or None where there is no copy: the caller then saves before the next step."""
    copy = self.checkpointer.copy_for_save(saved_part(self.config, self.state))
    if copy is None:
      return None
    return functools.partial(self._checked_save, self.step, copy, self.data.state(),
                             finite_flag(self.state.params), copied=True)

  def _checked_save(self, step: int, state, data: dict, finite: jax.Array, **how) -> None:
    """Checkpointer.save(step, state, ..., **how) once the health flags so far and `finite`
    (the parameters' finiteness at `step`) say the state may be saved."""
    self.health.check()
    if not bool(finite):
      raise Diverged(f"the parameters at step {step} are not finite, so they are not saved; the "
                     f"checkpoints hold earlier ones. Try a lower train.lr (now "
                     f"{self.config.train.lr:g}) or train.grad_clip")
    self.checkpointer.save(step, state, data, self._record, **how)
    self._saved = step

  def save(self, waited: bool = False) -> pathlib.Path:
    """A checkpoint of the current step (in the background with `checkpoint.async_save`), never
    of non-finite parameters (`Diverged` then). `waited`: the caller waits for it (the run's last,
    a stop signal's), so its write takes every core rather than `checkpoint.write_threads`, and
    is not compressed unless `checkpoint.compress_waited`."""
    if self._saved != self.step:
      self._checked_save(self.step, saved_part(self.config, self.state), self.data.state(),
                         finite_flag(self.state.params), waited=waited)
    return self.checkpointer.directory / str(self.step)

  def expert_load(self) -> np.ndarray:
    """The last step's share of routed tokens per expert, [MoE layers (then MTP blocks), E]."""
    if self._last_metrics is None:
      raise RuntimeError("no step has run yet: call train() first")
    return np.asarray(jax.device_get(self._last_metrics["expert_load"]))

  def model(self) -> nnx.Module:
    """The model with the current parameters (sharded as in training)."""
    return nnx.merge(self.spec.graphdef, self.state.params, self.state.rest)

  def score(self, sequences: list[list[int]]) -> list[list[float]]:
    """log p(token i+1 | tokens up to i) under the current model, per sequence."""
    return score(self.model(), self.layout, sequences)

  def close(self) -> None:
    """Waits for pending checkpoints, stops the input threads, and frees the state's device
    memory (the trainer cannot train after this). What fails in it is raised once all of it is
    done (the first failure: a save's, rather than the metrics' on the same full disk)."""
    failure = None
    for finish in (self.checkpointer.wait, self.data.close, self._writer.close,
                   self.checkpointer.close, self._lock.release):
      try:
        finish()
      except Exception as e:  # noqa: BLE001 - raised below
        failure = failure or e
    if self.state is not None:
      for x in jax.tree.leaves(self.state):
        if isinstance(x, jax.Array) and not x.is_deleted():
          x.delete()
      self.state = self._last_metrics = None
    if isinstance(failure, OSError):
      raise not_written(failure, self.workdir) from None
    if failure is not None:
      raise failure
