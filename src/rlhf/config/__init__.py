"""Config schema, its registration with Hydra, composition and validation."""

from rlhf.config.compose import compose_config, register_schema
from rlhf.config.schema import RunConfig
from rlhf.config.validate import DerivedSizes, validate
from rlhf.errors import ConfigError

__all__ = ["RunConfig", "ConfigError", "DerivedSizes", "compose_config", "register_schema", "validate"]
