"""The notebooks' datasets on disk: CIFAR-10's binary files and MNIST's IDX files.

``read_cifar10`` reads the CIFAR-10 "binary version": 3073-byte records, each one label byte 0..9, then the R, G, B
planes of 32x32, row-major. ``read_mnist`` reads MNIST's IDX files, gzipped or not. Both give
``(images_NCHW uint8, labels_N int32)``. ``write_cifar10`` and ``write_mnist`` write the same formats, atomically, and
the ``synthetic_*`` functions write small deterministic datasets in them, so that every test and job runs without a
download. A reader reads back what a writer wrote, bit for bit, and refuses a malformed file naming it.

Deliberate difference from rocAL: files are read in sorted name order, not in ``readdir`` order (the filesystem's).

Inputs: a count or seed is a Python or NumPy int, never a bool or a float (even 5.0); a path a str or ``os.PathLike``;
labels of an integer dtype. Anything else raises ValueError at the call, naming the function, parameter and value.

Imports: NumPy only, so the module can be copied alone (its name shadows no ``datasets`` package).
"""

from __future__ import annotations

import gzip
import os
import tempfile

import numpy as np

RECORD_BYTES = 3073
IMAGE_SHAPE = (3, 32, 32)  # CIFAR-10
MNIST_SHAPE = (1, 28, 28)
NUM_CLASSES = 10
TRAIN_PREFIX = "data_batch_"
TEST_PREFIX = "test_batch"


def read_cifar10(file_root: str | os.PathLike, filename_prefix: str = TRAIN_PREFIX):
    """``(images_NCHW, labels_N)`` of every file in ``file_root`` whose name starts with ``filename_prefix``.

    Files are read in sorted name order. The images are uint8 (N, 3, 32, 32), the labels int32 (N,). With one matching
    file the images are a read-only view of a memory map (no copy); with several, one in-memory copy.

    Raises:
      ValueError: ``filename_prefix`` not a str; a file not of whole 3073-byte records, a label > 9, no record at all.
      FileNotFoundError: the folder is missing, or no file matches."""
    root = _path("read_cifar10", "file_root", file_root)
    if not isinstance(filename_prefix, str):
        raise ValueError(f"read_cifar10: filename_prefix must be a str, got {filename_prefix!r}")
    if not os.path.isdir(root):
        raise FileNotFoundError(f"read_cifar10: file_root={root!r} is not a directory")
    names = sorted(name for name in os.listdir(root)
                   if name.startswith(filename_prefix) and os.path.isfile(os.path.join(root, name)))
    if not names:
        raise FileNotFoundError(f"read_cifar10: no file in {root!r} starts with filename_prefix={filename_prefix!r}")
    counts = {}
    for name in names:
        path = os.path.join(root, name)
        size = os.path.getsize(path)
        if size % RECORD_BYTES:
            raise ValueError(f"{path}: size {size} bytes is not a multiple of the {RECORD_BYTES}-byte CIFAR-10 "
                             f"record ({size % RECORD_BYTES} bytes left over: truncated or not CIFAR-10)")
        if size:  # np.memmap cannot map an empty file; it holds no record anyway.
            counts[name] = size // RECORD_BYTES
    if not counts:
        raise ValueError(f"read_cifar10: the files matching {filename_prefix!r} in {root!r} hold no record "
                         f"(all empty: {names})")
    starts = np.cumsum([0, *counts.values()])
    if len(counts) == 1:
        rows = np.memmap(os.path.join(root, *counts), dtype=np.uint8, mode="r").reshape(-1, RECORD_BYTES)
    else:
        # Read into one array, file by file. Concatenating memory maps would hold
        # every file's mapped pages and the copy at once: twice the dataset.
        rows = np.empty((starts[-1], RECORD_BYTES), np.uint8)
        for name, start, stop in zip(counts, starts, starts[1:]):
            with open(os.path.join(root, name), "rb") as f:
                f.readinto(memoryview(rows[start:stop]).cast("B"))
    for name, start, stop in zip(counts, starts, starts[1:]):
        bad = np.flatnonzero(rows[start:stop, 0] >= NUM_CLASSES)
        if bad.size:
            raise ValueError(f"{os.path.join(root, name)}: record {bad[0]} has label "
                             f"{rows[start + bad[0], 0]}; CIFAR-10 labels are 0..9")
    return rows[:, 1:].reshape((-1,) + IMAGE_SHAPE), rows[:, 0].astype(np.int32)


