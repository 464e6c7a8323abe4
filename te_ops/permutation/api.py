"""Public permutation ops: token_dispatch, token_combine, sort_chunks_by_index.

Each public function validates its arguments, then calls one ``jax.custom_vjp`` built per static
configuration, whose forward and backward dispatch to an implementation (``reference``, ``triton``,
``gluon``) through the registry. Sharding rules, partition plans and vmap rules live in
``sharding.py``; the row layout and the capacity rule in ``reference.py``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from te_ops._core import registry
from te_ops._core import triton_bridge as tb
from te_ops._core.partitioning import match_vma
from te_ops._core.validation import (
    FLOAT_DTYPES_WITH_F64,
    check_bool,
    check_float,
    check_int_array,
    check_rank,
    err,
    static_int,
)
from te_ops.permutation import reference as ref
from te_ops.permutation import sharding as S
from te_ops.permutation import triton as tri


class TokenDispatchResult(NamedTuple):
    """What :func:`token_dispatch` returns (a NamedTuple: unpack it or use the fields)."""

    out: jax.Array  # [N, H], x's dtype
    permuted_probs: jax.Array | None  # [N], probs' dtype; None without probs
    row_id_map: jax.Array  # int32 [T, 2E + 1], the input of token_combine
    pad_offsets: jax.Array | None  # int32 [E]; None without align_size
    tokens_per_expert: jax.Array  # int32 [E], rows of each expert's block in out (kept, padded)
    num_dropped: jax.Array  # int32 [], routed (token, expert) pairs that did not fit in out


def _gluon_available() -> str | None:
    why = tb.unavailable_reason(gluon=True)
    if why:
        return why
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return None  # the registry reports the missing device
    cc = str(getattr(devices[0], "compute_capability", "0.0"))
    if tuple(int(p) for p in cc.split(".")[:2]) < (9, 0):
        return f"the Gluon kernels are written for Hopper (sm_90+); this device is sm_{cc.replace('.', '')}"
    return None


# ----------------------------------------------------------------------------------------------
# Implementations: stage adapters returning only arrays (row_id_map is the shared residual).
# ----------------------------------------------------------------------------------------------


def _dispatch_fwd(mod, **kw):
    def fwd(x, routing_map, probs, *, num_out_tokens, align_size):
        outs, _ = mod.dispatch_forward(
            x, routing_map, probs, num_out_tokens=num_out_tokens, align_size=align_size, **kw
        )
        return outs

    return fwd


def _dispatch_bwd(mod, **kw):
    def bwd(row_id_map, g_out, g_pp, *, num_out_tokens, align_size):
        res = ref.DispatchResiduals(row_id_map, row_id_map.shape[0], g_pp is not None)
        return mod.dispatch_backward(res, g_out, g_pp, num_out_tokens=num_out_tokens, align_size=align_size, **kw)

    return bwd


def _combine_fwd(mod, **kw):
    def fwd(y, row_id_map, merging_probs):
        return mod.combine_forward(y, row_id_map, merging_probs, **kw)[0]

    return fwd


def _combine_bwd(mod, **kw):
    def bwd(row_id_map, g, y, merging_probs, *, num_rows):
        res = ref.CombineResiduals(y, row_id_map, merging_probs, num_rows)
        return mod.combine_backward(res, g, **kw)

    return bwd


def _sort_fwd(mod):
    return lambda x, sizes, idx: mod.sort_forward(x, sizes, idx)[0]


def _sort_bwd(mod):
    return lambda row_id_map, g: mod.sort_backward(ref.SortResiduals(row_id_map), g)


DISPATCH = registry.family("token_dispatch")
COMBINE = registry.family("token_combine")
SORT = registry.family("sort_chunks_by_index")

_triton_available = lambda: tb.unavailable_reason()  # noqa: E731
for _fam, _f, _b in ((DISPATCH, _dispatch_fwd, _dispatch_bwd), (COMBINE, _combine_fwd, _combine_bwd)):
    _fam.register(
        registry.Implementation("triton", _f(tri), _b(tri), tri.unsupported_reason, "cuda", _triton_available)
    )
    _fam.register(
        registry.Implementation(
            "gluon",
            _f(tri, gluon=True),
            _b(tri, gluon=True),
            tri.unsupported_reason,
            "cuda",
            _gluon_available,
        )
    )
    _fam.register(registry.Implementation(registry.REFERENCE, _f(ref), _b(ref)))
SORT.register(
    registry.Implementation("triton", _sort_fwd(tri), _sort_bwd(tri), tri.unsupported_reason, "cuda", _triton_available)
)
SORT.register(registry.Implementation(registry.REFERENCE, _sort_fwd(ref), _sort_bwd(ref)))


def _chosen(implementation: str | None, *sizes: int) -> str | None:
    """The implementation to run: the reference when any size is zero (there is nothing for a
    kernel to do, and every output is defined by the reference), else the requested one."""
    return registry.REFERENCE if min(sizes) == 0 else implementation


def _call(dtype, num_tokens, num_experts, probs_dtype, num_rows) -> dict[str, Any]:
    return dict(dtype=dtype, num_tokens=num_tokens, num_experts=num_experts, probs_dtype=probs_dtype, num_rows=num_rows)


# ----------------------------------------------------------------------------------------------
# token_dispatch
# ----------------------------------------------------------------------------------------------


@functools.cache
def _build_dispatch(
    num_out_tokens: int, align_size: int | None, implementation: str | None, has_probs: bool, num_tokens: int
):
    has_pad = align_size is not None

    def statics_for(t_local):
        return dict(num_out_tokens=S.local_out_tokens(num_out_tokens, t_local, num_tokens), align_size=align_size)

    def fwd_impl(x, rm, *probs):
        p = probs[0] if probs else None
        st = statics_for(x.shape[0])
        t_, h = x.shape
        e_ = rm.shape[1]
        n = ref.out_rows(st["num_out_tokens"], e_, align_size)
        call = _call(x.dtype, t_, e_, None if p is None else p.dtype, n)
        impl = _chosen(implementation, t_, e_, h, n)
        out, pp, row_id_map, pad, tpe, dropped = DISPATCH.dispatch(impl, "forward", (x, rm, p), st, call)
        return (out, *([pp] if has_probs else []), row_id_map, tpe, dropped, *([pad] if has_pad else []))

    def bwd_impl(row_id_map, g_out, *g_pp):
        gp = g_pp[0] if g_pp else None
        t_ = row_id_map.shape[0]
        e_ = (row_id_map.shape[1] - 1) // 2
        n, h = g_out.shape
        call = _call(g_out.dtype, t_, e_, None if gp is None else gp.dtype, n)
        impl = _chosen(implementation, t_, e_, h, n)
        dx, dprobs = DISPATCH.dispatch(impl, "backward", (row_id_map, g_out, gp), statics_for(t_), call)
        return (dx, dprobs) if has_probs else dx

    fwd_call = S.partitioned_dispatch_forward(fwd_impl, has_probs=has_probs, has_pad=has_pad)
    bwd_call = S.partitioned_dispatch_backward(bwd_impl, has_probs=has_probs, has_pad=has_pad)

    def run(x, rm, probs):
        outs = list(fwd_call(x, rm, *([probs] if has_probs else [])))
        out = outs.pop(0)
        pp = outs.pop(0) if has_probs else None
        row_id_map, tpe, dropped = outs[:3]
        pad = outs[3] if has_pad else None
        return TokenDispatchResult(out, pp, row_id_map, pad, tpe, dropped)

    @jax.custom_vjp
    def op(x, rm, probs):
        return run(x, rm, probs)

    def op_fwd(x, rm, probs):
        res = run(x, rm, probs)
        return res, res.row_id_map

    def op_bwd(row_id_map, cts):
        if has_probs:
            dx, dprobs = bwd_call(row_id_map, cts.out, cts.permuted_probs)
            return dx, None, dprobs
        return bwd_call(row_id_map, cts.out), None, None

    op.defvjp(op_fwd, op_bwd)
    return op


def token_dispatch(
    x: jax.Array,
    routing_map: jax.Array,
    num_out_tokens: int,
    *,
    probs: jax.Array | None = None,
    align_size: int | None = None,
    implementation: str | None = None,
) -> TokenDispatchResult:
    """Permutes token rows into expert-major order (MoE dispatch), with a fixed capacity.

    Every routed (token, expert) pair gets a row: all tokens routed to expert 0 in ascending token
    order, then expert 1, ...; with ``align_size`` A each expert's block is padded with zero rows
    to a multiple of A. The buffer has a fixed number of rows N (``num_out_tokens``, or
    ``((num_out_tokens + E * (A - 1)) // A) * A`` with A). Pairs whose row would be ``>= N`` are
    DROPPED: with more routed pairs than rows, these are the last pairs of the expert-major order
    (the highest-numbered tokens of the last non-empty experts). A dropped pair has no row, is not
    counted in ``tokens_per_expert``, contributes nothing to :func:`token_combine` and gets zero
    gradient (for x and for probs); ``num_dropped`` counts them. Dropping neither raises nor warns,
    also for concrete inputs (capacity-limited MoE drops on purpose): check ``num_dropped``.

    ``tokens_per_expert[e]`` is the number of rows of expert e's block in ``out`` (kept pairs, plus
    the block's padding with A, cut at N), so the blocks tile rows ``[0, sum(tokens_per_expert))``,
    ``sum(tokens_per_expert) <= N``, and a grouped GEMM over ``tokens_per_expert`` sees exactly the
    kept rows. Every row that holds no kept pair (padding, the unused tail) is zero, also in
    ``permuted_probs``. ``pad_offsets[e]`` (with A) is the number of padding rows before expert e's
    block. Exact formulas and the row_id_map layout: ``te_ops/permutation/reference.py``.

    Edge cases: T = 0, E = 0, H = 0 or N = 0 are allowed (zero-filled outputs of the stated shapes;
    with N = 0 every routed pair is dropped). Under token sharding (see ``sharding.py``) each shard
    has its own buffer of ``num_out_tokens / shards`` rows; ``tokens_per_expert`` and
    ``num_dropped`` are summed over the shards (with ``align_size`` the tokens are gathered and the
    capacity is global). Inside ``shard_map`` the op sees only the local tokens, so every output,
    the counts included, is per shard. In row_id_map a dropped pair is marked -2 (an unrouted one
    -1) after the token's kept rows.

    Equivalent to (without align_size)::

        t_idx, e_idx = jnp.nonzero(routing_map.T)[::-1]           # expert-major, tokens ascending
        keep = jnp.arange(len(t_idx)) < num_out_tokens               # the tail does not fit
        out = jnp.zeros((num_out_tokens, H), x.dtype).at[:keep.sum()].set(x[t_idx[keep]])
        permuted_probs = jnp.zeros((num_out_tokens,), probs.dtype).at[:keep.sum()].set(
            probs[t_idx[keep], e_idx[keep]])
        tokens_per_expert = jnp.bincount(e_idx[keep], length=E)
        num_dropped = len(t_idx) - keep.sum()

    Args:
      x: ``[T, H]`` float rows (float32, bfloat16, float16; float64 on the reference path).
      routing_map: ``[T, E]`` bool, True where a token is routed to an expert (any number per token).
      num_out_tokens: static int >= 0, the capacity; normally ``T * topk`` (nothing dropped).
      probs: optional ``[T, E]`` float routing probabilities, permuted alongside x.
      align_size: optional static int A >= 1: pad each expert block to a multiple of A.
      implementation: None (best available), "triton", "gluon" or "reference".

    Returns:
      A :class:`TokenDispatchResult` ``(out[N, H], permuted_probs[N] or None, row_id_map int32[T, 2E+1],
      pad_offsets int32[E] or None, tokens_per_expert int32[E], num_dropped int32[])``.

    Raises:
      TypeError: an argument has the wrong type or dtype (the message names it).
      ValueError: an argument has the wrong shape or a static argument is out of range (the message
        names it). Values (that probs is zero where routing_map is False, for instance) are not
        checked.
    """
    op = "token_dispatch"
    x = check_float(op, "x", x, FLOAT_DTYPES_WITH_F64, rank=2, layout="[T, H]")
    routing_map = check_bool(op, "routing_map", routing_map, hint="Convert it, e.g. routing_map = (routing_map != 0).")
    check_rank(op, "routing_map", routing_map, 2, "[T, E]")
    if routing_map.shape[0] != x.shape[0]:
        raise ValueError(
            err(
                op,
                f"routing_map must have shape [T, E] with T = x.shape[0] = {x.shape[0]}, got "
                f"{tuple(routing_map.shape)}.",
            )
        )
    why = "It sets the output shape, so it cannot be a traced value; pass e.g. num_out_tokens=T * topk."
    num_out_tokens = static_int(op, "num_out_tokens", num_out_tokens, minimum=0, why=why)
    align_size = static_int(op, "align_size", align_size, minimum=1, allow_none=True, why="It sets the output shape.")
    if probs is not None:
        probs = _check_probs(op, "probs", probs, routing_map.shape)
    return _build_dispatch(num_out_tokens, align_size, implementation, probs is not None, x.shape[0])(
        *match_vma(x, routing_map, probs)
    )


def _check_probs(op: str, name: str, p: Any, shape: tuple[int, int]) -> jax.Array:
    p = check_float(op, name, p, FLOAT_DTYPES_WITH_F64, rank=2, layout="[T, E]")
    if tuple(p.shape) != tuple(shape):
        raise ValueError(
            err(op, f"{name} must have shape {tuple(shape)} [T, E] like the routing, got {tuple(p.shape)}.")
        )
    return p


# ----------------------------------------------------------------------------------------------
# token_combine
# ----------------------------------------------------------------------------------------------


@functools.cache
def _build_combine(implementation: str | None, has_probs: bool, num_rows: int, num_tokens: int):
    def fwd_impl(y, row_id_map, *mp):
        m = mp[0] if mp else None
        t_ = row_id_map.shape[0]
        e_ = (row_id_map.shape[1] - 1) // 2
        n, h = y.shape
        call = _call(y.dtype, t_, e_, None if m is None else m.dtype, n)
        impl = _chosen(implementation, t_, e_, h, n)
        return COMBINE.dispatch(impl, "forward", (y, row_id_map, m), {}, call)

    def bwd_impl(row_id_map, g, *ymp):
        y, m = (ymp[0], ymp[1]) if ymp else (None, None)
        t_ = row_id_map.shape[0]
        e_ = (row_id_map.shape[1] - 1) // 2
        # rows of y in this shard: N scaled like the tokens
        n = num_rows * t_ // max(num_tokens, 1) if t_ != num_tokens else num_rows
        call = _call(g.dtype, t_, e_, None if m is None else m.dtype, n)
        impl = _chosen(implementation, t_, e_, g.shape[1], n)
        dy, dmp = COMBINE.dispatch(impl, "backward", (row_id_map, g, y, m), dict(num_rows=n), call)
        return (dy, dmp) if has_probs else dy

    fwd_call = S.partitioned_combine_forward(fwd_impl, has_probs=has_probs)
    bwd_call = S.partitioned_combine_backward(bwd_impl, has_probs=has_probs)

    @jax.custom_vjp
    def op(y, row_id_map, mp):
        return fwd_call(y, row_id_map, *([mp] if has_probs else []))

    def op_fwd(y, row_id_map, mp):
        out = fwd_call(y, row_id_map, *([mp] if has_probs else []))
        return out, ((row_id_map, y, mp) if has_probs else (row_id_map,))

    def op_bwd(res, g):
        if has_probs:
            row_id_map, y, mp = res
            dy, dmp = bwd_call(row_id_map, g, y, mp)
            return dy, None, dmp
        return bwd_call(res[0], g), None, None

    op.defvjp(op_fwd, op_bwd)
    return op


def token_combine(
    y: jax.Array,
    row_id_map: jax.Array,
    *,
    merging_probs: jax.Array | None = None,
    pad_offsets: jax.Array | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """Inverse of :func:`token_dispatch`: sums each token's kept expert rows, weighted by merging_probs.

    ``out[t]`` is the sum over token t's KEPT pairs (t, e) of ``y[row(t, e)] * merging_probs[t, e]``
    (a plain sum without merging_probs), accumulated in float32 and returned in y's dtype. Pairs
    that token_dispatch dropped contribute nothing; a token with no kept pair gets a zero row.
    Rows of y that hold no kept pair (padding, the unused tail) are never read.

    Backward: ``dy[row(t, e)] = g[t] * merging_probs[t, e]`` and zero on every other row;
    ``d merging_probs[t, e] = <y[row(t, e)], g[t]>`` (float32) for kept pairs and zero elsewhere
    (unrouted and dropped pairs). No gradient for row_id_map or pad_offsets.

    Equivalent to::

        out = zeros((T, H), f32)
        for t, k < row_id_map[t, 2E]:   row, e = row_id_map[t, k], row_id_map[t, E + k]
            out[t] += y[row].astype(f32) * merging_probs[t, e]
        out = out.astype(y.dtype)

    Trace-time checks: shapes, dtypes and that merging_probs / pad_offsets agree with row_id_map's
    T and E. Not checked (values): that row_id_map came from token_dispatch, and that it was made
    for a buffer of exactly ``y.shape[0]`` rows (rows at or past ``y.shape[0]`` are not read).
    T = 0, E = 0, H = 0 and N = 0 are allowed (zero-filled ``[T, H]``).

    Args:
      y: ``[N, H]`` float rows in token_dispatch's row order (the dispatch ``out`` shape).
      row_id_map: the int32 ``[T, 2E+1]`` map returned by token_dispatch.
      merging_probs: optional ``[T, E]`` float weights (plain sum without them).
      pad_offsets: optional int32 ``[E]``, accepted for TransformerEngine compatibility;
        row_id_map already holds padded rows, so it does not change the result.
      implementation: None (best available), "triton", "gluon" or "reference".

    Returns:
      ``[T, H]`` in y's dtype.
    """
    op = "token_combine"
    y = check_float(op, "y", y, FLOAT_DTYPES_WITH_F64, rank=2, layout="[N, H]")
    row_id_map = check_int_array(op, "row_id_map", row_id_map, dtype=jnp.int32)
    if row_id_map.ndim != 2 or row_id_map.shape[1] % 2 != 1:
        raise ValueError(
            err(
                op,
                f"row_id_map must be the int32 [T, 2E+1] map returned by token_dispatch (an odd "
                f"number of columns), got shape {tuple(row_id_map.shape)}.",
            )
        )
    t_, e_ = row_id_map.shape[0], (row_id_map.shape[1] - 1) // 2
    if merging_probs is not None:
        merging_probs = _check_probs(op, "merging_probs", merging_probs, (t_, e_))
    if pad_offsets is not None:
        check_int_array(op, "pad_offsets", pad_offsets, shape=(e_,), dtype=jnp.int32)
    return _build_combine(implementation, merging_probs is not None, y.shape[0], t_)(
        *match_vma(y, row_id_map, merging_probs)
    )


# ----------------------------------------------------------------------------------------------
# sort_chunks_by_index
# ----------------------------------------------------------------------------------------------


@functools.cache
def _build_sort(implementation: str | None):
    def fwd_impl(x, sizes, idx):
        impl = _chosen(implementation, *x.shape, idx.shape[0])
        return SORT.dispatch(impl, "forward", (x, sizes, idx), {}, dict(dtype=x.dtype, num_rows=x.shape[0]))

    def bwd_impl(row_id_map, g):
        impl = _chosen(implementation, *g.shape)
        return SORT.dispatch(impl, "backward", (row_id_map, g), {}, dict(dtype=g.dtype, num_rows=g.shape[0]))

    fwd_call = S.partitioned_sort_forward(fwd_impl)
    bwd_call = S.partitioned_sort_backward(bwd_impl)

    @jax.custom_vjp
    def op(x, sizes, idx):
        return fwd_call(x, sizes, idx)

    def op_fwd(x, sizes, idx):
        out, row_id_map = fwd_call(x, sizes, idx)
        return (out, row_id_map), row_id_map

    def op_bwd(row_id_map, cts):
        return bwd_call(row_id_map, cts[0]), None, None

    op.defvjp(op_fwd, op_bwd)
    return op


def sort_chunks_by_index(
    x: jax.Array, split_sizes: jax.Array, sorted_indices: jax.Array, *, implementation: str | None = None
) -> tuple[jax.Array, jax.Array]:
    """Reorders S consecutive chunks of rows (sizes ``split_sizes``) into the order ``sorted_indices``.

    Chunk i is rows ``[sum(split_sizes[:i]), sum(split_sizes[:i + 1]))`` of x; the output
    concatenates chunks ``sorted_indices[0], sorted_indices[1], ...`` and then the rows past
    ``sum(split_sizes)``, which stay where they are. Backward: the gradient goes back through the
    same permutation (``dx[i] = g[row_id_map[i]]``).

    Trace-time checks: x is ``[N, H]`` float, split_sizes and sorted_indices are 1-D integer arrays
    of the same length S. Not checked (values): that sorted_indices is a permutation of
    ``range(S)`` (a repeated index duplicates a chunk and the result is no longer a permutation);
    split_sizes are used as given with negative sizes counted as 0 and chunks cut at N rows (so
    ``sum(split_sizes) > N`` moves only the rows that exist). N = 0, H = 0 and S = 0 are allowed
    (S = 0: out = x).

    Equivalent to::

        chunks = jnp.split(x[:total], np.cumsum(split_sizes)[:-1])
        out = jnp.concatenate([chunks[i] for i in sorted_indices] + [x[total:]])

    Args:
      x: ``[N, H]`` float rows.
      split_sizes: ``[S]`` integer chunk sizes (on the device; cast to int32).
      sorted_indices: ``[S]`` integer, the order of the chunks in the output.
      implementation: None (best available), "triton" or "reference".

    Returns:
      ``(out[N, H], row_id_map int32[N])`` with ``out[row_id_map[i]] = x[i]``.
    """
    op = "sort_chunks_by_index"
    x = check_float(op, "x", x, FLOAT_DTYPES_WITH_F64, rank=2, layout="[N, H]")
    split_sizes = check_int_array(op, "split_sizes", split_sizes)
    check_rank(op, "split_sizes", split_sizes, 1, "[S]")
    sorted_indices = check_int_array(op, "sorted_indices", sorted_indices, shape=split_sizes.shape)
    return _build_sort(implementation)(*match_vma(x, split_sizes.astype(jnp.int32), sorted_indices.astype(jnp.int32)))
