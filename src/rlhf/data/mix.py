"""Prompt datasets from the Hugging Face hub or local JSON Lines / Parquet files, mixed by fraction or count.

Each source is a split of a dataset; `amount` takes a fraction of it (<= 1) or a number of rows (> 1),
chosen by a seeded shuffle. Rows become prompts through `dataset.sft_messages_key` (a conversation whose
final assistant turn is dropped) or `dataset.prompt_key` (a string, as one user message), plus
`dataset.prompt_suffix`, rendered with `dataset.chat_template`; `dataset.ground_truth_format` extracts the
answer from the ground-truth column. Bad rows (malformed JSON Lines lines among them) and over-long prompts
are counted per source and reported, each bad row named where an editor finds it (`p.jsonl line 3`, counted from 1,
or `p.parquet row 3`); tokenised results are cached on disk (rlhf.data.cache) under a key that
covers everything that shaped them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from rlhf.data.answers import GROUND_TRUTH_FORMATS, with_suffix
from rlhf.data.cache import cache_folder, read_cache, write_cache
from rlhf.data.config import DatasetConfig, DataSourceConfig
from rlhf.data.files import LOCAL_FORMATS, FileRows, RowSpan, folder_files, missing_path_error, read_files
from rlhf.data.prompts import PromptExample, PromptSplits
from rlhf.data.templates import CHAT_ROLES, TEMPLATE_ROLES, encode_prompt, render_prompt, renders_role, resolve_template
from rlhf.disk import looks_local
from rlhf.errors import ConfigError, require
from rlhf.registry import register

log = logging.getLogger("rlhf")

CACHE_VERSION = 5  # raise it when what a row becomes changes, so caches written before are not reused (5: origins)



@dataclass
class MixDatasetConfig(DatasetConfig):
    """Prompts from hub datasets or local files, mixed."""

    train: list[DataSourceConfig] = field(default_factory=list)  # training sources, concatenated
    eval: list[DataSourceConfig] = field(default_factory=list)  # eval sources; empty = eval_holdout, else the train prompts
    eval_holdout: float = 0.0  # share of the train prompts held out for eval when `eval` is empty
    path: Optional[str] = None  # one local file as the only train source (what dataset=jsonl/parquet read)
    prompt_key: str = "prompt"  # column holding the prompt string (used when sft_messages_key is null)
    sft_messages_key: Optional[str] = None  # column holding a conversation; its final assistant turn is dropped
    ground_truth_key: Optional[str] = None  # column passed to the reward functions as ground truth
    ground_truth_format: str = "raw"  # raw (a string or number), json (any value), gsm8k (the answer after `####`) or boxed (the last \boxed{})
    prompt_suffix: Optional[str] = None  # instruction appended to every prompt after a space; null = none
    chat_template: str = "tokenizer"  # tokenizer (its own), simple_concat_with_space, tulu, a .jinja file, or inline Jinja
    strict: bool = False  # bad rows stop the run (naming file, line or row, and column) instead of being counted
    sanity_check: Optional[int] = None  # keep at most this many rows of every source, for quick debugging
    cache_dir: Optional[str] = None  # tokenised-dataset cache; null = $RLHF_CACHE/datasets or ~/.cache/rlhf/datasets

    def check(self, at: str) -> None:
        super().check(at)
        require(0 <= self.eval_holdout < 1, f"{at}.eval_holdout={self.eval_holdout} must be in [0, 1)")
        require(self.sanity_check is None or self.sanity_check >= 1, f"{at}.sanity_check={self.sanity_check} must be >= 1 or null")
        require(
            self.ground_truth_format in GROUND_TRUTH_FORMATS,
            f"{at}.ground_truth_format={self.ground_truth_format!r}; choose one of {', '.join(GROUND_TRUTH_FORMATS)}",
        )
        require(
            self.ground_truth_format == "raw" or bool(self.ground_truth_key),
            f"{at}.ground_truth_format={self.ground_truth_format} extracts from {at}.ground_truth_key, which is null; "
            "name the column",
        )
        require(len(self.train) > 0 or bool(self.path), f"{at}.name=mix has no source: set {at}.path=<file> or list {at}.train sources")
        for split in ("train", "eval"):
            for i, src in enumerate(getattr(self, split)):
                require(src.amount > 0, f"{at}.{split}[{i}].amount={src.amount} must be > 0")
                require(
                    src.amount <= 1 or src.amount == int(src.amount),
                    f"{at}.{split}[{i}].amount={src.amount}: a count must be a whole number (fractions are <= 1)",
                )

class BadRow(ValueError):
    """A row that cannot become a prompt; carries the column at fault and, where the column's key is not the fix,
    the fix."""

    def __init__(self, column: str, why: str, fix: str | None = None) -> None:
        super().__init__(f"column {column!r}: {why}")
        self.column, self.fix = column, fix


@dataclass
class SourceReport:
    """What happened to one source's rows."""

    source: str  # the source's label (path, subset)
    split: str  # the split read
    rows: int = 0  # rows taken from the split (after amount and sanity_check), plus malformed lines skipped
    bad_rows: int = 0  # rows dropped for a missing column, wrong type, unknown role or empty prompt, or a malformed line
    too_long: int = 0  # rows dropped by max_prompt_length
    kept: int = 0  # rows that became prompts
    bad_examples: list[str] = field(default_factory=list)  # the first few "p.jsonl line 3: <why>", for the log


