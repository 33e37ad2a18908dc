"""A real SLURM cluster on this machine, for the launcher tests (fixtures in
tests/scripts/conftest.py): one node on localhost,
or two nodes in network namespaces.

Why a real cluster: the SLURM launcher's value is in how it talks to SLURM (signals to
the batch shell, `srun` forwarding them to every task, `scontrol requeue`, the restart
count); a mock would only test our assumptions about SLURM. Debian's `slurm-wlm` and
`munge` run fine as root in a container, so the fixture installs them
(`scripts/setup_slurm.sh`), writes a private `munge.key` and `slurm.conf` under a tmp
dir (free ports, so it cannot clash with anything else on the machine), starts `munged`,
`slurmctld` and `slurmd` in the foreground as children of the test process, waits until
`sinfo` shows the node idle, and stops all three at the end, also on failure.

Two nodes (`slurm_cluster_2node`): multi-node launching (the rendezvous host from
`scontrol show hostnames`, srun across hosts, requeue of a multi-node job) only runs where
the nodes really are separate hosts. Each node is a network namespace (`ip netns`) with
its own veth address on a private bridge (10.77.0.0/24, reachable only from these
namespaces) and, through `unshare --uts --mount`, its own hostname and its own
/etc/hosts (a bind mount seen by that node's processes only; the machine's file is not
touched). `slurmctld` and the test's client commands run in a third namespace, the hub
holding the bridge. The filesystem and munge's socket are shared, like the shared
filesystem of a real cluster. Teardown cancels the jobs, stops the daemons, kills what
is left in the namespaces and deletes them, also on failure; namespaces left by a test
process that died are removed at the next start.

If the cluster cannot start, the fixture fails with the reason and the daemon logs: a
launcher test that silently skips would hide exactly the breakage it exists to catch.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from common.io import free_port
from tests.utils.runs import REPO, train_env

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
    node_names: list[str] = field(default_factory=list)
    """Every node (the one-node cluster: [node_name])."""
    client_prefix: list[str] = field(default_factory=list)
    """Put before a client command (sbatch, scontrol, ...) to reach the controller."""
    namespaces: list[str] = field(default_factory=list)
    """Network namespaces this cluster created (deleted by stop())."""

    def client(self, *args: str) -> list[str]:
        """A SLURM client command line, run where the controller is reachable."""
        return [*self.client_prefix, *args]

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        """Run a SLURM client command against this cluster and return its stdout."""
        proc = subprocess.run(
            self.client(*args), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            )
        return proc.stdout

    def logs(self) -> str:
        """The tail of every daemon log, for failure messages."""
        parts = []
        names = ["munged", "slurmctld"]
        names += [f"slurmd-{n}" for n in self.node_names] if self.namespaces else ["slurmd"]
        for name in names:
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
        names = [n for n in self.daemons if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in names:
            proc = self.daemons.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for namespace in self.namespaces:
            _delete_namespace(namespace)
        self.namespaces.clear()


def _write_slurm_conf(
    root: Path,
    ctld: tuple[str, str],
    nodes: list[tuple[str, str]],
    num_cpus: int,
    ports: tuple[int, int],
    per_node_files: bool = False,
) -> Path:
    """slurm.conf for a controller (name, address) and nodes [(name, address)].

    `per_node_files`: each slurmd its own spool dir, pid and log file (%n = node name),
    for several slurmd sharing one filesystem.
    """
    ctld_port, slurmd_port = ports
    (root / "state").mkdir()
    (root / "spool").mkdir()
    for name, _ in nodes if per_node_files else []:
        (root / "spool" / name).mkdir()
    node_suffix = "-%n" if per_node_files else ""
    spool = root / "spool" / "%n" if per_node_files else root / "spool"
    node_lines = "\n".join(
        f"NodeName={name} NodeHostname={name} NodeAddr={addr} CPUs={num_cpus} State=UNKNOWN"
        if per_node_files
        else f"NodeName={name} NodeAddr={addr} CPUs={num_cpus} State=UNKNOWN"
        for name, addr in nodes
    )
    # Under load (2 cores shared by several slurmd and the jobs) a slurmd can take longer
    # than the default 10 s to answer the controller. A lost answer to the terminate
    # message of a job's earlier run is retried after the requeue and then kills the new
    # run of that job id (measured: every attempt after a crash died by SIGKILL).
    message_timeout = "MessageTimeout=60\n" if per_node_files else ""
    conf = root / "slurm.conf"
    conf.write_text(
        f"""\
