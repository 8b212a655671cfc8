"""The `mix` dataset builder: sources and amounts, splits and file formats, filters, bad rows, the cache, presets.

Every dataset here is a small local file written by the test in the shape of a hub dataset; nothing touches
the hub. Each test runs in its own folder (sources are given by relative path there, so the seeded row
selection, which depends on the path, is the same on every machine).
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from rlhf.config import ConfigError, compose_config
from rlhf.data.config import DataSourceConfig
from rlhf.parts import typed_node
from rlhf.data.mix import BadRow, MixDatasetConfig, mixed_dataset, row_ground_truth, row_messages
from rlhf.models.tiny import build_char_tokenizer


@pytest.fixture(autouse=True)
def _local_only(tmp_path, monkeypatch):
    """Run in the test's folder, keep `datasets`' own cache there, and switch the hub off."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


# --- helpers ------------------------------------------------------------------------------------------


def write_jsonl(path: str | Path, rows: list[dict]) -> str:
    """Write ``rows`` as JSON Lines (creating parent folders); returns the path as given."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_parquet(path: str | Path, rows: list[dict]) -> str:
    """Write ``rows`` as a Parquet file (creating parent folders); returns the path as given."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def arith_rows(n: int, plus: int = 1) -> list[dict]:
    """``n`` rows `{"prompt": "a+plus=", "answer": "..."}` for a = 0..n-1."""
    return [{"prompt": f"{a}+{plus}=", "answer": str(a + plus)} for a in range(n)]


def mix_cfg(train=(), eval=(), **overrides):
    """A typed `mix` config: simple_concat_with_space, max_prompt_length 64, cache in ./cache unless overridden."""
    values = dict(chat_template="simple_concat_with_space", max_prompt_length=64, cache_dir="cache") | overrides
    return OmegaConf.structured(MixDatasetConfig(name="mix", train=list(train), eval=list(eval), **values))


def src(path: str, split: str = "train", amount: float = 1.0) -> DataSourceConfig:
    """One data source."""
    return DataSourceConfig(path=path, split=split, amount=amount)


def texts(examples) -> list[str]:
    """The prompt texts of ``examples``, in order."""
    return [e.text for e in examples]


def source_reports(splits) -> list[tuple[str, int, int, int, int]]:
    """(source, rows, bad_rows, too_long, kept) for every source in the report, in order."""
    return [(r["source"], r["rows"], r["bad_rows"], r["too_long"], r["kept"]) for r in splits.report["sources"]]


# --- rows -> conversations ----------------------------------------------------------------------------


def test_sft_messages_drop_the_final_assistant_turn():
    """The final assistant turn (the reference answer) is dropped; earlier assistant turns stay."""
    cfg = mix_cfg(sft_messages_key="messages")
    row = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2="},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+3="},
            {"role": "assistant", "content": "6"},
        ]
    }
    assert row_messages(row, cfg) == row["messages"][:4]


def test_sft_messages_keep_a_conversation_ending_with_the_user():
    """A conversation that ends with a user turn is kept whole."""
    cfg = mix_cfg(sft_messages_key="messages")
    messages = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3="}]
    assert row_messages({"messages": messages}, cfg) == messages


def test_sft_messages_drop_only_one_trailing_assistant_turn():
    """Two assistant turns at the end: only the last is dropped."""
    cfg = mix_cfg(sft_messages_key="messages")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert row_messages({"messages": messages}, cfg) == messages[:2]


def test_sft_messages_keep_only_role_and_content():
    """Extra message fields are dropped and the prompt column is ignored when sft_messages_key is set."""
    cfg = mix_cfg(sft_messages_key="messages")
    row = {"prompt": "ignored", "messages": [{"role": "user", "content": "2+2=", "name": "x"}, {"role": "assistant", "content": "4"}]}
    assert row_messages(row, cfg) == [{"role": "user", "content": "2+2="}]


def test_prompt_key_wraps_a_string_as_one_user_message():
    """A prompt string becomes a single user message, unchanged."""
    cfg = mix_cfg(prompt_key="question")
    assert row_messages({"question": " 3+4= ", "prompt": "other"}, cfg) == [{"role": "user", "content": " 3+4= "}]


def test_ground_truth_passes_through():
    """The ground-truth column is returned as stored (a string or number; with format json any JSON value); without
    the key it is None."""
    assert [row_ground_truth({"answer": v}, mix_cfg(ground_truth_key="answer")) for v in ("7", 7, 7.5)] == ["7", 7, 7.5]
    json_format = mix_cfg(ground_truth_key="answer", ground_truth_format="json")
    assert row_ground_truth({"answer": [7, "seven"]}, json_format) == [7, "seven"]
    assert row_ground_truth({"answer": "7"}, mix_cfg()) is None


def test_ground_truth_reaches_the_prompt_example(tokenizer):
    """Through the builder, PromptExample.ground_truth is the row's column value (a string or a number)."""
    write_jsonl("a.jsonl", [{"prompt": "3+4=", "answer": "7"}, {"prompt": "2+9=", "answer": "11"}])
    write_jsonl("b.jsonl", [{"prompt": "2+2=", "answer": 4}])
    splits = mixed_dataset(mix_cfg([src("a.jsonl"), src("b.jsonl")], ground_truth_key="answer"), tokenizer, 1)
    assert [(e.text, e.ground_truth) for e in splits.train] == [("3+4=", "7"), ("2+9=", "11"), ("2+2=", 4)]
    assert splits.train[0].token_ids == tuple(tokenizer("3+4=")["input_ids"])


def test_sft_rows_through_the_builder(tokenizer):
    """Through the builder, the prompt is the conversation without its answer, rendered with the template."""
    write_jsonl(
        "conv.jsonl",
        [{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}],
    )
    splits = mixed_dataset(mix_cfg([src("conv.jsonl")], sft_messages_key="messages", chat_template="tulu"), tokenizer, 1)
    assert texts(splits.train) == ["<|user|>\n1+1=\n<|assistant|>\n"]


# --- amounts, seeds, sources --------------------------------------------------------------------------


@pytest.fixture
def two_sources():
    """a.jsonl (20 rows `a+1=`) and b.parquet (12 rows `a+2=`)."""
    write_jsonl("a.jsonl", arith_rows(20, plus=1))
    write_parquet("b.parquet", arith_rows(12, plus=2))
    return [src("a.jsonl", amount=0.5), src("b.parquet", amount=7)]


