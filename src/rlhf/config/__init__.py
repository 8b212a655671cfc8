"""Config schema, its registration with Hydra, composition and validation."""

from rlhf.config.compose import compose_config, register_schema
from rlhf.config.schema import RunConfig
from rlhf.config.sizes import DerivedSizes
from rlhf.config.spec import RunSpec, resolve
from rlhf.config.validate import validate
from rlhf.errors import ConfigError

__all__ = ["RunConfig", "ConfigError", "DerivedSizes", "RunSpec", "compose_config", "register_schema", "resolve", "validate"]
