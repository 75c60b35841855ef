"""The exact sum of L blocks' gradients (``exact_sum``): every entry of a leaf onto one grid, as an integer in K int32
limbs, the limbs added as integers (in any order, on any number of devices), the total rounded once. strategies.py's
canonical reduction adds its blocks with it (``sum_program``, ``loop_program``); it stands alone, over any pytree of
(k, ...) float32, bfloat16 or float16 leaves, on one device or inside a shard_map over ``axis``."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

LIMB_BITS = 20  # w: bits per limb below the top one
LIMBS = 3  # K: int32 limbs per entry, value bits 0..59
GRID_BITS = 59  # p: the grid's step is 2**(E - p), 2**E the least power of two above the leaf's largest |entry|
MAX_BLOCKS = 2047  # the largest L: each limb's sum over L blocks, and its carry, stay inside int32
PIECE = 1 << 20  # the most entries of a leaf whose limbs are made, moved and rounded at once
GROUP = 32  # the most slices of a device's blocks read side by side in one pass (beyond, a slice holds several)
# Leaf dtypes the sum rounds to: (significand bits stored, exponent bias, exponent bits)
FORMATS = {np.dtype(np.float32): (23, 127, 8), np.dtype(jnp.bfloat16): (7, 127, 8), np.dtype(np.float16): (10, 15, 5)}
_MASK = (1 << LIMB_BITS) - 1
_INF = 0x7F800000  # float32 +Inf's bits: |x|'s bits at or above it are an infinity or a NaN


def exact_sum(blocks, axis: str | None = None, whole: bool = False):
    """Each leaf's blocks (k, ...) summed over k, and over ``axis``'s devices inside a shard_map: the sum of the grid
    values, exact, rounded once to the leaf's dtype. In any order, on any number of devices, the same bits:

        x = each entry as float32, 0 where |x| < 2**-126 (float32's subnormals)
        M = max |x| over every block's finite entries of the leaf (an exact max; 0 if none)
        E = the least integer with M < 2**E, at least -125
        q = 2**(E - 59)                                      # the leaf's grid
        for each entry: v = sum over blocks l of round(x_l / q), half to even (exact integers, |v| < L * 2**59)
        the result: v * q rounded once to the dtype, to nearest even (+-Inf past its range; +0.0 for v = 0)

    So where every block's entry is 0 or at least 2**-35 * M in magnitude (its 24 bits then sit on the grid: p = 35),
    the result is the correctly rounded sum of the blocks; otherwise it is off that by at most L * q / 2. Integer zero
    has no sign: blocks all -0.0 give +0.0. An entry with a NaN in some block, or +Inf in one and -Inf in another,
    is NaN (float32 0x7fc00000, bfloat16 0x7fc0, float16 0x7e00); +Inf or -Inf alone, that infinity.

    How: each integer as K = 3 int32 limbs (``_to_limbs``: float operations that are exact), so L blocks' limbs, and
    their carries, stay inside int32 for L <= 2047 (MAX_BLOCKS). An entry that would land below 2**-126 on the way to
    the grid rounds to 0 whether or not the backend flushes it. That is why subnormal entries count as 0: XLA's CPU and
    TPU arithmetic flushes them, a GPU's need not, and the grid's multiplies must read the same numbers everywhere. M is
    the max of |x|'s bits as integers (their order is |x|'s; a subnormal max gives E = -125, as 0 does), so one pass
    over the blocks finds it and whether a NaN or an infinity is there; a second finds the finite M, only in a step that
    has one. Each device reads its blocks in place (up to GROUP slices side by side) and, entry by entry, adds their
    limbs; it carries (arithmetic shifts) and rounds 1/n of the entries, by integer operations alone (no float sum of
    limbs, which would round more than once); ``sum_program`` says what moves. A leaf goes a piece of at most PIECE
    entries at a time (scaled, moved, made into limbs, rounded), each piece scaled only once the last piece is rounded
    (``_after``): else XLA makes every piece's limbs first, and on CPUs a buffer that large (12 bytes an entry) is
    mapped anew, page by page, every call (on 8 CPU devices at L = 8n, 330 MiB of page faults a call; the sum took
    1.7x as long; at L = n a whole leaf's moved floats held a device at 1.5x a plain step's memory). One scale per
    leaf, not per entry: an entry-wise max would be an all-reduce of a whole gradient, a per-leaf one is a scalar.
    With ``whole`` (one device only: ``loop_program``'s sum, a chip's) each leaf goes at once, every limb its own sum
    over the blocks, and the side channel is always counted: the same bits, and on a TPU v5e the MLP's canonical step
    1.2-2.2x faster than in pieces (whose chains and conds keep CPUs' buffers small, and cost a TPU more than they
    save).
    K = 3 limbs move 3x a float32 all-reduce's bytes; a fourth would give p = 55 at 4x. The non-finite entries go by a
    side channel, counted and moved only in a step that has one. Leaves: float32, bfloat16, float16 (FORMATS);
    ValueError for another dtype."""
    leaves, tree = jax.tree.flatten(blocks)
    for x in leaves:
        if np.dtype(x.dtype) not in FORMATS:
            raise ValueError(f"exact_sum: a gradient leaf of dtype {x.dtype}; the canonical reduction sums "
                             f"{sorted(str(d) for d in FORMATS)} leaves (a float64 significand needs more limbs)")
    if whole:
        if axis is not None:
            raise ValueError(f"exact_sum: whole=True sums on one device; axis={axis!r}")
        return jax.tree.unflatten(tree, [_whole(x) for x in leaves])
    n = 1 if axis is None else lax.axis_size(axis)
    padded = lambda x, d: jnp.pad(x, [(0, -x.shape[d] % n if i == d else 0) for i in range(x.ndim)])
    # at k = 1 move the floats, not the limbs (a third of the bytes, the same sums); at k > 1 the all_to_all's
    # chunks of (k, entries) are strided, and XLA copies them: the limbs' reduce-scatter costs less
    moved = axis is not None and leaves and leaves[0].shape[0] == 1
    scatter = (lambda x: x) if axis is None or moved else (
        lambda x: lax.psum_scatter(padded(x, 0), axis, scatter_dimension=0, tiled=True))

    def sliced(x):  # at most GROUP slices (G, entries) of blocks (k, ...), each a block where it lies if G = 1
        G = -(-x.shape[0] // GROUP)
        x = jnp.pad(x, [(0, -x.shape[0] % G)] + [(0, 0)] * (x.ndim - 1))  # zero blocks add nothing
        return [x[i:i + G].astype(jnp.float32).reshape(G, -1) for i in range(0, x.shape[0], G)]
    rows = [sliced(x) for x in leaves]  # per leaf, this device's blocks where they lie (a cond's operands as they are)
    magnitude = lambda x: lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF  # ordered as |x|; NaN, Inf: >= _INF
    largest = lambda keep, rows: jnp.stack([jnp.max(functools.reduce(jnp.maximum, (keep(magnitude(x)) for x in r)),
                                                    initial=0) for r in rows])
    every = (lambda m: m) if axis is None else (lambda m: lax.pmax(m, axis))
    top = every(largest(lambda m: m, rows))
    specials = jnp.any(top >= _INF)
    E = _grid_exponent(lax.cond(specials, lambda rows: every(largest(lambda m: jnp.where(m < _INF, m, 0), rows)),
                                lambda rows: top, rows))

    def rounded(limbs, r, E, a: int, b: int, man: int, bias: int, ebits: int, special: bool):
        bits = _from_limbs([limbs[:, j] for j in range(LIMBS)], E, man, bias, ebits)
        if not special:
            return bits
        r = sliced(r[0]) if moved else [x[:, a:b] for x in r]  # scaled or not, a NaN and an infinity stay so
        count = lambda found: jnp.sum(sum(found(x).astype(jnp.int32) for x in r), 0, dtype=jnp.int32)
        # per entry, over every block and device: NaNs, and +Inf + 2**16 * -Inf
        nan, inf = scatter(jnp.stack([count(jnp.isnan), count(lambda x: x == np.inf) + (
            count(lambda x: x == -np.inf) << 16)], 1)).T
        return _special(bits, nan > 0, (inf & 0xFFFF) > 0, (inf >> 16) > 0, man, ebits)
    out, last = [], None
    for i, (leaf, r) in enumerate(zip(leaves, rows)):
        man, bias, ebits = FORMATS[np.dtype(leaf.dtype)]
        width = r[0].shape[1]
        step = 1 if axis is None else n  # a piece's entries: a multiple of what the collective splits
        size = -(-width // (-(-width // PIECE) * step)) * step
        values = []
        for a in range(0, width, size):  # a leaf a piece at a time: each piece's buffers die before the next's
            b = a + size
            e = E[i] if last is None else _after(E[i], last)
            if moved:  # each device gets every block's own 1/n of the piece's entries, scaled: (n*k, size/n)
                z = lax.all_to_all(padded(_scaled(r[0][:, a:b], e), 1), axis, 1, 0, tiled=True)
                parts, blocks = sliced(z), [z]
            else:
                parts, blocks = [_scaled(x[:, a:b], e) for x in r], r
            limbs = scatter(jnp.sum(sum(_to_limbs(z) for z in parts), 0, dtype=jnp.int32))  # (entries, K)
            # limbs go in whole (a cond's operand): fused into the rounding, XLA would make each block's limbs again
            bits = lax.cond(specials, *(functools.partial(rounded, a=a, b=b, man=man, bias=bias, ebits=ebits,
                                                          special=special) for special in (True, False)),
                            limbs, blocks, e)
            last = bits
            bits = bits if ebits + man == 31 else bits.astype(jnp.uint16)  # 16-bit formats: bits in [0, 2**16)
            value = lax.bitcast_convert_type(bits, leaf.dtype)
            values.append(value if axis is None else lax.all_gather(value, axis, tiled=True))
        value = values[0] if len(values) == 1 else jnp.concatenate(values)
        out.append(value[:int(np.prod(leaf.shape[1:]))].reshape(leaf.shape[1:]))
    return jax.tree.unflatten(tree, out)


def _whole(x):
    """exact_sum of a leaf's blocks (k, ...) on one device, the leaf at once: its max, each limb's sum, the rounding."""
    shape, dtype, (man, bias, ebits) = x.shape[1:], x.dtype, FORMATS[np.dtype(x.dtype)]
    x = x.astype(jnp.float32).reshape(x.shape[0], -1)
    finite = jnp.isfinite(x)
    E = _grid_exponent(lax.bitcast_convert_type(jnp.max(jnp.where(finite, jnp.abs(x), 0), initial=0), jnp.int32))
    z = jnp.where(finite, _scaled(x, E), 0)
    bits = _from_limbs([jnp.sum(limb.astype(jnp.int32), 0, dtype=jnp.int32) for limb in _limbs(z)], E, man, bias, ebits)
    inf = lambda sign: jnp.any(x == sign * np.inf, 0)
    bits = _special(bits, jnp.any(jnp.isnan(x), 0), inf(1), inf(-1), man, ebits)
    return lax.bitcast_convert_type(bits if ebits + man == 31 else bits.astype(jnp.uint16), dtype).reshape(shape)


def _after(E, done):
    """E, an int32 grid exponent (>= -125), read only once ``done`` (int32, at least one entry) is: max(E, min(done's
    first entry, -1000)) is E, a fact XLA does not see. So it cannot convert a piece before the last piece is rounded,
    and the pieces' limbs take turns in one buffer."""
    return jnp.maximum(E, jnp.minimum(done.reshape(-1)[0], -1000))


