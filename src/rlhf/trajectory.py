"""The one batch type every stage passes on: token-level trajectories. Owned by no backend.

A row is one trajectory: its prompt and every token after it (actions, and in multi-turn rows the observations
between them). Per-token tensors cover the row's *action window*: the last T columns of ``input_ids``, from the
first column any row trains on (column j of a (B, T) tensor is token ``input_ids[:, L - T + j]``). Log-softmax
over the vocabulary, losses and advantages run on that window only; ``loss_mask`` marks, inside it, the tokens the
policy is trained on. A single-turn completion is the case where the window is the response.

Shapes: B rows, L tokens per row, T = window columns (T <= L - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

def real_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """The position of each token counting real tokens only (padding before a row's first real token gets 0, padding
    after a real token repeats its position), so a left-padded row sees the positions it would alone. Shape:
    (B, L) -> (B, L)."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


PER_ROW = ("group_id", "stopped", "scores")
PER_TOKEN = ("loss_mask", "gen_logp", "old_logp", "ref_logp", "values", "advantages", "returns", "turn_rewards")


@dataclass
class Trajectories:
    """Rows of token ids with what each stage adds to them (``None`` until a stage fills it)."""

    input_ids: torch.Tensor  # (B, L) long: prompt and everything after it; padding where attention_mask is 0
    attention_mask: torch.Tensor  # (B, L) long: 1 for real tokens
    loss_mask: torch.Tensor  # (B, T) float: 1 for the action tokens the policy is trained on
    gen_logp: torch.Tensor  # (B, T) float: the generator's logprob of each action token (0 elsewhere)
    group_id: torch.Tensor  # (B,) long: rows sampled for the same prompt (or task instance) share an id
    stopped: torch.Tensor  # (B,) bool: the trajectory ended by itself (stop token), not at the length limit
    old_logp: torch.Tensor | None = None  # (B, T) the policy's logprobs before this step's update
    ref_logp: torch.Tensor | None = None  # (B, T) the reference model's logprobs
    values: torch.Tensor | None = None  # (B, T) the critic's value of the state before each token
    advantages: torch.Tensor | None = None  # (B, T) per-token advantages
    returns: torch.Tensor | None = None  # (B, T) value targets (algorithms with a critic)
    scores: torch.Tensor | None = None  # (B,) the reward of each row after the non-stop penalty
    turn_rewards: torch.Tensor | None = None  # (B, T) multi-turn: each turn's reward at its last action token; None = `scores` at the last
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # algorithm-specific row-aligned tensors: (B,) per row, (B, T) per window token
    rows_per_unit: int = 1  # rows trained as one unit (2 for a chosen/rejected pair); batches split whole units
    host_spans: torch.Tensor | None = None  # (B, 3) long on the CPU: each row's first and last real column and real-token count (`with_host_spans`); None = read from attention_mask

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def window_start(self) -> int:
        """Column of ``input_ids`` where the action window starts (L - T)."""
        return self.input_ids.shape[1] - self.loss_mask.shape[1]

    @property
    def window_ids(self) -> torch.Tensor:
        """The tokens of the action window. Shape: (B, T)."""
        return self.input_ids[:, self.window_start :]

    @property
    def action_lengths(self) -> torch.Tensor:
        """Trained tokens per row. Shape: (B,)."""
        return self.loss_mask.sum(dim=1)

    @property
    def num_units(self) -> int:
        return len(self) // self.rows_per_unit

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask, position_ids), each (B, L), for a teacher-forced forward.

        Positions count real tokens only, so a left-padded prompt sees the positions it saw when sampled.
        """
        return self.input_ids, self.attention_mask, real_positions(self.attention_mask)

    def real_spans(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first, last) column of each row's real tokens. Shapes: (B,), (B,)."""
        real = self.attention_mask.bool().int()
        return real.argmax(dim=1), real.shape[1] - 1 - real.flip(1).argmax(dim=1)

    def with_host_spans(self) -> "Trajectories":
        """The same rows carrying `host_spans`, read from the device once: the micro batches cut from them are
        trimmed and packed without reading the device again (no host sync between a mini batch's forwards)."""
        first, last = self.real_spans()
        spans = torch.stack([first, last, self.attention_mask.sum(dim=1)], dim=1).cpu()
        return replace(self, host_spans=spans)

    def justified_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`model_inputs` with each row moved left past its left padding (which goes after the row instead), and the
        column, in them, of the position whose output predicts each window token.

        Rows of prompts of different lengths then share a forward as wide as the longest row, not the longest prompt
        plus the longest window. Positions count real tokens as in `model_inputs`, so every real token sees the same
        tokens at the same positions. Window columns past a row's last real token point at its last column (their
        outputs are masked). Shapes: (B, L'), (B, L'), (B, L'), (B, T); L' <= L.
        """
        first, last = self.real_spans()
        length, start, width = self.input_ids.shape[1], self.window_start, self.loss_mask.shape[1]
        wide = int((last + 1 - first).max()) if len(self) else length
        source = first.unsqueeze(1) + torch.arange(wide, device=first.device)
        inside = source < length
        source = source.clamp(max=length - 1)
        mask = self.attention_mask.gather(1, source) * inside
        predicts = start - 1 - first.unsqueeze(1) + torch.arange(width, device=first.device)
        return self.input_ids.gather(1, source), mask, real_positions(mask), predicts.clamp(min=0, max=wide - 1)

    def _map(self, fn) -> "Trajectories":
        """Apply ``fn`` to every tensor (fields and extras) but `host_spans`, which stays on the CPU as it is."""
        changes = {
            f.name: fn(getattr(self, f.name)) for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor) and f.name != "host_spans"
        }
        return replace(self, **changes, extras={k: fn(v) for k, v in self.extras.items()})

    def select(self, index: torch.Tensor | slice) -> "Trajectories":
        """The rows at ``index`` (a slice or a 1-D index tensor), every column kept."""
        host = None if self.host_spans is None else self.host_spans[index.cpu() if isinstance(index, torch.Tensor) else index]
        if isinstance(index, torch.Tensor):  # a host index goes over without waiting for the device
            index = index.to(self.input_ids.device, non_blocking=True)
        return replace(self._map(lambda t: t[index]), host_spans=host)

    def rows_of(self, units: torch.Tensor) -> torch.Tensor:
        """Row indices of the given units (``rows_per_unit`` consecutive rows each), in order. Shape: (U,) -> (U * R,)."""
        return (units.unsqueeze(1) * self.rows_per_unit + torch.arange(self.rows_per_unit)).reshape(-1)

    def select_units(self, units: torch.Tensor) -> "Trajectories":
        """The rows of the given units, in order."""
        return self.select(self.rows_of(units))

    def trimmed(self) -> "Trajectories":
        """The same rows without the columns that are padding in every row: context columns before the first real
        token (left padding) and window columns after the last real one (right padding). Positions count real tokens,
        so a forward over the trimmed rows computes exactly what it computes over the full ones; window outputs
        keep their first T' columns (the rest were masked).
        """
        if not len(self):
            return self
        start, width = self.window_start, self.loss_mask.shape[1]
        if self.host_spans is not None:  # no device read
            used_first, used_last = int(self.host_spans[:, 0].min()), int(self.host_spans[:, 1].max())
        else:
            real = self.attention_mask.bool()
            if real.all():
                return self
            used = real.any(dim=0).nonzero().squeeze(1)
            used_first, used_last = int(used[0]), int(used[-1])
        first = min(used_first, start - 1) if start > 0 else 0  # keep the column that predicts the first window token
        keep = max(1, used_last + 1 - start)  # window columns up to the last real token
        if first == 0 and keep == width:
            return self

        inputs = {name: getattr(self, name)[:, first : start + keep] for name in ("input_ids", "attention_mask")}
        per_token = {name: getattr(self, name)[:, :keep] for name in PER_TOKEN if getattr(self, name) is not None}
        extras = {k: v[:, :keep] if v.dim() > 1 and v.shape[1] == width else v for k, v in self.extras.items()}
        host = None if self.host_spans is None else self.host_spans - torch.tensor([first, first, 0])
        return replace(self, **inputs, **per_token, extras=extras, host_spans=host)

    def chunks(self, size: int) -> list["Trajectories"]:
        """Consecutive row slices of at most ``size`` rows (micro batches for a forward pass)."""
        return [self.select(slice(start, start + size)) for start in range(0, len(self), size)]

    def to(self, device: torch.device | str) -> "Trajectories":
        return self._map(lambda t: t.to(device))


def with_groups(batch: Trajectories, samples_per_prompt: int) -> Trajectories:
    """The rows' group ids: each run of ``samples_per_prompt`` consecutive rows shares a prompt."""
    groups = torch.arange(len(batch) // samples_per_prompt, device=batch.group_id.device)
    return replace(batch, group_id=groups.repeat_interleave(samples_per_prompt))


def group_size(group_id: torch.Tensor) -> int | torch.Tensor:
    """G when rows come in contiguous groups of G equal ids (a prompt's samples in a row); the (P,) sizes of the
    groups when they differ (failed episodes left some short); ValueError when a group's rows are not contiguous.

    Shape: group_id (B,).
    """
    if not len(group_id):
        return 1
    ids, sizes = torch.unique_consecutive(group_id.cpu(), return_counts=True)
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"rows must come in contiguous groups; got group ids {group_id.tolist()}")
    return int(sizes[0]) if bool((sizes == sizes[0]).all()) else sizes


@dataclass
class Forward:
    """A trained model's outputs on a micro batch's window, with gradients. Shapes: (B, T)."""

    logp: torch.Tensor | None = None  # the policy's logprobs
    entropy: torch.Tensor | None = None  # the policy's entropy, when the algorithm asks for it
    values: torch.Tensor | None = None  # the critic's values


def from_completions(
    query_ids: torch.Tensor, query_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor,
    logprobs: torch.Tensor, stopped: torch.Tensor,
) -> Trajectories:
    """Single-turn rows: a left-padded prompt (B, Lq) then a right-padded response (B, Lr) that is the window.

    ``response_mask`` (B, Lr) marks real response tokens (the stop token included); each row is its own group
    until the caller says which rows share a prompt.
    """
    return Trajectories(
        input_ids=torch.cat([query_ids, response_ids], dim=1),
        attention_mask=torch.cat([query_mask, response_mask.long()], dim=1),
        loss_mask=response_mask.float(),
        gen_logp=logprobs,
        group_id=torch.arange(query_ids.shape[0], device=query_ids.device),
        stopped=stopped,
    )


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), each (B, longest prompt), padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    return ids, mask


