"""How far apart two trainings may end: the strategies' bound, measured, and its verdicts.

strategies.py runs the same data-parallel training four ways; every one hands its
gradient to one shared update program, so they differ only in the order in which their
gradient programs add some sums, and their params may differ by rounding. This module
says by how much, and judges a pair:

* ``ulp_bound`` is the count: roundings a step by which two strategies' gradients may
  differ (a model of where their summation orders differ, checked against measurement;
  not a worst-case proof), and what it becomes in the params under momentum (/ (1 -
  beta)) and under an adaptive rule (Adam: none).
* ``twin_growth`` measures how a difference grows over one training: a reference run,
  two twins moved a few ulps apart, vmapped, on the mesh, and the derivative of the
  same steps (``jax.jvp``). ``Growth`` holds what it measured and says where no bound
  is derived (``outside``): chaos, or kinks (a ReLU's switches, where the twins leave
  their linearisation).
* ``verdict`` turns count x growth into the bound on each leaf of the final params and
  says "identical", "within", "OUTSIDE", or "outside the domain where a bound is
  derived" (where a rounding difference and a real bug end alike, and then it names
  the routes that answer). ``leaf_ulps`` and ``ulps_apart`` are its distances.
* ``stepwise_verdict`` judges each step instead: both strategies from the same state,
  their gradients compared, so no difference grows; it answers on ReLU models, under
  Adam and at chaotic rates, wherever the gradient is smooth at the scale of rounding.

Bit-identical params on every topology are the canonical reduction's
(``reduction='canonical'`` in strategies.py), not a bound's.

Guarantees (test_equivalence.py): every pair of strategies ends within the bound
``verdict`` derives on the smooth models and rates tested there, and each planted bug (a
dropped device, a mis-scaled gradient) is OUTSIDE at ordinary rates; on ReLU models and
under Adam no correct pair is OUTSIDE either way, and ``stepwise_verdict`` calls each
planted bug (a device's gradient x 1.001, a dropped device, a division by the local
count) OUTSIDE at ordinary rates.

Imports: strategies.py (to run the strategies and the twins), NumPy and JAX.
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


def ulp_bound(a: str, b: str, platform: str, num_devices: int, *, momentum: float = 0.0,
              adaptive: bool = False) -> float | None:
    """The count: roundings a step by which strategies ``a`` and ``b`` may differ.

    Where they differ. Every strategy's plain step computes the gradient of the global
    masked mean in a program of its own, then hands it to one update program that every
    strategy shares (``strategies.apply_program``: the same compiled arithmetic, whatever
    computed the gradient). From the same state two strategies therefore differ only in
    the gradient: in the order in which some stage adds its terms, and in how XLA compiled
    the program that adds them. The count is of those roundings; the keywords say what
    they become in the params, the update rule's part:

    * plain SGD (the default: ``strategies.sgd``, ``optax.sgd`` without momentum, after
      ``optax.clip_by_global_norm`` too): p - lr g moves a gradient difference into the
      params once, so the count is also roundings a step of the params.
    * ``momentum`` beta (``optax.sgd(lr, momentum=beta)``, Nesterov's too): a step's
      gradient difference stays in the velocity and reaches the params again at every
      later step, with total weight 1 / (1 - beta): count / (1 - beta).
    * ``adaptive`` (``optax.adam``, ``adamw``, ``rmsprop``, ``adagrad``, ``lion``, ..., and any
      chain holding one): None for every pair whose gradients may differ: no count is
      derived for the params. The rule divides each entry by its own running magnitude,
      so an entry whose gradient is rounding noise moves by about the learning rate
      whichever way the noise falls (Adam's first step is -lr x sign(g)): a jump at the
      scale of rounding, like a ReLU's kink. ``verdict`` then says that no bound is
      derived, and ``stepwise_verdict``, which compares the gradients (they do not depend
      on the optimizer), takes the count as it is.

    The unit of a rounding is the ulp of the scale its numbers had (``Growth``): the
    largest of the leaf's magnitudes and of lr x sum_k |g_k|, the row blocks' gradients
    (a reordered sum is off relative to the size of its terms, not of its result, so
    an entry near zero, or a bias whose terms cancel, can differ by more than its own
    ulp). The counts hold at matmul precision "highest" (what the tests set). At
    NVIDIA's default for float32 matmuls, TF32, each dot rounds its inputs to 10-bit
    mantissas and the strategies drift apart by about 1e-3 relative: far more.

    How they are derived. Two strategies differ only in the order in which some stage
    adds g's terms, or in how one program computing g was compiled. The rule used:
    every stage whose order or compilation differs can move the once-rounded result
    p - lr g to a neighbouring float, 1 unit per stage and step; an all-reduce whose
    order the collective library chooses (NCCL, RCCL) is n - 1 such stages. This counts
    roundings: it is a model, checked against measurement below, not a worst-case proof
    (a worst-case bound for an m-term sum, (m - 1) units, is tens of units here and
    would hide real bugs). Counting, n = ``num_devices``, "cpu" one platform, every
    other platform counted as a GPU:

    * the same strategy: 0.
    * pmap and shard_map: two autodiff programs. pmap back-propagates 1/count through
      each device's own total and psums the gradient; shard_map differentiates
      psum(total) / psum(count), whose transpose psums it. For a leaf used once that is
      the same sum; for a leaf used twice (a tied embedding, gathered and projected
      onto) shard_map's transpose psums each use's contribution and adds the sums,
      psum(a) + psum(b), where pmap adds them on each device and psums once,
      psum(a + b): one stage in another order, 1 on CPU. Measured: the same bits on the
      notebooks' MLP, the linear model, ReLU and GELU MLPs and a one-layer transformer
      (sgd, momentum, adam, adamw, clipping chains, adam at lr 1: every leaf used
      once); on test_equivalence's causal attention model (its embedding tied to the
      output) 173 of the embedding gradient's 256 entries differ at the first step
      (no other leaf), 0.5 ulps after 6 steps, with FMA off
      (``XLA_FLAGS=--xla_cpu_max_isa=AVX``) too. On GPUs the all-reduce order may
      differ as well: n.
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
    leaf of cancelling terms needs. With ``optax.sgd(lr, momentum=0.9)`` in ``ulps_apart``'s
    ulps a step: pmap vs shard_map 0, sharded vs them <= 0.5, any vs single <= 3.25
    (the linear model's bias), within count / (1 - beta) (test_equivalence.py holds
    it to that). With ``optax.adam`` the params' distance follows no count: up to 12,333
    ulps a step between sharded and single on the MLP (7.4e-3 x lr a step), where the
    gradients were within 6.5 units of their term scale a counted rounding
    (``stepwise_verdict``). GPU counts are derived only; not measured.
    """
    if not 0 <= momentum < 1:
        raise ValueError(f"equivalence.ulp_bound: momentum={momentum} must be in [0, 1) (the velocity's "
                         f"decay, optax.sgd's momentum)")
    pair = frozenset((a, b))
    cpu = platform == "cpu"
    n = num_devices
    if len(pair) == 1:
        return 0
    if "single" in pair:
        count = 2 if cpu else n + 1
    else:
        count = 1 if cpu else n
    if adaptive:
        return None
    return count / (1 - momentum) if momentum else count


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
KINK_RATIO = 2.0  # how far a twin may end beyond its linearisation (Growth.outside)
ROUTE = ("no bound is derived for the final params; judge each step instead "
         "(equivalence.stepwise_verdict: the gradients from the same state), or train with "
         "reduction='canonical' for the same bits on every topology")


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
    up to 1 where it does not (0 if both twins end on the reference). ``tangent[l, t]``
    (None where not measured): the linearised training's difference, the derivative of
    the same steps (``jax.jvp``) along +delta, in the same unit: what the twins would
    measure if the training were differentiable at their scale."""
    distances: np.ndarray  # (2, leaves, steps + 1) float64
    off_centre: float
    scale: np.ndarray  # (leaves,) float64
    tangent: np.ndarray | None = None  # (leaves, steps + 1) float64

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

        * the training did not diverge: every distance and scale finite;
        * every G finite (a twin that met the reference and left it again: no);
        * the twins stayed small against the params: no distance above MAX_TWIN_ULPS,
          2**16 ulps, 2**-8 to 2**-7 of a leaf's largest magnitude (a growth of 2**10
          from the 64-ulp start). Beyond it the linearisation the bound rests on has
          no footing, and a bound that large admits real bugs as rounding;
        * the propagation was linear: ``off_centre`` <= MAX_OFF_CENTRE, 1/4, or the
          twins ended no farther from the reference than they started, in every leaf
          (nothing grew that could be non-linear);
        * where the ``tangent`` was measured, the twins followed it: no twin's largest
          distance above KINK_RATIO (2) x the tangent's largest, plus 1 unit a step (the
          twins' own arithmetic rounds too).

        Outside, the reason names the cause where the tangent tells it: *chaos* where the
        tangent itself grew beyond MAX_TWIN_ULPS (a smooth training that amplifies every
        difference); else *kinks* where the twins ended beyond KINK_RATIO x the tangent
        (+ 1 a step): the training is not differentiable at the scale of rounding. A
        ReLU's (or a max's) switch, crossed by a twin, jumps the gradient by an amount no
        derivative sees and no perturbation's size scales, and a correct pair crosses
        such switches as well, by chance."""
        start, largest = self.distances[..., 0].max(initial=0.0), self.distances.max(initial=0.0)
        linear = None if self.tangent is None else float(self.tangent.max(initial=0.0))
        kinked = linear is not None and largest > KINK_RATIO * linear + self.steps
        if not (np.isfinite(self.distances).all() and np.isfinite(self.scale).all()):
            return "the training diverged: the reference or a twin reached a NaN or an infinity"
        if not np.isfinite(self.factors()).all():
            reason = "a twin met the reference and left it again"
        elif largest > MAX_TWIN_ULPS:
            reason = (f"a difference of {start:.0f} ulps grew to {largest:.3g}, beyond "
                      f"{MAX_TWIN_ULPS:.0f} (2**-8 to 2**-7 of the params)")
        elif (self.distances[..., -1] > self.distances[..., 0]).any() and self.off_centre > MAX_OFF_CENTRE:
            reason = (f"a difference of {start:.0f} ulps grew to {largest:.3g} and not linearly (the "
                      f"twins ended {self.off_centre:.2f} off centre, more than {MAX_OFF_CENTRE})")
        elif kinked:
            reason = (f"a difference of {start:.0f} ulps grew to {largest:.3g}, more than {KINK_RATIO:g} x "
                      f"its linearisation's {linear:.3g} (+ 1 a step)")
        else:
            return None
        if linear is not None and linear > MAX_TWIN_ULPS:
            return (f"{reason}; the linearised training (jax.jvp) grew it to {linear:.3g} as well: chaos, a "
                    f"smooth training that amplifies every difference")
        if kinked:
            return (f"{reason}; the linearised training (jax.jvp) grew it only to {linear:.3g}: kinks, the "
                    f"training is not differentiable at the scale of rounding (a ReLU's switch crossed by a "
                    f"twin jumps the gradient, and a correct pair crosses such switches too, by chance)")
        return reason

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
    ``verdict`` says "outside the domain where a bound is derived". Alongside, the
    derivative of the reference's steps (``jax.jvp``, the optimizer state's float leaves
    carried too) takes +delta through the same batches: ``Growth.tangent``, in the same
    unit, what the twins would measure if the training were differentiable at their
    scale; twins that end beyond KINK_RATIO x it are outside the domain too (kinks), and
    a tangent beyond MAX_TWIN_ULPS names chaos. Costs three trainings' arithmetic and a
    jvp of each step on the mesh."""
    strategies.check_dtypes((params, opt_state), "equivalence.twin_growth")
    rng = np.random.default_rng(seed)
    params, opt_state = strategies.start_state("twin_growth", optimizer, params, opt_state, mesh)
    params = jax.tree.map(np.asarray, params)
    signs = [rng.choice(np.array([-1.0, 1.0]), size=np.shape(x)) for x in jax.tree.leaves(params)]

    starts = [params, _moved(params, signs, ulps), _moved(params, signs, -ulps)]
    stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                           *[(p, opt_state) for p in starts])
    # The tangent starts as twin a's perturbation, exactly; the optimizer state's float
    # leaves start unperturbed (zeros) and carry what the steps move into them.
    tangent = (jax.tree.map(lambda a, r: (a.astype(np.float64) - r).astype(r.dtype), starts[1], params),
               [np.zeros_like(x) for x in _float_leaves(opt_state)])
    step = _twin_step(loss_terms, optimizer.update, strategies.donates(mesh.devices.flat), mesh)
    final, values = strategies.train_loop(step, strategies.replicate((stacked, tangent), mesh),
                                          strategies.checked(batches, "sharded", mesh))
    reference = jax.tree.leaves(starts[0])
    scale = np.array([np.abs(x).max() if x.size else 0.0 for x in reference], np.float64)
    first, _ = _twin_distances(reference, jax.tree.leaves(starts[1]), jax.tree.leaves(starts[2]), scale)
    columns, linear = [first], [first[0]]
    if values:
        maxima = strategies.stack_losses(values)  # per leaf: (steps, 5), see _twin_step
        for t in range(len(values)):
            scale = np.maximum(scale, [max(leaf[t, 0], leaf[t, 3]) for leaf in maxima])
            units = [np.spacing(leaf.dtype.type(big)) for leaf, big in zip(maxima, scale)]
            columns.append(np.array([[leaf[t, k] / unit for leaf, unit in zip(maxima, units)] for k in (1, 2)],
                                    np.float64))
            linear.append(np.array([leaf[t, 4] / unit for leaf, unit in zip(maxima, units)], np.float64))
    last = [np.asarray(x) for x in jax.tree.leaves(strategies.to_host(final[0][0]))]
    _, off_centre = _twin_distances(*[[x[i] for x in last] for i in range(3)], scale)
    return Growth(np.stack(columns, axis=-1), off_centre, scale, np.stack(linear, axis=-1))


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
    """``verdict``'s and ``stepwise_verdict``'s answer: ``case`` is "identical", "within",
    "OUTSIDE" or "outside the domain" (no bound is derived: no verdict); ``ulps`` and
    ``bound`` those of the leaf nearest its bound (or over it by most: the largest ulps /
    bound), ``bound`` None outside the domain and ``ulps`` then the largest over the
    leaves; ``text`` the sentence refimpl and test_equivalence print."""
    case: str
    ulps: float
    bound: float | None
    text: str


