"""Rollout corrections, registered by name with their config classes (`algorithm/rollout_correction`). The math is in `rlhf.functional.importance`.

A correction is ``fn(trainer_logp, generator_logp, mask, cfg) -> (weights (B, T), flagged (B, T) bool)``: detached
per-token weights on the policy loss (0 drops a token) and the tokens it changed. `correction_metrics` reports
what it did under `rollout_corr/`. The rejecting corrections (`icepop`, `geo_reject`) also take the tokens they
reject out of the loss mask (`kept_mask`), so those tokens count in no term and no denominator, unless
``drop_rejected=false`` asks for the weight alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlhf.functional import masked_mean
from rlhf.functional.importance import (
    geometric_rejection_weights,
    masked_is_weights,
    sequence_truncated_is_weights,
    truncated_is_weights,
)
from rlhf.errors import require
from rlhf.parts import PartConfig
from rlhf.registry import register


def register_rollout_correction(name: str, *, config: type = PartConfig) -> Callable:
    """Decorator: register a rollout correction under ``name`` with its config class."""

    def add(fn: Callable) -> Callable:
        fn.config = config
        return register("rollout_correction", name)(fn)

    return add


@dataclass
class TruncationConfig(PartConfig):
    clip: float = 2.0  # the importance weight's cap

    def check(self, at: str) -> None:
        require(self.clip > 0, f"{at}.clip={self.clip} must be > 0 (the importance weight's cap)")


@dataclass
class BandConfig(PartConfig):
    low: float = 0.5  # ratios below this are masked (icepop) or their row rejected (geo_reject)
    high: float = 2.0  # ratios above this are masked (icepop) or their row rejected (geo_reject)
    drop_rejected: bool = True  # rejected tokens leave the loss mask of every term (KL, entropy, the denominator), as verl; false: only their policy-loss weight is 0

    def check(self, at: str) -> None:
        require(
            0 <= self.low < self.high,
            f"{at}.low={self.low} must be >= 0 and below {at}.high={self.high} (the band of kept ratios, e.g. 0.5 and 2)",
        )


@register_rollout_correction("token_tis", config=TruncationConfig)
def token_tis(trainer_logp, generator_logp, mask, cfg: TruncationConfig):
    """Truncated IS per token (Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy RL")."""
    return truncated_is_weights(trainer_logp, generator_logp, mask, cfg.clip)


@register_rollout_correction("seq_tis", config=TruncationConfig)
def seq_tis(trainer_logp, generator_logp, mask, cfg: TruncationConfig):
    """Truncated IS per sequence: the product of a row's token ratios, capped, weighs every token of the row."""
    return sequence_truncated_is_weights(trainer_logp, generator_logp, mask, cfg.clip)


@register_rollout_correction("icepop", config=BandConfig)
def icepop(trainer_logp, generator_logp, mask, cfg: BandConfig):
    """Masked IS (IcePop, Ling Team, 2025, Ring-1T): tokens whose ratio leaves [low, high] carry no gradient."""
    return masked_is_weights(trainer_logp, generator_logp, mask, cfg.low, cfg.high)


@register_rollout_correction("geo_reject", config=BandConfig)
def geo_reject(trainer_logp, generator_logp, mask, cfg: BandConfig):
    """Sequence rejection by the geometric-mean ratio: rows outside [low, high] are dropped from the loss."""
    return geometric_rejection_weights(trainer_logp, generator_logp, mask, cfg.low, cfg.high)


def kept_mask(weights: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """The loss mask after a correction: without the tokens it rejected (weight 0) when its config says
    ``drop_rejected``, else ``mask`` as is. Shapes: (B, T) each."""
    if not getattr(cfg, "drop_rejected", False):
        return mask
    return mask * (weights > 0).to(mask.dtype)


def correction_metrics(
    weights: torch.Tensor, flagged: torch.Tensor, trainer_logp: torch.Tensor, generator_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """`rollout_corr/*` over the action tokens: kept share (weight > 0), masked share (weight 0), flagged share
    (changed by the correction), the mean weight, and the token ratio's mean and max. Shapes: (B, T) each."""
    real = mask.bool()
    ratio = torch.exp(torch.where(real, trainer_logp - generator_logp, torch.zeros_like(trainer_logp)))
    kept = masked_mean((weights > 0).float(), mask).item()
    return {
        "rollout_corr/kept_share": kept,
        "rollout_corr/masked_share": 1.0 - kept if real.any() else 0.0,
        "rollout_corr/flagged_share": masked_mean(flagged.float(), mask).item(),
        "rollout_corr/weight_mean": masked_mean(weights, mask).item(),
        "rollout_corr/ratio_mean": masked_mean(ratio, mask).item(),
        "rollout_corr/ratio_max": ratio[real].max().item() if real.any() else 1.0,
    }
