"""A training strategy of a user's own, outside the package: one class with its config class. Named by import path
(`user_strategy.CountingSingle`) from `conf/policy/strategy/counting.yaml` beside it."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.errors import require
from rlhf.training.strategies import SingleStrategy, StrategyConfig

STEPS: list[str] = []  # the tag of every optimiser step, so a test can see the strategy ran with its own key


@dataclass
class CountingConfig(StrategyConfig):
    tag: str = "mine"  # recorded at every optimiser step

    def check(self, at: str) -> None:
        require(self.tag != "", f"{at}.tag must not be empty")


class CountingSingle(SingleStrategy):
    """The single-process strategy, recording its tag at every optimiser step."""

    config = CountingConfig

    def __init__(self, model, module, train_cfg, lr, total_steps, compute_dtype, strategy_cfg) -> None:
        super().__init__(model, module, train_cfg, lr, total_steps, compute_dtype, strategy_cfg)
        self.tag = strategy_cfg.tag

    def optimizer_step(self) -> float:
        STEPS.append(self.tag)
        return super().optimizer_step()
