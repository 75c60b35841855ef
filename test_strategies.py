"""strategies.py: what a caller passes in, where each strategy runs, the training loop, and
the canonical reduction.

* ``checked`` refuses each wrong layout (told from "mask"), batches on other devices or not
  sharded on 'data', host arrays across processes; it places host arrays in one process.
* The strategies follow the mesh, not JAX's default devices (permuted CPU devices, a pmap
  without ``devices=`` caught); ``single`` keeps its state on the mesh's first device and
  moves only batches not already there. Params come back where they went in (host or devices),
  epochs chained on the devices giving the host chain's bits, the caller's arrays kept.
* The refusals name the contract: float64 params without x64, a ``loss_terms`` that returns a
  mean or a vector, or whose count is not the first batch's real rows, an optimizer that
  breaks optax's contract, a reduction or logical_shards outside its domain.
* Dtypes: float64 trains in float64 with x64 on; bfloat16 trains in bfloat16, the count
  reaching the division exactly past 256 real rows; ``apply_updates`` is optax's arithmetic.
* ``train_loop`` keeps at most two steps in flight and calls back each finished step once,
  in order; steps donate on accelerators only, never the caller's arrays.
* The canonical reduction: the same bits through every strategy on every device count
  dividing L, n = L included, and single (a conv net with LayerNorm and GELU, a token model
  with a tied embedding, LayerNorm and attention, a ReLU MLP; adamw with clipping and a
  schedule, nesterov, lr 40); the compiled block and update programs the same on every
  topology, the sum program without float arithmetic (the exact sum itself: test_summation.py);
  a float64 step with its controls
  (a per-block mean, no max(count, 1)); batches carrying another L refused; MultiSteps' mean
  of means against logical shards' exact mean.

The plain reduction's equivalence (float64 training, the stepwise verdict):
test_equivalence.py, which shares conftest's models and batches.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import equivalence
import loaders
import model
import strategies
from conftest import (B, CLASSES, FEATURES, SMALL_LAYERS, assert_same_bits, bits_differ, compiled_on_each_device,
                      examples, host_batches, linear_init, linear_loss_terms, place, train)


def batch(mask_shape, images_tail=(3, 4, 4)):
    return {"images": np.zeros(mask_shape + images_tail, np.float32), "labels": np.zeros(mask_shape, np.int32),
            "mask": np.ones(mask_shape, bool)}


@pytest.mark.parametrize("strategy, shape, ok", [
    ("pmap", (4, 2), True), ("pmap", (2, 4), False), ("pmap", (8, 1), False), ("pmap", (8,), False),
    ("sharded", (8,), True), ("sharded", (4, 2), False),
    ("shard_map", (8,), True), ("shard_map", (4, 2), False),
    ("single", (8,), True), ("single", (4, 2), False),
])
def test_checked_tells_the_layout_from_the_mask(devices, strategy, shape, ok):
    mesh = loaders.data_mesh(devices[:4])
    host = batch(shape)
    if ok:
        [got] = list(strategies.checked([host], strategy, mesh))
        for key in host:
            assert_same_bits(np.asarray(got[key]), host[key], key)
            if strategy != "single":  # host arrays placed on the mesh, sharded on 'data'
                assert got[key].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), host[key].ndim), key
    else:
        with pytest.raises(ValueError, match=f"strategy '{strategy}', batch at step 0: needs layout "
                                             f"'{strategies.LAYOUT[strategy]}'.*mask of shape {re.escape(str(shape))}"):
            list(strategies.checked([host], strategy, mesh))


def test_checked_reads_no_key_but_mask(devices):
    # Datasets of named arrays: "labels" of any shape (per-token targets), or absent.
    mesh = loaders.data_mesh(devices[:2])
    tokens = {"tokens": np.zeros((4, 48), np.int32), "targets": np.zeros((4, 48), np.int32),
              "mask": np.ones(4, bool)}
    [got] = list(strategies.checked([tokens], "sharded", mesh))
    assert set(got) == set(tokens)
    with pytest.raises(ValueError, match="no 'mask'.*keys \\['images', 'labels'\\]"):
        list(strategies.checked([{"images": np.zeros(4), "labels": np.zeros(4)}], "sharded", mesh))


def test_checked_refuses_a_batch_on_other_devices(devices):
    mesh = loaders.data_mesh(devices[:2])
    elsewhere = loaders.data_mesh(devices[2:4])
    good = jax.device_put(batch((4,)), NamedSharding(mesh, P("data")))
    bad = jax.device_put(batch((4,)), NamedSharding(elsewhere, P("data")))
    assert len(list(strategies.checked([good], "sharded", mesh))) == 1
    with pytest.raises(ValueError, match="at step 1: batch\\['images'\\] lives on .* not on the mesh's devices"):
        list(strategies.checked([good, bad], "sharded", mesh))


def test_checked_refuses_a_batch_not_sharded_on_data(devices):
    # Replicated on the mesh's own devices: every device would compute every row.
    mesh = loaders.data_mesh(devices[:2])
    replicated = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in batch((4,)).items()}
    with pytest.raises(ValueError, match=r"at step 0: batch\['images'\] has sharding .*not NamedSharding\(mesh, P\('data'\)\)"):
        list(strategies.checked([replicated], "sharded", mesh))


def test_checked_refuses_host_arrays_across_processes(devices, monkeypatch):
    mesh = loaders.data_mesh(devices[:2])
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"at step 0: batch\['images'\] is a host array .*2 processes.*"
                                         r"make_array_from_process_local_data"):
        list(strategies.checked([batch((4,))], "sharded", mesh))


def test_checked_judges_each_signature_once_and_the_placement_every_step(devices, monkeypatch):
    """The mask's layout and the host leaves' dtypes (the door's too, per shape) are checked on the first batch of each
    signature only, a batch of a new one at its own step; the mask's presence, devices and sharding on every step."""
    mesh = loaders.data_mesh(devices[:2])
    steps = {"_check_layout": [], "check_dtypes": []}
    for name, called in steps.items():
        def spy(*args, real=getattr(strategies, name), called=called):
            called.append(int(re.search(r"batch at step (\d+)", str(args))[1]))
            return real(*args)
        monkeypatch.setattr(strategies, name, spy)
    on_mesh = jax.device_put(batch((4,)), NamedSharding(mesh, P("data")))
    epoch = [batch((4,)), batch((4,)), batch((4,)), batch((6,)), batch((4,)), on_mesh, on_mesh]
    assert len(list(strategies.checked(epoch, "sharded", mesh))) == len(epoch)
    assert steps == {"_check_layout": [0, 3, 5], "check_dtypes": [0, 3, 5]}
    elsewhere = jax.device_put(batch((4,)), NamedSharding(loaders.data_mesh(devices[2:4]), P("data")))
    replicated = jax.device_put(batch((4,)), NamedSharding(mesh, P()))
    for bad, said in ((batch((4, 2)), "needs layout 'sharded'"), ({"images": on_mesh["images"]}, "no 'mask'"),
                      (dict(on_mesh, images=np.zeros((4, 3, 4, 4))), r"batch: leaf \['images'\] is float64"),
                      (elsewhere, r"batch\['images'\] lives on"), (replicated, r"batch\['images'\] has sharding")):
        with pytest.raises(ValueError, match=f"strategy 'sharded', batch at step 3: {said}"):
            list(strategies.checked([on_mesh, on_mesh, on_mesh, bad], "sharded", mesh))


# --------------------------------------------------------------------------
# The strategies follow the mesh, not JAX's default devices
# --------------------------------------------------------------------------


def cpu_mesh(ids) -> jax.sharding.Mesh:
    cpus = jax.devices("cpu")
    return loaders.data_mesh([cpus[i] for i in ids])


@pytest.mark.bits
@pytest.mark.slow
def test_strategies_on_other_devices_give_the_same_params():
    """The extended tier's; the default tier holds its guarantee with
    test_pmap_results_stay_on_the_mesh[permuted]."""
    # CPU devices 4, 6 and 7, permuted: neither the default devices nor their order. The
    # linear model (quick to compile): where a strategy runs does not depend on the model.
    ids = (6, 4, 7)
    base, other = cpu_mesh((0, 1, 2)), cpu_mesh(ids)
    hosts = host_batches(seed=11, steps=2, n=3, real_per_device=[4, 1, 0], kind="linear")
    for name in ("sharded", "shard_map", "single"):  # pmap: test_pmap_results_stay_on_the_mesh
        fn = strategies.STRATEGIES[name]
        want = train(name, fn, linear_init(), hosts, 0.1, base, linear_loss_terms)[0]
        got = train(name, fn, linear_init(), hosts, 0.1, other, linear_loss_terms)[0]
        for key in want:
            assert_same_bits(got[key], want[key], f"{name} on CPU {ids}: {key}")


def pmap_outputs_on_the_mesh(step_fn, mesh, params) -> None:
    """Runs one pmap step of the linear model and checks that replica k of every output is
    on mesh position k."""
    host = host_batches(seed=12, steps=1, n=mesh.devices.size, real_per_device=[B] * mesh.devices.size,
                        kind="linear")[0]
    state = strategies.stack_replicas((params, strategies.sgd(0.1).init(params)), mesh)
    new, losses = step_fn(state, place(host, mesh, "pmap"))
    for leaf in jax.tree.leaves(new) + [losses]:
        devices = [shard.device for shard in sorted(leaf.addressable_shards, key=lambda s: s.index[0].start)]
        assert devices == list(mesh.devices.flat), f"pmap's results are on {devices}"


@pytest.mark.parametrize("ids", [pytest.param((4, 5, 6, 7), marks=pytest.mark.slow), (6, 4, 7, 5)],
                         ids=["cpu4-7", "permuted"])
def test_pmap_results_stay_on_the_mesh(ids):
    """The default tier holds this guarantee with [permuted] (here [cpu4-7] is the extended
    tier's)."""
    mesh = cpu_mesh(ids)
    step = strategies.pmap_step(linear_loss_terms, strategies.sgd_update, tuple(mesh.devices.flat))
    pmap_outputs_on_the_mesh(step, mesh, linear_init())


def test_pmap_without_devices_is_caught():
    # Negative control: the notebooks' pmap (no devices=) maps over the default
    # backend's first devices. On CPU devices [4..7] its results come back on
    # [0..3] (on a GPU host it fails outright); either way the check catches it.
    def summed(params, batch):
        return jax.lax.psum(jax.grad(lambda p: linear_loss_terms(p, batch)[0])(params), strategies.AXIS)
    gradient = jax.pmap(summed, axis_name=strategies.AXIS)  # no devices=: the legacy form, on purpose
    legacy = lambda state, batch: (gradient(state[0], batch), None)  # its grads, on devices checked alike
    on_cpu = jax.devices()[0].platform == "cpu"  # the default backend, on purpose
    with pytest.raises(AssertionError if on_cpu else Exception,
                       match=r"pmap's results are on \[CpuDevice\(id=0\)" if on_cpu else None):
        pmap_outputs_on_the_mesh(legacy, cpu_mesh((4, 5, 6, 7)), linear_init())


@pytest.mark.parametrize("name, given", [("pmap", "sharded"), ("sharded", "pmap"),
                                         ("shard_map", "pmap"), ("single", "pmap")])
def test_a_batch_in_the_wrong_layout_is_refused(small_params, name, given):
    mesh = cpu_mesh((0, 1, 2, 3))
    host = host_batches(seed=13, steps=1, n=4, real_per_device=[B] * 4)[0]
    with pytest.raises(ValueError, match=f"needs layout '{strategies.LAYOUT[name]}'"):
        strategies.STRATEGIES[name](small_params, [place(host, mesh, given)], mesh,
                                    loss_terms=model.loss_terms)


def test_a_batch_on_other_devices_is_refused(small_params):
    host = host_batches(seed=14, steps=1, n=4, real_per_device=[B] * 4)[0]
    batch = place(host, cpu_mesh((4, 5, 6, 7)), "sharded")
    with pytest.raises(ValueError, match="not on the mesh's devices"):
        strategies.sharded(small_params, [batch], cpu_mesh((0, 1, 2, 3)), loss_terms=model.loss_terms)


def test_single_keeps_its_state_on_the_meshs_first_device():
    # Mesh CPU [5, 6], JAX's default device CPU 0 (conftest): while single trains, its
    # params live on CPU 5 and nowhere else. Seen from the batches' iterator between steps.
    mesh = cpu_mesh((5, 6))
    hosts = host_batches(seed=15, steps=3, n=2, real_per_device=[B, 2], kind="linear")
    seen = []

    def batches():
        for h in hosts:
            live = [a for p in {"cpu", jax.devices()[0].platform} for a in jax.live_arrays(p)]  # the default backend too, on purpose
            seen.append({d for a in live if a.shape == (FEATURES, CLASSES) for d in a.devices()})
            yield place(h, mesh, "sharded")

    assert jax.config.jax_default_device not in mesh.devices.flat
    strategies.single(linear_init(), batches(), mesh, loss_terms=linear_loss_terms, optimizer=strategies.sgd(0.1))
    assert seen[1:] == [{mesh.devices.flat[0]}] * 2, seen


def test_single_moves_a_batch_only_when_it_is_not_on_the_meshs_first_device(monkeypatch):
    """On a mesh of one device a batch placed on it goes to the step as it is (each jax.device_put is a transfer a
    chip pays every step); on a mesh of two, each batch moves to the first device. Both train to the same bits."""
    hosts = host_batches(seed=16, steps=2, n=2, real_per_device=[B, 2], kind="linear")
    puts = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: puts.append(x) or real(x, *a, **k))
    out = {}
    for ids in ((3,), (3, 4)):
        mesh = cpu_mesh(ids)
        batches = [place(h, mesh, "sharded") if len(ids) == 2 else loaders.global_batch({0: h}, mesh) for h in hosts]
        del puts[:]
        out[ids] = strategies.single(linear_init(), batches, mesh, loss_terms=linear_loss_terms,
                                     optimizer=strategies.sgd(0.1))
        moved = [x for x in puts if isinstance(x, dict) and "mask" in x]  # the batches put, not the state
        assert len(moved) == (0 if len(ids) == 1 else len(batches)), (ids, len(moved))
    for got, want in zip(jax.tree.leaves(out[(3,)]), jax.tree.leaves(out[(3, 4)])):
        assert_same_bits(np.asarray(got), np.asarray(want), "single on one device and on two")


