"""Packed forwards: a micro batch's rows end to end in one sequence, so the token-wise layers (projections, MLPs,
norms, the output layer) compute no padding at all.

Attention stays inside each row. The policy, reference and critic models run on an attention implementation
registered here (`IMPLEMENTATION`): without packing arguments it is PyTorch SDPA unchanged (Hugging Face's own
function); with them (`Packed.attention_kwargs`) it gathers each row's queries, keys and values into a (rows, heads,
longest row, head dim) block, runs causal SDPA on it (in float32 for low-precision weights on the CPU, where that is
faster: `rlhf.models.cpu_attention`) and scatters the outputs back. The block's columns past a row's
last token (filled with the tokens after it) come after every real token of the row, where causal attention keeps
them from it, so every real token sees exactly what it sees in the padded layout, and their outputs are dropped.
Attention pays for those columns; the token-wise layers, most of a forward, do not. On CUDA in half precision the
rows go instead through torch's own variable-length attention (`torch.nn.attention.varlen`), which computes no such
columns at all.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AutoConfig, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

try:  # torch's variable-length attention (torch 2.10 on); packed rows use it on CUDA where it fits (`uses_varlen`)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

from rlhf.errors import ConfigError
from rlhf.models.cpu_attention import sdpa
from rlhf.models.loading import resolve_model_path
from rlhf.models.shared_prefix import gathered, heads_for, shared_attention
from rlhf.trajectory import Trajectories

IMPLEMENTATION = "rlhf_packed"  # the attention implementation name packed models run on
# model families whose every layer is full causal self-attention over rotary positions, with nothing else mixing
# tokens: a packed row sees no other row. Others (hybrid SSM or convolution layers, chunked or soft-capped
# attention, attention sinks) keep the justified layout until checked
FAMILIES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gpt_neox", "olmo", "olmo2", "phi3",
    "granite",
})
UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "position_bias")  # attention arguments the packed path cannot honour
VARLEN_ON_CUDA = True  # packed rows through torch's variable-length attention where it runs (bench/gpu_check.py compares)


@functools.cache  # read once: packed attention asks on every layer of every forward
def varlen_kernel() -> tuple | None:
    """(torch's variable-length (flash) attention, the keyword arguments that make it causal, whether it takes
    grouped-query heads, whether it takes a scale), or None where this torch has none. Its CUDA kernels take half
    precision only; it has no CPU kernel."""
    if varlen_attn is None:
        return None
    takes = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in takes else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in takes, "scale" in takes


def uses_varlen(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether packed rows of ``query`` run on `varlen_kernel` (CUDA, bf16 or fp16) rather than the per-row block: where
    the kernel exists and takes the model's heads as they are. Grouped-query attention on a kernel without
    ``enable_gqa`` (torch 2.11's) would need the key/value heads copied out per query head: measured slower on an H100
    (Qwen2.5-0.5B shape, 14 query / 2 key-value heads) than SDPA's own grouping in the block path, so the block runs."""
    if not (VARLEN_ON_CUDA and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)):
        return False
    kernel = varlen_kernel()
    return kernel is not None and (kernel[2] or query.shape[1] == key.shape[1])


