"""Unit tests of strategies.py's parts: the checks on what a caller passes in, the
measure and the bounds, the twin measurement of growth, and stack_losses.

* ``ulps_apart`` is the measure every equivalence test and refimpl's final report
  rely on, so it is checked against an independent count in exact rationals, leaf
  by leaf.
* ``checked`` is the guard that stops a strategy training on batches it cannot
  honour: shown refusing each wrong layout (told from "mask"), other devices and a
  batch not sharded on 'data', placing host arrays in one process and refusing
  them across processes, and passing the right ones.
* ``ulp_bound``'s counts are pinned, CPU and GPU, 1, 3 and 8 devices, as its
  docstring derives them (a looser count is a bug too); ``Growth`` and ``verdict``
  against hand-computed bounds and every edge of the domain.
* ``twin_growth`` on a model whose growth is known exactly (a quadratic whose one
  entry doubles each step: the twins' distance must double too), with a
  contracting control.
* the refusals: float64 params without x64, a ``loss_terms`` that returns a mean
  or a vector, an optimizer without ``init``/``update`` or whose updates do not
  match the params, each naming the contract; with x64 on, float64 trains in
  float64.
"""

import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import loaders
import strategies
from conftest import assert_same_bits


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


def batch(mask_shape, images_tail=(3, 4, 4)):
    return {"images": np.zeros(mask_shape + images_tail, np.float32), "labels": np.zeros(mask_shape, np.int32),
            "mask": np.ones(mask_shape, bool)}


@pytest.mark.parametrize("strategy, shape, ok", [
    ("pmap", (4, 2), True), ("pmap", (2, 4), False), ("pmap", (8, 1), False), ("pmap", (8,), False),
    ("sharded", (8,), True), ("sharded", (4, 2), False),
    ("shard_map", (8,), True), ("shard_map", (4, 2), False),
    ("single", (8,), True), ("single", (4, 2), False),
])
def test_checked_tells_the_layout_from_the_mask(devices, strategy, shape, ok):
    mesh = loaders.data_mesh(devices[:4])
    host = batch(shape)
    if ok:
        [got] = list(strategies.checked([host], strategy, mesh))
        for key in host:
            assert_same_bits(np.asarray(got[key]), host[key], key)
            if strategy != "single":  # host arrays placed on the mesh, sharded on 'data'
                assert got[key].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), host[key].ndim), key
    else:
        with pytest.raises(ValueError, match=f"strategy '{strategy}' needs batches in layout "
                                             f"'{strategies.LAYOUT[strategy]}'.*mask of shape {re.escape(str(shape))}"):
            list(strategies.checked([host], strategy, mesh))


def test_checked_reads_no_key_but_mask(devices):
    # Datasets of named arrays: "labels" of any shape (per-token targets), or absent.
    mesh = loaders.data_mesh(devices[:2])
    tokens = {"tokens": np.zeros((4, 48), np.int32), "targets": np.zeros((4, 48), np.int32),
              "mask": np.ones(4, bool)}
    [got] = list(strategies.checked([tokens], "sharded", mesh))
    assert set(got) == set(tokens)
    with pytest.raises(ValueError, match="has no 'mask'.*keys \\['images', 'labels'\\]"):
        list(strategies.checked([{"images": np.zeros(4), "labels": np.zeros(4)}], "sharded", mesh))


def test_checked_refuses_a_batch_on_other_devices(devices):
    mesh = loaders.data_mesh(devices[:2])
    elsewhere = loaders.data_mesh(devices[2:4])
    good = loaders.global_batch_from_rows(batch((4,)), mesh)
    bad = loaders.global_batch_from_rows(batch((4,)), elsewhere)
    assert len(list(strategies.checked([good], "sharded", mesh))) == 1
    with pytest.raises(ValueError, match="at step 1 lives on .* not on the mesh's devices"):
        list(strategies.checked([good, bad], "sharded", mesh))


def test_checked_refuses_a_batch_not_sharded_on_data(devices):
    # Replicated on the mesh's own devices: every device would compute every row.
    mesh = loaders.data_mesh(devices[:2])
    replicated = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in batch((4,)).items()}
    with pytest.raises(ValueError, match=r"batch\['images'\] at step 0 has sharding .*not NamedSharding\(mesh, P\('data'\)\)"):
        list(strategies.checked([replicated], "sharded", mesh))


def test_checked_refuses_host_arrays_across_processes(devices, monkeypatch):
    mesh = loaders.data_mesh(devices[:2])
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"batch\['images'\] at step 0 is a host array .*2 processes.*"
                                         r"global_batch_from_rows"):
        list(strategies.checked([batch((4,))], "sharded", mesh))


