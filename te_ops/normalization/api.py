"""Public rms_norm / layer_norm: validation, custom VJP, registration and implementation dispatch.

Sharding rules, partition plans and vmap folds: :mod:`te_ops.normalization.sharding`. The exact
semantics: the docstrings below, ``reference.py`` and docs/semantics.md ("Normalization").
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from te_ops._core import registry
from te_ops._core import triton_bridge as tb
from te_ops._core.partitioning import batch_folding, match_vma, partitioned
from te_ops._core.validation import FLOAT_DTYPES_WITH_F64, check_float, err, static_float
from te_ops.normalization import reference, sharding
from te_ops.normalization import triton as tri
from te_ops.normalization.reference import Residuals

OP = "normalization"
FAMILY = registry.family(OP)
FAMILY.register(
    registry.Implementation(
        name="triton",
        forward=tri.forward,
        backward=tri.backward,
        unsupported_reason=tri.unsupported_reason,
        platform="cuda",
        available=lambda: tb.unavailable_reason(),
    )
)
FAMILY.register(
    registry.Implementation(name=registry.REFERENCE, forward=reference.forward, backward=reference.backward)
)


class NormOutput(NamedTuple):
    """What ``rms_norm`` / ``layer_norm`` return when given a ``residual``."""

    y: jax.Array  # the normalised output [..., H], x's dtype
    h: jax.Array  # x + residual [..., H], x's dtype: the updated residual stream


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _validate(op: str, x, gamma, beta, residual, eps, zero_centered_gamma, has_beta: bool):
    x = check_float(op, "x", x, FLOAT_DTYPES_WITH_F64)
    if x.ndim < 1:
        raise ValueError(err(op, f"x must have rank >= 1 [..., H], got a scalar of shape {tuple(x.shape)}."))
    n = x.shape[-1]
    if n == 0:
        raise ValueError(
            err(op, f"x must have a non-empty last axis (the normalised axis H >= 1), got shape {tuple(x.shape)}. "
                    "The mean and variance of an empty row are undefined.")
        )  # fmt: skip
    params = [("gamma", gamma)] + ([("beta", beta)] if has_beta else [])
    checked = []
    for name, p in params:
        p = check_float(op, name, p, FLOAT_DTYPES_WITH_F64)
        if tuple(p.shape) != (n,):
            raise ValueError(err(op, f"{name} must have shape [H] = ({n},) (x's last axis), got {tuple(p.shape)}."))
        checked.append(p)
    if residual is not None:
        residual = check_float(op, "residual", residual, FLOAT_DTYPES_WITH_F64)
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(err(op, f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}."))
        if residual.dtype != x.dtype:
            raise TypeError(
                err(op, f"residual must have x's dtype {jnp.dtype(x.dtype)}, got {jnp.dtype(residual.dtype)}. "
                        "Cast it, e.g. residual.astype(x.dtype).")
            )  # fmt: skip
    eps = static_float(op, "eps", eps, why="It is compiled into the kernel; pass a number such as 1e-6.")
    if not eps > 0:
        raise ValueError(err(op, f"eps must be > 0 (it keeps 1 / sqrt(var + eps) finite), got {eps}."))
    if not isinstance(zero_centered_gamma, bool):
        raise TypeError(
            err(op, f"zero_centered_gamma must be a bool (True or False), got {type(zero_centered_gamma).__name__} "
                    f"{zero_centered_gamma!r:.80}.")
        )  # fmt: skip
    return x, checked[0], (checked[1] if has_beta else None), residual, eps


# ----------------------------------------------------------------------------------------------
# The custom_vjp op, built once per static configuration.
# ----------------------------------------------------------------------------------------------


def _call_desc(x, gamma, beta, kind):
    rows = 1
    for d in x.shape[:-1]:
        rows *= int(d)
    return dict(
        dtype=x.dtype,
        gamma_dtype=gamma.dtype,
        beta_dtype=None if beta is None else beta.dtype,
        rows=rows,
        h=x.shape[-1],
        kind=kind,
    )


@functools.cache
def _build(kind: str, eps: float, zero_centered_gamma: bool, implementation: str | None, has_beta: bool,
           has_res: bool):  # fmt: skip
    is_rms = kind == "rms"
    fwd_statics = dict(kind=kind, eps=eps, zero_centered_gamma=zero_centered_gamma)
    bwd_statics = dict(kind=kind, zero_centered_gamma=zero_centered_gamma)

    def fwd_impl(x, gamma, *rest):
        beta = rest[0] if has_beta else None
        residual = rest[-1] if has_res else None
        y, res = FAMILY.dispatch(
            implementation, "forward", (x, gamma, beta, residual), fwd_statics, _call_desc(x, gamma, beta, kind)
        )
        h = res.h if has_res else jnp.zeros((1,), x.dtype)
        mean = jnp.zeros((1,), jnp.float32) if is_rms else res.mean
        return y, h, mean, res.rstd

    def bwd_impl(h, gamma, mean, rstd, dy, *dh):
        res = Residuals(h, gamma, None if is_rms else mean, rstd)
        dx, dgamma, dbeta = FAMILY.dispatch(
            implementation, "backward", (res, dy, dh[0] if dh else None), bwd_statics,
            _call_desc(h, gamma, None, kind),
        )  # fmt: skip
        if dbeta is None:
            dbeta = jnp.zeros((1,), dgamma.dtype)
        return dx, dgamma, dbeta

    shard_kw = dict(is_rms=is_rms, has_beta=has_beta, has_res=has_res)
    fwd_part = partitioned(
        fwd_impl,
        rule=functools.partial(sharding.forward_rule, **shard_kw),
        specs=functools.partial(sharding.forward_specs, **shard_kw),
    )
    bwd_part = partitioned(
        bwd_impl,
        rule=functools.partial(sharding.backward_rule, is_rms=is_rms, has_dh=has_res),
        plan=functools.partial(sharding.backward_plan, impl=bwd_impl, is_rms=is_rms, has_dh=has_res),
    )
    fwd_call = batch_folding(fwd_part, sharding.forward_fold(fwd_part, has_beta=has_beta, has_res=has_res,
                                                             **fwd_statics))  # fmt: skip
    bwd_call = batch_folding(bwd_part, sharding.backward_fold(bwd_part, has_dh=has_res, **bwd_statics))

    def arrays(x, gamma, beta, residual):
        return [x, gamma] + ([beta] if has_beta else []) + ([residual] if has_res else [])

    @jax.custom_vjp
    def op(x, gamma, beta, residual):
        y, h, _, _ = fwd_call(*arrays(x, gamma, beta, residual))
        return (y, h) if has_res else y

    def op_fwd(x, gamma, beta, residual):
        y, h, mean, rstd = fwd_call(*arrays(x, gamma, beta, residual))
        saved = (h if has_res else x, gamma, mean, rstd, beta)
        return ((y, h) if has_res else y), saved

    def op_bwd(saved, ct):
        h, gamma, mean, rstd, beta = saved
        dy, dh = ct if has_res else (ct, None)
        dx, dgamma, dbeta = bwd_call(h, gamma, mean, rstd, dy, *([dh] if has_res else []))
        return (
            dx,
            dgamma.astype(gamma.dtype),
            dbeta.astype(beta.dtype) if has_beta else None,
            dx if has_res else None,
        )

    op.defvjp(op_fwd, op_bwd)
    return op


def _run(kind, x, gamma, beta, residual, eps, zero_centered_gamma, implementation):
    op = _build(kind, eps, zero_centered_gamma, implementation, beta is not None, residual is not None)
    rank1 = x.ndim == 1
    if rank1:  # the kernels and the sharding rule see rows: give a single row a leading axis
        x = x[None]
        residual = None if residual is None else residual[None]
    x, gamma, beta, residual = match_vma(x, gamma, beta, residual)
    out = op(x, gamma, beta, residual)
    if residual is None:
        return out[0] if rank1 else out
    y, h = out
    return NormOutput(y[0], h[0]) if rank1 else NormOutput(y, h)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def rms_norm(
    x: jax.Array,
    gamma: jax.Array,
    *,
    residual: jax.Array | None = None,
    eps: float = 1e-6,
    zero_centered_gamma: bool = False,
    implementation: str | None = None,
) -> jax.Array | NormOutput:
    """RMSNorm over the last axis, statistics in float32, output in x's dtype; optionally fused with
    the residual addition that precedes it in a pre-norm transformer.

    Equivalent to::

        h = x if residual is None else (x.astype(f32) + residual.astype(f32)).astype(x.dtype)
        hf = h.astype(f32)
        rstd = jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)
        w = gamma.astype(f32) + (1 if zero_centered_gamma else 0)
        y = (hf * rstd * w).astype(x.dtype)
        return y if residual is None else NormOutput(y, h)

    Gradients: x (and residual, which gets the same gradient: ``h = x + residual``), including the
    cotangent of the returned ``h``; gamma, reduced over every leading axis in float32 and cast to
    gamma's dtype. No special cases beyond the formula: a row of zeros has ``rstd = 1 / sqrt(eps)``
    and output 0; a NaN makes its whole row NaN; an infinity gives ``rstd = 0``, so output 0 at the
    row's finite positions and NaN at the infinite ones.

    Args:
      x: ``[..., H]`` float32, bfloat16 or float16 (float64 on the reference), rank >= 1, H >= 1.
        Leading axes may be empty (empty outputs).
      gamma: ``[H]`` scale, any of those float dtypes (need not match x).
      residual: optional ``[..., H]`` of x's shape and dtype, added to x before normalising.
      eps: static positive float added to the mean square.
      zero_centered_gamma: the scale is ``1 + gamma`` (gamma initialised at 0).
      implementation: None (best available: "triton" on CUDA, else "reference"), "triton" or
        "reference".

    Returns:
      ``y`` (``[..., H]``, x's dtype) without a residual; ``NormOutput(y, h)`` with one, where
      ``h = x + residual`` (x's dtype) is the residual stream to carry on.

    Raises:
      TypeError: x, gamma or residual missing or of an unsupported dtype, residual of another dtype
        than x, a traced eps, a non-bool zero_centered_gamma.
      ValueError: a scalar x, H = 0, gamma or residual of the wrong shape, eps <= 0 or not finite.

    Sharding: leading axes may be sharded (no communication forward; the gamma gradient is
    all-reduced over them); the last axis is gathered. See ``te_ops/normalization/sharding.py``.
    """
    x, gamma, _, residual, eps = _validate("rms_norm", x, gamma, None, residual, eps, zero_centered_gamma, False)
    return _run("rms", x, gamma, None, residual, eps, zero_centered_gamma, implementation)


def layer_norm(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array,
    *,
    residual: jax.Array | None = None,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    implementation: str | None = None,
) -> jax.Array | NormOutput:
    """LayerNorm over the last axis, statistics in float32, output in x's dtype; optionally fused with
    the residual addition that precedes it in a pre-norm transformer.

    Equivalent to::

        h = x if residual is None else (x.astype(f32) + residual.astype(f32)).astype(x.dtype)
        hf = h.astype(f32)
        mean = jnp.mean(hf, axis=-1, keepdims=True)
        var = jnp.mean((hf - mean) ** 2, axis=-1, keepdims=True)      # biased (divides by H)
        w = gamma.astype(f32) + (1 if zero_centered_gamma else 0)
        y = ((hf - mean) * jax.lax.rsqrt(var + eps) * w + beta.astype(f32)).astype(x.dtype)
        return y if residual is None else NormOutput(y, h)

    Gradients: x (and residual, the same gradient), including the cotangent of the returned ``h``;
    gamma and beta, reduced over every leading axis in float32 and cast to their dtypes. A constant
    row has ``var = 0`` and output ``beta``; a NaN or an infinity makes its whole row NaN (the
    mean is then infinite or NaN).

    Args:
      x: ``[..., H]`` float32, bfloat16 or float16 (float64 on the reference), rank >= 1, H >= 1.
        Leading axes may be empty (empty outputs).
      gamma: ``[H]`` scale, any of those float dtypes (need not match x).
      beta: ``[H]`` shift, any of those float dtypes.
      residual: optional ``[..., H]`` of x's shape and dtype, added to x before normalising.
      eps: static positive float added to the variance.
      zero_centered_gamma: the scale is ``1 + gamma`` (gamma initialised at 0).
      implementation: None (best available: "triton" on CUDA, else "reference"), "triton" or
        "reference".

    Returns:
      ``y`` (``[..., H]``, x's dtype) without a residual; ``NormOutput(y, h)`` with one.

    Raises:
      TypeError: x, gamma, beta or residual missing or of an unsupported dtype, residual of another
        dtype than x, a traced eps, a non-bool zero_centered_gamma.
      ValueError: a scalar x, H = 0, gamma, beta or residual of the wrong shape, eps <= 0 or not
        finite.

    Sharding: leading axes may be sharded (no communication forward; the gamma and beta gradients
    are all-reduced over them); the last axis is gathered. See ``te_ops/normalization/sharding.py``.
    """
    x, gamma, beta, residual, eps = _validate("layer_norm", x, gamma, beta, residual, eps, zero_centered_gamma, True)
    return _run("layer", x, gamma, beta, residual, eps, zero_centered_gamma, implementation)
