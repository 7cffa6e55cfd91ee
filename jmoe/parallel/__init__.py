"""The device mesh and the logical-axis rules that place parameters and activations on it.

Mesh axis names appear only here (and inside `shard_map` bodies); model code speaks logical names.
"""

from jmoe.parallel.mesh import (ExpertAxes, Layout, active_layout, constrain, gathered,
                                in_stages, make_layout, split_count, stage_balance)
