"""The harness's centre: the four strategies train to the same parameters.

Guarantees checked:

* pmap and shard_map give bit-identical params on CPU after k steps on the same
  global batches, masks included (devices holding only padding too); sharded
  (XLA's own partitioning of the jit step) stays within 1 ulp a step of them.
  The bounds are chosen by platform in one place (below).
* each of them matches ``single`` (the whole global batch on one device) within
  ``SINGLE_ULPS`` float32 ulps per step: the only difference is the order in
  which the batch's per-sample gradients are summed.
* negative controls: the comparison catches the notebooks' ``pmean(grads)`` when
  devices hold different numbers of real samples, and the shard_map port that
  trains with n times the gradient.
* end to end: one epoch of the real loader and the full-size MLP gives equal
  params and equal test accuracy with every strategy.
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

B = 4  # per device
SMALL_LAYERS = (3072, 32, 16, 10)  # same code path as the notebook MLP, faster to compile

# Allowed difference per training step, in float32 ulps of the leaf's largest
# magnitude (see assert_params_close), chosen by platform here and nowhere else.
#
# pmap vs shard_map: both are per-device programs with the same explicit psum.
# On CPU they lower to the same kernels and are bit-identical (0).
# sharded vs pmap/shard_map: XLA partitions the jit program itself and picks
# other local dot kernels for it, so a gradient entry can come out 1 ulp
# apart; measured at most 0.5 ulp a step over 30 random runs of 1-8 steps with
# uneven masks, so 1 ulp a step is the bound.
# On GPUs NCCL/RCCL may also reorder the n-term cross-device sum; reordering an
# n-term sum moves it by at most about n-1 ulps of its largest term, so n ulps a
# step is the bound there.
MANUAL_ULPS = {"cpu": 0}
SHARDED_ULPS = {"cpu": 1}
# any parallel strategy vs single: one pass over n*B samples versus n passes over
# B then a sum of n partials; measured at most 1.0 ulp a step (same 30 runs), so
# 2. The negative controls below are off by thousands of ulps.
SINGLE_ULPS = 2


def tolerance(kind: dict, platform: str, num_devices: int) -> int:
    return kind.get(platform, num_devices)


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


def host_batches(seed: int, steps: int, n: int, real_per_device: list[int]):
    """Random global batches (n*B rows); device k's block has real_per_device[k] real rows."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        pixels = rng.integers(0, 256, size=(n * B, 3, 32, 32), dtype=np.uint8)
        mask = np.zeros((n, B), bool)
        for k, real in enumerate(real_per_device):
            mask[k, rng.permutation(B)[:real]] = True  # padding anywhere in the block
        out.append({
            "images": loaders.Normalize()(pixels),
            "labels": rng.integers(0, 10, size=n * B).astype(np.int32),
            "mask": mask.reshape(-1),
        })
    return out


def place(host: dict, mesh, layout: str):
    """The same global batch through the loader's own code path (loaders.global_batch)."""
    n = mesh.devices.size
    blocks = {k: {name: rows[k * B:(k + 1) * B] for name, rows in host.items()} for k in range(n)}
    return loaders.global_batch(blocks, mesh, layout)


def train(name, step_fn, params, hosts, learning_rate, mesh):
    layout = strategies.LAYOUT.get(name, "sharded")
    return step_fn(params, [place(h, mesh, layout) for h in hosts], learning_rate, mesh)


def real_counts(n: int):
    """Per-device real-sample counts 0..B, at least one real sample in the global batch."""
    return st.lists(st.integers(0, B), min_size=n, max_size=n).filter(lambda c: sum(c) > 0)


@pytest.fixture(scope="module")
def small_params():
    return model.init_model(SMALL_LAYERS)


def test_parallel_strategies_agree_and_match_single(mesh, small_params):
    n = mesh.devices.size
    platform = mesh.devices.flat[0].platform

    @settings(max_examples=15)
    @given(seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 8), counts=real_counts(n),
           learning_rate=st.sampled_from([1e-3, 1e-2, 0.1, 0.5]))
    def check(seed, steps, counts, learning_rate):
        hosts = host_batches(seed, steps, n, counts)
        result = {name: train(name, fn, small_params, hosts, learning_rate, mesh)
                  for name, fn in strategies.STRATEGIES.items()}
        assert_params_close(result["shard_map"][0], result["pmap"][0], steps=steps,
                            ulps_per_step=tolerance(MANUAL_ULPS, platform, n), what="shard_map vs pmap")
        if platform == "cpu":
            np.testing.assert_array_equal(result["shard_map"][1], result["pmap"][1])
        for name in ("pmap", "shard_map"):
            assert_params_close(result[name][0], result["sharded"][0], steps=steps,
                                ulps_per_step=tolerance(SHARDED_ULPS, platform, n), what=f"{name} vs sharded")
        for name in ("sharded", "pmap", "shard_map"):
            assert_params_close(result[name][0], result["single"][0], steps=steps,
                                ulps_per_step=SINGLE_ULPS, what=f"{name} vs single")
            np.testing.assert_allclose(result[name][1], result["single"][1], rtol=1e-5)

    check()


