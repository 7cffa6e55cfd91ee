"""Training data: corpora, tokenizers, and batches placed on the devices."""

from jmoe.data.batches import WindowSampler, make_sampler
from jmoe.data.corpus import stdlib_documents
from jmoe.data.tokenizer import ByteTokenizer
