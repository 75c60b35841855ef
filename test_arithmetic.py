"""Tests of arithmetic.py: each guarantee its docstrings state.

* Each vendor's formula, evaluated here in NumPy (rocAL's fmaf in an extended long
  double, DALI's CPU subtract then multiply), equals its table bit for bit; the
  notebook's values differ from the naive (x - mean) / std, counted.
* normalize_table, crop_anchor and crop_mirror_normalize are implemented again from
  their docstrings alone (``docstring_*``: Python integers, fractions.Fraction and
  loops, each float32 operation on exact values rounded once; conftest holds the
  float32 helpers and the table, which test_loaders.py shares) and compared bit for
  bit over drawn inputs, with the cases that tell one reading from another pinned.
* crop_mirror_normalize is close to a float64 reference; each vendor rounds a half-way
  anchor its own way; the mirror flips inside the crop window.
* Normalize is equal, and hashes alike, exactly when its fields are, bit for bit.
* Bad input is refused at the call, naming the function, the parameter and the value.
"""

import itertools
import math
import warnings
from decimal import Decimal
from fractions import Fraction
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from arithmetic import (ARITHMETICS, Normalize, aligned_empty, crop_anchor, crop_mirror_normalize, crop_window,
                        keyed_table, normalize_table, one_row, table_key)
from conftest import (NOT_DOUBLES, SEEDS, assert_raises_naming, assert_refuses_naming_value, assert_same_bits,
                      crop_cases, examples, not_ints)

X = np.arange(256)
NOTEBOOK = ((127.5,) * 3, (127.5,) * 3)
F32_MAX = float(np.finfo(np.float32).max)  # (2 - 2**-23) * 2**127



# --------------------------------------------------------------------------
# arithmetic.py's docstrings read again, exactly: float32 as exact rationals, each operation
# rounded once, the sign of a zero as IEEE 754 gives it.
# --------------------------------------------------------------------------


FLOAT32_MAX = Fraction(2) ** 128 - Fraction(2) ** 104


def r32(exact: Fraction) -> Fraction:
    """Round-to-nearest-even to float32, with integers: |v| = q * 2**e, q in [2**23, 2**24)
    for normal numbers, e >= -149 below; Python's round() of a Fraction rounds half to even."""
    if exact == 0:
        return Fraction(0)
    e = math.floor(math.log2(abs(exact))) - 23
    while abs(exact) / Fraction(2) ** e >= 2**24:  # log2 of a Fraction can be off by one
        e += 1
    while abs(exact) / Fraction(2) ** e < 2**23:
        e -= 1
    e = max(e, -149)
    value = round(exact / Fraction(2) ** e) * Fraction(2) ** e
    assert abs(value) <= FLOAT32_MAX, "overflow: the spec says this is refused"
    return value


class F32(NamedTuple):
    """A float32 as the text sees it: its exact value and its sign bit (which
    matters only for a zero)."""
    value: Fraction
    negative: bool


def f32(exact: Fraction, negative_if_zero: bool) -> F32:
    """An operation's exact result rounded once to float32. A non-zero result that
    rounds to zero keeps its sign (underflow); an exact zero takes the sign the
    operation's rule gives (``negative_if_zero``)."""
    value = r32(exact)
    if value != 0:
        return F32(value, value < 0)
    return F32(value, exact < 0 if exact != 0 else negative_if_zero)


def from_double(d: float) -> F32:
    return f32(Fraction(d), math.copysign(1.0, d) < 0)


# IEEE 754's rules for the sign of an exact zero (round to nearest), as the text restates them.
def mul(a: F32, b: F32) -> F32:
    return f32(a.value * b.value, a.negative != b.negative)


def div(a: F32, b: F32) -> F32:
    return f32(a.value / b.value, a.negative != b.negative)


def add(a: F32, b: F32) -> F32:
    return f32(a.value + b.value, a.negative and b.negative)


def neg(a: F32) -> F32:
    return F32(-a.value, not a.negative)


def fma(a: F32, b: F32, c: F32) -> F32:
    return f32(a.value * b.value + c.value, (a.negative != b.negative) and c.negative)


def bits(x: F32) -> int:
    """The float32 bit pattern of ``x``."""
    if x.value == 0:
        return 0x80000000 if x.negative else 0
    return int(np.float32(float(x.value)).view(np.uint32))  # exact: x.value is a float32


def docstring_normalize_table(mean, std, arithmetic) -> list[list[int]]:
    """normalize_table's docstring, as float32 bit patterns: float() of each entry,
    then every operation on signed exact values rounded once."""
    C = len(mean)
    one = F32(Fraction(1), False)
    table = []
    for c in range(C):
        m, s = from_double(float(mean[c])), from_double(float(std[c]))
        inv = div(one, s)
        xs = [F32(Fraction(x), False) for x in range(256)]
        if arithmetic == "dali_cpu":
            table.append([bits(mul(add(x, neg(m)), inv)) for x in xs])
            continue
        off = neg(div(m, s)) if arithmetic == "rocal" and C == 1 else neg(mul(m, inv))
        table.append([bits(fma(x, inv, off)) for x in xs])
    return table


def coordinate_image() -> np.ndarray:
    """Channel 0 holds the row number, channel 1 the column number."""
    image = np.zeros((1, 3, 32, 32), np.uint8)
    image[0, 0] = np.arange(32)[:, None]
    image[0, 1] = np.arange(32)[None, :]
    return image


# --------------------------------------------------------------------------
# crop_mirror_normalize
# --------------------------------------------------------------------------


