"""Per-token KL estimators k1 and k3, with x = logp - ref_logp."""

import pytest
import torch
from torch.testing import assert_close

from rlhf.functional import kl_per_token

# log-ratios x = logp - ref_logp of [0.5, -1, 0, 2, -2]
LOGP = torch.tensor([[-1.0, -2.0, -0.5, -0.1, -3.0]])
REF_LOGP = torch.tensor([[-1.5, -1.0, -0.5, -2.1, -1.0]])


def test_k1_is_the_log_ratio():
    """k1 = x, which can be negative."""
    assert_close(kl_per_token(LOGP, REF_LOGP, "k1"), torch.tensor([[0.5, -1.0, 0.0, 2.0, -2.0]]))


def test_k3_values():
    """k3 = exp(-x) - 1 + x:
    x=0.5: 0.6065307 - 0.5 = 0.1065307;  x=-1: 2.7182818 - 2 = 0.7182818;  x=0: 0;
    x=2: 0.1353353 + 1 = 1.1353353;      x=-2: 7.3890561 - 3 = 4.3890561.
    """
    expected = torch.tensor([[0.1065307, 0.7182818, 0.0, 1.1353353, 4.3890561]])
    assert_close(kl_per_token(LOGP, REF_LOGP, "k3"), expected, atol=1e-5, rtol=1e-6)


def test_k3_is_zero_when_policies_agree():
    """x = 0 everywhere (same logprobs) -> k3 exactly 0, k1 exactly 0."""
    logp = torch.tensor([[-0.3, -2.0, -7.0]])
    assert torch.equal(kl_per_token(logp, logp.clone(), "k3"), torch.zeros(1, 3))
    assert torch.equal(kl_per_token(logp, logp.clone(), "k1"), torch.zeros(1, 3))


def test_k3_is_never_negative():
    """k3 >= 0 for log-ratios from -10 to 10, including tiny ones near 0, while k1 goes negative."""
    x = torch.cat([torch.linspace(-10.0, 10.0, 201), torch.tensor([-1e-6, -1e-8, 1e-8, 1e-6])]).unsqueeze(0)
    ref = torch.full_like(x, -2.0)
    assert (kl_per_token(ref + x, ref, "k3") >= 0).all()
    assert (kl_per_token(ref + x, ref, "k1") < 0).any()


def test_k1_and_k3_are_unbiased_estimates_of_kl():
    """Averaged under p, both equal KL(p || q). p = [0.5, 0.5], q = [0.25, 0.75]:
    KL = 0.5 ln 2 + 0.5 ln(2/3) = 0.3465736 - 0.2027326 = 0.1438410.
    """
    p = torch.tensor([[0.5, 0.5]])
    q = torch.tensor([[0.25, 0.75]])
    for estimator in ("k1", "k3"):
        expectation = (p * kl_per_token(p.log(), q.log(), estimator)).sum()
        assert_close(expectation, torch.tensor(0.1438410), atol=1e-6, rtol=0)


def test_unknown_estimator_is_an_error():
    """Only k1, k2 and k3 exist."""
    with pytest.raises(ValueError, match="k4"):
        kl_per_token(LOGP, REF_LOGP, "k4")

