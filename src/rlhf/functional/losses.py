"""Policy-gradient losses and how per-token losses are reduced to one number."""

from __future__ import annotations

import torch

from rlhf.functional.masked import masked_sum


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, per token, to be minimised.

    Shape: logp, old_logp, advantages (B, T) -> (loss (B, T), clipped (B, T) bool, log_ratio (B, T)).
    loss = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high)) with r = exp(logp - old_logp);
    ``clipped`` marks tokens where the clipped branch was the larger (its gradient is zero).
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped, log_ratio


def loss_denominator(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What `aggregate_loss` divides by, computed over a whole mini batch so micro batches add up exactly.

    Shape: mask (B, T) -> scalar. token_mean: valid tokens; seq_mean_token_mean: sequences.
    """
    if mode == "token_mean":
        return mask.sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        return torch.tensor(float(mask.shape[0]))
    raise ValueError(f"unknown loss aggregation {mode!r}; choose token_mean or seq_mean_token_mean")


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, denominator: torch.Tensor) -> torch.Tensor:
    """Reduce per-token losses of one micro batch to its share of the mini-batch loss.

    Shape: loss, mask (B, T), denominator scalar (from `loss_denominator` on the mini batch) -> scalar.
    token_mean: sum over valid tokens / denominator. seq_mean_token_mean: each sequence's token mean,
    summed / denominator. Summing the results of all micro batches gives the mini batch's loss.
    """
    if mode == "token_mean":
        return masked_sum(loss, mask) / denominator
    if mode == "seq_mean_token_mean":
        per_seq = masked_sum(loss, mask, dim=1) / mask.sum(1).clamp(min=1)
        return per_seq.sum() / denominator
    raise ValueError(f"unknown loss aggregation {mode!r}; choose token_mean or seq_mean_token_mean")