def reference_crop_mirror_normalize(images, crop, crop_pos, mirror, mean, std):
    """The docstring's formula, one output column at a time, in float64."""
    n, c, h, w = images.shape
    ch, cw = crop
    y0, x0 = round(crop_pos[0] * (h - ch)), round(crop_pos[1] * (w - cw))  # half to even
    mean = np.asarray(mean, np.float64)[:, None]
    std = np.asarray(std, np.float64)[:, None]
    out = np.empty((n, c, ch, cw))
    for i in range(n):
        for x in range(cw):
            source = x0 + (cw - 1 - x if mirror[i] else x)
            out[i, :, :, x] = (images[i, :, y0:y0 + ch, source] - mean) / std
    return out


@given(crop_cases())
def test_crop_mirror_normalize_matches_reference(case):
    images, crop, crop_pos, mirror, mean, std = case
    got = crop_mirror_normalize(images, crop=crop, crop_pos=crop_pos, mirror=np.array(mirror), mean=mean, std=std)
    want = reference_crop_mirror_normalize(images, crop, crop_pos, mirror, mean, std)
    assert got.dtype == np.float32 and got.shape == want.shape
    # float32 rounding of mean, std, the difference and the quotient: a few ulps
    # of the largest intermediate, (255 + |mean|) / |std|.
    scale = (255 + np.abs(mean)) / np.abs(std)
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-7 * scale.max())


@pytest.mark.parametrize("size, rocal, dali", [(29, 2, 2), (31, 0, 1), (27, 2, 3), (25, 4, 4), (30, 1, 1),
                                               (32, 0, 0)])
def test_each_vendor_rounds_a_half_way_anchor_its_own_way(size, rocal, dali):
    # 0.5 * (32 - size) = 1.5, 0.5, 2.5, 3.5, 1, 0: rocAL rounds half to even, DALI half away,
    # and the pixels show it (the window's first row and column).
    for arithmetic, anchor in (("rocal", rocal), ("dali_cpu", dali), ("dali_gpu", dali)):
        assert crop_anchor(0.5, 32, size, arithmetic) == anchor
        out = crop_mirror_normalize(coordinate_image(), crop=(size, size), arithmetic=arithmetic)
        assert out[0, 0, 0, 0] == anchor and out[0, 1, 0, 0] == anchor, arithmetic


@pytest.mark.parametrize("mirror", [True, np.True_, False, np.False_, [True, False], np.array([False, True])])
def test_mirror_flips_each_chosen_image_inside_the_crop_window(mirror):
    images = np.concatenate([coordinate_image()] * 2)
    images[1, 2] = 9  # two different images
    plain = crop_mirror_normalize(images, crop=(4, 8), crop_pos=(0.0, 0.25))
    np.testing.assert_array_equal(plain[:, 1, 0], [np.arange(6, 14)] * 2)  # the window: columns 6..13
    got = crop_mirror_normalize(images, crop=(4, 8), crop_pos=(0.0, 0.25), mirror=mirror)
    for n, flip in enumerate(np.broadcast_to(mirror, 2)):
        assert_same_bits(got[n], plain[n, ..., ::-1] if flip else plain[n], f"image {n}")


def test_aligned_empty_starts_on_its_boundary_for_any_shape():
    for align, shape in itertools.product([None, 1, 2, 48, 64, 4096], [5, (0,), (3, 0), (2, 3, 4), ()]):
        for _ in range(8):  # several allocations: different addresses
            x = aligned_empty(shape, np.float32) if align is None else aligned_empty(shape, np.float32, align)
            assert x.shape == np.empty(shape).shape and x.dtype == np.float32, (shape, align)
            assert x.size == 0 or x.ctypes.data % (align or 64) == 0, (shape, align)  # default 64
            assert x.flags.c_contiguous and x.flags.writeable


# --------------------------------------------------------------------------
# The vendors' formulas, evaluated in NumPy
# --------------------------------------------------------------------------


def rocal_formula(mean, std, offset=None) -> np.ndarray:
    """rocAL's fmaf(x, inv, offset) per pixel: x * inv and the sum are exact in a 64-bit-mantissa
    long double for these magnitudes, so one rounding to float32 is the FMA's."""
    mean, std = np.float32(mean), np.float32(std)
    inv = np.float32(1) / std
    offset = -(mean * inv) if offset is None else offset
    return (X.astype(np.longdouble) * np.longdouble(inv) + np.longdouble(offset)).astype(np.float32)


def dali_formula(mean, std) -> np.ndarray:
    """DALI's (float(x) - mean) * inv_stddev, each step rounded to float32 (float64 products of
    float32 values are exact, so each cast rounds once)."""
    mean, std = np.float32(mean), np.float32(std)
    inv = np.float32(1) / std
    difference = (X.astype(np.float64) - np.float64(mean)).astype(np.float32)
    return (difference.astype(np.float64) * np.float64(inv)).astype(np.float32)


# No mean in (0, 2**-20): its offset has bits below the long double's 64 (255 * inv + 6e-18 is
# one), so the formula rounds twice. The docstring tests below cover those means.
MEANS = st.sampled_from([0.0, 127.5, 125.3, 0.5 * 255]) | st.floats(2**-20, 255, width=32)
STDS = st.sampled_from([127.5, 255.0, 63.0, 1.0]) | st.floats(1, 255, width=32)
needs_long_double = pytest.mark.skipif(np.finfo(np.longdouble).nmant < 63, reason="needs an extended long double")


@needs_long_double
@given(st.lists(MEANS, min_size=3, max_size=3), st.lists(STDS, min_size=3, max_size=3))
def test_each_vendors_formula_equals_its_table_bit_for_bit(means, stds):
    rocal = normalize_table(means, stds, "rocal")
    dali = normalize_table(means, stds, "dali_cpu")
    assert rocal.shape == dali.shape == (3, 256) and rocal.dtype == dali.dtype == np.float32
    for c in range(3):
        np.testing.assert_array_equal(rocal[c], rocal_formula(means[c], stds[c]), err_msg=f"rocal, channel {c}")
        np.testing.assert_array_equal(dali[c], dali_formula(means[c], stds[c]), err_msg=f"dali, channel {c}")


