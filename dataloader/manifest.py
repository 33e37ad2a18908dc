"""The manifest of a prepared split: the single source of truth the loader trusts.

A split directory holds flat token shards (`shards/*.bin`, raw uint16/uint32 ids,
named in the manifest; a document never straddles two shards), one dataset-wide document index
(`documents.npy`: int64 start offsets of every document in the concatenated token
stream, plus the total as last entry) and `manifest.json`, written last and
atomically. The loader reads only the manifest and `documents.npy` at startup, so
startup cost does not grow with the number of shard files; shards are opened
(and their sizes checked) on first touch.

`Manifest.load` refuses anything that does not match what was recorded, with a
`ValueError` naming the file and the fix: a missing or truncated shard, a checksum
mismatch (with `verify=True`), a manifest from an unknown format version.

Format 2 adds `provenance` (`dataloader.provenance`: which source file and record each
document came from, in two files beside documents.npy); format 1 has none and still
loads and trains. `content_sha256` names the token stream alone, which both formats lay
out the same way (`STREAM_LAYOUT_VERSION`), so re-preparing the same inputs with format 2
keeps a run's fingerprint: it resumes onto the re-prepared data.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from common.io import write_json_atomic
from dataloader.tokenizer import sha256_file

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)  # 1: no provenance
STREAM_LAYOUT_VERSION = 1  # the token stream's layout, hashed into content_sha256
MANIFEST_NAME = "manifest.json"
DOCUMENTS_NAME = "documents.npy"
ON_EXHAUSTED_CHOICES = ("repeat", "stop")


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65535 else "uint32"


@dataclass(slots=True)
class ShardInfo:
    file: str  # relative to the split directory
    num_tokens: int
    num_documents: int
    bytes: int
    sha256: str


@dataclass(slots=True)
class Manifest:
    root: Path
    split: str
    tokenizer_sha256: str
    vocab_size: int
    bos_id: int
    eos_id: int
    dtype: str
    num_tokens: int
    num_documents: int
    num_empty_documents: int
    num_replaced_chars: int
    num_documents_with_replacements: int
    on_exhausted: str
    documents_bytes: int
    documents_sha256: str
    shards: list[ShardInfo]
    inputs: list[str] = field(default_factory=list)
    add_bos: bool = True
    add_eos: bool = True
    format_version: int = FORMAT_VERSION
    provenance: dict | None = None
    """Format 2: the provenance files' names, sizes and sha256s (`dataloader.provenance`)."""

    # ---- derived -------------------------------------------------------------
    @property
    def content_sha256(self) -> str:
        """Identity of the token stream: what the loader's fingerprint is built from."""
        digest = hashlib.sha256()
        digest.update(f"{STREAM_LAYOUT_VERSION}|{self.dtype}|{self.tokenizer_sha256}|".encode())
        digest.update(self.documents_sha256.encode())
        for shard in self.shards:
            digest.update(shard.sha256.encode())
        return digest.hexdigest()

    @property
    def documents_path(self) -> Path:
        return self.root / DOCUMENTS_NAME

    # ---- io ------------------------------------------------------------------
    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("root")
        out["content_sha256"] = self.content_sha256
        return out

    @classmethod
    def load(cls, path: str | Path, *, verify: bool = False, check_files: bool = True) -> Manifest:
        """Parse DIR/manifest.json (or the file itself) and check the files it lists.

        check_files: every file exists with its recorded size (a stat per shard).
        verify: additionally recompute every sha256 (reads all data).
        """
        path = Path(path)
        manifest_path = path / MANIFEST_NAME if path.is_dir() or not path.suffix else path
        if not manifest_path.is_file():
            raise ValueError(
                f"{manifest_path}: no manifest; prepare the data first with "
                "`python -m dataloader.prepare --out DATA ...` and point at DATA/train or DATA/val"
            )
        try:
            raw = json.loads(manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(
                f"{manifest_path}: corrupt manifest ({err}); re-run dataloader.prepare"
            ) from None
        if raw.get("format_version") not in READABLE_FORMATS:
            raise ValueError(
                f"{manifest_path}: format_version {raw.get('format_version')!r}, this code reads "
                f"{' and '.join(map(str, READABLE_FORMATS))}; re-run dataloader.prepare with this version"
            )
        recorded_content = raw.pop("content_sha256", None)
        try:
            raw["shards"] = [ShardInfo(**s) for s in raw["shards"]]
            manifest = cls(root=manifest_path.parent, **raw)
        except (TypeError, KeyError) as err:
            raise ValueError(
                f"{manifest_path}: malformed manifest ({err}); re-run dataloader.prepare"
            ) from None
        if recorded_content != manifest.content_sha256:
            raise ValueError(
                f"{manifest_path}: content_sha256 does not match its shard list; re-run dataloader.prepare"
            )
        if manifest.on_exhausted not in ON_EXHAUSTED_CHOICES:
            raise ValueError(
                f"{manifest_path}: on_exhausted {manifest.on_exhausted!r} not in {ON_EXHAUSTED_CHOICES}"
            )
        files = []  # (name in the split folder, bytes, sha256) of what is checked
        if check_files or verify:
            files.append((DOCUMENTS_NAME, manifest.documents_bytes, manifest.documents_sha256))
            files += [(shard.file, shard.bytes, shard.sha256) for shard in manifest.shards]
        if verify and manifest.provenance:  # metadata: the loader never needs it
            entry = manifest.provenance
            files += [
                tuple(entry[f"{n}_{k}"] for k in ("file", "bytes", "sha256"))
                for n in ("runs", "sources")
            ]
        for name, size, sha256 in files:
            manifest.check_file(manifest.root / name, size, sha256 if verify else None)
        return manifest

    def check_file(self, path: Path, size: int, sha256: str | None = None) -> None:
        fix = "re-run `python -m dataloader.prepare` with the same --out to rebuild it"
        if not path.is_file():
            raise ValueError(f"{path}: missing file listed in {self.root / MANIFEST_NAME}; {fix}")
        actual = path.stat().st_size
        if actual != size:
            raise ValueError(
                f"{path}: {actual} bytes, manifest records {size} (truncated or overwritten); {fix}"
            )
        if sha256 is not None and sha256_file(path) != sha256:
            raise ValueError(
                f"{path}: sha256 mismatch with {self.root / MANIFEST_NAME} (corrupt); {fix}"
            )

    def check_shard(self, index: int) -> None:
        """A shard's size, on its first read (also what the format-1 and format-2 loaders
        that tests/dataloader/test_loader.py runs from git call)."""
        shard = self.shards[index]
        self.check_file(self.root / shard.file, shard.bytes)

    def load_document_starts(self) -> np.ndarray:
        """int64 [num_documents + 1]: start of each document in the token stream, then the total."""
        self.check_file(self.documents_path, self.documents_bytes)
        starts = np.load(self.documents_path, mmap_mode="r")
        if starts.shape != (self.num_documents + 1,) or int(starts[-1]) != self.num_tokens:
            raise ValueError(
                f"{self.documents_path}: does not match {self.root / MANIFEST_NAME}; re-run dataloader.prepare"
            )
        return np.asarray(starts)

    # ---- compatibility checks --------------------------------------------------
    def check_vocab(self, model_vocab_size: int) -> None:
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"{self.root / MANIFEST_NAME}: tokenizer vocab {self.vocab_size} is larger than the "
                f"model's vocab_size {model_vocab_size}; token ids would index past the embedding. "
                f"Set model.vocab_size >= {self.vocab_size} or prepare with a smaller tokenizer"
            )

    def check_tokenizer(self, tokenizer_json: str | Path) -> None:
        actual = sha256_file(tokenizer_json)
        if actual != self.tokenizer_sha256:
            raise ValueError(
                f"{self.root / MANIFEST_NAME}: prepared with a different tokenizer (sha256 "
                f"{self.tokenizer_sha256[:12]}, {tokenizer_json} is {actual[:12]}); use the "
                "tokenizer in DATA/tokenizer or re-run dataloader.prepare with this one"
            )


