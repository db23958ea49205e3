#!/usr/bin/env bash
# Shared body of the GRPO launch scripts in scripts/npu and scripts/gpu (sourced, not run).
# The caller sets PLATFORM, TRAIN_ENGINE, MODE, PLACEMENT_MODE, GPU_MEMORY_UTILIZATION and
# the DEFAULT_* values; everything else comes from the environment (see the callers'
# headers) and "$@" (extra config overrides).
# NOT RUN ON HARDWARE, like its callers.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

NNODES="${NNODES:-$DEFAULT_NNODES}"
NODE_RANK="${NODE_RANK:-0}"
NPROC_PER_NODE="${NPROC_PER_NODE:-$DEFAULT_NPROC_PER_NODE}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
MODEL_PATH="${MODEL_PATH:-$DEFAULT_MODEL_PATH}"
DATA_PATH="${DATA_PATH:-data/dsr.jsonl}"
EVAL_PATH="${EVAL_PATH:-}"
OUT_DIR="${OUT_DIR:-$DEFAULT_OUT_DIR}"
ROLLOUT_SHARE="${ROLLOUT_SHARE:-2/3}"
PROMPTS_PER_STEP="${PROMPTS_PER_STEP:-$DEFAULT_PROMPTS_PER_STEP}"
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
PLACEMENT=(placement.mode=colocated)
if [[ "$PLACEMENT_MODE" == disaggregated ]]; then
  PLACEMENT_OUT="$("$PYTHON" "$REPO/scripts/npu/placement.py" --nnodes "$NNODES" --per-node "$NPROC_PER_NODE" \
    --rollout-share "$ROLLOUT_SHARE")"
  mapfile -t PLACEMENT <<<"$PLACEMENT_OUT"
  PLACEMENT=(placement.mode=disaggregated "${PLACEMENT[@]}")
fi

if [[ "$PLATFORM" == npu ]]; then
  # The CANN environment, unless the caller has set it up already (set_env.sh reads unset variables).
  ASCEND_ENV="${ASCEND_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}"
  if [[ -z "${ASCEND_HOME_PATH:-}" && -f "$ASCEND_ENV" ]]; then
    set +u; source "$ASCEND_ENV"; set -u
  fi
  export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-1200}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

EVAL_ARGS=()
[[ -n "$EVAL_PATH" ]] && EVAL_ARGS=("data.eval_path=$EVAL_PATH")

ARGS=(
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
  -m asyncflow.cli train grpo
  "trainer.platform=$PLATFORM" "trainer.nproc=$NPROC"
  "model.path=$MODEL_PATH" "model.train_engine=$TRAIN_ENGINE" model.attn_implementation=sdpa
  data.task=file "data.path=$DATA_PATH" "${EVAL_ARGS[@]}" data.chat_template=true data.max_prompt_tokens=1024
  reward.name=math
  rollout.engine=vllm "rollout.n=$RESPONSES_PER_PROMPT" "rollout.max_new_tokens=$MAX_NEW_TOKENS"
  "rollout.batch_prompts=$BATCH_PROMPTS" rollout.temperature=1.0 "rollout.gpu_memory_utilization=$GPU_MEMORY_UTILIZATION"
  "workflow.mode=$MODE" workflow.max_staleness=1 workflow.call_timeout_s=3600
  "${PLACEMENT[@]}"
  warmup.enabled=false "optim.lr=$LR" optim.warmup_steps=10 "${SCRIPT_OVERRIDES[@]}"
  "trainer.prompts_per_step=$PROMPTS_PER_STEP" "trainer.steps=$STEPS" trainer.time_budget_s=0
  trainer.eval_every=25 "trainer.out_dir=$OUT_DIR" trainer.progress=false
  "$@"
)
echo "+ $TORCHRUN ${ARGS[*]}" >&2
if [[ -n "${LAUNCH_WARNING:-}" && "$TORCHRUN" == torchrun ]]; then echo "warning: $LAUNCH_WARNING" >&2; fi
exec "$TORCHRUN" "${ARGS[@]}"
