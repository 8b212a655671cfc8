"""`+key=value` cannot add keys to the schema: a key the schema does not declare is refused before any model loads,
naming it and the closest real key; free-form fields (`dict[str, Any]`, e.g. reward function args) take any key.
That every preset passes is covered by tests/config/test_config.py, which validates each one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlhf.config import ConfigError, compose_config, validate
from rlhf.config.unknown_keys import check_unknown_keys


def test_an_added_typo_key_is_refused_with_the_closest_key():
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["+train.num_stepz=5"]))
    assert "train.num_stepz is not a config key (added with +?); did you mean train.num_steps?" in str(err.value)


@pytest.mark.parametrize(
    ("override", "named", "suggested"),
    [
        ("+num_steps=5", "num_steps", "train.num_steps"),  # right name, wrong section
        ("+trian.num_steps=5", "trian.num_steps", "train.num_steps"),  # the key typed, the section put right
        ("+reward.functions.0.argz.x=1", "reward.functions[0].argz.x", "reward.functions[0].args"),  # inside a list: its section
    ],
)
def test_the_message_names_the_key_and_suggests_one(override, named, suggested):
    with pytest.raises(ConfigError, match="not a config key") as err:
        check_unknown_keys(compose_config([override]))
    assert f"{named} is not a config key" in str(err.value) and f"did you mean {suggested}?" in str(err.value)


def test_a_key_without_a_close_match_says_to_remove_it():
    with pytest.raises(ConfigError, match=r"zzqqxx is not a config key .*remove it"):
        check_unknown_keys(compose_config(["+zzqqxx=1"]))


def test_free_form_args_take_any_key_the_function_takes(tmp_path, monkeypatch):
    """reward.functions[i].args is `dict[str, Any]`: keys below it, nested too, are the function's business. One with
    `**kwargs` takes them all; a built-in whose catch-all is `**_` takes only its parameters (arith_correct: none)."""
    (tmp_path / "kw_reward.py").write_text("def scored(prompts, responses, ground_truths, **kwargs):\n    return [0.0] * len(responses)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["+reward.functions.0.args.tolerance=0.5", "+reward.functions.0.args.extra.depth=2"]
    cfg = compose_config(["reward.functions.0.name=kw_reward.scored", *args])
    validate(cfg)
    assert cfg.reward.functions[0].args.extra.depth == 2
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].args.tolerance: reward function arith_correct takes no args"):
        validate(compose_config(args))


@pytest.mark.slow
def test_cli_refuses_an_added_key_with_exit_2_and_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "+train.num_stepz=5", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "train.num_stepz is not a config key (added with +?); did you mean train.num_steps?" in output
    assert "Traceback" not in output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
