"""The cluster simulation at a small scale: the real executor and TransferQueue carry every
row exactly once, through every stage, in each data path and mode (asyncflow/simulation)."""
from __future__ import annotations

import pytest

from asyncflow.simulation.cluster import ClusterConfig, Layout, simulate
from asyncflow.simulation.costs import CostModel

pytestmark = pytest.mark.slow  # host processes of simulated ranks: about 10 s a run

# A short window (the script's runs use >= 2 warm-up and >= 3 measured steps); the probe calls
# every rank often enough to be sampled inside it.
SMALL = dict(devices=8, prompts_per_step=4, warm_steps=1, measured_steps=2, scale=0.02, hosts=1, timeout_s=120.0,
             fan_out_interval_s=0.05)


def _check_every_row_once(cfg: ClusterConfig, r: dict) -> None:
    a = r["audit"]
    issued = cfg.steps * 4 * 8  # steps run (warm-up, window and tail) x prompts x group
    assert a["issued"] == issued
    assert a["trained_equals_issued"] and a["trained"] == a["trained_distinct"] == issued
    for stage in ("generated", "scored", "old_log_probs", "ref_log_probs"):
        assert a[stage] == issued, (stage, a)
    assert a["partitions_left"] == []  # every step's partition was cleared after its update
    assert r["samples_per_s"] > 0 and r["rows_per_step"] == 32  # the window's steps only
    assert 0 <= r["controller_busy"] < 1 and r["get_meta"]["n"] > 0
    f = r["fan_out"]  # the probe reached every training rank inside the window
    assert f["ranks"] == r["train_devices"] and f["n"] >= 1 and f["p50_us"] > 0, f


@pytest.mark.parametrize("mode", ["async", "stream"])
def test_disaggregated_modes_through_the_transfer_queue(mode):
    cfg = ClusterConfig(mode=mode, **SMALL)
    r = simulate(cfg)
    _check_every_row_once(cfg, r)
    assert r["tq_put_bytes_per_step"] > 0  # rows went through the hosts' storage units


@pytest.mark.parametrize("carries", ["inputs", "all"])
def test_sync_colocated_with_data_through_the_driver(carries):
    cfg = ClusterConfig(mode="sync", data_path="driver", driver_carries=carries, **SMALL)
    _check_every_row_once(cfg, simulate(cfg))


@pytest.mark.both_stacks
def test_layouts_and_cost_model():
    lay = Layout.of(ClusterConfig(devices=16, mode="async"))
    assert lay.world == 16 and len(lay.actor) == 8 and len(lay.instances) == 8 and lay.reward == [8]
    lay32 = Layout.of(ClusterConfig(devices=16, mode="async", model="qwen2.5-32b"))
    assert lay32.rollout_devices == 8 and len(lay32.instances) == 2 and lay32.world == 10  # TP 4 instances
    sync = Layout.of(ClusterConfig(devices=16, mode="sync"))
    assert sync.actor == list(range(16)) and len(sync.instances) == 16
    with pytest.raises(ValueError, match="sync only"):
        ClusterConfig(mode="async", data_path="driver")
    with pytest.raises(ValueError, match="driver_carries"):
        ClusterConfig(mode="sync", data_path="driver", driver_carries="some")
    c = CostModel.named("qwen2.5-7b")
    assert c.decode_step_s(64, 1000) > c.decode_step_s(1, 1000) > 0  # more rows read more KV cache
    assert c.train_s(2000) > c.forward_s(2000) > 0
    with pytest.raises(ValueError, match="unknown model"):
        CostModel.named("gpt-5")
