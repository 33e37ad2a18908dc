"""The data ledger's replay: RUN/ledger.jsonl walked in file order, its chain checked, its
lineage followed, and every step recomputed from the loader's own order.

Why: this is the proof behind `python -m train.ledger verify`. The order is a pure
function of what a segment record names, so each step's rows, position and counters can be
recomputed and compared. There is no second implementation of the order: `Replay` plans
every step with `dataloader.global_order` and `dataloader.stream`, as one rank whose local
batch is a whole step. Each claim of a segment record (manifests, skip ranges,
quarantines, config, the position at a rollback or a resume) is checked first by
`train.ledger.checks`.

Lineage: a segment that continues from step c *supersedes* every record of a later step
of the lineage it leaves (a resume from an earlier checkpoint, a rollback). Superseded
records are recomputed too, since they happened: a rollback's skipped data was drawn by
them. `final` is the lineage the last checkpoint descends from. With `collect_rows` each
recomputed step keeps its rows, and the skip-range rows drawn in its span, for `coverage`
(`train.ledger.readers`).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import numpy as np

from common.run_layout import CHECKPOINT_DIR, INCIDENTS, LEDGER, checkpoint_dir, list_checkpoints
from dataloader.global_order import Cursor, GlobalOrder
from dataloader.incidents import read_incidents
from dataloader.ledger_record import (
    GENESIS,
    LEDGER_VERSION,
    NUM_LANES,
    OrderParameters,
    add_rows,
    chain_hash,
    cursor_from_json,
    cursor_to_json,
    read_lines,
    step_record,
)
from train.ledger.checks import (
    Finding,
    Segment,
    brief,
    check_dataset_change,
    check_parameters,
    check_rollback,
    check_run_config,
    contents,
)


@dataclass
class StepEntry:
    """One step record as the replay saw it."""

    line: int
    segment: int
    record: dict
    before: dict  # the position before the step (ledger JSON)
    rows: np.ndarray | None = None  # (k, 5): sequence, dataset, epoch, start, seq_len
    skipped_rows: np.ndarray | None = None  # skip-range rows drawn in this step's span


class Replay:
    """RUN/ledger.jsonl walked in file order: the chain checked, lineage followed, and
    (with `recompute`) every record recomputed from the loader's own order.

    After `run()`: `findings` (in order), `final` (step -> its `StepEntry` in the final
    lineage), `superseded` (the `StepEntry`s a later segment went back past), `segments`.
    With `collect_rows` each recomputed step keeps its rows (for `coverage`)."""

    def __init__(
        self, run_dir: str | Path, *, recompute: bool = True, collect_rows=False, records=None
    ):
        """`records`: the ledger's records in file order, when they come from elsewhere
        than RUN/ledger.jsonl (the merge of a run's replica groups)."""
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LEDGER
        self.records = records
        if records is None and not self.path.is_file():
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
        self.incidents = read_incidents(self.run_dir)
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
        lines = enumerate(self.records, 1) if self.records is not None else read_lines(self.path)
        for line, record in lines:
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
            check_rollback(
                self.note,
                segment,
                self.incidents,
                self.run_dir,
                self.after.get(origin),
                self.after.get(self._last_step),
                self._last_step,
            )
        kept = self._cursor  # a rollback keeps the loader where it was
        # the new segment supersedes every later step of the lineage it leaves
        for step in [s for s in self.final if s > origin]:
            self.superseded.append(self.final.pop(step))
        resumed_from = self.after.get(origin)
        self.after = {s: cursor for s, cursor in self.after.items() if s <= origin}
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
        check_parameters(self.note, segment, self.incidents)
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
        elif previous is not None and contents(previous) != contents(segment):
            expected = None
            check_dataset_change(self.note, previous, segment, resumed_from)
        else:
            expected = resumed_from
        if expected is not None and expected != recorded:
            self.note(
                "MISMATCH",
                f"the loader started this segment at {brief(recorded)}, but the ledger "
                f"says the position after step {origin} was {brief(expected)}"
                + (
                    " (the checkpoint's loader state does not match the ledger)"
                    if cause == "resume"
                    else ""
                ),
                origin + 1,
            )
        segment.start = cursor_from_json(recorded, order.datasets)
        self._cursor = segment.start

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
        # a replica-group step holds its live groups' slices (train/replica_groups)
        order.local_batch_size = int(record.get("sequences", segment.params.sequences_per_step))
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
        expected = step_record(step, record.get("applied", True), lanes, after, order)
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
            # go on from the recorded position: later steps are judged on their own
            with contextlib.suppress(KeyError, TypeError, ValueError):
                after = cursor_from_json(record["cursor"], order.datasets)
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
        self._check_reaches_newest_checkpoint(steps)
        if self.superseded:
            steps_gone = sorted(int(e.record["step"]) for e in self.superseded)
            self.note(
                "superseded",
                f"{len(steps_gone)} record(s) of steps {_ranges(steps_gone)} were trained and "
                "then gone back past (a resume from an earlier checkpoint, or a rollback)",
            )
        if not (self.recompute and self.segments):
            return
        last = self.segments[-1].record
        check_run_config(self.note, self.run_dir, self.segments[-1])
        spikes, quarantines = self.incidents.spikes, self.incidents.quarantines
        if len(spikes) > int(last.get("incidents", 0)):
            self.note(
                "note",
                f"{INCIDENTS} holds {len(spikes)} loss-spike record(s), the last segment "
                f"ran with {last.get('incidents', 0)}: the run stopped after "
                "a rollback, before training on",
            )
        if len(quarantines) > int(last.get("quarantines", 0)):
            self.note(
                "note",
                f"{INCIDENTS} holds {len(quarantines)} quarantine record(s), the last segment "
                f"ran with {last.get('quarantines', 0)}: a resume passes over the rest",
            )

    def _check_reaches_newest_checkpoint(self, steps: list[int]) -> None:
        """The final lineage must reach the newest complete checkpoint: the recorder has
        every record up to a step on disk before that step's save begins
        (train/ledger/recorder.py), so a ledger that ends before it lost its tail (the last
        lines deleted, or the steps after a resume). Named, not accepted."""
        complete, _ = list_checkpoints(self.run_dir / CHECKPOINT_DIR)
        if not complete or (steps and steps[-1] >= complete[-1]):
            return
        newest = complete[-1]
        last = steps[-1] if steps else 0
        self.note(
            "GAP",
            f"checkpoint {checkpoint_dir(self.run_dir, newest)} is complete, but the final "
            f"lineage ends at step {last}: the ledger's tail was cut (the records of steps "
            f"{last + 1}-{newest} deleted or lost), so that checkpoint's data cannot be vouched for",
            last + 1,
        )


def _skip_range_rows(order: GlobalOrder, cursor: Cursor, stop: int) -> np.ndarray:
    """The windows of the skip-range sequences in [cursor, stop): drawn as if trained and
    given to no rank. Planned by the same order with no skip ranges, cut at seq_len phases
    (a round has one length), keeping the rows inside a skip range."""
    rows, ranges = [], order.skip_ranges
    order = copy.copy(order)  # the replay's own keeps its skip ranges and batch size
    order.skip_ranges = ()
    n = cursor.num_sequences
    cuts = [c for c in order.seq_len_starts if n < c < stop] + [stop]
    for cut in cuts:
        order.local_batch_size, n = cut - n, cut
        plan, cursor, seq_len = order.plan_round(cursor)
        rows += [(m, d, e, s, seq_len) for d, s, e, m in plan if any(a <= m < b for a, b in ranges)]
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def _cursor_difference(recorded, expected: dict) -> str:
    """What differs between a recorded position and the order's, field by field."""
    if not isinstance(recorded, dict):
        return f"recorded {recorded!r}, the order says {brief(expected)}"
    parts = []
    for key, value in expected.items():
        if key == "positions" and isinstance(recorded.get(key), list):
            for d, (mine, theirs) in enumerate(zip(recorded[key], value, strict=False)):
                if mine != theirs:
                    parts.append(f"dataset {d} recorded {mine}, the order says {theirs}")
        elif recorded.get(key) != value:
            parts.append(f"{key} recorded {recorded.get(key)}, the order says {value}")
    return "; ".join(parts) or "recorded fields the order does not have"


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7' (sorted values; a run of consecutive ones keeps i - v)."""
    runs = [[v for _, v in run] for _, run in groupby(enumerate(values), lambda p: p[1] - p[0])]
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
