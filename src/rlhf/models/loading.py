"""Loading tokenizers and causal LMs through the normal `from_pretrained` path.

``name_or_path`` is a hub name, a local folder, ``builtin:<name>`` for a model shipped in ``rlhf/assets`` (the tiny
model of the default task, reproducible with ``python -m rlhf.warmstart``), or a GGUF file (``rlhf.models.gguf``).
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from rlhf.disk import looks_local
from rlhf.errors import ConfigError
from rlhf.models import gguf
from rlhf.models.dtypes import DTYPES

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"


def resolve_model_path(name_or_path: str) -> str:
    """A `from_pretrained` argument: builtin names become their folder inside the installed package, a GGUF file its
    converted folder (`rlhf.models.gguf`), a `package:` reference the path inside its package."""
    if gguf.is_gguf(name_or_path):
        return gguf.resolve(name_or_path)
    if name_or_path.startswith(gguf.PACKAGE_PREFIX):
        return str(gguf.package_file(name_or_path))
    if not name_or_path.startswith(BUILTIN_PREFIX):
        return name_or_path
    name = name_or_path[len(BUILTIN_PREFIX) :]
    folder = Path(str(resources.files("rlhf.assets"))) / name
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"built-in model {name!r} not found at {folder}; rebuild it with `python -m rlhf.warmstart` "
            f"or give a model folder or a hub name"
        )
    return str(folder)


SCORE_HEADS = ("ForSequenceClassification", "ForTokenClassification")  # architectures ending in a score head
LM_HEADS = ("ForCausalLM", "LMHeadModel")  # architectures ending in a language-model head


def check_model_kind(key: str, value: str, folder: Path) -> None:
    """ConfigError when a local model folder's `architectures` (config.json) contradict the role of ``key``: a model
    that generates or scores tokens (`model.name_or_path`, `reference.name_or_path`, `teacher.name_or_path`) with only
    score heads (a reward model), or a `reward.path` with only language-model heads. A folder that lists none passes."""
    try:
        names = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return  # unreadable: the loader names it
    if not names:
        return
    if key != "reward.path" and all(name.endswith(SCORE_HEADS) for name in names):
        raise ConfigError(
            f"{key}={value} is a {names[0]} (a score head, as a reward model has), not a causal language model; point "
            f"{key} at a model that generates text (its config.json lists a *ForCausalLM architecture)"
        )
    if key == "reward.path" and all(name.endswith(LM_HEADS) for name in names):
        raise ConfigError(
            f"reward.path={value} is a {names[0]}, a language model without a trained score head; give a reward model "
            f"(python -m rlhf.train_reward writes one), or score with reward.functions instead"
        )


def weights_problem(folder: Path) -> str | None:
    """Why a model folder's `*.safetensors` files are unusable (truncated, not safetensors), or None; reads headers."""
    return next(filter(None, (safetensors_problem(file) for file in sorted(folder.glob("*.safetensors")))), None)


def check_weight_files(name_or_path: str, key: str | None = None) -> None:
    """ConfigError naming ``key`` and the damaged file when a local model folder's weights are truncated or corrupt;
    hub names and missing folders are left to `from_pretrained`."""
    folder = Path(resolve_model_path(name_or_path)).expanduser()
    if not (looks_local(str(folder)) and folder.is_dir()):
        return
    problem = weights_problem(folder)
    if problem is not None:
        where = f"{key}={name_or_path}" if key else f"model folder {name_or_path}"
        raise ConfigError(
            f"{where}: {problem}. The model's weights are damaged (an interrupted download, copy or save); download or "
            f"copy the model folder again, or point {key or 'the run'} at another model folder"
        )


