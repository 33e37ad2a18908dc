"""`DataLedgerRecorder`: the trainer's side of the data ledger (`train.ledger`).

Why a component of its own: the ledger is one small piece of per-step work, record what
this optimizer step trained, that must see every step exactly once and every checkpoint
load, and nothing else of the trainer. So the recorder is one of the trainer's step hooks
(`train.step_hooks`), called at three points: `lanes` (`take_lanes`) in the step's exchange
(the optimizers' veto, once the step's batches are drawn), `after_step`, once torchtitan's
step has applied or skipped the update (before a loss-spike rollback, which loads a
checkpoint), and `load_state_dict` (`on_load`), which torchtitan's `CheckpointManager`
reaches for a resume at start-up and for a rollback's load alike. The next step then opens
a new segment.

What one step costs (docs/bench/ledger-2026-11-24.md): on every rank, hashing its own
rows as the loader returns them (~1-2 us a row, in `dataloader.ledger_record.StepTap`); on
rank 0, one record of ~0.4 KB handed to the ledger's writer thread. The five lanes of a
step's rows are summed over the ranks by no collective of their own: they ride in the step's
one exchange
(`train.reliability.exchange`, five more float64 lanes of its all_reduce, read with the
health verdict's one sync). `take_lanes` hands this rank's lanes to it, and `after_step`
gets the sums back. float64 sums the lanes exactly while they stay below 2^53: at most
2^22 rows a step over all ranks, copies included (a 31-bit hash lane each), which the
recorder checks at start (a global batch of four million sequences is refused).

Why a writer thread (`LedgerWriterThread`): rank 0 used to append and fsync each record in
the training thread, and every other rank waited for that fsync at the next collective. On
NFS or Lustre, with an async checkpoint writing at the same time, an fsync takes 10-500 ms:
that, every step, on every rank. Now the training thread only queues the record; the thread
appends it (a whole line, flushed to the kernel: a kill -9 of the process keeps it) and
fsyncs every `FSYNC_EVERY_STEPS` steps and before each checkpoint save (`sync`, which the
checkpointer calls, train/components/checkpoint.py), and at close. What a crash can lose:
with kill -9 only records still in the queue, with a node crash those not yet fsynced;
either way only steps after the newest checkpoint, which the resume trains again in a new
segment that supersedes them. The records of every step up to a checkpoint reach the disk
before that checkpoint is written, so `verify` can require the final lineage to reach the
newest complete checkpoint (`train.ledger.replay`).

Ranks that hold the same rows (tensor, context or pipeline parallel copies of one
data-parallel rank) all add them: the sum is divided by the number of copies, and a sum
that does not divide evenly means the copies trained different rows (`replicas_disagree`,
which `verify` reports).
"""

from __future__ import annotations

import hashlib
import queue
import threading
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
from train.step_hooks import StepHook

# float64 sums integers exactly below 2**53; each row adds at most LANE_MASK to a hash lane
EXACT_ROWS = 2**53 // (LANE_MASK + 1)  # 2**22
# fsync the ledger at least this often (and before every checkpoint save): a node crash then
# loses at most this many steps' records, all of steps after the newest checkpoint (which the
# resume trains again); between fsyncs an append costs a write into the page cache
FSYNC_EVERY_STEPS = 50


class LedgerWriterThread:
    """Rank 0's ledger writer: appends the records the training thread queues, fsyncs every
    `fsync_every` step records and when asked (`sync`, before a checkpoint; `close`). A
    write error is raised in the training thread at its next `put` or `sync`."""

    def __init__(self, path: Path, fsync_every: int = FSYNC_EVERY_STEPS):
        self.writer = LedgerWriter(path)
        self.fsync_every = fsync_every
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
        self._thread.start()

    def put(self, record: dict) -> None:
        self._raise()
        self._queue.put(("record", record))

    def sync(self) -> None:
        """Return once every record queued so far is appended and fsynced."""
        if not self._thread.is_alive():  # closed
            return self._raise()
        done = threading.Event()
        self._queue.put(("sync", done))
        done.wait()
        self._raise()

    def close(self) -> None:
        """Append what is queued, fsync, stop the thread."""
        if self._thread.is_alive():
            self._queue.put(("stop", None))  # after every record queued before it
            self._thread.join()  # which fsynced and closed the file
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"{self.writer.path}: the ledger could not be written") from (
                self._error
            )

    def _run(self) -> None:
        unsynced = 0
        while True:
            kind, item = self._queue.get()
            try:
                if kind == "stop":
                    self.writer.close()  # fsynced
                elif self._error is None and kind == "record":
                    self.writer.append(item, sync=False)
                    unsynced += item.get("kind") == "step"
                    if unsynced >= self.fsync_every:
                        self.writer.sync()
                        unsynced = 0
                elif self._error is None and kind == "sync":
                    self.writer.sync()
                    unsynced = 0
            except Exception as err:  # the disk (or a bug): the training thread raises it
                self._error = self._error or err
            if kind == "sync":
                item.set()
            elif kind == "stop":
                return


