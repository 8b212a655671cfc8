"""End-to-end runs of `python -m rlhf.train` on local prompt files (dataset=jsonl / dataset=parquet).

The files hold the built-in task's prompts (`3+4=` -> `7`) plus bad and over-long rows, so the shipped
tiny model can train on them while the dataset report, eval generations, cache and strict mode are checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_cli import run_cli, scalars, text_tags

pytestmark = pytest.mark.slow

GOOD = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
# Rows 50..53 of the JSON Lines file: a non-string prompt, a missing prompt, an empty prompt, a missing answer.
BAD_JSONL = [{"prompt": 5, "answer": "5"}, {"answer": "3"}, {"prompt": "", "answer": "0"}, {"prompt": "1+1="}]
# Parquet columns have one type each: a null prompt, an empty prompt, a null answer.
BAD_PARQUET = [{"prompt": None, "answer": "3"}, {"prompt": "", "answer": "0"}, {"prompt": "1+1=", "answer": None}]
# 16 characters + BOS = 17 tokens > dataset.max_prompt_length=16.
TOO_LONG = [{"prompt": "1+2+3+4+5+6+7+8=", "answer": "36"}, {"prompt": "9+9+9+9+9+9+9+9=", "answer": "72"}]

EVAL_PROMPTS = 5  # eval_holdout 0.05 of the 100 kept prompts
EVAL_SAMPLES = 4  # eval.num_samples


def rows_with(bad: list[dict]) -> list[dict]:
    """The 100 addition problems with ``bad`` rows after the first 50 and the over-long rows at the end."""
    return GOOD[:50] + bad + GOOD[50:] + TOO_LONG


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """Write ``rows`` as JSON Lines."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dataset_args(preset: str, path: Path, tmp_path: Path) -> list[str]:
    """The overrides that train on the prompt file ``path``, with the tokenised cache under ``tmp_path``."""
    return [
        f"dataset={preset}",
        f"dataset.path={path}",
        "dataset.chat_template=simple_concat_with_space",
        "dataset.ground_truth_key=answer",
        "dataset.max_prompt_length=16",
        f"dataset.cache_dir={tmp_path / 'dataset_cache'}",
    ]


