"""Hugging Face interop, against transformers itself (run under .venv-hf: scripts/hf_reference_env.sh).

For each family: a tiny random-weight model built by transformers' own config class and saved with
save_pretrained; jmoe imports it and its log-probs equal transformers' (float32) to 1e-4; export
gives back every tensor exactly; a model trained by jmoe exports and loads in transformers with the
same log-probs.
"""

import json
import logging
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
from flax import nnx
import pytest
from safetensors import safe_open

from flags import xla_flags
from jmoe.hf.convert import export_hf, import_hf
from jmoe.hf.files import SafetensorsReader
from jmoe.hf.families import check_exportable
from jmoe.checkpoint.params import load_model
from jmoe.config import ConfigError, ParallelConfig, load_config
from jmoe.parallel import make_layout
from jmoe.inference.score import score
from jmoe.train.loop import train
from helpers import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
HF_PYTHON = ROOT / ".venv-hf" / "bin" / "python"
pytestmark = pytest.mark.skipif(not HF_PYTHON.exists(),
                                reason="no reference Python: run scripts/hf_reference_env.sh")

ROPE = lambda theta: {"rope_type": "default", "rope_theta": theta}


def preset_hf_kwargs(name: str) -> dict:
  """transformers config kwargs for a config file in configs/, as export-hf writes them."""
  config = load_config(ROOT / "configs" / name)
  hf = check_exportable(config.model, config.moe).to_hf(config.model, config.moe)
  return {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}


FAMILIES = {  # name: (family, transformers config kwargs, max_shard_size)
    "qwen3_moe": ("qwen3_moe", dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0],
        rope_parameters=ROPE(1000.0), rms_norm_eps=1e-6), "30KB"),
    "qwen3_moe_tied_top1_odd_heads": ("qwen3_moe", dict(
        vocab_size=70, hidden_size=20, intermediate_size=24, moe_intermediate_size=12,
        num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1, head_dim=6,
        num_experts=6, num_experts_per_tok=1, norm_topk_prob=False, tie_word_embeddings=True,
        rope_parameters=ROPE(10000.0), rms_norm_eps=1e-5), None),
    "deepseek_v3_yarn_interleaved": ("deepseek_v3", dict(
        vocab_size=90, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1, n_group=4,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=16,
        kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        rope_interleave=True, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 8, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}), "40KB"),
    "deepseek_v3_plain_q": ("deepseek_v3", dict(
        vocab_size=64, hidden_size=24, intermediate_size=30, moe_intermediate_size=10,
        num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3, n_routed_experts=6,
        n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=0, n_group=1,
        topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, q_lora_rank=None,
        kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=6, v_head_dim=8,
        rope_interleave=False, rms_norm_eps=1e-6, rope_parameters=ROPE(5000.0)), None),
    "gpt_oss_alternating_yarn": ("gpt_oss", dict(
        vocab_size=72, hidden_size=24, intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, head_dim=4, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "original_max_position_embeddings": 8, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False}, rms_norm_eps=1e-5), "20KB"),
    "gpt_oss_full_top1": ("gpt_oss", dict(
        vocab_size=50, hidden_size=16, intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_local_experts=4,
        num_experts_per_tok=1, layer_types=["full_attention", "full_attention"],
        rope_parameters=ROPE(10000.0), rms_norm_eps=1e-5), None),
    # Kimi K2 at CPU size: no expert groups, routed scaling 2.827, YaRN with beta_fast 1
    "kimi_k2_tiny": ("deepseek_v3", preset_hf_kwargs("tiny_kimi_k2.py"), "1MB"),
    "mixtral_window": ("mixtral", dict(
        vocab_size=80, hidden_size=24, intermediate_size=20, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, head_dim=4, num_local_experts=6,
        num_experts_per_tok=2, sliding_window=5, rope_parameters=ROPE(5000.0)), None),
}


def hf(*args):
  subprocess.run([str(HF_PYTHON), str(ROOT / "tests" / "hf_reference.py"), *map(str, args)],
                 check=True, capture_output=True, timeout=300)


def random_sequences(vocab, seed=0, lengths=(12, 7, 16)):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def hf_logprobs(model_dir, sequences, tmp):
  tokens, out = tmp / "tokens.json", tmp / "logprobs.json"
  tokens.write_text(json.dumps(sequences))
  hf("logprobs", model_dir, tokens, out)
  return json.loads(out.read_text())


def jmoe_logprobs(checkpoint, sequences):
  layout = make_layout(ParallelConfig())
  _, model = load_model(checkpoint, layout)
  return score(model, layout, sequences)


