"""Estimators, registered by name: grpo, reinforce, rloo (here), ppo and online_dpo (own modules)."""

from __future__ import annotations

import torch

from rlhf import functional as F
from rlhf.estimators.base import Estimator, Forward, PolicyGradientEstimator, StepInputs, TrainBatch
from rlhf.registry import register


@register("estimator", "grpo")
class GRPO(PolicyGradientEstimator):
    """Group-relative advantages: centred (and by default std-scaled) within each prompt's samples."""

    min_samples_per_prompt = 2

    def sequence_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return F.group_normalized_advantages(rewards, self.group_size, self.cfg.norm_adv_by_std)


@register("estimator", "reinforce")
class Reinforce(PolicyGradientEstimator):
    """REINFORCE with the batch-mean baseline (optionally whitened across the batch)."""

    def sequence_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        adv = F.baseline_advantages(rewards)
        return _maybe_whiten(adv, self.cfg.whiten_advantages)


@register("estimator", "rloo")
class RLOO(PolicyGradientEstimator):
    """REINFORCE leave-one-out: the baseline of a sample is the mean of its prompt's other samples."""

    min_samples_per_prompt = 2

    def sequence_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        adv = F.rloo_advantages(rewards, self.group_size)
        return _maybe_whiten(adv, self.cfg.whiten_advantages)


def _maybe_whiten(adv: torch.Tensor, whiten: bool) -> torch.Tensor:
    if not whiten or adv.numel() < 2:
        return adv
    return F.masked_whiten(adv, torch.ones_like(adv))


__all__ = ["Estimator", "Forward", "PolicyGradientEstimator", "StepInputs", "TrainBatch", "GRPO", "Reinforce", "RLOO"]