@pytest.mark.slow
def test_host_batches_are_placed_on_the_mesh(mesh):
    """The extended tier's; the default tier holds its guarantee with
    test_single_takes_host_leaves_as_they_are_and_the_others_place_them."""
    # NumPy batches given to sharded run sharded (the loader's bits), not on one device:
    # not single's bits, which the issue found they gave.
    n = mesh.devices.size
    hosts = host_batches(seed=16, steps=3, n=n, real_per_device=[B] + [1] * (n - 1))
    params0 = model.init_model(SMALL_LAYERS)
    on_host = strategies.sharded(params0, hosts, mesh, loss_terms=model.loss_terms,
                                 optimizer=strategies.sgd(0.5)).params
    placed = train("sharded", strategies.sharded, params0, hosts, 0.5, mesh, optimizer=strategies.sgd(0.5))[0]
    for i, (x, y) in enumerate(zip(jax.tree.leaves(on_host), jax.tree.leaves(placed))):
        assert_same_bits(x, y, f"host batches vs the loader's global arrays, leaf {i}")
    oracle = train("single", strategies.single, params0, hosts, 0.5, mesh)[0]
    assert equivalence.ulps_apart(on_host, oracle) > 0, "sharded gave single's bits: the batch was not sharded"


# --------------------------------------------------------------------------
# Refused with the contract in the message
# --------------------------------------------------------------------------


def linear_terms(params, batch):
    logits = batch["x"] @ params["w"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], axis=1)[:, 0]
    mask = batch["mask"].astype(logits.dtype)
    return jnp.sum(mask * nll), jnp.sum(mask)


def tiny_batches(n: int, steps: int = 2, dtype=np.float32):
    rng = np.random.default_rng(5)
    return [{"x": rng.standard_normal((4 * n, 6)).astype(dtype), "y": rng.integers(0, 3, 4 * n).astype(np.int32),
             "mask": np.arange(4 * n) % 3 != 2} for _ in range(steps)]


def tiny_params(dtype=np.float32):
    return {"w": (0.3 * np.random.default_rng(6).standard_normal((6, 3))).astype(dtype)}


def for_layout(name: str, batches: list, n: int):
    if strategies.LAYOUT[name] == "pmap":
        return [{k: v.reshape((n, -1) + v.shape[1:]) for k, v in b.items()} for b in batches]
    return batches


def test_float64_params_without_x64_are_refused(devices):
    mesh = loaders.data_mesh(devices[:2])
    for name, fn in strategies.STRATEGIES.items():
        with pytest.raises(ValueError, match=rf"strategy '{name}': params: leaf \['w'\] is float64, which "
                                             r"JAX would silently train as float32 because jax_enable_x64 is off; "
                                             r"cast it .*jax_enable_x64', True"):
            fn(tiny_params(np.float64), for_layout(name, tiny_batches(2), 2), mesh, loss_terms=linear_terms)
    with pytest.raises(ValueError, match=r"strategies.replicate: leaf \[0\] is int64"):
        strategies.replicate([np.arange(3)], mesh)
    strategies.replicate([np.float32(1), 0.5, 3], mesh)  # float32 and Python scalars pass


def test_float64_params_train_in_float64_with_x64_on(devices):
    mesh = loaders.data_mesh(devices[:2])
    with jax.enable_x64(True):  # shard_map places its state as sharded does (replicate)
        for name, fn in [(name, strategies.STRATEGIES[name]) for name in ("sharded", "pmap", "single")]:
            wide = fn(tiny_params(np.float64), for_layout(name, tiny_batches(2, dtype=np.float64), 2), mesh,
                      loss_terms=linear_terms, optimizer=strategies.sgd(0.5))
            w = wide.params["w"]
            assert w.dtype == np.float64 and wide.losses.dtype == np.float64, name
            # Computed in float64, not in float32 and widened: float32 cannot hold these values.
            assert (w != w.astype(np.float32)).mean() > 0.9, (name, w)


def momentum(rate: float, beta: float = 0.9) -> strategies.Optimizer:
    """Heavy-ball SGD whose state is the velocity, in the gradient's own dtype: the state
    shows the dtype the gradients arrive in."""
    def update(grads, velocity, params=None):
        velocity = jax.tree.map(lambda g, v: g + beta * v, grads, velocity)
        return jax.tree.map(lambda v: -rate * v, velocity), velocity
    return strategies.Optimizer(lambda params: jax.tree.map(jnp.zeros_like, params), update)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["plain", "canonical"])
def test_bfloat16_params_train_in_bfloat16_in_every_strategy(devices, reduction):
    """A model computed in bfloat16 (params, data and so its loss): every strategy trains it
    under either reduction and keeps bfloat16 throughout, the gradients too (seen in a
    momentum state, which takes their dtype): the plain reduction seeds the gradient in
    the loss's own dtype (a float32 seed is a bfloat16 loss's wrong cotangent, which JAX
    refuses), the canonical one divides each gradient sum in its own dtype. All four
    agree to bfloat16's precision (bit for bit under the canonical reduction)."""
    mesh = loaders.data_mesh(devices[:2])
    bf16 = jnp.bfloat16
    start = tiny_params(bf16)["w"].astype(np.float32)
    got = {}
    for name, fn in strategies.STRATEGIES.items():
        trained = fn(tiny_params(bf16), for_layout(name, tiny_batches(2, dtype=bf16), 2), mesh,
                     loss_terms=linear_terms, optimizer=momentum(0.5), reduction=reduction,
                     logical_shards=2 if reduction == "canonical" else None)
        w, velocity = trained.params["w"], trained.opt_state["w"]
        assert w.dtype == velocity.dtype == trained.losses.dtype == bf16, (name, w.dtype, velocity.dtype,
                                                                          trained.losses.dtype)
        got[name] = w.astype(np.float32)
        assert np.abs(got[name] - start).max() > 0.01, f"{name} did not train"
    for name, w in got.items():
        if reduction == "canonical":
            assert_same_bits(w, got["single"], name)
        np.testing.assert_allclose(w, got["single"], rtol=2 ** -6, atol=2 ** -8, err_msg=name)


