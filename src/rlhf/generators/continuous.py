"""Continuing responses across calls, for schedule=stream: `continue_rows(requests, sampling, steps)`.

A request is one row: its key (stable while the row is in flight), its tokens so far (prompt and sampled prefix) and
the tokens it may still sample. The answer, per request: the tokens sampled now, their logprobs, and whether the
row stopped (its stop token among them).

`ContinuousBatch` (the hf generator's) keeps every row's KV cache between calls: rows asked for again continue
where they stopped, rows not asked for leave, new rows are read (prefilled) and join the batch, so the decode never
waits for its longest row and never reads a row twice. New weights drop the batch: the next call reads every row
again under them (its KV recomputed, as a prompt's), and samples on. `continue_by_generate` is the same contract
for any generator with `generate`, each call a new generate on every row's tokens so far (vLLM keeps its rows as
requests of its engine instead: `rlhf.generators.vllm_stream`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import DynamicCache

from rlhf.generators.base import SamplingParams
from rlhf.generators.decode import next_tokens
from rlhf.generators.static_decode import as_attention_mask, cache_columns, cache_shape
from rlhf.models.logprobs import keeps_logits
from rlhf.trajectory import left_pad, real_positions

Request = tuple[int, list[int], int]  # (key, tokens so far, tokens it may still sample)
SLOT_ROWS = 16  # the slot cache grows by multiples of this many rows (rows joining a few at a time copy it rarely)
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


class RowCache:
    """A transformers-style KV cache over a `ContinuousBatch`'s slots for one decode step: row ``i`` writes its new key
    and value at its own column ``columns[i]`` and attends over the first ``width`` columns (the 4D mask passed with
    it says which of them each row holds)."""

    is_compileable = True

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], columns: torch.Tensor, width: int):
        self.keys, self.values, self.columns, self.width = keys, values, columns, width
        self.rows = torch.arange(len(columns), device=columns.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Shapes: key_states, value_states (R, H, 1, D) -> keys, values (R, H, width, D)."""
        rows, keys, values = len(self.rows), self.keys[layer_idx], self.values[layer_idx]
        keys[self.rows, :, self.columns] = key_states[:, :, 0].to(keys.dtype)
        values[self.rows, :, self.columns] = value_states[:, :, 0].to(values.dtype)
        return keys[:rows, :, : self.width], values[:rows, :, : self.width]


