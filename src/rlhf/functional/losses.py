"""Policy-gradient losses and how per-token losses are reduced to one number."""

from __future__ import annotations

import torch

from rlhf.functional.masked import masked_sum


LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "token_sum")


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, per token, to be minimised.

    Shape: logp, old_logp, advantages (B, T) -> (loss (B, T), clipped (B, T) bool, log_ratio (B, T)).
    loss = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high)) with r = exp(logp - old_logp); separate
    low/high ranges give clip-higher (DAPO). With ``dual_clip_c`` (> 1), tokens with A < 0 are also
    capped at -A * c, bounding the loss when r explodes (dual-clip PPO). ``clipped`` marks tokens whose
    loss came from a clipped branch (their gradient is zero).
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual-clip constant must be > 1, got {dual_clip_c}")
        cap = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped, log_ratio


def gspo_policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    clip_eps_low: float, clip_eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO's clipped surrogate with one ratio per sequence (Zheng et al., 2025), per token, to be minimised.

    Shape: logp, old_logp, advantages, mask (B, T) -> (loss (B, T), clipped (B, T) bool, log_ratio (B, T)).
    s_i = exp(mean over the sequence's tokens of (logp - old_logp)), the length-normalised sequence ratio. Each
    token carries s_i (value) with the gradient of its own logp (GSPO-token: s_i,t = sg[s_i] * p_t / sg[p_t]),
    so loss_t = max(-A_t * s_i,t, -A_t * clip(s_i,t, 1 - eps_low, 1 + eps_high)). ``log_ratio`` is log s_i at
    every token of the sequence.
    """
    seq_log_ratio = masked_sum(logp - old_logp, mask, dim=1) / mask.sum(dim=1).clamp(min=1)
    log_ratio = seq_log_ratio.detach().unsqueeze(1) + logp - logp.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped, log_ratio.detach().expand_as(logp)


def cispo_policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_eps_low: float, clip_eps_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO's loss per token, to be minimised (MiniMax-M1, Chen et al., 2025, arXiv:2506.13585).

    Shape: logp, old_logp, advantages (B, T) -> (loss (B, T), clipped (B, T) bool, log_ratio (B, T)).
    loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logp_t with r_t = exp(logp_t - old_logp_t): the
    importance weight is clipped and detached, so the gradient -w_t * A_t * grad logp_t never vanishes. A clipped
    token (``clipped``) still gets gradient, unlike PPO's clip, which zeroes it; ``log_ratio`` is log r_t, detached.
    """
    log_ratio = (logp - old_logp).detach()
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return -weight * advantages * logp, weight != ratio, log_ratio


def importance_sampling_loss(logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unclipped importance-weighted policy gradient, per token, to be minimised: -A * pi / pi_sampler.

    Shape: logp, sampler_logp (the generator's), advantages (B, T) -> (loss (B, T), log_ratio (B, T)). The
    gradient is -A * ratio * grad log pi: REINFORCE corrected for samples drawn by another distribution.
    """
    log_ratio = logp - sampler_logp
    return -advantages * torch.exp(log_ratio), log_ratio


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_eps: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's value loss per token: 0.5 * max((V - R)^2, (V_clipped - R)^2). Shape: (B, T) -> ((B, T), (B, T) bool).

    V_clipped = V_old + clip(V - V_old, -eps, eps); with ``clip_eps`` None the plain squared error is used.
    The bool tensor marks tokens where the clipped branch was the larger.
    """
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def dpo_loss(
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO loss per pair from summed sequence logprobs. Shape: each (P,) -> (loss (P,), chosen reward (P,), rejected reward (P,)).

    h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r)).
    sigmoid: -log sigmoid(beta * h) (Rafailov et al.); ipo: (h - 1 / (2 beta))^2 (Azar et al.).
    The implicit rewards are beta * (log pi - log ref) of each side, detached.
    """
    chosen_ratio = chosen_logp - ref_chosen_logp
    rejected_ratio = rejected_logp - ref_rejected_logp
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        loss = -torch.nn.functional.logsigmoid(beta * h)
    elif loss_type == "ipo":
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss type {loss_type!r}; choose sigmoid or ipo")
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(LOSS_AGGREGATIONS)}")


def loss_denominator(mask: torch.Tensor, mode: str, norm_constant: float = 1.0) -> torch.Tensor:
    """What `aggregate_loss` divides by, computed over a whole mini batch so micro batches add up exactly.

    Shape: mask (B, T) -> scalar. token_mean: valid tokens; seq_mean_token_mean and seq_mean_token_sum:
    sequences; seq_mean_token_sum_norm: sequences * ``norm_constant`` (Dr.GRPO divides every sequence's
    token sum by the same constant, e.g. the generation budget, instead of its own length); token_sum: 1 (the
    mini batch's summed token losses, as Tinker's loss functions return them).
    """
    _check_mode(mode)
    if mode == "token_mean":
        return mask.sum().clamp(min=1)
    if mode == "token_sum":
        return torch.ones((), dtype=mask.dtype, device=mask.device)
    sequences = torch.tensor(float(mask.shape[0]))
    return sequences * norm_constant if mode == "seq_mean_token_sum_norm" else sequences


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, denominator: torch.Tensor) -> torch.Tensor:
    """Reduce per-token losses of one micro batch to its share of the mini-batch loss.

    Shape: loss, mask (B, T), denominator scalar (from `loss_denominator` on the mini batch) -> scalar.
    token_mean, seq_mean_token_sum(_norm), token_sum: sum over valid tokens / denominator. seq_mean_token_mean:
    each sequence's token mean, summed / denominator. Summing over micro batches gives the mini batch's loss.
    """
    _check_mode(mode)
    if mode == "seq_mean_token_mean":
        per_seq = masked_sum(loss, mask, dim=1) / mask.sum(1).clamp(min=1)
        return per_seq.sum() / denominator
    return masked_sum(loss, mask) / denominator
