"""The accelerators a plan can target: memory, peaks and links, each with its source.

Why a table of our own: the planner runs on a CPU, so nothing can be asked of the target
card. Every figure the plan uses about a GPU lives here once, with where it comes from;
the plan's verdicts (memory) and predictions (time, `train.plan.time_model`) read it, and
`--gpu` names a row.

Peaks are dense (no 2:4 sparsity), as NVIDIA's and AMD's datasheets give them halved, and
as torchao's roofline table (`torchao/testing/training/roofline_utils.py`) and torchtitan's
MFU (`torchtitan.tools.utils.get_peak_flops`) use them. The scale-up bandwidth is per GPU
and per direction inside a node (NVLink; AMD's Infinity Fabric, seven links to the seven
other GPUs of an OAM node); the network between nodes is a per-node preset
(`train.plan.network`), each GPU naming the one its systems usually carry.

`h100-96gb` is the card of torchtitan's published H100 benchmarks (Meta's Grand Teton):
96 GB of HBM2e at 2.4 TB/s, run at a 500 W power limit. torchtitan says its peak lies
between the SXM's and the NVL's and that its exact value is unknown
(benchmarks/llama3_h100_202412_torchtitan.md, footnote 2). Its peak is the SXM's times
a fitted share (`train.plan.time_model.TimeConstants.unknown_clock_share`, `peak_known`
False), pinned by the three publications made on that card; the GEMM efficiency is then
this project's measurement on an SXM5, not a fit that also absorbs an unknown clock.

AMD: MI300X and MI325X (CDNA 3, gfx942) train FP8 in `float8_e4m3fnuz`, whose largest value
is 240, not 448 (torchao picks it at import); MI355X (CDNA 4, gfx950) in the OCP
`float8_e4m3fn` as NVIDIA does. The format changes no FLOP and no byte, so the plan only
names it (`fp8_format`); the FLOP peaks follow from compute units x FLOPs per clock x clock
(MI300X/MI325X: 304 x 4,096 FP8 x 2.1 GHz = 2.61 PFLOPS; MI355X: 256 x 8,192 x 2.4 GHz =
5.03 PFLOPS), as the datasheets state them.

`arch` says which FP8 a card computes: a plan refuses, in one line as a launch on that card
would, FP8 on a card without FP8 GEMMs (A100, sm80), MXFP8 anywhere, and a forced
`fp8.format` the card lacks (`gpu_spec(kind, run)`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

GIB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float
    source: str
    bf16_flops: float = 0.0  # dense peak, FLOP/s
    fp8_flops: float = 0.0
    memory_bandwidth: float = 0.0  # HBM, bytes/s
    scale_up_bandwidth: float = 0.0  # inside a node, per GPU per direction, bytes/s
    gpus_per_node: int = 8
    default_network: str = ""  # a train.plan.network.NETWORKS key
    vendor: str = "nvidia"  # "nvidia" / "amd": which GEMM efficiency the time model applies
    fp8_format: str = "float8_e4m3fn"
    peak_known: bool = True  # False: the card's clock is unknown, its share fitted
    peak_source: str = ""
    arch: str = ""  # NVIDIA compute capability (sm90) or AMD gfx target: which FP8 it has

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
# Infinity Fabric, MI300X/MI325X: 7 links to the other GPUs, 896 GB/s both directions
# together (AMD Instinct MI300X/MI325X data sheets); MI355X: 1,075 GB/s (MI355X data sheet)
_IF_CDNA3 = 448 * GB
_IF_CDNA4 = 537.6 * GB

# Capacities as sold (HBM is built in GiB-sized stacks); `nvidia-smi` shows slightly less
# (e.g. 81559 MiB on an H100 80GB), which the plan's headroom absorbs. A row that differs
# from another card only in memory names only what differs.
_H100 = GpuSpec(
    "NVIDIA H100 SXM5 80GB",
    80.0,
    "NVIDIA H100 datasheet (80 GB HBM3)",
    bf16_flops=989e12,
    fp8_flops=1979e12,
    memory_bandwidth=3.35 * TB,
    scale_up_bandwidth=_NVLINK4,
    default_network="ndr-ib",
    peak_source="NVIDIA H100 SXM5 datasheet: 989 / 1,979 TFLOPS dense, 3.35 TB/s",
    arch="sm90",
)
_MI300X = GpuSpec(
    "AMD Instinct MI300X 192GB",
    192.0,
    "AMD Instinct MI300X data sheet (192 GB HBM3)",
    bf16_flops=1307.4e12,
    fp8_flops=2614.9e12,
    memory_bandwidth=5.3 * TB,
    scale_up_bandwidth=_IF_CDNA3,
    default_network="roce",
    vendor="amd",
    fp8_format="float8_e4m3fnuz",
    peak_source="AMD Instinct MI300X data sheet: 1,307.4 / 2,614.9 TFLOPS dense, 5.3 TB/s",
    arch="gfx942",
)
GPUS: dict[str, GpuSpec] = {
    "h100": _H100,
    "h100-96gb": replace(
        _H100,
        name="NVIDIA H100 96GB HBM2e, 500 W (Grand Teton)",
        memory_gib=96.0,
        source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md (96 GB HBM2e)",
        memory_bandwidth=2.4 * TB,
        default_network="roce",
        peak_known=False,
        peak_source=(
            "the H100 SXM5 datasheet's 989 / 1,979 TFLOPS x the fitted share its 500 W "
            "clock reaches (`unknown_clock_share`; torchtitan: exact value unknown, between "
            "the SXM's and the NVL's 835 / 1,671); 2.4 TB/s as torchtitan and torchao's "
            "roofline table state"
        ),
    ),
    "h200": replace(
        _H100,
        name="NVIDIA H200 SXM 141GB",
        memory_gib=141.0,
        source="NVIDIA H200 datasheet (141 GB HBM3e)",
        memory_bandwidth=4.8 * TB,
        peak_source="NVIDIA H200 SXM datasheet: 989 / 1,979 TFLOPS dense, 4.8 TB/s",
    ),
    "a100": GpuSpec(
        "NVIDIA A100 SXM4 80GB",
        80.0,
        "NVIDIA A100 datasheet (80 GB HBM2e)",
        bf16_flops=312e12,
        fp8_flops=312e12,  # no FP8 GEMMs (sm80): an FP8 plan on it is refused (`gpu_spec`)
        memory_bandwidth=2.039 * TB,
        scale_up_bandwidth=300 * GB,
        default_network="hdr-ib",
        peak_source="NVIDIA A100 datasheet: 312 TFLOPS bf16 dense, 2,039 GB/s; NVLink 3 600 GB/s",
        arch="sm80",
    ),
    "b200": GpuSpec(
        "NVIDIA B200 180GB",
        180.0,
        "NVIDIA DGX B200 datasheet (1,440 GB over 8 GPUs)",
        bf16_flops=2.25e15,
        fp8_flops=4.5e15,
        memory_bandwidth=7.672 * TB,
        scale_up_bandwidth=900 * GB,
        default_network="ndr-ib",
        peak_source="torchao roofline_utils.py 'NVIDIA B200' (2.25 / 4.5 PFLOPS, 7.67 TB/s)",
        arch="sm100",
    ),
    "mi300x": _MI300X,
    "mi325x": replace(
        _MI300X,
        name="AMD Instinct MI325X 256GB",
        memory_gib=256.0,
        source="AMD Instinct MI325X data sheet (256 GB HBM3E)",
        memory_bandwidth=6.0 * TB,
        peak_source="AMD Instinct MI325X data sheet: 1,307.4 / 2,614.9 TFLOPS dense, 6 TB/s",
    ),
    "mi355x": GpuSpec(
        "AMD Instinct MI355X 288GB",
        288.0,
        "AMD Instinct MI355X data sheet (288 GB HBM3E)",
        bf16_flops=2516.6e12,
        fp8_flops=5033.2e12,
        memory_bandwidth=8.0 * TB,
        scale_up_bandwidth=_IF_CDNA4,
        default_network="roce",
        vendor="amd",
        peak_source="AMD Instinct MI355X data sheet: 2.5 / 5.0 PFLOPS dense, 8 TB/s",
        arch="gfx950",
    ),
    "cpu": GpuSpec("this machine's RAM", _host_memory_gib(), "os.sysconf physical pages"),
}


def gpu_spec(kind: str, run: Any = None) -> GpuSpec:
    """The row for `--gpu kind`, or a ValueError naming the choices; with `run` (a
    `train.config.RunConfig`), also one for FP8 settings that GPU cannot train: the rules a
    launch on it checks (`train.fp8.check_fp8_device`), asked of the planned card, so a plan
    refuses in one line what the launch would."""
    if kind not in GPUS:
        raise ValueError(f"--gpu {kind!r} is not known; choose one of {', '.join(GPUS)}")
    spec = GPUS[kind]
    f = run.fp8 if run is not None else None
    if f is None or not f.enable:
        return spec
    if not f.emulate and spec.arch.startswith("sm") and int(spec.arch[2:]) < 89:
        raise ValueError(
            f"fp8.enable = true on --gpu {kind} ({spec.name}, {spec.arch}): it has no FP8 "
            "GEMMs (torchao's float8 training needs NVIDIA SM89+ or AMD MI300+); set "
            "fp8.enable = false or plan another --gpu"
        )
    from train.fp8 import check_fp8_device

    check_fp8_device(run, [spec.arch] if spec.arch.startswith("gfx") else [])
    own = "fnuz" if spec.fp8_format.endswith("fnuz") else "fn"
    if spec.arch.startswith("sm") and f.format not in ("auto", own):
        raise ValueError(
            f"fp8.format = '{f.format}' but --gpu {kind} ({spec.name}) computes FP8 in the "
            f"'{own}' format only; set fp8.format = 'auto' (a forced format is for CPU tests)"
        )
    return spec
