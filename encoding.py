"""Samples that encode their own index: the probe data of a loader's conformance test.

Build a dataset with ``encoded_images`` (sample i encodes i), run it through a loader, and ``decode_indices`` turns each
delivered block into its indices, -1 where a slot encodes none; conformance.py compares those with the plan. Both work
for uint8 images of any shape, as stored or through a ``Normalize`` (a vendor's float32, an ulp off or not), and for
float and integer features of any shape, up to ``index_limit`` samples. A change that still decodes (a crop of the flat
planes, noise under a quarter of the table's step) is conformance.describe_content's and describe_values' to see.

Imports arithmetic.py, cifar_mnist.py (the default shape), NumPy and ml_dtypes (JAX's float types): copy it with those.
"""

from __future__ import annotations

import numpy as np

from arithmetic import Normalize
from cifar_mnist import IMAGE_SHAPE


def index_limit(shape: tuple[int, ...] = IMAGE_SHAPE, dtype=np.uint8) -> int:
    """How many samples of ``shape`` and ``dtype`` can encode their index: 0 .. limit - 1.

    With S the sample's size (S = 0 gives 0):

    * uint8: 65536 (two bytes per sample) when S >= 2; 0 when S = 1.
    * a float dtype (NumPy's, or ml_dtypes' such as bfloat16): min(2**(mantissa bits + 1), 2**63), below which every
      integer is exact (float64: 2**53; float32: 16,777,216; float16: 2048; bfloat16: 256; x86's longdouble: 2**63).
    * another integer dtype: min(its largest value + 1, 2**63) (indices are int64): int8 128, int16 32,768, uint16
      65,536, int64 and uint64 2**63.

    Raises ValueError for a shape that is not non-negative ints, or another dtype."""
    return _limit(shape, dtype, "index_limit")


def _limit(shape, dtype, where: str) -> int:
    if not isinstance(shape, (tuple, list)) or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) and d >= 0 for d in shape):
        raise ValueError(f"{where}: shape must be a tuple of non-negative ints, got {shape!r}")
    dtype, size = np.dtype(dtype), int(np.prod(shape))
    if size == 0:
        return 0
    if dtype == np.uint8:
        return 65536 if size >= 2 else 0
    if np.issubdtype(dtype, np.integer):
        return min(int(np.iinfo(dtype).max) + 1, 2**63)
    if np.issubdtype(dtype, np.floating):
        return min(2 ** (int(np.finfo(dtype).nmant) + 1), 2**63)
    if dtype.kind == "V" and dtype.names is None:  # ml_dtypes registers bfloat16, float8_* so
        try:
            import ml_dtypes  # comes with JAX
            return min(2 ** (int(ml_dtypes.finfo(dtype).nmant) + 1), 2**63)
        except (ImportError, ValueError, TypeError):
            pass
    raise ValueError(f"{where}: dtype={dtype} is neither uint8, a float nor an integer dtype")