def verdict(a: Params, b: Params, count: float | None, growth: Growth | None, steps: int | None = None,
            count_name: str = "equivalence.ulp_bound") -> Verdict:
    """Whether final params ``a`` and ``b`` of two strategies are as far apart as rounding allows.

    In this order:

    * "identical": every leaf the same bits.
    * count None (``ulp_bound`` derives none for an adaptive update rule): "outside the
      domain": no bound is derived for the final params (the text says why and names
      the routes that do answer: ``stepwise_verdict``, ``reduction='canonical'``).
    * count 0 (the same program): any difference is "OUTSIDE" (bound 0), whatever
      the growth: no rounding differs, so nothing can grow.
    * the no-growth test, with or without ``growth``: "within" if every leaf's own
      ``leaf_ulps(a, b)`` is at most count x steps: the bound with every growth factor 1,
      its least (and the leaf's own ulp is at most the growth's unit), so a pair that
      close is within whatever the growth, inside its domain or not.
    * no ``growth`` given: ValueError: the growth is needed.
    * otherwise ``growth`` (``twin_growth`` over the same training): outside its domain
      (``Growth.outside``: chaos, kinks, a difference grown beyond the linearisation),
      "outside the domain": a rounding difference and a real bug end alike, no verdict;
      else "within" if every leaf's distance, ``leaf_ulps(a, b, growth.scale)`` (the unit
      of ``Growth``), is at most its bound (``Growth.bound(count)``), "OUTSIDE" if one is
      not (a NaN distance is OUTSIDE).

    ``steps``, if given, is the training's step count; it must be ``growth.steps``.
    Raises ValueError as said, or if ``steps`` is not the growth's."""
    if growth is not None and steps is not None and steps != growth.steps:
        raise ValueError(f"equivalence.verdict: steps={steps}, but the growth was measured over "
                         f"{growth.steps} steps (twin_growth over the same training)")
    if _same_bits(a, b):
        return Verdict("identical", 0.0, 0.0, "identical")
    steps = growth.steps if growth is not None else steps
    after = f" after {steps} steps" if steps is not None else ""
    raw = leaf_ulps(a, b)
    largest = float(np.nan) if np.isnan(raw).any() else float(raw.max(initial=0.0))
    if count is None:
        return Verdict("outside the domain", largest, None,
                       f"not bit-identical: {largest:.1f} ulps{after}: no count is derived for the params "
                       f"under this update rule ({count_name}: an adaptive rule such as Adam divides each "
                       f"entry by its own running magnitude, so an entry whose gradient is rounding noise "
                       f"moves by about the learning rate whichever way the noise falls); {ROUTE}")
    if count == 0:
        each = leaf_ulps(a, b, None if growth is None else growth.scale)
        l = int(np.argmax(np.where(np.isnan(each), np.inf, each)))
        where = f" (leaf {l})" if len(each) > 1 else ""
        return Verdict("OUTSIDE", float(each[l]), 0.0,
                       f"not bit-identical: {each[l]:.1f} ulps{after}{where}, OUTSIDE the documented "
                       f"bound of 0 ulps: the same program, bit-identical expected ({count_name})")
    if steps is not None and (raw <= count * steps).all():
        l = int(np.argmax(raw))
        return Verdict("within", float(raw[l]), float(count * steps),
                       f"not bit-identical: {raw[l]:.1f} ulps after {steps} steps"
                       f"{f' (leaf {l})' if len(raw) > 1 else ''}, within the documented bound of "
                       f"{count * steps:g} ulps: {count:g} ulp{'' if count == 1 else 's'} a step "
                       f"({count_name}) times {steps} steps; every growth factor is at least 1, so no "
                       f"growth had to be measured")
    if growth is None:
        raise ValueError("equivalence.verdict: params further apart than count x steps in their own "
                         "ulps need the measured growth (growth=twin_growth(...) over the same "
                         "training) unless the count is 0")
    each = leaf_ulps(a, b, growth.scale)
    bounds = growth.bound(count)
    if bounds is None:
        ulps = float(np.nan) if np.isnan(each).any() else float(each.max())
        return Verdict("outside the domain", ulps, None,
                       f"not bit-identical: {ulps:.1f} ulps{after}: outside the domain where a bound "
                       f"is derived: {growth.outside()}, so a rounding difference and a real bug end "
                       f"alike: {ROUTE}")
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(np.isnan(each), np.inf, np.where(each > 0, each / bounds, 0.0))
    l = int(np.argmax(ratio))
    case = "within" if ratio[l] <= 1 else "OUTSIDE"
    where = f" (leaf {l})" if len(each) > 1 else ""
    return Verdict(case, float(each[l]), float(bounds[l]),
                   f"not bit-identical: {each[l]:.1f} ulps{after}{where}, {case} the documented bound "
                   f"of {bounds[l]:.0f} ulps there: {count:g} ulp{'' if count == 1 else 's'} a step "
                   f"({count_name}) times the "
                   f"measured growth of a difference in that leaf, summed over the steps (growth at "
                   f"most {growth.factors()[l].max(initial=1.0):.3g})")


