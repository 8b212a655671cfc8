"""The error every user-facing config problem raises (kept apart so any module can raise it without cycles)."""


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and the fix."""


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ``ok``."""
    if not ok:
        raise ConfigError(message)