@pytest.mark.parametrize("reduction", [pytest.param("plain", marks=pytest.mark.slow), "canonical"])
def test_every_strategy_trains_on_a_one_device_mesh(devices, reduction):
    """The edge n = 1: each strategy trains on a mesh of one device (not JAX's default
    one), one loss a step, to single's params: the same bits under the canonical
    reduction, float32 rounding apart under the plain one.
    The default tier holds this guarantee with [canonical] (here [plain] is the extended tier's)."""
    mesh = loaders.data_mesh(devices[3:4])
    got = {}
    for name, fn in strategies.STRATEGIES.items():
        trained = fn(tiny_params(), for_layout(name, tiny_batches(1, steps=3), 1), mesh, loss_terms=linear_terms,
                     optimizer=strategies.sgd(0.5), reduction=reduction,
                     logical_shards=1 if reduction == "canonical" else None)
        assert trained.losses.shape == (3,) and np.isfinite(trained.losses).all(), (name, trained.losses)
        got[name] = trained
    for name, trained in got.items():
        if reduction == "canonical":
            assert_same_bits(trained.params["w"], got["single"].params["w"], name)
            assert_same_bits(trained.losses, got["single"].losses, name)
        np.testing.assert_allclose(trained.params["w"], got["single"].params["w"], rtol=1e-6, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(trained.losses, got["single"].losses, rtol=1e-6, err_msg=name)


def test_sgd_updates_are_in_each_gradients_dtype():
    """sgd's updates are -(lr * g) computed in each leaf's own dtype (the float32 rate
    rounded to it first): float32, bfloat16 and float16 leaves, each against NumPy's
    product in that dtype, bit for bit; the state comes back as it went in."""
    rng = np.random.default_rng(8)
    grads = {name: rng.standard_normal(5).astype(dtype)
             for name, dtype in (("f32", np.float32), ("bf16", jnp.bfloat16), ("f16", np.float16))}
    state = strategies.sgd(0.1).init(grads)
    updates, same = strategies.sgd_update(jax.tree.map(jnp.asarray, grads), state)
    assert same is state
    for name, g in grads.items():
        want = -(np.asarray(np.float32(0.1), g.dtype) * g)
        assert updates[name].dtype == g.dtype, (name, updates[name].dtype)
        assert_same_bits(np.asarray(updates[name]), want, name)


def test_every_strategy_checks_its_reduction_and_logical_shards(devices):
    """The reduction is "plain" or "canonical", exactly; the plain one takes no logical
    shards; the canonical one takes an int L >= 1 (a bool is not one), at least the mesh's n
    devices, each rule refused in its own words, and without L on batches that do not carry
    it, nothing: it is refused (fail closed). Both sides of each edge, on one device (where
    every L >= 1 is enough) and on two."""
    one, two = loaders.data_mesh(devices[:1]), loaders.data_mesh(devices[:2])
    for name, fn in strategies.STRATEGIES.items():
        def train_on(mesh, **options):
            n = mesh.devices.size
            return fn(tiny_params(), for_layout(name, tiny_batches(n, steps=1), n), mesh, loss_terms=linear_terms,
                      optimizer=strategies.sgd(0.5), **options)
        for reduction in ("PLAIN", "Canonical", "", None):
            with pytest.raises(ValueError, match=rf"strategy '{name}': reduction must be one of"):
                train_on(two, reduction=reduction)
        with pytest.raises(ValueError, match=rf"strategy '{name}': logical_shards=2 needs reduction='canonical'"):
            train_on(two, logical_shards=2)
        for mesh, bad, rule in ((two, 2.0, "must be an int"), (two, "2", "must be an int"),
                                (one, True, "must be an int"), (one, np.bool_(True), "must be an int"),
                                (one, 1.0, "must be an int"), (one, 0, "must be at least 1"),
                                (two, 0, "must be at least 1"), (two, -2, "must be at least 1"),
                                (two, 1, "is fewer than the mesh's 2 device")):
            with pytest.raises(ValueError, match=rf"strategy '{name}': logical_shards={re.escape(repr(bad))} {rule}"):
                train_on(mesh, reduction="canonical", logical_shards=bad)
        goods = (((one, 1), (two, 2), (two, 3), (two, np.int64(2))) if name == "sharded" else
                 ((two, 2),))
        for mesh, good in goods:  # every edge through one strategy: the checks are shared
            assert np.isfinite(train_on(mesh, reduction="canonical", logical_shards=good).losses).all(), (name, good)
        with pytest.raises(ValueError, match="does not say its logical shards.*pass logical_shards=L"):
            train_on(two, reduction="canonical")


def test_pmap_and_single_refuse_a_run_of_two_processes_or_more(devices, monkeypatch):
    """pmap maps over its own process's devices and single's device holds one process's
    rows: with 2 processes (jax.process_count, as a multi-process run reports it) both
    refuse, naming the count; with 1 they train."""
    mesh = loaders.data_mesh(devices[:2])
    for name in ("pmap", "single"):
        fn = strategies.STRATEGIES[name]
        monkeypatch.setattr(jax, "process_count", lambda: 1)
        fn(tiny_params(), for_layout(name, tiny_batches(2, steps=1), 2), mesh, loss_terms=linear_terms)
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        with pytest.raises(ValueError, match=rf"strategy '{name}' runs in one process only; with 2 processes"):
            fn(tiny_params(), for_layout(name, tiny_batches(2, steps=1), 2), mesh, loss_terms=linear_terms)


def test_to_host_copies_replicated_single_device_and_host_leaves(devices):
    """to_host gives a NumPy copy of every leaf it takes: replicated over a mesh, on one
    device (the mesh's last, not the first), or already on the host (NumPy, a Python
    scalar), each its value; a sharded leaf is refused."""
    mesh = loaders.data_mesh(devices[:2])
    values = np.arange(6, dtype=np.float32)
    tree = {"replicated": jax.device_put(values, NamedSharding(mesh, P())),
            "one_device": jax.device_put(values + 1, devices[-1]), "numpy": values + 2, "scalar": 0.5}
    got = strategies.to_host(tree)
    for key, want in (("replicated", values), ("one_device", values + 1), ("numpy", values + 2),
                      ("scalar", np.asarray(0.5))):
        assert isinstance(got[key], np.ndarray), (key, type(got[key]))
        assert_same_bits(got[key], want, key)
    with pytest.raises(ValueError, match="to_host: expected replicated params"):
        strategies.to_host({"w": jax.device_put(values, NamedSharding(mesh, P(strategies.AXIS)))})


def test_the_optimizer_state_is_made_on_the_meshs_first_device(devices):
    """With no opt_state given, each strategy calls optimizer.init under the mesh's first
    device (here CPU 5 of [5, 6], not JAX's default CPU 0), so that nothing of the run
    is made on a device outside its mesh."""
    mesh = loaders.data_mesh([devices[5], devices[6]])
    assert jax.config.jax_default_device not in mesh.devices.flat
    for name, fn in strategies.STRATEGIES.items():
        seen = []

        def init(params):
            seen.append(jnp.zeros(()).devices())  # an array made where init runs
            return strategies.sgd(0.5).init(params)
        fn(tiny_params(), for_layout(name, tiny_batches(2, steps=1), 2), mesh, loss_terms=linear_terms,
           optimizer=strategies.Optimizer(init, strategies.sgd_update))
        assert seen == [{devices[5]}], (name, seen)


def test_a_batch_without_a_mask_is_refused_naming_what_came(devices):
    """A batch that is not a dict with a 'mask' is refused at its step, the message naming
    what came instead: a dict by its keys, anything else by its type alone."""
    mesh = loaders.data_mesh(devices[:2])
    good = tiny_batches(2, steps=1)[0]
    for batch, said in (({"x": good["x"], "y": good["y"]}, r"got dict with keys \['x', 'y'\]$"),
                        ([good["x"], good["mask"]], r"got list$"), (None, r"got NoneType$")):
        with pytest.raises(ValueError, match=rf"strategy 'sharded', batch at step 1: no 'mask' .*{said}"):
            strategies.sharded(tiny_params(), [good, batch], mesh, loss_terms=linear_terms)


def test_a_64_bit_optimizer_state_given_is_refused(devices):
    """An opt_state passed in is checked as the params are: a float64 leaf (which JAX would
    narrow without x64) is refused by every strategy, naming the state and the leaf."""
    mesh = loaders.data_mesh(devices[:2])
    for name, fn in strategies.STRATEGIES.items():
        with pytest.raises(ValueError, match=rf"strategy '{name}': opt_state: leaf \['learning_rate'\] is float64"):
            fn(tiny_params(), for_layout(name, tiny_batches(2, steps=1), 2), mesh, loss_terms=linear_terms,
               opt_state={"learning_rate": np.float64(0.1)})


def test_single_takes_host_leaves_as_they_are_and_the_others_place_them(devices):
    """checked's placing of NumPy leaves: for single they pass through as they came (single
    moves them to its one device itself, with no stop on the mesh's other devices); for
    every other strategy each becomes a jax.Array sharded on 'data' over the mesh."""
    mesh = loaders.data_mesh(devices[:2])
    for name in strategies.STRATEGIES:
        host = for_layout(name, tiny_batches(2, steps=1), 2)[0]
        (out,) = list(strategies.checked([host], name, mesh))
        for key, leaf in out.items():
            if name == "single":
                assert leaf is host[key], (name, key, type(leaf))
            else:
                assert isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(
                    NamedSharding(mesh, P(strategies.AXIS)), leaf.ndim), (name, key, getattr(leaf, "sharding", None))
                assert_same_bits(np.asarray(leaf), host[key], f"{name}: {key}")


def test_first_replica_is_the_first_devices_copy(devices):
    """first_replica reads replica 0 (the mesh's first device in this process), never
    another: shown on pmap-layout leaves whose replicas differ."""
    mesh = loaders.data_mesh(devices[:4])
    rows = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    stacked = {"w": jax.device_put(rows, NamedSharding(mesh, P(strategies.AXIS))),
               "b": jax.device_put(rows[:, 0] + 100, NamedSharding(mesh, P(strategies.AXIS)))}
    got = strategies.first_replica(stacked)
    assert_same_bits(got["w"], rows[0], "w")
    assert_same_bits(got["b"], np.float32(100), "b")


@pytest.mark.parametrize("returned, said", [
    (lambda total, count: total / count, r"got one array of shape \(\) \(a mean\? return the sum and the count\)"),
    (lambda total, count: (total * jnp.ones(3), count), r"got total of shape \(3,\) and count of shape \(\)"),
    (lambda total, count: (total, count, count), r"got a tuple of length 3(\n|$)"),
    (lambda total, count: total * jnp.ones(4), r"got one array of shape \(4,\)(\n|$)"),  # no mean: no hint
    (lambda total, count: {"total": total}, r"got a dict(\n|$)"),
    (lambda total, count: (total, count * jnp.ones(3)), r"got total of shape \(\) and count of shape \(3,\)"),
    (lambda total, count: (total, count.astype(jnp.int32)), None),  # the control: an int count is fine
    (lambda total, count: (total.astype(jnp.int32), count), r"got total of dtype int32(\n|$)"),
])
def test_a_loss_terms_that_breaks_its_contract_is_refused(devices, returned, said):
    mesh = loaders.data_mesh(devices[:2])
    broken = lambda params, batch: returned(*linear_terms(params, batch))
    for name, fn in strategies.STRATEGIES.items():
        if said is None:
            fn(tiny_params(), for_layout(name, tiny_batches(2, steps=1), 2), mesh, loss_terms=broken)
            continue
        with pytest.raises(TypeError, match=r"loss_terms\(params, batch\) must return \(total, count\).*" + said):
            fn(tiny_params(), for_layout(name, tiny_batches(2, steps=1), 2), mesh, loss_terms=broken)


def test_an_optimizer_that_breaks_its_contract_is_refused(devices):
    mesh = loaders.data_mesh(devices[:2])
    with pytest.raises(TypeError, match="optimizer must have init\\(params\\) and update"):
        strategies.sharded(tiny_params(), tiny_batches(2), mesh, loss_terms=linear_terms, optimizer=0.1)
    class Half:  # one of the two functions only, either one
        def __init__(self, name):
            setattr(self, name, lambda *args: None)
    for half in (Half("init"), Half("update")):
        with pytest.raises(TypeError, match="optimizer must have init\\(params\\) and update.*got Half"):
            strategies.sharded(tiny_params(), tiny_batches(2), mesh, loss_terms=linear_terms, optimizer=half)
    as_list = strategies.Optimizer(lambda p: {}, lambda g, s, p: [g, s])  # optax returns a tuple
    three = strategies.Optimizer(lambda p: {}, lambda g, s, p: (g, s, None))
    for bad in (as_list, three):
        with pytest.raises(TypeError, match=r"must return \(updates, new_state\) as optax does"):
            strategies.sharded(tiny_params(), tiny_batches(2), mesh, loss_terms=linear_terms, optimizer=bad)
    # updates of the params' structure whose leaf has another shape (one that would broadcast)
    wide = strategies.Optimizer(lambda p: {}, lambda g, s, p: ({"w": g["w"][:1]}, s))
    with pytest.raises(TypeError, match=r"must return \(updates, new_state\) as optax does.*got updates"):
        strategies.sharded(tiny_params(), tiny_batches(2), mesh, loss_terms=linear_terms, optimizer=wide)
    lost = strategies.Optimizer(lambda p: {}, lambda g, s, p: ([g["w"]], s))  # updates of another structure
    with pytest.raises(TypeError, match=r"optimizer.update\(grads, state, params\) must return \(updates, "
                                        r"new_state\) as optax does.*got updates"):
        strategies.sharded(tiny_params(), tiny_batches(2), mesh, loss_terms=linear_terms, optimizer=lost)


# --------------------------------------------------------------------------
# train_loop: at most two steps in flight, the callback, donation
# --------------------------------------------------------------------------


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


def test_the_callback_sees_each_finished_step_once_in_order():
    # Step t is reported right after step t + 1 is dispatched (the loop has just waited
    # for t), the last one after the loop; the two-in-flight guard holds throughout.
    values, events = [], []

    def step(state, batch):
        pending = [v.step for v in values if not v.done]
        assert len(pending) <= 1, f"steps {pending} still in flight when step {len(values)} starts"
        values.append(FakeValue(values, len(values)))
        events.append(("dispatch", len(values) - 1))
        return state, values[-1]

    def callback(t, value):
        assert value is values[t] and value.done, f"step {t} reported before it finished"
        events.append(("report", t))

    strategies.train_loop(step, None, range(5), callback)
    want = [("dispatch", 0)] + [e for t in range(1, 5) for e in (("dispatch", t), ("report", t - 1))]
    assert events == want + [("report", 4)]
    # Control: a loop that reports a step as soon as it is dispatched is caught.
    values.clear()
    with pytest.raises(AssertionError, match="reported before it finished"):
        for t in range(2):
            callback(t, step(None, t)[1])


def test_the_callback_gets_the_loops_values(mesh):
    n = mesh.devices.size
    hosts = host_batches(seed=17, steps=4, n=n, real_per_device=[B] * n, kind="linear")
    step = strategies.sharded_step(linear_loss_terms, strategies.sgd_update)
    state = strategies.replicate((linear_init(), strategies.sgd(0.1).init(None)), mesh)
    seen = {}
    state, values = strategies.train_loop(step, state, [place(h, mesh, "sharded") for h in hosts],
                                          lambda t, loss: seen.setdefault(t, float(loss)))
    assert list(seen) == [0, 1, 2, 3]
    assert_same_bits(np.float32(list(seen.values())), strategies.stack_losses(values), "callback's losses")


def test_steps_consume_the_state_they_replace_where_donating_never_the_callers_arrays(mesh):
    # Donated on accelerators, kept on CPU devices (strategies.donates: on CPU a donated
    # step only adds a copy); donate=True forces it, and then the state is consumed.
    n = mesh.devices.size
    rows = host_batches(seed=18, steps=1, n=n, real_per_device=[B] * n, kind="linear")[0]
    host, pmap_batch = place(rows, mesh, "sharded"), place(rows, mesh, "pmap")
    state0 = (linear_init(), strategies.sgd(0.1).init(None))
    donating = strategies.donates(mesh.devices.flat)
    assert donating == (mesh.devices.flat[0].platform != "cpu")
    steps = {"sharded_step": (strategies.sharded_step(linear_loss_terms, strategies.sgd_update),
                              strategies.replicate, host),
             "shard_map_step": (strategies.shard_map_step(linear_loss_terms, strategies.sgd_update, mesh),
                                strategies.replicate, host),
             "pmap_step": (strategies.pmap_step(linear_loss_terms, strategies.sgd_update, tuple(mesh.devices.flat)),
                           strategies.stack_replicas, pmap_batch)}
    for name, (step, put, batch) in steps.items():
        state = put(state0, mesh)
        step(state, batch)
        deleted = [leaf.is_deleted() for leaf in jax.tree.leaves(state)]
        assert deleted == [donating] * len(deleted), f"{name}: donated {deleted}, expected {donating}"
    # update_program, the update every step shares, donates only when asked (on CPU too): the control.
    grads = jax.tree.map(jnp.ones_like, linear_init())
    for donate, consumed in ((None, False), (False, False), (True, True)):
        state = strategies.replicate(state0, mesh)
        apply = strategies.update_program(strategies.sgd_update) if donate is None else \
            strategies.update_program(strategies.sgd_update, donate)
        apply(state, strategies.replicate(grads, mesh), jnp.float32(0), jnp.float32(1))
        deleted = [leaf.is_deleted() for leaf in jax.tree.leaves(state)]
        assert deleted == [consumed] * len(deleted), f"update_program(donate={donate}): donated {deleted}"
    # The caller's arrays (jax.Arrays on the mesh's first device) survive every strategy.
    mine = jax.device_put(linear_init(), mesh.devices.flat[0])
    for name, fn in strategies.STRATEGIES.items():
        batch = pmap_batch if strategies.LAYOUT[name] == "pmap" else host
        fn(mine, [batch], mesh, loss_terms=linear_loss_terms, optimizer=strategies.sgd(0.1))
        for key, leaf in mine.items():
            assert not leaf.is_deleted(), f"{name} consumed the caller's params[{key!r}]"
            assert_same_bits(np.asarray(leaf), linear_init()[key], f"{name}: the caller's params[{key!r}]")


def test_where_the_policy_donates_every_step_consumes_the_state_it_replaces(mesh, monkeypatch):
    """What an accelerator host runs, here on CPU devices (which honour donation) with
    ``donates`` answering yes for them: sharded_step's automatic choice, shard_map_step and
    pmap_step each consume the state passed in, and give the bits of the same step that
    keeps it (donation moves buffers, never values)."""
    n = mesh.devices.size
    rows = host_batches(seed=19, steps=1, n=n, real_per_device=[B, 3] + [B] * (n - 2), kind="linear")[0]
    host, pmap_batch = place(rows, mesh, "sharded"), place(rows, mesh, "pmap")
    state0 = (linear_init(), strategies.sgd(0.1).init(None))

    def steps():  # fresh functions each call: the builders are cached by the functions they get
        terms = lambda p, b: linear_loss_terms(p, b)
        update = lambda g, s, p=None: strategies.sgd_update(g, s, p)
        return {"sharded_step": (strategies.sharded_step(terms, update), strategies.replicate, host),
                "shard_map_step": (strategies.shard_map_step(terms, update, mesh), strategies.replicate, host),
                "pmap_step": (strategies.pmap_step(terms, update, tuple(mesh.devices.flat)),
                              strategies.stack_replicas, pmap_batch)}

    def after_one_step(name, step, put, batch, donated: bool):
        state = put(state0, mesh)
        new, loss = step(state, batch)
        deleted = [leaf.is_deleted() for leaf in jax.tree.leaves(state)]
        assert deleted == [donated] * len(deleted), f"{name}: donated {deleted}, expected {donated}"
        return [np.asarray(leaf.addressable_data(0)) for leaf in jax.tree.leaves((new, loss))]

    kept = {name: after_one_step(name, *built, donated=False) for name, built in steps().items()}
    monkeypatch.setattr(strategies, "donates", lambda devices: True)
    for name, built in steps().items():
        for got, want in zip(after_one_step(name, *built, donated=True), kept[name]):
            assert_same_bits(got, want, name)


def test_params_come_back_where_they_went_in_and_chain_on_the_devices(mesh, monkeypatch):
    """Host params in, host params and state out; jax.Array params in, jax.Arrays out, replicated on the devices the
    strategy ran on (single: the mesh's first). Two epochs chained on the devices give the bits of the same two chained
    through the host, the steps donating (as on accelerators) or not, and the caller's arrays kept. Where the steps
    donate, the caller's arrays are copied (an epoch of no steps still gives new buffers); where not, only put
    (``replicate(..., copy=False)`` shares them)."""
    n = mesh.devices.size
    hosts = host_batches(seed=20, steps=2, n=n, real_per_device=[B, 1] + [B] * (n - 2), kind="linear")
    mine = strategies.replicate(linear_init(), mesh)
    pointers = lambda tree: [x.addressable_data(0).unsafe_buffer_pointer() for x in jax.tree.leaves(tree)]
    assert pointers(strategies.replicate(mine, mesh, copy=False)) == pointers(mine)
    assert set(pointers(strategies.replicate(mine, mesh))).isdisjoint(pointers(mine))
    for name, donating in [(name, d) for d in (False, True) for name in strategies.STRATEGIES]:
        monkeypatch.setattr(strategies, "donates", lambda devices, d=donating: d)
        fn = strategies.STRATEGIES[name]
        terms = lambda p, b: linear_loss_terms(p, b)  # fresh: the step builders are cached by the functions they get
        train = lambda params, batches, state=None: fn(params, [place(h, mesh, strategies.LAYOUT[name])
                                                                for h in batches], mesh, loss_terms=terms,
                                                       optimizer=strategies.sgd(0.1), opt_state=state)
        host = train(linear_init(), hosts[:1])
        host = train(host.params, hosts[1:], host.opt_state)
        assert all(type(x) is np.ndarray for x in jax.tree.leaves((host.params, host.opt_state))), name
        first = train(mine, hosts[:1])
        on = train(first.params, hosts[1:], first.opt_state)
        where = {mesh.devices.flat[0]} if name == "single" else set(mesh.devices.flat)
        for x in jax.tree.leaves((first.params, first.opt_state, on.params, on.opt_state)):
            assert isinstance(x, jax.Array) and x.sharding.is_fully_replicated and x.devices() == where, (name, x)
        for got, want in zip(jax.tree.leaves((on.params, on.opt_state, on.losses)),
                             jax.tree.leaves((host.params, host.opt_state, host.losses))):
            assert_same_bits(np.asarray(got), want, f"{name}: chained on the devices")
        for key, leaf in mine.items():
            assert not leaf.is_deleted(), f"{name} consumed the caller's params[{key!r}]"
            assert_same_bits(np.asarray(leaf), linear_init()[key], f"{name}: the caller's params[{key!r}]")
        none = train(mine, [])
        for a, b in zip(jax.tree.leaves(none.params), jax.tree.leaves(mine)):
            if donating:
                assert a.addressable_data(0).unsafe_buffer_pointer() != b.addressable_data(0).unsafe_buffer_pointer()
            assert_same_bits(np.asarray(a), np.asarray(b), f"{name}: no steps")


# --------------------------------------------------------------------------
# stack_losses: any pytree of values
# --------------------------------------------------------------------------


def test_stack_losses_stacks_any_pytree(devices):
    mesh = loaders.data_mesh(devices[:2])
    replicated = NamedSharding(mesh, P())
    values = [{"loss": jax.device_put(np.float32(t), replicated), "hits": jax.device_put(np.int32(3 * t), devices[0]),
               "per_class": np.array([t, t + 1], np.float32)} for t in range(4)]
    got = strategies.stack_losses(values)
    assert_same_bits(got["loss"], np.arange(4, dtype=np.float32), "loss")
    assert_same_bits(got["hits"], 3 * np.arange(4, dtype=np.int32), "hits")
    assert_same_bits(got["per_class"], np.stack([np.arange(4), np.arange(1, 5)], 1).astype(np.float32), "per_class")
    assert_same_bits(strategies.stack_losses([jax.device_put(np.float32(2), replicated)]), np.float32([2]))
    empty = strategies.stack_losses([])  # no steps: (0,) float32, as the docstring says
    assert empty.shape == (0,) and empty.dtype == np.float32, (empty.shape, empty.dtype)
    sharded = jax.device_put(np.arange(2, dtype=np.float32), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"is sharded .*pass one replica"):
        strategies.stack_losses([sharded])


def test_stack_losses_starts_every_copy_before_it_waits(devices, monkeypatch):
    """stack_losses fetches all values in one jax.device_get (each copy started before any is waited for), not one
    blocking fetch per value; and _train hands it pmap's first replicas, so its losses need no program per step."""
    values = [jax.device_put(np.float32(t), devices[0]) for t in range(5)]
    calls, fetch = [], jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda tree: calls.append(len(jax.tree.leaves(tree))) or fetch(tree))
    assert_same_bits(strategies.stack_losses(values), np.arange(5, dtype=np.float32), "the losses")
    assert calls == [5], calls
    mesh, calls[:] = loaders.data_mesh(devices[:2]), []
    batches = [{"x": np.full((2, 1, 1), t, np.float32), "mask": np.ones((2, 1), bool)} for t in range(3)]
    terms = lambda p, b: (jnp.sum(b["mask"] * (b["x"][..., 0] * p["w"]) ** 2), jnp.sum(b["mask"]).astype(jnp.float32))
    got = strategies.pmap({"w": np.float32(1)}, batches, mesh, loss_terms=terms, optimizer=strategies.sgd(0.0)).losses
    assert calls[0] == 3, calls  # the 3 losses in one fetch
    assert_same_bits(got, np.float32([0, 1, 4]), "pmap's losses, the first replica's")


