"""Provenance: which source file and record each document of a prepared split came from.

Why: the data ledger (`train.ledger`) proves which windows of the token stream a
checkpoint trained on; an audit (a licence, an opt-out, a contamination check) asks about
*sources*: this file, that record. Prepare knows the answer while it reads, and throws it
away unless it is kept here.

Cheap, because documents come in long runs: consecutive records of one input file become
consecutive documents of a split. So a split keeps run-length ranges, one row per run:
(source, first record, first document, count), broken only where a record is dropped (an
empty document; a record that went to the other split) or a source ends. That is
O(input files + dropped records) rows, not O(documents): a corpus of 1e9 documents in
1e5 files with a 1% validation split has ~2e7 rows (~640 MB) against 8 GB for a row per
document, and a split without dropped records one row per file. A shard boundary does not
break a run (runs are joined across shards), so the ranges depend only on the inputs and
options: a one-process prepare and a SLURM array of any size write the same bytes.

Files, beside documents.npy, named in the manifest's `provenance` entry (manifest format
2; sizes and sha256s): `provenance.npy`, int64 [R, 4] sorted by first document and covering
every document once; `sources.json`, the source names (`Document.source`: the input path as
given, or `shakespeare/...` for the embedded corpus; a save_to_disk split is `PATH[split]`).
A *record* is what the reader counts (`dataloader.corpus.Document.index`): a jsonl file's
0-based line number (blank lines count), a parquet or datasets row, a text file's piece
(`--doc-separator`). Data prepared before format 2 has no provenance: it still loads and
trains, and `train.ledger which` says provenance is unavailable.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from common.io import atomic_path, write_bytes_atomic
from dataloader.tokenizer import sha256_file

RUNS_NAME = "provenance.npy"
SOURCES_NAME = "sources.json"


class RunBuilder:
    """The runs (source, first record, count) of documents appended in order."""

    def __init__(self) -> None:
        self.runs: list[list] = []

    def add(self, source: str, record: int, count: int = 1) -> None:
        last = self.runs[-1] if self.runs else None
        if last is not None and last[0] == source and last[1] + last[2] == record:
            last[2] += count
        else:
            self.runs.append([source, record, count])

    def take(self) -> list[list]:
        runs, self.runs = self.runs, []
        return runs


def write_provenance(split_dir: Path, chunk_runs: Iterable[list[list]]) -> dict:
    """provenance.npy and sources.json of a split from its shards' runs, in document
    order (joined where a run goes on across a shard boundary); returns the manifest's
    `provenance` entry."""
    joined = RunBuilder()  # documents are consecutive within a split
    for runs in chunk_runs:
        for source, first, count in runs:
            joined.add(source, first, count)
    sources: dict[str, int] = {}
    rows, document = [], 0
    for source, first, count in joined.runs:
        rows.append([sources.setdefault(source, len(sources)), first, document, count])
        document += count
    with atomic_path(split_dir / RUNS_NAME) as tmp, open(tmp, "wb") as fh:
        np.save(fh, np.array(rows, dtype=np.int64).reshape(-1, 4))
    write_bytes_atomic(split_dir / SOURCES_NAME, json.dumps(list(sources)).encode())
    entry = {"num_runs": len(rows), "num_sources": len(sources), "num_documents": document}
    for kind, name in (("runs", RUNS_NAME), ("sources", SOURCES_NAME)):
        path = split_dir / name
        entry[f"{kind}_file"], entry[f"{kind}_bytes"] = name, path.stat().st_size
        entry[f"{kind}_sha256"] = sha256_file(path)
    return entry


class Provenance:
    """A split's provenance, read back: `locate(document)` -> (source, record)."""

    def __init__(self, runs: np.ndarray, sources: list[str]):
        self.runs, self.sources = runs, sources

    @classmethod
    def of(cls, manifest) -> Provenance | None:
        """The provenance of a loaded `Manifest`; None for data prepared before format 2."""
        entry = manifest.provenance
        if not entry:
            return None
        runs_path = manifest.root / entry["runs_file"]
        sources_path = manifest.root / entry["sources_file"]
        manifest.check_file(runs_path, entry["runs_bytes"])
        manifest.check_file(sources_path, entry["sources_bytes"])
        runs = np.load(runs_path, mmap_mode="r")
        if runs.shape != (entry["num_runs"], 4):
            raise ValueError(
                f"{runs_path}: shape {runs.shape}, the manifest records {entry['num_runs']} runs; "
                "re-run dataloader.prepare"
            )
        return cls(runs, json.loads(sources_path.read_text()))

    def locate(self, document: int) -> tuple[str, int]:
        """(source, record) of a document of the split (a binary search over the runs)."""
        firsts = self.runs[:, 2]
        i = int(np.searchsorted(firsts, document, side="right")) - 1
        source, first_record, first_document, count = (int(x) for x in self.runs[i])
        if not 0 <= document - first_document < count:
            raise ValueError(f"document {document} is in no provenance run (corrupt runs file?)")
        return self.sources[source], first_record + document - first_document
