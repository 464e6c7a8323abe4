"""Equinox RMSNorm and LayerNorm on te_ops.rms_norm / te_ops.layer_norm (re-exported by
``te_layers.eqx``). ``num_features`` at construction; parameters ``scale [H]`` (and ``bias [H]``),
logical axes in ``param_axes`` (read by ``te_layers.eqx.logical_axes``). Call ``norm(x)`` -> y, or
``norm(x, residual)`` -> ``NormOutput(y, h)`` with ``h = x + residual``. The initialisers are
deterministic, so ``key`` is optional (accepted for symmetry with the other layers). The norms hold no
state: an ``eqx.nn.State`` passed as ``norm(x, state)`` is refused with an error that says so."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from te_layers import _norm
from te_layers import _validation as V

Initializer = Callable[..., jax.Array]
Axes = Sequence[str | None] | None


def _axes(a: Axes):
    return None if a is None else tuple(a)


def _refuse_state(layer: str, name: str, value: Any, call: str) -> None:
    """A clear error for an ``eqx.nn.State`` passed positionally to a layer that holds none (it would
    land in ``name``): the layers that take a state (Dense, NormDense, MultiHeadAttention, MoEBlock)
    take it as ``layer(x, state)``, these take none."""
    if isinstance(value, eqx.nn.State):
        raise TypeError(
            V.err(layer, f"got an eqx.nn.State as {name}; {layer} holds no state and takes none: call it as "
                         f"`{call}` and keep the state for the layers that take one (Dense, NormDense, "
                         "MultiHeadAttention, MoEBlock).")
        )  # fmt: skip


class RMSNorm(eqx.Module):
    """RMSNorm over the last axis (float32 statistics) on ``te_ops.rms_norm``: parameter ``scale [H]``.

    ``scale_init`` None means ones (zeros with ``zero_centered_gamma``, whose applied scale is
    ``1 + scale``). ``dtype``: the compute dtype (None: the input's).
    """

    scale: jax.Array
    epsilon: float = eqx.field(static=True)
    zero_centered_gamma: bool = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    param_axes: dict = eqx.field(static=True)

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, zero_centered_gamma: bool = False,
                 dtype: Any = None, param_dtype: Any = jnp.float32, scale_init: Initializer | None = None,
                 scale_axes: Axes = None, key: jax.Array | None = None):  # fmt: skip
        V.check_norm("RMSNorm", sizes={"num_features": num_features}, epsilon=epsilon,
                     zero_centered_gamma=zero_centered_gamma, dtype=dtype, param_dtype=param_dtype,
                     scale_axes=scale_axes)  # fmt: skip
        key = jax.random.key(0) if key is None else key
        init = scale_init or _norm.default_scale_init(zero_centered_gamma)
        self.scale = init(key, (num_features,), param_dtype)
        self.epsilon, self.zero_centered_gamma, self.dtype = float(epsilon), bool(zero_centered_gamma), dtype
        self.param_axes = {"scale": _axes(scale_axes)}

    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        _refuse_state("RMSNorm", "residual", residual, "y = norm(x)` or `norm(x, residual)")
        x, residual = V.norm_inputs("RMSNorm", x, residual, self.dtype, self.scale.shape[0])
        return _norm.norm_apply("rms", x, self.scale, None, residual, epsilon=self.epsilon,
                                zero_centered_gamma=self.zero_centered_gamma, dtype=self.dtype)  # fmt: skip


class LayerNorm(eqx.Module):
    """LayerNorm over the last axis (float32 statistics) on ``te_ops.layer_norm``: parameters
    ``scale [H]`` and ``bias [H]``.

    ``scale_init`` None means ones (zeros with ``zero_centered_gamma``); ``bias_init`` zeros.
    ``bias_axes`` None follows ``scale_axes``. ``dtype``: the compute dtype (None: the input's).
    """

    scale: jax.Array
    bias: jax.Array
    epsilon: float = eqx.field(static=True)
    zero_centered_gamma: bool = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    param_axes: dict = eqx.field(static=True)

    def __init__(self, num_features: int, *, epsilon: float = 1e-5, zero_centered_gamma: bool = False,
                 dtype: Any = None, param_dtype: Any = jnp.float32, scale_init: Initializer | None = None,
                 bias_init: Initializer = jax.nn.initializers.zeros, scale_axes: Axes = None,
                 bias_axes: Axes = None, key: jax.Array | None = None):  # fmt: skip
        V.check_norm("LayerNorm", sizes={"num_features": num_features}, epsilon=epsilon,
                     zero_centered_gamma=zero_centered_gamma, dtype=dtype, param_dtype=param_dtype,
                     scale_axes=scale_axes, bias_axes=bias_axes)  # fmt: skip
        ks, kb = jax.random.split(jax.random.key(0) if key is None else key)
        init = scale_init or _norm.default_scale_init(zero_centered_gamma)
        self.scale = init(ks, (num_features,), param_dtype)
        self.bias = bias_init(kb, (num_features,), param_dtype)
        self.epsilon, self.zero_centered_gamma, self.dtype = float(epsilon), bool(zero_centered_gamma), dtype
        self.param_axes = {"scale": _axes(scale_axes),
                           "bias": _axes(bias_axes if bias_axes is not None else scale_axes)}  # fmt: skip

    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        _refuse_state("LayerNorm", "residual", residual, "y = norm(x)` or `norm(x, residual)")
        x, residual = V.norm_inputs("LayerNorm", x, residual, self.dtype, self.scale.shape[0])
        return _norm.norm_apply("layer", x, self.scale, self.bias, residual, epsilon=self.epsilon,
                                zero_centered_gamma=self.zero_centered_gamma, dtype=self.dtype)  # fmt: skip


__all__ = ["LayerNorm", "RMSNorm"]
