"""LoRA adapters on the policy (`policy.lora.*`, through peft): adding them, checking their targets before any model
loads, the merged weights the generators load, and the adapter-only files of checkpoints and exports.

A LoRA layer computes ``W x + (alpha / rank) * B A x`` with the base weight ``W`` frozen; only ``A`` (rank, in) and
``B`` (out, rank) train. The generators never see adapters: they load merged weights ``W + (alpha / rank) B A``
under the base model's names, and only for the layers that carry adapters (every other weight is the base's, which
the generator loaded itself). The reference of the KL term is the same model with its adapters switched off.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from rlhf.errors import ConfigError
from rlhf.models.loading import meta_causal_lm

log = logging.getLogger("rlhf")

ADAPTER = "default"  # peft's name for the one adapter the policy trains
ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the output layer
PEFT_PREFIX = "base_model.model."  # what a PeftModel puts before the wrapped model's own parameter names


class AdaptersOff:
    """The KL reference of a LoRA policy: the policy's own base weights with the adapters switched off, so no second
    copy of the model is loaded. ``policy``: a `TorchPolicy` or its Ray handle (`RemoteTrainer`)."""

    def __init__(self, policy) -> None:
        self.policy = policy
        log.info("reference: the policy's base weights with its LoRA adapters off (no second copy loaded)")

    def rollout_logprobs(self, batch, chunk) -> torch.Tensor:
        """Logprobs (B, T) of the action window under the base model, no gradients."""
        return self.policy.base_logprobs(batch, chunk)


def enabled(lora_cfg) -> bool:
    """Whether `policy.lora` asks for adapters (a rank is set)."""
    return lora_cfg is not None and lora_cfg.rank is not None


def check_values(lora_cfg, key: str = "policy.lora") -> None:
    """ConfigError for a rank, alpha or dropout out of range (cheap: no model needed). Dropout must be 0: RL logprobs
    are deterministic given the weights."""
    if not enabled(lora_cfg):
        return
    if lora_cfg.rank <= 0:
        raise ConfigError(f"{key}.rank={lora_cfg.rank}: a LoRA rank must be a positive integer (8 or 16 are usual); null trains every weight")
    if lora_cfg.alpha <= 0:
        raise ConfigError(f"{key}.alpha={lora_cfg.alpha} must be > 0 (the update is scaled by alpha / rank; 2 x rank is usual)")
    if lora_cfg.dropout != 0.0:
        raise ConfigError(
            f"{key}.dropout={lora_cfg.dropout}: dropout makes the trainer's logprobs random for the same weights, so the "
            f"generator-trainer parity check, the gap watch and the importance ratios would read noise (every dropout of "
            f"the models is off for that reason; a resume's parity check refuses such a run); set {key}.dropout=0"
        )
    if not lora_cfg.target_modules:
        raise ConfigError(f"{key}.target_modules is empty; name module suffixes such as [q_proj, v_proj], or [{ALL_LINEAR}]")


def linear_names(model: torch.nn.Module) -> list[str]:
    """The qualified names of the model's linear layers, the output layer excluded (what `all-linear` targets)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear) and module is not output]


def matches(name: str, target: str) -> bool:
    """peft's rule for a target given as a string: the module's name is ``target`` or ends in ``.target``."""
    return name == target or name.endswith("." + target)


