"""equivalence.py and the harness's centre: the four strategies (strategies.py) train
to the same parameters, within the bound equivalence.verdict derives.

Guarantees checked:

* every pair of strategies ends within ``ulp_bound``'s count x the steps of each
  other after 1-8 steps at rates up to 0.5, masks included (devices holding only
  padding too), on 1, 3 and 8 devices: pmap and shard_map bit-identical on CPU on
  these two models (every leaf used once), sharded within 1 ulp a step of them, all
  within 2 of ``single``. That is the stricter form of the bound
  ``equivalence.verdict`` derives (count x the sum of the measured growth, each
  factor >= 1), in this test's domain. A leaf used twice (a tied weight) makes pmap
  and shard_map add in another order: their count is 1, and 0 would call them OUTSIDE.
* ReLU models and adaptive rules: on a ReLU MLP the twins cross kinks and the final
  params get "outside the domain" naming kinks and the routes that answer, never
  OUTSIDE; ``stepwise_verdict`` calls the planted bugs (one device's gradient x
  1.001, a dropped device, a division by the local count) OUTSIDE there at ordinary
  rates; under Adam pmap and shard_map are bit-identical (one update program) and no
  pair gets a count for its params. The drawn soak (``--run-slow``: ReLU, GELU and
  attention models; sgd, momentum, adam, adamw, a clipping chain; ordinary and chaotic
  rates) finds no correct pair OUTSIDE in either verdict, and every planted bug OUTSIDE
  step by step at ordinary rates; so does the issue's ReLU MLP at lr 0.02, 0.1, 0.5.
* the verdict is true at any rate, on the issue's token model (token ids (N, 48),
  vocabulary 500, embedding + mean pool + linear, 5 classes, a dict of params; 120
  steps) and the MLP (40 steps): within the growth-scaled bound at the rates that
  hold (token lr 5, MLP lr 0.5), "outside the domain where a bound is derived" at
  the rates where a difference grows chaotically (token lr 20, MLP lr 5; lr 40 in
  ``python test_equivalence.py rates``),
  never OUTSIDE for a correct pair, never "within" for a dropped device.
* negative controls: a strategy that drops one device's gradient and one whose
  gradient is off by a relative 1e-6 are OUTSIDE at the small rates (token lr 5
  and 10, MLP lr 0.5 and 1, 2 steps, CPU; a 1e-6 gradient error moves the params by
  about 8 units x lr |g| / |p| a step, so over long runs it stays inside a
  rounding-sized bound: ``python test_equivalence.py rates``); the notebooks'
  ``pmean(grads)`` with uneven masks and the shard_map port that trains with n
  times the gradient.
* end to end: one epoch of the real loader (dataset resident on the devices,
  1000 images, 32 steps of 8 x 4) gives equal params and equal test accuracy
  with every strategy (the placements' batches are bit-identical:
  test_loaders.py); the MLP is the small one here (the same code, a 3072-wide
  input); refimpl.py trains the notebooks' full-size MLP in test_refimpl.py
  (and through every strategy by default, the README's first command).
* any model: the property test draws the model too, from two shapes passed in
  as pure functions: the notebooks' MLP over images (a list of (w, b)) and a
  linear softmax over 40 float features with 3 classes (a dict of params).
* optax as it is (``pytest.importorskip``): optax.sgd gives strategies.sgd's bits,
  optax.adam and an optax chain (clipping, then SGD with momentum 0.9) train through
  all four strategies within their measured drift, and an optimizer state passed
  back in is the one continued (momentum's velocity, Adam's moments).
* equivalence.py's parts. ``ulps_apart`` is the measure every equivalence test
  and refimpl's final report rely on, so it is checked against an independent
  count in exact rationals, leaf by leaf. ``ulp_bound``'s counts are pinned, CPU
  and GPU, 1, 3 and 8 devices, as its docstring derives them (a looser count is
  a bug too), with momentum and adaptive rules; ``Growth`` and ``verdict`` against
  hand-computed bounds and every edge of the domain (the tangent's too: kinks and
  chaos told apart); the growth and no-growth paths agree on drawn pairs.
  ``twin_growth`` on a model whose growth is known exactly (a quadratic whose one
  entry doubles each step: the twins' distance, and the tangent's, must double
  too), with a contracting control; ``twin_growth`` and ``stepwise_distances``
  against NumPy re-computations of their docstrings on models where every number
  is exact (dyadic values, counts 1, 4 and 8): leaves of three dtypes and an empty
  one, a twin that rounds where the other does not, coupled entries, an optimizer
  state that is not init's, a one-sided ReLU kink, a batch of one real row.

strategies.py's mechanics (checked, where each strategy runs, the refusals,
train_loop, donation): test_strategies.py. The models and batches both files use
(linear_loss_terms, host_batches, place, train, ...) are conftest's.
"""

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import equivalence
import loaders
import model
import strategies
from cifar_mnist import TEST_PREFIX
from conftest import (B, CLASSES, MODELS, SMALL_LAYERS, assert_params_close, assert_same_bits, examples,
                      host_batches, linear_init, linear_loss_terms, place, train)


COUNTS = (1, 3, 8)  # device counts: one device, an odd count, the full 8


VOCABULARY, TOKENS, EMBED, TOKEN_CLASSES = 500, 48, 16, 5  # the issue's token model


def token_loss_terms(params: dict, batch: dict):
    """The issue's model: embedding (500, 16) of token ids (B, 48), mean pool, linear to 5 classes."""
    pooled_BxE = jnp.mean(params["embed"][batch["tokens"]], axis=1)
    logits_BxC = pooled_BxE @ params["w"] + params["b"]
    nll_B = -jnp.take_along_axis(jax.nn.log_softmax(logits_BxC), batch["labels"][:, None], axis=1)[:, 0]
    mask_B = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask_B * nll_B), jnp.sum(mask_B)


def token_init() -> dict:
    rng = np.random.default_rng(0)
    return {"embed": (0.1 * rng.standard_normal((VOCABULARY, EMBED))).astype(np.float32),
            "w": (0.1 * rng.standard_normal((EMBED, TOKEN_CLASSES))).astype(np.float32),
            "b": np.zeros(TOKEN_CLASSES, np.float32)}


def token_batches(seed: int, steps: int, rows: int) -> list[dict]:
    """Host batches of ``rows`` samples: labels uniform over 5 classes; 30% of a sample's 48
    tokens come from its class's fifth of the vocabulary, the rest from all of it (learnable:
    training converges, to accuracy 1.0 at lr 20 as in the issue)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        labels = rng.integers(0, TOKEN_CLASSES, rows).astype(np.int32)
        own = labels[:, None] * (VOCABULARY // TOKEN_CLASSES) + rng.integers(0, VOCABULARY // TOKEN_CLASSES,
                                                                            (rows, TOKENS))
        tokens = np.where(rng.random((rows, TOKENS)) < 0.3, own, rng.integers(0, VOCABULARY, (rows, TOKENS)))
        out.append({"tokens": tokens.astype(np.int32), "labels": labels, "mask": np.ones(rows, bool)})
    return out


def bound(a: str, b: str, mesh) -> int:
    """Allowed ulps per step between strategies a and b on ``mesh`` (equivalence.ulp_bound)."""
    return equivalence.ulp_bound(a, b, mesh.devices.flat[0].platform, mesh.devices.size)


@pytest.fixture(scope="module", params=COUNTS, ids=lambda c: f"{c}dev")
def count_mesh(request, devices):
    """The policy's first 1, 3 and 8 devices (counts the host lacks are skipped)."""
    if request.param > len(devices):
        pytest.skip(f"needs {request.param} devices, the policy gives {len(devices)}")
    return loaders.data_mesh(devices[:request.param])


def real_counts(n: int):
    """Per-device real-sample counts 0..B, at least one real sample in the global batch."""
    return st.lists(st.integers(0, B), min_size=n, max_size=n).filter(lambda c: sum(c) > 0)


def test_parallel_strategies_agree_and_match_single(count_mesh, small_params):
    mesh = count_mesh
    n = mesh.devices.size
    platform = mesh.devices.flat[0].platform
    initial = {"mlp": small_params, "linear": linear_init()}

    @settings(max_examples=examples(10 if n == 8 else 4))
    @given(seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 8), counts=real_counts(n),
           learning_rate=st.sampled_from([1e-3, 1e-2, 0.1, 0.5]), kind=st.sampled_from(list(MODELS)))
    def check(seed, steps, counts, learning_rate, kind):
        hosts = host_batches(seed, steps, n, counts, kind)
        loss_terms = MODELS[kind][0]
        result = {name: train(name, fn, initial[kind], hosts, learning_rate, mesh, loss_terms)
                  for name, fn in strategies.STRATEGIES.items()}
        names = list(result)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                assert_params_close(result[a][0], result[b][0], steps=steps,
                                    ulps_per_step=bound(a, b, mesh), what=f"{kind}: {a} vs {b}")
        if platform == "cpu":  # every leaf of these two models used once: the same sums (ulp_bound)
            np.testing.assert_array_equal(result["shard_map"][1], result["pmap"][1])
        for name in ("sharded", "pmap", "shard_map"):
            np.testing.assert_allclose(result[name][1], result["single"][1], rtol=1e-5)

    check()


# --------------------------------------------------------------------------
# optax as it is: stateful and non-linear update rules (equivalence.ulp_bound: what changes)
# --------------------------------------------------------------------------

BETA = 0.9  # optax.sgd's momentum in these tests
OPTAX_RATE = 0.1


@pytest.fixture(scope="module")
def optax_rules():
    """One optimizer object per rule for the whole module (a compiled step is cached on
    its update function: the same object, no new compilation)."""
    optax = pytest.importorskip("optax")
    # The chain: clipping (at a norm these gradients stay under, so it passes them through
    # exactly), then SGD with momentum: optax.sgd(momentum=...) held to its count, in a chain.
    return {"sgd": optax.sgd(OPTAX_RATE), "adam": optax.adam(OPTAX_RATE),
            "chain": optax.chain(optax.clip_by_global_norm(100.0), optax.sgd(OPTAX_RATE, momentum=BETA))}


def largest_difference(a, b) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("rule", ["sgd", "chain", "adam"])
def test_optax_trains_through_every_strategy_as_measured(mesh, optax_rules, rule):
    n, steps = mesh.devices.size, 4
    counts = [B] + [(0, 1, 3, B)[k % 4] for k in range(1, n)]
    hosts = host_batches(seed=21, steps=steps, n=n, real_per_device=counts, kind="linear")
    params0, tx = linear_init(), optax_rules[rule]
    run = {name: train(name, fn, params0, hosts, OPTAX_RATE, mesh, linear_loss_terms, tx)
           for name, fn in strategies.STRATEGIES.items()}
    names = list(strategies.STRATEGIES)
    for name, (_, losses) in run.items():
        assert losses[-1] < losses[0], f"{rule} through {name} does not train: {losses}"
    if rule == "sgd":  # optax.sgd's updates are -(lr * g): strategies.sgd's bits
        for name in names:
            mine = train(name, strategies.STRATEGIES[name], params0, hosts, OPTAX_RATE, mesh, linear_loss_terms)[0]
            for i, (x, y) in enumerate(zip(jax.tree.leaves(run[name][0]), jax.tree.leaves(mine))):
                assert_same_bits(x, y, f"optax.sgd vs strategies.sgd through {name}, leaf {i}")
    if rule == "chain":
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                # ulp_bound / (1 - beta): a gradient difference keeps acting through the velocity.
                assert_params_close(run[a][0], run[b][0], steps=steps, ulps_per_step=bound(a, b, mesh) / (1 - BETA),
                                    what=f"momentum chain: {a} vs {b}")
    if rule == "adam":
        tolerance = 1e-3 * OPTAX_RATE * steps  # Adam, measured: at most 1.5e-5 * lr a step here
        for a in names[:-1]:
            off = largest_difference(run[a][0], run["single"][0])
            assert off <= tolerance, f"adam: {a} vs single differ by {off:.3g}"
        # Control: one real sample with another label is caught by the same tolerance.
        changed = [dict(h) for h in hosts]
        changed[0]["labels"] = changed[0]["labels"].copy()
        changed[0]["labels"][np.flatnonzero(changed[0]["mask"])[0]] += 1
        changed[0]["labels"] %= CLASSES
        other = train("single", strategies.single, params0, changed, OPTAX_RATE, mesh, linear_loss_terms, tx)[0]
        assert largest_difference(other, run["single"][0]) > tolerance
        # One update program for every strategy: pmap and shard_map hand it the same gradient
        # (each leaf used once), so Adam's params are the same bits (they were not while the
        # update was fused into each step: XLA contracted Adam's moments into other FMAs).
        for i, (x, y) in enumerate(zip(jax.tree.leaves(run["pmap"][0]), jax.tree.leaves(run["shard_map"][0]))):
            assert_same_bits(x, y, f"adam: pmap vs shard_map, leaf {i}")
        # No count for Adam's params: identical, or no verdict said so; never OUTSIDE, never within.
        platform = mesh.devices.flat[0].platform
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                count = equivalence.ulp_bound(a, b, platform, n, adaptive=True)
                found = equivalence.verdict(run[a][0], run[b][0], count, None, steps=steps)
                assert found.case in ("identical", "outside the domain"), found.text
                assert found.case == "identical" or "no count is derived" in found.text
        assert found.case == "outside the domain"  # shard_map vs single: not the same bits


def test_an_optimizer_state_passed_back_in_is_the_one_continued(mesh, optax_rules):
    # Epochs chain by passing (params, opt_state) back: 2 steps + 2 steps is 4 steps, bit
    # for bit, momentum's velocity and Adam's moments included, in every strategy.
    n = mesh.devices.size
    hosts = host_batches(seed=22, steps=4, n=n, real_per_device=[B] * n, kind="linear")
    for rule in ("chain", "adam"):
        tx = optax_rules[rule]
        for name, fn in strategies.STRATEGIES.items():
            placed = [place(h, mesh, strategies.LAYOUT[name]) for h in hosts]
            whole = fn(linear_init(), placed, mesh, loss_terms=linear_loss_terms, optimizer=tx)
            first = fn(linear_init(), placed[:2], mesh, loss_terms=linear_loss_terms, optimizer=tx)
            second = fn(first.params, placed[2:], mesh, loss_terms=linear_loss_terms, optimizer=tx,
                        opt_state=first.opt_state)
            for what, x, y in [("params", whole.params, second.params), ("state", whole.opt_state, second.opt_state)]:
                for i, (u, v) in enumerate(zip(jax.tree.leaves(x), jax.tree.leaves(y))):
                    assert_same_bits(v, u, f"{rule} through {name}, {what} leaf {i}")
            # Control: a fresh state at step 2 (what ignoring opt_state does) ends elsewhere.
            restarted = fn(first.params, placed[2:], mesh, loss_terms=linear_loss_terms, optimizer=tx)
            assert largest_difference(restarted.params, whole.params) > 1e-6, (rule, name)


# --------------------------------------------------------------------------
# equivalence.py's parts: the measure, the counts, the growth and the verdict
# --------------------------------------------------------------------------


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
    got = equivalence.ulps_apart(a, b)
    want = exact_ulps_apart(jax.tree.leaves(a), jax.tree.leaves(b))
    assert got == float(want)


def test_ulps_apart_sees_a_difference_in_any_leaf():
    a = [np.array([1.0, 2.0], np.float32), np.array([4.0], np.float32)]
    b = [np.array([1.0 + 3 * 2.0**-22, 2.0], np.float32), np.array([4.0], np.float32)]
    assert equivalence.ulps_apart(a, b) == 3.0  # 2.0's ulp is 2**-22: 3 ulps, in the first leaf
    assert equivalence.ulps_apart(b, a) == 3.0
    assert equivalence.ulps_apart(a, a) == 0.0  # control: no difference, no ulps


def test_ulps_apart_takes_the_worst_leaf():
    a = [np.array([1.0], np.float32), np.array([1.0], np.float32), np.array([1.0], np.float32)]
    b = [np.array([1.0 + 5 * 2.0**-23], np.float32), np.array([1.0 + 2.0**-23], np.float32),
         np.array([1.0], np.float32)]
    assert equivalence.ulps_apart(a, b) == 5.0


@pytest.mark.parametrize("where", [0, 1, 2], ids=["first leaf", "middle leaf", "last leaf"])
def test_ulps_apart_is_nan_when_any_leaf_holds_a_nan_and_0_without_leaves(where):
    # The largest of leaf_ulps, which is NaN where a NaN meets a number: a NaN in any leaf
    # (each position, a NaN on either side) makes the whole measure NaN; no leaves, 0.
    a = [np.array([1.0, 2.0], np.float32) for _ in range(3)]
    b = [x.copy() for x in a]
    b[where][1] = np.nan
    assert np.isnan(equivalence.ulps_apart(a, b)) and np.isnan(equivalence.ulps_apart(b, a))
    assert equivalence.ulps_apart(a, a) == 0.0
    assert equivalence.ulps_apart([], []) == 0.0


# --------------------------------------------------------------------------
# The counts, pinned: what ulp_bound's docstring derives
# --------------------------------------------------------------------------


def derived_count(a: str, b: str, gpu: bool, n: int) -> int:
    """ulp_bound's docstring, read again: stages whose order or compilation differs, 1 ulp
    each a step; a library-ordered all-reduce is n - 1 more (GPUs only)."""
    if a == b:
        return 0
    pair = {a, b}
    if "single" in pair:  # one pass vs per-device sums + the reduction of n partial sums
        return 1 + 1 + (n - 1 if gpu else 0)
    if pair == {"pmap", "shard_map"}:  # two autodiff programs, compiled apart; on GPUs the reduction's order, n
        return n if gpu else 1
    return n if gpu else 1  # sharded vs pmap/shard_map: XLA's own partition (+ the reduction)


