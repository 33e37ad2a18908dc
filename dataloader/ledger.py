"""The data ledger: which windows every optimizer step trained, recorded by the run and
recomputed by anyone from the config, the manifests and the incidents alone.

Why: the loader's promise (every window of the corpus exactly once, across crashes,
rollbacks, reshards and seq_len changes) is the heart of this project, and audits ask for
it in writing: for licensing, an opt-out or a contamination check, *which documents did
this checkpoint train on, and did it see each one exactly once?* The order is a pure
function of (seed, manifests, mix and seq_len schedules, skip ranges), so the answer can
be recomputed; what the ledger adds is evidence of what the ranks *actually* did, so that
a recomputation that agrees with it is a proof, and one that does not names the step.

What the run records (`RUN/ledger.jsonl`, `common.run_layout.LEDGER`; rank 0 appends one
JSON line per optimizer step, fsynced, through `LedgerWriter`):

* A *step record* per optimizer step, written after the update was applied or skipped
  (train/ledger.py, called once from `RunTrainer.train_step`): whether the update was
  applied, the step's row digest, the loader's position after the step (`Cursor`, a few
  ints per dataset) and its counters of what was skipped: sequences in skip ranges
  (rollbacks, `dataloader.skip_sequences`), and input tokens dropped at block tails and
  seq_len group cuts. Its size is fixed by the number of datasets in the mix, never by the
  corpus or the step count: O(steps) bytes in all, ~0.4 KB a step for one dataset.
* The *row digest* is what makes it a record of what the ranks trained rather than of what
  rank 0 believes: each rank hashes each row its loader returned during the step,
  (global sequence, dataset, epoch, on-disk start, seq_len), into three 31-bit lanes, and
  sums them with a row count and a token count into five int64 lanes (`StepTap`, fed by the
  loader itself as it returns batches). Sums are order-free and fixed-size, so one extra
  all_reduce of 40 bytes per step combines all ranks (no O(W) gather; on NCCL a few tens
  of microseconds, latency-bound), and the digest does not depend on how the step's rows
  were dealt, which is why a resize 2 -> 3 -> 1 keeps one chain: the global order does not
  depend on the number of ranks, and neither does the record. A rank that read the wrong
  rows (a missing, repeated or misplaced window) changes the sums; a wrong row escapes only
  if its three random 31-bit lanes happen to cancel (~2^-93). With tensor, context or
  pipeline parallelism several ranks hold the same rows; the recorder divides by the
  number of copies, and copies that disagree cannot divide evenly (flagged).
* A *segment record* before the first step of each process start and of each loss-spike
  rollback: why the segment began (`start`, `resume` from checkpoint step c, `rollback` to
  checkpoint step c), the loader parameters it ran with (`OrderParameters`: mix paths,
  weights and manifest content hashes, seed, seq_len, schedule, block sizes, skip ranges,
  sequences per step), how many incidents of RUN/incidents.jsonl were in force, a sha256 of
  RUN/config.toml, the layout (ranks, data-parallel degree, local batch, accumulation) and
  the loader's position when the segment began.
* Each record carries `chain` = sha256(previous record's chain + the record's canonical
  JSON): a record edited or removed without rewriting every later one breaks the chain at
  that record. The chain is not a signature (anyone can rewrite a file end to end); what
  makes a ledger trustworthy is that `verify` recomputes every field of every record
  independently, so a rewritten ledger must also be a correct one.

Lineage. Steps recorded after the last checkpoint before a kill -9 are trained again after
the resume, and a rollback goes back to an earlier checkpoint: the file is chronological,
and a segment that continues from step c *supersedes* every record of a later step of the
lineage it leaves. `verify` follows the chain in file order, recomputes superseded records
too (they happened: a rollback's skipped data was drawn by them) and reports them; the final
lineage is what the last checkpoint descends from. A rollback keeps the loader where it was
(train/health.py `handle_spike`), so its segment must start at the position after the spike
step, and the skip range its incident records must be [position after step c, position
after the spike): both are checked.

Verification (`python -m dataloader.ledger verify RUN`, torch-free). It rebuilds the
global order of each segment with the loader's own code (`dataloader.global_order`,
`dataloader.stream`: there is no second implementation of the order) as one rank with a
local batch of one whole step, which yields the same rows and the same position after the
step as any number of ranks (a round of W x B sequences is "the next W x B outside the skip
ranges"), and compares every step's digest, position and counters. The parameters come
from the segment record, checked against what can be checked independently: the manifests'
content hashes on disk; the skip ranges against the config's `skip_sequences` plus the
first k incidents of RUN/incidents.jsonl; the last segment's against RUN/config.toml (the
schedule through `global_order.schedule_from_steps`, the rule train/build.py applies); and
the position at each resume against the ledger's own record of the checkpointed step. A
finding is one line; the exit status is 1 at the first mismatch (naming the step) or at a
gap (steps the ledger cannot vouch for, e.g. a run resumed from a checkpoint written before
it had a ledger), 0 when every step of the final lineage verified.

`which RUN --step N` plans step N from the position recorded before it and names each
row's documents through documents.npy and the manifest's provenance (source file and
record, `dataloader.provenance`). `coverage RUN` counts per dataset, by interval arithmetic
over the windows (never per token), the input tokens trained once and more than once within
an epoch (must be 0), skipped (skip ranges, group cuts and block tails, steps whose update
was not applied) and not reached yet. Costs: scripts/bench_ledger.py,
docs/bench/ledger-2026-11-24.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from common.io import append_jsonl, run_cli
from common.run_layout import CONFIG, INCIDENTS, LEDGER
from dataloader.global_order import Cursor, GlobalOrder, SchedulePhase, schedule_from_steps
from dataloader.manifest import Manifest
from dataloader.stream import STATE_FORMAT_VERSION, DatasetStream

LEDGER_VERSION = 1
GENESIS = "0" * 64  # the chain's value before the first record
SPIKE_KIND = "loss_spike"  # the incidents this reads (train/health.py writes them)
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
        h0, h1, h2 = row_lanes(sequence, dataset, epoch, start, seq_len)
        lanes[0] += 1
        lanes[1] += seq_len
        lanes[2] += h0
        lanes[3] += h1
        lanes[4] += h2


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
        phases = [
            p if isinstance(p, SchedulePhase) else SchedulePhase(**p) for p in config.schedule
        ]
        return cls(
            mix=[
                {
                    "path": entry.path,
                    "abspath": os.path.abspath(entry.path),
                    "weight": entry.weight,
                    "content_sha256": part["content_sha256"],
                }
                for entry, part in zip(loader.mix, loader.fingerprint_parts, strict=True)
            ],
            seed=config.seed,
            seq_len=loader.seq_len,
            schedule=[asdict(p) for p in phases],
            block_tokens=config.block_tokens,
            shuffle_blocks=config.shuffle_blocks,
            skip_sequences=[list(r) for r in config.skip_sequences],
            sequences_per_step=sequences_per_step,
            state_format=loader.state_format_version,
        )

    @classmethod
    def from_json(cls, data: dict) -> OrderParameters:
        return cls(**data)

    def phases(self) -> list[SchedulePhase]:
        return [SchedulePhase(**p) for p in self.schedule]

    def build(self) -> GlobalOrder:
        """The segment's global order as one rank whose local batch is a whole step: the
        same rows, and the same position after each step, as any number of ranks."""
        phases = self.phases()
        longest = max([self.seq_len] + [p.seq_len for p in phases if p.seq_len])
        streams = [
            DatasetStream(
                _dataset_path(entry),
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


def _dataset_path(entry: dict) -> str:
    """A mix entry's folder: as configured when it exists from here, else the absolute
    path the run resolved it to (verify may run from another folder)."""
    return entry["path"] if Path(entry["path"]).is_dir() else entry["abspath"]


def parameters_from_run_config(path: Path) -> dict:
    """What RUN/config.toml says the loader runs with, in `OrderParameters`' terms (the
    keys a resolved config always holds; the mapping of the schedule is the trainer's own,
    `schedule_from_steps`)."""
    with open(path, "rb") as fh:
        config = tomllib.load(fh)
    data, training = config.get("dataloader", {}), config.get("training", {})
    per_step = int(training.get("global_batch_size", -1))
    phases = [
        SimpleNamespace(**{"weights": [], "seq_len": 0, **p}) for p in data.get("schedule", [])
    ]
    return {
        "mix": [(m["path"], float(m.get("weight", 1.0))) for m in data.get("mix", [])],
        "seed": data.get("seed"),
        "seq_len": training.get("seq_len"),
        "schedule": [asdict(p) for p in schedule_from_steps(phases, per_step)],
        "block_tokens": data.get("block_tokens"),
        "shuffle_blocks": data.get("shuffle_blocks"),
        "skip_sequences": [list(r) for r in data.get("skip_sequences", [])],
        "sequences_per_step": per_step if per_step > 0 else None,
    }


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
    """Appends chained records to RUN/ledger.jsonl, each flushed and fsynced (rank 0)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.is_file() and self.path.stat().st_size:
            with open(self.path, "rb") as fh:
                fh.seek(-1, os.SEEK_END)
                torn = fh.read(1) != b"\n"
            if torn:  # a kill mid-append: end that line, so the next record is whole
                with open(self.path, "ab") as fh:
                    fh.write(b"\n")
                    fh.flush()
                    os.fsync(fh.fileno())
        self.previous = last_chain(self.path)

    def append(self, record: dict) -> dict:
        record = {**record, "chain": chain_hash(self.previous, record)}
        append_jsonl(self.path, record)  # flushed and fsynced: a kill tears at most this line
        self.previous = record["chain"]
        return record


