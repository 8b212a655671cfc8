"""Dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476, section 3.2): train only on groups with a signal.

A group whose samples all scored exactly the same has a group-relative advantage of 0 for every sample: it costs a
forward and backward pass and teaches nothing, and the share of such groups grows as the policy gets better (all
right) or stays bad (all wrong). With `algorithm.filter_groups` a step drops those groups and draws
`train.prompts_per_step` more prompts, up to `algorithm.max_resample_rounds` times, until it holds prompts_per_step
groups with a signal (any surplus from the last round is cut). When the rounds run out it trains on the groups it
kept, or, if it kept none, on its last batch as it is (its advantages are all 0), and warns.

Metrics: the first round's reward metrics (a sample of the policy the same size as without filtering; `time/*` are
summed over rounds), `dynamic_sampling/rounds` (generate calls), `dynamic_sampling/kept_share` (groups with a signal
/ groups generated) and `dynamic_sampling/kept_groups` (groups with a signal trained on).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

import torch

from rlhf import stages
from rlhf.data.prompts import PromptExample
from rlhf.generators.base import SamplingParams
from rlhf.trajectory import concat

log = logging.getLogger("rlhf")


def generate_groups(
    c, algo, examples: list[PromptExample], draw: Callable[[int], list[PromptExample]], sampling: SamplingParams,
    generator=None,
) -> stages.Scored:
    """The step's scored groups for ``examples``: `stages.generate_and_score`, or with `algorithm.filter_groups`
    only groups with a signal (see the module docstring). ``draw(n)`` gives n more prompts for a resampling round;
    ``generator`` (default: the run's) generates every round."""
    samples = algo.num_samples_per_prompt
    if not algo.filter_groups:
        return stages.generate_and_score(c, examples, samples, sampling, generator=generator)
    wanted = len(examples)
    rounds: list[stages.Scored] = []
    kept: list[stages.Scored] = []
    num_kept = generated = 0
    while True:
        scored = stages.generate_and_score(c, examples, samples, sampling, training=True, generator=generator)
        rounds.append(scored)
        groups = group_rows(scored.batch.group_id)
        signal = groups_with_signal(scored.scores, groups)
        generated += len(groups)
        kept.append(take_groups(scored, signal[: wanted - num_kept]))
        num_kept += len(signal)
        if num_kept >= wanted or len(rounds) > algo.max_resample_rounds:
            break
        examples = draw(wanted)
    trained = min(num_kept, wanted)
    if trained < wanted:
        log.warning(
            "dynamic sampling: %d of %d groups had a signal after %d generate calls; training on %s. Raise "
            "algorithm.max_resample_rounds=%d (or train.prompts_per_step) to fill the step",
            trained, wanted, len(rounds), f"those {trained}" if trained else "the last batch as is (all advantages 0)",
            algo.max_resample_rounds,
        )
    result = join(kept, int(c.tokenizer.pad_token_id)) if trained else rounds[-1]
    metrics = round_metrics(rounds) | {
        "dynamic_sampling/rounds": float(len(rounds)),
        "dynamic_sampling/kept_share": num_kept / max(generated, 1),
        "dynamic_sampling/kept_groups": float(trained),
    }
    return replace(result, metrics=metrics)


def group_rows(group_id: torch.Tensor) -> list[list[int]]:
    """Row indices of each group, groups in order of their first row. Shape: group_id (B,)."""
    rows: dict[int, list[int]] = {}
    for row, group in enumerate(group_id.tolist()):
        rows.setdefault(group, []).append(row)
    return list(rows.values())


def groups_with_signal(scores: torch.Tensor, groups: list[list[int]]) -> list[list[int]]:
    """The groups whose scores are not all exactly equal. Shape: scores (B,); groups as `group_rows` gives them."""
    return [rows for rows in groups if bool((scores[rows] != scores[rows[0]]).any())]


def take_groups(scored: stages.Scored, groups: list[list[int]]) -> stages.Scored:
    """The rows of ``groups`` (row indices per group), each group's rows together, group ids renumbered 0.."""
    rows = torch.tensor([row for group in groups for row in group], dtype=torch.long)
    sizes = torch.tensor([len(group) for group in groups], dtype=torch.long)
    batch = replace(scored.batch.select(rows), group_id=torch.arange(len(groups)).repeat_interleave(sizes))
    return stages.Scored(
        batch=batch,
        prompts=[scored.prompts[row] for row in rows.tolist()],
        responses=[scored.responses[row] for row in rows.tolist()],
        metrics=scored.metrics,
        versions=None if scored.versions is None else scored.versions[rows],
    )


def join(parts: list[stages.Scored], pad_id: int) -> stages.Scored:
    """The non-empty ``parts`` as one Scored, in order, group ids renumbered 0.. across them (each part's ids are
    0..; rows keep their extras). Metrics are the first part's."""
    parts = [part for part in parts if len(part.batch)]
    batches, offset = [], 0
    for part in parts:
        batches.append(replace(part.batch, group_id=part.batch.group_id + offset))
        offset += len(group_rows(part.batch.group_id))
    versions = [part.versions for part in parts]
    return stages.Scored(
        batch=concat(batches, pad_id),
        prompts=[prompt for part in parts for prompt in part.prompts],
        responses=[response for part in parts for response in part.responses],
        metrics=parts[0].metrics,
        versions=None if any(v is None for v in versions) else torch.cat(versions),
    )


def round_metrics(rounds: list[stages.Scored]) -> dict[str, float]:
    """The first round's metrics, with every `time/*` summed over the rounds."""
    metrics = dict(rounds[0].metrics)
    for scored in rounds[1:]:
        for key, value in scored.metrics.items():
            if key.startswith("time/"):
                metrics[key] = metrics.get(key, 0.0) + value
    return metrics
