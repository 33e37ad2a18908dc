"""The accelerators a plan can target: memory, peaks and links, each with its source.

Why a table of our own: the planner runs on a CPU, so nothing can be asked of the target
card. Every figure the plan uses about a GPU lives here once, with where it comes from;
the plan's verdicts (memory) and predictions (time, `train.plan.time_model`) read it, and
`--gpu` names a row.

Peaks are dense (no 2:4 sparsity), as NVIDIA's datasheets give them halved, and as
torchao's roofline table (`torchao/testing/training/roofline_utils.py`) and torchtitan's
MFU (`torchtitan.tools.utils.get_peak_flops`) use them. Link bandwidths are per GPU and
per direction: NVLink inside a node; the GPU's own network adapter (one per GPU in these
systems) between nodes.

`h100-96gb` is the card of torchtitan's published H100 benchmarks (Meta's Grand Teton):
96 GB of HBM2e at 2.4 TB/s, run at a 500 W power limit. torchtitan says its peak lies
between the SXM's and the NVL's and that its exact value is unknown
(benchmarks/llama3_h100_202412_torchtitan.md, footnote 2); the plan takes the midpoint of
the two datasheets' peaks, a stated assumption that the published-runs check
(docs/bench) tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float
    source: str
    bf16_flops: float = 0.0  # dense peak, FLOP/s
    fp8_flops: float = 0.0
    memory_bandwidth: float = 0.0  # HBM, bytes/s
    nvlink_bandwidth: float = 0.0  # per GPU per direction, bytes/s
    network_bandwidth: float = 0.0  # per GPU per direction across nodes, bytes/s
    gpus_per_node: int = 8
    peak_source: str = ""

    @property
    def timed(self) -> bool:
        """Whether the time model has the figures it needs for this target."""
        return self.bf16_flops > 0


def _host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


TB = 1e12
GB = 1e9
# NVLink 4 (H100, H200): 900 GB/s per GPU, both directions together
_NVLINK4 = 450 * GB
# ConnectX-7, 400 Gb/s per GPU (DGX H100/H200; torchtitan's Grand Teton: "400 Gb/s per GPU";
# Trainy's H200 hosts: "400Gb/s (Mellanox CX-7) per GPU")
_NIC_400G = 400e9 / 8

# Capacities as sold (HBM is built in GiB-sized stacks); `nvidia-smi` shows slightly less
# (e.g. 81559 MiB on an H100 80GB), which the plan's headroom absorbs.
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        "NVIDIA H100 SXM5 80GB",
        80.0,
        "NVIDIA H100 datasheet (80 GB HBM3)",
        bf16_flops=989e12,
        fp8_flops=1979e12,
        memory_bandwidth=3.35 * TB,
        nvlink_bandwidth=_NVLINK4,
        network_bandwidth=_NIC_400G,
        peak_source="NVIDIA H100 SXM5 datasheet: 989 / 1,979 TFLOPS dense, 3.35 TB/s",
    ),
    "h100-96gb": GpuSpec(
        "NVIDIA H100 96GB HBM2e, 500 W (Grand Teton)",
        96.0,
        "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (96 GB HBM2e)",
        bf16_flops=(989e12 + 835e12) / 2,
        fp8_flops=(1979e12 + 1671e12) / 2,
        memory_bandwidth=2.4 * TB,
        nvlink_bandwidth=_NVLINK4,
        network_bandwidth=_NIC_400G,
        peak_source=(
            "between the H100 SXM5 (989 / 1,979 TFLOPS) and NVL (835 / 1,671) datasheets "
            "(torchtitan: exact value unknown): the midpoint; 2.4 TB/s as torchtitan and "
            "torchao's roofline table state"
        ),
    ),
    "h200": GpuSpec(
        "NVIDIA H200 SXM 141GB",
        141.0,
        "NVIDIA H200 datasheet (141 GB HBM3e)",
        bf16_flops=989e12,
        fp8_flops=1979e12,
        memory_bandwidth=4.8 * TB,
        nvlink_bandwidth=_NVLINK4,
        network_bandwidth=_NIC_400G,
        peak_source="NVIDIA H200 SXM datasheet: 989 / 1,979 TFLOPS dense, 4.8 TB/s",
    ),
    "a100": GpuSpec(
        "NVIDIA A100 SXM4 80GB",
        80.0,
        "NVIDIA A100 datasheet (80 GB HBM2e)",
        bf16_flops=312e12,
        fp8_flops=312e12,  # no FP8 tensor cores: FP8 recipes run no faster than bf16
        memory_bandwidth=2.039 * TB,
        nvlink_bandwidth=300 * GB,
        network_bandwidth=200e9 / 8,
        peak_source="NVIDIA A100 datasheet: 312 TFLOPS bf16 dense, 2,039 GB/s; DGX A100 HDR 200 Gb/s",
    ),
    "b200": GpuSpec(
        "NVIDIA B200 180GB",
        180.0,
        "NVIDIA DGX B200 datasheet (1,440 GB over 8 GPUs)",
        bf16_flops=2.25e15,
        fp8_flops=4.5e15,
        memory_bandwidth=7.672 * TB,
        nvlink_bandwidth=900 * GB,
        network_bandwidth=_NIC_400G,
        peak_source="torchao roofline_utils.py 'NVIDIA B200' (2.25 / 4.5 PFLOPS, 7.67 TB/s)",
    ),
    "cpu": GpuSpec("this machine's RAM", _host_memory_gib(), "os.sysconf physical pages"),
}


def gpu_spec(kind: str) -> GpuSpec:
    """The row for `--gpu kind`, or a ValueError naming the choices."""
    if kind not in GPUS:
        raise ValueError(f"--gpu {kind!r} is not known; choose one of {', '.join(GPUS)}")
    return GPUS[kind]
