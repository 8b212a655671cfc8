"""Teacher-forced logprobs of trajectories' action windows under a causal LM."""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from rlhf.functional import entropy_from_logits, fused_logprobs, logprobs_from_logits
from rlhf.models import packing, shared_prefix
from rlhf.trajectory import Trajectories

FUSED_CHUNK_ON_CUDA = 1024  # `model.logprob_chunk: null` on CUDA: tokens per chunk of the fused output layer
# model families whose output layer's input is the last hidden state and whose logits are that layer's output as it
# is (no soft-capping or scaling after it): the families that pack, but granite (it scales its logits)
FUSES = packing.FAMILIES - {"granite"}


def logprob_chunk(model_cfg, device: torch.device) -> int:
    """Tokens per chunk of the fused output layer -> logprob (`model.logprob_chunk`); 0 = the plain logits. null:
    `FUSED_CHUNK_ON_CUDA` on CUDA, 0 elsewhere (the CPU float32 path bitwise as before)."""
    chunk = getattr(model_cfg, "logprob_chunk", None)
    if chunk is None:
        return FUSED_CHUNK_ON_CUDA if torch.device(device).type == "cuda" else 0
    return int(chunk)


def fuses(model: torch.nn.Module) -> bool:
    """Whether ``model``'s logprobs can come from the fused output layer (`fused_window_logprobs`): a plain
    `nn.Linear` head (not a LoRA-adapted one) of a `FUSES` family, its weight a whole tensor during and after the
    forward (not FSDP2's or ZeRO-3's shards, which their hooks gather only for the logits)."""
    head = output_layer(model)
    config = packing.model_config(model)
    if type(head) is not torch.nn.Linear or config is None or config.model_type not in FUSES:
        return False
    sharded = any(type(m).__name__.startswith("FSDP") for m in model.modules()) or hasattr(head.weight, "ds_id")
    return not sharded


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether the causal LM (or the DDP / DeepSpeed wrapper around it) takes `logits_to_keep`, computing the output
    layer for the last positions only."""
    inner = getattr(model, "module", model)
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def output_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    """The causal LM's output layer (the vocabulary projection), through a DDP or DeepSpeed wrapper; None when the
    model names none."""
    get = getattr(getattr(model, "module", model), "get_output_embeddings", None)
    return get() if callable(get) else None


def window_logits(model: torch.nn.Module, batch: Trajectories, temperature: float, share: bool | None = False) -> torch.Tensor:
    """Logits that predict each token of the action window, divided by the sampling temperature. Shape: (B, T, V).

    The rows run through the model packed end to end (`rlhf.models.packing`: no token-wise layer computes padding)
    when the model can take packed rows; otherwise each row is moved past its left padding
    (`Trajectories.justified_inputs`), so rows of prompts of different lengths compute no padding before them. The
    output layer (a vocabulary-sized matmul) runs on each row's window positions only: a hook hands it those
    positions of its input, row by row, so the logits are (B, T, V) however the rows are laid out. ``share``:
    `forward_layout`'s.
    """
    inputs, keep, columns, pick = head_layout(model, batch, share)
    picked = []

    def window_only(module, args):
        if not args or args[0].dim() != 3:
            return None
        picked.append(True)
        return (pick(args[0], columns), *args[1:])

    head = output_layer(model)
    handle = head.register_forward_pre_hook(window_only) if head is not None else None
    try:
        logits = model(**inputs, use_cache=False, **keep).logits
    finally:
        if handle is not None:
            handle.remove()
    window = logits if picked else pick(logits, columns)  # no output layer to hook: pick from the logits
    # in the model's dtype at temperature 1 (the log-softmax upcasts), else divided in float32
    return window if temperature == 1.0 else window.float() / temperature


def head_layout(model: torch.nn.Module, batch: Trajectories, share: bool | None = False) -> tuple[dict, dict, torch.Tensor, Callable]:
    """(forward inputs, the `logits_to_keep` keyword or none, the column of the output layer's input that predicts each
    window token (B, T), the function that picks those columns): `forward_layout`, with the output layer handed only
    the last positions, from the first predicting column, where the model takes `logits_to_keep`."""
    inputs, predicts, first, pick = forward_layout(model, batch, share)
    keep = {"logits_to_keep": inputs["input_ids"].shape[1] - first} if keeps_logits(model) else {}
    return inputs, keep, predicts - first if keep else predicts, pick


def forward_layout(
    model: torch.nn.Module, batch: Trajectories, share: bool | None = False
) -> tuple[dict, torch.Tensor, int, Callable]:
    """(keyword inputs of a teacher-forced forward, the column of its outputs that predicts each window token (B, T),
    the smallest such column, the function that picks those columns from (rows, columns, ...) outputs): the rows
    packed when ``model`` takes packed rows and no row has a hole, else justified. ``share`` (`model.shared_prefix`):
    rows of one prompt in the shared-prefix layout (`rlhf.models.shared_prefix`) where the model packs and rows share a
    prompt: True wherever they do, None where it pays (`micro_batches.pays`), False never."""
    packs = packing.packs(model)
    shared = shared_prefix.share(batch, force=bool(share)) if packs and share is not False else None
    if shared is not None:
        return packing.layout_inputs(shared, packing.model_config(model)), shared.predicts, shared.first_predict, pick_packed
    packed = packing.pack(batch) if packs else None
    if packed is not None:
        return packed.forward_inputs(packing.model_config(model)), packed.predicts, packed.first_predict, pick_packed
    input_ids, attention_mask, position_ids, predicts = batch.justified_inputs()
    first = int(predicts.min()) if predicts.numel() else 0
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    return inputs, predicts, first, pick_columns


def pick_packed(outputs: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``outputs[0, columns[b, t]]`` for every row b and column t of packed rows. Shapes: outputs (1, N, ...),
    columns (B, T) -> (B, T, ...)."""
    return outputs[0].index_select(0, columns.reshape(-1)).unflatten(0, columns.shape)


