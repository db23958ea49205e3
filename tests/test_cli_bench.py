"""`asyncflow bench NAME`: runs a script of the checkout's perf/ directory."""
from __future__ import annotations

from pathlib import Path

from asyncflow.cli import main, perf_scripts

REPO = Path(__file__).resolve().parents[1]


def test_every_benchmark_is_found_by_its_short_name():
    names = perf_scripts(REPO / "perf")
    for name in ("transfer_queue", "rpc", "rollout", "weight_sync", "e2e", "soak", "convergence", "simulate_cluster"):
        assert name in names, name
    assert not any(n.startswith("_") for n in names)  # helpers such as _trl_peer are not benchmarks
    assert perf_scripts(REPO / "no-such-dir") == {}


def test_unknown_benchmark_exits_2_listing_the_known_ones(capsys):
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'" in err and "e2e" in err
    assert main(["bench"]) == 2  # no name: the list, not argparse's "arguments are required"
    err = capsys.readouterr().err
    assert "name a benchmark; known:" in err and "e2e" in err


def test_arguments_reach_the_script():
    assert main(["bench", "e2e", "--help"]) == 0  # the script's own --help, not ours
