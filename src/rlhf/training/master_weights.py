"""Low-precision weights with float32 master copies, as the large trainers keep them.

The model computes in bf16 (weights, activations, norms: no autocast, no per-micro-batch casts); the optimiser owns a
float32 copy of each trained parameter. After each backward `accumulate` adds the bf16 gradients into the masters'
float32 gradients (one multi-tensor add) and drops them, so gradients accumulate over micro batches in float32 and no
bf16 gradient outlives its backward. The optimiser steps the masters, which `copy_to_weights` copies into the bf16
weights once per optimiser step.
"""

from __future__ import annotations

import torch


class MasterWeights:
    """Float32 masters of ``module``'s trained parameters; casts ``module`` to ``dtype`` in place.

    ``masters[i]`` belongs to ``params[i]`` (`module.parameters()` order, trained ones only): the optimiser is built
    over ``masters``.
    """

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        module.to(dtype)  # in place: the same Parameter objects now hold bf16 data

    def accumulate(self) -> None:
        """The bf16 gradients of the last backward into the masters' float32 gradients (allocated at the first micro
        batch of an optimiser step), then dropped. A parameter the backward did not reach adds nothing."""
        pairs = [(m, p.grad) for m, p in zip(self.masters, self.params) if p.grad is not None]
        for master, _ in pairs:
            if master.grad is None:
                master.grad = torch.zeros_like(master)
        if pairs:
            torch._foreach_add_([m.grad for m, _ in pairs], [g for _, g in pairs])
        for param in self.params:
            param.grad = None

    def copy_to_weights(self) -> None:
        """The masters into the low-precision weights (after an optimiser step, or a checkpoint load)."""
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)

    def zero_grad(self) -> None:
        for master, param in zip(self.masters, self.params):
            master.grad = None
            param.grad = None

    def by_name(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """{state-dict name: master} for every name under which ``module`` holds a trained parameter (tied weights
        under each of their names)."""
        index = {id(p): m for p, m in zip(self.params, self.masters)}
        return {name: index[id(t)] for name, t in module.state_dict(keep_vars=True).items() if id(t) in index}

    def state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``module``'s state dict with the trained parameters as their float32 masters (what a checkpoint keeps)."""
        masters = self.by_name(module)
        return {name: masters.get(name, t).detach() for name, t in module.state_dict().items()}

    def load(self, module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        """Masters from ``weights`` (float32, by state-dict name) where given, then into the weights."""
        with torch.no_grad():
            for name, master in self.by_name(module).items():
                if name in weights:
                    master.copy_(weights[name])
        self.copy_to_weights()