def load_tokenizer(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A tokenizer that left-pads and has a pad token (EOS doubles as pad when the model has none)."""
    tokenizer = AutoTokenizer.from_pretrained(
        resolve_model_path(name_or_path), revision=revision, trust_remote_code=trust_remote_code
    )
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {name_or_path!r} has neither a pad nor an EOS token; set one in its files")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def meta_causal_lm(model_cfg, name_or_path: str | None = None) -> torch.nn.Module:
    """The causal LM of ``name_or_path`` (default `model.name_or_path`) built on the meta device from its config alone
    (no weights load): for checks that need its module structure before anything loads."""
    config = AutoConfig.from_pretrained(
        resolve_model_path(name_or_path or model_cfg.name_or_path), revision=model_cfg.revision,
        trust_remote_code=model_cfg.trust_remote_code,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=model_cfg.trust_remote_code)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability to 0 (RL logprobs must be deterministic given the weights)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def zero_dropout_config(config):
    """Set every dropout probability in a model config to 0 (names with `dropout`, and `*_pdrop`)."""
    for key, value in list(vars(config).items()):
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def load_causal_lm(
    name_or_path: str,
    dtype: str = "float32",
    revision: str | None = None,
    trust_remote_code: bool = False,
    device: torch.device | str = "cpu",
    key: str | None = None,
) -> torch.nn.Module:
    """A causal LM with dropout off in its config and its modules, on ``device``; ``key`` (e.g. `model.name_or_path`)
    is the config key errors about damaged weight files name."""
    check_weight_files(name_or_path, key)
    path = resolve_model_path(name_or_path)
    config = zero_dropout_config(AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code))
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, revision=revision, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
    )
    contiguous_head_input(model)
    return disable_dropout(model).to(device)


def contiguous_head_input(model: torch.nn.Module) -> None:
    """Hands ``model``'s output layer a contiguous input wherever it computes in low precision on the CPU.

    transformers slices the positions it keeps (`logits_to_keep`) out of the hidden states; torch's matmul cannot fold
    that strided (rows, positions, width) slice into one matrix product, so it runs a batched one over the weight
    expanded to every row, which the CPU's bfloat16 kernel (oneDNN) first copies whole: one copy of the output layer
    per row (the hf generator's prompt pass of 64 rows of SmolLM2-135M: 3.4 GiB held at once). The copy of the slice
    is rows x positions x width. Float32 and CUDA kernels read the expanded weight in place and keep their path."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, torch.nn.Linear):
        head.register_forward_pre_hook(_contiguous_low_precision_input)


def _contiguous_low_precision_input(module: torch.nn.Linear, args: tuple) -> tuple | None:
    hidden = args[0]
    if hidden.is_contiguous() or hidden.device.type != "cpu" or module.weight.dtype == torch.float32:
        return None
    return (hidden.contiguous(), *args[1:])


def check_vocab_match(
    reference: PreTrainedTokenizerBase, other: PreTrainedTokenizerBase, reference_name: str, other_name: str
) -> None:
    """Raise ValueError unless both tokenizers map the same strings to the same ids."""
    ref_vocab, other_vocab = reference.get_vocab(), other.get_vocab()
    if ref_vocab == other_vocab:
        return
    only_ref = len(ref_vocab.keys() - other_vocab.keys())
    only_other = len(other_vocab.keys() - ref_vocab.keys())
    moved = sum(1 for tok, idx in ref_vocab.items() if tok in other_vocab and other_vocab[tok] != idx)
    raise ValueError(
        f"vocabulary mismatch: {other_name} ({len(other_vocab)} tokens) does not match {reference_name} "
        f"({len(ref_vocab)} tokens): {only_ref} only in {reference_name}, {only_other} only in {other_name}, "
        f"{moved} with different ids. Token ids are shared between them, so use models with the same tokenizer."
    )


def same_source(first: str, second: str) -> bool:
    """Whether two model references name the same folder (`./m` and `m/` do) or the same hub name."""
    first, second = resolve_model_path(first), resolve_model_path(second)
    if looks_local(first) and looks_local(second):
        return Path(first).expanduser().resolve() == Path(second).expanduser().resolve()
    return first == second


def check_model_tokenizer(model, tokenizer: PreTrainedTokenizerBase) -> None:
    """When `model.tokenizer` names another tokenizer than the one saved with the model: a warning naming both, or
    ConfigError when their vocabularies differ in any string's id (same size or not), since the model's rows would
    then mean other tokens. A model saved without a tokenizer has nothing to compare against."""
    if not model.tokenizer or same_source(model.tokenizer, model.name_or_path):
        return
    try:
        own = load_tokenizer(model.name_or_path, model.revision, model.trust_remote_code)
    except (OSError, ValueError, TypeError):  # no tokenizer files with the model (the usual reason to set model.tokenizer)
        return
    try:
        check_vocab_match(own, tokenizer, f"the tokenizer saved with model.name_or_path={model.name_or_path}",
                          f"model.tokenizer={model.tokenizer}")
    except ValueError as err:
        raise ConfigError(
            f"model.tokenizer={model.tokenizer}: {err} Set model.tokenizer=null to use the model's own tokenizer, or "
            f"give one with the same vocabulary"
        ) from None
    log.warning(
        "model.tokenizer=%s is not the tokenizer saved with model.name_or_path=%s; their vocabularies match, so "
        "training uses %s (its special tokens and chat template)", model.tokenizer, model.name_or_path, model.tokenizer
    )


def pick_device(name: str) -> torch.device:
    """`auto` means CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"cluster.device={name!r} but CUDA is not available here; use cluster.device=cpu or auto")
    return device


def safetensors_problem(file: Path) -> str | None:
    """Why a weights file is unusable: safe_open checks its header and that the file covers every tensor."""
    try:
        with safe_open(str(file), framework="pt"):
            return None
    except (OSError, SafetensorError) as err:
        return f"{file} is truncated or not a safetensors file ({err})"
