"""The vendors' arithmetic: crop_mirror_normalize as exact float32 tables.

Over uint8 input a vendor's normalisation is one float32 value per (channel,
pixel value): ``normalize_table`` computes that table for rocAL's arithmetic
(one FMA), DALI's GPU kernel (one FMA) and DALI's CPU kernel (a subtract, then a
multiply), each read in the vendor's source and stated below as IEEE 754
operations. ``crop_anchor`` is each vendor's rounding of a crop's position,
``crop_mirror_normalize`` the whole operator on the host (crop, flip, then a
lookup), and ``Normalize`` the value a loader is given: what to apply to which
images, hashable, bit for bit. Every path that normalises (the host here, the
devices in loaders.py, the vendors' own pipelines held to these tables) looks
the same table up, so the bits are the same on every device.

Guarantees (test_arithmetic.py): each table is its docstring's arithmetic,
entry for entry, checked against an exact rational evaluation; the host
operator is a pure lookup after the crop and flip; two Normalize are equal
exactly when their tables and windows are.

Deliberate difference from rocAL: a crop larger than the image is an error
here; rocAL silently clamps it.

Inputs, everywhere in this module: an int parameter (a size, a crop, a shape) takes a
Python or NumPy integer, never a bool and never a float, even a whole one; a real
number (a mean, a std, a crop position) takes what ``normalize_table`` states, never
a bool; a bool parameter (mirror) takes Python's or NumPy's bool, not 0 or 1. A
wrong type or value raises ValueError at the call, naming the function, the
parameter and the value.

Imports: NumPy only. Imported by loaders.py, conformance.py, dali_loader.py,
rocal_loader.py and refimpl.py. NumPy >= 1.25.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from fractions import Fraction
from typing import Sequence

import numpy as np

ARITHMETICS = ("rocal", "dali_cpu", "dali_gpu")


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

    Inputs: ``mean`` and ``std`` are each a sequence (a list, a tuple, a 1-d NumPy or
    JAX array; not a set, whose order is not defined, nor a generator) of C real
    numbers: ``numbers.Real`` (Python ints and floats, ``fractions.Fraction``, NumPy
    integer and floating scalars, ``np.longdouble`` included) or 0-d NumPy or JAX
    arrays of an integer or float dtype, as iterating a JAX array gives, ml_dtypes'
    included (bfloat16, the float8s, int4: JAX's own low-precision dtypes, whose
    every value is a double, so ``float()`` is exact for them and accepting them
    loses nothing). Never a bool (True is not the number 1 here) nor a complex
    number. Each entry is converted by Python's ``float()``
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
    one-dimensional sequence of real numbers (a scalar, a string, a 2-d array, a
    set, a generator, an entry that is a bool or of another type),
    of different lengths or empty (there is no broadcasting: a one-entry mean
    is a one-channel table, and ``crop_mirror_normalize`` refuses it for
    3-channel images); a mean or std that is not finite after f32 (NaN, inf,
    beyond float32's range, or beyond a double's for ``float()``); a std whose
    f32 is zero or subnormal (its inverse would overflow); or any inv, offset
    or table entry that overflows float32. Subnormal means are accepted.
    Negative stds are accepted (the arithmetic is defined).
    """
    return keyed_table(table_key(mean, std, arithmetic, "normalize_table")).copy()


def table_key(mean, std, arithmetic: str, where: str) -> tuple[bytes, bytes, str]:
    """What determines a table's bits, exactly: the float32 bit patterns of mean
    and std (so -0.0 and 0.0 are different keys; a NaN is refused before) and
    the arithmetic. Every table cache is keyed by this."""
    mean32, std32 = _mean_std(mean, std, where)
    return mean32.tobytes(), std32.tobytes(), _check_arithmetic(arithmetic)


def keyed_table(key: tuple[bytes, bytes, str]) -> np.ndarray:
    """The table of a ``table_key``, computed once per key and read-only (the cache
    every table user shares); ``normalize_table`` returns a writable copy. ``key`` must
    be what ``table_key`` returns: ValueError otherwise (two byte strings of the same
    whole number of float32 values, at least one, and an arithmetic)."""
    ok = isinstance(key, tuple) and len(key) == 3 and all(isinstance(k, bytes) for k in key[:2]) \
        and len(key[0]) == len(key[1]) and len(key[0]) and not len(key[0]) % 4
    if not ok:
        raise ValueError(f"keyed_table: key must be what table_key returns (mean's and std's float32 "
                         f"bytes, an arithmetic), got {key!r}")
    _check_arithmetic(key[2])
    return _keyed_table(key)