# --------------------------------------------------------------------------
# The step-synchronised verdict: each step from the same state
# --------------------------------------------------------------------------

STEP_UNITS = 32  # units of the gradient's term scale that one counted rounding may move it
STEP_TWIN_ULPS = 1  # the gradient twins' perturbation, in leaf_ulps' unit (stepwise_verdict)


def stepwise_verdict(a, b, params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms,
                     optimizer: Optimizer = strategies.sgd(), opt_state=None, count: float | None = None,
                     count_name: str = "equivalence.ulp_bound", seed: int = 0) -> Verdict:
    """Whether strategies ``a`` and ``b`` compute the same gradient, step by step, as rounding allows.

    Every step starts both strategies from the same state, a's: for each batch of
    ``batches`` (host dicts in layout "sharded", (n*B, ...) with a "mask"; reshaped to
    (n, B, ...) for a strategy of layout "pmap"), ``a`` and ``b`` each make that one step
    from (params_t, opt_state_t), through the strategy itself, and the gradient each
    handed its optimizer is recorded (the optimizer wrapped so that its state keeps it);
    a's new state is the next step's. No difference is carried from one step to the
    next, so nothing grows (neither chaos nor a ReLU's kinks carry a difference on), and
    the gradient does not depend on the optimizer: ``ulp_bound``'s count as it is, for
    Adam too. ``a`` and ``b``: names in ``strategies.STRATEGIES``, or functions with a
    strategy's signature that take layout "sharded" (your own strategy, a planted bug);
    ``count`` None means ``ulp_bound(a, b, platform, n)`` (names only). One process
    (host batches).

    The measure: at step t, per leaf l, max |g_a - g_b| in ulps of the gradient's term
    scale at that state, the largest over the leaf of sum_k |g_k| (``_absolute_gradient``,
    the scale ``Growth``'s unit rests on). The bound: ``count`` x STEP_UNITS (32) units,
    at every step and leaf that is judged. Why more than 1 unit a rounding: the unit is
    the row blocks' scale, while a stage adds rows, tokens and tied uses whose partial
    sums can be larger than a block's (they cancel), and where the loss is sharp (large
    logits) a rounding in the forward pass is amplified in the gradient. Measured
    (``python test_equivalence.py stepwise``: 8 CPU devices, 8 steps of 8 x 16 rows with
    uneven masks; a 256-unit ReLU MLP, the same with GELU, and test_equivalence's
    attention model; sgd, momentum, adam, adamw and a clipping chain, rates 1e-3 to 20,
    chaotic ones included): correct pairs at most 6.5 units a counted rounding at the
    judged steps and leaves (the attention model; the MLPs 3.5); the notebooks' MLP with
    ReLU and GELU (3072 inputs, 8 x 20 rows) reached 10 (Adam at lr 1). The planted bugs
    (a device's gradient x 1.001, a dropped device, a division by the local count):
    at least 1.45e3 units a counted rounding at ordinary rates, 934 where the training
    diverged, 29 to 45 x the bound.

    The domain, per step and leaf: judged where the gradient is smooth at the scale of
    rounding, measured at that state by twins: every param moved STEP_TWIN_ULPS (1) ulp
    of its leaf's largest magnitude, signs drawn once by ``np.random.default_rng(seed)``,
    +delta and -delta, the gradient (the sharded program) moves by at most STEP_UNITS
    units in that leaf. Where it moves more (a ReLU switching within a rounding of its
    input, a saturated softmax at a chaotic rate) a rounding difference and a bug move
    it alike, and that step and leaf are not judged (the text counts them): measured,
    none on the MLPs at ordinary rates and up to 14% on the attention model, up to 48%
    at chaotic rates; the one correct pair beyond the bound in these runs (the attention
    model under Adam at lr 1: 7.3e6 units, the gradients unrelated) was at a step whose
    1-ulp twins moved the gradient 1.85e4 units, outside this domain. Where the
    training itself diverges (a NaN or an infinity in the state, or in both gradients)
    the comparison stops at that step and the text says so.

    Cases: "identical", every step's gradients the same bits; count 0 (the same program),
    any difference OUTSIDE, judged or not; else "OUTSIDE" if a judged step and leaf is
    beyond the bound (a NaN in one gradient only is), "within" if every judged one is
    within it, "outside the domain" if none was judged.

    What it cannot see: an update applied wrongly to a right gradient, or a state carried
    wrongly from one step to the next (each step here starts from a's state). Every
    strategy of strategies.py applies one shared update program (``apply_program``);
    for the rest, the final-params ``verdict`` on a smooth model, or the canonical
    reduction's bits (``reduction='canonical'``), see those. Costs two one-step
    trainings a step, the row blocks' gradients and two gradient twins."""
    (name_a, fn_a, layout_a), (name_b, fn_b, layout_b) = _strategy(a), _strategy(b)
    if count is None:
        if not (isinstance(a, str) and isinstance(b, str)):
            raise ValueError("equivalence.stepwise_verdict: count=None takes ulp_bound's count, which needs "
                             "strategy names; pass count= for a strategy given as a function")
        count = ulp_bound(a, b, mesh.devices.flat[0].platform, mesh.devices.size)
    each, twin, same, diverged = stepwise_distances(fn_a, layout_a, fn_b, layout_b, params, batches, mesh,
                                                    loss_terms=loss_terms, optimizer=optimizer,
                                                    opt_state=opt_state, seed=seed)
    steps = len(each)
    stop = ("" if diverged is None else f"; the training diverged at step {diverged} (a NaN or an infinity "
            f"in the state or in both gradients), where the comparison stops")
    pair = f"{name_a} vs {name_b}, each of {steps} steps from the same state"
    if same and steps:
        return Verdict("identical", 0.0, 0.0, f"identical: {pair}, the same gradient bits{stop}")
    judged = twin <= STEP_UNITS
    if count == 0:
        judged = np.ones_like(judged)
    if not judged.any():
        return Verdict("outside the domain", float(np.nan), None,
                       f"{pair}: no step judged{stop}: no verdict" if steps else
                       f"{name_a} vs {name_b}: no step compared{stop}: no verdict")
    bound = count * STEP_UNITS
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(~judged, -1.0, np.where(np.isnan(each), np.inf, np.where(each > 0, each / bound, 0.0)))
    t, l = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    case = "within" if ratio[t, l] <= 1 else "OUTSIDE"
    unjudged = int((~judged).sum())
    skipped = (f"; {unjudged} of {judged.size} steps x leaves not judged: a {STEP_TWIN_ULPS}-ulp move of the "
               f"params moved their gradient by more than {STEP_UNITS} units (not smooth at the scale of "
               f"rounding: a kink, a saturated softmax)" if unjudged else "")
    why = (f"0 roundings a step ({count_name}): the same program, the same bits expected" if count == 0 else
           f"{count:g} rounding{'' if count == 1 else 's'} a step ({count_name}) x {STEP_UNITS} units a rounding")
    return Verdict(case, float(each[t, l]), float(bound),
                   f"{pair}: the gradients {each[t, l]:.1f} units of their term scale apart at step {t} "
                   f"(leaf {l}), {case} the bound of {bound:g}: {why}{skipped}{stop}")


