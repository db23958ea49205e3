#!/usr/bin/env bash
# GRPO on Qwen2.5-7B with DeepScaleR-style math prompts on NVIDIA GPUs (8 per node):
# the CUDA counterpart of scripts/npu/grpo_qwen2.5_7b.sh (async workflow, rollout and
# training on separate ranks; FSDP2 training engine, vLLM rollout).
#
# NOT RUN ON HARDWARE. Written against AsyncFlow's config and torchrun; no GPU was
# available when it was written. Check it with one node first. Known gaps of the code
# it drives (README "Known limitations", docs/deploy.md, docs/deploy.md "Running on GPUs"):
#   - TransferQueue: ONE storage unit by default, in rank 0's process: every sample passes
#     through node 0. transfer_queue.storage_units=per_node puts one unit on each node (the
#     prompts still start on node 0); this script keeps the default.
#   - FSDP2 data parallelism only (no tensor or pipeline parallelism).
#   - Each actor rank loads the full model in float32 on the host and moves it to its
#     device before sharding (7B: ~30 GB per rank, host RAM: 8 of them per node).
#   - Each rollout rank is one vLLM instance with tensor_parallel_size=1.
#   - Weight sync goes through host memory over gloo, from the first actor rank to every
#     rollout instance in turn: its cost grows with the number of rollout ranks.
#
# Run the same command on every node; only NODE_RANK differs:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MODEL_PATH=/models/Qwen2.5-7B-Instruct \
#     DATA_PATH=/shared/data/dsr.jsonl OUT_DIR=/shared/outputs/grpo7b scripts/gpu/grpo_qwen2.5_7b.sh
# With one node (the default) the 8 GPUs are split inside the node (3 training, 5 rollout).
# Data: python scripts/preprocess_math.py --format deepscaler --input deepscaler.json --output dsr.jsonl \
#         --instruction "Let's think step by step and output the final answer within \\boxed{}."
# Extra arguments are appended as config overrides (key=value). TORCHRUN=echo prints
# the command line instead of starting it. OUT_DIR must be on a filesystem shared by
# all actor ranks (the checkpoint is written by all of them).
set -euo pipefail

PLATFORM=cuda TRAIN_ENGINE=fsdp MODE=async PLACEMENT_MODE=disaggregated
GPU_MEMORY_UTILIZATION=0.8 LR=1e-6
DEFAULT_NNODES=1 DEFAULT_NPROC_PER_NODE=8 DEFAULT_PROMPTS_PER_STEP=256
DEFAULT_MODEL_PATH=/models/Qwen2.5-7B-Instruct DEFAULT_OUT_DIR=outputs/grpo_qwen2.5_7b_gpu
SCRIPT_OVERRIDES=()
source "$(dirname "${BASH_SOURCE[0]}")/../lib/grpo_launch.sh"
