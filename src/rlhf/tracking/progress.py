"""The live progress bar a terminal shows under the log lines (`logging.progress_bar`)."""

from __future__ import annotations

import os
import sys
from contextlib import ExitStack
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

PROGRESS_BAR_CHOICES = ("auto", "true", "false")
# (metric, label, format) shown after the bar; the bar itself gives the step and the ETA
BAR_FIELDS = (
    ("objective/scores", "score", "{:+.3f}"),
    ("objective/kl", "kl", "{:.4f}"),
    ("time/step", "s/step", "{:.2f}"),
)
BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| step {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"


def wants_bar(setting: object, stream: TextIO) -> bool:
    """`logging.progress_bar`: true or false as given; auto = only if ``stream`` is a terminal (not CI, not a file)."""
    choice = str(setting).lower()
    if choice == "auto":
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    return choice == "true"


def postfix(metrics: dict[str, float]) -> str:
    """`score +0.125, kl 0.0031, s/step 0.42` from the step's metrics (the fields it has)."""
    return ", ".join(f"{label} {fmt.format(metrics[key])}" for key, label, fmt in BAR_FIELDS if key in metrics)


class ProgressBar:
    """A tqdm bar on stderr, opened at the first step it sees; log records print above it while it is open."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.bar: tqdm | None = None
        self.redirect = ExitStack()

    def update(self, step: int, num_steps: int, metrics: dict[str, float]) -> None:
        """Move the bar to ``step`` (a resumed run starts it at its first step) and show the step's metrics."""
        if self.bar is None:
            self._open(step - 1, num_steps)
        self.bar.set_postfix_str(postfix(metrics), refresh=False)
        self.bar.update(step - self.bar.n)

    def _open(self, done: int, num_steps: int) -> None:
        # the console handlers (Hydra's, on the root logger) write through tqdm so lines never tear the bar
        self.redirect.enter_context(logging_redirect_tqdm())
        self.bar = tqdm(
            total=num_steps, initial=done, file=self.stream, desc="train ", bar_format=BAR_FORMAT,
            dynamic_ncols=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.redirect.close()