def write_cifar10(path: str | os.PathLike, images_NCHW: np.ndarray, labels_N: np.ndarray) -> None:
    """Writes one CIFAR-10 binary file, atomically (a reader never sees half a file); ``images_NCHW`` is uint8
    (N, 3, 32, 32), ``labels_N`` N integers 0..9: ValueError otherwise."""
    path = _path("write_cifar10", "path", path)
    images_NCHW, labels_N = _check_images_and_labels(f"write_cifar10({path!r})", images_NCHW, labels_N, IMAGE_SHAPE)
    rows = np.empty((len(labels_N), RECORD_BYTES), np.uint8)
    rows[:, 0] = labels_N
    rows[:, 1:] = images_NCHW.reshape(len(labels_N), RECORD_BYTES - 1)  # not -1: N may be 0
    _write_atomically(path, rows.tobytes())


def synthetic_cifar10(root: str | os.PathLike, *, num_train: int = 50_000, num_test: int = 10_000,
                      seed: int = 0) -> str:
    """Writes a CIFAR-10-format folder, data_batch_1..5.bin and test_batch.bin; returns ``root``.

    An image is its class's fixed random low-frequency colour pattern at a random contrast, shifted by a random
    brightness, plus strong per-pixel noise: learnable, but not at a glance, as with real data. The bytes are a function
    of (num_train, num_test, seed) alone, on every machine whose NumPy Generator draws the same values. ``num_train``
    and ``num_test`` are ints >= 0, ``seed`` an int in [0, 2**32): ValueError before anything is written otherwise."""
    draw = _synthetic_images("synthetic_cifar10", IMAGE_SHAPE, num_train, num_test, seed, salt=0xC1FA)
    root = _path("synthetic_cifar10", "root", root)
    os.makedirs(root, exist_ok=True)
    images, labels = draw(num_train)
    for i, part in enumerate(np.array_split(np.arange(num_train), 5), start=1):
        write_cifar10(os.path.join(root, f"{TRAIN_PREFIX}{i}.bin"), images[part], labels[part])
    images, labels = draw(num_test)
    write_cifar10(os.path.join(root, f"{TEST_PREFIX}.bin"), images, labels)
    return root


MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_IDX_MAGIC = {"images": 0x00000803, "labels": 0x00000801}  # uint8 data, 3 or 1 dimensions


def read_mnist(folder: str | os.PathLike, split: str = "train"):
    """``(images_NCHW uint8 (N, 1, 28, 28), labels_N int32)`` of MNIST's ``split``, "train" or "test".

    Reads ``train-images-idx3-ubyte`` and ``train-labels-idx1-ubyte`` (``t10k-*`` for "test"), plain or ``.gz``, also
    spelled ``train-images.idx3-ubyte`` as some mirrors do. Uncompressed images are a read-only memory map.

    Raises:
      ValueError: an unknown split; a bad magic number, images not 28x28, a file shorter or longer than its header
        says, image and label counts that differ, a label > 9 (naming the file and the value).
      FileNotFoundError: the folder or a file is missing."""
    _check_split("read_mnist", split)
    root = _path("read_mnist", "folder", folder)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"read_mnist: folder={root!r} is not a directory")
    images = _read_idx(_find_idx(root, MNIST_FILES[split][0]), "images")
    labels_path = _find_idx(root, MNIST_FILES[split][1])
    labels = _read_idx(labels_path, "labels")
    if len(images) != len(labels):
        raise ValueError(f"{labels_path}: {len(labels)} labels, but the images file of split {split!r} holds "
                         f"{len(images)} images")
    bad = np.flatnonzero(labels >= NUM_CLASSES)
    if bad.size:
        raise ValueError(f"{labels_path}: label {bad[0]} is {labels[bad[0]]}; MNIST labels are 0..9")
    return images.reshape((-1,) + MNIST_SHAPE), labels.astype(np.int32)


