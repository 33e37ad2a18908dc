"""Small raw corpora written on the spot, for the data tests (the `tiny_corpus` fixture of
tests/conftest.py hands one out; a test that needs several builds them here)."""

from __future__ import annotations

import json
from pathlib import Path


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