def _special(bits, nan, pos, neg, man: int, ebits: int):
    """The rounded bits, where an entry had a NaN (``nan``), or +Inf (``pos``) and -Inf (``neg``), made the stated
    NaN; where one infinity alone, that infinity."""
    top = ((1 << ebits) - 1) << man
    bits = jnp.where(pos, top, jnp.where(neg, top | _bit(ebits + man), bits))
    return jnp.where(nan | (pos & neg), top | (1 << (man - 1)), bits)


def _bit(n: int):
    """int32 with bit n alone set (bit 31: the sign)."""
    return np.array(1 << n, np.uint32).view(np.int32)[()]


def _shift(x, t):
    """x * 2**t for t >= 0, floor(x / 2**-t) for t < 0 (int32 x >= 0, low 32 bits); 0 past 31 either way."""
    left = lax.shift_left(x, jnp.clip(t, 0, 31))
    right = lax.shift_right_logical(x, jnp.clip(-t, 0, 31))
    return jnp.where(t >= 32, 0, jnp.where(t >= 0, left, jnp.where(t <= -32, 0, right)))


def _grid_exponent(bits):
    """E with m < 2**E from the bits of float32 m >= 0 (finite): 2**(e-127) <= m < 2**(e-126) for exponent field e;
    -125 for e = 0 (m zero or subnormal)."""
    return jnp.maximum(lax.shift_right_logical(bits, 23), 1) - 126


