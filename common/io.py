"""Files, ports and command-line errors: the generic helpers every stage needs.

- atomic writes (temp file + fsync + rename: a reader sees the old file or the new one,
  never a torn one), also for a file written in pieces (`atomic_path`);
- JSONL appends, flushed and fsynced line by line, so a kill tears at most the last line;
- a free loopback port for test servers and single-node rendezvous;
- `run_cli` / `cli_error`, the one-line `error: ...` / exit 2 contract every command-line
  entry point keeps (`common.exit_codes.ExitCode.USER_ERROR`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from common.exit_codes import ExitCode

EXIT_USER_ERROR = ExitCode.USER_ERROR  # the old name, for code not yet on `common.exit_codes`


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield `path.tmp` to write; on success fsync it and rename it onto `path`.

    For writers that need a file name rather than bytes (memory maps, numpy, safetensors).
    On an exception the temp file is left for the next run to overwrite, `path` untouched."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    yield tmp
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` via `path.tmp` + fsync + os.replace (never a torn file)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_jsonl_atomic(path: str | Path, records: list[dict]) -> None:
    """A whole JSON-lines file, one object a line, atomically."""
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def append_jsonl(path: str | Path, record: dict) -> None:
    """Append one JSON line to `path` (its folder made if missing), flushed and fsynced:
    a kill mid-write tears at most this line, which readers skip and count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_jsonl(path: str | Path) -> tuple[list[dict], int]:
    """(the records of a JSON-lines file, how many lines were torn and skipped).

    A line cut short by a kill mid-append does not parse; it is dropped and counted so the
    caller can say so. Blank lines are not records and not counted."""
    records, num_torn = [], 0
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            num_torn += 1
    return records, num_torn


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def cli_error(err: BaseException | str) -> int:
    """Print a user error as one line `error: ...` on stderr; returns the exit code (2)."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    return ExitCode.USER_ERROR


def run_cli(main: Callable[[], Any], errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run a command's body; a user error becomes one line `error: ...` and exit code 2.

    `ValueError` is the project's user-error type (bad flag, file, key or value, each
    message naming the thing and the fix); `errors` adds command-specific ones. Anything
    else is a bug and keeps its traceback. An int that `main` returns is the exit code;
    anything else it returns means success."""
    try:
        result = main()
    except (ValueError, *errors) as err:
        return cli_error(err)
    return result if isinstance(result, int) else 0
