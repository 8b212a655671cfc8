"""The generator interface: prompts in, token-level trajectories out (`rlhf.trajectory`).

A factory registered as kind ``generator`` is called as
``factory(cfg=<its typed config>, model_cfg=<model config>, tokenizer=..., device=...)`` and returns an object with
`generate` and `update_weights`. Its class attribute ``config`` is its config class: `GeneratorConfig` (the sampling
keys every backend shares) extended with the backend's own keys, so the `generator` node holds only the chosen
backend's keys (`rlhf.parts`). What the run asks a backend besides (all optional, as class attributes):
``plan_memory(config, model, work)`` (`rlhf.generators.memory`), ``rows_per_call(config, rows)``,
``sleep_overrides(config)`` (what lets it sleep: see `sleep_overrides`), ``check_run(config, cfg, ranks)`` (its fit
with the cluster and the data), ``memory_advice(config, shares_devices, rows)`` (overrides that shrink it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf.errors import require
from rlhf.models.dtypes import tensor_bytes
from rlhf.parts import PartConfig
from rlhf.trajectory import Trajectories


@dataclass
class GeneratorConfig(PartConfig):
    """The sampling keys every backend shares, so switching backends is one override."""

    max_new_tokens: int = 256  # response length limit; responses that hit it without a stop token are non-stop
    temperature: float = 1.0  # sampling temperature (also used by the trainer's logprobs)
    top_p: float = 1.0  # nucleus sampling mass
    stop_token: str = "eos"  # `eos` for the tokenizer's EOS, or a literal token that ends a response

    def check(self, at: str) -> None:
        require(self.max_new_tokens >= 1, f"{at}.max_new_tokens={self.max_new_tokens} must be >= 1")
        require(self.temperature > 0, f"{at}.temperature={self.temperature} must be > 0 (the trainer divides logits by it)")
        require(0 < self.top_p <= 1, f"{at}.top_p={self.top_p} must be in (0, 1]")


@dataclass
class SamplingParams:
    """How to sample; shared by every generator backend so switching is one override."""

    max_new_tokens: int  # response length limit
    temperature: float = 1.0  # logits are divided by it
    top_p: float = 1.0  # nucleus sampling mass
    greedy: bool = False  # argmax instead of sampling (evaluation)

    @classmethod
    def of(cls, gen_cfg) -> "SamplingParams":
        """The training sampling `generator.*` sets (not greedy)."""
        return cls(gen_cfg.max_new_tokens, gen_cfg.temperature, gen_cfg.top_p)


def sleep_overrides(generator: type, config) -> list[str] | None:
    """The overrides that let ``generator`` sleep while the policy trains: [] when it can as configured, None when it
    cannot at all. A backend answers with its ``sleep_overrides(config)``; one that declares none can sleep when it
    has a `sleep` method."""
    answer = getattr(generator, "sleep_overrides", None)
    if answer is not None:
        return answer(config)
    return [] if hasattr(generator, "sleep") else None


def runs_on_cpu(cfg) -> bool:
    """Whether the run's generator engines (or model) start on the CPU (the local backend's device, or Ray's device_type)."""
    if cfg.cluster.backend == "ray":
        return cfg.cluster.device_type == "cpu"
    return cfg.cluster.device == "cpu" or (cfg.cluster.device == "auto" and not torch.cuda.is_available())


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
    config: type  # class attribute: its config class, `GeneratorConfig` extended with the backend's own keys

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
