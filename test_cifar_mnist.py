"""Tests of cifar_mnist.py: each guarantee its docstrings state.

* CIFAR-10's binary files round-trip, are read in sorted name order, one file mapped
  without a copy; a malformed folder is refused naming the file and the value.
* MNIST's IDX files round-trip plain, gzipped and under the dotted names; a malformed
  file is refused naming the file and the value.
* The synthetic datasets are a function of their sizes and seed, pinned by digest.
* A write is atomic; bad input is refused at the call, naming the parameter and value.
"""

import gzip
import hashlib
import inspect
import mmap
import os
import tempfile

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from cifar_mnist import (IMAGE_SHAPE, RECORD_BYTES, TEST_PREFIX, read_cifar10, read_mnist, synthetic_cifar10,
                         synthetic_mnist, write_cifar10, write_mnist)
from conftest import SEEDS, assert_raises_naming, assert_refuses_naming_value, examples, not_ints, random_mnist


def random_cifar(seed: int, count: int):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(count,) + IMAGE_SHAPE, dtype=np.uint8)
    return images, rng.integers(0, 10, size=count)


def memmap_backed(array: np.ndarray) -> bool:
    """Whether the ``.base`` chain of ``array`` ends in a memory map."""
    while isinstance(array, np.ndarray):
        array = array.base
    return isinstance(array, mmap.mmap)


