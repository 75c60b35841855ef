"""encoding.py: samples that encode their own index, and their decoder.

Every index below ``index_limit`` round-trips, for uint8 images of any shape (the plane
scheme and the byte split at ceil(S/2)) and for float and integer features, as stored or
through a Normalize of either arithmetic (a negative std too); the limit is exact and
refused. A value decodes within a quarter of the table's step and not beyond; a float
sample decodes only to the non-negative integer below 2**63 it holds; a sample that is not
flat encodes nothing; the ramp planes make a mirror visible; bad input is refused by name.
Each has its control: a sample made not flat, a split one element off, the value at the edge.
"""

import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import encoding
from arithmetic import ARITHMETICS, Normalize
from conftest import examples


def assert_indices(got, want, why="") -> None:
    """``got`` is int64 and holds exactly ``want``; a failure names the first slot that differs."""
    want = np.array(want, np.int64)
    assert got.dtype == np.int64 and got.shape == want.shape, (got.dtype, got.shape, want.shape, why)
    wrong = np.flatnonzero(got != want)
    assert not wrong.size, f"{why}: slot {wrong[0]} decodes to {got[wrong[0]]}, not {want[wrong[0]]}"


NORMALISED = [Normalize(mirror=True), Normalize(crop=(20, 24), arithmetic="dali_cpu")] + [
    Normalize(**table, arithmetic=arithmetic) for arithmetic in ARITHMETICS
    for table in [{}, dict(mean=(10.0, 20.0, 30.0), std=(2.0, 3.0, 4.0)),
                  dict(mean=(10.0, 20.0, 30.0), std=(-2.0, 3.0, -4.0)),  # decreasing tables, in some
                  dict(mean=(0.0, 0.0, 0.0), std=(-1.0, -1.0, -1.0))]]  # channels or all
SAMPLES = [((3, 32, 32), np.uint8, norm) for norm in NORMALISED] + [
    ((1, 16, 16), np.uint8, Normalize(mean=(0.0,), std=(255.0,), arithmetic="dali_cpu")),
    ((1, 16, 16), np.uint8, None), ((40,), np.uint8, None), ((3, 4, 4), np.uint8, None),
    ((40,), np.float32, None), ((4, 4), np.int16, None), ((2,), np.float16, None), ((3,), np.uint64, None)]


@pytest.mark.parametrize("shape, dtype, normalize", SAMPLES,
                         ids=[f"{shape}-{np.dtype(d).name}-{i}" for i, (shape, d, _) in enumerate(SAMPLES)])
def test_indices_round_trip_for_any_sample(shape, dtype, normalize):
    limit = encoding.index_limit(shape, dtype)
    indices = np.array([0, 1, 255, 256, 1000, limit - 1])
    samples = encoding.encoded_images(indices, shape, dtype)
    assert samples.shape == (len(indices),) + shape and samples.dtype == dtype
    delivered = samples if normalize is None else normalize(samples)
    assert_indices(encoding.decode_indices(delivered, normalize), indices, "round trip")
    # Control: a sample whose index-carrying part is not flat encodes nothing, and the
    # others still decode (flatness is judged sample by sample).
    for element in (0, -1):  # the first element of the low part, the last of the high part
        broken = np.array(delivered, copy=True)
        broken.reshape(len(broken), -1)[1, element] += 1
        got = encoding.decode_indices(broken, normalize)
        if element == 0 or not (len(shape) == 3 and shape[0] >= 3):  # planes: the last element is the ramp's
            assert got[1] == -1, element
        assert_indices(np.delete(got, 1), np.delete(indices, 1), f"element {element}")


