"""Sharding rules and vmap folds of dense (used through ``te_ops._core.partitioning.partitioned``).

Factors: the leading axes of x ``b0 b1 ...`` (data parallel), ``k`` (contraction), ``n`` (output
features). Forward: ``b.. k, k n[, n] -> b.. n[, b.. n]``; backward:
``b.. k, k n[, b.. n], b.. n -> b.. k, k n[, n]``.

The per-shard function depends on which factors ended up sharded, so both directions use a
``plan`` (:class:`~te_ops._core.partitioning.ShardPlan`):

* data parallel (``b..`` sharded): no collective in the forward; the backward all-reduces
  dkernel/dbias over those axes (they are sums over the batch).
* column parallel (``n`` sharded): no collective in the forward (bias is sharded with ``n``); the
  backward all-reduces dx over the ``n`` axes.
* row parallel (``k`` sharded): each device computes float32 partial sums ``x_k @ kernel_k`` with
  no bias and no activation, ONE reduction combines them (``psum``, or ``psum_scatter`` along an
  output axis when the result is asked to be sharded over the same mesh axes, e.g. sequence
  parallelism), and only then bias and activation are applied (an activation of a partial sum
  would be wrong). The reduction runs in float32 (twice the bytes of a bf16 all-reduce, but the
  result equals the unsharded one up to summation order).

A mesh axis used by two factors at once is kept on the first of ``k``, ``b..``, ``n`` and dropped
from the others (those operands are gathered).

vmap (``forward_fold`` / ``backward_fold``): a batched x with an unbatched kernel and bias is one
call (the vmapped axis is one more leading axis of x). A batched kernel or bias (a different weight
per vmapped instance) is a batched GEMM, and so is the backward under vmap (dkernel and dbias are
per instance): those run the reference under ``jax.vmap`` (XLA's batched dot).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from te_ops._core.partitioning import ShardContext, ShardPlan
from te_ops._core.validation import mesh_axes, mesh_size, spec_entry
from te_ops.dense import reference
from te_ops.dense.reference import Residuals


def factor_axes(x_spec: Sequence[Any], k_spec: Sequence[Any]):
    """(mesh axes per leading axis of x, k axes, n axes) from the x and kernel specs, each mesh axis
    kept on the first factor of ``k``, ``b..``, ``n`` that uses it."""
    k_axes = mesh_axes(x_spec[-1])
    used = set(k_axes)
    batch = []
    for e in x_spec[:-1]:
        ax = tuple(a for a in mesh_axes(e) if a not in used)
        used.update(ax)
        batch.append(ax)
    n_axes = tuple(a for a in mesh_axes(k_spec[1]) if a not in used)
    return batch, k_axes, n_axes


def _batch_factors(rank_x: int) -> list[str]:
    return [f"b{i}" for i in range(rank_x - 1)]


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


def forward_rule(*shapes, n_results: int):
    """Shardy rule of the forward ``(x, kernel[, bias]) -> y[, saved]``."""
    b = _batch_factors(len(shapes[0]))
    ops = [" ".join(b + ["k"]), "k n"] + (["n"] if len(shapes) == 3 else [])
    res = [" ".join(b + ["n"])] * n_results
    return f"{', '.join(ops)} -> {', '.join(res)}", {"reduction_factors": ("k",)}


def row_parallel(
    partial: Callable[..., Any],
    epilogue: Callable[..., Any],
    k_axes: tuple[str, ...],
    scatter_dim: int | None,
) -> Callable[..., Any]:
    """The per-shard forward when ``k`` is sharded over ``k_axes``: float32 partial sums
    ``partial(x, kernel)``, one reduction over ``k_axes`` (``psum``, or ``psum_scatter`` along output
    axis ``scatter_dim``), then ``epilogue(z, bias_or_None, dtype)`` (bias and activation)."""

    def per_shard(x, kernel, *bias):
        z = partial(x, kernel)
        if scatter_dim is None:
            z = jax.lax.psum(z, k_axes)
        else:
            z = jax.lax.psum_scatter(z, k_axes, scatter_dimension=scatter_dim, tiled=True)
        return epilogue(z, bias[0] if bias else None, x.dtype)

    return per_shard


def forward_plan(
    ctx: ShardContext, *, partial: Callable[..., Any], epilogue: Callable[..., Any], n_results: int
) -> ShardPlan:
    """Specs and per-shard function of the forward (the op's own function unless ``k`` is sharded)."""
    x_shape = ctx.arg_shapes[0]
    rank_x = len(x_shape)
    has_bias = len(ctx.arg_shapes) == 3
    batch, k_axes, n_axes = factor_axes(ctx.arg_specs[0], ctx.arg_specs[1])
    n = ctx.arg_shapes[1][1]
    out_spec = [spec_entry(a) for a in batch] + [spec_entry(n_axes)]
    scatter_dim = None
    if k_axes:
        # reduce-scatter when the caller wants the output sharded over exactly the k axes
        out_dims = list(x_shape[:-1]) + [n]
        ksize = mesh_size(ctx.mesh, k_axes)
        for d, e in enumerate(ctx.result_specs[0]):
            if mesh_axes(e) == k_axes and out_spec[d] is None and out_dims[d] % ksize == 0:
                scatter_dim = d
                out_spec[d] = spec_entry(k_axes)
                break
    x_in = out_spec[:-1] + [spec_entry(k_axes)]
    if scatter_dim is not None and scatter_dim < rank_x - 1:
        x_in[scatter_dim] = None  # the scattered mesh axes shard k in x, not this axis
    in_specs = [x_in, [spec_entry(k_axes), spec_entry(n_axes)]]
    if has_bias:
        in_specs.append([out_spec[-1] if scatter_dim == rank_x - 1 else spec_entry(n_axes)])
    out_specs = out_spec if n_results == 1 else [out_spec] * n_results
    per_shard = row_parallel(partial, epilogue, k_axes, scatter_dim) if k_axes else None
    return ShardPlan(in_specs, out_specs, per_shard)


def forward_fold(
    call: Callable[..., Any], *, activation: str | None, has_bias: bool, mode: str, n_results: int
) -> Callable[..., Any]:
    """The vmap rule of the forward ``call(x, kernel[, bias])`` (see the module docstring)."""
    batched_out = (True,) * n_results if n_results > 1 else True

    def one(x, kernel, *bias):
        y, res = reference.forward(
            x, kernel, bias[0] if bias else None, activation=activation, has_bias=has_bias, mode=mode
        )
        return y if n_results == 1 else (y, res.saved)

    def fold(axis_size, in_batched, *args):
        x_b, k_b = in_batched[0], in_batched[1]
        b_b = in_batched[2] if has_bias else False
        if x_b and not k_b and not b_b:
            return call(*args), batched_out
        in_axes = tuple(0 if b else None for b in in_batched)
        return jax.vmap(one, in_axes=in_axes, axis_size=axis_size)(*args), batched_out

    return fold


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def backward_rule(*shapes, has_bias: bool):
    """Shardy rule of the backward ``(x, kernel[, saved], dy) -> (dx, dkernel[, dbias])``."""
    b = _batch_factors(len(shapes[0]))
    bn = " ".join(b + ["n"])
    has_saved = len(shapes) == 4
    ops = [" ".join(b + ["k"]), "k n"] + ([bn] if has_saved else []) + [bn]
    res = [" ".join(b + ["k"]), "k n"] + (["n"] if has_bias else [])
    return f"{', '.join(ops)} -> {', '.join(res)}", {}


def reduced_gradients(
    full: Callable[..., Any], batch_axes: tuple[str, ...], n_axes: tuple[str, ...]
) -> Callable[..., Any]:
    """The per-shard backward: ``full``'s local gradients, with dx summed over the ``n`` axes (a
    contraction over N) and dkernel/dbias summed over the batch axes."""

    def per_shard(*args):
        outs = list(full(*args))
        if n_axes:
            outs[0] = jax.lax.psum(outs[0], n_axes)
        if batch_axes:
            outs[1:] = [jax.lax.psum(o, batch_axes) for o in outs[1:]]
        return tuple(outs)

    return per_shard


def backward_plan(ctx: ShardContext, *, full: Callable[..., Any], has_bias: bool) -> ShardPlan:
    """Specs and per-shard function of the backward (``full`` plus the reductions it needs)."""
    has_saved = len(ctx.arg_shapes) == 4
    batch, k_axes, n_axes = factor_axes(ctx.arg_specs[0], ctx.arg_specs[1])
    b = [spec_entry(a) for a in batch]
    bk = b + [spec_entry(k_axes)]
    bn = b + [spec_entry(n_axes)]
    kn = [spec_entry(k_axes), spec_entry(n_axes)]
    in_specs = [bk, kn] + ([bn] if has_saved else []) + [bn]
    out_specs = [bk, kn] + ([[spec_entry(n_axes)]] if has_bias else [])
    batch_axes = tuple(a for ax in batch for a in ax)
    return ShardPlan(in_specs, out_specs, reduced_gradients(full, batch_axes, n_axes))


def backward_fold(*, activation: str | None, has_bias: bool, has_saved: bool) -> Callable[..., Any]:
    """The vmap rule of the backward ``(x, kernel[, saved], dy)``: the reference under ``jax.vmap``."""

    def one(x, kernel, *rest):
        saved = rest[0] if has_saved else None
        dx, dk, db = reference.backward(Residuals(x, kernel, saved), rest[-1], activation=activation, has_bias=has_bias)
        return (dx, dk, db) if has_bias else (dx, dk)

    def fold(axis_size, in_batched, *args):
        in_axes = tuple(0 if b else None for b in in_batched)
        out = jax.vmap(one, in_axes=in_axes, axis_size=axis_size)(*args)
        return out, (True,) * len(out)

    return fold
