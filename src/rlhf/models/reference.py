"""The reference policy: a frozen model that only scores responses, for the KL term.

A factory registered as kind ``reference`` is called as ``factory(cfg=<reference config>, model_cfg=...,
device=..., temperature=float)`` and returns an object with ``rollout_logprobs(batch, chunk: rows or
rlhf.micro_batches.Budget) -> (B, T)``, logprobs at the generator's sampling ``temperature``.
"""

from __future__ import annotations

import torch

from rlhf.models import packing
from rlhf.models.loading import load_causal_lm
from rlhf.micro_batches import Budget, window_outputs
from rlhf.models.logprobs import logprob_chunk, window_logprobs
from rlhf.registry import register
from rlhf.trajectory import Trajectories


@register("reference", "frozen")
class FrozenReference:
    """Weights from ``reference.name_or_path`` (default: the policy's start), eval mode, no gradients; logprobs at
    ``temperature`` (`generator.temperature`)."""

    def __init__(self, cfg, model_cfg, device: torch.device, temperature: float = 1.0) -> None:
        self.temperature = temperature
        self.chunk = logprob_chunk(model_cfg, device)  # the fused output layer's chunk; 0 = plain logits
        self.share = getattr(model_cfg, "shared_prefix", None)  # rows of one prompt laid out once: True, False, None = where it pays
        path = cfg.name_or_path or model_cfg.name_or_path
        self.model = load_causal_lm(path, model_cfg.dtype, model_cfg.revision, model_cfg.trust_remote_code, device).eval()
        self.model.requires_grad_(False)
        packing.enable(self.model)

    def rollout_logprobs(self, batch: Trajectories, chunk: int | Budget) -> torch.Tensor:
        """Logprobs of the action window, micro batches of ``chunk`` rows (or a `Budget`), no gradients. Shape: (B, T)."""
        return window_outputs(lambda part: window_logprobs(self.model, part, self.temperature, chunk=self.chunk, share=self.share)[0], batch, chunk, share=self.share)
