"""NVIDIA DALI backend: the reference loader's sharded epochs, read and normalised by DALI.

One DALI ``Pipeline`` per local device and epoch. Pipeline k (k = its device's
position in the mesh, never ``device.id``) reads shard k's samples with DALI's
file reader from one raw file per sample (``sample_files``), reshapes the bytes
to the images' own (C, H, W), and runs DALI's ``crop_mirror_normalize`` to
float32 CHW. Its outputs become row block k of global ``jax.Array``s through
``loaders.global_batch``, in both layouts, as ``loaders.Loader`` gives them.

Stateless: ``epoch(e, start_step)`` builds its pipelines when its first step is
asked for (a build takes about 2 ms on CPU) and drops them when the iterator
ends, is closed or collected, or is left unfinished at the interpreter's exit
(``loaders.EpochIterator``: before modules are torn down, printing nothing).
What it yields is a function of (seed, e, start_step, shard) and the loader's
arguments, nothing else: epoch 3 read twice, by two loaders
built alike, in any order of calls, after any other epoch, gives the same
batches, and ``epoch(e, s)`` yields steps s.. of ``epoch(e)``.

Resuming from a saved ``plan.LoaderState`` (``epoch(e, state=saved)``,
``state``, ``real_samples``: ``loaders.Loader``'s signatures and meaning; every
state names this loader's data, ``dataset``, and a state naming other data is
refused, through ``plan.Schedule``, as the reference loader refuses it):

* order="plan", on any device or process count and batch size: with ``st =
  saved.resized(n, B)`` and ``plan, row = st.plan()`` (``plan.elastic_plan``'s
  last segment), pipeline k's reader gets the files of ``plan.indices[row:, k]``
  (padding slots included), and the iterator yields global steps ``st.step ..
  st.num_steps - 1`` with the plan's mask: the batches of ``loaders.make_loader(...)
  .epoch(e, state=saved)`` bit for bit. A resumed segment may hold what a fresh
  epoch never does (a batch larger than a shard's run, a shard whose run is empty
  and holds only padding, 0 steps under drop): the reader is fed those slots all
  the same, and a segment of 0 steps builds no pipeline.
* order="vendor": on the saved shards and batch only (``st`` has the one
  segment ``(0, n, B)``: then ``epoch(e, start_step=st.step)``, DALI's order
  reached by running and discarding). A state from another shard count or batch
  size, or from an epoch already resumed on other shards, is refused
  (ValueError): which samples the old shards delivered is decided by DALI's
  shuffle inside its readers, and DALI's own checkpoints restore one reader
  state per pipeline onto as many pipelines (``nvidia/dali/plugin/jax/
  iterator.py``, ``data_iterator``: "The number of checkpoints provided ...
  should match the number of devices to use"), so no reader over other shards
  can continue that order without repeating or missing samples.

``order`` says who orders the samples:

* ``"plan"`` (the default): pipeline k's reader gets the list of files
  ``plan.epoch_plan(...).indices[start_step:, k]`` (padding slots included)
  with their labels (``fn.readers.file(files=..., labels=...)``), DALI's own
  shuffle off and one shard: DALI's epoch is exactly ``(len() - start_step) * B``
  samples in the plan's order. DALI still reads every file and computes every
  pixel; the global batches equal ``loaders.make_loader(..., normalize=
  Normalize(arithmetic=<the devices' kind>))`` BIT FOR BIT, shuffled or not,
  fill or drop, both layouts, one or several processes. The mask is the plan's.
* ``"vendor"``: DALI's own order, as the notebook gets it (see DALI's departures
  below): shuffle off, DALI's sharding of one list (which is the plan's order,
  so the same bits as "plan"); shuffle on, one list per shard shuffled by DALI,
  seeded with ``SeedSequence([seed, epoch, k])``, a fresh pipeline per epoch,
  ``start_step`` reached by running and discarding. Guaranteed then: shard k
  holds ``[N*k//n, N*(k+1)//n)`` and no other sample; fill: every sample has
  exactly one mask-True slot per epoch, padding repeats the shard's last
  delivered sample; drop: no sample twice. Not the plan's: the order of the
  samples within each shard (conformance.describe_epoch names it "order").

Also guaranteed, in both orders: ``len()`` is ``plan.num_steps(N, n, B,
last_batch)``, the same on every shard; the mask is the plan's
(``plan.epoch_plan``); pixels are ``normalize.table``'s bit for bit.

Arithmetic per device kind (``arithmetic_for``): a pipeline computes its own
kernel's bits, so the Normalize passed in must name them, else ValueError:

* CPU devices, CPU pipelines: ``"dali_cpu"``, ``(float(x) - mean) * inv``,
  two float32 roundings (dali/kernels/slice/slice_flip_normalize_permute_pad_cpu.h);
  crop anchor ``std::round`` (half away from zero) of ``double(pos) * (W - cw)``.
  Run and checked here.
* NVIDIA GPUs, GPU pipelines: ``"dali_gpu"``, one ``fmaf(x, inv, add)`` with
  ``inv = 1/std`` and ``add = -(mean*inv)`` in float32, for every channel count.
  READ in DALI's source, not run here: for uint8 CHW input
  ``new_crop_mirror_normalize.cu`` (``GetImplementationKind``) takes the
  generic kernel; ``GetNormParameters`` there computes ``inv = scale/std`` in
  double and stores it as float (the same float as 1.0f/std: a double quotient
  rounded to float is the correctly rounded float quotient); ``SetupParams`` in
  ``dali/kernels/slice/slice_flip_normalize_gpu.cu`` sets ``norm_add = -mean *
  inv`` in float; ``SliceNormalizeKernel_2D_NoPad`` in
  ``slice_flip_normalize_gpu_impl.cuh`` computes ``fmaf(float(x), norm_mul,
  norm_add)``. The crop window comes from ``CropAttr::CalculateAnchor``
  (``dali/operators/image/crop/crop_attr.cc``), shared with the CPU operator:
  ``std::round(double(pos) * (W - cw))``, so the anchor is "dali_cpu"'s (checked
  against real DALI on CPU: pos 0.7 over a span of 5 gives 3, not a float32
  product's 3.5 -> 4).

Worked example, N=13, n=4, B=3, fill: shards {0,1,2} {3,4,5} {6,7,8} {9..12},
two steps per epoch. ``p`` is a sample of the shard in DALI's shuffled order,
``l`` the shard's last delivered sample, ``*`` a padding slot (mask False):

    reader                          | shard 0               | shard 3
    --------------------------------+-----------------------+-----------------------
    order="plan" (files=, in order) | the plan's 6 slots    | the plan's 6 slots
    DALI's sharding, no shuffle     | [0 1 2] [2* 2* 2*]    | [9 10 11] [12 12* 12*]
    DALI's sharding, shuffled       | {0 2 10}: not shard 0 | {4 8 9 12}: not shard 3
    one list per shard, shuffled    | [p p p] [l* l* l*] (a)| [p p p] [l l* l*]

    (a) DALI's epoch over shard 0's list is one batch; the second is filled here.

DALI's departures from the spec (loaders.py), and what this module does about
them (order="vendor" keeps DALI's ordering; order="plan" avoids all of them):

* ``random_shuffle`` with DALI's sharding first permutes the WHOLE file list
  with a fixed seed (524287), then cuts it into shards: shard k is a fixed
  scattered subset, not ``[N*k//n, N*(k+1)//n)``. Workaround: one file list per
  shard, read with ``num_shards=1``, ``random_shuffle=True`` and
  ``initial_fill`` = the shard's size. Within a list DALI shuffles in two
  stages: the same fixed permutation P of the list (seed 524287, whatever the
  pipeline's seed), then each sample drawn from a buffer of ``initial_fill``
  samples of P; with DALI's default 1024 an epoch's first batch comes from P's
  first 1024 + B samples, with the whole shard in the buffer from anywhere.
* Without ``stick_to_shard`` reader k reads shard (k+e) mod n in epoch e:
  ``stick_to_shard=True`` always.
* ``run()`` never signals the end of an epoch, and a reader cannot seek or
  rewind (``Pipeline.reset()`` does not rewind it): hence a fresh pipeline per
  ``epoch()`` call, run exactly as many times as the epoch needs.
* With one list per shard, shard k's DALI epoch has ``ceil(S_k/B)`` batches,
  one fewer than ``len()`` when ``S_k = floor(N/n)`` and ``ceil(N/n)`` needs
  one more batch: that step is filled here with B repeats of the shard's last
  delivered sample, mask False.
* FILL padding is not marked: ``pad_last_batch`` repeats the shard's last
  returned sample after all of its samples, exactly where the plan's mask is
  False, so the mask is the plan's, positionally.
* ``crop_mirror_normalize`` defaults to ``mirror=0``; here mirror is always
  passed explicitly (``int(normalize.mirror)``).

How the output reaches JAX (``to_jax``, one function for both kinds):

* Every pipeline output goes through DLPack: ``jax.dlpack.from_dlpack(
  tensor_list.as_tensor(), device=device, copy=...)``. DALI's ``TensorCPU`` has
  ``__dlpack__`` too, so CPU pipelines drive the very code GPU pipelines use.
* Copy or not is decided by ``Pipeline.exec_dynamic``, as DALI's own JAX plugin
  does (``plugin/jax/iterator.py``: ``_to_jax_array(..., not exec_dynamic)``):
  with the dynamic executor (the default in DALI 2.x when ``exec_async`` and
  ``exec_pipelined`` are on, as here) every output is a new buffer that DALI
  never writes again once handed out, so the array wraps it (no copy on the
  pipeline's own device); with ``exec_dynamic=False`` DALI recycles its output
  buffers, so ``to_jax`` copies. Both are shown on CPU pipelines in test_dali.py.
  Virtual CPU device k != 0 still costs one copy (DLPack names CPU device 0).
* NVIDIA GPUs: pipeline k runs on CUDA device ``device.local_hardware_id``;
  the uint8 images move to the GPU (``.gpu()``) before ``crop_mirror_normalize``.
  NOT RUN HERE (no GPU on the machine this was written on): test_dali.py's GPU
  test runs where JAX sees an NVIDIA GPU.
* DALI's ``data_iterator`` is not used: it builds pipeline i with
  ``device_id=i``, ``shard_id=device.id`` and ``num_shards=jax.device_count()``
  (device ids need not be 0..n-1: JAX issue 16024), takes the global batch size,
  and its sharding/devices modes need CUDA.

Caches, each keyed by everything that determines its bits: the per-sample files
(``sample_files``: the images' shape and bytes and the int32 labels, refused
outside int32) and, in that folder, the shard lists (``shard_list``: k and n). No
table or compiled step is cached here: DALI computes the pixels from the mean and
std it is given, and the spec's table is ``arithmetic.normalize_table`` (keyed by bit
patterns, so -0.0 is not 0.0; test_dali runs -0.0 after 0.0 through DALI).

Needs loaders.py and ``pip install -r requirements-dali.txt`` (imported lazily:
this module loads without DALI).
"""

