"""The NVIDIA DALI backend (dali_loader.py), against real DALI pipelines on the suite's CPU devices.

Skipped where nvidia.dali does not import; the GPU tests run where JAX sees an NVIDIA GPU, and
a GPU fact that could only be read names DALI's file and function.

* order="plan": the reference loader's batches bit for bit, every field ("index" and
  "logical_shards" too), fresh, out of order and resumed from any state of the run.
* order="vendor": each shard's own samples in DALI's order (conformance.py describes the epoch
  against the plan), no "index", resumed only on its own plan.
* An epoch is a function of (seed, epoch, step, shard); pixels are the dali_cpu table's bits.
* DALI's departures from the spec, asserted as DALI behaves: a test fails when DALI changes.
* Wiring: refusals, the per-sample files and where they go, pipelines released, DLPack.
* With --run-slow: the configuration sweeps, two processes, refimpl.py end to end.

This file is also the worker program of the two-process test.
"""

import dataclasses
import gc
import json
import os
import shutil
import sys
import types
import weakref
from fractions import Fraction

import jax
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

if __name__ != "__main__":  # the worker below runs in a child process that sets its own devices
    from conftest import (assert_same_bits, assert_same_params, bits_differ, exactly_once, refimpl_resized,
                          run_children)

import conformance  # noqa: E402
import dali_loader  # noqa: E402
import encoding  # noqa: E402
import loaders  # noqa: E402
from arithmetic import Normalize, aligned_empty, crop_anchor, normalize_table  # noqa: E402
from cifar_mnist import IMAGE_SHAPE, MNIST_SHAPE, synthetic_cifar10  # noqa: E402
from plan import LAST_BATCH_POLICIES, LoaderState, epoch_plan, shard_bounds  # noqa: E402

# conftest's profile-scaled example count, under pytest (this file is also the worker program).
examples = getattr(sys.modules.get("conftest"), "examples", lambda count: count)
pytestmark = pytest.mark.dali

DALI = Normalize(arithmetic="dali_cpu")  # mean = std = 127.5: every index decodes
CIFAR_MEAN, CIFAR_STD = (125.3, 123.0, 113.9), (63.0, 62.1, 66.7)