@pytest.mark.parametrize("platform", ["cpu", "gpu", "cuda", "rocm"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_ulp_bound_returns_exactly_the_derived_counts(platform, n):
    names = list(strategies.STRATEGIES)
    table = {(a, b): equivalence.ulp_bound(a, b, platform, n) for a in names for b in names}
    want = {(a, b): derived_count(a, b, platform != "cpu", n) for a in names for b in names}
    assert table == want
    if platform == "cpu":  # the whole CPU table, as the docstring states it
        assert [table["pmap", "shard_map"], table["sharded", "pmap"], table["sharded", "shard_map"],
                table["sharded", "single"], table["pmap", "single"], table["shard_map", "single"]] == [1, 1, 1, 2, 2, 2]


def test_ulp_bound_for_momentum_and_for_adaptive_rules():
    # Momentum: a gradient difference reaches the params with total weight 1 / (1 - beta);
    # an adaptive rule (Adam): no count for the params of a pair whose gradients may differ.
    for a, b in [("sharded", "single"), ("pmap", "shard_map"), ("sharded", "pmap")]:
        plain = equivalence.ulp_bound(a, b, "cpu", 8)
        assert equivalence.ulp_bound(a, b, "cpu", 8, momentum=0.9) == pytest.approx(plain / (1 - 0.9))
        assert equivalence.ulp_bound(a, b, "cpu", 8, momentum=0.5) == 2 * plain
        assert equivalence.ulp_bound(a, b, "cpu", 8, adaptive=True) is None
        assert equivalence.ulp_bound(a, b, "gpu", 8, adaptive=True) is None
    assert equivalence.ulp_bound("pmap", "pmap", "cpu", 8, adaptive=True) == 0  # the same program
    assert equivalence.ulp_bound("single", "single", "cpu", 8, momentum=0.9) == 0
    for beta in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=f"momentum={beta}"):
            equivalence.ulp_bound("sharded", "single", "cpu", 8, momentum=beta)


# --------------------------------------------------------------------------
# Growth and verdict: the bound from the count and the measured growth
# --------------------------------------------------------------------------


def growth(*rows, off_centre=0.0):
    """A Growth of one leaf: each row one twin's distances after steps 0..T; the unit the
    params' own (scale 0)."""
    return equivalence.Growth(np.array(rows, np.float64)[:, None, :], off_centre, np.zeros(1))


def test_no_growth_gives_the_count_times_the_steps():
    for steps in (1, 4, 120):
        flat = growth([64.0] * (steps + 1), [64.0] * (steps + 1))
        np.testing.assert_array_equal(flat.factors(), [[1.0] * steps])
        assert flat.bound(2) == [2 * steps] and flat.bound(1) == [steps] and flat.bound(0) == [0]
        assert flat.outside() is None


def test_growth_factors_are_the_largest_later_distance_over_this_one():
    # e = 64, 128, 96, 512: a difference after step 1 (128) grows to at most 512 (x4),
    # after step 2 (96) to 512 (x5.33), after step 3 stays (x1); the other twin grows less.
    g = growth([64, 128, 96, 512], [64, 64, 64, 128])
    np.testing.assert_array_equal(g.factors(), [[4.0, 512 / 96, 1.0]])
    assert g.bound(2) == [2 * (4.0 + 512 / 96 + 1.0)]
    shrinking = growth([64, 32, 16, 8], [64, 32, 16, 8])  # contraction: never below 1
    np.testing.assert_array_equal(shrinking.factors(), [[1.0, 1.0, 1.0]])
    assert shrinking.bound(3) == [9]
    # Leaf by leaf: each leaf's bound from its own growth.
    two = equivalence.Growth(np.array([[[64, 64, 64], [64, 128, 256]]] * 2, np.float64), 0.0, np.zeros(2))
    np.testing.assert_array_equal(two.bound(2), [2 * (1 + 1), 2 * (2 + 1)])


def test_the_domain_ends_where_the_doc_says():
    inside = growth([64, 200], [64, 200], off_centre=equivalence.MAX_OFF_CENTRE)
    assert inside.outside() is None and inside.bound(2) == [2]
    skewed = growth([64, 200], [64, 200], off_centre=np.nextafter(equivalence.MAX_OFF_CENTRE, 1))
    assert "not linearly" in skewed.outside() and skewed.bound(2) is None
    assert skewed.bound(0) == [0]  # the same program: no rounding to propagate
    calm = growth([64, 64], [64, 40], off_centre=0.9)  # off centre, but nothing grew
    assert calm.outside() is None
    big = equivalence.MAX_TWIN_ULPS
    assert growth([64, big], [64, big]).outside() is None
    assert "beyond 65536" in growth([64, np.nextafter(big, np.inf)], [64, 64]).outside()
    assert "met the reference" in growth([64, 0, 5], [64, 64, 64]).outside()
    assert growth([64, 0, 0], [64, 64, 64]).outside() is None


def with_tangent(rows, tangent, off_centre=0.0):
    """A Growth of one leaf, as ``growth``, with the linearised difference measured."""
    return equivalence.Growth(np.array(rows, np.float64)[:, None, :], off_centre, np.zeros(1),
                              np.array([tangent], np.float64))


def test_the_tangent_tells_kinks_from_chaos():
    # The twins must follow the linearised training: at most KINK_RATIO x its largest
    # distance, + 1 a step (2 steps here), or the training has kinks at this scale.
    edge = equivalence.KINK_RATIO * 100 + 2
    followed = with_tangent([[64, 90, edge], [64, 64, 64]], [64, 80, 100])
    assert followed.outside() is None and followed.bound(1) is not None
    kinked = with_tangent([[64, 90, np.nextafter(edge, np.inf)], [64, 64, 64]], [64, 80, 100])
    assert kinked.bound(1) is None and kinked.bound(0) == [0]
    assert "more than 2 x its linearisation's 100" in kinked.outside()
    assert "kinks, the training is not differentiable at the scale of rounding" in kinked.outside()
    assert growth([64, 90, np.nextafter(edge, np.inf)], [64, 64, 64]).outside() is None  # no tangent: no edge
    # The old edges, with the cause named: twins beyond 2**16 or off centre while the
    # derivative grew little are kinks; a derivative beyond 2**16 too is chaos.
    assert "kinks" in with_tangent([[64, 1e6], [64, 1e6]], [64, 500]).outside()
    chaos = with_tangent([[64, 1e6], [64, 1e6]], [64, 2e6]).outside()
    assert "beyond 65536" in chaos and "chaos" in chaos and "kinks" not in chaos
    skewed = with_tangent([[64, 200], [64, 200]], [64, 180], off_centre=0.9).outside()
    assert "not linearly" in skewed and "kinks" not in skewed  # near its derivative: non-linear, no cause named
    assert "kinks" in with_tangent([[64, 400], [64, 200]], [64, 100], off_centre=0.9).outside()


def test_verdict_cases_and_their_words():
    a = [np.array([1.0, 2.0], np.float32)]
    near = [np.array([1.0, 2.0 + 10 * 2.0**-22], np.float32)]  # 10 ulps of 2.0
    flat4 = growth([64] * 5, [64] * 5)  # 4 steps, nothing grows: the bound is count x 4
    assert equivalence.verdict(a, a, 2, None).case == "identical"
    within = equivalence.verdict(a, near, 3, flat4)  # 10 <= 12
    assert within.case == "within" and within.bound == 12 and within.ulps == 10
    assert "10.0 ulps after 4 steps, within the documented bound of 12 ulps" in within.text
    # The unit is the ulp of the largest magnitude the leaf held (growth.scale): at 4.0, 5 ulps
    # (10 of its own, beyond 2 x 4: the growth's unit decides).
    held = equivalence.Growth(flat4.distances, 0.0, np.array([4.0]))
    found = equivalence.verdict(a, near, 2, held)
    assert found.ulps == 5 and found.case == "within" and found.bound == 8
    outside = equivalence.verdict(a, near, 2, flat4)  # 10 > 8
    assert outside.case == "OUTSIDE" and "OUTSIDE the documented bound of 8 ulps" in outside.text
    assert equivalence.verdict(a, near, 0, None).case == "OUTSIDE"  # the same program
    lost = equivalence.verdict(a, near, 2, growth([64] * 5, [64, 128, 1e6, 1e6, 1e6], off_centre=0.9))
    assert lost.case == "outside the domain" and lost.bound is None
    assert "outside the domain where a bound is derived" in lost.text
    assert equivalence.verdict(a, [np.array([1.0, np.nan], np.float32)], 2, flat4).case == "OUTSIDE"
    with pytest.raises(ValueError, match="need the measured growth"):
        equivalence.verdict(a, near, 2, None)
    # No growth measured: within count x steps is within whatever the growth (every G >= 1).
    close = equivalence.verdict(a, near, 3, None, steps=4)
    assert close.case == "within" and close.bound == 12 and "no growth had to be measured" in close.text
    with pytest.raises(ValueError, match="need the measured growth"):
        equivalence.verdict(a, near, 2, None, steps=4)  # 10 > 8: only the growth can tell
    with pytest.raises(ValueError, match="steps=5, but the growth was measured over 4 steps"):
        equivalence.verdict(a, near, 2, flat4, steps=5)
    # Outside the domain the verdict names the routes that do answer.
    assert "judge each step instead (equivalence.stepwise_verdict" in lost.text
    assert "reduction='canonical'" in lost.text
    # The no-growth test runs first with a growth too: within count x steps is within even
    # where the growth left its domain (10 <= 3 x 4), as without the growth.
    lost_growth = growth([64] * 5, [64, 128, 1e6, 1e6, 1e6], off_centre=0.9)
    first = equivalence.verdict(a, near, 3, lost_growth)
    assert first.case == "within" and first.bound == 12 and "no growth had to be measured" in first.text
    # No count (an adaptive rule): no bound, said so, never OUTSIDE; identical stays identical.
    adaptive = equivalence.verdict(a, near, None, flat4)
    assert adaptive.case == "outside the domain" and adaptive.bound is None
    assert "no count is derived for the params under this update rule" in adaptive.text
    assert "equivalence.stepwise_verdict" in adaptive.text
    assert equivalence.verdict(a, near, None, None, steps=4).case == "outside the domain"
    assert equivalence.verdict(a, a, None, None).case == "identical"


@given(apart=st.integers(0, 40), count=st.sampled_from([1, 2, 3]), steps=st.integers(1, 6),
       final=st.floats(1.0, 1e7), off_centre=st.floats(0.0, 1.0), tangent=st.floats(1.0, 1e7),
       has_tangent=st.booleans())
def test_the_growth_and_no_growth_paths_agree(apart, count, steps, final, off_centre, tangent, has_tangent):
    # Whatever the growth (inside its domain or not), a pair the no-growth test calls within
    # is within with the growth too, and one it cannot judge gets the growth's verdict.
    a = [np.array([1.0, 2.0], np.float32)]
    b = [np.array([1.0, 2.0 + apart * 2.0**-22], np.float32)]
    twins = np.linspace(64.0, final, steps + 1)
    measured = equivalence.Growth(np.stack([twins, twins])[:, None, :], off_centre, np.zeros(1),
                                  np.linspace(64.0, tangent, steps + 1)[None] if has_tangent else None)
    with_growth = equivalence.verdict(a, b, count, measured)
    try:
        alone = equivalence.verdict(a, b, count, None, steps=steps)
    except ValueError:  # further apart than count x steps: only the growth can tell
        assert apart > count * steps and with_growth.case != "identical"
        return
    assert with_growth.case == alone.case and alone.case in ("identical", "within")


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
    g = equivalence.twin_growth(params, [host] * steps, mesh, loss_terms=quadratic_terms,
                               optimizer=strategies.sgd(rate))
    want = 64 * per_step ** np.arange(steps + 1)
    np.testing.assert_array_equal(g.distances, [[want], [want]])
    assert g.off_centre == 0.0  # linear: the twins end exactly opposite
    np.testing.assert_array_equal(g.scale, [1.0])
    np.testing.assert_array_equal(g.factors(), [per_step ** np.arange(steps - 1, -1, -1)])
    assert g.bound(2) == [2 * sum(per_step ** k for k in range(steps))]
    np.testing.assert_array_equal(g.tangent, [want])  # the derivative of a linear step: the twins exactly
    assert g.outside() is None


# --------------------------------------------------------------------------
# twin_growth and stepwise_distances against NumPy, on a model where every
# number is exact: what each docstring says, re-computed from it
# --------------------------------------------------------------------------

COUPLE = np.array([1.0, 1.0, 2.0, 1.0], np.float32)  # w's entries meet in one residual: the twins' signs matter
CURVE = np.array([1.0, 2.0], np.float32)  # b's per-entry curvature
DECAY = {"w": 2.0}  # the exact optimizer's weight decay, per leaf (0 where not named)
MOMENTUM = {"w": 1.0}  # and its momentum


def exact_terms(params, batch):
    """Per real row i: 0.5 (w . COUPLE - x_i)^2 + 0.5 sum CURVE (b - y_i)^2; leaves e (empty), h
    (bfloat16) and k untouched by the loss. With dyadic inputs and counts 1, 2, 4 or 8 every
    gradient, in any order of summation, is exact in float32."""
    mask = batch["mask"].astype(jnp.float32)
    residual = params["w"] @ COUPLE - batch["x"]
    per_row = 0.5 * residual ** 2 + 0.5 * jnp.sum(CURVE * (params["b"] - batch["y"]) ** 2, axis=-1)
    return jnp.sum(mask * per_row), jnp.sum(mask)


def exact_optimizer() -> strategies.Optimizer:
    """Learning rate 1 with a per-leaf momentum and weight decay: trace' = MOMENTUM trace + g,
    update -(trace' + DECAY p); its state holds an int counter (no tangent) beside the floats.
    Every operation is exact on exact_terms' numbers."""
    def init(params):
        return {"count": jnp.zeros((), jnp.int32), "trace": jax.tree.map(jnp.zeros_like, params)}

    def update(grads, state, params):
        trace = {k: jnp.asarray(MOMENTUM.get(k, 0.0), g.dtype) * state["trace"][k] + g for k, g in grads.items()}
        updates = {k: -(trace[k] + jnp.asarray(DECAY.get(k, 0.0), trace[k].dtype) * params[k]) for k in trace}
        return updates, {"count": state["count"] + 1, "trace": trace}
    return strategies.Optimizer(init, update)


def exact_start():
    """(params, opt_state): leaf k's largest entry an odd number of ulps below 2, so that a move
    of 64 ulps up rounds (to even, upward) and one down does not: one twin starts 65 ulps out
    there, the other 64."""
    bf16 = jnp.bfloat16
    params = {"b": np.array([0.0, 0.125], np.float32), "e": np.zeros(0, np.float32),
              "h": np.array([1.5, 0.25], bf16), "k": np.array([2 - 2.0**-23, 1.0], np.float32),
              "w": np.array([1.0, -0.5, 0.25, 0.75], np.float32)}
    trace = {k: np.zeros_like(v) for k, v in params.items()}
    trace["w"] = np.array([0.25, 0.0, -0.5, 0.0], np.float32)  # a state that is not init's
    trace["b"] = np.array([0.5, 0.0], np.float32)
    return params, {"count": np.int32(3), "trace": trace}


def exact_hosts():
    """Three global batches of 12 rows (6 a device, two blocks of 3 rows each): 8, 1 and 4 real
    rows, uneven across the devices; y's first column cancels within blocks of 3 rows otherwise
    than within blocks of 2 (the row blocks are told by their sums)."""
    mask = [np.array([1, 1, 1, 1, 1, 0, 1, 1, 1, 0, 0, 0], bool),
            np.array([0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], bool),
            np.array([1, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0], bool)]
    x = [np.array([3, -1, 2, 0, 1, 9, -2, 4, 1, 7, 7, 7]), np.array([0, 0, 0, 0, 0, 0, 0, 0, 2, 5, 5, 5]),
         np.array([1, 3, -1, 0, 0, 0, 2, 2, 0, 0, 0, 0])]
    y = [np.stack([np.array([4, 4, -4, -4, 4, 5, 4, -4, 4, 0, 0, 0]), np.array([0, 2, 0, 2, 0, 0, 2, 2, 0, 0, 0, 0])], -1),
         np.stack([np.full(12, -1), np.full(12, 1)], -1),
         np.stack([np.array([2, 0, 2, 0, 0, 0, -2, 2, 0, 0, 0, 0]), np.array([1, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0])], -1)]
    return [{"x": xs.astype(np.float32), "y": ys.astype(np.float32), "mask": m} for xs, ys, m in zip(x, y, mask)]


def block_sums(p: dict, rows: dict, blocks: int) -> tuple:
    """(g, sum_k |g_k|) in float64 from each row's term of the masked mean's gradient
    (``rows[leaf]``: (rows, ...), already over the batch's count), g_k the sum over row block
    k, ``blocks`` equal blocks of consecutive rows; 0 for a leaf no row touches."""
    g = {k: np.zeros(np.shape(v)) for k, v in p.items()}
    absolute = {k: np.zeros(np.shape(v)) for k, v in p.items()}
    for k, r in rows.items():
        g[k] = r.sum(0)
        absolute[k] = np.abs(r.reshape((blocks, -1) + r.shape[1:]).sum(1)).sum(0)
    return g, absolute


def numpy_gradients(p: dict, host: dict, blocks: int):
    """(g, sum_k |g_k|) of exact_terms' masked mean (``block_sums``)."""
    m, count = host["mask"].astype(np.float64), max(host["mask"].sum(), 1)
    return block_sums(p, {"w": (m * (p["w"] @ COUPLE - host["x"]))[:, None] * COUPLE / count,
                          "b": m[:, None] * CURVE * (p["b"] - host["y"]) / count}, blocks)


def numpy_step(p: dict, trace: dict, g: dict) -> tuple:
    trace = {k: MOMENTUM.get(k, 0.0) * trace[k] + g[k] for k in p}
    updates = {k: -(trace[k] + DECAY.get(k, 0.0) * p[k]) for k in p}
    return {k: p[k] + updates[k] for k in p}, trace, updates


def as_float64(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def assert_exact_in(tree: dict, dtypes: dict):
    """The precondition the NumPy references rest on: every value they computed is a value of
    its leaf's own dtype (nothing JAX computed in that dtype could have rounded)."""
    for k, v in tree.items():
        np.testing.assert_array_equal(np.asarray(v).astype(dtypes[k]).astype(np.float64), v, err_msg=k)


def numpy_twin_growth(params, opt_state, hosts, n: int, ulps=equivalence.TWIN_ULPS, seed=0) -> tuple:
    """twin_growth, re-computed from its docstring and Growth's in float64: (distances, off_centre,
    scale, tangent), and which terms set the scale (params or updates)."""
    names, dtypes = sorted(params), {k: np.asarray(v).dtype for k, v in params.items()}
    rng = np.random.default_rng(seed)
    signs = {k: rng.choice(np.array([-1.0, 1.0]), size=np.shape(params[k])) for k in names}

    def moved(sign):
        out = {}
        for k in names:
            x = np.asarray(params[k])
            unit = np.float64(np.spacing(np.abs(x).max())) if x.size else 0.0
            out[k] = np.asarray(x.astype(np.float64) + sign * ulps * unit * signs[k], np.float64)
            out[k] = out[k].astype(dtypes[k]).astype(np.float64)  # rounded to the leaf's dtype
        return out

    states = [(as_float64(params), as_float64(opt_state["trace"]))] + [(moved(s), as_float64(opt_state["trace"]))
                                                                       for s in (1.0, -1.0)]
    scale = {k: float(np.abs(states[0][0][k]).max(initial=0.0)) for k in names}
    spacing = lambda k: float(np.spacing(dtypes[k].type(scale[k])))

    def distances():
        r = states[0][0]
        return np.array([[np.abs(s[0][k] - r[k]).max(initial=0.0) / spacing(k) for k in names] for s in states[1:]])

    columns, tangent, set_by = [distances()], [distances()[0]], set()
    for host in hosts:
        stepped = []
        for i, (p, trace) in enumerate(states):
            g, absolute = numpy_gradients(p, host, blocks=2 * n)
            if i == 0:
                sizes = numpy_step(p, trace, absolute)[2]
            stepped.append(numpy_step(p, trace, g)[:2])
        states = stepped
        for s in states:
            assert_exact_in(s[0], dtypes)
        for k in names:
            held, update = float(np.abs(states[0][0][k]).max(initial=0.0)), float(np.abs(sizes[k]).max(initial=0.0))
            if max(held, update) > scale[k]:
                set_by.add(("params" if held >= update else "updates", int(host["mask"].sum())))
            scale[k] = max(scale[k], held, update)
        columns.append(distances())
        tangent.append(columns[-1][0])  # an affine step: the tangent is twin a's difference, exactly
    r, a, b = (s[0] for s in states)
    middle = max(np.abs((a[k] - r[k]) + (b[k] - r[k])).max(initial=0.0) / spacing(k) for k in names)
    spread = columns[-1][0].max() + columns[-1][1].max()
    return (np.stack(columns, -1), middle / spread if spread else 0.0, np.array([scale[k] for k in names]),
            np.stack(tangent, -1), set_by, signs)


def test_twin_growth_is_what_its_docstring_computes_on_an_exact_model(devices):
    # Every number on the way is exact (dyadic values, counts 1, 4 and 8), so the measure has
    # one right answer: the docstring's, re-computed in NumPy. What the model puts in reach:
    # leaves of three dtypes and an empty one, a leaf whose twins start 65 and 64 ulps out
    # (rounding), coupled entries (the signs matter), an optimizer state that is not init's
    # (with an int leaf) and a weight decay (the update reads the params), a batch of one
    # real row, and a scale set by the params at one step and by an update at another.
    mesh = loaders.data_mesh(devices[:2])
    params, opt_state = exact_start()
    hosts = exact_hosts()
    distances, off_centre, scale, tangent, set_by, signs = numpy_twin_growth(params, opt_state, hosts, n=2)
    assert {("params", 8), ("updates", 8), ("updates", 1)} <= set_by, set_by
    assert (distances[0] != distances[1]).any() and 0 < off_centre < 1
    assert set(np.unique(signs["w"])) == {-1.0, 1.0}
    g = equivalence.twin_growth(params, hosts, mesh, loss_terms=exact_terms, optimizer=exact_optimizer(),
                                opt_state=opt_state)
    np.testing.assert_array_equal(g.distances, distances)
    assert g.off_centre == off_centre
    np.testing.assert_array_equal(g.scale, scale)
    np.testing.assert_array_equal(g.tangent, tangent)
    assert g.distances.dtype == g.scale.dtype == g.tangent.dtype == np.float64
    # Another seed draws other signs, and the measure follows them; batches already on the
    # mesh are the same batches, and are the caller's still after it (none donated).
    other = numpy_twin_growth(params, opt_state, hosts, n=2, seed=5)
    assert (other[0] != distances).any()
    placed = [jax.device_put(h, jax.sharding.NamedSharding(mesh, P(strategies.AXIS))) for h in hosts]
    np.testing.assert_array_equal(equivalence.twin_growth(params, placed, mesh, loss_terms=exact_terms,
                                                          optimizer=exact_optimizer(), opt_state=opt_state,
                                                          seed=5).distances, other[0])
    for h, p in zip(hosts, placed):
        for key in h:
            np.testing.assert_array_equal(np.asarray(p[key]), h[key])


KINK_COUPLE = np.array([1.0, 1.0, 2.0, 0.0], np.float32)  # w's last entry (8: its leaf's ulp) outside the residual


def kink_terms(params, batch):
    """Per real row i: 0.5 (w . KINK_COUPLE - x_i)^2 + relu(r - z_i), e empty and untouched.
    r sits on the ReLU's kink (r = z_i): its gradient is 0 there and 1 a row a ulp above, 0 a
    ulp below (one-sided). w's largest entry, 8, sets its leaf's ulp (2**-20) high enough that
    every residual of a 1-ulp move is exact in float32."""
    mask = batch["mask"].astype(jnp.float32)
    residual = params["w"] @ KINK_COUPLE - batch["x"]
    per_row = 0.5 * residual ** 2 + jax.nn.relu(params["r"][0] - batch["z"])
    return jnp.sum(mask * per_row), jnp.sum(mask)


def numpy_kink_gradients(p: dict, host: dict, blocks: int):
    """(g, sum_k |g_k|) of kink_terms' masked mean (``block_sums``)."""
    m, count = host["mask"].astype(np.float64), max(host["mask"].sum(), 1)
    return block_sums(p, {"w": (m * (p["w"] @ KINK_COUPLE - host["x"]))[:, None] * KINK_COUPLE / count,
                          "r": (m * (p["r"][0] - host["z"] > 0))[:, None] / count}, blocks)


def doubled(params, batches, mesh, *, loss_terms, optimizer, opt_state=None):
    """A strategy whose gradient is exactly twice sharded's (its loss doubled)."""
    twice = lambda p, batch: (2 * loss_terms(p, batch)[0], loss_terms(p, batch)[1])
    return strategies.sharded(params, batches, mesh, loss_terms=twice, optimizer=optimizer, opt_state=opt_state)


def kink_start():
    params = {"e": np.zeros(0, np.float32), "r": np.array([0.5], np.float32),
              "w": np.array([1.0, -0.5, 0.25, 8.0], np.float32)}
    trace = {"e": np.zeros(0, np.float32), "r": np.zeros(1, np.float32), "w": np.array([0.5, 0, 0, 0], np.float32)}
    return params, {"count": np.int32(0), "trace": trace}


def kink_hosts():
    """Three global batches of 12 rows: 8, 1 and 4 real rows; z = r every row (on the kink)."""
    mask = [np.array([1, 1, 1, 1, 1, 0, 1, 1, 1, 0, 0, 0], bool),
            np.array([0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0], bool),
            np.array([1, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0], bool)]
    x = [np.array([2, 0, 1, 1, 2, 9, 1, 0, 1, 7, 7, 7]) / 2, np.full(12, -1.0),
         np.array([1, 3, -1, 0, 0, 0, 2, 2, 0, 0, 0, 0]) / 4]
    return [{"x": xs.astype(np.float32), "z": np.full(12, 0.5, np.float32), "mask": m} for xs, m in zip(x, mask)]


def numpy_stepwise_distances(params, opt_state, hosts, n: int, seed=0) -> tuple:
    """stepwise_distances of ("sharded", ``doubled``), re-computed from stepwise_verdict's
    docstring in float64: (distances, twins, signs); the next state a's (sharded's)."""
    names = sorted(params)
    rng = np.random.default_rng(seed)
    signs = {k: rng.choice(np.array([-1.0, 1.0]), size=np.shape(params[k])) for k in names}
    p, trace = as_float64(params), as_float64(opt_state["trace"])
    distances, twins = [], []
    for host in hosts:
        g, absolute = numpy_kink_gradients(p, host, blocks=2 * n)
        scale = {k: absolute[k].max(initial=0.0) for k in names}
        unit = {k: float(np.spacing(np.float32(scale[k]))) for k in names}
        # leaf_ulps(g, 2g, scale): in ulps of the largest of |g|, |2g| and the term scale
        distances.append([np.abs(g[k]).max(initial=0.0) /
                          float(np.spacing(np.float32(max(2 * np.abs(g[k]).max(initial=0.0), scale[k]))))
                          for k in names])
        moves = []
        for sign in (1.0, -1.0):
            moved = {k: p[k] + sign * signs[k] * (float(np.spacing(np.float32(np.abs(p[k]).max()))) if p[k].size else 0.0)
                     for k in names}
            assert_exact_in(moved, {k: np.float32 for k in names})
            moves.append(numpy_kink_gradients(moved, host, blocks=2 * n)[0])
        twins.append([max(np.abs(m[k] - g[k]).max(initial=0.0) for m in moves) / unit[k] for k in names])
        p, trace, _ = numpy_step(p, trace, g)
        assert_exact_in(p, {k: np.float32 for k in names})
    return np.array(distances), np.array(twins), signs


def test_stepwise_distances_are_what_the_docstring_computes_on_an_exact_model(devices):
    # As twin_growth's test: an exact model, so one right answer, the docstring's. In reach: an
    # empty leaf, a ReLU kink that only one twin crosses (the larger twin is that one), a batch
    # of one real row, an optimizer state that is not init's and is a's (momentum: b's state
    # would take another path), coupled entries (the signs matter).
    mesh = loaders.data_mesh(devices[:2])
    params, opt_state = kink_start()
    hosts = kink_hosts()
    optimizer = exact_optimizer()
    distances, twins, signs = numpy_stepwise_distances(params, opt_state, hosts, n=2)
    assert signs["r"][0] == 1.0 and set(np.unique(signs["w"])) == {-1.0, 1.0}
    got, got_twins, same, diverged = equivalence.stepwise_distances(
        strategies.sharded, "sharded", doubled, "sharded", params, hosts, mesh, loss_terms=kink_terms,
        optimizer=optimizer, opt_state=opt_state)
    np.testing.assert_array_equal(got, distances)
    np.testing.assert_array_equal(got_twins, twins)
    assert got.dtype == got_twins.dtype == np.float64 and not same and diverged is None
    # A param that is already infinite: the training diverged at step 0, nothing compared.
    broken = dict(params, r=np.array([np.inf], np.float32))
    got, got_twins, same, diverged = equivalence.stepwise_distances(
        strategies.sharded, "sharded", doubled, "sharded", broken, hosts, mesh, loss_terms=kink_terms,
        optimizer=optimizer, opt_state=opt_state)
    assert diverged == 0 and got.shape == got_twins.shape == (0, 3)


def test_leaf_ulps_counts_in_each_leafs_own_dtype_and_is_symmetric():
    # float64 leaves in float64 ulps; every other dtype in float32, both sides converted to it
    # first (a float64 partner, an int leaf); max(|a|, |b|) over the leaf whichever side holds
    # it; an empty leaf 0, and the leaves after it still measured.
    one64 = np.float64(1.0)
    np.testing.assert_array_equal(equivalence.leaf_ulps([np.array([one64])], [np.array([one64 + 3 * 2.0**-52])]), [3])
    np.testing.assert_array_equal(equivalence.leaf_ulps([np.array([1.0], np.float32)], [np.array([1 + 2.0**-40])]), [0])
    np.testing.assert_array_equal(equivalence.leaf_ulps([np.array([2**24 + 1], np.int32)], [np.array([2**24], np.int32)]),
                                  [0])
    small, big = [np.array([1.0, 0.0], np.float32)], [np.array([1.0, 4.0], np.float32)]
    want = 4.0 / 2.0**-21  # |4 - 0| in ulps of 4
    np.testing.assert_array_equal(equivalence.leaf_ulps(small, big), [want])
    np.testing.assert_array_equal(equivalence.leaf_ulps(big, small), [want])
    empty_first = [np.zeros(0, np.float32), np.array([1.0], np.float32)]
    moved = [np.zeros(0, np.float32), np.array([1.0 + 2.0**-23], np.float32)]
    out = equivalence.leaf_ulps(empty_first, moved)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, [0.0, 1.0])


def test_the_verdict_after_no_steps_is_identical_or_outside_and_quiet():
    # A growth of 0 steps bounds every leaf by 0 ulps: a difference is OUTSIDE, in the leaf that
    # differs (not the one that agrees), with no division's warning; a one-leaf text names no leaf.
    import warnings
    a = [np.array([1.0], np.float32), np.array([2.0], np.float32)]
    b = [a[0].copy(), np.array([2.0 + 2.0**-22], np.float32)]
    none = equivalence.Growth(np.full((2, 2, 1), 64.0), 0.0, np.zeros(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = equivalence.verdict(a, b, 2, none)
    assert (v.case, v.ulps, v.bound) == ("OUTSIDE", 1.0, 0.0), v
    assert "(leaf 1)" in v.text and "growth at most 1)" in v.text
    assert equivalence.verdict(a, a, 2, none).case == "identical"
    one = growth([64, 64], [64, 64])
    v = equivalence.verdict(a[1:], b[1:], 0.5, one)
    assert v.case == "OUTSIDE" and "(leaf" not in v.text and "XX" not in v.text


def test_the_verdict_names_the_leaf_nearest_its_bound_even_at_one_ulp():
    # Leaf 0 one ulp apart against a bound of 2 (ratio 1/2), leaf 1 three ulps against 101 (its
    # growth x100 after step 1): the verdict's ulps and bound are leaf 0's. A NaN outside the
    # domain is a NaN.
    a = [np.array([1.0], np.float32), np.array([1.0], np.float32)]
    b = [np.array([1.0 + 2.0**-23], np.float32), np.array([1.0 + 3 * 2.0**-23], np.float32)]
    grown = equivalence.Growth(np.array([[[64, 64, 64], [64, 64, 6400]]] * 2, np.float64), 0.0, np.zeros(2))
    v = equivalence.verdict(a, b, 1, grown)
    assert (v.case, v.ulps, v.bound) == ("within", 1.0, 2.0) and "(leaf 0)" in v.text, v
    lost = growth([64] * 3, [64, 128, 1e6], off_centre=0.9)
    nan = equivalence.verdict(a[:1], [np.array([np.nan], np.float32)], 2, lost)
    assert nan.case == "outside the domain" and np.isnan(nan.ulps)


def test_twin_growth_and_stepwise_verdict_name_themselves_in_their_refusals(devices):
    mesh = loaders.data_mesh(devices[:2])
    params, hosts = {"w": np.ones(2, np.float64)}, [{"x": np.zeros(4, np.float32), "mask": np.ones(4, bool)}]
    with pytest.raises(ValueError, match=r"^equivalence\.twin_growth: leaf \[0\]\['w'\] is float64"):
        equivalence.twin_growth(params, hosts, mesh, loss_terms=linear_loss_terms)
    with pytest.raises(TypeError, match="^strategy 'twin_growth': optimizer must have init"):
        equivalence.twin_growth({"w": np.ones(2, np.float32)}, hosts, mesh, loss_terms=linear_loss_terms,
                                optimizer=object())
    with pytest.raises(TypeError, match="^strategy 'stepwise_verdict': optimizer must have init"):
        equivalence.stepwise_verdict("sharded", "single", {"w": np.ones(2, np.float32)}, hosts, mesh,
                                     loss_terms=linear_loss_terms, optimizer=object())


def test_stepwise_verdict_on_the_exact_model_at_its_bounds_edge(devices):
    # The exact model's distances (numpy_stepwise_distances) judged at a bound equal to the
    # largest judged one: within, that distance and bound; an ulp of count lower, OUTSIDE. The
    # state continued is the one given, and the signs are seed 0's (the judged count says).
    mesh = loaders.data_mesh(devices[:2])
    params, opt_state = kink_start()
    hosts = kink_hosts()
    distances, twins, _ = numpy_stepwise_distances(params, opt_state, hosts, n=2)
    judged = twins <= equivalence.STEP_UNITS
    largest = distances[judged].max()
    assert largest > 0 and (~judged).sum() > 0
    run = lambda count: equivalence.stepwise_verdict("sharded", doubled, params, hosts, mesh, loss_terms=kink_terms,
                                                     optimizer=exact_optimizer(), opt_state=opt_state, count=count)
    edge = run(largest / equivalence.STEP_UNITS)
    assert (edge.case, edge.ulps, edge.bound) == ("within", largest, largest), edge
    assert f"; {(~judged).sum()} of {judged.size} steps x leaves not judged" in edge.text
    assert run(np.nextafter(largest / equivalence.STEP_UNITS, 0)).case == "OUTSIDE"


def test_growth_in_units_below_one_and_at_the_reference():
    # Distances below one unit (the scale grew past them) still divide; a twin on the reference
    # that stays there grows by 1, one that leaves it again by infinity (and is outside).
    np.testing.assert_array_equal(growth([0.5, 0.5, 1.0], [0.5, 0.5, 0.5]).factors(), [[2.0, 1.0]])
    np.testing.assert_array_equal(growth([64, 0, 0], [64, 64, 64]).factors(), [[1.0, 1.0]])
    left = growth([64, 0, 0.5], [64, 64, 64])
    assert np.isinf(left.factors()[0, 0]) and left.outside() == "a twin met the reference and left it again"
    diverged = "the training diverged: the reference or a twin reached a NaN or an infinity"
    assert growth([64, np.inf], [64, 64]).outside() == diverged
    assert equivalence.Growth(np.full((2, 1, 2), 64.0), 0.0, np.array([np.inf])).outside() == diverged
    # A tangent of exactly MAX_TWIN_ULPS is not chaos: twins beyond twice it are kinks.
    edge = with_tangent([[64, 1e6], [64, 1e6]], [64, equivalence.MAX_TWIN_ULPS]).outside()
    assert "kinks" in edge and "chaos" not in edge, edge


def collapse_terms(params, batch):
    """0.5 (p - x_i)^2 per real row: SGD at rate 1 moves p onto the batch's mean, twins too."""
    mask = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask * 0.5 * jnp.sum((params["p"] - batch["x"]) ** 2, axis=-1)), jnp.sum(mask)


def test_twins_that_end_on_the_reference_are_on_centre(devices):
    # Both twins collapse onto the reference: off-centre 0 (not 0/0). With a leaf the loss does
    # not touch beside, whose twins start 65 and 64 ulps out (exact_start's k), the off-centre
    # is that leaf's 1 unit over 65 + 64, the two twins' own largest distances.
    mesh = loaders.data_mesh(devices[:2])
    hosts = [{"x": np.tile(np.array([[0.5, -0.25]], np.float32), (4, 1)), "mask": np.ones(4, bool)}] * 2
    sgd = strategies.sgd(1.0)
    alone = equivalence.twin_growth({"p": np.array([1.0, 0.75], np.float32)}, hosts, mesh,
                                    loss_terms=collapse_terms, optimizer=sgd)
    np.testing.assert_array_equal(alone.distances[..., 1:], 0.0)
    assert alone.off_centre == 0.0 and alone.outside() is None
    beside = {"k": exact_start()[0]["k"], "p": np.array([1.0, 0.75], np.float32)}
    g = equivalence.twin_growth(beside, hosts, mesh, loss_terms=collapse_terms, optimizer=sgd)
    assert sorted(g.distances[:, 0, -1]) == [64.0, 65.0] and g.off_centre == 1 / (65 + 64)
    # No batches: the perturbation alone, 0 steps, in the same float64 unit.
    still = equivalence.twin_growth(beside, [], mesh, loss_terms=collapse_terms, optimizer=sgd)
    assert still.steps == 0 and still.scale.dtype == still.distances.dtype == np.float64
    np.testing.assert_array_equal(still.scale, [2 - 2.0**-23, 1.0])


def test_identical_means_the_same_bits_shape_and_dtype_and_strategies_are_named(devices):
    # The same bytes as another dtype, or in another shape, are not identical.
    one = [np.array([1.0, 2.0], np.float32)]
    assert equivalence.verdict(one, [one[0].view(np.int32)], 0, None).case == "OUTSIDE"
    assert equivalence.verdict(one, [one[0].reshape(1, 2)], 0, None).case == "OUTSIDE"
    assert equivalence.verdict(one, [one[0].copy()], 0, None).case == "identical"
    # A strategy without a __name__ is named by its repr; names on a one-device mesh take
    # ulp_bound's count there.
    mesh = loaders.data_mesh(devices[:1])
    params, opt_state = kink_start()
    run = lambda a, b, count=None: equivalence.stepwise_verdict(
        a, b, params, kink_hosts()[:1], mesh, loss_terms=kink_terms, optimizer=exact_optimizer(),
        opt_state=opt_state, count=count)
    partial = functools.partial(doubled)
    assert run(partial, "sharded", count=1).text.startswith(f"{partial!r} vs sharded")
    count = equivalence.ulp_bound("sharded", "single", "cpu", 1)
    v = run("sharded", "single")
    assert v.case == "identical" or f"{count:g} rounding" in v.text, v


# --------------------------------------------------------------------------
# The bound at any rate: growth measured by twins, the verdict true (issue 23)
# --------------------------------------------------------------------------


PLANTED_BUGS = {"x1.001": (1.001, 0.0), "dropped": (0.0, 0.0), "local count": (1.0, 1.0)}


@functools.lru_cache(maxsize=None)
def planted_gradient(loss_terms, mesh):
    """Wrong on purpose: jit(shard_map) (params, batch, factor, local) -> (loss, gradient),
    the gradient wrong in one of three ways (PLANTED_BUGS: (factor, local)), chosen by
    values, so the three compile once per model and mesh: "x1.001", the last device's
    gradient x 1.001; "dropped", x 0, so it never reaches the sum; "local count", each
    device divides its total by its own count x n (the notebooks' mean of per-device
    means, wrong where the devices hold unequal numbers of real samples)."""
    def gradient(p, batch, factor, local):
        (total, count), vjp = jax.vjp(lambda q: loss_terms(q, batch), p)
        denominator = jnp.maximum(lax.psum(count, strategies.AXIS), 1.0)
        own = jnp.where(local > 0, jnp.maximum(count, 1.0) * lax.axis_size(strategies.AXIS), denominator)
        grads = vjp((1.0 / own, jnp.zeros_like(count)))[0]
        last = lax.axis_index(strategies.AXIS) == lax.axis_size(strategies.AXIS) - 1
        grads = jax.tree.map(lambda g: jnp.where(last, g * factor, g), grads)
        return lax.psum(total, strategies.AXIS) / denominator, lax.psum(grads, strategies.AXIS)

    return jax.jit(jax.shard_map(gradient, mesh=mesh, in_specs=(P(), P(strategies.AXIS), P(), P()),
                                 out_specs=(P(), P()), check_vma=False))


def planted(kind: str):
    """A strategy (strategies' signature, layout "sharded") with ``planted_gradient``'s bug
    ``kind``, the update the strategies' shared program (strategies.apply_program)."""
    factor, local = (np.float32(v) for v in PLANTED_BUGS[kind])

    def strategy(params, batches, mesh, *, loss_terms, optimizer, opt_state=None):
        state = strategies.replicate((params, optimizer.init(params) if opt_state is None else opt_state), mesh)
        gradient = planted_gradient(loss_terms, mesh)
        apply = strategies.apply_program(optimizer.update, strategies.donates(mesh.devices.flat))
        state, losses = strategies.train_loop(lambda s, batch: apply(s, *gradient(s[0], batch, factor, local)[::-1]),
                                              state, strategies.checked(batches, "sharded", mesh))
        return strategies.Trained(strategies.to_host(state[0]), strategies.stack_losses(losses),
                                  strategies.to_host(state[1]))
    strategy.__name__ = f"planted bug ({kind})"
    return strategy


PLANTED = {kind: planted(kind) for kind in PLANTED_BUGS}
dropped_device = PLANTED["dropped"]


def scaled_sgd_update(grads, state, params):
    """Wrong on purpose: SGD with every gradient multiplied by 1 + 1e-6 (float32: 1 + 8 ulps)."""
    return strategies.sgd_update(jax.tree.map(lambda g: g * np.float32(1 + 1e-6), grads), state, params)


def scaled_gradient(params, batches, mesh, *, loss_terms, optimizer):
    """Wrong on purpose: ``sharded`` with the gradient off by a relative 1e-6 (SGD only)."""
    return strategies.sharded(params, batches, mesh, loss_terms=loss_terms,
                              optimizer=strategies.Optimizer(optimizer.init, scaled_sgd_update))


CASES = {"token": (token_loss_terms, token_init), "mlp": (model.loss_terms, lambda: model.init_model(SMALL_LAYERS))}


def verdicts(kind: str, hosts: list, mesh, rate: float, wrong: dict) -> dict:
    """The verdict of sharded, and of each wrong strategy, against single, with the growth
    twin_growth measured over the same batches."""
    loss_terms, init = CASES[kind]
    placed = [jax.device_put(h, jax.sharding.NamedSharding(mesh, P(strategies.AXIS))) for h in hosts]
    run = lambda fn: fn(init(), placed, mesh, loss_terms=loss_terms, optimizer=strategies.sgd(rate)).params
    oracle = run(strategies.single)
    growth = equivalence.twin_growth(init(), placed, mesh, loss_terms=loss_terms, optimizer=strategies.sgd(rate))
    count = bound("sharded", "single", mesh)
    out = {name: equivalence.verdict(run(fn), oracle, count, growth, steps=len(hosts))
           for name, fn in dict(sharded=strategies.sharded, **wrong).items()}
    for name, v in out.items():
        print(f"{kind} lr {rate:g}, {len(hosts)} steps, {name} vs single: {v.text}")
    return out


@pytest.fixture(scope="module")
def pair_mesh(devices):
    """The policy's first two devices: long runs are cheapest there, and one device's
    gradient is half the sum (what the dropped-device control drops)."""
    return loaders.data_mesh(devices[:2])


def long_hosts(kind: str, steps: int) -> list:
    """Fixed shapes for every verdict test (one compilation per model and strategy):
    global batches of 16 token rows, or 2 x 4 MLP rows."""
    if kind == "token":
        return token_batches(seed=1, steps=steps, rows=16)
    return host_batches(seed=2, steps=steps, n=2, real_per_device=[B, 3], kind="mlp")


# The issue's runs: the token model, 120 steps, lr 5 (held) and 20 (413,484 ulps against a
# count-only bound of 240, while training converged; lr 40, alike: ``python
# test_equivalence.py rates``); the MLP at 0.5 and 5, 40 steps. (kind, steps, held rate,
# chaotic rate)
# The MLP's runs take 40 s on this 2-core machine: --run-slow (its 2-step runs are in
# test_wrong_strategies_are_outside_at_small_rates).
LONG_RUNS = [pytest.param("token", 120, 5.0, 20.0, id="token"),
             pytest.param("mlp", 40, 0.5, 5.0, id="mlp", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind, steps, held, chaotic", LONG_RUNS)
def test_a_correct_run_is_never_outside_at_any_rate(pair_mesh, kind, steps, held, chaotic):
    hosts = long_hosts(kind, steps)
    found = verdicts(kind, hosts, pair_mesh, held, {})
    assert found["sharded"].case in ("identical", "within"), found["sharded"].text
    found = verdicts(kind, hosts, pair_mesh, chaotic, {"dropped device": dropped_device})
    assert found["sharded"].case == "outside the domain", found["sharded"].text  # never OUTSIDE
    assert found["dropped device"].case != "within", found["dropped device"].text


@pytest.mark.parametrize("kind, rates", [("token", (5.0, 10.0)), ("mlp", (0.5, 1.0))])
def test_wrong_strategies_are_outside_at_small_rates(pair_mesh, kind, rates):
    # 2 steps. A relative 1e-6 gradient error moves a leaf by about 8 ulps x lr |g| / |p| a
    # step: visible against 2 ulps a step where the step is large against the params (the
    # token model from lr 5; measured 18 and 37 ulps against 4 and 8), and only on CPU,
    # where the counts are measured; on GPUs they are larger (n + 1 against single).
    wrong = {"dropped device": dropped_device}
    if pair_mesh.devices.flat[0].platform == "cpu":
        wrong["gradient x (1 + 1e-6)"] = scaled_gradient
    for rate in rates:
        found = verdicts(kind, long_hosts(kind, 2), pair_mesh, rate, wrong)
        assert found["sharded"].case in ("identical", "within"), found["sharded"].text
        for name in wrong:
            assert found[name].case == "OUTSIDE", found[name].text


# --------------------------------------------------------------------------
# ReLU models and adaptive rules: no bound on the final params, a verdict every step
# --------------------------------------------------------------------------
#
# On a ReLU model a difference of a few ulps crosses units' switches (kinks) and jumps,
# whatever its size: the twins end far beyond their linearisation (jax.jvp), and a
# correct pair crosses such switches too, by chance, so no bound on the final params is
# derived there (Growth.outside says "kinks"). Under Adam no count for the params is
# derived (ulp_bound(adaptive=True) is None). stepwise_verdict answers on both: each step
# of both strategies from the same state, the gradients compared. The planted bugs
# (planted_step) are caught by it at ordinary rates, and no correct pair is OUTSIDE
# (the drawn soak, --run-slow, over models, rules and rates, chaotic ones included).

WIDE_FEATURES, WIDE_UNITS, WIDE_CLASSES = 8, 256, 4  # 256 ReLU units: kinks within a few steps


def activation_mlp(activation):
    """A one-hidden-layer MLP over float features (B, 8), ``activation`` between, 4 classes."""
    def loss_terms(params: dict, batch: dict):
        hidden_BxH = activation(batch["x"] @ params["w1"] + params["b1"])
        logits_BxC = hidden_BxH @ params["w2"] + params["b2"]
        nll_B = -jnp.take_along_axis(jax.nn.log_softmax(logits_BxC), batch["y"][:, None], axis=1)[:, 0]
        mask_B = batch["mask"].astype(jnp.float32)
        return jnp.sum(mask_B * nll_B), jnp.sum(mask_B)
    loss_terms.__name__ = f"{activation.__name__}_mlp_terms"
    return loss_terms


relu_mlp_terms, gelu_mlp_terms = activation_mlp(jax.nn.relu), activation_mlp(jax.nn.gelu)


def wide_init() -> dict:
    rng = np.random.default_rng(3)
    return {"w1": (rng.standard_normal((WIDE_FEATURES, WIDE_UNITS)) / np.sqrt(WIDE_FEATURES)).astype(np.float32),
            "b1": np.zeros(WIDE_UNITS, np.float32),
            "w2": (rng.standard_normal((WIDE_UNITS, WIDE_CLASSES)) / np.sqrt(WIDE_UNITS)).astype(np.float32),
            "b2": np.zeros(WIDE_CLASSES, np.float32)}


def uneven_masks(rng, n: int, rows: int) -> np.ndarray:
    """(n * rows,) bool: device k's block of ``rows`` slots holds a drawn rows/2..rows real
    samples, at drawn slots (so a device's own count differs from the others')."""
    mask = np.zeros((n, rows), bool)
    for k in range(n):
        mask[k, rng.permutation(rows)[:rng.integers(rows // 2, rows + 1)]] = True
    return mask.reshape(-1)


def wide_hosts(seed: int, steps: int, n: int, rows: int = 16) -> list[dict]:
    """Host batches (layout "sharded") for activation_mlp: n x ``rows`` rows, uneven masks."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((n * rows, WIDE_FEATURES)).astype(np.float32)
        out.append({"x": x, "y": np.argmax(x[:, :WIDE_CLASSES], axis=1).astype(np.int32),
                    "mask": uneven_masks(rng, n, rows)})
    return out


@pytest.fixture(scope="module")
def verdict_rules():
    """One optimizer object per rule for the module, the rate in its state (with_rate)."""
    optax = pytest.importorskip("optax")
    return {"sgd": strategies.sgd(0.1),
            "momentum": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=BETA),
            "adam": optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
            "adamw": optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
            "chain": optax.chain(optax.clip_by_global_norm(1.0),
                                 optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3))}


def final_count(a: str, b: str, mesh, rule: str):
    """ulp_bound's count for the final params under ``rule`` (verdict_rules' names)."""
    return equivalence.ulp_bound(a, b, mesh.devices.flat[0].platform, mesh.devices.size,
                                 momentum=BETA if rule == "momentum" else 0.0,
                                 adaptive=rule in ("adam", "adamw", "chain"))


def test_stepwise_verdict_catches_the_planted_bugs_on_a_relu_model(mesh, verdict_rules):
    # Ordinary rates, uneven masks, 4 steps: SGD at 0.1 and Adam at 1e-3. Correct pairs are
    # within (or identical); each planted bug is OUTSIDE, measured 100s to 1e6 x its bound.
    n = mesh.devices.size
    hosts = wide_hosts(seed=11, steps=4, n=n)
    count = bound("sharded", "single", mesh)
    for rule, rate, bugs in (("sgd", 0.1, list(PLANTED)), ("adam", 1e-3, ["x1.001"])):  # the rest: the soak
        tx = verdict_rules[rule]
        state = with_rate(tx.init(wide_init()), rate)
        judge = functools.partial(equivalence.stepwise_verdict, params=wide_init(), batches=hosts, mesh=mesh,
                                  loss_terms=relu_mlp_terms, optimizer=tx, opt_state=state)
        found = judge("single", "sharded")  # every pair, and every model, rule and rate: the soak
        assert found.case == "within", (rule, found.text)
        for kind in bugs:
            found = judge("single", PLANTED[kind], count=count)
            assert found.case == "OUTSIDE" and found.ulps > 10 * found.bound, (rule, kind, found.text)
    assert "OUTSIDE the bound of" in found.text and "planted bug (x1.001)" in found.text


def test_no_bound_on_a_relu_models_final_params_and_the_verdict_says_why(mesh, verdict_rules):
    # 20 steps at lr 0.1: 64-ulp twins cross ReLU switches and end far beyond their
    # linearisation (measured 8.6e4 against 333 units on 4 devices): "kinks". A correct pair
    # within count x steps is still within (the no-growth test first); one further apart,
    # and a planted bug, get "outside the domain" with the routes that answer: never
    # OUTSIDE, never within.
    n = mesh.devices.size
    hosts = wide_hosts(seed=12, steps=20, n=n)
    tx = verdict_rules["sgd"]
    state = with_rate(tx.init(wide_init()), 0.1)
    growth = equivalence.twin_growth(wide_init(), hosts, mesh, loss_terms=relu_mlp_terms, optimizer=tx,
                                     opt_state=state)
    assert "kinks, the training is not differentiable at the scale of rounding" in growth.outside()
    assert growth.distances.max() > 10 * growth.tangent.max()
    trained = {name: strategies.STRATEGIES[name](wide_init(), [place(h, mesh, "sharded") for h in hosts], mesh,
                                                 loss_terms=relu_mlp_terms, optimizer=tx, opt_state=state).params
               for name in ("sharded", "single")}
    trained["bug"] = PLANTED["x1.001"](wide_init(), hosts, mesh, loss_terms=relu_mlp_terms, optimizer=tx,
                                       opt_state=state).params
    count = bound("sharded", "single", mesh)
    pair = equivalence.verdict(trained["sharded"], trained["single"], count, growth)
    assert pair.case in ("identical", "within", "outside the domain"), pair.text
    bug = equivalence.verdict(trained["bug"], trained["single"], count, growth)
    assert bug.case == "outside the domain" and "no bound is derived for the final params" in bug.text, bug.text
    assert "kinks" in bug.text and "stepwise_verdict" in bug.text and "reduction='canonical'" in bug.text


# stepwise_verdict's parts, each case and unit on a model whose gradient NumPy computes:
# a linear map under squared error, one real row per device (so each row is a term block:
# _absolute_gradient's blocks), rows whose gradients cancel (the term scale, sum_k |g_k|,
# is far above |g|: a unit taken from |g| instead reads many times more).
def square_terms(params: dict, batch: dict):
    r_BxC = batch["x"] @ params["w"] + params["b"] - batch["t"]
    mask_B = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask_B[:, None] * r_BxC ** 2), jnp.sum(mask_B)


def square_init() -> dict:
    return {"w": np.array([[0.5, -0.25], [0.75, 1.0], [-0.5, 0.125]], np.float32),
            "b": np.array([0.0625, -0.125], np.float32)}


def square_hosts(n: int, steps: int, nan_at: int | None = None) -> list[dict]:
    rng = np.random.default_rng(5)
    out = []
    for t in range(steps):
        x = rng.standard_normal((n, 3)).astype(np.float32)
        x[1::2] = -x[0::2][: n // 2] if n > 1 else x[1::2]  # pairs of rows that cancel
        host = {"x": x, "t": rng.standard_normal((n, 2)).astype(np.float32),
                "mask": np.ones(n, bool)}
        if t == nan_at:
            host["x"] = np.full_like(x, np.nan)
        out.append(host)
    return out


def square_scale(params: dict, host: dict) -> list[float]:
    """Per leaf (jax.tree.leaves order: b, w), max over entries of sum_k |g_k|, in float64:
    g_k the gradient of row k alone over the batch's count."""
    w, b = (np.asarray(params[k], np.float64) for k in ("w", "b"))
    x, t = np.asarray(host["x"], np.float64), np.asarray(host["t"], np.float64)
    r = x @ w + b - t  # (rows, C)
    count = host["mask"].sum()
    return [float(np.abs(2 * r / count).sum(axis=0).max()),
            float(np.abs(2 * x[:, :, None] * r[:, None, :] / count).sum(axis=0).max())]


def shifted(units_of_scale: float):
    """The sharded strategy with every gradient entry moved ``units_of_scale`` units of
    the term scale before its optimizer sees it (square_scale at the step's own state)."""
    def strategy(params, batches, mesh, *, loss_terms, optimizer, opt_state=None):
        (host,) = batches
        delta = [units_of_scale * np.spacing(np.float32(s)) for s in square_scale(params, host)]
        def update(grads, state, p):
            moved = {"b": grads["b"] + np.float32(delta[0]), "w": grads["w"] + np.float32(delta[1])}
            return optimizer.update(moved, state, p)
        return strategies.sharded(params, batches, mesh, loss_terms=loss_terms,
                                  optimizer=strategies.Optimizer(optimizer.init, update), opt_state=opt_state)
    strategy.__name__ = f"shifted by {units_of_scale:g}"
    return strategy


def test_stepwise_distances_are_in_units_of_the_term_scale_at_each_steps_state(mesh):
    n = mesh.devices.size
    hosts = square_hosts(n, steps=3)
    kw = dict(params=square_init(), batches=hosts, mesh=mesh, loss_terms=square_terms,
              optimizer=strategies.sgd(0.05))
    sharded = strategies.sharded
    distances, twins, same, diverged = equivalence.stepwise_distances(
        sharded, "sharded", shifted(5.0), "sharded", **kw)
    assert distances.shape == twins.shape == (3, 2) and distances.dtype == twins.dtype == np.float64
    np.testing.assert_allclose(distances, 5.0, atol=0.5)  # every step and both leaves
    assert not same and diverged is None
    assert np.isfinite(twins).all() and (twins >= 0).all() and twins.max() <= equivalence.STEP_UNITS
    # The same seed, the same twins; another seed, other signs (stepwise_verdict's seed)
    again = equivalence.stepwise_distances(sharded, "sharded", sharded, "sharded", **kw)
    other = equivalence.stepwise_distances(sharded, "sharded", sharded, "sharded", **kw, seed=1)
    np.testing.assert_array_equal(again[1], twins)
    assert not np.array_equal(other[1], twins)
    assert again[2] is True and not again[0].any()
    # pmap's layout: its batch is (n, B, ...); the same gradient bits as sharded's here
    pmapped = equivalence.stepwise_distances(strategies.pmap, "pmap", sharded, "sharded", **kw)
    assert pmapped[0].shape == (3, 2) and np.isfinite(pmapped[0]).all() and pmapped[0].max() <= 1


def test_stepwise_distances_stop_where_the_training_diverges(mesh):
    n = mesh.devices.size
    kw = dict(params=square_init(), batches=square_hosts(n, steps=3, nan_at=1), mesh=mesh,
              loss_terms=square_terms, optimizer=strategies.sgd(0.05))
    distances, twins, same, diverged = equivalence.stepwise_distances(
        strategies.sharded, "sharded", shifted(2.0), "sharded", **kw)
    assert diverged == 1 and distances.shape == twins.shape == (1, 2)
    found = equivalence.stepwise_verdict("sharded", shifted(2.0), count=1, **kw)
    assert "the training diverged at step 1 (a NaN or an infinity in the state or in both gradients)" \
        in found.text, found.text
    # one NaN gradient, the other finite: that is a difference, not a divergence
    def nan_gradient(params, batches, mesh, *, loss_terms, optimizer, opt_state=None):
        def update(grads, state, p):
            return optimizer.update(jax.tree.map(lambda g: g * jnp.nan, grads), state, p)
        return strategies.sharded(params, batches, mesh, loss_terms=loss_terms,
                                  optimizer=strategies.Optimizer(optimizer.init, update), opt_state=opt_state)
    kw["batches"] = square_hosts(n, steps=2)
    found = equivalence.stepwise_verdict("sharded", nan_gradient, count=1, **kw)
    assert found.case == "OUTSIDE" and "diverged" not in found.text, found.text


def quartic_terms(params: dict, batch: dict):
    """Every row's loss sum(w**4) + sum(v**4): the gradient 4 w**3 in every row (its term
    scale |4 w**3| too), exact in float32 at w = 1 and v = 2 and one ulp either side."""
    mask_B = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask_B) * (jnp.sum(params["w"] ** 4) + jnp.sum(params["v"] ** 4)), jnp.sum(mask_B)


def test_the_twins_are_the_gradients_move_under_a_one_ulp_move_of_the_params(mesh):
    # w moves +-1 ulp of its largest entry, 1: 2**-23; the gradient 4 w**3 moves 12 w**2
    # 2**-23 = 3 * 2**-21, 3 units of its scale 4 (np.spacing(4) = 2**-21), either way; v,
    # at 2, the same 3 units (48 * 2**-22 against spacing(32) = 2**-18). Smaller entries
    # move less. So every step's twin is 3 in both leaves, for any seed's signs.
    n = mesh.devices.size
    hosts = [{"x": np.zeros((2 * n, 1), np.float32), "mask": np.ones(2 * n, bool)}] * 2
    params = {"w": np.array([1.0, 0.75, -0.5, 0.25], np.float32), "v": np.array([2.0, -1.5], np.float32)}
    for seed in (0, 1):
        distances, twins, same, _ = equivalence.stepwise_distances(
            strategies.sharded, "sharded", strategies.sharded, "sharded", params, hosts, mesh,
            loss_terms=quartic_terms, optimizer=strategies.sgd(0.0), seed=seed)
        np.testing.assert_array_equal(twins, np.full((2, 2), 3.0), err_msg=f"seed {seed}")
        assert same and not distances.any()


def test_stepwise_verdict_cases_bounds_and_words(mesh):
    n, platform = mesh.devices.size, mesh.devices.flat[0].platform
    kw = dict(params=square_init(), batches=square_hosts(n, steps=2), mesh=mesh, loss_terms=square_terms,
              optimizer=strategies.sgd(0.05))
    U = equivalence.STEP_UNITS
    same = equivalence.stepwise_verdict("sharded", "sharded", **kw)
    assert same == equivalence.Verdict(
        "identical", 0.0, 0.0, "identical: sharded vs sharded, each of 2 steps from the same state, the same "
        "gradient bits"), same
    # count=None: ulp_bound's count for the two names, on the mesh's platform and size
    named = equivalence.stepwise_verdict("sharded", "single", **kw)
    assert named.bound == equivalence.ulp_bound("sharded", "single", platform, n) * U, named
    assert named.case in ("within", "identical"), named.text
    for a, b in (("sharded", shifted(1.0)), (shifted(1.0), "sharded"), (shifted(1.0), shifted(2.0))):
        with pytest.raises(ValueError, match="count=None takes ulp_bound's count"):
            equivalence.stepwise_verdict(a, b, **kw)
    # The bound is count x STEP_UNITS units; "within" up to it, OUTSIDE beyond it
    near = equivalence.stepwise_verdict("sharded", shifted(3.0), count=1, **kw)
    assert near.case == "within" and near.bound == U and abs(near.ulps - 3.0) <= 0.5, near
    assert near.text.startswith("sharded vs shifted by 3, each of 2 steps from the same state: the "
                                "gradients "), near.text
    assert f"within the bound of {U}: 1 rounding a step (equivalence.ulp_bound) x {U} units a rounding" \
        in near.text and "not judged" not in near.text and "diverged" not in near.text, near.text
    two = equivalence.stepwise_verdict("sharded", shifted(3.0), count=2, count_name="mine", **kw)
    assert two.bound == 2 * U and f"2 roundings a step (mine) x {U} units" in two.text, two.text
    far = equivalence.stepwise_verdict("sharded", shifted(2.0 * U), count=1, **kw)
    assert far.case == "OUTSIDE" and abs(far.ulps - 2 * U) <= 0.5, far
    assert f"OUTSIDE the bound of {U}" in far.text and "at step " in far.text, far.text
    # count 0, the same program: any difference is OUTSIDE, however small
    zero = equivalence.stepwise_verdict("sharded", shifted(1.0), count=0, **kw)
    assert zero.case == "OUTSIDE" and zero.bound == 0.0 and zero.ulps > 0, zero
    assert "0 roundings a step (equivalence.ulp_bound): the same program, the same bits expected" in zero.text
    # no batch: nothing compared
    empty = equivalence.stepwise_verdict("sharded", "single", **{**kw, "batches": []})
    assert empty.case == "outside the domain" and np.isnan(empty.ulps) and empty.bound is None, empty
    assert empty.text == "sharded vs single: no step compared: no verdict", empty.text


def test_stepwise_verdict_continues_the_optimizer_state_it_is_given(mesh):
    # opt_state is a's state at step 0: here the rate lives in it, so a rate of 0 keeps the
    # params where they are, and the second step's term scale is the first one's.
    optax = pytest.importorskip("optax")
    n = mesh.devices.size
    hosts = square_hosts(n, steps=2)
    hosts[1] = hosts[0]
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    kw = dict(params=square_init(), batches=hosts, mesh=mesh, loss_terms=square_terms, optimizer=tx)
    held = with_rate(tx.init(square_init()), 0.0)
    distances, twins, *_ = equivalence.stepwise_distances(strategies.sharded, "sharded", strategies.sharded,
                                                          "sharded", **kw, opt_state=held)
    moving = equivalence.stepwise_distances(strategies.sharded, "sharded", strategies.sharded, "sharded", **kw)
    np.testing.assert_array_equal(twins[1], twins[0])
    assert not np.array_equal(moving[1][1], moving[1][0])
    found = equivalence.stepwise_verdict("sharded", "single", **kw, opt_state=held, seed=1)
    assert found == equivalence.stepwise_verdict("sharded", "single", **kw, opt_state=held, seed=1)


def tied_terms(params: dict, batch: dict):
    """A linear map and its transpose, one leaf used twice (a tied embedding's pattern)."""
    logits_BxC = (batch["x"] @ params["w"]) @ params["w"].T[:, :WIDE_CLASSES]
    nll_B = -jnp.take_along_axis(jax.nn.log_softmax(logits_BxC), batch["y"][:, None], axis=1)[:, 0]
    mask_B = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask_B * nll_B), jnp.sum(mask_B)


def test_pmap_and_shard_map_count_one_rounding_for_a_leaf_used_twice(mesh):
    # A leaf used twice gets two gradient contributions a and b on each device. pmap adds
    # them, then psums once: psum(a + b); shard_map's transpose psums each use's
    # contribution, then adds: psum(a) + psum(b). Another order of the same sum: one step
    # ends apart (measured, JAX 0.10.2), which is why ulp_bound counts 1 for the pair, not
    # 0: with 0 this correct pair would be OUTSIDE.
    hosts = wide_hosts(seed=13, steps=1, n=mesh.devices.size)
    params = {"w": (np.random.default_rng(4).standard_normal((WIDE_FEATURES, WIDE_FEATURES)) / 3).astype(np.float32)}
    ends = [train(name, strategies.STRATEGIES[name], params, hosts, 0.5, mesh, tied_terms)[0]
            for name in ("pmap", "shard_map")]
    count = bound("pmap", "shard_map", mesh)
    found = equivalence.verdict(*ends, count, None, steps=1)
    assert found.case == "within" and found.ulps > 0, found.text
    assert equivalence.verdict(*ends, 0, None, steps=1).case == "OUTSIDE"


def attention_hosts(seed: int, steps: int, n: int, rows: int = 16) -> list[dict]:
    """Host batches for attention_loss_terms: n x ``rows`` token rows (learnable strides),
    uneven masks."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        start = rng.integers(0, VOCAB, (n * rows, 1))
        tokens = (start + np.arange(SEQ) * rng.integers(1, 4, (n * rows, 1))) % VOCAB
        out.append({"x": tokens.astype(np.int32), "mask": uneven_masks(rng, n, rows)})
    return out


def notebook_hosts(seed: int, steps: int, n: int, rows: int = 16) -> list[dict]:
    """Host batches for relu_notebook_terms: n x ``rows`` N(0, 1) images (3072 features),
    random labels, uneven masks."""
    rng = np.random.default_rng(seed)
    return [{"images": rng.standard_normal((n * rows, SMALL_LAYERS[0])).astype(np.float32),
             "labels": rng.integers(0, SMALL_LAYERS[-1], n * rows).astype(np.int32),
             "mask": uneven_masks(rng, n, rows)} for _ in range(steps)]


def soak_model(kind: str):
    """(loss_terms, initial params, hosts(seed, steps, n)) of a soak model: "relu" and "gelu",
    activation_mlp on wide_init; "attention", the canonical section's attention model (a
    tied embedding, a ReLU block); "notebook", the notebooks' MLP (SMALL_LAYERS) with ReLU."""
    if kind == "attention":
        return attention_loss_terms, canonical_model("attention")[1], attention_hosts
    if kind == "notebook":
        return relu_notebook_terms, model.init_model(SMALL_LAYERS), notebook_hosts
    return {"relu": relu_mlp_terms, "gelu": gelu_mlp_terms}[kind], wide_init(), wide_hosts


ADAPTIVE = ("adam", "adamw", "chain")
SOAK_RATES = {"sgd": (0.02, 0.5, 5.0, 20.0), "momentum": (0.01, 0.1, 2.0), "adam": (1e-3, 1e-2, 1.0),
              "adamw": (1e-3, 1.0), "chain": (1e-3, 1.0)}
ORDINARY = {"sgd": 0.5, "momentum": 0.1, "adam": 1e-2, "adamw": 1e-3, "chain": 1e-3}  # and below


def soak_run(mesh, verdict_rules, kind: str, rule: str, rate: float, seed: int, steps: int) -> dict:
    """Every verdict of one drawn training: {"stepwise": {pair: Verdict}, "bugs": {kind: Verdict},
    "final": {pair: Verdict}}, pairs of correct strategies (single against each, sharded
    against pmap, pmap against shard_map) and the planted bugs against single."""
    loss_terms, params, hosts_of = soak_model(kind)
    hosts = hosts_of(seed, steps, mesh.devices.size)
    tx = verdict_rules[rule]
    state = with_rate(tx.init(params), rate)
    judge = functools.partial(equivalence.stepwise_verdict, params=params, batches=hosts, mesh=mesh,
                              loss_terms=loss_terms, optimizer=tx, opt_state=state)
    pairs = [("single", "sharded"), ("single", "pmap"), ("single", "shard_map"), ("sharded", "pmap"),
             ("pmap", "shard_map")]
    out = {"stepwise": {pair: judge(*pair) for pair in pairs},
           "bugs": {bug: judge("single", PLANTED[bug], count=bound("sharded", "single", mesh)) for bug in PLANTED}}
    final = {name: fn(params, [place(h, mesh, strategies.LAYOUT[name]) for h in hosts], mesh, loss_terms=loss_terms,
                      optimizer=tx, opt_state=state).params for name, fn in strategies.STRATEGIES.items()}
    growth = None
    out["final"] = {}
    for a, b in pairs:
        count = final_count(a, b, mesh, rule)
        try:
            out["final"][a, b] = equivalence.verdict(final[a], final[b], count, growth, steps=steps)
        except ValueError:  # further apart than count x steps: the growth decides (measured once)
            growth = growth or equivalence.twin_growth(params, [place(h, mesh, "sharded") for h in hosts], mesh,
                                                       loss_terms=loss_terms, optimizer=tx, opt_state=state)
            out["final"][a, b] = equivalence.verdict(final[a], final[b], count, growth)
    return out


@pytest.mark.slow
@settings(max_examples=examples(8), deadline=None)
@given(kind=st.sampled_from(["relu", "gelu", "attention", "notebook"]), rule=st.sampled_from(list(SOAK_RATES)),
       which=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_no_correct_pair_is_outside_over_drawn_models_rules_and_rates(mesh, verdict_rules, kind, rule, which,
                                                                       seed):
    # Both verdicts, every correct pair, ordinary and chaotic rates: never OUTSIDE (no
    # bound: "outside the domain", said so). The planted bugs: OUTSIDE step by step at
    # ordinary rates, wherever a step was judged.
    rate = SOAK_RATES[rule][which % len(SOAK_RATES[rule])]
    found = soak_run(mesh, verdict_rules, kind, rule, rate, seed, steps=6)
    for what in ("stepwise", "final"):
        for pair, v in found[what].items():
            assert v.case != "OUTSIDE", (kind, rule, rate, what, pair, v.text)
    if rate <= ORDINARY[rule]:
        for bug, v in found["bugs"].items():
            assert v.case == "OUTSIDE", (kind, rule, rate, bug, v.text)
    if rule in ADAPTIVE:  # no count for the params: identical or no verdict, never within
        assert all(v.case in ("identical", "outside the domain") for v in found["final"].values())


def relu_notebook_terms(params: list, batch: dict):
    """The notebooks' MLP (model.py's list of (w, b)) with ReLU hidden layers in place of tanh."""
    x_BxD = batch["images"].reshape(batch["images"].shape[0], -1)
    for w, b in params[:-1]:
        x_BxD = jax.nn.relu(x_BxD @ w + b)
    w, b = params[-1]
    logp_BxC = jax.nn.log_softmax(x_BxD @ w + b)
    nll_B = -jnp.take_along_axis(logp_BxC, batch["labels"][:, None], axis=1)[:, 0]
    mask_B = batch["mask"].astype(logp_BxC.dtype)
    return jnp.sum(mask_B * nll_B), jnp.sum(mask_B)


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.02, 0.1, 0.5])
def test_the_issues_relu_mlp_at_its_rates(mesh, verdict_rules, rate):
    # The notebooks' MLP (3072-32-16-10) with ReLU, 20 steps of 8 x 16 rows, uneven masks, at
    # the issue's rates: the final params get no bound where the twins cross kinks, the
    # planted bugs are OUTSIDE step by step, no correct pair is OUTSIDE either way.
    n, steps = mesh.devices.size, 20
    hosts = notebook_hosts(int(rate * 100), steps, n)
    params, tx = model.init_model(SMALL_LAYERS), verdict_rules["sgd"]
    state = with_rate(tx.init(params), rate)
    growth = equivalence.twin_growth(params, hosts, mesh, loss_terms=relu_notebook_terms, optimizer=tx,
                                     opt_state=state)
    if rate < 0.5:  # measured: kinks within 20 steps at 0.02 and 0.1; at 0.5 these twins crossed none
        assert "kinks" in growth.outside(), growth.outside()
    assert growth.outside() is None or "kinks" in growth.outside(), growth.outside()
    judge = functools.partial(equivalence.stepwise_verdict, params=params, batches=hosts, mesh=mesh,
                              loss_terms=relu_notebook_terms, optimizer=tx, opt_state=state)
    count = bound("sharded", "single", mesh)
    for kind in PLANTED:
        found = judge("single", PLANTED[kind], count=count)
        assert found.case == "OUTSIDE", (kind, found.text)
    final = {}
    for name in ("sharded", "single"):
        final[name] = strategies.STRATEGIES[name](params, [place(h, mesh, "sharded") for h in hosts], mesh,
                                                  loss_terms=relu_notebook_terms, optimizer=tx,
                                                  opt_state=state).params
        found = judge("single", name)
        assert found.case in ("identical", "within"), found.text
    found = equivalence.verdict(final["sharded"], final["single"], count, growth)
    assert found.case in ("identical", "within", "outside the domain"), found.text


def stepwise_table() -> None:
    """The figures stepwise_verdict's docstring quotes: on 8 CPU devices, 8 steps of 8 x 16
    rows with uneven masks, per model, rule and rate, the correct pairs' largest distance a
    counted rounding among the judged steps and leaves, the share not judged, and the
    planted bugs' smallest distance a counted rounding."""
    import optax
    mesh = loaders.data_mesh(jax.devices("cpu"))
    rules = {"sgd": strategies.sgd(0.1), "momentum": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1,
                                                                                         momentum=BETA),
             "adam": optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
             "adamw": optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
             "chain": optax.chain(optax.clip_by_global_norm(1.0),
                                  optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3))}
    pairs = [("single", "sharded"), ("single", "pmap"), ("single", "shard_map"), ("sharded", "pmap"),
             ("pmap", "shard_map")]
    worst, weakest = 0.0, np.inf
    for kind in ("relu", "gelu", "attention", "notebook"):
        loss_terms, params, hosts_of = soak_model(kind)
        hosts = hosts_of(1, 8, mesh.devices.size)
        for rule, tx in rules.items():
            for rate in SOAK_RATES[rule]:
                state = with_rate(tx.init(params), rate)
                measure = functools.partial(equivalence.stepwise_distances, params=params, batches=hosts, mesh=mesh,
                                            loss_terms=loss_terms, optimizer=tx, opt_state=state)
                correct, skipped, total = 0.0, 0, 0
                for a, b in pairs:
                    each, twin, _, diverged = measure(strategies.STRATEGIES[a], strategies.LAYOUT[a],
                                                      strategies.STRATEGIES[b], strategies.LAYOUT[b])
                    judged = twin <= equivalence.STEP_UNITS
                    count = bound(a, b, mesh)
                    if count and judged.any():
                        correct = max(correct, float(np.nanmax(np.where(judged, each, 0.0))) / count)
                    skipped, total = skipped + int((~judged).sum()), total + judged.size
                bugs = []
                for bug, fn in PLANTED.items():
                    each, twin, _, _ = measure(strategies.single, "sharded", fn, "sharded")
                    judged = twin <= equivalence.STEP_UNITS
                    bugs.append(float(np.max(np.where(judged, each, 0.0))) / bound("sharded", "single", mesh))
                worst = max(worst, correct)
                if rate <= ORDINARY[rule]:
                    weakest = min(weakest, min(bugs))
                print(f"{kind:>9} {rule:>8} lr {rate:<6g} correct <= {correct:6.2f} units a rounding, "
                      f"{skipped}/{total} not judged; bugs >= {min(bugs):9.3g} ({', '.join(f'{x:.3g}' for x in bugs)})"
                      f"{'' if diverged is None else f'; diverged at step {diverged}'}", flush=True)
    print(f"largest correct: {worst:.2f} units a rounding; weakest bug at ordinary rates: {weakest:.3g}")


