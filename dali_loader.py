"""NVIDIA DALI backend: the reference loader's sharded epochs, read and normalised by DALI.

One DALI ``Pipeline`` per local device. Pipeline k (k = its device's position in
the mesh, never ``device.id``) reads shard k of n with DALI's file reader from
one raw file per sample (``sample_files``), reshapes the bytes to the images'
own (C, H, W), and runs DALI's ``crop_mirror_normalize`` to float32 NCHW. Its
outputs become row block k of global ``jax.Array``s through
``loaders.global_batch``, in both layouts, as ``loaders.Loader`` gives them.

Guaranteed (each is checked against real DALI in test_dali.py):

* ``len()`` is the reference's step count, ``loaders.num_steps(N, n, B,
  last_batch)``, the same on every shard, and ``epoch(e)`` yields exactly that
  many steps.
* Shard k holds the samples ``[N*k//n, N*(k+1)//n)`` and no other, shuffled or
  not. fill: every sample has exactly one mask-True slot per epoch; drop: no
  sample twice, all slots True. The mask is the plan's (``loaders.epoch_plan``).
* Shuffle off: the global arrays are bit for bit those of ``loaders.make_loader(
  ..., normalize=Normalize(arithmetic="dali_cpu"))``, images, labels and mask.
* Shuffle on: each shard's real slots are a permutation of that shard, the
  padding repeats the shard's last delivered sample, and the order is a function
  of (seed, shard, how many epochs this loader has read).
* Pixels are ``Normalize(arithmetic="dali_cpu")``'s table bit for bit: that table
  is the specification of DALI's arithmetic, ``(x - mean) * (1 / std)`` in
  float32 with two roundings, crop anchors rounded half away from zero.

Worked example, N=13, n=4, B=3, fill: shards {0,1,2} {3,4,5} {6,7,8} {9..12},
two steps per epoch. ``p`` is a sample of the shard in DALI's shuffled order,
``l`` the shard's last delivered sample, ``*`` a padding slot (mask False):

    reader                       | shard 0               | shard 3
    -----------------------------+-----------------------+-----------------------
    DALI's sharding, no shuffle  | [0 1 2] [2* 2* 2*]    | [9 10 11] [12 12* 12*]
    DALI's sharding, shuffled    | {0 2 10}: not shard 0 | {4 8 9 12}: not shard 3
    one list per shard, shuffled | [p p p] [l* l* l*] (a)| [p p p] [l l* l*]

    (a) DALI's epoch over shard 0's list is one batch; the second is filled here.

DALI's departures from the spec (loaders.py), and what this module does:

* ``random_shuffle`` with DALI's sharding first permutes the WHOLE file list
  with a fixed seed (524287), then cuts it into shards: shard k is a fixed
  scattered subset, not ``[N*k//n, N*(k+1)//n)``. Workaround: with shuffle on,
  one file list per shard (only shard k's samples), read with ``num_shards=1``,
  ``random_shuffle=True`` and ``initial_fill`` = the shard's size (DALI's
  default 1024-sample buffer would only shuffle locally within the fixed
  pre-permutation), seeded from ``SeedSequence([seed, k])``. DALI's seed does
  change the order (the pre-permutation aside). With shuffle off, DALI's own
  sharding of one list is already the plan's partition and order.
* Without ``stick_to_shard`` reader k reads shard (k+e) mod n in epoch e:
  ``stick_to_shard=True`` always.
* ``run()`` never signals the end of an epoch: reading goes on into the next
  one. Each pipeline's epoch is ``ceil(epoch_size_padded / number_of_shards /
  B)`` batches (``reader_meta``, ``pad_last_batch=True``, so an epoch ends on a
  batch boundary); ``epoch`` yields ``len()`` steps, then runs and discards the
  rest of each pipeline's epoch (drop), and an epoch left early is finished the
  same way when the next one starts.
* With one list per shard, shard k's DALI epoch has ``ceil(S_k/B)`` batches,
  one fewer than ``len()`` when ``S_k = floor(N/n)`` and ``ceil(N/n)`` needs one
  more batch (N=13, n=4, B=3: shard 0 has 3 samples, one batch; the plan has 2
  steps). That missing step is filled here: B repeats of the shard's last
  delivered sample, mask False.
* FILL padding is not marked: ``pad_last_batch`` repeats the shard's last
  returned sample after all of its samples. Since the padding sits exactly where
  the plan's mask is False, the mask is the plan's, positionally.
* A DALI reader cannot seek or rewind (``Pipeline.reset()`` does not rewind a
  reader): ``epoch(e)`` yields DALI's next epoch, ``e`` only has to be >= 0,
  and ``start_step`` must be 0.
* ``crop_mirror_normalize`` defaults to ``mirror=0``; here mirror is always
  passed explicitly (``int(normalize.mirror)``). Only ``arithmetic="dali_cpu"`` is
  accepted: DALI computes DALI's arithmetic.

How the output reaches JAX:

* CPU devices: CPU-only pipelines (``device_id=None``); ``as_array()`` copies
  each output into NumPy, and ``loaders.global_batch`` places block k on
  device k.
* NVIDIA GPUs (platform "gpu"/"cuda"): pipeline k runs on CUDA device
  ``device.local_hardware_id``; the uint8 images move to the GPU (``.gpu()``)
  before ``crop_mirror_normalize``, and the output tensor becomes a jax.Array on
  device k with ``jax.dlpack.from_dlpack(tensor_list.as_tensor(), device=device,
  copy=True)``, as DALI's own JAX plugin does (``plugin/jax/integration.py``)
  but with a copy: DALI reuses an output buffer once it is released, and that
  a zero-copy import keeps it alive was only seen on CPU. ``run()`` without a
  stream returns host-synchronous outputs. NOT VERIFIED: written against DALI
  2.4.0's API on a machine without a GPU; test_dali.py has a GPU test that
  runs where JAX sees an NVIDIA GPU.
* DALI's ``data_iterator`` is not used: it builds pipeline i with
  ``device_id=i``, ``shard_id=device.id`` and ``num_shards=jax.device_count()``
  (device ids need not be 0..n-1: JAX issue 16024), takes the global batch size,
  and its sharding/devices modes need CUDA.

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
from jax.sharding import Mesh

import loaders

INSTALL_HINT = ("the DALI backend needs NVIDIA DALI: pip install -r requirements-dali.txt "
                "(it installs nvidia-dali-cuda130; on CUDA 12 hosts install nvidia-dali-cuda120)")
NVIDIA_PLATFORMS = ("gpu", "cuda")
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


def usable(devices: Sequence[jax.Device] | Mesh) -> bool:
    """What ``--backend auto`` asks: is every device an NVIDIA GPU, and does nvidia.dali import?"""
    devices = list(devices.devices.flat) if isinstance(devices, Mesh) else list(devices)
    if not devices or any(d.platform not in NVIDIA_PLATFORMS for d in devices):
        return False
    try:
        import_dali()
    except ImportError:
        return False
    return True


def sample_files(images_NCHW: np.ndarray, labels_N: np.ndarray, cache_dir: str | os.PathLike) -> str:
    """One raw file per sample (C*H*W bytes, lossless) and ``list.txt`` ("<name> <label>" lines).

    The folder is ``cache_dir/dali-samples-<N>x<C>x<H>x<W>-<hash>``, the hash
    taken over the shape, the image bytes and the int32 labels, so a changed
    dataset never reuses stale files and the same dataset is written once. It is
    written into a temporary folder and renamed: a reader never sees half of it,
    and a concurrent writer that renames first wins (its folder is used). Returns
    the folder. Raises ValueError for images that are not uint8 (N, C, H, W) or
    labels that are not N integers.
    """
    images_NCHW, labels_N = np.ascontiguousarray(images_NCHW), np.asarray(labels_N)
    if images_NCHW.dtype != np.uint8 or images_NCHW.ndim != 4 or labels_N.shape != images_NCHW.shape[:1] \
            or not np.issubdtype(labels_N.dtype, np.integer):
        raise ValueError(f"sample_files: need uint8 images (N, C, H, W) and N integer labels, got "
                         f"images {images_NCHW.dtype} {images_NCHW.shape}, labels {labels_N.dtype} "
                         f"{labels_N.shape}")
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
        width = max(6, len(str(len(labels_N) - 1)))
        lines = []
        for i, label in enumerate(labels_N.tolist()):
            name = f"{i:0{width}d}.bin"
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


def shard_list(folder: str, shard_id: int, num_shards: int) -> str:
    """``folder/list-<k>-of-<n>.txt``: the lines of ``list.txt`` that belong to shard k,
    ``[N*k//n, N*(k+1)//n)``, written once, atomically. Returns its path."""
    path = os.path.join(folder, f"list-{shard_id}-of-{num_shards}.txt")
    if os.path.isfile(path):
        return path
    with open(os.path.join(folder, LIST_NAME)) as f:
        lines = f.readlines()
    start, stop = loaders.shard_bounds(len(lines), shard_id, num_shards)
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

    Build it with ``make_dali_loader``. ``len()`` steps per epoch; ``epoch(e)``
    yields DALI's next epoch as ``{"images" float32, "labels" int32, "mask"
    bool}`` global arrays in ``layout``; ``close()`` releases the pipelines.
    """
    pipelines: dict[int, object]  # mesh position -> built DALI Pipeline, local devices only
    mesh: Mesh
    batch_size: int
    num_samples: int
    layout: str
    last_batch: str
    shuffle: bool
    folder: str
    mask: np.ndarray = dataclasses.field(repr=False)  # (steps, n, B): the plan's
    batches: dict[int, int] = dataclasses.field(default_factory=dict)  # DALI epoch length per pipeline
    positions: dict[int, int] = dataclasses.field(default_factory=dict)  # batches run in its DALI epoch

    @property
    def num_shards(self) -> int:
        return self.mesh.devices.size

    @property
    def on_gpu(self) -> bool:
        return self.mesh.devices.flat[0].platform in NVIDIA_PLATFORMS

    def __len__(self) -> int:
        return loaders.num_steps(self.num_samples, self.num_shards, self.batch_size, self.last_batch)

    def real_samples(self, epoch: int) -> int:
        """How many mask-True slots each epoch has in the whole global batch."""
        return int(self.mask.sum())

    def describe(self) -> str:
        import nvidia.dali
        sharding = ("one file list per shard, shuffled by DALI within the shard" if self.shuffle
                    else "DALI's sharding of one file list")
        where = "GPU" if self.on_gpu else "CPU"
        return (f"NVIDIA DALI {nvidia.dali.__version__}: {len(self.pipelines)} {where} pipeline(s), "
                f"one per local device, shard = mesh position; {sharding}; files in {self.folder}")

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, jax.Array]]:
        """DALI's next epoch, ``len()`` steps; ``epoch`` only has to be >= 0."""
        if epoch < 0 or start_step != 0:
            raise ValueError(f"the DALI backend yields whole epochs in order: got epoch={epoch}, "
                             f"start_step={start_step} (DALI pipelines cannot seek; start_step must be 0)")
        if not self.pipelines:
            raise RuntimeError("DaliLoader.epoch: the loader is closed")
        return self._steps()

    def close(self) -> None:
        """Drops the pipelines (DALI shuts one down when its last reference goes); unusable after."""
        self.pipelines.clear()

    def _steps(self):
        self._to_boundary()  # an epoch left early is finished first
        devices = list(self.mesh.devices.flat)
        last = {}
        for step in range(len(self)):
            blocks = {}
            for k in self.pipelines:
                if self.positions[k] < self.batches[k]:
                    images, labels = self._run(k, devices[k])
                    last[k] = images[-1:], labels[-1:]
                else:  # one list per shard: this shard's DALI epoch is a batch short of the plan
                    images, labels = (x.repeat(self.batch_size, axis=0) for x in last[k])
                blocks[k] = {"images": images, "labels": labels, "mask": self.mask[step, k]}
            yield loaders.global_batch(blocks, self.mesh, self.layout)
        self._to_boundary()

    def _run(self, k: int, device: jax.Device):
        images, labels = self.pipelines[k].run()
        self.positions[k] += 1
        labels = labels.as_array().reshape(-1).astype(np.int32, copy=False)
        if self.on_gpu:  # not verified here: see the module docstring
            return jax.dlpack.from_dlpack(images.as_tensor(), device=device, copy=True), labels
        return images.as_array(), labels

    def _to_boundary(self) -> None:
        """Runs and discards the rest of each pipeline's DALI epoch."""
        for k, pipe in self.pipelines.items():
            while self.positions[k] < self.batches[k]:
                pipe.run()
                self.positions[k] += 1
            self.positions[k] = 0


