"""Training data: document sources, tokenizers, packing, and batches placed on the devices."""

from jmoe.data.pipeline import DataPipeline, first_batches
from jmoe.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
