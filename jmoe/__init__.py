"""jmoe: Mixture-of-Experts language model training with JAX and Flax NNX.

Packages import downward only, in this order (tests/test_layout.py reads this line):
  errors <- outputs <- cli <- ops <- config <- distributed <- parallel <- moe <- model <- data
  <- checkpoint <- hf <- inference <- train <- memory <- api <- convert <- score <- generate
  <- xla_flags
outputs checks and puts in place what commands write where a user says; cli is what commands
share; ops, the kernels and primitives, needs nothing of jmoe but its errors;
config validates against the registries there; distributed joins a run's processes (commands
call it); from api on: the Python API, the commands and their helpers (a `__main__.py` may import
anything).

Tensors are named with their shape, one letter per axis, each letter with one meaning:
  B batch              S sequence             N a window of S + 1 tokens (inputs, then targets)
  T tokens (B*S)       D model width          V vocabulary             L layers (of a stack; or
  H query heads        G key/value heads      A head dim                 the MoE layers, then the
  F hidden (MLP)       E experts              K chosen experts/token     MTP modules, in order)
  X token copies (T*K, in token order or sorted by expert)             M micro-batches
  C an expert's capacity (the rows of its block, or the copies it takes before dropping)
  J rows past the blocks (an expert's overflow)   P rows of an exchange buffer (a block per peer)
  U router groups (group-limited routing)     Q balance-loss groups (batch, ranks or sequences)
  Z steps of an FP8 amax history
  MLA: R a latent's rank (of the queries' or of the keys' and values')   W value head dim
       I = R + p, Y = n + W: the widths of the key/value down- and up-projections
  digits  an axis of that size (2: gate and up; 3: an FP8 GEMM's input, weight and gradient;
       2D: two model widths side by side)
  lowercase  a part of the axis its capital names: e experts (of one router group, or the slices
       of an upcycled MLP), u a token's chosen groups, f a slice of F, a half of A (rotary
       frequencies), n and p the no-rope and rope parts of A (MLA)
e.g. `x_BSD`, `w_in_ED2F`, `probs_TE`, `send_PD`.
"""

__version__ = "0.1.0"

_API = ("Config", "Trainer", "estimate_memory", "generate", "load_config", "load_model", "score")


def __getattr__(name: str):
  """`jmoe.Trainer`, `jmoe.load_config`, ... (jmoe/api.py), imported when first used."""
  if name in _API:
    from jmoe import api
    return getattr(api, name)
  raise AttributeError(f"module 'jmoe' has no attribute {name!r}")