def varlen_attention(query, key, value, cu_seqlens: torch.Tensor, longest: int, scaling) -> torch.Tensor:
    """Causal attention inside each packed row by `varlen_kernel`. Shapes: query (1, H, N, D), key and value
    (1, Hkv, N, D), cu_seqlens (R + 1,) int32 -> (1, N, H, D)."""
    kernel, causal, _, takes_scale = varlen_kernel()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, heads, D)
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}  # `uses_varlen`: only where the kernel takes it
    scale = {"scale": scaling} if takes_scale else {}  # else the kernel's 1 / sqrt(D), which every family here uses
    return kernel(q, k, v, cu_seqlens, cu_seqlens, longest, longest, **scale, **causal, **gqa).unsqueeze(0)


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Hugging Face attention function: SDPA, each row of a packed sequence attending only inside itself when
    ``kwargs`` carry `Packed.attention_kwargs`. Shapes: query (1, H, N, D), key and value (1, Hkv, N, D) ->
    ((1, N, H, D), None)."""
    rows_index = kwargs.get("rows_index")
    shared = kwargs.get("key_index") is not None  # a shared-prefix layout (`rlhf.models.shared_prefix`)
    if rows_index is None and not shared:
        if attention_mask is not None and attention_mask.shape[-2:] == (1, 1) and query.shape[2] > 1:
            raise ValueError(
                f"packed rows reached {type(module).__name__}'s attention without their packing arguments (a wrapper "
                "dropped the forward's keyword arguments): each row would attend to the others"
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    given = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if given:
        raise ValueError(f"packed rows cannot honour the attention arguments {given} of {type(module).__name__}")
    if shared:
        if dropout != 0.0:
            raise ValueError(f"a shared-prefix layout cannot run {type(module).__name__}'s attention with dropout")
        return shared_attention(query, key, value, scaling, kwargs), None
    if dropout == 0.0 and uses_varlen(query, key):
        return varlen_attention(query, key, value, kwargs["cu_seqlens"], kwargs["longest"], scaling), None
    # (1, H, N, D) -> (R, H, W, D): row r's column c is packed token rows_index[r, c] (past the row's end: a
    # token of the next row, whose outputs are dropped and which causal attention keeps from the real ones)
    q, k, v = (gathered(t, rows_index) for t in (query, key, value))
    k, v, gqa = heads_for(q, k, v)  # grouped-query attention: SDPA's own grouping, or the key/value heads repeated
    out = sdpa(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
    out = out.transpose(1, 2).reshape(rows_index.numel(), out.shape[1], out.shape[3])
    return out.index_select(0, kwargs["tokens_index"]).unsqueeze(0), None


def packed_mask(*args, attention_mask=None, **kwargs):
    """Hugging Face mask function: SDPA's own, except for a packed forward (no 2-D mask, no cache: queries and keys
    are the same N tokens), which needs none (`packed_attention` keeps each row to itself): no (N, N) mask is built.
    A cached forward or one with a mask gets exactly SDPA's. (transformers 4.x passes no ``q_length``: the queries
    are then the ``cache_position`` entries.)"""
    q_length = kwargs.get("q_length")
    if q_length is None and kwargs.get("cache_position") is not None:
        q_length = kwargs["cache_position"].shape[0]
    fresh = q_length == kwargs.get("kv_length") and not kwargs.get("q_offset") and not kwargs.get("kv_offset")
    if attention_mask is None and fresh:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(IMPLEMENTATION, packed_attention)
AttentionMaskInterface.register(IMPLEMENTATION, packed_mask)


def model_config(model: torch.nn.Module) -> PretrainedConfig | None:
    """The Hugging Face config of ``model``, through DDP, DeepSpeed, peft or `ValueModule` wrappers; None if none."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            return config
    return None


def can_pack(config: PretrainedConfig | None, attention: tuple[str, ...] = ("sdpa",)) -> bool:
    """Whether a model of ``config`` can take packed rows: a family of `FAMILIES` on an attention implementation of
    ``attention`` (one that hands packed rows to `packed_attention`, or that `enable` replaces), every layer full
    attention (no sliding window, no chunked attention)."""
    if config is None or config.model_type not in FAMILIES or config._attn_implementation not in attention:
        return False
    # a window of None or 0 is no window (Qwen2-MoE's config sets 0 when use_sliding_window is off)
    if getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None):
        return False
    return all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ())


def check_shared_prefix(model_cfg, name_or_path: str | None = None) -> None:
    """ConfigError before any weights load when `model.shared_prefix` is true and the model of ``name_or_path``
    (default `model.name_or_path`) cannot take packed rows (`can_pack`, read from its config alone): the shared-prefix
    layout is a packed one."""
    if not getattr(model_cfg, "shared_prefix", None):
        return
    name = name_or_path or model_cfg.name_or_path
    config = AutoConfig.from_pretrained(
        resolve_model_path(name), revision=model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code
    )
    if not can_pack(config, attention=(config._attn_implementation,)):
        raise ConfigError(
            f"model.shared_prefix=true: {name} ({config.model_type}) cannot take packed rows, and the shared-prefix "
            f"layout is a packed one (families: {', '.join(sorted(FAMILIES))}; every layer full attention, no sliding "
            "window); set model.shared_prefix=null (shared where the model packs and it pays) or false"
        )


def enable(model: torch.nn.Module) -> bool:
    """Switch a freshly loaded model from SDPA to `IMPLEMENTATION`, so its forwards can take packed rows. Models that
    cannot (`can_pack`: other attention, other families, sliding windows; or transformers cannot switch them) are
    left as they are, and run the justified layout. Returns whether the model now packs."""
    if not can_pack(model_config(model)):
        return False
    if not getattr(model, "_can_set_attn_implementation", lambda: False)():
        return False
    model.set_attn_implementation(IMPLEMENTATION)
    return packs(model)


def packs(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the model inside a wrapper) runs on `IMPLEMENTATION`."""
    config = model_config(model)
    return config is not None and config._attn_implementation == IMPLEMENTATION


@dataclass
class Packed:
    """A batch's rows end to end, each from its first real token to its last. Shapes: N packed tokens, R rows."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N): positions restart at 0 with each row
    lengths: torch.Tensor  # (R,) tokens of each row
    width: int  # the longest row
    predicts: torch.Tensor  # (R, T): the packed position whose output predicts each window token
    tokens_index: torch.Tensor  # (N,): each packed token's place in the (R, width) block, row * width + column
    first_predict: int  # the smallest entry of predicts, known on the host

    def attention_kwargs(self) -> dict:
        """Keyword arguments a Hugging Face model passes down to `packed_attention` (`rows_attention_kwargs`)."""
        return rows_attention_kwargs(self.lengths, self.width, self.tokens_index)

    def forward_inputs(self, config: PretrainedConfig | None = None) -> dict:
        """Keyword inputs of the Hugging Face model's forward over the packed rows (`layout_inputs`)."""
        return layout_inputs(self, config)


