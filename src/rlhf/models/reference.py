"""The reference policy: a frozen model that only scores responses, for the KL term.

A factory registered as kind ``reference`` is called as ``factory(cfg=<reference config>, model_cfg=...,
device=...)`` and returns an object with ``logprobs(rollout, temperature) -> (B, Lr)``.
"""

from __future__ import annotations


import torch

from rlhf.generators.base import Rollout
from rlhf.models.loading import load_causal_lm
from rlhf.models.logprobs import response_logprobs
from rlhf.registry import register


@register("reference", "frozen")
class FrozenReference:
    """Weights from ``reference.name_or_path`` (default: the policy's start), eval mode, no gradients."""

    def __init__(self, cfg, model_cfg, device: torch.device) -> None:
        path = cfg.name_or_path or model_cfg.name_or_path
        self.model = load_causal_lm(path, model_cfg.dtype, model_cfg.revision, model_cfg.trust_remote_code, device).eval()
        self.model.requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, rollout: Rollout, temperature: float) -> torch.Tensor:
        return response_logprobs(self.model, rollout, temperature)[0]

    def rollout_logprobs(self, rollout: Rollout, temperature: float, chunk: int) -> torch.Tensor:
        """`logprobs`, ``chunk`` rows per forward. Shape: (B, Lr)."""
        return torch.cat([self.logprobs(part, temperature) for part in rollout.chunks(chunk)])
