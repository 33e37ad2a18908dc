"""`TokenShardDataLoader`: the torchtitan dataloader over prepared token shards.

Why this design: the loader must never repeat or skip a sample across crashes,
preemptions and a change of data-parallel size. So the order of all sequences is
a pure function of (seed, manifests, mix, seq_len), and the whole checkpoint state
is a few global counters, identical on every rank:

* Per dataset, documents are shuffled once per epoch with
  `np.random.default_rng([seed, dataset_index, epoch]).permutation(num_docs)`; the
  dataset's token *stream* is the concatenation of its epochs. Sequence k of a
  dataset is stream tokens [k*L, k*L + L + 1) (inputs and shifted labels; windows
  overlap by one token), so seeking to any k is O(1): epoch = k*L // T.
* Datasets are interleaved by weight with deterministic error feedback: global
  sequence n goes to `argmax_d(w_d * (n+1) - c_d)` (ties -> lower index), where
  c_d counts the sequences dataset d has had. No random draws, no drift.
* Global sequences are dealt round by round: in a round of W*B sequences starting
  at cursor n, rank r takes [n + r*B, n + (r+1)*B) and every rank advances n by
  W*B. Resuming on any other (W, B) just continues from n: each sequence is used
  exactly once, with no divisibility rule.

Positions restart at 0 at every document start, and also at the start of every
window (a window that starts mid-document), so no position ever reaches seq_len.

Checkpoint state (see `state_dict`): `num_sequences_consumed`, `seq_len`,
`fingerprint` (hash of the manifests' contents, mix weights and seed) and a JSON
string with the per-dataset counters. A different seq_len is refused. A different
fingerprint is refused unless `allow_dataset_change=True`; then every dataset
whose content is unchanged keeps its position, new ones start at 0, and the new
weights apply from the resume point on (the mixer restarts its error feedback).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.tools.logging import logger

from dataloader.manifest import Manifest

MAX_OPEN_SHARDS = 256  # memmaps hold a file descriptor each
EPOCHS_CACHED = 2  # a window can straddle two epochs


@dataclass(slots=True)
class MixEntry:
    path: str
    weight: float = 1.0


class _ShardedDataset:
    """One prepared split: its shuffled, epoch-concatenated token stream."""

    def __init__(self, path: str, dataset_index: int, seed: int, seq_len: int, infinite: bool):
        self.manifest = Manifest.load(path, check_files=False)
        self.dataset_index, self.seed, self.seq_len = dataset_index, seed, seq_len
        self.doc_starts = self.manifest.load_document_starts()
        self.doc_lengths = np.diff(self.doc_starts)
        self.num_tokens = int(self.doc_starts[-1])  # T: tokens per epoch
        shard_tokens = np.array([s.num_tokens for s in self.manifest.shards], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(shard_tokens)])
        if self.shard_starts[-1] != self.num_tokens:
            raise ValueError(
                f"{self.manifest.root}: shard sizes do not add up to the document index; re-run dataloader.prepare"
            )
        self.dtype = np.dtype(self.manifest.dtype)
        self._shards: OrderedDict[int, np.memmap] = OrderedDict()
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        # Sequences available before stopping (None: repeat forever).
        stop = self.manifest.on_exhausted == "stop" or not infinite
        self.max_sequences = (self.num_tokens - 1) // seq_len if stop else None

    def _shard(self, index: int) -> np.memmap:
        mm = self._shards.get(index)
        if mm is None:
            self.manifest.check_shard(index)  # size check on first touch
            mm = np.memmap(
                self.manifest.root / self.manifest.shards[index].file, dtype=self.dtype, mode="r"
            )
            self._shards[index] = mm
            if len(self._shards) > MAX_OPEN_SHARDS:
                self._shards.popitem(last=False)
        else:
            self._shards.move_to_end(index)
        return mm

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, cumulative token offsets in that order) of one epoch."""
        cached = self._epochs.get(epoch)
        if cached is None:
            order = np.random.default_rng([self.seed, self.dataset_index, epoch]).permutation(
                self.manifest.num_documents
            )
            cum = np.zeros(order.size + 1, dtype=np.int64)
            np.cumsum(self.doc_lengths[order], out=cum[1:])
            cached = self._epochs[epoch] = (order, cum)
            if len(self._epochs) > EPOCHS_CACHED:
                self._epochs.popitem(last=False)
        return cached

    def read_window(
        self, k: int, tokens: np.ndarray, positions: np.ndarray, arange: np.ndarray
    ) -> None:
        """Fill tokens[: L+1] with stream tokens [k*L, k*L+L+1) and positions[: L]."""
        need = tokens.shape[0]
        filled = 0
        stream = k * self.seq_len
        while filled < need:
            epoch, offset = divmod(stream + filled, self.num_tokens)
            order, cum = self._epoch(epoch)
            end = min(offset + need - filled, self.num_tokens)
            first = int(np.searchsorted(cum, offset, side="right")) - 1
            last = int(np.searchsorted(cum, end, side="left"))  # exclusive
            for m in range(first, last):
                lo = max(int(cum[m]), offset)
                hi = min(int(cum[m + 1]), end)
                length = hi - lo
                start = int(self.doc_starts[order[m]]) + lo - int(cum[m])
                shard = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
                local = start - int(self.shard_starts[shard])
                tokens[filled : filled + length] = self._shard(shard)[local : local + length]
                # Positions restart at each piece: a document start or the window start.
                p_hi = min(filled + length, positions.shape[0])
                if p_hi > filled:
                    positions[filled:p_hi] = arange[: p_hi - filled]
                filled += length