from __future__ import annotations

import dataclasses
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
from arithmetic import Normalize
from cifar_mnist import TRAIN_PREFIX, read_cifar10
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
    """Platform "cuda", or "gpu" on a JAX built for CUDA (its client's ``platform_version``
    names CUDA). JAX calls ROCm devices platform "gpu" too, and nvidia.dali imports
    without CUDA, so neither the platform nor the import alone says NVIDIA."""
    if device.platform == "cuda":
        return True
    version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    return device.platform == "gpu" and "cuda" in version


def arithmetic_for(devices: Sequence[jax.Device] | Mesh) -> str:
    """The Normalize arithmetic DALI's pipelines compute on ``devices``: "dali_cpu" on
    CPU devices, "dali_gpu" on NVIDIA GPUs. ValueError for anything else (ROCm GPUs,
    TPUs, a mix), naming the platforms."""
    devices = list(devices.devices.flat) if isinstance(devices, Mesh) else list(devices)
    if devices and all(d.platform == "cpu" for d in devices):
        return "dali_cpu"
    if devices and all(is_nvidia_gpu(d) for d in devices):
        return "dali_gpu"
    kinds = sorted({f"{d.platform} ({getattr(getattr(d, 'client', None), 'platform_version', '?')})"
                    for d in devices})
    raise ValueError(f"DALI runs on CPU devices or NVIDIA GPUs, all of one kind; got {kinds or 'none'}")


