"""The few collectives the training ranks share outside their strategies' own: one flag or a few counts agreed
over the default process group, and nothing at all without one."""

from __future__ import annotations

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_ranks_true(flag: bool) -> bool:
    """True on every rank iff ``flag`` is true on every rank (a collective; just ``flag`` without a group)."""
    if world()[1] == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def all_ranks_max(*values: int) -> tuple[int, ...]:
    """The largest of each value over the ranks (one collective; the values themselves without a group)."""
    if world()[1] == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.long, device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tuple(int(v) for v in tensor.tolist())


def collective_device() -> torch.device:
    """Where a small tensor for a collective must live: the rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
