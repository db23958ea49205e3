#!/usr/bin/env bash
# One short check (about 4-5 minutes expected; every section time-limited so that even
# when all of them hang it ends in about 8) of AsyncFlow on a machine with one NVIDIA GPU and no
# internet. Sections, each with a time limit; a failing section is reported and the next
# one still runs, and the script exits non-zero at the end if any failed:
#   1. nvidia-smi, torch / CUDA / vLLM versions
#   2. build a ~104M-parameter Qwen2 (hidden 768, 12 layers, 12 heads, 4 KV heads, FFN 3072,
#      character tokenizer) offline into a temp dir, and print its parameter count
#   3. the GPU tests: pytest -k "(cuda or vllm or gpu) and not launch" (tests/engines/
#      test_rollout_vllm.py, the cuda cases of tests/test_platform.py; not the launch-script tests)
#   4. 5 async GRPO steps on that model, colocated on the one GPU, vLLM rollout when
#      `import vllm` works, else the built-in engine (and the built-in engine as a
#      fallback when the vLLM run fails and there is time left)
#   5. throughput: tokens/s per device (the run's summary.json) and weight-sync GB/s
#      (perf/bench_weight_sync.py: host-memory gloo sync between two processes, not
#      GPU-to-GPU)
# Everything printed also goes to $OUT/device_check.log when OUT is set; the run's small
# output files are copied to $OUT/grpo_run/. Knobs (for trying the script on a CPU):
#   PYTHON (python), DEVICE_CHECK_PLATFORM (cuda), DEVICE_CHECK_SPEC (768,12,12,4,3072).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
PLATFORM="${DEVICE_CHECK_PLATFORM:-cuda}"
SPEC="${DEVICE_CHECK_SPEC:-768,12,12,4,3072}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false

FAILED=()
heading() { printf '\n===== %s =====  (t=%ss)\n' "$1" "$SECONDS"; }
# step NAME TIMEOUT_S CMD...: run CMD with a time limit, note a failure and go on.
step() {
  local name="$1" limit="$2" rc=0
  shift 2
  timeout --kill-after=10 "$limit" "$@" || rc=$?
  if (( rc != 0 )); then
    if (( rc == 124 || rc == 137 )); then echo "!! $name: timed out after ${limit}s"; else echo "!! $name: exit $rc"; fi
    FAILED+=("$name")
  fi
  return 0
}

main() {
  local work
  work="$(mktemp -d "${TMPDIR:-/tmp}/asyncflow_device_check.XXXXXX")"
  cd "$REPO"
  echo "AsyncFlow device check: repo $REPO, work dir $work, platform $PLATFORM, $(date -u +%FT%TZ)"

  heading "1. nvidia-smi and versions"
  if command -v nvidia-smi >/dev/null; then step nvidia-smi 20 nvidia-smi; else echo "nvidia-smi: not found"; fi
  step versions 45 "$PYTHON" scripts/device_check.py env

  heading "2. build the ~100M-parameter Qwen2 model (offline, char tokenizer)"
  local model="$work/qwen2_100m"
  step build-model 90 "$PYTHON" scripts/device_check.py build-model "$model" --spec "$SPEC"

  heading "3. GPU tests (pytest -k 'cuda or vllm or gpu')"
  step pytest-gpu 140 "$PYTHON" -m pytest -q tests -k "(cuda or vllm or gpu) and not launch" -rs -p no:cacheprovider

  heading "4. async GRPO, 5 steps, colocated on one device"
  local engine=builtin
  if "$PYTHON" -c "import vllm" >/dev/null 2>&1; then engine=vllm; fi
  echo "rollout engine: $engine"
  local common=(trainer.platform="$PLATFORM" trainer.nproc=1 placement.mode=colocated "model.path=$model"
    model.attn_implementation=sdpa trainer.time_budget_s=0 trainer.steps=5 warmup.enabled=false
    reward.name=digits algorithm.dynamic_sampling=false trainer.prompts_per_step=8 rollout.n=4
    rollout.batch_prompts=4 rollout.max_new_tokens=16 rollout.gpu_memory_utilization=0.3
    data.num_eval=16 trainer.eval_every=0 trainer.progress=false workflow.call_timeout_s=150)
  local run="$work/run_$engine" limit=$(( 400 - SECONDS ))  # keep the whole script under ~8 minutes
  if (( limit > 200 )); then limit=200; elif (( limit < 60 )); then limit=60; fi
  step "grpo-$engine" "$limit" "$PYTHON" -m asyncflow.cli train grpo "${common[@]}" rollout.engine="$engine" \
    "trainer.out_dir=$run"
  if [[ "$engine" == vllm && ! -f "$run/summary.json" && $SECONDS -lt 300 ]]; then
    echo "the vLLM run did not finish: the same run with the built-in engine"
    run="$work/run_builtin"
    step grpo-builtin-fallback 100 "$PYTHON" -m asyncflow.cli train grpo "${common[@]}" rollout.engine=builtin \
      "trainer.out_dir=$run"
  fi

  heading "5. throughput"
  echo "tokens/s per device (summary.json of $run):"
  step summary 15 "$PYTHON" scripts/device_check.py summary "$run"
  echo "weight sync (perf/bench_weight_sync.py --mb 256: host memory over gloo, two processes):"
  step weight-sync 45 "$PYTHON" perf/bench_weight_sync.py --mb 256 --rounds 3

  if [[ -n "${OUT:-}" && -d "$run" ]]; then
    mkdir -p "$OUT/grpo_run"
    find "$run" -maxdepth 1 -type f -size -20M -exec cp {} "$OUT/grpo_run/" \;
  fi
  rm -rf "$work"

  heading "done in ${SECONDS}s"
  if (( ${#FAILED[@]} )); then
    echo "FAILED: ${FAILED[*]}"
    return 1
  fi
  echo "all sections passed"
}

if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  main "$@" 2>&1 | tee "$OUT/device_check.log"
else
  main "$@"
fi
