"""Sharding rules and vmap folds of the router ops (Shardy rules, partition specs/plans).

Row-wise ops (``fused_topk_with_score_function``, ``compute_routing_scores_for_aux_loss``, their
backwards): every token row is independent, so the token axis ``t`` may be sharded freely (no
collective) while the expert axis is gathered (``need_replication_factors``). Operands and results
are described by kinds: ``"te"`` = ``[T, E]``, ``"tc"`` = compact map ``[T, ceil(E/8)]``,
``"e"`` = ``[E]`` (expert bias, replicated).

``fused_moe_aux_loss`` is a reduction over tokens and experts. Forward: each shard sums its block
of ``probs[t, e] * tokens_per_expert[e]``, ONE ``psum`` over the mesh axes of ``t`` and ``e`` adds
the partial sums, then the global scale is applied, so the sharded loss equals the unsharded one.
Backward: ``d probs[t, e] = g_scaled * tokens_per_expert[e]`` is built per shard with the LOCAL
token count, tokens stay sharded like the requested result, no collective.

vmap: ``custom_partitioning`` has no batching rule. Row-wise ops fold the vmapped axis into ``T``
(one call); when a per-expert operand (expert bias) is itself vmapped, or for the aux loss (a
scalar per batch element), the batch runs sequentially (``lax.map``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from te_ops._core import partitioning as P
from te_ops._core.partitioning import ShardContext, ShardPlan
from te_ops._core.validation import broadcast_batched, mesh_axes, mesh_size, sequential_fold, spec_entry

ROW_KINDS = {"te": "t e", "tc": "t c", "e": "e"}


# ----------------------------------------------------------------------------------------------
# Row-wise ops
# ----------------------------------------------------------------------------------------------


def rowwise_rule(operand_kinds: Sequence[str], result_kinds: Sequence[str], *shapes) -> tuple[str, dict]:
    """Shardy rule: ``t`` propagates, every other factor (``e``, ``c``) is replicated."""
    del shapes
    ops = ", ".join(ROW_KINDS[k] for k in operand_kinds)
    res = ", ".join(ROW_KINDS[k] for k in result_kinds)
    order = []  # factors in order of first appearance (Shardy wants special factors sorted by index)
    for f in " ".join(ROW_KINDS[k] for k in (*operand_kinds, *result_kinds)).split():
        if f not in order:
            order.append(f)
    return f"{ops} -> {res}", {"need_replication_factors": tuple(f for f in order if f != "t")}


def rowwise_specs(
    operand_kinds: Sequence[str], result_kinds: Sequence[str], arg_specs: Sequence[list[Any]], shapes
) -> tuple[list[list[Any]], Any]:
    """Runs with the first operand's token sharding on every ``[T, ...]`` operand and result;
    expert axes and ``[E]`` operands gathered."""
    del shapes
    t_spec = arg_specs[0][0]
    spec = {"te": [t_spec, None], "tc": [t_spec, None], "e": [None]}
    ins = [spec[k] for k in operand_kinds]
    outs = [spec[k] for k in result_kinds]
    return ins, (tuple(outs) if len(outs) > 1 else outs[0])


def rowwise_fold(fn: Callable[..., Any], n_rows_args: int, axis_size: int, in_batched, *args):
    """vmap rule: the vmapped axis folds into ``T`` of the first ``n_rows_args`` (``[T, ...]``)
    operands; if a trailing ``[E]`` operand is vmapped too, the batch runs sequentially."""
    if any(in_batched[n_rows_args:]):
        return sequential_fold(fn)(axis_size, in_batched, *args)
    xs = broadcast_batched(axis_size, in_batched[:n_rows_args], args[:n_rows_args])
    v, t = xs[0].shape[:2]
    folded = [a.reshape(v * t, *a.shape[2:]) for a in xs]
    out = fn(*folded, *args[n_rows_args:])
    out = jax.tree.map(lambda o: o.reshape(v, t, *o.shape[1:]), out)
    return out, jax.tree.map(lambda _: True, out)


def rowwise_call(
    impl: Callable[..., Any], operand_kinds: Sequence[str], result_kinds: Sequence[str], n_rows_args: int
) -> Callable[..., Any]:
    """``impl`` with the row-wise sharding rule and vmap fold."""
    operand_kinds, result_kinds = tuple(operand_kinds), tuple(result_kinds)
    part = P.partitioned(
        impl,
        rule=functools.partial(rowwise_rule, operand_kinds, result_kinds),
        specs=functools.partial(rowwise_specs, operand_kinds, result_kinds),
    )
    return P.batch_folding(part, functools.partial(rowwise_fold, part, n_rows_args))


# ----------------------------------------------------------------------------------------------
# fused_moe_aux_loss
# ----------------------------------------------------------------------------------------------


def loss_forward_rule(*shapes) -> tuple[str, dict]:
    """``probs [t, e], tokens_per_expert [e] -> scalar``: both factors are reduced."""
    del shapes
    return "t e, e -> ", {"reduction_factors": ("t", "e")}


def _psum_then_finish(partial_sum: Callable, finish: Callable, axes: tuple[str, ...], probs, tpe):
    partial = partial_sum(probs, tpe)
    if axes:
        partial = jax.lax.psum(partial, axes)
    return finish(partial)


def loss_forward_plan(partial_sum: Callable, finish: Callable, ctx: ShardContext) -> ShardPlan:
    """Keeps probs' sharding (tokens_per_expert follows its expert axis); each shard computes its
    partial sum, one ``psum`` over the token and expert mesh axes, then ``finish`` scales it."""
    t_entry, e_entry = ctx.arg_specs[0]
    axes = mesh_axes(t_entry) + mesh_axes(e_entry)
    return ShardPlan(
        in_specs=[[t_entry, e_entry], [e_entry]],
        out_specs=[],
        per_shard=functools.partial(_psum_then_finish, partial_sum, finish, axes),
    )


def loss_backward_rule(*shapes) -> tuple[str, dict]:
    """``tokens_per_expert [e], g_scaled [] -> d probs [t e]``."""
    del shapes
    return "e, -> t e", {}


def loss_backward_plan(backward_for: Callable[[tuple[int, int]], Callable], ctx: ShardContext) -> ShardPlan:
    """d probs keeps the token sharding asked of the result (when it divides T), experts gathered;
    ``backward_for(local_shape)`` builds the per-shard function for the local block."""
    t, e = ctx.result_shapes[0]
    t_axes = mesh_axes(ctx.result_specs[0][0])
    n = mesh_size(ctx.mesh, t_axes)
    if t % n:
        t_axes, n = (), 1
    t_entry = spec_entry(t_axes)
    return ShardPlan(in_specs=[[None], []], out_specs=[t_entry, None], per_shard=backward_for((t // n, e)))


def loss_call(impl: Callable[..., Any], *, rule: Callable, plan: Callable[[ShardContext], ShardPlan]):
    """``impl`` with the given rule/plan, and a sequential vmap (one scalar loss per batch element)."""
    part = P.partitioned(impl, rule=rule, plan=plan)
    return P.batch_folding(part, sequential_fold(part))
