"""Hub names checked before anything loads: a model, tokenizer or dataset the run cannot get is one paragraph, exit 2.

A source named by a Hugging Face hub name (not a local folder or file, not `builtin:`) must be in the local cache or
answered for by the hub. The check looks in the cache first (no network), then asks the hub once about one small file
(`config.json`, `tokenizer_config.json`, a dataset's `README.md`): a HEAD request with a short timeout and no retries,
so an offline machine learns in a second what `from_pretrained` would say after half a minute of retries and sixty
lines of traceback. The answer is named: the hub is unreachable (or `HF_HUB_OFFLINE=1`), the repository does not
exist (or is private), it is gated, or the revision does not exist; each with the key, the name and the fix.
Local folders and files are left to the checks that read them (`rlhf.run.build.check_model_sources`, `rlhf.data.files`).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, is_offline_mode, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError, GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id
from omegaconf import OmegaConf

from rlhf.errors import ConfigError
from rlhf.models.gguf import is_gguf
from rlhf.disk import looks_local
from rlhf.models.loading import BUILTIN_PREFIX

TIMEOUT_S = 5.0  # one HEAD request; an unreachable host fails at once (DNS), a black-holed one within this
MODEL_KEYS = ("model.name_or_path", "model.tokenizer", "reference.name_or_path", "critic.name_or_path", "reward.path")
PROBE_FILES = {"model": "config.json", "tokenizer": "tokenizer_config.json", "dataset": "README.md"}


@dataclass(frozen=True)
class Source:
    """One hub name a run reads: the config key naming it, the name, its revision and what it is."""

    key: str  # e.g. model.name_or_path or dataset.train[0].path
    name: str  # the hub name, org/name
    revision: str | None = None
    kind: str = "model"  # model, tokenizer or dataset
    revision_key: str | None = None  # the key that sets ``revision``, for messages

    @property
    def repo_type(self) -> str:
        return "dataset" if self.kind == "dataset" else "model"


def is_hub_model_name(value: str | None) -> bool:
    """Whether a model key's value is a hub name (set, not `builtin:`, not a local path, not a GGUF file: a hub GGUF
    is fetched, and its failure named, by `rlhf.models.gguf`)."""
    return bool(value) and not value.startswith(BUILTIN_PREFIX) and not looks_local(value) and not is_gguf(value)


def is_hub_dataset_name(path: str | None) -> bool:
    """Whether a dataset source's `path` is a hub name (as `rlhf.data.mix.read_source` decides: not local)."""
    return bool(path) and not looks_local(path)


def model_sources(cfg) -> list[Source]:
    """The hub names among the model keys of an `rlhf.train` or `rlhf.train_reward` config (absent keys skipped)."""
    sources = []
    for key in MODEL_KEYS:
        value = OmegaConf.select(cfg, key)
        if not is_hub_model_name(value):
            continue
        own = key.startswith("model.")  # model.revision applies to the policy and its tokenizer only
        revision = OmegaConf.select(cfg, "model.revision") if own else None
        kind = "tokenizer" if key == "model.tokenizer" else "model"
        sources.append(Source(key, value, revision, kind, "model.revision" if own else None))
    return sources


def dataset_sources(cfg) -> list[Source]:
    """The hub datasets among a `dataset=mix` config's sources (`dataset.train[*]`, `dataset.eval[*]`)."""
    dataset = OmegaConf.select(cfg, "dataset")
    if dataset is None or dataset.get("name") != "mix":
        return []
    sources = []
    for split in ("train", "eval"):
        for i, src in enumerate(dataset.get(split) or []):
            key = f"dataset.{split}[{i}]"
            if is_hub_dataset_name(src.get("path")):
                sources.append(Source(f"{key}.path", src.path, src.get("revision"), "dataset", f"{key}.revision"))
    if not dataset.get("train") and is_hub_dataset_name(dataset.get("path")):
        sources.append(Source("dataset.path", dataset.path, kind="dataset"))
    return sources


def check_sources(cfg, datasets: bool = True) -> None:
    """Every hub model, tokenizer and (unless not ``datasets``) dataset of a composed config is in the local cache or
    on a reachable hub; ConfigError (one paragraph: the key, the name, why, the fix) for the first that is not."""
    seen = set()
    for source in model_sources(cfg) + (dataset_sources(cfg) if datasets else []):
        if (source.name, source.revision, source.kind) not in seen:
            seen.add((source.name, source.revision, source.kind))
            check_source(source)


def check_source(source: Source) -> None:
    """``source`` is cached here or the hub answers for it; ConfigError saying which of the two failed and how."""
    try:
        validate_repo_id(source.name)
    except HFValidationError:
        raise ConfigError(
            f"{source.key}={source.name} is neither a local {local_word(source)} (relative to {os.getcwd()}, the "
            f"launch folder) nor a valid hub name (org/name); give an existing {local_word(source)} or a hub name"
        ) from None
    if is_cached(source):
        return
    offline = datasets_offline() if source.kind == "dataset" else is_offline_mode()
    if offline:
        raise unreachable(source, "HF_HUB_OFFLINE=1 keeps the hub out of reach")
    ask_hub(source)


