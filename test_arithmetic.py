"""Property tests for arithmetic.py, the vendors' arithmetic as exact float32 tables:
each guarantee its docstrings state, checked.

* normalize_table: each vendor's formula, evaluated here independently of
  arithmetic.py's exact rationals (rocAL's fmaf in an extended long double,
  DALI's CPU subtract then multiply), equals its table bit for bit; the
  notebook's values against the naive (x - mean) / std, counted; the
  one-channel rocAL offset is -(mean / std). Negative controls: the naive
  division and a half-away anchor are caught as not rocAL's.
* crop_mirror_normalize matches a float64 reference written here; its anchor
  rounds as each vendor does (crop_anchor: rocAL half to even on a float32
  product, DALI half away on the exact one); the mirror flips inside the crop
  window; bad arguments are refused naming the value; a one-entry mean does
  not broadcast.
* Normalize refuses an unknown arithmetic and what it cannot hold, stores
  NumPy and JAX scalars as floats, and is equal and hashes alike exactly when
  its values are.

The three spec functions (normalize_table, crop_anchor, crop_mirror_normalize)
are also implemented a second time from their docstrings alone (``text_*``:
Python integers, fractions.Fraction and loops, every float32 operation on signed
exact values rounded once; the float32 helpers and text_normalize_table are
conftest's, since test_loaders.py holds every placement to the same bits) and
compared bit for bit over drawn inputs, with the cases that tell one reading of
the text from another pinned: the one-channel rocAL offset, the sign of a zero
(exact or from underflow), values that are not doubles going through float()
first, and what the text refuses.
"""

import itertools
import math
from decimal import Decimal
from fractions import Fraction

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from arithmetic import (ARITHMETICS, Normalize, aligned_empty, crop_anchor, crop_mirror_normalize, crop_window,
                        normalize_table, one_row)
from conftest import (NOT_DOUBLES, SEEDS, assert_raises_naming, assert_refuses_naming_value, assert_same_bits,
                      crop_cases, examples, not_ints, text_normalize_table, text_r32)


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
    got = crop_mirror_normalize(images, crop=crop, crop_pos=crop_pos,
                                        mirror=np.array(mirror), mean=mean, std=std)
    want = reference_crop_mirror_normalize(images, crop, crop_pos, mirror, mean, std)
    assert got.dtype == np.float32 and got.shape == want.shape
    # float32 rounding of mean, std, the difference and the quotient: a few ulps
    # of the largest intermediate, (255 + |mean|) / |std|.
    scale = (255 + np.abs(mean)) / np.abs(std)
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-7 * scale.max())


def coordinate_image() -> np.ndarray:
    """Channel 0 holds the row number, channel 1 the column number."""
    image = np.zeros((1, 3, 32, 32), np.uint8)
    image[0, 0] = np.arange(32)[:, None]
    image[0, 1] = np.arange(32)[None, :]
    return image


@pytest.mark.parametrize("size, anchor", [(29, 2), (31, 0), (30, 1), (27, 2), (25, 4), (32, 0)])
def test_anchor_rounds_half_to_even(size, anchor):
    # pos 0.5 * (32 - size): 1.5 -> 2, 0.5 -> 0, 1 -> 1, 2.5 -> 2, 3.5 -> 4.
    out = crop_mirror_normalize(coordinate_image(), crop=(size, size), crop_pos=(0.5, 0.5))
    assert out[0, 0, 0, 0] == anchor and out[0, 1, 0, 0] == anchor


def test_mirror_flips_inside_the_crop_window():
    images = np.concatenate([coordinate_image()] * 2)
    out = crop_mirror_normalize(images, crop=(4, 8), crop_pos=(0.0, 0.0),
                                        mirror=np.array([True, False]))
    np.testing.assert_array_equal(out[0, 1, 0], [7, 6, 5, 4, 3, 2, 1, 0])
    np.testing.assert_array_equal(out[1, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7])


@pytest.mark.parametrize("mirror", [True, np.True_, False, np.False_])
def test_one_bool_mirrors_every_image_or_none(mirror):
    images = np.random.default_rng(4).integers(0, 256, (3, 3, 6, 7), dtype=np.uint8)
    got = crop_mirror_normalize(images, crop=(4, 5), crop_pos=(0.25, 0.75), mirror=mirror)
    each = crop_mirror_normalize(images, crop=(4, 5), crop_pos=(0.25, 0.75), mirror=[bool(mirror)] * 3)
    assert_same_bits(got, each)
    plain = crop_mirror_normalize(images, crop=(4, 5), crop_pos=(0.25, 0.75))
    assert_same_bits(got, plain[..., ::-1] if mirror else plain)


