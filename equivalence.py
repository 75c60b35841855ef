"""How far apart the plain reduction's strategies may end, judged step by step.

strategies.py's plain reduction lets each strategy add its gradient's terms in its own order, so two strategies'
gradients differ by rounding. A difference grows with the training (chaos, a ReLU's kinks, Adam's sign-like first
steps), so no bound on the final params is claimed. ``stepwise_verdict`` judges each step instead: both strategies step
from the same state, and their gradients must agree within ``ulp_bound``'s count of roundings, in units of the
gradient's term scale. Bit-identical params on every topology are ``reduction="canonical"``'s, judged by equality.

Imports: strategies.py, NumPy and JAX. Imported by refimpl.py and the tests.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import strategies
from strategies import AXIS, LossTerms, Optimizer, Params


def ulp_bound(a: str, b: str, platform: str, num_devices: int) -> int:
    """Roundings per step by which the gradients of strategies ``a`` and ``b`` may differ.

    From the same state two strategies differ only in the gradient (every one hands it to
    ``strategies.update_program``): in the order some stage adds its terms, or in how XLA compiled the program that adds
    them. Each such stage counts 1; an all-reduce whose order the collective library picks (NCCL, RCCL) counts n - 1. On
    CPU: the same strategy 0; pmap vs shard_map 1 (a leaf used twice, a tied embedding, is psummed per use by one and
    once by the other); sharded vs pmap or shard_map 1 (XLA partitions the step itself); any vs single 2 (one pass over
    n*B rows against B per device, then n partial sums). Every other platform is counted as a GPU: n, n and n + 1. A
    model of where summation orders differ, checked by ``stepwise_verdict``'s tests; not a proof."""
    n, pair = num_devices, frozenset((a, b))
    if len(pair) == 1:
        return 0
    if "single" in pair:
        return 2 if platform == "cpu" else n + 1
    return 1 if platform == "cpu" else n


def ulps_apart(a: Params, b: Params) -> float:
    """The largest of ``leaf_ulps(a, b)``: max |a - b| in ulps of each leaf's largest magnitude."""
    each = leaf_ulps(a, b)
    return float(np.nan) if np.isnan(each).any() else float(each.max(initial=0.0))


def leaf_ulps(a: Params, b: Params, scale=None) -> np.ndarray:
    """(leaves,) float64: per leaf, max |a - b| in ulps (``np.spacing``) of the leaf's largest magnitude over a and b,
    or of ``scale[l]`` where that is larger; float64 leaves in float64, every other dtype in float32. 0 for an empty
    leaf, NaN where a NaN is met."""
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


TERM_BLOCKS = 2  # row blocks per device whose gradients make the term scale (_step_units)


class Verdict(NamedTuple):
    """``stepwise_verdict``'s answer: ``case`` one of its Cases; ``ulps`` and ``bound`` those of the judged step and
    leaf nearest its bound (identical: 0 and the bound the pair is held to; outside the domain: NaN and None); ``text``
    the sentence refimpl prints."""
    case: str
    ulps: float
    bound: float | None
    text: str


STEP_UNITS = 32  # units of the gradient's term scale that one counted rounding may move it
STEP_TWIN_ULPS = 1  # the gradient twins' perturbation, in leaf_ulps' unit (stepwise_verdict)