def stepwise_distances(fn_a: Callable, layout_a: str, fn_b: Callable, layout_b: str, params: Params,
                       batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms, optimizer: Optimizer,
                       opt_state=None, seed: int = 0) -> tuple:
    """``stepwise_verdict``'s measurements: (distances (steps, leaves) float64, the gradients'
    distance in units of their term scale; twins (steps, leaves), the larger distance the
    +-STEP_TWIN_ULPS twins moved the gradient, same unit; whether every step's gradients
    were the same bits; the step at which the training diverged, or None). Strategies as
    functions with their layouts ("sharded" or "pmap")."""
    params, opt_state = strategies.start_state("stepwise_verdict", optimizer, params, opt_state, mesh)
    recording = strategies.Optimizer(optimizer.init, _recording(optimizer.update))
    units_of = _step_units(loss_terms, mesh)
    rng = np.random.default_rng(seed)
    signs = [rng.choice(np.array([-1.0, 1.0]), size=np.shape(x)) for x in jax.tree.leaves(params)]
    n, sharding = mesh.devices.size, NamedSharding(mesh, P(AXIS))
    distances, twins, same, diverged = [], [], True, None
    for t, host in enumerate(batches):
        host = {k: np.asarray(v) for k, v in host.items()}
        params = jax.tree.map(np.asarray, params)
        start = (opt_state, jax.tree.map(np.zeros_like, params))
        out = []
        for fn, layout in ((fn_a, layout_a), (fn_b, layout_b)):
            batch = host if layout == "sharded" else {k: v.reshape((n, -1) + v.shape[1:]) for k, v in host.items()}
            out.append(fn(params, [batch], mesh, loss_terms=loss_terms, optimizer=recording, opt_state=start))
        ga, gb = out[0].opt_state[1], out[1].opt_state[1]
        if not (_finite(params) and (_finite(ga) or _finite(gb))):
            diverged = t  # the training itself diverged: nothing left to compare
            break
        moved = [params] + [_moved(params, signs, sign * STEP_TWIN_ULPS) for sign in (1.0, -1.0)]
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *moved)
        maxima = [np.asarray(x.addressable_data(0), np.float64)
                  for x in units_of(strategies.replicate(stacked, mesh), jax.device_put(host, sharding))]
        scale = [m[0] for m in maxima]
        units = [np.spacing(np.asarray(g).dtype.type(s)) for g, s in zip(jax.tree.leaves(ga), scale)]
        twins.append([max(m[1], m[2]) / u for m, u in zip(maxima, units)])
        distances.append(leaf_ulps(ga, gb, scale))
        same = same and _same_bits(ga, gb)
        params, opt_state = out[0].params, out[0].opt_state[0]
    leaves = len(jax.tree.leaves(params))
    return (np.array(distances, np.float64).reshape(-1, leaves), np.array(twins, np.float64).reshape(-1, leaves),
            same, diverged)


