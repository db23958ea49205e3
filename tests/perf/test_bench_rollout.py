"""perf/bench_rollout.py's pure parts: the methods with and without vLLM, the balanced order of
the rounds, the per-round service / bare ratio, counting tokens to the first EOS, the model
directory vLLM loads (the tokenizer's EOS is the bench's). No vLLM needed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
import bench_rollout


def test_vllm_methods_join_only_with_the_flag():
    assert bench_rollout.method_names(False) == ["builtin", "hf_generate"]
    assert bench_rollout.method_names(True) == ["builtin", "hf_generate", "vllm_bare", "vllm_adapter", "vllm_service"]


def test_two_methods_alternate_as_before():
    assert bench_rollout.balanced_orders(["a", "b"], 3) == [["a", "b"], ["b", "a"], ["a", "b"]]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_each_method_takes_each_position_once_per_square(n):
    names = [f"m{i}" for i in range(n)]
    orders = bench_rollout.balanced_orders(names, n)
    assert bench_rollout.positions_balanced(orders)
    assert all(sorted(o) == names for o in orders)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_each_method_follows_every_other_equally_often_over_the_design(n):
    names = [f"m{i}" for i in range(n)]
    rounds = n if n % 2 == 0 else 2 * n  # Williams: the square, and for an odd count its mirror too
    orders = bench_rollout.balanced_orders(names, rounds)
    pairs = {}
    for o in orders:
        for a, b in zip(o, o[1:]):
            pairs[a, b] = pairs.get((a, b), 0) + 1
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1
    assert bench_rollout.positions_balanced(orders)


def test_the_design_repeats_and_refuses_nothing_to_order():
    five = bench_rollout.method_names(True)
    assert bench_rollout.balanced_orders(five, 12)[10:] == bench_rollout.balanced_orders(five, 2)
    assert bench_rollout.balanced_orders(five, 1)[0] == ["builtin", "hf_generate", "vllm_service", "vllm_bare",
                                                         "vllm_adapter"]
    with pytest.raises(ValueError, match="balanced_orders"):
        bench_rollout.balanced_orders([], 3)
    with pytest.raises(ValueError, match="balanced_orders"):
        bench_rollout.balanced_orders(["a"], 0)


def test_unbalanced_orders_are_told_apart():
    assert not bench_rollout.positions_balanced([["a", "b"], ["a", "b"]])
    assert not bench_rollout.positions_balanced(bench_rollout.balanced_orders(["a", "b", "c"], 2))


def test_service_ratio_is_per_round_then_median():
    # per round 0.5, 0.9, 1.0: the median is 0.9, not the ratio of the medians (900 / 1000)
    s = bench_rollout.ratio_spread([500.0, 900.0, 1200.0], [1000.0, 1000.0, 1200.0])
    assert s == {"median": 0.9, "min": 0.5, "max": 1.0, "per_rep": [0.5, 0.9, 1.0]}


def test_tokens_count_to_the_first_eos_on_every_method():
    eos = bench_rollout.EOS
    assert bench_rollout.count_until_eos(torch.tensor([5, 6, eos, 7, eos])) == 3
    assert bench_rollout.count_until_eos(torch.tensor([5, 6, 7])) == 3
    assert bench_rollout.count_until_eos(torch.tensor([], dtype=torch.int64)) == 0


def test_every_method_gets_the_same_row_seeds():
    assert bench_rollout.row_seeds(2, 3) == [200_006, 200_007, 200_008]


def test_the_model_directory_vllm_loads_has_the_benchs_eos(tmp_path):
    from transformers import AutoConfig, AutoTokenizer
    model = bench_rollout.build_model(bench_rollout.Case(32, 1, 2, 1, 4))
    bench_rollout.save_for_vllm(model, str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    assert (tok.eos_token_id, tok.pad_token_id) == (bench_rollout.EOS, bench_rollout.PAD)
    assert cfg.eos_token_id == bench_rollout.EOS and cfg.vocab_size == bench_rollout.VOCAB
    assert len(tok) <= cfg.vocab_size  # every id the tokenizer has is one the model has


def test_without_vllm_the_flag_is_refused_with_the_reason(monkeypatch, capsys):
    monkeypatch.setattr(bench_rollout, "vllm_importable", lambda: "ModuleNotFoundError: No module named 'vllm'")
    monkeypatch.setattr(sys, "argv", ["bench_rollout.py", "--vllm"])
    with pytest.raises(SystemExit) as e:
        bench_rollout.main()
    assert e.value.code == 2
    assert "--vllm needs vLLM importable" in capsys.readouterr().err
