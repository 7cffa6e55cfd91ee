"""What a layout costs before renting it: a train step's per-device memory by category (before
compiling) and the bytes its collectives send (from the compiled program).

  estimate.py  the step-level estimate (`estimate`), and XLA's figure to check it against
  walk.py      the walk over a traced program's buffers, and what it assumes of XLA
  liveness.py  the walk's values and its pass over one program: what is stored, what is live
  flat.py      the program flattened for the walk; value kinds from named scopes
  gpu.py       the stand-ins for GPU kernels when estimating a GPU run on another platform
  traffic.py   the collectives of a compiled step: bytes per device by kind (`communication`)
  compiled.py  a compiled program's temporaries as XLA placed them, read from its dump
They read a traced or compiled step; nothing in training depends on them. docs/MEMORY.md has its measured error.
"""

from jmoe.memory.estimate import CATEGORIES, MemoryEstimate, compiled_bytes, estimate, function_peak
