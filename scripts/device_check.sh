#!/usr/bin/env bash
# One short check (about 5 minutes expected; every section time-limited so that even
# when all of them hang it ends in about 9 and a half) of AsyncFlow on a machine with one NVIDIA GPU and no
# internet. Sections, each with a time limit; a failing section is reported and the next
# one still runs, and the script exits non-zero at the end if any failed:
#   1. nvidia-smi, torch / CUDA / vLLM versions
#   2. build a ~104M-parameter Qwen2 (hidden 768, 12 layers, 12 heads, 4 KV heads, FFN 3072,
#      character tokenizer) offline into a temp dir, and print its parameter count
#   2b. on the device, world 1 over the platform's backend: the FSDP2 engine built on meta and loaded
#      from that model's safetensors (checked equal), its log-probs and training step in fp32 and bf16,
#      padded and padding-free, with activation checkpointing (lower peak memory), tokens/s of each;
#      the built-in rollout engine's tokens/s in bf16 (scripts/device_check.py scale)
#   3. the GPU tests: pytest -k "(cuda or vllm or gpu) and not launch" (tests/engines/
#      test_vllm_real.py over the CUDA vLLM when it imports, tests/engines/test_rollout_vllm.py,
#      the CUDA IPC hand-over of tests/engines/test_vllm_ipc_cuda.py, the
#      cuda cases of tests/test_platform.py; not the launch-script tests)
#   3b. vLLM's request API (VLLMRolloutEngine add_request / step / load_weights) on a tiny
#      Qwen2: requests stepped one by one, weights swapped mid-generation in "keep" and in
#      "recompute" mode, per-token versions and log-probs checked against the HF model of each
#      version, an over-long prompt answered with an error for itself alone (skipped, with a
#      message, without vLLM or CUDA)
#   4. 5 async GRPO steps on that model, colocated on the one GPU, vLLM rollout when
#      `import vllm` works, else the built-in engine (and the built-in engine as a
#      fallback when the vLLM run fails and there is time left)
#   5. throughput: tokens/s per device (the run's summary.json) and weight-sync GB/s
#      (perf/bench_weight_sync.py: host-memory gloo sync between two processes, not
#      GPU-to-GPU)
#   6. (only with DEVICE_CHECK_MODES=STEPS) the same colocated job at 256 rows x 64 new tokens a step,
#      sync and async in turns, twice each, STEPS RL steps a run: samples/s and tokens/s of each run
#      and the async/sync ratio of each pair (scripts/device_check.py modes)
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
# write_vllm_request_check FILE: section 3b's Python check (a file, not stdin: vLLM's spawned
# workers import the main module by path, which the __main__ guard keeps from running again).
write_vllm_request_check() {
  cat >"$1" <<'PY'
"""VLLMRolloutEngine's request API on a tiny Qwen2: step requests, swap weights mid-generation."""
import json
import sys
import tempfile

import torch


def ref_log_probs(model, prefix, tokens, temperature=1.0):
    with torch.inference_mode():
        logits = model(torch.cat([prefix, tokens])[None]).logits[0, prefix.numel() - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, tokens[:, None]).squeeze(-1)


def main() -> int:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken vllm install fails with more than ImportError
        print(f"SKIP: vLLM is not importable ({type(e).__name__}); the vLLM request path was NOT checked")
        return 0
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device; the vLLM request path was NOT checked")
        return 0
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from asyncflow.engines.rollout.base import GenerationRequest, SamplingParams
    from asyncflow.engines.rollout.vllm import VLLMRolloutEngine

    def tiny(seed):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(Qwen2Config(
            vocab_size=64, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=512, pad_token_id=0,
            eos_token_id=1, bos_token_id=1)).eval()

    path = tempfile.mkdtemp(prefix="asyncflow_vllm_requests_")
    m0, m1 = tiny(0), tiny(1)
    m0.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, 64)}}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>").save_pretrained(path)
    engine = VLLMRolloutEngine(path, dtype="float32", gpu_memory_utilization=0.2, max_model_len=128, enforce_eager=True)
    print(f"engine on devices {engine.devices}, native recompute: {engine.stats()['native_recompute']}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (4 + i,), generator=g) for i in range(6)]
    held, problems, report = {0: m0}, [], {}
    for mode, new in (("keep", m1), ("recompute", m0)):
        for i, p in enumerate(prompts):
            engine.add_request(GenerationRequest(f"{mode}-{i}", p, SamplingParams(max_new_tokens=24), seed=i))
        engine.add_request(GenerationRequest(f"{mode}-long", torch.full((200,), 5), SamplingParams(max_new_tokens=4)))
        out, steps, old = {}, 0, engine.version
        while engine.has_work():
            out.update({r.request_id: r for r in engine.step()})
            steps += 1
            if steps == 6:  # mid-generation: every row has at most 6 tokens
                engine.load_weights(new.state_dict(), engine.version + 1, mode=mode)
                held[engine.version] = new
        long = out.pop(f"{mode}-long", None)
        if long is None or long.finish_reason != "error" or not long.error:
            problems.append(f"{mode}: the over-long prompt did not come back as an error ({long})")
        crossed, worst = 0, 0.0
        for i, p in enumerate(prompts):
            r = out.get(f"{mode}-{i}")
            if r is None or r.finish_reason not in ("stop", "length"):
                problems.append(f"{mode}-{i}: did not finish ({r})")
                continue
            vs = r.token_versions.tolist()
            if vs != sorted(vs) or not set(vs) <= {old, engine.version} or len(vs) != r.log_probs.numel():
                problems.append(f"{mode}-{i}: per-token versions {vs} (swap {old} -> {engine.version})")
            crossed += len(set(vs)) == 2
            n_old = vs.count(old)
            spans = [(0, n_old, held[old])]  # before the swap: prompt and tokens all of the old weights
            if mode == "recompute" and n_old < len(vs):  # after it: KV recomputed with the new weights
                spans.append((n_old, len(vs), held[engine.version]))
            for a, b, model in spans:
                ref = ref_log_probs(model, torch.cat([p, r.response_ids[:a]]), r.response_ids[a:b])
                worst = max(worst, (r.log_probs[a:b] - ref).abs().max().item())
        if crossed == 0:
            problems.append(f"{mode}: no request ran across the swap")
        if worst > 2e-3:
            problems.append(f"{mode}: log-probs differ from the HF model of their version by {worst:.2e}")
        report[mode] = {"rows_across_swap": crossed, "max_log_prob_diff": worst, "steps": steps}
        print(f"{mode}: {crossed}/6 rows ran across the swap {old} -> {engine.version}, {steps} steps, "
              f"max |log-prob - HF| {worst:.1e}")
    print(json.dumps({"vllm_requests": report, "stats": engine.stats(), "problems": problems}))
    for p in problems:
        print(f"!! {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
PY
}

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

  heading "2b. training engine options and built-in rollout throughput on the device"
  step scale 150 "$PYTHON" scripts/device_check.py scale "$model" --platform "$PLATFORM"

  heading "3. GPU tests (pytest -k 'cuda or vllm or gpu')"
  step pytest-gpu 140 "$PYTHON" -m pytest -q tests -k "(cuda or vllm or gpu) and not launch" -rs -p no:cacheprovider

  heading "3b. vLLM request API: steps, weight swaps mid-generation (keep, recompute)"
  write_vllm_request_check "$work/vllm_request_check.py"
  step vllm-requests 150 "$PYTHON" "$work/vllm_request_check.py"

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
  local mode_steps="${DEVICE_CHECK_MODES:-0}"
  if (( mode_steps > 0 )); then
    heading "6. sync and async in turns, ${mode_steps} RL steps a run (256 rows x 64 new tokens a step)"
    local runs=()
    for round in 1 2; do
      for mode in sync async; do
        run="$work/mode_${mode}_$round"
        step "mode-$mode-$round" 180 "$PYTHON" -m asyncflow.cli train grpo "${common[@]}" rollout.engine=builtin \
          trainer.steps="$mode_steps" trainer.prompts_per_step=32 rollout.n=8 rollout.batch_prompts=32 \
          rollout.max_new_tokens=64 workflow.mode="$mode" "trainer.out_dir=$run"
        runs+=("$run")
      done
    done
    step modes 15 "$PYTHON" scripts/device_check.py modes "${runs[@]}"
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
