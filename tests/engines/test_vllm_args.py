"""vllm_args: vLLM's engine arguments from the run's config over platform defaults, the start-up
checks against what the installed vLLM reports, and the CPU thread binding per rank.
Pure functions over plain values: no vLLM needed."""
from __future__ import annotations

import pytest

from asyncflow.engines.rollout.vllm_args import VLLMFacts, cpu_bind, engine_kwargs, problems

FACTS = VLLMFacts(version="0.32.0", device_type="cpu", sleep_mode=False,
                  arg_names=frozenset({"enforce_eager", "max_model_len", "kv_cache_memory_bytes", "dtype", "seed",
                                       "tensor_parallel_size", "enable_sleep_mode", "async_scheduling",
                                       "gpu_memory_utilization", "max_num_seqs", "logprobs_mode", "model"}),
                  architectures=frozenset({"Qwen2ForCausalLM", "LlamaForCausalLM"}))


def _kwargs(user=None, **kw):
    base = dict(dtype="float32", seed=3, max_num_seqs=64, gpu_memory_utilization=0.5, sleep_mode_available=False,
                want_sleep=False, platform="cpu")
    base.update(kw)
    return engine_kwargs(user or {}, **base)


def test_defaults_follow_the_platform_and_the_user_has_the_last_word():
    cpu = _kwargs()
    assert cpu["enforce_eager"] is True and cpu["enable_sleep_mode"] is False and cpu["async_scheduling"] is False
    assert (cpu["dtype"], cpu["seed"], cpu["max_num_seqs"]) == ("float32", 3, 64)
    cuda = _kwargs(platform="cuda", sleep_mode_available=True, want_sleep=True)
    assert "enforce_eager" not in cuda and cuda["enable_sleep_mode"] is True
    assert _kwargs(platform="cuda", sleep_mode_available=False, want_sleep=True)["enable_sleep_mode"] is False
    assert _kwargs({"enforce_eager": False, "max_model_len": 96})["enforce_eager"] is False
    older = _kwargs(arg_names=frozenset({"dtype"}))  # a vLLM without those arguments is not given them
    assert "async_scheduling" not in older and "gpu_memory_utilization" not in older


def _problems(user=None, archs=("Qwen2ForCausalLM",), platform="cpu", want_sleep=False, forced=False):
    return problems(user or {}, FACTS, platform=platform, architectures=list(archs), want_sleep=want_sleep,
                    forced_sleep=forced)


def test_a_good_run_has_no_problem():
    assert _problems({"enforce_eager": True, "kv_cache_memory_bytes": 1 << 28, "tensor_parallel_size": 2}) == []


@pytest.mark.parametrize("user, expected", [
    ({"enforce_eagre": True}, r"rollout.engine_kwargs: vLLM 0.32.0 takes no argument \['enforce_eagre'\]"),
    ({"logprobs_mode": "raw_logprobs"}, "rollout.engine_kwargs.logprobs_mode: set by AsyncFlow"),
    ({"async_scheduling": True}, "rollout.engine_kwargs.async_scheduling: set by AsyncFlow"),
    ({"dtype": "bfloat16"}, "rollout.engine_kwargs.dtype: set it with weight_sync.dtype"),
    ({"max_num_seqs": 4}, "rollout.engine_kwargs.max_num_seqs: set it with rollout.max_running_rows"),
    ({"enable_sleep_mode": True}, "enable_sleep_mode: vLLM has no sleep mode on cpu"),
])
def test_engine_arguments_are_refused_naming_the_key(user, expected):
    found = _problems(user)
    assert any(__import__("re").search(expected, p) for p in found), found


def test_an_architecture_vllm_cannot_serve_names_model_path():
    (msg,) = _problems(archs=("MyNewForCausalLM",))
    assert msg.startswith("model.path:") and "MyNewForCausalLM" in msg and "rollout.engine=builtin" in msg
    assert _problems(archs=())[0].startswith("model.path:")


def test_another_platform_and_forced_offload_without_sleep_are_refused():
    assert any("runs on cpu, this run's ranks on cuda" in p for p in _problems(platform="cuda"))
    (msg,) = _problems(want_sleep=True, forced=True)
    assert msg.startswith("placement.offload_idle=on") and "no sleep mode" in msg
    assert _problems(want_sleep=True, forced=False) == []  # auto: the instance keeps its memory, said in the log


@pytest.mark.parametrize("cores, local, ranks, threads, tp, expected", [
    ([0, 1], 1, 2, 1, 1, "1"),  # async, 2 ranks on 2 cores: the rollout rank's own core
    ([0, 1], 0, 2, 1, 1, "0"),
    ([0, 1, 2, 3], 1, 2, 2, 1, "2,3"),
    ([0, 1], 1, 2, 0, 1, "0,1"),  # 0 threads (sync disaggregated): every core
    ([0, 1, 2, 3], 0, 1, 0, 2, "0,1|2,3"),  # tensor parallel: the share split among the workers
    ([0, 1], 1, 2, 1, 2, "1|0"),  # fewer cores than workers: one each, round-robin
    ([4, 6], 0, 1, 1, 1, "4"),  # cores as the affinity mask names them
])
def test_cpu_binding_gives_each_rank_its_share(cores, local, ranks, threads, tp, expected):
    assert cpu_bind(cores, local, ranks, threads, tp) == expected


def test_cpu_binding_needs_a_core():
    with pytest.raises(ValueError, match="no usable cores"):
        cpu_bind([], 0, 1, 1, 1)


def test_the_kv_cache_fits_the_runs_rows_not_half_the_machine():
    from asyncflow.engines.rollout.vllm_args import kv_cache_bytes
    tiny = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}
    assert kv_cache_bytes(tiny, max_rows=256, max_len=128, dtype_bytes=4) == 64 << 20  # the floor
    big = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584}
    # 2 (k, v) x 28 layers x 4 heads x 128 dims x 2 bytes = 57344 bytes a token, x 64 rows x 4096, x 1.25
    assert kv_cache_bytes(big, max_rows=64, max_len=4096, dtype_bytes=2) == int(1.25 * 57344 * 64 * 4096)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        kv_cache_bytes({"hidden_size": 8}, max_rows=1, max_len=1, dtype_bytes=4)
