"""Sequence-level advantages for critic-free estimators (GRPO, REINFORCE with a baseline, RLOO)."""

from __future__ import annotations

import torch


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """View (B,) scores as (B/G, G); samples of one prompt are contiguous."""
    if scores.dim() != 1 or scores.numel() % group_size != 0:
        raise ValueError(f"scores of shape {tuple(scores.shape)} cannot be split into groups of {group_size}")
    return scores.view(-1, group_size)


def group_normalized_advantages(
    scores: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: each score minus its group's mean, divided by the group's std unless ``norm_by_std`` is false.

    Shape: scores (B,) with B = prompts * G, groups contiguous -> (B,). The std is the unbiased one;
    a group whose samples all scored the same gets advantage 0.
    """
    if norm_by_std and group_size < 2:
        raise ValueError("GRPO with std normalisation needs at least 2 samples per prompt")
    grouped = _groups(scores, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: each score minus the mean of the other G-1 scores of its prompt. Shape: (B,) -> (B,)."""
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt")
    grouped = _groups(scores, group_size)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others_mean).reshape(-1)


def baseline_advantages(scores: torch.Tensor) -> torch.Tensor:
    """REINFORCE with the batch-mean baseline. Shape: (B,) -> (B,)."""
    return scores - scores.mean()


def to_token_level(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every valid response token its sequence's advantage. Shape: (B,), mask (B, T) -> (B, T)."""
    return advantages.unsqueeze(1) * mask