# --------------------------------------------------------------------------
# Negative controls: wrong steps that the same comparison must catch
# --------------------------------------------------------------------------


def _notebook_step(params, batch, learning_rate):
    # The notebooks' pmap step: mean over this device's real samples, then pmean.
    grads = jax.grad(model.loss)(params, batch)
    grads = lax.pmean(grads, model.AXIS)
    return model.sgd(params, grads, learning_rate), jnp.float32(0)


notebook_update_parallel = jax.pmap(_notebook_step, axis_name=model.AXIS, in_axes=(0, 0, None))


def notebook_pmap(params, batches, learning_rate, mesh):
    params = strategies.stack_replicas(params, mesh)
    for batch in batches:
        params, _ = notebook_update_parallel(params, batch, learning_rate)
    return strategies.first_replica(params), None


def n_times_shard_map(params, batches, learning_rate, mesh):
    # A direct port of the pmap step to jax.shard_map with check_vma=True: the grad
    # of the replicated params is already summed over devices, so pmean changes
    # nothing and the step is n times too large.
    def step(p, batch, lr):
        grads = lax.pmean(jax.grad(model.loss)(p, batch), model.AXIS)
        return model.sgd(p, grads, lr)

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(model.AXIS), P()), out_specs=P()))
    params = strategies.replicate(params, mesh)
    for batch in batches:
        params = step(params, batch, learning_rate)
    return strategies.to_host(params), None


def test_notebook_pmean_is_caught_with_uneven_masks(mesh, small_params):
    n = mesh.devices.size
    counts = [B] + [1] * (n - 1)  # device 0 full, the others mostly padding
    hosts = host_batches(seed=1, steps=2, n=n, real_per_device=counts)
    expected = train("sharded", strategies.sharded, small_params, hosts, 0.1, mesh)[0]
    wrong = train("pmap", notebook_pmap, small_params, hosts, 0.1, mesh)[0]
    with pytest.raises(AssertionError, match="differs"):
        assert_params_close(wrong, expected, ulps_per_step=SINGLE_ULPS, steps=2, what="notebook pmean")


def test_notebook_pmean_agrees_when_every_device_is_full(mesh, small_params):
    # Why the notebooks never noticed: with equal counts per device the mean of the
    # per-device means is the global mean (up to rounding).
    n = mesh.devices.size
    hosts = host_batches(seed=2, steps=2, n=n, real_per_device=[B] * n)
    expected = train("sharded", strategies.sharded, small_params, hosts, 0.1, mesh)[0]
    notebook = train("pmap", notebook_pmap, small_params, hosts, 0.1, mesh)[0]
    assert_params_close(notebook, expected, ulps_per_step=SINGLE_ULPS, steps=2, what="notebook pmean")


def test_n_times_gradient_shard_map_port_is_caught(mesh, small_params):
    n = mesh.devices.size
    hosts = host_batches(seed=3, steps=1, n=n, real_per_device=[B] * n)
    params0 = small_params
    expected = train("shard_map", strategies.shard_map, params0, hosts, 0.1, mesh)[0]
    wrong = train("shard_map", n_times_shard_map, params0, hosts, 0.1, mesh)[0]
    with pytest.raises(AssertionError, match="differs"):
        assert_params_close(wrong, expected, ulps_per_step=SINGLE_ULPS, steps=1, what="n-times port")
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
                                           shuffle=True, seed=7)
        trained[name], losses = fn(params0, train_loader.epoch(0), 0.001, mesh)
        assert losses.shape == (len(train_loader),) and np.isfinite(losses).all()
        accuracy[name] = model.accuracy(trained[name], test_loader.epoch(0))
    steps = len(train_loader)
    platform, n = mesh.devices.flat[0].platform, mesh.devices.size
    assert_params_close(trained["shard_map"], trained["pmap"], steps=steps,
                        ulps_per_step=tolerance(MANUAL_ULPS, platform, n), what="shard_map vs pmap")
    assert_params_close(trained["pmap"], trained["sharded"], steps=steps,
                        ulps_per_step=tolerance(SHARDED_ULPS, platform, n), what="pmap vs sharded")
    assert_params_close(trained["single"], trained["sharded"], steps=steps,
                        ulps_per_step=SINGLE_ULPS, what="single vs sharded")
    # An ulp-level difference can flip at most a near-tie prediction.
    for name in ("pmap", "shard_map", "single"):
        assert abs(accuracy[name] - accuracy["sharded"]) <= 1 / 200, (name, accuracy)
