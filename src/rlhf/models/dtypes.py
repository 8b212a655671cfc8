"""The dtypes `model.dtype` may name, and what tensors of them weigh."""

from __future__ import annotations

from typing import Iterable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the ``tensors`` hold (a model's parameters, a state dict's values, a weight push)."""
    return sum(t.numel() * t.element_size() for t in tensors)
