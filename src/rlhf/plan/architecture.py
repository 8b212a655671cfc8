"""What the plan knows of a model, from its `config.json` alone: parameter counts and activation bytes.

Nothing is downloaded but the config and no weight is allocated. Parameters are counted on a model built on the
meta device. Activations are traced: the model runs forward on fake tensors (shapes without storage) under
`torch.autograd.graph.saved_tensors_hooks`, which sees every tensor autograd keeps for the backward pass. The
trace runs with one and with two layers and is extrapolated linearly to the model's depth.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, PretrainedConfig

from rlhf.errors import ConfigError
from rlhf.functional import entropy_from_logits, fused_logprobs, logprobs_from_logits
from rlhf.models.logprobs import fuses, output_layer
from rlhf.disk import looks_local
from rlhf.models.loading import resolve_model_path
from rlhf.models.lora import adapted_layers, check_not_adapter
from rlhf.models.value import token_scores

NEEDED_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size")  # what the plan reads from a config.json


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, and the config key that names it (for messages)."""

    key: str  # e.g. model.name_or_path
    name: str  # hub name, local folder or builtin:<name>
    revision: str | None = None  # hub revision
    trust_remote_code: bool = False  # model code from the hub


@dataclass(frozen=True)
class Activations:
    """Bytes autograd keeps for one micro batch's backward pass, split as the plan needs them."""

    per_layer: int  # kept by one decoder layer (what gradient checkpointing drops)
    layer_input: int  # one layer's input (what gradient checkpointing keeps per layer)
    outside_layers: int  # embeddings, final norm, output layer and the loss's log-softmax
    largest: int  # the largest single kept tensor (its gradient is the backward's largest temporary)

    def total(self, layers: int, checkpointing: bool) -> int:
        """Kept bytes for a model of ``layers`` layers; with checkpointing one layer is recomputed at a time."""
        if checkpointing:
            return layers * self.layer_input + self.per_layer + self.outside_layers
        return layers * self.per_layer + self.outside_layers


def read_config(source: ModelSource) -> PretrainedConfig:
    """The model's config, checked to hold the fields the plan needs; ConfigError naming ``source.key``."""
    path = resolve_model_path(source.name)
    if looks_local(path):
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise ConfigError(
                f"{source.key}={source.name}: no such folder; give a folder holding the model (config.json and its "
                f"weights) or a hub name such as Qwen/Qwen2.5-0.5B"
            )
        check_not_adapter(source.key, source.name, path)
    try:
        config = AutoConfig.from_pretrained(path, revision=source.revision, trust_remote_code=source.trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"{source.key}={source.name}: its config.json cannot be read ({err})") from None
    text = getattr(config, "text_config", None) or config
    raw = _raw_fields(path)
    aliases = {value: key for key, value in getattr(type(text), "attribute_map", {}).items()}
    for field in NEEDED_FIELDS:
        names = {field, aliases.get(field, field)}
        if (raw is not None and not names & raw) or getattr(text, field, None) is None:
            raise ConfigError(
                f"{source.key}={source.name}: config.json has no {' / '.join(sorted(names))}, which the memory plan "
                f"needs; the file is incomplete (download the model's config.json again)"
            )
    return config


def _raw_fields(path: str) -> set[str] | None:
    """The top-level (and text_config) keys of a local config.json, or None for a hub model (read by transformers)."""
    file = Path(path).expanduser() / "config.json"
    if not (looks_local(path) and file.is_file()):
        return None
    raw = json.loads(file.read_text(encoding="utf-8"))
    return set(raw) | set(raw.get("text_config") or {})


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's part of a config (multimodal configs nest it as `text_config`)."""
    return getattr(config, "text_config", None) or config


@functools.lru_cache(maxsize=32)
def parameter_count(source: ModelSource, head: str = "lm") -> int:
    """Parameters of the model with an output layer (``head="lm"``) or a scalar head (``"value"``: critics and
    reward models, built with `AutoModelForSequenceClassification` like `rlhf.models.value`)."""
    with torch.device("meta"):
        model = _build(read_config(source), head, source.trust_remote_code)
    return sum(p.numel() for p in model.parameters())


def lora_parameter_counts(source: ModelSource, lora_cfg) -> tuple[int, int]:
    """(parameters of the LoRA adapters `policy.lora` adds: rank x (in + out) per adapted linear layer, parameters of
    those layers' base weights: what each weight push merges into a new copy)."""
    with torch.device("meta"):
        model = _build(read_config(source), "lm", source.trust_remote_code)
    layers = dict(model.named_modules())
    adapted = [layers[name] for name in adapted_layers(model, list(lora_cfg.target_modules))]
    return (sum(lora_cfg.rank * (m.in_features + m.out_features) for m in adapted),
            sum(m.in_features * m.out_features for m in adapted))


