"""The built wheel carries every module, `conf/` (as rlhf.conf) and the built-in model, so it works when installed."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_contains_configs_and_builtin_model(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("rlhf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected_conf = {f"rlhf/conf/{p.relative_to(ROOT / 'conf')}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert expected_conf <= names, sorted(expected_conf - names)
    assert "rlhf/assets/tiny_arith/model.safetensors" in names
    assert "rlhf/assets/tiny_arith/tokenizer.json" in names
    modules = {f"rlhf/{p.relative_to(ROOT / 'src' / 'rlhf')}" for p in (ROOT / "src" / "rlhf").rglob("*.py")}
    assert modules <= names, f"modules missing from the wheel (a package without __init__.py?): {sorted(modules - names)}"
    assert "rlhf/examples/agents/arith_retry.py" in names  # experiment=agent_tiny's env.path=builtin:agents/arith_retry.py


def test_configs_compose_without_the_optional_stacks():
    """A machine without the agent endpoint's web stack (FastAPI, uvicorn) or the distributed engines (such as the
    GPU machine the figures in bench/GPU.md come from) still composes and checks configs: those load only when used."""
    code = (
        "import sys\n"
        "for name in ('fastapi', 'uvicorn', 'ray', 'deepspeed', 'vllm'): sys.modules[name] = None\n"
        "from rlhf.config import compose_config\n"
        "cfg = compose_config(['algorithm=grpo'])\n"
        "print(cfg.algorithm.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("grpo")
