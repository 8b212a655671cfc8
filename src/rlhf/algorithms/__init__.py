"""Algorithms composed from registered parts: advantage estimators and pair selectors (`advantages`), policy losses and
pairwise losses (`policy_losses`), and the two shapes that wire them (`policy_gradient`, `pairwise`).

Each part is chosen by a node of its own (`algorithm.advantage`, `algorithm.policy_loss`, `algorithm.rollout_correction`,
`algorithm.kl_ctl`; see `rlhf.parts`). `build_algorithm(cfg.algorithm, max_new_tokens)` types and checks every node,
checks the composition (pairwise vs per-token parts) and returns the algorithm object the `Learner` calls through the
protocol `rlhf.algorithms.base.Algorithm` (`prepare`, `denominator`, `micro_loss`, `late_metrics`, `end_step`).
"""

from __future__ import annotations

from rlhf import registry
from rlhf.algorithms import advantages, kl_controllers, policy_losses, rollout_corrections  # noqa: F401 (registers the built-in parts)
from rlhf.algorithms.base import (
    AdvantageInputs, Algorithm, Metrics, PolicyLoss, register_advantage, register_pair_selector, register_pairwise_loss,
    register_policy_loss,
)
from rlhf.algorithms.pairwise import PairwisePreference
from rlhf.algorithms.policy_gradient import PolicyGradient
from rlhf.errors import ConfigError
from rlhf.parts import Part, choose, choose_optional
from rlhf.registry import trait


def parts(cfg) -> tuple[Part, Part]:
    """(advantage estimator or pair selector, policy loss or pairwise loss): the parts the nodes `algorithm.advantage`
    and `algorithm.policy_loss` choose, each with its typed, checked config."""
    return choose("advantage", cfg.advantage, "algorithm.advantage"), choose("policy_loss", cfg.policy_loss, "algorithm.policy_loss")


def rollout_correction(cfg) -> Part | None:
    """The correction the node `algorithm.rollout_correction` chooses, or None when it is null."""
    return choose_optional("rollout_correction", cfg.rollout_correction, "algorithm.rollout_correction")


def kl_controller(cfg) -> Part | None:
    """The KL controller the node `algorithm.kl_ctl` chooses, or None when it is null (a fixed coefficient)."""
    return choose_optional("kl_controller", cfg.kl_ctl, "algorithm.kl_ctl")


def names_with(kind: str, name: str) -> list[str]:
    """Registered names of ``kind`` whose part has the trait ``name`` set."""
    return [n for n in registry.names(kind) if trait(registry.resolve(kind, n), name, False)]


def is_pairwise(advantage: Part, loss: Part) -> tuple[bool, bool]:
    """(the node `algorithm.advantage` chose a pair selector, the node `algorithm.policy_loss` a pairwise loss)."""
    return (
        registry.kind_of("advantage", advantage.name) == "pair_selector",
        registry.kind_of("policy_loss", loss.name) == "pairwise_loss",
    )


def check_composition(advantage: Part, loss: Part) -> None:
    """ConfigError when the chosen parts do not fit together: a pair selector with a policy loss, an advantage
    estimator with a pairwise loss, or a loss that reads a critic's values with an advantage estimator that trains
    none."""
    pairs, pairwise_loss = is_pairwise(advantage, loss)
    if pairs and not pairwise_loss:
        raise ConfigError(
            f"algorithm.policy_loss={loss.name} is a policy loss on per-token advantages, but algorithm.advantage="
            f"{advantage.name} is a pair selector, making (chosen, rejected) pairs; choose a pairwise loss (algorithm/"
            f"policy_loss={' or '.join(registry.names('pairwise_loss'))}) or an advantage estimator"
            + (f" (a pairwise loss of your own declares its kind: `{loss.name.rpartition('.')[2]}.kind = "
               f"\"pairwise_loss\"`)" if loss.name not in registry.names("policy_loss") else "")
        )
    if loss.trait("needs_critic", False) and not advantage.trait("needs_critic", False):
        with_critic = names_with("advantage", "needs_critic")
        raise ConfigError(
            f"algorithm.policy_loss={loss.name} reads a critic's values, but algorithm.advantage={advantage.name} "
            f"trains no critic; choose algorithm/advantage={' or '.join(with_critic)}"
        )
    if pairwise_loss and not pairs:
        raise ConfigError(
            f"algorithm.policy_loss={loss.name} is a pairwise loss on preference pairs, but algorithm.advantage="
            f"{advantage.name} is an advantage estimator, giving per-token advantages; choose a pair selector "
            f"(algorithm/advantage={' or '.join(registry.names('pair_selector'))}), or a policy loss "
            f"({', '.join(registry.names('policy_loss'))})"
        )


def build_algorithm(cfg, max_new_tokens: int):
    """The algorithm `algorithm.*` composes (cheap: no model); ConfigError for a bad part node or composition. ``cfg``:
    the `algorithm` node, or its typed copy `RunSpec.algorithm_keys` (part nodes as dicts)."""
    advantage, loss = parts(cfg)
    check_composition(advantage, loss)
    if is_pairwise(advantage, loss)[0]:
        if cfg.distill_coef != 0:
            raise ConfigError(
                f"algorithm.distill_coef={cfg.distill_coef} adds the teacher's signal to per-token advantages, and "
                f"algorithm.advantage={advantage.name} makes preference pairs; set algorithm.distill_coef=0 or choose a "
                f"per-token algorithm"
            )
        return PairwisePreference(cfg, advantage, loss)
    return PolicyGradient(cfg, advantage, loss, max_new_tokens, rollout_correction(cfg), kl_controller(cfg))


__all__ = [
    "AdvantageInputs", "Algorithm", "Metrics", "PairwisePreference", "PolicyGradient", "PolicyLoss", "build_algorithm",
    "check_composition", "register_advantage", "register_pair_selector", "register_pairwise_loss", "register_policy_loss",
]
