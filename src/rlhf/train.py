"""Entry point: `python -m rlhf.train [hydra overrides]` composes the config, checks it, trains.

Examples:
    python -m rlhf.train
    python -m rlhf.train algorithm=rloo train.lr=3e-4
    python -m rlhf.train --multirun train.lr=1e-4,3e-4 seed=1,2
    python -m rlhf.train --cfg job          # print the composed config
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rlhf.config import ConfigError, register_schema, validate

log = logging.getLogger("rlhf")

register_schema()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: DictConfig, out: Path) -> dict:
    """Validate, build, run the schedule in folder ``out``, summarise. Returns the schedule's summary metrics."""
    from rlhf import registry
    from rlhf.build import build_components
    from rlhf.tracking.tracker import Tracker

    sizes = validate(cfg)
    schedule = registry.resolve("schedule", cfg.schedule.name, key="schedule.name")
    log.info("output folder: %s", out)
    log.info("derived sizes: %s", ", ".join(f"{k}={v}" for k, v in sizes.as_dict().items()))
    seed_everything(cfg.seed)
    components = build_components(cfg, sizes)
    tracker = Tracker(out, cfg.logging.tensorboard)
    tracker.config(OmegaConf.to_yaml(cfg), sizes.as_dict())
    try:
        summary = schedule(components, cfg, sizes, tracker)
    finally:
        tracker.close()
    summarize(summary, tracker.elapsed())
    return summary


def summarize(summary: dict, seconds: float) -> None:
    first, last = summary["first_eval"], summary["last_eval"]
    log.info("done in %.0f s. eval start -> end:", seconds)
    for key in sorted(set(first) & set(last)):
        log.info("  %-32s %.3f -> %.3f", key, first[key], last[key])


@hydra.main(config_path="pkg://rlhf.conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    try:
        summary = train(cfg, Path(HydraConfig.get().runtime.output_dir))
    except ConfigError as err:
        log.error("config error: %s", err)
        raise SystemExit(2) from None
    # returned for Hydra sweepers that optimise a value
    return summary["last_eval"].get("eval/sampled_correct_rate")


if __name__ == "__main__":
    main()
