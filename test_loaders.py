"""Property tests for loaders.py, delivery onto devices: each guarantee its docstrings
state, checked.

* The Loader's global arrays have the documented shape, dtype and sharding, and
  row block k, on the device at mesh position k, is shard k's batch (on a
  permuted mesh too; one device gives plain arrays); global_batch puts block k,
  NumPy or on another device, on mesh position k; data_mesh keeps the given
  order; split_rows gives block j to the jth position.
* Every placement gives the same bits: bit-identical epochs on 1, 3 and 8
  devices in both layouts; the host and device paths (device_normalize) give
  the tables' bits; every table cache is keyed by the bits, so a zero's sign and
  values that are not doubles reach every placement and layout (negative
  controls: the old float keying is caught); equal means with different stds
  keep one table row per channel. "device" holds shard k on device k and
  refuses a dataset over its budget (device_fit: sized by the largest shard).
* The epoch: its length, and real_samples, are what the masks deliver; uneven
  shards refuse a batch larger than the smallest; resuming at step s yields
  steps s.. of the full epoch; bad arguments are refused naming the value.
* MNIST through the loader, with the DALI notebook's normalisation.
* Prefetching re-raises worker errors, leaves no thread behind, and does not
  change the batches.

Resumes on other devices: test_loaders_resume.py; any dataset of named arrays:
test_loaders_any_data.py.
"""

import dataclasses
import gc
import threading

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import arithmetic
import loaders
from arithmetic import ARITHMETICS, Normalize, crop_mirror_normalize, normalize_table, table_key
from cifar_mnist import read_cifar10
from conftest import (EPOCHS, NOT_DOUBLES, POLICIES, SEEDS, assert_raises_naming, assert_same_bits, bits_differ,
                      crop_cases, examples, expected_steps, random_mnist, text_normalize_table)
from plan import LAST_BATCH_POLICIES, epoch_plan, num_steps, shard_bounds


# --------------------------------------------------------------------------
# The loader: global arrays, one row block per mesh position
# --------------------------------------------------------------------------

B = 8  # per device; fixed so every array the loader builds has one shape


@pytest.fixture(scope="module")
def cifar(synthetic_dir):
    return read_cifar10(synthetic_dir)


def blocks_by_position(array: jax.Array, device_order) -> dict:
    """{mesh position k: (index, host data)} of each shard, keyed by where it lives."""
    position = {device: k for k, device in enumerate(device_order)}
    return {position[s.device]: (s.index, np.asarray(s.data)) for s in array.addressable_shards}


def expected_block(cifar, plan, step: int, k: int, mirror: bool = False) -> dict:
    """Shard k's batch at ``step``, built from the plan and the files directly."""
    images, labels = cifar
    idx = plan.indices[step, k]
    return {"images": crop_mirror_normalize(images[idx], mirror=mirror, mean=(127.5,) * 3,
                                                    std=(127.5,) * 3),
            "labels": labels[idx], "mask": plan.mask[step, k], "index": idx.astype(np.int32),
            "logical_shards": np.array([k], np.int32)}


def check_batch(batch, cifar, plan, step, device_order, layout, mirror=False):
    """Shapes, dtypes, sharding and every device's block of one global batch."""
    n = len(device_order)
    mesh = loaders.data_mesh(device_order)
    rows = (n * B,) if layout == "sharded" else (n, B)
    one = (n,) if layout == "sharded" else (n, 1)  # a logical shard a device
    shapes = {"images": rows + (3, 32, 32), "labels": rows, "mask": rows, "index": rows, "logical_shards": one}
    dtypes = {"images": np.float32, "labels": np.int32, "mask": np.bool_, "index": np.int32,
              "logical_shards": np.int32}
    assert list(batch) == ["images", "labels", "mask", "index", "logical_shards"], list(batch)
    for name, array in batch.items():
        assert array.shape == shapes[name] and array.dtype == dtypes[name], name
        assert array.sharding == NamedSharding(mesh, P("data")), name
        blocks = blocks_by_position(array, device_order)
        assert sorted(blocks) == list(range(n))
        for k, (index, data) in blocks.items():
            want = expected_block(cifar, plan, step, k, mirror)[name]
            if layout == "sharded":
                size = 1 if name == "logical_shards" else B
                assert index[0] == slice(k * size, (k + 1) * size)
            else:
                assert index[0] == slice(k, k + 1)
                data = data[0]
            np.testing.assert_array_equal(data, want, err_msg=f"{name}, block {k}")