@needs_long_double
def test_one_channel_rocal_offset_is_minus_mean_over_std():
    # For 127.5 / 63 the two offsets are different floats, so the tables tell them apart.
    m, s = np.float32(127.5), np.float32(63.0)
    assert -(m / s) != -(m * (np.float32(1) / s))
    rocal = normalize_table([127.5], [63.0], "rocal")
    np.testing.assert_array_equal(rocal[0], rocal_formula(m, s, offset=-(m / s)))
    assert (rocal != normalize_table([127.5], [63.0], "dali_gpu")).any()  # -(m * inv) for every C


def test_the_notebook_values_against_the_naive_arithmetic():
    # (x - mean) / std is not rocAL's arithmetic on 223 of the 256 values (the figure the
    # module states), and DALI's CPU (x - mean) * (1/std) differs from rocAL's on 254.
    rocal = normalize_table(*NOTEBOOK, "rocal")[0]
    naive = (X.astype(np.float32) - np.float32(127.5)) / np.float32(127.5)
    assert (rocal != naive).sum() == 223
    assert (rocal != normalize_table(*NOTEBOOK, "dali_cpu")[0]).sum() == 254
    # float32(1/127.5) is above 1/127.5, so rocAL maps 255 to one ulp above 1 (its offset
    # rounds to exactly -1); (255 - 127.5) / 127.5 is 1.
    assert rocal[0] == -1.0 and rocal[255] == np.nextafter(np.float32(1), np.float32(2))
    assert naive[255] == 1.0
    assert np.abs(rocal - naive).max() <= np.spacing(np.float32(1))  # 1 ulp, never more


# --------------------------------------------------------------------------
# The docstrings are the spec: each function implemented again from its text alone
# --------------------------------------------------------------------------


def docstring_crop_anchor(pos: float, size: int, crop: int, arithmetic: str) -> int:
    p = r32(Fraction(pos))
    d = Fraction(size - crop)
    if arithmetic == "rocal":
        return round(r32(p * d))  # a float32 product, then half to even
    return math.floor(p * d + Fraction(1, 2))  # DALI: the exact product, half away from zero


def docstring_crop_mirror_normalize(images, crop, crop_pos, mirror, mean, std, arithmetic):
    N, C, H, W = images.shape
    ch, cw = crop
    table = docstring_normalize_table(mean, std, arithmetic)
    y0 = docstring_crop_anchor(crop_pos[0], H, ch, arithmetic)
    x0 = docstring_crop_anchor(crop_pos[1], W, cw, arithmetic)
    out = np.empty((N, C, ch, cw), np.uint32)
    for n, c, y, x in itertools.product(range(N), range(C), range(ch), range(cw)):
        xs = cw - 1 - x if mirror[n] else x
        out[n, c, y, x] = table[c][int(images[n, c, y0 + y, x0 + xs])]
    return out


def assert_is_its_docstring(mean, std, arithmetic):
    got = normalize_table(mean, std, arithmetic)
    assert got.shape == (len(mean), 256) and got.dtype == np.float32
    assert_same_bits(got.view(np.uint32), np.array(docstring_normalize_table(mean, std, arithmetic), np.uint32),
                     f"normalize_table({mean}, {std}, {arithmetic!r}) against its docstring")


SPEC_MEANS = (st.sampled_from([0.0, -0.0, 127.5, 125.3, 113.9, 255.0, -3.25, 1e-40, 1e-45, -1e-45])
              | st.floats(-300, 300) | st.fractions(-300, 300, max_denominator=2**70)
              | st.integers(-2**70, 2**70))
SPEC_STDS = (st.sampled_from([127.5, 63.0, 66.7, 255.0, 1.0, -2.0, 3e-38])
             | st.floats(0.01, 300) | st.floats(-300, -0.01) | st.fractions(1, 300, max_denominator=2**70))
MEAN_STD = st.integers(1, 3).flatmap(lambda c: st.tuples(st.lists(SPEC_MEANS, min_size=c, max_size=c),
                                                         st.lists(SPEC_STDS, min_size=c, max_size=c)))


@given(MEAN_STD, st.sampled_from(ARITHMETICS))
@settings(max_examples=examples(40))
def test_normalize_table_is_its_docstring(mean_std, arithmetic):
    mean, std = mean_std
    try:
        normalize_table(mean, std, arithmetic)
    except ValueError as error:  # the docstring refuses only an overflow here
        assert "overflows" in str(error)
        with pytest.raises(AssertionError, match="overflow"):
            docstring_normalize_table(mean, std, arithmetic)
        return
    assert_is_its_docstring(mean, std, arithmetic)


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("mean, std", [((127.5,), (63.0,)), ((127.5, 127.5, 127.5), (63.0, 62.1, 66.7)),
                                       ((-0.0,), (-2.0,)), ((0.0, -0.0), (-1.0, -1.0)),
                                       ((125.3, 123.0, 113.9), (63.0, 62.1, 66.7)),
                                       ((0.0, 1.724157630505255e-41), (127.5, 127.5)),
                                       ((1e-45,), (255.0,)), ((-1e-45,), (255.0,)), ((1e-45,), (-127.5,)),
                                       ((1e-45,) * 3, (-127.5,) * 3)])
def test_normalize_table_on_the_cases_that_tell_readings_apart(mean, std, arithmetic):
    # 127.5 / 63.0: r32(-(m/s)) and r32(-(m*inv)) differ, so the one-channel rocAL offset is
    # pinned; -0.0 with a negative std pins the sign of an exact zero; a subnormal mean moves
    # x*inv off a float32 tie (rounded once: down; rounded twice: up).
    assert_is_its_docstring(mean, std, arithmetic)