# --------------------------------------------------------------------------
# Issue 30.7: check_dtypes refuses a NumPy 64-bit scalar leaf (np.float64 is a Python float)
# --------------------------------------------------------------------------


def test_check_dtypes_refuses_a_numpy_float64_scalar():
    # Why it matters: without x64, JAX narrows the scalar to float32 in silence.
    assert not jax.config.jax_enable_x64 and jnp.asarray(np.float64(0.1)).dtype == jnp.float32
    for leaf, name in ((np.float64(0.1), "float64"), (np.complex128(1j), "complex128"), (np.int64(3), "int64")):
        with pytest.raises(ValueError, match=rf"where: leaf \['lr'\] is {name}, which JAX would silently train"):
            strategies.check_dtypes({"lr": leaf}, "where")
    # the control: Python's own scalars are weakly typed and pass, and so does a float32 scalar
    strategies.check_dtypes({"a": 0.1, "b": 3, "c": True, "d": 1j, "e": np.float32(0.1)}, "where")
    # and a scalar passing does not end the search: a float64 leaf after it is refused
    with pytest.raises(ValueError, match=r"where: leaf \['z'\] is float64"):
        strategies.check_dtypes({"a": 0.1, "b": 3, "z": np.arange(3.0)}, "where")


def test_every_placement_helper_refuses_a_64_bit_leaf_by_its_own_name(mesh):
    """replicate and stack_replicas each refuse a float64 leaf (which JAX would
    narrow) naming themselves and the leaf, before anything is placed; the control: the
    same tree in float32 is placed by each, its values kept."""
    wide = {"w": np.arange(4.0)}  # float64
    narrow = {"w": np.arange(4.0, dtype=np.float32)}
    helpers = {"strategies.replicate": lambda t: strategies.replicate(t, mesh),
               "strategies.stack_replicas": lambda t: strategies.stack_replicas(t, mesh)}
    for where, place_it in helpers.items():
        with pytest.raises(ValueError, match=rf"^{where}: leaf \['w'\] is float64, which JAX would silently"):
            place_it(wide)
        placed = place_it(narrow)["w"]
        assert placed.dtype == np.float32
        got = np.asarray(placed.addressable_data(0)).reshape(-1)
        np.testing.assert_array_equal(got, narrow["w"], err_msg=where)


