#!/usr/bin/env python
"""The Python parts of scripts/device_check.sh (one short check on a machine with a GPU).

    python scripts/device_check.py env                    # torch / CUDA / vLLM versions, devices
    python scripts/device_check.py build-model DIR        # a ~100M-parameter Qwen2 (char tokenizer), offline
    python scripts/device_check.py summary RUN_DIR        # tokens/s (and per device) from a run's summary.json

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
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