def exact(value) -> Fraction:
    """The exact rational value of an int, a Fraction, a float or a NumPy scalar."""
    return Fraction(value) if isinstance(value, (int, Fraction, float)) else Fraction(*value.as_integer_ratio())


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("mean, std", NOT_DOUBLES)
def test_values_that_are_not_doubles_go_through_float_first(mean, std, arithmetic):
    # Normalize (which stores those doubles), its table and normalize_table agree with the
    # docstring, bit for bit.
    want = np.array(docstring_normalize_table(mean, std, arithmetic), np.uint32)
    assert_same_bits(normalize_table(mean, std, arithmetic).view(np.uint32), want, "normalize_table")
    norm = Normalize(mean=mean, std=std, arithmetic=arithmetic)
    assert norm.mean == tuple(float(m) for m in mean) and all(type(m) is float for m in norm.mean + norm.std)
    assert_same_bits(norm.table.view(np.uint32), want, "Normalize(...).table")
    # The control: rounded once from the exact value, these inputs give another table
    # (except a float32 scalar, which is a double exactly: both readings agree there).
    once = [[float(r32(exact(v))) for v in values] for values in (mean, std)]
    other = np.array(docstring_normalize_table(*once, arithmetic), np.uint32)
    if isinstance(mean[0], np.float32):
        assert_same_bits(other, want, "a float32 scalar, read either way")
    else:
        assert (other != want).any(), "these inputs do not tell the two readings apart"
    # The docstring's example: 1 + 2**-24 + 2**-60 gives m = 1.0, so 1 - m is 0.
    assert normalize_table([Fraction(1) + Fraction(1, 2**24) + Fraction(1, 2**60)], [1.0], "dali_cpu")[0, 1] == 0


@pytest.mark.parametrize("mean, std, arithmetic, zero", [
    ((1e-45,), (255.0,), "dali_cpu", 0x80000000),  # (0 - 2**-149) * (1/255): underflows, keeps its minus
    ((-1e-45,), (255.0,), "dali_cpu", 0x00000000),
    ((-0.0,), (-2.0,), "rocal", 0x80000000),  # off = -(-0.0 / -2.0) = -0.0; fma(0, -0.5, -0.0) = -0.0
    ((1e-45,), (-127.5,), "rocal", 0x00000000),  # m / s underflows to -0.0, so off = +0.0
    ((1e-45,) * 3, (-127.5,) * 3, "dali_gpu", 0x00000000),  # m * inv underflows to -0.0, off = +0.0
])
def test_the_sign_of_a_zero_is_ieee_754s(mean, std, arithmetic, zero):
    # Pixel 0 is the sign bit alone: a reading that signs a zero otherwise differs there.
    table = normalize_table(mean, std, arithmetic)
    assert table[0, 0] == 0 and int(table[0, :1].view(np.uint32)[0]) == zero
    assert docstring_normalize_table(mean, std, arithmetic)[0][0] == zero


@given(st.floats(0, 1), st.integers(1, 4096), st.data(), st.sampled_from(ARITHMETICS))
@settings(max_examples=examples(60))
def test_crop_anchor_is_its_docstring(pos, size, data, arithmetic):
    crop = data.draw(st.integers(1, size))
    assert crop_anchor(pos, size, crop, arithmetic) == docstring_crop_anchor(pos, size, crop, arithmetic)


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("pos, size, crop", [(0.7, 32, 27), (0.9, 32, 27), (1 / 6, 32, 29), (0.1, 32, 27)])
def test_crop_anchor_rounds_the_vendors_product(pos, size, crop, arithmetic):
    # The exact product and its float32 rounding fall on different sides of a rounding
    # boundary for at least one vendor here.
    assert crop_anchor(pos, size, crop, arithmetic) == docstring_crop_anchor(pos, size, crop, arithmetic)


def test_the_docstrings_anchor_example():
    # pos=0.7, d=5: the exact product is below 3.5 (DALI: 3), the float32 one is 3.5 (rocAL:
    # half to even, 4). Each vendor's anchor is not the other product's rounding.
    p = np.float32(0.7)
    assert float(p) * 5 < 3.5 and p * np.float32(5) == np.float32(3.5)
    assert crop_anchor(0.7, 32, 27, "dali_cpu") == crop_anchor(0.7, 32, 27, "dali_gpu") == 3
    assert crop_anchor(0.7, 32, 27, "rocal") == 4


@given(MEAN_STD, st.tuples(st.integers(1, 9), st.integers(1, 9)),
       st.tuples(st.floats(0, 1), st.floats(0, 1)), st.lists(st.booleans(), min_size=2, max_size=2),
       st.sampled_from(ARITHMETICS), SEEDS)
@settings(max_examples=examples(25))
def test_crop_mirror_normalize_is_its_docstring(mean_std, crop, crop_pos, mirror, arithmetic, seed):
    mean, std = mean_std
    images = np.random.default_rng(seed).integers(0, 256, (2, len(mean), 9, 9), dtype=np.uint8)
    try:
        got = crop_mirror_normalize(images, crop=crop, mirror=np.array(mirror), mean=mean, std=std,
                                    crop_pos=crop_pos, arithmetic=arithmetic)
    except ValueError as error:
        assert "overflows" in str(error)
        return
    want = docstring_crop_mirror_normalize(images, crop, crop_pos, mirror, mean, std, arithmetic)
    np.testing.assert_array_equal(got.view(np.uint32), want)


