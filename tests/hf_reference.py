"""The Hugging Face side of the parity tests; runs under .venv-hf (torch + transformers), never
under jmoe's own Python.

  python hf_reference.py build FAMILY OUT_DIR SEED CONFIG_JSON [MAX_SHARD_SIZE]
      a random-weight model from transformers' own config class, saved with save_pretrained
  python hf_reference.py logprobs MODEL_DIR TOKENS_JSON OUT_JSON
      log p(tokens[i+1] | tokens[:i+1]) for each sequence, in float32
  python hf_reference.py mxfp4 MODEL_DIR OUT_DIR SEED
      GPT-OSS: OUT_DIR/quantized holds random MXFP4 expert weights (blocks and scales, as the
      release stores them), OUT_DIR/dequantized the same through transformers' dequantization
  python hf_reference.py chat TOKENIZER_DIR CONVERSATIONS_JSON OUT_JSON
      each conversation through apply_chat_template: its text, and (for templates with
      {% generation %} blocks) its token ids and assistant mask
  python hf_reference.py attention HF_CONFIGS_JSON OUT_JSON
      each config.json (as export-hf writes it) built on the CPU as scripts/hf_peer.py builds it:
      the attention implementations transformers accepts for it, and the one `auto` runs
"""

import json
import sys

import torch
import transformers

CLASSES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
}


def build(family, out_dir, seed, config_json, max_shard_size=None):
  config_cls, model_cls = CLASSES[family]
  torch.manual_seed(int(seed))
  model = model_cls(config_cls(**json.loads(config_json))).float().eval()
  with torch.no_grad():  # larger than the default init, so every weight visibly matters
    for name, p in model.named_parameters():
      if p.ndim >= 2:
        p.normal_(0.0, 0.2)
      elif "norm" not in name:  # biases, sinks
        p.normal_(0.0, 0.5)
      elif "norm" in name:
        p.uniform_(0.5, 1.5)
    for name, b in model.named_buffers():
      if "e_score_correction_bias" in name:  # DeepSeek's selection bias
        b.uniform_(-0.3, 0.3)
  kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(out_dir, **kwargs)


def logprobs(model_dir, tokens_json, out_json):
  model = transformers.AutoModelForCausalLM.from_pretrained(
      model_dir, dtype=torch.float32, experts_implementation="eager").eval()  # the per-expert loop
  out = []
  with torch.no_grad():
    for tokens in json.load(open(tokens_json)):
      ids = torch.tensor([tokens])
      logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
      out.append(logp[:-1].gather(-1, ids[0, 1:, None])[:, 0].tolist())
  json.dump(out, open(out_json, "w"))


def chat(tokenizer_dir, conversations_json, out_json):
  tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
  out = []
  for messages in json.load(open(conversations_json)):
    record = {"text": tokenizer.apply_chat_template(messages, tokenize=False),
              "prompt": tokenizer.apply_chat_template(messages[:-1], tokenize=False,
                                                      add_generation_prompt=True)}
    if "generation" in tokenizer.chat_template:
      encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
      record.update(ids=list(encoded["input_ids"]), mask=list(encoded["assistant_masks"]))
    out.append(record)
  json.dump(out, open(out_json, "w"))


def mxfp4(model_dir, out_dir, seed):
  import pathlib
  from safetensors.torch import load_file, save_file
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors
  model_dir, out_dir = pathlib.Path(model_dir), pathlib.Path(out_dir)
  tensors = load_file(model_dir / "model.safetensors")
  config = json.loads((model_dir / "config.json").read_text())
  generator = torch.Generator().manual_seed(int(seed))
  quantized, dequantized = {}, {}
  for name, tensor in tensors.items():
    if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
      quantized[name] = dequantized[name] = tensor
      continue
    experts, inputs, outputs = tensor.shape
    blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=generator,
                           dtype=torch.uint8)
    scales = torch.randint(122, 127, (experts, outputs, inputs // 32), generator=generator,
                           dtype=torch.uint8)
    quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
    dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
  for kind, weights in (("quantized", quantized), ("dequantized", dequantized)):
    (out_dir / kind).mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, out_dir / kind / "model.safetensors",
              metadata={"format": "pt"})
    saved = dict(config)
    if kind == "quantized":
      saved["quantization_config"] = {"quant_method": "mxfp4",
                                      "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                 "model.layers.*.mlp.router",
                                                                 "model.embed_tokens", "lm_head"]}
    (out_dir / kind / "config.json").write_text(json.dumps(saved))


def attention(hf_configs_json, out_json):
  import pathlib
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
  from hf_peer import attention_choices, build_model
  out = {}
  for hf in json.load(open(hf_configs_json)):
    name = hf["architectures"][0]
    config = transformers.AutoConfig.for_model(
        hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
    accepts = []
    for implementation in ("eager", "sdpa", "flex_attention"):
      try:
        build_model(getattr(transformers, name), config, (implementation,), dtype=torch.bfloat16)
        accepts.append(implementation)
      except (ValueError, ImportError):
        pass
    _, auto = build_model(getattr(transformers, name), config, attention_choices(name),
                          dtype=torch.bfloat16)
    out[name] = {"accepts": accepts, "auto": auto}
  json.dump(out, open(out_json, "w"))


if __name__ == "__main__":
  {"build": build, "logprobs": logprobs, "chat": chat, "mxfp4": mxfp4,
   "attention": attention}[sys.argv[1]](*sys.argv[2:])
