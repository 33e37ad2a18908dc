"""A keyed pseudo-random permutation of [0, n) evaluated per index in O(1) memory.

Why: shuffling the sequences of an epoch with `rng.permutation(n)` costs 8 bytes per
sequence on every rank (1 GB at 1e12 tokens / 8192), and it must be recomputed each
epoch. A *keyed bijection* gives the same thing without storing anything: position j
of epoch e is `FeistelPermutation(n, key(seed, dataset, e))[j]`, computed on demand.

How: a balanced Feistel network on 2h bits (2^(2h) >= n) is a bijection of
[0, 4^h) for *any* round function, because each round (l, r) -> (r, l ^ f(r)) can be
undone. To get a bijection of [0, n) we *cycle-walk*: apply the network again while
the result is >= n. Starting inside [0, n), the walk follows the permutation's cycle
and must re-enter [0, n) (at the latest back at the start), and two different starts
cannot land on the same value (the walk is invertible), so the restriction is a
bijection of [0, n). Since 4^h < 4n, the expected walk is < 4 applications.

The round function is a splitmix64 finaliser of (half ^ round key); round keys come
from sha256 of the caller's key, so a permutation is fully determined by (n, key) and
identical on every machine and numpy version (only uint64 wrap-around arithmetic).
"""

from __future__ import annotations

import hashlib

import numpy as np

NUM_ROUNDS = 6
_FULL = (1 << 64) - 1


def _mix(z: int) -> int:
    """splitmix64 finaliser: a fast, well-diffusing uint64 -> uint64 map (wrap-around
    arithmetic on Python ints)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _FULL
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _FULL
    return z ^ (z >> 31)


class FeistelPermutation:
    """`perm[j]` for j in [0, n): a bijection of [0, n) chosen by `key` (any ints)."""

    def __init__(self, n: int, *key: int):
        if n < 1:
            raise ValueError(f"permutation size must be >= 1, got {n}")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        self.half_bits = (bits + 1) // 2
        self.mask = (1 << self.half_bits) - 1
        digest = hashlib.sha256(("feistel|" + "|".join(str(int(k)) for k in key)).encode())
        raw = digest.digest() + hashlib.sha256(digest.digest()).digest()
        self.round_keys = [
            int.from_bytes(raw[8 * i : 8 * i + 8], "little") for i in range(NUM_ROUNDS)
        ]

    def _network(self, x: int) -> int:
        """One pass of the network on one index (pure Python ints: faster than numpy for
        the few indices a round of the loader asks for)."""
        left, right = x >> self.half_bits, x & self.mask
        for k in self.round_keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half_bits) | right

    def index(self, j: int) -> int:
        """perm[j] for one index, in pure Python."""
        if not 0 <= j < self.n:
            raise IndexError(f"index {j} outside [0, {self.n})")
        x = self._network(j)
        while x >= self.n:  # cycle-walking back into [0, n)
            x = self._network(x)
        return x

    def _inverse_network(self, x: int) -> int:
        """The network run backwards: each round (l, r) -> (r, l ^ f(r)) undone as
        (l', r') -> (r' ^ f(l'), l'), with the round keys in reverse order."""
        left, right = x >> self.half_bits, x & self.mask
        for k in reversed(self.round_keys):
            left, right = right ^ (_mix(left ^ k) & self.mask), left
        return (left << self.half_bits) | right

    def position(self, value: int) -> int:
        """The index j with perm[j] == value (the inverse permutation, O(1) memory): the
        cycle walk retraced backwards. The quarantine (`dataloader.stream`) asks where in
        a group's order a given window comes."""
        if not 0 <= value < self.n:
            raise IndexError(f"value {value} outside [0, {self.n})")
        x = self._inverse_network(value)
        while x >= self.n:
            x = self._inverse_network(x)
        return x

    def __call__(self, j: np.ndarray | int) -> np.ndarray:
        """The permuted value of every index in `j` (int64 array), one `index` each."""
        values = [self.index(int(i)) for i in np.ravel(j)]
        return np.array(values, dtype=np.int64).reshape(np.shape(j))

    def __getitem__(self, j: int) -> int:
        return self.index(int(j))
