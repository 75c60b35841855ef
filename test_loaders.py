"""Tests of loaders.py, delivery onto devices: each guarantee of its docstrings, checked.

* Blocks: for the tuple form (normalised images; raw uint8, int8 and float32 samples) and a
  dict dataset (int32 token ids, float32 features, normalised images with crop and mirror,
  ids), in both placements and layouts, on 1, 3 and 8 devices in a permuted order, with
  L = n and L = 2n logical shards: block k of every name at every step, on the device at
  mesh position k, is f(data[name][P.indices[s, k]]), and "mask", "index" and
  "logical_shards" are the plan's, in the documented shape, dtype and sharding. The global
  batch is the same on every n dividing L. A CIFAR-10 folder, MNIST with DALI's arithmetic.
* Normalisation: device_normalize gives the tables' bits; every table cache is keyed by the
  bits, so a zero's sign and values that are not doubles reach both placements and layouts
  (negative controls: keying by floats, rows compared as floats).
* Resume: ``it.get_state()`` after k steps of a fresh or a resumed epoch, resumed on other
  devices, batch sizes and logical shards, gives elastic_plan's rows on every device: each
  sample exactly once (fill), drop skipping the stated count; the fresh plan's state at the
  same step (the control) repeats samples. The edges, random access, real_samples, a state
  of other data, the digest computed once.
* Refusals name the parameter and the value.
* The epoch iterator: prefetch re-raises worker errors and changes nothing; the iterator
  ends what it started however it ends, at the interpreter's exit too.
"""

import dataclasses
import gc
import threading
import time
import weakref
from typing import NamedTuple

import jax
import numpy as np
import pytest
from hypothesis import assume, example, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec

import arithmetic
import conformance
import encoding
import loaders
from arithmetic import ARITHMETICS, Normalize, keyed_table, normalize_table, table_key, table_operands
from cifar_mnist import read_cifar10
from conftest import (NOT_DOUBLES, POLICIES, SEEDS, assert_raises_naming, assert_same_bits, bits_differ, crop_cases, epoch_steps,
                      examples, expected_steps, meshes, random_mnist)
from plan import (LoaderState, dataset_digest, device_slots, elastic_plan, epoch_plan, on_devices,
                  remaining_samples, shard_bounds)

N, B = 103, 3  # shards of 12 and 13 on 8 devices: uneven, so fill pads


# --------------------------------------------------------------------------
# Datasets and the spec of a batch
# --------------------------------------------------------------------------


class Data(NamedTuple):
    data: object  # what make_loader takes
    normalize: object  # make_loader's normalize
    arrays: dict  # name -> the spec's data[name]
    norms: dict  # name -> its Normalize
    ids: str  # the name whose row i holds i


KINDS = ("images", "uint8", "int8", "float32", "dict")


def dataset(kind: str, count: int = N) -> Data:
    """The tuple form (uint8 labels, delivered int32, label i is i): "images" (uint8, the
    default Normalize) or raw "uint8", "int8", "float32" samples; or "dict": int32 token
    ids, float32 features, uint8 images normalised with crop and mirror, int32 ids."""
    rng = np.random.default_rng(1)
    if kind != "dict":
        labels = np.arange(count, dtype=np.uint8)
        samples = {"images": lambda: rng.integers(0, 256, (count, 3, 8, 8)).astype(np.uint8),
                   "uint8": lambda: rng.integers(0, 256, (count, 1, 6, 6)).astype(np.uint8),
                   "int8": lambda: rng.integers(-128, 128, (count, 4, 4)).astype(np.int8),
                   "float32": lambda: rng.standard_normal((count, 40), dtype=np.float32)}[kind]()
        norms = {"images": Normalize()} if kind == "images" else {}
        return Data((samples, labels), "default" if norms else None,
                    {"images": samples, "labels": labels.astype(np.int32)}, norms, "labels")
    arrays = {"tokens": rng.integers(0, 500, (count, 3)).astype(np.int32),
              "features": rng.standard_normal((count, 2), dtype=np.float32),
              "images": rng.integers(0, 256, (count, 2, 5, 6)).astype(np.uint8),
              "ids": np.arange(count, dtype=np.int32)}
    norms = {"images": Normalize(mean=(100.0, 30.5), std=(50.0, 3.0), crop=(4, 4), crop_pos=(0.25, 0.75),
                                 mirror=True)}
    return Data(arrays, norms, arrays, norms, "ids")


def device_blocks(array: jax.Array, mesh, layout: str) -> dict[int, np.ndarray]:
    """{mesh position k: the block on that device}, checking the sharding and that block k is
    rows k*rows .. (k+1)*rows - 1 ("sharded") or row k ("pmap", returned without that axis)."""
    assert array.sharding == NamedSharding(mesh, PartitionSpec("data")), array.sharding
    position = {d: k for k, d in enumerate(mesh.devices.flat)}
    size = array.shape[0] // mesh.devices.size if layout == "sharded" else 1
    blocks = {}
    for shard in array.addressable_shards:
        k = position[shard.device]
        assert shard.index[0].indices(array.shape[0])[:2] == (k * size, (k + 1) * size), (k, shard.index)
        data = np.asarray(shard.data)
        blocks[k] = data if layout == "sharded" else data[0]
    assert sorted(blocks) == list(range(mesh.devices.size))
    return blocks


def check_batch(batch: dict, loader, plan, row: int, spec: Data, what: str) -> None:
    """Every block of ``batch`` is the module docstring's for row ``row`` of ``plan`` (over the
    loader's L logical shards), on the device at its mesh position."""
    n, L = loader.num_devices, plan.indices.shape[1]
    on = on_devices(plan, n)
    assert list(batch) == [*spec.arrays, "mask", "index", "logical_shards"], list(batch)
    for name, array in batch.items():
        for k, got in device_blocks(array, loader.mesh, loader.layout).items():
            idx = on.indices[row, k]
            if name == "mask":
                want = on.mask[row, k]
            elif name == "index":
                want = idx.astype(np.int32)
            elif name == "logical_shards":
                want = device_slots(L, n)[k].astype(np.int32)
            else:
                f = spec.norms.get(name)
                want = spec.arrays[name][idx] if f is None else f(spec.arrays[name][idx])
            assert_same_bits(got, want, f"{what}: {name}, row {row}, device {k}")


def real_ids(batch: dict, spec: Data) -> np.ndarray:
    return np.asarray(batch[spec.ids]).reshape(-1)[np.asarray(batch["mask"]).reshape(-1)]


def host(batch: dict) -> dict:
    return {name: np.asarray(array) for name, array in batch.items()}


def assert_same_batches(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} batches, want {len(want)}"
    for s, (g, w) in enumerate(zip(got, want)):
        assert list(g) == list(w), what
        for name in w:
            assert_same_bits(np.asarray(g[name]), np.asarray(w[name]), f"{what}: step {s}, {name}")


def permuted(devices, count: int) -> list:
    """``count`` devices, not the default one first, in an order that is not their ids'."""
    chosen = devices[len(devices) - count:]
    return chosen[1::2] + chosen[::2] if count > 1 else chosen


# --------------------------------------------------------------------------
# Blocks follow the plan
# --------------------------------------------------------------------------


CASES = dict(count=st.sampled_from([1, 3, 8]), kind=st.sampled_from(KINDS), layout=st.sampled_from(loaders.LAYOUTS),
             per=st.integers(1, 2), shuffle=st.booleans(), last_batch=POLICIES, seed=SEEDS, epoch=st.integers(0, 3))


def blocks_follow_the_plan(devices, count, kind, layout, per, shuffle, last_batch, seed, epoch):
    count = min(count, len(devices))
    spec, order, L = dataset(kind), permuted(devices, count), per * count
    plan = epoch_plan(N, L, B, epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch)
    for placement in loaders.PLACEMENTS:
        loader = loaders.make_loader(spec.data, order, B, layout=layout, shuffle=shuffle, seed=seed,
                                     last_batch=last_batch, normalize=spec.normalize, placement=placement,
                                     logical_shards=L if per > 1 else None)
        assert len(loader) == len(plan.indices) == expected_steps(N, L, B, last_batch)
        steps = 0
        for s, batch in enumerate(loader.epoch(epoch)):
            check_batch(batch, loader, plan, s, spec, f"{kind} {placement} {layout} L={L}")
            steps += 1
        assert steps == len(loader) and loader.real_samples(epoch) == int(plan.mask.sum())


