"""Training end to end: the loss falls, accumulation is exact, the CLI writes what it promises."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from flags import command_env
from jmoe.data import first_batches
from jmoe.parallel import make_layout
from jmoe.train.loop import train
from jmoe.train.optimizer import learning_rate, make_optimizer
from jmoe.train.state import state_spec
from jmoe.train.step import make_train_step
from helpers import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def first_step(config, devices):
  """Metrics and new parameters of one train step from the initial state."""
  layout = make_layout(config.parallel, devices)
  optimizer = make_optimizer(config.train, config.precision.moments)
  spec = state_spec(config, layout, optimizer)
  step = jax.jit(make_train_step(spec.graphdef, config, optimizer, learning_rate(config.train)))
  batch = jax.device_put(first_batches(config)[0], layout.batch)
  with layout.active():
    state, metrics = step(spec.init(), batch)
  return jax.device_get(metrics), jax.device_get(state.params)


def test_a_few_steps_lower_the_loss(tmp_path):
  config = tiny_config(train=dict(steps=30, warmup_steps=3, log_every=1, lr=1e-2))
  records = train(config, tmp_path, progress=False)
  losses = [r["loss"] for r in records]
  assert len(losses) == 30
  assert np.mean(losses[-5:]) < losses[0] - 1.0, losses


def test_gradient_accumulation_equals_one_big_batch():
  # The balance loss is a per-micro-batch quantity (as in Megatron-Core), so it is left out here;
  # the z-loss is a token mean and accumulates exactly.
  devices = jax.devices()[:1]
  no_aux = dict(balance=dict(aux_loss_coef=0.0, z_loss_coef=0.001))
  whole, p_whole = first_step(tiny_config(moe=no_aux), devices)
  accum, p_accum = first_step(tiny_config(moe=no_aux, train=dict(micro_batch_size=2)), devices)
  np.testing.assert_allclose(accum["lm_loss"], whole["lm_loss"], rtol=1e-6)
  np.testing.assert_allclose(accum["grad_norm"], whole["grad_norm"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(p_accum), jax.tree.leaves(p_whole)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(accum["z_loss"], whole["z_loss"], rtol=1e-5)
  np.testing.assert_allclose(accum["expert_load"], whole["expert_load"], rtol=1e-5)


def run_cli(workdir, *overrides):
  env = command_env(2)
  cmd = [sys.executable, "-m", "jmoe.train", "--config", str(ROOT / "configs" / "tiny_moe.py"),
         "--workdir", str(workdir), "--no-progress",
         "--config.model.d_model=32", "--config.model.d_ff=64", "--config.moe.d_ff_expert=16",
         "--config.model.num_layers=2", "--config.data.seq_len=32",
         "--config.data.max_corpus_bytes=300000", "--config.train.warmup_steps=1",
         "--config.train.log_every=2", *overrides]
  return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_cli_reports_config_errors(tmp_path):
  result = run_cli(tmp_path, "--config.moe.top_k=9")
  assert result.returncode == 2
  assert "moe.top_k (9) is larger than moe.num_experts (8)" in result.stderr


def test_expert_bias_updates_and_is_checkpointed(tmp_path):
  from flax import nnx
  from jmoe.checkpoint import Checkpointer
  from jmoe.moe import ExpertBias
  config = tiny_config(moe=dict(balance=dict(aux_loss_coef=0.0, bias_update_rate=0.01)),
                       train=dict(steps=3))
  train(config, tmp_path, progress=False)
  layout = make_layout(config.parallel)
  spec = state_spec(config, layout, make_optimizer(config.train, config.precision.moments))
  checkpointer = Checkpointer(tmp_path / "checkpoints", keep=1)
  restored, _ = checkpointer.restore(3, spec.abstract, spec.shardings)
  checkpointer.close()
  biases = [v for v in jax.tree.leaves(restored.rest, is_leaf=lambda x: isinstance(x, ExpertBias))
            if isinstance(v, ExpertBias)]
  assert len(biases) == 1 and biases[0].shape == (2, 8)  # two MoE layers, eight experts
  # Three sign steps of 0.01: every entry is a multiple of 0.01 in [-0.03, 0.03], not all zero.
  values = np.asarray(biases[0][...])
  np.testing.assert_allclose(values * 100, np.round(values * 100), atol=1e-4)
  assert np.abs(values).max() <= 0.0300001 and np.abs(values).max() > 0
  # The bias is not a trained parameter.
  assert not any(isinstance(v, ExpertBias) for v in jax.tree.leaves(
      restored.params, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def test_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path):
  from jmoe.config import ConfigError
  with pytest.raises(ConfigError, match=r"model.vocab_size \(200\) is smaller than the byte "
                                        r"tokenizer's 258 ids"):
    train(tiny_config(model=dict(vocab_size=200)), tmp_path, progress=False)


def test_multi_token_prediction_adds_its_weighted_loss(tmp_path):
  config = tiny_config(model=dict(mtp_depth=1), train=dict(steps=3, mtp_loss_weight=0.5),
                       moe=dict(balance=dict(bias_update_rate=0.01)))
  records = train(config, tmp_path, progress=False)
  for r in records:
    assert r["mtp_loss"] > 0.5 * 3.0  # about half of ln(264) at the start
    np.testing.assert_allclose(r["loss"], r["lm_loss"] + r["aux_loss"] + r["z_loss"] +
                               r["mtp_loss"], rtol=1e-5)
    assert len(r["expert_load"]) == 3  # two MoE layers and the MTP block


def test_adamw_update_is_optax_adamw_with_clipping():
  """The fused update against optax's AdamW after global-norm clipping, float32, over steps with
  and without clipping, on parameters of every kind (decayed or not)."""
  import optax
  from helpers import build
  from jmoe.ops.params import DECAYED_KINDS, kind_of
  from flax import nnx
  config = tiny_config(train=dict(grad_clip=0.5, weight_decay=0.1, lr=1e-2))
  params = nnx.state(build(config), nnx.Param)
  ours = make_optimizer(config.train, "float32")
  mask = jax.tree.map(lambda v: v.replace(kind_of(v) in DECAYED_KINDS), params,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))
  reference = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(
      learning_rate(config.train), b1=config.train.b1, b2=config.train.b2, eps=config.train.eps,
      weight_decay=0.1, mask=mask))
  state, ref_state, p, ref_p = ours.init(params), reference.init(params), params, params
  for i, scale in enumerate([1.0, 0.01, 3.0, 0.02]):  # clipped, not clipped, ...
    grads = jax.tree.map(lambda x: scale * jax.random.normal(jax.random.key(i), x.shape), params)
    p, state = ours.apply(grads, state, p, optax.tree.norm(grads))
    updates, ref_state = reference.update(grads, ref_state, ref_p)
    ref_p = optax.apply_updates(ref_p, updates)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_bfloat16_moments_train_like_float32_moments(tmp_path):
  """Precision-aware AdamW: float32 master weights with bfloat16 moments (half the optimizer
  state) follow the float32-moment run's loss."""
  runs = {}
  for moments in ("float32", "bfloat16"):
    config = tiny_config(train=dict(steps=30, warmup_steps=3, log_every=1, lr=1e-2),
                         precision=dict(moments=moments))
    runs[moments] = np.array([r["loss"] for r in train(config, tmp_path / moments,
                                                        progress=False)])
  assert runs["float32"][-1] < runs["float32"][0] - 1.0
  np.testing.assert_allclose(runs["bfloat16"], runs["float32"], rtol=0.01)
  config = tiny_config(precision=dict(moments="bfloat16"))
  spec = state_spec(config, make_layout(config.parallel, jax.devices()[:1]),
                    make_optimizer(config.train, "bfloat16"))
  moments = jax.tree.leaves((spec.abstract.opt_state.mu, spec.abstract.opt_state.nu))
  assert {str(m.dtype) for m in moments} == {"bfloat16"}
  assert {str(p.dtype) for p in jax.tree.leaves(spec.abstract.params)} == {"float32"}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_step_that_is_not_applied_changes_nothing(optimizer):
  """A non-finite gradient's update is selected away: parameters, moments and the update count
  come out bit for bit as they went in (NaN gradients included)."""
  import jax.numpy as jnp
  from helpers import build
  from flax import nnx
  config = tiny_config(precision=dict(moments="bfloat16"), train=dict(optimizer=optimizer))
  params = nnx.state(build(config), nnx.Param)
  optimizer = make_optimizer(config.train, "bfloat16")
  grads = jax.tree.map(lambda x: jnp.ones_like(x), params)
  params1, state1 = optimizer.apply(grads, optimizer.init(params), params, jnp.float32(3.0))
  nan_grads = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), params)
  params2, state2 = optimizer.apply(nan_grads, state1, params1, jnp.float32(jnp.nan),
                                    applied=jnp.bool_(False))
  for a, b in zip(jax.tree.leaves((params2, state2)), jax.tree.leaves((params1, state1))):
    np.testing.assert_array_equal(a, b)
  assert int(state2.count) == int(state1.count) == 1


def test_global_norm_summed_a_layer_at_a_time_is_the_norm():
  """The gradient norm over stacked layers' slices (each layer's own array) equals the norm of
  the whole tree, and does slice the stacks (the point of it: no sum over a stacked gradient)."""
  import optax
  from flax import nnx
  from helpers import build
  from jmoe.train.optimizer import global_norm
  params = nnx.state(build(tiny_config(model=dict(num_layers=3))), nnx.Param)
  keys = iter(jax.random.split(jax.random.key(0), 100))
  grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), params)
  expected = float(optax.tree.norm(grads))
  assert abs(float(global_norm(grads)) - expected) < 1e-5 * expected
  assert float(global_norm(grads, by_layer=False)) == pytest.approx(expected, rel=1e-6)
  sliced = str(jax.make_jaxpr(global_norm)(grads)).count(" slice[")
  assert sliced >= 3 and " slice[" not in str(jax.make_jaxpr(
      lambda g: global_norm(g, by_layer=False))(grads))


def test_copying_stacked_gradients_changes_no_update():
  """train.copy_stacked_grads puts a barrier on each layer-stacked gradient (and only on those)
  and gives the update it gives without."""
  from flax import nnx
  from helpers import build
  from jmoe.ops.params import is_stacked
  config = tiny_config(model=dict(num_layers=3))
  params = nnx.state(build(config), nnx.Param)
  keys = iter(jax.random.split(jax.random.key(0), 100))
  grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), params)
  stacked = sum(jax.tree.leaves(jax.tree.map(is_stacked, params, is_leaf=lambda x: isinstance(
      x, nnx.Variable))))
  assert 0 < stacked < len(jax.tree.leaves(params))
  results, barriers = [], []
  for copy in (False, True):
    optimizer = make_optimizer(tiny_config(train=dict(copy_stacked_grads=copy)).train)
    state = optimizer.init(params)
    apply = lambda g, s, p: optimizer.apply(g, s, p, np.float32(1.0))
    barriers.append(str(jax.make_jaxpr(apply)(grads, state, params)).count("optimization_barrier"))
    results.append(apply(grads, state, params))
  assert barriers == [0, stacked]
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_array_equal(a, b)


def test_a_model_without_moe_layers_logs_only_finite_json(tmp_path):
  """A dense model has no MoE layer to average the dropped fraction over: it logs 0, not NaN
  (which metrics.jsonl's JSON cannot hold)."""
  import json
  config = tiny_config(model=dict(num_layers=2), moe=dict(first_k_dense=2),
                       train=dict(steps=2, warmup_steps=1, log_every=1))
  records = train(config, tmp_path / "run", progress=False)
  assert records and records[-1]["dropped_fraction"] == 0.0

  def refuse(constant):
    raise ValueError(f"{constant} in metrics.jsonl")

  for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
    json.loads(line, parse_constant=refuse)


def test_an_error_in_the_block_is_not_hidden_by_one_in_closing(tmp_path, monkeypatch, caplog):
  """A full disk met by a save stops the run with the save's message; closing then meets the
  same disk in the metrics' last write, and that second error is logged, not raised in place of
  the first. Without an error under way, closing's own error is raised."""
  import errno
  from jmoe.config import ConfigError
  from jmoe.train import loop
  config = tiny_config()
  full = OSError(errno.ENOSPC, "No space left on device")

  def failing_close(writer):
    close = writer.close

    def close_on_a_full_disk():
      close()
      raise full
    monkeypatch.setattr(writer, "close", close_on_a_full_disk)

  with pytest.raises(ConfigError, match="saving the checkpoint of step 1"):
    with loop.Trainer(config, tmp_path / "a", progress=False) as trainer:
      failing_close(trainer._writer)
      raise ConfigError("saving the checkpoint of step 1 failed")
  assert "closing the run after the error below also failed" in caplog.text
  with pytest.raises(ConfigError, match=r"cannot be written \(No space left on device\)"):
    with loop.Trainer(config, tmp_path / "b", progress=False) as trainer:
      failing_close(trainer._writer)