# --------------------------------------------------------------------------
# The counts, pinned: what ulp_bound's docstring derives
# --------------------------------------------------------------------------


def derived_count(a: str, b: str, gpu: bool, n: int) -> int:
    """ulp_bound's docstring, read again: stages whose order differs, 1 ulp each a step;
    a library-ordered all-reduce is n - 1 more (GPUs only)."""
    if a == b:
        return 0
    pair = {a, b}
    if "single" in pair:  # one pass vs per-device sums + the reduction of n partial sums
        return 1 + 1 + (n - 1 if gpu else 0)
    if pair == {"pmap", "shard_map"}:  # the same program; on GPUs the reduction's order, n
        return n if gpu else 0
    return n if gpu else 1  # sharded vs pmap/shard_map: XLA's own partition (+ the reduction)


@pytest.mark.parametrize("platform", ["cpu", "gpu", "cuda", "rocm"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_ulp_bound_returns_exactly_the_derived_counts(platform, n):
    names = list(strategies.STRATEGIES)
    table = {(a, b): strategies.ulp_bound(a, b, platform, n) for a in names for b in names}
    want = {(a, b): derived_count(a, b, platform != "cpu", n) for a in names for b in names}
    assert table == want
    if platform == "cpu":  # the whole CPU table, as the docstring states it
        assert [table["pmap", "shard_map"], table["sharded", "pmap"], table["sharded", "shard_map"],
                table["sharded", "single"], table["pmap", "single"], table["shard_map", "single"]] == [0, 1, 1, 2, 2, 2]


# --------------------------------------------------------------------------
# Growth and verdict: the bound from the count and the measured growth
# --------------------------------------------------------------------------


def growth(*rows, off_centre=0.0):
    """A Growth of one leaf: each row one twin's distances after steps 0..T; the unit the
    params' own (scale 0)."""
    return strategies.Growth(np.array(rows, np.float64)[:, None, :], off_centre, np.zeros(1))


def test_no_growth_gives_the_count_times_the_steps():
    for steps in (1, 4, 120):
        flat = growth([64.0] * (steps + 1), [64.0] * (steps + 1))
        assert flat.factors().tolist() == [[1.0] * steps]
        assert flat.bound(2) == [2 * steps] and flat.bound(1) == [steps] and flat.bound(0) == [0]
        assert flat.outside() is None


def test_growth_factors_are_the_largest_later_distance_over_this_one():
    # e = 64, 128, 96, 512: a difference after step 1 (128) grows to at most 512 (x4),
    # after step 2 (96) to 512 (x5.33), after step 3 stays (x1); the other twin grows less.
    g = growth([64, 128, 96, 512], [64, 64, 64, 128])
    np.testing.assert_array_equal(g.factors(), [[4.0, 512 / 96, 1.0]])
    assert g.bound(2) == [2 * (4.0 + 512 / 96 + 1.0)]
    shrinking = growth([64, 32, 16, 8], [64, 32, 16, 8])  # contraction: never below 1
    assert shrinking.factors().tolist() == [[1.0, 1.0, 1.0]] and shrinking.bound(3) == [9]
    # Leaf by leaf: each leaf's bound from its own growth.
    two = strategies.Growth(np.array([[[64, 64, 64], [64, 128, 256]]] * 2, np.float64), 0.0, np.zeros(2))
    np.testing.assert_array_equal(two.bound(2), [2 * (1 + 1), 2 * (2 + 1)])


def test_the_domain_ends_where_the_doc_says():
    inside = growth([64, 200], [64, 200], off_centre=strategies.MAX_OFF_CENTRE)
    assert inside.outside() is None and inside.bound(2) == [2]
    skewed = growth([64, 200], [64, 200], off_centre=np.nextafter(strategies.MAX_OFF_CENTRE, 1))
    assert "not linearly" in skewed.outside() and skewed.bound(2) is None
    assert skewed.bound(0) == [0]  # the same program: no rounding to propagate
    calm = growth([64, 64], [64, 40], off_centre=0.9)  # off centre, but nothing grew
    assert calm.outside() is None
    big = strategies.MAX_TWIN_ULPS
    assert growth([64, big], [64, big]).outside() is None
    assert "beyond 65536" in growth([64, np.nextafter(big, np.inf)], [64, 64]).outside()
    assert "met the reference" in growth([64, 0, 5], [64, 64, 64]).outside()
    assert growth([64, 0, 0], [64, 64, 64]).outside() is None


def test_verdict_cases_and_their_words():
    a = [np.array([1.0, 2.0], np.float32)]
    near = [np.array([1.0, 2.0 + 10 * 2.0**-22], np.float32)]  # 10 ulps of 2.0
    flat4 = growth([64] * 5, [64] * 5)  # 4 steps, nothing grows: the bound is count x 4
    assert strategies.verdict(a, a, 2, None).case == "identical"
    within = strategies.verdict(a, near, 3, flat4)  # 10 <= 12
    assert within.case == "within" and within.bound == 12 and within.ulps == 10
    assert "10.0 ulps after 4 steps, within the documented bound of 12 ulps" in within.text
    # The unit is the ulp of the largest magnitude the leaf held (growth.scale): at 4.0, 5 ulps.
    held = strategies.Growth(flat4.distances, 0.0, np.array([4.0]))
    assert strategies.verdict(a, near, 3, held).ulps == 5
    outside = strategies.verdict(a, near, 2, flat4)  # 10 > 8
    assert outside.case == "OUTSIDE" and "OUTSIDE the documented bound of 8 ulps" in outside.text
    assert strategies.verdict(a, near, 0, None).case == "OUTSIDE"  # the same program
    lost = strategies.verdict(a, near, 2, growth([64] * 5, [64, 128, 1e6, 1e6, 1e6], off_centre=0.9))
    assert lost.case == "outside the domain" and lost.bound is None
    assert "outside the domain where a bound is derived" in lost.text
    assert strategies.verdict(a, [np.array([1.0, np.nan], np.float32)], 2, flat4).case == "OUTSIDE"
    with pytest.raises(ValueError, match="need the measured growth"):
        strategies.verdict(a, near, 2, None)
    # No growth measured: within count x steps is within whatever the growth (every G >= 1).
    close = strategies.verdict(a, near, 3, None, steps=4)
    assert close.case == "within" and close.bound == 12 and "no growth had to be measured" in close.text
    with pytest.raises(ValueError, match="need the measured growth"):
        strategies.verdict(a, near, 2, None, steps=4)  # 10 > 8: only the growth can tell
    with pytest.raises(ValueError, match="steps=5, but the growth was measured over 4 steps"):
        strategies.verdict(a, near, 2, flat4, steps=5)


# --------------------------------------------------------------------------
# twin_growth: measured on a model whose growth is known exactly
# --------------------------------------------------------------------------


H = np.array([0.0, 1.0, 0.25], np.float32)  # curvature per entry: 0 keeps the leaf's largest


def quadratic_terms(params, batch):
    """0.5 * sum(H p^2) per real sample: grad = H p, so SGD maps p to (1 - lr H) p."""
    mask = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask) * 0.5 * jnp.sum(H * params["p"] ** 2), jnp.sum(mask)


@pytest.mark.parametrize("rate, per_step", [(3.0, 2.0), (0.5, 1.0)], ids=["doubling", "contracting"])
def test_twin_growth_measures_a_known_growth(devices, rate, per_step):
    # lr 3: entry 1 becomes -2 x itself each step (exact in float32), entry 0 (1.0,
    # curvature 0) keeps the unit, so a 64-ulp difference doubles every step. lr 0.5:
    # every entry shrinks or stays, the difference stays at 64 (entry 0).
    mesh = loaders.data_mesh(devices[:2])
    steps = 6
    params = {"p": np.array([1.0, 2.0**-10, 2.0**-12], np.float32)}
    host = {"mask": np.ones(16, bool)}
    g = strategies.twin_growth(params, [host] * steps, mesh, loss_terms=quadratic_terms,
                               optimizer=strategies.sgd(rate))
    want = 64 * per_step ** np.arange(steps + 1)
    np.testing.assert_array_equal(g.distances, [[want], [want]])
    assert g.off_centre == 0.0 and g.scale.tolist() == [1.0]  # linear: the twins end exactly opposite
    np.testing.assert_array_equal(g.factors(), [per_step ** np.arange(steps - 1, -1, -1)])
    assert g.bound(2) == [2 * sum(per_step ** k for k in range(steps))]


# --------------------------------------------------------------------------
# Refused with the contract in the message
# --------------------------------------------------------------------------


def linear_terms(params, batch):
    logits = batch["x"] @ params["w"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], axis=1)[:, 0]
    mask = batch["mask"].astype(logits.dtype)
    return jnp.sum(mask * nll), jnp.sum(mask)


