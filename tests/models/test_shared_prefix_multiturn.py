"""Multi-turn episodes in the shared-prefix layout (`rlhf.models.shared_prefix.prefixes`): where a group's episodes
agree past their prompt (the same first answer, so the same observation after it), the agreed turns are laid out
once with the prompt, and the logprobs, losses and gradients stay the unshared layout's, the agreed action tokens'
loss included (their output feeds every row that takes them; autograd adds up the rows' gradients)."""

from __future__ import annotations

import pytest
import torch

from rlhf.envs.loop import Episode, Turn
from rlhf.envs.rows import episode_rows
from rlhf.models import shared_prefix
from test_shared_prefix import VOCAB, assert_critic_same, assert_same, llama, packed_model, qwen2, with_adapters

PAD = 0


def played(group: int, prompt: list[int], turns: list[tuple[list[int], list[int]]]) -> Episode:
    """An episode of ``turns`` (observation after the previous action, action), turn 0's observation the prompt."""
    episode = Episode(group=group, seed=0, task=None)
    for k, (observation, action) in enumerate(turns):
        episode.turns.append(Turn(
            observation="", observation_ids=prompt if k == 0 else observation, action_ids=action,
            action_logp=[-1.0] * len(action), stopped=True,
        ))
    return episode


def retry_groups(seed: int = 0):
    """Two groups of the arith-retry shape (prompt, answer, the problem again, a second answer), as `episode_rows`
    lays them out. Group 0: rows 0-2 give the same first answer (so see the same observation) and differ in the
    retry; row 3 answers otherwise and stops; row 4 is row 0's first turn only (its whole row is shared). Group 1:
    every first answer differs (only the prompt is shared)."""
    g = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()
    prompt, first, again = tokens(9), tokens(4), tokens(5)
    episodes = [played(0, prompt, [([], first), (again, tokens(n))]) for n in (3, 4, 2)]
    episodes += [played(0, prompt, [([], tokens(3))]), played(0, prompt, [([], first)])]
    prompt = tokens(6)
    episodes += [played(1, prompt, [([], tokens(3)), (tokens(4), tokens(2))]) for _ in range(3)]
    return episode_rows(episodes, "sum", PAD).trimmed()


def test_a_group_s_agreed_first_turn_is_laid_out_once_with_its_prompt():
    batch = retry_groups()
    parts = shared_prefix.row_parts(batch)
    heads, row_class, shared = shared_prefix.prefixes(parts)
    assert row_class == [0, 0, 0, 0, 0, 1, 1, 1]
    assert shared[:5] == [9 + 4 + 5] * 3 + [9, 9 + 4]  # the agreed answer and observation; the other answer: the prompt
    assert len(heads[0]) == 9 + 4 + 5 and len(heads[1]) == 6
    layout = shared_prefix.share(batch, force=True)
    total = int(batch.attention_mask.sum())
    assert layout.input_ids.shape[1] == total - sum(shared) + len(heads[0]) + len(heads[1])
    # row 1's retry is predicted from the shared observation's last token, its position past the agreed turn
    assert int(layout.predicts[1, 4 + 5]) == len(heads[0]) - 1
    assert layout.unshared_rows == 0
    # the agreed first answer is trained on: part of the shared prefix inside the loss mask
    assert batch.loss_mask[:3, :4].bool().all()


@pytest.mark.parametrize("build", [llama, qwen2], ids=["llama", "qwen2"])
def test_multi_turn_rows_give_the_unshared_logprobs_loss_and_gradients(build):
    assert_same(packed_model(build), retry_groups())


def test_lora_adapters_get_the_unshared_gradients_on_multi_turn_rows():
    assert_same(with_adapters(packed_model(qwen2)), retry_groups(seed=1))


def test_the_critic_s_values_and_gradients_on_multi_turn_rows_are_the_unshared_ones():
    assert_critic_same(retry_groups(seed=2))


