"""Public softmax ops: validation, custom VJP, sharding, vmap and implementation dispatch."""

from __future__ import annotations

import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_ops._core import partitioning as P
from te_ops._core import registry
from te_ops.softmax import native, reference
from te_ops.softmax.reference import Residuals

FAMILY = registry.family("softmax")
FAMILY.register(
    registry.Implementation(
        name="native",
        forward=native.forward,
        backward=native.backward,
        unsupported_reason=native.unsupported_reason,
        platform="cuda",
        available=registry.native_available("_native", "softmax"),
    )
)
FAMILY.register(
    registry.Implementation(name=registry.REFERENCE, forward=reference.forward, backward=reference.backward)
)

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _check_x(op: str, x: Any, min_rank: int) -> jax.Array:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
        raise TypeError(
            f"te_ops.{op}: x must be float32, bfloat16 or float16, got dtype {jnp.dtype(x.dtype)}. "
            f"Cast it first, e.g. x.astype(jnp.float32)."
        )
    if x.ndim < min_rank:
        raise ValueError(f"te_ops.{op}: x must have rank >= {min_rank}, got shape {tuple(x.shape)}.")
    return x


def _check_scale(op: str, scale: Any) -> float:
    if isinstance(scale, (jax.Array, jax.core.Tracer)) or isinstance(scale, bool):
        raise TypeError(
            f"te_ops.{op}: scale must be a static Python float, got {type(scale).__name__}. The scale is "
            "compiled into the kernel; pass a number such as scale=1 / math.sqrt(head_dim), not a traced array."
        )
    if not isinstance(scale, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"te_ops.{op}: scale must be a static Python float, got {scale!r}.")
    scale = float(scale)
    if not np.isfinite(scale):
        raise ValueError(f"te_ops.{op}: scale must be finite, got {scale}.")
    return scale


def _check_mask(op: str, mask: Any, x: jax.Array) -> jax.Array:
    if not hasattr(mask, "dtype"):
        mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"te_ops.{op}: mask must be a bool array (True = masked out), got dtype {mask.dtype}. "
            "Convert it, e.g. mask = (mask != 0)."
        )
    if mask.ndim > 4:
        raise ValueError(f"te_ops.{op}: mask must have rank <= 4, got shape {tuple(mask.shape)}.")
    mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    ok = mask.shape[3] == x.shape[3] and all(m in (1, d) for m, d in zip(mask.shape[:3], x.shape[:3], strict=True))
    if not ok:
        raise ValueError(
            f"te_ops.{op}: mask of shape {tuple(mask.shape)} is not broadcastable as [B or 1, N or 1, Sq or 1, Sk] "
            f"to x of shape {tuple(x.shape)}."
        )
    return mask


# ----------------------------------------------------------------------------------------------
# Sharding: batch, head and query axes may be sharded; the softmax axis is gathered. In causal mode
# the query axis is gathered too (the kernel reads the query position from the local row index).
# ----------------------------------------------------------------------------------------------


def _factors(x_shape, mask_shape, mode):
    xf = P.factor_names(len(x_shape))
    mf = None
    if mask_shape is not None:
        mf = [xf[i] if (mask_shape[i] == x_shape[i]) else f"m{i}" for i in range(4)]
    replicate = [xf[-1]] + ([xf[-2]] if mode == "causal" else [])
    return xf, mf, replicate


def _rule(mode, n_x_like):
    def rule(*shapes):
        x_shape = shapes[0]
        mask_shape = shapes[n_x_like] if len(shapes) > n_x_like else None
        xf, mf, replicate = _factors(x_shape, mask_shape, mode)
        operands = [" ".join(xf)] * n_x_like + ([" ".join(mf)] if mf else [])
        return f"{', '.join(operands)} -> {' '.join(xf)}", {"need_replication_factors": tuple(sorted(set(replicate)))}

    return rule


def _specs(mode, n_x_like):
    def specs(arg_specs, shapes):
        x_shape = shapes[0]
        x_spec = list(arg_specs[0])
        x_spec[-1] = None
        if mode == "causal":
            x_spec[-2] = None
        in_specs = [x_spec] * n_x_like
        if len(shapes) > n_x_like:
            m_shape = shapes[n_x_like]
            in_specs.append([x_spec[i] if m_shape[i] == x_shape[i] else None for i in range(3)] + [None])
        return in_specs, x_spec

    return specs


# ----------------------------------------------------------------------------------------------
# vmap: fold the vmapped axis into the leading axes the kernels already handle.
# ----------------------------------------------------------------------------------------------


def _fold(n_x_like, has_mask):
    def fold(axis_size, in_batched, *args):
        fn = fold.fn
        xs = P.broadcast_batched(axis_size, in_batched[:n_x_like], args[:n_x_like])
        if not has_mask:
            return fn(*xs), True
        mask, mask_batched = args[n_x_like], in_batched[n_x_like]
        lead = xs[0].shape[:2]  # (V, B)
        folded = [a.reshape(lead[0] * lead[1], *a.shape[2:]) for a in xs]
        if mask_batched:
            mask = jnp.broadcast_to(mask, (*lead, *mask.shape[2:])).reshape(lead[0] * lead[1], *mask.shape[2:])
        elif mask.shape[0] != 1:
            mask = jnp.tile(mask, (axis_size, 1, 1, 1))
        out = fn(*folded, mask)
        return out.reshape(*lead, *out.shape[1:]), True

    return fold


