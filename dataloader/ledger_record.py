"""The data ledger's record format: the row digest, positions as JSON, the loader's
parameters, and the chain of RUN/ledger.jsonl lines.

Why a room of its own: this is what the run writes (train/ledger/recorder.py, on every rank and
every step) and what every reader parses (`train.ledger.replay`,
`train.ledger.readers`). It must stay small and torch-free, and one change to a field
must be made here once. The why of the ledger as a whole, and its costs, are in
`train.ledger`'s essay.

What is here:
- the row digest: `row_lanes` hashes one trained row into three 31-bit lanes; `add_rows`
  sums a plan's rows into the five int64 lanes (rows, tokens, three hash lanes); the
  loader feeds a `StepTap` as it returns batches;
- positions: `cursor_to_json` and `cursor_from_json`, a few ints per dataset;
- `OrderParameters`: everything a segment's global order is a function of, read from a
  live loader (`of_loader`) or a record (`from_json`), and rebuilt as one rank whose local
  batch is a whole step (`build`);
- the chain: `canonical` JSON (keys sorted, without `chain`), `chain_hash`, `last_chain`
  (read from the file's tail), and `LedgerWriter`, which appends a record flushed (and
  fsynced when asked) and ends a line a kill tore;
- `step_record`: the record of one optimizer step, which `verify` recomputes field by
  field; and `read_lines`, a ledger streamed line by line.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from dataloader.global_order import Cursor, GlobalOrder, SchedulePhase, longest_seq_len
from dataloader.stream import STATE_FORMAT_VERSION, DatasetStream

LEDGER_VERSION = 1
GENESIS = "0" * 64  # the chain's value before the first record
NUM_LANES = 5  # rows, tokens, three 31-bit hash lanes
LANE_MASK = (1 << 31) - 1  # 2^31 x 2^32 rows still fit an int64 sum


# ------------------------------------------------------------------------ the row digest
def row_lanes(sequence: int, dataset: int, epoch: int, start: int, seq_len: int) -> tuple:
    """The three 31-bit hash lanes of one trained row (blake2b of its five ints)."""
    digest = hashlib.blake2b(
        struct.pack("<5q", sequence, dataset, epoch, start, seq_len), digest_size=12
    ).digest()
    return tuple(int.from_bytes(digest[i : i + 4], "little") & LANE_MASK for i in (0, 4, 8))


def add_rows(lanes: list[int], plan, seq_len: int) -> None:
    """Add the rows of a `global_order.Plan` ((dataset, on-disk start, epoch, sequence)
    each) of length `seq_len` to the five `lanes` in place."""
    for dataset, start, epoch, sequence in plan:
        row = (1, seq_len, *row_lanes(sequence, dataset, epoch, start, seq_len))
        for lane, value in enumerate(row):
            lanes[lane] += value


class StepTap:
    """What this rank's loader returned since the last `take`: the five digest lanes of its
    rows and the loader's position before the first of them. The loader feeds it from
    `__next__` (so it sees exactly the batches the trainer got); the recorder takes it once
    per optimizer step."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.lanes = [0] * NUM_LANES
        self.start: Cursor | None = None

    def add(self, plan, seq_len: int, before: Cursor) -> None:
        if self.start is None:
            self.start = before
        add_rows(self.lanes, plan, seq_len)

    def take(self) -> tuple[list[int], Cursor | None]:
        taken = (self.lanes, self.start)
        self.reset()
        return taken


# ------------------------------------------------------------------------ positions
def cursor_to_json(cursor: Cursor, orders) -> dict:
    """A loader position as the ledger writes it (a few ints per dataset)."""
    return {
        "n": cursor.num_sequences,
        "per_dataset": list(cursor.per_dataset),
        "mix_origin": cursor.mix_origin,
        "mix_origin_per_dataset": list(cursor.mix_origin_per_dataset),
        "positions": [o.position_state(p) for o, p in zip(orders, cursor.positions, strict=True)],
    }


def cursor_from_json(data: dict, orders) -> Cursor:
    positions = tuple(
        o.position_from_state({**state, "sequences_consumed": count})
        for o, state, count in zip(orders, data["positions"], data["per_dataset"], strict=True)
    )
    return Cursor(
        int(data["n"]),
        tuple(int(c) for c in data["per_dataset"]),
        int(data["mix_origin"]),
        tuple(int(c) for c in data["mix_origin_per_dataset"]),
        positions,
    )