def adapted_layers(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The names of the linear layers `add_adapters` puts adapters on, for ``targets`` (`target_modules`)."""
    names = linear_names(model)
    return names if targets == [ALL_LINEAR] else [n for n in names if any(matches(n, t) for t in targets)]


def unmatched_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The entries of ``targets`` that name no linear layer of ``model`` (`all-linear` always matches one)."""
    names = linear_names(model)
    return [t for t in targets if t != ALL_LINEAR and not any(matches(name, t) for name in names)]


def check_targets(lora_cfg, model_cfg, key: str = "policy.lora", name_or_path: str | None = None) -> None:
    """ConfigError when a target module matches no linear layer of the model (``name_or_path``, default
    `model.name_or_path`), or when the rank is past the narrowest adapted layer's width (the adapters would then hold
    more than the layers they adapt: no longer low rank); builds the model on the meta device from its config (no
    weights load)."""
    if not enabled(lora_cfg):
        return
    name_or_path = name_or_path or model_cfg.name_or_path
    model = meta_causal_lm(model_cfg, name_or_path)
    missing = unmatched_targets(model, list(lora_cfg.target_modules))
    if missing:
        suffixes = sorted({name.rsplit(".", 1)[-1] for name in linear_names(model)})
        raise ConfigError(
            f"{key}.target_modules: {missing} match no linear layer of {name_or_path}; its linear layers end "
            f"in {suffixes} (or use [{ALL_LINEAR}])"
        )
    layers = dict(model.named_modules())
    widths = {name: min(layers[name].in_features, layers[name].out_features)
              for name in adapted_layers(model, list(lora_cfg.target_modules))}
    narrowest = min(widths, key=widths.get)
    if lora_cfg.rank > widths[narrowest]:
        raise ConfigError(
            f"{key}.rank={lora_cfg.rank} is past the width of the adapted layer {narrowest} ({widths[narrowest]}) of "
            f"{name_or_path}: a rank-r adapter of an m x n layer is low rank only for r < min(m, n); set {key}.rank "
            f"<= {widths[narrowest]} (8 to 64 is usual), or drop that layer from {key}.target_modules"
        )


def add_adapters(model: torch.nn.Module, lora_cfg, head: str | None = None):
    """``model`` wrapped as a peft model with fresh adapters (B = 0, so it computes exactly what ``model`` did);
    only the adapters require gradients, and the module named ``head`` (a critic's value head), trained whole."""
    from peft import LoraConfig, get_peft_model

    targets = list(lora_cfg.target_modules)
    config = LoraConfig(
        r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets, bias="none",
        task_type="CAUSAL_LM" if head is None else None, modules_to_save=[head] if head else None,
    )
    return get_peft_model(model, config, adapter_name=ADAPTER)


def scaling(lora_cfg) -> float:
    """alpha / rank: the factor of ``B A`` in every adapted layer."""
    return lora_cfg.alpha / lora_cfg.rank


_BASE = re.compile(r"\.base_layer\.weight$")


def changing(names) -> set[str]:
    """Of a peft model's tensor names, the base tensors an `adapted_only` push carries: those of adapted layers and
    of the modules beside them (same parent module)."""
    parents = {name[: base.start()].rsplit(".", 1)[0] for name in names if (base := _BASE.search(name))}
    return {n for n in names if ".lora_" not in n and n.rsplit(".", 1)[0].removesuffix(".base_layer").rsplit(".", 1)[0] in parents}


def merged_weights(state: dict[str, torch.Tensor], factor: float, adapted_only: bool) -> dict[str, torch.Tensor]:
    """A peft model's state dict as the base model's weights with the adapters merged in, under the base names:
    ``W + factor * B @ A`` for each adapted linear layer (float32 arithmetic, back in W's dtype).

    ``adapted_only``: just the tensors of the adapted layers and of their sibling modules (the only ones a step
    changes, plus the siblings because vLLM fuses q/k/v and gate/up into one tensor and must reload whole groups);
    else every base tensor (an export, or a generator that freed its weights). Adapter tensors are never returned.
    """
    pushed = changing(state)
    merged = {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        plain = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        base = _BASE.search(name)
        if base is None:  # not an adapted layer's weight: the base's own (a bias of an adapted layer included)
            if not adapted_only or name in pushed:
                merged[plain.replace(".base_layer.", ".")] = tensor
            continue
        stem = name[: base.start()]
        a, b = state[f"{stem}.lora_A.{ADAPTER}.weight"], state[f"{stem}.lora_B.{ADAPTER}.weight"]
        delta = factor * (b.float() @ a.float())
        merged[_BASE.sub(".weight", plain)] = (tensor.float() + delta.to(tensor.device)).to(tensor.dtype)
    return merged


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model training LoRA adapters on frozen base weights (its checkpoints hold the
    adapters only)."""
    return hasattr(model, "peft_config")


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trained tensors of a peft model's state dict: A and B of every adapted layer (and a critic's head)."""
    return {name: tensor for name, tensor in state.items() if ".lora_" in name or ".modules_to_save." in name}


def load_adapters(model: torch.nn.Module, saved: dict[str, torch.Tensor], path: Path) -> None:
    """Load a LoRA checkpoint's tensors (as peft saves them) into a peft ``model``: every trained tensor of the model
    (`adapter_state`) must be there, and nothing else."""
    from peft import set_peft_model_state_dict

    trained = set(adapter_state(model.state_dict()))
    result = set_peft_model_state_dict(model, saved, adapter_name=ADAPTER)
    missing, unexpected = sorted(trained & set(result.missing_keys)), sorted(result.unexpected_keys)
    if missing or unexpected or not saved:
        raise ConfigError(
            f"checkpoint {path} does not match the model's LoRA adapters: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}; resume with the LoRA settings it trained (<role>.lora.* as its config.yaml records)"
        )


def to_model_names(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors as peft saves them (``...lora_A.weight``) under the live model's names (``...lora_A.default.weight``)."""
    return {re.sub(r"\.(lora_[AB])\.weight$", rf".\1.{ADAPTER}.weight", name): t for name, t in saved.items()}


def is_adapter_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a PEFT adapter (adapter_config.json) rather than a full model."""
    return (folder / "adapter_config.json").is_file()


def check_not_adapter(key: str, value: str, path: str) -> None:
    """ConfigError when the model folder ``path`` (given as ``key=value``) holds a PEFT adapter without base weights."""
    folder = Path(path).expanduser()
    if not is_adapter_folder(folder):
        return
    try:
        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        base = None
    raise ConfigError(
        f"{key}={value} holds a LoRA adapter (adapter_config.json) but no base model weights; point {key} at the base "
        f"model{f' ({base})' if base else ''} and train new adapters with policy.lora.rank, or use the merged "
        f"final_model folder an rlhf run exports beside its final_adapter"
    )


def trainable_summary(model: torch.nn.Module) -> dict[str, int]:
    """Parameter counts: trainable, total, and pushed to the generator per step under LoRA (`changing`); and the AdamW state the trainable ones need, two float32 moments each."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    params = dict(model.named_parameters())
    adapted = sum(params[name].numel() for name in changing(params))
    return {"trainable": trainable, "total": total, "adapted": adapted, "optimizer_state_bytes": 2 * 4 * trainable}