# --------------------------------------------------------------------------
# Negative controls: wrong steps that the same comparison must catch
# --------------------------------------------------------------------------


def _notebook_step(params, batch, learning_rate):
    # The notebooks' pmap step: mean over this device's real samples, then pmean.
    grads = jax.grad(model.loss)(params, batch)
    grads = lax.pmean(grads, model.AXIS)
    return model.sgd(params, grads, learning_rate), jnp.float32(0)


def notebook_pmap(params, batches, mesh, *, loss_terms, optimizer):
    devices = list(mesh.devices.flat)
    step = jax.pmap(_notebook_step, axis_name=model.AXIS, in_axes=(0, 0, None), devices=devices)
    params = strategies.stack_replicas(params, mesh)
    learning_rate = float(optimizer.init(params)["learning_rate"])
    for batch in batches:
        params, _ = step(params, batch, learning_rate)
    return strategies.first_replica(params), None, None


def n_times_shard_map(params, batches, mesh, *, loss_terms, optimizer):
    # A direct port of the pmap step to jax.shard_map with check_vma=True: the grad
    # of the replicated params is already summed over devices, so pmean changes
    # nothing and the step is n times too large.
    def step(p, batch, lr):
        grads = lax.pmean(jax.grad(model.loss)(p, batch), model.AXIS)
        return model.sgd(p, grads, lr)

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(model.AXIS), P()), out_specs=P()))
    params = strategies.replicate(params, mesh)
    learning_rate = float(optimizer.init(params)["learning_rate"])
    for batch in batches:
        params = step(params, batch, learning_rate)
    return strategies.to_host(params), None, None


