"""summation.py: the exact sum against its docstring read with Python integers (``grid_sum``), entry for entry, in
every leaf format, in pieces and ``whole``, on one device and through strategies.sum_program on several; the side
channel of NaN and the infinities; the refusals. The controls: a float32 left fold and a psum give other bits."""

import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import loaders
import strategies
import summation
from conftest import assert_same_bits, bits_differ


def rounded(value: Fraction, dtype) -> np.ndarray:
    """``value`` rounded once to ``dtype`` (float32, bfloat16, float16), to nearest even, as
    IEEE 754 says: subnormals on a fixed step, +-Inf past the largest finite value."""
    man, bias, ebits = summation.FORMATS[np.dtype(dtype)]
    if value == 0:
        return np.zeros((), dtype)
    a = abs(value)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e += (Fraction(2) ** (e + 1) <= a) - (Fraction(2) ** e > a)
    step = Fraction(2) ** max(e - man, 1 - bias - man)
    near = round(a / step) * step  # Fraction's round: half to even
    if near >= Fraction(2) ** ((1 << ebits) - 1 - bias):
        return np.asarray(np.copysign(np.inf, float(value)), np.float32).astype(dtype)
    return np.asarray(float(near) if value > 0 else -float(near)).astype(dtype)  # exact: near has few bits


def grid_sum(blocks: np.ndarray) -> np.ndarray:
    """exact_sum's docstring read literally, with Python integers: per entry the sum of the
    blocks' grid values round(x / q), rounded once (blocks (L, m), finite)."""
    up = blocks.astype(np.float32)
    up = np.where(np.abs(up) < 2.0**-126, np.float32(0), up)  # float32's subnormals count as 0
    M = float(np.max(np.abs(up))) if up.size else 0.0
    E = max(math.frexp(M)[1], -125)  # the least E with M < 2**E, at least -125
    q = Fraction(2) ** (E - summation.GRID_BITS)
    return np.array([rounded(sum(round(Fraction(float(x)) / q) for x in column) * q, blocks.dtype)
                     for column in up.T], blocks.dtype)


def exact_cases() -> dict:
    rng = np.random.default_rng(12)
    wide = rng.standard_normal((6, 64)) * 10.0 ** rng.integers(-44, 37, (6, 64))
    ties = np.array([[2.0**24, 1.0, 1.0, 1.0], [1.0, 2.0**24, 3.0, -1.0], [-0.0, 0.0, 0.0, 2.0**-30]], np.float32)
    return {"normal": rng.standard_normal((5, 64)).astype(np.float32),
            "wide range": wide.astype(np.float32),  # 1e-44 .. 1e37: subnormals, and entries below the grid
            "subnormal": (rng.standard_normal((4, 16)) * 1e-40).astype(np.float32),  # all count as 0
            "least normals": (rng.standard_normal((4, 16)) * 2.0**-124).astype(np.float32),  # the largest scaling
            "odd width": (rng.standard_normal((4, 7)) * 10.0 ** rng.integers(-3, 3, (4, 7))).astype(np.float32),
            "overflow": np.array([[3e38, -3e38, 3e38], [3e38, -3e38, -1.0], [1e38, 0.0, 0.0]], np.float32),
            "ties": ties, "signed zeros": np.full((3, 5), -0.0, np.float32),
            "many blocks": (rng.standard_normal((70, 9)) * 10.0 ** rng.integers(-3, 3, (70, 9))).astype(np.float32),
            "bfloat16": rng.standard_normal((6, 32)).astype(jnp.bfloat16),
            "float16": (rng.standard_normal((6, 32)) * 1000).astype(np.float16),
            "float16 tiny": (rng.standard_normal((6, 32)) * 1e-6).astype(np.float16)}


