"""Replica groups' bad input and the run-folder lease, through the real entry points: one
`error: ...` line, exit 2, no traceback (`python -m train --check`, a group started by
hand, `scripts/train_local.sh --replica-groups`); and the lease admits the launcher's own
groups and no one else."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from common.run_lease import LeaseHeld, RunLease
from tests.utils.runs import REPO, cli, train_env


def _one_line(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.mark.parametrize(
    ("sections", "fragment"),
    [
        ({"replica_groups": {"groups": 1}}, "at least 2 groups"),
        ({"replica_groups": {"groups": 3, "min_groups": 4}}, "replica_groups.min_groups = 4"),
        (
            {"replica_groups": {"groups": 2}, "parallelism": {"dp_replicate": 2}},
            "torchft owns the replicate dimension",
        ),
        (
            {
                "replica_groups": {"groups": 2},
                "training": {"global_batch_size": 4},
                "dataloader": {"schedule": [{"start_step": 3, "seq_len": 64}]},
            },
            "down_policy = 'accumulate'",
        ),
        ({"replica_groups": {"groups": 2, "down_policy": "grow"}}, "down_policy"),
    ],
    ids=["one-group", "min-groups", "dp-replicate", "seq-len-phase", "policy"],
)
def test_a_bad_replica_groups_key_is_one_line(run_toml, sections, fragment):
    _one_line(cli("--config", str(run_toml(**sections)), "--check"), fragment)


def test_a_group_started_by_hand_is_refused(run_toml):
    """Without its launcher's lease token a group does not start (before torch loads)."""
    config = run_toml(replica_groups={"groups": 2})
    _one_line(cli("--config", str(config)), "lease.json", "replica-groups")


def test_the_launcher_refuses_a_bad_group_count(run_toml):
    script = str(REPO / "scripts" / "train_local.sh")
    config = str(run_toml())
    for args, fragment in [
        (["--replica-groups", "1", config], "at least 2 groups"),
        (["--replica-groups", "3"], "give the number of groups and the config"),
        # the launcher takes train's own --fresh [--overwrite] (checked once, for all groups)
        (["--replica-groups", "2", config, "--overwrite"], "--overwrite only applies with --fresh"),
    ]:
        proc = subprocess.run(
            [script, *args], cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120
        )
        _one_line(proc, fragment)


