"""The paper's cluster-scale tables, with the real control and data planes (simulated devices).

The AsyncFlow paper measures throughput against verl from 32 to 1024 NPUs, an ablation
(TransferQueue, then asynchrony) and scaling linearity at 16x. Here the real driver,
executor, TransferQueue (controller, storage units, transport, authentication) and worker
runtimes drive 16 to 256 simulated devices on this machine: each simulated worker serves
the real calls and holds each one for the time a cost model gives (asyncflow/simulation,
docs/simulation.md). Every figure below is measured on the real control plane; the device
times are simulated.

Runs (1x = ``--base-devices``, weak scaling: rows per step grow with the devices):
- ``sync``: colocated, verl-style (every stage takes the whole step, roles switch on every
  device); ``stream`` and ``async``: disaggregated (half the devices generate), streaming,
  async with staleness 1;
- the ablation at the top scale: sync with data through the driver (a centralized,
  DataProto-like baseline, same simulated costs; once with each call's input columns, once
  with every column the rows have, as a DataProto trainer sends the whole batch) -> sync
  through the TransferQueue -> stream -> async;
- every run measures a steady-state window: ``--warm-steps`` (at least 2) left out, then
  ``--measured-steps`` (at least 3), then, in async, ``max_staleness`` tail steps so that the
  pipeline is as full when the window closes as when it opened (cluster.ClusterConfig);
- strong scaling (full run only): the top scale's global batch on every size.

The clock: ``--scale`` wall seconds per simulated second of device work. The control plane
is NOT scaled, so in simulated time it costs 1/scale times what it costs on a real cluster
(scale 1: true cost; below 1: pessimistic). The hosts of the simulated ranks share this
machine's cores with the driver and the controller (on a cluster they would be other
machines): their CPU and the machine's load are printed with the results.

    python perf/simulate_cluster.py --quick        # 7B, 1x and 16x (16 and 256 devices), the ablation
    python perf/simulate_cluster.py                # 1x..16x, strong scaling, 7B and 32B (longer)

The last printed line is one JSON object; its ``targets`` are judged on the values as printed
(asyncflow/simulation/verdict.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from asyncflow.simulation.cluster import ClusterConfig, simulate  # noqa: E402
from asyncflow.simulation.costs import CostModel  # noqa: E402
from asyncflow.simulation.verdict import judge  # noqa: E402

MIN_WARM_STEPS, MIN_MEASURED_STEPS = 2, 3
TARGETS = (("linearity_16x_async", 0.85, True), ("controller_busy_at_max", 0.5, False))


def _run(cfg: ClusterConfig, label: str, log: list) -> dict:
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    r = simulate(cfg)
    r["label"], r["load_before"] = label, load
    a = r["audit"]
    print(f"  {label:<28} {cfg.devices:>4} dev  {r['samples_per_s']:8.2f} samples/s  step {r['step_s']:6.1f} s  "
          f"ctrl {r['controller_busy']:.3f}  driver {r['driver_busy']:.3f}  hosts {r['hosts_cpu_cores']:.2f} cores  "
          f"get_meta p99 {r['get_meta']['p99_us'] / 1e3:.1f} ms  rows once: {a['trained_equals_issued']}  "
          f"({time.monotonic() - t0:.0f} s wall, load {load:.1f})", flush=True)
    if not a["trained_equals_issued"]:
        raise RuntimeError(f"{label}: the rows trained are not the rows issued, each once: {a}")
    log.append(r)
    return r


def weak(base: ClusterConfig, sizes: list[int], base_devices: int, rows_per_device: int) -> list[ClusterConfig]:
    return [replace(base, devices=base_devices * k, prompts_per_step=base_devices * k * rows_per_device //
                    base.group_size) for k in sizes]


def table(rows: list[dict], title: str) -> str:
    out = [f"### {title}", "", ("| run | devices | samples/s | tokens/s | per device | step s | controller busy | "
            "driver busy | get_meta p50/p99 ms | fan-out p50/p99 ms (ranks) | TQ MB put/step | hosts cores | load |"),
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g, f = r["get_meta"], r["fan_out"]
        out.append(f"| {r['label']} | {r['devices']} | {r['samples_per_s']:.2f} | {r['tokens_per_s']:.0f} | "
                   f"{r['samples_per_s'] / r['devices']:.3f} | {r['step_s']:.1f} | {r['controller_busy']:.3f} | "
                   f"{r['driver_busy']:.3f} | {g['p50_us'] / 1e3:.1f} / {g['p99_us'] / 1e3:.1f} | "
                   f"{f['p50_us'] / 1e3:.1f} / {f['p99_us'] / 1e3:.1f} ({f['ranks']}) | "
                   f"{r['tq_put_bytes_per_step'] / 1e6:.1f} | {r['hosts_cpu_cores']:.2f} | {r['load_before']:.1f} |")
    return "\n".join(out)


def plot(series: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, rows in series.items():
        if not rows:
            continue
        dev = [r["devices"] for r in rows]
        ax[0].plot(dev, [r["samples_per_s"] for r in rows], marker="o", label=name)
        ax[1].plot(dev, [r["controller_busy"] for r in rows], marker="o", label=name)
    for a, y in zip(ax, ("samples/s (simulated time)", "TransferQueue controller busy (CPU share)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("simulated devices")
        a.set_ylabel(y)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    ax[0].set_yscale("log", base=2)
    fig.suptitle("SIMULATED devices, real control plane (perf/simulate_cluster.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="7B, 1x and 16x only, no strong scaling")
    ap.add_argument("--warm-steps", type=int, default=MIN_WARM_STEPS, help="steps before the window (>= 2)")
    ap.add_argument("--measured-steps", type=int, default=MIN_MEASURED_STEPS, help="steps in the window (>= 3)")
    ap.add_argument("--scale", type=float, default=1.0, help="wall seconds per simulated second (1: real time)")
    ap.add_argument("--base-devices", type=int, default=16)
    ap.add_argument("--rows-per-device", type=int, default=4, help="rows per device per step (weak scaling)")
    ap.add_argument("--models", default=None, help="comma-separated: qwen2.5-7b,qwen2.5-32b")
    ap.add_argument("--hosts", type=int, default=2, help="processes hosting the simulated ranks")
    ap.add_argument("--out", default=str(ROOT / "perf" / "out" / "simulate_cluster"))
    args = ap.parse_args()
    if args.warm_steps < MIN_WARM_STEPS or args.measured_steps < MIN_MEASURED_STEPS:
        ap.error(f"a steady-state window needs --warm-steps >= {MIN_WARM_STEPS} and --measured-steps >= "
                 f"{MIN_MEASURED_STEPS}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [1, 16] if args.quick else [1, 2, 4, 8, 16]
    models = (args.models or ("qwen2.5-7b" if args.quick else "qwen2.5-7b,qwen2.5-32b")).split(",")
    top = args.base_devices * sizes[-1]
    t0 = time.monotonic()
    log: list[dict] = []
    results: dict = {"scale": args.scale, "base_devices": args.base_devices, "sizes": sizes, "models": {}}
    tables: list[str] = []
    for model in models:
        print(f"\n{model}: cost model {json.dumps(CostModel.named(model).describe()['derived'])}", flush=True)
        base = ClusterConfig(model=model, scale=args.scale, hosts=args.hosts, warm_steps=args.warm_steps,
                             measured_steps=args.measured_steps)
        async_cfg = replace(base, mode="async")
        sync_cfg = replace(base, mode="sync")
        stream_cfg = replace(async_cfg, mode="stream")
        m: dict = {}
        m["async"] = [_run(c, f"async {c.devices}", log) for c in weak(async_cfg, sizes, args.base_devices,
                                                                          args.rows_per_device)]
        m["sync"] = [_run(c, f"sync {c.devices}", log) for c in weak(sync_cfg, sizes, args.base_devices,
                                                                        args.rows_per_device)]
        top_sync = weak(sync_cfg, [sizes[-1]], args.base_devices, args.rows_per_device)[0]
        top_stream = weak(stream_cfg, [sizes[-1]], args.base_devices, args.rows_per_device)[0]
        m["sync_driver"] = [_run(replace(top_sync, data_path="driver"), f"sync, data via driver {top}", log)]
        m["sync_driver_all"] = [_run(replace(top_sync, data_path="driver", driver_carries="all"),
                                     f"sync, driver carries all {top}", log)]
        m["stream"] = [_run(top_stream, f"stream {top}", log)]
        if not args.quick:
            fixed = top_sync.prompts_per_step
            m["async_strong"] = [_run(replace(async_cfg, devices=args.base_devices * k, prompts_per_step=fixed),
                                      f"async strong {args.base_devices * k}", log) for k in sizes]
            m["sync_strong"] = [_run(replace(sync_cfg, devices=args.base_devices * k, prompts_per_step=fixed),
                                     f"sync strong {args.base_devices * k}", log) for k in sizes]
        results["models"][model] = m
        k = sizes[-1]

        # Both bind this model's results and top size (they are called within this iteration).
        def lin(series: str, m: dict = m, k: int = k) -> float:
            s = m[series]
            return s[-1]["samples_per_s"] / (k * s[0]["samples_per_s"])

        def strong(series: str, m: dict = m, k: int = k) -> float:
            s = m.get(series)
            return s[-1]["samples_per_s"] / (k * s[0]["samples_per_s"]) if s else float("nan")
        a_top, s_top, d_top, dall_top = m["async"][-1], m["sync"][-1], m["sync_driver"][0], m["sync_driver_all"][0]
        streamed = m.get("stream", [])
        ablation = {"baseline_sync_driver": 1.0,
                    "sync_driver_carries_all": dall_top["samples_per_s"] / d_top["samples_per_s"],
                    "sync_transfer_queue": s_top["samples_per_s"] / d_top["samples_per_s"],
                    **({"stream_transfer_queue": streamed[0]["samples_per_s"] / d_top["samples_per_s"]}
                       if streamed else {}),
                    "async_transfer_queue": a_top["samples_per_s"] / d_top["samples_per_s"]}
        results[model] = {
            "linearity_16x_async": lin("async"), "linearity_16x_sync": lin("sync"),
            "strong_linearity_16x_async": strong("async_strong"), "strong_linearity_16x_sync": strong("sync_strong"),
            "ratio_async_vs_sync_at_max": a_top["samples_per_s"] / s_top["samples_per_s"],
            "ratio_tq_vs_driver_at_max": s_top["samples_per_s"] / d_top["samples_per_s"],
            "ratio_stream_vs_driver_at_max": streamed[0]["samples_per_s"] / d_top["samples_per_s"],
            "ratio_tq_vs_driver_all_at_max": s_top["samples_per_s"] / dall_top["samples_per_s"],
            "ablation_at_max": ablation,
            "controller_busy_at_max": max(r["controller_busy"] for r in (a_top, s_top, *streamed)),
            "get_meta_p99_us_at_max": a_top["get_meta"]["p99_us"],
            # Extrapolated, not measured: the devices at which the controller's thread would be busy
            # all the time, if its CPU per device-step stayed what it is at the top scale.
            "controller_saturates_at_devices_est": top / max(a_top["controller_busy"], 1e-9),
            "controller_cpu_ms_per_row_at_max": a_top["controller_busy"] * a_top["step_s"] * args.scale * 1e3 /
            a_top["rows_per_step"],
            "fan_out_p99_us_at_max": a_top["fan_out"]["p99_us"],
        }
        tables.append(f"## {model} (SIMULATED devices; scale {args.scale} wall s per simulated s)")
        tables.append(table(m["async"] + m["sync"], "weak scaling"))
        tables.append(table([d_top, dall_top, s_top, *streamed, a_top], f"ablation at {top} devices"))
        tables.append("ablation, throughput relative to the baseline: " +
                      ", ".join(f"{k} {v:.2f}x" for k, v in ablation.items()))
        if not args.quick:
            tables.append(table(m["async_strong"] + m["sync_strong"], "strong scaling"))
        plot({f"{model} {k}": v for k, v in m.items() if k in ("async", "sync", "async_strong", "sync_strong")},
             out / f"throughput_{model}.png")
    first = results[models[0]]
    headline = {
        "linearity_16x_async": round(first["linearity_16x_async"], 3),
        "linearity_16x_sync": round(first["linearity_16x_sync"], 3),
        "ratio_async_vs_sync_at_max": round(first["ratio_async_vs_sync_at_max"], 3),
        "ratio_tq_vs_driver_at_max": round(first["ratio_tq_vs_driver_at_max"], 3),
        "ratio_stream_vs_driver_at_max": round(first["ratio_stream_vs_driver_at_max"], 3),
        "ratio_tq_vs_driver_all_at_max": round(first["ratio_tq_vs_driver_all_at_max"], 3),
        "controller_busy_at_max": round(first["controller_busy_at_max"], 4),
        "get_meta_p99_us_at_max": round(first["get_meta_p99_us_at_max"], 1),
        "simulated_devices_max": top, "model": models[0], "scale": args.scale, "simulated": True,
        "warm_steps": args.warm_steps, "measured_steps": args.measured_steps,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    verdicts = [judge(name, first[name], threshold, higher) for name, threshold, higher in TARGETS]
    headline["targets"] = {v.name: {"printed": v.printed, "threshold": v.threshold, "met": v.met} for v in verdicts}
    results["headline"] = headline
    (out / "results.json").write_text(json.dumps({"results": results, "runs": log}, indent=1, default=str))
    print("\n" + "\n\n".join(tables))
    print(f"\ncost model (all assumptions): {json.dumps(CostModel.named(models[0]).describe())}")
    print(f"plots: {', '.join(str(out / f'throughput_{m}.png') for m in models)}; all figures: {out / 'results.json'}")
    print("\n".join(v.line() for v in verdicts))
    print(json.dumps(headline), flush=True)


if __name__ == "__main__":
    main()
