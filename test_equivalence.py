"""The harness's centre: the four strategies train to the same parameters.

Guarantees checked:

* every pair of strategies ends within ``strategies.ulp_bound`` float32 ulps per
  step of each other after k steps on the same global batches, masks included
  (devices holding only padding too), on 1, 3 and 8 devices: pmap and
  shard_map bit-identical on CPU, sharded within 1 ulp a step of them, all
  within 2 of ``single`` (the whole global batch on one device). The bounds
  are chosen by platform in one place, strategies.ulp_bound, which derives them.
* the strategies follow the mesh: on CPU devices [4, 5, 6, 7] and in a
  permuted order they give the same params as on [0, 1, 2, 3], and pmap's
  results stay on the mesh's devices (a pmap without ``devices=`` is caught).
* a batch in the wrong layout is refused with a message naming the layout.
* negative controls: the comparison catches the notebooks' ``pmean(grads)`` when
  devices hold different numbers of real samples, and the shard_map port that
  trains with n times the gradient.
* end to end: one epoch of the real loader (dataset resident on the devices)
  and the full-size MLP gives equal params and equal test accuracy with every
  strategy (the placements' batches are bit-identical: test_loaders.py).
* any model: the property test draws the model too, from two shapes passed in
  as pure functions: the notebooks' MLP over images (a list of (w, b)) and a
  linear softmax over 40 float features with 3 classes (a dict of params).
* train_loop keeps at most two steps in flight (with a control that fails).
* stateful and non-linear optimizers (momentum, Adam): the strategies end
  within strategies.OPTIMIZER_DRIFT of each other, as measured.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import loaders
import model
import strategies
from conftest import examples

B = 4  # per device
SMALL_LAYERS = (3072, 32, 16, 10)  # same code path as the notebook MLP, faster to compile
COUNTS = (1, 3, 8)  # device counts: one device, an odd count, the full 8
FEATURES, CLASSES = 40, 3  # the linear model's input and output


def linear_loss_terms(params: dict, batch: dict):
    """A linear softmax over float features (B, 40): not an MLP, not images, params a dict."""
    logits_BxC = batch["images"] @ params["w"] + params["b"]
    logp_BxC = logits_BxC - jax.nn.logsumexp(logits_BxC, axis=1, keepdims=True)
    nll_B = -jnp.take_along_axis(logp_BxC, batch["labels"].reshape(-1, 1), axis=1)[:, 0]
    mask_B = batch["mask"].astype(logp_BxC.dtype)
    return jnp.sum(mask_B * nll_B), jnp.sum(mask_B)


def linear_init() -> dict:
    rng = np.random.default_rng(0)
    return {"w": (0.3 * rng.standard_normal((FEATURES, CLASSES))).astype(np.float32),
            "b": np.zeros(CLASSES, np.float32)}


def mlp_features(rng, rows: int) -> np.ndarray:
    return loaders.Normalize()(rng.integers(0, 256, size=(rows, 3, 32, 32), dtype=np.uint8))


def linear_features(rng, rows: int) -> np.ndarray:
    return rng.standard_normal((rows, FEATURES), dtype=np.float32)


def momentum_update(grads, state, params):
    """Heavy-ball momentum: v = beta * v + g, p = p - lr * v (stateful, linear in g)."""
    velocity = jax.tree.map(lambda v, g: state["beta"] * v + g, state["velocity"], grads)
    params = jax.tree.map(lambda p, v: p - state["learning_rate"] * v, params, velocity)
    return params, dict(state, velocity=velocity)


def momentum(learning_rate: float, beta: float = 0.9) -> strategies.Optimizer:
    return strategies.Optimizer(
        lambda p: {"learning_rate": np.float32(learning_rate), "beta": np.float32(beta),
                   "velocity": jax.tree.map(np.zeros_like, p)}, momentum_update)


def adam_update(grads, state, params):
    """Adam (Kingma and Ba), bias-corrected: non-linear in g (g / sqrt(v))."""
    b1, b2, count = np.float32(0.9), np.float32(0.999), state["count"] + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["mu"], grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["nu"], grads)
    scale = state["learning_rate"] * jnp.sqrt(1 - b2 ** count) / (1 - b1 ** count)
    params = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + 1e-8), params, mu, nu)
    return params, dict(state, mu=mu, nu=nu, count=count)


def adam(learning_rate: float) -> strategies.Optimizer:
    return strategies.Optimizer(
        lambda p: {"learning_rate": np.float32(learning_rate), "count": np.float32(0),
                   "mu": jax.tree.map(np.zeros_like, p), "nu": jax.tree.map(np.zeros_like, p)},
        adam_update)


# Fixed shapes (one compilation each): the model is drawn, not its sizes.
MODELS = {"mlp": (model.loss_terms, lambda: model.init_model(SMALL_LAYERS), mlp_features, 10),
          "linear": (linear_loss_terms, linear_init, linear_features, CLASSES)}


def bound(a: str, b: str, mesh) -> int:
    """Allowed ulps per step between strategies a and b on ``mesh`` (strategies.ulp_bound)."""
    return strategies.ulp_bound(a, b, mesh.devices.flat[0].platform, mesh.devices.size)


@pytest.fixture(scope="module", params=COUNTS, ids=lambda c: f"{c}dev")
def count_mesh(request, devices):
    """The policy's first 1, 3 and 8 devices (counts the host lacks are skipped)."""
    if request.param > len(devices):
        pytest.skip(f"needs {request.param} devices, the policy gives {len(devices)}")
    return loaders.data_mesh(devices[:request.param])


