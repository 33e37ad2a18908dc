"""The order of loader-state format 1 (before sequence-level shuffling), kept for resumes.

Why this exists: a run whose checkpoint was written by the format-1 loader has consumed
a prefix of *that* order. Continuing it with the format-2 order would repeat and skip
data, so a state without `format_version` (format 1) keeps this order for the rest of
the run: exact-once holds, at format 1's cost (O(documents) memory per rank: a
permutation of all documents and their cumulative offsets, per cached epoch). New runs
use format 2 (`dataloader.loader`), whose memory does not grow with the corpus.

Format 1: per dataset, epoch e visits documents in
`np.random.default_rng([seed, dataset_index, e]).permutation(num_documents)`; the
dataset's stream is the concatenation of its epochs and sequence k is stream tokens
[k*L, k*L + L + 1). This is the code of the format-1 loader, unchanged in behaviour.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

EPOCHS_CACHED = 2  # a window can straddle two epochs


class LegacyDocumentShuffle:
    """Format-1 windows of one dataset (`dataset` is a `loader._ShardedDataset`)."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.doc_lengths = np.diff(dataset.doc_starts)
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, cumulative token offsets in that order) of one epoch."""
        cached = self._epochs.get(epoch)
        if cached is None:
            d = self.dataset
            order = np.random.default_rng([d.seed, d.dataset_index, epoch]).permutation(
                d.manifest.num_documents
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
        d = self.dataset
        need = tokens.shape[0]
        filled = 0
        stream = k * d.seq_len
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
