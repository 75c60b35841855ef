"""encoding.py: samples that encode their own index, and their decoder.

Guarantees checked: every index below ``index_limit`` round-trips for uint8 images of
any shape (the plane scheme and the byte split at ceil(S/2), element by element, built
from the docstring alone) and for float and integer features, read as stored or through
a Normalize of either arithmetic (a negative std too), exactly at each dtype's limit,
which is refused, as is a negative index; a value decodes within a quarter of the
table's step and not beyond; a float sample decodes only to the non-negative integer it
holds (not 2.5, -1, inf, NaN, nor 2**63 or more: the answer is int64); samples that
are not flat, of no elements, or of one byte encode nothing or are refused, naming why;
the ramp planes make a mirror visible. Each has its control (a split one element off,
a sample made not flat, the dtype's largest value below the edge).
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import encoding
from arithmetic import ARITHMETICS, Normalize
from conftest import examples


def assert_indices(got, want, why="") -> None:
    """``got`` is int64 and holds exactly ``want``; a failure names the first slot that
    differs (no long diff of two lists)."""
    want = np.array(want, np.int64)
    assert got.dtype == np.int64 and got.shape == want.shape, (got.dtype, got.shape, want.shape, why)
    wrong = np.flatnonzero(got != want)
    assert not wrong.size, f"{why}: slot {wrong[0]} decodes to {got[wrong[0]]}, not {want[wrong[0]]}"


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_decode_recovers_indices_through_either_arithmetic(arithmetic):
    indices = np.array([0, 1, 255, 256, 1002, 65535])
    for norm in (Normalize(arithmetic=arithmetic),
                 Normalize(mean=(10.0, 20.0, 30.0), std=(2.0, 3.0, 4.0), arithmetic=arithmetic),
                 # a negative std: a decreasing table, in one channel or all
                 Normalize(mean=(10.0, 20.0, 30.0), std=(-2.0, 3.0, -4.0), arithmetic=arithmetic),
                 Normalize(mean=(0.0, 0.0, 0.0), std=(-1.0, -1.0, -1.0), arithmetic=arithmetic)):
        images = norm(encoding.encoded_images(indices))
        np.testing.assert_array_equal(encoding.decode_indices(images, norm), indices)


@pytest.mark.parametrize("std", [127.5, -127.5])
def test_a_value_decodes_within_a_quarter_of_the_tables_step_and_not_beyond(std):
    # The table's step is 1/127.5: 0.22 of it from an entry still decodes, 0.28 does not,
    # above or below, in an increasing table and a decreasing one.
    norm = Normalize(mean=(127.5,) * 3, std=(std,) * 3)
    step = 1 / 127.5
    for off, want in ((0.22, 9), (-0.22, 9), (0.28, -1), (-0.28, -1)):
        images = norm(encoding.encoded_images(np.array([9])))
        images[0, 0] += np.float32(off * step)
        np.testing.assert_array_equal(encoding.decode_indices(images, norm), [want], err_msg=f"{std} {off}")


def test_decode_marks_images_that_encode_nothing():
    norm = Normalize()
    images = norm(encoding.encoded_images(np.array([5, 6, 7])))
    images[0, 0, 3, 3] += 0.5  # plane 0 no longer flat
    images[1, 1] += 0.003  # between two table values (they are 1/127.5 apart)
    np.testing.assert_array_equal(encoding.decode_indices(images, norm), [-1, -1, 7])


@pytest.mark.parametrize("size", [2, 3, 5, 7, 9])
def test_odd_uint8_samples_split_low_and_high_bytes_at_ceil_half(size):
    """The documented layout, element by element: the first ceil(S/2) elements hold the
    low byte, the rest the high byte; every index 0..65535 round-trips."""
    half = -(-size // 2)
    [sample] = encoding.encoded_images([0x0302], (size,))
    np.testing.assert_array_equal(sample, [0x02] * half + [0x03] * (size - half))
    hand = np.array([[0x11] * half + [0x22] * (size - half)], np.uint8)  # built from the text alone
    np.testing.assert_array_equal(encoding.decode_indices(hand), [0x2211])
    every = np.arange(65536)
    np.testing.assert_array_equal(encoding.decode_indices(encoding.encoded_images(every, (size,))),
                                  every)
    # Control: the split one element off (floor instead of ceil) encodes nothing for odd S.
    if size % 2:
        off = np.array([[0x11] * (half - 1) + [0x22] * (size - half + 1)], np.uint8)
        np.testing.assert_array_equal(encoding.decode_indices(off), [-1])


FLOATS = [np.float16, np.float32, np.float64, ml_dtypes.bfloat16]


@settings(max_examples=examples(50))
@given(st.sampled_from(FLOATS), st.floats(allow_nan=True, allow_infinity=True, width=16))
def test_a_float_sample_decodes_only_to_the_non_negative_integer_it_holds(dtype, value):
    samples = np.full((1, 3), value).astype(dtype)
    held = float(samples[0, 0])
    integral = np.isfinite(held) and held >= 0 and held == np.floor(held)
    np.testing.assert_array_equal(encoding.decode_indices(samples), [int(held) if integral else -1], err_msg=str(held))


@pytest.mark.parametrize("dtype", FLOATS)
def test_non_integer_negative_and_non_finite_floats_encode_nothing(dtype):
    values = np.array([2.5, 0.5, -1.0, -2.0, -96.0, -0.0, np.inf, -np.inf, np.nan, 3.0], np.float64)
    samples = np.repeat(values[:, None], 4, axis=1).astype(dtype)
    # -0.0 is the integer 0; 3.0 is 3: the controls that decode.
    np.testing.assert_array_equal(encoding.decode_indices(samples), [-1, -1, -1, -1, -1, 0, -1, -1, -1, 3])


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
    np.testing.assert_array_equal(encoding.decode_indices(samples), edge)
    with pytest.raises(ValueError, match=rf"indices must lie in \[0, {limit}\)"):
        encoding.encoded_images([limit], shape, dtype)
    with pytest.raises(ValueError, match="indices must lie in"):
        encoding.encoded_images([-1], shape, dtype)
    # The limit is the dtype's own: one past it the dtype cannot hold the integer.
    if np.dtype(dtype) != np.uint8 and limit < 2**63:
        kind = np.dtype(dtype)
        held = np.array([limit + 1]).astype(kind)
        assert int(held.astype(np.float64)[0] if kind.kind in "fV" else held[0]) != limit + 1


def test_samples_without_two_bytes_or_without_elements_are_refused():
    assert encoding.index_limit((1,), np.uint8) == 0
    assert encoding.index_limit((0,), np.float32) == 0
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 0\)"):
        encoding.encoded_images([0], (1,), np.uint8)
    with pytest.raises(ValueError, match="at least 2 elements"):
        encoding.decode_indices(np.zeros((2, 1), np.uint8))
    with pytest.raises(ValueError, match="indices must be integers"):
        encoding.encoded_images([1.5], (2,), np.float32)
    with pytest.raises(ValueError, match="neither uint8, a float nor an integer"):
        encoding.index_limit((2,), np.bool_)


@pytest.mark.parametrize("shape, dtype", [((3,), np.uint8), ((3, 4, 4), np.uint8), ((2,), np.float32),
                                          ((), np.int16)])
def test_no_samples_encode_and_decode_to_nothing(shape, dtype):
    """A segment with no step, or a shard with no batch, has no samples: (0, ...) in, (0,) out."""
    samples = encoding.encoded_images(np.zeros(0, np.int64), shape, dtype)
    assert samples.shape == (0,) + shape and samples.dtype == dtype
    assert encoding.decode_indices(samples).shape == (0,)


@pytest.mark.parametrize("shape, dtype, normalize", [
    ((3, 32, 32), np.uint8, Normalize(mirror=True)),
    ((3, 32, 32), np.uint8, Normalize(crop=(20, 24), arithmetic="dali_cpu")),
    ((1, 16, 16), np.uint8, Normalize(mean=(0.0,), std=(255.0,), arithmetic="dali_cpu")),
    ((1, 16, 16), np.uint8, None),
    ((40,), np.uint8, None),
    ((40,), np.float32, None),
    ((4, 4), np.int16, None),
    ((2,), np.float16, None),
])
def test_indices_round_trip_for_any_sample(shape, dtype, normalize):
    limit = encoding.index_limit(shape, dtype)
    indices = np.array([0, 1, 255, 256, 1000, limit - 1]) % limit
    samples = encoding.encoded_images(indices, shape, dtype)
    assert samples.shape == (len(indices),) + shape and samples.dtype == dtype
    delivered = samples if normalize is None else normalize(samples)
    decoded = encoding.decode_indices(delivered, normalize)
    assert decoded.dtype == np.int64 and np.array_equal(decoded, indices)  # int64, exactly
    # Control: a sample whose digit-carrying part is not flat decodes to -1, and every
    # other sample of the batch still decodes (flatness is judged sample by sample).
    for element in (0, -1):  # the first element of the low part, the last of the high part
        broken = np.array(delivered, copy=True)
        broken.reshape(len(broken), -1)[1, element] += 1
        got = encoding.decode_indices(broken, normalize)
        if element == 0 or not (len(shape) == 3 and shape[0] >= 3):  # planes: the last element is the ramp's
            assert got[1] == -1, element
        assert np.array_equal(np.delete(got, 1), np.delete(indices, 1)), element
    with pytest.raises(ValueError, match=r"index_limit"):
        encoding.encoded_images([limit], shape, dtype)


def test_index_limits_are_the_exact_integers_of_each_dtype():
    assert encoding.index_limit((1, 16, 16), np.uint8) == 65536
    assert encoding.index_limit((40,), np.float32) == 2**24
    assert encoding.index_limit((40,), np.float16) == 2048
    # 2**24 + 1 is the first integer float32 cannot hold: the limit is where encoding breaks.
    assert np.float32(2**24 + 1) == np.float32(2**24)
    assert encoding.index_limit((1,), np.uint8) == 0  # one byte cannot hold two digits


@pytest.mark.parametrize("shape", [(3, 32, 32), (4, 3, 70), (3, 6, 10), (3, 5, 5), (5, 1, 1)], ids=str)
def test_the_planes_past_the_digits_hold_the_ramp_4x_plus_2y_mod_256_in_every_image(shape):
    """encoded_images' docstring: each plane from 2 on is (4x + 2y) mod 256 at row y, column x,
    whatever the index (a width of 70 wraps past 256); an even width makes every ramp pixel
    differ from its horizontal mirror, an even height from its vertical flip, and an odd
    width keeps only the middle column (the control: the mirror property is the ramp's)."""
    images = encoding.encoded_images(np.array([0, 1, 300, 65535]), shape)
    y, x = np.mgrid[0:shape[1], 0:shape[2]]
    ramp = (4 * x + 2 * y) % 256
    for image in images:
        for plane in image[2:]:
            np.testing.assert_array_equal(plane, ramp)
    planes = images[:, 2:]
    for axis, size in ((-1, shape[2]), (-2, shape[1])):
        same = np.flip(planes, axis) == planes
        if size % 2 == 0:
            assert not same.any(), (shape, axis)
        elif axis == -1:  # an odd width: the middle column is its own mirror, the rest differ
            middle = np.zeros(shape[2], bool)
            middle[shape[2] // 2] = True
            np.testing.assert_array_equal(same, np.broadcast_to(middle, same.shape))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ml_dtypes.bfloat16, np.longdouble,
                                   np.uint64, np.int64], ids=lambda d: np.dtype(d).name)
