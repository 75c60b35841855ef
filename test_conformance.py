"""conformance.py: the describers every loader's conformance test relies on.

Each check fires on a hand-made wrong epoch (its negative control) and stays silent on
the plan itself, so an empty report means something. Every finding names the steps it
sits at, with uneven shards and across resizes. Two broken loaders built on
loaders.make_loader, which describe_epoch alone passes, are named by the checks across
epochs (a shuffle that ignores the epoch) and by index (labels shifted by one sample),
for samples of several shapes and dtypes, normalised or not. Two broken resumes on other
shard sets are named (the epoch restarted from step 0, the new size's fresh plan). A
strided partition passes partition="any" and fails "contiguous". Bad input is refused,
naming the parameter. The index encoding itself: test_encoding.py.
"""

import re

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import conformance
import encoding
import loaders
from conftest import assert_same_bits, epoch_steps, examples
from arithmetic import Normalize
from plan import (LAST_BATCH_POLICIES, LoaderState, elastic_plan, epoch_plan,
                  num_steps, remaining_samples, shard_bounds)


N, n, B = 13, 2, 2  # shards [0, 6) and [6, 13); 4 fill steps, 3 drop steps


def plan_delivery(last_batch="fill", shuffle=False):
    plan = epoch_plan(N, n, B, last_batch=last_batch)
    delivered = [plan.indices[:, k].copy() for k in range(n)]
    if shuffle:
        rng = np.random.default_rng(0)
        for k, d in enumerate(delivered):  # shuffle the real slots, keep padding at the end
            real = plan.mask[:, k].ravel()
            flat = d.ravel()
            flat[real] = rng.permutation(flat[real])
    return delivered, [plan.mask[:, k].copy() for k in range(n)]


def kinds(delivered, masks=None, *, last_batch="fill", shuffle=False, length=None):
    length = num_steps(N, n, B, last_batch) if length is None else length
    return set(conformance.describe_epoch(delivered, N, B, shuffle=shuffle, last_batch=last_batch,
                                          length=length, masks=masks).kinds)


