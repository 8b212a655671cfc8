"""Teacher-forced logprobs of rollout responses under a causal LM."""

from __future__ import annotations

import torch

from rlhf import functional as F
from rlhf.generators.base import Rollout


def response_logits(model: torch.nn.Module, rollout: Rollout, temperature: float) -> torch.Tensor:
    """Logits that predict each response token, divided by the sampling temperature. Shape: (B, Lr, V)."""
    input_ids, attention_mask, position_ids = rollout.model_inputs()
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits
    query_len = rollout.query_ids.shape[1]
    response_len = rollout.response_ids.shape[1]
    # the token at position i is predicted by the logits at position i - 1
    return logits[:, query_len - 1 : query_len - 1 + response_len].float() / temperature


def response_logprobs(
    model: torch.nn.Module, rollout: Rollout, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs (B, Lr), entropy (B, Lr) or None) of each response token; 0 outside the response mask."""
    logits = response_logits(model, rollout, temperature)
    logp = F.logprobs_from_logits(logits, rollout.response_ids) * rollout.response_mask
    entropy = F.entropy_from_logits(logits) * rollout.response_mask if with_entropy else None
    return logp, entropy