def usable(devices: Sequence[jax.Device] | Mesh) -> bool:
    """What ``--backend auto`` asks: is every device an NVIDIA GPU, and does nvidia.dali import?"""
    devices = list(devices.devices.flat) if isinstance(devices, Mesh) else list(devices)
    if not devices or not all(is_nvidia_gpu(d) for d in devices):
        return False
    try:
        import_dali()
    except ImportError:
        return False
    return True


def to_jax(tensor_list, device: jax.Device, *, buffers_reused: bool) -> jax.Array:
    """One DALI output (a ``TensorListCPU`` or ``TensorListGPU`` of equal-shape samples)
    as a jax.Array on ``device``, through DLPack.

    ``buffers_reused``: whether DALI may write this output's memory again after
    handing it out (``not pipeline.exec_dynamic``); then the data is copied
    and the copy finished before this returns (DALI may write the buffer at its
    next run), else the array wraps DALI's buffer where it already lives on
    ``device`` and copies only to reach another device."""
    array = jax.dlpack.from_dlpack(tensor_list.as_tensor(), device=device, copy=None)
    if buffers_reused:
        # Not from_dlpack(copy=True): JAX 0.10.2 still wraps a CPU producer's buffer
        # then (pinned in test_dali.py). Copy explicitly, as DALI's own plugin does.
        array = jnp.array(array, copy=True).block_until_ready()
    return array


