"""Prompt datasets and the stream that feeds them to the orchestrator, epoch by epoch.

A factory registered as kind ``dataset`` is called as ``factory(cfg=<dataset config>, tokenizer=..., seed=int)``
and returns a `PromptSplits`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger("rlhf")


@dataclass(frozen=True)
class PromptExample:
    """One prompt: its text, its token ids and what a verifier needs to check a response."""

    text: str
    token_ids: tuple[int, ...]
    ground_truth: Any = None
    origin: str | None = field(default=None, compare=False)  # where its row is, for messages ("p.jsonl line 101")


def origin(example: PromptExample, index: int) -> str:
    """Where ``example``, the ``index``-th (from 0) of the train then eval prompts, came from, for messages: its file
    and line when the dataset recorded them, else its place among the prompts."""
    return example.origin or f"prompt {index + 1} of the dataset's train then eval prompts"


@dataclass(frozen=True)
class PromptSplits:
    train: list[PromptExample]
    eval: list[PromptExample]
    report: dict = field(default_factory=dict)  # what loading kept and dropped, per source


class PromptStream:
    """Draws batches of prompts without replacement; reshuffles and starts a new epoch when exhausted.

    The order is a pure function of (seed, epoch), so a run is reproducible and no prompt is skipped or
    seen twice within an epoch.
    """

    def __init__(self, examples: list[PromptExample], seed: int) -> None:
        if not examples:
            raise ValueError("the training split has no prompts")
        self.examples = examples
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)
        self._ids: dict[str, int] | None = None  # prompt text -> index in ``examples``, built on first use
        self.replay: list[int] = []  # indices drawn again before the stream goes on (drawn but never trained before a resume)
        self._warned_short = False  # warn_if_short has warned

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def next_batch(self, size: int) -> list[PromptExample]:
        """``size`` prompts; a batch may span the end of one epoch and the start of the next. Prompts to `replay` come
        first."""
        self.warn_if_short(size)
        batch = [self.examples[i] for i in self.replay[:size]]
        del self.replay[:size]
        while len(batch) < size:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(size - len(batch), len(self._order) - self.position)
            batch.extend(self.examples[i] for i in self._order[self.position : self.position + take])
            self.position += take
        return batch

    def warn_if_short(self, prompts_per_step: int) -> None:
        """Warn once when a step draws more prompts than the training split holds: some then repeat within the step.
        A warning, not an error: a tiny dataset is legitimate for a smoke run."""
        if prompts_per_step <= len(self.examples) or self._warned_short:
            return
        self._warned_short = True
        log.warning(
            "the training split has %d prompts, fewer than the %d a step draws (train.prompts_per_step), so every step "
            "trains some prompts more than once; add prompts, or set train.prompts_per_step<=%d",
            len(self.examples), prompts_per_step, len(self.examples),
        )

    def state_dict(self) -> dict:
        """Where the stream stands (and what it replays first, when anything); the order follows from (seed, epoch)."""
        state = {"seed": self.seed, "epoch": self.epoch, "position": self.position, "size": len(self.examples)}
        return state | ({"replay": list(self.replay)} if self.replay else {})

    def draws_as(self, state: dict[str, int]) -> bool:
        """Whether a `state_dict` ``state`` is of a stream drawing the same prompts in the same order (size and seed),
        which this one can continue."""
        return state["size"] == len(self.examples) and state["seed"] == self.seed

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not self.draws_as(state):
            raise ValueError(
                f"the checkpoint's prompt stream had {state['size']} prompts and seed {state['seed']}; this run has "
                f"{len(self.examples)} and seed {self.seed}: resuming would replay or skip prompts"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self.replay = list(state.get("replay", []))
        self._order = self._permutation(self.epoch)

    def ids_of(self, texts: list[str]) -> list[int | None]:
        """Each prompt text's index in the training split (its first occurrence), None for a text not in it (an
        environment's own task)."""
        if self._ids is None:
            self._ids = {}
            for index, example in enumerate(self.examples):
                self._ids.setdefault(example.text, index)
        return [self._ids.get(text) for text in texts]

    @property
    def epochs_done(self) -> float:
        """Fractional epochs consumed, for the `epoch` metric."""
        return epochs_done(self.state_dict())


def epochs_done(state: dict[str, int]) -> float:
    """Fractional epochs consumed at a `PromptStream.state_dict` ``state`` (prompts waiting to be replayed not counted)."""
    return state["epoch"] + (state["position"] - len(state.get("replay", ()))) / state["size"]