@pytest.mark.parametrize("last_batch", ["fill", "drop"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_the_plan_conforms(last_batch, shuffle):
    delivered, masks = plan_delivery(last_batch, shuffle)
    assert kinds(delivered, masks, last_batch=last_batch, shuffle=shuffle) == set()
    assert kinds(delivered, None, last_batch=last_batch, shuffle=shuffle) == set()


def test_every_shard_reading_the_whole_dataset():
    """rocAL's bug: both shards deliver the same stream over the whole dataset."""
    whole = np.arange(16).reshape(8, 2) % N
    found = conformance.describe_epoch([whole, whole.copy()], N, B, shuffle=False, last_batch="fill",
                                       length=8)
    assert {"same batch on several shards", "samples on two shards", "step count", "batches arrived",
            "order", "outside the shard"} <= set(found.kinds)
    assert "- same batch on several shards: 8 finding(s), 2 shard(s), 8 step(s)" in found.report()


def test_a_report_puts_one_summary_line_per_kind_first_then_capped_examples():
    found = conformance.Findings()
    assert found.report("header") == ""  # nothing found: no report, not even its header
    for i in range(conformance.EXAMPLES):
        found.add("order", f"finding {i}", shards=[0], steps=[i], samples=[i, i + 1])
    report = found.report()
    assert report.splitlines()[0] == "1 kind(s) of deviation:" and "more" not in report, report
    assert "- order: 3 finding(s), 1 shard(s), 3 step(s), 4 sample(s)" in report, report
    for i in range(conformance.EXAMPLES, 10):  # past the cap: counted, not shown
        found.add("order", f"finding {i}", shards=[i])
    found.add("mask", "a mask", shards=[0], steps=[0])
    lines = found.report("epoch 3").splitlines()
    assert lines[:4] == ["epoch 3", "2 kind(s) of deviation:",
                         "- order: 10 finding(s), 8 shard(s), 3 step(s), 4 sample(s)",
                         "- mask: 1 finding(s), 1 shard(s), 1 step(s), 0 sample(s)"], lines
    assert lines[4:9] == ["order, e.g.:", "    finding 0", "    finding 1", "    finding 2",
                          "    ... and 7 more"], lines


def test_the_next_shards_first_sample_is_outside_the_shard():
    # Shard 0 is [0, 6): sample 6 (its `stop`, shard 1's first) is outside it.
    delivered, masks = plan_delivery(shuffle=True)
    delivered[0][0, 0] = 6
    found = conformance.describe_epoch(delivered, N, B, shuffle=True, last_batch="fill", length=4,
                                       masks=masks)
    [(text, shards, *_)] = found.kinds["outside the shard"]
    assert "shard 0 delivers 1 samples from outside its range [0, 6) (e.g. [6]" in text
    delivered[0][0, 0] = 5  # control: shard 0's own last sample is inside
    assert "outside the shard" not in kinds(delivered, masks, shuffle=True)


# Uneven shards: the step count and the step every finding names -----------------

# N=31 over 4 shards: [0, 7), [7, 15), [15, 23), [23, 31). B=3: fill ceil(8/3) = 3 steps (shard 0
# pads its last two slots, step 2 slots 1-2), drop floor(7/3) = 2 steps (each shard skips 1 or 2).
UN, Un, UB = 31, 4, 3
USTEPS = {"fill": 3, "drop": 2}


@pytest.mark.parametrize("last_batch", ["fill", "drop"])
def test_a_reported_step_count_other_than_the_plans_names_every_shard_and_the_steps_between(last_batch):
    steps = USTEPS[last_batch]
    for shuffle in (False, True):
        plan = epoch_plan(UN, Un, UB, shuffle=shuffle, last_batch=last_batch, seed=4)
        assert plan.indices.shape == (steps, Un, UB)
        args = dict(shuffle=shuffle, last_batch=last_batch, masks=plan.mask)
        assert not conformance.describe_epoch(plan.indices, UN, UB, length=steps, **args)  # control
        for wrong, between, span in ((steps - 1, {steps - 1}, f"{steps - 1}"), (steps + 1, {steps}, f"{steps}"),
                                     (steps + 2, {steps, steps + 1}, f"{steps}-{steps + 1}")):
            [(text, shards, named, _)] = conformance.describe_epoch(plan.indices, UN, UB, length=wrong,
                                                                    **args).kinds["step count"]
            assert (shards, named) == (set(range(Un)), between) and text.endswith(f"steps {span}"), text
            assert text.startswith(f"the loader reports {wrong} steps per epoch; the plan has {steps} (N=31, "
                                   f"4 shards, batch 3, {last_batch})"), text


def one_deviation(kind, last_batch, shard, step, slot, seed):
    """The plan of N=31 over 4 shards with one deviation of ``kind`` at (shard, step, slot):
    (indices, masks, describe_epoch's arguments, the steps the finding must name, words its
    text must hold)."""
    steps = USTEPS[last_batch]
    shuffle = kind not in ("order",)
    plan = epoch_plan(UN, Un, UB, shuffle=shuffle, seed=seed, last_batch=last_batch)
    got, mask = plan.indices.copy(), plan.mask.copy()
    args = dict(shuffle=shuffle, last_batch=last_batch, length=steps, partition="contiguous")
    other = (shard + 1) % Un
    if not mask[step, shard, slot] and kind in ("outside the shard", "samples on two shards", "order",
                                                "outside the dataset"):
        slot = 0  # shard 0's padding slots: these kinds look at real slots (padding is "padding"'s)
    if kind == "undecodable slots":
        got[step, shard, slot] = -1
        return got, mask, args, {step}, f"first: step {step} slot {slot}"
    if kind == "same batch on several shards":
        got[step, other] = got[step, shard]
        return got, mask, args, {step}, f"step {step}: shards {sorted([shard, other])}"
    if kind == "mask":
        mask[step, shard, slot] = ~mask[step, shard, slot]
        return got, mask, args, {step}, f"first: step {step} slot {slot}"
    if kind == "order":  # another sample of the shard's own in one slot
        start = shard_bounds(UN, shard, Un)[0]
        got[step, shard, slot] = start if got[step, shard, slot] != start else start + 1
        return got, mask, args, {step}, f"shard {shard} step {step} slot {slot}:"
    if kind == "outside the shard":
        got[step, shard, slot] = got[0, other, 0]
        return got, mask, args, {step}, f"first at step {step})"
    if kind == "samples on two shards":  # the other shard's sample of another step
        there = (step + 1) % steps
        got[step, shard, slot] = got[there, other, 0]
        (a, at_a), (b, at_b) = sorted([(shard, step), (other, there)])
        return got, mask, args, {step, there}, f"at step {at_a} of shard {a} and step {at_b} of shard {b})"
    if kind == "repeated":  # drop (2 steps, no padding): the sample at (1 - s, slot) again at (s, slot)
        plan = epoch_plan(UN, Un, UB, shuffle=True, seed=seed, last_batch="drop")
        got, mask = plan.indices.copy(), plan.mask.copy()
        args.update(last_batch="drop", length=USTEPS["drop"])
        step = min(step, 1)
        got[step, shard, slot] = got[1 - step, shard, slot]
        return got, mask, args, {0, 1}, f"shard {shard} delivers 1 samples more than once in real slots " \
            f"(e.g. [{got[step, shard, slot]}]; at steps [0, 1])"
    if kind == "padding":  # fill: shard 0's padding slot (step 2, slot 1) holds shard 1's sample
        args.update(last_batch="fill", length=3)
        plan = epoch_plan(UN, Un, UB, shuffle=True, seed=seed, last_batch="fill")
        got, mask = plan.indices.copy(), plan.mask.copy()
        got[2, 0, 1] = got[0, 1, 0]
        return got, mask, args, {2}, "first at step 2)"
    if kind == "outside the dataset":
        args["partition"] = "any"
        got[step, shard, slot] = UN + 7
        return got, mask, args, {step}, f"first at step {step})"
    if kind == "batches arrived":
        per = [got[:, k] for k in range(Un)]
        per[shard] = per[shard][:step]
        return per, [mask[:, k] for k in range(Un)], args, set(range(step, steps)), \
            f"shard {shard}: {step} batches arrived, the plan has {steps}; steps " \
            f"{step if steps - step == 1 else f'{step}-{steps - 1}'}"
    raise AssertionError(kind)


KINDS = ["undecodable slots", "same batch on several shards", "mask", "order", "outside the shard",
         "samples on two shards", "repeated", "padding", "outside the dataset", "batches arrived"]


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=examples(10))
@given(last_batch=st.sampled_from(["fill", "drop"]), shard=st.integers(0, Un - 1), step=st.integers(0, 2),
       slot=st.integers(0, UB - 1), seed=st.integers(0, 2**32 - 1))
def test_every_finding_names_the_step_it_sits_at_with_uneven_shards(kind, last_batch, shard, step, slot,
                                                                     seed):
    step = min(step, USTEPS[last_batch] - 1)
    got, mask, args, want_steps, words = one_deviation(kind, last_batch, shard, step, slot, seed)
    found = conformance.describe_epoch(got, UN, UB, masks=mask, **args)
    items = found.kinds.get(kind)
    assert items, f"{kind} not found:\n{found.report()}"
    named = [(text, steps) for text, _, steps, _ in items if words in text]
    assert named, f"no {kind} finding says {words!r}:\n{found.report()}"
    assert any(steps == want_steps for _, steps in named), (named, want_steps)


# Across epochs and by index: two broken loaders that describe_epoch alone passes --

# 48 samples over 4 devices (12 each: a repeated shuffle has chance 1/12! per shard), batch 3.
EN, En, EB = 48, 4, 3
SAMPLES = {  # any sample shape and dtype, normalised or not: (shape, dtype, normalize)
    "uint8 images, normalised": ((3, 4, 4), np.uint8, Normalize()),
    "uint8 (7,)": ((7,), np.uint8, None),
    "float32 features": ((5,), np.float32, None),
    "int16 (2, 3)": ((2, 3), np.int16, None),
}


class EpochBlind:
    """A broken loader: its shuffle ignores the epoch (every epoch is epoch 0's order)."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def epoch(self, epoch):
        return self.inner.epoch(0)


class Counting:
    """A broken loader with a hidden state: epoch e is read as e + (reads so far)."""

    def __init__(self, inner):
        self.inner, self.reads = inner, 0

    def __len__(self):
        return len(self.inner)

    def epoch(self, epoch):
        self.reads += 1
        return self.inner.epoch(epoch + self.reads - 1)


def dataset(kind):
    shape, dtype, normalize = SAMPLES[kind]
    samples = encoding.encoded_images(np.arange(EN), shape, dtype)
    labels = (np.arange(EN) * 7 % 10).astype(np.int32)  # neighbours' labels always differ
    return samples, labels, normalize


def make(devices, data, normalize, shuffle=True, labels=None):
    samples, own = data
    return loaders.make_loader((samples, own if labels is None else labels), devices[:En], EB,
                               shuffle=shuffle, seed=5, normalize=normalize, prefetch=0)


def read(loader, epoch, normalize):
    """One epoch as per-shard arrays: decoded indices (steps, B), labels (steps, B), masks."""
    batches = [{k: conformance.shard_blocks(v, En) for k, v in b.items()} for b in loader.epoch(epoch)]
    indices = np.stack([[encoding.decode_indices(b["images"][k], normalize) for k in range(En)]
                        for b in batches], axis=1)
    labels = np.stack([b["labels"] for b in batches], axis=1)
    masks = np.stack([b["mask"] for b in batches], axis=1)
    return list(indices), list(labels), list(masks)


def epoch_kinds(loader, epochs, normalize, shuffle):
    return set(conformance.describe_epochs({e: read(loader, e, normalize)[0] for e in epochs}, EB,
                                           shuffle=shuffle).kinds)


@pytest.mark.parametrize("kind", list(SAMPLES))
def test_a_shuffle_that_ignores_the_epoch_is_named(devices, kind):
    samples, labels, normalize = dataset(kind)
    loader = make(devices, (samples, labels), normalize)
    blind = EpochBlind(loader)
    for epoch in (0, 1):  # each epoch alone conforms: describe_epoch cannot see it
        indices, _, masks = read(blind, epoch, normalize)
        assert not conformance.describe_epoch(indices, EN, EB, shuffle=True, last_batch="fill",
                                              length=len(blind), masks=masks)
    found = conformance.describe_epochs({0: read(blind, 0, normalize)[0], 1: read(blind, 1, normalize)[0],
                                         2: read(blind, 2, normalize)[0]}, EB, shuffle=True)
    texts = [text for text, *_ in found.kinds["same order in two epochs"]]
    assert len(texts) == 3 and set(found.kinds) == {"same order in two epochs"}, found.report()
    assert texts[0].startswith("shards [0, 1, 2, 3] deliver the same samples in the same slots in "
                               "epochs 0 and 1 (steps 0-3): the shuffle ignores the epoch"), texts[0]
    assert epoch_kinds(loader, (0, 1, 2), normalize, shuffle=True) == set()  # control: the reference


def test_epochs_without_shuffle_stay_and_reads_do_not_depend_on_history(devices):
    samples, labels, normalize = dataset("float32 features")
    fixed = make(devices, (samples, labels), normalize, shuffle=False)
    assert epoch_kinds(fixed, (0, 3), normalize, shuffle=False) == set()
    shuffled = make(devices, (samples, labels), normalize)
    found = conformance.describe_epochs({0: read(shuffled, 0, normalize)[0],
                                         1: read(shuffled, 1, normalize)[0]}, EB, shuffle=False)
    [text, *_] = [t for t, *_ in found.kinds["order changes with the epoch"]]
    assert text.startswith("shard 0: epoch 1 differs from epoch 0 in "), text
    # Two reads of one epoch: the reference gives the same; a loader that counts its reads does not.
    twice = [(1, read(shuffled, 1, normalize)[0]), (1, read(shuffled, 1, normalize)[0])]
    assert not conformance.describe_epochs(twice, EB, shuffle=True)
    counting = Counting(shuffled)
    twice = [(1, read(counting, 1, normalize)[0]), (1, read(counting, 1, normalize)[0])]
    found = conformance.describe_epochs(twice, EB, shuffle=True)
    assert set(found.kinds) == {"epoch read twice"} and len(found.kinds["epoch read twice"]) == En
    plan = epoch_plan(UN, Un, UB)  # shard 0 holds 0..6, then padding: 9 slots
    other = plan.indices.copy()
    other[1, 0, 1] = 5
    [(text, shards, steps, _)] = conformance.describe_epochs([(4, plan.indices), (4, other)], UB,
                                                             shuffle=True).kinds["epoch read twice"]
    assert (shards, steps) == ({0}, {1}) and text == (
        "shard 0: two reads of epoch 4 differ in 1 of 9 slots (first: step 1 slot 1, sample 4, then 5): the "
        "epoch depends on what was read before"), text
    # A read with a batch fewer differs in the slots it lacks (-1 in the text).
    short = [plan.indices[:, k] for k in range(Un)]
    short[2] = short[2][:-1]
    found = conformance.describe_epochs({0: plan.indices, 1: short}, UB, shuffle=False)
    [(text, shards, steps, _)] = found.kinds["order changes with the epoch"]
    assert shards == {2} and steps == {2}
    assert text.startswith("shard 2: epoch 1 differs from epoch 0 in 3 of 9 slots (first: step 2 slot 0, "
                           "sample 21 in epoch 0, -1 in epoch 1)"), text


def test_a_repeat_is_flagged_only_when_chance_makes_it_rarer_than_CHANCE():
    """The documented domain: 1/L! per repeating shard, multiplied, against CHANCE = 1e-6."""
    def repeat(sizes):
        B = 1
        shards = [np.arange(size).reshape(size, B) for size in sizes]
        padded = [np.concatenate([s, np.full((max(sizes) - len(s), B), s[-1, 0])]) for s in shards]
        return set(conformance.describe_epochs({0: padded, 1: padded}, B, shuffle=True).kinds)
    assert conformance.CHANCE == 1e-6
    assert repeat([10]) == {"same order in two epochs"}  # 1/10! = 2.8e-7
    assert repeat([9]) == set()  # 1/9! = 2.8e-6: a uniform shuffle repeats it that often
    assert repeat([2] * 8) == set()  # (1/2)**8
    assert repeat([6, 6, 7]) == {"same order in two epochs"}  # 1/(720 * 720 * 5040)
    x = np.arange(20).reshape(10, 2)
    assert not conformance.describe_epochs({0: [x, x + 20], 1: [x[::-1], x[::-1] + 20]}, 2, shuffle=True)
    found = conformance.describe_epochs({0: [x, x + 20], 1: [x[::-1], x + 20]}, 2, shuffle=True)
    [(text, shards, steps, _)] = found.kinds["same order in two epochs"]  # one shard of 20 repeats
    assert shards == {1} and steps == set(range(10)) and text.startswith("shard 1 delivers the same"), text


@pytest.mark.parametrize("kind", list(SAMPLES))
def test_labels_shifted_by_one_sample_are_named(devices, kind):
    samples, labels, normalize = dataset(kind)
    for shuffle in (False, True):
        shifted = make(devices, (samples, labels), normalize, shuffle, labels=np.roll(labels, -1))
        indices, got, masks = read(shifted, 1, normalize)
        # describe_epoch sees indices only: the broken loader conforms there.
        assert not conformance.describe_epoch(indices, EN, EB, shuffle=shuffle, last_batch="fill",
                                              length=len(shifted), masks=masks)
        found = conformance.describe_values(indices, got, labels)
        assert set(found.kinds) == {"labels"} and len(found.kinds["labels"]) == En, found.report()
        for text, *_ in found.kinds["labels"]:
            assert text.endswith("labels shifted by +1 sample(s)") and "12 of 12 slots" in text, text
        indices, got, _ = read(make(devices, (samples, labels), normalize, shuffle), 1, normalize)
        assert not conformance.describe_values(indices, got, labels)  # control: the reference


TARGETS = {  # any label shape and dtype: per-token targets, float targets, signed zeros
    "int32 (N,)": (np.arange(UN) * 7 % 10).astype(np.int32),
    "per-token int32 (N, 48)": (np.arange(UN * 48).reshape(UN, 48) % 500).astype(np.int32),
    "float32 (N,)": np.linspace(-1, 1, UN, dtype=np.float32),
    "float32 (N, 3) with -0.0": np.concatenate([np.where(np.arange(UN) % 2, 0.0, -0.0)[:, None],
                                                np.arange(2 * UN).reshape(UN, 2)], 1).astype(np.float32),
    "bfloat16 (N, 2)": np.arange(2 * UN).reshape(UN, 2).astype(ml_dtypes.bfloat16),
}


@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.parametrize("last_batch", ["fill", "drop"])
@settings(max_examples=examples(5))
@given(seed=st.integers(0, 2**32 - 1), d=st.sampled_from([1, -1, 2, -3, 4]), shard=st.integers(0, Un - 1))
def test_values_of_any_shape_and_dtype_are_held_to_their_sample(name, last_batch, seed, d, shard):
    reference = TARGETS[name]
    plan = epoch_plan(UN, Un, UB, shuffle=True, seed=seed, last_batch=last_batch)
    values = reference[plan.indices]  # (steps, n, B, ...)
    assert not conformance.describe_values(plan.indices, values, reference, name="targets")
    shifted = np.roll(reference, -d, axis=0)[plan.indices]
    found = conformance.describe_values(plan.indices, shifted, reference, name="targets")
    texts = [text for text, *_ in found.kinds["targets"]]
    assert texts and all(t.endswith(f"targets shifted by {d:+d} sample(s)") for t in texts), texts
    one = values.copy()
    i = plan.indices[-1, shard, 0]  # one slot, the last step, given another sample's (different) value
    other = next(j for j in ((i + m) % UN for m in range(1, UN)) if not np.array_equal(reference[j], reference[i]))
    one[-1, shard, 0] = reference[other]
    [(text, shards, steps, samples)] = conformance.describe_values(plan.indices, one, reference,
                                                                   name="targets").kinds["targets"]
    assert shards == {shard} and steps == {len(plan.indices) - 1}
    assert f"first: step {len(plan.indices) - 1} slot 0 holds sample {plan.indices[-1, shard, 0]}" in text


def test_values_compare_bits_within_a_dtype_and_numbers_across_dtypes():
    indices = np.arange(6).reshape(3, 1, 2)
    zeros = np.zeros((6, 2), np.float32)
    signed = zeros.copy()
    signed[4, 1] = -0.0  # the same number, other bits
    [(text, _, steps, samples)] = conformance.describe_values(indices, signed[indices], zeros).kinds["labels"]
    assert steps == {2} and samples == {4} and "1 of 6 slots" in text
    nan = np.full((6,), np.nan, np.float32)
    assert not conformance.describe_values(indices, nan[indices], nan)  # a NaN matches its own bits
    wide = np.arange(6, dtype=np.int64) * 1000
    assert not conformance.describe_values(indices, wide.astype(np.int32)[indices], wide)  # by number
    exact = np.array([0.1, 0.5, 1.0, 2.0, 0.25, 1 / 3])  # float64 targets delivered as float32
    found = conformance.describe_values(indices, exact.astype(np.float32)[indices], exact)
    assert found.kinds["labels"][0][3] == {0, 5}  # 0.1 and 1/3 were rounded; the others are exact
    undecodable = indices.copy()
    undecodable[0, 0, 0] = -1  # skipped here: describe_epoch names it
    assert not conformance.describe_values(undecodable, wide[indices], wide)
    assert not conformance.describe_values(np.full_like(indices, -1), wide[indices], wide)  # none decodes


# Across a resize: one epoch on several sets of shards (describe_resized_epoch) ---

# 48 encoded images; the epoch runs on 4 shards of 3 for steps 0-1, 3 of 2 for steps 2-3,
# 6 of 1 for steps 4-5 (24, then 12, then 12 samples; fill and drop alike).
RN, RSEGMENTS, RSEED, REPOCH = 48, [(0, 4, 3), (2, 3, 2), (4, 6, 1)], 11, 3
RNORM = Normalize()


def resized(delivered, segments, *, masks, last_batch, shuffle=True, partition="contiguous", length=None,
            N=RN, seed=RSEED, epoch=REPOCH):
    return conformance.describe_resized_epoch(delivered, N, segments, epoch=epoch, seed=seed,
                                              shuffle=shuffle, last_batch=last_batch, masks=masks,
                                              length=length, partition=partition)


def texts(found, kind) -> list[str]:
    return [text for text, *_ in found.kinds.get(kind, [])]


@pytest.fixture(scope="module")
def resize_loaders():
    """make_loader on 4, 3 and 6 devices (the segments' shard sets), both policies. The
    8 virtual CPU devices (conftest) always hold the chain; what is under test is the
    describer, fed what a loader delivers."""
    cpus = jax.devices("cpu")
    images = encoding.encoded_images(np.arange(RN), (3, 4, 4))
    labels = np.zeros(RN, np.int32)
    return {(n, B, last_batch): loaders.make_loader((images, labels), cpus[:n], B, shuffle=True,
                                                   seed=RSEED, last_batch=last_batch, normalize=RNORM,
                                                   prefetch=0)
            for _, n, B in RSEGMENTS for last_batch in LAST_BATCH_POLICIES}


def decoded(batches, n):
    """Global batches as (steps, n, B) decoded indices and masks, through shard_blocks."""
    indices = np.stack([[encoding.decode_indices(block, RNORM)
                         for block in conformance.shard_blocks(b["images"], n)] for b in batches])
    return indices, np.stack([conformance.shard_blocks(np.asarray(b["mask"]), n) for b in batches])


def loader_steps(loader, start, stop, state=None):
    """Steps start..stop-1 of epoch REPOCH as ``loader.batch`` gives them (fresh, or resumed
    from ``state``), decoded."""
    return decoded([loader.batch(REPOCH, s, state=state) for s in range(start, stop)], loader.num_shards)


def resumed_at(loader, segments, last_batch):
    """The state ``loader`` resumes epoch REPOCH from, after running ``segments[:-1]``."""
    (_, n, B), *later = segments
    state = LoaderState.start(RN, n, B, epoch=REPOCH, seed=RSEED, shuffle=True, last_batch=last_batch,
                              dataset=loader.dataset)
    for t, n, B in later:
        state = state.at_step(t).resized(n, B)
    return state


@pytest.fixture(scope="module")
def resized_epochs(resize_loaders):
    """Per policy, the conforming epoch over RSEGMENTS as delivered blocks: segment 0 from the
    4-device loader's fresh epoch, each later one from its loader resumed from the state at
    the change; all decoded from images, and checked against elastic_plan."""
    out = {}
    for last_batch in LAST_BATCH_POLICIES:
        plans = elastic_plan(RN, RSEGMENTS, epoch=REPOCH, seed=RSEED, shuffle=True,
                             last_batch=last_batch)
        ends = [t for t, _, _ in RSEGMENTS[1:]] + [epoch_steps(RN, RSEGMENTS, last_batch)]
        blocks = []
        for i, ((t, n, B), end) in enumerate(zip(RSEGMENTS, ends)):
            loader = resize_loaders[(n, B, last_batch)]
            state = resumed_at(loader, RSEGMENTS[:i + 1], last_batch) if i else None
            blocks.append(loader_steps(loader, t, end, state))
        for i, ((got, mask), plan) in enumerate(zip(blocks, plans)):
            assert_same_bits(got, plan.indices, f"{last_batch} segment {i}: decoded indices")
            assert_same_bits(mask, plan.mask, f"{last_batch} segment {i}: masks")
        out[last_batch] = [got for got, _ in blocks], [mask for _, mask in blocks]
    return out


@pytest.mark.parametrize("last_batch", LAST_BATCH_POLICIES)
def test_a_resized_epoch_delivered_by_loaders_conforms(resized_epochs, last_batch):
    delivered, masks = resized_epochs[last_batch]
    steps = epoch_steps(RN, RSEGMENTS, last_batch)
    for partition in conformance.PARTITIONS:
        for passed in (masks, None):  # no segment has fewer samples left than shards
            found = resized(delivered, RSEGMENTS, masks=passed, last_batch=last_batch,
                            partition=partition, length=steps)
            assert not found, found.report(f"{last_batch}, {partition}, masks: {passed is not None}")


def first_repeat(before, after, start):
    """(global step, shard) of the first real slot of ``after`` (steps, n, B) holding a
    sample of ``before``, scanning steps then shards; and the repeated samples."""
    (got0, mask0), (got1, mask1) = before, after
    seen = set(got0[mask0].tolist())
    where = [(start + s, k) for s in range(len(got1)) for k in range(got1.shape[1])
             if seen & set(got1[s, k][mask1[s, k]].tolist())]
    return where[0], sorted(seen & set(got1[mask1].tolist()))


@pytest.mark.parametrize("last_batch", LAST_BATCH_POLICIES)
def test_a_restart_from_step_0_on_the_new_shards_is_named(resized_epochs, resize_loaders, last_batch):
    """Negative control: after 2 steps on 4 shards, the 3 new shards start the epoch again:
    the samples of steps 0-1 come twice, named with the segment and step where that starts."""
    delivered, masks = resized_epochs[last_batch]
    segments = RSEGMENTS[:2]
    loader = resize_loaders[(3, 2, last_batch)]
    again = loader_steps(loader, 0, len(loader))
    (step, shard), twice = first_repeat((delivered[0], masks[0]), again, 2)
    assert step == 2  # a restart repeats from its first step on (the shuffle decides the shard)
    for partition in conformance.PARTITIONS:
        found = resized([delivered[0], again[0]], segments, masks=[masks[0], again[1]],
                        last_batch=last_batch, partition=partition)
        [(text, shards, steps, samples)] = found.kinds["repeated across segments"]
        assert text.startswith(f"segment 1 delivers {len(twice)} samples that segment 0 had delivered in "
                               f"real slots (e.g. {twice[:5]}); the repeats start at step 2 on shard "
                               f"{shard} of segment 1 (sample "), text
        assert samples == set(twice) and min(steps) == 0 and (1, shard) in shards
        if partition == "contiguous":  # and the new shards run the fresh plan's steps, not the rest's
            assert "outside the shard" in found.kinds and "batches arrived" in found.kinds, found.report()


@pytest.mark.parametrize("last_batch", LAST_BATCH_POLICIES)
def test_a_resume_on_the_new_sizes_fresh_plan_is_named(resized_epochs, resize_loaders, last_batch):
    """Negative control: the 3 new shards read their own fresh epoch_plan from step 2: some
    samples come twice and others never (fill) or fewer than stated (drop), each named."""
    delivered, masks = resized_epochs[last_batch]
    segments = RSEGMENTS[:2]
    loader = resize_loaders[(3, 2, last_batch)]
    fresh = loader_steps(loader, 2, len(loader))
    (step, shard), twice = first_repeat((delivered[0], masks[0]), fresh, 2)
    got = set(delivered[0][masks[0]].tolist()) | set(fresh[0][fresh[1]].tolist())
    never = sorted(set(range(RN)) - got)
    assert twice and never  # what makes this a control
    for partition in conformance.PARTITIONS:
        found = resized([delivered[0], fresh[0]], segments, masks=[masks[0], fresh[1]],
                        last_batch=last_batch, partition=partition, length=len(loader))
        [text] = texts(found, "repeated across segments")
        assert f"segment 1 delivers {len(twice)} samples that segment 0" in text, text
        assert f"the repeats start at step {step} on shard {shard} of segment 1" in text, text
        if last_batch == "fill":
            [(text, _, _, samples)] = found.kinds["missing from the epoch"]
            assert samples == set(never) and text.startswith(f"{len(never)} of the 48 samples are never "
                                                             f"delivered in a real slot of any segment")
        else:  # 4*3*2 + 3*2*4 stated; the fresh plan's rows 2-7 repeat some and skip others
            [text] = texts(found, "drop count")
            assert text.startswith(f"the epoch delivers {len(got)} distinct samples in real slots; "
                                   f"elastic_plan states 48 (4*3*2 + 3*2*4: n*B*steps"), text
        # The fresh plan ends at step 8, the resized one at 6: held to the plan (contiguous),
        # not to what the loader itself delivered (any).
        assert ("step count" in found.kinds) == (partition == "contiguous"), found.report()
        # Control: the same loader resumed from the state at the change conforms.
        rest = loader_steps(loader, 2, 6, resumed_at(loader, segments, last_batch))
        assert not resized([delivered[0], rest[0]], segments, masks=[masks[0], rest[1]],
                           last_batch=last_batch, partition=partition, length=6)


@pytest.mark.parametrize("last_batch", LAST_BATCH_POLICIES)
def test_a_segment_whose_shards_run_different_step_counts(resized_epochs, last_batch):
    """Negative control: shard 2 of segment 1 (global steps 2-3) and shard 4 of the last
    segment (steps 4-5) each lose their last batch; named by segment and global step."""
    delivered, masks = resized_epochs[last_batch]
    per = [list(np.swapaxes(d, 0, 1)) for d in delivered]
    per_masks = [list(np.swapaxes(m, 0, 1)) for m in masks]
    for i, k in ((1, 2), (2, 4)):
        per[i][k], per_masks[i][k] = per[i][k][:1], per_masks[i][k][:1]
    for partition, why in (("contiguous", ("the plan has 2", "the plan has 2")),
                           ("any", ("the segment runs 2", "the longest shard delivered 2"))):
        found = resized(per, RSEGMENTS, masks=per_masks, last_batch=last_batch, partition=partition)
        assert texts(found, "batches arrived") == [
            f"segment 1: shard 2: 1 batches arrived, {why[0]}; steps 3",
            f"segment 2: shard 4: 1 batches arrived, {why[1]}; steps 5"]
        lost = [delivered[i][1, k][masks[i][1, k]].tolist() for i, k in ((1, 2), (2, 4))]
        kind = "missing from the epoch" if last_batch == "fill" else "drop count"
        assert kind in found.kinds, found.report()
        if last_batch == "fill":
            assert found.kinds[kind][0][3] == set(lost[0] + lost[1])
    # Control: the same blocks, whole, as per-shard lists.
    whole = [list(np.swapaxes(d, 0, 1)) for d in delivered]
    assert not resized(whole, RSEGMENTS, masks=[list(np.swapaxes(m, 0, 1)) for m in masks],
                       last_batch=last_batch)


# One deviation each, named with its segment and global step. N=31: 4 shards of 3
# for step 0, 3 of 2 for steps 1-2, then 5 of 1 (7 samples left: runs 1,1,1,2,2) for steps
# 3-4 (fill: shards 0-2 pad at step 4) or step 3 (drop).
PN, PSEGMENTS = 31, [(0, 4, 3), (1, 3, 2), (3, 5, 1)]


def one_resize_deviation(kind, last_batch, shuffle, seed, epoch, segment, shard, row, slot):
    """(delivered, masks, partition, the segment whose words the finding carries or None,
    words its text must hold, a global step its steps must hold) for one deviation of
    ``kind`` in elastic_plan's epoch, its indices encoded and decoded first."""
    plans = elastic_plan(PN, PSEGMENTS, epoch=epoch, seed=seed, shuffle=shuffle,
                                 last_batch=last_batch)
    got = [encoding.decode_indices(encoding.encoded_images(p.indices.ravel(), (2,), np.float32))
           .reshape(p.indices.shape) for p in plans]
    masks = [p.mask.copy() for p in plans]
    if kind in ("order", "same batch on several shards", "repeated"):
        segment %= 2  # B >= 2 and every row real: another own sample, a real batch to copy
    i = segment % len(plans)
    t, n, B = PSEGMENTS[i]
    k, other = shard % n, (shard + 1) % n
    r = row % len(got[i])
    if not masks[i][r, k, slot % B]:  # these kinds sit on real slots: the shard's first one
        r, j = 0, 0
    else:
        j = slot % B
    at = t + r
    out = lambda partition, segment, words, step: (got, masks, partition, segment, words, step)
    if kind == "undecodable slots":
        got[i][r, k, j] = -1
        return out("contiguous", i, f"shard {k}: 1 slots hold no encoded sample (first: step {at} slot "
                                    f"{j})", at)
    if kind == "mask":
        masks[i][r, k, j] = False
        return out("contiguous", i, f"shard {k}: the mask differs from the plan's in 1 slots (first: step "
                                    f"{at} slot {j})", at)
    if kind == "order":  # shuffle off: another sample of the shard's own run
        own = plans[i].indices[:, k][plans[i].mask[:, k]]
        got[i][r, k, j] = own[0] if got[i][r, k, j] != own[0] else own[1]
        return out("contiguous", i, f"shard {k} step {at} slot {j}: sample {got[i][r, k, j]}, the plan "
                                    f"says", at)
    if kind == "outside the shard":
        got[i][r, k, j] = plans[i].indices[0, other, 0]
        return out("contiguous", i, f"shard {k} delivers 1 samples from outside its", at)
    if kind == "samples on two shards":
        x = got[i][r, k, j] = plans[i].indices[0, other, 0]
        (a, at_a), (b, at_b) = sorted([(k, at), (other, t)])
        return out("any", i, f"sample {x} at step {at_a} of shard {a} and step {at_b} of shard {b})", at)
    if kind == "same batch on several shards":
        got[i][r, other] = got[i][r, k]
        return out("any", i, f"step {at}: shards {sorted([k, other])} deliver the same", at)
    if kind == "repeated":  # another real slot of the shard, holding its sample at (r, j) again
        r2, j2 = next((a, b) for a, b in np.argwhere(masks[i][:, k]) if (a, b) != (r, j))
        got[i][r2, k, j2] = got[i][r, k, j]
        return out("any", i, f"shard {k} delivers 1 samples more than once in real slots", t + r2)
    if kind == "padding":  # fill: shard 0's padding at step 4 holds shard 3's sample
        got[2][1, 0, 0] = plans[2].indices[0, 3, 0]
        return out("any", 2, "shard 0: 1 padding slots hold samples that no real slot of the shard "
                             "delivers", 4)
    if kind == "batches arrived":
        d = len(got[i])
        words = f"shard {k}: {d - 1} batches arrived, the plan has {d}; steps {t + d - 1}"
        got, masks = [list(np.swapaxes(g, 0, 1)) for g in got], [list(np.swapaxes(m, 0, 1)) for m in masks]
        got[i][k], masks[i][k] = got[i][k][:d - 1], masks[i][k][:d - 1]
        return out("contiguous", i, words, t + d - 1)
    if kind == "outside the dataset":
        got[i][r, k, j] = PN + 7
        return out("any", None, f"first: sample {PN + 7} at step {at} on shard {k} of segment {i})", at)
    i = max(i, 1)  # the kinds over the whole epoch: a later segment takes a sample of an earlier one
    t, n, B = PSEGMENTS[i]
    k = shard % n
    lost, x = got[i][0, k, 0], got[i - 1][0, 0, 0]
    if kind == "drop count":  # drop: one real slot less
        masks[i][0, k, 0] = False
        return out("any", None, f"the epoch delivers {sum(m.sum() for m in masks)} distinct samples", t)
    got[i][0, k, 0] = x
    if kind == "repeated across segments":
        return out("any", None, f"the repeats start at step {t} on shard {k} of segment {i} (sample {x}, "
                                f"delivered at step {PSEGMENTS[i - 1][0]} on shard 0 of segment {i - 1})", t)
    if kind == "missing from the epoch":  # fill: the sample it displaced is never delivered
        return out("any", None, f"1 of the 31 samples are never delivered in a real slot of any segment, in "
                                f"any of steps 0-4 (e.g. [{lost}])", t)
    raise AssertionError(kind)


RESIZE_KINDS = {  # kind: the policies it can happen with
    "undecodable slots": ("fill", "drop"), "mask": ("fill", "drop"), "order": ("fill", "drop"),
    "outside the shard": ("fill", "drop"), "samples on two shards": ("fill", "drop"),
    "same batch on several shards": ("fill", "drop"), "repeated": ("fill", "drop"), "padding": ("fill",),
    "batches arrived": ("fill", "drop"), "outside the dataset": ("fill", "drop"),
    "drop count": ("drop",), "repeated across segments": ("fill", "drop"),
    "missing from the epoch": ("fill",),
}


@pytest.mark.parametrize("kind", list(RESIZE_KINDS))
@settings(max_examples=examples(5))
@given(data=st.data(), seed=st.integers(0, 2**32 - 1), epoch=st.integers(0, 100), segment=st.integers(0, 2),
       shard=st.integers(0, 4), row=st.integers(0, 1), slot=st.integers(0, 2))
def test_every_resize_finding_names_its_segment_and_global_step(kind, data, seed, epoch, segment, shard,
                                                               row, slot):
    last_batch = data.draw(st.sampled_from(RESIZE_KINDS[kind]))
    shuffle = kind != "order" and data.draw(st.booleans())
    got, masks, partition, i, words, step = one_resize_deviation(kind, last_batch, shuffle, seed, epoch, segment,
                                                           shard, row, slot)
    found = resized(got, PSEGMENTS, masks=masks, last_batch=last_batch, shuffle=shuffle, partition=partition,
                    N=PN, seed=seed, epoch=epoch)
    prefix = "" if i is None else f"segment {i}: "
    named = [(text, shards, steps) for text, shards, steps, _ in found.kinds.get(kind, [])
             if text.startswith(prefix) and words in text]
    assert named, f"no {kind} finding says {prefix}...{words!r}:\n{found.report()}"
    assert any(step in steps for _, _, steps in named), (named, step)
    if i is not None:
        assert all(s == i for _, shards, _ in named for s, _ in shards), named
    if partition == "any":  # the same deviation is seen against the plan too
        contiguous = resized(got, PSEGMENTS, masks=masks, last_batch=last_batch, shuffle=shuffle, N=PN,
                             seed=seed, epoch=epoch)
        assert contiguous, f"{kind}: 'any' found it, 'contiguous' did not"
    # (The plans alone conform: test_elastic_plans_conform_and_a_restart_never_does.)


@st.composite
def resize_chains(draw):
    """(N, segments, last_batch): up to two changes, each at a drawn step of the segment
    before it (its end included), onto drawn (n, B)."""
    N, last_batch = draw(st.integers(1, 30)), draw(st.sampled_from(LAST_BATCH_POLICIES))
    shards, batches = st.integers(1, min(N, 6)), st.integers(1, 4)
    segments = [(0, draw(shards), draw(batches))]
    for _ in range(draw(st.integers(0, 2))):
        end, start = epoch_steps(N, segments, last_batch), segments[-1][0]
        if end == start:
            break
        segments.append((draw(st.integers(start + 1, end)), draw(shards), draw(batches)))
    return N, segments, last_batch


@settings(max_examples=examples(30))
@given(resize_chains(), st.integers(0, 2**32 - 1), st.integers(0, 100), st.booleans())
@example((7, [(0, 2, 2), (1, 4, 1)], "fill"), 0, 0, False)  # the worked table's edges: an empty run,
@example((7, [(0, 2, 2), (2, 3, 1)], "fill"), 0, 0, True)  # a change at the end (0 steps),
@example((7, [(0, 2, 2), (1, 3, 1)], "drop"), 0, 0, False)  # drop's end, skipped samples stay skipped,
@example((7, [(0, 2, 1), (1, 3, 1), (2, 2, 1)], "fill"), 3, 1, True)  # two changes
@example((1, [(0, 1, 1), (1, 1, 1)], "fill"), 0, 0, False)  # nothing left after the change
def test_elastic_plans_conform_and_a_restart_never_does(chain, seed, epoch, shuffle):
    """Any chain's elastic_plan, decoded from encoded samples, gives an empty report in both
    modes with masks; without masks, only a segment with fewer samples left than shards
    gives findings, of the three kinds the docstring names, on that segment. Negative
    control: the last segment restarting the epoch (its fresh epoch_plan from step 0)
    repeats segment 0's samples, named."""
    N, segments, last_batch = chain
    plans = elastic_plan(N, segments, epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch)
    got = [encoding.decode_indices(encoding.encoded_images(p.indices.ravel(), (3,), np.uint8))
           .reshape(p.indices.shape) for p in plans]
    masks = [p.mask for p in plans]
    steps = epoch_steps(N, segments, last_batch)
    args = dict(last_batch=last_batch, shuffle=shuffle, N=N, seed=seed, epoch=epoch)
    run = dict(epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch)
    crowded = {i for i, (t, n, _) in enumerate(segments)  # fewer samples left than shards
               if len(remaining_samples(N, segments, t, **run)) < n and len(plans[i].indices)}
    for partition in conformance.PARTITIONS:
        found = resized(got, segments, masks=masks, partition=partition, length=steps, **args)
        assert not found, found.report(f"{chain}, {partition}")
        bare = resized(got, segments, masks=None, partition=partition, length=steps, **args)
        assert set(bare.kinds) <= {"same batch on several shards", "samples on two shards",
                                   "outside the shard"}
        assert {s for items in bare.kinds.values() for _, shards, *_ in items for s, _ in shards} == crowded
    if len(segments) > 1 and len(plans[0].indices) and masks[0].any():
        (_, n, B) = segments[-1]
        again = epoch_plan(N, n, B, epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch)
        if again.mask.any():
            found = resized(got[:-1] + [again.indices], segments, masks=masks[:-1] + [again.mask],
                            partition="any", **args)
            # fill: the restart delivers all N again; drop: its first step's samples, unless the
            # earlier segments had skipped exactly those
            twice = set(np.concatenate([g[m] for g, m in zip(got[:-1], masks[:-1])]).tolist()) & \
                set(again.indices[again.mask].tolist())
            assert bool(twice) == ("repeated across segments" in found.kinds), found.report()
            if last_batch == "fill":
                assert twice, "fill: a restart repeats every sample delivered before it"


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "outside the dataset"])
def test_one_segment_gives_describe_epochs_findings_by_segment(kind):
    """describe_resized_epoch reuses describe_epoch's per-shard checks: on one segment
    [(0, n, B)] every finding of describe_epoch (but the step count, checked over the
    epoch) comes back with the text prefixed "segment 0: " and its shards as (0, k)."""
    for last_batch, shard, step, slot, seed in (("fill", 0, 2, 1, 7), ("drop", 3, 1, 2, 8),
                                                ("fill", 2, 0, 0, 9)):
        step = min(step, USTEPS[last_batch] - 1)
        got, mask, args, _, _ = one_deviation(kind, last_batch, shard, step, slot, seed)
        want = conformance.describe_epoch(got, UN, UB, masks=mask, **args)
        args.pop("length")
        found = conformance.describe_resized_epoch([got], UN, [(0, Un, UB)], epoch=0, seed=seed, masks=[mask],
                                                   **args)
        assert kind in want.kinds
        for name, items in want.kinds.items():
            if name != "step count":
                assert found.kinds[name] == [(f"segment 0: {text}", {(0, k) for k in shards}, steps, samples)
                                             for text, shards, steps, samples in items], name
        assert set(found.kinds) - set(want.kinds) <= {"missing from the epoch", "drop count"}


@pytest.mark.parametrize("last_batch", LAST_BATCH_POLICIES)
def test_another_exactly_once_partition_after_the_resize_conforms_only_to_any(resized_epochs, last_batch):
    """After the change the 3 new shards split what is left strided (shard k takes every
    third remaining sample from the k-th), as many steps as the plan: exactly once still
    (partition="any" finds nothing), not the plan's runs (contiguous names them)."""
    delivered, masks = resized_epochs[last_batch]
    segments = RSEGMENTS[:2]
    pool = remaining_samples(RN, segments, 2, epoch=REPOCH, seed=RSEED, shuffle=True,
                                     last_batch=last_batch)
    steps = epoch_steps(RN, segments, last_batch) - 2
    strided = np.stack([pool[k::3][:steps * 2].reshape(steps, 2) for k in range(3)], axis=1)
    mask = np.ones(strided.shape, bool)  # 24 left, 8 a shard: 4 whole steps of 2, no padding
    assert not resized([delivered[0], strided], segments, masks=[masks[0], mask], last_batch=last_batch,
                       partition="any", length=6)
    found = resized([delivered[0], strided], segments, masks=[masks[0], mask], last_batch=last_batch)
    # (drop's last segment owes no particular samples: which are skipped is the shuffle's)
    want = {"outside the shard", "missing"} if last_batch == "fill" else {"outside the shard"}
    assert set(found.kinds) == want, found.report()


# Any partition, where a finding points, and the helpers ------------------------


def strided_epoch(N, n, B):
    """A correct loader with another partition: shard k is k::n, padded to equal steps."""
    steps = -(-(-(-N // n)) // B)
    delivered = np.empty((steps, n, B), np.int64)
    masks = np.zeros((steps, n, B), bool)
    for k in range(n):
        own = np.arange(k, N, n)
        slots = np.concatenate([own, np.full(steps * B - len(own), own[-1])])
        delivered[:, k] = slots.reshape(steps, B)
        masks[:, k] = (np.arange(steps * B) < len(own)).reshape(steps, B)
    return delivered, masks


def test_a_strided_partition_passes_the_any_mode_and_fails_the_contiguous_one():
    N, n, B = 1003, 8, 16
    delivered, masks = strided_epoch(N, n, B)
    args = dict(shuffle=False, last_batch="fill", length=len(delivered), masks=masks)
    assert not conformance.describe_epoch(delivered, N, B, partition="any", **args)
    contiguous = conformance.describe_epoch(delivered, N, B, **args)
    assert {"outside the shard", "missing"} <= set(contiguous.kinds)
    # Controls: the any mode still catches a lost sample, a sample on two shards and an uneven shard.
    lost = delivered.copy()
    lost[0, 0, 0] = lost[0, 1, 0]  # shard 0 loses sample 0 and repeats shard 1's sample 1
    found = conformance.describe_epoch(lost, N, B, partition="any", **args)
    assert {"missing", "samples on two shards"} <= set(found.kinds), found.report()
    [(text, shards, steps, samples)] = found.kinds["samples on two shards"]
    assert (steps, samples) == ({0}, {1}) and "sample 1 at step 0 of shard 0 and step 0 of shard 1" in text
    short = [delivered[:, k] for k in range(n)]
    short[3] = short[3][:-1]
    found = conformance.describe_epoch(short, N, B, partition="any", shuffle=False, last_batch="fill",
                                       length=len(delivered), masks=[masks[:, k] for k in range(n)])
    assert "batches arrived" in found.kinds


def test_every_finding_names_its_steps():
    N, n, B = 13, 2, 2
    plan = epoch_plan(N, n, B)
    delivered, masks = plan.indices.copy(), plan.mask.copy()
    delivered[0, 0, 0] = 12  # outside shard 0, on two shards, shard 0 misses sample 0
    delivered[1, 1, 0] = -1  # undecodable
    delivered[3, 0, 1] = 8  # padding from another shard
    masks[3, 1, 1] = False  # a mask unlike the plan's
    found = conformance.describe_epoch(delivered, N, B, shuffle=False, last_batch="fill", length=5,
                                       masks=masks)
    shifted = plan.indices.copy()
    shifted[:, 1] = np.roll(shifted[:, 1].ravel(), 1).reshape(-1, B)  # a stream one slot late
    found = conformance.describe_epoch(shifted, N, B, shuffle=False, last_batch="fill", length=5,
                                       masks=masks, findings=found)
    assert len(found.kinds) >= 7 and "shifted by 1 slots" in found.report(), found.report()
    for kind, items in found.kinds.items():
        for text, shards, steps, samples in items:
            assert steps and "step" in text, f"{kind}: {text!r} names no step"


def long_delivery(N=800, shards=2, batch=4):
    plan = epoch_plan(N, shards, batch)
    return [plan.indices[:, k].copy() for k in range(shards)], [plan.mask[:, k].copy() for k in range(shards)]


@pytest.mark.parametrize("shift", [-17, -16, -1, 1, 16, 17])
def test_a_constant_shift_is_named_up_to_four_batches_either_way_with_its_steps_and_first_sample(shift):
    # B = 4: a stream early or late by up to 4B = 16 slots is one "shifted" finding; by 17
    # it is a slot-by-slot one. Either names shard 1, every step that differs, and what it
    # delivered there.
    delivered, masks = long_delivery()
    want = delivered[1].ravel().copy()
    got = np.roll(want, shift)
    delivered[1] = got.reshape(delivered[1].shape)
    found = conformance.describe_epoch(delivered, 800, 4, shuffle=False, last_batch="fill",
                                       length=len(masks[0]), masks=masks)
    assert set(found.kinds) == {"order"}, found.report()
    [(text, shards, steps, samples)] = found.kinds["order"]
    wrong = np.flatnonzero(got != want)
    assert shards == {1} and steps == set((wrong // 4).tolist()), (shards, steps)
    if abs(shift) <= 16:
        assert text == (f"shard 1 is shifted by {shift} slots against the plan from step {wrong[0] // 4} "
                        f"(it starts with sample {got[0]}, the plan with {want[0]})"), text
        assert samples == {int(got[0])}
    else:
        s, j = divmod(int(wrong[0]), 4)
        assert text == (f"shard 1 step {s} slot {j}: sample {got[wrong[0]]}, the plan says {want[wrong[0]]} "
                        f"({wrong.size} of {want.size} slots differ)"), text
        assert samples == set(got[wrong].tolist())


def test_a_shift_is_named_on_a_stream_of_one_batch_and_not_past_its_end():
    # A shard of one step of 4: a shift by 1..3 leaves fewer than B slots to compare, so it
    # is read slot by slot; the finding still names the step.
    delivered, masks = long_delivery(N=8, shards=2, batch=4)
    delivered[0] = np.roll(delivered[0].ravel(), 1).reshape(1, 4)
    [(text, shards, steps, samples)] = conformance.describe_epoch(
        delivered, 8, 4, shuffle=False, last_batch="fill", length=1, masks=masks).kinds["order"]
    assert text.startswith("shard 0 step 0 slot 0: sample 3, the plan says 0 (4 of 4 slots differ)"), text
    assert (shards, steps, samples) == ({0}, {0}, {0, 1, 2, 3})


@pytest.mark.parametrize("lost", [0, 399, 400, 799])
def test_any_partition_names_a_missing_sample_at_either_end_with_every_shard_and_step(lost):
    # partition="any", fill: a sample no real slot delivers (here made -1, a slot that
    # decodes to nothing) is "missing", on every shard and step (it could have been anywhere).
    delivered, masks = long_delivery()
    k, at = divmod(int(np.flatnonzero(np.concatenate([d.ravel() for d in delivered]) == lost)[0]), 400)
    delivered[k].reshape(-1)[at] = -1
    found = conformance.describe_epoch(delivered, 800, 4, shuffle=True, last_batch="fill", length=100,
                                       masks=masks, partition="any")
    [(text, shards, steps, samples)] = found.kinds["missing"]
    assert text == (f"1 of the 800 samples are never delivered in a real slot of any shard, in any of "
                    f"steps 0-99 (e.g. [{lost}])"), text
    assert (shards, steps, samples) == ({0, 1}, set(range(100)), {lost})


@pytest.mark.parametrize("extra", [799, 800, 801])
def test_any_partition_names_a_sample_past_the_dataset_with_its_shard_and_step(extra):
    # Sample N - 1 = 799 is in the dataset (on another shard too); N and past it are not.
    delivered, masks = long_delivery()
    lost = int(delivered[1][7, 2])
    delivered[1][7, 2] = extra
    found = conformance.describe_epoch(delivered, 800, 4, shuffle=True, last_batch="fill", length=100,
                                       masks=masks, partition="any")
    assert found.kinds["missing"][0][3] == {lost}
    one = conformance.describe_resized_epoch([np.stack(delivered, 1)], 800, [(0, 2, 4)], epoch=0, seed=0,
                                             shuffle=True, last_batch="fill", masks=[np.stack(masks, 1)],
                                             partition="any")
    if extra < 800:
        assert "outside the dataset" not in set(found.kinds) | set(one.kinds), found.report()
        return
    [(text, shards, steps, samples)] = found.kinds["outside the dataset"]
    assert text == f"1 delivered samples are not in range(800) (e.g. [{extra}]; first at step 7)", text
    assert (shards, steps, samples) == ({1}, {7}, {extra})
    [(text, shards, steps, samples)] = one.kinds["outside the dataset"]  # one segment, the same range
    assert (shards, steps, samples) == ({(0, 1)}, {7}, {extra}) and text.endswith(
        f"first: sample {extra} at step 7 on shard 1 of segment 0)"), text


@pytest.mark.parametrize("d", [1, -1, 4, -4, 5, -5])
def test_values_shifted_in_the_shards_stream_are_named_up_to_four_slots_either_way(d):
    # Each shard's slot j holds the value of the sample d slots on in its own stream (a
    # loader that pairs values with the wrong slots), wrapping around at its ends: |d|
    # wrong slots with no slot d on, which the words allow. Up to SHIFTS = 4 slots it is
    # named, with its direction; at 5 the finding has no such words (every slot counted).
    plan = epoch_plan(64, 2, 4, shuffle=True, seed=3)
    reference = (np.arange(64) * 3).astype(np.int32)
    values = np.empty(plan.indices.shape, np.int32)
    for k in range(2):
        flat = plan.indices[:, k].ravel()
        values[:, k] = reference[np.roll(flat, -d)].reshape(-1, 4)
    found = conformance.describe_values(plan.indices, values, reference)
    items = found.kinds["labels"]
    assert conformance.SHIFTS == 4 and [sorted(shards) for _, shards, *_ in items] == [[0], [1]], found.report()
    for k, (text, shards, steps, samples) in enumerate(items):
        assert text.startswith(f"shard {k}: 32 of 32 slots hold labels that are not their sample's"), text
        words = (f"; every one holds the labels of the sample {abs(d)} slot(s) {'later' if d > 0 else 'earlier'}"
                 f" in the shard's stream (where there is one): labels shifted by {d:+d} slot(s)")
        assert text.endswith(words) if abs(d) <= 4 else "shifted" not in text, text
        assert len(samples) == 32 and steps <= set(range(8)), (samples, steps)


def test_describe_values_adds_to_the_findings_it_is_given_and_names_each_shard():
    # Two shards each with values of the wrong per-sample shape, (2,) for scalar labels:
    # one finding each, naming its shard and every step; into the Findings passed in.
    plan = epoch_plan(16, 2, 2)
    reference = np.arange(16, dtype=np.int32) * 5
    mine = conformance.Findings()
    mine.add("earlier", "a finding of mine")
    wide = np.zeros(plan.indices.shape + (2,), np.int32)
    found = conformance.describe_values(plan.indices, wide, reference, findings=mine)
    assert found is mine and set(found.kinds) == {"earlier", "labels shape"}
    assert [(t, k, st) for t, k, st, _ in found.kinds["labels shape"]] == [
        (f"shard {k}: labels arrive as int32 (2,) per sample; the dataset's are int32 ()", {k}, set(range(4)))
        for k in range(2)]


def test_describe_values_names_the_first_wrong_scalar_and_its_step_and_skips_what_is_not_a_sample():
    plan = epoch_plan(16, 2, 2)  # 4 steps of 2 a shard; shard 1 holds samples 8..15
    reference = np.arange(16, dtype=np.int32) * 5
    values = reference[plan.indices]
    values[2, 1, 1] = 7  # shard 1, step 2, slot 1: sample 13's value should be 65
    indices = plan.indices.copy()
    indices[3, 1, 0] = 16  # a slot that decodes to no sample of the dataset: not judged
    [(text, shards, steps, samples)] = conformance.describe_values(indices, values, reference).kinds["labels"]
    assert text == ("shard 1: 1 of 7 slots hold labels that are not their sample's (first: step 2 slot 1 "
                    "holds sample 13 with labels 7, the dataset's is 65)"), text
    assert (shards, steps, samples) == ({1}, {2}, {13})
    # A list of one shard: its own batch size
    one = conformance.describe_values([plan.indices[:, 1]], [values[:, 1]], reference)
    assert one.kinds["labels"][0][0].startswith("shard 0: 1 of 8 slots"), one.report()
    # values of more than one element per sample name no values in the text
    pairs = np.stack([reference, reference], axis=1)
    got = pairs[plan.indices]
    got[2, 1, 1] = -1  # no sample's value
    [(text, *_)] = conformance.describe_values(plan.indices, got, pairs).kinds["labels"]
    assert text == ("shard 1: 1 of 8 slots hold labels that are not their sample's (first: step 2 slot 1 "
                    "holds sample 13)"), text


def test_shard_blocks_splits_both_layouts():
    x = np.arange(24).reshape(12, 2)
    np.testing.assert_array_equal(conformance.shard_blocks(x, 3)[1], x[4:8])
    np.testing.assert_array_equal(conformance.shard_blocks(x.reshape(3, 4, 2), 3, "pmap")[2], x[8:])
    y = np.arange(12).reshape(4, 3)  # a pmap batch of two axes; a sharded one of one
    np.testing.assert_array_equal(conformance.shard_blocks(y, 4, "pmap"), y)
    np.testing.assert_array_equal(conformance.shard_blocks(y.ravel(), 4), y)


def test_real_first_moves_every_real_slot_first_in_order_and_keeps_the_shapes():
    # Each shard: its real slots in their order, then its padding in its order; masks
    # likewise, cut to the batches that arrived; each shard (steps, B) as it came.
    delivered = [np.arange(6).reshape(3, 2), np.arange(10, 16).reshape(3, 2), np.arange(20, 24).reshape(2, 2)]
    masks = [np.array([[False, True], [True, False], [False, True]]),
             np.ones((3, 2), bool),
             np.array([[False, False], [False, False], [True, True]])]  # a batch more than arrived
    got, got_masks = conformance.real_first(delivered, masks)
    want = [[1, 2, 5, 0, 3, 4], list(range(10, 16)), [20, 21, 22, 23]]
    want_masks = [[True] * 3 + [False] * 3, [True] * 6, [False] * 4]
    assert len(got) == len(got_masks) == 3
    for k in range(3):
        assert got[k].shape == got_masks[k].shape == delivered[k].shape
        np.testing.assert_array_equal(got[k].ravel(), want[k], err_msg=f"shard {k}")
        np.testing.assert_array_equal(got_masks[k].ravel(), want_masks[k], err_msg=f"shard {k}")
    # 40 slots (a sort that is not stable reorders equal keys beyond 16), masks of 0 and 1.
    rng = np.random.default_rng(8)
    long, mask = rng.permutation(40).reshape(5, 8), rng.integers(0, 2, (5, 8))
    [got], [got_mask] = conformance.real_first([long], [mask])
    real = mask.ravel().astype(bool)
    np.testing.assert_array_equal(got.ravel(), np.concatenate([long.ravel()[real], long.ravel()[~real]]))
    assert got_mask.dtype == bool
    np.testing.assert_array_equal(got_mask.ravel(), np.sort(real)[::-1])


# describe_content -----------------------------------------------------------------


def content_case():
    norm = Normalize()
    ref_images = encoding.encoded_images(np.arange(8))
    ref_labels = (np.arange(8) % 10).astype(np.int32)
    return norm, ref_images, ref_labels


def test_content_checks_sample_0_skips_only_undecodable_slots_and_counts_each_image():
    # Sample 0 is a sample like any other; a -1 slot may hold anything; labels one per slot
    # in any shape ((B, 1) too); the count names how many images differ.
    norm, ref_images, ref_labels = content_case()
    indices = np.array([0, -1, 2, 3])
    images = norm(ref_images[np.maximum(indices, 0)])
    labels = ref_labels[np.maximum(indices, 0)].reshape(-1, 1)
    images[1] += 7.0  # the -1 slot: garbage, skipped
    labels[1] = 9
    assert conformance.describe_content(images, labels, indices, ref_images, ref_labels, norm) == []
    labels[0] = 5
    images[0, 0, 0, 0] += 1.0
    images[3, 2, 5, 5] -= 1.0
    assert conformance.describe_content(images, labels, indices, ref_images, ref_labels, norm) == [
        "1 labels differ from the file (slot 0 holds sample 0 with label 5, the file says 0)",
        "2 images differ from the rocal table of their sample"]
    nothing = np.full(4, -1)
    assert conformance.describe_content(images, labels, nothing, ref_images, ref_labels, norm) == []
    # DALI's own arithmetic against rocAL's table: a few ulps apart, named so.
    dali = Normalize(arithmetic="dali_cpu")(ref_images[[3, 4, 5]])
    [text] = conformance.describe_content(dali, ref_labels[[3, 4, 5]], [3, 4, 5], ref_images, ref_labels, norm)
    assert text.endswith("another arithmetic than the table's"), text


@pytest.mark.parametrize("ulps", [1, 8, 9])
def test_content_names_up_to_8_ulps_as_another_arithmetic_and_not_beyond(ulps):
    # "up to 8 ulps" (of the largest magnitude, the table's scale) is named with the count;
    # 9 is a plain difference; a mirrored batch is named so.
    norm, ref_images, ref_labels = content_case()
    indices = np.array([1, 4, 6])
    want = norm(ref_images[indices])
    scale = np.spacing(np.float32(np.abs(want).max()))
    images = want.copy()
    at = np.unravel_index(np.argmax(np.abs(want)), want.shape)
    images[at] = want[at] + np.sign(want[at]) * ulps * scale
    [text] = conformance.describe_content(images, ref_labels[indices], indices, ref_images, ref_labels,
                                          norm)
    note = f"; up to {ulps} ulps apart: another arithmetic than the table's" if ulps <= 8 else ""
    assert text == f"1 images differ from the rocal table of their sample{note}"
    [text] = conformance.describe_content(want[..., ::-1], ref_labels[indices], indices, ref_images,
                                          ref_labels, norm)
    assert text == ("3 images differ from the rocal table of their sample; they equal the mirrored "
                    "images: mirror=0 was not honoured")


# Bad input ------------------------------------------------------------------------

PLAN = epoch_plan(13, 2, 2)
SEGMENTS = [(0, 2, 2), (1, 3, 1)]
PLANS = elastic_plan(7, SEGMENTS)
RUN = dict(epoch=0, seed=0, shuffle=False, last_batch="fill")
EPOCH = dict(shuffle=False, last_batch="fill", length=4)


def one_epoch(*args, **kwargs):
    return conformance.describe_epoch(*args, **{**EPOCH, **kwargs})


def resized_epoch(*args, **kwargs):
    return conformance.describe_resized_epoch(*args, **{**RUN, **kwargs})


def content(images=None, labels=None, indices=(0, 1)):
    norm, ref_images, ref_labels = content_case()
    images = norm(ref_images[:2]) if images is None else images
    return conformance.describe_content(images, ref_labels[:2] if labels is None else labels, np.array(indices),
                                        ref_images, ref_labels, norm)


BAD = [  # (call, the words of its ValueError)
    (lambda: one_epoch(PLAN.indices[:, 0], 13, 2), "describe_epoch: delivered as one array must be (steps, "
                                                        "n, B) like Plan.indices"),
    (lambda: one_epoch(PLAN.indices, 13, 3), "B = batch_size = 3"),
    (lambda: one_epoch(PLAN.indices.astype(float), 13, 2), "describe_epoch: delivered[0] must hold integer "
                                                                "values, got dtype float64"),
    (lambda: one_epoch(PLAN.indices, 13, 2, masks=PLAN.mask[:, :1]), "masks has 1 shards, delivered 2"),
    (lambda: one_epoch([PLAN.indices[:, 0]], 13, 2, masks=[PLAN.mask[:2, 0]]),
     "describe_epoch: masks of shard 0 cover 2 batches, delivered has 4"),
    (lambda: one_epoch(PLAN.indices, 13, 2, partition="strided"),
     "describe_epoch: partition must be one of ('contiguous', 'any'), got 'strided'"),
    (lambda: one_epoch(PLAN.indices, 13, 2, last_batch="pad"), "describe_epoch: last_batch must be one of"),
    (lambda: one_epoch([np.zeros(4, np.int64)], 13, 2), "describe_epoch: delivered[0] must be (steps, B)"),
    (lambda: one_epoch([], 13, 2), "delivered must be an array (steps, n, B) or a non-empty list"),
    (lambda: one_epoch(PLAN.indices, -13, 2, partition="any"),
     "describe_epoch: num_samples must be an int >= 0, got -13"),
    (lambda: one_epoch(PLAN.indices, 13, 0), "describe_epoch: batch_size must be an int >= 1, got 0"),
    (lambda: one_epoch(PLAN.indices, 13, 2, length=None), "describe_epoch: length must be an int >= 0, "
                                                               "got None"),
    (lambda: one_epoch(PLAN.indices, 13, 2, length=4.0), "length must be an int >= 0, got 4.0"),
    (lambda: resized_epoch([p.indices for p in PLANS], 7, [(0, 2, 2), (5, 3, 1)]),
     "describe_resized_epoch: segments=[(0, 2, 2), (5, 3, 1)] is not an epoch elastic_plan accepts: "
     "elastic_plan: segments[1].start=5 is after the epoch's end at step 2"),
    (lambda: resized_epoch([PLANS[0].indices], 7, SEGMENTS),
     "describe_resized_epoch: delivered must be a list with one entry per segment (2), got 1"),
    (lambda: resized_epoch(PLANS[0].indices, 7, SEGMENTS),
     "delivered must be a list with one entry per segment (2), got ndarray"),
    (lambda: resized_epoch([p.indices for p in PLANS], 7, SEGMENTS, masks=[PLANS[0].mask]),
     "masks must be a list with one entry per segment (2), got 1"),
    (lambda: resized_epoch([PLANS[0].indices, PLANS[0].indices], 7, SEGMENTS),
     "describe_resized_epoch: delivered[1] as one array must be (steps, n, B) like Plan.indices with "
     "B = batch_size = 1, got shape (1, 2, 2)"),
    (lambda: resized_epoch([PLANS[0].indices, PLANS[1].indices[:, :2]], 7, SEGMENTS),
     "describe_resized_epoch: delivered[1] has 2 shards; segments[1]=(1, 3, 1) has 3"),
    (lambda: resized_epoch([p.indices for p in PLANS], 7, SEGMENTS, masks=[p.indices for p in PLANS]),
     "describe_resized_epoch: masks[0][0] must hold bool values, got dtype int64"),
    (lambda: resized_epoch([p.indices for p in PLANS], 7, SEGMENTS, partition="strided"),
     "describe_resized_epoch: partition must be one of ('contiguous', 'any'), got 'strided'"),
    (lambda: resized_epoch([p.indices for p in PLANS], 7, SEGMENTS, length=-1),
     "describe_resized_epoch: length must be an int >= 0, got -1"),
    (lambda: conformance.describe_epochs({0: PLAN.indices}, 2, shuffle=True),
     "describe_epochs: needs two or more reads (epoch, delivered), got 1"),
    (lambda: conformance.describe_epochs({0: PLAN.indices, 1: PLAN.indices[:, :1]}, 2, shuffle=True),
     "describe_epochs: epoch 1 has 1 shards, epoch 0 has 2; all reads must come from one loader"),
    (lambda: conformance.describe_epochs({0: PLAN.indices, 1: PLAN.indices[0]}, 2, shuffle=True),
     "describe_epochs: epochs[1] as one array must be (steps, n, B)"),
    (lambda: conformance.describe_values(PLAN.indices, PLAN.indices[:2], np.arange(13)),
     "describe_values: labels[0] covers 2 batches, delivered has 4"),
    (lambda: conformance.describe_values(PLAN.indices, PLAN.indices[:, :1], np.arange(13)),
     "describe_values: labels has 1 shards, delivered 2"),
    (lambda: conformance.describe_values(PLAN.indices, PLAN.indices, np.int64(3), name="ids"),
     "describe_values: reference must be the dataset's 'ids' array (N, ...), got shape ()"),
    (lambda: conformance.describe_values(PLAN.indices[:, 0], PLAN.indices, np.arange(13)),
     "describe_values: delivered must be an array (steps, n, B)"),
    (lambda: conformance.shard_blocks(np.zeros((12, 2)), 5), "'sharded' batch must be (n*B, ...) with n = "
                                                             "num_shards = 5, got shape (12, 2)"),
    (lambda: conformance.shard_blocks(np.zeros((12, 2)), 3, "pmap"), "a 'pmap' batch must be (n, B, ...)"),
    (lambda: conformance.shard_blocks(np.arange(4), 4, "pmap"), "a 'pmap' batch must be (n, B, ...)"),
    (lambda: conformance.shard_blocks(np.zeros((12, 2)), 0), "shard_blocks: num_shards must be an int >= 1, "
                                                             "got 0"),
    (lambda: conformance.shard_blocks(np.zeros((12, 2)), 3, "jit"), "shard_blocks: layout must be one of"),
    (lambda: conformance.real_first([PLAN.indices[:, 0]], [PLAN.mask[:, 0]] * 2),
     "real_first: masks has 2 shards, delivered 1"),
    (lambda: conformance.real_first([PLAN.indices[:, 0]], [PLAN.mask[:3, 0]]),
     "real_first: masks[0] covers 3 batches, delivered[0] has 4"),
    (lambda: content(indices=(0, 1, 2)), "describe_content: images_BCHW (B, C, H, W), labels_B and indices_B must "
                                         "hold one entry per slot, got shapes (2, 3, 32, 32), (2,) and (3,)"),
    (lambda: content(labels=np.zeros(3, np.int32)), "got shapes (2, 3, 32, 32), (3,) and (2,)"),
    (lambda: content(images=np.zeros((2, 3, 32), np.float32)), "got shapes (2, 3, 32), (2,) and (2,)"),
]


@pytest.mark.parametrize("call, words", BAD, ids=[words[:48] for _, words in BAD])
def test_bad_input_is_refused_naming_the_parameter_and_the_value(call, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        call()


def test_the_bad_input_tables_good_calls_are_accepted():
    """The control of the test above: its calls with good input raise nothing."""
    assert not one_epoch(PLAN.indices, 13, 2, masks=PLAN.mask)
    assert not one_epoch([PLAN.indices[:, k] for k in range(2)], 13, 2, masks=[PLAN.mask[:, k] for k in range(2)])
    assert not resized_epoch([p.indices for p in PLANS], 7, SEGMENTS, masks=[p.mask for p in PLANS],
                                      length=2)
    assert not conformance.describe_epochs({0: PLAN.indices, 1: PLAN.indices}, 2, shuffle=False)
    assert not conformance.describe_values(PLAN.indices, PLAN.indices, np.arange(13))
    assert conformance.shard_blocks(np.zeros((12, 2)), 3).shape == (3, 4, 2)
    assert conformance.real_first([PLAN.indices[:, 0]], [PLAN.mask[:, 0]])[0][0].shape == (4, 2)
    assert content() == []
