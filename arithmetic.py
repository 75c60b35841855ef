"""The vendors' crop_mirror_normalize as exact float32 tables.

Over uint8 input a vendor's normalisation is one float32 value per (channel, pixel value). ``normalize_table`` computes
that table for each of ``ARITHMETICS`` (rocAL's, DALI's GPU and CPU kernels), ``crop_anchor`` is each vendor's rounding
of a crop's position, and ``crop_mirror_normalize`` the whole operator on the host: crop, flip, then a lookup.
``Normalize`` is the value a loader is given. Every path that normalises gives the table's bits (a lookup, or on a TPU
the table's own arithmetic, checked first on all 256 values), so every device gives the same bits.

Deliberate difference from rocAL: a crop larger than the image is an error here; rocAL silently clamps it.

Inputs: an int parameter (a size, a crop, a shape) takes a Python or NumPy integer, never a bool or a float (even 5.0).
A real number (a mean, a std, a crop position) takes what ``normalize_table`` states. ``mirror`` takes Python's or
NumPy's bool, not 0 or 1. Anything else raises ValueError at the call, naming the function, the parameter and the value.

Imports: NumPy (>= 1.25) only, so the module can be copied alone.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from fractions import Fraction
from typing import Sequence

import numpy as np

ARITHMETICS = ("rocal", "dali_cpu", "dali_gpu")

# Read in the vendors' source (ROCm/rocAL develop and rocm-6.4.1, ROCm/rpp, NVIDIA/DALI 2.4), as normalize_table and
# crop_anchor state them. rocAL: node_crop_mirror_normalize.cpp computes inv and the offset; RPP applies the FMA
# (crop_mirror_normalize.hpp's _mm256_fmadd_ps; the HIP kernel's pix * inv + offset is contracted to an FMA); the anchor
# is nearbyintf; default mirror=1. DALI: CPU kernel slice_flip_normalize_permute_pad_cpu.h, GPU kernel
# slice_flip_normalize_gpu*.cu; both anchors are crop_attr.cc's std::round (rounding="round"); default mirror=0.
# Neither is (x - mean) / std: for mean = std = 127.5 that differs from rocAL's on 223 of the 256 uint8 values (1 ulp).


def normalize_table(mean: Sequence[float], std: Sequence[float], arithmetic: str = "rocal") -> np.ndarray:
    """(C, 256) float32: the vendor's normalised value of each uint8 pixel value, per channel.

    ``mean`` and ``std`` are sequences of C real numbers: a list, a tuple or a 1-d NumPy or JAX array, not a set or a
    generator. An entry is a ``numbers.Real`` (a NumPy scalar or a ``Fraction`` too) or a 0-d integer or float array,
    ml_dtypes' included (bfloat16, the float8s, int4: every value a double); never a bool. ``float()`` rounds each entry
    to a double and f32 rounds that, as the vendors' Python bindings do: 1 + 2**-24 + 2**-60 becomes 1 + 2**-24, a
    float32 tie, so m = 1.0 (rounding once would give 1 + 2**-23).

    IEEE 754 binary32 throughout: each operation's exact result rounded once to nearest, ties to even. Per channel c,
    with x = 0..255 exact in float32:

        m   = f32(float(mean[c]))
        s   = f32(float(std[c]))
        inv = 1 / s                                   # float32 division
        "rocal":    off = -(m / s) if C == 1 else -(m * inv)
                    table[c, x] = fma(x, inv, off)    # x * inv + off exactly, rounded once
        "dali_gpu": off = -(m * inv)                  # for every C
                    table[c, x] = fma(x, inv, off)
        "dali_cpu": table[c, x] = (x - m) * inv       # a subtract, then a multiply

    Zeros take IEEE 754's signs. A non-zero result that rounds to zero keeps its sign. An exact zero product or quotient
    is -0.0 iff exactly one operand is negative; an exact zero sum (x * inv + off, x - m) iff both terms are -0.0.
    ``-(v)`` flips the sign. So "dali_cpu" with mean 1e-45, std 255 gives table[0, 0] = -0.0; "rocal" with mean -0.0,
    std -2.0 gives off = -0.0 and table[0, 0] = fma(0, -0.5, -0.0) = -0.0.

    Raises:
      ValueError: an unknown arithmetic; mean or std not as above, empty or of different lengths (no broadcasting); an
        entry not finite after f32; a std whose f32 is zero or subnormal; an inv, offset or table entry beyond float32.
        Subnormal means and negative stds are accepted."""
    return keyed_table(table_key(mean, std, arithmetic, "normalize_table")).copy()


def table_key(mean, std, arithmetic: str, where: str) -> tuple[bytes, bytes, str]:
    """What determines a table's bits: mean's and std's float32 bytes (so -0.0 is not 0.0), and the arithmetic. Every
    table cache is keyed by this; errors name ``where``."""
    mean32, std32 = _mean_std(mean, std, where)
    return mean32.tobytes(), std32.tobytes(), _check_arithmetic(arithmetic)


def keyed_table(key: tuple[bytes, bytes, str]) -> np.ndarray:
    """The read-only table of a ``table_key``, computed once per key and shared. ValueError unless ``key`` is what
    ``table_key`` returns: two byte strings of the same number (>= 1) of float32 values, and an arithmetic."""
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
    inv, offset = _operands(mean32, std32, arithmetic)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, quietly
        table = ((np.arange(256, dtype=np.float32) - mean32[:, None]) * inv[:, None]).astype(np.float32)
    if not (np.isfinite(inv).all() and (arithmetic == "dali_cpu" or np.isfinite(offset).all())):
        raise ValueError(f"{where}: 1/std or the offset overflows float32 ({arithmetic!r})")
    if arithmetic != "dali_cpu":  # NumPy has no float32 FMA: the exact sum, rounded once
        for c in range(channels):
            scale, shift = Fraction(float(inv[c])), Fraction(float(offset[c]))
            for value in range(256):
                exact = value * scale + shift
                if exact == 0:  # IEEE 754's sign of an exact zero from an FMA
                    table[c, value] = np.float32(value) * inv[c] + offset[c]
                else:
                    table[c, value] = _nearest_float32(exact)
    if not np.isfinite(table).all():
        raise ValueError(f"{where}: a table entry overflows float32 ({arithmetic!r})")
    table.flags.writeable = False
    return table


def table_operands(key: tuple[bytes, bytes, str]) -> dict[str, np.ndarray]:
    """The float32 operands (C,) of a ``table_key``'s table, as ``normalize_table``'s: {"inv", "offset"} ("rocal",
    "dali_gpu": table[c, x] = fma(x, inv[c], offset[c])) or {"mean", "inv"} ("dali_cpu": (x - mean[c]) * inv[c])."""
    keyed_table(key)  # checks the key, and that every operand is finite
    mean32, std32 = np.frombuffer(key[0], np.float32), np.frombuffer(key[1], np.float32)
    inv, offset = _operands(mean32, std32, key[2])
    return {"mean": mean32.copy(), "inv": inv} if key[2] == "dali_cpu" else {"inv": inv, "offset": offset}


def _operands(mean32: np.ndarray, std32: np.ndarray, arithmetic: str) -> tuple[np.ndarray, np.ndarray]:
    """(inv, offset), float32 (C,): 1/std, and -mean/std for rocAL's one channel, else -(mean * inv)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # an overflow is refused by the caller
        inv = np.float32(1) / std32
        return inv, (-(mean32 / std32) if arithmetic == "rocal" and len(mean32) == 1 else -(mean32 * inv))