def _build(config: PretrainedConfig, head: str, trust_remote_code: bool, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The model of ``config`` (random weights; on the meta device or fake tensors where the caller says), in
    ``dtype`` (None: float32)."""
    if dtype is not None:
        config = copy.deepcopy(config)
        config.dtype = dtype
    if head == "value":
        config = copy.deepcopy(config)
        config.num_labels = 1
        return AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def with_layers(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """A copy of ``config`` with ``layers`` decoder layers (per-layer lists cut to match)."""
    small = copy.deepcopy(config)
    text = text_config(small)
    text.num_hidden_layers = layers
    for name in ("layer_types", "mlp_only_layers"):
        value = getattr(text, name, None)
        if isinstance(value, list) and len(value) > layers:
            setattr(text, name, value[:layers])
    return small


def activations(
    source: ModelSource, micro_batch: int, seq_len: int, window: int, mode: str | bool, head: str = "lm", chunk: int = 0
) -> Activations:
    """Activation bytes of one training forward: ``micro_batch`` rows of ``seq_len`` tokens, the output layer and
    log-softmax (and entropy) on the last ``window`` positions (`rlhf.models.logprobs`; ``chunk`` > 0: the fused
    output layer, which keeps no logits), computed as ``mode`` says: ``float32``, ``autocast`` (float32 weights,
    bfloat16 autocast) or ``bf16`` (bf16 weights; True and False mean autocast and float32). ``head="value"``: a
    critic's scalar head on every position instead.

    Every kept tensor is proportional to the rows (the weights' bf16 copies aside), so one row is traced and scaled."""
    mode = {True: "autocast", False: "float32"}.get(mode, mode)
    row = _one_row(source, seq_len, window, mode, head, chunk)
    weight_casts = row.weight_casts
    return Activations(
        per_layer=micro_batch * (row.per_layer - weight_casts.per_layer) + weight_casts.per_layer,
        layer_input=micro_batch * row.layer_input,
        outside_layers=micro_batch * (row.outside_layers - weight_casts.outside_layers) + weight_casts.outside_layers,
        largest=micro_batch * row.largest,
    )


@dataclass(frozen=True)
class _Row(Activations):
    weight_casts: Activations = None  # the part that does not grow with rows: autocast's bf16 copies of the weights


@functools.lru_cache(maxsize=64)
def _one_row(source: ModelSource, seq_len: int, window: int, mode: str, head: str, chunk: int) -> _Row:
    """`Activations` of a single row, with its row-independent part (bf16 weight copies) apart."""
    config = read_config(source)
    one = _trace(with_layers(config, 1), 1, seq_len, window, mode, head, source.trust_remote_code, chunk)
    two = _trace(with_layers(config, 2), 1, seq_len, window, mode, head, source.trust_remote_code, chunk)
    per_layer = max(two["total"] - one["total"], 0)
    cast_layer = max(two["weights"] - one["weights"], 0)
    hidden = text_config(config).hidden_size
    return _Row(
        # the residual stream entering a layer: float32, or bf16 with bf16 weights
        per_layer=per_layer, layer_input=seq_len * hidden * (2 if mode == "bf16" else 4),
        outside_layers=max(one["total"] - per_layer, 0), largest=max(one["largest"], two["largest"]),
        weight_casts=Activations(cast_layer, 0, max(one["weights"] - cast_layer, 0), 0),
    )


def _fused_forward(model, ids, mask, positions, window: int, chunk: int) -> None:
    """The forward of `rlhf.models.logprobs.fused_window_logprobs` on plain rows: the output layer handed an empty
    input, the logprobs and entropies of the last ``window`` positions from its weight, ``chunk`` tokens at a time."""
    head, taken = output_layer(model), {}

    def take(module, args):
        taken["hidden"] = args[0]
        return (args[0][:, :0], *args[1:])

    handle = head.register_forward_pre_hook(take)
    try:
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=window)
    finally:
        handle.remove()
    fused_logprobs(taken["hidden"], head.weight, ids[:, -window:], 1.0, head.bias, chunk, with_entropy=True)


def _trace(config, micro_batch: int, seq_len: int, window: int, mode: str, head: str, trust: bool, chunk: int = 0) -> dict:
    """{"total": bytes autograd keeps, "largest": the largest kept tensor} for one forward on fake tensors."""
    bf16_autocast = mode == "autocast"
    kept: dict[int, int] = {}
    casts: set[int] = set()  # kept tensors shaped like a weight: autocast's copies of it, which rows do not scale
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _build(config, head, trust, torch.bfloat16 if mode == "bf16" else None).train()
        params = {id(p) for p in model.parameters()}
        weight_shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape[::-1]) for p in model.parameters()}

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            base = tensor if tensor._base is None else tensor._base
            if id(tensor) not in params and id(base) not in params:  # weights are counted once, as weights
                kept[id(base)] = base.numel() * base.element_size()
                if bf16_autocast and tuple(base.shape) in weight_shapes and base.dtype == torch.bfloat16:
                    casts.add(id(base))
            return tensor

        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        mask = torch.ones(micro_batch, seq_len, dtype=torch.long)
        positions = torch.arange(seq_len).expand(micro_batch, seq_len)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16_autocast else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), autocast:
            if head == "value":
                token_scores(model, ids, mask, positions)
            elif chunk and fuses(model):
                _fused_forward(model, ids, mask, positions, window, chunk)
            else:
                logits = model(
                    input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=window
                ).logits
                logprobs_from_logits(logits, ids[:, -window:])
                entropy_from_logits(logits)
    return {"total": sum(kept.values()), "largest": max((v for k, v in kept.items() if k not in casts), default=0),
            "weights": sum(kept[k] for k in casts)}
