"""The sbatch options and command line shared by submit.py and submit_prepare.py.

Why one builder: both helpers ask for the same job shape (time, partition, account, CPUs,
memory, name, log file, exported variables) and used to spell it twice. Every option
has an environment default named in `--help`, so a cluster profile is a few `export`s.
Imported by the two scripts from their own folder; stdlib and common/ only.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # common/ (stdlib only)
from common.launch_env import env_int  # noqa: E402

_MEMORY = re.compile(r"^\d+[KMGT]?$")


def in_venv(script: str, argv: list[str] | None) -> None:
    """Run `script` again in the project's venv unless this is it: resolving a config or
    reading the prepare markers imports train and dataloader (dacite, numpy, tokenizers)."""
    venv = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
    if venv.exists() and Path(sys.prefix).resolve() != venv.parents[1].resolve():
        os.execv(venv, [str(venv), script, *(sys.argv[1:] if argv is None else argv)])


def env_option(parser: argparse.ArgumentParser, flag: str, env: str, default=None,
               help: str = "", type=str) -> None:  # fmt: skip
    """`flag`, its default taken from the environment variable `env`, named in its help."""
    value = env_int(env, default) if type is int else os.environ.get(env, default)
    parser.add_argument(flag, type=type, default=value, help=f"[{env}] {help}")


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
    env_option(parser, "--time", "SBATCH_TIMELIMIT", time, f"default {time}")
    env_option(parser, "--partition", "SBATCH_PARTITION", help="default: the cluster's")
    env_option(parser, "--account", "SBATCH_ACCOUNT")
    env_option(parser, "--job-name", "SBATCH_JOB_NAME")
    env_option(parser, "--cpus-per-task", cpus_env, 0, cpus_help, int)
    env_option(parser, "--mem", mem_env, mem_default, mem_help)
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
    shape = {"time": args.time, "job-name": job_name, "chdir": Path.cwd(), "output": output,
             "exclusive": exclusive, "cpus-per-task": args.cpus_per_task, "mem": args.mem,
             "partition": args.partition, "account": args.account}  # fmt: skip
    # unset (None, 0, False) leaves SLURM's default; --exclusive takes no value
    cmd = ["sbatch", "--parsable"]
    cmd += [f"--{k}" if v is True else f"--{k}={v}" for k, v in shape.items() if v]
    cmd += extra
    cmd.append("--export=ALL," + ",".join(f"{k}={v}" for k, v in export.items()))
    return cmd
