"""`python -m dataloader.prepare`: raw text -> tokenizer + token shards + manifests; the
command (its options, from the command line and the SLURM array's environment) over the
package's driver, `dataloader.prepare.prepare` (why it is built this way: the package's
docstring).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common.io import run_cli
from dataloader.manifest import ON_EXHAUSTED_CHOICES
from dataloader.prepare import prepare
from dataloader.prepare.plan import DEFAULT_SHARD_CHARS, PrepareConfig

__all__ = ["main", "parse_args"]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def parse_args(argv: list[str] | None = None) -> PrepareConfig:
    parser = argparse.ArgumentParser(
        prog="python -m dataloader.prepare", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--input",
        action="append",
        required=True,
        dest="inputs",
        help="jsonl[.gz] / parquet / text file, directory, save_to_disk dataset, or 'shakespeare'",
    )
    parser.add_argument("--out", required=True, type=Path, help="output DATA directory")
    tok = parser.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="directory with a Hugging Face tokenizer.json")
    tok.add_argument(
        "--train-tokenizer", type=int, metavar="VOCAB", help="train a byte-level BPE of this size"
    )
    parser.add_argument("--text-field", default="text")
    parser.add_argument(
        "--doc-separator",
        metavar="REGEX",
        help="split text files where this multiline regex matches",
    )
    parser.add_argument("--val-fraction", type=float, default=0.0)
    parser.add_argument("--on-exhausted", choices=ON_EXHAUSTED_CHOICES, default="repeat")
    parser.add_argument(
        "--shard-chars", type=int, default=DEFAULT_SHARD_CHARS, help="text characters per shard"
    )
    parser.add_argument("--num-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--verify", action="store_true", help="re-hash every written file at the end"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    dist = parser.add_argument_group("distributed prepare (see docs/dataloader.md)")
    dist.add_argument(
        "--num-tasks",
        type=int,
        help="split the work into N tasks (default: $SLURM_ARRAY_TASK_COUNT, else 1)",
    )
    dist.add_argument(
        "--task-index",
        type=int,
        help="run only task I, then stop (default: $SLURM_ARRAY_TASK_ID; "
        "without either, run every task here and merge)",
    )
    stage = dist.add_mutually_exclusive_group()
    stage.add_argument(
        "--merge", action="store_true", help="after all N tasks: write the split manifests"
    )
    stage.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="with --train-tokenizer: train DATA/tokenizer and stop (before the tasks)",
    )
    args = parser.parse_args(argv)
    num_tasks = args.num_tasks
    if num_tasks is None:
        num_tasks = _env_int("SLURM_ARRAY_TASK_COUNT") or 1
    one_stage = args.merge or args.tokenizer_only  # neither is a task of the array
    task_index = None if one_stage else args.task_index
    if task_index is None and not one_stage:
        task_index = _env_int("SLURM_ARRAY_TASK_ID")
    if num_tasks > 1 and task_index is None and not one_stage:
        raise ValueError(
            f"--num-tasks {num_tasks}: say which task this is with --task-index I "
            "(or run inside a SLURM array job), or pass --merge once all tasks are done"
        )
    # every dest is a PrepareConfig field
    return PrepareConfig(**vars(args) | {"num_tasks": num_tasks, "task_index": task_index})


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: prepare(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