def _nearest_float32(exact: Fraction) -> np.float32:
    """``exact`` rounded once to float32, ties to even (inf beyond float32's range)."""
    double = np.float64(float(exact))  # rounded to nearest; made round-to-odd below
    if Fraction(float(double)) != exact and not double.view(np.uint64) & 1:
        double = np.nextafter(double, np.inf if exact > double else -np.inf)
    # Rounded to odd at 53 bits, then to nearest at 24 bits, is rounded once to 24 bits.
    with np.errstate(over="ignore"):  # inf is refused by the caller, quietly
        return np.float32(double)


def crop_anchor(pos: float, size: int, crop: int, arithmetic: str = "rocal") -> int:
    """First row (or column) of a ``crop``-long window in ``size``, at relative position ``pos``.

        p = r32(pos)                       # pos rounded to float32 first (RNE)
        d = size - crop                    # an integer, exact
        "rocal":                 t = r32(p * d)   # a float32 product, rounded once
                                 anchor = round t half to even    (nearbyintf)
        "dali_cpu", "dali_gpu":  t = p * d        # double(p) times the span: exact
                                 anchor = floor(t + 1/2)  (std::round: half away from zero)

    So pos=0.7, d=5 gives DALI t = 3.4999999, anchor 3; rocAL t = 3.5, anchor 4. The anchor is in [0, size - crop].

    Raises:
      ValueError: an unknown arithmetic; size not an int >= 1; crop not an int in [1, size]; pos not a real in [0, 1].
    """
    _check_arithmetic(arithmetic)
    size, crop = _check_int("crop_anchor", "size", size, 1), _check_int("crop_anchor", "crop", crop, 1)
    pos = _real("crop_anchor", "pos", pos)
    if not crop <= size:
        raise ValueError(f"crop_anchor: crop={crop} does not fit in size={size}")
    if not 0.0 <= pos <= 1.0:  # NaN fails both comparisons
        raise ValueError(f"crop_anchor: pos={pos} must lie in [0, 1]")
    if arithmetic == "rocal":
        return int(np.rint(float(np.float32(pos) * np.float32(size - crop))))  # r32(p * d), half to even
    product = float(np.float32(pos)) * (size - crop)  # exact in float64
    whole = int(np.floor(product))
    return whole + (product - whole >= 0.5)  # product >= 0: half away from zero