def tiny_batches(n: int, steps: int = 2, dtype=np.float32):
    rng = np.random.default_rng(5)
    return [{"x": rng.standard_normal((4 * n, 6)).astype(dtype), "y": rng.integers(0, 3, 4 * n).astype(np.int32),
             "mask": np.arange(4 * n) % 3 != 2} for _ in range(steps)]


def tiny_params(dtype=np.float32):
    return {"w": (0.3 * np.random.default_rng(6).standard_normal((6, 3))).astype(dtype)}


def for_layout(name: str, batches: list, n: int):
    if strategies.LAYOUT[name] == "pmap":
        return [{k: v.reshape((n, -1) + v.shape[1:]) for k, v in b.items()} for b in batches]
    return batches


def test_float64_params_without_x64_are_refused(devices):
    mesh = loaders.data_mesh(devices[:2])
    for name, train in strategies.STRATEGIES.items():
        with pytest.raises(ValueError, match=rf"strategy '{name}': params: leaf \['w'\] is float64, which "
                                             r"JAX would silently train as float32 because jax_enable_x64 is off; "
                                             r"cast it .*jax_enable_x64', True"):
            train(tiny_params(np.float64), for_layout(name, tiny_batches(2), 2), mesh, loss_terms=linear_terms)
    with pytest.raises(ValueError, match=r"strategies.replicate: leaf \[0\] is int64"):
        strategies.replicate([np.arange(3)], mesh)
    strategies.replicate([np.float32(1), 0.5, 3], mesh)  # float32 and Python scalars pass


