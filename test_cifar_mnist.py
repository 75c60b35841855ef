"""Tests for cifar_mnist.py, the notebooks' datasets on disk: each guarantee its
docstrings state, checked.

* The CIFAR-10 binary reader/writer round-trips, reads files in sorted name
  order, maps a single file without copying, and names the file and the value
  in every error; synthetic_cifar10 is a function of its seed.
* MNIST's IDX files round-trip plain, gzipped and with dotted names;
  synthetic_mnist is a function of its seed; a wrong magic number, a truncated
  file, trailing bytes, a label count unlike the image count, a label above 9
  and a missing file are refused naming the file and the value.
"""

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


# --------------------------------------------------------------------------
# CIFAR-10 binary files
# --------------------------------------------------------------------------


def random_cifar(seed: int, count: int):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(count,) + IMAGE_SHAPE, dtype=np.uint8)
    return images, rng.integers(0, 10, size=count)


def memmap_backed(array: np.ndarray) -> bool:
    """Whether the ``.base`` chain of ``array`` ends in a memory map."""
    while isinstance(array, np.ndarray):
        array = array.base
    return isinstance(array, mmap.mmap)


@given(st.lists(st.integers(0, 6), min_size=1, max_size=4), SEEDS)
@example(counts=[1, 2, 3], seed=0)  # three files of three sizes: each read in at its own offset
@example(counts=[2, 0, 1, 4], seed=1)  # an empty file among them
def test_write_read_round_trip(counts, seed):
    images, labels = random_cifar(seed, sum(counts))
    with tempfile.TemporaryDirectory() as root:
        start = 0
        for i, count in enumerate(counts):
            write_cifar10(os.path.join(root, f"data_batch_{i}.bin"),
                                  images[start:start + count], labels[start:start + count])
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
        images = np.full((2, 3, 32, 32), label, np.uint8)
        write_cifar10(tmp_path / name, images, [label] * 2)
    write_cifar10(tmp_path / "test_batch", np.zeros((1, 3, 32, 32), np.uint8), [9])
    # Whatever order the filesystem lists them in, here reverse sorted.
    real_listdir = os.listdir
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