def _finite(tree) -> bool:
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


def _moved(params: Params, signs: list, ulps: float) -> Params:
    """``params`` with every entry of each leaf moved ``ulps`` ulps of the leaf's largest
    magnitude (np.spacing in the leaf's dtype), times its sign, rounded to the leaf's dtype."""
    def leaf(x, s):
        x = np.asarray(x)
        unit = np.spacing(np.abs(x).max()) if x.size else x.dtype.type(0)
        return (x + ulps * unit * s).astype(x.dtype)
    leaves, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(tree, [leaf(x, s) for x, s in zip(leaves, signs)])


def _strategy(s) -> tuple[str, Callable, str]:
    """(name, function, layout) of a strategy name or function (layout "sharded" for a function)."""
    if isinstance(s, str):
        if s not in strategies.STRATEGIES:
            raise ValueError(f"equivalence.stepwise_verdict: unknown strategy {s!r}; one of "
                             f"{sorted(strategies.STRATEGIES)} or a function with a strategy's signature")
        return s, strategies.STRATEGIES[s], strategies.LAYOUT[s]
    return getattr(s, "__name__", repr(s)), s, "sharded"


@functools.lru_cache(maxsize=64)
def _recording(update: Callable) -> Callable:
    """``update`` with its state (inner state, gradient): the new state keeps the gradient it
    was given (one function per ``update``, so the strategies' compiled steps are reused)."""
    def recorded(grads, state, params):
        updates, new = update(grads, state[0], params)
        return updates, (new, grads)
    return recorded


