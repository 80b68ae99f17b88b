"""Typed configuration: every knob of a run, with its default and a one-line description.

Defaults live in `sections.py` and nowhere else. A run's config is built from (lowest to
highest priority) these defaults, an optional YAML file, and repeated `--set a.b=value`
overrides (`load.py`). Every validation error is turned into a `ConfigError` that names
the field, the bad value and what is allowed.
"""

from looprl.config.algo import DEFAULT_CLIP, AlgoConfig, AlgoExperimental, CurriculumConfig
from looprl.config.base import Section
from looprl.config.evaluation import AlsoEval, EvalConfig
from looprl.config.load import (
    config_from_dict,
    describe_fields,
    format_validation_error,
    load_config,
    parse_yaml,
    to_yaml,
)
from looprl.config.run import Config
from looprl.config.sections import (
    EnvConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    RolloutConfig,
    SFTConfig,
    TrainConfig,
)

__all__ = [
    "DEFAULT_CLIP",
    "AlgoConfig",
    "AlgoExperimental",
    "AlsoEval",
    "Config",
    "CurriculumConfig",
    "EnvConfig",
    "EvalConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "RolloutConfig",
    "SFTConfig",
    "Section",
    "TrainConfig",
    "config_from_dict",
    "describe_fields",
    "format_validation_error",
    "load_config",
    "parse_yaml",
    "to_yaml",
]
