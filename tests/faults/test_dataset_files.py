"""Bad dataset files never end a run with a library traceback, and a broken cache never blocks the next run.

A corrupt cache entry is deleted and rebuilt (naming the file); an empty, binary or malformed JSON Lines / Parquet
file is a ConfigError naming the key, the file, the line and the fix (with dataset.strict=false a malformed line is
counted and skipped like any bad row); a local-looking path that does not exist never reaches the hub; and
dataset.max_prompt_length must leave room for generator.max_new_tokens in the model's context. A folder is read as
its files are (each bad line named by file and line; an empty folder named by its key), a UTF-8 byte-order mark is
read, and training rows that are all bad name the commonest reason and the key to set. A bad row is named where an
editor finds it: its file and line (counted from 1) in JSON Lines, its file and row in a JSON array or Parquet.
Every test runs in its own folder, with `datasets`' cache there and the hub switched off.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from rlhf.run.build import build_components
from rlhf.config import ConfigError, compose_config, validate
from rlhf.data.config import DataSourceConfig
from rlhf.data import cache as dataset_cache
from rlhf.data.context import check_prompt_budget, model_context
from rlhf.data.mix import MixDatasetConfig, mixed_dataset


@pytest.fixture(autouse=True)
def _local_only(tmp_path, monkeypatch):
    """Run in the test's folder, keep `datasets`' own cache there, and switch the hub off."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def write_jsonl(path: str, lines: list[str]) -> str:
    """Write ``lines`` (already JSON, or deliberately not) one per line; returns the path."""
    Path(path).write_text("".join(line + "\n" for line in lines))
    return path


def good_lines(n: int) -> list[str]:
    """``n`` JSON Lines rows `{"prompt": "a+1="}`."""
    return [json.dumps({"prompt": f"{a}+1="}) for a in range(n)]


def path_cfg(path: str, **overrides):
    """A typed `mix` config reading `dataset.path` (cache in ./cache)."""
    values = dict(chat_template="simple_concat_with_space", max_prompt_length=64, cache_dir="cache") | overrides
    return OmegaConf.structured(MixDatasetConfig(name="mix", path=path, **values))


def one_paragraph(err: pytest.ExceptionInfo) -> str:
    """The error's message, checked to be one paragraph (no traceback, no second line)."""
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    return message


# --- 1. the tokenised-prompt cache ----------------------------------------------------------------------


def cache_file() -> Path:
    """The one cache entry in ./cache."""
    [path] = Path("cache").glob("*.json")
    return path


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda text: text[: len(text) // 2], id="truncated"),
        pytest.param(lambda text: "", id="empty"),
        pytest.param(lambda text: "[]", id="a-list"),
        pytest.param(lambda text: json.dumps({"train": "x", "eval": [], "report": {"sources": []}}), id="wrong-rows"),
        pytest.param(lambda text: json.dumps(json.loads(text) | {"train": [["0+1=", ["a"], None]]}), id="wrong-ids"),
        pytest.param(lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "report"}), id="no-report"),
    ],
)
def test_corrupt_cache_entry_is_deleted_and_rebuilt(tokenizer, caplog, damage):
    """A truncated or wrongly shaped cache file is named in a warning, deleted and rebuilt; the rebuild is then a hit."""
    write_jsonl("p.jsonl", good_lines(3))
    first = mixed_dataset(path_cfg("p.jsonl"), tokenizer, 1)
    path = cache_file()
    path.write_text(damage(path.read_text()))
    with caplog.at_level(logging.INFO, logger="rlhf"):
        rebuilt = mixed_dataset(path_cfg("p.jsonl"), tokenizer, 1)
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"dataset cache {path} is corrupt" in warning and "deleting it and rebuilding" in warning
    assert rebuilt.report["cache"] == "miss" and rebuilt.train == first.train
    again = mixed_dataset(path_cfg("p.jsonl"), tokenizer, 1)
    assert again.report["cache"] == "hit" and again.train == first.train


