"""NVIDIA DALI backend: the reference loader's epochs (loaders.py), read and normalised by DALI.

``make_dali_loader(data, devices, batch_size, ...)`` builds a ``DaliLoader``. Its ``epoch(e, *, state=None)`` is a
``loaders.EpochIterator`` of global batches {"images" float32, "labels" int32, "mask", "index", "logical_shards"}. Row
block k comes from pipeline k (mesh position k, never ``device.id``), built at the first step and dropped with the
iterator. DALI reads one raw file per sample (``sample_files``, under ``cache_dir``).

order="plan" (the default): reader k gets the files of its plan slots (padding included) in plan order, as one shard,
DALI's shuffle off. The batches are bit for bit those of ``loaders.make_loader`` with the Normalize of
``arithmetic_for(devices)``, fresh or resumed from any state of the run (any shards, batch size, processes).

order="vendor": DALI's own order, no "index": DALI's sharding of one list (the plan's order) or, shuffled, shard k's
own list of [N*k//n, N*(k+1)//n), shuffled by DALI with pipeline seed ``SeedSequence([seed, epoch, k])``; the mask is
the plan's (docs/vendors.md says what is exact). A state resumes only on the loader's own plan (one segment (0, n, B)):
earlier steps are read and dropped.

DALI 2.4's behaviour relied on is in docs/vendors.md, pinned in test_dali.py. nvidia.dali is imported lazily.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
import os
import shutil
import tempfile
from typing import Sequence

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import loaders
from arithmetic import Normalize
from cifar_mnist import TRAIN_PREFIX, _write_atomically, read_cifar10
from plan import LoaderState, Plan, check_seed, on_devices, shard_bounds

INSTALL_HINT = ("the DALI backend needs NVIDIA DALI: pip install -r requirements-dali.txt "
                "(it installs nvidia-dali-cuda130; on CUDA 12 hosts install nvidia-dali-cuda120)")
ORDERS = ("plan", "vendor")
DEFAULT_CACHE = os.path.join("~", ".cache", "refimpl")
LIST_NAME = "list.txt"
READER = "Reader"


def import_dali():
    """``(Pipeline, fn, types)`` from nvidia.dali; ImportError saying how to install it."""
    try:
        from nvidia.dali.pipeline import Pipeline
        from nvidia.dali import fn, types
    except ImportError as error:
        raise ImportError(f"{INSTALL_HINT} (import failed: {error})") from error
    return Pipeline, fn, types


def dali_version() -> str:
    """nvidia.dali's version, or "not installed" when it does not import."""
    try:
        import nvidia.dali
    except ImportError:
        return "not installed"
    return nvidia.dali.__version__


def is_nvidia_gpu(device) -> bool:
    """Platform "cuda", or "gpu" whose client's ``platform_version`` names CUDA (ROCm's is "gpu" too)."""
    if device.platform == "cuda":
        return True
    version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    return device.platform == "gpu" and "cuda" in version


def _device_list(devices) -> list:
    return list(devices.devices.flat) if isinstance(devices, Mesh) else list(devices)


def arithmetic_for(devices: Sequence[jax.Device] | Mesh) -> str:
    """The Normalize arithmetic DALI computes on ``devices``: "dali_cpu" on CPU devices, "dali_gpu" on NVIDIA GPUs.
    ValueError for anything else or a mix, naming the platforms."""
    devices = _device_list(devices)
    if devices and all(d.platform == "cpu" for d in devices):
        return "dali_cpu"
    if devices and all(is_nvidia_gpu(d) for d in devices):
        return "dali_gpu"
    kinds = sorted({f"{d.platform} ({getattr(getattr(d, 'client', None), 'platform_version', '?')})" for d in devices})
    raise ValueError(f"DALI runs on CPU devices or NVIDIA GPUs, all of one kind; got {kinds or 'none'}")


def usable(devices: Sequence[jax.Device] | Mesh) -> bool:
    """``--backend auto``'s question: is every device an NVIDIA GPU, and does nvidia.dali import?"""
    devices = _device_list(devices)
    if not devices or not all(is_nvidia_gpu(d) for d in devices):
        return False
    try:
        import_dali()
    except ImportError:
        return False
    return True


