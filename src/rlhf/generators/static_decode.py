"""The hf generator's fast decode: a preallocated KV cache and one fixed-shape step per batch bucket.

The eager loop (`rlhf.generators.decode`) grows its cache every token, reads a stop flag from the device every token
and launches every kernel from Python. Here everything a step touches lives in buffers allocated once per shape
(`SlotState`): the cache, the attention mask over all its columns, the input token and position of every row, the
rows' outputs. The step (`decode_step`) reads and advances those buffers in place and returns nothing, so it can be
compiled once and, on CUDA, recorded as a CUDA graph per bucket and replayed with no host work at all. The host looks
at the stop flags every ``check_every`` steps only; then it ends the decode when every row has stopped, and moves the
rows still going into a smaller bucket when they fit one and the move pays (`move_pays`; the eager loop drops a row
the step it stops; here finished rows ride along, masked, until the next check). With CUDA graphs the buckets are the
powers of 2 below the batch size and the batch size itself (each records a graph); without graphs every batch size
is one (a compiled step serves them all), so no row is padded. A move copies only the rows past the new bucket, into
slots whose rows have stopped, and of the cache only the columns written so far (`fill_holes`, `SlotState.move`). The
prompts go in packed where the model's attention takes packed rows (`StaticDecoder._packed_pass`): only their real
tokens are computed, and their keys and values land in the left-padded layout the steps read.

Rows sit in *slots*: slot ``i`` of a bucket of ``b`` rows is row ``i`` of every buffer, and a bucket's buffers are the
first ``b`` rows of the largest one's, so every bucket shares one cache. Weights are read where they live: a weight
push (an in-place copy) reaches the recorded graphs; a sleep frees the cache and the graphs with the weights (the next
decode allocates and records again).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rlhf.generators.base import SamplingParams
from rlhf.generators.decode import top_p_filter
from rlhf.generators.shared_prefill import PromptGroups
from rlhf.models.grouped_attention import NAME as GROUPED
from rlhf.models.logprobs import keeps_logits
from rlhf.models.packing import can_pack, rows_attention_kwargs, token_places, unread_mask
from rlhf.trajectory import real_positions

log = logging.getLogger("rlhf")

CACHE_COLUMNS = 64  # cache lengths are rounded up to a multiple of this, so calls of similar lengths share buffers
ATTENTION = ("sdpa", GROUPED, "eager")  # the attention implementations that take the boolean / additive 4D mask built here


def cache_columns(tokens: int) -> int:
    """The cache length that holds ``tokens`` positions: rounded up to a multiple of `CACHE_COLUMNS`."""
    return -(-tokens // CACHE_COLUMNS) * CACHE_COLUMNS


def bucket_for(rows: int, buckets: tuple[int, ...] | None) -> int:
    """The smallest bucket holding ``rows`` rows (``buckets`` sorted ascending; None: every batch size is one)."""
    if buckets is None:
        return rows
    for size in buckets:
        if size >= rows:
            return size
    raise ValueError(f"{rows} rows do not fit generator.buckets={list(buckets)}: add a bucket of at least {rows}")


def race_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A draw from each row's distribution by the exponential race: argmax of p / E with E ~ Exp(1) i.i.d. picks token
    ``t`` with probability ``p_t`` (the smallest E / p wins), with no host sync and no `multinomial`, so it can sit
    inside a recorded graph. Shapes: probs, noise (B, V) -> (B,)."""
    return (probs / noise).argmax(dim=-1)


