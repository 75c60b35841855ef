"""Tests for model.py on its own and the param-layout helpers of strategies.py.

Guarantees checked:

* init_model: float32 (in, out) weights and (out,) biases; the values are
  0.1 * randn drawn from RandomState(0) in the notebooks' order (w, then b, layer
  by layer); every call without ``rng`` returns the same params (unlike the
  notebooks' shared default RandomState, shown as a control); a passed ``rng``
  is the one drawn from.
* predict: (B, 3, 32, 32) and (B, 3072) give equal log-probabilities whose
  exponentials sum to 1, and match a float64 NumPy forward pass.
* loss_terms: (sum(mask * nll), sum(mask)), its mean against float64 NumPy; the
  notebooks' formula when nothing is masked; 0 with zero gradient when
  everything is masked.
* Changing the images and labels of mask-False slots leaves the loss and the
  gradient bit-identical; the same change to a mask-True slot does not (control).
* accuracy counts only mask-True slots and raises without any.
* replicate / stack_replicas / first_replica / to_host put params
  where their docstrings say and round-trip them exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import loaders
import model
import strategies
from conftest import assert_same_bits, bits_differ

LAYERS = (3072, 32, 16, 10)  # the notebook MLP's code path, quick to compile
B = 8
SEEDS = st.integers(0, 2**32 - 1)
MASKS = st.lists(st.booleans(), min_size=B, max_size=B).map(lambda m: np.array(m, bool))

# float32 vs float64 forward pass. The first layer's 3072-term dot products of
# terms ~0.1 round like a random walk, about sqrt(3072) * 6e-8 * 0.1 ~ 3e-7 per
# pre-activation; tanh is 1-Lipschitz and log-softmax at most 2-Lipschitz (max
# norm), so the log-probabilities (and any mean of them, the loss) should be off
# by ~1e-6. Measured: 4e-7. This holds at matmul precision "highest", which
# conftest sets: NVIDIA's default TF32 was measured 1.4e-4 off on an H200. 1e-5 leaves headroom; dropping one bias (0.1 * randn)
# or swapping tanh for relu moves them by ~1e-1.
ATOL = 1e-5

def masked_mean(params, batch):
    total, count = model.loss_terms(params, batch)
    return total / jnp.maximum(count, 1.0)


loss = jax.jit(masked_mean)
grad = jax.jit(jax.grad(masked_mean))
value_and_grad = jax.jit(jax.value_and_grad(masked_mean))


@pytest.fixture(scope="module")
def params():
    return model.init_model(LAYERS)


def make_batch(seed: int, mask, size: int = B) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "images": rng.standard_normal((size, 3, 32, 32), dtype=np.float32),
        "labels": rng.integers(0, 10, size).astype(np.int32),
        "mask": np.asarray(mask, bool),
    }


def predict64(params, images) -> np.ndarray:
    x = np.asarray(images, np.float64).reshape(len(images), -1)
    for w, b in params[:-1]:
        x = np.tanh(x @ w.astype(np.float64) + b)
    w, b = params[-1]
    z = x @ w.astype(np.float64) + b
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def loss64(params, batch) -> float:
    nll = -predict64(params, batch["images"])[np.arange(len(batch["labels"])), batch["labels"]]
    mask = batch["mask"].astype(np.float64)
    return float((mask * nll).sum() / max(mask.sum(), 1.0))


def leaves(tree) -> list:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def trees_equal(a, b) -> bool:
    """Same structure and every leaf the same bits (-0.0 is not 0.0)."""
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(bits_differ(x, y) is None for x, y in zip(leaves(a), leaves(b))))


# --------------------------------------------------------------------------
# init_model
# --------------------------------------------------------------------------


def expected_init(layers, seed: int) -> list:
    rng = np.random.RandomState(seed)
    out = []
    for i in range(len(layers) - 1):
        w = rng.standard_normal((layers[i], layers[i + 1])) * 0.1
        b = rng.standard_normal(layers[i + 1]) * 0.1
        out.append((np.float32(w), np.float32(b)))
    return out


def test_init_model_notebook_values_and_shapes():
    params = model.init_model()
    assert [(w.shape, b.shape) for w, b in params] == [
        ((3072, 1024), (1024,)), ((1024, 1024), (1024,)), ((1024, 10), (10,))]
    assert all(x.dtype == np.float32 for x in leaves(params))
    assert trees_equal(params, expected_init(model.LAYERS, 0))


def test_init_model_default_is_fresh_every_call():
    assert trees_equal(model.init_model(LAYERS), model.init_model(LAYERS))

    # Control: the notebooks' signature shares one RandomState between calls.
    def notebook_init(layers, rng=np.random.RandomState(0)):
        return model.init_model(layers, rng)

    assert trees_equal(notebook_init(LAYERS), expected_init(LAYERS, 0))
    assert not trees_equal(notebook_init(LAYERS), expected_init(LAYERS, 0))


def test_init_model_draws_from_the_given_rng():
    rng = np.random.RandomState(1)
    params = model.init_model(LAYERS, rng)
    assert trees_equal(params, expected_init(LAYERS, 1))
    assert not trees_equal(params, model.init_model(LAYERS))
    # It consumed exactly the draws it used: the stream continues where they end.
    reference = np.random.RandomState(1)
    reference.standard_normal(sum(x.size for x in leaves(params)))
    assert rng.standard_normal() == reference.standard_normal()


# --------------------------------------------------------------------------
# predict and loss
# --------------------------------------------------------------------------


def test_predict_layouts_normalisation_and_float64_reference(params):
    images = make_batch(0, [True] * B)["images"]
    logp = np.asarray(model.predict(params, images))
    assert logp.shape == (B, 10) and logp.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(model.predict(params, images.reshape(B, -1))), logp)
    np.testing.assert_allclose(np.exp(logp).sum(axis=1), 1.0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(logp, predict64(params, images), rtol=0, atol=ATOL)


@given(seed=SEEDS, mask=MASKS)
def test_loss_matches_float64_reference(params, seed, mask):
    batch = make_batch(seed, mask)
    np.testing.assert_allclose(float(loss(params, batch)), loss64(params, batch),
                               rtol=0, atol=ATOL)


def test_unmasked_loss_is_the_notebooks_loss(params):
    batch = make_batch(1, [True] * B)
    onehot = jax.nn.one_hot(batch["labels"], 10)
    notebook = -jnp.mean(jnp.sum(model.predict(params, batch["images"]) * onehot, axis=1))
    np.testing.assert_allclose(float(loss(params, batch)), float(notebook), rtol=1e-6)


@pytest.mark.parametrize("real", range(B + 1))
def test_loss_divides_by_the_real_count_at_every_count(params, real):
    # sum(mask * nll) / max(sum(mask), 1) at each count 0..B: the max's edge (0 and 1
    # real samples both divide by 1) and every count on either side of it.
    mask = np.zeros(B, bool)
    mask[np.random.default_rng(real).permutation(B)[:real]] = True
    batch = make_batch(10 + real, mask)
    np.testing.assert_allclose(float(loss(params, batch)), loss64(params, batch), rtol=0, atol=ATOL)


def test_fully_masked_loss_is_zero_with_zero_gradient(params):
    value, grads = value_and_grad(params, make_batch(2, [False] * B))
    assert float(value) == 0.0
    assert all(not g.any() for g in leaves(grads))


# --------------------------------------------------------------------------
# Masked slots
# --------------------------------------------------------------------------


def perturb(batch: dict, rows, seed: int) -> dict:
    """New images (10x larger) and different labels in ``rows``, the rest untouched."""
    rng = np.random.default_rng(seed)
    out = {k: v.copy() for k, v in batch.items()}
    out["images"][rows] = 10 * rng.standard_normal(out["images"][rows].shape, dtype=np.float32)
    out["labels"][rows] = (out["labels"][rows] + rng.integers(1, 10, len(out["labels"][rows]))) % 10
    return out


@given(seed=SEEDS, mask=MASKS, real=st.integers(0, B - 1))
def test_masked_slots_change_nothing(params, seed, mask, real):
    mask[real] = True  # a real slot for the control
    batch = make_batch(seed, mask)
    value, grads = value_and_grad(params, batch)

    value_p, grads_p = value_and_grad(params, perturb(batch, ~mask, seed))
    assert_same_bits(value_p, value, "the loss")
    for i, (g_p, g) in enumerate(zip(leaves(grads_p), leaves(grads))):
        assert_same_bits(g_p, g, f"gradient leaf {i}")

    # Control: the same change to one real slot changes both.
    value_r, grads_r = value_and_grad(params, perturb(batch, np.arange(B) == real, seed))
    assert not np.array_equal(value_r, value)
    assert not trees_equal(grads_r, grads)


# --------------------------------------------------------------------------
# accuracy
# --------------------------------------------------------------------------


def test_accuracy_counts_only_real_slots(params):
    batches = [make_batch(4, [True, True, False, False], size=4),
               make_batch(5, [True, False, False, False], size=4)]
    for batch, correct in zip(batches, ([1, 0, 1, 0], [0, 1, 1, 1])):
        predicted = np.argmax(np.asarray(model.predict(params, batch["images"])), axis=1)
        batch["labels"] = np.where(correct, predicted, (predicted + 1) % 10).astype(np.int32)
    # Real slots: 1 of 2 right in the first batch, 0 of 1 in the second; padding is
    # right 1 of 2 and 3 of 3 times, so counting it would change either answer.
    assert model.accuracy(params, batches[:1]) == 1 / 2
    assert model.accuracy(params, batches) == 1 / 3


def test_accuracy_without_real_samples_raises(params):
    with pytest.raises(ValueError, match="no real"):
        model.accuracy(params, [make_batch(6, [False] * B)])
    with pytest.raises(ValueError, match="no real"):
        model.accuracy(params, [])


# --------------------------------------------------------------------------
# Param layouts (strategies.py)
# --------------------------------------------------------------------------


def shard_devices(leaf) -> list:
    return [s.device for s in leaf.addressable_shards]


def test_replicate(mesh, params):
    placed = strategies.replicate(params, mesh)
    for leaf, p in zip(jax.tree.leaves(placed), leaves(params)):
        assert leaf.sharding == NamedSharding(mesh, P())
        assert set(shard_devices(leaf)) == set(mesh.devices.flat)
        assert all(np.array_equal(s.data, p) for s in leaf.addressable_shards)
    assert trees_equal(strategies.to_host(placed), params)
    assert all(type(x) is np.ndarray for x in jax.tree.leaves(strategies.to_host(placed)))


def test_stack_replicas(mesh, params):
    n = mesh.devices.size
    stacked = strategies.stack_replicas(params, mesh)
    for leaf, p in zip(jax.tree.leaves(stacked), leaves(params)):
        assert leaf.shape == (n,) + p.shape
        assert leaf.sharding == NamedSharding(mesh, P("data"))
        assert shard_devices(leaf) == list(mesh.devices.flat)  # one row on each device
        assert all(s.data.shape == (1,) + p.shape and np.array_equal(s.data[0], p)
                   for s in leaf.addressable_shards)
    assert trees_equal(strategies.first_replica(stacked), params)
    # to_host refuses a sharded (here: pmap-layout) array rather than return one shard.
    with pytest.raises(ValueError, match="replicated"):
        strategies.to_host(stacked)