def test_binary_cache_entry_is_rebuilt(tokenizer, caplog):
    """A cache file of non-UTF-8 bytes is rebuilt like any corrupt one."""
    write_jsonl("p.jsonl", good_lines(2))
    mixed_dataset(path_cfg("p.jsonl"), tokenizer, 1)
    cache_file().write_bytes(b"\xff\xfe\x00garbage")
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        assert mixed_dataset(path_cfg("p.jsonl"), tokenizer, 1).report["cache"] == "miss"
    assert "is corrupt" in caplog.text and json.loads(cache_file().read_text())["train"]


def test_cache_write_is_atomic(tokenizer, monkeypatch, caplog):
    """A write that fails before the rename leaves no cache entry and no temp file; the run keeps its prompts."""
    write_jsonl("p.jsonl", good_lines(2))

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dataset_cache.os, "replace", full_disk)
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        splits = mixed_dataset(path_cfg("p.jsonl"), tokenizer, 1)
    assert [e.text for e in splits.train] == ["0+1=", "1+1="]
    assert list(Path("cache").iterdir()) == []
    assert "not written (" in caplog.text and "No space left on device" in caplog.text


# --- 2. empty, binary and malformed files ---------------------------------------------------------------


def test_empty_jsonl_names_the_file(tokenizer):
    Path("p.jsonl").write_text("\n  \n")
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg("p.jsonl"), tokenizer, 1)
    assert one_paragraph(err) == (
        "dataset.path: p.jsonl is empty; give a JSON Lines file with one JSON object per line"
    )


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize(
    ("content", "why"),
    [
        pytest.param(gzip.compress(b'{"prompt": "1+1="}\n' * 50), "line 1: not UTF-8 text (byte 1)", id="gzipped"),
        pytest.param(b"\x00\x01\x02\x03data\n" * 10, "line 1: binary data (a NUL byte)", id="nul-bytes"),
    ],
)
def test_binary_jsonl_names_the_file_and_line(tokenizer, strict, content, why):
    """A binary file is an error whatever dataset.strict says: it is not a file of lines to skip."""
    Path("p.jsonl").write_bytes(content)
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg("p.jsonl", strict=strict), tokenizer, 1)
    assert one_paragraph(err) == (
        f"dataset.path: p.jsonl is not a JSON Lines file ({why}); give a UTF-8 text file with one JSON object per "
        "line, or a .parquet file"
    )


def test_a_file_with_no_object_names_its_first_line(tokenizer):
    """strict=false, every line text but none an object: the file itself is the error."""
    write_jsonl("p.jsonl", ["", "[1]", "2"])
    with pytest.raises(ConfigError, match=r"^dataset\.path: p\.jsonl is not a JSON Lines file \(line 2: no line is a JSON"):
        mixed_dataset(path_cfg("p.jsonl"), tokenizer, 1)


def test_a_non_utf8_line_among_good_ones_is_skipped(tokenizer):
    """strict=false: one line of stray bytes after good lines is a bad row like any other."""
    Path("p.jsonl").write_bytes("\n".join(good_lines(2)).encode() + b"\n\xff\xfe oops\n")
    splits = mixed_dataset(path_cfg("p.jsonl"), tokenizer, 1)
    assert splits.report["sources"][0]["bad_examples"] == ["p.jsonl line 3: not UTF-8 text (byte 0)"]


def test_malformed_line_strict_names_the_file_and_line(tokenizer):
    """strict=true: the first malformed line stops the run, named by file and 1-based line number, with the fix."""
    lines = good_lines(4)
    lines[2] = '{"prompt": "2+1=", '  # cut short
    write_jsonl("p.jsonl", lines)
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg("p.jsonl", strict=True), tokenizer, 1)
    message = one_paragraph(err)
    assert message.startswith("dataset.path: p.jsonl line 3: not valid JSON (")
    assert message.endswith("or set dataset.strict=false to count and skip malformed lines")


