"""How a batch is cut into micro batches for the forward passes of training and scoring.

Units (rows, or chosen/rejected pairs) are sorted by length, longest first, and cut into micro batches of at most
``Budget.rows`` rows and, when ``Budget.tokens`` is set, at most that many tokens counted with their padding (rows x
the longest row). Each micro batch is then trimmed of the columns that are padding in all of its rows
(`Trajectories.trimmed`), and its forward packs the rows end to end (`rlhf.models.packing`: no token-wise layer
computes padding; attention runs per row, padded to the longest), or, for a model whose attention takes no packed
rows, moves every row past its own left padding (`Trajectories.justified_inputs`), so it is as wide as its longest
row. Rows of similar length share a micro batch, whatever their prompts' lengths; where a model lays a group's prompt
out once (`model.shared_prefix`, `rlhf.models.shared_prefix`), a group's rows share one instead (`by_group`).
Every loss is a sum of per-token terms over a global denominator, so how rows are grouped changes no gradient
beyond float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from rlhf.collectives import all_ranks_max
from rlhf.trajectory import Forward, Trajectories


# `model.shared_prefix: null` shares where (prompt tokens saved) / (tokens of the unshared layout) is at least this
# share: the layout's cost (its host-side build, two attention calls and their gathers) measured under the tokens it
# saves down to 5% saved on a CPU (bench/shared_prefix_train.py; docs/performance.md has the figures)
PAYS_FROM = 0.05


@dataclass(frozen=True)
class Budget:
    """The most one forward may hold: ``rows`` rows and (when set) ``tokens`` tokens, padding included."""

    rows: int  # rows per micro batch (train.micro_batch_size)
    tokens: int | None = None  # tokens per micro batch, padding counted (train.max_tokens_per_micro_batch); None: rows only

    @classmethod
    def of(cls, train_cfg) -> "Budget":
        """The budget `train.*` sets for scoring passes (training passes also stay inside a mini batch)."""
        return cls(train_cfg.micro_batch_size, train_cfg.max_tokens_per_micro_batch)


def micro_units(mini_units: int, micro_batch_size: int, rows_per_unit: int) -> int:
    """Training units per micro batch: as many whole units (a sample, or a pair of rows for pairwise algorithms) as
    `train.micro_batch_size` rows hold, at least one, never more than the mini batch's ``mini_units``."""
    return min(mini_units, max(1, micro_batch_size // rows_per_unit))


def as_budget(size: int | Budget) -> Budget:
    """A plain row count is a budget of rows only."""
    return size if isinstance(size, Budget) else Budget(rows=int(size))



def halvings(size: int) -> list[int]:
    """size/2, size/4, ... down to 1: smaller batches, largest (fastest) first (what the memory plan suggests)."""
    found = []
    while size > 1:
        size //= 2
        found.append(size)
    return found

def unit_lengths(batch: Trajectories) -> torch.Tensor:
    """Each unit's longest row from its first real token to its last: the width of the (rows, longest row) block a
    packed micro batch's attention runs on, and of a justified forward (`Trajectories.justified_inputs`). Shape: (U,)."""
    first, last = batch.real_spans()
    return (last + 1 - first).view(-1, batch.rows_per_unit).amax(dim=1).cpu()


def plan(batch: Trajectories, size: int | Budget, equal_count: bool = False, by_group: bool = False) -> list[torch.Tensor]:
    """Unit indices of each micro batch, longest units first; ``by_group`` (rows of one unit each): a group's rows
    together, groups longest first, so rows of one prompt share a micro batch (`rlhf.models.shared_prefix` lays their
    prompt out once). ``equal_count``: every rank of the training group gets
    as many micro batches as the rank with the most (a collective), since sharded forwards and backwards must pair
    up across ranks; the largest micro batches are halved until the counts agree (capped at the fewest units any
    rank holds, where a rank then joins its smallest micro batches).

    Raises ValueError when one unit alone is over ``Budget.tokens``, naming both numbers.
    """
    budget = as_budget(size)
    lengths = unit_lengths(batch)
    per_unit = batch.rows_per_unit
    longest = int(lengths.max()) if len(lengths) else 0
    if budget.tokens is not None and longest * per_unit > budget.tokens:
        raise ValueError(
            f"train.max_tokens_per_micro_batch={budget.tokens} is smaller than the longest row of this batch "
            f"({longest} tokens{f' x {per_unit} rows per unit' if per_unit > 1 else ''}); raise it to at least "
            f"{longest * per_unit}, or set it to null to cut micro batches by train.micro_batch_size alone"
        )
    max_units = max(1, budget.rows // per_unit)
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    if by_group and per_unit == 1:
        order = grouped_order(order, batch.group_id.cpu().tolist())
    groups: list[list[int]] = []
    widest = 0
    for unit in order:  # longest first (by group: each group's longest first), widest the micro batch's longest
        rows = (len(groups[-1]) + 1) * per_unit if groups else 0
        wide = max(widest, int(lengths[unit]))
        fits = groups and len(groups[-1]) < max_units and (budget.tokens is None or rows * wide <= budget.tokens)
        if fits:
            groups[-1].append(unit)
            widest = wide
        else:
            groups.append([unit])
            widest = int(lengths[unit])
    if equal_count:
        most, fewest_units = all_ranks_max(len(groups), -len(order))
        groups = merge_to(split_to(groups, min(most, -fewest_units)), min(most, -fewest_units))
    return [torch.tensor(sorted(g), dtype=torch.long) for g in groups]


def grouped_order(order: list[int], group_id: list[int]) -> list[int]:
    """``order`` (rows, longest first) with each group's rows moved up to its longest row's place: groups in order of
    their longest row, each group's rows longest first."""
    rows: dict[int, list[int]] = {}
    for row in order:
        rows.setdefault(group_id[row], []).append(row)
    return [row for members in rows.values() for row in members]


def split_to(groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` with the largest halved until there are ``count`` of them (never more groups than units)."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[largest]) < 2:
            break
        half = len(groups[largest]) // 2
        groups[largest:largest + 1] = [groups[largest][:half], groups[largest][half:]]
    return groups


def merge_to(groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` with the two smallest neighbours joined until there are at most ``count`` (a rank holding fewer
    units than another rank's micro batches: the counts must still agree, so a micro batch may pass the budget)."""
    groups = [list(g) for g in groups]
    while len(groups) > max(count, 1):
        i = min(range(len(groups) - 1), key=lambda j: len(groups[j]) + len(groups[j + 1]))
        groups[i : i + 2] = [groups[i] + groups[i + 1]]
    return groups


def pays(prompt_tokens: int, distinct_prompt_tokens: int, response_tokens: int) -> bool:
    """`model.shared_prefix: null`'s rule: share where the prompt tokens saved, ``prompt_tokens -
    distinct_prompt_tokens``, are at least `PAYS_FROM` of the unshared layout's tokens, ``prompt_tokens +
    response_tokens`` (and more than none)."""
    saved = prompt_tokens - distinct_prompt_tokens
    return saved > 0 and saved >= PAYS_FROM * (prompt_tokens + response_tokens)


def group_pays(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, group_id: torch.Tensor) -> bool:
    """`pays` for rows of ``prompt_lengths`` and ``response_lengths`` where the rows of a ``group_id`` share their
    prompt. Shapes: (B,) each, on the host."""
    if not len(prompt_lengths):
        return False
    distinct = {int(g): int(p) for g, p in zip(group_id.tolist(), prompt_lengths.tolist())}
    return pays(int(prompt_lengths.sum()), sum(distinct.values()), int(response_lengths.sum()))


def by_group(batch: Trajectories, share: bool | None) -> bool:
    """Whether micro batches keep each group's rows together for a model of `model.shared_prefix` ``share``: always
    when true, never when false, and when null where the shared-prefix layout pays (`group_pays`,
    each group's rows taken to share its prompt)."""
    if share is None:
        first, last = batch.real_spans()
        start = batch.window_start
        return group_pays((start - first).clamp(min=0).cpu(), (last + 1 - start).clamp(min=0).cpu(), batch.group_id.cpu())
    return bool(share)


def padded_tokens(batch: Trajectories, size: int | Budget, packed: bool) -> tuple[int, int]:
    """(tokens the token-wise layers of the forward passes of ``plan`` compute, of which real): the padding a budget
    leaves. ``packed``: the model packs its micro batches (`rlhf.models.packing.pack`), so one whose rows have no
    padding between real tokens computes its real tokens only; any other micro batch, and every one of a model that
    does not pack, is as wide as its longest row (`Trajectories.justified_inputs`)."""
    first, last = batch.real_spans()
    spans = (last + 1 - first).view(-1, batch.rows_per_unit).cpu()
    real_per_unit = batch.attention_mask.sum(dim=1).view(-1, batch.rows_per_unit).sum(dim=1).cpu()
    computed = 0
    for units in plan(batch, size):
        real, span = int(real_per_unit[units].sum()), spans[units]
        gap_free = int(span.sum()) == real
        computed += real if packed and gap_free else span.numel() * int(span.max())
    return computed, int(real_per_unit.sum())


def place(outputs: list[torch.Tensor | None], rows: list[torch.Tensor], width: int) -> torch.Tensor | None:
    """Micro-batch outputs back in batch row order: ``outputs[i]`` belongs to rows ``rows[i]`` (together a
    permutation of the batch's rows); window tensors (R, T') are padded back to ``width`` columns with zeros."""
    if outputs[0] is None:
        return None
    stacked = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1])) if o.dim() > 1 else o for o in outputs])
    order = torch.cat(rows).to(stacked.device)
    return torch.empty_like(stacked).index_copy_(0, order, stacked)


