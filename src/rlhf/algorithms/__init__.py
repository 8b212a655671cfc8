"""Algorithms composed from registered parts: advantage estimators (`advantages`), policy losses
(`policy_losses`), and the two shapes that wire them (`policy_gradient`, `pairwise`).

`build_algorithm(cfg.algorithm, max_new_tokens)` checks the composition (names, pairwise vs per-token parts) and
returns the algorithm object the `Learner` calls: `build_batch`, `denominator`, `policy_loss`, `value_loss`.
"""

from __future__ import annotations

from rlhf import registry
from rlhf.algorithms import advantages, policy_losses, rollout_corrections  # noqa: F401 (registers the built-in parts)
from rlhf.algorithms.base import AdvantageInputs, PolicyLoss, register_advantage, register_policy_loss
from rlhf.algorithms.pairwise import PairwisePreference
from rlhf.algorithms.policy_gradient import PolicyGradient
from rlhf.errors import ConfigError
from rlhf.registry import trait


def parts(cfg):
    """(advantage estimator, policy loss) that `algorithm.advantage` and `algorithm.policy_loss` name."""
    return (
        registry.resolve("advantage", cfg.advantage, key="algorithm.advantage"),
        registry.resolve("policy_loss", cfg.policy_loss, key="algorithm.policy_loss"),
    )


def rollout_correction(cfg):
    """The correction `algorithm.rollout_correction` names, or None when it is null."""
    if cfg.rollout_correction is None:
        return None
    return registry.resolve("rollout_correction", cfg.rollout_correction, key="algorithm.rollout_correction")


def names_with(kind: str, name: str) -> list[str]:
    """Registered names of ``kind`` whose part has the trait ``name`` set."""
    return [n for n in registry.names(kind) if trait(registry.resolve(kind, n), name, False)]


def check_composition(cfg) -> None:
    """ConfigError when the chosen parts do not fit together: a pairwise part with a per-token one, or a loss that
    reads a critic's values with an advantage estimator that trains none."""
    advantage, loss = parts(cfg)
    pairwise_adv, pairwise_loss = bool(trait(advantage, "pairwise", False)), bool(trait(loss, "pairwise", False))
    pairwise = names_with("policy_loss", "pairwise")
    per_token = [n for n in registry.names("policy_loss") if n not in pairwise]
    if pairwise_adv and not pairwise_loss:
        raise ConfigError(
            f"algorithm.policy_loss={cfg.policy_loss} trains on per-token advantages, but algorithm.advantage="
            f"{cfg.advantage} makes (chosen, rejected) pairs; choose a pairwise loss ({', '.join(pairwise)}) or a "
            f"per-token advantage"
        )
    if trait(loss, "needs_critic", False) and not trait(advantage, "needs_critic", False):
        with_critic = names_with("advantage", "needs_critic")
        raise ConfigError(
            f"algorithm.policy_loss={cfg.policy_loss} reads a critic's values, but algorithm.advantage={cfg.advantage} "
            f"trains no critic; choose algorithm.advantage={' or '.join(with_critic)}"
        )
    if pairwise_loss and not pairwise_adv:
        pair_makers = names_with("advantage", "pairwise")
        raise ConfigError(
            f"algorithm.policy_loss={cfg.policy_loss} trains on preference pairs, but algorithm.advantage={cfg.advantage} "
            f"gives per-token advantages; choose algorithm.advantage={' or '.join(pair_makers)}, or a per-token loss "
            f"({', '.join(per_token)})"
        )


def build_algorithm(cfg, max_new_tokens: int):
    """The algorithm `algorithm.*` composes (cheap: no model); ConfigError for a bad composition."""
    check_composition(cfg)
    advantage, loss = parts(cfg)
    if trait(advantage, "pairwise", False):
        return PairwisePreference(cfg, advantage, loss)
    return PolicyGradient(cfg, advantage, loss, max_new_tokens, rollout_correction(cfg))


__all__ = [
    "AdvantageInputs", "PairwisePreference", "PolicyGradient", "PolicyLoss", "build_algorithm", "check_composition",
    "register_advantage", "register_policy_loss",
]