def write_token_split(
    root: Path, tokens: np.ndarray, starts: np.ndarray, shard_bounds: list[int], vocab_size: int
) -> Manifest:
    """Write an already-tokenized split in the real on-disk format: `tokens` (the whole
    stream), `starts` (its document index, the total last) and `shard_bounds` (document
    indices where shards begin, then the document count). For benchmarks and tests that
    need exact token layouts without a tokenizer; the manifest is written last, atomically,
    so the split reads as prepared only when complete."""
    assert shard_bounds[0] == 0 and shard_bounds[-1] == len(starts) - 1, shard_bounds
    dtype = dtype_for_vocab(vocab_size)
    (root / "shards").mkdir(parents=True)
    np.save(root / DOCUMENTS_NAME, np.asarray(starts, dtype=np.int64))
    shards = []
    for j, (lo, hi) in enumerate(zip(shard_bounds[:-1], shard_bounds[1:], strict=True)):
        name = f"shards/{j:05d}.bin"
        part = np.asarray(tokens[starts[lo] : starts[hi]], dtype=dtype)
        part.tofile(root / name)
        shards.append(ShardInfo(name, part.size, hi - lo, part.nbytes, sha256_file(root / name)))
    return write_untokenized_manifest(root, shards, vocab_size, sha256_file(root / DOCUMENTS_NAME))


def write_untokenized_manifest(
    root: Path, shards: list[ShardInfo], vocab_size: int, documents_sha256: str = "0" * 64
) -> Manifest:
    """The manifest of a split whose shards and documents.npy are already written and no
    tokenizer made (`write_token_split`; benchmarks' synthetic corpora, which pass
    placeholder checksums: no loader verifies them at start-up). Written atomically."""
    num_tokens = int(np.load(root / DOCUMENTS_NAME, mmap_mode="r")[-1])
    manifest = Manifest(
        root=root,
        split=root.name,
        tokenizer_sha256="0" * 64,  # no tokenizer made these ids
        vocab_size=vocab_size,
        bos_id=0,
        eos_id=1,
        dtype=dtype_for_vocab(vocab_size),
        num_tokens=num_tokens,
        num_documents=sum(s.num_documents for s in shards),
        num_empty_documents=0,
        num_replaced_chars=0,
        num_documents_with_replacements=0,
        on_exhausted="repeat",
        documents_bytes=(root / DOCUMENTS_NAME).stat().st_size,
        documents_sha256=documents_sha256,
        shards=shards,
    )
    write_json_atomic(root / MANIFEST_NAME, manifest.to_json())
    return manifest
