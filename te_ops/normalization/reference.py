"""Pure-JAX RMSNorm and LayerNorm: the specification, the test oracle and the CPU path (fp32 maths).

Signatures shared by every normalization implementation::

    forward(x, gamma, beta, residual, *, kind, eps, zero_centered_gamma) -> (y, Residuals)
    backward(res: Residuals, dy, dh, *, kind, zero_centered_gamma) -> (dx, dgamma, dbeta)

``kind`` is "rms" or "layer". ``beta`` is None for "rms"; ``residual`` is None when the caller
adds no residual. Arrays: ``x``, ``residual``, ``y``, ``dy``, ``dx`` ``[..., H]``; ``gamma``,
``beta`` ``[H]``; the statistics ``mean`` / ``rstd`` ``[...]`` float32.

Forward of one row (all maths in float32, ``f(.)`` = cast to float32):

* ``h = round_to_x_dtype(f(x) + f(residual))`` with a residual, else ``h = x``;
* "layer": ``mean = sum(f(h)) / H``, ``var = sum((f(h) - mean)^2) / H``; "rms": ``mean = 0``,
  ``var = sum(f(h)^2) / H``;
* ``rstd = 1 / sqrt(var + eps)``, ``xhat = (f(h) - mean) * rstd``;
* ``w = f(gamma)`` (``1 + f(gamma)`` with ``zero_centered_gamma``);
* ``y = round_to_x_dtype(xhat * w (+ f(beta)))``.

Backward, with ``g = f(dy) * w``: ``dx = rstd * (g - xhat * mean(g * xhat) - mean(g))`` ("rms"
drops the ``mean(g)`` term), plus ``f(dh)``, the cotangent of the returned ``h`` (so ``dx`` is also
the gradient of ``residual``); ``dgamma = sum over rows of f(dy) * xhat`` and
``dbeta = sum over rows of f(dy)``, both float32 (api.py casts them to the parameters' dtypes).

The residual layout (``Residuals``) keeps ``h`` in x's dtype and the two float32 statistics: the
backward kernels rebuild ``xhat`` from them in one pass, without recomputing the row reductions.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32


class Residuals(NamedTuple):
    h: jax.Array  # the normalised input [..., H] in x's dtype (x itself without a residual)
    gamma: jax.Array  # [H], the parameter as given
    mean: jax.Array | None  # [...] float32 ("layer" only)
    rstd: jax.Array  # [...] float32


def _compute_dtype(x: jax.Array):
    """float32, or float64 for float64 inputs (the reference takes them; kernels do not)."""
    return jnp.float64 if x.dtype == jnp.float64 else F32


def scale_of(gamma: jax.Array, zero_centered_gamma: bool, dt=F32) -> jax.Array:
    w = gamma.astype(dt)
    return 1 + w if zero_centered_gamma else w


def forward(x, gamma, beta=None, residual=None, *, kind: str, eps: float, zero_centered_gamma: bool):
    dt = _compute_dtype(x)
    h = x if residual is None else (x.astype(dt) + residual.astype(dt)).astype(x.dtype)
    hf = h.astype(dt)
    n = x.shape[-1]
    if kind == "layer":
        mean = jnp.sum(hf, axis=-1) / n
        centred = hf - mean[..., None]
    else:
        mean = None
        centred = hf
    var = jnp.sum(centred * centred, axis=-1) / n
    rstd = jax.lax.rsqrt(var + jnp.asarray(eps, dt))
    y = centred * rstd[..., None] * scale_of(gamma, zero_centered_gamma, dt)
    if beta is not None:
        y = y + beta.astype(dt)
    return y.astype(x.dtype), Residuals(h, gamma, mean, rstd)


def xhat_of(res: Residuals, dt=F32) -> jax.Array:
    hf = res.h.astype(dt)
    if res.mean is not None:
        hf = hf - res.mean.astype(dt)[..., None]
    return hf * res.rstd.astype(dt)[..., None]


def param_grads(res: Residuals, dy, *, kind: str, dt=F32, axes=None):
    """(dgamma, dbeta or None) in ``dt``: sums of ``dy * xhat`` and ``dy`` over ``axes`` (default:
    every axis but the last)."""
    axes = tuple(range(dy.ndim - 1)) if axes is None else axes
    g = dy.astype(dt)
    dgamma = jnp.sum(g * xhat_of(res, dt), axis=axes)
    dbeta = jnp.sum(g, axis=axes) if kind == "layer" else None
    return dgamma, dbeta


def backward(res: Residuals, dy, dh=None, *, kind: str, zero_centered_gamma: bool):
    dt = _compute_dtype(res.h)
    xhat = xhat_of(res, dt)
    g = dy.astype(dt) * scale_of(res.gamma, zero_centered_gamma, dt)
    c1 = jnp.mean(g * xhat, axis=-1, keepdims=True)
    inner = g - xhat * c1
    if kind == "layer":
        inner = inner - jnp.mean(g, axis=-1, keepdims=True)
    dx = res.rstd.astype(dt)[..., None] * inner
    if dh is not None:
        dx = dx + dh.astype(dt)
    dgamma, dbeta = param_grads(res, dy, kind=kind, dt=dt)
    return dx.astype(res.h.dtype), dgamma, dbeta
