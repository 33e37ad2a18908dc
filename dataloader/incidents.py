"""RUN/incidents.jsonl read back: what a resume puts in force on the loader.

Why one home: two readers must apply the incidents the same way. The trainer's resume
(`train.reliability.rollback.LossSpikeRollback`) hands them to the live loader, and the data
ledger's recomputation (`train.ledger.checks`) hands them to the order it rebuilds from the
config and the manifests. If the two rules drifted apart, `verify` would fail a correct run,
or pass a wrong one. So both read the file here and quarantine through `quarantine_streams`.

The file holds two kinds of record (`common.run_layout.SPIKE_KIND`, `QUARANTINE_KIND`):

* a loss-spike rollback (train/reliability/rollback.py writes it): its `skipped_sequences`
  [start, end) of global sequences is skipped again by every later segment;
* a quarantined document (`python -m train.forensics --quarantine-*` writes it): the
  content hash of its dataset and its on-disk token range [first, end). Every window that
  overlaps it is passed over, in every epoch. It is keyed by content, not path: a range
  means nothing on other data, and a moved dataset keeps its quarantine.

Each kind is in force in file order: a segment that ran with k rollbacks and q quarantines
had the first k and the first q records of each kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.io import read_jsonl
from common.run_layout import INCIDENTS, QUARANTINE_KIND, SPIKE_KIND


@dataclass
class Incidents:
    """The records of RUN/incidents.jsonl by kind, each in file order."""

    spikes: list[dict] = field(default_factory=list)
    quarantines: list[dict] = field(default_factory=list)
    num_torn: int = 0  # lines cut short by a kill mid-append: dropped

    def skip_ranges(self, k: int | None = None) -> list[list[int]]:
        """The global-sequence ranges the first `k` rollbacks (all when None) skip."""
        return [list(r["skipped_sequences"]) for r in self.spikes[:k]]

    def quarantine_entries(self, q: int | None = None) -> list[tuple[str, int, int]]:
        """(dataset content hash, first token, end token) of the first `q` quarantines."""
        return [(r["content_sha256"], *r["tokens"]) for r in self.quarantines[:q]]


def read_incidents(run_dir: str | Path) -> Incidents:
    """The incidents of `run_dir` (none when it has no RUN/incidents.jsonl)."""
    path = Path(run_dir) / INCIDENTS
    if not path.is_file():
        return Incidents()
    records, num_torn = read_jsonl(path)
    return Incidents(
        spikes=[r for r in records if r.get("kind") == SPIKE_KIND],
        quarantines=[r for r in records if r.get("kind") == QUARANTINE_KIND],
        num_torn=num_torn,
    )


def quarantine_streams(streams, contents: list[str], entries) -> int:
    """Quarantine `entries` ((content_sha256, first, end) each) on the `DatasetStream`s
    whose dataset content hash (`contents`, one per stream) they name, adding to the
    ranges already there. Returns how many entries name a dataset of these streams; the
    others belong to data this run does not train."""
    matched = 0
    for stream, content in zip(streams, contents, strict=True):
        ranges = [(int(first), int(end)) for named, first, end in entries if named == content]
        if ranges:
            stream.set_quarantine(list(stream.quarantine) + ranges)
            matched += len(ranges)
    return matched
