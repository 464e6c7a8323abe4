"""Sharding rules, partition plans and vmap rules of the permutation ops.

Used by ``api.py`` through ``te_ops._core.partitioning.partitioned`` (Shardy rule + partition
callback) and ``partitioning.batch_folding`` (vmap). Statics (has_probs, align_size, ...) are bound
with ``functools.partial``.

* token_dispatch / token_combine are **data parallel over tokens**: when the token axis of x (for
  dispatch) or of row_id_map (for combine) is sharded, each shard routes its own tokens into its
  own buffer of ``num_out_tokens / shards`` rows, so ``out``, ``permuted_probs`` and ``row_id_map``
  are the concatenation of the per-shard results and row_id_map values are shard-local rows. The
  capacity (and so which pairs are dropped) is per shard; ``tokens_per_expert`` and ``num_dropped``
  are summed over the shards (one all-reduce of E + 1 integers), so they count every kept row and
  every dropped pair of the global batch. token_combine must see the same token sharding as the
  token_dispatch that made its row_id_map (the natural case inside one data-parallel region).
  With ``align_size`` the per-shard padded sizes would not add up to the global N, so padded
  dispatch gathers the tokens instead (exact, not scaled out).
* sort_chunks_by_index gathers its row axis (chunks are global) and keeps a sharded hidden axis.
* vmap: every vmapped call runs the op once per batch element (``lax.map``), because each batch
  element routes its own tokens (``validation.sequential_fold``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from te_ops._core import partitioning as P
from te_ops._core.validation import err, mesh_axes, sequential_fold


def per_element_vmap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a vmap rule that runs it once per batch element."""
    return P.batch_folding(fn, sequential_fold(fn))


def local_out_tokens(num_out_tokens: int, t_local: int, t_global: int) -> int:
    """num_out_tokens of one token shard (``t_local`` of ``t_global`` tokens)."""
    if t_local == t_global:
        return num_out_tokens
    shards = t_global // t_local
    if num_out_tokens % shards:
        raise ValueError(
            err(
                "token_dispatch",
                f"with tokens sharded into {shards} shards, num_out_tokens ({num_out_tokens}) must split "
                "evenly over the shards (each shard gets its own buffer); use a multiple of the shard count "
                "(e.g. T * topk), or replicate the token axis.",
            )
        )
    return num_out_tokens // shards


def _summed_over(fn: Callable[..., Any], axes: Sequence[str], summed: Sequence[int]) -> Callable[..., Any]:
    """``fn`` whose results at positions ``summed`` are all-reduced (sum) over mesh ``axes``."""

    def per_shard(*args):
        outs = list(fn(*args))
        for i in summed:
            outs[i] = jax.lax.psum(outs[i], tuple(axes))
        return tuple(outs)

    return per_shard


# ----------------------------------------------------------------------------------------------
# token_dispatch: forward results (out, [permuted_probs], row_id_map, tokens_per_expert,
# num_dropped, [pad_offsets]); backward results (dx, [dprobs]).
# ----------------------------------------------------------------------------------------------


def dispatch_forward_rule(*shapes, has_probs: bool, has_pad: bool) -> tuple[str, dict[str, Any]]:
    ops = "t h, t e" + (", t e" if has_probs else "")
    res = ["n h"] + (["n"] if has_probs else []) + ["t r", "e", ""] + (["e"] if has_pad else [])
    return f"{ops} -> {', '.join(res)}", {}


def dispatch_forward_plan(
    ctx: P.ShardContext, *, fn: Callable[..., Any], has_probs: bool, has_pad: bool
) -> P.ShardPlan:
    t_ax = None if has_pad else ctx.arg_specs[0][0]
    ins = [[t_ax, None], [t_ax, None]] + ([[t_ax, None]] if has_probs else [])
    outs = [[t_ax, None]] + ([[t_ax]] if has_probs else []) + [[t_ax, None], [None], []]
    outs += [[None]] if has_pad else []
    axes = mesh_axes(t_ax)
    if not axes:
        return P.ShardPlan(ins, outs)
    first_count = 3 if has_probs else 2  # tokens_per_expert, then num_dropped
    return P.ShardPlan(ins, outs, _summed_over(fn, axes, (first_count, first_count + 1)))


def dispatch_backward_rule(*shapes, has_probs: bool) -> tuple[str, dict[str, Any]]:
    ops = "t r, n h" + (", n" if has_probs else "")
    res = "t h" + (", t e" if has_probs else "")
    return f"{ops} -> {res}", {}


