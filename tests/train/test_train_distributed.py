"""Real training runs under torchrun on CPU (gloo): FSDP2 + FP8, resume on fewer ranks with
the same global batch. (kill -9 and the restart past a torn save are the chaos run's:
tests/train/ledger/test_ledger_chaos.py; a preemption signal to one of 2 ranks, during a
save, through the launcher a user runs: tests/scripts/test_launchers.py.)

All runs use the debug model shrunk by overrides (seq 128, batch 2) so a step takes well
under a second; most of each test's time is torchrun/torchtitan start-up (~10 s a launch).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.utils.runs import (
    check_ok,
    complete_steps,
    read_metrics,
    run_config,
    torchrun,
    train_losses,
    write_config,
)

pytestmark = pytest.mark.slow

# FSDP over 2 ranks vs 1 rank with 2 accumulation micro-steps sums the same per-token
# losses in a different order (and float8 scales are per tensor/row of the same data):
# agreement to ~1e-5 was measured; 1e-3 relative leaves room for other CPUs' kernels.
RESUME_RTOL = 1e-3


@pytest.fixture(scope="module")
def fsdp_run(shakespeare_data, tmp_path_factory):
    """One 2-rank FSDP2 + FP8 run: 8 steps, checkpoints at 4 and 8, validation at 1, 4, 8,
    FP8 telemetry at 3 and 6 (a zero underflow threshold: its warning fires)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    config = run_config(
        shakespeare_data,
        tmp / "run",
        training={"global_batch_size": 4},
        fp8={"stats_freq": 3, "stats_underflow_warn": 0.0},
    )
    path = write_config(tmp / "fsdp.toml", config)
    proc = torchrun(path, 2)
    check_ok(proc)
    return path, tmp / "run", proc.stdout + proc.stderr


def test_fsdp_fp8_two_ranks_trains_checkpoints_and_logs(fsdp_run):
    config, run_dir, output = fsdp_run
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1] - 0.5, losses  # it learns
    assert complete_steps(run_dir) == [4, 8]
    assert "FP8: 28 linears converted, real float8 GEMMs (torch._scaled_mm)" in output
    assert "kept in high precision: lm_head" in output

    records = read_metrics(run_dir)
    train_record = next(r for r in records if r["step"] == 2 and "loss" in r)
    for key in (
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu",
        "data_wait_s",
        "data_wait_frac",
        "memory_gib",
    ):
        assert key in train_record, key
    assert train_record["tokens_per_s"] > 0 and 0 <= train_record["data_wait_frac"] < 1
    val_steps = [r["step"] for r in records if "val_loss" in r]
    assert val_steps == [1, 4, 8]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "loss_metrics/global_avg_loss",
        "grad_norm",
        "throughput(tps)",
        "validation_metrics/loss",
    } <= tags
    assert any(t.startswith("lr/") for t in tags) and "mfu(%)" in tags
    tb_losses = {e.step: e.value for e in events.Scalars("loss_metrics/global_avg_loss")}
    assert tb_losses == pytest.approx(losses, rel=1e-6)
    _check_fp8_telemetry(run_dir, output, records, events)

    # the resolved config is written and loads back to the same run
    from train.config import load_config

    assert load_config(run_dir / "config.toml") == load_config(config)


def _check_fp8_telemetry(run_dir: Path, output: str, records: list[dict], events) -> None:
    """fp8.stats_freq = 3: the per-type summary in metrics.jsonl and TensorBoard and the
    per-linear detail in RUN/fp8_stats.jsonl at steps 3 and 6 only, values in range, and the
    warning naming the worst linear (train/components/fp8_stats.py)."""
    from train.components.fp8_stats import worst_linears

    key = "fp8/feed_forward.w2/grad_output_underflow"
    assert sorted({r["step"] for r in records if key in r}) == [3, 6]
    assert [e.step for e in events.Scalars(key)] == [3, 6]
    assert [e.step for e in events.Scalars("fp8/attention.wo/gemm_rel_err")] == [3, 6]
    detail = [json.loads(line) for line in (run_dir / "fp8_stats.jsonl").read_text().splitlines()]
    assert [d["step"] for d in detail] == [3, 6]
    for record in detail:
        assert len(record["linears"]) == 28
        for name, linear in record["linears"].items():
            assert set(linear) == {"input", "weight", "grad_output", "gemm_rel_err"}, name
            assert 0 < linear["gemm_rel_err"] < 0.5, name  # float8 rounding, not garbage
            for operand in ("input", "weight", "grad_output"):
                stats = linear[operand]
                assert stats["amax"] > 0 and stats["scale"] > 0, (name, operand)
                assert 0 <= stats["underflow"] <= 1 and 0 <= stats["saturation"] <= 1
                # rowwise: the largest row's power-of-2 scale keeps it within e4m3's range
                assert stats["amax"] * stats["scale"] <= 448, (name, operand)
    share, name, op, _ = worst_linears(detail[:1], "underflow")[0]
    assert share > 0 and f"FP8 underflow at step 3: {name} {op} {share:.3%}" in output


def test_resume_on_one_rank_with_same_global_batch_matches_uninterrupted(fsdp_run, tmp_path):
    config, run_dir, _ = fsdp_run
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoint" / "step-4", resumed / "checkpoint" / "step-4")
    proc = torchrun(config, 1, "--job.folder", str(resumed), "--training.global_batch_size", "4")
    check_ok(proc)
    output = proc.stdout + proc.stderr
    assert "gradient accumulation steps 2" in output
    assert "Loading the checkpoint from" in output and "step-4" in output
    reference, losses = train_losses(run_dir), train_losses(resumed)
    assert sorted(losses) == [5, 6, 7, 8]  # continued at step 5: step and LR schedule restored
    for step in losses:
        assert losses[step] == pytest.approx(reference[step], rel=RESUME_RTOL), step
    # the data continued rather than restarted: restarting would replay step 1's batches
    first = {r["step"]: r for r in read_metrics(resumed) if "loss" in r}
    assert first[5]["tokens_seen"] == pytest.approx(5 * 4 * 128)
    # the FP8 telemetry of step 6 ran here over 2 accumulation micro-steps, on step 6 only
    assert (
        "fp8/attention.wo/input_amax" in first[6] and "fp8/attention.wo/input_amax" not in first[5]
    )
