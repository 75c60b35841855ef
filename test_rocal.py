"""The rocAL backend: wiring checked here with a test double, behaviour on an AMD host.

Two kinds of test:

* Everywhere: ``RecordingRocal``, a stand-in for the ``amd.rocal`` package put in
  ``sys.modules`` only inside these tests, records what each per-device pipeline
  is asked for and returns fixed arrays. It knows nothing about shards or
  batches, so these tests check the wiring (arguments, placement, ``len()``,
  errors), never rocAL's behaviour. The helpers the conformance test uses to
  decode samples and describe deviations are tested here on hand-made inputs.
* ``-m rocal`` (needs amd.rocal and at least 2 AMD GPUs, else skipped): the
  conformance test runs the real pipelines on a dataset whose images encode
  their own index and compares what each shard delivers with ``epoch_plan``.
  Its failure messages are written for a rocAL maintainer.

The synthetic dataset is a single ``data_batch_1.bin``: rocAL lists a folder in
raw ``readdir`` order, so with several files its global sample order (and with
it every shard) would depend on the filesystem, and the comparison with the plan
would test the filesystem instead of rocAL.
"""

import sys
import types as pytypes

import jax
import numpy as np
import pytest

import loaders

# --------------------------------------------------------------------------
# Images that encode their own index, and describing what a shard delivered
# --------------------------------------------------------------------------


