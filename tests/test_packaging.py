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