def pick_columns(outputs: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``outputs[b, columns[b, t]]`` for every row b and column t: a slice (no copy) when every row's columns are the
    same consecutive ones. Shapes: outputs (B, L, ...), columns (B, T) -> (B, T, ...)."""
    width = columns.shape[1]
    if width and (columns == columns[:1]).all() and (columns[0] == columns[0, 0] + torch.arange(width, device=columns.device)).all():
        start = int(columns[0, 0])
        return outputs[:, start : start + width]
    index = columns.reshape(*columns.shape, *([1] * (outputs.dim() - 2))).expand(-1, -1, *outputs.shape[2:])
    return outputs.gather(1, index)


def window_logprobs(
    model: torch.nn.Module, batch: Trajectories, temperature: float, with_entropy: bool = False, entropy_grad: bool = True,
    chunk: int = 0, share: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs (B, T), entropy (B, T) or None) of each window token; 0 outside the loss mask. ``entropy_grad=False``
    computes the entropy outside the autograd graph (a metric only: no (B, T, V) softmax kept for the backward).
    ``chunk`` > 0 (`logprob_chunk`): the fused output layer, ``chunk`` tokens at a time, where the model `fuses`.
    ``share``: the shared-prefix layout, as `forward_layout` takes it."""
    if chunk > 0 and fuses(model):
        return fused_window_logprobs(model, batch, temperature, with_entropy, entropy_grad, chunk, share)
    logits = window_logits(model, batch, temperature, share)
    logp = logprobs_from_logits(logits, batch.window_ids) * batch.loss_mask
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits) * batch.loss_mask
    return logp, entropy


def fused_window_logprobs(
    model: torch.nn.Module, batch: Trajectories, temperature: float, with_entropy: bool, entropy_grad: bool, chunk: int,
    share: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`window_logprobs` with the output layer fused into the logprob (`rlhf.functional.fused_logprobs`): the layer's
    hooks take its input at the window positions and hand it an empty one, so it computes nothing, and the logprobs
    (with their own backward) come from its weight ``chunk`` tokens at a time. No (B, T, V) logits exist."""
    inputs, keep, columns, pick = head_layout(model, batch, share)
    out: dict[str, torch.Tensor | None] = {}

    def take_window(module, args):
        if not args or args[0].dim() != 3 or "logp" in out:
            return None
        out["hidden"] = pick(args[0], columns)
        return (args[0][:, :0], *args[1:])

    def fuse(module, args, output):  # inside the model's forward, where every wrapper's weights are whole
        if "hidden" in out:
            out["logp"], out["entropy"] = fused_logprobs(
                out.pop("hidden"), module.weight, batch.window_ids, temperature, module.bias, chunk, with_entropy,
                entropy_grad,
            )

    head = output_layer(model)
    handles = [head.register_forward_pre_hook(take_window), head.register_forward_hook(fuse, prepend=True)]
    try:
        model(**inputs, use_cache=False, **keep)
    finally:
        for handle in handles:
            handle.remove()
    entropy = out["entropy"]
    return out["logp"] * batch.loss_mask, None if entropy is None else entropy * batch.loss_mask


@torch.no_grad()
def in_chunks(fn, batch: Trajectories, size: int):
    """``fn`` on consecutive row chunks of at most ``size`` rows, without gradients; outputs concatenated by row.

    ``fn`` returns a tensor or a tuple of tensors (a None stays None).
    """
    parts = [fn(part) for part in batch.chunks(size)]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return tuple(None if column[0] is None else torch.cat(column) for column in zip(*parts))
