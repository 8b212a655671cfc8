"""Shared fixtures of the fault tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def restore_logging():
    """Put the root and `rlhf` loggers back as they were: an in-process `main()` lets Hydra point handlers at this
    test's captured stderr, which is closed once the test ends, so later tests' log lines would fail to write."""
    loggers = [logging.getLogger(), logging.getLogger("rlhf")]
    saved = [(logger, logger.handlers[:], logger.level, logger.propagate) for logger in loggers]
    yield
    for logger, handlers, level, propagate in saved:
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate
