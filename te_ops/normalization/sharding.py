"""Sharding rules, partition plans and vmap folds of rms_norm / layer_norm.

Operands (x always has rank >= 2 here: api.py gives a rank-1 x a leading axis of 1):

* forward ``(x, gamma[, beta][, residual]) -> (y, h, mean, rstd)``: x, residual, y, h
  ``[d0 .. dk, H]``, gamma/beta ``[H]``, mean/rstd ``[d0 .. dk]`` (h and mean are size-1
  placeholders when there is no residual / for RMSNorm: see api.py);
* backward ``(h, gamma, mean, rstd, dy[, dh]) -> (dx, dgamma, dbeta)`` (mean is a placeholder for
  RMSNorm, dbeta for RMSNorm is a size-1 placeholder).

Sharding: the leading axes ``d0 .. dk`` may be sharded over any mesh axes (data, sequence or
expert parallel rows): every row is normalised on the shard that holds it, with no communication in
the forward. The normalised axis H is gathered (``need_replication_factors``): each row's
statistics need all of it, and H is small next to the rows. gamma and beta are used replicated
(gathered when they come in sharded). In the backward dx stays sharded like x; dgamma and dbeta
are float32 sums over the rows, so each shard's partial sum is ``psum``-ed over the mesh axes of
the leading axes (one all-reduce per parameter gradient) and the result equals the unsharded one up
to summation order.

vmap: ``custom_partitioning`` has no batching rule. With gamma/beta not batched, the vmapped axis
is one more leading axis of x (one kernel call over all instances); the backward's dx comes from
that call, and the per-instance dgamma/dbeta (a gradient per vmapped instance, as for per-example
gradients) are float32 sums over each instance's rows in XLA. A batched gamma or beta (a different
parameter per instance) runs the reference under ``jax.vmap``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from te_ops._core import partitioning as P
from te_ops._core.partitioning import ShardContext, ShardPlan
from te_ops._core.validation import broadcast_batched, mesh_axes
from te_ops.normalization import reference
from te_ops.normalization.reference import Residuals

# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


def _lead(rank: int) -> list[str]:
    return P.factor_names(rank - 1)


def forward_rule(*shapes, is_rms: bool, has_beta: bool, has_res: bool):
    """Shardy rule of the forward: ``d.. h, h[, h][, d.. h] -> d.. h, (d.. h | p), (d.. | q), d..``."""
    lead = _lead(len(shapes[0]))
    xf = " ".join(lead + ["h"])
    sf = " ".join(lead)
    ops = [xf, "h"] + (["h"] if has_beta else []) + ([xf] if has_res else [])
    res = [xf, xf if has_res else "p", "q" if is_rms else sf, sf]
    return f"{', '.join(ops)} -> {', '.join(res)}", {"need_replication_factors": ("h",)}


def forward_specs(arg_specs: Sequence[list[Any]], shapes, *, is_rms: bool, has_beta: bool, has_res: bool):
    """x's leading-axis sharding for x, residual and every output; H, gamma, beta replicated."""
    x_spec = list(arg_specs[0])[:-1] + [None]
    lead = x_spec[:-1]
    in_specs = [x_spec, [None]] + ([[None]] if has_beta else []) + ([x_spec] if has_res else [])
    out_specs = [x_spec, x_spec if has_res else [None], [None] if is_rms else lead, lead]
    return in_specs, out_specs


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def backward_rule(*shapes, is_rms: bool, has_dh: bool):
    """Shardy rule of the backward: ``d.. h, h, (d.. | q), d.., d.. h[, d.. h] -> d.. h, h, (h | p)``."""
    lead = _lead(len(shapes[0]))
    xf = " ".join(lead + ["h"])
    sf = " ".join(lead)
    ops = [xf, "h", "q" if is_rms else sf, sf, xf] + ([xf] if has_dh else [])
    return f"{', '.join(ops)} -> {xf}, h, {'p' if is_rms else 'h'}", {"need_replication_factors": ("h",)}


def summed_over(impl: Callable[..., Any], axes: tuple[str, ...]) -> Callable[..., Any]:
    """The per-shard backward: ``impl``'s dx, and its float32 dgamma/dbeta summed over ``axes``."""

    def per_shard(*args):
        dx, dgamma, dbeta = impl(*args)
        return dx, jax.lax.psum(dgamma, axes), jax.lax.psum(dbeta, axes)

    return per_shard


