"""The rocAL backend (rocal_loader.py, rocal_api.py): on a double of rocAL, and on real rocAL where it imports.

* ``FakeRocal`` stands in for amd.rocal (in ``sys.modules`` inside a test only): rocAL 2.3.0's
  cifar10 reader over the real file, with the API facts measured on a real build. ``copy_data``
  is a raw memcpy; ``dlpack_device(id)`` and ``__dlpack__(id)`` but no ``__dlpack_device__`` (or
  none of it: a build without DLPack); one output tensor over a ring of two buffers, run r's
  written again by run r+2; ``get_remaining_images()`` counting down as FILL/DROP with padding
  do; DROP moving on by B at each reset; padding copies shuffled in; files in readdir order,
  the prefix matched anywhere; ``mirror=1``, NHWC and uint8 by default; optionally the stale
  run past the end; by default the native sharding bug (every shard_id the same stream).
  Not modelled: rocAL's mt19937 order and rocal_release's 0.1 s wait.
* On the double: the pipelines' arguments, the files of each order and where they go,
  refusals, the reference's bits (order "plan": every field; "vendor": no "index"), masks by
  content, errors naming shard and step, bounded releases and builds, output checks, DLPack and
  the GPU path on CPU devices (the ring buffer's waits).
* rocAL's GPU arithmetic and crop anchor, read in rocAL's, MIVisionX's and RPP's source.
* Conformance: images that encode their index go through raw pipelines and the loader; each
  departure from the plan is described in words and held to ``known_deviations``, rocAL
  2.3.0's, so a deviation that appears or disappears fails (on the double: the controls).
* Real rocAL (``-m rocal``, skipped where amd.rocal does not import): the cells in
  ``REAL_IN_CI``, the pixels, resumes, DLPack on real tensors, the release through its C API.
* With --run-slow: the sweeps, refimpl.py end to end and two jax.distributed processes (this
  file is their worker program).
"""

import collections
import ctypes
import dataclasses
import functools
import os
import re
import shutil
import tempfile
import sys
import threading
import time
import types as pytypes

import jax
import numpy as np
import pytest

if __name__ != "__main__":  # two_process_worker runs in a child process that sets its own devices
    from conftest import assert_same_bits, assert_same_params, bits_differ, exactly_once, refimpl_resized
import conformance
import encoding
import loaders
import rocal_api
import rocal_loader
from arithmetic import Normalize, crop_anchor, crop_mirror_normalize
from cifar_mnist import read_cifar10, synthetic_cifar10, write_cifar10
from plan import LAST_BATCH_POLICIES, LoaderState, num_steps, shard_bounds

NORM = Normalize()  # the notebook's: mean = std = 127.5, rocAL's arithmetic
B = 4  # the conformance test's batch


def dataset_size(n: int) -> int:
    """Shards of 12 (a multiple of B: rocAL's epoch over them is a batch short of the plan)
    and of 13 (padded by rocAL with 3 copies of their last record)."""
    return 12 * n + max(1, n // 2)


def write_encoded(folder, N: int) -> str:
    """One data_batch file where sample i encodes i (label i % 10), plus a test_batch."""
    os.makedirs(folder, exist_ok=True)
    index = np.arange(N)
    write_cifar10(os.path.join(folder, "data_batch_1.bin"), encoding.encoded_images(index), index % 10)
    write_cifar10(os.path.join(folder, "test_batch.bin"), encoding.encoded_images(index[:4]), index[:4] % 10)
    return str(folder)


# --------------------------------------------------------------------------
# FakeRocal: a simulation of amd.rocal 2.3.0's cifar10 pipelines
# --------------------------------------------------------------------------

OK, RUNTIME_ERROR = 0, 2  # rocAL's RocalStatus values
NO_META_DATA = "{ labels_meta_data } No meta data has been loaded"


class ShardReader:
    """rocAL's CIFAR10DataReader for internal shard ``shard_id`` of ``shard_count``:
    [D*k//c, D*(k+1)//c) padded (pad_last_batch) with copies of its last record up to
    whole batches of the largest shard; DROP reads B entries fewer per epoch when the
    largest shard is not a whole number of batches."""

    def __init__(self, records: int, shard_id: int, shard_count: int, batch: int, drop: bool,
                 pad: bool, shuffle: bool, pad_extra: int = 0):
        start, stop = records * shard_id // shard_count, records * (shard_id + 1) // shard_count
        largest = -(-records // shard_count)
        padding = (largest - (stop - start)) + batch - largest % batch if pad and largest % batch else 0
        self.entries = np.array(list(range(start, stop)) + [stop - 1] * (padding + pad_extra))
        self.batch, self.shuffle, self.drop = batch, shuffle, drop
        self.permutation = np.random.default_rng(shard_id).permutation(len(self.entries))
        if shuffle:  # padding copies shuffled in among the real records
            self.entries = self.entries[self.permutation]
        # Reader::count_items: DROP leaves out a batch when the largest shard needed padding.
        self.per_epoch = len(self.entries) - (batch if drop and largest % batch else 0)
        self.offset = self.consumed = 0

    def remaining(self) -> int:
        return self.per_epoch - self.consumed

    def next_batch(self) -> np.ndarray:
        at = self.offset + self.consumed + np.arange(self.batch)
        self.consumed += self.batch
        return self.entries[at % len(self.entries)]

    def reset(self, prefetch: int) -> None:
        """The read position moves on by what the prefetcher read (the whole epoch when it ran
        to the end, more than was consumed when stopped early), and with DROP by B more."""
        read = self.per_epoch if self.remaining() < self.batch else self.consumed + prefetch * self.batch
        self.offset = (self.offset + read + (self.batch if self.drop else 0)) % len(self.entries)
        if self.shuffle:
            self.entries = self.entries[self.permutation]
        self.consumed = 0


class FakeTensor:
    """rocalTensor: the same object every run, pointing at the current ring slot."""

    def __init__(self, pipe):
        self.pipe = pipe

    @property
    def slot(self) -> np.ndarray:
        return self.pipe.ring[self.pipe.current]

    def dimensions(self):
        return list(self.slot.shape)

    def dtype(self):
        return str(self.slot.dtype)

    def layout(self):
        return self.pipe.cmn.get("output_layout", "NHWC")

    def copy_data(self, array):
        """A raw memcpy of the slot's bytes to ``array``'s first byte, as rocAL's: no check of
        shape, dtype, order or writeability. (Unlike rocAL it refuses to write past a buffer's end.)"""
        if not isinstance(array, np.ndarray):
            raise TypeError("copy_data(): incompatible function arguments")
        room = array.base.nbytes if isinstance(array.base, np.ndarray) else array.nbytes
        assert room >= self.slot.nbytes, "the real copy_data would write past the end of this buffer"
        ctypes.memmove(array.ctypes.data, self.slot.ctypes.data, self.slot.nbytes)



class FakeTensorWithDLPack(FakeTensor):
    """rocalTensor of a rocAL built with ENABLE_DLPACK (the archive's is)."""

    def dlpack_device(self, device_id):
        return (1, device_id)  # kDLCPU, with the id given, as rocAL's CPU backend says

    def __dlpack__(self, device_id):  # one positional argument: no stream, as rocAL's
        return self.slot.__dlpack__()  # a zero-copy alias of the ring slot


class FakeTensorWithoutDLPack(FakeTensor):
    """rocalTensor of a rocAL built without ENABLE_DLPACK (rocAL_pybind/rocal_pybind.cpp,
    release-staging/rocm-rel-7.0): no dlpack_device, and __dlpack__ raises."""

    def __dlpack__(self, device_id):
        raise RuntimeError("Dlpack not installed. Please use CPU backend or try again after installing dlpack.")


class FakeRocal:
    """Stands in for amd.rocal inside a test; see the module docstring.

    Options: ``sharding_bug`` (rocAL 2.3.0's native sharding), ``stale_run_past_end``
    (one OK run per epoch at remaining 0, stale data, labels raise), ``build_failures``
    (the next builds raise RuntimeError), ``verify_fails`` (build() prints and calls
    exit(0)), ``pad_extra`` (pad more copies than rocAL's rule: a broken rocAL),
    ``fail`` = (run, how): every pipeline's run number ``run`` (from 0) raises (how
    "raise") or returns RUNTIME_ERROR (how "status").
    """

    def __init__(self, *, sharding_bug=True, stale_run_past_end=False, build_failures=0,
                 verify_fails=False, pad_extra=0, fail=None, dlpack=True):
        self.tensor_type = FakeTensorWithDLPack if dlpack else FakeTensorWithoutDLPack
        self.sharding_bug, self.stale_run_past_end = sharding_bug, stale_run_past_end
        self.build_failures, self.verify_fails, self.pad_extra, self.fail = \
            build_failures, verify_fails, pad_extra, fail
        self.pipelines = []
        self.current = None
        self.modules = self._modules()

    def install(self, monkeypatch) -> "FakeRocal":
        for name, module in self.modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        return self

    def _modules(self) -> dict:
        rocal = self
        names = ["amd", "amd.rocal", "amd.rocal.pipeline", "amd.rocal.fn", "amd.rocal.types", "rocal_pybind"]
        modules = {name: pytypes.ModuleType(name) for name in names}
        modules["amd"].rocal = modules["amd.rocal"]
        for name in ("pipeline", "fn", "types"):
            setattr(modules["amd.rocal"], name, modules[f"amd.rocal.{name}"])
        modules["rocal_pybind"].__file__ = os.path.join(os.path.dirname(__file__), "no-such-folder", "x.so")
        modules["rocal_pybind"].rocalTensor = self.tensor_type
        modules["amd.rocal.pipeline"].Pipeline = lambda **kwargs: FakePipeline(rocal, kwargs)

        def cifar10(**kwargs):
            rocal.current.reader = kwargs
            return "cifar10-output"

        def crop_mirror_normalize(source, **kwargs):
            assert source == "cifar10-output"
            rocal.current.cmn = kwargs
            return "cmn-output"

        modules["amd.rocal.fn"].readers = pytypes.SimpleNamespace(cifar10=cifar10)
        modules["amd.rocal.fn"].crop_mirror_normalize = crop_mirror_normalize
        for name in ("NCHW", "NHWC", "FLOAT", "UINT8", "DEVICE_MEMORY", "HOST_MEMORY",
                     "LAST_BATCH_FILL", "LAST_BATCH_DROP", "LAST_BATCH_PARTIAL"):
            setattr(modules["amd.rocal.types"], name, name)
        modules["amd.rocal.types"].OK, modules["amd.rocal.types"].RUNTIME_ERROR = OK, RUNTIME_ERROR
        return modules


class FakePipeline:
    def __init__(self, rocal: FakeRocal, kwargs: dict):
        print("Pipeline has been created succesfully")  # as rocAL does, every time
        self.rocal, self.kwargs = rocal, kwargs
        self.reader, self.cmn, self.outputs = None, None, None
        self.calls, self.built, self.released = [], False, False
        self.tensor = rocal.tensor_type(self)
        self.runs = 0
        rocal.pipelines.append(self)

    def __enter__(self):
        self.rocal.current = self
        return self

    def __exit__(self, *exc):
        return False

    def set_outputs(self, *outputs):
        self.outputs = outputs

    @property
    def batch(self) -> int:
        return self.kwargs["batch_size"]

    def build(self):
        self.calls.append("build")
        if self.rocal.build_failures:
            self.rocal.build_failures -= 1
            raise RuntimeError(NO_META_DATA)
        if self.rocal.verify_fails:
            print("Verify graph failed")
            exit(0)
        root, prefix = self.reader["file_root"], self.reader["filename_prefix"]
        names = [n for n in os.listdir(root) if prefix in n]  # readdir order, substring match
        parts = [read_cifar10(root, name) for name in names]
        self.images = np.concatenate([p[0] for p in parts])
        self.labels = np.concatenate([p[1] for p in parts])
        count, shard = self.reader["num_shards"], self.reader["shard_id"]
        drop = self.reader["last_batch_policy"] == "LAST_BATCH_DROP"
        ids = range(count) if self.rocal.sharding_bug else [shard]
        self.readers = [ShardReader(len(self.labels), i, count, self.batch, drop,
                                    self.reader["pad_last_batch"], self.reader["random_shuffle"],
                                    self.rocal.pad_extra) for i in ids]
        self.turn = 0
        c, h, w = (3,) + tuple(self.cmn.get("crop", (32, 32)))
        shape = (self.batch, c, h, w) if self.cmn.get("output_layout") == "NCHW" else (self.batch, h, w, c)
        dtype = np.float32 if self.cmn.get("output_dtype") == "FLOAT" else np.uint8
        self.ring, self.current = [np.zeros(shape, dtype), np.zeros(shape, dtype)], 0
        self.labels_now, self.stale_done = None, False
        self.built = True
        return self

    def get_remaining_images(self):
        self.calls.append(("remaining", self._remaining()))
        return self._remaining()

    def _remaining(self) -> int:
        return sum(r.remaining() for r in self.readers)

    def rocal_run(self):
        self.calls.append(("run", self._remaining()))
        if self.rocal.fail and self.rocal.fail[0] == self.runs:
            if self.rocal.fail[1] == "raise":
                raise RuntimeError("simulated rocAL failure")
            return RUNTIME_ERROR
        ready = [r for r in self.readers if r.remaining() >= self.batch]
        if not ready:
            if self.rocal.stale_run_past_end and not self._remaining() and not self.stale_done:
                self.stale_done, self.labels_now = True, None  # no labels, and the batch of
                self.current = 1 - self.current  # two runs ago (rocAL's MasterGraph::run race)
                return OK
            return RUNTIME_ERROR
        for _ in self.readers:  # rocAL takes turns between its internal loaders, skipping empty ones
            self.turn = (self.turn + 1) % len(self.readers)
            if self.readers[self.turn].remaining() >= self.batch:
                break
        index = self.readers[self.turn].next_batch()
        self.runs += 1
        self.current = self.runs % 2
        self.ring[self.current][...] = self._normalize(self.images[index])
        self.labels_now = self.labels[index].astype(np.int32)
        return OK

    def _normalize(self, images):
        cmn = self.cmn
        crop = tuple(cmn.get("crop", (32, 32)))
        out = crop_mirror_normalize(
            images, crop=crop, mirror=bool(cmn.get("mirror", 1)),  # rocAL's default flips
            mean=cmn.get("mean", [0.0] * 3), std=cmn.get("std", [1.0] * 3),
            crop_pos=(cmn.get("crop_pos_y", 0.5), cmn.get("crop_pos_x", 0.5)), arithmetic="rocal")
        if cmn.get("output_layout") != "NCHW":
            out = out.transpose(0, 2, 3, 1)
        return out if cmn.get("output_dtype") == "FLOAT" else out.astype(np.uint8)

    def get_output_tensors(self):
        return [self.tensor]

    def get_image_labels(self):
        self.calls.append("labels")
        if self.labels_now is None:
            raise RuntimeError(NO_META_DATA)
        return self.labels_now.copy()

    def rocal_reset_loaders(self):
        self.calls.append("reset")
        for reader in self.readers:
            reader.reset(prefetch=2)
        self.stale_done = False

    def rocal_release(self):
        self.calls.append("release")
        self.released = True


@pytest.fixture
def fake(monkeypatch):
    return FakeRocal().install(monkeypatch)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """50 encoded samples: on 4 shards, 12, 13, 12, 13."""
    return write_encoded(tmp_path_factory.mktemp("rocal-small"), 50)


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


@pytest.fixture(scope="module")
def mesh4():
    """Four CPU devices in a mesh order that differs from their ids."""
    cpus = jax.devices("cpu")
    return loaders.data_mesh([cpus[i] for i in (2, 0, 3, 1)])


def shard_blocks(batch: dict, n: int) -> dict:
    """{name: (n, B, ...) numpy} from a global batch in either layout."""
    out = {}
    for name, x in batch.items():
        x = np.asarray(x)
        out[name] = x.reshape((n, -1) + x.shape[1:]) if x.ndim == (4 if name == "images" else 1) else x
    return out


def assert_same_arrays(got: dict, want: dict, where: str) -> None:
    """Bit for bit, with the same shape, dtype and sharding."""
    assert got.keys() == want.keys(), where
    for name in want:
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, f"{where} {name}"
        assert got[name].sharding == want[name].sharding, f"{where} {name}: sharding"
        assert_same_bits(got[name], want[name], f"{where} {name}")


def state_at(loader, epoch: int, step: int) -> LoaderState:
    """The state a job saves after ``step`` steps of a fresh ``epoch`` (the iterator's get_state)."""
    return loader.epoch(epoch).get_state().at_step(step)


def without_index(batch: dict) -> dict:
    """A reference batch as rocAL's own order delivers it: no "index" (rocAL picks the samples)."""
    return {name: x for name, x in batch.items() if name != loaders.INDEX}


# --------------------------------------------------------------------------
# Installing, choosing, refusing
# --------------------------------------------------------------------------


def test_without_rocal_the_error_says_how_to_install(monkeypatch, small_dir, mesh4):
    """Without amd.rocal: an ImportError saying how to install it, and no device is usable."""
    monkeypatch.setitem(sys.modules, "amd", None)
    monkeypatch.setitem(sys.modules, "amd.rocal", None)
    with pytest.raises(ImportError) as error:
        rocal_loader.make_rocal_loader(small_dir, mesh4, 2)
    for fragment in ("amd.rocal", "PYTHONPATH=/opt/rocm/lib", "'rocal' and 'rocal-dev'", "CPU backend"):
        assert fragment in str(error.value)
    assert not rocal_loader.usable(mesh4)


def test_auto_chooses_rocal_only_on_amd_gpus(monkeypatch, fake, mesh4):
    """usable and uses_gpu: AMD GPUs (ROCm or HIP clients) only, never CUDA or a mix."""
    def gpu(version):
        client = pytypes.SimpleNamespace(platform_version=version)
        return pytypes.SimpleNamespace(platform="gpu", client=client)

    rocm = pytypes.SimpleNamespace(platform="rocm")
    rocm_gpu, cuda_gpu = gpu("rocm 60400"), gpu("cuda 12020")
    cuda = pytypes.SimpleNamespace(platform="cuda")  # JAX's CUDA plugin's own platform name
    assert rocal_loader.usable([rocm, rocm_gpu])
    assert not rocal_loader.usable(mesh4)  # CPU devices: only when asked for
    assert not rocal_loader.usable([rocm, cuda_gpu]) and not rocal_loader.usable([])
    assert not rocal_loader.usable([cuda_gpu]) and not rocal_loader.usable([cuda, cuda])  # never on CUDA
    assert not rocal_loader.usable([gpu("")])  # a "gpu" that does not say ROCm is not taken for one
    hip = gpu("HIP 6.3.42131")  # a ROCm client may name HIP rather than ROCm
    assert rocal_loader.is_amd_gpu(hip) and rocal_loader.usable([hip, rocm_gpu]) and rocal_loader.uses_gpu([hip])
    cpu = pytypes.SimpleNamespace(platform="cpu")
    assert rocal_loader.uses_gpu([rocm, hip]) is True and rocal_loader.uses_gpu([cpu, cpu]) is False
    for mixed in ([cpu, rocm], [hip, cpu], [cpu, cuda_gpu], [rocm, cuda]):  # a mesh rocAL cannot serve
        with pytest.raises(ValueError, match=r"CPU devices or AMD GPUs, got platform\(s\)"):
            rocal_loader.uses_gpu(mixed)
    monkeypatch.setitem(sys.modules, "amd.rocal.pipeline", None)
    assert not rocal_loader.usable([rocm])


def test_refusals_build_no_pipeline(monkeypatch, small_dir, mesh4, fake, cache, tmp_path):
    """Bad arguments, and folders rocAL would read otherwise, are refused before a pipeline."""
    def refused(match, data=small_dir, **kwargs):
        with pytest.raises(ValueError, match=match):
            rocal_loader.make_rocal_loader(data, mesh4, 2, cache_dir=cache, **kwargs)

    refused("rocAL computes rocAL's arithmetic", normalize=Normalize(arithmetic="dali_cpu"))
    refused("rocAL computes rocAL's arithmetic", normalize=lambda x: x)
    refused("sharding must be one of", sharding="dali", order="vendor")
    refused("order must be one of", order="shuffled")
    refused("use order='vendor' with it", sharding="rocal")
    for threads in (0, 2.0, False):
        refused(f"num_threads must be an int >= 1, got {threads!r}", num_threads=threads)
    with pytest.raises(ValueError, match="larger than the smallest shard"):
        rocal_loader.make_rocal_loader(small_dir, mesh4, 13, cache_dir=cache)
    refused("does not fit", normalize=Normalize(crop=(40, 40)))
    mnist = (np.zeros((40, 1, 28, 28), np.uint8), np.zeros(40, np.int32))
    refused(r"rocAL's reader is CIFAR-10's", data=mnist,
            normalize=Normalize(mean=(0.0,), std=(255.0,)))
    refused("pass the folder", data=read_cifar10(small_dir), sharding="rocal", order="vendor")
    # rocal mode: rocAL must read what read_cifar10 reads, in the same order.
    odd = write_encoded(tmp_path / "odd", 16)
    write_cifar10(os.path.join(odd, "old_data_batch_1.bin"), encoding.encoded_images(np.arange(4)), np.arange(4))
    refused(r"rocAL would also read \['old_data_batch_1.bin'\]", data=odd, sharding="rocal", order="vendor")
    two = write_encoded(tmp_path / "two", 16)
    write_cifar10(os.path.join(two, "data_batch_2.bin"), encoding.encoded_images(np.arange(4)), np.arange(4))
    listdir = os.listdir
    monkeypatch.setattr(rocal_loader.os, "listdir", lambda root: sorted(listdir(root), reverse=True))
    refused("directory order", data=two, sharding="rocal", order="vendor")
    monkeypatch.setattr(rocal_loader.os, "listdir", listdir)
    os.mkdir(os.path.join(two, "a-folder"))
    refused("only the subfolders", data=two, sharding="rocal", order="vendor")
    assert fake.pipelines == []


def test_rocal_sharding_is_refused_naming_the_bug(small_dir, mesh4, fake, cache):
    """sharding='rocal' on a rocAL that ignores shard_id: refused at the first pipeline, naming the bug."""
    with pytest.raises(RuntimeError) as error:
        rocal_loader.make_rocal_loader(small_dir, mesh4, 4, sharding="rocal", order="vendor", cache_dir=cache)
    text = str(error.value)
    # 4 internal loaders of 16 (12 or 13 padded to 16): 64 instead of 16.
    assert "get_remaining_images() = 64; with working sharding it would be 16" in text
    assert "ignores shard_id" in text and "same batch" in text and "sharding='files'" in text
    assert len(fake.pipelines) == 1 and fake.pipelines[0].released  # refused at the first pipeline


# --------------------------------------------------------------------------
# The pipelines' arguments (both backends), and the files each order writes
# --------------------------------------------------------------------------


NORM_ARGS = Normalize(mean=(1.0, 2.0, 3.0), std=(4.0, 5.0, 6.0), mirror=True, crop=(28, 30), crop_pos=(0.25, 0.75))


def assert_pipeline_arguments(pipe, *, seed: int, shuffle: bool, norm=NORM_ARGS) -> None:
    """CPU backend, NCHW float32, shard 0 of 1, FILL + pad_last_batch, mirror explicit."""
    assert pipe.kwargs == dict(batch_size=4, num_threads=1, device_id=0, seed=seed, rocal_cpu=True,
                               tensor_layout="NCHW", tensor_dtype="FLOAT", output_memory_type="HOST_MEMORY")
    assert pipe.reader == dict(file_root=pipe.reader["file_root"], shard_id=0, num_shards=1,
                               filename_prefix="data_batch_", random_shuffle=shuffle,
                               last_batch_policy="LAST_BATCH_FILL", pad_last_batch=True)
    assert pipe.cmn == dict(output_layout="NCHW", output_dtype="FLOAT", crop=norm.crop,
                            crop_pos_x=norm.crop_pos[1], crop_pos_y=norm.crop_pos[0], mirror=int(norm.mirror),
                            mean=list(norm.mean), std=list(norm.std))
    assert pipe.outputs == ("cmn-output",) and pipe.built and pipe.released


@pytest.mark.parametrize("shuffle, last_batch", [(False, "fill"), (True, "drop")])
def test_plan_order_feeds_each_pipeline_a_file_of_its_planned_slots(small_dir, mesh4, fake, cache, shuffle,
                                                                    last_batch):
    """order="plan", an epoch resumed at step 1: pipeline k reads one file of plan.indices[1:, k]
    in plan order (padding slots too), then TAIL_BATCHES batches never run; rocAL's shuffle off,
    shard 0 of 1. The file lives in a folder of the epoch's own under cache_dir, gone when the
    epoch ends, is closed or was never started; nothing is built before the first step."""
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, shuffle=shuffle, last_batch=last_batch,
                                            normalize=NORM_ARGS, seed=7, cache_dir=cache)
    images, labels = read_cifar10(small_dir)
    steps = loader.epoch(3, state=state_at(loader, 3, 1))
    assert fake.pipelines == []
    next(steps)
    assert steps.get_state() == state_at(loader, 3, 2)
    (scratch,) = os.listdir(cache)
    assert scratch.startswith(".rocal-epoch-3-")
    plan, tail = loader.plan(3), rocal_loader.TAIL_BATCHES * 4
    for k, pipe in enumerate(fake.pipelines):
        assert pipe.reader["file_root"] == os.path.join(cache, scratch, f"shard-{k:05d}")
        rows = np.concatenate([plan.indices[1:, k].ravel(), np.full(tail, plan.indices[-1, k, -1])])
        assert np.array_equal(pipe.images, images[rows]) and np.array_equal(pipe.labels, labels[rows])
        assert [c for c in pipe.calls if isinstance(c, tuple) and c[0] == "run"] == [("run", len(rows))]
    list(steps)
    for pipe in fake.pipelines:
        assert_pipeline_arguments(pipe, seed=7, shuffle=False)
        runs = [c for c in pipe.calls if isinstance(c, tuple) and c[0] == "run"]
        assert len(runs) == len(loader) - 1 and all(left > tail for _, left in runs)  # the tail never runs
    assert os.listdir(cache) == []  # the epoch's files are gone
    # Left early, or never started: released and deleted all the same.
    steps = loader.epoch(0)
    next(steps)
    steps.close()
    assert all(p.released for p in fake.pipelines) and os.listdir(cache) == []
    loader.epoch(1)  # never started: builds and writes nothing
    assert len(fake.pipelines) == 8 and os.listdir(cache) == []


@pytest.mark.parametrize("shuffle", [False, True])
def test_vendor_order_gets_a_fill_pipeline_over_each_shards_file(small_dir, mesh4, fake, cache, shuffle):
    """order="vendor", files mode: pipeline k reads its shard's records, in order, as one file."""
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, shuffle=shuffle, last_batch="drop",
                                            normalize=NORM_ARGS, seed=7, cache_dir=cache, order="vendor")
    images, labels = read_cifar10(small_dir)
    assert fake.pipelines == []  # built per epoch
    list(loader.epoch(0))
    assert len(fake.pipelines) == 4
    for k, pipe in enumerate(fake.pipelines):
        assert_pipeline_arguments(pipe, seed=7, shuffle=shuffle)
        root = pipe.reader["file_root"]
        assert root.startswith(cache) and os.listdir(root) == ["data_batch_1.bin"]
        start, stop = shard_bounds(50, k, 4)
        got = read_cifar10(root)
        assert np.array_equal(got[0], images[start:stop]) and np.array_equal(got[1], labels[start:stop])