# --------------------------------------------------------------------------
# Normalize
# --------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [
    Normalize(),
    Normalize(mean=(1.0, 2.0, 3.0), std=(4.0, -5.0, 6.0), mirror=True, crop=(5, 7), crop_pos=(0.25, 0.75),
              arithmetic="dali_cpu"),
    Normalize(mean=(0.0,), std=(255.0,), crop=(12, 1), crop_pos=(1.0, 0.0), arithmetic="dali_gpu"),
], ids=["default", "every field", "one channel"])
def test_normalize_is_crop_mirror_normalize_with_its_fields(norm):
    # Into ``out`` when given; window is crop_window's, and output_shape is (C, ch, cw) of
    # that window, the shape __call__ returns.
    c = len(norm.mean)
    images = np.random.default_rng(c).integers(0, 256, (2, c, 12, 10), dtype=np.uint8)
    want = crop_mirror_normalize(images, crop=norm.crop, mirror=norm.mirror, mean=norm.mean, std=norm.std,
                                 crop_pos=norm.crop_pos, arithmetic=norm.arithmetic)
    assert_same_bits(norm(images), want, "Normalize()(images)")
    out = np.full(want.shape, np.nan, np.float32)
    assert norm(images, out=out) is out
    assert_same_bits(out, want, "Normalize()(images, out=)")
    window = crop_window((12, 10), norm.crop, norm.crop_pos, norm.arithmetic)
    assert norm.window((12, 10)) == window
    assert norm.output_shape((c, 12, 10)) == (c,) + tuple(window[2:]) == want.shape[1:]


def test_normalize_output_shape_refuses_what_does_not_fit_naming_why():
    norm = Normalize()
    assert_raises_naming(ValueError, lambda: norm.output_shape((12, 10)), "(N, C, H, W)", "(12, 10)")
    assert_raises_naming(ValueError, lambda: norm.output_shape((1, 3, 12, 10)), "(N, C, H, W)")
    assert_raises_naming(ValueError, lambda: norm.output_shape((12, 10, 3)), "mean and std need 12 entries",
                         "channels-last (NHWC, 3 channels)", "transpose(0, 3, 1, 2)")
    one = Normalize(mean=(127.5,), std=(127.5,))  # a one-channel mean on three-channel NHWC images: both hints
    assert_raises_naming(ValueError, lambda: one.output_shape((12, 10, 3)), "need 12 entries", "channels-last (NHWC, "
                         "3 channels)", "transpose(0, 3, 1, 2) and a mean and std of 3 entries")
    assert_raises_naming(ValueError, lambda: one.output_shape((28, 28, 1)), "channels-last (NHWC, 1 channel)")
    with pytest.raises(ValueError) as info:
        norm.output_shape((2, 12, 10))
    assert "need 2 entries" in str(info.value) and "NHWC" not in str(info.value)
    assert_raises_naming(ValueError, lambda: Normalize(crop=(13, 4)).output_shape((3, 12, 10)), "crop")


def test_normalize_values_are_equal_and_hash_alike_exactly_when_every_field_is_the_same():
    # Equal values built from other types (NumPy and JAX arrays and scalars, lists) are
    # stored as plain Python values and hash alike; a change of any one field, each float
    # entry included (0.0 and -0.0 too), makes another value.
    base = dict(mean=(1.0, 2.0, 0.0), std=(4.0, 5.0, 6.0), mirror=False, crop=(5, 7), crop_pos=(0.25, 0.75),
                arithmetic="rocal")
    a = Normalize(**base)
    same = Normalize(mean=jax.numpy.array([1.0, 2.0, 0.0]), std=np.array([4.0, 5.0, 6.0]), mirror=np.bool_(False),
                     crop=[np.int64(5), 7], crop_pos=(np.float32(0.25), 0.75), arithmetic="rocal")
    assert a == same and hash(a) == hash(same) and len({a, same}) == 1
    assert all(type(v) is float for v in same.mean + same.std + same.crop_pos) and same.mirror is False
    assert same.crop == (5, 7) and all(type(v) is int for v in same.crop)
    changes = [("mirror", True), ("crop", (5, 6)), ("crop", None), ("arithmetic", "dali_cpu")]
    for name in ("mean", "std", "crop_pos"):
        for i in range(len(base[name])):
            value = list(base[name])
            value[i] = -0.0 if value[i] == 0.0 else value[i] + (0.5 if name != "crop_pos" else -0.25)  # in [0, 1]
            changes.append((name, tuple(value)))
    for name, value in changes:
        other = Normalize(**{**base, name: value})
        assert other != a and a != other, (name, value)
    assert Normalize(mean=(0.0,), std=(1.0,)) != Normalize(mean=(-0.0,), std=(1.0,))
    assert Normalize(mean=(1.0,), std=(1.0,)) != Normalize(mean=(1.0, 1.0), std=(1.0, 1.0))


def test_a_bfloat16_mean_is_its_exact_value():
    # Accepted: bfloat16 (ml_dtypes', as JAX uses it) is a float dtype whose every value is a
    # double, so float() is exact and the table is that double's.
    b = ml_dtypes.bfloat16(0.1)  # 0.10009765625: bfloat16 keeps 8 significant bits
    assert float(b) == 0.10009765625
    want = normalize_table([0.10009765625] * 3, [127.5] * 3)
    for mean in ([b] * 3, [np.array(b)] * 3, np.full(3, b), [jax.numpy.array(0.1, jax.numpy.bfloat16)] * 3,
                 jax.numpy.full(3, 0.1, jax.numpy.bfloat16)):
        assert_same_bits(normalize_table(mean, [127.5] * 3), want, f"mean {mean!r}")
        assert Normalize(mean=mean).mean == (0.10009765625,) * 3
    # the control: the decimal 0.1 is another mean, with another table
    assert not np.array_equal(normalize_table([0.1] * 3, [127.5] * 3).view(np.uint32), want.view(np.uint32))
    # float8 and int4 (ml_dtypes too) are doubles as well
    assert Normalize(mean=[ml_dtypes.float8_e4m3fn(1.75), np.array(3, ml_dtypes.int4), 2], std=[1, 1, 1]).mean \
        == (1.75, 3.0, 2.0)


