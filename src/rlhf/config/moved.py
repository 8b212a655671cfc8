"""Config keys that moved, and where to: an old key on the command line (or in a YAML file) fails at once, naming
its new place, instead of Hydra's "not in struct"."""

from __future__ import annotations

from rlhf.errors import ConfigError
from rlhf.parts import GROUPS, PATHS

ROLES = "roles are named as the parts they run: policy, reference, critic, reward, generator"
PART_KEY = "a part's keys sit in its own node"
MOVED = {  # old key -> (new key, why)
    "cluster.roles.actor": ("cluster.roles.policy", ROLES),
    "cluster.roles.ref": ("cluster.roles.reference", ROLES),
    "algorithm.norm_adv_by_std": ("algorithm.advantage.norm_adv_by_std", PART_KEY),
    "algorithm.whiten_advantages": ("algorithm.advantage.whiten_advantages", PART_KEY),
    "algorithm.gamma": ("algorithm.advantage.gamma", PART_KEY),
    "algorithm.lam": ("algorithm.advantage.lam", PART_KEY),
    "algorithm.vf_coef": ("algorithm.advantage.vf_coef", PART_KEY + " (gae trains the critic)"),
    "algorithm.cliprange_value": ("algorithm.advantage.cliprange_value", PART_KEY + " (gae trains the critic)"),
    "algorithm.clip_eps_low": ("algorithm.policy_loss.clip_eps_low", PART_KEY),
    "algorithm.clip_eps_high": ("algorithm.policy_loss.clip_eps_high", PART_KEY),
    "algorithm.dual_clip_c": ("algorithm.policy_loss.dual_clip_c", PART_KEY),
    "algorithm.rollout_corr_clip": ("algorithm.rollout_correction.clip", PART_KEY),
    "algorithm.rollout_corr_low": ("algorithm.rollout_correction.low", PART_KEY),
    "algorithm.rollout_corr_high": ("algorithm.rollout_correction.high", PART_KEY),
    "algorithm.target_kl": ("algorithm.kl_ctl.target", PART_KEY + " (choose it with algorithm/kl_ctl=adaptive)"),
    "algorithm.kl_horizon": ("algorithm.kl_ctl.horizon", PART_KEY + " (choose it with algorithm/kl_ctl=adaptive)"),
}
PART_NODES = {path: group for path, group in PATHS.items() if path != group}  # nodes below a section: algorithm.policy_loss


def moved_to(key: str) -> tuple[str, str] | None:
    """(new key, why) for ``key`` or a key under it when it moved; None otherwise."""
    for old, (new, why) in MOVED.items():
        if key == old or key.startswith(old + "."):
            return new + key[len(old):], why
    return None


def check_overrides(overrides: list[str]) -> None:
    """ConfigError for the first override (``key=value``, ``+key=value``, ``~key``) that sets a key of `MOVED`, or a
    key under one, naming the key to write instead; and for a part node given a name (``algorithm.policy_loss=gspo``),
    naming the group override that chooses it (``algorithm/policy_loss=gspo``); and for a part group set to null,
    which Hydra cannot read, naming the override that turns the part off (``~algorithm/rollout_correction``)."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key in GROUPS and value in ("null", "None", "none"):
            raise ConfigError(f"{override}: a part group is turned off by removing its choice; write ~{key}")
        moved = moved_to(key)
        if moved is not None:
            new, why = moved
            raise ConfigError(f"{key} moved to {new} ({why}); write {override.replace(key, new, 1)}")
        if key in PART_NODES and value and not value.startswith("{"):
            group = PART_NODES[key]
            raise ConfigError(
                f"{key}={value}: a part is chosen as a node, with its own keys; write {group}={value} (a registered "
                f"name), or for a part of your own a YAML node of yours on hydra.searchpath ({group}=<its file name>, "
                f"holding `name: <import path>` and its keys)"
            )
