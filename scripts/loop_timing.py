"""`scripts/benchmark.py --loop`: the training command's own loop timed beside the bare step.

A step's time changes as the model trains (on one H200 the Qwen3 bench's step went from about
148 to 162 ms over 600 steps: the card runs at its power cap, and a trained state's GEMMs draw
more power than the first steps'), so the bench's step, timed from initialization, is not what
a 600-step loop can reach whatever the loop adds. `loop_figures` therefore also times the bare
step, as the bench times it, on the loop's own states: in the middle of each of `probes` equal
parts of the run (on a copy of the state, so that the loop goes on from where it was) and on its
last state, each timed step on a batch of its own, as the loop's (until 2026-12-04 the probes
repeated one batch). The mean of the middle ones is the bare step averaged over the run (the
midpoint rule), the reference the loop's tokens/s is compared with (`loop_steps_vs_mean_step`).
The loop's first step after each probe runs untimed (where that is not a checkpoint's step and
the part has steps after it): after a probe it ran 1.0 s longer than the others on an H100,
where the probe had moved the state to the host and back, and 0.12 s on an H200 (2026-12-06),
a cost of the probe, which a run of the command does not have.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time

from gpu_clocks import GpuClocks, clock_figures


def loop_figures(config, steps: int, warmup: int, probes: int = 3) -> dict:
  """jmoe.train's loop on `config` in a temporary workdir, as `--config.train.steps=STEPS` runs
  it (its checkpoints at the same steps): `steps` steps with their logging and checkpoints
  (`checkpoint.every`), then the run's last save; the first `warmup` of them untimed, the rest
  timed up to the end of the last save (and, apart, up to the end of the last step); the bare
  step on the loop's states (above). The probes' time is not the loop's; each takes a few batches
  of the loop's data."""
  import jax
  from jmoe.train.loop import Trainer
  # (the learning-rate schedule's horizon stays the config's where it is longer)
  config = dataclasses.replace(config, train=dataclasses.replace(
      config.train, steps=max(config.train.steps, steps)))
  tokens_per_step = config.train.batch_size * config.data.seq_len
  timed = steps - warmup
  marks = sorted({max(1, round(timed * (2 * i + 1) / (2 * probes))) for i in range(probes)}
                 | {timed}) if probes else [timed]
  middle, middle_clocks, records, stepped, done, untimed = [], [], [], 0.0, 0, 0
  loop_samples = ""  # the GPUs' clocks while the loop's steps ran (probes and last save apart)
  with tempfile.TemporaryDirectory(prefix="jmoe-loop-") as workdir:
    with Trainer(config, workdir, progress=False) as trainer:
      trainer.train(warmup)
      jax.block_until_ready(trainer.state)
      for k, mark in enumerate(marks):
        with GpuClocks() as clocks:
          t0 = time.perf_counter()
          records += trainer.train(mark - done, final_save=mark == timed)
          jax.block_until_ready(trainer.state)
          stepped += time.perf_counter() - t0
        loop_samples += clocks.samples + "\n"  # (a line the stop cut short stays apart)
        done = mark
        if mark < timed:
          probe_s, probe_clocks = bare_step_s(trainer, warmup, keep=False)
          middle.append(probe_s)
          middle_clocks.append(probe_clocks.figures())
          every = config.checkpoint.every
          if marks[k + 1] - done >= 2 and not (every and (trainer.step + 1) % every == 0):
            trainer.train(1)  # (untimed: the step after the probe; see above)
            jax.block_until_ready(trainer.state)
            done, untimed = done + 1, untimed + 1
      t0 = time.perf_counter()
      trainer.save(waited=True)  # the run's last checkpoint, as the command ends with
      last_call = time.perf_counter() - t0  # (its checks, the copy to the host, the write)
      trainer.checkpointer.wait()
      last_write = time.perf_counter() - t0
      saves = len(trainer.checkpointer.all_steps())
      phases = trainer.checkpointer.last_save
      end_s, clocks = bare_step_s(trainer, warmup, keep=True)
  seconds = stepped + last_write
  timed -= untimed
  tokens = tokens_per_step * timed
  intervals = [r["tokens_per_s"] for r in records if r["step"] > warmup + 1]
  figures = {
      "loop_steps": steps, "loop_timed_steps": timed, "loop_untimed_after_probes": untimed,
      "loop_checkpoint_every": config.checkpoint.every,
      "loop_checkpoints": saves, "loop_step_ms": round(seconds / timed * 1e3, 2),
      "loop_tokens_per_s": round(tokens / seconds),
      # the same to the end of the last step, without the last checkpoint's write
      "loop_tokens_per_s_steps": round(tokens / stepped),
      "loop_last_write_s": round(last_write, 1),
      # of which the save call (the finiteness check, the copy to the host and, since the
      # state goes to the host in parts as it is written, the write and Orbax's finishing) and
      # the rest (what `wait` found left: the whole write until f6e1069)
      "loop_last_save_call_s": round(last_call, 2),
      "loop_last_save_wait_s": round(last_write - last_call, 2),
      # and within it, from the save's call: the state on the host, written, finished (Orbax's
      # finishing and the removal of the step past checkpoint.keep, which took removing_s)
      **({f"loop_last_save_{k}": v for k, v in phases.seconds().items()} if phases else {}),
      "loop_interval_tokens_per_s": [round(min(intervals)), round(max(intervals))]
      if intervals else None,
      # each logged record's (step, tokens/s since the record before): where the loop loses time
      # (a save's interval, the data) shows here; the first record after each probe covers the
      # probe's restart, not a whole interval
      "loop_intervals": [[r["step"], round(r["tokens_per_s"])] for r in records
                         if r["step"] > warmup + 1],
      # the seconds the loop waited for its input (the data pipeline not keeping up)
      "loop_loader_wait_s": round(sum(r.get("loader_wait_s", 0.0) for r in records), 3),
      # the clocks the loop's steps ran at, against the bare steps' (`loop_end_*`,
      # `loop_probe_*`): a probe's few steps after a pause may run at a higher clock than a
      # long stretch of steps at the power cap
      **{f"loop_{k}": v for k, v in clock_figures(loop_samples).items()},
      "loop_end_bare_step_ms": round(end_s * 1e3, 2),
      "loop_end_bare_tokens_per_s": round(tokens_per_step / end_s),
      **{f"loop_end_{k}": v for k, v in clocks.figures().items()}}
  if middle:
    mean_s = sum(middle) / len(middle)
    figures.update({
        "loop_probe_steps": [warmup + m for m in marks[:-1]],
        "loop_probe_bare_step_ms": [round(s * 1e3, 2) for s in middle],
        "loop_mean_bare_step_ms": round(mean_s * 1e3, 2),
        **{f"loop_probe_{k}": [c.get(k) for c in middle_clocks]
           for k in ("gpu_sm_clock_mhz", "gpu_power_w") if any(middle_clocks)},
        # the loop's tokens/s over the bare step's at its mean time: mean step x steps / time
        "loop_steps_vs_mean_step": round(mean_s * timed / stepped, 3),
        "loop_vs_mean_step": round(mean_s * timed / seconds, 3)})
  return figures


