"""The few helpers every stage of the pipeline needs, in one torch-free module.

Why here: imports flow one way, dataloader <- train <- eval <- scripts, so the one module
that all four may import is at the bottom of that chain. It imports only the standard
library, so `python -m eval --help`, `dataloader.prepare`'s worker processes and the SLURM
helper scripts can use it without paying for torch.

What lives here, and nothing else:
- atomic writes (temp file + fsync + rename: a reader sees the old file or the new one,
  never a torn one);
- a free loopback port for test servers and single-node rendezvous;
- the `step-N` naming of checkpoint folders (torchtitan's `CheckpointManager` layout);
- unwrapping a tokenizer_config.json special token (a plain string or an AddedToken dict);
- `run_cli`, the one-line `error: ...` / exit 2 contract every command-line entry point keeps;
- `MixEntry`, the one type for "this prepared dataset, this weight" that the loader, the
  run config's `[[dataloader.mix]]` and eval's held-out replay all use.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class MixEntry:
    """One prepared dataset (a dataloader.prepare split folder) and its sampling weight."""

    path: str
    weight: float = 1.0


# torchtitan's CheckpointManager writes RUN/checkpoint/step-N
STEP_DIR_PATTERN = re.compile(r"^step-(\d+)$")


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` via `path.tmp` + fsync + os.replace (never a torn file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def parse_step_dir(name: str) -> int | None:
    """N for a folder named `step-N`, else None."""
    match = STEP_DIR_PATTERN.match(name)
    return int(match.group(1)) if match else None


def token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def run_cli(main: Callable[[], Any], errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run a command's body; a user error becomes one line `error: ...` and exit code 2.

    `ValueError` is the project's user-error type (bad flag, file, key or value, each
    message naming the thing and the fix); `errors` adds command-specific ones. Anything
    else is a bug and keeps its traceback. An int that `main` returns is the exit code;
    anything else it returns means success."""
    try:
        result = main()
    except (ValueError, *errors) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return result if isinstance(result, int) else 0