def test_the_leader_is_the_row_that_agrees_most_and_a_lone_agreement_extends_the_prefix():
    p = (1, 2, 3)
    parts = [(p, (5, 6)), (p, (7, 8, 9)), (p, (7, 8, 4)), (p, (7, 1)), (p, (5, 2))]
    heads, row_class, shared = shared_prefix.prefixes(parts)
    assert heads == [p + (7, 8)] and row_class == [0] * 5
    assert shared == [3, 5, 5, 4, 3]  # rows 1 and 2 agree on two tokens past the prompt, row 3 on one
    heads, _, shared = shared_prefix.prefixes([(p, (4,)), (p, (5,)), ((1, 2), (3, 4))])
    assert heads == [p, (1, 2)] and shared == [3, 3, 2]  # a prompt of its own stays its own, though it agrees on more


def test_the_leader_found_through_sorted_neighbours_is_the_one_every_pair_compared_finds():
    import random

    rng = random.Random(0)
    for _ in range(2000):  # short responses of two token values: many ties, empty ones, one a prefix of another
        responses = [tuple(rng.choice((3, 4)) for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(1, 9))]
        agree = [[shared_prefix.common_length(a, b) if i != j else 0 for j, b in enumerate(responses)] for i, a in enumerate(responses)]
        leader = max(range(len(responses)), key=lambda i: sum(agree[i]))  # the first of the best
        taken = list(agree[leader])
        taken[leader] = max((t for i, t in enumerate(taken) if i != leader), default=0)
        assert shared_prefix.leading(responses) == (leader, taken), responses


def test_the_fused_output_layer_gives_the_unshared_logprobs_and_gradients_on_multi_turn_rows():
    from rlhf.models.logprobs import fuses, window_logprobs

    model, batch = packed_model(llama), retry_groups(seed=3)
    assert fuses(model)
    out = {}
    for share, chunk in ((True, 5), (False, 0)):  # fused over the shared layout against the plain unshared logits
        model.zero_grad()
        logp, entropy = window_logprobs(model, batch, 1.0, with_entropy=True, chunk=chunk, share=share)
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        out[share] = logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    for got, want in zip(out[True][:2], out[False][:2]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, grad in out[False][2].items():
        torch.testing.assert_close(out[True][2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_multi_turn_run_s_first_step_is_the_unshared_one_with_its_agreed_turns_shared(tmp_path, monkeypatch):
    """`experiment=multiturn_tiny` (the retry task's episodes, 8 a problem, the built-in model warm-started on both
    turns) for one step with `model.shared_prefix` true and false: the same episodes scored alike, the same losses, KL
    and entropy within float rounding, and the shared step's forwards took turns past the prompt from a prefix."""
    import json

    from rlhf.config import compose_config
    from rlhf.train import train

    taken_past_prompt = []
    prefixes = shared_prefix.prefixes

    def counted(parts):
        heads, row_class, shared = prefixes(parts)
        taken_past_prompt.append(sum(k > len(prompt) for k, (prompt, _) in zip(shared, parts)))
        return heads, row_class, shared

    monkeypatch.setattr(shared_prefix, "prefixes", counted)
    firsts = {}
    for share in ("true", "false"):
        cfg = compose_config([
            "experiment=multiturn_tiny", f"model.shared_prefix={share}", "train.num_steps=1", "train.prompts_per_step=8",
            "eval.num_samples=0", "logging.tensorboard=false", "logging.sample_every=0", "checkpoint.save_final_model=false",
        ])
        train(cfg, tmp_path / share)
        rows = [json.loads(line) for line in (tmp_path / share / "metrics.jsonl").read_text().splitlines()]
        firsts[share] = next(row for row in rows if "objective/scores" in row)
    assert sum(taken_past_prompt) > 0
    shared, plain = firsts["true"], firsts["false"]
    assert shared["objective/scores"] == plain["objective/scores"]
    for key in ("loss/policy_avg", "loss/kl_avg", "objective/kl", "objective/entropy"):
        assert abs(shared[key] - plain[key]) <= 1e-5 * max(1.0, abs(plain[key])), key
