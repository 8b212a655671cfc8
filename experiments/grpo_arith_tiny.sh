#!/usr/bin/env bash
# GRPO on the built-in addition task with the built-in tiny model (CPU, about 10 s).
exec python -m rlhf.train experiment=grpo_arith_tiny "$@"
