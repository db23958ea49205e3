#!/usr/bin/env bash
# The verl-style baseline for scripts/npu/grpo_qwen2.5_7b.sh: the same model, data and
# hyper-parameters, but synchronous (workflow.mode=sync) and colocated (every rank
# generates, then trains, in turn; placement.mode=colocated), as verl's hybrid engine.
# Compare throughput (summary.json tokens_per_s) and reward curves between the two.
#
# NOT RUN ON HARDWARE. Written against AsyncFlow's config and torchrun; no NPU, CANN,
# torch_npu, MindSpeed or vllm-ascend was available when it was written. Check it on a
# small NNODES first. Known gaps of the code it drives (README "Known limitations", docs/deploy.md,
# "Running on Ascend NPUs"):
#   - TransferQueue: ONE storage unit by default, in rank 0's process: every sample passes
#     through node 0. transfer_queue.storage_units=per_node puts one unit on each node (the
#     prompts still start on node 0); this script keeps the default.
#   - model.train_engine=mindspeed applies mindspeed.megatron_adaptor and then runs the
#     same FSDP2 loop as the fsdp engine: no tensor or pipeline parallelism.
#   - Each actor rank loads the full model in float32 on the host and moves it to its
#     device before sharding (7B: ~30 GB per rank, host RAM: 16 of them per node).
#   - Each rollout rank is one vLLM instance with tensor_parallel_size=1.
#   - Weight sync goes through host memory over gloo, from the first actor rank to every
#     rollout instance in turn: here every rank is an instance, so it grows with NPROC.
#   - Colocated vLLM is NOT put to sleep between phases: vLLM (gpu_memory_utilization
#     0.35) and the trainer share each device; lower it if the trainer runs out of memory.
#
# Run the same command on every node; only NODE_RANK differs:
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 MODEL_PATH=/models/Qwen2.5-7B-Instruct \
#     DATA_PATH=/shared/data/dsr.jsonl OUT_DIR=/shared/outputs/grpo7b_sync scripts/npu/grpo_qwen2.5_7b_sync_baseline.sh
# Data: python scripts/preprocess_math.py --format deepscaler --input deepscaler.json --output dsr.jsonl \
#         --instruction "Let's think step by step and output the final answer within \\boxed{}."
# Extra arguments are appended as config overrides (key=value). TORCHRUN=echo prints
# the command line instead of starting it. OUT_DIR must be on a filesystem shared by
# all actor ranks (the checkpoint is written by all of them).
set -euo pipefail

PLATFORM=npu TRAIN_ENGINE=mindspeed MODE=sync PLACEMENT_MODE=colocated
GPU_MEMORY_UTILIZATION=0.35 LR=1e-6
DEFAULT_NNODES=4 DEFAULT_NPROC_PER_NODE=16 DEFAULT_PROMPTS_PER_STEP=256
DEFAULT_MODEL_PATH=/models/Qwen2.5-7B-Instruct DEFAULT_OUT_DIR=outputs/grpo_qwen2.5_7b_npu_sync
SCRIPT_OVERRIDES=()
source "$(dirname "${BASH_SOURCE[0]}")/../lib/grpo_launch.sh"