def step_record(step: int, applied: bool, lanes, cursor: Cursor, orders, order) -> dict:
    """The record of one optimizer step (what `verify` recomputes field by field)."""
    skipped_tokens = sum(o.skipped_tokens(p) for o, p in zip(orders, cursor.positions, strict=True))
    return {
        "kind": "step",
        "step": step,
        "applied": applied,
        "rows": int(lanes[0]),
        "tokens": int(lanes[1]),
        "digest": [int(x) for x in lanes[2:]],
        "cursor": cursor_to_json(cursor, orders),
        "skipped": {
            "sequences": order.skipped_sequences(cursor.num_sequences),
            "tokens": skipped_tokens,
        },
    }


# ------------------------------------------------------------------------ reading back
@dataclass
class Finding:
    """One line of `verify`'s report."""

    level: str  # "ok", "note", "superseded", "GAP" or "MISMATCH"
    text: str
    step: int | None = None

    @property
    def bad(self) -> bool:
        return self.level in ("GAP", "MISMATCH")

    def line(self) -> str:
        where = f"step {self.step}: " if self.step is not None else ""
        return f"{self.level:<10} {where}{self.text}"


@dataclass
class Segment:
    index: int
    line: int  # 1-based line in the ledger
    record: dict
    params: OrderParameters
    order: GlobalOrder | None = None  # built when the segment is recomputed
    start: Cursor | None = None