def in_row_order(parts: list[tuple[torch.Tensor, Forward]], width: int) -> Forward:
    """One `Forward` of (B, ``width``) tensors from each micro batch's (rows, Forward)."""
    rows = [r for r, _ in parts]
    columns = {f.name: [getattr(out, f.name) for _, out in parts] for f in fields(Forward)}
    return Forward(**{name: place(outputs, rows, width) for name, outputs in columns.items()})


@torch.no_grad()
def window_outputs(fn, batch: Trajectories, size: int | Budget, equal_count: bool = False, share: bool | None = False):
    """``fn`` on each trimmed micro batch of ``plan`` without gradients; outputs back in ``batch``'s row order, window
    tensors padded back to the batch's T columns. ``fn`` returns a tensor or a tuple of them (a None stays None).
    ``share``: the model's `model.shared_prefix`, where micro batches keep groups together (`by_group`)."""
    micro = plan(batch, size, equal_count, by_group(batch, share))
    parts = [(batch.rows_of(units), fn(batch.select_units(units).trimmed())) for units in micro]
    rows, width = [r for r, _ in parts], batch.loss_mask.shape[1]
    if isinstance(parts[0][1], torch.Tensor):
        return place([out for _, out in parts], rows, width)
    return tuple(place(list(column), rows, width) for column in zip(*(out for _, out in parts)))