def write_mnist(folder: str | os.PathLike, split: str, images_NCHW: np.ndarray, labels_N: np.ndarray) -> None:
    """Writes ``split``'s two IDX files, uncompressed, into ``folder``, each atomically; ``split`` is "train" or "test",
    ``images_NCHW`` uint8 (N, 1, 28, 28), ``labels_N`` N integers 0..9: ValueError otherwise."""
    _check_split("write_mnist", split)
    folder = _path("write_mnist", "folder", folder)
    images_NCHW, labels_N = _check_images_and_labels(f"write_mnist({folder!r})", images_NCHW, labels_N, MNIST_SHAPE)
    images_name, labels_name = MNIST_FILES[split]
    header = np.array([_IDX_MAGIC["images"], len(labels_N), 28, 28], ">u4").tobytes()
    _write_atomically(os.path.join(folder, images_name), header + images_NCHW.tobytes())
    header = np.array([_IDX_MAGIC["labels"], len(labels_N)], ">u4").tobytes()
    _write_atomically(os.path.join(folder, labels_name), header + labels_N.astype(np.uint8).tobytes())


def synthetic_mnist(root: str | os.PathLike, *, num_train: int = 60_000, num_test: int = 10_000, seed: int = 0) -> str:
    """Writes MNIST-format IDX files (train and t10k) of synthetic 28x28 grey images, made and validated as
    ``synthetic_cifar10``'s; returns ``root``."""
    draw = _synthetic_images("synthetic_mnist", MNIST_SHAPE, num_train, num_test, seed, salt=0x3A15)
    root = _path("synthetic_mnist", "root", root)
    os.makedirs(root, exist_ok=True)
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
    header_bytes = 4 * (1 + (3 if kind == "images" else 1))  # the magic number, then each dimension
    compressed = path.endswith(".gz")
    with (gzip.open if compressed else open)(path, "rb") as f:
        head = f.read(header_bytes)
        raw = head + f.read() if compressed else None  # a plain file is mapped, not read
    size = len(raw) if compressed else os.path.getsize(path)
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


def _check_images_and_labels(where: str, images_NCHW, labels_N, shape: tuple[int, ...]):
    images_NCHW, labels_N = np.asarray(images_NCHW), np.asarray(labels_N)
    if images_NCHW.dtype != np.uint8 or images_NCHW.shape[1:] != shape:
        raise ValueError(f"{where}: images must be uint8 (N, {', '.join(map(str, shape))}), "
                         f"got {images_NCHW.dtype} {images_NCHW.shape}")
    if labels_N.shape != images_NCHW.shape[:1]:
        raise ValueError(f"{where}: labels shape {labels_N.shape} does not match {images_NCHW.shape[0]} images")
    if labels_N.dtype.kind not in "iu":  # a float label 1.5 would be written as 1, a bool as 0 or 1
        raise ValueError(f"{where}: labels must be integers 0..9, got dtype {labels_N.dtype}")
    if labels_N.size and (labels_N.min() < 0 or labels_N.max() >= NUM_CLASSES):
        raise ValueError(f"{where}: labels must be 0..9, got range [{labels_N.min()}, {labels_N.max()}]")
    return images_NCHW, labels_N


def _write_atomically(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that a reader sees the old file or the whole new one: into a hidden file
    (".tmp-...") beside ``path``, then renamed onto it, which is atomic on any filesystem and needs no system temporary
    folder. A write that fails removes that file, leaves ``path`` unchanged and raises its own error."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# Not imported from plan.py: each module can be copied without the rest of the project.
def _check_int(where: str, name: str, value, minimum: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return int(value)


def _path(where: str, name: str, path) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{where}: {name} must be a path (a str or an os.PathLike), got {path!r}")
    return os.fspath(path)


def _check_split(where: str, split) -> None:
    if not isinstance(split, str) or split not in MNIST_FILES:
        raise ValueError(f"{where}: split must be one of {tuple(MNIST_FILES)}, got {split!r}")


def _synthetic_images(where: str, shape: tuple[int, ...], num_train: int, num_test: int, seed: int, salt: int):
    num_train = _check_int(where, "num_train", num_train, 0)
    num_test = _check_int(where, "num_test", num_test, 0)
    seed = _check_int(where, "seed", seed, 0)
    if seed >= 2**32:  # SeedSequence would split it into two words: [seed, salt] would alias another
        raise ValueError(f"{where}: seed={seed} is outside [0, 2**32)")
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