def assert_params_close(a, b, *, ulps_per_step: float, steps: int, what: str):
    """Every leaf of a within ``ulps_per_step * steps`` ulps of b (0 means bit-identical).

    The ulp is that of the leaf's largest magnitude: a reordered gradient sum is
    off relative to the size of its terms, not of its result, so an entry near
    zero can legitimately differ by more than its own ulp."""
    for i, (x, y) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b))):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, f"{what}: leaf {i} {x.shape} vs {y.shape}"
        allowed = ulps_per_step * steps * np.spacing(max(np.abs(x).max(), np.abs(y).max()))
        off = np.abs(x - y) > allowed
        assert not off.any(), (
            f"{what}: leaf {i} differs in {off.sum()} of {x.size} entries; max |diff| "
            f"{np.max(np.abs(x - y)):.3g} (allowed {ulps_per_step} ulps x {steps} steps)"
        )


def host_batches(seed: int, steps: int, n: int, real_per_device: list[int], kind: str = "mlp"):
    """Random global batches (n*B rows) for model ``kind``; device k's block has
    real_per_device[k] real rows."""
    _, _, features, classes = MODELS[kind]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = features(rng, n * B)
        mask = np.zeros((n, B), bool)
        for k, real in enumerate(real_per_device):
            mask[k, rng.permutation(B)[:real]] = True  # padding anywhere in the block
        out.append({
            "images": x,
            "labels": rng.integers(0, classes, size=n * B).astype(np.int32),
            "mask": mask.reshape(-1),
        })
    return out


def place(host: dict, mesh, layout: str):
    """The same global batch through the loader's own code path (loaders.global_batch)."""
    n = mesh.devices.size
    blocks = {k: {name: rows[k * B:(k + 1) * B] for name, rows in host.items()} for k in range(n)}
    return loaders.global_batch(blocks, mesh, layout)


def train(name, step_fn, params, hosts, learning_rate, mesh, loss_terms=model.loss_terms,
          optimizer=None):
    """(params, losses) of strategy ``step_fn`` on ``hosts``; SGD(learning_rate) unless
    ``optimizer`` is given."""
    layout = strategies.LAYOUT.get(name, "sharded")
    optimizer = strategies.sgd(learning_rate) if optimizer is None else optimizer
    params, losses, _ = step_fn(params, [place(h, mesh, layout) for h in hosts], mesh,
                                loss_terms=loss_terms, optimizer=optimizer)
    return params, losses