def to_jax(tensor_list, device: jax.Device, *, buffers_reused: bool) -> jax.Array:
    """One DALI output (equal-shape samples) as a jax.Array on ``device``, through DLPack: DALI's buffer wrapped, or,
    ``buffers_reused`` (``not pipeline.exec_dynamic``), copied and finished."""
    array = jax.dlpack.from_dlpack(tensor_list.as_tensor(), device=device, copy=None)
    if buffers_reused:
        # Not from_dlpack(copy=True): JAX 0.10.2 wraps a CPU buffer even then (test_dali.py).
        array = jnp.array(array, copy=True).block_until_ready()
    return array


def sample_files(images_NCHW: np.ndarray, labels_N: np.ndarray, cache_dir: str | os.PathLike) -> str:
    """One raw file per sample (C*H*W bytes) and ``list.txt`` ("<name> <label>" lines) in the returned folder,
    ``cache_dir/dali-samples-<N>x<C>x<H>x<W>-<content hash>``. It is written under another name and renamed: a reader
    never sees half of it; of two writers the first wins. Raises ValueError for images not uint8 (N, C, H, W), or
    labels not N integers within int32."""
    images_NCHW, labels_N = np.ascontiguousarray(images_NCHW), np.asarray(labels_N)
    if images_NCHW.dtype != np.uint8 or images_NCHW.ndim != 4 or labels_N.shape != images_NCHW.shape[:1] \
            or not np.issubdtype(labels_N.dtype, np.integer):
        raise ValueError("sample_files: need uint8 images (N, C, H, W) and N integer labels, got images "
                         f"{images_NCHW.dtype} {images_NCHW.shape}, labels {labels_N.dtype} {labels_N.shape}")
    bounds = np.iinfo(np.int32)
    outside = labels_N[(labels_N < bounds.min) | (labels_N > bounds.max)]
    if outside.size:
        raise ValueError(f"sample_files: labels outside int32, e.g. {outside[:3].tolist()}; they are stored "
                         f"as int32, which would change them")
    labels_N = labels_N.astype(np.int32)
    digest = hashlib.blake2b(repr(images_NCHW.shape).encode(), digest_size=16)
    digest.update(memoryview(images_NCHW).cast("B"))
    digest.update(labels_N.tobytes())
    cache_dir = os.path.expanduser(os.fspath(cache_dir))
    shape = "x".join(map(str, images_NCHW.shape))
    folder = os.path.join(cache_dir, f"dali-samples-{shape}-{digest.hexdigest()}")
    if os.path.isfile(os.path.join(folder, LIST_NAME)):
        return folder
    os.makedirs(cache_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=cache_dir, prefix=".dali-samples-writing-")
    try:
        lines = []
        for i, label in enumerate(labels_N.tolist()):
            name = sample_name(i, len(labels_N))
            with open(os.path.join(scratch, name), "wb") as f:
                f.write(images_NCHW[i].tobytes())
            lines.append(f"{name} {label}\n")
        with open(os.path.join(scratch, LIST_NAME), "w") as f:
            f.write("".join(lines))
        os.rename(scratch, folder)
    except BaseException as error:
        shutil.rmtree(scratch, ignore_errors=True)
        if not (isinstance(error, OSError) and os.path.isfile(os.path.join(folder, LIST_NAME))):
            raise  # else another process renamed its copy first
    return folder


def sample_name(index: int, num_samples: int) -> str:
    """Sample ``index``'s file name in a ``sample_files`` folder: sorted as the indices are."""
    return f"{index:0{max(6, len(str(num_samples - 1)))}d}.bin"


def shard_list(folder: str, shard_id: int, num_shards: int) -> str:
    """``folder/list-<k>-of-<n>.txt``: shard k of n's lines of ``list.txt``, written once, atomically."""
    path = os.path.join(folder, f"list-{shard_id}-of-{num_shards}.txt")
    if os.path.isfile(path):
        return path
    with open(os.path.join(folder, LIST_NAME)) as f:
        lines = f.readlines()
    start, stop = shard_bounds(len(lines), shard_id, num_shards)
    _write_atomically(path, "".join(lines[start:stop]).encode())
    return path


