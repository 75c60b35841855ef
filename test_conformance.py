"""conformance.py: the describer every vendor conformance test relies on.

Each check is shown to fire on a hand-made wrong epoch (a negative control),
and to stay silent on the plan itself, so an empty report from a vendor's
conformance test means something. The decoder is shown to recover indices
through both vendors' arithmetic and to refuse images that encode nothing.
"""

import numpy as np
import pytest

import conformance
import loaders

N, n, B = 13, 2, 2  # shards [0, 6) and [6, 13); 4 fill steps, 3 drop steps


def plan_delivery(last_batch="fill", shuffle=False):
    plan = loaders.epoch_plan(N, n, B, last_batch=last_batch)
    delivered = [plan.indices[:, k].copy() for k in range(n)]
    if shuffle:
        rng = np.random.default_rng(0)
        for k, d in enumerate(delivered):  # shuffle the real slots, keep padding at the end
            real = plan.mask[:, k].ravel()
            flat = d.ravel()
            flat[real] = rng.permutation(flat[real])
    return delivered, [plan.mask[:, k].copy() for k in range(n)]


def kinds(delivered, masks=None, *, last_batch="fill", shuffle=False, length=None):
    length = loaders.num_steps(N, n, B, last_batch) if length is None else length
    return set(conformance.describe_epoch(delivered, N, B, shuffle=shuffle, last_batch=last_batch,
                                          length=length, masks=masks).kinds)