def test_a_full_disk_met_by_the_metrics_names_the_save_that_filled_it(tmp_path, monkeypatch):
  """A save in the background fails on a full disk; the next record's write meets the same disk
  before the save's failure is read: the error raised is the save's (which says what is kept),
  not the metrics file's."""
  import errno
  from jmoe.config import ConfigError
  from jmoe.train import loop
  config = tiny_config(train=dict(log_every=1), checkpoint=dict(every=1, async_save=True))
  full = OSError(errno.ENOSPC, "No space left on device")

  def fail(*args, **kwargs):
    raise full

  with loop.Trainer(config, tmp_path, progress=False) as trainer:
    manager = trainer.checkpointer._manager  # Orbax's: the write after the save's start fails
    save, finish, started = manager.save, manager.wait_until_finished, []

    def save_then_fail(*args, **kwargs):  # the next wait for it raises, once
      save(*args, **kwargs)
      started.append(True)

    monkeypatch.setattr(manager, "save", save_then_fail)
    monkeypatch.setattr(manager, "wait_until_finished",
                        lambda: finish() or (fail() if started and started.pop() else None))
    write = trainer._writer.write
    monkeypatch.setattr(trainer._writer, "write",
                        lambda record: fail() if record["step"] > 1 else write(record))
    with pytest.raises(ConfigError, match=r"saving the checkpoint of step 1 in .* failed "
                                          r"\(OSError: \[Errno 28\] No space left"):
      trainer.train()


def test_a_logged_step_is_read_once_the_next_step_is_launched(tmp_path, monkeypatch):
  """The loop reads a logged step's metrics (a wait for the device) only after it has launched the
  next step, so the device is never idle while the host writes a record; the call's last step
  and a logged step that saves (step 4) are read at once. Records and their order are as
  before."""
  from jmoe.train import loop
  events = []
  config = tiny_config(train=dict(steps=6, log_every=2), checkpoint=dict(every=4))
  with loop.Trainer(config, tmp_path, progress=False) as trainer:
    step_fn = trainer._step_fn

    def launched(state, batch):
      out = step_fn(state, batch)
      events.append(("launch", trainer.step + 1))
      return out

    trainer._step_fn = launched
    summarize = loop.summarize
    monkeypatch.setattr(loop, "summarize",
                        lambda metrics, step: events.append(("read", step)) or summarize(
                            metrics, step))
    records = trainer.train()
  assert [r["step"] for r in records] == [1, 2, 4, 6]
  assert all(r["tokens_per_s"] > 0 for r in records)
  assert events == [("launch", 1), ("launch", 2), ("read", 1), ("launch", 3), ("read", 2),
                    ("launch", 4), ("read", 4), ("launch", 5), ("launch", 6), ("read", 6)]
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2, 4, 6]