# ----------------------------------------------------------------------------------------------
# The custom_vjp op, built once per static configuration.
# ----------------------------------------------------------------------------------------------


def _call_desc(x, mask, mode, scale):
    return dict(
        dtype=x.dtype,
        x_shape=tuple(x.shape),
        mask_shape=None if mask is None else tuple(mask.shape),
        mode=mode,
        scale=scale,
    )


@functools.cache
def _build(mode: str, scale: float, implementation: str | None, has_mask: bool):
    statics = dict(mode=mode, scale=scale)
    n_fwd, n_bwd = 1, 2

    def fwd_impl(x, *mask):
        m = mask[0] if mask else None
        y, _ = FAMILY.dispatch(implementation, "forward", (x, m), statics, _call_desc(x, m, mode, scale))
        return y

    def bwd_impl(y, dy, *mask):
        m = mask[0] if mask else None
        res = Residuals(y, m)
        return FAMILY.dispatch(implementation, "backward", (res, dy), statics, _call_desc(y, m, mode, scale))

    fwd_part = P.partitioned(fwd_impl, rule=_rule(mode, n_fwd), specs=_specs(mode, n_fwd))
    bwd_part = P.partitioned(bwd_impl, rule=_rule(mode, n_bwd), specs=_specs(mode, n_bwd))
    fold_f, fold_b = _fold(n_fwd, has_mask), _fold(n_bwd, has_mask)
    fold_f.fn, fold_b.fn = fwd_part, bwd_part
    fwd_call = P.batch_folding(fwd_part, fold_f)
    bwd_call = P.batch_folding(bwd_part, fold_b)

    if has_mask:

        @jax.custom_vjp
        def op(x, mask):
            return fwd_call(x, mask)

        def op_fwd(x, mask):
            y = fwd_call(x, mask)
            return y, Residuals(y, mask)

        def op_bwd(res, g):
            return bwd_call(res.y, g, res.mask), None

    else:

        @jax.custom_vjp
        def op(x):
            return fwd_call(x)

        def op_fwd(x):
            y = fwd_call(x)
            return y, Residuals(y, None)

        def op_bwd(res, g):
            return (bwd_call(res.y, g),)

    op.defvjp(op_fwd, op_bwd)
    return op


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def scaled_softmax(x: jax.Array, scale: float = 1.0, *, implementation: str | None = None) -> jax.Array:
    """Softmax of ``scale * x`` over the last axis, in fp32 maths, output in x's dtype.

    Equivalent to::

        jax.nn.softmax(scale * x.astype(jnp.float32), axis=-1).astype(x.dtype)

    Args:
      x: ``[..., S]`` float32, bfloat16 or float16.
      scale: static Python float.
      implementation: None (best available), "native" or "reference".

    Returns:
      ``[..., S]`` array of x's dtype.
    """
    op = "scaled_softmax"
    x = _check_x(op, x, 1)
    scale = _check_scale(op, scale)
    return _build("none", scale, implementation, False)(*P.match_vma(x))


def scaled_masked_softmax(
    x: jax.Array, mask: jax.Array, scale: float = 1.0, *, implementation: str | None = None
) -> jax.Array:
    """Masked softmax of ``scale * x`` over the last axis; True in ``mask`` means masked out.

    Masked positions get probability exactly 0; a row masked everywhere gives zeros (and a zero
    gradient), not NaN.

    Equivalent to::

        z = jnp.where(mask, -jnp.inf, scale * x.astype(jnp.float32))
        y = jax.nn.softmax(z, axis=-1)          # then rows that are all -inf -> 0
        y = jnp.where(mask.all(-1, keepdims=True), 0.0, y).astype(x.dtype)

    Args:
      x: ``[B, N, Sq, Sk]`` float32, bfloat16 or float16.
      mask: bool, broadcastable as ``[B or 1, N or 1, Sq or 1, Sk]`` (lower rank is left-padded).
      scale: static Python float.
      implementation: None (best available), "native" or "reference".
    """
    op = "scaled_masked_softmax"
    x = _check_x(op, x, 0)
    if x.ndim != 4:
        raise ValueError(f"te_ops.{op}: x must have rank 4 [B, N, Sq, Sk], got shape {tuple(x.shape)}.")
    mask = _check_mask(op, mask, x)
    scale = _check_scale(op, scale)
    return _build("mask", scale, implementation, True)(*P.match_vma(x, mask))


def scaled_upper_triang_masked_softmax(
    x: jax.Array, scale: float = 1.0, *, implementation: str | None = None
) -> jax.Array:
    """Causal softmax of ``scale * x``: position j > i of the trailing ``[S, S]`` block is masked.

    Equivalent to::

        causal = jnp.tril(jnp.ones((S, S), bool))
        jax.nn.softmax(scale * x.astype(jnp.float32), axis=-1, where=causal).astype(x.dtype)

    Args:
      x: ``[..., S, S]`` float32, bfloat16 or float16.
      scale: static Python float.
      implementation: None (best available), "native" or "reference".
    """
    op = "scaled_upper_triang_masked_softmax"
    x = _check_x(op, x, 2)
    if x.shape[-1] != x.shape[-2]:
        raise ValueError(
            f"te_ops.{op}: the last two axes must be equal (a square [S, S] score block), got shape {tuple(x.shape)}."
        )
    scale = _check_scale(op, scale)
    return _build("causal", scale, implementation, False)(*P.match_vma(x))
