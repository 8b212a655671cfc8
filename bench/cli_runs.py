"""What the benchmarks share: one training run through the real CLI, read back as per-step metric records, and random
Llama models of a chosen size saved with the built-in tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def train_records(name: str, overrides: list[str], folder: Path) -> list[dict]:
    """Run `python -m rlhf.train <overrides>` in a fresh subfolder of ``folder``; its step records after step 1
    (step 1 is a warm-up). Exits with the run's stderr tail if it fails."""
    out = folder / f"{name}-{len(list(folder.iterdir()))}"
    cmd = [sys.executable, "-m", "rlhf.train", *overrides, f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        sys.exit(f"{name} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "time/step" in r and r["step"] > 1]


def save_random_llama(folder: Path, hidden: int, layers: int, intermediate: int, vocab: int, heads: int) -> Path:
    """A random Llama of the given shape (tied embeddings, 256 positions) with the built-in tokenizer, saved in
    ``folder``; returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.models.loading import load_tokenizer

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer("builtin:tiny_arith").save_pretrained(folder)
    return folder
