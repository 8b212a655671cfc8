"""Per-token estimators of KL(policy || reference) from sampled tokens (Schulman's k1, k3), and the gap between two
models' logprobs on the same tokens."""

from __future__ import annotations

import torch

from rlhf.functional.masked import masked_mean


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL estimate at each sampled token. Shape: logp, ref_logp (B, T) -> (B, T).

    k1 = log p - log q (unbiased, can be negative); k2 = (log p - log q)^2 / 2 (biased, low variance,
    its gradient is that of the KL); k3 = q/p - 1 - log(q/p) (unbiased, never negative), where p is the
    policy and q the reference, both at the sampled token.
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def logprob_gap(gen_logp: torch.Tensor, train_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |gen - train| and the mean k3 KL(generator || trainer) over action tokens.

    Shapes: (B, T) each; ``mask`` 1.0 on action tokens. The tokens were sampled by the generator, so k3 estimates the
    KL of the generator's distribution from the trainer's."""
    diff = (gen_logp - train_logp).abs()
    return {
        "mean": masked_mean(diff, mask).item(),
        "max": (diff * mask).max().item() if mask.any() else 0.0,
        "k3": masked_mean(kl_per_token(gen_logp, train_logp, "k3"), mask).item(),
    }


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    def update(self, current_kl: float, n_samples: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Moves the coefficient so the measured KL tracks ``target`` (Ziegler et al., 2019).

    Each update multiplies the coefficient by 1 + clip(KL / target - 1, -0.2, 0.2) * n_samples / horizon.
    """

    def __init__(self, coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target} and {horizon}")
        self.value, self.target, self.horizon = coef, target, horizon

    def update(self, current_kl: float, n_samples: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon
