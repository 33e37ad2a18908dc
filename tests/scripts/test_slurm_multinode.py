"""scripts/slurm/ on a real two-node SLURM cluster: each node a network namespace with its
own hostname and address (tests/scripts/conftest.py, `slurm_cluster_2node`).

One process per node, so every collective and the c10d rendezvous cross the namespaces
(node1 serves the rendezvous at `node1:PORT`, the name `scontrol show hostnames` gives).
The fault test puts the recoveries a long run needs into one job: the two preemptions
SLURM delivers (USR1 to the batch shell, as `--signal=B:USR1@N` does before the time
limit; then SIGTERM to the job's steps, as a preemption by SLURM does) and a hang (SIGSTOP
of the rank on node2, named by the watchdog of the rank on node1). Each requeues the
2-node job; if any batch were skipped or repeated across a requeue, or the model/optimizer
state were not restored, the surviving per-step losses and token counts would differ from
the uninterrupted 2-node run's.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest

from tests.utils.runs import LAUNCHER_SIZED, read_metrics, run_config, write_config
from tests.utils.slurm import (
    job_logs,
    last_record_per_step,
    restart_events,
    submit,
    training_pids,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.e2e]

NUM_STEPS = 12
HANG_TIMEOUT_S = 15  # > a step + a checkpoint save on 2 busy cores


def submit_2node(cluster, config: Path, *args: str) -> str:
    return submit(cluster, config, *args, nodes=2, nproc_per_node=1)


def wait_for(predicate, timeout: float, run_dir: Path, what: str) -> float:
    """Poll `predicate`; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what}\n{job_logs(run_dir)}"
        time.sleep(0.2)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def completed_2node_run(slurm_cluster_2node, shakespeare_data, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("slurm2_full")
    run_dir = tmp / "run"
    config = write_config(
        tmp / "run.toml",
        run_config(shakespeare_data, run_dir, LAUNCHER_SIZED, training={"steps": NUM_STEPS}),
    )
    job_id = submit_2node(slurm_cluster_2node, config, "--fresh")
    state = slurm_cluster_2node.wait_job(job_id, timeout=300)
    assert state["JobState"] == "COMPLETED", (
        f"{state}\n{job_logs(run_dir)}\n{slurm_cluster_2node.logs()}"
    )
    return run_dir


def test_two_node_job_trains_across_namespaces(completed_2node_run):
    """A job submitted as the README submits one trains to completion (the README's
    `submit.py` command, tests/test_readme.py) with one process per node."""
    run_dir = completed_2node_run
    assert [r["step"] for r in read_metrics(run_dir, "train")] == list(range(1, NUM_STEPS + 1))
    assert (run_dir / "checkpoint" / f"step-{NUM_STEPS}" / ".metadata").exists()
    # a normal finish is logged and not requeued
    assert restart_events(run_dir) == ["0:start", "0:finished"]
    start = (run_dir / "slurm" / "restarts.log").read_text().splitlines()[0]
    assert "nodes=2" in start and "host=node1" in start and "rdzv=node1:" in start, start
    # one torchrun per node, each on its own host, in one world of 2
    for node, host in ((0, "node1"), (1, "node2")):
        (log,) = (run_dir / "slurm").glob(f"job*-attempt0-node{node}.log")
        text = log.read_text()
        assert f"[torchrun_node] {host}: node {node} of 2, 1 process(es)" in text, text[-2000:]
    assert (
        "Training finished" in next((run_dir / "slurm").glob("job*-attempt0-node0.log")).read_text()
    )


def test_two_node_job_survives_preemption_and_a_stopped_rank(
    slurm_cluster_2node, shakespeare_data, completed_2node_run, tmp_path
):
    cluster = slurm_cluster_2node
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "run.toml",
        run_config(
            shakespeare_data,
            run_dir,
            LAUNCHER_SIZED,
            training={"steps": NUM_STEPS},
            fault_tolerance={"hang_timeout_s": HANG_TIMEOUT_S},
        ),
    )
    job_id = submit_2node(cluster, config, "--fresh")

    def steps_done() -> int:
        return max((r["step"] for r in read_metrics(run_dir, "train")), default=0)

    def preempted_steps() -> list[int]:
        # (from restarts.log: the resumed attempt deletes RUN/preempted.json as it starts)
        return [
            json.loads(line.split("event=preempted", 1)[1])["step"]
            for line in (run_dir / "slurm" / "restarts.log").read_text().splitlines()
            if "event=preempted" in line
        ]

    # 1. what SLURM's --signal=B:USR1@N does before the time limit: USR1 to the batch shell
    # on node1 only, which must forward it to both nodes
    wait_for(lambda: steps_done() >= 2, 240, run_dir, "no step 2")
    cluster.run("scancel", "--batch", "--signal=USR1", job_id)
    wait_for(lambda: "1:start" in restart_events(run_dir), 180, run_dir, "no requeue")
    # 2. SIGTERM to the job's steps, on both nodes: each node's torchrun gets it too and
    # must not kill its worker before the workers have checkpointed
    first_preempted = preempted_steps()[0]
    wait_for(lambda: steps_done() >= first_preempted + 1, 240, run_dir, "no resumed step")
    cluster.run("scancel", "--signal=TERM", job_id)
    wait_for(lambda: "2:start" in restart_events(run_dir), 180, run_dir, "no second requeue")
    preempted_step = preempted_steps()[1]

    # 3. a hang: SIGSTOP the rank on node2 once the resumed run has trained two steps
    wait_for(lambda: steps_done() >= preempted_step + 2, 240, run_dir, "no resumed steps")
    workers = training_pids(config)
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[1], signal.SIGSTOP)
    stopped_after_step = steps_done()
    hang_json = run_dir / "hang" / "hang.json"
    detected_s = wait_for(hang_json.exists, HANG_TIMEOUT_S + 60, run_dir, "no hang detected")
    requeued_s = detected_s + wait_for(
        lambda: "3:start" in restart_events(run_dir), 180, run_dir, "no requeue after the hang"
    )
    state = cluster.wait_job(job_id, timeout=300)
    print(
        f"2-node hang: detected {detected_s:.1f} s, requeued attempt started {requeued_s:.1f} s "
        f"after SIGSTOP (hang_timeout_s={HANG_TIMEOUT_S})"
    )
    assert state["JobState"] == "COMPLETED", f"{state}\n{job_logs(run_dir)}"
    assert state["Restarts"] == "3"
    assert restart_events(run_dir) == [
        "0:start",
        "0:signal",
        "0:preempted",
        "0:requeue",
        "1:start",
        "1:preempted",
        "1:requeue",
        "2:start",
        "2:crash",
        "2:requeue",
        "3:start",
        "3:finished",
    ]
    preempted_lines = [
        line
        for line in (run_dir / "slurm" / "restarts.log").read_text().splitlines()
        if "event=preempted" in line
    ]
    assert '"signal": "SIGUSR1"' in preempted_lines[0]
    assert '"signal": "SIGTERM"' in preempted_lines[1]

    # the rank on node2 is named, by host and pid, with the step it stopped in
    hang = json.loads(hang_json.read_text())
    assert hang["culprit_ranks"] == [1] and hang["detected_by"] == 0, hang
    assert f"rank 1 (node2 pid {workers[1]}) stopped responding" in hang["reason"], hang
    assert stopped_after_step <= hang["step"] <= stopped_after_step + 2, hang
    assert HANG_TIMEOUT_S <= detected_s < HANG_TIMEOUT_S + 30
    (dump,) = (run_dir / "hang").glob("*-rank0.txt")
    assert "rank 0 (node1 pid" in dump.read_text()
    node0_log = next((run_dir / "slurm").glob("job*-attempt2-node0.log")).read_text()
    assert [line for line in node0_log.splitlines() if line.startswith("error: hang: rank 1 ")]

    # exactly once across the three recoveries
    interrupted = last_record_per_step(read_metrics(run_dir, "train"))
    reference = read_metrics(completed_2node_run, "train")
    assert [r["step"] for r in interrupted] == list(range(1, NUM_STEPS + 1))
    for got, want in zip(interrupted, reference, strict=True):
        assert got["tokens_seen"] == want["tokens_seen"], (got, want)
        assert math.isclose(got["loss"], want["loss"], rel_tol=1e-4), (got["step"], got, want)