@given(st.integers(0, 4), st.integers(0, 14), SEEDS, st.booleans(), POLICIES,
       st.sampled_from(loaders.LAYOUTS), st.booleans(), st.sampled_from(loaders.PLACEMENTS))
def test_loader_blocks_follow_the_plan(devices, synthetic_dir, cifar, epoch, step, seed, shuffle,
                                       last_batch, layout, mirror, placement):
    # Every placement against the same spec: so the three give bit-identical batches.
    loader = loaders.make_loader(synthetic_dir, devices, B, layout=layout, shuffle=shuffle,
                                 seed=seed, last_batch=last_batch, placement=placement,
                                 normalize=Normalize(mirror=mirror))
    plan = epoch_plan(len(cifar[1]), len(devices), B, epoch=epoch, seed=seed,
                              shuffle=shuffle, last_batch=last_batch)
    assert len(loader) == plan.indices.shape[0]
    step %= len(loader)
    check_batch(loader.batch(epoch, step), cifar, plan, step, devices, layout, mirror)


@pytest.mark.parametrize("count", [1, 3, 8])
@given(seed=SEEDS, epoch=EPOCHS, shuffle=st.booleans(), last_batch=POLICIES,
       layout=st.sampled_from(loaders.LAYOUTS), size=st.sampled_from([29, 100, 203]))
