"""`python -m dataloader.prepare`: raw text -> tokenizer + token shards + manifests; the
command (its options, from the command line and the SLURM array's environment) over the
package's driver, `dataloader.prepare.prepare` (why it is built this way: the package's
docstring).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common.io import ArgumentParser, run_cli
from common.launch_env import env_int
from dataloader.manifest import ON_EXHAUSTED_CHOICES
from dataloader.prepare import prepare
from dataloader.prepare.plan import DEFAULT_SHARD_CHARS, PrepareConfig

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> PrepareConfig:
    parser = ArgumentParser(prog="python -m dataloader.prepare", description=__doc__.split("\n")[0])
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
        default=env_int("SLURM_ARRAY_TASK_COUNT", 1),
        help="split the work into N tasks (default: $SLURM_ARRAY_TASK_COUNT, else 1)",
    )
    dist.add_argument(
        "--task-index",
        type=int,
        default=env_int("SLURM_ARRAY_TASK_ID", None),
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
    if args.merge or args.tokenizer_only:  # neither is a task of the array
        args.task_index = None
    elif args.num_tasks > 1 and args.task_index is None:
        raise ValueError(
            f"--num-tasks {args.num_tasks}: say which task this is with --task-index I "
            "(or run inside a SLURM array job), or pass --merge once all tasks are done"
        )
    # every dest is a PrepareConfig field
    return PrepareConfig(**vars(args))


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: prepare(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
