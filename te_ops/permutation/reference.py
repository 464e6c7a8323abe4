"""Pure-JAX token permutation: the specification, the test oracle and the CPU path.

Capacity layout of token_dispatch (``c[e]`` = tokens routed to expert e, ``A`` = align_size or 1)::

    p[e]      = ceil(c[e] / A) * A                   expert e's block in the full layout
    start[e]  = p[0] + ... + p[e - 1]                first row of expert e's block
    row(t, e) = start[e] + #{t' < t routed to e}     expert-major, ascending token within an expert
    N         = num_out_tokens, or ((num_out_tokens + E * (A - 1)) // A) * A with align_size

A pair (t, e) is KEPT when row(t, e) < N and DROPPED otherwise: the pairs that do not fit are the
tail of the expert-major order (the last rows of the last non-empty experts). With
``room[e] = max(N - start[e], 0)``::

    kept[e]              = min(c[e], room[e])               kept pairs of expert e
    tokens_per_expert[e] = min(p[e], room[e])               its (padded) block in the buffer
    pad_offsets[e]       = sum over e' < e of (tokens_per_expert[e'] - kept[e'])
    num_dropped          = sum over e of (c[e] - kept[e])

so the blocks of ``tokens_per_expert`` tile rows ``[0, sum(tokens_per_expert))`` with
``sum(tokens_per_expert) <= N`` (a grouped GEMM over them reads exactly the kept rows and their
padding), and a kept pair's row is ``sum(kept[:e]) + pad_offsets[e] + rank``. Every row that holds
no kept pair (alignment padding, unused tail) is zero.

row_id_map layout (int32 ``[T, 2 * E + 1]``), written by token_dispatch, read by token_combine::

    row_id_map[t, k]          k < n_t: the output row of the k-th KEPT pair of token t, pairs in
                              ascending expert order; k >= n_t: -2 when position k holds a routed
                              pair that was dropped, -1 when it holds an expert t is not routed to
    row_id_map[t, E + k]      the expert of position k: positions k < n_t hold token t's kept
                              experts (ascending), positions k >= n_t the other experts (dropped
                              and unrouted together, ascending), so row_id_map[t, E:2E] is a
                              permutation of range(E)
    row_id_map[t, 2 * E]      n_t, the number of kept rows of token t

Rows are the final (padded) output rows, so token_combine needs no pad_offsets (it accepts them for
TransformerEngine compatibility). Only the first n_t entries are ever read back, so a dropped pair
takes no part in token_combine or in any backward pass. Every entry is defined; the expert
permutation lets kernels write dense [T, E] gradients with one store per entry.

Shared signatures of every implementation::

    dispatch_forward(x, routing_map, probs, *, num_out_tokens, align_size)
        -> (out, permuted_probs | None, row_id_map, pad_offsets | None, tokens_per_expert, num_dropped),
           DispatchResiduals
    dispatch_backward(res, g_out, g_permuted_probs, *, num_out_tokens, align_size) -> (dx, dprobs | None)
    combine_forward(y, row_id_map, merging_probs) -> out, CombineResiduals
    combine_backward(res, g) -> (dy, dmerging_probs | None)   (g has y's dtype)
    sort_forward(x, split_sizes, sorted_indices) -> (out, row_id_map), SortResiduals
    sort_backward(res, g) -> dx

The GPU implementations are called only with non-empty sizes (T, E, H, N > 0); the reference
handles every size, including zero-length axes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class DispatchResiduals(NamedTuple):
    row_id_map: jax.Array
    num_tokens: int
    has_probs: bool


class CombineResiduals(NamedTuple):
    y: jax.Array | None  # needed only for the merging_probs gradient
    row_id_map: jax.Array
    merging_probs: jax.Array | None
    num_rows: int  # N, rows of y


class SortResiduals(NamedTuple):
    row_id_map: jax.Array


class RoutingLayout(NamedTuple):
    dest: jax.Array  # int32 [T, E]: row of every pair in the full (untruncated) layout
    kept: jax.Array  # bool [T, E]: routed and row < N
    routed: jax.Array  # bool [T, E]: the routing map
    tokens_per_expert: jax.Array  # int32 [E]
    pad_offsets: jax.Array  # int32 [E]
    num_dropped: jax.Array  # int32 []
    num_rows: int  # N


def out_rows(num_out_tokens: int, num_experts: int, align_size: int | None) -> int:
    """N: num_out_tokens, or with padding ((num_out_tokens + E * (A - 1)) // A) * A."""
    if not align_size:
        return num_out_tokens
    return ((num_out_tokens + num_experts * (align_size - 1)) // align_size) * align_size


def capacity_counts(counts: jax.Array, num_rows: int, align_size: int | None):
    """(start[E], tokens_per_expert[E], kept[E], pad_offsets[E], num_dropped) of the capacity layout
    (module docstring) from the routed count of every expert."""
    a = align_size or 1
    padded = (counts + a - 1) // a * a
    start = jnp.cumsum(padded, dtype=jnp.int32) - padded
    room = jnp.maximum(num_rows - start, 0)
    tpe = jnp.minimum(padded, room)
    kept = jnp.minimum(counts, room)
    holes = tpe - kept
    pad_offsets = jnp.cumsum(holes, dtype=jnp.int32) - holes
    num_dropped = jnp.sum(counts - kept, dtype=jnp.int32)
    return start, tpe, kept, pad_offsets, num_dropped


def routing_layout(routing_map: jax.Array, num_out_tokens: int, align_size: int | None) -> RoutingLayout:
    """The capacity layout of ``routing_map`` (module docstring)."""
    e_ = routing_map.shape[1]
    rm = routing_map.astype(jnp.int32)
    counts = rm.sum(0, dtype=jnp.int32)
    n = out_rows(num_out_tokens, e_, align_size)
    start, tpe, _, pad_offsets, num_dropped = capacity_counts(counts, n, align_size)
    dest = start[None, :] + jnp.cumsum(rm, axis=0, dtype=jnp.int32) - rm
    kept = routing_map & (dest < n)
    return RoutingLayout(dest, kept, routing_map, tpe, pad_offsets, num_dropped, n)


def make_row_id_map(layout: RoutingLayout) -> jax.Array:
    """row_id_map (module docstring) of a routing layout."""
    kept = layout.kept
    order = jnp.argsort(jnp.logical_not(kept).astype(jnp.int32), axis=1, stable=True).astype(jnp.int32)
    marks = jnp.where(kept, layout.dest, jnp.where(layout.routed, -2, -1))
    rows = jnp.take_along_axis(marks, order, axis=1)
    n = kept.sum(1, dtype=jnp.int32)
    return jnp.concatenate([rows, order, n[:, None]], axis=1)


def inverse_map(row_id_map: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(token[N], expert[N]) of every output row; -1 for rows that hold no kept pair."""
    t_ = row_id_map.shape[0]
    e_ = (row_id_map.shape[1] - 1) // 2
    rows = row_id_map[:, :e_]
    experts = row_id_map[:, e_ : 2 * e_]
    idx = jnp.where(rows >= 0, rows, num_rows).reshape(-1)
    tok = jnp.broadcast_to(jnp.arange(t_, dtype=jnp.int32)[:, None], rows.shape).reshape(-1)
    src_t = jnp.full((num_rows,), -1, jnp.int32).at[idx].set(tok, mode="drop")
    src_e = jnp.full((num_rows,), -1, jnp.int32).at[idx].set(experts.reshape(-1), mode="drop")
    return src_t, src_e


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x[idx] with zero rows where idx < 0 (x may have no rows)."""
    if x.shape[0] == 0:
        return jnp.zeros((idx.shape[0], *x.shape[1:]), x.dtype)
    vals = jnp.take(x, jnp.maximum(idx, 0), axis=0)
    return jnp.where((idx >= 0).reshape(-1, *([1] * (x.ndim - 1))), vals, jnp.zeros((), x.dtype))


def _gather_pairs(m: jax.Array, tok: jax.Array, exp: jax.Array) -> jax.Array:
    """m[tok, exp] with zeros where tok < 0 (m may be empty)."""
    if m.size == 0:
        return jnp.zeros(tok.shape, m.dtype)
    ok = tok >= 0
    return jnp.where(ok, m[jnp.maximum(tok, 0), jnp.maximum(exp, 0)], jnp.zeros((), m.dtype))


# ----------------------------------------------------------------------------------------------
# token_dispatch
# ----------------------------------------------------------------------------------------------


def dispatch_forward(x, routing_map, probs=None, *, num_out_tokens: int, align_size: int | None):
    layout = routing_layout(routing_map, num_out_tokens, align_size)
    row_id_map = make_row_id_map(layout)
    src_t, src_e = inverse_map(row_id_map, layout.num_rows)
    out = _gather_rows(x, src_t)
    pp = None if probs is None else _gather_pairs(probs, src_t, src_e)
    res = DispatchResiduals(row_id_map, x.shape[0], probs is not None)
    pad = layout.pad_offsets if align_size else None
    return (out, pp, row_id_map, pad, layout.tokens_per_expert, layout.num_dropped), res


def dispatch_backward(res: DispatchResiduals, g_out, g_pp=None, *, num_out_tokens: int, align_size: int | None):
    t_ = res.num_tokens
    e_ = (res.row_id_map.shape[1] - 1) // 2
    n = g_out.shape[0]
    src_t, _ = inverse_map(res.row_id_map, n)
    dx = (
        jnp.zeros((t_, g_out.shape[1]), jnp.float32)
        .at[jnp.where(src_t >= 0, src_t, t_)]
        .add(g_out.astype(jnp.float32), mode="drop")
    )
    dx = dx.astype(g_out.dtype)
    dprobs = None
    if res.has_probs and g_pp is not None:
        rows = res.row_id_map[:, :e_]
        experts = res.row_id_map[:, e_ : 2 * e_]
        val = _gather_rows(g_pp, jnp.where(rows >= 0, rows, -1).reshape(-1)).reshape(rows.shape)
        tok = jnp.broadcast_to(jnp.arange(t_)[:, None], rows.shape)
        dprobs = jnp.zeros((t_, e_), g_pp.dtype).at[tok, experts].set(val.astype(g_pp.dtype))
    return dx, dprobs


# ----------------------------------------------------------------------------------------------
# token_combine
# ----------------------------------------------------------------------------------------------


def _row_weights(row_id_map, merging_probs, n):
    src_t, src_e = inverse_map(row_id_map, n)
    if merging_probs is None:
        w = (src_t >= 0).astype(jnp.float32)
    else:
        w = _gather_pairs(merging_probs, src_t, src_e).astype(jnp.float32)
    return src_t, src_e, w


def combine_forward(y, row_id_map, merging_probs=None):
    t_ = row_id_map.shape[0]
    src_t, _, w = _row_weights(row_id_map, merging_probs, y.shape[0])
    out = (
        jnp.zeros((t_, y.shape[1]), jnp.float32)
        .at[jnp.where(src_t >= 0, src_t, t_)]
        .add(y.astype(jnp.float32) * w[:, None], mode="drop")
    )
    res = CombineResiduals(y if merging_probs is not None else None, row_id_map, merging_probs, y.shape[0])
    return out.astype(y.dtype), res


def combine_backward(res: CombineResiduals, g):
    n = res.num_rows
    dtype = g.dtype  # the cotangent of out has y's dtype
    src_t, src_e, w = _row_weights(res.row_id_map, res.merging_probs, n)
    g32 = _gather_rows(g.astype(jnp.float32), src_t)
    dy = (g32 * w[:, None]).astype(dtype)
    dmp = None
    if res.merging_probs is not None:
        t_, e_ = res.merging_probs.shape
        dots = jnp.sum(res.y.astype(jnp.float32) * g32, axis=1)
        dmp = (
            jnp.zeros((t_, e_), jnp.float32)
            .at[jnp.where(src_t >= 0, src_t, t_), jnp.maximum(src_e, 0)]
            .set(dots, mode="drop")
            .astype(res.merging_probs.dtype)
        )
    return dy, dmp


# ----------------------------------------------------------------------------------------------
# sort_chunks_by_index
# ----------------------------------------------------------------------------------------------


def chunk_layout(split_sizes, sorted_indices, n):
    """Per position j of the sorted order: (source start, destination start, destination end) of
    chunk sorted_indices[j]. Sizes are clipped to >= 0 and cumulative sizes to n."""
    sizes = jnp.maximum(split_sizes.astype(jnp.int32), 0)
    cum = jnp.cumsum(sizes, dtype=jnp.int32)
    ends = jnp.minimum(cum, n)
    starts = jnp.minimum(cum - sizes, n)
    clipped = ends - starts
    idx = sorted_indices.astype(jnp.int32)
    sz = clipped[idx]
    dst_end = jnp.cumsum(sz, dtype=jnp.int32)
    return starts[idx], dst_end - sz, dst_end


def chunk_src(split_sizes, sorted_indices, n):
    """src[r]: the input row output row r takes (rows past the chunks take themselves)."""
    r = jnp.arange(n, dtype=jnp.int32)
    if sorted_indices.shape[0] == 0:  # no chunks: every row stays
        return r
    src_start, dst_start, dst_end = chunk_layout(split_sizes, sorted_indices, n)
    j = jnp.sum(dst_end[None, :] <= r[:, None], axis=1, dtype=jnp.int32)
    inside = j < sorted_indices.shape[0]
    jj = jnp.where(inside, j, 0)
    return jnp.where(inside, src_start[jj] + r - dst_start[jj], r)


def sort_forward(x, split_sizes, sorted_indices):
    n = x.shape[0]
    src = chunk_src(split_sizes, sorted_indices, n)
    row_id_map = jnp.zeros((n,), jnp.int32).at[src].set(jnp.arange(n, dtype=jnp.int32))
    return (jnp.take(x, src, axis=0), row_id_map), SortResiduals(row_id_map)


def sort_backward(res: SortResiduals, g):
    return jnp.take(g, res.row_id_map, axis=0)