def test_the_launcher_refuses_more_groups_than_the_allocation_holds(run_toml, tmp_path):
    """Under SLURM (`--srun`) a group past the allocation's nodes would get no hosts and
    run on the batch host: 2 groups x 2 nodes of a 3-node allocation (`scontrol` stubbed,
    listing the allocation's hosts) are refused before any group starts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'n1\\nn2\\nn3\\n'\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = train_env() | {"PATH": f"{bin_dir}:{train_env()['PATH']}", "SLURM_JOB_NODELIST": "n[1-3]"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "replica_groups.py"), "--srun", "--groups", "2",
         "--nnodes", "2", str(run_toml())],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    _one_line(proc, "--groups 2 x --nnodes 2 needs 4 nodes, but the allocation has 3")


def test_the_launcher_refuses_groups_whose_state_exceeds_the_gpu(tmp_path):
    """`--nnodes 1 --nproc 8` of the 70B config (tp 8): 8 ranks a group, whose state with
    the replica sum's gradient buckets is 131.5 GiB a rank, above an H100's 80 GiB (the
    launch's GPU kind: TRAIN_GPU, as scripts/slurm/submit.py exports it). The group's
    `--check` refuses before any process starts."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "replica_groups.py"), "--groups", "2",
         "--nnodes", "1", "--nproc", "8", str(REPO / "configs" / "llama3_70b_fp8.toml"),
         "--job.folder", str(tmp_path / "run")],
        cwd=REPO, env=train_env() | {"TRAIN_GPU": "h100"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    _one_line(proc, "131.5 GiB on 8 ranks a group", "16 ranks a group hold it")


def test_the_lease_admits_the_launchers_groups_and_no_one_else(tmp_path):
    launcher = RunLease(tmp_path)
    launcher.acquire()
    try:
        RunLease(tmp_path).admit(launcher.me.token)  # a group it started
        with pytest.raises(LeaseHeld, match="in use by a live run"):
            RunLease(tmp_path).admit("someone else's token")
        with pytest.raises(LeaseHeld):
            RunLease(tmp_path).acquire()  # a second launch
    finally:
        launcher.release()
    with pytest.raises(LeaseHeld, match="started by its launcher"):
        RunLease(tmp_path).admit(launcher.me.token)  # the launcher is gone: no admission


def test_the_plan_plans_one_group_and_names_the_down_policy(run_toml):
    config = run_toml(
        training={"global_batch_size": 6},
        replica_groups={"groups": 3, "down_policy": "accumulate"},
    )
    proc = cli("--config", str(config), "--dry-run", "--world-size", "1", timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "replica groups: 3 groups, each planned below (2 of the 6 sequences" in proc.stdout
    assert "down_policy = accumulate" in proc.stdout and "3/k of one group's step" in proc.stdout
    assert "global batch 2;" in proc.stdout  # one group's step is what was traced


def test_torchft_timeouts_at_70b_on_32_gpus_come_from_the_plan():
    """The 70B config, a group of 32 H100s, with its plan (`python -m train --dry-run
    --world-size 32 --gpu h100 --write-budgets`, 2026-11-28: 8 micro-batches, step 36.1 s,
    compile 120 s, checkpoint 846.6 GB saved in 169.3 s at 5 GB/s). A rank's state is 12
    bytes a parameter over 32 ranks, 26.5 GB: 52.9 s at the configured 0.5 GB/s (torchft's
    HTTP transport on loopback). torchft's 60 s, 120 s and the Lighthouse's 2 s, the
    constants these replace, would each end a healthy run here."""
    from train.config import load_config
    from train.reliability.budgets import Budgets, PlannedTimes
    from train.replica_groups.build import HEARTBEAT_TIMEOUT_S, ft_timeouts

    path = str(REPO / "configs" / "llama3_70b_fp8.toml")
    run = load_config(path, ["--replica_groups.groups", "2"])
    planned = PlannedTimes(
        fingerprint="the plan's", world_size=32, gpu="NVIDIA H100 SXM5 80GB", accumulation=8,
        step_s={8192: 36.095}, compile_s=120.0, checkpoint_bytes=846_644_570_483,
        storage_gb_per_s=5.0, save_s=169.33,
    )  # fmt: skip
    budgets = Budgets.of(run, planned)
    assert budgets.init_timeout_s == 360  # the first step's collective timeout, compile in
    t = ft_timeouts(run, 32, budgets)
    assert t.heal_s == pytest.approx(52.92, abs=0.01)
    assert t.timeout_s == pytest.approx(3 * 52.92 + 360, abs=0.1)  # a heal x 3 + first step
    assert t.join_timeout_s == pytest.approx(3 * 169.33 + 60, abs=0.1)  # the save stall x 3
    assert t.quorum_timeout_s == pytest.approx(t.join_timeout_s + 360, abs=0.1)
    assert 1 <= t.chunks <= 27  # a stream per GB of the rank's state, at most a core each
    # a quorum's setup waits for a member as long as the watchdog lets a live rank go
    # without progress (torchft's whole timeout without a watchdog); an unreachable
    # Lighthouse is asked again every heartbeat timeout, not every sixth of the quorum's
    assert t.rendezvous_s == run.fault_tolerance.hang_timeout_s < t.timeout_s
    off = replace(run, fault_tolerance=replace(run.fault_tolerance, hang_timeout_s=0))
    assert ft_timeouts(off, 32, Budgets.of(off, planned)).rendezvous_s == t.timeout_s
    assert t.quorum_timeout_s / (t.quorum_retries + 1) <= HEARTBEAT_TIMEOUT_S
    # half the rate: the heal and the timeouts that wait for it grow with it
    slow = load_config(
        path, ["--replica_groups.groups", "2", "--replica_groups.heal_gb_per_s", "0.25"]
    )
    assert ft_timeouts(slow, 32, budgets).timeout_s == pytest.approx(3 * 105.84 + 360, abs=0.1)


def test_a_quorum_setup_waits_the_rendezvous_and_its_collectives_the_timeout():
    """torchft's gloo group as the groups build it (`IncarnationGloo`): a quorum's setup
    whose member never comes gives up after `rendezvous` (the survivor of a group that
    died in its quorum goes on to the next quorum), and a set-up group's collective waits
    for a late peer the whole `timeout` (a healing peer may take that long)."""
    import threading
    import time
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore

    from train.replica_groups.torchft_workarounds import IncarnationGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def group(rank: int, prefix: str) -> IncarnationGloo:
        pg = IncarnationGloo(timedelta(seconds=3), rendezvous=timedelta(seconds=0.5))
        pg.configure(f"127.0.0.1:{store.port}/{prefix}", f"group_{rank}", rank, 2)
        return pg

    start = time.monotonic()
    with pytest.raises(Exception, match="timeout"):
        group(0, "alone")  # the other member died after it asked for the quorum
    assert time.monotonic() - start < 2  # measured 0.53 s

    pgs = [None, None]
    threads = [
        threading.Thread(target=lambda r=r: pgs.__setitem__(r, group(r, "both"))) for r in (0, 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out"):
        pgs[0].allreduce([torch.ones(2)], torch.distributed.AllreduceOptions()).wait()
    assert time.monotonic() - start >= 2.5  # not the rendezvous' 0.5 s
