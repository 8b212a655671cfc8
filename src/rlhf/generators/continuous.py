"""Continuing responses across calls, for schedule=stream: `continue_rows(requests, sampling, steps)`.

A request is one row: its key (stable while the row is in flight), its tokens so far (prompt and sampled prefix) and
the tokens it may still sample. The answer, per request: the tokens sampled now, their logprobs, and whether the
row stopped (its stop token among them).

`ContinuousBatch` (the hf generator's) keeps every row's KV cache between calls: rows asked for again continue
where they stopped, rows not asked for leave, new rows are read (prefilled) and join the batch, so the decode never
waits for its longest row and never reads a row twice. New weights drop the batch: the next call reads every row
again under them (its KV recomputed, as a prompt's), and samples on. `continue_by_generate` is the same contract
for any generator with `generate` (vLLM: its prefix cache spares most of the re-read until the weights change).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import DynamicCache

from rlhf.generators.base import SamplingParams
from rlhf.generators.decode import next_tokens
from rlhf.models.logprobs import keeps_logits
from rlhf.trajectory import left_pad, real_positions

Request = tuple[int, list[int], int]  # (key, tokens so far, tokens it may still sample)
Continued = tuple[list[int], list[float], bool]  # (tokens sampled now, their logprobs, stopped)


def continue_by_generate(generator, requests: list[Request], sampling: SamplingParams, steps: int) -> list[Continued]:
    """`continue_rows` through one `generate` call on each row's tokens: at most ``steps`` more tokens a row, never
    past its room."""
    if not requests:
        return []
    budget = min(steps, max(room for _, _, room in requests))
    out = generator.generate([tokens for _, tokens, _ in requests], replace(sampling, max_new_tokens=budget))
    ids, mask, logp, stopped = (t.cpu() for t in (out.window_ids, out.loss_mask, out.gen_logp, out.stopped))
    answers = []
    for i, (_, _, room) in enumerate(requests):
        sampled = int(mask[i].sum())
        take = min(sampled, room)
        answers.append((ids[i, :take].tolist(), logp[i, :take].tolist(), bool(stopped[i]) and take == sampled))
    return answers


def _left_pad_layer(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """A cached (B, H, L, D) tensor padded with zeros before its first column to ``width`` columns."""
    grow = width - tensor.shape[2]
    return torch.nn.functional.pad(tensor, (0, 0, grow, 0)) if grow else tensor


class ContinuousBatch:
    """Rows decoding together across `run` calls, each with its KV cache, mask, next position and next-token logits."""

    def __init__(self, model) -> None:
        self.model = model
        self._clear()

    def _clear(self) -> None:
        """No rows in flight."""
        self.keys: list[int] = []  # the rows' keys, in the order the cache holds them
        self.lengths: list[int] = []  # tokens each row holds (prompt and sampled)
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # (R, L) 1 for real cached tokens
        self.last: torch.Tensor | None = None  # (R,) position of each row's last token
        self.logits: torch.Tensor | None = None  # (R, V) each row's next-token logits

    @torch.no_grad()
    def run(self, requests: list[Request], sampling: SamplingParams, steps: int, stop_id: int, pad_id: int) -> list[Continued]:
        """Continue each requested row by up to ``steps`` tokens (see the module's contract)."""
        if not requests:
            self._clear()
            return []
        wanted = {key: (tokens, room) for key, tokens, room in requests}
        self._keep([i for i, key in enumerate(self.keys) if key in wanted and len(wanted[key][0]) == self.lengths[i]])
        held = set(self.keys)
        new = [(key, tokens) for key, tokens, _ in requests if key not in held]
        if new:
            self._add(new, pad_id)
        sampled: dict[int, tuple[list[int], list[float]]] = {key: ([], []) for key in self.keys}
        stopped: set[int] = set()
        device = self.last.device
        room = torch.tensor([wanted[key][1] for key in self.keys], device=device)
        alive = room > 0
        rows = torch.arange(len(self.keys), device=device)
        for _ in range(steps):  # a row that ends stays in the batch until the call ends (one compaction per call)
            if not bool(alive.any()):
                break
            token, logp = next_tokens(self.logits, rows, len(rows), sampling)
            tokens, logps = token.tolist(), logp.tolist()
            for i in alive.nonzero().squeeze(1).tolist():
                sampled[self.keys[i]][0].append(tokens[i])
                sampled[self.keys[i]][1].append(logps[i])
            ends = alive & (token == stop_id)
            stopped.update(self.keys[i] for i in ends.nonzero().squeeze(1).tolist())
            room = room - 1
            alive = alive & ~ends & (room > 0)
            if bool(alive.any()):
                self._forward(token)
        self._keep(alive.nonzero().squeeze(1).tolist())
        return [(*sampled.get(key, ([], [])), key in stopped) for key, _, _ in requests]

    def _forward(self, token: torch.Tensor) -> None:
        """Feed each row its new token: the cache grows a column and ``logits`` become the next token's."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.keys), 1)], dim=1)
        self.last = self.last + 1
        out = self.model(input_ids=token[:, None], attention_mask=self.mask, position_ids=self.last[:, None],
                         past_key_values=self.cache, use_cache=True)
        self.logits = out.logits[:, -1].float()
        self.lengths = [n + 1 for n in self.lengths]

    def _keep(self, rows: list[int]) -> None:
        """Only the rows at batch positions ``rows`` stay; columns no remaining row uses go."""
        if len(rows) == len(self.keys):
            return
        if not rows:
            self._clear()
            return
        index = torch.tensor(rows, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.last, self.logits = self.mask[index], self.last[index], self.logits[index]
        self.keys = [self.keys[i] for i in rows]
        self.lengths = [self.lengths[i] for i in rows]
        first = int(self.mask.any(dim=0).float().argmax())  # leading columns that only padding fills
        if first:
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def _add(self, rows: list[tuple[int, list[int]]], pad_id: int) -> None:
        """Read the new rows' tokens (one prefill) and join them to the batch, caches aligned on the right."""
        device = next(self.model.parameters()).device
        ids, mask = (t.to(device) for t in left_pad([tokens for _, tokens in rows], pad_id))
        positions = real_positions(mask)
        cache = DynamicCache(config=self.model.config)
        keep = {"logits_to_keep": 1} if keeps_logits(self.model) else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, **keep)
        logits, last = out.logits[:, -1].float(), positions[:, -1]
        if self.cache is not None:
            width = max(self.mask.shape[1], mask.shape[1])
            for mine, theirs in zip(self.cache.layers, cache.layers):
                mine.keys = torch.cat([_left_pad_layer(mine.keys, width), _left_pad_layer(theirs.keys, width)])
                mine.values = torch.cat([_left_pad_layer(mine.values, width), _left_pad_layer(theirs.values, width)])
            pad = lambda m: torch.nn.functional.pad(m, (width - m.shape[1], 0))  # noqa: E731
            mask = torch.cat([pad(self.mask), pad(mask)])
            logits, last = torch.cat([self.logits, logits]), torch.cat([self.last, last])
            cache = self.cache
        self.cache, self.mask, self.logits, self.last = cache, mask, logits, last
        self.keys += [key for key, _ in rows]
        self.lengths += [len(tokens) for _, tokens in rows]
