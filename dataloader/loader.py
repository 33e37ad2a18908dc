"""`TokenShardDataLoader`: the torchtitan dataloader over prepared token shards.

Why this design: the loader must never repeat or skip a sample across crashes,
preemptions and a change of data-parallel size, and its cost must not grow with the
corpus (1e12 tokens, 1e9 documents). So the order of all sequences is a pure function
of (seed, manifests, mix schedule, seq_len schedule), computed per sequence in O(1) memory, and
the whole checkpoint state is a few global counters, identical on every rank:

* A dataset's T tokens, in on-disk order, are cut into blocks of C = `block_tokens`
  tokens (input positions [0, T-1): the last token is only a label). Each epoch, a keyed
  Feistel bijection (`dataloader.shuffle`) orders the blocks; consecutive runs of G =
  `shuffle_blocks` blocks in that order form *groups*. A group is cut into windows of the
  seq_len L in force when it is first drawn from (window = L consecutive input tokens of
  one block and the next token as the last label; a block's tail < L is skipped), and
  its windows are taken in another keyed Feistel order. Nothing of size T is ever
  materialised: the document index and shards are read with pread.
* seq_len may change (a resume with another training.seq_len, or a `schedule` phase
  with `seq_len`): a group already cut at another length is closed, dropping its
  untaken windows (< G*C tokens per dataset and change), so no token is ever in two
  windows; every dropped token is counted (`skipped_tokens`, logged to metrics.jsonl).
* Datasets are interleaved by weight with deterministic error feedback: global
  sequence n goes to `argmax_d(w_d * (n - o + 1) - (c_d - c_d(o)))` (ties -> lower
  index), where c_d counts the sequences dataset d has had and o is where the current
  weights took effect (the start, a `schedule` phase, or an allowed dataset change).
* Global sequences are dealt round by round: in a round of W*B sequences starting
  at cursor n, rank r takes [n + r*B, n + (r+1)*B) and every rank advances n by
  W*B. Resuming on any other (W, B) just continues from n: each sequence is used
  exactly once, with no divisibility rule. A batch has one length, so a seq_len phase
  must start on a round boundary (a training step boundary always is).
* Skip ranges (`skip_sequences`, `add_skip_ranges`): global sequences in [start, end)
  are drawn as if trained (every counter advances) and given to no rank; a round takes
  the next W*B sequences outside them. So a loss-spike rollback (train/health.py), a
  resume after it, and a run told the same ranges from the start all see one stream.
  Skipped sequences are counted (`skipped_sequences`, logged to metrics.jsonl).
* A background thread prepares the next `prefetch` batches from a *copy* of the
  counters; the state (`state_dict`) is the counters after the last batch returned,
  so what was prefetched but not returned is not consumed.

Positions restart at 0 at every document start, and also at the start of every
window (a window that starts mid-document), so no position ever reaches seq_len.

Checkpoint state (see `state_dict`): `num_sequences_consumed`, `seq_len`,
`fingerprint` (hash of the manifests' contents, mix weights, mix schedule, seed and
non-default block sizes) and a JSON string with the per-dataset counters (sequences,
block position: epoch, group, cut length, windows taken; skipped tokens) and the state's
`format_version` (3). Older states keep their order for the rest of the run: format 2
(windows of one seq_len shuffled over the epoch, `_ShardedDataset.window_start`) and
format 1 (no version field; `dataloader.legacy_order`); they cannot change seq_len. A
different fingerprint is refused unless `allow_dataset_change=True`; then every
dataset whose content is unchanged keeps its position, new ones start at 0, and the
new weights apply from the resume point on (the mixer restarts its error feedback).
"""

from __future__ import annotations

import atexit
import bisect
import hashlib
import json
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.tools.logging import logger

from dataloader.common import MixEntry
from dataloader.legacy_order import LegacyDocumentShuffle
from dataloader.manifest import Manifest
from dataloader.shuffle import FeistelPermutation

STATE_FORMAT_VERSION = 3
"""Version of the order the state's counters index into (1: `legacy_order`; 2: windows of
one seq_len shuffled over the epoch; 3: windows shuffled within groups of blocks)."""
MAX_OPEN_SHARDS = 256  # open file descriptors per dataset
PERMUTATIONS_CACHED = 2  # a batch can straddle two epochs
GROUPS_CACHED = 4  # a round can straddle groups (and the prefetch thread runs ahead)