@pytest.mark.parametrize("std", [1.0, -1.0])
def test_a_value_decodes_less_than_a_quarter_of_the_tables_step_away_and_not_at_it(std):
    """A table of step 1 (mean 0, std +-1: entries 0..+-255, exact, increasing or not):
    9 +- 0.25 is exactly a quarter step away and encodes nothing; 9 +- 0.2421875 decodes."""
    norm = Normalize(mean=(0.0,) * 3, std=(std,) * 3)
    for offset, want in ((0.25, -1), (-0.25, -1), (0.2421875, 9), (-0.2421875, 9)):
        images = norm(encoding.encoded_images(np.array([9])))
        images[0, 0] += np.float32(offset)
        assert_indices(encoding.decode_indices(images, norm), [want], f"offset {offset}")


@pytest.mark.parametrize("size", [2, 3, 5, 7, 9])
def test_uint8_samples_split_low_and_high_bytes_at_ceil_half(size):
    """The documented layout, element by element; every index 0..65535 round-trips."""
    half = -(-size // 2)
    [sample] = encoding.encoded_images([0x0302], (size,))
    np.testing.assert_array_equal(sample, [0x02] * half + [0x03] * (size - half))
    hand = np.array([[0x11] * half + [0x22] * (size - half)], np.uint8)  # built from the docstring
    assert_indices(encoding.decode_indices(hand), [0x2211], "by hand")
    every = np.arange(65536)
    assert_indices(encoding.decode_indices(encoding.encoded_images(every, (size,))), every, "every index")
    if size % 2:  # control: the split one element off (floor, not ceil) encodes nothing
        off = np.array([[0x11] * (half - 1) + [0x22] * (size - half + 1)], np.uint8)
        assert_indices(encoding.decode_indices(off), [-1], "floor split")


FLOATS = [np.float16, np.float32, np.float64, ml_dtypes.bfloat16]
FIXED = {2.5: -1, 0.5: -1, -1.0: -1, -2.0: -1, -96.0: -1, -0.0: 0, np.inf: -1, -np.inf: -1, np.nan: -1, 3.0: 3}


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@settings(max_examples=examples(15))
@given(value=st.floats(allow_nan=True, allow_infinity=True, width=16))
def test_a_float_sample_decodes_only_to_the_non_negative_integer_it_holds(dtype, value):
    """The fixed values by hand (-0.0 is the integer 0), then any value by the rule."""
    samples = np.repeat(np.array(list(FIXED) + [value])[:, None], 3, axis=1).astype(dtype)
    held = float(samples[-1, 0])
    integral = np.isfinite(held) and held >= 0 and held == np.floor(held)
    assert_indices(encoding.decode_indices(samples), list(FIXED.values()) + [int(held) if integral else -1],
                   str(held))


LIMITS = {np.uint8: 65536, np.float16: 2048, ml_dtypes.bfloat16: 256, np.float32: 2**24,
          np.float64: 2**53, np.int8: 128, np.int16: 2**15, np.uint16: 2**16, np.int32: 2**31,
          np.uint32: 2**32, np.int64: 2**63, np.uint64: 2**63,  # index_limit's docstring
          np.longdouble: min(2 ** (np.finfo(np.longdouble).nmant + 1), 2**63)}  # x86: 2**63


@pytest.mark.parametrize("dtype", list(LIMITS), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(3,), (2, 2), (3, 4, 4)], ids=str)
def test_index_limit_is_exact_at_its_edge(dtype, shape):
    limit = encoding.index_limit(shape, dtype)
    assert limit == LIMITS[dtype]
    edge = np.array([limit - 2, limit - 1], np.int64)
    samples = encoding.encoded_images(edge, shape, dtype)
    assert samples.dtype == np.dtype(dtype) and samples.shape == (2,) + shape
    assert_indices(encoding.decode_indices(samples), edge, "at the edge")
    with pytest.raises(ValueError, match=rf"indices must lie in \[0, {limit}\)"):
        encoding.encoded_images([limit], shape, dtype)
    with pytest.raises(ValueError, match="indices must lie in"):
        encoding.encoded_images([-1], shape, dtype)
    # The limit is the dtype's own: one past it the dtype cannot hold the integer.
    if np.dtype(dtype) != np.uint8 and limit < 2**63:
        kind = np.dtype(dtype)
        held = np.array([limit + 1]).astype(kind)
        assert int(held.astype(np.float64)[0] if kind.kind in "fV" else held[0]) != limit + 1


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ml_dtypes.bfloat16, np.longdouble,
                                   np.uint64, np.int64], ids=lambda d: np.dtype(d).name)