def test_a_save_with_a_device_copy_is_handed_over_once_the_next_step_is_launched(tmp_path,
                                                                                monkeypatch):
  """Where the devices have room for a copy of the state, a periodic save's copy and the check
  that the parameters are finite are queued behind the step, and the loop reads them (and hands
  the copy to the checkpointer) only after it has launched the next step, so the device does
  not wait for the host there (nor for the check's compilation, done at the start); without
  room the save is made before the next step. Either way the checkpoints hold the same state
  and data position, bit for bit, and the records match; also where the copy goes to the host a
  part at a time (`checkpoint.staging_gb`)."""
  from jmoe.checkpoint import Checkpointer, manager
  from jmoe.train import loop
  from jmoe.train.start import saved_part
  real_copy = manager.device_copy
  roomy = lambda device: {"bytes_limit": 1 << 40, "peak_bytes_in_use": 0}
  events, saved, logged = {}, {}, {}
  for room, staging in ((True, 0.0), (False, 0.0), ("staged", 2e-6)):
    config = tiny_config(train=dict(steps=5, log_every=2),
                         checkpoint=dict(every=2, keep=5, staging_gb=staging))
    monkeypatch.setattr(manager, "device_copy",
                        lambda tree, *_: real_copy(tree, roomy) if room else None)
    events[room] = seen = []
    workdir = tmp_path / str(room)
    with loop.Trainer(config, workdir, progress=False) as trainer:
      assert trainer.checkpointer._staging == staging
      with monkeypatch.context() as m:  # (the saves' finiteness check: compiled at the start)
        m.setattr(jax, "jit", lambda *args, **kwargs: pytest.fail("compiled at the save"))
        assert bool(loop.finite_flag(trainer.state.params))
      step_fn, save = trainer._step_fn, trainer.checkpointer.save

      def launched(state, batch):
        out = step_fn(state, batch)
        seen.append(("launch", trainer.step + 1))
        return out

      def recorded(step, *args, copied=False, **kwargs):
        seen.append(("save", step))
        assert copied == bool(room)
        return save(step, *args, copied=copied, **kwargs)

      trainer._step_fn = launched
      monkeypatch.setattr(trainer.checkpointer, "save", recorded)
      summarize = loop.summarize
      monkeypatch.setattr(loop, "summarize", lambda metrics, step: seen.append(
          ("read", step)) or summarize(metrics, step))
      logged[room] = [{k: v for k, v in r.items()  # (less the timings)
                       if k != "tokens_per_s" and not k.startswith("loader_")}
                      for r in trainer.train()]
      trainer.checkpointer.wait()
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                              saved_part(config, trainer.state))
      shardings = jax.tree.map(lambda x: x.sharding, saved_part(config, trainer.state))
    monkeypatch.setattr(loop, "summarize", summarize)
    reader = Checkpointer(workdir / "checkpoints", keep=5)
    assert reader.all_steps() == [2, 4]
    saved[room] = [(jax.tree.map(np.asarray, state), data)
                   for state, data in (reader.restore(step, abstract, shardings)
                                       for step in (2, 4))]
    reader.close()
  launch = lambda *steps: [("launch", s) for s in steps]
  assert events[True] == [*launch(1, 2), ("read", 1), ("launch", 3), ("read", 2), ("save", 2),
                          *launch(4, 5), ("read", 4), ("save", 4), ("read", 5)]
  assert events[False] == [*launch(1, 2), ("read", 1), ("read", 2), ("save", 2),
                           *launch(3, 4), ("read", 4), ("save", 4), ("launch", 5), ("read", 5)]
  assert events["staged"] == events[True]
  assert logged[True] == logged[False] == logged["staged"]
  assert [r["step"] for r in logged[True]] == [1, 2, 4, 5]
  for (state, data), (want, want_data), (staged, staged_data) in zip(
      saved[True], saved[False], saved["staged"]):
    assert data == want_data == staged_data
    jax.tree.map(np.testing.assert_array_equal, state, want)
    jax.tree.map(np.testing.assert_array_equal, staged, want)
  assert any(not np.array_equal(a, b) for a, b in zip(*(jax.tree.leaves(state)
                                                         for state, _ in saved[True])))


