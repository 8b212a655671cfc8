"""`python -m rlhf.plan`: every experiment preset is planned, and the real command prints the plan and exits 0 or 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from published_configs import CONFIGS, write_config
from rlhf.config import compose_config
from rlhf.plan import make_plan, render

EXPERIMENTS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "experiment").glob("*.yaml"))
# a hub model of a preset -> the published architecture it has (the plan needs only its config.json)
ARCHITECTURES = {"qwen": "qwen2_5_0_5b", "pythia": "pythia_1b", "tulu": "llama_3_1_8b", "arith_rm": None}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("architectures")
    return {name: str(write_config(root / name, config)) for name, config in CONFIGS.items()}


def local_copy(name: str | None, folders: dict) -> str | None:
    """The published-config folder standing in for a preset's hub model (None: keep the preset's own)."""
    for marker, architecture in ARCHITECTURES.items():
        if name and marker in name.lower():
            return folders[architecture] if architecture else "builtin:tiny_arith"
    return None


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_preset_is_planned_from_config_json_alone(experiment, folders):
    cfg = compose_config([f"experiment={experiment}"])
    overrides = [f"{key}={local}" for key in ("model.name_or_path", "reward.path")
                 if (local := local_copy(OmegaConf.select(cfg, key), folders))]
    plan = make_plan(compose_config([f"experiment={experiment}", "cluster.device_memory_gb=80", *overrides]))
    text = render(plan)
    assert "policy" in text and "verdict:" in text
    assert ("teacher" in text) == bool(cfg.teacher.name_or_path)  # a distillation teacher is planned as its own role
    assert all(group.peak[0] > 0 for group in plan.groups)


def run_plan(*overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf.plan", *overrides], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.mark.slow
def test_the_cli_prints_the_8b_plan_and_exits_2_when_it_cannot_fit(folders):
    llama = folders["llama_3_1_8b"]
    base = ["experiment=ppo_tulu3_8b_ultrafeedback", f"model.name_or_path={llama}", f"reward.path={llama}"]
    fits = run_plan(*base, "cluster.device_memory_gb=80")
    assert fits.returncode == 0, fits.stderr
    assert "7 device(s) holding policy + reference + critic + reward" in fits.stdout and "verdict: fits" in fits.stdout
    too_small = run_plan(*base, "cluster.device_memory_gb=40")
    assert too_small.returncode == 2 and "verdict: does NOT fit" in too_small.stdout
    assert "Traceback" not in too_small.stdout + too_small.stderr


@pytest.mark.slow
def test_the_cli_names_a_model_it_cannot_find_in_one_paragraph(tmp_path):
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub")}
    proc = run_plan("algorithm=ppo", "model=tulu8b", env=offline)
    assert proc.returncode == 2
    assert "model.name_or_path=allenai/Llama-3.1-Tulu-3-8B-SFT" in proc.stderr and "Traceback" not in proc.stderr
    assert len((proc.stdout + proc.stderr).strip().splitlines()) <= 3
    bad_key = run_plan("train.no_such_key=1")
    assert bad_key.returncode == 2 and "train.no_such_key" in bad_key.stderr and "Traceback" not in bad_key.stderr


@pytest.mark.parametrize(("overrides", "message"), [
    (["policy.lora.rank=4", "policy.lora.target_modules=[nope]"], "policy.lora.target_modules: ['nope'] match no linear layer"),
    (["policy.lora.rank=4096"], "policy.lora.rank=4096 is past the width of the adapted layer"),
    (["algorithm=ppo", "critic.lora.rank=4", "critic.lora.target_modules=[nope]"], "critic.lora.target_modules: ['nope']"),
])
def test_the_plan_refuses_the_layers_the_run_would_refuse(overrides, message, capsys):
    """LoRA targets the model lacks: the run refuses them before loading, and the plan said "fits" (it planned no
    adapters at all). In process: `rlhf.plan.__main__.main`, what `python -m rlhf.plan` runs."""
    from rlhf.plan.__main__ import main

    assert main(overrides) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and message in err