def _scaled(x, E):
    """float32 x, |x| < 2**E where finite -> z = x * 2**(19 - E), exact, by two powers of two, each within float32's
    range (a product that would land below 2**-126 is one far under the grid's step, 0 to it whether or not the
    backend flushes it); subnormal x read as 0, a NaN or an infinity stays one. ``_to_limbs`` takes z."""
    x = jnp.where(jnp.abs(x) < np.float32(2.0 ** -126), 0, x)
    d = GRID_BITS - 2 * LIMB_BITS - E
    return x * _power_of_two(d // 2) * _power_of_two(d - d // 2)


def _to_limbs(z):
    """z = ``_scaled`` x (..., m), finite -> int32 (..., m, K) [low, mid, top]: v = round(x / 2**(E - GRID_BITS)),
    half to even, = top * 2**40 + mid * 2**20 + low, each limb rounded to nearest (|limb| <= 2**19): top = round(z),
    mid = round((z - top) * 2**20), low = round(((z - top) * 2**20 - mid) * 2**20). Every float operation is exact
    (products by powers of two; differences that leave a number's own low bits), and as top * 2**40 and mid * 2**20
    are even, rounding the rest half to even rounds v so. The limbs' axis is last, so one pass over the blocks reads
    each entry once."""
    z = jnp.broadcast_to(z[..., None], z.shape + (LIMBS,))
    low, mid, top = _limbs(z)
    limb = lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    return jnp.where(limb == 0, low, jnp.where(limb == 1, mid, top)).astype(jnp.int32)


def _limbs(z):
    """``_to_limbs``' arithmetic, as three float32 arrays of integers: [low, mid, top]."""
    nearest = functools.partial(lax.round, rounding_method=lax.RoundingMethod.TO_NEAREST_EVEN)
    top = nearest(z)
    rest = (z - top) * np.float32(2.0 ** LIMB_BITS)
    mid = nearest(rest)
    return [nearest((rest - mid) * np.float32(2.0 ** LIMB_BITS)), mid, top]


def _power_of_two(e):
    """float32 2**e for int32 e in [-126, 127], from its bits."""
    return lax.bitcast_convert_type(lax.shift_left(e + 127, 23), jnp.float32)


def _carried(S):
    """Limbs of any sign -> the same value with every limb but the top in [0, 2**20) (arithmetic shifts)."""
    out, carry = [], jnp.zeros_like(S[0])
    for i in range(LIMBS - 1):
        v = S[i] + carry
        carry = lax.shift_right_arithmetic(v, LIMB_BITS)
        out.append(v & _MASK)
    return out + [S[LIMBS - 1] + carry]


def _from_limbs(S, E, man: int, bias: int, ebits: int):
    """K summed limbs, each (m,) -> the bits (int32) of v * 2**(E - GRID_BITS), v = sum_i S[i] * 2**(20 i), rounded
    once to nearest even in the format of ``man`` stored significand bits, ``bias`` and ``ebits`` exponent bits."""
    D = _carried(S)
    negative = D[-1] < 0
    D = _carried([jnp.where(negative, -d, d) for d in D])  # |v|
    length = [32 - lax.clz(d) for d in D]
    h = jnp.where(D[2] > 0, 2 * LIMB_BITS + length[2], jnp.where(D[1] > 0, LIMB_BITS + length[1], length[0])) - 1
    s = jnp.maximum(h - man, 1 - bias - man - (E - GRID_BITS))  # the significand's lowest bit (subnormals: fixed)
    sig = sum(_shift(D[i], LIMB_BITS * i - s) for i in range(LIMBS))
    rb = jnp.where(s >= 1, sum(_shift(D[i], LIMB_BITS * i - s + 1) & 1 for i in range(LIMBS)), 0)
    sticky = jnp.zeros(sig.shape, bool)
    for i in range(LIMBS):  # a bit of |v| below s - 1
        keep = s - 1 - LIMB_BITS * i
        low = D[i] & (lax.shift_left(jnp.int32(1), jnp.clip(keep, 0, 31)) - 1)
        sticky |= jnp.where(keep >= 32, D[i] != 0, low != 0)
    sig = sig + (rb & (sticky.astype(jnp.int32) | (sig & 1)))
    carried = sig >= (1 << (man + 1))
    sig, s = jnp.where(carried, lax.shift_right_logical(sig, 1), sig), s + carried.astype(jnp.int32)
    exponent = man + s + E - GRID_BITS + bias
    top = (1 << ebits) - 1
    bits = jnp.where(sig >= (1 << man), lax.shift_left(jnp.clip(exponent, 0, top), man) | (sig & ((1 << man) - 1)), sig)
    bits = jnp.where(exponent >= top, top << man, bits)
    return jnp.where(h < 0, 0, bits | jnp.where(negative, _bit(ebits + man), 0))
