"""Advantage estimators and pair selectors, registered by name with their config classes (`algorithm/advantage`). The
math is in `rlhf.functional`.

An estimator turns a step's rewards into per-token advantages over the action window; a pair selector picks the
(chosen, rejected) rows of a pairwise algorithm. See `rlhf.algorithms.base` for the call signatures and
`AdvantageInputs`.
"""

from __future__ import annotations

import torch

from dataclasses import dataclass
from typing import Optional

from rlhf.algorithms.base import AdvantageInputs, register_advantage, register_pair_selector
from rlhf.errors import require
from rlhf.functional import (
    baseline_advantages,
    best_and_worst,
    discounted_returns,
    gae_advantages,
    greedy_baseline_advantages,
    group_means,
    group_normalized_advantages,
    last_token_index,
    masked_whiten,
    rebn_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    to_token_level,
)
from rlhf.parts import PartConfig


@dataclass
class GroupConfig(PartConfig):
    norm_adv_by_std: bool = True  # divide group-centred rewards by the group std (false = Dr.GRPO style)


@dataclass
class WhitenConfig(PartConfig):
    whiten_advantages: bool = False  # whiten the advantages across the whole batch


@dataclass
class WhitenedConfig(WhitenConfig):
    whiten_advantages: bool = True  # whiten the advantages across the whole batch (unit variance)


@dataclass
class DiscountConfig(PartConfig):
    gamma: float = 1.0  # discount over tokens (rebn: over turns); 1 = none

    def check(self, at: str) -> None:
        require(0 <= self.gamma <= 1, f"{at}.gamma={self.gamma} must be in [0, 1]")


@dataclass
class GaeConfig(DiscountConfig):
    lam: float = 0.95  # GAE lambda
    whiten_advantages: bool = True  # whiten GAE advantages over the batch's tokens
    vf_coef: float = 0.1  # weight of the critic's value loss
    cliprange_value: Optional[float] = 0.2  # value clip range around the old values; null = unclipped

    def check(self, at: str) -> None:
        super().check(at)
        require(0 <= self.lam <= 1, f"{at}.lam={self.lam} must be in [0, 1]")
        require(self.vf_coef >= 0, f"{at}.vf_coef={self.vf_coef} must be >= 0")
        require(
            self.cliprange_value is None or self.cliprange_value > 0,
            f"{at}.cliprange_value={self.cliprange_value} must be > 0 (or null for an unclipped value loss)",
        )


def whiten_rows(advantages: torch.Tensor, whiten: bool) -> torch.Tensor:
    """Sequence advantages whitened across the batch when ``whiten`` (and there are two or more). Shape: (B,)."""
    if not whiten or advantages.numel() < 2:
        return advantages
    return masked_whiten(advantages, torch.ones_like(advantages))


@register_advantage("grpo", config=GroupConfig, min_samples_per_prompt=2)
def grpo(inputs: AdvantageInputs, cfg: GroupConfig):
    """Group-relative: each reward centred (and by default std-scaled) within its prompt's samples."""
    advantages = group_normalized_advantages(inputs.sequence_rewards(), inputs.group_size, cfg.norm_adv_by_std)
    return to_token_level(advantages, inputs.mask), None


@register_advantage("rloo", config=WhitenConfig, min_samples_per_prompt=2)
def rloo(inputs: AdvantageInputs, cfg: WhitenConfig):
    """REINFORCE leave-one-out: a sample's baseline is the mean reward of its prompt's other samples."""
    advantages = whiten_rows(rloo_advantages(inputs.sequence_rewards(), inputs.group_size), cfg.whiten_advantages)
    return to_token_level(advantages, inputs.mask), None


@register_advantage("reinforce", config=WhitenedConfig)
def reinforce(inputs: AdvantageInputs, cfg: WhitenedConfig):
    """REINFORCE with the batch-mean baseline (optionally whitened across the batch)."""
    advantages = whiten_rows(baseline_advantages(inputs.sequence_rewards()), cfg.whiten_advantages)
    return to_token_level(advantages, inputs.mask), None


