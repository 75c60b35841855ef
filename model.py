"""The seed notebooks' MLP as pure functions over a list of (w, b) tuples.

Batches are dicts with "images" (B, C, H, W) or (B, C*H*W) float32 (CIFAR-10:
(B, 3, 32, 32); MNIST: (B, 1, 28, 28)), "labels" (B,) int, and "mask" (B,) bool; mask False marks a padding slot that must not
count (see plan.epoch_plan). With an all-True mask every function here is the
notebooks' function.

Two SGD steps:

* ``update``: ``jax.jit``. On a batch sharded over devices and replicated params
  this is the notebooks' "automatic parallelisation": XLA inserts the
  cross-device sums.
* ``update_parallel(devices)``: ``jax.pmap`` over axis 'data' on exactly those
  devices, batches laid out (n, B, ...). pmap is in maintenance mode in current
  JAX (since 0.8 it is ``jit`` of ``shard_map``); strategies.py also shows the
  ``jax.shard_map`` form. A pmap without ``devices=`` maps over the default
  backend's first n devices, whatever devices its inputs live on: on a GPU host
  it would move a CPU mesh's batches to the GPU, and on CPU devices [4..7] it
  would bring the results back on devices [0..3].

strategies.py does not import this module: it takes the model as a function,
so pass ``loss_terms`` from here (``strategies.sharded(params, batches, mesh,
loss_terms=model.loss_terms, optimizer=strategies.sgd(0.001))``). ``update``
and ``update_parallel`` are the notebooks' steps written out for this MLP;
test_model.py holds them to a float64 reference and to each other.

Both compute the gradient of the *global* masked loss: the sum of every real
sample's negative log-likelihood divided by the number of real samples in the
whole global batch. The notebooks' ``lax.pmean(grads)`` averages per-device
means, which is that gradient only when every device holds the same number of
real samples; with padding it weights a device's samples by 1/(its own count).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Sequence

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

Params = list  # [(w_IxO, b_O), ...]
LAYERS = (3072, 1024, 1024, 10)  # the rocAL notebook's MLP, CIFAR-10
MNIST_LAYERS = (784, 1024, 1024, 10)  # the DALI notebook's
AXIS = "data"


def init_model(layers: Sequence[int] = LAYERS, rng: np.random.RandomState | None = None) -> Params:
    """w = 0.1 * randn(in, out), b = 0.1 * randn(out), float32, exactly as the notebooks.

    ``rng`` defaults to a fresh ``RandomState(0)`` on every call (the notebooks'
    default argument is one shared RandomState, so their second call returns
    different weights).
    """
    rng = np.random.RandomState(0) if rng is None else rng
    params = []
    for n_in, n_out in zip(layers[:-1], layers[1:]):
        w = (0.1 * rng.randn(n_in, n_out)).astype(np.float32)
        b = (0.1 * rng.randn(n_out)).astype(np.float32)
        params.append((w, b))
    return params


def predict(params: Params, images: jax.Array) -> jax.Array:
    """Log-probabilities (B, classes): tanh hidden layers, log-softmax output."""
    x_BxD = images.reshape(images.shape[0], -1)
    for w, b in params[:-1]:
        x_BxD = jnp.tanh(x_BxD @ w + b)
    w, b = params[-1]
    logits_BxC = x_BxD @ w + b
    return logits_BxC - jax.nn.logsumexp(logits_BxC, axis=1, keepdims=True)


def loss_terms(params: Params, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(sum of real samples' NLL, number of real samples) over one batch."""
    logp_BxC = predict(params, batch["images"])
    nll_B = -jnp.take_along_axis(logp_BxC, batch["labels"].reshape(-1, 1).astype(jnp.int32), axis=1)[:, 0]
    mask_B = batch["mask"].reshape(-1).astype(logp_BxC.dtype)
    return jnp.sum(mask_B * nll_B), jnp.sum(mask_B)


def loss(params: Params, batch: dict) -> jax.Array:
    """Masked mean NLL: sum(mask * nll) / max(sum(mask), 1). All-True mask: the notebooks' loss."""
    total, count = loss_terms(params, batch)
    return total / jnp.maximum(count, 1.0)


def sgd(params: Params, grads: Params, learning_rate) -> Params:
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)


@jax.jit
def update(params: Params, batch: dict, learning_rate=0.001) -> tuple[Params, jax.Array]:
    """One SGD step on the batch's masked loss; returns (new params, that loss). The rate
    defaults to the notebooks' 0.001."""
    value, grads = jax.value_and_grad(loss)(params, batch)
    return sgd(params, grads, learning_rate), value


def _update_parallel(params: Params, batch: dict, learning_rate=0.001):
    # The denominator is the real-sample count of the whole global batch; it does
    # not depend on params, so each device back-propagates 1/count through its
    # own numerator and the per-device gradients simply add up (psum).
    (total, count), vjp = jax.vjp(lambda p: loss_terms(p, batch), params)
    denominator = jnp.maximum(lax.psum(count, AXIS), 1.0)
    grads = lax.psum(vjp((1.0 / denominator, jnp.zeros_like(count)))[0], AXIS)
    return sgd(params, grads, learning_rate), lax.psum(total, AXIS) / denominator


@functools.lru_cache(maxsize=None)
def update_parallel(devices: tuple[jax.Device, ...]) -> Callable:
    """The pmap SGD step over exactly ``devices``, in that order (one per mesh position).

    The step takes params (n, ...) replicated, a batch (n, B, ...) and the learning
    rate, and returns (new params (n, ...), global masked loss (n,)), every replica
    equal, on the same devices.
    """
    return jax.pmap(_update_parallel, axis_name=AXIS, in_axes=(0, 0, None), devices=list(devices))


@jax.jit
def _correct_and_count(params: Params, batch: dict) -> tuple[jax.Array, jax.Array]:
    predicted_B = jnp.argmax(predict(params, batch["images"]), axis=1)
    hit_B = (predicted_B == batch["labels"].reshape(-1)) & batch["mask"].reshape(-1)
    return jnp.sum(hit_B), jnp.sum(batch["mask"])


def accuracy(params: Params, batches: Iterable[dict]) -> float:
    """Fraction of real (mask-True) samples classified correctly over ``batches``.

    Over a fill-policy loader this counts every sample exactly once (the
    notebooks' drop-policy validation silently skips the tail of the test set).
    """
    counts = [_correct_and_count(params, batch) for batch in batches]  # read once, at the end
    correct, total = (sum(int(c[i]) for c in counts) for i in (0, 1))
    if total == 0:
        raise ValueError("accuracy: the batches hold no real (mask-True) sample")
    return correct / total