@pytest.mark.parametrize("images, out, fragments", [
    (np.zeros((3, 32, 32), np.uint8), None, ["uint8 NCHW", "(3, 32, 32)"]),        # 3-d, uint8
    (np.zeros((1, 3, 32, 32), np.int16), None, ["uint8 NCHW", "int16"]),           # 4-d, not uint8
    (np.zeros((1, 3, 32, 32), np.uint8), np.zeros((1, 3, 32, 32), np.float64), ["float64"]),
    (np.zeros((1, 3, 32, 32), np.uint8), np.zeros((1, 3, 32, 31), np.float32), ["(1, 3, 32, 31)"]),
], ids=["3-d", "int16", "out float64", "out shape"])
def test_crop_mirror_normalize_refuses_each_wrong_part_alone(images, out, fragments):
    assert_raises_naming(ValueError, lambda: crop_mirror_normalize(images, out=out), *fragments)


@pytest.mark.parametrize("image_hw, crop, fragment", [
    ((32, 32, 3), None, "image_hw"), ((32,), None, "image_hw"),
    ((32, 32), (8, 8, 8), "crop"), ((32, 32), (8,), "crop")])
def test_a_window_takes_exactly_two_ints_for_the_image_and_the_crop(image_hw, crop, fragment):
    assert_raises_naming(ValueError, lambda: crop_window(image_hw, crop, (0.5, 0.5)), fragment)


@pytest.mark.parametrize("align", [1, 2, 48, 64, 4096])
def test_aligned_empty_starts_on_its_boundary_for_any_shape(align):
    for shape, want in ((5, (5,)), ((0,), (0,)), ((3, 0), (3, 0)), ((2, 3, 4), (2, 3, 4)), ((), ())):
        for _ in range(8):  # several allocations: different addresses
            x = aligned_empty(shape, np.float32, align)
            assert x.shape == want and x.dtype == np.float32, (shape, align)
            assert x.size == 0 or x.ctypes.data % align == 0, (shape, align)  # no element: no data
            assert x.flags.c_contiguous and x.flags.writeable


@pytest.mark.parametrize("kwargs, fragments", [
    (dict(mean=(0.0, 0.0)), ["mean=[0.0, 0.0]"]),
    (dict(std=(1.0, 1.0, 1.0, 1.0)), ["std=[1.0, 1.0, 1.0, 1.0]"]),
    (dict(std=(1.0, 0.0, 1.0)), ["zero", "std=[1.0, 0.0, 1.0]"]),
    (dict(crop=(33, 32)), ["crop=(33, 32)"]),
    (dict(crop=(32, 40)), ["crop=(32, 40)"]),
    (dict(crop=(28, 28), crop_pos=(1.5, 0.5)), ["crop_pos=(1.5, 0.5)"]),
    (dict(crop=(28, 28), crop_pos=(0.5, -0.1)), ["crop_pos=(0.5, -0.1)"]),
])
def test_crop_mirror_normalize_errors(kwargs, fragments):
    call = lambda: crop_mirror_normalize(coordinate_image(), **kwargs)
    assert_raises_naming(ValueError, call, *fragments)


# --------------------------------------------------------------------------
# The vendors' arithmetic as a table
# --------------------------------------------------------------------------

NOTEBOOK = ((127.5,) * 3, (127.5,) * 3)
X = np.arange(256)


def rocal_formula(mean, std) -> np.ndarray:
    """rocAL's per-pixel fmaf(x, inv, offset), evaluated independently of loaders'
    exact rationals: x * inv and the sum are exact in 64-bit-mantissa long double
    for these magnitudes, so one rounding to float32 is the FMA's."""
    mean, std = np.float32(mean), np.float32(std)
    inv = np.float32(1) / std
    offset = -(mean * inv)
    exact = X.astype(np.longdouble) * np.longdouble(inv) + np.longdouble(offset)
    return exact.astype(np.float32)


def dali_formula(mean, std) -> np.ndarray:
    """DALI's (float(x) - mean) * inv_stddev, each step rounded to float32 (float64
    products of float32 values are exact, so each cast rounds once)."""
    mean, std = np.float32(mean), np.float32(std)
    inv = np.float32(1) / std  # IEEE float32 division: 1/std rounded once
    difference = (X.astype(np.float64) - np.float64(mean)).astype(np.float32)
    return (difference.astype(np.float64) * np.float64(inv)).astype(np.float32)


# No subnormal means: rocal_formula's long double then rounds twice (x*inv + 1e-43 loses the
# offset and lands on a float32 tie; found by the thorough profile with mean 1.7e-41). The
# exact text test (test_normalize_table_is_its_docstring) covers them.
MEANS = (st.sampled_from([0.0, 127.5, 125.3, 0.5 * 255])
         | st.floats(0, 255, width=32, allow_subnormal=False))