def is_cached(source: Source) -> bool:
    """Whether ``source`` can load from this machine's cache alone (what the loaders fall back to offline)."""
    if source.kind == "dataset":
        return dataset_cached(source.name)
    probe = try_to_load_from_cache(source.name, PROBE_FILES[source.kind], revision=source.revision)
    return isinstance(probe, str)


def dataset_cached(name: str) -> bool:
    """Whether `datasets` holds a prepared copy of hub dataset ``name`` (the folders its offline fallback reads,
    `<HF_DATASETS_CACHE>/<org>___<name>/<config>/<version>/<hash>`); a hub snapshot alone does not load offline."""
    from datasets import config  # 1.5 s to import: only runs with a hub dataset pay it
    from datasets.naming import camelcase_to_snakecase

    parts = name.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    root = Path(os.path.expanduser(str(config.HF_DATASETS_CACHE))) / "___".join(parts)
    return any(Path(p).is_dir() for p in glob.glob(str(root / "*" / "*" / "*")))


def datasets_offline() -> bool:
    """`datasets`' offline switch (HF_HUB_OFFLINE, or HF_DATASETS_OFFLINE which overrides it)."""
    from datasets import config

    return bool(config.HF_HUB_OFFLINE)


def ask_hub(source: Source) -> None:
    """One HEAD request for ``source``'s probe file, no retries; ConfigError naming the hub's answer if it is no."""
    url = hub_url(source)
    try:
        get_hf_file_metadata(url, timeout=TIMEOUT_S)
    except GatedRepoError:  # a RepositoryNotFoundError too: test it first
        raise ConfigError(
            f"{source.key}={source.name}: the hub repository is gated and this machine has no access to it; accept "
            f"its terms at {constants.ENDPOINT}/{repo_path(source)} and log in (`hf auth login`, or set HF_TOKEN), or "
            f"point {source.key} at a local copy"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{source.key}={source.name} is not a local {local_word(source)}, and the hub has no {source.repo_type} "
            f"repository of that name (or it is private: log in with `hf auth login` or set HF_TOKEN); check the "
            f"name, or point {source.key} at a local copy"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(
            f"{source.key}={source.name}: the hub has no revision {source.revision!r} of it ({source.revision_key}); "
            f"give an existing branch, tag or commit, or null for the default branch"
        ) from None
    except EntryNotFoundError:  # the repository answers; it just lacks this file
        if source.kind == "model":
            raise ConfigError(
                f"{source.key}={source.name}: the hub repository has no config.json, so it is not a transformers "
                f"model; give a model repository or a local model folder"
            ) from None
    except HfHubHTTPError as err:
        raise unreachable(source, f"the hub answered HTTP {getattr(err.response, 'status_code', '?')}") from None
    except Exception as err:  # noqa: BLE001 -- any transport failure (DNS, refused, timeout) means: no hub here
        raise unreachable(source, f"the hub is unreachable ({reason(err)})") from None


def hub_url(source: Source) -> str:
    return hf_hub_url(source.name, PROBE_FILES[source.kind], repo_type=source.repo_type, revision=source.revision)


def repo_path(source: Source) -> str:
    """The repository's page below the hub's address: org/name, datasets/org/name."""
    return f"datasets/{source.name}" if source.kind == "dataset" else source.name


def local_word(source: Source) -> str:
    return "file or folder" if source.kind == "dataset" else "folder"


def reason(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def unreachable(source: Source, why: str) -> ConfigError:
    """The error for a source neither cached here nor answered for by the hub (``why``: offline, DNS, ...)."""
    where = constants.HF_HUB_CACHE
    if source.kind == "dataset":
        from datasets import config

        where = config.HF_DATASETS_CACHE
    return ConfigError(
        f"{source.key}={source.name} is neither a local {local_word(source)} nor in the local Hugging Face cache "
        f"({where}), and {why}; {fix(source)}"
    )


def fix(source: Source) -> str:
    """What to do: download it where the hub is reachable, or point the key at a local copy."""
    revision = f" --revision {source.revision}" if source.revision else ""
    if source.kind == "dataset":
        return (
            f"download it on a machine with hub access (`hf download {source.name} --repo-type dataset{revision} "
            f"--local-dir DIR`), copy DIR here and set {source.key}=DIR (a split's files, e.g. DIR/<subset>), or use "
            f"local .jsonl / .parquet files"
        )
    return (
        f"download it on a machine with hub access (`hf download {source.name}{revision}`; `huggingface-cli download` "
        f"on older versions) and bring its cache (HF_HOME) here, or download it to a folder (`--local-dir DIR`) and "
        f"set {source.key}=DIR"
    )