def test_a_periodic_saves_copy_is_let_go_once_its_save_is_written(tmp_path, monkeypatch):
  """The state's copy for a save beside training holds device memory (and page-locked host
  memory, for the part that did not fit): once that save is written nothing holds it, though
  the next save is steps away (the loop held it until then, so two copies met at that save)."""
  import gc
  import weakref
  from jmoe.checkpoint import manager
  from jmoe.train import loop
  real_copy = manager.device_copy
  roomy = lambda device: {"bytes_limit": 1 << 40, "peak_bytes_in_use": 0}
  copies, alive = [], []

  def copied(tree, *_):
    copy = real_copy(tree, roomy)
    copies.append([weakref.ref(x) for x in jax.tree.leaves(copy)])
    return copy

  monkeypatch.setattr(manager, "device_copy", copied)
  config = tiny_config(train=dict(steps=5), checkpoint=dict(every=2, keep=5))
  with loop.Trainer(config, tmp_path / "w", progress=False) as trainer:
    step_fn = trainer._step_fn

    def launched(state, batch):
      if trainer.step + 1 in (4, 5):  # (step 2's save handed over at step 3, step 4's at 5)
        trainer.checkpointer.wait()
        gc.collect()
        alive.append([sum(r() is not None for r in refs) for refs in copies])
      return step_fn(state, batch)

    trainer._step_fn = launched
    trainer.train()
  # (at step 5's launch, step 4's copy is not handed over yet: the loop holds it)
  assert alive == [[0], [0, len(copies[1])]] and len(copies) == 2, alive


def test_a_save_from_a_device_copy_outlives_an_error_and_never_holds_non_finite_values(
    tmp_path, monkeypatch):
  """A save whose copy was taken when the next step's batch fails is still made (the error goes
  on); one whose parameters turn out not finite is refused (`Diverged`) and leaves the earlier
  checkpoints as they were."""
  import jax.numpy as jnp
  from jmoe.checkpoint import manager
  from jmoe.errors import Diverged
  from jmoe.train import loop
  real_copy = manager.device_copy
  monkeypatch.setattr(manager, "device_copy", lambda tree, *_: real_copy(
      tree, lambda device: {"bytes_limit": 1 << 40, "peak_bytes_in_use": 0}))
  config = tiny_config(train=dict(steps=8, log_every=1), checkpoint=dict(every=2, keep=5))
  steps = lambda: sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
  with loop.Trainer(config, tmp_path, progress=False) as trainer:
    trainer.train(2)  # (the call ends on a save's step: made as the call returns)
    trainer.checkpointer.wait()
    assert steps() == [2]
    next_batch = trainer.data.next_batch

    def failing():
      if trainer.step == 4:
        raise OSError(5, "Input/output error")
      return next_batch()
    monkeypatch.setattr(trainer.data, "next_batch", failing)
    with pytest.raises(OSError, match="Input/output error"):
      trainer.train(3)
    assert trainer.step == 4 and steps() == [2, 4]
    monkeypatch.setattr(trainer.data, "next_batch", next_batch)
    monkeypatch.setattr(loop, "finite_flag", lambda tree: jnp.asarray(False))
    with pytest.raises(Diverged, match="parameters at step 6 are not finite, so they are not "
                                       "saved"):
      trainer.train(2)
  assert steps() == [2, 4]


