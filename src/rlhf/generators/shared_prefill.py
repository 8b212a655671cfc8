"""Shared prompt prefill: rows that carry the same prompt (a GRPO group's n samples) run its prompt pass once.

The prompt pass of a decode computes every prompt token of every row; when n rows hold one prompt token for token,
n - 1 of those passes compute what the first one does. Here the distinct prompts of a batch are found by their token
ids (`prompt_groups`), the prompt pass runs on them only, and its key/value cache and last-position logits are copied
to every row holding that prompt (`expand_cache`, ``logits[owner]``); decoding then goes on per row exactly as before,
each row sampling its own tokens. Rows whose prompts differ in any token are distinct prompts: each is prefilled on
its own, as without sharing.

`generator.share_prompt_prefill=auto` shares where it pays (`shares`): when the prompt-pass work it saves per row,
prompt tokens not computed x the model's parameters, reaches `AUTO_SAVED_WORK_PER_ROW`. Below that a call gains a few
milliseconds at most (the built-in 83k-parameter model's 0.05 s calls ran 0.82-1.43x shared over two runs, inside
this machine's noise), and sharing would move the prompt pass's float rounding (a matrix product over fewer rows
rounds otherwise), which could change a seeded run's samples and the recorded curves of `tests/golden`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHARE_MODES = ("auto", "true", "false")
# `auto` shares when prompt tokens saved per row x parameters reach this: the built-in task (83k parameters, 4-6-token
# prompts, 8 samples: 4.4 tokens a row, 0.37M) stays unshared; 6-token prompts x 8 samples on a 3M model (17M), where
# the whole call ran 1.17-1.25x shared, and every shape of SmolLM2 (135M parameters) share. `bench/shared_prefix.py`
# measures both sides of it (docs/generation.md)
AUTO_SAVED_WORK_PER_ROW = 2_000_000


@dataclass(frozen=True)
class PromptGroups:
    """Which rows of a batch hold the same prompt. Shapes: firsts (U,) long, the first row of each distinct prompt,
    ascending; owner (B,) long, the index into ``firsts`` of each row's prompt."""

    firsts: torch.Tensor
    owner: torch.Tensor

    @property
    def distinct(self) -> int:
        return len(self.firsts)

    @property
    def rows(self) -> int:
        return len(self.owner)

    def alone(self) -> int:
        """Rows whose prompt no other row of the batch holds (prefilled alone, shared or not)."""
        return int((torch.bincount(self.owner, minlength=self.distinct) == 1).sum())

    def to(self, device: torch.device) -> "PromptGroups":
        return PromptGroups(self.firsts.to(device), self.owner.to(device))


def prompt_groups(prompts: list[list[int]]) -> PromptGroups:
    """The distinct prompts of ``prompts`` by their token ids, token for token, wherever in the list they sit."""
    index: dict[tuple[int, ...], int] = {}
    firsts, owner = [], []
    for row, prompt in enumerate(prompts):
        key = tuple(prompt)
        if key not in index:
            index[key] = len(firsts)
            firsts.append(row)
        owner.append(index[key])
    return PromptGroups(torch.tensor(firsts, dtype=torch.long), torch.tensor(owner, dtype=torch.long))


def saved_tokens(prompts: list[list[int]], groups: PromptGroups) -> int:
    """Prompt tokens a shared prefill does not compute: every row's, less each distinct prompt's once."""
    return sum(len(p) for p in prompts) - sum(len(prompts[row]) for row in groups.firsts.tolist())


def shares(mode: str, prompts: list[list[int]], groups: PromptGroups, params: int) -> bool:
    """Whether a decode of ``prompts`` by a model of ``params`` parameters prefills each distinct prompt once:
    `generator.share_prompt_prefill` ``mode`` (`SHARE_MODES`); `auto` when the saved prompt tokens x ``params`` per row
    reach `AUTO_SAVED_WORK_PER_ROW`. A batch with no repeated prompt never shares (there is nothing to share)."""
    if mode == "false" or groups.distinct == groups.rows:
        return False
    if mode == "true":
        return True
    return saved_tokens(prompts, groups) * params >= AUTO_SAVED_WORK_PER_ROW * groups.rows


def expand_cache(cache, owner: torch.Tensor) -> None:
    """Give row ``i`` of a transformers cache the keys and values of its row ``owner[i]``, in place (a prompt pass
    over the distinct prompts becomes the batch's). Shape: owner (B,) long."""
    cache.batch_select_indices(owner)
