"""Teacher-forced logprobs of trajectories' action windows under a causal LM."""

from __future__ import annotations

import inspect

import torch

from rlhf.functional import entropy_from_logits, logprobs_from_logits
from rlhf.trajectory import Trajectories


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether the causal LM (or the DDP / DeepSpeed wrapper around it) takes `logits_to_keep`, computing the output
    layer for the last positions only."""
    inner = getattr(model, "module", model)
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def window_logits(model: torch.nn.Module, batch: Trajectories, temperature: float) -> torch.Tensor:
    """Logits that predict each token of the action window, divided by the sampling temperature. Shape: (B, T, V).

    The whole row runs through the model; the output layer (a vocabulary-sized matmul) runs for the window only
    when the model allows it, and the float logits are kept for the window only.
    """
    input_ids, attention_mask, position_ids = batch.model_inputs()
    start, width = batch.window_start, batch.loss_mask.shape[1]
    # the token at position i is predicted by the logits at position i - 1: the window needs positions
    # start - 1 .. L - 2, i.e. the last width + 1 positions without the very last
    keep = {"logits_to_keep": width + 1} if keeps_logits(model) else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **keep).logits
    window = logits[:, :-1] if keep else logits[:, start - 1 : start - 1 + width]
    # in the model's dtype at temperature 1 (the log-softmax upcasts), else divided in float32
    return window if temperature == 1.0 else window.float() / temperature


def window_logprobs(
    model: torch.nn.Module, batch: Trajectories, temperature: float, with_entropy: bool = False, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs (B, T), entropy (B, T) or None) of each window token; 0 outside the loss mask. ``entropy_grad=False``
    computes the entropy outside the autograd graph (a metric only: no (B, T, V) softmax kept for the backward)."""
    logits = window_logits(model, batch, temperature)
    logp = logprobs_from_logits(logits, batch.window_ids) * batch.loss_mask
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits) * batch.loss_mask
    return logp, entropy


@torch.no_grad()
def in_chunks(fn, batch: Trajectories, size: int):
    """``fn`` on consecutive row chunks of at most ``size`` rows, without gradients; outputs concatenated by row.

    ``fn`` returns a tensor or a tuple of tensors (a None stays None).
    """
    parts = [fn(part) for part in batch.chunks(size)]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return tuple(None if column[0] is None else torch.cat(column) for column in zip(*parts))