def make_dali_loader(data, devices: Sequence[jax.Device] | Mesh, batch_size: int, *,
                     layout: str = "sharded", filename_prefix: str = loaders.TRAIN_PREFIX,
                     shuffle: bool = False, seed: int = 0, last_batch: str = "fill",
                     normalize: loaders.Normalize = loaders.Normalize(arithmetic="dali_cpu"),
                     cache_dir: str | os.PathLike | None = None, num_threads: int = 1) -> DaliLoader:
    """A ``DaliLoader`` over ``data``: a CIFAR-10 folder (read with ``filename_prefix``) or an
    ``(images_NCHW uint8, labels_N)`` pair (MNIST's (N, 1, 28, 28) too). ``batch_size`` is
    per device; shard k goes to ``devices[k]`` (or mesh position k). The per-sample files go
    under ``cache_dir`` (default ~/.cache/refimpl).

    Raises ImportError (how to install DALI) without nvidia.dali; ValueError for
    everything ``loaders.make_loader`` refuses (a batch larger than the smallest
    shard, more devices than samples, an unknown layout or policy, ...), a
    normalize that is not ``Normalize(arithmetic="dali_cpu")``, num_threads < 1, or
    devices that are neither all CPU nor all NVIDIA GPUs.
    """
    if not isinstance(normalize, loaders.Normalize) or normalize.arithmetic != "dali_cpu":
        raise ValueError(f"make_dali_loader: normalize={normalize!r}: DALI computes DALI's arithmetic; "
                         f"pass loaders.Normalize(..., arithmetic='dali_cpu'), the spec of its bits")
    if num_threads < 1:
        raise ValueError(f"make_dali_loader: num_threads must be >= 1, got {num_threads}")
    import_dali()  # how to install it, before any data is read
    if isinstance(data, (str, os.PathLike)):
        data = loaders.read_cifar10(data, filename_prefix)
    # The reference loader checks every argument as make_loader does, and is the
    # plan the DALI epochs are held to (its mask). It does no device work.
    spec = loaders.make_loader(data, devices, batch_size, layout=layout, shuffle=shuffle, seed=seed,
                               last_batch=last_batch, normalize=normalize, prefetch=0)
    mesh, images = spec.mesh, spec.images
    device_list = list(mesh.devices.flat)
    platforms = {d.platform for d in device_list}
    if not (platforms == {"cpu"} or platforms <= set(NVIDIA_PLATFORMS)):
        raise ValueError(f"make_dali_loader: DALI runs on CPU devices or NVIDIA GPUs, got "
                         f"platform(s) {sorted(platforms)}")
    folder = sample_files(images, spec.labels, cache_dir if cache_dir is not None else DEFAULT_CACHE)
    n, N = len(device_list), len(spec.labels)
    pipelines, batches = {}, {}
    for k in loaders.local_positions(mesh):
        if shuffle:  # DALI's random_shuffle would cut a pre-permuted list: one list per shard
            start, stop = loaders.shard_bounds(N, k, n)
            reader = dict(file_list=shard_list(folder, k, n), shard_id=0, num_shards=1,
                          random_shuffle=True, initial_fill=stop - start)
            expect = (stop - start, stop - start)
        else:
            reader = dict(file_list=os.path.join(folder, LIST_NAME), shard_id=k, num_shards=n,
                          random_shuffle=False)
            expect = (N, -(-N // n))
        pipe = dali_pipeline(folder, reader, device_list[k], images.shape[1:], normalize, batch_size,
                             seed=int(np.random.SeedSequence([seed, k]).generate_state(1)[0]),
                             num_threads=num_threads)
        meta = pipe.reader_meta(READER)
        got = (meta["epoch_size"], meta["epoch_size_padded"] // meta["number_of_shards"])
        if got != expect:
            raise RuntimeError(f"DALI's reader of shard {k} sees {got[0]} samples, {got[1]} per shard "
                               f"(reader_meta {meta}); expected {expect} from {reader['file_list']}")
        # DALI's epoch: ceil(padded size / shards / B) batches; pad_last_batch ends it on a batch.
        pipelines[k], batches[k] = pipe, -(-got[1] // batch_size)
    return DaliLoader(pipelines, mesh, batch_size, N, layout, last_batch, shuffle, folder,
                      spec.plan(0).mask, batches, {k: 0 for k in pipelines})


def dali_pipeline(folder: str, reader: dict, device: jax.Device, image_shape: tuple[int, int, int],
                  normalize: loaders.Normalize, batch_size: int, *, seed: int, num_threads: int = 1):
    """A built DALI Pipeline: ``fn.readers.file(file_root=folder, **reader)`` with
    stick_to_shard and pad_last_batch, the raw bytes reshaped to ``image_shape`` (C, H, W),
    then crop_mirror_normalize to float32 CHW; outputs (images, labels). CPU-only for a CPU
    ``device``; on an NVIDIA GPU, CUDA device ``local_hardware_id`` and the normalisation
    there."""
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
