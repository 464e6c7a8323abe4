"""Triton (and Gluon) implementations of the permutation ops, launched through our Triton bridge.

Same signatures and residual layouts as ``reference.py``. ``gluon=True`` swaps the two hot
data-movement kernels (dispatch scatter, combine gather) for their Gluon versions; the small
routing kernels and the backward kernels are the Triton ones in both cases.

Kernel sequence (every output row written exactly once, so nothing is left undefined):

* dispatch fwd: count (per token block, per expert) -> scan (expert starts with padding, per block
  bases, and the capacity counts: tokens_per_expert, pad_offsets, num_dropped) -> rowmap
  (row_id_map with dropped pairs marked, permuted_probs, inverse map inv[row]) -> zero_holes
  (padding/tail rows of out and permuted_probs) -> dispatch (scatter x rows).
  Pairs whose row is >= N are dropped in rowmap (reference.py: the capacity layout); every later
  kernel reads only the first n_t entries of a row_id_map row, so dropped pairs take no part in
  the data movement or the backward kernels.
* dispatch bwd: one kernel per token: dx = sum of its rows (fp32), dprobs.
* combine fwd: one kernel per token (fp32 accumulation).
* combine bwd: inv -> zero_holes (rows no token uses) -> per token: dy rows and d merging_probs.
* sort_chunks fwd: chunk_src (source row of each output row, row_id_map) -> row gather; bwd: gather.

The launchers assume non-empty sizes (T, E, H, N > 0); api.py sends empty calls to the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_ops._core import triton_bridge as tb
from te_ops.permutation import reference as ref

SDS = jax.ShapeDtypeStruct
I32 = jnp.int32
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_EXPERTS = 4096


def _k():
    from te_ops.permutation import triton_kernels

    return triton_kernels


def _gk():
    from te_ops.permutation import gluon_kernels

    return gluon_kernels


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def _h_config(h: int, itemsize: int) -> tuple[int, int, int]:
    """(BLOCK_H, VEC, num_warps) for moving rows of h elements: 16-byte vectors, up to 4 warps."""
    block_h = max(32, min(128 * (16 // itemsize), _pow2(h)))
    vec = max(1, min(16 // itemsize, block_h // 32))
    warps = max(1, min(4, block_h // (32 * vec)))
    return block_h, vec, warps


def _div16(h: int) -> tuple[str, ...]:
    """Promise H % 16 == 0 to the compiler when it holds: row offsets row * H are then 32-byte
    aligned and loads/stores become 16-byte vectors (without it Triton emits 2-byte accesses)."""
    return ("H",) if h % 16 == 0 else ()


def _tile_t(e: int) -> tuple[int, int]:
    block_e = _pow2(max(e, 1))
    return max(1, min(64, 4096 // block_e)), block_e


def unsupported_reason(
    *, dtype=None, num_tokens=None, num_experts=None, probs_dtype=None, num_rows=None, **_
) -> str | None:
    if dtype is not None and jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        got = jnp.dtype(dtype)
        return f"the Triton permutation kernels support float32, bfloat16 and float16 rows, got {got}"
    if probs_dtype is not None and jnp.dtype(probs_dtype) not in SUPPORTED_DTYPES:
        got = jnp.dtype(probs_dtype)
        return f"probabilities must be float32, bfloat16 or float16 for the Triton kernels, got {got}"
    if num_experts is not None and num_experts > MAX_EXPERTS:
        return f"the Triton permutation kernels support up to {MAX_EXPERTS} experts, got {num_experts}"
    if num_tokens is not None and num_experts is not None and num_tokens * max(num_experts, 1) >= 2**31 - 1:
        return f"T * E must stay below 2**31 (int32 maps), got T={num_tokens}, E={num_experts}"
    if num_rows is not None and num_rows >= 2**31 - 1:
        return f"the number of output rows must stay below 2**31, got {num_rows}"
    return None


# ----------------------------------------------------------------------------------------------
# token_dispatch
# ----------------------------------------------------------------------------------------------


def _routing(routing_map, probs, num_out_tokens, align_size):
    k = _k()
    t_, e_ = routing_map.shape
    n = ref.out_rows(num_out_tokens, e_, align_size)
    block_t, block_e = _tile_t(e_)
    nb = _cdiv(t_, block_t)
    counts, totals = tb.triton_call(
        k.count_kernel,
        routing_map,
        np.int32(t_),
        np.int32(e_),
        out_shape=[SDS((nb, e_), I32), SDS((e_,), I32)],
        grid=(nb,),
        zeroed_outputs=(1,),
        constexprs=dict(BLOCK_T=block_t, BLOCK_E=block_e),
    )
    # expert tiles of BE experts scan the block counts in parallel (BLOCK_B blocks per step)
    be = min(block_e, 32)
    chunk_e = min(block_e, 256)
    block_b = max(1, min(256, 8192 // be))
    base, tpe, pad, dropped = tb.triton_call(
        k.scan_kernel,
        counts,
        totals,
        np.int32(nb),
        np.int32(e_),
        np.int32(align_size or 1),
        np.int32(n),
        out_shape=[SDS((nb, e_), I32), SDS((e_,), I32), SDS((e_,), I32), SDS((1,), I32)],
        grid=(_cdiv(e_, be),),
        constexprs=dict(BLOCK_B=block_b, BE=be, CHUNK_E=chunk_e, BLOCK_E=block_e),
        num_warps=8,
    )
    pp_shape = SDS((n,), probs.dtype) if probs is not None else SDS((1,), jnp.float32)
    row_id_map, inv, pp = tb.triton_call(
        k.rowmap_kernel,
        routing_map,
        probs if probs is not None else counts,
        base,
        np.int32(t_),
        np.int32(e_),
        np.int32(n),
        out_shape=[SDS((t_, 2 * e_ + 1), I32), SDS((n,), I32), pp_shape],
        grid=(nb,),
        zeroed_outputs=(1,),
        constexprs=dict(BLOCK_T=block_t, BLOCK_E=block_e, HAS_PROBS=probs is not None),
    )
    return row_id_map, inv, (pp if probs is not None else None), tpe, pad, dropped.reshape(()), n


def _zero_holes(inv, pp, n, h, dtype):
    block_h, _, warps = _h_config(h, jnp.dtype(dtype).itemsize)
    rows = max(1, min(32, 4096 // block_h))
    if pp is not None:
        out, pp = tb.triton_call(
            _k().zero_holes_kernel,
            inv,
            pp,
            np.int32(n),
            np.int32(h),
            out_shape=[SDS((n, h), dtype), SDS(pp.shape, pp.dtype)],
            input_output_aliases={1: 1},
            grid=(_cdiv(n, rows),),
            constexprs=dict(ROWS=rows, BLOCK_H=block_h, HAS_PROBS=True),
            num_warps=warps,
            divisible_by_16=_div16(h),
        )
        return out, pp
    out = tb.triton_call(
        _k().zero_holes_kernel,
        inv,
        inv,
        np.int32(n),
        np.int32(h),
        out_shape=[SDS((n, h), dtype)],
        grid=(_cdiv(n, rows),),
        constexprs=dict(ROWS=rows, BLOCK_H=block_h, HAS_PROBS=False),
        num_warps=warps,
        divisible_by_16=_div16(h),
    )[0]
    return out, None


def _move_rows(x, row_id_map, out0, gluon: bool):
    t_, h = x.shape
    e_ = (row_id_map.shape[1] - 1) // 2
    block_h, vec, warps = _h_config(h, x.dtype.itemsize)
    if gluon:
        tokens = 1 if h >= 1024 else 4
        return tb.triton_call(
            _gk().dispatch_kernel,
            x,
            row_id_map,
            out0,
            np.int32(t_),
            np.int32(e_),
            np.int32(h),
            out_shape=[SDS(out0.shape, out0.dtype)],
            input_output_aliases={2: 0},
            grid=(_cdiv(t_, tokens),),
            constexprs=dict(BLOCK_H=block_h, VEC=vec, TOKENS=tokens, NUM_WARPS=warps),
            num_warps=warps,
            divisible_by_16=_div16(h),
        )[0]
    return tb.triton_call(
        _k().dispatch_kernel,
        x,
        row_id_map,
        out0,
        np.int32(e_),
        np.int32(h),
        out_shape=[SDS(out0.shape, out0.dtype)],
        input_output_aliases={2: 0},
        grid=(t_,),
        constexprs=dict(BLOCK_H=block_h),
        num_warps=warps,
        divisible_by_16=_div16(h),
    )[0]


def dispatch_forward(x, routing_map, probs=None, *, num_out_tokens: int, align_size: int | None, gluon: bool = False):
    row_id_map, inv, pp, tpe, pad, dropped, n = _routing(routing_map, probs, num_out_tokens, align_size)
    out0, pp = _zero_holes(inv, pp, n, x.shape[1], x.dtype)
    out = _move_rows(x, row_id_map, out0, gluon)
    res = ref.DispatchResiduals(row_id_map, x.shape[0], probs is not None)
    return (out, pp, row_id_map, pad if align_size else None, tpe, dropped), res


def dispatch_backward(res, g_out, g_pp=None, *, num_out_tokens: int, align_size: int | None, gluon: bool = False):
    del num_out_tokens, align_size, gluon
    t_ = res.num_tokens
    e_ = (res.row_id_map.shape[1] - 1) // 2
    h = g_out.shape[1]
    block_h, _, warps = _h_config(h, g_out.dtype.itemsize)
    if res.has_probs and g_pp is not None:
        dx, dprobs = tb.triton_call(
            _k().dispatch_bwd_kernel,
            g_out,
            res.row_id_map,
            g_pp,
            np.int32(e_),
            np.int32(h),
            out_shape=[SDS((t_, h), g_out.dtype), SDS((t_, e_), g_pp.dtype)],
            grid=(t_,),
            constexprs=dict(BLOCK_H=block_h, BLOCK_E=_pow2(e_)),
            num_warps=warps,
            divisible_by_16=_div16(h),
        )
        return dx, dprobs
    dx = _combine(g_out, res.row_id_map, None, False)
    return dx, None


# ----------------------------------------------------------------------------------------------
# token_combine
# ----------------------------------------------------------------------------------------------


def _combine(y, row_id_map, merging_probs, gluon: bool):
    t_ = row_id_map.shape[0]
    e_ = (row_id_map.shape[1] - 1) // 2
    h = y.shape[1]
    block_h, vec, warps = _h_config(h, y.dtype.itemsize)
    mp = merging_probs if merging_probs is not None else row_id_map
    if gluon:
        tokens = 1 if h >= 1024 else 4
        return tb.triton_call(
            _gk().combine_kernel,
            y,
            row_id_map,
            mp,
            np.int32(t_),
            np.int32(e_),
            np.int32(h),
            out_shape=[SDS((t_, h), y.dtype)],
            grid=(_cdiv(t_, tokens),),
            num_warps=warps,
            constexprs=dict(
                BLOCK_H=block_h, VEC=vec, TOKENS=tokens, NUM_WARPS=warps, HAS_PROBS=merging_probs is not None
            ),
            divisible_by_16=_div16(h),
        )[0]
    return tb.triton_call(
        _k().combine_kernel,
        y,
        row_id_map,
        mp,
        np.int32(e_),
        np.int32(h),
        out_shape=[SDS((t_, h), y.dtype)],
        grid=(t_,),
        constexprs=dict(BLOCK_H=block_h, HAS_PROBS=merging_probs is not None),
        num_warps=warps,
        divisible_by_16=_div16(h),
    )[0]


def combine_forward(y, row_id_map, merging_probs=None, *, gluon: bool = False):
    out = _combine(y, row_id_map, merging_probs, gluon)
    res = ref.CombineResiduals(y if merging_probs is not None else None, row_id_map, merging_probs, y.shape[0])
    return out, res


def combine_backward(res, g, *, gluon: bool = False):
    del gluon
    k = _k()
    row_id_map = res.row_id_map
    t_ = row_id_map.shape[0]
    e_ = (row_id_map.shape[1] - 1) // 2
    n, h = res.num_rows, g.shape[1]
    block_t, block_e = _tile_t(e_)
    inv = tb.triton_call(
        k.inv_kernel,
        row_id_map,
        np.int32(t_),
        np.int32(e_),
        out_shape=[SDS((n,), I32)],
        grid=(_cdiv(t_, block_t),),
        zeroed_outputs=(0,),
        constexprs=dict(BLOCK_T=block_t, BLOCK_E=block_e),
    )[0]
    dy0, _ = _zero_holes(inv, None, n, h, g.dtype)
    block_h, _, warps = _h_config(h, g.dtype.itemsize)
    if res.merging_probs is not None:
        dy, dmp = tb.triton_call(
            k.combine_bwd_kernel,
            g,
            res.y,
            row_id_map,
            res.merging_probs,
            dy0,
            np.int32(e_),
            np.int32(h),
            out_shape=[SDS((n, h), g.dtype), SDS(res.merging_probs.shape, res.merging_probs.dtype)],
            input_output_aliases={4: 0},
            grid=(t_,),
            constexprs=dict(BLOCK_H=block_h, BLOCK_E=block_e),
            num_warps=warps,
            divisible_by_16=_div16(h),
        )
        return dy, dmp
    dy = tb.triton_call(
        k.combine_bwd_noprobs_kernel,
        g,
        row_id_map,
        dy0,
        np.int32(e_),
        np.int32(h),
        out_shape=[SDS((n, h), g.dtype)],
        input_output_aliases={2: 0},
        grid=(t_,),
        constexprs=dict(BLOCK_H=block_h, BLOCK_E=block_e),
        num_warps=warps,
        divisible_by_16=_div16(h),
    )[0]
    return dy, None


# ----------------------------------------------------------------------------------------------
# sort_chunks_by_index
# ----------------------------------------------------------------------------------------------


def _gather(x, idx):
    n, h = x.shape
    block_h, _, warps = _h_config(h, x.dtype.itemsize)
    rows = max(1, min(16, 4096 // block_h))
    return tb.triton_call(
        _k().row_gather_kernel,
        x,
        idx,
        np.int32(n),
        np.int32(h),
        out_shape=[SDS(x.shape, x.dtype)],
        grid=(_cdiv(n, rows),),
        constexprs=dict(ROWS=rows, BLOCK_H=block_h),
        num_warps=warps,
        divisible_by_16=_div16(h),
    )[0]


def sort_forward(x, split_sizes, sorted_indices):
    n = x.shape[0]
    s = sorted_indices.shape[0]
    src_start, dst_start, dst_end = ref.chunk_layout(split_sizes, sorted_indices, n)
    block_s = _pow2(max(s, 1))
    rows = max(1, min(64, 4096 // block_s))
    src, row_id_map = tb.triton_call(
        _k().chunk_src_kernel,
        src_start,
        dst_start,
        dst_end,
        np.int32(s),
        np.int32(n),
        out_shape=[SDS((n,), I32), SDS((n,), I32)],
        grid=(_cdiv(n, rows),),
        constexprs=dict(ROWS=rows, BLOCK_S=block_s),
    )
    return (_gather(x, src), row_id_map), ref.SortResiduals(row_id_map)


def sort_backward(res, g):
    return _gather(g, res.row_id_map)