def test_a_value_of_2_to_the_63_or_more_encodes_nothing_and_the_largest_below_it_decodes(dtype):
    """The answer is int64: a sample holding 2**63 (or more) encodes nothing, on both sides
    of the edge: the dtype's largest value below 2**63 decodes to itself, exactly."""
    kind = np.dtype(dtype)
    if kind.kind in "iu":
        below, at_or_above = [2**63 - 1], ([2**63, 2**64 - 1] if kind.kind == "u" else [])
        values = np.array(below + at_or_above, dtype)
    else:
        edge = np.array(2.0**63).astype(dtype) if kind.itemsize > 2 or kind == ml_dtypes.bfloat16 else None
        if edge is None:  # float16's largest finite value is 65504: no 2**63 to hold
            values = np.array([65504.0, np.inf], dtype)
            below, at_or_above = [65504], [np.inf]
        else:
            under = np.nextafter(np.array(2.0**63, np.longdouble if kind == np.longdouble else np.float64),
                                 0).astype(dtype)
            if float(under) >= 2.0**63:  # bfloat16: nextafter in float64 rounds back up
                under = np.array(2.0**63 - 2.0**55, dtype)
            values = np.array([under, edge, edge * 2], dtype)
            below, at_or_above = [int(under)], [2**63, 2**64]
    samples = np.repeat(values[:, None], 3, axis=1)
    got = encoding.decode_indices(samples)
    assert_indices(got, below + [-1] * len(at_or_above), str(values))  # int64, exactly


