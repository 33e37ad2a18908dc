"""The orders of loader-state formats 1 and 2, kept so that their runs resume exactly.

Why this exists: a run whose checkpoint was written by an older loader has consumed a
prefix of *that* loader's order. Continuing it in the current order (format 3,
`dataloader.stream`) would repeat and skip data, so a state of format 1 or 2 keeps its
order for the rest of the run. Both implement `dataloader.stream.DatasetOrder` over a
`DatasetStream` (which reads the tokens), so the global order deals them exactly like
format 3 and has no branch of its own for them.

In both, a dataset's position is its sequence count k (the state's
`sequences_consumed`), and dataset sequence k covers stream tokens [k*L, k*L + L + 1) of
a per-epoch order at the one seq_len L the run started with (`fixed_seq_len`: these
formats cannot change it; the loader refuses a change with the fixes):

* Format 2 (commit e22de0e and before): epoch e = floor(k / N) takes the N = (T-1)//L
  windows of the on-disk stream in the keyed order `FeistelPermutation(N, seed,
  dataset_index, e)`. O(1) memory, like format 3.
* Format 1 (commit 8166cc5 and before; no `format_version` in the state): epoch e visits
  documents in `np.random.default_rng([seed, dataset_index, e]).permutation(num_documents)`
  and the stream is the concatenation of its epochs. This is the code of the format-1
  loader, unchanged in behaviour, at format 1's cost: O(documents) memory per rank (a
  permutation of all documents and their cumulative offsets, per cached epoch).
"""

from __future__ import annotations

import functools

import numpy as np

from dataloader.shuffle import FeistelPermutation
from dataloader.stream import DatasetStream

PERMUTATIONS_CACHED = 2  # a batch can straddle two epochs
EPOCHS_CACHED = 2  # a window can straddle two epochs


class WindowShuffleOrder:
    """Format 2: the windows of one seq_len shuffled over the whole epoch."""

    format_version = 2
    parallel_reads = True

    def __init__(self, stream: DatasetStream, seq_len: int):
        self.stream, self.fixed_seq_len = stream, seq_len
        self.windows_per_epoch = (stream.num_tokens - 1) // seq_len  # N
        # epoch -> its permutation (a batch can straddle two epochs); lru_cache is
        # thread-safe, and the reader threads share it
        self._perm = functools.lru_cache(PERMUTATIONS_CACHED)(
            lambda epoch: FeistelPermutation(
                self.windows_per_epoch, stream.seed, stream.dataset_index, epoch
            )
        )

    def start_position(self) -> int:
        return 0

    def position_from_state(self, entry: dict) -> int:
        return int(entry["sequences_consumed"])

    def position_state(self, k: int) -> dict:
        return {}  # the count is the state's sequences_consumed

    def skipped_tokens(self, k: int) -> int:
        return 0

    def advance(self, k: int, seq_len: int, count: int, starts: list | None = None) -> int:
        """Sequences k .. k+count-1; their keys are their indices (epoch: 0, unused).
        `seq_len` is `fixed_seq_len` for drawn windows (the global order checks)."""
        if starts is not None:
            starts.extend((0, j) for j in range(k, k + count))
        return k + count

    def exhausted(self, k: int) -> bool:
        return self.stream.one_pass and k > self.windows_per_epoch

    def window_start(self, k: int) -> int:
        """On-disk token offset of dataset sequence k: window perm_e(k mod N)."""
        epoch, j = divmod(k, self.windows_per_epoch)
        return self._perm(epoch).index(j) * self.fixed_seq_len

    def read_sequence(self, k: int, tokens: np.ndarray, positions: np.ndarray) -> None:
        self.stream.read_window(self.window_start(k), tokens, positions)


class DocumentShuffleOrder(WindowShuffleOrder):
    """Format 1: documents shuffled per epoch, the shuffled stream cut into windows.
    Positions, counts and the end of a pass are format 2's; only the windows differ."""

    format_version = 1
    parallel_reads = False  # the epoch cache is not guarded: one reader

    def __init__(self, stream: DatasetStream, seq_len: int):
        super().__init__(stream, seq_len)
        self.doc_lengths = np.diff(stream.doc_starts)
        self._epoch = functools.lru_cache(EPOCHS_CACHED)(self._shuffle_epoch)

    def _shuffle_epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, cumulative token offsets in that order) of one epoch."""
        d = self.stream
        order = np.random.default_rng([d.seed, d.dataset_index, epoch]).permutation(
            d.manifest.num_documents
        )
        cum = np.zeros(order.size + 1, dtype=np.int64)
        np.cumsum(self.doc_lengths[order], out=cum[1:])
        return order, cum

    def read_sequence(self, k: int, tokens: np.ndarray, positions: np.ndarray) -> None:
        """Fill tokens[: L+1] with stream tokens [k*L, k*L+L+1) and positions[: L]."""
        d, arange = self.stream, self.stream.arange
        need = tokens.shape[0]
        filled = 0
        stream = k * self.fixed_seq_len
        while filled < need:
            epoch, offset = divmod(stream + filled, d.num_tokens)
            order, cum = self._epoch(epoch)
            end = min(offset + need - filled, d.num_tokens)
            first = int(np.searchsorted(cum, offset, side="right")) - 1
            last = int(np.searchsorted(cum, end, side="left"))  # exclusive
            for m in range(first, last):
                lo = max(int(cum[m]), offset)
                hi = min(int(cum[m + 1]), end)
                length = hi - lo
                start = int(d.doc_starts[order[m]]) + lo - int(cum[m])
                d.copy_tokens(start, tokens[filled : filled + length])
                # Positions restart at each piece: a document start or the window start.
                p_hi = min(filled + length, positions.shape[0])
                if p_hi > filled:
                    positions[filled:p_hi] = arange[: p_hi - filled]
                filled += length
