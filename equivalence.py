"""How far apart two trainings may end: the strategies' bound, measured, and its verdict.

strategies.py runs the same data-parallel training four ways; they differ only in
the order in which some sums are added, so their final params may differ by
rounding. This module says by how much, and judges a pair:

* ``ulp_bound`` is the count: roundings a step by which two strategies may
  differ (a model of where their summation orders differ, checked against
  measurement; not a worst-case proof).
* ``twin_growth`` measures how a difference grows over one training: a reference
  run and two twins moved a few ulps apart, vmapped, on the mesh. ``Growth``
  holds what it measured and says where no bound is derived (``outside``).
* ``verdict`` turns count x growth into the bound on each leaf of the final
  params and says "identical", "within", "OUTSIDE", or "outside the domain where
  a bound is derived" (where a rounding difference and a real bug end alike).
  ``leaf_ulps`` and ``ulps_apart`` are its distances.

Guarantees (test_equivalence.py): pmap and shard_map end bit-identical on CPU
with SGD (the same program); every pair of strategies ends within the bound
``verdict`` derives on the models and rates tested there, and each planted bug
(a dropped device, a mis-scaled gradient) is OUTSIDE at ordinary rates.

Imports: strategies.py (to run the twins with the sharded program), NumPy and JAX.
Imported by refimpl.py and the tests.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import strategies
from strategies import AXIS, LossTerms, Optimizer, Params

# --------------------------------------------------------------------------
# The count: roundings a step
# --------------------------------------------------------------------------


def ulp_bound(a: str, b: str, platform: str, num_devices: int) -> int:
    """The count: roundings a step by which strategies ``a`` and ``b`` may differ, with SGD.

    ``verdict`` turns it into the bound on the final params: count x the measured
    growth of a difference, summed over the steps, per leaf (``twin_growth``). The
    unit of a rounding is the ulp of the scale its numbers had (``Growth``): the
    largest of the leaf's magnitudes and of lr x sum_k |g_k|, the row blocks' gradients
    (a reordered sum is off relative to the size of its terms, not of its result, so
    an entry near zero, or a bias whose terms cancel, can differ by more than its own
    ulp). The counts hold at matmul precision "highest" (what the tests set). At
    NVIDIA's default for float32 matmuls, TF32, each dot rounds its inputs to 10-bit
    mantissas and the strategies drift apart by about 1e-3 relative: far more.

    How they are derived. Each SGD step computes p - lr * g from the same global
    masked gradient g; two strategies differ only in the order in which some
    stage adds g's terms. The rule used: every stage whose summation order
    differs can move the once-rounded result p - lr * g to a neighbouring float,
    1 unit per stage and step; an all-reduce whose order the collective library
    chooses (NCCL, RCCL) is n - 1 such stages. This counts roundings: it is a
    model, checked against measurement below, not a worst-case proof (a
    worst-case bound for an m-term sum, (m - 1) units, is tens of units here and
    would hide real bugs). Counting, n = ``num_devices``, "cpu" one platform, every
    other platform counted as a GPU:

    * the same strategy: 0.
    * pmap and shard_map (since JAX 0.8 pmap is jit of shard_map, with the same
      explicit psum): no stage differs, 0 on CPU; on GPUs the all-reduce order
      may differ between two programs, n.
    * sharded vs pmap/shard_map: XLA partitions the jit step itself and may pick
      other local dot kernels, so the per-device B-term sums may be added in
      another order: 1 on CPU; n on GPUs (the all-reduce as well).
    * any vs single: single adds the n*B terms in one pass, the others B per
      device, then n partial sums: two stages differ, 2 on CPU; on GPUs the
      all-reduce adds n - 1 more, n + 1.

    Measured on 8 CPU devices (JAX 0.10.2, ``python test_equivalence.py drift``: 42
    random runs of 1-8 steps with uneven masks, the MLP and the linear model, rates
    1e-3 to 0.1): every pair ended within 0.50 of its bound, pmap and shard_map
    bit-identical; 3 x 42 runs of sharded against single, rates up to 0.5: within 0.75. In the leaf's own ulps (``ulps_apart``,
    no growth, no term scale) the linear model's zero-initialised bias reached 3.8
    ulps a step against single, 3 after one step: the unit, not the count, is what a
    leaf of cancelling terms needs. GPU counts are derived only; not measured.

    Only for SGD, whose step moves a rounding difference into the params once.
    Measured the same way with optax's optimizers, in ``ulps_apart``'s ulps a step:

    * ``optax.sgd(lr, momentum=0.9)`` (v = g + 0.9 v, p += -lr v): pmap vs shard_map
      0, sharded vs them <= 0.5, any vs single <= 3.25 (the linear model's bias). The
      SGD count does not carry over, though: a step's gradient difference stays in the
      velocity and reaches the params again at every later step, with total weight up
      to 1 / (1 - beta), so the same counting gives ``ulp_bound / (1 - beta)`` a step
      (20 against single here); test_equivalence.py holds momentum to that.
    * ``optax.adam(lr)`` (non-linear: each entry divided by its own running
      magnitude): pmap vs shard_map up to 25 (the update's element-wise arithmetic is
      compiled into each program separately), sharded vs them 81, any vs single up to
      12,333 on the MLP, where an entry whose gradient is rounding noise moves by about
      the learning rate whichever way the noise falls. In absolute terms: within
      1.6e-4 x lr a step between the parallel strategies and 7.4e-3 x lr a step against
      single on the MLP, 1.5e-5 x lr on the linear model (test_equivalence.py allows
      1e-3 x lr there). No count is derived for Adam.
    """
    pair = frozenset((a, b))
    cpu = platform == "cpu"
    n = num_devices
    if len(pair) == 1:
        return 0
    if "single" in pair:
        return 2 if cpu else n + 1
    if pair == {"pmap", "shard_map"}:
        return 0 if cpu else n
    return 1 if cpu else n


def ulps_apart(a: Params, b: Params) -> float:
    """Largest |a - b| over all leaves, in ulps of each leaf's largest magnitude: the
    largest of ``leaf_ulps``."""
    each = leaf_ulps(a, b)
    return float(np.nan) if np.isnan(each).any() else float(each.max(initial=0.0))


def leaf_ulps(a: Params, b: Params, scale=None) -> np.ndarray:
    """(leaves,) float64: per leaf (``jax.tree.leaves`` order), max |a - b| in ulps of the
    leaf's largest magnitude, ``np.spacing`` of max(|a|, |b|) over the leaf (and of
    ``scale[l]`` if given, if larger), in float64 for float64 leaves and in float32 for
    every other dtype (values converted to it); 0 for an empty leaf, NaN where a NaN
    meets a number or another NaN."""
    out = []
    for l, (x, y) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b))):
        dtype = np.float64 if np.asarray(x).dtype == np.float64 else np.float32
        x, y = np.asarray(x, dtype), np.asarray(y, dtype)
        if not x.size:
            out.append(0.0)
            continue
        big = max(np.abs(x).max(), np.abs(y).max(), 0.0 if scale is None else scale[l])
        out.append(float(np.abs(x.astype(np.float64) - y).max() / np.spacing(dtype(big))))
    return np.array(out, np.float64)


TWIN_ULPS = 64  # the twins' perturbation, in leaf_ulps' unit
TERM_BLOCKS = 2  # row blocks per device whose gradients twin_growth sums in absolute value
MAX_OFF_CENTRE = 0.25  # the domain's edges (Growth.outside)
MAX_TWIN_ULPS = 2.0**16


class Growth(NamedTuple):
    """How a difference grows over one training, leaf by leaf: what ``twin_growth`` measured.

    The unit of leaf l after step t is the ulp (np.spacing, the leaf's dtype) of
    ``scale[l]`` so far: the largest of the magnitudes the reference's leaf l has
    held at steps 0..t and of the updates the optimizer makes, at steps 1..t, from
    sum_k |g_k|, g_k the gradient of row block k alone, the batch's rows cut into
    TERM_BLOCKS (2) blocks per device (for SGD lr x sum_k |g_k|: at least the size of
    any partial sum of those blocks, in any order; the classical scale of a sum's
    rounding, sum_i |g_i| over single rows, with blocks of rows in place of rows, one
    gradient per block held). A rounding is relative to the numbers that went into
    it: a leaf whose gradient is a cancelling sum (a bias started at 0: its rows'
    terms cancel to a small result) is rounded at the scale of its terms, and a leaf
    that returns toward zero does not count its past roundings in ever smaller ulps.
    ``scale[l]``: that magnitude after the last step. ``distances[i, l, t]``: twin i's
    distance from the reference in leaf l after step t (t = 0: the perturbation
    itself), in that unit. ``off_centre``: after the last step T, the largest over the
    leaves of |(a_T - r_T) + (b_T - r_T)| over the sum of the two twins' largest
    distances in all leaves, a and b the twins started at +delta and -delta, r the
    reference: 0 where the difference propagates linearly (the twins end opposite),
    up to 1 where it does not (0 if both twins end on the reference)."""
    distances: np.ndarray  # (2, leaves, steps + 1) float64
    off_centre: float
    scale: np.ndarray  # (leaves,)

    @property
    def steps(self) -> int:
        return self.distances.shape[-1] - 1

    def factors(self) -> np.ndarray:
        """(leaves, steps) float64: G[l, t - 1] for t = 1..T, how much a difference in leaf l
        after step t may grow by the end: the larger over the two twins of
        max(1, max_{t<=s<=T} e_s / e_t), e that twin's distances in leaf l (e_t = 0: 1 if
        every later e_s is 0, else inf)."""
        e = self.distances
        later = np.maximum.accumulate(e[..., ::-1], axis=-1)[..., ::-1]  # max over s >= t
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(e > 0, later / np.where(e > 0, e, 1), np.where(later > 0, np.inf, 1.0))
        return np.maximum(1.0, ratio.max(axis=0)[:, 1:])

    def outside(self) -> str | None:
        """Why no bound is derived, or None inside the domain. The domain's edges:

        * every G finite (a twin that met the reference and left it again: no);
        * the twins stayed small against the params: no distance above MAX_TWIN_ULPS,
          2**16 ulps, 2**-8 to 2**-7 of a leaf's largest magnitude (a growth of 2**10
          from the 64-ulp start). Beyond it the linearisation the bound rests on has
          no footing, and a bound that large admits real bugs as rounding;
        * the propagation was linear: ``off_centre`` <= MAX_OFF_CENTRE, 1/4, or the
          twins ended no farther from the reference than they started, in every leaf
          (nothing grew that could be non-linear)."""
        start, largest = self.distances[..., 0].max(initial=0.0), self.distances.max(initial=0.0)
        if not np.isfinite(self.factors()).all():
            return "a twin met the reference and left it again"
        if largest > MAX_TWIN_ULPS:
            return (f"a difference of {start:.0f} ulps grew to {largest:.3g}, beyond "
                    f"{MAX_TWIN_ULPS:.0f} (2**-8 to 2**-7 of the params)")
        grew = (self.distances[..., -1] > self.distances[..., 0]).any()
        if grew and self.off_centre > MAX_OFF_CENTRE:
            return (f"a difference of {start:.0f} ulps grew to {largest:.3g} and not linearly (the "
                    f"twins ended {self.off_centre:.2f} off centre, more than {MAX_OFF_CENTRE})")
        return None

    def bound(self, count: float) -> np.ndarray | None:
        """(leaves,) float64, the bound on each leaf of the final params, in ulps: count x
        sum_t G[l, t] (count x steps where nothing grows); zeros for a count of 0; None
        outside the domain (``outside``)."""
        if count == 0:
            return np.zeros(self.distances.shape[1])
        if self.outside() is not None:
            return None
        return count * self.factors().sum(axis=1)


def twin_growth(params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms,
                optimizer: Optimizer = strategies.sgd(), opt_state=None, ulps: float = TWIN_ULPS,
                seed: int = 0) -> Growth:
    """Measures how a difference grows over this training: a reference run and two twins.

    Why. Two strategies differ by rounding: after step t, p'_t = p_t + d_t with
    d_{t+1} = J_t d_t + r_{t+1}, J_t the Jacobian of one step (I - lr H_t for SGD,
    H_t the loss's Hessian) and r_t at most ``ulp_bound``'s count c of ulps in each
    leaf. So d_T = sum_t J_{T-1} ... J_t r_t: a rounding at step t is multiplied by
    the steps after it. Where lr x curvature stays below about 1 the product stays
    near 1 and the count alone bounds the end (c x T); above it the product grows,
    exponentially in the steps, and c x T no longer holds. The unit moves too: a
    leaf whose largest magnitude shrinks (a bias near zero) counts the same
    difference in more ulps.

    What is run, on ``mesh`` with the ``sharded`` program (jit, state replicated,
    batches sharded on 'data', so across processes too): three copies of the
    training from the same optimizer state (``opt_state`` or ``optimizer.init``),
    one step each on each batch of ``batches`` (layout "sharded"), vmapped: the
    reference from ``params``, and twins from params + delta and params - delta,
    where delta moves every entry of each leaf by ``ulps`` ulps of that leaf's
    largest magnitude (np.spacing in the leaf's dtype), signs drawn once by
    ``np.random.default_rng(seed)``, rounded to the leaf's dtype. After each step each
    twin's distance from the reference is recorded, leaf by leaf, and the unit it is
    counted in (``Growth``): at the reference, the optimizer's update is also computed
    from sum_k |g_k| over the batch's row blocks (every batch key is (n*B, ...) in
    layout "sharded"; each device computes its own blocks), the scale at which a
    reordered sum rounds.

    ``Growth.factors`` estimates G[l, t], the growth of leaf l from step t to the
    end, from the twins' distances; the bound on leaf l of the final params is
    c x sum_t G[l, t] (``Growth.bound``). It is measured along the twins'
    directions, not proven for every direction: random signs over every entry,
    like rounding differences. The propagation argument is linear, for small
    differences; ``Growth.outside`` says where the twins showed it did not hold.
    There a difference of a few ulps has grown until it no longer behaves like a
    small difference: a rounding difference and a real bug then end alike, and
    ``verdict`` says "outside the domain where a bound is derived". Costs three
    trainings' arithmetic on the mesh."""
    strategies.check_dtypes((params, opt_state), "equivalence.twin_growth")
    rng = np.random.default_rng(seed)
    params, opt_state = strategies.start_state("twin_growth", optimizer, params, opt_state, mesh)
    params = jax.tree.map(np.asarray, params)
    signs = [rng.choice(np.array([-1.0, 1.0]), size=np.shape(x)) for x in jax.tree.leaves(params)]

    def moved(sign):
        def leaf(x, s):
            unit = np.spacing(np.abs(x).max()) if x.size else x.dtype.type(0)
            return (x + sign * ulps * unit * s).astype(x.dtype)
        leaves, tree = jax.tree.flatten(params)
        return jax.tree.unflatten(tree, [leaf(x, s) for x, s in zip(leaves, signs)])

    starts = [params, moved(1.0), moved(-1.0)]
    stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                           *[(p, opt_state) for p in starts])
    step = _twin_step(loss_terms, optimizer.update, strategies.donates(mesh.devices.flat), mesh)
    final, values = strategies.train_loop(step, strategies.replicate(stacked, mesh), strategies.checked(batches, "sharded", mesh))
    reference = jax.tree.leaves(starts[0])
    scale = np.array([np.abs(x).max() if x.size else 0.0 for x in reference], np.float64)
    first, _ = _twin_distances(reference, jax.tree.leaves(starts[1]), jax.tree.leaves(starts[2]), scale)
    columns = [first]
    if values:
        maxima = strategies.stack_losses(values)  # per leaf: (steps, 4), see _twin_step
        for t in range(len(values)):
            scale = np.maximum(scale, [max(leaf[t, 0], leaf[t, 3]) for leaf in maxima])
            columns.append(np.array([[leaf[t, k] / np.spacing(leaf.dtype.type(big)) for leaf, big in
                                      zip(maxima, scale)] for k in (1, 2)], np.float64))
    last = [np.asarray(x) for x in jax.tree.leaves(strategies.to_host(final[0]))]
    _, off_centre = _twin_distances(*[[x[i] for x in last] for i in range(3)], scale)
    return Growth(np.stack(columns, axis=-1), off_centre, scale)