class TokenShardDataLoader(BaseDataLoader):
    """Deterministic, resumable, reshardable loader over `dataloader.prepare` output."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        mix: list[MixEntry] = field(default_factory=list)
        """Prepared datasets (DATA/train, ...) and their sampling weights."""
        seed: int = 0
        """Shuffling seed (part of the checkpoint fingerprint)."""
        infinite: bool = True
        """False: one deterministic pass over every dataset, then stop (validation)."""
        allow_dataset_change: bool = False
        """Resume onto a different mix/dataset/seed instead of refusing it."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int = 1,
        dp_rank: int = 0,
        tokenizer: Any = None,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = None,  # state is a few scalars: always current
        **kwargs: Any,
    ):
        if not config.mix:
            raise ValueError('dataloader.mix is empty; add [[dataloader.mix]] path = "DATA/train"')
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} outside dp_world_size {dp_world_size}")
        self.config = config
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        mix = [MixEntry(**m) if isinstance(m, dict) else m for m in config.mix]
        for entry in mix:
            if not entry.weight > 0:
                raise ValueError(f"dataloader.mix {entry.path}: weight {entry.weight} must be > 0")
        self.datasets = [
            _ShardedDataset(entry.path, i, config.seed, seq_len, config.infinite)
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
        total = sum(e.weight for e in mix)
        self.weights = [e.weight / total for e in mix]
        self.mix = mix
        self.fingerprint_parts = [
            {"path": e.path, "content_sha256": d.manifest.content_sha256, "weight": e.weight}
            for e, d in zip(mix, self.datasets, strict=True)
        ]
        self.fingerprint = hashlib.sha256(
            json.dumps(
                {"datasets": self.fingerprint_parts, "seed": config.seed}, sort_keys=True
            ).encode()
        ).hexdigest()
        # Global counters (identical on every rank).
        self.num_sequences_consumed = 0
        self.sequences_per_dataset = [0] * len(self.datasets)
        # Where the current mix started (moved by an allowed dataset change).
        self.mix_origin = 0
        self.mix_origin_per_dataset = [0] * len(self.datasets)
        self.data_wait_seconds = 0.0
        self.num_batches_yielded = 0
        self._exhausted = False
        self._arange = np.arange(seq_len + 1, dtype=np.int64)
        for d in self.datasets:
            if d.max_sequences is not None:
                tail = (
                    d.num_tokens - d.max_sequences * seq_len - 1
                    if d.max_sequences
                    else d.num_tokens
                )
                logger.info(
                    f"[TokenShardDataLoader] {d.manifest.root}: one pass = {d.max_sequences} sequences "
                    f"of {seq_len}; {tail} tail tokens are never used as inputs"
                )

    # ---- schedule -----------------------------------------------------------------
    def _plan_round(self) -> list[tuple[int, int]] | None:
        """(dataset, sequence index) for every global sequence of the next round;
        None when a stopping dataset runs out inside it (the round is dropped)."""
        size = self.dp_world_size * self.local_batch_size
        counts = list(self.sequences_per_dataset)
        plan = []
        n = self.num_sequences_consumed - self.mix_origin
        if len(self.datasets) == 1:
            k0 = counts[0]
            limit = self.datasets[0].max_sequences
            if limit is not None and k0 + size > limit:
                self._log_drop(max(0, limit - k0), size)
                return None
            return [(0, k0 + i) for i in range(size)]
        for i in range(size):
            scores = [
                w * (n + i + 1) - (c - o)
                for w, c, o in zip(self.weights, counts, self.mix_origin_per_dataset, strict=True)
            ]
            d = scores.index(max(scores))
            limit = self.datasets[d].max_sequences
            if limit is not None and counts[d] >= limit:
                self._log_drop(i, size)
                return None
            plan.append((d, counts[d]))
            counts[d] += 1
        return plan

    def _log_drop(self, num_available: int, size: int) -> None:
        logger.info(
            f"[TokenShardDataLoader] data exhausted after {self.num_batches_yielded} batches on rank "
            f"{self.dp_rank}: dropped the final incomplete round ({num_available} of {size} sequences "
            "available) so every rank yields the same number of batches"
        )

    # ---- iteration ------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        started = time.perf_counter()
        try:
            if self._exhausted:
                raise StopIteration
            plan = self._plan_round()
            if plan is None:
                self._exhausted = True
                raise StopIteration
            batch_size, seq_len = self.local_batch_size, self.seq_len
            mine = plan[self.dp_rank * batch_size : (self.dp_rank + 1) * batch_size]
            tokens = np.empty((batch_size, seq_len + 1), dtype=self.datasets[0].dtype)
            positions = np.empty((batch_size, seq_len), dtype=np.int64)
            for row, (d, k) in enumerate(mine):
                self.datasets[d].read_window(k, tokens[row], positions[row], self._arange)
            window = torch.from_numpy(tokens).long()
            batch = (
                {"input": window[:, :-1].contiguous(), "positions": torch.from_numpy(positions)},
                window[:, 1:].contiguous(),
            )
            # Commit the whole round only once the batch exists (state == batches yielded).
            for d, _ in plan:
                self.sequences_per_dataset[d] += 1
            self.num_sequences_consumed += len(plan)
            self.num_batches_yielded += 1
            return batch
        finally:
            self.data_wait_seconds += time.perf_counter() - started

    # ---- checkpoint -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        datasets = [
            {**part, "sequences_consumed": c, "mix_origin": o}
            for part, c, o in zip(
                self.fingerprint_parts,
                self.sequences_per_dataset,
                self.mix_origin_per_dataset,
                strict=True,
            )
        ]
        return {
            "num_sequences_consumed": self.num_sequences_consumed,
            "seq_len": self.seq_len,
            "fingerprint": self.fingerprint,
            "state_json": json.dumps(
                {"datasets": datasets, "mix_origin": self.mix_origin, "seed": self.config.seed},
                sort_keys=True,
            ),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return  # fresh start
        saved_seq_len = int(state_dict["seq_len"])
        if saved_seq_len != self.seq_len:
            raise ValueError(
                f"dataloader checkpoint was saved with seq_len {saved_seq_len}, this run uses "
                f"{self.seq_len}: sequence k covers tokens [k*seq_len, ...), so resuming would repeat or "
                f"skip data. Resume with training.seq_len = {saved_seq_len}, or start the data stream "
                "afresh by not loading the dataloader state (checkpoint.exclude_from_loading = ['dataloader'])"
            )
        saved = json.loads(state_dict["state_json"])
        n = int(state_dict["num_sequences_consumed"])
        if state_dict["fingerprint"] == self.fingerprint:
            self.num_sequences_consumed = n
            self.sequences_per_dataset = [int(d["sequences_consumed"]) for d in saved["datasets"]]
            self.mix_origin = int(saved["mix_origin"])
            self.mix_origin_per_dataset = [int(d["mix_origin"]) for d in saved["datasets"]]
            logger.info(
                f"[TokenShardDataLoader] rank {self.dp_rank}/{self.dp_world_size} resumed at global sequence "
                f"{n} (per dataset {self.sequences_per_dataset})"
            )
            return
        changes = self._describe_change(saved)
        if not self.config.allow_dataset_change:
            raise ValueError(
                "dataloader checkpoint was written for different data: " + "; ".join(changes)
                + ". Resuming would not continue the same sample stream. Restore the original mix/seed, "
                "or set dataloader.allow_dataset_change = true to continue with the new data "
                "(unchanged datasets keep their position, new ones start at 0)"
            )  # fmt: skip
        by_content = {d["content_sha256"]: int(d["sequences_consumed"]) for d in saved["datasets"]}
        self.num_sequences_consumed = n
        self.sequences_per_dataset = [
            by_content.get(p["content_sha256"], 0) for p in self.fingerprint_parts
        ]
        self.mix_origin = n
        self.mix_origin_per_dataset = list(self.sequences_per_dataset)
        logger.warning(
            "[TokenShardDataLoader] DATASET CHANGE ACCEPTED (allow_dataset_change=true): "
            + "; ".join(changes)
            + f". Continuing at global sequence {n}; per-dataset positions {self.sequences_per_dataset}; "
            "the new weights apply from here on"
        )

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
        return changes or ["fingerprint differs"]