MALFORMED_LINE = "a malformed JSON Lines line"  # the reason counted for each line files.py skipped

COLUMN_FIXES = {  # the key that names a bad row's column -> how to set it
    "dataset.prompt_key": "set dataset.prompt_key to the column holding the prompt string (or dataset.sft_messages_key "
                          "to a column holding a conversation)",
    "dataset.sft_messages_key": "set dataset.sft_messages_key to the column holding a list of {role, content} messages "
                                "(or dataset.prompt_key to a column holding the prompt string)",
    "dataset.ground_truth_key": "set dataset.ground_truth_key to the column holding the answer (and "
                                "dataset.ground_truth_format to how it is written)",
    "dataset.path": "fix the malformed lines the log names",
}

def _role_order(role: str) -> int:
    """Roles listed as chat templates know them: `CHAT_ROLES` first, then `TEMPLATE_ROLES`."""
    order = CHAT_ROLES + TEMPLATE_ROLES
    return order.index(role) if role in order else len(order)


ROLE_FIX = (  # follows the reason, which lists the roles the template renders
    "rename the conversation's other roles to these (ShareGPT's human and gpt are user and assistant; a chat "
    "template may drop a message of another role without a word)"
)
TRUTH_TYPE_FIX = (
    "write each answer as one string or number (e.g. \"42\"), or set dataset.ground_truth_format=json if your reward "
    "functions read lists and objects"
)


@dataclass
class BadRowTally:
    """Why rows were bad, over the training sources: what the error says when no training prompt is left."""

    reasons: Counter = field(default_factory=Counter)  # "column 'prompt': missing" -> rows
    fix_of: dict[str, str] = field(default_factory=dict)  # reason -> its fix (the bad row's own, or a COLUMN_FIXES value)
    columns: dict[str, None] = field(default_factory=dict)  # the bad rows' columns, in first-seen order

    def add(self, reason: str, fix: str, row: dict[str, Any] | None = None) -> None:
        self.reasons[reason] += 1
        self.fix_of.setdefault(reason, fix)
        self.columns.update(dict.fromkeys(row or ()))

    def summary(self, most: int = 2) -> str:
        """The commonest reasons with their counts, and the columns the bad rows have."""
        parts = [f"{why} in {n} row{'s' if n != 1 else ''}" for why, n in self.reasons.most_common(most)]
        if self.columns:
            names = list(self.columns)
            parts.append(f"the rows have columns {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}")
        return "; ".join(parts)

    def fixes(self, most: int = 2) -> list[str]:
        """How to fix each of the commonest reasons, once per fix."""
        return list(dict.fromkeys(self.fix_of[why] for why, _ in self.reasons.most_common(most)))


def row_fix(err: BadRow, cfg, from_prompt: bool) -> str:
    """A bad row's fix: its own, or how to set the key that named its column (the prompt's or the answer's)."""
    if err.fix:
        return err.fix
    if not from_prompt:
        return COLUMN_FIXES["dataset.ground_truth_key"]
    return COLUMN_FIXES["dataset.sft_messages_key" if cfg.sft_messages_key else "dataset.prompt_key"]


