"""The RL math as pure tensor functions: no models, no config, each testable on hand-made tensors.

Shapes: B = sequences in a batch, T = tokens of the action window (see `rlhf.trajectory`), V = vocabulary, G = samples per prompt
(P groups; ragged groups, of different sizes, where failed episodes left some short).
"""

from rlhf.functional.advantages import (
    GroupSizes,
    baseline_advantages,
    best_and_worst,
    discounted_returns,
    greedy_baseline_advantages,
    group_means,
    group_normalized_advantages,
    rebn_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    to_token_level,
    turn_returns,
)
from rlhf.functional.distill import reverse_kl, teacher_signal
from rlhf.functional.fused_logprobs import fused_logprobs
from rlhf.functional.gae import gae_advantages, last_token_index, token_level_rewards
from rlhf.functional.importance import (
    geometric_rejection_weights,
    masked_is_weights,
    sequence_truncated_is_weights,
    truncated_is_weights,
)
from rlhf.functional.kl import AdaptiveKLController, FixedKLController, kl_per_token
from rlhf.functional.logprobs import entropy_from_logits, logprobs_from_logits
from rlhf.functional.losses import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    cispo_policy_loss,
    clipped_policy_loss,
    clipped_value_loss,
    dpo_loss,
    gspo_policy_loss,
    importance_sampling_loss,
    loss_denominator,
)
from rlhf.functional.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlhf.functional.shaping import overlong_penalty

__all__ = [
    "GroupSizes",
    "best_and_worst",
    "group_means",
    "reverse_kl",
    "teacher_signal",
    "baseline_advantages",
    "discounted_returns",
    "greedy_baseline_advantages",
    "reinforce_pp_advantages",
    "geometric_rejection_weights",
    "masked_is_weights",
    "sequence_truncated_is_weights",
    "cispo_policy_loss",
    "group_normalized_advantages",
    "rebn_advantages",
    "rloo_advantages",
    "to_token_level",
    "turn_returns",
    "fused_logprobs",
    "gae_advantages",
    "last_token_index",
    "token_level_rewards",
    "AdaptiveKLController",
    "FixedKLController",
    "kl_per_token",
    "entropy_from_logits",
    "logprobs_from_logits",
    "LOSS_AGGREGATIONS",
    "aggregate_loss",
    "clipped_policy_loss",
    "clipped_value_loss",
    "dpo_loss",
    "gspo_policy_loss",
    "importance_sampling_loss",
    "loss_denominator",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "truncated_is_weights",
]