def real_counts(n: int):
    """Per-device real-sample counts 0..B, at least one real sample in the global batch."""
    return st.lists(st.integers(0, B), min_size=n, max_size=n).filter(lambda c: sum(c) > 0)


@pytest.fixture(scope="module")
def small_params():
    return model.init_model(SMALL_LAYERS)


def test_parallel_strategies_agree_and_match_single(count_mesh, small_params):
    mesh = count_mesh
    n = mesh.devices.size
    platform = mesh.devices.flat[0].platform
    initial = {"mlp": small_params, "linear": linear_init()}

    @settings(max_examples=examples(15 if n == 8 else 6))
    @given(seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 8), counts=real_counts(n),
           learning_rate=st.sampled_from([1e-3, 1e-2, 0.1, 0.5]), kind=st.sampled_from(list(MODELS)))
    def check(seed, steps, counts, learning_rate, kind):
        hosts = host_batches(seed, steps, n, counts, kind)
        loss_terms = MODELS[kind][0]
        result = {name: train(name, fn, initial[kind], hosts, learning_rate, mesh, loss_terms)
                  for name, fn in strategies.STRATEGIES.items()}
        names = list(result)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                assert_params_close(result[a][0], result[b][0], steps=steps,
                                    ulps_per_step=bound(a, b, mesh), what=f"{kind}: {a} vs {b}")
        if platform == "cpu":
            np.testing.assert_array_equal(result["shard_map"][1], result["pmap"][1])
        for name in ("sharded", "pmap", "shard_map"):
            np.testing.assert_allclose(result[name][1], result["single"][1], rtol=1e-5)

    check()


# --------------------------------------------------------------------------
# Stateful and non-linear update rules (strategies.ulp_bound: what changes)
# --------------------------------------------------------------------------


def test_momentum_and_adam_drift_as_stated(mesh):
    n, steps, lr = mesh.devices.size, 4, 0.1
    counts = [B] + [(0, 1, 3, B)[k % 4] for k in range(1, n)]
    hosts = host_batches(seed=21, steps=steps, n=n, real_per_device=counts, kind="linear")
    params0 = linear_init()
    run = lambda opt, h=hosts: {name: train(name, fn, params0, h, lr, mesh, linear_loss_terms, opt)[0]
                                for name, fn in strategies.STRATEGIES.items()}
    moved = run(momentum(lr))
    names = list(moved)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            # ulp_bound / (1 - beta): a gradient difference keeps acting through the velocity.
            assert_params_close(moved[a], moved[b], steps=steps, ulps_per_step=bound(a, b, mesh) / 0.1,
                                what=f"momentum: {a} vs {b}")
    adam_runs = run(adam(lr))
    tolerance = 1e-3 * lr * steps  # measured: at most 4.4e-4 * lr a step
    for a in names[:-1]:
        off = max(np.abs(x - y).max() for x, y in zip(jax.tree.leaves(adam_runs[a]),
                                                      jax.tree.leaves(adam_runs["single"])))
        assert off <= tolerance, f"adam: {a} vs single differ by {off:.3g}"
    # Control: one real sample with another label is caught by the same tolerance.
    changed = [dict(h) for h in hosts]
    changed[0]["labels"] = changed[0]["labels"].copy()
    changed[0]["labels"][np.flatnonzero(changed[0]["mask"])[0]] += 1
    changed[0]["labels"] %= CLASSES
    other = train("single", strategies.single, params0, changed, lr, mesh, linear_loss_terms, adam(lr))[0]
    off = max(np.abs(x - y).max() for x, y in zip(jax.tree.leaves(other),
                                                  jax.tree.leaves(adam_runs["single"])))
    assert off > tolerance, off


# --------------------------------------------------------------------------
# The strategies follow the mesh, not JAX's default devices
# --------------------------------------------------------------------------


def cpu_mesh(ids) -> jax.sharding.Mesh:
    cpus = jax.devices("cpu")
    return loaders.data_mesh([cpus[i] for i in ids])