@pytest.mark.bits
@pytest.mark.parametrize("full", [pytest.param(True, marks=pytest.mark.slow), False])
def test_the_exact_sum_is_the_rounding_of_the_sum_of_the_grid_values(devices, full):
    """exact_sum entry for entry against its docstring in Python integers (grid_sum): float32,
    bfloat16 and float16; values from 1e-44 to 3e38, subnormals (counted as 0), the least
    normals (the grid's largest scaling), overflow to +-Inf, ties of the last rounding, blocks
    all -0.0 (+0.0), more blocks than GROUP; in pieces and ``whole``. The same bits through
    sum_program on 1, 2 and 4 devices (L/n blocks each; a leaf's width not a multiple of n
    included) for three of the cases, and three more in the extended tier (``full``, that alone).
    Where every entry is 0 or at least 2**-35 of the largest, it is the correctly rounded sum of
    the blocks themselves. The controls: a float32 left fold of the blocks, and a psum, give
    other bits."""
    cases = exact_cases()
    wants = {name: grid_sum(blocks) for name, blocks in cases.items()}
    for L in sorted({len(blocks) for blocks in cases.values()}) if not full else ():
        tree = {name: blocks for name, blocks in cases.items() if len(blocks) == L}  # a leaf each: one program
        for whole in (False, True):
            got = jax.jit(functools.partial(summation.exact_sum, whole=whole))(tree)
            for name in tree:
                assert_same_bits(np.asarray(got[name]), wants[name], f"{name}, whole" if whole else name)
    for name, blocks in cases.items():
        want = wants[name]
        L = len(blocks)
        spread = name in (("ties", "bfloat16", "wide range") if full else ("normal", "odd width", "many blocks"))
        for n in [n for n in (1, 2, 4) if n <= len(devices) and L % n == 0 and spread]:
            mesh = loaders.data_mesh(devices[:n])
            rounds = [jax.device_put(blocks.reshape(n, L // n, -1)[:, i], NamedSharding(mesh, P("data")))
                      for i in range(L // n)]
            assert_same_bits(np.asarray(strategies.sum_program(mesh, L // n)(rounds).addressable_data(0)), want,
                             f"{name}, {n} devices")
    if full:
        return
    blocks = exact_cases()["normal"]
    exact = [rounded(sum(Fraction(float(x)) for x in column), np.float32) for column in blocks.T]
    assert_same_bits(grid_sum(blocks), np.array(exact, np.float32), "the correctly rounded sum")
    wide = exact_cases()["wide range"]
    folded = functools.reduce(np.add, wide)
    assert bits_differ(folded, grid_sum(wide)) is not None, "control: a left fold"
    mesh = loaders.data_mesh(devices[:2])
    psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(jnp.sum(x, 0), "data"), mesh=mesh, in_specs=P("data"),
                                 out_specs=P()))(jax.device_put(wide, NamedSharding(mesh, P("data"))))
    assert bits_differ(np.asarray(psum), grid_sum(wide)) is not None, "control: a psum"


@pytest.mark.bits
def test_nan_and_infinities_take_their_side_channel_and_padding_sums_to_plus_zero(devices):
    """Per entry: a NaN in any block, or +Inf in one block and -Inf in another, gives NaN
    (float32 0x7fc00000, bfloat16 0x7fc0, float16 0x7e00); +Inf or -Inf alone, that infinity;
    the other entries sum as without them. Blocks of padding (all zeros, or -0.0) give +0.0.
    On 1, 2 and 4 devices alike (on 4, a block each: the floats move, not the limbs), and
    ``whole``; the
    control: a float32 sum of the same blocks gives another NaN only by chance, and the finite
    entries' sums are held against grid_sum."""
    nan_bits = {np.float32: 0x7FC00000, jnp.bfloat16: 0x7FC0, np.float16: 0x7E00}
    for dtype, pattern in nan_bits.items():
        blocks = np.ones((4, 6), np.float32)
        blocks[1, 0], blocks[2, 1], blocks[3, 1], blocks[0, 2], blocks[1, 3] = np.nan, np.inf, -np.inf, np.inf, -np.inf
        blocks = blocks.astype(dtype)
        for n in (1, 2, 4):
            mesh = loaders.data_mesh(devices[:n])
            rounds = [jax.device_put(blocks.reshape(n, 4 // n, 6)[:, i], NamedSharding(mesh, P("data")))
                      for i in range(4 // n)]
            got = np.asarray(strategies.sum_program(mesh, 4 // n)(rounds).addressable_data(0))
            unsigned = got.view(np.uint32 if got.itemsize == 4 else np.uint16)
            assert list(unsigned[:2]) == [pattern] * 2, (dtype, n, [hex(x) for x in unsigned])
            assert got[2] == np.inf and got[3] == -np.inf, (dtype, n, got)
            assert_same_bits(got[4:], grid_sum(blocks[:, 4:]), f"{dtype}, the finite entries")
        got = np.asarray(jax.jit(functools.partial(summation.exact_sum, whole=True))(blocks))
        assert list(got[:2].view(unsigned.dtype)) == [pattern] * 2 and got[2] == np.inf and got[3] == -np.inf, got
        assert_same_bits(got[4:], grid_sum(blocks[:, 4:]), f"{dtype}, whole, the finite entries")
    for padding in (np.zeros((3, 4), np.float32), np.full((3, 4), -0.0, np.float32)):
        for whole in (False, True):
            got = np.asarray(jax.jit(functools.partial(summation.exact_sum, whole=whole))(padding))
            assert not np.signbit(got).any() and not got.any(), (whole, got)


@pytest.mark.bits
@pytest.mark.parametrize("full", [pytest.param(True, marks=pytest.mark.slow), False])
def test_a_leaf_in_pieces_sums_to_the_same_bits(devices, monkeypatch, full):
    """A leaf wider than PIECE is made into limbs, moved and rounded a piece at a time: with PIECE = 8, entry for entry
    grid_sum's bits, on one device (pieces of 8, the last shorter) and through sum_program on 2 and 4 devices (pieces
    a multiple of n, the last padded; at a block a device the scaled floats move), a NaN and the infinities in a piece
    past the first included. The default tier: two cases (8 pieces; 70 blocks in 2), the specials on 2 devices; the
    extended (``full``): three more, the specials on 1 and 4."""
    monkeypatch.setattr(summation, "PIECE", 8)
    cases = exact_cases()
    for name in ("normal", "odd width", "float16") if full else ("wide range", "many blocks"):
        blocks, want = cases[name], grid_sum(cases[name])
        assert_same_bits(np.asarray(jax.jit(lambda b: summation.exact_sum(b))(blocks)), want, f"{name}, pieces")
        L = len(blocks)
        for n in [n for n in (2, 4) if n <= len(devices) and L % n == 0]:
            mesh = loaders.data_mesh(devices[:n])
            rounds = [jax.device_put(blocks.reshape(n, L // n, -1)[:, i], NamedSharding(mesh, P("data")))
                      for i in range(L // n)]
            got = strategies.sum_program.__wrapped__(mesh, L // n)(rounds).addressable_data(0)
            assert_same_bits(np.asarray(got), want, f"{name}, pieces, {n} devices")
    blocks = np.ones((4, 22), np.float32)
    blocks[1, 17], blocks[2, 18], blocks[3, 18], blocks[0, 19] = np.nan, np.inf, -np.inf, -np.inf
    for n in [n for n in ((1, 4) if full else (2,)) if n <= len(devices)]:
        mesh = loaders.data_mesh(devices[:n])
        rounds = [jax.device_put(blocks.reshape(n, 4 // n, 22)[:, i], NamedSharding(mesh, P("data")))
                  for i in range(4 // n)]
        got = np.asarray(strategies.sum_program.__wrapped__(mesh, 4 // n)(rounds).addressable_data(0))
        assert list(got[17:19].view(np.uint32)) == [0x7FC00000] * 2 and got[19] == -np.inf, (n, got[16:20])
        assert_same_bits(np.delete(got, [17, 18, 19]), np.full(19, 4, np.float32), f"pieces, specials, {n} devices")


def test_a_leaf_the_exact_sum_cannot_round_to_is_refused():
    """float64 (x64) and integer leaves are refused naming exact_sum and the dtype, ``whole``
    with an axis naming the axis (canonical_step's MAX_BLOCKS: test_strategies.py)."""
    with pytest.raises(ValueError, match=r"exact_sum: a gradient leaf of dtype int32"):
        summation.exact_sum({"w": jnp.zeros((2, 3), jnp.int32)})
    with pytest.raises(ValueError, match=r"exact_sum: whole=True sums on one device; axis='data'"):
        summation.exact_sum({"w": jnp.zeros((2, 3))}, "data", whole=True)
