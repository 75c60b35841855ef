"""The NVIDIA DALI backend (dali_loader.py), checked against real DALI pipelines.

Skipped when nvidia.dali does not import (``pip install -r requirements-dali.txt``).
Everything here runs DALI's CPU pipelines on the suite's devices; the one
GPU test runs where JAX sees an NVIDIA GPU.

* Conformance: a dataset whose images encode their own index goes through the
  backend for two epochs, for drawn (N, n, B, last_batch, shuffle, layout);
  what each shard delivered is decoded and described against the plan
  (conformance.py): the report must be empty. Shuffle off, the global arrays
  must equal the reference loader's bit for bit.
* Pixels: crop, mirror and per-channel mean/std equal Normalize(arithmetic=
  "dali_cpu") bit for bit, and not the rocAL table (negative control).
* DALI's departures from the spec, each asserted as DALI really behaves, so a
  test fails when DALI changes: the shuffled native sharding, shards moving
  without stick_to_shard, run() not stopping at the epoch end, a reader that
  reset() does not rewind, what the seed changes, and the short epoch of a
  one-shard list.
* Wiring: refusals, MNIST-shaped data, the per-sample file cache, close().
"""

import gc
import os
import shutil
import sys
import weakref

import jax
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

pytest.importorskip("nvidia.dali", reason="needs NVIDIA DALI: pip install -r requirements-dali.txt")

import conformance  # noqa: E402
from conftest import examples  # noqa: E402
import dali_loader  # noqa: E402
import loaders  # noqa: E402

pytestmark = pytest.mark.dali

