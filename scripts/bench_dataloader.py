"""Benchmark the data pipeline: loader throughput, startup, resume, prepare, stock loader.

    .venv/bin/python scripts/bench_dataloader.py [--quick] [--workdir DIR]

Everything runs on the real Shakespeare corpus (prepared here with a freshly trained
2048-token BPE) or on synthetic shard sets; nothing is downloaded. Tokenizers'
Rayon pool is pinned to one thread so the prepare-vs-encode_batch comparison is per core.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers is imported: per-core numbers
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402


def loader_throughput(data: Path, seq_len: int, batch: int, seconds: float) -> tuple[float, float]:
    from dataloader import MixEntry, TokenShardDataLoader

    loader = TokenShardDataLoader.Config(mix=[MixEntry(str(data / "train"))], seed=0).build(
        dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=seq_len, local_batch_size=batch
    )
    next(loader)  # warm the page cache and the epoch permutation
    num_batches, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(loader)
        num_batches += 1
    elapsed = time.perf_counter() - start
    return num_batches / elapsed, num_batches * batch * seq_len / elapsed


def synthetic_dataset(
    root: Path, num_shards: int, docs_per_shard: int = 4, doc_len: int = 300
) -> Path:
    """A valid prepared split with `num_shards` small shard files of random tokens."""
    from dataloader.common import write_json_atomic
    from dataloader.manifest import DOCUMENTS_NAME, MANIFEST_NAME, Manifest, ShardInfo
    from dataloader.tokenizer import sha256_file

    (root / "shards").mkdir(parents=True)
    rng = np.random.default_rng(0)
    shards = []
    for i in range(num_shards):
        tokens = rng.integers(2, 2048, size=docs_per_shard * doc_len, dtype=np.uint16)
        path = root / "shards" / f"{i:05d}.bin"
        tokens.tofile(path)
        shards.append(
            ShardInfo(f"shards/{i:05d}.bin", tokens.size, docs_per_shard, tokens.nbytes, "0" * 64)
        )
    num_docs = num_shards * docs_per_shard
    np.save(root / DOCUMENTS_NAME, np.arange(num_docs + 1, dtype=np.int64) * doc_len)
    manifest = Manifest(
        root=root, split="train", tokenizer_sha256="0" * 64, vocab_size=2048, bos_id=0, eos_id=1,
        dtype="uint16", num_tokens=num_docs * doc_len, num_documents=num_docs, num_empty_documents=0,
        num_replaced_chars=0, num_documents_with_replacements=0, on_exhausted="repeat",
        documents_bytes=(root / DOCUMENTS_NAME).stat().st_size,
        documents_sha256=sha256_file(root / DOCUMENTS_NAME), shards=shards,
    )  # fmt: skip
    write_json_atomic(root / MANIFEST_NAME, manifest.to_json())
    return root


def time_to_first_batch(path: Path, state: dict | None = None, seq_len: int = 2048) -> float:
    from dataloader import MixEntry, TokenShardDataLoader

    start = time.perf_counter()
    loader = TokenShardDataLoader.Config(mix=[MixEntry(str(path))], seed=0).build(
        dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=seq_len, local_batch_size=8
    )
    if state is not None:
        loader.load_state_dict(state)
    next(loader)
    return time.perf_counter() - start


def stock_loader_throughput(
    data: Path, workdir: Path, seq_len: int, batch: int, seconds: float
) -> float:
    """torchtitan's HuggingFaceTextDataLoader on the same documents (a local jsonl dir)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from dataloader.corpus import iter_documents

    jsonl_dir = workdir / "stock_jsonl"
    jsonl_dir.mkdir(exist_ok=True)
    with open(jsonl_dir / "data.jsonl", "w") as fh:
        for doc in iter_documents(["shakespeare"]):
            fh.write(json.dumps({"text": doc.text}) + "\n")
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(data / "tokenizer"))
    loader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(jsonl_dir)).build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=batch
    )
    iterator = iter(loader)
    next(iterator)
    num_batches, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(iterator)
        num_batches += 1
    return num_batches * batch * seq_len / (time.perf_counter() - start)


def prepare_throughput(data: Path, workdir: Path) -> tuple[float, float]:
    """(prepare tokens/s with one worker, raw encode_batch tokens/s), both on one core."""
    from tokenizers import Tokenizer

    from dataloader.corpus import iter_documents
    from dataloader.prepare import PrepareConfig, prepare

    texts = [d.text for d in iter_documents(["shakespeare"]) if d.text.strip()]
    tokenizer = Tokenizer.from_file(str(data / "tokenizer" / "tokenizer.json"))
    start = time.perf_counter()
    num_raw = sum(len(e.ids) + 2 for e in tokenizer.encode_batch(texts, add_special_tokens=False))
    raw = num_raw / (time.perf_counter() - start)
    start = time.perf_counter()
    manifest = prepare(PrepareConfig(inputs=["shakespeare"], out=workdir / "prep", tokenizer=str(data / "tokenizer"),
                                     num_workers=1, progress=False))["train"]  # fmt: skip
    return manifest.num_tokens / (time.perf_counter() - start), raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="short timings, 1,000 instead of 10,000 shards"
    )
    parser.add_argument(
        "--workdir", type=Path, help="keep the prepared data here (default: a temp dir)"
    )
    args = parser.parse_args()
    seconds = 1.0 if args.quick else 4.0
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_dataloader_"))
    workdir.mkdir(parents=True, exist_ok=True)
    from dataloader.prepare import PrepareConfig, prepare

    data = workdir / "shakespeare"
    start = time.perf_counter()
    prepare(
        PrepareConfig(
            inputs=["shakespeare"], out=data, train_tokenizer=2048, num_workers=1, progress=False
        )
    )
    print(
        f"prepared Shakespeare (tokenizer training included) in {time.perf_counter() - start:.1f} s"
    )

    print("\n## Loader throughput (1 rank, page cache)")
    ours = {}
    for seq_len in (2048, 8192):
        batches, tokens = loader_throughput(data, seq_len, 8, seconds)
        ours[seq_len] = tokens
        print(
            f"seq_len {seq_len} x batch 8: {batches:8.1f} batches/s  {tokens / 1e6:7.1f} M tokens/s"
        )
    stock = stock_loader_throughput(data, workdir, 2048, 8, seconds)
    print(f"torchtitan HuggingFaceTextDataLoader, seq_len 2048 x batch 8: {stock / 1e6:.3f} M tokens/s "
          f"-> ours is {ours[2048] / stock:.0f}x faster")  # fmt: skip

    print("\n## Startup (construct + first batch, seq_len 2048 x 8)")
    for num_shards in (10, 1_000 if args.quick else 10_000):
        path = synthetic_dataset(workdir / f"synthetic_{num_shards}", num_shards)
        print(f"{num_shards:6d} shard files: {time_to_first_batch(path) * 1000:7.1f} ms")

    print("\n## Time to first batch after resume")
    path = data / "train"
    from dataloader import MixEntry, TokenShardDataLoader

    template = (
        TokenShardDataLoader.Config(mix=[MixEntry(str(path))], seed=0)
        .build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=2048, local_batch_size=8)
        .state_dict()
    )
    for cursor in (16, 10**12):
        state = dict(template, num_sequences_consumed=cursor)
        saved = json.loads(state["state_json"])
        saved["datasets"][0]["sequences_consumed"] = cursor
        state["state_json"] = json.dumps(saved)
        print(f"cursor {cursor:>14,d} sequences: {time_to_first_batch(path, state) * 1000:7.1f} ms")

    print("\n## Prepare throughput (one core)")
    prepared, raw = prepare_throughput(data, workdir)
    print(f"prepare (read + encode + write + hash): {prepared / 1e6:.2f} M tokens/s; raw encode_batch: "
          f"{raw / 1e6:.2f} M tokens/s ({prepared / raw:.0%} of raw)")  # fmt: skip
    if args.workdir is None:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
