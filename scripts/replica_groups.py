#!/usr/bin/env python3
"""Run N torchft replica groups of one run: the Lighthouse, then each group's torchrun
agents (one per node of the group, `--nnodes`), each group restarted when it dies while the
others train on.

    scripts/replica_groups.py --groups N [--nnodes K] --nproc P CONFIG [--section.key value]...

Why a supervisor: with replica groups a dead group is not the end of the run. The others
finish the step without it (torchft's quorum drops it) and this launcher starts the group
again, which joins the next quorum and heals from a live peer, reading no checkpoint
(`TRAIN_REPLICA_REJOIN=1`: it loads nothing at start-up). The Lighthouse is restarted on
its address when it dies; the groups retry their quorum meanwhile. The launcher holds the
run folder's lease for its groups (`common.run_lease.RunLease.admit`): a second launch on
the folder is refused, and so is a group started by hand.

`scripts/train_local.sh --replica-groups N` runs this; SLURM's batch script runs it on
the batch host with `--srun` (each group one `srun` step over its own K nodes, the
allocation's nodes in blocks of K; a group restarts on its own block). Exit status:
the first non-zero of the groups' final exits, 0 when every group finished; 2 for bad input
(common/exit_codes.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.exit_codes import ExitCode  # noqa: E402
from common.io import ArgumentParser, free_port, run_cli, write_json_atomic  # noqa: E402
from common.run_layout import CHECKPOINT_DIR, LIGHTHOUSE, REPLICAS_DIR  # noqa: E402
from common.run_lease import LEASE_TOKEN_ENV, RunLease  # noqa: E402

LIGHTHOUSE_FILE_ENV = "TRAIN_LIGHTHOUSE_FILE"  # train/replica_groups/torchft_workarounds.py
REJOIN_ENV = "TRAIN_REPLICA_REJOIN"
GROUP_ENV = "TRAIN_REPLICA_GROUP"


def say(message: str) -> None:
    print(f"[replica_groups] {message}", file=sys.stderr, flush=True)


def flags(values: dict) -> list[str]:
    """{"--flag": value, ...} as argv."""
    return [arg for flag, value in values.items() for arg in (flag, str(value))]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = ArgumentParser(prog="scripts/replica_groups.py", description=__doc__)
    parser.add_argument("--groups", type=int, required=True, help="replica groups (>= 2)")
    parser.add_argument("--nproc", type=int, default=1, help="processes per node")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes per group")
    parser.add_argument("--max-restarts", type=int, default=3, help="per group")
    parser.add_argument("--srun", action="store_true", help="under SLURM: each group one srun step")
    parser.add_argument(
        "--fresh", action="store_true", help="start from scratch; refuses if RUN has checkpoints"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="with --fresh: delete RUN's checkpoints"
    )
    parser.add_argument("config")
    return parser.parse_known_args(argv)


class Lighthouse:
    """torchft's Lighthouse server (its `torchft_lighthouse` binary) on a fixed port, so a
    restart keeps the address the groups know. Its join timeout outlasts the plan's save
    stall (`train.replica_groups.build.ft_timeouts`): a group that saves still beats, and a
    quorum formed without it would make it heal."""

    def __init__(self, run_dir: Path, min_replicas: int, join_timeout_s: float):
        self.port = free_port()
        self.address = f"http://{os.environ.get('SLURMD_NODENAME') or '127.0.0.1'}:{self.port}"
        self.min_replicas = min_replicas
        self.join_timeout_ms = int(join_timeout_s * 1000)
        self.log = open(run_dir / "lighthouse.log", "ab")  # noqa: SIM115
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0
        self.file = run_dir / LIGHTHOUSE

    def start(self) -> None:
        from train.replica_groups.build import HEARTBEAT_TIMEOUT_S

        # the groups' rendezvous prefix names the incarnation
        # (train/replica_groups/torchft_workarounds.py): counted before it starts
        self.incarnation += 1
        self.record()
        binary = shutil.which("torchft_lighthouse") or str(
            Path(sys.executable).parent / "torchft_lighthouse"
        )
        options = {"--min_replicas": self.min_replicas, "--bind": f"[::]:{self.port}",
                   "--join_timeout_ms": self.join_timeout_ms, "--quorum_tick_ms": 100,
                   "--heartbeat_timeout_ms": int(HEARTBEAT_TIMEOUT_S * 1000)}  # fmt: skip
        self.proc = subprocess.Popen(
            [binary, *flags(options)], stdout=self.log, stderr=subprocess.STDOUT
        )

    def record(self, **ended) -> None:
        """RUN/lighthouse.json: the address and incarnation, and at the end how it ended."""
        where = {"address": self.address, "incarnation": self.incarnation}
        write_json_atomic(self.file, where | ended)

    def keep_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            say(f"Lighthouse exited ({self.proc.returncode}); restarting it on {self.address}")
            self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def group_commands(args, group: int, rest: list[str], hosts: list[str]) -> list[list[str]]:
    """The commands of group `group`: one torchrun agent per node of the group, meeting at
    a rendezvous of the group's own (its id and port; on its first node), so the groups
    never join each other's. `hosts`: the group's SLURM nodes (one `srun` step over them),
    or none on this machine, where each of the group's `--nnodes` agents is a process here
    (the nodes of a group simulated, as torchrun's c10d rendezvous lets several agents on
    one host meet). The port is picked free on this host, outside the ephemeral range
    (`common.io.free_port`); with SLURM it is bound on the group's first node."""
    endpoint = f"{hosts[0] if hosts else '127.0.0.1'}:{free_port(host='')}"
    rendezvous = {"--nnodes": args.nnodes, "--nproc_per_node": args.nproc,
                  "--rdzv-backend": "c10d", "--rdzv-endpoint": endpoint,
                  "--rdzv-id": f"group-{group}"}  # fmt: skip
    torchrun = [sys.executable, str(REPO / "scripts" / "slurm" / "torchrun.py")]
    torchrun += [*flags(rendezvous), "-m", "train", "--config", args.config, *rest]
    if not hosts:
        return [torchrun] * args.nnodes
    # one step per group on its own nodes: a task that fails ends its step, not the job
    nodes = {"--nodes": len(hosts), "--ntasks": len(hosts), "--ntasks-per-node": 1,
             "--nodelist": ",".join(hosts)}  # fmt: skip
    srun = ["srun", *flags(nodes), "--kill-on-bad-exit=1", "--job-name", f"group-{group}"]
    return [srun + torchrun]


