"""The GPU check (scripts/gpu_check), rehearsed on CPU so it still works when a session
draws a GPU: `prepare` makes the inputs the device call carries, `run --rehearse` runs every
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


def _check(*args, timeout=900, **env):
    return subprocess.run(
        [*CHECK, *args], cwd=REPO, env={**train_env(), **env}, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def inputs(shakespeare_data, tmp_path_factory):
    """`prepare --no-wheels` on the session's prepared data (it reuses prepared data)."""
    folder = tmp_path_factory.mktemp("gpu_check_inputs")
    shutil.copytree(shakespeare_data, folder / "data")
    proc = _check("prepare", "--no-wheels", "--inputs", str(folder))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return folder


def test_prepare_plans_both_step_variants_for_both_gpus(inputs):
    plan = json.loads((inputs / "plan.json").read_text())
    assert plan["world_size"] == 1
    for gpu in ("h100", "h200"):
        for loss in ("chunked", "full_logits"):
            fp8, bf16 = plan[loss]["fp8_tensorwise"][gpu], plan[loss]["bf16"][gpu]
            assert 0 < bf16["tokens_per_s_per_gpu"] < fp8["tokens_per_s_per_gpu"]
            assert 10 < fp8["reserved_gib"] < 80  # 1.5B parameters with Adam on one GPU
        # the whole fp32 logits and their gradient: GiBs the chunked loss never holds
        full, chunked = plan["full_logits"]["bf16"][gpu], plan["chunked"]["bf16"][gpu]
        assert full["reserved_gib"] > chunked["reserved_gib"] + 2
    h100, h200 = (plan["chunked"]["bf16"][g]["tokens_per_s_per_gpu"] for g in ("h100", "h200"))
    assert h200 > h100
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
    proc = _check("run", "--rehearse", "--inputs", str(inputs), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    parts = report["parts"]
    assert list(parts) == ["env", "gemm", "flex", "step", "trainer", "vllm"]
    failed = {name: r.get("error", r) for name, r in parts.items() if not r["ok"]}
    assert not failed, failed
    assert report["rehearsal"] and sum(report["caps_s"].values()) > 0
    # what each part measured, checked for sense (a rehearsal makes no timing claims)
    assert {row["model"] for row in parts["gemm"]["rows"]} == {"8B", "70B"}
    assert all(row["fp8_rowwise_rel_err"] < 0.1 for row in parts["gemm"]["rows"])
    tables = parts["flex"]["block_tables"]
    assert tables["partial_mismatches"] == tables["full_mismatches"] == 0
    assert tables["full_blocks"] > 0 and tables["empty_blocks"] > 0
    assert parts["flex"]["out_rel_err"] < 1e-4
    for variant in ("fp8_tensorwise", "bf16"):
        assert parts["step"]["variants"][variant]["rc"] == 0
    trainer = parts["trainer"]
    assert trainer["resumed"]["max_abs_loss_diff"] == 0.0  # CPU: bitwise repeatable
    assert trainer["ledger_verify"]["rc"] == 0
    assert parts["vllm"]["float32_rel_err"] < 2e-5
    md = (out / "report.md").read_text()
    for title in ("a. Environment", "b. FP8 GEMMs", "c. A training step", "f. vLLM"):
        assert title in md
    assert sorted(p.name for p in out.iterdir()) == ["check.log", "report.json", "report.md"]


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
    """The step part's cap scaled to a few seconds: the part and the trainer it started
    (a process group of its own) are gone when the check returns."""
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    t0 = time.monotonic()
    proc = _check(
        "run", "--rehearse", "--parts", "step", "--caps-scale", "0.02", "--inputs", str(inputs),
        "--out", str(out), GPU_CHECK_WORK=str(work),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 60
    step = json.loads((out / "report.json").read_text())["parts"]["step"]
    assert not step["ok"]
    assert "timeout" in json.dumps(step) or "timed out" in json.dumps(step)
    assert any(work.rglob("*.toml")), "the trainer never started"
    leftover = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""
