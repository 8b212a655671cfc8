"""The hf generator's attention: grouped-query decode steps without copying the KV cache to every query head, and
prompt passes in packed rows.

transformers' SDPA path repeats each key/value head for its query heads (`repeat_kv`) whenever an attention mask is
given, which every batched decode step gives (left padding; the static decode's preallocated columns): per layer
and step a copy of the whole cache, `num_attention_heads / num_key_value_heads` times over (7x for Qwen2.5-0.5B).
One query token needs no copy: the query heads that share a key/value head are that head's query rows, so one SDPA
call over (rows, kv heads, group, head dim) against the cache as it is gives the same attention, exactly.

A prompt pass that carries packing arguments (the static decode's, `rlhf.generators.static_decode`) attends inside
each packed row (`rlhf.models.packing.packed_attention`). Other prompt passes and training forwards (more than one
query token) go to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlhf.models.packing import packed_attention

NAME = "rlhf_grouped_sdpa"  # the attention implementation's registered name


def grouped_sdpa(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; for one query token of a grouped-query layer, each key/value head attended by its
    query heads as query rows. Shapes: query (B, H, Q, D), key/value (B, Hkv, L, D), attention_mask (B, 1, Q, L)
    boolean or additive -> (B, Q, H, D)."""
    if kwargs.get("rows_index") is not None:  # prompts packed end to end
        return packed_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    rows, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    if queries != 1 or kv_heads == heads or dropout > 0 or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)  # query head h reads key/value head h // group
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # it takes the masks SDPA takes


def grouped(config) -> bool:
    """Whether a model of ``config`` has grouped-query attention (fewer key/value heads than query heads)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads is not None and kv_heads < heads


def use_generator_attention(model) -> bool:
    """Switch ``model`` (a generator's own copy) from SDPA to `grouped_sdpa`; whether it did. For a model without
    grouped-query attention it changes only what packed prompt passes can do. Any other attention implementation
    (eager, flash) is left as it is."""
    if model.config._attn_implementation != "sdpa":
        return False
    if not getattr(model, "_can_set_attn_implementation", lambda: False)():  # remote code may fix its attention
        return False
    model.set_attn_implementation(NAME)
    return True