def max_diff(a, b):
  return max(float(np.max(np.abs(np.subtract(x, y)))) for x, y in zip(a, b))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_import_matches_transformers_and_export_round_trips(name, tmp_path):
  family, kwargs, shard = FAMILIES[name]
  hf_dir = tmp_path / "hf"
  hf("build", family, hf_dir, 0, json.dumps(kwargs), *([shard] if shard else []))
  if shard:
    assert (hf_dir / "model.safetensors.index.json").is_file()  # the sharded layout is covered
  sequences = random_sequences(kwargs["vocab_size"])
  reference = hf_logprobs(hf_dir, sequences, tmp_path)

  config = import_hf(hf_dir, tmp_path / "ckpt")
  assert config.model.family == family
  ours = jmoe_logprobs(tmp_path / "ckpt", sequences)
  assert [len(x) for x in ours] == [len(s) - 1 for s in sequences]
  assert max_diff(ours, reference) < 1e-4, max_diff(ours, reference)

  export_hf(tmp_path / "ckpt", tmp_path / "back", shard_bytes=20_000,
            rope_interleave=kwargs.get("rope_interleave"))
  original, exported = SafetensorsReader(hf_dir), SafetensorsReader(tmp_path / "back")
  assert set(exported.weight_map) == set(original.weight_map)
  for key in original.weight_map:
    np.testing.assert_array_equal(exported(key), original(key), err_msg=key)


TRAINED = {
    "qwen3_moe": dict(model=dict(family="qwen3_moe", qk_norm=True, num_heads=4, num_kv_heads=2)),
    "deepseek_v3": dict(
        model=dict(family="deepseek_v3", attention="mla", num_heads=4, num_kv_heads=2, mtp_depth=1,
                   mla=dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                            qk_rope_head_dim=4, v_head_dim=8),
                   yarn=dict(factor=4.0, original_max_len=8, mscale_all_dim=1.0)),
        moe=dict(num_shared_experts=1, router=dict(score="sigmoid", num_groups=4, topk_groups=2,
                                                   scaling_factor=2.5),
                 balance=dict(bias_update_rate=0.01))),
    "gpt_oss": dict(
        model=dict(family="gpt_oss", sliding_window=6, full_attention_every=2,
                   attention_bias=True, attention_sinks=True, num_heads=4, num_kv_heads=2),
        moe=dict(first_k_dense=0, expert_bias=True, activation="clamped_swiglu",
                 router=dict(score="softmax_topk", bias=True))),
}


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_a_jmoe_trained_model_exports_to_transformers(name, tmp_path):
  """Trained by jmoe (DeepSeek-V3 in 2 pipeline stages of 2 micro-batches, saved as any run is):
  the export scores in transformers as the run's model does."""
  pipelined = name == "deepseek_v3"
  config = tiny_config(**TRAINED[name], **({"parallel": dict(pipeline=2)} if pipelined else {}),
                       train=dict(steps=5, warmup_steps=1, **({"micro_batch_size": 4}
                                                              if pipelined else {})))
  train(config, tmp_path / "run", progress=False)
  export_hf(tmp_path / "run", tmp_path / "hf")
  sequences = random_sequences(config.model.vocab_size, seed=1)
  reference = hf_logprobs(tmp_path / "hf", sequences, tmp_path)
  ours = jmoe_logprobs(tmp_path / "run", sequences)
  assert max_diff(ours, reference) < 1e-4, max_diff(ours, reference)


def test_conversion_errors_name_the_problem(tmp_path):
  with pytest.raises(ConfigError, match="config.json does not exist"):
    import_hf(tmp_path, tmp_path / "out")
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                    "architectures": ["LlamaForCausalLM"]}))
  with pytest.raises(ConfigError, match=r"unsupported architecture \['LlamaForCausalLM'\]"):
    import_hf(tmp_path, tmp_path / "out")
  family, kwargs, _ = FAMILIES["mixtral_window"]
  hf("build", family, tmp_path / "m", 0, json.dumps(kwargs))
  from safetensors.numpy import save_file
  with safe_open(tmp_path / "m" / "model.safetensors", "np") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys() if "experts.3.w2" not in k}
  save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ConfigError, match=r"tensor 'model.layers.0.block_sparse_moe.experts.3"
                                        r".w2.weight' is missing"):
    import_hf(tmp_path / "m", tmp_path / "out")
  plain = tiny_config()
  with pytest.raises(ConfigError, match="set it to one of"):
    check_exportable(plain.model, plain.moe)
  mixtral_with_qk_norm = tiny_config(model=dict(family="mixtral", qk_norm=True),
                                     moe=dict(first_k_dense=0))
  with pytest.raises(ConfigError, match="model.family=mixtral needs model.qk_norm=False"):
    check_exportable(mixtral_with_qk_norm.model, mixtral_with_qk_norm.moe)


