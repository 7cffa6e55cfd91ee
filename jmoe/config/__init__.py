"""Configuration: typed dataclasses, loading with overrides, validation."""

from jmoe.config.load import (apply_overrides, defaults, from_config_dict, load_config,
                              read_config_file)
from jmoe.config.schema import (BalanceConfig, CheckpointConfig, Config, DataConfig, DenseLayout,
                                ExpertLayout, LoRAConfig, MoEConfig, ModelConfig, ParallelConfig,
                                MLAConfig, PrecisionConfig, RouterConfig, TrainConfig, YarnConfig,
                                to_dict)
from jmoe.config.validate import validate
from jmoe.errors import ConfigError
