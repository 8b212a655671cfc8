"""What a generator holds on its device, for the memory plan (`rlhf.plan`) to add up before any model loads.

A generator class answers `plan_memory(config, model, work) -> [MemoryNeed]`; the plan asks it instead of testing
the backend's name. `own_copy_memory` is the estimate of a generator with its own copy of the weights and a KV cache
per call (the hf backend's, and the plan's guess for a backend that declares none).
"""

from __future__ import annotations

from dataclasses import dataclass

FLOAT32 = 4  # bytes of a float32 logit
ENGINE_SHARE = "engine's device share (its runtime included)"  # a MemoryNeed that claims a share of the device, e.g. vLLM's gpu_memory_utilization


@dataclass(frozen=True)
class GeneratorShape:
    """The sizes of the model a generator serves."""

    params: int  # parameters of the causal LM
    layers: int  # decoder layers
    kv_heads: int  # key/value heads per layer
    head_dim: int  # size of one head
    vocab: int  # vocabulary size


@dataclass(frozen=True)
class GenerationWork:
    """One step's generation as the plan sees it."""

    rows: int  # sequences in one generate call
    seq_len: int  # longest prompt plus response (or an episode's token budget)
    new_tokens: int  # tokens generated per row (the window)
    dtype_bytes: int  # bytes per weight and KV element (model.dtype)
    device_kind: str  # cuda or cpu
    capacity: int | None  # bytes of one device, where known


@dataclass(frozen=True)
class MemoryNeed:
    """One thing a generator holds."""

    what: str  # e.g. weights, kv_cache
    bytes: int  # its size on one device
    resident: bool  # held through training too (unless the generator sleeps); False: only while generating


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, dtype_bytes: int) -> int:
    """Keys and values of ``tokens`` positions over every layer."""
    return 2 * layers * kv_heads * head_dim * tokens * dtype_bytes


def generate_logits_bytes(rows: int, new_tokens: int, vocab: int) -> int:
    """The decode loop keeps a float32 (rows, vocab) tensor per new token."""
    return rows * new_tokens * vocab * FLOAT32


def own_copy_memory(config, model: GeneratorShape, work: GenerationWork) -> list[MemoryNeed]:
    """Its own copy of the weights (resident), a KV cache and the kept logits (while generating)."""
    kv = kv_cache_bytes(model.layers, model.kv_heads, model.head_dim, work.rows * work.seq_len, work.dtype_bytes)
    return [
        MemoryNeed("weights", model.params * work.dtype_bytes, resident=True),
        MemoryNeed("kv_cache", kv, resident=False),
        MemoryNeed("logits", generate_logits_bytes(work.rows, work.new_tokens, model.vocab), resident=False),
    ]
