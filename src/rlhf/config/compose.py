"""Register the schema with Hydra and compose configs outside `@hydra.main` (tests, tools, notebooks)."""

from __future__ import annotations

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from rlhf.config.schema import RunConfig

CONFIG_MODULE = "rlhf.conf"
SCHEMA_NAME = "rlhf_schema"


def register_schema() -> None:
    """Make `rlhf_schema` (the structured RunConfig) available to the defaults list of conf/config.yaml."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The run config `python -m rlhf.train <overrides>` would get (without the `hydra` node)."""
    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides or []))
