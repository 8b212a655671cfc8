"""The supervised warm start is a separate, reproducible stage that yields a loadable, imperfect policy."""

from __future__ import annotations

import random
from collections import Counter

import torch

from rlhf import warmstart
from rlhf.data.arith import arith_problems
from rlhf.models.loading import load_causal_lm, load_tokenizer


def test_demonstrations_follow_the_advertised_mix():
    """About 30% of demonstrations are correct and about 40% are off by one (so greedy starts wrong)."""
    rng = random.Random(0)
    kinds = Counter()
    for _ in range(4000):
        reply = warmstart.demonstration("7", rng, 18)
        kinds["correct" if reply == "7" else "off_by_one" if reply == "8" else "other"] += 1
    assert abs(kinds["correct"] / 4000 - (0.30 + 0.2 / 19)) < 0.03
    assert abs(kinds["off_by_one"] / 4000 - (0.40 + 0.2 / 19)) < 0.03


def test_short_warm_start_saves_a_model_that_loads_with_from_pretrained(tmp_path):
    warmstart.main(["--output-dir", str(tmp_path), "--steps", "30", "--batch-size", "32"])
    tokenizer = load_tokenizer(str(tmp_path))
    model = load_causal_lm(str(tmp_path))
    prompt = tokenizer(arith_problems(9)[0][0], return_tensors="pt")
    with torch.no_grad():
        logits = model(**prompt).logits
    assert logits.shape == (1, prompt["input_ids"].shape[1], len(tokenizer))
    assert tokenizer.padding_side == "left" and tokenizer.eos_token == "<eos>"


def test_the_committed_model_is_the_builtin_one():
    """`builtin:tiny_arith` resolves to the committed folder inside the package."""
    model = load_causal_lm("builtin:tiny_arith")
    assert sum(p.numel() for p in model.parameters()) < 200_000
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    assert head_dim >= 32, "vLLM's CPU backend needs head_dim >= 32"