def test_stray_files_in_the_cache_folder_are_neither_read_nor_touched(small_dir, mesh4, fake, cache):
    """cache_dir holding what the loader did not write: CIFAR-10 files a reader of the folder
    would take as records (negative control: a pipeline over it does), a shard folder, and the
    leftovers of an earlier epoch's folder. Both orders' epochs are the reference's and every
    stray is left as it was. A stray beside a cached shard file, which rocAL would read with
    it, is refused, named."""
    os.makedirs(os.path.join(cache, ".rocal-epoch-0", "shard-00000"))
    strays = {"data_batch_1.bin": 7, "test_batch.bin": 2, os.path.join("shard-00000", "data_batch_1.bin"): 3,
              os.path.join(".rocal-epoch-0", "shard-00000", "data_batch_2.bin"): 5}
    for name, count in strays.items():
        os.makedirs(os.path.dirname(os.path.join(cache, name)), exist_ok=True)
        write_cifar10(os.path.join(cache, name), encoding.encoded_images(np.arange(100, 100 + count)),
                      np.full(count, 9))

    def contents() -> dict:
        return {os.path.relpath(os.path.join(top, name), cache): open(os.path.join(top, name), "rb").read()
                for top, _, names in os.walk(cache) for name in names if "rocal-shards-" not in top}

    before = contents()
    reference = loaders.make_loader(small_dir, mesh4, 4, prefetch=0)
    for order in rocal_loader.ORDERS:
        loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, cache_dir=cache, order=order)
        for step, got in enumerate(loader.epoch(0)):
            want = reference.batch(0, step)
            assert_same_arrays(got, want if order == "plan" else without_index(want), f"{order} step {step}")
        assert contents() == before, f"{order}: a stray file was changed or removed"
    pipe = rocal_loader.rocal_pipeline(cache, batch_size=1, normalize=NORM, on_gpu=False)
    assert pipe.get_remaining_images() == 7, "control: a reader of the cache folder reads the strays"
    [shard] = [f for f in rocal_loader.shard_folders(*read_cifar10(small_dir), 4, cache) if f.endswith("1")]
    write_cifar10(os.path.join(shard, "data_batch_2.bin"), encoding.encoded_images(np.arange(2)), np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"shard-00001/data_batch_1.bin: the cached shard should hold 13 "
                                         r"records, alone in its folder .*'data_batch_2.bin'"):
        rocal_loader.make_rocal_loader(small_dir, mesh4, 4, cache_dir=cache, order="vendor")


def test_gpu_and_rocal_sharding_arguments(small_dir, fake):
    """The GPU backend's arguments, rocAL's sharding passed on, mirror=0 explicit."""
    rocal_loader.rocal_pipeline(small_dir, batch_size=8, normalize=NORM, on_gpu=True, device_id=3,
                                shard_id=2, num_shards=4, shuffle=True, num_threads=8)
    (pipe,) = fake.pipelines
    assert pipe.kwargs == dict(batch_size=8, num_threads=8, device_id=3, seed=0, rocal_cpu=False,
                               tensor_layout="NCHW", tensor_dtype="FLOAT", output_memory_type="DEVICE_MEMORY")
    assert pipe.reader == dict(file_root=small_dir, shard_id=2, num_shards=4, filename_prefix="data_batch_",
                               random_shuffle=True, last_batch_policy="LAST_BATCH_FILL", pad_last_batch=True)
    assert pipe.cmn["mirror"] == 0 and pipe.cmn["crop"] == (32, 32)  # never rocAL's default mirror=1


def test_rocal_sharding_on_a_fixed_rocal_reads_the_original_folder(monkeypatch, small_dir, mesh4, cache):
    """sharding='rocal' on a rocAL whose sharding works: checked at build, then the reference's
    batches (no "index") read from the data folder itself."""
    fixed = FakeRocal(sharding_bug=False).install(monkeypatch)
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, sharding="rocal", order="vendor",
                                            cache_dir=cache)
    # The build-time check of rocAL's sharding: one pipeline per shard, released at once.
    assert [(p.reader["file_root"], p.reader["shard_id"], p.reader["num_shards"]) for p in fixed.pipelines] \
        == [(small_dir, k, 4) for k in range(4)] and all(p.released for p in fixed.pipelines)
    assert not os.path.exists(cache)  # no files written
    reference = loaders.make_loader(small_dir, mesh4, 4, prefetch=0)
    for step, got in enumerate(loader.epoch(0)):
        assert_same_arrays(got, without_index(reference.batch(0, step)), f"step {step}")


def test_shard_files_are_written_once_atomically_and_keyed_by_content(cache):
    """Shard k's records as one file, written once, keyed by the data and n; a damaged cached file
    is named, never read."""
    images, labels = encoding.encoded_images(np.arange(30)), (np.arange(30) % 10).astype(np.int32)
    folders = rocal_loader.shard_folders(images, labels, 4, cache)
    assert len(folders) == 4 and len({os.path.dirname(f) for f in folders}) == 1
    assert sorted(os.listdir(cache)) == [os.path.basename(os.path.dirname(folders[0]))]  # no scratch left
    for k, folder in enumerate(folders):
        start, stop = shard_bounds(30, k, 4)
        got_images, got_labels = read_cifar10(folder)
        assert np.array_equal(got_images, images[start:stop])
        assert np.array_equal(got_labels, labels[start:stop])
    inode = os.stat(os.path.join(folders[0], "data_batch_1.bin")).st_ino
    assert rocal_loader.shard_folders(images, labels, 4, cache) == folders
    assert os.stat(os.path.join(folders[0], "data_batch_1.bin")).st_ino == inode  # not written again
    assert rocal_loader.shard_folders(images, labels, 3, cache)[0] not in folders
    labels[5] = 9
    assert rocal_loader.shard_folders(images, labels, 4, cache)[0] not in folders
    with open(os.path.join(folders[2], "data_batch_1.bin"), "ab") as f:
        f.write(b"\0" * 3073)
    with pytest.raises(ValueError, match="shard-00002/data_batch_1.bin: the cached shard should hold 7"):
        rocal_loader.shard_folders(images, np.where(np.arange(30) == 5, 5, labels), 4, cache)


PIXELS = Normalize(mean=(125.3, 123.0, 113.9), std=(63.0, 62.1, 66.7), crop=(29, 27),
                          crop_pos=(0.25, 0.75), mirror=True)


def assert_pixels_are_the_rocal_table(mesh, cache: str) -> None:
    """Per-channel mean/std, a crop at (pos_y, pos_x) and a mirror: bit for bit the rocal
    table's, and not the same arguments with crop_pos swapped or no mirror."""
    n = mesh.devices.size
    rng = np.random.default_rng(7)
    images = rng.integers(0, 256, size=(8 * n, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, size=8 * n).astype(np.int32)
    loader = rocal_loader.make_rocal_loader((images, labels), mesh, 8, normalize=PIXELS, cache_dir=cache)
    try:
        (batch,) = list(loader.epoch(0))
    finally:
        loader.close()
    got = np.asarray(batch["images"])
    assert got.shape == (8 * n, 3, 29, 27)
    assert_same_bits(got, PIXELS(images), "rocAL's pixels against the rocal table")
    np.testing.assert_array_equal(np.asarray(batch["labels"]), labels)
    for wrong in (dict(crop_pos=(0.75, 0.25)), dict(mirror=False)):
        assert not np.array_equal(got, dataclasses.replace(PIXELS, **wrong)(images)), wrong


def test_crop_mirror_and_channels_reach_the_pipelines(mesh4, fake, cache):
    """assert_pixels_are_the_rocal_table on the double."""
    assert_pixels_are_the_rocal_table(mesh4, cache)


# --------------------------------------------------------------------------
# Epochs: the reference's bits, stateless, masks by content (order="vendor")
# --------------------------------------------------------------------------


@pytest.mark.parametrize("order, shuffle, last_batch, layout", [
    ("plan", True, "fill", "pmap"), ("plan", False, "drop", "sharded"),
    ("vendor", False, "fill", "sharded"), ("vendor", False, "drop", "pmap")])
def test_epochs_are_the_reference_loaders_bit_for_bit(small_dir, mesh4, fake, cache, order, shuffle, last_batch,
                                                      layout):
    """order="plan", shuffled or not: every field, "index" and "logical_shards" too. order="vendor",
    unshuffled (rocAL's order is then the plan's): every field but "index", which it leaves out."""
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, last_batch=last_batch, layout=layout,
                                            shuffle=shuffle, seed=11, order=order, cache_dir=cache)
    reference = loaders.make_loader(small_dir, mesh4, 4, last_batch=last_batch, layout=layout, shuffle=shuffle,
                                    seed=11, prefetch=0)
    assert len(loader) == len(reference) == {"fill": 4, "drop": 3}[last_batch]
    for epoch in (1, 0):
        batches = list(loader.epoch(epoch))
        assert len(batches) == len(loader)
        for step, got in enumerate(batches):
            want = reference.batch(epoch, step)
            assert_same_arrays(got, want if order == "plan" else without_index(want), f"epoch {epoch} step {step}")
        assert loader.real_samples(epoch) == reference.real_samples(epoch)
    if order == "vendor" and last_batch == "fill":  # shards 0, 2 (12 samples): 3 rocAL batches, the 4th filled
        runs = [sum(1 for call in p.calls if isinstance(call, tuple) and call[0] == "run")
                for p in fake.pipelines]
        assert runs == [3, 4, 3, 4] * 2
    assert loader.describe().startswith("AMD rocAL ? (CPU backend): 4 pipeline(s) per epoch")


