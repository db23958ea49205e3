"""Tests of asyncflow.platform: the cpu platform for real, cuda/npu where present."""

from __future__ import annotations

import datetime
import queue
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from asyncflow.platform import Platform, get_platform


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return bool(torch.npu.is_available())


CUDA = torch.cuda.is_available()
NPU = _npu_available()


# --- cpu ---------------------------------------------------------------------


def test_cpu_platform_basics():
    platform = get_platform("cpu")
    assert platform == Platform("cpu", "gloo")
    assert platform.backend == "gloo"
    assert platform.is_available()
    assert not platform.is_accelerator
    assert platform.device_count() == 1
    assert platform.device_for_local_rank(0) == torch.device("cpu")
    assert platform.device_for_local_rank(3) == torch.device("cpu")
    assert platform.supports_bf16()
    platform.set_device(0)  # no-op on cpu
    platform.synchronize()  # no-op on cpu


def test_names_are_case_and_space_insensitive():
    assert get_platform(" CPU ").name == "cpu"


def test_negative_local_rank_fails():
    with pytest.raises(ValueError, match="local_rank"):
        get_platform("cpu").device_for_local_rank(-1)


def test_cpu_memory_stats_report_process_rss():
    platform = get_platform("cpu")
    stats = platform.memory_stats()
    assert set(stats) == {"allocated_bytes", "reserved_bytes", "peak_bytes", "rss_bytes"}
    assert stats["rss_bytes"] > 0
    assert stats["peak_bytes"] >= stats["rss_bytes"]
    # 64 MiB written page by page must show up in the resident set.
    block = torch.ones(16 * 1024 * 1024, dtype=torch.float32)
    after = platform.memory_stats()
    assert after["rss_bytes"] >= stats["rss_bytes"] + 32 * 1024 * 1024
    del block


def test_cpu_manual_seed_makes_draws_repeat():
    platform = get_platform("cpu")
    platform.manual_seed(1234)
    first = torch.rand(8)
    platform.manual_seed(1234)
    assert torch.equal(first, torch.rand(8))


