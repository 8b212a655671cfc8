"""The critic: a value model trained alongside the policy (PPO).

A factory registered as kind ``critic`` is called as ``factory(cfg=<critic config>, model_cfg=...,
init_path=str, train_cfg=..., total_optimizer_steps=int, device=...)`` and returns an object with
``values(rollout)`` and the optimisation methods of `TrainableModel`.
"""

from __future__ import annotations

import torch

from rlhf.generators.base import Rollout
from rlhf.models.dtypes import DTYPES
from rlhf.models.trainable import TrainableModel
from rlhf.models.value import load_value_model, response_values
from rlhf.registry import register


@register("critic", "torch")
class TorchCritic(TrainableModel):
    """A value model with its own AdamW optimiser and learning rate (`critic.lr`, default `train.lr`)."""

    def __init__(self, cfg, model_cfg, init_path: str, train_cfg, total_optimizer_steps: int, device: torch.device) -> None:
        self.cfg = cfg
        model = load_value_model(init_path, "float32", None, model_cfg.trust_remote_code, device)
        lr = cfg.lr if cfg.lr is not None else train_cfg.lr
        super().__init__(model, train_cfg, lr, total_optimizer_steps, cfg.gradient_checkpointing, DTYPES[model_cfg.dtype])

    def values(self, rollout: Rollout) -> torch.Tensor:
        """V(s_t) before each response token, with gradients, in float32. Shape: (B, Lr)."""
        with self.autocast():
            return response_values(self.model, rollout)
