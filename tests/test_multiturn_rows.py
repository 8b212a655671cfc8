"""Multi-turn rows (prompt, action, observation, action) flow through every stage after generation with no new
type: teacher-forced logprobs, reward-model scoring, critic values, advantages, the loss and one optimiser step.
Observation tokens are context, never trained on."""

from __future__ import annotations

from dataclasses import replace

import torch

from rlhf.algorithms import build_algorithm
from rlhf.generators.hf import left_pad
from rlhf.training.policy import TorchPolicy
from rlhf.models.value import load_value_model, sequence_scores
from rlhf.run.state import NonFiniteGuard
from rlhf.step.learner import Learner
from rlhf.step.scored import Scored
from rlhf.trajectory import Trajectories, from_completions
from algorithm_nodes import algorithm_cfg

CPU = torch.device("cpu")


def ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without BOS (the char tokenizer: one token per character)."""
    return tokenizer.convert_tokens_to_ids(list(text))


def multiturn(tokenizer) -> tuple[Trajectories, list[str]]:
    """Two rows: prompt, action, observation, action + EOS; the second row is shorter (right padding).

    Returns the rows and, for each row, its full text after the prompt (for single-turn twins).
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompt = tokenizer("1+2=")["input_ids"]
    turns = [[("3", 1), ("+4=", 0), ("7", 1)], [("12", 1), ("=", 0), ("1", 1)]]  # (text, is action)
    rows, masks = [], []
    for row in turns:
        tokens, mask = [], []
        for text, action in row:
            tokens += ids(tokenizer, text)
            mask += [float(action)] * len(text)
        rows.append(tokens + [eos])
        masks.append(mask + [1.0])
    width = max(len(r) for r in rows)
    window = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    loss_mask = torch.tensor([m + [0.0] * (width - len(m)) for m in masks])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    context = torch.tensor([prompt, prompt])
    batch = Trajectories(
        input_ids=torch.cat([context, window], dim=1),
        attention_mask=torch.cat([torch.ones_like(context), attention], dim=1),
        loss_mask=loss_mask,
        gen_logp=torch.zeros_like(loss_mask),
        group_id=torch.tensor([0, 0]),
        stopped=torch.tensor([True, True]),
    )
    return batch, ["".join(text for text, _ in row) for row in turns]


def single_turn_twin(tokenizer, batch: Trajectories, row: int, last_action_tokens: int) -> Trajectories:
    """The same row as a single-turn completion: everything before its last action is the prompt."""
    real = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
    query, response = real[:-last_action_tokens], real[-last_action_tokens:]
    query_ids, query_mask = left_pad([query], tokenizer.pad_token_id)
    mask = torch.ones(1, len(response))
    return from_completions(query_ids, query_mask, torch.tensor([response]), mask, torch.zeros(1, len(response)), torch.tensor([True]))


def test_logprobs_score_actions_in_context_and_skip_observations(policy_cfg, model_cfg, train_cfg, tokenizer):
    policy = TorchPolicy(policy_cfg, model_cfg, train_cfg(), total_optimizer_steps=1, device=CPU)
    batch, _ = multiturn(tokenizer)
    logp, entropy = policy.rollout_logprobs(batch, chunk=1, with_entropy=True)
    assert logp.shape == batch.loss_mask.shape
    assert (logp[batch.loss_mask == 0] == 0).all() and (entropy[batch.loss_mask == 0] == 0).all()
    assert (logp[batch.loss_mask == 1] < 0).all()
    # the last action (+ EOS) scored after the observation equals the same tokens scored as a plain response
    for row, width in ((0, 2), (1, 2)):
        twin = single_turn_twin(tokenizer, batch, row, width)
        twin_logp, _ = policy.rollout_logprobs(twin, chunk=1)
        actions = logp[row][batch.loss_mask[row].bool()]
        torch.testing.assert_close(actions[-width:], twin_logp[0], rtol=0, atol=1e-5)


def test_reward_model_scores_the_whole_row(tiny_model_dir, tokenizer):
    reward_model = load_value_model(tiny_model_dir).eval()
    batch, _ = multiturn(tokenizer)
    with torch.no_grad():
        scores = sequence_scores(reward_model, *batch.model_inputs()[:2])
        twin = single_turn_twin(tokenizer, batch, 1, 2)
        twin_score = sequence_scores(reward_model, *twin.model_inputs()[:2])
    torch.testing.assert_close(scores[1:], twin_score, rtol=0, atol=1e-5)


def test_prepare_and_update_train_only_the_actions(policy_cfg, model_cfg, train_cfg, tokenizer):
    """GRPO over two multi-turn rows: observation tokens get no advantage and no loss; one step moves the policy."""
    train = train_cfg(lr=1e-2, micro_batch_size=1)
    policy = TorchPolicy(policy_cfg, model_cfg, train, total_optimizer_steps=1, device=CPU)
    algorithm = build_algorithm(algorithm_cfg("grpo", num_samples_per_prompt=2), max_new_tokens=8)
    learner = Learner(policy, None, None, algorithm, train, CPU, torch.Generator().manual_seed(0),
                      policy_packs=policy.packs())
    batch, texts = multiturn(tokenizer)
    scored = Scored(replace(batch, scores=torch.tensor([1.0, 0.0])), ["1+2="] * 2, texts, {})
    trained, metrics = learner.prepare(scored)
    observations = trained.loss_mask == 0
    assert (trained.advantages[observations] == 0).all()
    assert (trained.advantages[0][~observations[0]] > 0).all() and (trained.advantages[1][~observations[1]] < 0).all()
    assert metrics["val/sequence_lengths"] == 3.5  # action tokens: 3 and 4 (EOS included), observations excluded
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    stats = learner.train(trained, guard=NonFiniteGuard(1))
    assert stats["policy/grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in policy.model.state_dict().items())
