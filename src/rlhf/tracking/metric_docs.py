"""Every metric a run logs: its name, what it means, when it is logged. The source of docs/metrics.md:

    python -m rlhf.tracking.metric_docs > docs/metrics.md     # tests/docs checks that the page is up to date

A ``<part>`` in a name stands for a part of it (a reward function's name, an evaluation mode). The golden-curve runs
check that every metric of every algorithm preset is listed here, and a scan of the source that every metric name
the code spells is.
"""

from __future__ import annotations

import re

EVERY_STEP = "every step"

METRICS: dict[str, tuple[str, str]] = {  # name -> (meaning, when logged)
    # the objective, named as TRL and OpenRLHF name it
    "objective/scores": ("mean score of the step's samples: reward functions, reward model, non-stop penalty", EVERY_STEP),
    "objective/rlhf_reward": ("mean of score plus the KL penalty in the reward: what the advantages see", EVERY_STEP),
    "objective/non_score_reward": ("mean KL penalty in the reward (-beta x KL per sequence; 0 when KL is a loss)", EVERY_STEP),
    "objective/kl": ("KL of the policy to the reference: per-sequence sum over action tokens, mean over the batch", "a reference (algorithm.beta > 0)"),
    "objective/kl_coef": ("the KL coefficient in use (moves with algorithm/kl_ctl=adaptive)", "a reference, policy-gradient algorithms"),
    "objective/entropy": ("policy entropy: per-sequence sum over action tokens, mean over the batch", EVERY_STEP),
    "objective/verifiable_correct_rate": ("share of samples a verifier (rule or math reward) scored correct", "a verifiable reward"),
    "objective/frac_reward_zero_std": ("share of the step's groups whose samples all scored the same: no group-relative signal", "more than one sample per prompt"),
    "objective/greedy_baseline_scores": ("mean score of the greedy response per prompt (ReMax's baseline)", "algorithm=remax"),
    "objective/loss": ("the pairwise loss (DPO / IPO) of the step", "algorithm=online_dpo"),
    "objective/scores_margin": ("mean score of the chosen minus the rejected sample", "algorithm=online_dpo"),
    # the update
    "loss/policy_avg": ("policy loss, mean over the step's micro batches", "policy-gradient algorithms"),
    "loss/kl_avg": ("KL loss term (before beta), mean over micro batches", "KL as a loss (algorithm.kl_in_reward=false, beta > 0)"),
    "loss/entropy_avg": ("entropy bonus term, mean over micro batches", "algorithm.entropy_coef > 0"),
    "loss/value_avg": ("critic's clipped value loss, mean over micro batches", "algorithm=ppo"),
    "policy/approxkl_avg": ("approximate KL between the policy before and after the update (k3 of the ratio)", "policy-gradient algorithms"),
    "policy/clipfrac_avg": ("share of action tokens whose ratio the loss clipped", "policy-gradient algorithms"),
    "policy/grad_norm": ("the policy's gradient norm before clipping, last optimiser step", EVERY_STEP),
    "critic/grad_norm": ("the critic's gradient norm before clipping, last optimiser step", "algorithm=ppo"),
    "val/ratio": ("mean importance ratio pi_new / pi_old over action tokens", "policy-gradient algorithms"),
    "val/clipfrac_avg": ("share of value predictions the value loss clipped", "algorithm=ppo"),
    "val/values": ("mean critic value over action tokens", "algorithm=ppo"),
    "val/returns": ("mean GAE return over action tokens", "algorithm=ppo"),
    "val/valid_pairs": ("share of pairs whose chosen sample scored above the rejected one", "algorithm=online_dpo"),
    "logps/chosen": ("mean sequence logprob of the chosen samples", "algorithm=online_dpo"),
    "logps/rejected": ("mean sequence logprob of the rejected samples", "algorithm=online_dpo"),
    "reward/chosen": ("mean implicit reward (beta x log ratio to the reference) of the chosen samples", "algorithm=online_dpo"),
    "reward/rejected": ("mean implicit reward of the rejected samples", "algorithm=online_dpo"),
    "reward_margin": ("mean implicit reward of chosen minus rejected", "algorithm=online_dpo"),
    "lr": ("learning rate after the step's last optimiser step", EVERY_STEP),
    "train/skipped_steps": ("optimiser steps skipped so far for a non-finite loss or gradient", EVERY_STEP),
    # rewards
    "reward/<function>": ("mean score of one reward function (its name in reward.functions)", "each reward function"),
    "reward/<function>_<key>": ("a reward function's own figure (e.g. reward/math_verify_no_answer_rate)", "functions that report one"),
    "reward/model": ("mean raw score of the reward model (before normalize and clip)", "reward=model"),
    "reward/model_std": ("standard deviation of the reward model's raw scores", "reward=model"),
    "generator/prefilled_prompts": ("distinct prompts the hf generator prefilled in the step's generate call (shared prefill: once per prompt)", "generator=hf"),
    "generator/alone_rows": ("rows prefilled alone although their prompt had company (a group split across generator.batch_size batches)", "generator=hf"),
    "reward/unscored_share": ("share of the batch's rows no reward could score (Unscored: a sandbox or judge failure), after retries", EVERY_STEP),
    "reward/unscored_rows": ("rows that left the batch unscored: out of the loss and of their groups' statistics", "a row was unscored"),
    "reward/unscored_dropped_groups": ("groups dropped because too few of their rows were scored (under the estimator's samples per prompt)", "a row was unscored"),
    "reward/<function>_unscored": ("rows one reward function could not score, after its retries", "the function left a row unscored"),
    "eval/<mode>_unscored": ("evaluation rows no reward could score (left out of the evaluation's figures)", "a row was unscored"),
    "reward/overlong_penalty": ("mean overlong-shaping penalty (DAPO)", "reward.overlong_buffer_len set"),
    "dynamic_sampling/rounds": ("generate calls the step took to fill the batch with groups that carry a signal", "algorithm.filter_groups"),
    "dynamic_sampling/kept_share": ("groups with a signal / groups generated (schedule=stream: / groups passed over or trained)", "algorithm.filter_groups"),
    "dynamic_sampling/kept_groups": ("groups with a signal trained on", "algorithm.filter_groups"),
    "rollout_corr/kept_share": ("share of action tokens the correction keeps", "algorithm/rollout_correction set"),
    "rollout_corr/masked_share": ("share of action tokens it drops (no gradient)", "algorithm/rollout_correction set"),
    "rollout_corr/flagged_share": ("share of action tokens whose weight it changed", "algorithm/rollout_correction set"),
    "rollout_corr/weight_mean": ("mean correction weight over action tokens", "algorithm/rollout_correction set"),
    "rollout_corr/ratio_mean": ("mean ratio pi_trainer / pi_generator over action tokens", "algorithm/rollout_correction set"),
    "rollout_corr/ratio_max": ("largest ratio pi_trainer / pi_generator", "algorithm/rollout_correction set"),
    # the samples
    "val/sequence_lengths": ("mean response length in tokens", EVERY_STEP),
    "val/num_stop_token_ids": ("responses that ended with the stop token", EVERY_STEP),
    "val/stop_rate": ("share of responses that ended with the stop token", EVERY_STEP),
    "val/generator_logprob_diff": ("mean generator - trainer logprob on the sampled tokens", "when the trainer rescores the rollout"),
    "checks/logprob_gap_mean": ("the same mean gap, as the parity watch reads it", "when the trainer rescores the rollout"),
    "checks/logprob_gap_max": ("largest |generator - trainer| logprob on one token", "when the trainer rescores the rollout"),
    "checks/logprob_gap_k3": ("k3 KL between the generator's and the trainer's token distributions", "when the trainer rescores the rollout"),
    "train/kl_sample_train_v1": ("sampler-trainer KL, v1 estimator: mean(gen - train)", "when the trainer rescores the rollout"),
    "train/kl_sample_train_v2": ("sampler-trainer KL, v2 estimator: mean((gen - train)^2) / 2", "when the trainer rescores the rollout"),
    # multi-turn environments
    "distill/reverse_kl": ("the sampled per-token reverse KL to the teacher, log p_student (the pre-update policy's) - log p_teacher, averaged over action tokens", "a teacher (algorithm/advantage=opd or algorithm.distill_coef)"),
    "distill/teacher_logprob": ("the teacher's mean logprob of the sampled action tokens", "a teacher (algorithm/advantage=opd or algorithm.distill_coef)"),
    "env/num_episodes": ("episodes played this step", "env set"),
    "env/success_rate": ("share of episodes that succeeded", "env set"),
    "env/first_turn_success_rate": ("share of episodes that succeeded on the first turn", "env set"),
    "env/later_turn_success_rate": ("of the episodes that went past the first turn, the share that succeeded", "env set"),
    "env/episode_return": ("mean summed reward of an episode", "env set"),
    "env/num_turns_per_episode": ("mean turns per episode", "env set"),
    "env/action_num_tokens": ("mean action tokens per episode", "env set"),
    "env/max_turns_rate": ("share of episodes cut at env.max_turns", "env set"),
    "env/max_tokens_rate": ("share of episodes cut at env.max_tokens", "env set"),
    "env/failed_share": ("share of the batch's episodes whose environment or agent failed (raised, timed out, answered malformed), after retries", "env set"),
    "env/failed_episodes": ("episodes still failed after env.failed_retries: out of the loss and of their groups' statistics (their groups go on)", "env set"),
    "env/retried_episodes": ("failed episodes played again, fresh with the same task and seed (each retry counted)", "env set"),
    "env/failed_dropped_groups": ("groups dropped because failures left too few of their episodes (under the estimator's samples per prompt)", "env set"),
    "env/short_group_episodes": ("good episodes dropped because failures left their group under the estimator's samples per prompt", "env set"),
    "env/<key>": ("an environment's own figure, averaged over its episodes", "environments that report one"),
    "env/generate_calls": ("generate calls the agent endpoint made this step (its requests batched)", "env=openai_agent"),
    "env/generated_rows": ("rows those calls generated (requests times their n)", "env=openai_agent"),
    "env/retried_requests": ("requests answered with the reply already sampled for them (SDK retries)", "env=openai_agent"),
    "env/forked_chains": ("chains started beside an existing one (a rewritten or branched history, a race)", "env=openai_agent"),
    "env/rewritten_messages": ("assistant messages the agents wrote themselves (trained as masked observations)", "env=openai_agent"),
    "env/unparsed_tool_calls": ("replies whose tool-call text did not parse (returned as plain content)", "env=openai_agent"),
    "env/budget_ended_requests": ("requests answered with nothing because env.max_turns or env.max_tokens ran out", "env=openai_agent"),
    "env/rejected_requests": ("requests refused with a 4xx naming the bad field", "env=openai_agent"),
    "env/late_requests": ("requests to a session that had ended or never existed (410 or 404)", "env=openai_agent"),
    "env/raised_episodes": ("episodes lost because the agent's run raised", "env=openai_agent"),
    "env/timed_out_episodes": ("episodes lost because the agent went quiet past env.step_timeout_s, blocked the agents' event loop that long, or ran past env.episode_timeout_s", "env=openai_agent"),
    "env/over_budget_episodes": ("episodes lost because the agent made more than env.max_requests requests", "env=openai_agent"),
    "env/no_reward_episodes": ("episodes lost because the agent gave no (or no finite) reward", "env=openai_agent"),
    # evaluation
    "eval/<mode>_scores": ("mean score on the evaluation prompts (mode: greedy or sampled)", "every eval.every steps and at the end"),
    "eval/<mode>_correct_rate": ("share the verifier scored correct on the evaluation prompts", "eval steps, a verifiable reward"),
    "eval/<mode>_sequence_lengths": ("mean response length on the evaluation prompts", "eval steps"),
    "eval/<mode>_reward_model": ("mean reward-model score on the evaluation prompts", "eval steps, reward=model"),
    "eval/<mode>_failed_episodes": ("evaluation episodes whose environment or agent failed (all of them when the evaluation measured nothing)", "eval steps, env set"),
    "eval/<mode>_<key>": ("an environment's figure on the evaluation episodes (success_rate, episode_return, ...)", "eval steps, env set"),
    # schedules
    "async/policy_version": ("the policy version that trains on the step's batch", "schedule=async or stream"),
    "async/staleness_mean": ("mean steps between a row's policy version (stream: its oldest token's) and the trainer's", "schedule=async or stream"),
    "async/staleness_max": ("largest such staleness in the batch", "schedule=async or stream"),
    "async/token_staleness_mean": ("mean versions between a trained token's sampler and the trainer", "schedule=stream"),
    "async/token_staleness_max": ("largest such token staleness (at most schedule.max_staleness)", "schedule=stream"),
    "async/versions_per_row": ("mean distinct policy versions among a row's tokens (> 1: weights loaded mid-response)", "schedule=stream"),
    "async/stale_token_share": ("share of tokens out of the loss for being older than schedule.max_token_version_gap", "schedule=stream"),
    "stream/occupancy": ("rows decoding per chunk / schedule.in_flight, since the last step (0: no chunk since)", "schedule=stream"),
    "stream/tokens_per_s": ("tokens sampled per second of decoding, since the last step", "schedule=stream"),
    "stream/weight_loads": ("pushed weights the generator loaded mid-stream since the last step", "schedule=stream"),
    "memory/generator_freed_mb": ("MiB the generator released while asleep", "schedule=hybrid"),
    # counters, sizes, times
    "step": ("the RL step", EVERY_STEP),
    "episode": ("samples (episodes) trained so far", EVERY_STEP),
    "epoch": ("passes over the training prompts so far (fractional)", EVERY_STEP),
    "perf/total_num_tokens": ("real tokens of the step's batch (prompts and responses)", EVERY_STEP),
    "perf/padding_fraction": ("share of padding in what the training forwards computed", EVERY_STEP),
    "perf/prefix_unshared_rows": ("rows whose prompt differs, token for token, from their group's first row's: the shared-prefix layout gives them a prompt of their own", "model.shared_prefix not false, a policy that packs"),
    "perf/weight_sync_mb": ("MiB of weights pushed to the generator", "local backend"),
    "time/<stage>": ("seconds of a stage of the step: generation, logprobs, training, weight_sync, greedy_baseline "
                     "(ReMax), wait_for_rollout (async, stream), generator_sleep and optimizer_offload (hybrid)", EVERY_STEP),
    "time/step": ("seconds of the whole step", EVERY_STEP),
    "time/total": ("seconds since the run started", EVERY_STEP),
}
STAGES = ("generation", "logprobs", "training", "weight_sync", "greedy_baseline", "wait_for_rollout", "generator_sleep",
          "optimizer_offload")  # what `time/<stage>` stands for


def pattern(name: str) -> re.Pattern:
    """The names ``name`` documents: a ``<part>`` matches any part of a name (``time/<stage>``: the stages only)."""
    parts = re.split(r"(<[a-z_]+>)", name)
    regex = "".join(
        ("(" + "|".join(STAGES) + ")" if part == "<stage>" else r"[A-Za-z0-9_]+") if part.startswith("<") else re.escape(part)
        for part in parts
    )
    return re.compile(regex)


PATTERNS = [(name, pattern(name)) for name in METRICS]


def documented(name: str) -> bool:
    """Whether the metric ``name`` is listed (exactly, or through a ``<part>``)."""
    return any(regex.fullmatch(name) for _, regex in PATTERNS)


INTRO = """# Metrics

Written to TensorBoard (`<output folder>/tensorboard`), to `<output folder>/metrics.jsonl`, and (a subset) to the
console every `logging.log_every` steps and at the last, with the names the peers use. `logging.wandb=true` sends
the same to Weights & Biases. Sample prompts, completions and scores go to TensorBoard's text tab (`samples`,
`eval_samples/greedy`, `eval_samples/sampled`). This page is written by `python -m rlhf.tracking.metric_docs`
from `rlhf/tracking/metric_docs.py`; a test checks that every metric the algorithm presets log is on it.

On a terminal a live bar shows the step, the ETA, score, KL and s/step between those lines
(`logging.progress_bar`: `auto` shows it only on a terminal, so logs, CI and files get plain lines; `true`, `false`).
`logging.wandb=true` (`pip install 'rlhf[wandb]'`) sends the same metrics, the composed config and the sample tables
to Weights & Biases as well, project `logging.wandb_project`, run name `logging.wandb_name` (default: the output folder's
name), mode `logging.wandb_mode` (default: `WANDB_MODE`; `offline` writes `<output folder>/wandb/`, then `wandb sync`).

| metric | meaning | logged |
|---|---|---|
"""


def page() -> str:
    rows = [f"| `{name}` | {meaning} | {when} |" for name, (meaning, when) in METRICS.items()]
    return INTRO + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(page(), end="")