def backward_plan(ctx: ShardContext, *, impl: Callable[..., Any], is_rms: bool, has_dh: bool) -> ShardPlan:
    x_spec = list(ctx.arg_specs[0])[:-1] + [None]
    lead = x_spec[:-1]
    in_specs = [x_spec, [None], [None] if is_rms else lead, lead, x_spec] + ([x_spec] if has_dh else [])
    out_specs = [x_spec, [None], [None]]
    axes = tuple(a for e in lead for a in mesh_axes(e))
    return ShardPlan(in_specs, out_specs, summed_over(impl, axes) if axes else None)


# ----------------------------------------------------------------------------------------------
# vmap
# ----------------------------------------------------------------------------------------------


def forward_fold(call: Callable[..., Any], *, kind: str, eps: float, zero_centered_gamma: bool, has_beta: bool,
                 has_res: bool) -> Callable[..., Any]:  # fmt: skip
    """vmap rule of the forward ``call(x, gamma[, beta][, residual])``."""
    n_param = 2 if has_beta else 1

    def one(x, gamma, *rest):
        beta = rest[0] if has_beta else None
        residual = rest[-1] if has_res else None
        y, res = reference.forward(x, gamma, beta, residual, kind=kind, eps=eps,
                                   zero_centered_gamma=zero_centered_gamma)  # fmt: skip
        h = res.h if has_res else jnp.zeros((1,), x.dtype)
        mean = res.mean if kind == "layer" else jnp.zeros((1,), jnp.float32)
        return y, h, mean, res.rstd

    def fold(axis_size, in_batched, *args):
        if any(in_batched[1 : 1 + n_param]):
            in_axes = tuple(0 if b else None for b in in_batched)
            return jax.vmap(one, in_axes=in_axes, axis_size=axis_size)(*args), (True,) * 4
        x_like = [0] + ([1 + n_param] if has_res else [])
        xs = broadcast_batched(axis_size, [in_batched[i] for i in x_like], [args[i] for i in x_like])
        new = list(args)
        for i, a in zip(x_like, xs, strict=True):
            new[i] = a
        y, h, mean, rstd = call(*new)
        # the size-1 placeholders are not per instance
        return (y, h, mean, rstd), (True, has_res, kind == "layer", True)

    return fold


def backward_fold(call: Callable[..., Any], *, kind: str, zero_centered_gamma: bool,
                  has_dh: bool) -> Callable[..., Any]:  # fmt: skip
    """vmap rule of the backward ``call(h, gamma, mean, rstd, dy[, dh])``: every output per instance."""
    is_rms = kind == "rms"

    def one(h, gamma, mean, rstd, dy, *dh):
        res = Residuals(h, gamma, None if is_rms else mean, rstd)
        dx, dgamma, dbeta = reference.backward(res, dy, dh[0] if dh else None, kind=kind,
                                               zero_centered_gamma=zero_centered_gamma)  # fmt: skip
        return dx, dgamma, dbeta if dbeta is not None else jnp.zeros((1,), jnp.float32)

    def fold(axis_size, in_batched, *args):
        if in_batched[1]:
            in_axes = tuple(0 if b else None for b in in_batched)
            return jax.vmap(one, in_axes=in_axes, axis_size=axis_size)(*args), (True, True, True)
        per_row = [0, 3, 4] + ([5] if has_dh else []) + ([] if is_rms else [2])
        xs = broadcast_batched(axis_size, [in_batched[i] for i in per_row], [args[i] for i in per_row])
        new = list(args)
        for i, a in zip(per_row, xs, strict=True):
            new[i] = a
        h, gamma, mean, rstd, dy = new[:5]
        dx, _, _ = call(*new)
        res = Residuals(h, gamma, None if is_rms else mean, rstd)
        axes = tuple(range(1, dy.ndim - 1))  # each instance's rows
        dt = jnp.float64 if h.dtype == jnp.float64 else jnp.float32
        dgamma, dbeta = reference.param_grads(res, dy, kind=kind, dt=dt, axes=axes)
        if dbeta is None:
            dbeta = jnp.zeros((axis_size, 1), jnp.float32)
        return (dx, dgamma, dbeta), (True, True, True)

    return fold
