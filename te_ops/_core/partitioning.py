"""Helpers that give an op its sharding rule (Shardy) and its vmap behaviour.

``partitioned(impl, rule=..., specs=... | plan=...)`` wraps a function of arrays in
:func:`jax.experimental.custom_partitioning.custom_partitioning` (no op calls it directly):

* ``rule(*operand_shapes) -> (einsum_like_rule, kwargs)`` gives Shardy the propagation rule, e.g.
  ``("a b k, a b k -> a b k", {"need_replication_factors": ("k",)})``;
* ``specs(operand_specs, operand_shapes) -> (operand_specs, result_specs)`` decides, from the
  shardings Shardy chose, which shardings the op really runs with (e.g. gather the softmax axis);
  the per-shard function is ``impl`` itself, called on local shards;
* or ``plan(ShardContext) -> ShardPlan`` when the per-shard function depends on the shardings
  (it sees the mesh and the result shardings, and returns its own per-shard function, e.g. one that
  ``psum``s partial sums over a sharded contraction axis).

Each op keeps its rule, specs/plan and vmap fold as top-level functions in ``<op>/sharding.py``.

On one device, or inside ``shard_map`` with every axis manual, ``custom_partitioning`` inlines ``impl``.

``custom_partitioning`` has no batching rule, so ``batch_folding(fn, fold)`` puts a
:func:`jax.custom_batching.custom_vmap` around it whose rule folds the vmapped axis into the op's
own leading axes (``fold(axis_size, in_batched, *args) -> (outputs, out_batched)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from te_ops._core.validation import broadcast_batched, sequential_fold  # noqa: F401 (re-exported)

Shape = tuple[int, ...]


def padded_spec(spec: PartitionSpec | None, rank: int) -> list[Any]:
    """The entries of ``spec`` padded with None to ``rank`` entries."""
    entries = list(spec) if spec is not None else []
    return entries + [None] * (rank - len(entries))


def factor_names(rank: int, prefix: str = "d") -> list[str]:
    return [f"{prefix}{i}" for i in range(rank)]


@dataclasses.dataclass(frozen=True)
class ShardContext:
    """What a partition callback sees: the mesh, and per operand / result its global shape and the
    sharding Shardy chose (PartitionSpec entries padded to the rank; results whose sharding is not
    known yet get all-None entries)."""

    mesh: Any
    arg_shapes: tuple[Shape, ...]
    arg_specs: tuple[list[Any], ...]
    result_shapes: tuple[Shape, ...]
    result_specs: tuple[list[Any], ...]


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How an op runs on the chosen shardings: operand specs, result specs (a list per result, or
    one list for a single result) and the per-shard function (None: the op's own function, called
    on local shards). A per-shard function adds the collectives the plan needs (e.g. a ``psum`` of
    partial sums when a contraction axis is sharded)."""

    in_specs: Sequence[Sequence[Any]]
    out_specs: Any
    per_shard: Callable[..., Any] | None = None


def _to_shapes(avals) -> tuple[Shape, ...]:
    avals = avals if isinstance(avals, (list, tuple)) else [avals]
    return tuple(tuple(a.shape) for a in avals)


def _to_specs(avals) -> tuple[list[Any], ...]:
    avals = avals if isinstance(avals, (list, tuple)) else [avals]
    out = []
    for a in avals:
        sharding = getattr(a, "sharding", None)
        out.append(padded_spec(getattr(sharding, "spec", None), len(a.shape)))
    return tuple(out)


def partitioned(
    impl: Callable[..., Any],
    *,
    rule: Callable[..., tuple[str, dict[str, Any]]],
    specs: Callable[[Sequence[list[Any]], Sequence[Shape]], tuple[Sequence[Any], Any]] | None = None,
    plan: Callable[[ShardContext], ShardPlan] | None = None,
    rule_needs_mesh: bool = False,
) -> Callable[..., Any]:
    """``impl`` with a Shardy sharding rule and a partition function.

    Give exactly one of:

    * ``specs(operand_specs, operand_shapes) -> (operand_specs, result_specs)``: the per-shard
      function is ``impl`` itself (ops whose shards need no collective);
    * ``plan(ctx: ShardContext) -> ShardPlan``: for ops whose per-shard function depends on the
      shardings (reductions over a sharded axis, shapes that change per shard).

    ``rule(*operand_shapes) -> (einsum_like_rule, kwargs)`` gives Shardy the propagation rule. This
    is the only place in te_ops that calls ``custom_partitioning``. With ``rule_needs_mesh`` the rule
    is called as ``rule(*operand_shapes, mesh=mesh)`` (e.g. to state a block structure only where
    every mesh axis divides the number of blocks).
    """
    if (specs is None) == (plan is None):
        raise TypeError("partitioned: give exactly one of specs= or plan=")
    cp = custom_partitioning(impl)

    def partition(mesh, arg_shapes, result_shape):
        multiple = isinstance(result_shape, (list, tuple))
        if plan is not None:
            ctx = ShardContext(
                mesh=mesh,
                arg_shapes=_to_shapes(arg_shapes),
                arg_specs=_to_specs(arg_shapes),
                result_shapes=_to_shapes(result_shape),
                result_specs=_to_specs(result_shape),
            )
            p = plan(ctx)
        else:
            in_specs, out_specs = specs(list(_to_specs(arg_shapes)), list(_to_shapes(arg_shapes)))
            p = ShardPlan(in_specs, out_specs)
        to_sharding = lambda s: NamedSharding(mesh, PartitionSpec(*s))
        in_shardings = tuple(to_sharding(s) for s in p.in_specs)
        if multiple:
            out_shardings = tuple(to_sharding(s) for s in p.out_specs)
        else:
            out_shardings = to_sharding(p.out_specs)
        return mesh, (p.per_shard or impl), out_shardings, in_shardings

    def sharding_rule(mesh, value_types, result_types):
        del result_types
        shapes = [tuple(t.shape) for t in value_types]
        return rule(*shapes, mesh=mesh) if rule_needs_mesh else rule(*shapes)

    cp.def_partition(partition, sharding_rule=sharding_rule)
    return cp


def batch_folding(fn: Callable[..., Any], fold: Callable[..., tuple[Any, Any]]) -> Callable[..., Any]:
    """``fn`` with a custom vmap rule ``fold`` (see module docstring)."""
    wrapped = jax.custom_batching.custom_vmap(fn)
    wrapped.def_vmap(fold)
    return wrapped


def _varying_axes(a: Any) -> frozenset:
    """The manual mesh axes ``a`` varies over inside ``shard_map``."""
    mat = getattr(jax.typeof(a), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ()) if mat is not None else frozenset()


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
