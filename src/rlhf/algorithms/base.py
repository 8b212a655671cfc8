"""How algorithm parts register, and what an advantage estimator is given.

An algorithm is composed from config (`algorithm.advantage`, `algorithm.policy_loss`, plus one KL term, one
entropy term and one loss aggregation): see `rlhf.algorithms.policy_gradient` and `rlhf.algorithms.pairwise`.

- An advantage estimator is ``fn(inputs: AdvantageInputs, cfg) -> (advantages (B, T), returns (B, T) or None)``;
  a pairwise one (``pairwise=True``) returns the (chosen (P,), rejected (P,)) row indices of preference pairs.
- A policy loss is ``fn(logp (B, T), batch: Trajectories, cfg) -> PolicyLoss``; a pairwise one is
  ``fn(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta)`` on summed sequence logprobs (P,)
  -> (loss (P,), chosen reward (P,), rejected reward (P,)).

``cfg`` is the part's own config: its node (`algorithm.advantage`, `algorithm.policy_loss`) typed by the config class
the part registers with (``config=``, a `rlhf.parts.PartConfig` dataclass beside the part), so a key the chosen part
does not declare is refused before anything loads (`rlhf.parts.choose`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlhf.functional import GroupSizes, masked_sum, token_level_rewards
from rlhf.parts import PartConfig
from rlhf.registry import register


def register_advantage(
    name: str, *, config: type = PartConfig, needs_critic: bool = False, min_samples_per_prompt: int = 1,
    pairwise: bool = False, needs_greedy_baseline: bool = False, needs_teacher: bool = False,
) -> Callable:
    """Decorator: register an advantage estimator under ``name`` with its config class and traits
    (``needs_greedy_baseline``: each step also generates and scores one greedy response per prompt, given as
    ``AdvantageInputs.baselines``; ``needs_teacher``: it reads ``AdvantageInputs.teacher_signal``)."""

    def add(fn: Callable) -> Callable:
        fn.config, fn.needs_critic = config, needs_critic
        fn.min_samples_per_prompt, fn.pairwise = min_samples_per_prompt, pairwise
        fn.needs_greedy_baseline, fn.needs_teacher = needs_greedy_baseline, needs_teacher
        return register("advantage", name)(fn)

    return add


def register_policy_loss(
    name: str, *, config: type = PartConfig, pairwise: bool = False, needs_critic: bool = False
) -> Callable:
    """Decorator: register a policy loss under ``name`` with its config class and traits (``needs_critic``: it reads
    ``batch.values``, so the advantage estimator must train a critic)."""

    def add(fn: Callable) -> Callable:
        fn.config, fn.pairwise, fn.needs_critic = config, pairwise, needs_critic
        return register("policy_loss", name)(fn)

    return add


@dataclass
class PolicyLoss:
    """A policy loss per token and what it reports. Shapes: (B, T)."""

    loss: torch.Tensor  # to be minimised, per token
    clipped: torch.Tensor  # bool: tokens whose loss came from a clipped branch
    log_ratio: torch.Tensor  # log of the importance ratio the loss used (detached where the loss detaches it)


@dataclass
class AdvantageInputs:
    """One step's rewards as an advantage estimator sees them. Shapes: (B,) per row, (B, T) per window token."""

    scores: torch.Tensor  # (B,) reward after the non-stop penalty
    mask: torch.Tensor  # (B, T) the loss mask
    group_size: GroupSizes  # rows per group (an int), or each group's size (a (P,) tensor) when they differ; a group's rows are contiguous
    kl: torch.Tensor | None = None  # (B, T) KL of the pre-update policy to the reference (0 outside the mask)
    kl_coef: float = 0.0  # this step's KL coefficient
    kl_in_reward: bool = False  # the KL is a reward penalty (else a loss term, and the rewards are the scores)
    values: torch.Tensor | None = None  # (B, T) the critic's values (estimators with needs_critic)
    turn_rewards: torch.Tensor | None = None  # (B, T) multi-turn: each turn's reward at its last action token
    baselines: torch.Tensor | None = None  # (B,) the score of the prompt's greedy response (estimators with needs_greedy_baseline)
    teacher_signal: torch.Tensor | None = None  # (B, T) -(logp_behaviour - logp_teacher) per action token (a run with a teacher)

    def non_score_rewards(self) -> torch.Tensor:
        """The KL penalty of each row, -kl_coef * summed KL (0 when the KL is not in the reward). Shape: (B,)."""
        if self.kl is None or not self.kl_in_reward:
            return torch.zeros_like(self.scores)
        return -self.kl_coef * masked_sum(self.kl, self.mask, dim=1)

    def sequence_rewards(self) -> torch.Tensor:
        """Score plus the KL penalty, one per row. Shape: (B,)."""
        if self.kl is None or not self.kl_in_reward:
            return self.scores
        return self.scores + self.non_score_rewards()

    def token_rewards(self) -> torch.Tensor:
        """The KL penalty at every token plus the rewards: the score at each row's last action token, or with
        ``turn_rewards`` each turn's reward at its own last token. Shape: (B, T)."""
        penalty = -self.kl_coef * self.kl if self.kl is not None and self.kl_in_reward else torch.zeros_like(self.mask)
        if self.turn_rewards is not None:
            return penalty * self.mask + self.turn_rewards
        return token_level_rewards(self.scores, penalty, self.mask)

