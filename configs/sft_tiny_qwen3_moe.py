"""Supervised fine-tuning of an imported (tiny) Qwen3-MoE checkpoint on chat data.

  python -m jmoe.convert import-hf --hf-dir HF_DIR --out CKPT
  python -m jmoe.train --config configs/sft_tiny_qwen3_moe.py --workdir WORKDIR \\
      --config.checkpoint.load_params=CKPT --config.data.tokenizer=CKPT \\
      --config.data.source=chat:CHATS.jsonl

The model's architecture comes from CKPT (checkpoint.load_params_config); each line of
CHATS.jsonl is {"messages": [{"role": ..., "content": ...}, ...]}, rendered with CKPT's own chat
template (import-hf keeps the tokenizer files beside the model), and only the assistant's tokens
count in the loss. Every 10th conversation is held out; its loss is reported every 50 steps.
The learning rate suits the tiny random model of scripts/tiny_chat_model.py, which learns its
arithmetic from nothing here (about a minute on a 2-core CPU); a released model wants one
100-1000 times lower.
"""

import pathlib
import runpy


def get_config():
  c = runpy.run_path(str(pathlib.Path(__file__).with_name("tiny_qwen3_moe.py")))["get_config"]()
  c.checkpoint.update(load_params="", load_params_config=True, every=0)
  c.data.update(source="chat:chats.jsonl", packing="concat", seq_len=128, eval_fraction=0.1,
                eval_batches=1)
  c.train.update(steps=300, batch_size=8, lr=3e-3, min_lr_ratio=0.1, warmup_steps=20,
                 weight_decay=0.0, eval_every=50, log_every=10)
  return c
