"""Test-only faults in weight pushes, put between the verified generator (`rlhf.checks.weight_sync`) and the
generator it wraps, so the check sees what a broken transport would deliver: a push that never arrives, or one
tensor that stops arriving."""

from __future__ import annotations

import torch

from rlhf.checks.weight_sync import VerifiedGenerator


class FaultyTransport:
    """The wrapped generator, except that `update_weights` drops the push (``skip``) or delivers ``kept`` tensors in
    place of the pushed ones."""

    def __init__(self, inner, skip: bool, kept: dict[str, torch.Tensor]) -> None:
        self.inner, self.skip, self.kept = inner, skip, kept

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def update_weights(self, state_dict, **kwargs) -> None:
        if not self.skip:  # (a Ray object reference, never altered, passes as it is)
            self.inner.update_weights({**state_dict, **self.kept} if self.kept else state_dict, **kwargs)


def inject_push_faults(monkeypatch, stale_push: int | None = None, missed: str | None = None) -> None:
    """From now on every verified generator loses push ``stale_push`` (0 = the first), and keeps receiving push 1's
    copy of tensor ``missed`` on every push after it."""
    update = VerifiedGenerator.update_weights
    kept: dict[int, dict[str, torch.Tensor]] = {}  # per verified generator: the frozen tensor

    def faulty(self, state_dict, **kwargs):
        push, inner = self.pushes, self.inner
        frozen = kept.setdefault(id(self), {})
        if missed is not None and push > 0:
            frozen.setdefault(missed, state_dict[missed].detach().clone())
        self.inner = FaultyTransport(inner, push == stale_push, frozen)
        try:
            update(self, state_dict, **kwargs)
        finally:
            self.inner = inner

    monkeypatch.setattr(VerifiedGenerator, "update_weights", faulty)