@dataclass
class StepEntry:
    """One step record as the replay saw it."""

    line: int
    segment: int
    record: dict
    before: dict  # the position before the step (ledger JSON)
    rows: np.ndarray | None = None  # (k, 5): sequence, dataset, epoch, start, seq_len
    skipped_rows: np.ndarray | None = None  # skip-range rows drawn in this step's span


def _read_lines(path: Path) -> Iterator[tuple[int, dict | None]]:
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


def read_spike_incidents(run_dir: Path) -> list[dict]:
    path = run_dir / INCIDENTS
    if not path.is_file():
        return []
    out = []
    for _, record in _read_lines(path):
        if record is not None and record.get("kind") == SPIKE_KIND:
            out.append(record)
    return out


class Replay:
    """RUN/ledger.jsonl walked in file order: the chain checked, lineage followed, and
    (with `recompute`) every record recomputed from the loader's own order.

    After `run()`: `findings` (in order), `final` (step -> its `StepEntry` in the final
    lineage), `superseded` (the `StepEntry`s a later segment went back past), `segments`.
    With `collect_rows` each recomputed step keeps its rows (for `coverage`)."""

    def __init__(self, run_dir: str | Path, *, recompute: bool = True, collect_rows=False):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LEDGER
        if not self.path.is_file():
            raise ValueError(
                f"{self.path}: no ledger; is {self.run_dir} a training run folder? (runs "
                "write it from their first step; a run started before the ledger existed "
                "has none)"
            )
        self.recompute, self.collect_rows = recompute, collect_rows
        self.findings: list[Finding] = []
        self.segments: list[Segment] = []
        self.final: dict[int, StepEntry] = {}
        self.superseded: list[StepEntry] = []
        self.after: dict[int, dict] = {}  # step -> position after it (latest execution)
        self.incidents = read_spike_incidents(self.run_dir)
        self.num_torn = 0
        self._cursor: Cursor | None = None
        self._last_step: int | None = None

    def note(self, level: str, text: str, step: int | None = None) -> None:
        self.findings.append(Finding(level, text, step))

    @property
    def first_bad(self) -> Finding | None:
        return next((f for f in self.findings if f.bad), None)

    # ---- the walk
    def run(self) -> Replay:
        previous = GENESIS
        for line, record in _read_lines(self.path):
            if record is None:
                self.num_torn += 1
                self.note(
                    "note", f"line {line} is torn (a kill mid-append); it is not in the chain"
                )
                continue
            expected = chain_hash(previous, record)
            if record.get("chain") != expected:
                self.note(
                    "MISMATCH",
                    f"line {line}: chain hash broken (this record was edited, or one before "
                    "it removed)",
                    record.get("step"),
                )
            previous = record.get("chain", expected)
            kind = record.get("kind")
            try:
                if kind == "segment":
                    self._segment(line, record)
                elif kind == "step":
                    self._step(line, record)
                else:
                    self.note("MISMATCH", f"line {line}: unknown record kind {kind!r}")
            except (KeyError, TypeError, ValueError, IndexError) as err:  # damaged or edited
                step = record.get("step", record.get("continues_from"))
                self.note("MISMATCH", f"line {line}: unreadable {kind} record ({err!r})", step)
        self._finish()
        return self

    def _segment(self, line: int, record: dict) -> None:
        if record.get("version") != LEDGER_VERSION:
            raise ValueError(
                f"ledger version {record.get('version')!r}; this code reads version "
                f"{LEDGER_VERSION}"
            )
        params = OrderParameters.from_json(record["params"])
        segment = Segment(len(self.segments), line, record, params)
        previous = self.segments[-1] if self.segments else None
        self.segments.append(segment)
        cause, origin = record["cause"], int(record["continues_from"])
        if cause not in ("start", "resume", "rollback"):
            raise ValueError(f"unknown segment cause {cause!r}")
        what = {"start": "start", "resume": f"resume from step {origin}"}.get(
            cause, f"rollback to step {origin}"
        )
        world = record.get("world", {})
        self.note(
            "ok" if self.recompute else "note",
            f"segment {segment.index} ({what}; {world.get('ranks', '?')} rank(s): data-parallel "
            f"{world.get('dp', '?')} x local batch {world.get('local_batch', '?')} x "
            f"{world.get('grad_accum', '?')} accumulation = {params.sequences_per_step} "
            f"sequences a step; seq_len {params.seq_len}"
            + (f", {len(params.schedule)} schedule phase(s)" if params.schedule else "")
            + ")",
            origin + 1,
        )
        if cause == "rollback":
            self._check_rollback(segment, origin)
        kept = self._cursor  # a rollback keeps the loader where it was
        # the new segment supersedes every later step of the lineage it leaves
        for step in [s for s in self.final if s > origin]:
            self.superseded.append(self.final.pop(step))
        resumed_from = self.after.get(origin)
        for step in [s for s in self.after if s > origin]:
            del self.after[step]
        self._last_step = origin
        if cause == "start" and origin != 0:
            self.note("MISMATCH", f"line {line}: a start that continues from step {origin}", origin)
        if cause == "resume" and origin and resumed_from is None:
            self.note(
                "GAP",
                f"steps 1-{origin} are not in the ledger (resumed from checkpoint step "
                f"{origin}, which the ledger never recorded): they cannot be verified; "
                "continuing from the checkpoint's loader position",
                origin,
            )
        if not self.recompute:
            return
        self._check_parameters(segment)
        order = segment.order
        if order is None:
            self._cursor = None  # this segment's steps cannot be recomputed
            return
        recorded = record["cursor"]
        if cause == "rollback":
            expected = None if kept is None else cursor_to_json(kept, order.datasets)
        elif origin == 0:
            zeros = (0,) * len(order.datasets)
            fresh = Cursor(0, zeros, 0, zeros, tuple(d.start_position() for d in order.datasets))
            expected = cursor_to_json(fresh, order.datasets)
        elif previous is not None and _contents(previous) != _contents(segment):
            expected = None
            self._check_dataset_change(previous, segment, resumed_from)
        else:
            expected = resumed_from
        if expected is not None and expected != recorded:
            self.note(
                "MISMATCH",
                f"the loader started this segment at {_brief(recorded)}, but the ledger "
                f"says the position after step {origin} was {_brief(expected)}"
                + (
                    " (the checkpoint's loader state does not match the ledger)"
                    if cause == "resume"
                    else ""
                ),
                origin + 1,
            )
        segment.start = cursor_from_json(recorded, order.datasets)
        self._cursor = segment.start

    def _check_dataset_change(self, previous: Segment, segment: Segment, before) -> None:
        """A resume onto other data (dataloader.allow_dataset_change): every dataset whose
        content is unchanged keeps its count and position, a new one starts at 0, and the
        mix restarts its error feedback at the resume point (the loader's rule)."""
        origin = int(segment.record["continues_from"])
        self.note("note", "the data changed at this resume (allow_dataset_change)", origin + 1)
        if before is None:
            return
        old = {h: i for i, h in enumerate(_contents(previous))}
        start, problems = segment.record["cursor"], []
        for d, h in enumerate(_contents(segment)):
            i = old.get(h)
            count = 0 if i is None else before["per_dataset"][i]
            if start["per_dataset"][d] != count:
                problems.append(
                    f"{segment.params.mix[d]['path']} resumed at {start['per_dataset'][d]}, not {count}"
                )
            if i is not None and start["positions"][d] != before["positions"][i]:
                problems.append(f"{segment.params.mix[d]['path']} changed position")
        if start["n"] != before["n"]:
            problems.append(f"global sequence {start['n']}, not {before['n']}")
        for problem in problems:
            self.note("MISMATCH", f"dataset change at the resume: {problem}", origin + 1)

    def _check_rollback(self, segment: Segment, origin: int) -> None:
        """A rollback keeps the loader where it was: its incident's skip range must be
        [position after step `origin`, position after the spike step]."""
        k = int(segment.record.get("incidents", 0))
        if k < 1 or k > len(self.incidents):
            self.note(
                "MISMATCH",
                f"a rollback to step {origin} with {k} incident(s) in force, but "
                f"{self.run_dir / INCIDENTS} holds {len(self.incidents)} loss-spike record(s)",
                origin + 1,
            )
            return
        incident = self.incidents[k - 1]
        before, now = self.after.get(origin), self.after.get(self._last_step)
        expected = [None if before is None else before["n"], None if now is None else now["n"]]
        if (
            incident.get("rolled_back_to") != origin
            or incident.get("skipped_sequences") != expected
        ):
            self.note(
                "MISMATCH",
                f"incident {k} rolled back to step {incident.get('rolled_back_to')} skipping "
                f"{incident.get('skipped_sequences')}, but the ledger went back to step {origin} "
                f"from step {self._last_step}, which makes {expected}",
                origin + 1,
            )

    def _check_parameters(self, segment: Segment) -> None:
        """Manifests, skip ranges and incidents against what the segment recorded; then
        build its order (None when it cannot be verified)."""
        params, record = segment.params, segment.record
        step = int(record["continues_from"]) + 1
        if params.state_format != STATE_FORMAT_VERSION:
            self.note(
                "GAP",
                f"this segment's loader ran a format-{params.state_format} state (resumed from "
                f"a run started before format {STATE_FORMAT_VERSION}); the ledger verifies format "
                f"{STATE_FORMAT_VERSION} orders only",
                step,
            )
            return
        for entry in params.mix:
            try:
                manifest = Manifest.load(_dataset_path(entry), check_files=False)
            except ValueError as err:
                self.note("GAP", f"dataset {entry['path']}: {err}", step)
                return
            if manifest.content_sha256 != entry["content_sha256"]:
                self.note(
                    "MISMATCH",
                    f"dataset {entry['path']}: its manifest's content is {manifest.content_sha256[:12]}, "
                    f"the run trained on {entry['content_sha256'][:12]} (re-prepared or replaced "
                    "since)",
                    step,
                )
                return
        world = record.get("world", {})
        per_step = world.get("dp", 0) * world.get("local_batch", 0) * world.get("grad_accum", 0)
        if per_step and per_step != params.sequences_per_step:
            self.note(
                "MISMATCH",
                f"{world} makes {per_step} sequences a step, the segment says "
                f"{params.sequences_per_step}",
                step,
            )
        order = params.build()
        k = int(record.get("incidents", 0))
        ranges = [r["skipped_sequences"] for r in self.incidents[:k]]
        order.skip_ranges = order.merged_skip_ranges(params.skip_sequences + ranges)
        if [list(r) for r in order.skip_ranges] != record.get("skip_ranges"):
            self.note(
                "MISMATCH",
                f"the loader skipped {record.get('skip_ranges')}, but dataloader.skip_sequences "
                f"{params.skip_sequences} and the first {k} incident(s) of {INCIDENTS} make "
                f"{[list(r) for r in order.skip_ranges]}",
                step,
            )
        segment.order = order

    def _step(self, line: int, record: dict) -> None:
        step = int(record["step"])
        if not self.segments:
            self.note("MISMATCH", f"line {line}: a step record before any segment record", step)
            return
        segment = self.segments[-1]
        if self._last_step is not None and step != self._last_step + 1:
            self.note(
                "MISMATCH",
                f"line {line}: step {step} follows step {self._last_step} with no segment "
                "record between (a record removed, or steps out of order)",
                step,
            )
        self._last_step = step
        before = (
            segment.record["cursor"]
            if step == int(segment.record["continues_from"]) + 1
            else self.after.get(step - 1, record["cursor"])
        )
        entry = StepEntry(line, segment.index, record, before)
        if self.recompute and segment.order is not None and self._cursor is not None:
            self._recompute(segment, entry)
        self.final[step] = entry
        self.after[step] = record["cursor"]

    def _recompute(self, segment: Segment, entry: StepEntry) -> None:
        order, record, step = segment.order, entry.record, int(entry.record["step"])
        cursor = self._cursor
        try:
            planned = order.plan_round(cursor)
        except ValueError as err:
            self.note("MISMATCH", f"the order cannot plan this step: {err}", step)
            return
        if planned is None:
            self.note("MISMATCH", "the order ran out of data at this step", step)
            return
        plan, after, seq_len = planned
        lanes = [0] * NUM_LANES
        add_rows(lanes, plan, seq_len)
        expected = step_record(
            step, record.get("applied", True), lanes, after, order.datasets, order
        )
        problems = []
        if (record.get("rows"), record.get("tokens")) != (expected["rows"], expected["tokens"]):
            problems.append(
                f"{record.get('rows')} rows / {record.get('tokens')} tokens trained, the order "
                f"has {expected['rows']} / {expected['tokens']}"
            )
        elif record.get("digest") != expected["digest"]:
            problems.append(
                "the rows the ranks trained differ from the order's (a window missing, "
                "repeated or read from elsewhere)"
            )
        if record.get("cursor") != expected["cursor"]:
            problems.append(
                f"position after the step: {_cursor_difference(record.get('cursor'), expected['cursor'])}"
            )
        if record.get("skipped") != expected["skipped"]:
            problems.append(
                f"skipped counters {record.get('skipped')}, the order says {expected['skipped']}"
            )
        if record.get("replicas_disagree"):
            problems.append("ranks holding the same rows (TP/CP/PP copies) trained different ones")
        for problem in problems:
            self.note("MISMATCH", problem, step)
        if problems and isinstance(record.get("cursor"), dict):
            try:  # go on from the recorded position: later steps are judged on their own
                after = cursor_from_json(record["cursor"], order.datasets)
            except (KeyError, TypeError, ValueError):
                pass
        if self.collect_rows:
            entry.rows = np.array(
                [(n, d, e, s, seq_len) for d, s, e, n in plan], dtype=np.int64
            ).reshape(-1, 5)
            if order.skipped_sequences(after.num_sequences) > order.skipped_sequences(
                cursor.num_sequences
            ):
                entry.skipped_rows = _skip_range_rows(order, cursor, after.num_sequences)
        self._cursor = after

    def _finish(self) -> None:
        steps = sorted(self.final)
        holes = sorted(set(range(1, steps[-1] + 1)) - set(steps)) if steps else []
        if holes and not any(f.level == "GAP" for f in self.findings):
            self.note(
                "GAP", f"steps {_ranges(holes)} have no record in the final lineage", holes[0]
            )
        if self.superseded:
            steps_gone = sorted(int(e.record["step"]) for e in self.superseded)
            self.note(
                "superseded",
                f"{len(steps_gone)} record(s) of steps {_ranges(steps_gone)} were trained and "
                "then gone back past (a resume from an earlier checkpoint, or a rollback)",
            )
        if self.recompute and self.segments:
            self._check_run_config()
        if self.recompute and len(self.incidents) > int(
            self.segments[-1].record.get("incidents", 0)
        ):
            self.note(
                "note",
                f"{INCIDENTS} holds {len(self.incidents)} loss-spike record(s), the last segment "
                f"ran with {self.segments[-1].record.get('incidents', 0)}: the run stopped after "
                "a rollback, before training on",
            )

    def _check_run_config(self) -> None:
        """The last segment's parameters against RUN/config.toml (what a resume will use)."""
        path, segment = self.run_dir / CONFIG, self.segments[-1]
        if not path.is_file():
            self.note("note", f"{path}: missing; the last segment's parameters are unchecked")
            return
        config, params = parameters_from_run_config(path), segment.params
        recorded = {
            "mix": [(m["path"], float(m["weight"])) for m in params.mix],
            "seed": params.seed,
            "seq_len": params.seq_len,
            "schedule": params.schedule,
            "block_tokens": params.block_tokens,
            "shuffle_blocks": params.shuffle_blocks,
            "skip_sequences": params.skip_sequences,
            "sequences_per_step": params.sequences_per_step,
        }
        if config["sequences_per_step"] is None:
            config["sequences_per_step"] = params.sequences_per_step  # -1: local x dp
        differ = [k for k in recorded if recorded[k] != config[k]]
        if differ:
            self.note(
                "MISMATCH",
                f"{path} differs from what the last segment ran with in {differ} (config: "
                + "; ".join(f"{k}={config[k]}" for k in differ)
                + "; ledger: "
                + "; ".join(f"{k}={recorded[k]}" for k in differ)
                + ")",
                int(segment.record["continues_from"]) + 1,
            )
        else:
            self.note("ok", f"{path.name} matches the last segment's loader parameters")
        if hashlib.sha256(path.read_bytes()).hexdigest() != segment.record.get("config_sha256"):
            self.note(
                "note",
                f"{path.name} was edited since the last segment started (its data keys still match)",
            )