@dataclasses.dataclass(eq=False)
class DaliLoader:
    """Epochs read by DALI (the module docstring); ``len()``, ``plan``, ``real_samples``, ``dataset``: ``spec``'s."""
    spec: loaders.Loader  # the reference loader built alike: the plan, the mesh, the checks
    order: str
    folder: str  # the sample_files folder
    num_threads: int = 1
    closed: bool = False

    @property
    def mesh(self) -> Mesh:
        return self.spec.mesh

    @property
    def num_shards(self) -> int:
        return self.spec.num_shards

    @property
    def on_gpu(self) -> bool:
        return is_nvidia_gpu(self.mesh.devices.flat[0])

    @property
    def dataset(self) -> str:
        return self.spec.dataset

    @property
    def num_steps(self) -> int:
        return self.spec.num_steps

    def __len__(self) -> int:
        return self.num_steps

    def plan(self, epoch: int) -> Plan:
        return self.spec.plan(epoch)

    def real_samples(self, epoch: int, *, state: LoaderState | None = None) -> int:
        resumed = None if state is None else self._resumed("DaliLoader.real_samples", epoch, state)
        return self.spec.schedule.real_samples(epoch, resumed)

    def describe(self) -> str:
        if self.order == "plan":
            how = "each reader fed its shard's files in the plan's order"
        elif self.spec.shuffle:
            how = "DALI's order: one file list per shard, shuffled by DALI within the shard"
        else:
            how = "DALI's order: DALI's sharding of one file list"
        return (f"NVIDIA DALI {dali_version()}: {len(loaders.local_positions(self.mesh))} "
                f"{'GPU' if self.on_gpu else 'CPU'} pipeline(s) an epoch, one per local device, shard = "
                f"mesh position; {how}; files in {self.folder}")

    def epoch(self, epoch: int, *, state: LoaderState | None = None) -> loaders.EpochIterator:
        """The batches of ``epoch``, or its rest from ``state``, as ``loaders.Loader.epoch``'s. ValueError as there, and
        with order="vendor" for a state whose plan is not this loader's; RuntimeError once closed."""
        where = "DaliLoader.epoch"
        if self.closed:
            raise RuntimeError(f"{where}: the loader is closed")
        check_seed("epoch", epoch, where)
        if state is None:
            return loaders.EpochIterator(_batches(self, epoch, self.plan(epoch), 0),
                                         lambda: self.spec.schedule.start(epoch))
        resumed = self._resumed(where, epoch, state)
        plan, row = resumed.plan()
        return loaders.EpochIterator(_batches(self, epoch, plan, row), resumed)

    def close(self) -> None:
        """No further epochs (pipelines live only while an epoch's iterator does)."""
        self.closed = True

    def _resumed(self, where: str, epoch: int, state) -> LoaderState:
        """``state`` checked and resized to this loader's shards; order="vendor" refuses a resize."""
        resumed = self.spec.schedule.resume(where, epoch, state)
        if self.order == "vendor" and len(resumed.segments) > 1:
            raise ValueError(f"{where}: order='vendor' resumes only on the shards and batch that wrote the state "
                             f"(segments {[tuple(x) for x in state.segments]}; this loader: {self.num_shards} shards x "
                             f"{self.spec.batch_size}): DALI's shuffle inside its readers decided which samples the "
                             f"old shards delivered, and DALI's checkpoints restore one reader state per pipeline onto "
                             f"as many pipelines. Use order='plan' (plan.elastic_plan's order, on any shard count)")
        return resumed


def _batches(loader: DaliLoader, epoch: int, plan: Plan, row: int):
    """The global batches of rows ``row ..`` of ``plan`` (a fresh epoch's or a resumed segment's)."""
    devices, n = list(loader.mesh.devices.flat), loader.mesh.devices.size
    plan = on_devices(plan, n)  # device k's logical shards, one block
    make = _plan_blocks if loader.order == "plan" else _vendor_blocks
    shards = {k: make(loader, epoch, plan, k, devices[k], row) for k in loaders.local_positions(loader.mesh)}
    try:
        for r in range(row, len(plan.indices)):
            blocks = {}
            for k, blocks_k in shards.items():
                images, labels = next(blocks_k)
                added = loaders.added_fields(plan.mask[r, k], plan.indices[r, k], k, loader.num_shards, n)
                if loader.order == "vendor":  # DALI decides which sample a row holds
                    del added[loaders.INDEX]
                blocks[k] = {"images": images, "labels": labels, **added}
            yield loaders.global_batch(blocks, loader.mesh, loader.spec.layout)
    finally:
        for blocks_k in shards.values():
            blocks_k.close()  # drops the pipeline now, not at garbage collection