def _pad(t: torch.Tensor, left: int, right: int, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(t, (left, right), value=value) if left or right else t


def _window_extra(part: Trajectories, key: str, window: int) -> torch.Tensor:
    """``part.extras[key]``, a per-token extra (B, T) padded on the right with 0 to ``window`` columns; a per-row one as is."""
    value, width = part.extras[key], part.loss_mask.shape[1]
    return _pad(value, 0, window - width, 0) if value.dim() > 1 and value.shape[1] == width else value


def concat(parts: list[Trajectories], pad_id: int) -> Trajectories:
    """Stack rows of different widths: the context before each window is padded on the left, the window on the
    right, so every row's window starts at the same column. Rows keep their group ids."""
    if len(parts) == 1:
        return parts[0]
    context = max(p.window_start for p in parts)
    window = max(p.loss_mask.shape[1] for p in parts)

    def stack(name: str, value: float) -> torch.Tensor | None:
        tensors = [getattr(p, name) for p in parts]
        if any(t is None for t in tensors):
            return None
        per_token = name in PER_TOKEN
        out = []
        for p, t in zip(parts, tensors):
            grow = window - p.loss_mask.shape[1]
            out.append(_pad(t, 0, grow, value) if per_token else _pad(t, context - p.window_start, grow, value))
        return torch.cat(out)

    per_token = {name: stack(name, 0.0) for name in PER_TOKEN}
    per_row = {name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts]) for name in PER_ROW}
    return Trajectories(
        input_ids=stack("input_ids", pad_id),
        attention_mask=stack("attention_mask", 0),
        extras={k: torch.cat([_window_extra(p, k, window) for p in parts]) for k in parts[0].extras},
        rows_per_unit=parts[0].rows_per_unit,
        **per_token,
        **per_row,
    )