def test_a_batch_whose_rows_do_not_split_into_the_logical_shards_is_refused_by_every_strategy(mesh):
    """The canonical reduction adds one gradient sum per logical block: a global batch of
    n*B rows with L = 3n logical shards (n*B = 4n rows do not split into 3n slots) is
    refused at its step by each strategy (single: on its one device), naming the rows and
    the slots; the control: L = n
    splits them and trains."""
    n = mesh.devices.size
    rows = host_batches(seed=5, steps=1, n=n, real_per_device=[B] * n, kind="linear")[0]
    for name, train in strategies.STRATEGIES.items():
        batch = place(rows, mesh, strategies.LAYOUT[name])
        with pytest.raises(ValueError, match=rf"canonical_step: the batch's {n * B} rows on (1|{n}) device\(s\) do "
                                             rf"not split into {3 * n} slots of one size"):
            train(linear_init(), [batch], mesh, loss_terms=linear_loss_terms, optimizer=strategies.sgd(0.1),
                  reduction="canonical", logical_shards=3 * n)
    params, losses, _ = strategies.sharded(linear_init(), [place(rows, mesh, "sharded")], mesh,
                                           loss_terms=linear_loss_terms, optimizer=strategies.sgd(0.1),
                                           reduction="canonical", logical_shards=n)
    assert np.isfinite(np.asarray(losses)).all()


# --------------------------------------------------------------------------
# The canonical reduction: the same bits on every topology, by construction
# --------------------------------------------------------------------------
#
# The models users bring: a conv net with LayerNorm and GELU, a token model with a tied
# embedding, LayerNorm and causal softmax attention, a ReLU MLP. N = 23 samples, not a
# multiple of any L here, so every epoch ends on a padded step.

CANON_N = 23


def layer_norm(x, gain, bias):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * gain + bias


def conv_terms(params, batch):
    """Two 3x3 convolutions (NHWC), LayerNorm over channels, GELU, mean pool, a LayerNorm head."""
    dims = ("NHWC", "HWIO", "NHWC")
    y_BxHxWxC = jax.lax.conv_general_dilated(batch["x"], params["c1"], (1, 1), "SAME", dimension_numbers=dims)
    y_BxHxWxC = jax.nn.gelu(layer_norm(y_BxHxWxC, params["g1"], params["n1"]))
    y_BxHxWxC = jax.lax.conv_general_dilated(y_BxHxWxC, params["c2"], (2, 2), "SAME", dimension_numbers=dims)
    logits_BxK = layer_norm(jax.nn.gelu(y_BxHxWxC).mean(axis=(1, 2)), params["g2"], params["n2"]) @ params["w"]
    nll_B = -jnp.take_along_axis(jax.nn.log_softmax(logits_BxK), batch["y"][:, None], axis=1)[:, 0]
    mask_B = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask_B * nll_B), jnp.sum(mask_B)


VOCAB, SEQ, WIDTH = 32, 8, 16


def token_terms(params, batch):
    """Next-token prediction: embedding (tied to the output), LayerNorm, causal attention."""
    tokens_BxT = batch["x"]
    x_BxTxD = params["embed"][tokens_BxT] + params["position"]
    h_BxTxD = layer_norm(x_BxTxD, params["g1"], params["b1"])
    q, k, v = (h_BxTxD @ params[name] for name in ("wq", "wk", "wv"))
    scores_BxTxT = jnp.einsum("btd,bsd->bts", q, k) / np.float32(np.sqrt(WIDTH))
    scores_BxTxT = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), scores_BxTxT, -1e9)
    x_BxTxD = x_BxTxD + jax.nn.softmax(scores_BxTxT, -1) @ v @ params["wo"]
    logits_BxTxV = layer_norm(x_BxTxD, params["g2"], params["b2"])[:, :-1] @ params["embed"].T
    nll_BxT = -jnp.take_along_axis(jax.nn.log_softmax(logits_BxTxV), tokens_BxT[:, 1:, None], axis=2)[..., 0]
    mask_B = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask_B * nll_BxT.sum(1)), jnp.sum(mask_B)


def relu_terms(params, batch):
    logits_BxK = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
    nll_B = -jnp.take_along_axis(jax.nn.log_softmax(logits_BxK), batch["y"][:, None], axis=1)[:, 0]
    mask_B = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask_B * nll_B), jnp.sum(mask_B)


def canonical_model(kind: str, N: int = CANON_N):
    """(loss_terms, params, data) of ``kind``: fixed shapes, N samples (CANON_N by default)."""
    rng = np.random.default_rng(7)
    normal = lambda *shape, scale=0.3: (scale * rng.standard_normal(shape)).astype(np.float32)
    ones, zeros = (lambda n: np.ones(n, np.float32)), (lambda n: np.zeros(n, np.float32))
    if kind == "conv":
        params = {"c1": normal(3, 3, 3, 8), "g1": ones(8), "n1": zeros(8), "c2": normal(3, 3, 8, 16, scale=0.1),
                  "g2": ones(16), "n2": zeros(16), "w": normal(16, 10)}
        return conv_terms, params, {"x": normal(N, 8, 8, 3, scale=1.0),
                                    "y": rng.integers(0, 10, N).astype(np.int32)}
    if kind == "token":
        params = {name: normal(*shape) for name, shape in (("embed", (VOCAB, WIDTH)), ("position", (SEQ, WIDTH)),
                                                           ("wq", (WIDTH, WIDTH)), ("wk", (WIDTH, WIDTH)),
                                                           ("wv", (WIDTH, WIDTH)), ("wo", (WIDTH, WIDTH)))}
        params.update(g1=ones(WIDTH), b1=zeros(WIDTH), g2=ones(WIDTH), b2=zeros(WIDTH))
        start, stride = rng.integers(0, VOCAB, (N, 1)), rng.integers(1, 4, (N, 1))
        return token_terms, params, {"x": ((start + np.arange(SEQ) * stride) % VOCAB).astype(np.int32)}
    x = normal(N, 12, scale=1.0)
    params = {"w1": normal(12, 24, scale=0.5), "b1": zeros(24), "w2": normal(24, 4, scale=0.5), "b2": zeros(4)}
    return relu_terms, params, {"x": x, "y": np.argmax(x[:, :4], axis=1).astype(np.int32)}


@pytest.fixture(scope="module")
def canonical_rules():
    """Users' optax chains, built once for the module (a compiled step is cached on them)."""
    optax = pytest.importorskip("optax")
    return {"adamw": optax.chain(optax.clip_by_global_norm(1.0),
                                 optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 0.03, 2, 20))),
            "nesterov": optax.sgd(0.03, momentum=0.9, nesterov=True),
            "chaotic": optax.sgd(40.0), "chaotic-adam": optax.adam(3.0), "sgd": optax.sgd(0.1)}


def canonical_run(devices, strategy: str, n: int, *, kind: str, rule, L: int, b: int, last_batch="fill"):
    """(params, opt_state, losses) of ``strategy`` on the first n devices over one epoch of
    make_loader(logical_shards=L, batch_size=b); L comes from the batches. CANON_N samples, or
    2L + 3 where that is more (every shard then holds 2, and the last step is padded)."""
    loss_terms, params, data = canonical_model(kind, max(CANON_N, 2 * L + 3))
    mesh = loaders.data_mesh(devices[:n])
    loader = loaders.make_loader(data, mesh, b, logical_shards=L, shuffle=True, seed=3, last_batch=last_batch,
                                 layout=strategies.LAYOUT[strategy], prefetch=0)
    return tuple(strategies.STRATEGIES[strategy](params, loader.epoch(0), mesh, loss_terms=loss_terms,
                                                 optimizer=rule, reduction="canonical"))


def topologies(L: int, most: int, every: bool) -> list:
    """(strategy, n): single, and every strategy at n = L; with ``every``, sharded on every n from
    1 to L up to ``most`` devices (those that do not divide L hold a spare slot), and pmap and
    shard_map at n = 3, else sharded at n = 2 (an n < L)."""
    if every:
        runs = [("sharded", n) for n in range(1, min(L, most) + 1)]
        return runs + [(s, min(3, L, most)) for s in ("pmap", "shard_map")] + [("single", 1)]
    runs = [(s, L) for s in ("sharded", "pmap", "shard_map") if L <= most] + [("single", 1)]
    return runs if L <= 2 or most < 2 else runs + [("sharded", 2)]


def differences(runs: dict) -> list:
    """Where each run's (params, opt_state, losses) differs from the first run's, as bytes."""
    (first, want), *rest = runs.items()
    found = []
    for key, got in rest:
        for i, (x, y) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
            why = bits_differ(x, y)
            if why:
                found.append(f"{key} vs {first}, leaf {i}: {why}")
    return found


# (kind, rule, L, b, every n): n = L in every case; "chaotic" is sgd at lr 40, "chaotic-adam" adam at 3
CANONICAL_CASES = [
    pytest.param("relu", "adamw", 2, 4, False, id="relu-adamw-L2", marks=pytest.mark.slow),  # default: relu-sgd-L3
    pytest.param("relu", "sgd", 3, 2, False, id="relu-sgd-L3"),  # n = 2 does not divide 3: a spare slot
    pytest.param("conv", "adamw", 2, 4, False, id="conv-adamw-L2", marks=pytest.mark.slow),
    pytest.param("token", "nesterov", 4, 3, False, id="token-nesterov-L4", marks=pytest.mark.slow),
    pytest.param("conv", "adamw", 8, 1, True, id="conv-adamw-L8-every-n", marks=pytest.mark.slow),
    pytest.param("token", "chaotic", 8, 2, True, id="token-chaotic-L8-every-n", marks=pytest.mark.slow),
    pytest.param("relu", "adamw", 8, 2, False, id="relu-adamw-L8", marks=pytest.mark.slow),
    pytest.param("conv", "chaotic", 4, 2, False, id="conv-chaotic-L4", marks=pytest.mark.slow),
    pytest.param("relu", "nesterov", 8, 1, False, id="relu-nesterov-L8", marks=pytest.mark.slow),
    pytest.param("token", "chaotic-adam", 4, 2, False, id="token-chaotic-adam-L4", marks=pytest.mark.slow),
    pytest.param("relu", "sgd", 24, 1, True, id="relu-sgd-L24-every-n", marks=pytest.mark.slow),
    pytest.param("conv", "sgd", 8, 2, False, id="conv-sgd-L8", marks=pytest.mark.slow),
    pytest.param("token", "adamw", 24, 1, False, id="token-adamw-L24", marks=pytest.mark.slow),
]


