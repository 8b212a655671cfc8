"""Resuming with a changed config: each checkpoint records the config its step ran with; a resume lists every
changed key, refuses changes that break exact resume (seed, batch sizes, algorithm.*) unless
`checkpoint.allow_config_change=true`, and refuses a `train.num_steps` below the checkpoint's step."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from rlhf.run.checkpoint import CONFIG_FILE, complete_checkpoints
from rlhf.config import ConfigError, compose_config, validate
from rlhf.train import train

SMALL = [
    "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=2", "eval.num_samples=0", "eval.greedy=false",
    "logging.tensorboard=false", "checkpoint.every=2", "checkpoint.keep_last=0",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run folder with a checkpoint at step 2 (built once; tests work on copies)."""
    out = tmp_path_factory.mktemp("trained")
    train(compose_config([*SMALL, "train.num_steps=2", "checkpoint.save_final_model=false"]), out)
    return out


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
    return tmp_path


def recorded(run_dir: Path, step: int) -> dict:
    return yaml.safe_load((run_dir / "checkpoints" / f"step_{step:08d}" / CONFIG_FILE).read_text())


def test_a_checkpoint_records_the_resolved_config_its_step_ran_with(trained):
    config = recorded(trained, 2)
    assert config["seed"] == 1 and config["train"]["prompts_per_step"] == 4 and config["train"]["num_steps"] == 2
    assert config["algorithm"]["num_samples_per_prompt"] == 2 and config["checkpoint"]["allow_config_change"] is False


@pytest.mark.parametrize(
    "change", ["seed=2", "train.prompts_per_step=2", "train.micro_batch_size=8", "algorithm.policy_loss.clip_eps_high=0.3"]
)
def test_a_change_that_breaks_exact_resume_is_refused_naming_the_key(run_dir, change, monkeypatch):
    monkeypatch.setattr("rlhf.train.build_components", lambda *a, **k: pytest.fail("a model loaded before the refusal"))
    key, value = change.split("=")
    with pytest.raises(ConfigError, match="checkpoint.allow_config_change=true") as err:
        train(compose_config([*SMALL, "train.num_steps=4", "resume=auto", change]), run_dir)
    assert f"{key}: " in str(err.value) and f"-> {value}" in str(err.value)
    assert "since step 2" in str(err.value)


def test_allow_config_change_resumes_with_the_new_values_and_keeps_the_old_record(run_dir, caplog):
    change = "algorithm.policy_loss.clip_eps_high=0.3"
    cfg = compose_config([*SMALL, "train.num_steps=4", "resume=auto", change, "checkpoint.allow_config_change=true"])
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        state = train(cfg, run_dir)
    assert state.step == 4
    assert "continuing with algorithm.policy_loss.clip_eps_high: 0.2 -> 0.3" in caplog.text
    assert recorded(run_dir, 2)["algorithm"]["policy_loss"]["clip_eps_high"] == 0.2, "the config step 2 ran with was rewritten"
    assert recorded(run_dir, 4)["algorithm"]["policy_loss"]["clip_eps_high"] == 0.3


def test_other_changes_are_listed_and_the_run_resumes(run_dir, caplog):
    cfg = compose_config([*SMALL, "train.num_steps=4", "resume=auto", "logging.sample_every=3"])
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        state = train(cfg, run_dir)
    assert state.step == 4
    listed = next(r.getMessage() for r in caplog.records if "keys differ" in r.getMessage())
    assert "logging.sample_every: 10 -> 3" in listed and "train.num_steps: 2 -> 4" in listed
    assert "resume:" not in listed.split("):", 1)[1], "the resume key itself is not a change"
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == ["step_00000002", "step_00000004"]
    assert recorded(run_dir, 2)["logging"]["sample_every"] == 10
    assert recorded(run_dir, 4)["logging"]["sample_every"] == 3


def test_num_steps_below_the_checkpoint_step_is_a_config_error_not_an_export(run_dir):
    with pytest.raises(ConfigError, match=r"train.num_steps=1 is below step 2 of the checkpoint"):
        train(compose_config([*SMALL, "train.num_steps=1", "resume=auto"]), run_dir)
    assert not (run_dir / "final_model").exists()


def test_a_checkpoint_without_a_recorded_config_resumes_with_a_warning(run_dir, caplog):
    (run_dir / "checkpoints" / "step_00000002" / CONFIG_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        state = train(compose_config([*SMALL, "train.num_steps=3", "resume=auto", "train.micro_batch_size=8"]), run_dir)
    assert state.step == 3
    assert "records no config" in caplog.text


def test_a_fresh_start_sets_an_earlier_runs_records_aside_instead_of_appending(tmp_path, caplog):
    """A run killed before its first checkpoint, started again with `resume=auto` in the same folder: the new run's
    records hold its own steps only; the dead run's move to previous_run_1/ (before, both were appended together:
    a 30-step run's metrics.jsonl held 42 train rows)."""
    from rlhf.tracking.tracker import Tracker

    run = tmp_path / "run"
    dead = Tracker(run, tensorboard=True)
    for step in (1, 2, 3):
        dead.log(step, {"objective/scores": 0.5})
    dead.close()
    (run / "prompts.jsonl").write_text('{"step": 1, "prompts": [0]}\n')
    fresh = Tracker(run, tensorboard=True)  # resume=auto found no checkpoint: resume_step None
    fresh.log(1, {"objective/scores": 0.7})
    fresh.close()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["objective/scores"] for r in rows if "objective/scores" in r] == [0.7]
    aside = run / "previous_run_1"
    assert len((aside / "metrics.jsonl").read_text().splitlines()) == 3 and (aside / "prompts.jsonl").is_file()
    assert (aside / "tensorboard").is_dir() and not (run / "prompts.jsonl").exists()
    assert "a fresh start in" in caplog.text and "previous_run_1" in caplog.text
    Tracker(run, tensorboard=False).close()  # another fresh start: the next free folder
    assert (run / "previous_run_2" / "metrics.jsonl").is_file()


