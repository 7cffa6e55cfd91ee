"""tiny_dense upcycled into a fine-grained MoE: each dense MLP (width 512) cut into 4 slices of 128,
16 experts (4 copies of the MLP), top-4. Upcycle a trained tiny_dense run, then train from it:

  python -m jmoe.convert upcycle --checkpoint /tmp/jmoe-dense \
      --config configs/tiny_upcycled_moe.py --out /tmp/jmoe-upcycled
  python -m jmoe.train --config configs/tiny_upcycled_moe.py --workdir /tmp/jmoe-upcycled-run \
      --config.checkpoint.load_params=/tmp/jmoe-upcycled
"""

import pathlib

from jmoe.config import read_config_file


def get_config():
  c = read_config_file(pathlib.Path(__file__).with_name("tiny_moe.py"))
  c.moe.update(num_experts=16, top_k=4, d_ff_expert=128, first_k_dense=0)
  c.moe.router.update(score="softmax", norm_topk_prob=True)
  c.train.update(lr=1e-3, warmup_steps=10)  # a gentler start: the model is already trained
  return c
