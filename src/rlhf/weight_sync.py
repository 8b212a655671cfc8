"""Verified weight sync: after a push of policy weights, the generator proves it holds what the trainer pushed.

Both sides reduce every tensor to a fingerprint: a weighted sum, in float64, of a fixed pseudo-random sample of its
elements (the same sample on both sides: it depends only on the tensor's size). The generator reports what it holds
(`weight_fingerprints`, one per engine) and what it should hold after the push (`expected_fingerprint`); a mismatch
stops the run naming the push (the step after which it happened), the engine and the first tensor that differs
(`checks.weight_sync`: every push, the first only, or off).

- The hf generator holds the trainer's own tensors: it fingerprints its weights, and the trainer's side is cast to
  its dtype first, so a bfloat16 generator matches exactly.
- A vLLM engine fuses tensors (q/k/v, gate/up) and, on CPU, repacks them into kernel formats that cannot be read
  back: each engine worker fingerprints the tensors it received and handed to its loader, so a push that never
  arrived, or arrived without a tensor or with an old one, is caught where it lands.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("rlhf")

SAMPLE = 1024  # elements sampled per tensor: enough that a stale or missed tensor differs with certainty
MODES = ("every", "first", "off")
# test-only fault injection (never a config key): {"stale_push": k} skips push k; {"missed": name} keeps pushing the
# weights of push 1 for tensor `name` from then on
FAULTS: dict = {}


class WeightSyncError(RuntimeError):
    """The generator holds weights other than the ones the trainer pushed."""


@functools.lru_cache(maxsize=256)
def sample_of(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices (k,), float64 weights (k,)) of the elements a tensor of ``numel`` elements is fingerprinted on."""
    generator = torch.Generator().manual_seed(numel)
    k = min(numel, SAMPLE)
    indices = torch.randperm(numel, generator=generator)[:k] if numel <= SAMPLE else torch.randint(
        0, numel, (k,), generator=generator)
    return indices, torch.rand(k, generator=generator, dtype=torch.float64) + 0.5


def tensor_fingerprint(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """sum(w * x[i]) over the sampled elements of ``tensor`` (cast to ``dtype`` first), in float64."""
    return fingerprint({"tensor": tensor}, dtype)["tensor"]


@functools.lru_cache(maxsize=16)
def layout_of(numels: tuple[int, ...]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """For tensors of these sizes: each one's sampled indices, then every sample's tensor number (k_total,) and
    weight (k_total,) float64, concatenated in order."""
    samples = [sample_of(numel) for numel in numels]
    counts = torch.tensor([len(indices) for indices, _ in samples])
    segments = torch.repeat_interleave(torch.arange(len(numels)), counts)
    return [indices for indices, _ in samples], segments, torch.cat([weights for _, weights in samples])


def fingerprint(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, float]:
    """{name: `tensor_fingerprint`} of every floating-point tensor of a state dict (cast to ``dtype`` first).

    One gather per tensor, then a handful of operations over all samples at once: per-operation overhead, not
    arithmetic, is what a small model's push costs here."""
    tensors = {name: t.detach().reshape(-1) for name, t in state.items() if t.is_floating_point()}
    if not tensors:
        return {}
    indices, segments, weights = layout_of(tuple(t.numel() for t in tensors.values()))
    gathered = [torch.index_select(t, 0, i.to(t.device)) for t, i in zip(tensors.values(), indices)]
    values = torch.cat(gathered)  # mixed dtypes promote exactly (e.g. bfloat16 into float32)
    if dtype is not None:
        values = values.to(dtype)
    sums = torch.zeros(len(tensors), dtype=torch.float64).index_add_(0, segments, values.double().cpu() * weights)
    return dict(zip(tensors, sums.tolist()))


def first_difference(pushed: dict[str, float], held: dict[str, float], partial: bool = False) -> str | None:
    """The first tensor whose fingerprints differ or that one side lacks (in push order, then the tensors only the
    generator holds, unless the push was ``partial``: some of the weights only); None when all agree."""
    for name, value in pushed.items():
        if name not in held or abs(value - held[name]) > 1e-9 * (1.0 + abs(value)):
            return name
    return None if partial else next((name for name in held if name not in pushed), None)


class VerifiedGenerator:
    """A generator whose every weight push (`checks.weight_sync=every`, or the first) is checked against what it
    then holds; everything else passes through to the generator it wraps."""

    def __init__(self, inner, mode: str) -> None:
        self.inner, self.mode, self.pushes = inner, mode, 0
        self.first_step = 0  # the step the run starts after (a resumed run's checkpoint): push k follows step first_step + k
        self.full_size = 0  # tensors in the first push (every weight); a later push of fewer is partial (LoRA layers)
        self._kept: dict[str, torch.Tensor] = {}  # FAULTS["missed"]: the tensor frozen at push 1

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def update_weights(self, state_dict: dict[str, torch.Tensor], **kwargs) -> None:
        push, self.pushes = self.pushes, self.pushes + 1
        pushed = self._faulty(push, state_dict)
        if FAULTS.get("stale_push") != push:
            self.inner.update_weights(pushed, **kwargs)
        if self.mode == "every" or (self.mode == "first" and push == 0):
            self.verify(push, state_dict)

    def verify(self, push: int, state_dict: dict[str, torch.Tensor]) -> None:
        """WeightSyncError unless the generator holds ``state_dict`` (as its dtype rounds it)."""
        step = self.first_step + push
        after = f"the initial push (before step {step + 1})" if push == 0 else f"the push after step {step}"
        if getattr(self.inner, "asleep", False):
            raise WeightSyncError(
                f"weight sync check failed at {after}: the generator is still asleep, holding no weights; the push "
                f"never woke it (schedule=hybrid). checks.weight_sync=off skips this check"
            )
        expected = self.inner.expected_fingerprint(state_dict)
        engines = self.inner.weight_fingerprints()
        if push == 0:
            self.full_size = len(expected)
        partial = len(expected) < self.full_size
        for engine, held in enumerate(engines):
            name = first_difference(expected, held, partial)
            if name is None:
                continue
            which = f" (engine worker {engine} of {len(engines)})" if len(engines) > 1 else ""
            raise WeightSyncError(
                f"weight sync check failed at {after}: the generator{which} holds a different `{name}` than the "
                f"trainer pushed (fingerprint {held.get(name, 'missing')} != {expected.get(name, 'never pushed')}); "
                f"rollouts would be sampled from weights the trainer never pushed. Check the generator's weight "
                f"loading (a skipped or renamed parameter, a push that never arrived); checks.weight_sync=off skips "
                f"this check"
            )

    def _faulty(self, push: int, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        name = FAULTS.get("missed")
        if name is None or push == 0:
            return state_dict
        self._kept.setdefault(name, state_dict[name].detach().clone())
        return {**state_dict, name: self._kept[name]}


def resumed(generator, step: int) -> None:
    """Tell a verified ``generator`` that the run resumes after ``step``, so its messages name the real steps."""
    if isinstance(generator, VerifiedGenerator):
        generator.first_step = step


def verified(generator, mode: str):
    """``generator`` wrapped for `checks.weight_sync` (unchanged when off or when it cannot fingerprint)."""
    if mode == "off":
        return generator
    if not hasattr(generator, "weight_fingerprints"):
        log.warning("checks.weight_sync=%s: %s cannot report its weights; weight pushes are not verified",
                    mode, type(generator).__name__)
        return generator
    return VerifiedGenerator(generator, mode)
