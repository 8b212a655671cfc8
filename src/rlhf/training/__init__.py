"""Trained models: the policy and the critic, each an optimiser and a training strategy (single process, DDP, FSDP2,
DeepSpeed) around a model of `rlhf.models`; the collectives their ranks share."""
