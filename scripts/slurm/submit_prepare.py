#!/usr/bin/env python3
"""Submit a multi-machine `dataloader.prepare` to SLURM: an array job plus a dependent merge.

Why a helper instead of bare `sbatch`: the stages must be chained (tokenizer training
before the tasks when `--train-tokenizer` is given, the merge after every task) and a
resubmission should run only the tasks that have not finished. This script reads the
tasks' completion markers (DATA/prepare_tasks/task-I-of-N.json, checked against the
current options and input files), submits `scripts/slurm/prepare.sbatch` as an array of
exactly the unfinished tasks, and a merge job with `afterok` on that array. A failed or
cancelled task makes SLURM drop the merge (`--kill-on-invalid-dep=yes`); run this script
again with the same arguments and only the missing tasks are resubmitted.

    scripts/slurm/submit_prepare.py --num-tasks N [sbatch flags] PREPARE_ARGS...

PREPARE_ARGS are `python -m dataloader.prepare`'s (`--input`, `--out`, `--tokenizer` or
`--train-tokenizer`, ...); the job runs in the current directory, so relative paths
mean the same in every task. Prints one JSON line: the job ids and the tasks submitted.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from itertools import groupby
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sbatch_args.py, next to this file
from sbatch_args import add_job_options, check_job_options, in_venv, sbatch_command  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
from common.io import ArgumentParser, check_folder_writable, cli_error  # noqa: E402

SBATCH_SCRIPT = REPO / "scripts" / "slurm" / "prepare.sbatch"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="scripts/slurm/submit_prepare.py",
        description="Submit dataloader.prepare as a SLURM array job and a dependent merge; "
        "unknown arguments go to dataloader.prepare.",
        allow_abbrev=False,
    )
    parser.add_argument("--num-tasks", type=int, required=True, help="array size N")
    parser.add_argument(
        "--max-parallel",
        type=int,
        default=0,
        help="at most this many tasks at once (--array=...%%K)",
    )
    add_job_options(
        parser,
        time="24:00:00",
        cpus_env="PREPARE_CPUS_PER_TASK",
        cpus_help="cores per task (= tokenizing processes); default: SLURM's",
        mem_env="PREPARE_MEM",
        mem_default=None,
        mem_help="memory per task (sbatch --mem); default: SLURM's",
    )
    return parser


def array_spec(tasks: list[int], max_parallel: int) -> str:
    """`0-3` / `1,3,7` (runs collapsed), plus `%K` when the parallelism is capped."""
    # consecutive tasks share task - position: each such group is one run
    runs = [[t for _, t in g] for _, g in groupby(enumerate(tasks), lambda p: p[1] - p[0])]
    parts = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    return ",".join(parts) + (f"%{max_parallel}" if max_parallel else "")


def build_commands(
    args: argparse.Namespace, prepare_args: list[str]
) -> tuple[list[tuple[str, list[str]]], list[int], Path]:
    """(stage, sbatch argv) for each job to submit, in order; `{tokenizer}` / `{array}` in
    a --dependency are replaced by the job ids as they are known."""
    from dataloader.corpus import expand_inputs
    from dataloader.prepare.__main__ import parse_args
    from dataloader.prepare.plan import check_config, pending_tasks, stamped_tokenizer

    if args.num_tasks < 1:
        raise ValueError(f"--num-tasks must be at least 1, got {args.num_tasks}")
    args_with_n = [*prepare_args, "--num-tasks", str(args.num_tasks)]
    config = parse_args([*args_with_n, "--merge"])
    check_config(config)
    out = Path(config.out).resolve()
    expand_inputs(config.inputs)  # a wrong --input: refused here, not in every array task
    check_folder_writable(out, "--out")
    needs_tokenizer = (
        config.train_tokenizer is not None and stamped_tokenizer(config, out / "tokenizer") is None
    )
    pending = list(range(args.num_tasks)) if needs_tokenizer else pending_tasks(config)
    name = args.job_name or f"prepare-{out.name}"
    logs = out / "prepare_logs"
    check_job_options(args)

    def command(stage: str, output: str, extra: list[str]) -> list[str]:
        job = {"job_name": f"{name}-{stage}", "output": logs / output, "extra": extra}
        sbatch = sbatch_command(args, **job, export={"PREPARE_REPO": str(REPO)})
        return [*sbatch, str(SBATCH_SCRIPT), stage, *args_with_n]

    jobs = []
    if needs_tokenizer:
        jobs.append(("tokenizer", command("tokenizer", "%x-%j.log", [])))
    if pending:
        dep = ["--dependency=afterok:{tokenizer}", "--kill-on-invalid-dep=yes"]
        array = [f"--array={array_spec(pending, args.max_parallel)}"]
        jobs.append(
            ("array", command("task", "%x-%A_%a.log", array + (dep if needs_tokenizer else [])))
        )
    dep = ["--dependency=afterok:{array}", "--kill-on-invalid-dep=yes"]
    jobs.append(("merge", command("merge", "%x-%j.log", dep if pending else [])))
    return jobs, pending, logs


def main(argv: list[str] | None = None) -> int:
    in_venv(__file__, argv)
    try:
        parser = build_parser()  # its defaults read the environment (env_int)
        args, prepare_args = parser.parse_known_args(argv)
        jobs, pending, logs = build_commands(args, prepare_args)
    except ValueError as e:
        return cli_error(e)
    ids: dict[str, str | None] = {"tokenizer": None, "array": None, "merge": None}
    for stage, cmd in jobs:
        cmd = [c.format(**ids) if c.startswith("--dependency=") else c for c in cmd]
        if args.dry_print:
            print(shlex.join(cmd))
            ids[stage] = f"<{stage}>"
            continue
        logs.mkdir(parents=True, exist_ok=True)  # sbatch cannot create its --output folder
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"error: sbatch ({stage}) failed: {proc.stderr.strip()}", file=sys.stderr)
            return proc.returncode
        ids[stage] = proc.stdout.strip().split(";")[0]
    if not args.dry_print:
        print(json.dumps({**ids, "tasks": pending}))
        print(
            f"[submit_prepare] tasks {pending or 'none (all complete)'} of {args.num_tasks}; "
            f"logs in {logs}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
