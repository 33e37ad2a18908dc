"""`python -m dataloader.prepare`: raw text -> tokenizer + token shards + manifests.

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

import argparse
import hashlib
import io
import json
import multiprocessing
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing.pool import AsyncResult
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common.io import run_cli, write_bytes_atomic, write_json_atomic
from dataloader.corpus import (
    Document,
    expand_inputs,
    iter_documents,
    iter_unit_documents,
    unit_size,
)
from dataloader.manifest import (
    DOCUMENTS_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    ON_EXHAUSTED_CHOICES,
    Manifest,
    ShardInfo,
    dtype_for_vocab,
)
from dataloader.tokenizer import (
    encode_documents,
    install_tokenizer,
    load_special_ids,
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

    def add(self, other: SplitStats) -> None:
        for key, value in asdict(other).items():
            setattr(self, key, getattr(self, key) + value)


def is_val(doc: Document, val_fraction: float) -> bool:
    """Deterministic split by a hash of (source, document index)."""
    if val_fraction <= 0:
        return False
    digest = hashlib.sha256(f"{doc.source}\0{doc.index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


# ---- worker side ---------------------------------------------------------------
_worker_tokenizer = None


def _init_worker(tokenizer_json: str, single_threaded: bool) -> None:
    global _worker_tokenizer
    if single_threaded:
        # One process per core already: keep tokenizers' Rayon pool to one thread.
        os.environ["RAYON_NUM_THREADS"] = "1"
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _worker_tokenizer = Tokenizer.from_file(tokenizer_json)


@dataclass
class ShardJob:
    shard_dir: str
    unit: int
    chunk: int
    texts: list[str]
    input_sha256: str
    tokenizer_sha256: str
    bos_id: int
    eos_id: int
    dtype: str

    @property
    def split(self) -> str:
        return Path(self.shard_dir).parent.name


def shard_stem(unit: int, chunk: int) -> str:
    return f"{unit:06d}-{chunk:05d}"


def _paths(shard_dir: Path, unit: int, chunk: int) -> tuple[Path, Path, Path]:
    stem = shard_stem(unit, chunk)
    return shard_dir / f"{stem}.bin", shard_dir / f"{stem}.docs.npy", shard_dir / f"{stem}.json"


def _write_shard(job: ShardJob) -> dict:
    """Tokenize one chunk and write its shard, doc-length file and sidecar (last)."""
    arrays = encode_documents(
        _worker_tokenizer, job.texts, job.bos_id, job.eos_id, np.dtype(job.dtype)
    )
    tokens = np.concatenate(arrays)
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    bin_path, docs_path, sidecar_path = _paths(Path(job.shard_dir), job.unit, job.chunk)
    write_bytes_atomic(bin_path, tokens.tobytes())
    write_bytes_atomic(docs_path, _npy_bytes(lengths))
    sidecar = {
        "input_sha256": job.input_sha256,
        "tokenizer_sha256": job.tokenizer_sha256,
        "num_tokens": int(tokens.size),
        "num_documents": len(arrays),
        "bytes": tokens.nbytes,
        "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
        "docs_sha256": sha256_file(docs_path),
    }
    write_json_atomic(sidecar_path, sidecar)
    return sidecar


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _finished_sidecar(job: ShardJob) -> dict | None:
    """The sidecar of a shard finished by an earlier run on the same input, else None."""
    bin_path, docs_path, sidecar_path = _paths(Path(job.shard_dir), job.unit, job.chunk)
    try:
        sidecar = json.loads(sidecar_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if (
        sidecar.get("input_sha256") != job.input_sha256
        or sidecar.get("tokenizer_sha256") != job.tokenizer_sha256
        or not bin_path.is_file()
        or bin_path.stat().st_size != sidecar.get("bytes")
        or not docs_path.is_file()
        or sha256_file(bin_path) != sidecar.get("sha256")
        or sha256_file(docs_path) != sidecar.get("docs_sha256")
    ):
        return None
    return sidecar


# ---- planning ----------------------------------------------------------------------
def _texts_sha256(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8", errors="surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def plan_units(inputs: list[str], target_bytes: int) -> list[list[tuple[str, Path, str | None]]]:
    """Consecutive input files grouped into work units of >= `target_bytes` on disk
    (the last may be smaller). Depends only on the inputs, never on the task count."""
    units: list[list[tuple[str, Path, str | None]]] = []
    current: list[tuple[str, Path, str | None]] = []
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


def _file_ids(unit: list[tuple[str, Path, str | None]]) -> list[list]:
    """(path, size, mtime_ns) of a unit's files: a finished task is redone if they change."""
    ids = []
    for _, path, _ in unit:
        stat = path.stat()
        ids.append([str(path), unit_size(path), stat.st_mtime_ns])
    return ids


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