def encoded_images(indices: np.ndarray) -> np.ndarray:
    """uint8 (N, 3, 32, 32): plane 0 is index % 256, plane 1 is index // 256 (N < 65536),
    plane 2 a ramp that a horizontal flip changes, so a mirrored image is detectable."""
    indices = np.asarray(indices, np.int64)
    images = np.empty((len(indices),) + loaders.IMAGE_SHAPE, np.uint8)
    images[:, 0] = (indices % 256)[:, None, None]
    images[:, 1] = (indices // 256)[:, None, None]
    y, x = np.mgrid[0:32, 0:32]
    images[:, 2] = 4 * x + 2 * y
    return images


def decode_indices(images_BCHW: np.ndarray, normalize: loaders.Normalize) -> np.ndarray:
    """The sample index each normalised image encodes; -1 where the pixels encode none."""
    images_BCHW = np.asarray(images_BCHW, np.float64)
    mean = np.asarray(normalize.mean)[:, None, None]
    std = np.asarray(normalize.std)[:, None, None]
    pixels = images_BCHW * std + mean
    planes = np.rint(pixels[:, :2])
    whole = np.all(np.abs(pixels[:, :2] - planes) < 0.01, axis=(1, 2, 3))
    flat = np.all(planes == planes[:, :, :1, :1], axis=(1, 2, 3))
    in_range = np.all((planes >= 0) & (planes <= 255), axis=(1, 2, 3))
    index = (planes[:, 0, 0, 0] + 256 * planes[:, 1, 0, 0]).astype(np.int64)
    return np.where(whole & flat & in_range, index, -1)


def describe_deviations(delivered: list, num_samples: int, batch_size: int, *, shuffle: bool,
                        last_batch: str, length: int) -> list[str]:
    """How what the shards delivered in one epoch departs from ``epoch_plan``, in words.

    ``delivered[k]`` is shard k's decoded sample indices, int (steps that arrived, B);
    ``length`` is what the loader's ``len()`` says. Returns [] when the epoch conforms:
    the plan's step count, disjoint shards, and with shuffle off the plan's indices in
    the plan's order; with shuffle on, each shard's own samples (fill: every one of
    them; drop: none twice).
    """
    n = len(delivered)
    true_steps = loaders.num_steps(num_samples, n, batch_size, last_batch)
    found = []
    if length != true_steps:
        found.append(f"len() says {length}, the true step count is {true_steps}")
    for k, got in enumerate(delivered):
        if len(got) != length:
            found.append(f"len() says {length}, {len(got)} batches arrived on shard {k}")
        if (got < 0).any():
            found.append(f"shard {k}: {(got < 0).sum()} slots hold no encoded sample "
                         f"(their pixels decode to no index)")
    for a in range(n):
        for b in range(a + 1, n):
            da, db = delivered[a], delivered[b]
            same = [s for s in range(min(len(da), len(db)))
                    if np.array_equal(np.sort(da[s]), np.sort(db[s]))]
            if same:
                more = f" (and at {len(same) - 1} more steps)" if len(same) > 1 else ""
                found.append(f"shards {a} and {b} deliver the same {batch_size} samples "
                             f"at step {same[0]}{more}")
            shared = np.intersect1d(da[da >= 0], db[db >= 0])
            if shared.size:
                found.append(f"shards {a} and {b} share {shared.size} samples over the epoch "
                             f"(e.g. {shared[:5].tolist()})")
    plan = loaders.epoch_plan(num_samples, n, batch_size, last_batch=last_batch)
    for k, got in enumerate(delivered):
        start, stop = loaders.shard_bounds(num_samples, k, n)
        if not shuffle:
            want = plan.indices[:, k]
            steps = min(len(got), len(want))
            wrong = np.argwhere(got[:steps] != want[:steps])
            if wrong.size:
                s, j = wrong[0]
                found.append(f"shard {k} step {s} slot {j}: sample {got[s, j]}, the plan says "
                             f"{want[s, j]} ({len(wrong)} of {steps * batch_size} slots differ)")
            continue
        real = got[got >= 0]
        outside = np.unique(real[(real < start) | (real >= stop)])
        if outside.size:
            found.append(f"shard {k} delivers {outside.size} samples from outside its range "
                         f"[{start}, {stop}) (e.g. {outside[:5].tolist()})")
        if last_batch == "fill":
            missing = np.setdiff1d(np.arange(start, stop), real)
            if missing.size:
                found.append(f"shard {k} misses {missing.size} of its {stop - start} samples "
                             f"(e.g. {missing[:5].tolist()})")
        else:
            values, counts = np.unique(real, return_counts=True)
            if (counts > 1).any():
                found.append(f"shard {k} delivers {(counts > 1).sum()} samples more than once "
                             f"(e.g. {values[counts > 1][:5].tolist()})")
    return found


def describe_content(images_BCHW, labels_B, indices_B, ref_images, ref_labels,
                     normalize: loaders.Normalize, atol: float = 1e-5) -> list[str]:
    """Labels and pixels of one delivered batch against the file, in words ([] if equal)."""
    images_BCHW, labels_B = np.asarray(images_BCHW), np.asarray(labels_B)
    ok = indices_B >= 0
    found = []
    wrong = np.flatnonzero(ok & (labels_B != ref_labels[np.where(ok, indices_B, 0)]))
    if wrong.size:
        j = wrong[0]
        found.append(f"{wrong.size} labels differ from the file (slot {j} holds sample "
                     f"{indices_B[j]} with label {labels_B[j]}, the file says "
                     f"{ref_labels[indices_B[j]]})")
    want = normalize(ref_images[indices_B[ok]])
    got = images_BCHW[ok]
    diff = np.abs(got - want).max(axis=(1, 2, 3)) if got.size else np.zeros(0)
    bad = diff > atol
    if bad.any():
        mirrored = np.abs(got[bad] - want[bad][..., ::-1]).max(axis=(1, 2, 3)) <= atol
        note = (": they equal the horizontally mirrored images, so mirror=0 was not honoured"
                if mirrored.all() else "")
        found.append(f"{bad.sum()} images differ from (x - mean) / std of their sample by up to "
                     f"{diff.max():.3g}{note}")
    return found


# --------------------------------------------------------------------------
# The helpers, on hand-made inputs
# --------------------------------------------------------------------------

NORM = loaders.Normalize()


def test_decode_recovers_indices_through_normalisation():
    indices = np.array([0, 1, 255, 256, 1002, 65535])
    images = NORM(encoded_images(indices))
    np.testing.assert_array_equal(decode_indices(images, NORM), indices)
    other = loaders.Normalize(mean=(10.0, 20.0, 30.0), std=(2.0, 3.0, 4.0))
    np.testing.assert_array_equal(decode_indices(other(encoded_images(indices)), other), indices)


def test_decode_marks_images_that_encode_nothing():
    images = NORM(encoded_images(np.array([5, 6, 7])))
    images[0, 0, 3, 3] += 0.5  # plane 0 no longer flat
    images[1] += 0.001  # pixels no longer whole numbers
    np.testing.assert_array_equal(decode_indices(images, NORM), [-1, -1, 7])


def _plan_delivery(num_samples, n, batch_size, last_batch):
    plan = loaders.epoch_plan(num_samples, n, batch_size, last_batch=last_batch)
    return [plan.indices[:, k].copy() for k in range(n)]


@pytest.mark.parametrize("last_batch", ["fill", "drop"])
def test_describer_accepts_the_plan(last_batch):
    delivered = _plan_delivery(13, 2, 2, last_batch)
    steps = loaders.num_steps(13, 2, 2, last_batch)
    for shuffle in (False, True):
        assert describe_deviations(delivered, 13, 2, shuffle=shuffle, last_batch=last_batch,
                                   length=steps) == []


def test_describer_accepts_a_shuffled_fill_epoch():
    delivered = _plan_delivery(13, 2, 2, "fill")
    rng = np.random.default_rng(0)
    shuffled = [rng.permutation(d.ravel()).reshape(d.shape) for d in delivered]
    assert describe_deviations(shuffled, 13, 2, shuffle=True, last_batch="fill", length=4) == []
    assert describe_deviations(shuffled, 13, 2, shuffle=False, last_batch="fill", length=4)


def test_describer_names_duplicated_shards():
    """Negative control: every shard reading the whole dataset (the suspected bug)."""
    whole = np.arange(16).reshape(4, 4)
    found = describe_deviations([whole, whole.copy()], 16, 4, shuffle=False, last_batch="drop",
                                length=2)
    text = "\n".join(found)
    assert "shards 0 and 1 deliver the same 4 samples at step 0 (and at 3 more steps)" in text
    assert "shards 0 and 1 share 16 samples over the epoch" in text
    assert "len() says 2, 4 batches arrived on shard 0" in text
    assert "shard 1 step 0 slot 0: sample 0, the plan says 8" in text


def test_describer_names_a_wrong_length_and_missing_and_repeated_samples():
    delivered = _plan_delivery(13, 2, 2, "fill")
    assert describe_deviations(delivered, 13, 2, shuffle=False, last_batch="fill", length=7) == [
        "len() says 7, the true step count is 4",
        "len() says 7, 4 batches arrived on shard 0",
        "len() says 7, 4 batches arrived on shard 1"]
    lost = [d.copy() for d in delivered]
    lost[0][0, 0] = lost[0][0, 1]  # sample 0 never arrives
    lost[1][1, 1] = -1
    found = describe_deviations(lost, 13, 2, shuffle=True, last_batch="fill", length=4)
    assert "shard 0 misses 1 of its 6 samples (e.g. [0])" in found
    assert any(m.startswith("shard 1: 1 slots hold no encoded sample") for m in found)
    drop = _plan_delivery(13, 2, 2, "drop")
    drop[1][0, 0] = drop[1][1, 1]
    drop[0][1, 1] = 12
    found = describe_deviations(drop, 13, 2, shuffle=True, last_batch="drop", length=3)
    assert "shard 1 delivers 1 samples more than once (e.g. [9])" in found
    assert "shard 0 delivers 1 samples from outside its range [0, 6) (e.g. [12])" in found


def test_content_describer_names_labels_and_mirrored_pixels():
    ref_images = encoded_images(np.arange(8))
    ref_labels = (np.arange(8) % 10).astype(np.int32)
    indices = np.array([3, 4, 5])
    images, labels = NORM(ref_images[indices]), ref_labels[indices].copy()
    assert describe_content(images, labels, indices, ref_images, ref_labels, NORM) == []
    labels[1] = 9
    flipped = images[..., ::-1]
    found = describe_content(flipped, labels, indices, ref_images, ref_labels, NORM)
    assert found[0] == "1 labels differ from the file (slot 1 holds sample 4 with label 9, " \
                       "the file says 4)"
    assert found[1].startswith("3 images differ from (x - mean) / std of their sample")
    assert "mirror=0 was not honoured" in found[1]


# --------------------------------------------------------------------------
# RecordingRocal: a test double for the amd.rocal package
# --------------------------------------------------------------------------


class RecordingRocal:
    """Stands in for ``amd.rocal`` inside a test: records calls, returns fixed arrays.

    Pipeline output at its r-th run (r counts from 1, across resets): images filled
    with ``1000 * device_id + r`` in the shape the recorded arguments ask for, and
    labels ``100 * device_id + arange(B)``. ``rocal_run`` reports the end after
    ``runs_per_epoch`` runs since the last reset. Nothing here knows about shards.
    """

    def __init__(self, runs_per_epoch: int = 1000):
        self.runs_per_epoch = runs_per_epoch
        self.pipelines = []
        rocal = self

        class Pipeline:
            _current_pipeline = None

            def __init__(self, **kwargs):
                self.kwargs, self.calls, self.tensors = kwargs, [], []
                self.runs = self.runs_since_reset = self.resets = 0
                self.built = self.released = False
                rocal.pipelines.append(self)

            def __enter__(self):
                Pipeline._current_pipeline = self
                return self

            def __exit__(self, *exc):
                return False

            def set_outputs(self, *outputs):
                self.calls.append(("set_outputs", outputs, {}))

            def build(self):
                self.built = True
                return self

            def rocal_run(self):
                if self.runs_since_reset >= rocal.runs_per_epoch:
                    return 1
                self.runs += 1
                self.runs_since_reset += 1
                return 0

            def get_output_tensors(self):
                crop = self.call("crop_mirror_normalize")[2]["crop"]
                shape = (self.kwargs["batch_size"], 3) + tuple(crop)
                value = 1000 * self.kwargs["device_id"] + self.runs
                self.tensors.append(FakeTensor(np.full(shape, value, np.float32)))
                return [self.tensors[-1]]

            def get_image_labels(self):
                return 100 * self.kwargs["device_id"] + np.arange(self.kwargs["batch_size"],
                                                                  dtype=np.int32)

            def rocal_reset_loaders(self):
                self.resets += 1
                self.runs_since_reset = 0

            def rocal_release(self):
                self.released = True

            def call(self, name):
                (match,) = [c for c in self.calls if c[0] == name]
                return match

        def record(name, result):
            def fn(*args, **kwargs):
                Pipeline._current_pipeline.calls.append((name, args, kwargs))
                return result
            return fn

        self.Pipeline = Pipeline
        self.modules = {
            "amd": pytypes.ModuleType("amd"),
            "amd.rocal": pytypes.ModuleType("amd.rocal"),
            "amd.rocal.pipeline": pytypes.ModuleType("amd.rocal.pipeline"),
            "amd.rocal.fn": pytypes.ModuleType("amd.rocal.fn"),
            "amd.rocal.types": pytypes.ModuleType("amd.rocal.types"),
        }
        self.modules["amd"].rocal = self.modules["amd.rocal"]
        for name in ("pipeline", "fn", "types"):
            setattr(self.modules["amd.rocal"], name, self.modules[f"amd.rocal.{name}"])
        self.modules["amd.rocal.pipeline"].Pipeline = Pipeline
        fn = self.modules["amd.rocal.fn"]
        fn.readers = pytypes.SimpleNamespace(cifar10=record("cifar10", "reader-output"))
        fn.crop_mirror_normalize = record("crop_mirror_normalize", "cmn-output")
        for name in ("NCHW", "NHWC", "FLOAT", "UINT8", "DEVICE_MEMORY", "HOST_MEMORY",
                     "LAST_BATCH_FILL", "LAST_BATCH_DROP", "LAST_BATCH_PARTIAL"):
            setattr(self.modules["amd.rocal.types"], name, name)
        self.modules["amd.rocal.types"].OK = 0

    def install(self, monkeypatch) -> "RecordingRocal":
        for name, module in self.modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        return self


class FakeTensor:
    """A rocAL output tensor: ``__dlpack__`` takes the GPU id, as rocAL's does."""

    def __init__(self, array: np.ndarray):
        self.array, self.dlpack_calls = array, []

    def __dlpack__(self, device_id):
        self.dlpack_calls.append(device_id)
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return (1, 0)  # DLPack kDLCPU: these arrays live in host memory


@pytest.fixture
def fake_rocal(monkeypatch):
    return RecordingRocal().install(monkeypatch)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """22 encoded samples in one data_batch file, plus a test_batch file."""
    root = tmp_path_factory.mktemp("rocal_small")
    indices = np.arange(22)
    loaders.write_cifar10(root / "data_batch_1.bin", encoded_images(indices), indices % 10)
    loaders.write_cifar10(root / "test_batch.bin", encoded_images(indices[:4]), indices[:4] % 10)
    return str(root)


@pytest.fixture
def mesh4():
    """Four CPU devices (the double's arrays live in host memory, even on a GPU host),
    in a mesh order that differs from their ids."""
    cpus = jax.devices("cpu")
    return loaders.data_mesh([cpus[i] for i in (2, 0, 3, 1)])


# --------------------------------------------------------------------------
# Wiring, with the test double
# --------------------------------------------------------------------------


def test_rocal_backend_without_rocal_says_how_to_install(monkeypatch, small_dir, mesh4):
    monkeypatch.setitem(sys.modules, "amd", None)
    monkeypatch.setitem(sys.modules, "amd.rocal", None)
    with pytest.raises(ImportError, match="PYTHONPATH=/opt/rocm/lib") as error:
        loaders.make_loader(small_dir, mesh4, 2, backend="rocal")
    assert "'rocal' and 'rocal-dev'" in str(error.value)
    assert not loaders.rocal_usable(list(mesh4.devices.flat))


def test_auto_falls_back_to_the_reference(monkeypatch, small_dir, mesh4, fake_rocal):
    # rocAL imports (the double) but the devices are not AMD GPUs.
    assert isinstance(loaders.make_loader(small_dir, mesh4, 2, backend="auto"), loaders.Loader)
    # Arrays cannot go through rocAL, whatever the devices.
    arrays = loaders.read_cifar10(small_dir)
    assert isinstance(loaders.make_loader(arrays, mesh4, 2, backend="auto"), loaders.Loader)
    assert fake_rocal.pipelines == []
    monkeypatch.setitem(sys.modules, "amd.rocal.pipeline", None)
    assert isinstance(loaders.make_loader(small_dir, mesh4, 2, backend="auto"), loaders.Loader)


def test_refusals(small_dir, mesh4, fake_rocal, tmp_path):
    with pytest.raises(ValueError, match="backend must be one of"):
        loaders.make_loader(small_dir, mesh4, 2, backend="rocm")
    with pytest.raises(ValueError, match="pass the folder"):
        loaders.make_loader(loaders.read_cifar10(small_dir), mesh4, 2, backend="rocal")
    with pytest.raises(ValueError, match="needs last_batch='drop'"):
        loaders.make_loader(small_dir, mesh4, 2, backend="rocal", shuffle=True)
    indices = np.arange(8)
    loaders.write_cifar10(tmp_path / "data_batch_1.bin", encoded_images(indices), indices)
    loaders.write_cifar10(tmp_path / "old_data_batch_1.bin", encoded_images(indices), indices)
    with pytest.raises(ValueError, match=r"rocAL would also read \['old_data_batch_1.bin'\]"):
        loaders.make_loader(str(tmp_path), mesh4, 2, backend="rocal")
    with pytest.raises(ValueError, match="does not fit"):
        loaders.make_loader(small_dir, mesh4, 2, backend="rocal",
                            normalize=loaders.Normalize(crop=(40, 40)))
    assert fake_rocal.pipelines == []


@pytest.mark.parametrize("shuffle, last_batch, mirror", [
    (False, "fill", False), (True, "drop", False), (False, "drop", True)])
def test_each_device_gets_a_pipeline_for_its_shard(small_dir, mesh4, fake_rocal, shuffle,
                                                  last_batch, mirror):
    norm = loaders.Normalize(mean=(1.0, 2.0, 3.0), std=(4.0, 5.0, 6.0), mirror=mirror,
                             crop=(28, 30), crop_pos=(0.25, 0.75))
    loader = loaders.make_loader(small_dir, mesh4, 2, backend="rocal", shuffle=shuffle,
                                 last_batch=last_batch, normalize=norm, seed=7)
    devices = list(mesh4.devices.flat)
    assert len(fake_rocal.pipelines) == 4
    for k, pipe in enumerate(fake_rocal.pipelines):
        assert pipe.kwargs == dict(batch_size=2, num_threads=8, device_id=devices[k].id, seed=7,
                                   rocal_cpu=False, tensor_layout="NCHW", tensor_dtype="FLOAT",
                                   output_memory_type="DEVICE_MEMORY")
        assert pipe.call("cifar10") == ("cifar10", (), dict(
            file_root=small_dir, shard_id=k, num_shards=4, filename_prefix="data_batch_",
            random_shuffle=shuffle,
            last_batch_policy="LAST_BATCH_FILL" if last_batch == "fill" else "LAST_BATCH_DROP",
            pad_last_batch=last_batch == "fill"))
        assert pipe.call("crop_mirror_normalize") == ("crop_mirror_normalize", ("reader-output",),
            dict(output_layout="NCHW", output_dtype="FLOAT", crop=(28, 30), crop_pos_x=0.75,
                 crop_pos_y=0.25, mirror=int(mirror), mean=[1.0, 2.0, 3.0], std=[4.0, 5.0, 6.0]))
        assert pipe.call("set_outputs") == ("set_outputs", ("cmn-output",), {})
        assert pipe.built and pipe.runs == 0
    assert loader.pipelines == dict(enumerate(fake_rocal.pipelines))


def test_the_test_set_pipeline_reads_test_batch(small_dir, fake_rocal):
    loader = loaders.make_loader(small_dir, jax.devices("cpu")[:1], 4, backend="rocal",
                                 filename_prefix=loaders.TEST_PREFIX)
    (pipe,) = fake_rocal.pipelines
    assert pipe.call("cifar10")[2]["filename_prefix"] == "test_batch"
    assert pipe.call("cifar10")[2]["num_shards"] == 1
    assert pipe.call("crop_mirror_normalize")[2]["crop"] == (32, 32)
    assert pipe.call("crop_mirror_normalize")[2]["mirror"] == 0  # never rocAL's default 1
    assert len(loader) == 1


@pytest.mark.parametrize("layout", loaders.LAYOUTS)
def test_outputs_become_global_arrays_by_mesh_position(small_dir, mesh4, fake_rocal, layout):
    loader = loaders.make_loader(small_dir, mesh4, 2, backend="rocal", layout=layout)
    reference = loaders.make_loader(small_dir, mesh4, 2, layout=layout)
    want = next(iter(reference.epoch(0)))
    devices = list(mesh4.devices.flat)
    batches = list(loader.epoch(0))
    assert len(batches) == len(loader) == len(reference) == 3
    for step, batch in enumerate(batches):
        for name in ("images", "labels", "mask"):
            assert batch[name].shape == want[name].shape, name
            assert batch[name].sharding == want[name].sharding, name
            assert batch[name].dtype == want[name].dtype, name
            sample_shape = want[name].shape[1:] if layout == "sharded" else want[name].shape[2:]
            for shard in batch[name].addressable_shards:
                k = devices.index(shard.device)
                block = np.asarray(shard.data).reshape((2,) + sample_shape)
                if name == "images":
                    np.testing.assert_array_equal(block, 1000 * devices[k].id + step + 1)
                elif name == "labels":
                    np.testing.assert_array_equal(block, 100 * devices[k].id + np.arange(2))
    for k, pipe in enumerate(fake_rocal.pipelines):
        assert [t.dlpack_calls for t in pipe.tensors] == [[devices[k].id]] * 3


@pytest.mark.parametrize("last_batch", ["fill", "drop"])
def test_len_is_the_true_step_count_and_mask_follows_the_policy(small_dir, mesh4, fake_rocal,
                                                                last_batch):
    loader = loaders.make_loader(small_dir, mesh4, 2, backend="rocal", last_batch=last_batch)
    steps = loaders.num_steps(22, 4, 2, last_batch)
    assert len(loader) == steps == {"fill": 3, "drop": 2}[last_batch]
    plan = loaders.epoch_plan(22, 4, 2, last_batch=last_batch)
    for epoch in range(2):
        masks = [np.asarray(b["mask"]).reshape(4, 2) for b in loader.epoch(epoch)]
        assert len(masks) == steps  # the double would run 1000 times: len() decides
        np.testing.assert_array_equal(np.stack(masks), plan.mask)
        assert loader.real_samples(epoch) == int(np.stack(masks).sum())
        assert [p.runs for p in fake_rocal.pipelines] == [steps * (epoch + 1)] * 4
        assert [p.resets for p in fake_rocal.pipelines] == [epoch] * 4
    if last_batch == "fill":
        assert not plan.mask.all()  # 22 samples on 4 shards of 6 slots: some padding


def test_epochs_reset_only_pipelines_that_ran(small_dir, mesh4, fake_rocal):
    loader = loaders.make_loader(small_dir, mesh4, 2, backend="rocal")
    loader.epoch(0)  # never iterated
    first = loader.epoch(3)
    assert [p.resets for p in fake_rocal.pipelines] == [0] * 4
    next(first)
    list(loader.epoch(1))
    assert [p.resets for p in fake_rocal.pipelines] == [1] * 4
    with pytest.raises(ValueError, match="cannot seek"):
        loader.epoch(0, start_step=1)
    loader.close()
    assert all(p.released for p in fake_rocal.pipelines) and loader.pipelines == {}


def test_a_pipeline_that_ends_early_is_an_error(small_dir, mesh4, fake_rocal):
    fake_rocal.runs_per_epoch = 2
    loader = loaders.make_loader(small_dir, mesh4, 2, backend="rocal")
    with pytest.raises(RuntimeError, match=r"shard 0 .* ran out at step 2, but len\(\) is 3"):
        list(loader.epoch(0))


# --------------------------------------------------------------------------
# Conformance on an AMD host: real rocAL against epoch_plan
# --------------------------------------------------------------------------

BATCH = 16
NUM_ENCODED = 1003  # odd-sized shards and a padded last batch on any GPU count up to 62


@pytest.fixture(scope="module")
def amd_gpus():
    try:
        loaders.import_rocal()
    except ImportError as error:
        pytest.skip(f"needs amd.rocal, which does not import here ({error.__cause__}): install "
                    f"ROCm's rocal and rocal-dev packages and set PYTHONPATH=/opt/rocm/lib")
    try:
        gpus = jax.devices("rocm")
    except RuntimeError:
        gpus = []
    if len(gpus) < 2:
        pytest.skip(f"needs at least 2 AMD GPUs visible to JAX, found {len(gpus)}")
    return gpus


@pytest.fixture(scope="module")
def encoded_dir(tmp_path_factory):
    """One data_batch file (see the module docstring); sample i encodes i, label i % 10."""
    root = tmp_path_factory.mktemp("rocal_encoded")
    indices = np.arange(NUM_ENCODED)
    loaders.write_cifar10(root / "data_batch_1.bin", encoded_images(indices), indices % 10)
    return str(root)


def _run_to_the_end(pipes, devices, max_steps):
    """Each pipeline run until rocAL reports the end (at most max_steps): per shard, the
    list of (images, labels) on the host."""
    out = [[] for _ in pipes]
    for k, (pipe, device) in enumerate(zip(pipes, devices)):
        while len(out[k]) < max_steps:
            step = loaders.rocal_step(pipe, device)
            if step is None:
                break
            out[k].append((np.asarray(step[0]), step[1]))
    return out


@pytest.mark.rocal
@pytest.mark.parametrize("last_batch", ["fill", "drop"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_rocal_shards_conform_to_the_plan(amd_gpus, encoded_dir, shuffle, last_batch):
    mesh = loaders.data_mesh(amd_gpus)
    devices, n = list(mesh.devices.flat), len(amd_gpus)
    ref_images, ref_labels = loaders.read_cifar10(encoded_dir)
    if shuffle and last_batch == "fill":  # the loader refuses this; the pipelines still run
        length = loaders.num_steps(NUM_ENCODED, n, BATCH, last_batch)
        pipes = [loaders.rocal_pipeline(encoded_dir, shard_id=k, num_shards=n, device=d,
                                        batch_size=BATCH, shuffle=True, last_batch="fill")
                 for k, d in enumerate(devices)]
    else:
        loader = loaders.make_loader(encoded_dir, mesh, BATCH, backend="rocal", shuffle=shuffle,
                                     last_batch=last_batch)
        length, pipes = len(loader), [loader.pipelines[k] for k in range(n)]
    found = []
    try:
        for epoch in range(2):
            if epoch:
                for pipe in pipes:
                    pipe.rocal_reset_loaders()
            remaining = [pipe.get_remaining_images() for pipe in pipes]
            out = _run_to_the_end(pipes, devices, max_steps=4 * -(-NUM_ENCODED // BATCH) + 4)
            delivered = [np.array([decode_indices(images, NORM) for images, _ in shard],
                                  np.int64).reshape(-1, BATCH) for shard in out]
            here = describe_deviations(delivered, NUM_ENCODED, BATCH, shuffle=shuffle,
                                       last_batch=last_batch, length=length)
            for k, shard in enumerate(out):
                bad = [(s, m) for s, (images, labels) in enumerate(shard) for m in describe_content(
                    images, labels, delivered[k][s], ref_images, ref_labels, NORM)]
                if bad:
                    steps = len({s for s, _ in bad})
                    more = f" (and at {steps - 1} more steps)" if steps > 1 else ""
                    here.append(f"shard {k} step {bad[0][0]}: {bad[0][1]}{more}")
            if here:
                here.append(f"rocAL's get_remaining_images() said {remaining} at the start")
            found += [f"epoch {epoch}: {m}" for m in here]
    finally:
        for pipe in pipes:
            pipe.rocal_release()
    setup = (f"rocAL cifar10 reader, {n} pipelines (shard_id=0..{n - 1}, num_shards={n}), "
             f"batch {BATCH}, {NUM_ENCODED} samples in one file, random_shuffle={shuffle}, "
             f"last_batch={last_batch}; deviations from the intended shards "
             f"[N*k//n, N*(k+1)//n):\n")
    more = f"\n... and {len(found) - 40} more" if len(found) > 40 else ""
    assert not found, setup + "\n".join(found[:40]) + more


@pytest.mark.rocal
@pytest.mark.parametrize("layout", loaders.LAYOUTS)
@pytest.mark.parametrize("last_batch", ["fill", "drop"])
def test_rocal_loader_matches_the_reference_loader(amd_gpus, encoded_dir, layout, last_batch):
    mesh = loaders.data_mesh(amd_gpus)
    reference = loaders.make_loader(encoded_dir, mesh, BATCH, layout=layout, last_batch=last_batch)
    loader = loaders.make_loader(encoded_dir, mesh, BATCH, layout=layout, last_batch=last_batch,
                                 backend="rocal")
    assert len(loader) == len(reference), \
        f"len() says {len(loader)}, the reference loader has {len(reference)} steps"
    try:
        for epoch in range(2):
            for step, (got, want) in enumerate(zip(loader.epoch(epoch), reference.epoch(epoch))):
                where = f"epoch {epoch} step {step} ({layout}, {last_batch})"
                for name in ("images", "labels", "mask"):
                    assert got[name].shape == want[name].shape, f"{where}: {name} shape"
                    assert got[name].sharding == want[name].sharding, f"{where}: {name} sharding"
                images = np.asarray(got["images"]).reshape((-1,) + loaders.IMAGE_SHAPE)
                ref = np.asarray(want["images"]).reshape((-1,) + loaders.IMAGE_SHAPE)
                same = (np.allclose(images, ref, atol=1e-5)
                        and np.array_equal(np.asarray(got["labels"]), np.asarray(want["labels"]))
                        and np.array_equal(np.asarray(got["mask"]), np.asarray(want["mask"])))
                assert same, (f"{where}: rocAL delivers samples "
                              f"{decode_indices(images, NORM).tolist()}, the reference "
                              f"{decode_indices(ref, NORM).tolist()}")
    finally:
        loader.close()
