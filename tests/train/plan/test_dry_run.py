"""The dry-run planner: the launch's own trainer, built by its constructor on torchtitan's
fake comm backend at the real world size, one step measured on fake tensors, and timed.

Every shipped config is planned at every world size its header or docs advertise, once per
module (`shipped_plans`, shared by the tests below, planned beside the layer extension's
traces in one pool of workers: `traced`); the tracker is checked against a real 2-rank gloo
step, the layer extension against tracing every layer, the counts against the kernel's
formulas, and the time model on counts made by hand (no trace needed)."""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path

import pytest

from tests.utils.distributed import run_distributed_test
from tests.utils.side_by_side import side_by_side
from tests.utils.tiny_model import TINY_TRAIN_MODEL_4_HEADS
from train.config import RunConfig, from_dict, load_config
from train.plan.dry_run import GIB, GPUS, StepCounts, measure, plan, run_dry, traced_config
from train.plan.gpu_specs import GpuSpec
from train.plan.network import NETWORKS, SCALE_UP_LATENCY_S, collective_terms
from train.plan.step_counts import OpCounts, attention_flops
from train.plan.time_model import COMPILE_S, Layout, TimeConstants, gemm_rates, predict
from train.runtime import prepare_runtime

REPO = Path(__file__).resolve().parents[3]
CONFIGS = sorted((REPO / "configs").glob("*.toml"))

# The world sizes each shipped config advertises (its header, docs/training.md, the README).
WORLD_SIZES = {
    "base": [2],
    "debug": [2],
    "llama3_1b": [8],
    "llama3_8b_fp8": [8, 64],
    "llama3_70b_fp8": [64, 128, 256],  # at 32: full AC, local batch 4 (its header)
    "llama3_8b_long_context": [64],  # CP 8 x FSDP 8 at its longest phase (128K)
}
# Where the plan must fit an H100 (docs/dry_run.md).
MUST_FIT = {
    ("base", 2),
    ("debug", 2),
    ("llama3_1b", 8),
    ("llama3_8b_fp8", 8),
    ("llama3_8b_fp8", 64),
    ("llama3_70b_fp8", 64),  # Q/K/V unfused: no gathered state-dict cache (issue 18)
    ("llama3_70b_fp8", 128),
    ("llama3_70b_fp8", 256),
    ("llama3_8b_long_context", 64),
}


@pytest.fixture(autouse=True, scope="module")
def _runtime():
    prepare_runtime()  # what `python -m train --dry-run` does before planning


# The layer extension's check: each AC mode's 5-layer model, extended from 3 traced layers
# and traced whole (`test_extending_from_three_traced_layers_equals_tracing_every_layer`).
EXTENDED_MODES = ("none", "full", "selective")


@pytest.fixture(scope="module")
def traced(_runtime):
    """({(config stem, world size): DryRunReport} for every advertised pair, [(extended,
    traced whole) StepCounts per mode of `EXTENDED_MODES`]), each planned or measured once,
    side by side on the machine's cores: one pool of workers for both (each worker's start
    imports torch and torchtitan)."""
    pairs = [(path, ws) for path in CONFIGS for ws in WORLD_SIZES.get(path.stem, [])]
    runs = [
        traced_config(_tiny(activation_checkpoint={"mode": m}, model={"n_layers": 5}))
        for m in EXTENDED_MODES
    ]
    calls = [(plan, (load_config(path), ws, "h100"), {"phases": False}) for path, ws in pairs]
    calls += [
        (measure, (run, 2), {"accelerator": True, "traced_layers": n})
        for run in runs
        for n in (3, 5)
    ]
    results = side_by_side(calls)
    reports, counts = results[: len(pairs)], results[len(pairs) :]
    shipped = {(path.stem, ws): r for (path, ws), r in zip(pairs, reports, strict=True)}
    return shipped, list(zip(counts[::2], counts[1::2], strict=True))


@pytest.fixture(scope="module")
def shipped_plans(traced):
    """{(config stem, world size): DryRunReport} for every advertised pair (`traced`)."""
    return traced[0]