def slurm_nodes() -> list[str]:
    """The allocation's hosts, in order (the first is the batch host)."""
    hostnames = ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]]
    return subprocess.run(hostnames, capture_output=True, text=True, check=True).stdout.split()


def group_exit(agents: list[subprocess.Popen]) -> int | None:
    """A group's exit: the first failed agent's code (the others are ended: a group is
    whole or dead), 0 when every agent finished, None while it runs."""
    codes = [agent.poll() for agent in agents]
    failed = [code for code in codes if code]
    for agent in agents if failed else []:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    return failed[0] if failed else (0 if None not in codes else None)


def supervise(
    args, rest: list[str], run_dir: Path, lease: RunLease, quorum: int, join_s: float
) -> int:
    lighthouse = Lighthouse(run_dir, quorum, join_s)
    lighthouse.start()
    env = dict(os.environ)
    env |= {"TORCHFT_LIGHTHOUSE": lighthouse.address, LEASE_TOKEN_ENV: lease.me.token}
    env[LIGHTHOUSE_FILE_ENV] = str(lighthouse.file)
    procs: dict[int, list[subprocess.Popen]] = {}
    restarts = dict.fromkeys(range(args.groups), 0)
    finished: dict[int, int] = {}

    nodes = slurm_nodes() if args.srun else []

    def launch(group: int, rejoin: bool) -> None:
        group_env = env | {GROUP_ENV: str(group), REJOIN_ENV: "1" if rejoin else "0"}
        hosts = nodes[group * args.nnodes : (group + 1) * args.nnodes]  # its own, every start
        if hosts:
            say(f"group {group} on {','.join(hosts)}")
        commands = group_commands(args, group, rest, hosts)
        procs[group] = [subprocess.Popen(command, env=group_env) for command in commands]

    stopping: list[int] = []

    def forward(signum, frame) -> None:  # a preemption: every group checkpoints and stops
        stopping.append(signum)
        for proc in (agent for agents in procs.values() for agent in agents):
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, forward)
    for group in range(args.groups):
        launch(group, rejoin=False)
    try:
        while procs:
            time.sleep(0.5)
            lighthouse.keep_alive()
            for group, agents in list(procs.items()):
                code = group_exit(agents)
                if code is None:
                    continue
                del procs[group]
                live = [g for g, a in procs.items() if group_exit(a) is None]
                if code and any(c == 0 for c in finished.values()) and restarts[group]:
                    # the run finished before this restarted group could rejoin it
                    say(f"group {group} did not rejoin before the run finished")
                    finished[group] = 0
                    continue
                if code in (0, ExitCode.USER_ERROR) or not live or stopping:
                    finished[group] = code
                    continue
                if restarts[group] >= args.max_restarts:
                    say(f"group {group} exited {code}; no restarts left")
                    finished[group] = code
                    continue
                restarts[group] += 1
                say(f"group {group} exited {code} while groups {live} train on: restarting it "
                    f"(restart {restarts[group]}); it heals from a live peer")  # fmt: skip
                launch(group, rejoin=True)
    finally:
        agents = [agent for group in procs.values() for agent in group]
        for proc in agents:
            proc.send_signal(signal.SIGTERM)
        for proc in agents:
            proc.wait()
        lighthouse.stop()
    lighthouse.record(groups=args.groups, restarts=restarts, exits=finished)
    bad = [code for code in finished.values() if code]
    return bad[0] if bad else 0