def test_notebook_pmean_is_caught_with_uneven_masks(mesh, small_params):
    n = mesh.devices.size
    counts = [B] + [1] * (n - 1)  # device 0 full, the others mostly padding
    hosts = host_batches(seed=1, steps=2, n=n, real_per_device=counts)
    expected = train("sharded", strategies.sharded, small_params, hosts, 0.1, mesh)[0]
    wrong = train("pmap", notebook_pmap, small_params, hosts, 0.1, mesh)[0]
    with pytest.raises(AssertionError, match="differs"):
        assert_params_close(wrong, expected, ulps_per_step=bound("pmap", "single", mesh), steps=2,
                            what="notebook pmean")


def test_notebook_pmean_agrees_when_every_device_is_full(mesh, small_params):
    # Why the notebooks never noticed: with equal counts per device the mean of the
    # per-device means is the global mean (up to rounding).
    n = mesh.devices.size
    hosts = host_batches(seed=2, steps=2, n=n, real_per_device=[B] * n)
    expected = train("sharded", strategies.sharded, small_params, hosts, 0.1, mesh)[0]
    notebook = train("pmap", notebook_pmap, small_params, hosts, 0.1, mesh)[0]
    assert_params_close(notebook, expected, ulps_per_step=bound("pmap", "single", mesh), steps=2,
                        what="notebook pmean")


