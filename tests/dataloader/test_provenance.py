"""Provenance (dataloader/provenance.py): prepare keeps which source file and record each
document came from, in run-length ranges; data prepared before it still loads and trains.

A distributed prepare writes the same provenance bytes as one process:
test_prepare.py::test_tasks_then_merge_equal_single_process compares them
(`assert_same_dataset`).
"""

from __future__ import annotations

import json

import numpy as np

from dataloader import MixEntry, TokenShardDataLoader
from dataloader.corpus import iter_documents
from dataloader.manifest import MANIFEST_NAME, Manifest
from dataloader.prepare import PrepareConfig, prepare
from dataloader.prepare.plan import is_val
from dataloader.provenance import RUNS_NAME, Provenance


def test_prepare_keeps_the_source_and_record_of_every_document(shakespeare_data, tiny_corpus):
    """Every document of both splits, in three input formats, with dropped records (empty
    ones; the val split's, seen from train) breaking the runs."""
    texts = [f"document {i} " * (1 + i % 5) if i % 7 != 3 else "   " for i in range(60)]
    inputs = [
        tiny_corpus.jsonl(texts[:30], name="a.jsonl"),
        tiny_corpus.parquet(texts[30:], name="b.parquet"),
        tiny_corpus.text("## one\nx\n## two\ny\n## three\nz\n", name="c.md"),
    ]
    out = tiny_corpus.root / "data"
    prepare(
        PrepareConfig(
            inputs=[str(p) for p in inputs],
            out=out,
            tokenizer=str(shakespeare_data / "tokenizer"),
            doc_separator="^## ",
            val_fraction=0.2,
            shard_chars=200,  # many shards: runs go on across shard boundaries
            num_workers=1,
            progress=False,
        )
    )
    documents = [
        d for d in iter_documents([str(p) for p in inputs], "text", "^## ") if d.text.strip()
    ]
    dropped = 60 + 3 - len(documents)
    for split in ("train", "val"):
        manifest = Manifest.load(out / split, verify=True)  # provenance sha256s checked too
        provenance = Provenance.of(manifest)
        expected = [(d.source, d.index) for d in documents if is_val(d, 0.2) == (split == "val")]
        assert len(expected) == manifest.num_documents
        assert [provenance.locate(i) for i in range(manifest.num_documents)] == expected
        # O(files + dropped records) runs, never one per document
        runs = np.load(out / split / RUNS_NAME)
        assert len(runs) <= len(inputs) + dropped + sum(is_val(d, 0.2) for d in documents)
        if split == "train":  # runs joined across its shards
            assert len(runs) < manifest.num_documents // 2 and len(manifest.shards) > 3


def test_data_prepared_before_provenance_loads_trains_and_keeps_its_fingerprint(
    shakespeare_data, tmp_path
):
    """A format-1 manifest (no provenance) loads; its stream's content hash, and so a
    run's fingerprint, is the one re-prepared format-2 data has: a run resumes onto it."""
    import shutil

    def loader(path):
        config = TokenShardDataLoader.Config(mix=[MixEntry(str(path))], seed=3, prefetch=0)
        return config.build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=2)

    data = tmp_path / "train"
    shutil.copytree(shakespeare_data / "train", data)
    before = loader(data)  # format 2
    next(before)
    state, content = before.state_dict(), Manifest.load(data).content_sha256
    raw = json.loads((data / MANIFEST_NAME).read_text())
    assert raw["format_version"] == 2 and raw["provenance"]["num_runs"] > 0
    raw["format_version"] = 1  # what prepare wrote before provenance
    del raw["provenance"]
    (data / MANIFEST_NAME).write_text(json.dumps(raw))
    manifest = Manifest.load(data, verify=True)
    assert Provenance.of(manifest) is None
    assert manifest.content_sha256 == content
    after = loader(data)
    after.load_state_dict(state)  # refused if the fingerprint differed
    assert (next(after)[1] == next(before)[1]).all()
