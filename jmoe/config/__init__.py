"""Configuration: typed dataclasses, loading with overrides, validation."""

from jmoe.config.load import (apply_overrides, defaults, from_config_dict, load_config,
                              read_config_file)
from jmoe.config.layout import DenseLayout, ExpertLayout, ParallelConfig
from jmoe.config.schema import (BalanceConfig, CheckpointConfig, Config, DataConfig, LoRAConfig,
                                MoEConfig, ModelConfig, MLAConfig, PrecisionConfig, RouterConfig,
                                TrainConfig, YarnConfig, to_dict)
from jmoe.config.validate import validate
from jmoe.errors import ConfigError
