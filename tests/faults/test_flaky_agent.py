"""An agent function that fails on 30% of its calls (`env=agent_func`): the failed episodes are played again once
(`env.failed_retries=1`, the default), and the run trains on the episodes that worked. Before, one failed episode
dropped its whole group, so at 30% most groups went and a batch could lose every one ("every episode of the batch
failed") although 70% of the episodes had succeeded."""

from __future__ import annotations

import json
import subprocess
import sys

FLAKY_AGENT = '''
import itertools

calls = itertools.count()


def step(state, action, label=None, **_):
    if next(calls) % 10 in (1, 4, 7):  # 3 calls in 10 raise
        raise ConnectionError("the tool server dropped the request")
    return float(action.strip() == str(label)), state + action, True, {}
'''


def test_an_agent_failing_on_30_percent_of_calls_trains_on_the_rest(tmp_path):
    (tmp_path / "flaky_agent.py").write_text(FLAKY_AGENT)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+1=", "label": str(a + 1)}) + "\n" for a in range(8)))
    done = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "env=agent_func", f"env.path={tmp_path / 'flaky_agent.py'}",
         "env.max_tokens=64", "dataset=jsonl", f"dataset.path={tmp_path / 'tasks.jsonl'}", "dataset.ground_truth_key=label",
         "dataset.chat_template='{{ messages[0].content }}'", "dataset.max_prompt_length=16", "train.num_steps=3",
         "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=4", "eval.every=0", "logging.tensorboard=false",
         f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "env/failed_episodes" in r]
    assert len(steps) == 3
    for row in steps:  # 16 episodes a step, 4-6 of them failed and played again, at most 2 of those failed again
        assert 3 <= row["env/retried_episodes"] <= 6 and row["env/failed_episodes"] <= 2, row
        assert row["env/failed_share"] == row["env/failed_episodes"] / 16, row
        assert row["env/num_episodes"] + row["env/short_group_episodes"] == 16 - row["env/failed_episodes"], row
