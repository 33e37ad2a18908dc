"""scripts/slurm/ on a real one-node SLURM cluster started on localhost (tests/scripts/conftest.py).

Each test submits `train.sbatch` through `submit.py` exactly as a user would (CPU nodes:
no GPUs, two gloo processes per node) and watches the job with `scontrol show job`.
A job that trains to completion, and preemption (USR1 to the batch shell, SIGTERM to the
steps), requeue and an exactly-once finish, are proven once, on the two-node cluster
(test_slurm_multinode.py: its uninterrupted run, and its fault job that also stops a rank).
Here, with two processes on one node: the crash limit and `scancel`.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from tests.utils.runs import LAUNCHER_SIZED, REPO, read_metrics, run_config, write_config
from tests.utils.slurm import (
    job_logs,
    restart_events,
    submit,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.e2e]


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
