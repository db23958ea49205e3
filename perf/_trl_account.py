"""TRL's GRPOTrainer (perf/_trl_peer.py) with its CPU accounted by component: the TRL side of
perf/cpu_account.py. Runs with the TRL venv's python, like the peer.

    python perf/_trl_account.py SPEC RESULT WINDOW

WINDOW is a JSON file written here: ``{"steps", "threads": {tid: [name, ns]}, "spans": {tid:
{component: ns}}}``, every thread's CPU and the spans' over the optimizer steps
``spec["account_from"]`` to ``spec["account_to"]`` (read at those steps' ends, in this process:
no window is misaligned). The components: GRPOTrainer's methods charged with
``asyncflow.cpu_account`` spans (the same accountant as AsyncFlow's), its main thread's
remainder the trainer loop's.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PERF = Path(__file__).resolve().parent
sys.path.insert(0, str(PERF))
sys.path.insert(0, str(PERF.parent))


def _charge(cls: type, name: str, component: str, unless_inside: str | None = None) -> None:
    """Charge ``cls.name`` to ``component`` (not when called inside a span of ``unless_inside``:
    the policy's log-probs inside the loss are the update's)."""
    from asyncflow import cpu_account

    fn = getattr(cls, name)

    def charged(*args, **kwargs):
        account = cpu_account.ACCOUNT
        if unless_inside is not None and account.current() == unless_inside:
            return fn(*args, **kwargs)
        with account.span(component):
            return fn(*args, **kwargs)
    setattr(cls, name, charged)


def instrument(window_path: str, first: int, last: int) -> None:
    """Spans on the trainer's methods; the window read at the ends of steps ``first`` and ``last``."""
    import accelerate
    import transformers
    from accelerate.optimizer import AcceleratedOptimizer
    from thread_cpu import cpu_by_thread
    from transformers.trainer_callback import CallbackHandler
    from trl import GRPOTrainer

    from asyncflow import cpu_account

    _charge(GRPOTrainer, "training_step", "update")
    _charge(GRPOTrainer, "_prepare_inputs", "driver_loop")  # generation batches: tokenize, pad, advantages
    _charge(GRPOTrainer, "_generate_single_turn", "generation")
    _charge(GRPOTrainer, "_calculate_rewards", "reward")
    _charge(GRPOTrainer, "_get_per_token_logps_and_entropies", "ref_log_prob", unless_inside="update")
    _charge(AcceleratedOptimizer, "step", "update")
    _charge(AcceleratedOptimizer, "zero_grad", "update")
    _charge(accelerate.Accelerator, "clip_grad_norm_", "update")
    _charge(transformers.Trainer, "log", "logging")

    step_end = CallbackHandler.on_step_end
    marks: dict[int, tuple[dict, dict]] = {}

    def on_step_end(self, args, state, control):
        out = step_end(self, args, state, control)
        if state.global_step in (first, last):
            pid = os.getpid()
            marks[state.global_step] = ({tid: v for (_, tid), v in cpu_by_thread({pid}).items()},
                                        cpu_account.ACCOUNT.snapshot())
            if state.global_step == last:
                write_window(window_path, marks[first], marks[last], last - first)
        return out
    CallbackHandler.on_step_end = on_step_end


def write_window(path: str, start: tuple[dict, dict], end: tuple[dict, dict], steps: int) -> None:
    (cpu0, snap0), (cpu1, snap1) = start, end
    threads = {str(tid): [snap1["threads"].get(str(tid), name), round((sec - cpu0.get(tid, (name, 0.0))[1]) * 1e9)]
               for tid, (name, sec) in cpu1.items()}
    spans = {}
    for tid, comps in snap1["spans"].items():
        before = snap0["spans"].get(tid, {})
        spans[tid] = {c: ns - before.get(c, 0) for c, ns in comps.items()}
    Path(path).write_text(json.dumps({"steps": steps, "threads": threads, "spans": spans}))


def main() -> None:
    spec_path, result_path, window_path = sys.argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    os.environ["ASYNCFLOW_CPU_ACCOUNT"] = str(Path(window_path).parent / "trl_account")
    instrument(window_path, int(spec["account_from"]), int(spec["account_to"]))
    import _trl_peer
    sys.argv = [sys.argv[0], spec_path, result_path]
    _trl_peer.main()


if __name__ == "__main__":
    main()