@pytest.mark.skipif(CUDA or NPU, reason="an accelerator is present: auto picks it")
def test_auto_picks_cpu_without_accelerator():
    assert get_platform() == Platform("cpu", "gloo")
    assert get_platform("auto").name == "cpu"


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine with one CUDA device and no NPU, whatever this one has."""
    import asyncflow.platform as plat
    monkeypatch.setattr(plat, "_unavailable_reason", lambda name: None if name in ("cpu", "cuda") else "no npu")
    monkeypatch.setattr(Platform, "device_count", lambda self: 1)


def test_auto_takes_the_accelerator_only_with_a_device_per_rank(one_gpu, caplog):
    """nccl refuses two ranks on one device (their first collective fails): found on one H200."""
    assert get_platform("auto", ranks_per_node=1) == Platform("cuda", "nccl")
    with caplog.at_level("WARNING", logger="asyncflow.platform"):
        assert get_platform("auto", ranks_per_node=2) == Platform("cpu", "gloo")
    assert "not cuda: 2 ranks on this node but 1 cuda device(s)" in caplog.text


def test_an_accelerator_asked_for_with_fewer_devices_than_ranks_says_how_to_fit(one_gpu):
    assert get_platform("cuda", ranks_per_node=1).name == "cuda"
    with pytest.raises(RuntimeError, match=r"2 ranks on this node but 1 cuda device\(s\), and nccl runs one rank "
                                           r"per device: .*trainer.nproc=1 placement.mode=colocated.*platform 'cpu'"):
        get_platform("cuda", ranks_per_node=2)
    assert get_platform("cpu", ranks_per_node=8).name == "cpu"  # gloo: any number of ranks


# --- bad and unavailable names -------------------------------------------------


@pytest.mark.parametrize("name", ["tpu", "gpu", "", "cuda:0"])
def test_unknown_name_lists_valid_names(name):
    with pytest.raises(ValueError) as info:
        get_platform(name)
    message = str(info.value)
    assert repr(name) in message
    for valid in ("auto", "cpu", "cuda", "npu"):
        assert valid in message


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
def test_cuda_request_fails_clearly_without_gpu():
    with pytest.raises(RuntimeError) as info:
        get_platform("cuda")
    message = str(info.value)
    assert "'cuda'" in message
    assert "CUDA build of torch" in message
    assert "platform 'cpu'" in message


@pytest.mark.skipif(NPU, reason="an NPU is available here")
def test_npu_request_fails_clearly_without_npu():
    with pytest.raises(RuntimeError) as info:
        get_platform("npu")
    message = str(info.value)
    assert "'npu'" in message
    assert "torch_npu" in message
    assert "platform 'cpu'" in message


def test_unavailable_platform_objects_say_so():
    # A Platform built by hand (not through get_platform) still answers honestly.
    if not CUDA:
        cuda = Platform("cuda", "nccl")
        assert not cuda.is_available()
        assert cuda.device_count() == 0
        assert not cuda.supports_bf16()
        with pytest.raises(RuntimeError, match="no visible device"):
            cuda.device_for_local_rank(0)
    if not NPU:
        npu = Platform("npu", "hccl")
        assert not npu.is_available()
        assert npu.device_count() == 0


# --- accelerators, where present ------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device")),
        pytest.param("npu", marks=pytest.mark.skipif(not NPU, reason="no NPU device")),
    ],
)
def test_accelerator_platform(name):
    platform = get_platform(name)
    assert platform.backend == {"cuda": "nccl", "npu": "hccl"}[name]
    count = platform.device_count()
    assert count >= 1
    device = platform.device_for_local_rank(count)  # wraps around
    assert device == torch.device(name, 0)
    platform.set_device(device)
    before = platform.memory_stats()
    block = torch.ones(1024, 1024, device=device)
    platform.synchronize()
    after = platform.memory_stats()
    assert after["allocated_bytes"] >= before["allocated_bytes"] + block.numel() * 4
    assert after["peak_bytes"] >= after["allocated_bytes"]
    assert after["rss_bytes"] > 0
    platform.manual_seed(7)
    first = torch.rand(4, device=device)
    platform.manual_seed(7)
    assert torch.equal(first, torch.rand(4, device=device))
    assert isinstance(platform.supports_bf16(), bool)


# --- two processes over the cpu platform's backend -------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _all_reduce_worker(rank: int, world_size: int, port: int, results) -> None:
    try:
        import torch.distributed as dist

        platform = get_platform("cpu")
        dist.init_process_group(
            platform.backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=30),
        )
        try:
            tensor = torch.tensor([float(rank + 1)], device=platform.device_for_local_rank(rank))
            dist.all_reduce(tensor)
            platform.synchronize()
            results.put((rank, dist.get_backend(), tensor.item(), None))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        results.put((rank, None, None, traceback.format_exc()))


@pytest.mark.slow
@pytest.mark.both_stacks
def test_two_process_all_reduce_over_platform_backend():
    world_size = 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_all_reduce_worker, args=(rank, world_size, port, results))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        got = {}
        for _ in range(world_size):
            try:
                rank, backend, value, error = results.get(timeout=60)
            except queue.Empty:
                pytest.fail(f"no all_reduce result within 60 s; have ranks {sorted(got)}")
            assert error is None, f"rank {rank} failed:\n{error}"
            got[rank] = (backend, value)
        assert got == dict.fromkeys(range(world_size), ("gloo", 3.0))
        for proc in procs:
            proc.join(timeout=30)
            assert proc.exitcode == 0, f"worker exited with {proc.exitcode}"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


def test_train_refuses_more_ranks_than_devices_before_any_rank_starts(one_gpu, tmp_path, capsys, monkeypatch):
    from asyncflow.launcher import train_main
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    started = []
    monkeypatch.setattr("asyncflow.launcher.launch_local", lambda *a, **k: started.append(a) or 0)
    assert train_main(["grpo", "trainer.platform=cuda", "trainer.nproc=2", f"trainer.out_dir={tmp_path}"]) == 2
    assert not started
    err = capsys.readouterr().err
    assert "trainer.platform=cuda: 2 ranks on this node but 1 cuda device(s)" in err


def test_ranks_that_share_a_nodes_devices(monkeypatch):
    from asyncflow.single_controller.launch import ranks_sharing_devices
    for var in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert ranks_sharing_devices(4) == 4  # about to spawn them with this environment
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ranks_sharing_devices() == 1  # started one by one (srun): each may see a device of its own
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    assert ranks_sharing_devices() == 8  # torchrun's agent starts them all with one environment