def source_label(src) -> str:
    return f"{src.path}[{src.split}]"


def read_source(src, key: str, strict: bool) -> FileRows:
    """A source's split: its local files' rows, or a `datasets` split (hub name, hub-layout folder), each row's place
    known."""
    local = Path(src.path).expanduser()
    if local.is_file():
        if local.suffix not in LOCAL_FORMATS:
            raise ValueError(f"{key}.path={src.path}: unknown file type {local.suffix!r}; use .jsonl, .json or .parquet")
        if src.split != "train":
            raise ValueError(f"{key}.split={src.split}: a single local file only has the split `train`")
        return read_files([local], key, strict)
    if local.is_dir() and (files := folder_files(local, src.split, key, src.path)):
        return read_files(files, key, strict)  # each file checked as a single file is, its bad lines named
    if not local.is_dir() and looks_local(src.path):
        raise missing_path_error(key, src.path)
    from datasets import load_dataset  # 1.5 s to import (pandas, pyarrow): only hub datasets pay it

    if local.is_dir():
        split = read_hub_layout_folder(local, src, key)
    else:
        split = load_dataset(src.path, src.subset, split=src.split, revision=src.revision)
    return FileRows(rows=split, spans=[RowSpan(source_label(src), 0)])


def read_hub_layout_folder(folder: Path, src, key: str):
    """A local folder in the hub's layout (files in subfolders) read by `datasets`; its failures name the key."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    try:
        return load_dataset(str(folder), split=src.split)
    except (DatasetGenerationError, FileNotFoundError, ValueError) as err:  # EmptyDatasetError is a FileNotFoundError
        reason = str(err.__cause__ or err).strip().splitlines()
        raise ConfigError(
            f"{key}.path={src.path}: `datasets` could not read split {src.split!r} of this folder "
            f"({reason[0] if reason else type(err).__name__}); put the split's .jsonl or .parquet files in the folder "
            f"itself (named {src.split}.jsonl or {src.split}-<n>.jsonl) so each file and line is checked and named"
        ) from None


def load_rows(src, seed: int, sanity_check: int | None, key: str, strict: bool = False):
    """(row index in the split, row) for one source after `amount` (seeded) and `sanity_check`; all the split's rows
    read (FileRows: where each row is, the lines skipped)."""
    read = read_source(src, key, strict)
    n = len(read.rows)
    if src.amount <= 1:
        take = round(n * src.amount)
    else:
        if src.amount != int(src.amount):
            raise ValueError(f"{key}.amount={src.amount}: a count must be a whole number (fractions are <= 1)")
        take = int(src.amount)
        if take > n:
            raise ValueError(f"{key}.amount={take} rows, but {source_label(src)} has only {n}")
    if take == 0:
        raise ValueError(f"{key}.amount={src.amount} of {source_label(src)} ({n} rows) selects no row")
    order = list(range(n))
    random.Random(f"{seed}:{src.path}:{src.split}").shuffle(order)
    order = sorted(order[:take])  # the chosen rows, in file order
    if sanity_check is not None:
        order = order[:sanity_check]
    return [(i, read.rows[i]) for i in order], read


def row_messages(row: dict[str, Any], cfg, roles: frozenset[str] = frozenset(CHAT_ROLES)) -> list[dict[str, str]]:
    """The conversation a prompt is rendered from (its messages' ``roles`` among those the chat template renders);
    raises BadRow naming the column at fault."""
    if cfg.sft_messages_key:
        key = cfg.sft_messages_key
        if key not in row or row[key] is None:
            raise BadRow(key, "missing")
        messages = row[key]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
        ):
            raise BadRow(key, "not a list of {role, content} messages")
        for number, m in enumerate(messages, start=1):
            if m["role"] not in roles:
                raise BadRow(key, f"message {number} has role {m['role']!r}, not one of {', '.join(sorted(roles, key=_role_order))}", ROLE_FIX)
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages or not any(m["content"].strip() for m in messages):
            raise BadRow(key, "no message left to prompt with")
        return messages
    key = cfg.prompt_key
    if key not in row or row[key] is None:
        raise BadRow(key, "missing")
    if not isinstance(row[key], str):
        raise BadRow(key, f"expected a string, got {type(row[key]).__name__}")
    if not row[key].strip():
        raise BadRow(key, "empty prompt")
    return [{"role": "user", "content": row[key]}]


def row_ground_truth(row: dict[str, Any], cfg) -> Any:
    """The ground-truth column's value, or the answer `dataset.ground_truth_format` extracts from it."""
    key = cfg.ground_truth_key
    if not key:
        return None
    if key not in row or row[key] is None:
        raise BadRow(key, "missing")
    if cfg.ground_truth_format == "json":
        return row[key]
    if cfg.ground_truth_format == "raw":  # what exact_match, arith_correct and math_verify read (bool is an int: kept)
        if not isinstance(row[key], (str, int, float)):
            raise BadRow(key, f"expected a string or number, got {type(row[key]).__name__}", TRUTH_TYPE_FIX)
        return row[key]
    if not isinstance(row[key], str):
        raise BadRow(key, f"expected a string to extract a {cfg.ground_truth_format} answer from")
    answer = GROUND_TRUTH_FORMATS[cfg.ground_truth_format](row[key])
    if answer is None:
        raise BadRow(key, f"no {cfg.ground_truth_format} answer in it")
    return answer


def to_examples(
    rows, read: FileRows, src, key: str, cfg, tokenizer, template: str, tally: BadRowTally | None = None,
) -> tuple[list[PromptExample], SourceReport]:
    """Prompts from one source's chosen ``rows`` (``read``: its split as read, naming each row's place and the
    malformed lines skipped; ``key``: the source's key), with the report of what was dropped and why (``tally``:
    where to count the bad rows' reasons)."""
    skipped = read.skipped
    report = SourceReport(source_label(src), src.split, rows=len(rows) + len(skipped), bad_rows=len(skipped))
    report.bad_examples = list(skipped[:3])
    tally = tally if tally is not None else BadRowTally()
    for _ in skipped:
        tally.add(MALFORMED_LINE, COLUMN_FIXES["dataset.path"])
    examples = []
    roles = frozenset(CHAT_ROLES + tuple(r for r in TEMPLATE_ROLES if renders_role(tokenizer, template, r)))
    for index, row in rows:
        from_prompt = True
        try:
            messages = with_suffix(row_messages(row, cfg, roles), cfg.prompt_suffix)
            from_prompt = False
            ground_truth = row_ground_truth(row, cfg)
        except BadRow as err:
            fix = row_fix(err, cfg, from_prompt)
            if cfg.strict:
                raise ConfigError(
                    f"{key}.path: {read.where(index)}: {err}; {fix}, or set dataset.strict=false to count and skip "
                    f"bad rows"
                ) from None
            report.bad_rows += 1
            tally.add(str(err), fix, row)
            if len(report.bad_examples) < 3:
                report.bad_examples.append(f"{read.where(index)}: {err}")
            continue
        text = render_prompt(tokenizer, messages, template, cfg.chat_template, read.where(index))
        ids = encode_prompt(tokenizer, text)
        if len(ids) > cfg.max_prompt_length:
            report.too_long += 1
            continue
        examples.append(PromptExample(text=text, token_ids=tuple(ids), ground_truth=ground_truth, origin=read.where(index)))
    report.kept = len(examples)
    return examples, report


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256((type(tokenizer).__name__ + body + json.dumps(tokenizer.special_tokens_map, sort_keys=True)).encode()).hexdigest()


def source_fingerprint(src) -> dict[str, Any]:
    """What identifies a source's data: a local file's size and mtime, or the hub name and revision."""
    local = Path(src.path).expanduser()
    stat = {}
    if local.exists():
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        stat = {str(p): [p.stat().st_size, p.stat().st_mtime_ns] for p in files}
    return {
        "path": src.path, "subset": src.subset, "split": src.split, "amount": src.amount, "revision": src.revision,
        "files": stat,
    }


def cache_key(cfg, seed: int, template: str, tokenizer, sources: dict[str, list]) -> str:
    shaping = {
        "version": CACHE_VERSION,
        "seed": seed,
        "sources": {split: [source_fingerprint(s) for s in srcs] for split, srcs in sources.items()},
        "eval_holdout": cfg.eval_holdout,
        "keys": [cfg.prompt_key, cfg.sft_messages_key, cfg.ground_truth_key, cfg.ground_truth_format],
        "prompt_suffix": cfg.prompt_suffix,
        "template": template,
        "max_prompt_length": cfg.max_prompt_length,
        "strict": cfg.strict,
        "sanity_check": cfg.sanity_check,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }
    return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:24]