@settings(max_examples=examples(8))
def test_placements_give_bit_identical_epochs(devices, cifar, count, seed, epoch, shuffle,
                                              last_batch, layout, size):
    if count > len(devices):
        pytest.skip(f"needs {count} devices")
    data = (cifar[0][:size], cifar[1][:size])
    batch_size = min(3, size // count)
    norm = Normalize(crop=(29, 30), crop_pos=(0.5, 0.25), mirror=bool(seed % 2),
                             arithmetic=("rocal", "dali_cpu")[seed % 3 == 0])
    epochs = {p: [jax.tree.map(np.asarray, b) for b in loaders.make_loader(
        data, devices[:count], batch_size, layout=layout, shuffle=shuffle, seed=seed,
        last_batch=last_batch, normalize=norm, placement=p).epoch(epoch)] for p in loaders.PLACEMENTS}
    steps = num_steps(size, count, batch_size, last_batch)
    for p, batches in epochs.items():
        assert len(batches) == steps, p
        for s, (got, want) in enumerate(zip(batches, epochs["host_float32"])):
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{p} step {s} {name}")


def test_device_placement_holds_shard_k_on_device_k(devices, cifar):
    images, labels = cifar[0][:203], cifar[1][:203]
    order = devices[::-1][:3]  # not the default devices, and reversed
    loader = loaders.make_loader((images, labels), order, 4, placement="device")
    size = -(-203 // 3)
    for name, source in (("images", images), ("labels", labels)):
        array = loader.resident[name]
        assert array.shape[0] == 3 * size
        for shard in array.addressable_shards:
            k = order.index(shard.device)
            start, stop = shard_bounds(203, k, 3)
            np.testing.assert_array_equal(np.asarray(shard.data)[:stop - start], source[start:stop])
    batch = loader.batch(0, 0)
    assert {s.device for s in batch["images"].addressable_shards} == set(order)


def test_device_placement_refuses_a_dataset_over_the_budget(devices, cifar):
    per_device = -(-len(cifar[1]) // len(devices)) * (3072 + 4)
    assert_raises_naming(ValueError, lambda: loaders.make_loader(
        cifar, devices, B, placement="device", device_budget=per_device - 1),
        "placement='device'", "over the budget", "placement='host'")
    loaders.make_loader(cifar, devices, B, placement="device", device_budget=per_device)  # fits exactly


def test_data_mesh_keeps_the_given_order(devices):
    for order in (devices[::-1], devices[1::2] + devices[::2]):
        assert list(loaders.data_mesh(order).devices.flat) == list(order)


def test_split_rows_gives_block_j_to_the_jth_position():
    rows = {"mask": np.arange(6), "labels": np.arange(6) * 10}
    blocks = loaders.split_rows(rows, [5, 1, 3])  # a process's positions, as listed
    assert list(blocks) == [5, 1, 3]
    np.testing.assert_array_equal(blocks[5]["mask"], [0, 1])
    np.testing.assert_array_equal(blocks[1]["mask"], [2, 3])
    np.testing.assert_array_equal(blocks[3]["labels"], [40, 50])


def test_uneven_shards_refuse_a_batch_larger_than_the_smallest(devices, cifar):
    data = (cifar[0][:17], cifar[1][:17])  # shards of 2 and 3 samples on 8 devices
    assert_raises_naming(ValueError, lambda: loaders.make_loader(data, devices[:8], 3, last_batch="drop"),
                         "batch_size=3", "smallest shard (2 samples")
    assert len(loaders.make_loader(data, devices[:8], 2, last_batch="drop")) == 1


def test_loader_epoch_length(devices, synthetic_dir, cifar):
    N, n = len(cifar[1]), len(devices)
    for last_batch in LAST_BATCH_POLICIES:
        loader = loaders.make_loader(synthetic_dir, devices, B, last_batch=last_batch)
        assert len(loader) == expected_steps(N, n, B, last_batch)
        delivered = [int(np.asarray(batch["mask"]).sum()) for batch in loader.epoch(0)]
        assert len(delivered) == len(loader)
        # real_samples (what refimpl's images/s divides) is what the masks deliver:
        # every sample once with fill, n * steps * B with drop.
        assert loader.real_samples(0) == sum(delivered)
        assert sum(delivered) == (N if last_batch == "fill" else n * len(loader) * B)


def test_permuted_mesh_puts_shard_k_on_the_kth_device(devices, synthetic_dir, cifar):
    order = devices[1::2] + devices[::2]
    assert [d.id for d in order] != sorted(d.id for d in order)
    loader = loaders.make_loader(synthetic_dir, order, B, shuffle=True, seed=3)
    assert list(loader.mesh.devices.flat) == order
    plan = epoch_plan(len(cifar[1]), len(order), B, epoch=1, seed=3, shuffle=True)
    check_batch(loader.batch(1, 2), cifar, plan, 2, order, "sharded")


def test_single_device_gives_plain_arrays(devices, cifar):
    images, labels = cifar[0][:40], cifar[1][:40]
    loader = loaders.make_loader((images, labels), devices[:1], B)
    batch = loader.batch(0, 1)
    assert batch["images"].shape == (B, 3, 32, 32) and batch["labels"].shape == (B,)
    assert all(a.sharding.device_set == {devices[0]} for a in batch.values())
    want = expected_block((images, labels), loader.plan(0), 1, 0)
    for name in want:
        np.testing.assert_array_equal(np.asarray(batch[name]), want[name])


@given(st.integers(0, 3), st.integers(0, 16), SEEDS, st.booleans())
def test_resume_yields_the_rest_of_the_epoch(devices, synthetic_dir, epoch, start, seed, shuffle):
    loader = loaders.make_loader(synthetic_dir, devices, B, shuffle=shuffle, seed=seed)
    start = min(start, len(loader))
    full = list(loader.epoch(epoch))
    rest = list(loader.epoch(epoch, start_step=start))
    assert len(rest) == len(full) - start
    for got, want in zip(rest, full[start:]):
        for name in want:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))


def test_resume_outside_the_epoch_is_an_error(devices, synthetic_dir):
    loader = loaders.make_loader(synthetic_dir, devices, B)
    for start in (-1, len(loader) + 1):
        assert_raises_naming(IndexError, lambda: loader.epoch(0, start_step=start),
                             f"start_step={start}")


def test_loader_errors(devices, synthetic_dir, cifar):
    smallest = len(cifar[1]) // len(devices)

    def make(devices=devices, batch_size=B, **kwargs):
        return lambda: loaders.make_loader(synthetic_dir, devices, batch_size, **kwargs)

    assert_raises_naming(ValueError, make(batch_size=0), "batch_size", "got 0")
    assert_raises_naming(ValueError, make(batch_size=smallest + 1),
                         f"batch_size={smallest + 1}", f"({smallest} samples")
    assert_raises_naming(ValueError, make(devices=[devices[0], devices[1], devices[0]]), "twice")
    grid = jax.sharding.Mesh(np.array(devices[:2]).reshape(1, 2), ("data", "model"))
    assert_raises_naming(ValueError, make(devices=grid), "'data'")
    assert_raises_naming(ValueError, make(layout="rows"), "'rows'")
    assert_raises_naming(ValueError, make(last_batch="pad"), "'pad'")


def test_mnist_through_the_loader_with_the_dali_notebooks_normalisation(devices, tmp_path):
    images, labels = random_mnist(3, 60)
    norm = Normalize(mean=(0.0,), std=(255.0,), arithmetic="dali_cpu")
    loader = loaders.make_loader((images, labels), devices[:3], 4, normalize=norm)
    batch = loader.batch(0, 1)
    assert batch["images"].shape == (12, 1, 28, 28)
    plan = loader.plan(0)
    want = norm(images[plan.indices[1].reshape(-1)])
    np.testing.assert_array_equal(np.asarray(batch["images"]), want)
    # x * float32(1/255), not x / 255: DALI's bits.
    assert not np.array_equal(want, images[plan.indices[1].reshape(-1)] / np.float32(255))
    with pytest.raises(ValueError, match="need 1 entries"):
        loaders.make_loader((images, labels), devices[:3], 4)  # the 3-channel default


# --------------------------------------------------------------------------
# Prefetching
# --------------------------------------------------------------------------


class FailsAtStep:
    """A normalize that raises on the first image block of ``step``."""

    def __init__(self, step: int, num_shards: int):
        self.calls, self.first_bad_call = 0, step * num_shards

    def __call__(self, images_NCHW):
        self.calls += 1
        if self.calls > self.first_bad_call:
            raise RuntimeError("normalize failed on purpose")
        return Normalize()(images_NCHW)


def prefetch_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "loader-prefetch" and t.is_alive()]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_worker_error_reaches_the_consumer(devices, synthetic_dir, prefetch):
    loader = loaders.make_loader(synthetic_dir, devices, B, prefetch=prefetch, placement="host_float32")
    loader = dataclasses.replace(loader, normalize=FailsAtStep(2, len(devices)))
    received = 0
    with pytest.raises(RuntimeError, match="on purpose"):
        for _ in loader.epoch(0):
            received += 1
    assert received == 2
    assert not prefetch_threads()