def _skip_range_rows(order: GlobalOrder, cursor: Cursor, stop: int) -> np.ndarray:
    """The windows of the skip-range sequences in [cursor, stop): drawn as if trained and
    given to no rank. Planned by the same order with no skip ranges, cut at seq_len phases
    (a round has one length), keeping the rows inside a skip range."""
    saved_ranges, saved_batch = order.skip_ranges, order.local_batch_size
    rows, ranges = [], saved_ranges
    try:
        order.skip_ranges = ()
        n = cursor.num_sequences
        cuts = [c for c in order.seq_len_starts if n < c < stop] + [stop]
        for cut in cuts:
            order.local_batch_size, n = cut - n, cut
            plan, cursor, seq_len = order.plan_round(cursor)
            rows += [
                (m, d, e, s, seq_len) for d, s, e, m in plan if any(a <= m < b for a, b in ranges)
            ]
    finally:
        order.skip_ranges, order.local_batch_size = saved_ranges, saved_batch
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def _contents(segment: Segment) -> list[str]:
    return [entry["content_sha256"] for entry in segment.params.mix]


def _cursor_difference(recorded, expected: dict) -> str:
    """What differs between a recorded position and the order's, field by field."""
    if not isinstance(recorded, dict):
        return f"recorded {recorded!r}, the order says {_brief(expected)}"
    parts = []
    for key, value in expected.items():
        if key == "positions" and isinstance(recorded.get(key), list):
            for d, (mine, theirs) in enumerate(zip(recorded[key], value, strict=False)):
                if mine != theirs:
                    parts.append(f"dataset {d} recorded {mine}, the order says {theirs}")
        elif recorded.get(key) != value:
            parts.append(f"{key} recorded {recorded.get(key)}, the order says {value}")
    return "; ".join(parts) or "recorded fields the order does not have"


