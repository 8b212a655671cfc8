"""Responses in flight: sampled a chunk of tokens at a time, so new weights can load between chunks.

A `Row` keeps what it has sampled so far, each token with its logprob and the policy version that sampled it. The
streaming schedule calls `advance` on every unfinished row: one generate call continues each row from its prompt and
the tokens it holds, for at most ``chunk`` more tokens, under whatever weights the generator holds now
(the hf generator keeps each row's KV cache between calls, `rlhf.generators.continuous`; vLLM keeps each row a request
of its engine, `rlhf.generators.vllm_stream`; both read every row again after new weights). An unfinished response
therefore continues under new weights, its new tokens sampled by them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import torch

from rlhf.data.prompts import PromptExample
from rlhf.generators.base import SamplingParams
from rlhf.trajectory import Trajectories, from_completions, left_pad


_KEYS = itertools.count()  # row keys, unique in the process


@dataclass
class Row:
    """One response being sampled, possibly under several policy versions."""

    prompt: tuple[int, ...]  # the prompt's token ids
    key: int = field(default_factory=lambda: next(_KEYS))  # names the row to the generator while it is in flight
    tokens: list[int] = field(default_factory=list)  # sampled so far
    logprobs: list[float] = field(default_factory=list)  # the generator's logprob of each, under the version that sampled it
    versions: list[int] = field(default_factory=list)  # the policy version that sampled each
    stopped: bool = False  # ended by the stop token

    def done(self, limit: int) -> bool:
        """Stopped, or holding ``limit`` tokens (`generator.max_new_tokens`)."""
        return self.stopped or len(self.tokens) >= limit


@dataclass
class Group:
    """A prompt's ``samples_per_prompt`` rows, in flight together and trained together."""

    index: int  # draw order: the streaming schedule trains groups in this order
    example: PromptExample
    rows: list[Row]

    @classmethod
    def of(cls, index: int, example: PromptExample, size: int) -> "Group":
        return cls(index, example, [Row(tuple(example.token_ids)) for _ in range(size)])

    def done(self, limit: int) -> bool:
        return all(row.done(limit) for row in self.rows)


def advance(generator, rows: list[Row], sampling: SamplingParams, chunk: int, version: int) -> int:
    """Sample up to ``chunk`` more tokens for each unfinished row (``version``: the weights ``generator`` holds) with
    its `continue_rows` (`rlhf.generators.continuous`). Rows never pass `sampling.max_new_tokens`; a stop token ends
    a row. Returns the tokens sampled."""
    limit = sampling.max_new_tokens
    rows = [row for row in rows if not row.done(limit)]
    if not rows:
        return 0
    requests = [(row.key, list(row.prompt) + row.tokens, limit - len(row.tokens)) for row in rows]
    answers = generator.continue_rows(requests, sampling, chunk)
    sampled = 0
    for row, (tokens, logprobs, stopped) in zip(rows, answers):
        row.tokens += tokens
        row.logprobs += logprobs
        row.versions += [version] * len(tokens)
        row.stopped = stopped
        sampled += len(tokens)
    return sampled


def group_batch(group: Group, pad_id: int) -> Trajectories:
    """A finished group's rows as single-turn trajectories (group id 0), with ``extras['token_versions']`` (B, T)
    long: the version that sampled each response token (0 past a row's end, as `concat` pads it)."""
    rows = group.rows
    query_ids, query_mask = left_pad([list(row.prompt) for row in rows], pad_id)
    width = max(1, max(len(row.tokens) for row in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width))
    logp = torch.zeros((len(rows), width))
    versions = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row.tokens)
        ids[i, :n] = torch.tensor(row.tokens, dtype=torch.long)
        mask[i, :n] = 1.0
        logp[i, :n] = torch.tensor(row.logprobs)
        versions[i, :n] = torch.tensor(row.versions, dtype=torch.long)
    stopped = torch.tensor([row.stopped for row in rows])
    batch = from_completions(query_ids, query_mask, ids, mask, logp, stopped)
    return replace(batch, group_id=torch.zeros(len(rows), dtype=torch.long), extras={"token_versions": versions})
