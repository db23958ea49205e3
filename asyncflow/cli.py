"""The `asyncflow` command line.

Each subcommand is one `_add_<name>(subparsers)` function that declares its
arguments and sets `func`, the handler called with the parsed arguments. `bench` runs
the scripts of the checkout's perf/ directory (they are not part of the installed package).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncflow import __version__
from asyncflow.metrics.report import JsonlError, build_report
from asyncflow.planning.command import add_arguments as add_plan_arguments
from asyncflow.planning.command import run as run_plan
from asyncflow.workflow.recipe import available


def _cmd_version(args: argparse.Namespace) -> int:
    print(f"asyncflow {__version__}")
    return 0


def _add_version(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("version", help="print the AsyncFlow version")
    parser.set_defaults(func=_cmd_version)


def _cmd_report(args: argparse.Namespace) -> int:
    try:
        paths = build_report(args.output_dir)
    except FileNotFoundError as err:  # no such run: a usage error, like argparse's exit 2
        print(f"asyncflow report: error: {err}", file=sys.stderr)
        return 2
    except JsonlError as err:  # the run exists but a log line is corrupt
        print(f"asyncflow report: error: {err}", file=sys.stderr)
        return 1
    print(f"report of {args.output_dir} written to {paths['timeline'].parent}:")
    for name, path in paths.items():
        print(f"  {name:<16} {path}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from asyncflow.launcher import train_main  # slow: the launcher imports torch; the other commands stay fast
    return train_main([*([args.recipe] if args.recipe else []), *args.overrides])


def _add_train(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="run a recipe (default: GRPO, async, 2 CPU ranks, built-in tiny model and task)",
        description="asyncflow train [RECIPE] [key=value ...]  e.g. asyncflow train grpo workflow.mode=sync")
    parser.add_argument("recipe", nargs="?", default=None,
                        help=f"a recipe name in recipes/ ({', '.join(available())}) or a recipe directory")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value (see docs/configuration.md)")
    parser.set_defaults(func=_cmd_train)


def _add_report(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="redraw a run's report (PNG plots, Chrome trace) from its logged files")
    parser.add_argument("output_dir", help="the run's output directory (holds metrics.jsonl)")
    parser.set_defaults(func=_cmd_report)


def perf_scripts(perf_dir: Path) -> dict[str, Path]:
    """Benchmark name -> script: perf/bench_<name>.py, and the other public scripts by stem."""
    out = {}
    for f in sorted(perf_dir.glob("*.py")) if perf_dir.is_dir() else []:
        if not f.name.startswith("_"):
            out[f.stem.removeprefix("bench_")] = f
    return out


def _cmd_bench(args: argparse.Namespace) -> int:
    repo = Path(__file__).resolve().parents[1]
    scripts = perf_scripts(repo / "perf")
    if not scripts:
        print(f"asyncflow bench: error: no perf/ directory next to the package ({repo}): the benchmarks live in "
              "the source checkout; clone the repository and install it with `pip install -e .`", file=sys.stderr)
        return 2
    if args.name not in scripts:
        what = "name a benchmark" if args.name is None else f"unknown benchmark {args.name!r}"
        print(f"asyncflow bench: error: {what}; known: {', '.join(scripts)}", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    return subprocess.call([sys.executable, str(scripts[args.name]), *args.args], cwd=repo, env=env)


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="run a benchmark of perf/ (e.g. asyncflow bench e2e --quick)",
        description="asyncflow bench NAME [ARGS...]: runs perf/bench_NAME.py (or perf/NAME.py) with ARGS")
    parser.add_argument("name", nargs="?", default=None,
                        help="transfer_queue, rpc, rollout, weight_sync, e2e, auth, soak, convergence, "
                             "simulate_cluster")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments (e.g. --quick)")
    parser.set_defaults(func=_cmd_bench)


def _cmd_plan(args: argparse.Namespace) -> int:
    return run_plan(args)


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="memory per device and role, and the fastest rollout/training split, for a model",
        description="asyncflow plan [CONFIG.JSON | MODEL_DIR] --devices N ...  (see docs/plan.md)")
    add_plan_arguments(parser)
    parser.set_defaults(func=_cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncflow",
        description="AsyncFlow: asynchronous streaming RL for LLM post-training.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"asyncflow {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_version(subparsers)
    _add_train(subparsers)
    _add_report(subparsers)
    _add_bench(subparsers)
    _add_plan(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:  # no subcommand given: show what there is
        parser.print_help()
        return 0
    return func(args)


if __name__ == "__main__":
    raise SystemExit(main())
