"""Samples that encode their own index: the probe data of a loader's conformance test.

Build a dataset with ``encoded_images`` (sample i encodes i), run it through any loader
(a vendor's, Grain, your own), and ``decode_indices`` turns each delivered block back
into the sample indices it holds, -1 where a slot encodes none; conformance.py's
describers then compare those indices with the reference plan. Both work for uint8
images of any shape, read as stored or through a ``Normalize`` (a vendor's normalised
float32, an ulp off or not), and for float and integer features of any shape and dtype,
up to ``index_limit`` samples, which is exact for each dtype.

What the encoding cannot carry: anything a loader does to a sample that still decodes
(a crop of the flat planes, noise under a quarter of the normalisation table's step);
conformance.describe_content and describe_values hold the content for that.

Imports: arithmetic.py (``Normalize``, for its table), cifar_mnist.py (CIFAR-10's image
shape, the default) and NumPy; ml_dtypes (which comes with JAX) only for its float
types' mantissas. Copy it with those two.
"""

from __future__ import annotations

import numpy as np

from arithmetic import Normalize
from cifar_mnist import IMAGE_SHAPE


def index_limit(shape: tuple[int, ...] = IMAGE_SHAPE, dtype=np.uint8) -> int:
    """How many samples ``encoded_images`` can number in ``shape`` and ``dtype``: indices
    0 .. limit - 1, each of which ``decode_indices`` recovers exactly; the limit itself
    is refused. S = the sample's size (product of ``shape``); S = 0 gives 0.

    * uint8: 65536 (two bytes a sample) when S >= 2; 0 when S = 1.
    * a float dtype (NumPy's, or ml_dtypes' such as bfloat16): min(2**(mantissa bits
      + 1), 2**63), below which every integer is exact (float64: 2**53; float32:
      16,777,216; float16: 2048; bfloat16: 256; x86's longdouble: 2**63).
    * another integer dtype: min(its largest value + 1, 2**63) (indices are int64):
      int8 128, int16 32,768, uint16 65,536, int64 and uint64 2**63.

    Raises ValueError for any other dtype (bool, complex, strings, ...)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape))
    if size == 0:
        return 0
    if dtype == np.uint8:
        return 65536 if size >= 2 else 0
    if np.issubdtype(dtype, np.integer):
        return min(int(np.iinfo(dtype).max) + 1, 2**63)
    mantissa = _mantissa_bits(dtype)
    if mantissa is None:
        raise ValueError(f"index_limit: dtype={dtype} is neither uint8, a float nor an integer dtype")
    return min(2 ** (mantissa + 1), 2**63)


def _mantissa_bits(dtype: np.dtype) -> int | None:
    """The stored mantissa bits of a real float dtype (NumPy's or ml_dtypes'), else None."""
    if np.issubdtype(dtype, np.floating):
        return int(np.finfo(dtype).nmant)
    if dtype.kind == "V" and dtype.names is None:  # ml_dtypes registers bfloat16, float8_* so
        try:
            import ml_dtypes  # comes with JAX
            return int(ml_dtypes.finfo(dtype).nmant)
        except (ImportError, ValueError, TypeError):
            return None
    return None


def encoded_images(indices: np.ndarray, shape: tuple[int, ...] = IMAGE_SHAPE,
                   dtype=np.uint8) -> np.ndarray:
    """Samples (N, *shape) of ``dtype`` that encode their own index, for ``decode_indices``.

    * uint8, shape (C, H, W) with C >= 3 (the default, CIFAR-10's (3, 32, 32)):
      plane 0 is index % 256, plane 1 is index // 256, and each of planes 2..
      holds the same ramp in every image, (4x + 2y) mod 256 at row y, column x.
      For an even width a horizontal mirror changes every pixel of the ramp (and
      for an even height a vertical flip does), so a mirrored image is detectable;
      for an odd width the middle column is its own mirror. Flat planes decode
      after any crop.
    * uint8, any other shape (one channel (1, 16, 16), (40,), ...): the first
      ceil(S/2) elements of the flattened sample hold index % 256, the rest
      index // 256 (S the sample's size, at least 2). Decodes when the sample
      arrives whole (a mirror of an image keeps its rows, so it decodes too).
    * any other dtype (float32 features, int16, ...): every element equals the
      index, exactly.

    Raises ValueError for indices that are not integers, or an index outside
    [0, index_limit(shape, dtype))."""
    raw = np.asarray(indices).reshape(-1)
    shape, dtype = tuple(shape), np.dtype(dtype)
    limit = index_limit(shape, dtype)
    if raw.size and raw.dtype.kind not in "iu" and not (
            raw.dtype.kind == "O" and all(isinstance(i, int) for i in raw.tolist())):
        raise ValueError(f"encoded_images: indices must be integers, got dtype {raw.dtype}")
    if raw.size and (int(raw.min()) < 0 or int(raw.max()) >= limit):  # Python ints: no overflow
        raise ValueError(f"encoded_images: indices must lie in [0, {limit}) for samples {shape} of "
                         f"{dtype} (index_limit), got range [{int(raw.min())}, {int(raw.max())}]")
    indices = raw.astype(np.int64)
    if dtype != np.uint8:
        return np.broadcast_to(indices.astype(dtype).reshape((-1,) + (1,) * len(shape)),
                               (len(indices),) + shape).copy()
    images = np.empty((len(indices),) + shape, np.uint8)
    if _planes(shape):
        images[:, 0] = (indices % 256).reshape((-1, 1, 1))
        images[:, 1] = (indices // 256).reshape((-1, 1, 1))
        y, x = np.mgrid[0:shape[1], 0:shape[2]]
        images[:, 2:] = ((4 * x + 2 * y) % 256)[None, None]
        return images
    flat = images.reshape(len(indices), int(np.prod(shape)))  # (0, S) too: -1 is ambiguous there
    half = -(-flat.shape[1] // 2)
    flat[:, :half] = (indices % 256)[:, None]
    flat[:, half:] = (indices // 256)[:, None]
    return images


def decode_indices(images: np.ndarray, normalize: Normalize | None = None) -> np.ndarray:
    """The sample index each delivered sample encodes (``encoded_images``), int64 (B,);
    -1 where it encodes none. ``images``: (B, ...) as delivered, one block of one shard.

    With a ``normalize`` (images (B, C, H, W) float32 from uint8), each value is
    first mapped back to the nearest entry of its channel's normalisation table
    (so a vendor that is an ulp off still decodes); a value a quarter of the table's
    step or more from every entry encodes nothing (the table may decrease: a negative
    std). Without one, the samples
    are read as stored:

    * uint8 by the byte scheme of ``encoded_images``, which follows the sample
      shape: (C >= 3, H, W) planes 0 and 1, else the first ceil(S/2) elements
      (low byte) and the rest (high byte). Each part must be flat (every element
      equal). Needs S >= 2 elements (ValueError otherwise).
    * any other dtype by value: the sample's elements must all be equal (as
      numbers) to one value v, and v must be a non-negative integer: a float
      sample that holds 2.5, -1, inf or NaN encodes nothing, nor does one of 2**63
      or more (the answer is int64). Integer dtypes are
      read exactly (int64 and uint64 up to 2**63 - 1, never through float64);
      floats of up to 8 bytes through float64, which holds each of their values
      exactly, wider ones (longdouble) as they are. Shape (B,) (scalar samples)
      is accepted; a sample of 0 elements encodes nothing.
    """
    images = np.asarray(images)
    if normalize is None and images.dtype != np.uint8:
        if images.ndim < 1:
            raise ValueError("decode_indices: samples must be (B, ...) with a batch axis, got a scalar")
        flat = images.reshape(len(images), int(np.prod(images.shape[1:])))
        if not flat.shape[1]:
            return np.full(len(images), -1, np.int64)
        ok = np.all(flat == flat[:, :1], axis=1)
        first = flat[:, 0]
        if np.issubdtype(flat.dtype, np.integer):  # exactly, not through float64 (int64 > 2**53)
            if flat.dtype == np.uint64:
                ok &= first < np.uint64(2**63)
            first = first.astype(np.int64)  # a wrapped uint64 >= 2**63 is masked above
            return np.where(ok & (first >= 0), first, -1)
        if flat.dtype.itemsize <= 8:  # float64 holds every value of these exactly
            first = first.astype(np.float64)
        ok &= np.isfinite(first) & (first >= 0) & (first == np.floor(first)) & (first < 2.0**63)
        return np.where(ok, np.where(ok, first, 0).astype(np.int64), -1)
    if images.ndim < 2:
        raise ValueError(f"decode_indices: images must be (B, ...) with a batch axis, got shape "
                         f"{images.shape}")
    if normalize is None:
        pixels, near = images.astype(np.int64), np.ones(images.shape, bool)
    else:
        pixels, near = _unnormalize(images, normalize)
    if int(np.prod(images.shape[1:])) < 2:  # (C >= 3, 0, W) too: planes of no pixel
        raise ValueError(f"decode_indices: uint8 samples need at least 2 elements (two bytes), "
                         f"got samples of shape {images.shape[1:]}")
    if _planes(images.shape[1:]):
        planes, near = pixels[:, :2], near[:, :2]
        flat = np.all(planes == planes[:, :, :1, :1], axis=(1, 2, 3))
        index = planes[:, 0, 0, 0] + 256 * planes[:, 1, 0, 0]
    else:
        values = pixels.reshape(len(pixels), int(np.prod(pixels.shape[1:])))
        half = -(-values.shape[1] // 2)
        low, high = values[:, :half], values[:, half:]
        flat = np.all(low == low[:, :1], axis=1) & np.all(high == high[:, :1], axis=1)
        index = low[:, 0] + 256 * high[:, 0]
    ok = np.all(near.reshape(len(near), int(np.prod(near.shape[1:]))), axis=1)
    return np.where(ok & flat, index, -1)


def _planes(sample_shape: tuple[int, ...]) -> bool:
    """Whether uint8 samples of this shape use the plane scheme (C, H, W), C >= 3."""
    return len(sample_shape) == 3 and sample_shape[0] >= 3


def _unnormalize(images: np.ndarray, normalize: Normalize) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 value of the nearest table entry, whether it is within a quarter step) per
    element of (B, C, H, W) normalised images."""
    if images.ndim != 4:
        raise ValueError(f"decode_indices: with a Normalize, images must be (B, C, H, W), got shape "
                         f"{images.shape}")
    table = normalize.table.astype(np.float64)
    if table.shape[0] != images.shape[1]:
        raise ValueError(f"decode_indices: {images.shape[1]} channels, but normalize has "
                         f"{table.shape[0]} (mean={list(normalize.mean)})")
    values = images.astype(np.float32).astype(np.float64)
    pixels, near = np.empty(images.shape, np.int64), np.empty(images.shape, bool)
    for c in range(images.shape[1]):
        row, plane = table[c], values[:, c]
        step = np.abs(np.diff(row)).min()
        guess = np.rint(np.interp(plane, row, np.arange(256))) if row[1] > row[0] \
            else np.rint(np.interp(-plane, -row, np.arange(256)))
        guess = guess.astype(np.int64).clip(0, 255)
        pixels[:, c], near[:, c] = guess, np.abs(row[guess] - plane) < step / 4
    return pixels, near
