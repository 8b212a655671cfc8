"""Config schema, its registration with Hydra, composition and validation."""

from rlhf.config.compose import compose_config, register_schema
from rlhf.config.schema import RunConfig
from rlhf.errors import ConfigError
from rlhf.config.validate import DerivedSizes, validate

__all__ = ["RunConfig", "ConfigError", "DerivedSizes", "compose_config", "register_schema", "validate"]