# --------------------------------------------------------------------------
# The shared table: its key, its read-only rows, the overflow edge on both sides
# --------------------------------------------------------------------------


def test_keyed_table_refuses_each_wrong_part_of_a_key_alone():
    # The key is a tuple of two byte strings of the same whole, non-zero number of float32
    # values, and an arithmetic; each wrong part alone is refused.
    good = table_key([0.5, 0.25], [2.0, 4.0], "rocal", "test")
    four, eight = good[0][:4], good[0]
    for key in [list(good), good[:2], good + ("x",), (good[0].decode("latin-1"), good[1], "rocal"),
                (good[0], good[1].decode("latin-1"), "rocal"), (four, eight, "rocal"), (eight, four, "rocal"),
                (b"", b"", "rocal"), (eight[:6], eight[:6], "rocal"), (1, 2, "rocal")]:
        with pytest.raises(ValueError, match="key must be what table_key returns"):
            keyed_table(key)
    with pytest.raises(ValueError, match="arithmetic must be one of"):
        keyed_table((good[0], good[1], "nvidia"))
    np.testing.assert_array_equal(keyed_table(good), normalize_table([0.5, 0.25], [2.0, 4.0], "rocal"))  # control


def test_the_shared_table_is_read_only_and_normalize_table_hands_out_a_writable_copy():
    key = table_key([0.1], [0.3], "dali_gpu", "test")
    shared = keyed_table(key)
    assert keyed_table(key) is shared and not shared.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        shared[0, 0] = 1.0
    copy = normalize_table([0.1], [0.3], "dali_gpu")
    assert copy.flags.writeable and copy is not shared
    before = shared.copy()
    copy[0, 0] = 7.0  # reaches no later table
    np.testing.assert_array_equal(normalize_table([0.1], [0.3], "dali_gpu"), before)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # quiet, as the refusals are
@pytest.mark.parametrize("arithmetic", ["rocal", "dali_gpu"])
def test_an_entry_at_float32_max_plus_half_an_ulp_overflows_and_one_an_ulp_below_rounds_to_max(arithmetic):
    # std = 2**-103 (inv = 2**103) and offset = 2**128 - 2**111 put entry 255 at
    # 2**128 - 2**103, max + half an ulp: a tie that rounds to infinity, so the table is
    # refused. With the offset one ulp lower the entry is max - half an ulp, a tie that
    # rounds to the even max - ulp.
    offset = 2.0**128 - 2.0**111
    inv = 2.0**103
    assert 255 * inv + offset == 2.0**128 - 2.0**103  # exact in a double: the edge itself
    mean = -offset / inv  # -(mean * inv) = offset, exactly (a power-of-two scale)
    with pytest.raises(ValueError, match="overflows float32"):
        normalize_table([mean, mean], [1 / inv, 1 / inv], arithmetic)
    lower = float(np.nextafter(np.float32(offset), np.float32(0)))  # 2**128 - 2**111 - 2**104
    table = normalize_table([-lower / inv] * 2, [1 / inv] * 2, arithmetic)
    assert table[0, 255] == table[0, 254] == np.float32(F32_MAX - 2.0**104)  # the tie's even side; exact
    assert np.isfinite(table).all()


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_a_table_of_entries_just_under_max_plus_half_an_ulp_is_all_max(arithmetic):
    # offset = max and inv = 2**95: entry v is max + v * 2**95, below max + half an ulp
    # (2**103) for every v <= 255, so each rounds to max.
    inv = 2.0**95
    table = normalize_table([-F32_MAX / inv] * 3, [1 / inv] * 3, arithmetic)
    assert (table == np.float32(F32_MAX)).all()


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_an_entry_that_a_double_rounds_onto_the_overflow_edge_is_rounded_once():
    # An exact entry of max + 2**103 - 2**73, which a double rounds to max + 2**103 (and
    # float32 from there to infinity), rounds once to max; the next entry overflows, so the
    # table is refused with a ValueError. v = 93 with inv = 11,545,611 * 2**73
    # (93 x 11,545,611 = 2**30 - 1) and offset = max.
    inv = 11_545_611 * 2.0**73
    assert np.float32(inv) == inv and 93 * 11_545_611 == 2**30 - 1
    assert float(Fraction(F32_MAX) + 93 * Fraction(inv)) == F32_MAX + 2.0**103  # the double lands on the edge
    std = float(np.float32(1 / inv))
    for _ in range(4):  # the float32 std whose float32 inverse is inv
        if np.float32(1) / np.float32(std) == np.float32(inv):
            break
        std = float(np.nextafter(np.float32(std), np.float32(np.inf if np.float32(1) / np.float32(std) > inv
                                                            else 0)))
    assert np.float32(1) / np.float32(std) == np.float32(inv)
    mean = -F32_MAX / inv
    for _ in range(8):  # the float32 mean with -(mean * inv) == max in float32
        got = -(np.float32(mean) * np.float32(inv))
        if got == np.float32(F32_MAX):
            break
        mean = float(np.nextafter(np.float32(mean), np.float32(0 if got > F32_MAX else -np.inf)))
    assert -(np.float32(mean) * np.float32(inv)) == np.float32(F32_MAX)
    with pytest.raises(ValueError, match="overflows float32"):
        normalize_table([mean] * 3, [std] * 3, "dali_gpu")


@pytest.mark.parametrize("mean, std, words", [
    ([1e39, 0.0, 0.0], [1.0, 1.0, 1.0], "must be finite"),
    ([3e38, 0.0, 0.0], [1e-30, 1.0, 1.0], "overflows float32"),
    ([0.0, 0.0, 0.0], [1e-37, 1.0, 1.0], "overflows float32"),
])
@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_a_refusal_is_a_value_error_and_no_floating_point_warning(mean, std, words, arithmetic):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=words):
            normalize_table(mean, std, arithmetic)
        normalize_table([0.5, 0.5, 0.5], [0.25, 0.25, 0.25], arithmetic)  # the control: no warning


