"""Config schema, its registration with Hydra, and validation."""

from rlhf.config.schema import RunConfig
from rlhf.config.validate import ConfigError, DerivedSizes, validate

__all__ = ["RunConfig", "ConfigError", "DerivedSizes", "validate"]
