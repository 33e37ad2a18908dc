"""The data ledger's segment checks: what a segment record claims, held against evidence
the run cannot rewrite.

Why a room of its own: a segment record names the parameters its steps were trained with,
and `verify` recomputes every step from them (`train.ledger.replay`). A recomputation
that agrees with the ledger proves the steps only if the parameters are the right ones. So
each claim is checked against something independent of the ledger: the manifests' content
hashes on disk; RUN/incidents.jsonl for the skip ranges and quarantines in force;
RUN/config.toml for the last segment (what a resume will use); and, at a rollback or a
resume onto other data, the ledger's own record of the steps before. Each check writes its
findings through a `note(level, text, step)` callable, one line each.

The skip ranges and quarantines a segment ran with are rebuilt by `order_in_force`. It
uses the rule a resume applies (`dataloader.incidents`): the config's `skip_sequences`
plus the first k rollbacks' ranges, and the first q quarantined documents, matched to
datasets by content hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from common.run_layout import CONFIG, INCIDENTS
from dataloader.global_order import Cursor, GlobalOrder, schedule_from_steps
from dataloader.incidents import Incidents, quarantine_streams
from dataloader.ledger_record import OrderParameters, dataset_path
from dataloader.manifest import Manifest
from dataloader.stream import STATE_FORMAT_VERSION
from train.config import load_config

Note = Callable[..., None]  # note(level, text, step=None)


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


def contents(segment: Segment) -> list[str]:
    """The content hash of each dataset of the segment's mix."""
    return [entry["content_sha256"] for entry in segment.params.mix]


def brief(cursor) -> str:
    """A recorded position in a few words."""
    if not isinstance(cursor, dict):
        return repr(cursor)
    return f"global sequence {cursor.get('n')} (per dataset {cursor.get('per_dataset')})"


def order_in_force(params: OrderParameters, record: dict, incidents: Incidents) -> GlobalOrder:
    """The segment's global order with the skip ranges and quarantines it ran with: the
    config's `skip_sequences` plus the first `record["incidents"]` rollbacks' ranges, and
    the first `record["quarantines"]` quarantined documents (`dataloader.incidents`)."""
    order = params.build()
    k, q = int(record.get("incidents", 0)), int(record.get("quarantines", 0))
    order.skip_ranges = order.merged_skip_ranges(params.skip_sequences + incidents.skip_ranges(k))
    quarantine_streams(
        order.datasets,
        [entry["content_sha256"] for entry in params.mix],
        incidents.quarantine_entries(q),
    )
    return order


