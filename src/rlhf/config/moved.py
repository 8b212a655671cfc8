"""Config keys that moved, and where to: an old key on the command line fails at once, naming its new place,
instead of Hydra's "not in struct"."""

from __future__ import annotations

from rlhf.errors import ConfigError

ROLE_NAMES = "policy, reference, critic, reward, generator"
MOVED = {  # old key -> new key
    "cluster.roles.actor": "cluster.roles.policy",
    "cluster.roles.ref": "cluster.roles.reference",
}


def check_overrides(overrides: list[str]) -> None:
    """ConfigError for the first override (``key=value``, ``+key=value``, ``~key``) that sets a key of `MOVED`, or a
    key under one, naming the key to write instead."""
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        for old, new in MOVED.items():
            if key == old or key.startswith(old + "."):
                raise ConfigError(
                    f"{key} moved to {new}{key[len(old):]} (roles are named as the parts they run: {ROLE_NAMES}); "
                    f"write {override.replace(old, new, 1)}"
                )