def test_strategies_on_other_devices_give_the_same_params():
    # CPU devices 4..7, permuted: neither the default devices nor their order. The
    # linear model (quick to compile): where a strategy runs does not depend on the model.
    ids = (6, 4, 7, 5)
    base, other = cpu_mesh((0, 1, 2, 3)), cpu_mesh(ids)
    hosts = host_batches(seed=11, steps=2, n=4, real_per_device=[4, 1, 0, 3], kind="linear")
    for name, fn in strategies.STRATEGIES.items():
        want = train(name, fn, linear_init(), hosts, 0.1, base, linear_loss_terms)[0]
        got = train(name, fn, linear_init(), hosts, 0.1, other, linear_loss_terms)[0]
        assert_params_close(got, want, steps=2, ulps_per_step=0, what=f"{name} on CPU {ids}")


def pmap_outputs_on_the_mesh(step_fn, mesh, params) -> None:
    """Runs one pmap step and checks that replica k of every output is on mesh position k."""
    host = host_batches(seed=12, steps=1, n=mesh.devices.size, real_per_device=[B] * mesh.devices.size)[0]
    state = strategies.stack_replicas((params, strategies.sgd(0.1).init(params)), mesh)
    new, losses = step_fn(state, place(host, mesh, "pmap"))
    for leaf in jax.tree.leaves(new) + [losses]:
        devices = [shard.device for shard in sorted(leaf.addressable_shards, key=lambda s: s.index[0].start)]
        assert devices == list(mesh.devices.flat), f"pmap's results are on {devices}"


@pytest.mark.parametrize("ids", [(4, 5, 6, 7), (6, 4, 7, 5)], ids=["cpu4-7", "permuted"])
def test_pmap_results_stay_on_the_mesh(small_params, ids):
    mesh = cpu_mesh(ids)
    step = strategies.pmap_step(model.loss_terms, strategies.sgd_update, tuple(mesh.devices.flat))
    pmap_outputs_on_the_mesh(step, mesh, small_params)


def test_pmap_without_devices_is_caught(small_params):
    # Negative control: the notebooks' pmap (no devices=) maps over the default
    # backend's first devices. On CPU devices [4..7] its results come back on
    # [0..3] (on a GPU host it fails outright); either way the check catches it.
    legacy = jax.pmap(strategies._parallel_step(model.loss_terms, strategies.sgd_update),
                      axis_name=strategies.AXIS)
    on_cpu = jax.devices()[0].platform == "cpu"
    with pytest.raises(AssertionError if on_cpu else Exception,
                       match=r"pmap's results are on \[CpuDevice\(id=0\)" if on_cpu else None):
        pmap_outputs_on_the_mesh(legacy, cpu_mesh((4, 5, 6, 7)), small_params)


@pytest.mark.parametrize("name, given", [("pmap", "sharded"), ("sharded", "pmap"),
                                         ("shard_map", "pmap"), ("single", "pmap")])
def test_a_batch_in_the_wrong_layout_is_refused(small_params, name, given):
    mesh = cpu_mesh((0, 1, 2, 3))
    host = host_batches(seed=13, steps=1, n=4, real_per_device=[B] * 4)[0]
    with pytest.raises(ValueError, match=f"needs batches in layout '{strategies.LAYOUT[name]}'"):
        strategies.STRATEGIES[name](small_params, [place(host, mesh, given)], mesh,
                                    loss_terms=model.loss_terms)


def test_a_batch_on_other_devices_is_refused(small_params):
    host = host_batches(seed=14, steps=1, n=4, real_per_device=[B] * 4)[0]
    batch = place(host, cpu_mesh((4, 5, 6, 7)), "sharded")
    with pytest.raises(ValueError, match="not on the mesh's devices"):
        strategies.sharded(small_params, [batch], cpu_mesh((0, 1, 2, 3)), loss_terms=model.loss_terms)


class FakeValue:
    def __init__(self, log: list, step: int):
        self.log, self.step, self.done = log, step, False

    def block_until_ready(self):
        self.done = True
        return self


