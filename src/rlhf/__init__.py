"""rlhf: reinforcement learning from feedback for language models."""

__version__ = "0.1.0"
