"""The cost model of a simulated device: how long a real device would take for each call.

A roofline model from published hardware and model figures; every constant is listed with
its source in ``SOURCES`` and printed with the results (``CostModel.describe``).

- Decode (memory-bound): one engine step of ``B`` running rows reads the weights once and
  each row's KV cache: ``(weight_bytes + B * ctx * kv_bytes_per_token) / (hbm_bw * hbm_eff)``,
  and at least ``2 * params * B / (peak * mfu_decode)`` of compute.
- Prefill (compute-bound): ``2 * params * prompt_tokens / (peak * mfu_prefill)``.
- Training (compute-bound): ``6 * params * tokens / (peak * mfu_train)`` per device of the
  data-parallel group (forward + backward, Kaplan et al. 2020's 6N rule); a log-prob pass
  is the forward only, ``2 * params * tokens``.
  The gradient all-reduce is a ring (``allreduce_s``): a bandwidth term and a latency term
  per bucket that grows with the ranks, ``2 * (n - 1) * link_latency_s``.
- Links are a node's: its ``node_gbps`` are shared by its devices (``devices_per_node``), so
  a rank's share in a collective is ``node_gbps / devices_per_node`` and the rollout
  instances on one node share its network for the weights they receive.
- Weight sync: every instance receives the bf16 weights (``2 * params`` bytes); the
  receivers on a node share its link and the training nodes' links carry every copy sent.
- Stragglers: a device's work in a call is slowed by a seeded draw (``stragglers.py``,
  lognormal of ``straggler_sigma``); a collective call lasts as long as its slowest rank's.
- Colocated role switch (sync, verl's hybrid engine): weights and optimizer state move to
  host and back over PCIe (``offload_s``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

SOURCES = {
    "h100_sxm": "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS dense BF16, 3.35 TB/s HBM3",
    "qwen2.5": "Qwen2.5 technical report (arXiv 2412.15115) and the models' config.json on Hugging Face: "
               "7B = 7.61e9 params, 28 layers, 4 KV heads x 128; 32B = 32.5e9 params, 64 layers, 8 KV heads x 128",
    "6N": "Kaplan et al. 2020, 'Scaling Laws for Neural Language Models': ~6N training FLOPs per token, 2N forward",
    "mfu": "Narayanan et al. 2021 (Megatron-LM, SC'21): 44-52% of peak in large-scale training; 40% assumed",
    "decode_eff": "vLLM/PagedAttention (Kwon et al. SOSP'23): decode is memory-bound; 60% of HBM bandwidth assumed",
    "link": "NDR InfiniBand 400 Gb/s per port (NVIDIA ConnectX-7), one port per GPU on an 8-GPU node "
            "(DGX H100): 25 GB/s effective assumed per port, 200 GB/s per node, shared by the node's devices",
    "ring": "Thakur, Rabenseifner and Gropp 2005 (Optimization of Collective Communication Operations in MPICH): "
            "ring all-reduce 2(n-1) alpha + 2(n-1)/n bytes/bandwidth; 5 us per hop assumed (InfiniBand with NCCL)",
    "bucket": "PyTorch DistributedDataParallel: gradients all-reduced in buckets of 25 MB (bucket_cap_mb default)",
    "stragglers": "per-rank slowdowns of a step (thermal, kernel, host jitter): lognormal, sigma 0.05 assumed; "
                  "a synchronous collective waits for the slowest rank (Dean and Barroso 2013, The Tail at Scale)",
    "pcie": "PCIe Gen5 x16: 64 GB/s per direction; 25 GB/s effective assumed for offload to host",
}


@dataclass(frozen=True)
class Device:
    name: str = "H100-SXM"
    peak_flops: float = 989e12  # dense BF16
    hbm_bytes_per_s: float = 3.35e12
    hbm_eff: float = 0.6  # share of HBM bandwidth a decode step achieves
    mfu_train: float = 0.40
    mfu_prefill: float = 0.50
    mfu_decode: float = 0.30  # compute bound of a large decode batch


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int = 128
    rollout_tp: int = 1  # devices per rollout instance (tensor parallel)

    @property
    def kv_bytes_per_token(self) -> float:  # K and V, bf16
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def weight_bytes(self) -> float:  # bf16
        return 2 * self.params


MODELS = {
    "qwen2.5-7b": Model("Qwen2.5-7B", 7.61e9, 28, 4, rollout_tp=1),
    "qwen2.5-32b": Model("Qwen2.5-32B", 32.5e9, 64, 8, rollout_tp=4),
}


@dataclass(frozen=True)
class CostModel:
    model: Model
    device: Device = Device()
    node_gbps: float = 200.0  # a node's network (its devices' ports together), GB/s
    devices_per_node: int = 8
    link_latency_s: float = 5e-6  # one hop of a ring collective (alpha)
    grad_bucket_bytes: float = 25e6  # gradients are reduced bucket by bucket
    straggler_sigma: float = 0.05  # lognormal sigma of a device's per-call slowdown (stragglers.py)
    offload_gbps: float = 25.0  # device <-> host, colocated role switches
    call_overhead_s: float = 0.002  # kernel launches, framework work per call (not the control plane)

    @staticmethod
    def named(name: str) -> CostModel:
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r} for the cost model; known: {sorted(MODELS)}")
        return CostModel(MODELS[name])

    # ---- rollout (one instance of model.rollout_tp devices) --------------------------------
    def decode_step_s(self, running: int, mean_context: float) -> float:
        """One engine step: every running row gets one token."""
        m, d = self.model, self.device
        tp = m.rollout_tp
        memory = (m.weight_bytes + running * mean_context * m.kv_bytes_per_token) / (tp * d.hbm_bytes_per_s * d.hbm_eff)
        compute = 2 * m.params * running / (tp * d.peak_flops * d.mfu_decode)
        return max(memory, compute)

    def prefill_s(self, prompt_tokens: int) -> float:
        m, d = self.model, self.device
        return 2 * m.params * prompt_tokens / (m.rollout_tp * d.peak_flops * d.mfu_prefill)

    # ---- training (a data-parallel group: each device its share) ----------------------------
    def train_s(self, tokens_per_device: float) -> float:
        m, d = self.model, self.device
        return self.call_overhead_s + 6 * m.params * tokens_per_device / (d.peak_flops * d.mfu_train)

    def forward_s(self, tokens_per_device: float) -> float:
        m, d = self.model, self.device
        return self.call_overhead_s + 2 * m.params * tokens_per_device / (d.peak_flops * d.mfu_train)

    # ---- collectives (a node's link shared by its devices) ------------------------------------
    @property
    def rank_gbps(self) -> float:
        """A device's share of its node's network."""
        return self.node_gbps / self.devices_per_node

    def _buckets(self, nbytes: float) -> int:
        return max(1, math.ceil(nbytes / self.grad_bucket_bytes))

    def allreduce_s(self, ranks: int, nbytes: float) -> float:
        """A ring all-reduce of ``nbytes`` over ``ranks``: bandwidth plus 2(n-1) hops of latency per bucket."""
        if ranks <= 1:
            return 0.0
        bandwidth = 2 * (ranks - 1) / ranks * nbytes / (self.rank_gbps * 1e9)
        return bandwidth + 2 * (ranks - 1) * self.link_latency_s * self._buckets(nbytes)

    def allgather_s(self, ranks: int, nbytes: float) -> float:
        """A ring all-gather of ``nbytes`` in all: (n-1)/n of them over each rank's link, n-1 hops per bucket."""
        if ranks <= 1:
            return 0.0
        bandwidth = (ranks - 1) / ranks * nbytes / (self.rank_gbps * 1e9)
        return bandwidth + (ranks - 1) * self.link_latency_s * self._buckets(nbytes)

    def grad_sync_s(self, train_devices: int) -> float:
        """The bf16 gradients all-reduced over the data-parallel group."""
        return self.allreduce_s(train_devices, self.model.weight_bytes)

    # ---- weights ---------------------------------------------------------------------------
    def weight_sync_s(self, instances: int = 1, train_devices: int = 1) -> float:
        """One instance receives the new bf16 weights. The instances on a node share its link; the
        training nodes' links carry a copy for every instance (both sides share, the slower decides)."""
        m = self.model
        per_node = max(1, min(instances, self.devices_per_node // m.rollout_tp))
        receive = min(self.node_gbps / per_node, m.rollout_tp * self.rank_gbps)  # its share, at most its ports
        train_nodes = max(1, math.ceil(train_devices / self.devices_per_node))
        send = self.node_gbps * train_nodes / max(instances, 1)
        return m.weight_bytes / (min(receive, send) * 1e9) + self.link_latency_s * self._buckets(m.weight_bytes)

    def gather_s(self, train_devices: int) -> float:
        """The training group gathers full weights for sending (an all-gather of the shards)."""
        return self.call_overhead_s + self.allgather_s(train_devices, self.model.weight_bytes)

    def offload_s(self, state_bytes_per_device: float) -> float:
        return state_bytes_per_device / (self.offload_gbps * 1e9)

    def describe(self) -> dict:
        """Every assumption, for printing beside the results."""
        m = self.model
        return {"model": asdict(m), "device": asdict(self.device), "node_gbps": self.node_gbps,
                "devices_per_node": self.devices_per_node, "link_latency_s": self.link_latency_s,
                "grad_bucket_bytes": self.grad_bucket_bytes, "straggler_sigma": self.straggler_sigma,
                "offload_gbps": self.offload_gbps, "call_overhead_s": self.call_overhead_s,
                "derived": {"decode_step_s_B16_ctx1k": self.decode_step_s(16, 1024),
                            "decode_step_s_B128_ctx1k": self.decode_step_s(128, 1024),
                            "prefill_s_256_tokens": self.prefill_s(256),
                            "train_tokens_per_s_per_device":
                                self.device.peak_flops * self.device.mfu_train / (6 * m.params),
                            "weight_sync_s_8_instances": self.weight_sync_s(8, 8),
                            "grad_sync_s_8_ranks": self.grad_sync_s(8),
                            "grad_sync_s_128_ranks": self.grad_sync_s(128)},
                "sources": SOURCES}