@given(**CASES)
@example(count=1, kind="images", layout="pmap", per=2, shuffle=True, last_batch="fill", seed=7, epoch=1)
@example(count=3, kind="float32", layout="sharded", per=1, shuffle=True, last_batch="drop", seed=2**32 - 1, epoch=3)
@example(count=3, kind="int8", layout="pmap", per=1, shuffle=False, last_batch="fill", seed=0, epoch=0)
@example(count=8, kind="dict", layout="sharded", per=2, shuffle=True, last_batch="drop", seed=5, epoch=2)
@example(count=8, kind="uint8", layout="pmap", per=1, shuffle=True, last_batch="fill", seed=9, epoch=0)
@settings(max_examples=examples(4))
def test_blocks_follow_the_plan_in_both_placements(devices, count, kind, layout, per, shuffle, last_batch, seed,
                                                   epoch):
    """Every step of an epoch, in both placements: block k of every name, on the device at mesh
    position k, is the spec's for the plan over L = per * n logical shards; the epoch's
    length and real_samples are the plan's. The examples: every kind, layout, L/n and policy."""
    blocks_follow_the_plan(devices, count, kind, layout, per, shuffle, last_batch, seed, epoch)


@pytest.mark.parametrize("example", [
    dict(count=3, kind="images", layout="pmap", per=2, shuffle=True, last_batch="fill", seed=7, epoch=1),
    dict(count=8, kind="dict", layout="sharded", per=1, shuffle=True, last_batch="drop", seed=5, epoch=2)])
def test_a_tpus_delivery_played_on_cpu_devices_follows_the_plan(devices, monkeypatch, example):
    """On a TPU (ARITHMETIC_PLATFORMS, GATHER_ONCE_PLATFORMS, CHUNK_PROGRAM_PLATFORMS) the loader
    normalises by the table's arithmetic, placement "device" gathers an epoch's rows at once, and
    a program makes a chunk's batches: played here by CPU devices, every block still follows the
    plan in both placements (the test above)."""
    monkeypatch.setattr(loaders, "ARITHMETIC_PLATFORMS", ("cpu",))
    monkeypatch.setattr(loaders, "GATHER_ONCE_PLATFORMS", ("cpu",))
    monkeypatch.setattr(loaders, "CHUNK_PROGRAM_PLATFORMS", ("cpu",))
    loaders.normalizer.cache_clear()
    try:
        blocks_follow_the_plan(devices, **example)
    finally:
        loaders.normalizer.cache_clear()


@pytest.mark.slow
@given(**CASES)
@settings(max_examples=examples(60))
def test_blocks_follow_the_plan_sweep(devices, count, kind, layout, per, shuffle, last_batch, seed, epoch):
    """The test above over many more drawn cases."""
    blocks_follow_the_plan(devices, count, kind, layout, per, shuffle, last_batch, seed, epoch)


def test_the_batch_check_sees_another_row_and_another_plan(devices):
    """The control of check_batch: a batch is not the next row's, nor the fresh plan's."""
    spec = dataset("dict")
    loader = loaders.make_loader(spec.data, devices, B, shuffle=True, seed=2, normalize=spec.normalize)
    batch, plan = loader.batch(0, 1), loader.plan(0)
    check_batch(batch, loader, plan, 1, spec, "right")
    for other, row in ((plan, 2), (loader.plan(1), 1)):
        with pytest.raises(AssertionError, match="differ"):
            check_batch(batch, loader, other, row, spec, "wrong")


def test_a_cifar_folder_is_the_tuple_form_over_its_files(devices, synthetic_dir):
    """A folder is read_cifar10's (images, labels) with the default Normalize, the images a
    strided view of the records, in both placements."""
    images, labels = read_cifar10(synthetic_dir)
    assert not images.flags.c_contiguous
    spec = Data(None, None, {"images": images, "labels": labels}, {"images": Normalize()}, "labels")
    for placement in loaders.PLACEMENTS:
        loader = loaders.make_loader(synthetic_dir, permuted(devices, len(devices)), 8, shuffle=True, seed=3,
                                     placement=placement)
        check_batch(loader.batch(1, 2), loader, loader.plan(1), 2, spec, placement)


@pytest.mark.slow
def test_logical_shards_give_the_same_global_batch_on_every_device_count(devices):
    """With L logical shards, every step's global arrays are on_devices' for every n from 1 to L
    (a spare slot where n does not divide L: the device's first row, mask False, shard -1), in
    both placements and layouts: its rows, mask, index and logical shards; so the real slots
    are the plan's L shards on every n. added_fields gives vendor loaders the same blocks.
    The extended tier's; the default tier holds its guarantee with
    test_blocks_follow_the_plan_in_both_placements (L = per * n)."""
    L, b = 8, 3
    data = {"x": np.arange(N, dtype=np.int32), "y": np.arange(2 * N, dtype=np.float32).reshape(N, 2)}
    plan = epoch_plan(N, L, b, epoch=1, seed=5, shuffle=True)
    for n in (1, 2, 3, 5, 8):
        on, slots = on_devices(plan, n), device_slots(L, n)
        idx = on.indices.reshape(len(on.indices), -1)
        want = [{"x": i.astype(np.int32), "y": data["y"][i], "mask": m, "index": i.astype(np.int32),
                 "logical_shards": slots.reshape(-1).astype(np.int32)} for i, m in zip(idx, on.mask.reshape(idx.shape))]
        real = np.repeat(slots.reshape(-1) >= 0, b)
        assert_same_bits(idx[:, real], plan.indices.reshape(len(idx), -1), f"n={n}: the real slots are the plan's")
        for placement in loaders.PLACEMENTS:
            for layout in loaders.LAYOUTS:
                loader = loaders.make_loader(data, devices[:n], b, logical_shards=L, shuffle=True, seed=5,
                                             placement=placement, layout=layout)
                assert loader.num_shards == L and loader.device_rows == slots.shape[1] * b
                batches = list(loader.epoch(1))
                got = [{k: v.reshape((-1,) + v.shape[2 if layout == "pmap" else 1:]) for k, v in host(batch).items()}
                       for batch in batches]
                assert_same_batches(got, want, f"n={n} {placement} {layout}")
                last = len(batches) - 1
                blocks = {name: device_blocks(a, loader.mesh, layout) for name, a in batches[last].items()}
                for k in range(n):
                    for name, block in loaders.added_fields(on.mask[last, k], on.indices[last, k], k, L, n).items():
                        assert_same_bits(block, blocks[name][k], f"added_fields, n={n}, device {k}, {name}")


def test_global_batch_puts_block_k_on_mesh_position_k(devices):
    """global_batch: block k, NumPy or a jax.Array on another device, lands on the kth device of
    the mesh, in both layouts; a missing local block is refused."""
    order = [devices[2], devices[0], devices[3]]
    mesh = loaders.data_mesh(order)
    blocks = {k: {"labels": np.full(2, 10 * k, np.int32), "mask": np.array([True, k != 1])} for k in range(3)}
    blocks[2]["labels"] = jax.device_put(blocks[2]["labels"], devices[1])  # elsewhere: copied over
    for layout in loaders.LAYOUTS:
        out = loaders.global_batch(blocks, mesh, layout)
        assert out["labels"].shape == ((6,) if layout == "sharded" else (3, 2))
        for name in blocks[0]:
            for k, got in device_blocks(out[name], mesh, layout).items():
                assert_same_bits(got, np.asarray(blocks[k][name]), f"{layout} {name} {k}")
        assert_raises_naming(ValueError, lambda: loaders.global_batch({0: blocks[0], 2: blocks[2]}, mesh, layout),
                             "no block for the local shards [1]")


def test_data_mesh_keeps_the_given_order(devices):
    """Mesh position k is devices[k], whatever the devices' ids."""
    for order in (devices[::-1], devices[1::2] + devices[::2]):
        assert list(loaders.data_mesh(order).devices.flat) == list(order)