@pytest.mark.parametrize("shape", [(0,), (0, 4), (4, 0, 2)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.float64])
def test_a_sample_of_no_elements_encodes_nothing(shape, dtype):
    """decode_indices' docstring: a sample of 0 elements encodes nothing: -1 for each of B
    samples, int64 (B = 3 here: the B = 0 case is test_no_samples_encode_and_decode_to_nothing);
    uint8 needs two elements and refuses one of none, naming it."""
    got = encoding.decode_indices(np.zeros((3,) + shape, dtype))
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [-1, -1, -1])
    with pytest.raises(ValueError, match="at least 2 elements"):
        encoding.decode_indices(np.zeros((3,) + shape, np.uint8))


def test_only_planes_0_and_1_carry_the_index_and_the_ramp_may_be_anything():
    """decode_indices reads (C >= 3, H, W) images by planes 0 and 1 alone: a ramp plane
    changed (raw, or normalised beyond a quarter of the table's step) still decodes; the
    control: the same change in plane 1 encodes nothing."""
    norm = Normalize()
    for plane, want in ((2, 77), (1, -1)):
        raw = encoding.encoded_images(np.array([77]))
        raw[0, plane, 0, 0] += 3
        assert_indices(encoding.decode_indices(raw), [want], f"raw, plane {plane}")
        images = norm(encoding.encoded_images(np.array([77])))
        images[0, plane, 1, 1] += np.float32(0.4 / 127.5)
        assert_indices(encoding.decode_indices(images, norm), [want], f"normalised, plane {plane}")


