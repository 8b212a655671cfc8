"""`python -m rlhf.plan [overrides]`: print the memory plan of the run `python -m rlhf.train [overrides]` would
start, loading no weights. Exit 0 when it fits (or the capacity is unknown), 2 when it does not or the config is bad.
"""

from __future__ import annotations

import sys

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from rlhf import exits
from rlhf.checks import hub
from rlhf.config import ConfigError, compose_config, validate
from rlhf.plan import advise, plan_of, render
from rlhf.checks.layers import check_trained_layers


def main(argv: list[str]) -> int:
    """Compose, validate, find the models (not the datasets: the plan reads none, and they may live only where the run
    will), check the layers LoRA and compile name, plan, print; returns the exit code."""
    try:
        cfg = compose_config(argv)
        spec = validate(cfg)
        hub.check_sources(cfg, datasets=False)
        check_trained_layers(spec)
        plan = plan_of(spec)
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        print(f"config error: {str(err).splitlines()[0]}", file=sys.stderr)
        return exits.CONFIG_ERROR
    print(render(plan, advise(plan) if plan.fits is False else []))
    return exits.CONFIG_ERROR if plan.fits is False else exits.FINISHED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