def test_leaving_an_epoch_early_stops_the_worker(devices, synthetic_dir):
    loader = loaders.make_loader(synthetic_dir, devices, B, prefetch=2)
    batches = loader.epoch(0)
    next(batches)
    assert prefetch_threads(), "the worker should be running mid-epoch"  # the check can see it
    batches.close()
    assert not prefetch_threads()

    for _ in loader.epoch(1):
        break
    gc.collect()
    assert not prefetch_threads()


def test_prefetch_does_not_change_the_batches(devices, synthetic_dir):
    loader = loaders.make_loader(synthetic_dir, devices, B, shuffle=True, seed=5, prefetch=2)
    eager = dataclasses.replace(loader, prefetch=0)
    pairs = list(zip(loader.epoch(2), eager.epoch(2), strict=True))
    assert len(pairs) == len(loader)
    for ahead, now in pairs:
        for name in ahead:
            np.testing.assert_array_equal(np.asarray(ahead[name]), np.asarray(now[name]))


# --------------------------------------------------------------------------
# The host and device paths: the tables' bits
# --------------------------------------------------------------------------


@given(crop_cases(), st.sampled_from(ARITHMETICS))
@settings(max_examples=examples(10))
def test_host_and_device_paths_give_the_tables_bits(case, arithmetic):
    images, crop, crop_pos, mirror, mean, std = case
    flip = bool(mirror[0])
    norm = Normalize(mean=tuple(mean), std=tuple(std), mirror=flip, crop=crop,
                             crop_pos=crop_pos, arithmetic=arithmetic)
    host = norm(images)
    y0, x0, ch, cw = norm.window(images.shape[2:])
    window = images[:, :, y0:y0 + ch, x0:x0 + cw]
    window = window[..., ::-1] if flip else window
    lookup = norm.table[np.arange(3)[None, :, None, None], window]
    np.testing.assert_array_equal(host, lookup)
    cpu = jax.devices("cpu")[0]
    device = loaders.device_normalize(jax.device_put(images, cpu), jax.device_put(norm.table, cpu),
                                      norm.window(images.shape[2:]), flip)
    np.testing.assert_array_equal(np.asarray(device), host)