@pytest.mark.bits
@pytest.mark.parametrize("kind, rule, L, b, every", CANONICAL_CASES)
def test_canonical_reduction_is_the_same_bits_on_every_topology(devices, canonical_rules, kind, rule, L, b, every):
    """Params, optimizer state and losses, as bytes (NaN payloads included), through every
    strategy at n = L, at an n < L (dividing L or not), and on one device adding the L blocks
    as microbatches (single); the extended tier: every n from 1 to 8 (3, 5, 6 and 7
    included; every strategy at 3) once a model (conv and attention at L = 8, the ReLU MLP at
    24), the other cases at n = L and 2; attention at L = 24 on 2 devices."""
    runs = {key: canonical_run(devices, *key, kind=kind, rule=canonical_rules[rule], L=L, b=b)
            for key in topologies(L, len(devices), every)}
    assert not differences(runs), differences(runs)[:3]
    losses = runs["single", 1][1]
    assert rule.startswith("chaotic") or (np.isfinite(losses).all() and losses[-1] != losses[0]), losses


@pytest.mark.bits
def test_the_canonical_reduction_is_not_the_plain_one_on_another_topology(devices, canonical_rules):
    """The controls of the test above: the plain reduction, the same runs on 4 and 2 devices
    and single: not the same bits (its sums follow the device count); and the canonical one
    at another L (L = 2 against 4 on 2 devices, the same rows a step): not the same bits."""
    loss_terms, params, data = canonical_model("relu")
    runs = {}
    for name, n in (("shard_map", 4), ("shard_map", 2), ("single", 1)):
        mesh = loaders.data_mesh(devices[:n])
        loader = loaders.make_loader(data, mesh, 4 // n * 2, shuffle=True, seed=3, prefetch=0)
        runs[name, n] = tuple(strategies.STRATEGIES[name](params, loader.epoch(0), mesh, loss_terms=loss_terms,
                                                          optimizer=canonical_rules["nesterov"]))
    assert len(differences(runs)) >= 2, differences(runs)
    other_L = {L: canonical_run(devices, "sharded", 2, kind="relu", rule=canonical_rules["nesterov"], L=L, b=8 // L)
               for L in (2, 4)}
    assert differences(other_L), "another L gave the same bits"


def compiled_text(fn, *args) -> str:
    return fn.lower(*args).compile().as_text()


def first_instruction_apart(a: str, b: str) -> str | None:
    """The first line where two compiled programs' texts differ (None if they do not),
    module names and metadata aside."""
    def lines(text):
        return [line.split(", metadata=")[0].strip() for line in text.splitlines()
                if line.strip() and not line.startswith("HloModule")]
    for i, (x, y) in enumerate(zip(lines(a), lines(b))):
        if x != y:
            return f"instruction {i}: {x!r} vs {y!r}"
    la, lb = lines(a), lines(b)
    return None if len(la) == len(lb) else f"{len(la)} vs {len(lb)} instructions"


@pytest.mark.bits
@pytest.mark.slow
def test_the_canonical_programs_compile_alike_on_every_topology(devices, canonical_rules):
    """Statically: on two devices (the programs are single-device and take no n), the block
    program (one block of b rows) and the update program compile to the same optimized HLO,
    each compiled anew on each device (conftest.compiled_on_each_device: elsewhere the suite's
    own cache loads one device's executable on every other, which this test shows safe);
    on meshes of 1, 2 and 4 devices (k = 8, 4 and 2 blocks a device) the sum program adds no
    floats: its float operations are exact ones (multiplies by powers of two, roundings to
    integers, subtractions of an integer's own bits) beside moves, |x| and the max; its sums
    are int32. Its collectives: the maxima's all-reduce, then at k = 1 an all-to-all of the
    blocks' floats, else a reduce-scatter of int32 limbs, and an all-gather. The control: the
    block program of a block of 2b rows (two blocks as one) differs, and the first differing
    instruction is named. The extended tier's; the default tier holds its guarantee with
    test_canonical_reduction_is_the_same_bits_on_every_topology[relu-sgd-L3]."""
    loss_terms, params, data = canonical_model("conv")
    L, b = 8, 2
    rule = canonical_rules["adamw"]
    rows = {k: v[:b] for k, v in data.items()} | {"mask": np.ones(b, bool), "index": np.arange(b, dtype=np.int32)}
    # programs new to this process (functions of their own), so that each device compiles its own
    block = strategies.block_program(lambda p, batch: loss_terms(p, batch))
    update = strategies.update_program(lambda g, s, p=None: rule.update(g, s, p))
    sums = jax.eval_shape(block, params, rows)
    texts = {}
    with compiled_on_each_device():
        for d in devices[:2]:
            on_d = lambda tree: jax.device_put(tree, d)
            texts[d.id, "block"] = compiled_text(block, on_d(params), on_d(rows))
            state = on_d((params, rule.init(params)))
            folded = on_d(jax.tree.map(lambda s: np.zeros(s.shape[1:], s.dtype), sums))
            texts[d.id, "update"] = compiled_text(update, state, *folded)
    for n in [n for n in (1, 2, 4) if n <= len(devices)]:
        mesh = loaders.data_mesh(devices[:n])
        half = {"half": jax.ShapeDtypeStruct((1, 300), jnp.bfloat16)}
        rounds = [jax.tree.map(lambda s: jax.ShapeDtypeStruct((n,) + s.shape[1:], s.dtype,
                                                              sharding=NamedSharding(mesh, P("data"))), (sums, half))]
        text = compiled_text(strategies.sum_program(mesh, L // n), rounds * (L // n))
        floats = set(re.findall(r"= (?:f32|bf16|f16)\[\S* ([a-z\-]+)\(", text))
        assert {"multiply", "round-nearest-even"} <= floats and not floats - {
            "abs", "maximum", "reduce", "reduce-window", "select", "convert", "bitcast", "bitcast-convert", "broadcast",
            "concatenate", "constant", "parameter", "fusion", "get-tuple-element", "all-reduce", "all-gather", "copy",
            "slice", "reshape", "pad", "transpose", "multiply", "round-nearest-even", "floor", "ceil",
            "subtract"}, floats
        # a tuple's type: its first element's
        collectives = set(re.findall(r"= \(?(\w+)\[[^=]*? (all-reduce|all-gather|all-to-all|collective-permute|"
                                     r"reduce-scatter)\(", text))
        moved = ("f32", "all-to-all") if L // n == 1 else ("s32", "reduce-scatter")
        assert collectives - {("s32", "all-reduce"), ("f32", "all-reduce"), ("f32", "all-gather"),
                              ("bf16", "all-gather"), moved} == set(), (n, collectives)
        assert n == 1 or {moved, ("f32", "all-gather")} <= collectives, (n, collectives)
    for kind in ("block", "update"):
        programs = {key: text for key, text in texts.items() if key[1] == kind}
        (first, text), *rest = programs.items()
        for key, other in rest:
            assert first_instruction_apart(text, other) is None, (key, first, first_instruction_apart(text, other))
    double = {k: np.concatenate([v, v]) for k, v in rows.items()}
    apart = first_instruction_apart(texts[devices[0].id, "block"], compiled_text(block, params, double))
    assert apart is not None and apart.startswith("instruction "), apart


def while_body(text: str) -> str:
    """The body of the one ``while`` in a compiled program's text, and every computation it
    calls (fusions, reductions), each instruction with metadata stripped and its names
    numbered in order of appearance: what XLA compiled the loop's iteration to."""
    computations = {}
    for chunk in re.split(r"\n(?=\S)", text):
        head = re.match(r"(?:ENTRY )?%(\S+) ", chunk)
        if head:
            computations[head.group(1)] = chunk
    [body] = re.findall(r" while\(.*?body=%([\w.\-]+)", text)
    names, order, todo, seen = {}, [], [body], set()
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        order.append(name)
        todo += re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", computations[name])
    lines = [line.split(", metadata=")[0].split(", backend_config=")[0] for name in order
             for line in computations[name].splitlines()]
    numbered = re.sub(r"%([\w.\-]+)", lambda m: "%" + str(names.setdefault(m.group(1), len(names))), "\n".join(lines))
    return numbered


def loop_body(loss_terms, params, data, k: int, b: int) -> str:
    """The while body of loop_program at k blocks of b rows (``while_body``), its slot count
    written K: one device's iteration, k's own dimension aside."""
    slots = max(k, strategies.LOOP_SLOTS)
    rows = {key: np.concatenate([x] * -(-k * b // len(x)))[:k * b] for key, x in data.items()}
    text = compiled_text(strategies.loop_program(loss_terms, k, False), params, dict(rows, mask=np.ones(k * b, bool)),
                         np.int32(k))
    assert text.count(" while(") == 1, "XLA removed or unrolled the loop"
    body = re.sub(r"param_(\d+)\.\d+", r"param_\1", while_body(text))  # parameter names carry a module count
    # the slots' own dimension, and the slot count as the index arithmetic's bound (jax's negative-index wrap)
    return re.sub(rf"\[{slots}([,\]])", r"[K\1", body).replace(f"constant({slots})", "constant(K)")


@pytest.mark.bits
@pytest.mark.slow
def test_every_block_of_the_loop_runs_code_that_does_not_depend_on_how_many_blocks():
    """loop_program (LOOP_PLATFORMS' schedule): with k = 1, 7 and 11 blocks of 3 rows on a
    device (L = k * n for any device count n), the while loop's body, with every computation
    it calls, compiles to the same instructions, the slots' own dimension aside: each block
    runs the same arithmetic whatever the device count. The control: blocks of 2 rows compile
    to another body, and the difference is found.
    The extended tier's; the default tier holds its guarantee with
    test_a_loop_of_one_block_keeps_the_block_inside_it (k = 1 against k = 8)."""
    loss_terms, params, data = canonical_model("relu")
    bodies = {(k, b): loop_body(loss_terms, params, data, k, b) for k, b in ((7, 3), (11, 3), (1, 3), (7, 2))}
    for k in (11, 1):
        assert bodies[7, 3] == bodies[k, 3], (k, first_instruction_apart(bodies[7, 3], bodies[k, 3]))
    assert first_instruction_apart(bodies[7, 3], bodies[7, 2]) is not None


@pytest.mark.bits
def test_a_loop_of_one_block_keeps_the_block_inside_it(monkeypatch):
    """What broke the loop schedule's bits on AVX2 CPUs (the token model at L = 8: one device
    against eight, a LayerNorm bias's gradient one rounding apart): at k = 1, rows of one slot
    let XLA see that every iteration reads slot 0, so it hoisted the block's arithmetic out of
    the loop and fused it with its neighbours; k = 8 computed it inside. With LOOP_SLOTS = 2 the
    block's matmuls stay in the body at k = 1 (the HLO, on any CPU); the control, one slot,
    leaves the body none of them. The bits, on the token model: each block's sums at k = 1
    equal its row of k = 8's (a difference there shows only where the CPU's kernels round the
    hoisted and the looped forms apart: CI plays AVX2)."""
    loss_terms, params, data = canonical_model("relu")
    assert loop_body(loss_terms, params, data, 1, 3).count(" dot(") == 5  # 2 forward, 3 backward
    monkeypatch.setattr(strategies, "LOOP_SLOTS", 1)
    strategies.loop_program.cache_clear()
    try:
        assert loop_body(loss_terms, params, data, 1, 3).count(" dot(") == 0
    finally:
        monkeypatch.undo()
        strategies.loop_program.cache_clear()
    loss_terms, params, data = canonical_model("token")
    k, b = 8, 2
    rows = {"x": data["x"][:k * b], "mask": np.ones(k * b, bool)}
    stacked = strategies.loop_program(loss_terms, k, False)(params, rows, np.int32(k))
    for i in range(k):
        one = strategies.loop_program(loss_terms, 1, False)(params, {key: x[i * b:(i + 1) * b] for key, x in
                                                                     rows.items()}, np.int32(1))
        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(stacked), jax.tree.leaves(one)):
            assert_same_bits(np.asarray(y)[0], np.asarray(x)[i], f"block {i}, {jax.tree_util.keystr(path)}")


@pytest.mark.bits
@pytest.mark.slow
@pytest.mark.parametrize("kind, L", [("relu", 4), ("conv", 4), ("token", 8)])
def test_the_loop_schedule_is_the_same_bits_on_every_topology(devices, canonical_rules, monkeypatch, kind, L):
    """A TPU's schedule (LOOP_PLATFORMS: each device's blocks in one loop program), played on
    these CPU devices: params, optimizer state and losses the same bits through sharded on one
    device and on L, and single. (Not promised, and not so for the conv net on
    CPU: the loop's bits against a program a block's; the schedule is fixed by the platform.)
    The extended tier's; the default tier holds its guarantee with
    test_a_loop_of_one_block_keeps_the_block_inside_it (k = 1 against k = 8)."""
    monkeypatch.setattr(strategies, "LOOP_PLATFORMS", ("cpu",))
    runs = {("sharded", n): canonical_run(devices, "sharded", n, kind=kind, rule=canonical_rules["adamw"], L=L, b=2)
            for n in (1, L) if n <= len(devices)}
    runs["single", 1] = canonical_run(devices, "single", 1, kind=kind, rule=canonical_rules["adamw"], L=L, b=2)
    assert len(runs) >= 3 and not differences(runs), differences(runs)[:3]


def test_a_canonical_step_over_max_blocks_is_refused():
    """L over summation.MAX_BLOCKS is refused by canonical_step naming it."""
    mesh = loaders.data_mesh(jax.devices("cpu")[:1])
    with pytest.raises(ValueError, match=r"logical_shards=2048 is over 2047 \(MAX_BLOCKS\)"):
        strategies.canonical_step(linear_terms, strategies.sgd_update, mesh, 2048)


def linear_sgd64(params: dict, batch: dict, rate: float) -> dict:
    """linear_terms' SGD step on one global batch, in float64: the gradient of the masked
    sum over every real row, divided by max(real rows, 1)."""
    w = np.asarray(params["w"], np.float64)
    x, y, mask = (np.asarray(batch[k]) for k in ("x", "y", "mask"))
    z = x.astype(np.float64) @ w
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    return {"w": w - rate * (x.T @ (p * mask[:, None])) / max(mask.sum(), 1)}


def test_the_canonical_step_is_the_float64_mean_gradient_over_the_real_rows(devices, monkeypatch):
    """Equal is not correct: each canonical step, against a float64 step on the same global
    batch (drawn values, uneven masks, blocks of 3 rows, one step all padding), within
    float32 rounding. The controls, each caught by the same comparison: a per-block mean
    (each block divided by its own count, then averaged: the gradient-accumulation bug,
    which blocks of several rows with uneven masks show) and a division by the count
    without max(count, 1) (NaN on the all-padding step)."""
    L, b, n = 4, 3, 2
    mesh = loaders.data_mesh(devices[:n])
    rng = np.random.default_rng(9)
    batches = []
    for mask in (rng.random(L * b) < 0.6, np.zeros(L * b, bool), np.arange(L * b) % 5 != 0):
        mask[:2] = mask[:2] if mask.any() else False
        batches.append({"x": rng.standard_normal((L * b, 6)).astype(np.float32),
                        "y": rng.integers(0, 3, L * b).astype(np.int32), "mask": mask})

    def run(loss_terms):
        params, out = tiny_params(), []
        for batch in batches:
            params = strategies.sharded(params, [batch], mesh, loss_terms=loss_terms, optimizer=strategies.sgd(0.5),
                                        reduction="canonical", logical_shards=L).params
            out.append(params)
        return out

    def apart(trained) -> float:
        """The largest relative distance of a step from the float64 step from the same params."""
        params, each = tiny_params(), []
        for batch, got in zip(batches, trained):
            want = linear_sgd64(params, batch, 0.5)
            each.append(float(np.abs(got["w"] - want["w"]).max() / np.abs(want["w"]).max()))
            params = got
        return float(np.max(each))  # NaN if any step's is
    assert apart(run(linear_terms)) < 2.0**-20
    whole = strategies._total_gradient

    def per_block_mean(loss_terms):  # each block's sums over its own count, counted as 1
        def gradient(params, rows):
            grads, total, count = whole(loss_terms)(params, rows)
            each = jnp.maximum(count, 1.0)
            return jax.tree.map(lambda g: g / each, grads), total / each, jnp.float32(1)
        return gradient
    try:
        monkeypatch.setattr(strategies, "_total_gradient", per_block_mean)
        strategies.block_program.cache_clear()
        assert apart(run(linear_terms)) > 1e-3
        monkeypatch.undo()
        monkeypatch.setattr(strategies, "_divided", lambda x, count: x / count.astype(x.dtype))
        monkeypatch.setattr(jnp, "maximum", lambda a, b: a)  # update_program's max(count, 1) gone
        strategies.block_program.cache_clear()
        strategies.update_program.cache_clear()
        assert np.isnan(apart(run(linear_terms)))
    finally:
        monkeypatch.undo()
        strategies.block_program.cache_clear()
        strategies.update_program.cache_clear()


@pytest.mark.slow
def test_a_canonical_strategy_takes_the_batches_logical_shards_and_refuses_another(devices):
    """Fail closed: a loader's batches carry its plan's L ("logical_shards"). Given no L the
    strategy takes it; given another L (4 or 16 for batches of 8) it refuses, naming both;
    host batches that carry none and no L given: refused. make_loader refuses L below 1 in
    those words.
    The extended tier's; the default tier holds its guarantee with
    test_a_canonical_step_refuses_batches_of_another_plans_logical_shards."""
    loss_terms, params, data = canonical_model("relu")
    mesh = loaders.data_mesh(devices[:2])
    loader = loaders.make_loader(data, mesh, 1, logical_shards=8, shuffle=True, seed=3, prefetch=0)
    batch = loader.batch(0, 0)
    train = lambda batches, **options: strategies.sharded(params, batches, mesh, loss_terms=loss_terms,
                                                          reduction="canonical", **options)
    assert_same_bits(train([batch]).params["w1"], train([batch], logical_shards=8).params["w1"])
    for other in (4, 16):
        with pytest.raises(ValueError, match=f"carries logical_shards=8 .* made for logical_shards={other}"):
            train([batch], logical_shards=other)
    host = {k: np.asarray(v) for k, v in batch.items() if k != "logical_shards"}
    with pytest.raises(ValueError, match="does not say its logical shards"):
        train([host])
    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"logical_shards={bad} must be at least 1"):
            loaders.make_loader(data, mesh, 1, logical_shards=bad)


@pytest.mark.parametrize("reduction", [pytest.param("plain", marks=pytest.mark.slow), "canonical"])
def test_the_count_reaches_the_division_exactly_with_bfloat16_params(devices, reduction):
    """A count is an integer: with bfloat16 params and 257..320 real rows (bfloat16 holds
    integers only up to 256), every strategy's gradient is bfloat16(1/count) for a loss whose
    gradient sum is 1 (the first row's), and so is the loss.
    The default tier holds this guarantee with [canonical] (here [plain] is the extended tier's)."""
    mesh = loaders.data_mesh(devices[:2])
    terms = lambda p, batch: (jnp.sum(batch["mask"] * batch["x"] * p["v"]), jnp.sum(batch["mask"].astype(jnp.float32)))
    record = strategies.Optimizer(lambda p: {"g": jax.tree.map(jnp.zeros_like, p)},
                                  lambda g, s, p: (jax.tree.map(jnp.zeros_like, g), {"g": g}))
    rows, x = 320, np.zeros(320, jnp.bfloat16)
    x[0] = 1
    for count in (257, 300):  # an odd count bfloat16 rounds, an even one it holds
        batch = {"x": x, "mask": np.arange(rows) < count}
        want = np.float32(1 / count).astype(jnp.bfloat16)
        for name, fn in strategies.STRATEGIES.items():
            trained = fn({"v": np.ones((), jnp.bfloat16)}, for_layout(name, [batch], 2), mesh, loss_terms=terms,
                         optimizer=record, reduction=reduction,
                         logical_shards=2 if reduction == "canonical" else None)
            assert_same_bits(np.asarray(trained.opt_state["g"]["v"]), want, f"{name}, count {count}")
            assert_same_bits(trained.losses[0], want, f"{name}, count {count}: the loss")
            assert np.asarray(trained.params["v"]).dtype == jnp.bfloat16, name  # bfloat16 throughout


def masked_mean_terms(p, batch):  # (mean over the real rows, count): 0/0 when all are padding
    total, count = linear_terms(p, batch)
    return total / count, count


def mean_of_all_terms(p, batch):  # (mean over all rows, count): b times too small
    total, count = linear_terms(p, batch)
    return total / batch["mask"].shape[0], count


def unmasked_terms(p, batch):  # a total over every row, padding too, with the right count
    logits = batch["x"] @ p["w"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], axis=1)[:, 0]
    return jnp.sum(nll), jnp.sum(batch["mask"].astype(jnp.float32))


def token_terms_weighted(p, batch):  # a loss weighted by "token": 3 per row, counted so
    total, count = linear_terms(p, batch)
    return 3 * total, 3 * count


# (what, loss_terms, batch change, the message, a regex): each refused by every strategy and step
DOOR_CASES = [
    ("a count that counts padding", lambda p, b: (linear_terms(p, b)[0], jnp.float32(b["mask"].shape[0])), None,
     r"returned total=0, count=[48] when every row is padding, not \(0, 0\)"),
    ("a total that ignores the mask", unmasked_terms, None, r"total=[\d.]+, count=0 when every row is padding"),
    ("a mean over the real rows", masked_mean_terms, None, r"returned total=nan, count=0 when every row is padding"),
    ("a mean over all rows", mean_of_all_terms, None, r"with as many padding rows added: a total that changes"),
    ("a count below the real rows", lambda p, b: (linear_terms(p, b)[0], jnp.maximum(linear_terms(p, b)[1] - 1, 0)),
     None, r"returned count=[25], below its [36] real rows"),
    ("a uint8 mask of 0 and 255", linear_terms, lambda b: dict(b, mask=b["mask"].astype(np.uint8) * 255),
     r"batch\['mask'\] is uint8, not bool"),
    ("an int64 host leaf", linear_terms, lambda b: dict(b, index=np.arange(len(b["mask"])) + 2**31),
     r"batch: leaf \['index'\] is int64, which JAX would silently train as int32"),
]


@pytest.mark.parametrize("what, terms, change, said", DOOR_CASES, ids=[c[0] for c in DOOR_CASES])
def test_a_step_refuses_at_the_door_what_it_would_train_wrong(devices, what, terms, change, said):
    """The first batch of a shape is checked (strategies.door), naming the value and the rule: a
    loss_terms that breaks its contract on the first device's rows (with every row padding its
    total and count are 0; padding rows added change neither; the count is at least the real
    rows), a mask that is not bool, a 64-bit host leaf; through sharded_step in a user's own
    loop and the strategy sharded. The controls: the right loss_terms trains, and so does a
    loss weighted by token (a count of 3 per real row)."""
    mesh = loaders.data_mesh(devices[:2])
    hosts = [change(h) for h in tiny_batches(2, steps=1)] if change else tiny_batches(2, steps=1)
    state = strategies.replicate((tiny_params(), strategies.sgd(0.5).init(tiny_params())), mesh)
    with pytest.raises(ValueError, match=said):
        strategies.sharded_step(terms, strategies.sgd_update)(state, hosts[0])
    with pytest.raises(ValueError, match=said):
        strategies.sharded(tiny_params(), hosts, mesh, loss_terms=terms, optimizer=strategies.sgd(0.5))
    if change is None:
        for good in (linear_terms, token_terms_weighted):
            strategies.sharded(tiny_params(), hosts, mesh, loss_terms=good, optimizer=strategies.sgd(0.5))


def test_the_door_checks_a_shape_once_however_often_the_step_is_built(devices, monkeypatch):
    """canonical_step is built anew for every strategy call (an epoch, in refimpl): the door it
    gets is the same for the same arguments, so three epochs check loss_terms' contract once.
    The control: a door made anew (its cache cleared) checks again."""
    mesh = loaders.data_mesh(devices[:2])
    real, calls = strategies._check_contract, []
    monkeypatch.setattr(strategies, "_check_contract", lambda *a, **k: calls.append(1) or real(*a, **k))
    terms = lambda params, batch: linear_terms(params, batch)  # a loss_terms no other test has checked
    params = tiny_params()
    for _ in range(3):
        params = strategies.sharded(params, tiny_batches(2, steps=2), mesh, loss_terms=terms,
                                    reduction="canonical", logical_shards=2).params
    assert len(calls) == 1, calls
    strategies.door.cache_clear()
    strategies.sharded(params, tiny_batches(2, steps=1), mesh, loss_terms=terms, reduction="canonical",
                       logical_shards=2)
    assert len(calls) == 2, calls


def test_every_way_to_train_has_the_door(devices):
    """One refusal of the test above (a count that counts padding) from every way to train:
    the four strategies in both reductions, and the steps of a user's own loop (sharded_step,
    pmap_step, shard_map_step, canonical_step), each naming itself."""
    mesh = loaders.data_mesh(devices[:2])
    _, terms, _, said = DOOR_CASES[0]
    hosts = tiny_batches(2, steps=1)
    for reduction in ("plain", "canonical"):
        extra = {"logical_shards": 2} if reduction == "canonical" else {}
        for name, fn in strategies.STRATEGIES.items():
            with pytest.raises(ValueError, match=said):
                fn(tiny_params(), for_layout(name, hosts, 2), mesh, loss_terms=terms, reduction=reduction, **extra)
    state = strategies.replicate((tiny_params(), strategies.sgd(0.5).init(tiny_params())), mesh)
    batch = loaders.global_batch({k: {f: v[k * 4:(k + 1) * 4] for f, v in hosts[0].items()} for k in range(2)}, mesh)
    pmap_batch = loaders.global_batch({k: {f: v[k * 4:(k + 1) * 4] for f, v in hosts[0].items()} for k in range(2)},
                                      mesh, "pmap")
    steps = {"sharded_step": (strategies.sharded_step(terms, strategies.sgd_update), state, batch),
             "shard_map_step": (strategies.shard_map_step(terms, strategies.sgd_update, mesh), state, batch),
             "canonical_step": (strategies.canonical_step(terms, strategies.sgd_update, mesh, 2), state, batch),
             "pmap_step": (strategies.pmap_step(terms, strategies.sgd_update, tuple(mesh.devices.flat)),
                           strategies.stack_replicas((tiny_params(), strategies.sgd(0.5).init(tiny_params())), mesh),
                           pmap_batch)}
    for name, (step, start, given) in steps.items():
        with pytest.raises(ValueError, match=f"^{name}: .*{said}"):
            step(start, given)
    # The door knows pmap_step's device count: a host (NumPy) batch of pmap's (n, B) layout trains as placed.
    host = {f: v.reshape((2, 4) + v.shape[1:]) for f, v in hosts[0].items()}
    pmapped = strategies.pmap_step(linear_terms, strategies.sgd_update, tuple(mesh.devices.flat))
    start = lambda: strategies.stack_replicas((tiny_params(), strategies.sgd(0.5).init(tiny_params())), mesh)
    (got, _), losses = pmapped(start(), host)
    (want, _), _ = pmapped(start(), loaders.global_batch({k: {f: v[k] for f, v in host.items()} for k in range(2)},
                                                         mesh, "pmap"))
    assert np.isfinite(np.asarray(losses)).all()
    assert_same_bits(np.asarray(got["w"]), np.asarray(want["w"]), "pmap_step: a host batch against the placed one")


def test_a_canonical_step_refuses_batches_of_another_plans_logical_shards(devices):
    """canonical_step made for L = 4 refuses a batch whose loader planned L = 8 (its
    "logical_shards"), naming both; the control: made for 8, it trains that batch."""
    loss_terms, params, data = canonical_model("relu")
    mesh = loaders.data_mesh(devices[:2])
    batch = next(iter(loaders.make_loader(data, mesh, 2, logical_shards=8).epoch(0)))
    state = strategies.replicate((params, strategies.sgd(0.1).init(params)), mesh)
    with pytest.raises(ValueError, match=r"canonical_step: the batch carries logical_shards=8 \(its loader's plan\), "
                                         r"but the step was made for logical_shards=4"):
        strategies.canonical_step(loss_terms, strategies.sgd_update, mesh, 4)(state, batch)
    strategies.canonical_step(loss_terms, strategies.sgd_update, mesh, 8)(state, batch)


def test_apply_updates_adds_in_the_wider_dtype_then_casts_as_optax_does(devices):
    """strategies.apply_updates is optax.apply_updates' arithmetic: p + u in the wider of the two
    dtypes, then cast to p's (a bfloat16 leaf with a float32 update rounds once); the control:
    casting the update first rounds twice and gives other bits."""
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(3)
    w = rng.standard_normal(64).astype(jnp.bfloat16)
    ulp = np.abs(np.nextafter(w, np.array(np.inf, jnp.bfloat16)).astype(np.float32) - w.astype(np.float32))
    # Just over half a bfloat16 ulp of w: rounded once it carries w up, cast first it ties to even.
    p = {"w": w, "b": rng.standard_normal(4).astype(np.float32)}
    u = {"w": (ulp * (0.5 + 2.0**-12)).astype(np.float32), "b": (1e-3 * rng.standard_normal(4)).astype(np.float32)}
    mine, theirs = strategies.apply_updates(p, u), optax.apply_updates(p, u)
    for key in p:
        assert_same_bits(np.asarray(mine[key]), np.asarray(theirs[key]), key)
        assert np.asarray(mine[key]).dtype == p[key].dtype
    cast_first = (p["w"] + u["w"].astype(jnp.bfloat16)).astype(jnp.bfloat16)
    assert bits_differ(np.asarray(mine["w"]), cast_first) is not None


@pytest.mark.bits
@pytest.mark.slow
def test_gradient_accumulation_with_multisteps_is_a_mean_of_means_and_logical_shards_are_exact(devices):
    """optax.MultiSteps(k=2) over two padded steps (128 and 72 real rows) applies the mean of
    the two steps' mean gradients, not the mean over the 200 real rows: held against a float64
    step, it is far outside float32 rounding. What the project offers instead: the two steps as
    one global batch of 16 logical shards on 2 devices, the canonical reduction: the float64
    step within rounding.
    The extended tier's; the default tier holds its guarantee with
    test_the_canonical_step_is_the_float64_mean_gradient_over_the_real_rows."""
    optax = pytest.importorskip("optax")
    mesh = loaders.data_mesh(devices[:2])
    rng = np.random.default_rng(11)
    rows = [{"x": rng.standard_normal((128, 6)).astype(np.float32), "y": rng.integers(0, 3, 128).astype(np.int32),
             "mask": np.arange(128) < real} for real in (128, 72)]
    both = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    want = linear_sgd64(tiny_params(), both, 0.5)["w"]
    accumulated = strategies.sharded(tiny_params(), rows, mesh, loss_terms=linear_terms,
                                     optimizer=optax.MultiSteps(optax.sgd(0.5), every_k_schedule=2)).params["w"]
    exact = strategies.sharded(tiny_params(), [both], mesh, loss_terms=linear_terms, optimizer=strategies.sgd(0.5),
                               reduction="canonical", logical_shards=16).params["w"]
    relative = lambda got: float(np.abs(got - want).max() / np.abs(want - tiny_params()["w"]).max())
    assert relative(exact) < 2.0**-16 < 1e-2 < relative(accumulated), (relative(exact), relative(accumulated))


def test_the_canonical_programs_carry_their_own_xla_options(monkeypatch):
    """The options the canonical programs need are the code's, not the user's: the block, sum
    and update programs are each compiled with CANONICAL_XLA_OPTIONS (on GPUs: deterministic
    kernels, no autotuning; each device compiles its own copy)."""
    seen = []
    real = jax.jit

    def recording(fn, **options):
        seen.append(options.get("compiler_options"))
        return real(fn, **options)
    monkeypatch.setattr(strategies.jax, "jit", recording)
    for build in (strategies.block_program, strategies.sum_program, strategies.update_program):
        build.cache_clear()
    try:
        strategies.block_program(linear_terms)
        strategies.sum_program(loaders.data_mesh(jax.devices("cpu")[:2]), 1)
        strategies.update_program(strategies.sgd_update)
    finally:
        monkeypatch.undo()
        for build in (strategies.block_program, strategies.sum_program, strategies.update_program):
            build.cache_clear()
    assert seen == [strategies.CANONICAL_XLA_OPTIONS] * 3, seen
    assert strategies.CANONICAL_XLA_OPTIONS == {"xla_gpu_deterministic_ops": True, "xla_gpu_autotune_level": 0}


def keep_gradient():
    """An optimizer that moves nothing and keeps the gradient it was handed as its state."""
    return strategies.Optimizer(lambda p: jax.tree.map(np.zeros_like, p),
                                lambda g, s, p: (jax.tree.map(jnp.zeros_like, g), g))


@given(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 3, 7, 255, 2**20 + 1]))
@settings(max_examples=examples(20))
def test_the_update_divides_as_numpys_float32_division(seed, count):
    """update_program's g / max(count, 1), the gradient the optimizer is handed, and the loss
    total / max(count, 1): bit for bit NumPy's float32 division (bfloat16 leaves: in float32,
    then cast), for drawn sums over many binades and counts from 0 up. The control: a
    reciprocal multiply, g * (1 / count), which XLA:CPU once chose by itself, differs."""
    import ml_dtypes
    rng = np.random.default_rng(seed)
    sums = {"f": (rng.standard_normal(64) * 2.0 ** rng.integers(-30, 30, 64)).astype(np.float32),
            "h": (rng.standard_normal(16) * 8).astype(ml_dtypes.bfloat16)}
    total = np.float32(rng.standard_normal() * 100)
    params = jax.tree.map(np.zeros_like, sums)
    rule = keep_gradient()
    ((_, handed), loss) = strategies.update_program(rule.update)((params, rule.init(params)), sums, total,
                                                                 np.float32(count))
    c = np.float32(max(count, 1))
    assert_same_bits(np.asarray(handed["f"]), sums["f"] / c, "float32 leaf")
    assert_same_bits(np.asarray(handed["h"]), (sums["h"].astype(np.float32) / c).astype(ml_dtypes.bfloat16), "bf16")
    assert_same_bits(np.asarray(loss), total / c, "loss")
    if count in (3, 7, 255):
        assert bits_differ(sums["f"] * (np.float32(1) / c), sums["f"] / c)


@pytest.mark.parametrize("reduction", ["plain", "canonical"])
def test_a_step_of_padding_only_reports_a_loss_of_zero(devices, reduction):
    """A step whose rows are all padding reports loss +0.0 (0 / max(0, 1)), not NaN, through
    every strategy; its neighbours' losses are finite and positive."""
    mesh = loaders.data_mesh(devices[:2])
    hosts = tiny_batches(2, steps=3)
    hosts[1] = dict(hosts[1], mask=np.zeros(8, bool))
    extra = {"logical_shards": 2} if reduction == "canonical" else {}
    for name, fn in strategies.STRATEGIES.items():
        losses = fn(tiny_params(), for_layout(name, hosts, 2), mesh, loss_terms=linear_terms, reduction=reduction,
                    **extra).losses
        assert losses[1] == 0 and not np.signbit(losses[1]) and (losses[[0, 2]] > 0).all(), (name, losses)


def test_the_keys_and_the_axis_both_modules_spell_are_the_same():
    """strategies.py and loaders.py are copied apart, so each spells the batch's keys and the
    mesh axis itself: the same words."""
    assert (strategies.AXIS, strategies.SHARDS_KEY) == (loaders.DATA_AXIS, loaders.SHARDS)
    assert "mask" == loaders.MASK and strategies.LAYOUT["pmap"] in loaders.LAYOUTS