STDS = st.sampled_from([127.5, 255.0, 63.0, 1.0]) | st.floats(1, 255, width=32)


@pytest.mark.skipif(np.finfo(np.longdouble).nmant < 63, reason="needs an extended long double")
@given(st.lists(MEANS, min_size=3, max_size=3), st.lists(STDS, min_size=3, max_size=3))
def test_each_vendors_formula_equals_its_table_bit_for_bit(means, stds):
    rocal = normalize_table(means, stds, "rocal")
    dali = normalize_table(means, stds, "dali_cpu")
    assert rocal.shape == dali.shape == (3, 256) and rocal.dtype == dali.dtype == np.float32
    for c in range(3):
        np.testing.assert_array_equal(rocal[c], rocal_formula(means[c], stds[c]), err_msg=f"rocal, channel {c}")
        np.testing.assert_array_equal(dali[c], dali_formula(means[c], stds[c]), err_msg=f"dali, channel {c}")


def test_one_channel_rocal_offset_is_minus_mean_over_std():
    # With one channel rocAL's node computes offset = -(mean / std), not -(mean * (1/std)).
    mean, std = np.float32(125.3), np.float32(66.7)
    table = normalize_table([125.3], [66.7], "rocal")[0]
    inv, offset = np.float32(1) / std, -(mean / std)
    exact = X.astype(np.longdouble) * np.longdouble(inv) + np.longdouble(offset)
    np.testing.assert_array_equal(table, exact.astype(np.float32))


def test_the_notebook_values_against_the_naive_arithmetic():
    # Counted independently from the vendors' source (the issue that specified the
    # tables): (x - mean) / std is not rocAL's arithmetic on 223 of the 256 values,
    # and DALI's (x - mean) * (1/std) differs from rocAL's on 254.
    rocal = normalize_table(*NOTEBOOK, "rocal")[0]
    naive = (X.astype(np.float32) - np.float32(127.5)) / np.float32(127.5)
    assert (rocal != naive).sum() == 223
    assert (rocal != normalize_table(*NOTEBOOK, "dali_cpu")[0]).sum() == 254
    # float32(1/127.5) is above 1/127.5, so rocAL maps 255 to 1.0000001, one ulp above
    # 1 (offset -(127.5 * inv) rounds to exactly -1); (255 - 127.5) / 127.5 is 1.
    assert rocal[0] == -1.0 and rocal[255] == np.nextafter(np.float32(1), np.float32(2))
    assert naive[255] == 1.0
    assert np.abs(rocal - naive).max() <= np.spacing(np.float32(1))  # 1 ulp, never more


def test_naive_division_is_caught_as_not_rocals_arithmetic():
    # Negative control for the equality check above: a loader that divided would fail it.
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(
            (X.astype(np.float32) - np.float32(127.5)) / np.float32(127.5), rocal_formula(127.5, 127.5))


@pytest.mark.parametrize("size, rocal, dali", [(29, 2, 2), (31, 0, 1), (27, 2, 3), (25, 4, 4), (30, 1, 1)])
def test_crop_anchor_rounding_of_each_vendor(size, rocal, dali):
    # 0.5 * (32 - size): 1.5, 0.5, 2.5, 3.5, 1.0. rocAL rounds half to even, DALI half away.
    assert crop_anchor(0.5, 32, size, "rocal") == rocal
    assert crop_anchor(0.5, 32, size, "dali_cpu") == dali


def test_half_away_anchor_is_caught_as_not_rocals():
    # Negative control: the .5 cases where the vendors differ are visible in the pixels.
    image = coordinate_image()
    rocal = crop_mirror_normalize(image, crop=(31, 27), crop_pos=(0.5, 0.5), arithmetic="rocal")
    dali = crop_mirror_normalize(image, crop=(31, 27), crop_pos=(0.5, 0.5), arithmetic="dali_cpu")
    assert (rocal[0, 0, 0, 0], rocal[0, 1, 0, 0]) == (0, 2)  # rows from 0, columns from 2
    assert (dali[0, 0, 0, 0], dali[0, 1, 0, 0]) == (1, 3)


def test_normalize_rejects_an_unknown_arithmetic():
    assert_raises_naming(ValueError, lambda: Normalize(arithmetic="cuda"), "'cuda'")


# --------------------------------------------------------------------------
# The docstrings are the spec: each of the three functions implemented again
# from its docstring's text alone, in the plainest way (Python integers,
# fractions.Fraction, loops; conftest's exact float32 helpers), and compared bit
# for bit over drawn inputs.
# --------------------------------------------------------------------------


def text_crop_anchor(pos: float, size: int, crop: int, arithmetic: str) -> int:
    p = text_r32(Fraction(pos))
    d = Fraction(size - crop)
    if arithmetic == "rocal":
        return round(text_r32(p * d))  # a float32 product, then half to even
    return math.floor(p * d + Fraction(1, 2))  # DALI: the exact product, half away from zero