def test_a_value_of_2_to_the_63_or_more_encodes_nothing_and_the_largest_below_it_decodes(dtype):
    """The answer is int64: on both sides of 2**63, exactly."""
    kind = np.dtype(dtype)
    if kind.kind in "iu":
        below, at_or_above = [2**63 - 1], ([2**63, 2**64 - 1] if kind.kind == "u" else [])
        values = np.array(below + at_or_above, dtype)
    elif kind == np.float16:  # its largest finite value is 65504: no 2**63 to hold
        values, below, at_or_above = np.array([65504.0, np.inf], dtype), [65504], [np.inf]
    else:
        edge = np.array(2.0**63).astype(dtype)
        under = np.nextafter(np.array(2.0**63, np.longdouble if kind == np.longdouble else np.float64),
                             0).astype(dtype)
        if float(under) >= 2.0**63:  # bfloat16: nextafter in float64 rounds back up
            under = np.array(2.0**63 - 2.0**55, dtype)
        values, below, at_or_above = np.array([under, edge, edge * 2], dtype), [int(under)], [2**63, 2**64]
    got = encoding.decode_indices(np.repeat(values[:, None], 3, axis=1))
    assert_indices(got, below + [-1] * len(at_or_above), str(values))


@pytest.mark.parametrize("shape, dtype", [((3,), np.uint8), ((3, 4, 4), np.uint8), ((2,), np.float32),
                                          ((), np.int16)])
def test_no_samples_encode_and_decode_to_nothing(shape, dtype):
    """A segment with no step, or a shard with no batch: (0, ...) in, (0,) out."""
    samples = encoding.encoded_images(np.zeros(0, np.int64), shape, dtype)
    assert samples.shape == (0,) + shape and samples.dtype == dtype
    assert encoding.decode_indices(samples).shape == (0,)


@pytest.mark.parametrize("shape", [(0,), (0, 4), (4, 0, 2)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.float64])
def test_a_sample_of_no_elements_encodes_nothing(shape, dtype):
    assert encoding.index_limit(shape, dtype) == 0
    assert_indices(encoding.decode_indices(np.zeros((3,) + shape, dtype)), [-1, -1, -1], str(shape))


@pytest.mark.parametrize("shape", [(3, 32, 32), (4, 3, 70), (3, 6, 10), (3, 5, 5), (5, 1, 1)], ids=str)
def test_the_planes_past_the_digits_hold_the_ramp_4x_plus_2y_mod_256_in_every_image(shape):
    """Each plane from 2 on is (4x + 2y) mod 256, whatever the index (a width of 70 wraps);
    an even width makes every ramp pixel differ from its mirror, an even height from its
    flip; an odd width keeps only the middle column (the control)."""
    images = encoding.encoded_images(np.array([0, 1, 300, 65535]), shape)
    y, x = np.mgrid[0:shape[1], 0:shape[2]]
    np.testing.assert_array_equal(images[:, 2:], np.broadcast_to((4 * x + 2 * y) % 256, images[:, 2:].shape))
    planes = images[:, 2:]
    for axis, size in ((-1, shape[2]), (-2, shape[1])):
        same = np.flip(planes, axis) == planes
        if size % 2 == 0:
            assert not same.any(), (shape, axis)
        elif axis == -1:
            middle = np.arange(shape[2]) == shape[2] // 2
            np.testing.assert_array_equal(same, np.broadcast_to(middle, same.shape))


