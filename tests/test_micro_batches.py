"""Micro batches by rows and token budget (`rlhf.micro_batches`), trimmed padding, and old logprobs taken from the
training forward: every one must give what the padded path gives (float32, 1e-5)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rlhf.algorithms import build_algorithm
from rlhf.algorithms.base import OldLogprobs
from rlhf.functional import entropy_from_logits, logprobs_from_logits
from algorithm_nodes import algorithm_cfg
from rlhf.micro_batches import Budget, as_budget, by_group, padded_tokens, plan, split_to, window_outputs
from rlhf.training.policy import TorchPolicy
from rlhf.models.reference import FrozenReference
from rlhf.step.learner import Learner, accumulate
from rlhf.step.scored import Scored
from rlhf.run.state import NonFiniteGuard
from rlhf.trajectory import Forward, Trajectories, from_completions

CPU = torch.device("cpu")
PROMPT_LENGTHS = [3, 6, 2, 5, 4, 6, 3, 2]
RESPONSE_LENGTHS = [9, 1, 4, 7, 2, 9, 5, 3]


def ragged_rows(vocab: int, prompts=PROMPT_LENGTHS, responses=RESPONSE_LENGTHS, seed: int = 0) -> Trajectories:
    """Rows of the given prompt and response lengths (random tokens), left- and right-padded, groups of 2."""
    g = torch.Generator().manual_seed(seed)
    rows, lq, lr = len(prompts), max(prompts), max(responses)
    query_ids = torch.zeros(rows, lq, dtype=torch.long)
    query_mask = torch.zeros(rows, lq, dtype=torch.long)
    response_ids = torch.zeros(rows, lr, dtype=torch.long)
    response_mask = torch.zeros(rows, lr)
    for i, (q, r) in enumerate(zip(prompts, responses)):
        query_ids[i, lq - q :] = torch.randint(4, vocab, (q,), generator=g)
        query_mask[i, lq - q :] = 1
        response_ids[i, :r] = torch.randint(4, vocab, (r,), generator=g)
        response_mask[i, :r] = 1
    batch = from_completions(query_ids, query_mask, response_ids, response_mask, torch.zeros(rows, lr), torch.ones(rows, dtype=torch.bool))
    return replace(batch, group_id=torch.arange(rows) // 2, scores=torch.arange(rows, dtype=torch.float) % 3)


def algorithm(**overrides):
    return build_algorithm(algorithm_cfg("grpo", **{"num_samples_per_prompt": 2} | overrides), max_new_tokens=9)


@pytest.fixture
def policy(policy_cfg, model_cfg, train_cfg):
    """A fresh seed-0 tiny policy (lr 1e-2)."""
    return lambda **train: TorchPolicy(policy_cfg, model_cfg, train_cfg(lr=1e-2, **train), total_optimizer_steps=4, device=CPU)


# --- planning ---------------------------------------------------------------------------------------


def test_rows_only_cuts_longest_first_and_covers_every_row_once():
    batch = ragged_rows(20)
    parts = plan(batch, 3)
    assert [len(p) for p in parts] == [3, 3, 2]
    assert sorted(torch.cat(parts).tolist()) == list(range(8))
    lengths = batch.attention_mask.sum(dim=1)
    assert lengths[parts[0]].min() >= lengths[parts[-1]].max()  # longest rows first


def test_a_token_budget_bounds_every_micro_batch_with_its_padding():
    batch = ragged_rows(20)
    for tokens in (15, 24, 40, 200):
        parts = plan(batch, Budget(rows=8, tokens=tokens))
        for units in parts:
            micro = batch.select_units(units).trimmed()
            assert micro.justified_inputs()[0].numel() <= tokens or len(units) == 1
        assert sorted(torch.cat(parts).tolist()) == list(range(8))
    assert len(plan(batch, Budget(rows=8, tokens=200))) == 1
    assert len(plan(batch, Budget(rows=8, tokens=15))) > len(plan(batch, Budget(rows=8, tokens=40))) > 1


def test_a_budget_below_the_longest_row_names_both_numbers():
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch=14 is smaller than the longest row of this batch \(15 tokens\)"):
        plan(ragged_rows(20), Budget(rows=8, tokens=14))


def test_pairs_stay_whole_and_count_both_rows():
    batch = replace(ragged_rows(20), rows_per_unit=2)
    parts = plan(batch, Budget(rows=8, tokens=30))
    assert sorted(torch.cat(parts).tolist()) == list(range(4))  # unit (pair) indices
    with pytest.raises(ValueError, match=r"\(15 tokens x 2 rows per unit\); raise it to at least 30"):
        plan(batch, Budget(rows=8, tokens=29))


def test_split_to_halves_the_largest_until_the_counts_agree():
    assert split_to([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert split_to([[0], [1]], 4) == [[0], [1]]  # never more micro batches than units


def test_packed_micro_batches_compute_no_padding_and_others_their_longest_row():
    batch = ragged_rows(20)
    real = sum(PROMPT_LENGTHS) + sum(RESPONSE_LENGTHS)
    assert padded_tokens(batch, Budget(rows=2), packed=True) == (real, real)  # packed: real tokens only
    # a model that does not pack: rows of 15, 12 | 12, 8 | 7, 6 | 6, 5 tokens, each pair as wide as its longest
    assert padded_tokens(batch, Budget(rows=2), packed=False) == (2 * (15 + 12 + 7 + 6), real)
    gap = replace(batch, attention_mask=batch.attention_mask.clone())
    gap.attention_mask[1, batch.window_start - 2] = 0  # a hole in row 1's prompt: its micro batch cannot pack
    computed, real_gap = padded_tokens(gap, Budget(rows=2), packed=True)
    assert real_gap == real - 1
    # longest first, rows 1 (7 tokens, one now a hole) and 2 (6) share a micro batch: 2 x 7 columns for 12 real tokens
    assert computed == real_gap + 2 * 7 - 12


# --- the same numbers as the padded path --------------------------------------------------------------


def padded_forward(model, batch: Trajectories) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) of the window tokens from the untouched (B, L) rows, left padding and all: the reference
    the trimmed, justified micro batches must reproduce."""
    input_ids, attention_mask, position_ids = batch.model_inputs()
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    window = logits[:, batch.window_start - 1 : -1]
    return logprobs_from_logits(window, batch.window_ids) * batch.loss_mask, entropy_from_logits(window) * batch.loss_mask