@pytest.mark.parametrize("order", rocal_loader.ORDERS)
def test_epochs_are_a_function_of_seed_epoch_and_step(small_dir, mesh4, fake, cache, order):
    """Nothing depends on history: epoch 3 twice is the same; two loaders built alike give the
    same epochs in any call order, also iterated at once; resumed from the state of step s, the
    epoch's steps s.. . order="plan": a new seed or epoch is a new order. order="vendor": rocAL
    seeds its shuffle by shard_id and each epoch has fresh pipelines, so every epoch and seed
    has the same order (the module docstring says so)."""
    def images_of(batches):
        return [(np.asarray(b["images"]), np.asarray(b["mask"])) for b in batches]

    def differ(a, b) -> str | None:
        """Why two reads differ (batch count, or the first batch whose images or mask are not
        the same bits, by bits_differ: never a bare == on ~200 KB values), or None."""
        if len(a) != len(b):
            return f"{len(a)} batches, then {len(b)}"
        for step, (x, y) in enumerate(zip(a, b)):
            why = bits_differ(x[0], y[0]) or bits_differ(x[1], y[1])
            if why:
                return f"batch {step}: {why}"
        return None

    make = lambda seed=5: rocal_loader.make_rocal_loader(small_dir, mesh4, 4, shuffle=True, seed=seed,
                                                         order=order, cache_dir=cache)
    one, two = make(), make()
    three = images_of(one.epoch(3))
    zero = images_of(one.epoch(0))
    assert three and zero and differ(images_of(one.epoch(3)), three) is None
    later, first = two.epoch(3), two.epoch(0)  # two epochs in flight at once
    assert differ(images_of(later), three) is None and differ(images_of(first), zero) is None
    for start in (1, len(one) - 1, len(one)):
        assert differ(images_of(one.epoch(3, state=state_at(one, 3, start))), three[start:]) is None, start
    other_seed, other_epoch = images_of(make(6).epoch(3)), images_of(one.epoch(4))
    if order == "plan":
        assert differ(other_seed, three) and differ(other_epoch, three)
    else:
        assert differ(other_seed, three) is None and differ(other_epoch, three) is None
    with pytest.raises(ValueError, match="epoch=-1"):
        one.epoch(-1)
    assert all(p.released for p in fake.pipelines)


@pytest.mark.parametrize("last_batch", ["fill", "drop"])
def test_vendor_shuffled_masks_are_found_by_content(small_dir, mesh4, fake, cache, last_batch):
    """rocAL's shuffled padding copies are masked where they fall: fill, each record real once;
    drop, none twice; padding holds the shard's last record."""
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, shuffle=True, last_batch=last_batch,
                                            cache_dir=cache, order="vendor")
    blocks = [shard_blocks(b, 4) for b in loader.epoch(0)]
    got = np.stack([encoding.decode_indices(b["images"].reshape(-1, 3, 32, 32), NORM).reshape(4, 4)
                    for b in blocks], 1)  # (n, steps, B)
    mask = np.stack([b["mask"] for b in blocks], 1)
    assert loader.real_samples(0) == mask.sum() == loader.real_samples(7)  # every epoch alike
    for k in range(4):
        start, stop = shard_bounds(50, k, 4)
        real = got[k][mask[k]]
        assert np.all(got[k][~mask[k]] == stop - 1), "padding holds the shard's last record"
        if last_batch == "fill":
            assert sorted(real.tolist()) == list(range(start, stop))
        else:
            assert len(set(real.tolist())) == len(real) and np.all((real >= start) & (real < stop))
    if last_batch == "fill":
        assert mask.sum() == 50
        assert not mask[:, :-1].all(), "rocAL's padding sits before the last step"
    else:
        assert not mask.all(), "rocAL's padding copies fall in the steps kept"


def test_vendor_drop_and_shuffle_counts_its_real_slots_by_reading(small_dir, mesh4, fake, cache):
    """real_samples reads one epoch (once) to count drop + shuffle's real slots: every epoch's."""
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, shuffle=True, last_batch="drop",
                                            cache_dir=cache, order="vendor")
    count = loader.real_samples(2)  # nothing read yet: it reads an epoch (once)
    assert len(fake.pipelines) == 4 and count < 4 * len(loader) * 4
    assert loader.real_samples(0) == count and len(fake.pipelines) == 4
    masks = [np.asarray(b["mask"]) for b in loader.epoch(5)]
    assert sum(int(m.sum()) for m in masks) == count


def test_a_reused_pipeline_would_start_its_next_epoch_rotated(small_dir, fake):
    """Why each epoch has fresh pipelines: a rocAL pipeline reset before the end of its epoch
    restarts where its prefetcher was (the double does as rocAL 2.3.0 does)."""
    pipe = rocal_loader.rocal_pipeline(os.path.join(small_dir), batch_size=5, normalize=NORM, on_gpu=False)
    first = lambda: (pipe.rocal_run(), encoding.decode_indices(pipe.tensor.slot, NORM)[0])[1]
    assert first() == 0
    pipe.rocal_reset_loaders()
    assert first() != 0


def test_vendor_drop_runs_out_the_rest_of_rocals_epoch(small_dir, mesh4, fake, cache):
    """Drop: the batch rocAL has past the plan's steps is run at the end, so its padding is checked."""
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, last_batch="drop", cache_dir=cache,
                                            order="vendor")
    list(loader.epoch(0))
    # Shards of 13: 4 rocAL batches, 3 steps; the 4th is run (and its padding checked) at the end.
    assert [p._remaining() for p in fake.pipelines] == [0, 0, 0, 0]
    assert [p.runs for p in fake.pipelines] == [3, 4, 3, 4]


@pytest.mark.parametrize("order", rocal_loader.ORDERS)
def test_a_stale_run_past_the_end_is_never_reached(monkeypatch, small_dir, mesh4, cache, order):
    """A pipeline is never run at 0 remaining, where rocAL can return a stale OK batch (negative
    control: a loop on the status meets it)."""
    stale = FakeRocal(stale_run_past_end=True).install(monkeypatch)
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, cache_dir=cache, order=order)
    for epoch in range(2):
        assert len(list(loader.epoch(epoch))) == 4
    # Negative control: running on the status, as rocAL's own iterators do, meets it: one
    # more OK run with the batch of two runs before, and no labels.
    pipe = rocal_loader.rocal_pipeline(small_dir, batch_size=4, normalize=NORM, on_gpu=False,
                                       shard_id=1, num_shards=4)
    stale.sharding_bug = False
    pipe.build()
    seen = []
    while pipe.rocal_run() == OK:
        assert len(seen) < 10, "the double's pipeline of 16 records still runs OK after 10 batches"
        seen.append(encoding.decode_indices(pipe.get_output_tensors()[0].slot, NORM).tolist())
        try:
            pipe.get_image_labels()
        except RuntimeError as error:
            assert "No meta data has been loaded" in str(error)
            break
    assert len(seen) == 5 and seen[-1] == seen[-3] == [20, 21, 22, 23]


# --------------------------------------------------------------------------
# Errors: named, bounded, never written through
# --------------------------------------------------------------------------


@pytest.mark.parametrize("order, how, where", [
    ("plan", "raise", "rocAL, shard 0 on cpu:2, epoch 0 step 1: "),
    ("vendor", "status", "rocAL, shard 0 on cpu:2, epoch 0 step 1 (batch 2 of its 3): ")])
def test_rocal_errors_name_the_shard_and_the_step(monkeypatch, small_dir, mesh4, cache, how, order, where):
    """A run that raises, or returns an error status, is an error naming the shard, its device,
    the epoch and the step; the epoch's files are gone."""
    FakeRocal(fail=(1, how)).install(monkeypatch)  # the 2nd run of every pipeline
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, cache_dir=cache, order=order)
    with pytest.raises(RuntimeError) as error:
        list(loader.epoch(0))
    text = str(error.value)
    left = {"plan": (4 - 1 + rocal_loader.TAIL_BATCHES) * 4, "vendor": 8}[order]
    said = {"raise": "rocal_run() raised RuntimeError: simulated rocAL failure",
            "status": f"rocal_run() returned 2 with {left} samples left"}[how]
    assert text.startswith(where + said), text
    assert not os.path.exists(cache) or not [n for n in os.listdir(cache) if n.startswith(".rocal-epoch")]


def test_padding_that_is_not_rocals_is_an_error_not_a_guess(monkeypatch, small_dir, mesh4, cache):
    """A rocAL that pads more than its rule says is refused before a run (both orders); one
    whose padding found by content at the epoch's end is not what it padded, after it."""
    FakeRocal(pad_extra=4).install(monkeypatch)  # a rocAL that pads a whole batch more than it says
    with pytest.raises(RuntimeError, match=r"shard 0, epoch 0: get_remaining_images\(\) = 16 for shard 0 "
                                           r"\(12 records read with FILL \+ pad_last_batch\); expected 12"):
        list(rocal_loader.make_rocal_loader(small_dir, mesh4, 4, cache_dir=cache, order="vendor").epoch(0))
    with pytest.raises(RuntimeError, match=r"shard 0, epoch 0: get_remaining_images\(\) = 36 for a file of "
                                           r"32 records \(whole batches of 4\); expected 32"):
        list(rocal_loader.make_rocal_loader(small_dir, mesh4, 4, cache_dir=cache).epoch(0))
    assert os.listdir(cache) == [os.path.basename(os.path.dirname(rocal_loader.shard_folders(
        *read_cifar10(small_dir), 4, cache)[0]))]  # the shard files; no epoch files left
    FakeRocal().install(monkeypatch)
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, shuffle=True, cache_dir=cache, order="vendor")
    loader.shards[1] = dataclasses.replace(loader.shards[1], padded=2)  # rocAL said 2 copies, gave 3
    with pytest.raises(RuntimeError, match="shard 1, at the end of epoch 0: .* so 3 padding copies; rocAL "
                                           "padded 2. The masks of this epoch cannot be trusted"):
        list(loader.epoch(0))


def test_rocals_labels_are_checked_by_value(monkeypatch, small_dir, mesh4, fake, cache):
    """order="plan": each run's labels must be the plan's samples' labels; a rocAL that reads
    the right number of labels with one value wrong is an error naming shard and step."""
    run = FakePipeline.rocal_run

    def one_label_off(self):
        status = run(self)
        if self.reader["file_root"].endswith("shard-00001") and self.runs == 2:
            self.labels_now[3] = (self.labels_now[3] + 1) % 10
        return status

    monkeypatch.setattr(FakePipeline, "rocal_run", one_label_off)
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, cache_dir=cache)
    with pytest.raises(RuntimeError, match=r"shard 1 on .*, epoch 0 step 1: rocAL read labels \[.*\] from "
                                           r"the epoch's file, which holds"):
        list(loader.epoch(0))


@pytest.mark.parametrize("order, off", [("plan", -4), ("vendor", 4)])
def test_rocals_remaining_count_is_checked_both_ways(monkeypatch, small_dir, mesh4, fake, cache, order, off):
    """Before every run get_remaining_images() must be exactly what is left of the epoch: a
    rocAL that says a batch more, or a batch less, is an error naming shard and step."""
    remaining = FakePipeline.get_remaining_images
    monkeypatch.setattr(FakePipeline, "get_remaining_images", lambda self: remaining(self) + (
        off if self.runs == 2 and self.reader["file_root"].endswith(("shard-00002", "shard-00001")[order == "vendor"])
        else 0))
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, cache_dir=cache, order=order)
    with pytest.raises(RuntimeError, match=r"shard \d on .*, epoch 0 step 2.*: get_remaining_images\(\) says "
                                           r"(\d+), but (?!\1)\d+ samples are left"):
        list(loader.epoch(0))


def test_a_resumed_vendor_epoch_is_checked_as_a_whole_one(monkeypatch, small_dir, mesh4, fake, cache):
    """order="vendor" resumed at step s reads steps 0..s-1 too: the real-slot count of a
    drop + shuffle epoch first read resumed is the whole epoch's, and the masks found by
    content are still held to the plan (unshuffled) and to rocAL's padding."""
    make = lambda **kw: rocal_loader.make_rocal_loader(small_dir, mesh4, 4, cache_dir=cache, order="vendor", **kw)
    resumed, whole = make(shuffle=True, last_batch="drop"), make(shuffle=True, last_batch="drop")
    assert len(list(resumed.epoch(0, state=state_at(resumed, 0, 2)))) == len(resumed) - 2
    assert resumed.real_samples(0) == whole.real_samples(0) < 4 * len(whole) * 4
    for shuffle in (False, True):
        loader = make(shuffle=shuffle)
        loader.shards[1] = dataclasses.replace(loader.shards[1], padded=2)  # rocAL said 2 copies, gave 3
        with pytest.raises(RuntimeError, match="shard 1, at the end of epoch 0: .* so 3 padding copies"):
            list(loader.epoch(0, state=state_at(loader, 0, len(loader) - 1)))
    # Shard 3 = [37, 50): record 38 made a twin of its last record 49, and the loader told that
    # the shard holds none of that content (copies=0): step 0's twin is then taken for padding
    # where the plan has a real sample. Resumed at the last step, that step 0 is still checked.
    images, labels = (np.array(x) for x in read_cifar10(small_dir))
    images[38], labels[38] = images[49], labels[49]
    loader = rocal_loader.make_rocal_loader((images, labels), mesh4, 4, cache_dir=cache, order="vendor")
    assert loader.shards[3].copies == 2
    loader.shards[3] = dataclasses.replace(loader.shards[3], copies=0)
    with pytest.raises(RuntimeError, match=r"shard 3 on .*, epoch 0 step 0: the shard's last record sits in "
                                           r"slots \[1\] as padding, the plan pads slots \[\]"):
        list(loader.epoch(0, state=state_at(loader, 0, 3)))


def test_an_interrupted_steps_copies_are_waited_for_before_release(monkeypatch, small_dir, mesh4, fake, cache,
                                                                 as_if_on_amd_gpus):
    """The GPU path: a run that fails in the middle of a step (shard 2 of 4, step 1) leaves
    copies of that step's first shards in flight; every copy made is waited for before
    the first pipeline is released."""
    copies, waited = [], []
    device_images, wait = rocal_loader.device_images, jax.block_until_ready
    monkeypatch.setattr(rocal_loader, "device_images", lambda *a, **k: copies.append(device_images(*a, **k))
                        or copies[-1])
    monkeypatch.setattr(jax, "block_until_ready", lambda arrays: (
        waited.extend(id(x) for x in jax.tree.leaves(arrays) if not any(p.released for p in fake.pipelines)),
        wait(arrays))[1])
    run = FakePipeline.rocal_run

    def fails_in_step_1_on_shard_2(self):
        if self.reader["file_root"].endswith("shard-00002") and self.runs == 1:
            raise RuntimeError("simulated rocAL failure")
        return run(self)

    monkeypatch.setattr(FakePipeline, "rocal_run", fails_in_step_1_on_shard_2)
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, cache_dir=cache)
    with pytest.raises(RuntimeError, match="shard 2 on .*, epoch 0 step 1.*simulated rocAL failure"):
        list(loader.epoch(0))
    assert len(copies) == 4 + 2 and all(p.released for p in fake.pipelines)
    assert {id(x) for x in copies} <= set(waited), "a copy was not waited for before its pipeline's release"


def test_an_evenly_divisible_largest_shard_is_not_padded():
    """rocal_padded_size, re-derived from its text on every (N, n, B) of a grid: rocAL pads
    each shard up to whole batches of the largest shard, and not at all when the largest
    shard is a whole number of batches (then each shard keeps its own size)."""
    for N in range(1, 41):
        for n in range(1, min(N, 6) + 1):
            largest = max(stop - start for start, stop in (shard_bounds(N, k, n) for k in range(n)))
            for B in range(1, 7):
                for k in range(n):
                    start, stop = shard_bounds(N, k, n)
                    want = stop - start if largest % B == 0 else (largest + B - 1) // B * B
                    assert rocal_loader.rocal_padded_size(N, n, k, B) == want, (N, n, k, B)
    assert rocal_loader.rocal_padded_size(10, 4, 0, 3) == 2  # shards 2,3,2,3, B=3: none padded


class ReleaseBlocksForEver:
    """A pipeline double whose rocal_release() never returns (rocAL 2.3.0's lost wake-up),
    waiting as rocAL's blocked thread does: without holding the GIL."""

    def __init__(self):
        self.entered, self.unblock = threading.Event(), threading.Event()

    def rocal_release(self):
        self.entered.set()
        self.unblock.wait()