def pick_tokens(
    logits: torch.Tensor, greedy: bool, nucleus: bool, temperature: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its logprob) of each row, as `rlhf.generators.decode.next_tokens` picks them: argmax and its logprob at
    temperature 1 when greedy; else a draw from the nucleus (``nucleus``: top_p < 1) at the temperature and its
    logprob under the temperature-scaled distribution the trainer scores. ``temperature`` and ``top_p`` are 0-d
    tensors, so a recorded step serves any value. Shapes: logits (B, V) -> (B,), (B,)."""
    logits = logits.float()
    if greedy:
        token = logits.argmax(dim=-1)
        return token, torch.log_softmax(logits, dim=-1).gather(-1, token[:, None]).squeeze(-1)
    scaled = logits / temperature
    kept = top_p_filter(scaled, top_p) if nucleus else scaled
    token = race_sample(kept.softmax(dim=-1), torch.empty_like(scaled).exponential_())
    return token, torch.log_softmax(scaled, dim=-1).gather(-1, token[:, None]).squeeze(-1)


class SlotCache:
    """A transformers-style KV cache over preallocated tensors: `update` writes the new keys and values at the cache
    columns ``columns`` (a long tensor, read on the device) and returns every column, or the first ``width`` during
    the prompt pass. What the decoder layers call; the model never asks it for a length (positions and the 4D mask
    are always passed)."""

    is_compileable = True

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], columns: torch.Tensor, width: int | None = None):
        self.keys, self.values, self.columns, self.width = keys, values, columns, width

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.columns, key_states.to(keys.dtype))
        values.index_copy_(2, self.columns, value_states.to(values.dtype))
        if self.width is None:
            return keys, values
        return keys[:, :, : self.width], values[:, :, : self.width]


class PackedPromptCache:
    """The cache of a packed prompt pass: `update` writes each packed token's keys and values at its (slot, column) of
    the slot cache's buffers and hands the packed ones back, for attention inside each packed row. Shapes: slots,
    columns (N,) long; the buffers (rows, kv heads, L, head dim)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor, columns: torch.Tensor):
        self.keys, self.values, self.slots, self.columns = keys, values, slots, columns

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        for buffer, states in ((self.keys[layer_idx], key_states), (self.values[layer_idx], value_states)):
            # (1, heads, N, D) -> (N, heads, D), written at (slot, column) of the (rows, L, heads, D) view
            buffer.transpose(1, 2).index_put_((self.slots, self.columns), states[0].transpose(0, 1).to(buffer.dtype))
        return key_states, value_states


@dataclass
class SlotState:
    """Every tensor one bucket's step reads or writes: views of the first ``rows`` rows of the decoder's buffers.
    Shapes: keys/values [layers x (rows, kv heads, L, head dim)], mask (rows, L) bool, token/position/length (rows,)
    long, done (rows,) bool, column/step (1,) long, tokens/logprobs (rows, budget)."""

    keys: list[torch.Tensor]  # each layer's (its own tensor: a compiled step mutating views of one would copy it whole)
    values: list[torch.Tensor]
    mask: torch.Tensor  # which cache columns each row attends to
    token: torch.Tensor  # the token each row feeds the next step
    position: torch.Tensor  # that token's position in its row (real tokens only)
    done: torch.Tensor  # the row has emitted its stop token (or is an empty slot)
    length: torch.Tensor  # tokens the row has emitted, its stop token included
    column: torch.Tensor  # the cache column this step writes (the same for every row)
    step: torch.Tensor  # the response index this step writes
    tokens: torch.Tensor  # each row's response so far
    logprobs: torch.Tensor  # and its tokens' logprobs

    SHARED = ("column", "step")  # one value for every slot: not cut by `head`, not copied by `move`

    def head(self, rows: int) -> "SlotState":
        """The first ``rows`` slots (a smaller bucket), sharing every buffer."""
        return SlotState(**{
            name: value if name in self.SHARED else [t[:rows] for t in value] if isinstance(value, list) else value[:rows]
            for name, value in vars(self).items()
        })

    def move(self, sources: torch.Tensor, targets: torch.Tensor, columns: int) -> None:
        """Copy slots ``sources`` into slots ``targets`` (long tensors of one length), in place; of the cache only the
        first ``columns`` columns (the ones written so far: later ones are masked until a step writes them)."""
        for name, value in vars(self).items():
            if name in self.SHARED:
                continue
            for tensor in value if isinstance(value, list) else [value]:
                part = tensor[:, :, :columns] if tensor.dim() == 4 else tensor
                part.index_copy_(0, targets, part.index_select(0, sources))


def fill_holes(going: list[int]) -> tuple[list[int], list[int]]:
    """(sources, targets): the moves that put the ``going`` slots (ascending) into the first ``len(going)`` slots,
    each going slot past them into a slot among them that has stopped, so no slot already in place is copied."""
    kept = len(going)
    holes = sorted(set(range(kept)) - set(going))
    return [slot for slot in going if slot >= kept], holes


def move_pays(moved: int, dropped: int, steps: int) -> bool:
    """Whether moving ``moved`` rows (each row's written cache read and written once) so that the next ``steps`` steps
    run ``dropped`` rows fewer pays before the next look: each step reads every row's cache once (its attention), so
    the move pays when it copies no more than those steps stop reading (the dropped rows' matrix products are saved
    on top). Moving no row always pays."""
    return 2 * moved <= dropped * steps