@pytest.mark.parametrize(
    ("bad_line", "why"),
    [
        ('{"prompt": "x"', "not valid JSON"),
        ("[1, 2]", "a JSON list, not an object"),
        ('"just a string"', "a JSON str, not an object"),
    ],
)
def test_malformed_lines_are_counted_and_skipped(tokenizer, caplog, bad_line, why):
    """strict=false: a malformed line is a bad row, counted in the report and logged with its line number."""
    lines = good_lines(3)
    lines.insert(1, bad_line)
    write_jsonl("p.jsonl", lines)
    with caplog.at_level(logging.INFO, logger="rlhf"):
        splits = mixed_dataset(path_cfg("p.jsonl"), tokenizer, 1)
    assert [e.text for e in splits.train] == ["0+1=", "1+1=", "2+1="]
    [report] = splits.report["sources"]
    assert (report["rows"], report["bad_rows"], report["kept"]) == (4, 1, 3)
    assert report["bad_examples"][0].startswith(f"p.jsonl line 2: {why}")
    assert "p.jsonl[train]: 4 rows, 1 bad" in caplog.text and "p.jsonl line 2: " in caplog.text


def test_malformed_line_in_a_train_source_names_that_key(tokenizer):
    """A source listed in dataset.train is named by its own key."""
    write_jsonl("a.jsonl", good_lines(2))
    write_jsonl("b.jsonl", [*good_lines(2), "{oops"])
    cfg = path_cfg(None, train=[DataSourceConfig(path="a.jsonl"), DataSourceConfig(path="b.jsonl")], strict=True)
    with pytest.raises(ConfigError, match=r"^dataset\.train\[1\]\.path: b\.jsonl line 3: not valid JSON"):
        mixed_dataset(cfg, tokenizer, 1)


def test_json_array_file_still_reads(tokenizer):
    """A .json file holding one array of objects reads as rows (as `datasets` read it)."""
    Path("p.json").write_text(json.dumps([{"prompt": "1+1="}, {"prompt": "2+1="}]))
    assert [e.text for e in mixed_dataset(path_cfg("p.json"), tokenizer, 1).train] == ["1+1=", "2+1="]


def test_truncated_json_array_names_the_line(tokenizer):
    """A .json array cut short is named by file and line, whatever dataset.strict says (it is one value)."""
    Path("p.json").write_text('[\n{"prompt": "1+1="},\n{"prompt": "2+')
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg("p.json"), tokenizer, 1)
    assert one_paragraph(err).startswith("dataset.path: p.json line 3: not valid JSON (Unterminated string")


@pytest.mark.parametrize("content", [b"", b'{"prompt": "1+1="}\n', b"PAR1\x00\x01truncated"])
def test_unreadable_parquet_names_the_file(tokenizer, content):
    """An empty, non-Parquet or truncated .parquet file is a ConfigError naming it, not pyarrow's traceback."""
    Path("p.parquet").write_bytes(content)
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg("p.parquet"), tokenizer, 1)
    message = one_paragraph(err)
    assert message.startswith("dataset.path: p.parquet is not a readable Parquet file (")
    assert message.endswith("rewrite it (e.g. with pyarrow.parquet.write_table) or give a .jsonl file")


# --- 3. local-looking paths that do not exist -------------------------------------------------------------


@pytest.fixture
def no_hub(monkeypatch):
    """`datasets.load_dataset` records its calls and fails, as an offline hub lookup would."""
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append(args)
        raise ConnectionError("the hub was asked")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_a_missing_file_is_named_before_the_chat_template_is_asked_for(tokenizer, no_hub):
    """The tiny tokenizer has no chat template: before, a missing file reported the template (what a user fixes
    second), and a template fix then led to the missing file."""
    assert not getattr(tokenizer, "chat_template", None)
    for cfg, key in ((path_cfg("prompts.jsonl", chat_template="tokenizer"), "dataset.path"),
                     (path_cfg(write_jsonl("train.jsonl", good_lines(4)), chat_template="tokenizer",
                               eval=[DataSourceConfig(path="held_out.jsonl", split="train", amount=1.0)]), "dataset.eval[0].path")):
        with pytest.raises(ConfigError) as err:
            mixed_dataset(cfg, tokenizer, 1)
        assert one_paragraph(err).startswith(f"{key}="), str(err.value)


@pytest.mark.parametrize(
    "path", ["prompts.jsonl", "data/train.parquet", "p.json", "./data", "../elsewhere", "~/no/such", "/no/such"]
)
def test_missing_local_path_never_asks_the_hub(tokenizer, no_hub, path):
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg(path), tokenizer, 1)
    assert one_paragraph(err).startswith(f"dataset.path={path}: no such file or folder, relative to {os.getcwd()} ")
    assert no_hub == []


