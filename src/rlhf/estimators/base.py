"""The estimator interface: rollout scores -> advantages -> a policy loss.

A factory registered as kind ``estimator`` is called as ``factory(cfg=<algorithm config>)`` and returns
an object with the three methods of `Estimator`. Critic-free estimators only differ in
`sequence_advantages`; subclass `PolicyGradientEstimator` and override that one method.
"""

from __future__ import annotations

from typing import Protocol

import torch

from rlhf import functional as F


class Estimator(Protocol):
    needs_reference: bool  # whether the loss or reward uses reference logprobs

    def shape_rewards(self, scores: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rlhf_reward (B,), non_score_reward (B,)) from scores (B,) and per-token KL (B, T) or None."""

    def advantages(self, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-token advantages (B, T) from rlhf rewards (B,)."""

    def policy_loss(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        ref_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        denominator: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(micro-batch loss, metrics) for one micro batch; all tensors (B, T) but the scalar denominator."""


class PolicyGradientEstimator:
    """Clipped policy-gradient loss with optional KL (in the reward or as a loss); advantages per subclass."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.group_size = int(cfg.num_samples_per_prompt)
        self.needs_reference = cfg.beta > 0

    def sequence_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Advantage of each sequence. Shape: (B,) -> (B,)."""
        raise NotImplementedError

    def shape_rewards(self, scores: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores plus -beta * summed KL when the KL lives in the reward. Shape: (B,), (B, T) -> (B,), (B,)."""
        if kl is None or not self.cfg.kl_in_reward:
            return scores, torch.zeros_like(scores)
        non_score = -self.cfg.beta * F.masked_sum(kl, mask, dim=1)
        return scores + non_score, non_score

    def advantages(self, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-token advantages. Shape: rewards (B,), mask (B, T) -> (B, T)."""
        return F.to_token_level(self.sequence_advantages(rewards), mask)

    def policy_loss(self, logp, old_logp, ref_logp, advantages, mask, denominator):
        """Clipped surrogate (+ beta * KL when KL is a loss), reduced by `algorithm.loss_agg`."""
        cfg = self.cfg
        per_token, clipped, log_ratio = F.clipped_policy_loss(logp, old_logp, advantages, cfg.clip_eps_low, cfg.clip_eps_high)
        pg_loss = F.aggregate_loss(per_token, mask, cfg.loss_agg, denominator)
        loss = pg_loss
        metrics = {
            "loss/policy": pg_loss.detach(),
            "policy/approxkl": F.masked_mean(0.5 * log_ratio.detach() ** 2, mask),
            "policy/clipfrac": F.masked_mean(clipped.float(), mask),
            "val/ratio": F.masked_mean(log_ratio.detach().exp(), mask),
        }
        if ref_logp is not None and cfg.beta > 0 and not cfg.kl_in_reward:
            kl = F.kl_per_token(logp, ref_logp, cfg.kl_estimator)
            kl_loss = F.aggregate_loss(kl, mask, cfg.loss_agg, denominator)
            loss = loss + cfg.beta * kl_loss
            metrics["loss/kl"] = kl_loss.detach()
        return loss, metrics
