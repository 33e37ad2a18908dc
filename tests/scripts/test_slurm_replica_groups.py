"""torchft replica groups under SLURM, on a local four-node cluster (tests/utils/slurm.py):
`submit.py --replica-groups 2 --nodes 4` asks for one allocation that survives a lost node
(--no-kill); the batch host runs the Lighthouse and the supervisor, each group is one
`srun` step over two nodes of its own, its two torchrun agents meeting at a rendezvous of
the group's own (`--nnodes 2`; one rank a node, FSDP across the nodes). The group on node3
and node4 loses its processes (kill -9 of its torchruns and workers, as nodes that go away
take them): the job goes on, the other group waiting in its quorum while the lost group's
step is started again, heals from its peer and rejoins; the job completes, and the ledger
verifies every step across the quorum changes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.utils.runs import (
    LAUNCHER_SIZED,
    ledger_verify,
    replica_ledger,
    run_config,
    write_config,
)
from tests.utils.slurm import job_logs, start_two_node_cluster, submit

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.e2e]

STEPS = 10  # the loss at step 3, then the replacement heals and trains with group 0 to the end


def _group_processes(config: Path, group: int) -> list[int]:
    """The torchrun agent and workers of replica group `group` (any node: the namespaces
    share this machine's process table)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(config).encode() in cmdline and f"TRAIN_REPLICA_GROUP={group}".encode() in environ:
            if b"srun" not in cmdline.split(b"\0")[0]:
                pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def slurm_cluster_4node(tmp_path_factory):
    cluster = start_two_node_cluster(tmp_path_factory.mktemp("slurm4"), num_nodes=4)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_lost_groups_node_does_not_stop_the_job(slurm_cluster_4node, shakespeare_data, tmp_path):
    cluster = slurm_cluster_4node
    run = tmp_path / "run"
    config = write_config(
        tmp_path / "run.toml",
        run_config(
            shakespeare_data,
            run,
            LAUNCHER_SIZED,
            training={"steps": STEPS, "global_batch_size": 4, "local_batch_size": 1},
            health={"inject_faults": ["sleep rank=0 seconds=0.5"]},
            # two groups, a majority of two: both start together at step 1 (with one enough,
            # group 0 may train steps alone before group 1's slower start joins), and after
            # the loss group 0's quorum waits for group 1's replacement; training on alone is
            # the gloo test's (tests/train/replica_groups/test_replica_groups.py)
            replica_groups={"timeout_s": 30, "quorum_timeout_s": 120},
        ),
    )
    job = submit(
        cluster, config, "--fresh", launcher=("--replica-groups", "2"), nodes=4, nproc_per_node=1
    )
    deadline = time.monotonic() + 300
    while not any(r["step"] >= 3 for r in replica_ledger(run, 1) if r["kind"] == "step"):
        assert time.monotonic() < deadline, job_logs(run) + cluster.logs()
        time.sleep(0.3)
    pids = _group_processes(config, 1)
    assert pids, job_logs(run)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    state = cluster.wait_job(job, timeout=600)
    assert state["JobState"] == "COMPLETED", f"{state}\n{job_logs(run)}\n{cluster.logs()}"

    group0 = [r for r in replica_ledger(run, 0) if r["kind"] == "step"]
    assert [r["step"] for r in group0] == list(range(1, STEPS + 1))
    assert group0[-1]["quorum"]["groups"] == [0, 1], "group 1 rejoined"
    causes = [r["cause"] for r in replica_ledger(run, 1) if r["kind"] == "segment"]
    assert causes[0] == "start" and set(causes[1:]) == {"heal"}, causes
    batch_log = "".join(path.read_text() for path in (run / "slurm").glob("job*-batch.log"))
    assert batch_log.count("group 1 on node3,node4") == 2, batch_log  # started, restarted
    verify = ledger_verify(run)
    assert verify.returncode == 0, verify.stdout + verify.stderr
