"""The sizes that follow from the config: batch arithmetic checked, and the longest row a run can produce.

Derived once, by `rlhf.config.validate` (into `RunSpec.sizes`) or `rlhf.config.spec.resolve`; logged at start and
never written back into the config.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from rlhf.envs.base import EnvConfig
from rlhf.errors import require as _require
from rlhf.micro_batches import micro_units


@dataclass(frozen=True)
class DerivedSizes:
    """Batch sizes that follow from the config (logged at start, never stored back)."""

    samples_per_step: int  # prompts_per_step * num_samples_per_prompt
    train_units_per_step: int  # what mini batches split: samples, or (chosen, rejected) pairs for online_dpo
    mini_batch_size: int  # training units per optimiser step (micro batches are capped at this size)
    grad_accum_steps: int  # micro batches per optimiser step
    optimizer_steps: int  # optimiser steps over the whole run
    eval_every: int  # steps between evaluations (from eval.every or eval.num_evals); 0 = start and end only
    total_episodes: int  # completions generated over the whole run
    prompts_seen: int  # prompts drawn over the whole run (reused each epoch when above the dataset size)
    longest_row: int  # the most tokens one trajectory can hold (env.max_tokens, or the longest prompt plus the response budget)
    longest_row_keys: str  # the keys that set longest_row, for messages

    def as_dict(self) -> dict[str, int | str]:
        return dict(self.__dict__)


def derive_sizes(cfg: DictConfig, env: EnvConfig | None, pairwise: bool = False) -> DerivedSizes:
    """Check the batch arithmetic and return the derived sizes (``env``: the typed `env` node, None for env=none;
    ``pairwise``: units are chosen/rejected pairs)."""
    train, algo = cfg.train, cfg.algorithm
    for key, value in (
        ("train.num_steps", train.num_steps),
        ("train.prompts_per_step", train.prompts_per_step),
        ("algorithm.num_samples_per_prompt", algo.num_samples_per_prompt),
        ("train.num_epochs", train.num_epochs),
        ("train.num_mini_batches", train.num_mini_batches),
        ("train.micro_batch_size", train.micro_batch_size),
    ):
        _require(value >= 1, f"{key}={value} must be >= 1")
    samples = train.prompts_per_step * algo.num_samples_per_prompt
    if pairwise:
        return _derive_pairwise_sizes(cfg, env, samples)
    _require(
        samples % train.num_mini_batches == 0,
        f"samples per step ({train.prompts_per_step} train.prompts_per_step * {algo.num_samples_per_prompt} "
        f"algorithm.num_samples_per_prompt = {samples}) is not divisible by train.num_mini_batches="
        f"{train.num_mini_batches}; pick num_mini_batches from the divisors of {samples}",
    )
    mini = samples // train.num_mini_batches
    micro = micro_units(mini, train.micro_batch_size, 1)  # a micro batch never exceeds its mini batch
    _require(
        mini % micro == 0,
        f"mini batch ({samples} samples per step / {train.num_mini_batches} train.num_mini_batches = {mini}) "
        f"is not divisible by train.micro_batch_size={train.micro_batch_size}; "
        f"pick micro_batch_size from the divisors of {mini}",
    )
    return _sizes(cfg, env, samples, samples, mini, mini // micro)


def _derive_pairwise_sizes(cfg: DictConfig, env: EnvConfig | None, samples: int) -> DerivedSizes:
    """Pairwise algorithms (online DPO) train on one pair (2 samples) per prompt; batches hold whole pairs."""
    train = cfg.train
    pairs = train.prompts_per_step
    _require(
        pairs % train.num_mini_batches == 0,
        f"algorithm.advantage={cfg.algorithm.advantage.name} trains on one pair per prompt: {pairs} pairs per step (train.prompts_per_step) "
        f"is not divisible by train.num_mini_batches={train.num_mini_batches}",
    )
    mini = pairs // train.num_mini_batches
    micro_pairs = micro_units(mini, train.micro_batch_size, 2)
    _require(
        train.micro_batch_size % 2 == 0 and mini % micro_pairs == 0,
        f"algorithm.advantage={cfg.algorithm.advantage.name}: train.micro_batch_size={train.micro_batch_size} counts samples (2 per pair) and "
        f"must be an even number whose half divides the {mini} pairs of a mini batch",
    )
    return _sizes(cfg, env, samples, pairs, mini, mini // micro_pairs)


def _sizes(cfg: DictConfig, env: EnvConfig | None, samples: int, units: int, mini: int, accum: int) -> DerivedSizes:
    train = cfg.train
    optimizer_steps = train.num_steps * train.num_epochs * train.num_mini_batches
    num_evals = cfg.eval.num_evals
    eval_every = -(-train.num_steps // num_evals) if num_evals else cfg.eval.every
    longest, keys = longest_row(cfg, env)
    return DerivedSizes(
        longest_row=longest,
        longest_row_keys=keys,
        eval_every=eval_every,
        samples_per_step=samples,
        train_units_per_step=units,
        mini_batch_size=mini,
        grad_accum_steps=accum,
        optimizer_steps=optimizer_steps,
        total_episodes=train.num_steps * samples,
        prompts_seen=train.num_steps * train.prompts_per_step,
    )




def longest_row(cfg: DictConfig, env: EnvConfig | None) -> tuple[int, str]:
    """The most tokens one trajectory can hold, and the keys that set it: an episode's `env.max_tokens` (``env``: the
    typed `env` node), else the longest prompt plus the response budget. (Read from `DerivedSizes.longest_row` once
    sizes are derived.)"""
    if env is not None:
        return env.max_tokens, "env.max_tokens"
    return int(cfg.dataset.max_prompt_length) + int(cfg.generator.max_new_tokens), "dataset.max_prompt_length + generator.max_new_tokens"


def check_token_budget(cfg: DictConfig, sizes: DerivedSizes, pairwise: bool) -> None:
    """`train.max_tokens_per_micro_batch` holds the longest row the run can produce (pairwise: a pair of them)."""
    budget = cfg.train.max_tokens_per_micro_batch
    if budget is None:
        return
    longest = sizes.longest_row * (2 if pairwise else 1)
    _require(budget >= 1, f"train.max_tokens_per_micro_batch={budget} must be >= 1, or null to cut micro batches by rows alone")
    _require(
        budget >= longest,
        f"train.max_tokens_per_micro_batch={budget} is smaller than the longest row this run can produce ({longest} "
        f"tokens: {sizes.longest_row_keys}); raise it to at least {longest}, or null to cut micro batches by rows alone",
    )
