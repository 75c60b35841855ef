"""loaders.make_loader over any arrays, not only uint8 images.

Guarantees checked (the loader's, test_loaders.py, held on other samples):

* the tuple form: float32 features (N, 40), int8 features (N, 4, 4) and uint8
  images without normalisation come out bit for bit as stored, in their dtype;
  dict datasets of named arrays: token ids (N, 48) int32 with per-token targets
  (N, 48) int32, float features (N, 40) float32 with float targets (N,)
  float32, and uint8 images (normalised: crop, mirror) with labels. For each,
  block k of every name at step s is ``f(data[name][plan.indices[s, k]])`` on
  the device at mesh position k (f: the name's Normalize, else the identity),
  with the plan's mask, for every placement and both layouts, shuffled or not,
  fill or drop; a batch holds the data's names in order, then "mask";
* for the dict datasets, in every placement and layout: every sample exactly
  once over a fill epoch (read from the delivered rows, which carry their
  index; a negative control loses one), resuming at a step gives the epoch's
  tail, ``batch(e, s)`` is step s, shapes, dtypes and sharding are the
  documented ones, and on a permuted list of devices block k is on list
  position k; the three placements give bit-identical epochs;
* what the loader cannot honour is refused with a message naming the
  parameter, the value and the fix: dtypes JAX would convert (int64 token ids
  are told int32, never float32; uint64 uint32; float64 float32; values beyond
  int32 said not to fit), a Normalize on samples that are not uint8 (N, C, H,
  W) (flat rows, (N, H, W), 5-d; channels-last images: "NCHW expected" and the
  transpose), a key "mask", an empty dict, names that are not strings, arrays
  of different N, a bare Normalize for a dict dataset, a normalize naming a
  missing key, a callable on a placement other than host_float32 or breaking
  its contract, non-int batch sizes, a non-bool shuffle; the device budget
  counts every array's bytes;
* the reference loader over float features that encode their index conforms
  (conformance.describe_epoch finds nothing), in both layouts.

conformance.py's own checks on any sample and any partition: test_conformance.py.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import conformance
import encoding
import loaders
from arithmetic import Normalize
from conftest import assert_same_bits, examples
from plan import LAST_BATCH_POLICIES, epoch_plan


N = 103  # shards of 12/13 on 8 devices: uneven, so fill pads
B = 3
TUPLES = ["float32", "int8", "uint8"]  # the tuple form (samples, labels)
DICTS = ["tokens", "regression", "images"]  # dict datasets of named arrays


def samples(kind: str, count: int = N):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, count).astype(np.int64)  # int64 in, int32 out
    if kind == "float32":
        return rng.standard_normal((count, 40), dtype=np.float32), labels
    if kind == "int8":
        return rng.integers(-128, 128, (count, 4, 4)).astype(np.int8), labels
    return rng.integers(0, 256, (count, 1, 16, 16)).astype(np.uint8), labels  # raw images


def dataset(kind: str, count: int = N):
    """(data, normalize, the name whose rows carry the sample index: row i holds i).

    tokens: token ids (N, 48) int32 (vocabulary 500, the first token is the
    index) with per-token targets (N, 48) int32 (the next token); regression:
    float features (N, 40) float32 with float targets (N,) float32 (target i is
    i); images: uint8 (N, 3, 8, 8) normalised (crop, mirror) with int32 labels
    (N,) (label i is i)."""
    rng = np.random.default_rng(1)
    index = np.arange(count)
    if kind in TUPLES:
        return samples(kind, count), None, None
    if kind == "tokens":
        tokens = rng.integers(0, 500, (count, 48)).astype(np.int32)
        tokens[:, 0] = index
        return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1)}, None, "tokens"
    if kind == "regression":
        return ({"features": rng.standard_normal((count, 40), dtype=np.float32),
                 "targets": index.astype(np.float32)}, None, "targets")
    images = rng.integers(0, 256, (count, 3, 8, 8)).astype(np.uint8)
    norm = Normalize(crop=(6, 7), crop_pos=(0.25, 0.5), mirror=True)
    return {"images": images, "labels": index.astype(np.int32)}, {"images": norm}, "labels"


def named(data) -> dict:
    """What a loader over ``data`` delivers by name (before normalisation)."""
    if isinstance(data, dict):
        return data
    return {"images": data[0], "labels": data[1].astype(np.int32)}


def expected(data, normalize, name: str, idx: np.ndarray) -> np.ndarray:
    rows = named(data)[name][idx]
    norm = (normalize or {}).get(name)
    return rows if norm is None else norm(rows)


def block(array, k: int, layout: str, B: int = B) -> np.ndarray:
    """Shard k's block of a global array, from the shard on the device that holds it."""
    x = np.asarray(array)
    return x[k * B:(k + 1) * B] if layout == "sharded" else x[k]


