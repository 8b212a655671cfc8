"""KL controllers, registered by name (`algorithm/kl_ctl`): how the KL coefficient `algorithm.beta` moves over a run.

A controller is ``fn(beta, cfg) -> controller`` with ``value`` (this step's coefficient) and ``update(kl, n)``; the
math is in `rlhf.functional.kl`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rlhf.errors import require
from rlhf.functional import AdaptiveKLController, FixedKLController
from rlhf.parts import PartConfig
from rlhf.registry import register


def register_kl_controller(name: str, *, config: type = PartConfig, needs_beta: bool = False) -> Callable:
    """Decorator: register a KL controller under ``name`` with its config class (``needs_beta``: it multiplies
    `algorithm.beta`, so beta must be > 0)."""

    def add(fn: Callable) -> Callable:
        fn.config, fn.needs_beta = config, needs_beta
        return register("kl_controller", name)(fn)

    return add


@register_kl_controller("fixed")
def fixed(beta: float, cfg: PartConfig) -> FixedKLController:
    """`algorithm.beta` for the whole run."""
    return FixedKLController(beta)


@dataclass
class AdaptiveKLConfig(PartConfig):
    target: float = 6.0  # the per-sequence KL to aim for
    horizon: int = 10000  # samples over which the coefficient adapts

    def check(self, at: str) -> None:
        require(
            self.target > 0 and self.horizon > 0,
            f"{at}.target={self.target} and {at}.horizon={self.horizon} must both be > 0",
        )


@register_kl_controller("adaptive", config=AdaptiveKLConfig, needs_beta=True)
def adaptive(beta: float, cfg: AdaptiveKLConfig) -> AdaptiveKLController:
    """Starts at `algorithm.beta` and moves it so the measured KL tracks `target` (Ziegler et al., 2019)."""
    return AdaptiveKLController(beta, cfg.target, cfg.horizon)
