"""Tests of plan.py: each guarantee its docstrings state, checked, with negative controls.

* The construction in plan.py's docstring is implemented a second time from its text
  alone (``spec_*`` below: Python ints, fractions.Fraction and lists; NumPy's SeedSequence
  and PCG64 as the specified primitives) and compared bit for bit with shard_bounds,
  num_steps, shard_permutation, epoch_plan and elastic_plan over drawn inputs.
* The docstrings' worked tables are read back from the docstrings, cell for cell.
* Over drawn epochs and chains of resizes: shards partition range(N); every shard of a
  segment runs the stated steps; fill delivers every sample exactly once, drop at most once
  and the stated count; padding repeats a sample real earlier in its segment; the shuffle
  mixes its inputs. ``once_failure`` says why an epoch is not exactly once; its negative
  controls show that it catches a restart, a resume from the new size's fresh plan and a
  lost slot.
* LoaderState and Schedule: the JSON form, resizes, and a job that saves, reloads and
  resizes delivers elastic_plan's epoch. Every refusal names the parameter and the value.
* dataset_digest is its docstring and tells other data apart.
"""

import dataclasses
import hashlib
import json
import math
import re
from collections import deque
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import plan as plan_module
from conftest import (EPOCHS, POLICIES, SEEDS, assert_raises_naming, assert_refuses_naming_value,
                      assert_same_bits, epoch_steps, examples, expected_steps, not_ints)
from plan import (LoaderState, Plan, Schedule, check_seed, dataset_digest, elastic_plan,
                  epoch_plan, num_steps, on_devices, remaining_samples, shard_bounds, device_slots,
                  shard_permutation)


@st.composite
def samples_and_shards(draw, max_samples=5000, max_shards=16):
    n = draw(st.integers(1, max_shards))
    return draw(st.integers(n, max_samples)), n


def docstring_table(doc: str, header: str) -> list[list[str]]:
    """The rows of the table in ``doc`` whose header starts with ``header``, split into cells."""
    lines = doc[doc.index(header):].split("\n\n")[0].splitlines()[2:]
    return [[cell.strip() for cell in line.split("|")] for line in lines]


def cell(indices, mask) -> str:
    """A batch in the docstrings' notation: [0,1] with ``*`` on a padding slot."""
    return "[" + ",".join(f"{i}{'' if m else '*'}" for i, m in zip(indices, mask)) + "]"


def render(plan: Plan) -> list[str]:
    """Each step of ``plan``: its shards' batches, left to right."""
    return [" ".join(cell(i, m) for i, m in zip(plan.indices[s], plan.mask[s])) for s in range(len(plan.indices))]


def flat(nested) -> list:
    return [x for step in nested for shard in step for x in shard]


# --------------------------------------------------------------------------
# The checkers and their negative controls
# --------------------------------------------------------------------------


def once_failure(N: int, blocks, last_batch: str = "fill", stated: int | None = None) -> str | None:
    """Why the real slots of ``blocks`` ((indices, mask) pairs) are not every sample of range(N)
    once (fill), or at most once and ``stated`` of them (drop); None when they are."""
    real = np.concatenate([np.asarray(i)[np.asarray(m)] for i, m in blocks] or [[]]).astype(np.int64)
    if real.size and (real.min() < 0 or real.max() >= N):
        return f"samples outside range({N})"
    counts = np.bincount(real, minlength=N)
    if (twice := np.flatnonzero(counts > 1)).size:
        return f"samples delivered more than once: {twice[:5].tolist()}"
    if last_batch == "fill" and (missing := np.flatnonzero(counts == 0)).size:
        return f"samples missing: {missing[:5].tolist()}"
    if last_batch == "drop" and stated is not None and real.size != stated:
        return f"{real.size} samples delivered, {stated} stated"
    return None


def all_real(samples) -> list:
    return [(np.asarray(samples), np.ones(len(samples), bool))]


def check_plan(plan: Plan, N: int, n: int, B: int, last_batch: str) -> None:
    """Every guarantee of a fresh epoch's plan that does not depend on the order."""
    steps = expected_steps(N, n, B, last_batch)
    assert plan.indices.shape == plan.mask.shape == (steps, n, B), "steps or shape"
    assert plan.indices.dtype == np.int64 and plan.mask.dtype == bool
    for k in range(n):
        lo, hi = N * k // n, N * (k + 1) // n
        idx, real = plan.indices[:, k].ravel(), plan.mask[:, k].ravel()
        inside = (lo <= idx) & (idx < hi)
        assert inside.all(), f"shard {k} holds {idx[~inside][:5]}, outside [{lo}, {hi})"
        assert set(idx[~real]) <= set(idx[real]), f"shard {k}: padding is not a real sample"
    assert last_batch == "fill" or plan.mask.all(), "drop has no padding"
    why = once_failure(N, [plan], last_batch, n * steps * B)
    assert why is None, why


def worked_fill_plan() -> Plan:
    """plan.py's worked fill plan (N=7, n=2, B=2), as literal arrays."""
    return Plan(np.array([[[0, 1], [3, 4]], [[2, 2], [5, 6]]], np.int64),
                np.array([[[1, 1], [1, 1]], [[1, 0], [1, 1]]], bool))


def test_once_failure_names_a_repeat_a_gap_a_stray_and_a_count():
    assert once_failure(3, all_real([2, 0, 1])) is None  # the control
    for blocks, N, last_batch, stated, why in [
            (all_real(np.r_[0:4, 3:7]), 7, "fill", None, "more than once: [3]"),
            (all_real([0, 1, 3]), 4, "fill", None, "samples missing: [2]"),
            (all_real([0, 1, 2, 3]), 3, "fill", None, "samples outside range(3)"),
            (all_real([0, 0]), 3, "drop", None, "more than once: [0]"),
            (all_real([0, 2]), 3, "drop", 3, "2 samples delivered, 3 stated")]:
        assert why in (once_failure(N, blocks, last_batch, stated) or ""), why


def test_check_plan_accepts_the_worked_plan_and_rejects_broken_ones():
    check_plan(worked_fill_plan(), 7, 2, 2, "fill")
    twice = worked_fill_plan()
    twice.mask[1, 0, 1] = True  # the padding copy of sample 2 counted as real
    missing = worked_fill_plan()
    missing.indices[1, 1, 1], missing.mask[1, 1, 1] = 5, False  # sample 6 dropped
    crossed = worked_fill_plan()
    crossed.indices[0, 0, 0], crossed.indices[0, 1, 0] = 3, 0  # shards swap a sample
    stray = worked_fill_plan()
    stray.indices[1, 0, 1], stray.indices[0, 0, 1] = 1, 2  # real slots hold 0, 2, 2; padding holds 1
    for broken, policy, why in [(twice, "fill", "more than once"), (missing, "fill", "missing"),
                                (crossed, "fill", "outside"), (stray, "fill", "padding"),
                                (worked_fill_plan(), "drop", "steps")]:
        with pytest.raises(AssertionError, match=why):
            check_plan(broken, 7, 2, 2, policy)


def test_once_failure_catches_a_restart_a_resume_from_the_fresh_plan_and_a_lost_slot():
    # Preempted at step 1 on 2 shards of 2, resumed on 3 shards of 1.
    before = epoch_plan(7, 2, 2)
    first = (before.indices[:1], before.mask[:1])
    fresh = epoch_plan(7, 3, 1)
    assert "more than once: [0, 1, 3, 4]" in once_failure(7, [first, fresh])  # the epoch restarted
    # The new size's own plan read from step 1 misses 2 and repeats 1 and 3.
    assert "more than once: [1, 3]" in once_failure(7, [first, (fresh.indices[1:], fresh.mask[1:])])
    drop = epoch_plan(7, 3, 1, last_batch="drop")
    assert "more than once: [1, 3]" in once_failure(7, [first, (drop.indices[1:], drop.mask[1:])], "drop")
    kw = dict(seed=1, epoch=2, shuffle=True)  # shuffled: 4 shards of 3 for 2 steps, then 3 shards of 5
    before, fresh = epoch_plan(40, 4, 3, **kw), epoch_plan(40, 3, 5, **kw)
    assert once_failure(40, elastic_plan(40, [(0, 4, 3), (2, 3, 5)], **kw)) is None
    assert once_failure(40, [(before.indices[:2], before.mask[:2]), (fresh.indices[2:], fresh.mask[2:])])
    plans = elastic_plan(7, [(0, 2, 2), (1, 3, 1)])
    lost = plans[1].mask.copy()
    lost[0, 2, 0] = False
    assert once_failure(7, [plans[0], (plans[1].indices, lost)]) == "samples missing: [6]"
    assert once_failure(7, [plans[0], (plans[1].indices, lost)], "drop", 7) == "6 samples delivered, 7 stated"


# --------------------------------------------------------------------------
# plan.py's construction, implemented again from its text alone
# --------------------------------------------------------------------------


def spec_bounds(N: int, k: int, n: int) -> tuple[int, int]:
    return math.floor(Fraction(N * k, n)), math.floor(Fraction(N * (k + 1), n))


def spec_steps(m: int, n: int, B: int, last_batch: str) -> int:
    if last_batch == "fill":
        return math.ceil(Fraction(math.ceil(Fraction(m, n)), B))
    return math.floor(Fraction(math.floor(Fraction(m, n)), B))


def spec_permutation(size: int, seed: int, epoch: int, shard: int, segment: int = 0) -> list[int]:
    E = [seed, epoch, shard] if segment == 0 else [seed, epoch, shard, segment]
    keys = [int(key) for key in np.random.PCG64(np.random.SeedSequence(E)).random_raw(size)]
    return sorted(range(size), key=lambda j: (keys[j], j))  # argsort, stable: ties keep ascending j