@pytest.mark.parametrize("last_batch", ["fill", "drop"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_the_plan_conforms(last_batch, shuffle):
    delivered, masks = plan_delivery(last_batch, shuffle)
    assert kinds(delivered, masks, last_batch=last_batch, shuffle=shuffle) == set()
    assert kinds(delivered, None, last_batch=last_batch, shuffle=shuffle) == set()


def test_a_wrong_reported_length_and_missing_batches():
    delivered, masks = plan_delivery()
    assert kinds(delivered, masks, length=7) == {"step count"}
    assert "batches arrived" in kinds([delivered[0][:3], delivered[1]], [masks[0][:3], masks[1]])


def test_undecodable_slots():
    delivered, masks = plan_delivery()
    delivered[1][2, 1] = -1
    assert "undecodable slots" in kinds(delivered, masks)


def test_every_shard_reading_the_whole_dataset():
    """rocAL's bug: both shards deliver the same stream over the whole dataset."""
    whole = np.arange(16).reshape(8, 2) % N
    found = conformance.describe_epoch([whole, whole.copy()], N, B, shuffle=False, last_batch="fill",
                                       length=8)
    assert {"same batch on several shards", "samples on two shards", "step count", "batches arrived",
            "order", "outside the shard"} <= set(found.kinds)
    report = found.report("rocAL, 2 shards")
    lines = report.splitlines()
    assert lines[0] == "rocAL, 2 shards" and lines[1].endswith("kind(s) of deviation:")
    assert "- same batch on several shards: 8 finding(s), 2 shard(s), 8 step(s)" in report
    # Summary first: every kind's summary line comes before any example.
    first_example = next(i for i, l in enumerate(lines) if l.endswith(", e.g.:"))
    assert all(l.startswith("- ") for l in lines[2:first_example])


def test_examples_are_capped_but_counted():
    found = conformance.Findings()
    for i in range(10):
        found.add("order", f"finding {i}", shards=[i])
    report = found.report()
    assert "finding 2" in report and "finding 3" not in report and "... and 7 more" in report
    assert "- order: 10 finding(s), 10 shard(s), 0 step(s), 0 sample(s)" in report


def test_a_stream_that_starts_one_slot_late_is_named_as_a_shift():
    delivered, masks = plan_delivery()
    delivered[1] = np.roll(delivered[1].ravel(), 1).reshape(delivered[1].shape)
    found = conformance.describe_epoch(delivered, N, B, shuffle=False, last_batch="fill", length=4,
                                       masks=masks)
    [text] = [t for t, *_ in found.kinds["order"]]
    assert "shard 1 is shifted by 1 slots" in text


def test_swapped_samples_are_an_order_finding_not_a_shift():
    delivered, masks = plan_delivery()
    delivered[0][0] = delivered[0][0][::-1]
    [text] = [t for t, *_ in conformance.describe_epoch(
        delivered, N, B, shuffle=False, last_batch="fill", length=4, masks=masks).kinds["order"]]
    assert text.startswith("shard 0 step 0 slot 0: sample 1, the plan says 0 (2 of 8 slots differ)")


def test_samples_from_another_shard_missing_and_repeated():
    delivered, masks = plan_delivery(shuffle=True)
    delivered[0][0, 0] = 12  # a sample of shard 1 in shard 0, and shard 0 loses one
    found = kinds(delivered, masks, shuffle=True)
    assert {"outside the shard", "missing", "samples on two shards"} <= found
    drop, drop_masks = plan_delivery("drop", shuffle=True)
    drop[1][0, 0] = drop[1][1, 0]
    assert "repeated" in kinds(drop, drop_masks, last_batch="drop", shuffle=True)


def test_a_wrong_mask_and_stray_padding():
    delivered, masks = plan_delivery()
    masks[0][tuple(np.argwhere(~masks[0])[0])] = True  # shard 0's padding slot counted as real
    assert {"mask", "repeated"} <= kinds(delivered, masks)
    delivered, masks = plan_delivery()
    pad = np.argwhere(~masks[1])
    delivered[1][tuple(pad[0])] = 3  # padding that repeats another shard's sample
    assert "padding" in kinds(delivered, masks)


@pytest.mark.parametrize("arithmetic", loaders.ARITHMETICS)
def test_decode_recovers_indices_through_either_arithmetic(arithmetic):
    indices = np.array([0, 1, 255, 256, 1002, 65535])
    for norm in (loaders.Normalize(arithmetic=arithmetic),
                 loaders.Normalize(mean=(10.0, 20.0, 30.0), std=(2.0, 3.0, 4.0), arithmetic=arithmetic)):
        images = norm(conformance.encoded_images(indices))
        np.testing.assert_array_equal(conformance.decode_indices(images, norm), indices)


def test_decode_marks_images_that_encode_nothing():
    norm = loaders.Normalize()
    images = norm(conformance.encoded_images(np.array([5, 6, 7])))
    images[0, 0, 3, 3] += 0.5  # plane 0 no longer flat
    images[1, 1] += 0.003  # between two table values (they are 1/127.5 apart)
    np.testing.assert_array_equal(conformance.decode_indices(images, norm), [-1, -1, 7])


def test_content_names_labels_mirrored_pixels_and_another_arithmetic():
    norm = loaders.Normalize()
    ref_images = conformance.encoded_images(np.arange(8))
    ref_labels = (np.arange(8) % 10).astype(np.int32)
    indices = np.array([3, 4, 5])
    images, labels = norm(ref_images[indices]), ref_labels[indices].copy()
    assert conformance.describe_content(images, labels, indices, ref_images, ref_labels, norm) == []
    labels[1] = 9
    found = conformance.describe_content(images[..., ::-1], labels, indices, ref_images, ref_labels, norm)
    assert found[0] == ("1 labels differ from the file (slot 1 holds sample 4 with label 9, "
                        "the file says 4)")
    assert "mirror=0 was not honoured" in found[1]
    dali = loaders.Normalize(arithmetic="dali_cpu")(ref_images[indices])
    [text] = conformance.describe_content(dali, ref_labels[indices], indices, ref_images, ref_labels, norm)
    assert "another arithmetic than the table's" in text


def test_a_reported_length_too_short_is_a_step_count_finding():
    # The check is "differs from the plan's", both ways (too long is above).
    delivered, masks = plan_delivery()
    assert kinds(delivered, masks, length=3) == {"step count"}
    assert kinds(delivered, masks, length=4) == set()  # control: the plan's own count


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
