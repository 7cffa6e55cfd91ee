"""A byte-level tokenizer: every byte is a token, plus end-of-document and padding ids."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
  EOD = 256  # closes every document, so the model learns where documents end
  PAD = 257
  vocab_size = 258

  def encode(self, text: str | bytes) -> np.ndarray:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
