"""The dry-run planner: one training step of the real torchtitan model, parallelized by its
real parallelize_fn on a fake process group of the real world size, measured by torch's
MemTracker on fake tensors.

Every shipped config is planned at every world size its header or docs advertise, once per
session (`shipped_plans`, shared by the tests below); the tracker is checked against a real
2-rank gloo step, and the layer extension against tracing every layer."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from tests.utils.distributed import run_distributed_test
from train.config import RunConfig, from_dict, load_config
from train.dry_run import GIB, GPUS, StepCounts, measure, plan, run_dry, traced_config
from train.runtime import prepare_runtime

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.toml"))

# The world sizes each shipped config advertises (its header, docs/training.md, the README).
WORLD_SIZES = {
    "base": [2],
    "debug": [2],
    "llama3_1b": [8],
    "llama3_8b_fp8": [8, 64],
    "llama3_70b_fp8": [32, 64, 128],
    "llama3_8b_long_context": [64],  # CP 8 x FSDP 8 at its longest phase (128K)
}
# Where the plan must fit an H100. 70B at 32 and 64 GPUs: see docs/dry_run.md (its
# checkpoint-save peak decides).
MUST_FIT = {
    ("base", 2),
    ("debug", 2),
    ("llama3_1b", 8),
    ("llama3_8b_fp8", 8),
    ("llama3_8b_fp8", 64),
    ("llama3_70b_fp8", 32),  # Q/K/V unfused: no gathered state-dict cache (issue 18)
    ("llama3_70b_fp8", 64),
    ("llama3_70b_fp8", 128),
    ("llama3_8b_long_context", 64),
}


@pytest.fixture(autouse=True, scope="module")
def _runtime():
    prepare_runtime()  # what `python -m train --dry-run` does before planning


@pytest.fixture(scope="module")
def shipped_plans(_runtime):
    """{(config stem, world size): DryRunReport} for every advertised pair, planned once."""
    return {
        (path.stem, world_size): plan(load_config(path), world_size, "h100")
        for path in CONFIGS
        for world_size in WORLD_SIZES.get(path.stem, [])
    }


def _run(**sections) -> RunConfig:
    raw = {"dataloader": {"mix": [{"path": "unused"}]}, "validation": {"enable": False}}
    raw.update(sections)
    return from_dict(raw, "test")


def _tiny(**sections) -> RunConfig:
    """A 4-layer model with the 8B config's flags (FP8 tensorwise + FP8 all-gather,
    selective AC), head_dim 16, dims multiples of 16 so every block linear is FP8."""
    model = {
        "dim": 64,
        "n_layers": 4,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_hidden_dim": 128,
        "vocab_size": 512,
        "max_seq_len": 64,
    }
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


@pytest.mark.slow
def test_every_shipped_config_is_planned_at_every_advertised_world_size(shipped_plans):
    assert {p.stem for p in CONFIGS} == set(WORLD_SIZES), "add the world sizes a config advertises"
    for (name, world_size), report in shipped_plans.items():
        out = report.format()
        assert f"world size {world_size}" in out
        assert report.counts.flops > 0 and report.memory.activations > 0, out
        if load_config(REPO / "configs" / f"{name}.toml").fp8.enable:
            assert report.counts.num_float8_linears > 0, out
        if (name, world_size) in MUST_FIT:
            assert report.fits, out
        # FSDP shards: at least one all-gather and one reduce-scatter of weights per step
        if report.degrees["dp_shard"] > 1:
            assert any(k.startswith("FSDP all-gather") for k in report.counts.comm), out
            assert any(k.startswith("FSDP reduce-scatter") for k in report.counts.comm), out


@pytest.mark.slow
def test_70b_plan_counts_70_6b_parameters_and_reports_its_save_peak(shipped_plans):
    at_32, at_64, at_128 = (shipped_plans["llama3_70b_fp8", n] for n in (32, 64, 128))
    assert at_32.num_params == pytest.approx(70.6e9, rel=0.005)
    # 80 blocks x (wq, wk, wv, wo, w1, w2, w3) are torchao Float8Linear
    assert at_32.counts.num_float8_linears == 560
    assert "traced at 2 and 3 layers, extended linearly to 80" in at_32.format()
    out = at_32.format()
    save = float(re.search(r"checkpoint-save peak\s+([\d.]+) GiB", out).group(1))
    assert save * GIB == pytest.approx(at_32.save_peak, abs=0.01 * GIB)
    assert at_32.save_peak > at_32.memory.parameters + at_32.memory.optimizer
    # more GPUs, less state per GPU (FSDP shards over world size / 8)
    assert at_32.memory.optimizer > at_64.memory.optimizer > at_128.memory.optimizer


@pytest.mark.slow
def test_long_context_plan_counts_the_context_parallel_k_v_exchange(shipped_plans):
    """CP 8 at 128K: each layer all-gathers the whole sequence's K and V (bf16, 8 KV heads
    of 128) in the forward and again in full AC's recompute, and reduce-scatters their
    gradients once in the backward."""
    report = shipped_plans["llama3_8b_long_context", 64]
    k_and_v = 2 * 131072 * 8 * 128 * 2  # bytes per layer
    assert report.counts.comm["CP all-gather (K, V) bfloat16"] == 32 * 2 * k_and_v
    assert report.counts.comm["CP reduce-scatter (dK, dV) bfloat16"] == 32 * k_and_v
    assert "context parallel: K/V all-gather" in report.format()


@pytest.mark.slow
def test_tensor_parallel_traffic_is_visible_and_fp8_halves_the_fsdp_all_gather():
    # the 70B layout, scaled: FSDP 2 x TP 2 with sequence parallelism
    layout = {"tp": 2, "enable_sequence_parallel": True}
    fp8 = plan(_tiny(parallelism=layout), 4, "h100").counts.comm
    bf16 = plan(
        _tiny(parallelism=layout, fp8={"fsdp_float8_all_gather": False}), 4, "h100"
    ).counts.comm
    # TP/SP collectives run in bf16 (DTensor redistributions; issue 18 item 7)
    assert fp8.get("DTensor all-gather bfloat16", 0) > 0
    assert fp8.get("DTensor reduce-scatter bfloat16", 0) > 0
    # Float8Linear weights travel as float8 (uint8 buffers), at half their bf16 bytes
    gathered_fp8 = fp8["FSDP all-gather uint8"]
    assert "FSDP all-gather uint8" not in bf16
    saved_bf16 = bf16["FSDP all-gather bfloat16"] - fp8["FSDP all-gather bfloat16"]
    assert 2 * gathered_fp8 == pytest.approx(saved_bf16, rel=0.01)  # + scales, padding


@pytest.mark.slow
def test_extending_from_three_traced_layers_equals_tracing_every_layer():
    for mode in ("none", "full", "selective"):
        run = traced_config(_tiny(activation_checkpoint={"mode": mode}, model={"n_layers": 5}))
        extended = measure(run, 2, accelerator=True, traced_layers=3)
        traced = measure(run, 2, accelerator=True, traced_layers=5)
        assert extended.layers == traced.layers == 5
        if mode != "selective":
            assert extended == traced, mode
            continue
        # Selective AC does not save the same tensors in every block (measured here: the
        # 5-layer forward/backward peak is 2.6% above the extension); all else is exact.
        peak = extended.peak_forward_backward
        assert peak == pytest.approx(traced.peak_forward_backward, rel=0.05)
        assert dataclasses.replace(extended, peak_forward_backward=0) == dataclasses.replace(
            traced, peak_forward_backward=0
        )


def _real_step_rank(rank: int, world_size: int, run: RunConfig, out: Path) -> None:
    from train.dry_run import trace_step

    prepare_runtime()
    counts = trace_step(run, world_size, accelerator=False, fake=False)
    if rank == 0:
        out.write_text(json.dumps(dataclasses.asdict(counts)))


@pytest.mark.slow
def test_the_plan_matches_a_real_two_rank_step(tmp_path):
    """Tracker vs reality: the same step on real tensors over 2 gloo ranks (CPU: fp32
    params, SDPA) against the fake-tensor plan for the same target ("cpu")."""
    run = traced_config(_tiny(fp8={"recipe": "rowwise", "fsdp_float8_all_gather": False}))
    planned = measure(run, 2, accelerator=False, traced_layers=4)
    run_distributed_test(_real_step_rank, 2, run, tmp_path / "real.json", backend="gloo")
    real = StepCounts(**json.loads((tmp_path / "real.json").read_text()))
    assert (planned.parameters, planned.gradients, planned.optimizer) == (
        real.parameters,
        real.gradients,
        real.optimizer,
    )
    assert planned.state_dict_cache == real.state_dict_cache
    assert planned.flops == real.flops
    assert planned.comm == real.comm
    activations = planned.peak_forward_backward - planned.parameters - planned.gradients
    real_activations = real.peak_forward_backward - real.parameters - real.gradients
    assert activations == pytest.approx(real_activations, rel=0.25)


def test_the_plan_resolves_auto_for_the_target_gpu_not_this_machine():
    # FSDP's unsharded compute copies are bf16 on a GPU and fp32 on CPU (param_dtype=auto)
    run = _tiny(fp8={"enable": False})
    on_h100, on_cpu = plan(run, 2, "h100"), plan(run, 2, "cpu")
    assert (
        on_h100.counts.comm["FSDP all-gather bfloat16"] * 2
        == (on_cpu.counts.comm["FSDP all-gather float32"])
    )
    assert on_h100.spmd_backend == "partial_dtensor"


@pytest.mark.slow
def test_the_verdict_is_the_peak_against_the_usable_memory(shipped_plans):
    report = shipped_plans["llama3_70b_fp8", 32]
    small = dataclasses.replace(GPUS["h100"], memory_gib=report.peak / GIB * 0.95)
    big = dataclasses.replace(GPUS["h100"], memory_gib=report.peak / GIB / 0.85)
    assert not dataclasses.replace(report, gpu=small).fits
    assert dataclasses.replace(report, gpu=big).fits
    assert "DOES NOT FIT" in dataclasses.replace(report, gpu=small).format()


def test_a_launch_rule_stops_the_plan_before_torch_builds_anything():
    # the rules themselves are train.launch_rules.check_launch's (tests/train/test_config.py)
    cp = _run(training={"seq_len": 2050}, parallelism={"cp": 2})
    with pytest.raises(ValueError, match=r"128-token mask blocks x parallelism\.cp=2"):
        run_dry(cp, 8, "h100")
    with pytest.raises(ValueError, match="--world-size must be at least 1"):
        run_dry(_run(), 0, "h100")


def test_unknown_gpu_is_rejected():
    with pytest.raises(ValueError, match="--gpu 'v100'"):
        run_dry(_run(), 1, "v100")
    assert {"h100", "h200", "a100", "b200", "cpu"} <= set(GPUS)