def check_parameters(note: Note, segment: Segment, incidents: Incidents) -> None:
    """Manifests, skip ranges and quarantines against what the segment recorded; then
    build its order into `segment.order` (left None when it cannot be verified)."""
    params, record = segment.params, segment.record
    step = int(record["continues_from"]) + 1
    if params.state_format != STATE_FORMAT_VERSION:
        note(
            "GAP",
            f"this segment's loader ran a format-{params.state_format} state (resumed from "
            f"a run started before format {STATE_FORMAT_VERSION}); the ledger verifies format "
            f"{STATE_FORMAT_VERSION} orders only",
            step,
        )
        return
    for entry in params.mix:
        try:
            manifest = Manifest.load(dataset_path(entry), check_files=False)
        except ValueError as err:
            note("GAP", f"dataset {entry['path']}: {err}", step)
            return
        if manifest.content_sha256 != entry["content_sha256"]:
            note(
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
        note(
            "MISMATCH",
            f"{world} makes {per_step} sequences a step, the segment says "
            f"{params.sequences_per_step}",
            step,
        )
    k, q = int(record.get("incidents", 0)), int(record.get("quarantines", 0))
    if q > len(incidents.quarantines):
        note(
            "MISMATCH",
            f"the loader ran with {q} quarantined document(s) in force, but {INCIDENTS} holds "
            f"{len(incidents.quarantines)} quarantine record(s) (a record removed since?)",
            step,
        )
    order = order_in_force(params, record, incidents)
    if [list(r) for r in order.skip_ranges] != record.get("skip_ranges"):
        note(
            "MISMATCH",
            f"the loader skipped {record.get('skip_ranges')}, but dataloader.skip_sequences "
            f"{params.skip_sequences} and the first {k} incident(s) of {INCIDENTS} make "
            f"{[list(r) for r in order.skip_ranges]}",
            step,
        )
    recorded = record.get("quarantined")  # absent when the loader held no quarantine
    rebuilt = [[list(r) for r in stream.quarantine] for stream in order.datasets]
    if (recorded is not None or any(rebuilt)) and rebuilt != recorded:
        note(
            "MISMATCH",
            f"the loader passed over the token ranges {recorded} (per dataset), but the first "
            f"{q} quarantine record(s) of {INCIDENTS} make {rebuilt}",
            step,
        )
    segment.order = order


def check_rollback(
    note: Note,
    segment: Segment,
    incidents: Incidents,
    run_dir: Path,
    before: dict | None,
    now: dict | None,
    last_step: int | None,
) -> None:
    """A rollback keeps the loader where it was: its incident's skip range must be
    [position after the step gone back to (`before`), position after the spike step
    `last_step` (`now`)]."""
    origin = int(segment.record["continues_from"])
    spikes = incidents.spikes
    k = int(segment.record.get("incidents", 0))
    if k < 1 or k > len(spikes):
        note(
            "MISMATCH",
            f"a rollback to step {origin} with {k} incident(s) in force, but "
            f"{run_dir / INCIDENTS} holds {len(spikes)} loss-spike record(s)",
            origin + 1,
        )
        return
    incident = spikes[k - 1]
    expected = [None if before is None else before["n"], None if now is None else now["n"]]
    if incident.get("rolled_back_to") != origin or incident.get("skipped_sequences") != expected:
        note(
            "MISMATCH",
            f"incident {k} rolled back to step {incident.get('rolled_back_to')} skipping "
            f"{incident.get('skipped_sequences')}, but the ledger went back to step {origin} "
            f"from step {last_step}, which makes {expected}",
            origin + 1,
        )


def check_dataset_change(note: Note, previous: Segment, segment: Segment, before) -> None:
    """A resume onto other data (dataloader.allow_dataset_change): every dataset whose
    content is unchanged keeps its count and position, a new one starts at 0, and the
    mix restarts its error feedback at the resume point (the loader's rule)."""
    origin = int(segment.record["continues_from"])
    note("note", "the data changed at this resume (allow_dataset_change)", origin + 1)
    if before is None:
        return
    old = {h: i for i, h in enumerate(contents(previous))}
    start, problems = segment.record["cursor"], []
    for d, h in enumerate(contents(segment)):
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
        note("MISMATCH", f"dataset change at the resume: {problem}", origin + 1)


def parameters_from_run_config(path: Path) -> dict:
    """What RUN/config.toml says the loader runs with, in `OrderParameters`' terms: the
    config read by the trainer's own reader (`train.config.load_config`, its defaults and
    checks) and mapped as the trainer maps it (the schedule through `schedule_from_steps`)."""
    run = load_config(path)
    data, per_step = run.dataloader, run.training.global_batch_size
    return {
        "mix": [(m.path, float(m.weight)) for m in data.mix],
        "seed": data.seed,
        "seq_len": run.training.seq_len,
        "schedule": [asdict(p) for p in schedule_from_steps(data.schedule, per_step)],
        "block_tokens": data.block_tokens,
        "shuffle_blocks": data.shuffle_blocks,
        "skip_sequences": [list(r) for r in data.skip_sequences],
        "sequences_per_step": per_step if per_step > 0 else None,
    }


def check_run_config(note: Note, run_dir: Path, segment: Segment) -> None:
    """The last segment's parameters against RUN/config.toml (what a resume will use)."""
    path = run_dir / CONFIG
    if not path.is_file():
        note("note", f"{path}: missing; the last segment's parameters are unchecked")
        return
    config, params = parameters_from_run_config(path), segment.params
    recorded = {key: getattr(params, key) for key in config}  # the same names
    recorded["mix"] = [(m["path"], float(m["weight"])) for m in params.mix]
    if config["sequences_per_step"] is None:
        config["sequences_per_step"] = params.sequences_per_step  # -1: local x dp
    differ = [k for k in recorded if recorded[k] != config[k]]
    if differ:
        note(
            "MISMATCH",
            f"{path} differs from what the last segment ran with in {differ} (config: "
            + "; ".join(f"{k}={config[k]}" for k in differ)
            + "; ledger: "
            + "; ".join(f"{k}={recorded[k]}" for k in differ)
            + ")",
            int(segment.record["continues_from"]) + 1,
        )
    else:
        note("ok", f"{path.name} matches the last segment's loader parameters")
    if hashlib.sha256(path.read_bytes()).hexdigest() != segment.record.get("config_sha256"):
        note(
            "note",
            f"{path.name} was edited since the last segment started (its data keys still match)",
        )