def test_trimmed_rows_give_the_full_rows_logprobs(policy, tokenizer):
    model = policy()
    batch = ragged_rows(len(tokenizer))
    full, entropy = model.rollout_logprobs(batch, len(batch), with_entropy=True)  # one forward: rows sorted, no trim
    padded, padded_entropy = padded_forward(model.model, batch)
    for budget in (Budget(rows=1), Budget(rows=3), Budget(rows=8, tokens=30)):
        logp, ent = model.rollout_logprobs(batch, budget, with_entropy=True)
        torch.testing.assert_close(logp, padded, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent, padded_entropy, rtol=0, atol=1e-5)
    torch.testing.assert_close(full, padded, rtol=0, atol=1e-5)
    assert (padded[batch.loss_mask == 0] == 0).all()


def layout(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """``model`` set to lay micro batches out ``name``: "packed" (rows end to end) or "justified" (rows padded, each
    past its own left padding: the layout of a model whose attention takes no packed rows)."""
    from rlhf.models import packing

    if name == "packed":
        assert packing.enable(model) or packing.packs(model)
    else:
        model.set_attn_implementation("sdpa")
        assert not packing.packs(model)
    return model


def test_the_policy_says_whether_its_training_forwards_pack(policy):
    """`TorchPolicy.packs` (what `perf/padding_fraction` counts by) follows the model's attention."""
    model = policy()
    assert model.packs() and "micro batches packed" in model.describe()
    assert "a group's prompt laid out once where it pays (model.shared_prefix)" in model.describe()  # null, the default
    layout(model.model, "justified")
    assert not model.packs() and "rows padded per micro batch" in model.describe()


@pytest.mark.parametrize("rows", ["packed", "justified"])
def test_packed_and_justified_rows_give_the_padded_rows_logprobs_gradients_and_values(policy, tokenizer, tiny_model_dir, rows):
    """Rows packed end to end, or moved past their left padding (a forward as wide as the longest row): the
    logprobs, gradients and critic values of the untouched rows (float32, 1e-5)."""
    from rlhf.models.logprobs import window_logprobs
    from rlhf.models.value import ValueModule, load_value_model, token_scores, window_values

    model = layout(policy().model, rows)
    batch = ragged_rows(len(tokenizer))
    ids, mask, positions, predicts = batch.justified_inputs()
    assert ids.shape[1] == max(p + r for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS))
    pair = batch.select(torch.tensor([0, 1])).trimmed()  # prompts 3 and 6, responses 9 and 1: 12 columns, not 6 + 9
    assert pair.input_ids.shape[1] == 15 and pair.justified_inputs()[0].shape[1] == 12
    assert (mask.sum(dim=1) == batch.attention_mask.sum(dim=1)).all() and (mask[:, 0] == 1).all()
    full_positions = batch.model_inputs()[2]
    for row in range(len(batch)):  # the same tokens at the same positions
        real = batch.attention_mask[row].bool()
        assert ids[row, mask[row].bool()].tolist() == batch.input_ids[row, real].tolist()
        assert positions[row, mask[row].bool()].tolist() == full_positions[row, real].tolist()
    weights = torch.rand(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))

    def grads(out, module=model):
        (-(out * weights).sum()).backward()
        found = {name: p.grad.clone() for name, p in module.named_parameters()}
        module.zero_grad()
        return found

    input_ids, attention_mask, position_ids = batch.model_inputs()
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    padded = logprobs_from_logits(logits[:, batch.window_start - 1 : -1], batch.window_ids) * batch.loss_mask
    padded_grads = grads(padded)
    justified, _ = window_logprobs(model, batch, 1.0)
    torch.testing.assert_close(justified, padded, rtol=0, atol=1e-5)
    for name, grad in grads(justified).items():
        torch.testing.assert_close(grad, padded_grads[name], rtol=1e-4, atol=1e-5)

    critic = layout(load_value_model(tiny_model_dir).eval(), rows)
    want = token_scores(critic, input_ids, attention_mask, position_ids)[:, batch.window_start - 1 : -1] * batch.loss_mask
    want_grads = grads(want, critic)
    values = window_values(ValueModule(critic), batch)
    torch.testing.assert_close(values, want, rtol=0, atol=1e-5)
    for name, grad in grads(values, critic).items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", ["packed", "justified"])
