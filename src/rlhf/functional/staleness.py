"""Per-token policy versions under a streaming schedule: how stale each trained token is, and which are too stale.

A token's version is the policy version that sampled it (a response may span several versions when weights load
mid-generation). Its staleness at training time is ``trainer_version - version``.
"""

from __future__ import annotations

import torch


def token_staleness(token_versions: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """Versions between each token's sampler and the trainer. Shape: (B, T) long -> (B, T) long."""
    return trainer_version - token_versions


def fresh_enough(token_versions: torch.Tensor, mask: torch.Tensor, trainer_version: int, max_gap: int | None) -> torch.Tensor:
    """``mask`` without the tokens sampled more than ``max_gap`` versions before ``trainer_version`` (None keeps every
    token). Shapes: token_versions (B, T) long, mask (B, T) float -> (B, T) float."""
    if max_gap is None:
        return mask
    return mask * (token_staleness(token_versions, trainer_version) <= max_gap).to(mask.dtype)


def versions_per_row(token_versions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Distinct policy versions among each row's tokens (0 for a row without any). Shapes: (B, T), (B, T) -> (B,) long."""
    real = mask.bool()
    big = torch.iinfo(token_versions.dtype).max
    ordered = torch.where(real, token_versions, torch.full_like(token_versions, big)).sort(dim=1).values
    changes = (ordered[:, 1:] != ordered[:, :-1]) & (ordered[:, 1:] != big)
    return changes.sum(dim=1) + real.any(dim=1).long()


def oldest_version(token_versions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The version of each row's oldest token (a row without tokens: the largest version seen). Shapes: (B, T), (B, T) -> (B,)."""
    big = int(token_versions.max()) if token_versions.numel() else 0
    return torch.where(mask.bool(), token_versions, torch.full_like(token_versions, big)).min(dim=1).values
