#!/usr/bin/env bash
# GRPO with Qwen2.5-0.5B-Instruct on two-digit addition, on one GPU.
exec python -m rlhf.train experiment=grpo_arith_qwen2_5_0_5b "$@"
