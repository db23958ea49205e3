#!/usr/bin/env bash
# GRPO on Qwen2.5-32B with DeepScaleR-style math prompts on Ascend NPUs: AsyncFlow's own
# setting (async workflow, rollout and training on separate nodes).
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
#   - EXPECT IT NOT TO START ON 64 GB DEVICES with the code as it is: each actor rank
#     loads the full model in float32 and moves it to its device before sharding
#     (32B: ~130 GB per device, and ~130 GB of host RAM per rank while loading), and each
#     rollout rank is one vLLM instance with tensor_parallel_size=1 (~65 GB of bf16
#     weights on one device). It needs meta-device loading in the FSDP engine and a
#     rollout tensor-parallel setting, neither of which exists yet.
#   - Weight sync goes through host memory over gloo, from the first actor rank to every
#     rollout instance in turn: its cost grows with the number of rollout ranks.
#
# Run the same command on every node; only NODE_RANK differs:
#   NNODES=16 NODE_RANK=0 MASTER_ADDR=node0 MODEL_PATH=/models/Qwen2.5-32B-Instruct \
#     DATA_PATH=/shared/data/dsr.jsonl OUT_DIR=/shared/outputs/grpo32b scripts/npu/grpo_qwen2.5_32b.sh
# Data: python scripts/preprocess_math.py --format deepscaler --input deepscaler.json --output dsr.jsonl \
#         --instruction "Let's think step by step and output the final answer within \\boxed{}."
# Extra arguments are appended as config overrides (key=value). TORCHRUN=echo prints
# the command line instead of starting it. OUT_DIR must be on a filesystem shared by
# all actor ranks (the checkpoint is written by all of them).
set -euo pipefail

PLATFORM=npu TRAIN_ENGINE=mindspeed MODE=async PLACEMENT_MODE=disaggregated
GPU_MEMORY_UTILIZATION=0.8 LR=5e-7
DEFAULT_NNODES=16 DEFAULT_NPROC_PER_NODE=16 DEFAULT_PROMPTS_PER_STEP=512
DEFAULT_MODEL_PATH=/models/Qwen2.5-32B-Instruct DEFAULT_OUT_DIR=outputs/grpo_qwen2.5_32b_npu
SCRIPT_OVERRIDES=(optim.micro_batch_tokens=4096)
LAUNCH_WARNING="see this script's header: the 32B model is not expected to fit with the current engines \
(full fp32 model per device before sharding; rollout tensor_parallel_size=1)"
source "$(dirname "${BASH_SOURCE[0]}")/../lib/grpo_launch.sh"
