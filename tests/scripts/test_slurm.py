"""scripts/slurm/ on a real one-node SLURM cluster started on localhost (tests/scripts/conftest.py).

Each test submits `train.sbatch` through `submit.py` exactly as a user would (CPU nodes:
no GPUs, two gloo processes per node) and watches the job with `scontrol show job`.
The preemption test compares the interrupted run with the uninterrupted one step by
step: if any batch were skipped or repeated across the requeue, or the model/optimizer
state were not restored, the per-step losses and token counts would differ.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest

from tests.utils.runs import LAUNCHER_SIZED, REPO, read_metrics, run_config, write_config
from tests.utils.slurm import (
    job_logs,
    restart_events,
    submit,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.e2e]

NUM_STEPS = 12


@pytest.fixture(scope="module")
def completed_run(slurm_cluster, shakespeare_data, tmp_path_factory) -> Path:
    """An uninterrupted SLURM run of NUM_STEPS steps (also the preemption test's reference)."""
    tmp = tmp_path_factory.mktemp("slurm_full")
    run_dir = tmp / "run"
    config = write_config(
        tmp / "run.toml",
        run_config(shakespeare_data, run_dir, LAUNCHER_SIZED, training={"steps": NUM_STEPS}),
    )
    job_id = submit(slurm_cluster, config, "--fresh")
    state = slurm_cluster.wait_job(job_id, timeout=240)
    assert state["JobState"] == "COMPLETED", f"{state}\n{job_logs(run_dir)}\n{slurm_cluster.logs()}"
    return run_dir


def test_sbatch_job_trains_to_completion(completed_run):
    run_dir = completed_run
    assert [r["step"] for r in read_metrics(run_dir, "train")] == list(range(1, NUM_STEPS + 1))
    assert (run_dir / "checkpoint" / f"step-{NUM_STEPS}" / ".metadata").exists()
    # a normal finish is logged and not requeued
    assert restart_events(run_dir) == ["0:start", "0:finished"]
    node_logs = list((run_dir / "slurm").glob("job*-attempt0-node0.log"))
    assert len(node_logs) == 1 and "Training finished" in node_logs[0].read_text()


def test_preempted_job_checkpoints_requeues_and_finishes_exactly_once(
    slurm_cluster, shakespeare_data, completed_run, tmp_path
):
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "run.toml",
        run_config(shakespeare_data, run_dir, LAUNCHER_SIZED, training={"steps": NUM_STEPS}),
    )
    # --fresh on a requeue would refuse the existing checkpoint: the script must drop it
    job_id = submit(slurm_cluster, config, "--fresh")

    def wait_for_steps(num_steps: int) -> None:
        deadline = time.monotonic() + 180
        while len(read_metrics(run_dir, "train")) < num_steps:
            assert time.monotonic() < deadline, job_logs(run_dir)
            assert slurm_cluster.job_state(job_id)["JobState"] in ("PENDING", "RUNNING")
            time.sleep(0.3)

    # 1. what SLURM's --signal=B:USR1@N does before the time limit: USR1 to the batch
    # shell only, which must forward it to the workers
    wait_for_steps(2)  # mid-run: past startup, well before the end
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job_id)
    deadline = time.monotonic() + 120
    while "1:start" not in restart_events(run_dir):  # the requeued attempt began
        assert time.monotonic() < deadline, job_logs(run_dir)
        time.sleep(0.3)
    wait_for_steps(len(read_metrics(run_dir, "train")) + 1)  # ... resumed and trained a step
    # 2. SIGTERM to the job's steps: torchrun gets it too and must not kill its workers
    # before they have checkpointed
    slurm_cluster.run("scancel", "--signal=TERM", job_id)

    state = slurm_cluster.wait_job(job_id, timeout=300)
    assert state["JobState"] == "COMPLETED", f"{state}\n{job_logs(run_dir)}"
    assert state["Restarts"] == "2"
    assert restart_events(run_dir) == [
        "0:start",
        "0:signal",
        "0:preempted",
        "0:requeue",
        "1:start",
        "1:preempted",
        "1:requeue",
        "2:start",
        "2:finished",
    ]
    preempted_lines = [
        line
        for line in (run_dir / "slurm" / "restarts.log").read_text().splitlines()
        if "event=preempted" in line
    ]
    assert '"signal": "SIGUSR1"' in preempted_lines[0]
    assert '"signal": "SIGTERM"' in preempted_lines[1]

    interrupted = read_metrics(run_dir, "train")
    reference = read_metrics(completed_run, "train")
    assert [r["step"] for r in interrupted] == list(range(1, NUM_STEPS + 1)), (
        "a step ran twice or never"
    )
    for got, want in zip(interrupted, reference, strict=True):
        assert got["tokens_seen"] == want["tokens_seen"], (got, want)
        assert math.isclose(got["loss"], want["loss"], rel_tol=1e-4), (got["step"], got, want)


def test_crashing_job_stops_requeueing_after_max_crashes(slurm_cluster, shakespeare_data, tmp_path):
    run_dir = tmp_path / "run"
    # passes every check before torchrun (submit.py and the batch script's preflight), fails
    # in the workers at every attempt: the run folder holds a checkpoint of another model
    shutil.copytree(
        REPO / "tests" / "assets" / "ckpt_compat" / "run" / "checkpoint",
        run_dir / "checkpoint",
    )
    config = write_config(
        tmp_path / "run.toml", run_config(shakespeare_data, run_dir, LAUNCHER_SIZED)
    )
    job_id = submit(slurm_cluster, config, launcher=("--max-crashes", "2"))
    state = slurm_cluster.wait_job(job_id, timeout=240)
    assert state["JobState"] == "FAILED", f"{state}\n{job_logs(run_dir)}"
    assert state["Restarts"] == "1"
    assert restart_events(run_dir) == [
        "0:start",
        "0:crash",
        "0:requeue",
        "1:start",
        "1:crash",
        "1:gave-up",
    ]
    batch_log = next((run_dir / "slurm").glob("job*-batch.log")).read_text()
    assert "error: giving up: 2 crashes within 3600s (TRAIN_MAX_CRASHES=2)" in batch_log
    # the cause is in each attempt's node log
    for attempt in (0, 1):
        node_log = next((run_dir / "slurm").glob(f"job*-attempt{attempt}-node0.log")).read_text()
        assert "was made by a different model shape" in node_log
        assert "Traceback" not in node_log  # the one line, without torchrun's report


def test_scancel_ends_the_job_without_a_requeue(slurm_cluster, shakespeare_data, tmp_path):
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "run.toml",
        run_config(shakespeare_data, run_dir, LAUNCHER_SIZED, training={"steps": 200}),
    )
    job_id = submit(slurm_cluster, config)
    deadline = time.monotonic() + 180
    while len(read_metrics(run_dir, "train")) < 2:
        assert time.monotonic() < deadline, job_logs(run_dir)
        time.sleep(0.3)
    slurm_cluster.run("scancel", job_id)

    state = slurm_cluster.wait_job(job_id, timeout=120)
    assert state["JobState"] == "CANCELLED", f"{state}\n{job_logs(run_dir)}"
    assert state["Restarts"] == "0"
    assert restart_events(run_dir) == ["0:start", "0:signal", "0:ended"], job_logs(run_dir)
    # the workers still used their SIGTERM to checkpoint: a later submit resumes there
    step = json.loads((run_dir / "preempted.json").read_text())["step"]
    assert (run_dir / "checkpoint" / f"step-{step}" / ".metadata").exists()
