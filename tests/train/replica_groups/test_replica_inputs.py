"""Replica groups' bad input and the run-folder lease, through the real entry points: one
`error: ...` line, exit 2, no traceback (`python -m train --check`, a group started by
hand, `scripts/train_local.sh --replica-groups`); and the lease admits the launcher's own
groups and no one else."""

from __future__ import annotations

import subprocess

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
