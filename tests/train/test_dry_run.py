"""The dry-run planner: real torchtitan parallelize_fn on a meta model under a fake process
group. Everything here runs on the meta device, so even the 70B plans take seconds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from train.__main__ import prepare_runtime
from train.config import RunConfig, from_dict, load_config
from train.dry_run import GPUS, plan, run_dry

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.toml"))

# The world size each shipped config is meant for: its plan must fit an H100 there.
WORLD_SIZES = {"base": 2, "debug": 2, "llama3_1b": 8, "llama3_8b_fp8": 8, "llama3_70b_fp8": 64}

LLAMA3_70B = {
    "dim": 8192,
    "n_layers": 80,
    "n_heads": 64,
    "n_kv_heads": 8,
    "vocab_size": 128256,
    "ffn_hidden_dim": 28672,
}


@pytest.fixture(autouse=True, scope="module")
def _runtime():
    prepare_runtime()  # what `python -m train --dry-run` does before planning


def _run(**sections) -> RunConfig:
    raw = {"dataloader": {"mix": [{"path": "unused"}]}, "validation": {"enable": False}}
    for name, values in sections.items():
        raw[name] = values
    return from_dict(raw, "test")


def _printed(capsys) -> str:
    return capsys.readouterr().out


def _params(out: str) -> int:
    return int(re.search(r"^parameters: ([\d,]+)", out, re.M).group(1).replace(",", ""))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_dry_runs(path, capsys):
    assert path.stem in WORLD_SIZES, f"{path.name}: add the world size it is meant for"
    run = load_config(path)
    world_size = WORLD_SIZES[path.stem]
    code = run_dry(run, world_size, "h100")
    out = _printed(capsys)
    assert code == 0, out
    assert f"world size {world_size}" in out
    assert _params(out) > 0
    assert re.search(r"^  total\s+[\d.]+ GiB$", out, re.M)
    if run.fp8.enable:
        assert not re.search(r" 0 Float8Linear", out)


def _llama3_70b_run(**parallelism) -> RunConfig:
    return _run(
        model=LLAMA3_70B,
        fp8={"enable": True},
        training={"seq_len": 8192, "local_batch_size": 1},
        activation_checkpoint={"mode": "full"},
        parallelism=parallelism,
    )


def test_70b_has_70_6b_parameters_and_fits_64_h100s(capsys):
    run = load_config(REPO / "configs" / "llama3_70b_fp8.toml")
    assert run_dry(run, 64, "h100") == 0
    out = _printed(capsys)
    assert _params(out) == pytest.approx(70.6e9, rel=0.005)
    assert "FITS" in out and "DOES NOT FIT" not in out
    # 80 blocks x (wq, wk, wv, wo, w1, w2, w3) really became torchao Float8Linear
    assert "560 Float8Linear" in out


def test_fit_verdict_flips_with_world_size_and_gpu(capsys):
    run = _llama3_70b_run(tp=8)
    # 8 GPUs hold 70.6B params x 16 bytes (fp32 weights, grads, 2 Adam states) / 8 = 131 GiB
    assert run_dry(run, 8, "h100") == 1
    assert "DOES NOT FIT" in _printed(capsys)
    # ... a B200's 180 GB holds them, and so do 16 H100s (66 GiB each)
    assert run_dry(run, 8, "b200") == 0
    assert run_dry(run, 16, "h100") == 0
    assert "FITS NVIDIA H100" in _printed(capsys)


def test_more_gpus_means_less_memory_per_gpu(capsys):
    run = _run(parallelism={"tp": 1})

    def total_gib(world_size: int) -> float:
        run_dry(run, world_size, "cpu")
        out = _printed(capsys)
        return float(re.search(r"^  parameters.*?([\d.]+) GiB$", out, re.M).group(1))

    assert total_gib(4) < total_gib(1)


def test_activation_checkpointing_lowers_the_activation_estimate(capsys):
    def activations(mode: str) -> float:
        run = _llama3_70b_run(tp=8)
        run.activation_checkpoint.mode = mode
        run_dry(run, 64, "h100")
        out = _printed(capsys)
        return float(re.search(r"activations, AC=\w+ \(est\.\)\s+([\d.]+) GiB", out).group(1))

    assert activations("full") < activations("selective") < activations("none")


def test_a_launch_rule_stops_the_plan_before_torch_builds_anything():
    # the rules themselves are train.config.check_launch's (tests/train/test_config.py)
    cp = _run(training={"seq_len": 2050}, parallelism={"cp": 2})
    with pytest.raises(ValueError, match=r"2 \* parallelism\.cp=2"):
        run_dry(cp, 8, "h100")
    with pytest.raises(ValueError, match="--world-size must be at least 1"):
        run_dry(_run(), 0, "h100")


def test_the_plan_resolves_auto_for_the_target_gpu_not_this_machine():
    # FSDP's unsharded compute copies are bf16 on a GPU and fp32 on CPU (param_dtype=auto):
    # the largest unit's buffers cost 2 x 2 + 4 bytes per parameter there, 2 x 4 + 4 here
    run = _run()
    on_h100, on_cpu = plan(run, 2, "h100"), plan(run, 2, "cpu")
    assert on_h100.memory.fsdp_buffers * 12 == on_cpu.memory.fsdp_buffers * 8
    assert on_h100.spmd_backend == "partial_dtensor"


def test_unknown_gpu_is_rejected():
    with pytest.raises(ValueError, match="--gpu 'v100'"):
        run_dry(_run(), 1, "v100")
    assert {"h100", "h200", "a100", "b200", "cpu"} <= set(GPUS)