def text_crop_mirror_normalize(images, crop, crop_pos, mirror, mean, std, arithmetic):
    N, C, H, W = images.shape
    ch, cw = crop
    table = text_normalize_table(mean, std, arithmetic)
    y0 = text_crop_anchor(crop_pos[0], H, ch, arithmetic)
    x0 = text_crop_anchor(crop_pos[1], W, cw, arithmetic)
    out = np.empty((N, C, ch, cw), np.uint32)
    for n in range(N):
        for c in range(C):
            for y in range(ch):
                for x in range(cw):
                    xs = cw - 1 - x if mirror[n] else x
                    out[n, c, y, x] = table[c][int(images[n, c, y0 + y, x0 + xs])]
    return out


SPEC_MEANS = (st.sampled_from([0.0, -0.0, 127.5, 125.3, 113.9, 255.0, -3.25, 1e-40, 1e-45, -1e-45])
              | st.floats(-300, 300) | st.fractions(-300, 300, max_denominator=2**70)
              | st.integers(-2**70, 2**70))
SPEC_STDS = (st.sampled_from([127.5, 63.0, 66.7, 255.0, 1.0, -2.0, 3e-38])
             | st.floats(0.01, 300) | st.floats(-300, -0.01) | st.fractions(1, 300, max_denominator=2**70))


@given(st.integers(1, 3).flatmap(lambda c: st.tuples(st.lists(SPEC_MEANS, min_size=c, max_size=c),
                                                     st.lists(SPEC_STDS, min_size=c, max_size=c))),
       st.sampled_from(ARITHMETICS))
@settings(max_examples=examples(40))
def test_normalize_table_is_its_docstring(mean_std, arithmetic):
    mean, std = mean_std
    try:
        got = normalize_table(mean, std, arithmetic)
    except ValueError as error:  # the text refuses only an overflow here
        assert "overflows" in str(error)
        with pytest.raises(AssertionError, match="overflow"):
            text_normalize_table(mean, std, arithmetic)
        return
    assert got.shape == (len(mean), 256) and got.dtype == np.float32
    assert_same_bits(got.view(np.uint32), np.array(text_normalize_table(mean, std, arithmetic), np.uint32),
                     f"normalize_table({mean}, {std}, {arithmetic!r}) against its text")


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("mean, std", [((127.5,), (63.0,)), ((127.5, 127.5, 127.5), (63.0, 62.1, 66.7)),
                                       ((-0.0,), (-2.0,)), ((0.0, -0.0), (-1.0, -1.0)),
                                       ((125.3, 123.0, 113.9), (63.0, 62.1, 66.7)),
                                       ((0.0, 1.724157630505255e-41), (127.5, 127.5)),
                                       ((1e-45,), (255.0,)), ((-1e-45,), (255.0,)), ((1e-45,), (-127.5,)),
                                       ((1e-45,) * 3, (-127.5,) * 3)])
def test_normalize_table_text_on_the_cases_that_tell_choices_apart(mean, std, arithmetic):
    # 127.5 / 63.0: r32(-(m/s)) and r32(-(m*inv)) differ, so the one-channel rocAL
    # offset is pinned; -0.0 with a negative std pins the sign of an exact zero; a subnormal
    # mean moves x*inv off a float32 tie (rounded once: down; a double rounding: up).
    got = normalize_table(mean, std, arithmetic)
    assert_same_bits(got.view(np.uint32), np.array(text_normalize_table(mean, std, arithmetic), np.uint32),
                     f"normalize_table({mean}, {std}, {arithmetic!r}) against its text")


def test_the_one_channel_offsets_differ_for_127_5_over_63():
    # Negative control for the case above: the two offsets really are different floats.
    m, s = np.float32(127.5), np.float32(63.0)
    assert -(m / s) != -(m * (np.float32(1) / s))
    rocal = normalize_table([127.5], [63.0], "rocal")
    gpu = normalize_table([127.5], [63.0], "dali_gpu")  # -(m*inv) for every C
    assert (rocal != gpu).any()


