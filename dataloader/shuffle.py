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
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a fast, well-diffusing uint64 -> uint64 map."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """`perm[j]` for j in [0, n): a bijection of [0, n) chosen by `key` (any ints)."""

    def __init__(self, n: int, *key: int):
        if n < 1:
            raise ValueError(f"permutation size must be >= 1, got {n}")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        self.half_bits = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half_bits) - 1)
        digest = hashlib.sha256(("feistel|" + "|".join(str(int(k)) for k in key)).encode())
        raw = digest.digest() + hashlib.sha256(digest.digest()).digest()
        self.round_keys_int = [
            int.from_bytes(raw[8 * i : 8 * i + 8], "little") for i in range(NUM_ROUNDS)
        ]
        self.round_keys = [np.uint64(k) for k in self.round_keys_int]

    def _network(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half_bits)
        left, right = x >> shift, x & self.mask
        with np.errstate(over="ignore"):
            for k in self.round_keys:
                left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << shift) | right

    def _network_int(self, x: int) -> int:
        """The same network on one Python int (faster than numpy for a few indices)."""
        shift, mask, full = self.half_bits, int(self.mask), (1 << 64) - 1
        left, right = x >> shift, x & mask
        for k in self.round_keys_int:
            z = right ^ k
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & full
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & full
            left, right = right, left ^ ((z ^ (z >> 31)) & mask)
        return (left << shift) | right

    def index(self, j: int) -> int:
        """perm[j] for one index, in pure Python."""
        if not 0 <= j < self.n:
            raise IndexError(f"index {j} outside [0, {self.n})")
        x = self._network_int(j)
        while x >= self.n:  # cycle-walking back into [0, n)
            x = self._network_int(x)
        return x

    def _inverse_network_int(self, x: int) -> int:
        """The network run backwards: each round (l, r) -> (r, l ^ f(r)) undone as
        (l', r') -> (r' ^ f(l'), l'), with the round keys in reverse order."""
        shift, mask, full = self.half_bits, int(self.mask), (1 << 64) - 1
        left, right = x >> shift, x & mask
        for k in reversed(self.round_keys_int):
            z = left ^ k
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & full
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & full
            left, right = right ^ ((z ^ (z >> 31)) & mask), left
        return (left << shift) | right

    def position(self, value: int) -> int:
        """The index j with perm[j] == value (the inverse permutation, O(1) memory): the
        cycle walk retraced backwards. The quarantine (`dataloader.stream`) asks where in
        a group's order a given window comes."""
        if not 0 <= value < self.n:
            raise IndexError(f"value {value} outside [0, {self.n})")
        x = self._inverse_network_int(value)
        while x >= self.n:
            x = self._inverse_network_int(x)
        return x

    def __call__(self, j: np.ndarray | int) -> np.ndarray:
        """Vectorised: the permuted value of every index in `j` (int64 array)."""
        x = np.asarray(j, dtype=np.uint64).copy()
        if x.size and (int(x.max()) >= self.n or int(np.asarray(j).min()) < 0):
            raise IndexError(f"index outside [0, {self.n})")
        x = self._network(x)
        outside = x >= self.n
        while outside.any():  # cycle-walking back into [0, n)
            x[outside] = self._network(x[outside])
            outside = x >= self.n
        return x.astype(np.int64)

    def __getitem__(self, j: int) -> int:
        return self.index(int(j))