def _twin_distances(reference: list, a: list, b: list, scale) -> tuple[np.ndarray, float]:
    """((2, leaves) distances |a - r|, |b - r| in ulps of ``scale``, off-centre as Growth
    defines it)."""
    distances, middle = np.zeros((2, len(reference))), 0.0
    for l, (r, x, y) in enumerate(zip(reference, a, b)):
        if not np.size(r):
            continue
        unit = np.spacing(r.dtype.type(scale[l]))
        dx, dy = x - r, y - r
        distances[:, l] = np.abs(dx).max() / unit, np.abs(dy).max() / unit
        middle = max(middle, float(np.abs(dx + dy).max() / unit))
    spread = distances[0].max(initial=0.0) + distances[1].max(initial=0.0)
    return distances, middle / spread if spread else 0.0


class Verdict(NamedTuple):
    """``verdict``'s answer: ``case`` is "identical", "within", "OUTSIDE" or "outside
    the domain"; ``ulps`` and ``bound`` those of the leaf nearest its bound (or over it
    by most: the largest ulps / bound), ``bound`` None outside the domain and
    ``ulps`` then the largest over the leaves; ``text`` the sentence refimpl and
    test_equivalence print."""
    case: str
    ulps: float
    bound: float | None
    text: str


def verdict(a: Params, b: Params, count: float, growth: Growth | None, steps: int | None = None,
            count_name: str = "equivalence.ulp_bound") -> Verdict:
    """Whether final params ``a`` and ``b`` of two strategies are as far apart as rounding allows.

    * "identical": every leaf the same bits.
    * count 0 (the same program): any difference is "OUTSIDE" (bound 0), whatever
      the growth: no rounding differs, so nothing can grow.
    * no ``growth`` given: "within" if every leaf's own ``leaf_ulps(a, b)`` is at most
      count x ``steps``: the bound with every growth factor 1, its least (and the
      leaf's own ulp is at most the growth's unit), so a pair that close is within
      whatever the growth; else ValueError: the growth is needed.
    * otherwise ``growth`` (``twin_growth`` over the same training) is needed:
      outside its domain (``Growth.outside``), "outside the domain" (no verdict:
      rounding and a bug end alike); else "within" if every leaf's distance,
      ``leaf_ulps(a, b, growth.scale)`` (the unit of ``Growth``), is at most its
      bound (``Growth.bound(count)``), "OUTSIDE" if one is not (a NaN distance is
      OUTSIDE). Without growth the distance is ``leaf_ulps(a, b)``.

    ``steps``, if given, is the training's step count; it must be ``growth.steps``.
    Raises ValueError as said, or if ``steps`` is not the growth's."""
    if growth is not None and steps is not None and steps != growth.steps:
        raise ValueError(f"equivalence.verdict: steps={steps}, but the growth was measured over "
                         f"{growth.steps} steps (twin_growth over the same training)")
    if _same_bits(a, b):
        return Verdict("identical", 0.0, 0.0, "identical")
    if count and growth is None:
        raw = leaf_ulps(a, b)
        if steps is None or not (raw <= count * steps).all():
            raise ValueError("equivalence.verdict: params further apart than count x steps in their own "
                             "ulps need the measured growth (growth=twin_growth(...) over the same "
                             "training) unless the count is 0")
        l = int(np.argmax(raw))
        return Verdict("within", float(raw[l]), float(count * steps),
                       f"not bit-identical: {raw[l]:.1f} ulps after {steps} steps"
                       f"{f' (leaf {l})' if len(raw) > 1 else ''}, within the documented bound of "
                       f"{count * steps:g} ulps: {count:g} ulp{'' if count == 1 else 's'} a step "
                       f"({count_name}) times {steps} steps; every growth factor is at least 1, so no "
                       f"growth had to be measured")
    each = leaf_ulps(a, b, None if growth is None else growth.scale)
    steps = growth.steps if growth is not None else steps
    after = f" after {steps} steps" if steps is not None else ""
    bounds = growth.bound(count) if growth is not None else np.zeros(len(each))
    if bounds is None:
        ulps = float(np.nan) if np.isnan(each).any() else float(each.max())
        return Verdict("outside the domain", ulps, None,
                       f"not bit-identical: {ulps:.1f} ulps{after}: outside the domain where a bound "
                       f"is derived: {growth.outside()}, so a rounding difference and a real bug end "
                       f"alike; no verdict")
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(np.isnan(each), np.inf, np.where(each > 0, each / bounds, 0.0))
    l = int(np.argmax(ratio))
    case = "within" if ratio[l] <= 1 else "OUTSIDE"
    where = f" (leaf {l})" if len(each) > 1 else ""
    if count == 0:
        return Verdict("OUTSIDE", float(each[l]), 0.0,
                       f"not bit-identical: {each[l]:.1f} ulps{after}{where}, OUTSIDE the documented "
                       f"bound of 0 ulps: the same arithmetic, bit-identical expected ({count_name})")
    return Verdict(case, float(each[l]), float(bounds[l]),
                   f"not bit-identical: {each[l]:.1f} ulps{after}{where}, {case} the documented bound "
                   f"of {bounds[l]:.0f} ulps there: {count:g} ulp{'' if count == 1 else 's'} a step "
                   f"({count_name}) times the "
                   f"measured growth of a difference in that leaf, summed over the steps (growth at "
                   f"most {growth.factors()[l].max(initial=1.0):.3g})")