@dataclass(slots=True)
class SchedulePhase:
    """From global sequence `start_sequence` on, the mix uses `weights` (one per mix entry)
    and/or sequences are `seq_len` tokens long (None: unchanged from the phase before)."""

    start_sequence: int
    weights: list[float] | None = None
    seq_len: int | None = None


@dataclass(frozen=True, slots=True)
class _BlockPosition:
    """Where one dataset stands in the format-3 order (a few ints, whatever the corpus).

    Epoch `epoch`, group `group` of its blocks, cut into windows of `seq_len` tokens
    (0: not cut yet), `taken` of them consumed; `skipped` counts the input tokens this
    dataset has dropped so far (block tails shorter than a window, and the rest of a
    group cut short by a seq_len change)."""

    epoch: int = 0
    group: int = 0
    seq_len: int = 0
    taken: int = 0
    skipped: int = 0


class _GroupLayout:
    """The windows of one group of blocks at one seq_len, in their keyed order."""

    __slots__ = ("blocks", "cum", "num_windows", "input_tokens", "perm", "seq_len", "block_tokens")

    def __init__(self, blocks, avail, seq_len: int, block_tokens: int, key: tuple[int, ...]):
        self.blocks = blocks  # block ids, in the group's (shuffled) block order
        per_block = avail // seq_len  # windows per block: a tail < seq_len is dropped
        self.cum = np.concatenate([[0], np.cumsum(per_block)])
        self.num_windows = int(self.cum[-1])
        self.input_tokens = int(avail.sum())
        self.perm = FeistelPermutation(self.num_windows, *key) if self.num_windows else None
        self.seq_len, self.block_tokens = seq_len, block_tokens

    def start(self, j: int) -> int:
        """On-disk token offset of the group's j-th window in order."""
        w = self.perm.index(j)
        s = int(np.searchsorted(self.cum, w, side="right")) - 1
        return int(self.blocks[s]) * self.block_tokens + (w - int(self.cum[s])) * self.seq_len


@dataclass(frozen=True, slots=True)
class _Cursor:
    """Global counters: everything the position in the stream depends on."""

    num_sequences: int
    per_dataset: tuple[int, ...]
    mix_origin: int
    mix_origin_per_dataset: tuple[int, ...]
    blocks: tuple[_BlockPosition, ...] = ()  # format 3: each dataset's position