def test_fraction_and_count_mix(tokenizer, two_sources):
    """0.5 of 20 rows gives 10 and a count of 7 gives 7, chosen by the seed, in file order, sources concatenated."""
    splits = mixed_dataset(mix_cfg(two_sources), tokenizer, 1)
    assert texts(splits.train) == [f"{a}+1=" for a in (0, 1, 3, 7, 8, 9, 10, 14, 16, 17)] + [
        f"{a}+2=" for a in (0, 1, 2, 3, 5, 6, 10)
    ]
    assert source_reports(splits) == [("a.jsonl[train]", 10, 0, 0, 10), ("b.parquet[train]", 7, 0, 0, 7)]
    assert splits.report["cache"] == "miss"


def test_selection_is_seeded(tokenizer, two_sources):
    """The same seed picks the same rows (fresh builds); another seed picks other rows, in the same numbers."""
    first = mixed_dataset(mix_cfg(two_sources, cache_dir="c1"), tokenizer, 1)
    again = mixed_dataset(mix_cfg(two_sources, cache_dir="c2"), tokenizer, 1)
    other = mixed_dataset(mix_cfg(two_sources, cache_dir="c3"), tokenizer, 2)
    assert [s.report["cache"] for s in (first, again, other)] == ["miss", "miss", "miss"]
    assert again.train == first.train
    assert texts(other.train) == [f"{a}+1=" for a in (1, 3, 4, 6, 7, 9, 10, 11, 14, 15)] + [
        f"{a}+2=" for a in (0, 1, 3, 6, 7, 8, 9)
    ]
    assert texts(other.train) != texts(first.train)


@pytest.mark.parametrize(("amount", "rows"), [(1.0, 10), (0.5, 5), (0.33, 3), (0.37, 4), (2, 2), (10, 10)])
def test_amount_rounds_fractions_and_counts_exactly(tokenizer, amount, rows):
    """A fraction of 10 rows rounds to the nearest count; a whole number above 1 is an exact count."""
    write_jsonl("a.jsonl", arith_rows(10))
    splits = mixed_dataset(mix_cfg([src("a.jsonl", amount=amount), src("a.jsonl", amount=1.0)]), tokenizer, 1)
    assert splits.report["sources"][0]["rows"] == rows
    assert len(splits.train) == rows + 10


def test_count_larger_than_the_split_errors(tokenizer, two_sources):
    """Asking for more rows than a split has names the key, the count and the split's size."""
    with pytest.raises(ValueError, match=r"^dataset\.train\[1\]\.amount=13 rows, but b\.parquet\[train\] has only 12$"):
        mixed_dataset(mix_cfg([two_sources[0], src("b.parquet", amount=13)]), tokenizer, 1)


def test_count_must_be_whole(tokenizer, two_sources):
    """An amount above 1 that is not a whole number names the key."""
    with pytest.raises(ValueError, match=r"^dataset\.train\[0\]\.amount=2\.5: a count must be a whole number"):
        mixed_dataset(mix_cfg([src("a.jsonl", amount=2.5)]), tokenizer, 1)


def test_no_source_errors(tokenizer):
    """A mix without sources or a path says which keys to set."""
    with pytest.raises(ValueError, match=r"needs dataset\.train sources or dataset\.path=<file>"):
        mixed_dataset(mix_cfg(), tokenizer, 1)


def test_dataset_path_is_the_only_train_source(tokenizer):
    """`dataset.path` (what dataset=jsonl/parquet set) reads one file's `train` split, all of it."""
    write_jsonl("p.jsonl", arith_rows(3))
    splits = mixed_dataset(mix_cfg(path="p.jsonl"), tokenizer, 1)
    assert texts(splits.train) == ["0+1=", "1+1=", "2+1="]
    assert source_reports(splits) == [("p.jsonl[train]", 3, 0, 0, 3)]


# --- splits and file formats --------------------------------------------------------------------------


@pytest.fixture
def split_folder():
    """A local folder holding train.jsonl, validation.jsonl and test_prefs.jsonl, 3 rows each."""
    for split in ("train", "validation", "test_prefs"):
        write_jsonl(f"folder/{split}.jsonl", [{"prompt": f"{split} {i}"} for i in range(3)])
    return "folder"


@pytest.mark.parametrize("split", ["train", "validation"])
def test_folder_split_by_name(tokenizer, split_folder, split):
    """A folder source reads the split named by `split` from its file of that name."""
    splits = mixed_dataset(mix_cfg([src(split_folder, split=split)]), tokenizer, 1)
    assert texts(splits.train) == [f"{split} 0", f"{split} 1", f"{split} 2"]
    assert splits.report["sources"][0]["source"] == f"folder[{split}]"


def test_folder_split_with_a_custom_name(tokenizer, split_folder):
    """A folder's test_prefs.jsonl is the split `test_prefs` (the ultrafeedback split names)."""
    splits = mixed_dataset(mix_cfg([src(split_folder, split="test_prefs")]), tokenizer, 1)
    assert texts(splits.train) == ["test_prefs 0", "test_prefs 1", "test_prefs 2"]


def test_folder_train_split_reads_only_train_file(tokenizer):
    """The split `train` of a folder holding train.jsonl and train_prefs.jsonl is train.jsonl alone."""
    write_jsonl("folder/train.jsonl", [{"prompt": "train 0"}])
    write_jsonl("folder/train_prefs.jsonl", [{"prompt": "train_prefs 0"}])
    splits = mixed_dataset(mix_cfg([src("folder"), src("folder", split="train_prefs")]), tokenizer, 1)
    assert texts(splits.train) == ["train 0", "train_prefs 0"]


def test_folder_split_shards_are_concatenated(tokenizer):
    """`<split>-*.<ext>` shards of one split are read together, in file-name order."""
    write_jsonl("folder/train-00001-of-00002.jsonl", [{"prompt": "second"}])
    write_jsonl("folder/train-00000-of-00002.jsonl", [{"prompt": "first"}])
    write_jsonl("folder/validation.jsonl", [{"prompt": "other"}])
    splits = mixed_dataset(mix_cfg([src("folder")]), tokenizer, 1)
    assert texts(splits.train) == ["first", "second"]


def test_folder_split_mixing_formats_errors(tokenizer):
    """A split whose files are both JSON Lines and Parquet names the folder, the split and the files."""
    write_jsonl("folder/train.jsonl", [{"prompt": "a"}])
    write_parquet("folder/train-00001.parquet", [{"prompt": "b"}])
    with pytest.raises(ConfigError, match=r"^dataset\.train\[0\]\.path: folder: split 'train' mixes file formats \(train-00001\.parquet, train\.jsonl\); keep one format"):
        mixed_dataset(mix_cfg([src("folder")]), tokenizer, 1)


