"""One prepared dataset as a stream of windows: shards -> blocks -> groups -> windows.

Why this is its own module: what one dataset does (where its next window lies on disk,
what that costs, what a seq_len change drops) is a different question from how datasets
are interleaved and dealt to ranks (`dataloader.global_order`) and from iteration and
checkpoint state (`dataloader.loader`). Each dataset sees only "give me the next `count`
windows of length L after this position", so this is the one place that decides which
tokens a window holds, and the only place a new order (a new state format) changes.

The order of state format 3 (`STATE_FORMAT_VERSION`), whose cost does not grow with the
corpus (1e12 tokens, 1e9 documents); the position is a few ints (`BlockPosition`):

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
  windows; every dropped token is counted (`BlockPosition.skipped`).
* Positions restart at 0 at every document start, and also at the start of every
  window (a window that starts mid-document), so no position ever reaches seq_len.
* Quarantine (`set_quarantine`): on-disk token ranges (documents `python -m
  train.forensics --quarantine-*` named) whose windows are passed over wherever they
  come, in this epoch or any later one: a window overlapping a range is taken from the
  order but yielded to no one, and counted (`BlockPosition.quarantined`, its tokens in
  `skipped`). Each group's dropped windows are found from the ranges with the inverse
  permutation (`FeistelPermutation.position`), O(quarantined windows), so nothing grows
  with the corpus; with no range the order is exactly the one without quarantine.

`DatasetOrder` is the interface the global order uses; `DatasetStream` implements it for
format 3, `dataloader.legacy_order` for formats 1 and 2 over the same stream, so that the
round planner has one path whatever the format. What a new format must do is written on
`DatasetOrder`.
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
from collections import OrderedDict
from dataclasses import astuple, dataclass
from typing import Any, Protocol

import numpy as np

from dataloader.manifest import Manifest
from dataloader.shuffle import FeistelPermutation

STATE_FORMAT_VERSION = 3
"""Version of the order the state's counters index into (1: `legacy_order`; 2: windows of
one seq_len shuffled over the epoch; 3: windows shuffled within groups of blocks)."""
MAX_OPEN_SHARDS = 256  # open file descriptors per dataset
GROUPS_CACHED = 4  # a round can straddle groups (and the prefetch thread runs ahead)


def merge_ranges(ranges) -> tuple[tuple[int, int], ...]:
    """[start, end) ranges, sorted, with the ones that overlap or touch joined."""
    merged: list[list[int]] = []
    for a, e in sorted((int(a), int(e)) for a, e in ranges):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([a, e])
    return tuple((a, e) for a, e in merged)


class DatasetOrder(Protocol):
    """One dataset's windows in one state format's order, as the global order sees them.

    A position is a value the order defines (format 3: `BlockPosition`; formats 1-2: the
    dataset's sequence count); the global order keeps one per dataset in its cursor and
    only passes it back. Each method is pure in the position, so the prefetch thread and
    a resume on any number of ranks see the same windows.

    A new state format must: implement this protocol (a class beside `DatasetStream`,
    reading tokens through it); raise `STATE_FORMAT_VERSION`; keep every older format's
    class, so a run resumed from an older state keeps its order (exact-once);
    make `TokenShardDataLoader._set_state_format` pick each version's class; and add its
    cases to tests/dataloader/test_order_golden.py, with every older digest unchanged.
    The global order (`dataloader.global_order`) does not change.
    """

    format_version: int
    """The state's `format_version` this order is."""
    fixed_seq_len: int | None
    """The only seq_len this order can cut (formats 1-2), None when any seq_len works."""
    parallel_reads: bool
    """Whether rows may be read by several threads at once."""

    def start_position(self) -> Any:
        """The position of a dataset nothing was drawn from."""

    def position_from_state(self, entry: dict) -> Any:
        """The position in a state's per-dataset entry (`position_state`'s keys and the
        `sequences_consumed` count)."""

    def position_state(self, position: Any) -> dict:
        """The keys this format adds to the state's per-dataset entry."""

    def advance(self, position: Any, seq_len: int, count: int, starts: list | None = None) -> Any:
        """The position after `count` more windows of `seq_len`; each window's
        (epoch, key for `read_sequence`) is appended to `starts` when given."""

    def exhausted(self, position: Any) -> bool:
        """Whether a dataset that stops after one pass has drawn beyond it."""

    def skipped_tokens(self, position: Any) -> int:
        """Input tokens dropped up to `position` (never trained on, counted)."""

    def read_sequence(self, key: int, tokens: np.ndarray, positions: np.ndarray) -> None:
        """One row: tokens[: L+1] and positions[: L] of the window `key` names."""


@dataclass(frozen=True, slots=True)
class BlockPosition:
    """Where one dataset stands in the format-3 order (a few ints, whatever the corpus).

    Epoch `epoch`, group `group` of its blocks, cut into windows of `seq_len` tokens
    (0: not cut yet), `taken` of them consumed; `skipped` counts the input tokens this
    dataset has dropped so far (block tails shorter than a window, the rest of a group
    cut short by a seq_len change, and quarantined windows); `quarantined` counts the
    windows passed over because they overlap a quarantined token range (they are among
    the `taken`)."""

    epoch: int = 0
    group: int = 0
    seq_len: int = 0
    taken: int = 0
    skipped: int = 0
    quarantined: int = 0


class _GroupLayout:
    """The windows of one group of blocks at one seq_len, in their keyed order."""

    def __init__(self, blocks, avail, seq_len: int, block_tokens: int, key: tuple[int, ...]):
        self.blocks = blocks  # block ids, in the group's (shuffled) block order
        per_block = avail // seq_len  # windows per block: a tail < seq_len is dropped
        self.cum = np.concatenate([[0], np.cumsum(per_block)])
        self.num_windows = int(self.cum[-1])
        self.input_tokens = int(avail.sum())
        self.perm = FeistelPermutation(self.num_windows, *key) if self.num_windows else None
        self.seq_len, self.block_tokens = seq_len, block_tokens
        self.dropped: list[int] = []  # sorted order indices of quarantined windows

    def quarantine(self, ranges: tuple[tuple[int, int], ...]) -> None:
        """Mark the windows overlapping any on-disk token range [a, e) as dropped. Window
        k of block b holds tokens [b*C + k*L, b*C + k*L + L + 1) (its last label
        included), so it meets [a, e) for (a - b*C - L - 1) // L < k <= (e - b*C - 1) // L."""
        if not self.num_windows or not ranges:
            return
        length, size = self.seq_len, self.block_tokens
        block_starts = self.blocks * size
        per_block = np.diff(self.cum)
        found: set[int] = set()
        for a, e in ranges:
            hits = np.nonzero((block_starts < e) & (block_starts + per_block * length + 1 > a))[0]
            for s in hits.tolist():
                base = int(block_starts[s])
                first = max(0, (a - base - length - 1) // length + 1)
                last = min(int(per_block[s]) - 1, (e - base - 1) // length)
                found.update(
                    self.perm.position(int(self.cum[s]) + k) for k in range(first, last + 1)
                )
        self.dropped = sorted(found)

    def next_dropped(self, j: int) -> int:
        """The first quarantined order index >= j, or `num_windows` when none is ahead."""
        i = bisect.bisect_left(self.dropped, j)
        return self.dropped[i] if i < len(self.dropped) else self.num_windows

    def start(self, j: int) -> int:
        """On-disk token offset of the group's j-th window in order."""
        w = self.perm.index(j)
        s = int(np.searchsorted(self.cum, w, side="right")) - 1
        return int(self.blocks[s]) * self.block_tokens + (w - int(self.cum[s])) * self.seq_len


class DatasetStream:
    """One prepared split: its shards and document index read with pread, and its windows
    in the format-3 order (`DatasetOrder`)."""

    format_version = STATE_FORMAT_VERSION
    fixed_seq_len = None
    parallel_reads = True

    def __init__(
        self,
        path: str,
        dataset_index: int,
        seed: int,
        *,
        max_seq_len: int,
        one_pass: bool = False,
        block_tokens: int = 1 << 17,
        shuffle_blocks: int = 1024,
    ):
        # Start-up reads the manifest and stats the index: O(shards) JSON, no O(documents) read.
        self.manifest = Manifest.load(path, check_files=False)
        self.dataset_index, self.seed = dataset_index, seed
        self.block_tokens, self.shuffle_blocks = block_tokens, shuffle_blocks
        self.manifest.load_document_starts()  # size, shape and total checked
        # Mapped for format 1 only (it needs all of it); formats 2-3 read entries with pread.
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
        if self.num_tokens - 1 < max_seq_len:
            raise ValueError(
                f"{self.manifest.root}: {self.num_tokens} tokens, fewer than seq_len + 1 = {max_seq_len + 1}: "
                "not one full sequence; use a smaller training.seq_len or more data"
            )
        # Input positions [0, T-1) in blocks of C tokens, G blocks per group.
        self.num_blocks = -(-(self.num_tokens - 1) // block_tokens)
        self.num_groups = -(-self.num_blocks // shuffle_blocks)
        # (epoch, group, seq_len) -> its layout; lru_cache is thread-safe (reader threads)
        self.group_layout = functools.lru_cache(GROUPS_CACHED)(self._group_layout)
        self.dtype = np.dtype(self.manifest.dtype)
        self.arange = np.arange(max_seq_len + 1, dtype=np.int64)
        self._shards: OrderedDict[int, int] = OrderedDict()  # shard -> fd
        self._evicted: list[int] = []
        self._lock = threading.Lock()  # guards the caches; reads run in parallel
        # True: the dataset ends after one pass (on_exhausted = "stop", or validation).
        self.one_pass = one_pass or self.manifest.on_exhausted == "stop"
        self.quarantine: tuple[tuple[int, int], ...] = ()
        """Merged on-disk token ranges [a, e) whose windows are passed over (`set_quarantine`)."""

    def set_quarantine(self, ranges) -> None:
        """Pass over every window overlapping one of these on-disk token ranges [a, e),
        in every epoch from the current position on (the whole list: it replaces the one
        there). Called while no thread plans (the loader stops its prefetch first)."""
        ranges = [(int(a), int(e)) for a, e in ranges]
        for a, e in ranges:
            if not 0 <= a < e <= self.num_tokens:
                raise ValueError(
                    f"{self.manifest.root}: quarantined token range [{a}, {e}) is outside the "
                    f"dataset's {self.num_tokens} tokens (was it quarantined on other data?)"
                )
        with self._lock:
            self.quarantine = merge_ranges(ranges)
            self.group_layout.cache_clear()  # layouts hold their dropped windows

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

    def documents_between(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(document, its first token, its end) of each document that on-disk tokens
        [start, stop) overlap, in order: ~log2(D) + a few preads, whatever the corpus
        (`train.ledger which` names a window's documents with it)."""
        found, m = [], self._last_document_at_or_before(start)
        while m < self.manifest.num_documents:
            entries = self._index_entries(m, 65)  # starts of m.., and the end of the last
            for i in range(len(entries) - 1):
                if int(entries[i]) >= stop:
                    return found
                found.append((m + i, int(entries[i]), int(entries[i + 1])))
            m += len(entries) - 1
        return found

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

    # ---- format 3: blocks, groups of blocks, windows shuffled within a group -------------
    def _group_layout(self, epoch: int, group: int, seq_len: int) -> _GroupLayout:
        """Group `group` of epoch `epoch`: blocks pi_e(gG .. gG+G-1) cut at `seq_len`
        (`group_layout`: the same, cached)."""
        seed, d = self.seed, self.dataset_index
        block_order = FeistelPermutation(self.num_blocks, seed, d, epoch, 3)
        first = group * self.shuffle_blocks
        blocks = block_order(np.arange(first, min(first + self.shuffle_blocks, self.num_blocks)))
        # Input positions end at T-2: the last token is only ever a label.
        avail = np.minimum(self.block_tokens, self.num_tokens - 1 - blocks * self.block_tokens)
        layout = _GroupLayout(
            blocks, avail, seq_len, self.block_tokens, (seed, d, epoch, 3, group, seq_len)
        )
        layout.quarantine(self.quarantine)
        return layout

    def advance(
        self, position: BlockPosition, seq_len: int, count: int, starts: list | None = None
    ) -> BlockPosition:
        """The position after `count` more windows of `seq_len`; their (epoch, on-disk
        start) are appended to `starts` when given.

        A group is cut into windows at the seq_len in force when its first window is
        taken. If the seq_len differs when the group is next drawn from, the rest of the
        group is dropped (at most G*C tokens, counted in `skipped`), so a token is never
        in two windows: the windows of one group at one seq_len are disjoint. A
        quarantined window is passed over: taken, but not counted in `count` nor listed
        in `starts`."""
        epoch, group, cut, taken, skipped, quarantined = astuple(position)
        while count > 0:
            if taken == 0:
                cut = seq_len  # nothing taken yet: cut (or re-cut) the group at this length
            layout = self.group_layout(epoch, group, cut)
            if cut == seq_len and taken < layout.num_windows:
                limit = layout.next_dropped(taken)  # num_windows: nothing quarantined ahead
                if limit == taken:  # a quarantined window: passed over, its tokens counted
                    taken, skipped, quarantined = taken + 1, skipped + cut, quarantined + 1
                    continue
                n = min(count, limit - taken)
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
        return BlockPosition(epoch, group, cut, taken, skipped, quarantined)

    def exhausted(self, position: BlockPosition) -> bool:
        return self.one_pass and position.epoch >= 1

    def start_position(self) -> BlockPosition:
        return BlockPosition()

    def position_from_state(self, entry: dict) -> BlockPosition:
        if "block_position" not in entry:
            return BlockPosition()
        quarantined = entry.get("quarantined_windows", 0)
        p = BlockPosition(*entry["block_position"], entry["skipped_tokens"], quarantined)
        # a position no `advance` makes would loop past the last group, or count < 0 skipped
        inside = min(astuple(p)) >= 0 and p.group < self.num_groups
        if inside and p.taken:
            inside = 0 < p.seq_len and p.taken <= self.group_layout(*astuple(p)[:3]).num_windows
        if not inside:
            raise ValueError(
                f"{self.manifest.root}: dataloader state position {entry['block_position']} "
                f"(epoch, group, seq_len, windows taken) lies outside this dataset's "
                f"{self.num_groups} group(s): the checkpoint's loader state is damaged or was "
                "edited; resume from another checkpoint, or start the data stream afresh "
                "(checkpoint.exclude_from_loading = ['dataloader'])"
            )
        return p

    def position_state(self, position: BlockPosition) -> dict:
        p = position
        state = {"block_position": list(astuple(p)[:4]), "skipped_tokens": p.skipped}
        if p.quarantined:  # absent until a window is quarantined: older states are unchanged
            state["quarantined_windows"] = p.quarantined
        return state

    def skipped_tokens(self, position: BlockPosition) -> int:
        return position.skipped

    def read_sequence(self, key: int, tokens: np.ndarray, positions: np.ndarray) -> None:
        """One row; `key` is the window's on-disk start (what `advance` gave)."""
        self.read_window(key, tokens, positions)