def bounded(fn, seconds: float, what: str):
    """fn() on a thread; fails, naming ``what``, if it has not returned within ``seconds``."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{what} did not return within {seconds} s"
    return result


def test_a_release_that_blocks_for_ever_is_bounded_and_named(monkeypatch):
    """release_pipelines returns within RELEASE_TIMEOUT_S per blocked pipeline, warns naming
    it, releases the others, and reports it in unreleased(); the double really blocks
    (negative control: its release is still waiting after the call returned)."""
    monkeypatch.setattr(rocal_api, "RELEASE_TIMEOUT_S", 0.1)
    stuck, released = ReleaseBlocksForEver(), []
    before = pytypes.SimpleNamespace(rocal_release=lambda: released.append("shard 0"))
    after = pytypes.SimpleNamespace(rocal_release=lambda: released.append("shard 2"))
    try:
        with pytest.warns(rocal_api.RocalReleaseWarning) as caught:
            bounded(lambda: rocal_loader.release_pipelines({0: before, 1: stuck, 2: after}, "rocAL, epoch 7"),
                    5, "release_pipelines with a release that blocks for ever")
        assert [str(w.message).split(":")[0] for w in caught] == ["rocAL, epoch 7, shard 1"]
        assert "did not return within 0.1 s" in str(caught[0].message)
        assert released == ["shard 0", "shard 2"] and stuck.entered.is_set() and not stuck.unblock.is_set()
        assert "rocAL, epoch 7, shard 1" in rocal_api.unreleased()
        [thread] = [t for where, t in rocal_api._UNRELEASED if where == "rocAL, epoch 7, shard 1"]
        assert thread.daemon  # its release goes on in a daemon thread: the process can still exit
    finally:
        stuck.unblock.set()  # lets the double's release end, as a late wake-up would
    bounded(lambda: [t.join() for where, t in rocal_api._UNRELEASED if where.startswith("rocAL, epoch 7")],
            5, "the double's release once unblocked")
    assert "rocAL, epoch 7, shard 1" not in rocal_api.unreleased()
    # Called from a thread that is not a daemon (the main thread here), the stuck release is
    # still left in a daemon thread: it never keeps the process from exiting.
    again = ReleaseBlocksForEver()
    try:
        with pytest.warns(rocal_api.RocalReleaseWarning):
            rocal_loader.release_pipelines({4: again}, "rocAL, epoch 8")
        [thread] = [t for where, t in rocal_api._UNRELEASED if where == "rocAL, epoch 8, shard 4"]
        assert thread.daemon and not threading.current_thread().daemon
    finally:
        again.unblock.set()
    bounded(thread.join, 5, "the second double's release once unblocked")


def test_an_epoch_whose_release_blocks_ends_warns_and_cleans_up(monkeypatch, small_dir, mesh4, fake, cache):
    """Through the loader: shard 2's pipeline never releases; the epoch still ends (within
    the bound), every batch is the reference's, the warning names the epoch and the shard,
    and the epoch's files are deleted."""
    monkeypatch.setattr(rocal_api, "RELEASE_TIMEOUT_S", 0.2)
    stuck = ReleaseBlocksForEver()
    release = FakePipeline.rocal_release
    monkeypatch.setattr(FakePipeline, "rocal_release", lambda self: (
        stuck.rocal_release() if self.reader["file_root"].endswith("shard-00002") else release(self)))
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, shuffle=True, seed=2, cache_dir=cache)
    reference = loaders.make_loader(small_dir, mesh4, 4, shuffle=True, seed=2, prefetch=0)
    try:
        with pytest.warns(rocal_api.RocalReleaseWarning, match=r"rocAL, epoch 5, shard 2: rocal_release"):
            got = bounded(lambda: list(loader.epoch(5)), 5, "an epoch whose release blocks")[0]
    finally:
        stuck.unblock.set()
    for step, batch in enumerate(got):
        assert_same_arrays(batch, reference.batch(5, step), f"step {step}")
    assert [p.released for p in fake.pipelines] == [True, True, False, True]
    assert os.listdir(cache) == []


def test_builds_are_retried_a_bounded_number_of_times(monkeypatch, small_dir, capsys):
    """A build raising RuntimeError is retried BUILD_ATTEMPTS times; a graph that does not verify,
    or another error, is not; every failed pipeline is released."""
    flaky = FakeRocal(build_failures=2).install(monkeypatch)
    pipe = rocal_loader.rocal_pipeline(small_dir, batch_size=4, normalize=NORM, on_gpu=False)
    assert [p.released for p in flaky.pipelines] == [True, True, False] and pipe is flaky.pipelines[-1]
    FakeRocal(build_failures=rocal_api.BUILD_ATTEMPTS).install(monkeypatch)
    with pytest.raises(RuntimeError, match="building failed 3 times; rocAL said: .*No meta data"):
        rocal_loader.rocal_pipeline(small_dir, batch_size=4, normalize=NORM, on_gpu=False)
    unverified = FakeRocal(verify_fails=True).install(monkeypatch)
    with pytest.raises(RuntimeError, match="did not verify, and rocAL called exit.0.; it printed: .*Verify"):
        rocal_loader.rocal_pipeline(small_dir, batch_size=4, normalize=NORM, on_gpu=False)
    assert len(unverified.pipelines) == 1  # not retried
    # Each failed build's pipeline is released before the error (a half-built pipeline's
    # threads and buffers would stay): after a retried failure, after the last failure,
    # after a graph that did not verify, and after any other error.
    assert all(p.released for p in unverified.pipelines)
    failing = FakeRocal(build_failures=rocal_api.BUILD_ATTEMPTS).install(monkeypatch)
    with pytest.raises(RuntimeError):
        rocal_loader.rocal_pipeline(small_dir, batch_size=4, normalize=NORM, on_gpu=False)
    assert len(failing.pipelines) == rocal_api.BUILD_ATTEMPTS and all(p.released for p in failing.pipelines)
    other = FakeRocal().install(monkeypatch)
    monkeypatch.setattr(FakePipeline, "build", lambda self: (_ for _ in ()).throw(ValueError("odd")))
    with pytest.raises(RuntimeError, match="building raised ValueError: odd"):
        rocal_loader.rocal_pipeline(small_dir, batch_size=4, normalize=NORM, on_gpu=False)
    assert len(other.pipelines) == 1 and other.pipelines[0].released
    assert "Pipeline has been created" not in capsys.readouterr().out  # rocAL's chatter kept off stdout


def test_rocals_console_lines_are_kept_off_but_anything_else_gets_through(monkeypatch, small_dir, capfd):
    """rocAL prints two lines per pipeline ("OK: loaded 45 kernels from libvx_rpp.so", "Pipeline
    has been created succesfully"): kept off stdout. Any other line it prints (a warning, an
    error) is passed on."""
    fake = FakeRocal().install(monkeypatch)
    build = FakePipeline.build

    def chatty_build(self):
        print("OK: loaded 45 kernels from libvx_rpp.so")
        print("WRN: something rocAL wants you to know")
        return build(self)

    monkeypatch.setattr(FakePipeline, "build", chatty_build)
    rocal_loader.rocal_pipeline(small_dir, batch_size=4, normalize=NORM, on_gpu=False)
    out = capfd.readouterr().out
    assert "WRN: something rocAL wants you to know" in out and fake.pipelines[0].built
    assert "OK: loaded" not in out and "Pipeline has been created" not in out


def test_outputs_are_checked_before_rocals_raw_copy(small_dir, fake):
    """copy_output refuses, writing nothing, a buffer of another shape or dtype, not C-contiguous or
    read-only (negative control: rocAL's copy_data writes into any)."""
    pipe = rocal_loader.rocal_pipeline(small_dir, batch_size=4, normalize=NORM, on_gpu=False)
    pipe.rocal_run()
    (tensor,) = pipe.get_output_tensors()
    assert tensor.dimensions() == [4, 3, 32, 32] and tensor.dtype() == "float32" and tensor.layout() == "NCHW"
    assert not hasattr(tensor, "__dlpack_device__")
    big = np.full((8, 3, 32, 32), 7.0, np.float32)
    read_only = np.full((4, 3, 32, 32), 7.0, np.float32)
    read_only.flags.writeable = False
    bad = {"shape (4, 32, 32, 3)": np.full((4, 32, 32, 3), 7.0, np.float32),
           "dtype float64": np.full((4, 3, 32, 32), 7.0),
           "not C-contiguous": big[::2],
           "not C-contiguous ": np.asfortranarray(np.full((4, 3, 32, 32), 7.0, np.float32)),
           "read-only": read_only}
    for problem, buffer in bad.items():
        with pytest.raises(RuntimeError, match=re.escape(problem.strip())):
            rocal_loader.copy_output(tensor, buffer, "here")
        assert np.all(buffer == 7.0) and np.all(big == 7.0), f"{problem}: written"
    # Negative control: the double's copy_data itself writes into any of them, as rocAL's does.
    tensor.copy_data(bad["read-only"])
    assert not np.all(bad["read-only"] == 7.0)
    out = np.empty((4, 3, 32, 32), np.float32)
    rocal_loader.copy_output(tensor, out)
    np.testing.assert_array_equal(encoding.decode_indices(out, NORM), [0, 1, 2, 3])


def assert_dlpack_copy_survives_the_ring(pipe, device) -> None:
    """``device_images`` of run 1, then two more runs: the copy holds batch 1, while a
    zero-copy DLPack view of the same tensor has moved on to batch 3 (rocAL's tensor is a
    ring-buffer slot written again by the second following run)."""
    pipe.rocal_run()
    (tensor,) = pipe.get_output_tensors()
    with pytest.raises((TypeError, AttributeError)):  # no __dlpack_device__; __dlpack__ needs the id
        jax.dlpack.from_dlpack(tensor)
    assert rocal_api.RocalDLPack(tensor, 1).__dlpack_device__() == (1, 1)  # kDLCPU, the id given
    images = rocal_loader.device_images(tensor, device, (3, 32, 32), 4)
    alias = np.from_dlpack(rocal_api.RocalDLPack(tensor, 0))
    assert images.devices() == {device} and images.dtype == np.float32
    images.block_until_ready()  # what the loader's _Transfers sees to before the second next run
    pipe.rocal_run()
    np.testing.assert_array_equal(encoding.decode_indices(alias, NORM), [0, 1, 2, 3])  # intact one run on
    pipe.rocal_run()
    # From the second next run on, rocAL's output thread writes that slot again (real rocAL:
    # at once or a little later; it then holds batch 3 or a later one).
    deadline = time.monotonic() + 5
    while encoding.decode_indices(alias, NORM).tolist() == [0, 1, 2, 3] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert encoding.decode_indices(alias, NORM)[0] >= 8, "the view did not move on"
    np.testing.assert_array_equal(encoding.decode_indices(np.asarray(images), NORM), [0, 1, 2, 3])  # the copy did
    with pytest.raises(RuntimeError, match=r"output is float32 \(4, 3, 32, 32\) NCHW, expected float32 "
                                           r"\(8, 3, 32, 32\) NCHW"):
        rocal_loader.device_images(tensor, device, (3, 32, 32), 8)


def test_dlpack_import_is_a_copy_of_rocals_ring_buffer(small_dir, fake):
    """assert_dlpack_copy_survives_the_ring on the double; one tensor object every run."""
    pipe = rocal_loader.rocal_pipeline(small_dir, batch_size=4, normalize=NORM, on_gpu=False)
    assert_dlpack_copy_survives_the_ring(pipe, jax.devices("cpu")[1])
    assert pipe.get_output_tensors()[0] is pipe.tensor  # one tensor object, every run


@pytest.fixture
def as_if_on_amd_gpus(monkeypatch):
    """make_rocal_loader takes the suite's CPU devices for AMD GPUs: GPU pipelines (on the
    double), outputs through DLPack, as on a ROCm host."""
    monkeypatch.setattr(rocal_loader, "uses_gpu", lambda devices: True)


class RingWatch:
    """Watches the GPU path on the double: each DLPack copy (``device_images``) by the run it
    copied, each ``jax.block_until_ready`` on copies, and each run. ``late``: copies of run r
    not waited for when run r + 2 began (it writes their ring slot again). ``early``: copies
    waited for before run r + 1 began, but at the end (a wait on the freshest copies stalls the
    pipelines). ``waits``: the copies each wait covered."""

    def __init__(self, monkeypatch):
        self.copies, self.waited, self.late, self.waits = {}, {}, [], []
        images, wait, run = rocal_loader.device_images, jax.block_until_ready, FakePipeline.rocal_run

        def copied(tensor, *args, **kwargs):
            array = images(tensor, *args, **kwargs)
            self.copies[id(array)] = (array, tensor.pipe, tensor.pipe.runs)
            return array

        def waiting(arrays):
            leaves = [x for x in jax.tree.leaves(arrays) if id(x) in self.copies]
            self.waits.append(leaves)
            for x in leaves:
                self.waited.setdefault(id(x), self.copies[id(x)][1].runs)
            return wait(arrays)

        def running(pipe):
            self.late += [(pipe.reader["file_root"][-5:], r) for key, (_, p, r) in self.copies.items()
                          if p is pipe and r == pipe.runs - 1 and key not in self.waited]
            return run(pipe)

        monkeypatch.setattr(rocal_loader, "device_images", copied)
        monkeypatch.setattr(jax, "block_until_ready", waiting)
        monkeypatch.setattr(FakePipeline, "rocal_run", running)

    @property
    def early(self) -> list:
        return [(pipe.reader["file_root"][-5:], r) for key, (_, pipe, r) in self.copies.items()
                if self.waited.get(key) == r != pipe.runs]


@pytest.mark.parametrize("order, last_batch", [("plan", "drop"), ("vendor", "fill")])
def test_gpu_path_waits_for_each_copy_before_rocal_writes_its_slot_again(monkeypatch, small_dir, mesh4, fake, cache,
                                                                        as_if_on_amd_gpus, order, last_batch):
    """The GPU path on CPU devices (GPU pipelines, outputs copied through DLPack; the double's
    outputs a ring of two): the copy of run r is waited for before run r + 2 writes its slot
    again, and not before run r + 1 but at the end: one wait a step, all shards at once. The
    batches, all held at once, are the reference's (order "plan") or the host path's (order
    "vendor": the same masks found by content)."""
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, shuffle=True, seed=2, last_batch=last_batch,
                                            order=order, cache_dir=cache)
    assert loader.on_gpu and loader.dlpack and "(GPU backend)" in loader.describe()
    watch = RingWatch(monkeypatch)
    batches = list(loader.epoch(1))
    assert watch.copies and not watch.late and not watch.early, (watch.late, watch.early)
    assert len(watch.waits) == len(loader) - 2 + 1 and all(len(w) == 4 for w in watch.waits[:-1])
    for pipe, device in zip(fake.pipelines, mesh4.devices.flat):
        assert pipe.kwargs["rocal_cpu"] is False and pipe.kwargs["output_memory_type"] == "DEVICE_MEMORY"
        assert pipe.kwargs["device_id"] == device.id  # CPU devices have no local_hardware_id
    if order == "plan":
        reference = loaders.make_loader(small_dir, mesh4, 4, shuffle=True, seed=2, last_batch=last_batch,
                                        prefetch=0)
        want = [reference.batch(1, step) for step in range(len(reference))]
    else:
        host = dataclasses.replace(loader, dlpack=False)
        want = list(host.epoch(1))
        assert loader.real_samples(1) == host.real_samples(1)
    for step, (got, w) in enumerate(zip(batches, want, strict=True)):
        assert_same_arrays(got, w, f"step {step}")


def test_the_ring_watch_sees_a_missing_wait_and_an_early_one(monkeypatch, small_dir, mesh4, fake, cache,
                                                             as_if_on_amd_gpus):
    """RingWatch's negative controls: a wait one step later than the ring allows sees a copy late;
    one a step sooner, early."""
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, order="vendor", cache_dir=cache)
    for ring, seen in ((3, "late"), (1, "early")):
        monkeypatch.setattr(rocal_loader, "RING_SLOTS", ring)
        watch = RingWatch(monkeypatch)
        list(loader.epoch(0))
        assert getattr(watch, seen), seen


def test_a_gpu_loader_refuses_a_rocal_without_dlpack(monkeypatch, small_dir, mesh4, cache, as_if_on_amd_gpus):
    """The GPU path needs rocAL's tensor type with dlpack_device (a build with ENABLE_DLPACK):
    refused, building nothing, without it, and where rocal_pybind has no rocalTensor at all."""
    without = FakeRocal(dlpack=False).install(monkeypatch)
    with pytest.raises(RuntimeError, match=r"built without DLPack \(ENABLE_DLPACK off"):
        rocal_loader.make_rocal_loader(small_dir, mesh4, 4, cache_dir=cache)
    assert without.pipelines == []
    monkeypatch.delattr(sys.modules["rocal_pybind"], "rocalTensor")
    with pytest.raises(RuntimeError, match=r"built without DLPack \(ENABLE_DLPACK off"):
        rocal_api.check_dlpack()
    FakeRocal(dlpack=True).install(monkeypatch)
    rocal_api.check_dlpack()  # control


# --------------------------------------------------------------------------
# rocAL's GPU arithmetic: read in the source (no AMD GPU here), pinned
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mean, std", [((127.5,) * 3, (127.5,) * 3), ((125.3, 123.0, 113.9), (63.0, 62.1, 66.7))])
def test_rocals_gpu_kernel_computes_the_rocal_table(mean, std):
    """READ, NOT RUN. What rocAL's GPU backend computes for uint8 NCHW in, float32 out:

    * rocAL (ROCm/rocAL release-staging/rocm-rel-7.0, ccd08621),
      rocAL/source/augmentations/geometry_augmentations/node_crop_mirror_normalize.cpp,
      CropMirrorNormalizeNode::create_node: on the host, for either backend, float32
      inv = 1 / std[c] and shift = -(mean[c] * inv) (one channel: -(mean / std)).
    * MIVisionX (rocm-7.0.0), amd_openvx_extensions/amd_rpp/source/tensor/CropMirrorNormalize.cpp:
      the same two arrays, in the same positions, to rppt_crop_mirror_normalize_gpu and _host.
    * RPP (ROCm/rpp release-staging/rocm-rel-7.0, 9929a6e1),
      src/modules/tensor/rppt_tensor_geometric_augmentations.cpp, rppt_crop_mirror_normalize_gpu:
      U8 -> F32 goes to hip_exec_crop_mirror_normalize_tensor<Rpp8u, Rpp32f>, for NCHW 3 channels
      crop_mirror_normalize_pln_hip_tensor (src/modules/tensor/hip/kernel/crop_mirror_normalize.cpp),
      whose cmn_hip_compute(uchar*, float*, ...) is ``pix * multiplier + offset`` on float4 lanes
      (multiplier = inv, offset = shift), the pixel converted from uint8 exactly. HIP compiles with
      fp-contract=fast (and RPP's release flags add -Ofast): one fused multiply-add, rounded once,
      as the CPU kernel's _mm256_fmadd_ps (src/modules/tensor/cpu/kernel/crop_mirror_normalize.cpp).
      The results are normal floats far from the denormal range, so a flush-to-zero mode changes
      nothing.

    So the GPU's bits are the "rocal" table, the CPU's (checked on real rocAL). Computed here
    independently of loaders.py: the exact x*inv + shift (exact in float64 for these
    magnitudes), rounded once to float32. Negative control: without the contraction (two
    roundings) the table would differ."""
    mean32, std32 = np.float32(mean), np.float32(std)
    inv = np.float32(1) / std32
    shift = -(mean32 * inv)
    x = np.arange(256, dtype=np.float64)
    fused = (x[None] * inv[:, None].astype(np.float64) + shift[:, None].astype(np.float64)).astype(np.float32)
    separate = (np.float32(x[None]) * inv[:, None] + shift[:, None]).astype(np.float32)
    table = Normalize(mean=mean, std=std, arithmetic="rocal").table
    assert_same_bits(table, fused, "rocal table against one FMA")
    assert (separate != fused).sum() > 0  # the contraction matters: a kernel without it is another table


