#!/usr/bin/env python
"""Rollout / training rank lists for a disaggregated multi-node run.

Prints two `asyncflow train` overrides, one a line, actor first:

    placement.actor_ranks=[0,1,...]
    placement.rollout_ranks=[16,17,...]

Global ranks are numbered node by node under torchrun (node i holds ranks
i*per_node .. i*per_node+per_node-1). The training (actor) ranks come first, so rank 0
(driver, TransferQueue) is a training rank, as in the default config.

Whole nodes per role when possible (`--granularity node`, the default): the rollout
role gets round(nnodes * share) nodes, at least one and at most nnodes - 1. With one
node, or with `--granularity rank`, ranks are split inside nodes instead:
round(total * share) rollout ranks, at least one and at most total - 1. The share
actually laid out, which whole nodes may move away from the one asked for, is reported
on stderr. Standard library only: the launch scripts call it before anything else.

    python scripts/npu/placement.py --nnodes 4 --per-node 16 --rollout-share 2/3
"""
from __future__ import annotations

import argparse
import sys
from fractions import Fraction


def _share(text: str) -> Fraction:
    """A fraction strictly between 0 and 1: '2/3', '0.667' or '0.5'."""
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or fraction (e.g. 2/3 or 0.6)") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must lie strictly between 0 and 1 "
                                         "(both roles need at least one rank)")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _round(x: Fraction) -> int:
    """Round half up (Python's round() rounds half to even)."""
    return int(x + Fraction(1, 2))


def split(nnodes: int, per_node: int, share: Fraction, granularity: str = "node") -> tuple[list[int], list[int]]:
    """(actor_ranks, rollout_ranks): disjoint, together every rank 0..nnodes*per_node-1."""
    if nnodes < 1 or per_node < 1:
        raise ValueError(f"nnodes and per_node must be >= 1, got {nnodes} and {per_node}")
    if not 0 < share < 1:
        raise ValueError(f"rollout share must lie strictly between 0 and 1, got {share}")
    if granularity not in ("node", "rank"):
        raise ValueError(f"granularity must be 'node' or 'rank', got {granularity!r}")
    total = nnodes * per_node
    if total < 2:
        raise ValueError(f"{nnodes} node(s) x {per_node} rank(s) = {total} rank: a disaggregated run needs at "
                         "least 2 (one training, one rollout); use placement.mode=colocated for one device")
    if granularity == "node" and nnodes >= 2:
        n_rollout = min(max(_round(nnodes * share), 1), nnodes - 1) * per_node
    else:
        n_rollout = min(max(_round(total * share), 1), total - 1)
    n_actor = total - n_rollout
    return list(range(n_actor)), list(range(n_actor, total))


def overrides(actor: list[int], rollout: list[int]) -> list[str]:
    """The two override strings, without spaces (one shell word each)."""
    def fmt(ranks: list[int]) -> str:
        return "[" + ",".join(map(str, ranks)) + "]"
    return [f"placement.actor_ranks={fmt(actor)}", f"placement.rollout_ranks={fmt(rollout)}"]


def _nodes(ranks: list[int], per_node: int) -> str:
    nodes = sorted({r // per_node for r in ranks})
    return f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes[0]}-{nodes[-1]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="placement.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nnodes", type=_positive, required=True, help="nodes in the run")
    ap.add_argument("--per-node", type=_positive, default=16, help="ranks (devices) per node (default 16)")
    ap.add_argument("--rollout-share", type=_share, default=Fraction(2, 3),
                    help="share of the ranks that run rollout, e.g. 2/3 or 0.5 (default 2/3)")
    ap.add_argument("--granularity", choices=("node", "rank"), default="node",
                    help="node: whole nodes per role when there are >= 2 nodes (default); rank: split inside nodes")
    a = ap.parse_args(argv)
    try:
        actor, rollout = split(a.nnodes, a.per_node, a.rollout_share, a.granularity)
    except ValueError as e:
        ap.error(str(e))
    for line in overrides(actor, rollout):
        print(line)
    total = a.nnodes * a.per_node
    print(f"placement: {total} ranks on {a.nnodes} node(s): training {len(actor)} ({_nodes(actor, a.per_node)}), "
          f"rollout {len(rollout)} ({_nodes(rollout, a.per_node)}); rollout share "
          f"{len(rollout) / total:.3f} (asked {float(a.rollout_share):.3f})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
