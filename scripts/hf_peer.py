"""The PyTorch peer: a Hugging Face transformers training step on the same model config and batch.

  python scripts/hf_peer.py --config configs/bench/qwen3_30b_a3b_1gpu.py
      [--experts-implementation grouped_mm] [--attn-implementation auto] [--steps 5] [--warmup 2]
      [--settle S]

Builds the transformers model that `jmoe.convert export-hf` would write for the config (its
architecture from `model.family`), with random weights in bf16, the fastest attention transformers
offers for that architecture (ATTENTION below; `--attn-implementation` names one instead) and
PyTorch's fused AdamW, and times full steps (forward, backward, update) on random tokens. Prints
one JSON line with the same fields and the same FLOP count as scripts/benchmark.py, so the two
compare directly, and the attention it ran. Needs torch and transformers (present on the GPU
image; not a jmoe dependency).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# Attention implementations to ask transformers for under `auto`, fastest first; one that
# transformers refuses when the model is built falls to the next. GPT-OSS's attention sinks keep it
# off sdpa (its _supports_sdpa is False in transformers 5.17); flex attention applies them from its
# log-sum-exp, eager from the full score matrix.
ATTENTION = {
    "Qwen3MoeForCausalLM": ("sdpa",),
    "MixtralForCausalLM": ("sdpa",),
    "DeepseekV3ForCausalLM": ("sdpa",),
    "GptOssForCausalLM": ("flex_attention", "eager"),
}


def attention_choices(architecture: str, requested: str = "auto") -> tuple[str, ...]:
  return ATTENTION[architecture] if requested == "auto" else (requested,)


def build_model(architecture, hf_config, choices: tuple[str, ...], **kwargs):
  """`architecture` (a transformers class) built with the first of `choices` that transformers
  accepts for it, and the attention implementation the model then runs."""
  for name in choices[:-1]:
    try:  # transformers checks the choice first thing in the constructor, before any weight
      model = architecture._from_config(hf_config, attn_implementation=name, **kwargs)
      return model, model.config._attn_implementation
    except (ValueError, ImportError):
      pass
  model = architecture._from_config(hf_config, attn_implementation=choices[-1], **kwargs)
  return model, model.config._attn_implementation


def timed_steps(step, warmup: int, steps: int, config, settle_s: float = 0.0) -> dict:
  """`step()` (a PyTorch training step returning its loss) run `warmup` times, then for
  `settle_s` seconds (gpu_clocks.settle), then timed over `steps` more with the GPU synced around
  them: the figures every peer prints, the model FLOPs counted by jmoe (jmoe.train.flops) for
  `config`'s batch, and the GPU's clocks over the timed steps, as scripts/benchmark.py's."""
  import torch
  from gpu_clocks import GpuClocks, settle  # (this script's folder is on sys.path)
  from jmoe.train.flops import model_flops_per_token
  for _ in range(warmup):
    step()
  torch.cuda.synchronize()
  settled = settle(step, torch.cuda.synchronize, settle_s)
  with GpuClocks() as clocks:
    t0 = time.perf_counter()
    for _ in range(steps):
      loss = step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / steps
  tokens_per_s = config.train.batch_size * config.data.seq_len / step_s
  return {"step_ms": round(step_s * 1e3, 2), "tokens_per_s_per_device": round(tokens_per_s),
          "tflops_per_device": round(tokens_per_s * model_flops_per_token(config) / 1e12, 1),
          "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
          "loss": round(float(loss.detach()), 4), **settled, **clocks.figures()}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--experts-implementation", default="grouped_mm")
  parser.add_argument("--attn-implementation", default="auto",
                      help="auto: the fastest transformers accepts for the architecture")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=2)
  from gpu_clocks import add_settle_flag  # (this script's folder is on sys.path)
  add_settle_flag(parser)
  from jmoe.cli import split_overrides
  rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(rest)

  import torch
  import transformers
  from jmoe.hf.families import check_exportable
  from jmoe.config import load_config

  config = load_config(args.config, overrides)
  family = check_exportable(config.model, config.moe)
  hf_dict = family.to_hf(config.model, config.moe)
  hf_config = transformers.AutoConfig.for_model(
      hf_dict["model_type"], **{k: v for k, v in hf_dict.items() if k != "model_type"})
  architecture = getattr(transformers, family.architecture)
  torch.manual_seed(0)
  with torch.device("cuda"):  # initialised on the GPU: a CPU init of billions of weights is slow
    model, attention = build_model(
        architecture, hf_config, attention_choices(family.architecture, args.attn_implementation),
        dtype=torch.bfloat16, experts_implementation=args.experts_implementation)
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
  batch_size, seq = config.train.batch_size, config.data.seq_len
  tokens = torch.randint(0, config.model.vocab_size, (batch_size, seq), device="cuda")

  def step():
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss

  figures = timed_steps(step, args.warmup, args.steps, config, args.settle)
  print(json.dumps({
      "peer": f"transformers {transformers.__version__} / torch {torch.__version__}",
      "config": args.config, "architecture": family.architecture,
      "experts_implementation": args.experts_implementation, "attention": attention,
      "layers": config.model.num_layers,
      "batch": batch_size, "seq_len": seq, **figures}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