def test_rocals_crop_anchor_is_the_same_on_both_backends():
    """READ, NOT RUN (GPU). The crop window's anchor is computed on the host, in rocAL, for both
    backends: rocAL/source/parameters/parameter_rocal_crop.cpp, RocalCropParam::fill_crop_dims,
    ``std::nearbyintf(anchor * (W - cw))`` (float32 product, round half to even), then given to
    RPP as the ROI (CropMirrorNormalizeNode::update_node). arithmetic.crop_anchor(arithmetic="rocal")
    is that; DALI's rounds half away from zero (negative control)."""
    for pos, size, crop in [(0.5, 32, 27), (0.5, 32, 29), (0.25, 32, 30), (0.75, 32, 26), (0.3, 32, 1)]:
        want = int(np.rint(np.float32(pos) * np.float32(size - crop)))
        assert crop_anchor(pos, size, crop, "rocal") == want
    assert crop_anchor(0.5, 32, 27, "rocal") == 2 and crop_anchor(0.5, 32, 27, "dali_cpu") == 3


# --------------------------------------------------------------------------
# Conformance: what each shard delivers, against the plan, in words
# --------------------------------------------------------------------------

SHARDING_BUG = {
    "step count": "every pipeline counts the whole dataset (n internal loaders): n times the plan's steps",
    "batches arrived": "... and delivers that many batches",
    "same batch on several shards": "every pipeline delivers the same stream: shard_id is ignored",
    "samples on two shards": "so every sample is delivered by every shard",
    "outside the shard": "each pipeline delivers the whole dataset, not its shard",
}
SHORT_SHARD = {  # files mode, raw FILL pipelines: rocAL's own epoch over one shard's file
    "step count": "a shard of floor(N/n) = 12 samples, a multiple of B, needs no padding: rocAL's FILL "
                  "epoch over it is ceil(12/4) = 3 batches, one fewer than the plan's 4 (ceil(ceil(N/n)/B)), "
                  "so the shards would run different numbers of steps",
    "batches arrived": "... and the shards of 12 deliver that batch fewer",
}


def known_deviations(*, sharding: str, raw: bool, shuffle: bool, last_batch: str, sharding_bug: bool,
                     surplus: set) -> dict[str, str]:
    """rocAL 2.3.0's deviations from the plan in this test's setup, in words, by kind.

    ``sharding``: "files" or "rocal" (raw pipelines, or the loader with order="vendor"),
    or "plan" (the loader with order="plan": no deviation, whatever rocAL does).
    ``surplus``: (epoch, shard) where the shard's last record arrived more than once
    in the slots delivered (raw) or kept (loader) — where rocAL shuffled padding copies."""
    if sharding == "plan":
        return {}
    if sharding == "rocal" and sharding_bug:
        if not raw:
            return {"loader refused": "the loader checks rocAL's get_remaining_images() and refuses "
                                      "rocAL's sharding, naming the bug"}
        out = dict(SHARDING_BUG)
        if not shuffle:
            out["order"] = "each stream takes turns between the internal loaders and starts outside the shard"
        return out
    out = dict(SHORT_SHARD) if raw and sharding == "files" and last_batch == "fill" else {}
    if raw and sharding == "files" and last_batch == "drop" and not shuffle:
        out["order"] = ("rocAL's DROP moves the read position on by B at every reset "
                        "(CIFAR10DataReader::reset): a shard of a whole number of batches (12), where "
                        "nothing was dropped, starts its next epoch B samples late")
    if raw and last_batch == "drop" and shuffle and surplus:
        out["repeated"] = ("rocAL's DROP with pad_last_batch shuffles the padding copies in and drops the "
                           "last batch: the copies in the batches kept repeat the shard's last record")
    if not raw and last_batch == "drop" and shuffle and surplus:
        out["mask"] = ("drop with shuffle: padding copies rocAL shuffled into the steps kept are masked, "
                       "so those shards have fewer real slots than the plan's steps x B")
    if not raw and shuffle:
        out["same order in two epochs"] = (
            "order='vendor' builds fresh pipelines every epoch, and rocAL seeds its shuffle with the "
            "shard_id (std::mt19937(shard_id)), not the pipeline's seed: one fixed permutation per shard "
            "size, every epoch (shards of 12 and 13: a uniform shuffle repeats one with chance 1/12!)")
    return out


@dataclasses.dataclass
class Observed:
    found: conformance.Findings  # every epoch's, each example prefixed with its epoch
    surplus: set  # (epoch, shard): the shard's last record arrived more than once
    touched: dict  # kind -> {(epoch, shard)} its findings name
    lengths: list  # (epoch, the step count rocAL or the loader reports)


def conformance_run(mesh, folder: str, cache: str, *, sharding: str, raw: bool, shuffle: bool,
                    last_batch: str, epochs: int = 2, layout: str = "sharded") -> Observed:
    """Two epochs through the raw pipelines (FILL + pad for fill, the notebook's DROP + pad
    for drop) or the loader (``sharding`` "plan": order="plan", else order="vendor" with
    that sharding); every deviation from the plan as a finding, nothing raised."""
    images, labels = read_cifar10(folder)
    observed = Observed(conformance.Findings(), set(), collections.defaultdict(set), [])
    run = _raw_epochs if raw else functools.partial(_loader_epochs, layout=layout)
    reads = {}  # the loader's epochs as delivered, for describe_epochs
    for epoch, delivered, masks, length, found in run(mesh, folder, cache, images, labels, sharding=sharding,
                                                     shuffle=shuffle, last_batch=last_batch, epochs=epochs):
        observed.lengths.append((epoch, length))
        if delivered is not None and not raw:
            reads[epoch] = delivered
        if delivered is not None:
            N, n = len(labels), len(delivered)
            for k in range(n):
                stop = shard_bounds(N, k, n)[1]
                if (delivered[k] == stop - 1).sum() > 1:
                    observed.surplus.add((epoch, k))
            if shuffle and masks is not None:
                delivered, masks = conformance.real_first(delivered, masks)
            conformance.describe_epoch(delivered, N, B, shuffle=shuffle, last_batch=last_batch,
                                       length=length, masks=masks, findings=found)
        for kind, items in found.kinds.items():
            when = f"epoch {epoch}" if epoch >= 0 else "building"
            observed.found.kinds[kind] += [(f"{when}: {text}", *rest) for text, *rest in items]
            observed.touched[kind] |= {(epoch, k) for _, shards, *_ in items for k in shards}
    # How the loader's epochs relate (raw pipelines are reset between epochs instead: their
    # per-epoch findings name what a reset does).
    if len(reads) >= 2:
        for kind, items in conformance.describe_epochs(reads, B, shuffle=shuffle).kinds.items():
            observed.found.kinds[kind] += [(f"epochs {sorted(reads)}: {text}", *rest) for text, *rest in items]
    return observed


def _raw_epochs(mesh, folder, cache, images, labels, *, sharding, shuffle, last_batch, epochs):
    devices = list(mesh.devices.flat)
    n = len(devices)
    on_gpu = devices[0].platform != "cpu"
    roots = rocal_loader.shard_folders(images, labels, n, cache) if sharding == "files" else [folder] * n
    native = [dict(shard_id=k, num_shards=n) if sharding == "rocal" else {} for k in range(n)]
    policy = dict(last_batch_policy="FILL" if last_batch == "fill" else "DROP", pad_last_batch=True)
    pipes = {}
    try:
        for k in range(n):
            pipes[k] = rocal_loader.rocal_pipeline(
                roots[k], batch_size=B, normalize=NORM, on_gpu=on_gpu, shuffle=shuffle,
                device_id=devices[k].local_hardware_id if on_gpu else 0, **native[k], **policy)
    except Exception as error:  # described, not raised
        found = conformance.Findings()
        found.add("rocAL raised", f"building the pipelines: {type(error).__name__}: {error}")
        rocal_loader.release_pipelines(pipes, "rocAL, raw pipelines")
        yield -1, None, None, None, found
        return
    try:
        reset_errors = []
        for epoch in range(epochs):
            found, delivered, lengths = conformance.Findings(), [], {}
            for text in reset_errors:
                found.add("rocAL raised", f"before this epoch: {text}")
            reset_errors.clear()
            for k, pipe in pipes.items():
                got, where = [], f"rocAL, shard {k}"
                try:
                    remaining = pipe.get_remaining_images()
                    lengths[k] = remaining // B
                    if remaining % B:
                        found.add("step count", f"shard {k}: get_remaining_images() = {remaining}, not a "
                                  f"whole number of batches", shards=[k])
                    while pipe.get_remaining_images() > 0 and len(got) < 4 * remaining // B + 4:
                        where = f"rocAL, shard {k}, batch {len(got)}"
                        status = pipe.rocal_run()
                        if status != OK:
                            found.add("rocAL error", f"{where}: rocal_run() returned {status!r} with "
                                      f"{pipe.get_remaining_images()} samples left", shards=[k],
                                      steps=[len(got)])
                            break
                        tensor = pipe.get_output_tensors()[0]
                        if on_gpu:
                            batch = np.asarray(rocal_loader.device_images(tensor, devices[k], (3, 32, 32), B))
                        else:
                            batch = np.empty((B, 3, 32, 32), np.float32)
                            rocal_loader.copy_output(tensor, batch, where)
                        index = encoding.decode_indices(batch, NORM)
                        for text in conformance.describe_content(batch, pipe.get_image_labels(), index,
                                                                 images, labels, NORM):
                            found.add("content", f"shard {k} batch {len(got)}: {text}", shards=[k],
                                      steps=[len(got)])
                        got.append(index)
                except Exception as error:  # described, not raised
                    found.add("rocAL raised", f"{where}: {type(error).__name__}: {error}", shards=[k])
                delivered.append(np.array(got, np.int64).reshape(-1, B))
            longest = max(lengths.values(), default=0)
            for k, length in lengths.items():
                if length != longest:
                    found.add("step count", f"shard {k}: rocAL's epoch has {length} batches, another "
                              f"shard's {longest}: the shards would run different numbers of steps",
                              shards=[k])
            yield epoch, delivered, None, longest, found
            for k, pipe in pipes.items():  # after all ran: one just finished takes 0.1 s to reset
                try:
                    pipe.rocal_reset_loaders()
                except Exception as error:  # described with the next epoch
                    reset_errors.append(f"shard {k}: rocal_reset_loaders() raised {error}")
    finally:
        rocal_loader.release_pipelines(pipes, "rocAL, raw pipelines")


def _loader_epochs(mesh, folder, cache, images, labels, *, sharding, shuffle, last_batch, epochs, layout):
    n, N = mesh.devices.size, len(labels)
    order = "plan" if sharding == "plan" else "vendor"
    try:
        loader = rocal_loader.make_rocal_loader(folder, mesh, B, shuffle=shuffle, last_batch=last_batch,
                                                order=order, sharding="files" if order == "plan" else sharding,
                                                cache_dir=cache, layout=layout, seed=9)
    except (ValueError, RuntimeError) as error:
        found = conformance.Findings()
        found.add("loader refused", f"{type(error).__name__}: {error}")
        yield -1, None, None, None, found
        return
    reference = loaders.make_loader(folder, mesh, B, shuffle=shuffle, last_batch=last_batch, layout=layout,
                                    seed=9, prefetch=0)
    try:
        for epoch in range(epochs):
            found = conformance.Findings()
            try:
                batches = list(loader.epoch(epoch))
            except Exception as error:  # described, not raised
                found.add("loader raised", f"{type(error).__name__}: {error}")
                yield epoch, None, None, len(loader), found
                return
            blocks = [shard_blocks(b, n) for b in batches]
            delivered = [np.array([encoding.decode_indices(b["images"][k], NORM) for b in blocks],
                                  np.int64).reshape(-1, B) for k in range(n)]
            masks = [np.array([b["mask"][k] for b in blocks], bool).reshape(-1, B) for k in range(n)]
            for step, block in enumerate(blocks):
                for k in range(n):
                    for text in conformance.describe_content(block["images"][k], block["labels"][k],
                                                             delivered[k][step], images, labels, NORM):
                        found.add("content", f"shard {k} step {step}: {text}", shards=[k], steps=[step])
            plan = loader.plan(epoch)
            for k in range(n):
                stop = shard_bounds(N, k, n)[1]
                padding = delivered[k][~masks[k]]
                # The plan pads with its last real slot; rocAL with the shard's last record.
                want = plan.indices[:, k][~plan.mask[:, k]] if order == "plan" else stop - 1
                if padding.shape != np.shape(want) and order == "plan" or (padding != want).any():
                    found.add("padding content", f"shard {k}: padding holds {np.unique(padding).tolist()}, "
                              f"not {np.unique(want).tolist()}", shards=[k])
            try:
                said = loader.real_samples(epoch)
            except RuntimeError as error:
                said = f"an error ({error})"
            if said != sum(int(m.sum()) for m in masks):
                found.add("real samples", f"real_samples({epoch}) says {said}; the masks hold "
                          f"{sum(int(m.sum()) for m in masks)} real slots")
            if not shuffle or order == "plan":  # the reference's bits, masks and shardings
                for step, got in enumerate(batches[:len(reference)]):
                    want = reference.batch(epoch, step)
                    want = want if order == "plan" else without_index(want)
                    differ = sorted(set(got) ^ set(want)) or [
                        name for name in want if got[name].sharding != want[name].sharding
                        or bits_differ(got[name], want[name])]
                    if differ:
                        found.add("differs from the reference loader", f"step {step}: {differ} differ "
                                  f"from loaders.make_loader's", steps=[step])
            yield epoch, delivered, masks, len(loader), found
    finally:
        loader.close()


def check_known(observed: Observed, expected: dict[str, str], setup: str) -> str:
    """The report, and an assertion that its kinds are exactly the known ones; conditional
    kinds ("repeated", "mask") must touch exactly the shards where copies were kept."""
    report = observed.found.report(setup) or f"{setup}\nconforms: no deviation"
    known = "\n".join(f"  known: {kind}: {words}" for kind, words in expected.items()) or "  known: none"
    found = set(observed.found.kinds)
    message = (f"{report}\n{known}\n unknown deviations: {sorted(found - set(expected))}; known "
               f"deviations that did not appear (rocAL changed? update known_deviations): "
               f"{sorted(set(expected) - found)}")
    assert found == set(expected), message
    for kind in {"repeated", "mask"} & found:
        assert observed.touched[kind] == observed.surplus, \
            f"{message}\n{kind} names (epoch, shard) {sorted(observed.touched[kind])}; copies of the last " \
            f"record were kept in {sorted(observed.surplus)}"
    return f"{report}\n{known}"


def case_id(case) -> str:
    source, raw, shuffle, last_batch, layout = case
    what = "raw" if raw else ("loader" if source == "plan" else "loader-vendor")
    return f"{source}-{what}-{'shuffle' if shuffle else 'ordered'}-{last_batch}-{layout}"


# (source, raw, shuffle, last_batch, layout). source: "files" / "rocal" = rocAL's sharding
# bypassed / used (raw pipelines, or the loader with order="vendor"); "plan": order="plan".
RAW_CASES = [(source, True, shuffle, last_batch, "sharded") for source in rocal_loader.SHARDINGS
             for shuffle in (False, True) for last_batch in ("fill", "drop")]
LOADER_CASES = [(source, False, shuffle, last_batch, layout) for source in ("plan", "files", "rocal")
                for shuffle in (False, True) for last_batch in ("fill", "drop") for layout in loaders.LAYOUTS]
# By default (the rest with --run-slow), on the double: each control once, the sharding bug
# found and, fixed, gone; on real rocAL: every deviation the module docstring states, and one
# cell per order, vendor mode and layout.
DOUBLE_IN_CI = {(("rocal", True, False, "fill", "sharded"), True), (("rocal", True, False, "fill", "sharded"), False),
                (("rocal", False, False, "fill", "sharded"), True), (("rocal", False, False, "fill", "sharded"), False),
                (("files", True, False, "fill", "sharded"), True), (("files", False, True, "drop", "sharded"), True),
                (("plan", False, True, "fill", "sharded"), True)}
DOUBLE_CASES = [pytest.param(case, bug, marks=() if (case, bug) in DOUBLE_IN_CI else pytest.mark.slow,
                             id=f"{case_id(case)}-{'buggy' if bug else 'fixed'}-double")
                for case in RAW_CASES + [c for c in LOADER_CASES if c[-1] == "sharded"] for bug in (True, False)]
REAL_IN_CI = {("files", True, False, "fill", "sharded"), ("files", True, False, "drop", "sharded"),
              ("files", True, True, "drop", "sharded"), ("rocal", True, False, "fill", "sharded"),
              ("files", False, False, "fill", "sharded"), ("files", False, True, "drop", "pmap"),
              ("rocal", False, False, "fill", "sharded"), ("plan", False, True, "fill", "sharded"),
              ("plan", False, False, "drop", "pmap")}
REAL_CASES = [pytest.param(case, marks=() if case in REAL_IN_CI else pytest.mark.slow, id=case_id(case))
              for case in RAW_CASES + LOADER_CASES]


def setup_line(mesh, N, case, rocal: str) -> str:
    source, raw, shuffle, last_batch, layout = case
    what = ("raw rocAL pipelines" if raw else "the rocal_loader backend, order='plan'" if source == "plan"
            else "the rocal_loader backend, order='vendor'")
    return (f"{what} on {rocal}, source={source!r}, {mesh.devices.size} "
            f"{mesh.devices.flat[0].platform} devices, N={N}, batch {B}, shuffle={shuffle}, "
            f"last_batch={last_batch}, layout={layout}: deviations from the plan")


@pytest.fixture(scope="module")
def encoded_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rocal-encoded")


def encoded_for(encoded_dir, n: int) -> str:
    folder = os.path.join(encoded_dir, f"n{n}")
    return folder if os.path.isdir(folder) else write_encoded(folder, dataset_size(n))