def test_hub_names_still_go_to_the_hub(tokenizer, no_hub):
    with pytest.raises(ConnectionError, match="the hub was asked"):
        mixed_dataset(path_cfg(None, train=[DataSourceConfig(path="openai/gsm8k", subset="main")]), tokenizer, 1)
    assert no_hub == [("openai/gsm8k", "main")]


# --- 4. prompts and the model's context ------------------------------------------------------------------


def test_context_is_read_from_the_model_config_alone(tmp_path, long_model_dir):
    """model_context reads max_position_embeddings from config.json: a folder without weights still answers."""
    folder = tmp_path / "config_only"
    folder.mkdir()
    shutil.copy(Path(long_model_dir) / "config.json", folder / "config.json")
    model = OmegaConf.create({"name_or_path": str(folder), "revision": None, "trust_remote_code": False})
    assert model_context(model) == 300
    assert model_context(compose_config([]).model) == 64  # builtin:tiny_arith


def test_prompt_limit_beyond_the_context_names_both_keys():
    """The jsonl preset's 512-token limit cannot fit the 64-position tiny model with a 4-token response."""
    cfg = compose_config(["dataset=jsonl", "dataset.path=p.jsonl"])
    context = model_context(cfg.model)
    with pytest.raises(ConfigError) as err:
        check_prompt_budget(cfg.dataset.max_prompt_length, cfg.generator.max_new_tokens, context, cfg.model.name_or_path)
    assert one_paragraph(err) == (
        "dataset.max_prompt_length=512 + generator.max_new_tokens=4 = 516 tokens exceeds the 64-token context of "
        "model.name_or_path=builtin:tiny_arith (max_position_embeddings); set dataset.max_prompt_length<=60 "
        "(longer prompts are then dropped and counted) or lower generator.max_new_tokens"
    )


def test_prompt_limit_that_fits_exactly_passes():
    check_prompt_budget(60, 4, 64, "m")
    with pytest.raises(ConfigError, match=r"dataset\.max_prompt_length=61 \+ generator\.max_new_tokens=4 = 65 tokens"):
        check_prompt_budget(61, 4, 64, "m")
    check_prompt_budget(10**6, 4, None, "m")  # a config without a context length is not checked


def test_response_budget_filling_the_context_is_an_error():
    with pytest.raises(ConfigError, match=r"^generator\.max_new_tokens=64 leaves no room for a prompt in model\.name_or_"):
        check_prompt_budget(1, 64, 64, "m")


def test_run_with_too_long_a_prompt_limit_stops_before_models_load(monkeypatch):
    """Through build_components: the limit is refused after the (cheap) data load and before any weights load."""
    write_jsonl("p.jsonl", [json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) for a in range(4)])
    cfg = compose_config([
        "dataset=jsonl", "dataset.path=p.jsonl", "dataset.ground_truth_key=answer", "dataset.cache_dir=cache",
        "dataset.chat_template=simple_concat_with_space", "dataset.max_prompt_length=61",
    ])

    def no_models(*args, **kwargs):
        raise AssertionError("models were built")

    monkeypatch.setattr("rlhf.run.build.build_local_models", no_models)
    with pytest.raises(ConfigError, match=r"^dataset\.max_prompt_length=61 \+ generator\.max_new_tokens=4 = 65 tokens"):
        build_components(validate(cfg))


def test_a_file_whose_rows_all_go_to_evaluation_is_a_config_error(monkeypatch):
    """One good row and one malformed (skipped): the 5% hold-out takes the one row, so no training prompt is left."""
    write_jsonl("p.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"}), '{"prompt": broken'])
    cfg = compose_config([
        "dataset=jsonl", "dataset.path=p.jsonl", "dataset.ground_truth_key=answer", "dataset.cache_dir=cache",
        "dataset.chat_template=simple_concat_with_space", "dataset.max_prompt_length=60",
    ])
    monkeypatch.setattr("rlhf.run.build.build_local_models", lambda *a, **k: pytest.fail("models were built"))
    with pytest.raises(ConfigError, match=r"no training prompts are left \(1 went to evaluation.*dataset\.eval_holdout"):
        build_components(validate(cfg))


