"""The trained policy: single-process torch on CPU or one GPU.

A factory registered as kind ``policy`` is called as
``factory(cfg=<policy config>, model_cfg=..., train_cfg=..., total_optimizer_steps=int, device=...)`` and
returns an object with the methods of `TorchPolicy` used by `rlhf.update`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlhf.generators.base import Rollout
from rlhf.models.loading import load_causal_lm
from rlhf.models.logprobs import response_logprobs
from rlhf.registry import register


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):
    """Multiplier of the peak learning rate at each optimiser step: linear warm-up, then constant or linear decay."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "linear":
            remaining = total_steps - warmup_steps
            return max(0.0, 1.0 - (step - warmup_steps) / max(1, remaining))
        return 1.0

    return factor


def make_optimizer(model: torch.nn.Module, train_cfg, lr: float, total_optimizer_steps: int):
    """AdamW over the trainable parameters and its LR schedule, from `train.*`."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=lr,
        betas=tuple(train_cfg.adam_betas),
        eps=train_cfg.adam_eps,
        weight_decay=train_cfg.weight_decay,
    )
    schedule = lr_lambda(train_cfg.lr_schedule, train_cfg.warmup_steps, total_optimizer_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def clip_gradients(model: torch.nn.Module, max_grad_norm: float) -> float:
    """Clip the global gradient norm (when > 0); returns the pre-clip norm (non-finite when a gradient is)."""
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf))


def clip_and_step(model: torch.nn.Module, optimizer, scheduler, max_grad_norm: float) -> float:
    """Clip, step, advance the schedule, clear grads; returns the pre-clip norm.

    A non-finite norm skips the update entirely (weights, optimiser moments and schedule untouched).
    """
    norm = clip_gradients(model, max_grad_norm)
    if math.isfinite(norm):
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def save_trainable(path: Path, model: torch.nn.Module, optimizer, scheduler) -> None:
    """Weights as a Hugging Face folder (safetensors) plus optimiser and scheduler states."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path / "model", safe_serialization=True)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, path / "optim.pt")


def load_trainable(path: Path, model: torch.nn.Module, optimizer, scheduler) -> None:
    """Inverse of `save_trainable`; never unpickles arbitrary objects (safetensors, weights_only=True)."""
    weights = {}
    for shard in sorted((path / "model").glob("*.safetensors")):
        weights |= load_file(shard, device=str(next(model.parameters()).device))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {name for name in missing if "lm_head" in name and getattr(model.config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
    state = torch.load(path / "optim.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])


@register("policy", "torch")
class TorchPolicy:
    """A causal LM with AdamW and an LR schedule; gradients accumulate over micro batches."""

    def __init__(self, cfg, model_cfg, train_cfg, total_optimizer_steps: int, device: torch.device) -> None:
        self.cfg, self.train_cfg = cfg, train_cfg
        self.model = load_causal_lm(
            model_cfg.name_or_path, model_cfg.dtype, model_cfg.revision, model_cfg.trust_remote_code, device
        )
        self.model.train()  # dropout is already 0; train() only matters for modules such as gradient checkpointing
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.optimizer, self.scheduler = make_optimizer(self.model, train_cfg, train_cfg.lr, total_optimizer_steps)

    def logprobs(self, rollout: Rollout, temperature: float, with_entropy: bool = False):
        """(logprobs (B, Lr), entropy or None) with gradients enabled."""
        return response_logprobs(self.model, rollout, temperature, with_entropy)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> float:
        """Clip, step, advance the schedule, clear grads; returns the pre-clip gradient norm."""
        return clip_and_step(self.model, self.optimizer, self.scheduler, self.train_cfg.max_grad_norm)

    def zero_grad(self) -> None:
        """Drop accumulated gradients without stepping (a skipped step)."""
        self.optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self) -> float:
        """Clip the accumulated gradients by `train.max_grad_norm`; returns the pre-clip norm."""
        return clip_gradients(self.model, self.train_cfg.max_grad_norm)

    def step(self) -> None:
        """Apply the (clipped) gradients, advance the LR schedule, clear the gradients."""
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def save_checkpoint(self, path: Path) -> None:
        save_trainable(path, self.model, self.optimizer, self.scheduler)

    def load_checkpoint(self, path: Path) -> None:
        load_trainable(path, self.model, self.optimizer, self.scheduler)

    def export(self, path: Path, tokenizer) -> None:
        """The policy as a plain Hugging Face folder (safetensors, config, tokenizer)."""
        self.model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model weights, as the generator loads them."""
        return self.model.state_dict()