class _ShardedDataset:
    """One prepared split: memory-mapped shards and document index, windows in keyed order."""

    def __init__(
        self,
        path: str,
        dataset_index: int,
        seed: int,
        seq_len: int,
        infinite: bool,
        *,
        max_seq_len: int | None = None,
        block_tokens: int = 1 << 17,
        shuffle_blocks: int = 1024,
    ):
        # Start-up reads the manifest and stats the index: O(shards) JSON, no O(documents) read.
        self.manifest = Manifest.load(path, check_files=False)
        self.dataset_index, self.seed, self.seq_len = dataset_index, seed, seq_len
        max_seq_len = max(seq_len, max_seq_len or 0)
        self.block_tokens, self.shuffle_blocks = block_tokens, shuffle_blocks
        self.manifest.load_document_starts()  # size, shape and total checked
        # Mapped for format 1 only (it needs all of it); format 2 reads entries with pread.
        self.doc_starts = np.load(self.manifest.documents_path, mmap_mode="r")
        self._index_offset = int(self.doc_starts.offset)
        self._index_fd = os.open(self.manifest.documents_path, os.O_RDONLY)
        self.num_tokens = int(self.manifest.num_tokens)  # T: tokens per epoch
        shard_tokens = np.array([s.num_tokens for s in self.manifest.shards], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(shard_tokens)])
        if self.shard_starts[-1] != self.num_tokens:
            raise ValueError(
                f"{self.manifest.root}: shard sizes do not add up to the document index; re-run dataloader.prepare"
            )
        self.windows_per_epoch = (self.num_tokens - 1) // seq_len  # N (format 2)
        if self.num_tokens - 1 < max_seq_len:
            raise ValueError(
                f"{self.manifest.root}: {self.num_tokens} tokens, fewer than seq_len + 1 = {max_seq_len + 1}: "
                "not one full sequence; use a smaller training.seq_len or more data"
            )
        # Format 3: input positions [0, T-1) in blocks of C tokens, G blocks per group.
        self.num_blocks = -(-(self.num_tokens - 1) // block_tokens)
        self.num_groups = -(-self.num_blocks // shuffle_blocks)
        self._groups: OrderedDict[tuple[int, int, int], _GroupLayout] = OrderedDict()
        self.dtype = np.dtype(self.manifest.dtype)
        self.arange = np.arange(max_seq_len + 1, dtype=np.int64)
        self._shards: OrderedDict[int, int] = OrderedDict()  # shard -> fd
        self._evicted: list[int] = []
        self._perms: OrderedDict[int, FeistelPermutation] = OrderedDict()
        self._lock = threading.Lock()  # guards the caches; reads run in parallel
        self.legacy: LegacyDocumentShuffle | None = None
        self.order_format = STATE_FORMAT_VERSION
        # Sequences available before stopping (None: repeat forever).
        stop = self.manifest.on_exhausted == "stop" or not infinite
        self.max_sequences = self.windows_per_epoch if stop else None

    # ---- token access --------------------------------------------------------------
    def _shard(self, index: int) -> int:
        """An open file descriptor of shard `index` (LRU of MAX_OPEN_SHARDS)."""
        with self._lock:  # reader threads share the cache of open files
            fd = self._shards.get(index)
            if fd is None:
                self.manifest.check_shard(index)  # size check on first touch
                fd = os.open(self.manifest.root / self.manifest.shards[index].file, os.O_RDONLY)
                self._shards[index] = fd
                if len(self._shards) > MAX_OPEN_SHARDS:
                    # Closed once no read can be using it (`release_evicted`, between batches).
                    self._evicted.append(self._shards.popitem(last=False)[1])
            else:
                self._shards.move_to_end(index)
            return fd

    def __del__(self):
        fds = list(getattr(self, "_shards", {}).values()) + getattr(self, "_evicted", [])
        for fd in fds + [getattr(self, "_index_fd", None)]:
            if fd is not None:
                os.close(fd)

    def release_evicted(self) -> None:
        with self._lock:
            for fd in self._evicted:
                os.close(fd)
            self._evicted.clear()

    def copy_tokens(self, start: int, out: np.ndarray) -> None:
        """out[:] = on-disk stream tokens [start, start + len(out)) (may cross shards).

        pread, not a memory map: a read touches only its own pages, releases the GIL, and
        leaves nothing mapped, so the RSS does not grow with the tokens read."""
        filled, need, itemsize = 0, out.shape[0], self.dtype.itemsize
        while filled < need:
            pos = start + filled
            shard = int(np.searchsorted(self.shard_starts, pos, side="right")) - 1
            local = pos - int(self.shard_starts[shard])
            length = min(need - filled, int(self.shard_starts[shard + 1]) - pos)
            view = memoryview(out[filled : filled + length]).cast("B")
            got = os.preadv(self._shard(shard), [view], local * itemsize)
            if got != length * itemsize:
                raise ValueError(
                    f"{self.manifest.root / self.manifest.shards[shard].file}: short read at token "
                    f"{local} (file truncated after start-up?); re-run dataloader.prepare"
                )
            filled += length

    # ---- order ----------------------------------------------------------------------
    def _perm(self, epoch: int) -> FeistelPermutation:
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = FeistelPermutation(
                    self.windows_per_epoch, self.seed, self.dataset_index, epoch
                )
                self._perms[epoch] = perm
                if len(self._perms) > PERMUTATIONS_CACHED:
                    self._perms.popitem(last=False)
            return perm

    # ---- format 3: blocks, groups of blocks, windows shuffled within a group -------------
    def group_layout(self, epoch: int, group: int, seq_len: int) -> _GroupLayout:
        """Group `group` of epoch `epoch`: blocks pi_e(gG .. gG+G-1) cut at `seq_len`."""
        key = (epoch, group, seq_len)
        with self._lock:
            layout = self._groups.get(key)
            if layout is not None:
                self._groups.move_to_end(key)
                return layout
        seed, d = self.seed, self.dataset_index
        block_order = FeistelPermutation(self.num_blocks, seed, d, epoch, 3)
        first = group * self.shuffle_blocks
        blocks = np.array(
            [
                block_order.index(i)
                for i in range(first, min(first + self.shuffle_blocks, self.num_blocks))
            ],
            dtype=np.int64,
        )
        # Input positions end at T-2: the last token is only ever a label.
        avail = np.minimum(self.block_tokens, self.num_tokens - 1 - blocks * self.block_tokens)
        layout = _GroupLayout(
            blocks, avail, seq_len, self.block_tokens, (seed, d, epoch, 3, group, seq_len)
        )
        with self._lock:
            self._groups[key] = layout
            if len(self._groups) > GROUPS_CACHED:
                self._groups.popitem(last=False)
        return layout

    def advance(
        self, pos: _BlockPosition, seq_len: int, count: int, starts: list | None = None
    ) -> _BlockPosition:
        """The position after `count` more windows of `seq_len`; their (epoch, start) are
        appended to `starts` when given.

        A group is cut into windows at the seq_len in force when its first window is
        taken. If the seq_len differs when the group is next drawn from, the rest of the
        group is dropped (at most G*C tokens, counted in `skipped`), so a token is never
        in two windows: the windows of one group at one seq_len are disjoint."""
        epoch, group, cut, taken, skipped = (
            pos.epoch,
            pos.group,
            pos.seq_len,
            pos.taken,
            pos.skipped,
        )
        while count > 0:
            if taken == 0:
                cut = seq_len  # nothing taken yet: cut (or re-cut) the group at this length
            layout = self.group_layout(epoch, group, cut)
            if cut == seq_len and taken < layout.num_windows:
                n = min(count, layout.num_windows - taken)
                if starts is not None:
                    starts.extend((epoch, layout.start(j)) for j in range(taken, taken + n))
                taken += n
                count -= n
                continue
            # close the group: what it has not yielded is skipped (tails, or a cut-short rest)
            skipped += layout.input_tokens - taken * cut
            group, taken = group + 1, 0
            if group == self.num_groups:
                epoch, group = epoch + 1, 0
        return _BlockPosition(epoch, group, cut, taken, skipped)

    def window_start(self, k: int) -> int:
        """On-disk token offset of dataset sequence k (format 2): window perm_e(k mod N)."""
        epoch, j = divmod(k, self.windows_per_epoch)
        return self._perm(epoch).index(j) * self.seq_len

    def _index_entries(self, first: int, count: int) -> np.ndarray:
        """documents.npy entries [first, first + count) (clipped), read with pread."""
        count = max(0, min(count, self.manifest.num_documents + 1 - first))
        out = np.empty(count, dtype=np.int64)
        got = os.preadv(self._index_fd, [memoryview(out).cast("B")], self._index_offset + 8 * first)
        if got != 8 * count:
            raise ValueError(
                f"{self.manifest.documents_path}: short read (truncated?); re-run dataloader.prepare"
            )
        return out

    def _last_document_at_or_before(self, pos: int) -> int:
        """max m with starts[m] <= pos: a binary search of ~log2(D) 8-byte preads.

        Not a memory map: mapped index pages touched by the searches count in the RSS and
        accumulate (measured: 770 MB after 2 s at 1e8 documents); preads leave nothing."""
        lo, hi = 0, self.manifest.num_documents  # starts[lo] <= pos < starts[hi + 1]
        while hi - lo > 256:
            mid = (lo + hi) // 2
            if int(self._index_entries(mid, 1)[0]) <= pos:
                lo = mid
            else:
                hi = mid - 1
        block = self._index_entries(lo, hi - lo + 1)
        return lo + int(np.searchsorted(block, pos, side="right")) - 1

    def read_window(self, start: int, tokens: np.ndarray, positions: np.ndarray) -> None:
        """tokens[: L+1] = stream tokens from `start`; positions restart at document starts."""
        self.copy_tokens(start, tokens)
        end = start + tokens.shape[0]
        first = self._last_document_at_or_before(start)
        # Window-relative starts of the pieces: the window start, then each document start.
        cuts, m = [0], first + 1
        while True:
            block = self._index_entries(m, 64)
            inside = block[block < end]
            cuts.extend(int(s) - start for s in inside)
            if inside.size < block.size or block.size == 0:
                break
            m += block.size
        cuts.append(end - start)
        # Cheap corruption check of the index entries used (full check: prepare --verify).
        if not (0 <= first < self.manifest.num_documents) or any(
            b < a for a, b in zip(cuts[:-2], cuts[1:-1], strict=True)
        ):
            raise ValueError(
                f"{self.manifest.documents_path}: not increasing near document {first} (corrupt); "
                "run `python -m dataloader.prepare ... --verify` and re-prepare"
            )
        length, arange = positions.shape[0], self.arange
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            b = min(b, length)
            if b > a:
                positions[a:b] = arange[: b - a]

    def read_sequence(self, key: int, tokens: np.ndarray, positions: np.ndarray) -> None:
        """One row: tokens[: L+1] and positions[: L]. `key` is the dataset sequence k in
        formats 1 and 2, the window's on-disk start in format 3."""
        if self.legacy is not None:
            self.legacy.read_window(key, tokens, positions, self.arange)
        elif self.order_format == 2:
            self.read_window(self.window_start(key), tokens, positions)
        else:
            self.read_window(key, tokens, positions)


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
        rollback's skipped windows, train/health.py; or a reference run that never saw
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
        snapshot_every_n_steps: int | None = None,  # state is a few scalars: always current
        **kwargs: Any,
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
        # seq_len phases: the length of global sequence n (phase 0: the build's seq_len)
        self.seq_len_starts = [0] + [p.start_sequence for p in schedule if p.seq_len]
        self.seq_lens = [seq_len] + [p.seq_len for p in schedule if p.seq_len]
        if max(self.seq_lens) > config.block_tokens:
            raise ValueError(
                f"seq_len {max(self.seq_lens)} exceeds dataloader.block_tokens {config.block_tokens}: "
                "a window never crosses a shuffle block; raise block_tokens to at least the longest seq_len"
            )
        if config.shuffle_blocks < 1:
            raise ValueError(f"dataloader.shuffle_blocks {config.shuffle_blocks} must be >= 1")
        self.datasets = [
            _ShardedDataset(
                entry.path,
                i,
                config.seed,
                seq_len,
                config.infinite,
                max_seq_len=max(self.seq_lens),
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
        total = sum(e.weight for e in mix)
        self.weights = [e.weight / total for e in mix]
        # Phases: (first global sequence, normalised weights); phase 0 is the mix itself.
        mix_phases = [p for p in schedule if p.weights is not None]
        self.phase_starts = [0] + [p.start_sequence for p in mix_phases]
        self.phase_weights = [self.weights] + [
            [w / sum(p.weights) for w in p.weights] for p in mix_phases
        ]
        self.mix = mix
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
        fresh = (_BlockPosition(),) * len(self.datasets)
        self._committed = _Cursor(0, zeros, 0, zeros, fresh)
        self.state_format_version = STATE_FORMAT_VERSION
        self.last_origins: list[tuple[int, int, int]] = []
        """(dataset, epoch, on-disk start) of each row of the last batch returned (format 3)."""
        self.last_sequences: list[int] = []
        """The global sequence index of each row of the last batch returned."""
        self.skip_ranges: tuple[tuple[int, int], ...] = ()
        self.add_skip_ranges(config.skip_sequences)
        self.data_wait_seconds = 0.0
        self.num_batches_yielded = 0
        self._exhausted = False
        self._prefetcher: _Prefetcher | None = None
        self._reader_pool: ThreadPoolExecutor | None = None

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
        merged: list[list[int]] = []
        for entry in sorted([list(r) for r in self.skip_ranges] + [list(r) for r in ranges]):
            if len(entry) != 2 or not 0 <= entry[0] < entry[1]:
                raise ValueError(
                    f"dataloader.skip_sequences: bad range {entry}; write [start, end) of global "
                    "sequences with 0 <= start < end, e.g. [1600, 2400]"
                )
            if merged and entry[0] <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], entry[1])
            else:
                merged.append([int(entry[0]), int(entry[1])])
        self.close()
        self.skip_ranges = tuple((a, b) for a, b in merged)

    @property
    def skipped_sequences(self) -> int:
        """Global sequences below the cursor that lie in a skip range (never yielded)."""
        n = self._committed.num_sequences
        return sum(max(0, min(b, n) - a) for a, b in self.skip_ranges)

    # ---- counters (compat names) ---------------------------------------------------------
    @property
    def num_sequences_consumed(self) -> int:
        return self._committed.num_sequences

    @property
    def sequences_per_dataset(self) -> list[int]:
        return list(self._committed.per_dataset)

    # ---- planning -------------------------------------------------------------------
    def seq_len_at(self, n: int) -> int:
        """The length of global sequence n (the seq_len phase in force there)."""
        return self.seq_lens[bisect.bisect_right(self.seq_len_starts, n) - 1]

    def _round_segments(self, n0: int, size: int) -> list[tuple[int, int, bool]]:
        """The global sequences the round at `n0` consumes, as runs (start, stop, used):
        `size` used sequences, and the skip ranges met on the way (used=False). A round that
        ends where a skip range starts leaves it to the next round."""
        segments, n, need = [], n0, size
        for start, stop in self.skip_ranges:
            if stop <= n:
                continue
            if start > n:
                take = min(need, start - n)
                segments.append((n, n + take, True))
                n, need = n + take, need - take
                if not need:
                    return segments
            segments.append((n, stop, False))
            n = stop
        segments.append((n, n + need, True))
        return segments

    def _length_pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """[start, stop) cut at the seq_len phases: (first sequence, count, seq_len) each."""
        pieces, n = [], start
        while n < stop:
            following = bisect.bisect_right(self.seq_len_starts, n)
            end = stop
            if following < len(self.seq_len_starts):
                end = min(stop, self.seq_len_starts[following])
            pieces.append((n, end - n, self.seq_len_at(n)))
            n = end
        return pieces

    def _plan_round(
        self, cursor: _Cursor
    ) -> tuple[list[tuple[int, int, int, int]], _Cursor, int] | None:
        """This rank's rows in the round at `cursor` as (dataset, key, epoch, global
        sequence) (key: the sequence index in formats 1-2, the window's on-disk start in
        format 3), the cursor after the whole round, and the round's seq_len; None when a
        stopping dataset runs out inside the round (it is dropped on every rank).

        A round is the next W*B global sequences outside the skip ranges; the skipped ones
        are drawn as if trained (every counter advances, each at its own phase's seq_len)
        and given to no rank, so the stream after them is the one a run that trained them
        would see."""
        size = self.dp_world_size * self.local_batch_size
        lo, hi = self.dp_rank * self.local_batch_size, (self.dp_rank + 1) * self.local_batch_size
        n0 = cursor.num_sequences
        segments = self._round_segments(n0, size)
        used = [(start, stop) for start, stop, is_used in segments if is_used]
        seq_len = self.seq_len_at(used[0][0])
        for start, stop in used:
            for first, _, length in self._length_pieces(start, stop):
                if length != seq_len:
                    raise ValueError(
                        f"dataloader.schedule: seq_len changes to {length} at global "
                        f"sequence {first}, inside the round of {size} sequences ({self.dp_world_size} "
                        f"ranks x local batch {self.local_batch_size}) starting at {n0}, and a batch has "
                        f"one length; start the phase at a multiple of {size} (a training step boundary)"
                    )
        blocked = self.state_format_version >= 3
        if not blocked and seq_len != self.seq_len:
            raise ValueError(
                f"dataloader: this run resumed a format-{self.state_format_version} state, whose order "
                f"is fixed to seq_len {self.seq_len}; a seq_len phase ({seq_len}) needs a run started "
                "with this loader (format 3). Drop the seq_len phase, or start the data stream afresh "
                "(checkpoint.exclude_from_loading = ['dataloader'])"
            )
        span = segments[-1][1] - n0  # used and skipped
        counts, positions = list(cursor.per_dataset), list(cursor.blocks)
        plan: list[tuple[int, int, int, int]] = []
        if len(self.datasets) == 1:
            d = self.datasets[0]
            if blocked:
                pos, taken = positions[0], 0  # taken: used sequences so far
                for start, stop, is_used in segments:
                    if not is_used:
                        for _, count, length in self._length_pieces(start, stop):
                            pos = d.advance(pos, length, count)
                        continue
                    count = stop - start
                    first = min(max(lo - taken, 0), count)  # this rank's rows in the run
                    last = min(max(hi - taken, 0), count)
                    starts: list[tuple[int, int]] = []
                    pos = d.advance(pos, seq_len, first)
                    pos = d.advance(pos, seq_len, last - first, starts)
                    pos = d.advance(pos, seq_len, count - last)
                    plan += [
                        (0, key, epoch, start + first + j) for j, (epoch, key) in enumerate(starts)
                    ]
                    taken += count
                if d.max_sequences is not None and pos.epoch >= 1:
                    self._log_drop(None, size)
                    return None
                positions = [pos]
            else:
                limit = d.max_sequences
                if limit is not None and counts[0] + span > limit:
                    self._log_drop(max(0, limit - counts[0]), size)
                    return None
                rows = [n for start, stop in used for n in range(start, stop)][lo:hi]
                plan = [(0, counts[0] + n - n0, 0, n) for n in rows]
            after = (counts[0] + span,)
            return (
                plan,
                replace(
                    cursor, num_sequences=n0 + span, per_dataset=after, blocks=tuple(positions)
                ),
                seq_len,
            )
        origin, origin_counts = cursor.mix_origin, list(cursor.mix_origin_per_dataset)
        phase = bisect.bisect_right(self.phase_starts, n0) - 1
        i = 0  # used sequences so far
        for start, stop, is_used in segments:
            for n in range(start, stop):
                while phase + 1 < len(self.phase_starts) and self.phase_starts[phase + 1] <= n:
                    phase += 1
                if self.phase_starts[phase] > origin:  # a schedule phase starts: new error feedback
                    origin, origin_counts = self.phase_starts[phase], list(counts)
                weights = self.phase_weights[phase]
                scores = [
                    w * (n - origin + 1) - (c - o)
                    for w, c, o in zip(weights, counts, origin_counts, strict=True)
                ]
                d = scores.index(max(scores))
                dataset = self.datasets[d]
                mine = is_used and lo <= i < hi
                if blocked:
                    starts = [] if mine else None
                    length = seq_len if is_used else self.seq_len_at(n)
                    positions[d] = dataset.advance(positions[d], length, 1, starts)
                    if dataset.max_sequences is not None and positions[d].epoch >= 1:
                        self._log_drop(i, size)
                        return None
                    if starts:
                        plan.append((d, starts[0][1], starts[0][0], n))
                else:
                    limit = dataset.max_sequences
                    if limit is not None and counts[d] >= limit:
                        self._log_drop(i, size)
                        return None
                    if mine:
                        plan.append((d, counts[d], 0, n))
                counts[d] += 1
                i += is_used
        after = _Cursor(n0 + span, tuple(counts), origin, tuple(origin_counts), tuple(positions))
        return plan, after, seq_len

    def _log_drop(self, num_available: int | None, size: int) -> None:
        available = "" if num_available is None else f"{num_available} of "
        logger.info(
            f"[TokenShardDataLoader] data exhausted on rank {self.dp_rank}: dropped the final "
            f"incomplete round ({available}{size} sequences) so every rank "
            "yields the same number of batches"
        )

    def _produce(self, cursor: _Cursor) -> tuple[tuple, _Cursor] | None:
        """The batch of this rank at `cursor` and the cursor after it (pure in `cursor`)."""
        planned = self._plan_round(cursor)
        if planned is None:
            return None
        plan, after, seq_len = planned
        batch_size = self.local_batch_size
        tokens = np.empty((batch_size, seq_len + 1), dtype=self.datasets[0].dtype)
        positions = np.empty((batch_size, seq_len), dtype=np.int64)

        def read(row: int) -> None:
            d, key, _, _ = plan[row]
            self.datasets[d].read_sequence(key, tokens[row], positions[row])

        legacy = any(d.legacy is not None for d in self.datasets)  # format 1: one reader
        if self.config.read_threads > 1 and batch_size > 1 and not legacy:
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

    # ---- iteration ------------------------------------------------------------------
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
            # The state is the counters after the last batch returned (never prefetch-skewed).
            self._committed = after
            self.last_origins = [(d, epoch, key) for d, key, epoch, _ in plan]
            self.last_sequences = [n for _, _, _, n in plan]
            self.num_batches_yielded += 1
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
        if self.state_format_version >= 3:
            for entry, pos in zip(datasets, c.blocks, strict=True):
                entry["block_position"] = [pos.epoch, pos.group, pos.seq_len, pos.taken]
                entry["skipped_tokens"] = pos.skipped
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
            "seq_len": self.seq_len_at(c.num_sequences) if blocked else self.seq_len,
            "fingerprint": self.fingerprint,
            "state_json": json.dumps(saved, sort_keys=True),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.close()  # batches prefetched from the old position are discarded
        self._exhausted = False
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
        positions = {
            d["content_sha256"]: (
                _BlockPosition(*d["block_position"], d["skipped_tokens"])
                if "block_position" in d
                else _BlockPosition()
            )
            for d in saved["datasets"]
        }
        if state_dict["fingerprint"] == self.fingerprint:
            self._committed = _Cursor(
                n,
                tuple(int(d["sequences_consumed"]) for d in saved["datasets"]),
                int(saved["mix_origin"]),
                tuple(int(d["mix_origin"]) for d in saved["datasets"]),
                tuple(positions[d["content_sha256"]] for d in saved["datasets"]),
            )
            logger.info(
                f"[TokenShardDataLoader] rank {self.dp_rank}/{self.dp_world_size} resumed at global sequence "
                f"{n} (per dataset {self.sequences_per_dataset})"
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
        by_content = {d["content_sha256"]: int(d["sequences_consumed"]) for d in saved["datasets"]}
        per_dataset = tuple(by_content.get(p["content_sha256"], 0) for p in self.fingerprint_parts)
        blocks = tuple(
            positions.get(p["content_sha256"], _BlockPosition()) for p in self.fingerprint_parts
        )
        self._committed = _Cursor(n, per_dataset, n, per_dataset, blocks)
        logger.warning(
            "[TokenShardDataLoader] DATASET CHANGE ACCEPTED (allow_dataset_change=true): "
            + "; ".join(changes)
            + f". Continuing at global sequence {n}; per-dataset positions {list(per_dataset)}; "
            "the new weights apply from here on"
        )

    def _set_state_format(self, version: int) -> None:
        if version == 1:
            # Documented migration: a run started by the format-1 loader keeps its order.
            if self.state_format_version != 1:
                logger.warning(
                    "[TokenShardDataLoader] resuming a format-1 dataloader state (written before "
                    "sequence-level shuffling): this run keeps the format-1 document-shuffle order so "
                    "no sample is repeated or skipped; it costs O(documents) memory per rank. Runs "
                    "started afresh use format 3"
                )
            for d in self.datasets:
                if d.legacy is None:
                    d.legacy = LegacyDocumentShuffle(d)
        elif version in (2, 3):
            if version == 2 and self.state_format_version != 2:
                logger.warning(
                    "[TokenShardDataLoader] resuming a format-2 dataloader state (written before "
                    "seq_len could change): this run keeps the format-2 order, at a fixed seq_len "
                    f"{self.seq_len}. Runs started afresh use format 3"
                )
            for d in self.datasets:
                d.legacy = None
        else:
            raise ValueError(
                f"dataloader checkpoint state has format_version {version}; this code reads formats "
                f"1 to {STATE_FORMAT_VERSION}. It was written by a newer version of dataloader/loader.py: "
                "resume with that version, or start the data stream afresh "
                "(checkpoint.exclude_from_loading = ['dataloader'])"
            )
        for d in self.datasets:
            d.order_format = version
        self.state_format_version = version

    @property
    def skipped_tokens(self) -> int:
        """Input tokens dropped so far, over all datasets (format 3; see `_BlockPosition`)."""
        return sum(p.skipped for p in self._committed.blocks)

    def metrics(self) -> dict[str, float]:
        """What the trainer logs to metrics.jsonl (`data/skipped_tokens`,
        `data/skipped_sequences`)."""
        return {
            "data/skipped_tokens": float(self.skipped_tokens),
            "data/skipped_sequences": float(self.skipped_sequences),
        }

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

    _DONE = object()

    def __init__(self, produce, cursor: _Cursor, depth: int):
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

    def _run(self, produce, cursor: _Cursor) -> None:
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