# --- 5. what a hostile user tried -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["p.jsonl", "p.json"])
def test_a_utf8_bom_is_read_as_utf8_sig(tokenizer, name):
    """A leading byte-order mark (Windows editors write one) is not part of the first line's JSON."""
    Path(name).write_bytes(b"\xef\xbb\xbf" + "\n".join(good_lines(2)).encode() + b"\n")
    splits = mixed_dataset(path_cfg(name), tokenizer, 1)
    assert [e.text for e in splits.train] == ["0+1=", "1+1="]
    assert splits.report["sources"][0]["bad_rows"] == 0


def test_a_utf8_bom_before_a_json_array_is_read(tokenizer):
    Path("p.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([{"prompt": "1+1="}]).encode())
    assert [e.text for e in mixed_dataset(path_cfg("p.json"), tokenizer, 1).train] == ["1+1="]


def test_a_folder_names_the_bad_line_of_the_right_file(tokenizer, caplog):
    """A folder is read as its files are: b.jsonl's malformed line 51 is skipped and named, a.jsonl's rows kept."""
    Path("data").mkdir()
    write_jsonl("data/a.jsonl", good_lines(3))
    lines = good_lines(60)
    lines[50] = '{"prompt": "50+1=", '
    write_jsonl("data/b.jsonl", lines)
    with caplog.at_level(logging.INFO, logger="rlhf"):
        splits = mixed_dataset(path_cfg("data"), tokenizer, 1)
    [report] = splits.report["sources"]
    assert (report["rows"], report["bad_rows"], report["kept"]) == (63, 1, 62)
    assert report["bad_examples"][0].startswith("data/b.jsonl line 51: not valid JSON (")
    assert "data/b.jsonl line 51: " in caplog.text


def test_a_folder_with_strict_stops_at_the_bad_line_of_the_right_file(tokenizer):
    Path("data").mkdir()
    write_jsonl("data/a.jsonl", good_lines(3))
    write_jsonl("data/b.jsonl", [*good_lines(50), "{oops"])
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg("data", strict=True), tokenizer, 1)
    assert one_paragraph(err).startswith("dataset.path: data/b.jsonl line 51: not valid JSON (")


def write_files(files: dict[str, str | list[dict]]) -> None:
    """Write each file: text as it is, a list of rows as Parquet."""
    for name, content in files.items():
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            Path(name).write_text(content)
        else:
            pq.write_table(pa.Table.from_pylist(content), name)


GOOD, NO_PROMPT = '{"prompt": "1+1="}', '{"question": "2+2="}'


@pytest.mark.parametrize(
    "path, files, place",
    [
        pytest.param("p.jsonl", {"p.jsonl": f"{GOOD}\n\n{NO_PROMPT}\n"}, "p.jsonl line 3", id="jsonl-after-a-blank-line"),
        pytest.param("data", {"data/a.jsonl": f"{GOOD}\n{GOOD}\n", "data/b.jsonl": f"{GOOD}\n{NO_PROMPT}\n"},
                     "data/b.jsonl line 2", id="folder-second-file"),
        pytest.param("p.json", {"p.json": f"[\n{GOOD},\n{NO_PROMPT}\n]"}, "p.json row 2", id="json-array"),
        pytest.param("data", {"data/train-0.parquet": [{"prompt": "1+1="}], "data/train-1.parquet": [
            {"prompt": "2+2="}, {"prompt": None}]}, "data/train-1.parquet row 2", id="parquet-second-shard"),
        pytest.param("uf", {"uf/data/train-00000-of-00001.parquet": [{"prompt": "1+1="}, {"prompt": None}]},
                     "uf[train] row 2", id="hub-layout-folder"),
    ],
)
def test_a_bad_row_is_named_where_an_editor_finds_it(tokenizer, path, files, place):
    """Lines and rows count from 1 (as files.py counts malformed lines), within the file the row is in: the report
    and the strict error name the same place."""
    write_files(files)
    splits = mixed_dataset(path_cfg(path), tokenizer, 1)
    assert splits.report["sources"][0]["bad_examples"][-1] == f"{place}: column 'prompt': missing"
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg(path, strict=True, cache_dir="cache_strict"), tokenizer, 1)
    assert one_paragraph(err).startswith(f"dataset.path: {place}: column 'prompt': missing; set dataset.prompt_key")


