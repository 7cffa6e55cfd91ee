"""Orbax checkpoints of the train state."""

from jmoe.checkpoint.manager import Checkpointer
