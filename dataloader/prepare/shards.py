"""`dataloader.prepare`'s workers: one task's work units tokenized into shard files.

Each chunk of a unit (about `--shard-chars` characters, never spanning two units) becomes
one shard `UUUUUU-CCCCC.bin`, its document lengths `.docs.npy`, and last a sidecar
`.json` (the chunk's input hash, tokenizer hash, size and sha256) that marks it finished:
a re-run keeps every shard whose sidecar still matches. The task's marker lists each shard
with its documents' provenance runs (`dataloader.provenance`), which the merge joins. Chunks are tokenized in a process
pool (one process per core, tokenizers' own Rayon threads pinned to 1 per process so the
cores are not oversubscribed). A finished task writes its marker.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from multiprocessing.pool import AsyncResult
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common.io import atomic_path, write_bytes_atomic, write_json_atomic
from dataloader.corpus import InputFile, iter_unit_documents
from dataloader.prepare.plan import (
    SPLITS,
    PrepareConfig,
    SplitStats,
    TokenizerInfo,
    expected_marker,
    is_val,
    marker_is_current,
    marker_path,
    splits_of,
)
from dataloader.provenance import RunBuilder
from dataloader.tokenizer import encode_documents, sha256_file

_worker_tokenizer = None


def _init_worker(tokenizer_json: str, single_threaded: bool) -> None:
    global _worker_tokenizer
    if single_threaded:
        # One process per core already: keep tokenizers' Rayon pool to one thread.
        os.environ["RAYON_NUM_THREADS"] = "1"
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _worker_tokenizer = Tokenizer.from_file(tokenizer_json)
    # "<|end_of_text|>" in a document is text: its id only ever bounds documents (ours)
    _worker_tokenizer.encode_special_tokens = True


@dataclass
class ShardJob:
    shard_dir: str
    unit: int
    chunk: int
    texts: list[str]
    input_sha256: str
    tok: TokenizerInfo

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
    tok = job.tok
    arrays = encode_documents(
        _worker_tokenizer, job.texts, tok.bos_id, tok.eos_id, np.dtype(tok.dtype)
    )
    tokens = np.concatenate(arrays)
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    bin_path, docs_path, sidecar_path = _paths(Path(job.shard_dir), job.unit, job.chunk)
    write_bytes_atomic(bin_path, tokens.tobytes())
    with atomic_path(docs_path) as tmp, open(tmp, "wb") as fh:
        np.save(fh, lengths)
    sidecar = {
        "input_sha256": job.input_sha256,
        "tokenizer_sha256": job.tok.sha256,
        "num_tokens": int(tokens.size),
        "num_documents": len(arrays),
        "bytes": tokens.nbytes,
        "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
        "docs_sha256": sha256_file(docs_path),
    }
    write_json_atomic(sidecar_path, sidecar)
    return sidecar


def _finished_sidecar(job: ShardJob) -> dict | None:
    """The sidecar of a shard finished by an earlier run on the same input, else None."""
    bin_path, docs_path, sidecar_path = _paths(Path(job.shard_dir), job.unit, job.chunk)
    try:
        sidecar = json.loads(sidecar_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if (
        sidecar.get("input_sha256") != job.input_sha256
        or sidecar.get("tokenizer_sha256") != job.tok.sha256
        or not bin_path.is_file()
        or bin_path.stat().st_size != sidecar.get("bytes")
        or not docs_path.is_file()
        or sha256_file(bin_path) != sidecar.get("sha256")
        or sha256_file(docs_path) != sidecar.get("docs_sha256")
    ):
        return None
    return sidecar


def _texts_sha256(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8", errors="surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def _unit_chunks(
    config: PrepareConfig, files: list[InputFile], stats: dict[str, SplitStats]
) -> Iterator[tuple[str, int, list[str], list[list]]]:
    """(split, chunk index, texts, provenance runs) chunks of about `shard_chars`
    characters of one work unit, counting as it goes; chunks never span two units. The
    runs ((source, first record, count), `dataloader.provenance`) say where the chunk's
    documents came from; a dropped record breaks a run."""
    pending: dict[str, list[str]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    chunks = {"train": 0, "val": 0}
    runs = {"train": RunBuilder(), "val": RunBuilder()}
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
        runs[split].add(doc.source, doc.index)
        sizes[split] += len(doc.text)
        if sizes[split] >= config.shard_chars:
            yield split, chunks[split], pending[split], runs[split].take()
            chunks[split] += 1
            stats[split].num_shards += 1
            pending[split], sizes[split] = [], 0
    for split in SPLITS:
        if pending[split]:
            yield split, chunks[split], pending[split], runs[split].take()
            stats[split].num_shards += 1


def run_task(
    config: PrepareConfig,
    index: int,
    tok: TokenizerInfo,
    plan: list[list[InputFile]],
) -> None:
    """Tokenize the work units of task `index` of `config.num_tasks`; write its marker."""
    out = Path(config.out)
    num_tasks = config.num_tasks
    expected = expected_marker(config, tok, plan, index)
    my_units = [int(u) for u in expected["units"]]
    marker_file = marker_path(out, index, num_tasks)
    if marker_is_current(marker_file, expected, out):
        print(
            f"task {index} of {num_tasks}: already complete ({marker_file}); nothing to do",
            flush=True,
        )
        return

    for split in splits_of(config):
        (out / split / "shards").mkdir(parents=True, exist_ok=True)
    stats = {s: SplitStats() for s in SPLITS}
    units = expected["units"]
    for unit in units.values():
        unit |= {split: [] for split in splits_of(config)}

    def jobs() -> Iterator[tuple[ShardJob, list[list]]]:
        for u in my_units:
            for split, chunk, texts, runs in _unit_chunks(config, plan[u], stats):
                shard_dir = str(out / split / "shards")
                yield ShardJob(shard_dir, u, chunk, texts, _texts_sha256(texts), tok), runs

    bar = tqdm(
        desc=f"prepare task {index}/{num_tasks}",
        unit="doc",
        disable=not config.progress,
        file=sys.stderr,
    )

    def collect(job: ShardJob, runs: list[list], result: dict | AsyncResult) -> None:
        sidecar = result if isinstance(result, dict) else result.get()
        rows = units[str(job.unit)][job.split]
        assert len(rows) == job.chunk, (job.unit, job.split, job.chunk, len(rows))
        stem = shard_stem(job.unit, job.chunk)
        row = {"file": f"{stem}.bin", "docs_file": f"{stem}.docs.npy", **sidecar}
        rows.append({**row, "provenance": runs})
        bar.update(len(job.texts))

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
        in_flight: list[tuple[ShardJob, list[list], dict | AsyncResult]] = []
        for job, runs in jobs():
            done = _finished_sidecar(job)
            if done is not None:
                stats[job.split].num_shards_kept += 1
                in_flight.append((job, runs, done))
            elif pool is None:
                in_flight.append((job, runs, _write_shard(job)))
            else:
                in_flight.append((job, runs, pool.apply_async(_write_shard, (job,))))
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
