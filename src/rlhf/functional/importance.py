"""Truncated importance sampling for the gap between the generator's and the trainer's token probabilities.

A generation engine (vLLM, or weights one step behind under an async schedule) samples from a distribution
slightly different from the one the trainer scores. Weighting each token's policy-gradient loss by
``min(pi_trainer / pi_generator, clip)`` corrects that, and the truncation bounds the variance (TIS).
"""

from __future__ import annotations

import torch


def truncated_is_weights(
    trainer_logp: torch.Tensor, generator_logp: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, clipped), both (B, T): ``min(exp(trainer_logp - generator_logp), clip)`` per token, 0 outside
    ``mask``, detached; ``clipped`` marks real tokens whose ratio exceeded ``clip``.

    Shapes: trainer_logp, generator_logp, mask (B, T).
    """
    log_ratio = (trainer_logp - generator_logp).detach()
    real = mask.bool()
    ratio = torch.exp(torch.where(real, log_ratio, torch.zeros_like(log_ratio)))
    clipped = (ratio > clip) & real
    weights = torch.where(real, ratio.clamp(max=clip), torch.zeros_like(ratio))
    return weights, clipped
