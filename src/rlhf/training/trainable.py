"""What every trained model shares: AdamW with an LR schedule, gradient clipping, skipped steps, checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf.training.strategies import build_strategy, shard_units
from rlhf.errors import ConfigError
from rlhf.models.loading import meta_causal_lm
from rlhf.parts import Part
from rlhf.training.optim import move_optimizer_state


class TrainableModel:
    """A model with its optimiser and schedule under a training strategy (`rlhf.training.strategies`);
    gradients accumulate over micro batches until `optimizer_step`.

    Weights and optimiser state stay in float32 (a bf16 weight cannot take a 1e-6 step); ``compute_dtype``
    bfloat16 runs the forward passes under autocast instead. ``strategy`` is the part the model's `*.strategy` node chose.
    ``module`` is what forward passes call: the model, or a wrapper around it (the strategy's DDP module or DeepSpeed
    engine).
    """

    def __init__(
        self, model: torch.nn.Module, train_cfg, lr: float, total_optimizer_steps: int, gradient_checkpointing: bool,
        compute_dtype: torch.dtype, strategy: Part, module: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.compute_dtype = compute_dtype
        self.strategy = build_strategy(
            model, module if module is not None else model, train_cfg, lr, total_optimizer_steps, compute_dtype,
            strategy, gradient_checkpointing,
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

    def shares(self, fn, mini, *args) -> list:
        """``[fn(self, mini, *args)]``: the one rank's share of a mini batch is all of it (`RemoteTrainer.shares`
        splits a mini batch over the ranks of a Ray group)."""
        return [fn(self, mini, *args)]

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


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks `policy.compile` compiles: HF's `_no_split_modules`, the ones FSDP2 shards. ConfigError when the
    model names none."""
    blocks = shard_units(model)
    if not blocks:
        raise ConfigError(
            f"policy.compile: {type(model).__name__} names no repeated decoder blocks (`_no_split_modules`) to "
            "compile; set policy.compile=false"
        )
    return blocks


def check_compilable(policy_cfg, model_cfg) -> None:
    """With `policy.compile`, the `decoder_blocks` ConfigError before any weights load: the model is built on the meta
    device from its config."""
    if not policy_cfg.compile:
        return
    decoder_blocks(meta_causal_lm(model_cfg))


def compile_blocks(model: torch.nn.Module, activation_memory_budget: float | None = None) -> int:
    """`torch.compile` each decoder block of ``model`` (`policy.compile`) in place (`nn.Module.compile`: weight names,
    checkpoints and weight pushes unchanged), with dynamic shapes, so micro batches of new row counts and lengths
    reuse the graphs (each grad mode compiles its own, once; a model that packs its micro batches runs every training
    forward in one form, one row included; one that does not compiles once more for one row and for no padding).
    Fuses the per-token work between the matrix products (norms, rotary, activations), most of a small model's
    step. ``activation_memory_budget`` (`policy.activation_memory_budget`): the share of the blocks' activations their
    graphs keep for the backward, for these blocks only. Returns the number of blocks compiled."""
    blocks = decoder_blocks(model)
    for block in blocks:
        block.compile(dynamic=True)
        if activation_memory_budget is not None:
            block._compiled_call_impl = within_budget(block._compiled_call_impl, activation_memory_budget)
    return len(blocks)


def within_budget(compiled, budget: float):
    """``compiled`` (a compiled call) run with torch's activation memory budget set to ``budget``: the graph splits
    forward from backward when first called, so the budget is in force then, and only for this call, not for other
    compiled code in the process."""

    def call(*args, **kwargs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compiled(*args, **kwargs)

    return call
