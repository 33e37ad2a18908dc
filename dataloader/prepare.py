"""`python -m dataloader.prepare`: raw text -> tokenizer + token shards + manifests.

Why it is built this way:
- The loader must never repeat or skip a sample, so its input must be immutable
  and self-describing: every file is checksummed in a manifest written last.
- Preparing a large corpus takes hours, so it resumes: documents are grouped into
  shard-sized chunks in a deterministic order; each chunk becomes one shard file
  written under a temp name and `os.replace`d, then a sidecar `NNNNN.json`
  (recording the chunk's input hash, tokenizer hash, size and sha256) marks it
  finished. A re-run keeps every shard whose sidecar still matches and redoes the
  rest. A crash never leaves a half-written shard that looks whole.
- Chunks are tokenized in a process pool (one process per core, tokenizers' own
  Rayon threads pinned to 1 per process so the cores are not oversubscribed).
- Nothing is dropped silently: empty documents and replaced non-UTF-8 bytes are
  counted, printed and recorded in the manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dataloader.common import run_cli, write_bytes_atomic, write_json_atomic
from dataloader.corpus import Document, iter_documents
from dataloader.manifest import (
    DOCUMENTS_NAME,
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


@dataclass
class SplitStats:
    num_documents: int = 0
    num_empty_documents: int = 0
    num_replaced_chars: int = 0
    num_documents_with_replacements: int = 0
    num_shards: int = 0
    num_shards_kept: int = 0


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
    index: int
    texts: list[str]
    input_sha256: str
    tokenizer_sha256: str
    bos_id: int
    eos_id: int
    dtype: str


def _paths(shard_dir: Path, index: int) -> tuple[Path, Path, Path]:
    stem = f"{index:05d}"
    return shard_dir / f"{stem}.bin", shard_dir / f"{stem}.docs.npy", shard_dir / f"{stem}.json"


def _write_shard(job: ShardJob) -> dict:
    """Tokenize one chunk and write its shard, doc-length file and sidecar (last)."""
    arrays = encode_documents(
        _worker_tokenizer, job.texts, job.bos_id, job.eos_id, np.dtype(job.dtype)
    )
    tokens = np.concatenate(arrays)
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    bin_path, docs_path, sidecar_path = _paths(Path(job.shard_dir), job.index)
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
    import io

    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _finished_sidecar(job: ShardJob) -> dict | None:
    """The sidecar of a shard finished by an earlier run on the same input, else None."""
    bin_path, docs_path, sidecar_path = _paths(Path(job.shard_dir), job.index)
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


# ---- main side -------------------------------------------------------------------
def _texts_sha256(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8", errors="surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def _chunks(config: PrepareConfig, stats: dict[str, SplitStats]) -> Iterator[tuple[str, list[str]]]:
    """(split, texts) chunks of about `shard_chars` characters, counting as it goes."""
    pending: dict[str, list[str]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    for doc in iter_documents(config.inputs, config.text_field, config.doc_separator):
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
            yield split, pending[split]
            pending[split], sizes[split] = [], 0
    for split in ("train", "val"):
        if pending[split]:
            yield split, pending[split]


def _trained_tokenizer(config: PrepareConfig, tok_dir: Path) -> Path:
    """Train (or, on resume with the same inputs, reuse) the BPE tokenizer."""
    stamp = {
        "vocab_size": config.train_tokenizer,
        "inputs": config.inputs,
        "text_field": config.text_field,
        "doc_separator": config.doc_separator,
    }
    stamp_path = tok_dir / "trained_from.json"
    if (tok_dir / "tokenizer.json").is_file() and stamp_path.is_file():
        if json.loads(stamp_path.read_text()) == stamp:
            print(f"reusing tokenizer trained earlier in {tok_dir}", file=sys.stderr)
            return tok_dir / "tokenizer.json"
    texts = (
        d.text
        for d in iter_documents(config.inputs, config.text_field, config.doc_separator)
        if d.text.strip()
    )
    tokenizer = train_bpe(texts, config.train_tokenizer)
    path = install_tokenizer(None, tokenizer, tok_dir)
    write_json_atomic(stamp_path, stamp)
    return path


def prepare(config: PrepareConfig) -> dict[str, Manifest]:
    if (config.tokenizer is None) == (config.train_tokenizer is None):
        raise ValueError("pass exactly one of --tokenizer DIR or --train-tokenizer VOCAB_SIZE")
    if not 0.0 <= config.val_fraction < 1.0:
        raise ValueError(f"--val-fraction {config.val_fraction}: must be in [0, 1)")
    if config.on_exhausted not in ON_EXHAUSTED_CHOICES:
        raise ValueError(
            f"--on-exhausted {config.on_exhausted!r}: choose from {ON_EXHAUSTED_CHOICES}"
        )
    out = Path(config.out)
    tok_dir = out / "tokenizer"
    if config.train_tokenizer is not None:
        tokenizer_json = _trained_tokenizer(config, tok_dir)
    else:
        tokenizer_json = install_tokenizer(config.tokenizer, None, tok_dir)
    tok_config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    bos_id, eos_id, _, _ = load_special_ids(tokenizer_json, tok_config)
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    dtype = dtype_for_vocab(vocab_size)
    tokenizer_sha256 = sha256_file(tokenizer_json)

    splits = ["train", "val"] if config.val_fraction > 0 else ["train"]
    for split in splits:
        (out / split / "shards").mkdir(parents=True, exist_ok=True)
    stats = {"train": SplitStats(), "val": SplitStats()}
    sidecars: dict[str, list[dict]] = {"train": [], "val": []}

    def jobs() -> Iterator[ShardJob]:
        for split, texts in _chunks(config, stats):
            index = stats[split].num_shards
            stats[split].num_shards += 1
            yield ShardJob(
                str(out / split / "shards"), index, texts, _texts_sha256(texts),
                tokenizer_sha256, bos_id, eos_id, dtype,
            )  # fmt: skip

    bar = tqdm(desc="prepare", unit="doc", disable=not config.progress, file=sys.stderr)

    def collect(split: str, index: int, num_docs: int, sidecar: dict) -> None:
        rows = sidecars[split]
        rows.extend([None] * (index + 1 - len(rows)))
        rows[index] = sidecar
        bar.update(num_docs)

    single_process = config.num_workers <= 1
    pool = None
    if not single_process:
        pool = multiprocessing.get_context("spawn").Pool(
            config.num_workers, initializer=_init_worker, initargs=(str(tokenizer_json), True)
        )
    else:
        _init_worker(str(tokenizer_json), False)
    try:
        in_flight = []
        for job in jobs():
            split = "val" if Path(job.shard_dir).parent.name == "val" else "train"
            done = _finished_sidecar(job)
            if done is not None:
                stats[split].num_shards_kept += 1
                collect(split, job.index, len(job.texts), done)
                continue
            if pool is None:
                collect(split, job.index, len(job.texts), _write_shard(job))
                continue
            in_flight.append(
                (split, job.index, len(job.texts), pool.apply_async(_write_shard, (job,)))
            )
            # Bound memory: at most two chunks per worker are held in flight.
            while len(in_flight) >= 2 * config.num_workers:
                s, i, n, result = in_flight.pop(0)
                collect(s, i, n, result.get())
        for s, i, n, result in in_flight:
            collect(s, i, n, result.get())
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        bar.close()

    manifests = {}
    for split in splits:
        split_stats = stats[split]
        if split_stats.num_documents == 0:
            what = (
                "the inputs"
                if split == "train"
                else f"the val split (--val-fraction {config.val_fraction})"
            )
            raise ValueError(
                f"no non-empty documents in {what} {config.inputs} "
                f"({split_stats.num_empty_documents} empty); check --input and --text-field"
                + ("" if split == "train" else ", or raise --val-fraction")
            )
        manifests[split] = _write_split(
            out / split, split, sidecars[split], split_stats, config, tokenizer_sha256,
            vocab_size, bos_id, eos_id, dtype,
        )  # fmt: skip
    if config.val_fraction <= 0 and (out / "val" / MANIFEST_NAME).exists():
        (out / "val" / MANIFEST_NAME).unlink()  # a stale val split from an earlier run
    _report(out, manifests, stats)
    return manifests


def _write_split(
    split_dir, split, sidecars, stats, config, tokenizer_sha256, vocab_size, bos_id, eos_id, dtype
):
    shard_dir = split_dir / "shards"
    lengths = [np.load(_paths(shard_dir, i)[1]) for i in range(len(sidecars))]
    # Shards beyond this run's count (from an earlier run on more input) are stale.
    for stale in shard_dir.iterdir():
        stem = stale.name.split(".")[0]
        if stale.name.endswith(".tmp") or (stem.isdigit() and int(stem) >= len(sidecars)):
            stale.unlink()
    all_lengths = np.concatenate(lengths)
    starts = np.zeros(all_lengths.size + 1, dtype=np.int64)
    np.cumsum(all_lengths, out=starts[1:])
    write_bytes_atomic(split_dir / DOCUMENTS_NAME, _npy_bytes(starts))
    manifest = Manifest(
        root=split_dir,
        split=split,
        tokenizer_sha256=tokenizer_sha256,
        vocab_size=vocab_size,
        bos_id=bos_id,
        eos_id=eos_id,
        dtype=dtype,
        num_tokens=int(starts[-1]),
        num_documents=int(all_lengths.size),
        num_empty_documents=stats.num_empty_documents,
        num_replaced_chars=stats.num_replaced_chars,
        num_documents_with_replacements=stats.num_documents_with_replacements,
        on_exhausted=config.on_exhausted,
        documents_bytes=(split_dir / DOCUMENTS_NAME).stat().st_size,
        documents_sha256=sha256_file(split_dir / DOCUMENTS_NAME),
        shards=[
            ShardInfo(
                f"shards/{i:05d}.bin", s["num_tokens"], s["num_documents"], s["bytes"], s["sha256"]
            )
            for i, s in enumerate(sidecars)
        ],
        inputs=list(config.inputs),
    )
    assert manifest.num_documents == stats.num_documents, (
        manifest.num_documents,
        stats.num_documents,
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
    args = parser.parse_args(argv)  # fmt: skip
    return PrepareConfig(
        inputs=args.inputs, out=args.out, tokenizer=args.tokenizer, train_tokenizer=args.train_tokenizer,
        text_field=args.text_field, doc_separator=args.doc_separator, val_fraction=args.val_fraction,
        on_exhausted=args.on_exhausted, shard_chars=args.shard_chars, num_workers=args.num_workers,
        verify=args.verify, progress=not args.no_progress,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    return run_cli(lambda: prepare(config))


if __name__ == "__main__":
    sys.exit(main())
