"""The reference policy: a frozen model that only scores responses, for the KL term.

A factory registered as kind ``reference`` is called as ``factory(cfg=<reference config>, model_cfg=...,
device=...)`` and returns an object with ``rollout_logprobs(batch, temperature, chunk: rows or rlhf.micro_batches.Budget) -> (B, T)``.
"""

from __future__ import annotations

import torch

from rlhf.models import packing
from rlhf.models.loading import load_causal_lm
from rlhf.micro_batches import Budget, window_outputs
from rlhf.models.logprobs import window_logprobs
from rlhf.registry import register
from rlhf.trajectory import Trajectories


@register("reference", "frozen")
class FrozenReference:
    """Weights from ``reference.name_or_path`` (default: the policy's start), eval mode, no gradients."""

    def __init__(self, cfg, model_cfg, device: torch.device) -> None:
        path = cfg.name_or_path or model_cfg.name_or_path
        self.model = load_causal_lm(path, model_cfg.dtype, model_cfg.revision, model_cfg.trust_remote_code, device).eval()
        self.model.requires_grad_(False)
        packing.enable(self.model)

    def rollout_logprobs(self, batch: Trajectories, temperature: float, chunk: int | Budget) -> torch.Tensor:
        """Logprobs of the action window, micro batches of ``chunk`` rows (or a `Budget`), no gradients. Shape: (B, T)."""
        return window_outputs(lambda part: window_logprobs(self.model, part, temperature)[0], batch, chunk)
