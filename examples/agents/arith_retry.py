"""The built-in multi-turn task (addition, one retry after a miss) written as an agent against OpenAI's API.

Train it with ``python -m rlhf.train experiment=agent_tiny`` (or any run with ``env=openai_agent
env.path=examples/agents/arith_retry.py``): the run starts an OpenAI-compatible endpoint and calls ``run`` once per
episode. Nothing here knows about the trainer; point ``base_url`` at any OpenAI-compatible server and it runs as is.
"""

import asyncio

import httpx
import openai

FIRST_TRY, RETRY = 1.0, 0.5  # a right answer's reward on the first try and on the retry
# one connection pool for every episode (a new OpenAI client costs ~25 ms: SSL setup), per event loop: a pool is bound
# to the loop it was first used on, and the run starts a fresh loop if an agent ever blocks one
_http: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}


def shared_http() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    if loop not in _http:
        _http[loop] = httpx.AsyncClient(timeout=120)
    return _http[loop]


async def run(task, client) -> float:
    """Ask the problem; after a wrong answer, ask it once more. The reward: how soon the answer was right."""
    llm = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, http_client=shared_http())
    messages = [{"role": "user", "content": task.prompt}]
    for reward in (FIRST_TRY, RETRY):
        reply = await llm.chat.completions.create(model=client.model, messages=messages, max_tokens=4)
        answer = reply.choices[0].message.content or ""
        if answer.strip() == str(task.label):
            return reward
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": task.prompt}]
    return 0.0
