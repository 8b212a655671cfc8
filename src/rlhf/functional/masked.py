"""Reductions over the valid (mask == 1) entries of a tensor."""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set. Shape: values, mask (B, T) -> scalar, or (B,) with dim=1.

    Entries outside the mask are dropped, not multiplied by 0, so inf or NaN padding cannot leak in.
    """
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set; 0 where nothing is set. Shape as `masked_sum`."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid entries. Shape: values, mask (B, T) -> scalar."""
    mean = masked_mean(values, mask)
    sq = masked_mean((values - mean) ** 2, mask)
    count = mask.sum()
    if unbiased:
        if count < 2:
            raise ValueError(f"unbiased variance needs at least 2 valid entries, got {int(count)}")
        sq = sq * count / (count - 1)
    return sq


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Scale the valid entries to unit variance (and zero mean unless ``shift_mean`` is false).

    Shape: values, mask (B, T) -> (B, T); entries outside the mask are returned as 0. With fewer than two
    valid entries there is no variance to divide by: they are only centred (or returned as they are).
    """
    mean = masked_mean(values, mask)
    if mask.sum() < 2:
        return ((values - mean) if shift_mean else values) * mask
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask
