"""Policy losses and pairwise losses, registered by name with their config classes (`algorithm/policy_loss`). The math is
in `rlhf.functional`.

A policy loss takes the trained policy's logprobs and the micro batch; a pairwise loss (DPO, IPO; kind
``pairwise_loss``) takes summed sequence logprobs of (chosen, rejected) pairs. See `rlhf.algorithms.base` for the
signatures.
"""

from __future__ import annotations

import torch

from dataclasses import dataclass
from typing import Optional

from rlhf.algorithms.base import PolicyLoss, register_pairwise_loss, register_policy_loss
from rlhf.errors import require
from rlhf.functional import cispo_policy_loss, clipped_policy_loss, dpo_loss, gspo_policy_loss, importance_sampling_loss
from rlhf.parts import PartConfig
from rlhf.trajectory import Trajectories


@dataclass
class ClipConfig(PartConfig):
    clip_eps_low: float = 0.2  # lower clip range: ratio >= 1 - clip_eps_low
    clip_eps_high: float = 0.2  # upper clip range: ratio <= 1 + clip_eps_high (raise it for clip-higher)

    def check(self, at: str) -> None:
        require(
            self.clip_eps_low > 0 and self.clip_eps_high > 0,
            f"{at}.clip_eps_low={self.clip_eps_low} and {at}.clip_eps_high={self.clip_eps_high} must be > 0",
        )
        require(
            self.clip_eps_low <= 1,
            f"{at}.clip_eps_low={self.clip_eps_low} must be <= 1: the ratio is never below 0, so 1 already means no "
            f"lower clip",
        )


@dataclass
class PpoClipConfig(ClipConfig):
    dual_clip_c: Optional[float] = None  # cap the loss of negative-advantage tokens at -c*A (c > 1); null = off

    def check(self, at: str) -> None:
        super().check(at)
        require(
            self.dual_clip_c is None or self.dual_clip_c > 1,
            f"{at}.dual_clip_c={self.dual_clip_c} must be > 1 (or null to turn dual-clip off)",
        )


@dataclass
class GspoConfig(ClipConfig):
    clip_eps_low: float = 3e-4  # sequence ratio lower clip: 1 - 3e-4 (the paper's range)
    clip_eps_high: float = 4e-4  # sequence ratio upper clip: 1 + 4e-4


@dataclass
class CispoConfig(ClipConfig):
    clip_eps_low: float = 1.0  # no lower bound on the weight (1 - 1 = 0): the paper tunes only the upper one
    clip_eps_high: float = 4.0  # weight capped at 1 + 4 = 5 (ScaleRL's CISPO setting)


@dataclass
class PairConfig(PartConfig):
    beta: float = 0.1  # the temperature of the pair loss (DPO's beta)

    def check(self, at: str) -> None:
        require(self.beta > 0, f"{at}.beta={self.beta} must be > 0 (the pair loss's temperature, e.g. 0.1)")


@register_policy_loss("ppo_clip", config=PpoClipConfig)
def ppo_clip(logp: torch.Tensor, batch: Trajectories, cfg: PpoClipConfig) -> PolicyLoss:
    """PPO's clipped surrogate per token, with clip-higher (separate low/high ranges) and dual-clip."""
    loss, clipped, log_ratio = clipped_policy_loss(
        logp, batch.old_logp, batch.advantages, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip_c
    )
    return PolicyLoss(loss, clipped, log_ratio)


@register_policy_loss("gspo", config=GspoConfig)
def gspo(logp: torch.Tensor, batch: Trajectories, cfg: GspoConfig) -> PolicyLoss:
    """GSPO: one length-normalised importance ratio per sequence, clipped (use small clip ranges, e.g. 3e-4/4e-4)."""
    loss, clipped, log_ratio = gspo_policy_loss(
        logp, batch.old_logp, batch.advantages, batch.loss_mask, cfg.clip_eps_low, cfg.clip_eps_high
    )
    return PolicyLoss(loss, clipped, log_ratio)


@register_policy_loss("cispo", config=CispoConfig)
def cispo(logp: torch.Tensor, batch: Trajectories, cfg: CispoConfig) -> PolicyLoss:
    """CISPO (MiniMax-M1): the clipped, detached importance weight times -A * logp; clipped tokens keep gradient."""
    return PolicyLoss(*cispo_policy_loss(logp, batch.old_logp, batch.advantages, cfg.clip_eps_low, cfg.clip_eps_high))


@register_policy_loss("importance_sampling")
def importance_sampling(logp: torch.Tensor, batch: Trajectories, cfg: PartConfig) -> PolicyLoss:
    """-A * pi / pi_generator, unclipped: the policy gradient for samples drawn by the generator's distribution."""
    loss, log_ratio = importance_sampling_loss(logp, batch.gen_logp, batch.advantages)
    return PolicyLoss(loss, torch.zeros_like(loss, dtype=torch.bool), log_ratio.detach())


@register_pairwise_loss("dpo", config=PairConfig)
def dpo(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, cfg: PairConfig):
    """DPO's sigmoid loss on pairs (Rafailov et al., 2023), `beta` the temperature."""
    return dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, cfg.beta, "sigmoid")


@register_pairwise_loss("ipo", config=PairConfig)
def ipo(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, cfg: PairConfig):
    """IPO's squared loss on pairs (Azar et al., 2023), regressing the margin to 1 / (2 beta)."""
    return dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, cfg.beta, "ipo")
