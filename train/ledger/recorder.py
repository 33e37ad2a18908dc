"""`DataLedgerRecorder`: the trainer's side of the data ledger (`train.ledger`).

Why a component of its own: the ledger is one small piece of per-step work, record what
this optimizer step trained, that must see every step exactly once and every checkpoint
load, and nothing else of the trainer. So `RunTrainer` holds one recorder and calls it
from three places: `take_lanes` in the step's exchange (the optimizers' veto, once the
step's batches are drawn), `after_step` in `train_step`, once torchtitan's step has applied
or skipped the update (before a loss-spike rollback, which loads a checkpoint), and
`on_load` in `load_state_dict`, which torchtitan's `CheckpointManager` calls for a resume
at start-up and for a rollback's load alike. The next step then opens a new segment.

What one step costs (docs/bench/ledger-2026-11-24.md): on every rank, hashing its own
rows as the loader returns them (~1-2 us a row, in `dataloader.ledger_record.StepTap`); on
rank 0, one JSON line of ~0.4 KB appended and fsynced. The five lanes of a step's rows are
summed over the ranks by no collective of their own: they ride in the step's one exchange
(`train.reliability.exchange`, five more float64 lanes of its all_reduce, read with the
health verdict's one sync). `take_lanes` hands this rank's lanes to it, and `after_step`
gets the sums back. float64 sums the lanes exactly while they stay below 2^53: at most
2^22 rows a step over all ranks, copies included (a 31-bit hash lane each), which the
recorder checks at start (a global batch of four million sequences is refused).

Ranks that hold the same rows (tensor, context or pipeline parallel copies of one
data-parallel rank) all add them: the sum is divided by the number of copies, and a sum
that does not divide evenly means the copies trained different rows (`replicas_disagree`,
which `verify` reports).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from common.run_layout import CONFIG, LEDGER
from dataloader.incidents import read_incidents
from dataloader.ledger_record import (
    LANE_MASK,
    LEDGER_VERSION,
    NUM_LANES,
    LedgerWriter,
    OrderParameters,
    StepTap,
    cursor_to_json,
    step_record,
)

# float64 sums integers exactly below 2**53; each row adds at most LANE_MASK to a hash lane
EXACT_ROWS = 2**53 // (LANE_MASK + 1)  # 2**22


class DataLedgerRecorder:
    """Owned by `RunTrainer`: one step record per optimizer step, a segment record at
    each start, resume and rollback (RUN/ledger.jsonl, rank 0 writes)."""

    def __init__(self, loader, *, run_folder: Path, micro_batches: int, fresh: bool) -> None:
        """`loader`: the training loader (its `ledger_tap` hashes the rows it returns);
        `micro_batches`: micro-batches per optimizer step (gradient accumulation x pipeline
        micro-batches); `fresh`: a `--fresh` start, whose history begins anew."""
        self.loader = loader
        self.enabled = isinstance(getattr(loader, "ledger_tap", None), StepTap)
        self.run_dir = Path(run_folder)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        if not self.enabled:
            return
        self.copies = self.world_size // loader.dp_world_size
        self.world = {
            "ranks": self.world_size,
            "dp": loader.dp_world_size,
            "local_batch": loader.local_batch_size,
            "grad_accum": micro_batches,
        }
        self.sequences_per_step = loader.local_batch_size * loader.dp_world_size
        self.sequences_per_step *= self.world["grad_accum"]
        rows = self.sequences_per_step * self.copies  # summed in the exchange's float64 lanes
        if rows > EXACT_ROWS:
            raise ValueError(
                f"the data ledger sums each step's rows exactly in float64 lanes, up to "
                f"{EXACT_ROWS:,} rows a step over all ranks; this run has {rows:,} "
                f"({self.sequences_per_step:,} sequences x {self.copies} copies): lower "
                "training.global_batch_size"
            )
        if self.rank == 0 and fresh:
            (self.run_dir / LEDGER).unlink(missing_ok=True)  # --fresh: a new history
        self.writer = LedgerWriter(self.run_dir / LEDGER) if self.rank == 0 else None
        self._segment: tuple[str, int] | None = ("start", 0)
        self._steps_recorded = 0
        self._start = None  # the loader's position before the step's rows (`take_lanes`)

    def on_load(self, step: int) -> None:
        """A checkpoint of step `step` was loaded: the next step opens a segment."""
        if self.enabled:
            self._segment = ("rollback" if self._steps_recorded else "resume", step)

    def take_lanes(self) -> list[int]:
        """This rank's lanes of the step's rows (the loader's tap, taken once per step), for
        the step's exchange; zeros without a ledger."""
        if not self.enabled:
            return [0] * NUM_LANES
        lanes, self._start = self.loader.ledger_tap.take()
        return lanes

    def after_step(self, step: int, *, skipped: bool, lanes: list[int] | None = None) -> None:
        """Record optimizer step `step`, its update applied or (`skipped`: a non-finite
        step, a spike's last step) not; rank 0 writes. `lanes`: the step's lanes summed
        over the ranks (the exchange's); None in a world of one: this rank's own."""
        if not self.enabled:
            return
        if lanes is None:
            assert self.world_size == 1, "with several ranks the lanes come summed"
            lanes = self.take_lanes()
        start, self._start = self._start, None
        assert start is not None, f"step {step} drew no batch from the loader"
        disagree = any(x % self.copies for x in lanes)
        lanes = [x // self.copies for x in lanes]
        self._steps_recorded += 1
        if self.writer is None:
            return
        loader = self.loader
        orders = loader.order.datasets
        if self._segment is not None:
            self.writer.append(self._segment_record(*self._segment, start, orders))
            self._segment = None
        record = step_record(step, not skipped, lanes, loader.cursor, orders, loader.order)
        if disagree:
            record["replicas_disagree"] = True
        self.writer.append(record)

    def _segment_record(self, cause: str, origin: int, start, orders) -> dict:
        loader = self.loader
        config = self.run_dir / CONFIG
        params = OrderParameters.of_loader(loader, self.sequences_per_step)
        record = {
            "kind": "segment",
            "version": LEDGER_VERSION,
            "cause": cause,
            "continues_from": origin,
            "params": asdict(params),
            "skip_ranges": [list(r) for r in loader.skip_ranges],
            "incidents": len(read_incidents(self.run_dir).spikes),
            "config_sha256": (
                hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
            ),
            "cursor": cursor_to_json(start, orders),
            "world": self.world,
            "time": time.time(),
        }
        if loader.quarantine_entries:  # absent without one: such records are as before
            # the first q quarantine records of RUN/incidents.jsonl, as the resume handed
            # them to the loader (train/reliability/rollback.py), and the token ranges they made
            record["quarantines"] = loader.quarantine_entries
            record["quarantined"] = [[list(r) for r in d.quarantine] for d in loader.datasets]
        return record