def folder_digest(root) -> str:
    """The first 32 hex digits of SHA-256 over a folder's file names and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(root)):
        h.update(name.encode())
        h.update(open(os.path.join(root, name), "rb").read())
    return h.hexdigest()[:32]


# --------------------------------------------------------------------------
# CIFAR-10 binary files
# --------------------------------------------------------------------------


@given(st.lists(st.integers(0, 6), min_size=1, max_size=4), SEEDS)
@example(counts=[1, 2, 3], seed=0)  # three files of three sizes: each read in at its own offset
@example(counts=[2, 0, 1, 4], seed=1)  # an empty file among them
def test_write_read_round_trip(counts, seed):
    images, labels = random_cifar(seed, sum(counts))
    with tempfile.TemporaryDirectory() as root:
        start = 0
        for i, count in enumerate(counts):
            write_cifar10(os.path.join(root, f"data_batch_{i}.bin"), images[start:start + count],
                          labels[start:start + count])
            start += count
        if not labels.size:
            return  # all files empty: an error, tested below
        got_images, got_labels = read_cifar10(root)
        assert got_images.dtype == np.uint8 and got_images.shape == images.shape
        assert got_labels.dtype == np.int32 and got_labels.shape == labels.shape
        np.testing.assert_array_equal(got_images, images)
        np.testing.assert_array_equal(got_labels, labels)


def test_files_are_read_in_sorted_name_order(tmp_path, monkeypatch):
    for name, label in [("data_batch_3", 3), ("data_batch_1", 1), ("data_batch_2", 2)]:
        write_cifar10(tmp_path / name, np.full((2, 3, 32, 32), label, np.uint8), [label] * 2)
    write_cifar10(tmp_path / "test_batch", np.zeros((1, 3, 32, 32), np.uint8), [9])
    real_listdir = os.listdir  # whatever order the filesystem lists them in: here reverse sorted
    monkeypatch.setattr(os, "listdir", lambda path: sorted(real_listdir(path), reverse=True))
    images, labels = read_cifar10(tmp_path)
    np.testing.assert_array_equal(labels, [1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(images[:, 0, 0, 0], [1, 1, 2, 2, 3, 3])


def test_single_file_is_a_read_only_memmap_view(tmp_path):
    images, labels = random_cifar(0, 5)
    write_cifar10(tmp_path / "data_batch_1.bin", images, labels)
    got, _ = read_cifar10(tmp_path)
    assert memmap_backed(got) and not got.flags.writeable
    write_cifar10(tmp_path / "data_batch_2.bin", images, labels)
    both, _ = read_cifar10(tmp_path)
    assert not memmap_backed(both)  # several files: one in-memory copy


@pytest.mark.parametrize("images, labels, fragment", [
    (np.zeros((1, 3, 32, 31), np.uint8), [0], "images"),    # the right dtype, a wrong shape
    (np.zeros((1, 3, 32, 32), np.int16), [0], "images"),    # the right shape, a wrong dtype
    (np.zeros((2, 3, 32, 32), np.uint8), [0, -1], "label"),  # below 0 alone
    (np.zeros((2, 3, 32, 32), np.uint8), [9, 10], "label"),  # 10 alone
    (np.zeros((1, 3, 32, 32), np.uint8), np.array([1.0]), "label")])
def test_write_cifar10_refuses_each_wrong_part_alone(tmp_path, images, labels, fragment):
    with pytest.raises(ValueError, match=fragment):
        write_cifar10(tmp_path / "data_batch_1.bin", images, labels)
    assert not os.listdir(tmp_path)  # nothing half-written


def test_a_bad_cifar10_folder_is_refused_naming_the_file_and_the_value(tmp_path):
    missing = tmp_path / "nowhere"
    assert_raises_naming(FileNotFoundError, lambda: read_cifar10(missing), str(missing))
    write_cifar10(tmp_path / "test_batch.bin", *random_cifar(0, 1))
    assert_raises_naming(FileNotFoundError, lambda: read_cifar10(tmp_path), str(tmp_path), "'data_batch_'")
    for name in ("data_batch_1.bin", "data_batch_2.bin"):
        (tmp_path / name).write_bytes(b"")
    assert_raises_naming(ValueError, lambda: read_cifar10(tmp_path), str(tmp_path), "data_batch_1.bin",
                         "data_batch_2.bin")  # no record at all
    path = tmp_path / "data_batch_1.bin"
    write_cifar10(path, *random_cifar(0, 2))
    os.truncate(path, 2 * RECORD_BYTES - 5)
    assert_raises_naming(ValueError, lambda: read_cifar10(tmp_path), str(path), str(2 * RECORD_BYTES - 5))
    records = np.zeros((3, RECORD_BYTES), np.uint8)
    records[:, 0] = [4, 10, 2]  # written by hand: write_cifar10 refuses label 10
    path.write_bytes(records.tobytes())
    assert_raises_naming(ValueError, lambda: read_cifar10(tmp_path), str(path), "record 1", "label 10")


# --------------------------------------------------------------------------
# MNIST's IDX files
# --------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 7])
@pytest.mark.parametrize("compress, dotted", [(False, False), (True, False), (False, True), (True, True)])
def test_mnist_round_trip_plain_gzipped_and_dotted_names(tmp_path, compress, dotted, count):
    # Every spelling read_mnist's docstring names, and every N: the empty split (a plain
    # file that is not mapped), one image and several.
    images, labels = random_mnist(count, count)
    write_mnist(tmp_path, "test", images, labels)
    for name in os.listdir(tmp_path):
        path, new = tmp_path / name, tmp_path / (name.replace("-idx", ".idx") if dotted else name)
        if compress:
            with gzip.open(f"{new}.gz", "wb") as f:
                f.write(path.read_bytes())
            path.unlink()
        else:
            path.rename(new)
    got_images, got_labels = read_mnist(tmp_path, "test")
    assert got_images.dtype == np.uint8 and got_images.shape == (count, 1, 28, 28)
    assert got_labels.dtype == np.int32 and got_labels.shape == (count,)
    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, labels)


def test_uncompressed_mnist_images_are_a_read_only_memory_map(tmp_path):
    images, labels = random_mnist(7, 3)
    write_mnist(tmp_path, "train", images, labels)
    got, _ = read_mnist(tmp_path)
    assert memmap_backed(got) and not got.flags.writeable
    with pytest.raises(ValueError):
        got[0, 0, 0, 0] = 1
    np.testing.assert_array_equal(read_mnist(tmp_path)[0], images)  # the file is as written


def idx_images(height: int, width: int) -> bytes:
    """An IDX images file of two images of height x width."""
    return np.array([0x00000803, 2, height, width], ">u4").tobytes() + bytes(2 * height * width)


IMAGES, LABELS = "train-images-idx3-ubyte", "train-labels-idx1-ubyte"  # of five images, as written below


@pytest.mark.parametrize("name, edit, fragments", [
    (IMAGES, lambda d: b"\x00\x00\x08\x01" + d[4:], ["magic number 0x00000801"]),
    (IMAGES, lambda d: d[:-10], ["truncated", str(16 + 5 * 784 - 10)]),
    (IMAGES, lambda d: d + b"\x00", ["trailing bytes", str(16 + 5 * 784 + 1), str(16 + 5 * 784)]),
    (LABELS, lambda d: d + b"\x00", ["trailing bytes", "14", "13"]),
    (LABELS, lambda d: d[:4] + (4).to_bytes(4, "big") + d[8:-1], ["4 labels", "5 images"]),
    (LABELS, lambda d: d[:9] + b"\x0c" + d[10:], ["label 1 is 12"]),
    (LABELS, lambda d: d[:10] + b"\x0a" + d[11:], ["label 2 is 10"]),  # 10: the first one out
    (IMAGES, lambda d: idx_images(27, 28), ["27x28"]),  # either side off by one, and CIFAR's 32x32
    (IMAGES, lambda d: idx_images(28, 29), ["28x29"]),
    (IMAGES, lambda d: idx_images(32, 32), ["32x32"]),
])
def test_a_malformed_mnist_file_is_refused_naming_the_file_and_the_value(tmp_path, name, edit, fragments):
    write_mnist(tmp_path, "train", *random_mnist(2, 5))
    read_mnist(tmp_path)  # the control: the same files, untouched, are read
    path = tmp_path / name
    path.write_bytes(edit(path.read_bytes()))
    assert_raises_naming(ValueError, lambda: read_mnist(tmp_path), str(path), *fragments)


def test_a_missing_mnist_folder_or_file_is_named(tmp_path):
    missing = tmp_path / "nowhere"
    assert_raises_naming(FileNotFoundError, lambda: read_mnist(missing), str(missing))
    write_mnist(tmp_path, "train", *random_mnist(2, 5))
    os.unlink(tmp_path / LABELS)
    assert_raises_naming(FileNotFoundError, lambda: read_mnist(tmp_path), LABELS, str(tmp_path))


# --------------------------------------------------------------------------
# The synthetic datasets
# --------------------------------------------------------------------------


def test_the_synthetic_datasets_default_to_the_real_ones_sizes_and_seed_0():
    for writer, train in ((synthetic_cifar10, 50_000), (synthetic_mnist, 60_000)):
        defaults = {k: p.default for k, p in inspect.signature(writer).parameters.items() if k != "root"}
        assert defaults == {"num_train": train, "num_test": 10_000, "seed": 0}, (writer.__name__, defaults)


@pytest.mark.parametrize("writer", [synthetic_cifar10, synthetic_mnist])
def test_a_synthetic_dataset_is_a_function_of_its_sizes_and_seed(tmp_path, writer):
    def contents(name, seed):
        assert writer(tmp_path / name, num_train=9, num_test=3, seed=seed) == str(tmp_path / name)
        return {f: (tmp_path / name / f).read_bytes() for f in os.listdir(tmp_path / name)}

    first = contents("a", 7)
    assert contents("a", 7) == first  # again, into the now existing folder
    assert contents("b", 7) == first
    other = contents("c", 8)
    assert all(first[name] != other[name] for name in first)


def test_the_synthetic_bytes_are_the_same_on_every_machine(tmp_path):
    # Pinned on the NumPy the suite installs (its Generator's normal and uniform streams).
    synthetic_cifar10(tmp_path / "cifar", num_train=23, num_test=4, seed=7)
    assert sorted(os.listdir(tmp_path / "cifar")) == [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    assert folder_digest(tmp_path / "cifar") == "9f251677f85f746302fe583009d0ad60"
    assert read_cifar10(tmp_path / "cifar")[0].shape == (23, 3, 32, 32)
    assert read_cifar10(tmp_path / "cifar", TEST_PREFIX)[1].shape == (4,)
    # One past the generator's 4096-image chunk: both sides of its edge in one file.
    synthetic_mnist(tmp_path / "mnist", num_train=4097, num_test=1, seed=1)
    images, labels = read_mnist(tmp_path / "mnist")
    assert images.shape == (4097, 1, 28, 28) and sorted(set(labels.tolist())) == list(range(10))
    assert len(set(map(bytes, images[4094:4098]))) == 3  # the chunk's last two and the next: images
    assert folder_digest(tmp_path / "mnist") == "7772eb72a1f0d67e3e61b87d05be43d5"


def test_synthetic_cifar10_with_fewer_images_than_files(tmp_path):
    synthetic_cifar10(tmp_path, num_train=3, num_test=0)  # two of the five files hold no record
    assert read_cifar10(tmp_path)[1].shape == (3,)
    assert os.path.getsize(tmp_path / "test_batch.bin") == 0


# --------------------------------------------------------------------------
# Writes, and bad input
# --------------------------------------------------------------------------


def _writes(tmp_path):
    """Each writer, writing one small file set into tmp_path: (name, write)."""
    images, labels = np.zeros((2,) + IMAGE_SHAPE, np.uint8), np.array([1, 2])
    mnist_images, mnist_labels = random_mnist(1, 2)
    return [("cifar10", lambda: write_cifar10(tmp_path / "data_batch_1.bin", images, labels)),
            ("mnist", lambda: write_mnist(tmp_path, "train", mnist_images, mnist_labels))]


def test_a_failed_write_raises_its_own_error_and_leaves_the_old_files_and_nothing_else(tmp_path, monkeypatch):
    # A write that fails at the rename (a full disk, a kill between the two steps): the
    # folder holds what it held before, byte for byte, with no partial or temporary file.
    for name, write in _writes(tmp_path):
        write()
        before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
        with monkeypatch.context() as m:
            def full(src, dst):
                raise OSError(28, "No space left on device (simulated)")
            m.setattr(os, "replace", full)
            with pytest.raises(OSError, match="simulated"):
                write()
        assert {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)} == before, name
        write()  # the control: the same write, with the rename, succeeds
        assert sorted(os.listdir(tmp_path)) == sorted(before), name


def test_a_write_goes_through_a_hidden_file_beside_its_target_and_needs_no_system_temp_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-folder"))  # the system's is gone
    renamed = []
    replace = os.replace

    def watch(src, dst):
        renamed.append((os.path.dirname(src), os.path.basename(src), os.path.getsize(src), dst))
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", watch)
    for name, write in _writes(tmp_path):
        renamed.clear()
        write()
        assert renamed, name
        for folder, base, size, dst in renamed:
            assert folder == str(tmp_path) and os.path.dirname(dst) == str(tmp_path), (name, folder, dst)
            assert base.startswith(".") and os.path.getsize(dst) == size > 0, (name, base)
        assert not [f for f in os.listdir(tmp_path) if f.startswith(".")], name


DATASETS = {"synthetic_cifar10": synthetic_cifar10, "synthetic_mnist": synthetic_mnist}


@pytest.mark.parametrize("where", list(DATASETS))
@pytest.mark.parametrize("name, valid", [("num_train", 5), ("num_test", 2), ("seed", 3)])
@given(data=st.data())
@settings(max_examples=examples(8))
def test_every_int_parameter_refuses_what_is_not_an_int(where, name, valid, data):
    with tempfile.TemporaryDirectory() as root:
        args = {"num_train": 5, "num_test": 2, "seed": 3}
        call = lambda v: DATASETS[where](os.path.join(root, "data"), **{**args, name: v})
        assert_refuses_naming_value(call, where, name, data.draw(not_ints(valid), label=name))
        assert not os.path.exists(os.path.join(root, "data")), "refused at the call: nothing written"
        call(np.int64(valid))  # the control: the call is valid with an int, Python's or NumPy's


@pytest.mark.parametrize("prefix", [b"data_batch_", 5, None])
def test_read_cifar10_takes_a_str_prefix_and_refuses_any_other(tmp_path, prefix):
    synthetic_cifar10(tmp_path, num_train=3, num_test=1)
    assert read_cifar10(tmp_path, "data_batch_")[1].shape == (3,)  # the control: a str
    assert_raises_naming(ValueError, lambda: read_cifar10(tmp_path, prefix),
                         "read_cifar10: filename_prefix must be a str", repr(prefix))


@pytest.mark.parametrize("call, fragments", [
    (lambda d: synthetic_cifar10(d, num_train=-1), ["synthetic_cifar10: num_train must be >= 0, got -1"]),
    (lambda d: synthetic_mnist(d, seed=2**32), ["synthetic_mnist: seed=4294967296 is outside [0, 2**32)"]),
    (lambda d: read_cifar10(5), ["read_cifar10: file_root must be a path", "5"]),
    (lambda d: read_mnist(d, "validation"), ["read_mnist: split must be one of", "'validation'"]),
    (lambda d: read_mnist(b"folder"), ["read_mnist: folder must be a path", "b'folder'"]),
    (lambda d: write_mnist(d, "validation", *random_mnist(0, 2)), ["write_mnist: split must be one of",
                                                                   "'validation'"]),
    (lambda d: write_mnist(d, "train", random_mnist(0, 2)[0], np.array([1.5, 2.0])),
     ["write_mnist", "labels must be integers 0..9", "float64"]),
    (lambda d: write_cifar10(os.path.join(d, "x.bin"), np.zeros((2, 3, 32, 32), np.uint8), np.array([True, False])),
     ["write_cifar10", "labels must be integers 0..9", "bool"]),
    (lambda d: write_cifar10(None, np.zeros((1, 3, 32, 32), np.uint8), [1]), ["write_cifar10: path", "None"]),
])
def test_bad_input_is_refused_at_the_call_naming_the_parameter_and_the_value(tmp_path, call, fragments):
    assert_raises_naming(ValueError, lambda: call(str(tmp_path)), *fragments)
