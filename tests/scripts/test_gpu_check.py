"""The GPU check (scripts/gpu_check), rehearsed on CPU so it still works on the next
short lease of a GPU machine: `prepare` makes the inputs the device call carries, `run --rehearse` runs every
part at tiny shapes and reports each, a failing part is recorded and the next one runs,
and a part past its cap is killed with its trainer and recorded as timed out."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from tests.utils.runs import REPO, train_env

CHECK = [sys.executable, str(REPO / "scripts" / "gpu_check")]
sys.path.insert(0, str(REPO / "scripts" / "gpu_check"))
import scaling  # noqa: E402

LOSSES = ("full_logits", "chunked")


def _check(*args, timeout=900, **env):
    return subprocess.run(
        [*CHECK, *args], cwd=REPO, env={**train_env(), **env}, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def inputs(shakespeare_data, tmp_path_factory):
    """`prepare --no-wheels` on the session's prepared data (it reuses prepared data), the
    plans of the first layer group (70B, bf16, full AC) only."""
    folder = tmp_path_factory.mktemp("gpu_check_inputs")
    shutil.copytree(shakespeare_data, folder / "data")
    proc = _check("prepare", "--no-wheels", "--plan-combos", "1", "--inputs", str(folder))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return folder


def test_prepare_plans_the_layers_runs_for_both_gpus(inputs):
    plan = json.loads((inputs / "plan.json").read_text())
    assert plan["world_size"] == 1
    for loss in LOSSES:
        layers = plan["layers"][loss]
        assert sorted(layers) == [f"70B/bf16/full/{n}" for n in (1, 2, 4, 80)]
        for gpu in ("h100", "h200"):
            # 3B parameters with Adam at 1 layer; each layer adds 0.86B (14 GiB with Adam)
            one, two, four, eighty = (layers[f"70B/bf16/full/{n}"][gpu] for n in (1, 2, 4, 80))
            assert 45 < one["reserved_gib"] < 80
            assert 10 < two["reserved_gib"] - one["reserved_gib"] < 25
            # past the traced 3 layers, the planner's own linear extension
            per_layer = (four["allocated_gib"] - two["allocated_gib"]) / 2
            assert eighty["allocated_gib"] - four["allocated_gib"] == pytest.approx(76 * per_layer)
            assert 0 < eighty["tokens_per_s_per_gpu"] < four["tokens_per_s_per_gpu"]
    # each loss planned as such (at the 70B width the optimizer step holds the memory
    # peak either way, and the chunked loss's time differs)
    for gpu in ("h100", "h200"):
        full, chunked = (plan["layers"][loss]["70B/bf16/full/1"][gpu] for loss in LOSSES)
        assert full["step_s"] != chunked["step_s"]
    h100, h200 = (
        plan["layers"]["chunked"]["70B/bf16/full/80"][g]["step_s"] for g in ("h100", "h200")
    )
    assert h200 < h100
    kernels = sorted(p.name for p in (inputs / "vllm_kernels").iterdir())
    assert kernels == sorted(
        [
            "triton_attention_helpers.py",
            "triton_reshape_and_cache_flash.py",
            "triton_unified_attention.py",
        ]
    )
    assert (inputs / "commit").read_text().strip()


@pytest.mark.slow
def test_rehearsal_runs_every_part_and_reports_it(inputs, tmp_path):
    out = tmp_path / "out"
    every = "env,replica,tp_shapes,layers,parity,flex,gemm,trainer,vllm"
    proc = _check(
        "run", "--rehearse", "--parts", every, "--inputs", str(inputs), "--out", str(out)
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    parts = report["parts"]
    assert list(parts) == every.split(",")
    failed = {name: r.get("error", r) for name, r in parts.items() if not r["ok"]}
    assert not failed, failed
    assert report["rehearsal"] and sum(report["caps_s"].values()) > 0
    # what each part measured, checked for sense (a rehearsal makes no timing claims)
    replica = parts["replica"]  # gloo here: what the trainer picks without an accelerator
    assert replica["process_group"] == "gloo" and replica["committed_steps"] == [1, 2, 3]
    assert replica["ledger_verify"]["rc"] == 0 and replica["torchft_error"] is None
    assert {row["model"] for row in parts["gemm"]["rows"]} == {"8B", "70B"}
    assert all(row["fp8_rowwise_rel_err"] < 0.1 for row in parts["gemm"]["rows"])
    tables = parts["flex"]["block_tables"]
    assert tables["partial_mismatches"] == tables["full_mismatches"] == 0
    assert tables["full_blocks"] > 0 and tables["empty_blocks"] > 0
    assert parts["flex"]["out_rel_err"] < 1e-4
    long = parts["flex"]["long"]["block_tables"]  # the 32K check's code, at 1,024 tokens
    assert long["partial_mismatches"] == long["full_mismatches"] == 0 and long["full_blocks"] > 0
    rows = parts["tp_shapes"]["rows"]
    assert [r["layout"] for r in rows] == ["70B TP 8"] * 5 + ["8B FSDP"] * 4
    assert all(r["bf16_rel_err"] < 1e-2 and r["rowwise_rel_err"] < 0.1 for r in rows)
    assert all(r["tensorwise_rel_err"] < 0.1 for r in rows)
    layers = parts["layers"]
    assert [run["rc"] for run in layers["runs"].values()] == [0] * 4
    fits = layers["fits"]
    assert sorted(fits) == ["70B/bf16/full", "70B/tensorwise/full"]
    assert fits["70B/tensorwise/full"]["depths"] == [1, 2]
    assert "per_layer_speedup_over_bf16" in fits["70B/tensorwise/full"]
    parity = parts["parity"]
    curves = parity["curves"]
    assert [len(c) for c in curves.values()] == [parity["steps"]] * 3
    # the same seed: the same model and data at step 1 (FP8 rounds the forward only);
    # another seed: another model
    assert abs(curves["fp8_tensorwise"][0] - curves["bf16"][0]) < 0.05
    assert abs(curves["bf16_seed43"][0] - curves["bf16"][0]) > 0.1
    assert parity["tolerance"] == 2 * parity["seed_gap"]
    trainer = parts["trainer"]
    assert trainer["resumed"]["max_abs_loss_diff"] == 0.0  # CPU: bitwise repeatable
    assert trainer["ledger_verify"]["rc"] == 0
    assert parts["vllm"]["float32_rel_err"] < 2e-5
    md = (out / "report.md").read_text()
    for title in ("a. Environment", "b. FP8 GEMMs", "c. Layer by layer", "f. vLLM", "g. FP8 lin",
                  "h. FP8 against bf16", "i. One replica group"):  # fmt: skip
        assert title in md
    assert sorted(p.name for p in out.iterdir()) == ["check.log", "report.json", "report.md"]
    # fit for the repo: the machine's paths are named, not spelled
    log = (out / "check.log").read_text()
    assert "$WORK/layers/" in log and "$REPO/" in log
    for text in (log, (out / "report.json").read_text(), md):
        assert str(REPO) not in text and "/tmp/gpu_check_" not in text


def test_a_failing_part_is_recorded_and_the_next_one_runs(tmp_path):
    """No inputs at all: the trainer part fails (our trainer's one-line error about the
    missing tokenizer), env still runs after it, and the report is written."""
    out = tmp_path / "out"
    proc = _check(
        "run", "--rehearse", "--parts", "trainer,env", "--inputs", str(tmp_path / "none"),
        "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = json.loads((out / "report.json").read_text())["parts"]
    assert not parts["trainer"]["ok"] and "tokenizer" in json.dumps(parts["trainer"])
    assert parts["env"]["ok"] and parts["env"]["torch"]
    assert "**Failed:**" not in (out / "report.md").read_text().split("## a. Environment")[1]


def test_a_part_past_its_cap_is_killed_with_its_trainer(inputs, tmp_path):
    """The parity part's cap scaled to a few seconds: the part and the trainers it started
    (process groups of their own) are gone when the check returns; the report names the
    GPU though the env part did not run."""
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    t0 = time.monotonic()
    proc = _check(
        "run", "--rehearse", "--parts", "parity", "--caps-scale", "0.02", "--inputs", str(inputs),
        "--out", str(out), GPU_CHECK_WORK=str(work),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 60
    report = json.loads((out / "report.json").read_text())
    parity = report["parts"]["parity"]
    assert not parity["ok"]
    assert "timeout" in json.dumps(parity) or "timed out" in json.dumps(parity)
    assert report["gpu"] == "no GPU" and "GPU check" in (out / "report.md").read_text()
    assert any(work.rglob("*.toml")), "the trainer never started"
    leftover = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


def test_the_layers_fit_takes_the_slope_per_layer_and_the_intercept_as_fixed():
    """Two depths on a line: the slope and intercept exactly, full depth extrapolated and
    set beside the plan's prediction for it, the per-layer FP8/bf16 ratio from slopes."""
    runs = {
        f"70B/{recipe}/full/{n}": {"step_time_s": fixed + per * n, "peak_memory_gib": 40 + 10 * n}
        for recipe, fixed, per in (("bf16", 0.1, 0.06), ("tensorwise", 0.1, 0.04))
        for n in (1, 2)
    }
    runs["70B/rowwise/full/1"] = {"step_time_s": 0.2}  # one depth: no fit
    plans = {"70B/tensorwise/full/80": {"tokens_per_s_per_gpu": 8192 / 6.4}}
    fits = scaling.fit_layers(runs, plans, seq_len=8192)
    assert sorted(fits) == ["70B/bf16/full", "70B/tensorwise/full"]
    fp8 = fits["70B/tensorwise/full"]
    assert fp8["per_layer_s"] == pytest.approx(0.04) and fp8["fixed_s"] == pytest.approx(0.1)
    assert fp8["extrapolated_step_s"] == pytest.approx(80 * 0.04 + 0.1)
    assert fp8["per_layer_gib"] == pytest.approx(10) and fp8["fixed_gib"] == pytest.approx(40)
    assert fp8["extrapolated_over_predicted_tokens_per_s"] == pytest.approx(6.4 / 3.3)
    assert fp8["per_layer_speedup_over_bf16"] == pytest.approx(1.5)
    assert "predicted" not in fits["70B/bf16/full"]
