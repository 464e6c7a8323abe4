"""Pure-JAX softmax: the specification, the test oracle and the CPU path (fp32 maths).

Signatures shared by every softmax implementation::

    forward(x, mask, *, mode, scale) -> (y, Residuals)
    backward(res: Residuals, dy, *, mode, scale) -> dx

``mode`` is "none", "mask" (``mask`` is a bool array broadcastable to x, True = masked out) or
"causal" (position j > i of the trailing [S, S] block is masked). Masked positions get probability
exactly 0; a row masked everywhere gives zeros and a zero gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Residuals(NamedTuple):
    y: jax.Array  # forward output, in the input dtype
    mask: jax.Array | None  # the bool mask for mode="mask" (kernels use it to skip masked blocks)


def masked_positions(x_shape: tuple[int, ...], mask: jax.Array | None, mode: str) -> jax.Array | None:
    """Bool array (broadcastable to x_shape) of masked-out positions, or None."""
    if mode == "mask":
        return mask
    if mode == "causal":
        s_q, s_k = x_shape[-2], x_shape[-1]
        return jnp.arange(s_k)[None, :] > jnp.arange(s_q)[:, None]
    return None


def forward(x: jax.Array, mask: jax.Array | None = None, *, mode: str, scale: float):
    z = x.astype(jnp.float32) * jnp.float32(scale)
    masked = masked_positions(x.shape, mask, mode)
    if masked is not None:
        z = jnp.where(masked, -jnp.inf, z)
    zmax = jnp.max(z, axis=-1, keepdims=True)
    zmax = jnp.where(jnp.isneginf(zmax), 0.0, zmax)  # fully masked row: exp(-inf - 0) = 0 below
    e = jnp.exp(z - zmax)
    total = jnp.sum(e, axis=-1, keepdims=True)
    y = jnp.where(total > 0, e / jnp.where(total > 0, total, 1.0), 0.0).astype(x.dtype)
    return y, Residuals(y, mask if mode == "mask" else None)


def backward(res: Residuals, dy: jax.Array, *, mode: str, scale: float) -> jax.Array:
    del mode
    y = res.y.astype(jnp.float32)
    g = dy.astype(jnp.float32)
    dot = jnp.sum(y * g, axis=-1, keepdims=True)
    return (jnp.float32(scale) * y * (g - dot)).astype(res.y.dtype)
