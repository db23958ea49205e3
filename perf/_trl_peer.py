"""TRL's GRPOTrainer on the benchmark's workload: the peer of perf/bench_e2e.py.

Runs with the TRL virtual environment's python (perf/.venv-trl, made by bench_e2e.py),
never with the project's: TRL pins its own transformers / accelerate. Reads one JSON
spec (argv[1]), trains, and writes one JSON result (argv[2]):

  spec: model, prompts, answers (in training order), steps, prompts_per_step, group_size,
        max_completion_length, beta (KL coef), lr, temperature, seed, threads
  result: samples_per_s, tokens_per_s, train_s, steps, completion length stats

The prompts are the ones the AsyncFlow runs train on (first steps x prompts_per_step of
the same stream), in the same order (no shuffling); one optimizer step per generation
batch of prompts_per_step x group_size completions, as AsyncFlow's update stage.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    out_path = sys.argv[2]
    if spec.get("threads"):
        import torch
        torch.set_num_threads(int(spec["threads"]))
    os.environ.setdefault("WANDB_DISABLED", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    import trl

    transformers.logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"])
    ds = Dataset.from_dict({"prompt": spec["prompts"], "answer": spec["answers"]})
    lengths: list[int] = []
    number = re.compile(r"-?\d+")

    def exact_number(completions, answer, completion_ids=None, **kw):
        """1.0 when the first number in the completion equals the answer (AsyncFlow's "number")."""
        if completion_ids is not None:
            lengths.extend(len(c) for c in completion_ids)
        out = []
        for c, a in zip(completions, answer):
            m = number.search(c if isinstance(c, str) else str(c))
            out.append(1.0 if m is not None and m.group(0) == str(a) else 0.0)
        return out

    rows = spec["prompts_per_step"] * spec["group_size"]
    args = GRPOConfig(
        output_dir=spec["out_dir"], use_cpu=True, bf16=False, fp16=False, use_vllm=False,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=spec["group_size"], max_completion_length=spec["max_completion_length"],
        max_steps=spec["steps"], learning_rate=spec["lr"], lr_scheduler_type="constant",
        beta=spec["beta"], temperature=spec["temperature"], seed=spec["seed"], shuffle_dataset=False,
        report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0, remove_unused_columns=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=exact_number, args=args, train_dataset=ds,
                          processing_class=tok)
    start = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - start
    samples = spec["steps"] * rows
    tokens = sum(lengths)
    ls = sorted(lengths)
    json.dump({
        "trl_version": trl.__version__, "transformers_version": transformers.__version__,
        "steps": spec["steps"], "rows_per_step": rows, "train_s": train_s,
        "samples_per_s": samples / train_s, "tokens_per_s": tokens / train_s if lengths else None,
        "completion_len_mean": tokens / len(ls) if ls else None,
        "completion_len_p50": ls[len(ls) // 2] if ls else None, "completion_len_max": ls[-1] if ls else None,
    }, open(out_path, "w"))


if __name__ == "__main__":
    main()