@settings(max_examples=examples(10))
@given(kind=st.sampled_from(TUPLES + DICTS), layout=st.sampled_from(loaders.LAYOUTS),
       shuffle=st.booleans(), last_batch=st.sampled_from(LAST_BATCH_POLICIES),
       seed=st.integers(0, 2**32 - 1), epoch=st.integers(0, 3))
def test_any_samples_follow_the_plan_in_every_placement(devices, kind, layout, shuffle, last_batch,
                                                         seed, epoch):
    data, normalize, _ = dataset(kind)
    n = len(devices)
    plan = epoch_plan(N, n, B, epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch)
    epochs = {}
    for placement in loaders.PLACEMENTS:
        loader = loaders.make_loader(data, devices, B, layout=layout, shuffle=shuffle,
                                     seed=seed, last_batch=last_batch, normalize=normalize,
                                     placement=placement)
        epochs[placement] = [{k: np.asarray(v) for k, v in b.items()} for b in loader.epoch(epoch)]
        assert len(epochs[placement]) == len(loader) == plan.indices.shape[0]
    for placement, batches in epochs.items():
        for s, batch in enumerate(batches):
            assert list(batch) == [*named(data), "mask", "index", "logical_shards"], list(batch)
            for k in range(n):
                idx = plan.indices[s, k]
                for name in named(data):
                    assert_same_bits(block(batch[name], k, layout), expected(data, normalize, name, idx),
                                     f"{placement}, step {s}, shard {k}, {name}")
                assert_same_bits(block(batch["mask"], k, layout), plan.mask[s, k], "mask")
            for name in batch:
                assert_same_bits(batch[name], epochs["host"][s][name], f"{placement} vs host, step {s}, {name}")


@pytest.mark.parametrize("layout", loaders.LAYOUTS)
@pytest.mark.parametrize("kind", DICTS)
def test_named_arrays_keep_the_plans_guarantees_in_every_placement(devices, kind, layout):
    # Every sample exactly once (fill), read from the delivered rows themselves;
    # resume at a step; random access; block k on the kth device of a permuted
    # list; shapes, dtypes and sharding; the three placements bit for bit.
    data, normalize, carrier = dataset(kind)
    order = [devices[i] for i in (5, 2, 7, 0, 3, 6, 1, 4)] if len(devices) == 8 else devices[::-1]
    n, epoch = len(order), 2
    mesh = loaders.data_mesh(order)
    epochs = {}
    for placement in loaders.PLACEMENTS:
        loader = loaders.make_loader(data, order, B, layout=layout, shuffle=True, seed=7,
                                     normalize=normalize, placement=placement)
        plan = loader.plan(epoch)
        whole = list(loader.epoch(epoch))
        epochs[placement] = whole
        seen = []
        for s, batch in enumerate(whole):
            assert list(batch) == [*data, "mask", "index", "logical_shards"]
            for k in range(n):
                assert_same_bits(block(batch["index"], k, layout), plan.indices[s, k].astype(np.int32), "index")
                assert_same_bits(block(batch["logical_shards"], k, layout, 1), np.array([k], np.int32), "shards")
            for name, array in batch.items():
                if name in ("index", "logical_shards"):
                    continue
                rows = (n * B,) if layout == "sharded" else (n, B)
                want = expected(data, normalize, name, plan.indices[s, 0]) if name != "mask" else plan.mask[s, 0]
                assert array.shape == rows + want.shape[1:] and array.dtype == want.dtype, (name, array.shape)
                assert array.sharding == NamedSharding(mesh, P("data")), name
                for shard in array.addressable_shards:
                    k = order.index(shard.device)  # the device at list position k holds block k
                    got = np.asarray(shard.data) if layout == "sharded" else np.asarray(shard.data)[0]
                    want = plan.mask[s, k] if name == "mask" else expected(data, normalize, name, plan.indices[s, k])
                    assert_same_bits(got, want, f"{placement}, step {s}, block {k}, {name}")
            carried = np.asarray(batch[carrier]).reshape(n * B, -1)[:, 0]
            seen.extend(carried[np.asarray(batch["mask"]).reshape(-1)].astype(np.int64).tolist())
        assert sorted(seen) == list(range(N)), f"{placement}: not every sample exactly once"
        tail = list(loader.epoch(epoch, start_step=3))
        assert len(tail) == len(whole) - 3
        for s, batch in enumerate(tail, start=3):
            for name in batch:
                assert_same_bits(batch[name], whole[s][name], f"{placement}: resumed step {s}, {name}")
        for name, array in loader.batch(epoch, 1).items():
            assert_same_bits(array, whole[1][name], f"{placement}: batch({epoch}, 1), {name}")
    for placement, batches in epochs.items():
        for s, batch in enumerate(batches):
            for name in batch:
                assert_same_bits(batch[name], epochs["host"][s][name], f"{placement} vs host, step {s}, {name}")