def encoded_images(indices: np.ndarray, shape: tuple[int, ...] = IMAGE_SHAPE, dtype=np.uint8) -> np.ndarray:
    """Samples (N, *shape) of ``dtype``, sample n encoding ``indices[n]``, for ``decode_indices``.

    * uint8, shape (C, H, W) with C >= 3 (the default, CIFAR-10's (3, 32, 32)): plane 0 is index % 256, plane 1
      index // 256, and each plane from 2 on the same ramp in every image, (4x + 2y) mod 256 at row y, column x. An
      even width makes every ramp pixel differ from its mirror (an even height from its flip); an odd width keeps the
      middle column. Flat planes decode after any crop.
    * uint8, any other shape: the first ceil(S/2) of the S elements hold index % 256, the rest index // 256.
    * any other dtype: every element equals the index, exactly.

    ``indices``: integers of any shape, flattened. Raises ValueError for indices that are not integers or lie outside
    [0, index_limit(shape, dtype)), or a bad shape or dtype."""
    raw, dtype = np.asarray(indices).reshape(-1), np.dtype(dtype)
    limit, shape = _limit(shape, dtype, "encoded_images"), tuple(int(d) for d in shape)
    if raw.size and raw.dtype.kind not in "iu" and not (
            raw.dtype.kind == "O" and all(isinstance(i, int) for i in raw.tolist())):
        raise ValueError(f"encoded_images: indices must be integers, got dtype {raw.dtype}")
    if raw.size and (int(raw.min()) < 0 or int(raw.max()) >= limit):  # Python ints: no overflow
        raise ValueError(f"encoded_images: indices must lie in [0, {limit}) for samples {shape} of "
                         f"{dtype} (index_limit), got range [{int(raw.min())}, {int(raw.max())}]")
    indices = raw.astype(np.int64)
    if dtype != np.uint8:
        return np.broadcast_to(indices.astype(dtype).reshape((-1,) + (1,) * len(shape)), (len(indices),) + shape).copy()
    images = np.empty((len(indices),) + shape, np.uint8)
    if _planes(shape):
        images[:, 0], images[:, 1] = (indices % 256).reshape((-1, 1, 1)), (indices // 256).reshape((-1, 1, 1))
        y, x = np.mgrid[0:shape[1], 0:shape[2]]
        images[:, 2:] = ((4 * x + 2 * y) % 256)[None, None]
        return images
    flat = _rows(images)
    half = -(-flat.shape[1] // 2)
    flat[:, :half], flat[:, half:] = (indices % 256)[:, None], (indices // 256)[:, None]
    return images


def decode_indices(images: np.ndarray, normalize: Normalize | None = None) -> np.ndarray:
    """The index each delivered sample encodes, int64 (B,); -1 where it encodes none.

    ``images``: one shard's block (B, ...) as delivered. With a ``normalize``, (B, C, H, W) float32 of uint8 samples:
    each value maps to the nearest entry of its channel's table, and encodes nothing a quarter of the table's step or
    more from every entry. Without one, samples are read as stored:

    * uint8 by the byte scheme of ``encoded_images``; each part must be flat (all equal).
    * any other dtype by value: all elements must equal one integer in [0, 2**63) (2.5, -1, inf and NaN encode
      nothing), read exactly (floats through float64, longdouble as it is). A sample of no elements encodes nothing.

    Raises ValueError for images without a batch axis, uint8 samples of fewer than 2 elements, or normalised images that
    are not (B, C, H, W) with normalize's channels."""
    images = np.asarray(images)
    if images.ndim < 1:
        raise ValueError("decode_indices: samples must be (B, ...) with a batch axis, got a scalar")
    if normalize is None and images.dtype != np.uint8:
        flat = _rows(images)
        if not flat.shape[1]:
            return np.full(len(images), -1, np.int64)
        ok, first = np.all(flat == flat[:, :1], axis=1), flat[:, 0]
        if np.issubdtype(flat.dtype, np.integer):  # exactly, not through float64 (int64 > 2**53)
            first = first.astype(np.int64)  # a uint64 of 2**63 or more wraps negative: encodes nothing
            return np.where(ok & (first >= 0), first, -1)
        if flat.dtype.itemsize <= 8:  # float64 holds every value of these exactly
            first = first.astype(np.float64)
        ok &= np.isfinite(first) & (first >= 0) & (first == np.floor(first)) & (first < 2.0**63)
        return np.where(ok, np.where(ok, first, 0).astype(np.int64), -1)
    if normalize is None:
        pixels, near = images.astype(np.int64), np.ones(images.shape, bool)
    else:
        pixels, near = _unnormalize(images, normalize)
    if images.ndim < 2 or int(np.prod(images.shape[1:])) < 2:  # (C >= 3, 0, W) too: planes of no pixel
        raise ValueError(f"decode_indices: uint8 samples need at least 2 elements (two bytes), "
                         f"got images of shape {images.shape}")
    if _planes(images.shape[1:]):
        planes = pixels[:, :2]
        flat = np.all(planes == planes[:, :, :1, :1], axis=(1, 2, 3))
        index, near = planes[:, 0, 0, 0] + 256 * planes[:, 1, 0, 0], near[:, :2]
    else:
        values = _rows(pixels)
        half = -(-values.shape[1] // 2)
        low, high = values[:, :half], values[:, half:]
        flat = np.all(low == low[:, :1], axis=1) & np.all(high == high[:, :1], axis=1)
        index = low[:, 0] + 256 * high[:, 0]
    return np.where(np.all(_rows(near), axis=1) & flat, index, -1)


def _rows(x: np.ndarray) -> np.ndarray:  # (B, ...) as (B, S): reshape(B, -1) cannot tell S when B = 0
    return x.reshape(len(x), int(np.prod(x.shape[1:])))


def _planes(sample_shape: tuple[int, ...]) -> bool:  # whether uint8 samples use the plane scheme
    return len(sample_shape) == 3 and sample_shape[0] >= 3


def _unnormalize(images: np.ndarray, normalize: Normalize) -> tuple[np.ndarray, np.ndarray]:
    """Per element: the uint8 value of the nearest table entry, and whether it is near (decode_indices)."""
    table = normalize.table.astype(np.float64)
    if images.ndim != 4 or table.shape[0] != images.shape[1]:
        raise ValueError(f"decode_indices: with a Normalize of {table.shape[0]} channels, images must be "
                         f"(B, {table.shape[0]}, H, W), got shape {images.shape}")
    values = images.astype(np.float32).astype(np.float64)
    pixels, near = np.empty(images.shape, np.int64), np.empty(images.shape, bool)
    for c in range(images.shape[1]):
        row, plane = table[c], values[:, c]
        step = np.abs(np.diff(row)).min()
        sign = 1.0 if row[1] > row[0] else -1.0  # np.interp needs an increasing table (a std < 0 is not)
        guess = np.rint(np.interp(sign * plane, sign * row, np.arange(256))).astype(np.int64).clip(0, 255)
        pixels[:, c], near[:, c] = guess, np.abs(row[guess] - plane) < step / 4
    return pixels, near
