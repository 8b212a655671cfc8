"""Package layout that pyproject.toml alone cannot express: `conf/` and `examples/` at the root ship as `rlhf.conf`
and `rlhf.examples` (with `examples/agents/`)."""

from setuptools import find_packages, setup

setup(packages=find_packages("src") + ["rlhf.conf", "rlhf.examples", "rlhf.examples.agents"])