def test_the_exactly_once_check_sees_a_lost_sample(devices):
    # Negative control for the test above: the same reading of the carried index
    # flags an epoch in which one real slot repeats another sample.
    data, _, carrier = dataset("regression")
    loader = loaders.make_loader(data, devices, B, shuffle=True, seed=7, normalize=None)
    seen = []
    for s, batch in enumerate(loader.epoch(2)):
        carried = np.asarray(batch[carrier]).reshape(-1)
        mask = np.asarray(batch["mask"])
        if s == 0:
            carried = carried.copy()
            carried[0] = carried[1]
        seen.extend(carried[mask].astype(np.int64).tolist())
    assert sorted(seen) != list(range(N))


@pytest.mark.parametrize("placement", loaders.PLACEMENTS)
def test_float_features_resume_random_access_and_device_order(devices, placement):
    data, labels = samples("float32")
    order = [devices[i] for i in (5, 2, 7, 0)] if len(devices) >= 8 else devices[::-1]
    loader = loaders.make_loader((data, labels), order, B, shuffle=True, seed=9, normalize=None,
                                 placement=placement)
    whole = list(loader.epoch(2))
    tail = list(loader.epoch(2, start_step=3))
    assert len(tail) == len(whole) - 3
    for s, batch in enumerate(tail, start=3):
        for name in batch:
            np.testing.assert_array_equal(np.asarray(batch[name]), np.asarray(whole[s][name]))
            np.testing.assert_array_equal(np.asarray(loader.batch(2, s)[name]), np.asarray(batch[name]))
    plan = loader.plan(2)
    for shard in whole[1]["images"].addressable_shards:
        k = order.index(shard.device)  # the device at list position k holds shard k's block
        np.testing.assert_array_equal(np.asarray(shard.data), data[plan.indices[1, k]])


def refusal(data, devices, **kwargs) -> str:
    """make_loader's error message for ``data``; fails if it is accepted."""
    with pytest.raises(ValueError) as error:
        loaders.make_loader(data, devices, B, **kwargs)
    return str(error.value)


def test_bad_data_is_refused_by_name(devices):
    features, labels = samples("float32")
    cases = [
        ((features.astype(np.float64), labels), {}, "samples of dtype float64"),
        ((features, labels), {"normalize": Normalize()}, "pass normalize=None"),
        ((features, labels.astype(np.float32)), {"normalize": None}, "labels must be integers"),
        ((features, labels[:-1]), {"normalize": None}, "labels (N,)"),
        ((features.astype(object), labels), {"normalize": None}, "samples of dtype object"),
    ]
    for data, kwargs, words in cases:
        message = refusal(data, devices, **kwargs)
        assert words in message and "make_loader" in message, message