def test_the_runs_last_step_is_saved_once_with_every_core(tmp_path, monkeypatch):
  """`run` ends with a save it waits for; where a periodic save falls on the last step too, that
  step is saved once, as the waited save (every core), not started in the background at
  `checkpoint.write_threads` threads and then waited for. Periodic saves before it stay in the
  background."""
  from jmoe.train import loop
  config = tiny_config(train=dict(steps=4, warmup_steps=1, log_every=2),
                       checkpoint=dict(every=2))
  with loop.Trainer(config, tmp_path, progress=False) as trainer:
    saves = []
    save = trainer.checkpointer.save

    def recorded(step, *args, waited=False, **kwargs):
      saves.append((step, waited))
      return save(step, *args, waited=waited, **kwargs)
    monkeypatch.setattr(trainer.checkpointer, "save", recorded)
    trainer.run()
  assert saves == [(2, False), (4, True)]
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [2, 4]
  # A stop signal that lands on a periodic save's step: that step too is saved once, waited.
  import signal
  from jmoe.errors import Interrupted
  from jmoe.train.preemption import StopSignals
  config = tiny_config(train=dict(steps=6, warmup_steps=1, log_every=2),
                       checkpoint=dict(every=2))
  with loop.Trainer(config, tmp_path / "stopped", progress=False) as trainer:
    saves.clear()
    save = trainer.checkpointer.save
    monkeypatch.setattr(trainer.checkpointer, "save", recorded)
    signals = StopSignals()
    monkeypatch.setattr(signals, "stop_requested", lambda step: step == 4)
    signals.signum = signal.SIGTERM
    with pytest.raises(Interrupted):
      trainer.train(signals=signals)
  assert saves == [(2, False), (4, True)]


def test_the_start_says_which_gemms_fp8_covers(tmp_path, caplog):
  from jmoe.train import loop
  with caplog.at_level("INFO", logger="jmoe"):
    with loop.Trainer(tiny_config(precision=dict(gemm="fp8")), tmp_path, progress=False):
      pass
  assert ("FP8 (current recipe): the routed experts' GEMMs; the dense GEMMs "
          "(precision.fp8_dense=false) and the LM head in") in caplog.text


def test_rows_of_more_documents_than_the_step_takes_get_a_step_for_any_batch(tmp_path,
                                                                             monkeypatch):
  """On one process on GPUs the step is compiled for rows of at most model.attention_max_documents
  documents (no branch on the device: jmoe/train/step.py `documents_bound`); a batch whose rows
  hold more, counted on the host, runs a step compiled for any batch, from the first such batch
  on, and batches that fit keep the first step. Forced here with a bound of 4 on packed short
  documents: each step goes to the step its batch's count calls for, both kinds occur, and the
  losses equal those of a run with the one step for any batch (on the CPU the same program)."""
  from jmoe.train import loop
  docs = tmp_path / "docs"
  docs.mkdir()
  rng = np.random.default_rng(3)
  for i in range(60):
    (docs / f"{i:02d}.txt").write_text(f"d{i} " + "ab " * int(rng.integers(0, 12)))
  config = tiny_config(train=dict(steps=6), data=dict(source=str(docs)))

  def run(workdir, bound):
    if bound is not None:
      monkeypatch.setattr(loop, "documents_bound", lambda config: bound)
    used = []
    with loop.Trainer(config, workdir, progress=False) as trainer:
      first, compile_any = trainer._step_fn, trainer._compile_any

      def fitting(state, batch):
        used.append(("first", trainer.data.documents))
        return first(state, batch)

      def any_batch():
        config, compiled = compile_any()
        return config, lambda state, batch: (used.append(("any", trainer.data.documents))
                                             or compiled(state, batch))

      trainer._step_fn, trainer._compile_any = fitting, any_batch
      records = trainer.train()
    monkeypatch.undo()
    return [r["loss"] for r in records], used

  want, used = run(tmp_path / "any", None)
  assert {kind for kind, _ in used} == {"first"}  # (no bound: the first step takes any batch)
  got, used = run(tmp_path / "bound", 4)
  assert got == want
  assert all((kind == "any") == (documents > 4) for kind, documents in used), used
  assert {kind for kind, _ in used} == {"first", "any"}, used
