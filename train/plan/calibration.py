"""Published runs the plan is checked against, and the fit of the time model's constants.

Why: a time model with free constants can match anything it is tuned on. So the constants
(`train.plan.time_model.TimeConstants`) are few, each with a prior, and the model is judged
leave-one-out: for each published row the constants are fitted to the *other* rows, and
that fit predicts the row. The mean absolute error of those predictions is what the plan
promises for a configuration nobody has published (targets: 15 % on tokens/s, 10 % on
reserved memory; docs/bench/plan_published-2026-11-24.md states where a row falls outside
and why).

Each row is a configuration as its source publishes it (model, GPUs, degrees, local batch,
seq_len, activation checkpointing, compile, FP8 recipe), planned exactly there: the tracer
runs at the row's world size on a fake process group. What a source leaves out is filled
in from the torchtitan release it names, and said in the row's `assumed`; a row whose
layout is not published at all (IBM and Meta's 70B) is planned at a stated guess and
left out of the error (`exact=False`).

Every published run computed its loss on the whole logits (torchtitan's `ChunkedLossWrapper`
came later), so the rows are traced with that loss (`full_logits_loss`): at 8K tokens and a
128K vocabulary the fp32 logits and their gradient are several GiB that this trainer's
chunked loss never holds.

How the fit works: the traced counts do not depend on the constants, so every row is traced
once (`trace_rows`), and fitting is arithmetic: a coordinate search over each constant's
range minimising the mean absolute relative error (tokens/s for the time constants,
reserved memory for the memory ones), deterministic and dependency-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from train.plan.time_model import Layout, TimeConstants, predict, reserved_bytes

GIB = 1024**3

LLAMA3_8B = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
             "ffn_hidden_dim": 14336, "vocab_size": 128256, "rope_theta": 500000.0}  # fmt: skip
LLAMA3_70B = {"dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8,
              "ffn_hidden_dim": 28672, "vocab_size": 128256, "rope_theta": 500000.0}  # fmt: skip
MODELS = {"8B": LLAMA3_8B, "70B": LLAMA3_70B, "8B-2L": {**LLAMA3_8B, "n_layers": 2}}

TT_DEC24 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TT_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
TRAINY = "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
TORCHAO = "pytorch/ao docs/source/workflows/training.md (torchao 0.18), 'NVIDIA H100'"
IBM = "pytorch.org blog 'Supercharging Training using float8 and FSDP2' (2024-11-25)"
# torchtitan's Dec 2024 benchmark names "Float8" only; its docs/float8.md then advised the
# FP8 all-gather with precomputed scales for FSDP, which this assumes
DEC24_FP8 = "FP8 tensorwise (the only recipe then) with the FP8 all-gather (assumed)"


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: str  # "8B" / "70B"
    gpu: str  # train.plan.gpu_specs.GPUS key
    world_size: int
    tp: int
    cp: int
    local_batch: int
    seq_len: int
    ac: str  # "none" / "selective" / "full"
    compile: bool
    fp8: str  # "" (bf16), "tensorwise", "rowwise"
    fp8_all_gather: bool
    async_tp: bool
    tokens_per_s: float  # per GPU
    memory_gib: float | None  # peak reserved, GiB; None: not published
    source: str
    assumed: str = ""
    exact: bool = True

    @property
    def dp_shard(self) -> int:
        return self.world_size // (self.tp * self.cp)

    def run_config(self) -> Any:
        """The row as our `RunConfig` (global batch: local x FSDP degree, as torchtitan's
        default -1 makes it)."""
        from train.config import from_dict

        fp8 = {"enable": bool(self.fp8)}
        if self.fp8:
            fp8 |= {"recipe": self.fp8, "filter_fqns": ["lm_head"],
                    "fsdp_float8_all_gather": self.fp8_all_gather}  # fmt: skip
        raw = {
            "model": {**MODELS[self.model], "max_seq_len": max(self.seq_len, 8192)},
            "fp8": fp8,
            "dataloader": {"mix": [{"path": "unused"}], "block_tokens": max(self.seq_len, 131072)},
            "validation": {"enable": False},
            "training": {"seq_len": self.seq_len, "local_batch_size": self.local_batch,
                         "global_batch_size": -1},
            "parallelism": {"tp": self.tp, "cp": self.cp, "dp_shard": -1},
            "activation_checkpoint": {"mode": self.ac},
            "compile": {"enable": self.compile, "async_tp": self.async_tp},
        }  # fmt: skip
        return from_dict(raw, f"published run {self.name}")

    def trace_key(self) -> tuple:
        """Rows that trace the same step (compile and async TP change only the timing);
        the last item: whether its memory is measured (published)."""
        same = dataclasses.replace(
            self, name="", compile=False, async_tp=False, tokens_per_s=0.0, memory_gib=None,
            source="", assumed="", exact=True, gpu="h100" if self.gpu != "cpu" else "cpu")  # fmt: skip
        return (*dataclasses.astuple(same), self.memory_gib is not None)


# what differs between a published step and this trainer's at the same configuration
FLOAT8_TP = (
    "the published step gathered TP activations in float8 (torchtitan's "
    "Float8ColwiseParallel then); this trainer's TP moves bf16"
)
ROWWISE_TP = "torchtitan calls this baseline's speed a bug (pytorch/torchtitan#1207)"
RING_CP = ("CP then: torch's ring attention over SDPA; planned as this trainer's "
           "FlexAttention K/V all-gather; memory near the 96 GB card (an upper bound)")  # fmt: skip


def _dec24(name, model, world, tp, cp, batch, seq, ac, compile_, fp8, tps, mem, async_tp=False):
    notes = [DEC24_FP8] if fp8 else []
    notes += ["per-op SAC"] * (ac == "selective") + [RING_CP] * (seq > 8192)
    notes += [FLOAT8_TP] * (tp > 1 and fp8 == "tensorwise")
    return PublishedRun(name, model, "h100-96gb", world, tp, cp, batch, seq, ac, compile_, fp8,
                        bool(fp8), async_tp, tps, mem, TT_DEC24, assumed="; ".join(notes))  # fmt: skip


def _async25(name, model, world, tp, batch, ac, fp8, async_tp, tps):
    notes = ["bf16 FSDP all-gather (the commands set no FP8 all-gather)"]
    notes += [FLOAT8_TP] * (fp8 == "tensorwise") + [ROWWISE_TP] * (fp8 == "rowwise")
    return PublishedRun(name, model, "h100-96gb", world, tp, 1, batch, 8192, ac, True, fp8,
                        False, async_tp, tps, None, TT_ASYNC, assumed="; ".join(notes))  # fmt: skip


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
    PublishedRun("ao-8b-bf16", "8B", "h100-96gb", 8, 1, 1, 1, 8192, "selective", True, "",
                 False, False, 6150, 47.65, TORCHAO,
                 assumed="Meta's 96 GB H100 (torchao's roofline table is of it); 'GB' read as GiB"),
    PublishedRun("ao-8b-tensorwise", "8B", "h100-96gb", 8, 1, 1, 1, 8192, "selective", True,
                 "tensorwise", True, False, 7689.5, 47.77, TORCHAO,
                 assumed="Meta's 96 GB H100 (torchao's roofline table is of it); 'GB' read as GiB"),
    PublishedRun("ao-8b-rowwise", "8B", "h100-96gb", 8, 1, 1, 1, 8192, "selective", True,
                 "rowwise", False, False, 6768, 47.79, TORCHAO,
                 assumed="Meta's 96 GB H100 (torchao's roofline table is of it); 'GB' read as GiB"),
    PublishedRun("trainy-8b-32-h200", "8B", "h200", 32, 1, 1, 2, 8192, "selective", True,
                 "tensorwise", True, False, 10938, 47.96, TRAINY,
                 assumed="per-op SAC (llama3_8b.toml then); its force_recompute_fp8_weight_in_bwd and loss are not this trainer's"),
    PublishedRun("trainy-8b-64-h200", "8B", "h200", 64, 1, 1, 2, 8192, "selective", True,
                 "tensorwise", True, False, 10753, 46.97, TRAINY,
                 assumed="per-op SAC (llama3_8b.toml then); its force_recompute_fp8_weight_in_bwd and loss are not this trainer's"),
    PublishedRun("ibm-70b-fsdp", "70B", "h100", 256, 1, 1, 2, 8192, "full", True,
                 "tensorwise", True, False, 1430, None, IBM,
                 assumed="GPU count, batch and AC not published: guessed 256 x FSDP, local 2, full AC",
                 exact=False),
]  # fmt: skip


# Measured by this project: scripts/gpu_check's `step` part on a lent H100 SXM5 80 GB,
# configs/llama3_8b_fp8.toml at full width with 2 layers, one GPU, seq 8192, local batch 1,
# compiled, selective AC. Kept apart from PUBLISHED, out of the fit and its error, until
# there are enough of them to weigh against the published rows (issue 35); the plan's
# prediction for each is checked against it in tests/train/plan/test_plan_published.py.
GPU_CHECK_H100 = "docs/bench/gpu/2026-11-26-h100.md (this project, measured)"
TORCH_211 = (
    "torch 2.11.0+cu130 (the lent image), not the pinned 2.13: partial_dtensor SPMD backend "
    "and torchtitan's full-logits CrossEntropyLoss (scripts/gpu_check/torch_bridge.py)"
)
MEASURED_HERE: list[PublishedRun] = [
    PublishedRun("gpu-check-8b-2l-fp8", "8B-2L", "h100", 1, 1, 1, 1, 8192, "selective", True,
                 "tensorwise", True, False, 65490, 31.57, GPU_CHECK_H100, assumed=TORCH_211),
    PublishedRun("gpu-check-8b-2l-bf16", "8B-2L", "h100", 1, 1, 1, 1, 8192, "selective", True,
                 "", False, False, 61446, 31.51, GPU_CHECK_H100, assumed=TORCH_211),
]  # fmt: skip


# --------------------------------------------------------------------------- tracing


def trace_rows(rows: list[PublishedRun] = PUBLISHED) -> dict[str, Any]:
    """{row name: StepCounts}, each distinct traced step traced once (minutes on 2 cores)."""
    from train.plan.trace import TRACED_LAYERS, measure, traced_config

    by_key: dict[tuple, Any] = {}
    counts = {}
    for row in rows:
        key = row.trace_key()
        if key not in by_key:
            by_key[key] = measure(traced_config(row.run_config()), row.world_size,
                                  accelerator=True, traced_layers=TRACED_LAYERS,
                                  full_logits_loss=True,
                                  track_memory=key[-1])  # fmt: skip
        counts[row.name] = by_key[key]
    return counts


def predicted(row: PublishedRun, counts: Any, c: TimeConstants) -> tuple[float, float]:
    """(tokens/s/GPU, reserved GiB) the plan predicts for `row` with constants `c`."""
    from train.plan.gpu_specs import GPUS
    from train.plan.report import memory_of

    layout = Layout(
        world_size=row.world_size,
        global_batch_size=row.local_batch * row.world_size // (row.tp * row.cp),
        seq_len=row.seq_len,
        compile=row.compile,
        async_tp=row.async_tp,
        fp8_all_gather=row.fp8_all_gather,
    )
    prediction = predict(counts, layout, GPUS[row.gpu], c)
    memory, _ = memory_of(counts)
    reserved = reserved_bytes(counts, memory.total, row.compile, c) / GIB
    return prediction.tokens_per_s_per_gpu, reserved


# --------------------------------------------------------------------------- the fit

# constant -> (low, high): the range the search may use
THROUGHPUT_CONSTANTS = {
    "gemm_efficiency": (0.3, 0.95),
    "rowwise_gemm_efficiency": (0.15, 0.95),
    "attention_efficiency": (0.15, 0.9),
    "compiled_traffic": (0.02, 1.0),
    "eager_traffic": (0.2, 1.5),
    "link_efficiency": (0.3, 1.0),
    "async_tp_hidden": (0.0, 1.0),
}
MEMORY_CONSTANTS = {"allocator_overhead": (0.0, 0.6), "compiled_activations": (0.3, 1.2)}
# Where every fit starts: sourced values where there are any, else round guesses; the fit to
# all rows and each leave-one-out fit start here (never from a fit that saw the left-out row)
PRIORS = TimeConstants(
    gemm_efficiency=0.78,  # torchao roofline_utils.py pct_achievable_gemm_tops (H100)
    rowwise_gemm_efficiency=0.78,  # the same, no separate source
    attention_efficiency=0.5,
    compiled_traffic=0.5,
    eager_traffic=1.0,  # the trace's own count
    link_efficiency=0.8,
    async_tp_hidden=0.5,
    allocator_overhead=0.1,
    compiled_activations=1.0,  # the trace's own count
)


def errors(rows: list[PublishedRun], counts: dict, c: TimeConstants) -> tuple[list, list]:
    """Relative errors (predicted / published - 1) on tokens/s and on memory."""
    tps, mem = [], []
    for row in rows:
        tokens, reserved = predicted(row, counts[row.name], c)
        tps.append(tokens / row.tokens_per_s - 1)
        if row.memory_gib is not None:
            mem.append(reserved / row.memory_gib - 1)
    return tps, mem


def _mae(values: list[float]) -> float:
    return sum(abs(v) for v in values) / len(values) if values else 0.0


def fit(rows: list[PublishedRun], counts: dict) -> TimeConstants:
    """Constants minimising the mean absolute relative error over `rows`, from `PRIORS`."""
    c = PRIORS
    exact = [r for r in rows if r.exact]
    for names, which in ((THROUGHPUT_CONSTANTS, 0), (MEMORY_CONSTANTS, 1)):
        c = _coordinate_search(c, names, lambda k, w=which: _mae(errors(exact, counts, k)[w]))
    return c


def _coordinate_search(c: TimeConstants, ranges: dict, loss) -> TimeConstants:
    best = loss(c)
    step = 0.25
    while step > 0.002:
        improved = False
        for name, (low, high) in ranges.items():
            for direction in (1, -1):
                value = getattr(c, name) + direction * step * (high - low)
                if not low <= value <= high:
                    continue
                trial = c.replace(**{name: round(value, 4)})
                trial_loss = loss(trial)
                if trial_loss < best - 1e-9:
                    c, best, improved = trial, trial_loss, True
        if not improved:
            step /= 2
    return c


@dataclass
class Check:
    """The published-runs check: each row predicted by constants fitted without it."""

    rows: list[PublishedRun]
    constants: TimeConstants  # fitted to every exact row
    tps_loo: dict[str, float]  # row -> relative error, leave-one-out
    memory_loo: dict[str, float]
    predictions: dict[str, tuple[float, float]]  # row -> leave-one-out (tokens/s, GiB)

    @property
    def tps_mae(self) -> float:
        exact = {r.name for r in self.rows if r.exact}
        return _mae([v for k, v in self.tps_loo.items() if k in exact])

    @property
    def memory_mae(self) -> float:
        exact = {r.name for r in self.rows if r.exact}
        return _mae([v for k, v in self.memory_loo.items() if k in exact])


def leave_one_out(rows: list[PublishedRun], counts: dict) -> Check:
    """Fit on all exact rows; then, for each row, fit without it and predict it."""
    everything = fit(rows, counts)
    tps, memory, predictions = {}, {}, {}
    for row in rows:
        others = [r for r in rows if r.name != row.name]
        c = fit(others, counts) if row.exact else everything
        tokens, reserved = predicted(row, counts[row.name], c)
        predictions[row.name] = (tokens, reserved)
        tps[row.name] = tokens / row.tokens_per_s - 1
        if row.memory_gib is not None:
            memory[row.name] = reserved / row.memory_gib - 1
    return Check(rows, everything, tps, memory, predictions)