def test_the_output_layer_runs_on_each_rows_window_only(policy, tokenizer, rows):
    """However far apart the rows' windows sit, the output layer computes (B, T, V) logits, its hook is gone
    afterwards, and a model whose output layer cannot be hooked gets the same logits picked from all of them."""
    from rlhf.models.logprobs import window_logits

    model = layout(policy().model, rows)
    batch = ragged_rows(len(tokenizer))
    head = model.get_output_embeddings()
    loaded_hooks = list(head._forward_pre_hooks.values())  # the loader's own (rlhf.models.loading), which stay
    seen = []
    handle = head.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    with torch.no_grad():
        hooked = window_logits(model, batch, 1.0)
    handle.remove()
    assert seen == [(len(batch), batch.loss_mask.shape[1], model.config.vocab_size)]
    assert list(head._forward_pre_hooks.values()) == loaded_hooks

    class Bare(torch.nn.Module):  # no get_output_embeddings, no logits_to_keep
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    with torch.no_grad():
        torch.testing.assert_close(window_logits(Bare(model), batch, 1.0), hooked, rtol=0, atol=1e-5)


def test_window_outputs_restore_row_order():
    batch = ragged_rows(20)
    rows = window_outputs(lambda part: part.input_ids[:, -1].float() * 0 + part.loss_mask.sum(dim=1), batch, Budget(rows=3))
    torch.testing.assert_close(rows, batch.loss_mask.sum(dim=1))


