"""The NVIDIA DALI backend (dali_loader.py), checked against real DALI pipelines.

Skipped when nvidia.dali does not import (``pip install -r requirements-dali.txt``).
Everything here runs DALI's CPU pipelines on the suite's devices; the GPU tests
run where JAX sees an NVIDIA GPU. Where a GPU fact could only be read (DALI's
GPU kernel), the test that pins it names DALI's file and function.

* Conformance: a dataset whose images encode their own index goes through the
  backend, for drawn (N, n, B, last_batch, shuffle, layout, order) and for a
  matrix {fill, drop} x {shuffle on, off} x {sharded, pmap} x {plan, vendor}
  (a few cells in CI, all with --run-slow), and in two processes (jax.distributed,
  2 x 4 CPU devices). What each shard delivered is decoded and described against
  the plan (conformance.py). order="plan": the global arrays equal the reference
  loader's bit for bit. order="vendor": every sample of the shard once (fill),
  none twice (drop), and with shuffle on the one described deviation, "order".
* Stateless: an epoch is a function of (seed, epoch, start_step, shard): read
  twice, by two loaders, in any order, resumed mid-epoch, the same batches.
* Pixels: crop, mirror and per-channel mean/std equal Normalize(arithmetic=
  "dali_cpu") bit for bit, and not the rocAL table (negative control). The
  "dali_gpu" table is DALI's GPU kernel's FMA, computed independently here.
* Device kinds: arithmetic_for, usable and refimpl.choose_backend on fake
  NVIDIA, ROCm and CPU devices; the DLPack conversion the GPU path uses, driven
  by CPU pipelines, with and without DALI's dynamic executor.
* DALI's departures from the spec, each asserted as DALI really behaves, so a
  test fails when DALI changes: the shuffled native sharding, shards moving
  without stick_to_shard, run() not stopping at the epoch end, a reader that
  reset() does not rewind, what the seed changes, and the short epoch of a
  one-shard list.
* End to end: refimpl.py --backend dali and --backend reference, same seed and
  --normalize dali_cpu, write identical final params (--params-out).
* Wiring: refusals, MNIST-shaped data, the per-sample file cache, pipelines
  released with their epoch.

This file is also the worker program of the two-process test.
"""

import dataclasses
import gc
import json
import os
import shutil
import socket
import sys
import types
import weakref
from fractions import Fraction

import jax
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

pytest.importorskip("nvidia.dali", reason="needs NVIDIA DALI: pip install -r requirements-dali.txt")

if __name__ != "__main__":  # the worker below runs in a child process that sets its own devices
    from conftest import assert_same_bits, bits_differ, run_children

import conformance  # noqa: E402
import encoding  # noqa: E402
import dali_loader  # noqa: E402
import loaders  # noqa: E402
from arithmetic import Normalize, aligned_empty, crop_anchor, normalize_table
from cifar_mnist import IMAGE_SHAPE, MNIST_SHAPE, synthetic_cifar10
from plan import LAST_BATCH_POLICIES, LoaderState, epoch_plan, num_steps, shard_bounds

# The profile-scaled example count from conftest, under pytest. Not imported here:
# this file is also the two-process worker, and conftest starts JAX's backend.
examples = getattr(sys.modules.get("conftest"), "examples", lambda count: count)
pytestmark = pytest.mark.dali

DALI = Normalize(arithmetic="dali_cpu")  # mean = std = 127.5: every index decodes
CIFAR_MEAN, CIFAR_STD = (125.3, 123.0, 113.9), (63.0, 62.1, 66.7)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One per-sample file cache for the module: a dataset is written once, whatever test reads it."""
    return str(tmp_path_factory.mktemp("dali-cache"))


def encoded(N: int):
    """Images that encode their index, labels i % 10."""
    return encoding.encoded_images(np.arange(N)), (np.arange(N) % 10).astype(np.int32)


def shard_blocks(batch: dict, n: int) -> dict:
    """{name: (n, B, ...) numpy}; "sharded" (n*B, ...) and "pmap" (n, B, ...) alike."""
    out = {}
    for name, x in batch.items():
        x = np.asarray(x)
        per_sample = 3 if name == "images" else 0
        if x.ndim == 1 + per_sample:  # "sharded": (n*B, ...)
            x = x.reshape((n, -1) + x.shape[1:])
        out[name] = x
    return out


def describe(batches: list, N: int, B: int, n: int, images, labels, *, shuffle: bool,
             last_batch: str, length: int, normalize=DALI) -> str:
    """The conformance report of one epoch of global batches: '' when it conforms."""
    blocks = [shard_blocks(b, n) for b in batches]
    delivered = [np.array([encoding.decode_indices(b["images"][k], normalize) for b in blocks],
                          np.int64).reshape(-1, B) for k in range(n)]
    masks = [np.array([b["mask"][k] for b in blocks], bool).reshape(-1, B) for k in range(n)]
    report = conformance.describe_epoch(delivered, N, B, shuffle=shuffle, last_batch=last_batch,
                                        length=length, masks=masks).report()
    content = []
    for k in range(n):  # describe_epoch does not look inside padding slots
        got, real = delivered[k].ravel(), masks[k].ravel()
        if real.any() and (got[~real] != got[real][-1]).any():
            content.append(f"shard {k}: padding holds {np.unique(got[~real]).tolist()}, not its last "
                           f"real sample {got[real][-1]}")
    for step, b in enumerate(blocks):
        for k in range(n):
            content += [f"step {step} shard {k}: {text}" for text in conformance.describe_content(
                b["images"][k], b["labels"][k], delivered[k][step], images, labels, normalize)]
    return "\n".join(filter(None, [report] + content[:5]))


def assert_same_arrays(got: dict, want: dict, where: str) -> None:
    """Bit for bit, with the same shape, dtype and sharding."""
    assert got.keys() == want.keys(), where
    for name in want:
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, \
            f"{where} {name}: {got[name].dtype} {got[name].shape} != {want[name].dtype} {want[name].shape}"
        assert got[name].sharding == want[name].sharding, f"{where} {name}: sharding"
        assert_same_bits(got[name], want[name], f"{where} {name}")


def assert_raises_naming(error, fn, *fragments):
    with pytest.raises(error) as info:
        fn()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


# --------------------------------------------------------------------------
# Conformance: the backend's epochs against the plan
# --------------------------------------------------------------------------


def check_epoch(batches: list, reference, epoch: int, start_step: int, order: str, where: str) -> None:
    """One epoch (from start_step) of a DALI loader against the reference loader built alike.

    plan, or vendor with shuffle off (DALI's sharding is the plan's order): bit for
    bit. vendor with shuffle on: an empty report with any order within a shard
    allowed, nothing but "order" departing from the unshuffled plan, and the one
    described deviation: the order is not the (shuffled) plan's."""
    assert len(batches) == len(reference) - start_step, where
    if order == "plan" or not reference.shuffle:
        for step, got in enumerate(batches, start=start_step):
            assert_same_arrays(got, reference.batch(epoch, step), f"{where} epoch {epoch} step {step}")
        return
    N, n, B = len(reference.labels), reference.num_shards, reference.batch_size
    args = dict(last_batch=reference.last_batch, length=len(reference), normalize=reference.normalize)
    report = describe(batches, N, B, n, reference.images, reference.labels, shuffle=True, **args)
    assert not report, f"{where} epoch {epoch}:\n{report}"
    findings = describe_kinds(batches, N, B, n, shuffle=False, **args)
    assert findings <= {"order"}, f"{where} epoch {epoch}: {findings}"
    plan = reference.plan(epoch)
    got = np.stack([encoding.decode_indices(shard_blocks(b, n)["images"].reshape(n * B, *b["images"].shape[-3:]),
                                               reference.normalize).reshape(n, B) for b in batches])
    assert (got != plan.indices[start_step:])[plan.mask[start_step:]].any(), \
        f"{where} epoch {epoch}: DALI's order is the plan's: the described deviation is gone"
    for step, got in enumerate(batches):  # the mask is the plan's, positionally
        assert_same_arrays({"mask": got["mask"]}, {"mask": reference.batch(epoch, step)["mask"]},
                           f"{where} step {step}")


def describe_kinds(batches, N, B, n, *, shuffle, last_batch, length, normalize) -> set:
    """The kinds of deviation conformance.describe_epoch finds in one whole epoch."""
    blocks = [shard_blocks(b, n) for b in batches]
    delivered = [np.array([encoding.decode_indices(b["images"][k], normalize) for b in blocks],
                          np.int64).reshape(-1, B) for k in range(n)]
    masks = [np.array([b["mask"][k] for b in blocks], bool).reshape(-1, B) for k in range(n)]
    return set(conformance.describe_epoch(delivered, N, B, shuffle=shuffle, last_batch=last_batch,
                                          length=length, masks=masks).kinds)


