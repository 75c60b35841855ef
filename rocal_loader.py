"""AMD rocAL backend: the reference loader's epochs (loaders.py), read and normalised by rocAL.

``make_rocal_loader(data, devices, batch_size, ...)`` builds a ``RocalLoader``. Its ``epoch(e, *, state=None)`` is a
``loaders.EpochIterator`` of global batches {"images" float32, "labels" int32, "mask", "index", "logical_shards"}. Row
block k comes from pipeline k (mesh position k, never ``device.id``), alive from the epoch's first step until its
iterator ends. rocAL's calls are rocal_api.py's. CIFAR-10 only.

order="plan" (the default): pipeline k reads one file of its plan slots (padding included) in plan order, then
TAIL_BATCHES batches never run; shuffle off, one shard, FILL + pad_last_batch, so rocAL pads nothing. The file lives in
``cache_dir/.rocal-epoch-<e>-*`` until the epoch ends. Each run's labels are checked against the plan. The batches are
``loaders.make_loader(..., normalize=Normalize(arithmetic="rocal"))``'s bit for bit, fresh or resumed from any state.

order="vendor": rocAL's own order (docs/vendors.md) over shard k's records [N*k//n, N*(k+1)//n), no "index". sharding
"files" gives pipeline k one file of its shard (``shard_folders``); "rocal" uses rocAL's shard_id, refused at build
while rocAL ignores it. The mask is found by content (copies of the shard's last record beyond its own are padding, even
where a shuffle moved them into the steps drop keeps), checked against rocAL's count at the epoch's end. A state resumes
only on the loader's own plan (one segment (0, n, B)): rocAL cannot seek, so earlier steps are read and dropped.

rocAL 2.3.0's departures relied on are in docs/vendors.md; test_rocal.py fails when one changes.
"""

from __future__ import annotations

import collections
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
from arithmetic import Normalize, aligned_empty
from cifar_mnist import IMAGE_SHAPE, RECORD_BYTES, TRAIN_PREFIX, write_cifar10
from plan import LoaderState, Plan, check_seed, on_devices, shard_bounds
from rocal_api import (_call, _check_remaining, _hardware_id, check_dlpack, copy_output, device_images, import_rocal,
                       release_pipelines, rocal_pipeline, rocal_version)

ORDERS = ("plan", "vendor")
SHARDINGS = ("files", "rocal")
DEFAULT_CACHE = os.path.join("~", ".cache", "refimpl")
SHARD_FILE = "data_batch_1.bin"  # the only file in a shard's folder
# order="plan" writes this many batches more at each file's end and never runs them: with nothing left,
# rocAL's output thread sleeps in steps the release waits out. More than rocAL loads ahead (2 + 1 running).
TAIL_BATCHES = 4
RING_SLOTS = 2  # a rocAL output is a ring-buffer slot that the second next run writes again


def is_amd_gpu(device: jax.Device) -> bool:
    """Platform "rocm", or "gpu" on a JAX built for ROCm (its client names ROCm or HIP)."""
    if device.platform == "rocm":
        return True
    version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    return device.platform == "gpu" and ("rocm" in version or "hip" in version)


def usable(devices: Sequence[jax.Device] | Mesh) -> bool:
    """``--backend auto``'s question: is every device an AMD GPU, and does amd.rocal import?"""
    devices = list(devices.devices.flat) if isinstance(devices, Mesh) else list(devices)
    if not devices or not all(is_amd_gpu(d) for d in devices):
        return False
    try:
        import_rocal()
    except ImportError:
        return False
    return True


def uses_gpu(devices: Sequence[jax.Device]) -> bool:
    """False for CPU devices (rocAL's CPU backend), True for AMD GPUs; ValueError otherwise."""
    if all(d.platform == "cpu" for d in devices):
        return False
    if all(is_amd_gpu(d) for d in devices):
        return True
    raise ValueError(f"make_rocal_loader: rocAL runs on CPU devices or AMD GPUs, got platform(s) "
                     f"{sorted({d.platform for d in devices})}")