def test_a_fresh_start_in_a_folder_holding_checkpoints_is_refused_before_any_model_loads(run_dir, monkeypatch):
    """Before, resume=null in such a folder trained, moved the old records aside and deleted the old checkpoints at
    its first save ("it belongs to the run that was resumed from an earlier step")."""
    monkeypatch.setattr("rlhf.train.build_components", lambda *a, **k: pytest.fail("a model loaded before the refusal"))
    with pytest.raises(ConfigError, match=r"resume=null starts a fresh run, but .*step_00000002.*resume=auto"):
        train(compose_config([*SMALL, "train.num_steps=4"]), run_dir)
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == ["step_00000002"]


@pytest.mark.parametrize("change", ["model.name_or_path=builtin:tiny_count", "reference.name_or_path=builtin:tiny_count", "dataset.max_operand=5"])
def test_another_model_lora_setting_or_dataset_is_refused_like_the_batch_keys(run_dir, change, monkeypatch):
    """Before, these were only listed: a resume onto another model (or reference) trained against another KL
    reference, and another dataset failed once the models had loaded."""
    monkeypatch.setattr("rlhf.train.build_components", lambda *a, **k: pytest.fail("a model loaded before the refusal"))
    with pytest.raises(ConfigError, match=rf"^resume from .*{change.split('=')[0]}: .*-> .*checkpoint.allow_config_change=true"):
        train(compose_config([*SMALL, "train.num_steps=4", "resume=auto", change]), run_dir)


def test_allow_config_change_with_another_dataset_starts_the_prompt_stream_over(run_dir, caplog):
    """Before, checkpoint.allow_config_change=true passed the config check and the run then failed on the prompt
    stream's size, after the models had loaded."""
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        state = train(compose_config([*SMALL, "train.num_steps=3", "resume=auto", "dataset.max_operand=5",
                                      "checkpoint.allow_config_change=true"]), run_dir)
    assert state.step == 3
    assert "the prompt stream starts over" in caplog.text


def test_a_sweep_job_whose_swept_value_moved_is_refused(run_dir, caplog):
    """Re-launching `--multirun train.lr=1e-3,3e-3 resume=auto` as `train.lr=5e-4,1e-3,3e-3`: job 0 (now 5e-4) found
    job 0's checkpoint (trained at 1e-3) and resumed it with a warning only. A key the sweep varies must match."""
    from rlhf.run.preflight import check_resume

    path = run_dir / "checkpoints" / "step_00000002"
    cfg = compose_config([*SMALL, "train.num_steps=4", "resume=auto", "train.lr=5e-4"])
    with pytest.raises(ConfigError, match=r"^resume from .* in a sweep: this job's swept train.lr: .* -> 0.0005 differs .* new hydra.sweep.dir"):
        check_resume(validate(cfg), path, swept={"train.lr"})
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        check_resume(validate(cfg), path, swept={"seed"})  # swept, but not changed; the changed lr is listed only
    assert "train.lr" in caplog.text
    grouped = compose_config([*SMALL, "train.num_steps=4", "resume=auto", "dataset.max_operand=5", "checkpoint.allow_config_change=true"])
    with pytest.raises(ConfigError, match=r"in a sweep: this job's swept dataset.max_operand: 9 -> 5"):
        check_resume(validate(grouped), path, swept={"dataset"})  # `dataset=a,b`: the keys under the group



def test_dataset_keys_that_leave_the_training_prompts_as_they_were_do_not_break_exact_resume():
    from rlhf.run.preflight import breaks_exact_resume

    for free in ("dataset.cache_dir", "dataset.strict", "dataset.eval"):  # the cache, bad-row handling, eval sources
        assert not breaks_exact_resume(free)
    for breaking in ("dataset.path", "dataset.train", "dataset.eval_holdout", "dataset.prompt_key", "dataset.max_operand"):
        assert breaks_exact_resume(breaking)


@pytest.mark.parametrize("change", ["policy.lora.alpha=32", "policy.lora.target_modules=[q_proj,v_proj]"])
def test_other_lora_settings_are_refused_like_the_batch_keys(tmp_path, change, monkeypatch):
    """Another alpha rescales the adapters (the resumed policy is not the checkpointed one); other target modules
    failed once the models had loaded."""
    lora = ["policy.lora.rank=4", "train.num_steps=2", "checkpoint.save_final_model=false"]
    train(compose_config([*SMALL, *lora]), tmp_path)
    monkeypatch.setattr("rlhf.train.build_components", lambda *a, **k: pytest.fail("a model loaded before the refusal"))
    with pytest.raises(ConfigError, match=rf"^resume from .*{change.split('=')[0]}: .*-> .*checkpoint.allow_config_change=true"):
        train(compose_config([*SMALL, *lora, "train.num_steps=4", "resume=auto", change]), tmp_path)