def dispatch_backward_specs(arg_specs, shapes, *, has_probs: bool, has_pad: bool):
    t_ax = None if has_pad else arg_specs[0][0]
    ins = [[t_ax, None], [t_ax, None]] + ([[t_ax]] if has_probs else [])
    outs = [[t_ax, None], [t_ax, None]] if has_probs else [t_ax, None]
    return ins, outs


# ----------------------------------------------------------------------------------------------
# token_combine: forward (y, row_id_map, [merging_probs]) -> out; backward
# (row_id_map, g, [y, merging_probs]) -> (dy, [dmerging_probs]).
# ----------------------------------------------------------------------------------------------


def combine_forward_rule(*shapes, has_probs: bool) -> tuple[str, dict[str, Any]]:
    return "n h, t r" + (", t e" if has_probs else "") + " -> t h", {}


def combine_forward_specs(arg_specs, shapes, *, has_probs: bool):
    t_ax = arg_specs[1][0]
    ins = [[t_ax, None], [t_ax, None]] + ([[t_ax, None]] if has_probs else [])
    return ins, [t_ax, None]


def combine_backward_rule(*shapes, has_probs: bool) -> tuple[str, dict[str, Any]]:
    ops = "t r, t h" + (", n h, t e" if has_probs else "")
    res = "n h" + (", t e" if has_probs else "")
    return f"{ops} -> {res}", {}


def combine_backward_specs(arg_specs, shapes, *, has_probs: bool):
    t_ax = arg_specs[0][0]
    ins = [[t_ax, None], [t_ax, None]] + ([[t_ax, None], [t_ax, None]] if has_probs else [])
    outs = [[t_ax, None], [t_ax, None]] if has_probs else [t_ax, None]
    return ins, outs


# ----------------------------------------------------------------------------------------------
# sort_chunks_by_index: forward (x, split_sizes, sorted_indices) -> (out, row_id_map); backward
# (row_id_map, g) -> dx. The row axis is gathered, the hidden axis may stay sharded.
# ----------------------------------------------------------------------------------------------


def sort_forward_rule(*shapes) -> tuple[str, dict[str, Any]]:
    return "n h, s, s -> n h, n", {"need_replication_factors": ("n",)}


def sort_forward_specs(arg_specs, shapes):
    h_ax = arg_specs[0][1]
    return [[None, h_ax], [None], [None]], [[None, h_ax], [None]]


def sort_backward_rule(*shapes) -> tuple[str, dict[str, Any]]:
    return "n, n h -> n h", {"need_replication_factors": ("n",)}


def sort_backward_specs(arg_specs, shapes):
    h_ax = arg_specs[1][1]
    return [[None], [None, h_ax]], [None, h_ax]


def partitioned_dispatch_forward(fn: Callable[..., Any], *, has_probs: bool, has_pad: bool) -> Callable[..., Any]:
    """The dispatch forward ``fn`` with its sharding rule, partition plan and vmap rule."""
    rule = functools.partial(dispatch_forward_rule, has_probs=has_probs, has_pad=has_pad)
    plan = functools.partial(dispatch_forward_plan, fn=fn, has_probs=has_probs, has_pad=has_pad)
    return per_element_vmap(P.partitioned(fn, rule=rule, plan=plan))


def partitioned_dispatch_backward(fn: Callable[..., Any], *, has_probs: bool, has_pad: bool) -> Callable[..., Any]:
    rule = functools.partial(dispatch_backward_rule, has_probs=has_probs)
    specs = functools.partial(dispatch_backward_specs, has_probs=has_probs, has_pad=has_pad)
    return per_element_vmap(P.partitioned(fn, rule=rule, specs=specs))


def partitioned_combine_forward(fn: Callable[..., Any], *, has_probs: bool) -> Callable[..., Any]:
    rule = functools.partial(combine_forward_rule, has_probs=has_probs)
    specs = functools.partial(combine_forward_specs, has_probs=has_probs)
    return per_element_vmap(P.partitioned(fn, rule=rule, specs=specs))


def partitioned_combine_backward(fn: Callable[..., Any], *, has_probs: bool) -> Callable[..., Any]:
    rule = functools.partial(combine_backward_rule, has_probs=has_probs)
    specs = functools.partial(combine_backward_specs, has_probs=has_probs)
    return per_element_vmap(P.partitioned(fn, rule=rule, specs=specs))


def partitioned_sort_forward(fn: Callable[..., Any]) -> Callable[..., Any]:
    return per_element_vmap(P.partitioned(fn, rule=sort_forward_rule, specs=sort_forward_specs))


def partitioned_sort_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
    return per_element_vmap(P.partitioned(fn, rule=sort_backward_rule, specs=sort_backward_specs))