def no_prompt_left_error(cfg, reports: list[dict], tally: BadRowTally) -> ConfigError:
    """The error when every training row was bad or too long: the counts, the commonest reasons and the keys to set."""
    rows, too_long, bad = (sum(r[k] for r in reports) for k in ("rows", "too_long", "bad_rows"))
    reasons = f" ({tally.summary()})" if bad else ""
    fixes = (["raise dataset.max_prompt_length"] if too_long else []) + (tally.fixes() if bad else [])
    return ConfigError(
        f"no training prompt is left: {rows} rows read, {too_long} longer than dataset.max_prompt_length="
        f"{cfg.max_prompt_length}, {bad} bad{reasons}; {', or '.join(fixes) or 'add rows'}"
    )


def build_splits(cfg, tokenizer, seed: int, sources: dict[str, list], path_key: bool = False) -> PromptSplits:
    """Load, mix, render, tokenise and filter every source (no cache); ``path_key``: the one source is `dataset.path`."""
    template = resolve_template(cfg.chat_template, tokenizer)
    out: dict[str, list[PromptExample]] = {"train": [], "eval": []}
    reports, tally = [], BadRowTally()
    for split, srcs in sources.items():
        for i, src in enumerate(srcs):
            key = "dataset" if path_key and split == "train" else f"dataset.{split}[{i}]"
            rows, read = load_rows(src, seed, cfg.sanity_check, key, cfg.strict)
            examples, report = to_examples(rows, read, src, key, cfg, tokenizer, template, tally if split == "train" else None)
            out[split] += examples
            reports.append({"role": split, **asdict(report)})
    if not out["train"]:
        raise no_prompt_left_error(cfg, [r for r in reports if r["role"] == "train"], tally)
    train, eval_ = out["train"], out["eval"]
    if not sources["eval"] and cfg.eval_holdout > 0:
        shuffled = train[:]
        random.Random(seed).shuffle(shuffled)
        n_eval = max(1, round(len(shuffled) * cfg.eval_holdout))
        train, eval_ = shuffled[n_eval:], shuffled[:n_eval]
    elif not sources["eval"]:
        eval_ = train
    return PromptSplits(train=train, eval=eval_, report={"sources": reports, "cache": "miss"})