class DataLedgerRecorder(StepHook):
    """A step hook: one step record per optimizer step, a segment record at each start,
    resume and rollback (RUN/ledger.jsonl, rank 0 writes)."""

    def __init__(
        self,
        loader,
        *,
        run_folder: Path,
        micro_batches: int,
        fresh: bool,
        fsync_every: int = FSYNC_EVERY_STEPS,
        ledger_path: Path | None = None,
    ) -> None:
        """`loader`: the training loader (its `ledger_tap` hashes the rows it returns);
        `micro_batches`: micro-batches per optimizer step (gradient accumulation x pipeline
        micro-batches); `fresh`: a `--fresh` start, whose history begins anew;
        `fsync_every`: step records between the writer thread's fsyncs; `ledger_path`: where
        rank 0 writes (RUN/ledger.jsonl unless given: a replica group's is its own)."""
        self.loader = loader
        self.optimizers = None  # `from_trainer`'s (a replica group's tell what the quorum did)
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
        self.sequences_per_step = loader.local_batch_size * loader.dp_world_size * micro_batches
        rows = self.sequences_per_step * self.copies  # summed in the exchange's float64 lanes
        if rows > EXACT_ROWS:
            raise ValueError(
                f"the data ledger sums each step's rows exactly in float64 lanes, up to "
                f"{EXACT_ROWS:,} rows a step over all ranks; this run has {rows:,} "
                f"({self.sequences_per_step:,} sequences x {self.copies} copies): lower "
                "training.global_batch_size"
            )
        ledger_path = Path(ledger_path or self.run_dir / LEDGER)
        if self.rank == 0 and fresh:
            ledger_path.unlink(missing_ok=True)  # --fresh: a new history
        if self.rank == 0:
            ledger_path.parent.mkdir(parents=True, exist_ok=True)
        self.writer = LedgerWriterThread(ledger_path, fsync_every) if self.rank == 0 else None
        self._segment: tuple[str, int] | None = ("start", 0)
        self._steps_recorded = 0
        self._start = None  # the loader's position before the step's rows (`take_lanes`)

    @classmethod
    def from_trainer(cls, trainer, **kwargs) -> DataLedgerRecorder:
        """The run's data ledger, RUN/ledger.jsonl (`kwargs`: a subclass's own)."""
        micro_batches = trainer.gradient_accumulation_steps
        micro_batches *= trainer.num_pipeline_parallel_microbatches
        fresh = getattr(trainer.checkpointer, "fresh", False)
        kwargs = {"micro_batches": micro_batches, "fresh": fresh} | kwargs
        recorder = cls(trainer.dataloader, run_folder=Path(trainer.config.dump_folder), **kwargs)
        trainer.checkpointer.before_save(recorder.sync)  # a checkpoint never outruns its ledger
        recorder.optimizers = trainer.optimizers
        return recorder

    def lanes(self) -> dict:
        return {"ledger": self.take_lanes()}

    def load_state_dict(self, state: dict) -> None:
        self.on_load(state["step"])

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

    def after_step(
        self, step: int, *, skipped: bool, lanes: list[int] | None = None, sums=None
    ) -> None:
        """Record optimizer step `step`, its update applied or (`skipped`: a non-finite
        step, a spike's last step) not; rank 0 writes. `lanes`: the step's lanes summed
        over the ranks (the exchange's `sums`); None in a world of one: this rank's own."""
        if sums is not None:
            lanes = sums.ledger
        if not self.enabled:
            return
        if lanes is None:
            assert self.world_size == 1, "with several ranks the lanes come summed"
            lanes = self.take_lanes()
        start, self._start = self._start, None
        assert start is not None, f"step {step} drew no batch from the loader"
        self._steps_recorded += 1
        if self.writer is None:
            return
        loader = self.loader
        per_copy = [x // self.copies for x in lanes]
        record = step_record(step, not skipped, per_copy, loader.cursor, loader.order)
        if any(x % self.copies for x in lanes):
            record["replicas_disagree"] = True
        self._write(start, record)

    def _write(self, start, record: dict) -> None:
        """Rank 0: the pending segment record (a start, resume or rollback), if any, then
        `record` (a subclass adds its own fields here)."""
        if self._segment is not None:
            orders = self.loader.order.datasets
            self.writer.put(self._segment_record(*self._segment, start, orders))
            self._segment = None
        self.writer.put(record)  # appended by the writer thread, fsynced every few steps

    def sync(self, step: int | None = None) -> None:
        """Every record so far on disk, fsynced (rank 0; a no-op elsewhere): called before
        each checkpoint save of `step`, so that a checkpoint never outruns its ledger."""
        if getattr(self, "writer", None) is not None:
            self.writer.sync()

    def close(self) -> None:
        """Flush, fsync and stop the writer thread (the trainer's close)."""
        if getattr(self, "writer", None) is not None:
            self.writer.close()

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
