"""The generator interface and the rollout it returns.

A factory registered as kind ``generator`` is called as
``factory(cfg=<generator config>, model_cfg=<model config>, tokenizer=..., device=...)`` and returns an
object with `generate` and `update_weights`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch


@dataclass
class SamplingParams:
    """How to sample; shared by every generator backend so switching is one override."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False


@dataclass
class Rollout:
    """Prompts and their sampled responses, padded into rectangles.

    Shapes: Lq = longest prompt, Lr = longest response. Prompts are left-padded, responses right-padded;
    everything after a response's stop token is padding and masked out.
    """

    query_ids: torch.Tensor  # (B, Lq) long, left-padded
    query_mask: torch.Tensor  # (B, Lq) long, 1 for real prompt tokens
    response_ids: torch.Tensor  # (B, Lr) long, right-padded; includes the stop token
    response_mask: torch.Tensor  # (B, Lr) float, 1 for real response tokens
    logprobs: torch.Tensor  # (B, Lr) float, the generator's own logprobs (diagnostics only; 0 where masked)
    stopped: torch.Tensor  # (B,) bool, the response ended with a stop token before the length limit

    def __len__(self) -> int:
        return self.query_ids.shape[0]

    def select(self, index: torch.Tensor | slice) -> "Rollout":
        """The rows at ``index`` (a slice or a 1-D index tensor)."""
        return Rollout(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def chunks(self, size: int) -> list["Rollout"]:
        """Consecutive row slices of at most ``size`` rows (micro batches for a forward pass)."""
        return [self.select(slice(start, start + size)) for start in range(0, len(self), size)]

    def to(self, device: torch.device | str) -> "Rollout":
        return Rollout(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask, position_ids), each (B, Lq + Lr), for a teacher-forced forward.

        Positions count real tokens only, so a left-padded prompt sees the positions it saw when sampled.
        """
        input_ids = torch.cat([self.query_ids, self.response_ids], dim=1)
        attention_mask = torch.cat([self.query_mask, self.response_mask.long()], dim=1)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        return input_ids, attention_mask, position_ids

    @property
    def response_lengths(self) -> torch.Tensor:
        """Real tokens per response, stop token included. Shape: (B,)."""
        return self.response_mask.sum(dim=1)


def _pad_right(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def _pad_left(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)


def concat_rollouts(chunks: list[Rollout], pad_id: int) -> Rollout:
    """Stack rollouts of different widths (prompts padded left, responses right)."""
    if len(chunks) == 1:
        return chunks[0]
    q = max(c.query_ids.shape[1] for c in chunks)
    r = max(c.response_ids.shape[1] for c in chunks)
    return Rollout(
        query_ids=torch.cat([_pad_left(c.query_ids, q, pad_id) for c in chunks]),
        query_mask=torch.cat([_pad_left(c.query_mask, q, 0) for c in chunks]),
        response_ids=torch.cat([_pad_right(c.response_ids, r, pad_id) for c in chunks]),
        response_mask=torch.cat([_pad_right(c.response_mask, r, 0) for c in chunks]),
        logprobs=torch.cat([_pad_right(c.logprobs, r, 0) for c in chunks]),
        stopped=torch.cat([c.stopped for c in chunks]),
    )


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollout:
        """Sample one response per prompt (repeat prompts for several samples)."""

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new policy weights; later samples must come from them. A sleeping generator wakes with them."""


class SleepingGenerator(Generator, Protocol):
    """What schedule=hybrid needs besides: freeing memory between generating and the next weights."""

    freed_bytes: int  # what the last `sleep` released

    def sleep(self) -> None:
        """Release the weights (and what else the backend can) until `update_weights` brings new ones."""
