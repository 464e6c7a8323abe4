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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from te_layers import _validation as V
from te_layers._common import dense_apply
from te_ops.normalization import NormOutput, layer_norm, rms_norm

__all__ = ["NormDenseOutput", "NormOutput", "default_scale_init", "norm_apply", "norm_dense_apply"]


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


# ----------------------------------------------------------------------------------------------
# NormDense: norm followed by a dense projection
# ----------------------------------------------------------------------------------------------

NORM_KINDS = V.NORM_KINDS
DEFAULT_EPSILON = V.DEFAULT_EPSILON


class NormDenseOutput(NamedTuple):
    """What a NormDense with ``return_normed=True`` returns: the projection ``y`` and the normalized
    input ``normed`` (in the compute dtype) that went into the GEMM."""

    y: jax.Array
    normed: jax.Array


def norm_dense_axes(scale_axes: Any, norm_bias_axes: Any, kernel_axes: Any) -> tuple[Any, Any]:
    """Logical axes of ``scale`` and ``norm_bias``: None follows the kernel's input axis
    (``kernel_axes[0]``); ``norm_bias_axes`` None follows the scale's."""
    if scale_axes is None and kernel_axes is not None:
        scale_axes = (tuple(kernel_axes)[0],)
    if norm_bias_axes is None:
        norm_bias_axes = scale_axes
    return scale_axes, norm_bias_axes


def norm_dense_apply(kind: str, x: jax.Array, scale: jax.Array, norm_bias: jax.Array | None, kernel: jax.Array,
                     bias: jax.Array | None, *, epsilon: float, zero_centered_gamma: bool, activation: Any = None,
                     dtype: Any = None, fp8: Any = None, fp8_state: Any = None,
                     return_normed: bool = False) -> jax.Array | NormDenseOutput:  # fmt: skip
    """``activation(norm(x) @ kernel + bias)``: :func:`norm_apply` (float32 statistics, output in the
    compute dtype) then ``te_layers._common.dense_apply`` on the normalized input. With ``fp8`` (a
    resolved recipe) only the GEMM runs in FP8: the normalized input is quantized by the GEMM, not
    inside the norm kernel."""
    normed = norm_apply(kind, x, scale, norm_bias, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
                        dtype=dtype)  # fmt: skip
    y = dense_apply(normed, kernel, bias, activation=activation, dtype=dtype, fp8=fp8, fp8_state=fp8_state)
    return NormDenseOutput(y, normed) if return_normed else y