def test_hub_layout_folder_has_named_splits(tokenizer):
    """A folder in the hub's layout, data/<split>-00000-of-00001.parquet, serves any split name."""
    write_parquet("uf/data/train_prefs-00000-of-00001.parquet", [{"prompt": "tp 0"}, {"prompt": "tp 1"}])
    write_parquet("uf/data/test_prefs-00000-of-00001.parquet", [{"prompt": "sp 0"}])
    splits = mixed_dataset(mix_cfg([src("uf", split="train_prefs")], [src("uf", split="test_prefs")]), tokenizer, 1)
    assert texts(splits.train) == ["tp 0", "tp 1"]
    assert texts(splits.eval) == ["sp 0"]


@pytest.mark.parametrize("suffix", ["jsonl", "json", "parquet"])
def test_single_file_formats(tokenizer, suffix):
    """JSON Lines (.jsonl or .json) and Parquet files read the same rows."""
    rows = arith_rows(4)
    path = write_parquet(f"p.{suffix}", rows) if suffix == "parquet" else write_jsonl(f"p.{suffix}", rows)
    splits = mixed_dataset(mix_cfg([src(path)], ground_truth_key="answer"), tokenizer, 1)
    assert [(e.text, e.ground_truth) for e in splits.train] == [("0+1=", "1"), ("1+1=", "2"), ("2+1=", "3"), ("3+1=", "4")]


def test_single_file_has_only_train(tokenizer):
    """A single file asked for another split names the key."""
    write_jsonl("p.jsonl", arith_rows(2))
    with pytest.raises(ValueError, match=r"^dataset\.eval\[0\]\.split=validation: a single local file only has the split `train`$"):
        mixed_dataset(mix_cfg([src("p.jsonl")], [src("p.jsonl", split="validation")]), tokenizer, 1)


def test_unknown_file_type_errors(tokenizer):
    """A .csv file names the key and the accepted suffixes."""
    Path("p.csv").write_text("prompt\n1+1=\n")
    with pytest.raises(ValueError, match=r"^dataset\.train\[0\]\.path=p\.csv: unknown file type '\.csv'; use \.jsonl, \.json or \.parquet$"):
        mixed_dataset(mix_cfg([src("p.csv")]), tokenizer, 1)


def test_missing_local_path_errors_without_the_hub(tokenizer):
    """A path that looks local but does not exist fails before any hub lookup."""
    with pytest.raises(ValueError, match=r"^dataset\.train\[0\]\.path=\./missing\.jsonl: no such file or folder, relative to ") as err:
        mixed_dataset(mix_cfg([src("./missing.jsonl")]), tokenizer, 1)
    assert f"relative to {Path.cwd()} (the launch folder)" in str(err.value)


# --- eval prompts -------------------------------------------------------------------------------------


def test_eval_sources_give_the_eval_split(tokenizer):
    """With eval sources, eval prompts come from them and every train prompt stays in train (holdout unused)."""
    write_jsonl("train.jsonl", arith_rows(10, plus=1))
    write_jsonl("eval.jsonl", arith_rows(3, plus=5))
    splits = mixed_dataset(mix_cfg([src("train.jsonl")], [src("eval.jsonl")], eval_holdout=0.5), tokenizer, 1)
    assert texts(splits.train) == [f"{a}+1=" for a in range(10)]
    assert texts(splits.eval) == ["0+5=", "1+5=", "2+5="]
    assert source_reports(splits) == [("train.jsonl[train]", 10, 0, 0, 10), ("eval.jsonl[train]", 3, 0, 0, 3)]


def test_eval_holdout_splits_the_train_prompts(tokenizer):
    """Without eval sources, eval_holdout=0.2 of 10 prompts holds out 2 (seeded), disjoint from the other 8."""
    write_jsonl("train.jsonl", arith_rows(10))
    splits = mixed_dataset(mix_cfg([src("train.jsonl")], eval_holdout=0.2, cache_dir="c1"), tokenizer, 1)
    again = mixed_dataset(mix_cfg([src("train.jsonl")], eval_holdout=0.2, cache_dir="c2"), tokenizer, 1)
    assert (len(splits.train), len(splits.eval)) == (8, 2)
    assert not set(texts(splits.train)) & set(texts(splits.eval))
    assert sorted(texts(splits.train) + texts(splits.eval)) == sorted(f"{a}+1=" for a in range(10))
    assert (again.train, again.eval) == (splits.train, splits.eval)


def test_small_holdout_keeps_at_least_one_eval_prompt(tokenizer):
    """A holdout share that rounds to zero still holds out one prompt."""
    write_jsonl("train.jsonl", arith_rows(10))
    splits = mixed_dataset(mix_cfg([src("train.jsonl")], eval_holdout=0.01), tokenizer, 1)
    assert (len(splits.train), len(splits.eval)) == (9, 1)


def test_without_eval_sources_or_holdout_eval_is_train(tokenizer):
    """No eval sources and no holdout: the eval prompts are the training prompts."""
    write_jsonl("train.jsonl", arith_rows(5))
    splits = mixed_dataset(mix_cfg([src("train.jsonl")]), tokenizer, 1)
    assert splits.eval == splits.train
    assert len(splits.eval) == 5


# --- length filter ------------------------------------------------------------------------------------


def test_long_prompts_are_dropped_and_counted_per_source(tokenizer):
    """With max_prompt_length=6 (BOS + 5 chars), longer prompts are dropped and counted by source; 6 is kept."""
    write_jsonl("a.jsonl", [{"prompt": p} for p in ("1+1=", "12+3=", "10+10=", "123+4=")])
    write_jsonl("b.jsonl", [{"prompt": p} for p in ("2+2=", "99+99=")])
    write_jsonl("e.jsonl", [{"prompt": p} for p in ("5+5=", "55+55=")])
    splits = mixed_dataset(mix_cfg([src("a.jsonl"), src("b.jsonl")], [src("e.jsonl")], max_prompt_length=6), tokenizer, 1)
    assert texts(splits.train) == ["1+1=", "12+3=", "2+2="]
    assert texts(splits.eval) == ["5+5="]
    assert source_reports(splits) == [
        ("a.jsonl[train]", 4, 0, 2, 2),
        ("b.jsonl[train]", 2, 0, 1, 1),
        ("e.jsonl[train]", 2, 0, 1, 1),
    ]
    assert max(len(e.token_ids) for e in splits.train) == 6


