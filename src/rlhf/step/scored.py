"""A scored batch (`Scored`), and the group arithmetic of dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476,
section 3.2: train only on groups with a signal).

A group whose samples all scored exactly the same has a group-relative advantage of 0 for every sample: it costs a
forward and backward pass and teaches nothing, and the share of such groups grows as the policy gets better (all
right) or stays bad (all wrong). With `algorithm.filter_groups` the `Collector` drops those groups and draws
`train.prompts_per_step` more prompts, up to `algorithm.max_resample_rounds` times, until it holds prompts_per_step
groups with a signal (any surplus from the last round is cut). When the rounds run out it trains on the groups it
kept, or, if it kept none, on its last batch as it is (its advantages are all 0), and warns.

Metrics: the first round's reward metrics (a sample of the policy the same size as without filtering; `time/*` are
summed over rounds), `dynamic_sampling/rounds` (generate calls), `dynamic_sampling/kept_share` (groups with a signal
/ groups generated) and `dynamic_sampling/kept_groups` (groups with a signal trained on).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rlhf.trajectory import Trajectories, concat


@dataclass
class Scored:
    """Generated trajectories with their scores (``batch.scores``) and decoded texts."""

    batch: Trajectories  # on the CPU, with group ids and scores
    prompts: list[str]  # (B,) prompt texts, each repeated num_samples_per_prompt times in a row
    responses: list[str]  # (B,) decoded completions, special tokens removed
    metrics: dict[str, float]  # per-function reward means and the verifiable correct rate
    versions: torch.Tensor | None = None  # (B,) policy version that generated each row (async schedule), else None
    trainer_version: int | None = None  # the policy version that trains on the batch (async), else None
    tasks: list[int] | None = None  # played episodes: the position among the examples of each group's task (a group whose episodes failed is missing), else None

    @property
    def scores(self) -> torch.Tensor:
        """(B,) summed reward after the non-stop penalty."""
        return self.batch.scores


def group_rows(group_id: torch.Tensor) -> list[list[int]]:
    """Row indices of each group, groups in order of their first row. Shape: group_id (B,)."""
    rows: dict[int, list[int]] = {}
    for row, group in enumerate(group_id.tolist()):
        rows.setdefault(group, []).append(row)
    return list(rows.values())


def kept_groups(groups: list[list[int]], lost: list[bool], min_group: int) -> list[list[int]]:
    """The rows of each group that were not ``lost``, a group left with fewer than ``min_group`` rows (the
    estimator's samples per prompt: a baseline needs company; at most the group's size) or none dropped. The rule for
    every failure that is not a score (`rlhf.rewards.failure`). ``groups`` as `group_rows` gives them; ``lost`` (B,)."""
    left = [[row for row in rows if not lost[row]] for rows in groups]
    return [rows for rows, whole in zip(left, groups) if rows and len(rows) >= min(min_group, len(whole))]


def groups_with_signal(scores: torch.Tensor, groups: list[list[int]]) -> list[list[int]]:
    """The groups whose scores are not all exactly equal. Shape: scores (B,); groups as `group_rows` gives them."""
    return [rows for rows in groups if bool((scores[rows] != scores[rows[0]]).any())]


def take_groups(scored: Scored, groups: list[list[int]]) -> Scored:
    """The rows of ``groups`` (row indices per group), each group's rows together, group ids renumbered 0.."""
    rows = torch.tensor([row for group in groups for row in group], dtype=torch.long)
    sizes = torch.tensor([len(group) for group in groups], dtype=torch.long)
    batch = replace(scored.batch.select(rows), group_id=torch.arange(len(groups)).repeat_interleave(sizes))
    return Scored(
        batch=batch,
        prompts=[scored.prompts[row] for row in rows.tolist()],
        responses=[scored.responses[row] for row in rows.tolist()],
        metrics=scored.metrics,
        versions=None if scored.versions is None else scored.versions[rows],
        trainer_version=scored.trainer_version,
    )


def join(parts: list[Scored], pad_id: int) -> Scored:
    """The non-empty ``parts`` as one Scored, in order, group ids renumbered 0.. across them (each part's ids are
    0..; rows keep their extras). Metrics are the first part's."""
    parts = [part for part in parts if len(part.batch)]
    batches, offset = [], 0
    for part in parts:
        batches.append(replace(part.batch, group_id=part.batch.group_id + offset))
        offset += len(group_rows(part.batch.group_id))
    versions = [part.versions for part in parts]
    return Scored(
        batch=concat(batches, pad_id),
        prompts=[prompt for part in parts for prompt in part.prompts],
        responses=[response for part in parts for response in part.responses],
        metrics=parts[0].metrics,
        versions=None if any(v is None for v in versions) else torch.cat(versions),
        trainer_version=parts[0].trainer_version,
    )


def round_metrics(rounds: list[Scored]) -> dict[str, float]:
    """The first round's metrics, with every `time/*` summed over the rounds."""
    metrics = dict(rounds[0].metrics)
    for scored in rounds[1:]:
        for key, value in scored.metrics.items():
            if key.startswith("time/"):
                metrics[key] = metrics.get(key, 0.0) + value
    return metrics