def test_device_placement_holds_shard_k_on_device_k(devices):
    """Placement "device" holds shard k of n, zero-padded to the largest, on mesh position k."""
    spec = dataset("dict")
    order = devices[::-1][:3]
    loader = loaders.make_loader(spec.data, order, 4, placement="device", normalize=spec.normalize)
    size = -(-N // 3)
    for name, source in spec.arrays.items():
        for k, got in device_blocks(loader.resident[name], loader.mesh, "sharded").items():
            start, stop = shard_bounds(N, k, 3)
            want = np.zeros((size,) + source.shape[1:], source.dtype)
            want[:stop - start] = source[start:stop]
            assert_same_bits(got, want, f"{name}, device {k}")


@pytest.mark.parametrize("gather_once", [False, True])
def test_device_budget_counts_every_arrays_bytes_of_the_largest_shard(devices, monkeypatch, gather_once):
    """Placement "device" refuses a dataset whose largest shard (every array's row bytes), held
    once (resident), or twice on GATHER_ONCE_PLATFORMS (and an epoch's rows, played here by CPU
    devices), does not fit device_budget, and takes one that fits exactly; device_fit likewise.
    A CPU is charged once: the budget that fits there is refused where the rows are gathered
    once an epoch."""
    monkeypatch.setattr(loaders, "GATHER_ONCE_PLATFORMS", ("cpu",) if gather_once else ())
    copies = 2 if gather_once else 1
    tokens = dataset("dict").arrays  # 12 + 8 + 60 + 4 bytes per sample
    features, labels = dataset("float32").data  # 160 + 4 (int32 labels) bytes per sample
    for data, sample_bytes in ((tokens, 84), ((features, labels), 164)):
        fits = copies * -(-N // len(devices)) * sample_bytes
        loaders.make_loader(data, devices, B, normalize=None, placement="device", device_budget=fits)
        assert_raises_naming(ValueError, lambda: loaders.make_loader(
            data, devices, B, normalize=None, placement="device", device_budget=fits - 1),
            "placement='device'", "over the budget", "placement='host'")
    mesh = loaders.data_mesh(devices[:2])  # 7 samples: shards of 3 and 4, (1 + 4) bytes each
    pair = (np.zeros((7, 1, 1, 1), np.uint8), np.zeros(7, np.int64))  # labels delivered as int32
    assert loaders.device_fit(pair, mesh, device_budget=20 * copies) is None
    assert f"4 samples {('once', 'twice')[gather_once]}" in loaders.device_fit(pair, mesh,
                                                                              device_budget=20 * copies - 1)


def test_device_fit_counts_every_field_as_make_loader_does(devices):
    """device_fit is make_loader's own check: a float32 "weights" field beside images and labels
    counts its 4 bytes a sample (the control: without it the same budget fits), and make_loader
    refuses with device_fit's words. A folder or a list is refused naming data."""
    mesh = loaders.data_mesh(devices[:2])
    data = {"images": np.zeros((7, 1, 1, 1), np.uint8), "labels": np.zeros(7, np.int32),
            "weights": np.ones(7, np.float32)}
    why = loaders.device_fit(data, mesh, device_budget=35)  # 4 samples x (1 + 4 + 4) bytes = 36
    assert why is not None and "4 samples once" in why and "= 0.0 MiB" in why
    assert loaders.device_fit(data, mesh, device_budget=36) is None
    assert loaders.device_fit({k: v for k, v in data.items() if k != "weights"}, mesh, device_budget=20) is None
    with pytest.raises(ValueError) as refused:
        loaders.make_loader(data, mesh, 1, normalize=None, placement="device", device_budget=35)
    assert str(refused.value) == why
    for bad in ("a-folder", [data["images"]], {}):
        assert_raises_naming(ValueError, lambda: loaders.device_fit(bad, mesh), "device_fit: data must be")


def test_mnist_with_the_dali_notebooks_normalisation(devices):
    """One-channel images with DALI's arithmetic, x * float32(1/255), not x / 255; the
    three-channel default is refused on them."""
    images, labels = random_mnist(3, 60)
    labels = labels.astype(np.int32)
    norm = Normalize(mean=(0.0,), std=(255.0,), arithmetic="dali_cpu")
    loader = loaders.make_loader((images, labels), devices[:3], 4, normalize=norm)
    idx = loader.plan(0).indices[1].reshape(-1)
    want = norm(images[idx])
    assert_same_bits(np.asarray(loader.batch(0, 1)["images"]), want)
    assert bits_differ(want, images[idx] / np.float32(255))
    assert_raises_naming(ValueError, lambda: loaders.make_loader((images, labels), devices[:3], 4), "need 1 entries")


def test_the_reference_loader_on_encoded_float_features_conforms(devices):
    """conformance.describe_epoch finds nothing in the reference loader's epoch, both layouts."""
    count, b, n = 203, 4, len(devices)
    features = encoding.encoded_images(np.arange(count), (40,), np.float32)
    for layout in loaders.LAYOUTS:
        loader = loaders.make_loader((features, np.zeros(count, np.int32)), devices, b, layout=layout,
                                     shuffle=True, seed=3, normalize=None)
        batches = list(loader.epoch(1))
        decoded = np.stack([encoding.decode_indices(x.reshape((-1,) + x.shape[2:]), None).reshape(n, b)
                            for x in (conformance.shard_blocks(y["images"], n, layout) for y in batches)])
        masks = np.stack([conformance.shard_blocks(y["mask"], n, layout) for y in batches])
        assert_same_bits(decoded, loader.plan(1).indices)
        found = conformance.describe_epoch(decoded, count, b, shuffle=True, last_batch="fill", length=len(loader),
                                           masks=masks)
        assert not found, found.report()


# --------------------------------------------------------------------------
# Normalisation: the tables' bits, whatever the cache saw before
# --------------------------------------------------------------------------


@given(crop_cases(), st.sampled_from(ARITHMETICS))
@settings(max_examples=examples(5))
def test_device_normalize_gives_the_tables_bits(case, arithmetic):
    """device_normalize (both placements' arithmetic) is a lookup in the table of the cropped,
    flipped window, as Normalize is on the host."""
    images, crop, crop_pos, mirror, mean, std = case
    norm = Normalize(mean=tuple(mean), std=tuple(std), mirror=bool(mirror[0]), crop=crop, crop_pos=crop_pos,
                     arithmetic=arithmetic)
    y0, x0, ch, cw = norm.window(images.shape[2:])
    window = images[:, :, y0:y0 + ch, x0:x0 + cw]
    want = norm.table[np.arange(3)[None, :, None, None], window[..., ::-1] if norm.mirror else window]
    assert_same_bits(norm(images), want)
    cpu = jax.devices("cpu")[0]
    key = table_key(norm.mean, norm.std, norm.arithmetic, "test")
    normalise = jax.jit(loaders.device_normalize, static_argnums=(2, 3))
    for how in ({"table": norm.table}, table_operands(key)):  # both routes
        got = normalise(jax.device_put(images, cpu), jax.device_put(how, cpu), norm.window(images.shape[2:]),
                        norm.mirror)
        assert_same_bits(np.asarray(got), want, sorted(how))


@given(st.lists(st.floats(-300, 300), min_size=1, max_size=3), st.floats(0.01, 300), st.booleans(),
       st.sampled_from(ARITHMETICS))
@settings(max_examples=examples(20))
def test_the_tables_arithmetic_gives_every_value_of_the_table(means, std, negative, arithmetic):
    """The arithmetic route (ARITHMETIC_PLATFORMS', run here on CPU) on all 256 values of every
    channel: the table's bits, where no operand and no entry is subnormal (XLA flushes those
    to zero; the loader checks and falls back, test above). The control: the same operands as
    x * inv + offset, two roundings, miss the FMA's table (the rocAL notebook's mean = std =
    127.5 on 158 values)."""
    stds = [-std if negative else std] * len(means)
    key = table_key(means, stds, arithmetic, "test")
    values = np.concatenate([keyed_table(key).reshape(-1), *table_operands(key).values()])
    assume(not (np.abs(values[values != 0]) < np.finfo(np.float32).tiny).any())
    values = np.arange(256, dtype=np.uint8)[None, None, :].repeat(len(means), 0)
    normalise = jax.jit(loaders.device_normalize, static_argnums=(2, 3))  # compiled, as the loaders run it
    got = normalise(jax.device_put(values, jax.devices("cpu")[0]), table_operands(key), (0, 0, 1, 256), False)[:, 0]
    assert_same_bits(np.asarray(got), keyed_table(key))
    rocal = table_operands(table_key([127.5], [127.5], "rocal", "test"))
    naive = np.arange(256, dtype=np.float32) * rocal["inv"] + rocal["offset"]
    assert bits_differ(naive, keyed_table(table_key([127.5], [127.5], "rocal", "test"))[0])


@pytest.mark.slow
def test_where_the_devices_normalise_by_arithmetic_they_deliver_the_tables_bits(devices, monkeypatch):
    """On ARITHMETIC_PLATFORMS (a TPU's; played here by CPU devices) the loader normalises by
    the table's operands after checking all 256 values on the devices: both placements and
    layouts give the table's bits, the notebooks' tables and a zero's sign included. A table
    the devices miss (a subnormal mean: XLA flushes it to zero) falls back to the lookup,
    still the table's bits; the control: the operands alone do miss it.
    The extended tier's; the default tier holds its guarantee with
    test_device_normalize_gives_the_tables_bits."""
    monkeypatch.setattr(loaders, "ARITHMETIC_PLATFORMS", ("cpu",))
    loaders.normalizer.cache_clear()
    try:
        subnormal = Normalize(mean=(1e-45,), std=(3.0,), arithmetic="dali_cpu")
        for norm in (Normalize(), Normalize(mean=(0.0,), std=(255.0,), arithmetic="dali_cpu"),
                     Normalize(mean=(120.0, 0.0, -3.5), std=(30.0, -60.0, 90.0), arithmetic="dali_gpu"),
                     *SIGNED_ZERO_PAIRS["three channels"], subnormal):
            for layout in loaders.LAYOUTS:
                assert not placements_disagree(devices, norm, layout), (norm, layout)
        mesh = loaders.data_mesh(devices[:4])
        routes = {norm.arithmetic: sorted(loaders.normalizer(table_key(norm.mean, norm.std, norm.arithmetic, "t"), mesh))
                  for norm in (Normalize(), subnormal)}
        assert routes == {"rocal": ["inv", "offset"], "dali_cpu": ["table"]}, routes
        key = table_key(subnormal.mean, subnormal.std, subnormal.arithmetic, "t")
        values = np.arange(256, dtype=np.uint8)[None, None, :]
        normalise = jax.jit(loaders.device_normalize, static_argnums=(2, 3))
        by_operands = normalise(jax.device_put(values, devices[0]), table_operands(key), (0, 0, 1, 256), False)[:, 0]
        assert bits_differ(np.asarray(by_operands), keyed_table(key))
    finally:
        loaders.normalizer.cache_clear()


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
        loader = loaders.make_loader((images, np.arange(8, dtype=np.int32)), devices[:4], 2, layout=layout,
                                     normalize=norm, placement=placement)
        idx = loader.plan(0).indices[0].reshape(-1)
        want = table[np.arange(channels)[None, :, None, None], images[idx]]
        why = bits_differ(np.asarray(loader.batch(0, 0)["images"]).reshape(want.shape), want)
        if why:
            found.append(f"{placement}: {why}")
    return found


@pytest.mark.parametrize("layout", loaders.LAYOUTS)
def test_a_zeros_sign_reaches_both_placements_and_layouts(devices, layout):
    """Tables that differ only in a zero's sign each reach the devices, the +0.0 one placed
    first (a cache keyed by floats would serve it to the -0.0 loader: -0.0 == 0.0)."""
    for first, then in SIGNED_ZERO_PAIRS.values():
        tables = [normalize_table(f.mean, f.std, f.arithmetic) for f in (first, then)]
        assert bits_differ(tables[0], tables[1]) and (tables[0] == tables[1]).all()
        for norm in (first, then):
            assert not placements_disagree(devices, norm, layout)


def test_the_zero_sign_check_sees_tables_keyed_by_floats(devices, monkeypatch):
    """The controls of the test above: a table cache keyed by floats gives the -0.0 loader the
    +0.0 table, and rows compared as floats collapse the three-channel table, in both placements."""
    real = loaders.normalizer.__wrapped__
    by_floats = {}

    def float_keyed(key, mesh):
        floats = (tuple(np.frombuffer(key[0], np.float32).tolist()),
                  tuple(np.frombuffer(key[1], np.float32).tolist()), key[2], mesh)
        return by_floats.setdefault(floats, real(key, mesh))

    first, then = SIGNED_ZERO_PAIRS["one channel"]
    with monkeypatch.context() as patch:
        patch.setattr(loaders, "normalizer", float_keyed)
        assert not placements_disagree(devices, first, "sharded")
        found = placements_disagree(devices, then, "sharded")
    assert [f.split(":")[0] for f in found] == list(loaders.PLACEMENTS), found
    with monkeypatch.context() as patch:
        by_value = lambda table: bool((table == table[:1]).all())
        patch.setattr(arithmetic, "one_row", by_value)
        patch.setattr(loaders, "one_row", by_value)
        loaders.normalizer.cache_clear()  # tables placed before were built with the real one_row
        try:
            found = placements_disagree(devices, SIGNED_ZERO_PAIRS["three channels"][1], "sharded")
        finally:
            loaders.normalizer.cache_clear()  # and the collapsed ones must not outlive the patch
    assert [f.split(":")[0] for f in found] == list(loaders.PLACEMENTS), found
    assert table_key((0.0,), (-2.0,), "rocal", "") != table_key((-0.0,), (-2.0,), "rocal", "")


@pytest.mark.parametrize("mean, std", NOT_DOUBLES[:1] + NOT_DOUBLES[-1:])
def test_values_that_are_not_doubles_give_the_same_bits_in_both_placements(devices, mean, std):
    """A mean or std that float() rounds (a Fraction, a long double) reaches the devices as
    normalize_table's bits."""
    assert not placements_disagree(devices, Normalize(mean=mean, std=std), "sharded")


def test_equal_means_with_different_stds_keep_one_table_row_per_channel(devices):
    """A device table collapses to one row only when every channel's row is the same bits."""
    norm = Normalize(mean=(120.0, 120.0, 120.0), std=(30.0, 60.0, 90.0))
    assert not (norm.table[0] == norm.table[1]).all()
    images = every_value_images(8, 3)
    spec = Data(None, None, {"images": images, "labels": np.zeros(8, np.int32)}, {"images": norm}, "labels")
    for placement in loaders.PLACEMENTS:
        loader = loaders.make_loader(spec.arrays, devices[:2], 4, normalize=spec.norms, placement=placement)
        check_batch(loader.batch(0, 0), loader, loader.plan(0), 0, spec, placement)


# --------------------------------------------------------------------------
# Resume: get_state, on other devices, batch sizes and logical shards
# --------------------------------------------------------------------------

NR, SEED, EPOCH = 97, 11, 2
# (conftest.meshes position, logical shards, batch size, steps; None: to the end). 8 devices x 4
# for 2 steps (64 delivered); 3 devices, L = 7 (3 slots a device, two of them spare) x 2 for
# 1 step (14); then 4 devices in a permuted order, L = 8 x 1, the rest: L > n resumed on other
# device counts, twice, once on an n that does not divide L.
CHAIN = ((0, None, 4, 2), (1, 7, 2, 1), (2, 8, 1, None))


def chain_loader(devices, stage: int, spec: Data, **kwargs):
    m, L, b, _ = CHAIN[stage]
    return loaders.make_loader(spec.data, meshes(devices)[m], b, shuffle=True, seed=SEED, normalize=spec.normalize,
                               logical_shards=L, **kwargs)


def run_chain(devices, kind: str, placement: str, layout: str, last_batch: str):
    """A job over CHAIN: run, save ``it.get_state()`` through JSON, resume on the next stage.
    Checks every batch against elastic_plan; returns (the real ids delivered, the segments)."""
    spec = dataset(kind, NR)
    delivered, segments, saved = [], [], None
    for stage, (_, _, b, steps) in enumerate(CHAIN):
        loader = chain_loader(devices, stage, spec, placement=placement, layout=layout, last_batch=last_batch)
        it = loader.epoch(EPOCH) if saved is None else loader.epoch(EPOCH, state=saved)
        segments.append((0 if saved is None else saved.step, loader.num_shards, b))
        plan = elastic_plan(NR, segments, epoch=EPOCH, seed=SEED, shuffle=True, last_batch=last_batch)[-1]
        rows = 0
        for batch in it:
            check_batch(batch, loader, plan, rows, spec, f"{kind} {placement} {layout} {last_batch} stage {stage}")
            delivered.append(real_ids(batch, spec))
            rows += 1
            if rows == steps:
                break
        it.close()
        assert rows == (steps or len(plan.indices)), f"stage {stage}: {rows} steps"
        saved = LoaderState.from_json(it.get_state().to_json())
        assert saved.step == segments[-1][0] + rows and saved.segments == tuple(segments)
    assert saved.step == saved.num_steps
    return np.concatenate(delivered), segments


@pytest.mark.parametrize("layout", loaders.LAYOUTS)
@pytest.mark.parametrize("placement", loaders.PLACEMENTS)
def test_a_job_resumed_twice_gets_elastic_plans_rows_each_sample_once(devices, placement, layout):
    """get_state after k steps of a fresh epoch, then of the resumed one, each resumed on other
    devices, batch sizes and logical shards (L > n): every block is elastic_plan's, and the
    delivered ids are each sample exactly once."""
    ids, _ = run_chain(devices, "dict", placement, layout, "fill")
    assert_same_bits(np.sort(ids), np.arange(NR, dtype=np.int32))


@pytest.mark.slow
@pytest.mark.parametrize("layout", loaders.LAYOUTS)
@pytest.mark.parametrize("placement", loaders.PLACEMENTS)
@pytest.mark.parametrize("kind", ["images", "float32"])
def test_a_job_resumed_twice_on_the_tuple_form(devices, kind, placement, layout):
    """The job above on the tuple form: normalised images, raw float32 features."""
    ids, _ = run_chain(devices, kind, placement, layout, "fill")
    assert_same_bits(np.sort(ids), np.arange(NR, dtype=np.int32))


@pytest.mark.parametrize("placement", loaders.PLACEMENTS)
def test_a_job_resumed_twice_with_drop_skips_the_stated_count(devices, placement):
    """Drop delivers each sample at most once, n*B a step, and skips remaining_samples."""
    ids, segments = run_chain(devices, "dict", placement, "sharded", "drop")
    plans = elastic_plan(NR, segments, epoch=EPOCH, seed=SEED, shuffle=True, last_batch="drop")
    assert len(ids) == sum(n * b * len(p.indices) for (_, n, b), p in zip(segments, plans))
    skipped = remaining_samples(NR, segments, epoch_steps(NR, segments, "drop"), epoch=EPOCH, seed=SEED,
                                shuffle=True, last_batch="drop")
    assert_same_bits(np.sort(np.concatenate([ids, skipped.astype(np.int32)])), np.arange(NR, dtype=np.int32))


def resized_once(devices, spec: Data, **kwargs) -> tuple[list, object]:
    """CHAIN's first two stages: 2 steps on 8 devices, then resumed on 3 for 1 step: (the real
    ids delivered, the resumed iterator, open)."""
    it = chain_loader(devices, 0, spec, **kwargs).epoch(EPOCH)
    done = [real_ids(next(it), spec) for _ in range(2)]
    it.close()
    it = chain_loader(devices, 1, spec, **kwargs).epoch(EPOCH, state=it.get_state())
    done.append(real_ids(next(it), spec))
    return done, it


def test_the_fresh_plans_state_at_the_same_step_repeats_samples(devices):
    """The control: after a resumed epoch's k steps, the fresh plan's state at the same step (not
    the iterator's) resumed on the next stage delivers some samples twice and some never."""
    spec = dataset("dict", NR)
    second, third = (chain_loader(devices, stage, spec) for stage in (1, 2))
    done, it = resized_once(devices, spec)
    right = it.get_state()
    wrong = second.epoch(EPOCH).get_state().at_step(right.step)
    assert len(right.segments) == 2 and len(wrong.segments) == 1
    for state, once in ((right, True), (wrong, False)):
        got = np.concatenate(done + [real_ids(b, spec) for b in third.epoch(EPOCH, state=state)])
        assert np.array_equal(np.sort(got), np.arange(NR)) is once, np.bincount(got, minlength=NR)


def test_get_state_at_an_epochs_start_and_end(devices):
    """Before its first batch an epoch's state is LoaderState.start naming the data (fresh) or the
    state it resumed, resized to this loader; it counts the batches yielded, not those
    prefetched; at the end nothing is left to resume."""
    spec = dataset("dict", NR)
    eight, three = chain_loader(devices, 0, spec), chain_loader(devices, 1, spec, placement="device")
    start = LoaderState.start(NR, 8, 4, epoch=EPOCH, seed=SEED, shuffle=True, dataset=dataset_digest(spec.arrays))
    it = eight.epoch(EPOCH)
    assert it.get_state() == start
    next(it), next(it)
    assert it.get_state() == start.at_step(2)
    resumed = three.epoch(EPOCH, state=it.get_state())
    assert resumed.get_state() == start.at_step(2).resized(7, 2)
    list(it)
    end = it.get_state()
    assert end == start.at_step(len(eight))
    again = three.epoch(EPOCH, state=end)
    assert list(again) == [] and again.get_state().step == end.step and three.real_samples(EPOCH, state=end) == 0


@pytest.mark.parametrize("placement", loaders.PLACEMENTS)
def test_resume_random_access_and_real_samples(devices, placement):
    """On the same loader a resume from get_state is the epoch's rest, bit for bit; after a
    resize, batch(e, s, state=) is the resumed iterator's step s and real_samples(e, state=)
    counts its real slots."""
    spec = dataset("dict", NR)
    eight, three = (chain_loader(devices, stage, spec, placement=placement) for stage in (0, 1))
    full = [host(b) for b in eight.epoch(EPOCH)]
    it = eight.epoch(EPOCH)
    next(it), next(it)
    saved = it.get_state()
    it.close()
    assert_same_batches([host(b) for b in eight.epoch(EPOCH, state=saved)], full[2:], "the rest")
    rest = [host(b) for b in three.epoch(EPOCH, state=saved)]
    for s in range(saved.step, saved.step + len(rest)):
        assert_same_batches([host(three.batch(EPOCH, s, state=saved))], [rest[s - saved.step]], f"batch({s})")
    assert three.real_samples(EPOCH, state=saved) == NR - 64 == sum(int(b["mask"].sum()) for b in rest)


@pytest.mark.parametrize("placement", loaders.PLACEMENTS)
def test_a_state_saved_inside_a_resized_segment_resumes_there(devices, placement):
    """A state saved one step into a segment that began at a resize (8 devices, then 3), resumed
    on a loader of that segment's shape (no new resize): the rest of the uninterrupted iterator,
    bit for bit; batch(e, s, state=) is its step s; every sample once over the three parts."""
    spec = dataset("dict", NR)
    done, it = resized_once(devices, spec, placement=placement)
    saved = it.get_state()
    rest = [host(b) for b in it]
    assert len(saved.segments) == 2 and saved.step == saved.segments[-1][0] + 1 and rest, saved
    again = chain_loader(devices, 1, spec, placement=placement)  # another loader of the segment's shape
    resumed = [host(b) for b in again.epoch(EPOCH, state=saved)]
    assert_same_batches(resumed, rest, "resumed inside the segment")
    for s in (saved.step, saved.step + len(rest) - 1):
        assert_same_batches([host(again.batch(EPOCH, s, state=saved))], [resumed[s - saved.step]], f"batch({s})")
    ids = np.concatenate(done + [np.asarray(b[spec.ids]).reshape(-1)[b["mask"].reshape(-1)] for b in resumed])
    assert_same_bits(np.sort(ids), np.arange(NR, dtype=ids.dtype), "every sample once")
    assert again.epoch(EPOCH, state=saved).get_state() == saved
    start = host(next(iter(again.epoch(EPOCH, state=saved.at_step(saved.step - 1)))))  # the control: the
    assert bits_differ(start[spec.ids], rest[0][spec.ids]) is not None  # segment's first row is another batch


def test_logical_shards_resume_on_other_devices_without_a_resize(devices):
    """A state of L = 8 resumes on 2 devices with L = 8 as the same plan (one segment): the same
    batches; without logical shards the 2-device loader resizes (a second segment)."""
    data = {"x": np.arange(N, dtype=np.int32)}
    eight = loaders.make_loader(data, devices, 3, logical_shards=8, shuffle=True, seed=5)
    full = [host(b) for b in eight.epoch(0)]
    it = eight.epoch(0)
    next(it), next(it)
    saved = it.get_state()
    for placement in loaders.PLACEMENTS:
        two = loaders.make_loader(data, devices[:2], 3, logical_shards=8, shuffle=True, seed=5, placement=placement)
        rest = two.epoch(0, state=saved)
        assert_same_batches([host(b) for b in rest], full[2:], placement)
        assert rest.get_state().segments == saved.segments
    plain = loaders.make_loader(data, devices[:2], 3, shuffle=True, seed=5)
    assert len(plain.epoch(0, state=saved).get_state().segments) == 2


@pytest.mark.parametrize("last_batch", ["fill", "drop"])
def test_fewer_samples_left_than_shards_and_a_batch_larger_than_the_rest(devices, last_batch):
    """fill: 4 samples left for 8 shards pad the empty runs; drop: 12 left in runs of 6 < B = 8
    give no step (make_loader's batch rule is a fresh epoch's)."""
    data = {"ids": np.arange(20, dtype=np.int32), "x": np.arange(40, dtype=np.float32).reshape(20, 2)}
    spec = Data(data, None, data, {}, "ids")
    mesh8, _, mesh4 = meshes(devices)
    first = loaders.make_loader(data, mesh4, 2, shuffle=True, seed=1, last_batch=last_batch)
    step = 2 if last_batch == "fill" else 1
    it = first.epoch(0)
    done = [real_ids(next(it), spec) for _ in range(step)]
    saved = it.get_state()
    wide = mesh8 if last_batch == "fill" else loaders.data_mesh(list(mesh8.devices.flat)[:2])
    for placement in loaders.PLACEMENTS:
        later = loaders.make_loader(data, wide, 2 if last_batch == "fill" else 8, shuffle=True, seed=1,
                                    last_batch=last_batch, placement=placement)
        rest = later.epoch(0, state=saved)
        plan = elastic_plan(20, rest.get_state().segments, seed=1, shuffle=True, last_batch=last_batch)[-1]
        batches = list(rest)
        assert len(batches) == len(plan.indices) == (1 if last_batch == "fill" else 0)
        for r, batch in enumerate(batches):
            check_batch(batch, later, plan, r, spec, f"{placement} {last_batch}")
        got = np.sort(np.concatenate(done + [real_ids(b, spec) for b in batches]))
        assert_same_bits(got, np.arange(20, dtype=np.int32) if last_batch == "fill" else np.sort(np.concatenate(done)))


def test_a_state_of_another_run_or_epoch_is_refused_naming_the_field(devices):
    """A state of another run (each field), of another epoch or not a LoaderState is refused
    naming it; random access outside the resumed epoch's steps is an IndexError."""
    spec = dataset("dict", NR)
    loader = chain_loader(devices, 1, spec)
    saved = LoaderState.start(NR, 8, 4, epoch=EPOCH, seed=SEED, shuffle=True).at_step(2)
    others = {"num_samples": LoaderState.start(NR + 1, 8, 4, epoch=EPOCH, seed=SEED, shuffle=True),
              "seed": LoaderState.start(NR, 8, 4, epoch=EPOCH, seed=SEED + 1, shuffle=True),
              "shuffle": LoaderState.start(NR, 8, 4, epoch=EPOCH, seed=SEED),
              "last_batch": LoaderState.start(NR, 8, 4, epoch=EPOCH, seed=SEED, shuffle=True, last_batch="drop")}
    for field, other in others.items():
        assert_raises_naming(ValueError, lambda: loader.epoch(EPOCH, state=other),
                             f"Loader.epoch: the loader state was taken with {field}=")
    assert_raises_naming(ValueError, lambda: loader.epoch(EPOCH + 1, state=saved),
                         "Loader.epoch: epoch=3, but the state is of epoch 2")
    assert_raises_naming(ValueError, lambda: loader.epoch(EPOCH, state=saved.to_json()),
                         "state must be a plan.LoaderState", "got str")
    last = epoch_steps(NR, [(0, 8, 4), (2, 7, 2)])
    for step in (1, last):
        assert_raises_naming(IndexError, lambda: loader.batch(EPOCH, step, state=saved),
                             f"step={step} is outside [2, {last})")
    assert_raises_naming(IndexError, lambda: loader.batch(EPOCH, len(loader)), f"step={len(loader)} is outside")
    assert_raises_naming(ValueError, lambda: loader.real_samples(0, state=saved), "Loader.real_samples: epoch=0")


def test_a_state_of_other_data_of_the_same_size_is_refused_naming_dataset(devices):
    """Every use of a state names the data's digest when it is another's; a state naming no
    data is taken on trust, and the resumed epoch's state names this loader's data."""
    spec = dataset("dict", NR)
    other = {**spec.arrays, "features": spec.arrays["features"][::-1].copy()}  # the same N, other samples
    it = chain_loader(devices, 0, spec).epoch(EPOCH)
    next(it), next(it)
    saved = it.get_state()
    it.close()
    assert saved.dataset == dataset_digest(spec.arrays) and LoaderState.from_json(saved.to_json()) == saved
    loader = chain_loader(devices, 1, spec._replace(data=other))
    for what, call in [("epoch", lambda: loader.epoch(EPOCH, state=saved)),
                       ("batch", lambda: loader.batch(EPOCH, 2, state=saved)),
                       ("real_samples", lambda: loader.real_samples(EPOCH, state=saved))]:
        assert_raises_naming(ValueError, call, f"Loader.{what}: the loader state was taken with "
                             f"dataset='{saved.dataset}', this run has dataset='{dataset_digest(other)}'")
    copy = chain_loader(devices, 1, spec._replace(data={k: v.copy() for k, v in spec.arrays.items()}))
    assert next(iter(copy.epoch(EPOCH, state=saved)))["mask"].shape == (18,)  # 3 devices x 3 slots x 2
    unnamed = loader.epoch(EPOCH, state=dataclasses.replace(saved, dataset=None))
    assert unnamed.get_state().dataset == dataset_digest(other)


def test_a_loader_computes_its_digest_once_and_only_for_states(devices, monkeypatch):
    """plan.dataset_digest runs when a loader first makes or checks a state, and only then."""
    calls = []
    monkeypatch.setattr(loaders, "dataset_digest", lambda arrays: calls.append(1) or dataset_digest(arrays))
    spec = dataset("dict", NR)
    loader = chain_loader(devices, 0, spec, prefetch=0)
    len(loader), loader.plan(EPOCH), loader.real_samples(EPOCH), loader.batch(EPOCH, 0), list(loader.epoch(EPOCH))
    assert calls == [], "no state, no digest"
    it = loader.epoch(EPOCH)
    next(it)
    saved = it.get_state()
    it.get_state(), list(loader.epoch(EPOCH, state=saved)), loader.real_samples(EPOCH, state=saved)
    assert len(calls) == 1, "once a loader"
    chain_loader(devices, 1, spec).epoch(EPOCH).get_state()
    assert len(calls) == 2, "the control: another loader computes its own"


# --------------------------------------------------------------------------
# Refusals: the parameter and the value named
# --------------------------------------------------------------------------


def test_arguments_the_loader_cannot_honour_are_refused_naming_them(devices):
    """Every argument out of its range is refused naming it and the value: shuffle takes only
    a bool (not 1, 0, 1.0 or np.int64(1)), "host_float32" is no placement, normalize only a
    Normalize; the controls are accepted."""
    data = {"x": np.zeros((N, 4), np.float32)}
    pair = (np.zeros((N, 1, 4, 4), np.uint8), np.zeros(N, np.int32))
    cases = [("batch_size", [0, 3.0, True, N // 2 + 1]), ("prefetch", [1.5, -1]),
             ("shuffle", [1, 0, 1.0, np.int64(1), "yes"]), ("placement", ["host_float32"]),
             ("layout", ["rows"]), ("last_batch", ["pad"]), ("seed", [-1, 2**32, 1.0]),
             ("device_budget", [1.5]), ("logical_shards", [3.0, True, "8", 0])]
    for name, values in cases:
        for value in values:
            with pytest.raises(ValueError) as error:
                loaders.make_loader(data, devices[:2], **{"batch_size": B, name: value})
            assert name in str(error.value) and repr(value) in str(error.value), (name, value, str(error.value))
    assert_raises_naming(ValueError, lambda: loaders.make_loader(data, devices[:2], B, logical_shards=0),
                         "must be at least 1")
    assert_raises_naming(ValueError, lambda: loaders.make_loader(data, devices[:3], 3, logical_shards=2),
                         "logical_shards=2 is fewer than the 3 device(s)")
    assert loaders.make_loader(data, devices[:3], 3, logical_shards=8).device_rows == 9  # the control: 3 slots of 3
    assert_raises_naming(ValueError, lambda: loaders.make_loader(data, devices[:2], 13, logical_shards=8),
                         "batch_size=13 per logical shard", "8 logical shards")
    assert_raises_naming(ValueError, lambda: loaders.make_loader(pair, devices, B, normalize=lambda b: b),
                         "normalize=<function", "is not a Normalize")
    assert_raises_naming(ValueError, lambda: loaders.make_loader(pair, devices, B, normalize="rocal"),
                         "normalize='rocal' is not a Normalize")
    assert_raises_naming(ValueError, lambda: loaders.make_loader({"images": pair[0]}, devices, B,
                                                                  normalize={"images": lambda b: b}),
                         "normalize['images']=<function", "is not a Normalize")
    twice = [devices[0], devices[1], devices[0]]
    assert_raises_naming(ValueError, lambda: loaders.make_loader(data, twice, B), "twice")
    assert_raises_naming(ValueError, lambda: loaders.make_loader(data, [], B), "need at least one device")
    grid = jax.sharding.Mesh(np.array(devices[:2]).reshape(1, 2), ("data", "model"))
    assert_raises_naming(ValueError, lambda: loaders.make_loader(data, grid, B), "axis 'data' must hold every device")
    uneven = {"x": np.zeros(17, np.float32)}  # shards of 2 and 3 samples on 8 devices
    assert_raises_naming(ValueError, lambda: loaders.make_loader(uneven, devices, 3, last_batch="drop"),
                         "batch_size=3 per device", "smallest shard (2 samples")
    # The controls: real bools, a batch that fits the smallest shard, L a multiple of n.
    for shuffle in (True, False, np.bool_(True)):
        assert loaders.make_loader(data, devices, B, shuffle=shuffle).shuffle is bool(shuffle)
    assert len(loaders.make_loader(uneven, devices, 2, last_batch="drop")) == 1
    assert loaders.make_loader(data, devices[:2], 12, logical_shards=8).device_rows == 48


def refusal(data, devices, **kwargs) -> str:
    """make_loader's error message for ``data``; fails if it is accepted."""
    with pytest.raises(ValueError) as error:
        loaders.make_loader(data, devices, B, **kwargs)
    assert str(error.value).startswith("make_loader: "), str(error.value)
    return str(error.value)


def test_data_the_loader_cannot_hold_is_refused_by_name(devices):
    """Data make_loader cannot deliver as documented is refused saying why and how to fix it."""
    x = np.zeros((N, 4), np.float32)
    images = np.zeros((N, 1, 4, 4), np.uint8)
    norm = Normalize(mean=(0.0,), std=(1.0,))
    cases = [
        ((x.astype(np.float64), np.zeros(N, np.int32)), {}, "samples of dtype float64"),
        ((x, np.zeros(N, np.int32)), {"normalize": Normalize()}, "pass normalize=None"),
        ((x, np.zeros(N, np.float32)), {"normalize": None}, "labels must be integers"),
        ((x, np.zeros(N - 1, np.int32)), {"normalize": None}, "labels (N,)"),
        ((x.astype(object), np.zeros(N, np.int32)), {"normalize": None}, "samples of dtype object"),
        ((x, np.full(N, 2**31, np.uint32)), {"normalize": None}, "labels must fit int32"),
        *(({"x": x, name: np.ones(N, bool)}, {}, f"named {name!r}") for name in ("mask", "index", "logical_shards")),
        ({}, {}, "empty dict"),
        ({"x": x, 3: x}, {}, "must be strings"),
        ({"x": x, "y": x[:-1]}, {}, "same N samples"),
        ({"x": np.float32(1)}, {}, "must be (N, ...)"),
        ({"images": images}, {"normalize": norm}, "name the arrays to normalise, e.g. normalize={'images'"),
        ({"images": images}, {"normalize": {"pixels": norm}}, "normalize names ['pixels'], which the data lacks"),
        ({"x": x}, {"normalize": {"x": norm}}, "leave 'x' out of normalize"),
        ((images, np.zeros(N, np.int32)), {"normalize": {"labels": norm}}, "normalises only 'images'"),
        (images, {}, "a tuple (samples, labels) or a dict"),
        (np.zeros((2, N), np.int32), {}, "got ndarray (2, 103)"),  # would unpack into two rows
        ((images, images, images), {}, "got tuple"),
        ({"x": x}, {"filename_prefix": "test_batch"}, "picks the files of a CIFAR-10 folder"),
    ]
    for data, kwargs, words in cases:
        assert words in refusal(data, devices, **kwargs), words
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        loaders.make_loader("not a folder", devices, B)
    # The controls: the same arrays, well named, are accepted; so is {"images": Normalize} on the tuple form.
    loaders.make_loader({"x": x, "y": x}, devices, B)
    pair = loaders.make_loader((images, np.zeros(N, np.int32)), devices, B, normalize={"images": norm})
    assert pair.normalize == norm and pair.batch(0, 0)["images"].dtype == np.float32


def test_dtypes_jax_would_convert_are_refused_keeping_their_kind(devices):
    """int64 is told int32 (never float32), uint64 uint32, float64 float32; values beyond int32
    are said not to fit. Tuple-form int64 labels get a dict's int64 array's message."""
    tokens = np.arange(N * 4).reshape(N, 4)  # int64, as np.arange gives
    cases = [
        ({"tokens": tokens}, "data['tokens'] of dtype int64",
         "data['tokens'].astype(np.int32) (keeps them integers; its values fit)"),
        ({"tokens": tokens + 2**40}, "int64", "does not hold its values (range [1099511627776,"),
        ({"ids": tokens.astype(np.uint64)}, "uint64", "data['ids'].astype(np.uint32)"),
        ({"x": tokens.astype(np.float64)}, "float64", "data['x'].astype(np.float32) (rounds each value)"),
        ((tokens, np.zeros(N, np.int32)), "samples of dtype int64", "samples.astype(np.int32)"),
    ]
    for data, *fragments in cases:
        message = refusal(data, devices, normalize=None)
        for fragment in fragments + ["jax_enable_x64"]:
            assert fragment in message, (fragment, message)
        if "int" in fragments[0]:
            assert "float" not in message, message
    x = np.zeros((N, 4), np.float32)
    labels = np.arange(N)  # int64
    assert (refusal((x, labels), devices, normalize=None).replace("labels", "data['labels']")
            == refusal({"x": x, "labels": labels}, devices))


def test_a_normalize_needs_uint8_nchw_images(devices):
    """A Normalize refuses uint8 samples that are not (N, C, H, W), by name and shape, with the
    fix; channels last is told "NCHW expected" and the transpose, which is accepted."""
    rng = np.random.default_rng(2)
    labels = np.zeros(N, np.int32)
    for shape, hint in [((N, 32, 32), "images[:, None]"), ((N, 3072), "reshape them to (N, C, H, W)"),
                        ((N, 1, 3, 32, 32), "")]:
        images = rng.integers(0, 256, shape).astype(np.uint8)
        for data, norm in (((images, labels), Normalize()),
                           ({"pixels": images, "labels": labels}, {"pixels": Normalize()})):
            message = refusal(data, devices, normalize=norm)
            for fragment in ("needs uint8 images (N, C, H, W)", f"uint8 {shape}", hint):
                assert fragment in message, (fragment, message)
    for shape, norm in [((N, 32, 32, 3), Normalize()), ((N, 16, 16, 1), Normalize(mean=(127.5,), std=(127.5,)))]:
        images = rng.integers(0, 256, shape).astype(np.uint8)
        message = refusal((images, labels), devices, normalize=norm)
        assert "NCHW expected" in message and "images.transpose(0, 3, 1, 2)" in message, message
        loaders.make_loader((images.transpose(0, 3, 1, 2), labels), devices, B, normalize=norm)


# --------------------------------------------------------------------------
# The epoch iterator: prefetching, and its end however it comes
# --------------------------------------------------------------------------


def prefetch_threads(before=()) -> list:
    """The prefetch threads running, but those in ``before`` (left by a test that failed)."""
    return [t for t in threading.enumerate() if t.name == "loader-prefetch" and t.is_alive() and t not in before]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_worker_error_reaches_the_consumer(devices, monkeypatch, prefetch):
    """An error making the third chunk of 2 steps is raised at the consumer's fifth next(), after
    four batches, and leaves no thread behind."""
    spec = dataset("dict")
    monkeypatch.setattr(loaders, "CHUNK_STEPS", 2)
    loader = loaders.make_loader(spec.data, devices, B, prefetch=prefetch, normalize=spec.normalize)
    assert loaders.chunk_steps(loader, len(loader)) == 2 and len(loader) == 5
    calls, gather = [], loaders._gather

    def fails_at_step_2(source, indices):
        calls.append(1)
        if len(calls) > 2 * len(spec.arrays):
            raise RuntimeError("gather failed on purpose")
        return gather(source, indices)

    monkeypatch.setattr(loaders, "_gather", fails_at_step_2)
    received, before = 0, prefetch_threads()
    with pytest.raises(RuntimeError, match="on purpose"):
        for _ in loader.epoch(0):
            received += 1
    assert received == 4 and not prefetch_threads(before)


@pytest.mark.parametrize("chunk, programs", [(1, ()), (3, ()), (3, ("cpu",)), (8, ("cpu",))])
def test_prefetch_and_chunks_do_not_change_the_batches(devices, monkeypatch, chunk, programs):
    """An epoch made ahead in chunks of ``chunk`` steps (3: a short last chunk; 8: one chunk, cut
    to the epoch's 5 steps), by a program a step or a program a chunk (CHUNK_PROGRAM_PLATFORMS), is
    the epoch made on demand a step at a time, and so is each step made alone (``Loader.batch``);
    its worker ends with it."""
    spec = dataset("dict")
    loader = loaders.make_loader(spec.data, devices, B, shuffle=True, seed=5, prefetch=2, normalize=spec.normalize)
    monkeypatch.setattr(loaders, "CHUNK_STEPS", 1)
    one = [host(b) for b in dataclasses.replace(loader, prefetch=0).epoch(2)]
    monkeypatch.setattr(loaders, "CHUNK_STEPS", chunk)
    monkeypatch.setattr(loaders, "CHUNK_PROGRAM_PLATFORMS", programs)
    assert len(loader) == 5 and loaders.chunk_steps(loader, 5) == min(chunk, 5)
    before = prefetch_threads()
    assert_same_batches([host(b) for b in loader.epoch(2)], one, f"prefetch 2, chunks of {chunk}")
    assert_same_batches([host(loader.batch(2, s)) for s in range(5)], one, f"batch(), chunks of {chunk}")
    assert not prefetch_threads(before)


def test_a_gather_in_parts_is_the_gather(monkeypatch):
    """Past PARALLEL_GATHER_BYTES ``_gather`` splits its rows over threads: the same bytes as one NumPy gather, from a
    contiguous source and from a strided view, and an error on a thread is raised in the caller."""
    monkeypatch.setattr(loaders, "PARALLEL_GATHER_BYTES", 64)
    source = np.random.default_rng(0).integers(0, 256, (40, 2, 3, 4), np.uint8)
    idx = np.random.default_rng(1).permutation(40)[:33]
    for what, src in (("contiguous", source), ("strided", source.transpose(0, 3, 1, 2))):
        got = loaders._gather(src, idx)
        assert got.ctypes.data % 64 == 0
        assert_same_bits(got, src[idx], what)
    with pytest.raises(IndexError):
        loaders._gather(source.transpose(0, 3, 1, 2), np.array([0, 1, 2, 99] * 8))


@pytest.mark.parametrize("placement, prefetch, chunk", [("host", 1, 1), ("host", 3, 1), ("host", 0, 2), ("host", 1, 2),
                                                        ("device", 2, 2)])
def test_the_loader_holds_no_more_batches_ahead_than_its_depth(devices, monkeypatch, placement, prefetch, chunk):
    """Seen after each next() of a slow consumer, host and device apart. Chunks of ``chunk`` steps prepared (their rows
    gathered and moved, ``_host_rows``) and not yet made into batches: at most ``prefetch``, in placement host, and the
    worker fills them (the control: it reaches ``prefetch``); none in placement device or with prefetch 0. Device
    batches made and not yet taken: the rest of the chunk being taken alone, at most chunk - 1 (the control: reached): a
    chunk's program is queued when its first batch is asked for. A chunk's host rows live only inside its preparing."""
    made, real = [], loaders._step_program
    moved, rows = [], loaders._host_rows

    def counting(*key):
        program = real(*key)
        return lambda *args: (lambda out: made.extend(out[0]) or out)(program(*args))
    monkeypatch.setattr(loaders, "_step_program", counting)
    monkeypatch.setattr(loaders, "_host_rows", lambda *args: moved.append(1) or rows(*args))
    monkeypatch.setattr(loaders, "CHUNK_STEPS", chunk)
    spec = dataset("dict")
    loader = loaders.make_loader(spec.data, devices, B, prefetch=prefetch, placement=placement,
                                 normalize=spec.normalize)
    chunks, batches = [], []
    for taken, _ in enumerate(loader.epoch(0), 1):
        time.sleep(0.05)  # the worker fills what it may
        batched = min(len(made), len(loader))  # a chunk is made whole, or to the epoch's end
        chunks.append(len(moved) - (-(-batched // chunk) if placement == "host" else 0))  # "device" moves none
        batches.append(batched - taken)
    depth = prefetch if placement == "host" else 0
    assert len(batches) == len(loader) > (depth + 1) * chunk
    assert max(chunks) == depth and min(chunks) >= 0, chunks
    assert max(batches) == chunk - 1 and min(batches) >= 0, batches


def test_an_epoch_left_early_ends_its_worker(devices, monkeypatch):
    """close() ends the worker; so does dropping the last reference, at once (the worker holds
    the queue, not the iterator), and a held iterator runs on (the control). Chunks of one step:
    the worker has more to prepare after the first."""
    monkeypatch.setattr(loaders, "CHUNK_STEPS", 1)
    spec = dataset("dict")
    loader = loaders.make_loader(spec.data, devices, B, prefetch=2, normalize=spec.normalize)
    before = prefetch_threads()
    it = loader.epoch(0)
    next(it)
    assert prefetch_threads(before)
    it.close()
    assert not prefetch_threads(before)
    it = loader.epoch(1)
    next(it)
    held, dropped = [it], weakref.ref(it)
    del it
    assert dropped() is not None and prefetch_threads(before)
    held.clear()
    assert dropped() is None and not prefetch_threads(before)
    for _ in loader.epoch(2):
        break
    gc.collect()
    assert not prefetch_threads(before)


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
loaders.CHUNK_STEPS = 1  # a chunk a step: each worker has more to prepare after its first
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
saved = loaders.make_loader(data, devices[:2], 4).epoch(0)
next(saved)
left_open("host, resumed", loader.epoch(0, state=saved.get_state()))
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


@pytest.mark.slow  # a child process: the extended tier
def test_epochs_left_unfinished_at_exit_print_nothing_and_end(tmp_path):
    """Every backend's epoch left unfinished at the interpreter's exit (host epochs with their
    prefetch threads, one never started, a resumed one; "device"; DALI's and rocAL's pipelines
    in both orders, where they import) ends before teardown, printing nothing."""
    import importlib.util
    import os
    import sys
    import time

    from conftest import own_stderr, run_children

    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "child.py"
    script.write_text(EXIT_CHILD)
    started = time.time()
    [child] = run_children([[sys.executable, str(script), here]], timeout=90)
    code, out, err = child
    assert code == 0 and own_stderr(err) == "", f"exit status {code}; stderr:\n{err}\nstdout:\n{out}"
    said = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert int(said["threads running mid-epoch"]) >= 4, out  # the control: the exit check had threads to see
    vendors = [name for name, package in (("dali", "nvidia.dali"), ("rocal", "amd.rocal"))
               if importlib.util.find_spec(package.split(".")[0]) and importlib.util.find_spec(package)]
    for case in ["host", "device"] + [f"{vendor} {order}" for vendor in vendors for order in ("plan", "vendor")]:
        assert repr(case) in said["cases"], (case, out)
    exited = started + child.seconds - float(out.split("main done at ")[1])
    assert exited < 15, f"the child took {exited:.1f} s to exit after its last line"


@pytest.mark.parametrize("placement", loaders.PLACEMENTS)
def test_a_resume_at_any_step_runs_the_programs_its_epoch_compiled(devices, placement):
    """Resumed at steps 1, 2 and 3 of a 5-step epoch (not at a resize), and read by random access
    with ``batch(..., state=)``, an epoch compiles nothing its fresh run did not: the plan is placed
    whole, whatever the steps left. The same batches as the fresh epoch's. The control: another
    batch size is another program, and the listener hears it compile."""
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiled.append(kw.get("fun_name")) if event.endswith("backend_compile_duration")
        else None)
    data = {"x": np.arange(40, dtype=np.float32).reshape(20, 2), "y": np.arange(20, dtype=np.int32)}
    loader = loaders.make_loader(data, devices[:2], 2, shuffle=True, seed=4, placement=placement, prefetch=0)
    it = loader.epoch(0)
    fresh, states = [], []
    for batch in it:
        fresh.append(host(batch))
        states.append(it.get_state())
    assert len(fresh) == 5
    mark = len(compiled)
    for step in (1, 2, 3):
        assert_same_batches([host(b) for b in loader.epoch(0, state=states[step - 1])], fresh[step:], placement)
        assert_same_batches([host(loader.batch(0, step, state=states[step - 1]))], fresh[step:step + 1], placement)
    assert compiled[mark:] == [], compiled[mark:]
    other = loaders.make_loader(data, devices[:2], 1, shuffle=True, seed=4, placement=placement, prefetch=0)
    jax.block_until_ready(other.batch(0, 0))
    assert len(compiled) > mark


@pytest.mark.parametrize("placement", loaders.PLACEMENTS)
def test_after_its_first_step_an_epoch_moves_nothing_implicitly(devices, placement):
    """A step's index s reaches the devices as the step before made it (``loaders._counted``), never as a host scalar
    (an implicit transfer at every call: 0.17 ms on a TPU v5e); a step's only transfers are its rows', explicit, in
    placement host. Held by JAX's transfer guard, which refuses implicit host-to-device transfers: every step of an
    epoch after its first, made in this thread (prefetch 0), passes under it. The control: the guard refuses a jit
    called with a host scalar."""
    data = {"x": np.arange(40, dtype=np.float32).reshape(20, 2), "y": np.arange(20, dtype=np.int32)}
    loader = loaders.make_loader(data, devices[:2], 2, shuffle=True, seed=4, placement=placement, prefetch=0)
    it = loader.epoch(0)
    first = next(it)
    with jax.transfer_guard_host_to_device("disallow"):
        rest = [host(batch) for batch in it]
    assert len(rest) == len(loader) - 1 == 4
    with pytest.raises(Exception, match="host-to-device"), jax.transfer_guard_host_to_device("disallow"):
        jax.jit(lambda x, s: x + s)(first["y"], np.int32(1))