def test_one_row_compares_rows_bit_for_bit_and_refuses_each_wrong_table_alone():
    # True iff every row is row 0 bit for bit: -0.0 is not 0.0, and a NaN row equals itself.
    row = np.linspace(-1, 1, 256, dtype=np.float32)
    assert one_row(row[None]) and one_row(np.stack([row] * 3))
    for at in (6, 7):  # a NaN whose bits are a NaN at any width the rows could be read at
        nan = row.copy()
        nan.view(np.uint32)[at] = 0x7FF80000
        assert one_row(np.stack([nan, nan])), at
    for k, at in itertools.product(range(3), (200, 201)):  # -0.0 in either half of an 8-byte pair
        zeros = np.zeros((3, 256), np.float32)
        zeros[k, at] = -0.0
        assert not one_row(zeros), (k, at)
        other = np.stack([row] * 3)
        other[k, 255] = np.nextafter(other[k, 255], np.float32(0))
        assert not one_row(other), k
    for bad in [np.zeros((0, 256), np.float32), np.zeros((2, 255), np.float32), np.zeros(256, np.float32),
                np.zeros((2, 256), np.float64), np.zeros((1, 2, 256), np.float32), [[0.0] * 256]]:
        with pytest.raises(ValueError, match=r"table must be a float32 \(C, 256\) array"):
            one_row(bad)


# --------------------------------------------------------------------------
# Bad input is refused at the call, naming the function, the parameter and the value
# --------------------------------------------------------------------------


IMAGES = np.zeros((2, 3, 8, 8), np.uint8)
IMAGE = coordinate_image()

# (the function as its messages name it, the call with one int parameter v, that parameter, a valid v)
INT_PARAMETERS = [
    ("crop_anchor", lambda v: crop_anchor(0.5, v, 2), "size", 8),
    ("crop_anchor", lambda v: crop_anchor(0.5, 8, v), "crop", 2),
    ("crop_window", lambda v: crop_window((v, 8), None, (0.5, 0.5)), "image_hw", 8),
    ("crop_window", lambda v: crop_window((8, 8), (2, v), (0.5, 0.5)), "crop", 2),
    ("crop_mirror_normalize", lambda v: crop_mirror_normalize(IMAGES, crop=(v, 2)), "crop", 2),
    ("Normalize", lambda v: Normalize(crop=(2, v)), "crop", 2),
    ("Normalize", lambda v: Normalize().window((8, v)), "image_hw", 8),
    ("Normalize", lambda v: Normalize().output_shape((v, 8, 8)), "image_chw", 3),
    ("aligned_empty", lambda v: aligned_empty((v, 3), np.float32), "shape", 2),
    ("aligned_empty", lambda v: aligned_empty((2, 3), np.float32, align=v), "align", 64),
]


@pytest.mark.parametrize("where, call, name, valid", INT_PARAMETERS, ids=[f"{w}-{n}" for w, _, n, _ in INT_PARAMETERS])
@given(data=st.data())
@settings(max_examples=examples(8))
def test_every_int_parameter_refuses_what_is_not_an_int(where, call, name, valid, data):
    call(valid)  # the control: the call is valid with an int, Python's or NumPy's
    call(np.int64(valid))
    assert_refuses_naming_value(call, where, name, data.draw(not_ints(valid), label=name))


