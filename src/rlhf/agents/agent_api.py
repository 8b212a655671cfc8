"""What an agent file is given (`AgentTask`, `ClientConfig`) and how it is loaded (`load_agent`)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from rlhf.envs.agent_func import check_function, load_module
from rlhf.errors import ConfigError

_EXAMPLE = "async def run(task, client): ... return reward"
BUILTIN = "builtin:"  # `env.path=builtin:agents/arith_retry.py`: a file of the examples shipped with the package


@dataclass(frozen=True)
class AgentTask:
    """What an agent is asked to do in one episode."""

    prompt: str  # the dataset row's prompt text
    label: Any  # its ground truth
    seed: int  # the episode's reset seed (shared by the episodes of one group)


@dataclass(frozen=True)
class ClientConfig:
    """How an agent reaches its session."""

    base_url: str  # the session's OpenAI base URL: http://127.0.0.1:<port>/sessions/<id>/v1
    api_key: str  # the session's key (the endpoint also finds the session by it on the plain /v1 routes)
    model: str  # the model name to ask for (`env.model_name`)
    session_id: str  # the session's id (in its URLs)
    reward_url: str  # POST {"reward": x, "finished": bool} here, with `headers`, to add to the episode's reward

    @property
    def headers(self) -> dict[str, str]:
        """The session's key as an HTTP header: every session URL (a reward post too) answers 401 without it."""
        return {"Authorization": f"Bearer {self.api_key}"}

    def environ(self) -> dict[str, str]:
        """Environment variables for a program that reads OpenAI's."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model}


def load_agent(path: str | None):
    """The ``run`` function of the agent file ``path``, checked, or ConfigError naming `env.path` and the fix."""
    if not path:
        raise ConfigError(f"env.name=openai_agent needs env.path=<a Python file defining `{_EXAMPLE}`>")
    file = Path(str(resources.files("rlhf.examples"))) / path[len(BUILTIN) :] if path.startswith(BUILTIN) else Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"env.path={path!r} is not a file; give the Python file that defines `{_EXAMPLE}`")
    run = getattr(load_module(file, path), "run", None)
    if run is None:
        raise ConfigError(f"env.path={path!r} defines no `run`; add `{_EXAMPLE}`")
    check_function(run, "run", ("task", "client"), path)
    return run