def train_tokenizer(config: PrepareConfig) -> Path:
    """Train (or, on resume with the same inputs, reuse) the BPE tokenizer."""
    tok_dir = Path(config.out) / "tokenizer"
    found = stamped_tokenizer(config, tok_dir)
    if found is not None:
        print(f"reusing tokenizer trained earlier in {tok_dir}", file=sys.stderr)
        return found
    texts = (
        d.text
        for d in iter_documents(config.inputs, config.text_field, config.doc_separator)
        if d.text.strip()
    )
    tokenizer = train_bpe(texts, config.train_tokenizer)
    path = install_tokenizer(None, tokenizer, tok_dir)
    write_json_atomic(tok_dir / "trained_from.json", _tokenizer_stamp(config))
    return path


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
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    return TokenizerInfo(
        path, tok_dir, sha256_file(path), vocab_size, bos_id, eos_id, dtype_for_vocab(vocab_size)
    )


# ---- one task ----------------------------------------------------------------------
def _task_options(config: PrepareConfig, tok: TokenizerInfo, num_units: int) -> dict:
    """What every task of one prepare must agree on (the merge checks it)."""
    return {
        "format_version": FORMAT_VERSION,
        "inputs": list(config.inputs),
        "text_field": config.text_field,
        "doc_separator": config.doc_separator,
        "val_fraction": config.val_fraction,
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


def _splits(config: PrepareConfig) -> list[str]:
    return ["train", "val"] if config.val_fraction > 0 else ["train"]


def _expected_marker(config: PrepareConfig, tok: TokenizerInfo, plan: list, index: int) -> dict:
    """What task `index`'s marker must hold (less its results) to count as done."""
    my_units = [u for u in range(len(plan)) if task_of_unit(u, config.num_tasks) == index]
    return {
        "options": _task_options(config, tok, len(plan)),
        "task_index": index,
        "units": {str(u): {"files": _file_ids(plan[u])} for u in my_units},
    }


def _marker_is_current(marker_file: Path, expected: dict, out: Path) -> bool:
    try:
        marker = json.loads(marker_file.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if {k: marker.get(k) for k in expected if k != "units"} != {
        k: v for k, v in expected.items() if k != "units"
    }:
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


def _unit_chunks(
    config: PrepareConfig, files: list[tuple[str, Path, str | None]], stats: dict[str, SplitStats]
) -> Iterator[tuple[str, int, list[str]]]:
    """(split, chunk index, texts) chunks of about `shard_chars` characters of one work
    unit, counting as it goes; chunks never span two units."""
    pending: dict[str, list[str]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    chunks = {"train": 0, "val": 0}
    for doc in iter_unit_documents(files, config.text_field, config.doc_separator):
        split = "val" if is_val(doc, config.val_fraction) else "train"
        split_stats = stats[split]
        if doc.num_replaced:
            split_stats.num_replaced_chars += doc.num_replaced
            split_stats.num_documents_with_replacements += 1
        if not doc.text.strip():
            split_stats.num_empty_documents += 1
            continue
        split_stats.num_documents += 1
        pending[split].append(doc.text)
        sizes[split] += len(doc.text)
        if sizes[split] >= config.shard_chars:
            yield split, chunks[split], pending[split]
            chunks[split] += 1
            stats[split].num_shards += 1
            pending[split], sizes[split] = [], 0
    for split in SPLITS:
        if pending[split]:
            yield split, chunks[split], pending[split]
            stats[split].num_shards += 1


def run_task(
    config: PrepareConfig,
    index: int,
    tok: TokenizerInfo,
    plan: list[list[tuple[str, Path, str | None]]],
) -> dict:
    """Tokenize the work units of task `index` of `config.num_tasks`; write its marker."""
    out = Path(config.out)
    num_tasks = config.num_tasks
    expected = _expected_marker(config, tok, plan, index)
    my_units = [int(u) for u in expected["units"]]
    marker_file = marker_path(out, index, num_tasks)
    if _marker_is_current(marker_file, expected, out):
        print(
            f"task {index} of {num_tasks}: already complete ({marker_file}); nothing to do",
            flush=True,
        )
        return json.loads(marker_file.read_text())

    for split in _splits(config):
        (out / split / "shards").mkdir(parents=True, exist_ok=True)
    stats = {s: SplitStats() for s in SPLITS}
    units = expected["units"]
    for unit in units.values():
        for split in _splits(config):
            unit[split] = []

    def jobs() -> Iterator[ShardJob]:
        for u in my_units:
            for split, chunk, texts in _unit_chunks(config, plan[u], stats):
                yield ShardJob(
                    str(out / split / "shards"),
                    u,
                    chunk,
                    texts,
                    _texts_sha256(texts),
                    tok.sha256,
                    tok.bos_id,
                    tok.eos_id,
                    tok.dtype,
                )

    bar = tqdm(
        desc=f"prepare task {index}/{num_tasks}",
        unit="doc",
        disable=not config.progress,
        file=sys.stderr,
    )

    def collect(job: ShardJob, num_docs: int, result: dict | AsyncResult) -> None:
        sidecar = result if isinstance(result, dict) else result.get()
        rows = units[str(job.unit)][job.split]
        assert len(rows) == job.chunk, (job.unit, job.split, job.chunk, len(rows))
        stem = shard_stem(job.unit, job.chunk)
        rows.append({"file": f"{stem}.bin", "docs_file": f"{stem}.docs.npy", **sidecar})
        bar.update(num_docs)

    pool = None
    if config.num_workers > 1:
        pool = multiprocessing.get_context("spawn").Pool(
            config.num_workers, initializer=_init_worker, initargs=(str(tok.path), True)
        )
    else:
        _init_worker(str(tok.path), False)
    try:
        # Results are collected in submission order (kept shards too), so each unit's
        # shard list stays in chunk order; at most two chunks per worker are in flight.
        in_flight: list[tuple[ShardJob, int, dict | AsyncResult]] = []
        for job in jobs():
            done = _finished_sidecar(job)
            if done is not None:
                stats[job.split].num_shards_kept += 1
                in_flight.append((job, len(job.texts), done))
            elif pool is None:
                in_flight.append((job, len(job.texts), _write_shard(job)))
            else:
                in_flight.append((job, len(job.texts), pool.apply_async(_write_shard, (job,))))
            while in_flight and (pool is None or len(in_flight) >= 2 * config.num_workers):
                collect(*in_flight.pop(0))
        for item in in_flight:
            collect(*item)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        bar.close()

    marker = {**expected, "stats": {s: asdict(stats[s]) for s in SPLITS}}
    marker_file.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(marker_file, marker)
    num_docs = sum(s.num_documents for s in stats.values())
    num_shards = sum(s.num_shards for s in stats.values())
    kept = sum(s.num_shards_kept for s in stats.values())
    print(
        f"task {index} of {num_tasks}: {len(my_units)} of {len(plan)} work units, {num_docs} "
        f"documents in {num_shards} shards ({kept} kept from an earlier run); marker {marker_file}",
        flush=True,
    )
    return marker


# ---- merge ---------------------------------------------------------------------------
def _list_tasks(indices: list[int], limit: int = 20) -> str:
    shown = ", ".join(map(str, indices[:limit]))
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


def pending_tasks(config: PrepareConfig) -> list[int]:
    """Tasks of `config.num_tasks` whose marker is missing or stale (for resubmission)."""
    try:
        tok = resolve_tokenizer(config)
    except ValueError:
        return list(range(config.num_tasks))  # tokenizer not trained yet: all pending
    plan = plan_units(config.inputs, config.shard_chars)
    return [
        index
        for index in range(config.num_tasks)
        if not _marker_is_current(
            marker_path(config.out, index, config.num_tasks),
            _expected_marker(config, tok, plan, index),
            Path(config.out),
        )
    ]


def merge(config: PrepareConfig, tok: TokenizerInfo) -> dict[str, Manifest]:
    """Check that every task finished with the same options, then write each split's
    documents.npy and manifest.json from the tasks' markers (no token is re-read)."""
    out = Path(config.out)
    num_tasks = config.num_tasks
    markers: list[dict] = []
    missing = []
    for index in range(num_tasks):
        try:
            markers.append(json.loads(marker_path(out, index, num_tasks).read_text()))
        except (OSError, json.JSONDecodeError):
            missing.append(index)
    if missing:
        raise ValueError(
            f"{out / TASKS_DIR}: task(s) {_list_tasks(missing)} of {num_tasks} have not "
            f"completed (no {marker_path(out, missing[0], num_tasks).name}"
            f"{', ...' if len(missing) > 1 else ''}); run just those again "
            f"(--task-index I, or sbatch --array={','.join(map(str, missing[:20]))}; "
            "scripts/slurm/submit_prepare.py resubmits exactly the unfinished ones), then merge"
        )
    options = _task_options(config, tok, markers[0]["options"].get("num_units"))
    for index, marker in enumerate(markers):
        theirs = marker.get("options", {})
        for key, value in options.items():
            if theirs.get(key) != value:
                what = "a different tokenizer" if key == "tokenizer_sha256" else "different options"
                raise ValueError(
                    f"{marker_path(out, index, num_tasks)}: task {index} of {num_tasks} ran with "
                    f"{what}: {key}={theirs.get(key)!r}, but this merge has "
                    f"{key}={value!r}; every task and the merge must get the same --input, "
                    "--tokenizer/--train-tokenizer, --text-field, --doc-separator, "
                    "--val-fraction and --shard-chars. Rerun that task with them"
                )
    # Inputs changed (or shards lost) since a task ran: its marker no longer describes them.
    plan = plan_units(config.inputs, config.shard_chars)
    stale = [
        index
        for index in range(num_tasks)
        if not _marker_is_current(
            marker_path(out, index, num_tasks), _expected_marker(config, tok, plan, index), out
        )
    ]
    if stale:
        raise ValueError(
            f"{out / TASKS_DIR}: task(s) {_list_tasks(stale)} of {num_tasks} are out of date "
            "(their input files changed, or shards they wrote are missing or resized, since "
            "they ran); run just those again "
            f"(--task-index I, or sbatch --array={','.join(map(str, stale[:20]))}), then merge"
        )
    num_units = options["num_units"]
    covered = sorted(int(u) for m in markers for u in m["units"])
    assert covered == list(range(num_units)), (covered, num_units)

    stats = {s: SplitStats() for s in SPLITS}
    for marker in markers:
        for split in SPLITS:
            stats[split].add(SplitStats(**marker["stats"][split]))
    manifests = {}
    for split in _splits(config):
        rows = []
        for u in range(num_units):
            marker = markers[task_of_unit(u, num_tasks)]
            rows += marker["units"][str(u)].get(split, [])
        if stats[split].num_documents == 0:
            what = (
                "the inputs"
                if split == "train"
                else f"the val split (--val-fraction {config.val_fraction})"
            )
            raise ValueError(
                f"no non-empty documents in {what} {config.inputs} "
                f"({stats[split].num_empty_documents} empty); check --input and --text-field"
                + ("" if split == "train" else ", or raise --val-fraction")
            )
        for row in rows:
            path = out / split / "shards" / row["file"]
            if not path.is_file() or path.stat().st_size != row["bytes"]:
                raise ValueError(
                    f"{path}: missing or not {row['bytes']} bytes as its task recorded; "
                    "delete that task's marker in prepare_tasks/ and rerun it"
                )
        manifests[split] = _write_split(out / split, split, rows, stats[split], config, tok)
    for split in SPLITS:
        if split not in manifests and (out / split / MANIFEST_NAME).exists():
            (out / split / MANIFEST_NAME).unlink()  # a stale val split from an earlier run
    if tok.source_dir.resolve() != (out / "tokenizer").resolve():
        install_tokenizer(tok.source_dir, None, out / "tokenizer")
    _report(out, manifests, stats)
    return manifests


def _write_documents(path: Path, shard_dir: Path, rows: list[dict], num_documents: int) -> None:
    """documents.npy (int64 starts, then the total) streamed shard by shard: memory does
    not grow with the corpus. Temp name + fsync + rename, like every other write here."""
    tmp = path.with_name(path.name + ".tmp")
    starts = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int64, shape=(num_documents + 1,))
    starts[0] = 0
    at, total = 1, 0
    for row in rows:
        lengths = np.load(shard_dir / row["docs_file"])
        if len(lengths) != row["num_documents"]:
            raise ValueError(
                f"{shard_dir / row['docs_file']}: {len(lengths)} documents, its sidecar records "
                f"{row['num_documents']}; delete that task's marker in prepare_tasks/ and rerun it"
            )
        np.cumsum(lengths, out=starts[at : at + len(lengths)])
        starts[at : at + len(lengths)] += total
        total += int(lengths.sum())
        at += len(lengths)
    assert at == num_documents + 1, (at, num_documents)
    starts.flush()
    del starts
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _write_split(split_dir, split, rows, stats, config, tok: TokenizerInfo) -> Manifest:
    shard_dir = split_dir / "shards"
    num_documents = sum(r["num_documents"] for r in rows)
    assert num_documents == stats.num_documents, (num_documents, stats.num_documents)
    # Files no task listed (temp files, an earlier run on other inputs or options) are stale.
    listed = {r["file"] for r in rows} | {r["docs_file"] for r in rows}
    listed |= {r["file"].removesuffix(".bin") + ".json" for r in rows}
    for stale in shard_dir.iterdir():
        if stale.name not in listed:
            stale.unlink()
    _write_documents(split_dir / DOCUMENTS_NAME, shard_dir, rows, num_documents)
    manifest = Manifest(
        root=split_dir,
        split=split,
        tokenizer_sha256=tok.sha256,
        vocab_size=tok.vocab_size,
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        dtype=tok.dtype,
        num_tokens=sum(r["num_tokens"] for r in rows),
        num_documents=num_documents,
        num_empty_documents=stats.num_empty_documents,
        num_replaced_chars=stats.num_replaced_chars,
        num_documents_with_replacements=stats.num_documents_with_replacements,
        on_exhausted=config.on_exhausted,
        documents_bytes=(split_dir / DOCUMENTS_NAME).stat().st_size,
        documents_sha256=sha256_file(split_dir / DOCUMENTS_NAME),
        shards=[
            ShardInfo(
                f"shards/{r['file']}", r["num_tokens"], r["num_documents"], r["bytes"], r["sha256"]
            )
            for r in rows
        ],
        inputs=list(config.inputs),
    )
    write_json_atomic(split_dir / MANIFEST_NAME, manifest.to_json())
    return Manifest.load(split_dir, verify=config.verify)


def _report(out: Path, manifests: dict[str, Manifest], stats: dict[str, SplitStats]) -> None:
    for split, manifest in manifests.items():
        s = stats[split]
        print(
            f"{out / split}: {manifest.num_documents} documents, {manifest.num_tokens} tokens "
            f"({manifest.dtype}) in {len(manifest.shards)} shards ({s.num_shards_kept} kept from an "
            f"earlier run); dropped {s.num_empty_documents} empty documents; replaced "
            f"{s.num_replaced_chars} undecodable bytes in {s.num_documents_with_replacements} documents"
        )


# ---- entry point -----------------------------------------------------------------------
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
    parser.add_argument("--no-progress", action="store_true")
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
    task_index = args.task_index
    if task_index is None and not (args.merge or args.tokenizer_only):
        task_index = _env_int("SLURM_ARRAY_TASK_ID")
    if args.merge or args.tokenizer_only:
        task_index = None
    if num_tasks > 1 and task_index is None and not (args.merge or args.tokenizer_only):
        raise ValueError(
            f"--num-tasks {num_tasks}: say which task this is with --task-index I "
            "(or run inside a SLURM array job), or pass --merge once all tasks are done"
        )
    return PrepareConfig(
        inputs=args.inputs,
        out=args.out,
        tokenizer=args.tokenizer,
        train_tokenizer=args.train_tokenizer,
        text_field=args.text_field,
        doc_separator=args.doc_separator,
        val_fraction=args.val_fraction,
        on_exhausted=args.on_exhausted,
        shard_chars=args.shard_chars,
        num_workers=args.num_workers,
        verify=args.verify,
        progress=not args.no_progress,
        num_tasks=num_tasks,
        task_index=task_index,
        merge=args.merge,
        tokenizer_only=args.tokenizer_only,
    )


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: prepare(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
