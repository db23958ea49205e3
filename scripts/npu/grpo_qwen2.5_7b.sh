#!/usr/bin/env bash
# GRPO on Qwen2.5-7B with DeepScaleR-style math prompts on Ascend NPUs: AsyncFlow's own
# setting (async workflow, rollout and training on separate nodes).
#
# NOT RUN ON HARDWARE. Written against AsyncFlow's config and torchrun; no NPU, CANN,
# torch_npu, MindSpeed or vllm-ascend was available when it was written. Check it on a
# small NNODES first. Known gaps of the code it drives (README "Known limitations",
# "Running on Ascend NPUs"):
#   - TransferQueue: ONE storage unit, in rank 0's process; every sample passes through
#     node 0. Per-node storage units are not wired into `asyncflow train` yet, so this
#     script sets no transfer_queue key (none exists).
#   - model.train_engine=mindspeed applies mindspeed.megatron_adaptor and then runs the
#     same FSDP2 loop as the fsdp engine: no tensor or pipeline parallelism.
#   - Each actor rank loads the full model in float32 on the host and moves it to its
#     device before sharding (7B: ~30 GB per rank, host RAM: 16 of them per node).
#   - Each rollout rank is one vLLM instance with tensor_parallel_size=1.
#   - Weight sync goes through host memory over gloo, from the first actor rank to every
#     rollout instance in turn: its cost grows with the number of rollout ranks.
#
# Run the same command on every node; only NODE_RANK differs:
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 MODEL_PATH=/models/Qwen2.5-7B-Instruct \
#     DATA_PATH=/shared/data/dsr.jsonl OUT_DIR=/shared/outputs/grpo7b scripts/npu/grpo_qwen2.5_7b.sh
# Data: python scripts/preprocess_math.py --format deepscaler --input deepscaler.json --output dsr.jsonl \
#         --instruction "Let's think step by step and output the final answer within \\boxed{}."
# Extra arguments are appended as config overrides (key=value). TORCHRUN=echo prints
# the command line instead of starting it. OUT_DIR must be on a filesystem shared by
# all actor ranks (the checkpoint is written by all of them).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"

NNODES="${NNODES:-4}"
NODE_RANK="${NODE_RANK:-0}"
NPROC_PER_NODE="${NPROC_PER_NODE:-16}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
MODEL_PATH="${MODEL_PATH:-/models/Qwen2.5-7B-Instruct}"
DATA_PATH="${DATA_PATH:-data/dsr.jsonl}"
EVAL_PATH="${EVAL_PATH:-}"
OUT_DIR="${OUT_DIR:-outputs/grpo_qwen2.5_7b_npu}"
ROLLOUT_SHARE="${ROLLOUT_SHARE:-2/3}"
PROMPTS_PER_STEP="${PROMPTS_PER_STEP:-256}"
RESPONSES_PER_PROMPT="${RESPONSES_PER_PROMPT:-8}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-4096}"
BATCH_PROMPTS="${BATCH_PROMPTS:-4}"
STEPS="${STEPS:-200}"
TORCHRUN="${TORCHRUN:-torchrun}"
PYTHON="${PYTHON:-python3}"

die() { echo "$(basename "$0"): $*" >&2; exit 2; }
for v in NNODES NPROC_PER_NODE MASTER_PORT; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive integer, got '${!v}'"
done
[[ "$NODE_RANK" =~ ^[0-9]+$ ]] && (( NODE_RANK < NNODES )) \
  || die "NODE_RANK must be an integer in 0..$((NNODES - 1)), got '$NODE_RANK'"
[[ -e "$MODEL_PATH" ]] || echo "warning: MODEL_PATH $MODEL_PATH does not exist on this node" >&2
[[ -e "$DATA_PATH" ]] || echo "warning: DATA_PATH $DATA_PATH does not exist on this node" >&2

NPROC=$((NNODES * NPROC_PER_NODE))
PLACEMENT_OUT="$("$PYTHON" "$HERE/placement.py" --nnodes "$NNODES" --per-node "$NPROC_PER_NODE" \
  --rollout-share "$ROLLOUT_SHARE")"
mapfile -t PLACEMENT <<<"$PLACEMENT_OUT"

# The CANN environment, unless the caller has set it up already (set_env.sh reads unset variables).
ASCEND_ENV="${ASCEND_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}"
if [[ -z "${ASCEND_HOME_PATH:-}" && -f "$ASCEND_ENV" ]]; then
  set +u; source "$ASCEND_ENV"; set -u
fi
export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-1200}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

EVAL_ARGS=()
[[ -n "$EVAL_PATH" ]] && EVAL_ARGS=("data.eval_path=$EVAL_PATH")

ARGS=(
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
  -m asyncflow.cli train grpo
  trainer.platform=npu "trainer.nproc=$NPROC"
  "model.path=$MODEL_PATH" model.train_engine=mindspeed model.attn_implementation=sdpa
  data.task=file "data.path=$DATA_PATH" "${EVAL_ARGS[@]}" data.chat_template=true data.max_prompt_tokens=1024
  reward.name=math
  rollout.engine=vllm "rollout.n=$RESPONSES_PER_PROMPT" "rollout.max_new_tokens=$MAX_NEW_TOKENS"
  "rollout.batch_prompts=$BATCH_PROMPTS" rollout.temperature=1.0 rollout.gpu_memory_utilization=0.8
  workflow.mode=async workflow.max_staleness=1 workflow.call_timeout_s=3600
  placement.mode=disaggregated "${PLACEMENT[@]}"
  warmup.enabled=false optim.lr=1e-6 optim.warmup_steps=10
  "trainer.prompts_per_step=$PROMPTS_PER_STEP" "trainer.steps=$STEPS" trainer.time_budget_s=0
  trainer.eval_every=25 "trainer.out_dir=$OUT_DIR" trainer.progress=false
  "$@"
)
echo "+ $TORCHRUN ${ARGS[*]}" >&2
exec "$TORCHRUN" "${ARGS[@]}"
