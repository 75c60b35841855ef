"""Sharded loaders for data-parallel JAX: one shard per device. The reference.

This module is the data half of the reference, and the spec every vendor
loader (rocal_loader.py, dali_loader.py) is held to. It is pure NumPy plus JAX
and stands on its own: copy it into another project as it is.

The contract, in the order the pieces are used:

* ``read_cifar10`` reads the CIFAR-10 "binary version" (3073-byte records: one
  label byte 0..9, then the R, G, B planes of 32x32, row-major); ``read_mnist``
  reads MNIST's IDX files. Both give ``(images_NCHW uint8, labels_N int32)``.
* ``shard_bounds`` partitions ``range(N)`` into ``n`` contiguous shards: shard k
  is ``[N*k//n, N*(k+1)//n)``, the partition rocAL and DALI use. Shard sizes
  differ by at most one.
* ``epoch_plan`` turns (N, n, B, epoch, seed, shuffle, last_batch) into the whole
  epoch as data: which sample sits in which slot of which device's batch at which
  step, and whether that slot is real (mask True) or padding (mask False).
  Batches are therefore a pure function of (seed, epoch, step, shard): resuming
  mid-epoch needs the step number and nothing else. Resuming on another number
  of devices or batch size: ``elastic_plan`` and ``LoaderState``, which
  ``Loader.state`` gives and ``Loader.epoch(e, state=...)`` takes.
* ``Normalize`` is the per-image arithmetic of the vendors' crop_mirror_normalize,
  specified as a table: over uint8 input, a vendor's formula is one float32 value
  per (channel, pixel value), ``normalize_table``. Every path that normalises
  (host, device) looks the table up, so the bits are the same on every device.
* ``make_loader`` puts it together: one loader for a set of devices over a
  dataset of named arrays, N first: a dict ``{name: array}`` (token ids and
  per-token targets, float features and float targets, images and labels: any
  names but "mask", any shapes, any dtype JAX holds as it is), or the
  notebooks' tuple ``(images, labels)`` and a CIFAR-10 folder, which give
  "images" and "labels". Its epoch iterator yields every name plus "mask" as
  global ``jax.Array``s, row block k on the device at position k of the mesh,
  each name delivered bit for bit as stored unless ``normalize`` names it
  (``normalize={"images": Normalize()}``; for the tuple form ``Normalize()`` is
  the default). ``placement`` says where the work happens: "host" gathers rows
  on the host and normalises on the devices; "device" keeps each shard
  resident on its device and gathers there; "host_float32" normalises on the
  host. All three give the same bits.

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
* Every name of a dataset follows the same plan, mask, layout and resume.
* The three placements give bit-identical global arrays, in both layouts.

Deliberate differences from rocAL and DALI, and why:

* Files are read in sorted name order. rocAL lists a folder in raw ``readdir``
  order, which depends on the filesystem, so the same folder can give a different
  sample order on another machine.
* Shuffle honours ``seed`` and changes every epoch. rocAL seeds its shuffle with
  the shard index alone; DALI pre-permutes with a fixed seed.
* A crop larger than the image is an error here; rocAL silently clamps it.
* The shard of a device is its position in the mesh, never ``device.id``
  (device ids need not be 0..n-1; see JAX issue 16024).

Devices: nothing here uses JAX's default device or backend. Every array goes to
the devices of the mesh it was given, so a mesh of CPU devices on a GPU host
stays on the CPU. Supported: JAX 0.10 or newer (tested on 0.10.2; the module
itself needs only ``jax.shard_map`` at top level and ``jax.sharding.Mesh`` with
``axis_types``, so 0.7+); NumPy >= 1.25.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import numbers
import os
import queue
import tempfile
import threading
from collections.abc import Mapping
from fractions import Fraction
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

RECORD_BYTES = 3073
IMAGE_SHAPE = (3, 32, 32)  # CIFAR-10
MNIST_SHAPE = (1, 28, 28)
NUM_CLASSES = 10
TRAIN_PREFIX = "data_batch_"
TEST_PREFIX = "test_batch"
DATA_AXIS = "data"
LAST_BATCH_POLICIES = ("fill", "drop")
LAYOUTS = ("sharded", "pmap")
PLACEMENTS = ("host", "device", "host_float32")
ARITHMETICS = ("rocal", "dali_cpu", "dali_gpu")


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
    images_NCHW, labels_N = _check_images_and_labels(f"write_cifar10({path!r})", images_NCHW,
                                                     labels_N, IMAGE_SHAPE)
    rows = np.empty((len(labels_N), RECORD_BYTES), np.uint8)
    rows[:, 0] = labels_N
    rows[:, 1:] = images_NCHW.reshape(len(labels_N), RECORD_BYTES - 1)  # not -1: N may be 0
    _write_atomically(path, rows.tobytes())


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
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    draw = _synthetic_images(IMAGE_SHAPE, num_train, num_test, seed, salt=0xC1FA)
    images, labels = draw(num_train)
    for i, part in enumerate(np.array_split(np.arange(num_train), 5), start=1):
        write_cifar10(os.path.join(root, f"{TRAIN_PREFIX}{i}.bin"), images[part], labels[part])
    images, labels = draw(num_test)
    write_cifar10(os.path.join(root, f"{TEST_PREFIX}.bin"), images, labels)
    return root


# --------------------------------------------------------------------------
# Reading and writing MNIST's IDX files (the DALI notebook's dataset)
# --------------------------------------------------------------------------

MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_IDX_MAGIC = {"images": 0x00000803, "labels": 0x00000801}  # uint8 data, 3 or 1 dimensions


def read_mnist(folder: str | os.PathLike, split: str = "train"):
    """MNIST's ``split`` ("train" or "test") from the IDX files users download.

    Looks for ``train-images-idx3-ubyte`` / ``train-labels-idx1-ubyte`` (or
    ``t10k-*`` for "test"), each optionally gzipped (``.gz``) and also under the
    ``train-images.idx3-ubyte`` spelling some mirrors use. Returns
    ``(images_NCHW uint8 (N, 1, 28, 28), labels_N int32)``; uncompressed images
    are a read-only memory map.

    Raises FileNotFoundError (folder or file missing) or ValueError (a bad magic
    number, a header that is not 28x28, a file shorter or longer than its header
    says, image and label counts that differ, a label > 9); each names the file
    and the value.
    """
    if split not in MNIST_FILES:
        raise ValueError(f"read_mnist: split must be one of {tuple(MNIST_FILES)}, got {split!r}")
    root = os.fspath(folder)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"read_mnist: folder={root!r} is not a directory")
    images = _read_idx(_find_idx(root, MNIST_FILES[split][0]), "images")
    labels_path = _find_idx(root, MNIST_FILES[split][1])
    labels = _read_idx(labels_path, "labels")
    if len(images) != len(labels):
        raise ValueError(f"{labels_path}: {len(labels)} labels, but the images file of split "
                         f"{split!r} holds {len(images)} images")
    bad = np.flatnonzero(labels >= NUM_CLASSES)
    if bad.size:
        raise ValueError(f"{labels_path}: label {bad[0]} is {labels[bad[0]]}; MNIST labels are 0..9")
    return images.reshape((-1,) + MNIST_SHAPE), labels.astype(np.int32)


def write_mnist(folder: str | os.PathLike, split: str, images_NCHW: np.ndarray,
                labels_N: np.ndarray) -> None:
    """Writes ``split``'s two IDX files (uncompressed) into ``folder``, each atomically."""
    folder = os.fspath(folder)
    images_NCHW, labels_N = _check_images_and_labels(f"write_mnist({folder!r})", images_NCHW,
                                                     labels_N, MNIST_SHAPE)
    count = len(labels_N)
    header = np.array([_IDX_MAGIC["images"], count, 28, 28], ">u4").tobytes()
    images_name, labels_name = MNIST_FILES[split]
    _write_atomically(os.path.join(folder, images_name), header + images_NCHW.tobytes())
    header = np.array([_IDX_MAGIC["labels"], count], ">u4").tobytes()
    _write_atomically(os.path.join(folder, labels_name), header + labels_N.astype(np.uint8).tobytes())


def synthetic_mnist(root: str | os.PathLike, *, num_train: int = 60_000, num_test: int = 10_000,
                    seed: int = 0) -> str:
    """Writes MNIST-format IDX files (train and t10k) of synthetic 28x28 grey images,
    made like ``synthetic_cifar10``'s; a function of (num_train, num_test, seed). Returns ``root``."""
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    draw = _synthetic_images(MNIST_SHAPE, num_train, num_test, seed, salt=0x3A15)
    write_mnist(root, "train", *draw(num_train))
    write_mnist(root, "test", *draw(num_test))
    return root


def _find_idx(root: str, name: str) -> str:
    dotted = name.replace("-idx", ".idx")  # train-images.idx3-ubyte, as some mirrors name it
    for candidate in (name, name + ".gz", dotted, dotted + ".gz"):
        path = os.path.join(root, candidate)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"read_mnist: no {name} (or {name}.gz) in {root!r}")


def _read_idx(path: str, kind: str) -> np.ndarray:
    dims = 3 if kind == "images" else 1
    header_bytes = 4 * (1 + dims)
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            raw = f.read()
        size = len(raw)
    else:
        raw, size = None, os.path.getsize(path)
    head = raw[:header_bytes] if raw is not None else open(path, "rb").read(header_bytes)
    if len(head) < header_bytes:
        raise ValueError(f"{path}: {size} bytes, shorter than the {header_bytes}-byte IDX header")
    magic, *shape = np.frombuffer(head, ">u4").tolist()
    if magic != _IDX_MAGIC[kind]:
        raise ValueError(f"{path}: magic number {magic:#010x}, expected {_IDX_MAGIC[kind]:#010x} "
                         f"for MNIST {kind} (not an MNIST {kind} file, or still compressed)")
    if kind == "images" and shape[1:] != [28, 28]:
        raise ValueError(f"{path}: images of {shape[1]}x{shape[2]}, MNIST's are 28x28")
    want = header_bytes + int(np.prod(shape))
    if size != want:
        raise ValueError(f"{path}: {size} bytes, but its header ({shape[0]} {kind}) needs "
                         f"{want}: {'truncated' if size < want else 'trailing bytes'}")
    if raw is not None:
        return np.frombuffer(raw, np.uint8, offset=header_bytes).reshape(shape)
    if not shape[0]:
        return np.zeros(shape, np.uint8)
    return np.memmap(path, np.uint8, mode="r", offset=header_bytes).reshape(shape)


# --------------------------------------------------------------------------
# Shared by the readers and writers
# --------------------------------------------------------------------------


def _check_images_and_labels(where: str, images_NCHW, labels_N, shape: tuple[int, ...]):
    images_NCHW, labels_N = np.asarray(images_NCHW), np.asarray(labels_N)
    if images_NCHW.dtype != np.uint8 or images_NCHW.shape[1:] != shape:
        raise ValueError(f"{where}: images must be uint8 (N, {', '.join(map(str, shape))}), "
                         f"got {images_NCHW.dtype} {images_NCHW.shape}")
    if labels_N.shape != images_NCHW.shape[:1]:
        raise ValueError(f"{where}: labels shape {labels_N.shape} does not match "
                         f"{images_NCHW.shape[0]} images")
    if labels_N.size and (labels_N.min() < 0 or labels_N.max() >= NUM_CLASSES):
        raise ValueError(f"{where}: labels must be 0..9, got range [{labels_N.min()}, {labels_N.max()}]")
    return images_NCHW, labels_N


def _write_atomically(path: str, data: bytes) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _synthetic_images(shape: tuple[int, ...], num_train: int, num_test: int, seed: int, salt: int):
    for name, value in (("num_train", num_train), ("num_test", num_test)):
        if value < 0:
            raise ValueError(f"synthetic data: {name} must be >= 0, got {value}")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, salt])))
    c, h, w = shape
    coarse = rng.normal(size=(NUM_CLASSES, c, 4, 4))
    patterns = np.repeat(np.repeat(coarse, -(-h // 4), axis=2), -(-w // 4), axis=3)[:, :, :h, :w]

    def draw(count: int):
        labels = rng.integers(0, NUM_CLASSES, size=count)
        images = np.empty((count,) + shape, np.uint8)
        for start in range(0, count, 4096):  # float64 temporaries stay ~100 MB
            part = slice(start, min(start + 4096, count))
            n = part.stop - part.start
            contrast = rng.uniform(0.2, 1.0, size=(n, 1, 1, 1))
            brightness = rng.normal(0.0, 0.5, size=(n, 1, 1, 1))
            x = contrast * patterns[labels[part]] + brightness + rng.normal(0.0, 1.0, size=(n,) + shape)
            images[part] = np.clip(np.rint(127.5 + 40.0 * x), 0, 255)
        return images, labels

    return draw


# --------------------------------------------------------------------------
# Sharding and the epoch plan
# --------------------------------------------------------------------------


def shard_bounds(num_samples: int, shard_id: int, num_shards: int) -> tuple[int, int]:
    """Shard ``shard_id`` of ``num_shards`` over ``range(num_samples)``: the half-open
    ``[N*k//n, N*(k+1)//n)`` with N = num_samples, k = shard_id, n = num_shards,
    integer (floor) division on exact integers.

    The shards tile range(N) in order with no gap or overlap; their sizes are
    floor(N/n) or ceil(N/n), and the larger ones are not all at one end (N=7,
    n=3 gives [0, 2), [2, 4), [4, 7)). It is rocAL's and DALI's partition, so a
    vendor reader fed shard k reads the same samples.

    Validated here: ValueError for num_shards < 1, num_shards > num_samples (a
    shard would be empty), or shard_id outside [0, num_shards).
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
    """Steps per epoch, the same for every shard (N = num_samples, n = num_shards,
    B = batch_size, exact integer arithmetic):

        fill: ceil(ceil(N/n) / B)   -- the largest shard's batches, the last one padded
        drop: floor(floor(N/n) / B) -- the smallest shard's whole batches

    A batch larger than the smallest shard is allowed here (fill pads, drop gives
    0 steps); ``make_loader`` refuses it as a policy. Validated here: ValueError
    for an unknown last_batch, batch_size < 1, or num_shards outside [1, N].
    """
    _check_policy(last_batch)
    if batch_size < 1:
        raise ValueError(f"num_steps: batch_size must be >= 1, got {batch_size}")
    shard_bounds(num_samples, 0, num_shards)  # validates num_shards against num_samples
    if last_batch == "fill":
        return -(-(-(-num_samples // num_shards)) // batch_size)
    return (num_samples // num_shards) // batch_size


def epoch_plan(num_samples: int, num_shards: int, batch_size: int, *, epoch: int = 0,
               seed: int = 0, shuffle: bool = False, last_batch: str = "fill") -> Plan:
    """The sample in every slot of every batch of one epoch (the module docstring's table).

    With S = num_steps(N, n, B, last_batch) and, for each shard k,
    ``start, stop = shard_bounds(N, k, n)`` and L = stop - start:

        order = [start + p for p in shard_permutation(L, seed=seed, epoch=epoch, shard=k)]
                if shuffle else [start, start + 1, ..., stop - 1]
        real  = min(S * B, L)                        # drop: L >= S * B, so real = S * B
        slot j of shard k, j = s * B + b  (0 <= j < S * B):
            j <  real: indices[s, k, b] = order[j],        mask True
            j >= real: indices[s, k, b] = order[real - 1], mask False   (padding)

    So: the permutation is of local positions 0..L-1 and the shard offset is added
    after it; drop shuffles the whole shard and then keeps its first S*B samples
    (shuffle, then truncate: which samples are skipped changes every epoch);
    padding slots are the shard's last slots of the epoch (its final batch's
    tail) and repeat the last real sample *in epoch order* (with shuffle, not the
    shard's highest index). Without shuffle, ``seed`` and ``epoch`` do not change
    the plan. These choices are arbitrary among equally valid ones; they are the
    ones the vendors' readers produce when fed this order (DALI and rocAL pad by
    repeating the last sample read).

    Validated here: ValueError for an unknown last_batch, batch_size < 1,
    num_shards outside [1, N], or a seed or epoch outside [0, 2**32) (checked
    with or without shuffle, so a plan that is valid unshuffled stays valid
    shuffled). A batch larger than the smallest shard is allowed (see num_steps).
    """
    _check_policy(last_batch)
    if batch_size < 1:
        raise ValueError(f"epoch_plan: batch_size must be >= 1, got {batch_size}")
    check_seed("seed", seed, "epoch_plan")
    check_seed("epoch", epoch, "epoch_plan")
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
    """A permutation of range(size) (int64, shape (size,)) that depends on (seed, epoch, shard) alone:

        ss   = numpy.random.SeedSequence([seed, epoch, shard])  # entropy: this list, this order
        keys = numpy.random.PCG64(ss).random_raw(size)          # the first `size` raw uint64 outputs
        perm = argsort(keys), ascending, stable                  # perm[i] = j of the i-th smallest key

    Equal keys (probability about size**2 / 2**65) keep ascending j, which is what
    a stable sort gives; ``perm`` is the sorting permutation, not the ranks (its
    inverse). Why this construction: SeedSequence's hashing and PCG64's output
    function are specified by NumPy bit for bit (and stable across versions),
    while ``Generator.permutation``'s algorithm may change between versions. The
    three numbers are mixed by SeedSequence, never added, so (seed 1, epoch 0)
    and (seed 0, epoch 1) give unrelated orders. size 0 gives an empty array.

    Validated here: ValueError for a negative size, or a seed, epoch or shard
    outside [0, 2**32) (check_seed says why).
    """
    if size < 0:
        raise ValueError(f"shard_permutation: size must be >= 0, got {size}")
    check_seed("seed", seed, "shard_permutation")
    check_seed("epoch", epoch, "shard_permutation")
    check_seed("shard", shard, "shard_permutation")
    keys = np.random.PCG64(np.random.SeedSequence([seed, epoch, shard])).random_raw(size)
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


def check_seed(name: str, value: int, where: str) -> None:
    """Raises ValueError unless 0 <= value < 2**32.

    SeedSequence splits an int >= 2**32 into several 32-bit words, so a larger
    value would alias another triple: (seed 2**32, epoch 0) reads as (0, 1, 0)."""
    if not 0 <= value < 2**32:
        raise ValueError(f"{where}: {name}={value} is outside [0, 2**32)")


def _check_policy(last_batch: str) -> None:
    if last_batch not in LAST_BATCH_POLICIES:
        raise ValueError(f"last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")


# --------------------------------------------------------------------------
# Elastic epochs: an epoch resumed on another number of shards
# --------------------------------------------------------------------------


class Segment(NamedTuple):
    """A stretch of one epoch run by one set of shards: from global step ``start`` of the
    epoch until the next segment's start (or the epoch's end), ``num_shards`` shards of
    ``batch_size`` samples each. Plain tuples and lists ``[start, n, B]`` are accepted
    wherever a Segment is."""
    start: int
    num_shards: int
    batch_size: int


def elastic_plan(num_samples: int, segments: Sequence, *, epoch: int = 0, seed: int = 0,
                 shuffle: bool = False, last_batch: str = "fill") -> list[Plan]:
    """One epoch run by a chain of shard sets: ``plans[i]`` is what segment i delivers.

    ``segments`` is ``[(t_0, n_0, B_0), (t_1, n_1, B_1), ...]``: segment i runs from
    global step t_i of the epoch on n_i shards of per-shard batch B_i, until t_{i+1}
    (the last one until the epoch ends). ``plans[i]`` is a ``Plan`` of shape
    (d_i, n_i, B_i): row r is global step t_i + r. With one segment [(0, n, B)] the
    result is ``[epoch_plan(N, n, B, ...)]``, bit for bit. The next epoch is a fresh
    ``epoch_plan`` on the last segment's (n, B).

    The construction. R_i is the pool of segment i: the samples not delivered in
    a real (mask True) slot before step t_i, in ascending order; R_0 = [0, 1, ..., N-1].
    With m = len(R_i), n = n_i, B = B_i:

        S_i = 0                      if i >= 1 and t_i == t_{i-1} + S_{i-1}  (the epoch had ended)
            = ceil(ceil(m/n) / B)    fill   -- the largest run's batches, the last one padded
            = floor(floor(m/n) / B)  drop   -- the smallest run's whole batches
        d_i = t_{i+1} - t_i if a segment i+1 follows (refused unless 1 <= d_i <= S_i), else S_i
        new shard k (0 <= k < n):
            lo, hi = m*k // n, m*(k+1) // n               # shard_bounds' formula on pool positions
            run    = R_i[lo:hi]                           # empty when m < n and m*k//n == m*(k+1)//n
            order  = [run[p] for p in perm] if shuffle else run
                     perm = argsort(PCG64(SeedSequence(E)).random_raw(len(run))), ascending, stable
                     E = [seed, epoch, k] for i = 0, [seed, epoch, k, i] for i >= 1
            real   = min(S_i * B, len(run))
            slot j = s*B + b, 0 <= j < S_i*B:
                j <  real: indices[s, k, b] = order[j],                                  mask True
                j >= real: indices[s, k, b] = order[real-1] if real else R_i[lo],        mask False
        plans[i] = rows s < d_i of that (S_i, n, B) plan
        R_{i+1}  = R_i without the samples of plans[i]'s mask-True slots, ascending

    So segment 0 is exactly epoch_plan (R_0 = range(N), runs = shard_bounds(N, k, n),
    E = shard_permutation's), and every later segment is the same construction on
    what is left: the samples delivered before a change are exactly those of the old
    segment's plan at its steps before the change, and the new shards split the rest
    into contiguous runs of the ascending pool. Samples move between shards at a
    change (the new runs need not lie in the old shards), so ``stick_to_shard`` holds
    within a segment only. Why E: SeedSequence hashes a missing entropy word as 0
    (it pads to its pool size of 4), so [seed, epoch, k, 0] would be epoch_plan's
    [seed, epoch, k] stream again; a fourth word i >= 1 never is, and segment i of
    epoch e never reuses another (segment, epoch, shard)'s stream. The pool depends
    on the whole chain, so a change back to an earlier (n, B) does not restore the
    earlier plan (the rows below show one).

    Edges, decided: a change at step 0 is not a segment (t_0 = 0 < t_1 < ... is
    required): an epoch that starts on (n', B') is [(0, n', B')], a fresh epoch_plan
    (``LoaderState.resized`` replaces a segment that ran no step). A change at the
    epoch's end (t_{i+1} = t_i + S_i) gives a segment of 0 steps: fill has nothing
    left, and drop's unread samples stay skipped, so a state at the end of epoch e
    means the same as one at the start of e+1. A change after the end is refused
    (those steps ran on no shards), and so is any segment after a 0-step one. When
    fewer samples remain than new shards (m < n, fill), S_i = 1 and the shards whose
    run is empty hold B padding slots repeating R_i[lo], the smallest sample of the
    next non-empty run (real in that shard at that step); drop then has 0 steps. A
    batch larger than a run is allowed (fill pads; drop gives 0 steps). Every shard
    of a segment runs d_i steps. Padding slots are masked False and repeat a sample
    that is real at the same or an earlier step of the same segment.

    Counts: fill delivers every sample of range(N) in exactly one mask-True slot over
    the epoch. drop delivers each sample at most once, and exactly
    sum_i n_i * B_i * d_i of them (drop has no padding); the other
    N - sum_i n_i * B_i * d_i are skipped: the last segment's pool minus what it
    delivers. The epoch has t_last + d_last steps (``elastic_num_steps``); neither
    count depends on seed, epoch or shuffle.

    Worked (N=7, no shuffle; a batch is [..], shards left to right, ``*`` marks a
    padding slot (mask False); steps are the epoch's global steps):

        segments (start, n, B)   | policy | step 0       | step 1            | step 2     | steps
        -------------------------+--------+--------------+-------------------+------------+------
        (0,2,2)                  | fill   | [0,1] [3,4]  | [2,2*] [5,6]      |            | 2
        (0,2,2) (1,3,1)          | fill   | [0,1] [3,4]  | [2] [5] [6]       |            | 2
        (0,2,2) (1,3,1)          | drop   | [0,1] [3,4]  | (none: the end)   |            | 1
        (0,2,2) (1,2,1)          | fill   | [0,1] [3,4]  | [2] [5]           | [2*] [6]   | 3
        (0,2,2) (1,4,1)          | fill   | [0,1] [3,4]  | [2*] [2] [5] [6]  |            | 2
        (0,2,2) (1,1,4)          | fill   | [0,1] [3,4]  | [2,5,6,6*]        |            | 2
        (0,2,2) (2,3,1)          | fill   | [0,1] [3,4]  | [2,2*] [5,6]      | (none left)| 2
        (0,3,1) (1,2,1)          | drop   | [0] [2] [4]  | [1] [5]           | [3] [6]    | 3
        (0,2,1) (1,3,1) (2,2,1)  | fill   | [0] [3]      | [1] [2] [5]       | [4] [6]    | 3

    Row 2: the pool after step 0 is [2, 5, 6]; three runs of one. Row 3: drop's
    epoch on 2 shards has 1 step, so a change at step 1 is at its end: 2, 5 and 6
    stay skipped. Row 4: the same n with another B: runs [2] and [5, 6]. Row 5: 3
    samples on 4 shards; shard 0's run is empty and pads with 2. Row 6: a batch
    larger than the pool. Row 7: a change at the end, nothing left. Row 8:
    unchanged, drop on 3 shards skips 6; after the change nothing is skipped (the
    pool [1, 3, 5, 6] splits evenly). Row 9: back to 2 shards of 1, yet not
    epoch_plan(7, 2, 1)'s steps 2.. ([2] [5]). The epoch after row 2 is
    epoch_plan(7, 3, 1, epoch=1).

    Validated here (ValueError naming the parameter and its value): an unknown
    last_batch; num_samples < 1; seed or epoch outside [0, 2**32) (with or without
    shuffle); shuffle not a bool; an empty ``segments``; a segment that is not
    three integers; a start < 0, num_shards < 1 or > num_samples (a fresh epoch on
    it would have an empty shard), batch_size < 1; t_0 != 0; starts not strictly
    increasing; a start after the previous segment's end.
    """
    where = "elastic_plan"
    check_seed("seed", seed, where)
    check_seed("epoch", epoch, where)
    if not isinstance(shuffle, (bool, np.bool_)):
        raise ValueError(f"{where}: shuffle must be a bool, got {shuffle!r}")
    segments, steps = _elastic_steps(where, num_samples, segments, last_batch)
    taken = np.zeros(num_samples, bool)
    plans = []
    for i, ((_, n, B), (S, rows)) in enumerate(zip(segments, steps)):
        full = _segment_plan(np.flatnonzero(~taken), n, B, S, segment=i, epoch=epoch, seed=seed,
                             shuffle=bool(shuffle))
        plan = Plan(full.indices[:rows].copy(), full.mask[:rows].copy())
        taken[plan.indices[plan.mask]] = True
        plans.append(plan)
    return plans


def elastic_num_steps(num_samples: int, segments: Sequence, last_batch: str = "fill") -> int:
    """Global steps of the epoch ``elastic_plan`` describes: t_last + d_last (the last
    segment's start plus its steps). Equal to ``num_steps(N, n, B, last_batch)`` for one
    segment [(0, n, B)]. Validated as elastic_plan validates its segments."""
    segments, steps = _elastic_steps("elastic_num_steps", num_samples, segments, last_batch)
    return segments[-1].start + steps[-1][1]


def remaining_samples(num_samples: int, segments: Sequence, step: int, *, epoch: int = 0,
                      seed: int = 0, shuffle: bool = False, last_batch: str = "fill") -> np.ndarray:
    """The samples not delivered in a real slot of ``elastic_plan``'s epoch before global
    ``step``, ascending (int64): at a segment's start, its pool R_i. ``step`` must lie in
    [0, elastic_num_steps(...)]; at the end it is the empty array (fill) or the skipped
    samples (drop)."""
    plans = elastic_plan(num_samples, segments, epoch=epoch, seed=seed, shuffle=shuffle,
                         last_batch=last_batch)
    segments = [Segment(*s) for s in segments]
    end = segments[-1].start + len(plans[-1].indices)
    _check_int("remaining_samples", "step", step, 0)
    if step > end:
        raise ValueError(f"remaining_samples: step={step} is outside [0, {end}] (the epoch's steps)")
    taken = np.zeros(num_samples, bool)
    for (start, _, _), plan in zip(segments, plans):
        rows = max(0, min(step - start, len(plan.indices)))
        taken[plan.indices[:rows][plan.mask[:rows]]] = True
    return np.flatnonzero(~taken).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class LoaderState:
    """Where a loader stands in an epoch, as a small plain value a job saves with its
    checkpoint and a loader on other devices resumes from.

    ``step`` is the epoch's global step of the next batch (the number of steps of
    ``epoch`` already delivered); ``segments`` the epoch's shard sets so far, the last
    one being the shards that wrote the state (``elastic_plan``'s argument). A fresh
    epoch is ``LoaderState.start(...)``: segments ((0, n, B),), step 0.

    The JSON form (``to_json``/``from_json``) is one object with exactly the keys
    format ("loaders.LoaderState/1"), num_samples, seed, epoch, step, shuffle (a
    bool), last_batch and segments (a list of [start, num_shards, batch_size]):
    about 150 bytes, plus about 12 a segment (CIFAR-10 on 8, then 4, then 3 shards,
    the largest seed: 173). Validated on construction (ValueError naming the field
    and value): what ``elastic_plan`` validates, shuffle a bool, and step within
    [the last segment's start, the epoch's end]. A state resumes only the run it
    was taken in: ``check_same_run`` refuses another dataset size, seed, shuffle
    or last_batch by name.
    """
    num_samples: int
    seed: int
    epoch: int
    step: int
    shuffle: bool
    last_batch: str
    segments: tuple

    FORMAT = "loaders.LoaderState/1"

    def __post_init__(self):
        where = "LoaderState"
        for name in ("seed", "epoch"):
            _check_int(where, name, getattr(self, name), 0)
        if not isinstance(self.shuffle, (bool, np.bool_)):
            raise ValueError(f"{where}: shuffle must be a bool, got {self.shuffle!r}")
        check_seed("seed", self.seed, where)
        check_seed("epoch", self.epoch, where)
        segments, steps = _elastic_steps(where, self.num_samples, self.segments, self.last_batch)
        object.__setattr__(self, "segments", tuple(segments))
        object.__setattr__(self, "shuffle", bool(self.shuffle))
        for name in ("num_samples", "seed", "epoch"):
            object.__setattr__(self, name, int(getattr(self, name)))
        _check_int(where, "step", self.step, 0)
        first, end = segments[-1].start, segments[-1].start + steps[-1][1]
        if not first <= self.step <= end:
            raise ValueError(f"{where}: step={self.step} is outside [{first}, {end}] (the last "
                             f"segment's start .. the epoch's end)")
        object.__setattr__(self, "step", int(self.step))

    @classmethod
    def start(cls, num_samples: int, num_shards: int, batch_size: int, *, epoch: int = 0,
              seed: int = 0, shuffle: bool = False, last_batch: str = "fill") -> "LoaderState":
        """Step 0 of ``epoch`` on one set of shards: segments ((0, num_shards, batch_size),)."""
        return cls(num_samples, seed, epoch, 0, shuffle, last_batch, ((0, num_shards, batch_size),))

    @property
    def num_steps(self) -> int:
        """The epoch's global steps, ``elastic_num_steps(N, segments, last_batch)``."""
        return elastic_num_steps(self.num_samples, self.segments, self.last_batch)

    def at_step(self, step: int) -> "LoaderState":
        """The same epoch on the same shards at another ``step`` (validated as above)."""
        return dataclasses.replace(self, step=step)

    def saved_at(self, where: str, step, *, resumed: bool) -> "LoaderState":
        """What a loader's ``state(epoch, step)`` returns from this state: ``at_step(step)``,
        its ValueError prefixed with ``where`` and the step. A state the epoch was
        resumed from (``resumed``) also refuses a step before its own, where the
        resumed epoch starts. Every backend's ``state`` ends here."""
        if resumed and (not _is_int(step) or step < self.step):
            raise ValueError(f"{where}: step={step!r} is before the state's step {self.step}, "
                             f"where the resumed epoch starts")
        try:
            return self.at_step(step)
        except ValueError as error:
            raise ValueError(f"{where}: step={step!r}: {error}") from None

    def resized(self, num_shards: int, batch_size: int) -> "LoaderState":
        """The state a loader of ``num_shards`` shards of ``batch_size`` resumes from, at
        the same step. A last segment that has run no step yet (step == its start) is
        dropped first: it leaves no trace, so a resize at step 0 is a fresh epoch_plan
        on the new shards, and a resize back before a step ran restores the earlier
        plan. Then the segments are kept as they are when their last one has this
        (num_shards, batch_size) (the same shards continue their plan), and
        (step, num_shards, batch_size) is appended otherwise."""
        last = self.segments[-1]
        kept = self.segments[:-1] if self.step == last.start else self.segments
        if kept and (kept[-1].num_shards, kept[-1].batch_size) == (num_shards, batch_size):
            return dataclasses.replace(self, segments=kept)
        return dataclasses.replace(self, segments=kept + ((self.step, num_shards, batch_size),))

    def plan(self) -> tuple[Plan, int]:
        """(the last segment's Plan, the row of ``step`` in it): the shards run rows
        ``row ..`` of it, so shard k's remaining samples are ``plan.indices[row:, k]``
        (global step ``step + r`` is row ``row + r``)."""
        plans = elastic_plan(self.num_samples, self.segments, epoch=self.epoch, seed=self.seed,
                             shuffle=self.shuffle, last_batch=self.last_batch)
        return plans[-1], self.step - self.segments[-1].start

    def next_epoch(self) -> "LoaderState":
        """Step 0 of epoch + 1 on the last segment's shards: a fresh epoch_plan there."""
        last = self.segments[-1]
        return LoaderState.start(self.num_samples, last.num_shards, last.batch_size,
                                 epoch=self.epoch + 1, seed=self.seed, shuffle=self.shuffle,
                                 last_batch=self.last_batch)

    def check_same_run(self, where: str, *, num_samples: int, seed: int, shuffle: bool,
                       last_batch: str) -> None:
        """Raises ValueError, naming the first field that differs, unless the state was
        taken with this dataset size, seed, shuffle and last_batch (a state of another
        run would deliver another epoch's samples)."""
        for name, mine in (("num_samples", num_samples), ("seed", seed), ("shuffle", shuffle),
                           ("last_batch", last_batch)):
            theirs = getattr(self, name)
            if theirs != mine or name == "shuffle" and not isinstance(mine, (bool, np.bool_)):
                raise ValueError(f"{where}: the loader state was taken with {name}={theirs!r}, "
                                 f"this run has {name}={mine!r}; a state resumes only the run it "
                                 f"was taken in")

    def to_json(self) -> str:
        import json  # local: this section leaves the module's imports as they are
        return json.dumps({"format": self.FORMAT, "num_samples": self.num_samples, "seed": self.seed,
                           "epoch": self.epoch, "step": self.step, "shuffle": self.shuffle,
                           "last_batch": self.last_batch,
                           "segments": [list(s) for s in self.segments]}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "LoaderState":
        """The state ``to_json`` wrote. ValueError for text that is not JSON, another
        format, a missing or unknown key, or a value the constructor refuses."""
        import json
        try:
            doc = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"LoaderState.from_json: not a JSON document ({e})") from None
        keys = ("format", "num_samples", "seed", "epoch", "step", "shuffle", "last_batch", "segments")
        if not isinstance(doc, dict) or set(doc) != set(keys):
            got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"LoaderState.from_json: expected an object with keys {list(keys)}, "
                             f"got {got}")
        if doc["format"] != cls.FORMAT:
            raise ValueError(f"LoaderState.from_json: format={doc['format']!r}, expected {cls.FORMAT!r}")
        if not isinstance(doc["segments"], list):
            raise ValueError(f"LoaderState.from_json: segments={doc['segments']!r} is not a list")
        return cls(**{k: doc[k] for k in keys[1:-1]}, segments=tuple(doc["segments"]))


def resume_state(where: str, state, epoch: int, *, num_samples: int, seed: int, shuffle: bool,
                 last_batch: str, num_shards: int, batch_size: int) -> LoaderState:
    """The state from which a loader of this run (``num_samples``, ``seed``, ``shuffle``,
    ``last_batch``) over ``num_shards`` shards of ``batch_size`` resumes ``epoch``:
    ``state`` resized to those shards (``LoaderState.resized``), after checking that it is
    a LoaderState, of this run (``check_same_run``) and of this epoch. ValueError naming
    ``where`` otherwise. Every backend that resumes from a state (Loader, and the vendor
    loaders built on this module) checks it here."""
    if not isinstance(state, LoaderState):
        raise ValueError(f"{where}: state must be a loaders.LoaderState (LoaderState.from_json "
                         f"reads a saved one), got {type(state).__name__}")
    state.check_same_run(where, num_samples=num_samples, seed=seed, shuffle=shuffle, last_batch=last_batch)
    if epoch != state.epoch:
        raise ValueError(f"{where}: epoch={epoch!r}, but the state is of epoch {state.epoch}; a state "
                         f"resumes its own epoch (the next one is fresh: epoch({state.epoch + 1}))")
    return state.resized(num_shards, batch_size)


def _check_int(where: str, name: str, value, minimum: int) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{where}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")


def _elastic_steps(where: str, num_samples: int, segments,
                   last_batch: str) -> tuple[list[Segment], list[tuple[int, int]]]:
    """(the validated segments, [(S_i, d_i)]) of elastic_plan's text, from counts alone."""
    _check_policy(last_batch)
    _check_int(where, "num_samples", num_samples, 1)
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence) or not segments:
        raise ValueError(f"{where}: segments must be a non-empty list of (start, num_shards, "
                         f"batch_size), got {segments!r}")
    checked = []
    for i, segment in enumerate(segments):
        if isinstance(segment, (str, bytes)) or not isinstance(segment, Sequence) or len(segment) != 3:
            raise ValueError(f"{where}: segments[{i}]={segment!r} is not (start, num_shards, batch_size)")
        for name, value, minimum in zip(Segment._fields, segment, (0, 1, 1)):
            _check_int(where, f"segments[{i}].{name}", value, minimum)
        if segment[1] > num_samples:
            raise ValueError(f"{where}: segments[{i}].num_shards={segment[1]} is more than "
                             f"num_samples={num_samples}; a fresh epoch on it would have an empty shard")
        checked.append(Segment(*(int(v) for v in segment)))
    if checked[0].start != 0:
        raise ValueError(f"{where}: segments[0].start={checked[0].start}; the first segment starts "
                         f"at step 0")
    steps = []
    m, ended = num_samples, False
    for i, (start, n, B) in enumerate(checked):
        if i:
            prev = checked[i - 1]
            S_prev = steps[-1][0]
            if start <= prev.start:
                raise ValueError(f"{where}: segments[{i}].start={start} is not after segments[{i - 1}]"
                                 f".start={prev.start}; starts must increase (a resize before a "
                                 f"segment's first step replaces it)")
            if start > prev.start + S_prev:
                raise ValueError(f"{where}: segments[{i}].start={start} is after the epoch's end at "
                                 f"step {prev.start + S_prev} (segments[{i - 1}]={tuple(prev)} has "
                                 f"{S_prev} steps)")
            rows = start - prev.start
            steps[-1] = (S_prev, rows)
            m -= sum(min(rows * prev.batch_size, m * (k + 1) // prev.num_shards - m * k // prev.num_shards)
                     for k in range(prev.num_shards))
            ended = rows == S_prev
        if ended:
            S = 0
        elif last_batch == "fill":
            S = -(-(-(-m // n)) // B)
        else:
            S = (m // n) // B
        steps.append((S, S))
    return checked, steps


def _segment_plan(pool: np.ndarray, n: int, B: int, steps: int, *, segment: int, epoch: int,
                  seed: int, shuffle: bool) -> Plan:
    """elastic_plan's text for one segment: the (steps, n, B) plan over ``pool`` (ascending)."""
    m, slots = len(pool), steps * B
    indices = np.empty((n, slots), np.int64)
    mask = np.zeros((n, slots), bool)
    for k in range(n):
        lo, hi = m * k // n, m * (k + 1) // n
        order = pool[lo:hi]
        if shuffle:
            order = order[_segment_permutation(hi - lo, seed=seed, epoch=epoch, shard=k, segment=segment)]
        real = min(slots, len(order))
        indices[k, :real] = order[:real]
        if real < slots:  # slots > 0 implies m >= 1, so pool[lo] exists (lo < m)
            indices[k, real:] = order[real - 1] if real else pool[lo]
        mask[k, :real] = True
    shape = (n, steps, B)
    return Plan(indices.reshape(shape).swapaxes(0, 1).copy(), mask.reshape(shape).swapaxes(0, 1).copy())


def _segment_permutation(size: int, *, seed: int, epoch: int, shard: int, segment: int) -> np.ndarray:
    if segment == 0:
        return shard_permutation(size, seed=seed, epoch=epoch, shard=shard)
    check_seed("segment", segment, "elastic_plan")
    keys = np.random.PCG64(np.random.SeedSequence([seed, epoch, shard, segment])).random_raw(size)
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


# --------------------------------------------------------------------------
# Per-image arithmetic: the vendors' crop_mirror_normalize, as a table
# --------------------------------------------------------------------------
#
# Read in the vendors' source (ROCm/rocAL develop and rocm-6.4.1, ROCm/rpp,
# NVIDIA/DALI 2.4):
#
# rocAL: rocAL/source/augmentations/.../node_crop_mirror_normalize.cpp computes,
#   in float32, inv[c] = 1 / std[c] and offset[c] = -(mean[c] * inv[c]) (one
#   channel: offset = -(mean / std)); RPP applies one fused multiply-add per
#   pixel, fmaf(x, inv, offset), rounded once (rpp: src/modules/cpu/kernel/
#   crop_mirror_normalize.hpp, _mm256_fmadd_ps; HIP kernel: pix * inv + offset
#   in float32, contracted to an FMA). Crop anchor nearbyintf(crop_pos *
#   (W - cw)) on a float32 product: half to even. Default mirror=1.
# DALI: dali/kernels/slice/slice_flip_normalize_permute_pad_cpu.h computes
#   (float(x) - mean[c]) * inv_stddev[c] with inv_stddev = 1 / std in float32:
#   a subtract and a multiply, two roundings. Crop anchor: std::round (half
#   away from zero) of double(crop_pos) * (W - cw) (its rounding="round"
#   default; dali/operators/image/crop/crop_attr.cc, shared by CPU and GPU).
#   Default mirror=0. GPU (dali_gpu): new_crop_mirror_normalize.cu and
#   dali/kernels/slice/slice_flip_normalize_gpu*.cu(h): fmaf(x, inv, -(mean*inv)).
#
# Neither is (x - mean) / std: for mean = std = 127.5 that differs from rocAL's
# result on 223 of the 256 uint8 values (by 1 ulp).


def normalize_table(mean: Sequence[float], std: Sequence[float], arithmetic: str = "rocal") -> np.ndarray:
    """(C, 256) float32: the vendor's normalised value of each uint8 pixel value, per channel.

    Inputs: ``mean`` and ``std`` hold C real numbers each (``numbers.Real``: Python
    ints and floats, ``fractions.Fraction``, NumPy integer and floating scalars,
    ``np.longdouble`` included; also 0-d NumPy or JAX arrays of an integer or
    float dtype, as iterating a JAX array gives). Each entry is converted by Python's ``float()``
    to a double (correctly rounded, ties to even) and that double is rounded to
    float32: a value that is not a double is rounded twice, as the vendors'
    Python bindings round it. For example 1 + 2**-24 + 2**-60 (a Fraction or a
    long double) becomes the double 1 + 2**-24, a float32 tie, so m = 1.0 (rounded
    once from the exact value it would be 1 + 2**-23); so does 2**60 + 2**36 + 1
    (an int), to m = 2**60. ``Normalize`` stores the same doubles, so its table
    and every placement agree with this function for any such input.

    Arithmetic: IEEE 754 binary32, every operation's exact result rounded once
    to nearest, ties to even. Per channel c (x = 0..255 is exact in float32):

        m   = f32(float(mean[c]))
        s   = f32(float(std[c]))
        inv = 1 / s                                   # float32 division
        "rocal":    off = -(m / s) if C == 1 else -(m * inv)
                    table[c, x] = fma(x, inv, off)    # x * inv + off exactly, rounded once
        "dali_gpu": off = -(m * inv)                  # for every C
                    table[c, x] = fma(x, inv, off)
        "dali_cpu": table[c, x] = (x - m) * inv       # a subtract, then a multiply

    Why these: each is the vendor's own arithmetic, read in its source (see the
    comment above this function): rocAL's node computes the one-channel offset
    as -(mean / std) and the multi-channel one as -(mean * inv), so both are
    kept; DALI's GPU kernel folds the mean into one FMA, its CPU kernel does not.

    Signs of zeros, IEEE 754's rules: a non-zero exact result that rounds to
    zero (underflow) keeps its sign; an exact zero product or quotient is -0.0
    iff exactly one operand is negative; an exact zero sum (an fma's exact
    product plus off; x - m) is -0.0 iff both terms are -0.0, else +0.0;
    ``-(v)`` flips the sign bit. So "dali_cpu" with mean 1e-45 (m = 2**-149)
    and std 255 gives table[0, 0] = (-2**-149) * inv, which underflows to -0.0;
    "rocal" with mean -0.0 and std -2.0 gives off = -(-0.0 / -2.0) = -0.0 and
    table[0, 0] = fma(0, -0.5, -0.0) = -0.0. NaN is refused (below), so no NaN
    payload reaches a table.

    Validated here: ValueError for an unknown arithmetic; mean or std not a
    one-dimensional sequence of real numbers (a scalar, a string, a 2-d array),
    of different lengths or empty (there is no broadcasting: a one-entry mean
    is a one-channel table, and ``crop_mirror_normalize`` refuses it for
    3-channel images); a mean or std that is not finite after f32 (NaN, inf,
    beyond float32's range, or beyond a double's for ``float()``); a std whose
    f32 is zero or subnormal (its inverse would overflow); or any inv, offset
    or table entry that overflows float32. Subnormal means are accepted.
    Negative stds are accepted (the arithmetic is defined).
    """
    return _table(_table_key(mean, std, arithmetic, "normalize_table")).copy()


def _table_key(mean, std, arithmetic: str, where: str) -> tuple[bytes, bytes, str]:
    """What determines a table's bits, exactly: the float32 bit patterns of mean
    and std (so -0.0 and 0.0 are different keys; a NaN is refused before) and
    the arithmetic. Every table cache is keyed by this."""
    mean32, std32 = _mean_std(mean, std, where)
    return mean32.tobytes(), std32.tobytes(), _check_arithmetic(arithmetic)


@functools.lru_cache(maxsize=64)
def _table(key: tuple[bytes, bytes, str]) -> np.ndarray:
    mean32, std32 = np.frombuffer(key[0], np.float32), np.frombuffer(key[1], np.float32)
    channels, arithmetic = len(mean32), key[2]
    where = f"normalize_table: mean={mean32.tolist()}, std={std32.tolist()}"
    with np.errstate(over="ignore", invalid="ignore"):
        inv = np.float32(1) / std32
        x = np.arange(256, dtype=np.float32)
        if arithmetic == "dali_cpu":
            table = ((x[None, :] - mean32[:, None]) * inv[:, None]).astype(np.float32)
            offset = inv
        else:
            one_channel_rocal = arithmetic == "rocal" and channels == 1
            offset = -(mean32 / std32) if one_channel_rocal else -(mean32 * inv)
            table = None
    if not (np.isfinite(inv).all() and np.isfinite(offset).all()):
        raise ValueError(f"{where}: 1/std or the offset overflows float32 ({arithmetic!r})")
    if table is None:
        table = np.empty((channels, 256), np.float32)
        for c in range(channels):
            scale, shift = Fraction(float(inv[c])), Fraction(float(offset[c]))
            for value in range(256):
                exact = value * scale + shift
                if exact == 0:  # IEEE 754's sign of an exact zero from an FMA
                    table[c, value] = np.float32(value) * inv[c] + offset[c]
                else:
                    table[c, value] = _nearest_float32(exact, where)
    if not np.isfinite(table).all():
        raise ValueError(f"{where}: a table entry overflows float32 ({arithmetic!r})")
    table.flags.writeable = False
    return table


_FLOAT32_MAX = Fraction(float(np.finfo(np.float32).max))
_FLOAT32_HALF_ULP_AT_MAX = Fraction(2) ** (127 - 24)  # past max + this, r32 overflows


def _nearest_float32(exact: Fraction, where: str = "") -> np.float32:
    """``exact`` (non-zero) rounded once to float32, ties to even; ValueError on overflow."""
    if abs(exact) >= _FLOAT32_MAX + _FLOAT32_HALF_ULP_AT_MAX:
        raise ValueError(f"{where}: a value overflows float32")
    with np.errstate(over="ignore"):
        guess = np.float32(float(exact))  # within one float32 step of the answer
    if not np.isfinite(guess):
        guess = np.float32(np.copysign(np.finfo(np.float32).max, float(exact)))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    candidates = [c for c in candidates if np.isfinite(c)]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact), int(c.view(np.uint32)) & 1))


def crop_anchor(pos: float, size: int, crop: int, arithmetic: str = "rocal") -> int:
    """First row (or column) of a ``crop``-long window in ``size`` at relative ``pos``:

        p = r32(pos)                       # pos rounded to float32 first (RNE)
        d = size - crop                    # an integer, exact
        "rocal":                 t = r32(p * d)   # a float32 product, rounded once
                                 anchor = round t half to even    (nearbyintf)
        "dali_cpu", "dali_gpu":  t = p * d        # double(p) times the span: exact
                                 anchor = floor(t + 1/2)  (std::round: half away from zero)

    rocAL: nearbyintf of a float32 product (RocalCropParam::fill_crop_dims). DALI,
    CPU and GPU operators alike, computes the anchor on the host in
    CropAttr::CalculateAnchor (dali/operators/image/crop/crop_attr.cc) from
    double(float32 pos): pos=0.7, span 5 is 3.4999999 -> 3 there, where a float32
    product would give 3.5 -> 4. The anchor lies in [0, size - crop]. Validated
    here: ValueError for an unknown arithmetic, crop outside [1, size], or pos
    outside [0, 1] (NaN included).
    """
    _check_arithmetic(arithmetic)
    if not 0 < crop <= size:
        raise ValueError(f"crop_anchor: crop={crop} does not fit in size={size}")
    if not 0.0 <= pos <= 1.0:
        raise ValueError(f"crop_anchor: pos={pos} must lie in [0, 1]")
    if arithmetic == "rocal":
        return int(np.rint(float(np.float32(pos) * np.float32(size - crop))))  # exact in float64
    product = float(np.float32(pos)) * (size - crop)  # exact in float64
    whole = int(np.floor(product))
    return whole + (product - whole >= 0.5)  # product >= 0: half away from zero


def crop_mirror_normalize(images_NCHW: np.ndarray, *, crop: tuple[int, int] | None = None,
                          mirror=False, mean: Sequence[float] = (0.0, 0.0, 0.0),
                          std: Sequence[float] = (1.0, 1.0, 1.0),
                          crop_pos: tuple[float, float] = (0.5, 0.5), arithmetic: str = "rocal",
                          out: np.ndarray | None = None) -> np.ndarray:
    """A vendor's crop_mirror_normalize on uint8 NCHW images; float32 NCHW out.

    With ``table = normalize_table(mean, std, arithmetic)`` (mean and std in pixel
    units, 0..255, exactly C entries each: no broadcasting), ``(ch, cw) = crop``
    (default: the whole image), ``y0 = crop_anchor(crop_pos[0], H, ch,
    arithmetic)``, ``x0 = crop_anchor(crop_pos[1], W, cw, arithmetic)``:

        out[n, c, y, x] = table[c, images[n, c, y0 + y, x0 + x']]
        x' = cw - 1 - x if mirror[n] else x     # a horizontal flip inside the window

    So crop, then flip, then normalise: the output is a pure lookup, and no other
    rounding happens. ``mirror`` is a bool (every image) or a bool array (N,).

    Validated here: ValueError for images that are not uint8 4-d, mean/std without
    exactly C entries (or anything normalize_table refuses), a crop larger than
    the image or < 1 (rocAL clamps it silently), a crop_pos outside [0, 1], a
    mirror of another shape, or an ``out`` that is not float32 (N, C, ch, cw).
    ``out``: the array to write into (default: a new one, 64-byte aligned so that
    JAX on CPU can use it in place).
    """
    images_NCHW = np.asarray(images_NCHW)
    if images_NCHW.ndim != 4 or images_NCHW.dtype != np.uint8:
        raise ValueError(f"crop_mirror_normalize: images must be uint8 NCHW, got "
                         f"{images_NCHW.dtype} {images_NCHW.shape}")
    n, c, h, w = images_NCHW.shape
    table = _table(_table_key(mean, std, arithmetic, "crop_mirror_normalize"))
    if table.shape[0] != c:
        raise ValueError(f"crop_mirror_normalize: mean and std need {c} entries (one per channel), "
                         f"got mean={list(mean)}, std={list(std)}")
    y0, x0, ch, cw = crop_window((h, w), crop, crop_pos, arithmetic)
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
    window = images_NCHW[:, :, y0:y0 + ch, x0:x0 + cw]
    if flip.any():
        window = np.where(flip[:, None, None, None], window[..., ::-1], window)
    if _one_row(table):  # one table for every channel, bit for bit: one lookup
        np.take(table[0], window, out=out, mode="clip")
    else:
        for channel in range(c):
            out[:, channel] = np.take(table[channel], window[:, channel])
    return out


def crop_window(image_hw: tuple[int, int], crop: tuple[int, int] | None,
                crop_pos: tuple[float, float], arithmetic: str = "rocal") -> tuple[int, int, int, int]:
    """``(y0, x0, ch, cw)``: the crop window in an image of ``image_hw``; ValueError if it does not fit."""
    h, w = image_hw
    ch, cw = (h, w) if crop is None else crop
    if not (0 < ch <= h and 0 < cw <= w):
        raise ValueError(f"crop_mirror_normalize: crop={crop} does not fit in images of {h}x{w}")
    if not all(0.0 <= p <= 1.0 for p in crop_pos):
        raise ValueError(f"crop_mirror_normalize: crop_pos={crop_pos} must lie in [0, 1]")
    return (crop_anchor(crop_pos[0], h, ch, arithmetic), crop_anchor(crop_pos[1], w, cw, arithmetic),
            ch, cw)


def aligned_empty(shape: tuple[int, ...], dtype, align: int = 64) -> np.ndarray:
    """``np.empty`` whose data starts on an ``align``-byte boundary.

    JAX's CPU client wraps a 64-byte-aligned host buffer without copying it (it
    copies anything else); NumPy's allocator only promises 16 bytes.
    """
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _doubles(name: str, values, where: str) -> tuple[float, ...]:
    """``values`` as a tuple of doubles, each entry converted by ``float()`` (normalize_table's text)."""
    try:
        one_dimensional = np.iterable(values) and np.ndim(values) == 1
    except ValueError:  # a ragged nesting
        one_dimensional = False
    if isinstance(values, (str, bytes)) or not one_dimensional:
        raise ValueError(f"{where}: {name} must be a sequence of real numbers, one per channel, "
                         f"got {values!r}")
    out = []
    for value in values:
        zero_d = hasattr(value, "dtype") and np.ndim(value) == 0 and np.dtype(value.dtype).kind in "biuf"
        if not (isinstance(value, numbers.Real) or zero_d):
            raise ValueError(f"{where}: {name}={list(values)!r} holds {value!r} of type "
                             f"{type(value).__name__}, not a real number (int, float, Fraction, "
                             f"NumPy scalar)")
        try:
            out.append(float(value))
        except OverflowError:
            raise ValueError(f"{where}: {name}={list(values)!r}: {value!r} is beyond a double's "
                             f"range, so not finite") from None
    return tuple(out)


def _mean_std(mean, std, where: str) -> tuple[np.ndarray, np.ndarray]:
    """mean and std as float32: float() of each entry, then rounded to float32 (RNE),
    checked as normalize_table states."""
    mean, std = _doubles("mean", mean, where), _doubles("std", std, where)
    with np.errstate(over="ignore"):
        mean32 = np.array(mean, np.float64).astype(np.float32)
        std32 = np.array(std, np.float64).astype(np.float32)
    if len(mean) != len(std) or not mean:
        raise ValueError(f"{where}: mean and std need one entry per channel, "
                         f"got mean={list(mean)}, std={list(std)}")
    if not (np.isfinite(mean32).all() and np.isfinite(std32).all()):
        raise ValueError(f"{where}: mean and std must be finite float32 values, got "
                         f"mean={list(mean)}, std={list(std)}")
    if np.any(std32 == 0):
        raise ValueError(f"{where}: std has a zero entry: std={std32.tolist()}")
    if np.any(np.abs(std32) < np.finfo(np.float32).smallest_normal):
        raise ValueError(f"{where}: std has a subnormal float32 entry (1/std would "
                         f"overflow): std={list(std)}")
    return mean32, std32


def _check_arithmetic(arithmetic: str) -> str:
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"arithmetic must be one of {ARITHMETICS}, got {arithmetic!r}")
    return arithmetic


@dataclasses.dataclass(frozen=True, eq=False)
class Normalize:
    """What the loader applies to each image: a vendor's crop_mirror_normalize.

    The default is the rocAL notebook's: no crop, no flip, mean = std = 127.5 per
    channel, rocAL's arithmetic. ``arithmetic`` picks whose bits ("rocal" or
    "dali_cpu" or "dali_gpu"), also for the crop anchor's rounding; ``table`` is the (C, 256)
    specification. The DALI notebook's MNIST is ``Normalize(mean=(0.0,),
    std=(255.0,), arithmetic="dali_cpu")``.

    ``mean`` and ``std`` take what ``normalize_table`` takes (any real numbers)
    and are stored as tuples of ``float()`` of each entry, the doubles
    normalize_table rounds to float32; ``crop_pos`` likewise. ``crop`` is None
    or two ints, ``mirror`` a bool. Two Normalize are equal (and hash alike)
    exactly when every field is the same, floats bit for bit: mean 0.0 and
    -0.0, whose tables differ, are different values. The images it takes are
    uint8 (N, C, H, W) with C = len(mean), channels first (NCHW).
    """
    mean: tuple[float, ...] = (127.5, 127.5, 127.5)
    std: tuple[float, ...] = (127.5, 127.5, 127.5)
    mirror: bool = False
    crop: tuple[int, int] | None = None
    crop_pos: tuple[float, float] = (0.5, 0.5)
    arithmetic: str = "rocal"

    def __post_init__(self):
        _mean_std(self.mean, self.std, "Normalize")
        _check_arithmetic(self.arithmetic)
        if self.mirror not in (True, False):
            raise ValueError(f"Normalize: mirror must be a bool, got {self.mirror!r}")
        crop = self.crop
        if crop is not None and (np.ndim(crop) != 1 or len(crop) != 2 or not all(
                isinstance(c, numbers.Integral) and not isinstance(c, (bool, np.bool_)) for c in crop)):
            raise ValueError(f"Normalize: crop must be None or two ints (height, width), got {crop!r}")
        crop_pos = _doubles("crop_pos", self.crop_pos, "Normalize")
        if len(crop_pos) != 2:
            raise ValueError(f"Normalize: crop_pos must be two numbers (y, x), got {self.crop_pos!r}")
        # Plain Python values whatever was passed (lists, NumPy scalars): a Normalize is a hashable value.
        object.__setattr__(self, "mean", _doubles("mean", self.mean, "Normalize"))
        object.__setattr__(self, "std", _doubles("std", self.std, "Normalize"))
        object.__setattr__(self, "mirror", bool(self.mirror))
        object.__setattr__(self, "crop", None if crop is None else tuple(int(c) for c in crop))
        object.__setattr__(self, "crop_pos", crop_pos)

    def _identity(self) -> tuple:
        # The floats by their bit patterns: 0.0 == -0.0 as floats, not as bits.
        floats = np.array(self.mean + self.std + self.crop_pos, np.float64).tobytes()
        return floats, len(self.mean), self.mirror, self.crop, self.arithmetic

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._identity() == other._identity()

    def __hash__(self):
        return hash(self._identity())

    @property
    def table(self) -> np.ndarray:
        return normalize_table(self.mean, self.std, self.arithmetic)

    def window(self, image_hw: tuple[int, int]) -> tuple[int, int, int, int]:
        return crop_window(image_hw, self.crop, self.crop_pos, self.arithmetic)

    def output_shape(self, image_chw: tuple[int, ...]) -> tuple[int, int, int]:
        """(C, ch, cw) of a normalised image of ``image_chw`` = (C, H, W); ValueError
        if that is not 3-d, or mean/std or the crop do not fit it."""
        if len(image_chw) != 3:
            raise ValueError(f"Normalize: images must be (N, C, H, W), one image (C, H, W), got an image "
                             f"of shape {tuple(image_chw)}")
        c, h, w = image_chw
        if len(self.mean) != c:
            hint = ""
            if image_chw[-1] == len(self.mean):
                hint = (f"; these look channels-last (NHWC): NCHW expected, pass "
                        f"images.transpose(0, 3, 1, 2)")
            raise ValueError(f"Normalize: mean and std need {c} entries (one per channel of images "
                             f"{tuple(image_chw)}, channels first), got mean={list(self.mean)}{hint}")
        return (c,) + self.window((h, w))[2:]

    def __call__(self, images_NCHW: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return crop_mirror_normalize(images_NCHW, crop=self.crop, mirror=self.mirror, mean=self.mean,
                                     std=self.std, crop_pos=self.crop_pos, arithmetic=self.arithmetic,
                                     out=out)


def device_normalize(images_u8: jax.Array, table: jax.Array, window: tuple[int, int, int, int],
                     mirror: bool) -> jax.Array:
    """The same arithmetic in JAX, for traced uint8 (..., C, H, W): crop, flip, then a
    gather from ``table`` (C, 256), or (1, 256) when every channel has the same
    table, so the bits are the table's on every device."""
    y0, x0, ch, cw = window
    x = images_u8[..., y0:y0 + ch, x0:x0 + cw].astype(jnp.int32)
    if mirror:
        x = jnp.flip(x, axis=-1)
    channels = table.shape[0]
    if channels == 1:  # one table for every channel: a plain lookup, 1.6x faster on CPU
        return jnp.take(table[0], x, mode="clip")
    rows = (256 * jnp.arange(channels, dtype=jnp.int32)).reshape(channels, 1, 1)
    return jnp.take(table.reshape(-1), x + rows, mode="clip")


# --------------------------------------------------------------------------
# Devices, meshes and global arrays
# --------------------------------------------------------------------------


def data_mesh(devices: Sequence[jax.Device] | Mesh) -> Mesh:
    """A one-axis mesh named 'data' over ``devices``, keeping their order exactly.

    Built with ``jax.sharding.Mesh`` (``jax.make_mesh`` may reorder devices on
    accelerators), so mesh position k, and with it shard k, is ``devices[k]``.
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
    array = np.empty(len(devices), object)
    array[:] = devices
    # Auto axes: jit propagates the batch's sharding, as the notebooks rely on.
    return Mesh(array, (DATA_AXIS,), axis_types=(AxisType.Auto,))


def local_positions(mesh: Mesh) -> list[int]:
    """Mesh positions (= shard indices) of this process's devices, ascending."""
    return [k for k, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]


def split_rows(rows: dict[str, np.ndarray], positions: list[int]) -> dict[int, dict[str, np.ndarray]]:
    """Rows (len(positions) * B, ...) holding the blocks of ``positions`` one after the
    other, as {position: block} (views): block j of the rows belongs to positions[j]."""
    size = len(rows["mask"]) // len(positions)
    return {k: {name: x[j * size:(j + 1) * size] for name, x in rows.items()}
            for j, k in enumerate(positions)}


def global_batch(blocks: dict[int, dict[str, np.ndarray]], mesh: Mesh, layout: str = "sharded"):
    """Global ``jax.Array``s from per-shard blocks: block k goes to mesh position k.

    ``blocks[k]`` maps each name ("images", "labels", "mask") to shard k's rows
    (B, ...): NumPy arrays, or jax.Arrays (a vendor's output), copied to device k
    if they are elsewhere. Only the shards whose device belongs to this process
    need to be present, so the same call builds the same global batch in every
    process of a multi-process run. Layouts, both ``NamedSharding(mesh, P('data'))``:

    * "sharded": (n*B, ...), what jit on sharded arrays takes;
    * "pmap": (n, B, ...), what pmap and DALI's devices= give.
    """
    _check_layout(layout)
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
    _check_layout(layout)
    n = mesh.devices.size
    local = local_positions(mesh)
    n_local = len(local)
    if local != list(range(local[0], local[0] + n_local)):
        # This process's rows are not one contiguous slice of the global batch
        # (a hand-made mesh that interleaves processes): place block by block.
        return global_batch(split_rows(rows, local), mesh, layout)
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    out = {}
    for name, x in rows.items():
        block = x.reshape((n_local, -1) + x.shape[1:])
        if layout == "sharded":
            out[name] = jax.make_array_from_process_local_data(sharding, x, (n * block.shape[1],) + x.shape[1:])
        else:
            out[name] = jax.make_array_from_process_local_data(sharding, block, (n,) + block.shape[1:])
    return out


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


# --------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------

MASK = "mask"  # the name every batch adds; refused as a name in the data


@dataclasses.dataclass(frozen=True)
class Loader:
    """A sharded epoch iterator over an in-memory (or memory-mapped) dataset of named arrays.

    Build it with ``make_loader``. ``arrays`` is the dataset: name -> host array
    (N, ...), row i of every array being sample i ("images" and "labels" (int32)
    for ``make_loader``'s tuple form and a CIFAR-10 folder). ``len(loader)`` is
    the number of steps in every epoch, equal on every shard.
    ``loader.epoch(e)`` yields one dict per step, ``loader.batch(e, s)`` is step
    s alone (random access), ``loader.plan(e)`` is the epoch's ``Plan``.

    A batch holds every name of ``arrays``, in its order, then "mask" (bool):
    global ``jax.Array``s in ``layout``, "sharded" (n*B, ...) or "pmap" (n, B,
    ...), both ``NamedSharding(mesh, P('data'))``, block k (rows k*B..k*B+B-1, or
    row k for "pmap") on the device at mesh position k. With P = plan(e), for
    every name, step s and shard k:

        block k of name   = f(arrays[name][P.indices[s, k]])
        block k of "mask" = P.mask[s, k]

    where f is ``normalizers[name]`` when there is one (a ``Normalize``: its
    ``crop_mirror_normalize``, float32 (B, C, ch, cw) looked up in
    ``normalize_table``; a callable: what it returns) and otherwise the
    identity: the rows bit for bit as stored, dtype and shape kept. So every name follows the same plan, mask, resume and device order,
    and batches are fully determined by (seed, epoch, step): two loaders with
    the same arguments yield equal batches, whatever their placement.

    ``normalize`` is what ``make_loader`` resolved: a dict name -> Normalize or
    callable for a dict dataset; for the tuple form and a folder, what applies
    to "images" (a Normalize, a callable or None). ``normalizers`` gives either
    as one dict, name -> Normalize or callable.

    Placements (where the per-step work happens):

    * "host": the host gathers each step's rows into one buffer per name and
      moves them as stored (uint8 images: a quarter of the float32 bytes); each
      device crops, flips and looks the table up on its own block of every
      normalised name (jit + shard_map).
    * "device": shard k's samples of every name live on device k for the
      loader's life (about N/n samples per device, padded to the largest
      shard), the epoch's plan goes to the devices once per epoch, and each step
      is one dispatch that gathers and normalises on every device: no host work
      per step.
    * "host_float32": the host normalises (into float32 for a Normalize) and
      moves that; the only placement that accepts any callable in
      ``normalize``.

    The three give the same bits, in both layouts.

    Resuming on other devices (``elastic_plan``, ``LoaderState``). A job saves
    ``loader.state(e, s)`` (after s steps of epoch e: a small plain value,
    ``to_json``); a loader on any other mesh or batch size, built by
    ``make_loader`` from the same data, seed, shuffle and last_batch, resumes
    with ``loader.epoch(e, state=saved)``. With ``st = saved.resized(n, B)``
    (this loader's shard count and batch) and ``plan, row = st.plan()``, that
    iterator yields global steps ``st.step .. st.num_steps - 1`` of the epoch,
    ``st.num_steps - st.step`` of them, where step ``st.step + r`` is
    ``Plan`` row ``row + r`` by the rule above: so the epoch's samples not yet
    delivered in a real slot before the change are delivered exactly once
    (fill; at most once with elastic_plan's stated count for drop), on every
    name, in every placement and layout, with the same bits. Its state after
    k more steps is ``loader.state(e, st.step + k, state=saved)``. ``len(loader)``
    keeps meaning a fresh epoch, and epoch e + 1 is fresh on this loader's
    shards (``loader.epoch(e + 1)``). In placement "device" a resumed segment on
    other shards first places, once, what its shards still need: on device k the
    distinct samples of ``plan.indices[row:, k]`` (at most ceil(m/n) samples,
    m the samples left), beside the resident shard.
    """
    arrays: dict[str, np.ndarray]
    mesh: Mesh
    batch_size: int
    layout: str = "sharded"
    shuffle: bool = False
    seed: int = 0
    last_batch: str = "fill"
    normalize: Normalize | Callable | dict | None = None
    prefetch: int = 2
    placement: str = "host"
    resident: dict | None = dataclasses.field(default=None, repr=False)  # placement="device"

    @property
    def images(self) -> np.ndarray:
        """``arrays["images"]`` (the tuple form's samples)."""
        return self._array("images")

    @property
    def labels(self) -> np.ndarray:
        """``arrays["labels"]`` (the tuple form's int32 labels)."""
        return self._array("labels")

    def _array(self, name: str) -> np.ndarray:
        if name not in self.arrays:
            raise AttributeError(f"Loader: this dataset has no {name!r}; its names are {list(self.arrays)}")
        return self.arrays[name]

    @property
    def normalizers(self) -> dict:
        """name -> Normalize or callable, for the names that are normalised."""
        if isinstance(self.normalize, dict):
            return {name: f for name, f in self.normalize.items() if f is not None}
        return {} if self.normalize is None else {"images": self.normalize}

    @property
    def num_samples(self) -> int:
        return len(next(iter(self.arrays.values())))

    @property
    def num_shards(self) -> int:
        return self.mesh.devices.size

    def __len__(self) -> int:
        return num_steps(self.num_samples, self.num_shards, self.batch_size, self.last_batch)

    def plan(self, epoch: int) -> Plan:
        return epoch_plan(self.num_samples, self.num_shards, self.batch_size, epoch=epoch,
                          seed=self.seed, shuffle=self.shuffle, last_batch=self.last_batch)

    def real_samples(self, epoch: int, *, state: LoaderState | None = None) -> int:
        """How many mask-True slots ``epoch`` has in the whole global batch; with a
        ``state``, how many the steps ``epoch(epoch, state=state)`` yields have."""
        if state is None:
            return int(self.plan(epoch).mask.sum())
        plan, row = self._resumed("Loader.real_samples", epoch, state).plan()
        return int(plan.mask[row:].sum())

    def state(self, epoch: int, step: int = 0, *, state: LoaderState | None = None) -> LoaderState:
        """Where this loader stands at global ``step`` of ``epoch``: the ``LoaderState``
        to save after ``step`` steps of the epoch have been delivered (its next batch
        is step ``step``). Without ``state``: of a fresh epoch, ``LoaderState.start(N,
        n, B, epoch=..., seed=, shuffle=, last_batch=).at_step(step)``, step in [0,
        len]. With the ``state`` the epoch was resumed from: ``state.resized(n,
        B).at_step(step)``, step in [state.step, that state's num_steps]; so after k
        steps of ``epoch(e, start_step=s)`` it is ``state(e, s + k)``, and after k
        steps of ``epoch(e, state=saved)`` it is ``state(e, saved.step + k,
        state=saved)``. ValueError for a state of another run or epoch (as
        ``epoch``) or a step outside that range."""
        if state is None:
            check_seed("epoch", epoch, "Loader.state")
            fresh = LoaderState.start(self.num_samples, self.num_shards, self.batch_size, epoch=epoch,
                                      seed=self.seed, shuffle=self.shuffle, last_batch=self.last_batch)
        else:
            fresh = self._resumed("Loader.state", epoch, state)
        return fresh.saved_at("Loader.state", step, resumed=state is not None)

    def _resumed(self, where: str, epoch: int, state) -> LoaderState:
        """``state`` checked against this loader's run and ``epoch``, resized to its shards."""
        return resume_state(where, state, epoch, num_samples=self.num_samples, seed=self.seed,
                            shuffle=self.shuffle, last_batch=self.last_batch, num_shards=self.num_shards,
                            batch_size=self.batch_size)

    def host_rows(self, plan: Plan, step: int) -> dict[str, np.ndarray]:
        """This process's rows at ``step`` of ``plan``: (n_local * B, ...) per name, its
        shards' blocks in mesh order, each name in one aligned buffer: as stored
        (placements "host" and "device", and names without a normaliser), or
        normalised for "host_float32"; then "mask"."""
        local = local_positions(self.mesh)
        idx = plan.indices[step, local]  # (n_local, B)
        B = self.batch_size
        norms = self.normalizers if self.placement == "host_float32" else {}
        rows = {}
        for name, source in self.arrays.items():
            norm = norms.get(name)
            if norm is None:
                rows[name] = _gather(source, idx.reshape(-1))
            elif isinstance(norm, Normalize):
                out = aligned_empty((idx.size,) + norm.output_shape(source.shape[1:]), np.float32)
                for j in range(len(local)):
                    norm(source[idx[j]], out=out[j * B:(j + 1) * B])
                rows[name] = out
            else:  # any other callable: its blocks, checked, copied into one array
                rows[name] = _called(norm, name, [source[i] for i in idx], B)
        rows[MASK] = plan.mask[step, local].reshape(-1)
        return rows

    def host_blocks(self, plan: Plan, step: int) -> dict[int, dict[str, np.ndarray]]:
        """Host-side blocks for this process's shards at ``step`` of ``plan``."""
        return split_rows(self.host_rows(plan, step), local_positions(self.mesh))

    def batch(self, epoch: int, step: int, *, state: LoaderState | None = None) -> dict[str, jax.Array]:
        """Global step ``step`` of ``epoch`` alone (random access), of a fresh epoch or,
        with ``state``, of the epoch resumed from it (``epoch``'s text): IndexError
        for a step outside [0, len) (fresh) or [state.step, num_steps) (resumed)."""
        if state is not None:
            st = self._resumed("Loader.batch", epoch, state)
            if not st.step <= step < st.num_steps:
                raise IndexError(f"step={step} is outside [{st.step}, {st.num_steps}) (the resumed "
                                 f"epoch's steps)")
            plan, row = st.plan()
            return self._segment_steps(st, plan, row + step - st.step, row + step - st.step + 1)[0]()
        if not 0 <= step < len(self):
            raise IndexError(f"step={step} is outside [0, {len(self)})")
        if self.placement == "device":
            return self._device_step(self._device_work(), self._place_plan(self.plan(epoch)), step)
        return self._host_step(self._device_work(), self.plan(epoch), step)

    def epoch(self, epoch: int, start_step: int = 0, *,
              state: LoaderState | None = None) -> Iterator[dict[str, jax.Array]]:
        """Steps ``start_step .. len-1`` of ``epoch``; with ``state`` (a saved
        ``LoaderState`` of this run, any shard count), the rest of the epoch it was
        taken in, from its step (the class docstring's "Resuming"), and
        ``start_step`` must stay 0 (the state says where to start: pass
        ``state.at_step(s)`` for a later step of the saved shards). Host placements
        prepare steps ``prefetch`` ahead on a background thread: a worker error is
        raised here in the caller, and closing the iterator early (``break``,
        garbage collection) stops and joins the thread. "device" needs no thread:
        each step is one asynchronous dispatch.

        Raises IndexError for a start_step outside [0, len]; ValueError for a
        state that is not a LoaderState, of another run (num_samples, seed, shuffle,
        last_batch: named) or another epoch, or a start_step with a state."""
        if state is not None:
            st = self._resumed("Loader.epoch", epoch, state)
            if start_step != 0:
                raise ValueError(f"Loader.epoch: start_step={start_step!r} with a state; the state "
                                 f"says where the epoch resumes (step {state.step})")
            plan, row = st.plan()
            makers = self._segment_steps(st, plan, row, len(plan.indices))
            if self.placement == "device":
                return (make() for make in makers)
            return _prefetched(lambda make: make(), makers, self.prefetch)
        if not 0 <= start_step <= len(self):
            # range(-1, len) would yield the last step and then the whole epoch.
            raise IndexError(f"start_step={start_step} is outside [0, {len(self)}]")
        plan = self.plan(epoch)
        steps = range(start_step, len(self))
        work = self._device_work()  # resolved once an epoch, not every step
        if self.placement == "device":
            placed = self._place_plan(plan)
            return (self._device_step(work, placed, s) for s in steps)
        return _prefetched(functools.partial(self._host_step, work, plan), steps, self.prefetch)

    def _segment_steps(self, st: LoaderState, plan: Plan, first: int, stop: int) -> list[Callable]:
        """One function per row ``first .. stop-1`` of a resumed state's last segment
        plan, each making that step's batch. On this loader's own fresh plan (the
        only segment is (0, n, B)) every placement runs as for ``epoch(e, s)``;
        after a change, "device" places what rows ``first..`` need first."""
        work = self._device_work()
        rows = range(first, stop)
        if self.placement != "device":
            return [functools.partial(self._host_step, work, plan, r) for r in rows]
        if not rows:
            return []
        if len(st.segments) == 1:  # segment 0 is epoch_plan: the resident shards hold it
            placed, resident = self._place_plan(plan), self.resident
        else:
            placed, resident = self._place_segment(plan, first)
            rows = range(0, stop - first)
        return [functools.partial(self._device_step, work, placed, r, resident) for r in rows]

    def _device_work(self):
        """What the devices do each step. "device": (the jitted step, the tables by
        name); "host": [(name, the jitted normaliser, its table)] for each name with
        a Normalize; "host_float32": nothing."""
        if self.placement == "host_float32":
            return ()
        norms = {name: f for name, f in self.normalizers.items() if isinstance(f, Normalize)}
        windows = tuple((name, tuple(int(v) for v in f.window(self.arrays[name].shape[2:])), f.mirror)
                        for name, f in norms.items())
        tables = {name: _replicated_table(_table_key(f.mean, f.std, f.arithmetic, "Loader"), self.mesh)
                  for name, f in norms.items()}
        if self.placement == "device":
            return _device_step_fn(self.mesh, self.layout, tuple(self.arrays), windows), tables
        return [(name, _normalize_fn(self.mesh, window, mirror), tables[name])
                for name, window, mirror in windows]

    def _host_step(self, work, plan: Plan, step: int) -> dict[str, jax.Array]:
        batch = global_batch_from_rows(self.host_rows(plan, step), self.mesh, self.layout)
        for name, fn, table in work:  # placement "host": normalise on the devices
            batch[name] = fn(batch[name], table)
        return batch

    def _place_plan(self, plan: Plan) -> dict[str, jax.Array]:
        """The epoch's plan on the devices: per shard (1, steps, B) local indices and mask."""
        starts = np.array([shard_bounds(self.num_samples, k, self.num_shards)[0]
                           for k in range(self.num_shards)])
        local = (plan.indices - starts[None, :, None]).astype(np.int32).swapaxes(0, 1)
        mask = plan.mask.swapaxes(0, 1)
        return {"indices": _by_position(local, self.mesh), "mask": _by_position(mask, self.mesh)}

    def _place_segment(self, plan: Plan, row: int) -> tuple[dict, dict]:
        """(placed plan, resident samples) for rows ``row..`` of a resumed segment:
        device k holds the distinct samples of ``plan.indices[row:, k]``, ascending,
        zero-padded to the largest count, and the placed indices are positions in
        them (searchsorted); row 0 of the placed plan is ``plan`` row ``row``."""
        rest, mask = plan.indices[row:], plan.mask[row:]
        n = self.num_shards
        needed = [np.unique(rest[:, k]) for k in range(n)]
        size = max(len(u) for u in needed)
        local = np.stack([np.searchsorted(needed[k], rest[:, k]) for k in range(n)]).astype(np.int32)
        sharding = NamedSharding(self.mesh, P(DATA_AXIS))

        def rows(source: np.ndarray):
            def block(index):
                k = index[0].start // size if index[0].start is not None else 0
                out = np.zeros((size,) + source.shape[1:], source.dtype)
                out[:len(needed[k])] = source[needed[k]]
                return out
            return jax.make_array_from_callback((n * size,) + source.shape[1:], sharding, block)

        placed = {"indices": _by_position(local, self.mesh),
                  "mask": _by_position(mask.swapaxes(0, 1), self.mesh)}
        return placed, {name: rows(source) for name, source in self.arrays.items()}

    def _device_step(self, work, placed: dict, step: int, resident: dict | None = None) -> dict[str, jax.Array]:
        fn, tables = work
        out = fn(self.resident if resident is None else resident, placed, np.int32(step), tables)
        return {name: out[name] for name in (*self.arrays, MASK)}  # jit returns a dict's keys sorted


def make_loader(data, devices: Sequence[jax.Device] | Mesh, batch_size: int, *,
                layout: str = "sharded", filename_prefix: str = TRAIN_PREFIX,
                shuffle: bool = False, seed: int = 0, last_batch: str = "fill",
                normalize: Normalize | Callable | dict | str | None = "default", prefetch: int = 2,
                placement: str = "host", device_budget: int | None = None) -> Loader:
    """A ``Loader`` over ``data``, in one of three forms:

    * a dict of named arrays ``{name: array}``: any string names but "mask",
      any shapes and dtypes JAX holds as they are, every array N first (row i
      is sample i): token ids int32 (N, 48) with per-token targets int32 (N,
      48), float features (N, 40) with float targets (N,), uint8 images (N, C,
      H, W) with labels of any shape. Batches hold every name, delivered bit for
      bit as stored unless ``normalize`` names it, plus "mask";
    * a tuple ``(samples, labels_N)`` (or a two-item list), the notebooks' form: ``samples`` any array
      (N, ...) whose dtype JAX holds as it is, ``labels_N`` integers (N,) within
      int32, delivered as int32; batches are {"images": the samples (normalised
      by default), "labels", "mask"};
    * a CIFAR-10 folder, read with ``filename_prefix`` (``read_cifar10``): the
      tuple form over its images and labels.

    ``batch_size`` is per device; shard k goes to ``devices[k]`` (or mesh
    position k). The partition, the plan, the mask, resuming at a step and the
    device order are the same for every name and whatever the arrays are: they
    depend on (N, n, B, seed, epoch, shuffle, last_batch) only (``Loader``
    states what each block holds).

    ``normalize``: for a dict dataset, None or a dict ``{name: Normalize or
    callable}`` naming the arrays to normalise (the others are delivered as
    stored; the default, "default", normalises nothing). For the tuple form and a
    folder, what applies to "images": a ``Normalize``, any callable, None, or
    ``{"images": ...}``; the default, "default", is ``Normalize()``, the rocAL
    notebook's. A ``Normalize`` needs uint8 images (N, C, H, W), channels first,
    C = len(mean), and works in every placement; any other callable (it gets a
    block of B samples and must return B rows of a dtype JAX holds as it is)
    needs placement "host_float32".

    ``placement`` is "host", "device" or "host_float32" (see ``Loader``).
    "device" keeps about N/n samples of every array on every device and refuses
    a dataset whose shard does not fit ``device_budget`` bytes per device
    (default: half of what the device reports free; for CPU devices, half of the
    host's available memory shared among this process's devices).

    Raises ValueError, naming the parameter, the value and the fix, for:
    batch_size not an int >= 1, a batch larger than the smallest shard (every
    step of a fresh epoch would be mostly padding, or with drop there would be
    no step; an epoch resumed from a state may leave runs smaller than the
    batch, which elastic_plan allows: fill pads, drop gives 0 steps), more
    devices than samples, a repeated device, a mesh without a 'data' axis
    spanning its devices, an unknown layout, last_batch policy or placement, a
    seed outside [0, 2**32), shuffle not a bool, prefetch not an int >= 0; data
    in none of the three forms (an array is not a tuple, even a (2, N) one), an
    empty dict, a name that is not a string or is
    "mask", arrays without a leading N axis or of different N; an array of a
    dtype JAX would convert (int64, uint64, float64, complex128 without
    ``jax_enable_x64``: the message says which dtype keeps its kind, e.g.
    int32 for int64 token ids; or not numbers at all); tuple-form labels that
    are not (N,) integers within int32; a Normalize on an array that is not
    uint8 (N, C, H, W) (for channels-last images it says "NCHW expected" and how
    to transpose), or whose mean/std or crop do not fit the images; a bare
    Normalize or callable for a dict dataset, or a name in ``normalize`` that
    the data lacks; a callable with a placement other than "host_float32"; a
    ``filename_prefix`` other than the default with arrays (it picks a folder's
    files); or a dataset over the device budget. A callable that returns blocks of another
    length or a dtype JAX would convert is refused when its batch is made. A
    folder that cannot be read raises what ``read_cifar10`` raises.
    """
    arrays, normalize = _dataset(data, filename_prefix, normalize)
    mesh = data_mesh(devices)
    _check_policy(last_batch)
    _check_layout(layout)
    check_seed("seed", seed, "make_loader")
    if placement not in PLACEMENTS:
        raise ValueError(f"make_loader: placement must be one of {PLACEMENTS}, got {placement!r}")
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"make_loader: batch_size must be an int >= 1 (per device), got {batch_size!r}")
    if not _is_int(prefetch) or prefetch < 0:
        raise ValueError(f"make_loader: prefetch must be an int >= 0, got {prefetch!r}")
    if shuffle not in (True, False):
        raise ValueError(f"make_loader: shuffle must be a bool, got {shuffle!r}")
    if device_budget is not None and not _is_int(device_budget):
        raise ValueError(f"make_loader: device_budget must be None or an int (bytes), got {device_budget!r}")
    loader = Loader(arrays, mesh, int(batch_size), layout, bool(shuffle), seed, last_batch, normalize,
                    int(prefetch), placement)
    for name, f in loader.normalizers.items():
        if not isinstance(f, Normalize) and placement != "host_float32":
            raise ValueError(f"make_loader: placement={placement!r} needs a Normalize for {name!r} (its "
                             f"table runs on the devices); the callable {f!r} needs placement='host_float32'")
    n, N = mesh.devices.size, loader.num_samples
    if n > N:
        raise ValueError(f"make_loader: {n} devices but only {N} samples: some shard would be empty")
    if batch_size > N // n:
        raise ValueError(
            f"make_loader: batch_size={batch_size} per device is larger than the smallest shard "
            f"({N // n} samples = {N} samples / {n} devices)"
        )
    if placement == "device":
        loader = dataclasses.replace(loader, resident=_place_dataset(arrays, mesh, device_budget))
    return loader


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _dataset(data, filename_prefix: str, normalize):
    """make_loader's checks of the data and of ``normalize``; returns (arrays by
    name, normalize resolved: a dict for a dict dataset, else what applies to "images")."""
    if isinstance(data, (str, os.PathLike)):
        data = read_cifar10(data, filename_prefix)
    elif filename_prefix != TRAIN_PREFIX:
        raise ValueError(f"make_loader: filename_prefix={filename_prefix!r} picks the files of a CIFAR-10 "
                         f"folder, but data is a {type(data).__name__} of arrays; read the files first "
                         f"(read_cifar10(folder, {filename_prefix!r})) or pass the folder")
    if isinstance(data, Mapping):
        return _named_arrays(data, normalize)
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        # Not "samples, labels = data": a (2, N) array would unpack into two rows.
        raise ValueError(f"make_loader: data must be a CIFAR-10 folder, a tuple (samples, labels) or a "
                         f"dict of named arrays, got {type(data).__name__}"
                         f"{f' {data.shape}' if hasattr(data, 'shape') else ''}")
    samples, labels = data
    if isinstance(normalize, str) and normalize == "default":
        normalize = Normalize()
    elif isinstance(normalize, Mapping):
        if set(normalize) - {"images"}:
            raise ValueError(f"make_loader: normalize={dict(normalize)!r} names "
                             f"{sorted(set(normalize) - {'images'})}, but the tuple form (samples, labels) "
                             f"normalises only 'images'; pass a dict dataset to normalise other names")
        normalize = normalize.get("images")
    if normalize is not None and not callable(normalize):
        raise ValueError(f"make_loader: normalize={normalize!r} is not a Normalize, a callable, a dict "
                         f"or None")
    samples, labels = np.asarray(samples), np.asarray(labels)
    if samples.ndim < 1 or labels.shape != samples.shape[:1]:
        raise ValueError(f"make_loader: data must be samples (N, ...) and labels (N,), got samples "
                         f"{samples.dtype} {samples.shape}, labels {labels.shape}")
    _check_dtype("samples", samples)
    if labels.dtype.kind not in "biu":
        raise ValueError(f"make_loader: labels must be integers (N,), got dtype {labels.dtype} "
                         f"(for float or other targets, pass a dict dataset: {{'images': samples, "
                         f"'targets': targets}})")
    if labels.size and (labels.min() < np.iinfo(np.int32).min or labels.max() > np.iinfo(np.int32).max):
        raise ValueError(f"make_loader: labels must fit int32, got range [{labels.min()}, {labels.max()}]")
    _check_normalizer("samples", samples, normalize, "pass normalize=None to deliver them as they are")
    return {"images": samples, "labels": labels.astype(np.int32, copy=False)}, normalize


def _named_arrays(data: Mapping, normalize):
    if not data:
        raise ValueError("make_loader: data is an empty dict; a dataset needs at least one named array")
    arrays = {}
    for name, value in data.items():
        if not isinstance(name, str):
            raise ValueError(f"make_loader: data's names must be strings (they name the batch's arrays), "
                             f"got {name!r}")
        if name == MASK:
            raise ValueError(f"make_loader: data has an array named {MASK!r}; every batch adds its own "
                             f"'mask' (False on padding slots), so rename yours")
        array = np.asarray(value)
        if array.ndim < 1:
            raise ValueError(f"make_loader: data[{name!r}] must be (N, ...), one row per sample, got a "
                             f"0-d {array.dtype} array")
        arrays[name] = array
        _check_dtype(f"data[{name!r}]", array)
    sizes = {name: len(a) for name, a in arrays.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"make_loader: every array of data must hold the same N samples (axis 0), got "
                         f"{sizes}")
    if normalize is None or (isinstance(normalize, str) and normalize == "default"):
        return arrays, {}
    if not isinstance(normalize, Mapping):
        raise ValueError(f"make_loader: normalize={normalize!r} for a dict dataset: name the arrays to "
                         f"normalise, e.g. normalize={{{next(iter(arrays))!r}: Normalize(...)}} "
                         f"(the data's names: {list(arrays)})")
    unknown = [name for name in normalize if name not in arrays]
    if unknown:
        raise ValueError(f"make_loader: normalize names {unknown}, which the data lacks (its names: "
                         f"{list(arrays)})")
    norms = {name: f for name, f in normalize.items() if f is not None}
    for name, f in norms.items():
        if not callable(f):
            raise ValueError(f"make_loader: normalize[{name!r}]={f!r} is not a Normalize or a callable")
        _check_normalizer(f"data[{name!r}]", arrays[name], f,
                          f"leave {name!r} out of normalize to deliver it as it is")
    return arrays, norms


def _check_dtype(what: str, array: np.ndarray) -> None:
    """Refuses a dtype JAX would not hold as it is, advising the dtype that keeps its kind."""
    if not (jnp.issubdtype(array.dtype, jnp.number) or array.dtype == np.bool_):
        raise ValueError(f"make_loader: {what} of dtype {array.dtype} is not numbers JAX can hold; "
                         f"convert it to a numeric array first (token ids: np.int32)")
    held = np.dtype(jax.dtypes.canonicalize_dtype(array.dtype))
    if held == array.dtype:
        return
    fix = f"{what}.astype(np.{held.name})"
    if array.dtype.kind in "iu":
        info = np.iinfo(held)
        low, high = (array.min(), array.max()) if array.size else (0, 0)
        fix += (" (keeps them integers; its values fit)" if info.min <= low and high <= info.max else
                f" keeps them integers but does not hold its values (range [{low}, {high}]), so enable x64")
    else:
        fix += " (rounds each value)"
    raise ValueError(f"make_loader: {what} of dtype {array.dtype} cannot go to the devices as stored: "
                     f"without jax_enable_x64 JAX would convert it to {held} in silence. Pass {fix}, or "
                     f"call jax.config.update('jax_enable_x64', True) first to keep {array.dtype}")


def _check_normalizer(what: str, array: np.ndarray, normalize, fix: str) -> None:
    """A Normalize's images: uint8 (N, C, H, W) that its mean/std and crop fit."""
    if not isinstance(normalize, Normalize):
        return
    if array.dtype != np.uint8 or array.ndim != 4:
        hint = ""
        if array.dtype == np.uint8 and array.ndim == 3:
            hint = " (one-channel (N, H, W) images: pass images[:, None], (N, 1, H, W))"
        elif array.dtype == np.uint8 and array.ndim == 2:
            hint = " (flat rows: reshape them to (N, C, H, W))"
        raise ValueError(f"make_loader: normalize={normalize} needs uint8 images (N, C, H, W), got "
                         f"{what} {array.dtype} {array.shape}{hint}; {fix}")
    try:
        normalize.output_shape(array.shape[1:])
    except ValueError as error:
        raise ValueError(f"make_loader: {what} {array.shape}: {error}") from None


def _gather(source: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``source[indices]`` into one 64-byte-aligned buffer."""
    out = aligned_empty((len(indices),) + source.shape[1:], source.dtype)
    if source.flags.c_contiguous:
        # mode="clip" (the plan's indices are in range): with the default "raise"
        # NumPy buffers the whole gather when out is a view, 30x slower here.
        np.take(source, indices, axis=0, out=out, mode="clip")
    else:
        # read_cifar10's images are a strided view (3073-byte records): np.take
        # would first copy the WHOLE dataset to make it contiguous, every step.
        np.copyto(out, source[indices])
    return out


def _called(f: Callable, name: str, blocks: list[np.ndarray], B: int) -> np.ndarray:
    """A callable normaliser's output for each block, checked and concatenated."""
    outs = [np.asarray(f(block)) for block in blocks]
    for out in outs:
        held = ((jnp.issubdtype(out.dtype, jnp.number) or out.dtype == np.bool_)
                and jax.dtypes.canonicalize_dtype(out.dtype) == out.dtype)
        if out.ndim < 1 or len(out) != B or not held or out.shape != outs[0].shape:
            raise ValueError(f"Loader: normalize for {name!r} ({f!r}) returned {out.dtype} {out.shape} for "
                             f"a block of B={B} samples; it must return B rows, every block alike, of a "
                             f"dtype JAX holds as it is (e.g. float32, not float64)")
    return np.concatenate(outs)


# --------------------------------------------------------------------------
# Device-side work (placements "host" and "device")
# --------------------------------------------------------------------------
#
# Caches: each is keyed by everything that determines its result, exactly.
# _table and _replicated_table by _table_key (mean's and std's float32 bit
# patterns: -0.0 is not 0.0) and the mesh; the jitted functions by the mesh, the
# layout, the names and each normalised name's crop window (ints) and mirror (a
# bool), while jit's own cache adds the arguments' shapes and dtypes. A table is
# an argument of the jitted functions, never a constant inside them.


def _by_position(per_shard: np.ndarray, mesh: Mesh) -> jax.Array:
    """(n, ...) host array -> global array sharded on axis 0: row k on mesh position k.
    Each process fills only its own devices' rows."""
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    return jax.make_array_from_callback(per_shard.shape, sharding, lambda index: per_shard[index])


def device_fit(num_samples: int, sample_shape: tuple[int, ...], mesh: Mesh,
               device_budget: int | None = None, itemsize: int = 1) -> str | None:
    """Why a dataset would not fit placement "device" on ``mesh``, or None if it fits.

    Each device holds the largest shard, ceil(N/n) samples of ``sample_shape``
    with ``itemsize`` bytes an element (1: uint8 images) plus their int32
    labels; the budget is ``device_budget`` bytes per device, by default half of
    what the device reports free (for CPU devices, which report nothing, half the
    host's available memory shared among this process's devices)."""
    return _fits(num_samples, int(np.prod(sample_shape)) * itemsize + 4, mesh, device_budget)


def _fits(num_samples: int, sample_bytes: int, mesh: Mesh, device_budget: int | None) -> str | None:
    """device_fit for samples of ``sample_bytes`` bytes each (every array's row together)."""
    n = mesh.devices.size
    size = -(-num_samples // n)
    per_device = size * sample_bytes
    local = [mesh.devices.flat[k] for k in local_positions(mesh)]
    limit, where = (device_budget, "device_budget") if device_budget is not None else _default_budget(local)
    if per_device <= limit:
        return None
    return (f"placement='device': each device would hold {size} samples = {per_device / 2**20:.1f} MiB "
            f"({num_samples} samples / {n} devices), over the budget of {limit / 2**20:.1f} MiB per "
            f"device ({where}); use placement='host' or more devices")


def _place_dataset(arrays: dict[str, np.ndarray], mesh: Mesh, budget: int | None) -> dict:
    """Shard k's samples of every array on mesh position k, padded to the largest
    shard: (n * S, ...) in their dtype, sharded on 'data'."""
    N = len(next(iter(arrays.values())))
    sample_bytes = sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize for a in arrays.values())
    too_big = _fits(N, sample_bytes, mesh, budget)
    if too_big:
        raise ValueError(too_big)
    n = mesh.devices.size
    size = -(-N // n)  # the largest shard
    sharding = NamedSharding(mesh, P(DATA_AXIS))

    def rows(source: np.ndarray):
        def block(index):
            k = index[0].start // size if index[0].start is not None else 0
            start, stop = shard_bounds(N, k, n)
            out = np.zeros((size,) + source.shape[1:], source.dtype)
            out[:stop - start] = source[start:stop]
            return out
        return jax.make_array_from_callback((n * size,) + source.shape[1:], sharding, block)

    return {name: rows(source) for name, source in arrays.items()}


def _default_budget(devices: list) -> tuple[int, str]:
    stats = devices[0].memory_stats() if devices else None
    if stats and "bytes_limit" in stats:
        free = min(d.memory_stats()["bytes_limit"] - d.memory_stats().get("bytes_in_use", 0)
                   for d in devices)
        return free // 2, f"half the free memory of {devices[0].platform} devices"
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // 2 // max(len(devices), 1), \
        f"half the host's available memory over {len(devices)} {devices[0].platform} devices"


@functools.lru_cache(maxsize=None)
def _normalize_fn(mesh: Mesh, window: tuple[int, int, int, int], mirror: bool):
    """jit(shard_map) of device_normalize: each device normalises its own rows (no
    collective), output sharded like the input."""
    fn = functools.partial(device_normalize, window=window, mirror=mirror)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(DATA_AXIS), P()), out_specs=P(DATA_AXIS)))


@functools.lru_cache(maxsize=None)
def _device_step_fn(mesh: Mesh, layout: str, names: tuple[str, ...], windows: tuple):
    """One step of placement "device": every device gathers its batch of every name
    from its own resident shard by the plan's local indices, then normalises each
    name of ``windows`` ((name, window, mirror), ...) with its table, from the
    ``tables`` argument (name -> table)."""
    how = {name: (window, mirror) for name, window, mirror in windows}

    def step(resident, placed, s, tables):
        idx = placed["indices"][0, s]  # (B,), into this device's shard
        out = {}
        for name in names:
            rows = resident[name][idx]
            if name in how:
                rows = device_normalize(rows, tables[name], *how[name])
            out[name] = rows
        out[MASK] = placed["mask"][0, s]
        return out if layout == "sharded" else jax.tree.map(lambda x: x[None], out)

    specs = (P(DATA_AXIS), P(DATA_AXIS), P(), P())  # each a prefix of its argument's pytree
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=P(DATA_AXIS)))


@functools.lru_cache(maxsize=64)
def _replicated_table(key: tuple[bytes, bytes, str], mesh: Mesh) -> jax.Array:
    """The table of ``key`` (``_table_key``) on every device of ``mesh``, placed once
    per (key, mesh); one row when every channel's row is the same bits."""
    table = _table(key)
    if _one_row(table):
        table = table[:1]  # one row serves every channel (device_normalize)
    return jax.make_array_from_callback(table.shape, NamedSharding(mesh, P()), lambda index: table[index])


def _one_row(table: np.ndarray) -> bool:
    """Whether every row of ``table`` is row 0, bit for bit (-0.0 is not 0.0)."""
    bits = table.view(np.uint32)
    return bool((bits == bits[:1]).all())


# --------------------------------------------------------------------------
# Prefetching
# --------------------------------------------------------------------------


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
