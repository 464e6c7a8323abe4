"""The maths of the RMSNorm / LayerNorm layers, shared by the Linen, NNX and Equinox modules.

Parameters (all frameworks, the names flax.linen.RMSNorm / LayerNorm use): ``scale [H]`` and, for
LayerNorm, ``bias [H]``. With ``zero_centered_gamma`` the applied scale is ``1 + scale`` and
``scale`` is initialised at 0 (else at 1).

Dtypes: the layer computes in ``dtype`` (None: the input's dtype): x and the residual are cast to
it, so the output and the returned residual stream ``h`` are in that dtype. The parameters go to
the op in their stored dtype (the op reads them in float32 whatever it is), except float64
parameters with a lower-precision input, which are read as float32 (the GPU kernels do not take
float64).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from te_ops.normalization import NormOutput, layer_norm, rms_norm

__all__ = ["NormOutput", "default_scale_init", "norm_apply"]


def default_scale_init(zero_centered_gamma: bool):
    """Ones, or zeros when the applied scale is ``1 + scale``."""
    return jax.nn.initializers.zeros if zero_centered_gamma else jax.nn.initializers.ones


def _param(p: jax.Array | None, dt: Any) -> jax.Array | None:
    if p is None:
        return None
    return p.astype(jnp.float32) if p.dtype == jnp.float64 and dt != jnp.float64 else p


def norm_apply(kind: str, x: jax.Array, scale: jax.Array, bias: jax.Array | None = None,
               residual: jax.Array | None = None, *, epsilon: float, zero_centered_gamma: bool,
               dtype: Any = None) -> jax.Array | NormOutput:  # fmt: skip
    """``te_ops.rms_norm`` ("rms") or ``te_ops.layer_norm`` ("layer") in the compute dtype."""
    dt = jnp.dtype(x.dtype if dtype is None else dtype)
    x = x.astype(dt)
    residual = None if residual is None else residual.astype(dt)
    if kind == "rms":
        return rms_norm(x, _param(scale, dt), residual=residual, eps=epsilon, zero_centered_gamma=zero_centered_gamma)
    return layer_norm(x, _param(scale, dt), _param(bias, dt), residual=residual, eps=epsilon,
                      zero_centered_gamma=zero_centered_gamma)  # fmt: skip