DALI = loaders.Normalize(arithmetic="dali_cpu")  # mean = std = 127.5: every index decodes
CIFAR_MEAN, CIFAR_STD = (125.3, 123.0, 113.9), (63.0, 62.1, 66.7)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One per-sample file cache for the module: a dataset is written once, whatever test reads it."""
    return str(tmp_path_factory.mktemp("dali-cache"))


def encoded(N: int):
    """Images that encode their index, labels i % 10."""
    return conformance.encoded_images(np.arange(N)), (np.arange(N) % 10).astype(np.int32)


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
    delivered = [np.array([conformance.decode_indices(b["images"][k], normalize) for b in blocks],
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
        assert np.asarray(got[name]).tobytes() == np.asarray(want[name]).tobytes(), f"{where} {name}"


def assert_raises_naming(error, fn, *fragments):
    with pytest.raises(error) as info:
        fn()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


# --------------------------------------------------------------------------
# Conformance: the backend's epochs against the plan
# --------------------------------------------------------------------------


@st.composite
def cases(draw):
    n = draw(st.sampled_from([1, 2, 3, 8]))
    N = draw(st.integers(20, 300))
    B = draw(st.integers(1, min(8, N // n)))
    return (N, n, B, draw(st.sampled_from(loaders.LAST_BATCH_POLICIES)), draw(st.booleans()),
            draw(st.sampled_from(loaders.LAYOUTS)), draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=examples(20))
@given(cases())
# Shard lists a batch short of the plan (S_k = floor(N/n) a multiple of B): filled by the backend.
@example((23, 4, 5, "fill", True, "sharded", 0))
@example((60, 8, 7, "fill", True, "pmap", 5))
def test_dali_epochs_conform_to_the_plan(devices, cache, case):
    N, n, B, last_batch, shuffle, layout, seed = case
    if n > len(devices):
        n = len(devices)
    images, labels = encoded(N)
    args = dict(layout=layout, shuffle=shuffle, seed=seed, last_batch=last_batch, normalize=DALI)
    loader = dali_loader.make_dali_loader((images, labels), devices[:n], B, cache_dir=cache, **args)
    # host_float32: the same bits as every placement (test_loaders.py), without a jit per shape.
    reference = loaders.make_loader((images, labels), devices[:n], B, prefetch=0,
                                    placement="host_float32", **args)
    try:
        assert len(loader) == loaders.num_steps(N, n, B, last_batch)
        for epoch in range(2):
            batches = list(loader.epoch(epoch))
            report = describe(batches, N, B, n, images, labels, shuffle=shuffle,
                              last_batch=last_batch, length=len(loader))
            assert not report, f"epoch {epoch} of {case}:\n{report}"
            assert loader.real_samples(epoch) == reference.real_samples(epoch)
            for step, got in enumerate(batches):
                want = reference.batch(epoch, step)
                if shuffle:  # DALI's order within a shard: only the mask is the plan's bit for bit
                    assert_same_arrays({"mask": got["mask"]}, {"mask": want["mask"]}, f"step {step}")
                    for name in ("images", "labels"):
                        assert got[name].sharding == want[name].sharding and \
                            got[name].shape == want[name].shape and got[name].dtype == want[name].dtype
                else:
                    assert_same_arrays(got, want, f"epoch {epoch} step {step} of {case}")
    finally:
        loader.close()


def test_leaving_an_epoch_early_resumes_on_dalis_epoch_boundary(devices, cache):
    N, n, B = 50, 4, 3  # 5 steps per epoch
    images, labels = encoded(N)
    loader = dali_loader.make_dali_loader((images, labels), devices[:n], B, cache_dir=cache)
    reference = loaders.make_loader((images, labels), devices[:n], B, normalize=DALI, prefetch=0,
                                    placement="host_float32")
    steps = loader.epoch(0)
    next(steps)
    steps.close()
    for step, got in enumerate(loader.epoch(1)):
        assert_same_arrays(got, reference.batch(1, step), f"step {step}")
    loader.close()


# --------------------------------------------------------------------------
# Pixels: crop, mirror, per-channel mean and std
# --------------------------------------------------------------------------


@pytest.mark.parametrize("crop, crop_pos, mirror, wrong", [
    # anchors 1.5 -> 2 (y) and 2.5 -> 3 (x): DALI rounds half away from zero, rocAL to even.
    ((29, 27), (0.5, 0.5), True, dict(mirror=False)),
    # anchors y = 1/6 * 4 -> 1, x = 0.9 * 2 -> 2: crop_pos is (pos_y, pos_x), not the reverse.
    ((28, 30), (1 / 6, 0.9), False, dict(crop_pos=(0.9, 1 / 6))),
])
def test_crop_mirror_normalize_is_the_dali_table(devices, cache, crop, crop_pos, mirror, wrong):
    rng = np.random.default_rng(7)
    images = rng.integers(0, 256, size=(16,) + loaders.IMAGE_SHAPE, dtype=np.uint8)
    labels = rng.integers(0, 10, size=16).astype(np.int32)
    norm = loaders.Normalize(mean=CIFAR_MEAN, std=CIFAR_STD, crop=crop, crop_pos=crop_pos,
                             mirror=mirror, arithmetic="dali_cpu")
    loader = dali_loader.make_dali_loader((images, labels), devices[:2], 8, normalize=norm, cache_dir=cache)
    (batch,) = list(loader.epoch(0))
    loader.close()
    got = np.asarray(batch["images"])  # rows: shard 0 = samples 0..7, shard 1 = 8..15
    assert got.shape == (16, 3) + crop and got.dtype == np.float32
    assert got.tobytes() == norm(images).tobytes(), "DALI's pixels differ from the dali table"
    np.testing.assert_array_equal(np.asarray(batch["labels"]), labels)
    # Negative controls: the rocAL table, and the same arguments with one thing changed, do not match.
    rocal = loaders.Normalize(mean=CIFAR_MEAN, std=CIFAR_STD, crop=crop, crop_pos=crop_pos,
                              mirror=mirror, arithmetic="rocal")
    assert not np.array_equal(got, rocal(images))
    assert not np.array_equal(got, loaders.Normalize(**{**norm.__dict__, **wrong})(images))


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

    loader = dali_loader.make_dali_loader((images, labels), devices[:n], B, shuffle=True, cache_dir=cache)
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

    loader = dali_loader.make_dali_loader((images, labels), devices[:n], B, shuffle=True, cache_dir=cache)
    batches = [shard_blocks(b, n) for b in loader.epoch(0)]
    loader.close()
    last = conformance.decode_indices(batches[0]["images"][0], DALI)[-1]
    np.testing.assert_array_equal(conformance.decode_indices(batches[1]["images"][0], DALI), [last] * B)
    assert not batches[1]["mask"][0].any() and batches[1]["mask"][3].tolist() == [True, False, False]


def test_without_stick_to_shard_readers_move_to_the_next_shard(cache):
    """DALI's documented behaviour: without stick_to_shard, reader k reads shard
    (k + e) mod n in epoch e (each padded with its own last sample)."""
    N, n, B = 13, 4, 3
    folder = dali_loader.sample_files(*encoded(N), cache)
    plan = loaders.epoch_plan(N, n, B)
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
    assert raw_ids(pipe, 5).tolist() == [[0, 1, 2], [2, 2, 2]] * 2 + [[0, 1, 2]]  # 2 batches an epoch
    pipe.reset()
    assert raw_ids(pipe, 1).tolist() == [[2, 2, 2]]  # not [0, 1, 2]: no rewind


def test_the_seed_changes_dalis_shuffle(devices, cache):
    """DALI's documented behaviour: the pipeline seed drives random_shuffle's order within
    a shard (the pre-permutation before sharding is fixed), the same seed gives the same
    stream on a rebuild, and each epoch has a new order. The backend derives shard k's seed
    from SeedSequence([seed, k])."""
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
                                              cache_dir=cache)
        ids = [conformance.decode_indices(np.asarray(b["images"]), DALI) for e in range(2)
               for b in loader.epoch(e)]
        loader.close()
        return np.concatenate(ids).tolist()

    assert loader_order(0) == loader_order(0) != loader_order(1)


# --------------------------------------------------------------------------
# Wiring and refusals
# --------------------------------------------------------------------------


def test_refusals(devices, cache):
    images, labels = encoded(20)

    def make(**kwargs):
        args = dict(data=(images, labels), devices=devices[:4], batch_size=2, cache_dir=cache) | kwargs
        return lambda: dali_loader.make_dali_loader(args.pop("data"), args.pop("devices"),
                                                    args.pop("batch_size"), **args)

    assert_raises_naming(ValueError, make(normalize=loaders.Normalize()), "arithmetic='rocal'",
                         "DALI computes DALI's arithmetic")
    assert_raises_naming(ValueError, make(normalize=lambda x: x), "normalize=", "arithmetic='dali_cpu'")
    assert_raises_naming(ValueError, make(batch_size=6), "batch_size=6", "smallest shard")
    assert_raises_naming(ValueError, make(num_threads=0), "num_threads", "got 0")
    assert_raises_naming(ValueError, make(layout="rows"), "'rows'")
    assert_raises_naming(ValueError, make(last_batch="partial"), "'partial'")
    assert_raises_naming(ValueError, make(data=(images.astype(np.float32), labels)), "uint8")
    loader = make()()
    assert_raises_naming(ValueError, lambda: loader.epoch(0, start_step=1), "start_step=1", "cannot seek")
    assert_raises_naming(ValueError, lambda: loader.epoch(-1), "epoch=-1")
    assert len(loader) == 3 and "4 CPU pipeline(s)" in loader.describe()
    loader.close()


@pytest.mark.parametrize("layout", loaders.LAYOUTS)
def test_mnist_shaped_data_equals_the_reference(devices, cache, layout):
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, size=(50,) + loaders.MNIST_SHAPE, dtype=np.uint8)
    labels = rng.integers(0, 10, size=50).astype(np.int32)
    norm = loaders.Normalize(mean=(0.0,), std=(255.0,), arithmetic="dali_cpu")  # the DALI notebook's
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


def test_close_releases_the_pipelines(devices, cache):
    loader = dali_loader.make_dali_loader(encoded(20), devices[:3], 2, cache_dir=cache)
    next(loader.epoch(0))
    refs = [weakref.ref(p) for p in loader.pipelines.values()]
    loader.close()
    gc.collect()
    assert refs and all(r() is None for r in refs), "a pipeline outlived close()"
    assert_raises_naming(RuntimeError, lambda: loader.epoch(1), "closed")


def test_install_hint_and_usable(devices, monkeypatch):
    if devices[0].platform == "cpu":
        assert not dali_loader.usable(devices[:2])
    monkeypatch.setitem(sys.modules, "nvidia.dali.pipeline", None)
    assert_raises_naming(ImportError, dali_loader.import_dali, "pip install -r requirements-dali.txt",
                         "nvidia-dali-cuda120", "import failed")
    assert not dali_loader.usable(devices[:2])


# --------------------------------------------------------------------------
# NVIDIA GPUs (skipped where JAX sees none)
# --------------------------------------------------------------------------


def nvidia_gpus() -> list:
    try:
        return [d for d in jax.devices("gpu") if d.platform in dali_loader.NVIDIA_PLATFORMS]
    except RuntimeError:
        return []


@pytest.mark.skipif(not nvidia_gpus(), reason="needs an NVIDIA GPU: JAX sees none here")
@pytest.mark.parametrize("layout", loaders.LAYOUTS)
def test_gpu_pipelines_equal_the_reference(cache, layout):
    gpus = nvidia_gpus()[:8]
    N, B = 37 * len(gpus), 4
    images, labels = encoded(N)
    args = dict(layout=layout, normalize=DALI)
    loader = dali_loader.make_dali_loader((images, labels), gpus, B, cache_dir=cache, **args)
    assert dali_loader.usable(gpus) and "GPU pipeline(s)" in loader.describe()
    reference = loaders.make_loader((images, labels), gpus, B, prefetch=0, **args)
    for epoch in range(2):
        for step, got in enumerate(loader.epoch(epoch)):
            assert_same_arrays(got, reference.batch(epoch, step), f"epoch {epoch} step {step}")
    loader.close()


# --------------------------------------------------------------------------
# Issue 18: sentences of the spec only these tests can hold DALI to. Each pins
# public behaviour (not the module's internals), to re-check after a rewrite.
# --------------------------------------------------------------------------


def test_one_cache_serves_every_device_count(devices, cache):
    # A shuffled run with 4 devices, then one with 2 over the same cache folder: the
    # second must read its own shards (the cached shard lists are keyed by n too).
    N, B = 40, 2
    images, labels = encoded(N)
    for n in (4, 2):
        loader = dali_loader.make_dali_loader((images, labels), devices[:n], B, shuffle=True, seed=3,
                                              cache_dir=cache, normalize=DALI)
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
        start, stop = loaders.shard_bounds(N, k, n)
        order = np.concatenate([conformance.decode_indices(b["images"][k], DALI) for b in blocks])
        assert sorted(order.tolist()) == list(range(start, stop))  # control: each is its own shard
        local.append((order - start).tolist())
    assert local[0] != local[1], "both shards shuffled alike"