def test_dtypes_jax_would_convert_are_refused_keeping_their_kind(devices):
    # Integers stay integers: int64 token ids are told int32 (never float32), uint64
    # uint32, float64 float32; values beyond int32 are said not to fit.
    tokens = np.arange(N * 4).reshape(N, 4)  # int64, as np.arange gives
    cases = [
        ({"tokens": tokens}, "data['tokens'] of dtype int64", "data['tokens'].astype(np.int32) (keeps them integers; its values fit)"),
        ({"tokens": tokens + 2**40}, "int64", "does not hold its values (range [1099511627776,"),
        ({"ids": tokens.astype(np.uint64)}, "uint64", "data['ids'].astype(np.uint32)"),
        ({"x": tokens.astype(np.float64)}, "float64", "data['x'].astype(np.float32) (rounds each value)"),
        ((tokens, np.zeros(N, np.int32)), "samples of dtype int64", "samples.astype(np.int32)"),
    ]
    for data, *fragments in cases:
        message = refusal(data, devices, normalize=None)
        for fragment in fragments + ["make_loader", "jax_enable_x64"]:
            assert fragment in message, (fragment, message)
        if "int" in fragments[0]:
            assert "float" not in message, message  # integers are never told to become floats


def test_a_normalize_needs_uint8_nchw_images(devices):
    # The issue-22 guarantee: a Normalize refuses uint8 samples that are not (N, C, H, W),
    # by name and shape (not a bare unpacking error), with the fix.
    rng = np.random.default_rng(2)
    labels = np.zeros(N, np.int32)
    for shape, hint in [((N, 32, 32), "images[:, None]"), ((N, 3072), "reshape them to (N, C, H, W)"),
                        ((N, 1, 3, 32, 32), "")]:
        images = rng.integers(0, 256, shape).astype(np.uint8)
        for data, norm in (((images, labels), Normalize()),
                           ({"pixels": images, "labels": labels}, {"pixels": Normalize()})):
            message = refusal(data, devices, normalize=norm)
            for fragment in ("make_loader", "needs uint8 images (N, C, H, W)", f"uint8 {shape}", hint):
                assert fragment in message, (fragment, message)
    # Channels last: "NCHW expected" and the transpose that fixes it, 3 channels and 1.
    for shape, norm in [((N, 32, 32, 3), Normalize()),
                        ((N, 16, 16, 1), Normalize(mean=(127.5,), std=(127.5,)))]:
        images = rng.integers(0, 256, shape).astype(np.uint8)
        message = refusal((images, labels), devices, normalize=norm)
        assert "NCHW expected" in message and "images.transpose(0, 3, 1, 2)" in message, message
        fixed = images.transpose(0, 3, 1, 2)
        loaders.make_loader((fixed, labels), devices, B, normalize=norm)  # the fix is accepted


def test_dict_datasets_are_refused_by_name(devices):
    x = np.zeros((N, 4), np.float32)
    images = np.zeros((N, 1, 4, 4), np.uint8)
    norm = Normalize(mean=(0.0,), std=(1.0,))
    cases = [
        ({"x": x, "mask": np.ones(N, bool)}, {}, "named 'mask'"),
        ({}, {}, "empty dict"),
        ({"x": x, 3: x}, {}, "must be strings"),
        ({"x": x, "y": x[:-1]}, {}, "same N samples"),
        ({"x": np.float32(1)}, {}, "must be (N, ...)"),
        ({"images": images}, {"normalize": norm}, "name the arrays to normalise, e.g. normalize={'images'"),
        ({"images": images}, {"normalize": {"pixels": norm}}, "normalize names ['pixels'], which the data lacks"),
        ({"x": x}, {"normalize": {"x": norm}}, "leave 'x' out of normalize"),
        ({"images": images}, {"normalize": {"images": lambda b: b}}, "needs placement='host_float32'"),
        ((images, np.zeros(N, np.int32)), {"normalize": {"labels": norm}}, "normalises only 'images'"),
        ("not a folder", {}, "is not a directory"),
        (images, {}, "a tuple (samples, labels) or a dict"),
        (np.zeros((2, N), np.int32), {}, "got ndarray (2, 103)"),  # would unpack into two rows
        ((images, images, images), {}, "got tuple"),
        ({"x": x}, {"filename_prefix": "test_batch"}, "picks the files of a CIFAR-10 folder"),
    ]
    for data, kwargs, words in cases:
        with pytest.raises((ValueError, FileNotFoundError)) as error:
            loaders.make_loader(data, devices, B, **kwargs)
        assert words in str(error.value), (words, str(error.value))
    # Controls: the same arrays, well named, are accepted; so is {"images": Normalize} on the tuple form.
    loaders.make_loader({"x": x, "y": x}, devices, B)
    loaders.make_loader({"images": images}, devices, B, normalize={"images": norm})
    pair = loaders.make_loader((images, np.zeros(N, np.int32)), devices, B, normalize={"images": norm})
    assert pair.normalize == norm and pair.batch(0, 0)["images"].dtype == np.float32


