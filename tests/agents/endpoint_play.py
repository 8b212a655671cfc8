"""Playing agent episodes through a test's endpoint (`tests/agents/conftest.py`'s ``runner`` and ``generator``)."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import openai

from rlhf.agents.endpoint import OpenAIAgentConfig
from rlhf.data.prompts import PromptExample
from rlhf.generators.base import SamplingParams

SAMPLING = SamplingParams(max_new_tokens=4)


def client_of(client, **options):
    return openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0, **options)


def task(tokenizer, a: int, b: int) -> PromptExample:
    text = f"{a}+{b}="
    return PromptExample(text=text, token_ids=tuple(tokenizer(text)["input_ids"]), ground_truth=a + b)


def play(runner, generator, tokenizer, agent, group_size=2, cfg=None, problems=((1, 2), (3, 4))):
    runner.maker = SimpleNamespace(run=agent)
    if cfg is not None:
        runner.cfg = cfg
    tasks = [task(tokenizer, a, b) for a, b in problems]
    return runner.run(generator, tasks, list(range(len(tasks))), group_size, SAMPLING)


@contextmanager
def configured(runner, **keys):
    """``runner`` with these `env.*` keys changed inside the block."""
    saved = runner.cfg
    runner.cfg = OpenAIAgentConfig(**{**vars(saved), **keys})
    try:
        yield runner
    finally:
        runner.cfg = saved
