"""The critic: a value model trained alongside the policy (PPO).

A factory registered as kind ``critic`` is called as ``factory(cfg=<critic config>, model_cfg=...,
init_path=str, train_cfg=..., total_optimizer_steps=int, device=...)`` and returns an object with
``values(rollout)``, ``rollout_values(rollout, chunk)``, ``micro_loss`` and the optimisation methods of
`TrainableModel`.
"""

from __future__ import annotations

import torch

from rlhf.generators.base import Rollout
from rlhf.models.dtypes import DTYPES
from rlhf.models.trainable import TrainableModel
from rlhf.models.value import ValueModule, load_value_model, response_values
from rlhf.registry import register


@register("critic", "torch")
class TorchCritic(TrainableModel):
    """A value model with its own AdamW optimiser and learning rate (`critic.lr`, default `train.lr`)."""

    def __init__(self, cfg, model_cfg, init_path: str, train_cfg, total_optimizer_steps: int, device: torch.device) -> None:
        self.cfg = cfg
        model = load_value_model(init_path, "float32", None, model_cfg.trust_remote_code, device)
        lr = cfg.lr if cfg.lr is not None else train_cfg.lr
        super().__init__(
            model, train_cfg, lr, total_optimizer_steps, cfg.gradient_checkpointing, DTYPES[model_cfg.dtype],
            cfg.strategy, module=ValueModule(model),
        )

    def values(self, rollout: Rollout) -> torch.Tensor:
        """V(s_t) before each response token, with gradients, in float32. Shape: (B, Lr)."""
        with self.autocast():
            return response_values(self.module, rollout)

    @torch.no_grad()
    def rollout_values(self, rollout: Rollout, chunk: int) -> torch.Tensor:
        """`values` without gradients, ``chunk`` rows per forward. Shape: (B, Lr)."""
        return torch.cat([self.values(part) for part in rollout.chunks(chunk)])

    def micro_loss(self, estimator, micro, denominator: torch.Tensor, temperature: float):
        """(the estimator's weighted value loss of micro batch ``micro``, its metrics), with gradients."""
        return estimator.value_loss(micro, self.values(micro.rollout), denominator)
