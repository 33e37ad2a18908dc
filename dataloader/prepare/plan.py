"""`dataloader.prepare`'s plan: what is prepared, by which task, with which tokenizer.

Everything here is decided before a token is written, from the inputs and options alone
(never from the task count), so one process or 1,000 array tasks agree: the options
(`PrepareConfig`, checked by `check_config`), the work units (consecutive input files of
about `--shard-chars` bytes on disk; unit u goes to task u % num_tasks), the tokenizer
every task encodes with, and each task's marker (`DATA/prepare_tasks/task-I-of-N.json`),
which says whether a task is done for these inputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.io import write_json_atomic
from dataloader.corpus import Document, InputFile, expand_inputs, iter_documents, unit_size
from dataloader.manifest import FORMAT_VERSION, ON_EXHAUSTED_CHOICES, dtype_for_vocab
from dataloader.tokenizer import (
    install_tokenizer,
    load_special_ids,
    load_tokenizer,
    sha256_file,
    train_bpe,
)

DEFAULT_SHARD_CHARS = 64 << 20  # text characters per shard (~16M tokens)
TASKS_DIR = "prepare_tasks"
SPLITS = ("train", "val")


@dataclass
class PrepareConfig:
    inputs: list[str]
    out: Path
    tokenizer: str | None = None
    train_tokenizer: int | None = None
    text_field: str = "text"
    doc_separator: str | None = None
    val_fraction: float = 0.0
    on_exhausted: str = "repeat"
    shard_chars: int = DEFAULT_SHARD_CHARS
    num_workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    verify: bool = False
    progress: bool = True
    # Distributed prepare: task `task_index` of `num_tasks` does units u with
    # u % num_tasks == task_index and stops; `merge` writes the manifests afterwards.
    # task_index None and merge False: every task here, then the merge (one machine).
    num_tasks: int = 1
    task_index: int | None = None
    merge: bool = False
    tokenizer_only: bool = False


@dataclass
class SplitStats:
    num_documents: int = 0
    num_empty_documents: int = 0
    num_replaced_chars: int = 0
    num_documents_with_replacements: int = 0
    num_shards: int = 0
    num_shards_kept: int = 0


# What `is_val` hashes; recorded in every task marker, so the merge refuses tasks that split
# by another rule (before 2026-11-25 the path as given, which moved with the corpus).
VAL_SPLIT_KEY = "split_name,index"


def is_val(doc: Document, val_fraction: float) -> bool:
    """Deterministic split by a hash of (`Document.split_name`, document index): the same
    documents go to val wherever the corpus lives."""
    if val_fraction <= 0:
        return False
    digest = hashlib.sha256(f"{doc.split_name}\0{doc.index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


# ---- planning ----------------------------------------------------------------------
def plan_units(inputs: list[str], target_bytes: int) -> list[list[InputFile]]:
    """Consecutive input files grouped into work units of >= `target_bytes` on disk
    (the last may be smaller). Depends only on the inputs, never on the task count."""
    units: list[list[InputFile]] = []
    current: list[InputFile] = []
    size = 0
    for item in expand_inputs(inputs):
        current.append(item)
        size += unit_size(item[1])
        if size >= target_bytes:
            units.append(current)
            current, size = [], 0
    if current:
        units.append(current)
    return units


def task_of_unit(unit: int, num_tasks: int) -> int:
    return unit % num_tasks


def _file_ids(unit: list[InputFile]) -> list[list]:
    """(path, size, mtime_ns) of a unit's files: a finished task is redone if they change."""
    return [[str(item.path), unit_size(item.path), item.path.stat().st_mtime_ns] for item in unit]


def marker_path(out: Path, index: int, num_tasks: int) -> Path:
    return Path(out) / TASKS_DIR / f"task-{index:05d}-of-{num_tasks:05d}.json"


# ---- tokenizer -----------------------------------------------------------------------
@dataclass
class TokenizerInfo:
    path: Path  # tokenizer.json
    source_dir: Path  # the directory it was read from
    sha256: str
    vocab_size: int
    bos_id: int
    eos_id: int
    dtype: str


def _tokenizer_stamp(config: PrepareConfig) -> dict:
    return {
        "vocab_size": config.train_tokenizer,
        "inputs": config.inputs,
        "text_field": config.text_field,
        "doc_separator": config.doc_separator,
    }


def stamped_tokenizer(config: PrepareConfig, tok_dir: Path) -> Path | None:
    """DATA/tokenizer/tokenizer.json if it was trained from these inputs, else None."""
    stamp_path = tok_dir / "trained_from.json"
    if (tok_dir / "tokenizer.json").is_file() and stamp_path.is_file():
        if json.loads(stamp_path.read_text()) == _tokenizer_stamp(config):
            return tok_dir / "tokenizer.json"
    return None


def train_tokenizer(config: PrepareConfig) -> None:
    """Train (or, on resume with the same inputs, reuse) the BPE tokenizer."""
    tok_dir = Path(config.out) / "tokenizer"
    if stamped_tokenizer(config, tok_dir) is not None:
        print(f"reusing tokenizer trained earlier in {tok_dir}", file=sys.stderr)
        return
    texts = (
        d.text
        for d in iter_documents(config.inputs, config.text_field, config.doc_separator)
        if d.text.strip()
    )
    tokenizer = train_bpe(texts, config.train_tokenizer)
    install_tokenizer(None, tokenizer, tok_dir)
    write_json_atomic(tok_dir / "trained_from.json", _tokenizer_stamp(config))