def test_length_counts_the_rendered_prompt(tokenizer):
    """The limit applies to the templated text: tulu markers count, so a short question can be too long."""
    write_jsonl("a.jsonl", [{"prompt": "1+1="}])
    rendered = len(tokenizer("<|user|>\n1+1=\n<|assistant|>\n")["input_ids"])
    assert rendered > len(tokenizer("1+1=")["input_ids"])
    cfg = mix_cfg([src("a.jsonl")], chat_template="tulu", max_prompt_length=rendered)
    assert len(mixed_dataset(cfg, tokenizer, 1).train[0].token_ids) == rendered
    cfg.max_prompt_length = rendered - 1
    with pytest.raises(ValueError, match=rf"1 longer than dataset\.max_prompt_length={rendered - 1}, 0 bad"):
        mixed_dataset(cfg, tokenizer, 1)


def test_limit_that_removes_everything_errors(tokenizer):
    """When no training prompt fits, the error gives the counts and names dataset.max_prompt_length."""
    write_jsonl("a.jsonl", arith_rows(4) + [{"answer": "x"}])
    with pytest.raises(ValueError) as err:
        mixed_dataset(mix_cfg([src("a.jsonl")], max_prompt_length=3), tokenizer, 1)
    assert str(err.value) == (
        "no training prompt is left: 5 rows read, 4 longer than dataset.max_prompt_length=3, 1 bad (column 'prompt': "
        "missing in 1 row; the rows have columns answer); raise dataset.max_prompt_length, or set dataset.prompt_key "
        "to the column holding the prompt string (or dataset.sft_messages_key to a column holding a conversation)"
    )


def test_limit_error_counts_train_sources_of_any_split_name(tokenizer):
    """The totals in the no-prompt-left error count a train source read from split train_prefs."""
    write_parquet("uf/data/train_prefs-00000-of-00001.parquet", [{"prompt": "1+1="}, {"prompt": "2+2="}])
    with pytest.raises(ValueError) as err:
        mixed_dataset(mix_cfg([src("uf", split="train_prefs")], max_prompt_length=2), tokenizer, 1)
    assert str(err.value).startswith("no training prompt is left: 2 rows read, 2 longer than dataset.max_prompt_length=2")


def test_report_gives_each_source_its_role_and_split(tokenizer):
    """Each report entry has the source's role (train or eval) and, separately, the dataset split it was read from."""
    write_parquet("uf/data/train_prefs-00000-of-00001.parquet", [{"prompt": "1+1="}])
    write_jsonl("e.jsonl", [{"prompt": "2+2="}, {"prompt": ""}])
    splits = mixed_dataset(mix_cfg([src("uf", split="train_prefs")], [src("e.jsonl")]), tokenizer, 1)
    assert splits.report == {
        "sources": [
            {"role": "train", "source": "uf[train_prefs]", "split": "train_prefs", "rows": 1, "bad_rows": 0,
             "too_long": 0, "kept": 1, "bad_examples": []},
            {"role": "eval", "source": "e.jsonl[train]", "split": "train", "rows": 2, "bad_rows": 1,
             "too_long": 0, "kept": 1, "bad_examples": ["e.jsonl line 2: column 'prompt': empty prompt"]},
        ],
        "cache": "miss",
    }


# --- bad rows -----------------------------------------------------------------------------------------

PROMPT_ROWS = [
    {"prompt": "1+1=", "answer": "2"},  # 0 good
    {"answer": "3"},  # 1 missing prompt
    {"prompt": "", "answer": "0"},  # 2 empty prompt
    {"prompt": 5, "answer": "5"},  # 3 prompt is not a string
    {"prompt": "2+2="},  # 4 missing ground truth
    {"prompt": "   ", "answer": "0"},  # 5 blank prompt
    {"prompt": ["3+3="], "answer": "6"},  # 6 prompt is a list
    {"prompt": "3+3=", "answer": "6"},  # 7 good
]

MESSAGE_ROWS = [
    {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]},  # 0 good
    {"messages": "1+1="},  # 1 not a list
    {"messages": [{"role": "user"}]},  # 2 a message without content
    {"messages": ["1+1="]},  # 3 a list of strings
    {"other": 1},  # 4 missing column
    {"messages": [{"role": "assistant", "content": "2"}]},  # 5 only the answer
    {"messages": [{"role": "user", "content": 7}]},  # 6 content is not a string
    {"messages": [{"role": "user", "content": "2+2="}]},  # 7 good
]


def mix_reason(row: dict) -> str:
    """The BadRow message row_messages gives ``row`` with sft_messages_key=messages."""
    with pytest.raises(BadRow) as err:
        row_messages(row, mix_cfg(sft_messages_key="messages"))
    assert err.value.column == "messages"
    return str(err.value)


def test_bad_prompt_rows_are_counted(tokenizer):
    """Missing, empty, blank and non-string prompts and a missing ground truth are counted, with reasons."""
    write_jsonl("bad.jsonl", PROMPT_ROWS)
    splits = mixed_dataset(mix_cfg([src("bad.jsonl")], ground_truth_key="answer"), tokenizer, 1)
    assert [(e.text, e.ground_truth) for e in splits.train] == [("1+1=", "2"), ("3+3=", "6")]
    assert source_reports(splits) == [("bad.jsonl[train]", 8, 6, 0, 2)]
    assert splits.report["sources"][0]["bad_examples"] == [
        "bad.jsonl line 2: column 'prompt': missing",
        "bad.jsonl line 3: column 'prompt': empty prompt",
        "bad.jsonl line 4: column 'prompt': expected a string, got int",
    ]


def test_bad_rows_name_their_column(tokenizer):
    """Each kind of bad row is reported with the column at fault."""
    write_jsonl("bad.jsonl", [PROMPT_ROWS[4], PROMPT_ROWS[6], PROMPT_ROWS[5]])
    write_jsonl("ok.jsonl", [PROMPT_ROWS[0]])
    splits = mixed_dataset(mix_cfg([src("bad.jsonl"), src("ok.jsonl")], ground_truth_key="answer"), tokenizer, 1)
    assert source_reports(splits) == [("bad.jsonl[train]", 3, 3, 0, 0), ("ok.jsonl[train]", 1, 0, 0, 1)]
    assert splits.report["sources"][0]["bad_examples"] == [
        "bad.jsonl line 1: column 'answer': missing",
        "bad.jsonl line 2: column 'prompt': expected a string, got list",
        "bad.jsonl line 3: column 'prompt': empty prompt",
    ]


