"""`TokenShardDataLoader`: the torchtitan dataloader over prepared token shards.

Why this design: the loader must never repeat or skip a sample across crashes,
preemptions and a change of data-parallel size, and its cost must not grow with the
corpus (1e12 tokens, 1e9 documents). So the order of all sequences is a pure function
of (seed, manifests, mix schedule, seq_len schedule, skip ranges), computed per sequence
in O(1) memory, and the whole checkpoint state is a few global counters, identical on
every rank. Three modules, one job each:

* `dataloader.stream`: one dataset's windows (shards -> blocks -> groups -> windows in
  keyed order, what a seq_len change drops) and the state's `STATE_FORMAT_VERSION`;
* `dataloader.global_order`: rounds of W*B global sequences, the mix's error feedback,
  skip ranges and seq_len phases (`SchedulePhase`), from the counters (`Cursor`);
* this module: `Config` and its checks, iteration, the prefetch thread, and the
  checkpoint state with the migration of older state formats.

A background thread prepares the next `prefetch` batches from a *copy* of the
counters; the state (`state_dict`) is the counters after the last batch returned,
so what was prefetched but not returned is not consumed.

Checkpoint state (see `state_dict`): `num_sequences_consumed`, `seq_len`,
`fingerprint` (hash of the manifests' contents, mix weights, mix schedule, seed and
non-default block sizes) and a JSON string with the per-dataset counters (sequences,
block position: epoch, group, cut length, windows taken; skipped tokens) and the state's
`format_version` (3). Older states keep their order for the rest of the run
(`dataloader.legacy_order`): format 2 (windows of one seq_len shuffled over the epoch)
and format 1 (no version field: documents shuffled); they cannot change seq_len. A
different fingerprint is refused unless `allow_dataset_change=True`; then every
dataset whose content is unchanged keeps its position, new ones start at 0, and the
new weights apply from the resume point on (the mixer restarts its error feedback).
Dropped input tokens (`skipped_tokens`) and skipped sequences (`skipped_sequences`) are
counted and logged to metrics.jsonl (`metrics`).

Quarantine (`add_quarantine`): documents named by their on-disk token ranges (what `python
-m train.forensics --quarantine-*` writes to RUN/incidents.jsonl, read back at a resume by
train/reliability/rollback.py) are never trained again: each dataset passes over any window
overlapping one, in this epoch and every later one (`DatasetStream.set_quarantine`), and
counts it (`data/quarantined_windows`; its tokens in `data/skipped_tokens`). A skip range
only covers global sequences of one stretch of the stream, while a document comes back every
epoch in another window: hence ranges of tokens, not of sequences. The global order, the mix
and the state are unchanged by it (the list is not part of the state or the fingerprint:
like skip ranges, it comes from the run folder at each start).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.tools.logging import logger

from dataloader.common import MixEntry
from dataloader.global_order import Cursor, GlobalOrder, Plan, SchedulePhase, longest_seq_len
from dataloader.incidents import quarantine_streams
from dataloader.ledger_record import StepTap
from dataloader.legacy_order import DocumentShuffleOrder, WindowShuffleOrder
from dataloader.stream import STATE_FORMAT_VERSION, BlockPosition, DatasetStream

__all__ = ["MixEntry", "SchedulePhase", "TokenShardDataLoader"]


class TokenShardDataLoader(BaseDataLoader):
    """Deterministic, resumable, reshardable loader over `dataloader.prepare` output."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        mix: list[MixEntry] = field(default_factory=list)
        """Prepared datasets (DATA/train, ...) and their sampling weights."""
        schedule: list[SchedulePhase] = field(default_factory=list)
        """Later mix weights: phase p applies from global sequence `start_sequence` on."""
        seed: int = 0
        """Shuffling seed (part of the checkpoint fingerprint)."""
        infinite: bool = True
        """False: one deterministic pass over every dataset, then stop (validation)."""
        allow_dataset_change: bool = False
        """Resume onto a different mix/dataset/seed/schedule instead of refusing it."""
        prefetch: int = 2
        """Batches prepared ahead by a background thread (0: read inside `next()`)."""
        read_threads: int = 4
        """Threads reading the rows of one batch concurrently (cold pages: parallel I/O)."""
        start_seq_len: int = 0
        """Length of the first phase, when set; 0: the seq_len `build` is given (torchtitan's
        training.seq_len). The trainer sets training.seq_len to the longest phase, so that
        torchtitan sizes RoPE for it, and this to the run's own training.seq_len. (Not
        `seq_len`: torchtitan refuses a config field named like a build() argument.)"""
        block_tokens: int = 1 << 17
        """Shuffle block C: a dataset's token stream is cut into blocks of C tokens, and a
        window never crosses a block boundary, so every seq_len must be <= C. Part of the
        order (the fingerprint)."""
        shuffle_blocks: int = 1024
        """G: windows are shuffled within groups of G blocks (the blocks themselves are
        shuffled over the epoch). A seq_len change drops at most the rest of one group per
        dataset (< G*C tokens, counted). Part of the order (the fingerprint)."""
        skip_sequences: list[list[int]] = field(default_factory=list)
        """[start, end) ranges of global sequences drawn but never yielded (a loss-spike
        rollback's skipped windows, train/reliability/health.py; or a reference run that never saw
        them). Not part of the fingerprint: a range only acts ahead of the cursor, so
        ranges can be added at a resume; `add_skip_ranges` adds more to a live loader."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int = 1,
        dp_rank: int = 0,
        tokenizer: Any = None,
        seq_len: int,
        local_batch_size: int,
        **kwargs: Any,  # snapshot_every_n_steps: the state is a few scalars, always current
    ):
        if not config.mix:
            raise ValueError('dataloader.mix is empty; add [[dataloader.mix]] path = "DATA/train"')
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} outside dp_world_size {dp_world_size}")
        if config.prefetch < 0:
            raise ValueError(f"dataloader.prefetch {config.prefetch} must be >= 0")
        self.config = config
        seq_len = config.start_seq_len or seq_len
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        mix = [MixEntry(**m) if isinstance(m, dict) else m for m in config.mix]
        for entry in mix:
            if not entry.weight > 0:
                raise ValueError(f"dataloader.mix {entry.path}: weight {entry.weight} must be > 0")
        schedule = [SchedulePhase(**p) if isinstance(p, dict) else p for p in config.schedule]
        self._check_schedule(schedule, len(mix))
        longest = longest_seq_len(seq_len, schedule)
        if longest > config.block_tokens:
            raise ValueError(
                f"seq_len {longest} exceeds dataloader.block_tokens {config.block_tokens}: "
                "a window never crosses a shuffle block; raise block_tokens to at least the longest seq_len"
            )
        if config.shuffle_blocks < 1:
            raise ValueError(f"dataloader.shuffle_blocks {config.shuffle_blocks} must be >= 1")
        self.datasets = [
            DatasetStream(
                entry.path,
                i,
                config.seed,
                max_seq_len=longest,
                one_pass=not config.infinite,
                block_tokens=config.block_tokens,
                shuffle_blocks=config.shuffle_blocks,
            )
            for i, entry in enumerate(mix)
        ]
        hashes = {d.manifest.tokenizer_sha256 for d in self.datasets}
        if len(hashes) > 1:
            raise ValueError(
                f"dataloader.mix mixes datasets prepared with different tokenizers "
                f"({[e.path for e in mix]}); re-prepare them with one tokenizer"
            )
        tokenizer_path = getattr(tokenizer, "tokenizer_path", None)
        if tokenizer_path is not None:
            for d in self.datasets:
                d.manifest.check_tokenizer(Path(tokenizer_path) / "tokenizer.json")
        self.order = GlobalOrder(
            list(self.datasets),  # format 3 until a state of an older format is loaded
            [e.weight for e in mix],
            schedule,
            seq_len=seq_len,
            dp_world_size=dp_world_size,
            dp_rank=dp_rank,
            local_batch_size=local_batch_size,
        )
        self.mix, self.schedule = mix, schedule
        mix_phases = [p for p in schedule if p.weights is not None]
        self.fingerprint_parts = [
            {"path": e.path, "content_sha256": d.manifest.content_sha256, "weight": e.weight}
            for e, d in zip(mix, self.datasets, strict=True)
        ]
        identity: dict[str, Any] = {"datasets": self.fingerprint_parts, "seed": config.seed}
        # seq_len phases are not part of the identity: a seq_len change is exact (format 3)
        self.schedule_parts = [[p.start_sequence, list(p.weights)] for p in mix_phases]
        if mix_phases:  # absent when empty: fingerprints of runs without a schedule are unchanged
            identity["schedule"] = self.schedule_parts
        self.block_parts = [config.block_tokens, config.shuffle_blocks]
        if self.block_parts != [1 << 17, 1024]:  # absent at the defaults: format-2 states load
            identity["blocks"] = self.block_parts
        self.fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        zeros = (0,) * len(self.datasets)
        fresh = tuple(d.start_position() for d in self.datasets)
        self._committed = Cursor(0, zeros, 0, zeros, fresh)
        self.state_format_version = STATE_FORMAT_VERSION
        self.last_origins: list[tuple[int, int, int]] = []
        """(dataset, epoch, on-disk start) of each row of the last batch returned (format 3)."""
        self.last_sequences: list[int] = []
        """The global sequence index of each row of the last batch returned."""
        self.ledger_tap = StepTap()
        """The digest of the rows returned since the trainer's last optimizer step, and the
        position before them (`dataloader.ledger_record`; train/ledger/recorder.py takes it each step)."""
        self.quarantine_entries = 0
        """How many quarantine entries `add_quarantine` was handed (the ledger records it)."""
        self._prefetcher: _Prefetcher | None = None
        self._reader_pool: ThreadPoolExecutor | None = None
        self.add_skip_ranges(config.skip_sequences)
        self.data_wait_seconds = 0.0
        self._exhausted = False

    @staticmethod
    def _check_schedule(schedule: list[SchedulePhase], num_datasets: int) -> None:
        previous = 0
        for i, phase in enumerate(schedule):
            where = f"dataloader.schedule[{i}]"
            if phase.weights is None and not phase.seq_len:
                raise ValueError(f"{where}: give weights, a seq_len, or both")
            if phase.seq_len is not None and not phase.seq_len > 0:
                raise ValueError(f"{where}: seq_len {phase.seq_len} must be positive")
            if phase.weights is not None and len(phase.weights) != num_datasets:
                raise ValueError(
                    f"{where}: {len(phase.weights)} weights for {num_datasets} [[dataloader.mix]] "
                    "entries; give one weight per mix entry, in mix order"
                )
            weights = phase.weights if phase.weights is not None else [1.0]
            if any(not w >= 0 for w in weights) or not sum(weights) > 0:
                raise ValueError(
                    f"{where}: weights {phase.weights} must be >= 0 with a positive sum"
                )
            if not phase.start_sequence > previous:
                raise ValueError(
                    f"{where}: starts at sequence {phase.start_sequence}; phases must start after 0 "
                    "and after the previous phase, in increasing order"
                )
            previous = phase.start_sequence

    # ---- skip ranges ----------------------------------------------------------------------
    def add_skip_ranges(self, ranges) -> None:
        """Also skip these [start, end) ranges of global sequences (merged with the ones
        there). Batches prefetched under the old ranges are discarded."""
        merged = self.order.merged_skip_ranges(ranges)
        self.close()
        self.order.skip_ranges = merged

    # ---- quarantine ------------------------------------------------------------------------
    def add_quarantine(self, entries) -> int:
        """Pass over every window overlapping one of these documents from now on, in every
        epoch: `entries` are (content_sha256 of the dataset, first token, end token), the
        document's on-disk token range [first, end). Keyed by content, not path: a range
        means nothing on other data, and a moved dataset keeps its quarantine. Batches
        prefetched before are discarded. Returns how many entries name a dataset of this
        mix (the others belong to data this run no longer trains)."""
        entries = list(entries)
        self.close()
        contents = [part["content_sha256"] for part in self.fingerprint_parts]
        matched = quarantine_streams(self.datasets, contents, entries)
        self.quarantine_entries += len(entries)
        if matched and self.state_format_version < 3:
            self._warn_legacy_quarantine()
        return matched

    def _warn_legacy_quarantine(self) -> None:
        logger.warning(
            f"[TokenShardDataLoader] quarantined documents are not passed over: this run "
            f"resumed a format-{self.state_format_version} dataloader state, whose order "
            "keeps no shuffle groups (only runs started with format 3 apply a quarantine)"
        )

    @property
    def quarantined_windows(self) -> int:
        """Windows passed over so far because they overlap a quarantined document."""
        positions = self._committed.positions
        return sum(p.quarantined for p in positions if isinstance(p, BlockPosition))

    @property
    def skip_ranges(self) -> tuple[tuple[int, int], ...]:
        """The merged [start, end) ranges of global sequences never yielded."""
        return self.order.skip_ranges

    @property
    def skipped_sequences(self) -> int:
        """Global sequences below the cursor that lie in a skip range (never yielded)."""
        return self.order.skipped_sequences(self._committed.num_sequences)

    # ---- counters (compat names) ---------------------------------------------------------
    @property
    def cursor(self) -> Cursor:
        """The position after the last batch returned (what `state_dict` saves)."""
        return self._committed

    @property
    def num_sequences_consumed(self) -> int:
        return self._committed.num_sequences

    # ---- replica groups (train/replica_groups) --------------------------------------------
    def deal(self, dp_world_size: int, dp_rank: int, cursor: Cursor | None = None) -> None:
        """Deal the next rounds to `dp_world_size` ranks as rank `dp_rank`, from `cursor`
        when given (else from where the loader is). Replica groups call it each step: the
        step's quorum decides how many slices of the global order it trains and which one
        is this rank's, and a step that did not commit is served again from its start. A
        rank at or past `dp_world_size` takes no rows of the round. Prefetched batches are
        discarded when anything changes."""
        same = (dp_world_size, dp_rank) == (self.dp_world_size, self.dp_rank)
        if same and (cursor is None or cursor == self._committed):
            return
        self.close()
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.order.dp_world_size, self.order.dp_rank = dp_world_size, dp_rank
        if cursor is not None:
            self._committed = cursor
            self._exhausted = False
            self.ledger_tap.reset()  # rows returned before belong to no step after it

    def pass_round(self) -> None:
        """Move past the next round without taking a row of it (a replica group with no
        slice in a step's last, partial round); the other ranks train it."""
        self.close()
        planned = self.order.plan_round(self._committed)
        if planned is None:
            self._exhausted = True
            return
        self._committed = planned[1]

    # ---- iteration ------------------------------------------------------------------
    def _produce(self, cursor: Cursor) -> tuple[tuple, Cursor, Plan] | None:
        """The batch of this rank at `cursor`, the cursor after it and its plan (pure in
        `cursor`)."""
        planned = self.order.plan_round(cursor)
        if planned is None:
            return None
        plan, after, seq_len = planned
        batch_size = self.local_batch_size
        tokens = np.empty((batch_size, seq_len + 1), dtype=self.datasets[0].dtype)
        positions = np.empty((batch_size, seq_len), dtype=np.int64)

        orders = self.order.datasets

        def read(row: int) -> None:
            d, key, _, _ = plan[row]
            orders[d].read_sequence(key, tokens[row], positions[row])

        parallel = all(order.parallel_reads for order in orders)  # format 1: one reader
        if self.config.read_threads > 1 and batch_size > 1 and parallel:
            if self._reader_pool is None:
                self._reader_pool = ThreadPoolExecutor(
                    self.config.read_threads, thread_name_prefix="TokenShardRead"
                )
            # Page faults release the GIL: cold rows are read concurrently (disk queue depth).
            list(self._reader_pool.map(read, range(batch_size)))
        else:
            for row in range(batch_size):
                read(row)
        for dataset in self.datasets:
            dataset.release_evicted()
        window = torch.from_numpy(tokens).long()
        batch = (
            {"input": window[:, :-1].contiguous(), "positions": torch.from_numpy(positions)},
            window[:, 1:].contiguous(),
        )
        return batch, after, plan

    def __iter__(self):
        return self

    def __next__(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        started = time.perf_counter()
        try:
            if self._exhausted:
                raise StopIteration
            if self.config.prefetch == 0:
                produced = self._produce(self._committed)
            else:
                if self._prefetcher is None:
                    self._prefetcher = _Prefetcher(
                        self._produce, self._committed, self.config.prefetch
                    )
                try:
                    produced = self._prefetcher.get()
                except BaseException:
                    self.close()  # the next call restarts from the committed state
                    raise
            if produced is None:
                self._exhausted = True
                raise StopIteration
            batch, after, plan = produced
            self.ledger_tap.add(plan, batch[1].shape[-1], self._committed)
            # The state is the counters after the last batch returned (never prefetch-skewed).
            self._committed = after
            self.last_origins = [(d, epoch, key) for d, key, epoch, _ in plan]
            self.last_sequences = [n for _, _, _, n in plan]
            return batch
        finally:
            self.data_wait_seconds += time.perf_counter() - started

    def close(self) -> None:
        """Stop the prefetch thread (prefetched batches are discarded, not consumed)."""
        if getattr(self, "_prefetcher", None) is not None:
            self._prefetcher.stop()
            self._prefetcher = None
        if getattr(self, "_reader_pool", None) is not None:
            self._reader_pool.shutdown(wait=True)
            self._reader_pool = None

    def __del__(self):
        self.close()

    # ---- checkpoint -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        c = self._committed
        datasets = [
            {**part, "sequences_consumed": n, "mix_origin": o}
            for part, n, o in zip(
                self.fingerprint_parts, c.per_dataset, c.mix_origin_per_dataset, strict=True
            )
        ]
        for entry, order, position in zip(datasets, self.order.datasets, c.positions, strict=True):
            entry.update(order.position_state(position))  # format 3: block_position, skipped
        saved: dict[str, Any] = {
            "datasets": datasets,
            "mix_origin": c.mix_origin,
            "seed": self.config.seed,
            "format_version": self.state_format_version,
        }
        if self.state_format_version >= 3:
            saved["blocks"] = self.block_parts
            saved["skipped_tokens"] = self.skipped_tokens
        if self.schedule_parts:
            saved["schedule"] = self.schedule_parts
        blocked = self.state_format_version >= 3
        return {
            "num_sequences_consumed": c.num_sequences,
            # format 3: informational (the length of the next sequence); 1-2: the order's length
            "seq_len": self.order.seq_len_at(c.num_sequences) if blocked else self.seq_len,
            "fingerprint": self.fingerprint,
            "state_json": json.dumps(saved, sort_keys=True),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.close()  # batches prefetched from the old position are discarded
        self._exhausted = False
        self.ledger_tap.reset()  # rows returned before a load belong to no step after it
        if not state_dict:
            return  # fresh start
        saved = json.loads(state_dict["state_json"])
        version = int(saved.get("format_version", 1))
        saved_seq_len = int(state_dict["seq_len"])
        if version < 3 and saved_seq_len != self.seq_len:
            raise ValueError(
                f"dataloader checkpoint was saved with seq_len {saved_seq_len}, this run uses "
                f"{self.seq_len}, and its state is format {version} (written before seq_len could "
                "change): its sequence k covers tokens [k*seq_len, ...), so resuming would repeat or "
                f"skip data. Resume with training.seq_len = {saved_seq_len}, or start the data stream "
                "afresh by not loading the dataloader state (checkpoint.exclude_from_loading = ['dataloader'])"
            )
        self._set_state_format(version)
        n = int(state_dict["num_sequences_consumed"])
        orders = self.order.datasets
        if state_dict["fingerprint"] == self.fingerprint:  # the same datasets, in mix order
            self._committed = Cursor(
                n,
                tuple(int(d["sequences_consumed"]) for d in saved["datasets"]),
                int(saved["mix_origin"]),
                tuple(int(d["mix_origin"]) for d in saved["datasets"]),
                tuple(
                    o.position_from_state(d) for o, d in zip(orders, saved["datasets"], strict=True)
                ),
            )
            logger.info(
                f"[TokenShardDataLoader] rank {self.dp_rank}/{self.dp_world_size} resumed at global sequence "
                f"{n} (per dataset {list(self._committed.per_dataset)})"
            )
            return
        changes = self._describe_change(saved)
        if version >= 3 and saved.get("blocks", self.block_parts) != self.block_parts:
            raise ValueError(
                f"dataloader.block_tokens, shuffle_blocks changed {saved['blocks']} -> "
                f"{self.block_parts}: the checkpoint's positions index the old block layout, so "
                "even allow_dataset_change cannot keep them. Restore the old values, or start the "
                "data stream afresh (checkpoint.exclude_from_loading = ['dataloader'])"
            )
        if not self.config.allow_dataset_change:
            raise ValueError(
                "dataloader checkpoint was written for different data: "
                + "; ".join(changes)
                + ". Resuming would not continue the same sample stream. Restore the original mix/seed/schedule, "
                "or set dataloader.allow_dataset_change = true to continue with the new data "
                "(unchanged datasets keep their position, new ones start at 0)"
            )
        by_content = {d["content_sha256"]: d for d in saved["datasets"]}
        kept = [by_content.get(p["content_sha256"]) for p in self.fingerprint_parts]
        per_dataset = tuple(0 if d is None else int(d["sequences_consumed"]) for d in kept)
        positions = tuple(
            o.start_position() if d is None else o.position_from_state(d)
            for o, d in zip(orders, kept, strict=True)
        )
        self._committed = Cursor(n, per_dataset, n, per_dataset, positions)
        logger.warning(
            "[TokenShardDataLoader] DATASET CHANGE ACCEPTED (allow_dataset_change=true): "
            + "; ".join(changes)
            + f". Continuing at global sequence {n}; per-dataset positions {list(per_dataset)}; "
            "the new weights apply from here on"
        )

    def _set_state_format(self, version: int) -> None:
        """Deal the datasets in the order of state format `version`: one `DatasetOrder` each
        (format 3: the streams themselves; 1-2: `dataloader.legacy_order`'s, over them). A
        new format adds its class here (see `DatasetOrder`); the global order is unchanged."""
        if version not in (1, 2, STATE_FORMAT_VERSION):
            raise ValueError(
                f"dataloader checkpoint state has format_version {version}; this code reads formats "
                f"1 to {STATE_FORMAT_VERSION}. It was written by a newer version of dataloader/loader.py: "
                "resume with that version, or start the data stream afresh "
                "(checkpoint.exclude_from_loading = ['dataloader'])"
            )
        if version == self.state_format_version:
            return  # keep the orders and their caches
        if version == 1:
            # Documented migration: a run started by the format-1 loader keeps its order.
            logger.warning(
                "[TokenShardDataLoader] resuming a format-1 dataloader state (written before "
                "sequence-level shuffling): this run keeps the format-1 document-shuffle order so "
                "no sample is repeated or skipped; it costs O(documents) memory per rank. Runs "
                "started afresh use format 3"
            )
            orders = [DocumentShuffleOrder(d, self.seq_len) for d in self.datasets]
        elif version == 2:
            logger.warning(
                "[TokenShardDataLoader] resuming a format-2 dataloader state (written before "
                "seq_len could change): this run keeps the format-2 order, at a fixed seq_len "
                f"{self.seq_len}. Runs started afresh use format 3"
            )
            orders = [WindowShuffleOrder(d, self.seq_len) for d in self.datasets]
        else:
            orders = list(self.datasets)
        self.order.datasets = orders
        self.state_format_version = version
        if version < 3 and any(d.quarantine for d in self.datasets):
            self._warn_legacy_quarantine()

    @property
    def skipped_tokens(self) -> int:
        """Input tokens dropped so far, over all datasets (format 3; see `BlockPosition`)."""
        return self.order.skipped_tokens(self._committed)

    def metrics(self) -> dict[str, float]:
        """What the trainer logs to metrics.jsonl (`data/skipped_tokens`,
        `data/skipped_sequences`, and `data/quarantined_windows` once a document is
        quarantined)."""
        metrics = {
            "data/skipped_tokens": float(self.skipped_tokens),
            "data/skipped_sequences": float(self.skipped_sequences),
        }
        if any(d.quarantine for d in self.datasets):
            metrics["data/quarantined_windows"] = float(self.quarantined_windows)
        return metrics

    def _describe_change(self, saved: dict) -> list[str]:
        changes = []
        if saved.get("seed") != self.config.seed:
            changes.append(f"seed {saved.get('seed')} -> {self.config.seed}")
        old = {d["content_sha256"]: d for d in saved["datasets"]}
        new = {p["content_sha256"]: p for p in self.fingerprint_parts}
        for h, d in old.items():
            if h not in new:
                changes.append(f"dataset {d['path']} (content {h[:12]}) removed or changed")
        for h, p in new.items():
            if h not in old:
                changes.append(f"dataset {p['path']} (content {h[:12]}) is new")
            elif old[h]["weight"] != p["weight"]:
                changes.append(f"weight of {p['path']} {old[h]['weight']} -> {p['weight']}")
        if [d["content_sha256"] for d in saved["datasets"]] != list(new) and not changes:
            changes.append("mix order changed")
        if saved.get("blocks", self.block_parts) != self.block_parts:
            changes.append(f"block_tokens, shuffle_blocks {saved['blocks']} -> {self.block_parts}")
        if saved.get("schedule", []) != self.schedule_parts:
            changes.append(f"schedule {saved.get('schedule', [])} -> {self.schedule_parts}")
        return changes or ["fingerprint differs"]


_LIVE_PREFETCHERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_live_prefetchers() -> None:
    # A daemon thread still inside a torch op when the interpreter finalizes aborts the
    # process ("terminate called without an active exception", exit -6) after all its work
    # is done; stop and join every prefetch thread first.
    for prefetcher in list(_LIVE_PREFETCHERS):
        prefetcher.stop()


class _Prefetcher:
    """A thread that produces batches ahead into a bounded queue.

    It walks its own copy of the cursor; the loader commits a batch's cursor only when
    it returns the batch, so the checkpoint state never includes prefetched batches.
    """

    def __init__(self, produce, cursor: Cursor, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(produce, cursor), name="TokenShardPrefetch", daemon=True
        )
        self._thread.start()
        _LIVE_PREFETCHERS.add(self)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, produce, cursor: Cursor) -> None:
        try:
            while not self._stop.is_set():
                produced = produce(cursor)
                if not self._put(produced) or produced is None:
                    return
                cursor = produced[1]
        except BaseException as err:  # re-raised in the consumer's next()
            self._put(err)

    def get(self):
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        self._stop.set()
        # the loader can be garbage-collected on this very thread: it then just ends
        if self._thread is not threading.current_thread():
            self._thread.join()
