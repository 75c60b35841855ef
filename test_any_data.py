"""loaders.make_loader and conformance.py over any arrays, not only uint8 images.

Guarantees checked (the loader's, test_loaders.py, held on other samples):

* float32 features (N, 40), int8 features (N, 4, 4) and uint8 images without
  normalisation (``normalize=None``) come out bit for bit as stored, in their
  dtype: shard k's block at step s is ``samples[plan.indices[s, k]]`` on the
  device at mesh position k, with the plan's labels and mask, for every
  placement and both layouts, shuffled or not, fill or drop;
* the three placements give bit-identical epochs; resuming at a step
  (``epoch(e, start_step=s)``) gives the epoch's tail; ``batch(e, s)`` is the
  epoch's step s; on a permuted list of CPU devices the blocks follow the list;
* bad data is refused with a message naming the parameter: float64 features
  (JAX would convert them), a Normalize on features, float labels, object
  arrays, labels of another length;
* conformance: index encoding round-trips for any sample shape (uint8 and
  float), through a Normalize for images; strided partitions (k::n) pass the
  "every sample exactly once" mode and fail the contiguous one; the plan's own
  layout (steps, n, B) is accepted, bad input is refused clearly, and every
  finding names real steps.
"""

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import conformance
import loaders

N = 103  # shards of 12/13 on 8 devices: uneven, so fill pads
B = 3


def samples(kind: str, count: int = N):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, count).astype(np.int64)  # int64 in, int32 out
    if kind == "float32":
        return rng.standard_normal((count, 40), dtype=np.float32), labels
    if kind == "int8":
        return rng.integers(-128, 128, (count, 4, 4)).astype(np.int8), labels
    return rng.integers(0, 256, (count, 1, 16, 16)).astype(np.uint8), labels  # raw images


def block(array, k: int, layout: str, B: int = B) -> np.ndarray:
    """Shard k's block of a global array, from the shard on the device that holds it."""
    x = np.asarray(array)
    return x[k * B:(k + 1) * B] if layout == "sharded" else x[k]


@settings(max_examples=10)
@given(kind=st.sampled_from(["float32", "int8", "uint8"]), layout=st.sampled_from(loaders.LAYOUTS),
       shuffle=st.booleans(), last_batch=st.sampled_from(loaders.LAST_BATCH_POLICIES),
       seed=st.integers(0, 2**32 - 1), epoch=st.integers(0, 3))
def test_any_samples_follow_the_plan_in_every_placement(devices, kind, layout, shuffle, last_batch,
                                                         seed, epoch):
    data, labels = samples(kind)
    n = len(devices)
    plan = loaders.epoch_plan(N, n, B, epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch)
    epochs = {}
    for placement in loaders.PLACEMENTS:
        loader = loaders.make_loader((data, labels), devices, B, layout=layout, shuffle=shuffle,
                                     seed=seed, last_batch=last_batch, normalize=None,
                                     placement=placement)
        epochs[placement] = [jax.tree.map(np.asarray, b) for b in loader.epoch(epoch)]
        assert len(epochs[placement]) == len(loader) == plan.indices.shape[0]
    for placement, batches in epochs.items():
        for s, batch in enumerate(batches):
            assert batch["images"].dtype == data.dtype and batch["labels"].dtype == np.int32
            for k in range(n):
                idx = plan.indices[s, k]
                np.testing.assert_array_equal(block(batch["images"], k, layout), data[idx])
                np.testing.assert_array_equal(block(batch["labels"], k, layout), labels[idx])
                np.testing.assert_array_equal(block(batch["mask"], k, layout), plan.mask[s, k])
            for name in batch:
                np.testing.assert_array_equal(batch[name], epochs["host"][s][name],
                                              err_msg=f"{placement} vs host, step {s}, {name}")


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


def test_bad_data_is_refused_by_name(devices):
    features, labels = samples("float32")
    cases = [
        ((features.astype(np.float64), labels), {}, "samples of dtype float64"),
        ((features, labels), {"normalize": loaders.Normalize()}, "pass normalize=None"),
        ((features, labels.astype(np.float32)), {"normalize": None}, "labels must be integers"),
        ((features, labels[:-1]), {"normalize": None}, "labels (N,)"),
        ((features.astype(object), labels), {"normalize": None}, "samples of dtype object"),
    ]
    for data, kwargs, words in cases:
        with pytest.raises(ValueError, match=None) as error:
            loaders.make_loader(data, devices, B, **kwargs)
        assert words in str(error.value) and "make_loader" in str(error.value), str(error.value)