# --------------------------------------------------------------------------
# Every cache keyed by what determines the bits: a zero's sign reaches every placement
# --------------------------------------------------------------------------

SIGNED_ZERO_PAIRS = {  # (first, then): tables that differ only in the sign of a zero
    "one channel": (Normalize(mean=(0.0,), std=(-2.0,)), Normalize(mean=(-0.0,), std=(-2.0,))),
    "three channels": (Normalize(mean=(0.0,) * 3, std=(-1.0,) * 3),
                       Normalize(mean=(0.0, -0.0, 0.0), std=(-1.0,) * 3)),
}


def every_value_images(count: int, channels: int) -> np.ndarray:
    """uint8 (count, channels, 16, 16): every image channel holds each value 0..255 once."""
    base = np.arange(256).reshape(16, 16)
    return np.stack([[np.roll(base, i + c) for c in range(channels)] for i in range(count)]).astype(np.uint8)


def placements_disagree(devices, norm: Normalize, layout: str) -> list[str]:
    """Where a batch of each placement differs from normalize_table's bits."""
    channels = len(norm.mean)
    images = every_value_images(8, channels)
    table = normalize_table(norm.mean, norm.std, norm.arithmetic)
    found = []
    for placement in loaders.PLACEMENTS:
        loader = loaders.make_loader((images, np.arange(8)), devices[:4], 2, layout=layout, normalize=norm,
                                     placement=placement)
        idx = loader.plan(0).indices[0].reshape(-1)
        want = table[np.arange(channels)[None, :, None, None], images[idx]]
        got = np.asarray(loader.batch(0, 0)["images"]).reshape(want.shape)
        why = bits_differ(got, want)
        if why:
            found.append(f"{placement}: {why}")
    return found


@pytest.mark.parametrize("layout", loaders.LAYOUTS)
@pytest.mark.parametrize("case", SIGNED_ZERO_PAIRS)
def test_a_zeros_sign_reaches_every_placement_and_layout(devices, case, layout):
    # The +0.0 loader first: a cache keyed by (mean, std) floats would then serve its
    # table to the -0.0 one (-0.0 == 0.0), and "host"/"device" would give +0.0.
    first, then = SIGNED_ZERO_PAIRS[case]
    tables = [normalize_table(n.mean, n.std, n.arithmetic) for n in (first, then)]
    assert bits_differ(tables[0], tables[1]) and (tables[0] == tables[1]).all()  # the sign alone differs
    for norm in (first, then):
        assert not placements_disagree(devices, norm, layout), placements_disagree(devices, norm, layout)


def test_the_old_keying_is_caught(devices, monkeypatch):
    # Negative controls for the test above. A table cache keyed by floats (as before):
    # the -0.0 loader gets the +0.0 table on the devices.
    real = loaders._replicated_table.__wrapped__
    by_floats = {}

    def float_keyed(key, mesh):
        floats = (tuple(np.frombuffer(key[0], np.float32).tolist()),
                  tuple(np.frombuffer(key[1], np.float32).tolist()), key[2], mesh)
        return by_floats.setdefault(floats, real(key, mesh))

    first, then = SIGNED_ZERO_PAIRS["one channel"]
    with monkeypatch.context() as patch:
        patch.setattr(loaders, "_replicated_table", float_keyed)
        assert not placements_disagree(devices, first, "sharded")
        found = placements_disagree(devices, then, "sharded")
    assert [f.split(":")[0] for f in found] == ["host", "device"], found
    # Rows compared as floats, not bits: the three-channel table collapses to its
    # first row, in every placement (the host's crop_mirror_normalize too).
    with monkeypatch.context() as patch:
        by_value = lambda table: bool((table == table[:1]).all())
        patch.setattr(arithmetic, "one_row", by_value)  # the host's crop_mirror_normalize
        patch.setattr(loaders, "one_row", by_value)  # the devices' tables
        loaders._replicated_table.cache_clear()  # tables placed before were built with the real one_row
        try:
            found = placements_disagree(devices, SIGNED_ZERO_PAIRS["three channels"][1], "sharded")
        finally:
            loaders._replicated_table.cache_clear()  # and the collapsed ones must not outlive the patch
    assert [f.split(":")[0] for f in found] == list(loaders.PLACEMENTS), found
    # The keys themselves: equal as floats (and hash alike), different as bits.
    assert (0.0,) == (-0.0,) and hash((0.0,)) == hash((-0.0,))
    assert table_key((0.0,), (-2.0,), "rocal", "") != table_key((-0.0,), (-2.0,), "rocal", "")
    assert first != then and first == Normalize(mean=(0.0,), std=(-2.0,))