@pytest.mark.parametrize("case, sharding_bug", DOUBLE_CASES)
def test_conformance_checker_on_the_double(monkeypatch, encoded_dir, cache, case, sharding_bug):
    """Controls: the double with rocAL 2.3.0's sharding bug is reported as such (negative
    control), and with the bug fixed it conforms (positive control), on 4 devices."""
    FakeRocal(sharding_bug=sharding_bug).install(monkeypatch)
    mesh = loaders.data_mesh(jax.devices("cpu")[:4])
    folder = encoded_for(encoded_dir, 4)
    sharding, raw, shuffle, last_batch, layout = case
    observed = conformance_run(mesh, folder, cache, sharding=sharding, raw=raw, shuffle=shuffle,
                               last_batch=last_batch, layout=layout)
    expected = known_deviations(sharding=sharding, raw=raw, shuffle=shuffle, last_batch=last_batch,
                                sharding_bug=sharding_bug, surplus=observed.surplus)
    check_known(observed, expected, setup_line(mesh, dataset_size(4), case, "the double"))
    if sharding == "rocal" and sharding_bug and raw:
        assert observed.lengths[0][1] == 4 * num_steps(dataset_size(4), 4, B, last_batch)  # n x
    if sharding == "rocal" and sharding_bug and not raw:
        assert "sharding bug" in observed.found.report()
    if sharding == "files" and raw and not shuffle and last_batch == "fill":
        assert "shard 0: rocAL's epoch has 3 batches, another shard's 4" in observed.found.report()


@pytest.mark.parametrize("case", [("rocal", True, False, "fill", "sharded"), ("files", True, False, "drop", "sharded"),
                                  ("files", False, True, "drop", "sharded")], ids=case_id)
def test_a_known_deviation_that_disappears_fails_the_check(monkeypatch, encoded_dir, cache, case):
    """Negative control for the real-rocAL test below: a rocAL whose deviation is gone (the
    double with the bug fixed, or without DROP's late start, or without shuffled padding) held
    to rocAL 2.3.0's known deviations fails, naming the deviation that did not appear."""
    sharding, raw, shuffle, last_batch, layout = case
    fixed = FakeRocal(sharding_bug=False).install(monkeypatch)
    if sharding == "files":  # a rocAL that neither moves on at reset nor shuffles its padding in
        monkeypatch.setattr(ShardReader, "reset", lambda self, prefetch: setattr(self, "consumed", 0))
        monkeypatch.setattr(ShardReader, "__init__", _reader_without_shuffled_padding(ShardReader.__init__))
    mesh = loaders.data_mesh(jax.devices("cpu")[:4])
    observed = conformance_run(mesh, encoded_for(encoded_dir, 4), cache, sharding=sharding, raw=raw,
                               shuffle=shuffle, last_batch=last_batch, layout=layout)
    rocal_2_3 = known_deviations(sharding=sharding, raw=raw, shuffle=shuffle, last_batch=last_batch,
                                 sharding_bug=True, surplus={(0, 0)})  # what rocAL 2.3.0 shows here
    with pytest.raises(AssertionError, match=r"known deviations that did not appear .*: \['"):
        check_known(observed, rocal_2_3, setup_line(mesh, dataset_size(4), case, "a fixed double"))
    assert fixed.pipelines


def _reader_without_shuffled_padding(init):
    def wrapped(self, records, shard_id, shard_count, batch, drop, pad, shuffle, pad_extra=0):
        init(self, records, shard_id, shard_count, batch, drop, pad, False, pad_extra)
        real = np.unique(self.entries)
        self.entries[:len(real)] = np.random.default_rng(shard_id).permutation(real) if shuffle else real
        self.shuffle = False
    return wrapped


# --------------------------------------------------------------------------
# Conformance on real rocAL (-m rocal): wherever amd.rocal imports
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rocal_mesh(devices):
    try:
        rocal_loader.import_rocal()
    except ImportError as error:
        pytest.skip(f"needs amd.rocal, which does not import here ({error.__cause__}); see "
                    f"rocal_api.INSTALL_HINT")
    if not (all(d.platform == "cpu" for d in devices) or all(rocal_loader.is_amd_gpu(d) for d in devices)):
        pytest.skip(f"rocAL runs on CPU devices or AMD GPUs; the suite's devices are {devices[0].platform}")
    if len(devices) < 2:
        pytest.skip("needs at least 2 devices to shard")
    # Two: order="vendor" waits out rocAL's 0.1 s release per pipeline and epoch, and shards of
    # 12 and 13 (dataset_size) show every deviation.
    return loaders.data_mesh(devices[:2])


@pytest.mark.rocal
@pytest.mark.parametrize("case", REAL_CASES)
def test_rocal_deviations_are_the_known_ones(rocal_mesh, encoded_dir, tmp_path, case):
    """The conformance matrix on real rocAL, one process: raw pipelines, and the loader
    (order x shuffle x last_batch x layout). order="plan": no deviation, and the reference
    loader's bits, masks and shardings at every step (checked in _loader_epochs); otherwise
    exactly rocAL 2.3.0's known deviations (test_a_known_deviation_that_disappears_fails_the_check
    shows the check failing when one disappears)."""
    n = rocal_mesh.devices.size
    folder = encoded_for(encoded_dir, n)
    sharding, raw, shuffle, last_batch, layout = case
    observed = conformance_run(rocal_mesh, folder, str(tmp_path / "cache"), sharding=sharding, raw=raw,
                               shuffle=shuffle, last_batch=last_batch, layout=layout)
    expected = known_deviations(sharding=sharding, raw=raw, shuffle=shuffle, last_batch=last_batch,
                                sharding_bug=True, surplus=observed.surplus)
    print(check_known(observed, expected, setup_line(rocal_mesh, dataset_size(n), case,
                                                     f"rocAL {rocal_api.rocal_version()}")))
    assert not os.path.isdir(tmp_path / "cache") or not [
        name for name in os.listdir(tmp_path / "cache") if name.startswith(".")], "files left behind"


@pytest.mark.rocal
def test_rocal_loader_equals_the_reference_loader_resumed_and_out_of_order(rocal_mesh, encoded_dir, tmp_path):
    """order="plan" on real rocAL: epoch 3, epoch 1 resumed at step 2, epoch 3 again resumed at
    step 1: the reference's steps, and no file left behind."""
    folder = encoded_for(encoded_dir, rocal_mesh.devices.size)
    loader = rocal_loader.make_rocal_loader(folder, rocal_mesh, B, shuffle=True, seed=3, cache_dir=str(tmp_path))
    reference = loaders.make_loader(folder, rocal_mesh, B, shuffle=True, seed=3, prefetch=0)
    for epoch, start in ((3, 0), (1, 2), (3, 1)):
        state = state_at(loader, epoch, start)
        for step, got in enumerate(loader.epoch(epoch, state=state), start=start):
            assert_same_arrays(got, reference.batch(epoch, step), f"epoch {epoch} step {step}")
    assert os.listdir(tmp_path) == []


@pytest.mark.rocal
def test_rocal_vendor_order_ignores_seed_and_epoch(rocal_mesh, encoded_dir, tmp_path):
    """order="vendor": a fresh pipeline per epoch, and rocAL seeds its shuffle with shard_id
    (CIFAR10DataReader: std::mt19937(_shard_id)), so every epoch and seed has one order. A
    pipeline that is reset instead reshuffles: the order changes each epoch (negative control)."""
    folder = encoded_for(encoded_dir, 2)
    orders = []
    for seed, epoch in ((0, 0), (12345, 1)):
        loader = rocal_loader.make_rocal_loader(folder, rocal_mesh, B, shuffle=True, seed=seed, order="vendor",
                                                cache_dir=str(tmp_path))
        orders.append([encoding.decode_indices(np.asarray(b["images"]), NORM).tolist()
                       for b in loader.epoch(epoch)])
    assert all(order == orders[0] for order in orders), "rocAL's shuffle now depends on the seed or epoch"
    pipe = rocal_loader.rocal_pipeline(folder, batch_size=B, normalize=NORM, on_gpu=False, shuffle=True, seed=5)
    try:
        epochs = []
        for _ in range(2):
            got = []
            while pipe.get_remaining_images() > 0:
                assert len(got) <= dataset_size(2) // B, \
                    f"rocAL's epoch still has {pipe.get_remaining_images()} images after {len(got)} batches"
                pipe.rocal_run()
                got.append(encoding.decode_indices(rocal_pipeline_output(pipe), NORM).tolist())
            epochs.append(got)
            pipe.rocal_reset_loaders()
    finally:
        rocal_loader.release_pipelines([pipe], "rocAL, a test pipeline")
    assert epochs[0] != epochs[1], "a reset rocAL pipeline no longer reshuffles"


@pytest.mark.rocal
def test_rocal_gpu_conversion_runs_on_real_rocal_tensors(rocal_mesh, encoded_dir, tmp_path):
    """The GPU path's conversion code on real rocAL outputs (the archive's rocAL is built with
    DLPack; its CPU backend's tensors say kDLCPU): device_images survives the ring buffer, and
    a loader that takes every output through DLPack is the reference's, bit for bit."""
    rocal_loader.check_dlpack()
    folder = encoded_for(encoded_dir, rocal_mesh.devices.size)
    pipe = rocal_loader.rocal_pipeline(folder, batch_size=4, normalize=NORM, on_gpu=False)
    try:
        assert_dlpack_copy_survives_the_ring(pipe, rocal_mesh.devices.flat[1])
    finally:
        rocal_loader.release_pipelines([pipe], "rocAL, a test pipeline")
    loader = dataclasses.replace(rocal_loader.make_rocal_loader(
        folder, rocal_mesh, B, shuffle=True, seed=4, last_batch="drop", cache_dir=str(tmp_path)), dlpack=True)
    reference = loaders.make_loader(folder, rocal_mesh, B, shuffle=True, seed=4, last_batch="drop", prefetch=0)
    for step, got in enumerate(list(loader.epoch(2))):
        assert_same_arrays(got, reference.batch(2, step), f"step {step}")


@pytest.mark.rocal
def test_rocal_negative_zero_mean_gives_the_reference_tables_bits(rocal_mesh, tmp_path):
    """Real rocAL, mean -0.0 after mean +0.0 (std -2): each loader's pixels
    are Normalize.table's bits, which differ in the sign of pixel value 0's entry (-(m*inv)
    keeps the sign of the zero: +0.0, then -0.0), so nothing keyed by mean == 0.0 is reused."""
    images = np.zeros((8, 3, 32, 32), np.uint8)
    images[:, :, 0, 1], images[:, :, 0, 2] = 7, 255
    labels = (np.arange(8) % 10).astype(np.int32)
    signs = []
    for mean in (0.0, -0.0):
        norm = Normalize(mean=(mean,) * 3, std=(-2.0,) * 3)
        loader = rocal_loader.make_rocal_loader((images, labels), rocal_mesh, 2, normalize=norm,
                                                cache_dir=str(tmp_path))
        got = np.asarray(next(iter(loader.epoch(0)))["images"])
        assert_same_bits(got, norm(images[:len(got)]), f"rocAL, mean {mean!r}")
        signs.append(bool(np.signbit(got[0, 0, 0, 0])))
    assert signs == [False, True], signs


@pytest.mark.rocal
def test_real_pipelines_are_released_through_rocals_c_api(rocal_mesh, encoded_dir):
    """release_pipelines frees a real pipeline with rocAL's C rocalRelease, called through a
    ctypes.CDLL function (which drops the GIL while it runs, so RELEASE_TIMEOUT_S can bound
    it; the pybind binding holds the GIL): the worker threads the build started are gone
    afterwards, and the Python object no longer holds the freed context."""
    _, _, c_release = rocal_api._rocal_c_api()
    assert not c_release._flags_ & ctypes._FUNCFLAG_PYTHONAPI, "called with the GIL held"
    tasks = lambda: set(os.listdir("/proc/self/task"))
    before = tasks()
    pipe = rocal_loader.rocal_pipeline(encoded_for(encoded_dir, rocal_mesh.devices.size), batch_size=B,
                                       normalize=NORM, on_gpu=False)
    started = tasks() - before
    pipe.rocal_run()
    assert started, "control: building a rocAL pipeline starts its loading and output threads"
    rocal_loader.release_pipelines([pipe], "rocAL, a test pipeline")
    assert not started & tasks() and pipe._handle is None


def rocal_pipeline_output(pipe) -> np.ndarray:
    tensor = pipe.get_output_tensors()[0]
    out = np.empty(tuple(int(d) for d in tensor.dimensions()), np.float32)
    rocal_loader.copy_output(tensor, out)
    return out


@pytest.mark.rocal
def test_rocal_pixels_are_the_rocal_table(rocal_mesh, tmp_path):
    """assert_pixels_are_the_rocal_table on real rocAL."""
    assert_pixels_are_the_rocal_table(rocal_mesh, str(tmp_path))


# --------------------------------------------------------------------------
# Resuming a saved epoch (plan.LoaderState), on other shards in order "plan"
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
    """What a loader of N samples on n0 shards of B0 saves after ``stop`` steps of epoch 1."""
    return LoaderState.start(N, n0, B0, epoch=1, **run).at_step(stop)


def resumed_pair(N: int, n1: int, B1: int, cache: str, order: str = "plan", **args):
    """(rocAL's loader, the reference loader) over N encoded samples on the first n1 CPU devices."""
    data = encoding.encoded_images(np.arange(N)), (np.arange(N) % 10).astype(np.int32)
    loader = rocal_loader.make_rocal_loader(data, cpu_devices(n1), B1, cache_dir=cache, order=order, **args)
    reference = loaders.make_loader(data, cpu_devices(n1), B1, prefetch=0, **args)
    return loader, reference


def check_resumed(loader, reference, saved: LoaderState, where: str) -> list:
    """rocAL's ``epoch(1, state=saved)`` is the reference's, bit for bit, with the same count,
    real slots and state after it, and leaves no file behind; returns rocAL's batches."""
    it, reference_it = loader.epoch(1, state=saved), reference.epoch(1, state=saved)
    got, want = list(it), list(reference_it)
    resized = saved.resized(reference.num_shards, reference.batch_size)
    assert len(got) == len(want) == resized.num_steps - saved.step, where
    for step, (g, w) in enumerate(zip(got, want), start=saved.step):
        assert_same_arrays(g, w, f"{where}: resumed step {step}")
    assert loader.real_samples(1, state=saved) == reference.real_samples(1, state=saved), where
    assert it.get_state() == reference_it.get_state(), where
    assert not os.path.isdir(loader.cache_dir) or not os.listdir(loader.cache_dir), "files left behind"
    return got


@pytest.fixture(scope="module")
def real_rocal():
    try:
        rocal_loader.import_rocal()
    except ImportError as error:
        pytest.skip(f"needs amd.rocal, which does not import here ({error.__cause__}); see "
                    f"rocal_api.INSTALL_HINT")


@pytest.mark.rocal
@pytest.mark.parametrize("n0, B0, stop, n1, B1, last_batch, shuffle, layout", RESUMED_CELLS)
def test_plan_order_resumes_on_other_shards_as_the_reference(real_rocal, tmp_path, n0, B0, stop, n1, B1,
                                                            last_batch, shuffle, layout):
    """order="plan" on real rocAL: a state saved on n0 shards of B0 resumes on n1 of B1 with
    the reference loader's batches (plan.elastic_plan's last segment), and the state after
    one more step resumes again, back on n0 x B0 (a chain of two changes)."""
    run = dict(seed=5, shuffle=shuffle, last_batch=last_batch)
    cache = str(tmp_path / "cache")
    saved = saved_state(48, n0, B0, stop, **run)
    loader, reference = resumed_pair(48, n1, B1, cache, layout=layout, **run)
    where = f"{n0}x{B0} -> {n1}x{B1} at step {stop}, {last_batch}, shuffle={shuffle}, {layout}"
    it = loader.epoch(1, state=saved)
    next(it)
    again = it.get_state()
    it.close()
    assert len(again.segments) == 2 and len(check_resumed(loader, reference, saved, where)) >= 2
    back, back_reference = resumed_pair(48, n0, B0, cache, layout=layout, **run)
    assert check_resumed(back, back_reference, again, where + f", then back to {n0}x{B0} at step {stop + 1}")


@pytest.mark.rocal
@pytest.mark.parametrize("n0, B0, stop, n1, B1, last_batch, edge", [
    (3, 2, 2, 8, 4, "fill", "a batch larger than every run"),  # 25 left: runs of 3 and 4, B=4
    (2, 4, 4, 7, 1, "fill", "shards with an empty run"),  # 5 left on 7 shards: two hold padding alone
    (4, 3, 2, 6, 3, "drop", "0 steps"),  # 13 left on 6 shards of 3: drop runs none
])
def test_plan_order_resumes_what_only_a_resized_segment_holds(real_rocal, tmp_path, n0, B0, stop, n1, B1,
                                                             last_batch, edge):
    """Segments a fresh epoch never has (make_loader refuses a batch larger than a shard, and
    every fresh shard holds samples): each pipeline's file holds them all the same."""
    run = dict(seed=8, shuffle=True, last_batch=last_batch)
    saved = saved_state(37, n0, B0, stop, **run)
    plan, row = saved.resized(n1, B1).plan()
    real = plan.mask[row:].sum(axis=(0, 2))  # per shard
    assert {"a batch larger than every run": len(plan.indices) - row == 1 and real.max() <= B1
            and real.min() < B1, "shards with an empty run": 0 < (real == 0).sum() < n1,
            "0 steps": len(plan.indices) == row}[edge], f"the case is not {edge!r}: {real}"
    loader, reference = resumed_pair(37, n1, B1, str(tmp_path / "cache"), layout="pmap", **run)
    check_resumed(loader, reference, saved, edge)


