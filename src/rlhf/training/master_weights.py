"""Low-precision weights with float32 master copies, as the large trainers keep them.

The model computes in bf16 (weights, activations, norms: no autocast, no per-micro-batch casts); the optimiser owns a
float32 copy of each trained parameter. Each backward's bf16 gradient is added into the master's float32 gradient the
moment autograd has accumulated it (a post-accumulate-grad hook) and dropped, so gradients accumulate over micro
batches in float32 and no bf16 gradient outlives its backward. The optimiser steps the masters, which
`copy_to_weights` copies into the bf16 weights once per optimiser step.

(One multi-tensor add after each backward instead of the hooks was measured slower on an H100, bench/GPU.md: torch's
multi-tensor add falls back to one kernel per tensor for float32 += bf16, and the first micro batch then pays a zero
fill and an add where the hook pays one cast.)
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
        self.hooks = [p.register_post_accumulate_grad_hook(self._into(m)) for p, m in zip(self.params, self.masters)]

    @staticmethod
    def _into(master: torch.Tensor):
        """The hook of one parameter: its bf16 gradient into ``master``'s float32 one (a cast at the first micro batch
        of an optimiser step, an add after), then dropped."""

        def accumulate(param: torch.Tensor) -> None:
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None

        return accumulate

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
