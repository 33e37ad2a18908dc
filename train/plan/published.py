"""The published runs the planner is fitted to and judged against, each with its source.

Why a table of rows and not a few headline numbers: a time model with free constants can
match anything it is tuned on, so what says how far to trust it is its error on rows it
never saw, and that needs many rows from many publishers, on the cards users pick.
`train.plan.calibration` fits and judges; this module only states what was published.

Each row is a configuration as its source publishes it (model, GPU, world size, degrees,
local and global batch, seq_len, activation checkpointing, compile, FP8 recipe, network,
attention kernel) and the figures it reports (tokens/s/GPU; peak reserved memory where
published). What a source leaves out is filled in from the torchtitan release it names,
and said in the row's `assumed`. A row is planned exactly there: the tracer runs at its
world size on a fake process group, with the loss its run computed (every published run
here computed it on the whole logits: `training.loss_chunks = 0`, which the CLI plans the
same way, tests/train/plan/test_plan_published.py), compiled with the model or not: a row
published before torchtitan compiled the loss (pytorch/torchtitan#1033, April 2025) has
`eager_loss`, and its fp32 log-probabilities count in its memory.

A row stays out of the fit and the headline error, and is reported apart, when its
`excluded` says why: its publisher calls its speed a bug, or its layout is not published.

The publications (a row's `source`; "leave one publication out" holds out all of one):
- `TT_DEC24`, `TT_ASYNC`: torchtitan's H100 benchmarks (Meta's 96 GB, 500 W Grand Teton);
- `TRAINY`: torchtitan's H200 benchmark by Trainy on WhiteFiber;
- `TORCHAO_H100`, `TORCHAO_MI300X`, `TORCHAO_B200`: torchao's e2e training tables (three
  runs, three dates, three vendors' cards);
- `AWS`: AWS's torchtitan post on SageMaker p5 (32 H100 SXM5 80 GB: the CLI's default card);
- `PRIMUS`: AMD's Primus (torchtitan backend) on MI325X;
- `THIS_PROJECT`, `H200_CHECK`: this project's GPU check on a leased H100 SXM5 80 GB and a leased
  H200 (`MEASURED_HERE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LLAMA3_8B = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
             "ffn_hidden_dim": 14336, "vocab_size": 128256, "rope_theta": 500000.0}  # fmt: skip
LLAMA3_70B = {"dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8,
              "ffn_hidden_dim": 28672, "vocab_size": 128256, "rope_theta": 500000.0}  # fmt: skip
MODELS = {"8B": LLAMA3_8B, "70B": LLAMA3_70B}


def at_depth(model: str, layers: int) -> str:
    """The MODELS key of `model` cut to `layers` layers (its width kept), added if new:
    the shape of a depth-varying measurement (`layers_row`)."""
    key = f"{model}-{layers}L"
    MODELS.setdefault(key, {**MODELS[model], "n_layers": layers})
    return key


TT_DEC24 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TT_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
TRAINY = "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
TORCHAO_H100 = "pytorch/ao docs/source/workflows/training.md (torchao 0.18), 'NVIDIA H100'"
TORCHAO_MI300X = "pytorch/ao docs/source/workflows/training.md (torchao 0.18), 'AMD MI300x'"
TORCHAO_B200 = (
    "pytorch/ao docs/source/workflows/training.md (torchao 0.18), 'Training e2e benchmarks "
    "on NVIDIA B200'"
)
AWS = (
    "AWS Machine Learning Blog, 'Efficient Pre-training of Llama 3-like model architectures "
    "using torchtitan on Amazon SageMaker' (with Meta, 2024), performance table"
)
PRIMUS = (
    "AMD ROCm performance results (amd.com/en/developer/resources/rocm-hub/dev-ai/"
    "performance-results.html, AI training, PyTorch/Primus) as issue 37 quotes them; layout "
    "from AMD-AGI/Primus examples/torchtitan/configs/MI325X/llama3.1_{8B,70B}-FP8-pretrain.yaml"
)
IBM = "pytorch.org blog 'Supercharging Training using float8 and FSDP2' (2024-11-25)"
THIS_PROJECT = "docs/bench/gpu/2026-11-26-h100.md (this project, measured)"
H200_CHECK = "docs/bench/gpu/2026-11-28-h200.md (this project, measured)"
# a short name for each publication, for tables
SHORT = {
    TT_DEC24: "torchtitan H100, Dec 2024",
    TT_ASYNC: "torchtitan async TP, June 2025",
    TRAINY: "Trainy H200, June 2025",
    TORCHAO_H100: "torchao H100",
    TORCHAO_MI300X: "torchao MI300X",
    TORCHAO_B200: "torchao B200",
    AWS: "AWS p5 (SageMaker)",
    PRIMUS: "AMD Primus MI325X",
    IBM: "IBM/PyTorch 70B",
    THIS_PROJECT: "this project's H100",
    H200_CHECK: "this project's H200",
}


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: str  # a MODELS key
    gpu: str  # a train.plan.gpu_specs.GPUS key
    world_size: int
    tp: int
    cp: int
    local_batch: int
    seq_len: int
    ac: str  # "none" / "selective" / "full"
    compile: bool
    fp8: str  # "" (bf16), "tensorwise", "rowwise", "rowwise_with_gw_hp"
    fp8_all_gather: bool
    async_tp: bool
    tokens_per_s: float  # per GPU
    memory_gib: float | None  # peak reserved, GiB; None: not published
    source: str
    assumed: str = ""
    network: str = ""  # a train.plan.network.NETWORKS key; "": the GPU's default
    attention: str = "flash"  # the kernel: flash (SDPA), flex, ring (CP over SDPA)
    global_batch: int = 0  # sequences per step; 0: local x the FSDP degree
    excluded: str = ""  # why the row is out of the fit and the headline error
    eager_loss: bool = False  # the loss ran eagerly beside a compiled model (before 2025-04)

    @property
    def must_fit(self) -> bool:
        """Whether the row ran this trainer's stack at a known layout (included, or excluded
        for its speed alone): a plan must never refuse it (`train.plan.calibration.fit`)."""
        return self.excluded in ("", ROWWISE_BUG, B200_POWER)

    @property
    def dp_shard(self) -> int:
        return self.world_size // (self.tp * self.cp)

    @property
    def global_batch_size(self) -> int:
        return self.global_batch or self.local_batch * self.dp_shard

    @property
    def configuration(self) -> tuple:
        """Rows that differ only in settings (compile, FP8 recipe, async TP, network) share
        a configuration: leave-one-configuration-out holds them out together."""
        return (self.source, self.model, self.gpu, self.world_size, self.tp, self.cp,
                self.local_batch, self.seq_len, self.ac)  # fmt: skip

    def run_config(self) -> Any:
        """The row as our `RunConfig`, which `python -m train --dry-run` plans the same way:
        the whole-logits loss, the row's attention kernel (sdpa for flash and ring), its
        global batch."""
        from train.config import from_dict

        fp8 = {"enable": bool(self.fp8)}
        if self.fp8:
            fp8 |= {"recipe": self.fp8, "filter_fqns": ["lm_head"],
                    "fsdp_float8_all_gather": self.fp8_all_gather}  # fmt: skip
        parallelism = {"tp": self.tp, "cp": self.cp, "dp_shard": -1}
        if self.world_size == 1:  # FSDP over one rank, as the GPU check ran it
            parallelism["spmd_backend"] = "partial_dtensor"
        raw = {
            "model": {**MODELS[self.model], "max_seq_len": max(self.seq_len, 8192),
                      "attention": "flex" if self.attention == "flex" else "sdpa"},
            "fp8": fp8,
            "dataloader": {"mix": [{"path": "unused"}], "block_tokens": max(self.seq_len, 131072)},
            "validation": {"enable": False},
            "training": {"seq_len": self.seq_len, "local_batch_size": self.local_batch,
                         "global_batch_size": self.global_batch or -1, "loss_chunks": 0},
            "parallelism": parallelism,
            "activation_checkpoint": {"mode": self.ac},
            "compile": {"enable": self.compile, "async_tp": self.async_tp,
                        "components": ["model"] if self.eager_loss else ["model", "loss"]},
        }  # fmt: skip
        return from_dict(raw, f"published run {self.name}")

    def trace_key(self) -> tuple:
        """Rows that trace the same step (the GPU, compile, async TP, network and kernel
        change only the timing)."""
        return (self.model, self.world_size, self.tp, self.cp, self.local_batch, self.seq_len,
                self.ac, self.fp8, self.fp8_all_gather, self.global_batch_size)  # fmt: skip


# what differs between a published step and this trainer's at the same configuration
# torchtitan's Dec 2024 benchmark names "Float8" only; its docs/float8.md then advised the
# FP8 all-gather with precomputed scales for FSDP, which this assumes
DEC24_FP8 = "FP8 tensorwise (the only recipe then) with the FP8 all-gather (assumed)"
FLOAT8_TP = (
    "the published step gathered TP activations in float8 (torchtitan's "
    "Float8ColwiseParallel then); this trainer's TP moves bf16"
)
ROWWISE_BUG = (
    "torchtitan's own note calls this rowwise + TP baseline's speed a bug being fixed "
    "(pytorch/torchtitan#1207)"
)
RING_CP = "CP then: torch's ring attention over SDPA (attention kernel 'ring')"
GRAND_TETON = "RoCE 8 x 400 Gb/s a node ('400 Gb/s per GPU', fabric assumed RoCE)"


def _dec24(name, model, world, tp, cp, batch, seq, ac, compile_, fp8, tps, mem, async_tp=False):
    notes = [DEC24_FP8] if fp8 else []
    notes += ["per-op SAC"] * (ac == "selective") + [RING_CP] * (cp > 1)
    notes += [FLOAT8_TP] * (tp > 1 and fp8 == "tensorwise") + [GRAND_TETON] * (world > 8)
    return PublishedRun(name, model, "h100-96gb", world, tp, cp, batch, seq, ac, compile_, fp8,
                        bool(fp8), async_tp, tps, mem, TT_DEC24, assumed="; ".join(notes),
                        network="roce", attention="ring" if cp > 1 else "flash",
                        eager_loss=True)  # fmt: skip


def _async25(name, model, world, tp, batch, ac, fp8, async_tp, tps):
    notes = ["bf16 FSDP all-gather (the commands set no FP8 all-gather)", GRAND_TETON]
    notes += [FLOAT8_TP] * (fp8 == "tensorwise")
    return PublishedRun(name, model, "h100-96gb", world, tp, 1, batch, 8192, ac, True, fp8,
                        False, async_tp, tps, None, TT_ASYNC, assumed="; ".join(notes),
                        network="roce", excluded=ROWWISE_BUG if fp8 == "rowwise" else "")  # fmt: skip


def _torchao(name, gpu, source, fp8, tps, mem, assumed, excluded=""):
    return PublishedRun(name, "8B", gpu, 8, 1, 1, 1, 8192, "selective", True, fp8,
                        fp8 == "tensorwise", False, tps, mem, source,
                        assumed="per-op SAC; 'GB' read as GiB (torchtitan logs GiB); " + assumed,
                        excluded=excluded, eager_loss=source == TORCHAO_H100)  # fmt: skip


def _aws(name, compile_, fp8, all_gather, tps):
    return PublishedRun(name, "8B", "h100", 32, 1, 1, 1, 8192, "selective", compile_, fp8,
                        all_gather, False, tps, None, AWS, network="aws-p5-efa",
                        assumed="4 x p5.48xlarge (H100 SXM5 80 GB, 3,200 Gb/s EFA); layout not "
                        "stated: torchtitan's llama3_8b.toml then (local batch 1, seq 8192, "
                        "per-op SAC, FSDP over all 32)", eager_loss=True)  # fmt: skip


def _b200(name, fp8, tps, mem):
    return _torchao(name, "b200", TORCHAO_B200, fp8, tps, mem, "torchtitan 6fc499f (Aug 2025)",
                    excluded=B200_POWER)  # fmt: skip


B200_POWER = (
    "torchao ran '8x power limited B200' without stating the limit: the card's peak, "
    "which the plan takes from the datasheet, is unknown"
)
PRIMUS_KERNELS = (
    "AMD's Primus runs its own kernels (Primus-Turbo: AITER flash attention, its own FP8 "
    "linear, tuned hipBLASLt), not the torchtitan + torchao stack this trainer runs on ROCm "
    "(torchao's MI300X rows): a plan of this trainer is not a plan of Primus"
)
_PRIMUS_NOTE = (
    "Primus-Turbo kernels (AITER flash attention, its own FP8 linear), not torchtitan's; "
    "FSDP over the node (Primus' default dp_shard -1), compiled"
)
_TRAINY_NOTE = (
    "per-op SAC (llama3_8b.toml then); its force_recompute_fp8_weight_in_bwd and loss are "
    "not this trainer's; 8 x 400 Gb/s CX-7 a node (fabric assumed NDR InfiniBand)"
)

PUBLISHED: list[PublishedRun] = [
    _dec24("tt-8b-8-eager-bf16", "8B", 8, 1, 1, 2, 8192, "selective", False, "", 5762, 82.4),
    _dec24("tt-8b-8-compile-bf16", "8B", 8, 1, 1, 2, 8192, "selective", True, "", 6667, 77.0),
    _dec24("tt-8b-8-compile-fp8", "8B", 8, 1, 1, 2, 8192, "selective", True, "tensorwise", 8532, 76.8),
    _dec24("tt-8b-128-eager-bf16", "8B", 128, 1, 1, 2, 8192, "selective", False, "", 5605, 67.0),
    _dec24("tt-8b-128-compile-bf16", "8B", 128, 1, 1, 2, 8192, "selective", True, "", 6514, 62.0),
    _dec24("tt-8b-128-compile-fp8", "8B", 128, 1, 1, 2, 8192, "selective", True, "tensorwise", 8380, 61.8),
    _dec24("tt-8b-32k-fsdp8", "8B", 8, 1, 1, 1, 32768, "full", True, "tensorwise", 3890, 83.9),
    _dec24("tt-8b-64k-cp2", "8B", 8, 1, 2, 1, 65536, "full", True, "tensorwise", 2540, 84.2),
    _dec24("tt-8b-128k-cp4", "8B", 8, 1, 4, 1, 131072, "full", True, "tensorwise", 1071, 84.0),
    _dec24("tt-8b-256k-cp8", "8B", 8, 1, 8, 1, 262144, "full", True, "tensorwise", 548, 84.5),
    _dec24("tt-70b-256-tp8", "70B", 256, 8, 1, 16, 8192, "full", True, "tensorwise", 829, 71.9),
    _dec24("tt-70b-256-tp8-async", "70B", 256, 8, 1, 16, 8192, "full", True, "tensorwise", 876, 67.6, async_tp=True),
    _async25("tt25-70b-bf16", "70B", 256, 8, 16, "full", "", False, 597.3),
    _async25("tt25-70b-bf16-async", "70B", 256, 8, 16, "full", "", True, 652.4),
    _async25("tt25-70b-tensorwise", "70B", 256, 8, 16, "full", "tensorwise", False, 809.8),
    _async25("tt25-70b-tensorwise-async", "70B", 256, 8, 16, "full", "tensorwise", True, 942.4),
    _async25("tt25-70b-rowwise", "70B", 256, 8, 16, "full", "rowwise", False, 599.6),
    _async25("tt25-70b-rowwise-async", "70B", 256, 8, 16, "full", "rowwise", True, 624.8),
    _async25("tt25-8b-bf16", "8B", 64, 8, 12, "selective", "", False, 4378),
    _async25("tt25-8b-bf16-async", "8B", 64, 8, 12, "selective", "", True, 4809.4),
    _async25("tt25-8b-tensorwise", "8B", 64, 8, 12, "selective", "tensorwise", False, 5078.1),
    _async25("tt25-8b-tensorwise-async", "8B", 64, 8, 12, "selective", "tensorwise", True, 5570.1),
    _async25("tt25-8b-rowwise", "8B", 64, 8, 12, "selective", "rowwise", False, 3708.5),
    _async25("tt25-8b-rowwise-async", "8B", 64, 8, 12, "selective", "rowwise", True, 3914.9),
    _torchao("ao-8b-bf16", "h100-96gb", TORCHAO_H100, "", 6150, 47.65, "Meta's 96 GB H100 (torchao's roofline table is of it)"),
    _torchao("ao-8b-tensorwise", "h100-96gb", TORCHAO_H100, "tensorwise", 7689.5, 47.77, "Meta's 96 GB H100 (torchao's roofline table is of it)"),
    _torchao("ao-8b-rowwise", "h100-96gb", TORCHAO_H100, "rowwise", 6768, 47.79, "Meta's 96 GB H100 (torchao's roofline table is of it)"),
    _torchao("ao-mi300x-8b-bf16", "mi300x", TORCHAO_MI300X, "", 5376.5, 39.09, "torchtitan 2c8b594 (Aug 2025), ROCm 6.4"),
    _torchao("ao-mi300x-8b-tensorwise", "mi300x", TORCHAO_MI300X, "tensorwise", 6166.0, 39.07, "torchtitan 2c8b594 (Aug 2025), ROCm 6.4"),
    _torchao("ao-mi300x-8b-rowwise-gw-hp", "mi300x", TORCHAO_MI300X, "rowwise_with_gw_hp", 6100.0, 39.32, "torchtitan 2c8b594 (Aug 2025), ROCm 6.4"),
    _torchao("ao-mi300x-8b-rowwise", "mi300x", TORCHAO_MI300X, "rowwise", 5891.0, 39.32, "torchtitan 2c8b594 (Aug 2025), ROCm 6.4"),
    _b200("ao-b200-8b-bf16", "", 8307.5, 33.71),
    _b200("ao-b200-8b-tensorwise", "tensorwise", 10417.0, 33.38),
    _b200("ao-b200-8b-rowwise", "rowwise", 8640.5, 33.72),
    PublishedRun("trainy-8b-32-h200", "8B", "h200", 32, 1, 1, 2, 8192, "selective", True,
                 "tensorwise", True, False, 10938, 47.96, TRAINY, assumed=_TRAINY_NOTE, network="ndr-ib"),
    PublishedRun("trainy-8b-64-h200", "8B", "h200", 64, 1, 1, 2, 8192, "selective", True,
                 "tensorwise", True, False, 10753, 46.97, TRAINY, assumed=_TRAINY_NOTE, network="ndr-ib"),
    _aws("aws-8b-32-eager-bf16", False, "", False, 6475),
    _aws("aws-8b-32-compile-bf16", True, "", False, 7166),
    _aws("aws-8b-32-fp8", True, "tensorwise", False, 8624),
    _aws("aws-8b-32-fp8-all-gather", True, "tensorwise", True, 8950),
    PublishedRun("primus-mi325x-8b-fp8", "8B", "mi325x", 8, 1, 1, 7, 8192, "none", True,
                 "tensorwise", True, False, 16186, None, PRIMUS, assumed=_PRIMUS_NOTE,
                 excluded=PRIMUS_KERNELS),
    PublishedRun("primus-mi325x-70b-fp8", "70B", "mi325x", 8, 1, 1, 2, 8192, "full", True,
                 "tensorwise", True, False, 1726, None, PRIMUS, global_batch=32,
                 assumed=_PRIMUS_NOTE + "; global batch 32 (2 micro-batches a step)",
                 excluded=PRIMUS_KERNELS),
    PublishedRun("ibm-70b-fsdp", "70B", "h100", 256, 1, 1, 2, 8192, "full", True,
                 "tensorwise", True, False, 1430, None, IBM, network="roce", eager_loss=True,
                 excluded="GPU count, batch and AC not published: guessed 256 x FSDP, local 2, full AC"),
]  # fmt: skip


# Measured by this project: scripts/gpu_check's `step` part on a leased H100 SXM5 80 GB,
# configs/llama3_8b_fp8.toml at full width with 2 layers, one GPU, seq 8192, local batch 1,
# compiled, selective AC, FlexAttention; on torch 2.11 with torchtitan's full-logits loss
# (scripts/gpu_check/torch_bridge.py). They join the table as a publication of their own.
TORCH_211 = (
    "torch 2.11.0+cu130 (the leased machine's image), not the pinned 2.13: partial_dtensor "
    "SPMD backend and torchtitan's full-logits CrossEntropyLoss "
    "(scripts/gpu_check/torch_bridge.py)"
)


def layers_row(
    model: str,
    layers: int,
    fp8: str,
    ac: str,
    tokens_per_s: float,
    memory_gib: float | None,
    source: str = THIS_PROJECT,
    assumed: str = TORCH_211,
    gpu: str = "h100",
    name: str = "",
) -> PublishedRun:
    """One step measured on one GPU at `model`'s width cut to `layers` layers (the GPU
    check's `step` and `layers` parts: seq 8192, local batch 1, compiled, FlexAttention,
    FSDP over the one rank, the whole-logits loss): `fp8` "" for bf16 or a recipe, `ac`
    "selective" or "full", `tokens_per_s` and `memory_gib` (peak reserved) as measured.
    A report's rows at 1, 2 and 4 layers join `MEASURED_HERE` as they are: each is
    planned at its own depth, so the fit meets the per-layer terms (the slope between
    depths) and the fixed ones (embedding, lm_head, loss, optimizer) apart."""
    name = name or f"gpu-check-{model.lower()}-{layers}l-{fp8 or 'bf16'}-{ac}"
    return PublishedRun(name, at_depth(model, layers), gpu, 1, 1, 1, 1, 8192, ac, True, fp8,
                        fp8 == "tensorwise", False, tokens_per_s, memory_gib, source,
                        assumed=assumed, attention="flex")  # fmt: skip


MEASURED_HERE: list[PublishedRun] = [
    layers_row("8B", 2, "tensorwise", "selective", 65490, 31.57, name="gpu-check-8b-2l-fp8"),
    layers_row("8B", 2, "", "selective", 61446, 31.51, name="gpu-check-8b-2l-bf16"),
    # the `layers` part on a leased H200 (torch 2.11, the whole-logits loss compiled)
    *(
        layers_row("70B", n, fp8, ac, tok, gib, source=H200_CHECK, gpu="h200")
        for n, fp8, ac, tok, gib in [
            (1, "", "full", 34789, 57.21),
            (1, "tensorwise", "full", 39680, 57.45),
            (2, "", "full", 24003, 70.96),
            (2, "tensorwise", "full", 28796, 71.41),
            (1, "", "selective", 36021, 57.03),
            (1, "tensorwise", "selective", 41568, 58.17),
            (2, "", "selective", 25345, 70.69),
        ]
    ),
]

ROWS: list[PublishedRun] = PUBLISHED + MEASURED_HERE