def _brief(cursor) -> str:
    if not isinstance(cursor, dict):
        return repr(cursor)
    return f"global sequence {cursor.get('n')} (per dataset {cursor.get('per_dataset')})"


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


# ------------------------------------------------------------------------ verify
def verify(run_dir: str | Path, out=sys.stdout) -> int:
    """Print one line per finding; 0 when every step verified, 1 at a mismatch or gap."""
    replay = Replay(run_dir).run()
    for finding in replay.findings:
        print(finding.line(), file=out)
    steps = sorted(replay.final)
    bad = replay.first_bad
    if bad is not None:
        where = f"step {bad.step}" if bad.step is not None else "the ledger"
        print(f"FAILED: first bad step: {where}: {bad.text}", file=out)
        return 1
    if not steps:
        print("FAILED: the ledger has no step records", file=out)
        return 1
    print(
        f"OK: steps 1-{steps[-1]} verified ({len(steps)} in the final lineage, "
        f"{len(replay.superseded)} superseded record(s), {len(replay.segments)} segment(s), "
        f"{len(replay.incidents)} rollback(s))",
        file=out,
    )
    return 0


# ------------------------------------------------------------------------ which
@dataclass
class DocumentRef:
    """A document a window overlaps: its index in the split, its tokens [start, end) in
    the token stream, the window's part of it, and where it came from (None without
    provenance)."""

    document: int
    start: int
    end: int
    window_start: int
    window_end: int
    source: str | None
    record: int | None