@pytest.mark.parametrize("call, fragments", [
    # normalize_table's mean and std
    (lambda: normalize_table((float("nan"),), (1.0,)), ["normalize_table", "finite"]),
    (lambda: normalize_table((0.0,), (float("inf"),)), ["normalize_table", "finite"]),
    (lambda: normalize_table((1e39,), (1.0,)), ["normalize_table", "finite"]),
    (lambda: normalize_table((0.0,), (1e-40,)), ["normalize_table", "subnormal"]),
    (lambda: normalize_table((0.0,), (0.0,)), ["normalize_table", "zero"]),
    (lambda: normalize_table((1e30,), (1e-30,)), ["normalize_table", "overflows"]),
    (lambda: normalize_table((0.0, 1.0), (1.0,)), ["normalize_table", "one entry per channel"]),
    (lambda: normalize_table((0.0,), ("1",)), ["normalize_table: std", "'1' of type str"]),
    (lambda: normalize_table((Decimal("1.5"),), (1.0,)), ["normalize_table: mean", "of type Decimal, not a real"]),
    (lambda: normalize_table((0.0,), (1j,)), ["normalize_table: std", "1j", "not a real number"]),
    (lambda: normalize_table((np.str_("1"),), (1.0,)), ["normalize_table: mean", "not a real number"]),
    (lambda: normalize_table((10**400,), (1.0,)), ["normalize_table: mean", "beyond a double's range"]),
    (lambda: normalize_table((Fraction(10**400, 3),), (1.0,)), ["normalize_table: mean", "beyond a double"]),
    (lambda: normalize_table([True], [1.0]), ["normalize_table: mean", "True"]),
    (lambda: normalize_table([1.0], [np.True_]), ["normalize_table: std", "True"]),
    # ... a sequence, ordered, of one number a channel: not a set, a generator, a nesting, a scalar, a string
    *[(lambda mean=mean: normalize_table(mean, [1.0, 1.0]), ["normalize_table: mean must be a sequence"])
      for mean in ({1.0, 2.0}, (m for m in [1.0, 2.0]), [[1.0], [2.0]], np.ones((2, 1)), [[0.0, 1.0], [0.0]],
                   127.5, "127.5", np.zeros((1, 3)))],
    # crop_anchor
    (lambda: crop_anchor(-0.1, 32, 8), ["crop_anchor: pos", "-0.1"]),
    (lambda: crop_anchor(1.5, 32, 8), ["crop_anchor: pos", "1.5"]),
    (lambda: crop_anchor(float("nan"), 32, 8), ["crop_anchor: pos", "nan"]),
    (lambda: crop_anchor(0.5, 32, 33), ["crop_anchor: crop=33", "size=32"]),
    (lambda: crop_anchor(0.5, 32, 0), ["crop_anchor: crop", "0"]),
    (lambda: crop_anchor(0.5, True, True), ["crop_anchor: size must be an int, got True"]),
    (lambda: crop_anchor(True, 8, 2), ["crop_anchor: pos", "True"]),
    (lambda: crop_anchor(np.array([0.5]), 10, 4), ["crop_anchor: pos="]),  # a 0-d array is a number; this is not
    (lambda: crop_anchor(np.array([[0.5]]), 10, 4), ["crop_anchor: pos="]),
    (lambda: crop_anchor(np.array([0.5], ml_dtypes.bfloat16), 10, 4), ["crop_anchor: pos="]),
    # crop_mirror_normalize and crop_window
    (lambda: crop_mirror_normalize(np.zeros((3, 32, 32), np.uint8)), ["uint8 NCHW", "(3, 32, 32)"]),
    (lambda: crop_mirror_normalize(np.zeros((1, 3, 32, 32), np.int16)), ["uint8 NCHW", "int16"]),
    (lambda: crop_mirror_normalize(IMAGE, out=np.zeros((1, 3, 32, 32))), ["out must be float32", "float64"]),
    (lambda: crop_mirror_normalize(IMAGE, out=np.zeros((1, 3, 32, 31), np.float32)), ["(1, 3, 32, 31)"]),
    (lambda: crop_mirror_normalize(IMAGE, mean=(0.0, 0.0)), ["mean=[0.0, 0.0]"]),
    (lambda: crop_mirror_normalize(IMAGE, std=(1.0,) * 4), ["std=[1.0, 1.0, 1.0, 1.0]"]),
    (lambda: crop_mirror_normalize(IMAGE, mean=(0.0,), std=(1.0,)), ["3 entries"]),  # no broadcasting
    (lambda: crop_mirror_normalize(IMAGE, std=(1.0, 0.0, 1.0)), ["zero", "std=[1.0, 0.0, 1.0]"]),
    (lambda: crop_mirror_normalize(IMAGE, crop=(33, 32)), ["crop_mirror_normalize: crop=(33, 32)"]),
    (lambda: crop_mirror_normalize(IMAGE, crop=(32, 40)), ["crop=(32, 40)"]),
    (lambda: crop_mirror_normalize(IMAGE, crop=(28, 28), crop_pos=(1.5, 0.5)), ["crop_pos=(1.5, 0.5)"]),
    (lambda: crop_mirror_normalize(IMAGE, crop=(28, 28), crop_pos=(0.5, -0.1)), ["crop_pos=(0.5, -0.1)"]),
    (lambda: crop_mirror_normalize(IMAGES, mirror=[1, 0]), ["crop_mirror_normalize: mirror", "[1, 0]"]),
    (lambda: crop_mirror_normalize(IMAGES, mirror="yes"), ["crop_mirror_normalize: mirror", "'yes'"]),
    (lambda: crop_window((32, 32, 3), None, (0.5, 0.5)), ["crop_window: image_hw", "(32, 32, 3)"]),
    (lambda: crop_window((32,), None, (0.5, 0.5)), ["crop_window: image_hw", "(32,)"]),
    (lambda: crop_window((32, 32), (8, 8, 8), (0.5, 0.5)), ["crop_window: crop", "(8, 8, 8)"]),
    (lambda: crop_window((32, 32), (8,), (0.5, 0.5)), ["crop_window: crop", "(8,)"]),
    # Normalize, at construction
    (lambda: Normalize(arithmetic="cuda"), ["arithmetic must be one of", "'cuda'"]),
    (lambda: Normalize(mean=127.5), ["Normalize: mean must be a sequence", "127.5"]),
    (lambda: Normalize(crop=(28.0, 28)), ["Normalize: crop", "two ints", "(28.0, 28)"]),
    (lambda: Normalize(crop=(28,)), ["Normalize: crop", "two ints", "(28,)"]),
    (lambda: Normalize(crop=(0, 2)), ["Normalize: crop", "(0, 2)"]),
    (lambda: Normalize(crop_pos=(0.5,)), ["Normalize: crop_pos must be two numbers", "(0.5,)"]),
    (lambda: Normalize(crop_pos=(1.5, 0.5)), ["Normalize: crop_pos", "(1.5, 0.5)", "[0, 1]"]),
    (lambda: Normalize(crop_pos=(0.5, float("nan"))), ["Normalize: crop_pos", "nan"]),
    (lambda: Normalize(mirror="yes"), ["Normalize: mirror must be a bool", "'yes'"]),
    (lambda: Normalize(mirror=1), ["Normalize: mirror must be a bool, got 1"]),
    (lambda: Normalize(mirror=1.0), ["Normalize: mirror must be a bool, got 1.0"]),
    (lambda: one_row(np.zeros((3, 256))), ["one_row: table must be a float32 (C, 256) array"]),
])
def test_bad_input_is_refused_naming_the_parameter_and_the_value(call, fragments):
    assert_raises_naming(ValueError, call, *fragments)


def test_crop_anchor_takes_a_zero_d_number():
    # pos is one real number: a NumPy or ml_dtypes scalar, a 0-d array or a Fraction is one.
    want = crop_anchor(0.5, 10, 4)
    for pos in (np.float32(0.5), np.array(0.5), np.array(0.5, ml_dtypes.bfloat16), Fraction(1, 2)):
        assert crop_anchor(pos, 10, 4) == want, repr(pos)
