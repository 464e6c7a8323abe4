"""Flax Linen RMSNorm and LayerNorm on te_ops.rms_norm / te_ops.layer_norm (re-exported by
``te_layers.linen``). Parameters ``scale [H]`` (and ``bias [H]``) as in ``flax.linen.RMSNorm`` /
``LayerNorm``; H is read from the input. Call ``norm(x)`` -> y, or ``norm(x, residual)`` ->
``NormOutput(y, h)`` with ``h = x + residual`` (the residual stream to carry on)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_layers import _norm
from te_layers import _validation as V

Initializer = Callable[..., jax.Array]
Axes = Sequence[str | None] | None


def _param(mod: nn.Module, name: str, init: Initializer, n: int, dtype, axes: Axes):
    if axes is not None:
        init = nn.with_logical_partitioning(init, tuple(axes))
    return mod.param(name, init, (n,), dtype)


def _stored_features(mod: nn.Module) -> int | None:
    """H of an existing ``scale`` (apply, or a second call during init), else None."""
    node = mod.variables.get("params", {})
    if hasattr(node, "get") and "scale" in node:
        return nn.meta.unbox(node["scale"]).shape[0]
    return None


class RMSNorm(nn.Module):
    """RMSNorm over the last axis (float32 statistics) on ``te_ops.rms_norm``: parameter ``scale [H]``.

    ``scale_init`` None means ones (zeros with ``zero_centered_gamma``, whose applied scale is
    ``1 + scale``). ``dtype``: the compute dtype (None: the input's).
    """

    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    scale_init: Initializer | None = None
    scale_axes: Axes = None

    def __post_init__(self):
        V.check_norm("RMSNorm", sizes={}, epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
                     dtype=self.dtype, param_dtype=self.param_dtype, scale_axes=self.scale_axes)  # fmt: skip
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        x, residual = V.norm_inputs("RMSNorm", x, residual, self.dtype, _stored_features(self))
        init = self.scale_init or _norm.default_scale_init(self.zero_centered_gamma)
        scale = _param(self, "scale", init, x.shape[-1], self.param_dtype, self.scale_axes)
        return _norm.norm_apply("rms", x, scale, None, residual, epsilon=self.epsilon,
                                zero_centered_gamma=self.zero_centered_gamma, dtype=self.dtype)  # fmt: skip


class LayerNorm(nn.Module):
    """LayerNorm over the last axis (float32 statistics) on ``te_ops.layer_norm``: parameters
    ``scale [H]`` and ``bias [H]``.

    ``scale_init`` None means ones (zeros with ``zero_centered_gamma``); ``bias_init`` zeros.
    ``bias_axes`` None follows ``scale_axes``. ``dtype``: the compute dtype (None: the input's).
    """

    epsilon: float = 1e-5
    zero_centered_gamma: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    scale_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()
    scale_axes: Axes = None
    bias_axes: Axes = None

    def __post_init__(self):
        V.check_norm("LayerNorm", sizes={}, epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
                     dtype=self.dtype, param_dtype=self.param_dtype, scale_axes=self.scale_axes,
                     bias_axes=self.bias_axes)  # fmt: skip
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        x, residual = V.norm_inputs("LayerNorm", x, residual, self.dtype, _stored_features(self))
        n = x.shape[-1]
        init = self.scale_init or _norm.default_scale_init(self.zero_centered_gamma)
        scale = _param(self, "scale", init, n, self.param_dtype, self.scale_axes)
        b_axes = self.bias_axes if self.bias_axes is not None else self.scale_axes
        bias = _param(self, "bias", self.bias_init, n, self.param_dtype, b_axes)
        return _norm.norm_apply("layer", x, scale, bias, residual, epsilon=self.epsilon,
                                zero_centered_gamma=self.zero_centered_gamma, dtype=self.dtype)  # fmt: skip


__all__ = ["LayerNorm", "RMSNorm"]
