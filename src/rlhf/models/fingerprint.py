"""Weight fingerprints: every tensor of a state dict reduced to one float64, a weighted sum of a fixed
pseudo-random sample of its elements (the same sample wherever it is computed: it depends only on the tensor's size).
Generators report the fingerprints of what they hold; `rlhf.checks.weight_sync` compares them with the trainer's."""

from __future__ import annotations

import functools

import torch

SAMPLE = 1024  # elements sampled per tensor: enough that a stale or missed tensor differs with certainty


@functools.lru_cache(maxsize=256)
def sample_of(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices (k,), float64 weights (k,)) of the elements a tensor of ``numel`` elements is fingerprinted on."""
    generator = torch.Generator().manual_seed(numel)
    k = min(numel, SAMPLE)
    indices = torch.randperm(numel, generator=generator)[:k] if numel <= SAMPLE else torch.randint(
        0, numel, (k,), generator=generator)
    return indices, torch.rand(k, generator=generator, dtype=torch.float64) + 0.5


def tensor_fingerprint(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """sum(w * x[i]) over the sampled elements of ``tensor`` (cast to ``dtype`` first), in float64."""
    return fingerprint({"tensor": tensor}, dtype)["tensor"]


@functools.lru_cache(maxsize=16)
def layout_of(numels: tuple[int, ...]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """For tensors of these sizes: each one's sampled indices, then every sample's tensor number (k_total,) and
    weight (k_total,) float64, concatenated in order."""
    samples = [sample_of(numel) for numel in numels]
    counts = torch.tensor([len(indices) for indices, _ in samples])
    segments = torch.repeat_interleave(torch.arange(len(numels)), counts)
    return [indices for indices, _ in samples], segments, torch.cat([weights for _, weights in samples])


def fingerprint(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, float]:
    """{name: `tensor_fingerprint`} of every floating-point tensor of a state dict (cast to ``dtype`` first).

    One gather per tensor, then a handful of operations over all samples at once: per-operation overhead, not
    arithmetic, is what a small model's push costs here."""
    tensors = {name: t.detach().reshape(-1) for name, t in state.items() if t.is_floating_point()}
    if not tensors:
        return {}
    indices, segments, weights = layout_of(tuple(t.numel() for t in tensors.values()))
    gathered = [torch.index_select(t, 0, i.to(t.device)) for t, i in zip(tensors.values(), indices)]
    values = torch.cat(gathered)  # mixed dtypes promote exactly (e.g. bfloat16 into float32)
    if dtype is not None:
        values = values.to(dtype)
    sums = torch.zeros(len(tensors), dtype=torch.float64).index_add_(0, segments, values.double().cpu() * weights)
    return dict(zip(tensors, sums.tolist()))


def first_difference(pushed: dict[str, float], held: dict[str, float], partial: bool = False) -> str | None:
    """The first tensor whose fingerprints differ or that one side lacks (in push order, then the tensors only the
    generator holds, unless the push was ``partial``: some of the weights only); None when all agree."""
    for name, value in pushed.items():
        if name not in held or abs(value - held[name]) > 1e-9 * (1.0 + abs(value)):
            return name
    return None if partial else next((name for name in held if name not in pushed), None)
