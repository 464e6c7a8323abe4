"""Pure-JAX dense: the specification, the test oracle and the CPU path (fp32 accumulation).

Signatures shared by every dense implementation::

    forward(x, kernel, bias, *, activation, has_bias, mode) -> (y, Residuals | None)
    backward(res: Residuals, dy, *, activation, has_bias) -> (dx, dkernel, dbias | None)

``x`` is ``[..., K]``, ``kernel`` ``[K, N]``, ``bias`` ``[N]`` or None; all of one dtype (the
compute dtype). ``mode`` is

* ``"primal"``: only ``y`` is needed (no gradient will be taken); ``Residuals`` is None;
* ``"train"``: ``y`` plus the ``Residuals`` the backward needs;
* ``"partial"``: ``x @ kernel`` in float32 without bias or activation (row-parallel sharding: the
  partial sums are reduced across devices first, then :func:`epilogue` applies bias and
  activation). ``Residuals`` is None.

What the backward keeps (``Residuals.saved``, compute dtype, shape ``[..., N]``):

* ``"gelu"``, ``"gelu_tanh"``, ``"silu"``: the pre-activation ``z = x @ kernel + bias``;
* ``"relu"``: the output ``y`` itself (``y > 0`` exactly where ``z > 0``), so nothing extra;
* ``None``: nothing.

Numerics: products accumulate in float32 (``preferred_element_type=float32``, ``HIGHEST`` precision,
so float32 inputs are not silently computed in TF32 on GPU); bias and activation are applied in
float32 and the result is rounded once to the compute dtype. The backward rounds
``dz = dy * act'(z)`` to the compute dtype before its two GEMMs (as the CUDA path does) and sums
``dbias`` from the float32 ``dz``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

ACTIVATIONS = (None, "gelu", "gelu_tanh", "relu", "silu")
# Activations whose backward needs the pre-activation z.
SAVES_PRE_ACTIVATION = ("gelu", "gelu_tanh", "silu")

_HI = jax.lax.Precision.HIGHEST
_F32 = jnp.float32


class Residuals(NamedTuple):
    x: jax.Array  # [..., K]
    kernel: jax.Array  # [K, N]
    saved: jax.Array | None  # [..., N]: z for gelu/gelu_tanh/silu, y for relu, None for no activation


def activate(z: jax.Array, activation: str | None) -> jax.Array:
    """The activation in float32 (``z`` float32)."""
    if activation is None:
        return z
    if activation == "gelu":
        return jax.nn.gelu(z, approximate=False)
    if activation == "gelu_tanh":
        return jax.nn.gelu(z, approximate=True)
    if activation == "relu":
        return jax.nn.relu(z)
    if activation == "silu":
        return jax.nn.silu(z)
    raise ValueError(f"unknown activation {activation!r}")


def activation_grad(saved: jax.Array, activation: str) -> jax.Array:
    """d act / d z in float32, from ``Residuals.saved`` (z, or y for relu)."""
    s = saved.astype(_F32)
    if activation == "relu":
        return (s > 0).astype(_F32)
    if activation == "gelu":
        cdf = 0.5 * (1.0 + jax.lax.erf(s * (1.0 / math.sqrt(2.0))))
        pdf = jnp.exp(-0.5 * s * s) * (1.0 / math.sqrt(2.0 * math.pi))
        return cdf + s * pdf
    if activation == "gelu_tanh":
        c = math.sqrt(2.0 / math.pi)
        t = jnp.tanh(c * (s + 0.044715 * s * s * s))
        return 0.5 * (1.0 + t) + 0.5 * s * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * s * s)
    if activation == "silu":
        sig = jax.nn.sigmoid(s)
        return sig * (1.0 + s * (1.0 - sig))
    raise ValueError(f"unknown activation {activation!r}")


def matmul_f32(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x[..., K] @ kernel[K, N]`` accumulated and returned in float32."""
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=_HI, preferred_element_type=_F32)


def epilogue(z: jax.Array, bias: jax.Array | None, *, activation: str | None, dtype, save: bool):
    """Bias + activation on float32 ``z``: returns (y, saved) in ``dtype`` (saved None unless ``save``)."""
    if bias is not None:
        z = z + bias.astype(_F32)
    y = activate(z, activation).astype(dtype)
    saved = None
    if save:
        if activation in SAVES_PRE_ACTIVATION:
            saved = z.astype(dtype)
        elif activation == "relu":
            saved = y
    return y, saved


def forward(x, kernel, bias=None, *, activation: str | None, has_bias: bool, mode: str = "train"):
    z = matmul_f32(x, kernel)
    if mode == "partial":
        return z, None
    y, saved = epilogue(z, bias if has_bias else None, activation=activation, dtype=x.dtype, save=(mode == "train"))
    return y, (Residuals(x, kernel, saved) if mode == "train" else None)


def backward(res: Residuals, dy: jax.Array, *, activation: str | None, has_bias: bool, **_):
    x, kernel = res.x, res.kernel
    dtype = x.dtype
    n = kernel.shape[1]
    g = dy.astype(_F32)
    dz = g if activation is None else g * activation_grad(res.saved, activation)
    dz_c = dz.astype(dtype)
    dx = jax.lax.dot_general(
        dz_c, kernel, (((dz_c.ndim - 1,), (1,)), ((), ())), precision=_HI, preferred_element_type=_F32
    ).astype(dtype)
    m = math.prod(x.shape[:-1])  # explicit: reshape(-1, ...) is ambiguous for empty arrays
    x2 = x.reshape(m, x.shape[-1])
    dz2 = dz_c.reshape(m, n)
    dk = jax.lax.dot_general(x2, dz2, (((0,), (0,)), ((), ())), precision=_HI, preferred_element_type=_F32)
    dk = dk.astype(kernel.dtype)
    db = dz.reshape(m, n).sum(axis=0).astype(dtype) if has_bias else None
    return dx, dk, db


def unsupported_reason(**_) -> str | None:
    return None