HEADER_PLAN = re.compile(
    r"--world-size (\d+) --gpu h100\):\s+([\d,]+) tokens/s/GPU, ([\d.]+) GiB peak reserved"
)


def _header_plan(name: str, world_size: int) -> tuple[float, float]:
    """(tokens/s/GPU, GiB) a shipped config's header states for `world_size` H100s."""
    text = (REPO / "configs" / f"{name}.toml").read_text()
    for ranks, tokens, reserved in HEADER_PLAN.findall(" ".join(text.split("\n# "))):
        if int(ranks) == world_size:
            return float(tokens.replace(",", "")), float(reserved)
    raise AssertionError(
        f"configs/{name}.toml: no header line '# plan (python -m train --config "
        f"configs/{name}.toml --dry-run --world-size {world_size} --gpu h100): N tokens/s/GPU, "
        "G GiB peak reserved'"
    )


def _run(**sections) -> RunConfig:
    raw = {"dataloader": {"mix": [{"path": "unused"}]}, "validation": {"enable": False}}
    raw.update(sections)
    return from_dict(raw, "test")


def _tiny(**sections) -> RunConfig:
    """A 3-layer model (traced whole, once) with the 8B config's flags (FP8 tensorwise + FP8 all-gather,
    selective AC), head_dim 16, dims multiples of 16 so every block linear is FP8."""
    model = TINY_TRAIN_MODEL_4_HEADS | {"n_layers": 3, "vocab_size": 512, "max_seq_len": 64}
    base = {
        "model": model,
        "fp8": {
            "enable": True,
            "recipe": "tensorwise",
            "filter_fqns": ["lm_head"],
            "fsdp_float8_all_gather": True,
        },
        "training": {"seq_len": 64, "local_batch_size": 2, "global_batch_size": 4},
        "activation_checkpoint": {"mode": "selective"},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return _run(**base)


# --------------------------------------------------------------------------- shipped configs


@pytest.mark.slow
def test_every_shipped_config_is_planned_at_every_advertised_world_size(shipped_plans):
    assert {p.stem for p in CONFIGS} == set(WORLD_SIZES), "add the world sizes a config advertises"
    for (name, world_size), report in shipped_plans.items():
        out = report.format()
        assert f"world size {world_size}" in out
        assert report.counts.micro.flops and report.memory.activations > 0, out
        if load_config(REPO / "configs" / f"{name}.toml").fp8.enable:
            assert report.counts.num_float8_linears > 0, out
        if (name, world_size) in MUST_FIT:
            assert report.fits, out
        # FSDP shards: at least one all-gather and one reduce-scatter of weights per step
        if report.degrees["dp_shard"] > 1:
            assert any(k.startswith("fsdp all-gather") for k in report.counts.step.comm), out
            assert any(k.startswith("fsdp reduce-scatter") for k in report.counts.step.comm), out
        # Q/K/V unfused: the checkpointer's cached state dict views the parameters
        assert report.memory.state_dict_cache == 0 == report.counts.state_dict_refresh, out
        p = report.prediction
        assert p is not None and 0 < p.mfu < 1 and p.step_s > 0, out
        assert p.tokens_per_s_per_gpu * p.step_s * world_size == pytest.approx(
            report.global_batch_size * report.seq_len
        )
        # no positive time or memory prints as 0 (the debug model's are below 0.01 s and GiB)
        for label in ("  step ", "training-step peak", ": reserved peak"):
            line = next(line for line in out.splitlines() if label in line)
            assert float(re.search(r"([\d.e+-]+) (s|GiB)", line.split(label)[1])[1]) > 0, line
        # the config's header states what this plan predicts (re-plan and edit it if not)
        tokens, reserved = _header_plan(name, world_size)
        assert tokens == pytest.approx(p.tokens_per_s_per_gpu, rel=0.03), (name, world_size)
        assert reserved == pytest.approx(report.peak / GIB, rel=0.03, abs=0.01), (name, world_size)


@pytest.mark.parametrize(
    ("figure", "places", "printed"),
    [(0.0, 2, "0.00"), (36.1, 2, "36.10"), (0.0041, 2, "0.0041"), (5.2e-06, 2, "5.2e-06"),
     (0.04, 1, "0.04"), (169.33, 1, "169.3")],
)  # fmt: skip
def test_the_plan_never_prints_a_positive_figure_as_zero(figure, places, printed):
    from train.plan.report import _f

    assert _f(figure, places) == printed


@pytest.mark.slow
def test_70b_plan_counts_70_6b_parameters_and_reports_its_save_peak(shipped_plans):
    at_64, at_128, at_256 = (shipped_plans["llama3_70b_fp8", n] for n in (64, 128, 256))
    assert at_64.counts.num_params == pytest.approx(70.6e9, rel=0.005)
    # 80 blocks x (wq, wk, wv, wo, w1, w2, w3) are torchao Float8Linear
    assert at_64.counts.num_float8_linears == 560
    out = at_64.format()
    assert "traced at 2 and 3 layers, extended linearly to 80" in out
    save = float(re.search(r"checkpoint-save peak\s+([\d.]+) GiB", out).group(1))
    assert save * GIB == pytest.approx(at_64.save_peak, abs=0.01 * GIB)
    assert at_64.save_peak > at_64.memory.parameters + at_64.memory.optimizer
    # more GPUs, less state per GPU (FSDP shards over world size / 8)
    assert at_64.memory.optimizer > at_128.memory.optimizer > at_256.memory.optimizer
    # global batch 128, local 2: 8 micro-batches per step at 64 GPUs (FSDP 8), 2 at 256
    assert (at_64.counts.accumulation, at_256.counts.accumulation) == (8, 2)
    assert "8 micro-batch(es)" in out
    # TP 8 stays inside a node, FSDP crosses nodes
    assert (
        "tp all-gather bfloat16 [NVLink]" in out and "fsdp reduce-scatter float32 [network]" in out
    )


@pytest.mark.slow
def test_long_context_plan_counts_the_context_parallel_k_v_exchange(shipped_plans):
    """CP 8 at 128K: each layer all-gathers the whole sequence's K and V (bf16, 8 KV heads
    of 128) in the forward and again in full AC's recompute, and reduce-scatters their
    gradients once in the backward; per micro-batch, and 8 micro-batches per step
    (global batch 64 over a batch degree of 8: torchtitan leaves CP out of it)."""
    report = shipped_plans["llama3_8b_long_context", 64]
    k_and_v = 2 * 131072 * 8 * 128 * 2  # bytes per layer
    micro, step = report.counts.micro, report.counts.step
    assert micro.comm["cp all-gather (K, V) bfloat16"] == 32 * 2 * k_and_v
    assert micro.comm["cp reduce-scatter (K, V) bfloat16"] == 32 * k_and_v
    assert report.counts.accumulation == 8
    # per step = per micro-batch x accumulation (+ what runs once: no CP traffic there)
    for key in ("cp all-gather (K, V) bfloat16", "cp reduce-scatter (K, V) bfloat16"):
        assert step.comm[key] == 8 * micro.comm[key]
    assert step.comm["cp all-gather (K, V) bfloat16"] == 256 * GIB
    assert "context parallel: K/V all-gather" in report.format()


@pytest.mark.slow
def test_the_verdict_reads_the_memory_range_tight_at_the_margin(shipped_plans):
    """FITS when the upper end of the reserved peak's held-out range fits the usable
    memory, TIGHT (with the margin) when only the point does, DOES NOT FIT when the point
    does not; a TIGHT plan still exits 0, a plan that does not fit 1."""
    from train.plan.report import OUTSIDE_ALLOCATOR_FRACTION
    from train.plan.time_model import HELD_OUT_MEMORY

    report = shipped_plans["llama3_70b_fp8", 64]
    assert report.peak > report.memory.total  # reserved: allocated + the allocator's share
    low, high = report.peak_range
    assert low < report.peak < high == pytest.approx(report.peak / (1 - HELD_OUT_MEMORY))

    def on_card(reserved_bytes: float):
        gib = reserved_bytes / GIB / (1 - OUTSIDE_ALLOCATOR_FRACTION)
        return dataclasses.replace(report, gpu=dataclasses.replace(GPUS["h100"], memory_gib=gib))

    at_margin = on_card((report.peak + high) / 2)  # the point fits, the upper end does not
    assert at_margin.verdict == "TIGHT" and not at_margin.fits and at_margin.runs
    assert re.search(r"^TIGHT .* upper end is [\d.]+ GiB over$", at_margin.format(), re.M)
    assert on_card(high * 1.001).verdict == "FITS" and on_card(high * 1.001).fits
    short = on_card(report.peak * 0.999)
    assert short.verdict == "DOES NOT FIT" and not short.runs
    assert "DOES NOT FIT" in short.format()


@pytest.mark.slow
def test_the_shipped_8b_and_70b_configs_plan_on_amd_gpus(shipped_plans):
    """`python -m train --dry-run --gpu mi300x` (and MI325X, MI355X) plans the shipped 8B
    and 70B configs: the same traced step, timed on AMD's peaks over its network, FP8 in
    its format."""
    for name, world_size in (("llama3_8b_fp8", 8), ("llama3_70b_fp8", 64)):
        on_h100 = shipped_plans[name, world_size]
        run = load_config(REPO / "configs" / f"{name}.toml")
        for gpu in ("mi300x", "mi325x", "mi355x"):
            report = plan(run, world_size, gpu, phases=False, counts=on_h100.counts)
            out = report.format()
            assert report.fits and report.prediction.tokens_per_s_per_gpu > 0, out
            assert "Infinity Fabric" in out or report.degrees["tp"] == 1, out
            assert ("float8_e4m3fnuz" in out) == (gpu != "mi355x"), out
        assert report.prediction.tokens_per_s_per_gpu > on_h100.prediction.tokens_per_s_per_gpu


# --------------------------------------------------------------------------- the counts


def test_a_one_layer_plan_at_seq_4096_counts_attention_as_the_causal_kernel_does():
    """FlexAttention / FlashAttention compute the blocks on and below the diagonal: 32 x 33
    / 2 of the 32 x 32 blocks of 128 tokens at 4096, forward (QK^T, PV) and backward (5
    GEMMs: S recomputed, dP, dV, dQ, dK)."""
    run = _tiny(
        model={"n_layers": 1, "max_seq_len": 4096},
        training={"seq_len": 4096, "local_batch_size": 1, "global_batch_size": 2},
        activation_checkpoint={"mode": "none"},
    )
    report = plan(run, 2, "h100")
    b, h, d, s = 1, 4, 16, 4096
    dense_forward = 2 * 2 * b * h * d * s * s
    causal_forward = dense_forward * 33 // 64
    assert report.counts.micro.flops["attention"] == causal_forward * 7 // 2
    assert attention_flops(b, h, s, s, d) == causal_forward
    assert attention_flops(b, h, s, s, d, backward=True) == causal_forward * 5 // 2
    # context parallelism: a rank's queries against the gathered keys, 1/cp of the blocks
    assert attention_flops(b, h, s // 4, s, d) == causal_forward // 4
    assert "TFLOP attention" in report.format()


def test_per_step_counts_are_micro_batch_counts_times_the_accumulation_plus_the_optimizer():
    # global 8 over FSDP 2 x local 1: 4 micro-batches per step, torchtitan's count
    run = _tiny(training={"local_batch_size": 1, "global_batch_size": 8})
    report = plan(run, 2, "h100")
    c = report.counts
    assert c.accumulation == 4
    for table in ("flops", "memory_bytes", "comm", "comm_calls"):
        micro, once, step = (getattr(x, table) for x in (c.micro, c.once, c.step))
        assert step == {k: 4 * micro.get(k, 0) + once.get(k, 0) for k in {*micro, *once}}
    assert c.once.memory_bytes and not c.once.flops  # the optimizer: memory-bound only
    p = report.prediction
    assert p.step_s == pytest.approx(4 * p.micro_batch_s, rel=0.2)
    assert p.step_s > 4 * p.micro_batch_s
    assert "4 micro-batch(es)" in report.format()


def test_an_unfused_qkv_plan_shows_a_state_dict_cache_of_0_a_fused_one_its_gathered_qkv():
    """The checkpointer's cache counts only storage it allocates (storage identity): views
    of the parameters cost nothing, a state-dict hook's fresh tensors their bytes."""
    import torch

    from train.plan.trackers import fresh_bytes, storages

    report = plan(_tiny(), 2, "h100")
    assert report.memory.state_dict_cache == 0 == report.counts.state_dict_refresh
    assert re.search(r"checkpoint state-dict cache \(own storage\) +0.00 GiB", report.format())

    class Fused(torch.nn.Module):  # a fused wqkv whose hook splits it into new tensors
        def __init__(self):
            super().__init__()
            self.wqkv = torch.nn.Parameter(torch.zeros(12, 4))
            self._register_state_dict_hook(self._split)

        @staticmethod
        def _split(module, state_dict, prefix, local_metadata):
            fused = state_dict.pop(prefix + "wqkv")
            for name, part in zip("qkv", fused.chunk(3), strict=True):
                state_dict[prefix + f"w{name}"] = part.clone()

    for module, fresh in ((torch.nn.Linear(4, 12), 0), (Fused(), 12 * 4 * 4)):
        owned = {ref for p in module.parameters() for ref, _ in storages(p)}
        assert fresh_bytes(module.state_dict().values(), owned) == fresh


def test_tensor_parallel_traffic_is_visible_and_fp8_halves_the_fsdp_all_gather():
    # the 70B layout, scaled: FSDP 2 x TP 2 with sequence parallelism
    layout = {"tp": 2, "enable_sequence_parallel": True}
    fp8 = plan(_tiny(parallelism=layout), 4, "h100").counts.step.comm
    bf16 = plan(_tiny(parallelism=layout, fp8={"fsdp_float8_all_gather": False}), 4, "h100")
    bf16 = bf16.counts.step.comm
    # TP/SP collectives run in bf16 (DTensor redistributions; issue 18 item 7)
    assert fp8.get("tp all-gather bfloat16", 0) > 0
    assert fp8.get("tp reduce-scatter bfloat16", 0) > 0
    # Float8Linear weights travel as float8 (uint8 buffers), at half their bf16 bytes
    gathered_fp8 = fp8["fsdp all-gather uint8"]
    assert "fsdp all-gather uint8" not in bf16
    saved_bf16 = bf16["fsdp all-gather bfloat16"] - fp8["fsdp all-gather bfloat16"]
    assert 2 * gathered_fp8 == pytest.approx(saved_bf16, rel=0.01)  # + scales, padding


@pytest.mark.slow
def test_extending_from_three_traced_layers_equals_tracing_every_layer(traced):
    for mode, (extended, whole) in zip(EXTENDED_MODES, traced[1], strict=True):
        assert extended.layers == whole.layers == 5
        if mode != "selective":
            assert extended == whole, mode
            continue
        # Selective AC does not save the same tensors in every block (measured here: the
        # 5-layer forward/backward peak is 2.6% above the extension); all else is exact.
        peak = extended.peak_forward_backward
        assert peak == pytest.approx(whole.peak_forward_backward, rel=0.05)
        assert dataclasses.replace(extended, peak_forward_backward=0) == dataclasses.replace(
            whole, peak_forward_backward=0
        )


def _real_step_rank(rank: int, world_size: int, run: RunConfig, out: Path) -> None:
    from train.plan.trace import trace_step

    prepare_runtime()
    counts = trace_step(run, world_size, accelerator=False, fake=False)
    if rank == 0:
        out.write_bytes(pickle.dumps(counts))


@pytest.mark.slow
def test_the_plan_matches_a_real_two_rank_step(tmp_path):
    """Tracker vs reality: the same step on real tensors over 2 gloo ranks (CPU: fp32
    params, SDPA) against the fake-tensor plan for the same target ("cpu")."""
    run = traced_config(_tiny(fp8={"recipe": "rowwise", "fsdp_float8_all_gather": False}))
    planned = measure(run, 2, accelerator=False, traced_layers=3)
    run_distributed_test(_real_step_rank, 2, run, tmp_path / "real.pkl", backend="gloo")
    real = pickle.loads((tmp_path / "real.pkl").read_bytes())
    assert (planned.parameters, planned.gradients, planned.optimizer) == (
        real.parameters,
        real.gradients,
        real.optimizer,
    )
    assert planned.state_dict_cache == real.state_dict_cache == 0
    for phase in ("micro", "once"):
        fake_ops, real_ops = getattr(planned, phase), getattr(real, phase)
        assert (fake_ops.flops, fake_ops.comm, fake_ops.comm_calls) == (
            real_ops.flops,
            real_ops.comm,
            real_ops.comm_calls,
        )
        # gloo's reduce-scatter copies its output once more than the traced (NCCL) path:
        # at 2 ranks half its input, read and written
        gloo_copy = real_ops.comm.get("fsdp reduce-scatter float32", 0)
        assert (
            real_ops.memory_bytes["eager other"] - gloo_copy == fake_ops.memory_bytes["eager other"]
        ), phase
        for kind in ("eager fp8 casts", "compiled fp8 casts"):
            assert fake_ops.memory_bytes.get(kind) == real_ops.memory_bytes.get(kind), (phase, kind)
    assert planned.accumulation == real.accumulation == 1
    activations = planned.peak_forward_backward - planned.parameters - planned.gradients
    real_activations = real.peak_forward_backward - real.parameters - real.gradients
    assert activations == pytest.approx(real_activations, rel=0.25)


def test_the_plan_resolves_auto_for_the_target_gpu_not_this_machine():
    # FSDP's unsharded compute copies are bf16 on a GPU and fp32 on CPU (param_dtype=auto)
    run = _tiny(fp8={"enable": False})
    on_h100, on_cpu = plan(run, 2, "h100"), plan(run, 2, "cpu")
    assert (
        on_h100.counts.micro.comm["fsdp all-gather bfloat16"] * 2
        == on_cpu.counts.micro.comm["fsdp all-gather float32"]
    )
    assert on_h100.spmd_backend == "partial_dtensor"
    assert on_cpu.prediction is None  # no peaks to time a CPU step against


def test_a_schedule_is_planned_at_each_of_its_seq_lens():
    run = _tiny(
        model={"max_seq_len": 256},
        dataloader={"mix": [{"path": "unused"}], "schedule": [{"start_step": 5, "seq_len": 256}]},
    )
    report = plan(run, 1, "h100")  # one GPU: no collective latency hides the compute
    assert [p.seq_len for p in report.phases] == [64, 256]
    short, long = report.phases
    assert long.step_s > short.step_s and long.reserved_peak > short.reserved_peak
    assert dict(report.prediction.phases) == {64: short.step_s, 256: long.step_s}
    assert report.prediction.step_s == long.step_s
    assert "phase seq      64" in report.format()
    # the budgets read each phase's time (train/reliability/budgets.py): a window per seq_len
    from train.reliability.budgets import Budgets, PlannedTimes

    planned = PlannedTimes.from_prediction(report.prediction, run, 1, report.seq_len)
    assert planned.step_s == {64: short.step_s, 256: long.step_s}
    assert planned.micro_batch_s(256) == long.step_s / report.counts.accumulation
    lines = Budgets.of(run, planned).describe()
    assert any("watchdog window per micro-batch at seq 256" in line for line in lines)


def test_a_launch_rule_stops_the_plan_before_torch_builds_anything():
    # the rules themselves are train.launch_rules.check_launch's (tests/train/test_config.py)
    cp = _run(training={"seq_len": 2050}, parallelism={"cp": 2})
    with pytest.raises(ValueError, match=r"128-token mask blocks x parallelism\.cp=2"):
        run_dry(cp, 8, "h100")
    with pytest.raises(ValueError, match="the world size must be at least 1"):
        run_dry(_run(), 0, "h100")


def test_unknown_gpu_is_rejected():
    with pytest.raises(ValueError, match="--gpu 'v100'"):
        run_dry(_run(), 1, "v100")
    assert {"h100", "h100-96gb", "h200", "a100", "b200", "mi300x", "mi325x", "mi355x",
            "cpu"} <= set(GPUS)  # fmt: skip


# --------------------------------------------------------------------------- the time model

H100 = GPUS["h100"]


def _counts(micro: OpCounts, once: OpCounts | None = None, accumulation: int = 1, **groups):
    """StepCounts made by hand: what the time model reads (no trace)."""
    zero = {f.name: 0 for f in dataclasses.fields(StepCounts) if f.type == "int"}
    zero.pop("accumulation")
    zero.update(layers=1, num_fsdp_modules=10, num_flops_per_token=6 * 10**9)
    return StepCounts(
        **zero, accumulation=accumulation, groups=groups, micro=micro, once=once or OpCounts()
    )


def test_a_collective_gets_its_share_of_the_node_network():
    """Inside a node a ring runs over the scale-up link; across nodes over the node's NICs,
    at the group's share of the node (its ranks per node / GPUs per node): FSDP over every
    GPU of each node gets the whole node, one GPU a node (FSDP beside TP 8) one NIC's
    worth, one Ethernet port shared by all eight far less."""
    gib = 2**30
    ndr, ethernet = NETWORKS["ndr-ib"], NETWORKS["ethernet"]

    def seconds(ranks, kind="all-gather", nbytes=gib, calls=0, net=ndr):
        return sum(collective_terms(H100, net, ranks, kind, nbytes, calls))  # link efficiency 1

    inside = seconds(list(range(8)))
    assert inside == pytest.approx(7 / 8 * gib / H100.scale_up_bandwidth)
    whole_nodes = seconds(list(range(32)))  # 4 nodes x 8: the node's 8 NICs, 400 GB/s
    assert whole_nodes == pytest.approx(31 / 32 * gib / ndr.node_bandwidth)
    one_a_node = seconds(list(range(0, 32, 8)))  # rail 0 of 4 nodes: one 50 GB/s NIC
    assert one_a_node == pytest.approx(3 / 4 * gib / (ndr.node_bandwidth / 8))
    assert one_a_node > 5 * whole_nodes
    shared_port = seconds(list(range(32)), net=ethernet)
    assert shared_port == pytest.approx(
        31 / 32 * gib / (ethernet.node_bandwidth * ethernet.transport_share)
    )
    # an all-reduce moves twice an all-gather's bytes; a rank alone moves nothing
    assert seconds(list(range(8)), "all-reduce") == pytest.approx(2 * inside)
    assert seconds([0], calls=5) == 0
    # latency: a ring's steps, one per node over the network; small all-reduces take
    # NCCL's tree (2 log2 hops) where it is shorter than the ring's two passes
    ring = seconds(list(range(256)), nbytes=0, calls=1)
    assert ring == pytest.approx(32 * ndr.hop_latency_s + 224 * SCALE_UP_LATENCY_S)
    tree = seconds(list(range(256)), "all-reduce", nbytes=0, calls=1)
    assert tree == pytest.approx(2 * 5 * ndr.hop_latency_s + 2 * 3 * SCALE_UP_LATENCY_S)
    assert tree < 2 * ring


def test_the_network_preset_times_the_step_and_is_printed():
    """`--network` (or the GPU's default) picks the preset; the plan names it; an unknown
    one is refused in one line."""
    run = _tiny(training={"local_batch_size": 1, "global_batch_size": 16})
    on_ib = plan(run, 16, "h100", phases=False)
    on_ethernet = plan(run, 16, "h100", phases=False, network="ethernet", counts=on_ib.counts)
    assert "network ndr-ib: 8 x 400 Gb/s RDMA per node" in on_ib.format()
    assert "network ethernet: 1 x 100 Gb/s TCP per node" in on_ethernet.format()
    # a tiny model's collectives are mostly latency: TCP's 60 us hops against NDR's 5 us
    assert on_ethernet.prediction.comm_s > 4 * on_ib.prediction.comm_s
    assert on_ethernet.prediction.step_s > on_ib.prediction.step_s
    with pytest.raises(ValueError, match="--network 'infiniband' is not known"):
        plan(run, 16, "h100", network="infiniband", counts=on_ib.counts)


def test_fsdp_overlaps_compute_tp_is_exposed_unless_async_tp():
    c = TimeConstants()
    flops = {"gemm bfloat16": int(H100.bf16_flops * c.gemm_efficiency)}  # 1 s of GEMMs
    layout = Layout(world_size=16, global_batch_size=2, seq_len=8192, compile=True, async_tp=False)
    fsdp_ranks, tp_ranks = list(range(0, 16, 8)), list(range(8))
    small = predict(_counts(OpCounts(flops=flops, comm={"fsdp all-gather bfloat16": 10**9}),
                            fsdp=fsdp_ranks), layout, H100, c)  # fmt: skip
    assert small.breakdown["FSDP exposed"] < 0.01  # hidden behind 1 s of compute
    big = predict(_counts(OpCounts(flops=flops, comm={"fsdp all-gather bfloat16": 10**12}),
                          fsdp=fsdp_ranks), layout, H100, c)  # fmt: skip
    assert big.breakdown["FSDP exposed"] > 10  # 10 s of network traffic: exposed
    tp = _counts(OpCounts(flops=flops, comm={"tp all-gather bfloat16": 10**11}), tp=tp_ranks)
    vanilla = predict(tp, layout, H100, c)
    overlapped = predict(tp, dataclasses.replace(layout, async_tp=True), H100, c)
    assert vanilla.breakdown["TP exposed"] == pytest.approx(vanilla.comm_s)
    assert overlapped.breakdown["TP exposed"] == pytest.approx(
        (1 - c.async_tp_hidden) * vanilla.breakdown["TP exposed"]
    )
    assert vanilla.exposed_comm_share > overlapped.exposed_comm_share > 0


def test_a_prediction_gives_the_step_its_tokens_mfu_first_step_and_save():
    c = TimeConstants()
    flops = {"gemm float8": int(gemm_rates(H100, c)["tensorwise"] * 2)}  # 2 s
    counts = _counts(OpCounts(flops=flops), accumulation=4)
    layout = Layout(world_size=8, global_batch_size=32, seq_len=4096, compile=True, async_tp=False)
    p = predict(counts, layout, H100, c)
    assert p.step_s == pytest.approx(8.0) and p.accumulation == 4
    assert p.tokens_per_s_per_gpu == pytest.approx(32 * 4096 / 8 / 8.0)
    assert p.mfu == pytest.approx(6e9 * p.tokens_per_s_per_gpu / H100.bf16_flops)
    assert p.first_step_s == p.step_s + COMPILE_S
    eager = predict(counts, dataclasses.replace(layout, compile=False), H100, c)
    assert eager.first_step_s == eager.step_s
    assert p.checkpoint_bytes == p.save_s == 0  # predict_with_save adds them


def test_the_gpu_table_states_a_source_for_every_timed_row():
    for kind, spec in GPUS.items():
        assert isinstance(spec, GpuSpec) and spec.source
        if kind != "cpu":
            assert spec.timed and spec.peak_source and spec.fp8_flops >= spec.bf16_flops
            assert spec.default_network in NETWORKS and spec.scale_up_bandwidth > 0
    # CDNA 3 trains FP8 in the fnuz format (largest value 240); CDNA 4 as NVIDIA does
    amd = {k: s.fp8_format for k, s in GPUS.items() if s.vendor == "amd"}
    assert amd == {"mi300x": "float8_e4m3fnuz", "mi325x": "float8_e4m3fnuz",
                   "mi355x": "float8_e4m3fn"}  # fmt: skip
    for net in NETWORKS.values():
        assert net.source and net.node_bandwidth > 0 and 0 < net.transport_share <= 1


def test_the_save_is_planned_at_the_configured_storage_rate():
    """`[checkpoint] storage_gb_per_s` is the plan's storage: its save time, and so the
    budgets and SLURM's lead that read it (train/reliability/budgets.py)."""
    run = _tiny(checkpoint={"storage_gb_per_s": 0.25}, fault_tolerance={"min_save_gb_per_s": 0.2})
    report = plan(run, 2, "h100")
    p = report.prediction
    assert p.storage_gb_per_s == 0.25 and p.checkpoint_bytes > 0
    assert p.save_s == pytest.approx(p.checkpoint_bytes / 0.25e9)
    assert "GB at 0.25 GB/s storage" in report.format()
