"""Unit tests of strategies.checked and strategies.ulps_apart.

``ulps_apart`` is the measure every equivalence test and refimpl's final report
rely on, so it is checked here against an independent count in exact rationals,
leaf by leaf; ``checked`` is the guard that stops a strategy training on batches
of the wrong layout, shown refusing each wrong shape and passing the right one.
"""

from fractions import Fraction

import jax
import numpy as np
import pytest
from hypothesis import given, strategies as st

import loaders
import strategies


def exact_ulps_apart(a: list, b: list) -> Fraction:
    """The docstring's measure, exactly: max over leaves of max|x - y| / ulp(leaf's
    largest magnitude), the ulp as float32's spacing at that magnitude."""
    worst = Fraction(0)
    for x, y in zip(a, b):
        x, y = np.asarray(x, np.float32).ravel(), np.asarray(y, np.float32).ravel()
        big = max(max(abs(float(v)) for v in x), max(abs(float(v)) for v in y))
        unit = Fraction(float(np.spacing(np.float32(big))))
        worst = max(worst, max(abs(Fraction(float(p)) - Fraction(float(q))) for p, q in zip(x, y)) / unit)
    return worst


FLOATS = st.floats(-1e3, 1e3, width=32)


@given(st.lists(st.tuples(FLOATS, st.integers(-50, 50)), min_size=3, max_size=3), st.integers(0, 2))
def test_ulps_apart_counts_float32_ulps_of_each_leafs_largest_magnitude(entries, which):
    a = {"w": np.array([e[0] for e in entries], np.float32), "b": np.float32(3.0),
         "c": np.array([[0.5, -8.0]], np.float32)}
    b = jax.tree.map(np.copy, a)
    # Move one entry of one leaf (not only the last leaf) by a number of its own ulps.
    leaf = ["w", "b", "c"][which]
    x = np.asarray(b[leaf]).copy().ravel()
    x[0] = x[0] + entries[0][1] * np.spacing(np.float32(np.abs(x).max()))
    b[leaf] = x.reshape(np.shape(a[leaf])).astype(np.float32)
    got = strategies.ulps_apart(a, b)
    want = exact_ulps_apart(jax.tree.leaves(a), jax.tree.leaves(b))
    assert got == float(want)


def test_ulps_apart_sees_a_difference_in_any_leaf():
    a = [np.array([1.0, 2.0], np.float32), np.array([4.0], np.float32)]
    b = [np.array([1.0 + 3 * 2.0**-22, 2.0], np.float32), np.array([4.0], np.float32)]
    assert strategies.ulps_apart(a, b) == 3.0  # 2.0's ulp is 2**-22: 3 ulps, in the first leaf
    assert strategies.ulps_apart(b, a) == 3.0
    assert strategies.ulps_apart(a, a) == 0.0  # control: no difference, no ulps


def test_ulps_apart_takes_the_worst_leaf():
    a = [np.array([1.0], np.float32), np.array([1.0], np.float32), np.array([1.0], np.float32)]
    b = [np.array([1.0 + 5 * 2.0**-23], np.float32), np.array([1.0 + 2.0**-23], np.float32),
         np.array([1.0], np.float32)]
    assert strategies.ulps_apart(a, b) == 5.0


def batch(labels_shape, images_tail=(3, 4, 4)):
    labels = np.zeros(labels_shape, np.int32)
    return {"images": np.zeros(labels_shape + images_tail, np.float32), "labels": labels,
            "mask": np.ones(labels_shape, bool)}


@pytest.mark.parametrize("strategy, shape, ok", [
    ("pmap", (4, 2), True), ("pmap", (2, 4), False), ("pmap", (8, 1), False), ("pmap", (8,), False),
    ("sharded", (8,), True), ("sharded", (4, 2), False),
    ("shard_map", (8,), True), ("shard_map", (4, 2), False),
    ("single", (8,), True), ("single", (4, 2), False),
])
def test_checked_refuses_a_batch_in_the_wrong_layout(devices, strategy, shape, ok):
    mesh = loaders.data_mesh(devices[:4])
    batches = [batch(shape)]
    if ok:
        assert list(strategies.checked(batches, strategy, mesh)) == batches
    else:
        with pytest.raises(ValueError, match=f"strategy '{strategy}' needs batches in layout "
                                             f"'{strategies.LAYOUT[strategy]}'.*{shape}"):
            list(strategies.checked(batches, strategy, mesh))


def test_checked_refuses_a_batch_on_other_devices(devices):
    mesh = loaders.data_mesh(devices[:2])
    elsewhere = loaders.data_mesh(devices[2:4])
    good = loaders.global_batch_from_rows(batch((4,)), mesh)
    bad = loaders.global_batch_from_rows(batch((4,)), elsewhere)
    assert len(list(strategies.checked([good], "sharded", mesh))) == 1
    with pytest.raises(ValueError, match="not on the mesh's devices"):
        list(strategies.checked([good, bad], "sharded", mesh))