@pytest.fixture(scope="module", autouse=True)
def dali_imports():
    """nvidia.dali, imported by the module's first test, not where every xdist worker collects
    the file; without it every test skips, saying so."""
    pytest.importorskip("nvidia.dali", reason="needs NVIDIA DALI: pip install -r requirements-dali.txt")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One per-sample file cache for the module: a dataset is written once."""
    return str(tmp_path_factory.mktemp("dali-cache"))


def encoded(N: int):
    """Images that encode their index, labels i % 10 (int32)."""
    return encoding.encoded_images(np.arange(N)), (np.arange(N) % 10).astype(np.int32)


def cpu_devices(count: int) -> list:
    devices = jax.devices("cpu")
    if len(devices) < count:
        pytest.skip(f"needs {count} CPU devices, JAX has {len(devices)}")
    return devices[:count]


def pair(N: int, n: int, B: int, cache: str, order: str = "plan", **run):
    """(DALI's loader, the reference loader) over N encoded samples on n CPU devices, built alike."""
    run = dict(normalize=DALI) | run
    loader = dali_loader.make_dali_loader(encoded(N), cpu_devices(n), B, cache_dir=cache, order=order, **run)
    return loader, loaders.make_loader(encoded(N), cpu_devices(n), B, prefetch=0, **run)


def decoded(batches: list, n: int, layout: str, normalize=DALI) -> tuple[list, list]:
    """Per shard, (steps, B): the indices its images encode, and its masks."""
    blocks = [{name: conformance.shard_blocks(b[name], n, layout) for name in ("images", "mask")} for b in batches]
    delivered = [np.array([encoding.decode_indices(b["images"][k], normalize) for b in blocks]) for k in range(n)]
    return delivered, [np.array([b["mask"][k] for b in blocks]) for k in range(n)]


def assert_same_arrays(got: dict, want: dict, where: str) -> None:
    """The same fields, each bit for bit with the same shape, dtype and sharding."""
    assert got.keys() == want.keys(), f"{where}: fields {sorted(got)} != {sorted(want)}"
    for name in want:
        assert (got[name].shape, got[name].dtype) == (want[name].shape, want[name].dtype), f"{where} {name}"
        assert got[name].sharding == want[name].sharding, f"{where} {name}: sharding"
        assert_same_bits(got[name], want[name], f"{where} {name}")


def assert_raises_naming(error, fn, *fragments):
    with pytest.raises(error) as info:
        fn()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


# --------------------------------------------------------------------------
# Epochs against the plan
# --------------------------------------------------------------------------


def vendor_findings(batches: list, reference, *, shuffle: bool) -> conformance.Findings:
    """DALI's own order described against the plan (shuffled or not), with each slot's pixels and
    label against the file and each shard's padding against its last real sample."""
    n, B, N = reference.num_shards, reference.batch_size, reference.num_samples
    delivered, masks = decoded(batches, n, reference.layout)
    found = conformance.describe_epoch(delivered, N, B, shuffle=shuffle, last_batch=reference.last_batch,
                                       length=len(reference), masks=masks)
    for k in range(n):
        got, real = delivered[k].ravel(), masks[k].ravel()
        if real.any() and (got[~real] != got[real][-1]).any():
            found.add("padding content", f"shard {k}: padding holds {np.unique(got[~real]).tolist()}")
        for step, batch in enumerate(batches):
            images = conformance.shard_blocks(batch["images"], n, reference.layout)[k]
            labels = conformance.shard_blocks(batch["labels"], n, reference.layout)[k]
            for text in conformance.describe_content(images, labels, delivered[k][step], reference.images,
                                                     reference.labels, reference.normalize):
                found.add("content", f"step {step} shard {k}: {text}")
    return found


def check_epoch(batches: list, reference, epoch: int, first: int, order: str, where: str) -> None:
    """Steps ``first ..`` of a DALI epoch against the reference loader built alike.

    order="plan": every field bit for bit. order="vendor": no "index"; shuffle off, every other
    field bit for bit; shuffle on, "mask" and "logical_shards" bit for bit, each shard its own
    samples (fill: once each), and the order within a shard not the plan's."""
    assert len(batches) == len(reference) - first, where
    for step, got in enumerate(batches, start=first):
        want = reference.batch(epoch, step)
        if order == "vendor":
            assert loaders.INDEX not in got, f"{where}: DALI's own order delivers no sample indices"
            keep = (loaders.MASK, loaders.SHARDS) if reference.shuffle else set(want) - {loaders.INDEX}
            got, want = {k: got[k] for k in keep}, {k: want[k] for k in keep}
        assert_same_arrays(got, want, f"{where} epoch {epoch} step {step}")
    if order == "vendor" and reference.shuffle and first == 0:
        found = vendor_findings(batches, reference, shuffle=True)
        assert not found, f"{where} epoch {epoch}:\n{found.report()}"
        kinds = set(vendor_findings(batches, reference, shuffle=False).kinds)
        assert kinds <= {"order"}, f"{where} epoch {epoch}: {kinds}"
        plan, (got, _) = reference.plan(epoch), decoded(batches, reference.num_shards, reference.layout)
        assert (np.stack(got, 1) != plan.indices)[plan.mask].any(), \
            f"{where} epoch {epoch}: DALI's order is the plan's: the described deviation is gone"


# By default every value of each axis (order "plan" with drop and pmap: the resumes below); the
# rest with --run-slow.
MATRIX_CI = {("plan", "fill", True, "sharded"), ("vendor", "fill", True, "pmap"), ("vendor", "drop", True, "sharded"),
             ("vendor", "fill", False, "sharded")}


@pytest.mark.parametrize("order, last_batch, shuffle, layout", [
    pytest.param(*cell, marks=() if cell in MATRIX_CI else pytest.mark.slow)
    for cell in [(o, p, s, l) for o in dali_loader.ORDERS for p in LAST_BATCH_POLICIES
                 for s in (True, False) for l in loaders.LAYOUTS]])
def test_epochs_against_the_reference(cache, order, last_batch, shuffle, layout):
    """N=53 over 4 shards (13, 13, 13, 14) in batches of 3: fill pads every shard, drop skips
    samples. Epochs 2 and 0 read out of order; epoch 2 resumed from the state its iterator
    gives after 2 steps (the reference's) is the rest of the epoch read whole."""
    loader, reference = pair(53, 4, 3, cache, order, layout=layout, shuffle=shuffle, seed=11,
                             last_batch=last_batch)
    where = f"{order} {last_batch} shuffle={shuffle} {layout}"
    for epoch in (2, 0):
        check_epoch(list(loader.epoch(epoch)), reference, epoch, 0, order, where)
        assert loader.real_samples(epoch) == reference.real_samples(epoch)
    it, whole = loader.epoch(2), list(loader.epoch(2))
    next(it), next(it)
    saved = it.get_state()
    it.close()
    assert saved == reference.epoch(2).get_state().at_step(2)
    resumed = loader.epoch(2, state=saved)
    rest = list(resumed)
    assert resumed.get_state() == saved.at_step(len(reference))
    if order == "plan" or not shuffle:
        check_epoch(rest, reference, 2, 2, order, where + ", resumed at step 2")
    for step, (got, want) in enumerate(zip(rest, whole[2:], strict=True), start=2):
        assert_same_arrays(got, want, f"{where}: resumed step {step} against the epoch read whole")


@st.composite
def cases(draw):
    n = draw(st.sampled_from([1, 2, 3, 8]))
    N = draw(st.integers(20, 300))
    return (N, n, draw(st.integers(1, min(8, N // n))), draw(st.sampled_from(LAST_BATCH_POLICIES)),
            draw(st.booleans()), draw(st.sampled_from(loaders.LAYOUTS)), draw(st.integers(0, 2**32 - 1)))


@pytest.mark.slow
@settings(max_examples=examples(4))
@given(cases())
@example((23, 4, 5, "fill", True, "sharded", 0))  # a shard list of 5 = B: a batch short of the plan, filled
def test_drawn_epochs_against_the_reference(cache, case):
    """Drawn (N, n, B, policy, shuffle, layout, seed), both orders: check_epoch's guarantees."""
    N, n, B, last_batch, shuffle, layout, seed = case
    for order in dali_loader.ORDERS:
        loader, reference = pair(N, n, B, cache, order, layout=layout, shuffle=shuffle, seed=seed,
                                 last_batch=last_batch)
        for epoch in (1, 0):
            check_epoch(list(loader.epoch(epoch)), reference, epoch, 0, order, f"{order} {case}")


def test_check_epoch_fails_on_the_wrong_order(cache):
    """check_epoch's negative controls: DALI's shuffled order held to the plan's bits fails, the
    plan's order held to DALI's fails (no "order" deviation), and a sample moved to another
    shard is named; a vendor batch with "index" fails too."""
    vendor, reference = pair(53, 4, 3, cache, "vendor", shuffle=True, seed=11)
    plan, _ = pair(53, 4, 3, cache, "plan", shuffle=True, seed=11)
    with pytest.raises(AssertionError, match="epoch 0 step"):
        check_epoch(list(vendor.epoch(0)), reference, 0, 0, "plan", "vendor held to the plan")
    with pytest.raises(AssertionError, match="the described deviation is gone"):
        check_epoch([{k: v for k, v in b.items() if k != loaders.INDEX} for b in plan.epoch(0)], reference,
                    0, 0, "vendor", "plan held to the vendor's")
    with pytest.raises(AssertionError, match="no sample indices"):
        check_epoch(list(plan.epoch(0)), reference, 0, 0, "vendor", "an index in DALI's order")
    batches = [dict(b) for b in vendor.epoch(0)]
    swapped = np.asarray(batches[1]["images"]).copy()
    swapped[[0, 3]] = swapped[[3, 0]]  # first slot of shard 0 <-> first slot of shard 1
    batches[1]["images"] = swapped
    with pytest.raises(AssertionError, match="outside the shard"):
        check_epoch(batches, reference, 0, 0, "vendor", "shards mixed")


@pytest.mark.parametrize("order", dali_loader.ORDERS)
def test_an_epoch_is_a_function_of_seed_epoch_step_and_shard(cache, order):
    """Epoch 3 read by one loader, again after others and after an epoch left early, and by a
    second loader built alike, and resumed at steps 1 and 5 (the end): the same batches.
    Negative control: epoch 2 differs."""
    first, _ = pair(50, 4, 3, cache, order, shuffle=True, seed=7)  # 5 steps an epoch
    second, _ = pair(50, 4, 3, cache, order, shuffle=True, seed=7)

    def read(loader, epoch, step=0):
        state = None if not step else loader.epoch(epoch).get_state().at_step(step)
        return [{k: np.asarray(v) for k, v in b.items()} for b in loader.epoch(epoch, state=state)]

    three = read(first, 3)
    left_early = first.epoch(0)
    next(left_early)
    left_early.close()
    read(second, 1)
    reads = {"again": read(first, 3), "second loader": read(second, 3), "from step 1": read(first, 3, 1),
             "from the end": read(first, 3, 5)}
    for what, got in reads.items():
        start = {"from step 1": 1, "from the end": 5}.get(what, 0)
        assert len(got) == 5 - start, what
        for step, batch in enumerate(got, start=start):
            for name in batch:
                assert_same_bits(batch[name], three[step][name], f"{order}, {what}: step {step} {name}")
    assert any(bits_differ(a["images"], b["images"]) for a, b in zip(read(first, 2), three))


@pytest.mark.parametrize("order", dali_loader.ORDERS)
def test_shards_of_equal_size_are_shuffled_apart(cache, order):
    """Two shards of 20 samples: each its own samples, in orders that differ (shard k's shuffle is
    seeded by the shard, in DALI's order by SeedSequence([seed, epoch, k])), the same again from
    a second loader built alike (the difference is the shard's, not noise)."""
    def local_orders():
        loader, _ = pair(40, 2, 4, cache, order, shuffle=True, seed=0)
        delivered, _ = decoded(list(loader.epoch(0)), 2, "sharded")
        return [(delivered[k].ravel() - shard_bounds(40, k, 2)[0]).tolist() for k in range(2)]

    local = local_orders()
    assert sorted(local[0]) == sorted(local[1]) == list(range(20)), "each shard its own samples, once"
    assert local[0] != local[1], f"{order}: both shards shuffled alike"
    assert local_orders() == local


# --------------------------------------------------------------------------
# Pixels: crop, mirror, per-channel mean and std
# --------------------------------------------------------------------------


@pytest.mark.parametrize("crop, crop_pos, mirror, wrong", [
    # anchors 1.5 -> 2 (y) and 2.5 -> 3 (x): DALI rounds half away from zero, rocAL to even.
    ((29, 27), (0.5, 0.5), True, dict(mirror=False)),
    # anchors y = 1/6 * 4 -> 1, x = 0.9 * 2 -> 2: crop_pos is (pos_y, pos_x), not the reverse.
    ((28, 30), (1 / 6, 0.9), False, dict(crop_pos=(0.9, 1 / 6))),
    # 0.7f * 5 = 3.4999999 in double -> 3 (CropAttr::CalculateAnchor, crop_attr.cc); a float32
    # product would be 3.5 -> 4: the negative control is a window one pixel further.
    ((27, 27), (0.7, 0.7), True, dict(crop_pos=(0.8, 0.8))),
])
def test_crop_mirror_normalize_is_the_dali_table(cache, crop, crop_pos, mirror, wrong):
    """Crop at (pos_y, pos_x), mirror and per-channel mean/std: the dali_cpu table's bits, not
    rocAL's table nor the same arguments with one changed."""
    rng = np.random.default_rng(7)
    images = rng.integers(0, 256, size=(16,) + IMAGE_SHAPE, dtype=np.uint8)
    labels = rng.integers(0, 10, size=16).astype(np.int32)
    norm = Normalize(mean=CIFAR_MEAN, std=CIFAR_STD, crop=crop, crop_pos=crop_pos, mirror=mirror,
                     arithmetic="dali_cpu")
    loader = dali_loader.make_dali_loader((images, labels), cpu_devices(2), 8, normalize=norm, cache_dir=cache)
    (batch,) = list(loader.epoch(0))
    got = np.asarray(batch["images"])  # shard 0 = samples 0..7, shard 1 = 8..15
    assert got.shape == (16, 3) + crop and got.dtype == np.float32
    assert_same_bits(got, norm(images), "DALI's pixels against the dali_cpu table")
    np.testing.assert_array_equal(np.asarray(batch["labels"]), labels)
    assert not np.array_equal(got, dataclasses.replace(norm, arithmetic="rocal")(images))
    assert not np.array_equal(got, dataclasses.replace(norm, **wrong)(images))


@pytest.mark.parametrize("channels", [1, 3])
def test_a_negative_zero_mean_gives_the_tables_bits(cache, channels):
    """Normalize(mean=-0.0, std=-2.0) after the same with +0.0: each loader's pixels are its own
    table's (dali_cpu: x - mean is +0.0 at x = 0 for both zeros, -0.0 after the product)."""
    images = np.zeros((8, channels, 6, 6), np.uint8)
    images[:, :, 0, 1], images[:, :, 0, 2] = 7, 255
    labels = (np.arange(8) % 10).astype(np.int32)
    for mean in (0.0, -0.0):
        norm = Normalize(mean=(mean,) * channels, std=(-2.0,) * channels, arithmetic="dali_cpu")
        loader = dali_loader.make_dali_loader((images, labels), cpu_devices(2), 2, normalize=norm, cache_dir=cache)
        got = np.asarray(next(loader.epoch(0))["images"])
        assert_same_bits(got, norm(images[:len(got)]), f"DALI, mean {mean!r}")
        assert np.signbit(got[0, 0, 0, 0]) and np.signbit(norm.table[0, 0])


def test_mnist_shaped_data_is_the_references(cache):
    """One channel of 28 x 28, the DALI notebook's Normalize(0, 255)."""
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, size=(50,) + MNIST_SHAPE, dtype=np.uint8)
    labels = rng.integers(0, 10, size=50).astype(np.int32)
    run = dict(layout="pmap", normalize=Normalize(mean=(0.0,), std=(255.0,), arithmetic="dali_cpu"))
    loader = dali_loader.make_dali_loader((images, labels), cpu_devices(4), 5, cache_dir=cache, **run)
    reference = loaders.make_loader((images, labels), cpu_devices(4), 5, prefetch=0, **run)
    check_epoch(list(loader.epoch(1)), reference, 1, 0, "plan", "MNIST")


# --------------------------------------------------------------------------
# DALI's departures from the spec, as DALI behaves
# --------------------------------------------------------------------------


def raw_pipeline(folder: str, batch_size: int, *, seed: int = 1, file_list: str = dali_loader.LIST_NAME,
                 **reader):
    """A bare CPU pipeline: DALI's file reader alone (raw bytes out)."""
    Pipeline, fn, _ = dali_loader.import_dali()
    pipe = Pipeline(batch_size=batch_size, num_threads=1, device_id=None, seed=seed)
    with pipe:
        raw, _ = fn.readers.file(file_root=folder, file_list=os.path.join(folder, file_list),
                                 name=dali_loader.READER, **reader)
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


def test_random_shuffle_with_dalis_sharding_scatters_the_shards(cache):
    """readers.file with random_shuffle permutes the whole list with a fixed seed before cutting
    shards: shard k is a fixed scattered subset, the same for every seed. The backend's one
    list per shard keeps every shard contiguous."""
    N, n, B = 13, 4, 3
    folder = dali_loader.sample_files(*encoded(N), cache)
    subsets = {}
    for seed in (1, 7):
        delivered = [raw_ids(raw_pipeline(folder, B, seed=seed, shard_id=k, num_shards=n, random_shuffle=True,
                                          stick_to_shard=True, pad_last_batch=True), 2) for k in range(n)]
        found = conformance.describe_epoch(delivered, N, B, shuffle=True, last_batch="fill", length=2)
        assert "outside the shard" in found.kinds, found.report()
        subsets[seed] = [sorted(set(d.ravel().tolist())) for d in delivered]
    assert subsets[1] == subsets[7] == [[0, 2, 10], [1, 7, 11], [3, 5, 6], [4, 8, 9, 12]]  # mt19937(524287)
    loader, reference = pair(N, n, B, cache, "vendor", shuffle=True)
    assert not vendor_findings(list(loader.epoch(0)), reference, shuffle=True)


def test_a_shard_lists_epoch_can_be_a_batch_short(cache):
    """A reader over S samples with pad_last_batch has ceil(S/B) batches: with one list per
    shard (N=13, n=4, B=3: shards of 3, 3, 3, 4) shards 0..2 have 1, the plan 2. The backend
    fills that step with the shard's last delivered sample, mask False."""
    N, n, B = 13, 4, 3
    folder = dali_loader.sample_files(*encoded(N), cache)
    pipes = [raw_pipeline(folder, B, file_list=os.path.basename(dali_loader.shard_list(folder, k, n)),
                          shard_id=0, num_shards=1, random_shuffle=True, stick_to_shard=True,
                          pad_last_batch=True) for k in range(n)]
    lengths = [-(-p.reader_meta(dali_loader.READER)["epoch_size_padded"] // B) for p in pipes]
    assert lengths == [1, 1, 1, 2]
    found = conformance.describe_epoch([raw_ids(p, m) for p, m in zip(pipes, lengths)], N, B, shuffle=True,
                                       last_batch="fill", length=2)
    assert "batches arrived" in found.kinds and "outside the shard" not in found.kinds
    loader, _ = pair(N, n, B, cache, "vendor", shuffle=True)
    delivered, masks = decoded(list(loader.epoch(0)), n, "sharded")
    np.testing.assert_array_equal(delivered[0][1], [delivered[0][0][-1]] * B)
    assert not masks[0][1].any()
    np.testing.assert_array_equal(masks[3][1], [True, False, False])


def test_without_stick_to_shard_readers_move_to_the_next_shard(cache):
    """Without stick_to_shard, reader k reads shard (k + e) mod n in epoch e."""
    N, n, B = 13, 4, 3
    folder = dali_loader.sample_files(*encoded(N), cache)
    plan = epoch_plan(N, n, B)
    for k in (0, 3):
        pipe = raw_pipeline(folder, B, shard_id=k, num_shards=n, stick_to_shard=False, pad_last_batch=True)
        for epoch in range(3):
            np.testing.assert_array_equal(raw_ids(pipe, 2), plan.indices[:, (k + epoch) % n],
                                          err_msg=f"reader {k} epoch {epoch}")


def test_run_does_not_stop_at_the_epoch_end_and_reset_does_not_rewind(cache):
    """Pipeline.run() never ends an epoch (only DALI's iterators count batches, from
    reader_meta), and reset() does not rewind a reader."""
    folder = dali_loader.sample_files(*encoded(13), cache)
    pipe = raw_pipeline(folder, 3, shard_id=0, num_shards=4, stick_to_shard=True, pad_last_batch=True)
    meta = pipe.reader_meta(dali_loader.READER)
    assert (meta["epoch_size"], meta["epoch_size_padded"], meta["number_of_shards"]) == (13, 16, 4)
    np.testing.assert_array_equal(raw_ids(pipe, 5), [[0, 1, 2], [2, 2, 2]] * 2 + [[0, 1, 2]])
    pipe.reset()
    np.testing.assert_array_equal(raw_ids(pipe, 1), [[2, 2, 2]])  # not [0, 1, 2]


def test_the_pipeline_seed_drives_dalis_shuffle(cache):
    """Within one list, random_shuffle's order follows the pipeline seed: the same seed, the same
    stream; another seed or the next epoch, another order. So the backend's vendor order changes
    with the seed and the epoch, and is the same for the same pair."""
    N = 40
    images, labels = encoded(N)
    folder = dali_loader.sample_files(images, labels, cache)

    def order(seed):
        pipe = raw_pipeline(folder, 8, seed=seed, shard_id=0, num_shards=1, random_shuffle=True,
                            stick_to_shard=True, pad_last_batch=True, initial_fill=N)
        return raw_ids(pipe, 10).reshape(2, N)  # two epochs

    one, two = order(1), order(2)
    assert sorted(one[0]) == sorted(one[1]) == list(range(N))
    np.testing.assert_array_equal(order(1), one)
    assert one[0].tolist() != two[0].tolist() and one[0].tolist() != one[1].tolist()

    def loader_order(seed, epoch):
        loader, _ = pair(N, 2, 4, cache, "vendor", shuffle=True, seed=seed)
        return np.concatenate(decoded(list(loader.epoch(epoch)), 2, "sharded")[0]).tolist()

    assert loader_order(0, 0) == loader_order(0, 0) != loader_order(1, 0)
    assert loader_order(0, 0) != loader_order(0, 1), "the same order in epochs 0 and 1"


def test_vendor_shuffle_draws_from_the_whole_shard(cache):
    """Each shard is read with initial_fill = its size. DALI permutes the list with its fixed seed
    (order P: initial_fill=1 reads P itself), then draws each sample from a buffer of
    initial_fill samples of P: the first batch (shard of 2048, B=32) holds samples from anywhere
    in P. Negative control: DALI's default buffer (1024) draws it from P's first 1024 + 32."""
    N, B = 2048, 32
    images = encoding.encoded_images(np.arange(N), (1, 2, 2))  # [i % 256, i % 256, i // 256, i // 256]
    labels = (np.arange(N) % 10).astype(np.int32)
    identity = Normalize(mean=(0.0,), std=(1.0,), arithmetic="dali_cpu")
    loader = dali_loader.make_dali_loader((images, labels), cpu_devices(1), B, shuffle=True, seed=1,
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
def test_a_reader_whose_padded_shard_is_not_the_plans_is_refused(cache, monkeypatch, order, shuffle):
    """Each reader's reader_meta is held to the plan (the epoch's size and the padded size a
    shard): one that reports a batch more a shard is refused, naming the shard, before a batch."""
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

    loader, _ = pair(20, 2, 2, cache, order, shuffle=shuffle)
    assert len(list(loader.epoch(0))) == 5  # control: the real readers pass
    monkeypatch.setattr(dali_loader, "dali_pipeline", lambda *a, **k: PaddedMore(real(*a, **k)))
    with pytest.raises(RuntimeError, match=r"reader of shard 0 sees \d+ samples, \d+ per shard"):
        next(loader.epoch(0))


def test_dalis_own_checkpoints_restore_only_onto_as_many_pipelines():
    """Why order="vendor" cannot resize (nvidia/dali/plugin/jax/iterator.py, data_iterator):
    DALI's JAX iterator takes one checkpoint per device and refuses another count."""
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
# Resuming a saved epoch on other shards
# --------------------------------------------------------------------------

# (n0, B0, stop, n1, B1): epoch 1 of 48 samples saved after `stop` steps on n0 shards of B0,
# resumed on n1 shards of B1: fewer shards with a larger batch, and more with a smaller one.
RESIZES = [(8, 2, 1, 3, 4), (4, 3, 2, 6, 2)]
RESUMED_IN_CI = {(8, 2, 1, 3, 4, "fill", True, "sharded"), (4, 3, 2, 6, 2, "drop", False, "pmap")}
RESUMED_CELLS = [pytest.param(*cell, marks=() if cell in RESUMED_IN_CI else pytest.mark.slow)
                 for cell in [(*r, p, s, l) for r in RESIZES for p in LAST_BATCH_POLICIES
                              for s in (True, False) for l in loaders.LAYOUTS]]


def saved_state(N: int, n0: int, B0: int, stop: int, **run) -> LoaderState:
    """What a loader of N samples on n0 shards of B0 saves after ``stop`` steps of epoch 1."""
    return LoaderState.start(N, n0, B0, epoch=1, **run).at_step(stop)


def check_resumed(loader, reference, saved: LoaderState, where: str) -> list:
    """DALI's ``epoch(1, state=saved)`` is the reference's bit for bit, with the same real slots
    and the same state after it; returns DALI's batches."""
    it, reference_it = loader.epoch(1, state=saved), reference.epoch(1, state=saved)
    got, want = list(it), list(reference_it)
    assert len(got) == len(want) == saved.resized(reference.num_shards, reference.batch_size).num_steps - \
        saved.step, where
    for step, (g, w) in enumerate(zip(got, want), start=saved.step):
        assert_same_arrays(g, w, f"{where}: resumed step {step}")
    assert loader.real_samples(1, state=saved) == reference.real_samples(1, state=saved), where
    assert it.get_state() == reference_it.get_state(), where
    return got


@pytest.mark.parametrize("n0, B0, stop, n1, B1, last_batch, shuffle, layout", RESUMED_CELLS)
def test_plan_order_resumes_on_other_shards_as_the_reference(cache, n0, B0, stop, n1, B1, last_batch, shuffle,
                                                            layout):
    """A state saved on n0 shards of B0 resumes on n1 of B1 as the reference's (elastic_plan's
    last segment); the state after one more step resumes again, back on n0 x B0."""
    run = dict(seed=5, shuffle=shuffle, last_batch=last_batch)
    saved = saved_state(48, n0, B0, stop, **run)
    loader, reference = pair(48, n1, B1, cache, layout=layout, **run)
    where = f"{n0}x{B0} -> {n1}x{B1} at step {stop}, {last_batch}, shuffle={shuffle}, {layout}"
    it = loader.epoch(1, state=saved)
    next(it)
    again = it.get_state()
    it.close()
    assert len(again.segments) == 2, "the cell resumes a resized epoch"
    assert len(check_resumed(loader, reference, saved, where)) >= 2
    back, back_reference = pair(48, n0, B0, cache, layout=layout, **run)
    assert check_resumed(back, back_reference, again, where + f", then back to {n0}x{B0} at step {stop + 1}")


@pytest.mark.parametrize("n0, B0, stop, n1, B1, last_batch, edge", [
    (3, 2, 2, 8, 4, "fill", "a batch larger than every run"),  # 25 left: runs of 3 and 4, B=4
    (2, 4, 4, 7, 1, "fill", "shards with an empty run"),  # 5 left on 7 shards: two hold padding alone
    (4, 3, 2, 6, 3, "drop", "0 steps"),  # 13 left on 6 shards of 3: drop runs none
])
def test_plan_order_resumes_what_only_a_resized_segment_holds(cache, n0, B0, stop, n1, B1, last_batch, edge):
    """Segments a fresh epoch never has: DALI is fed them all the same, as the reference."""
    run = dict(seed=8, shuffle=True, last_batch=last_batch)
    saved = saved_state(37, n0, B0, stop, **run)
    plan, row = saved.resized(n1, B1).plan()
    real = plan.mask[row:].sum(axis=(0, 2))  # per shard
    assert {"a batch larger than every run": len(plan.indices) - row == 1 and real.max() <= B1
            and real.min() < B1, "shards with an empty run": 0 < (real == 0).sum() < n1,
            "0 steps": len(plan.indices) == row}[edge], f"the case is not {edge!r}: {real}"
    loader, reference = pair(37, n1, B1, cache, layout="pmap", **run)
    check_resumed(loader, reference, saved, edge)


def test_a_resume_that_reads_the_own_plan_from_the_step_is_caught(cache):
    """check_resumed's negative control: the new shards' own plan from the saved step is not the
    resumed epoch."""
    run = dict(seed=5, shuffle=True, last_batch="fill")
    saved = saved_state(48, 8, 2, 1, **run)
    loader, reference = pair(48, 3, 4, cache, **run)
    own = loader.epoch(1).get_state().at_step(saved.step)
    got, want = list(loader.epoch(1, state=own)), list(reference.epoch(1, state=saved))
    assert len(got) != len(want) or any(bits_differ(a["images"], b["images"]) for a, b in zip(got, want))


def test_resume_refusals_name_the_field(cache):
    """A state of another run or epoch, or not a LoaderState, is refused naming the field."""
    run = dict(seed=5, shuffle=True, last_batch="fill")
    saved = saved_state(48, 8, 2, 1, **run)
    loader, _ = pair(48, 3, 4, cache, **run)
    assert_raises_naming(ValueError, lambda: loader.epoch(1, state=dataclasses.replace(saved, seed=6)),
                         "DaliLoader.epoch", "seed=6", "this run has seed=5")
    assert_raises_naming(ValueError, lambda: loader.epoch(2, state=saved), "epoch=2", "state is of epoch 1")
    assert_raises_naming(ValueError, lambda: loader.epoch(1, state=saved.to_json()), "must be a plan.LoaderState")
    assert_raises_naming(ValueError, lambda: loader.real_samples(1, state=dataclasses.replace(saved, shuffle=False)),
                         "DaliLoader.real_samples", "shuffle")


def test_vendor_order_resumes_only_on_its_own_plan(cache):
    """order="vendor" continues DALI's order only from a state of its own shards and batch (one
    segment): the steps after it, its state and real slots; a state of other shards, another
    batch, or an epoch resized on the way, is refused naming why."""
    run = dict(seed=5, shuffle=True, last_batch="fill")
    loader, _ = pair(48, 4, 3, cache, "vendor", **run)
    same = saved_state(48, 4, 3, 2, **run)
    it = loader.epoch(1, state=same)
    got = list(it)
    for step, (g, w) in enumerate(zip(got, list(loader.epoch(1))[2:], strict=True), start=2):
        assert_same_arrays(g, w, f"resumed step {step}")
    assert it.get_state() == dataclasses.replace(same.at_step(len(loader)), dataset=loader.dataset)
    assert loader.real_samples(1, state=same) == int(loader.plan(1).mask[2:].sum())
    for other in (saved_state(48, 8, 2, 1, **run), saved_state(48, 4, 2, 1, **run),
                  same.resized(3, 4).at_step(3).resized(4, 3)):
        for call in (lambda: loader.epoch(1, state=other), lambda: loader.real_samples(1, state=other)):
            assert_raises_naming(ValueError, call, "order='vendor' resumes only on the shards and batch",
                                 "DALI's checkpoints restore one reader state per pipeline", "order='plan'")


@pytest.mark.parametrize("order", dali_loader.ORDERS)
def test_a_state_of_other_data_is_refused_naming_dataset(cache, order):
    """A state names its data: one taken over other labels is refused; the loader's own, and
    the reference's over the same data (the same digest), resume."""
    run = dict(seed=5, shuffle=True, last_batch="fill", normalize=DALI)
    images, labels = encoded(48)
    loader = dali_loader.make_dali_loader((images, labels), cpu_devices(4), 3, cache_dir=cache, order=order, **run)
    foreign = loaders.make_loader((images, (labels + 1) % 10), cpu_devices(4), 3, **run).epoch(1).get_state()
    for what, call in [("epoch", lambda: loader.epoch(1, state=foreign)),
                       ("real_samples", lambda: loader.real_samples(1, state=foreign))]:
        assert_raises_naming(ValueError, call, f"DaliLoader.{what}: the loader state was taken with dataset=",
                             f"this run has dataset={loader.dataset!r}")
    own = loader.epoch(1).get_state()
    assert own == loaders.make_loader((images, labels), cpu_devices(4), 3, **run).epoch(1).get_state()
    assert loader.real_samples(1, state=own.at_step(2)) == loader.real_samples(1) - 24


def test_logical_shards_are_the_references_on_2_3_and_4_devices(cache):
    """logical_shards=8: reader k reads its device's logical shards (a spare slot on 3
    devices), bit for bit the reference's, fresh and resumed from a state of 8 shards taken
    elsewhere (no new segment); refused with order="vendor"."""
    run = dict(seed=6, shuffle=True, last_batch="fill", logical_shards=8, layout="pmap")
    saved = LoaderState.start(48, 8, 2, epoch=1, seed=6, shuffle=True).at_step(2)
    for n in (2, 3, 4):
        loader, reference = pair(48, n, 2, cache, **run)
        check_epoch(list(loader.epoch(1)), reference, 1, 0, "plan", f"{n} devices")
        assert len(check_resumed(loader, reference, saved, f"{n} devices")) == 1
    with pytest.raises(ValueError, match="logical_shards=8 with order='vendor'"):
        pair(48, 2, 2, cache, "vendor", **run)


# --------------------------------------------------------------------------
# Wiring: refusals, files, pipelines
# --------------------------------------------------------------------------


def test_refusals(cache):
    """Bad arguments are refused naming the parameter and the value; a closed loader starts no epoch."""
    images, labels = encoded(20)

    def make(**kwargs):
        args = dict(data=(images, labels), devices=cpu_devices(4), batch_size=2, cache_dir=cache) | kwargs
        return lambda: dali_loader.make_dali_loader(args.pop("data"), args.pop("devices"), args.pop("batch_size"),
                                                    **args)

    assert_raises_naming(ValueError, make(normalize=Normalize()), "arithmetic='rocal'",
                         "compute arithmetic='dali_cpu'")
    assert_raises_naming(ValueError, make(normalize=Normalize(arithmetic="dali_gpu")),
                         "arithmetic='dali_gpu'", "cpu devices compute arithmetic='dali_cpu'")
    assert_raises_naming(ValueError, make(normalize=lambda x: x), "normalize=", "arithmetic='dali_cpu'")
    assert_raises_naming(ValueError, make(order="dali"), "order", "'dali'")
    assert_raises_naming(ValueError, make(batch_size=6), "batch_size=6", "smallest shard")
    for threads in (0, 1.5, True):
        assert_raises_naming(ValueError, make(num_threads=threads), "num_threads", f"got {threads!r}")
    assert_raises_naming(ValueError, make(layout="rows"), "'rows'")
    assert_raises_naming(ValueError, make(last_batch="partial"), "'partial'")
    assert_raises_naming(ValueError, make(data=(images.astype(np.float32), labels)), "uint8")
    loader = make(num_threads=np.int64(2))()
    assert_raises_naming(ValueError, lambda: loader.epoch(-1), "epoch=-1")
    assert len(loader) == 3 and "4 CPU pipeline(s) an epoch" in loader.describe()
    loader.close()
    assert_raises_naming(RuntimeError, lambda: loader.epoch(1), "closed")


def test_sample_files_go_where_cache_dir_says(tmp_path, monkeypatch):
    """The per-sample files (and order="vendor"'s shard lists) are written under cache_dir, "~"
    expanded, and read from there; nothing goes to DEFAULT_CACHE then. Without cache_dir,
    DEFAULT_CACHE is used (patched here to a folder under tmp_path)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)  # a "~" left unexpanded would make a folder "~" here
    monkeypatch.setattr(dali_loader, "DEFAULT_CACHE", str(tmp_path / "default"))
    read_from, real = [], dali_loader.dali_pipeline
    monkeypatch.setattr(dali_loader, "dali_pipeline", lambda folder, *a, **k: read_from.append(folder)
                        or real(folder, *a, **k))
    for cache_dir, where in (("~/given", tmp_path / "home" / "given"), (None, tmp_path / "default")):
        loader = dali_loader.make_dali_loader(encoded(12), cpu_devices(2), 2, cache_dir=cache_dir,
                                              shuffle=True, order="vendor")
        assert os.path.dirname(loader.folder) == str(where) and os.listdir(where) == [os.path.basename(loader.folder)]
        list(loader.epoch(0))
        assert set(read_from) == {loader.folder}, read_from
        assert "list-1-of-2.txt" in os.listdir(loader.folder)
        read_from.clear()
        if cache_dir is not None:
            assert not os.path.exists(tmp_path / "default"), "written to DEFAULT_CACHE as well"


def test_sample_files_are_keyed_by_content_and_written_once(tmp_path):
    """One file a sample and list.txt, keyed by the shape, bytes and labels: written once, never
    reused for changed data; a label int32 would change is refused."""
    images, labels = encoded(12)
    folder = dali_loader.sample_files(images, labels, tmp_path)
    assert sorted(os.listdir(folder)) == [f"{i:06d}.bin" for i in range(12)] + ["list.txt"]
    assert open(os.path.join(folder, "000011.bin"), "rb").read() == images[11].tobytes()
    assert open(os.path.join(folder, "list.txt")).read().splitlines()[11] == "000011.bin 1"
    before = os.stat(os.path.join(folder, "list.txt"))
    assert dali_loader.sample_files(images.copy(), labels.astype(np.int64), tmp_path) == folder
    after = os.stat(os.path.join(folder, "list.txt"))
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "rewritten"
    changed, relabelled = images.copy(), labels.copy()
    changed[5, 2, 31, 31] ^= 1
    relabelled[0] = 9
    others = {dali_loader.sample_files(changed, labels, tmp_path),
              dali_loader.sample_files(images, relabelled, tmp_path),
              dali_loader.sample_files(images[:, :1], labels, tmp_path)}
    assert len(others | {folder}) == 4
    assert all(name.startswith("dali-samples-") for name in os.listdir(tmp_path)), "scratch left behind"
    with pytest.raises(ValueError, match=r"labels outside int32.*4294967297"):  # never wrapped to label 1
        dali_loader.sample_files(images[:4], np.array([0, 1, 2, 2**32 + 1]), tmp_path / "other")
    assert not os.path.exists(tmp_path / "other")


def test_sample_files_is_atomic(tmp_path, monkeypatch):
    """A failed write leaves nothing; a writer that loses the race uses the winner's folder."""
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
    assert os.listdir(tmp_path) == [os.path.basename(folder)] and len(os.listdir(folder)) == 6


@settings(max_examples=examples(60))
@given(st.integers(1, 10**13), st.data())
@example(10**6, None)
@example(10**6 + 1, None)
@example(10**7 + 5, None)
def test_sample_names_are_distinct_and_in_index_order_for_any_n(N, data):
    """sample_name(i, N): distinct, sorted by name as by index (DALI lists a folder by name), naming
    the index; at N = 10**6 + 1 too, where a six-digit pad would put 1000000 before 999999."""
    picks = [0, N - 1, N // 2, max(N - 2, 0), min(999_999, N - 1)]
    if data is not None:
        picks += data.draw(st.lists(st.integers(0, N - 1), max_size=6))
    picks = sorted(set(picks))
    names = [dali_loader.sample_name(i, N) for i in picks]
    assert sorted(names) == names and len(set(names)) == len(names), names
    assert [int(name[:-len(".bin")]) for name in names] == picks
    assert len({len(name) for name in names}) == 1, names


def test_a_shard_list_is_keyed_by_the_shard_count(tmp_path):
    """shard_list(folder, k, n) holds shard k of n's lines, whatever (k, n') was asked before."""
    folder = dali_loader.sample_files(*encoded(12), tmp_path)
    lines = open(os.path.join(folder, dali_loader.LIST_NAME)).read().splitlines()
    for k, n in ((0, 2), (0, 3), (1, 3), (1, 2), (0, 1), (0, 2)):
        start, stop = shard_bounds(12, k, n)
        assert open(dali_loader.shard_list(folder, k, n)).read().splitlines() == lines[start:stop], (k, n)


def test_an_epochs_pipelines_go_with_its_iterator(cache, monkeypatch):
    """Built at the first step, one a device; gone when the iterator is closed or read out."""
    built, real = [], dali_loader.dali_pipeline

    def recorded(*args, **kwargs):
        pipe = real(*args, **kwargs)
        built.append(weakref.ref(pipe))
        return pipe

    monkeypatch.setattr(dali_loader, "dali_pipeline", recorded)
    loader, _ = pair(20, 3, 2, cache)
    steps = loader.epoch(0)
    assert not built, "pipelines built before the first step was asked for"
    next(steps)
    assert len(built) == 3 and all(r() is not None for r in built)
    steps.close()
    gc.collect()
    assert all(r() is None for r in built), "a pipeline outlived its epoch's iterator"
    list(loader.epoch(1))
    gc.collect()
    assert len(built) == 6 and all(r() is None for r in built)


def test_dali_version_and_the_install_hint(monkeypatch):
    """dali_version: DALI's version, or "not installed" without nvidia.dali (hidden here); the
    import error says how to install it, and no device is usable then."""
    import nvidia.dali
    assert dali_loader.dali_version() == nvidia.dali.__version__
    monkeypatch.setitem(sys.modules, "nvidia.dali.pipeline", None)
    assert_raises_naming(ImportError, dali_loader.import_dali, "pip install -r requirements-dali.txt",
                         "nvidia-dali-cuda120", "import failed")
    assert not dali_loader.usable([fake_device("gpu", "cuda 12080")])
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    assert dali_loader.dali_version() == "not installed"


# --------------------------------------------------------------------------
# Device kinds: which arithmetic, which backend (fake devices)
# --------------------------------------------------------------------------


def fake_device(platform: str, version: str = "<unknown>"):
    """What usable/arithmetic_for/choose_backend read of a jax.Device (JAX 0.10 on CUDA: platform
    "gpu", version "cuda 12080"; on ROCm: "gpu" too, version "rocm 60300")."""
    return types.SimpleNamespace(platform=platform, client=types.SimpleNamespace(platform_version=version),
                                 process_index=0)


NVIDIA = [fake_device("gpu", "cuda 12080"), fake_device("gpu", "CUDA 13000")]
ROCM = [fake_device("gpu", "rocm 60300"), fake_device("gpu", "rocm 60300")]
CPU = [fake_device("cpu")]


def test_arithmetic_and_usable_follow_the_device_kind():
    """dali_gpu on NVIDIA GPUs, dali_cpu on CPU devices, anything else refused; usable only on
    NVIDIA GPUs."""
    assert dali_loader.arithmetic_for(NVIDIA) == dali_loader.arithmetic_for([fake_device("cuda")]) == "dali_gpu"
    assert dali_loader.arithmetic_for(CPU) == dali_loader.arithmetic_for(cpu_devices(2)) == "dali_cpu"
    for wrong in (ROCM, NVIDIA[:1] + CPU, [fake_device("tpu", "TFRT TPU")], []):
        with pytest.raises(ValueError, match="CPU devices or NVIDIA GPUs"):
            dali_loader.arithmetic_for(wrong)
    assert dali_loader.usable(NVIDIA)  # nvidia.dali imports here: only the device kind decides
    for wrong in (ROCM, CPU, [], NVIDIA + ROCM, cpu_devices(2)):
        assert not dali_loader.usable(wrong)
    with pytest.raises(ValueError, match=r"gpu \(rocm 60300\)"):
        dali_loader.make_dali_loader(encoded(20), ROCM, 2)


def test_auto_backend_never_picks_dali_on_rocm_nor_rocal_on_cuda(monkeypatch):
    """refimpl.choose_backend on fake device lists, rocAL's and DALI's imports made to succeed
    or fail: only the device kind decides."""
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
    """Without normalize: Normalize(arithmetic=arithmetic_for(devices)), dali_gpu on NVIDIA GPUs
    (fake devices; the spec loader is caught before any device work), dali_cpu on CPU; an
    explicit dali_gpu is taken there and dali_cpu refused (negative control)."""
    seen = []

    def spec_loader(data, mesh, batch_size, **kwargs):
        seen.append(kwargs["normalize"])
        raise Stop

    monkeypatch.setattr(loaders, "data_mesh", lambda devices: types.SimpleNamespace(devices=np.array(devices)))
    monkeypatch.setattr(loaders, "make_loader", spec_loader)
    for devices, normalize in ((NVIDIA, None), (NVIDIA, Normalize(arithmetic="dali_gpu")), (CPU, None)):
        with pytest.raises(Stop):
            dali_loader.make_dali_loader(encoded(8), devices, 2, normalize=normalize)
    assert seen == [Normalize(arithmetic="dali_gpu")] * 2 + [Normalize(arithmetic="dali_cpu")]
    with pytest.raises(ValueError, match="compute arithmetic='dali_gpu'"):
        dali_loader.make_dali_loader(encoded(8), NVIDIA, 2, normalize=DALI)


def test_refimpl_takes_dali_gpu_on_nvidia_gpus():
    """refimpl's arithmetic for --backend dali: dali_gpu on NVIDIA GPUs, dali_cpu on CPU, an
    explicit --normalize kept; parse_args takes dali_gpu with --backend dali, refuses rocal."""
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


# --------------------------------------------------------------------------
# DALI's GPU arithmetic: read in the source (no GPU here), pinned
# --------------------------------------------------------------------------


def fma_float32(x: int, scale: np.float32, shift: np.float32) -> np.float32:
    """x*scale + shift exact, rounded once to float32 (ties to even), by integer arithmetic."""
    exact = Fraction(x) * Fraction(float(scale)) + Fraction(float(shift))
    if exact == 0:
        return np.float32(0)
    sign, exact = (-1 if exact < 0 else 1), abs(exact)
    e = exact.numerator.bit_length() - exact.denominator.bit_length() - 24
    while exact / Fraction(2) ** e >= 2**24:
        e += 1
    while exact / Fraction(2) ** e < 2**23:
        e -= 1
    return np.float32(sign * round(exact / Fraction(2) ** e) * Fraction(2) ** e)  # round(): half to even


@settings(max_examples=examples(6))
@given(st.lists(st.tuples(st.floats(0, 255, width=32), st.floats(0.5, 300, width=32)), min_size=1,
                max_size=3))
@example([(127.5, 127.5)] * 3)
@example([(0.0, 255.0)])
def test_dali_gpu_table_is_the_gpu_kernels_fma(mean_std):
    """READ, not run, in NVIDIA/DALI:

    * dali/operators/image/crop/new_crop_mirror_normalize.cu, GetImplementationKind: uint8 CHW
      input takes SliceFlipNormalizeGpuGeneric; GetNormParameters: inv_stddev = 1 / std in
      double, stored as float; mean stored as float.
    * dali/kernels/slice/slice_flip_normalize_gpu.cu, SetupParams: norm_add = -mean * inv_stddev,
      norm_mul = inv_stddev, both float.
    * dali/kernels/slice/slice_flip_normalize_gpu_impl.cuh, SliceNormalizeKernel_2D(_NoPad):
      fmaf(float(x), norm_mul[c], norm_add[c]), one rounding, for every channel count.

    So table[c, x] = fma(x, inv, -(mean*inv)), inv = f32(1/std) (a double quotient of floats
    rounded to float is the float quotient)."""
    mean, std = zip(*mean_std)
    table = normalize_table(mean, std, "dali_gpu")
    for c, (m, s) in enumerate(mean_std):
        inv = np.float32(1.0 / float(np.float32(s)))
        add = np.float32(-(np.float32(m) * inv))
        assert_same_bits(table[c], np.array([fma_float32(x, inv, add) for x in range(256)], np.float32),
                         f"channel {c}: mean {m}, std {s}")


def test_dali_gpu_and_dali_cpu_tables_differ_where_the_roundings_do():
    """The CPU kernel (slice_flip_normalize_permute_pad_cpu.h) rounds (x - mean), then the
    product: at mean = std = 127.5 that differs from the GPU's one rounding on 762 of 768
    entries; at MNIST's (0, 255) on none (x - 0 is exact). Both crop with the same anchor
    (CropAttr::CalculateAnchor); rocAL's rounds half to even (negative control)."""
    gpu = normalize_table((127.5,) * 3, (127.5,) * 3, "dali_gpu")
    cpu = normalize_table((127.5,) * 3, (127.5,) * 3, "dali_cpu")
    assert (gpu != cpu).sum() == 762
    np.testing.assert_array_equal(np.flatnonzero(gpu[0] == cpu[0]), [0, 32])
    x = np.arange(256, dtype=np.float32)
    assert_same_bits(cpu[0], (x - np.float32(127.5)) * (np.float32(1) / np.float32(127.5)), "dali_cpu")
    assert_same_bits(*[normalize_table((0.0,), (255.0,), a) for a in ("dali_gpu", "dali_cpu")], "MNIST's table")
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
                                 name=dali_loader.READER)
        pipe.set_outputs(fn.cast(raw, dtype=types_.FLOAT))
    pipe.build()
    return pipe


def test_to_jax_copies_only_where_dali_reuses_its_buffers(cache):
    """to_jax is what GPU outputs go through; DALI's TensorCPU speaks DLPack too, so CPU pipelines
    drive it. With the dynamic executor (DALI 2.x's default) an output is a new buffer DALI does
    not write again: wrapped. Without it DALI recycles its buffers: copied. Negative control:
    wrapping a recycled buffer loses the values."""
    folder = dali_loader.sample_files(*encoded(12), cache)
    cpu0 = cpu_devices(1)[0]

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

    first = np.arange(12).reshape(4, 3).tolist()  # each sample's first raw byte is its index
    assert outputs(exec_dynamic=True, buffers_reused=False) == (first, [True] * 4)
    assert outputs(exec_dynamic=False, buffers_reused=True) == (first, [False] * 4)
    values, wrapped = outputs(exec_dynamic=False, buffers_reused=False)
    assert all(wrapped) and values != first, values


def test_a_copy_from_a_recycled_buffer_is_complete_when_to_jax_returns():
    """buffers_reused=True: the copy is finished when to_jax returns, not merely enqueued (DALI
    may write the buffer at its next run). The device is kept busy so that an enqueued copy
    waits; the buffer is overwritten right after the call. Negative control: the same copy
    without the wait is still pending at return."""
    cpu0 = cpu_devices(1)[0]
    want = np.arange(1 << 18, dtype=np.float32)
    a = jax.device_put(jax.numpy.full((300, 300), 1 / 300, np.float32), cpu0)
    busy = jax.jit(lambda a: jax.lax.fori_loop(0, 60, lambda i, x: x @ a, a))  # about 80 ms
    busy(a).block_until_ready()

    def copied(convert):
        buffer = want.copy()  # DALI's output buffer; NumPy arrays speak DLPack as DALI's tensors do
        running = busy(a)
        got = convert(buffer)
        ready = got.is_ready()
        buffer[:] = -1  # DALI's next run
        running.block_until_ready()
        return ready, got

    unwaited = lambda b: jax.numpy.array(jax.dlpack.from_dlpack(b, device=cpu0, copy=None), copy=True)
    copied(unwaited)  # compiled out of the way
    ready, got = copied(lambda b: dali_loader.to_jax(types.SimpleNamespace(as_tensor=lambda: b), cpu0,
                                                      buffers_reused=True))
    assert ready, "to_jax returned before its copy was done"
    assert_same_bits(got, want, "to_jax's copy after DALI rewrote its buffer")
    assert not copied(unwaited)[0], "control: a copy that is not waited for was done at return"


def test_jax_from_dlpack_copy_true_still_wraps_a_cpu_buffer():
    """JAX 0.10.2 on CPU: from_dlpack(x, copy=True) returns an array on x's memory, whatever its
    docstring says: why to_jax copies with jnp.array. If this fails, copy=True now copies."""
    x = aligned_empty((256,), np.float32)
    x[:] = 0
    wrapped = jax.dlpack.from_dlpack(x, device=cpu_devices(1)[0], copy=True)
    x[:] = 7
    assert wrapped.unsafe_buffer_pointer() == x.ctypes.data and float(wrapped[0]) == 7


def test_the_loaders_pipelines_use_the_dynamic_executor(cache, monkeypatch):
    """DALI 2.x's default executor is dynamic, and the backend keeps it: to_jax wraps, never
    copies, on the pipeline's own device."""
    Pipeline, _, _ = dali_loader.import_dali()
    assert Pipeline(batch_size=1, num_threads=1, device_id=None).exec_dynamic is True
    seen, real = [], dali_loader.to_jax
    monkeypatch.setattr(dali_loader, "to_jax", lambda t, d, buffers_reused: seen.append(buffers_reused)
                        or real(t, d, buffers_reused=buffers_reused))
    loader, _ = pair(20, 2, 2, cache)
    assert len(list(loader.epoch(0))) == 5 and seen == [False] * 10


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
    """GPU pipelines compute the "dali_gpu" table's bits (at mean = std = 127.5 it differs from
    "dali_cpu" on 762 of 768 entries, so the CPU table would fail)."""
    gpus = nvidia_gpus()[:8]  # asked here, not at import: the worker sets its devices first
    if not gpus:
        pytest.skip("needs an NVIDIA GPU: JAX sees none here")
    N, B = 37 * len(gpus), 4
    run = dict(layout=layout, normalize=Normalize(arithmetic="dali_gpu"), shuffle=order == "plan", seed=3)
    loader = dali_loader.make_dali_loader(encoded(N), gpus, B, cache_dir=cache, order=order, **run)
    assert dali_loader.usable(gpus) and "GPU pipeline(s)" in loader.describe()
    reference = loaders.make_loader(encoded(N), gpus, B, prefetch=0, **run)
    for epoch in range(2):
        check_epoch(list(loader.epoch(epoch)), reference, epoch, 0, order, f"GPU {layout}")


# --------------------------------------------------------------------------
# Several processes, and refimpl.py end to end (--run-slow)
# --------------------------------------------------------------------------


def worker(out_dir: str, coordinator: str, process_id: int) -> None:
    """One of two jax.distributed processes, 4 CPU devices each: order="plan" loaders on a
    contiguous and an interleaved mesh, every local shard against the reference: epoch 1, and
    epoch 0 resumed from a state saved on 3 shards of 5."""
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=process_id,
                               initialization_timeout=60, heartbeat_timeout_seconds=30,
                               coordinator_bind_address=coordinator)
    every = jax.devices()
    mine = [[d for d in every if d.process_index == p] for p in range(2)]
    meshes = {"contiguous": every, "interleaved": [d for pair_ in zip(*mine) for d in pair_]}
    N, B = 101, 3
    compared = 0
    for (name, devices), (last_batch, layout) in zip(meshes.items(), [("fill", "sharded"), ("drop", "pmap")]):
        run = dict(layout=layout, shuffle=True, seed=9, last_batch=last_batch, normalize=DALI)
        loader = dali_loader.make_dali_loader(encoded(N), devices, B, cache_dir=out_dir, **run)
        reference = loaders.make_loader(encoded(N), devices, B, prefetch=0, **run)
        saved = LoaderState.start(N, 3, 5, epoch=0, seed=9, shuffle=True, last_batch=last_batch).at_step(2)
        for epoch, state in ((1, None), (0, saved)):
            for got, want in zip(loader.epoch(epoch, state=state), reference.epoch(epoch, state=state), strict=True):
                for field in want:
                    assert got[field].sharding == want[field].sharding, (name, field)
                    mine_got = {s.device: np.asarray(s.data) for s in got[field].addressable_shards}
                    for s in want[field].addressable_shards:  # bit for bit, without conftest
                        a, b = mine_got[s.device], np.asarray(s.data)
                        assert a.dtype == b.dtype and a.shape == b.shape and \
                            np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{name} epoch {epoch} {field}"
                        compared += 1
    with open(os.path.join(out_dir, f"done-{process_id}.json"), "w") as f:
        json.dump({"compared": compared}, f)
    jax.distributed.shutdown()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_read_the_plan_bit_for_bit(tmp_path):
    """Two jax.distributed processes (worker above): each local shard is the reference's."""
    import refimpl
    coordinator = f"127.0.0.1:{refimpl.loopback_port('coordinator')}"
    here = os.path.dirname(os.path.abspath(__file__))
    results = run_children([[sys.executable, os.path.abspath(__file__), str(tmp_path), coordinator, str(i)]
                            for i in range(2)], timeout=120, cwd=here, grace=10)
    for i, (code, out, err) in enumerate(results):
        assert code == 0, f"process {i} exited {code}:\n{err[-3000:]}"
    # N=101 on 8 shards of 3: fill 5 steps, drop 4; resumed from 3 x 5 at step 2: 3 and 2 steps.
    # 5 fields on 4 local devices a step.
    for i in range(2):
        assert json.loads((tmp_path / f"done-{i}.json").read_text())["compared"] == 20 * (5 + 3 + 4 + 2)


@pytest.mark.slow
def test_refimpl_dali_and_reference_resize_to_identical_params(tmp_path):
    """refimpl.py: 4 devices stop after 2 run steps, 3 resume; DALI (shuffled) and the reference,
    same seed and --normalize, each report every sample of the interrupted epoch delivered
    exactly once across the change, and end with the very same (trained) params."""
    data = synthetic_cifar10(tmp_path / "data", num_train=96, num_test=16, seed=2)
    common = ["--data-dir", data, "--cache-dir", str(tmp_path), "--epochs", "1", "--batch-size", "4",
              "--eval-batch-size", "16", "--strategies", "sharded", "--normalize", "dali_cpu", "--seed", "5",
              "--hidden", "64,64"]
    backends = ("dali", "reference")
    outputs = refimpl_resized(tmp_path, backends, common, ["--devices", "4", "--stop-after-step", "2"],
                              ["--devices", "3"])
    dali = outputs["dali"]
    assert "NVIDIA DALI" in dali and "3 CPU pipeline(s)" in dali and "dali_cpu's arithmetic" in dali, dali
    assert "segments [(0, 4, 4), (2, 3, 4)]" in dali, dali
    for backend, out in outputs.items():
        assert exactly_once(out) == ["sharded epoch 0, counted by sample index over the runs that delivered it: "
                                     "every one of the 96 samples delivered exactly once"], out
    assert_same_params(tmp_path, backends, 7)  # 6 params, 1 SGD state
    import model
    initial = np.asarray(jax.tree.leaves(model.init_model((3072, 64, 64, 10)))[0])
    assert bits_differ(np.load(tmp_path / "dali.npz")["sharded/0"], initial), "the params did not train"


# conftest's two resizes (this file is also a worker program, run without conftest).
RESIZES_2048 = getattr(sys.modules.get("conftest"), "RESIZES_2048", [])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name, stop, resume, before, after",
                         [pytest.param(*r, id=r[0].replace(" ", "")) for r in RESIZES_2048])
def test_refimpl_resizes_through_dali(tmp_path, name, stop, resume, before, after):
    """--backend dali and --backend reference (same seed, --normalize dali_cpu, synthetic CIFAR-10
    of 2048, batch 16, 2 epochs, the sharded strategy, hidden layers of 64: the loader's claim)
    stop at run step 7 and resume on other devices or processes: each reports exactly once across
    the change, with the same params."""
    common = ["--cache-dir", str(tmp_path / "cache"), "--epochs", "2", "--strategies", "sharded",
              "--normalize", "dali_cpu", "--hidden", "64,64"]
    backends = ("dali", "reference")
    outputs = refimpl_resized(tmp_path, backends, common, stop + ["--stop-after-step", "7"], resume, timeout=600)
    for out in outputs.values():
        assert f"(written on {before}" in out and f"this run: {after}" in out, out
        lines = exactly_once(out)
        assert lines == ["sharded epoch 0, counted by sample index over the runs that delivered it: every one "
                         "of the 2048 samples delivered exactly once"], out
    assert_same_params(tmp_path, backends, 7)  # 6 params, 1 SGD state


@pytest.mark.slow
@pytest.mark.multiprocess
def test_refimpl_two_processes_dali_and_reference_identical_params(tmp_path):
    """--local-processes 2 --epochs 2 (hidden layers of 64): DALI's params are the reference's, bit for bit."""
    here = os.path.dirname(os.path.abspath(__file__))
    data = synthetic_cifar10(tmp_path / "data", num_train=512, num_test=64, seed=2)
    for backend in ("dali", "reference"):  # one after the other: 2 processes each
        [(code, out, err)] = run_children([[
            sys.executable, os.path.join(here, "refimpl.py"), "--backend", backend, "--normalize", "dali_cpu",
            "--local-processes", "2", "--epochs", "2", "--hidden", "64,64", "--data-dir", data,
            "--cache-dir", str(tmp_path),
            "--params-out", str(tmp_path / f"{backend}.npz")]], timeout=300, cwd=here)
        assert code == 0, f"{backend}:\n{err[-3000:]}"
        assert "OUTSIDE" not in out, out
    assert_same_params(tmp_path, ("dali", "reference"), 14)


@pytest.mark.slow
def test_params_out_is_checked_before_any_work(tmp_path, capsys):
    """refimpl.py refuses a --params-out it could not write before any work."""
    import refimpl

    for path, why in ((tmp_path / "missing" / "p.npz", "does not exist"), (tmp_path, "is a directory")):
        with pytest.raises(SystemExit) as info:
            refimpl.parse_args(["--params-out", str(path)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and f"--params-out {path}: " in err and why in err, err


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