def shard_folders(images_NCHW: np.ndarray, labels_N: np.ndarray, num_shards: int,
                  cache_dir: str | os.PathLike) -> list[str]:
    """The n folders of order="vendor", sharding="files": folder k holds shard k's records [N*k//n, N*(k+1)//n) as its
    only file, in ``cache_dir/rocal-shards-<N>-of-<n>-<content hash>``. The set is written under another name and
    renamed: the first writer wins. Raises ValueError for images not uint8 (N, 3, 32, 32), labels not integers 0..9,
    more shards than samples, or a cached folder that is not one file of its shard's size (never read)."""
    images_NCHW, labels_N = np.ascontiguousarray(images_NCHW), np.asarray(labels_N)
    if images_NCHW.dtype != np.uint8 or images_NCHW.shape[1:] != IMAGE_SHAPE or labels_N.shape != images_NCHW.shape[:1]:
        raise ValueError("shard_folders: rocAL's cifar10 reader needs uint8 images (N, 3, 32, 32) and N labels, got "
                         f"images {images_NCHW.dtype} {images_NCHW.shape}, labels {labels_N.shape}")
    if not np.issubdtype(labels_N.dtype, np.integer) or ((labels_N < 0) | (labels_N > 9)).any():
        raise ValueError(f"shard_folders: CIFAR-10 labels are integers 0..9, got {labels_N.dtype} in "
                         f"[{labels_N.min() if labels_N.size else ''}, {labels_N.max() if labels_N.size else ''}]"
                         f" (checked before the cache key is taken: they are hashed as int32)")
    N = len(labels_N)
    shard_bounds(N, 0, num_shards)  # more shards than samples
    digest = hashlib.blake2b(repr(images_NCHW.shape).encode(), digest_size=16)
    digest.update(memoryview(images_NCHW).cast("B"))
    digest.update(labels_N.astype(np.int32).tobytes())
    cache_dir = os.path.expanduser(os.fspath(cache_dir))
    top = os.path.join(cache_dir, f"rocal-shards-{N}-of-{num_shards}-{digest.hexdigest()}")
    folders = [os.path.join(top, f"shard-{k:05d}") for k in range(num_shards)]
    if not os.path.isdir(top):
        os.makedirs(cache_dir, exist_ok=True)
        scratch = tempfile.mkdtemp(dir=cache_dir, prefix=".rocal-shards-writing-")
        try:
            for k in range(num_shards):
                start, stop = shard_bounds(N, k, num_shards)
                os.mkdir(os.path.join(scratch, os.path.basename(folders[k])))
                write_cifar10(os.path.join(scratch, os.path.basename(folders[k]), SHARD_FILE),
                              images_NCHW[start:stop], labels_N[start:stop])
            os.rename(scratch, top)
        except BaseException as error:
            shutil.rmtree(scratch, ignore_errors=True)
            if not (isinstance(error, OSError) and os.path.isdir(top)):  # else another process renamed first
                raise
    for k, folder in enumerate(folders):
        start, stop = shard_bounds(N, k, num_shards)
        path = os.path.join(folder, SHARD_FILE)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        names = sorted(os.listdir(folder)) if os.path.isdir(folder) else None
        if size != (stop - start) * RECORD_BYTES or names != [SHARD_FILE]:
            raise ValueError(f"{path}: the cached shard should hold {stop - start} records, alone in its folder (size "
                             f"{size}, folder holds {names}); delete {top} to have it written again")
    return folders


