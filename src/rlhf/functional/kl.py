"""Per-token estimators of KL(policy || reference) from sampled tokens (Schulman's k1, k3)."""

from __future__ import annotations

import torch


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL estimate at each sampled token. Shape: logp, ref_logp (B, T) -> (B, T).

    k1 = log p - log q (unbiased, can be negative); k3 = q/p - 1 - log(q/p) (unbiased, never negative),
    where p is the policy and q the reference, both at the sampled token.
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1 or k3")