@dataclass
class Row:
    sequence: int
    dataset: int
    dataset_path: str
    epoch: int
    start: int  # on-disk token offset of the window's first input token
    seq_len: int
    documents: list[DocumentRef] = field(default_factory=list)


def which(run_dir: str | Path, step: int) -> tuple[dict, list[Row]]:
    """The rows step `step` of the final lineage trained, each with its documents: (the
    step's record, rows). Planned from the position the ledger recorded before the step,
    and checked against the step's digest."""
    from dataloader.provenance import Provenance

    replay = Replay(run_dir, recompute=False).run()
    entry = replay.final.get(step)
    if entry is None:
        steps = sorted(replay.final)
        span = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"
        raise ValueError(f"step {step} is not in the final lineage of {replay.path} ({span})")
    segment = replay.segments[entry.segment]
    order = segment.params.build()
    k = int(segment.record.get("incidents", 0))
    ranges = [r["skipped_sequences"] for r in replay.incidents[:k]]
    order.skip_ranges = order.merged_skip_ranges(segment.params.skip_sequences + ranges)
    cursor = cursor_from_json(entry.before, order.datasets)
    plan, _, seq_len = order.plan_round(cursor)
    lanes = [0] * NUM_LANES
    add_rows(lanes, plan, seq_len)
    if lanes[2:] != entry.record.get("digest"):
        raise ValueError(
            f"step {step}: the rows planned from the recorded position differ from the ledger's "
            f"digest; run `python -m dataloader.ledger verify {run_dir}`"
        )
    provenances = [Provenance.of(stream.manifest) for stream in order.datasets]
    rows = []
    for d, start, epoch, n in plan:
        stream = order.datasets[d]
        row = Row(n, d, segment.params.mix[d]["path"], epoch, start, seq_len)
        for doc, a, b in stream.documents_between(start, start + seq_len + 1):
            source, record = provenances[d].locate(doc) if provenances[d] else (None, None)
            row.documents.append(
                DocumentRef(
                    doc, a, b, max(a, start) - a, min(b, start + seq_len + 1) - a, source, record
                )
            )
        rows.append(row)
    return entry.record, rows


