"""One seed for every random number generator a run draws from."""

from __future__ import annotations

import random

import numpy as np
import torch

from typing import Any

from rlhf.errors import require

MAX_SEED = 2**32 - 2**16  # NumPy takes seeds in [0, 2**32); ranks and workers add small offsets to the run's seed


def check_seed(seed: int) -> None:
    """ConfigError unless ``seed`` (the `seed` key) is one every generator takes."""
    require(0 <= seed < MAX_SEED, f"seed={seed} must be in [0, {MAX_SEED}) (numpy takes no negative seed)")


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_states() -> dict[str, Any]:
    """Every global RNG's state: {"torch", "cuda", "python", "numpy"} (`set_rng_states` puts them back)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def set_rng_states(rng: dict[str, Any]) -> None:
    """Put back the global RNGs as `rng_states` recorded them."""
    torch.set_rng_state(rng["torch"])
    if rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
