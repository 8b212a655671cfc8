"""Shared builders for the algorithm tests: `algorithm` nodes as composition makes them (parts with their own
nodes), trajectories from a mask, and the two-row KL example the policy-gradient tests share."""

from __future__ import annotations

from dataclasses import replace

import torch

from algorithm_nodes import algorithm_cfg
from rlhf.algorithms import build_algorithm
from rlhf.trajectory import Trajectories, from_completions

MAX_NEW_TOKENS = 8  # GeneratorConfig.max_new_tokens's default


def make_algorithm(max_new_tokens: int = MAX_NEW_TOKENS, **overrides):
    """`build_algorithm` on `algorithm_cfg(**overrides)`."""
    return build_algorithm(algorithm_cfg(**overrides), max_new_tokens)


def trajectories(
    mask: torch.Tensor, group: int = 1, response_ids: torch.Tensor | None = None, **fields
) -> Trajectories:
    """Single-turn rows whose window is ``mask`` (B, T) after a 2-token prompt; contiguous groups of ``group`` rows.

    Token ids are ones unless given; ``fields`` (scores, old_logp, ref_logp, values, ...) are set on the batch.
    """
    rows, length = mask.shape
    batch = from_completions(
        torch.ones(rows, 2, dtype=torch.long),
        torch.ones(rows, 2, dtype=torch.long),
        torch.ones(rows, length, dtype=torch.long) if response_ids is None else response_ids,
        mask,
        torch.zeros(rows, length),
        torch.ones(rows, dtype=torch.bool),
    )
    return replace(batch, group_id=torch.arange(rows) // group, **fields)


# The two-row KL example: k1 KL (old - ref) at valid tokens is [0.5, 0.25] and [1.0]; garbage elsewhere.
SCORES = torch.tensor([1.0, 2.0])
KL_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
OLD_LOGP = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, 9.0, 9.0]])
REF_LOGP = torch.tensor([[-1.5, -2.25, -9.0], [-1.5, -9.0, -9.0]])


def build_kl_example(algo, old_logp=OLD_LOGP, ref_logp=REF_LOGP, scores=SCORES, group: int = 1):
    """A step of ``algo`` on the two-row KL example: its `prepare` (returned), then its `end_step` on those metrics."""
    batch, metrics = algo.prepare(trajectories(KL_MASK, group, scores=scores, old_logp=old_logp, ref_logp=ref_logp))
    algo.end_step(metrics, len(batch))
    return batch, metrics