def stepwise_verdict(a, b, params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms,
                     optimizer: Optimizer = strategies.sgd(), opt_state=None, count: float | None = None, seed: int = 0,
                     count_name: str = "equivalence.ulp_bound", after_run: Callable[[], None] | None = None) -> Verdict:
    """Whether strategies ``a`` and ``b`` compute the same gradient, step by step, as rounding allows. ``after_run``, if
    given, is called after each strategy's one-step run (refimpl.py gives memory back there).

    For each batch (a host dict in layout "sharded", reshaped to (n, B, ...) for layout "pmap"), ``a`` and ``b`` each
    make one step from the same state, a's; the gradient each handed its optimizer is recorded; a's new state is the
    next step's, so no difference carries over. ``a``, ``b``: names in ``strategies.STRATEGIES``, or functions with a
    strategy's signature taking layout "sharded" (then pass ``count``). One process.

    Measure: per step t and leaf l, max |g_a - g_b| in units of the gradient's term scale: the ulp (``np.spacing``) of
    the largest entry of sum_k |g_k|, g_k the gradient of row block k alone, TERM_BLOCKS blocks per device. Bound:
    ``count`` (default ``ulp_bound(a, b, platform, n)``) x STEP_UNITS units. A rounding counts 32 units, not 1: a stage
    adds rows, tokens and tied uses whose partial sums exceed a block's, and a sharp loss amplifies a forward rounding
    in the gradient; planted bugs (a device's gradient x 1.001, a dropped device, a local count) land at thousands.

    Domain: step t and leaf l are judged only where the gradient is smooth at the scale of rounding: moving every param
    STEP_TWIN_ULPS ulp of its leaf's largest magnitude (signs from ``np.random.default_rng(seed)``), +delta and -delta,
    moves the gradient by at most STEP_UNITS units. Elsewhere (a ReLU switching, a saturated softmax) a rounding and a
    bug look alike. Where the training diverges (a NaN or inf in the state or in both gradients) the comparison stops.

    Cases: "identical", every gradient the same bits; "OUTSIDE", a judged step and leaf beyond the bound (with
    ``count`` 0, any difference); "within", every judged one within it; "outside the domain", none judged. It cannot see
    an update applied wrongly to a right gradient (every strategy shares ``strategies.update_program``)."""
    (name_a, fn_a, layout_a), (name_b, fn_b, layout_b) = _strategy(a), _strategy(b)
    if count is None:
        if not (isinstance(a, str) and isinstance(b, str)):
            raise ValueError("equivalence.stepwise_verdict: count=None takes ulp_bound's count, which needs "
                             "strategy names; pass count= for a strategy given as a function")
        count = ulp_bound(a, b, mesh.devices.flat[0].platform, mesh.devices.size)
    each, twin, same, diverged = stepwise_distances(fn_a, layout_a, fn_b, layout_b, params, batches, mesh,
                                                    loss_terms=loss_terms, optimizer=optimizer,
                                                    opt_state=opt_state, seed=seed, after_run=after_run)
    steps = len(each)
    stop = ("" if diverged is None else f"; the training diverged at step {diverged} (a NaN or an infinity "
            f"in the state or in both gradients), where the comparison stops")
    pair = f"{name_a} vs {name_b}, each of {steps} steps from the same state"
    if same and steps:
        return Verdict("identical", 0.0, float(count * STEP_UNITS), f"identical: {pair}, the same gradient bits{stop}")
    judged = (twin <= STEP_UNITS) | (count == 0)  # count 0: every step and leaf judged
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
    why = (f"0 roundings per step ({count_name}): the same program, the same bits expected" if count == 0 else
           f"{count:g} rounding{'' if count == 1 else 's'} per step ({count_name}) x {STEP_UNITS} units per rounding")
    return Verdict(case, float(each[t, l]), float(bound), f"{pair}: the gradients {each[t, l]:.1f} units of their "
                   f"term scale apart at step {t} (leaf {l}), {case} the bound of {bound:g}: {why}{skipped}{stop}")


def stepwise_distances(fn_a: Callable, layout_a: str, fn_b: Callable, layout_b: str, params: Params,
                       batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms, optimizer: Optimizer,
                       opt_state=None, seed: int = 0, after_run: Callable[[], None] | None = None) -> tuple:
    """``stepwise_verdict``'s measurements: (distances (steps, leaves) float64, the gradients' distance in units of
    their term scale; twins (steps, leaves), the larger distance the +-STEP_TWIN_ULPS twins moved the gradient, same
    unit; whether every step's gradients were the same bits; the step at which the training diverged, or None).
    Strategies as functions with their layouts ("sharded" or "pmap")."""
    params, opt_state = strategies.start_state("stepwise_verdict", optimizer, params, opt_state, mesh)
    recording = strategies.Optimizer(optimizer.init, _recording(optimizer.update))
    units_of = _step_units(loss_terms, mesh)
    rng = np.random.default_rng(seed)
    signs = [rng.choice(np.array([-1.0, 1.0]), size=np.shape(x)) for x in jax.tree.leaves(params)]
    n = mesh.devices.size
    distances, twins, same, diverged = [], [], True, None
    for t, host in enumerate(batches):
        host = {k: np.asarray(v) for k, v in host.items() if k != strategies.SHARDS_KEY}  # rows only
        params = jax.tree.map(np.asarray, params)
        start = (opt_state, jax.tree.map(np.zeros_like, params))
        out = []
        for fn, layout in ((fn_a, layout_a), (fn_b, layout_b)):
            batch = host if layout == "sharded" else {k: v.reshape((n, -1) + v.shape[1:]) for k, v in host.items()}
            out.append(fn(params, [batch], mesh, loss_terms=loss_terms, optimizer=recording, opt_state=start))
            if after_run is not None:
                after_run()
        ga, gb = out[0].opt_state[1], out[1].opt_state[1]
        if not (_finite(params) and (_finite(ga) or _finite(gb))):
            diverged = t  # the training itself diverged: nothing left to compare
            break
        moved = [params] + [_moved(params, signs, sign * STEP_TWIN_ULPS) for sign in (1.0, -1.0)]
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *moved)
        maxima = units_of(stacked, host)
        scale = [m[0] for m in maxima]
        units = [np.spacing(np.asarray(g).dtype.type(s)) for g, s in zip(jax.tree.leaves(ga), scale)]
        twins.append([max(m[1], m[2]) / u for m, u in zip(maxima, units)])
        distances.append(leaf_ulps(ga, gb, scale))
        same = same and _same_bits(ga, gb)
        params, opt_state = out[0].params, out[0].opt_state[0]
        del out, ga, gb
    leaves = len(jax.tree.leaves(params))
    return (np.array(distances, np.float64).reshape(-1, leaves), np.array(twins, np.float64).reshape(-1, leaves),
            same, diverged)