def test_only_planes_0_and_1_carry_the_index_and_the_ramp_may_be_anything():
    """A ramp plane changed (raw, or normalised beyond a quarter step) still decodes; the
    control: the same change in plane 1 encodes nothing."""
    norm = Normalize()
    for plane, want in ((2, 77), (1, -1)):
        raw = encoding.encoded_images(np.array([77]))
        raw[0, plane, 0, 0] += 3
        assert_indices(encoding.decode_indices(raw), [want], f"raw, plane {plane}")
        images = norm(encoding.encoded_images(np.array([77])))
        images[0, plane, 1, 1] += np.float32(0.4 / 127.5)
        assert_indices(encoding.decode_indices(images, norm), [want], f"normalised, plane {plane}")


def test_indices_are_any_integers_in_any_shape():
    """Any integer dtype, Python ints in an object array (beyond int64 too, then refused by
    the limit), in any shape (flattened: one sample each)."""
    grid = np.array([[1, 2], [3, 4]])
    assert_indices(encoding.decode_indices(encoding.encoded_images(grid, (4,))), [1, 2, 3, 4], "a 2 x 2 grid")
    for ok in (np.array([5, 6], np.uint16), np.array([5, 6], object), [5, 6]):
        assert_indices(encoding.decode_indices(encoding.encoded_images(ok, (4,))), [5, 6], repr(ok))
    with pytest.raises(ValueError, match="indices must lie in"):
        encoding.encoded_images(np.array([2**70], object), (4,))


BAD = [  # (call, the words of its ValueError)
    (lambda: encoding.encoded_images(np.array([True]), (4,)),
     "encoded_images: indices must be integers, got dtype bool"),
    (lambda: encoding.encoded_images(np.array([1.0]), (4,)), "indices must be integers, got dtype float64"),
    (lambda: encoding.encoded_images(np.array(["1"], object), (4,)), "indices must be integers, got dtype object"),
    (lambda: encoding.encoded_images(np.array([1.5], object), (4,)), "indices must be integers, got dtype object"),
    (lambda: encoding.encoded_images([0], (1,), np.uint8), "indices must lie in [0, 0) for samples (1,)"),
    (lambda: encoding.encoded_images([0], (-1, 2), np.float32),
     "encoded_images: shape must be a tuple of non-negative ints, got (-1, 2)"),
    (lambda: encoding.index_limit(40, np.float32),
     "index_limit: shape must be a tuple of non-negative ints, got 40"),
    (lambda: encoding.index_limit((2.0,), np.float32), "got (2.0,)"),
    (lambda: encoding.encoded_images([0], (2,), np.bool_), "encoded_images: dtype=bool is neither uint8, a float"),
    (lambda: encoding.decode_indices(np.zeros((3, 1), np.uint8)), "uint8 samples need at least 2 elements"),
    (lambda: encoding.decode_indices(np.zeros((3, 0, 2), np.uint8)), "uint8 samples need at least 2 elements"),
    (lambda: encoding.decode_indices(np.zeros(4, np.uint8)), "got images of shape (4,)"),
    (lambda: encoding.decode_indices(np.float32(3)), "decode_indices: samples must be (B, ...) with a batch axis"),
    (lambda: encoding.decode_indices(np.zeros((2, 3, 4), np.float32), Normalize()),
     "with a Normalize of 3 channels, images must be (B, 3, H, W), got shape (2, 3, 4)"),
    (lambda: encoding.decode_indices(np.zeros((2, 1, 4, 4), np.float32), Normalize()), "got shape (2, 1, 4, 4)"),
]


@pytest.mark.parametrize("call, words", BAD, ids=[words[:48] for _, words in BAD])
def test_bad_input_is_refused_naming_the_parameter_and_value(call, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        call()


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, np.bool_, np.str_, np.dtype("V4")],
                         ids=lambda d: np.dtype(d).str)
def test_a_dtype_that_is_no_number_has_no_index_limit(dtype):
    with pytest.raises(ValueError, match="neither uint8, a float nor an integer"):
        encoding.index_limit((2,), dtype)
