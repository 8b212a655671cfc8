"""What every trained model shares: AdamW with an LR schedule, gradient clipping, skipped steps, checkpoints."""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors.torch import load_file


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


class TrainableModel:
    """A model with its optimiser and schedule; gradients accumulate over micro batches until `step`.

    Weights and optimiser state stay in float32 (a bf16 weight cannot take a 1e-6 step); ``compute_dtype``
    bfloat16 runs the forward passes under autocast instead.
    """

    def __init__(
        self, model: torch.nn.Module, train_cfg, lr: float, total_optimizer_steps: int, gradient_checkpointing: bool,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.compute_dtype = compute_dtype
        self.model.train()  # dropout is already 0; train() only matters for modules such as gradient checkpointing
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.max_grad_norm = train_cfg.max_grad_norm
        self.optimizer, self.scheduler = make_optimizer(self.model, train_cfg, lr, total_optimizer_steps)

    def autocast(self):
        """The context the forward passes run in: bf16 autocast, or nothing for float32."""
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=next(self.model.parameters()).device.type, dtype=self.compute_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_gradients(self) -> float:
        """Clip the accumulated gradients by `train.max_grad_norm`; returns the pre-clip norm."""
        return clip_gradients(self.model, self.max_grad_norm)

    def step(self) -> None:
        """Apply the (clipped) gradients, advance the LR schedule, clear the gradients."""
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def zero_grad(self) -> None:
        """Drop accumulated gradients without stepping (a skipped step)."""
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        """Clip, step (unless the norm is non-finite), clear grads; returns the pre-clip gradient norm."""
        return clip_and_step(self.model, self.optimizer, self.scheduler, self.max_grad_norm)

    def save_checkpoint(self, path: Path) -> None:
        save_trainable(path, self.model, self.optimizer, self.scheduler)

    def load_checkpoint(self, path: Path) -> None:
        load_trainable(path, self.model, self.optimizer, self.scheduler)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]
