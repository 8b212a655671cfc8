"""The agent endpoint under the rule every failure that is not a score follows (`rlhf.rewards.failure`): a failed
agent episode is played again, a fresh session of the same task, within `env.failed_retries`; only those episodes."""

from __future__ import annotations

from endpoint_play import SAMPLING, client_of, task

from rlhf.envs.loop import play_retrying

CALLS: list[int] = []  # each agent run's task label, in the order the runs started


async def flaky(task, client):
    """Task 3's first run raises (its retry works); task 7's runs all raise but its second."""
    tries = CALLS.count(task.label)
    CALLS.append(task.label)
    if (task.label == 3 and tries == 0) or (task.label == 7 and tries != 1):
        raise ConnectionError("the agent's tool server went away")
    reply = await client_of(client).chat.completions.create(model=client.model, messages=[{"role": "user", "content": task.prompt}])
    return float(reply.choices[0].message.content.strip() == str(task.label))


def test_only_the_failed_agent_episodes_run_again(runner, generator, tokenizer):
    CALLS.clear()
    runner.maker = type("Maker", (), {"run": staticmethod(flaky)})()
    tasks = [task(tokenizer, 1, 2), task(tokenizer, 3, 4)]
    episodes, retried, counts = play_retrying(runner, generator, tasks, [0, 1], 2, SAMPLING, retries=1)
    assert sorted(CALLS) == [3, 3, 3, 7, 7, 7] and retried == 2  # two sessions each, then the failed one of each again
    assert [ep.group for ep in episodes] == [0, 0, 1, 1]
    assert [ep.failed for ep in episodes[:2]] == [False, False]  # task 3's retry worked: a row like the other
    assert sum(ep.failed for ep in episodes[2:]) == 1 and "ConnectionError" in next(ep.error for ep in episodes if ep.failed)
    assert all(ep.turns and ep.turns[0].action_ids for ep in episodes if not ep.failed)
    assert counts["env/raised_episodes"] == 3  # every try that raised, summed over the runner's two runs
