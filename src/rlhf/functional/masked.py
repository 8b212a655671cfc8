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


def masked_constant(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Whether every valid entry holds the same value, exactly (True when none is valid). Shape: (B, T) -> scalar bool.

    Read on the device: no host sync."""
    valid = mask.bool()
    high = torch.where(valid, values, torch.full_like(values, float("-inf"))).amax()
    low = torch.where(valid, values, torch.full_like(values, float("inf"))).amin()
    return (high == low) | ~valid.any()


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Scale the valid entries to unit variance (and zero mean unless ``shift_mean`` is false).

    Shape: values, mask (B, T) -> (B, T); entries outside the mask are returned as 0. With fewer than two
    valid entries there is no variance to divide by: they are only centred (or returned as they are). Valid entries
    that are all equal centre to exactly 0: their float mean can be an ulp off the value (0.9, 0.7), and dividing
    that ulp by a variance of ~1e-14 would turn "no signal" into advantages of ~1e-3 that Adam makes a full step.
    """
    mean = masked_mean(values, mask)
    centred = torch.where(masked_constant(values, mask), torch.zeros_like(values), values - mean)
    if mask.sum() < 2:
        return (centred if shift_mean else values) * mask
    var = masked_var(values, mask)
    whitened = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask
