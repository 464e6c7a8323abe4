"""Sharding rules of dense (Shardy rule + partition callback).

Factors: the leading axes of x ``b0 b1 ...`` (data parallel), ``k`` (contraction), ``n`` (output
features). Forward: ``b.. k, k n[, n] -> b.. n[, b.. n]``; backward:
``b.. k, k n[, b.. n], b.. n -> b.. k, k n[, n]``.

The per-shard function depends on which factors ended up sharded, so this module builds its own
``custom_partitioning`` (``te_ops._core.partitioning.partitioned`` runs one fixed function):

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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from te_ops._core.partitioning import padded_spec


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def _entry(axes: tuple[str, ...]) -> Any:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def _size(mesh, axes: tuple[str, ...]) -> int:
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


def _plan(x_spec: list[Any], k_spec: list[Any]):
    """Sanitised (batch axes per leading dim, k axes, n axes) from the x and kernel specs."""
    k_axes = _axes(x_spec[-1])
    used = set(k_axes)
    batch = []
    for e in x_spec[:-1]:
        ax = tuple(a for a in _axes(e) if a not in used)
        used.update(ax)
        batch.append(ax)
    n_axes = tuple(a for a in _axes(k_spec[1]) if a not in used)
    return batch, k_axes, n_axes


def _batch_rule(rank_x: int) -> list[str]:
    return [f"b{i}" for i in range(rank_x - 1)]


def forward_partitioned(
    full: Callable[..., Any],
    row_parallel: Callable[[tuple[str, ...], int | None], Callable[..., Any]],
    *,
    has_bias: bool,
    n_results: int,
) -> Callable[..., Any]:
    """``full(x, kernel[, bias])`` with the dense forward sharding rule.

    ``row_parallel(k_axes, scatter_dim)`` returns the per-shard function used when ``k`` is sharded:
    it reduces float32 partial sums over ``k_axes`` (``psum``, or ``psum_scatter`` along output axis
    ``scatter_dim``) and then applies bias and activation.
    """
    cp = custom_partitioning(full)

    def rule(mesh, value_types, result_types):
        del mesh, result_types
        rank_x = len(value_types[0].shape)
        b = _batch_rule(rank_x)
        ops = [" ".join(b + ["k"]), "k n"] + (["n"] if has_bias else [])
        res = [" ".join(b + ["n"])] * n_results
        return f"{', '.join(ops)} -> {', '.join(res)}", {"reduction_factors": ("k",)}

    def partition(mesh, arg_shapes, result_shape):
        x_shape = tuple(arg_shapes[0].shape)
        rank_x = len(x_shape)
        x_spec = padded_spec(arg_shapes[0].sharding.spec, rank_x)
        k_spec = padded_spec(arg_shapes[1].sharding.spec, 2)
        batch, k_axes, n_axes = _plan(x_spec, k_spec)
        n = arg_shapes[1].shape[1]
        out_spec = [_entry(a) for a in batch] + [_entry(n_axes)]
        scatter_dim = None
        if k_axes:
            first = result_shape[0] if isinstance(result_shape, (list, tuple)) else result_shape
            want = padded_spec(first.sharding.spec, rank_x) if first.sharding is not None else [None] * rank_x
            out_dims = list(x_shape[:-1]) + [n]
            ksize = _size(mesh, k_axes)
            for d, e in enumerate(want):
                if _axes(e) == k_axes and out_spec[d] is None and out_dims[d] % ksize == 0:
                    scatter_dim = d
                    out_spec[d] = _entry(k_axes)
                    break
        in_specs = [out_spec[:-1] + [_entry(k_axes)], [_entry(k_axes), _entry(n_axes)]]
        if has_bias:
            in_specs.append([_entry(n_axes) if scatter_dim != rank_x - 1 else out_spec[-1]])
        sh = lambda s: NamedSharding(mesh, PartitionSpec(*s))
        # x's leading specs must not carry the scattered axis (it is a k axis there).
        if scatter_dim is not None and scatter_dim < rank_x - 1:
            in_specs[0][scatter_dim] = None
        in_shardings = tuple(sh(s) for s in in_specs)
        outs = tuple(sh(out_spec) for _ in range(n_results))
        lower = row_parallel(k_axes, scatter_dim) if k_axes else full
        return mesh, lower, (outs if n_results > 1 else outs[0]), in_shardings

    cp.def_partition(partition, sharding_rule=rule)
    return cp


def backward_partitioned(full: Callable[..., Any], *, has_bias: bool, has_saved: bool) -> Callable[..., Any]:
    """``full(x, kernel[, saved], dy) -> (dx, dkernel[, dbias])`` with the dense backward rule."""

    def rule(mesh, value_types, result_types):
        del mesh, result_types
        rank_x = len(value_types[0].shape)
        b = _batch_rule(rank_x)
        bn = " ".join(b + ["n"])
        ops = [" ".join(b + ["k"]), "k n"] + ([bn] if has_saved else []) + [bn]
        res = [" ".join(b + ["k"]), "k n"] + (["n"] if has_bias else [])
        return f"{', '.join(ops)} -> {', '.join(res)}", {}

    def lowered(batch_axes: tuple[str, ...], n_axes: tuple[str, ...]):
        def fn(*args):
            outs = list(full(*args))
            if n_axes:
                outs[0] = jax.lax.psum(outs[0], n_axes)
            if batch_axes:
                outs[1:] = [jax.lax.psum(o, batch_axes) for o in outs[1:]]
            return tuple(outs)

        return fn

    cp = custom_partitioning(full)

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        rank_x = len(arg_shapes[0].shape)
        x_spec = padded_spec(arg_shapes[0].sharding.spec, rank_x)
        k_spec = padded_spec(arg_shapes[1].sharding.spec, 2)
        batch, k_axes, n_axes = _plan(x_spec, k_spec)
        b = [_entry(a) for a in batch]
        bn = b + [_entry(n_axes)]
        in_specs = (
            [b + [_entry(k_axes)], [_entry(k_axes), _entry(n_axes)]] + ([bn] if has_saved else []) + [bn]
        )
        out_specs = [b + [_entry(k_axes)], [_entry(k_axes), _entry(n_axes)]] + (
            [[_entry(n_axes)]] if has_bias else []
        )
        sh = lambda s: NamedSharding(mesh, PartitionSpec(*s))
        batch_axes = tuple(a for ax in batch for a in ax)
        return (
            mesh,
            lowered(batch_axes, n_axes),
            tuple(sh(s) for s in out_specs),
            tuple(sh(s) for s in in_specs),
        )

    cp.def_partition(partition, sharding_rule=rule)
    return cp
