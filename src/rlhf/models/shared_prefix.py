"""Shared-prefix packed forwards: the rows of a micro batch that begin with the same prompt, token for token, laid
out once: the prompt, then each row's response (the tokens from the action window's first column to the row's last
real token). A GRPO group's prompt then runs through every token-wise layer once instead of once per sample, and its
backward once, its gradient the sum of the group's (autograd adds up what flows back into shared activations).

Attention (`shared_attention`, reached through `packing.packed_attention`) runs in two blocks: each distinct prompt
causally over itself, (prompts, heads, longest prompt, head dim); each response's tokens as queries over its prompt's
keys and its own, (rows, heads, longest response, longest prompt + longest response), under a boolean mask (the
prompt's real columns, and the response's columns up to the query's own). Every token sees exactly the tokens and
positions it sees in its own row, so logprobs, values and gradients equal the unshared layout's within float rounding.

Multi-turn episodes (`rlhf.envs.rows`) share more than their prompt where they agree past it: rows of one prompt
whose first turns agree (the same answer, so the same observation after it) take those turns from the prefix too
(`prefixes`), and each row's rest starts where it stops agreeing. An agreed action token inside the loss mask is then
computed once; its output feeds the logprob of every row that takes it, and autograd adds up their gradients, as the
unshared layout's separate copies would.

Rows whose prompts differ from their group's (a template rendered otherwise, a truncation) get a prompt of their own:
laid out unshared, never wrong, and counted (`perf/prefix_unshared_rows`, `unshared_in`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.micro_batches import group_pays, pays
from rlhf.models.cpu_attention import sdpa
from rlhf.trajectory import Trajectories


@dataclass
class SharedPacked:
    """A micro batch's distinct prompts each once (with the turns its rows agree on past it, `prefixes`), each
    followed by the rest of each of its rows. Shapes: N packed tokens, B rows, G distinct prompts, T window columns."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N): a prefix's from 0, a row's rest's on from the prefix tokens it takes
    predicts: torch.Tensor  # (B, T): the packed position whose output predicts each window token
    first_predict: int  # the smallest entry of predicts, known on the host
    prompt_index: torch.Tensor  # (G, Wp): packed position of each prefix column (past a prefix's end: its last token)
    query_index: torch.Tensor  # (B, Wr): packed position of each column of a row's rest (past its end: any token)
    key_index: torch.Tensor  # (B, Wp + Wr): each row's prefix columns, then its rest's
    mask: torch.Tensor  # (B, 1, Wr, Wp + Wr) bool: which keys each query of a row's rest sees
    tokens_index: torch.Tensor  # (N,): each packed token's place in the prefix outputs then the rest outputs
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
    rows share a prompt, or (``force`` false) where sharing does not pay (`micro_batches.pays`, the tokens each row
    takes from a prefix counted as its prompt's)."""
    if not len(batch) or not (force or spans_pay(batch)):
        return None
    parts = row_parts(batch)
    if parts is None:
        return None
    heads, row_class, shared = prefixes(parts)
    if len(heads) == len(parts):
        return None
    rest = sum(len(p) + len(r) for p, r in parts) - sum(shared)
    if not force and not pays(sum(shared), sum(len(h) for h in heads), rest):
        return None
    return laid_out(batch, parts, heads, row_class, shared)


def common_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefixes(parts: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[list[tuple[int, ...]], list[int], list[int]]:
    """(each class's shared prefix, each row's class, how many of its first tokens each row takes from its class's
    prefix) for rows of ``parts`` (`row_parts`), classes in order of first use. Rows of one prompt form a class. Its
    prefix is the prompt, and past it (multi-turn episodes whose first turns agree) the tokens of its leader, the row
    that agrees longest with the others in sum, as far as another row agrees with them; each row takes the prompt and
    as much more as it agrees with the leader."""
    classes: dict[tuple[int, ...], list[int]] = {}
    for row, (prompt, _) in enumerate(parts):
        classes.setdefault(prompt, []).append(row)
    heads, row_class, shared = [], [0] * len(parts), [0] * len(parts)
    for c, (prompt, rows) in enumerate(classes.items()):
        responses = [parts[r][1] for r in rows]
        leader, taken = leading(responses)
        heads.append(prompt + responses[leader][: taken[leader]])
        for row, extra in zip(rows, taken):
            row_class[row], shared[row] = c, len(prompt) + extra
    return heads, row_class, shared


def leading(responses: list[tuple[int, ...]]) -> tuple[int, list[int]]:
    """(the index of the response that agrees longest with the others in sum, the first of them on a tie; how many
    leading tokens each response agrees on with it, the leader's own the most of the others'). Sorted, two responses
    agree on the least of the agreements of the neighbours between them: one pass over the tokens, not one per pair."""
    order = sorted(range(len(responses)), key=lambda i: (responses[i], i))
    between = [common_length(responses[a], responses[b]) for a, b in zip(order, order[1:])]
    best: tuple[int, int] | None = None
    agreed: list[int] = []
    for k in range(len(order)):
        agree = [0] * len(order)  # by sorted place
        for step in (1, -1):
            run, j = None, k + step
            while 0 <= j < len(order):
                edge = between[min(j, j - step)]
                run = edge if run is None else min(run, edge)
                agree[j] = run
                j += step
        key = (sum(agree), -order[k])
        if best is None or key > best:
            best, agreed = key, agree
    leader = -best[1]
    taken = [0] * len(responses)
    for place, index in enumerate(order):
        taken[index] = agreed[place]
    taken[leader] = max((t for i, t in enumerate(taken) if i != leader), default=0)
    return leader, taken


def sequence(
    parts: list[tuple[tuple[int, ...], tuple[int, ...]]], heads: list[tuple[int, ...]], row_class: list[int],
    shared: list[int],
) -> tuple[list[int], list[int], list[list[int]], list[list[int]]]:
    """The packed sequence of rows of ``parts`` (`row_parts`) over the prefixes of `prefixes`: (its token ids, their
    positions, each class's prefix's packed positions, each row's rest's packed positions): each prefix, then the
    rest of each row of its class (its tokens past the ones it takes from the prefix)."""
    ids: list[int] = []
    positions: list[int] = []
    prefix_at: list[list[int]] = []
    rest_at: list[list[int]] = [[] for _ in parts]
    for c, head in enumerate(heads):
        prefix_at.append(list(range(len(ids), len(ids) + len(head))))
        ids += head
        positions += range(len(head))
        for row in (r for r, rc in enumerate(row_class) if rc == c):
            prompt, response = parts[row]
            rest = response[shared[row] - len(prompt) :]
            rest_at[row] = list(range(len(ids), len(ids) + len(rest)))
            ids += rest
            positions += range(shared[row], shared[row] + len(rest))
    return ids, positions, prefix_at, rest_at


def padded(index: list[int], width: int, fill: int) -> list[int]:
    return index + [fill] * (width - len(index))


def laid_out(
    batch: Trajectories, parts: list[tuple[tuple[int, ...], tuple[int, ...]]], heads: list[tuple[int, ...]],
    row_class: list[int], shared: list[int],
) -> SharedPacked:
    """The shared-prefix layout of rows of ``parts`` (`row_parts`) over the prefixes of `prefixes`, built on the host
    and moved to the device once. Block columns past a prefix's or a rest's end gather any token of it: their outputs
    are dropped."""
    window = batch.loss_mask.shape[1]
    ids, positions, prefix_at, rest_at = sequence(parts, heads, row_class, shared)
    wp = max(len(p) for p in prefix_at)
    wr = max(1, max(len(r) for r in rest_at))
    prompt_index = [padded(p, wp, p[-1]) for p in prefix_at]
    query_index = [padded(r, wr, (r or prefix_at[g][: k])[-1]) for r, g, k in zip(rest_at, row_class, shared)]
    tokens_index = [0] * len(ids)
    for g, p in enumerate(prefix_at):
        for c, pos in enumerate(p):
            tokens_index[pos] = g * wp + c
    base = len(prefix_at) * wp
    for b, r in enumerate(rest_at):
        for c, pos in enumerate(r):
            tokens_index[pos] = base + b * wr + c
    # window column t is the row's token len(prompt) + t, predicted by the token before it, wherever that lies: in
    # the prefix (the prompt's last for t = 0, or, past the prompt, a turn the class's rows agree on) or in the row's
    # rest (columns past the row's end point at its last token: their outputs are masked)
    predicts = []
    for b, r in enumerate(rest_at):
        before = prefix_at[row_class[b]][: shared[b]] + r
        first = len(parts[b][0]) - 1
        predicts.append([before[min(first + t, len(before) - 1)] for t in range(window)])
    mask = response_mask(torch.tensor(shared), torch.tensor([len(r) for r in rest_at]), wp, wr)
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
        key_index=torch.cat([prompt_index_t[tensor(row_class)], query_index_t], dim=1),
        mask=mask.to(device, non_blocking=True),
        tokens_index=tensor(tokens_index),
        unshared_rows=unshared_rows(batch.group_id.tolist(), [p for p, _ in parts]),
    )


def response_mask(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, wp: int, wr: int) -> torch.Tensor:
    """Which keys each query of a row's rest sees: the first ``prompt_lengths`` columns of its prefix (the tokens it
    takes from it), and its rest's columns up to its own. Shapes: (B,), (B,) -> (B, 1, wr, wp + wr) bool."""
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