def as_attention_mask(model, attend: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 4D mask the model's attention takes, from ``attend`` (bool, True = attend): as is for sdpa, additive for
    the eager implementation. Shape: (B, 1, Q, K) -> (B, 1, Q, K)."""
    if model.config._attn_implementation in ("sdpa", GROUPED):
        return attend
    return torch.zeros(attend.shape, dtype=dtype, device=attend.device).masked_fill(~attend, torch.finfo(dtype).min)


def decode_step(
    model, state: SlotState, greedy: bool, nucleus: bool, temperature, top_p, stop_id: int, pad_id: int, width: int | None = None
) -> None:
    """One token for every slot, read from and written to ``state`` in place (nothing returned, nothing read on the
    host): the slot's token goes in at its column, the next token is picked (`pick_tokens`) and recorded, rows that
    have stopped record ``pad_id`` with logprob 0, and the inputs advance for the next step. ``width``: attend to the
    first ``width`` cache columns only (the ones written so far; without graphs the host knows it), else to all."""
    state.mask.index_fill_(1, state.column, True)
    dtype = state.keys[0].dtype
    out = model(
        input_ids=state.token[:, None], position_ids=state.position[:, None], use_cache=True,
        attention_mask=as_attention_mask(model, state.mask[:, None, None, :width], dtype),
        past_key_values=SlotCache(state.keys, state.values, state.column, width),
    )
    token, logprob = pick_tokens(out.logits[:, -1], greedy, nucleus, temperature, top_p)
    token = torch.where(state.done, torch.full_like(token, pad_id), token)
    logprob = torch.where(state.done, torch.zeros_like(logprob), logprob)
    state.tokens.index_copy_(1, state.step, token[:, None])
    state.logprobs.index_copy_(1, state.step, logprob[:, None])
    state.length.add_((~state.done).long())
    state.done.logical_or_(token == stop_id)
    state.token.copy_(token)
    state.position.add_(1)
    state.column.add_(1)
    state.step.add_(1)


def prompt_mask(query_mask: torch.Tensor) -> torch.Tensor:
    """The prompt pass's (B, 1, Lq, Lq) bool mask: causal over each row's real tokens; a padding position sees
    itself only, so no row of the attention is empty (an empty one is NaN, and NaN values cached at padding columns
    would poison later steps even at weight 0). Shape: (B, Lq) -> (B, 1, Lq, Lq)."""
    width = query_mask.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=query_mask.device).tril()
    attend = causal[None] & query_mask.bool()[:, None, :]
    return (attend | torch.eye(width, dtype=torch.bool, device=query_mask.device)[None])[:, None]


def unsupported(config) -> str | None:
    """Why a model of ``config`` cannot decode from preallocated cache columns under a mask built here, or None when it
    can: the mask is one of the `ATTENTION` implementations' and attends over every earlier column (no sliding
    window)."""
    if config._attn_implementation not in ATTENTION:
        return f"it needs sdpa or eager attention, not {config._attn_implementation}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "it serves full-attention models only (this one has sliding-window layers)"
    return None


def attention_window(config) -> int | None:
    """How far back a model of ``config`` lets a token attend, where its config bounds it (a sliding window or chunked
    attention: Mistral, Phi-3), else None. The slot cache attends over every earlier column, which is the same
    attention for rows that stay within the window, and wrong past it."""
    return getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None) or None


def cache_shape(config) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a model of ``config``: what one cached position holds."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, heads, head_dim


class StaticDecoder:
    """Decodes with preallocated buffers and one step per (bucket, greedy, nucleus), compiled (``compile``) and on
    CUDA recorded as a CUDA graph (``graphs``). `decode` answers as `rlhf.generators.decode.decode` does."""

    def __init__(self, model, buckets: tuple[int, ...] | None, check_every: int, compile: bool, graphs: bool) -> None:
        reason = unsupported(model.config)
        if reason:
            raise ValueError(f"generator.decode=static cannot decode this model: {reason}; set generator.decode=eager (or auto)")
        self.model, self.check_every = model, check_every
        self.buckets = tuple(sorted(buckets)) if buckets is not None else None  # None: each batch size as it is
        self.graphs = graphs
        self.window = attention_window(model.config)
        # prompts run packed end to end (no padding computed) where the model's attention takes packed rows: the hf
        # generator's own (`rlhf.models.grouped_attention`) on a family whose rows packing keeps apart
        self.packs = can_pack(model.config, (GROUPED,))
        # on the CPU the compiled step's calls go through a C++ wrapper (`cpp_wrapper`): 10-15% of a small model's step
        cpu = next(model.parameters()).device.type == "cpu"
        self.step_fn = torch.compile(decode_step, options={"cpp_wrapper": True} if cpu else None) if compile else decode_step
        self.state: SlotState | None = None  # the largest bucket's buffers; None until the first decode or after free
        self.recorded: dict[tuple, torch.cuda.CUDAGraph] = {}  # (bucket, greedy, nucleus) -> its step's graph, once recorded
        self.temperature = self.top_p = None

    def serves(self, tokens: int) -> bool:
        """Whether rows of up to ``tokens`` tokens (prompt and response) decode here as the model attends
        (`attention_window`)."""
        return self.window is None or tokens <= self.window

    def free(self) -> None:
        """Drop the buffers and the recorded graphs (the generator sleeps; the weights they read are going)."""
        self.state, self.recorded = None, {}

    def _buffers(self, rows: int, columns: int, budget: int, like: torch.Tensor) -> SlotState:
        """The buffers for ``rows`` slots, ``columns`` cache columns and ``budget`` response tokens: the present ones
        when they are large enough, else new ones (and the graphs recorded on the old ones are dropped)."""
        state = self.state
        if state is not None and state.mask.shape[0] >= rows and state.mask.shape[1] >= columns and state.tokens.shape[1] >= budget:
            return state
        if state is not None:
            rows, columns = max(rows, state.mask.shape[0]), max(columns, state.mask.shape[1])
            budget = max(budget, state.tokens.shape[1])
        self.free()
        device = like.device
        layers, heads, head_dim = cache_shape(self.model.config)
        dtype = next(self.model.parameters()).dtype
        cache = [torch.zeros(rows, heads, columns, head_dim, dtype=dtype, device=device) for _ in range(2 * layers)]
        long = dict(dtype=torch.long, device=device)
        self.state = SlotState(
            keys=cache[0::2], values=cache[1::2], mask=torch.zeros(rows, columns, dtype=torch.bool, device=device),
            token=torch.zeros(rows, **long), position=torch.zeros(rows, **long),
            done=torch.ones(rows, dtype=torch.bool, device=device), length=torch.zeros(rows, **long),
            column=torch.zeros(1, **long), step=torch.zeros(1, **long),
            tokens=torch.zeros(rows, budget, **long), logprobs=torch.zeros(rows, budget, device=device),
        )
        self.temperature = torch.ones((), device=device)
        self.top_p = torch.ones((), device=device)
        return self.state

    @torch.no_grad()
    def decode(
        self, query_ids: torch.Tensor, query_mask: torch.Tensor, sampling: SamplingParams, stop_id: int, pad_id: int,
        groups: PromptGroups | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample up to ``sampling.max_new_tokens`` tokens after each left-padded prompt. Returns (tokens (B, W),
        logprobs (B, W)) as the eager loop does: W the longest response, a row's tokens up to its stop token, then
        ``pad_id`` with logprob 0. ``groups``: each distinct prompt prefilled once (`_prefill`). Shapes: query_ids,
        query_mask (B, Lq)."""
        rows, width = query_ids.shape
        budget = sampling.max_new_tokens
        bucket = bucket_for(rows, self.buckets)
        full = self._buffers(bucket, cache_columns(width + budget), budget, query_ids)
        self.temperature.fill_(sampling.temperature)
        self.top_p.fill_(sampling.top_p)
        mode = (sampling.greedy, sampling.top_p < 1.0)
        state = full.head(bucket)
        self._prefill(state, query_ids, query_mask, mode, stop_id, pad_id, groups)
        slot_rows = torch.arange(rows, device=query_ids.device)  # the batch row each slot holds
        tokens = torch.full((rows, budget), pad_id, dtype=torch.long, device=query_ids.device)
        logprobs = torch.zeros(rows, budget, device=query_ids.device)
        longest, ran = 0, 1  # the prompt pass picked each row's first token
        going = (~state.done[:rows]).nonzero().squeeze(1)
        while ran < budget and len(going):
            steps = min(self.check_every, budget - ran)
            smaller = bucket_for(len(going), self.buckets)
            moves = fill_holes(going.tolist()) if smaller < bucket else None
            if moves is not None and move_pays(len(moves[0]), bucket - smaller, steps):
                # the rows still going fill the front slots, and the steps run at the smaller bucket
                longest = max(longest, self._flush(state, slot_rows, tokens, logprobs))
                sources, targets = (torch.tensor(slots, dtype=torch.long, device=going.device) for slots in moves)
                state.move(sources, targets, width + ran - 1)
                slot_rows[targets] = slot_rows[sources]
                slot_rows = slot_rows[: len(going)]
                bucket, state = smaller, full.head(smaller)
                state.done[len(slot_rows) :] = True
            for written in range(width + ran - 1, width + ran - 1 + steps):  # the cache column each step writes
                self._step(state, bucket, mode, stop_id, pad_id, written + 1)
            ran += steps
            going = (~state.done[: len(slot_rows)]).nonzero().squeeze(1)  # the one host read per check
        longest = max(longest, self._flush(state, slot_rows, tokens, logprobs))
        return tokens[:, :longest], logprobs[:, :longest]

    def _prefill(
        self, state: SlotState, query_ids, query_mask, mode: tuple[bool, bool], stop_id: int, pad_id: int,
        groups: PromptGroups | None = None,
    ) -> None:
        """Run the prompts (left-padded, as `rlhf.trajectory.left_pad` builds them: a row's prompt ends at column
        Lq - 1 with no gap) into the cache's first Lq columns, packed where the model takes packed rows
        (`_packed_pass`), else as the padded batch (`_padded_pass`); pick each row's first token from its last prompt
        token's logits and set every slot up for the first step (slots past the batch attend to one column and start
        done). ``groups``: only the distinct prompts run (`_shared_pass`)."""
        rows, width = query_ids.shape
        slots = state.mask.shape[0]
        mask = torch.zeros(slots, width, dtype=torch.long, device=query_ids.device)
        mask[:rows] = query_mask
        mask[rows:, -1] = 1
        if groups is not None:
            logits = self._shared_pass(state, query_ids, mask, pad_id, groups)
        else:
            logits = (self._packed_pass if self.packs else self._padded_pass)(state, query_ids, mask, pad_id)
        token, logprob = pick_tokens(logits, *mode, self.temperature, self.top_p)
        state.done.zero_()
        state.done[rows:] = True
        token = torch.where(state.done, torch.full_like(token, pad_id), token)
        state.mask.zero_()
        state.mask[:, :width] = mask.bool()
        state.tokens.fill_(pad_id)
        state.logprobs.zero_()
        state.tokens[:, 0], state.logprobs[:, 0] = token, torch.where(state.done, 0.0, logprob)
        state.length.copy_((~state.done).long())
        state.done.logical_or_(token == stop_id)
        state.token.copy_(token)
        state.position.copy_(real_positions(mask)[:, -1] + 1)
        state.column.fill_(width)
        state.step.fill_(1)

    def _shared_pass(self, state: SlotState, query_ids, mask, pad_id: int, groups: PromptGroups) -> torch.Tensor:
        """The prompt pass over each distinct prompt once, into the first U slots (packed or padded, as `_prefill`
        chooses), then every row's slot given its prompt's cache columns and logits; slots past the batch get zero
        keys and values (they attend to one column and are done from the start). Returns each slot's last-position
        logits (slots, V; zeros past the batch)."""
        rows, width = query_ids.shape
        distinct = groups.distinct
        own = state.head(distinct)
        own_mask = mask[groups.firsts]
        logits = (self._packed_pass if self.packs else self._padded_pass)(own, query_ids[groups.firsts], own_mask, pad_id)
        for buffer in state.keys + state.values:
            prompt = buffer[:, :, :width]
            prompt[:rows] = prompt[:distinct].index_select(0, groups.owner)  # a copy first: row i reads slot owner[i] <= i
            prompt[rows:].zero_()
        return torch.cat([logits[:distinct].index_select(0, groups.owner), logits.new_zeros(mask.shape[0] - rows, logits.shape[-1])])

    def _padded_pass(self, state: SlotState, query_ids, mask, pad_id: int) -> torch.Tensor:
        """The prompt pass over every slot's padded row (``mask``: the slots' (slots, Lq) prompt mask; slots past the
        batch hold a one-token dummy prompt), the padding computed like the tokens. Returns each slot's last-position
        logits (slots, V)."""
        rows, width = query_ids.shape
        ids = torch.full(mask.shape, pad_id, dtype=torch.long, device=query_ids.device)
        ids[:rows] = query_ids
        out = self.model(
            input_ids=ids, position_ids=real_positions(mask), use_cache=True,
            attention_mask=as_attention_mask(self.model, prompt_mask(mask), state.keys[0].dtype),
            past_key_values=SlotCache(state.keys, state.values, torch.arange(width, device=ids.device), width),
            **({"logits_to_keep": 1} if keeps_logits(self.model) else {}),
        )
        return out.logits[:, -1]

    def _packed_pass(self, state: SlotState, query_ids, mask, pad_id: int) -> torch.Tensor:
        """The prompt pass over the batch's real prompt tokens only, packed end to end (`rlhf.models.packing`): each
        token's keys and values land at its slot and column of the left-padded layout (`PackedPromptCache`); the
        padding columns are zeroed, never computed. Returns the last prompt token's logits of each slot (slots, V;
        zeros for slots past the batch)."""
        rows, width = query_ids.shape
        lengths = mask[:rows].sum(dim=1)
        total, longest, shortest = torch.stack([lengths.sum(), lengths.max(), lengths.min()]).tolist()  # one host read
        if shortest == 0:  # an empty prompt has no last token to pack: the padded pass reads its padding
            return self._padded_pass(state, query_ids, mask, pad_id)
        row, starts, offset = token_places(lengths, total)  # each packed token's row and place in its prompt
        column = width - lengths[row] + offset
        for buffer in state.keys + state.values:
            buffer[:, :, :width].zero_()  # padding columns are masked; zeros keep a stale NaN out of the attention
        lasts = starts[1:] - 1  # each row's last prompt token in the packed sequence
        keeps = keeps_logits(self.model)
        out = self.model(
            input_ids=query_ids[row, column][None], position_ids=offset[None], use_cache=True,
            attention_mask=unread_mask(query_ids.device),
            past_key_values=PackedPromptCache(state.keys, state.values, row, column),
            **rows_attention_kwargs(lengths, longest, row * longest + offset),
            **({"logits_to_keep": lasts} if keeps else {}),
        )
        logits = out.logits[0] if keeps else out.logits[0, lasts]
        return torch.cat([logits, logits.new_zeros(mask.shape[0] - rows, logits.shape[-1])])

    def _step(self, state: SlotState, bucket: int, mode: tuple[bool, bool], stop_id: int, pad_id: int, width: int) -> None:
        """One step at ``bucket`` rows: replayed from its CUDA graph (recorded on first use; it attends over every cache
        column), or called attending over the first ``width`` columns."""
        if not self.graphs:
            self.step_fn(self.model, state, *mode, self.temperature, self.top_p, stop_id, pad_id, width)
            return
        key = (bucket, *mode)
        if key not in self.recorded:
            self.recorded[key] = self._record(state, bucket, mode, stop_id, pad_id)
        self.recorded[key].replay()

    def _record(self, state: SlotState, bucket: int, mode: tuple[bool, bool], stop_id: int, pad_id: int):
        """Record the step at ``bucket`` rows as a CUDA graph on the buffers, after warm-up calls on a side stream
        (which also compile it). The warm-ups advance nothing: the small buffers are saved and put back, and the cache
        column they wrote is written again by the real step (columns past it are masked). Each graph has its own
        memory pool: nothing of one graph's is alive when another replays, in whatever order the buckets come."""
        saved = {name: value.clone() for name, value in vars(state).items() if torch.is_tensor(value)}

        def call():
            self.step_fn(self.model, state, *mode, self.temperature, self.top_p, stop_id, pad_id)

        def restore():
            for name, value in saved.items():
                getattr(state, name).copy_(value)

        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    call()
                    restore()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
        except torch.OutOfMemoryError as error:
            cache = sum(t.numel() * t.element_size() for t in state.keys + state.values)
            raise torch.OutOfMemoryError(
                f"recording the decode step for generator.buckets entry {bucket} ran out of GPU memory (its rows' "
                f"cache alone is {cache / 2**30:.2f} GiB, {torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB free): drop the "
                "largest buckets or lower generator.batch_size, or decode without graphs (generator.graphs=false) or "
                "eagerly (generator.decode=eager)"
            ) from error
        log.info("generator: recorded the decode step for %d rows (greedy=%s, nucleus=%s)", bucket, *mode)
        return graph

    def _flush(self, state: SlotState, slot_rows: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> int:
        """Copy the responses of the slots holding batch rows into ``tokens``/``logprobs`` (B, budget); returns their
        longest length (a host read)."""
        held, budget = len(slot_rows), tokens.shape[1]
        tokens[slot_rows] = state.tokens[:held, :budget]
        logprobs[slot_rows] = state.logprobs[:held, :budget]
        return int(state.length[:held].max())
