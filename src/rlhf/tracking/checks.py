"""`logging.*` checks that need no model, run by `rlhf.config.validate` before anything loads."""

from __future__ import annotations

import importlib.util

from rlhf.errors import require
from rlhf.tracking.progress import PROGRESS_BAR_CHOICES
from rlhf.tracking.wandb_run import WANDB_MODES


def check_logging(logging_cfg) -> None:
    """The sample tables' counts, the progress bar and W&B keys: known choices, and wandb installed when
    `logging.wandb=true`."""
    for key in ("sample_every", "num_sample_texts"):
        require(logging_cfg[key] >= 0, f"logging.{key}={logging_cfg[key]} must be >= 0")
    bar = str(logging_cfg.progress_bar).lower()
    require(
        bar in PROGRESS_BAR_CHOICES,
        f"logging.progress_bar={logging_cfg.progress_bar!r}; choose one of {', '.join(PROGRESS_BAR_CHOICES)}",
    )
    mode = logging_cfg.wandb_mode
    require(
        mode is None or mode in WANDB_MODES,
        f"logging.wandb_mode={mode!r}; choose one of {', '.join(WANDB_MODES)}, or null to read WANDB_MODE",
    )
    require(
        not logging_cfg.wandb or importlib.util.find_spec("wandb") is not None,
        "logging.wandb=true needs the wandb package: pip install 'rlhf[wandb]' (or pip install wandb), "
        "or set logging.wandb=false",
    )