def test_float64_params_train_in_float64_with_x64_on(devices):
    mesh = loaders.data_mesh(devices[:2])
    with jax.enable_x64(True):  # shard_map places its state as sharded does (replicate)
        for name, train in [(name, strategies.STRATEGIES[name]) for name in ("sharded", "pmap", "single")]:
            wide = train(tiny_params(np.float64), for_layout(name, tiny_batches(2, dtype=np.float64), 2), mesh,
                         loss_terms=linear_terms, optimizer=strategies.sgd(0.5))
            w = wide.params["w"]
            assert w.dtype == np.float64 and wide.losses.dtype == np.float64, name
            # Computed in float64, not in float32 and widened: float32 cannot hold these values.
            assert (w != w.astype(np.float32)).mean() > 0.9, (name, w)


@pytest.mark.parametrize("returned, said", [
    (lambda total, count: total / count, r"got one array of shape \(\) \(a mean\? return the sum and the count\)"),
    (lambda total, count: (total * jnp.ones(3), count), r"got total of shape \(3,\) and count of shape \(\)"),
    (lambda total, count: (total, count, count), r"got a tuple of length 3"),
])
def test_a_loss_terms_that_breaks_its_contract_is_refused(devices, returned, said):
    mesh = loaders.data_mesh(devices[:2])
    broken = lambda params, batch: returned(*linear_terms(params, batch))
    for name, train in strategies.STRATEGIES.items():
        with pytest.raises(TypeError, match=r"loss_terms\(params, batch\) must return \(total, count\).*" + said):
            train(tiny_params(), for_layout(name, tiny_batches(2, steps=1), 2), mesh, loss_terms=broken)


def test_an_optimizer_that_breaks_its_contract_is_refused(devices):
    mesh = loaders.data_mesh(devices[:2])
    with pytest.raises(TypeError, match="optimizer must have init\\(params\\) and update"):
        strategies.sharded(tiny_params(), tiny_batches(2), mesh, loss_terms=linear_terms, optimizer=0.1)
    lost = strategies.Optimizer(lambda p: {}, lambda g, s, p: ([g["w"]], s))  # updates of another structure
    with pytest.raises(TypeError, match=r"optimizer.update\(grads, state, params\) must return \(updates, "
                                        r"new_state\) as optax does.*got updates"):
        strategies.sharded(tiny_params(), tiny_batches(2), mesh, loss_terms=linear_terms, optimizer=lost)


# --------------------------------------------------------------------------
# stack_losses: any pytree of values
# --------------------------------------------------------------------------


def test_stack_losses_stacks_any_pytree(devices):
    mesh = loaders.data_mesh(devices[:2])
    replicated = NamedSharding(mesh, P())
    values = [{"loss": jax.device_put(np.float32(t), replicated), "hits": jax.device_put(np.int32(3 * t), devices[0]),
               "per_class": np.array([t, t + 1], np.float32)} for t in range(4)]
    got = strategies.stack_losses(values)
    assert_same_bits(got["loss"], np.arange(4, dtype=np.float32), "loss")
    assert_same_bits(got["hits"], 3 * np.arange(4, dtype=np.int32), "hits")
    assert_same_bits(got["per_class"], np.stack([np.arange(4), np.arange(1, 5)], 1).astype(np.float32), "per_class")
    assert_same_bits(strategies.stack_losses([jax.device_put(np.float32(2), replicated)]), np.float32([2]))
    assert strategies.stack_losses([]).shape == (0,)
    sharded = jax.device_put(np.arange(2, dtype=np.float32), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"is sharded .*pass one replica"):
        strategies.stack_losses([sharded])