def sample_files(images_NCHW: np.ndarray, labels_N: np.ndarray, cache_dir: str | os.PathLike) -> str:
    """One raw file per sample (C*H*W bytes, lossless) and ``list.txt`` ("<name> <label>" lines).

    Sample i's file is ``sample_name(i, N)``. The folder is
    ``cache_dir/dali-samples-<N>x<C>x<H>x<W>-<hash>``, the hash taken over the
    shape, the image bytes and the int32 labels, so a changed dataset never
    reuses stale files and the same dataset is written once. It is written into
    a temporary folder and renamed: a reader never sees half of it, and a
    concurrent writer that renames first wins (its folder is used). Returns the
    folder. Raises ValueError for images that are not uint8 (N, C, H, W) or
    labels that are not N integers within int32 (as which they are stored).
    """
    images_NCHW, labels_N = np.ascontiguousarray(images_NCHW), np.asarray(labels_N)
    if images_NCHW.dtype != np.uint8 or images_NCHW.ndim != 4 or labels_N.shape != images_NCHW.shape[:1] \
            or not np.issubdtype(labels_N.dtype, np.integer):
        raise ValueError(f"sample_files: need uint8 images (N, C, H, W) and N integer labels, got "
                         f"images {images_NCHW.dtype} {images_NCHW.shape}, labels {labels_N.dtype} "
                         f"{labels_N.shape}")
    if labels_N.size and (labels_N.min() < np.iinfo(np.int32).min or labels_N.max() > np.iinfo(np.int32).max):
        bad = labels_N[(labels_N < np.iinfo(np.int32).min) | (labels_N > np.iinfo(np.int32).max)]
        raise ValueError(f"sample_files: labels outside int32, e.g. {bad[:3].tolist()}; they are stored "
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
    except OSError:
        shutil.rmtree(scratch, ignore_errors=True)
        if os.path.isfile(os.path.join(folder, LIST_NAME)):
            return folder  # another process renamed its copy first
        raise
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return folder


def sample_name(index: int, num_samples: int) -> str:
    """File name of sample ``index`` of ``num_samples`` in a ``sample_files`` folder."""
    return f"{index:0{max(6, len(str(num_samples - 1)))}d}.bin"


def shard_list(folder: str, shard_id: int, num_shards: int) -> str:
    """``folder/list-<k>-of-<n>.txt``: the lines of ``list.txt`` that belong to shard k,
    ``[N*k//n, N*(k+1)//n)``, written once, atomically. Returns its path."""
    path = os.path.join(folder, f"list-{shard_id}-of-{num_shards}.txt")
    if os.path.isfile(path):
        return path
    with open(os.path.join(folder, LIST_NAME)) as f:
        lines = f.readlines()
    start, stop = shard_bounds(len(lines), shard_id, num_shards)
    fd, scratch = tempfile.mkstemp(dir=folder, prefix=".list-writing-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("".join(lines[start:stop]))
        os.replace(scratch, path)
    except BaseException:
        os.unlink(scratch)
        raise
    return path


@dataclasses.dataclass(eq=False)
class DaliLoader:
    """Sharded epochs read by DALI; see the module docstring for what is guaranteed.

    Build it with ``make_dali_loader``. ``len()`` steps per epoch; ``epoch(e,
    start_step)`` yields steps ``start_step..len-1`` of epoch e as ``{"images"
    float32, "labels" int32, "mask" bool}`` global arrays in ``layout``, from
    pipelines built for that call alone, and ``epoch(e, state=saved)`` the rest
    of a saved epoch (the module docstring's "Resuming"); ``close()`` refuses
    further epochs.
    """
    spec: loaders.Loader  # the reference loader with the same arguments: the plan, the mesh
    order: str
    folder: str
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
        """The identity of this loader's data, its spec's (``loaders.Loader.dataset``):
        what every state names and is checked against, computed once."""
        return self.spec.dataset

    def __len__(self) -> int:
        return len(self.spec)

    def plan(self, epoch: int) -> Plan:
        return self.spec.plan(epoch)

    def real_samples(self, epoch: int, *, state: LoaderState | None = None) -> int:
        """How many mask-True slots ``epoch`` has in the whole global batch; with a
        ``state``, how many the steps ``epoch(epoch, state=state)`` yields have."""
        if state is not None:
            self._resumed("DaliLoader.real_samples", epoch, state)  # order="vendor" refuses a resize
        return self.spec.schedule.real_samples("DaliLoader.real_samples", epoch, state=state)

    def state(self, epoch: int, step: int = 0, *,
              state: LoaderState | None = None) -> LoaderState:
        """The ``plan.LoaderState`` to save after ``step`` steps of ``epoch``:
        ``loaders.Loader.state``'s meaning, range and refusals (without ``state``:
        of a fresh epoch on this loader's shards; with the ``state`` the epoch was
        resumed from: ``state.resized(n, B).at_step(step)``, step from its step on).
        order="vendor" refuses a ``state`` of other shards as ``epoch`` does."""
        if state is not None:
            self._resumed("DaliLoader.state", epoch, state)  # order="vendor" refuses a resize
        return self.spec.schedule.state("DaliLoader.state", epoch, step, state=state)

    def describe(self) -> str:
        if self.order == "plan":
            how = "each reader fed its shard's files in the plan's order"
        elif self.spec.shuffle:
            how = "DALI's order: one file list per shard, shuffled by DALI within the shard"
        else:
            how = "DALI's order: DALI's sharding of one file list"
        where = "GPU" if self.on_gpu else "CPU"
        return (f"NVIDIA DALI {dali_version()}: {len(loaders.local_positions(self.mesh))} "
                f"{where} pipeline(s) an epoch, one per local device, shard = mesh position; {how}; "
                f"files in {self.folder}")

    def epoch(self, epoch: int, start_step: int = 0, *,
              state: LoaderState | None = None) -> Iterator[dict[str, jax.Array]]:
        """With ``state`` (a saved ``plan.LoaderState`` of this run: the same data, seed,
        shuffle and last_batch), the rest of the epoch it was taken in, from its step
        (the module docstring's "Resuming"), and ``start_step`` must stay 0. Without
        it, steps ``start_step .. len-1`` of this loader's own fresh plan, a function
        of (seed, epoch, start_step, shard) alone: what another loader delivered there
        only if it had the same logical shards and batch_size (``loaders.Loader``'s
        last paragraph); after any other, resume from its state. Raises ValueError
        for an epoch outside [0, 2**32), a state of another run (num_samples,
        dataset, seed, shuffle, last_batch: named) or epoch, a start_step with a
        state, or (order="vendor") a state of other shards; IndexError for a
        start_step outside [0, len]; RuntimeError once closed."""
        if self.closed:
            raise RuntimeError("DaliLoader.epoch: the loader is closed")
        check_seed("epoch", epoch, "DaliLoader.epoch")
        if state is not None:
            st = self._resumed("DaliLoader.epoch", epoch, state)
            if start_step != 0:
                raise ValueError(f"DaliLoader.epoch: start_step={start_step!r} with a state; the state "
                                 f"says where the epoch resumes (step {state.step})")
            plan, row = st.plan()  # one segment (0, n, B): epoch_plan, row = step
            return loaders.EpochIterator(_steps(self, epoch, plan, row))
        if not 0 <= start_step <= len(self):
            raise IndexError(f"start_step={start_step} is outside [0, {len(self)}]")
        return loaders.EpochIterator(_steps(self, epoch, self.plan(epoch), start_step))

    def close(self) -> None:
        """No further epochs. Pipelines live only while an epoch's iterator does."""
        self.closed = True

    def _resumed(self, where: str, epoch: int, state) -> LoaderState:
        """``state`` checked against this run and ``epoch`` (as loaders.Loader checks
        it), resized to this loader's shards; order="vendor" refuses a resize."""
        st = self.spec.schedule.resumed(where, epoch, state)
        if self.order == "vendor" and len(st.segments) > 1:
            raise ValueError(
                f"{where}: order='vendor' resumes only on the shards and batch that wrote the state "
                f"(segments {[tuple(x) for x in state.segments]}; this loader: {self.num_shards} shards "
                f"x {self.spec.batch_size}): which samples the old shards delivered is DALI's shuffle inside "
                f"its readers, and DALI's checkpoints restore one reader state per pipeline onto as "
                f"many pipelines, so no reader over other shards continues that order exactly once. "
                f"Use order='plan' (plan.elastic_plan's order, on any shard count)")
        return st


# --------------------------------------------------------------------------
# Reading an epoch: the plan's order and DALI's own
# --------------------------------------------------------------------------


def _steps(loader: DaliLoader, epoch: int, plan: Plan, row: int):
    """The global batches of rows ``row ..`` of ``plan`` (a fresh epoch's or a
    resumed segment's)."""
    devices = list(loader.mesh.devices.flat)
    local = loaders.local_positions(loader.mesh)
    plan = on_devices(plan, loader.mesh.devices.size)  # device k's logical shards, one block
    make = _plan_blocks if loader.order == "plan" else _vendor_blocks
    shards = {k: make(loader, epoch, plan, k, devices[k], row) for k in local}
    try:
        for r in range(row, len(plan.indices)):
            blocks = {}
            for k, blocks_k in shards.items():
                images, labels = next(blocks_k)
                added = loaders.added_fields(plan.mask[r, k], plan.indices[r, k], k, loader.num_shards,
                                             loader.mesh.devices.size)
                if loader.order != "plan":  # DALI's own order: which sample a row holds is DALI's
                    del added[loaders.INDEX]
                blocks[k] = {"images": images, "labels": labels, **added}
            yield loaders.global_batch(blocks, loader.mesh, loader.spec.layout)
    finally:
        for blocks_k in shards.values():
            blocks_k.close()  # drops the pipeline now, not at garbage collection


def _plan_blocks(loader: DaliLoader, epoch: int, plan: Plan, k: int, device, row: int):
    """Shard k's (images, labels) per row ``row ..`` of ``plan``, read by DALI in
    that order (padding slots included)."""
    steps = len(plan.indices) - row
    if not steps:
        return
    indices = plan.indices[row:, k].reshape(-1)
    N = len(loader.spec.labels)
    reader = dict(files=[sample_name(i, N) for i in indices.tolist()],
                  labels=loader.spec.labels[indices].tolist(), shard_id=0, num_shards=1,
                  random_shuffle=False)
    pipe = _pipeline(loader, reader, device, seed=0)
    _check_size(pipe, k, (len(indices), len(indices)), "the plan's files")
    for _ in range(steps):
        yield _run(pipe, device)


def _vendor_blocks(loader: DaliLoader, epoch: int, plan: Plan, k: int, device, start_step: int):
    """Shard k's (images, labels) per step in DALI's own order, from step 0 of a
    fresh pipeline, the first ``start_step`` run and discarded."""
    n, N, B = loader.num_shards, len(loader.spec.labels), loader.spec.batch_size
    if loader.spec.shuffle:  # DALI's random_shuffle would cut a pre-permuted list: one list per shard
        start, stop = shard_bounds(N, k, n)
        reader = dict(file_list=shard_list(loader.folder, k, n), shard_id=0, num_shards=1,
                      random_shuffle=True, initial_fill=stop - start)
        expect = (stop - start, stop - start)
    else:
        reader = dict(file_list=os.path.join(loader.folder, LIST_NAME), shard_id=k, num_shards=n,
                      random_shuffle=False)
        expect = (N, -(-N // n))
    seed = int(np.random.SeedSequence([loader.spec.seed, epoch, k]).generate_state(1)[0])
    pipe = _pipeline(loader, reader, device, seed=seed)
    _check_size(pipe, k, expect, reader["file_list"])
    batches = -(-expect[1] // B)  # DALI's epoch; pad_last_batch ends it on a batch
    last = None
    for step in range(len(loader)):
        if step < batches:
            images, labels = _run(pipe, device)
            last = images[-1:], labels[-1:]
        else:  # one list per shard: this shard's DALI epoch is a batch short of the plan
            images, labels = jnp.repeat(last[0], B, axis=0), np.repeat(last[1], B, axis=0)
        if step >= start_step:
            yield images, labels


def _pipeline(loader: DaliLoader, reader: dict, device, *, seed: int):
    return dali_pipeline(loader.folder, reader, device, loader.spec.images.shape[1:],
                         loader.spec.normalize, loader.spec.device_rows, seed=seed,
                         num_threads=loader.num_threads)


def _check_size(pipe, k: int, expect: tuple[int, int], source: str) -> None:
    meta = pipe.reader_meta(READER)
    got = (meta["epoch_size"], meta["epoch_size_padded"] // meta["number_of_shards"])
    if got != expect:
        raise RuntimeError(f"DALI's reader of shard {k} sees {got[0]} samples, {got[1]} per shard "
                           f"(reader_meta {meta}); expected {expect} from {source}")


def _run(pipe, device):
    images, labels = pipe.run()
    labels = labels.as_array().reshape(-1).astype(np.int32, copy=False)
    return to_jax(images, device, buffers_reused=not pipe.exec_dynamic), labels


def make_dali_loader(data, devices: Sequence[jax.Device] | Mesh, batch_size: int, *,
                     layout: str = "sharded", filename_prefix: str = TRAIN_PREFIX,
                     shuffle: bool = False, seed: int = 0, last_batch: str = "fill",
                     normalize: Normalize | None = None, order: str = "plan",
                     cache_dir: str | os.PathLike | None = None, num_threads: int = 1,
                     logical_shards: int | None = None) -> DaliLoader:
    """A ``DaliLoader`` over ``data``: a CIFAR-10 folder (read with ``filename_prefix``) or an
    ``(images_NCHW uint8, labels_N)`` pair (MNIST's (N, 1, 28, 28) too). ``batch_size`` is
    per device; shard k goes to ``devices[k]`` (or mesh position k). ``normalize``
    defaults to ``Normalize(arithmetic=arithmetic_for(devices))`` (mean = std = 127.5).
    ``order``: "plan" or "vendor" (module docstring). The per-sample files go under
    ``cache_dir`` (default ~/.cache/refimpl). ``logical_shards``: as
    ``loaders.make_loader``'s (order="plan" only): reader k reads its device's
    logical shards' blocks, (L/n)*B samples a step.

    Raises ImportError (how to install DALI) without nvidia.dali; ValueError for
    everything ``loaders.make_loader`` refuses (a batch larger than the smallest
    shard, more devices than samples, an unknown layout or policy, ...), devices
    that are neither all CPU nor all NVIDIA GPUs, a normalize that is not a
    ``Normalize`` with the devices' arithmetic ("dali_cpu" on CPU, "dali_gpu" on
    NVIDIA GPUs), an unknown order, or num_threads < 1.
    """
    arithmetic = arithmetic_for(devices)  # before anything else: a ROCm GPU is refused by name
    mesh = loaders.data_mesh(devices)
    if normalize is None:
        normalize = Normalize(arithmetic=arithmetic)
    if not isinstance(normalize, Normalize) or normalize.arithmetic != arithmetic:
        got = getattr(normalize, "arithmetic", type(normalize).__name__)
        raise ValueError(f"make_dali_loader: normalize={normalize!r} (arithmetic={got!r}): DALI's "
                         f"pipelines on {mesh.devices.flat[0].platform} devices compute "
                         f"arithmetic={arithmetic!r}; pass arithmetic.Normalize(..., "
                         f"arithmetic={arithmetic!r}), the spec of their bits")
    if order not in ORDERS:
        raise ValueError(f"make_dali_loader: order must be one of {ORDERS}, got {order!r}")
    if num_threads < 1:
        raise ValueError(f"make_dali_loader: num_threads must be >= 1, got {num_threads}")
    if order == "vendor" and logical_shards not in (None, mesh.devices.size):
        raise ValueError(f"make_dali_loader: logical_shards={logical_shards!r} with order='vendor': "
                         f"DALI's own sharding is one shard a device; use order='plan'")
    import_dali()  # how to install it, before any data is read
    if isinstance(data, (str, os.PathLike)):
        data = read_cifar10(data, filename_prefix)
    # The reference loader checks every argument as make_loader does, and is the
    # plan the DALI epochs are held to. It does no device work.
    spec = loaders.make_loader(data, mesh, batch_size, layout=layout, shuffle=shuffle, seed=seed,
                               last_batch=last_batch, normalize=normalize, prefetch=0,
                               logical_shards=logical_shards)
    folder = sample_files(spec.images, spec.labels, cache_dir if cache_dir is not None else DEFAULT_CACHE)
    return DaliLoader(spec, order, folder, num_threads)


def dali_pipeline(folder: str, reader: dict, device: jax.Device, image_shape: tuple[int, int, int],
                  normalize: Normalize, batch_size: int, *, seed: int, num_threads: int = 1):
    """A built DALI Pipeline: ``fn.readers.file(file_root=folder, **reader)`` with
    stick_to_shard and pad_last_batch, the raw bytes reshaped to ``image_shape`` (C, H, W),
    then crop_mirror_normalize to float32 CHW; outputs (images, labels). CPU-only for a CPU
    ``device``; on an NVIDIA GPU, CUDA device ``local_hardware_id`` and the normalisation
    there. DALI's default executor (``exec_dynamic`` on)."""
    Pipeline, fn, types = import_dali()
    on_gpu = device.platform != "cpu"
    pipe = Pipeline(batch_size=batch_size, num_threads=num_threads, seed=seed,
                    device_id=device.local_hardware_id if on_gpu else None)
    with pipe:
        raw, labels = fn.readers.file(file_root=folder, stick_to_shard=True, pad_last_batch=True,
                                      name=READER, **reader)
        chw = fn.reshape(raw, shape=list(image_shape), layout="CHW")
        if on_gpu:
            chw = chw.gpu()
        out = fn.crop_mirror_normalize(
            chw, dtype=types.FLOAT, output_layout="CHW",
            crop=list(normalize.crop or image_shape[1:]),  # (height, width)
            crop_pos_x=normalize.crop_pos[1], crop_pos_y=normalize.crop_pos[0],
            mirror=int(normalize.mirror),  # explicit, whatever DALI's default
            mean=list(normalize.mean), std=list(normalize.std))
        pipe.set_outputs(out, labels)
    pipe.build()
    return pipe
