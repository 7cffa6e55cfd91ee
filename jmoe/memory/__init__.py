"""The memory estimate: a train step's per-device memory by category, before compiling.

  estimate.py  the step-level estimate (`estimate`), and XLA's figure to check it against
  walk.py      the walk over a traced program's buffers, and what it assumes of XLA
  flat.py      the program flattened for the walk; value kinds from named scopes
  gpu.py       the stand-ins for GPU kernels when estimating a GPU run on another platform
It reads a traced step; nothing in training depends on it. docs/MEMORY.md has its measured error.
"""

from jmoe.memory.estimate import CATEGORIES, MemoryEstimate, compiled_bytes, estimate, function_peak