def layout_inputs(layout, config: PretrainedConfig | None = None) -> dict:
    """Keyword inputs of the Hugging Face model's forward over a packed layout (`Packed`, or a shared-prefix one,
    `rlhf.models.shared_prefix.SharedPacked`), for a model of ``config``: with `unread_mask`, except where the model
    reads the mask itself (a mixture of experts' router balancing loss, `output_router_logits`), which then gets
    none."""
    inputs = {"input_ids": layout.input_ids, "position_ids": layout.position_ids, **layout.attention_kwargs()}
    if not getattr(config, "output_router_logits", False):
        inputs["attention_mask"] = unread_mask(layout.input_ids.device)
    return inputs


def rows_attention_kwargs(lengths: torch.Tensor, width: int, tokens_index: torch.Tensor) -> dict:
    """Keyword arguments a Hugging Face model passes down to `packed_attention` for rows of ``lengths`` packed end to
    end (the longest ``width``; ``tokens_index``: each packed token's place in the (R, width) block): the gather/scatter
    indices between packed tokens and (R, W) rows, and the rows' bounds. Shapes: lengths (R,), tokens_index (N,)."""
    starts = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    columns = torch.arange(width, device=starts.device)
    rows_index = (starts[:-1, None] + columns).clamp(max=len(tokens_index) - 1)
    # a compiled model (`policy.compile`) keeps the row count symbolic even at one row, rather than compiling a
    # graph for the one-row micro batch (dynamo specialises sizes 0 and 1 unless told otherwise)
    torch._dynamo.decorators.mark_unbacked(rows_index, 0)
    cu_seqlens = starts.to(torch.int32)  # the rows' bounds, for the variable-length kernel (`varlen_attention`)
    return {"rows_index": rows_index, "tokens_index": tokens_index, "cu_seqlens": cu_seqlens, "longest": width}


def unread_mask(device: torch.device) -> torch.Tensor:
    """The attention mask a packed forward passes, never read (packed rows attend inside themselves): a 4-D mask is
    one Hugging Face takes as built, so it builds none and skips its packed-sequence detection, which reads the
    position ids back from the device on every forward (a host sync)."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)


def token_places(lengths: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each of the ``total`` tokens of rows of ``lengths`` packed end to end comes from: (its row (N,), each
    row's first packed position (R + 1,), the last entry ``total``, its place in its row (N,)). Shape: lengths (R,)."""
    row = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths, output_size=total)
    starts = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    return row, starts, torch.arange(total, device=lengths.device) - starts[row]


def pack(batch: Trajectories) -> Packed | None:
    """``batch``'s rows packed end to end; None when a row has padding between real tokens (a packed row has no
    mask). Rows that would need no padding (one row, or all of one length) are packed too: every training forward
    then has the same form, which a compiled model (`policy.compile`) traces once. The sizes come from
    ``batch.host_spans`` when the batch carries them (no device read), else from one read of the device."""
    if not len(batch):
        return None
    device = batch.input_ids.device
    if batch.host_spans is not None:
        first_h, last_h, real_h = batch.host_spans.unbind(1)
        lengths_h = last_h + 1 - first_h
        total, real, width = int(lengths_h.sum()), int(real_h.sum()), int(lengths_h.max())
        first0, length0 = int(first_h[0]), int(lengths_h[0])
        first, lengths = first_h.to(device, non_blocking=True), lengths_h.to(device, non_blocking=True)
    else:
        first, last = batch.real_spans()
        lengths = last + 1 - first
        total, real, width, first0, length0 = torch.stack(
            [lengths.sum(), batch.attention_mask.sum(), lengths.max(), first[0], lengths[0]]
        ).tolist()
    if total != real:
        return None
    row, starts, offset = token_places(lengths, total)
    window = torch.arange(batch.loss_mask.shape[1], device=device)
    # window column t is token window_start + t; its prediction comes from the row's token before it (padded window
    # columns past a row's end point at the row's last token: their outputs are masked)
    inside = (batch.window_start - 1 - first[:, None] + window).clamp(min=0).minimum(lengths[:, None] - 1)
    return Packed(
        input_ids=batch.input_ids[row, first[row] + offset].unsqueeze(0),
        position_ids=offset.unsqueeze(0),
        lengths=lengths,
        width=int(width),
        predicts=starts[:-1, None] + inside,
        tokens_index=row * width + offset,
        # the smallest of predicts: row 0's first window column (every later row's columns start past row 0's)
        first_predict=min(max(0, batch.window_start - 1 - first0), length0 - 1),
    )