@functools.lru_cache(maxsize=64)
def _keyed_table(key: tuple[bytes, bytes, str]) -> np.ndarray:
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
    with np.errstate(over="ignore"):  # a step past max is inf: not a candidate, and no warning
        guess = np.float32(float(exact))  # within one float32 step of the answer
        if not np.isfinite(guess):
            guess = np.copysign(np.finfo(np.float32).max, np.float32(float(exact)))
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
    product would give 3.5 -> 4. The anchor lies in [0, size - crop]. Accepted:
    ``pos`` a real number as normalize_table's entries (never a bool), ``size`` and
    ``crop`` ints (Python or NumPy integers; never a bool, nor a float even when
    whole). Validated here: ValueError, naming the parameter and the value, for an
    unknown arithmetic, a parameter of another type, size < 1, crop outside [1,
    size], or pos outside [0, 1] (NaN included).
    """
    _check_arithmetic(arithmetic)
    size = _check_int("crop_anchor", "size", size, 1)
    crop = _check_int("crop_anchor", "crop", crop, 1)
    pos = _real("crop_anchor", "pos", pos)
    if not crop <= size:
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
    rounding happens. ``mirror`` is a bool (every image; Python's or NumPy's) or
    an array of N bools (a list of bools, or a NumPy array of dtype bool; not
    ints). ``crop`` is None or two ints (``crop_anchor``'s), ``crop_pos`` two real
    numbers (``crop_anchor``'s pos).

    Validated here: ValueError for images that are not uint8 4-d, mean/std without
    exactly C entries (or anything normalize_table refuses), a crop that is not two
    ints, larger than the image or < 1 (rocAL clamps it silently), a crop_pos that
    is not two real numbers in [0, 1], a mirror that is not a bool or N bools, or
    an ``out`` that is not float32 (N, C, ch, cw).
    ``out``: the array to write into (default: a new one, 64-byte aligned so that
    JAX on CPU can use it in place).
    """
    images_NCHW = np.asarray(images_NCHW)
    if images_NCHW.ndim != 4 or images_NCHW.dtype != np.uint8:
        raise ValueError(f"crop_mirror_normalize: images must be uint8 NCHW, got "
                         f"{images_NCHW.dtype} {images_NCHW.shape}")
    n, c, h, w = images_NCHW.shape
    table = keyed_table(table_key(mean, std, arithmetic, "crop_mirror_normalize"))
    if table.shape[0] != c:
        raise ValueError(f"crop_mirror_normalize: mean and std need {c} entries (one per channel), "
                         f"got mean={list(mean)}, std={list(std)}")
    y0, x0, ch, cw = _window("crop_mirror_normalize", (h, w), crop, crop_pos, arithmetic)
    if isinstance(mirror, (bool, np.bool_)):
        flip = np.full(n, bool(mirror))
    else:
        flip = np.asarray(mirror) if isinstance(mirror, (list, tuple, np.ndarray)) else None
        if flip is None or flip.dtype != np.bool_ or flip.shape != (n,):
            raise ValueError(f"crop_mirror_normalize: mirror must be a bool or {n} bools (one per "
                             f"image), got {mirror!r}")
    if out is None:
        out = aligned_empty((n, c, ch, cw), np.float32)
    elif not isinstance(out, np.ndarray) or out.shape != (n, c, ch, cw) or out.dtype != np.float32:
        raise ValueError(f"crop_mirror_normalize: out must be float32 {(n, c, ch, cw)}, "
                         f"got {out.dtype} {out.shape}")
    window = images_NCHW[:, :, y0:y0 + ch, x0:x0 + cw]
    if flip.any():
        window = np.where(flip[:, None, None, None], window[..., ::-1], window)
    if one_row(table):  # one table for every channel, bit for bit: one lookup
        np.take(table[0], window, out=out, mode="clip")
    else:
        for channel in range(c):
            out[:, channel] = np.take(table[channel], window[:, channel])
    return out


def crop_window(image_hw: tuple[int, int], crop: tuple[int, int] | None,
                crop_pos: tuple[float, float], arithmetic: str = "rocal") -> tuple[int, int, int, int]:
    """``(y0, x0, ch, cw)``: the crop window in an image of ``image_hw`` (two ints >= 1),
    Python ints. ``crop`` is None (the whole image) or two ints, ``crop_pos`` two real
    numbers, as ``crop_mirror_normalize`` takes them. ValueError, naming the parameter
    and the value, for one of another type, or a window that does not fit."""
    return _window("crop_window", image_hw, crop, crop_pos, arithmetic)


