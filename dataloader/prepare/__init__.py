"""`python -m dataloader.prepare`: raw text -> tokenizer + token shards + manifests.

This package's `prepare` is the driver and `dataloader.prepare.__main__` the command; the
work lives in three rooms: the plan (`dataloader.prepare.plan`: options, work units,
tokenizer, task markers), the workers (`dataloader.prepare.shards`: one task's units
tokenized into shards) and the merge (`dataloader.prepare.merge`: manifests).
`PrepareConfig` and `prepare` are importable from here.

Why it is built this way:
- The loader must never repeat or skip a sample, so its input must be immutable
  and self-describing: every file is checksummed in a manifest written last.
- A corpus of trillions of tokens takes days on one machine, so the work is cut into
  *work units* that many machines can do independently (a SLURM job array, see
  `scripts/slurm/submit_prepare.py`), then a cheap merge writes the manifests. A work
  unit is a run of consecutive input files of about `--shard-chars` bytes on disk
  (found with `stat`, no text read); unit `u` goes to task `u % num_tasks`. Shards are
  cut per unit and per split, so the shard layout, and with it every file and the
  manifest's `content_sha256`, is a function of (inputs, tokenizer, options) alone: one
  process or 1,000 array tasks write the same bytes.
- Preparing takes hours, so it resumes at two levels. Each chunk of a unit becomes one
  shard file written under a temp name and `os.replace`d, then a sidecar
  `UUUUUU-CCCCC.json` (the chunk's input hash, tokenizer hash, size and sha256) marks
  it finished; a re-run keeps every shard whose sidecar still matches. A finished task
  leaves `DATA/prepare_tasks/task-IIIII-of-NNNNN.json` (its options, input files and
  shard list); a re-run of a finished task returns at once. A crash never leaves a
  half-written shard that looks whole.
- Chunks are tokenized in a process pool (one process per core, tokenizers' own
  Rayon threads pinned to 1 per process so the cores are not oversubscribed).
- Nothing is dropped silently: empty documents and replaced non-UTF-8 bytes are
  counted, printed and recorded in the manifest.
"""

from __future__ import annotations

from dataloader.manifest import Manifest
from dataloader.prepare.merge import merge
from dataloader.prepare.plan import (
    PrepareConfig,
    check_config,
    plan_units,
    resolve_tokenizer,
    train_tokenizer,
)
from dataloader.prepare.shards import run_task

__all__ = ["PrepareConfig", "prepare"]


def prepare(config: PrepareConfig) -> dict[str, Manifest]:
    """One machine (default): every task, then the merge. With `task_index`: that task
    only. With `merge`: the merge only. With `tokenizer_only`: train the tokenizer only."""
    check_config(config)
    one_machine = config.task_index is None and not config.merge and not config.tokenizer_only
    if config.train_tokenizer is not None and (one_machine or config.tokenizer_only):
        train_tokenizer(config)
        if config.tokenizer_only:
            return {}
    tok = resolve_tokenizer(config)
    if config.merge:
        return merge(config, tok)
    plan = plan_units(config.inputs, config.shard_chars)
    if config.task_index is not None:
        run_task(config, config.task_index, tok, plan)
        return {}
    for index in range(config.num_tasks):
        run_task(config, index, tok, plan)
    return merge(config, tok)
