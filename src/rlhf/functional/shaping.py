"""Reward shaping on a response's length (DAPO, Yu et al. 2025, arXiv:2503.14476, section 3.4).

Overlong reward shaping: a response is free up to ``max_len - buffer_len`` tokens; inside the last ``buffer_len``
tokens of the budget its reward falls linearly, reaching ``-factor`` at ``max_len``. A long but finished answer
so costs a little instead of being treated like a truncated one.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """Reward added to each response: ``min(0, (max_len - buffer_len - L) / buffer_len) * factor``.

    Shape: lengths (B,) generated tokens per response -> (B,) float, 0 up to ``max_len - buffer_len`` tokens,
    ``-factor`` at ``max_len``.
    """
    if not 1 <= buffer_len <= max_len:
        raise ValueError(f"buffer_len={buffer_len} must be in [1, max_len={max_len}]")
    excess = lengths.float() - (max_len - buffer_len)  # tokens into the buffer; <= 0 before it
    return -(excess / buffer_len).clamp(min=0) * factor