def _window(where: str, image_hw, crop, crop_pos, arithmetic: str) -> tuple[int, int, int, int]:
    """crop_window's text, its errors naming ``where``."""
    h, w = _ints(where, "image_hw", image_hw, 2, 1)
    ch, cw = (h, w) if crop is None else _ints(where, "crop", crop, 2, 1)
    if not (ch <= h and cw <= w):
        raise ValueError(f"{where}: crop={crop} does not fit in images of {h}x{w}")
    pos_y, pos_x = _crop_pos(where, crop_pos)
    _check_arithmetic(arithmetic)
    return (crop_anchor(pos_y, h, ch, arithmetic), crop_anchor(pos_x, w, cw, arithmetic), ch, cw)


def aligned_empty(shape: tuple[int, ...], dtype, align: int = 64) -> np.ndarray:
    """``np.empty`` whose data starts on an ``align``-byte boundary (an array of no element
    has no data: its address is that of NumPy's empty slice, not aligned).

    JAX's CPU client wraps a 64-byte-aligned host buffer without copying it (it
    copies anything else); NumPy's allocator only promises 16 bytes. ``shape`` is an
    int or a sequence of ints >= 0, ``align`` an int >= 1, ``dtype`` what
    ``np.dtype`` takes (ValueError, naming the parameter and the value, otherwise).
    """
    shape = (shape,) if _is_int(shape) else shape
    shape = _ints("aligned_empty", "shape", shape, None, 0)
    align = _check_int("aligned_empty", "align", align, 1)
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"aligned_empty: dtype={dtype!r} is not a NumPy dtype") from None
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _doubles(name: str, values, where: str) -> tuple[float, ...]:
    """``values`` as a tuple of doubles, each entry converted by ``float()`` (normalize_table's text)."""
    ordered = isinstance(values, Sequence) or (hasattr(values, "__len__") and getattr(values, "ndim", None) == 1)
    nested = ordered and any(isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) for v in values)
    if isinstance(values, (str, bytes)) or not ordered or nested or getattr(values, "ndim", 1) != 1:
        raise ValueError(f"{where}: {name} must be a sequence of real numbers, one per channel, "
                         f"got {values!r}")
    return tuple(_real(where, name, value, values) for value in values)


def _real(where: str, name: str, value, values=None) -> float:
    """One real number (normalize_table's text) as the double ``float()`` gives; ValueError
    naming ``name`` (and the whole of ``values``, when it is an entry of one) otherwise."""
    dtype = getattr(value, "dtype", None)
    zero_d = dtype is not None and np.ndim(value) == 0 and (
        np.dtype(dtype).kind in "iuf" or np.dtype(dtype).type.__module__.split(".")[0] == "ml_dtypes")
    if isinstance(value, (bool, np.bool_)) or not (isinstance(value, numbers.Real) or zero_d):
        held = f"{list(values)!r} holds {value!r} of type {type(value).__name__}, " if values is not None \
            else f"{value!r} of type {type(value).__name__} is "
        raise ValueError(f"{where}: {name}={held}not a real number (int, float, Fraction, a NumPy "
                         f"or ml_dtypes scalar; never a bool)")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{where}: {name}={list(values) if values is not None else value!r}: {value!r} "
                         f"is beyond a double's range, so not finite") from None