def rocal_padded_size(num_samples: int, num_shards: int, shard_id: int, batch_size: int) -> int:
    """Shard k's ``get_remaining_images()`` at its epoch's start under FILL + pad_last_batch, were rocAL's sharding to
    work: whole batches of the largest shard, or no padding when that one is whole batches
    (``CIFAR10DataReader::subfolder_reading``)."""
    start, stop = shard_bounds(num_samples, shard_id, num_shards)
    largest = -(-num_samples // num_shards)
    return -(-largest // batch_size) * batch_size if largest % batch_size else stop - start


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """order="vendor": shard k's size, rocAL's epoch over it, and its last record (the padding's content)."""
    size: int
    batches: int
    padded: int
    last_image: np.ndarray = dataclasses.field(repr=False)  # float32 (C, ch, cw), the table's bits
    last_label: int
    copies: int  # records whose content and label are the last record's


@dataclasses.dataclass(frozen=True, eq=False)
class RocalLoader(loaders.Scheduled):
    """Epochs read by rocAL (the module docstring). It holds no pipeline: each epoch's iterator has its own, so epochs
    are independent and may overlap."""
    images: np.ndarray = dataclasses.field(repr=False)  # uint8 (N, 3, 32, 32), read_cifar10's order
    labels: np.ndarray = dataclasses.field(repr=False)  # int32 (N,)
    mesh: Mesh
    batch_size: int
    layout: str
    shuffle: bool
    seed: int
    last_batch: str
    normalize: Normalize
    order: str  # "plan" or "vendor"
    sharding: str  # order="vendor": "files" or "rocal"
    on_gpu: bool  # rocAL's GPU backend (AMD GPUs) or its CPU backend
    dlpack: bool  # outputs reach JAX through DLPack (the GPU path; tests drive it on CPU)
    cache_dir: str
    num_threads: int = 1
    folders: dict = dataclasses.field(default_factory=dict, repr=False)  # vendor: position -> folder
    prefix: str = TRAIN_PREFIX  # vendor: the filename_prefix rocAL reads with
    shards: dict = dataclasses.field(default_factory=dict, repr=False)  # vendor: position -> ShardInfo
    logical_shards: int | None = None  # order="plan": the plan's shards (None: one per device)
    # order="vendor", drop + shuffle: {"steps": real slots of each step} once an epoch was read
    # (every epoch alike). Not an argument: a loader made by dataclasses.replace starts its own.
    known_real: dict = dataclasses.field(default_factory=dict, repr=False, init=False)

    @property
    def arrays(self) -> dict:
        """The data as ``loaders.make_loader`` holds it: ``dataset``, the digest a state names, is its loader's."""
        return {"images": self.images, "labels": self.labels}

    def describe(self) -> str:
        if self.order == "plan":
            how = ("order 'plan': per epoch, each pipeline reads a file of its shard's planned "
                   "samples in plan order, rocAL's shuffle off (bit for bit the reference loader)")
        elif self.sharding == "files":
            how = ("order 'vendor': rocAL's own order over one file per shard, each read as shard 0 "
                   "of 1 (rocAL's sharding bypassed)")
        else:
            how = "order 'vendor': rocAL's own sharding and order"
        return (f"AMD rocAL {rocal_version()} ({'GPU' if self.on_gpu else 'CPU'} backend): "
                f"{len(loaders.local_positions(self.mesh))} pipeline(s) per epoch, one per local "
                f"device, shard = mesh position; {how}")

    def real_samples(self, epoch: int, *, state: LoaderState | None = None) -> int:
        """Mask-True slots of ``epoch``, or of ``epoch(epoch, state=state)``'s steps. order="vendor" with drop and
        shuffle reads one epoch to count them: RuntimeError unless this process holds every shard."""
        where, first = "RocalLoader.real_samples", 0
        if state is not None:
            resumed = self._resumed(where, epoch, state)
            if self.order == "plan":
                plan, row = resumed.plan()
                return int(plan.mask[row:].sum())
            first = resumed.step  # vendor: the loader's own plan from the step
        if self.order == "plan" or self.last_batch == "fill" or not self.shuffle \
                or not any(shard.padded for shard in self.shards.values()):
            return int(self.plan(epoch).mask[first:].sum())
        if len(self.shards) != self.num_shards:
            raise RuntimeError(f"{where}: with order='vendor', drop and shuffle the count comes from "
                               f"reading every shard; this process holds only some")
        if "steps" not in self.known_real:
            for _ in self.epoch(epoch):
                pass
        return sum(self.known_real["steps"][first:])

    def epoch(self, epoch: int, *, state: LoaderState | None = None) -> loaders.EpochIterator:
        """The batches of ``epoch``, or its rest from ``state``, as ``loaders.Loader.epoch``'s. ValueError as there, and
        with order="vendor" for a state whose plan is not this loader's."""
        where = "RocalLoader.epoch"
        check_seed("epoch", epoch, where)
        if state is None:
            (plan, row), first = (self.plan(epoch), 0), 0
            saved = lambda: self.schedule.start(epoch)
        else:
            saved = self._resumed(where, epoch, state)
            (plan, row), first = saved.plan(), saved.step  # order="vendor": its own plan, row = step
        batches = _plan_steps(self, epoch, plan, row, first) if self.order == "plan" else \
            _vendor_steps(self, epoch, row)
        return loaders.EpochIterator(batches, saved)

    def close(self) -> None:
        """Nothing to release: pipelines live as long as one epoch's iterator."""

    def _resumed(self, where: str, epoch: int, state) -> LoaderState:
        """``state`` checked and resized to this loader's shards; order="vendor" refuses a resize."""
        resumed = self.schedule.resume(where, epoch, state)
        if self.order == "vendor" and len(resumed.segments) > 1:
            raise ValueError(
                f"{where}: order='vendor' resumes only on the shards and batch that wrote the state (segments "
                f"{[tuple(x) for x in state.segments]}; this loader: {self.num_shards} shards x {self.batch_size}): "
                "rocAL has no checkpoint and no seek (a reset moves the read position on), so step s is reached by "
                "reading steps 0..s-1 again, and rocAL's order on the old shards is not one pipelines over other "
                "shards can skip. Use order='plan' (plan.elastic_plan's order, on any shard count)")
        return resumed


def _plan_steps(loader: RocalLoader, epoch: int, plan: Plan, row: int, first: int):
    """Rows ``row ..`` of ``plan`` (a fresh epoch's or a resumed segment's), global steps ``first ..``."""
    local, B, n = loaders.local_positions(loader.mesh), loader.device_rows, loader.mesh.devices.size
    plan = on_devices(plan, n)  # device k's logical shards, one block
    stop = len(plan.indices)
    if row == stop:  # nothing left (drop's segment of 0 steps, or a state at the end)
        return
    os.makedirs(loader.cache_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=loader.cache_dir, prefix=f".rocal-epoch-{epoch}-")
    pipelines, transfers = {}, _Transfers(loader.dlpack)
    try:
        for k in local:
            folder = os.path.join(scratch, f"shard-{k:05d}")
            os.mkdir(folder)
            rows = plan.indices[row:, k].reshape(-1)  # padding slots included: rocAL pads nothing
            rows = np.concatenate([rows, np.full(TAIL_BATCHES * B, rows[-1])])
            write_cifar10(os.path.join(folder, SHARD_FILE), loader.images[rows], loader.labels[rows])
            pipelines[k] = _pipeline(loader, folder, k, shuffle=False)
            _check_remaining(pipelines[k], f"rocAL, shard {k}, epoch {epoch}", len(rows),
                             f"a file of {len(rows)} records (whole batches of {B})")
        devices = list(loader.mesh.devices.flat)
        for r in range(row, stop):
            transfers.before_runs()
            blocks = {}
            for k in local:
                here = f"rocAL, shard {k} on {devices[k]}, epoch {epoch} step {first + r - row}"
                images, labels = _run(loader, pipelines[k], devices[k], (stop - r + TAIL_BATCHES) * B, here, transfers)
                want = loader.labels[plan.indices[r, k]]
                if not np.array_equal(labels, want):
                    raise RuntimeError(f"{here}: rocAL read labels {labels.tolist()} from the epoch's "
                                       f"file, which holds {want.tolist()} there")
                blocks[k] = {"images": images, "labels": labels,
                             **loaders.added_fields(plan.mask[r, k], plan.indices[r, k], k, loader.num_shards, n)}
            transfers.after_runs()
            yield loaders.global_batch(blocks, loader.mesh, loader.layout)
    finally:
        transfers.drain()  # the copies read rocAL's buffers: finished before they are released
        try:
            release_pipelines(pipelines, f"rocAL, epoch {epoch}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _vendor_steps(loader: RocalLoader, epoch: int, start: int):
    """rocAL's own epoch from fresh pipelines, yielded from step ``start``; padding found by content."""
    devices, B = list(loader.mesh.devices.flat), loader.device_rows
    pipelines, transfers = {}, _Transfers(loader.dlpack)
    runs = {k: 0 for k in loader.shards}
    seen = {k: 0 for k in loader.shards}  # slots holding the shard's last record
    real = [0] * len(loader)  # real slots per step, every shard of this process
    try:
        for k, shard in loader.shards.items():
            native = dict(shard_id=k, num_shards=loader.num_shards) if loader.sharding == "rocal" else {}
            pipelines[k] = _pipeline(loader, loader.folders[k], k, shuffle=loader.shuffle, **native)
            _check_remaining(pipelines[k], f"rocAL, shard {k}, epoch {epoch}", shard.batches * B,
                             f"shard {k} ({shard.size} records read with FILL + pad_last_batch)")
        plan_mask = None if loader.shuffle else loader.plan(epoch).mask
        for step in range(len(loader)):
            transfers.before_runs()
            blocks = {}
            for k, shard in loader.shards.items():
                here = f"rocAL, shard {k} on {devices[k]}, epoch {epoch} step {step}"
                if runs[k] < shard.batches:
                    images, labels, mask = _read_by_content(loader, pipelines[k], k, devices[k], runs, seen,
                                                            here, transfers)
                else:  # files mode: this shard's rocAL epoch is a batch short of the plan
                    images = aligned_empty((B,) + shard.last_image.shape, np.float32)
                    images[:] = shard.last_image
                    images = jax.device_put(images, devices[k]) if loader.dlpack else images
                    labels, mask = np.full(B, shard.last_label, np.int32), np.zeros(B, bool)
                if plan_mask is not None and not np.array_equal(mask, plan_mask[step, k]):
                    raise RuntimeError(
                        f"{here}: the shard's last record sits in slots {np.flatnonzero(~mask).tolist()} "
                        f"as padding, the plan pads slots {np.flatnonzero(~plan_mask[step, k]).tolist()}: "
                        f"rocAL's order is not the plan's, so the mask cannot be the plan's")
                real[step] += int(mask.sum())
                blocks[k] = {"images": images, "labels": labels, loaders.MASK: mask,
                             loaders.SHARDS: np.array([k], np.int32)}  # rocAL's order: no "index"
            transfers.after_runs()
            if step >= start:
                yield loaders.global_batch(blocks, loader.mesh, loader.layout)
        for k, shard in loader.shards.items():  # run out rocAL's epoch, then check its padding
            while runs[k] < shard.batches:
                transfers.before_runs()
                _read_by_content(loader, pipelines[k], k, devices[k], runs, seen,
                                 f"rocAL, shard {k}, the end of epoch {epoch}", transfers)
                transfers.after_runs()
            found = seen[k] - shard.copies
            if found != shard.padded:
                raise RuntimeError(
                    f"rocAL, shard {k}, at the end of epoch {epoch}: its epoch held {seen[k]} slots with the content "
                    f"of the shard's last record, of which {shard.copies} are the shard's own records, so {found} "
                    f"padding copies; rocAL padded {shard.padded}. The masks of this epoch cannot be trusted")
        if len(loader.shards) == loader.num_shards:
            loader.known_real["steps"] = real
    finally:
        transfers.drain()
        release_pipelines(pipelines, f"rocAL, epoch {epoch}")


def _read_by_content(loader: RocalLoader, pipe, k: int, device, runs: dict, seen: dict, where: str, transfers):
    """One rocAL run of shard k: (images, labels int32 (B,), the mask found by content)."""
    shard, B = loader.shards[k], loader.device_rows
    where = f"{where} (batch {runs[k] + 1} of its {shard.batches})"
    images, labels = _run(loader, pipe, device, (shard.batches - runs[k]) * B, where, transfers)
    runs[k] += 1
    if loader.dlpack:  # one small read back per shard and step: order="vendor" only
        same = np.asarray(jnp.all(images == jax.device_put(shard.last_image, device), axis=(1, 2, 3)))
    else:
        same = np.all(images == shard.last_image, axis=(1, 2, 3))
    mask = np.ones(B, bool)
    for j in np.flatnonzero(same & (labels == shard.last_label)):
        mask[j] = seen[k] < shard.copies  # the first `copies` are the shard's own records
        seen[k] += 1
    return images, labels, mask


def _pipeline(loader: RocalLoader, folder: str, k: int, *, shuffle: bool, **native):
    device = loader.mesh.devices.flat[k]
    prefix = loader.prefix if loader.order == "vendor" else TRAIN_PREFIX
    return rocal_pipeline(folder, batch_size=loader.device_rows, normalize=loader.normalize, on_gpu=loader.on_gpu,
                          device_id=_hardware_id(device) if loader.on_gpu else 0, filename_prefix=prefix,
                          shuffle=shuffle, seed=loader.seed, num_threads=loader.num_threads, **native)


def _run(loader: RocalLoader, pipe, device, left: int, where: str, transfers):
    """One ``rocal_run()`` with ``left`` samples left of rocAL's epoch, checked first (a run at 0 can
    return a stale batch): (images float32 (B, C, ch, cw), with DLPack on ``device``; labels int32 (B,))."""
    B = loader.device_rows
    remaining = _call(where, "get_remaining_images()", pipe.get_remaining_images)
    if remaining != left:
        raise RuntimeError(f"{where}: get_remaining_images() says {remaining}, but {left} samples "
                           f"are left of this epoch")
    status = _call(where, "rocal_run()", pipe.rocal_run)
    if status != import_rocal()[2].OK:
        raise RuntimeError(f"{where}: rocal_run() returned {status!r} with {remaining} samples left")
    tensor = _call(where, "get_output_tensors()", pipe.get_output_tensors)[0]
    shape = loader.normalize.output_shape(IMAGE_SHAPE)
    if loader.dlpack:
        images = transfers.add(device_images(tensor, device, shape, B, where))
    else:
        images = aligned_empty((B,) + shape, np.float32)
        copy_output(tensor, images, where)
    labels = np.asarray(_call(where, "get_image_labels()", pipe.get_image_labels))
    if labels.shape != (B,):
        raise RuntimeError(f"{where}: get_image_labels() gave shape {labels.shape}, expected ({B},)")
    return images, labels.astype(np.int32)


class _Transfers:
    """The DLPack copies, safe from rocAL's ring: a step's runs first wait for the copies of ``RING_SLOTS`` steps
    earlier; ``drain()`` waits for the rest before the release."""

    def __init__(self, active: bool):
        self.active, self.steps, self.current = active, collections.deque(), []

    def add(self, array):
        self.current.append(array)
        return array

    def before_runs(self) -> None:
        if self.active and len(self.steps) == RING_SLOTS:
            jax.block_until_ready(self.steps.popleft())

    def after_runs(self) -> None:
        if self.active:
            self.steps.append(self.current)
            self.current = []

    def drain(self) -> None:
        if self.active:
            jax.block_until_ready([*self.steps, self.current])


def make_rocal_loader(data, devices: Sequence[jax.Device] | Mesh, batch_size: int, *, layout: str = "sharded",
                      filename_prefix: str = TRAIN_PREFIX, shuffle: bool = False, seed: int = 0,
                      last_batch: str = "fill", normalize: Normalize = Normalize(), order: str = "plan",
                      cache_dir: str | os.PathLike | None = None, sharding: str = "files", num_threads: int = 1,
                      logical_shards: int | None = None) -> RocalLoader:
    """A ``RocalLoader`` over ``data``, shard k on ``devices[k]`` (or mesh position k).

    Args:
      data: a CIFAR-10 folder (read with ``filename_prefix``) or ``(images uint8 (N, 3, 32, 32), labels_N)``.
      batch_size, layout, shuffle, seed, last_batch, logical_shards (order="plan" only): ``loaders.make_loader``'s.
      normalize: a Normalize with arithmetic "rocal" (rocAL computes its own).
      order: "plan" or "vendor"; sharding: order="vendor"'s "files" or "rocal" (the module docstring). "rocal" needs
        the folder, read by rocAL as ``read_cifar10`` reads it.
      cache_dir: for the epoch and shard files; None: DEFAULT_CACHE, ~/.cache/refimpl.
      num_threads: rocAL's threads per pipeline, an int >= 1.

    Raises:
      ImportError: amd.rocal does not import (the message says how to install it).
      ValueError: anything ``loaders.make_loader`` refuses; an argument outside its line above; devices not all CPU
        or all AMD GPUs; a folder rocAL would read otherwise.
      RuntimeError: a GPU rocAL built without DLPack; sharding "rocal" while rocAL ignores shard_id; a pipeline that
        cannot be built."""
    if not isinstance(normalize, Normalize) or normalize.arithmetic != "rocal":
        raise ValueError(f"make_rocal_loader: normalize={normalize!r}: rocAL computes rocAL's "
                         f"arithmetic; pass arithmetic.Normalize(..., arithmetic='rocal'), the spec of its bits")
    if order not in ORDERS:
        raise ValueError(f"make_rocal_loader: order must be one of {ORDERS}, got {order!r}")
    if sharding not in SHARDINGS:
        raise ValueError(f"make_rocal_loader: sharding must be one of {SHARDINGS}, got {sharding!r}")
    if order == "plan" and sharding != "files":
        raise ValueError(f"make_rocal_loader: sharding={sharding!r} reads rocAL's own shards in rocAL's order; "
                         "order='plan' writes each shard's planned samples itself: use order='vendor' with it")
    if not isinstance(num_threads, numbers.Integral) or isinstance(num_threads, bool) or num_threads < 1:
        raise ValueError(f"make_rocal_loader: num_threads must be an int >= 1, got {num_threads!r}")
    if order == "vendor" and logical_shards is not None:
        raise ValueError(f"make_rocal_loader: logical_shards={logical_shards!r} with order='vendor': "
                         f"rocAL's own order is one shard a pipeline; use order='plan'")
    if sharding == "rocal" and not isinstance(data, (str, os.PathLike)):
        raise ValueError("make_rocal_loader: sharding='rocal' reads the CIFAR-10 files itself; "
                         "pass the folder, not (images, labels) arrays")
    import_rocal()  # how to install it, before any data is read
    # The reference loader built alike checks every other argument; it does no device work.
    spec = loaders.make_loader(data, devices, batch_size, layout=layout, filename_prefix=filename_prefix,
                               shuffle=shuffle, seed=seed, last_batch=last_batch,
                               normalize=normalize, prefetch=0, logical_shards=logical_shards)
    images, labels, mesh = spec.images, spec.labels, spec.mesh
    if images.shape[1:] != IMAGE_SHAPE:
        raise ValueError(f"make_rocal_loader: images of shape {images.shape[1:]}; rocAL's reader "
                         f"is CIFAR-10's, (3, 32, 32) (for MNIST use the dali or reference backend)")
    device_list = list(mesh.devices.flat)
    on_gpu = uses_gpu(device_list)
    if on_gpu:
        check_dlpack()
    cache = os.path.expanduser(os.fspath(DEFAULT_CACHE if cache_dir is None else cache_dir))
    loader = RocalLoader(images, labels, mesh, spec.batch_size, layout, spec.shuffle, spec.seed, last_batch, normalize,
                         order, sharding, on_gpu, on_gpu, cache, int(num_threads), logical_shards=spec.logical_shards)
    if order == "plan":
        return loader
    n, N, B = len(device_list), len(labels), batch_size
    if sharding == "files":
        folders, prefix = shard_folders(images, labels, n, cache), TRAIN_PREFIX
    else:
        _check_native_folder(os.fspath(data), filename_prefix)
        folders, prefix = [os.fspath(data)] * n, filename_prefix
    loader = dataclasses.replace(loader, prefix=prefix)  # the build-time check below reads with it
    shards = {}
    for k in loaders.local_positions(mesh):
        start, stop = shard_bounds(N, k, n)
        want = rocal_padded_size(N, n, k, B) if sharding == "rocal" else -(-(stop - start) // B) * B
        if sharding == "rocal":  # rocAL 2.3.0's sharding bug shows in the first pipeline's count
            pipe = _pipeline(loader, folders[k], k, shuffle=shuffle, shard_id=k, num_shards=n)
            try:
                remaining = _call(f"rocAL, shard {k}, after build()", "get_remaining_images()",
                                  pipe.get_remaining_images)
            finally:
                release_pipelines({k: pipe}, "rocAL, make_rocal_loader(sharding='rocal')")
            if remaining != want:
                raise RuntimeError(
                    f"make_rocal_loader(sharding='rocal'): the pipeline of shard {k} of {n} says "
                    f"get_remaining_images() = {remaining}; with working sharding it would be {want} "
                    f"({stop - start} samples, padded). This is rocAL's sharding bug: fn.readers.cifar10 "
                    f"ignores shard_id (rocAL 2.3.0 builds one internal loader per shard and overwrites the "
                    f"caller's shard_id, so every pipeline reads the whole dataset and every device would "
                    f"train on the same batch). Use sharding='files' (the default), or order='plan'")
            if want % B:  # rocAL pads no shard when the largest is whole batches
                raise ValueError(f"make_rocal_loader(sharding='rocal'): rocAL would not pad shard {k} "
                                 f"({want} samples, batch {B}) and FILL would never deliver its last "
                                 f"{want % B}; use sharding='files' or another batch size")
        shards[k] = _shard_info(images, labels, start, stop, B, want // B, normalize)
    return dataclasses.replace(loader, folders={k: folders[k] for k in shards}, shards=shards)


def _shard_info(images: np.ndarray, labels: np.ndarray, start: int, stop: int, batch_size: int,
                batches: int, normalize: Normalize) -> ShardInfo:
    """Shard [start, stop)'s ShardInfo. Its records alike to its last are found on the uint8 window: two pixel values
    are alike where the table maps them to the same float."""
    last = stop - 1
    y0, x0, ch, cw = normalize.window(images.shape[2:])
    # ids[c, x]: pixel values x that channel c's table maps to the same float share an id
    ids = np.stack([np.unique(row, return_inverse=True)[1] for row in normalize.table]).astype(np.uint8)

    def key(block):  # (count, C, ch, cw) uint8 ids
        window = block[:, :, y0:y0 + ch, x0:x0 + cw]
        return np.stack([ids[c][window[:, c]] for c in range(window.shape[1])], axis=1)

    target = key(images[last:last + 1])
    copies = 0
    for lo in range(start, stop, 1024):
        hi = min(lo + 1024, stop)
        same = np.all(key(images[lo:hi]) == target, axis=(1, 2, 3)) & (labels[lo:hi] == labels[last])
        copies += int(same.sum())
    return ShardInfo(size=stop - start, batches=batches, padded=batches * batch_size - (stop - start),
                     last_image=normalize(images[last:last + 1])[0], last_label=int(labels[last]),
                     copies=copies)


def _check_native_folder(root: str, prefix: str) -> None:
    """sharding="rocal": ValueError unless rocAL reads ``root`` as ``read_cifar10`` does. rocAL matches ``prefix``
    anywhere in a name (read_cifar10: at its start), lists files in readdir order (read_cifar10: sorted), and reads
    subfolders when the first name sorted is one."""
    names = os.listdir(root)  # readdir order, what rocAL sees
    if names and os.path.isdir(os.path.join(root, sorted(names)[0])):
        raise ValueError(f"{root}: rocAL reads only the subfolders of a folder whose first entry "
                         f"({sorted(names)[0]!r}) is a folder; move it out")
    extra = sorted(n for n in names if prefix in n and not n.startswith(prefix))
    if extra:
        raise ValueError(f"{root}: rocAL would also read {extra}, which contain filename_prefix="
                         f"{prefix!r}; move them out of the folder")
    matching = [n for n in names if n.startswith(prefix) and os.path.isfile(os.path.join(root, n))]
    if matching != sorted(matching):
        raise ValueError(f"{root}: rocAL reads files in directory order {matching}, the spec in sorted "
                         f"order; with sharding='rocal' the shards would differ (use sharding='files')")
