"""A row a reward could not score for a reason of its own: not the response's fault, so not a score.

A reward function returns `Unscored(reason)` in a row's place when its machinery failed for that row: a sandbox that
died for reasons of its own, a judge that timed out or answered garbage, a service out of reach. Such a row is not a
zero: a zero would tell the policy its response was bad, and bias every advantage of its group. `RewardSet` masks
such rows out of the loss and out of their group's statistics and counts them (`reward/unscored`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unscored:
    """In a reward function's returned list, at a row's place: this row could not be scored (``reason`` says why,
    for the count and the log), through no fault of the response."""

    reason: str

    def __float__(self) -> float:  # never silently a number: a caller that does not expect failures stops here
        raise TypeError(f"an unscored row has no score ({self.reason}); mask it out instead")


def is_unscored(value) -> bool:
    """Whether ``value`` (one entry of a reward function's returned list) marks an unscored row."""
    return isinstance(value, Unscored)


class RewardUnavailable(RuntimeError):
    """Past `reward.max_unscored_share` of a training batch's rows could not be scored: the service behind a reward
    (a sandbox, a judge) is failing, and training on what is left would train on a biased sample of the batch."""