def test_at_most_two_steps_in_flight():
    # The fix for a deadlock of XLA's CPU all-reduce under unbounded async dispatch
    # (test_refimpl.py's slow regression test reproduces the original): before
    # step s is dispatched, every step up to s - 2 has finished.
    values = []

    def step(state, batch):
        pending = [v.step for v in values if not v.done]
        assert len(pending) <= 1, f"steps {pending} still in flight when step {len(values)} starts"
        values.append(FakeValue(values, len(values)))
        return state, values[-1]

    state, out = strategies.train_loop(step, None, range(6))
    assert len(values) == 6 and out == values
    # Control: a loop that never waits is caught by the same check.
    values.clear()
    with pytest.raises(AssertionError, match="still in flight"):
        for batch in range(6):
            step(None, batch)


# --------------------------------------------------------------------------
# Negative controls: wrong steps that the same comparison must catch
# --------------------------------------------------------------------------


def _notebook_step(params, batch, learning_rate):
    # The notebooks' pmap step: mean over this device's real samples, then pmean.
    grads = jax.grad(model.loss)(params, batch)
    grads = lax.pmean(grads, model.AXIS)
    return model.sgd(params, grads, learning_rate), jnp.float32(0)


def notebook_pmap(params, batches, mesh, *, loss_terms, optimizer):
    devices = list(mesh.devices.flat)
    step = jax.pmap(_notebook_step, axis_name=model.AXIS, in_axes=(0, 0, None), devices=devices)
    params = strategies.stack_replicas(params, mesh)
    learning_rate = float(optimizer.init(params)["learning_rate"])
    for batch in batches:
        params, _ = step(params, batch, learning_rate)
    return strategies.first_replica(params), None, None


def n_times_shard_map(params, batches, mesh, *, loss_terms, optimizer):
    # A direct port of the pmap step to jax.shard_map with check_vma=True: the grad
    # of the replicated params is already summed over devices, so pmean changes
    # nothing and the step is n times too large.
    def step(p, batch, lr):
        grads = lax.pmean(jax.grad(model.loss)(p, batch), model.AXIS)
        return model.sgd(p, grads, lr)

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(model.AXIS), P()), out_specs=P()))
    params = strategies.replicate(params, mesh)
    learning_rate = float(optimizer.init(params)["learning_rate"])
    for batch in batches:
        params = step(params, batch, learning_rate)
    return strategies.to_host(params), None, None


def test_notebook_pmean_is_caught_with_uneven_masks(mesh, small_params):
    n = mesh.devices.size
    counts = [B] + [1] * (n - 1)  # device 0 full, the others mostly padding
    hosts = host_batches(seed=1, steps=2, n=n, real_per_device=counts)
    expected = train("sharded", strategies.sharded, small_params, hosts, 0.1, mesh)[0]
    wrong = train("pmap", notebook_pmap, small_params, hosts, 0.1, mesh)[0]
    with pytest.raises(AssertionError, match="differs"):
        assert_params_close(wrong, expected, ulps_per_step=bound("pmap", "single", mesh), steps=2,
                            what="notebook pmean")


def test_notebook_pmean_agrees_when_every_device_is_full(mesh, small_params):
    # Why the notebooks never noticed: with equal counts per device the mean of the
    # per-device means is the global mean (up to rounding).
    n = mesh.devices.size
    hosts = host_batches(seed=2, steps=2, n=n, real_per_device=[B] * n)
    expected = train("sharded", strategies.sharded, small_params, hosts, 0.1, mesh)[0]
    notebook = train("pmap", notebook_pmap, small_params, hosts, 0.1, mesh)[0]
    assert_params_close(notebook, expected, ulps_per_step=bound("pmap", "single", mesh), steps=2,
                        what="notebook pmean")


def test_n_times_gradient_shard_map_port_is_caught(mesh, small_params):
    n = mesh.devices.size
    hosts = host_batches(seed=3, steps=1, n=n, real_per_device=[B] * n)
    params0 = small_params
    expected = train("shard_map", strategies.shard_map, params0, hosts, 0.1, mesh)[0]
    wrong = train("shard_map", n_times_shard_map, params0, hosts, 0.1, mesh)[0]
    with pytest.raises(AssertionError, match="differs"):
        assert_params_close(wrong, expected, ulps_per_step=bound("shard_map", "single", mesh),
                            steps=1, what="n-times port")
    # And it is n times, not merely different: the update is n times the correct one.
    right_step = np.asarray(expected[0][0]) - params0[0][0]
    wrong_step = np.asarray(wrong[0][0]) - params0[0][0]
    np.testing.assert_allclose(wrong_step, n * right_step, rtol=1e-3, atol=1e-6)