def test_n_times_gradient_shard_map_port_is_caught(mesh, small_params):
    n = mesh.devices.size
    hosts = host_batches(seed=3, steps=1, n=n, real_per_device=[B] * n)
    params0 = small_params
    expected = train("shard_map", strategies.shard_map, params0, hosts, 0.1, mesh)[0]
    wrong = train("shard_map", n_times_shard_map, params0, hosts, 0.1, mesh)[0]
    with pytest.raises(AssertionError, match="differs"):
        assert_params_close(wrong, expected, ulps_per_step=bound("shard_map", "single", mesh),
                            steps=1, what="n-times port")
    # And it is n times, not merely different: the update is n times the correct one.
    right_step = np.asarray(expected[0][0]) - params0[0][0]
    wrong_step = np.asarray(wrong[0][0]) - params0[0][0]
    np.testing.assert_allclose(wrong_step, n * right_step, rtol=1e-3, atol=1e-6)


# --------------------------------------------------------------------------
# End to end through the real loader (refimpl.py end to end: test_refimpl.py)
# --------------------------------------------------------------------------


def test_one_epoch_end_to_end(synthetic_dir, mesh, devices, small_params):
    params0 = small_params
    test_loader = loaders.make_loader(synthetic_dir, devices[:1], 50, filename_prefix=TEST_PREFIX)
    trained, accuracy = {}, {}
    for name, fn in strategies.STRATEGIES.items():
        # B (4 per device, the property test's shapes: its compiled steps serve here too)
        train_loader = loaders.make_loader(synthetic_dir, mesh, B, layout=strategies.LAYOUT[name],
                                           shuffle=True, seed=7, placement="device")
        trained[name], losses, _ = fn(params0, train_loader.epoch(0), mesh, loss_terms=model.loss_terms,
                                      optimizer=strategies.sgd(0.001))
        assert losses.shape == (len(train_loader),) and np.isfinite(losses).all()
        accuracy[name] = model.accuracy(trained[name], test_loader.epoch(0))
    steps = len(train_loader)
    names = list(trained)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert_params_close(trained[a], trained[b], steps=steps, ulps_per_step=bound(a, b, mesh),
                                what=f"{a} vs {b}")
    # An ulp-level difference can flip at most a near-tie prediction.
    for name in ("pmap", "shard_map", "single"):
        assert abs(accuracy[name] - accuracy["sharded"]) <= 1 / 200, (name, accuracy)


