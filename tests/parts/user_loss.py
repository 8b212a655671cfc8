"""A policy loss of a user's own, outside the package: one module with its config class and its function. Named by
import path (`user_loss.scaled_clip`) from `conf/algorithm/policy_loss/scaled_clip.yaml` beside it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.algorithms import PolicyLoss
from rlhf.errors import require
from rlhf.functional import clipped_policy_loss
from rlhf.parts import PartConfig

CALLS: list[float] = []  # the scale of every call, so a test can see the loss ran with its own key


@dataclass
class ScaledClipConfig(PartConfig):
    scale: float = 1.0  # the clipped surrogate is multiplied by this
    clip_eps: float = 0.2  # symmetric clip range of the ratio

    def check(self, at: str) -> None:
        require(self.scale > 0, f"{at}.scale={self.scale} must be > 0 (it multiplies the loss)")


def scaled_clip(logp: torch.Tensor, batch, cfg: ScaledClipConfig) -> PolicyLoss:
    """PPO's clipped surrogate times `scale`."""
    CALLS.append(cfg.scale)
    loss, clipped, log_ratio = clipped_policy_loss(logp, batch.old_logp, batch.advantages, cfg.clip_eps, cfg.clip_eps, None)
    return PolicyLoss(cfg.scale * loss, clipped, log_ratio)


scaled_clip.config = ScaledClipConfig


def not_a_config_class(logp, batch, cfg):
    """A loss whose `config` attribute is not a config class (a user's mistake)."""
    raise AssertionError("never called: its node is refused before any model loads")


not_a_config_class.config = {"scale": 1.0}


@dataclass
class CheckRaisesConfig(PartConfig):
    limit: int = 3  # anything

    def check(self, at: str) -> None:
        raise KeyError("limit")  # a user's check that itself fails


def check_raises(logp, batch, cfg):
    raise AssertionError("never called")


check_raises.config = CheckRaisesConfig

not_a_function = 42  # named as a part or a reward function by mistake: refused before any model loads


def unclassed_clip(logp: torch.Tensor, batch, cfg) -> PolicyLoss:
    """A loss that declares no config class: it gets its node as written and reads its keys by attribute."""
    CALLS.append(cfg.clip_eps_low)
    return scaled_clip(logp, batch, ScaledClipConfig(name=cfg.name, scale=1.0, clip_eps=cfg.clip_eps_low))