def loss_and_grads(model, algo, batch, micro) -> tuple[float, dict[str, torch.Tensor]]:
    """One accumulation of the policy loss over ``batch``; (summed loss, gradients), gradients then cleared."""
    denominator = algo.denominator(batch)
    finite, metrics, _ = accumulate(model, batch, algo.policy_loss, denominator, as_budget(micro), False, False)
    assert finite
    grads = {name: p.grad.clone() for name, p in model.model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return metrics["loss/policy_avg"], grads


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_token_budget_loss_and_gradients_equal_the_padded_path(policy, tokenizer, loss_agg):
    """The padded path: every row in one untrimmed forward. Micro batches by a token budget, sorted and trimmed, give
    the same loss and gradients."""
    model = policy()
    algo = algorithm(loss_agg=loss_agg)
    rollout = ragged_rows(len(tokenizer))
    with torch.no_grad():
        old, _ = model.logprobs(rollout)
    batch, _ = algo.prepare(replace(rollout, old_logp=old + 0.05 * rollout.loss_mask))  # ratios != 1: clipping counts
    denominator = algo.denominator(batch)
    micro, forward, _ = model.train_forward(batch, False)
    loss, _ = algo.policy_loss(micro, forward, denominator)
    loss.backward()
    padded = {name: p.grad.clone() for name, p in model.model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for micro in (1, 3, Budget(rows=8, tokens=24)):
        budget_loss, grads = loss_and_grads(model, algo, batch, micro)
        assert budget_loss == pytest.approx(loss.item(), abs=1e-5)
        scale = max(1.0, max(g.abs().max().item() for g in padded.values()))  # sums per sequence give larger gradients
        for name, grad in padded.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * scale)


# --- old logprobs from the training forward -------------------------------------------------------------


def one_step(policy, reference, algo, batch, from_training: bool, train) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """A real Learner's `prepare` then `train` on a fresh seed-0 policy; (prepare and update metrics, weights after).
    ``algo`` must say whether the old logprobs may come from the training forward (`reuse_training_logprobs`)."""
    model = policy(micro_batch_size=train.get("micro_batch_size", 8), max_tokens_per_micro_batch=train.get("tokens"))
    learner = Learner(model, reference, None, algo, model.train_cfg, CPU, torch.Generator().manual_seed(0),
                      policy_packs=model.packs())
    assert (learner.old_logprobs is OldLogprobs.TRAINING) == from_training
    prepared, metrics = learner.prepare(Scored(batch, [""] * len(batch), [""] * len(batch), {}))
    assert (prepared.old_logp is None) == from_training
    metrics |= learner.train(prepared, NonFiniteGuard(1))
    return metrics, {k: v.clone() for k, v in model.model.state_dict().items()}


@pytest.mark.parametrize("train", [{}, {"micro_batch_size": 3}, {"tokens": 24}], ids=["one-micro", "rows-3", "tokens-24"])
def test_old_logprobs_from_the_training_forward_change_nothing(policy, reference_cfg, model_cfg, tokenizer, train):
    """GRPO with a KL loss to a reference (beta 0.1) and an entropy bonus: one pass fewer, and the same loss, metrics
    (entropy, KL, generator gap) and weights after the step."""
    reference = FrozenReference(reference_cfg(), model_cfg, CPU)
    batch = ragged_rows(len(tokenizer))
    batch = replace(batch, gen_logp=-0.5 * batch.loss_mask)
    separate, after_separate = one_step(
        policy, reference, algorithm(beta=0.1, entropy_coef=0.01, reuse_training_logprobs=False), batch, False, train
    )
    fused, after_fused = one_step(policy, reference, algorithm(beta=0.1, entropy_coef=0.01), batch, True, train)
    assert set(fused) == set(separate)
    for key in ("objective/entropy", "objective/kl", "checks/logprob_gap_mean", "train/kl_sample_train_v2", "loss/policy_avg",
                "loss/kl_avg", "policy/grad_norm", "policy/approxkl_avg", "val/ratio"):
        assert fused[key] == pytest.approx(separate[key], abs=1e-5), key
    assert fused["val/ratio"] == pytest.approx(1.0, abs=1e-6)
    # AdamW moves each weight by about lr = 1e-2 whatever its gradient's size, so the float rounding of a near-zero
    # gradient (the two passes pack different micro batches) can show up to about 1e-5 in one element
    for name, weight in after_separate.items():
        torch.testing.assert_close(after_fused[name], weight, rtol=0, atol=5e-5)


@pytest.mark.parametrize("correction", [
    "token_tis", "seq_tis", {"name": "icepop", "drop_rejected": False}, {"name": "geo_reject", "drop_rejected": False},
], ids=["token_tis", "seq_tis", "icepop-weights-only", "geo_reject-weights-only"])
def test_a_rollout_correction_weighs_the_loss_from_the_training_forward(policy, reference_cfg, model_cfg, tokenizer, correction):
    """A correction that leaves the loss mask as it is: no pre-update pass either; the loss weighs each token from the
    training forward's logprobs, detached (the pre-update ones: one optimiser step), so the loss, the correction's
    `rollout_corr/*` figures and the weights after the step are those of the separate pass. The generator's
    logprobs are the policy's own moved by up to +-1, so some ratios pass the cap (2) and leave the band [0.5, 2]."""
    reference = FrozenReference(reference_cfg(), model_cfg, CPU)
    batch = ragged_rows(len(tokenizer))
    with torch.no_grad():
        own, _ = policy().logprobs(batch)
    noise = torch.empty_like(own).uniform_(-1.0, 1.0, generator=torch.Generator().manual_seed(3))
    batch = replace(batch, gen_logp=(own + noise) * batch.loss_mask)
    train = {"micro_batch_size": 3}
    separate, after_separate = one_step(
        policy, reference, algorithm(beta=0.1, rollout_correction=correction, reuse_training_logprobs=False), batch, False, train
    )
    fused, after_fused = one_step(policy, reference, algorithm(beta=0.1, rollout_correction=correction), batch, True, train)
    assert set(fused) == set(separate)
    assert 0.0 < separate["rollout_corr/flagged_share"] < 1.0, "the test needs tokens the correction changes and some it keeps"
    for key in [k for k in separate if k.startswith("rollout_corr/")] + ["loss/policy_avg", "policy/grad_norm", "objective/kl"]:
        assert fused[key] == pytest.approx(separate[key], abs=1e-5), key
    for name, weight in after_separate.items():
        torch.testing.assert_close(after_fused[name], weight, rtol=0, atol=5e-5)


def test_old_logprobs_need_their_own_pass_where_the_batch_reads_them(train_cfg):
    """A KL penalty in the reward, a correction that takes rejected tokens out of the loss mask (the denominators
    read it), or several optimiser steps per step keep the separate pass; a correction that only weighs tokens does
    not."""
    one = train_cfg()

    def fused(algo, train=one) -> bool:
        return Learner(None, None, None, algo, train, CPU, torch.Generator()).old_logprobs is OldLogprobs.TRAINING

    assert fused(algorithm()) and fused(algorithm(beta=0.1))
    assert not fused(algorithm(beta=0.1, kl_in_reward=True))
    assert fused(algorithm(rollout_correction="token_tis")) and fused(algorithm(rollout_correction="seq_tis"))
    assert not fused(algorithm(rollout_correction="icepop")) and not fused(algorithm(rollout_correction="geo_reject"))
    assert fused(algorithm(rollout_correction={"name": "icepop", "drop_rejected": False}))
    assert not fused(algorithm(reuse_training_logprobs=False))
    assert not fused(algorithm(), train_cfg(num_mini_batches=2))
    assert not fused(algorithm(), train_cfg(num_epochs=2))


def test_the_training_forward_records_in_row_order(policy, tokenizer):
    model = policy()
    algo = algorithm()
    rollout = ragged_rows(len(tokenizer))
    with torch.no_grad():
        old, entropy = model.logprobs(rollout, with_entropy=True)
    batch, _ = algo.prepare(replace(rollout, old_logp=old))
    _, _, recorded = accumulate(model, batch, algo.policy_loss, algo.denominator(batch), Budget(8, 24), False, True)
    assert isinstance(recorded, Forward)
    torch.testing.assert_close(recorded.logp, old, rtol=0, atol=1e-5)
    torch.testing.assert_close(recorded.entropy, entropy, rtol=0, atol=1e-5)
    assert not recorded.logp.requires_grad


def test_merge_to_joins_the_smallest_neighbours():
    from rlhf.micro_batches import merge_to

    assert merge_to([[0, 1, 2], [3], [4], [5, 6]], 2) == [[0, 1, 2], [3, 4, 5, 6]]
    assert merge_to([[0], [1]], 3) == [[0], [1]]


def test_by_group_keeps_each_group_in_one_micro_batch_longest_group_first():
    batch = ragged_rows(40)  # groups of 2: rows (0, 1), (2, 3), ...
    parts = plan(batch, 4, by_group=True)
    groups = [sorted(set(batch.group_id[p].tolist())) for p in parts]
    assert all(len(batch.group_id[p]) == 2 * len(g) for p, g in zip(parts, groups))  # no group split
    assert sorted(torch.cat(parts).tolist()) == list(range(len(batch)))
    lengths = [max(PROMPT_LENGTHS[r] + RESPONSE_LENGTHS[r] for r in p.tolist()) for p in parts]
    assert lengths == sorted(lengths, reverse=True)
    split = [set(batch.group_id[p].tolist()) for p in plan(batch, 4)]
    assert any(a & b for i, a in enumerate(split) for b in split[i + 1:])  # by length alone, groups split


def test_by_group_follows_model_shared_prefix():
    batch = ragged_rows(40)  # groups of 2, each row its own prompt: the host-side rule counts what sharing would save
    assert by_group(batch, True) and not by_group(batch, False)
    assert by_group(batch, None)  # groups of 2 with prompts of 2-6 tokens and answers of 1-9: over 5% saved
