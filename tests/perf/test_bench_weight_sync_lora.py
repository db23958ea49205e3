"""perf/bench_weight_sync.py --lora: its pure parts (the model's size, the /proc reading, the
summary of a mode, the projection from asyncflow.planning) on made-up rank reports."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
import bench_weight_sync as bench

from asyncflow.planning import ModelShape, count_params
from asyncflow.planning.params import lora_params


@pytest.mark.parametrize("mb", [64.0, 128.0, 512.0])
def test_the_model_is_whole_layers_closest_to_the_size_asked(mb):
    cfg = bench.qwen2_config(mb)
    total = count_params(ModelShape.from_config(cfg)).total * 4
    per_layer = count_params(ModelShape.from_config(cfg)).per_layer * 4
    assert abs(total - mb * 2**20) <= per_layer / 2
    assert cfg["tie_word_embeddings"] is False  # as Qwen2.5-7B/32B: the LM head is its own tensor


def test_a_model_smaller_than_its_embeddings_still_has_a_layer():
    assert bench.qwen2_config(1.0)["num_hidden_layers"] == 1


def test_status_lines_are_read_in_kb():
    text = "Name:\tpython\nVmHWM:\t  123456 kB\nVmRSS:\t   65432 kB\n"
    assert bench.status_kb(text, "VmHWM") == 123456 and bench.status_kb(text, "VmRSS") == 65432
    with pytest.raises(KeyError, match="VmSwap"):
        bench.status_kb(text, "VmSwap")


def _rank(rank: int, variants: dict, peak_kb: int, before_kb: int = 100_000) -> dict:
    return {"rank": rank, "seconds": {v: s for v, (s, _, _) in variants.items()},
            "select_seconds": {v: [rank * 0.01 + x for x in sel] for v, (_, _, sel) in variants.items()},
            "bytes": {v: b for v, (_, b, _) in variants.items()},
            "first_bytes": {v: b[0] + (1000 if v == "adapters" else 0) for v, (_, b, _) in variants.items()},
            "peak_kb": peak_kb, "before_build_kb": before_kb, "after_build_kb": before_kb + 2048,
            "state_bytes": 3 * 2**20, "adapter_bytes": 4096}


def test_a_mode_is_summarised_by_medians_bytes_and_peaks_over_ranks():
    variants = {"adapters": ([0.3, 0.1, 0.2], [4096], [0.0, 0.0, 0.0]),
                "merged": ([0.5, 0.9, 0.7], [1 << 20], [0.2, 0.4, 0.3])}
    out = bench.summarize_mode([_rank(0, variants, 100_000 + 10 * 1024), _rank(1, variants, 100_000 + 12 * 1024)])
    assert out["adapters"]["bytes_per_version"] == 4096 and out["adapters"]["first_version_bytes"] == 5096
    assert out["adapters"]["sync_s"] == 0.2 and out["merged"]["sync_s"] == 0.7
    assert out["merged"]["select_s"] == pytest.approx(0.31)  # the slower rank's median
    assert out["trainer_peak_mb_by_rank"] == [10.0, 12.0] and out["trainer_after_build_mb_by_rank"] == [2.0, 2.0]
    assert out["trainer_state_mb_by_rank"] == [3.0, 3.0] and out["adapter_bytes"] == 4096


def test_versions_of_different_sizes_are_refused():
    variants = {"full": ([0.1, 0.2], [100, 200], [0.0, 0.0])}
    with pytest.raises(ValueError, match="different sizes"):
        bench.summarize_mode([_rank(0, variants, 200_000)])


def test_the_summary_compares_full_with_lora():
    full = {"full": {"bytes_per_version": 8000, "sync_s": 0.4}, "trainer_peak_mb_by_rank": [300.0, 320.0],
            "adapter_bytes": 0}
    lora = {"adapters": {"bytes_per_version": 100, "sync_s": 0.05},
            "merged": {"bytes_per_version": 8000, "sync_s": 0.8},
            "trainer_peak_mb_by_rank": [160.0, 150.0], "adapter_bytes": 100}
    out = bench.lora_summary(full, lora, {"num_hidden_layers": 3}, 8, 64.0, 5, 3)
    assert out["adapters_equal_adapter_bytes"] is True
    assert out["ratio_bytes_full_vs_lora"] == 80.0 and out["ratio_sync_s_full_vs_lora"] == 8.0
    assert out["ratio_sync_s_full_vs_lora_merged"] == 0.5
    assert out["trainer_peak_mb_full"] == 320.0 and out["trainer_peak_mb_lora"] == 160.0
    assert out["ratio_trainer_peak_full_vs_lora"] == 2.0
    lora["adapters"]["bytes_per_version"] = 132  # a version that is not the adapters alone
    again = bench.lora_summary(full, lora, {"num_hidden_layers": 3}, 8, 64.0, 5, 3)
    assert again["adapters_equal_adapter_bytes"] is False


def test_projection_uses_the_planners_counts():
    rows = {(r["model"], r["training"]): r for r in bench.lora_projection_rows(8)}
    for name, config in bench.QWEN25_CONFIGS.items():
        shape = ModelShape.from_config(config)
        assert rows[(name, "full")]["sync_bytes"] == count_params(shape).total * 2
        assert rows[(name, "lora r=8")]["sync_bytes"] == lora_params(shape, 8) * 2
        lora_state = rows[(name, "lora r=8")]["actor_state_bytes_per_device"]
        assert lora_state < rows[(name, "full")]["actor_state_bytes_per_device"] / 3
    # the planner's own figure for Qwen2.5-7B's rank-8 adapters (tests/planning/test_plan_lora.py)
    assert rows[("Qwen2.5-7B", "lora r=8")]["sync_bytes"] / 2 == pytest.approx(20.185e6, rel=1e-4)
    lines = bench.lora_projection_lines(8)
    assert lines[0].startswith("PROJECTED") and len(lines) == 2 + 4
