"""Per-token log-probabilities and entropies from logits."""

from __future__ import annotations

import torch


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label, in float32 (bf16 logits are upcast inside the kernel, not copied first).

    Shape: logits (B, T, V), labels (B, T) -> (B, T).
    """
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    return torch.gather(logp, -1, labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's distribution, in nats. Shape: (B, T, V) -> (B, T).

    Tokens masked to -inf contribute 0 (the limit of p log p), not NaN.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.special.entr(probs).sum(-1)
