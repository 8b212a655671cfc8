"""Log-probabilities of labels and entropies from logits, on tiny vocabularies."""

import math

import torch
from torch.testing import assert_close

from rlhf.functional import entropy_from_logits, logprobs_from_logits

LN4 = 1.3862944  # ln 4


def test_uniform_logits_over_four_tokens():
    """Equal logits over V = 4: every label has logprob -ln 4, entropy ln 4 (shift-invariant)."""
    for value in (0.0, 7.0):
        logits = torch.full((2, 3, 4), value)
        labels = torch.tensor([[0, 1, 2], [3, 3, 0]])
        assert_close(logprobs_from_logits(logits, labels), torch.full((2, 3), -LN4))
        assert_close(entropy_from_logits(logits), torch.full((2, 3), LN4))


def test_logits_from_log_probabilities_recover_them():
    """logits ln [1, 2, 3, 4] -> p = [0.1, 0.2, 0.3, 0.4]:
    logp(0) = ln 0.1 = -2.3025851, logp(3) = ln 0.4 = -0.9162907;
    H = 0.1*2.3025851 + 0.2*1.6094379 + 0.3*1.2039728 + 0.4*0.9162907 = 1.2798542.
    """
    logits = torch.tensor([[[0.0, math.log(2), math.log(3), math.log(4)]] * 2])  # (1, 2, 4)
    labels = torch.tensor([[0, 3]])
    assert_close(logprobs_from_logits(logits, labels), torch.tensor([[-2.3025851, -0.9162907]]))
    assert_close(entropy_from_logits(logits), torch.tensor([[1.2798542, 1.2798542]]))


def test_each_position_uses_its_own_distribution_and_label():
    """V = 2, position 0 has logits [0, ln 3] (p = [0.25, 0.75]), position 1 is uniform.

    logp: label 1 at pos 0 = ln 0.75 = -0.2876821; label 0 at pos 1 = -ln 2 = -0.6931472.
    H: 0.25 ln 4 + 0.75 ln(4/3) = 0.3465736 + 0.2157616 = 0.5623351; uniform V=2: ln 2 = 0.6931472.
    """
    logits = torch.tensor([[[0.0, math.log(3)], [5.0, 5.0]]])
    labels = torch.tensor([[1, 0]])
    assert_close(logprobs_from_logits(logits, labels), torch.tensor([[-0.2876821, -0.6931472]]))
    assert_close(entropy_from_logits(logits), torch.tensor([[0.5623351, 0.6931472]]))


def test_near_deterministic_distribution():
    """One logit 100 above the others: its logprob ~0, others ~-100, entropy ~0."""
    logits = torch.tensor([[[100.0, 0.0, 0.0]]])
    assert_close(logprobs_from_logits(logits, torch.tensor([[0]])), torch.tensor([[0.0]]))
    assert_close(logprobs_from_logits(logits, torch.tensor([[2]])), torch.tensor([[-100.0]]))
    assert_close(entropy_from_logits(logits), torch.tensor([[0.0]]), atol=1e-6, rtol=0)


def test_low_precision_logits_are_computed_in_float32():
    """bfloat16 logits give float32 results with the same values (uniform V = 4)."""
    logits = torch.zeros(1, 2, 4, dtype=torch.bfloat16)
    logp = logprobs_from_logits(logits, torch.tensor([[1, 2]]))
    ent = entropy_from_logits(logits)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    assert_close(logp, torch.full((1, 2), -LN4))
    assert_close(ent, torch.full((1, 2), LN4))


def test_logprobs_gradient_is_onehot_minus_softmax():
    """d logp(label) / d logits = onehot(label) - p; uniform V = 4, label 2 -> [-.25, -.25, .75, -.25]."""
    logits = torch.zeros(1, 1, 4, requires_grad=True)
    logprobs_from_logits(logits, torch.tensor([[2]])).sum().backward()
    assert_close(logits.grad, torch.tensor([[[-0.25, -0.25, 0.75, -0.25]]]))


def test_entropy_with_minus_inf_logits_is_finite():
    """Logits [0, 0, -inf] are two equally likely tokens: entropy ln 2, not NaN."""
    logits = torch.tensor([[[0.0, 0.0, float("-inf")]]])
    assert_close(entropy_from_logits(logits), torch.tensor([[0.6931472]]))
