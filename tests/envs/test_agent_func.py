"""`agent_func` environments: step functions written to files here, loaded from their path, run turn by turn."""

from __future__ import annotations

from dataclasses import fields

import asyncio
import pickle
import textwrap

import pytest
import torch

from rlhf import registry
from rlhf.data.prompts import PromptExample
from rlhf.envs.agent_func import AgentFuncConfig, AgentFuncMaker
from rlhf.envs.base import EnvConfig, EnvError, check_step
from rlhf.errors import ConfigError

TASK = PromptExample(text="2+2=", token_ids=(), ground_truth="4")

# OpenRLHF's agent-function shape: next_state extends state + action with the feedback
RETRY = """
async def step(state, action, label, **kw):
    if action.strip() == label:
        return 1.0, state + action + " Correct.", True, {"success": True}
    return 0.0, state + action + " Wrong, try again: ", False, {}
"""


def maker_for(tmp_path, source: str, name: str = "agent.py") -> AgentFuncMaker:
    """An agent_func maker of a file holding ``source``."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return AgentFuncMaker(cfg=AgentFuncConfig(name="agent_func", path=str(path)))


def play(env, actions: list[str], seed: int = 0) -> list:
    """[reset's answer, then each step's answer], run on one event loop."""

    async def episode():
        answers = [await env.reset(seed)]
        for action in actions:
            answers.append(await env.step(action))
        return answers

    return asyncio.run(episode())


def test_registered_with_its_keys():
    assert registry.resolve("env", "agent_func") is AgentFuncMaker
    assert AgentFuncMaker.config is AgentFuncConfig and AgentFuncMaker.uses_dataset is True
    assert {f.name for f in fields(AgentFuncConfig)} - {f.name for f in fields(EnvConfig)} == {"path"}


def test_observation_is_what_next_state_appends(tmp_path):
    answers = play(maker_for(tmp_path, RETRY).make(TASK), ["5", "4"])
    assert answers == [
        ("2+2=", {}),
        (" Wrong, try again: ", 0.0, False, False, {}),
        (" Correct.", 1.0, True, False, {"success": True}),
    ]


def test_reset_extra_observation_tensor_reward_and_offered_keywords(tmp_path):
    """reset rewrites the prompt; extra["observation"] names the text; turn and seed reach a function taking them."""
    source = """
    import torch

    async def reset(state, label, seed):
        return f"[{seed}] " + state

    async def step(state, action, label, turn):
        return torch.tensor([0.5]), action, turn == 1, {"observation": f" turn {turn} done"}
    """
    answers = play(maker_for(tmp_path, source).make(TASK), ["a", "b"], seed=9)
    assert answers[0] == ("[9] 2+2=", {})
    assert answers[1][0] == " turn 0 done" and answers[1][2:] == (False, False, {})
    assert float(answers[2][1]) == 0.5 and answers[2][0] == " turn 1 done" and answers[2][2] is True


def test_plain_def_step_is_accepted(tmp_path):
    source = """
    def step(state, action, label):
        return 1.0, state + action + "!", True, {}
    """
    assert play(maker_for(tmp_path, source).make(TASK), ["4"])[1] == ("!", 1.0, True, False, {})


def test_next_state_that_does_not_extend_the_conversation_is_an_env_error(tmp_path):
    source = """
    async def step(state, action, label):
        return 0.0, "something else", False, {}
    """
    with pytest.raises(EnvError, match=r"does not extend state \+ action; return extra\['observation'\]"):
        play(maker_for(tmp_path, source).make(TASK), ["4"])


@pytest.mark.parametrize("reward", ['"1"', "None", "float('nan')"])
def test_a_reward_that_is_not_a_finite_number_is_an_env_error_naming_it(tmp_path, reward):
    """Before: a str reward "1" trained as 1.0 (float() took it); openai_agent refuses it, and so does agent_func."""
    source = f"""
    async def step(state, action, label):
        return {reward}, state + action, True, {{}}
    """
    with pytest.raises(EnvError, match=r"agent_func step\(\) returned reward=.*the 1st value must be a finite number"):
        play(maker_for(tmp_path, source).make(TASK), ["4"])


@pytest.mark.parametrize("reward", ["1", None, float("inf")])
def test_the_loop_refuses_a_step_reward_that_is_not_a_number(reward):
    """Every environment's step() reward passes one check (a tensor still does, and a bool: `action == answer`)."""
    answer = ("obs", reward, True, False, {})
    with pytest.raises(EnvError, match="step\\(\\) reward must be a finite number"):
        check_step(answer)
    assert check_step(("obs", torch.tensor([0.5]), True, False, {})).reward == 0.5
    assert check_step(("obs", True, True, False, {})).reward == 1.0 and check_step(("obs", False, True, False, {})).reward == 0.0


