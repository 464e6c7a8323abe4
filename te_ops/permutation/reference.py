"""Pure-JAX token permutation: the specification, the test oracle and the CPU path.

row_id_map layout (int32 ``[T, 2 * E + 1]``), written by token_dispatch, read by token_combine::

    row_id_map[t, k]          k < n_t: the output row of the k-th (t, e) pair of token t, pairs in
                              ascending expert order; -1 for n_t <= k < E
    row_id_map[t, E + k]      the expert of position k: positions k < n_t hold token t's routed
                              experts (ascending), positions k >= n_t the other experts (ascending),
                              so row_id_map[t, E:2E] is a permutation of range(E)
    row_id_map[t, 2 * E]      n_t, the number of rows of token t

Rows are the final (padded) output rows, so token_combine needs no pad_offsets (it accepts them for
TransformerEngine compatibility). A (t, e) pair whose row would fall at or past the output size N
(possible only when num_out_tokens is smaller than the routed count) is dropped: it is not listed.
Every entry is defined; the expert permutation lets kernels write dense [T, E] gradients with one
store per entry.

Shared signatures of every implementation::

    dispatch_forward(x, routing_map, probs, *, num_out_tokens, align_size)
        -> (out, permuted_probs | None, row_id_map, pad_offsets | None, tokens_per_expert), DispatchResiduals
    dispatch_backward(res, g_out, g_permuted_probs, *, num_out_tokens, align_size) -> (dx, dprobs | None)
    combine_forward(y, row_id_map, merging_probs) -> out, CombineResiduals
    combine_backward(res, g) -> (dy, dmerging_probs | None)   (g has y's dtype)
    sort_forward(x, split_sizes, sorted_indices) -> (out, row_id_map), SortResiduals
    sort_backward(res, g) -> dx
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


def out_rows(num_out_tokens: int, num_experts: int, align_size: int | None) -> int:
    """N: num_out_tokens, or with padding ((num_out_tokens + E * (A - 1)) // A) * A."""
    if not align_size:
        return num_out_tokens
    return ((num_out_tokens + num_experts * (align_size - 1)) // align_size) * align_size


def routing_layout(routing_map: jax.Array, num_out_tokens: int, align_size: int | None):
    """(dest[T, E] output row of each pair, valid[T, E], tokens_per_expert[E], pad_offsets[E], N)."""
    t_, e_ = routing_map.shape
    rm = routing_map.astype(jnp.int32)
    counts = rm.sum(0, dtype=jnp.int32)
    a = align_size or 1
    padded = (counts + a - 1) // a * a
    start = jnp.cumsum(padded, dtype=jnp.int32) - padded
    dest = start[None, :] + jnp.cumsum(rm, axis=0, dtype=jnp.int32) - rm
    n = out_rows(num_out_tokens, e_, align_size)
    valid = routing_map & (dest < n)
    pad = padded - counts
    pad_offsets = jnp.cumsum(pad, dtype=jnp.int32) - pad
    return dest, valid, padded, pad_offsets, n


def make_row_id_map(dest: jax.Array, valid: jax.Array) -> jax.Array:
    order = jnp.argsort(jnp.logical_not(valid).astype(jnp.int32), axis=1, stable=True).astype(jnp.int32)
    rows = jnp.take_along_axis(jnp.where(valid, dest, -1), order, axis=1)
    n = valid.sum(1, dtype=jnp.int32)
    return jnp.concatenate([rows, order, n[:, None]], axis=1)


def inverse_map(row_id_map: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(token[N], expert[N]) of every output row; -1 for padding/tail rows."""
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
    vals = jnp.take(x, jnp.maximum(idx, 0), axis=0)
    return jnp.where((idx >= 0)[:, None], vals, jnp.zeros((), x.dtype))


# ----------------------------------------------------------------------------------------------
# token_dispatch
# ----------------------------------------------------------------------------------------------


def dispatch_forward(x, routing_map, probs=None, *, num_out_tokens: int, align_size: int | None):
    dest, valid, tpe, pad_offsets, n = routing_layout(routing_map, num_out_tokens, align_size)
    row_id_map = make_row_id_map(dest, valid)
    src_t, src_e = inverse_map(row_id_map, n)
    out = _gather_rows(x, src_t)
    pp = None
    if probs is not None:
        pp = jnp.where(
            src_t >= 0, probs[jnp.maximum(src_t, 0), jnp.maximum(src_e, 0)], jnp.zeros((), probs.dtype)
        )
    res = DispatchResiduals(row_id_map, x.shape[0], probs is not None)
    return (out, pp, row_id_map, pad_offsets if align_size else None, tpe), res


def dispatch_backward(
    res: DispatchResiduals, g_out, g_pp=None, *, num_out_tokens: int, align_size: int | None
):
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
        val = jnp.where(rows >= 0, g_pp[jnp.maximum(rows, 0)], 0)
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
        w = jnp.where(
            src_t >= 0, merging_probs[jnp.maximum(src_t, 0), jnp.maximum(src_e, 0)].astype(jnp.float32), 0.0
        )
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
    src_start, dst_start, dst_end = chunk_layout(split_sizes, sorted_indices, n)
    r = jnp.arange(n, dtype=jnp.int32)
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
