"""Package layout that pyproject.toml alone cannot express: `conf/` at the root ships as `rlhf.conf`."""

from setuptools import find_packages, setup

setup(packages=find_packages("src") + ["rlhf.conf"])
