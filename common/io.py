"""Files, ports and command-line errors: the generic helpers every stage needs.

- atomic writes (temp file + fsync + rename: a reader sees the old file or the new one,
  never a torn one), also for a file written in pieces (`atomic_path`);
- JSONL appends, flushed and fsynced line by line, so a kill tears at most the last line;
- `check_folder_writable`, an output folder refused before the work, not after it;
- a free port outside the kernel's ephemeral range, for rendezvous stores and test servers;
- `run_cli` / `cli_error` / `ArgumentParser`, the one-line `error: ...` / exit 2 contract
  every command-line entry point keeps (`common.exit_codes.ExitCode.USER_ERROR`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from common.exit_codes import ExitCode


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
    a kill mid-write tears at most this line, which readers skip and count. A line a kill
    tore is ended first: the record would otherwise join it and be dropped with it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab+") as fh:
        end = fh.seek(0, os.SEEK_END)
        torn = end and os.pread(fh.fileno(), 1, end - 1) != b"\n"
        fh.write(b"\n" * bool(torn) + (json.dumps(record) + "\n").encode())
        fh.flush()
        os.fsync(fh.fileno())


def check_folder_writable(path: str | Path, what: str) -> None:
    """Refuse (ValueError naming `what`) a folder that cannot be made or written, before the
    work that writes there: its nearest existing ancestor is a file, or not ours to write."""
    path = Path(path)
    folder = next(p for p in (path, *path.parents) if p.exists())
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ValueError(
            f"{what} {path}: {folder} is not a folder this user can write; pick a path under one"
        )


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


# What free_port hands out: above the well-known service ports, below 65536, and never
# twice in one process (two servers asking one after the other get two ports).
_PORT_FLOOR = 10000
_ports_given: set[int] = set()


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for ports it assigns by itself (outgoing connections, bind to
    port 0): /proc/sys/net/ipv4/ip_local_port_range, else Linux's default."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a TCP server could listen on `port` of `host` now ("" = every address,
    IPv6 too where the host has it: what the c10d rendezvous store binds)."""
    families = [socket.AF_INET]
    if host == "" and socket.has_ipv6:
        families.append(socket.AF_INET6)
    for family in families:
        address = "::" if family == socket.AF_INET6 else host
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((address, port))
        except OSError as err:
            if family == socket.AF_INET6 and err.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                continue  # no IPv6 on this host
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, outside the kernel's ephemeral range.

    Why outside: the caller binds the port later (a rendezvous store, a test server), and
    until then any outgoing connection on the machine may be given a port from the
    ephemeral range, this one included; a port outside it is only taken by a program that
    asks for it by number. Tried in a random order, each checked with a bind (`port_is_free`).
    """
    low, high = ephemeral_port_range()
    candidates = [
        p for p in range(_PORT_FLOOR, 65536) if not low <= p <= high and p not in _ports_given
    ]
    if not candidates:  # a range that leaves nothing above the floor: anything unprivileged
        candidates = [p for p in range(1024, 65536) if not low <= p <= high]
    # the OS's randomness: no seeded or forked generator makes two processes pick alike
    for port in random.SystemRandom().sample(candidates, min(len(candidates), 200)):
        if port_is_free(port, host):
            _ports_given.add(port)
            return port
    raise OSError(f"no free TCP port on {host or 'this host'} outside the ephemeral range")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose usage error is the one line `error: ...` (exit 2) of every
    entry point, naming where the flags are listed (argparse prints its usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(ExitCode.USER_ERROR, f"error: {message}; {self.prog} --help lists the flags\n")


def cli_error(err: BaseException | str) -> int:
    """Print a user error as one line `error: ...` on stderr; returns the exit code (2)."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    return ExitCode.USER_ERROR


def run_cli(main: Callable[[], Any], errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run a command's body; a user error becomes one line `error: ...` and exit code 2.

    `ValueError` is the project's user-error type (bad flag, file, key or value, each
    message naming the thing and the fix); `errors` adds command-specific ones. So is an
    `OSError` on a named path (a file where a folder must be, no permission, a full disk):
    the path a user gave, or one under it. Anything else is a bug and keeps its traceback.
    An int that `main` returns is the exit code; anything else it returns means success."""
    try:
        result = main()
    except (ValueError, *errors) as err:
        return cli_error(err)
    except OSError as err:
        if err.filename is None:
            raise
        return cli_error(f"{err.filename}: {err.strerror}; check that path and its folders")
    return result if isinstance(result, int) else 0
