"""Pure-JAX softmax: the specification, the test oracle and the CPU path (fp32 maths).

Signatures shared by every softmax implementation::

    forward(x, mask, *, mode, scale) -> (y, Residuals)
    backward(res: Residuals, dy, *, mode, scale) -> dx

``mode`` is "none", "mask" (``mask`` is a bool array broadcastable to x, True = masked out) or
"causal" (position j > i of the trailing [S, S] block is masked).

Semantics of one row, with ``z = scale * float32(x)`` and U the unmasked positions of the row:

* masked positions get exactly 0, whatever x holds there (NaN included);
* if some ``z[j]``, j in U, is NaN or +inf, every position in U gets NaN (as in
  ``jax.nn.softmax``): a diverging input is not hidden;
* otherwise, if no ``z[j]``, j in U, is finite (U empty, or all -inf), the row is all zeros;
* otherwise ``y[j] = exp(z[j] - m) / sum_{k in U} exp(z[k] - m)`` on U, with m the row maximum;
  a -inf ``z[j]`` gets exactly 0, like a masked position.

Backward, with y the forward output (in x's dtype): positions where ``y == 0`` (masked, -inf,
underflowed, or a row without a finite element) get ``dx = 0`` and take no part in the row sum,
whatever ``dy`` holds there; elsewhere ``dx = scale * y * (dy - sum_{k: y[k] != 0} y[k] * dy[k])``.
For finite ``dy`` this is exactly ``scale * y * (dy - sum(dy * y))``. A NaN row of y gives a NaN
gradient on its unmasked positions.
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
    # zmax is NaN for a row holding a NaN and +inf for one holding +inf: exp() below then gives NaN
    # at that position and the NaN sum makes the whole row NaN. A row with no finite element has
    # zmax = -inf: shifting by 0 instead gives exp(-inf) = 0 everywhere and a zero sum. ``initial``
    # makes the maximum of an empty last axis (S = 0) -inf instead of an error.
    zmax = jnp.max(z, axis=-1, keepdims=True, initial=-jnp.inf)
    zmax = jnp.where(jnp.isneginf(zmax), 0.0, zmax)
    e = jnp.exp(z - zmax)
    total = jnp.sum(e, axis=-1, keepdims=True)
    y = e / jnp.where(total == 0, 1.0, total)
    if masked is not None:
        y = jnp.where(masked, 0.0, y)  # exactly 0, also in a NaN row
    y = y.astype(x.dtype)
    return y, Residuals(y, mask if mode == "mask" else None)


def backward(res: Residuals, dy: jax.Array, *, mode: str, scale: float) -> jax.Array:
    del mode  # masked positions have y == 0, which the rule below covers
    y = res.y.astype(jnp.float32)
    g = dy.astype(jnp.float32)
    live = y != 0  # NaN is live: a NaN row stays NaN
    dot = jnp.sum(jnp.where(live, y * g, 0.0), axis=-1, keepdims=True)
    return jnp.where(live, jnp.float32(scale) * y * (g - dot), 0.0).astype(res.y.dtype)
