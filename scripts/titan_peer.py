"""The second PyTorch peer: torchtitan's own MoE model of the same config, trained as torchtitan's
trainer trains it on one GPU.

  python scripts/titan_peer.py --config configs/bench/qwen3_30b_a3b_1gpu.py
      [--balanced] [--attention auto|sdpa|flex] [--no-compile] [--steps 5] [--warmup 2] [--settle S]
      [--config.group.key=value ...]

Builds torchtitan's model of the config's family (`model.family`: qwen3_moe -> its Qwen3 with MoE
layers, deepseek_v3 -> DeepSeek-V3, gpt_oss -> GPT-OSS; torchtitan has no Mixtral) at the config's
shapes (`titan_args` holds the mapping), counts its parameters against jmoe's model of the same
config and refuses to time it when they differ by more than 0.1%, then times full steps on random
tokens with what torchtitan's trainer runs on one GPU: its per-block torch.compile (`apply_compile`:
dense blocks whole, MoE blocks submodule by submodule, the experts' torch._grouped_mm function on
its own; `--no-compile`: eager), its compiled summed cross-entropy over the valid-token count, its
gradient-norm clipping (train.grad_clip), PyTorch's fused AdamW. Parameters and AdamW moments are
bf16, as hf_peer.py has them; attention is what torchtitan's own model flavours of the family use
(sdpa for Qwen3, flex attention for DeepSeek-V3 and GPT-OSS; `--attention` picks another the family
has); routing is real, or with `--balanced` torchtitan's forced balance (its router's round-robin
`_debug_force_load_balance`: token t takes experts (t*k + j) mod E, as moe.router.force_balanced).
Prints one JSON line with hf_peer.py's fields and jmoe's FLOP count (jmoe.train.flops), so that
the ratio compares the same work, and both parameter counts.

Not run: torchtitan's update of the aux-loss-free expert bias between steps (the bias is there and
stays zero) and its learning-rate schedule; jmoe's balancing losses have no torchtitan counterpart.

Which torchtitan: 0.2.2, the newest whose model code runs on the GPU image's torch 2.11. 0.3.0 was
written for torch 2.14: its DeepSeek-V3 model module (mtp.py) and every family's package (through
its FSDP helpers) import torch.distributed.fsdp.DataParallelMeshDims, which torch 2.11 lacks.
torchtitan's packages import its whole trainer (data loaders, TensorBoard, tokenizers); this
script loads only the model code (`import_torchtitan`). What the image lacks, as pure-Python wheels
to carry (`../shared/device/wheels.sh` names them; 0.7 MB in all):
  torchtitan==0.2.2 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
(tyro because torchtitan's config module imports it; torch, triton and typing-extensions come
with the image.)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import pathlib
import sys
import types

TORCHTITAN = "0.2.2"  # the version whose model arguments `titan_args` writes
MODELS = {"qwen3_moe": "Qwen3Model", "deepseek_v3": "DeepSeekV3Model", "gpt_oss": "GptOssModel"}
MISSING = {"mixtral": "torchtitan has no Mixtral model (its MoE models: Qwen3, DeepSeek-V3, "
                      "GPT-OSS, Llama 4)"}
# What the family's own model flavours in torchtitan run, and what else each supports
ATTENTION = {"Qwen3Model": ("sdpa", "flex"), "DeepSeekV3Model": ("flex", "sdpa"),
             "GptOssModel": ("flex",)}
PARAM_TOLERANCE = 1e-3


def refuse_unless(family: str, checks: list[tuple[str, object, object]]) -> None:
  """A ConfigError for the first (field, value, what torchtitan's model runs) that differs."""
  from jmoe.errors import ConfigError
  for field, value, wanted in checks:
    if value != wanted:
      raise ConfigError(f"{field}={value!r}: torchtitan's {family} model runs {field}={wanted!r} "
                        f"only; set --config.{field}={wanted} to time this peer")


def moe_args(config, balanced: bool) -> dict:
  """torchtitan's MoEArgs for the config's MoE layers (router, experts, shared experts)."""
  moe, router = config.moe, config.moe.router
  return {"num_experts": moe.num_experts, "num_shared_experts": moe.num_shared_experts,
          "top_k": moe.top_k,
          # softmax over the k chosen logits is the softmax renormalised over the chosen k
          "score_func": "sigmoid" if router.score == "sigmoid" else "softmax",
          "route_norm": router.norm_topk_prob or router.score == "softmax_topk",
          "route_scale": router.scaling_factor, "gate_bias": router.bias,
          "num_expert_groups": router.num_groups if router.num_groups > 1 else None,
          "num_limited_groups": router.topk_groups if router.num_groups > 1 else None,
          "score_before_experts": False,  # as torchtitan's flavours: weights after the experts
          "use_grouped_mm": True,
          "load_balance_coeff": config.moe.balance.bias_update_rate or None,
          "_debug_force_load_balance": balanced}


def common_checks(config) -> list:
  m, moe = config.model, config.moe
  return [("model.mtp_depth", m.mtp_depth, 0), ("moe.capacity_factor", moe.capacity_factor or 0, 0),
          ("moe.router.jitter", moe.router.jitter, 0.0), ("lora.rank", config.lora.rank, 0),
          ("precision.gemm", config.precision.gemm, "bf16")]


def qwen3_args(config) -> dict:
  m, moe = config.model, config.moe
  refuse_unless("Qwen3", common_checks(config) + [
      ("model.attention", m.attention, "gqa"), ("model.attention_bias", m.attention_bias, False),
      ("model.attention_sinks", m.attention_sinks, False),
      ("model.sliding_window", m.sliding_window, 0), ("model.yarn.factor", m.yarn.factor, 1.0),
      ("moe.first_k_dense", moe.first_k_dense, 0),  # its MoE variant has experts in every layer
      ("moe.router.bias", moe.router.bias, False), ("moe.expert_bias", moe.expert_bias, False),
      ("moe.activation", moe.activation, "swiglu")])
  return {"dim": m.d_model, "n_layers": m.num_layers, "n_heads": m.num_heads,
          "n_kv_heads": m.num_kv_heads, "head_dim": m.head_dim, "vocab_size": m.vocab_size,
          "hidden_dim": m.d_ff, "norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
          "qk_norm": m.qk_norm, "enable_weight_tying": m.tie_embeddings,
          "moe_enabled": True, "moe_inter_dim": moe.d_ff_expert}


def deepseek_v3_args(config) -> dict:
  m, moe = config.model, config.moe
  refuse_unless("DeepSeek-V3", common_checks(config) + [
      ("model.attention", m.attention, "mla"), ("model.qk_norm", m.qk_norm, False),
      ("model.attention_bias", m.attention_bias, False),
      ("model.attention_sinks", m.attention_sinks, False),
      ("model.sliding_window", m.sliding_window, 0),
      ("model.tie_embeddings", m.tie_embeddings, False),
      ("moe.router.bias", moe.router.bias, False), ("moe.expert_bias", moe.expert_bias, False),
      ("moe.activation", moe.activation, "swiglu")])
  return {"dim": m.d_model, "n_layers": m.num_layers, "n_dense_layers": moe.first_k_dense,
          "n_heads": m.num_heads, "vocab_size": m.vocab_size, "inter_dim": m.d_ff,
          "moe_inter_dim": moe.d_ff_expert, "norm_eps": m.norm_eps,
          "q_lora_rank": m.mla.q_lora_rank, "kv_lora_rank": m.mla.kv_lora_rank,
          "qk_nope_head_dim": m.mla.qk_nope_head_dim, "qk_rope_head_dim": m.mla.qk_rope_head_dim,
          "v_head_dim": m.mla.v_head_dim, "rope_theta": m.rope_theta,
          "rope_factor": m.yarn.factor, "original_seq_len": m.yarn.original_max_len,
          "beta_fast": m.yarn.beta_fast, "beta_slow": m.yarn.beta_slow,
          # its mscale scales the softmax as transformers' mscale_all_dim (0 and 1 alike: none)
          "mscale": m.yarn.mscale_all_dim}


def gpt_oss_args(config) -> dict:
  m, moe = config.model, config.moe
  refuse_unless("GPT-OSS", common_checks(config) + [
      ("model.attention", m.attention, "gqa"), ("model.qk_norm", m.qk_norm, False),
      ("model.attention_bias", m.attention_bias, True),
      ("model.attention_sinks", m.attention_sinks, True),
      # its windowed layers are the even ones, as jmoe's with full attention every second layer
      ("model.full_attention_every", m.full_attention_every, 2),
      ("model.tie_embeddings", m.tie_embeddings, False),
      ("moe.first_k_dense", moe.first_k_dense, 0),
      ("moe.num_shared_experts", moe.num_shared_experts, 0),
      ("moe.router.bias", moe.router.bias, True), ("moe.expert_bias", moe.expert_bias, True),
      ("moe.activation", moe.activation, "clamped_swiglu"),
      ("moe.swiglu_alpha", moe.swiglu_alpha, 1.702)])
  if not m.sliding_window:
    refuse_unless("GPT-OSS", [("model.sliding_window", m.sliding_window, 128)])
  return {"dim": m.d_model, "n_layers": m.num_layers, "n_heads": m.num_heads,
          "n_kv_heads": m.num_kv_heads, "head_dim": m.head_dim, "vocab_size": m.vocab_size,
          "moe_inter_dim": moe.d_ff_expert, "norm_eps": m.norm_eps,
          "swiglu_limit": moe.swiglu_limit, "sliding_window_size": m.sliding_window,
          "rope_theta": m.rope_theta, "rope_factor": m.yarn.factor,
          "original_seq_len": m.yarn.original_max_len,
          "ntk_alpha": m.yarn.beta_slow, "ntk_beta": m.yarn.beta_fast}


ARGS = {"Qwen3Model": qwen3_args, "DeepSeekV3Model": deepseek_v3_args,
        "GptOssModel": gpt_oss_args}


def titan_args(config, attention: str = "auto", balanced: bool = False) -> dict:
  """The torchtitan model that runs jmoe's `config`: its class name, its ModelArgs and MoEArgs
  keyword arguments, or a ConfigError naming the field that torchtitan's model cannot follow."""
  from jmoe.errors import ConfigError, not_one_of
  family = config.model.family
  if family in MISSING:
    raise ConfigError(f"model.family={family!r}: {MISSING[family]}; this peer times "
                      f"{sorted(MODELS)}")
  if family not in MODELS:
    raise ConfigError(not_one_of("model.family (for the torchtitan peer)", family, MODELS))
  model = MODELS[family]
  kinds = ATTENTION[model]
  attention = kinds[0] if attention == "auto" else attention
  if attention not in kinds:
    raise ConfigError(f"--attention {attention}: torchtitan's {model} runs {list(kinds)}")
  args = dict(ARGS[model](config), max_seq_len=config.data.seq_len, attn_type=attention,
              attn_mask_type="causal")  # one document per row, as benchmark.py's batches
  return {"model": model, "args": args, "moe_args": moe_args(config, balanced)}


def jmoe_params(config) -> int:
  """Parameters of jmoe's model of `config` (shapes only: nothing is allocated)."""
  import jax
  from flax import nnx
  from jmoe.model.factory import model_factory
  state = nnx.state(nnx.eval_shape(model_factory(config)), nnx.Param)
  return sum(x.size for x in jax.tree.leaves(state))


def check_params(titan: int, jmoe: int) -> None:
  from jmoe.errors import ConfigError
  if abs(titan - jmoe) > PARAM_TOLERANCE * jmoe:
    raise ConfigError(f"torchtitan's model has {titan:,} parameters, jmoe's {jmoe:,} "
                      f"({titan - jmoe:+,}): not the same model, so not timed")


# ---- torchtitan's model code, without its trainer ----------------------------------------------

# Packages whose __init__ imports torchtitan's trainer (train specs: data loaders, metrics with
# TensorBoard, tokenizers, validators); their modules are loaded without it.
TRAINER_PACKAGES = ("torchtitan", "torchtitan.models.llama3", "torchtitan.models.llama4",
                    "torchtitan.models.qwen3", "torchtitan.models.deepseek_v3",
                    "torchtitan.models.gpt_oss")


def import_torchtitan() -> types.SimpleNamespace:
  """torchtitan's model classes and the trainer's pieces a step uses, imported without the rest
  of its trainer."""
  from importlib.metadata import version
  from jmoe.errors import ConfigError
  spec = importlib.util.find_spec("torchtitan")
  if spec is None:
    raise ConfigError(f"torchtitan is not installed: carry torchtitan=={TORCHTITAN} and its "
                      f"wheels (this script's docstring lists them)")
  found = version("torchtitan")
  if found != TORCHTITAN:
    raise ConfigError(f"torchtitan {found} is installed; this peer maps configs onto "
                      f"torchtitan {TORCHTITAN}'s model arguments")
  root = pathlib.Path(spec.submodule_search_locations[0]).parent
  for name in TRAINER_PACKAGES:
    if name not in sys.modules:
      package = types.ModuleType(name)
      package.__path__ = [str(root.joinpath(*name.split(".")))]
      sys.modules[name] = package
  # Model files import the model protocol through train_spec, which imports the trainer's parts.
  protocol = importlib.import_module("torchtitan.protocols.model")
  train_spec = types.ModuleType("torchtitan.protocols.train_spec")
  train_spec.BaseModelArgs = protocol.BaseModelArgs
  train_spec.ModelProtocol = protocol.ModelProtocol
  sys.modules.setdefault(train_spec.__name__, train_spec)
  get = importlib.import_module
  return types.SimpleNamespace(
      version=found, MoEArgs=get("torchtitan.models.moe").MoEArgs,
      Qwen3Model=get("torchtitan.models.qwen3.model.model").Qwen3Model,
      Qwen3ModelArgs=get("torchtitan.models.qwen3.model.args").Qwen3ModelArgs,
      DeepSeekV3Model=get("torchtitan.models.deepseek_v3.model.model").DeepSeekV3Model,
      DeepSeekV3ModelArgs=get("torchtitan.models.deepseek_v3.model.args").DeepSeekV3ModelArgs,
      GptOssModel=get("torchtitan.models.gpt_oss.model.model").GptOssModel,
      GptOssModelArgs=get("torchtitan.models.gpt_oss.model.args").GptOssModelArgs,
      JobConfig=get("torchtitan.config").JobConfig,
      apply_compile=get("torchtitan.models.llama4.infra.parallelize").apply_compile,
      build_loss=get("torchtitan.components.loss").build_cross_entropy_loss,
      clip_grad_norm_=get("torchtitan.distributed.utils").clip_grad_norm_)


def build_model(titan, spec: dict):
  """torchtitan's model of `spec` (from `titan_args`) on the meta device: shapes, no memory."""
  import torch
  args = getattr(titan, spec["model"] + "Args")(**spec["args"],
                                               moe_args=titan.MoEArgs(**spec["moe_args"]))
  args.moe_impl = "standard"  # what the trainer sets from its parallelism config (no DeepEP)
  with torch.device("meta"):
    return getattr(titan, spec["model"])(args)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--attention", default="auto",
                      help="auto: what torchtitan's flavours of the family run")
  parser.add_argument("--balanced", action="store_true",
                      help="torchtitan's forced balance: every expert the same load")
  parser.add_argument("--no-compile", action="store_true", help="eager blocks and loss")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=2)
  from gpu_clocks import add_settle_flag  # (this script's folder is on sys.path)
  add_settle_flag(parser)
  from jmoe.cli import run, split_overrides
  rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(rest)
  # jmoe only counts here (parameters, FLOPs): JAX stays off the GPU that torch times
  os.environ["JAX_PLATFORMS"] = "cpu"
  return run(lambda: peer(args, overrides))


