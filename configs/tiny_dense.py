"""tiny_moe with every layer dense: the starting point for upcycling (see tiny_upcycled_moe.py).

  python -m jmoe.train --config configs/tiny_dense.py --workdir /tmp/jmoe-dense
"""

import pathlib

from jmoe.config import read_config_file


def get_config():
  c = read_config_file(pathlib.Path(__file__).with_name("tiny_moe.py"))
  c.moe.first_k_dense = c.model.num_layers  # all layers dense: no experts
  return c
