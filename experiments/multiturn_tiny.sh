#!/usr/bin/env bash
# Multi-turn RL on the built-in task: addition with one retry after a wrong answer (CPU, about a minute).
exec python -m rlhf.train experiment=multiturn_tiny "$@"
