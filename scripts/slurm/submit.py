#!/usr/bin/env python3
"""Submit a training run to SLURM: `scripts/slurm/train.sbatch` with the job shape filled in.

Why a helper instead of bare `sbatch`: the batch script needs the run folder (for its
logs, the restart log and the preemption marker) before the job starts, and the folder
lives in the TOML (`[job] folder`, possibly overridden on the command line). Resolving it
here with `train.config.load_config` also checks the config, the world size and the data
(`train.preflight`, torch-free) at submit time, so a typo fails in a second on the login
node instead of after hours in the queue.

Job shape by default: whole nodes (`--exclusive`), all of each node's memory (`--mem=0`)
and every CPU of the node for its torchrun (train.sbatch hands `SLURM_CPUS_ON_NODE` to
srun); `--no-exclusive` shares nodes and then needs `--cpus-per-task` and `--mem`.

    scripts/slurm/submit.py [launcher flags] CONFIG [--section.key value | --set k=v]... [--fresh [--overwrite]]

Every launcher flag has an environment default (listed in `--help`), so a cluster profile
can be a few `export`s. `--dry-print` prints the sbatch command (with the exported
variables) instead of submitting.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sbatch_args.py, next to this file
from sbatch_args import (  # noqa: E402
    add_job_options,
    check_job_options,
    env_int,
    env_option,
    in_venv,
    sbatch_command,
)

REPO = Path(__file__).resolve().parents[2]
from common.io import ArgumentParser, cli_error  # noqa: E402

SBATCH_SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"
REPLICA_SBATCH_SCRIPT = REPO / "scripts" / "slurm" / "replica_groups.sbatch"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="scripts/slurm/submit.py",
        description="Submit scripts/slurm/train.sbatch; unknown arguments after CONFIG go to train.",
        allow_abbrev=False,
    )
    parser.add_argument("config", help="run TOML, e.g. configs/debug.toml")
    env_option(parser, "--nodes", "TRAIN_NODES", 1, "default 1", int)
    env_option(parser, "--gpus-per-node", "TRAIN_GPUS_PER_NODE", 8, "GPUs requested per node "
               "(--gres=gpu:N); 0 for CPU nodes. Default 8", int)  # fmt: skip
    env_option(parser, "--gpu", "TRAIN_GPU", help="the GPU kind, a row of the planner "
               "(train/plan/gpu_specs.py): a layout whose model state exceeds it is refused. "
               "Default h100 with --gpus-per-node")  # fmt: skip
    env_option(parser, "--nproc-per-node", "TRAIN_NPROC_PER_NODE", 0, "training processes per "
               "node; default: --gpus-per-node, or 2 when that is 0", int)  # fmt: skip
    add_job_options(
        parser,
        time="04:00:00",
        cpus_env="TRAIN_CPUS_PER_NODE",
        cpus_help="CPUs for each node's torchrun, its workers, loader threads and compile "
        "workers; default: every CPU of the node (--exclusive), required with --no-exclusive",
        mem_env="TRAIN_MEM",
        mem_default="0",
        mem_help="memory per node (sbatch --mem); default 0: all of each node's memory",
    )
    parser.add_argument(
        "--exclusive",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("TRAIN_EXCLUSIVE", "1") != "0",
        help="[TRAIN_EXCLUSIVE=1|0] whole nodes: no other job's processes compete for the "
        "node's CPUs, memory and links. Default on",
    )
    env_option(parser, "--run-dir", "TRAIN_RUN_DIR", help="run folder; overrides [job] folder "
               "of the config")  # fmt: skip
    parser.add_argument(
        "--signal-seconds",
        type=int,
        default=env_int("TRAIN_SIGNAL_SECONDS", 0) or None,
        help="[TRAIN_SIGNAL_SECONDS] USR1 this long before the time limit: time to finish a step and checkpoint, the backstop of the run's own end-in-time stop (train/reliability/time_limit.py). Default: one step and one save of the plan's RUN/budgets.json x 3, the save at checkpoint.storage_gb_per_s or the rate RUN/save_rate.json measured, at least 300 (train/reliability/budgets.py); a value shorter than that is refused",
    )
    env_option(parser, "--max-crashes", "TRAIN_MAX_CRASHES", 3, "crashes within the window "
               "before requeueing stops. Default 3", int)  # fmt: skip
    env_option(parser, "--crash-window", "TRAIN_CRASH_WINDOW_S", 3600, "seconds. Default 3600", int)
    env_option(parser, "--replica-groups", "TRAIN_REPLICA_GROUPS", 0, "torchft replica groups "
               "(docs/reliability.md): N groups of --nodes/N nodes each in one allocation that "
               "survives a lost node (--no-kill); a dead group restarts on its own nodes. "
               "Default 0: off", int)  # fmt: skip
    env_option(parser, "--port", "TRAIN_RDZV_PORT", 0, "rendezvous port on the first node "
               "(checked free when the job starts); default: a free port outside the ephemeral "
               "range, picked there", int)  # fmt: skip
    return parser


SIGNAL_FLOOR_S = 300  # the signal lead without a plan (and the least one with it)


def check_run(
    config: str, overrides: list[str], world_size: int, nproc: int, data: bool, gpu: str | None
):
    """Load and check the config for `world_size` ranks, `nproc` a node (and, when `data`,
    its data and that no live run holds the run folder), as `python -m train --check` does
    in the job, and that a rank's model state fits a `gpu`; the run folder, absolute (the
    job may start elsewhere), and the run's time budgets."""
    from train.config import load_config
    from train.launch_rules import check_launch, check_tp_in_node
    from train.preflight import check_gpu_memory, preflight
    from train.reliability.budgets import load_budgets
    from train.runtime import check_run_dir_free

    run = load_config(config, overrides)
    check_gpu_memory(run, check_launch(run, world_size), gpu)
    check_tp_in_node(run.parallelism.tp, nproc, world_size)
    if data:
        preflight(run, world_size)
        check_run_dir_free(run)  # a live run on the folder: refused before it is queued
    return run.run_dir.resolve(), load_budgets(run, world_size)


def slurm_seconds(time: str) -> int | None:
    """SLURM's --time ("MM", "MM:SS", "HH:MM:SS", "D-HH[:MM[:SS]]") in seconds; None for
    "infinite" or a form not listed."""
    days, _, rest = time.rpartition("-")
    parts = rest.split(":")
    if not all(p.isdigit() for p in parts) or (days and not days.isdigit()) or len(parts) > 3:
        return None
    numbers = [int(p) for p in parts]
    if days:  # D-HH, D-HH:MM, D-HH:MM:SS
        h, m, sec = (numbers + [0, 0])[:3]
    else:  # MM, MM:SS, HH:MM:SS
        h, m, sec = [0, *numbers, 0][:3] if len(numbers) == 1 else [0, *numbers][-3:]
    return int(days or 0) * 86400 + h * 3600 + m * 60 + sec


def signal_lead(args: argparse.Namespace, budgets) -> int:
    """SLURM's USR1 lead: one step and one save of the plan (train/reliability/budgets.py), at least
    SIGNAL_FLOOR_S; a --signal-seconds shorter than the plan's is refused. Warns when the
    time limit cannot fit the first step and one save."""
    planned = budgets.signal_lead_s()
    if args.signal_seconds is not None and planned and args.signal_seconds < planned:
        raise ValueError(
            f"--signal-seconds {args.signal_seconds} is shorter than one step and one save "
            f"of this run's plan ({planned:.0f} s, RUN/budgets.json): the preemption "
            f"checkpoint would be cut off; pass at least {planned:.0f}, or leave it out"
        )
    lead = args.signal_seconds or max(SIGNAL_FLOOR_S, planned or 0)
    limit = slurm_seconds(args.time)
    p = budgets.planned
    if p is not None and limit is not None:
        first = p.compile_s + max(p.step_s.values())
        if limit < lead + first:
            print(
                f"warning: --time {args.time} cannot fit the first step ({first:.0f} s with "
                f"compile) and one save before the USR1 lead ({lead} s): the job would "
                "requeue without ever saving; give it a longer --time",
                file=sys.stderr,
            )
    return lead