def peer(args: argparse.Namespace, overrides: list[str]) -> int:
  from jmoe.config import load_config
  config = load_config(args.config, overrides)
  spec = titan_args(config, args.attention, args.balanced)
  titan = import_torchtitan()
  import torch
  model = build_model(titan, spec)
  params, jmoe = sum(p.numel() for p in model.parameters()), jmoe_params(config)
  print(f"parameters: torchtitan {params:,}, jmoe {jmoe:,}", file=sys.stderr)
  check_params(params, jmoe)

  torch.manual_seed(config.train.seed)
  model.to(torch.bfloat16).to_empty(device="cuda")
  with torch.no_grad():
    model.init_weights(buffer_device=torch.device("cuda"))  # fp32 buffers (rope, expert bias)
  model.train()
  job = titan.JobConfig()
  job.compile.enable = not args.no_compile
  if job.compile.enable:
    titan.apply_compile(model, job.compile, ep_enabled=False)
  loss_fn = titan.build_loss(job)
  train = config.train
  optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=(train.b1, train.b2),
                                eps=train.eps, weight_decay=train.weight_decay, fused=True)
  batch_size, seq = train.batch_size, config.data.seq_len
  tokens = torch.randint(0, config.model.vocab_size, (batch_size, seq + 1), device="cuda")
  inputs, labels = tokens[:, :-1], tokens[:, 1:]
  flex = spec["args"]["attn_type"] == "flex"

  def step():
    masks = model.get_attention_masks(input_batch=inputs, tokenizer=None) if flex else None
    loss = loss_fn(model(inputs, attention_masks=masks), labels) / labels.numel()
    loss.backward()
    if train.grad_clip:
      titan.clip_grad_norm_(list(model.parameters()), train.grad_clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss

  from hf_peer import timed_steps  # (this script's folder is on sys.path)
  figures = timed_steps(step, args.warmup, args.steps, config, args.settle)
  print(json.dumps({
      "peer": f"torchtitan {titan.version} / torch {torch.__version__}",
      "config": args.config, "architecture": spec["model"],
      "experts_implementation": "grouped_mm", "attention": spec["args"]["attn_type"],
      "compile": "off" if args.no_compile else "per block",
      "routing": "balanced" if args.balanced else "real", "layers": config.model.num_layers,
      "params": params, "jmoe_params": jmoe,
      "batch": batch_size, "seq_len": seq, **figures}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