def _finite(tree) -> bool:
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


def _moved(params: Params, signs: list, ulps: float) -> Params:
    """``params``, each entry moved ``ulps`` x its sign ulps of its leaf's largest magnitude."""
    def leaf(x, s):
        x = np.asarray(x)
        unit = np.spacing(np.abs(x).max()) if x.size else x.dtype.type(0)
        return (x + ulps * unit * s).astype(x.dtype)
    leaves, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(tree, [leaf(x, s) for x, s in zip(leaves, signs)])


def _strategy(s) -> tuple[str, Callable, str]:
    if isinstance(s, str):
        if s not in strategies.STRATEGIES:
            raise ValueError(f"equivalence.stepwise_verdict: unknown strategy {s!r}; one of "
                             f"{sorted(strategies.STRATEGIES)} or a function with a strategy's signature")
        return s, strategies.STRATEGIES[s], strategies.LAYOUT[s]
    return getattr(s, "__name__", repr(s)), s, "sharded"


@functools.lru_cache(maxsize=64)
def _recording(update: Callable) -> Callable:
    """``update`` with its state (inner state, gradient): the new state keeps the gradient it was given (one function
    per ``update``, so the strategies' compiled steps are reused)."""
    def recorded(grads, state, params):
        updates, new = update(grads, state[0], params)
        return updates, (new, grads)
    return recorded


@functools.lru_cache(maxsize=64)
def _step_units(loss_terms: LossTerms, mesh: Mesh) -> Callable:
    """(params stacked (3, ...) = (p, p + delta, p - delta), host; the batch, host, in layout "sharded") -> per leaf,
    float64: (the term scale at p, max |g(p + delta) - g(p)|, max |g(p - delta) - g(p)|), g the batch's masked mean
    gradient (one sharded program, called on each of the three). The term scale, at which a reordered sum of the
    gradient's terms rounds: max over entries of sum_k |G_k| / count, G_k the gradient of row block k's total alone (one
    program, on the mesh's first device, block after block; the sum in float64), TERM_BLOCKS blocks per device (the
    largest count up to it that divides a device's rows), count the batch's. One gradient at a time, so the verdict
    holds little more than a step."""
    first, n = mesh.devices.flat[0], mesh.devices.size

    @jax.jit
    def block_gradient(params, block):
        (_, count), grads = jax.value_and_grad(lambda p: strategies.checked_terms(loss_terms, p, block),
                                               has_aux=True)(params)
        return grads, count

    def mean(params, batch):
        total, count = strategies.checked_terms(loss_terms, params, batch)
        return total / jnp.maximum(count, 1.0)
    gradient = jax.jit(jax.grad(mean))

    def units(stacked, host):
        leaves = lambda tree: [np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)
                               for x in jax.tree.leaves(tree)]
        at = [jax.tree.map(lambda x: np.asarray(x)[i], stacked) for i in range(3)]
        rows = len(host["mask"]) // n
        parts = n * max(c for c in range(1, TERM_BLOCKS + 1) if rows % c == 0)
        p0, total, count = jax.device_put(at[0], first), None, 0.0
        for k in range(parts):
            block = jax.device_put({key: v[k * len(v) // parts:(k + 1) * len(v) // parts] for key, v in host.items()},
                                   first)
            grads, c = block_gradient(p0, block)
            if total is None:
                total = [np.zeros(np.shape(g), np.float64) for g in jax.tree.leaves(grads)]
            for t, g in zip(total, jax.tree.leaves(grads)):
                t += np.abs(np.asarray(g))
            count += float(c)
        batch = jax.device_put(host, NamedSharding(mesh, P(AXIS)))
        g = [leaves(gradient(strategies.replicate(p, mesh), batch)) for p in at]
        return [np.array([t.max(initial=0) / max(count, 1.0), np.abs(up - g0).max(initial=0),
                          np.abs(down - g0).max(initial=0)], np.float64) for t, g0, up, down in zip(total, *g)]
    return units


def _same_bits(a: Params, b: Params) -> bool:
    pairs = ((np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return all(x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in pairs)