def test_a_value_exactly_a_quarter_step_from_the_table_encodes_nothing():
    """"a quarter of the table's step or more from every entry encodes nothing": with a
    table of step 1 (mean 0, std 1: entries 0..255, exact) 9.25 and 8.75 are exactly a
    quarter from 9 and encode nothing; 9.2421875 (just under) decodes."""
    norm = Normalize(mean=(0.0,) * 3, std=(1.0,) * 3)
    for offset, want in ((0.25, -1), (-0.25, -1), (0.2421875, 9), (-0.2421875, 9)):
        images = norm(encoding.encoded_images(np.array([9])))
        images[0, 0] += np.float32(offset)
        assert_indices(encoding.decode_indices(images, norm), [want], f"offset {offset}")


def test_indices_are_any_integers_in_any_shape_and_nothing_else():
    """encoded_images takes integer indices of any integer dtype, Python ints in an object
    array (beyond int64's range too, then refused by the limit), in any shape (flattened:
    one sample each); bools, floats (even integral ones) and other objects are refused."""
    grid = np.array([[1, 2], [3, 4]])
    assert_indices(encoding.decode_indices(encoding.encoded_images(grid, (4,))), [1, 2, 3, 4], "a 2 x 2 grid")
    for ok in (np.array([5, 6], np.uint16), np.array([5, 6], object), [5, 6]):
        assert_indices(encoding.decode_indices(encoding.encoded_images(ok, (4,))), [5, 6], repr(ok))
    with pytest.raises(ValueError, match="indices must lie in"):
        encoding.encoded_images(np.array([2**70], object), (4,))
    for bad in (np.array([True, False]), np.array([1.0, 2.0]), np.array(["1"], object), np.array([1.5], object)):
        with pytest.raises(ValueError, match="indices must be integers"):
            encoding.encoded_images(bad, (4,))


def test_an_unsigned_64_bit_sample_must_be_flat_too():
    """uint64 samples are read exactly and by the same rule as every dtype: all elements
    equal, else nothing (the control: the flat one decodes)."""
    samples = np.array([[2**62, 2**62, 2**62], [2**62, 2**62, 5]], np.uint64)
    assert_indices(encoding.decode_indices(samples), [2**62, -1], "uint64")


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, np.bool_, np.str_, np.dtype("V4")],
                         ids=lambda d: np.dtype(d).str)
def test_a_dtype_that_is_no_number_has_no_index_limit(dtype):
    with pytest.raises(ValueError, match="neither uint8, a float nor an integer"):
        encoding.index_limit((2,), dtype)