class ContinuousBatch:
    """Rows decoding together across `run` calls in the slots of one preallocated KV cache: row ``i`` of the batch is
    slot ``i``, its tokens at columns 0 .. length - 1 (column = position), so a step writes one column per row and
    nothing is concatenated; a row leaving moves at most the rows after it down; the buffers grow (rarely) when a call
    needs more slots or columns, and outlive the rows (a weight push keeps them). Serves the models the static decode
    serves (`rlhf.generators.static_decode.unsupported`)."""

    def __init__(self, model) -> None:
        self.model = model
        self.cache_keys: list[torch.Tensor] = []  # per layer (slots, kv heads, columns, head dim)
        self.cache_values: list[torch.Tensor] = []
        self.clear()

    def clear(self) -> None:
        """No rows in flight (the buffers stay)."""
        self.keys: list[int] = []  # the rows' keys, in slot order
        self.lengths: list[int] = []  # tokens each row holds (prompt and sampled): its next token's column
        self.logits: torch.Tensor | None = None  # (R, V) each row's next-token logits

    @torch.no_grad()
    def run(self, requests: list[Request], sampling: SamplingParams, steps: int, stop_id: int, pad_id: int) -> list[Continued]:
        """Continue each requested row by up to ``steps`` tokens (see the module's contract)."""
        if not requests:
            self.clear()
            return []
        wanted = {key: (tokens, room) for key, tokens, room in requests}
        self._keep([i for i, key in enumerate(self.keys) if key in wanted and len(wanted[key][0]) == self.lengths[i]])
        held = set(self.keys)
        new = [(key, tokens) for key, tokens, _ in requests if key not in held]
        longest = max([len(tokens) for _, tokens in new] + self.lengths)
        # every row moves one column a step, for as many steps as the roomiest row samples: no more than that
        self._room(len(self.keys) + len(new), longest + min(steps, max(room for _, _, room in requests)))
        if new:
            self._add(new, pad_id)
        sampled: dict[int, tuple[list[int], list[float]]] = {key: ([], []) for key in self.keys}
        stopped: set[int] = set()
        device = self.logits.device
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
        """Feed each row its new token at its next column: ``logits`` become the next token's."""
        device = token.device
        columns = torch.tensor(self.lengths, device=device)
        width = max(self.lengths) + 1
        attend = torch.arange(width, device=device)[None, :] <= columns[:, None]  # (R, width)
        dtype = self.cache_keys[0].dtype
        out = self.model(
            input_ids=token[:, None], position_ids=columns[:, None], use_cache=True,
            attention_mask=as_attention_mask(self.model, attend[:, None, None, :], dtype),
            past_key_values=RowCache(self.cache_keys, self.cache_values, columns, width),
        )
        self.logits = out.logits[:, -1].float()
        self.lengths = [n + 1 for n in self.lengths]

    def _keep(self, rows: list[int]) -> None:
        """Only the rows at slots ``rows`` stay, moved to slots 0, 1, ... in that order (only those whose slot changes
        are copied)."""
        if rows == list(range(len(self.keys))):
            return
        if not rows:
            self.clear()
            return
        moved = [(slot, row) for slot, row in enumerate(rows) if slot != row]
        if moved:
            device = self.logits.device
            target, source = (torch.tensor(side, device=device) for side in zip(*moved))
            width = max(self.lengths[row] for _, row in moved)
            for tensor in self.cache_keys + self.cache_values:
                tensor[target, :, :width] = tensor[source, :, :width]
        self.logits = self.logits[torch.tensor(rows, device=self.logits.device)]
        self.keys = [self.keys[i] for i in rows]
        self.lengths = [self.lengths[i] for i in rows]

    def _room(self, rows: int, columns: int) -> None:
        """Buffers of at least ``rows`` slots and ``columns`` columns, the rows held copied over when they grow."""
        have = self.cache_keys[0].shape if self.cache_keys else (0, 0, 0, 0)
        if rows <= have[0] and columns <= have[2]:
            return
        rows, columns = max(-(-rows // SLOT_ROWS) * SLOT_ROWS, have[0]), max(cache_columns(columns), have[2])
        layers, heads, head_dim = cache_shape(self.model.config)
        weight = next(self.model.parameters())
        grown = [torch.zeros(rows, heads, columns, head_dim, dtype=weight.dtype, device=weight.device) for _ in range(2 * layers)]
        held, width = len(self.keys), max(self.lengths, default=0)
        for old, new in zip(self.cache_keys + self.cache_values, grown):
            new[:held, :, :width] = old[:held, :, :width]
        self.cache_keys, self.cache_values = grown[:layers], grown[layers:]

    def _add(self, rows: list[tuple[int, list[int]]], pad_id: int) -> None:
        """Read the new rows' tokens (one left-padded prefill) into the next free slots, each row's cached positions
        moved to columns 0 .. length - 1."""
        device = next(self.model.parameters()).device
        ids, mask = (t.to(device) for t in left_pad([tokens for _, tokens in rows], pad_id))
        positions = real_positions(mask)
        cache = DynamicCache(config=self.model.config)
        keep = {"logits_to_keep": 1} if keeps_logits(self.model) else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, **keep)
        width, first = ids.shape[1], len(self.keys)
        lengths = [len(tokens) for _, tokens in rows]
        source_row = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)], device=device)
        column = torch.tensor([c for n in lengths for c in range(n)], device=device)
        source_column = column + torch.tensor([width - n for n in lengths for _ in range(n)], device=device)
        slot = source_row + first
        for layer, (keys, values) in enumerate(zip(self.cache_keys, self.cache_values)):
            keys[slot, :, column] = cache.layers[layer].keys[source_row, :, source_column].to(keys.dtype)
            values[slot, :, column] = cache.layers[layer].values[source_row, :, source_column].to(values.dtype)
        logits = out.logits[:, -1].float()
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self.keys += [key for key, _ in rows]
        self.lengths += lengths
