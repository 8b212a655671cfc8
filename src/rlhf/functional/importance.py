"""Rollout corrections for the gap between the generator's and the trainer's token probabilities.

A generation engine (vLLM, or weights one step behind under an async schedule) samples from a distribution
slightly different from the one the trainer scores. Each correction turns the ratio r_t = pi_trainer / pi_generator
of every action token into a detached weight on that token's policy loss:

- truncated IS per token (TIS): w_t = min(r_t, clip);
- truncated IS per sequence: w_t = min(prod_t r_t, clip), one weight for the whole row;
- masked IS (IcePop): w_t = r_t inside [low, high], 0 outside, so tokens far off carry no gradient;
- geometric-mean rejection: a row whose exp(mean_t log r_t) leaves [low, high] is dropped (w = 0), others w = 1.

Every function takes trainer_logp, generator_logp, mask (B, T) and returns (weights (B, T), flagged (B, T) bool):
weights are 0 outside ``mask``; ``flagged`` marks real tokens the correction changed (truncated, masked or
rejected).
"""

from __future__ import annotations

import torch


def _token_log_ratio(trainer_logp: torch.Tensor, generator_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log r_t, detached, 0 outside the mask (so padding never overflows). Shape: (B, T)."""
    log_ratio = (trainer_logp - generator_logp).detach()
    return torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))


def sequence_log_ratio(trainer_logp: torch.Tensor, generator_logp: torch.Tensor, mask: torch.Tensor, mean: bool) -> torch.Tensor:
    """Per row: sum over action tokens of log r_t (``mean``: divided by the row's token count). Shape: (B, T) -> (B,)."""
    total = _token_log_ratio(trainer_logp, generator_logp, mask).sum(dim=1)
    return total / mask.sum(dim=1).clamp(min=1) if mean else total


def truncated_is_weights(
    trainer_logp: torch.Tensor, generator_logp: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level TIS: ``min(r_t, clip)``; flagged = real tokens whose ratio exceeded ``clip``."""
    real = mask.bool()
    ratio = torch.exp(_token_log_ratio(trainer_logp, generator_logp, mask))
    weights = torch.where(real, ratio.clamp(max=clip), torch.zeros_like(ratio))
    return weights, (ratio > clip) & real


def sequence_truncated_is_weights(
    trainer_logp: torch.Tensor, generator_logp: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level TIS: every token of a row weighs ``min(prod_t r_t, clip)``; flagged = rows over ``clip``.

    The product is taken in log space and capped at log(clip) before exponentiating, so long rows cannot overflow.
    """
    real = mask.bool()
    log_ratio = sequence_log_ratio(trainer_logp, generator_logp, mask, mean=False)
    weight = torch.exp(log_ratio.clamp(max=torch.log(torch.tensor(clip)).item()))
    weights = torch.where(real, weight.unsqueeze(1).expand_as(trainer_logp), torch.zeros_like(trainer_logp))
    return weights, (log_ratio > torch.log(torch.tensor(clip))).unsqueeze(1) & real


def masked_is_weights(
    trainer_logp: torch.Tensor, generator_logp: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """IcePop's masked IS: ``r_t`` where low <= r_t <= high, else 0; flagged = real tokens outside the band."""
    real = mask.bool()
    ratio = torch.exp(_token_log_ratio(trainer_logp, generator_logp, mask))
    inside = (ratio >= low) & (ratio <= high)
    return torch.where(real & inside, ratio, torch.zeros_like(ratio)), real & ~inside


def geometric_rejection_weights(
    trainer_logp: torch.Tensor, generator_logp: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection by the geometric-mean ratio exp(mean_t log r_t): 1 for a row inside [low, high], 0 for every token
    of a row outside it; flagged = the tokens of rejected rows."""
    real = mask.bool()
    geo = torch.exp(sequence_log_ratio(trainer_logp, generator_logp, mask, mean=True))
    keep = ((geo >= low) & (geo <= high)).unsqueeze(1)
    return (real & keep).to(trainer_logp.dtype), real & ~keep