@st.composite
def cases(draw):
    n = draw(st.sampled_from([1, 2, 3, 8]))
    N = draw(st.integers(20, 300))
    B = draw(st.integers(1, min(8, N // n)))
    return (N, n, B, draw(st.sampled_from(LAST_BATCH_POLICIES)), draw(st.booleans()),
            draw(st.sampled_from(loaders.LAYOUTS)), draw(st.integers(0, 2**32 - 1)),
            draw(st.sampled_from(dali_loader.ORDERS)))


@settings(max_examples=examples(4))
@given(cases())
# Shard lists a batch short of the plan (S_k = floor(N/n) a multiple of B): filled by the backend.
@example((23, 4, 5, "fill", True, "sharded", 0, "vendor"))
@example((23, 4, 5, "fill", True, "sharded", 0, "plan"))
def test_dali_epochs_conform_to_the_plan(devices, cache, case):
    N, n, B, last_batch, shuffle, layout, seed, order = case
    n = min(n, len(devices))
    images, labels = encoded(N)
    args = dict(layout=layout, shuffle=shuffle, seed=seed, last_batch=last_batch, normalize=DALI)
    loader = dali_loader.make_dali_loader((images, labels), devices[:n], B, cache_dir=cache, order=order,
                                          **args)
    # host_float32: the same bits as every placement (test_loaders.py), without a jit per shape.
    reference = loaders.make_loader((images, labels), devices[:n], B, prefetch=0,
                                    placement="host_float32", **args)
    assert len(loader) == len(reference) == num_steps(N, n, B, last_batch)
    for epoch in (1, 0):
        check_epoch(list(loader.epoch(epoch)), reference, epoch, 0, order, str(case))
        assert loader.real_samples(epoch) == reference.real_samples(epoch)


MATRIX_CI = {("plan", "fill", True, "sharded"), ("plan", "drop", False, "pmap"),
             ("vendor", "fill", True, "pmap"), ("vendor", "drop", True, "sharded"),
             ("vendor", "fill", False, "sharded")}  # every value of every axis; the rest with --run-slow


@pytest.mark.parametrize("order, last_batch, shuffle, layout", [
    pytest.param(*cell, marks=() if cell in MATRIX_CI else pytest.mark.slow)
    for cell in [(o, p, s, l) for o in dali_loader.ORDERS for p in LAST_BATCH_POLICIES
                 for s in (True, False) for l in loaders.LAYOUTS]])
def test_conformance_matrix(devices, cache, order, last_batch, shuffle, layout):
    """One process, N=53 over 4 shards (13, 13, 13, 14) in batches of 3: fill pads
    every shard, drop skips samples; epochs read out of order and resumed."""
    N, n, B = 53, 4, 3
    images, labels = encoded(N)
    args = dict(layout=layout, shuffle=shuffle, seed=11, last_batch=last_batch, normalize=DALI)
    loader = dali_loader.make_dali_loader((images, labels), devices[:n], B, cache_dir=cache, order=order,
                                          **args)
    reference = loaders.make_loader((images, labels), devices[:n], B, prefetch=0,
                                    placement="host_float32", **args)
    where = f"{order} {last_batch} shuffle={shuffle} {layout}"
    for epoch in (2, 0):
        check_epoch(list(loader.epoch(epoch)), reference, epoch, 0, order, where)
    resumed = list(loader.epoch(2, start_step=2))
    if order == "plan" or not shuffle:
        check_epoch(resumed, reference, 2, 2, order, where + " resumed at step 2")
    else:  # DALI's own order: the resumed steps are the tail of the same epoch read whole
        for got, want in zip(resumed, list(loader.epoch(2))[2:]):
            assert_same_arrays(got, want, where + " resumed at step 2")


def test_check_epoch_fails_on_the_wrong_order(devices, cache):
    """Negative control of the matrix's check: DALI's shuffled order held to the plan's
    bits fails, and the plan's own order fails the vendor check (no "order" deviation)."""
    N, n, B = 53, 4, 3
    images, labels = encoded(N)
    args = dict(shuffle=True, seed=11, normalize=DALI)
    vendor = dali_loader.make_dali_loader((images, labels), devices[:n], B, cache_dir=cache, order="vendor",
                                          **args)
    plan = dali_loader.make_dali_loader((images, labels), devices[:n], B, cache_dir=cache, **args)
    reference = loaders.make_loader((images, labels), devices[:n], B, prefetch=0, placement="host_float32",
                                    **args)
    with pytest.raises(AssertionError, match="epoch 0 step"):
        check_epoch(list(vendor.epoch(0)), reference, 0, 0, "plan", "vendor held to the plan")
    with pytest.raises(AssertionError, match="the described deviation is gone"):
        check_epoch(list(plan.epoch(0)), reference, 0, 0, "vendor", "plan held to the vendor's")
    # A sample from another shard in DALI's epoch: the conformance report names it.
    batches = [dict(b) for b in vendor.epoch(0)]
    swapped = np.asarray(batches[1]["images"]).copy()
    swapped[[0, B]] = swapped[[B, 0]]  # first slot of shard 0 <-> first slot of shard 1
    batches[1]["images"] = swapped
    with pytest.raises(AssertionError, match="outside the shard"):
        check_epoch(batches, reference, 0, 0, "vendor", "shards mixed")


@pytest.mark.parametrize("order", dali_loader.ORDERS)
def test_epochs_are_a_function_of_seed_epoch_step_and_shard(devices, cache, order):
    """Epoch 3 read twice, by two loaders built alike, before and after other epochs,
    an epoch left early in between, and resumed at every step: the same batches."""
    N, n, B = 50, 4, 3  # 5 steps an epoch
    images, labels = encoded(N)
    args = dict(shuffle=True, seed=7, last_batch="fill", normalize=DALI, cache_dir=cache, order=order)
    first = dali_loader.make_dali_loader((images, labels), devices[:n], B, **args)
    second = dali_loader.make_dali_loader((images, labels), devices[:n], B, **args)

    def read(loader, epoch, start_step=0):
        return [{k: np.asarray(v) for k, v in b.items()} for b in loader.epoch(epoch, start_step)]

    left_early = first.epoch(0)
    next(left_early)
    left_early.close()
    three = read(first, 3)
    assert len(three) == 5
    read(second, 1)
    again = read(second, 3)
    for start_step in range(6):
        resumed = read(first, 3, start_step)
        assert len(resumed) == 5 - start_step
        for step, got in enumerate(resumed, start=start_step):
            for name in got:
                where = f"{order}: epoch 3 step {step} {name} (start_step {start_step})"
                assert_same_bits(got[name], three[step][name], where)
                assert_same_bits(again[step][name], three[step][name], where + ", read again")
    # Negative control: another epoch is another order, so the comparison above can fail.
    assert any(bits_differ(a["images"], b["images"]) for a, b in zip(read(first, 2), three))


# --------------------------------------------------------------------------
# Pixels: crop, mirror, per-channel mean and std
# --------------------------------------------------------------------------


@pytest.mark.parametrize("crop, crop_pos, mirror, wrong", [
    # anchors 1.5 -> 2 (y) and 2.5 -> 3 (x): DALI rounds half away from zero, rocAL to even.
    ((29, 27), (0.5, 0.5), True, dict(mirror=False)),
    # anchors y = 1/6 * 4 -> 1, x = 0.9 * 2 -> 2: crop_pos is (pos_y, pos_x), not the reverse.
    ((28, 30), (1 / 6, 0.9), False, dict(crop_pos=(0.9, 1 / 6))),
    # anchors 0.7f * 5 = 3.4999999 in double -> 3 (CropAttr::CalculateAnchor, crop_attr.cc);
    # a float32 product would be 3.5 -> 4: the negative control is a window one pixel further.
    ((27, 27), (0.7, 0.7), True, dict(crop_pos=(0.8, 0.8))),
])
def test_crop_mirror_normalize_is_the_dali_table(devices, cache, crop, crop_pos, mirror, wrong):
    rng = np.random.default_rng(7)
    images = rng.integers(0, 256, size=(16,) + IMAGE_SHAPE, dtype=np.uint8)
    labels = rng.integers(0, 10, size=16).astype(np.int32)
    norm = Normalize(mean=CIFAR_MEAN, std=CIFAR_STD, crop=crop, crop_pos=crop_pos,
                             mirror=mirror, arithmetic="dali_cpu")
    loader = dali_loader.make_dali_loader((images, labels), devices[:2], 8, normalize=norm, cache_dir=cache)
    (batch,) = list(loader.epoch(0))
    loader.close()
    got = np.asarray(batch["images"])  # rows: shard 0 = samples 0..7, shard 1 = 8..15
    if crop_pos == (0.7, 0.7):
        assert norm.window((32, 32))[:2] == (3, 3) == Normalize(**{**norm.__dict__, "arithmetic": "dali_gpu"}).window((32, 32))[:2]
    assert got.shape == (16, 3) + crop and got.dtype == np.float32
    assert_same_bits(got, norm(images), "DALI's pixels against the dali table")
    np.testing.assert_array_equal(np.asarray(batch["labels"]), labels)
    # Negative controls: the rocAL table, and the same arguments with one thing changed, do not match.
    rocal = Normalize(mean=CIFAR_MEAN, std=CIFAR_STD, crop=crop, crop_pos=crop_pos,
                              mirror=mirror, arithmetic="rocal")
    assert not np.array_equal(got, rocal(images))
    assert not np.array_equal(got, Normalize(**{**norm.__dict__, **wrong})(images))


# --------------------------------------------------------------------------
# DALI's departures from the spec, as DALI behaves
# --------------------------------------------------------------------------


def raw_pipeline(folder: str, batch_size: int, *, seed: int = 1, file_list: str = dali_loader.LIST_NAME,
                 **reader):
    """A bare CPU pipeline: DALI's file reader and nothing else (raw bytes out)."""
    Pipeline, fn, _ = dali_loader.import_dali()
    pipe = Pipeline(batch_size=batch_size, num_threads=1, device_id=None, seed=seed)
    with pipe:
        raw, _ = fn.readers.file(file_root=folder, file_list=os.path.join(folder, file_list),
                                 name="Reader", **reader)
        pipe.set_outputs(raw)
    pipe.build()
    return pipe


def raw_ids(pipe, batches: int) -> np.ndarray:
    """(batches, B): the index each sample's raw bytes encode (plane 0 + 256 * plane 1)."""
    out = []
    for _ in range(batches):
        raw = pipe.run()[0].as_array().astype(np.int64)
        out.append(raw[:, 0] + 256 * raw[:, 32 * 32])
    return np.array(out)


def test_random_shuffle_with_dali_sharding_scatters_the_shards(devices, cache):
    """DALI's documented behaviour: with random_shuffle, the file reader first permutes the
    whole file list with a fixed seed (the same on every shard), then cuts it into shards.
    So shard k is a fixed scattered subset, not [N*k//n, N*(k+1)//n), whatever the seed.
    The backend's workaround, one list per shard, keeps every shard contiguous."""
    N, n, B = 13, 4, 3
    images, labels = encoded(N)
    folder = dali_loader.sample_files(images, labels, cache)
    subsets = {}
    for seed in (1, 7):
        delivered = [raw_ids(raw_pipeline(folder, B, seed=seed, shard_id=k, num_shards=n,
                                          random_shuffle=True, stick_to_shard=True,
                                          pad_last_batch=True), 2) for k in range(n)]
        findings = conformance.describe_epoch(delivered, N, B, shuffle=True, last_batch="fill", length=2)
        assert "outside the shard" in findings.kinds, findings.report()
        subsets[seed] = [sorted(set(d.ravel().tolist())) for d in delivered]
    # Still a partition, the same for both seeds, and libstdc++'s mt19937(524287) subsets.
    assert sorted(sum(subsets[1], [])) == list(range(N))
    assert subsets[1] == subsets[7] == [[0, 2, 10], [1, 7, 11], [3, 5, 6], [4, 8, 9, 12]]

    loader = dali_loader.make_dali_loader((images, labels), devices[:n], B, shuffle=True, cache_dir=cache,
                                          order="vendor")
    report = describe(list(loader.epoch(0)), N, B, n, images, labels, shuffle=True, last_batch="fill",
                      length=len(loader))
    loader.close()
    assert not report, report


def test_a_shard_list_epoch_can_be_a_batch_short(devices, cache):
    """DALI's documented behaviour: a reader over S samples with pad_last_batch has
    ceil(S/B) batches per epoch. With one list per shard, shard k has ceil(S_k/B), one
    fewer than the plan's ceil(ceil(N/n)/B) when S_k = floor(N/n) (N=13, n=4, B=3:
    shards 0..2 have 3 samples, 1 batch; the plan has 2 steps). The backend fills the
    missing step with the shard's last delivered sample, masked False."""
    N, n, B = 13, 4, 3
    images, labels = encoded(N)
    folder = dali_loader.sample_files(images, labels, cache)
    pipes = [raw_pipeline(folder, B, file_list=os.path.basename(dali_loader.shard_list(folder, k, n)),
                          shard_id=0, num_shards=1, random_shuffle=True, stick_to_shard=True,
                          pad_last_batch=True) for k in range(n)]
    lengths = [-(-p.reader_meta("Reader")["epoch_size_padded"] // B) for p in pipes]
    assert lengths == [1, 1, 1, 2]
    delivered = [raw_ids(p, m) for p, m in zip(pipes, lengths)]
    findings = conformance.describe_epoch(delivered, N, B, shuffle=True, last_batch="fill", length=2)
    assert "batches arrived" in findings.kinds and "outside the shard" not in findings.kinds

    loader = dali_loader.make_dali_loader((images, labels), devices[:n], B, shuffle=True, cache_dir=cache,
                                          order="vendor")
    batches = [shard_blocks(b, n) for b in loader.epoch(0)]
    loader.close()
    last = encoding.decode_indices(batches[0]["images"][0], DALI)[-1]
    np.testing.assert_array_equal(encoding.decode_indices(batches[1]["images"][0], DALI), [last] * B)
    assert not batches[1]["mask"][0].any()
    np.testing.assert_array_equal(batches[1]["mask"][3], [True, False, False])


def test_without_stick_to_shard_readers_move_to_the_next_shard(cache):
    """DALI's documented behaviour: without stick_to_shard, reader k reads shard
    (k + e) mod n in epoch e (each padded with its own last sample)."""
    N, n, B = 13, 4, 3
    folder = dali_loader.sample_files(*encoded(N), cache)
    plan = epoch_plan(N, n, B)
    for k in (0, 3):
        pipe = raw_pipeline(folder, B, shard_id=k, num_shards=n, stick_to_shard=False, pad_last_batch=True)
        for epoch in range(3):
            np.testing.assert_array_equal(raw_ids(pipe, 2), plan.indices[:, (k + epoch) % n],
                                          err_msg=f"reader {k} epoch {epoch}")


def test_run_does_not_stop_at_the_epoch_end_and_reset_does_not_rewind(cache):
    """DALI's documented behaviour: Pipeline.run() never raises StopIteration at an epoch
    end (only DALI's iterators count batches, from reader_meta), and reset() does not
    rewind a reader: reading simply goes on."""
    N, n, B = 13, 4, 3
    folder = dali_loader.sample_files(*encoded(N), cache)
    pipe = raw_pipeline(folder, B, shard_id=0, num_shards=n, stick_to_shard=True, pad_last_batch=True)
    meta = pipe.reader_meta("Reader")
    assert (meta["epoch_size"], meta["epoch_size_padded"], meta["number_of_shards"]) == (13, 16, 4)
    np.testing.assert_array_equal(raw_ids(pipe, 5), [[0, 1, 2], [2, 2, 2]] * 2 + [[0, 1, 2]])  # 2 batches an epoch
    pipe.reset()
    np.testing.assert_array_equal(raw_ids(pipe, 1), [[2, 2, 2]])  # not [0, 1, 2]: no rewind


def test_the_seed_changes_dalis_shuffle(devices, cache):
    """DALI's documented behaviour: the pipeline seed drives random_shuffle's order within
    a shard (the pre-permutation before sharding is fixed), the same seed gives the same
    stream on a rebuild, and each epoch has a new order. The backend (order="vendor") builds
    a fresh pipeline per epoch with shard k's seed from SeedSequence([seed, epoch, k])."""
    N = 40
    images, labels = encoded(N)
    folder = dali_loader.sample_files(images, labels, cache)

    def order(seed):
        pipe = raw_pipeline(folder, 8, seed=seed, shard_id=0, num_shards=1, random_shuffle=True,
                            stick_to_shard=True, pad_last_batch=True, initial_fill=N)
        return raw_ids(pipe, 10).reshape(2, N)  # two epochs

    one, again, two = order(1), order(1), order(2)
    assert sorted(one[0]) == sorted(one[1]) == list(range(N))
    np.testing.assert_array_equal(one, again)
    assert one[0].tolist() != two[0].tolist() and one[0].tolist() != one[1].tolist()

    def loader_order(seed):
        loader = dali_loader.make_dali_loader((images, labels), devices[:2], 4, shuffle=True, seed=seed,
                                              cache_dir=cache, order="vendor")
        ids = [np.concatenate([encoding.decode_indices(np.asarray(b["images"]), DALI)
                               for b in loader.epoch(e)]).tolist() for e in range(2)]
        loader.close()
        return ids

    assert loader_order(0) == loader_order(0) != loader_order(1)
    assert loader_order(0)[0] != loader_order(0)[1], "the same order in epochs 0 and 1"


# --------------------------------------------------------------------------
# Wiring and refusals
# --------------------------------------------------------------------------


def test_refusals(devices, cache):
    images, labels = encoded(20)

    def make(**kwargs):
        args = dict(data=(images, labels), devices=devices[:4], batch_size=2, cache_dir=cache) | kwargs
        return lambda: dali_loader.make_dali_loader(args.pop("data"), args.pop("devices"),
                                                    args.pop("batch_size"), **args)

    assert_raises_naming(ValueError, make(normalize=Normalize()), "arithmetic='rocal'",
                         "compute arithmetic='dali_cpu'")
    # DALI's GPU kernel's bits are not its CPU pipelines': refused on CPU devices.
    assert_raises_naming(ValueError, make(normalize=Normalize(arithmetic="dali_gpu")),
                         "arithmetic='dali_gpu'", "cpu devices compute arithmetic='dali_cpu'")
    assert_raises_naming(ValueError, make(normalize=lambda x: x), "normalize=", "arithmetic='dali_cpu'")
    assert_raises_naming(ValueError, make(order="dali"), "order", "'dali'")
    assert_raises_naming(ValueError, make(batch_size=6), "batch_size=6", "smallest shard")
    assert_raises_naming(ValueError, make(num_threads=0), "num_threads", "got 0")
    assert_raises_naming(ValueError, make(layout="rows"), "'rows'")
    assert_raises_naming(ValueError, make(last_batch="partial"), "'partial'")
    assert_raises_naming(ValueError, make(data=(images.astype(np.float32), labels)), "uint8")
    loader = make()()
    assert_raises_naming(IndexError, lambda: loader.epoch(0, start_step=4), "start_step=4", "[0, 3]")
    assert_raises_naming(IndexError, lambda: loader.epoch(0, start_step=-1), "start_step=-1")
    assert_raises_naming(ValueError, lambda: loader.epoch(-1), "epoch=-1")
    assert list(loader.epoch(0, start_step=3)) == []
    assert len(loader) == 3 and "4 CPU pipeline(s) an epoch" in loader.describe()
    loader.close()
    assert_raises_naming(RuntimeError, lambda: loader.epoch(1), "closed")


@pytest.mark.parametrize("layout", loaders.LAYOUTS)
def test_mnist_shaped_data_equals_the_reference(devices, cache, layout):
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, size=(50,) + MNIST_SHAPE, dtype=np.uint8)
    labels = rng.integers(0, 10, size=50).astype(np.int32)
    norm = Normalize(mean=(0.0,), std=(255.0,), arithmetic="dali_cpu")  # the DALI notebook's
    args = dict(layout=layout, last_batch="fill", normalize=norm)
    loader = dali_loader.make_dali_loader((images, labels), devices[:4], 5, cache_dir=cache, **args)
    reference = loaders.make_loader((images, labels), devices[:4], 5, prefetch=0, **args)
    for epoch in range(2):
        steps = 0
        for step, got in enumerate(loader.epoch(epoch)):
            assert_same_arrays(got, reference.batch(epoch, step), f"epoch {epoch} step {step}")
            steps += 1
        assert steps == len(reference) == 3
    loader.close()


def test_sample_files_are_keyed_by_content_and_written_once(tmp_path):
    images, labels = encoded(12)
    folder = dali_loader.sample_files(images, labels, tmp_path)
    names = sorted(os.listdir(folder))
    assert names == [f"{i:06d}.bin" for i in range(12)] + ["list.txt"]
    assert open(os.path.join(folder, "000011.bin"), "rb").read() == images[11].tobytes()
    assert open(os.path.join(folder, "list.txt")).read().splitlines()[11] == "000011.bin 1"
    before = os.stat(os.path.join(folder, "list.txt"))
    assert dali_loader.sample_files(images.copy(), labels.astype(np.int64), tmp_path) == folder
    after = os.stat(os.path.join(folder, "list.txt"))
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "rewritten"
    changed = images.copy()
    changed[5, 2, 31, 31] ^= 1
    relabelled = labels.copy()
    relabelled[0] = 9
    others = {dali_loader.sample_files(changed, labels, tmp_path),
              dali_loader.sample_files(images, relabelled, tmp_path),
              dali_loader.sample_files(images[:, :1], labels, tmp_path)}
    assert len(others | {folder}) == 4
    assert all(name.startswith("dali-samples-") for name in os.listdir(tmp_path)), "scratch left behind"


@settings(max_examples=examples(60))
@given(st.integers(1, 10**13), st.data())
@example(10**6, None)
@example(10**6 + 1, None)
@example(10**7 + 5, None)
def test_sample_names_are_distinct_and_in_index_order_for_any_n(N, data):
    """sample_name(i, N) for i in [0, N): distinct, sorted by name exactly as by index (DALI
    and ls list a folder by name), and naming the index; at N = 10**6 + 1 too, where a
    six-digit pad would put 1000000 before 999999."""
    picks = [0, N - 1, N // 2, max(N - 2, 0), min(999_999, N - 1)]
    if data is not None:
        picks += data.draw(st.lists(st.integers(0, N - 1), max_size=6))
    picks = sorted(set(picks))
    names = [dali_loader.sample_name(i, N) for i in picks]
    assert sorted(names) == names and len(set(names)) == len(names), names
    assert [int(name[:-len(".bin")]) for name in names] == picks
    assert len({len(name) for name in names}) == 1, names


def test_vendor_shuffle_draws_from_the_whole_shard(devices, cache):
    """order="vendor", shuffle: each shard is read with initial_fill = its size. DALI's
    random_shuffle first permutes the list with its fixed seed (524287: the same order P
    for every pipeline seed; initial_fill=1 reads P itself), then draws each sample from
    a buffer of initial_fill samples of P. With the whole shard in the buffer, the first
    batch (shard of 2048, B=32) holds samples from anywhere in P. Negative control: DALI's
    default buffer (1024) draws that batch from P's first 1024 + 32 only."""
    N, B = 2048, 32
    images = encoding.encoded_images(np.arange(N), (1, 2, 2))  # [i % 256, i % 256, i // 256, i // 256]
    labels = (np.arange(N) % 10).astype(np.int32)
    identity = Normalize(mean=(0.0,), std=(1.0,), arithmetic="dali_cpu")
    loader = dali_loader.make_dali_loader((images, labels), devices[:1], B, shuffle=True, seed=1,
                                          order="vendor", normalize=identity, cache_dir=cache)
    steps = loader.epoch(0)
    first = np.asarray(next(steps)["images"]).astype(np.int64).reshape(B, 4)
    steps.close()
    shard_list = os.path.basename(dali_loader.shard_list(loader.folder, 0, 1))
    window = 1024 + B

    def read(batches, **reader):
        pipe = raw_pipeline(loader.folder, B, file_list=shard_list, shard_id=0, num_shards=1,
                            random_shuffle=True, stick_to_shard=True, pad_last_batch=True, **reader)
        raw = np.concatenate([pipe.run()[0].as_array() for _ in range(batches)]).astype(np.int64)
        return raw.reshape(-1, 4)[:, 0] + 256 * raw.reshape(-1, 4)[:, 3]

    head = set(read(window // B, initial_fill=1).tolist())  # P's first `window` samples
    far = [i for i in (first[:, 0] + 256 * first[:, 3]).tolist() if i not in head]
    assert len(far) >= B // 4, f"only {len(far)} of the first batch's samples lie beyond P's first {window}"
    assert set(read(1).tolist()) <= head, "control: DALI's default buffer is not local"


@pytest.mark.parametrize("order, shuffle", [("plan", False), ("vendor", True), ("vendor", False)])
def test_a_reader_whose_padded_shard_is_not_the_plans_is_refused(devices, cache, monkeypatch, order, shuffle):
    """Each pipeline's reader_meta is held to the plan twice: the epoch's size and the padded
    size per shard. A reader that reports the right epoch but one more batch per shard is
    refused, naming the shard, before a batch is delivered."""
    real = dali_loader.dali_pipeline

    class PaddedMore:
        def __init__(self, pipe):
            self.pipe = pipe

        def __getattr__(self, name):
            return getattr(self.pipe, name)

        def reader_meta(self, name):
            meta = dict(self.pipe.reader_meta(name))
            meta["epoch_size_padded"] += 2 * meta["number_of_shards"]
            return meta

    loader = dali_loader.make_dali_loader(encoded(20), devices[:2], 2, cache_dir=cache, order=order,
                                          shuffle=shuffle)
    assert len(list(loader.epoch(0))) == 5  # control: the real readers pass
    monkeypatch.setattr(dali_loader, "dali_pipeline", lambda *a, **k: PaddedMore(real(*a, **k)))
    with pytest.raises(RuntimeError, match=r"reader of shard 0 sees \d+ samples, \d+ per shard"):
        next(loader.epoch(0))


def test_a_shard_list_is_keyed_by_the_shard_count(tmp_path):
    """shard_list(folder, k, n) holds shard k of n's lines whatever (k, n') was asked before."""
    folder = dali_loader.sample_files(*encoded(12), tmp_path)
    lines = open(os.path.join(folder, dali_loader.LIST_NAME)).read().splitlines()
    for k, n in ((0, 2), (0, 3), (1, 3), (1, 2), (0, 1), (0, 2)):
        start, stop = shard_bounds(12, k, n)
        assert open(dali_loader.shard_list(folder, k, n)).read().splitlines() == lines[start:stop], (k, n)


def test_sample_files_refuses_labels_that_int32_would_change(tmp_path):
    """Labels are stored (and hashed) as int32: a label outside its range is refused, never
    wrapped (2**32 + 1 would become 1 and share a cache folder with label 1)."""
    images, labels = encoded(4)
    with pytest.raises(ValueError, match=r"labels outside int32.*4294967297"):
        dali_loader.sample_files(images, np.array([0, 1, 2, 2**32 + 1]), tmp_path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("channels", [1, 3])
def test_a_negative_zero_mean_gives_the_reference_tables_bits(devices, cache, channels):
    """Issue 23.4 through DALI: Normalize(mean=-0.0, std=-2.0) after the same with mean +0.0,
    MNIST-shaped and CIFAR-shaped: each loader's pixels are its own Normalize.table's bits
    (dali_cpu: x - mean is +0.0 at x = 0 for both zeros, so -0.0 after the product; the
    table says so, and DALI must too)."""
    images = np.zeros((8, channels, 6, 6), np.uint8)
    images[:, :, 0, 1], images[:, :, 0, 2] = 7, 255
    labels = np.arange(8) % 10
    for mean in (0.0, -0.0):
        norm = Normalize(mean=(mean,) * channels, std=(-2.0,) * channels, arithmetic="dali_cpu")
        loader = dali_loader.make_dali_loader((images, labels), devices[:2], 2, normalize=norm, cache_dir=cache)
        got = np.asarray(next(iter(loader.epoch(0)))["images"])
        assert_same_bits(got, norm(images[:len(got)]), f"DALI, mean {mean!r}")
        assert np.signbit(got[0, 0, 0, 0]) and np.signbit(norm.table[0, 0])


def test_sample_files_is_atomic(tmp_path, monkeypatch):
    images, labels = encoded(5)
    real_rename = os.rename

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "rename", fail)
    with pytest.raises(OSError, match="No space"):
        dali_loader.sample_files(images, labels, tmp_path)
    assert os.listdir(tmp_path) == [], "a failed write left files behind"

    def lose_the_race(src, dst):  # another process renames its complete copy first
        shutil.copytree(src, dst)
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", lose_the_race)
    folder = dali_loader.sample_files(images, labels, tmp_path)
    assert os.listdir(tmp_path) == [os.path.basename(folder)]
    assert len(os.listdir(folder)) == 6


def test_an_epochs_pipelines_go_with_its_iterator(devices, cache, monkeypatch):
    built = []
    real = dali_loader.dali_pipeline

    def recorded(*args, **kwargs):
        pipe = real(*args, **kwargs)
        built.append(weakref.ref(pipe))
        return pipe

    monkeypatch.setattr(dali_loader, "dali_pipeline", recorded)
    loader = dali_loader.make_dali_loader(encoded(20), devices[:3], 2, cache_dir=cache)
    steps = loader.epoch(0)
    assert not built, "pipelines built before the first step was asked for"
    next(steps)
    assert len(built) == 3 and all(r() is not None for r in built)
    steps.close()  # an epoch left early
    gc.collect()
    assert all(r() is None for r in built), "a pipeline outlived its epoch's iterator"
    list(loader.epoch(1))  # read to the end
    gc.collect()
    assert len(built) == 6 and all(r() is None for r in built)


def test_install_hint(devices, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali.pipeline", None)
    assert_raises_naming(ImportError, dali_loader.import_dali, "pip install -r requirements-dali.txt",
                         "nvidia-dali-cuda120", "import failed")
    assert not dali_loader.usable([fake_device("gpu", "cuda 12080")])


# --------------------------------------------------------------------------
# Device kinds: which arithmetic, which backend (fake devices: no GPU needed)
# --------------------------------------------------------------------------


def fake_device(platform: str, version: str = "<unknown>"):
    """What usable/arithmetic_for/choose_backend read of a jax.Device: its platform and
    its client's platform_version (JAX 0.10 on CUDA: platform "gpu", version "cuda 12080";
    on ROCm: platform "gpu" too, version "rocm 60300")."""
    return types.SimpleNamespace(platform=platform, client=types.SimpleNamespace(platform_version=version),
                                 process_index=0)


NVIDIA = [fake_device("gpu", "cuda 12080"), fake_device("gpu", "CUDA 13000")]
ROCM = [fake_device("gpu", "rocm 60300"), fake_device("gpu", "rocm 60300")]
CPU = [fake_device("cpu")]


def test_arithmetic_and_usable_follow_the_device_kind(devices):
    assert dali_loader.arithmetic_for(NVIDIA) == "dali_gpu"
    assert dali_loader.arithmetic_for([fake_device("cuda")]) == "dali_gpu"
    assert dali_loader.arithmetic_for(CPU) == dali_loader.arithmetic_for(jax.devices("cpu")) == "dali_cpu"
    for wrong in (ROCM, NVIDIA[:1] + CPU, [fake_device("tpu", "TFRT TPU")], []):
        with pytest.raises(ValueError, match="CPU devices or NVIDIA GPUs"):
            dali_loader.arithmetic_for(wrong)
    # nvidia.dali imports here (no CUDA): only an NVIDIA device makes it usable for --backend auto.
    assert dali_loader.usable(NVIDIA)
    assert not dali_loader.usable(ROCM) and not dali_loader.usable(CPU) and not dali_loader.usable([])
    assert not dali_loader.usable(NVIDIA + ROCM)
    if devices[0].platform == "cpu":
        assert not dali_loader.usable(devices[:2])
    with pytest.raises(ValueError, match=r"gpu \(rocm 60300\)"):
        dali_loader.make_dali_loader(encoded(20), ROCM, 2)


def test_auto_backend_never_picks_dali_on_rocm_nor_rocal_on_cuda(monkeypatch):
    """refimpl.choose_backend with fake device lists; rocAL's and DALI's imports are made
    to succeed (or fail) here, so only the device kind decides."""
    import refimpl
    import rocal_loader

    def rocal_imports(ok: bool):
        def fake():
            if not ok:
                raise ImportError("no amd.rocal")
        monkeypatch.setattr(rocal_loader, "import_rocal", fake)

    rocal_imports(True)
    assert refimpl.choose_backend("auto", "cifar10", ROCM) == "rocal"
    assert refimpl.choose_backend("auto", "cifar10", NVIDIA) == "dali"  # rocAL importable, still not rocal
    assert refimpl.choose_backend("auto", "mnist", NVIDIA) == "dali"
    assert refimpl.choose_backend("auto", "mnist", ROCM) == "reference"  # rocAL reads CIFAR-10 only
    assert refimpl.choose_backend("auto", "cifar10", CPU) == "reference"
    rocal_imports(False)
    assert refimpl.choose_backend("auto", "cifar10", ROCM) == "reference"  # DALI importable, still not dali
    assert refimpl.choose_backend("dali", "cifar10", ROCM) == "dali"  # asked for: no choice made
    monkeypatch.setitem(sys.modules, "nvidia.dali.pipeline", None)
    assert refimpl.choose_backend("auto", "cifar10", NVIDIA) == "reference"


class Stop(Exception):
    """Raised by a stand-in to end make_dali_loader once it has shown what it would build."""


def test_the_default_arithmetic_follows_the_devices(monkeypatch):
    """make_dali_loader without normalize: Normalize(arithmetic=arithmetic_for(devices)),
    dali_gpu on an NVIDIA GPU mesh (fake devices: the spec loader it would build is caught
    before any device work), dali_cpu on CPU; an explicit dali_gpu is accepted there and
    dali_cpu refused (negative control)."""
    seen = []

    def spec_loader(data, mesh, batch_size, **kwargs):
        seen.append(kwargs["normalize"])
        raise Stop

    monkeypatch.setattr(loaders, "data_mesh", lambda devices: types.SimpleNamespace(devices=np.array(devices)))
    monkeypatch.setattr(loaders, "make_loader", spec_loader)
    for normalize in (None, Normalize(arithmetic="dali_gpu")):
        with pytest.raises(Stop):
            dali_loader.make_dali_loader(encoded(8), NVIDIA, 2, normalize=normalize)
    with pytest.raises(Stop):
        dali_loader.make_dali_loader(encoded(8), CPU, 2)
    assert seen == [Normalize(arithmetic="dali_gpu")] * 2 + [Normalize(arithmetic="dali_cpu")]
    with pytest.raises(ValueError, match="compute arithmetic='dali_gpu'"):
        dali_loader.make_dali_loader(encoded(8), NVIDIA, 2, normalize=DALI)


def test_refimpl_takes_dali_gpu_on_nvidia_gpus():
    """refimpl's choice for --backend dali: dali_gpu on an NVIDIA GPU mesh, dali_cpu on CPU,
    an explicit --normalize kept; parse_args accepts --normalize dali_gpu with --backend dali
    and refuses rocal (negative control)."""
    import refimpl
    assert refimpl.choose_arithmetic("dali", None, "cifar10", NVIDIA) == "dali_gpu"
    assert refimpl.choose_arithmetic("dali", None, "mnist", NVIDIA) == "dali_gpu"
    assert refimpl.choose_arithmetic("dali", None, "cifar10", CPU) == "dali_cpu"
    assert refimpl.choose_arithmetic("dali", "dali_gpu", "cifar10", NVIDIA) == "dali_gpu"
    assert refimpl.choose_arithmetic("reference", None, "cifar10", NVIDIA) == "rocal"  # the notebook's
    assert refimpl.choose_arithmetic("rocal", None, "cifar10", ROCM) == "rocal"
    assert refimpl.parse_args(["--backend", "dali", "--normalize", "dali_gpu"]).normalize == "dali_gpu"
    with pytest.raises(SystemExit):
        refimpl.parse_args(["--backend", "dali", "--normalize", "rocal"])


def fma_float32(x: int, scale: np.float32, shift: np.float32) -> np.float32:
    """x*scale + shift exact, rounded once to float32 (ties to even), by integer arithmetic:
    independent of loaders' own rounding code."""
    exact = Fraction(x) * Fraction(float(scale)) + Fraction(float(shift))
    if exact == 0:
        return np.float32(0)
    sign, exact = (-1 if exact < 0 else 1), abs(exact)
    e = exact.numerator.bit_length() - exact.denominator.bit_length() - 24
    while exact / Fraction(2) ** e >= 2**24:
        e += 1
    while exact / Fraction(2) ** e < 2**23:
        e -= 1
    mantissa = round(exact / Fraction(2) ** e)  # round() on a Fraction: half to even
    return np.float32(sign * mantissa * Fraction(2) ** e)


@settings(max_examples=examples(15))
@given(st.lists(st.tuples(st.floats(0, 255, width=32), st.floats(0.5, 300, width=32)), min_size=1,
                max_size=3))
@example([(127.5, 127.5)] * 3)
@example([(0.0, 255.0)])
def test_dali_gpu_table_is_the_gpu_kernels_fma(mean_std):
    """READ, not run (no GPU here), in NVIDIA/DALI (read at the commits the source index
    holds; the notes' disassembly of the shipped 2.4.0 libdali_kernels.so for sm_90 agrees):

    * dali/operators/image/crop/new_crop_mirror_normalize.cu, GetImplementationKind: uint8
      CHW input takes SliceFlipNormalizeGpuGeneric (the HWC fast path needs HWC input);
      GetNormParameters: inv_stddev = scale / std in double (scale = 1), stored as float;
      mean stored as float (shift = 0).
    * dali/kernels/slice/slice_flip_normalize_gpu.cu, SliceFlipNormalizeGPU::SetupParams:
      norm_add = -mean * inv_stddev, norm_mul = inv_stddev, both float.
    * dali/kernels/slice/slice_flip_normalize_gpu_impl.cuh, SliceNormalizeKernel_2D(_NoPad):
      fmaf(float(x), norm_mul[c], norm_add[c]): one rounding, for every channel count.

    So table[c, x] = fma(x, inv, -(mean*inv)) with inv = f32(1/std) (a double quotient of
    floats rounded to float is the float quotient) and the product rounded to float."""
    mean, std = zip(*mean_std)
    table = normalize_table(mean, std, "dali_gpu")
    for c, (m, s) in enumerate(mean_std):
        inv = np.float32(1.0 / float(np.float32(s)))
        add = np.float32(-(np.float32(m) * inv))
        want = [fma_float32(x, inv, add) for x in range(256)]
        assert_same_bits(table[c], np.array(want, np.float32), f"channel {c}: mean {m}, std {s}")


def test_dali_gpu_and_dali_cpu_tables_differ_where_the_roundings_do():
    """The CPU kernel (slice_flip_normalize_permute_pad_cpu.h) rounds (x - mean) and then
    the product: two roundings. At the rocAL notebook's mean = std = 127.5 that differs
    from the GPU kernel's one rounding on 762 of the 768 entries; at the DALI notebook's
    MNIST (0, 255) on none (x - 0 is exact)."""
    gpu = normalize_table((127.5,) * 3, (127.5,) * 3, "dali_gpu")
    cpu = normalize_table((127.5,) * 3, (127.5,) * 3, "dali_cpu")
    assert (gpu != cpu).sum() == 762
    np.testing.assert_array_equal(np.flatnonzero(gpu[0] == cpu[0]), [0, 32])
    x = np.arange(256, dtype=np.float32)  # the CPU table, independently: two float32 roundings
    assert_same_bits(cpu[0], (x - np.float32(127.5)) * (np.float32(1) / np.float32(127.5)), "dali_cpu")
    mnist = [normalize_table((0.0,), (255.0,), a) for a in ("dali_gpu", "dali_cpu")]
    assert_same_bits(mnist[0], mnist[1], "MNIST's table, GPU vs CPU")
    # The GPU operator's crop window comes from CropAttr::CalculateAnchor (crop_attr.cc),
    # shared with the CPU operator: std::round(double(pos) * (W - cw)), as dali_cpu.
    for pos, size, crop in [(0.5, 32, 29), (0.5, 32, 27), (0.25, 32, 30), (1 / 6, 32, 28), (0.7, 32, 27)]:
        assert crop_anchor(pos, size, crop, "dali_gpu") == crop_anchor(pos, size, crop, "dali_cpu")
    assert crop_anchor(0.5, 32, 27, "dali_gpu") == 3 != crop_anchor(0.5, 32, 27, "rocal")


# --------------------------------------------------------------------------
# The conversion GPU pipelines use, driven by CPU pipelines
# --------------------------------------------------------------------------


def float_pipeline(folder: str, *, exec_dynamic: bool):
    """Raw bytes as float32, 12 files in batches of 3 (4 batches an epoch)."""
    Pipeline, fn, types_ = dali_loader.import_dali()
    pipe = Pipeline(batch_size=3, num_threads=1, device_id=None, seed=1, exec_dynamic=exec_dynamic)
    with pipe:
        raw, _ = fn.readers.file(file_root=folder, file_list=os.path.join(folder, dali_loader.LIST_NAME),
                                 name="Reader")
        pipe.set_outputs(fn.cast(raw, dtype=types_.FLOAT))
    pipe.build()
    return pipe


def test_to_jax_copies_only_where_dali_reuses_its_buffers(cache):
    """dali_loader.to_jax is what GPU pipelines' outputs go through; DALI's TensorCPU has
    __dlpack__/__dlpack_device__ too, so CPU pipelines drive it here. What decides the copy
    is Pipeline.exec_dynamic (DALI's own JAX plugin: _to_jax_array(..., copy=not
    exec_dynamic) in plugin/jax/iterator.py): with the dynamic executor, DALI 2.x's default,
    every output is a new buffer that DALI does not write again, so the array wraps it;
    without it DALI recycles its output buffers, so to_jax copies."""
    folder = dali_loader.sample_files(*encoded(12), cache)
    cpu0 = jax.devices("cpu")[0]
    first = np.arange(12).reshape(4, 3)  # each sample's first raw byte is its index

    def outputs(exec_dynamic: bool, buffers_reused: bool):
        pipe = float_pipeline(folder, exec_dynamic=exec_dynamic)
        assert pipe.exec_dynamic == exec_dynamic
        out, wrapped = [], []
        for _ in range(4):
            (images,) = pipe.run()
            array = dali_loader.to_jax(images, cpu0, buffers_reused=buffers_reused)
            wrapped.append(array.unsafe_buffer_pointer() == images.as_tensor().data_ptr())
            out.append(array)
        del pipe
        gc.collect()  # the arrays must outlive their pipeline
        return [np.asarray(a)[:, 0].tolist() for a in out], wrapped

    values, wrapped = outputs(exec_dynamic=True, buffers_reused=False)
    assert values == first.tolist() and all(wrapped), "dynamic executor: wrapped, no copy, values kept"
    values, wrapped = outputs(exec_dynamic=False, buffers_reused=True)
    assert values == first.tolist() and not any(wrapped), "recycling executor: copied, values kept"
    # Negative control: wrapping a recycled buffer (no copy) loses the values.
    values, wrapped = outputs(exec_dynamic=False, buffers_reused=False)
    assert all(wrapped) and values != first.tolist(), values


def test_a_copy_from_a_recycled_buffer_is_complete_when_to_jax_returns():
    """buffers_reused=True: DALI may write the buffer at its very next run, so the copy must
    be finished when to_jax returns, not merely enqueued. The device is kept busy (a
    matmul chain already dispatched), so an enqueued copy waits behind it; a 1 MB buffer
    that DLPack hands over is overwritten at once after the call, as DALI's recycling
    executor would: to_jax's array is ready at return and keeps the old values. Negative
    control: the same copy without the wait (jnp.array alone) is still pending at return."""
    cpu0 = jax.devices("cpu")[0]
    want = np.arange(1 << 18, dtype=np.float32)
    a = jax.device_put(jax.numpy.full((300, 300), 1 / 300, np.float32), cpu0)
    # 60 products (about 80 ms on a quiet core): with 6 (9 ms) the unwaited control copy was
    # sometimes done at return on a loaded machine (1 run in 3 or so); with 60, none in 60.
    busy = jax.jit(lambda a: jax.lax.fori_loop(0, 60, lambda i, x: x @ a, a))
    busy(a).block_until_ready()  # compiled before timing matters

    def copied(convert):
        buffer = want.copy()  # DALI's output buffer; numpy arrays speak DLPack as DALI's tensors do
        running = busy(a)
        got = convert(buffer)
        ready = got.is_ready()
        buffer[:] = -1  # DALI's next run
        running.block_until_ready()
        return ready, got

    unwaited = lambda b: jax.numpy.array(jax.dlpack.from_dlpack(b, device=cpu0, copy=None), copy=True)
    copied(unwaited)  # the copy's compilation, out of the way
    ready, got = copied(lambda b: dali_loader.to_jax(types.SimpleNamespace(as_tensor=lambda: b), cpu0,
                                                      buffers_reused=True))
    assert ready, "to_jax returned before its copy was done"
    assert_same_bits(got, want, "to_jax's copy after DALI rewrote its buffer")
    assert not copied(unwaited)[0], "control: a copy that is not waited for was done at return"


def test_jax_from_dlpack_copy_true_still_wraps_a_cpu_buffer():
    """JAX 0.10.2, CPU: from_dlpack(x, copy=True) returns an array on x's own memory
    (its docstring promises a copy). Why to_jax copies with jnp.array instead. If this
    fails, JAX copies now, and to_jax could pass copy=True."""
    x = aligned_empty((256,), np.float32)
    x[:] = 0
    wrapped = jax.dlpack.from_dlpack(x, device=jax.devices("cpu")[0], copy=True)
    x[:] = 7
    assert wrapped.unsafe_buffer_pointer() == x.ctypes.data and float(wrapped[0]) == 7


def test_the_loaders_pipelines_use_the_dynamic_executor(devices, cache, monkeypatch):
    """DALI 2.x's default executor (exec_dynamic when exec_async and exec_pipelined, as the
    backend leaves them): so the backend's to_jax wraps, never copies, on the pipeline's
    own device (CPU 0 here, a GPU's own CUDA device there)."""
    Pipeline, _, _ = dali_loader.import_dali()
    assert Pipeline(batch_size=1, num_threads=1, device_id=None).exec_dynamic is True
    seen = []
    real = dali_loader.to_jax
    monkeypatch.setattr(dali_loader, "to_jax", lambda t, d, buffers_reused: seen.append(buffers_reused)
                        or real(t, d, buffers_reused=buffers_reused))
    loader = dali_loader.make_dali_loader(encoded(20), devices[:2], 2, cache_dir=cache)
    assert len(list(loader.epoch(0))) == 5 and seen == [False] * 10


# --------------------------------------------------------------------------
# Resuming a saved epoch (plan.LoaderState) on other shards: issue 25.2
# --------------------------------------------------------------------------

# (n0, B0, stop, n1, B1): epoch 1 of 48 samples saved after `stop` steps on n0 shards of B0,
# resumed on n1 shards of B1: fewer shards with a larger batch, and more with a smaller one.
# 48: every cell's resumed epoch has 2 steps or more, and the chain back a step or more.
RESIZES = [(8, 2, 1, 3, 4), (4, 3, 2, 6, 2)]
RESUMED_IN_CI = {(8, 2, 1, 3, 4, "fill", True, "sharded"), (4, 3, 2, 6, 2, "drop", False, "pmap")}
RESUMED_CELLS = [pytest.param(*cell, marks=() if cell in RESUMED_IN_CI else pytest.mark.slow)
                 for cell in [(*r, p, s, l) for r in RESIZES for p in LAST_BATCH_POLICIES
                              for s in (True, False) for l in loaders.LAYOUTS]]


def cpu_devices(count: int) -> list:
    devices = jax.devices("cpu")
    if len(devices) < count:
        pytest.skip(f"needs {count} CPU devices, JAX has {len(devices)}")
    return devices[:count]


def saved_state(N: int, n0: int, B0: int, stop: int, **run) -> LoaderState:
    """What a loader of N samples on n0 shards of B0 saves after ``stop`` steps of epoch 1
    (loaders.Loader.state's value)."""
    return LoaderState.start(N, n0, B0, epoch=1, **run).at_step(stop)


def resumed_pair(N: int, n1: int, B1: int, cache: str, order: str = "plan", **args):
    """(DALI's loader, the reference loader) over N samples on the first n1 CPU devices, built alike."""
    data = encoded(N)
    loader = dali_loader.make_dali_loader(data, cpu_devices(n1), B1, cache_dir=cache, normalize=DALI,
                                          order=order, **args)
    reference = loaders.make_loader(data, cpu_devices(n1), B1, prefetch=0, placement="host_float32",
                                    normalize=DALI, **args)
    return loader, reference


def check_resumed(loader, reference, saved: LoaderState, where: str) -> list:
    """DALI's ``epoch(1, state=saved)`` is the reference's, bit for bit, with the same count,
    real slots and state after it; returns DALI's batches."""
    got, want = list(loader.epoch(1, state=saved)), list(reference.epoch(1, state=saved))
    resized = saved.resized(reference.num_shards, reference.batch_size)
    assert len(got) == len(want) == resized.num_steps - saved.step, where
    for step, (g, w) in enumerate(zip(got, want), start=saved.step):
        assert_same_arrays(g, w, f"{where}: resumed step {step}")
    assert loader.real_samples(1, state=saved) == reference.real_samples(1, state=saved), where
    end = saved.step + len(got)
    assert loader.state(1, end, state=saved) == reference.state(1, end, state=saved), where
    return got


@pytest.mark.parametrize("n0, B0, stop, n1, B1, last_batch, shuffle, layout", RESUMED_CELLS)
def test_plan_order_resumes_on_other_shards_as_the_reference(cache, n0, B0, stop, n1, B1, last_batch, shuffle,
                                                            layout):
    """order="plan": a state saved on n0 shards of B0 resumes on n1 of B1 with the reference
    loader's batches (plan.elastic_plan's last segment), and the state after one more
    step resumes again, back on n0 x B0 (a chain of two changes)."""
    run = dict(seed=5, shuffle=shuffle, last_batch=last_batch)
    saved = saved_state(48, n0, B0, stop, **run)
    loader, reference = resumed_pair(48, n1, B1, cache, layout=layout, **run)
    where = f"{n0}x{B0} -> {n1}x{B1} at step {stop}, {last_batch}, shuffle={shuffle}, {layout}"
    got = check_resumed(loader, reference, saved, where)
    assert len(saved.resized(n1, B1).segments) == 2 and len(got) >= 2, "the cell resumes a resized epoch"
    again = loader.state(1, stop + 1, state=saved)
    back, back_reference = resumed_pair(48, n0, B0, cache, layout=layout, **run)
    assert check_resumed(back, back_reference, again, where + f", then back to {n0}x{B0} at step {stop + 1}")


@pytest.mark.parametrize("n0, B0, stop, n1, B1, last_batch, edge", [
    (3, 2, 2, 8, 4, "fill", "a batch larger than every run"),  # 25 left: runs of 3 and 4, B=4
    (2, 4, 4, 7, 1, "fill", "shards with an empty run"),  # 5 left on 7 shards: two hold padding alone
    (4, 3, 2, 6, 3, "drop", "0 steps"),  # 13 left on 6 shards of 3: drop runs none
])
def test_plan_order_resumes_what_only_a_resized_segment_holds(cache, n0, B0, stop, n1, B1, last_batch, edge):
    """Segments a fresh epoch never has (make_loader refuses a batch larger than a shard, and
    every fresh shard holds samples): DALI is fed them all the same, as the reference."""
    run = dict(seed=8, shuffle=True, last_batch=last_batch)
    saved = saved_state(37, n0, B0, stop, **run)
    plan, row = saved.resized(n1, B1).plan()
    real = plan.mask[row:].sum(axis=(0, 2))  # per shard
    assert {"a batch larger than every run": len(plan.indices) - row == 1 and real.max() <= B1
            and real.min() < B1, "shards with an empty run": 0 < (real == 0).sum() < n1,
            "0 steps": len(plan.indices) == row}[edge], f"the case is not {edge!r}: {real}"
    loader, reference = resumed_pair(37, n1, B1, cache, layout="pmap", **run)
    check_resumed(loader, reference, saved, edge)


def test_a_resume_that_reads_the_fresh_plan_from_the_step_is_caught(cache):
    """Negative control of check_resumed: the fresh plan of the new shards read from the
    saved step (what epoch(e, start_step) gives) is not the resumed epoch."""
    run = dict(seed=5, shuffle=True, last_batch="fill")
    saved = saved_state(48, 8, 2, 1, **run)
    loader, reference = resumed_pair(48, 3, 4, cache, **run)
    fresh_from_step = list(loader.epoch(1, start_step=saved.step))
    resumed = list(reference.epoch(1, state=saved))
    assert len(fresh_from_step) != len(resumed) or any(
        bits_differ(a["images"], b["images"]) for a, b in zip(fresh_from_step, resumed))


def test_resume_refusals_name_the_field(cache):
    run = dict(seed=5, shuffle=True, last_batch="fill")
    saved = saved_state(48, 8, 2, 1, **run)
    loader, _ = resumed_pair(48, 3, 4, cache, **run)
    assert_raises_naming(ValueError, lambda: loader.epoch(1, state=dataclasses.replace(saved, seed=6)),
                         "DaliLoader.epoch", "seed=6", "this run has seed=5")
    assert_raises_naming(ValueError, lambda: loader.epoch(2, state=saved), "epoch=2", "state is of epoch 1")
    assert_raises_naming(ValueError, lambda: loader.epoch(1, 1, state=saved), "start_step=1 with a state")
    assert_raises_naming(ValueError, lambda: loader.epoch(1, state=saved.to_json()), "must be a plan.LoaderState")
    assert_raises_naming(ValueError, lambda: loader.real_samples(1, state=dataclasses.replace(saved, shuffle=False)),
                         "DaliLoader.real_samples", "shuffle")
    assert_raises_naming(ValueError, lambda: loader.state(1, 0, state=saved),
                         "DaliLoader.state: step=0 is before the state's step 1")
    assert_raises_naming(ValueError, lambda: loader.state(1, 99, state=saved), "DaliLoader.state: step=99")


def test_vendor_order_resumes_only_on_the_saved_shards(cache):
    """order="vendor": DALI's own order continues only on the shards and batch that saved the
    state (there ``epoch(e, state=s)`` is ``epoch(e, start_step=s.step)``); a state of other
    shards, another batch, or an epoch already resized, is refused with the reason."""
    run = dict(seed=5, shuffle=True, last_batch="fill")
    loader, _ = resumed_pair(48, 4, 3, cache, order="vendor", **run)
    same = saved_state(48, 4, 3, 2, **run)
    for got, want in zip(list(loader.epoch(1, state=same)), list(loader.epoch(1, start_step=2)), strict=True):
        assert_same_arrays(got, want, "vendor order, resumed on the saved shards")
    assert loader.state(1, 3, state=same) == dataclasses.replace(same.at_step(3), dataset=loader.dataset)
    assert loader.real_samples(1, state=same) == int(loader.plan(1).mask[2:].sum())
    # Another shard count; another batch; these shards and batch, after a resize in the epoch.
    for other in (saved_state(48, 8, 2, 1, **run), saved_state(48, 4, 2, 1, **run),
                  same.resized(3, 4).at_step(3).resized(4, 3)):
        for call in (lambda: loader.epoch(1, state=other), lambda: loader.state(1, other.step, state=other),
                     lambda: loader.real_samples(1, state=other)):
            assert_raises_naming(ValueError, call, "order='vendor' resumes only on the shards and batch",
                                 "DALI's checkpoints restore one reader state per pipeline", "order='plan'")


def test_dalis_own_checkpoints_restore_only_onto_as_many_pipelines():
    """Why order="vendor" cannot resize (DALI 2.4, nvidia/dali/plugin/jax/iterator.py,
    data_iterator's create_iterator): DALI's JAX iterator takes one checkpoint per device
    and refuses another count before it builds anything."""
    from nvidia.dali.plugin.jax import data_iterator
    from nvidia.dali import fn

    def pipeline():
        return fn.readers.file(file_root="/nonexistent", name=dali_loader.READER)

    make = data_iterator(pipeline, output_map=["x", "y"], reader_name=dali_loader.READER,
                         devices=cpu_devices(3))
    with pytest.raises(RuntimeError, match=r"number of checkpoints provided \(4\) should match the number "
                                           r"of devices to use \(3\)"):
        make(batch_size=6, checkpoints=["saved on 4 devices"] * 4)


# --------------------------------------------------------------------------
# Several processes, and the main job end to end
# --------------------------------------------------------------------------


def worker(out_dir: str, coordinator: str, process_id: int) -> None:
    """One of two jax.distributed processes, 4 CPU devices each: order="plan" loaders on a
    contiguous and on an interleaved mesh, every local shard against the reference: fresh
    epochs, one resumed at a step, and one resumed from a state saved on 3 shards of 5."""
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=process_id,
                               initialization_timeout=60, heartbeat_timeout_seconds=30,
                               coordinator_bind_address=coordinator)
    every = jax.devices()
    mine = [[d for d in every if d.process_index == p] for p in range(2)]
    meshes = {"contiguous": every, "interleaved": [d for pair in zip(*mine) for d in pair]}
    N, B = 101, 3
    images, labels = encoded(N)
    compared = 0
    for (name, devices), (last_batch, layout) in zip(meshes.items(), [("fill", "sharded"), ("drop", "pmap")]):
        args = dict(layout=layout, shuffle=True, seed=9, last_batch=last_batch, normalize=DALI)
        loader = dali_loader.make_dali_loader((images, labels), devices, B, cache_dir=out_dir, **args)
        reference = loaders.make_loader((images, labels), devices, B, prefetch=0, placement="host_float32",
                                        **args)
        saved = LoaderState.start(N, 3, 5, epoch=0, seed=9, shuffle=True, last_batch=last_batch).at_step(2)
        resumed = zip(loader.epoch(0, state=saved), reference.epoch(0, state=saved), strict=True)
        for epoch, start_step, pairs in ((1, 0, None), (0, 2, None), (0, saved.step, resumed)):
            if pairs is None:
                pairs = ((got, reference.batch(epoch, step)) for step, got in
                         enumerate(loader.epoch(epoch, start_step), start=start_step))
            for step, (got, want) in enumerate(pairs, start=start_step):
                for field in want:
                    assert got[field].sharding == want[field].sharding, (name, field)
                    mine_got = {s.device: np.asarray(s.data) for s in got[field].addressable_shards}
                    for s in want[field].addressable_shards:
                        # Bit for bit, without conftest (this runs in a child process).
                        a, b = mine_got[s.device], np.asarray(s.data)
                        assert a.dtype == b.dtype and a.shape == b.shape and \
                            np.array_equal(a.view(np.uint8), b.view(np.uint8)), \
                            f"{name} epoch {epoch} step {step} {field} on {s.device}"
                        compared += 1
    with open(os.path.join(out_dir, f"done-{process_id}.json"), "w") as f:
        json.dump({"compared": compared}, f)
    jax.distributed.shutdown()


@pytest.mark.multiprocess
def test_two_processes_read_the_plan_bit_for_bit(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{probe.getsockname()[1]}"
    here = os.path.dirname(os.path.abspath(__file__))
    results = run_children([[sys.executable, os.path.abspath(__file__), str(tmp_path), coordinator, str(i)]
                            for i in range(2)], timeout=120, cwd=here, grace=10)
    for i, (code, out, err) in enumerate(results):
        assert code == 0, f"process {i} exited {code}:\n{err[-3000:]}"
    # N=101 over 8 shards, B=3: fill 5 steps, drop 4; epoch 1 whole, epoch 0 from step 2, and
    # epoch 0 from a state saved on 3 shards of 5 after 2 steps (71 samples left: fill 3
    # steps, drop 2); 3 fields on 4 local devices.
    resumed = {p: LoaderState.start(101, 3, 5, shuffle=True, last_batch=p).at_step(2).resized(8, 3)
               for p in ("fill", "drop")}
    assert [st.num_steps - st.step for st in resumed.values()] == [3, 2]
    for i in range(2):
        assert json.loads((tmp_path / f"done-{i}.json").read_text())["compared"] == 12 * (5 + 3 + 3 + 4 + 2 + 2)


def refimpl_resized(tmp_path, common: list, backends: tuple, stop: list, resume: list, *, timeout=240) -> dict:
    """refimpl.py for each backend at once, twice: ``stop`` options with --checkpoint-dir, then
    ``resume`` options resuming that checkpoint with --params-out <backend>.npz; returns
    {backend: the resumed run's stdout}, after checking every exit status."""
    here = os.path.dirname(os.path.abspath(__file__))
    outputs = {}
    for phase, options in (("stop", stop), ("resume", resume)):
        commands = []
        for backend in backends:
            where = str(tmp_path / f"ck-{backend}")
            more = (["--checkpoint-dir", where] if phase == "stop" else
                    ["--resume-from", where, "--params-out", str(tmp_path / f"{backend}.npz")])
            # The reference on the host (the same bits in every placement, test_loaders.py):
            # no device-side normalisation to compile in each child.
            placement = ["--placement", "host_float32"] if backend == "reference" else []
            commands.append([sys.executable, os.path.join(here, "refimpl.py"), "--backend", backend, *placement,
                             *common, *options, *more])
        for backend, command, (code, out, err) in zip(backends, commands,
                                                      run_children(commands, timeout=timeout, cwd=here)):
            assert code == 0, f"{' '.join(command[1:])} exited {code}:\n{out[-2000:]}\n{err[-3000:]}"
            assert "OUTSIDE" not in out and "FAILED" not in out, out
            outputs[backend] = out
    return outputs


def exactly_once(out: str) -> list[str]:
    return [line for line in out.splitlines() if "counted from the delivered rows" in line]


def assert_same_params(tmp_path, backends: tuple, leaves: int) -> None:
    got, want = (np.load(tmp_path / f"{b}.npz") for b in backends)
    assert sorted(got.files) == sorted(want.files) and len(want.files) == leaves, (got.files, want.files)
    for name in want.files:
        assert_same_bits(got[name], want[name], f"{name}: --backend {backends[0]}'s params against "
                                                f"--backend {backends[1]}'s after the same resize")


def test_refimpl_dali_and_reference_resize_to_identical_params(tmp_path):
    """The consequence, through refimpl.py: 4 devices stop after 2 run steps, 3 devices resume
    (plan.elastic_plan's order); DALI (shuffled, the main job's default) and the reference,
    with the same seed and --normalize, each report every sample of the interrupted epoch
    delivered exactly once across the change, and end with the very same params. The
    issue's two resizes, through DALI, run with --run-slow."""
    data = synthetic_cifar10(tmp_path / "data", num_train=96, num_test=16, seed=2)
    # The notebook's MLP with narrow hidden layers (the same code, a fraction of the compute).
    common = ["--data-dir", data, "--cache-dir", str(tmp_path), "--epochs", "1", "--batch-size", "4",
              "--eval-batch-size", "16", "--strategies", "sharded", "--normalize", "dali_cpu", "--seed", "5",
              "--hidden", "64,64"]
    backends = ("dali", "reference")
    outputs = refimpl_resized(tmp_path, common, backends, ["--devices", "4", "--stop-after-step", "2"],
                              ["--devices", "3"])
    dali = outputs["dali"]
    assert "NVIDIA DALI" in dali and "3 CPU pipeline(s)" in dali and "dali_cpu's arithmetic" in dali, dali
    assert "segments [(0, 4, 4), (2, 3, 4)]" in dali, dali
    for backend, out in outputs.items():
        [line] = exactly_once(out)
        assert line.startswith("sharded epoch 0: every one of the 96 samples delivered in exactly one real "
                               "slot, counted from the delivered rows"), line
        how = "dali" if backend == "dali" else "reference loader, placement host_float32"
        assert f"steps 0-1 on 4 cpu device(s) x 4 ({how}): 32; steps 2-7 on 3 cpu device(s) x 4" in line, line
    assert_same_params(tmp_path, backends, 7)  # 6 params, 1 SGD state
    # The params did train (a loader that delivered nothing would also agree).
    assert not np.array_equal(np.load(tmp_path / "dali.npz")["sharded/0"], model_init_leaf0((3072, 64, 64, 10)))


# Issue 25's two resizes: (name, stop options, resume options, the stopped run, the resumed run).
ISSUE_RESIZES = [
    ("2x4 -> 8", ["--local-processes", "2"], ["--devices", "8"], "8 cpu device(s) in 2 processes x 16",
     "8 cpu device(s) x 16"),
    ("8 -> 3", ["--devices", "8"], ["--devices", "3"], "8 cpu device(s) x 16", "3 cpu device(s) x 16")]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name, stop, resume, before, after",
                         [pytest.param(*r, id=r[0].replace(" ", "")) for r in ISSUE_RESIZES])
def test_refimpl_the_issues_resizes_through_dali(tmp_path, name, stop, resume, before, after):
    """Issue 25's two resizes with --backend dali and --backend reference (same seed, --normalize
    dali_cpu, default synthetic CIFAR-10 of 2048, batch 16, 2 epochs): 2 processes of 4 devices
    stop at run step 7 and 1 process of 8 resumes; 8 devices stop at step 7 and 3 resume. Each
    reports exactly once across the change per strategy; the params are the reference's bit for
    bit. 45-65 s each on a busy machine (one resize a test: both in one outlasted the watchdog there)."""
    common = ["--cache-dir", str(tmp_path / "cache"), "--epochs", "2", "--strategies", "sharded,shard_map",
              "--normalize", "dali_cpu"]
    backends = ("dali", "reference")
    outputs = refimpl_resized(tmp_path, common, backends, stop + ["--stop-after-step", "7"], resume, timeout=600)
    for backend, out in outputs.items():
        lines = exactly_once(out)
        assert len(lines) == 2, out
        for line in lines:
            print(f"{name}, --backend {backend}: {line}")
            assert "every one of the 2048 samples delivered in exactly one real slot" in line, line
            assert f"steps 0-6 on {before}" in line and ": 896; steps 7-" in line and after in line, line
        for line in out.splitlines():
            if line.startswith("final params"):
                print(f"{name}, --backend {backend}: {line}")
    assert_same_params(tmp_path, backends, 14)  # 2 x (6 params, 1 SGD state)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_refimpl_two_processes_dali_and_reference_identical_params(tmp_path):
    """The issue's case: --local-processes 2 --epochs 2, where DALI's stateful epochs used
    to train the second strategy on other epochs (733 ulps apart). About 15 s."""
    here = os.path.dirname(os.path.abspath(__file__))
    data = synthetic_cifar10(tmp_path / "data", num_train=512, num_test=64, seed=2)
    for backend in ("dali", "reference"):  # one after the other: 2 processes each
        [(code, out, err)] = run_children([[
            sys.executable, os.path.join(here, "refimpl.py"), "--backend", backend, "--normalize", "dali_cpu",
            "--local-processes", "2", "--epochs", "2", "--data-dir", data, "--cache-dir", str(tmp_path),
            "--params-out", str(tmp_path / f"{backend}.npz")]], timeout=300, cwd=here)
        assert code == 0, f"{backend}:\n{err[-3000:]}"
        assert "OUTSIDE" not in out, out
    dali, reference = (np.load(tmp_path / f"{b}.npz") for b in ("dali", "reference"))
    assert sorted(dali.files) == sorted(reference.files) and len(dali.files) == 14  # sharded, shard_map: 6 params, 1 SGD state
    for name in dali.files:
        assert_same_bits(dali[name], reference[name], f"{name}: DALI's params against the reference's")


def test_params_out_is_checked_before_any_work(tmp_path, capsys):
    import refimpl

    for path, why in ((tmp_path / "missing" / "p.npz", "does not exist"), (tmp_path, "is a directory")):
        with pytest.raises(SystemExit) as info:
            refimpl.parse_args(["--params-out", str(path)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and f"--params-out {path}: " in err and why in err, err


def model_init_leaf0(layers=None):
    import model
    return np.asarray(jax.tree.leaves(model.init_model(layers or model.LAYERS))[0])


# --------------------------------------------------------------------------
# NVIDIA GPUs (skipped where JAX sees none)
# --------------------------------------------------------------------------


def nvidia_gpus() -> list:
    try:
        return [d for d in jax.devices("gpu") if dali_loader.is_nvidia_gpu(d)]
    except RuntimeError:
        return []


@pytest.mark.parametrize("layout", loaders.LAYOUTS)
@pytest.mark.parametrize("order", dali_loader.ORDERS)
def test_gpu_pipelines_equal_the_reference(cache, layout, order):
    """GPU pipelines compute DALI's GPU kernel's bits: the "dali_gpu" table (at mean = std =
    127.5 it differs from "dali_cpu" on 762 of 768 entries, so the CPU table would fail)."""
    gpus = nvidia_gpus()[:8]  # asked here, not at import: the worker sets its devices first
    if not gpus:
        pytest.skip("needs an NVIDIA GPU: JAX sees none here")
    N, B = 37 * len(gpus), 4
    images, labels = encoded(N)
    norm = Normalize(arithmetic="dali_gpu")
    args = dict(layout=layout, normalize=norm, shuffle=order == "plan", seed=3)
    loader = dali_loader.make_dali_loader((images, labels), gpus, B, cache_dir=cache, order=order, **args)
    assert dali_loader.usable(gpus) and "GPU pipeline(s)" in loader.describe()
    reference = loaders.make_loader((images, labels), gpus, B, prefetch=0, **args)
    for epoch in range(2):
        for step, got in enumerate(loader.epoch(epoch)):
            assert_same_arrays(got, reference.batch(epoch, step), f"epoch {epoch} step {step}")
    resumed = next(loader.epoch(1, start_step=1))
    assert_same_arrays(resumed, reference.batch(1, 1), "epoch 1 resumed at step 1")


# --------------------------------------------------------------------------
# Issue 18: sentences of the spec only these tests can hold DALI to. Each pins
# public behaviour (not the module's internals), to re-check after a rewrite.
# --------------------------------------------------------------------------


def test_one_cache_serves_every_device_count(devices, cache):
    # A shuffled vendor-order run (the one that reads shard lists) with 4 devices, then one
    # with 2 over the same cache folder: the second must read its own shards (the cached
    # shard lists are keyed by n too).
    N, B = 40, 2
    images, labels = encoded(N)
    for n in (4, 2):
        loader = dali_loader.make_dali_loader((images, labels), devices[:n], B, shuffle=True, seed=3,
                                              cache_dir=cache, normalize=DALI, order="vendor")
        try:
            report = describe(list(loader.epoch(0)), N, B, n, images, labels, shuffle=True,
                              last_batch="fill", length=len(loader))
            assert not report, f"{n} devices after another device count:\n{report}"
        finally:
            loader.close()


def test_equal_size_shards_shuffle_differently(devices, cache):
    # Each shard's shuffle is seeded by (seed, shard): two equal shards must not
    # visit their samples in the same local order.
    N, n, B = 40, 2, 4
    images, labels = encoded(N)
    loader = dali_loader.make_dali_loader((images, labels), devices[:n], B, shuffle=True, seed=0,
                                          cache_dir=cache, normalize=DALI)
    try:
        blocks = [shard_blocks(b, n) for b in loader.epoch(0)]
    finally:
        loader.close()
    local = []
    for k in range(n):
        start, stop = shard_bounds(N, k, n)
        order = np.concatenate([encoding.decode_indices(b["images"][k], DALI) for b in blocks])
        assert sorted(order.tolist()) == list(range(start, stop))  # control: each is its own shard
        local.append((order - start).tolist())
    assert local[0] != local[1], "both shards shuffled alike"



# --------------------------------------------------------------------------
# Issue 30.3: a state names its data, and DALI's loader checks it (through plan.Schedule)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("order", dali_loader.ORDERS)
def test_a_state_of_other_data_is_refused_naming_dataset(cache, order):
    run = dict(seed=5, shuffle=True, last_batch="fill")
    images, labels = encoded(48)
    loader = dali_loader.make_dali_loader((images, labels), cpu_devices(4), 3, cache_dir=cache, normalize=DALI,
                                          order=order, **run)
    reference = loaders.make_loader((images, (labels + 1) % 10), cpu_devices(4), 3, normalize=DALI, **run)
    foreign = reference.state(1, 2)  # the same size and run, other labels
    for what, call in [("epoch", lambda: loader.epoch(1, state=foreign)),
                       ("state", lambda: loader.state(1, 3, state=foreign)),
                       ("real_samples", lambda: loader.real_samples(1, state=foreign))]:
        assert_raises_naming(ValueError, call, f"DaliLoader.{what}: the loader state was taken with dataset=",
                             f"this run has dataset={loader.dataset!r}")
    # The controls: its own state, and one the reference loader takes over the same data
    # (the same digest: loaders.Loader.dataset), resume.
    own = loader.state(1, 2)
    assert own.dataset == loaders.make_loader((images, labels), cpu_devices(4), 3, normalize=DALI, **run).dataset
    assert loader.real_samples(1, state=own) == loader.real_samples(1) - 24


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))


# --------------------------------------------------------------------------
# Logical shards read by DALI (order="plan"): the reference's batches on any devices dividing L
# --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["sharded", "pmap"])
def test_logical_shards_read_by_dali_are_the_references_on_2_and_4_devices(devices, cache, layout):
    # make_dali_loader(logical_shards=8): reader k reads its device's 8/n logical shards'
    # blocks, bit for bit the reference loader's, fresh and resumed from a state of 8
    # logical shards taken on other devices (the same plan: no new segment).
    data = encoded(48)
    run = dict(seed=6, shuffle=True, last_batch="fill", logical_shards=8, layout=layout, normalize=DALI)
    saved = LoaderState.start(48, 8, 2, epoch=1, seed=6, shuffle=True).at_step(2)
    for n in (2, 4):
        loader = dali_loader.make_dali_loader(data, devices[:n], 2, cache_dir=cache, **run)
        reference = loaders.make_loader(data, devices[:n], 2, prefetch=0, **run)
        for step, (g, w) in enumerate(zip(loader.epoch(1), reference.epoch(1))):
            assert_same_arrays(g, w, f"{n} devices, step {step}")
        resumed = list(loader.epoch(1, state=saved))
        assert len(resumed) == 1
        assert_same_arrays(resumed[0], reference.batch(1, 2), f"{n} devices, resumed at step 2")
        assert loader.state(1, 3, state=saved).segments == saved.segments
    with pytest.raises(ValueError, match="logical_shards=8 with order='vendor'"):
        dali_loader.make_dali_loader(data, devices[:2], 2, cache_dir=cache, order="vendor", **run)


def test_dali_version_says_not_installed_without_dali(monkeypatch):
    """dali_version: DALI's version, or "not installed" when nvidia.dali does not import
    (hidden here), instead of raising."""
    import nvidia.dali
    assert dali_loader.dali_version() == nvidia.dali.__version__
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    assert dali_loader.dali_version() == "not installed"
