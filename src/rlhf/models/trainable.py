"""What every trained model shares: AdamW with an LR schedule, gradient clipping, skipped steps, checkpoints."""

from __future__ import annotations

import math
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
    """Clip the global gradient norm (when > 0); returns the pre-clip norm (non-finite when a gradient is).

    Sharded (FSDP2) parameters give a DTensor norm, reduced over the ranks into the full norm here.
    """
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf)
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


def is_share(key: str) -> bool:
    """Loss metrics are each micro batch's share of the mini-batch loss (summed); others are averaged."""
    return key.startswith("loss/") or key == "objective/loss"


class TrainableModel:
    """A model with its optimiser and schedule under a training strategy (`rlhf.distributed.strategies`);
    gradients accumulate over micro batches until `optimizer_step`.

    Weights and optimiser state stay in float32 (a bf16 weight cannot take a 1e-6 step); ``compute_dtype``
    bfloat16 runs the forward passes under autocast instead. ``module`` is what forward passes call: the model,
    or a wrapper around it (the strategy's DDP module or DeepSpeed engine).
    """

    def __init__(
        self, model: torch.nn.Module, train_cfg, lr: float, total_optimizer_steps: int, gradient_checkpointing: bool,
        compute_dtype: torch.dtype = torch.float32, strategy_cfg=None, module: torch.nn.Module | None = None,
    ) -> None:
        from rlhf.config.schema import StrategyConfig
        from rlhf.distributed.strategies import build_strategy

        self.model = model
        self.compute_dtype = compute_dtype
        self.strategy = build_strategy(
            model, module if module is not None else model, train_cfg, lr, total_optimizer_steps, compute_dtype,
            strategy_cfg if strategy_cfg is not None else StrategyConfig(), gradient_checkpointing,
        )
        self.module = self.strategy.module
        self.optimizer, self.scheduler = self.strategy.optimizer, self.strategy.scheduler

    def autocast(self):
        """The context the forward passes run in: bf16 autocast, or nothing."""
        return self.strategy.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of ``loss``, its share of the (global) mini-batch loss."""
        self.strategy.backward(loss)

    def zero_grad(self) -> None:
        """Drop accumulated gradients without stepping (a skipped step)."""
        self.strategy.zero_grad()

    def accumulate(self, estimator, mini, denominator: torch.Tensor, micro_units: int, temperature: float):
        """Forward and backward each micro batch (``micro_units`` units) of ``mini``, this rank's share of a mini batch.

        Returns (finite, metrics). As soon as a loss is non-finite on any rank, every rank stops before that
        backward and returns False (the caller drops the gradients). Metrics named `loss/...` or `objective/loss`
        are summed over micro batches (they are shares of the mini-batch loss); the others are averaged.
        """
        from rlhf.distributed.strategies import all_ranks_true

        metrics: dict[str, float] = {}
        micro_ids = torch.arange(mini.num_units).split(micro_units)
        for ids in micro_ids:
            loss, micro_metrics = self.micro_loss(estimator, mini.select_units(ids), denominator, temperature)
            if not all_ranks_true(bool(torch.isfinite(loss).item())):
                return False, {}  # no backward: a NaN must not reach the gradients
            self.backward(loss)
            for key, value in micro_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + float(value) * (1.0 if is_share(key) else 1.0 / len(micro_ids))
        return True, metrics

    def optimizer_step(self) -> float:
        """Clip, step (unless the norm is non-finite), clear grads; returns the pre-clip gradient norm."""
        return self.strategy.optimizer_step()

    def offload_optimizer(self) -> None:
        """Move the optimiser state to the CPU, freeing the accelerator for generation (schedule=hybrid)."""
        self._offloaded_from = move_optimizer_state(self.optimizer, torch.device("cpu"))

    def reload_optimizer(self) -> None:
        """Put the optimiser state back where `offload_optimizer` found it, before training."""
        move_optimizer_state(self.optimizer, getattr(self, "_offloaded_from", {}))

    def release_cached_memory(self) -> None:
        """Hand the allocator's cached blocks (activations of the last step) back to the device (schedule=hybrid)."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full weights under the HF names on rank 0 (None on other ranks); a collective when sharded."""
        return self.strategy.full_state_dict()

    def save_checkpoint(self, path: Path) -> None:
        self.strategy.save(path)

    def load_checkpoint(self, path: Path) -> None:
        self.strategy.load(path)

    @property
    def lr(self) -> float:
        return self.strategy.lr
