"""AMD rocAL backend: the reference loader's sharded epochs, read and normalised by rocAL.

This module plans, shards and delivers; rocAL's own calls (the import, a pipeline's
build and its bounded release, the output copies and DLPack) are rocal_api.py's, below it.

One rocAL ``Pipeline`` per local device and epoch. Pipeline k (k = its device's
position in the mesh, never ``device.id``) reads with ``fn.readers.cifar10`` and
runs ``fn.crop_mirror_normalize`` to float32 NCHW. Its outputs become row block
k of global ``jax.Array``s through ``loaders.global_batch``, in both layouts, as
``loaders.Loader`` gives them.

What the rocAL notebook's code does on the rocAL that exists (rocAL 2.3.0, its
CPU backend; docs/vendors.md has each fact with its evidence, and test_rocal.py's
conformance test fails when one changes): ``fn.readers.cifar10(shard_id=k,
num_shards=n)`` ignores ``shard_id``, so every pipeline delivers the same stream
over the whole dataset (EVERY DEVICE TRAINS ON THE SAME BATCH, and an epoch is n
times too long); DROP and ``pad_last_batch=False`` silently lose records, and only
FILL with ``pad_last_batch=True`` delivers every record, padding with unmarked
copies; ``random_shuffle`` is seeded by the shard index, not the Pipeline's seed,
and shuffles those copies in; ``rocal_run()`` can return a stale batch past an
epoch's end; ``rocal_release()`` can block for ever (a lost wake-up), so every
release here is bounded (``release_pipelines``, ``RELEASE_TIMEOUT_S``,
``RocalReleaseWarning``); ``crop_mirror_normalize`` flips every image unless told
``mirror=0``; files are read in raw ``readdir`` order; and the notebook's
``ROCALJaxIterator`` imports ``PositionalSharding``, removed in JAX 0.7.

So this module never uses rocAL's sharding, shuffle or resets for the data a
model trains on. Two orders:

* ``order="plan"`` (the default). Every ``epoch(e, start_step)`` call builds its
  own pipelines. Pipeline k reads ONE CIFAR-10 file holding exactly the slots
  ``plan.indices[start_step:, k]`` of ``plan.epoch_plan`` (padding slots
  included, in plan order), followed by ``TAIL_BATCHES`` batches that are never
  run, with rocAL's shuffle off, ``num_shards=1`` and FILL + pad_last_batch:
  rocAL's epoch is exactly the planned ``steps * B`` records and pads nothing.
  rocAL reads and decodes the records and runs crop_mirror_normalize; the mask
  is the plan's. The files are written (each atomically) into a temporary
  folder ``cache_dir/.rocal-epoch-<e>-*`` that the iterator deletes, with the
  pipelines released, when it ends, is closed or is collected, or is left
  unfinished at the interpreter's exit (``loaders.EpochIterator``: before modules
  are torn down, printing nothing; its cost: docs/vendors.md).
* ``order="vendor"``: rocAL's own order, for the conformance tests and to show
  what rocAL does. Pipelines are built per epoch too (stateless), over
  sharding="files" (shard k's records ``[N*k//n, N*(k+1)//n)`` as one file
  ``data_batch_1.bin`` in a folder of its own: ``shard_folders``, written once,
  atomically, under a cache keyed by content) read as shard 0 of 1, or
  sharding="rocal" (``shard_id=k, num_shards=n`` over the original folder, for a
  fixed rocAL: refused at build time, naming the bug, when every pipeline's
  ``get_remaining_images()`` is not its padded shard's size). The mask is found
  by content (a slot whose image and label equal the shard's last record,
  beyond the shard's own records with that content, is padding) and checked
  against what rocAL padded at the end of each epoch: never guessed.

Guaranteed, both orders:

* ``len()`` is ``plan.num_steps(N, n, B, last_batch)``; ``epoch(e, s)``
  yields steps s .. len()-1 of epoch e, and is a function of (seed, e, s,
  shard) alone: the same batches whatever was read before, in any call order,
  from any number of loaders built alike, also with several epochs in flight.
* A pipeline is never run at 0 remaining: before every run
  ``get_remaining_images()`` must be exactly what is left of its epoch.
  ``mirror`` is always passed explicitly; output layout, shape and dtype are
  checked before a byte is copied (``copy_output``; rocAL's ``copy_data`` is a
  raw memcpy). Every rocAL error is re-raised naming the shard, the epoch and
  the step; a build that raises RuntimeError is retried (``BUILD_ATTEMPTS``).
* Releasing never hangs: each pipeline's release returns or is given up after
  ``RELEASE_TIMEOUT_S`` with a ``RocalReleaseWarning`` naming its epoch and
  shard (``release_pipelines``); the epoch's files are deleted either way.

order="plan", also guaranteed: the global arrays are bit for bit those of
``loaders.make_loader(..., normalize=Normalize(arithmetic="rocal"))`` with the
same seed, images, labels, mask and sharding, shuffled or not, fill or drop,
both layouts, one or several processes (each process builds the pipelines of
its own devices and writes only their files); and so is training on them:
``refimpl.py --backend rocal`` ends with the reference backend's params.

order="vendor", not guaranteed (rocAL's, stated): with shuffle the order is
rocAL's: one fixed permutation per shard size, the same for every seed and
every epoch (fresh pipelines, seeded by shard_id, which is 0 for every pipeline
in files mode, so shards of equal size are permuted alike); drop with shuffle
masks the padding copies rocAL shuffled into the steps kept, so such an epoch
has fewer than ``n * len() * B`` real slots (``real_samples`` reads an epoch
to count them). ``start_step`` is served by reading and dropping the steps
before it. In files mode a shard of floor(N/n) samples, a multiple of B, gets
an epoch of ``ceil(S_k/B)`` rocAL batches, one fewer than ``len()``: that step
is filled here with B copies of the shard's last record, mask False.

Resuming from a saved ``plan.LoaderState`` (``epoch(e, state=saved)``,
``state``, ``real_samples``: ``loaders.Loader``'s signatures and meaning; every
state names this loader's data, ``dataset``, and a state naming other data is
refused, through ``plan.Schedule``, as the reference loader refuses it):

* order="plan", on any device or process count and batch size: with ``st =
  saved.resized(n, B)`` and ``plan, row = st.plan()`` (``plan.elastic_plan``'s
  last segment), pipeline k's file holds ``plan.indices[row:, k]`` (padding
  slots included, then the tail), and the iterator yields global steps
  ``st.step .. st.num_steps - 1`` with the plan's mask: bit for bit
  ``loaders.make_loader(...).epoch(e, state=saved)``. What a resumed segment may
  hold and a fresh epoch never does (a batch larger than a shard's run, a shard
  whose run is empty and holds only padding, 0 steps under drop) is written
  into the files like any other slot; a segment of 0 steps builds nothing.
* order="vendor": on the saved shards and batch only (then ``epoch(e,
  start_step=st.step)``, steps 0..s-1 read and dropped); any other state is
  refused, saying why: rocAL has no checkpoint and no seek, and which samples the
  old shards delivered in rocAL's order no pipeline over other shards can skip.

Worked example, N=9, n=2, B=2 (fill: 3 steps; drop: 2). Shard 0 is {0,1,2,3},
shard 1 is {4,...,8}. ``*`` marks a padding slot (mask False); rows marked
"rocAL" are what rocAL 2.3.0 delivered in a probe; ``p`` is a planned sample:

    reader                           | shard 0             | shard 1
    ---------------------------------+---------------------+-----------------------
    rocAL, notebook (native, DROP)   | [0 4][0 1][5 6][2 3]| the same: 7, 8 never
    order plan, fill (= reference)   | [0 1][2 3][3* 3*]   | [4 5][6 7][8 8*]
    order plan, drop (= reference)   | [0 1][2 3]          | [4 5][6 7]
    order plan, fill, shuffled       | [p p][p p][p* p*]   | [p p][p p][p p*]
    rocAL, files mode                | [0 1][2 3]          | [4 5][6 7][8 8]
    order vendor, fill               | [0 1][2 3][3* 3*]   | [4 5][6 7][8 8*]
    order vendor, fill, shuffled     | [p p][p p][3* 3*]   | [6 8][7 4][5 8*], every epoch
    order vendor, drop, shuffled     | [p p][p p]          | [6 8][7 4], every epoch

How the output reaches JAX: on CPU devices, rocAL's CPU backend, each output
copied (``copy_output``, after its layout, shape and dtype are checked) into an
aligned float32 buffer that ``global_batch`` places on device k. On AMD GPUs
(platform "rocm", or "gpu" on a ROCm JAX; never CUDA devices), the GPU backend
through DLPack (``check_dlpack``, ``RocalDLPack``), the imported alias copied on
the device; rocAL's outputs are ring-buffer slots its second next run overwrites,
so before the runs of step s one wait covers the copies of step s-2. NOT RUN on a
GPU (none was available): that path runs in the tests on CPU devices with a double
of rocAL's tensor and with real rocAL CPU tensors; what its HIP kernels compute
was read in rocAL's source (docs/vendors.md, pinned in test_rocal.py).

Caches, each keyed by everything that determines its bits: the shard files of
order="vendor" (``shard_folders``: N, n and a hash of the images' shape and bytes
and the int32 labels, which must be 0..9, checked before hashing); the epoch files
of order="plan" are never reused (one temporary folder per ``epoch()`` call). No
table or compiled step is cached here: tables come from ``arithmetic.normalize_table``
(keyed by the float32 bit patterns of mean and std, so -0.0 is not 0.0).

Imports: plan.py, arithmetic.py, cifar_mnist.py, and loaders.py to place each step's
blocks on the devices (``global_batch``); amd.rocal lazily (this module loads without it).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import os
import shutil
import tempfile
from typing import Iterator, Sequence

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import loaders
from arithmetic import Normalize, aligned_empty
from cifar_mnist import IMAGE_SHAPE, RECORD_BYTES, TRAIN_PREFIX, write_cifar10
from plan import LoaderState, Plan, Schedule, check_seed, dataset_digest, on_devices, shard_bounds
from rocal_api import (_call, _check_remaining, _hardware_id, _rocal_ok, check_dlpack, copy_output, rocal_version,
                       device_images, import_rocal, release_pipelines, rocal_pipeline)

ORDERS = ("plan", "vendor")
SHARDINGS = ("files", "rocal")
DEFAULT_CACHE = os.path.join("~", ".cache", "refimpl")
SHARD_FILE = "data_batch_1.bin"  # the only file in a shard's folder
ROCAL_SHARDING_BUG = (
    "rocAL's sharding bug: fn.readers.cifar10 ignores shard_id (rocAL 2.3.0 builds one internal "
    "loader per shard and overwrites the caller's shard_id, so every pipeline reads the whole "
    "dataset and every device would train on the same batch)"
)


def is_amd_gpu(device: jax.Device) -> bool:
    """Platform "rocm", or "gpu" on a JAX built for ROCm."""
    if device.platform == "rocm":
        return True
    version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    return device.platform == "gpu" and ("rocm" in version or "hip" in version)


def usable(devices: Sequence[jax.Device] | Mesh) -> bool:
    """What ``--backend auto`` asks: is every device an AMD GPU, and does amd.rocal import?

    The notebook's hosts. On CPU devices the CPU backend works too, but only when
    asked for (``--backend rocal``)."""
    devices = list(devices.devices.flat) if isinstance(devices, Mesh) else list(devices)
    if not devices or not all(is_amd_gpu(d) for d in devices):
        return False
    try:
        import_rocal()
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------
# Files mode: one CIFAR-10 file per shard
# --------------------------------------------------------------------------


def shard_folders(images_NCHW: np.ndarray, labels_N: np.ndarray, num_shards: int,
                  cache_dir: str | os.PathLike) -> list[str]:
    """Folder k holds shard k's records ``[N*k//n, N*(k+1)//n)``, in order, as one
    CIFAR-10 file ``data_batch_1.bin``. Returns the n folders.

    They live in ``cache_dir/rocal-shards-<N>-of-<n>-<hash>``, the hash taken over
    the images' shape and bytes and the labels, so a changed dataset never reuses
    stale files and the same one is written once. The set is written into a
    temporary folder and renamed: a reader never sees half of it, and of two
    concurrent writers the first rename wins. Raises ValueError for images that
    are not CIFAR-10's uint8 (N, 3, 32, 32), labels outside 0..9, more shards than
    samples, or a cached file of the wrong size (named).
    """
    images_NCHW, labels_N = np.ascontiguousarray(images_NCHW), np.asarray(labels_N)
    if images_NCHW.dtype != np.uint8 or images_NCHW.shape[1:] != IMAGE_SHAPE \
            or labels_N.shape != images_NCHW.shape[:1]:
        raise ValueError(f"shard_folders: rocAL's cifar10 reader needs uint8 images (N, 3, 32, 32) "
                         f"and N labels, got images {images_NCHW.dtype} {images_NCHW.shape}, "
                         f"labels {labels_N.shape}")
    if not np.issubdtype(labels_N.dtype, np.integer) or (labels_N.size and not (
            (labels_N >= 0) & (labels_N <= 9)).all()):
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
        except OSError:
            shutil.rmtree(scratch, ignore_errors=True)
            if not os.path.isdir(top):  # else another process renamed its copy first
                raise
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    for k, folder in enumerate(folders):  # a damaged cache is named, never read
        start, stop = shard_bounds(N, k, num_shards)
        path = os.path.join(folder, SHARD_FILE)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        names = sorted(os.listdir(folder)) if os.path.isdir(folder) else None
        if size != (stop - start) * RECORD_BYTES or names != [SHARD_FILE]:
            raise ValueError(f"{path}: the cached shard should hold {stop - start} records, alone in "
                             f"its folder (size {size}, folder holds {names}); delete {top} to have "
                             f"it written again")
    return folders


def rocal_padded_size(num_samples: int, num_shards: int, shard_id: int, batch_size: int) -> int:
    """What ``get_remaining_images()`` says at the start of an epoch of shard k of n
    under FILL + pad_last_batch when rocAL's sharding works: rocAL pads every shard
    with copies of its last record up to a whole number of batches of the largest
    shard, or not at all when the largest shard is a whole number of batches
    (``CIFAR10DataReader::subfolder_reading``)."""
    start, stop = shard_bounds(num_samples, shard_id, num_shards)
    largest = -(-num_samples // num_shards)
    return -(-largest // batch_size) * batch_size if largest % batch_size else stop - start


# --------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """order="vendor": what the loader knows of shard k before reading it: its size
    and rocAL's epoch over it (batches, padding copies), its last record normalised
    (the padding's content) and how many of its records have that content."""
    size: int
    batches: int
    padded: int
    last_image: np.ndarray = dataclasses.field(repr=False)  # float32 (C, ch, cw), the table's bits
    last_label: int
    copies: int


@dataclasses.dataclass(frozen=True, eq=False)
class RocalLoader:
    """Sharded epochs read and normalised by rocAL; see the module docstring.

    Build it with ``make_rocal_loader``. ``len()`` steps per epoch; ``epoch(e,
    start_step)`` yields steps ``start_step .. len()-1`` of epoch e as
    ``{"images" float32, "labels" int32, "mask" bool}`` global arrays in
    ``layout``; ``epoch(e, state=saved)`` the rest of a saved epoch (the module
    docstring's "Resuming"). The loader holds no pipeline: each ``epoch()``
    iterator builds its own, and releases them (and deletes its files) when it ends,
    is closed or collected, or is left unfinished at exit, so epoch e is a function of (seed, e, start_step, shard) whatever
    was read before, and several epochs may be iterated at once.
    """
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
    dlpack: bool  # outputs reach JAX through DLPack (the GPU path; on CPU, tests drive it)
    cache_dir: str
    num_threads: int = 1
    folders: dict = dataclasses.field(default_factory=dict, repr=False)  # vendor: position -> folder
    prefix: str = TRAIN_PREFIX  # vendor: the filename_prefix rocAL reads with
    shards: dict = dataclasses.field(default_factory=dict, repr=False)  # vendor: position -> ShardInfo
    logical_shards: int | None = None  # order="plan": the plan's shards (None: one a device)
    # order="vendor", drop + shuffle: {"steps": real slots of each step} once an epoch has been
    # read (every epoch alike). Not an argument: a loader made with dataclasses.replace starts its own.
    known_real: dict = dataclasses.field(default_factory=dict, repr=False, init=False)

    @property
    def num_shards(self) -> int:
        """The plan's shards: ``logical_shards``, or the device count."""
        return self.logical_shards or self.mesh.devices.size

    @property
    def device_rows(self) -> int:
        """Samples a pipeline reads a step: (L/n) x batch_size."""
        return self.num_shards // self.mesh.devices.size * self.batch_size

    @property
    def num_samples(self) -> int:
        return len(self.labels)

    @functools.cached_property
    def dataset(self) -> str:
        """The identity of this loader's data, ``plan.dataset_digest({"images": images,
        "labels": labels})``: what ``loaders.make_loader`` over the same data gives, so a
        state moves between the two. Computed the first time a state is made or
        checked, then kept."""
        return dataset_digest({"images": self.images, "labels": self.labels})

    @property
    def schedule(self) -> Schedule:
        """This loader's epochs as pure schedule (plan.Schedule), its data's identity
        (``dataset``) read when a state is made or checked."""
        return Schedule(self.num_samples, self.num_shards, self.batch_size, self.seed, self.shuffle,
                        self.last_batch, dataset=self._dataset)

    def _dataset(self) -> str:
        return self.dataset

    def __len__(self) -> int:
        return self.schedule.steps

    def plan(self, epoch: int) -> Plan:
        """The reference plan of ``epoch`` (what order="plan" delivers)."""
        return self.schedule.plan(epoch)

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
        """Mask-True slots of ``epoch`` in the whole global batch: the plan's (fill: N;
        drop: n * len() * B); with a ``state``, those of the steps ``epoch(epoch,
        state=state)`` yields (order="plan": ``plan.mask[row:]`` of the resumed
        segment). order="vendor" with drop and shuffle: rocAL shuffles its padding
        copies into the steps kept, so the count is found by reading the epoch (once:
        every epoch of a fresh rocAL pipeline is alike); RuntimeError when this
        process does not hold every shard."""
        first = 0
        if state is not None:
            st = self._resumed("RocalLoader.real_samples", epoch, state)
            if self.order == "plan":
                plan, row = st.plan()
                return int(plan.mask[row:].sum())
            first = st.step  # vendor: the saved shards' fresh epoch from its step
        if self.order == "plan" or self.last_batch == "fill" or not self.shuffle \
                or not any(shard.padded for shard in self.shards.values()):
            return int(self.plan(epoch).mask[first:].sum())
        if len(self.shards) != self.num_shards:
            raise RuntimeError("RocalLoader.real_samples: with order='vendor', drop and shuffle the "
                               "count comes from reading every shard; this process holds only some")
        if "steps" not in self.known_real:
            for _ in self.epoch(epoch):
                pass
        return sum(self.known_real["steps"][first:])

    def state(self, epoch: int, step: int = 0, *,
              state: LoaderState | None = None) -> LoaderState:
        """The ``plan.LoaderState`` to save after ``step`` steps of ``epoch``:
        ``loaders.Loader.state``'s meaning, range and refusals (without ``state``:
        of a fresh epoch on this loader's shards; with the ``state`` the epoch was
        resumed from: ``state.resized(n, B).at_step(step)``, step from its step on).
        order="vendor" refuses a ``state`` of other shards as ``epoch`` does."""
        if state is not None:
            self._resumed("RocalLoader.state", epoch, state)  # order="vendor" refuses a resize
        return self.schedule.state("RocalLoader.state", epoch, step, state=state)

    def epoch(self, epoch: int, start_step: int = 0, *,
              state: LoaderState | None = None) -> Iterator[dict[str, jax.Array]]:
        """With ``state`` (a saved ``plan.LoaderState`` of this run: the same data, seed,
        shuffle and last_batch), the rest of the epoch it was taken in, from its step
        (the module docstring's "Resuming"), and ``start_step`` must stay 0. Without
        it, steps ``start_step .. len()-1`` of this loader's own fresh plan: what
        another loader delivered there only if it had the same logical shards and
        batch_size (``loaders.Loader``'s last paragraph); after any other, resume from
        its state. Raises ValueError for an epoch outside [0, 2**32), a state of
        another run (num_samples, dataset, seed, shuffle, last_batch: named) or epoch,
        a start_step with a state, or (order="vendor") a state of other shards;
        IndexError for a start_step outside [0, len()]. The pipelines are built, and
        the epoch's files written, at the first ``next()``."""
        check_seed("epoch", epoch, "RocalLoader.epoch")
        if state is not None:
            st = self._resumed("RocalLoader.epoch", epoch, state)
            if start_step != 0:
                raise ValueError(f"RocalLoader.epoch: start_step={start_step!r} with a state; the state "
                                 f"says where the epoch resumes (step {state.step})")
            if self.order == "vendor":  # one segment (0, n, B): the saved shards' fresh epoch
                return loaders.EpochIterator(_vendor_steps(self, epoch, st.step))
            plan, row = st.plan()
            return loaders.EpochIterator(_plan_steps(self, epoch, plan, row, st.step))
        if not 0 <= start_step <= len(self):
            raise IndexError(f"RocalLoader.epoch: start_step={start_step} is outside [0, {len(self)}]")
        if self.order == "plan":
            return loaders.EpochIterator(_plan_steps(self, epoch, self.plan(epoch), start_step,
                                                     start_step))
        return loaders.EpochIterator(_vendor_steps(self, epoch, start_step))

    def close(self) -> None:
        """Nothing to release: pipelines live as long as one epoch's iterator."""

    def _resumed(self, where: str, epoch: int, state) -> LoaderState:
        """``state`` checked against this run and ``epoch`` (as loaders.Loader checks
        it), resized to this loader's shards; order="vendor" refuses a resize."""
        st = self.schedule.resumed(where, epoch, state)
        if self.order == "vendor" and len(st.segments) > 1:
            raise ValueError(
                f"{where}: order='vendor' resumes only on the shards and batch that wrote the state "
                f"(segments {[tuple(x) for x in state.segments]}; this loader: {self.num_shards} shards "
                f"x {self.batch_size}), and only by reading its steps again: rocAL has no checkpoint "
                f"and no seek (a reset moves the read position on), so this backend reaches step s by "
                f"reading and dropping steps 0..s-1 of fresh pipelines, and which samples were "
                f"delivered is rocAL's order on the old shards, which pipelines over other shards "
                f"cannot skip. Use order='plan' (plan.elastic_plan's order, on any shard count)")
        return st


# --------------------------------------------------------------------------
# Reading an epoch: the plan's order and rocAL's own
# --------------------------------------------------------------------------


def _plan_steps(loader: RocalLoader, epoch: int, plan: Plan, row: int, first: int):
    """Rows ``row ..`` of ``plan`` (a fresh epoch's or a resumed segment's), global
    steps ``first ..`` of the epoch."""
    local, B = loaders.local_positions(loader.mesh), loader.device_rows
    plan = on_devices(plan, loader.mesh.devices.size)  # device k's logical shards, one block
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
            # TAIL_BATCHES more (never run): see TAIL_BATCHES.
            rows = np.concatenate([rows, np.full(TAIL_BATCHES * B, rows[-1])])
            write_cifar10(os.path.join(folder, SHARD_FILE), loader.images[rows], loader.labels[rows])
            pipelines[k] = _pipeline(loader, folder, k, shuffle=False)
            _check_remaining(pipelines[k], f"rocAL, shard {k}, epoch {epoch}", len(rows),
                             f"a file of {len(rows)} records (whole batches of {B})")
        devices = list(loader.mesh.devices.flat)
        for r in range(row, stop):
            where = f"rocAL, shard {{}} on {{}}, epoch {epoch} step {first + r - row}"
            transfers.before_runs()
            blocks = {}
            for k in local:
                here = where.format(k, devices[k])
                images, labels = _run(loader, pipelines[k], devices[k], (stop - r + TAIL_BATCHES) * B,
                                           here, transfers)
                want = loader.labels[plan.indices[r, k]]
                if not np.array_equal(labels, want):
                    raise RuntimeError(f"{here}: rocAL read labels {labels.tolist()} from the epoch's "
                                       f"file, which holds {want.tolist()} there")
                blocks[k] = {"images": images, "labels": labels,
                            **loaders.added_fields(plan.mask[r, k], plan.indices[r, k], k, loader.num_shards,
                                                   loader.mesh.devices.size)}
            transfers.after_runs()
            yield loaders.global_batch(blocks, loader.mesh, loader.layout)
    finally:
        transfers.drain()  # the copies read rocAL's buffers: finished before they are released
        try:
            release_pipelines(pipelines, f"rocAL, epoch {epoch}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _vendor_steps(loader: RocalLoader, epoch: int, start: int):
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
                    images, labels = _padding(loader, k, devices[k])
                    mask = np.zeros(B, bool)
                if plan_mask is not None and not np.array_equal(mask, plan_mask[step, k]):
                    raise RuntimeError(
                        f"{here}: the shard's last record sits in slots {np.flatnonzero(~mask).tolist()} "
                        f"as padding, the plan pads slots {np.flatnonzero(~plan_mask[step, k]).tolist()}: "
                        f"rocAL's order is not the plan's, so the mask cannot be the plan's")
                real[step] += int(mask.sum())
                blocks[k] = {"images": images, "labels": labels, "mask": mask,
                             loaders.SHARDS: np.array([k], np.int32)}  # rocAL's order: no sample indices
            transfers.after_runs()
            if step >= start:  # resuming: the steps before are read by rocAL and dropped
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
                    f"rocAL, shard {k}, at the end of epoch {epoch}: its epoch held {seen[k]} slots with "
                    f"the content of the shard's last record, of which {shard.copies} are the shard's "
                    f"own records, so {found} padding copies; rocAL padded {shard.padded}. The masks "
                    f"of this epoch cannot be trusted")
        if len(loader.shards) == loader.num_shards:
            loader.known_real["steps"] = real
    finally:
        transfers.drain()
        release_pipelines(pipelines, f"rocAL, epoch {epoch}")


def _read_by_content(loader: RocalLoader, pipe, k: int, device, runs: dict, seen: dict, where: str, transfers):
    """One rocAL run of shard k: (images, labels int32 (B,), mask found by content)."""
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


def _padding(loader: RocalLoader, k: int, device: jax.Device):
    shard, B = loader.shards[k], loader.device_rows
    images = aligned_empty((B,) + shard.last_image.shape, np.float32)
    images[:] = shard.last_image
    if loader.dlpack:
        images = jax.device_put(images, device)
    return images, np.full(B, shard.last_label, np.int32)


def _pipeline(loader: RocalLoader, folder: str, k: int, *, shuffle: bool, **native):
    device = loader.mesh.devices.flat[k]
    prefix = loader.prefix if loader.order == "vendor" else TRAIN_PREFIX
    return rocal_pipeline(folder, batch_size=loader.device_rows, normalize=loader.normalize,
                          on_gpu=loader.on_gpu, device_id=_hardware_id(device) if loader.on_gpu else 0,
                          filename_prefix=prefix, shuffle=shuffle, seed=loader.seed,
                          num_threads=loader.num_threads, **native)


def _run(loader: RocalLoader, pipe, device, left: int, where: str, transfers):
    """One ``rocal_run()`` with ``left`` samples left of rocAL's epoch (checked first:
    a pipeline is never run at 0, where rocAL 2.3.0 can return a stale batch):
    (images float32 (B, C, ch, cw) on the host or, ``dlpack``, on ``device``,
    labels int32 (B,))."""
    B = loader.device_rows
    remaining = _call(where, "get_remaining_images()", pipe.get_remaining_images)
    if remaining != left:
        raise RuntimeError(f"{where}: get_remaining_images() says {remaining}, but {left} samples "
                           f"are left of this epoch")
    status = _call(where, "rocal_run()", pipe.rocal_run)
    if status != _rocal_ok():
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


# order="plan" writes this many batches more than the epoch's at the end of each file and
# never runs them. rocAL's output thread, once its reader has nothing left to load, sleeps
# in 100 ms steps (MasterGraph::output_routine), and rocal_release() waits that sleep out:
# 0.1 s per pipeline per epoch, one after the other (0.75 s for 8 pipelines, measured).
# With batches left to load the thread waits on the full ring buffer instead, and
# rocal_release() returns in about 1 ms. More than rocAL loads ahead (its ring of 2 plus
# one being processed). Either way a release can meet rocAL's lost wake-up (see
# release_pipelines): the tail changes its cost, not its safety.
TAIL_BATCHES = 4
RING_SLOTS = 2  # a rocAL output is a ring-buffer slot that the second following run writes again


class _Transfers:
    """The DLPack path's copies, kept safe from rocAL's ring buffer without waiting on
    every one: before the runs of a step, ONE ``jax.block_until_ready`` waits for the
    copies made ``RING_SLOTS`` steps earlier (the slots these runs will write); the
    device runs its queue in order, so they have long finished and the wait costs
    nothing. ``drain()`` waits for the rest before the pipelines are released."""

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
            self.steps.clear()
            self.current = []


def uses_gpu(devices: Sequence[jax.Device]) -> bool:
    """False for CPU devices (rocAL's CPU backend), True for AMD GPUs (its GPU backend);
    ValueError for anything else or a mix."""
    if all(d.platform == "cpu" for d in devices):
        return False
    if all(is_amd_gpu(d) for d in devices):
        return True
    raise ValueError(f"make_rocal_loader: rocAL runs on CPU devices or AMD GPUs, got platform(s) "
                     f"{sorted({d.platform for d in devices})}")


def make_rocal_loader(data, devices: Sequence[jax.Device] | Mesh, batch_size: int, *,
                      layout: str = "sharded", filename_prefix: str = TRAIN_PREFIX,
                      shuffle: bool = False, seed: int = 0, last_batch: str = "fill",
                      normalize: Normalize = Normalize(), order: str = "plan",
                      cache_dir: str | os.PathLike | None = None, sharding: str = "files",
                      num_threads: int = 1, logical_shards: int | None = None) -> RocalLoader:
    """A ``RocalLoader`` over ``data``: a CIFAR-10 folder (read with ``filename_prefix``),
    or an ``(images uint8 (N, 3, 32, 32), labels_N)`` pair. ``batch_size`` is per
    device; shard k goes to ``devices[k]`` (or mesh position k). ``order`` is "plan"
    (default: the reference loader's epochs, bit for bit) or "vendor" (rocAL's own
    order; ``sharding`` "files" or "rocal" picks how rocAL is given its shard).
    ``logical_shards``: as ``loaders.make_loader``'s (order="plan" only: pipeline k
    reads its device's logical shards' blocks, (L/n)*B records a step).
    Files go under ``cache_dir`` (default ~/.cache/refimpl): the epoch files of
    order="plan" (deleted when the epoch ends) and the shard files of
    order="vendor", sharding="files" (kept, keyed by content).

    Raises ImportError (how to install rocAL) without amd.rocal; ValueError for
    everything ``loaders.make_loader`` refuses, a normalize that is not
    ``Normalize(arithmetic="rocal")`` (rocAL computes rocAL's arithmetic), images
    that are not CIFAR-10's (rocAL's reader is CIFAR-10 only: no MNIST), an
    unknown order or sharding, sharding="rocal" with order="plan", num_threads < 1,
    devices that are neither all CPU nor all AMD GPUs, and in rocal mode arrays
    instead of a folder or a folder rocAL would read differently from
    ``read_cifar10``; RuntimeError for a rocAL GPU build without DLPack, when
    rocAL's sharding does not work (rocal mode), or a pipeline cannot be built.
    """
    if not isinstance(normalize, Normalize) or normalize.arithmetic != "rocal":
        raise ValueError(f"make_rocal_loader: normalize={normalize!r}: rocAL computes rocAL's "
                         f"arithmetic; pass arithmetic.Normalize(..., arithmetic='rocal'), the spec of its bits")
    if order not in ORDERS:
        raise ValueError(f"make_rocal_loader: order must be one of {ORDERS}, got {order!r}")
    if sharding not in SHARDINGS:
        raise ValueError(f"make_rocal_loader: sharding must be one of {SHARDINGS}, got {sharding!r}")
    if order == "plan" and sharding != "files":
        raise ValueError(f"make_rocal_loader: sharding={sharding!r} reads rocAL's own shards in rocAL's "
                         f"order; order='plan' writes each shard's planned samples itself: use "
                         f"order='vendor' with it")
    if num_threads < 1:
        raise ValueError(f"make_rocal_loader: num_threads must be >= 1, got {num_threads}")
    if order == "vendor" and logical_shards is not None:
        raise ValueError(f"make_rocal_loader: logical_shards={logical_shards!r} with order='vendor': "
                         f"rocAL's own order is one shard a pipeline; use order='plan'")
    is_folder = isinstance(data, (str, os.PathLike))
    if sharding == "rocal" and not is_folder:
        raise ValueError("make_rocal_loader: sharding='rocal' reads the CIFAR-10 files itself; "
                         "pass the folder, not (images, labels) arrays")
    import_rocal()  # how to install it, before any data is read
    # The reference loader checks every argument as make_loader does. It does no device work.
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
    cache = os.path.expanduser(os.fspath(cache_dir if cache_dir is not None else DEFAULT_CACHE))
    loader = RocalLoader(images, labels, mesh, batch_size, layout, shuffle, seed, last_batch, normalize,
                         order, sharding, on_gpu, on_gpu, cache, num_threads,
                         logical_shards=spec.logical_shards)
    if order == "plan":
        return loader
    n, N, B = len(device_list), len(labels), batch_size
    local = loaders.local_positions(mesh)
    if sharding == "files":
        folders = shard_folders(images, labels, n, cache)
        prefix = TRAIN_PREFIX
    else:
        _check_native_folder(os.fspath(data), filename_prefix)
        folders, prefix = [os.fspath(data)] * n, filename_prefix
    loader = dataclasses.replace(loader, prefix=prefix)  # the build-time check below reads with it
    shards = {}
    for k in local:
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
                    f"({stop - start} samples, padded). This is {ROCAL_SHARDING_BUG}. Use "
                    f"sharding='files' (the default), or order='plan'")
            if want % B:  # rocAL pads no shard when the largest is whole batches
                raise ValueError(f"make_rocal_loader(sharding='rocal'): rocAL would not pad shard {k} "
                                 f"({want} samples, batch {B}) and FILL would never deliver its last "
                                 f"{want % B}; use sharding='files' or another batch size")
        shards[k] = _shard_info(images, labels, start, stop, B, want // B, normalize)
    return dataclasses.replace(loader, folders={k: folders[k] for k in local}, shards=shards)


def _shard_info(images: np.ndarray, labels: np.ndarray, start: int, stop: int, batch_size: int,
                batches: int, normalize: Normalize) -> ShardInfo:
    """Shard [start, stop)'s last record normalised, and how many of its records
    normalise to the same image with the same label (found on the uint8 window:
    two pixel values are alike where the table maps them to the same float)."""
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
    """sharding="rocal": rocAL must read the same records in the same order as
    ``read_cifar10``: it matches ``prefix`` anywhere in a name (read_cifar10: at
    the start), lists files in readdir order (read_cifar10: sorted), and reads
    subfolders instead when the first name in sorted order is a folder."""
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