@pytest.mark.parametrize("mean, std, fragment", [
    ((float("nan"),), (1.0,), "finite"), ((0.0,), (float("inf"),), "finite"),
    ((1e39,), (1.0,), "finite"), ((0.0,), (1e-40,), "subnormal"), ((0.0,), (0.0,), "zero"),
    ((1e30,), (1e-30,), "overflows"), ((0.0, 1.0), (1.0,), "one entry per channel"),
    (127.5, (1.0,), "mean must be a sequence"), ("127.5", (1.0,), "mean must be a sequence"),
    (np.zeros((1, 3)), np.ones(3), "mean must be a sequence"), ((0.0,), ("1",), "'1' of type str"),
    ((Decimal("1.5"),), (1.0,), "of type Decimal, not a real number"), ((0.0,), (1j,), "not a real number"),
    ((10**400,), (1.0,), "beyond a double's range"), ((Fraction(10**400, 3),), (1.0,), "beyond a double"),
    ([[0.0, 1.0], [0.0]], (1.0,), "mean must be a sequence"), ((np.str_("1"),), (1.0,), "not a real number"),
])
def test_normalize_table_refuses_what_its_text_refuses(mean, std, fragment):
    with pytest.raises(ValueError, match=fragment):
        normalize_table(mean, std, "rocal")


def exact(value) -> Fraction:
    """The exact rational value of an int, a Fraction, a float or a NumPy scalar."""
    return Fraction(value) if isinstance(value, (int, Fraction, float)) else Fraction(*value.as_integer_ratio())


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("mean, std", NOT_DOUBLES)
def test_values_that_are_not_doubles_go_through_float_first(mean, std, arithmetic):
    # The text: float() of each entry, then float32. Normalize (which stores those
    # doubles), its table and normalize_table agree with the text, bit for bit.
    want = np.array(text_normalize_table(mean, std, arithmetic), np.uint32)
    got = normalize_table(mean, std, arithmetic)
    assert_same_bits(got.view(np.uint32), want, f"normalize_table({mean}, {std}, {arithmetic!r})")
    norm = Normalize(mean=mean, std=std, arithmetic=arithmetic)
    assert norm.mean == tuple(float(m) for m in mean) and all(type(m) is float for m in norm.mean + norm.std)
    assert_same_bits(norm.table.view(np.uint32), want, "Normalize(...).table")
    # Negative control: rounded once from the exact value, these inputs give another table
    # (except a float32 scalar, which is a double exactly: both readings agree there).
    once = [[float(text_r32(exact(v))) for v in values] for values in (mean, std)]
    other = np.array(text_normalize_table(*once, arithmetic), np.uint32)
    if isinstance(mean[0], np.float32):
        assert_same_bits(other, want, "a float32 scalar, read either way")
    else:
        assert (other != want).any(), "these inputs do not tell the two readings apart"


@pytest.mark.parametrize("mean, std, arithmetic, zero", [
    ((1e-45,), (255.0,), "dali_cpu", 0x80000000),  # (0 - 2**-149) * (1/255): underflows, keeps its minus
    ((-1e-45,), (255.0,), "dali_cpu", 0x00000000),
    ((1e-45,), (-127.5,), "rocal", 0x00000000),  # m / s underflows to -0.0, so off = +0.0
    ((1e-45,) * 3, (-127.5,) * 3, "dali_gpu", 0x00000000),  # m * inv underflows to -0.0, off = +0.0
])
def test_a_zero_from_underflow_keeps_the_sign_of_its_exact_value(mean, std, arithmetic, zero):
    # Pinned as the text's example says; a reading where underflow gives +0.0 (or -0.0)
    # would differ from the table at pixel 0, which is the sign bit alone.
    table = normalize_table(mean, std, arithmetic)
    assert table[0, 0] == 0 and int(table[0, :1].view(np.uint32)[0]) == zero
    assert text_normalize_table(mean, std, arithmetic)[0][0] == zero


def test_normalize_refuses_what_it_cannot_hold():
    for kwargs, words in [(dict(mean=127.5), "mean must be a sequence"), (dict(crop=(28.0, 28)), "two ints"),
                          (dict(crop=(28,)), "two ints"), (dict(mirror="yes"), "mirror must be a bool"),
                          (dict(crop_pos=(0.5,)), "crop_pos must be two numbers")]:
        assert_raises_naming(ValueError, lambda: Normalize(**kwargs), "Normalize", words)
    as_jax = Normalize(mean=jax.numpy.array([127.5] * 3), std=np.full(3, 127.5))  # 0-d entries
    assert as_jax == Normalize() and all(type(m) is float for m in as_jax.mean + as_jax.std)
    norm = Normalize(crop=(np.int64(28), 28), mirror=np.bool_(True), crop_pos=[np.float32(0.5), 0.5])
    assert norm.crop == (28, 28) and norm.mirror is True and norm.crop_pos == (0.5, 0.5)
    assert norm == Normalize(crop=(28, 28), mirror=True) and hash(norm) == hash(
        Normalize(crop=(28, 28), mirror=True))


def test_a_one_entry_mean_does_not_broadcast():
    with pytest.raises(ValueError, match="3 entries"):
        crop_mirror_normalize(np.zeros((1, 3, 4, 4), np.uint8), mean=(0.0,), std=(1.0,))


