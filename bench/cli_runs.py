"""What the benchmarks share: one training run through the real CLI, read back as per-step metric records, and random
Llama models of a chosen size saved with the built-in tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def train_records(
    name: str, overrides: list[str], folder: Path, source: Path | None = None, keep_eval: bool = False
) -> list[dict]:
    """Run `python -m rlhf.train <overrides>` in a fresh subfolder of ``folder``; its step records after step 1
    (step 1 is a warm-up), or with ``keep_eval`` every record (evaluation rows, step 0's too). ``source``: run the
    `rlhf` package of another checkout (its ``src`` folder) instead of the installed one. Exits with the run's
    stderr tail if it fails."""
    out = folder / f"{name}-{len(list(folder.iterdir()))}"
    cmd = [sys.executable, "-m", "rlhf.train", *overrides, f"hydra.run.dir={out}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(source), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{name} run failed ({proc.returncode}):\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records if keep_eval else [r for r in records if "time/step" in r and r["step"] > 1]


def save_random_llama(
    folder: Path, hidden: int, layers: int, intermediate: int, vocab: int, heads: int, positions: int = 256,
    kv_heads: int | None = None,
) -> Path:
    """A random Llama of the given shape (tied embeddings, ``positions`` positions, ``kv_heads`` key/value heads, by
    default as many as query heads) with the built-in tokenizer, saved in ``folder``; returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.models.loading import load_tokenizer

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads, max_position_embeddings=positions, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer("builtin:tiny_arith").save_pretrained(folder)
    return folder


def attempt(fn, strict: bool, limit: int = 600):
    """``fn()``; unless ``strict`` (the tiny form CI runs), an error it raises as ``{"error": ...}``, so one broken
    measurement costs only its own figures."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - reported in the figures
        if strict:
            raise
        return {"error": f"{type(error).__name__}: {error}"[:limit]}


def release(device) -> None:
    """Free what the last measurement left: its garbage, and on CUDA the allocator's cached blocks, so the next
    measurement's peak memory is its own."""
    import gc

    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def sync(device) -> None:
    """Wait for the work queued on ``device`` (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def matmul_peak(device, sizes: tuple[int, ...], dtype) -> float:
    """The machine's matrix-product rate in FLOP/s: the best of square products of each size in ``sizes`` (warmed
    up, then timed over repeats), measured in this process."""
    import time

    import torch

    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        repeats = max(3, int(2e10 // (2 * n**3))) if device.type == "cpu" else 10
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        sync(device)
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - start))
    return best


def train_flops(config, tokens: float, window_tokens: float, context_sum: float) -> float:
    """Model FLOPs of one training pass (forward + backward): 6 N per token for the transformer's matmul weights
    (the embedding lookup excluded), 6 d V per scored (window) token for the output layer, which runs on the window
    only, and 12 L d per token and position it attends to for attention scores and values (PaLM's convention, no
    causal halving). ``context_sum``: the sum over tokens of their row's length (rows x length^2 when equal)."""
    d, layers, heads, kv = config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    head_dim = d // heads
    per_layer = d * d * 2 + 2 * d * kv * head_dim + 3 * d * config.intermediate_size  # q, o, k, v, gate/up/down
    return 6 * layers * per_layer * tokens + 12 * layers * d * context_sum + 6 * d * config.vocab_size * window_tokens