@functools.lru_cache(maxsize=64)
def _step_units(loss_terms: LossTerms, mesh: Mesh) -> Callable:
    """jit: (params stacked (3, ...) = (p, p + delta, p - delta), replicated; batch sharded on
    'data') -> per leaf, (max of sum_k |g_k| at p, max |g(p + delta) - g(p)|, max |g(p - delta)
    - g(p)|), g the batch's masked mean gradient (the sharded program)."""
    absolute = _absolute_gradient(loss_terms, mesh)
    def mean(params, batch):
        total, count = strategies.checked_terms(loss_terms, params, batch)
        return total / jnp.maximum(count, 1.0)
    gradient = jax.vmap(jax.grad(mean), in_axes=(0, None))

    def units(stacked, batch):
        scale = jax.tree.leaves(absolute(jax.tree.map(lambda x: x[0], stacked), batch))
        grads = jax.tree.leaves(gradient(stacked, batch))
        return [jnp.stack([jnp.max(s), jnp.max(jnp.abs(g[1] - g[0])), jnp.max(jnp.abs(g[2] - g[0]))])
                if s.size else jnp.zeros(3, s.dtype) for s, g in zip(scale, grads)]
    return jax.jit(units)


def _same_bits(a: Params, b: Params) -> bool:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
            return False
    return True