def resolve_tokenizer(config: PrepareConfig) -> TokenizerInfo:
    """The tokenizer every task encodes with, read in place (tasks never write it: N
    tasks starting at once would race on DATA/tokenizer; the merge installs it)."""
    if config.train_tokenizer is not None:
        tok_dir = Path(config.out) / "tokenizer"
        path = stamped_tokenizer(config, tok_dir)
        if path is None:
            raise ValueError(
                f"--train-tokenizer {config.train_tokenizer}: no tokenizer trained from these "
                f"inputs in {tok_dir}. With --num-tasks/--task-index or --merge it must be "
                "trained once before the tasks start, so all of them use the same one: run "
                "the same command with --tokenizer-only first (scripts/slurm/submit_prepare.py "
                "does), or pass --tokenizer DIR"
            )
    else:
        tok_dir = Path(config.tokenizer)
        path = tok_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"--tokenizer {tok_dir}: no tokenizer.json there; pass a Hugging Face tokenizer "
                "directory or use --train-tokenizer VOCAB"
            )
    config_path = tok_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text()) if config_path.is_file() else None
    bos_id, eos_id, _, _ = load_special_ids(path, tok_config)
    vocab_size = load_tokenizer(path).get_vocab_size(with_added_tokens=True)
    return TokenizerInfo(
        path, tok_dir, sha256_file(path), vocab_size, bos_id, eos_id, dtype_for_vocab(vocab_size)
    )


# ---- one task ----------------------------------------------------------------------
def task_options(config: PrepareConfig, tok: TokenizerInfo, num_units: int) -> dict:
    """What every task of one prepare must agree on (the merge checks it)."""
    return {
        "format_version": FORMAT_VERSION,
        "inputs": list(config.inputs),
        "text_field": config.text_field,
        "doc_separator": config.doc_separator,
        "val_fraction": config.val_fraction,
        "val_split_key": VAL_SPLIT_KEY,
        "shard_chars": config.shard_chars,
        "train_tokenizer": config.train_tokenizer,
        "tokenizer_sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "dtype": tok.dtype,
        "num_units": num_units,
        "num_tasks": config.num_tasks,
    }


def splits_of(config: PrepareConfig) -> list[str]:
    return ["train", "val"] if config.val_fraction > 0 else ["train"]


def expected_marker(config: PrepareConfig, tok: TokenizerInfo, plan: list, index: int) -> dict:
    """What task `index`'s marker must hold (less its results) to count as done."""
    my_units = [u for u in range(len(plan)) if task_of_unit(u, config.num_tasks) == index]
    return {
        "options": task_options(config, tok, len(plan)),
        "task_index": index,
        "units": {str(u): {"files": _file_ids(plan[u])} for u in my_units},
    }


def marker_is_current(marker_file: Path, expected: dict, out: Path) -> bool:
    try:
        marker = json.loads(marker_file.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if any(marker.get(k) != v for k, v in expected.items() if k != "units"):
        return False
    units = marker.get("units", {})
    if sorted(units) != sorted(expected["units"]):
        return False
    for key, unit in units.items():
        if unit.get("files") != expected["units"][key]["files"]:
            return False
        for split in SPLITS:
            for shard in unit.get(split, []):
                path = out / split / "shards" / shard["file"]
                if not path.is_file() or path.stat().st_size != shard["bytes"]:
                    return False
    return True


def pending_tasks(config: PrepareConfig) -> list[int]:
    """Tasks of `config.num_tasks` whose marker is missing or stale (for resubmission)."""
    try:
        tok = resolve_tokenizer(config)
    except ValueError:
        if config.tokenizer is not None:
            raise  # a --tokenizer that does not load fails every task: say so now
        return list(range(config.num_tasks))  # tokenizer not trained yet: all pending
    return stale_tasks(config, tok)


def stale_tasks(config: PrepareConfig, tok: TokenizerInfo) -> list[int]:
    """Tasks whose marker is missing or no longer describes the inputs and its shards."""
    plan, out = plan_units(config.inputs, config.shard_chars), Path(config.out)
    return [
        index
        for index in range(config.num_tasks)
        if not marker_is_current(
            marker_path(out, index, config.num_tasks),
            expected_marker(config, tok, plan, index),
            out,
        )
    ]


# ---- options -----------------------------------------------------------------------
def check_config(config: PrepareConfig) -> None:
    if (config.tokenizer is None) == (config.train_tokenizer is None):
        raise ValueError("pass exactly one of --tokenizer DIR or --train-tokenizer VOCAB_SIZE")
    if not 0.0 <= config.val_fraction < 1.0:
        raise ValueError(f"--val-fraction {config.val_fraction}: must be in [0, 1)")
    if config.on_exhausted not in ON_EXHAUSTED_CHOICES:
        raise ValueError(
            f"--on-exhausted {config.on_exhausted!r}: choose from {ON_EXHAUSTED_CHOICES}"
        )
    if config.shard_chars < 1:
        raise ValueError(f"--shard-chars {config.shard_chars}: must be at least 1")
    if config.num_tasks < 1:
        raise ValueError(f"--num-tasks {config.num_tasks}: must be at least 1")
    if config.task_index is not None and not 0 <= config.task_index < config.num_tasks:
        raise ValueError(
            f"--task-index {config.task_index}: must be in [0, {config.num_tasks}) for "
            f"--num-tasks {config.num_tasks} (SLURM_ARRAY_TASK_COUNT counts only the elements "
            "of this submission: pass --num-tasks explicitly when resubmitting a subset)"
        )
    if config.tokenizer_only and config.train_tokenizer is None:
        raise ValueError("--tokenizer-only trains a tokenizer: it needs --train-tokenizer VOCAB")