def _plan_blocks(loader: DaliLoader, epoch: int, plan: Plan, k: int, device, row: int):
    """Shard k's (images, labels) for rows ``row ..`` of ``plan``, read by DALI in that order."""
    steps = len(plan.indices) - row
    if not steps:
        return
    indices = plan.indices[row:, k].reshape(-1)
    N = len(loader.spec.labels)
    reader = dict(files=[sample_name(i, N) for i in indices.tolist()], labels=loader.spec.labels[indices].tolist(),
                  shard_id=0, num_shards=1, random_shuffle=False)
    pipe = _pipeline(loader, reader, device, k, (len(indices), len(indices)), "the plan's files", seed=0)
    for _ in range(steps):
        yield _run(pipe, device)


def _vendor_blocks(loader: DaliLoader, epoch: int, plan: Plan, k: int, device, first: int):
    """Shard k's (images, labels) per step in DALI's order, from step 0 of a fresh pipeline; the steps before
    ``first`` are read and dropped."""
    n, N, B = loader.num_shards, len(loader.spec.labels), loader.spec.batch_size
    if loader.spec.shuffle:  # one list per shard: DALI's sharding would cut a pre-permuted list
        start, stop = shard_bounds(N, k, n)
        reader = dict(file_list=shard_list(loader.folder, k, n), shard_id=0, num_shards=1,
                      random_shuffle=True, initial_fill=stop - start)
        expect = (stop - start, stop - start)
    else:
        reader = dict(file_list=os.path.join(loader.folder, LIST_NAME), shard_id=k, num_shards=n, random_shuffle=False)
        expect = (N, -(-N // n))
    seed = int(np.random.SeedSequence([loader.spec.seed, epoch, k]).generate_state(1)[0])
    pipe = _pipeline(loader, reader, device, k, expect, reader["file_list"], seed=seed)
    batches = -(-expect[1] // B)  # DALI's epoch over the shard
    for step in range(len(loader)):
        if step < batches:
            images, labels = _run(pipe, device)
            last = images[-1:], labels[-1:]
        else:  # the shard's list is a batch short of the plan
            images, labels = jnp.repeat(last[0], B, axis=0), np.repeat(last[1], B, axis=0)
        if step >= first:
            yield images, labels


def _pipeline(loader: DaliLoader, reader: dict, device, k: int, expect: tuple[int, int], source: str, *, seed: int):
    """Pipeline k, built; RuntimeError unless its reader sees (samples, padded samples per shard) = ``expect``."""
    pipe = dali_pipeline(loader.folder, reader, device, loader.spec.images.shape[1:], loader.spec.normalize,
                         loader.spec.device_rows, seed=seed, num_threads=loader.num_threads)
    meta = pipe.reader_meta(READER)
    got = (meta["epoch_size"], meta["epoch_size_padded"] // meta["number_of_shards"])
    if got != expect:
        raise RuntimeError(f"DALI's reader of shard {k} sees {got[0]} samples, {got[1]} per shard "
                           f"(reader_meta {meta}); expected {expect} from {source}")
    return pipe


def _run(pipe, device):
    images, labels = pipe.run()
    labels = labels.as_array().reshape(-1).astype(np.int32, copy=False)
    return to_jax(images, device, buffers_reused=not pipe.exec_dynamic), labels


def make_dali_loader(data, devices: Sequence[jax.Device] | Mesh, batch_size: int, *, layout: str = "sharded",
                     filename_prefix: str = TRAIN_PREFIX, shuffle: bool = False, seed: int = 0,
                     last_batch: str = "fill", normalize: Normalize | None = None, order: str = "plan",
                     cache_dir: str | os.PathLike | None = None, num_threads: int = 1,
                     logical_shards: int | None = None) -> DaliLoader:
    """A ``DaliLoader`` over ``data``, shard k on ``devices[k]`` (or mesh position k).

    Args:
      data: a CIFAR-10 folder (read with ``filename_prefix``) or ``(images uint8 (N, C, H, W), labels_N)``.
      batch_size, layout, shuffle, seed, last_batch, logical_shards (order="plan" only): ``loaders.make_loader``'s.
      normalize: a Normalize with the devices' arithmetic (``arithmetic_for``); None: the default one.
      order: "plan" or "vendor" (the module docstring).
      cache_dir: where ``sample_files`` writes (None: DEFAULT_CACHE, ~/.cache/refimpl).
      num_threads: DALI's threads per pipeline, an int >= 1.

    Raises:
      ImportError: nvidia.dali does not import (the message says how to install it).
      ValueError: what ``make_loader`` refuses; an argument outside its line; devices not all CPU or all NVIDIA GPUs."""
    arithmetic = arithmetic_for(devices)  # first: a ROCm GPU is refused by name
    mesh = loaders.data_mesh(devices)
    if normalize is None:
        normalize = Normalize(arithmetic=arithmetic)
    if not isinstance(normalize, Normalize) or normalize.arithmetic != arithmetic:
        got = getattr(normalize, "arithmetic", type(normalize).__name__)
        raise ValueError(f"make_dali_loader: normalize={normalize!r} (arithmetic={got!r}): DALI's pipelines on "
                         f"{mesh.devices.flat[0].platform} devices compute arithmetic={arithmetic!r}; pass "
                         f"arithmetic.Normalize(..., arithmetic={arithmetic!r}), the spec of their bits")
    if order not in ORDERS:
        raise ValueError(f"make_dali_loader: order must be one of {ORDERS}, got {order!r}")
    if not isinstance(num_threads, numbers.Integral) or isinstance(num_threads, bool) or num_threads < 1:
        raise ValueError(f"make_dali_loader: num_threads must be an int >= 1, got {num_threads!r}")
    if order == "vendor" and logical_shards not in (None, mesh.devices.size):
        raise ValueError(f"make_dali_loader: logical_shards={logical_shards!r} with order='vendor': "
                         f"DALI's own sharding is one shard a device; use order='plan'")
    import_dali()  # how to install it, before any data is read
    if isinstance(data, (str, os.PathLike)):
        data = read_cifar10(data, filename_prefix)
    # The reference loader built alike checks every other argument and holds the plan.
    spec = loaders.make_loader(data, mesh, batch_size, layout=layout, shuffle=shuffle, seed=seed, last_batch=last_batch,
                               normalize=normalize, prefetch=0, logical_shards=logical_shards)
    folder = sample_files(spec.images, spec.labels, DEFAULT_CACHE if cache_dir is None else cache_dir)
    return DaliLoader(spec, order, folder, int(num_threads))


def dali_pipeline(folder: str, reader: dict, device: jax.Device, image_shape: tuple[int, int, int],
                  normalize: Normalize, batch_size: int, *, seed: int, num_threads: int = 1):
    """A built Pipeline with outputs (images float32 CHW, labels): ``fn.readers.file(file_root=folder, **reader)`` with
    stick_to_shard and pad_last_batch, reshaped to ``image_shape``, then crop_mirror_normalize, on the GPU of a GPU
    ``device``. DALI's default executor."""
    Pipeline, fn, types = import_dali()
    on_gpu = device.platform != "cpu"
    pipe = Pipeline(batch_size=batch_size, num_threads=num_threads, seed=seed,
                    device_id=device.local_hardware_id if on_gpu else None)
    with pipe:
        raw, labels = fn.readers.file(file_root=folder, stick_to_shard=True, pad_last_batch=True, name=READER, **reader)
        chw = fn.reshape(raw, shape=list(image_shape), layout="CHW")
        if on_gpu:
            chw = chw.gpu()
        out = fn.crop_mirror_normalize(chw, dtype=types.FLOAT, output_layout="CHW", mirror=int(normalize.mirror),
                                       crop=list(normalize.crop or image_shape[1:]),  # (height, width)
                                       crop_pos_x=normalize.crop_pos[1], crop_pos_y=normalize.crop_pos[0],
                                       mean=list(normalize.mean), std=list(normalize.std))
        pipe.set_outputs(out, labels)
    pipe.build()
    return pipe
