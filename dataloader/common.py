"""The data types and tokenizer helpers the other packages take from the dataloader.

Generic helpers (atomic writes, free ports, `step-N` names, `run_cli`) live one floor
down, in `common/`; what is here is about data and tokenizers:
- `MixEntry`, the one type for "this prepared dataset, this weight" that the loader, the
  run config's `[[dataloader.mix]]` and eval's held-out replay all use;
- unwrapping a tokenizer_config.json special token (a plain string or an AddedToken dict).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class MixEntry:
    """One prepared dataset (a dataloader.prepare split folder) and its sampling weight."""

    path: str
    weight: float = 1.0


def token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value