ClusterName=launcher-test
SlurmctldHost={ctld[0]}({ctld[1]})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also the delay before a requeued job may start again (default 120 s)
AuthInfo=socket={root / "munge.socket"},cred_expire=10
StateSaveLocation={root / "state"}
SlurmdSpoolDir={spool}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / f"slurmd{node_suffix}.pid"}
SlurmctldLogFile={root / "slurmctld.log"}
SlurmdLogFile={root / f"slurmd{node_suffix}.log"}
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
{message_timeout}{node_lines}
PartitionName=debug Nodes={",".join(name for name, _ in nodes)} Default=YES MaxTime=INFINITE State=UP
"""
    )
    return conf


def _install_slurm() -> None:
    setup = subprocess.run(
        [str(REPO / "scripts" / "setup_slurm.sh")], capture_output=True, text=True
    )
    if setup.returncode != 0:
        pytest.fail(f"scripts/setup_slurm.sh failed:\n{setup.stdout}\n{setup.stderr}")


def _launch(
    cluster: SlurmCluster,
    conf: Path,
    ctld_wrap: list[str],
    slurmds: dict[str, list[str]],
) -> None:
    """Start munged, slurmctld (behind `ctld_wrap`) and each node's slurmd (behind its
    wrapper); wait until every node is idle. Stops everything on failure."""
    root, env = cluster.root, cluster.env
    key = root / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)

    def spawn(name: str, args: list[str]) -> None:
        log = open(root / f"{name}.stdout", "wb")  # closed with the process
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
        spawn("slurmctld", [*ctld_wrap, "slurmctld", "-D", "-f", str(conf)])
        for daemon, wrap in slurmds.items():
            node = daemon.removeprefix("slurmd-") if daemon != "slurmd" else cluster.node_name
            spawn(daemon, [*wrap, "slurmd", "-D", "-f", str(conf), "-N", node])

        def nodes_idle() -> bool:
            out = subprocess.run(
                cluster.client("sinfo", "-h", "-N", "-o", "%t"),
                env=env,
                capture_output=True,
                text=True,
            )
            states = out.stdout.split()
            return out.returncode == 0 and states == ["idle"] * len(cluster.node_names)

        _wait_for(nodes_idle, 60, "sinfo to show every node idle", cluster)
    except BaseException:
        cluster.stop()
        raise


def start_cluster(root: Path) -> SlurmCluster:
    """One node: this machine, by its own hostname, on 127.0.0.1."""
    _install_slurm()
    node_name = socket.gethostname().split(".")[0]
    num_cpus = os.cpu_count() or 1
    conf = _write_slurm_conf(
        root,
        (node_name, "127.0.0.1"),
        [(node_name, "127.0.0.1")],
        num_cpus,
        (free_port(), free_port()),
    )
    env = dict(os.environ, SLURM_CONF=str(conf))
    cluster = SlurmCluster(
        root=root, node_name=node_name, num_cpus=num_cpus, env=env, node_names=[node_name]
    )
    _launch(cluster, conf, [], {"slurmd": []})
    return cluster


# Namespaces are named after the creating process, so leftovers of a dead one are found.
NAMESPACE_PREFIX = "slurmtest"
SUBNET = "10.77.0"  # private; these addresses exist only inside the namespaces below


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _delete_namespace(namespace: str) -> None:
    """Kill what still runs in it (only our daemons and jobs can), then delete it."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in pids.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    for _ in range(50):
        if subprocess.run(["ip", "netns", "del", namespace], capture_output=True).returncode == 0:
            return
        time.sleep(0.1)


def _delete_stale_namespaces() -> None:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == NAMESPACE_PREFIX and parts[1].isdigit():
            if not Path(f"/proc/{parts[1]}").exists():
                _delete_namespace(name)


def _node_wrapper(namespace: str, hostname: str, hosts_file: Path) -> list[str]:
    """Run a command in `namespace` as host `hostname`, resolving names with `hosts_file`
    only (the resolv.conf next to it names no server outside the namespace)."""
    script = (
        'mount --bind "$1" /etc/hosts && mount --bind "$1.resolv" /etc/resolv.conf'
        ' && hostname "$2" && shift 2 && exec "$@"'
    )
    # nsenter, not `ip netns exec`: that one remounts /sys, hiding /sys/fs/cgroup, which
    # slurmd needs even with proctrack/linuxproc
    return [
        "nsenter",
        f"--net=/run/netns/{namespace}",
        "unshare",
        "--uts",
        "--mount",
        "sh",
        "-c",
        script,
        "sh",
        str(hosts_file),
        hostname,
    ]


