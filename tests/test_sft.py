"""Fine-tuning a released checkpoint: import a tiny Hugging Face MoE with its tokenizer and chat
template, fine-tune it on chat data, generate from it, and export it, with the README's commands."""

import json

import pytest

from test_chat import CHATML_THINKING, make_chat_tokenizer, write_chats
from test_hf import FAMILIES, HF_PYTHON, ROOT, hf

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not HF_PYTHON.exists(), reason="no reference Python: run scripts/hf_reference_env.sh")]


def imported_qwen(tmp_path):
  """A tiny Qwen3-MoE from transformers, with a chat tokenizer, imported with import-hf."""
  from jmoe.convert import main as convert
  kwargs = dict(FAMILIES["qwen3_moe"][1], vocab_size=416)
  hf("build", "qwen3_moe", tmp_path / "hf", 0, json.dumps(kwargs))
  make_chat_tokenizer(tmp_path / "hf", CHATML_THINKING)
  assert convert(["import-hf", "--hf-dir", str(tmp_path / "hf"), "--out",
                  str(tmp_path / "ckpt")]) == 0
  return tmp_path / "ckpt"


def test_the_readme_flow_import_fine_tune_generate_export(tmp_path, capsys):
  """README, "Fine-tuning": the tiny model and chat file of scripts/tiny_chat_model.py."""
  import runpy
  from jmoe.convert import main as convert
  from jmoe.generate import main as generate
  from jmoe.train.__main__ import main as train
  make = runpy.run_path(str(ROOT / "scripts" / "tiny_chat_model.py"))["main"]
  assert make(["--out", str(tmp_path / "hf"), "--chats", str(tmp_path / "chats.jsonl"),
               "--count", "200"]) == 0
  ckpt = tmp_path / "ckpt"
  assert convert(["import-hf", "--hf-dir", str(tmp_path / "hf"), "--out", str(ckpt)]) == 0
  assert (ckpt / "tokenizer.json").is_file() and (ckpt / "tokenizer_config.json").is_file()
  workdir = tmp_path / "sft"
  assert train(["--config", str(ROOT / "configs" / "sft_tiny_qwen3_moe.py"), "--workdir",
                str(workdir), "--no-progress", f"--config.checkpoint.load_params={ckpt}",
                f"--config.data.tokenizer={ckpt}", f"--config.data.source=chat:{tmp_path}/"
                "chats.jsonl", "--config.train.steps=6", "--config.train.warmup_steps=2",
                "--config.train.eval_every=3", "--config.data.seq_len=64"]) == 0
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["model"]["family"] == "qwen3_moe" and saved["model"]["vocab_size"] == 512
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert len(evals) == 2 and evals[1] < evals[0] and records[-1]["loss"] < records[0]["loss"]
  capsys.readouterr()
  assert generate(["--checkpoint", str(workdir), "--chat", "--prompt", "Name a colour.",
                   "--max-new-tokens", "8"]) == 0
  reply = json.loads(capsys.readouterr().out.strip())
  assert 1 <= len(reply["tokens"]) <= 8 and isinstance(reply["text"], str)
  assert convert(["export-hf", "--checkpoint", str(workdir), "--out", str(tmp_path / "out")]) == 0
  assert (tmp_path / "out" / "tokenizer.json").is_file()
  assert "chat_template" in json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())


def test_lora_fine_tune_exports_merged_and_transformers_agrees(tmp_path):
  """A model that transformers wrote (the architecture from it: top-3, 416 ids), LoRA on it."""
  from jmoe.convert import main as convert
  from jmoe.train.__main__ import main as train
  from test_hf import hf_logprobs, jmoe_logprobs, max_diff, random_sequences
  ckpt = imported_qwen(tmp_path)
  write_chats(tmp_path / "chats.jsonl", 40)
  workdir = tmp_path / "lora"
  assert train(["--config", str(ROOT / "configs" / "sft_tiny_qwen3_moe.py"), "--workdir",
                str(workdir), "--no-progress", f"--config.checkpoint.load_params={ckpt}",
                f"--config.data.tokenizer={ckpt}", "--config.data.eod_token=<|endoftext|>",
                f"--config.data.source=chat:{tmp_path / 'chats.jsonl'}", "--config.train.steps=4",
                "--config.train.eval_every=0", "--config.data.seq_len=64", "--config.lora.rank=4",
                "--config.train.lr=0.01", "--config.train.warmup_steps=1"]) == 0
  assert json.loads((workdir / "config.json").read_text())["moe"]["top_k"] == 3
  sequences = random_sequences(416, seed=3)
  before, adapted = jmoe_logprobs(ckpt, sequences), jmoe_logprobs(workdir, sequences)
  assert max_diff(before, adapted) > 1e-3  # the adapters changed the model
  assert convert(["export-hf", "--checkpoint", str(workdir), "--out", str(tmp_path / "out")]) == 0
  assert max_diff(hf_logprobs(tmp_path / "out", sequences, tmp_path), adapted) < 1e-4
