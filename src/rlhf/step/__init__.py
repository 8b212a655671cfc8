"""One RL step in two pieces: a `Collector` turns prompts or tasks into a scored batch, a `Learner` turns a scored
batch into a policy update. `rlhf.schedules` decide only when each runs."""
