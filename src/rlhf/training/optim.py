"""Optimiser helpers every trained model shares: AdamW with an LR schedule, gradient clipping, skipped steps, checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlhf.models.lora import has_adapters, load_adapters, to_model_names
from rlhf.errors import ConfigError, require


MAX_LR = 1.0  # AdamW moves each weight by about lr per step; above this a step overwrites the weights


def check_lr(key: str, lr: float) -> None:
    """ConfigError unless the learning rate ``lr`` (set at ``key``) is a number in (0, `MAX_LR`]: above it, AdamW's
    first step replaces the weights by noise (or overflows float32 and fails mid-step)."""
    require(0 < lr <= MAX_LR, f"{key}={lr} must be in (0, {MAX_LR:g}]: AdamW moves each weight by about lr per step "
                              f"(language models train at 1e-6 to 1e-4, the built-in tiny models at 1e-3)")


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


def make_optimizer(model: torch.nn.Module | list[torch.Tensor], train_cfg, lr: float, total_optimizer_steps: int):
    """AdamW over the trainable parameters (of a module, or a list of tensors such as float32 masters) and its LR
    schedule, from `train.*`. Fused (one kernel for every parameter) when they all live on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad] if isinstance(model, torch.nn.Module) else list(model)
    optimizer = torch.optim.AdamW(
        params,
        lr=lr,
        betas=tuple(train_cfg.adam_betas),
        eps=train_cfg.adam_eps,
        weight_decay=train_cfg.weight_decay,
        fused=True if params and all(p.is_cuda for p in params) else None,
    )
    schedule = lr_lambda(train_cfg.lr_schedule, train_cfg.warmup_steps, total_optimizer_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def clip_gradients(model: torch.nn.Module | list[torch.Tensor], max_grad_norm: float) -> float:
    """Clip the global gradient norm of a module's parameters (or of a list of tensors) when > 0; returns the
    pre-clip norm (non-finite when a gradient is).

    Sharded (FSDP2) parameters give a DTensor norm, reduced over the ranks into the full norm here.
    """
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def clip_and_step(model: torch.nn.Module, optimizer, scheduler, max_grad_norm: float) -> float:
    """Clip, step, advance the schedule, clear grads; returns the pre-clip norm.

    A non-finite norm skips the update entirely (weights, optimiser moments and schedule untouched).
    """
    return step_if_finite(clip_gradients(model, max_grad_norm), optimizer, scheduler)


def step_if_finite(norm: float, optimizer, scheduler) -> float:
    """Step the optimiser and schedule when the (already clipped) gradients' pre-clip ``norm`` is finite, else
    change nothing; clears the gradients either way and returns ``norm``."""
    if math.isfinite(norm):
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def save_trainable(path: Path, model: torch.nn.Module, optimizer, scheduler, state_dict: dict | None = None) -> None:
    """Weights as a Hugging Face folder (safetensors; ``state_dict`` instead of the model's own, such as float32
    masters) plus optimiser and scheduler states."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path / "model", state_dict=state_dict, safe_serialization=True)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, path / "optim.pt")


def load_trainable(path: Path, model: torch.nn.Module, optimizer, scheduler) -> dict[str, torch.Tensor]:
    """Inverse of `save_trainable`; never unpickles arbitrary objects (safetensors, weights_only=True). Returns the
    saved weights under the model's names, as saved (float32 masters stay float32)."""
    weights = {}
    for shard in sorted((path / "model").glob("*.safetensors")):
        weights |= load_file(shard, device=str(next(model.parameters()).device))
    if has_adapters(model):  # the checkpoint holds the adapters only
        load_adapters(model, weights, path)
        weights = to_model_names(weights)
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {name for name in missing if "lm_head" in name and getattr(model.config, "tie_word_embeddings", False)}
        if set(missing) - tied or unexpected:
            raise ConfigError(
                f"checkpoint {path} does not match the model: missing {sorted(set(missing) - tied)[:3]}, unexpected "
                f"{unexpected[:3]}; resume with the model it trained (model.name_or_path as its config.yaml records)"
            )
    state = torch.load(path / "optim.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return weights


def move_optimizer_state(optimizer: torch.optim.Optimizer, to: torch.device | dict) -> dict:
    """Move every tensor of the optimiser's state (Adam moments, step counters), in place.

    ``to``: one device for all, or the dict a previous call returned, to put each tensor back where it was.
    Returns {(param index, key): device before the move}.
    """
    before = {}
    for index, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                before[(index, key)] = value.device
                state[key] = value.to(to.get((index, key), value.device) if isinstance(to, dict) else to)
    return before
