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

import logging

import torch

from rlhf.models.fingerprint import first_difference

log = logging.getLogger("rlhf")

MODES = ("every", "first", "off")


class WeightSyncError(RuntimeError):
    """The generator holds weights other than the ones the trainer pushed."""


class VerifiedGenerator:
    """A generator whose every weight push (`checks.weight_sync=every`, or the first) is checked against what it
    then holds; everything else passes through to the generator it wraps."""

    def __init__(self, inner, mode: str) -> None:
        self.inner, self.mode, self.pushes = inner, mode, 0
        self.first_step = 0  # the step the run starts after (a resumed run's checkpoint): push k follows step first_step + k
        self.full_size = 0  # tensors in the first push (every weight); a later push of fewer is partial (LoRA layers)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None, **kwargs) -> None:
        """Load and verify; ``version``: the step after which these weights were pushed, when a schedule that may
        skip superseded pushes (async, stream) says which it loads (else the count of pushes tells)."""
        push, self.pushes = self.pushes, self.pushes + 1
        self.inner.update_weights(state_dict, **kwargs)
        if self.mode == "every" or (self.mode == "first" and push == 0):
            self.verify(push, state_dict, version)

    def verify(self, push: int, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        """WeightSyncError unless the generator holds ``state_dict`` (as its dtype rounds it)."""
        step = self.first_step + push if version is None else version
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
