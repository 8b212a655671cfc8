"""Shared-prefix packed forwards: the rows of a micro batch that begin with the same prompt, token for token, laid
out once: the prompt, then each row's response (the tokens from the action window's first column to the row's last
real token). A GRPO group's prompt then runs through every token-wise layer once instead of once per sample, and its
backward once, its gradient the sum of the group's (autograd adds up what flows back into shared activations).

Attention (`shared_attention`, reached through `packing.packed_attention`) runs in two blocks: each distinct prompt
causally over itself, (prompts, heads, longest prompt, head dim); each response's tokens as queries over its prompt's
keys and its own, (rows, heads, longest response, longest prompt + longest response), under a boolean mask (the
prompt's real columns, and the response's columns up to the query's own). Every token sees exactly the tokens and
positions it sees in its own row, so logprobs, values and gradients equal the unshared layout's within float rounding.

Rows whose prompts differ from their group's (a template rendered otherwise, a truncation) get a prompt of their own:
laid out unshared, never wrong, and counted (`perf/prefix_unshared_rows`, `unshared_in`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.micro_batches import group_pays, pays
from rlhf.trajectory import Trajectories


@dataclass
class SharedPacked:
    """A micro batch's distinct prompts each once, each followed by the responses of its rows. Shapes: N packed
    tokens, B rows, G distinct prompts, T window columns."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N): a prompt's from 0, a response's on from its prompt's length
    predicts: torch.Tensor  # (B, T): the packed position whose output predicts each window token
    first_predict: int  # the smallest entry of predicts, known on the host
    prompt_index: torch.Tensor  # (G, Wp): packed position of each prompt column (past a prompt's end: its last token)
    query_index: torch.Tensor  # (B, Wr): packed position of each response column (past its end: any of its tokens)
    key_index: torch.Tensor  # (B, Wp + Wr): each row's prompt columns, then its response's
    mask: torch.Tensor  # (B, 1, Wr, Wp + Wr) bool: which keys each response query sees
    tokens_index: torch.Tensor  # (N,): each packed token's place in the prompt outputs then the response outputs
    unshared_rows: int  # rows whose group_id another row of the micro batch has but whose prompt differs

    def attention_kwargs(self) -> dict:
        """Keyword arguments a Hugging Face model passes down to `packing.packed_attention` (`shared_attention`)."""
        return {
            "prompt_index": self.prompt_index, "query_index": self.query_index, "key_index": self.key_index,
            "shared_mask": self.mask, "tokens_index": self.tokens_index,
        }


def row_parts(batch: Trajectories) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """Each row's (prompt's real tokens, response's tokens), read from the device once; None
    when a row has padding between real tokens or no prompt token before the window (no shared layout for it)."""
    start = batch.window_start
    ids, mask = batch.input_ids.cpu(), batch.attention_mask.cpu().bool()
    parts = []
    for row_ids, real in zip(ids.tolist(), mask.tolist()):
        if not any(real):
            return None
        first, last = real.index(True), len(real) - 1 - real[::-1].index(True)
        if first >= start or not all(real[first : last + 1]):
            return None
        parts.append((tuple(row_ids[first:start]), tuple(row_ids[start : last + 1])))
    return parts


def spans_pay(batch: Trajectories) -> bool:
    """Whether sharing may pay, told from ``batch.host_spans`` and the group ids without reading the tokens
    (`micro_batches.group_pays`: every row taken to share its group's prompt): where it is False, `share` reads no
    token. True without `host_spans` (`share` then decides on the tokens alone)."""
    if batch.host_spans is None or not len(batch):
        return True
    first, last = batch.host_spans[:, 0], batch.host_spans[:, 1]
    prompts = (batch.window_start - first).clamp(min=0)
    return group_pays(prompts, (last + 1 - batch.window_start).clamp(min=0), batch.group_id.cpu())


