"""LoRA: adapters that start as no change, fold exactly into the weights, train alone on a frozen
model whose copy stays out of the run's checkpoints, resume exactly, and shard like their base."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from helpers import build, tiny_config
from jmoe.checkpoint.params import load_model, save_model
from jmoe.config import ConfigError, LoRAConfig, ParallelConfig
from jmoe.model.factory import model_factory
from jmoe.ops.lora import merged
from jmoe.ops.params import LoRAParam
from jmoe.parallel import make_layout
from jmoe.train.loop import Trainer
from test_parallel import MODEL, assert_matches, loss_and_grads

ROOT = pathlib.Path(__file__).resolve().parents[1]
LORA = dict(rank=4, alpha=8.0)
FAMILIES = {  # every weight kind an adapter can sit on
    "gqa_shared_expert": dict(moe=dict(num_shared_experts=1)),
    "mla_blocks": dict(model=dict(attention="mla", mla=dict(q_lora_rank=16, kv_lora_rank=12,
                                                            qk_nope_head_dim=8,
                                                            qk_rope_head_dim=4, v_head_dim=8)),
                       moe=dict(expert_blocks=1.0)),
}


def lora_config(**overrides):
  overrides = {**overrides, "lora": {**LORA, **overrides.get("lora", {})},
               "checkpoint": {"load_params": "unused", **overrides.get("checkpoint", {})}}
  return tiny_config(**overrides)


def randomized(state, seed, std=0.3):
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [std * jax.random.normal(k, x.shape, x.dtype)
                                   for k, x in zip(keys, leaves)])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_new_adapters_change_nothing_and_trained_ones_fold_into_the_weights(name):
  config = lora_config(**FAMILIES[name])
  plain = dataclasses.replace(config, lora=LoRAConfig())
  model, base = build(config), build(plain)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 264, (2, 24)))

  def as_plain(model):  # the model without LoRA that `merged` describes
    state = nnx.state(base)
    nnx.replace_by_pure_dict(state, merged(nnx.to_pure_dict(nnx.state(model)), config.lora.scale))
    nnx.update(base, state)
    return base(tokens)[0]

  kinds = {path[-2] for path, _ in nnx.to_flat_state(nnx.state(model, LoRAParam))}
  assert {"w_in_ED2F", "w_out_EFD", "w_in_D2F", "w_out_FD"} <= kinds  # experts, MLPs
  assert len(kinds) >= 6  # and the attention projections
  before = model(tokens)[0]
  np.testing.assert_array_equal(np.asarray(as_plain(model)), np.asarray(before))  # B = 0
  nnx.update(model, randomized(nnx.state(model, LoRAParam), 1))
  after = model(tokens)[0]
  assert float(jnp.max(jnp.abs(after - before))) > 0.1
  np.testing.assert_allclose(np.asarray(as_plain(model)), np.asarray(after), atol=2e-5)


def test_adapter_gradients_match_single_device(monkeypatch):
  """Nonzero adapters (so that every factor has a gradient) on FSDP 2 x CP 2 x TP 2 for attention
  and MLPs and EP 4 x ETP 2 for the experts (all-to-all), against one device."""
  from jmoe.train import state as state_module
  original = state_module.state_spec

  def with_random_adapters(config, layout, optimizer):
    spec = original(config, layout, optimizer)

    def init():
      state = spec.init()
      return state.replace(params=jax.device_put(randomized(state.params, 2),
                                                 spec.shardings.params))
    return dataclasses.replace(spec, init=init)

  monkeypatch.setattr("test_parallel.state_spec", with_random_adapters)
  dense, expert = dict(data=1, fsdp=2, context=2, tensor=2), dict(data=1, expert=4, tensor=2)
  common = dict(model=MODEL, moe=dict(dispatcher="alltoall"))
  ref_loss, _, ref_grads = loss_and_grads(lora_config(**common), jax.devices()[:1])
  loss, _, grads = loss_and_grads(
      lora_config(**common, parallel=dict(dense=dense, expert=expert)), jax.devices())
  assert all(isinstance(v, LoRAParam) for _, v in nnx.to_flat_state(grads))
  assert_matches(loss, grads, ref_loss, ref_grads)


@pytest.mark.slow
def test_adapters_train_alone_save_small_and_resume_exactly(tmp_path):
  base_config = tiny_config(moe=dict(num_shared_experts=1), train=dict(steps=4))
  base = build(base_config)
  save_model(tmp_path / "base", nnx.state(base), base_config)
  config = lora_config(moe=dict(num_shared_experts=1),
                       checkpoint=dict(load_params=str(tmp_path / "base"), every=2),
                       train=dict(steps=4, lr=1e-2, weight_decay=0.0))
  with Trainer(config, tmp_path / "whole", progress=False) as trainer:
    assert all(isinstance(v, LoRAParam) for _, v in nnx.to_flat_state(trainer.state.params))
    records = trainer.train()
    final = jax.device_get(nnx.to_pure_dict(trainer.state.params))
    model = jax.device_get(nnx.to_pure_dict(nnx.state(trainer.model(), nnx.All(
        nnx.Param, nnx.Not(LoRAParam)))))
  assert records[-1]["loss"] < records[0]["loss"]
  jax.tree.map(np.testing.assert_array_equal, model,
               jax.device_get(nnx.to_pure_dict(nnx.state(base, nnx.Param))))  # frozen
  # The run's checkpoint holds the adapters (and their optimizer moments), not the model.
  with ocp.StandardCheckpointer() as checkpointer:
    saved = checkpointer.metadata(tmp_path / "whole" / "checkpoints" / "4" / "state").item_metadata
  paths = [tuple(str(getattr(k, "key", k)) for k in path)
           for path, _ in jax.tree_util.tree_flatten_with_path(dict(saved))[0]]
  weights = [p for p in paths if any(k.startswith("w_") for k in p)]
  assert len(weights) > 20 and all("lora" in p for p in weights), weights

  with Trainer(config, tmp_path / "resumed", progress=False) as trainer:
    trainer.train(2)
    trainer.save()
  with Trainer(config, tmp_path / "resumed", progress=False) as trainer:
    assert trainer.step == 2
    trainer.train()
    resumed = jax.device_get(nnx.to_pure_dict(trainer.state.params))
  jax.tree.map(np.testing.assert_array_equal, resumed, final)

  # The workdir reads back as the adapted model (its base from load_params), or merged.
  layout = make_layout(ParallelConfig(), jax.devices()[:1])
  _, adapted = load_model(tmp_path / "whole", layout)
  plain_config, plain = load_model(tmp_path / "whole", layout, merge_adapters=True)
  assert plain_config.lora.rank == 0 and not nnx.state(plain, LoRAParam)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 264, (2, 16)))
  np.testing.assert_allclose(np.asarray(plain(tokens)[0]), np.asarray(adapted(tokens)[0]),
                             atol=2e-5)
  (tmp_path / "base").rename(tmp_path / "moved")
  with pytest.raises(ConfigError, match="which is gone; the adapters need it"):
    load_model(tmp_path / "whole", layout)


def test_lora_config_is_checked():
  with pytest.raises(ConfigError, match="lora.targets names \\['heads'\\]"):
    lora_config(lora=dict(targets="attention,heads"))
  with pytest.raises(ConfigError, match="reads from checkpoint.load_params|read from "
                                        "checkpoint.load_params"):
    tiny_config(lora=LORA)
  config = lora_config(lora=dict(targets="experts"))
  kinds = {path[-2] for path, _ in nnx.to_flat_state(
      nnx.state(nnx.eval_shape(model_factory(config)), LoRAParam))}
  assert kinds == {"w_in_ED2F", "w_out_EFD"}
  assert json.dumps(dataclasses.asdict(config.lora))


def test_a_checkpoint_with_adapters_exports_them_folded_everywhere(tmp_path):
  """export-hf folds every adapter into its weight, the multi-token prediction modules' too
  (their list index is a key of its own in the checkpoint): the files equal those of the model
  with the adapters merged beforehand."""
  from jmoe.hf.convert import export_hf
  from jmoe.hf.files import SafetensorsReader
  from jmoe.config import load_config
  config = load_config(ROOT / "configs" / "tiny_deepseek_v3.py",
                       ["model.mtp_depth=1", "lora.rank=4", "lora.alpha=8.0",
                        "checkpoint.load_params=unused"])
  rng = np.random.default_rng(3)  # random values everywhere, adapters included (B != 0)
  state = jax.tree.map(lambda a: rng.normal(0, 0.3, a.shape).astype(a.dtype),
                       nnx.state(nnx.eval_shape(model_factory(config))))
  assert any(str(path[0]) == "mtp" for path, _ in nnx.to_flat_state(nnx.state(state, LoRAParam)))
  save_model(tmp_path / "adapted", state, config)
  plain = dataclasses.replace(config, lora=LoRAConfig())
  merged_state = nnx.state(nnx.eval_shape(model_factory(plain)))
  nnx.replace_by_pure_dict(merged_state, merged(nnx.to_pure_dict(state), config.lora.scale))
  save_model(tmp_path / "merged", merged_state, plain)
  export_hf(tmp_path / "adapted", tmp_path / "adapted-hf")
  export_hf(tmp_path / "merged", tmp_path / "merged-hf")
  got, want = SafetensorsReader(tmp_path / "adapted-hf"), SafetensorsReader(tmp_path / "merged-hf")
  assert set(got.weight_map) == set(want.weight_map)
  assert any(name.startswith(f"model.layers.{config.model.num_layers}.") for name in got.weight_map)
  for name in want.weight_map:
    np.testing.assert_allclose(got(name), want(name), rtol=1e-6, atol=1e-7, err_msg=name)


# ---- reading adapters folded, a part at a time ----

def test_a_folded_weight_reads_the_same_values_whatever_the_region(monkeypatch):
  """FoldedArray (what export-hf and load_params of a LoRA workdir read) folds each matrix whole:
  any region of it (a layer, an expert, a device's shard of rows or columns, rows a block at a
  time) holds the values of the whole fold, bit for bit."""
  import tensorstore as ts
  from jmoe.checkpoint import streamed
  from jmoe.ops.lora import fold
  rng = np.random.default_rng(0)
  w, a, b = (rng.normal(0, 0.3, shape).astype(np.float32)
             for shape in ((3, 4, 24, 20), (3, 4, 24, 4), (3, 4, 4, 20)))
  opened = lambda x: streamed.StoredArray(ts.array(x), pathlib.Path("ckpt"))
  folded = streamed.FoldedArray(opened(w), opened(a), opened(b), 2.0, "w")
  whole = fold(w, a, b, 2.0)
  assert np.abs(whole - w).max() > 0.1
  for region in [(), (1,), (slice(0, 2), 3), (2, slice(1, 3), slice(5, 17)), (0, 0, 7),
                 (slice(None), slice(None), slice(None), slice(3, 11))]:
    np.testing.assert_array_equal(folded.read(region), whole[region], err_msg=str(region))
  monkeypatch.setattr(streamed, "FOLD_BYTES", 4 * 4 * 24 * 20)  # a layer at a time
  np.testing.assert_array_equal(folded.read((slice(None), slice(None), slice(2, 9))),
                                whole[:, :, 2:9])


def test_opened_arrays_have_the_fingerprint_of_placed_ones(monkeypatch):
  """The frozen model's fingerprint, taken from arrays read a region at a time (export-hf, a LoRA
  workdir read folded), equals the one of the same values on devices, whatever the regions."""
  import tensorstore as ts
  from jmoe.checkpoint import fingerprint as digest
  from jmoe.checkpoint.streamed import StoredArray
  rng = np.random.default_rng(0)
  values = {"w": rng.normal(size=(3, 5, 7)).astype(np.float32),
            "layers": {0: rng.normal(size=(4, 6)).astype(jnp.bfloat16)},
            "mask": rng.integers(0, 2, 5).astype(bool), "scalar": np.float32(3.5),
            "ids": rng.integers(-9, 9, (2, 3, 4, 5)).astype(np.int32)}
  placed = digest.fingerprint(jax.tree.map(jnp.asarray, values))
  opened = lambda values: jax.tree.map(
      lambda x: StoredArray(ts.array(np.array(x)), pathlib.Path("c")), values)
  for limit in (1 << 28, 64, 17, 1):  # whole arrays; blocks of rows; single elements
    monkeypatch.setattr(digest, "FINGERPRINT_BYTES", limit)
    assert digest.fingerprint(opened(values)) == placed, limit
  values["w"][2, 4, 6] = np.nextafter(values["w"][2, 4, 6], np.float32(1))  # one bit
  assert digest.fingerprint(opened(values)) != placed