def spec_plans(N, segments, epoch=0, seed=0, shuffle=False, last_batch="fill"):
    """[(indices, mask, S_i)] per segment, indices and mask nested lists (d_i, n_i, B_i)."""
    pool, out = list(range(N)), []
    for i, (t, n, B) in enumerate(segments):
        m = len(pool)
        S = 0 if i >= 1 and t == segments[i - 1][0] + out[-1][2] else spec_steps(m, n, B, last_batch)
        d = segments[i + 1][0] - t if i + 1 < len(segments) else S
        indices = [[[None] * B for _ in range(n)] for _ in range(S)]
        mask = [[[None] * B for _ in range(n)] for _ in range(S)]
        for k in range(n):
            lo, hi = spec_bounds(m, k, n)
            run = pool[lo:hi]
            order = [run[p] for p in spec_permutation(len(run), seed, epoch, k, i)] if shuffle else run
            real = min(S * B, len(run))
            for j in range(S * B):
                s, b = divmod(j, B)
                indices[s][k][b] = order[j] if j < real else (order[real - 1] if real else pool[lo])
                mask[s][k][b] = j < real
        indices, mask = indices[:d], mask[:d]
        taken = {x for x, real in zip(flat(indices), flat(mask)) if real}
        pool = [x for x in pool if x not in taken]
        out.append((indices, mask, S))
    return out


def assert_is_spec(plans, spec, segments) -> None:
    assert len(plans) == len(spec) == len(segments)
    for i, (plan, (indices, mask, _), (_, n, B)) in enumerate(zip(plans, spec, segments)):
        assert plan.indices.shape == plan.mask.shape == (len(indices), n, B), f"segment {i}"
        assert_same_bits(plan.indices.reshape(-1), np.array(flat(indices), np.int64), f"segment {i} indices")
        assert_same_bits(plan.mask.reshape(-1), np.array(flat(mask), bool), f"segment {i} mask")


@given(samples_and_shards(max_samples=300), st.integers(1, 40), POLICIES)
@settings(max_examples=examples(40))
def test_shard_bounds_and_num_steps_are_the_spec(sizes, B, last_batch):
    N, n = sizes
    assert [shard_bounds(N, k, n) for k in range(n)] == [spec_bounds(N, k, n) for k in range(n)]
    assert num_steps(N, n, B, last_batch) == spec_steps(N, n, B, last_batch)


@given(st.integers(0, 200), SEEDS, SEEDS, SEEDS, st.sampled_from([0, 1, 2, 2**32 - 1]))
@settings(max_examples=examples(40))
def test_shard_permutation_is_the_spec(size, seed, epoch, shard, segment):
    got = shard_permutation(size, seed=seed, epoch=epoch, shard=shard, segment=segment)
    assert_same_bits(got, np.array(spec_permutation(size, seed, epoch, shard, segment), np.int64))


def test_shard_permutation_is_the_sorting_permutation_not_the_ranks():
    # The control for the spec's reading: the ranks (the inverse) are another permutation.
    perm = shard_permutation(50, seed=1, epoch=2, shard=3)
    assert perm.tolist() != np.argsort(perm).tolist()


@given(samples_and_shards(max_samples=200, max_shards=6), st.integers(1, 50), SEEDS, EPOCHS,
       st.booleans(), POLICIES)
@settings(max_examples=examples(40))
def test_epoch_plan_is_the_spec_and_elastic_plans_one_segment(sizes, B, seed, epoch, shuffle, last_batch):
    N, n = sizes
    kw = dict(epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch)
    plan = epoch_plan(N, n, B, **kw)
    assert_is_spec([plan], spec_plans(N, [(0, n, B)], **kw), [(0, n, B)])
    [one] = elastic_plan(N, [(0, n, B)], **kw)
    assert_same_bits(one.indices, plan.indices, "indices")
    assert_same_bits(one.mask, plan.mask, "mask")
    assert epoch_steps(N, [(0, n, B)], last_batch) == num_steps(N, n, B, last_batch)


def test_epoch_plan_spec_pins_its_choices():
    # Uneven shards, shuffled: padding repeats the last sample in epoch order (not the
    # shard's highest index), the offset is added after the permutation, and drop
    # shuffles the whole shard before it truncates.
    plan = epoch_plan(7, 2, 2, seed=5, epoch=1, shuffle=True)
    order0 = [0 + p for p in spec_permutation(3, 5, 1, 0)]
    np.testing.assert_array_equal(plan.indices[:, 0].reshape(-1), order0 + [order0[-1]])
    drop = epoch_plan(7, 2, 2, seed=5, epoch=1, shuffle=True, last_batch="drop")
    order1 = [3 + p for p in spec_permutation(4, 5, 1, 1)]
    np.testing.assert_array_equal(drop.indices[:, 1].reshape(-1), order1[:2])
    for kwargs in (dict(seed=2**32), dict(epoch=2**32), dict(seed=-1)):  # checked without shuffle too
        with pytest.raises(ValueError, match="outside"):
            epoch_plan(7, 2, 2, **kwargs)


@st.composite
def chains(draw, max_samples=40, max_shards=6, max_batch=5, min_changes=1, max_changes=3,
           policies=POLICIES):
    """(N, segments, last_batch): a valid chain of up to ``max_changes`` changes, each at a drawn
    step, at the old segment's last step, at its end, at its last step onto the most shards
    (fewer samples left than shards: empty runs), or at its end onto one shard of 1 (drop:
    the skipped samples could fill a step there)."""
    N = draw(st.integers(1, max_samples))
    last_batch = draw(policies)
    top = min(N, max_shards)
    shards, batches = st.integers(1, top), st.integers(1, max_batch)
    segments = [(0, draw(shards), draw(batches))]
    for _ in range(draw(st.integers(min_changes, max_changes))):
        t, S = segments[-1][0], spec_plans(N, segments, last_batch=last_batch)[-1][2]
        if S == 0:
            break
        where = draw(st.sampled_from(["any", "any", "any", "last", "end", "crowd", "end onto 1"]))
        last = t + max(S - 1, 1)
        start, n, B = {"any": (None, None, None), "last": (last, None, None),
                       "end": (t + S, None, None), "crowd": (last, top, None),
                       "end onto 1": (t + S, 1, 1)}[where]
        start = draw(st.integers(t + 1, t + S)) if start is None else start
        segments.append((start, draw(shards) if n is None else n, draw(batches) if B is None else B))
    return N, segments, last_batch


@given(chains(), SEEDS, EPOCHS, st.booleans())
@settings(max_examples=examples(40))
def test_elastic_plan_is_the_spec(chain, seed, epoch, shuffle):
    N, segments, last_batch = chain
    kw = dict(epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch)
    assert_is_spec(elastic_plan(N, segments, **kw), spec_plans(N, segments, **kw), segments)


# Chains of fixed shape, mid-size, with the seeds drawn: every kind of change, shuffled.
FIXED_CHAINS = [
    (40, [(0, 4, 3), (2, 3, 5)], "fill"),                  # to fewer shards, larger B
    (40, [(0, 2, 4), (1, 5, 2), (3, 2, 4)], "fill"),       # more shards, then back
    (40, [(0, 4, 2), (2, 4, 3)], "drop"),                  # the same n, another B
    (50, [(0, 3, 4), (1, 8, 1), (3, 1, 7), (5, 6, 2)], "drop"),  # three; the last at the end
    (23, [(0, 3, 2), (3, 7, 1)], "fill"),                  # at the last step: empty runs
    (23, [(0, 4, 2), (2, 1, 1)], "drop"),                  # at the end: nothing more
    (1000, [(0, 8, 16), (3, 3, 32), (9, 5, 20)], "fill"),  # 8 left a shard: B=20 pads
    (1000, [(0, 8, 16), (3, 3, 32), (9, 5, 20)], "drop"),  # ... and drop has 0 steps
]


@pytest.mark.parametrize("N, segments, last_batch", FIXED_CHAINS)
@given(seed=SEEDS, epoch=EPOCHS)
@settings(max_examples=examples(3))
def test_elastic_plan_is_the_spec_on_fixed_chains(N, segments, last_batch, seed, epoch):
    kw = dict(epoch=epoch, seed=seed, shuffle=True, last_batch=last_batch)
    plans = elastic_plan(N, segments, **kw)
    assert_is_spec(plans, spec_plans(N, segments, **kw), segments)
    stated = sum(n * B * len(p.indices) for (_, n, B), p in zip(segments, plans))
    assert once_failure(N, plans, last_batch, stated) is None


# --------------------------------------------------------------------------
# Shards, the shuffle and the fresh epoch
# --------------------------------------------------------------------------


@given(samples_and_shards())
def test_shard_bounds_partition(sizes):
    N, n = sizes
    bounds = [shard_bounds(N, k, n) for k in range(n)]
    assert bounds[0][0] == 0 and bounds[-1][1] == N
    assert all(bounds[k][1] == bounds[k + 1][0] for k in range(n - 1)), "not contiguous"
    lengths = [stop - start for start, stop in bounds]
    assert max(lengths) - min(lengths) <= 1
    assert once_failure(N, all_real(np.concatenate([np.arange(*b) for b in bounds]))) is None


@pytest.mark.parametrize("N, n, lengths", [(13, 4, [3, 3, 3, 4]), (10, 4, [2, 3, 2, 3]), (7, 3, [2, 2, 3])])
def test_shard_bounds_examples(N, n, lengths):  # DALI's, and shard_bounds' docstring's
    assert [stop - start for start, stop in (shard_bounds(N, k, n) for k in range(n))] == lengths


@pytest.mark.parametrize("N, k, n, fragments", [
    (10, -1, 4, ["shard_id=-1"]),
    (10, 4, 4, ["shard_id=4"]),
    (10, 0, 0, ["num_shards", "got 0"]),
    (10, 0, 11, ["num_shards=11", "num_samples=10"]),
])
def test_shard_bounds_errors(N, k, n, fragments):
    assert_raises_naming(ValueError, lambda: shard_bounds(N, k, n), "shard_bounds: ", *fragments)


@given(samples_and_shards(), st.integers(1, 64), SEEDS, EPOCHS, POLICIES, st.booleans())
def test_epoch_plan_guarantees(sizes, B, seed, epoch, last_batch, shuffle):
    N, n = sizes
    check_plan(epoch_plan(N, n, B, epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch),
               N, n, B, last_batch)


@given(st.integers(10, 300), st.integers(0, 2**32 - 2), st.integers(0, 2**32 - 2), st.integers(0, 14),
       st.integers(0, 14))
def test_shard_permutation_changes_with_each_input(size, seed, epoch, shard, segment):
    # size >= 10: two independent permutations agree with probability 1/10! at most.
    def perm(seed, epoch, shard, segment=segment):
        return shard_permutation(size, seed=seed, epoch=epoch, shard=shard, segment=segment).tolist()
    base = perm(seed, epoch, shard)
    assert base != perm(seed, epoch + 1, shard)
    assert base != perm(seed + 1, epoch, shard)
    assert base != perm(seed, epoch, shard + 1)
    assert base != perm(seed, epoch, shard, segment + 1)
    assert perm(seed + 1, epoch, shard) != perm(seed, epoch + 1, shard)  # mixed, not added


@pytest.mark.parametrize("name", ["seed", "epoch", "shard", "segment"])
def test_shard_permutation_rejects_values_that_would_alias(name):
    # SeedSequence would read (seed 2**32, epoch 0) as (seed 0, epoch 1).
    args = {"seed": 0, "epoch": 0, "shard": 0, "segment": 0, name: 2**32}
    assert_raises_naming(ValueError, lambda: shard_permutation(10, **args), f"{name}={2**32}")


def test_shard_permutation_golden():
    # Pins the shuffle's bits, so that a NumPy upgrade or a change to the keys fails here.
    np.testing.assert_array_equal(shard_permutation(7, seed=0, epoch=0, shard=0), [3, 2, 1, 6, 0, 4, 5])
    np.testing.assert_array_equal(shard_permutation(5, seed=3, epoch=2, shard=1), [1, 4, 3, 0, 2])
    assert (shard_permutation(12, seed=2024, epoch=7, shard=3).tolist()
            == [10, 1, 8, 11, 4, 2, 6, 0, 7, 9, 5, 3])


def test_segment_streams_never_reuse_segment_0s():
    # The NumPy fact shard_permutation's E relies on: SeedSequence pads a short entropy list
    # with zero words, so a fourth word 0 would repeat segment 0's stream.
    def raw(entropy):
        return np.random.PCG64(np.random.SeedSequence(entropy)).random_raw(4)
    assert_same_bits(raw([5, 2, 1, 0]), raw([5, 2, 1]), "a zero fourth word")
    for i in (1, 2, 2**32 - 1):
        assert not np.array_equal(raw([5, 2, 1, i]), raw([5, 2, 1]))
    # Same pool size, another segment index: another order (the fourth word counts).
    a = elastic_plan(40, [(0, 1, 1), (1, 1, 39)], shuffle=True, seed=3)[1].indices
    b = elastic_plan(40, [(0, 1, 1), (1, 1, 1), (2, 1, 38)], shuffle=True, seed=3)[2].indices
    assert a.shape == (1, 1, 39) and b.shape == (1, 1, 38) and not np.array_equal(a[0, 0, 1:], b[0, 0])


def test_the_module_docstrings_worked_table():
    rows = docstring_table(plan_module.__doc__, "policy | steps")
    assert [row[0] for row in rows] == ["fill", "drop"]
    for policy, steps, *cells in rows:
        plan = epoch_plan(7, 2, 2, last_batch=policy)
        assert steps.endswith(f"= {len(plan.indices)}") and num_steps(7, 2, 2, policy) == len(plan.indices)
        batches = [c.replace(" ", "") for c in cells if c.startswith("[")]
        assert batches == [r.replace(" ", "") for r in render(plan)]
    assert cells == ["[0, 1]  [3, 4]", "(none: 2, 5, 6 skipped)"]
    np.testing.assert_array_equal(remaining_samples(7, [(0, 2, 2)], 1, last_batch="drop"), [2, 5, 6])


@given(st.integers(1, 300), st.integers(1, 16), POLICIES)
def test_every_accepted_batch_size_gives_at_least_one_step(N, n, last_batch):
    # Shards differ in size: the check is against the smallest shard, N // n. Checked
    # against the largest instead, N=17, n=8, B=3 with drop would give 0 steps.
    if n > N:
        return
    smallest = min(b - a for a, b in (shard_bounds(N, k, n) for k in range(n)))
    assert smallest == N // n
    for batch_size in (1, smallest):
        assert num_steps(N, n, batch_size, last_batch) >= 1


def test_the_default_seed_is_0():
    np.testing.assert_array_equal(epoch_plan(40, 2, 4, shuffle=True).indices,
                                  epoch_plan(40, 2, 4, seed=0, shuffle=True).indices)
    assert Schedule(40, 2, 4, shuffle=True).seed == 0


# --------------------------------------------------------------------------
# The elastic epoch
# --------------------------------------------------------------------------

TABLE = [  # (segments, policy, the delivered steps in the docstring's notation, steps)
    ([(0, 2, 2)], "fill", ["[0,1] [3,4]", "[2,2*] [5,6]"], 2),
    ([(0, 2, 2), (1, 3, 1)], "fill", ["[0,1] [3,4]", "[2] [5] [6]"], 2),
    ([(0, 2, 2), (1, 3, 1)], "drop", ["[0,1] [3,4]"], 1),
    ([(0, 2, 2), (1, 2, 1)], "fill", ["[0,1] [3,4]", "[2] [5]", "[2*] [6]"], 3),
    ([(0, 2, 2), (1, 4, 1)], "fill", ["[0,1] [3,4]", "[2*] [2] [5] [6]"], 2),
    ([(0, 2, 2), (1, 1, 4)], "fill", ["[0,1] [3,4]", "[2,5,6,6*]"], 2),
    ([(0, 2, 2), (2, 3, 1)], "fill", ["[0,1] [3,4]", "[2,2*] [5,6]"], 2),
    ([(0, 3, 1), (1, 2, 1)], "drop", ["[0] [2] [4]", "[1] [5]", "[3] [6]"], 3),
    ([(0, 2, 1), (1, 3, 1), (2, 2, 1)], "fill", ["[0] [3]", "[1] [2] [5]", "[4] [6]"], 3),
]


@pytest.mark.parametrize("segments, policy, steps, total", TABLE)
def test_elastic_worked_table(segments, policy, steps, total):
    plans = elastic_plan(7, segments, last_batch=policy)
    assert [c for plan in plans for c in render(plan)] == steps
    assert epoch_steps(7, segments, policy) == total
    key = " ".join(f"({t},{n},{B})" for t, n, B in segments)
    [row] = [row for row in docstring_table(elastic_plan.__doc__, "segments (start") if row[:2] == [key, policy]]
    assert row[-1] == str(total) and row[2:2 + len(steps)] == steps, row
    assert all(not c.startswith("[") for c in row[2 + len(steps):-1]), row  # and no other batches
    assert once_failure(7, plans, policy, sum(p.mask.sum() for p in plans)) is None
    assert len(docstring_table(elastic_plan.__doc__, "segments (start")) == len(TABLE)


def test_elastic_worked_table_notes():
    # Row 3: drop on 2 shards of 2 ends at step 1, so 2, 5 and 6 stay skipped.
    assert num_steps(7, 2, 2, "drop") == 1
    np.testing.assert_array_equal(remaining_samples(7, [(0, 2, 2), (1, 3, 1)], 1, last_batch="drop"), [2, 5, 6])
    # Row 5: shard 0's run is empty and pads with 2.
    [_, plan] = elastic_plan(7, [(0, 2, 2), (1, 4, 1)])
    assert render(plan) == ["[2*] [2] [5] [6]"]
    # Row 9: back on 2 shards of 1, yet step 2 is not epoch_plan(7, 2, 1)'s.
    assert render(epoch_plan(7, 2, 1))[2] == "[2] [5]"


@given(chains(), SEEDS, EPOCHS, st.booleans())
@settings(max_examples=examples(40))
def test_exactly_once_equal_steps_and_stated_counts(chain, seed, epoch, shuffle):
    N, segments, last_batch = chain
    kw = dict(epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch)
    plans = elastic_plan(N, segments, **kw)
    for i, (plan, (t, n, B)) in enumerate(zip(plans, segments)):
        rows = len(plan.indices)
        if i + 1 < len(segments):
            assert rows == segments[i + 1][0] - t >= 1, f"segment {i} runs until the next starts"
        assert plan.indices.shape == (rows, n, B)  # every shard of the segment: `rows` steps
    end = segments[-1][0] + len(plans[-1].indices)
    assert epoch_steps(N, segments, last_batch) == end
    assert last_batch == "fill" or all(p.mask.all() for p in plans), "drop has no padding"
    stated = sum(n * B * len(p.indices) for (_, n, B), p in zip(segments, plans))
    assert once_failure(N, plans, last_batch, stated) is None
    skipped = remaining_samples(N, segments, end, **kw)
    assert len(skipped) == N - sum(int(p.mask.sum()) for p in plans)
    assert last_batch == "drop" or len(skipped) == 0


@given(chains(min_changes=1, policies=st.just("fill")), SEEDS, EPOCHS, st.booleans())
@settings(max_examples=examples(25))
def test_once_failure_catches_a_restart_on_drawn_chains(chain, seed, epoch, shuffle):
    # Restarting the epoch on the new shards repeats what the first segment delivered
    # (fill: its first step holds a real sample on every shard).
    N, segments, _ = chain
    plans = elastic_plan(N, segments, epoch=epoch, seed=seed, shuffle=shuffle)
    again = epoch_plan(N, *segments[1][1:], epoch=epoch, seed=seed, shuffle=shuffle)
    assert "more than once" in (once_failure(N, [plans[0], again]) or "")


@given(chains(), SEEDS, EPOCHS, st.booleans())
@settings(max_examples=examples(25))
def test_padding_is_masked_and_repeats_a_sample_real_earlier_in_its_segment(chain, seed, epoch, shuffle):
    N, segments, last_batch = chain
    for plan in elastic_plan(N, segments, epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch):
        for s, k, b in np.argwhere(~plan.mask):
            seen = plan.indices[:s + 1][plan.mask[:s + 1]]
            assert plan.indices[s, k, b] in seen, f"padding at step {s}, shard {k} repeats no real sample"


@given(chains(), SEEDS, EPOCHS, st.booleans())
@settings(max_examples=examples(25))
def test_a_later_change_keeps_what_earlier_segments_delivered(chain, seed, epoch, shuffle):
    # What was delivered before the change at t_j is the plan without that change, at its steps < t_j.
    N, segments, last_batch = chain
    kw = dict(epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch)
    plans = elastic_plan(N, segments, **kw)
    for j in range(1, len(segments)):
        before = elastic_plan(N, segments[:j], **kw)
        for i in range(j):
            rows = len(plans[i].indices)
            assert_same_bits(plans[i].indices, before[i].indices[:rows], f"segment {i} with {j} segments")
            assert_same_bits(plans[i].mask, before[i].mask[:rows], f"segment {i} mask with {j} segments")


@given(chains(), SEEDS, EPOCHS)
@settings(max_examples=examples(25))
def test_the_counts_do_not_depend_on_the_shuffle(chain, seed, epoch):
    N, segments, last_batch = chain
    shuffled = elastic_plan(N, segments, epoch=epoch, seed=seed, shuffle=True, last_batch=last_batch)
    for a, b in zip(shuffled, elastic_plan(N, segments, last_batch=last_batch)):
        assert a.indices.shape == b.indices.shape and int(a.mask.sum()) == int(b.mask.sum())


@given(chains(), SEEDS, EPOCHS, st.booleans())
@settings(max_examples=examples(25))
def test_remaining_samples_are_what_real_slots_have_not_delivered(chain, seed, epoch, shuffle):
    N, segments, last_batch = chain
    kw = dict(epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch)
    blocks = [(p.indices[r], p.mask[r]) for p in elastic_plan(N, segments, **kw) for r in range(len(p.indices))]
    pools = {}
    for step in range(len(blocks) + 1):
        seen = np.zeros(N, bool)
        for indices, mask in blocks[:step]:
            seen[indices[mask]] = True
        pools[step] = remaining_samples(N, segments, step, **kw)
        assert_same_bits(pools[step], np.flatnonzero(~seen).astype(np.int64), f"remaining at step {step}")
    pool = list(range(N))  # at each segment's start, its pool R_i as the spec builds it
    for (t, _, _), (indices, mask, _) in zip(segments, spec_plans(N, segments, **kw)):
        assert_same_bits(pools[t], np.array(pool, np.int64), f"the pool at segment start {t}")
        taken = {x for x, real in zip(flat(indices), flat(mask)) if real}
        pool = [x for x in pool if x not in taken]


def test_fewer_samples_left_than_new_shards():
    # fill: one step; an empty run is all padding, repeating R_i[m*k//n]. 7 samples, [5, 6]
    # left after step 0, on 5 shards: runs [], [], [5], [], [6] (lo = 2*k//5 = 0, 0, 0, 1, 1).
    [_, plan] = elastic_plan(7, [(0, 1, 5), (1, 5, 2)])
    np.testing.assert_array_equal(plan.indices, [[[5, 5], [5, 5], [5, 5], [6, 6], [6, 6]]])
    np.testing.assert_array_equal(plan.mask, [[[False, False], [False, False], [True, False], [False, False],
                                                [True, False]]])
    [_, plan] = elastic_plan(7, [(0, 2, 3), (1, 3, 1)], last_batch="drop")
    assert plan.indices.shape == (0, 3, 1)  # drop: 0 steps, the epoch ends at the change


def test_a_zero_step_segment_is_last():
    assert epoch_steps(7, [(0, 2, 2), (2, 3, 1)]) == 2
    with pytest.raises(ValueError, match=r"segments\[2\].start=3 is after the epoch's end at step 2"):
        elastic_plan(7, [(0, 2, 2), (2, 3, 1), (3, 1, 1)])
    with pytest.raises(ValueError, match=r"segments\[2\].start=2 is not after segments\[1\].start=2"):
        elastic_plan(7, [(0, 2, 2), (2, 3, 1), (2, 1, 1)])


@pytest.mark.parametrize("N, segments, kw, fragment", [
    (7, [], {}, "segments must be a non-empty list"),
    (7, "0,2,2", {}, "segments must be a non-empty list"),
    (7, deque([(0, 2, 2)]), {}, "segments must be a non-empty list"),
    (7, [(0, 2)], {}, r"segments[0]=(0, 2) is not (start, num_shards, batch_size)"),
    (7, [range(0, 3)], {}, r"segments[0]=range(0, 3) is not (start, num_shards, batch_size)"),
    (7, [(0, 2, 2), (1.0, 3, 1)], {}, "segments[1].start must be an int, got 1.0"),
    (7, [(0, 2, True)], {}, "segments[0].batch_size must be an int, got True"),
    (7, [(0, 0, 2)], {}, "segments[0].num_shards must be >= 1, got 0"),
    (7, [(0, 2, 0)], {}, "segments[0].batch_size must be >= 1, got 0"),
    (7, [(0, 2, 2), (-1, 3, 1)], {}, "segments[1].start must be >= 0, got -1"),
    (7, [(0, 8, 1)], {}, "segments[0].num_shards=8 is more than num_samples=7"),
    (7, [(0, 2, 2), (1, 8, 1)], {}, "segments[1].num_shards=8 is more than num_samples=7"),
    (7, [(1, 2, 2)], {}, "segments[0].start=1; the first segment starts at step 0"),
    (7, [(0, 2, 2), (0, 3, 1)], {}, "segments[1].start=0 is not after segments[0].start=0"),
    (7, [(0, 2, 2), (2, 3, 1), (1, 2, 1)], {}, "segments[2].start=1 is not after segments[1].start=2"),
    (7, [(0, 2, 2), (3, 3, 1)], {}, "segments[1].start=3 is after the epoch's end at step 2"),
    (7, [(0, 2, 2), (2, 3, 1)], {"last_batch": "drop"}, "segments[1].start=2 is after the epoch's end at step 1"),
    (0, [(0, 1, 1)], {}, "num_samples must be >= 1, got 0"),
    (7, [(0, 2, 2)], {"seed": 2**32}, "seed=4294967296 is outside [0, 2**32)"),
    (7, [(0, 2, 2)], {"epoch": -1}, "epoch=-1 is outside [0, 2**32)"),
    (7, [(0, 2, 2)], {"shuffle": 1}, "shuffle must be a bool, got 1"),
    (7, [(0, 2, 2)], {"last_batch": "pad"}, "last_batch must be one of"),
])
def test_elastic_plan_refuses_naming_the_parameter(N, segments, kw, fragment):
    assert_raises_naming(ValueError, lambda: elastic_plan(N, segments, **kw), "elastic_plan: ", fragment)


def test_segments_are_lists_or_tuples():
    # The control for the refusals above: a list or tuple of lists or tuples (a state's own too).
    want = elastic_plan(7, [(0, 2, 2), (1, 3, 1)])
    for segments in (((0, 2, 2), (1, 3, 1)), [[0, 2, 2], [1, 3, 1]], [plan_module._Segment(0, 2, 2), (1, 3, 1)]):
        for a, b in zip(elastic_plan(7, segments), want):
            assert_same_bits(a.indices, b.indices)


def test_remaining_samples_refuses_a_step_outside_the_epoch():
    with pytest.raises(ValueError, match=r"step=3 is outside \[0, 2\]"):
        remaining_samples(7, [(0, 2, 2), (1, 3, 1)], 3)
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        remaining_samples(7, [(0, 2, 2)], -1)
    # The range is the policy's own: fill's last step is past drop's end.
    assert remaining_samples(23, [(0, 4, 2)], 3, last_batch="fill").size == 0
    np.testing.assert_array_equal(remaining_samples(23, [(0, 4, 2)], 2, last_batch="drop"),
                                  [4, 9, 10, 15, 16, 21, 22])
    assert_raises_naming(ValueError, lambda: remaining_samples(23, [(0, 4, 2)], 3, last_batch="drop"),
                         "step=3 is outside [0, 2]")


# --------------------------------------------------------------------------
# LoaderState
# --------------------------------------------------------------------------


@st.composite
def states(draw):
    N, segments, last_batch = draw(chains())
    seed, epoch, shuffle = draw(SEEDS), draw(EPOCHS), draw(st.booleans())
    step = draw(st.integers(segments[-1][0], epoch_steps(N, segments, last_batch)))
    dataset = draw(st.sampled_from([None, "0123456789abcdef" * 2]))
    return LoaderState(N, seed, epoch, step, shuffle, last_batch, tuple(segments), dataset)


@given(states())
@settings(max_examples=examples(25))
def test_state_round_trips_through_json(state):
    text = state.to_json()
    assert LoaderState.from_json(text) == state
    assert LoaderState.from_json(json.dumps(json.loads(text), indent=2)) == state


DIGEST = "0123456789abcdef" * 2



def test_the_json_form_is_its_docstring():
    state = LoaderState.start(7, 2, 2, dataset=DIGEST).at_step(1).resized(3, 1)
    assert state.to_json() == ('{"format":"plan.LoaderState/2","num_samples":7,"dataset":"' + DIGEST + '",'
                               '"seed":0,"epoch":0,"step":1,"shuffle":false,"last_batch":"fill",'
                               '"segments":[[0,2,2],[1,3,1]]}')
    assert LoaderState.from_json(state.to_json()) == state
    # An older format is not read: one way to save a state.
    old = ('{"format":"loaders.LoaderState/1","num_samples":7,"seed":0,"epoch":0,"step":1,"shuffle":false,'
           '"last_batch":"fill","segments":[[0,2,2],[1,3,1]]}')
    assert_raises_naming(ValueError, lambda: LoaderState.from_json(old), "format='loaders.LoaderState/1'")


def test_from_json_refuses_what_is_not_a_state():
    doc = json.loads(LoaderState.start(7, 2, 2).to_json())
    for bad, fragment in [
        ("{", "LoaderState.from_json: not a JSON document"),
        ("[1, 2]", "expected an object with keys"),
        (json.dumps({k: v for k, v in doc.items() if k != "step"}), "got ['dataset', 'epoch', 'format'"),
        (json.dumps({**doc, "extra": 1}), "'extra'"),
        (json.dumps({**doc, "format": "plan.LoaderState/3"}), "format='plan.LoaderState/3'"),
        (json.dumps({**doc, "format": None}), "format=None"),
        (json.dumps({**doc, "dataset": "not a digest"}), "dataset must be None or 32 lowercase hex digits"),
        (json.dumps({**doc, "segments": "0,2,2"}), "segments must be a non-empty list"),
        (json.dumps({**doc, "segments": [[0, 2]]}), "segments[0]=[0, 2] is not"),
        (json.dumps({**doc, "shuffle": "false"}), "shuffle must be a bool"),
        (json.dumps({**doc, "num_samples": 7.0}), "num_samples must be an int, got 7.0"),
    ]:
        assert_raises_naming(ValueError, lambda: LoaderState.from_json(bad), fragment)


def test_state_validates_itself():
    good = dict(num_samples=7, seed=0, epoch=0, step=1, shuffle=False, last_batch="fill",
                segments=((0, 2, 2), (1, 3, 1)))
    LoaderState(**good)
    for change, fragment in [
        ({"step": 0}, "step=0 is outside [1, 2]"),
        ({"step": 3}, "step=3 is outside [1, 2]"),
        ({"step": 1.0}, "step must be an int, got 1.0"),
        ({"shuffle": 0}, "shuffle must be a bool, got 0"),
        ({"seed": -1}, "seed=-1 is outside [0, 2**32)"),
        ({"seed": "0"}, "seed must be an int in [0, 2**32), got '0'"),
        ({"epoch": 2**32}, "epoch=4294967296 is outside [0, 2**32)"),
        ({"num_samples": 6, "segments": ((0, 2, 2), (3, 3, 1))}, "segments[1].start=3 is after"),
        ({"last_batch": "drop", "step": 2, "segments": ((0, 2, 2), (2, 3, 1))},
         "segments[1].start=2 is after the epoch's end at step 1"),
        ({"segments": ()}, "segments must be a non-empty list"),
        ({"dataset": "ABC"}, "dataset must be None or 32 lowercase hex digits"),
    ]:
        assert_raises_naming(ValueError, lambda: LoaderState(**{**good, **change}), "LoaderState: ", fragment)


@given(states(), st.integers(1, 6), st.integers(1, 5))
@settings(max_examples=examples(25))
def test_resized_state_plans_the_new_shards_from_its_step(state, n, B):
    n = min(n, state.num_samples)
    new = state.resized(n, B)
    plan, row = new.plan()
    kept = state.segments[:-1] if state.step == state.segments[-1].start else state.segments
    assert new.segments == (kept if kept and kept[-1][1:] == (n, B) else kept + ((state.step, n, B),))
    assert dataclasses.replace(new, segments=state.segments) == state  # nothing else changed
    want = elastic_plan(state.num_samples, new.segments, epoch=state.epoch, seed=state.seed,
                        shuffle=state.shuffle, last_batch=state.last_batch)[-1]
    assert_same_bits(plan.indices, want.indices, "resized plan")
    assert row == state.step - new.segments[-1].start and 0 <= row <= len(plan.indices)
    assert new.num_steps - new.step == len(plan.indices) - row


@given(chains(), SEEDS, EPOCHS, st.booleans())
@settings(max_examples=examples(25))
def test_a_job_that_saves_reloads_and_resizes_delivers_the_spec(chain, seed, epoch, shuffle):
    # Each segment's devices run from the state they were handed and save it at the next
    # change (through JSON); the next devices resume from it. Together they deliver
    # elastic_plan's epoch, exactly once.
    N, segments, last_batch = chain
    run = dict(seed=seed, shuffle=shuffle, last_batch=last_batch)
    state = LoaderState.start(N, *segments[0][1:], epoch=epoch, **run)
    delivered = []
    for i in range(len(segments)):
        plan, row = state.plan()
        stop = segments[i + 1][0] if i + 1 < len(segments) else state.num_steps
        delivered.append((plan.indices[row:row + stop - state.step], plan.mask[row:row + stop - state.step]))
        state = LoaderState.from_json(state.at_step(stop).to_json())
        assert Schedule(N, *state.segments[-1][1:], **run).resume("test", epoch, state) == state
        if i + 1 < len(segments):
            state = state.resized(*segments[i + 1][1:])
    spec = elastic_plan(N, state.segments, epoch=epoch, **run)
    assert_same_bits(np.concatenate([i.reshape(-1) for i, _ in delivered]),
                     np.concatenate([p.indices.reshape(-1) for p in spec]), "what the resumed shards delivered")
    stated = sum(s.num_shards * s.batch_size * len(p.indices) for s, p in zip(state.segments, spec))
    assert once_failure(N, delivered, last_batch, stated) is None
    assert state.step == state.num_steps
    [fresh] = elastic_plan(N, state.next_epoch().segments, epoch=epoch + 1, **run)
    assert_same_bits(fresh.indices, epoch_plan(N, *state.segments[-1][1:], epoch=epoch + 1, **run).indices,
                     "the next epoch is a fresh plan")


@pytest.mark.parametrize("last_batch", ["fill", "drop"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_next_epoch_carries_the_run_and_the_data(shuffle, last_batch):
    state = LoaderState.start(23, 4, 2, epoch=2, seed=9, shuffle=shuffle, last_batch=last_batch,
                              dataset=DIGEST).at_step(1).resized(3, 3)
    assert state.next_epoch() == LoaderState.start(23, 3, 3, epoch=3, seed=9, shuffle=shuffle,
                                                   last_batch=last_batch, dataset=DIGEST)


def test_resize_edges():
    state = LoaderState.start(7, 2, 2)
    assert state.resized(3, 1).segments == ((0, 3, 1),)  # at step 0: a fresh epoch on 3 shards
    at_end = state.at_step(2).resized(3, 1)
    assert at_end.segments == ((0, 2, 2), (2, 3, 1)) and at_end.num_steps == 2
    plan, row = at_end.plan()
    assert plan.indices.shape == (0, 3, 1) and row == 0
    assert at_end.resized(1, 1).segments == ((0, 2, 2), (2, 1, 1))  # replaces the 0-step one
    moved = state.at_step(1).resized(3, 1)
    assert moved.segments == ((0, 2, 2), (1, 3, 1))
    assert moved.resized(3, 1) == moved  # the same shards continue
    # Back to (2, 2) before a step ran on (3, 1): the original plan continues ...
    assert moved.resized(2, 2).segments == ((0, 2, 2),)
    # ... but after one, (2, 2) is a new segment over what is left.
    assert moved.at_step(2).resized(2, 2).segments == ((0, 2, 2), (1, 3, 1), (2, 2, 2))
    with pytest.raises(ValueError, match=r"num_shards=8 is more than num_samples=7"):
        state.at_step(1).resized(8, 1)


def test_a_state_of_the_same_logical_shards_continues_on_any_devices():
    # A state is of its plan's L shards of b, not of the devices: the same (L, b) continues
    # the same plan (no new segment); another (L, b) is a resize.
    saved = LoaderState.start(100, 8, 3, seed=5, shuffle=True).at_step(2)
    assert saved.resized(8, 3).segments == saved.segments
    np.testing.assert_array_equal(saved.resized(8, 3).plan()[0].indices,
                                  epoch_plan(100, 8, 3, seed=5, shuffle=True).indices)
    assert len(saved.resized(4, 6).segments) == 2


STATE = LoaderState.start(7, 2, 2)


def test_a_resume_checks_the_type_the_run_and_the_epoch_then_resizes():
    """Schedule.resume: the state of this run (num_samples, seed, shuffle, last_batch) and
    epoch, resized to its shards; else refused naming the caller, the field and both values."""
    state = LoaderState.start(100, 4, 8, epoch=5, seed=3, shuffle=True).at_step(2)
    run = dict(seed=3, shuffle=True, last_batch="fill")
    for n, B in ((4, 8), (3, 5), (1, 1)):
        assert Schedule(100, n, B, **run).resume("Loader", 5, state) == state.resized(n, B)
    for epoch in (4, 6):
        assert_raises_naming(ValueError, lambda: Schedule(100, 4, 8, **run).resume("Loader", epoch, state),
                             f"Loader: epoch={epoch}, but the state is of epoch 5")
    for name, value in [("num_samples", 99), ("seed", 4), ("shuffle", False), ("last_batch", "drop")]:
        other = dict(num_samples=100, num_shards=4, batch_size=8, **run) | {name: value}
        assert_raises_naming(ValueError, lambda: Schedule(**other).resume("Loader", 5, state),
                             "Loader: ", f"{name}={getattr(state, name)!r}", f"{name}={value!r}")
    for other in (None, state.to_json(), dataclasses.asdict(state)):
        assert_raises_naming(ValueError, lambda: Schedule(100, 4, 8, **run).resume("Loader", 5, other),
                             "Loader: state must be a plan.LoaderState", type(other).__name__)


@pytest.mark.parametrize("seed, shuffle, last_batch", [(0, False, "fill"), (7, True, "drop"), (3, True, "fill")])
def test_schedule_is_its_docstring(seed, shuffle, last_batch):
    s = Schedule(23, 3, 4, seed=seed, shuffle=shuffle, last_batch=last_batch)
    run = dict(seed=seed, shuffle=shuffle, last_batch=last_batch)
    assert s.num_steps == num_steps(23, 3, 4, last_batch)
    for epoch in (0, 1, 2**32 - 1):
        want = epoch_plan(23, 3, 4, epoch=epoch, **run)
        assert_same_bits(s.plan(epoch).indices, want.indices, f"plan({epoch})")
        assert_same_bits(s.plan(epoch).mask, want.mask, f"plan({epoch}).mask")
        assert s.real_samples(epoch) == int(want.mask.sum())
        assert s.start(epoch) == LoaderState.start(23, 3, 4, epoch=epoch, **run)
    for epoch in (-1, 2**32):
        assert_raises_naming(ValueError, lambda: s.start(epoch), "Schedule.start: epoch=")
    # Resumed from a state taken on 2 shards of 5 at step 1: resized to these shards.
    other = LoaderState.start(23, 2, 5, epoch=4, **run).at_step(1)
    resumed = s.resume("Loader", 4, other)
    assert resumed == other.resized(3, 4)
    plan, row = resumed.plan()
    assert s.real_samples(4, resumed) == int(plan.mask[row:].sum())
    assert_raises_naming(ValueError, lambda: s.resume("Loader", 5, other), "Loader: epoch=5")


# --------------------------------------------------------------------------
# Logical shards (on_devices)
# --------------------------------------------------------------------------


def test_on_devices_worked_table():
    # N=7, L=4 logical shards of b=1, fill, on 4, 3, 2 and 1 devices: the docstring's rows
    # (``-`` a spare slot), and the same L shards of each step on each.
    table = {int(row[0]): [c for c in row[1:] if c] for row in docstring_table(on_devices.__doc__, "devices |")}
    assert sorted(table) == [1, 2, 3, 4]
    whole = epoch_plan(7, 4, 1)
    for n, cells in table.items():
        view, spare = on_devices(whole, n), device_slots(4, n) < 0
        got = [" ".join("[" + ",".join("-" if spare[k, j] else f"{i}{'' if m else '*'}" for j, (i, m) in
                                       enumerate(zip(view.indices[s, k], view.mask[s, k]))) + "]"
                        for s in range(len(view.indices))) for k in range(n)]
        assert got == cells, (n, got, cells)
        real = view.indices.reshape(2, -1)[:, ~spare.reshape(-1)]  # b = 1: a row a slot
        assert_same_bits(real, whole.indices.reshape(2, -1))  # the global batches' shards, in shard order


def test_device_slots_is_its_docstrings_table_and_shard_bounds_of_the_shards():
    assert_same_bits(device_slots(8, 3), np.array([[0, 1, -1], [2, 3, 4], [5, 6, 7]]), "L=8, n=3")
    assert_same_bits(device_slots(8, 5), np.array([[0, -1], [1, 2], [3, -1], [4, 5], [6, 7]]), "L=8, n=5")
    for L in range(1, 25):
        for n in range(1, L + 1):
            slots = device_slots(L, n)
            assert slots.shape == (n, -(-L // n)), (L, n)
            assert_same_bits(np.sort(slots[slots >= 0]), np.arange(L, dtype=slots.dtype), f"L={L}, n={n}")  # once
            for d in range(n):
                lo, hi = shard_bounds(L, d, n)
                want = np.array(list(range(lo, hi)) + [-1] * (slots.shape[1] - (hi - lo)), slots.dtype)
                assert_same_bits(slots[d], want, f"L={L}, n={n}, device {d}")
                assert slots.shape[1] - (hi - lo) <= 1  # at most one spare a device
            if L % n == 0:
                assert (slots == np.arange(L).reshape(n, -1)).all()
    for bad, name in ((9, "num_devices=9"), (0, "num_devices must be >= 1, got 0"), (2.0, "num_devices")):
        assert_raises_naming(ValueError, lambda: device_slots(8, bad), f"device_slots: {name}")


@settings(max_examples=examples(40))
@given(N=st.integers(24, 200), L=st.sampled_from([4, 6, 8, 12]), b=st.integers(1, 4), seed=SEEDS,
       epoch=EPOCHS, shuffle=st.booleans(), last_batch=POLICIES)
def test_on_devices_gives_each_device_its_logical_shards_in_order(N, L, b, seed, epoch, shuffle, last_batch):
    whole = epoch_plan(N, L, b, seed=seed, epoch=epoch, shuffle=shuffle, last_batch=last_batch)
    steps = len(whole.indices)
    for n in range(1, L + 1):
        view, slots = on_devices(whole, n), device_slots(L, n)
        k = slots.shape[1]
        assert view.indices.shape == view.mask.shape == (steps, n, k * b)
        for d in range(n):
            for j, l in enumerate(slots[d]):
                rows = slice(j * b, (j + 1) * b)
                if l < 0:  # a spare slot: the device's own first row, never real
                    assert not view.mask[:, d, rows].any()
                    assert (view.indices[:, d, rows] == view.indices[:, d, :1]).all()
                    continue
                assert_same_bits(view.indices[:, d, rows], whole.indices[:, l], f"n={n}, device {d}, slot {j}")
                assert_same_bits(view.mask[:, d, rows], whole.mask[:, l], f"n={n}, device {d}, slot {j}")
            lo, hi = shard_bounds(L, d, n)  # a device's logical shards together: samples lo*N//L .. hi*N//L - 1
            assert set(view.indices[:, d][view.mask[:, d]].tolist()) <= set(range(N * lo // L, N * hi // L))
        if L % n == 0:
            assert np.shares_memory(view.indices, whole.indices)  # a reshape


def test_on_devices_refuses_more_devices_than_shards_and_what_is_not_a_plan():
    whole = epoch_plan(30, 6, 2)
    for bad in (7, 0, -1, 2.0, True, "2", None):
        assert_raises_naming(ValueError, lambda: on_devices(whole, bad), f"on_devices: num_devices={bad!r}",
                             "outside [1, 6]")
    assert [on_devices(whole, n).indices.shape[1:] for n in range(1, 7)] == [
        (1, 12), (2, 6), (3, 4), (4, 4), (5, 4), (6, 2)]  # the control: every n up to L
    good = epoch_plan(8, 4, 1)
    for bad in (Plan(good.indices, good.mask[:, :2]), Plan(good.indices, good.mask[:-1]),
                Plan(good.indices[:, :, 0], good.mask[:, :, 0]), tuple(good),
                Plan(good.indices.tolist(), good.mask.tolist())):
        assert_raises_naming(ValueError, lambda: on_devices(bad, 2), "on_devices: plan must be a Plan")


# --------------------------------------------------------------------------
# Inputs: a wrong type or value is refused at the call, naming the function, the parameter
# and the value (ints: Python and NumPy integers, never a bool or a whole float)
# --------------------------------------------------------------------------

# (the function as its messages name it, the call with one int parameter v, that parameter, a valid v)
PLAN_INT_PARAMETERS = [
    ("shard_bounds", lambda v: shard_bounds(v, 0, 2), "num_samples", 5),
    ("shard_bounds", lambda v: shard_bounds(5, v, 2), "shard_id", 1),
    ("shard_bounds", lambda v: shard_bounds(5, 0, v), "num_shards", 2),
    ("num_steps", lambda v: num_steps(v, 2, 2, "fill"), "num_samples", 7),
    ("num_steps", lambda v: num_steps(7, v, 2, "fill"), "num_shards", 2),
    ("num_steps", lambda v: num_steps(7, 2, v, "drop"), "batch_size", 2),
    ("epoch_plan", lambda v: epoch_plan(v, 2, 2), "num_samples", 7),
    ("epoch_plan", lambda v: epoch_plan(7, v, 2), "num_shards", 2),
    ("epoch_plan", lambda v: epoch_plan(7, 2, v), "batch_size", 2),
    ("epoch_plan", lambda v: epoch_plan(7, 2, 2, epoch=v), "epoch", 1),
    ("epoch_plan", lambda v: epoch_plan(7, 2, 2, seed=v, shuffle=True), "seed", 1),
    ("on_devices", lambda v: on_devices(epoch_plan(8, 4, 1), v), "num_devices", 2),
    ("shard_permutation", lambda v: shard_permutation(v, seed=0, epoch=0, shard=0), "size", 5),
    ("shard_permutation", lambda v: shard_permutation(5, seed=v, epoch=0, shard=0), "seed", 1),
    ("shard_permutation", lambda v: shard_permutation(5, seed=0, epoch=v, shard=0), "epoch", 1),
    ("shard_permutation", lambda v: shard_permutation(5, seed=0, epoch=0, shard=v), "shard", 1),
    ("shard_permutation", lambda v: shard_permutation(5, seed=0, epoch=0, shard=0, segment=v), "segment", 1),
    ("caller", lambda v: check_seed("seed", v, "caller"), "seed", 1),
    ("elastic_plan", lambda v: elastic_plan(v, [(0, 2, 2)]), "num_samples", 7),
    ("elastic_plan", lambda v: elastic_plan(7, [(0, 2, 2)], epoch=v), "epoch", 1),
    ("elastic_plan", lambda v: elastic_plan(7, [(0, 2, 2)], seed=v), "seed", 1),
    ("elastic_plan", lambda v: elastic_plan(7, [(0, 2, 2), (1, v, 1)]), "segments[1].num_shards", 3),
    ("remaining_samples", lambda v: remaining_samples(7, [(0, 2, 2)], v), "step", 1),
    ("remaining_samples", lambda v: remaining_samples(v, [(0, 2, 2)], 1), "num_samples", 7),
    ("LoaderState", lambda v: LoaderState(v, 0, 0, 0, False, "fill", ((0, 2, 2),)), "num_samples", 7),
    ("LoaderState", lambda v: LoaderState(7, v, 0, 0, False, "fill", ((0, 2, 2),)), "seed", 1),
    ("LoaderState", lambda v: LoaderState(7, 0, v, 0, False, "fill", ((0, 2, 2),)), "epoch", 1),
    ("LoaderState", lambda v: LoaderState(7, 0, 0, v, False, "fill", ((0, 2, 2),)), "step", 1),
    ("LoaderState.start", lambda v: LoaderState.start(v, 2, 2), "num_samples", 7),
    ("LoaderState.start", lambda v: LoaderState.start(7, v, 2), "num_shards", 2),
    ("LoaderState.start", lambda v: LoaderState.start(7, 2, v), "batch_size", 2),
    ("LoaderState.start", lambda v: LoaderState.start(7, 2, 2, epoch=v), "epoch", 1),
    ("LoaderState.at_step", lambda v: STATE.at_step(v), "step", 1),
    ("LoaderState.resized", lambda v: STATE.at_step(1).resized(v, 1), "num_shards", 3),
    ("LoaderState.resized", lambda v: STATE.at_step(1).resized(3, v), "batch_size", 1),
    ("caller", lambda v: Schedule(7, 2, 2).resume("caller", v, STATE), "epoch", 0),
    ("Schedule", lambda v: Schedule(v, 2, 2), "num_samples", 7),
    ("Schedule", lambda v: Schedule(7, v, 2), "num_shards", 2),
    ("Schedule", lambda v: Schedule(7, 2, v), "batch_size", 2),
    ("Schedule", lambda v: Schedule(7, 2, 2, seed=v), "seed", 1),
    ("Schedule.plan", lambda v: Schedule(7, 2, 2).plan(v), "epoch", 1),
    ("Schedule.start", lambda v: Schedule(7, 2, 2).start(v), "epoch", 1),
    ("Schedule.real_samples", lambda v: Schedule(7, 2, 2).real_samples(v), "epoch", 1),
]


@pytest.mark.parametrize("where, call, name, valid", PLAN_INT_PARAMETERS,
                         ids=[f"{w}-{n}" for w, _, n, _ in PLAN_INT_PARAMETERS])
@given(data=st.data())
@settings(max_examples=examples(8))
def test_every_int_parameter_refuses_what_is_not_an_int(where, call, name, valid, data):
    call(valid)  # the control: the call is valid with an int, Python's or NumPy's
    call(np.int64(valid))
    assert_refuses_naming_value(call, where, name, data.draw(not_ints(valid), label=name))


# (the function as its messages name it, the call with one int parameter v, that parameter,
# its least value): at the least value the call is valid, one below it is refused, named.
PLAN_INT_MINIMUMS = [
    ("num_steps", lambda v: num_steps(8, 2, v, "fill"), "batch_size", 1),
    ("epoch_plan", lambda v: epoch_plan(8, 2, v), "batch_size", 1),
    ("shard_permutation", lambda v: shard_permutation(v, seed=0, epoch=0, shard=0), "size", 0),
    ("LoaderState", lambda v: LoaderState(7, 0, 0, v, False, "fill", ((0, 2, 2),)), "step", 0),
    ("LoaderState.start", lambda v: LoaderState.start(7, 2, v), "batch_size", 1),
    ("LoaderState.resized", lambda v: STATE.at_step(1).resized(v, 1), "num_shards", 1),
    ("LoaderState.resized", lambda v: STATE.at_step(1).resized(3, v), "batch_size", 1),
    ("Schedule", lambda v: Schedule(7, v, 2), "num_shards", 1),
    ("Schedule", lambda v: Schedule(7, 2, v), "batch_size", 1),
]


@pytest.mark.parametrize("where, call, name, least", PLAN_INT_MINIMUMS,
                         ids=[f"{w}-{n}" for w, _, n, _ in PLAN_INT_MINIMUMS])
def test_every_int_parameter_with_a_least_value_takes_it_and_refuses_one_below(where, call, name, least):
    call(least)
    with pytest.raises(ValueError, match=re.escape(f"{where}: {name} must be >= {least}, got {least - 1}")):
        call(least - 1)


@pytest.mark.parametrize("call, fragment", [
    (lambda: shard_bounds(5.0, 0, 2), "shard_bounds: num_samples must be an int, got 5.0"),
    (lambda: shard_bounds(True, 0, 1), "shard_bounds: num_samples must be an int, got True"),
    (lambda: check_seed("seed", None, "caller"), "caller: seed must be an int in [0, 2**32), got None"),
    (lambda: epoch_plan(5, 1, 1, shuffle=1), "epoch_plan: shuffle must be a bool, got 1"),
    (lambda: epoch_plan(5, 1, 1, last_batch="pad"), "epoch_plan: last_batch must be one of"),
    (lambda: Schedule(5, 1, 1, last_batch=None), "Schedule: last_batch must be one of ('fill', 'drop'), got None"),
    (lambda: Schedule(7, 2, 2, shuffle="yes"), "Schedule: shuffle must be a bool, got 'yes'"),
    (lambda: Schedule(7, 2, 2, seed=0.0), "Schedule: seed must be an int in [0, 2**32), got 0.0"),
])
def test_other_wrong_inputs_are_refused_at_the_call(call, fragment):
    assert_raises_naming(ValueError, call, fragment)


# Each call's int arguments as Python ints or as a small NumPy integer type whose products
# overflow: the results must be the same.
SMALL_INT_CALLS = [
    (np.int16, lambda i: elastic_plan(i(3000), [(i(0), i(20), i(100)), (i(1), i(30), i(90))])),
    (np.int16, lambda i: epoch_steps(i(3000), [(0, 20, 100), (1, 30, 90)])),
    (np.int16, lambda i: remaining_samples(i(3000), [(0, 20, 100), (1, 30, 90)], i(2))),
    (np.int16, lambda i: LoaderState.from_json(LoaderState(i(3000), i(0), i(0), i(2), False, "fill",
                                                           ((0, 20, 100), (1, 30, 90))).to_json())),
    (np.int16, lambda i: LoaderState.start(i(3000), i(20), i(100)).at_step(i(1)).resized(i(30), i(90)).num_steps),
    (np.int16, lambda i: Schedule(i(3000), i(20), i(100)).start(i(0)).at_step(i(1)).resized(30, 90).plan()),
    (np.int8, lambda i: on_devices(epoch_plan(220, 27, 11), i(1))),
    (np.int8, lambda i: [shard_bounds(i(120), i(k), i(7)) for k in range(7)]),
    (np.int8, lambda i: epoch_plan(i(120), i(7), i(100), seed=i(3), epoch=i(1), shuffle=True)),
]


def assert_same_results(got, want) -> None:
    if isinstance(want, np.ndarray):
        assert_same_bits(got, want)
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for a, b in zip(got, want):
            assert_same_results(a, b)
    else:
        assert type(got) is type(want) and got == want, (got, want)


@pytest.mark.parametrize("small, call", SMALL_INT_CALLS)
def test_small_numpy_ints_are_used_as_python_ints(small, call):
    assert_same_results(call(small), call(int))


def test_small_numpy_ints_at_the_epochs_end():
    # N=3000 on 20 shards of 100 for a step, then 30 shards of 90: 2 steps, whatever the int type.
    for i in (int, np.int16):
        assert epoch_steps(i(3000), [(0, 20, 100), (1, 30, 90)]) == 2
        assert_raises_naming(ValueError, lambda: remaining_samples(i(3000), [(0, 20, 100), (1, 30, 90)], 3),
                             "step=3 is outside [0, 2]")
        assert_raises_naming(ValueError, lambda: LoaderState(i(3000), 0, 0, 3, False, "fill",
                                                             ((0, 20, 100), (1, 30, 90))), "step=3 is outside [1, 2]")


def test_states_and_schedules_hold_plain_python_values():
    state = LoaderState(np.int64(7), np.int64(0), np.int64(0), np.int64(1), np.True_, "fill", ((0, 2, 2),),
                        dataset=np.str_(DIGEST))
    assert [type(v) for v in dataclasses.astuple(state)[:5]] == [int, int, int, int, bool]
    assert type(state.dataset) is str and type(state.segments[0][0]) is int
    schedule = Schedule(np.int32(40), np.int8(2), np.int8(4), np.uint32(1), np.True_, dataset=np.str_(DIGEST))
    assert [type(v) for v in dataclasses.astuple(schedule)] == [int, int, int, int, bool, str, str]


def test_a_schedule_reads_its_dataset_only_for_a_state():
    reads = []
    schedule = Schedule(7, 2, 2, dataset=lambda: reads.append(1) or DIGEST)
    schedule.num_steps, schedule.plan(0), schedule.real_samples(0)
    with pytest.raises(ValueError, match="state must be a plan.LoaderState"):
        schedule.resume("caller", 0, "not a state")
    assert reads == [], "the plan needs no digest, and a state that is not one is refused first"
    saved = schedule.start(0).at_step(1)
    assert saved.dataset == DIGEST and reads == [1]
    assert schedule.resume("r", 0, saved).dataset == DIGEST and reads == [1, 1]
    other = Schedule(7, 2, 2, dataset="f" * 32)
    assert_raises_naming(ValueError, lambda: other.resume("RocalLoader.epoch", 0, saved),
                         "RocalLoader.epoch: the loader state was taken with dataset=")
    assert_raises_naming(ValueError, lambda: Schedule(7, 2, 2, dataset="x"), "Schedule: dataset must be")
    assert_raises_naming(ValueError, lambda: Schedule(7, 2, 2, dataset=lambda: "x").start(0),
                         "Schedule.dataset: dataset must be")


# --------------------------------------------------------------------------
# The data a state was taken on (dataset_digest, LoaderState.dataset)
# --------------------------------------------------------------------------


def spec_digest(arrays) -> str:
    """dataset_digest's docstring read literally: of each array its header, then the rows it
    names (all of at most 64, else 64 spread evenly) as one C-order copy."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        a = np.asarray(arrays[name])
        header = json.dumps([name, a.dtype.str, a.dtype.name, list(a.shape)], separators=(",", ":"))
        digest.update(header.encode("utf-8") + b"\n")
        if a.ndim:
            a = a[np.arange(len(a)) if len(a) <= 64 else np.arange(64) * (len(a) - 1) // 63]
        digest.update(a.tobytes(order="C"))
    return digest.hexdigest()


def some_data(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"labels": rng.integers(0, 10, 12).astype(np.int32),
            "images": rng.integers(0, 256, (12, 3, 4, 5)).astype(np.uint8),
            "big_endian": rng.integers(-9, 9, (12, 2)).astype(">i4"),
            "x": rng.standard_normal((12, 3)).astype(ml_dtypes.bfloat16),
            "keep": rng.integers(0, 2, 12).astype(bool)}


@given(SEEDS)
@settings(max_examples=examples(10))
def test_dataset_digest_is_its_docstring(seed):
    data = some_data(seed)
    got = dataset_digest(data)
    assert got == spec_digest(data) and len(got) == 32 and set(got) <= set("0123456789abcdef")
    assert dataset_digest(dict(reversed(list(data.items())))) == got, "the names' order is not the data"


def test_dataset_digest_is_the_same_on_every_machine():
    # A checkpoint names its data by this digest: a change to it would refuse every saved run.
    data = {"labels": np.arange(10, dtype=np.int32), "images": np.arange(60, dtype=np.uint8).reshape(10, 2, 3),
            "x": np.linspace(-1, 1, 20, dtype=np.float32).reshape(10, 2)}
    assert dataset_digest(data) == "27b5fa12ff3788d1e7d6aa87ff7272bc"


def test_dataset_digest_reads_64_rows_of_a_long_array_and_a_view_as_its_copy(tmp_path):
    """Of a memory map of 1,000 rows, a strided view, it reads the 64 rows digest_rows names,
    the first and the last among them, one at a time, and gives its copy's digest; a change in
    a row it reads is told apart, one in a row it skips is not (the stated limit)."""
    records = np.random.default_rng(3).integers(0, 256, (1000, 3073)).astype(np.uint8)
    path = tmp_path / "records.bin"
    records.tofile(path)
    mapped = np.memmap(path, np.uint8, mode="r").reshape(1000, 3073)
    view = {"images": mapped[:, 1:].reshape(1000, 3, 32, 32), "labels": mapped[:, 0].astype(np.int32)}
    assert not view["images"].flags.c_contiguous  # the control: the view is strided
    copy = {name: np.ascontiguousarray(a) for name, a in view.items()}
    assert dataset_digest(view) == dataset_digest(copy) == spec_digest(copy)

    class Counted(np.ndarray):
        def __getitem__(self, key):
            read.append(key)
            return np.asarray(self)[key]
    read = []
    dataset_digest({"images": copy["images"].view(Counted)})
    assert read == plan_module.digest_rows(1000) and len(read) == 64 and read[0] == 0 and read[-1] == 999
    for row, told in ((read[5], True), (read[5] + 1, False)):
        changed = copy["images"].copy()
        changed[row, 0, 0, 0] ^= 1
        assert (dataset_digest({**copy, "images": changed}) != dataset_digest(copy)) is told, row


def test_dataset_digest_is_its_docstring_at_the_array_edges():
    # A 0-d array, an empty one (before and after the others in name order), a single row,
    # a column, 64 and 65 rows: the docstring read literally.
    data = {"a scalar": np.array(2.5, np.float32), "b empty": np.zeros((0, 3), np.int16),
            "c one row": np.arange(5, dtype=np.uint8).reshape(1, 5), "d column": np.arange(4, dtype=np.int64),
            "e empty last": np.zeros(0, bool), "f after": np.arange(6, dtype=np.int32).reshape(3, 2),
            "g 64": np.arange(128, dtype=np.int16).reshape(64, 2), "h 65": np.arange(130, dtype=np.int16).reshape(65, 2)}
    assert dataset_digest(data) == spec_digest(data)
    assert plan_module.digest_rows(64) == list(range(64)) and len(plan_module.digest_rows(65)) == 64
    # the controls: the 0-d value, an empty array's shape, and the arrays after an empty one count
    for name, other in [("a scalar", np.array(3.5, np.float32)), ("b empty", np.zeros((0, 4), np.int16)),
                        ("f after", np.arange(1, 7, dtype=np.int32).reshape(3, 2))]:
        assert dataset_digest({**data, name: other}) != dataset_digest(data), name


def test_dataset_digest_tells_other_data_apart():
    data = some_data(0)
    same = dataset_digest(data)
    changed = {"one byte": {**data, "images": data["images"].copy()},
               "a dtype, the same bytes": {**data, "labels": data["labels"].view(np.float32)},
               "a shape, the same bytes": {**data, "images": data["images"].reshape(12, 3, 5, 4)},
               "a byte order": {**data, "big_endian": data["big_endian"].astype("<i4")},
               "a name": {**{k: v for k, v in data.items() if k != "x"}, "y": data["x"]},
               "one more array": {**data, "more": np.zeros(12, np.int32)},
               "one fewer": {k: v for k, v in data.items() if k != "keep"}}
    changed["one byte"]["images"][7, 1, 2, 3] ^= 1
    for what, other in changed.items():
        assert dataset_digest(other) != same, what
    assert dataset_digest({k: v.copy() for k, v in data.items()}) == same  # the control: a copy is the data
    f8 = {"x": np.arange(12, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)}
    assert np.dtype(ml_dtypes.int4).str == f8["x"].dtype.str == "<V1"  # why the header has dtype.name
    assert dataset_digest(f8) != dataset_digest({"x": f8["x"].view(ml_dtypes.int4)})
    assert dataset_digest({"a": np.zeros(2, np.complex64), "b": np.zeros(2, np.uint64)})  # kinds c and u
    for bad, fragment in [([data["labels"]], "arrays must be a mapping"), ({1: data["labels"]}, "must be strings"),
                          ({"a": np.array([object()])}, "dtype object"),
                          ({"a": np.zeros(2, [("f", "<i4")])}, "not numbers or bools"),
                          ({"a": np.zeros(2, "m8[s]")}, "dtype timedelta64[s]"),
                          ({"a": np.zeros(2, "M8[D]")}, "dtype datetime64[D]")]:
        assert_raises_naming(ValueError, lambda: dataset_digest(bad), "dataset_digest: ", fragment)


def test_a_state_names_its_dataset_and_refuses_other_data_by_name():
    named = dataset_digest(some_data(0))
    state = LoaderState.start(7, 2, 2, dataset=named)
    assert state.at_step(1).resized(3, 1).next_epoch().dataset == named
    other = dataset_digest(some_data(1))
    on = lambda n, B, dataset=None: Schedule(7, n, B, dataset=dataset)
    assert_raises_naming(ValueError, lambda: on(2, 2, other).resume("Loader.epoch", 0, state),
                         "Loader.epoch: the loader state was taken with dataset=", repr(named), repr(other))
    assert on(2, 2, named).resume("r", 0, state) == state  # the control: the same data
    assert on(2, 2).resume("r", 0, state) == state  # a run that names no data checks none
    # A state that names none is taken on trust, and names this run's data from then on.
    assert on(3, 1, other).resume("r", 0, STATE).dataset == other
    # Resumed without a dataset, a state keeps the one it names.
    assert on(1, 2).resume("r", 0, state).dataset == named
    for bad in ("ABC", named.upper(), named[:-1], 5, b"0" * 32):
        assert_raises_naming(ValueError, lambda: LoaderState.start(7, 2, 2, dataset=bad), "LoaderState.start: dataset")
