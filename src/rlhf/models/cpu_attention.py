"""Attention of low-precision weights on the CPU, computed in float32 where that is faster.

torch's CPU flash-attention kernel runs slower in bfloat16 than in float32 over the short rows RL often trains on, and
slower in float16 at every length (bench/cpu_attention.py, forward and backward, 2,048 tokens a call: bfloat16 2.2x
at 71 keys, 1.5x at 128, level from 192 to 384, 0.93x at 512; float16 2.7x at 24 keys to 7.7x at 2,048). So packed
training forwards (`rlhf.models.packing`, `rlhf.models.shared_prefix`) of a low-precision model on the CPU cast a
layer's queries, keys and values to float32 for attention alone, and its output back, wherever `MAX_KEYS` says. The
result is attention as float32 computes it, closer to exact than the low-precision kernel's; float32 models, CUDA
and long bfloat16 rows keep their kernel as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# per low-precision dtype, the most keys a query attends for attention to run in float32 on the CPU (None: any number)
MAX_KEYS: dict[torch.dtype, int | None] = {torch.bfloat16: 256, torch.float16: None}


def upcasts(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether attention of ``query`` over ``key`` runs in float32: a dtype of `MAX_KEYS` on the CPU, within its number
    of keys. Shapes: query (..., Q, D), key (..., L, D)."""
    if query.device.type != "cpu" or query.dtype not in MAX_KEYS:
        return False
    most = MAX_KEYS[query.dtype]
    return most is None or key.shape[-2] <= most


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None, **kwargs) -> torch.Tensor:
    """`torch.nn.functional.scaled_dot_product_attention`, in float32 where `upcasts` says and cast back to the
    query's dtype. Shapes: query (R, H, Q, D), key and value (R, Hkv, L, D) -> (R, H, Q, D)."""
    if not upcasts(query, key):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, **kwargs)
    if attn_mask is not None and attn_mask.is_floating_point():  # an additive mask in the weights' dtype
        attn_mask = attn_mask.float()
    out = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=attn_mask, **kwargs)
    return out.to(query.dtype)