# ------------------------------------------------------------------------ parameters
@dataclass
class OrderParameters:
    """Everything the global order of a segment is a function of (plus the step size)."""

    mix: list[dict]  # {"path": as configured, "abspath", "weight", "content_sha256"}
    seed: int
    seq_len: int  # the first phase's length (training.seq_len)
    schedule: list[dict]  # {"start_sequence", "weights" | None, "seq_len" | None}
    block_tokens: int
    shuffle_blocks: int
    skip_sequences: list[list[int]]  # the config's dataloader.skip_sequences
    sequences_per_step: int  # the global batch: global_batch_size sequences
    state_format: int = STATE_FORMAT_VERSION

    @classmethod
    def of_loader(cls, loader, sequences_per_step: int) -> OrderParameters:
        """The parameters a live `TokenShardDataLoader` runs with (read, not recomputed)."""
        config = loader.config
        return cls(
            mix=[  # path, weight, content_sha256 as fingerprinted
                {**part, "abspath": os.path.abspath(part["path"])}
                for part in loader.fingerprint_parts
            ],
            seed=config.seed,
            seq_len=loader.seq_len,
            schedule=[asdict(p) for p in loader.schedule],
            block_tokens=config.block_tokens,
            shuffle_blocks=config.shuffle_blocks,
            skip_sequences=[list(r) for r in config.skip_sequences],
            sequences_per_step=sequences_per_step,
            state_format=loader.state_format_version,
        )

    @classmethod
    def from_json(cls, data: dict) -> OrderParameters:
        return cls(**data)

    def build(self) -> GlobalOrder:
        """The segment's global order as one rank whose local batch is a whole step: the
        same rows, and the same position after each step, as any number of ranks."""
        phases = [SchedulePhase(**p) for p in self.schedule]
        longest = longest_seq_len(self.seq_len, phases)
        streams = [
            DatasetStream(
                dataset_path(entry),
                i,
                self.seed,
                max_seq_len=longest,
                block_tokens=self.block_tokens,
                shuffle_blocks=self.shuffle_blocks,
            )
            for i, entry in enumerate(self.mix)
        ]
        return GlobalOrder(
            streams,
            [entry["weight"] for entry in self.mix],
            phases,
            seq_len=self.seq_len,
            dp_world_size=1,
            dp_rank=0,
            local_batch_size=self.sequences_per_step,
        )


def dataset_path(entry: dict) -> str:
    """A mix entry's folder: as configured when it exists from here, else the absolute
    path the run resolved it to (verify may run from another folder)."""
    return entry["path"] if Path(entry["path"]).is_dir() else entry["abspath"]


# ------------------------------------------------------------------------ writing
def canonical(record: dict) -> str:
    """The bytes a record's chain hash covers: its JSON, keys sorted, without `chain`."""
    body = {k: v for k, v in record.items() if k != "chain"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def chain_hash(previous: str, record: dict) -> str:
    return hashlib.sha256((previous + canonical(record)).encode()).hexdigest()


def last_chain(path: Path) -> str:
    """The chain value of the last whole record of an existing ledger (GENESIS if none),
    reading only its tail: a ledger of a million steps costs a few KB at start-up."""
    if not path.is_file():
        return GENESIS
    size, span = path.stat().st_size, 1 << 16
    with open(path, "rb") as fh:
        while True:
            fh.seek(max(0, size - span))
            lines = fh.read().split(b"\n")
            if size > span:
                lines = lines[1:]  # the first may be cut by the seek
            for line in reversed(lines):
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue  # blank, or torn by a kill mid-append
                if isinstance(record, dict) and "chain" in record:
                    return record["chain"]
            if span >= size:
                return GENESIS
            span *= 4


class LedgerWriter:
    """Appends chained records to RUN/ledger.jsonl (rank 0's ledger writer thread,
    `train.ledger.recorder`). `append` writes a whole line and flushes it to the kernel, so a
    killed process (kill -9, an OOM kill) leaves it in the file: a kill tears at most the
    line being written. `sync` (fsync) makes what was appended survive a crash of the node
    too; the writer calls it every few steps and before each checkpoint."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.is_file() and self.path.stat().st_size:
            with open(self.path, "rb+") as fh:
                fh.seek(-1, os.SEEK_END)
                # a kill mid-append: end that line (the read left the file at its end), so
                # the next record is whole
                if fh.read(1) != b"\n":
                    fh.write(b"\n")
                    fh.flush()
                    os.fsync(fh.fileno())
        self.previous = last_chain(self.path)
        self._file = None

    def append(self, record: dict, *, sync: bool = True) -> dict:
        record = {**record, "chain": chain_hash(self.previous, record)}
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")  # noqa: SIM115 (held open: one open per run)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if sync:
            os.fsync(self._file.fileno())
        self.previous = record["chain"]
        return record

    def sync(self) -> None:
        """fsync what was appended."""
        if self._file is not None:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self.sync()
            self._file.close()
            self._file = None


def step_record(step: int, applied: bool, lanes, cursor: Cursor, order: GlobalOrder) -> dict:
    """The record of one optimizer step (what `verify` recomputes field by field)."""
    return {
        "kind": "step",
        "step": step,
        "applied": applied,
        "rows": int(lanes[0]),
        "tokens": int(lanes[1]),
        "digest": [int(x) for x in lanes[2:]],
        "cursor": cursor_to_json(cursor, order.datasets),
        "skipped": {
            "sequences": order.skipped_sequences(cursor.num_sequences),
            "tokens": order.skipped_tokens(cursor),
        },
    }


def read_lines(path: Path) -> Iterator[tuple[int, dict | None]]:
    """(line number, record or None when torn) for each non-blank line, streamed."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                yield number, None
                continue
            yield number, record if isinstance(record, dict) else None