def crop_mirror_normalize(images_NCHW: np.ndarray, *, crop: tuple[int, int] | None = None, mirror=False,
                          mean: Sequence[float] = (0.0, 0.0, 0.0), std: Sequence[float] = (1.0, 1.0, 1.0),
                          crop_pos: tuple[float, float] = (0.5, 0.5), arithmetic: str = "rocal",
                          out: np.ndarray | None = None) -> np.ndarray:
    """A vendor's crop_mirror_normalize of uint8 NCHW images, as float32 NCHW.

    With ``table = normalize_table(mean, std, arithmetic)`` (in pixel units, C entries), ``(ch, cw) = crop``
    (default: the whole image), ``y0 = crop_anchor(crop_pos[0], H, ch, arithmetic)`` and
    ``x0 = crop_anchor(crop_pos[1], W, cw, arithmetic)``:

        out[n, c, y, x] = table[c, images[n, c, y0 + y, x0 + x']]
        x' = cw - 1 - x if mirror[n] else x     # a horizontal flip inside the window

    Crop, then flip, then a lookup: no other rounding happens. ``crop`` is None or two ints, ``crop_pos`` two real
    numbers in [0, 1]. ``mirror`` is one bool for every image, or N bools (a list or a NumPy bool array; not ints).
    ``out`` is a float32 (N, C, ch, cw) array to write into; by default a new 64-byte-aligned one (``aligned_empty``).
    ValueError for anything else, or a crop larger than the image."""
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
        mirror = np.full(n, bool(mirror))
    flip = np.asarray(mirror) if isinstance(mirror, (list, tuple, np.ndarray)) else None
    if flip is None or flip.dtype != np.bool_ or flip.shape != (n,):
        raise ValueError(f"crop_mirror_normalize: mirror must be a bool or {n} bools (one per image), got {mirror!r}")
    if out is None:
        out = aligned_empty((n, c, ch, cw), np.float32)
    elif not isinstance(out, np.ndarray) or out.shape != (n, c, ch, cw) or out.dtype != np.float32:
        raise ValueError(f"crop_mirror_normalize: out must be float32 {(n, c, ch, cw)}, got {out.dtype} {out.shape}")
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
    """``(y0, x0, ch, cw)``, Python ints: the crop window in an image of ``image_hw``, two ints >= 1. ``crop`` and
    ``crop_pos`` are crop_mirror_normalize's; ValueError as there."""
    return _window("crop_window", image_hw, crop, crop_pos, arithmetic)


def _window(where: str, image_hw, crop, crop_pos, arithmetic: str) -> tuple[int, int, int, int]:
    h, w = _ints(where, "image_hw", image_hw, 2, 1)
    ch, cw = (h, w) if crop is None else _ints(where, "crop", crop, 2, 1)
    if not (ch <= h and cw <= w):
        raise ValueError(f"{where}: crop={crop} does not fit in images of {h}x{w}")
    pos_y, pos_x = _crop_pos(where, crop_pos)
    return (crop_anchor(pos_y, h, ch, arithmetic), crop_anchor(pos_x, w, cw, arithmetic), ch, cw)