def _same_bits(a: Params, b: Params) -> bool:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
            return False
    return True



@functools.lru_cache(maxsize=64)
def _twin_step(loss_terms: LossTerms, update: Callable, donate: bool, mesh: Mesh) -> Callable:
    """twin_growth's step: the plain step vmapped over three stacked states (r, a, b); the
    value is a list with, per leaf, in the leaf's dtype (zeros for an empty leaf):
    (max|r|, max|a - r|, max|b - r|) of the new params, and max|u|, u the update
    ``update`` makes at r's old params and state from sum_k |g_k|, g_k the gradient of
    row block k alone over the whole batch's count, the rows cut into TERM_BLOCKS
    blocks per device of ``mesh`` (the largest count up to it that divides a device's
    rows), each device computing its own blocks' gradients."""
    one = jax.vmap(strategies.one_step(loss_terms, update), in_axes=(0, None))

    def absolute_update(state, batch):
        params, opt_state = state
        count = jnp.maximum(strategies.checked_terms(loss_terms, params, batch)[1], 1.0)
        block_grad = jax.grad(lambda p, block: strategies.checked_terms(loss_terms, p, block)[0] / count)
        rows, blocks = jax.tree.leaves(batch)[0].shape[0], mesh.devices.size
        parts = blocks * max(c for c in range(1, TERM_BLOCKS + 1) if (rows // blocks) % c == 0)
        by_device = NamedSharding(mesh, P(AXIS))  # each device its own rows' blocks
        split = jax.tree.map(lambda x: lax.with_sharding_constraint(
            x.reshape((parts, -1) + x.shape[1:]), by_device), batch)
        grads = jax.tree.map(lambda g: lax.with_sharding_constraint(g, by_device),
                             jax.vmap(block_grad, in_axes=(None, 0))(params, split))
        absolute = jax.tree.map(lambda g: jnp.sum(jnp.abs(g), axis=0), grads)
        return jax.tree.leaves(update(absolute, opt_state, params)[0])

    def step(states, batch):
        sizes = absolute_update(jax.tree.map(lambda x: x[0], states), batch)
        states, _ = one(states, batch)
        maxima = [jnp.stack([jnp.max(jnp.abs(x[0])), jnp.max(jnp.abs(x[1] - x[0])), jnp.max(jnp.abs(x[2] - x[0])),
                             jnp.max(jnp.abs(u)).astype(x.dtype)])
                  if x[0].size else jnp.zeros(4, x.dtype)
                  for x, u in zip(jax.tree.leaves(states[0]), sizes)]
        return states, maxima
    return jax.jit(step, donate_argnums=(0,) if donate else ())

