"""FeistelPermutation: a keyed bijection of [0, n) for any n, computed per index."""

from __future__ import annotations

import numpy as np
import pytest

from dataloader.shuffle import FeistelPermutation


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097, 100_003])
def test_is_a_bijection_of_any_size(n):
    values = FeistelPermutation(n, 7, 0, 3)(np.arange(n))
    assert np.array_equal(np.sort(values), np.arange(n))


def test_scalar_and_vector_agree_and_depend_only_on_key():
    perm = FeistelPermutation(12345, 1, 2)
    indices = np.array([0, 5, 12344, 777])
    assert [perm[int(j)] for j in indices] == perm(indices).tolist()
    assert np.array_equal(FeistelPermutation(12345, 1, 2)(indices), perm(indices))
    assert not np.array_equal(FeistelPermutation(12345, 1, 3)(np.arange(100)), perm(np.arange(100)))


def test_looks_random():
    n = 100_000
    values = FeistelPermutation(n, 42)(np.arange(n))
    assert abs(np.corrcoef(np.arange(n), values)[0, 1]) < 0.02
    # Neighbours are scattered: consecutive indices rarely map close together.
    assert np.mean(np.abs(np.diff(values)) < n // 100) < 0.05
    # Each tenth of the input spreads over all tenths of the output.
    counts = np.bincount(values[: n // 10] * 10 // n, minlength=10)
    assert counts.min() > 0.8 * n / 100


def test_refuses_out_of_range():
    with pytest.raises(IndexError):
        FeistelPermutation(10, 1)(np.array([10]))
    with pytest.raises(ValueError):
        FeistelPermutation(0, 1)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_position_is_the_inverse_permutation(n):
    perm = FeistelPermutation(n, 5, 1, 2)
    values = perm(np.arange(n))
    assert [perm.position(int(v)) for v in values] == list(range(n))
    with pytest.raises(IndexError):
        perm.position(n)