def test_a_resumed_segment_feeds_each_pipeline_its_rows_on_the_double(fake, cache):
    """The wiring, without rocAL: pipeline k's file holds plan.indices[row:, k] of the resumed
    segment (then the tail), the batches are the reference's. Negative control: the new shards'
    own plan from the saved step is not that epoch."""
    run = dict(seed=5, shuffle=True, last_batch="fill")
    saved = saved_state(48, 8, 2, 1, **run)
    loader, reference = resumed_pair(48, 3, 4, cache, **run)
    check_resumed(loader, reference, saved, "8x2 -> 3x4 on the double")
    plan, row = saved.resized(3, 4).plan()
    tail = rocal_loader.TAIL_BATCHES * 4
    assert len(fake.pipelines) == 3
    for k, pipe in enumerate(fake.pipelines):
        rows = np.concatenate([plan.indices[row:, k].ravel(), np.full(tail, plan.indices[-1, k, -1])])
        assert np.array_equal(encoding.decode_indices(pipe.images, None), rows), k
    own = state_at(loader, 1, saved.step)
    fresh_from_step = [np.asarray(b["images"]) for b in loader.epoch(1, state=own)]
    resumed = [np.asarray(b["images"]) for b in reference.epoch(1, state=saved)]
    assert len(fresh_from_step) != len(resumed) or any(map(bits_differ, fresh_from_step, resumed))


def test_resume_refusals_name_the_field(fake, cache):
    """A state of another run or epoch, or not a LoaderState, is refused naming the field."""
    run = dict(seed=5, shuffle=True, last_batch="fill")
    saved = saved_state(48, 8, 2, 1, **run)
    loader, _ = resumed_pair(48, 3, 4, cache, **run)
    for call, fragments in (
            (lambda: loader.epoch(1, state=dataclasses.replace(saved, seed=6)),
             ("RocalLoader.epoch", "seed=6", "this run has seed=5")),
            (lambda: loader.epoch(2, state=saved), ("epoch=2", "state is of epoch 1")),
            (lambda: loader.epoch(1, state=saved.to_json()), ("must be a plan.LoaderState",)),
            (lambda: loader.real_samples(1, state=dataclasses.replace(saved, shuffle=False)),
             ("RocalLoader.real_samples", "shuffle"))):
        with pytest.raises(ValueError) as error:
            call()
        assert all(fragment in str(error.value) for fragment in fragments), (fragments, str(error.value))
    assert fake.pipelines == []


@pytest.mark.parametrize("last_batch", LAST_BATCH_POLICIES)
def test_vendor_order_resumes_only_on_the_saved_shards(fake, cache, last_batch):
    """order="vendor" continues rocAL's order only from a state of its own shards and batch (one
    segment), by reading again: the steps after it, the state after them, and real_samples
    counting them (drop + shuffle by reading). A fresh epoch's iterator gives its state too. A
    state of other shards, another batch, or an epoch resized on the way, is refused naming why."""
    run = dict(seed=5, shuffle=True, last_batch=last_batch)
    loader, _ = resumed_pair(50, 4, 4, cache, order="vendor", **run)  # shards of 12 and 13
    fresh = loader.epoch(1)
    whole = list(fresh)
    same = fresh.get_state().at_step(2)
    assert same == dataclasses.replace(saved_state(50, 4, 4, 2, **run), dataset=loader.dataset)
    it = loader.epoch(1, state=same)
    got = list(it)
    for step, (g, w) in enumerate(zip(got, whole[2:], strict=True), start=2):
        assert_same_arrays(g, w, f"vendor order, resumed on the saved shards, step {step}")
    assert it.get_state() == same.at_step(len(loader))
    assert loader.real_samples(1, state=same) == sum(int(np.asarray(b["mask"]).sum()) for b in got)
    # Another shard count; another batch; these shards and batch, after a resize in the epoch.
    for other in (saved_state(50, 8, 2, 1, **run), saved_state(50, 4, 2, 1, **run),
                  same.resized(3, 4).at_step(3).resized(4, 4)):
        for call in (lambda: loader.epoch(1, state=other), lambda: loader.real_samples(1, state=other)):
            with pytest.raises(ValueError) as error:
                call()
            for fragment in ("order='vendor' resumes only on the shards and batch", "rocAL has no checkpoint "
                             "and no seek", "order='plan'"):
                assert fragment in str(error.value), str(error.value)


@pytest.mark.rocal
def test_rocal_has_no_checkpoint_and_no_seek(real_rocal):
    """Why order="vendor" resumes only by reading again (rocAL 2.3.0: amd/rocal/pipeline.py's
    Pipeline and the rocal_pybind module): no call saves, restores, seeks or skips a reader's
    position; a reset moves it on (test_a_reused_pipeline_would_start_its_next_epoch_rotated,
    on the double as measured)."""
    from amd.rocal.pipeline import Pipeline
    import rocal_pybind

    words = ("checkpoint", "state", "seek", "skip", "restore", "resume", "position")
    names = [name for name in dir(Pipeline) + dir(rocal_pybind)
             if not name.startswith("__") and any(w in name.lower() for w in words)]
    assert not names, f"rocAL now has {names}: order='vendor' may resume through them"
    assert "rocal_reset_loaders" in dir(Pipeline) and "get_remaining_images" in dir(Pipeline)  # control


# --------------------------------------------------------------------------
# End to end, and across processes, on real rocAL (--run-slow)
# --------------------------------------------------------------------------

HERE = os.path.dirname(os.path.abspath(__file__))
ROCAL_CHATTER_SEEN = ("Pipeline has been created succesfully", "OK: loaded")


def refimpl_commands(data_dir: str, tmp_path, *options: str) -> list[list[str]]:
    """refimpl.py with the rocal and the reference backend, rocAL's arithmetic for both."""
    return [[sys.executable, os.path.join(HERE, "refimpl.py"), "--data-dir", data_dir, "--cache-dir",
             str(tmp_path / f"cache-{backend}"), "--backend", backend, "--normalize", "rocal", "--params-out",
             str(tmp_path / f"{backend}.npz"), *options] for backend in ("rocal", "reference")]


def assert_identical_final_params(results, tmp_path) -> str:
    for (code, out, err), backend in zip(results, ("rocal", "reference")):
        assert code == 0, f"--backend {backend} exited {code}:\n{out[-2000:]}\n{err[-3000:]}"
        assert not any(line in out + err for line in ROCAL_CHATTER_SEEN), "rocAL's console lines got through"
        assert "Traceback" not in err, err
    rocal_out = results[0][1]
    assert f"AMD rocAL {rocal_api.rocal_version()} (CPU backend)" in rocal_out and "order 'plan'" in rocal_out
    got, want = np.load(tmp_path / "rocal.npz"), np.load(tmp_path / "reference.npz")
    assert sorted(got.files) == sorted(want.files) and len(got.files) >= 12
    differ = {key: bits_differ(got[key], want[key]) for key in want.files if bits_differ(got[key], want[key])}
    assert not differ, f"final params differ between --backend rocal and reference: {differ}"
    assert [name for name in os.listdir(tmp_path / "cache-rocal") if name.startswith(".")] == []
    return rocal_out


@pytest.fixture(scope="module")
def tiny_cifar(tmp_path_factory):
    return synthetic_cifar10(tmp_path_factory.mktemp("rocal-tiny"), num_train=96, num_test=16, seed=3)


def rocal_resized(data_dir: str, tmp_path, common: list, stop: list, resume: list, *,
                  timeout: float = 240) -> dict:
    """conftest.refimpl_resized with --backend rocal and --backend reference (rocAL's arithmetic
    for both, a cache folder each), checking too that rocAL's console lines stay off the output
    and no file is left behind in rocAL's cache."""
    def quiet(out, err):
        assert not any(line in out + err for line in ROCAL_CHATTER_SEEN), "rocAL's console lines got through"
    outputs = refimpl_resized(tmp_path, ("rocal", "reference"), ["--data-dir", data_dir, "--normalize", "rocal",
                                                                  *common], stop, resume,
                              per_backend=lambda backend: ["--cache-dir", str(tmp_path / f"cache-{backend}")],
                              check=quiet, timeout=timeout)
    assert [name for name in os.listdir(tmp_path / "cache-rocal") if name.startswith(".")] == []
    return outputs


@pytest.mark.rocal
@pytest.mark.slow
def test_refimpl_rocal_backend_resizes_to_the_reference_params(rocal_mesh, tiny_cifar, tmp_path):
    """``refimpl.py --backend rocal`` end to end through a resize: 4 devices stop after 2 run
    steps, 3 resume; rocAL and the reference backend (rocAL's arithmetic, the same seed, shuffled,
    the pmap strategy) each report every sample of the interrupted epoch delivered exactly once
    across the change and end with the same trained params, bit for bit; rocAL's console lines
    are kept off the output."""
    # The notebook's MLP with narrow hidden layers (the same code, a fraction of the compute).
    common = ["--epochs", "1", "--batch-size", "4", "--eval-batch-size", "16", "--strategies", "pmap",
              "--hidden", "64,64"]
    outputs = rocal_resized(tiny_cifar, tmp_path, common, ["--devices", "4", "--stop-after-step", "2"],
                              ["--devices", "3"])
    rocal = outputs["rocal"]
    assert f"AMD rocAL {rocal_api.rocal_version()} (CPU backend)" in rocal and "order 'plan'" in rocal, rocal
    assert "segments [(0, 4, 4), (2, 3, 4)]" in rocal, rocal
    for backend, out in outputs.items():
        assert exactly_once(out) == ["pmap epoch 0, counted by sample index over the runs that delivered it: "
                                     "every one of the 96 samples delivered exactly once"], out
    assert_same_params(tmp_path, ("rocal", "reference"), 7)  # 6 params, 1 SGD state
    import model
    initial = np.asarray(jax.tree.leaves(model.init_model((3072, 64, 64, 10)))[0])
    assert bits_differ(np.load(tmp_path / "rocal.npz")["pmap/0"], initial), "the params did not train"


@pytest.fixture(scope="module")
def cifar_2048(tmp_path_factory):
    return synthetic_cifar10(tmp_path_factory.mktemp("cifar-2048"), num_train=2048, num_test=256, seed=0)


# conftest's two resizes (this file is also a worker program, run without conftest).
RESIZES_2048 = getattr(sys.modules.get("conftest"), "RESIZES_2048", [])


@pytest.mark.rocal
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name, stop, resume, before, after",
                         [pytest.param(*r, id=r[0].replace(" ", "")) for r in RESIZES_2048])
def test_refimpl_resizes_through_rocal(rocal_mesh, cifar_2048, tmp_path, name, stop, resume, before, after):
    """Two resizes with --backend rocal and --backend reference (rocAL's arithmetic,
    synthetic CIFAR-10 of 2048, batch 16, 2 epochs, the sharded strategy, hidden layers of 64:
    the loader's claim):
    2 processes of 4 devices stop at run step 7 and 1 process of 8 resumes; 8 devices stop at
    step 7 and 3 resume. Each reports exactly once across the change; the params are the
    reference's bit for bit."""
    common = ["--epochs", "2", "--strategies", "sharded", "--hidden", "64,64"]
    outputs = rocal_resized(cifar_2048, tmp_path, common, stop + ["--stop-after-step", "7"], resume,
                              timeout=600)
    for backend, out in outputs.items():
        assert f"(written on {before}" in out and f"this run: {after}" in out, out
        lines = exactly_once(out)
        assert lines == ["sharded epoch 0, counted by sample index over the runs that delivered it: every one "
                         "of the 2048 samples delivered exactly once"], out
    assert_same_params(tmp_path, ("rocal", "reference"), 7)  # 6 params, 1 SGD state


@pytest.mark.rocal
@pytest.mark.multiprocess
@pytest.mark.slow
def test_refimpl_rocal_backend_in_two_processes_trains_to_the_reference_params(rocal_mesh, tiny_cifar, tmp_path):
    """Two processes, two epochs: rocAL's params are the reference's, bit for bit."""
    from conftest import run_children
    results = run_children(refimpl_commands(tiny_cifar, tmp_path, "--epochs", "2", "--local-processes", "2",
                                            "--batch-size", "8"), timeout=300, cwd=HERE)
    out = assert_identical_final_params(results, tmp_path)
    assert "8 cpu device(s) in 2 processes" in out and "the plain reduction promises no bits across strategies" in out


def two_process_worker(folder: str, cache: str, coordinator: str, process_id: int) -> None:
    """One of two jax.distributed processes, 4 CPU devices each: order="plan" against the
    reference loader, shard by shard on this process's devices, bit for bit: epoch 1, and
    epoch 0 resumed from a state saved on 3 shards of 5."""
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=process_id,
                               initialization_timeout=60, heartbeat_timeout_seconds=30,
                               coordinator_bind_address=coordinator)
    devices = jax.devices()
    checked = 0
    for layout, shuffle, last_batch in (("sharded", True, "fill"), ("pmap", False, "drop"), ("sharded", True, "drop")):
        common = dict(layout=layout, shuffle=shuffle, seed=6, last_batch=last_batch)
        loader = rocal_loader.make_rocal_loader(folder, devices, B, cache_dir=cache, **common)
        reference = loaders.make_loader(folder, devices, B, prefetch=0, **common)
        saved = LoaderState.start(len(reference.labels), 3, 5, epoch=0, seed=6, shuffle=shuffle,
                                  last_batch=last_batch).at_step(2)
        for epoch, state in ((1, None), (0, saved)):
            pairs = zip(loader.epoch(epoch, state=state), reference.epoch(epoch, state=state), strict=True)
            for step, (got, want) in enumerate(pairs):
                for name in want:
                    assert got[name].sharding == want[name].sharding and got[name].shape == want[name].shape
                    for a, b in zip(got[name].addressable_shards, want[name].addressable_shards):
                        assert a.device == b.device and a.index == b.index, (name, a.device, b.device)
                        # Bit for bit, without conftest (this runs in a child process).
                        x, y = np.asarray(a.data), np.asarray(b.data)
                        assert x.dtype == y.dtype and x.shape == y.shape and \
                            np.array_equal(x.view(np.uint8), y.view(np.uint8)), \
                            f"{layout} epoch {epoch} step {step}: {name} on {a.device}"
                checked += 1
    print(f"process {process_id}: {checked} steps equal the reference on {len(jax.local_devices())} local shards")
    jax.distributed.shutdown()


@pytest.mark.rocal
@pytest.mark.multiprocess
@pytest.mark.slow
def test_rocal_plan_order_in_two_processes_equals_the_reference(rocal_mesh, encoded_dir, tmp_path):
    """Two jax.distributed processes (two_process_worker): each local shard is the reference's."""
    from conftest import run_children
    folder = encoded_for(encoded_dir, 8)
    import refimpl
    coordinator = f"127.0.0.1:{refimpl.loopback_port('coordinator')}"
    results = run_children([[sys.executable, os.path.abspath(__file__), folder, str(tmp_path / "cache"),
                             coordinator, str(i)] for i in range(2)], timeout=120, cwd=HERE, grace=10)
    report = "\n".join(f"process {i} exited {code} (None: still running at the deadline):\n"
                       f"stdout: {out[-2000:]}\nstderr: {err[-3000:]}" for i, (code, out, err) in enumerate(results))
    steps = 0  # the worker's: epoch 1 whole, epoch 0 resumed from its state
    for shuffle, last_batch in ((True, "fill"), (False, "drop"), (True, "drop")):
        resumed = LoaderState.start(dataset_size(8), 3, 5, shuffle=shuffle, last_batch=last_batch) \
            .at_step(2).resized(8, B)
        steps += num_steps(dataset_size(8), 8, B, last_batch) + resumed.num_steps - resumed.step
    for i, (code, out, err) in enumerate(results):  # every child's output, whichever failed
        assert code == 0, report
        assert f"process {i}: {steps} steps equal the reference on 4 local shards" in out, report
    assert os.listdir(tmp_path / "cache") == []


# --------------------------------------------------------------------------
# A state names its data; padding found by what rocAL delivers (the crop window)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("order", rocal_loader.ORDERS)
def test_a_state_of_other_data_is_refused_naming_dataset(small_dir, mesh4, fake, cache, order):
    """A state taken over other labels is refused before a pipeline is built; the loader's own
    state is the reference's over the same data (the same digest)."""
    loader = rocal_loader.make_rocal_loader(small_dir, mesh4, 4, shuffle=True, seed=5, cache_dir=cache, order=order)
    images, labels = read_cifar10(small_dir)
    foreign = state_at(loaders.make_loader((images, (labels + 1) % 10), mesh4, 4, shuffle=True, seed=5), 0, 1)
    for what, call in [("epoch", lambda: loader.epoch(0, state=foreign)),
                       ("real_samples", lambda: loader.real_samples(0, state=foreign))]:
        with pytest.raises(ValueError, match=rf"RocalLoader.{what}: the loader state was taken with "
                                             rf"dataset='{foreign.dataset}', this run has dataset='{loader.dataset}'"):
            call()
    assert fake.pipelines == [], "refused before any pipeline is built"
    assert state_at(loader, 0, 1) == state_at(loaders.make_loader(small_dir, mesh4, 4, shuffle=True, seed=5), 0, 1)


def twin_outside_the_window(norm: Normalize):
    """26 records, two shards of 13 (rocAL pads each to 16 with 3 copies of its last record,
    batch 4). In shard 1 ([13, 26), last record 25) record 15 is record 25 inside ``norm``'s
    crop window, label included, and differs outside it: rocAL delivers the two alike. Record
    18 is record 25 but for one pixel inside the window, record 20 but for its label: other
    samples."""
    rng = np.random.default_rng(30)
    images = rng.integers(0, 256, (26, 3, 32, 32)).astype(np.uint8)
    labels = rng.integers(0, 10, 26).astype(np.int32)
    y0, x0, ch, cw = norm.window((32, 32))
    images[15], labels[15] = images[25], labels[25]
    images[15, :, 0, 0] ^= 1  # outside the window (it starts at row y0 > 0)
    images[18], labels[18] = images[25], labels[25]
    images[18, 1, y0 + 3, x0 + 5] ^= 1  # inside it
    images[20], labels[20] = images[25], (labels[25] + 1) % 10
    return images, labels


