"""What the bench scripts' tests may ask of a figure timed on a shared machine."""

from __future__ import annotations

import math


def measured(mfu: float) -> bool:
    """An MFU measured on a shared CPU is a figure to print, not a bound: the matmul peak it divides by may have been
    timed while other work slowed it (an MFU of 1.09 was seen), so only a finite, positive figure is asked for."""
    return math.isfinite(mfu) and mfu > 0