def _print_which(run_dir: str, step: int, as_json: bool) -> None:
    record, rows = which(run_dir, step)
    if as_json:
        print(
            json.dumps(
                {"step": step, "applied": record.get("applied"), "rows": [asdict(r) for r in rows]}
            )
        )
        return
    print(
        f"step {step}: {len(rows)} rows of {rows[0].seq_len if rows else 0} tokens"
        + ("" if record.get("applied", True) else " (update not applied)")
    )
    for row in rows:
        docs = ", ".join(
            (f"{d.source} record {d.record}" if d.source is not None else f"document {d.document}")
            + f" [{d.window_start}:{d.window_end}] of {d.end - d.start}"
            for d in row.documents
        )
        print(
            f"sequence {row.sequence} {row.dataset_path} epoch {row.epoch} tokens "
            f"[{row.start}, {row.start + row.seq_len}): {docs}"
        )
    if rows and rows[0].documents and rows[0].documents[0].source is None:
        print(
            "provenance unavailable: the data was prepared before manifest format 2; "
            "re-prepare it to name source files and records"
        )


# ------------------------------------------------------------------------ coverage
def _multiplicity(windows: np.ndarray) -> tuple[int, int]:
    """(tokens covered once, extra coverage: tokens x (times - 1) beyond once) of
    [start, end) intervals, by a sweep over their sorted endpoints."""
    if not len(windows):
        return 0, 0
    points = np.concatenate([windows[:, 0], windows[:, 1]])
    deltas = np.concatenate([np.ones(len(windows), np.int64), -np.ones(len(windows), np.int64)])
    order = np.lexsort((deltas, points))  # at equal points an end (-1) comes first
    points, deltas = points[order], deltas[order]
    depth = np.cumsum(deltas)[:-1]
    lengths = np.diff(points)
    once = int(lengths[depth == 1].sum())
    extra = int((lengths * np.maximum(depth - 1, 0)).sum())
    return once, extra