def _is_int(value) -> bool:
    """The module's one rule for an int: a Python or NumPy integer, never a bool, never a
    float (even a whole one)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_int(where: str, name: str, value, minimum: int) -> int:
    """``value`` as a Python int; ValueError naming ``where``, ``name`` and the value unless
    it is an int (``_is_int``) >= ``minimum``."""
    if not _is_int(value):
        raise ValueError(f"{where}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return int(value)


def _ints(where: str, name: str, values, count: int | None, minimum: int) -> tuple[int, ...]:
    """``values`` as a tuple of Python ints (``count`` of them, when given), each an int
    >= ``minimum``; ValueError naming ``name`` and the whole value otherwise."""
    ok = isinstance(values, (tuple, list, np.ndarray)) and np.ndim(values) == 1 \
        and (count is None or len(values) == count) and all(_is_int(v) and v >= minimum for v in values)
    if not ok:
        what = {None: "ints", 2: "two ints", 3: "three ints"}.get(count, f"{count} ints")
        raise ValueError(f"{where}: {name} must be {what} >= {minimum}, got {values!r}")
    return tuple(int(v) for v in values)


def _crop_pos(where: str, crop_pos) -> tuple[float, float]:
    """Two real numbers (``_real``) in [0, 1], as doubles; ValueError naming crop_pos otherwise."""
    pos = _doubles("crop_pos", crop_pos, where)
    if len(pos) != 2:
        raise ValueError(f"{where}: crop_pos must be two numbers (y, x), got {crop_pos!r}")
    if not all(0.0 <= p <= 1.0 for p in pos):  # NaN fails both comparisons
        raise ValueError(f"{where}: crop_pos={tuple(crop_pos)} must lie in [0, 1]")
    return pos


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

    ``mean`` and ``std`` take what ``normalize_table`` takes (any real numbers,
    bfloat16 included; never a bool) and are stored as tuples of ``float()`` of
    each entry, the doubles normalize_table rounds to float32; ``crop_pos`` likewise
    (two of them, each in [0, 1]). ``crop`` is None or two ints >= 1 (Python or
    NumPy integers; never a bool, nor a whole float), ``mirror`` a bool (Python's or
    NumPy's; not 0 or 1). All of it is checked on construction (ValueError naming
    the field and the value), so a Normalize that exists fails later only for
    images it does not fit (``output_shape``). Two Normalize are equal (and hash alike)
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
        where = "Normalize"
        _mean_std(self.mean, self.std, where)
        _check_arithmetic(self.arithmetic)
        if not isinstance(self.mirror, (bool, np.bool_)):
            raise ValueError(f"{where}: mirror must be a bool, got {self.mirror!r}")
        crop = None if self.crop is None else _ints(where, "crop (height, width)", self.crop, 2, 1)
        crop_pos = _crop_pos(where, self.crop_pos)
        # Plain Python values whatever was passed (lists, NumPy scalars): a Normalize is a hashable value.
        object.__setattr__(self, "mean", _doubles("mean", self.mean, where))
        object.__setattr__(self, "std", _doubles("std", self.std, where))
        object.__setattr__(self, "mirror", bool(self.mirror))
        object.__setattr__(self, "crop", crop)
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
        """``crop_window`` of this crop in an image of ``image_hw`` (two ints >= 1)."""
        return _window("Normalize", image_hw, self.crop, self.crop_pos, self.arithmetic)

    def output_shape(self, image_chw: tuple[int, ...]) -> tuple[int, int, int]:
        """(C, ch, cw) of a normalised image of ``image_chw`` = (C, H, W), three ints >= 1;
        ValueError if it is not that, or mean/std or the crop do not fit it."""
        if not isinstance(image_chw, (tuple, list)) or len(image_chw) != 3:
            raise ValueError(f"Normalize: images must be (N, C, H, W), one image (C, H, W), got an image "
                             f"of shape {image_chw!r}")
        c, h, w = _ints("Normalize", "image_chw", image_chw, 3, 1)
        if len(self.mean) != c:
            hint = ""
            if image_chw[-1] == len(self.mean):
                hint = ("; these look channels-last (NHWC): NCHW expected, pass "
                        "images.transpose(0, 3, 1, 2)")
            raise ValueError(f"Normalize: mean and std need {c} entries (one per channel of images "
                             f"{tuple(image_chw)}, channels first), got mean={list(self.mean)}{hint}")
        return (c,) + self.window((h, w))[2:]

    def __call__(self, images_NCHW: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return crop_mirror_normalize(images_NCHW, crop=self.crop, mirror=self.mirror, mean=self.mean,
                                     std=self.std, crop_pos=self.crop_pos, arithmetic=self.arithmetic,
                                     out=out)


def one_row(table: np.ndarray) -> bool:
    """Whether every row of ``table`` (a float32 (C, 256) NumPy array, C >= 1: ValueError
    otherwise) is row 0, bit for bit (-0.0 is not 0.0): then one lookup serves every channel."""
    if not isinstance(table, np.ndarray) or table.dtype != np.float32 or table.ndim != 2 \
            or table.shape[1] != 256 or not len(table):
        raise ValueError(f"one_row: table must be a float32 (C, 256) array, got "
                         f"{getattr(table, 'dtype', type(table).__name__)} {np.shape(table)}")
    bits = table.view(np.uint32)
    return bool((bits == bits[:1]).all())
