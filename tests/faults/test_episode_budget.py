"""An episode longer than the model's context is refused before any model loads, naming `env.max_tokens` and the
context (before, an agent that never ended gave 215-token rows on the 64-position model, trained without a word)."""

from __future__ import annotations

import pytest

from rlhf.config import ConfigError, compose_config
from rlhf.data.context import check_episode_budget
from rlhf.train import train

AGENT = '''
def step(state, action, label=None, **_):
    return {"observation": " again", "reward": 0.0, "done": False}
'''


def test_an_episode_budget_past_the_context_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    (tmp_path / "endless_agent.py").write_text(AGENT)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "1+1=", "label": "2"}\n' * 8)
    loaded = []
    monkeypatch.setattr("rlhf.run.build.build_local_models", lambda *a, **k: loaded.append(1))
    cfg = compose_config([
        "env=agent_func", f"env.path={tmp_path / 'endless_agent.py'}", "env.max_turns=30", "dataset=jsonl",
        f"dataset.path={tasks}", "dataset.ground_truth_key=label", "dataset.chat_template='{{ messages[0].content }}'",
        "dataset.max_prompt_length=16",
    ])
    with pytest.raises(ConfigError, match=r"env.max_tokens=256 is longer than the 64-token context of "
                                          r"model.name_or_path=builtin:tiny_arith; set env.max_tokens<=64"):
        train(cfg, tmp_path / "run")
    assert not loaded


def test_the_episode_budget_check_itself():
    check_episode_budget(64, 64, "m")  # exactly the context: fine
    check_episode_budget(4096, None, "m")  # a model that declares no context: not checked
    with pytest.raises(ConfigError, match=r"env.max_tokens=65 is longer than the 64-token context of model.name_or_path=m"):
        check_episode_budget(65, 64, "m")