def coverage(run_dir: str | Path) -> dict:
    """Per dataset, input tokens trained once, trained more than once within an epoch,
    skipped (by kind) and not reached, over the final lineage (interval arithmetic)."""
    replay = Replay(run_dir, collect_rows=True).run()
    bad = replay.first_bad
    if bad is not None:
        raise ValueError(
            f"the ledger does not verify ({bad.line()}); run `python -m dataloader.ledger "
            f"verify {run_dir}` first"
        )
    last_segment = replay.segments[-1]
    ranges = last_segment.order.skip_ranges
    final = [replay.final[s] for s in sorted(replay.final)]
    empty = np.zeros((0, 5), np.int64)
    trained = np.concatenate([e.rows for e in final if e.record.get("applied", True)] + [empty])
    unapplied = np.concatenate(
        [e.rows for e in final if not e.record.get("applied", True)] + [empty]
    )
    # skip-range windows: drawn by superseded steps (a rollback) or inside a final step's span
    drawn = np.concatenate(
        [e.rows for e in replay.superseded if e.rows is not None]
        + [e.skipped_rows for e in final + replay.superseded if e.skipped_rows is not None]
        + [empty]
    )
    in_range = np.zeros(len(drawn), bool)
    for a, b in ranges:
        in_range |= (drawn[:, 0] >= a) & (drawn[:, 0] < b)
    skipped = drawn[in_range]
    skipped = skipped[np.unique(skipped[:, 0], return_index=True)[1]]
    last = final[-1].record
    orders = last_segment.order.datasets
    position = cursor_from_json(last["cursor"], orders)
    result = {"datasets": [], "loader": last["skipped"], "steps": len(final)}
    for d, stream in enumerate(orders):
        mine = trained[trained[:, 1] == d]
        once = extra = 0
        for epoch in np.unique(mine[:, 2]):
            rows = mine[mine[:, 2] == epoch]
            o, x = _multiplicity(np.stack([rows[:, 3], rows[:, 3] + rows[:, 4]], axis=1))
            once, extra = once + o, extra + x
        pos = position.positions[d]
        epochs = pos.epoch + (1 if (pos.group or pos.taken) else 0)
        range_rows = skipped[skipped[:, 1] == d]
        unapplied_rows = unapplied[unapplied[:, 1] == d]
        cut = stream.skipped_tokens(pos)
        tokens = {
            "trained_once": once,
            "trained_twice": extra,
            "skipped_ranges": int(range_rows[:, 4].sum()),
            "skipped_sequences": len(range_rows),
            "skipped_cuts_and_tails": cut,
            "skipped_unapplied": int(unapplied_rows[:, 4].sum()),
        }
        covered = once + tokens["skipped_ranges"] + tokens["skipped_unapplied"] + cut
        tokens["not_reached"] = epochs * (stream.num_tokens - 1) - covered
        result["datasets"].append(
            {
                "path": last_segment.params.mix[d]["path"],
                "epochs": epochs,
                "input_tokens_per_epoch": stream.num_tokens - 1,
                **tokens,
            }
        )
    return result


def _print_coverage(run_dir: str, as_json: bool) -> int:
    result = coverage(run_dir)
    if as_json:
        print(json.dumps(result))
    else:
        for d in result["datasets"]:
            print(
                f"{d['path']}: {d['input_tokens_per_epoch']} input tokens an epoch, "
                f"{d['epochs']} epoch(s) drawn from"
            )
            print(f"  trained once          {d['trained_once']}")
            print(f"  trained twice         {d['trained_twice']}  (within an epoch: must be 0)")
            print(
                f"  skipped               "
                f"{d['skipped_ranges'] + d['skipped_cuts_and_tails'] + d['skipped_unapplied']}"
                f"  (skip ranges {d['skipped_ranges']} in {d['skipped_sequences']} sequences; "
                f"group cuts and block tails {d['skipped_cuts_and_tails']}; updates not applied "
                f"{d['skipped_unapplied']})"
            )
            print(f"  not reached           {d['not_reached']}")
        loader = result["loader"]
        print(
            f"loader counters after step {result['steps']}: skipped sequences "
            f"{loader['sequences']}, skipped tokens {loader['tokens']}"
        )
    twice = sum(d["trained_twice"] for d in result["datasets"])
    if twice:
        print(f"FAILED: {twice} token(s) trained more than once within an epoch")
        return 1
    return 0


# ------------------------------------------------------------------------ the command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dataloader.ledger", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "verify", help="recompute every record; exit 1 at the first bad step"
    )
    check.add_argument("run", help="the run folder RUN (holds ledger.jsonl)")
    look = commands.add_parser("which", help="the documents (source file, record) of a step's rows")
    look.add_argument("run")
    look.add_argument(
        "--step", type=int, required=True, help="an optimizer step of the final lineage"
    )
    look.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    count = commands.add_parser(
        "coverage", help="per dataset: tokens trained once, twice, skipped, not reached"
    )
    count.add_argument("run")
    count.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = parser.parse_args(argv)

    def body():
        if args.command == "verify":
            return verify(args.run)
        if args.command == "which":
            return _print_which(args.run, args.step, args.json)
        return _print_coverage(args.run, args.json)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