def test_convert_and_score_commands(tmp_path):
  family, kwargs, _ = FAMILIES["mixtral_window"]
  hf("build", family, tmp_path / "hf", 3, json.dumps(kwargs))
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(2),
         "PATH": "/usr/bin:/bin"}
  run = lambda *args: subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                                     cwd=ROOT, env=env, timeout=300)
  result = run("jmoe.convert", "import-hf", "--hf-dir", tmp_path / "hf", "--out", tmp_path / "ck")
  assert result.returncode == 0, result.stderr
  sequences = random_sequences(kwargs["vocab_size"], seed=2)
  (tmp_path / "tokens.txt").write_text("\n".join(" ".join(map(str, s)) for s in sequences) + "\n")
  result = run("jmoe.score", "--checkpoint", tmp_path / "ck", "--tokens-file",
               tmp_path / "tokens.txt", "--out", tmp_path / "scores.json")
  assert result.returncode == 0, result.stderr
  scores = json.loads((tmp_path / "scores.json").read_text())
  assert [s["tokens"] for s in scores] == sequences
  reference = hf_logprobs(tmp_path / "hf", sequences, tmp_path)
  assert max_diff([s["logprobs"] for s in scores], reference) < 1e-4
  result = run("jmoe.convert", "export-hf", "--checkpoint", tmp_path / "ck", "--out",
               tmp_path / "out", "--dtype", "bfloat16")
  assert result.returncode == 0, result.stderr
  assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"

  (tmp_path / "bad.txt").write_text("1 2 300\n")
  result = run("jmoe.score", "--checkpoint", tmp_path / "ck", "--tokens-file", tmp_path / "bad.txt")
  assert result.returncode == 2 and "token id 300 is outside the model's vocabulary" in result.stderr


def test_deepseek_prediction_modules_convert_both_ways(tmp_path):
  """DeepSeek-V3's multi-token prediction module is layer num_layers of its checkpoints: export
  writes it (with the copies of the embedding and head it shares), import reads it back into
  `model.mtp_depth` exactly; transformers, which has no such module, still loads the model."""
  config = tiny_config(**TRAINED["deepseek_v3"], train=dict(steps=2, warmup_steps=1))
  train(config, tmp_path / "run", progress=False)
  export_hf(tmp_path / "run", tmp_path / "hf")
  exported = SafetensorsReader(tmp_path / "hf")
  mtp = f"model.layers.{config.model.num_layers}."
  for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
               "shared_head.head.weight", "embed_tokens.weight", "self_attn.kv_b_proj.weight",
               "mlp.experts.3.down_proj.weight", "mlp.gate.e_score_correction_bias"):
    assert mtp + name in exported.weight_map, name
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
  imported = import_hf(tmp_path / "hf", tmp_path / "ckpt")
  assert imported.model.mtp_depth == 1
  layout = make_layout(ParallelConfig())
  _, trained = load_model(tmp_path / "run", layout)
  _, back = load_model(tmp_path / "ckpt", layout)
  ours, theirs = nnx.to_flat_state(nnx.state(trained)), dict(nnx.to_flat_state(nnx.state(back)))
  assert any(path[0] == "mtp" for path, _ in ours)
  for path, variable in ours:
    np.testing.assert_array_equal(np.asarray(theirs[path][...]), np.asarray(variable[...]),
                                  err_msg=".".join(map(str, path)))
  sequences = random_sequences(config.model.vocab_size, seed=2)
  reference = hf_logprobs(tmp_path / "hf", sequences, tmp_path)
  assert max_diff(jmoe_logprobs(tmp_path / "ckpt", sequences), reference) < 1e-4
  # A checkpoint whose prediction module has an embedding of its own cannot be held.
  data = {k: exported(k) for k in exported.weight_map}
  data[mtp + "embed_tokens.weight"] = data[mtp + "embed_tokens.weight"] + 1
  from safetensors.numpy import save_file
  (tmp_path / "own").mkdir()
  save_file(data, str(tmp_path / "own" / "model.safetensors"))
  (tmp_path / "own" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
  with pytest.raises(ConfigError, match="differs from the model's own embedding"):
    import_hf(tmp_path / "own", tmp_path / "own_ckpt")


def test_gpt_oss_mxfp4_experts_dequantize_on_import_as_transformers_does(tmp_path):
  kwargs = dict(FAMILIES["gpt_oss_full_top1"][1], hidden_size=32, intermediate_size=32)
  hf("build", "gpt_oss", tmp_path / "hf", 0, json.dumps(kwargs))
  hf("mxfp4", tmp_path / "hf", tmp_path / "mx", 1)
  assert "gate_up_proj_blocks" in " ".join(SafetensorsReader(tmp_path / "mx" / "quantized")
                                          .weight_map)
  # The quantized one read an expert at a time (its blocks and scales sliced), the other whole.
  quantized = import_hf(tmp_path / "mx" / "quantized", tmp_path / "q", part_bytes=1)
  import_hf(tmp_path / "mx" / "dequantized", tmp_path / "d")
  layout = make_layout(ParallelConfig())
  pure = [jax.device_get(nnx.to_pure_dict(nnx.state(load_model(tmp_path / name, layout)[1])))
          for name in ("q", "d")]
  jax.tree.map(np.testing.assert_array_equal, *pure)  # exactly transformers' dequantization
  assert quantized.model.family == "gpt_oss"
  sequences = random_sequences(kwargs["vocab_size"])
  reference = hf_logprobs(tmp_path / "mx" / "dequantized", sequences, tmp_path)
  assert max_diff(jmoe_logprobs(tmp_path / "q", sequences), reference) < 1e-4


KIMI_AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}