@pytest.mark.parametrize("mean, std", NOT_DOUBLES[:1] + NOT_DOUBLES[-1:])
def test_values_that_are_not_doubles_give_the_same_bits_in_every_placement(devices, mean, std):
    norm = Normalize(mean=mean, std=std)
    assert not placements_disagree(devices, norm, "sharded")
    assert_same_bits(norm.table.view(np.uint32), np.array(text_normalize_table(mean, std, "rocal"), np.uint32))


# --------------------------------------------------------------------------
# Sentences of the spec that only another module's tests held (issue 18's mutants)
# --------------------------------------------------------------------------


def test_device_fit_is_sized_by_the_largest_shard(devices):
    # 7 samples over 2 devices: shards of 3 and 4; each device holds 4 samples of
    # (1 + 4 label) bytes = 20 bytes, so 19 bytes must not fit.
    mesh = loaders.data_mesh(devices[:2])
    assert loaders.device_fit(7, (1, 1, 1), mesh, device_budget=20) is None
    assert "4 samples" in loaders.device_fit(7, (1, 1, 1), mesh, device_budget=19)


@pytest.mark.parametrize("placement", ["host", "device"])
def test_equal_means_with_different_stds_keep_one_table_row_per_channel(devices, cifar, placement):
    # The device table may collapse to one row only when every channel's row is equal;
    # equal means with different stds are three different rows.
    norm = Normalize(mean=(120.0, 120.0, 120.0), std=(30.0, 60.0, 90.0))
    data = (cifar[0][:64], cifar[1][:64])
    want = loaders.make_loader(data, devices[:2], 4, normalize=norm, placement="host_float32").batch(0, 1)
    got = loaders.make_loader(data, devices[:2], 4, normalize=norm, placement=placement).batch(0, 1)
    np.testing.assert_array_equal(np.asarray(got["images"]), np.asarray(want["images"]))
    host = norm(cifar[0][:4])
    for c in range(3):  # and on the host path: each channel its own row
        np.testing.assert_array_equal(host[:, c], norm.table[c][cifar[0][:4, c]])
    assert not (norm.table[0] == norm.table[1]).all()  # control: the rows really differ


@pytest.mark.parametrize("layout", loaders.LAYOUTS)
def test_global_batch_puts_block_k_on_mesh_position_k(devices, layout):
    # loaders.global_batch's own guarantee, held here (not only through a vendor's tests):
    # block k, NumPy or a jax.Array on another device, lands on the kth device of the mesh.
    order = [devices[2], devices[0], devices[3]]
    mesh = loaders.data_mesh(order)
    blocks = {k: {"labels": np.full(2, 10 * k, np.int32), "mask": np.array([True, k != 1])}
              for k in range(3)}
    blocks[2]["labels"] = jax.device_put(blocks[2]["labels"], devices[1])  # elsewhere: copied over
    out = loaders.global_batch(blocks, mesh, layout)
    want_shape = (6,) if layout == "sharded" else (3, 2)
    assert out["labels"].shape == want_shape and out["labels"].sharding == NamedSharding(mesh, P("data"))
    for shard in out["labels"].addressable_shards:
        k = order.index(shard.device)
        np.testing.assert_array_equal(np.asarray(shard.data).ravel(), [10 * k] * 2)
    np.testing.assert_array_equal(np.asarray(out["mask"]).ravel(), [True, True, True, False, True, True])
    with pytest.raises(ValueError, match=r"no block for the local shards \[1\]"):
        loaders.global_batch({0: blocks[0], 2: blocks[2]}, mesh, layout)


# --------------------------------------------------------------------------
# Logical shards: the same global batch on every device count that divides L
# --------------------------------------------------------------------------


