"""Sharded CIFAR-10 loaders for data-parallel JAX: one shard per device.

This module is the data half of the reference. It is pure NumPy plus JAX and
stands on its own (copy it into another project as it is).

The contract, in the order the pieces are used:

* ``read_cifar10`` reads the CIFAR-10 "binary version" (3073-byte records: one
  label byte 0..9, then the R, G, B planes of 32x32, row-major).
* ``shard_bounds`` partitions ``range(N)`` into ``n`` contiguous shards: shard k
  is ``[N*k//n, N*(k+1)//n)``, the partition rocAL and DALI use. Shard sizes
  differ by at most one.
* ``epoch_plan`` turns (N, n, B, epoch, seed, shuffle, last_batch) into the whole
  epoch as data: which sample sits in which slot of which device's batch at which
  step, and whether that slot is real (mask True) or padding (mask False).
  Batches are therefore a pure function of (seed, epoch, step, shard): resuming
  mid-epoch needs the step number and nothing else.
* ``crop_mirror_normalize`` is rocAL's per-image arithmetic in NumPy.
* ``make_loader`` puts it together: one loader for a set of devices whose epoch
  iterator yields ``{"images", "labels", "mask"}`` as global ``jax.Array``s,
  row block k on the device at position k of the mesh.
* ``make_loader(..., backend="rocal")`` builds the same global batches from AMD
  rocAL pipelines instead (end of module: what that backend does and does not
  guarantee).

Remainder handling, worked (DALI's LastBatchPolicy table, for shards). Data is
samples 0..6 (N=7), two shards (n=2), per-device batch B=2, no shuffle.
Shard 0 is [0, 3) = {0, 1, 2}; shard 1 is [3, 7) = {3, 4, 5, 6}.
``*`` marks a padding slot (mask False) that repeats the shard's last sample:

    policy | steps                 | step 0 (shard 0, 1) | step 1 (shard 0, 1)
    -------+-----------------------+---------------------+--------------------
    fill   | ceil(ceil(7/2)/2) = 2 | [0, 1]  [3, 4]      | [2, 2*]  [5, 6]
    drop   | (7//2)//2 = 1         | [0, 1]  [3, 4]      | (none: 2, 5, 6 skipped)

Guarantees (each is tested in test_loaders.py):

* Every shard runs the same number of steps in an epoch (SPMD collectives need
  it: a device with one step fewer would hang the others).
* fill: over one epoch every sample of range(N) has exactly one mask-True slot.
  Padding slots repeat a real sample of the same shard and are masked False, so a
  masked loss or accuracy counts each sample exactly once (rocAL's and DALI's
  FILL repeat samples but do not say which slots are padding).
* drop: every sample appears at most once and exactly ``n * steps * B`` appear.
* shuffle: each shard's order is a permutation of that shard, a deterministic
  function of (seed, epoch, shard) alone, computed from NumPy's PCG64 raw bit
  stream and SeedSequence (both specified bit for bit, so stable across NumPy
  versions). Seeds are mixed by SeedSequence, never added: (seed 1, epoch 0) and
  (seed 0, epoch 1) give unrelated orders. Shards never exchange samples
  (rocAL's and DALI's ``stick_to_shard`` behaviour).

Deliberate differences from rocAL and DALI, and why:

* Files are read in sorted name order. rocAL lists a folder in raw ``readdir``
  order, which depends on the filesystem, so the same folder can give a different
  sample order on another machine.
* Shuffle honours ``seed`` and changes every epoch. rocAL seeds its shuffle with
  the shard index alone; DALI pre-permutes with a fixed seed.
* A crop larger than the image is an error here; rocAL silently clamps it.
* The shard of a device is its position in the mesh, never ``device.id``
  (device ids need not be 0..n-1; see JAX issue 16024).

Supported: JAX 0.7 or newer (``jax.shard_map`` at top level, ``jax.make_mesh``
with ``devices=`` and ``AxisType``); the whole suite was run on 0.7.0 and 0.10.2.
NumPy >= 1.25.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import tempfile
import threading
from typing import Iterator, NamedTuple, Sequence

import numpy as np
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

RECORD_BYTES = 3073
IMAGE_SHAPE = (3, 32, 32)
NUM_CLASSES = 10
TRAIN_PREFIX = "data_batch_"
TEST_PREFIX = "test_batch"
DATA_AXIS = "data"
LAST_BATCH_POLICIES = ("fill", "drop")
LAYOUTS = ("sharded", "pmap")


# --------------------------------------------------------------------------
# Reading and writing the CIFAR-10 binary format
# --------------------------------------------------------------------------


def read_cifar10(file_root: str | os.PathLike, filename_prefix: str = TRAIN_PREFIX):
    """Reads every file in ``file_root`` whose name starts with ``filename_prefix``.

    Files are read in sorted name order, so the sample order is the same on every
    filesystem. Returns ``(images_NCHW, labels_N)``: uint8 (N, 3, 32, 32) and
    int32 (N,). With one matching file the images are a read-only view of a
    memory map (no copy); with several they are one in-memory copy, never more.

    Raises FileNotFoundError (folder missing, no matching file) or ValueError (a
    file whose size is not a whole number of 3073-byte records, a label > 9, no
    records at all); each message names the file and the offending value.
    """
    root = os.fspath(file_root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"read_cifar10: file_root={root!r} is not a directory")
    names = sorted(
        name for name in os.listdir(root)
        if name.startswith(filename_prefix) and os.path.isfile(os.path.join(root, name))
    )
    if not names:
        raise FileNotFoundError(
            f"read_cifar10: no file in {root!r} starts with filename_prefix={filename_prefix!r}"
        )
    counts = {}
    for name in names:
        path = os.path.join(root, name)
        size = os.path.getsize(path)
        if size % RECORD_BYTES:
            raise ValueError(
                f"{path}: size {size} bytes is not a multiple of the {RECORD_BYTES}-byte "
                f"CIFAR-10 record ({size % RECORD_BYTES} bytes left over: truncated or not CIFAR-10)"
            )
        if size:  # np.memmap cannot map an empty file; it holds no record anyway.
            counts[name] = size // RECORD_BYTES
    if not counts:
        raise ValueError(
            f"read_cifar10: the files matching {filename_prefix!r} in {root!r} hold no record "
            f"(all empty: {names})"
        )
    if len(counts) == 1:
        rows = np.memmap(os.path.join(root, *counts), dtype=np.uint8, mode="r").reshape(-1, RECORD_BYTES)
    else:
        # Read into one array, file by file. Concatenating memory maps would hold
        # every file's mapped pages and the copy at once: twice the dataset.
        rows = np.empty((sum(counts.values()), RECORD_BYTES), np.uint8)
        start = 0
        for name, count in counts.items():
            with open(os.path.join(root, name), "rb") as f:
                f.readinto(memoryview(rows[start:start + count]).cast("B"))
            start += count
    start = 0
    for name, count in counts.items():
        bad = np.flatnonzero(rows[start:start + count, 0] >= NUM_CLASSES)
        if bad.size:
            raise ValueError(f"{os.path.join(root, name)}: record {bad[0]} has label "
                             f"{rows[start + bad[0], 0]}; CIFAR-10 labels are 0..9")
        start += count
    images = rows[:, 1:].reshape((-1,) + IMAGE_SHAPE)
    labels = rows[:, 0].astype(np.int32)
    return images, labels


def write_cifar10(path: str | os.PathLike, images_NCHW: np.ndarray, labels_N: np.ndarray) -> None:
    """Writes one CIFAR-10 binary file, atomically (a reader never sees half a file).

    ``images_NCHW`` must be uint8 (N, 3, 32, 32) and ``labels_N`` integers 0..9.
    """
    path = os.fspath(path)
    images_NCHW = np.asarray(images_NCHW)
    labels_N = np.asarray(labels_N)
    if images_NCHW.dtype != np.uint8 or images_NCHW.shape[1:] != IMAGE_SHAPE:
        raise ValueError(
            f"write_cifar10({path!r}): images must be uint8 (N, 3, 32, 32), "
            f"got {images_NCHW.dtype} {images_NCHW.shape}"
        )
    if labels_N.shape != images_NCHW.shape[:1]:
        raise ValueError(
            f"write_cifar10({path!r}): labels shape {labels_N.shape} does not match "
            f"{images_NCHW.shape[0]} images"
        )
    if labels_N.size and (labels_N.min() < 0 or labels_N.max() >= NUM_CLASSES):
        raise ValueError(
            f"write_cifar10({path!r}): labels must be 0..9, got range "
            f"[{labels_N.min()}, {labels_N.max()}]"
        )
    rows = np.empty((len(labels_N), RECORD_BYTES), np.uint8)
    rows[:, 0] = labels_N
    rows[:, 1:] = images_NCHW.reshape(len(labels_N), RECORD_BYTES - 1)  # not -1: N may be 0
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(rows.tobytes())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def synthetic_cifar10(root: str | os.PathLike, *, num_train: int = 50_000,
                      num_test: int = 10_000, seed: int = 0) -> str:
    """Writes a CIFAR-10-format folder: data_batch_1..5.bin and test_batch.bin.

    Each class has a fixed random low-frequency colour pattern; an image is its
    class pattern at a random contrast, shifted by a random brightness, plus
    strong per-pixel noise. Classes are learnable by the seed MLP but not
    separable at a glance (accuracy climbs over several epochs, as with real
    data). The bytes are a function of (num_train, num_test, seed) alone.
    Returns ``root``.
    """
    for name, value in (("num_train", num_train), ("num_test", num_test)):
        if value < 0:
            raise ValueError(f"synthetic_cifar10: {name} must be >= 0, got {value}")
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0xC1FA])))
    coarse = rng.normal(size=(NUM_CLASSES, 3, 4, 4))
    patterns = np.repeat(np.repeat(coarse, 8, axis=2), 8, axis=3)  # (10, 3, 32, 32)

    def draw(count: int):
        labels = rng.integers(0, NUM_CLASSES, size=count)
        images = np.empty((count,) + IMAGE_SHAPE, np.uint8)
        for start in range(0, count, 4096):  # float64 temporaries stay ~100 MB
            part = slice(start, min(start + 4096, count))
            n = part.stop - part.start
            contrast = rng.uniform(0.2, 1.0, size=(n, 1, 1, 1))
            brightness = rng.normal(0.0, 0.5, size=(n, 1, 1, 1))
            x = contrast * patterns[labels[part]] + brightness + rng.normal(0.0, 1.0, size=(n,) + IMAGE_SHAPE)
            images[part] = np.clip(np.rint(127.5 + 40.0 * x), 0, 255)
        return images, labels

    images, labels = draw(num_train)
    for i, part in enumerate(np.array_split(np.arange(num_train), 5), start=1):
        write_cifar10(os.path.join(root, f"{TRAIN_PREFIX}{i}.bin"), images[part], labels[part])
    images, labels = draw(num_test)
    write_cifar10(os.path.join(root, f"{TEST_PREFIX}.bin"), images, labels)
    return root


# --------------------------------------------------------------------------
# Sharding and the epoch plan
# --------------------------------------------------------------------------


def shard_bounds(num_samples: int, shard_id: int, num_shards: int) -> tuple[int, int]:
    """Shard ``shard_id`` of ``num_shards`` over ``range(num_samples)``: [N*k//n, N*(k+1)//n).

    Raises ValueError for num_shards < 1, num_shards > num_samples, or shard_id
    outside [0, num_shards).
    """
    if num_shards < 1:
        raise ValueError(f"shard_bounds: num_shards must be >= 1, got {num_shards}")
    if num_shards > num_samples:
        raise ValueError(
            f"shard_bounds: num_shards={num_shards} is more than num_samples={num_samples}; "
            f"some shard would be empty"
        )
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"shard_bounds: shard_id={shard_id} is outside [0, {num_shards})")
    return num_samples * shard_id // num_shards, num_samples * (shard_id + 1) // num_shards


class Plan(NamedTuple):
    """One epoch as data. ``indices`` int64 and ``mask`` bool, both (steps, num_shards, B).

    ``indices[s, k]`` are the sample indices of shard k's batch at step s; ``mask``
    is False exactly on padding slots.
    """
    indices: np.ndarray
    mask: np.ndarray


def num_steps(num_samples: int, num_shards: int, batch_size: int, last_batch: str) -> int:
    """Steps per epoch, the same for every shard: fill ceil(ceil(N/n)/B), drop (N//n)//B."""
    if last_batch == "fill":
        return -(-(-(-num_samples // num_shards)) // batch_size)
    return (num_samples // num_shards) // batch_size


def epoch_plan(num_samples: int, num_shards: int, batch_size: int, *, epoch: int = 0,
               seed: int = 0, shuffle: bool = False, last_batch: str = "fill") -> Plan:
    """The sample in every slot of every batch of one epoch; see the module docstring."""
    _check_policy(last_batch)
    if batch_size < 1:
        raise ValueError(f"epoch_plan: batch_size must be >= 1, got {batch_size}")
    if seed < 0 or epoch < 0:
        raise ValueError(f"epoch_plan: seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    shard_bounds(num_samples, 0, num_shards)  # validates num_shards against num_samples
    steps = num_steps(num_samples, num_shards, batch_size, last_batch)
    slots = steps * batch_size
    indices = np.empty((num_shards, slots), np.int64)
    mask = np.zeros((num_shards, slots), bool)
    for k in range(num_shards):
        start, stop = shard_bounds(num_samples, k, num_shards)
        order = np.arange(start, stop)
        if shuffle:
            order = order[shard_permutation(stop - start, seed=seed, epoch=epoch, shard=k)]
        real = min(slots, len(order))
        indices[k, :real] = order[:real]
        indices[k, real:] = order[real - 1] if real else start
        mask[k, :real] = True
    shape = (num_shards, steps, batch_size)
    return Plan(indices.reshape(shape).swapaxes(0, 1).copy(), mask.reshape(shape).swapaxes(0, 1).copy())


def shard_permutation(size: int, *, seed: int, epoch: int, shard: int) -> np.ndarray:
    """A permutation of range(size) that depends on (seed, epoch, shard) alone.

    Sorting PCG64's raw 64-bit outputs uses only the bit streams that NumPy
    specifies exactly (SeedSequence and PCG64), not ``Generator.permutation``,
    whose algorithm NumPy may change between versions. Raises ValueError for a
    seed, epoch or shard outside [0, 2**32).
    """
    # SeedSequence splits an int >= 2**32 into several 32-bit words, so a larger
    # value would alias another triple: (seed 2**32, epoch 0) reads as (0, 1, 0).
    for name, value in (("seed", seed), ("epoch", epoch), ("shard", shard)):
        if not 0 <= value < 2**32:
            raise ValueError(f"shard_permutation: {name}={value} is outside [0, 2**32)")
    keys = np.random.PCG64(np.random.SeedSequence([seed, epoch, shard])).random_raw(size)
    return np.argsort(keys, kind="stable")


def _check_policy(last_batch: str) -> None:
    if last_batch not in LAST_BATCH_POLICIES:
        raise ValueError(f"last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")


# --------------------------------------------------------------------------
# Per-image arithmetic
# --------------------------------------------------------------------------


def crop_mirror_normalize(images_NCHW: np.ndarray, *, crop: tuple[int, int] | None = None,
                          mirror=False, mean: Sequence[float] = (0.0, 0.0, 0.0),
                          std: Sequence[float] = (1.0, 1.0, 1.0),
                          crop_pos: tuple[float, float] = (0.5, 0.5),
                          out: np.ndarray | None = None) -> np.ndarray:
    """rocAL's crop_mirror_normalize on uint8 NCHW images; float32 NCHW out.

    ``out[n, c, y, x] = (in[n, c, y0 + y, x0 + x'] - mean[c]) / std[c]`` with mean
    and std in pixel units (0..255), ``x' = cw - 1 - x`` where the sample is
    mirrored (a horizontal flip inside the crop window), else ``x' = x``.
    ``crop = (ch, cw)`` (default: the whole image), ``crop_pos = (pos_y, pos_x)``
    in [0, 1], anchor ``y0 = nearbyint(pos_y * (H - ch))`` rounding half to even,
    likewise x0. ``mirror`` is a bool or a bool array of shape (N,).

    Raises ValueError for mean/std without one entry per channel, a zero std, a
    crop larger than the image (rocAL clamps it silently), or a crop_pos outside
    [0, 1]. ``out``: a float32 (N, C, ch, cw) array to write into (default: a new
    one, 64-byte aligned so that ``jax.device_put`` on CPU can use it in place).
    """
    images_NCHW = np.asarray(images_NCHW)
    if images_NCHW.ndim != 4:
        raise ValueError(f"crop_mirror_normalize: images must be NCHW, got shape {images_NCHW.shape}")
    n, c, h, w = images_NCHW.shape
    mean = np.asarray(mean, np.float32)
    std = np.asarray(std, np.float32)
    if mean.shape != (c,) or std.shape != (c,):
        raise ValueError(
            f"crop_mirror_normalize: mean and std need {c} entries (one per channel), "
            f"got mean={mean.tolist()}, std={std.tolist()}"
        )
    if np.any(std == 0):
        raise ValueError(f"crop_mirror_normalize: std has a zero entry: std={std.tolist()}")
    ch, cw = (h, w) if crop is None else crop
    if not (0 < ch <= h and 0 < cw <= w):
        raise ValueError(f"crop_mirror_normalize: crop={crop} does not fit in images of {h}x{w}")
    if not all(0.0 <= p <= 1.0 for p in crop_pos):
        raise ValueError(f"crop_mirror_normalize: crop_pos={crop_pos} must lie in [0, 1]")
    y0 = int(np.rint(crop_pos[0] * (h - ch)))
    x0 = int(np.rint(crop_pos[1] * (w - cw)))
    window = images_NCHW[:, :, y0:y0 + ch, x0:x0 + cw]
    flip = np.asarray(mirror, bool)
    if flip.ndim == 0:
        flip = np.full(n, bool(flip))
    if flip.shape != (n,):
        raise ValueError(f"crop_mirror_normalize: mirror must be a bool or shape ({n},), got {flip.shape}")
    if out is None:
        out = aligned_empty((n, c, ch, cw), np.float32)
    elif out.shape != (n, c, ch, cw) or out.dtype != np.float32:
        raise ValueError(f"crop_mirror_normalize: out must be float32 {(n, c, ch, cw)}, "
                         f"got {out.dtype} {out.shape}")
    # The same value for every channel (the default): a scalar operand lets NumPy
    # run one long loop instead of one per image plane, twice as fast, same bits.
    mean = mean[0] if np.all(mean == mean[0]) else mean[:, None, None]
    std = std[0] if np.all(std == std[0]) else std[:, None, None]
    np.subtract(window, mean, out=out, dtype=np.float32)
    if flip.any():
        out[flip] = out[flip][..., ::-1]
    np.divide(out, std, out=out)
    return out


def aligned_empty(shape: tuple[int, ...], dtype, align: int = 64) -> np.ndarray:
    """``np.empty`` whose data starts on an ``align``-byte boundary.

    JAX's CPU client wraps a 64-byte-aligned host buffer without copying it (it
    copies anything else); NumPy's allocator only promises 16 bytes.
    """
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@dataclasses.dataclass(frozen=True)
class Normalize:
    """What the loader applies to each image: crop_mirror_normalize's arguments.

    The default is the rocAL notebook's: no crop, no flip, (x - 127.5) / 127.5.
    """
    mean: tuple[float, float, float] = (127.5, 127.5, 127.5)
    std: tuple[float, float, float] = (127.5, 127.5, 127.5)
    mirror: bool = False
    crop: tuple[int, int] | None = None
    crop_pos: tuple[float, float] = (0.5, 0.5)

    def __call__(self, images_NCHW: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return crop_mirror_normalize(images_NCHW, crop=self.crop, mirror=self.mirror,
                                     mean=self.mean, std=self.std, crop_pos=self.crop_pos, out=out)


# --------------------------------------------------------------------------
# Devices, meshes and global arrays
# --------------------------------------------------------------------------


def data_mesh(devices: Sequence[jax.Device] | Mesh) -> Mesh:
    """A one-axis mesh named 'data' over ``devices`` in the given order.

    A Mesh is returned as it is after checking that it has a 'data' axis holding
    all its devices. Raises ValueError for no device, a repeated device, or a mesh
    whose 'data' axis does not span its devices.
    """
    if isinstance(devices, Mesh):
        mesh = devices
        if DATA_AXIS not in mesh.axis_names or mesh.shape[DATA_AXIS] != mesh.devices.size:
            raise ValueError(
                f"mesh: axis {DATA_AXIS!r} must hold every device, got axes {dict(mesh.shape)}"
            )
        return mesh
    devices = list(devices)
    if not devices:
        raise ValueError("devices: need at least one device, got none")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices: a device is listed twice: {devices}")
    # Auto axes: jit propagates the batch's sharding, as the notebooks rely on.
    return jax.make_mesh((len(devices),), (DATA_AXIS,), axis_types=(AxisType.Auto,), devices=devices)


def local_positions(mesh: Mesh) -> list[int]:
    """Mesh positions (= shard indices) of this process's devices, ascending."""
    return [k for k, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]


def split_rows(rows: dict[str, np.ndarray], positions: list[int]) -> dict[int, dict[str, np.ndarray]]:
    """Contiguous per-process rows (len(positions) * B, ...) as per-shard blocks (views)."""
    size = len(rows["mask"]) // len(positions)
    return {k: {name: x[j * size:(j + 1) * size] for name, x in rows.items()}
            for j, k in enumerate(positions)}


def global_batch(blocks: dict[int, dict[str, np.ndarray]], mesh: Mesh, layout: str = "sharded"):
    """Global ``jax.Array``s from per-shard host blocks: block k goes to mesh position k.

    ``blocks[k]`` maps each name ("images", "labels", "mask") to shard k's rows
    (B, ...): NumPy arrays, or jax.Arrays already on device k (the rocAL
    backend's images), used in place. Only the shards whose device belongs to
    this process need to be present, so the same call builds the same global
    batch in every process of a multi-process run. Layouts:

    * "sharded": (n*B, ...) with ``NamedSharding(mesh, P('data'))``; with a single
      device, plain (B, ...) arrays on that device.
    * "pmap": (n, B, ...) sharded on axis 0 (what pmap and DALI's devices= give).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    devices = list(mesh.devices.flat)
    local = local_positions(mesh)
    missing = [k for k in local if k not in blocks]
    if missing:
        raise ValueError(f"global_batch: no block for the local shards {missing}")
    n = len(devices)
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    out = {}
    for name in blocks[local[0]]:
        rows = blocks[local[0]][name]
        if layout == "sharded" and n == 1:
            out[name] = jax.device_put(rows, devices[0])
            continue
        if layout == "sharded":
            shape = (n * rows.shape[0],) + rows.shape[1:]
            parts = [jax.device_put(blocks[k][name], devices[k]) for k in local]
        else:
            shape = (n,) + rows.shape
            parts = [jax.device_put(blocks[k][name][None], devices[k]) for k in local]
        out[name] = jax.make_array_from_single_device_arrays(shape, sharding, parts)
    return out


def global_batch_from_rows(rows: dict[str, np.ndarray], mesh: Mesh, layout: str = "sharded"):
    """``global_batch`` for rows already laid out as this process's part of the batch.

    ``rows[name]`` is (n_local * B, ...): the blocks of this process's shards, in
    mesh order, one after the other. One ``jax.make_array_from_process_local_data``
    per name replaces n ``device_put``s (each ~0.1 ms of fixed cost on CPU), and
    a 64-byte-aligned buffer is used in place, not copied.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    devices = list(mesh.devices.flat)
    n = len(devices)
    local = local_positions(mesh)
    n_local = len(local)
    if local != list(range(local[0], local[0] + n_local)):
        # This process's rows are not one contiguous slice of the global batch
        # (a hand-made mesh that interleaves processes): place block by block.
        return global_batch(split_rows(rows, local), mesh, layout)
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    out = {}
    for name, x in rows.items():
        if layout == "sharded" and n == 1:
            out[name] = jax.device_put(x, devices[0])
            continue
        block = x.reshape((n_local, -1) + x.shape[1:])
        if layout == "sharded":
            out[name] = jax.make_array_from_process_local_data(sharding, x, (n * block.shape[1],) + x.shape[1:])
        else:
            out[name] = jax.make_array_from_process_local_data(sharding, block, (n,) + block.shape[1:])
    return out


# --------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Loader:
    """A sharded epoch iterator over an in-memory (or memory-mapped) dataset.

    Build it with ``make_loader``. ``len(loader)`` is the number of steps in every
    epoch, equal on every shard. ``loader.epoch(e)`` yields one dict per step with
    global arrays "images" (float32, normalised), "labels" (int32) and "mask"
    (bool) in ``layout``; ``loader.batch(e, s)`` is step s alone (random access).
    ``loader.plan(e)`` is the epoch's ``Plan``. Batches are fully determined by
    (seed, epoch, step): two loaders with the same arguments yield equal batches.
    """
    images: np.ndarray
    labels: np.ndarray
    mesh: Mesh
    batch_size: int
    layout: str = "sharded"
    shuffle: bool = False
    seed: int = 0
    last_batch: str = "fill"
    normalize: Normalize = Normalize()
    prefetch: int = 2

    @property
    def num_shards(self) -> int:
        return self.mesh.devices.size

    def __len__(self) -> int:
        return num_steps(len(self.labels), self.num_shards, self.batch_size, self.last_batch)

    def plan(self, epoch: int) -> Plan:
        return epoch_plan(len(self.labels), self.num_shards, self.batch_size, epoch=epoch,
                          seed=self.seed, shuffle=self.shuffle, last_batch=self.last_batch)

    def real_samples(self, epoch: int) -> int:
        """How many mask-True slots ``epoch`` has in the whole global batch."""
        return int(self.plan(epoch).mask.sum())

    def host_rows(self, plan: Plan, step: int) -> dict[str, np.ndarray]:
        """This process's rows at ``step`` of ``plan``: (n_local * B, ...) per name,
        its shards' blocks in mesh order, the images in one aligned buffer."""
        local = local_positions(self.mesh)
        idx = plan.indices[step, local]  # (n_local, B)
        B = self.batch_size
        if isinstance(self.normalize, Normalize):
            c, h, w = self.images.shape[1:]
            images = aligned_empty((idx.size, c) + (self.normalize.crop or (h, w)), np.float32)
            for j in range(len(local)):
                self.normalize(self.images[idx[j]], out=images[j * B:(j + 1) * B])
        else:  # any other callable: its blocks, copied into one array
            images = np.concatenate([self.normalize(self.images[i]) for i in idx])
        return {"images": images, "labels": self.labels[idx.reshape(-1)],
                "mask": plan.mask[step, local].reshape(-1)}

    def host_blocks(self, plan: Plan, step: int) -> dict[int, dict[str, np.ndarray]]:
        """Host-side blocks for this process's shards at ``step`` of ``plan``."""
        return split_rows(self.host_rows(plan, step), local_positions(self.mesh))

    def batch(self, epoch: int, step: int) -> dict[str, jax.Array]:
        if not 0 <= step < len(self):
            raise IndexError(f"step={step} is outside [0, {len(self)})")
        return global_batch_from_rows(self.host_rows(self.plan(epoch), step), self.mesh, self.layout)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, jax.Array]]:
        """Steps ``start_step .. len-1`` of ``epoch``, prepared ``prefetch`` steps ahead
        on a background thread. A worker error is raised here in the caller; closing
        the iterator early (``break``, garbage collection) stops and joins the thread."""
        if not 0 <= start_step <= len(self):
            # range(-1, len) would yield the last step and then the whole epoch.
            raise IndexError(f"start_step={start_step} is outside [0, {len(self)}]")
        plan = self.plan(epoch)
        make = lambda s: global_batch_from_rows(self.host_rows(plan, s), self.mesh, self.layout)
        return _prefetched(make, range(start_step, len(self)), self.prefetch)


def make_loader(data, devices: Sequence[jax.Device] | Mesh, batch_size: int, *,
                layout: str = "sharded", filename_prefix: str = TRAIN_PREFIX,
                shuffle: bool = False, seed: int = 0, last_batch: str = "fill",
                normalize: Normalize = Normalize(), prefetch: int = 2,
                backend: str = "reference") -> Loader | RocalLoader:
    """A ``Loader`` over ``data``: a CIFAR-10 folder (read with ``filename_prefix``)
    or an ``(images_NCHW uint8, labels_N)`` pair. ``batch_size`` is per device.

    ``backend``: "reference" (this module, any device), "rocal" (one AMD rocAL
    pipeline per device, a ``RocalLoader``; see the end of this module) or "auto"
    (rocal when ``data`` is a folder, ``amd.rocal`` imports and every device is
    an AMD GPU; else reference). Both loaders have ``len()`` and ``epoch(e)``.

    Raises ValueError for batch_size < 1, a batch larger than the smallest shard
    (every step would be mostly padding, or with drop there would be no step),
    more devices than samples, a repeated device, a mesh without a 'data' axis
    spanning its devices, or an unknown layout, last_batch policy or backend;
    ImportError saying how to install rocAL for backend="rocal" without it.
    """
    if isinstance(data, (str, os.PathLike)):
        images, labels = read_cifar10(data, filename_prefix)
    else:
        images, labels = data
    mesh = data_mesh(devices)
    _check_policy(last_batch)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    n = mesh.devices.size
    if n > len(labels):
        raise ValueError(f"{n} devices but only {len(labels)} samples: some shard would be empty")
    if batch_size > len(labels) // n:
        raise ValueError(
            f"batch_size={batch_size} per device is larger than the smallest shard "
            f"({len(labels) // n} samples = {len(labels)} samples / {n} devices)"
        )
    if _use_rocal(backend, data, mesh):
        return make_rocal_loader(data, mesh, batch_size, num_samples=len(labels), layout=layout,
                                 filename_prefix=filename_prefix, shuffle=shuffle, seed=seed,
                                 last_batch=last_batch, normalize=normalize)
    return Loader(images, labels, mesh, batch_size, layout, shuffle, seed, last_batch,
                  normalize, prefetch)


def _prefetched(make, steps, depth: int):
    if depth == 0:
        return (make(s) for s in steps)
    return _prefetch_thread(make, steps, depth)


def _prefetch_thread(make, steps, depth: int):
    out: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def work():
        try:
            for s in steps:
                if not put(("batch", make(s))):
                    return
            put(("end", None))
        except BaseException as error:  # handed to the consumer, raised there
            put(("error", error))

    worker = threading.Thread(target=work, name="loader-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            kind, value = out.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        worker.join()


# --------------------------------------------------------------------------
# rocAL backend: the same global batches, read and normalised by AMD rocAL
# --------------------------------------------------------------------------
# Written against rocAL's Python API as of early 2025 (ROCm/rocAL:
# rocAL_pybind/amd/rocal/{pipeline,readers,fn,types}.py, plugin/jax.py), not run here.
# Imported lazily: this module loads on machines without rocAL.

BACKENDS = ("reference", "rocal", "auto")
ROCAL_INSTALL_HINT = (
    "backend='rocal' needs AMD rocAL's Python package amd.rocal, which is not on PyPI: on a "
    "ROCm host install the OS packages 'rocal' and 'rocal-dev' (e.g. `apt install rocal "
    "rocal-dev`) and run with PYTHONPATH=/opt/rocm/lib, where they put amd.rocal. "
    "backend='reference' runs anywhere."
)
_DL_ROCM = 10  # DLPack's kDLROCM device type


@dataclasses.dataclass(eq=False)
class RocalLoader:
    """Sharded epochs read by rocAL: one ``Pipeline`` per local device, as in the notebook.

    Pipeline k (k = its device's position in the mesh) runs ``fn.readers.cifar10(
    shard_id=k, num_shards=n)`` and ``fn.crop_mirror_normalize`` to float32 NCHW on
    that GPU. Its output becomes a jax.Array on device k through DLPack, its labels
    come from ``get_image_labels()``, and ``global_batch`` lays them out as ``Loader``
    does, in both layouts. Interface: ``len()`` and ``epoch(e)`` yielding
    ``{"images", "labels", "mask"}``; no ``batch``, ``plan`` or ``start_step``.

    Guaranteed here:

    * ``len()`` is the true number of steps, ``num_steps(N, n, B, last_batch)``, not
      what rocAL's ``get_remaining_images()`` implies (N: the records of the files
      rocAL reads; a folder where rocAL would read more than ``read_cifar10`` is
      refused). ``epoch`` stops after ``len()`` steps and raises if a pipeline runs
      out before.
    * "mask": drop, all True. fill without shuffle, the reference plan's mask:
      rocAL pads the tail of each shard with copies of its last sample, the slots
      the plan masks. fill with shuffle is refused: rocAL does not say which
      slots are padding, so a mask would be a guess.
    * Images are copied out of rocAL's output buffers, which its next run reuses.

    Not guaranteed (rocAL's behaviour as read in its source, never observed here;
    the conformance test in test_rocal.py checks it on an AMD host):

    * The order is rocAL's: files in raw ``readdir`` order; the shuffle seeded by
      the shard index (newer code also hands the reader the pipeline seed, which
      rocAL keeps process-wide), never by the epoch. ``epoch(e)`` resets the
      pipelines and yields rocAL's next pass whatever ``e`` is: batches are not
      a function of (seed, epoch) as with ``Loader``.
    * Disjoint shards: rocAL's CIFAR-10 node seems to build one internal loader
      per shard and overwrite ``shard_id`` (``cifar10_loader_sharded.cpp``), so
      every device would read the whole dataset.
    * With drop, rocAL may skip B samples at every reset.
    """
    pipelines: dict[int, object]  # mesh position -> built rocAL Pipeline, local devices only
    mesh: Mesh
    batch_size: int
    num_samples: int
    layout: str = "sharded"
    last_batch: str = "fill"
    crop: tuple[int, int] = IMAGE_SHAPE[1:]
    used: bool = dataclasses.field(default=False, init=False)  # ran since the last reset

    @property
    def num_shards(self) -> int:
        return self.mesh.devices.size

    def __len__(self) -> int:
        return num_steps(self.num_samples, self.num_shards, self.batch_size, self.last_batch)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, jax.Array]]:
        """rocAL's next pass, ``len()`` steps; ``epoch`` only has to be >= 0."""
        if epoch < 0 or start_step != 0:
            raise ValueError(f"the rocAL backend yields whole epochs: got epoch={epoch}, "
                             f"start_step={start_step} (rocAL pipelines cannot seek)")
        if self.used:
            for pipe in self.pipelines.values():
                pipe.rocal_reset_loaders()
            self.used = False
        return self._steps()

    def close(self) -> None:
        """Releases the pipelines and their GPU buffers; the loader is unusable after."""
        for pipe in self.pipelines.values():
            pipe.rocal_release()
        self.pipelines.clear()

    def real_samples(self, epoch: int) -> int:
        """How many mask-True slots each epoch has in the whole global batch."""
        return int(self._mask().sum())

    def _mask(self) -> np.ndarray:
        if self.last_batch == "fill":  # shuffle off (make_rocal_loader refuses fill + shuffle)
            return epoch_plan(self.num_samples, self.num_shards, self.batch_size).mask
        return np.ones((len(self), self.num_shards, self.batch_size), bool)

    def _steps(self):
        devices = list(self.mesh.devices.flat)
        mask = self._mask()
        want = (self.batch_size, IMAGE_SHAPE[0]) + tuple(self.crop)
        for step in range(len(self)):
            self.used = True
            blocks = {}
            for k, pipe in self.pipelines.items():
                out = rocal_step(pipe, devices[k])
                if out is None:
                    raise RuntimeError(f"rocAL pipeline of shard {k} ({devices[k]}) ran out at "
                                       f"step {step}, but len() is {len(self)}")
                images, labels = out
                if images.shape != want or labels.shape != want[:1]:
                    raise RuntimeError(f"rocAL pipeline of shard {k} gave images {images.shape} "
                                       f"and labels {labels.shape}; expected {want}, {want[:1]}")
                blocks[k] = {"images": images, "labels": labels, "mask": mask[step, k]}
            yield global_batch(blocks, self.mesh, self.layout)


def import_rocal():
    """``(Pipeline, fn, types)`` from amd.rocal; ImportError saying how to install it."""
    try:
        from amd.rocal.pipeline import Pipeline
        import amd.rocal.fn as fn
        import amd.rocal.types as types
    except ImportError as error:
        raise ImportError(f"{ROCAL_INSTALL_HINT} (import failed: {error})") from error
    return Pipeline, fn, types


def rocal_usable(devices: Sequence[jax.Device]) -> bool:
    """What backend="auto" asks: does amd.rocal import, and is every device an AMD GPU?"""
    try:
        import_rocal()
        amd_gpus = set(jax.devices("rocm"))
    except (ImportError, RuntimeError):  # RuntimeError: JAX has no ROCm backend
        return False
    return all(d in amd_gpus for d in devices)


def rocal_pipeline(file_root: str | os.PathLike, *, shard_id: int, num_shards: int,
                   device: jax.Device, batch_size: int, filename_prefix: str = TRAIN_PREFIX,
                   shuffle: bool = False, last_batch: str = "fill",
                   normalize: Normalize = Normalize(), seed: int = 0, num_threads: int = 8):
    """A built rocAL Pipeline for one shard on ``device``'s GPU, as the notebook builds it.

    Note: rocAL's ``Pipeline.build()`` calls ``exit(0)`` if the graph fails to verify.
    """
    Pipeline, fn, types = import_rocal()
    pipe = Pipeline(batch_size=batch_size, num_threads=num_threads, device_id=_hardware_id(device),
                    seed=seed, rocal_cpu=False, tensor_layout=types.NCHW,
                    tensor_dtype=types.FLOAT, output_memory_type=types.DEVICE_MEMORY)
    crop = normalize.crop or IMAGE_SHAPE[1:]
    policy = types.LAST_BATCH_FILL if last_batch == "fill" else types.LAST_BATCH_DROP
    with pipe:
        raw = fn.readers.cifar10(
            file_root=os.fspath(file_root), shard_id=shard_id, num_shards=num_shards,
            filename_prefix=filename_prefix, random_shuffle=shuffle,
            last_batch_policy=policy, pad_last_batch=last_batch == "fill")
        images = fn.crop_mirror_normalize(
            raw, output_layout=types.NCHW, output_dtype=types.FLOAT, crop=tuple(crop),
            crop_pos_x=normalize.crop_pos[1], crop_pos_y=normalize.crop_pos[0],
            mirror=int(normalize.mirror),  # explicit: rocAL's default 1 flips every image
            mean=list(normalize.mean), std=list(normalize.std))
        pipe.set_outputs(images)
    pipe.build()
    return pipe


def rocal_step(pipe, device: jax.Device):
    """Runs ``pipe`` once: ``(images float32 (B, C, H, W) on device, labels int32 (B,))``,
    or None when rocAL reports the end of its data (``rocal_run()`` status not OK)."""
    if int(pipe.rocal_run()) != 0:
        return None
    tensor = pipe.get_output_tensors()[0]
    images = jax.dlpack.from_dlpack(_RocalDLPack(tensor, _hardware_id(device)), device=device,
                                    copy=True)  # rocAL overwrites this buffer on a later run
    labels = np.asarray(pipe.get_image_labels()).astype(np.int32).reshape(-1)
    return images, labels


class _RocalDLPack:
    """A rocAL output tensor as ``jax.dlpack.from_dlpack`` wants it.

    rocAL's ``__dlpack__`` takes the GPU id (its plugin/jax.py calls
    ``tensor.__dlpack__(device_id)``) and JAX calls ``__dlpack__(stream=...)``; JAX
    also needs ``__dlpack_device__``, whose device id rocAL's binding may leave at 0.
    """

    def __init__(self, tensor, device_id: int):
        self.tensor, self.device_id = tensor, device_id

    def __dlpack__(self, stream=None, **_):
        return self.tensor.__dlpack__(self.device_id)

    def __dlpack_device__(self):
        kind = int(self.tensor.__dlpack_device__()[0]) if hasattr(
            self.tensor, "__dlpack_device__") else _DL_ROCM
        return kind, self.device_id if kind == _DL_ROCM else 0


def _hardware_id(device: jax.Device) -> int:
    return device.id if device.local_hardware_id is None else device.local_hardware_id


def _use_rocal(backend: str, data, mesh: Mesh) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return isinstance(data, (str, os.PathLike)) and rocal_usable(list(mesh.devices.flat))
    return backend == "rocal"


def make_rocal_loader(data, mesh: Mesh, batch_size: int, *, num_samples: int, layout: str,
                      filename_prefix: str, shuffle: bool, seed: int, last_batch: str,
                      normalize: Normalize) -> RocalLoader:
    """``make_loader(..., backend="rocal")`` after its own checks. Raises ValueError for
    arrays instead of a folder, fill with shuffle, or a file rocAL would read that
    ``read_cifar10`` skips; ImportError (how to install) without amd.rocal."""
    if not isinstance(data, (str, os.PathLike)):
        raise ValueError("backend='rocal': rocAL reads the CIFAR-10 files itself; "
                         "pass the folder, not (images, labels) arrays")
    import_rocal()
    if shuffle and last_batch == "fill":
        raise ValueError("backend='rocal' with shuffle=True needs last_batch='drop': rocAL's fill "
                         "repeats samples without saying which slots are padding")
    root = os.fspath(data)
    # rocAL matches filename_prefix anywhere in a name; read_cifar10, only at its start.
    extra = sorted(n for n in os.listdir(root) if filename_prefix in n
                   and not n.startswith(filename_prefix))
    if extra:
        raise ValueError(f"{root}: rocAL would also read {extra}, which contain "
                         f"filename_prefix={filename_prefix!r}; move them out of the folder")
    normalize(np.zeros((1,) + IMAGE_SHAPE, np.uint8))  # the reference's checks of mean, std, crop
    devices = list(mesh.devices.flat)
    pipelines = {
        k: rocal_pipeline(root, shard_id=k, num_shards=len(devices), device=devices[k],
                          batch_size=batch_size, filename_prefix=filename_prefix,
                          shuffle=shuffle, last_batch=last_batch, normalize=normalize, seed=seed)
        for k in local_positions(mesh)
    }
    return RocalLoader(pipelines, mesh, batch_size, num_samples, layout, last_batch,
                       tuple(normalize.crop or IMAGE_SHAPE[1:]))