def check_padding_found_by_content(mesh, cache: str) -> None:
    """The guarantee ShardInfo.copies serves: in rocAL's order, a slot is padding exactly
    when rocAL padded it, so every record has exactly one mask-True slot (fill) and each
    shard exactly rocAL's padding count masked, also where the crop window hides a
    difference the whole image shows (record 15, real once, not taken for a copy) and where
    it shows one (record 18, and record 20 by its label, never taken for the last record)."""
    norm = Normalize(crop=(16, 16), crop_pos=(0.5, 0.5))
    images, labels = twin_outside_the_window(norm)
    delivered = lambda i: (int(labels[i]), norm(images[i:i + 1]).tobytes())  # what rocAL gives for record i
    assert delivered(15) == delivered(25) and not np.array_equal(images[15], images[25]), \
        "the control: the whole images differ where the windows do not"
    assert delivered(18) != delivered(25) != delivered(20)
    loader = rocal_loader.make_rocal_loader((images, labels), mesh, 4, shuffle=True, normalize=norm,
                                            cache_dir=cache, order="vendor")
    blocks = [shard_blocks(b, 2) for b in loader.epoch(0)]  # rocAL's padding checked at the epoch's end
    for k in range(2):
        start, stop = shard_bounds(26, k, 2)
        images_k = np.concatenate([b["images"][k] for b in blocks])
        labels_k = np.concatenate([b["labels"][k] for b in blocks])
        mask_k = np.concatenate([b["mask"][k] for b in blocks])
        slot = lambda j: (int(labels_k[j]), images_k[j:j + 1].tobytes())
        real = sorted(slot(j) for j in np.flatnonzero(mask_k))
        assert real == sorted(delivered(i) for i in range(start, stop)), f"shard {k}: not every record once"
        padding = [slot(j) for j in np.flatnonzero(~mask_k)]
        assert len(padding) == len(mask_k) - (stop - start) == 3, f"shard {k}: {len(padding)} padding slots"
        assert all(p == delivered(stop - 1) for p in padding), f"shard {k}: padding is not its last record"


def test_padding_is_found_on_the_crop_window_on_the_double(fake, cache):
    """check_padding_found_by_content on the double."""
    check_padding_found_by_content(loaders.data_mesh(jax.devices("cpu")[:2]), cache)


@pytest.mark.rocal
def test_padding_is_found_on_the_crop_window_on_real_rocal(rocal_mesh, tmp_path):
    """check_padding_found_by_content on real rocAL."""
    check_padding_found_by_content(rocal_mesh, str(tmp_path / "cache"))


# --------------------------------------------------------------------------
# Logical shards on real rocAL: the reference's batches on any devices dividing L
# --------------------------------------------------------------------------


@pytest.mark.rocal
def test_logical_shards_read_by_rocal_are_the_references_on_2_3_and_4_devices(real_rocal, tmp_path):
    """make_rocal_loader(logical_shards=8): pipeline k reads its device's logical shards'
    blocks, ceil(8/n)*B records a step (a spare slot on 3 devices), bit for bit the reference
    loader's, fresh and resumed from a state of 8 logical shards on other devices (the same
    plan: no new segment)."""
    run = dict(seed=6, shuffle=True, last_batch="fill", logical_shards=8, layout="pmap")
    saved = LoaderState.start(48, 8, 2, epoch=1, seed=6, shuffle=True).at_step(2)
    for n in (2, 3, 4):
        loader, reference = resumed_pair(48, n, 2, str(tmp_path / f"cache{n}"), **run)
        assert loader.device_rows == -(-8 // n) * 2 and len(loader) == len(reference) == 3
        for step, (g, w) in enumerate(zip(loader.epoch(1), reference.epoch(1))):
            assert_same_arrays(g, w, f"{n} devices, step {step}")
        got = check_resumed(loader, reference, saved, f"{n} devices, resumed at step 2")
        assert len(got) == 1
    with pytest.raises(ValueError, match="logical_shards=8 with order='vendor'"):
        resumed_pair(48, 2, 2, str(tmp_path / "cache-vendor"), order="vendor", **run)


# --------------------------------------------------------------------------
# The pieces, alone: shard files, padding counts, outputs, options, releases, version
# --------------------------------------------------------------------------


def test_shard_folders_refuses_each_wrong_part_of_its_input_alone(cache):
    """shard_folders refuses images that are not uint8 (N, 3, 32, 32), a label count other than
    N, and labels outside the integers 0..9, each alone; 9 is taken. One shard and N shards
    are written, N + 1 refused (more shards than samples)."""
    images, labels = encoding.encoded_images(np.arange(6)), np.arange(6, dtype=np.int32)
    for wrong_images, wrong_labels in ((images.astype(np.int16), labels), (images[:, :, :, :31], labels),
                                       (images[:, :2], labels), (images, labels[:5])):
        with pytest.raises(ValueError, match="rocAL's cifar10 reader needs uint8 images"):
            rocal_loader.shard_folders(wrong_images, wrong_labels, 2, cache)
    for wrong in (np.where(labels == 5, 10, labels), labels - 1, labels + 0.0,
                  np.where(labels == 3, np.int64(2**32 + 1), labels)):  # 2**32 + 1 would hash as label 1
        with pytest.raises(ValueError, match="shard_folders: CIFAR-10 labels are integers 0..9"):
            rocal_loader.shard_folders(images, wrong, 2, cache)
    nines = np.full(6, 9, np.int32)
    [one] = rocal_loader.shard_folders(images, nines, 1, cache)
    np.testing.assert_array_equal(read_cifar10(one)[1], nines)
    assert len(rocal_loader.shard_folders(images, labels, 6, cache)) == 6
    with pytest.raises(ValueError):
        rocal_loader.shard_folders(images, labels, 7, cache)


def test_shard_info_counts_every_copy_of_the_last_record_in_every_block():
    """_shard_info over shard [start, stop) of 2,100 records (read in blocks of 1,024): its
    size, rocAL's padding (batches x B - size), the last record normalised and its label,
    and how many of the shard's records normalise to the last one with its label, copies
    at a block's first and last record and in each block counted once each; a copy with
    another label, or outside the shard, is not one."""
    start, stop, B, batches = 10, 2110, 32, 66
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (stop + 5, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, stop + 5).astype(np.int32)
    last = stop - 1
    labels[last] = 3
    for offset in (0, 1023, 1024, 2047, 2048):  # block starts and ends, relative to start
        images[start + offset], labels[start + offset] = images[last], 3
    images[start + 5], labels[start + 5] = images[last], 4  # another label
    images[start - 1], labels[start - 1] = images[last], 3  # before the shard
    images[stop], labels[stop] = images[last], 3  # after it
    info = rocal_loader._shard_info(images, labels, start, stop, B, batches, NORM)
    assert (info.size, info.batches, info.padded, info.last_label, info.copies) == (2100, 66, 66 * 32 - 2100, 3, 6)
    np.testing.assert_array_equal(info.last_image, NORM(images[last:last + 1])[0])


def test_dlpack_gets_the_devices_hardware_id_or_its_id():
    """The device id rocAL's DLPack calls are given: the device's local hardware id (its
    GPU on this host), or its id where JAX has none (CPU devices)."""
    assert rocal_api._hardware_id(pytypes.SimpleNamespace(local_hardware_id=3, id=11)) == 3
    assert rocal_api._hardware_id(pytypes.SimpleNamespace(local_hardware_id=0, id=11)) == 0
    assert rocal_api._hardware_id(pytypes.SimpleNamespace(local_hardware_id=None, id=11)) == 11


def slot_tensor(shape=(4, 3, 32, 32), dtype=np.float32, layout="NCHW", kind=None):
    """A FakeTensor (``kind``: FakeTensorWithDLPack by default) over one ring slot of 0.5s,
    outside any FakePipeline: device_images alone."""
    pipe = pytypes.SimpleNamespace(ring=[np.full(shape, 0.5, dtype)], current=0, cmn={"output_layout": layout})
    return (kind or FakeTensorWithDLPack)(pipe)


def test_device_images_checks_each_part_of_the_output_and_names_a_rocal_without_dlpack():
    """device_images refuses an output of another shape, dtype or layout, each alone,
    naming ``where``; rocAL's own "Dlpack not installed", and a tensor without
    dlpack_device, become DLPACK_MISSING, named too; any other error of the import passes
    through as it is; a good output is a copy on the device (FakeTensors over one slot)."""
    device = jax.devices("cpu")[2]
    for wrong in (dict(shape=(8, 3, 32, 32)), dict(shape=(4, 3, 32, 31)), dict(dtype=np.float16),
                  dict(layout="NHWC")):
        with pytest.raises(RuntimeError, match=r"^shard 2 there: rocAL's output is .* expected float32 "
                                               r"\(4, 3, 32, 32\) NCHW$"):
            rocal_api.device_images(slot_tensor(**wrong), device, (3, 32, 32), 4, "shard 2 there")
    class Raising(FakeTensorWithDLPack):  # dlpack_device there, __dlpack__ rocAL's without DLPack
        __dlpack__ = FakeTensorWithoutDLPack.__dlpack__
    with pytest.raises(RuntimeError) as error:
        rocal_api.device_images(slot_tensor(kind=Raising), device, (3, 32, 32), 4, "shard 2 there")
    assert str(error.value) == f"shard 2 there: {rocal_api.DLPACK_MISSING}"
    with pytest.raises(RuntimeError) as error:  # no dlpack_device at all
        rocal_api.device_images(slot_tensor(kind=FakeTensorWithoutDLPack), device, (3, 32, 32), 4, "shard 2 there")
    assert str(error.value).startswith(f"shard 2 there: {rocal_api.DLPACK_MISSING} ("), str(error.value)
    other = RuntimeError("something else")

    class OtherError(FakeTensorWithDLPack):
        def __dlpack__(self, device_id):
            raise other
    with pytest.raises(RuntimeError) as error:
        rocal_api.device_images(slot_tensor(kind=OtherError), device, (3, 32, 32), 4)
    assert error.value is other
    tensor = slot_tensor()
    images = rocal_api.device_images(tensor, device, (3, 32, 32), 4)
    assert images.devices() == {device} and images.dtype == np.float32
    tensor.slot[:] = 9.0  # rocAL writes its buffer again: the copy keeps what it was
    np.testing.assert_array_equal(np.asarray(images), np.full((4, 3, 32, 32), 0.5, np.float32))


def test_describe_names_the_order_the_sharding_and_the_version(monkeypatch):
    """RocalLoader.describe names the order ('plan': the planned samples in plan order; 'vendor'
    over one file per shard, or with rocAL's own sharding), the backend, a pipeline per local
    device, and rocAL's version: "not installed" where rocal_pybind does not import."""
    mesh = loaders.data_mesh(jax.devices("cpu")[:3])
    said = {}
    for order, sharding in (("plan", "files"), ("vendor", "files"), ("vendor", "rocal")):
        stand_in = pytypes.SimpleNamespace(order=order, sharding=sharding, on_gpu=False, mesh=mesh)
        said[order, sharding] = rocal_loader.RocalLoader.describe(stand_in)
        assert "(CPU backend): 3 pipeline(s) per epoch" in said[order, sharding], said
    assert "order 'plan'" in said["plan", "files"] and "in plan order" in said["plan", "files"], said
    assert "order 'vendor'" in said["vendor", "files"] and "one file per shard" in said["vendor", "files"], said
    assert said["vendor", "rocal"].endswith("order 'vendor': rocAL's own sharding and order"), said
    monkeypatch.setitem(sys.modules, "rocal_pybind", None)  # import raises ImportError
    assert rocal_loader.RocalLoader.describe(stand_in).startswith("AMD rocAL not installed (CPU backend)")


def test_make_rocal_loader_hands_its_options_on_and_refuses_what_the_reference_refuses(monkeypatch, tmp_path,
                                                                                         mesh4):
    """make_rocal_loader (FakeRocal): every pipeline gets num_threads and the loader's seed
    (0 unless given); order='vendor' over rocAL's own sharding reads the data folder with
    filename_prefix, order='plan' the epoch files it writes (data_batch_) under cache_dir,
    by default DEFAULT_CACHE; a layout, last_batch, seed or shuffle the reference loader
    refuses is refused here too, each alone, with the reference loader's error."""
    fixed = FakeRocal(sharding_bug=False).install(monkeypatch)
    folder = tmp_path / "data"
    folder.mkdir()
    index = np.arange(20)
    write_cifar10(str(folder / "train_part1.bin"), encoding.encoded_images(index), index % 10)
    loader = rocal_loader.make_rocal_loader(str(folder), mesh4, 4, order="vendor", sharding="rocal",
                                            filename_prefix="train_", num_threads=3, cache_dir=str(tmp_path / "c"))
    list(loader.epoch(0))
    assert fixed.pipelines and {(p.reader["filename_prefix"], p.reader["file_root"], p.kwargs["num_threads"],
                                 p.kwargs["seed"]) for p in fixed.pipelines} == {("train_", str(folder), 3, 0)}
    monkeypatch.setattr(rocal_loader, "DEFAULT_CACHE", str(tmp_path / "home-cache"))
    fixed.pipelines.clear()
    loader = rocal_loader.make_rocal_loader(str(folder), mesh4, 4, filename_prefix="train_", num_threads=2,
                                            seed=7, shuffle=True)
    list(loader.epoch(0))
    assert fixed.pipelines and all(p.reader["filename_prefix"] == "data_batch_" and p.kwargs["num_threads"] == 2
                                   and p.kwargs["seed"] == 7 for p in fixed.pipelines), fixed.pipelines
    assert all(p.reader["file_root"].startswith(str(tmp_path / "home-cache")) for p in fixed.pipelines)
    for bad in (dict(layout="rows"), dict(last_batch="pad"), dict(seed=-1), dict(seed=2.5), dict(shuffle="yes")):
        with pytest.raises((ValueError, TypeError)) as want:
            loaders.make_loader(str(folder), mesh4, 4, filename_prefix="train_", **bad)
        with pytest.raises(type(want.value)) as got:
            rocal_loader.make_rocal_loader(str(folder), mesh4, 4, filename_prefix="train_",
                                           cache_dir=str(tmp_path / "c"), **bad)
        assert str(got.value) == str(want.value), bad


def test_shard_folders_writes_in_the_cache_and_leaves_no_scratch_behind(cache, monkeypatch, tmp_path):
    """shard_folders writes its set in a scratch folder inside cache_dir (renamed in place:
    tempfile's default folder is never used, so a missing one does not matter); a write
    that fails, or is interrupted, leaves no scratch folder and raises; where another
    process renamed its identical set first, that set is used and no scratch is left;
    a cached shard file or folder that is missing is named as damaged (ValueError)."""
    images, labels = encoding.encoded_images(np.arange(8)), np.arange(8, dtype=np.int32)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-folder"))
    folders = rocal_loader.shard_folders(images, labels, 2, cache)
    assert os.listdir(cache) == [os.path.basename(os.path.dirname(folders[0]))]
    real_write, real_rename = rocal_loader.write_cifar10, os.rename
    for error in (OSError("disk full"), KeyboardInterrupt()):
        def failing(path, *a):
            real_write(path, *a)
            raise error
        monkeypatch.setattr(rocal_loader, "write_cifar10", failing)
        with pytest.raises(type(error)):
            rocal_loader.shard_folders(images, labels, 3, cache)
        assert sorted(os.listdir(cache)) == [os.path.basename(os.path.dirname(folders[0]))], os.listdir(cache)
    monkeypatch.setattr(rocal_loader, "write_cifar10", real_write)

    def raced(scratch, top):  # another process renamed its identical set into place first
        shutil.copytree(scratch, top)
        raise OSError(39, "Directory not empty")
    monkeypatch.setattr(os, "rename", raced)
    three = rocal_loader.shard_folders(images, labels, 3, cache)
    monkeypatch.setattr(os, "rename", real_rename)
    assert len(os.listdir(cache)) == 2 and all(os.path.dirname(f) in map(lambda n: os.path.join(cache, n),
                                                                          os.listdir(cache)) for f in three)
    os.remove(os.path.join(three[1], "data_batch_1.bin"))
    with pytest.raises(ValueError, match="shard-00001/data_batch_1.bin: the cached shard should hold"):
        rocal_loader.shard_folders(images, labels, 3, cache)
    shutil.rmtree(three[0])  # a whole shard folder missing
    with pytest.raises(ValueError, match="shard-00000/data_batch_1.bin: the cached shard should hold 2 records, "
                                         "alone in its folder \\(size None, folder holds None\\)"):
        rocal_loader.shard_folders(images, labels, 3, cache)


def test_release_errors_are_raised_together_once_every_pipeline_is_released():
    """release_pipelines releases every pipeline even when some releases raise, then raises
    one RuntimeError naming each that raised ("<where>, shard k: rocal_release() raised
    <type>: <words>", in order, "; " between), where defaults to "rocAL"; none raised:
    nothing (doubles with rocal_release)."""
    done = []

    def double(k, error=None):
        def release():
            done.append(k)
            if error:
                raise error
        return pytypes.SimpleNamespace(rocal_release=release)
    with pytest.raises(RuntimeError) as raised:
        rocal_api.release_pipelines({0: double(0, ValueError("a")), 1: double(1), 2: double(2, OSError("b"))},
                                    "rocAL, epoch 3")
    assert done == [0, 1, 2]
    assert str(raised.value) == ("rocAL, epoch 3, shard 0: rocal_release() raised ValueError: a; "
                                 "rocAL, epoch 3, shard 2: rocal_release() raised OSError: b"), str(raised.value)
    with pytest.raises(RuntimeError, match=r"^rocAL, shard 1: rocal_release\(\) raised KeyError: 'k'$"):
        rocal_api.release_pipelines([double(0), double(1, KeyError("k"))])
    done.clear()
    assert rocal_api.release_pipelines([double(0), double(1)]) is None and done == [0, 1]


def test_rocal_version_is_read_from_its_librarys_file_name(monkeypatch, tmp_path):
    """rocal_version: the X.Y.Z of librocal.so.X.Y.Z beside rocal_pybind (in a folder whose own
    name holds ".so." too), "?" where there is none, "not installed" where it does not import."""
    folder = tmp_path / "rocal.so.d" / "lib"
    folder.mkdir(parents=True)
    stand_in = pytypes.ModuleType("rocal_pybind")
    stand_in.__file__ = str(folder / "rocal_pybind.cpython-311-x86_64-linux-gnu.so")
    monkeypatch.setitem(sys.modules, "rocal_pybind", stand_in)
    assert rocal_api.rocal_version() == "?"
    (folder / "librocal.so.9.8.7").write_bytes(b"")
    (folder / "librocal.so").write_bytes(b"")
    assert rocal_api.rocal_version() == "9.8.7"
    monkeypatch.setitem(sys.modules, "rocal_pybind", None)
    assert rocal_api.rocal_version() == "not installed"


if __name__ == "__main__":
    two_process_worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
