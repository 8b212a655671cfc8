"""End-to-end runs of `python -m rlhf.train` on reasoning tasks with the built-in tiny model.

`dataset=reasoning_gym` generates its problems locally; `dataset=gsm8k` reads files with the hub set's columns
(the hub is not reachable in tests). The tiny model's tokenizer maps letters to <unk>, which is fine for a few
training steps: what is checked is that prompts, ground truths and the verifiers meet.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from run_records import records
from test_cli import run_cli
from test_datasets_cli import local_env

pytestmark = pytest.mark.slow

SHORT_RUN = ["train.num_steps=2", "train.prompts_per_step=4", "eval.num_samples=1", "eval.every=0", "logging.log_every=1"]


def generations(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "eval_generations.jsonl").read_text().splitlines()]


def test_reasoning_gym_run_scores_with_the_tasks_own_check(tmp_path, long_model_dir):
    out = tmp_path / "run"
    run_cli(
        f"model.name_or_path={long_model_dir}",  # chain_sum prompts pass the built-in model's 64 positions
        "dataset=reasoning_gym", "dataset.tasks=[basic_arithmetic,chain_sum]", "reward=reasoning_gym",
        "reward.functions.0.args.answer_tag=null",  # the tiny model answers with bare digits, no tags
        "dataset.prompt_suffix=null", "dataset.chat_template=simple_concat_with_space", "dataset.max_prompt_length=160",
        "dataset.train_size=16", "dataset.eval_size=2", *SHORT_RUN, f"hydra.run.dir={out}",
        cwd=tmp_path, env_extra=local_env(tmp_path),
    )
    report = json.loads((out / "dataset_report.json").read_text())
    assert [(r["source"], r["role"], r["rows"]) for r in report["sources"]] == [
        ("reasoning_gym:basic_arithmetic", "train", 16), ("reasoning_gym:basic_arithmetic", "eval", 2),
        ("reasoning_gym:chain_sum", "train", 16), ("reasoning_gym:chain_sum", "eval", 2),
    ]
    last = records(out)[2]
    for key in ("reward/reasoning_gym", "reward/reasoning_gym_no_answer_rate", "objective/verifiable_correct_rate"):
        assert 0 <= last[key] <= 1, (key, last)
    prompts = {g["prompt"] for g in generations(out)}
    assert len(prompts) == 4 and any(p.startswith("Calculate") for p in prompts)


def test_gsm8k_preset_on_local_files(tmp_path):
    """dataset=gsm8k with its sources pointed at Parquet files shaped like openai/gsm8k, scored by reward=math."""
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    rows = [
        {"question": f"Ann has {a} pens and buys {b}. How many?", "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
        for a in range(4) for b in range(4)
    ]
    rows.append({"question": "A farm sells 1,000 eggs twice.", "answer": "1,000 * 2 = 2,000\n#### 2,000"})
    pq.write_table(pa.Table.from_pylist(rows[:-3]), str(folder / "train-00000-of-00001.parquet"))
    pq.write_table(pa.Table.from_pylist(rows[-3:]), str(folder / "test-00000-of-00001.parquet"))
    out = tmp_path / "run"
    run_cli(
        "dataset=gsm8k", f"dataset.train.0.path={folder}", f"dataset.eval.0.path={folder}", "reward=math",
        "dataset.prompt_suffix=null", "dataset.chat_template=simple_concat_with_space", "dataset.max_prompt_length=60",
        f"dataset.cache_dir={tmp_path / 'cache'}", *SHORT_RUN, f"hydra.run.dir={out}",
        cwd=tmp_path, env_extra=local_env(tmp_path),
    )
    report = json.loads((out / "dataset_report.json").read_text())
    assert [(r["role"], r["kept"], r["bad_rows"]) for r in report["sources"]] == [("train", 14, 0), ("eval", 3, 0)]
    assert {g["prompt"] for g in generations(out)} == {row["question"] for row in rows[-3:]}
    last = records(out)[2]
    assert 0 <= last["reward/math_verify"] <= 1 and 0 <= last["objective/verifiable_correct_rate"] <= 1
