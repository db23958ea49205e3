"""TRL's GRPOTrainer on the benchmark's workload: the peer of perf/bench_e2e.py.

Runs with the TRL virtual environment's python (perf/.venv-trl, made by bench_e2e.py),
never with the project's: TRL pins its own transformers / accelerate. Reads one JSON
spec (argv[1]), trains, and writes one JSON result (argv[2]).

  spec: model (the warmed-up Hugging Face directory AsyncFlow's runs start from), prompts,
        prompt_ids (AsyncFlow's token ids of those prompts: checked, never trusted), answers
        (in training order), steps, prompts_per_step, group_size, max_completion_length,
        fixed_length, row_targets (optional: each row's target length, [prompt][sample]),
        beta (KL coef), lr, lr_warmup_steps, grad_clip, temperature, seed, threads, out_dir,
        use_vllm (optional: TRL's colocated vLLM generates, see below)
  result: samples_per_s, gen_tokens (every token generated), useful_tokens (the tokens kept
          and trained), their rates, rl_s, steps, per-row lengths and the reward curve

What is made equal to AsyncFlow's run, and how:
- the policy it starts from (the same warmed-up weights) and the prompts: the first
  steps x prompts_per_step of AsyncFlow's stream, in the same order (no shuffling), with
  the token ids asserted equal to AsyncFlow's;
- the reward: AsyncFlow's own ``number`` rule (asyncflow.rewards, pure Python) on the
  completion text TRL decodes (special tokens skipped, as AsyncFlow's reward worker does);
- the optimisation step: one optimizer step per generation batch of prompts_per_step x
  group_size completions, AdamW at the same learning rate with the same linear warm-up,
  the same gradient clip, PPO clip 0.2, token-level loss, k3 KL at the same coefficient;
- lengths: ``fixed_length`` false: both sides stop at EOS or max_completion_length;
  true: EOS is suppressed until max_completion_length (``min_new_tokens``), every row
  has exactly that many tokens; ``row_targets`` (the long-tailed workload): every row is
  trained on exactly its target's tokens. ``generate`` takes one length for a batch, so each
  generation batch runs, EOS suppressed, to its longest target (what a static batch costs:
  its rows are computed until the longest ends), and each row is then cut to its target
  before the reward and the loss see it; the tokens cut off are counted as generated, not
  as useful (see TargetLengths);
- generated tokens are counted as AsyncFlow counts them (bench_e2e.generated_tokens: every
  token a row generated, its EOS included), on the completion ids TRL keeps (cut after the
  first EOS);
- the clock runs from the trainer's on_train_begin to on_train_end: the RL loop only, as
  AsyncFlow's rl_s (model loading, tokenizer, trainer set-up are outside both);
- gradient checkpointing is off (GRPOConfig turns it on by default; AsyncFlow has none).

With ``use_vllm`` (run with a python that has vLLM and TRL: perf/.venv-trl-vllm, made by
bench_e2e.py), TRL generates with vLLM in its own process (``vllm_mode="colocate"``: vLLM's
``external_launcher`` backend, the model runner in the trainer's process, weights pushed into it
after every optimizer step), its KV cache at 1 GiB (VLLM_CPU_KVCACHE_SPACE, the least it takes),
its OpenMP threads bound to the cores the trainer's torch threads may use.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

PERF = Path(__file__).resolve().parent
sys.path.insert(0, str(PERF))
sys.path.insert(0, str(PERF.parent))  # asyncflow.rewards is pure Python: the reward is AsyncFlow's own

from bench_e2e import generated_tokens, length_stats  # noqa: E402


def cut_to_targets(completions: list[list[int]], targets: list[int], generated: int) -> list[list[int]]:
    """Each row cut to its target length; every row must have been generated to ``generated``
    tokens (EOS suppressed until then), the longest target."""
    if len(completions) != len(targets):
        raise RuntimeError(f"row targets: {len(completions)} completions for {len(targets)} targets")
    short = [len(c) for c in completions if len(c) != generated]
    if short:
        raise RuntimeError(f"row targets: rows of {sorted(set(short))} tokens, all should have {generated} "
                           "(EOS suppressed until the batch's longest target)")
    return [list(c[:t]) for c, t in zip(completions, targets)]


def batch_targets(uids: list[int], row_targets: list[list[int]]) -> list[int]:
    """The target of each row of a generation batch: its prompt's targets in turn (the rows of a
    prompt come together, one per sample of its group)."""
    seen: dict[int, int] = {}
    out = []
    for u in uids:
        j = seen.get(u, 0)
        seen[u] = j + 1
        out.append(row_targets[u][j])
    return out


def check_prompt_ids(tok, prompts: list[str], expected: list[list[int]]) -> None:
    """TRL tokenizes plain prompts with ``tok(text=...)``: the ids must be AsyncFlow's."""
    got = tok(text=prompts)["input_ids"]
    for i, (g, e) in enumerate(zip(got, expected)):
        if list(g) != list(e):
            raise ValueError(f"prompt {i} {prompts[i]!r}: TRL's tokenizer gives {list(g)}, AsyncFlow used {list(e)}; "
                             "the two sides would not see the same prompts")


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    out_path = sys.argv[2]
    use_vllm = bool(spec.get("use_vllm"))
    if use_vllm:
        cores = sorted(os.sched_getaffinity(0))[: int(spec.get("threads") or 1)]
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cores))
    import torch
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    os.environ.setdefault("WANDB_DISABLED", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncflow.rewards import number_reward

    transformers.logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    check_prompt_ids(tok, spec["prompts"], spec["prompt_ids"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], attn_implementation="eager")
    # uid: the prompt's position in the stream (AsyncFlow's prompt uid), for the row targets
    ds = Dataset.from_dict({"prompt": spec["prompts"], "answer": spec["answers"],
                            "uid": list(range(len(spec["prompts"])))})
    kept_ids: list[list[int]] = []  # every row's completion ids as TRL keeps them
    rewards: list[float] = []  # mean reward of each generation batch (one per step)

    def number(completions, answer, completion_ids=None, **kw):
        """AsyncFlow's `number` reward; also counts each row's generated tokens."""
        if completion_ids is None:
            raise RuntimeError("TRL did not pass completion_ids to the reward: cannot count generated tokens")
        kept_ids.extend(list(c) for c in completion_ids)
        scores = [number_reward(c if isinstance(c, str) else str(c), str(a)) for c, a in zip(completions, answer)]
        rewards.append(sum(scores) / max(len(scores), 1))
        return scores

    class Clock(TrainerCallback):
        """The RL loop's clock, and the time each step ended (for reward against time)."""

        def __init__(self) -> None:
            self.begin = self.end = None
            self.step_end: list[float] = []

        def on_train_begin(self, args, state, control, **kw):
            self.begin = time.monotonic()

        def on_step_end(self, args, state, control, **kw):
            self.step_end.append(time.monotonic() - self.begin)

        def on_train_end(self, args, state, control, **kw):
            self.end = time.monotonic()

    rows = spec["prompts_per_step"] * spec["group_size"]
    budget = int(spec["max_completion_length"])
    generation = {"min_new_tokens": budget} if spec.get("fixed_length") else None
    args = GRPOConfig(
        output_dir=spec["out_dir"], use_cpu=True, bf16=False, fp16=False, use_vllm=use_vllm,
        **({"vllm_mode": "colocate", "vllm_max_model_length": int(spec.get("max_model_len", 128)),
            "vllm_enable_sleep_mode": False, "vllm_tensor_parallel_size": 1} if use_vllm else {}),
        gradient_checkpointing=False,  # GRPOConfig's default is True; recomputing activations is not equal work
        per_device_train_batch_size=rows, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=spec["group_size"], max_completion_length=budget, generation_kwargs=generation,
        max_steps=spec["steps"], learning_rate=spec["lr"], lr_scheduler_type="constant_with_warmup",
        warmup_steps=int(spec["lr_warmup_steps"]), max_grad_norm=spec["grad_clip"], weight_decay=0.0,
        beta=spec["beta"], epsilon=0.2, loss_type="dapo", scale_rewards="group", temperature=spec["temperature"],
        top_p=1.0, top_k=0, seed=spec["seed"], shuffle_dataset=False,
        report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0, remove_unused_columns=False,
    )
    targets = spec.get("row_targets")
    generated: list[int] = []  # tokens generated per row under row_targets, those cut off included

    class TargetLengths(GRPOTrainer):
        """GRPO with each row cut to its target length (spec row_targets): each generation
        batch is generated to its longest target with EOS suppressed (min_new_tokens =
        max_new_tokens), then each row is cut to its own target."""

        def _generate_and_score_completions(self, inputs):
            self._targets = batch_targets([int(x["uid"]) for x in inputs], targets)
            return super()._generate_and_score_completions(inputs)

        def _generate_single_turn(self, prompt_ids, *args, **kw):
            longest = max(self._targets)
            saved = (self.generation_config.max_new_tokens, self.generation_config.min_new_tokens,
                     dict(self.generation_kwargs))
            self.generation_config.max_new_tokens = self.generation_config.min_new_tokens = longest
            self.generation_kwargs.update(max_new_tokens=longest, min_new_tokens=longest)
            try:
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kw)
            finally:
                self.generation_config.max_new_tokens, self.generation_config.min_new_tokens = saved[:2]
                self.generation_kwargs.clear()
                self.generation_kwargs.update(saved[2])
            generated.extend(len(c) for c in completion_ids)
            kept = cut_to_targets([list(c) for c in completion_ids], self._targets, longest)
            if logprobs is not None:
                logprobs = [lp[:t] for lp, t in zip(logprobs, self._targets)]
            return kept, logprobs

    if targets and use_vllm:
        raise RuntimeError("row_targets: applied on the transformers generate path only, not with use_vllm")
    clock = Clock()
    trainer_class = TargetLengths if targets else GRPOTrainer
    trainer = trainer_class(model=model, reward_funcs=number, args=args, train_dataset=ds, processing_class=tok,
                            callbacks=[clock])
    if getattr(trainer.args, "gradient_checkpointing", False):
        raise RuntimeError("TRL's gradient checkpointing is still on")
    trainer.train()
    rl_s = clock.end - clock.begin
    samples = spec["steps"] * rows
    lengths = [len(c) for c in kept_ids]
    if len(lengths) != samples:
        raise RuntimeError(f"TRL generated {len(lengths)} completions, expected {spec['steps']} steps x {rows} rows")
    if spec.get("fixed_length") and any(n != budget for n in lengths):
        raise RuntimeError(f"fixed_length: TRL rows have {sorted(set(lengths))} tokens, expected all {budget}")
    useful = generated_tokens(kept_ids)
    if targets:
        want = sorted(t for ts in targets[:samples // spec["group_size"]] for t in ts)
        if sorted(lengths) != want:
            raise RuntimeError("row_targets: the trained rows' lengths are not the targets of the prompts trained")
        gen = sum(generated)
    else:
        gen = useful  # every generated token kept (cut after the first EOS, as AsyncFlow's rows end)
    json.dump({
        "trl_version": trl.__version__, "transformers_version": transformers.__version__, "use_vllm": use_vllm,
        "torch_threads": torch.get_num_threads(), "gradient_checkpointing": False,
        "fixed_length": bool(spec.get("fixed_length")), "steps": spec["steps"], "rows_per_step": rows,
        "rl_s": rl_s, "samples_per_s": samples / rl_s, "gen_tokens": gen, "gen_tokens_per_s": gen / rl_s,
        "useful_tokens": useful, "useful_tokens_per_s": useful / rl_s, "row_targets": bool(targets),
        "response_len": length_stats(lengths, budget),
        "reward_curve": [{"samples": (i + 1) * rows, "reward": r, "t": t}
                         for i, (r, t) in enumerate(zip(rewards, clock.step_end))],
    }, open(out_path, "w"))


if __name__ == "__main__":
    main()
