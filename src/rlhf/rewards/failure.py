"""A row a reward could not score for a reason of its own: not the response's fault, so not a score.

A reward function returns `Unscored(reason)` in a row's place when its machinery failed for that row: a sandbox that
died for reasons of its own, a judge that timed out or answered garbage, a service out of reach. Such a row is not a
zero: a zero would tell the policy its response was bad, and bias every advantage of its group. `RewardSet` asks such
rows again (`retry_failed`), the `Collector` masks what is left out of the loss and out of their group's statistics
and counts them (`reward/unscored_*`).

The same rule serves an environment or agent episode that failed (it raised, timed out, answered malformed): it is
played again through `retry_failed` (`env.failed_retries`), then masked and counted (`env/failed_*`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


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


def retry_failed(values: list, failed: Callable[[Any], bool], again: Callable[[list[int]], list], retries: int) -> tuple[list, int]:
    """``values`` with each entry that ``failed`` asked again, alone with the others that failed (``again(rows)``
    returns new entries for those rows, in order), up to ``retries`` more times; and how many entries were asked
    again in all. An entry that succeeded is never asked again."""
    values, asked = list(values), 0
    for _ in range(retries):
        rows = [row for row, value in enumerate(values) if failed(value)]
        if not rows:
            break
        for row, value in zip(rows, again(rows), strict=True):
            values[row] = value
        asked += len(rows)
    return values, asked
