"""The seed notebooks' MLP as pure functions over a list of (w, b) tuples.

Batches are dicts with "images" (B, C, H, W) or (B, C*H*W) float32 (CIFAR-10: (B, 3, 32, 32); MNIST: (B, 1, 28, 28)),
"labels" (B,) int and "mask" (B,) bool; mask False marks a padding slot that must not count. With an all-True mask every
function is the notebooks'.

``loss_terms`` is the model as strategies.py takes it: (the real samples' summed negative log-likelihood, their count);
a strategy divides the global sums, so the gradient is the global batch's masked mean's. The notebooks' ``lax.pmean`` of
per-device means is that gradient only when every device holds as many real samples (docs/traps.md).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import jax
import jax.numpy as jnp

Params = list  # [(w_IxO, b_O), ...]
LAYERS = (3072, 1024, 1024, 10)  # the rocAL notebook's MLP, CIFAR-10
MNIST_LAYERS = (784, 1024, 1024, 10)  # the DALI notebook's


def init_model(layers: Sequence[int] = LAYERS, rng: np.random.RandomState | None = None) -> Params:
    """w = 0.1 * randn(in, out), b = 0.1 * randn(out), float32, exactly as the notebooks. ``rng`` defaults to a fresh
    ``RandomState(0)`` on every call (the notebooks' default is one shared RandomState: a second call differs)."""
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


@jax.jit
def _correct_and_count(params: Params, batch: dict) -> tuple[jax.Array, jax.Array]:
    predicted_B = jnp.argmax(predict(params, batch["images"]), axis=1)
    hit_B = (predicted_B == batch["labels"].reshape(-1)) & batch["mask"].reshape(-1)
    return jnp.sum(hit_B), jnp.sum(batch["mask"])


def accuracy(params: Params, batches: Iterable[dict]) -> float:
    """Fraction of real (mask-True) samples classified correctly over ``batches`` (ValueError if none is real): over a
    fill-policy loader, every sample exactly once (the notebooks' drop-policy validation skips the test set's tail)."""
    counts = [_correct_and_count(params, batch) for batch in batches]  # read once, at the end
    correct, total = (sum(int(c[i]) for c in counts) for i in (0, 1))
    if total == 0:
        raise ValueError("accuracy: the batches hold no real (mask-True) sample")
    return correct / total