def test_other_arguments_the_loader_cannot_honour_are_refused(devices):
    data = {"x": np.zeros((N, 4), np.float32)}
    pair = (data["x"], np.zeros(N, np.int32))
    for data, kwargs, words in [(data, {"batch_size": 3.0}, "batch_size must be an int"),
                                (data, {"batch_size": True}, "batch_size must be an int"),
                                (data, {"shuffle": "yes"}, "shuffle must be a bool"),
                                (data, {"prefetch": 1.5}, "prefetch must be an int"),
                                (pair, {"normalize": "rocal"}, "normalize='rocal' is not a Normalize")]:
        with pytest.raises(ValueError) as error:
            loaders.make_loader(data, devices, **{"batch_size": B, **kwargs})
        assert words in str(error.value) and "make_loader" in str(error.value), str(error.value)


def test_a_callable_normalize_that_breaks_its_contract_is_refused(devices):
    images, labels = samples("uint8")
    for bad, words in [(lambda b: b.astype(np.float64), "float64"), (lambda b: b[:-1], "B=3")]:
        loader = loaders.make_loader((images, labels), devices, B, normalize=bad, placement="host_float32",
                                     prefetch=0)
        with pytest.raises(ValueError, match="returned") as error:
            loader.batch(0, 0)
        assert words in str(error.value), str(error.value)
    good = loaders.make_loader((images, labels), devices, B, normalize=lambda b: b.astype(np.float32),
                               placement="host_float32")
    assert good.batch(0, 0)["images"].dtype == np.float32  # the control: a callable within its contract


def test_device_budget_counts_every_arrays_bytes(devices):
    data, _, _ = dataset("tokens")  # two int32 (N, 48) arrays: 384 bytes a sample
    per_device = -(-N // len(devices)) * 2 * 48 * 4
    loaders.make_loader(data, devices, B, placement="device", device_budget=per_device)  # fits exactly
    with pytest.raises(ValueError, match="over the budget"):
        loaders.make_loader(data, devices, B, placement="device", device_budget=per_device - 1)


def test_device_budget_counts_the_samples_bytes(devices):
    features, labels = samples("float32")
    per_device = -(-N // len(devices)) * (40 * 4 + 4)
    loaders.make_loader((features, labels), devices, B, normalize=None, placement="device",
                        device_budget=per_device)  # fits exactly
    with pytest.raises(ValueError, match="over the budget"):
        loaders.make_loader((features, labels), devices, B, normalize=None, placement="device",
                            device_budget=per_device - 1)


# --------------------------------------------------------------------------
# The reference loader through conformance.py
# --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", loaders.LAYOUTS)
def test_the_reference_loader_on_encoded_float_features_conforms(devices, layout):
    N, B, n = 203, 4, len(devices)
    features = encoding.encoded_images(np.arange(N), (40,), np.float32)
    loader = loaders.make_loader((features, np.arange(N) % 3), devices, B, layout=layout, shuffle=True,
                                 seed=3, normalize=None)
    batches = list(loader.epoch(1))
    decoded = np.stack([encoding.decode_indices(b.reshape((-1,) + b.shape[2:]), None).reshape(n, B)
                        for b in (conformance.shard_blocks(x["images"], n, layout) for x in batches)])
    masks = np.stack([conformance.shard_blocks(x["mask"], n, layout) for x in batches])
    np.testing.assert_array_equal(decoded, loader.plan(1).indices)
    found = conformance.describe_epoch(decoded, N, B, shuffle=True, last_batch="fill", length=len(loader),
                                       masks=masks)
    assert not found, found.report()