def test_bad_message_rows_are_counted(tokenizer):
    """Messages that are missing, not a list of {role, content}, or empty once the answer is dropped are counted."""
    write_jsonl("bad.jsonl", MESSAGE_ROWS)
    splits = mixed_dataset(mix_cfg([src("bad.jsonl")], sft_messages_key="messages"), tokenizer, 1)
    assert texts(splits.train) == ["1+1=", "2+2="]
    assert source_reports(splits) == [("bad.jsonl[train]", 8, 6, 0, 2)]
    reasons = [mix_reason(row) for row in MESSAGE_ROWS[1:7]]
    assert reasons == [
        "column 'messages': not a list of {role, content} messages",
        "column 'messages': not a list of {role, content} messages",
        "column 'messages': not a list of {role, content} messages",
        "column 'messages': missing",
        "column 'messages': no message left to prompt with",
        "column 'messages': not a list of {role, content} messages",
    ]
    assert splits.report["sources"][0]["bad_examples"] == [f"bad.jsonl line {i + 1}: {reasons[i - 1]}" for i in (1, 2, 3)]


STRICT_OFF = ", or set dataset.strict=false to count and skip bad rows"


def test_strict_names_source_line_column_and_fix(tokenizer):
    """strict=true stops at the first bad row, naming the source's key, the file and line (counted from 1, as an
    editor counts), the column and the fix."""
    write_jsonl("bad.jsonl", PROMPT_ROWS)
    with pytest.raises(ConfigError) as err:
        mixed_dataset(mix_cfg([src("bad.jsonl")], ground_truth_key="answer", strict=True), tokenizer, 1)
    assert str(err.value) == (
        "dataset.train[0].path: bad.jsonl line 2: column 'prompt': missing; set dataset.prompt_key to the column "
        f"holding the prompt string (or dataset.sft_messages_key to a column holding a conversation){STRICT_OFF}"
    )


def test_strict_names_a_wrong_type(tokenizer):
    """strict=true on a non-string prompt names the column and the type found."""
    write_jsonl("bad.jsonl", [PROMPT_ROWS[0], PROMPT_ROWS[3]])
    with pytest.raises(ConfigError, match=r"^dataset\.train\[0\]\.path: bad\.jsonl line 2: column 'prompt': expected a string, got int; "):
        mixed_dataset(mix_cfg([src("bad.jsonl")], strict=True), tokenizer, 1)


def test_strict_names_bad_messages(tokenizer):
    """strict=true on a malformed conversation names the messages column."""
    write_jsonl("conv.jsonl", MESSAGE_ROWS[:3])
    with pytest.raises(ConfigError) as err:
        mixed_dataset(mix_cfg([src("conv.jsonl")], sft_messages_key="messages", strict=True), tokenizer, 1)
    assert str(err.value) == (
        "dataset.train[0].path: conv.jsonl line 2: column 'messages': not a list of {role, content} messages; set "
        "dataset.sft_messages_key to the column holding a list of {role, content} messages (or dataset.prompt_key to "
        f"a column holding the prompt string){STRICT_OFF}"
    )


def test_a_bad_row_is_named_by_its_line_in_the_file(tokenizer):
    """With half of 10 rows chosen (seed 1: rows 0, 3, 6, 7, 9), the bad eighth row is reported as line 8, not as
    the fourth row chosen."""
    rows = arith_rows(10)
    rows[7] = {"prompt": None, "answer": "8"}
    write_jsonl("bad.jsonl", rows)
    lenient = mixed_dataset(mix_cfg([src("bad.jsonl", amount=0.5)]), tokenizer, 1)
    assert texts(lenient.train) == ["0+1=", "3+1=", "6+1=", "9+1="]
    assert lenient.report["sources"][0]["bad_examples"] == ["bad.jsonl line 8: column 'prompt': missing"]
    with pytest.raises(ConfigError, match=r"^dataset\.train\[0\]\.path: bad\.jsonl line 8: column 'prompt': missing"):
        mixed_dataset(mix_cfg([src("bad.jsonl", amount=0.5)], strict=True), tokenizer, 1)


# --- what a row may hold: an answer is a string or a number, a message's role one a chat template renders ------

STRUCTURED_ANSWERS = [
    {"prompt": "1+1=", "answer": "2"},  # line 1 good
    {"prompt": "2+2=", "answer": ["4", "four"]},  # line 2 a list
    {"prompt": "3+3=", "answer": {"value": 6}},  # line 3 an object
    {"prompt": "4+4=", "answer": 8},  # line 4 good: a number
]

TRUTH_TYPE_FIX = (
    'write each answer as one string or number (e.g. "42"), or set dataset.ground_truth_format=json if your reward '
    "functions read lists and objects"
)


@pytest.mark.parametrize("line, kind", [(2, "list"), (3, "dict")])
def test_strict_names_an_answer_that_is_a_list_or_an_object(tokenizer, line, kind):
    """strict=true: an answer column holding a list or an object (which exact_match would compare as its Python
    text) stops the run, naming the line, the column and the fix."""
    write_jsonl("a.jsonl", [STRUCTURED_ANSWERS[0], STRUCTURED_ANSWERS[line - 1]])
    with pytest.raises(ConfigError) as err:
        mixed_dataset(mix_cfg([src("a.jsonl")], ground_truth_key="answer", strict=True), tokenizer, 1)
    assert str(err.value) == (
        f"dataset.train[0].path: a.jsonl line 2: column 'answer': expected a string or number, got {kind}; "
        f"{TRUTH_TYPE_FIX}{STRICT_OFF}"
    )


def test_answers_that_are_lists_or_objects_are_counted_and_skipped(tokenizer):
    """strict=false: such rows are bad rows like any other, counted and named by line; strings and numbers stay."""
    write_jsonl("a.jsonl", STRUCTURED_ANSWERS)
    splits = mixed_dataset(mix_cfg([src("a.jsonl")], ground_truth_key="answer"), tokenizer, 1)
    assert [(e.text, e.ground_truth) for e in splits.train] == [("1+1=", "2"), ("4+4=", 8)]
    assert source_reports(splits) == [("a.jsonl[train]", 4, 2, 0, 2)]
    assert splits.report["sources"][0]["bad_examples"] == [
        "a.jsonl line 2: column 'answer': expected a string or number, got list",
        "a.jsonl line 3: column 'answer': expected a string or number, got dict",
    ]


