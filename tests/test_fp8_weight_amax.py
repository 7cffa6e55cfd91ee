"""The FP8 expert weights' amax kept by the train step (precision.fp8_weight_amax=kept): the same
training as reading it from the weights at each use, on one device and on an expert-parallel
layout; never saved, and made again from the parameters wherever a run's state comes from
(resume, load_params, LoRA's frozen model)."""

import json
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from helpers import build, tiny_config
from test_lora import lora_config
from test_train import first_batches
from jmoe.checkpoint.manager import Checkpointer
from jmoe.checkpoint.params import save_model
from jmoe.moe.layer import keep_weight_amax
from jmoe.ops.fp8 import WeightAmax
from jmoe.parallel import make_layout
from jmoe.train.loop import initial_state, train
from jmoe.train.optimizer import learning_rate, make_optimizer
from jmoe.train.state import state_spec
from jmoe.train.step import make_eval_step, make_gradients, make_train_step

FP8 = dict(params="float32", compute="bfloat16", gemm="fp8", fp8_weight_amax="kept")
EP4 = dict(dense=dict(data=1, fsdp=-1), expert=dict(expert=4, data=-1))


def spec_for(config, devices):
  layout = make_layout(config.parallel, devices)
  optimizer = make_optimizer(config.train, config.precision.moments)
  return layout, optimizer, state_spec(config, layout, optimizer)


def kept(state):
  return jax.device_get(nnx.to_pure_dict(nnx.filter_state(state.rest, WeightAmax)))


def weights_amax(config, params, rest):
  """The amaxes made from `params` op by op, outside any train state's code."""
  model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: build_like(config))), params, rest)
  keep_weight_amax(model)
  return jax.device_get(nnx.to_pure_dict(nnx.state(model, WeightAmax)))


def build_like(config):
  from jmoe.model.factory import model_factory
  return model_factory(config, train_state=True)()


def run_steps(config, devices, steps=3):
  layout, optimizer, spec = spec_for(config, devices)
  step = jax.jit(make_train_step(spec.graphdef, config, optimizer, learning_rate(config.train)))
  batch = jax.device_put(first_batches(config)[0], layout.batch)
  state, losses = spec.init(), []
  with layout.active():
    for _ in range(steps):
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
  return layout, spec, state, losses, batch


@pytest.mark.parametrize("parallel,devices", [({}, 1), (EP4, 4)])
def test_kept_amax_trains_as_reading_it_from_the_weights(parallel, devices):
  devices = jax.devices()[:devices]
  configs = {mode: tiny_config(precision=dict(FP8, fp8_weight_amax=mode), parallel=parallel,
                               train=dict(warmup_steps=1)) for mode in ("kept", "each_use")}
  runs = {mode: run_steps(config, devices) for mode, config in configs.items()}
  layout, spec, state, losses, batch = runs["kept"]
  _, other_spec, other, other_losses, _ = runs["each_use"]
  assert losses == other_losses and losses[2] < losses[0], (losses, other_losses)
  assert kept(state) and not kept(other)
  # From the same parameters both compute the same gradients, bit for bit.
  gradients = {mode: jax.jit(make_gradients(s.graphdef, configs[mode]))
               for mode, s in (("kept", spec), ("each_use", other_spec))}
  with layout.active():
    grads = gradients["kept"](state.params, state.rest, batch, None)[0]
    read = gradients["each_use"](state.params, nnx.filter_state(state.rest, nnx.Not(WeightAmax)),
                                 batch, None)[0]
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(grads), jax.device_get(read))
  # The updates agree to float32's rounding: XLA fuses the amax into the update's pass, which
  # may round the update differently (seen on CPU: 1.5e-8 in some expert weights after 3 steps).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=3e-8),
               jax.device_get(state.params), jax.device_get(other.params))
  # What the state keeps is the amax of its weights as they are after the last update.
  config = configs["kept"]
  jax.tree.map(np.testing.assert_array_equal, kept(state),
               weights_amax(config, state.params, state.rest))
  # The forward pass scales the experts by what is kept: halved, the loss changes.
  evaluate = jax.jit(make_eval_step(spec.graphdef, config))
  halved = jax.tree.map(lambda v: v / 2 if isinstance(v, WeightAmax) else v, state.rest,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))
  with layout.active():
    loss, _ = evaluate(state.params, state.rest, batch)
    stale, _ = evaluate(state.params, halved, batch)
  assert abs(float(stale) - float(loss)) > 1e-3, (loss, stale)