def test_device_budget_counts_the_samples_bytes(devices):
    features, labels = samples("float32")
    per_device = -(-N // len(devices)) * (40 * 4 + 4)
    loaders.make_loader((features, labels), devices, B, normalize=None, placement="device",
                        device_budget=per_device)  # fits exactly
    with pytest.raises(ValueError, match="over the budget"):
        loaders.make_loader((features, labels), devices, B, normalize=None, placement="device",
                            device_budget=per_device - 1)


# --------------------------------------------------------------------------
# conformance.py for any loader
# --------------------------------------------------------------------------


@pytest.mark.parametrize("shape, dtype, normalize", [
    ((3, 32, 32), np.uint8, loaders.Normalize(mirror=True)),
    ((3, 32, 32), np.uint8, loaders.Normalize(crop=(20, 24), arithmetic="dali_cpu")),
    ((1, 16, 16), np.uint8, loaders.Normalize(mean=(0.0,), std=(255.0,), arithmetic="dali_cpu")),
    ((1, 16, 16), np.uint8, None),
    ((40,), np.uint8, None),
    ((40,), np.float32, None),
    ((4, 4), np.int16, None),
    ((2,), np.float16, None),
])
def test_indices_round_trip_for_any_sample(shape, dtype, normalize):
    limit = conformance.index_limit(shape, dtype)
    indices = np.array([0, 1, 255, 256, 1000, limit - 1]) % limit
    samples = conformance.encoded_images(indices, shape, dtype)
    assert samples.shape == (len(indices),) + shape and samples.dtype == dtype
    delivered = samples if normalize is None else normalize(samples)
    np.testing.assert_array_equal(conformance.decode_indices(delivered, normalize), indices)
    # Control: a sample whose digit-carrying part is not flat decodes to -1.
    broken = np.array(delivered, copy=True)
    broken.reshape(len(broken), -1)[1, 0] += 1
    assert conformance.decode_indices(broken, normalize)[1] == -1
    with pytest.raises(ValueError, match=r"index_limit"):
        conformance.encoded_images([limit], shape, dtype)


def test_index_limits_are_the_exact_integers_of_each_dtype():
    assert conformance.index_limit((1, 16, 16), np.uint8) == 65536
    assert conformance.index_limit((40,), np.float32) == 2**24
    assert conformance.index_limit((40,), np.float16) == 2048
    # 2**24 + 1 is the first integer float32 cannot hold: the limit is where encoding breaks.
    assert np.float32(2**24 + 1) == np.float32(2**24)
    assert conformance.index_limit((1,), np.uint8) == 0  # one byte cannot hold two digits


def strided_epoch(N, n, B, drop_last=False):
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
    assert steps == {0} and "sample 1 at step 0 of shard 0 and step 0 of shard 1" in text
    assert "0 step(s)" not in found.report()
    short = [delivered[:, k] for k in range(n)]
    short[3] = short[3][:-1]
    found = conformance.describe_epoch(short, N, B, partition="any", shuffle=False, last_batch="fill",
                                       length=len(delivered), masks=[masks[:, k] for k in range(n)])
    assert "batches arrived" in found.kinds
    outside = delivered.copy()
    outside[2, 5, 1] = N + 7
    assert "outside the dataset" in conformance.describe_epoch(outside, N, B, partition="any", **args).kinds


def test_the_plan_layout_is_accepted_and_bad_input_is_refused_clearly():
    N, n, B = 13, 2, 2
    plan = loaders.epoch_plan(N, n, B)
    args = dict(shuffle=False, last_batch="fill", length=4)
    assert not conformance.describe_epoch(plan.indices, N, B, masks=plan.mask, **args)
    listed = conformance.describe_epoch([plan.indices[:, k] for k in range(n)], N, B,
                                        masks=[plan.mask[:, k] for k in range(n)], **args)
    assert not listed
    bad = [((plan.indices[:, 0], N, B), {}, "must be (steps, n, B) like Plan.indices"),
           ((plan.indices, N, 3), {}, "B = batch_size = 3"),
           ((plan.indices.astype(float), N, B), {}, "must hold integer values"),
           ((plan.indices, N, B), {"masks": plan.mask[:, :1]}, "masks has 1 shards, delivered 2"),
           ((plan.indices, N, B), {"partition": "strided"}, "partition must be one of"),
           (([np.zeros(4, np.int64)], N, B), {}, "delivered[0] must be (steps, B)")]
    for positional, kwargs, words in bad:
        with pytest.raises(ValueError) as error:
            conformance.describe_epoch(*positional, **{**args, **kwargs})
        assert words in str(error.value) and "describe_epoch" in str(error.value), str(error.value)


def test_every_finding_names_its_steps():
    N, n, B = 13, 2, 2
    plan = loaders.epoch_plan(N, n, B)
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


def test_shard_blocks_in_both_layouts():
    x = np.arange(24).reshape(12, 2)
    np.testing.assert_array_equal(conformance.shard_blocks(x, 3)[1], x[4:8])
    np.testing.assert_array_equal(conformance.shard_blocks(x.reshape(3, 4, 2), 3, "pmap")[2], x[8:])
    with pytest.raises(ValueError, match="num_shards = 5"):
        conformance.shard_blocks(x, 5)
    with pytest.raises(ValueError, match="'pmap' batch must be"):
        conformance.shard_blocks(x, 3, "pmap")


@pytest.mark.parametrize("layout", loaders.LAYOUTS)
def test_the_reference_loader_on_encoded_float_features_conforms(devices, layout):
    N, B, n = 203, 4, len(devices)
    features = conformance.encoded_images(np.arange(N), (40,), np.float32)
    loader = loaders.make_loader((features, np.arange(N) % 3), devices, B, layout=layout, shuffle=True,
                                 seed=3, normalize=None)
    batches = list(loader.epoch(1))
    decoded = np.stack([conformance.decode_indices(b.reshape((-1,) + b.shape[2:]), None).reshape(n, B)
                        for b in (conformance.shard_blocks(x["images"], n, layout) for x in batches)])
    masks = np.stack([conformance.shard_blocks(x["mask"], n, layout) for x in batches])
    np.testing.assert_array_equal(decoded, loader.plan(1).indices)
    found = conformance.describe_epoch(decoded, N, B, shuffle=True, last_batch="fill", length=len(loader),
                                       masks=masks)
    assert not found, found.report()