def test_a_bad_row_after_a_skipped_malformed_line_keeps_its_line(tokenizer):
    """strict=false: the malformed line 2 is skipped, and the row after it is still line 3."""
    write_jsonl("p.jsonl", [GOOD, "{oops", NO_PROMPT])
    bad = mixed_dataset(path_cfg("p.jsonl"), tokenizer, 1).report["sources"][0]["bad_examples"]
    assert [example.partition(": ")[0] for example in bad] == ["p.jsonl line 2", "p.jsonl line 3"]
    assert bad[1] == "p.jsonl line 3: column 'prompt': missing"


def test_a_json_array_item_that_is_not_an_object_is_named_by_its_row(tokenizer):
    Path("p.json").write_text(json.dumps([{"prompt": "1+1="}, "2+2=", {"prompt": "3+3="}]))
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg("p.json"), tokenizer, 1)
    assert one_paragraph(err) == (
        "dataset.path: p.json row 2 is a JSON str, not an object; a JSON array must hold one object per row"
    )


def test_a_folder_of_train_shards_still_reads_only_its_split(tokenizer):
    """Files named for splits keep their meaning: train-0 and train-1 are the train split, test.jsonl is not."""
    Path("data").mkdir()
    write_jsonl("data/train-0.jsonl", good_lines(2))
    write_jsonl("data/train-1.jsonl", [json.dumps({"prompt": "9+1="})])
    write_jsonl("data/test.jsonl", [json.dumps({"prompt": "5+5="})])
    assert [e.text for e in mixed_dataset(path_cfg("data"), tokenizer, 1).train] == ["0+1=", "1+1=", "9+1="]


def test_a_folder_of_files_holding_the_split_as_a_word_reads_them_and_skips_metadata(tokenizer):
    """Without a train.jsonl, `gsm8k_train.jsonl` and `train_prefs.jsonl` are the train split, as `datasets` reads
    them; a hub clone's top-level dataset_infos.json is metadata, not prompts."""
    Path("data").mkdir()
    write_jsonl("data/gsm8k_train.jsonl", good_lines(2))
    write_jsonl("data/train_prefs.jsonl", [json.dumps({"prompt": "9+1="})])
    write_jsonl("data/gsm8k_test.jsonl", [json.dumps({"prompt": "5+5="})])
    Path("data/dataset_infos.json").write_text(json.dumps({"default": {"description": "x"}}))
    assert sorted(e.text for e in mixed_dataset(path_cfg("data"), tokenizer, 1).train) == ["0+1=", "1+1=", "9+1="]


@pytest.mark.parametrize("files", [[], ["README.md", "notes.txt"]], ids=["empty", "no-prompt-files"])
def test_a_folder_without_prompt_files_names_dataset_path(tokenizer, no_hub, files):
    """An empty folder (or one of other files) was `datasets`' EmptyDatasetError; now the key and the fix."""
    Path("data").mkdir()
    for name in files:
        Path("data", name).write_text("hello\n")
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg("data"), tokenizer, 1)
    assert one_paragraph(err) == (
        "dataset.path=data: the folder holds no .jsonl, .json or .parquet file; put the prompt files there, or give "
        "one file"
    )
    assert no_hub == []


def test_a_folder_whose_files_name_other_splits_names_the_split(tokenizer):
    """Only test.jsonl and validation.jsonl: no train split, said with the files the folder holds."""
    Path("data").mkdir()
    write_jsonl("data/test.jsonl", good_lines(2))
    write_jsonl("data/validation.jsonl", good_lines(2))
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg("data"), tokenizer, 1)
    assert one_paragraph(err) == (
        "dataset.path=data: the folder has no file for split 'train' (it holds test.jsonl, validation.jsonl); name "
        "the files train.jsonl or train-<n>.jsonl, or choose the split the files are named for"
    )


