"""`logging.wandb=true`: the same metrics, the composed config and the sample tables reach a W&B run (offline here)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import rlhf.train
from rlhf.config import ConfigError, validate
from rlhf.config.compose import compose_config
from rlhf.config.schema import LoggingConfig
from rlhf.tracking import checks
from rlhf.tracking.tracker import Tracker
from rlhf.train import train

wandb = pytest.importorskip("wandb")
import wandb_records  # noqa: E402  (the reader of .wandb files beside this test; needs wandb's protobufs)

TINY = ["train.num_steps=2", "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=4",
        "train.micro_batch_size=16", "eval.max_prompts=4", "eval.num_samples=1", "eval.greedy=false",
        "logging.tensorboard=false", "logging.sample_every=1", "checkpoint.save_final_model=false"]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B in offline mode, writing under the test's folder, never prompting."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield tmp_path
    assert wandb.run is None, "the tracker left a W&B run open"


def run_file(folder: Path) -> Path:
    files = list((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0]


def wandb_children() -> list[str]:
    ps = subprocess.run(["ps", "--ppid", str(os.getpid()), "-o", "cmd="], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "wandb" in line]


def test_a_run_logs_its_metrics_config_and_sample_tables_to_wandb(offline):
    out = offline / "run"
    train(compose_config([*TINY, "logging.wandb=true", "logging.wandb_project=tests"]), out)
    path = run_file(out)
    history = wandb_records.history(path)
    logged_each_step = set(history[1]) & set(history[2])
    assert {"objective/scores", "objective/kl", "loss/policy_avg", "time/step"} <= logged_each_step
    assert "eval/sampled_correct_rate" in history[0] and "eval/sampled_correct_rate" in history[2]
    assert history[1]["samples/_type"] == "table-file" and history[1]["samples/nrows"] == 4
    assert list((path.parent / "files" / "media" / "table").glob("samples_1_*.table.json"))
    config = wandb_records.config(path)
    assert config["train"]["prompts_per_step"] == 4 and config["logging"]["wandb"] is True
    assert config["derived_sizes"]["samples_per_step"] == 16
    assert wandb_records.exit_code(path) == 0
    assert not wandb_children(), "wandb's service process outlived the run"


def test_the_run_name_defaults_to_the_run_folder_and_wandb_mode_overrides_the_environment(offline, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")  # logging.wandb_mode=offline wins: no network, no login
    cfg = OmegaConf.merge(OmegaConf.structured(LoggingConfig), {"wandb": True, "wandb_mode": "offline"})
    with Tracker(offline / "my_run", tensorboard=False, settings=cfg) as tracker:
        assert tracker.wandb.run.name == "my_run" and tracker.wandb.run.settings.mode == "offline"


def test_an_error_finishes_the_wandb_run_as_failed(offline):
    cfg = OmegaConf.merge(OmegaConf.structured(LoggingConfig), {"wandb": True})
    tracker = Tracker(offline / "run", tensorboard=False, settings=cfg)
    with pytest.raises(RuntimeError, match="boom"), tracker:
        tracker.log(1, {"objective/scores": 0.5})
        raise RuntimeError("boom")
    path = run_file(offline / "run")
    assert wandb_records.history(path)[1]["objective/scores"] == 0.5
    assert wandb_records.exit_code(path) == 1
    assert not wandb_children()


def test_missing_wandb_is_a_config_error_before_any_model_loads(tmp_path, monkeypatch):
    real = checks.importlib.util.find_spec
    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    monkeypatch.setattr(rlhf.train, "build_components", lambda *args, **kwargs: pytest.fail("models loaded before the check"))
    message = r"logging.wandb=true needs the wandb package: pip install 'rlhf\[wandb\]'"
    with pytest.raises(ConfigError, match=message):
        train(compose_config(["logging.wandb=true"]), tmp_path)


@pytest.mark.parametrize(
    ("override", "message"),
    [("logging.wandb_mode=cloud", r"logging.wandb_mode='cloud'; choose one of online, offline"),
     ("logging.progress_bar=sometimes", r"logging.progress_bar='sometimes'; choose one of auto, true, false")],
)
def test_unknown_choices_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config([override]))


def test_an_unreachable_wandb_server_is_a_config_error_before_any_model_loads(tmp_path, monkeypatch):
    """Online mode with W&B's server not answering (a closed port here): refused in seconds before the models load
    (before, about 100 s of wandb's retries after they had loaded, then exit 6). Offline mode is not checked."""
    import socket

    from rlhf.run.preflight import check_wandb

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    loaded = []
    monkeypatch.setattr("rlhf.train.build_components", lambda *a, **k: loaded.append(1))
    with pytest.raises(ConfigError, match=rf"logging.wandb=true: the W&B server http://127.0.0.1:{port} does not answer"):
        train(compose_config(["logging.wandb=true", "train.num_steps=1"]), tmp_path / "run")
    assert not loaded
    check_wandb(OmegaConf.merge(OmegaConf.structured(LoggingConfig), {"wandb": True, "wandb_mode": "offline"}))