def measure_drift(runs: int = 42, seed: int = 1) -> dict:
    """Largest ulps a step (ulps_apart's unit), max |diff| / (lr * steps), and (SGD only) the
    largest share of the derived bound reached (equivalence.verdict: ulps / bound in the
    growth's unit), between each pair of strategies, per update rule (strategies.sgd,
    optax.sgd with momentum 0.9, optax.adam) and model, over ``runs`` random runs of 1-8
    steps at rates 1e-3 to 0.1 on this process's CPU devices."""
    import optax

    mesh = loaders.data_mesh(jax.devices("cpu"))
    n, rng = mesh.devices.size, np.random.default_rng(seed)
    rates = (1e-3, 1e-2, 0.1)  # one optimizer object per rate: compiled once
    rules = {"sgd": {lr: strategies.sgd(lr) for lr in rates},
             "momentum": {lr: optax.sgd(lr, momentum=BETA) for lr in rates},
             "adam": {lr: optax.adam(lr) for lr in rates}}
    initial = {"mlp": model.init_model(SMALL_LAYERS), "linear": linear_init()}
    worst = {}
    for run in range(runs):
        kind, steps = ("mlp", "linear")[run % 2], int(rng.integers(1, 9))
        counts = [max(int(c), k == 0) for k, c in enumerate(rng.integers(0, B + 1, n))]
        lr = float(rng.choice(rates))
        hosts = host_batches(int(rng.integers(2**31)), steps, n, counts, kind)
        for rule, by_rate in rules.items():
            out = {name: train(name, fn, initial[kind], hosts, lr, mesh, MODELS[kind][0], by_rate[lr])[0]
                   for name, fn in strategies.STRATEGIES.items()}
            growth = None
            if rule == "sgd":  # the derived bound's unit and growth: how close to it each pair ends
                growth = equivalence.twin_growth(initial[kind], [place(h, mesh, "sharded") for h in hosts], mesh,
                                                loss_terms=MODELS[kind][0], optimizer=by_rate[lr])
            names = list(out)
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    old = worst.get((rule, kind, a, b), (0.0, 0.0, 0.0))
                    near = 0.0
                    if growth is not None:
                        found = equivalence.verdict(out[a], out[b], bound(a, b, mesh), growth)
                        near = found.ulps / found.bound if found.bound else float(found.case == "OUTSIDE")
                    worst[rule, kind, a, b] = (max(old[0], equivalence.ulps_apart(out[a], out[b]) / steps),
                                               max(old[1], largest_difference(out[a], out[b]) / (lr * steps)),
                                               max(old[2], near))
    return worst


def rate_table() -> None:
    """The verdicts docs/guarantees.md quotes: the token model and the MLP on 2 devices at the
    issue's rates over 120 steps, and the two wrong strategies, against single."""
    mesh = loaders.data_mesh(jax.devices("cpu")[:2])
    wrong = {"dropped device": dropped_device, "gradient x (1 + 1e-6)": scaled_gradient}
    for kind, rates in (("token", (1.0, 5.0, 10.0, 12.0, 20.0, 40.0)), ("mlp", (0.5, 1.0, 1.5, 2.0, 5.0))):
        for steps in (2, 120):
            for rate in rates:
                verdicts(kind, long_hosts(kind, steps), mesh, rate, wrong)


# --------------------------------------------------------------------------
# The canonical reduction: the same bits on every topology (strategies.canonical_step)
# --------------------------------------------------------------------------
#
# A fixed global batch (the loader's logical shards: plan.on_devices) trained with
# reduction="canonical" gives the same params, optimizer state and losses, bit for bit
# (compared as uint32 views), on every device count n dividing L, through every
# strategy, and on one device adding the L blocks as microbatches: at ordinary and at
# chaotic rates, with a masked tail (fill) or drop, shuffled or not. Models: a ReLU MLP
# over float features and a one-layer causal attention model over tokens (a ReLU MLP
# block), both dicts of params; optimizers: strategies.sgd, optax.adam, and a chain
# (clip_by_global_norm then adamw), their rates held in the state (inject_hyperparams),
# so a rate is a value, not a new compilation.

CANON_N, CANON_FEATURES, CANON_CLASSES, CANON_WIDTH = 101, 12, 4, 24  # N: not a multiple of any L
SEQ, VOCAB, WIDTH = 8, 16, 16  # the attention model's tokens
WIDE = 1367  # 12 x 1367 = 16,404 >= strategies.SMALL_LEAF; not a multiple of 8 (chunks padded on 8)


def relu_loss_terms(params: dict, batch: dict):
    """A ReLU MLP over float features (B, 12), 4 classes: where twins cross ReLU kinks."""
    hidden_BxH = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    logits_BxC = hidden_BxH @ params["w2"] + params["b2"]
    nll_B = -jnp.take_along_axis(jax.nn.log_softmax(logits_BxC), batch["y"][:, None], axis=1)[:, 0]
    mask_B = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask_B * nll_B), jnp.sum(mask_B)


def attention_loss_terms(params: dict, batch: dict):
    """One causal self-attention layer and a ReLU MLP block over tokens (B, 8) of a
    vocabulary of 16, predicting each next token; the loss is summed over real samples."""
    x_BxTxD = params["embed"][batch["x"]] + params["position"]
    q, k, v = (x_BxTxD @ params[name] for name in ("wq", "wk", "wv"))
    scores_BxTxT = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(WIDTH).astype(np.float32)
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    attended = jax.nn.softmax(jnp.where(causal, scores_BxTxT, -1e9), axis=-1) @ v
    x_BxTxD = x_BxTxD + attended @ params["wo"]
    x_BxTxD = x_BxTxD + jax.nn.relu(x_BxTxD @ params["up"]) @ params["down"]
    logits = x_BxTxD[:, :-1] @ params["embed"].T
    nll_BxT = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["x"][:, 1:, None], axis=2)[..., 0]
    mask_B = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask_B * jnp.sum(nll_BxT, axis=1)), jnp.sum(mask_B)


