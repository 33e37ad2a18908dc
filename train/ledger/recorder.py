"""`DataLedgerRecorder`: the trainer's side of the data ledger (`train.ledger`).

Why a component of its own: the ledger is one small piece of per-step work, record what
this optimizer step trained, that must see every step exactly once and every checkpoint
load, and nothing else of the trainer. So `RunTrainer` holds one recorder and calls it
from two lines: `after_step` in `train_step`, once torchtitan's step has applied or
skipped the update (before a loss-spike rollback, which loads a checkpoint), and
`on_load` in `load_state_dict`, which torchtitan's `CheckpointManager` calls for a resume
at start-up and for a rollback's load alike. The next step then opens a new segment.

What one step costs (docs/bench/ledger-2026-11-24.md): on every rank, hashing its own
rows as the loader returns them (~1-2 us a row, in `dataloader.ledger_record.StepTap`) and one
all_reduce of five int64 over the default group (40 bytes: latency only, a few tens of
microseconds on NCCL, plus the host sync of reading the sum); on rank 0, one JSON line of
~0.4 KB appended and fsynced. The all_reduce is kept here, apart from the health check's
collective (train/reliability/health.py), so that it can later ride on it as five more lanes.

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

import torch
import torch.distributed as dist

from common.run_layout import CONFIG, LEDGER
from dataloader.incidents import read_incidents
from dataloader.ledger_record import (
    LEDGER_VERSION,
    LedgerWriter,
    OrderParameters,
    StepTap,
    cursor_to_json,
    step_record,
)


class DataLedgerRecorder:
    """Owned by `RunTrainer`: one step record per optimizer step, a segment record at
    each start, resume and rollback (RUN/ledger.jsonl, rank 0 writes)."""

    def __init__(
        self, loader, *, run_folder: Path, device, micro_batches: int, fresh: bool
    ) -> None:
        """`loader`: the training loader (its `ledger_tap` hashes the rows it returns);
        `micro_batches`: micro-batches per optimizer step (gradient accumulation x pipeline
        micro-batches); `fresh`: a `--fresh` start, whose history begins anew."""
        self.loader = loader
        self.enabled = isinstance(getattr(loader, "ledger_tap", None), StepTap)
        self.run_dir = Path(run_folder)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.device = device
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
        if self.rank == 0 and fresh:
            (self.run_dir / LEDGER).unlink(missing_ok=True)  # --fresh: a new history
        self.writer = LedgerWriter(self.run_dir / LEDGER) if self.rank == 0 else None
        self._segment: tuple[str, int] | None = ("start", 0)
        self._steps_recorded = 0

    def on_load(self, step: int) -> None:
        """A checkpoint of step `step` was loaded: the next step opens a segment."""
        if self.enabled:
            self._segment = ("rollback" if self._steps_recorded else "resume", step)

    def after_step(self, step: int, *, skipped: bool) -> None:
        """Record optimizer step `step`, its update applied or (`skipped`: a non-finite
        step, a spike's last step) not: every rank takes part in the all_reduce; rank 0
        writes."""
        if not self.enabled:
            return
        lanes, start = self.loader.ledger_tap.take()
        assert start is not None, f"step {step} drew no batch from the loader"
        if dist.is_initialized() and self.world_size > 1:
            summed = torch.tensor(lanes, dtype=torch.int64, device=self.device)
            dist.all_reduce(summed)
            lanes = summed.cpu().tolist()
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