@register_advantage("reinforce_pp", config=DiscountConfig)
def reinforce_pp(inputs: AdvantageInputs, cfg: DiscountConfig):
    """REINFORCE++ (Hu, 2025): per-token KL penalty in the reward, reward-to-go whitened over the batch's tokens."""
    return reinforce_pp_advantages(inputs.token_rewards(), inputs.mask, cfg.gamma), None


@register_advantage("reinforce_pp_baseline", config=DiscountConfig, min_samples_per_prompt=2)
def reinforce_pp_baseline(inputs: AdvantageInputs, cfg: DiscountConfig):
    """REINFORCE++ with a baseline: each row's score minus its group's mean score (at the last action token) first,
    then REINFORCE++'s returns and batch whitening."""
    rewards = inputs.token_rewards().clone()
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last_token_index(inputs.mask)] -= group_means(
        inputs.scores, inputs.group_size)
    return reinforce_pp_advantages(rewards, inputs.mask, cfg.gamma), None


@register_advantage("remax", config=WhitenConfig, needs_greedy_baseline=True)
def remax(inputs: AdvantageInputs, cfg: WhitenConfig):
    """ReMax (Li et al., 2023): each row's reward minus the reward of its prompt's greedy response, generated in the
    same step."""
    if inputs.baselines is None:
        raise ValueError("algorithm.advantage=remax needs each prompt's greedy-response score; none was generated")
    advantages = greedy_baseline_advantages(inputs.sequence_rewards(), inputs.baselines)
    return to_token_level(whiten_rows(advantages, cfg.whiten_advantages), inputs.mask), None


@register_advantage("gae", config=GaeConfig, needs_critic=True)
def gae(inputs: AdvantageInputs, cfg: GaeConfig):
    """GAE on per-token rewards (KL penalty per token, score at the last one) and the critic's values; returns
    are the value targets. `vf_coef` and `cliprange_value` configure the critic's loss that comes with it."""
    if inputs.values is None:
        raise ValueError("algorithm.advantage=gae needs the critic's values; none were computed")
    advantages, returns = gae_advantages(inputs.token_rewards(), inputs.values, inputs.mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, inputs.mask)
    return advantages, returns


@dataclass
class RebnConfig(DiscountConfig):
    unbiased_std: bool = False  # true: the Bessel-corrected std over the batch's turns (GEM's example); false: the biased one
    eps: float = 1e-6  # added to the std before dividing (GEM's example: 1e-9)

    def check(self, at: str) -> None:
        super().check(at)
        require(self.eps > 0, f"{at}.eps={self.eps} must be > 0")


@register_advantage("rebn", config=RebnConfig)
def rebn(inputs: AdvantageInputs, cfg: RebnConfig):
    """Per-turn returns discounted by `gamma`, normalised over every turn of the batch (return batch normalisation)."""
    return rebn_advantages(inputs.token_rewards(), inputs.mask, cfg.gamma, cfg.eps, cfg.unbiased_std), None


@dataclass
class DistillConfig(PartConfig):
    gamma: float = 0.0  # 0: each token's own signal (as Tinker's cookbook); 1: the signal summed from the token to the end

    def check(self, at: str) -> None:
        require(0 <= self.gamma <= 1, f"{at}.gamma={self.gamma} must be in [0, 1]")


@register_advantage("opd", config=DistillConfig, needs_teacher=True)
def opd(inputs: AdvantageInputs, cfg: DistillConfig):
    """On-policy distillation: the advantage of each sampled token is the teacher's signal, -(log p_student -
    log p_teacher) (`rlhf.functional.distill`), discounted over the following tokens by `gamma`; the reward is not used."""
    if inputs.teacher_signal is None:
        raise ValueError("algorithm.advantage=opd needs the teacher's logprobs; set teacher.name_or_path")
    return discounted_returns(inputs.teacher_signal, inputs.mask, cfg.gamma), None


@register_pair_selector("best_vs_worst")
def best_vs_worst(inputs: AdvantageInputs, cfg: PartConfig):
    """Preference pairs: each prompt's highest- against its lowest-scored sample (first on ties), as row indices."""
    return best_and_worst(inputs.scores, inputs.group_size)
