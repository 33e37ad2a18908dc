"""What `python -m train.forensics` reads and writes around its replay (no training here).

Why a module apart from the replay (train/forensics/__main__.py, train/forensics/replay.py): the
questions answered here (which incident, what the run logged for its steps, which FP8
statistics belong to the spiking lineage, how per-token losses become a ranking of
documents, what a quarantine record holds, the table a person reads) depend only on the
run folder's files and on the replay's per-row losses, so they are tested in-process
without a launch, and the replay stays about the training it reruns.

The run folder keeps one lineage per stretch between loads: a rollback or a resume trains
a step number again. What belongs to the spiking lineage of incident K is what was
written before its record: metrics.jsonl lines carry a time, and the latest line of a
step before the incident's time is the one the spike rule judged. FP8 statistics
(RUN/fp8_stats.jsonl) carry no time, but each stats step writes exactly one record there
and one metrics line holding its `fp8/...` summary, in the same order; the n-th such line
dates the n-th record.

A document's loss: each row of the spiking step is a window of on-disk tokens [s, s+L+1);
its per-token loss i is the loss of predicting token s+i+1, counted for the document that
holds that token (what the model failed to predict is that document's text). A document
is ranked by its mean per-token loss over every row of the spiking step(s) it appears in,
when it has at least `min_tokens` such tokens there (a fragment of a few tokens at a
window's edge has a noisy mean; it is listed, not ranked).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from common import run_layout
from common.io import read_jsonl
from common.run_layout import QUARANTINE_KIND, SPIKE_KIND


# --------------------------------------------------------------------------- the incident
def read_incident(run_dir: Path, number: int) -> tuple[dict, list[dict]]:
    """(incident `number`'s record, every record of RUN/incidents.jsonl before it): the
    loss-spike rollbacks and quarantines in force while the run trained into that spike.
    Incidents are numbered 1, 2, ... in file order (the record's `rollback`)."""
    path = run_dir / run_layout.INCIDENTS
    if not path.is_file():
        raise ValueError(f"{path} does not exist: the run in {run_dir} had no loss-spike rollback")
    records, _ = read_jsonl(path)
    spikes = [i for i, r in enumerate(records) if r.get("kind") == SPIKE_KIND]
    if not 1 <= number <= len(spikes):
        raise ValueError(
            f"--incident {number}: {path} holds {len(spikes)} loss-spike incident(s); "
            f"give --incident 1 to {len(spikes)}"
            if spikes
            else f"--incident {number}: {path} holds no loss-spike incident"
        )
    at = spikes[number - 1]
    return records[at], records[:at]


def spiking_steps(incident: dict) -> list[int]:
    """The steps the spike rule flagged: first_spike_step .. step."""
    return list(range(int(incident["first_spike_step"]), int(incident["step"]) + 1))


def logged_lines(run_dir: Path, incident: dict, steps: list[int]) -> dict[int, dict]:
    """Per step, the metrics.jsonl line of the spiking lineage: the last line of that step
    logged before the incident was recorded (a later one is a re-run after a rollback)."""
    records, _ = run_layout.read_metrics(run_dir)
    return {
        r["step"]: r
        for r in records
        if r.get("step") in steps and "loss" in r and r.get("time", 0.0) <= incident["time"]
    }


def original_losses(run_dir: Path, incident: dict, steps: list[int]) -> dict[int, dict]:
    """Per step, the global mean loss the run logged (metrics.jsonl), or, for a spiking step
    whose line was not logged (metrics.log_freq), the one the spike rule recorded."""
    lines = logged_lines(run_dir, incident, steps)
    rule = dict(zip(spiking_steps(incident), incident.get("losses", []), strict=False))
    out = {}
    for step in steps:
        if step in lines:
            out[step] = {"loss": lines[step]["loss"], "from": run_layout.METRICS}
        elif step in rule:
            out[step] = {"loss": rule[step], "from": f"{run_layout.INCIDENTS} (6 decimals)"}
    return out


# --------------------------------------------------------------------------- FP8 statistics
def fp8_statistics(run_dir: Path, incident: dict) -> tuple[list[dict], str]:
    """(the RUN/fp8_stats.jsonl records of the spiking lineage between the checkpoint and
    the spike, nearest the spike first; a line saying what was found or why none)."""
    path = run_dir / run_layout.FP8_STATS
    first, last = int(incident["rolled_back_to"]) + 1, int(incident["step"])
    if not path.is_file():
        return [], f"no FP8 statistics recorded ({path.name} absent: fp8.stats_freq = 0)"
    stats, _ = read_jsonl(path)
    metrics, _ = run_layout.read_metrics(run_dir)
    dated = [r for r in metrics if any(k.startswith("fp8/") for k in r)]
    if len(dated) != len(stats) or any(
        a.get("step") != b.get("step") for a, b in zip(dated, stats, strict=False)
    ):
        return [], (
            f"{path.name} and {run_layout.METRICS} do not align ({len(stats)} records, "
            f"{len(dated)} lines with fp8/ keys: a torn line?); not attributed to a lineage"
        )
    chosen: dict[int, dict] = {}
    for line, record in zip(dated, stats, strict=True):
        if first <= line["step"] <= last and line.get("time", 0.0) <= incident["time"]:
            chosen[line["step"]] = record
    if not chosen:
        return [], (
            f"no FP8 statistics recorded between checkpoint step {first - 1} and the spike at "
            f"step {last} (fp8.stats_freq too coarse, or 0)"
        )
    ordered = [chosen[s] for s in sorted(chosen, reverse=True)]
    return ordered, f"FP8 statistics of step(s) {sorted(chosen)} ({path.name})"


# --------------------------------------------------------------------------- documents
@dataclass
class ScoredRow:
    """One row of a replayed spiking step: where its window lies and its per-token losses
    (no injected fault factor: the model's own loss), from `train.forensics.replay`."""

    step: int
    rank: int
    sequence: int  # global sequence index
    dataset: int  # index in the mix
    epoch: int
    start: int  # on-disk token of the window's first input token
    losses: np.ndarray  # [L] float32: loss of predicting token start + i + 1
    positions: np.ndarray  # [L] the loader's positions (0 at each document start)
    factor: float  # the injected spike factor of its micro-batch (1.0 in a real run)


@dataclass
class DocumentLoss:
    dataset: int
    dataset_path: str
    content_sha256: str
    document: int
    first: int
    end: int
    source: str | None
    record: int | None
    tokens: int = 0
    loss_sum: float = 0.0
    loss_max: float = 0.0
    windows: list = field(default_factory=list)
    ranked: bool = True

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.tokens if self.tokens else 0.0

    def to_json(self) -> dict:
        return asdict(self) | {"mean_loss": self.mean_loss}


def rank_documents(rows, datasets: list[dict], window_documents, min_tokens: int):
    """Every document of the rows, with its per-token losses summed: the ranked ones
    (>= `min_tokens` tokens) by mean loss, highest first, then the rest (`ranked` False).

    `datasets[d]` holds the mix entry's `path` and `content_sha256`; `window_documents(d,
    first, end)` lists the documents a window's tokens overlap
    (`train.ledger.readers.DocumentRef`s; the seam in train/forensics/__main__.py)."""
    found: dict[tuple[int, int], DocumentLoss] = {}
    for row in rows:
        length = len(row.losses)
        docs = window_documents(row.dataset, row.start, row.start + length + 1)
        check_positions(row, docs)
        firsts = [doc.start for doc in docs]
        predicted = row.start + 1 + np.arange(length)  # the token each loss is about
        owner = np.searchsorted(firsts, predicted, side="right") - 1
        for k in np.unique(owner).tolist():
            doc = docs[k]
            losses = row.losses[owner == k]
            key = (row.dataset, doc.document)
            entry = found.get(key)
            if entry is None:
                meta = datasets[row.dataset]
                names = (doc.document, doc.start, doc.end, doc.source, doc.record)
                entry = found[key] = DocumentLoss(
                    row.dataset, meta["path"], meta["content_sha256"], *names
                )
            entry.tokens += int(losses.size)
            entry.loss_sum += float(losses.sum(dtype=np.float64))
            entry.loss_max = max(entry.loss_max, float(losses.max()))
            part = predicted[owner == k]
            entry.windows.append(
                {
                    "step": row.step,
                    "sequence": row.sequence,
                    "epoch": row.epoch,
                    "window_start": row.start,
                    "tokens": [int(part[0]), int(part[-1]) + 1],  # on-disk tokens predicted
                    "mean_loss": float(losses.mean(dtype=np.float64)),
                }
            )
    for entry in found.values():
        entry.ranked = entry.tokens >= min_tokens
    return sorted(found.values(), key=lambda e: (not e.ranked, -e.mean_loss))


def check_positions(row: ScoredRow, docs: list) -> None:
    """The loader's positions restart exactly where the documents named start (and at the
    window's first token): the seam and the batch agree on the boundaries."""
    length = len(row.positions)
    starts = {0} | {doc.start - row.start for doc in docs if 0 < doc.start - row.start < length}
    restarts = set(np.flatnonzero(np.asarray(row.positions) == 0).tolist())
    assert restarts == starts, (
        f"sequence {row.sequence}: positions restart at {sorted(restarts)}, documents start "
        f"at {sorted(starts)}"
    )


def select_for_quarantine(ranked: list[DocumentLoss], top: int | None, above: float | None):
    """The documents `--quarantine-top N` (the first N ranked) or `--quarantine-above LOSS`
    (every ranked one with a mean loss above LOSS) select."""
    candidates = [e for e in ranked if e.ranked]
    if top is not None:
        return candidates[:top]
    if above is not None:
        return [e for e in candidates if e.mean_loss > above]
    return []


def quarantine_records(selected, incident: dict, number: int, existing: list[dict], now: float):
    """The RUN/incidents.jsonl records quarantining `selected` (one per document not
    already quarantined): what a resume hands the loader (train/reliability/rollback.py)."""
    known = {
        (r.get("content_sha256"), tuple(r.get("tokens", ())))
        for r in existing
        if r.get("kind") == QUARANTINE_KIND
    }
    return [
        {
            "kind": QUARANTINE_KIND,
            "incident": number,
            "step": incident["step"],
            "dataset": e.dataset_path,
            "content_sha256": e.content_sha256,
            "document": e.document,
            "tokens": [e.first, e.end],
            "source": e.source,
            "record": e.record,
            "mean_loss": round(e.mean_loss, 6),
            "time": now,
        }
        for e in selected
        if (e.content_sha256, (e.first, e.end)) not in known
    ]


# --------------------------------------------------------------------------- the table
def format_report(report: dict, rows_shown: int) -> str:
    """The console version of the report (the JSON has everything)."""
    # the ranking the run's FP8 warnings use; it loads torch, as the replay before did
    from train.components.fp8_stats import worst_linears

    inc, plan = report["incident"], report.get("plan")
    planned = (
        f" (planned peak {plan['peak_gib']:.2f} GiB a rank of {plan['usable_gib']:.1f} GiB "
        "usable: train/forensics/plan.py)"
        if plan
        else ""
    )
    out = [
        f"incident {report['number']} of {report['run']}: loss spike at step {inc['step']} "
        f"(first spiking step {inc['first_spike_step']}), rolled back to checkpoint step "
        f"{inc['rolled_back_to']}; global sequences {inc['skipped_sequences']} skipped",
        f"replayed steps {report['replayed_steps'][0]}-{report['replayed_steps'][-1]} from "
        f"checkpoint step {inc['rolled_back_to']} on {report['world_size']} rank(s)" + planned,
        "",
        f"{'step':>5}  {'run loss':>12}  {'replay loss':>12}  {'|diff|':>9}  "
        f"{'model loss':>10}  source of the run's loss",
    ]
    for step in report["losses"]:
        run_loss, replay = step.get("run"), step.get("replay")
        diff = abs(run_loss - replay) if None not in (run_loss, replay) else None
        out.append(
            f"{step['step']:>5}  {_num(run_loss, 12, 6)}  {_num(replay, 12, 6)}  "
            f"{_num(diff, 9, 2, 'e')}  {_num(step.get('model'), 10, 4)}  {step.get('from', '-')}"
        )
    out.append(
        "  (run and replay losses are what the trainer logs, injected fault factors included; "
        "model loss: the mean per-token loss of the step's tokens without them)"
    )
    docs = report["documents"]
    ranked = [d for d in docs if d["ranked"]]
    out += [
        "",
        f"documents of step(s) {report['spiking_steps']} by mean per-token loss "
        f"({len(ranked)} with >= {report['min_tokens']} tokens ranked; "
        f"{len(docs) - len(ranked)} fragments not ranked)",
        f"{'#':>3}  {'mean':>7}  {'max':>7}  {'tokens':>6}  {'document':>9}  "
        f"{'token range':<20}  {'source:record':<24}  dataset",
    ]
    for i, d in enumerate(ranked[:rows_shown], start=1):
        span = f"[{d['first']}, {d['end']})"
        source = "-" if d.get("source") is None else f"{d['source']}:{d['record']}"
        out.append(
            f"{i:>3}  {d['mean_loss']:>7.3f}  {d['loss_max']:>7.3f}  {d['tokens']:>6}  "
            f"{d['document']:>9}  {span:<20}  {source:<24}  {d['dataset_path']}"
        )
    if ranked and ranked[0].get("source") is None:
        out.append(
            "  (source file and record: provenance unavailable, the data was prepared before "
            "manifest format 2; re-prepare it to name them)"
        )
    out += ["", report["fp8"]["note"]]
    for record in report["fp8"]["records"][:1]:
        for title, stat, spec in (
            ("worst underflow", "underflow", ".3%"),
            ("worst saturation", "saturation", ".3%"),
            ("largest amax", "amax", ".4g"),
        ):
            worst = worst_linears([record], stat)[:3]
            shown = ", ".join(f"{name} {op} {value:{spec}}" for value, name, op, _ in worst)
            out.append(f"  step {record['step']} {title}: {shown or '-'}")
    out += [*report.get("quarantined_lines", []), "", f"report: {report['report_path']}"]
    return "\n".join(out)


def _num(value, width: int, digits: int, kind: str = "f") -> str:
    return f"{value:>{width}.{digits}{kind}}" if value is not None else f"{'-':>{width}}"