def folder_digest(root) -> str:
    """The first 32 hex digits of SHA-256 over a folder's file names and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(root)):
        h.update(name.encode())
        h.update(open(os.path.join(root, name), "rb").read())
    return h.hexdigest()[:32]


def test_the_synthetic_datasets_default_to_the_real_ones_sizes_and_seed_0():
    for writer, train in ((synthetic_cifar10, 50_000), (synthetic_mnist, 60_000)):
        defaults = {k: p.default for k, p in inspect.signature(writer).parameters.items() if k != "root"}
        assert defaults == {"num_train": train, "num_test": 10_000, "seed": 0}, (writer.__name__, defaults)


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


def test_synthetic_cifar10_is_a_function_of_the_seed(tmp_path):
    def folder(name, seed):
        return synthetic_cifar10(tmp_path / name, num_train=23, num_test=4, seed=seed)

    def contents(root):
        return {name: open(os.path.join(root, name), "rb").read() for name in os.listdir(root)}

    first, again = contents(folder("a", 7)), contents(folder("b", 7))
    other = contents(folder("c", 8))
    assert sorted(first) == [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    assert first == again
    assert all(first[name] != other[name] for name in first)
    # ... and the same bytes on every machine: the reference's synthetic data are fixed
    # (here on the NumPy the suite installs; Generator's normal and uniform streams)
    assert folder_digest(tmp_path / "a") == "9f251677f85f746302fe583009d0ad60"
    train_images, train_labels = read_cifar10(tmp_path / "a")
    assert train_images.shape == (23, 3, 32, 32) and train_labels.shape == (23,)
    assert read_cifar10(tmp_path / "a", TEST_PREFIX)[1].shape == (4,)


def test_synthetic_cifar10_with_fewer_images_than_files(tmp_path):
    # Three training images over five files: two files hold no record.
    synthetic_cifar10(tmp_path, num_train=3, num_test=0)
    assert read_cifar10(tmp_path)[1].shape == (3,)
    assert os.path.getsize(tmp_path / "test_batch.bin") == 0


def test_read_errors_name_the_folder_and_prefix(tmp_path):
    missing = tmp_path / "nowhere"
    assert_raises_naming(FileNotFoundError, lambda: read_cifar10(missing), str(missing))
    write_cifar10(tmp_path / "test_batch.bin", *random_cifar(0, 1))
    assert_raises_naming(FileNotFoundError, lambda: read_cifar10(tmp_path, "data_batch_"),
                         str(tmp_path), "'data_batch_'")


def test_truncated_file_is_named(tmp_path):
    path = tmp_path / "data_batch_1.bin"
    write_cifar10(path, *random_cifar(0, 2))
    os.truncate(path, 2 * RECORD_BYTES - 5)
    assert_raises_naming(ValueError, lambda: read_cifar10(tmp_path),
                         str(path), str(2 * RECORD_BYTES - 5))


def test_label_out_of_range_is_named(tmp_path):
    path = tmp_path / "data_batch_1.bin"
    records = np.zeros((3, RECORD_BYTES), np.uint8)
    records[:, 0] = [4, 10, 2]  # written by hand: write_cifar10 refuses label 10
    path.write_bytes(records.tobytes())
    assert_raises_naming(ValueError, lambda: read_cifar10(tmp_path),
                         str(path), "record 1", "label 10")


def test_empty_dataset_is_an_error(tmp_path):
    for name in ("data_batch_1.bin", "data_batch_2.bin"):
        (tmp_path / name).write_bytes(b"")
    assert_raises_naming(ValueError, lambda: read_cifar10(tmp_path),
                         str(tmp_path), "data_batch_1.bin", "data_batch_2.bin")


# --------------------------------------------------------------------------
# MNIST's IDX files
# --------------------------------------------------------------------------


@pytest.mark.parametrize("compress, dotted", [(False, False), (True, False), (False, True), (True, True)])
def test_mnist_round_trip_plain_gzipped_and_dotted_names(tmp_path, compress, dotted):
    # Every spelling read_mnist's docstring names: plain or .gz, each under either name.
    images, labels = random_mnist(1, 7)
    write_mnist(tmp_path, "test", images, labels)
    for name in os.listdir(tmp_path):
        path = tmp_path / name
        new = name.replace("-idx", ".idx") if dotted else name
        if compress:
            import gzip
            with gzip.open(tmp_path / (new + ".gz"), "wb") as f:
                f.write(path.read_bytes())
            path.unlink()
        else:
            path.rename(tmp_path / new)
    got_images, got_labels = read_mnist(tmp_path, "test")
    assert got_images.dtype == np.uint8 and got_images.shape == (7, 1, 28, 28)
    assert got_labels.dtype == np.int32
    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, labels)


def test_synthetic_mnist_is_a_function_of_the_seed(tmp_path):
    a = read_mnist(synthetic_mnist(tmp_path / "a", num_train=9, num_test=3, seed=2))
    b = read_mnist(synthetic_mnist(tmp_path / "b", num_train=9, num_test=3, seed=2))
    c = read_mnist(synthetic_mnist(tmp_path / "c", num_train=9, num_test=3, seed=3))
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(a[0], c[0])
    assert read_mnist(tmp_path / "a", "test")[0].shape == (3, 1, 28, 28)


def _corrupt(tmp_path, name: str, edit) -> str:
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(edit(data)))
    return str(path)


def test_mnist_errors_name_the_file_and_the_value(tmp_path):
    images, labels = random_mnist(2, 5)

    def fresh():
        for name in os.listdir(tmp_path):
            os.unlink(tmp_path / name)
        write_mnist(tmp_path, "train", images, labels)

    read = lambda: read_mnist(tmp_path)
    fresh()
    path = _corrupt(tmp_path, "train-images-idx3-ubyte", lambda d: d[:4] and b"\x00\x00\x08\x01" + d[4:])
    assert_raises_naming(ValueError, read, path, "magic number 0x00000801")
    fresh()
    path = _corrupt(tmp_path, "train-images-idx3-ubyte", lambda d: d[:-10])
    assert_raises_naming(ValueError, read, path, "truncated", str(16 + 5 * 784 - 10))
    fresh()
    path = _corrupt(tmp_path, "train-labels-idx1-ubyte", lambda d: d[:4] + (4).to_bytes(4, "big") + d[8:-1])
    assert_raises_naming(ValueError, read, path, "4 labels", "5 images")
    fresh()
    path = _corrupt(tmp_path, "train-labels-idx1-ubyte", lambda d: d[:9] + b"\x0c" + d[10:])
    assert_raises_naming(ValueError, read, path, "label 1 is 12")
    os.unlink(path)
    assert_raises_naming(FileNotFoundError, read, "train-labels-idx1-ubyte", str(tmp_path))


# --------------------------------------------------------------------------
# Sentences of the spec that only another module's tests held (issue 18's mutants)
# --------------------------------------------------------------------------


def test_mnist_label_10_and_trailing_bytes_are_refused(tmp_path):
    # "a label > 9" (10 is the first one out) and "longer than its header says".
    images, labels = random_mnist(4, 5)
    read = lambda: read_mnist(tmp_path)
    write_mnist(tmp_path, "train", images, labels)
    path = _corrupt(tmp_path, "train-labels-idx1-ubyte", lambda d: d[:10] + b"\x0a" + d[11:])
    assert_raises_naming(ValueError, read, path, "label 2 is 10")
    for name, count in (("train-images-idx3-ubyte", 16 + 5 * 784), ("train-labels-idx1-ubyte", 8 + 5)):
        write_mnist(tmp_path, "train", images, labels)
        path = _corrupt(tmp_path, name, lambda d: d + b"\x00")
        assert_raises_naming(ValueError, read, path, "trailing bytes", str(count + 1), str(count))
    write_mnist(tmp_path, "train", images, labels)
    read()  # the control: the same files, untouched, are read


# --------------------------------------------------------------------------
# Edges the mutation run found unheld (mutation.py pure)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1])
@pytest.mark.parametrize("compress", [False, True])
def test_mnist_split_of_zero_and_one_image_round_trips(tmp_path, count, compress):
    # read_mnist returns (images uint8 (N, 1, 28, 28), labels int32) for every N, the
    # empty split (the plain file's no-memory-map branch) and one image on either side.
    images, labels = random_mnist(5, count)
    write_mnist(tmp_path, "train", images, labels)
    if compress:
        import gzip
        for name in os.listdir(tmp_path):
            with gzip.open(tmp_path / (name + ".gz"), "wb") as f:
                f.write((tmp_path / name).read_bytes())
            os.unlink(tmp_path / name)
    got_images, got_labels = read_mnist(tmp_path)
    assert got_images.dtype == np.uint8 and got_images.shape == (count, 1, 28, 28)
    assert got_labels.dtype == np.int32 and got_labels.shape == (count,)
    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, labels)


@pytest.mark.parametrize("height, width", [(27, 28), (28, 29), (32, 32)])
def test_mnist_images_that_are_not_28x28_are_refused(tmp_path, height, width):
    # "a header that is not 28x28": either side off by one, and CIFAR's 32x32.
    images, labels = random_mnist(6, 2)
    write_mnist(tmp_path, "train", images, labels)
    pixels = np.zeros(2 * height * width, np.uint8).tobytes()
    header = np.array([0x00000803, 2, height, width], ">u4").tobytes()
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(header + pixels)
    assert_raises_naming(ValueError, lambda: read_mnist(tmp_path), str(path), f"{height}x{width}")


def test_synthetic_mnist_writes_into_an_existing_folder_and_defaults_to_seed_0(tmp_path):
    # synthetic_mnist is a function of (num_train, num_test, seed): a second call into the
    # same (now existing) folder writes the same files, and no seed means seed 0.
    synthetic_mnist(tmp_path, num_train=4, num_test=2, seed=0)
    first = read_mnist(tmp_path)[0].copy()
    assert synthetic_mnist(tmp_path, num_train=4, num_test=2) == str(tmp_path)
    np.testing.assert_array_equal(read_mnist(tmp_path)[0], first)


def test_synthetic_mnist_across_a_4096_image_chunk_holds_every_class(tmp_path):
    # num_train is any count (here one past the generator's 4096-image chunk, both sides of
    # its edge in one file), and the labels are CIFAR/MNIST classes: every one of 0..9 drawn.
    synthetic_mnist(tmp_path, num_train=4097, num_test=1, seed=1)
    images, labels = read_mnist(tmp_path)
    assert images.shape == (4097, 1, 28, 28) and labels.shape == (4097,)
    assert sorted(set(labels.tolist())) == list(range(10))
    assert len(set(map(bytes, images[4094:4098]))) == 3  # the chunk's last two and the next: images
    assert folder_digest(tmp_path) == "7772eb72a1f0d67e3e61b87d05be43d5"  # the draws across the chunk's edge


def test_uncompressed_mnist_images_are_a_read_only_memory_map(tmp_path):
    # read_mnist: "uncompressed images are a read-only memory map" (gzipped ones are read).
    images, labels = random_mnist(7, 3)
    write_mnist(tmp_path, "train", images, labels)
    got, _ = read_mnist(tmp_path)
    assert memmap_backed(got) and not got.flags.writeable
    with pytest.raises(ValueError):
        got[0, 0, 0, 0] = 1
    np.testing.assert_array_equal(read_mnist(tmp_path)[0], images)  # the file is as written


# --------------------------------------------------------------------------
# Issue 30.7: a wrong type or value is refused at the call, naming the function,
# the parameter and the value (ints: Python and NumPy integers, never a bool or a
# whole float)
# --------------------------------------------------------------------------


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


@pytest.mark.parametrize("call, fragments", [
    (lambda d: synthetic_cifar10(d, num_train=-1), ["synthetic_cifar10: num_train must be >= 0, got -1"]),
    (lambda d: synthetic_mnist(d, seed=2**32), ["synthetic_mnist: seed=4294967296 is outside [0, 2**32)"]),
    (lambda d: read_cifar10(5), ["read_cifar10: file_root must be a path", "5"]),
    (lambda d: read_cifar10(d, filename_prefix=None), ["read_cifar10: filename_prefix must be a str", "None"]),
    (lambda d: write_mnist(d, "validation", *random_mnist(0, 2)), ["write_mnist: split must be one of",
                                                                   "'validation'"]),
    (lambda d: write_mnist(d, "train", random_mnist(0, 2)[0], np.array([1.5, 2.0])),
     ["write_mnist", "labels must be integers 0..9", "float64"]),
    (lambda d: write_cifar10(os.path.join(d, "x.bin"), np.zeros((2, 3, 32, 32), np.uint8), np.array([True, False])),
     ["write_cifar10", "labels must be integers 0..9", "bool"]),
])
def test_the_reports_inputs_are_refused_at_the_call(tmp_path, call, fragments):
    # Each was a TypeError or KeyError from inside, or (float and bool labels) written as
    # their integer parts, before issue 30.7.
    assert_raises_naming(ValueError, lambda: call(str(tmp_path)), *fragments)


def _writes(tmp_path):
    """Each writer, writing one small file set into tmp_path: (name, write)."""
    images, labels = np.zeros((2,) + IMAGE_SHAPE, np.uint8), np.array([1, 2])
    mnist_images, mnist_labels = random_mnist(1, 2)
    return [("cifar10", lambda: write_cifar10(tmp_path / "data_batch_1.bin", images, labels)),
            ("mnist", lambda: write_mnist(tmp_path, "train", mnist_images, mnist_labels))]


def test_a_failed_write_raises_its_own_error_and_leaves_the_old_files_and_nothing_else(tmp_path, monkeypatch):
    """A write that fails at the rename (a full disk, a kill between the two steps) raises
    that error, and the folder holds what it held before, byte for byte: no partial file,
    no temporary file."""
    for name, write in _writes(tmp_path):
        write()
        before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
        with monkeypatch.context() as m:
            def full(src, dst):
                raise OSError(28, "No space left on device (planted)")
            m.setattr(os, "replace", full)
            with pytest.raises(OSError, match="planted"):
                write()
        assert {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)} == before, name
        write()  # the control: the same write, with the rename, succeeds
        assert sorted(os.listdir(tmp_path)) == sorted(before), name


def test_a_write_goes_through_a_hidden_file_beside_its_target_and_needs_no_system_temp_folder(tmp_path, monkeypatch):
    """The new bytes are written into a hidden file (its name starts with '.') in the
    target's own folder, then renamed: atomic on any filesystem, and a writer works with the
    system's temporary folder gone (here: TMPDIR pointing nowhere)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-folder"))
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