def start_two_node_cluster(root: Path, num_nodes: int = 2) -> SlurmCluster:
    """`num_nodes` slurmd hosts, each in its own network namespace (see the module doc)."""
    _install_slurm()
    _delete_stale_namespaces()
    tag = f"{NAMESPACE_PREFIX}-{os.getpid()}"
    hub = f"{tag}-hub"
    ctld = ("ctl", f"{SUBNET}.1")
    nodes = [(f"node{i}", f"{SUBNET}.{10 + i}") for i in range(1, num_nodes + 1)]
    hosts_file = root / "hosts"
    hosts_file.write_text(
        "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr in [ctld, *nodes])
    )
    # no DNS: a lookup that misses the hosts file fails at once on the node's own loopback
    (root / "hosts.resolv").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    num_cpus = os.cpu_count() or 1
    # Each namespace has its own port space: SLURM's standard ports cannot clash here.
    conf = _write_slurm_conf(root, ctld, nodes, num_cpus, (6817, 6818), per_node_files=True)
    env = dict(os.environ, SLURM_CONF=str(conf))
    cluster = SlurmCluster(
        root=root,
        node_name=nodes[0][0],
        num_cpus=num_cpus,
        env=env,
        node_names=[name for name, _ in nodes],
        client_prefix=["nsenter", f"--net=/run/netns/{hub}"],
    )
    try:
        cluster.namespaces.append(hub)
        _ip("netns", "add", hub)
        _ip("-n", hub, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "addr", "add", f"{ctld[1]}/24", "dev", "br0")
        _ip("-n", hub, "link", "set", "br0", "up")
        for index, (name, addr) in enumerate(nodes, start=1):
            namespace = f"{tag}-{name}"
            cluster.namespaces.append(namespace)
            _ip("netns", "add", namespace)
            _ip(
                "-n",
                hub,
                "link",
                "add",
                f"veth{index}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                namespace,
            )
            _ip("-n", hub, "link", "set", f"veth{index}", "master", "br0", "up")
            _ip("-n", namespace, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
    except RuntimeError as e:
        cluster.stop()
        pytest.fail(f"could not build the namespace network: {e}")
    slurmds = {
        f"slurmd-{name}": _node_wrapper(f"{tag}-{name}", name, hosts_file) for name, _ in nodes
    }
    _launch(cluster, conf, _node_wrapper(hub, ctld[0], hosts_file), slurmds)
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


SUBMIT = REPO / "scripts" / "slurm" / "submit.py"


def submit(
    cluster: SlurmCluster,
    config: Path,
    *args: str,
    launcher: tuple[str, ...] = (),
    nodes: int = 1,
    nproc_per_node: int = 2,
) -> str:
    """`submit.py` as a user runs it (CPU nodes, gloo); returns the job id."""
    proc = subprocess.run(
        cluster.client(
            sys.executable,
            str(SUBMIT),
            "--nodes",
            str(nodes),
            "--gpus-per-node",
            "0",
            "--nproc-per-node",
            str(nproc_per_node),
            "--cpus-per-task",
            str(cluster.num_cpus),
            "--time",
            "10:00",
            *launcher,
            str(config),
            *args,
        ),
        env=cluster.env | train_env() | {"SLURM_CONF": cluster.env["SLURM_CONF"]},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def restart_events(run_dir: Path) -> list[str]:
    """The `event=` of each line in RUN/slurm/restarts.log, with its attempt number."""
    lines = (run_dir / "slurm" / "restarts.log").read_text().splitlines()
    events = []
    for line in lines:
        fields = dict(tok.split("=", 1) for tok in line.split()[1:] if "=" in tok)
        events.append(f"{fields['attempt']}:{fields['event']}")
    return events


def job_logs(run_dir: Path) -> str:
    parts = []
    for path in sorted((run_dir / "slurm").glob("*.log")):
        parts.append(f"--- {path.name}\n" + "\n".join(path.read_text().splitlines()[-30:]))
    return "\n".join(parts)


def training_pids(config: Path) -> dict[int, int]:
    """{rank: pid} of the torchrun workers `python -m train --config CONFIG` running now
    (any node: the namespaces share this machine's process table). A worker's own children
    (DCP's async checkpoint daemon is forked from it, with the same command line and
    environment) are not workers: of each rank's processes the oldest, the parent, is kept."""
    pids: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train" in cmdline and str(config).encode() in cmdline and b"-m" in cmdline:
            env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
            if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
                rank, pid = int(env[b"RANK"]), int(entry.name)
                pids[rank] = min(pid, pids.get(rank, pid))
    return pids


def last_record_per_step(records: list[dict]) -> list[dict]:
    """The surviving trajectory: a step re-run after a crash replaces its earlier line."""
    by_step = {r["step"]: r for r in records}
    return [by_step[s] for s in sorted(by_step)]
