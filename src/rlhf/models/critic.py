"""The critic: a value model trained alongside the policy (PPO).

A factory registered as kind ``critic`` is called as ``factory(cfg=<critic config>, model_cfg=...,
init_path=str, train_cfg=..., total_optimizer_steps=int, device=...)`` and returns an object with
``values(rollout)``, ``backward(loss)`` and ``optimizer_step()``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf.generators.base import Rollout
from rlhf.models.policy import clip_and_step, clip_gradients, load_trainable, make_optimizer, save_trainable
from rlhf.models.value import load_value_model, response_values
from rlhf.registry import register


@register("critic", "torch")
class TorchCritic:
    """A value model with its own AdamW optimiser and learning rate (`critic.lr`, default `train.lr`)."""

    def __init__(self, cfg, model_cfg, init_path: str, train_cfg, total_optimizer_steps: int, device: torch.device) -> None:
        self.cfg = cfg
        self.model = load_value_model(init_path, model_cfg.dtype, None, model_cfg.trust_remote_code, device)
        self.model.train()
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        lr = cfg.lr if cfg.lr is not None else train_cfg.lr
        self.optimizer, self.scheduler = make_optimizer(self.model, train_cfg, lr, total_optimizer_steps)
        self.max_grad_norm = train_cfg.max_grad_norm

    def values(self, rollout: Rollout) -> torch.Tensor:
        """V(s_t) before each response token, with gradients. Shape: (B, Lr)."""
        return response_values(self.model, rollout)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> float:
        """Clip, step, advance the schedule, clear grads; returns the pre-clip gradient norm."""
        return clip_and_step(self.model, self.optimizer, self.scheduler, self.max_grad_norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self) -> float:
        return clip_gradients(self.model, self.max_grad_norm)

    def step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def save_checkpoint(self, path: Path) -> None:
        save_trainable(path, self.model, self.optimizer, self.scheduler)

    def load_checkpoint(self, path: Path) -> None:
        load_trainable(path, self.model, self.optimizer, self.scheduler)
