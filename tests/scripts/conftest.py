"""A real one-node SLURM cluster on localhost, for the launcher tests.

Why a real cluster: the SLURM launcher's value is in how it talks to SLURM (signals to
the batch shell, `srun` forwarding them to every task, `scontrol requeue`, the restart
count); a mock would only test our assumptions about SLURM. Debian's `slurm-wlm` and
`munge` run fine as root in a container, so the fixture installs them
(`scripts/setup_slurm.sh`), writes a private `munge.key` and `slurm.conf` under a tmp
dir (free ports, so it cannot clash with anything else on the machine), starts `munged`,
`slurmctld` and `slurmd` in the foreground as children of the test process, waits until
`sinfo` shows the node idle, and stops all three at the end, also on failure.

If the cluster cannot start, the fixture fails with the reason and the daemon logs: a
launcher test that silently skips would hide exactly the breakage it exists to catch.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomli_w

from dataloader.common import free_port

REPO = Path(__file__).resolve().parents[2]
# Completed jobs stay visible to `scontrol show job` this long (no accounting database,
# so no `sacct`): longer than any test here waits on one job.
MIN_JOB_AGE_S = 1800


@dataclass
class SlurmCluster:
    """Handles to a running local cluster; `env` is what SLURM clients need."""

    root: Path
    node_name: str
    num_cpus: int
    env: dict[str, str]
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        """Run a SLURM client command against this cluster and return its stdout."""
        proc = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            )
        return proc.stdout

    def logs(self) -> str:
        """The tail of every daemon log, for failure messages."""
        parts = []
        for name in ("munged", "slurmctld", "slurmd"):
            path = self.root / f"{name}.log"
            text = path.read_text(errors="replace") if path.exists() else "(no log file)"
            parts.append(f"--- {path} (last 40 lines) ---\n" + "\n".join(text.splitlines()[-40:]))
        return "\n".join(parts)

    def job_state(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id)
        fields = {}
        for token in out.split():
            key, _, value = token.partition("=")
            fields[key] = value
        return fields

    def wait_job(self, job_id: str, timeout: float, until=None) -> dict[str, str]:
        """Poll until the job reaches a final state (or `until(state)` holds)."""
        final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
        deadline = time.monotonic() + timeout
        state: dict[str, str] = {}
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if until is not None and until(state):
                return state
            if until is None and state.get("JobState") in final:
                return state
            time.sleep(1)
        raise AssertionError(
            f"job {job_id} still not done after {timeout:.0f} s: {state}\n{self.logs()}"
        )

    def stop(self) -> None:
        # Jobs first: a test that failed mid-job would otherwise leave slurmstepd and its
        # training processes running after slurmd is gone. A plain scancel ends a
        # train.sbatch job for good (it does not requeue a job SLURM is ending).
        if self.daemons.get("slurmctld") and self.daemons["slurmctld"].poll() is None:
            deadline = time.monotonic() + 45
            while time.monotonic() < deadline:
                jobs = self.run("squeue", "-h", "-o", "%A", check=False).split()
                if not jobs:
                    break
                self.run("scancel", *jobs, check=False)
                time.sleep(1)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.daemons.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _write_config(root: Path, node_name: str, num_cpus: int) -> Path:
    ctld_port, slurmd_port = free_port(), free_port()
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(
        f"""\
ClusterName=launcher-test
SlurmctldHost={node_name}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also the delay before a requeued job may start again (default 120 s)
AuthInfo=socket={root / "munge.socket"},cred_expire=10
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "slurmctld.log"}
SlurmdLogFile={root / "slurmd.log"}
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container: track processes through /proc, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
# schedule every few seconds, not every minute: requeued jobs restart promptly
SchedulerParameters=sched_interval=2,bf_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge={MIN_JOB_AGE_S}
KillWait=30
NodeName={node_name} NodeAddr=127.0.0.1 CPUs={num_cpus} State=UNKNOWN
PartitionName=debug Nodes={node_name} Default=YES MaxTime=INFINITE State=UP
"""
    )
    return conf


def start_cluster(root: Path) -> SlurmCluster:
    setup = subprocess.run(
        [str(REPO / "scripts" / "setup_slurm.sh")], capture_output=True, text=True
    )
    if setup.returncode != 0:
        pytest.fail(f"scripts/setup_slurm.sh failed:\n{setup.stdout}\n{setup.stderr}")

    node_name = socket.gethostname().split(".")[0]
    num_cpus = os.cpu_count() or 1
    conf = _write_config(root, node_name, num_cpus)
    key = root / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    env = dict(os.environ, SLURM_CONF=str(conf))
    cluster = SlurmCluster(root=root, node_name=node_name, num_cpus=num_cpus, env=env)

    def spawn(name: str, args: list[str]) -> None:
        log = open(root / f"{name}.stdout", "wb")  # noqa: SIM115 (closed with the process)
        cluster.daemons[name] = subprocess.Popen(
            args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    try:
        spawn(
            "munged",
            [
                shutil.which("munged") or "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={root / 'munge.socket'}",
                f"--pid-file={root / 'munged.pid'}",
                f"--log-file={root / 'munged.log'}",
                f"--seed-file={root / 'munged.seed'}",
            ],
        )
        _wait_for(lambda: (root / "munge.socket").exists(), 20, "munged socket", cluster)
        spawn("slurmctld", ["slurmctld", "-D", "-f", str(conf)])
        spawn("slurmd", ["slurmd", "-D", "-f", str(conf), "-N", node_name])

        def node_idle() -> bool:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True
            )
            return out.returncode == 0 and out.stdout.strip() == "idle"

        _wait_for(node_idle, 60, "sinfo to show the node idle", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_for(predicate, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        dead = {n: p.returncode for n, p in cluster.daemons.items() if p.poll() is not None}
        if dead:
            pytest.fail(f"SLURM daemon(s) exited {dead} while waiting for {what}\n{cluster.logs()}")
        time.sleep(0.5)
    pytest.fail(
        f"SLURM did not start: timed out after {timeout} s waiting for {what}\n{cluster.logs()}"
    )


def write_run_config(path: Path, data: Path, run_dir: Path, **sections) -> Path:
    """A configs/debug.toml run shrunk to seconds per step on 2 shared cores.

    seq 64, batch 2, a checkpoint every 3 steps, a metrics line every step; `sections`
    replace whole keys of a section (`training={"steps": 9}`).
    """
    config = {
        "extends": str(REPO / "configs" / "debug.toml"),
        "job": {"folder": str(run_dir)},
        "dataloader": {
            "tokenizer": str(data / "tokenizer"),
            "mix": [{"path": str(data / "train"), "weight": 1.0}],
        },
        "validation": {"enable": False},
        "training": {"steps": 6, "seq_len": 64, "local_batch_size": 2},
        "lr_scheduler": {"warmup_steps": 2},
        "checkpoint": {"interval": 3},
        "metrics": {"log_freq": 1},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    path.write_text(tomli_w.dumps(config))
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    """RUN/metrics.jsonl as dicts (training lines only: the ones with a loss)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "loss" in r]


def launcher_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory) -> SlurmCluster:
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()
