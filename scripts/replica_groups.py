#!/usr/bin/env python3
"""Run N torchft replica groups of one run on this machine: the Lighthouse, then one
torchrun per group, each restarted when it dies while the others train on.

    scripts/replica_groups.py --groups N --nproc P CONFIG [--section.key value]...

Why a supervisor: with replica groups a dead group is not the end of the run. The others
finish the step without it (torchft's quorum drops it) and this launcher starts the group
again, which joins the next quorum and heals from a live peer, reading no checkpoint
(`TRAIN_REPLICA_REJOIN=1`: it loads nothing at start-up). The Lighthouse is restarted on
its address when it dies; the groups retry their quorum meanwhile. The launcher holds the
run folder's lease for its groups (`common.run_lease.RunLease.admit`): a second launch on
the folder is refused, and so is a group started by hand.

`scripts/train_local.sh --replica-groups N` runs this; SLURM's batch script runs it on
the batch host with `--srun` (each group one `srun` step on its own nodes). Exit status:
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
from common.io import free_port, run_cli, write_json_atomic  # noqa: E402
from common.run_layout import CHECKPOINT_DIR, LIGHTHOUSE, REPLICAS_DIR  # noqa: E402
from common.run_lease import LEASE_TOKEN_ENV, RunLease  # noqa: E402

LIGHTHOUSE_FILE_ENV = "TRAIN_LIGHTHOUSE_FILE"  # train/replica_groups/torchft_workarounds.py
REJOIN_ENV = "TRAIN_REPLICA_REJOIN"
GROUP_ENV = "TRAIN_REPLICA_GROUP"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="scripts/replica_groups.py", description=__doc__)
    parser.add_argument("--groups", type=int, required=True, help="replica groups (>= 2)")
    parser.add_argument("--nproc", type=int, default=1, help="processes per group")
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
    restart keeps the address the groups know."""

    def __init__(self, run_dir: Path, min_replicas: int):
        self.port = free_port()
        self.host = os.environ.get("SLURMD_NODENAME") or "127.0.0.1"
        self.address = f"http://{self.host}:{self.port}"
        self.min_replicas = min_replicas
        self.log = open(run_dir / "lighthouse.log", "ab")  # noqa: SIM115
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.incarnation = 0
        self.file = run_dir / LIGHTHOUSE

    def start(self) -> None:
        # the groups' rendezvous prefix names the incarnation
        # (train/replica_groups/torchft_workarounds.py): counted before it starts
        self.incarnation += 1
        write_json_atomic(self.file, {"address": self.address, "incarnation": self.incarnation})
        binary = shutil.which("torchft_lighthouse") or str(
            Path(sys.executable).parent / "torchft_lighthouse"
        )
        self.proc = subprocess.Popen(
            [
                binary,
                "--min_replicas",
                str(self.min_replicas),
                "--bind",
                f"[::]:{self.port}",
                "--join_timeout_ms",
                "2000",
                "--quorum_tick_ms",
                "100",
                "--heartbeat_timeout_ms",
                "5000",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def keep_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            self.restarts += 1
            print(
                f"[replica_groups] Lighthouse exited ({self.proc.returncode}); restarting "
                f"it on {self.address}",
                file=sys.stderr,
                flush=True,
            )
            self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def group_command(args, group: int, rest: list[str], node: str | None) -> list[str]:
    torchrun = [
        sys.executable,
        str(REPO / "scripts" / "slurm" / "torchrun.py"),
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(args.nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "-m",
        "train",
        "--config",
        args.config,
        *rest,
    ]
    if node is None:
        return torchrun
    # one step per group, on a node of its own; a failed step does not end the job
    return [
        "srun",
        "--nodes",
        "1",
        "--ntasks",
        "1",
        "--nodelist",
        node,
        "--kill-on-bad-exit=0",
        "--job-name",
        f"group-{group}",
        *torchrun,
    ]


def slurm_nodes() -> list[str]:
    """The allocation's hosts, in order (the first is the batch host)."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


def place(group: int, nodes: list[str], placed: dict[int, str], failed: str | None) -> str:
    """A node for `group`: one no live group uses, a spare before the node it failed on."""
    busy = {n for g, n in placed.items() if g != group}
    free = [n for n in nodes if n not in busy]
    spares = [n for n in free if n != failed]
    return (spares or free or [failed or nodes[group % len(nodes)]])[0]


def supervise(args, rest: list[str], run_dir: Path, lease: RunLease, quorum: int) -> int:
    lighthouse = Lighthouse(run_dir, min_replicas=quorum)
    lighthouse.start()
    env = dict(os.environ)
    env |= {"TORCHFT_LIGHTHOUSE": lighthouse.address, LEASE_TOKEN_ENV: lease.me.token}
    env[LIGHTHOUSE_FILE_ENV] = str(lighthouse.file)
    procs: dict[int, subprocess.Popen] = {}
    restarts = dict.fromkeys(range(args.groups), 0)
    finished: dict[int, int] = {}

    nodes = slurm_nodes() if args.srun else []
    placed: dict[int, str] = {}

    def launch(group: int, rejoin: bool) -> None:
        group_env = env | {GROUP_ENV: str(group), REJOIN_ENV: "1" if rejoin else "0"}
        node = None
        if nodes:
            node = placed[group] = place(group, nodes, placed, placed.get(group))
            print(f"[replica_groups] group {group} on {node}", file=sys.stderr, flush=True)
        procs[group] = subprocess.Popen(group_command(args, group, rest, node), env=group_env)

    stopping: list[int] = []

    def forward(signum, frame) -> None:  # a preemption: every group checkpoints and stops
        stopping.append(signum)
        for proc in procs.values():
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
            for group, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[group]
                live = [g for g, p in procs.items() if p.poll() is None]
                if code and any(c == 0 for c in finished.values()) and restarts[group]:
                    # the run finished before this restarted group could rejoin it
                    print(
                        f"[replica_groups] group {group} did not rejoin before the run finished",
                        file=sys.stderr,
                        flush=True,
                    )
                    finished[group] = 0
                    continue
                if code in (0, ExitCode.USER_ERROR) or not live or stopping:
                    finished[group] = code
                    continue
                if restarts[group] >= args.max_restarts:
                    print(
                        f"[replica_groups] group {group} exited {code}; no restarts left",
                        file=sys.stderr,
                        flush=True,
                    )
                    finished[group] = code
                    continue
                restarts[group] += 1
                print(
                    f"[replica_groups] group {group} exited {code} while groups {live} "
                    f"train on: restarting it (restart {restarts[group]}); it heals from "
                    "a live peer",
                    file=sys.stderr,
                    flush=True,
                )
                launch(group, rejoin=True)
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.wait()
        lighthouse.stop()
    write_json_atomic(
        lighthouse.file,
        {
            "address": lighthouse.address,
            "incarnation": lighthouse.incarnation,
            "groups": args.groups,
            "restarts": restarts,
            "exits": finished,
        },
    )
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
        if args.nproc < 1:
            raise ValueError(f"--nproc {args.nproc} must be a positive integer")
        if not Path(args.config).is_file():
            raise ValueError(f"config file {args.config} not found")
        overrides = [*rest, "--replica_groups.groups", str(args.groups)]
        check = subprocess.run(
            [
                sys.executable,
                "-m",
                "train",
                "--check",
                "--world-size",
                str(args.nproc),
                "--config",
                args.config,
                *overrides,
            ],
            cwd=os.getcwd(),
        )
        if check.returncode:
            return check.returncode
        from train.config import load_config
        from train.runtime import check_fresh, prepare_run_dir

        run = load_config(args.config, overrides)
        check_fresh(run, args.fresh, args.overwrite)
        lease = RunLease(run.run_dir)
        with lease.held(on_lost=lambda holder: os._exit(ExitCode.USER_ERROR)):
            if args.fresh:  # once, here: a group restarted later must resume, never start over
                start_over(run.run_dir)
            prepare_run_dir(run)  # once for all groups (they skip it)
            return supervise(args, overrides, run.run_dir, lease, run.min_replica_groups)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
