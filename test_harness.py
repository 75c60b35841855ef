"""The harness itself: the helpers every test relies on can fail, and fail fast.

* ``bits_differ`` / ``assert_same_bits`` (conftest.py) compare arrays bit for bit
  (-0.0 is not 0.0, a NaN equals itself), name the first differing index, both values
  and the count, and stay fast on large arrays: pytest never diffs two byte strings.
"""

import time

import numpy as np
import pytest

from conftest import assert_same_bits, bits_differ


def test_bits_differ_sees_every_kind_of_difference():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert bits_differ(x, x.copy()) is None
    assert bits_differ(np.array([np.nan]), np.array([np.nan])) is None  # same bits
    assert "index (0,)" in bits_differ(np.array([0.0, 1.0]), np.array([-0.0, 1.0]))  # sign of zero
    assert "float32 (3, 4), want float32 (12,)" in bits_differ(x, x.reshape(-1))
    assert "want float64" in bits_differ(x, x.astype(np.float64))
    y = x.copy()
    y[1, 2] += 1
    y[2, 0] += 1
    assert bits_differ(x, y) == ("2 of 12 elements differ; the first at index (1, 2): got "
                                 "np.float32(6.0), want np.float32(7.0)")
    assert bits_differ(np.array([True, False]), np.array([True, True])).startswith("1 of 2")
    assert bits_differ(np.zeros((0, 3)), np.zeros((0, 3))) is None


def test_a_failing_comparison_of_large_arrays_is_reported_at_once():
    # The regression: `assert a.tobytes() == b.tobytes()` failing on 100 MB made pytest
    # diff the bytes for minutes. The helper's message is built in linear time.
    x = np.zeros(25_000_000, np.float32)
    y = x.copy()
    y[7:] = 1
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"the params: 24999993 of 25000000 elements differ; the first at index \(7,\)"):
        assert_same_bits(x, y, "the params")
    assert time.monotonic() - start < 10, "the comparison should take well under a second"