# --------------------------------------------------------------------------
# End to end through the real loader with the notebooks' full-size MLP
# --------------------------------------------------------------------------


def test_one_epoch_end_to_end(synthetic_dir, mesh, devices):
    params0 = model.init_model()
    test_loader = loaders.make_loader(synthetic_dir, devices[:1], 50, filename_prefix=loaders.TEST_PREFIX)
    trained, accuracy = {}, {}
    for name, fn in strategies.STRATEGIES.items():
        train_loader = loaders.make_loader(synthetic_dir, mesh, 16, layout=strategies.LAYOUT[name],
                                           shuffle=True, seed=7, placement="device")
        trained[name], losses, _ = fn(params0, train_loader.epoch(0), mesh, loss_terms=model.loss_terms,
                                      optimizer=strategies.sgd(0.001))
        assert losses.shape == (len(train_loader),) and np.isfinite(losses).all()
        accuracy[name] = model.accuracy(trained[name], test_loader.epoch(0))
    steps = len(train_loader)
    names = list(trained)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert_params_close(trained[a], trained[b], steps=steps, ulps_per_step=bound(a, b, mesh),
                                what=f"{a} vs {b}")
    # An ulp-level difference can flip at most a near-tie prediction.
    for name in ("pmap", "shard_map", "single"):
        assert abs(accuracy[name] - accuracy["sharded"]) <= 1 / 200, (name, accuracy)


def measure_drift(runs: int = 42, seed: int = 1) -> dict:
    """Largest ulps a step (and max |diff| / (lr * steps)) between each pair of strategies,
    per update rule and model, over ``runs`` random runs on this process's CPU devices."""
    mesh = loaders.data_mesh(jax.devices("cpu"))
    n, rng = mesh.devices.size, np.random.default_rng(seed)
    rules = {"sgd": strategies.sgd, "momentum": momentum, "adam": adam}
    initial = {"mlp": model.init_model(SMALL_LAYERS), "linear": linear_init()}
    worst = {}
    for run in range(runs):
        kind, steps = ("mlp", "linear")[run % 2], int(rng.integers(1, 9))
        counts = [max(int(c), k == 0) for k, c in enumerate(rng.integers(0, B + 1, n))]
        lr = float(rng.choice([1e-3, 1e-2, 0.1]))
        hosts = host_batches(int(rng.integers(2**31)), steps, n, counts, kind)
        for rule, make in rules.items():
            out = {name: train(name, fn, initial[kind], hosts, lr, mesh, MODELS[kind][0], make(lr))[0]
                   for name, fn in strategies.STRATEGIES.items()}
            names = list(out)
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    diff = max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
                               for x, y in zip(jax.tree.leaves(out[a]), jax.tree.leaves(out[b])))
                    old = worst.get((rule, kind, a, b), (0.0, 0.0))
                    worst[rule, kind, a, b] = (max(old[0], strategies.ulps_apart(out[a], out[b]) / steps),
                                               max(old[1], diff / (lr * steps)))
    return worst


if __name__ == "__main__":
    # python test_equivalence.py drift [runs] [seed]: the figures strategies.ulp_bound quotes.
    import sys
    import conftest  # noqa: F401  (8 CPU devices, matmul precision "highest")
    if sys.argv[1:2] != ["drift"]:
        sys.exit("usage: python test_equivalence.py drift [runs] [seed]")
    figures = measure_drift(*(int(a) for a in sys.argv[2:4]))
    for (rule, kind, a, b), (ulps, relative) in sorted(figures.items()):
        print(f"{rule:>8} {kind:>6} {a:>9} vs {b:<9} {ulps:8.2f} ulps/step  {relative:.2g} lr/step")