def test_logical_shards_give_the_same_global_batch_on_every_device_count(devices):
    # make_loader(logical_shards=L): device k of n reads logical shards k*L/n.., so every
    # step's global batch (rows, values, mask) is the same for n = 1, 2, 8, in every
    # placement and layout, and it is plan.on_devices(loader.plan(e), n)'s.
    N, L, b = 103, 8, 3
    data = {"x": np.arange(N, dtype=np.int32), "y": np.arange(2 * N, dtype=np.float32).reshape(N, 2)}
    want = None
    for n in (1, 2, 8):
        for placement in loaders.PLACEMENTS:
            for layout in loaders.LAYOUTS:
                loader = loaders.make_loader(data, devices[:n], b, logical_shards=L, shuffle=True, seed=5,
                                             placement=placement, layout=layout)
                assert loader.num_shards == L and loader.device_rows == L // n * b and len(loader) == 5
                got = [{k: np.asarray(v).reshape((-1,) + np.shape(v)[2 if layout == "pmap" else 1:])
                        for k, v in batch.items()} for batch in loader.epoch(1)]
                plan = loader.plan(1)
                indices = plan.indices.reshape(len(got), L * b).astype(np.int32)
                assert_same_bits(np.array([g["x"] for g in got]), indices)
                assert_same_bits(np.array([g["index"] for g in got]), indices)
                for g in got:
                    assert_same_bits(g["logical_shards"], np.arange(L, dtype=np.int32), "the plan's L, every n")
                assert_same_bits(np.array([g["mask"] for g in got]), plan.mask.reshape(len(got), L * b))
                if want is None:
                    want = got
                for s, (g, w) in enumerate(zip(got, want)):
                    for key in g:
                        assert_same_bits(g[key], w[key], f"n={n} {placement} {layout} step {s} {key}")


def test_logical_shards_resume_on_other_devices_without_a_resize(devices):
    # A state taken on 8 devices with L = 8 resumes on 2 with L = 8: the same plan (one
    # segment), the same batches from its step; the control: without logical shards the
    # 2-device loader's state is of 2 shards, a resize (a new segment).
    data = {"x": np.arange(103, dtype=np.int32)}
    eight = loaders.make_loader(data, devices, 3, logical_shards=8, shuffle=True, seed=5)
    full = [np.asarray(batch["x"]) for batch in eight.epoch(0)]
    saved = eight.state(0, 2)
    two = loaders.make_loader(data, devices[:2], 3, logical_shards=8, shuffle=True, seed=5)
    rest = [np.asarray(batch["x"]) for batch in two.epoch(0, state=saved)]
    assert len(rest) == len(full) - 2
    for s, (got, want) in enumerate(zip(rest, full[2:])):
        assert_same_bits(got, want, f"step {s + 2}")
    assert two.state(0, 3, state=saved).segments == saved.segments
    plain = loaders.make_loader(data, devices[:2], 3, shuffle=True, seed=5)
    assert len(plain.state(0, 3, state=saved).segments) == 2


def test_logical_shards_refuse_a_device_count_that_does_not_divide(devices):
    data = {"x": np.arange(103, dtype=np.int32)}
    for bad in (7, 3.0, True, 0, "8"):
        assert_raises_naming(ValueError, lambda bad=bad: loaders.make_loader(data, devices[:2], 3, logical_shards=bad),
                             f"logical_shards={bad!r}")
    assert_raises_naming(ValueError, lambda: loaders.make_loader(data, devices[:3], 3, logical_shards=8),
                         "logical_shards=8", "3 device(s)")
    assert_raises_naming(ValueError, lambda: loaders.make_loader(data, devices[:2], 13, logical_shards=8),
                         "batch_size=13 per logical shard", "8 logical shards")
    assert loaders.make_loader(data, devices[:2], 12, logical_shards=8).device_rows == 48  # control

# Issue 30.4: an epoch left unfinished at exit prints nothing and leaves nothing running
# --------------------------------------------------------------------------

