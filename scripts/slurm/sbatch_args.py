"""The sbatch options and command line shared by submit.py and submit_prepare.py.

Why one builder: both helpers ask for the same job shape (time, partition, account, CPUs,
memory, name, log file, exported variables) and used to spell it twice. Every option
has an environment default named in `--help`, so a cluster profile is a few `export`s.
Imported by the two scripts from their own folder; stdlib only.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

_MEMORY = re.compile(r"^\d+[KMGT]?$")


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def add_job_options(
    parser: argparse.ArgumentParser,
    *,
    time: str,
    cpus_env: str,
    cpus_help: str,
    mem_env: str,
    mem_default: str | None,
    mem_help: str,
) -> None:
    """--time, --partition, --account, --job-name, --cpus-per-task, --mem, --dry-print."""
    env = os.environ.get
    parser.add_argument(
        "--time", default=env("SBATCH_TIMELIMIT", time), help=f"[SBATCH_TIMELIMIT] default {time}"
    )
    parser.add_argument(
        "--partition",
        default=env("SBATCH_PARTITION"),
        help="[SBATCH_PARTITION] default: the cluster's",
    )
    parser.add_argument("--account", default=env("SBATCH_ACCOUNT"), help="[SBATCH_ACCOUNT]")
    parser.add_argument("--job-name", default=env("SBATCH_JOB_NAME"), help="[SBATCH_JOB_NAME]")
    parser.add_argument(
        "--cpus-per-task", type=int, default=env_int(cpus_env, 0), help=f"[{cpus_env}] {cpus_help}"
    )
    parser.add_argument("--mem", default=env(mem_env, mem_default), help=f"[{mem_env}] {mem_help}")
    parser.add_argument(
        "--dry-print", action="store_true", help="print the sbatch command(s), submit nothing"
    )


def check_job_options(args: argparse.Namespace) -> None:
    """ValueError naming the flag, for what sbatch would refuse less clearly."""
    if args.cpus_per_task < 0:
        raise ValueError(f"--cpus-per-task must not be negative, got {args.cpus_per_task}")
    if args.mem is not None and not _MEMORY.match(args.mem):
        raise ValueError(
            f"--mem {args.mem!r}: give a size like 512G, 64000M or 0 (all of each node's memory)"
        )


def sbatch_command(
    args: argparse.Namespace,
    *,
    job_name: str,
    output: Path,
    export: dict[str, str],
    extra: list[str] | tuple[str, ...] = (),
    exclusive: bool = False,
) -> list[str]:
    """`sbatch --parsable ...` up to (not including) the batch script and its arguments.

    The job runs in the current directory, so relative paths mean the same in every job."""
    cmd = [
        "sbatch",
        "--parsable",
        f"--time={args.time}",
        f"--job-name={job_name}",
        f"--chdir={Path.cwd()}",
        f"--output={output}",
    ]
    if exclusive:
        cmd.append("--exclusive")
    if args.cpus_per_task:
        cmd.append(f"--cpus-per-task={args.cpus_per_task}")
    if args.mem is not None:
        cmd.append(f"--mem={args.mem}")
    if args.partition:
        cmd.append(f"--partition={args.partition}")
    if args.account:
        cmd.append(f"--account={args.account}")
    cmd += extra
    cmd.append("--export=ALL," + ",".join(f"{k}={v}" for k, v in export.items()))
    return cmd