@given(st.floats(0, 1), st.integers(1, 4096), st.data(), st.sampled_from(ARITHMETICS))
@settings(max_examples=examples(60))
def test_crop_anchor_is_its_docstring(pos, size, data, arithmetic):
    crop = data.draw(st.integers(1, size))
    assert crop_anchor(pos, size, crop, arithmetic) == text_crop_anchor(pos, size, crop, arithmetic)


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("pos, size, crop", [(0.7, 32, 27), (0.9, 32, 27), (1 / 6, 32, 29), (0.1, 32, 27)])
def test_crop_anchor_rounds_the_vendors_product(pos, size, crop, arithmetic):
    # Here the exact (float64) product and its float32 rounding fall on different sides
    # of a rounding boundary for at least one vendor: rocAL's r32(p * d) and DALI's
    # exact double(p) * d decide.
    assert crop_anchor(pos, size, crop, arithmetic) == text_crop_anchor(pos, size, crop, arithmetic)


def test_float64_products_would_round_otherwise():
    # Negative control for the cases above: each vendor's anchor differs from the
    # other product's rounding (rocAL: not the exact product; DALI: not the float32 one).
    p = float(np.float32(0.7))
    assert text_crop_anchor(0.7, 32, 27, "rocal") != round(Fraction(p) * 5)
    float32_product = Fraction(float(np.float32(p) * np.float32(5)))
    assert text_crop_anchor(0.7, 32, 27, "dali_cpu") != math.floor(float32_product + Fraction(1, 2))


@pytest.mark.parametrize("pos, size, crop", [(-0.1, 32, 8), (1.5, 32, 8), (float("nan"), 32, 8),
                                             (0.5, 32, 33), (0.5, 32, 0)])
def test_crop_anchor_validates_itself(pos, size, crop):
    with pytest.raises(ValueError, match="crop_anchor"):
        crop_anchor(pos, size, crop)


@given(st.integers(1, 3).flatmap(lambda c: st.tuples(st.lists(SPEC_MEANS, min_size=c, max_size=c),
                                                     st.lists(SPEC_STDS, min_size=c, max_size=c))),
       st.tuples(st.integers(1, 9), st.integers(1, 9)),
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
    want = text_crop_mirror_normalize(images, crop, crop_pos, mirror, mean, std, arithmetic)
    np.testing.assert_array_equal(got.view(np.uint32), want)



# --------------------------------------------------------------------------
# Normalize's methods are the functions they name (test_arithmetic.py's own test of them)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [
    Normalize(),
    Normalize(mean=(1.0, 2.0, 3.0), std=(4.0, -5.0, 6.0), mirror=True, crop=(5, 7), crop_pos=(0.25, 0.75),
              arithmetic="dali_cpu"),
    Normalize(mean=(0.0,), std=(255.0,), crop=(12, 1), crop_pos=(1.0, 0.0), arithmetic="dali_gpu"),
], ids=["default", "every field", "one channel"])
def test_normalize_is_crop_mirror_normalize_with_its_fields(norm):
    # A Normalize applies crop_mirror_normalize with its own mean, std, mirror, crop,
    # crop_pos and arithmetic (into ``out`` when given); window is crop_window's, and
    # output_shape is (C, ch, cw) of that window, the shape __call__ returns.
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
                         "channels-last (NHWC)", "transpose(0, 3, 1, 2)")
    with pytest.raises(ValueError) as info:
        norm.output_shape((2, 12, 10))
    assert "need 2 entries" in str(info.value) and "NHWC" not in str(info.value)
    assert_raises_naming(ValueError, lambda: Normalize(crop=(13, 4)).output_shape((3, 12, 10)), "crop")



def test_normalize_values_are_equal_and_hash_alike_exactly_when_every_field_is_the_same():
    # "Two Normalize are equal (and hash alike) exactly when every field is the same,
    # floats bit for bit": equal values built from other types hash alike; a change of
    # any one field, each float entry included (0.0 and -0.0 too), makes another value.
    base = dict(mean=(1.0, 2.0, 0.0), std=(4.0, 5.0, 6.0), mirror=False, crop=(5, 7), crop_pos=(0.25, 0.75),
                arithmetic="rocal")
    a = Normalize(**base)
    same = Normalize(mean=[1, 2, 0], std=np.array([4.0, 5.0, 6.0]), mirror=np.bool_(False), crop=[5, 7],
                     crop_pos=(np.float32(0.25), 0.75), arithmetic="rocal")
    assert a == same and hash(a) == hash(same) and len({a, same}) == 1
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


# --------------------------------------------------------------------------
# Issue 30.7: a wrong type or value is refused at the call, naming the function,
# the parameter and the value (ints: Python and NumPy integers, never a bool or a
# whole float; real numbers: never a bool)
# --------------------------------------------------------------------------