def aligned_empty(shape: tuple[int, ...], dtype, align: int = 64) -> np.ndarray:
    """``np.empty`` whose data (if it has an element) starts on an ``align``-byte boundary.

    JAX's CPU client wraps a 64-byte-aligned host buffer without copying it; NumPy's allocator only promises 16 bytes.
    ``shape`` is an int or ints >= 0, ``align`` an int >= 1, ``dtype`` what ``np.dtype`` takes; ValueError otherwise."""
    shape = _ints("aligned_empty", "shape", (shape,) if _is_int(shape) else shape, None, 0)
    align = _check_int("aligned_empty", "align", align, 1)
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"aligned_empty: dtype={dtype!r} is not a NumPy dtype") from None
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@dataclasses.dataclass(frozen=True, eq=False)
class Normalize:
    """What a loader applies to each image: a vendor's crop_mirror_normalize, as a value.

    The default is the rocAL notebook's: no crop, no flip, mean = std = 127.5 per channel, rocAL's arithmetic; the DALI
    notebook's MNIST is ``Normalize(mean=(0.0,), std=(255.0,), arithmetic="dali_cpu")``. ``arithmetic`` also picks the
    crop anchor's rounding; ``table`` is the (C, 256) specification. It takes uint8 NCHW images with C = len(mean).

    The fields take what crop_mirror_normalize takes, but ``mirror`` is one bool; they are checked on construction and
    stored as plain Python values, mean, std and crop_pos as tuples of ``float()``. Two Normalize are equal, and hash
    alike, exactly when every field is the same, floats bit for bit (mean 0.0 and -0.0 differ, as their tables do)."""
    mean: tuple[float, ...] = (127.5, 127.5, 127.5)
    std: tuple[float, ...] = (127.5, 127.5, 127.5)
    mirror: bool = False
    crop: tuple[int, int] | None = None
    crop_pos: tuple[float, float] = (0.5, 0.5)
    arithmetic: str = "rocal"

    def __post_init__(self):
        _mean_std(self.mean, self.std, "Normalize")
        _check_arithmetic(self.arithmetic)
        if not isinstance(self.mirror, (bool, np.bool_)):
            raise ValueError(f"Normalize: mirror must be a bool, got {self.mirror!r}")
        # Plain Python values whatever was passed (lists, NumPy scalars): a hashable value.
        fields = dict(crop=None if self.crop is None else _ints("Normalize", "crop (height, width)", self.crop, 2, 1),
                      crop_pos=_crop_pos("Normalize", self.crop_pos), mirror=bool(self.mirror),
                      mean=_doubles("mean", self.mean, "Normalize"), std=_doubles("std", self.std, "Normalize"))
        for name, value in fields.items():
            object.__setattr__(self, name, value)

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
        """(C, ch, cw) of a normalised image of ``image_chw`` = (C, H, W), three ints >= 1; ValueError if it is not
        that, or mean/std or the crop do not fit it."""
        if not isinstance(image_chw, (tuple, list)) or len(image_chw) != 3:
            raise ValueError(f"Normalize: images must be (N, C, H, W), one image (C, H, W), got an image "
                             f"of shape {image_chw!r}")
        c, h, w = _ints("Normalize", "image_chw", image_chw, 3, 1)
        if len(self.mean) != c:
            last = image_chw[-1]  # a last axis of at most 4, below the first: channels, whatever mean says
            hint = (f"; these look channels-last (NHWC, {last} channel{'s' * (last > 1)}): NCHW expected, pass "
                    f"images.transpose(0, 3, 1, 2)" + (f" and a mean and std of {last} entries" if last != len(
                        self.mean) else "")) if last <= 4 and last < c else ""
            raise ValueError(f"Normalize: mean and std need {c} entries (one per channel of images "
                             f"{tuple(image_chw)}, channels first), got mean={list(self.mean)}{hint}")
        return (c,) + self.window((h, w))[2:]

    def __call__(self, images_NCHW: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return crop_mirror_normalize(images_NCHW, crop=self.crop, mirror=self.mirror, mean=self.mean, std=self.std,
                                     crop_pos=self.crop_pos, arithmetic=self.arithmetic, out=out)


def one_row(table: np.ndarray) -> bool:
    """Whether every row of ``table``, a float32 (C >= 1, 256) NumPy array (ValueError otherwise), is row 0 bit for bit
    (-0.0 is not 0.0): then one lookup serves every channel."""
    if not isinstance(table, np.ndarray) or table.dtype != np.float32 or table.ndim != 2 \
            or table.shape[1] != 256 or not len(table):
        raise ValueError(f"one_row: table must be a float32 (C, 256) array, got "
                         f"{getattr(table, 'dtype', type(table).__name__)} {np.shape(table)}")
    bits = table.view(np.uint32)
    return bool((bits == bits[:1]).all())


def _doubles(name: str, values, where: str) -> tuple[float, ...]:
    """``values`` as a tuple of doubles, each entry as ``float()`` gives it (normalize_table's rule)."""
    ordered = isinstance(values, Sequence) or (hasattr(values, "__len__") and getattr(values, "ndim", None) == 1)
    nested = ordered and any(isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) for v in values)
    if isinstance(values, (str, bytes)) or not ordered or nested or getattr(values, "ndim", 1) != 1:
        raise ValueError(f"{where}: {name} must be a sequence of real numbers, one per channel, got {values!r}")
    return tuple(_real(where, name, value, values) for value in values)


