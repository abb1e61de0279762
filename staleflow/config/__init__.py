"""One typed configuration for ``staleflow launch``: nested frozen dataclasses with help
text and validation, YAML files plus ``key=value`` overrides.

Each component receives its own section (``config.rollout``, ``config.coordinator``,
...); :meth:`RunConfig.resolved` makes cross-section ``auto`` choices explicit first.
Errors are :class:`coordinator.config.ConfigError` (a ``ValueError``), whose message names
the dotted key and the fix.
"""

from coordinator.config import ConfigError, CoordinatorConfig, CostModelConfig
from staleflow.config.env import EnvConfig
from staleflow.config.evaluation import EvalConfig
from staleflow.config.io import (
    config_from_dict,
    config_to_dict,
    describe_config,
    format_config_help,
    load_config,
    parse_override,
    save_config,
)
from staleflow.config.recovery import RecoveryConfig
from staleflow.config.resources import ResourcesConfig
from staleflow.config.run import RunConfig, config_warnings
from staleflow.config.sections import (
    DataConfig,
    ModelConfig,
    PSConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from staleflow.config.walk import ConfigKey

__all__ = [
    "ConfigError",
    "ConfigKey",
    "CoordinatorConfig",
    "CostModelConfig",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "ModelConfig",
    "PSConfig",
    "RecoveryConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainerConfig",
    "config_from_dict",
    "config_to_dict",
    "config_warnings",
    "describe_config",
    "format_config_help",
    "load_config",
    "parse_override",
    "save_config",
]
