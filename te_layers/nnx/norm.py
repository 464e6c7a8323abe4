"""Flax NNX RMSNorm and LayerNorm on te_ops.rms_norm / te_ops.layer_norm (re-exported by
``te_layers.nnx``). ``num_features`` at construction (as ``flax.nnx.RMSNorm``); parameters
``scale [H]`` (and ``bias [H]``). Call ``norm(x)`` -> y, or ``norm(x, residual)`` ->
``NormOutput(y, h)`` with ``h = x + residual``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_layers import _norm
from te_layers import _validation as V

Initializer = Callable[..., jax.Array]
Axes = Sequence[str | None] | None


def _param(rngs: nnx.Rngs, init: Initializer, n: int, dtype, axes: Axes) -> nnx.Param:
    value = init(rngs.params(), (n,), dtype)
    if axes is None:
        return nnx.Param(value)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)  # logical names: metadata only


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis (float32 statistics) on ``te_ops.rms_norm``: parameter ``scale [H]``.

    ``scale_init`` None means ones (zeros with ``zero_centered_gamma``, whose applied scale is
    ``1 + scale``). ``dtype``: the compute dtype (None: the input's).
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, zero_centered_gamma: bool = False,
                 dtype: Any = None, param_dtype: Any = jnp.float32, scale_init: Initializer | None = None,
                 scale_axes: Axes = None, rngs: nnx.Rngs):  # fmt: skip
        V.check_norm("RMSNorm", sizes={"num_features": num_features}, epsilon=epsilon,
                     zero_centered_gamma=zero_centered_gamma, dtype=dtype, param_dtype=param_dtype,
                     scale_axes=scale_axes)  # fmt: skip
        self.num_features, self.epsilon, self.zero_centered_gamma, self.dtype = (
            num_features, epsilon, zero_centered_gamma, dtype)  # fmt: skip
        init = scale_init or _norm.default_scale_init(zero_centered_gamma)
        self.scale = _param(rngs, init, num_features, param_dtype, scale_axes)

    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        x, residual = V.norm_inputs("RMSNorm", x, residual, self.dtype, self.num_features)
        return _norm.norm_apply("rms", x, self.scale[...], None, residual, epsilon=self.epsilon,
                                zero_centered_gamma=self.zero_centered_gamma, dtype=self.dtype)  # fmt: skip


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis (float32 statistics) on ``te_ops.layer_norm``: parameters
    ``scale [H]`` and ``bias [H]``.

    ``scale_init`` None means ones (zeros with ``zero_centered_gamma``); ``bias_init`` zeros.
    ``bias_axes`` None follows ``scale_axes``. ``dtype``: the compute dtype (None: the input's).
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-5, zero_centered_gamma: bool = False,
                 dtype: Any = None, param_dtype: Any = jnp.float32, scale_init: Initializer | None = None,
                 bias_init: Initializer = jax.nn.initializers.zeros, scale_axes: Axes = None,
                 bias_axes: Axes = None, rngs: nnx.Rngs):  # fmt: skip
        V.check_norm("LayerNorm", sizes={"num_features": num_features}, epsilon=epsilon,
                     zero_centered_gamma=zero_centered_gamma, dtype=dtype, param_dtype=param_dtype,
                     scale_axes=scale_axes, bias_axes=bias_axes)  # fmt: skip
        self.num_features, self.epsilon, self.zero_centered_gamma, self.dtype = (
            num_features, epsilon, zero_centered_gamma, dtype)  # fmt: skip
        init = scale_init or _norm.default_scale_init(zero_centered_gamma)
        self.scale = _param(rngs, init, num_features, param_dtype, scale_axes)
        self.bias = _param(rngs, bias_init, num_features, param_dtype,
                           bias_axes if bias_axes is not None else scale_axes)  # fmt: skip

    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        x, residual = V.norm_inputs("LayerNorm", x, residual, self.dtype, self.num_features)
        return _norm.norm_apply("layer", x, self.scale[...], self.bias[...], residual, epsilon=self.epsilon,
                                zero_centered_gamma=self.zero_centered_gamma, dtype=self.dtype)  # fmt: skip


__all__ = ["LayerNorm", "RMSNorm"]