def start_over(run_dir: Path) -> None:
    """--fresh (--overwrite: `check_fresh` allowed it): the run's checkpoints and every
    group's ledger go, so that the groups start at step 0 with a new history."""
    for folder in (run_dir / CHECKPOINT_DIR, run_dir / REPLICAS_DIR):
        if folder.is_dir():
            print(f"[replica_groups] --fresh: deleting {folder}", flush=True)
            shutil.rmtree(folder)


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        if args.groups < 2:
            raise ValueError(f"--replica-groups {args.groups}: give at least 2 groups")
        if min(args.nproc, args.nnodes) < 1:
            raise ValueError(
                f"--nproc {args.nproc}, --nnodes {args.nnodes}: give positive integers"
            )
        if not Path(args.config).is_file():
            raise ValueError(f"config file {args.config} not found")
        # a group past the allocation's nodes would get no hosts and run on the batch host
        allocated = len(slurm_nodes()) if args.srun else 0
        if args.srun and allocated < args.groups * args.nnodes:
            raise ValueError(
                f"--groups {args.groups} x --nnodes {args.nnodes} needs "
                f"{args.groups * args.nnodes} nodes, but the allocation has "
                f"{allocated}; allocate more nodes or give fewer groups"
            )
        overrides = [*rest, "--replica_groups.groups", str(args.groups)]
        world = args.nnodes * args.nproc
        check = [sys.executable, "-m", "train", "--check", "--world-size", str(world)]
        check = subprocess.run([*check, "--config", args.config, *overrides])
        if check.returncode:
            return check.returncode
        from train.config import load_config
        from train.reliability.budgets import load_budgets
        from train.replica_groups.build import ft_timeouts
        from train.runtime import check_fresh, prepare_run_dir

        run = load_config(args.config, overrides)
        join_s = ft_timeouts(run, world, load_budgets(run, world)).join_timeout_s
        check_fresh(run, args.fresh, args.overwrite)
        lease = RunLease(run.run_dir)
        with lease.held(on_lost=lambda holder: os._exit(ExitCode.USER_ERROR)):
            if args.fresh:  # once, here: a group restarted later must resume, never start over
                start_over(run.run_dir)
            prepare_run_dir(run)  # once for all groups (they skip it)
            return supervise(args, overrides, run.run_dir, lease, run.min_replica_groups, join_s)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