def build_command(args: argparse.Namespace, train_args: list[str]) -> tuple[list[str], Path]:
    """The sbatch argv (exporting TRAIN_* to the batch script) and the run folder.

    Checks the config and the world size; the data too unless --dry-print (which only
    shows the command, possibly before the data is prepared)."""
    if not Path(args.config).is_file():
        raise ValueError(
            f"config file {args.config} not found (give a path like configs/debug.toml)"
        )
    for name in ("nodes", "signal_seconds", "max_crashes", "crash_window"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    if args.gpus_per_node < 0 or args.nproc_per_node < 0:
        raise ValueError("--gpus-per-node and --nproc-per-node must not be negative")
    if not 0 <= args.port < 65536:  # else refused only on the cluster, by train.sbatch
        raise ValueError(f"--port {args.port} is not a port number (1-65535; 0: pick a free one)")
    if 0 < args.gpus_per_node < args.nproc_per_node:  # a rank per GPU: the rest have none
        raise ValueError(
            f"--nproc-per-node {args.nproc_per_node} is more than --gpus-per-node "
            f"{args.gpus_per_node}: each training process needs a GPU of its own; give "
            f"--nproc-per-node {args.gpus_per_node} or less, or leave it out"
        )
    check_job_options(args)
    if not args.exclusive and (not args.cpus_per_task or args.mem in (None, "0")):
        raise ValueError(
            "--no-exclusive shares the nodes: give --cpus-per-task N and --mem SIZE (e.g. "
            "--cpus-per-task 64 --mem 512G), or keep --exclusive"
        )
    train_flags = [a for a in train_args if a in ("--fresh", "--overwrite")]
    overrides = [a for a in train_args if a not in ("--fresh", "--overwrite")]
    if args.run_dir:
        # train must write where the batch script looks
        overrides += ["--job.folder", str(Path(args.run_dir).resolve())]
    nproc = args.nproc_per_node or args.gpus_per_node or 2
    world = args.nodes * nproc
    if args.replica_groups:  # a launch's world is one group's
        if args.nodes % args.replica_groups:
            raise ValueError(
                f"--nodes {args.nodes} is not a multiple of --replica-groups "
                f"{args.replica_groups}: every group gets --nodes/--replica-groups nodes"
            )
        overrides += ["--replica_groups.groups", str(args.replica_groups)]
        world = args.nodes // args.replica_groups * nproc
    gpu = args.gpu or ("h100" if args.gpus_per_node else None)
    run_dir, budgets = check_run(args.config, overrides, world, nproc, not args.dry_print, gpu)

    extra = [f"--nodes={args.nodes}", f"--signal=B:USR1@{signal_lead(args, budgets)}"]
    if args.gpus_per_node:
        extra.append(f"--gres=gpu:{args.gpus_per_node}")
    exported = {
        "TRAIN_REPO": str(REPO),
        "TRAIN_RUN_DIR": str(run_dir),
        "TRAIN_NPROC_PER_NODE": str(nproc),
        "TRAIN_MAX_CRASHES": str(args.max_crashes),
        "TRAIN_CRASH_WINDOW_S": str(args.crash_window),
    }
    if args.port:
        exported["TRAIN_RDZV_PORT"] = str(args.port)
    if gpu:  # the job's --check and its ranks check the same GPU (train/preflight.py)
        exported["TRAIN_GPU"] = gpu
    script = SBATCH_SCRIPT
    if args.replica_groups:  # the Lighthouse and the groups' supervisor on the batch host
        exported["TRAIN_REPLICA_GROUPS"] = str(args.replica_groups)
        exported["TRAIN_GROUP_NODES"] = str(args.nodes // args.replica_groups)
        extra.append("--no-kill")
        script = REPLICA_SBATCH_SCRIPT
    job = {
        "job_name": args.job_name or run_dir.name,
        "output": run_dir / "slurm" / "job%j-batch.log",
    }
    sbatch = sbatch_command(args, **job, export=exported, extra=extra, exclusive=args.exclusive)
    sbatch += [str(script), str(Path(args.config).resolve()), *overrides, *train_flags]
    return sbatch, run_dir


def main(argv: list[str] | None = None) -> int:
    in_venv(__file__, argv)
    try:
        parser = build_parser()  # its defaults read the environment (env_int)
        args, train_args = parser.parse_known_args(argv)
        sbatch, run_dir = build_command(args, train_args)
    except ValueError as e:  # our user errors, including train.config.ConfigError
        return cli_error(e)
    if args.dry_print:
        print(shlex.join(sbatch))
        return 0
    # sbatch cannot create the folder of its --output file
    (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(sbatch, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"error: sbatch failed: {proc.stderr.strip()}", file=sys.stderr)
        return proc.returncode
    job_id = proc.stdout.strip().split(";")[0]
    print(job_id)
    print(f"[submit] job {job_id}: logs and restart log in {run_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