def conv_loss_terms(params: dict, batch: dict):
    """A 3x3 convolution (SAME, NHWC) with ReLU over images (B, 4, 4, 16), averaged over the
    pixels, then a linear layer to 4 classes: a model with a leaf of rank 4."""
    y_BxHxWxK = lax.conv_general_dilated(batch["x"], params["kernel"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
    logits_BxC = jax.nn.relu(y_BxHxWxK).mean(axis=(1, 2)) @ params["w"] + params["b"]
    nll_B = -jnp.take_along_axis(jax.nn.log_softmax(logits_BxC), batch["y"][:, None], axis=1)[:, 0]
    mask_B = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask_B * nll_B), jnp.sum(mask_B)


CONV_KERNEL = (3, 3, 16, 384)  # 55,296 entries, 18,432 after its first axis: both >= SMALL_LEAF


def canonical_model(kind: str):
    """(loss_terms, params, data) of ``kind``: fixed shapes, CANON_N samples. "wide" is the
    ReLU model with WIDE hidden units: its first layer has 12 x 1367 = 16,404 entries, over
    strategies.SMALL_LEAF, as the notebooks' 3072 x 1024 is."""
    rng = np.random.default_rng(7)
    if kind in ("relu", "wide"):
        width = WIDE if kind == "wide" else CANON_WIDTH
        params = {"w1": (0.5 * rng.standard_normal((CANON_FEATURES, width))).astype(np.float32),
                  "b1": np.zeros(width, np.float32),
                  "w2": (0.5 * rng.standard_normal((width, CANON_CLASSES))).astype(np.float32),
                  "b2": np.zeros(CANON_CLASSES, np.float32)}
        x = rng.standard_normal((CANON_N, CANON_FEATURES)).astype(np.float32)
        data = {"x": x, "y": (np.argmax(x[:, :CANON_CLASSES], axis=1)).astype(np.int32)}
        return relu_loss_terms, params, data
    if kind == "conv":
        params = {"kernel": (0.1 * rng.standard_normal(CONV_KERNEL)).astype(np.float32),
                  "w": (0.3 * rng.standard_normal((CONV_KERNEL[-1], CANON_CLASSES))).astype(np.float32),
                  "b": np.zeros(CANON_CLASSES, np.float32)}
        x = rng.standard_normal((CANON_N, 4, 4, CONV_KERNEL[2])).astype(np.float32)
        return conv_loss_terms, params, {"x": x, "y": (np.argmax(x[:, 0, 0, :CANON_CLASSES], axis=1)).astype(np.int32)}
    shapes = {"embed": (VOCAB, WIDTH), "position": (SEQ, WIDTH), "wq": (WIDTH, WIDTH), "wk": (WIDTH, WIDTH),
              "wv": (WIDTH, WIDTH), "wo": (WIDTH, WIDTH), "up": (WIDTH, 2 * WIDTH), "down": (2 * WIDTH, WIDTH)}
    params = {name: (0.3 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}
    start = rng.integers(0, VOCAB, (CANON_N, 1))
    tokens = (start + np.arange(SEQ) * rng.integers(1, 4, (CANON_N, 1))) % VOCAB  # learnable strides
    return attention_loss_terms, params, {"x": tokens.astype(np.int32)}


@pytest.fixture(scope="module")
def canonical_rules():
    """One optimizer object per rule for the module, the rate in its state (set per run)."""
    optax = pytest.importorskip("optax")
    return {"sgd": strategies.sgd(0.1),
            "adam": optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
            "chain": optax.chain(optax.clip_by_global_norm(1.0),
                                 optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3))}


def with_rate(opt_state, rate: float):
    """``opt_state`` with every 'learning_rate' entry set to ``rate`` (float32)."""
    def set_rate(path, leaf):
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        return np.float32(rate) if "learning_rate" in names else leaf
    return jax.tree_util.tree_map_with_path(set_rate, opt_state)


def canonical_run(devices, strategy: str, n: int, *, kind: str, rule, rate: float, L: int, b: int,
                  last_batch: str, shuffle: bool, epochs: int = 1, reduction: str = "canonical"):
    """(params, opt_state, losses) of ``strategy`` on the first n devices, the batches from
    make_loader(logical_shards=L, batch_size=b) over the model's data."""
    loss_terms, params, data = canonical_model(kind)
    mesh = loaders.data_mesh(devices[:n])
    loader = loaders.make_loader(data, mesh, b, logical_shards=L, shuffle=shuffle, seed=3,
                                 last_batch=last_batch, layout=strategies.LAYOUT[strategy], prefetch=0)
    opt_state = with_rate(rule.init(params), rate)
    losses = []
    for epoch in range(epochs):
        extra = {"logical_shards": L} if reduction == "canonical" else {}
        params, step_losses, opt_state = strategies.STRATEGIES[strategy](
            params, loader.epoch(epoch), mesh, loss_terms=loss_terms, optimizer=rule, opt_state=opt_state,
            reduction=reduction, **extra)
        losses.append(step_losses)
    return params, opt_state, np.concatenate(losses)


def uint_views(result) -> list:
    return [np.asarray(x).view({2: np.uint16, 4: np.uint32, 8: np.uint64}[np.asarray(x).dtype.itemsize])
            for x in jax.tree.leaves(result)]


def same_bits_everywhere(runs: dict) -> list[str]:
    """The runs ({(strategy, n): result}) whose bits differ from the first one's, named."""
    (first, want), *rest = runs.items()
    want = uint_views(want)
    differ = []
    for key, result in rest:
        got = uint_views(result)
        if len(got) != len(want) or any(not np.array_equal(x, y) for x, y in zip(got, want)):
            differ.append(f"{key} differs from {first}")
    return differ


def divisors(L: int, most: int) -> list[int]:
    return [n for n in range(1, most + 1) if L % n == 0]


def case_id(case) -> str:
    return f"{case['kind']}-{case['rule']}-lr{case['rate']:g}-L{case['L']}"


CANONICAL_CASES = [  # both models, all three rules, a chaotic rate, fill and drop, L = 4, 6, 8, 12
    dict(kind="relu", rule="adam", rate=1e-2, L=8, b=3, last_batch="fill", shuffle=True),
    dict(kind="attention", rule="sgd", rate=20.0, L=6, b=2, last_batch="drop", shuffle=False),
    pytest.param(dict(kind="relu", rule="chain", rate=1e-2, L=12, b=1, last_batch="fill", shuffle=False),
                 marks=pytest.mark.slow),
    pytest.param(dict(kind="attention", rule="adam", rate=40.0, L=4, b=4, last_batch="fill", shuffle=True),
                 marks=pytest.mark.slow),
]
PARALLEL = ("sharded", "pmap", "shard_map")


def topologies(L: int, most: int, every: bool) -> list[tuple[str, int]]:
    """(strategy, n) pairs to run besides ("single", 1): with ``every``, each parallel
    strategy on each n dividing L (up to ``most`` devices); otherwise each strategy on the
    largest such n and the smaller n taken in turn by sharded, pmap and shard_map, so that
    every device count runs and, where L has four divisors or more, every strategy on two
    (the suite's default; --run-slow runs every pair)."""
    counts = divisors(L, most)
    if every:
        return [(s, n) for n in counts for s in PARALLEL]
    return [(s, counts[-1]) for s in PARALLEL] + [(PARALLEL[i % 3], n) for i, n in enumerate(counts[:-1])]


def test_topologies_cover_every_strategy_and_device_count():
    for L, most in [(8, 8), (6, 8), (12, 8), (4, 8), (24, 3)]:
        counts = divisors(L, most)
        every = topologies(L, most, True)
        assert len(every) == 3 * len(counts) == len(set(every))
        some = topologies(L, most, False)
        assert set(some) <= set(every) and {n for _, n in some} == set(counts)
        assert all((strategy, counts[-1]) in some for strategy in PARALLEL)
        smaller = [s for s, n in some if n != counts[-1]]
        assert len(smaller) == len(counts) - 1 and len(set(smaller)) == min(3, len(counts) - 1)


@pytest.mark.parametrize("case", CANONICAL_CASES, ids=case_id)
def test_canonical_reduction_is_bit_identical_on_every_topology(devices, canonical_rules, case, request):
    # Every strategy and every n dividing L against single; by default the topologies()
    # rotation of them, every pair with --run-slow.
    case = dict(case, rule=canonical_rules[case["rule"]])
    pairs = topologies(case["L"], len(devices), request.config.getoption("--run-slow"))
    runs = {("single", 1): canonical_run(devices, "single", 1, **case)}
    for strategy, n in pairs:
        runs[(strategy, n)] = canonical_run(devices, strategy, n, **case)
    assert len(runs) == 1 + len(pairs)
    assert not same_bits_everywhere(runs), same_bits_everywhere(runs)
    if case["rate"] >= 20:  # chaotic: the losses wander, and still every topology agrees
        losses = runs[("single", 1)][2]
        assert np.ptp(losses) > 0.1 * abs(losses[0]) or not np.isfinite(losses).all(), losses


@settings(max_examples=examples(1), deadline=None)
@given(kind=st.sampled_from(["relu", "attention"]), rule=st.sampled_from(["sgd", "adam", "chain"]),
       rate=st.sampled_from([1e-3, 0.1, 1.0, 20.0, 40.0]), L=st.sampled_from([4, 6, 8, 12]),
       b=st.integers(1, 3), last_batch=st.sampled_from(["fill", "drop"]), shuffle=st.booleans())
def test_canonical_reduction_on_drawn_runs(devices, canonical_rules, kind, rule, rate, L, b, last_batch,
                                           shuffle):
    case = dict(kind=kind, rule=canonical_rules[rule], rate=rate, L=L, b=b, last_batch=last_batch,
                shuffle=shuffle)
    runs = {("single", 1): canonical_run(devices, "single", 1, **case)}
    for n in divisors(L, len(devices)):
        runs[("shard_map", n)] = canonical_run(devices, "shard_map", n, **case)
    assert not same_bits_everywhere(runs), same_bits_everywhere(runs)


def test_a_leaf_of_small_leaf_entries_or_more_goes_by_all_to_all_with_the_same_bits(devices, canonical_rules):
    """canonical_sums' step 2 for a leaf of SMALL_LEAF entries or more (the notebooks' first
    layer): all_to_all of its chunks, each device folding one chunk of every block, zero
    padding to n chunks, then an all_gather of the folded chunks. On one device (single:
    the whole leaf folded in place) and on 3, 6 and 8 devices (16,404 entries: chunks of
    5,468, 2,734, and 2,051 padded by 4) every strategy ends on the same bits, Adam, the
    last batch padded and masked; a smaller leaf (b1, w2, b2) goes the other way in the
    same runs."""
    assert CANON_FEATURES * WIDE >= strategies.SMALL_LEAF > WIDE * CANON_CLASSES and CANON_FEATURES * WIDE % 8
    case = dict(kind="wide", rule=canonical_rules["adam"], rate=1e-2, L=24, b=1, last_batch="fill", shuffle=True)
    runs = {("single", 1): canonical_run(devices, "single", 1, **case)}
    counts = [n for n in (3, 6, 8) if n <= len(devices)]
    for strategy, n in zip(("sharded", "shard_map", "pmap"), counts):
        runs[(strategy, n)] = canonical_run(devices, strategy, n, **case)
    assert len(runs) == 1 + len(counts)
    assert not same_bits_everywhere(runs), same_bits_everywhere(runs)


def test_a_leaf_of_any_rank_goes_by_all_to_all_with_the_same_bits(devices, canonical_rules):
    """canonical_sums' step 2 ravels a leaf whatever its rank: a convolution kernel
    (3, 3, 16, 384), SMALL_LEAF entries or more, goes by all_to_all in chunks of the whole
    leaf, and single on one device, sharded on 2 and shard_map and pmap on 4 end on the
    same bits (SGD, the last batch padded and masked). A fold that took the leaf's size
    from all but its first axis would split 18,432 entries into chunks, not 55,296."""
    assert int(np.prod(CONV_KERNEL[1:])) >= strategies.SMALL_LEAF and len(CONV_KERNEL) == 4
    case = dict(kind="conv", rule=canonical_rules["sgd"], rate=0.1, L=4, b=2, last_batch="fill", shuffle=False)
    runs = {("single", 1): canonical_run(devices, "single", 1, **case)}
    for strategy, n in (("sharded", 2), ("shard_map", 4), ("pmap", 4)):
        if n <= len(devices):
            runs[(strategy, n)] = canonical_run(devices, strategy, n, **case)
    assert len(runs) >= 2 and np.isfinite(runs[("single", 1)][2]).all()
    assert not same_bits_everywhere(runs), same_bits_everywhere(runs)


def canonical_sums_on(loss_terms, params, rows: dict, L: int, counts) -> dict:
    """{n: canonical_gradients' (gradient sums, loss sum, count) as host arrays} on the
    first n devices, for each n in ``counts``: the same global rows, L logical shards."""
    out = {}
    for n in counts:
        mesh = loaders.data_mesh(jax.devices()[:n])
        batch = jax.device_put(rows, jax.sharding.NamedSharding(mesh, P(strategies.AXIS)))
        sums = strategies.canonical_gradients(loss_terms, mesh, L)(strategies.replicate(params, mesh), batch)
        out[n] = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), sums)
    return out


def test_canonical_gradients_compile_alike_on_every_mesh_on_attention():
    """The block program is compiled alike on every mesh (CANONICAL_XLA_OPTIONS): on the
    attention model, whose softmax gradient XLA:CPU's CSE rewrites on one device only (a
    divide by a broadcast made a multiply by a reciprocal, then an FMA), the gradient
    sums, loss sum and count of one step are the same bits on 1, 2 and 4 devices. With
    the CSE passes on, 364 entries of four leaves differ (JAX 0.10.2, CPU)."""
    loss_terms, params, data = canonical_model("attention")
    rows = {"x": data["x"][:8], "mask": np.array([1, 1, 1, 0, 1, 1, 1, 1], bool)}
    sums = canonical_sums_on(loss_terms, params, rows, 4, [n for n in (1, 2, 4) if n <= len(jax.devices())])
    assert len(sums) >= 2
    assert not same_bits_everywhere(sums), same_bits_everywhere(sums)


def test_the_fold_keeps_the_sign_of_a_zero_sum_and_pads_any_width():
    """canonical_sums' fold over all_to_all chunks is one device's left fold exactly: it
    starts from block 0 itself (a sum of -0.0 gradients stays -0.0; 0 + -0.0 is +0.0) and
    pads a leaf to n chunks with zeros that reach no entry. A leaf of 129 x 128 = 16,512
    entries (>= SMALL_LEAF; 16,512 = 5 x 3,302 + 2, so 5 devices pad it by 3) whose
    features past the fifth are -0.0 in every row: its sums on 1, 2 and 5 devices are the
    same bits, -0.0 included."""
    def loss_terms(params, batch):
        mask_B = batch["mask"].astype(jnp.float32)
        return jnp.sum(mask_B * jnp.sum(batch["x"] * params["w"].reshape(-1), axis=1)), jnp.sum(mask_B)
    shape = (129, 128)
    x = np.full((10, shape[0] * shape[1]), -0.0, np.float32)
    x[:, :5] = np.random.default_rng(4).standard_normal((10, 5))
    rows = {"x": x, "mask": np.arange(10) % 4 != 3}
    sums = canonical_sums_on(loss_terms, {"w": np.ones(shape, np.float32)}, rows, 10,
                             [n for n in (1, 2, 5) if n <= len(jax.devices())])
    one = sums[1][0]["w"].reshape(-1)
    assert np.signbit(one[5:]).all() and (one[5:] == 0).all() and (one[:5] != 0).all(), one[:8]
    assert shape[0] * shape[1] >= strategies.SMALL_LEAF and shape[0] * shape[1] % 5 and len(sums) >= 2
    assert not same_bits_everywhere(sums), same_bits_everywhere(sums)


def test_the_canonical_step_is_the_mean_gradient_over_the_steps_real_rows(devices):
    """update_program's arithmetic, against the plain formula: each step's gradient is the
    gradient of the step's loss sum over all its rows divided by its count of real
    samples, max(count, 1), then the update; the step's loss is the loss sum over the same
    count. Held to float32 rounding (the canonical order of summation is not jax.grad's
    on the whole batch) over an epoch of 26 steps of L = 4 blocks of 1 row (101 samples:
    the last step has one real sample, where max(count, 1) and max(count, 2) part), SGD
    at 0.5 through an update function of this test's own (so that the step is compiled
    anew here, not reused from another test's cache)."""
    loss_terms, params0, data = canonical_model("relu")
    n = max(d for d in divisors(4, len(devices)))
    mesh = loaders.data_mesh(devices[:n])
    loader = loaders.make_loader(data, mesh, 1, logical_shards=4, shuffle=True, seed=3, last_batch="fill", prefetch=0)
    rule = strategies.Optimizer(lambda p: {"learning_rate": np.float32(0.5)},
                                lambda g, s, p=None: strategies.sgd_update(g, s, p))
    params, losses, _ = strategies.sharded(params0, loader.epoch(0), mesh, loss_terms=loss_terms, optimizer=rule,
                                           reduction="canonical", logical_shards=4)
    want, want_losses, counts = jax.tree.map(np.asarray, params0), [], []
    for batch in loader.epoch(0):
        batch = jax.tree.map(np.asarray, batch)
        (total, count), grads = jax.value_and_grad(lambda p: loss_terms(p, batch), has_aux=True)(want)
        counts.append(float(count))
        denominator = max(float(count), 1.0)
        want = jax.tree.map(lambda p, g: np.asarray(p - np.float32(0.5) * (np.asarray(g) / np.float32(denominator))),
                            want, grads)
        want_losses.append(float(total) / denominator)
    assert len(counts) == 26 and counts[-1] == 1.0 and set(counts[:-1]) == {4.0}
    np.testing.assert_allclose(np.asarray(losses), want_losses, rtol=2e-6)
    for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)


