"""`ReplicaLedgerRecorder`: the data ledger of one replica group, RUN/replicas/G/ledger.jsonl.

Why one ledger per group: groups die and come back on their own, so no single writer sees
every step; each group's rank 0 records every step it took part in, and `python -m
train.ledger verify` merges the groups' ledgers (`train.ledger.replicas`). What makes a
group's record a record of the *whole* step: the trainer sums each rank's row digest over
the step's groups (`ReplicaGroupsManager.sum_across`, after the gradients' sums)
before this recorder sums it over the group's ranks, so every group that commits a step
records the digest of all its rows, those of a group that died after the reduction too.

What a record adds to the single-run format (`dataloader.ledger_record.step_record`):
`sequences` (this step's size: the live groups' slices), `quorum` (how many groups, this
group's rank among them, and which groups: a bit per group, summed in the same reduction),
and `time`. A step the quorum did not commit is an `attempt` record: no data consumed, the
position it was served from, which the next step serves again. A group that heals writes a
`heal` segment, continuing from its peer's step with its peer's loader position.
"""

from __future__ import annotations

import time
from pathlib import Path

from common.run_layout import LEDGER, replica_dir
from dataloader.ledger_record import cursor_to_json
from train.ledger.recorder import DataLedgerRecorder


class ReplicaLedgerRecorder(DataLedgerRecorder):
    def __init__(self, loader, *, run_folder: Path, group: int, **kwargs) -> None:
        ledger = replica_dir(run_folder, group) / LEDGER  # written by the base's writer thread
        super().__init__(loader, run_folder=run_folder, ledger_path=ledger, **kwargs)
        self.group = group
        self.healing = False  # the trainer sets it around the quorum: a load then is a heal
        self.quorum: dict = {}  # the step's quorum, set by the trainer
        self.sequences = 0  # the step's size, set by the trainer
        self.step_loss: float | None = None  # the step's loss over all its slices
        self._began = time.time()

    @classmethod
    def from_trainer(cls, trainer) -> ReplicaLedgerRecorder:
        """This group's ledger, RUN/replicas/G/ledger.jsonl, in place of the run's."""
        return super().from_trainer(
            trainer,
            group=trainer.config.replica_groups.replica_id,
            micro_batches=trainer.gradient_accumulation_steps,  # a full step, over every group
            fresh=False,
        )

    def on_load(self, step: int) -> None:
        super().on_load(step)
        self._began = time.time()
        if self.enabled and self.healing:
            self._segment = ("heal", step)

    def healed_to(self, committed: int) -> None:
        """A heal in this step's quorum continues from the quorum's `committed` steps (the
        peer's train state was taken mid-step, its step counter already advanced)."""
        if self._segment is not None and self._segment[0] == "heal":
            self._segment = ("heal", committed)

    def after_step(
        self, step: int, *, skipped: bool, lanes: list[int] | None = None, sums=None
    ) -> None:
        """A step the quorum committed: `lanes` summed over the groups (the trainer's
        reduction across them) and over this group's ranks (the step's exchange, `sums`);
        one it did not made no exchange (the optimizers asked torchft first): an attempt."""
        if not getattr(self.optimizers, "committed", True):
            return self.attempt(step)
        super().after_step(step, skipped=skipped, lanes=lanes, sums=sums)

    def attempt(self, step: int) -> None:
        """A step the quorum did not commit: no data consumed; the position it was served
        from (taken by the step's exchange, which ran empty for its flags), which the next
        step serves again."""
        if not self.enabled:
            return
        start, self._start = self._start, None
        if start is None:  # no exchange took the tap this step
            _, start = self.loader.ledger_tap.take()
        if self.writer is None:
            return
        cursor = cursor_to_json(start, self.loader.order.datasets)
        self._write(start, {"kind": "attempt", "step": step, "cursor": cursor})

    def _write(self, start, record: dict) -> None:
        """A step record adds the step's size; every record the quorum and the time."""
        if record["kind"] == "step":
            record["sequences"] = self.sequences
        record |= {"quorum": self.quorum, "group": self.group, "time": time.time()}
        if self.step_loss is not None:
            record["loss"] = self.step_loss
        super()._write(start, record)

    def _segment_record(self, *args) -> dict:
        """The base's, timed at the load, to be merged with the other groups' by time."""
        return super()._segment_record(*args) | {"time": self._began}