def test_an_empty_folder_stops_the_run_before_models_load(monkeypatch):
    """Through build_components, as `python -m rlhf.train dataset=jsonl dataset.path=data` runs it (exit 2)."""
    Path("data").mkdir()
    cfg = compose_config([
        "dataset=jsonl", "dataset.path=data", "dataset.cache_dir=cache", "dataset.chat_template=simple_concat_with_space",
        "dataset.max_prompt_length=60",
    ])
    monkeypatch.setattr("rlhf.run.build.build_local_models", lambda *a, **k: pytest.fail("models were built"))
    with pytest.raises(ConfigError, match=r"^dataset\.path=data: the folder holds no \.jsonl"):
        build_components(validate(cfg))


def test_a_hub_layout_folder_that_datasets_cannot_read_names_the_key(tokenizer):
    """Files only in a subfolder go to `datasets` (the hub's layout); its failure is a ConfigError naming the key."""
    Path("data/sub").mkdir(parents=True)
    write_jsonl("data/sub/train.jsonl", [*good_lines(3), "{oops"])
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg("data"), tokenizer, 1)
    message = one_paragraph(err)
    assert message.startswith("dataset.path=data: `datasets` could not read split 'train' of this folder (")
    assert message.endswith("so each file and line is checked and named")


def question_rows(n: int) -> list[str]:
    """``n`` rows `{"question": ..., "answer": ...}`: no `prompt` column."""
    return [json.dumps({"question": f"{a}+1=", "answer": str(a + 1)}) for a in range(n)]


def test_every_row_missing_the_prompt_column_says_which_column_and_key(tokenizer):
    """The default prompt_key on question/answer rows: the error names the reason, the columns and the key to set."""
    write_jsonl("p.jsonl", question_rows(200))
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg("p.jsonl", max_prompt_length=60), tokenizer, 1)
    assert one_paragraph(err) == (
        "no training prompt is left: 200 rows read, 0 longer than dataset.max_prompt_length=60, 200 bad (column "
        "'prompt': missing in 200 rows; the rows have columns question, answer); set dataset.prompt_key to the column "
        "holding the prompt string (or dataset.sft_messages_key to a column holding a conversation)"
    )


def test_every_row_missing_the_ground_truth_column_names_ground_truth_key(tokenizer):
    write_jsonl("p.jsonl", [json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) for a in range(200)])
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg("p.jsonl", ground_truth_key="nope"), tokenizer, 1)
    assert one_paragraph(err) == (
        "no training prompt is left: 200 rows read, 0 longer than dataset.max_prompt_length=64, 200 bad (column "
        "'nope': missing in 200 rows; the rows have columns prompt, answer); set dataset.ground_truth_key to the "
        "column holding the answer (and dataset.ground_truth_format to how it is written)"
    )


def test_mixed_reasons_give_the_two_commonest_and_malformed_lines(tokenizer):
    """Three missing prompts, two malformed lines, one empty prompt: the two commonest reasons and their fixes."""
    write_jsonl("p.jsonl", [*question_rows(3), "{oops", "[1]", json.dumps({"prompt": ""})])
    with pytest.raises(ConfigError) as err:
        mixed_dataset(path_cfg("p.jsonl"), tokenizer, 1)
    assert one_paragraph(err) == (
        "no training prompt is left: 6 rows read, 0 longer than dataset.max_prompt_length=64, 6 bad (column 'prompt': "
        "missing in 3 rows; a malformed JSON Lines line in 2 rows; the rows have columns question, answer, prompt); "
        "set dataset.prompt_key to the column holding the prompt string (or dataset.sft_messages_key to a column "
        "holding a conversation), or fix the malformed lines the log names"
    )


def test_all_bad_rows_stop_the_run_before_models_load(monkeypatch):
    """Through build_components (exit 2): the reason reaches the user, not only the counts."""
    write_jsonl("p.jsonl", question_rows(20))
    cfg = compose_config([
        "dataset=jsonl", "dataset.path=p.jsonl", "dataset.ground_truth_key=answer", "dataset.cache_dir=cache",
        "dataset.chat_template=simple_concat_with_space", "dataset.max_prompt_length=60",
    ])
    monkeypatch.setattr("rlhf.run.build.build_local_models", lambda *a, **k: pytest.fail("models were built"))
    with pytest.raises(ConfigError, match=r"20 bad \(column 'prompt': missing in 20 rows; the rows have columns "
                                          r"question, answer\); set dataset\.prompt_key to"):
        build_components(validate(cfg))