def test_an_agent_func_step_may_return_a_bool_reward(tmp_path):
    source = """
    async def step(state, action, label):
        return action.strip() == "4", state + action, True, {}
    """
    (_, step), (_, wrong) = (play(maker_for(tmp_path, source).make(TASK), [action]) for action in ("4", "5"))
    assert check_step(step).reward == 1.0 and check_step(wrong).reward == 0.0


def test_an_extra_that_is_not_a_dict_is_an_env_error_naming_it(tmp_path):
    """Before: "dictionary update sequence element #0 has length 3", naming neither the function nor the value."""
    source = """
    async def step(state, action, label):
        return 0.0, state + action + " ok", True, "yes"
    """
    with pytest.raises(EnvError, match=r"agent_func step\(\) returned extra='yes' \(str\): the 4th value must be a dict"):
        play(maker_for(tmp_path, source).make(TASK), ["4"])


def test_each_maker_loads_its_own_module(tmp_path):
    """Module-level state is per loaded file: two makers of one path do not share it."""
    source = """
    calls = []

    async def step(state, action, label):
        calls.append(action)
        return float(len(calls)), state + action, False, {}
    """
    first, second = maker_for(tmp_path, source), maker_for(tmp_path, source)
    assert play(first.make(TASK), ["a", "b"])[2][1] == 2.0
    assert play(second.make(TASK), ["a"])[1][1] == 1.0


def test_pickles_by_path(tmp_path):
    copy = pickle.loads(pickle.dumps(maker_for(tmp_path, RETRY)))
    assert play(copy.make(TASK), ["4"])[1][1] == 1.0


def test_make_needs_a_task(tmp_path):
    with pytest.raises(ValueError, match="need a dataset row"):
        maker_for(tmp_path, RETRY).make(None)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("x = 1\n", r"defines no `step`; add `async def step\(state, action, label, \*\*kw\)"),
        ("step = 3\n", r"`step` must be a function"),
        ("async def step(state, action):\n    pass\n", r"`step` cannot be called as .*(too many positional arguments)"),
        ("async def step(s, a, l):\n    yield 1\n", r"`step` must be a function"),
        (RETRY + "def reset(state):\n    return state\n", r"`reset` cannot be called as `async def reset\(state, l"),
        ("def step(:\n", r"failed to load: SyntaxError.*fix the file"),
    ],
)
def test_bad_file_names_env_path_and_the_fix(tmp_path, source, message):
    with pytest.raises(ConfigError, match=r"env.path='.*agent.py'.*" + message):
        maker_for(tmp_path, source)


def test_missing_path_or_file_names_env_path(tmp_path):
    with pytest.raises(ConfigError, match=r"needs env.path=<a Python file defining `async def step"):
        AgentFuncMaker(cfg=AgentFuncConfig(name="agent_func"))
    missing = str(tmp_path / "absent.py")
    with pytest.raises(ConfigError, match=r"env.path='.*absent.py' is not a file"):
        AgentFuncMaker(cfg=AgentFuncConfig(name="agent_func", path=missing))
