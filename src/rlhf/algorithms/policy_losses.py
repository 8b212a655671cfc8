"""Policy losses, registered by name (`algorithm.policy_loss`). The math is in `rlhf.functional`.

A per-token loss takes the trained policy's logprobs and the micro batch; a pairwise one (DPO, IPO) takes summed
sequence logprobs of (chosen, rejected) pairs. See `rlhf.algorithms.base` for the signatures.
"""

from __future__ import annotations

import torch

from rlhf.algorithms.base import PolicyLoss, register_policy_loss
from rlhf.functional import cispo_policy_loss, clipped_policy_loss, dpo_loss, gspo_policy_loss, importance_sampling_loss
from rlhf.trajectory import Trajectories


@register_policy_loss("ppo_clip", config_keys=("clip_eps_low", "clip_eps_high", "dual_clip_c"))
def ppo_clip(logp: torch.Tensor, batch: Trajectories, cfg) -> PolicyLoss:
    """PPO's clipped surrogate per token, with clip-higher (separate low/high ranges) and dual-clip."""
    loss, clipped, log_ratio = clipped_policy_loss(
        logp, batch.old_logp, batch.advantages, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip_c
    )
    return PolicyLoss(loss, clipped, log_ratio)


@register_policy_loss("gspo", config_keys=("clip_eps_low", "clip_eps_high"))
def gspo(logp: torch.Tensor, batch: Trajectories, cfg) -> PolicyLoss:
    """GSPO: one length-normalised importance ratio per sequence, clipped (use small clip ranges, e.g. 3e-4/4e-4)."""
    loss, clipped, log_ratio = gspo_policy_loss(
        logp, batch.old_logp, batch.advantages, batch.loss_mask, cfg.clip_eps_low, cfg.clip_eps_high
    )
    return PolicyLoss(loss, clipped, log_ratio)


@register_policy_loss("cispo", config_keys=("clip_eps_low", "clip_eps_high"))
def cispo(logp: torch.Tensor, batch: Trajectories, cfg) -> PolicyLoss:
    """CISPO (MiniMax-M1): the clipped, detached importance weight times -A * logp; clipped tokens keep gradient."""
    return PolicyLoss(*cispo_policy_loss(logp, batch.old_logp, batch.advantages, cfg.clip_eps_low, cfg.clip_eps_high))


@register_policy_loss("importance_sampling")
def importance_sampling(logp: torch.Tensor, batch: Trajectories, cfg) -> PolicyLoss:
    """-A * pi / pi_generator, unclipped: the policy gradient for samples drawn by the generator's distribution."""
    loss, log_ratio = importance_sampling_loss(logp, batch.gen_logp, batch.advantages)
    return PolicyLoss(loss, torch.zeros_like(loss, dtype=torch.bool), log_ratio.detach())


@register_policy_loss("dpo", pairwise=True)
def dpo(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta: float):
    """DPO's sigmoid loss on pairs (Rafailov et al., 2023), `algorithm.beta` the temperature."""
    return dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta, "sigmoid")


@register_policy_loss("ipo", pairwise=True)
def ipo(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta: float):
    """IPO's squared loss on pairs (Azar et al., 2023), regressing the margin to 1 / (2 beta)."""
    return dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta, "ipo")
