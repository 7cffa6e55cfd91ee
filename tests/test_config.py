import pathlib

import pytest

from jmoe.config import ConfigError, load_config
from helpers import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_FILE = ROOT / "configs" / "tiny_moe.py"


def test_tiny_config_file_loads_and_divides_by_eight():
  config = load_config(TINY_FILE)
  assert config.moe.num_experts % 8 == 0
  assert config.model.num_heads % 8 == 0
  assert config.train.batch_size % 8 == 0


def test_overrides_are_typed():
  config = load_config(TINY_FILE, ["--config.train.steps=70", "config.train.lr=1e-3",
                                   "--config.model.tie_embeddings=True", "--config.moe.gemm=dense",
                                   "--config.moe.balance.aux_loss_coef=0"])
  assert config.train.steps == 70
  assert config.train.lr == 1e-3
  assert config.model.tie_embeddings is True
  assert config.moe.gemm == "dense"
  assert config.moe.balance.aux_loss_coef == 0.0 and isinstance(config.moe.balance.aux_loss_coef,
                                                                float)


@pytest.mark.parametrize("override, message", [
    ("--config.train.stepz=3", "unknown key 'train.stepz'"),
    ("--config.trian.steps=3", "no config group 'trian'"),
    ("--config.train.steps=many", "'train.steps' must be a int"),
    ("--config.moe.router=3", "unknown key 'moe.router'"),
    ("--config.model.tie_embeddings=1", "takes True or False"),
    ("--config.train.steps", "must look like"),
])
def test_bad_overrides(override, message):
  with pytest.raises(ConfigError, match=message):
    load_config(TINY_FILE, [override])


@pytest.mark.parametrize("overrides, message", [
    (dict(moe=dict(top_k=9)), r"moe.top_k \(9\) is larger than moe.num_experts \(8\)"),
    (dict(model=dict(num_heads=6, num_kv_heads=4)),
     r"model.num_heads \(6\) must be a multiple of model.num_kv_heads \(4\)"),
    (dict(model=dict(head_dim=7)), "head_dim must be even"),
    (dict(moe=dict(first_k_dense=4)), r"moe.first_k_dense \(4\) must be in \[0, model.num_layers\]"),
    (dict(train=dict(batch_size=8, micro_batch_size=3)),
     r"train.batch_size \(8\) must be a multiple of train.micro_batch_size \(3\)"),
    (dict(moe=dict(gemm="cublas")), "moe.gemm must be one of"),
    (dict(precision=dict(compute="float16")), "precision.compute must be one of"),
    (dict(train=dict(warmup_steps=8)), r"train.warmup_steps \(8\) must be in"),
    (dict(model=dict(extra=1)), r"unknown config key\(s\) \['model.extra'\]"),
    (dict(moe=dict(router=dict(num_groups=3))), r"moe.router.num_groups \(3\) must divide"),
    (dict(moe=dict(router=dict(num_groups=8))), "leaves 1 expert per group"),
    (dict(moe=dict(router=dict(num_groups=4, topk_groups=5))), r"topk_groups \(5\) must be in"),
    (dict(moe=dict(top_k=5, router=dict(num_groups=4, topk_groups=2))),
     r"moe.top_k \(5\) is more than the 2 x 2 experts"),
    (dict(moe=dict(balance=dict(aux_loss_type="batch"))), "aux_loss_type must be one of"),
    (dict(moe=dict(capacity_factor=-1.0)), r"capacity_factor must be None or in \[0, inf\)"),
    (dict(moe=dict(drop_policy="random")), "moe.drop_policy must be one of"),
    (dict(moe=dict(router=dict(score="relu"))), "moe.router.score must be one of"),
    (dict(parallel=dict(dense=dict(data=-1, tensor=-1))), "at most one size may be -1"),
    (dict(model=dict(d_model="wide")), "'model.d_model' must be a int"),
])
def test_bad_configs_name_the_key(overrides, message):
  with pytest.raises(ConfigError, match=message):
    tiny_config(**overrides)


def test_all_problems_reported_together():
  with pytest.raises(ConfigError) as info:
    tiny_config(moe=dict(top_k=9), model=dict(head_dim=7))
  assert "top_k" in str(info.value) and "head_dim" in str(info.value)


def test_missing_config_file():
  with pytest.raises(ConfigError, match="does not exist"):
    load_config("configs/nope.py")


def test_override_keys_the_file_leaves_at_default():
  config = load_config(TINY_FILE, ["--config.moe.router.jitter=0.1",
                                   "--config.moe.capacity_factor=1.25",
                                   "--config.moe.balance.aux_loss_type=seq"])
  assert config.moe.router.jitter == 0.1 and config.moe.capacity_factor == 1.25
  assert config.moe.balance.aux_loss_type == "seq"
  assert load_config(TINY_FILE, ["--config.moe.capacity_factor=None"]).moe.capacity_factor is None


def test_registry_names_are_what_validation_accepts():
  """Validation reads the registries themselves: every registered name passes, others fail."""
  from jmoe.ops.grouped_gemm import GEMM_BACKENDS
  from jmoe.ops.remat import REMAT_POLICIES
  for name in REMAT_POLICIES:
    tiny_config(train=dict(remat=name))
  for name in GEMM_BACKENDS:
    tiny_config(moe=dict(gemm=name))
  with pytest.raises(ConfigError, match="train.remat must be one of"):
    tiny_config(train=dict(remat="some"))


def test_dispatcher_and_family_are_checked_against_their_registries(tmp_path):
  """Their registries sit above jmoe.config: the MoE layer checks `moe.dispatcher` as it is
  built, the trainer `model.family` before it builds anything."""
  from jmoe.model.factory import model_factory
  from jmoe.moe import DISPATCHERS
  from jmoe.train.loop import train
  for name in DISPATCHERS:
    model_factory(tiny_config(moe=dict(dispatcher=name)))()
  with pytest.raises(ConfigError, match=r"moe.dispatcher must be one of \['allgather', "):
    model_factory(tiny_config(moe=dict(dispatcher="ring")))()
  with pytest.raises(ConfigError, match="model.family must be one of"):
    train(tiny_config(model=dict(family="llama")), tmp_path / "run", progress=False)


def test_pipeline_layers_parse_as_a_list_and_survive_config_json():
  """`--config.parallel.pipeline_layers=[1,2]` or `=1,2`; config.json's list reads back the same."""
  import json
  from jmoe.config import from_config_dict, to_dict
  for value in ("[1,2]", "1,2", "(1, 2)"):
    config = load_config(TINY_FILE, ["--config.parallel.pipeline=2",
                                     f"--config.parallel.pipeline_layers={value}"])
    assert config.parallel.pipeline_layers == (1, 2)
    assert config.parallel.layer_groups(3) == (1, 2)
  assert from_config_dict(json.loads(json.dumps(to_dict(config)))) == config


@pytest.mark.parametrize("parallel, layers, groups", [
    (dict(pipeline=2), 3, (2, 1)),
    (dict(pipeline=4, pipeline_repeats=2), 58, (8, 8, 7, 7, 7, 7, 7, 7)),
    (dict(pipeline=16, pipeline_first=2, pipeline_last=2), 58,
     (2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 3, 3, 2)),
    (dict(pipeline=4, pipeline_last=1), 58, (19, 19, 19, 1)),
])
def test_layer_groups_as_even_as_the_counts_allow(parallel, layers, groups):
  from jmoe.config import ParallelConfig
  assert ParallelConfig(**parallel).layer_groups(layers) == groups
