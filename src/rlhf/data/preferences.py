"""Preference pairs (prompt, chosen, rejected) for reward-model training, and the built-in arith_prefs task.

A factory registered as kind ``preference_dataset`` is called as ``factory(cfg=<preferences config>,
tokenizer=...)`` and returns a `PreferenceSplits`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from rlhf.data.arith import arith_problems
from rlhf.trajectory import left_pad
from rlhf.registry import register


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class PreferenceSplits:
    train: list[PreferencePair]
    eval: list[PreferencePair]


@register("preference_dataset", "arith_prefs")
def arith_preferences(cfg, tokenizer=None) -> PreferenceSplits:
    """Correct sums are chosen over wrong ones (seeded).

    Every problem appears in both splits, but the eval split's rejected answers are held out: for each
    problem a share (``eval_fraction``) of the wrong numbers 0..2*max_operand+1 is kept for eval only, so
    eval accuracy measures whether the model knows the right answer, not whether it memorised the pairs.
    """
    if not 0 < cfg.eval_fraction < 1:
        raise ValueError(f"preferences.eval_fraction={cfg.eval_fraction} must be in (0, 1)")
    if cfg.max_operand < 1:
        raise ValueError(f"preferences.max_operand={cfg.max_operand} must be >= 1")
    if cfg.pairs_per_problem < 1:
        raise ValueError(f"preferences.pairs_per_problem={cfg.pairs_per_problem} must be >= 1")
    rng = random.Random(0)
    train, held_out = [], []
    for prompt, answer in arith_problems(cfg.max_operand):
        wrong = [str(n) for n in range(2 * cfg.max_operand + 2) if str(n) != answer]
        rng.shuffle(wrong)
        k = max(1, round(len(wrong) * cfg.eval_fraction))
        held_out += [PreferencePair(prompt, answer, w) for w in wrong[:k]]
        train += [PreferencePair(prompt, answer, rng.choice(wrong[k:])) for _ in range(cfg.pairs_per_problem)]
    rng.shuffle(train)
    return PreferenceSplits(train=train, eval=held_out)


def encode_pairs(pairs: list[PreferencePair], tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen rows then rejected rows, each prompt + response + EOS, left-padded. Shape: (2P, L) ids and mask.

    The EOS matches how the policy's stopped responses end, so the model scores what it will see.
    """
    def ids(prompt: str, response: str) -> list[int]:
        return tokenizer(prompt)["input_ids"] + tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    rows = [ids(p.prompt, p.chosen) for p in pairs] + [ids(p.prompt, p.rejected) for p in pairs]
    return left_pad(rows, tokenizer.pad_token_id)