def test_every_answer_a_list_names_the_json_format(tokenizer):
    """When no training prompt is left because every answer is a list, the error gives the fix, not only the key."""
    write_jsonl("a.jsonl", [STRUCTURED_ANSWERS[1]] * 3)
    with pytest.raises(ConfigError) as err:
        mixed_dataset(mix_cfg([src("a.jsonl")], ground_truth_key="answer"), tokenizer, 1)
    assert str(err.value) == (
        "no training prompt is left: 3 rows read, 0 longer than dataset.max_prompt_length=64, 3 bad (column 'answer': "
        f"expected a string or number, got list in 3 rows; the rows have columns prompt, answer); {TRUTH_TYPE_FIX}"
    )


def test_json_format_hands_on_lists_and_objects(tokenizer):
    """ground_truth_format=json: every answer reaches the reward functions as stored, strict or not."""
    write_jsonl("a.jsonl", STRUCTURED_ANSWERS)
    cfg = mix_cfg([src("a.jsonl")], ground_truth_key="answer", ground_truth_format="json", strict=True)
    splits = mixed_dataset(cfg, tokenizer, 1)
    assert [e.ground_truth for e in splits.train] == [row["answer"] for row in STRUCTURED_ANSWERS]


ROLE_ROWS = [
    {"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}]},  # line 1 good
    {"messages": [{"role": "human", "content": "2+2="}, {"role": "gpt", "content": "4"}]},  # line 2 ShareGPT roles
    {"messages": [{"role": "user", "content": "3+3="}, {"role": "tool", "content": "6"}]},  # line 3 good: a tool turn
    {"messages": [{"role": "user", "content": "4+4="}, {"role": "User", "content": "and?"}]},  # line 4 a capital
]

ROLE_FIX = (
    "rename the conversation's other roles to these (ShareGPT's human and gpt are user and assistant; a chat template "
    "may drop a message of another role without a word)"
)


def test_strict_names_a_message_role_no_template_renders(tokenizer):
    """strict=true: a conversation with a role outside system/user/assistant/tool (which Qwen2.5's template drops,
    and whose final answer was never dropped as the assistant's) stops the run, naming line, message and fix."""
    write_jsonl("conv.jsonl", ROLE_ROWS[:2])
    with pytest.raises(ConfigError) as err:
        mixed_dataset(mix_cfg([src("conv.jsonl")], sft_messages_key="messages", strict=True), tokenizer, 1)
    assert str(err.value) == (
        "dataset.train[0].path: conv.jsonl line 2: column 'messages': message 1 has role 'human', not one of system, "
        f"user, assistant, tool, developer, ipython; {ROLE_FIX}{STRICT_OFF}"  # the two last: this template renders them
    )


def test_unknown_message_roles_are_counted_and_skipped(tokenizer):
    """strict=false: rows with an unknown role (roles are case-sensitive) are counted and named by line; a tool
    turn is a role chat templates render, and stays."""
    write_jsonl("conv.jsonl", ROLE_ROWS)
    splits = mixed_dataset(mix_cfg([src("conv.jsonl")], sft_messages_key="messages"), tokenizer, 1)
    assert texts(splits.train) == ["Add. 1+1=", "3+3= 6"]
    assert source_reports(splits) == [("conv.jsonl[train]", 4, 2, 0, 2)]
    assert splits.report["sources"][0]["bad_examples"] == [
        "conv.jsonl line 2: column 'messages': message 1 has role 'human', not one of system, user, assistant, tool, developer, ipython",
        "conv.jsonl line 4: column 'messages': message 2 has role 'User', not one of system, user, assistant, tool, developer, ipython",
    ]


KNOWN_ROLES_ONLY = "{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}{{ m.content }} {% endif %}{% endfor %}"


@pytest.mark.parametrize(("template", "kept"), [("simple_concat_with_space", True), (KNOWN_ROLES_ONLY, False)])
def test_a_developer_or_ipython_message_is_kept_where_the_template_renders_it(tokenizer, template, kept):
    """OpenAI's developer and Llama 3.1's ipython roles: rows keep them when the chat template shows such a message
    (here one that renders every message), and are bad rows when it would drop them (one that knows three roles)."""
    write_jsonl("conv.jsonl", [
        {"messages": [{"role": "developer", "content": "Add."}, {"role": "user", "content": "1+1="}]},
        {"messages": [{"role": "user", "content": "2+2="}, {"role": "ipython", "content": "4"}]},
        {"messages": [{"role": "user", "content": "3+3="}]},
    ])
    splits = mixed_dataset(mix_cfg([src("conv.jsonl")], sft_messages_key="messages", chat_template=template), tokenizer, 1)
    if kept:
        assert texts(splits.train) == ["Add. 1+1=", "2+2= 4", "3+3="]
    else:
        assert texts(splits.train) == ["3+3= "]
        assert splits.report["sources"][0]["bad_examples"][0] == (
            "conv.jsonl line 1: column 'messages': message 1 has role 'developer', not one of system, user, assistant, tool")


def test_strict_passes_clean_data(tokenizer):
    """strict=true changes nothing when every row is good."""
    write_jsonl("a.jsonl", arith_rows(3))
    splits = mixed_dataset(mix_cfg([src("a.jsonl")], strict=True), tokenizer, 1)
    assert texts(splits.train) == ["0+1=", "1+1=", "2+1="]


# --- sanity_check -------------------------------------------------------------------------------------


def test_sanity_check_caps_each_source(tokenizer, two_sources):
    """sanity_check=3 keeps the first 3 chosen rows of every source, train and eval."""
    write_jsonl("e.jsonl", arith_rows(5, plus=9))
    splits = mixed_dataset(mix_cfg(two_sources, [src("e.jsonl")], sanity_check=3), tokenizer, 1)
    assert texts(splits.train) == ["0+1=", "1+1=", "3+1=", "0+2=", "1+2=", "2+2="]
    assert texts(splits.eval) == ["0+9=", "1+9=", "2+9="]
    assert [r["rows"] for r in splits.report["sources"]] == [3, 3, 3]


def test_sanity_check_above_the_size_keeps_everything(tokenizer):
    """A cap above a source's size keeps all of it."""
    write_jsonl("a.jsonl", arith_rows(4))
    splits = mixed_dataset(mix_cfg([src("a.jsonl")], sanity_check=100), tokenizer, 1)
    assert len(splits.train) == 4


# --- cache --------------------------------------------------------------------------------------------


@pytest.fixture
def cached(tokenizer):
    """A train file, an eval file, a config and its first (cache-miss) build."""
    write_jsonl("a.jsonl", arith_rows(6) + [{"prompt": "11+11=", "answer": "22"}, {"answer": "0"}])
    write_jsonl("e.jsonl", arith_rows(2, plus=3))
    cfg = mix_cfg([src("a.jsonl", amount=0.5)], [src("e.jsonl")], ground_truth_key="answer", max_prompt_length=6)
    first = mixed_dataset(cfg, tokenizer, 1)
    assert first.report["cache"] == "miss"
    return cfg, first


def test_second_build_is_a_cache_hit(tokenizer, cached):
    """The same config again is served from the cache: same examples, same report, marked as a hit."""
    cfg, first = cached
    second = mixed_dataset(cfg, tokenizer, 1)
    assert second.report["cache"] == "hit"
    assert (second.train, second.eval) == (first.train, first.eval)
    assert second.report["sources"] == first.report["sources"]
    assert len(list(Path("cache").glob("*.json"))) == 1


def test_cache_hit_keeps_ground_truth_types(tokenizer):
    """Ground truths of any JSON type (ground_truth_format=json) come back from the cache unchanged."""
    write_jsonl("a.jsonl", [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": ["4", 4]}])
    cfg = mix_cfg([src("a.jsonl")], ground_truth_key="answer", ground_truth_format="json")
    first, second = mixed_dataset(cfg, tokenizer, 1), mixed_dataset(cfg, tokenizer, 1)
    assert second.report["cache"] == "hit"
    assert [e.ground_truth for e in second.train] == [2, ["4", 4]] == [e.ground_truth for e in first.train]


def test_changing_the_tokenizer_misses(tokenizer, cached):
    """Another tokenizer (another vocabulary) is a cache miss and gives its own token ids."""
    cfg, first = cached
    other = build_char_tokenizer("=+9876543210")
    rebuilt = mixed_dataset(cfg, other, 1)
    assert rebuilt.report["cache"] == "miss"
    assert texts(rebuilt.train) == texts(first.train)
    assert rebuilt.train[0].token_ids == tuple(other(first.train[0].text)["input_ids"]) != first.train[0].token_ids


def test_changing_the_template_misses(tokenizer, cached):
    """Another chat template is a cache miss."""
    cfg, _ = cached
    cfg.chat_template = "{{ messages[0]['content'] }}"
    assert mixed_dataset(cfg, tokenizer, 1).report["cache"] == "miss"


def test_changing_max_prompt_length_misses(tokenizer, cached):
    """Another max_prompt_length is a cache miss, and the longer prompt now fits."""
    cfg, first = cached
    cfg.max_prompt_length = 7
    rebuilt = mixed_dataset(cfg, tokenizer, 1)
    assert rebuilt.report["cache"] == "miss"
    assert [r["too_long"] for r in rebuilt.report["sources"]] == [0, 0]


def test_changing_the_seed_or_sources_misses(tokenizer, cached):
    """Another seed, or another amount, is a cache miss."""
    cfg, _ = cached
    assert mixed_dataset(cfg, tokenizer, 2).report["cache"] == "miss"
    cfg.train[0].amount = 1.0
    assert mixed_dataset(cfg, tokenizer, 1).report["cache"] == "miss"


def test_rewriting_the_file_misses(tokenizer, cached):
    """Rewriting a source file is a cache miss and the new rows are read."""
    cfg, _ = cached
    write_jsonl("e.jsonl", arith_rows(3, plus=4))
    rebuilt = mixed_dataset(cfg, tokenizer, 1)
    assert rebuilt.report["cache"] == "miss"
    assert texts(rebuilt.eval) == ["0+4=", "1+4=", "2+4="]


@pytest.mark.parametrize(
    ("template", "text"),
    [("{{ bos_token }}{{ messages[0]['content'] }}", "<bos>1+1="), ("{{ messages[0]['content'] }}", "1+1=")],
)
@pytest.mark.parametrize("own", [True, False], ids=["tokenizer", "inline"])
def test_bos_is_added_once(template, text, own):
    """A template that writes BOS itself gets no second one; a template without BOS gets the tokenizer's."""
    tok = build_char_tokenizer("0123456789+=")
    tok.chat_template = template
    write_jsonl("a.jsonl", [{"prompt": "1+1="}])
    splits = mixed_dataset(mix_cfg([src("a.jsonl")], chat_template="tokenizer" if own else template), tok, 1)
    assert texts(splits.train) == [text]
    assert splits.train[0].token_ids == tuple(tok("1+1=")["input_ids"])
    assert splits.train[0].token_ids[0] == tok.bos_token_id


def test_tokenizer_template_and_its_inline_copy_agree_through_the_cache(tokenizer):
    """The tokenizer's own template and the same text inline share a cache entry, which holds the same ids."""
    own = build_char_tokenizer("0123456789+=")
    own.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    write_jsonl("a.jsonl", [{"prompt": "1+1="}])
    via_tokenizer = mixed_dataset(mix_cfg([src("a.jsonl")], chat_template="tokenizer"), own, 1)
    inline = mixed_dataset(mix_cfg([src("a.jsonl")], chat_template=own.chat_template), own, 1)
    assert (via_tokenizer.report["cache"], inline.report["cache"]) == ("miss", "hit")
    assert inline.train == via_tokenizer.train
    assert inline.train[0].token_ids == tuple(own("1+1=")["input_ids"])


# --- presets (hub datasets, read from local folders of the same shapes) -----------------------------

TLDR_POSTS = [
    "SUBREDDIT: r/cats\n\nTITLE: My cat sleeps all day\n\nPOST: Is this normal?\n\nTL;DR:",
    "SUBREDDIT: r/running\n\nTITLE: First 10k\n\nPOST: Finished in 55 minutes.\n\nTL;DR:",
    "SUBREDDIT: r/cooking\n\nTITLE: Burnt rice\n\nPOST: Too much heat.\n\nTL;DR:",
]


def tldr_row(post: str) -> dict:
    """A row shaped like trl-internal-testing/tldr-preference-sft-trl-style."""
    return {
        "prompt": post,
        "messages": [{"role": "user", "content": post}, {"role": "assistant", "content": " A short summary."}],
        "chosen": [{"role": "user", "content": post}, {"role": "assistant", "content": " Good summary."}],
        "rejected": [{"role": "user", "content": post}, {"role": "assistant", "content": " Bad summary."}],
    }


def no_robots_row(i: int, system: str | None, user: str, category: str) -> dict:
    """A row shaped like HuggingFaceH4/no_robots (the system turn is optional)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": "Reference answer."},
    ]
    return {"prompt": user, "prompt_id": f"id{i}", "messages": messages, "category": category}


def ultrafeedback_row(turns: list[str]) -> dict:
    """A row shaped like allenai/ultrafeedback_binarized_cleaned: alternating user/assistant turns, answer last."""
    history = [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(turns)]
    return {
        "prompt": turns[-1],
        "prompt_id": "p" + str(len(turns)),
        "chosen": history + [{"role": "assistant", "content": "Chosen answer."}],
        "rejected": history + [{"role": "assistant", "content": "Rejected answer."}],
        "messages": history + [{"role": "assistant", "content": "Chosen answer."}],
        "score_chosen": 8.0,
        "score_rejected": 3.5,
    }


def preset(name: str, folder: Path, tmp_path: Path):
    """The dataset node of `dataset=<name>` with its train/eval paths pointed at ``folder``, typed by its builder's
    class as the run builds it."""
    cfg = compose_config(
        [
            f"dataset={name}",
            f"dataset.train.0.path='{folder}'",
            f"dataset.eval.0.path='{folder}'",
            f"dataset.cache_dir='{tmp_path / 'cache'}'",
        ]
    )
    return typed_node("dataset", cfg.dataset, "dataset")


def test_tldr_preset(tokenizer, tmp_path):
    """dataset=tldr: the post itself is the prompt (simple_concat_with_space), summaries dropped, eval = validation."""
    folder = tmp_path / "tldr"
    write_jsonl(folder / "train.jsonl", [tldr_row(p) for p in TLDR_POSTS[:2]])
    write_jsonl(folder / "validation.jsonl", [tldr_row(TLDR_POSTS[2])])
    dataset = preset("tldr", folder, tmp_path)
    assert (dataset.name, dataset.sft_messages_key, dataset.chat_template) == ("mix", "messages", "simple_concat_with_space")
    assert [(s.split, s.amount) for s in (*dataset.train, *dataset.eval)] == [("train", 1.0), ("validation", 1.0)]
    splits = mixed_dataset(dataset, tokenizer, 1)
    assert splits.train[0].text == "SUBREDDIT: r/cats\n\nTITLE: My cat sleeps all day\n\nPOST: Is this normal?\n\nTL;DR:"
    assert texts(splits.train) == TLDR_POSTS[:2]
    assert texts(splits.eval) == TLDR_POSTS[2:]
    assert splits.train[0].token_ids == tuple(tokenizer(TLDR_POSTS[0])["input_ids"])
    assert splits.train[0].token_ids[0] == tokenizer.bos_token_id


def test_no_robots_preset(tokenizer, tmp_path):
    """dataset=no_robots: tulu markers, the optional system turn kept, the reference answer dropped, eval = test."""
    folder = tmp_path / "no_robots"
    write_jsonl(
        folder / "train.jsonl",
        [
            no_robots_row(0, "You are a poet.", "Write a haiku about rain.", "Generation"),
            no_robots_row(1, None, "Name a fruit.", "Brainstorm"),
        ],
    )
    write_jsonl(folder / "test.jsonl", [no_robots_row(2, None, "Summarise: sun.", "Summarize")])
    dataset = preset("no_robots", folder, tmp_path)
    assert (dataset.sft_messages_key, dataset.chat_template, dataset.eval[0].split) == ("messages", "tulu", "test")
    splits = mixed_dataset(dataset, tokenizer, 1)
    assert splits.train[0].text == "<|system|>\nYou are a poet.\n<|user|>\nWrite a haiku about rain.\n<|assistant|>\n"
    assert texts(splits.train)[1:] == ["<|user|>\nName a fruit.\n<|assistant|>\n"]
    assert texts(splits.eval) == ["<|user|>\nSummarise: sun.\n<|assistant|>\n"]
    assert source_reports(splits) == [(f"{folder}[train]", 2, 0, 0, 2), (f"{folder}[test]", 1, 0, 0, 1)]


def test_ultrafeedback_preset(tokenizer, tmp_path):
    """dataset=ultrafeedback: prompts from the `chosen` conversations of train_prefs / test_prefs, tulu markers."""
    folder = tmp_path / "ultrafeedback"
    write_parquet(
        folder / "data" / "train_prefs-00000-of-00001.parquet",
        [ultrafeedback_row(["What is 2+2?"]), ultrafeedback_row(["Hi.", "Hello!", "Count to 3."])],
    )
    write_parquet(folder / "data" / "test_prefs-00000-of-00001.parquet", [ultrafeedback_row(["Name a colour."])])
    dataset = preset("ultrafeedback", folder, tmp_path)
    assert (dataset.sft_messages_key, dataset.chat_template) == ("chosen", "tulu")
    assert (dataset.train[0].split, dataset.eval[0].split) == ("train_prefs", "test_prefs")
    splits = mixed_dataset(dataset, tokenizer, 1)
    assert texts(splits.train) == [
        "<|user|>\nWhat is 2+2?\n<|assistant|>\n",
        "<|user|>\nHi.\n<|assistant|>\nHello!<eos>\n<|user|>\nCount to 3.\n<|assistant|>\n",
    ]
    assert texts(splits.eval) == ["<|user|>\nName a colour.\n<|assistant|>\n"]
    assert splits.train[1].token_ids.count(tokenizer.eos_token_id) == 1  # the earlier answer's EOS is a real token


def test_preset_max_prompt_length_drops_long_prompts(tokenizer, tmp_path):
    """A preset with a lowered max_prompt_length counts the long posts it drops."""
    folder = tmp_path / "tldr"
    write_jsonl(folder / "train.jsonl", [tldr_row(p) for p in TLDR_POSTS])
    write_jsonl(folder / "validation.jsonl", [tldr_row(TLDR_POSTS[0])])
    dataset = preset("tldr", folder, tmp_path)
    dataset.max_prompt_length = len(tokenizer(TLDR_POSTS[2])["input_ids"])
    splits = mixed_dataset(dataset, tokenizer, 1)
    assert texts(splits.train) == [TLDR_POSTS[2]]
    assert [(r["too_long"], r["kept"]) for r in splits.report["sources"]] == [(2, 1), (1, 0)]
