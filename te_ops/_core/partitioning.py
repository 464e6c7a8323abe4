"""Helpers that give an op its sharding rule (Shardy) and its vmap behaviour.

``partitioned(impl, rule=..., specs=...)`` wraps a function of arrays in
:func:`jax.experimental.custom_partitioning.custom_partitioning`:

* ``rule(*operand_shapes) -> (einsum_like_rule, kwargs)`` gives Shardy the propagation rule, e.g.
  ``("a b k, a b k -> a b k", {"need_replication_factors": ("k",)})``;
* ``specs(operand_specs, operand_shapes) -> (operand_specs, result_specs)`` decides, from the
  shardings Shardy chose, which shardings the op really runs with (e.g. gather the softmax axis);
  the per-shard function is ``impl`` itself, called on local shards.

On one device, or inside ``shard_map`` with every axis manual, ``custom_partitioning`` inlines ``impl``.

``custom_partitioning`` has no batching rule, so ``batch_folding(fn, fold)`` puts a
:func:`jax.custom_batching.custom_vmap` around it whose rule folds the vmapped axis into the op's
own leading axes (``fold(axis_size, in_batched, *args) -> (outputs, out_batched)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

Shape = tuple[int, ...]


def padded_spec(spec: PartitionSpec | None, rank: int) -> list[Any]:
    """The entries of ``spec`` padded with None to ``rank`` entries."""
    entries = list(spec) if spec is not None else []
    return entries + [None] * (rank - len(entries))


def factor_names(rank: int, prefix: str = "d") -> list[str]:
    return [f"{prefix}{i}" for i in range(rank)]


def partitioned(
    impl: Callable[..., Any],
    *,
    rule: Callable[..., tuple[str, dict[str, Any]]],
    specs: Callable[[Sequence[list[Any]], Sequence[Shape]], tuple[Sequence[Any], Any]],
) -> Callable[..., Any]:
    """``impl`` with a Shardy sharding rule and a partition function (see module docstring)."""
    cp = custom_partitioning(impl)

    def partition(mesh, arg_shapes, result_shape):
        shapes = [tuple(a.shape) for a in arg_shapes]
        arg_specs = [padded_spec(a.sharding.spec, len(a.shape)) for a in arg_shapes]
        in_specs, out_specs = specs(arg_specs, shapes)
        to_sharding = lambda s: NamedSharding(mesh, PartitionSpec(*s))
        in_shardings = tuple(to_sharding(s) for s in in_specs)
        if isinstance(result_shape, (list, tuple)):
            out_shardings = tuple(to_sharding(s) for s in out_specs)
        else:
            out_shardings = to_sharding(out_specs)
        return mesh, impl, out_shardings, in_shardings

    def sharding_rule(mesh, value_types, result_types):
        del mesh, result_types
        return rule(*[tuple(t.shape) for t in value_types])

    cp.def_partition(partition, sharding_rule=sharding_rule)
    return cp


def batch_folding(fn: Callable[..., Any], fold: Callable[..., tuple[Any, Any]]) -> Callable[..., Any]:
    """``fn`` with a custom vmap rule ``fold`` (see module docstring)."""
    wrapped = jax.custom_batching.custom_vmap(fn)
    wrapped.def_vmap(fold)
    return wrapped


def broadcast_batched(axis_size: int, in_batched: Sequence[bool], args: Sequence[jax.Array]) -> list[jax.Array]:
    """Gives every unbatched argument the leading vmapped axis (custom_vmap puts it at axis 0)."""
    out = []
    for a, b in zip(args, in_batched, strict=True):
        out.append(a if b else jax.numpy.broadcast_to(a, (axis_size, *a.shape)))
    return out


def _varying_axes(a: Any) -> frozenset:
    """The manual mesh axes ``a`` varies over (jax 0.11: ``typeof(a).manual_axis_type.varying``;
    older releases: ``typeof(a).vma``)."""
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()) or ())
    return frozenset(getattr(t, "vma", ()) or ())


def match_vma(*args: Any) -> tuple[Any, ...]:
    """Inside ``shard_map`` (with ``check_vma``), casts every array leaf of ``args`` to the union of
    their varying manual axes.

    A custom VJP's backward must return cotangents of the primal input types. For a replicated
    (unvarying) weight used with a sharded (varying) activation, the per-device weight gradient is
    varying, which JAX rejects. Casting the weight to varying *before* the custom_vjp makes the types
    agree, and JAX's transpose of that cast inserts the psum over the manual axes, so the weight's
    gradient comes out reduced and replicated. Outside ``shard_map`` this is a no-op.
    """
    leaves, tree = jax.tree.flatten(args)
    vmas = [_varying_axes(a) for a in leaves]
    union = frozenset().union(*vmas)
    if not union:
        return args
    out = []
    for a, vma in zip(leaves, vmas, strict=True):
        missing = tuple(sorted(union - vma))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return jax.tree.unflatten(tree, out)