def kimi_config_json(kwargs: dict) -> dict:
  """The config.json Kimi K2's checkpoints have (moonshotai/Kimi-K2-Instruct) for the model that
  DeepseekV3Config(**kwargs) describes: model_type kimi_k2 with the remote code's auto_map, the
  original DeepSeek code's fields (rope_scaling with a "type" and rope_theta beside it, the
  router's scoring and top-k method, its training settings), no rope_interleave or head_dim."""
  hf = {k: v for k, v in kwargs.items() if k not in ("rope_parameters", "rope_interleave",
                                                      "head_dim")}
  rope = dict(kwargs["rope_parameters"])
  assert rope.pop("rope_type") == "yarn" and rope.pop("truncate")  # Kimi's YaRN truncates
  return dict(hf, architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2",
              auto_map=KIMI_AUTO_MAP, rope_theta=rope.pop("rope_theta"),
              rope_scaling=dict(rope, type="yarn"), scoring_func="sigmoid",
              topk_method="noaux_tc", moe_layer_freq=1, num_nextn_predict_layers=0,
              aux_loss_alpha=0.001, seq_aux=True, pretraining_tp=1, attention_dropout=0.0,
              bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16",
              transformers_version="4.48.3", use_cache=True)


def test_a_kimi_k2_config_json_imports_as_deepseek_v3(tmp_path, caplog):
  """Kimi K2's checkpoints hold DeepSeek-V3's tensors under a config.json of model_type kimi_k2,
  which transformers has no class for: import reads it as DeepSeek-V3 with every field known, and
  the model scores as transformers' DeepseekV3ForCausalLM does; export writes DeepSeek-V3, which
  transformers runs without remote code. The released weights' FP8 quantization_config is
  refused by name."""
  _, kwargs, _ = FAMILIES["kimi_k2_tiny"]
  hf("build", "deepseek_v3", tmp_path / "hf", 1, json.dumps(kwargs))
  sequences = random_sequences(kwargs["vocab_size"], seed=2)
  reference = hf_logprobs(tmp_path / "hf", sequences, tmp_path)
  kimi = tmp_path / "kimi"
  shutil.copytree(tmp_path / "hf", kimi)
  (kimi / "config.json").write_text(json.dumps(kimi_config_json(kwargs)))

  with caplog.at_level(logging.INFO, logger="jmoe"):
    config = import_hf(kimi, tmp_path / "ckpt")
  assert "model_type kimi_k2 is read as deepseek_v3" in caplog.text
  assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  preset = load_config(ROOT / "configs" / "tiny_kimi_k2.py")
  assert (config.model.family, config.model.mtp_depth) == ("deepseek_v3", 0)
  assert (config.model.mla, config.model.yarn, config.model.rope_theta, config.moe.router) == (
      preset.model.mla, preset.model.yarn, preset.model.rope_theta, preset.moe.router)
  assert max_diff(jmoe_logprobs(tmp_path / "ckpt", sequences), reference) < 1e-4

  export_hf(tmp_path / "ckpt", tmp_path / "back")
  assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "deepseek_v3"
  assert max_diff(hf_logprobs(tmp_path / "back", sequences, tmp_path), reference) < 1e-4

  released = dict(kimi_config_json(kwargs), quantization_config={
      "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
      "weight_block_size": [128, 128]})
  (kimi / "config.json").write_text(json.dumps(released))
  with pytest.raises(ConfigError, match=r"quantization_config \(quant_method 'fp8'\) is not "
                                        r"supported: .*convert a dequantized copy"):
    import_hf(kimi, tmp_path / "fp8")
  assert not (tmp_path / "fp8").exists()