def bare_step_s(trainer, warmup: int, *, keep: bool, repeats: int = 5) -> tuple[float, GpuClocks]:
  """Seconds per step of the trainer's compiled step on its current state, timed as the bench
  times it (`warmup` steps first, one sync at the end), and the GPUs' clocks meanwhile. Unlike
  the bench, which repeats one batch, each timed step takes its own, the next ones of the
  trainer's data, put on the devices beforehand: the loop's steps each route a new batch, and
  how evenly a batch's tokens spread over the experts changes a step's time (probes before
  2026-12-04 repeated one batch). `keep`: the trainer goes on from the state reached;
  else the steps run on a copy (one more state on the devices for the while), or where the
  devices lack room for one (the Qwen3 bench's 31.3 GiB state beside its step on an 80 GB H100),
  on the state itself while a copy of it waits in host memory, put back after."""
  import jax
  from jmoe.checkpoint.manager import device_copy
  batches, steps = [], []
  for _ in range(max(warmup, repeats)):
    batches.append(trainer.data.next_batch())
    steps.append(trainer.step_for(trainer.data.documents))
  jax.block_until_ready(batches)
  stashed = None
  state = trainer.state if keep else device_copy(trainer.state, whole=True)
  if state is None:
    state = trainer.state
    stashed = (jax.device_get(state), jax.tree.map(lambda x: x.sharding, state))
  for _ in range(warmup):
    state, _ = steps[0](state, batches[0])
  jax.block_until_ready(state)
  with GpuClocks() as clocks:
    t0 = time.perf_counter()
    for step, batch in zip(steps, batches):
      state, _ = step(state, batch)
    jax.block_until_ready(state)
    seconds = (time.perf_counter() - t0) / len(batches)
  if keep:
    trainer.state = state
  else:
    for x in jax.tree.leaves(state):
      x.delete()
    if stashed is not None:
      trainer.state = jax.block_until_ready(jax.device_put(*stashed))
  return seconds, clocks