def test_canonical_negative_controls(devices, canonical_rules):
    # 1. The plain reduction on another device count: not the same bits (the claim is the
    #    canonical reduction's; the plain one's psum order follows n).
    case = dict(kind="relu", rule=canonical_rules["sgd"], rate=0.5, L=8, b=3, last_batch="fill", shuffle=True)
    plain = {(s, n): canonical_run(devices, s, n, reduction="plain", **case)
             for s, n in [("shard_map", 8), ("shard_map", 2), ("single", 1)]}
    assert len(same_bits_everywhere(plain)) == 2, same_bits_everywhere(plain)
    # 2. The gradient-accumulation bug class: each microbatch's mean, then the mean of those
    #    means (what a per-microbatch normalisation gives), is not the canonical step.
    loss_terms, params, data = canonical_model("relu")
    mesh = loaders.data_mesh(devices[:1])
    loader = loaders.make_loader(data, mesh, 3, logical_shards=8, shuffle=True, seed=3, prefetch=0)
    batch = loader.batch(0, len(loader) - 1)  # the masked tail: blocks of unequal real counts
    state = strategies.replicate((params, strategies.sgd(0.5).init(params)), mesh)
    canonical = strategies.canonical_step(loss_terms, strategies.sgd_update, mesh, 8)(state, batch)

    def mean_of_means(params, batch):
        blocks = jax.tree.map(lambda x: x.reshape((8, -1) + x.shape[1:]), batch)
        def mean(block):
            total, count = loss_terms(params, block)
            return total / jnp.maximum(count, 1.0)
        return jnp.mean(jax.vmap(mean)(blocks))
    grads = jax.grad(mean_of_means)(params, jax.device_get(batch))
    wrong = jax.tree.map(lambda p, g: p - np.float32(0.5) * g, params, grads)
    assert np.asarray(batch["mask"]).sum() not in (0, 24)  # a tail: the two normalisations differ
    assert largest_difference(wrong, strategies.to_host(canonical[0][0])) > 1e-4
    # 3. A device that reads another device's logical shards: its blocks are then another
    #    global batch, and the canonical params are not the same bits.
    good = canonical_run(devices, "shard_map", 4, **case)
    crossed = _crossed_run(devices, **case)
    assert same_bits_everywhere({"good": good, "crossed": crossed}), "a crossed read went unnoticed"


def _crossed_run(devices, *, kind, rule, rate, L, b, last_batch, shuffle):
    """canonical_run on 4 devices, but devices 1 and 2 swap their logical shards' rows."""
    loss_terms, params, data = canonical_model(kind)
    mesh = loaders.data_mesh(devices[:4])
    loader = loaders.make_loader(data, mesh, b, logical_shards=L, shuffle=shuffle, seed=3,
                                 last_batch=last_batch, prefetch=0)
    rows = (L // 4) * b

    def crossed(batches):
        for batch in batches:
            host = {k: np.asarray(v) for k, v in batch.items()}
            swapped = {k: np.concatenate([v[:rows], v[2 * rows:3 * rows], v[rows:2 * rows], v[3 * rows:]])
                       for k, v in host.items()}
            yield jax.device_put(swapped, jax.sharding.NamedSharding(mesh, P("data")))
    params, losses, opt_state = strategies.shard_map(
        params, crossed(loader.epoch(0)), mesh, loss_terms=loss_terms, optimizer=rule,
        opt_state=with_rate(rule.init(params), rate), reduction="canonical", logical_shards=L)
    return params, opt_state, losses


if __name__ == "__main__":
    # python test_equivalence.py drift [runs] [seed]: the figures equivalence.ulp_bound quotes.
    # python test_equivalence.py rates: the verdicts at the issue's rates (docs/guarantees.md).
    # python test_equivalence.py stepwise: the figures equivalence.stepwise_verdict quotes.
    import sys
    import conftest  # noqa: F401  (8 CPU devices, matmul precision "highest")
    if sys.argv[1:2] == ["rates"]:
        rate_table()
        sys.exit(0)
    if sys.argv[1:2] == ["stepwise"]:
        stepwise_table()
        sys.exit(0)
    if sys.argv[1:2] != ["drift"]:
        sys.exit("usage: python test_equivalence.py drift [runs] [seed] | rates | stepwise")
    figures = measure_drift(*(int(a) for a in sys.argv[2:4]))
    for (rule, kind, a, b), (ulps, relative, near) in sorted(figures.items()):
        share = f"  {near:.2f} of the bound" if rule == "sgd" else ""
        print(f"{rule:>8} {kind:>6} {a:>9} vs {b:<9} {ulps:8.2f} ulps/step  {relative:.2g} lr/step{share}")


# --------------------------------------------------------------------------
# stepwise_verdict where steps and leaves are not judged, and which one it names (the fourth
# mutation run's survivors: mutation.py pure equivalence.py)
# --------------------------------------------------------------------------


def abs_terms(params: dict, batch: dict):
    """square_terms' linear map under |r| instead of r**2: a kink where a residual is 0."""
    r_BxC = batch["x"] @ params["w"] + params["b"] - batch["t"]
    mask_B = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask_B[:, None] * jnp.abs(r_BxC)), jnp.sum(mask_B)


def kinked_hosts(n: int, every_row: bool) -> list[dict]:
    """One batch of 2 rows a device for abs_terms at square_init whose residuals are exactly 0
    on some rows, so that a 1-ulp move of the params flips their gradient's sign. every_row
    False: the first row of each device has x = 0 and t = b (only b's gradient sits on the
    kink; w's rows are generic). True: every row is a one-hot x_j with t = f32(w_j + b), both
    leaves on the kink (x @ w of a one-hot row is exact, and so is the sum's rounding)."""
    init = square_init()
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2 * n, 3)).astype(np.float32)
    t = rng.standard_normal((2 * n, 2)).astype(np.float32)
    if every_row:
        x = np.eye(3, dtype=np.float32)[np.arange(2 * n) % 3]
        t = (x @ init["w"] + init["b"]).astype(np.float32)
        assert np.array_equal(t, init["w"][np.arange(2 * n) % 3] + init["b"])
    else:
        x[0::2], t[0::2] = 0.0, init["b"]
    return [{"x": x, "t": t, "mask": np.ones(2 * n, bool)}]


def nudged(leaf: str, amount: float):
    """The sharded strategy with ``amount`` added to one leaf's gradient before its optimizer."""
    def strategy(params, batches, mesh, *, loss_terms, optimizer, opt_state=None):
        def update(grads, state, p):
            return optimizer.update({**grads, leaf: grads[leaf] + np.float32(amount)}, state, p)
        return strategies.sharded(params, batches, mesh, loss_terms=loss_terms,
                                  optimizer=strategies.Optimizer(optimizer.init, update), opt_state=opt_state)
    strategy.__name__ = f"{leaf} nudged"
    return strategy


@pytest.mark.filterwarnings("error::RuntimeWarning")  # count 0 divides by a bound of 0: quietly
def test_a_leaf_on_a_kink_is_not_judged_but_count_0_judges_every_leaf(mesh):
    """stepwise_verdict's domain: b's gradient flips under a 1-ulp move (its rows sit on |r|'s
    kink), so b is not judged and a difference there alone is "within", naming w (leaf 1, 0
    units apart) and counting the leaf not judged; count 0 judges everything: the same
    difference is OUTSIDE, named at b (leaf 0) with its distance."""
    n = mesh.devices.size
    kw = dict(params=square_init(), batches=kinked_hosts(n, every_row=False), mesh=mesh, loss_terms=abs_terms,
              optimizer=strategies.sgd(0.05))
    *_, twins, _, _ = equivalence.stepwise_distances(strategies.sharded, "sharded", strategies.sharded, "sharded",
                                                     **kw)
    assert twins[0, 0] > equivalence.STEP_UNITS >= twins[0, 1], twins  # the premise: b on the kink, w not
    U = equivalence.STEP_UNITS
    found = equivalence.stepwise_verdict("sharded", nudged("b", 1e-3), count=1, **kw)
    assert found.case == "within" and found.ulps == 0.0 and found.bound == U, found
    assert found.text == (
        f"sharded vs b nudged, each of 1 steps from the same state: the gradients 0.0 units of their term scale "
        f"apart at step 0 (leaf 1), within the bound of {U}: 1 rounding a step (equivalence.ulp_bound) x {U} "
        f"units a rounding; 1 of 2 steps x leaves not judged: a {equivalence.STEP_TWIN_ULPS}-ulp move of the "
        f"params moved their gradient by more than {U} units (not smooth at the scale of rounding: a kink, a "
        f"saturated softmax)"), found.text
    zero = equivalence.stepwise_verdict("sharded", nudged("b", 1e-3), count=0, **kw)
    assert zero.case == "OUTSIDE" and zero.ulps > 1e3 and zero.bound == 0.0, zero
    assert "at step 0 (leaf 0), OUTSIDE the bound of 0" in zero.text and "not judged" not in zero.text, zero.text


def test_with_every_leaf_on_a_kink_no_step_is_judged_and_there_is_no_verdict(mesh):
    n = mesh.devices.size
    kw = dict(params=square_init(), batches=kinked_hosts(n, every_row=True), mesh=mesh, loss_terms=abs_terms,
              optimizer=strategies.sgd(0.05))
    found = equivalence.stepwise_verdict("sharded", nudged("w", 1e-3), count=1, **kw)
    assert found.case == "outside the domain" and np.isnan(found.ulps) and found.bound is None, found
    assert found.text == "sharded vs w nudged, each of 1 steps from the same state: no step judged: no verdict"
    # the control: the same difference where the residuals are off the kink is judged, and OUTSIDE
    off = {**kw, "batches": kinked_hosts(n, every_row=False)}
    assert equivalence.stepwise_verdict("sharded", nudged("w", 1e-3), count=1, **off).case == "OUTSIDE"


def test_the_verdict_names_the_step_and_leaf_of_the_largest_distance_not_a_zero_one(mesh):
    """Where one leaf is 0 units apart and another a few, the verdict is the few, at their
    leaf (w, leaf 1), at the step they happen (step 1 of 2 here: the first is the same)."""
    n = mesh.devices.size
    kw = dict(params=square_init(), batches=square_hosts(n, steps=2), mesh=mesh, loss_terms=square_terms,
              optimizer=strategies.sgd(0.05))
    late = nudged("w", 2e-7)

    def second_step_only(params, batches, mesh, **k):
        first = not np.array_equal(np.asarray(batches[0]["x"]), kw["batches"][1]["x"])
        return (strategies.sharded if first else late)(params, batches, mesh, **k)
    second_step_only.__name__ = "w nudged at step 1"
    found = equivalence.stepwise_verdict("sharded", second_step_only, count=1, **kw)
    assert found.case == "within" and 0 < found.ulps <= equivalence.STEP_UNITS, found
    assert "at step 1 (leaf 1), within" in found.text, found.text
    assert found.text.endswith(f"x {equivalence.STEP_UNITS} units a rounding"), found.text  # nothing skipped


def test_a_pmap_layout_strategy_takes_batches_of_several_rows_a_device(mesh):
    """stepwise_verdict reshapes a host batch (n*B, ...) to (n, B, ...) for a pmap-layout
    strategy: at B = 2 it runs, and pmap's gradient is within the bound of sharded's."""
    n = mesh.devices.size
    hosts = kinked_hosts(n, every_row=False)
    found = equivalence.stepwise_verdict("sharded", "pmap", params=square_init(), batches=hosts, mesh=mesh,
                                         loss_terms=square_terms, optimizer=strategies.sgd(0.05))
    assert found.case in ("identical", "within"), found.text


# --------------------------------------------------------------------------
# verdict's every case, whole: its fields and its words (the fourth run's survivors in verdict)
# --------------------------------------------------------------------------

VA = {"b": np.array([1.0, 2.0], np.float32), "w": np.array([[0.5, -0.25], [0.75, 1.0]], np.float32)}


def moved_up(k: int, leaf: str = "w", at=(1, 1), params=VA) -> dict:
    """params with one entry k float32 steps up: at w[1, 1] = 1.0, the leaf's largest
    magnitude, that is k of the leaf's own ulps (2**-23) exactly."""
    out = {n: np.array(v, copy=True) for n, v in params.items()}
    for _ in range(k):
        out[leaf][at] = np.nextafter(out[leaf][at], np.float32(np.inf))
    return out


def two_leaf_growth(steps: int, scale=(0.0, 0.0), rows=None, off_centre=0.0) -> "equivalence.Growth":
    """A Growth of VA's two leaves: every twin 64 units from step 0 on (no growth) unless rows."""
    row = rows if rows is not None else [64.0] * (steps + 1)
    return equivalence.Growth(np.array([[row, row], [row, row]], np.float64), off_centre,
                              np.array(scale, np.float64))


def test_verdict_gives_each_case_whole_with_its_fields_and_words():
    """verdict's docstring, case by case, every field of the Verdict and every word of its text:
    the distance named is the largest leaf's (a NaN one first), "(leaf l)" only with several
    leaves, "after N steps" only with N, "1 ulp" but "2 ulps", the count's name as given."""
    V, U = equivalence.Verdict, "equivalence.ulp_bound"
    verdict = equivalence.verdict
    b3 = moved_up(3)
    assert verdict(VA, VA, 1, None) == V("identical", 0.0, 0.0, "identical")
    # count None: no count for the params; the distance and the steps named
    free = verdict(VA, b3, None, None, steps=4)
    assert (free.case, free.ulps, free.bound) == ("outside the domain", 3.0, None), free
    assert free.text.startswith(f"not bit-identical: 3.0 ulps after 4 steps: no count is derived for the params "
                                f"under this update rule ({U}: an adaptive rule") and \
        free.text.endswith(equivalence.ROUTE), free.text
    assert verdict(VA, b3, None, None).text.startswith("not bit-identical: 3.0 ulps: no count"), "no steps"
    zero_sign = {**VA, "b": np.array([0.0, 2.0], np.float32)}
    signed = verdict(zero_sign, {**zero_sign, "b": np.array([-0.0, 2.0], np.float32)}, None, None)
    assert signed.case == "outside the domain" and signed.ulps == 0.0, signed  # other bits, 0 ulps apart
    nan = moved_up(0)
    nan["w"][0, 0] = np.nan
    assert np.isnan(verdict(VA, nan, None, None).ulps)
    # count 0: OUTSIDE at any distance, at the largest leaf, in own ulps or the growth's unit
    assert verdict(VA, b3, 0, None, steps=4) == V(
        "OUTSIDE", 3.0, 0.0, f"not bit-identical: 3.0 ulps after 4 steps (leaf 1), OUTSIDE the documented bound "
        f"of 0 ulps: the same program, bit-identical expected ({U})")
    nan_first = {**nan, "b": np.array([np.nan, 2.0], np.float32)}
    first = verdict(VA, nan_first, 0, None, count_name="mine")
    assert first.case == "OUTSIDE" and np.isnan(first.ulps) and "nan ulps (leaf 0)" in first.text \
        and first.text.endswith("(mine)"), first.text
    one_leaf = verdict({"w": VA["w"]}, {"w": b3["w"]}, 0, None)
    assert one_leaf.text.startswith("not bit-identical: 3.0 ulps, OUTSIDE") and "leaf" not in one_leaf.text
    scaled = verdict(VA, b3, 0, two_leaf_growth(4, scale=(0.0, 4.0)))  # the unit: spacing(4.0) = 4 ulps of 1.0
    assert scaled.ulps == 0.75 and "0.8 ulps after 4 steps (leaf 1)" in scaled.text, scaled
    # within by the no-growth test: count x steps in own ulps
    assert verdict(VA, b3, 1, None, steps=4) == V(
        "within", 3.0, 4.0, f"not bit-identical: 3.0 ulps after 4 steps (leaf 1), within the documented bound of "
        f"4 ulps: 1 ulp a step ({U}) times 4 steps; every growth factor is at least 1, so no growth had to "
        f"be measured")
    two = verdict(VA, b3, 2, None, steps=4)
    assert (two.case, two.bound) == ("within", 8.0) and "of 8 ulps: 2 ulps a step" in two.text, two.text
    alone = verdict({"w": VA["w"]}, {"w": b3["w"]}, 1, None, steps=4)
    assert alone.text.startswith("not bit-identical: 3.0 ulps after 4 steps, within"), alone.text
    # the measured growth: each leaf against its bound, in the growth's unit
    flat = two_leaf_growth(2)
    assert verdict(VA, moved_up(5), 1, flat) == V(
        "OUTSIDE", 5.0, 2.0, f"not bit-identical: 5.0 ulps after 2 steps (leaf 1), OUTSIDE the documented bound "
        f"of 2 ulps there: 1 ulp a step ({U}) times the measured growth of a difference in that leaf, summed "
        f"over the steps (growth at most 1)")
    assert "of 4 ulps there: 2 ulps a step" in verdict(VA, moved_up(5), 2, flat).text
    wide = two_leaf_growth(2, scale=(0.0, 4.0))  # leaf 1 in units of 4 of its own ulps
    at_edge = verdict(VA, moved_up(8), 1, wide)  # 8 own ulps = 2.0 units: exactly the bound
    assert (at_edge.case, at_edge.ulps, at_edge.bound) == ("within", 2.0, 2.0), at_edge
    inside = verdict(VA, moved_up(6), 1, wide)  # 1.5 units; leaf 0 is 0 apart and not the one named
    assert (inside.case, inside.ulps) == ("within", 1.5) and "(leaf 1), within" in inside.text, inside.text
    past = verdict(VA, moved_up(9), 1, wide)
    assert (past.case, past.ulps) == ("OUTSIDE", 2.25), past
    grown = two_leaf_growth(2, rows=[64.0, 128.0, 256.0], off_centre=0.5)  # grew, not linearly: no bound
    assert grown.outside() is not None
    lost = verdict(VA, moved_up(5), 1, grown)
    assert (lost.case, lost.ulps, lost.bound) == ("outside the domain", 5.0, None), lost
    assert lost.text.startswith("not bit-identical: 5.0 ulps after 2 steps: outside the domain where a bound is "
                                f"derived: {grown.outside()}"), lost.text
