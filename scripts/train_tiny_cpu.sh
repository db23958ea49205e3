#!/usr/bin/env bash
# The default run (GRPO, async, disaggregated) under torchrun: the same as `asyncflow train`.
# Extra arguments are config overrides, e.g.  scripts/train_tiny_cpu.sh workflow.mode=sync
set -euo pipefail
exec torchrun --standalone --nproc-per-node "${NPROC:-2}" -m asyncflow.cli train grpo "$@"