def log_report(report: dict) -> None:
    for r in report["sources"]:
        log.info(
            "dataset %-5s %s: %d rows, %d bad, %d longer than max_prompt_length, %d kept",
            r["role"], r["source"], r["rows"], r["bad_rows"], r["too_long"], r["kept"],
        )
        for example in r["bad_examples"]:
            log.warning("  bad row in %s: %s", r["source"], example)


@register("dataset", "mix")
def mixed_dataset(cfg, tokenizer, seed: int = 1) -> PromptSplits:
    """Train and eval prompts from `dataset.train` / `dataset.eval` sources (or `dataset.path`), cached."""
    one_file = {"path": cfg.path, "split": "train", "amount": 1.0, "revision": None, "subset": None}
    train_sources = list(cfg.train) or ([one_file] if cfg.path else [])
    if not train_sources:
        raise ValueError("dataset.name=mix needs dataset.train sources or dataset.path=<file>")
    sources = {"train": [OmegaConf.create(dict(s)) for s in train_sources], "eval": [OmegaConf.create(dict(s)) for s in cfg.eval]}
    for split, srcs in sources.items():  # a missing file first: it is what a user fixes first
        for i, src in enumerate(srcs):
            if looks_local(src.path) and not Path(src.path).expanduser().exists():
                raise missing_path_error("dataset" if not cfg.train and split == "train" else f"dataset.{split}[{i}]", src.path)
    template = resolve_template(cfg.chat_template, tokenizer)
    key = cache_key(cfg, seed, template, tokenizer, sources)
    path = cache_folder(cfg) / f"{key}.json"
    splits = read_cache(path)
    if splits is None:
        splits = build_splits(cfg, tokenizer, seed, sources, path_key=not cfg.train)
        write_cache(path, splits)
    log_report(splits.report)
    return splits


mixed_dataset.config = MixDatasetConfig  # its keys (`dataset.*`)
