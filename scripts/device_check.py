#!/usr/bin/env python
"""The Python parts of scripts/device_check.sh (one short check on a machine with a GPU).

    python scripts/device_check.py env                    # torch / CUDA / vLLM versions, devices
    python scripts/device_check.py build-model DIR        # a ~100M-parameter Qwen2 (char tokenizer), offline
    python scripts/device_check.py summary RUN_DIR        # tokens/s (and per device) from a run's summary.json
    python scripts/device_check.py modes RUN_DIR...       # samples/s of sync/async runs taken in turns
    python scripts/device_check.py scale MODEL_DIR        # the training engine's options and the built-in
                                                          # engine's tokens/s on the device

`build-model --spec hidden,layers,heads,kv_heads,ffn` picks another shape (the shell
script's smoke test on a CPU uses a tiny one). Each command ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_SPEC = "768,12,12,4,3072"  # hidden, layers, heads, kv heads, FFN: ~104M parameters with tied embeddings


def cmd_env(_: argparse.Namespace) -> int:
    import torch
    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, device_memory_gib=round(p.total_memory / 2**30, 1),
                    capability=f"{p.major}.{p.minor}", bf16=torch.cuda.is_bf16_supported(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    for name in ("transformers", "vllm", "flash_attn"):
        try:
            mod = __import__(name)
            info[name] = getattr(mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - vllm can fail with more than ImportError
            info[name] = f"not importable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    for k, v in info.items():
        print(f"  {k:<18} {v}")
    print(json.dumps(info))
    return 0


def parse_spec(text: str) -> dict[str, int]:
    try:
        hidden, layers, heads, kv, ffn = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--spec {text!r}: expected five integers hidden,layers,heads,kv_heads,ffn") from None
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": ffn}


def expected_parameters(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                        tied: bool = True) -> int:
    """Qwen2 parameter count: q/k/v projections with bias, o without, SwiGLU MLP, 2 RMSNorms per layer."""
    kv_dim = hidden // heads * kv_heads
    attn = (hidden * hidden + hidden) + 2 * (hidden * kv_dim + kv_dim) + hidden * hidden
    mlp = 3 * hidden * ffn
    per_layer = attn + mlp + 2 * hidden
    embed = vocab * hidden
    return embed * (1 if tied else 2) + layers * per_layer + hidden


def cmd_build_model(a: argparse.Namespace) -> int:
    import time

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncflow.models.char_tokenizer import char_vocab
    from asyncflow.models.tiny import TinyModelSpec, build_tiny_model

    shape = parse_spec(a.spec)
    spec = TinyModelSpec(**shape, max_position_embeddings=a.max_positions, attn_implementation="sdpa", seed=0)
    t0 = time.perf_counter()
    out = build_tiny_model(a.out_dir, spec)
    build_s = time.perf_counter() - t0
    cfg = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    counted = sum(p.numel() for p in model.parameters())  # parameters() skips the tied lm_head
    expected = expected_parameters(len(char_vocab()), shape["hidden_size"], shape["num_hidden_layers"],
                                   shape["num_attention_heads"], shape["num_key_value_heads"],
                                   shape["intermediate_size"])
    size_mb = sum(f.stat().st_size for f in Path(out).glob("*.safetensors")) / 2**20
    info = {"model_dir": str(out), **shape, "vocab": len(char_vocab()), "parameters": counted,
            "parameters_expected": expected, "parameters_m": round(counted / 1e6, 1),
            "safetensors_mb": round(size_mb, 1), "build_s": round(build_s, 1)}
    print(f"  {counted:,} parameters ({counted / 1e6:.1f}M; formula: {expected:,}), "
          f"{size_mb:.0f} MB of safetensors, built in {build_s:.1f} s")
    print(json.dumps(info))
    if counted != expected:
        print(f"device_check: parameter count {counted} differs from the formula's {expected}", file=sys.stderr)
        return 1
    return 0


def cmd_summary(a: argparse.Namespace) -> int:
    run = Path(a.run_dir)
    path = run / "summary.json"
    if not path.is_file():
        print(f"device_check: {path} does not exist (the run did not finish)", file=sys.stderr)
        return 1
    s = json.loads(path.read_text())
    nproc = 1
    cfg_path = run / "config.json"
    if cfg_path.is_file():
        nproc = int(json.loads(cfg_path.read_text()).get("trainer", {}).get("nproc", 1))
    tps = float(s.get("tokens_per_s", float("nan")))
    info = {"rl_steps": s.get("rl_steps"), "rl_s": s.get("rl_s"), "nproc": nproc, "tokens_per_s": tps,
            "tokens_per_s_per_device": tps / max(nproc, 1), "samples_per_s": s.get("samples_per_s"),
            "staleness_mean": s.get("staleness_mean"), "idle_ratio": s.get("idle_ratio")}
    print(f"  {info['rl_steps']} RL steps in {float(info['rl_s'] or 0):.1f} s: {tps:.1f} tokens/s, "
          f"{info['tokens_per_s_per_device']:.1f} tokens/s per device ({nproc} device(s))")
    print(json.dumps(info))
    return 0


def cmd_modes(a: argparse.Namespace) -> int:
    """Runs given as sync, async, sync, async...: each run's rates and each pair's async/sync ratio."""
    rows, missing = [], []
    for run in map(Path, a.run_dirs):
        path = run / "summary.json"
        if not path.is_file():
            missing.append(str(run))
            continue
        s = json.loads(path.read_text())
        mode = json.loads((run / "config.json").read_text())["workflow"]["mode"]
        rows.append({"run": run.name, "mode": mode, "rl_steps": s.get("rl_steps"), "rl_s": s.get("rl_s"),
                     "samples_per_s": s.get("samples_per_s"), "tokens_per_s": s.get("tokens_per_s")})
        print(f"  {run.name:<16} {mode:<5} {s.get('rl_steps')} steps in {float(s.get('rl_s') or 0):6.1f} s  "
              f"{float(s.get('samples_per_s') or 0):8.1f} samples/s  {float(s.get('tokens_per_s') or 0):9.1f} tokens/s")
    ratios = [b["samples_per_s"] / a_["samples_per_s"] for a_, b in zip(rows[::2], rows[1::2])
              if a_["mode"] == "sync" and b["mode"] == "async" and a_["samples_per_s"]]
    if ratios:
        print(f"  async/sync samples/s per pair: {', '.join(f'{r:.2f}' for r in ratios)}")
    print(json.dumps({"modes": rows, "ratio_async_vs_sync_samples_per_s": ratios, "missing": missing}))
    return 1 if missing else 0


def _scale_batch(vocab: int, rows: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(torch.randint(16, 65, (1,), generator=g)),), generator=g)
               for _ in range(rows)]
    responses = [torch.randint(3, vocab, (int(torch.randint(32, 257, (1,), generator=g)),), generator=g)
                 for _ in range(rows)]
    fields = {"advantages": [torch.randn(r.shape, generator=g) for r in responses],
              "old_log_probs": [-torch.rand(r.shape, generator=g) * 4 for r in responses]}
    return prompts, responses, fields


def cmd_scale(a: argparse.Namespace) -> int:
    """On the device: the FSDP2 engine built on meta and loaded from safetensors, under each of
    its options (bf16, padding-free, activation checkpointing), against the fp32 padded engine;
    then the built-in rollout engine's decode throughput."""
    import os

    import torch.distributed as dist

    from asyncflow.platform import get_platform

    plat = get_platform(a.platform)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("LOCAL_RANK", "0")
    plat.set_device(plat.device_for_local_rank(0))
    dist.init_process_group(plat.backend, rank=0, world_size=1)
    try:
        return _scale_checks(a, plat, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _scale_checks(a: argparse.Namespace, plat, group) -> int:
    import time

    import torch
    from safetensors.torch import load_file

    from asyncflow.config import AlgorithmConfig
    from asyncflow.engines.rollout.base import SamplingParams
    from asyncflow.engines.rollout.builtin import BuiltinRolloutEngine
    from asyncflow.engines.train import FSDPEngine, OptimConfig
    from asyncflow.engines.train.model_source import PretrainedModel
    from asyncflow.engines.train.options import EngineOptions
    from asyncflow.workers.actor_loss import policy_loss_fn

    # the actor's own loss: PPO-clip over token-mean, with an entropy bonus
    loss_fn = policy_loss_fn(AlgorithmConfig(policy_loss="ppo_clip", entropy_coef=0.01))
    problems: list[str] = []
    report: dict = {"platform": plat.name, "backend": plat.backend}
    vocab = int(json.loads((Path(a.model_dir) / "config.json").read_text())["vocab_size"])
    batch = _scale_batch(vocab, a.rows, seed=0)
    tokens = sum(p.numel() + r.numel() for p, r in zip(batch[0], batch[1]))
    optim = OptimConfig(lr=1e-5, micro_batch_tokens=a.micro_batch_tokens)
    settings = {"fp32_padded": EngineOptions(param_dtype="float32"),
                "fp32_packed": EngineOptions(param_dtype="float32", padding_free=True),
                "bf16_padded": EngineOptions(param_dtype="bfloat16"),
                "bf16_packed": EngineOptions(param_dtype="bfloat16", padding_free=True),
                "bf16_packed_ac": EngineOptions(param_dtype="bfloat16", padding_free=True,
                                                activation_checkpointing=True)}
    ref_lp = None
    files = sorted(Path(a.model_dir).glob("*.safetensors"))
    on_disk = {k: v for f in files for k, v in load_file(str(f)).items()}
    for name, options in settings.items():
        plat.synchronize()
        if plat.is_accelerator:  # each setting's own peak
            getattr(torch, plat.name).empty_cache()
            getattr(torch, plat.name).reset_peak_memory_stats()
        t0 = time.perf_counter()
        engine = FSDPEngine(PretrainedModel(a.model_dir, attn_implementation="sdpa"), optim, process_group=group,
                            platform=plat, options=options)
        build_s = time.perf_counter() - t0
        if name == "fp32_padded":  # loaded exactly what the checkpoint holds
            state = engine.full_state_dict()
            worst = max((state[k].float().cpu() - v.float()).abs().max().item()
                        for k, v in on_disk.items() if k in state)
            missing = sorted(set(on_disk) - set(state))
            report["loaded_vs_safetensors_max_diff"] = worst
            if worst != 0.0 or missing:
                problems.append(f"loaded weights differ from the safetensors by {worst} (missing {missing[:3]})")
            del state
        lp, _ = engine.compute_log_probs(batch[0], batch[1])
        flat = torch.cat([x.float().cpu() for x in lp])
        if ref_lp is None:
            ref_lp = flat
        diff = (flat - ref_lp).abs().max().item()
        engine.train_step(*batch, loss_fn, with_entropy=True)  # warm-up (kernels, allocator)
        plat.synchronize()
        t0 = time.perf_counter()
        metrics = {}
        for _ in range(a.steps):
            metrics = engine.train_step(*batch, loss_fn, with_entropy=True)
        plat.synchronize()
        step_s = (time.perf_counter() - t0) / a.steps
        peak = plat.memory_stats()["peak_bytes"] if plat.is_accelerator else 0  # CPU: the process's, not the step's
        row = {"build_s": round(build_s, 2), "log_prob_max_diff_vs_fp32_padded": diff, "step_s": round(step_s, 4),
               "train_tokens_per_s": round(tokens / step_s), "peak_mb": round(peak / 2**20),
               "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm")}
        report[name] = row
        print(f"  {name:<15} build {build_s:5.1f} s  |lp - fp32 padded| {diff:.1e}  step {step_s * 1e3:7.1f} ms  "
              f"{tokens / step_s:9.0f} tokens/s  peak {peak / 2**20:7.0f} MB")
        bound = 1e-3 if name.startswith("fp32") else 0.5
        if not diff <= bound:
            problems.append(f"{name}: log-probs differ from the fp32 padded engine's by {diff:.2e} (> {bound})")
        del engine
    if plat.is_accelerator and not report["bf16_packed_ac"]["peak_mb"] < report["bf16_packed"]["peak_mb"]:
        problems.append("activation checkpointing did not lower the training step's peak memory")

    # the built-in engine: bf16 weights on the device, rows of fixed length (eos ignored)
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if plat.is_accelerator else torch.float32
    device = plat.device_for_local_rank(0)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    prompts = [torch.randint(3, vocab, (32,)) for _ in range(a.gen_rows)]
    params = SamplingParams(max_new_tokens=a.gen_tokens, temperature=1.0, ignore_eos=True)
    for running in sorted({a.gen_rows, max(1, a.gen_rows // 4)}):
        engine = BuiltinRolloutEngine(model, eos_token_ids=[1], pad_token_id=0, device=device,
                                      max_running_rows=running)
        engine.generate(prompts[:running], SamplingParams(max_new_tokens=8, ignore_eos=True),
                        seeds=list(range(running)))  # warm-up
        plat.synchronize()
        t0 = time.perf_counter()
        out = engine.generate(prompts, params, seeds=list(range(len(prompts))))
        plat.synchronize()
        gen_s = time.perf_counter() - t0
        n = sum(int(r.numel()) for r in out.response_ids)
        report[f"rollout_running_{running}"] = {"rows": len(prompts), "tokens": n, "s": round(gen_s, 3),
                                                "tokens_per_s": round(n / gen_s)}
        print(f"  built-in rollout, {len(prompts)} rows x {a.gen_tokens} tokens, {running} running: "
              f"{n / gen_s:9.0f} tokens/s ({gen_s:.2f} s)")
        if n != len(prompts) * a.gen_tokens:
            problems.append(f"rollout: {n} tokens generated, expected {len(prompts) * a.gen_tokens}")
        del engine
    print(json.dumps({"scale": report, "problems": problems}))
    for p in problems:
        print(f"!! {p}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env", help="versions and devices").set_defaults(func=cmd_env)
    b = sub.add_parser("build-model", help="build the ~100M Qwen2 model into an empty directory")
    b.add_argument("out_dir")
    b.add_argument("--spec", default=DEFAULT_SPEC, help=f"hidden,layers,heads,kv_heads,ffn (default {DEFAULT_SPEC})")
    b.add_argument("--max-positions", type=int, default=512)
    b.set_defaults(func=cmd_build_model)
    s = sub.add_parser("summary", help="throughput from a run's summary.json")
    s.add_argument("run_dir")
    s.set_defaults(func=cmd_summary)
    m = sub.add_parser("modes", help="rates of sync and async runs taken in turns, and their ratios")
    m.add_argument("run_dirs", nargs="+")
    m.set_defaults(func=cmd_modes)
    c = sub.add_parser("scale", help="the training engine's options and the built-in engine's tokens/s")
    c.add_argument("model_dir")
    c.add_argument("--platform", default="cuda")
    c.add_argument("--rows", type=int, default=32, help="training batch rows (prompts 16-64, responses 32-256 tokens)")
    c.add_argument("--steps", type=int, default=3, help="timed training steps per setting")
    c.add_argument("--micro-batch-tokens", type=int, default=4096)
    c.add_argument("--gen-rows", type=int, default=128)
    c.add_argument("--gen-tokens", type=int, default=128)
    c.set_defaults(func=cmd_scale)
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