EXIT_CHILD = r'''
import os, sys, tempfile, threading, time, weakref
sys.path.insert(0, sys.argv[1])
import jax
jax.config.update("jax_num_cpu_devices", 4)
import numpy as np


class Sentinel:
    pass


sentinel, before = Sentinel(), set(threading.enumerate())


def at_exit():
    # Finalizers run at exit newest first, so this one, made before any epoch, runs after
    # every epoch's end: what it still sees running was left running.
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    if left:
        sys.stderr.write(f"threads still running at exit: {left}\n")


weakref.finalize(sentinel, at_exit)

import loaders
devices, cache = jax.devices(), tempfile.mkdtemp()
rng = np.random.default_rng(0)
data = (rng.integers(0, 256, (40, 3, 32, 32)).astype(np.uint8), rng.integers(0, 10, 40).astype(np.int32))
cases, unfinished = [], []


def left_open(name, iterator, take=True):
    if take:
        next(iterator)
    cases.append(name)
    unfinished.append(iterator)


loader = loaders.make_loader(data, devices, 2)
left_open("host", loader.epoch(0))
left_open("host, another epoch", loader.epoch(1))
left_open("host, never started", loader.epoch(2), take=False)
left_open("host, resumed", loader.epoch(0, state=loaders.make_loader(data, devices[:2], 4).state(0, 1)))
left_open("host_float32", loaders.make_loader(data, devices, 2, placement="host_float32").epoch(0))
left_open("device", loaders.make_loader(data, devices, 2, placement="device").epoch(0))
try:
    import dali_loader
    dali_loader.import_dali()
except ImportError:
    pass
else:
    for order in dali_loader.ORDERS:
        dali = dali_loader.make_dali_loader(data, devices, 2, cache_dir=cache, order=order)
        left_open(f"dali {order}", dali.epoch(0))
try:
    import rocal_loader
    rocal_loader.import_rocal()
except ImportError:
    pass
else:
    for order in rocal_loader.ORDERS:
        rocal = rocal_loader.make_rocal_loader(data, devices, 2, cache_dir=cache, order=order)
        left_open(f"rocal {order}", rocal.epoch(0))
running = [t for t in threading.enumerate() if t not in before and t.is_alive()]
print(f"cases: {cases}")
print(f"threads running mid-epoch: {len(running)}")
print(f"main done at {time.time()!r}", flush=True)
'''


def test_epochs_left_unfinished_at_exit_print_nothing_and_end(tmp_path):
    # One child, every backend's epoch left unfinished at once (the host placements with
    # their prefetch threads, one never started, a resumed one; "device"; DALI's and rocAL's
    # pipelines in both orders, where they import). Before issue 30.4 the child printed
    # "Exception ignored in: <generator object _prefetch_thread ...>" (or rocAL's
    # _plan_steps, _vendor_steps) at exit, and two open host epochs could abort it.
    import importlib.util
    import os
    import sys
    import time

    from conftest import run_children

    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "child.py"
    script.write_text(EXIT_CHILD)
    started = time.time()
    [child] = run_children([[sys.executable, str(script), here]], timeout=90)
    code, out, err = child
    assert code == 0 and err == "", f"exit status {code}; stderr:\n{err}\nstdout:\n{out}"
    said = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert int(said["threads running mid-epoch"]) >= 4, out  # the control: the exit check had threads to see
    vendors = [name for name, package in (("dali", "nvidia.dali"), ("rocal", "amd.rocal"))
               if importlib.util.find_spec(package.split(".")[0]) and importlib.util.find_spec(package)]
    for case in ["host", "device"] + [f"{vendor} {order}" for vendor in vendors for order in ("plan", "vendor")]:
        assert repr(case) in said["cases"], (case, out)
    exited = started + child.seconds - float(out.split("main done at ")[1])
    assert exited < 15, f"the child took {exited:.1f} s to exit after its last line"


def test_a_dropped_epoch_ends_its_worker_at_once(devices, synthetic_dir):
    # The worker references the queue, not the iterator, so dropping the last reference
    # ends the epoch there (no collector pass needed); one more reference keeps it running.
    import weakref

    loader = loaders.make_loader(synthetic_dir, devices, B, prefetch=2)
    batches = loader.epoch(0)
    next(batches)
    held, dropped = [batches], weakref.ref(batches)
    del batches
    assert dropped() is not None and prefetch_threads(), "the control: a held epoch runs on"
    held.clear()
    assert dropped() is None and not prefetch_threads()