def share(batch: Trajectories, force: bool = False) -> SharedPacked | None:
    """``batch``'s rows in the shared-prefix layout; None where it cannot lay them out (`row_parts`), where no two
    rows share a prompt, or (``force`` false) where sharing does not pay (`micro_batches.pays`)."""
    if not len(batch) or not (force or spans_pay(batch)):
        return None
    parts = row_parts(batch)
    if parts is None:
        return None
    prompts = [p for p, _ in parts]
    lengths = [len(p) for p in prompts]
    if len(set(prompts)) == len(prompts):
        return None
    if not force and not pays(sum(lengths), sum(len(p) for p in set(prompts)), sum(len(r) for _, r in parts)):
        return None
    return laid_out(batch, parts)


def sequence(parts: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[list[int], list[int], list[list[int]], list[list[int]], list[int]]:
    """The packed sequence of rows of ``parts`` (`row_parts`): (its token ids, their positions, each distinct prompt's
    packed positions, each row's response's packed positions, each row's prompt), prompts in order of first use."""
    classes: dict[tuple[int, ...], int] = {}
    members: list[list[int]] = []
    for row, (prompt, _) in enumerate(parts):
        if prompt not in classes:
            classes[prompt] = len(members)
            members.append([])
        members[classes[prompt]].append(row)
    ids: list[int] = []
    positions: list[int] = []
    prompt_at: list[list[int]] = []
    response_at: list[list[int]] = [[] for _ in parts]
    for prompt, rows in zip(classes, members):
        prompt_at.append(list(range(len(ids), len(ids) + len(prompt))))
        ids += prompt
        positions += range(len(prompt))
        for row in rows:
            response = parts[row][1]
            response_at[row] = list(range(len(ids), len(ids) + len(response)))
            ids += response
            positions += range(len(prompt), len(prompt) + len(response))
    return ids, positions, prompt_at, response_at, [classes[p] for p, _ in parts]


def padded(index: list[int], width: int, fill: int) -> list[int]:
    return index + [fill] * (width - len(index))


def laid_out(batch: Trajectories, parts: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> SharedPacked:
    """The shared-prefix layout of rows of ``parts`` (`row_parts`), built on the host and moved to the device once.
    Block columns past a prompt's or a response's end gather any token of it: their outputs are dropped."""
    window = batch.loss_mask.shape[1]
    ids, positions, prompt_at, response_at, row_prompt = sequence(parts)
    wp = max(len(p) for p in prompt_at)
    wr = max(1, max(len(r) for r in response_at))
    prompt_index = [padded(p, wp, p[-1]) for p in prompt_at]
    query_index = [padded(r, wr, (r or prompt_at[g])[-1]) for r, g in zip(response_at, row_prompt)]
    tokens_index = [0] * len(ids)
    for g, p in enumerate(prompt_at):
        for c, pos in enumerate(p):
            tokens_index[pos] = g * wp + c
    base = len(prompt_at) * wp
    for b, r in enumerate(response_at):
        for c, pos in enumerate(r):
            tokens_index[pos] = base + b * wr + c
    # window column t is token start + t, predicted by the token before it: the prompt's last for t = 0, else the
    # response's column t - 1 (columns past the row's end point at its last token: their outputs are masked)
    predicts = []
    for b, r in enumerate(response_at):
        before = [prompt_at[row_prompt[b]][-1], *r]
        predicts.append([before[min(t, len(before) - 1)] for t in range(window)])
    mask = response_mask(
        torch.tensor([len(prompt_at[g]) for g in row_prompt]), torch.tensor([len(r) for r in response_at]), wp, wr
    )
    device = batch.input_ids.device
    tensor = lambda x: torch.tensor(x, dtype=torch.long).to(device, non_blocking=True)
    prompt_index_t, query_index_t = tensor(prompt_index), tensor(query_index)
    return SharedPacked(
        input_ids=tensor(ids).unsqueeze(0),
        position_ids=tensor(positions).unsqueeze(0),
        predicts=tensor(predicts),
        first_predict=min(min(p) for p in predicts) if window else 0,
        prompt_index=prompt_index_t,
        query_index=query_index_t,
        key_index=torch.cat([prompt_index_t[tensor(row_prompt)], query_index_t], dim=1),
        mask=mask.to(device, non_blocking=True),
        tokens_index=tensor(tokens_index),
        unshared_rows=unshared_rows(batch.group_id.tolist(), [p for p, _ in parts]),
    )


def response_mask(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, wp: int, wr: int) -> torch.Tensor:
    """Which keys each response query sees: its prompt's real columns, and its response's columns up to its own.
    Shapes: (B,), (B,) -> (B, 1, wr, wp + wr) bool."""
    query = torch.arange(wr)
    sees_prompt = (torch.arange(wp)[None, :] < prompt_lengths[:, None])[:, None, :].expand(-1, wr, -1)
    sees_response = (query[None, None, :] <= query[None, :, None]) & (query < response_lengths[:, None, None])
    return torch.cat([sees_prompt, sees_response], dim=2).unsqueeze(1)


def unshared_in(batch: Trajectories) -> int:
    """Rows of ``batch`` whose prompt (the real tokens before the action window) differs from that of the first row of
    their group: rows the shared-prefix layout gives a prompt of their own (`perf/prefix_unshared_rows`). One read of
    the device."""
    start = batch.window_start
    ids, mask = batch.input_ids[:, :start].cpu().tolist(), batch.attention_mask[:, :start].cpu().tolist()
    prompts = [tuple(t for t, real in zip(row, keep) if real) for row, keep in zip(ids, mask)]
    return unshared_rows(batch.group_id.cpu().tolist(), prompts)


def unshared_rows(group_ids: list[int], prompts: list[tuple[int, ...]]) -> int:
    """Rows whose prompt differs from that of the first row of their group (by ``group_ids``) among these rows."""
    first: dict[int, tuple[int, ...]] = {}
    count = 0
    for group, prompt in zip(group_ids, prompts):
        if group in first and first[group] != prompt:
            count += 1
        first.setdefault(group, prompt)
    return count


def heads_for(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(key, value, whether SDPA groups the heads itself) for grouped-query attention: SDPA's own grouping where it
    keeps a fused kernel (CUDA in half precision), else the key/value heads repeated, as transformers does. Shapes:
    query (R, H, W, D), key and value (R, Hkv, W', D)."""
    groups = query.shape[1] // key.shape[1]
    fused = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256
    if groups > 1 and not fused:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return key, value, groups > 1 and fused


def gathered(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Packed tokens ``index`` of ``t`` as a block. Shapes: t (1, H, N, D), index (R, W) -> (R, H, W, D)."""
    return t[0].index_select(1, index.reshape(-1)).unflatten(1, index.shape).transpose(0, 1)


def shared_attention(query, key, value, scaling, kwargs: dict) -> torch.Tensor:
    """Attention of a `SharedPacked` layout (its `attention_kwargs` in ``kwargs``): each prompt causally over itself,
    each response over its prompt and itself. Shapes: query (1, H, N, D), key and value (1, Hkv, N, D) -> (1, N, H, D)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    prompts = kwargs["prompt_index"]
    q, k, v = (gathered(t, prompts) for t in (query, key, value))
    k, v, gqa = heads_for(q, k, v)
    prompt_out = sdpa(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    q = gathered(query, kwargs["query_index"])
    k, v = (gathered(t, kwargs["key_index"]) for t in (key, value))
    k, v, gqa = heads_for(q, k, v)
    response_out = sdpa(q, k, v, attn_mask=kwargs["shared_mask"], scale=scaling, enable_gqa=gqa)
    heads, dim = prompt_out.shape[1], prompt_out.shape[3]
    out = torch.cat([
        prompt_out.transpose(1, 2).reshape(-1, heads, dim), response_out.transpose(1, 2).reshape(-1, heads, dim),
    ])
    return out.index_select(0, kwargs["tokens_index"]).unsqueeze(0)