def local_env(tmp_path: Path) -> dict[str, str]:
    """Keep `datasets`' cache in the test folder and the hub switched off."""
    return {
        "HF_DATASETS_CACHE": str(tmp_path / "hf_cache"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",  # a tiny model gains nothing from threads, and they thrash on a busy machine
    }


def train(tmp_path: Path, out: Path, *overrides: str, check: bool = True):
    """A 20-step run with two evaluations (at steps 0, 10, 20) in folder ``out``."""
    return run_cli(
        *overrides, "eval.num_evals=2", "eval.every=0", "train.num_steps=20", f"hydra.run.dir={out}",
        cwd=tmp_path, env_extra=local_env(tmp_path), check=check,
    )


def check_eval_outputs(out: Path) -> None:
    """eval_generations.jsonl and TensorBoard hold the three evaluations, greedy and sampled."""
    generations = [json.loads(line) for line in (out / "eval_generations.jsonl").read_text().splitlines()]
    counts = {}
    for g in generations:
        assert set(g) == {"step", "mode", "prompt", "response", "score"}
        assert isinstance(g["prompt"], str) and isinstance(g["response"], str) and isinstance(g["score"], float)
        counts[(g["step"], g["mode"])] = counts.get((g["step"], g["mode"]), 0) + 1
    assert counts == {
        (step, mode): EVAL_PROMPTS * (1 if mode == "greedy" else EVAL_SAMPLES)
        for step in (0, 10, 20)
        for mode in ("greedy", "sampled")
    }
    eval_prompts = {g["prompt"] for g in generations}
    assert len(eval_prompts) == EVAL_PROMPTS and eval_prompts <= {row["prompt"] for row in GOOD}
    series = scalars(out)
    assert [step for step, _ in series["eval/sampled_correct_rate"]] == [0, 10, 20]
    assert [step for step, _ in series["eval/greedy_correct_rate"]] == [0, 10, 20]
    tags = text_tags(out)
    assert "eval_samples/greedy/text_summary" in tags and "eval_samples/sampled/text_summary" in tags, tags


def test_jsonl_run_reports_bad_rows_and_uses_the_cache(tmp_path):
    """dataset=jsonl: the run finishes, reports bad and too-long rows, evaluates 3 times; a rerun is a cache hit."""
    path = write_jsonl(tmp_path / "prompts.jsonl", rows_with(BAD_JSONL))
    out = tmp_path / "run"
    proc = train(tmp_path, out, *dataset_args("jsonl", path, tmp_path))
    report = json.loads((out / "dataset_report.json").read_text())
    assert report == {
        "sources": [
            {
                "role": "train",
                "source": f"{path}[train]",
                "split": "train",
                "rows": 106,
                "bad_rows": 4,
                "too_long": 2,
                "kept": 100,
                "bad_examples": [  # after the 50 good lines
                    f"{path} line 51: column 'prompt': expected a string, got int",
                    f"{path} line 52: column 'prompt': missing",
                    f"{path} line 53: column 'prompt': empty prompt",
                ],
            }
        ],
        "cache": "miss",
    }
    log = proc.stdout + proc.stderr
    assert f"{path}[train]: 106 rows, 4 bad, 2 longer than max_prompt_length, 100 kept" in log
    assert "95 train prompts, 5 eval prompts" in log
    check_eval_outputs(out)

    again = tmp_path / "run2"
    proc = run_cli(
        *dataset_args("jsonl", path, tmp_path), "train.num_steps=1", "eval.num_samples=1", f"hydra.run.dir={again}",
        cwd=tmp_path, env_extra=local_env(tmp_path),
    )
    assert "dataset cache hit" in proc.stdout + proc.stderr
    assert json.loads((again / "dataset_report.json").read_text()) == report | {"cache": "hit"}


def test_parquet_run(tmp_path):
    """dataset=parquet: the same run from a Parquet file, with its null and empty cells counted as bad rows."""
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(rows_with(BAD_PARQUET)), str(path))
    out = tmp_path / "run"
    train(tmp_path, out, *dataset_args("parquet", path, tmp_path))
    (source,) = json.loads((out / "dataset_report.json").read_text())["sources"]
    assert (source["source"], source["rows"], source["bad_rows"], source["too_long"], source["kept"]) == (
        f"{path}[train]", 105, 3, 2, 100,
    )
    assert source["bad_examples"] == [
        f"{path} row 51: column 'prompt': missing",
        f"{path} row 52: column 'prompt': empty prompt",
        f"{path} row 53: column 'answer': missing",
    ]
    check_eval_outputs(out)


def test_strict_bad_row_exits_with_code_2(tmp_path):
    """dataset.strict=true on the file with bad rows stops before training, naming the line and the column."""
    path = write_jsonl(tmp_path / "prompts.jsonl", rows_with(BAD_JSONL))
    out = tmp_path / "run"
    proc = train(tmp_path, out, *dataset_args("jsonl", path, tmp_path), "dataset.strict=true", check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert (
        f"config error: dataset.path: {path} line 51: column 'prompt': expected a string, got int; set "
        "dataset.prompt_key to" in log
    )
    assert not (out / "eval_generations.jsonl").exists() and not (out / "dataset_report.json").exists()


def test_a_verifier_without_ground_truths_fails_before_models_load(tmp_path):
    """The default reward checks answers; a dataset with no ground_truth_key must say so up front."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1="}) + "\n" for a in range(5)))
    proc = run_cli(
        "dataset=jsonl", f"dataset.path={data}", "dataset.chat_template=simple_concat_with_space",
        f"dataset.cache_dir={tmp_path / 'cache'}", "train.num_steps=1", cwd=tmp_path, check=False,
    )
    assert proc.returncode == 2
    assert "set dataset.ground_truth_key=<column>" in proc.stdout + proc.stderr
