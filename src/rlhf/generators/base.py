"""The generator interface: prompts in, token-level trajectories out (`rlhf.trajectory`).

A factory registered as kind ``generator`` is called as
``factory(cfg=<generator config>, model_cfg=<model config>, tokenizer=..., device=...)`` and returns an
object with `generate` and `update_weights`. Its class attribute ``config_keys`` names the `generator.*` keys it
reads beyond the shared sampling keys, so a key of another backend is refused (`rlhf.config.ownership`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf.models.dtypes import tensor_bytes
from rlhf.trajectory import Trajectories

SAMPLING_KEYS = ("name", "max_new_tokens", "temperature", "top_p", "stop_token")  # read by every generator


@dataclass
class SamplingParams:
    """How to sample; shared by every generator backend so switching is one override."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False

    @classmethod
    def of(cls, gen_cfg) -> "SamplingParams":
        """The training sampling `generator.*` sets (not greedy)."""
        return cls(gen_cfg.max_new_tokens, gen_cfg.temperature, gen_cfg.top_p)


def release_parameters(module: torch.nn.Module) -> dict[str, torch.Size]:
    """Free every parameter's storage (tied ones once), keeping the tensors; returns their shapes for
    `restore_parameters`. Buffers, being small, stay."""
    shapes = {}
    for name, param in module.named_parameters():
        shapes[name] = param.shape
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return shapes


def restore_parameters(module: torch.nn.Module, shapes: dict[str, torch.Size]) -> None:
    """Reallocate what `release_parameters` freed (uninitialised: load weights into it next)."""
    for name, param in module.named_parameters():
        param.data = torch.empty(shapes[name], dtype=param.dtype, device=param.device)


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters a module holds now (0 once released)."""
    return tensor_bytes(module.parameters())


class Generator(Protocol):
    config_keys: tuple[str, ...]  # class attribute: the backend's own `generator.*` keys

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Trajectories:
        """Sample one completion per prompt (repeat prompts for several samples): single-turn trajectories whose
        action window is the response (`rlhf.trajectory.from_completions`)."""

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new policy weights; later samples must come from them. A sleeping generator wakes with them."""


class SleepingGenerator(Generator, Protocol):
    """What schedule=hybrid needs besides: freeing memory between generating and the next weights."""

    freed_bytes: int  # what the last `sleep` released

    def sleep(self) -> None:
        """Release the weights (and what else the backend can) until `update_weights` brings new ones."""
