"""The dtypes `model.dtype` may name, and what tensors of them weigh."""

from __future__ import annotations

from typing import Iterable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the ``tensors`` hold (a model's parameters, a state dict's values, a weight push)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def cpu_computes_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic (oneDNN's AVX512-BF16 or AMX kernels), which `model.dtype=bfloat16` on
    the CPU needs to be anything but an emulation."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