def _real(where: str, name: str, value, values=None) -> float:
    """One real number (normalize_table's rule) as the double ``float()`` gives; else ValueError naming it."""
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


# _is_int and _check_int are copied, not imported: each module can be copied without the rest of the project.
def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_int(where: str, name: str, value, minimum: int) -> int:
    if not _is_int(value):
        raise ValueError(f"{where}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return int(value)


def _ints(where: str, name: str, values, count: int | None, minimum: int) -> tuple[int, ...]:
    """``values`` as a tuple of Python ints (``count`` of them, if given), each >= ``minimum``; else ValueError."""
    ok = isinstance(values, (tuple, list, np.ndarray)) and np.ndim(values) == 1 \
        and (count is None or len(values) == count) and all(_is_int(v) and v >= minimum for v in values)
    if not ok:
        what = {None: "ints", 2: "two ints", 3: "three ints"}.get(count, f"{count} ints")
        raise ValueError(f"{where}: {name} must be {what} >= {minimum}, got {values!r}")
    return tuple(int(v) for v in values)


def _crop_pos(where: str, crop_pos) -> tuple[float, float]:
    """Two real numbers in [0, 1], as doubles; ValueError naming crop_pos otherwise."""
    pos = _doubles("crop_pos", crop_pos, where)
    if len(pos) != 2:
        raise ValueError(f"{where}: crop_pos must be two numbers (y, x), got {crop_pos!r}")
    if not all(0.0 <= p <= 1.0 for p in pos):  # NaN fails both comparisons
        raise ValueError(f"{where}: crop_pos={tuple(crop_pos)} must lie in [0, 1]")
    return pos


def _mean_std(mean, std, where: str) -> tuple[np.ndarray, np.ndarray]:
    """mean and std as float32 (float() of each entry, then rounded), checked as normalize_table says."""
    mean, std = _doubles("mean", mean, where), _doubles("std", std, where)
    with np.errstate(over="ignore"):  # beyond float32 becomes inf, refused below
        mean32, std32 = np.array(mean, np.float64).astype(np.float32), np.array(std, np.float64).astype(np.float32)
    if len(mean) != len(std) or not mean:
        raise ValueError(f"{where}: mean and std need one entry per channel, got mean={list(mean)}, std={list(std)}")
    if not (np.isfinite(mean32).all() and np.isfinite(std32).all()):
        raise ValueError(f"{where}: mean and std must be finite float32 values, got mean={list(mean)}, std={list(std)}")
    if np.any(std32 == 0):
        raise ValueError(f"{where}: std has a zero entry: std={std32.tolist()}")
    if np.any(np.abs(std32) < np.finfo(np.float32).smallest_normal):
        raise ValueError(f"{where}: std has a subnormal float32 entry (1/std would overflow): std={list(std)}")
    return mean32, std32


def _check_arithmetic(arithmetic: str) -> str:
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"arithmetic must be one of {ARITHMETICS}, got {arithmetic!r}")
    return arithmetic
