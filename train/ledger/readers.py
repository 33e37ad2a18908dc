"""The data ledger's readers: which documents a step trained (`which`), and how much of
each dataset the run has trained once, twice, skipped or not reached yet (`coverage`).

Why apart from the replay: these answer an auditor's questions from a ledger already
trusted. `which` plans one step from the position the ledger recorded before it, so it
costs one step, not the run. It checks that step against its digest and names each row's
documents through documents.npy and the manifest's provenance (`dataloader.provenance`).
`coverage` runs the whole replay with its rows kept (`train.ledger.replay.Replay`),
refuses a ledger that does not verify, and counts by interval arithmetic over the windows,
never per token, so its cost grows with the steps, not the tokens (scripts/bench_ledger.py).
Both read a run of replica groups as `verify` does: its groups' ledgers merged first
(`train.ledger.replicas.run_replay`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dataloader.ledger_record import NUM_LANES, add_rows, cursor_from_json
from train.ledger.checks import order_in_force
from train.ledger.replicas import run_replay


@dataclass
class DocumentRef:
    """A document a window overlaps: its index in the split, its tokens [start, end) in
    the token stream, the window's part of it, and where prepare read it from
    (`dataloader.provenance`; None for data prepared before manifest format 2)."""

    document: int
    start: int
    end: int
    window_start: int
    window_end: int
    source: str | None = None
    record: int | None = None


def window_documents(stream, provenance, first: int, stop: int) -> list[DocumentRef]:
    """The documents on-disk tokens [first, stop) of one dataset (`stream`) overlap, in
    order, named through its `provenance` (None: no names). `which` asks it for a step's
    rows, and spike forensics for the rows it scored."""
    return [
        DocumentRef(
            doc,
            a,
            b,
            max(a, first) - a,
            min(b, stop) - a,
            *(provenance.locate(doc) if provenance else (None, None)),
        )
        for doc, a, b in stream.documents_between(first, stop)
    ]


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

    replay, _ = run_replay(run_dir, recompute=False)
    entry = replay.final.get(step)
    if entry is None:
        steps = sorted(replay.final)
        span = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"
        raise ValueError(f"step {step} is not in the final lineage of {run_dir} ({span})")
    segment = replay.segments[entry.segment]
    order = order_in_force(segment.params, segment.record, replay.incidents)
    cursor = cursor_from_json(entry.before, order.datasets)
    # a replica-group step holds its live groups' slices, as the replay plans it
    order.local_batch_size = int(entry.record.get("sequences", segment.params.sequences_per_step))
    plan, _, seq_len = order.plan_round(cursor)
    lanes = [0] * NUM_LANES
    add_rows(lanes, plan, seq_len)
    if lanes[2:] != entry.record.get("digest"):
        raise ValueError(
            f"step {step}: the rows planned from the recorded position differ from the ledger's "
            f"digest; run `python -m train.ledger verify {run_dir}`"
        )
    provenances = [Provenance.of(stream.manifest) for stream in order.datasets]
    rows = []
    for d, start, epoch, n in plan:
        documents = window_documents(order.datasets[d], provenances[d], start, start + seq_len + 1)
        rows.append(Row(n, d, segment.params.mix[d]["path"], epoch, start, seq_len, documents))
    return entry.record, rows


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
    replay, merge = run_replay(run_dir, collect_rows=True)
    bad = next((f for f in merge if f.bad), None) or replay.first_bad
    if bad is not None:
        raise ValueError(
            f"the ledger does not verify ({bad.line()}); run `python -m train.ledger "
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
    result["torn_lines"] = replay.num_torn  # a kill mid-append: dropped, and said so
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
            "skipped_cuts_and_tails": cut,  # quarantined windows too (the loader counts them there)
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
