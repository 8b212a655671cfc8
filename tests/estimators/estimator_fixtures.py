"""Shared builders for the estimator tests: configs with every AlgorithmConfig field, rollouts from a mask."""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace

import torch

from rlhf.config.schema import AlgorithmConfig
from rlhf.generators.base import Rollout


def algorithm_cfg(**overrides) -> SimpleNamespace:
    """A plain namespace with every AlgorithmConfig field (schema defaults, then ``overrides``; estimator grpo)."""
    fields = asdict(AlgorithmConfig(estimator="grpo"))
    fields.update(overrides)
    return SimpleNamespace(**fields)


def rollout_with_mask(mask: torch.Tensor, response_ids: torch.Tensor | None = None) -> Rollout:
    """A rollout with the given response mask; token ids are ones unless given."""
    rows, length = mask.shape
    return Rollout(
        query_ids=torch.ones(rows, 2, dtype=torch.long),
        query_mask=torch.ones(rows, 2, dtype=torch.long),
        response_ids=torch.ones(rows, length, dtype=torch.long) if response_ids is None else response_ids,
        response_mask=mask,
        logprobs=torch.zeros(rows, length),
        stopped=torch.ones(rows, dtype=torch.bool),
    )