def losses_of(workdir):
  return [json.loads(line)["loss"] for line in open(workdir / "metrics.jsonl")]


def test_kept_amax_is_not_saved_and_is_made_again_on_resume_and_from_loaded_weights(tmp_path):
  config = tiny_config(precision=FP8, train=dict(steps=4, log_every=1, warmup_steps=1),
                       checkpoint=dict(every=2, async_save=False))
  devices = jax.devices()[:2]
  train(config, tmp_path / "whole", progress=False, devices=devices)
  with ocp.StandardCheckpointer() as checkpointer:
    saved = checkpointer.metadata(tmp_path / "whole" / "checkpoints" / "4" / "state").item_metadata
  assert "amax_in_E" not in str(jax.tree_util.tree_flatten_with_path(dict(saved))[0])
  assert "w_in_ED2F" in str(jax.tree_util.tree_flatten_with_path(dict(saved))[0])
  shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
  train(config, tmp_path / "resumed", progress=False, devices=devices)  # from step 2
  assert losses_of(tmp_path / "resumed") == losses_of(tmp_path / "whole")

  # Parameters from elsewhere (a model of another seed than the new run would draw): the kept
  # amaxes are theirs, with and without LoRA (whose frozen experts the step leaves alone).
  base_config = tiny_config(precision=FP8)
  save_model(tmp_path / "base", nnx.state(build(base_config, seed=7)), base_config)
  for name, started in [
      ("load_params", tiny_config(precision=FP8,
                                  checkpoint=dict(load_params=str(tmp_path / "base")))),
      ("lora", lora_config(precision=FP8, checkpoint=dict(load_params=str(tmp_path / "base"))))]:
    _, _, spec = spec_for(started, devices)
    checkpointer = Checkpointer(tmp_path / name, 1, async_save=False)
    step, state, _ = initial_state(started, spec, checkpointer)
    checkpointer.close()
    drawn = kept(spec.init())
    made = weights_amax(started, state.params, state.rest)
    jax.tree.map(np.testing.assert_array_equal, kept(state), made)
    assert step == 0 and not all(jax.tree.leaves(jax.tree.map(np.array_equal, made, drawn)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_stored_amax_is_the_largest_stored_magnitude(dtype):
  """Of values rounded from float32 in the same program (where XLA may keep the wider value), per
  row and whole; NaN propagates as the maximum does."""
  from jmoe.ops.fp8 import stored_amax
  wide = jax.random.normal(jax.random.key(0), (6, 300)) * 3 + 1e-3
  wide = wide.at[0, 7].set(-50.123456)
  got = jax.jit(lambda w: stored_amax(w.astype(dtype), axis=-1))(wide)
  stored = np.asarray(wide.astype(dtype)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(got), np.abs(stored).max(axis=-1))
  assert float(got[0]) == float(np.float32(np.asarray(wide[0, 7].astype(dtype)))) * -1
  assert np.isnan(float(stored_amax(wide.at[2, 2].set(np.nan).astype(dtype))))


def test_kept_amax_gives_the_same_gradients_through_pipeline_stages():
  """1F1B over two stages (the layers' amaxes split with their weights): the gradients of reading
  the amax at each use, bit for bit."""
  import dataclasses
  from test_pipeline import config_for, gradients
  base = config_for(dict(pipeline=2, pipeline_schedule="1f1b", dense=dict(data=4),
                         expert=dict(data=4)))
  runs = [gradients(dataclasses.replace(base, precision=dataclasses.replace(
      base.precision, **dict(FP8, fp8_weight_amax=mode))), jax.devices()) for mode in
      ("kept", "each_use")]
  assert runs[0][1]["loss"] == runs[1][1]["loss"]
  jax.tree.map(np.testing.assert_array_equal, runs[0][0], runs[1][0])
