"""build_tiny_model writes a directory transformers loads; ensure_tiny_model caches it atomically."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncflow.models import tiny
from asyncflow.models.tiny import SPEC_FILE, TinyModelSpec, default_cache_root, ensure_tiny_model


def test_directory_loads_with_auto_classes(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", SPEC_FILE} <= names
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.max_position_embeddings) == (128, 2, 4, 2, 512, 128)
    assert cfg.vocab_size == len(tok)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert 0.3e6 < sum(p.numel() for p in model.parameters()) < 1e6
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    batch = tok(["12+34=", "1+2="], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    prompt_len = batch["input_ids"].shape[1]
    assert out.shape[0] == 2 and prompt_len < out.shape[1] <= prompt_len + 3
    assert torch.equal(out[:, :prompt_len], batch["input_ids"])


def test_ensure_returns_cached_path_without_building(monkeypatch, tiny_cache, tiny_dir):
    spec = TinyModelSpec()
    assert tiny_dir == tiny_cache / "models" / spec.digest()
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns

    def no_build(out_dir, spec=None):
        raise AssertionError(f"a cached model was built again into {out_dir}")

    monkeypatch.setattr(tiny, "build_tiny_model", no_build)
    again = ensure_tiny_model(cache_dir=tiny_cache)
    assert again == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before  # not rebuilt
    assert json.loads((tiny_dir / SPEC_FILE).read_text())["hidden_size"] == 128
    assert [p.name for p in (tiny_cache / "models").iterdir()] == [tiny_dir.name]  # no temp dirs left


def test_cache_root_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCFLOW_CACHE", str(tmp_path / "c"))
    assert default_cache_root() == tmp_path / "c"
    monkeypatch.delenv("ASYNCFLOW_CACHE")
    assert default_cache_root() == Path.home() / ".cache" / "asyncflow"


def test_digest_depends_on_spec():
    assert TinyModelSpec().digest() == TinyModelSpec().digest()
    assert TinyModelSpec(seed=1).digest() != TinyModelSpec().digest()
    assert TinyModelSpec(hidden_size=256).digest() != TinyModelSpec().digest()


@pytest.mark.parametrize("kwargs,msg", [
    ({"hidden_size": 130}, "not divisible"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"attn_implementation": "flash"}, "expected 'eager' or 'sdpa'"),
])
def test_bad_spec(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        TinyModelSpec(**kwargs)


def test_build_refuses_a_directory_holding_a_model(tiny_dir):
    with pytest.raises(FileExistsError, match="already holds a model"):
        tiny.build_tiny_model(tiny_dir)


def test_concurrent_builders_leave_one_complete_directory(monkeypatch, tmp_path):
    """Racing callers: every one gets the same complete directory, no temp dir is left.
    The builder is replaced by a slow fake so the race window is wide and the test quick."""
    calls = []
    barrier = threading.Barrier(4)

    def slow_build(out_dir, spec=None):
        calls.append(out_dir)
        barrier.wait(timeout=10)  # all four are building at once
        out = Path(out_dir)
        (out / "config.json").write_text(json.dumps({"who": str(out)}))
        time.sleep(0.05)
        (out / SPEC_FILE).write_text("{}")
        return out

    monkeypatch.setattr(tiny, "build_tiny_model", slow_build)
    results, errors = [], []

    def call():
        try:
            results.append(ensure_tiny_model(cache_dir=tmp_path))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors and len(results) == 4 and len(set(results)) == 1
    final = results[0]
    assert len(calls) == 4
    winner = json.loads((final / "config.json").read_text())["who"]
    assert winner in {str(c) for c in calls}
    assert [p.name for p in final.parent.iterdir()] == [final.name]


def test_incomplete_cache_directory_is_reported(tmp_path):
    final = tmp_path / "models" / TinyModelSpec().digest()
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="not a complete build.*Delete that directory"):
        ensure_tiny_model(cache_dir=tmp_path)


def test_same_seed_gives_same_weights_and_leaves_global_rng(tmp_path, tiny_dir):
    from safetensors.torch import load_file

    state = torch.random.get_rng_state()
    other = tiny.build_tiny_model(tmp_path / "again")
    assert torch.equal(torch.random.get_rng_state(), state)
    a = load_file(str(tiny_dir / "model.safetensors"))
    b = load_file(str(other / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _fake_build(out_dir, spec=None):
    out = Path(out_dir)
    (out / "config.json").write_text(json.dumps({"pid": __import__("os").getpid()}))
    time.sleep(0.2)  # a wide window in which every process is mid-build
    (out / SPEC_FILE).write_text("{}")
    return out


def _ensure_in_child(cache: str, q) -> None:
    try:
        q.put(str(ensure_tiny_model(cache_dir=cache)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        q.put(f"error: {exc!r}")


def test_concurrent_processes(monkeypatch, tmp_path):
    """The same race across processes (forked, so they inherit the fake builder)."""
    import multiprocessing as mp

    monkeypatch.setattr(tiny, "build_tiny_model", _fake_build)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(str(tmp_path), q)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [q.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert len(set(results)) == 1 and not results[0].startswith("error"), results
    final = Path(results[0])
    assert json.loads((final / "config.json").read_text())["pid"] in {p.pid for p in procs}
    assert [p.name for p in final.parent.iterdir()] == [final.name]