def _float_leaves(tree) -> list:
    """The floating-point leaves of ``tree``, in ``jax.tree.leaves`` order (what a tangent moves;
    an optimizer's step counter is an int and has none)."""
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]


def _absolute_gradient(loss_terms: LossTerms, mesh: Mesh) -> Callable:
    """(params, batch) -> sum_k |g_k| per leaf (the params' tree), g_k the gradient of row
    block k alone over the whole batch's count, the rows cut into TERM_BLOCKS blocks per
    device of ``mesh`` (the largest count up to it that divides a device's rows), each
    device computing its own blocks' gradients: the scale at which a reordered sum of the
    gradient's terms rounds (``Growth``)."""
    def absolute(params, batch):
        count = jnp.maximum(strategies.checked_terms(loss_terms, params, batch)[1], 1.0)
        block_grad = jax.grad(lambda p, block: strategies.checked_terms(loss_terms, p, block)[0] / count)
        rows, blocks = jax.tree.leaves(batch)[0].shape[0], mesh.devices.size
        parts = blocks * max(c for c in range(1, TERM_BLOCKS + 1) if (rows // blocks) % c == 0)
        by_device = NamedSharding(mesh, P(AXIS))  # each device its own rows' blocks
        split = jax.tree.map(lambda x: lax.with_sharding_constraint(
            x.reshape((parts, -1) + x.shape[1:]), by_device), batch)
        grads = jax.tree.map(lambda g: lax.with_sharding_constraint(g, by_device),
                             jax.vmap(block_grad, in_axes=(None, 0))(params, split))
        return jax.tree.map(lambda g: jnp.sum(jnp.abs(g), axis=0), grads)
    return absolute


@functools.lru_cache(maxsize=64)
def _twin_step(loss_terms: LossTerms, update: Callable, donate: bool, mesh: Mesh) -> Callable:
    """twin_growth's step on ((r, a, b) stacked states, tangent): the plain step vmapped over
    the three states, and the tangent carried by the derivative (``jax.jvp``) of r's step
    (params and the state's float leaves). The value is a list with, per leaf, in the leaf's
    dtype (zeros for an empty leaf): (max|r|, max|a - r|, max|b - r|) of the new params,
    max|u|, u the update ``update`` makes at r's old params and state from sum_k |g_k|
    (``_absolute_gradient``), and max|tangent| of the new params."""
    plain = strategies.one_step(loss_terms, update)
    one = jax.vmap(plain, in_axes=(0, None))
    absolute = _absolute_gradient(loss_terms, mesh)

    def linearised(state, tangent, batch):
        params, opt_state = state
        leaves, tree = jax.tree.flatten(opt_state)
        moving = [i for i, x in enumerate(leaves) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]

        def f(p, floats):
            held = list(leaves)
            for i, x in zip(moving, floats):
                held[i] = x
            new_params, new_state = plain((p, jax.tree.unflatten(tree, held)), batch)[0]
            new_leaves = jax.tree.leaves(new_state)
            return new_params, [new_leaves[i] for i in moving]
        return jax.jvp(f, (params, [leaves[i] for i in moving]), tangent)[1]

    def step(carry, batch):
        states, tangent = carry
        params, opt_state = jax.tree.map(lambda x: x[0], states)
        sizes = jax.tree.leaves(update(absolute(params, batch), opt_state, params)[0])
        tangent = linearised((params, opt_state), tangent, batch)
        states, _ = one(states, batch)
        maxima = [jnp.stack([jnp.max(jnp.abs(x[0])), jnp.max(jnp.abs(x[1] - x[0])), jnp.max(jnp.abs(x[2] - x[0])),
                             jnp.max(jnp.abs(u)).astype(x.dtype), jnp.max(jnp.abs(d)).astype(x.dtype)])
                  if x[0].size else jnp.zeros(5, x.dtype)
                  for x, u, d in zip(jax.tree.leaves(states[0]), sizes, jax.tree.leaves(tangent[0]))]
        return (states, tangent), maxima
    return jax.jit(step, donate_argnums=(0,) if donate else ())