IMAGES = np.zeros((2, 3, 8, 8), np.uint8)

# (the function as its messages name it, the call with one int parameter v, that parameter, a valid v)
ARITHMETIC_INT_PARAMETERS = [
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


@pytest.mark.parametrize("where, call, name, valid", ARITHMETIC_INT_PARAMETERS,
                         ids=[f"{w}-{n}" for w, _, n, _ in ARITHMETIC_INT_PARAMETERS])
@given(data=st.data())
@settings(max_examples=examples(8))
def test_every_int_parameter_refuses_what_is_not_an_int(where, call, name, valid, data):
    call(valid)  # the control: the call is valid with an int, Python's or NumPy's
    call(np.int64(valid))
    assert_refuses_naming_value(call, where, name, data.draw(not_ints(valid), label=name))


@pytest.mark.parametrize("call, fragments", [
    # accepted at construction before issue 30.7, failing only when images came
    (lambda: Normalize(crop=(0, 2)), ["Normalize: crop", "(0, 2)"]),
    (lambda: Normalize(crop_pos=(1.5, 0.5)), ["Normalize: crop_pos", "(1.5, 0.5)", "[0, 1]"]),
    (lambda: Normalize(crop_pos=(0.5, float("nan"))), ["Normalize: crop_pos", "nan"]),
    # bools read as 0 and 1
    (lambda: crop_anchor(0.5, True, True), ["crop_anchor: size must be an int, got True"]),
    (lambda: crop_anchor(True, 8, 2), ["crop_anchor: pos", "True"]),
    (lambda: normalize_table([True], [1.0]), ["normalize_table: mean", "True"]),
    (lambda: normalize_table([1.0], [np.True_]), ["normalize_table: std", "True"]),
    (lambda: Normalize(mirror=1), ["Normalize: mirror must be a bool, got 1"]),
    (lambda: Normalize(mirror=1.0), ["Normalize: mirror must be a bool, got 1.0"]),
    (lambda: crop_mirror_normalize(IMAGES, mirror=[1, 0]), ["crop_mirror_normalize: mirror", "[1, 0]"]),
    (lambda: crop_mirror_normalize(IMAGES, mirror="yes"), ["crop_mirror_normalize: mirror", "'yes'"]),
    (lambda: one_row(np.zeros((3, 256))), ["one_row: table must be a float32 (C, 256) array"]),
])
def test_the_reports_inputs_are_refused_at_the_call(call, fragments):
    assert_raises_naming(ValueError, call, *fragments)


def test_a_mean_is_an_ordered_sequence_of_real_numbers():
    # Kept through issue 30.7's rewrite of the check: a set has no order, a generator is
    # consumed by reading it, a nesting is not one number a channel.
    for mean in ({1.0, 2.0}, (m for m in [1.0, 2.0]), [[1.0], [2.0]], np.ones((2, 1))):
        assert_raises_naming(ValueError, lambda: normalize_table(mean, [1.0, 1.0]),
                             "normalize_table: mean must be a sequence")


def test_a_bfloat16_mean_is_its_exact_value():
    # Accepted, not refused: bfloat16 (ml_dtypes', as JAX uses it) is a float dtype whose
    # every value is a double, so float() is exact and the table is that double's. Before
    # issue 30.7 a 0-d JAX bfloat16 raised a TypeError, a NumPy one a ValueError.
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
# The fourth mutation run's survivors (mutation.py pure arithmetic.py): the table's cache
# key, its read-only rows, the overflow edge on both sides, quiet refusals
# --------------------------------------------------------------------------

from arithmetic import keyed_table, table_key  # noqa: E402

F32_MAX = float(np.finfo(np.float32).max)  # (2 - 2**-23) * 2**127


def test_keyed_table_refuses_each_wrong_part_of_a_key_alone():
    """keyed_table's docstring: the key is what table_key returns: a tuple of two byte strings
    of the same whole, non-zero number of float32 values, and an arithmetic. Each wrong part
    alone is a ValueError naming the key (a tuple that is only right in some parts included)."""
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
    """keyed_table's docstring: computed once per key and read-only (every table user shares it);
    normalize_table returns a writable copy, whose change reaches no later table."""
    key = table_key([0.1], [0.3], "dali_gpu", "test")
    shared = keyed_table(key)
    assert keyed_table(key) is shared and not shared.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        shared[0, 0] = 1.0
    copy = normalize_table([0.1], [0.3], "dali_gpu")
    assert copy.flags.writeable and copy is not shared
    before = shared.copy()
    copy[0, 0] = 7.0
    np.testing.assert_array_equal(normalize_table([0.1], [0.3], "dali_gpu"), before)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # quiet, as the refusals are
@pytest.mark.parametrize("arithmetic", ["rocal", "dali_gpu"])
def test_an_entry_at_float32_max_plus_half_an_ulp_overflows_and_one_an_ulp_below_rounds_to_max(arithmetic):
    """Rounded once, ties to even, as IEEE 754 says: an exact entry at float32's max + half its
    ulp (2**128 - 2**103) rounds to infinity, so the table is refused; with the offset one ulp
    lower, the same entry is max - half an ulp, a tie that rounds to the even max - ulp, and the
    table is accepted. std = 2**-103 (inv = 2**103 exactly) and offset = 2**128 - 2**111 put
    entry 255 at 255 * 2**103 + offset = 2**128 - 2**103."""
    offset = 2.0**128 - 2.0**111
    inv = 2.0**103
    assert 255 * inv + offset == 2.0**128 - 2.0**103  # exact in a double: the edge itself
    mean = -offset / inv  # -(mean * inv) = offset, exactly (a power-of-two scale)
    with pytest.raises(ValueError, match="overflows float32"):
        normalize_table([mean, mean], [1 / inv, 1 / inv], arithmetic)
    lower = float(np.nextafter(np.float32(offset), np.float32(0)))  # 2**128 - 2**111 - 2**104
    table = normalize_table([-lower / inv] * 2, [1 / inv] * 2, arithmetic)
    assert table[0, 255] == np.float32(F32_MAX - 2.0**104)  # the tie's even neighbour, max - ulp
    assert table[0, 254] == np.float32(F32_MAX - 2.0**104)  # max - ulp, exactly
    assert np.isfinite(table).all()


@pytest.mark.filterwarnings("error::RuntimeWarning")  # quiet, as the refusals are
@pytest.mark.parametrize("arithmetic", ["rocal", "dali_gpu", "dali_cpu"])
def test_a_table_of_entries_just_under_max_plus_half_an_ulp_is_all_max(arithmetic):
    """The other side of the edge: offset = max and inv = 2**95, so entry v is max + v * 2**95,
    below max + half an ulp (2**103) for every v <= 255: each rounds to max, none overflows."""
    inv = 2.0**95
    table = normalize_table([-F32_MAX / inv] * 3, [1 / inv] * 3, arithmetic)
    assert (table == np.float32(F32_MAX)).all()


@pytest.mark.filterwarnings("error::RuntimeWarning")  # quiet, as the refusals are
def test_an_entry_that_a_double_rounds_onto_the_overflow_edge_is_rounded_once():
    """An exact entry of max + 2**103 - 2**73, which a double rounds to max + 2**103 (and float32
    from there to infinity), is rounded once, to max; the next entry overflows, so the table is
    refused with its ValueError (never a TypeError from the way there). v = 93 with
    inv = 11,545,611 * 2**73 (93 x 11,545,611 = 2**30 - 1) and offset = max."""
    inv = 11_545_611 * 2.0**73
    assert np.float32(inv) == inv and 93 * 11_545_611 == 2**30 - 1
    exact = Fraction(F32_MAX) + 93 * Fraction(inv)
    assert float(exact) == F32_MAX + 2.0**103  # the double lands on the edge
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
    """Overflow on the way to a refusal is the refusal's business: normalize_table raises its
    ValueError and NumPy emits no RuntimeWarning (warnings made errors here)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=words):
            normalize_table(mean, std, arithmetic)
        normalize_table([0.5, 0.5, 0.5], [0.25, 0.25, 0.25], arithmetic)  # the control: no warning


def test_aligned_empty_is_64_byte_aligned_by_default():
    """aligned_empty's default align is 64 (a cache line, and what AVX-512 loads want)."""
    for n in (1, 3, 17, 100, 1000):
        assert aligned_empty((n,), np.uint8).ctypes.data % 64 == 0, n


def test_one_row_compares_rows_bit_for_bit_and_refuses_each_wrong_table_alone():
    """one_row's docstring: True iff every row is row 0 bit for bit (-0.0 is not 0.0, a NaN row
    equals itself); ValueError for anything but a float32 (C, 256) array with C >= 1."""
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


def test_crop_anchor_takes_a_zero_d_number_and_refuses_an_array_of_one():
    """crop_anchor's pos is one real number: a NumPy or ml_dtypes scalar, or a 0-d array, is
    one; an array of one element (or more) is not, and is refused naming pos."""
    want = crop_anchor(0.5, 10, 4)
    for pos in (np.float32(0.5), np.array(0.5), np.array(0.5, ml_dtypes.bfloat16), Fraction(1, 2)):
        assert crop_anchor(pos, 10, 4) == want, repr(pos)
    for pos in (np.array([0.5]), np.array([[0.5]]), np.array([0.5], ml_dtypes.bfloat16)):
        with pytest.raises(ValueError, match="crop_anchor: pos="):
            crop_anchor(pos, 10, 4)
