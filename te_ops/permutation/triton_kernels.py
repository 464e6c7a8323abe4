"""Triton kernels of the permutation ops. Imported only when a Triton implementation runs (this module
imports triton at module scope; ``te_ops`` itself never imports it).

All sizes (T, E, H, N, S, align) are runtime scalars; only block sizes and feature flags are
constexprs, so a new token count does not recompile. Row offsets are computed in int64.
The row_id_map layout is documented in ``reference.py``.
"""

import triton
import triton.language as tl

# ----------------------------------------------------------------------------------------------
# token_dispatch: routing layout
# ----------------------------------------------------------------------------------------------


@triton.jit
def count_kernel(rm_ptr, T, E, counts_ptr, tot_ptr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[b, e] = number of tokens of block b routed to expert e; tot[e] += counts[b, e]
    (tot is zeroed by the launcher)."""
    b = tl.program_id(0)
    t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    m = (t[:, None] < T) & (e[None, :] < E)
    r = tl.load(rm_ptr + t[:, None].to(tl.int64) * E + e[None, :], mask=m, other=0)
    c = tl.sum((r != 0).to(tl.int32), axis=0)
    tl.store(counts_ptr + b * E + e, c, mask=e < E)
    tl.atomic_add(tot_ptr + e, c, mask=(e < E) & (c > 0))


@triton.jit
def scan_kernel(
    counts_ptr,
    tot_ptr,
    nb,
    E,
    A,
    N,
    base_ptr,
    tpe_ptr,
    pad_ptr,
    drop_ptr,
    BLOCK_B: tl.constexpr,
    BE: tl.constexpr,
    CHUNK_E: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Program p owns experts [p * BE, (p + 1) * BE): their start rows (sum of the padded totals of
    the experts before them) and the per-block bases base[b, e] = start[e] + sum_{b' < b}
    counts[b', e]. Program 0 also writes the capacity counts of reference.capacity_counts for a
    buffer of N rows: tokens_per_expert (kept, padded), pad_offsets and num_dropped."""
    p = tl.program_id(0)
    e = p * BE + tl.arange(0, BE)
    em = e < E
    start = tl.zeros([BE], tl.int32)
    for c0 in range(0, E, CHUNK_E):
        ec = c0 + tl.arange(0, CHUNK_E)
        tot_c = tl.load(tot_ptr + ec, mask=ec < E, other=0)
        padded_c = (tot_c + A - 1) // A * A
        start += tl.sum(tl.where(ec[None, :] < e[:, None], padded_c[None, :], 0), axis=1)
    if p == 0:
        ea = tl.arange(0, BLOCK_E)
        tot = tl.load(tot_ptr + ea, mask=ea < E, other=0)
        padded = (tot + A - 1) // A * A
        room = tl.maximum(N - (tl.cumsum(padded, axis=0) - padded), 0)  # rows left at each block's start
        tpe = tl.minimum(padded, room)
        kept = tl.minimum(tot, room)
        holes = tpe - kept
        tl.store(tpe_ptr + ea, tpe, mask=ea < E)
        tl.store(pad_ptr + ea, tl.cumsum(holes, axis=0) - holes, mask=ea < E)
        tl.store(drop_ptr, tl.sum(tot - kept, axis=0))
    bb = tl.arange(0, BLOCK_B)
    run = start
    for b0 in range(0, nb, BLOCK_B):
        m = ((b0 + bb)[:, None] < nb) & em[None, :]
        c = tl.load(counts_ptr + (b0 + bb)[:, None] * E + e[None, :], mask=m, other=0)
        base = run[None, :] + tl.cumsum(c, axis=0) - c
        tl.store(base_ptr + (b0 + bb)[:, None] * E + e[None, :], base, mask=m)
        run += tl.sum(c, axis=0)


@triton.jit
def rowmap_kernel(
    rm_ptr,
    probs_ptr,
    base_ptr,
    T,
    E,
    N,
    map_ptr,
    inv_ptr,
    pp_ptr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    """row_id_map rows of a block of tokens, the inverse map inv[row] = t * E + e + 1 (0 = hole;
    the buffer is zeroed by the launcher) and permuted_probs at the kept rows. A pair is kept when
    its row is < N; a dropped pair is marked -2 in row_id_map, an unrouted one -1."""
    b = tl.program_id(0)
    t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    tm = t < T
    em = e < E
    m = tm[:, None] & em[None, :]
    t64 = t.to(tl.int64)
    r = (tl.load(rm_ptr + t64[:, None] * E + e[None, :], mask=m, other=0) != 0).to(tl.int32)
    rank = tl.cumsum(r, axis=0) - r
    base = tl.load(base_ptr + b * E + e, mask=em, other=0)
    dest = base[None, :] + rank
    valid = (r != 0) & (dest < N) & m
    v = valid.to(tl.int32)
    k = tl.cumsum(v, axis=1) - v
    n = tl.sum(v, axis=1)
    pos = tl.where(valid, k, n[:, None] + e[None, :] - k)
    W = 2 * E + 1
    row_base = map_ptr + t64[:, None] * W
    tl.store(row_base + pos, tl.where(valid, dest, tl.where(r != 0, -2, -1)), mask=m)
    tl.store(row_base + E + pos, e[None, :] + tl.zeros_like(pos), mask=m)
    tl.store(map_ptr + t64 * W + 2 * E, n, mask=tm)
    dest64 = dest.to(tl.int64)
    tl.store(inv_ptr + dest64, (t[:, None] * E + e[None, :] + 1), mask=valid)
    if HAS_PROBS:
        p = tl.load(probs_ptr + t64[:, None] * E + e[None, :], mask=valid, other=0)
        tl.store(pp_ptr + dest64, p, mask=valid)


@triton.jit
def inv_kernel(map_ptr, T, E, inv_ptr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """inv[row] = t * E + e + 1 for every routed (t, e) of row_id_map (buffer zeroed by the launcher)."""
    b = tl.program_id(0)
    t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.arange(0, BLOCK_E)
    W = 2 * E + 1
    t64 = t.to(tl.int64)
    tm = t < T
    n = tl.load(map_ptr + t64 * W + 2 * E, mask=tm, other=0)
    m = tm[:, None] & (k[None, :] < n[:, None])
    rows = tl.load(map_ptr + t64[:, None] * W + k[None, :], mask=m, other=0)
    es = tl.load(map_ptr + t64[:, None] * W + E + k[None, :], mask=m, other=0)
    tl.store(inv_ptr + rows.to(tl.int64), t[:, None] * E + es + 1, mask=m & (rows >= 0))


@triton.jit
def zero_holes_kernel(
    inv_ptr, pp_ptr, N, H, out_ptr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, HAS_PROBS: tl.constexpr
):
    """Zeroes the rows no token is routed to (inv == 0): padding and tail rows. ``pp_ptr`` is an
    input aliased to its output (permuted_probs), only touched with HAS_PROBS."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = r < N
    hole = (tl.load(inv_ptr + r, mask=rm, other=1) == 0) & rm
    if HAS_PROBS:
        tl.store(pp_ptr + r, tl.zeros([ROWS], pp_ptr.dtype.element_ty), mask=hole)
    if tl.sum(hole.to(tl.int32), axis=0) > 0:
        r64 = r.to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            tl.store(
                out_ptr + r64[:, None] * H + hh[None, :],
                tl.zeros([ROWS, BLOCK_H], out_ptr.dtype.element_ty),
                mask=hole[:, None] & (hh < H)[None, :],
            )


# ----------------------------------------------------------------------------------------------
# Data movement
# ----------------------------------------------------------------------------------------------


@triton.jit
def dispatch_kernel(x_ptr, map_ptr, out_ptr, E, H, BLOCK_H: tl.constexpr):
    """out[row] = x[t] for every routed row of token t (``out_ptr`` is an input aliased to the
    output; its hole rows were zeroed before)."""
    t = tl.program_id(0).to(tl.int64)
    W = 2 * E + 1
    n = tl.load(map_ptr + t * W + 2 * E)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        hm = hh < H
        v = tl.load(x_ptr + t * H + hh, mask=hm)
        for k in range(n):
            row = tl.load(map_ptr + t * W + k).to(tl.int64)
            tl.store(out_ptr + row * H + hh, v, mask=hm)


@triton.jit
def _combine_token(t, y_ptr, map_ptr, mp_ptr, out_ptr, E, H, BLOCK_H: tl.constexpr, HAS_PROBS: tl.constexpr):
    W = 2 * E + 1
    n = tl.load(map_ptr + t * W + 2 * E)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        hm = hh < H
        acc = tl.zeros([BLOCK_H], tl.float32)
        # two rows per step: two independent row loads in flight per warp (memory-level parallelism)
        for k in range(0, n, 2):
            has1 = k + 1 < n
            row0 = tl.load(map_ptr + t * W + k).to(tl.int64)
            row1 = tl.load(map_ptr + t * W + k + 1, mask=has1, other=0).to(tl.int64)
            v0 = tl.load(y_ptr + row0 * H + hh, mask=hm, other=0).to(tl.float32)
            v1 = tl.load(y_ptr + row1 * H + hh, mask=hm & has1, other=0).to(tl.float32)
            if HAS_PROBS:
                e0 = tl.load(map_ptr + t * W + E + k)
                e1 = tl.load(map_ptr + t * W + E + k + 1, mask=has1, other=0)
                v0 = v0 * tl.load(mp_ptr + t * E + e0).to(tl.float32)
                v1 = v1 * tl.load(mp_ptr + t * E + e1, mask=has1, other=0).to(tl.float32)
            acc += v0 + v1
        tl.store(out_ptr + t * H + hh, acc.to(out_ptr.dtype.element_ty), mask=hm)


@triton.jit
def combine_kernel(y_ptr, map_ptr, mp_ptr, E, H, out_ptr, BLOCK_H: tl.constexpr, HAS_PROBS: tl.constexpr):
    """out[t] = sum_k y[row_k] * merging_probs[t, e_k] in fp32 (also dispatch's dx without probs)."""
    t = tl.program_id(0).to(tl.int64)
    _combine_token(t, y_ptr, map_ptr, mp_ptr, out_ptr, E, H, BLOCK_H, HAS_PROBS)


@triton.jit
def dispatch_bwd_kernel(
    g_ptr, map_ptr, gpp_ptr, E, H, dx_ptr, dprobs_ptr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr
):
    """dx[t] = sum of g over t's rows (fp32); dprobs[t, e] = g_permuted_probs[row(t, e)], 0 elsewhere."""
    t = tl.program_id(0).to(tl.int64)
    _combine_token(t, g_ptr, map_ptr, map_ptr, dx_ptr, E, H, BLOCK_H, False)
    W = 2 * E + 1
    n = tl.load(map_ptr + t * W + 2 * E)
    kk = tl.arange(0, BLOCK_E)
    km = kk < E
    rows = tl.load(map_ptr + t * W + kk, mask=km, other=0)
    es = tl.load(map_ptr + t * W + E + kk, mask=km, other=0)
    val = tl.load(gpp_ptr + rows.to(tl.int64), mask=km & (kk < n), other=0)
    tl.store(dprobs_ptr + t * E + es, val.to(dprobs_ptr.dtype.element_ty), mask=km)


@triton.jit
def _combine_bwd_token(
    t,
    g_ptr,
    y_ptr,
    map_ptr,
    mp_ptr,
    dy_ptr,
    dmp_ptr,
    E,
    H,
    BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    W = 2 * E + 1
    n = tl.load(map_ptr + t * W + 2 * E)
    for k in range(n):
        row = tl.load(map_ptr + t * W + k).to(tl.int64)
        e = tl.load(map_ptr + t * W + E + k)
        if HAS_PROBS:
            p = tl.load(mp_ptr + t * E + e).to(tl.float32)
        else:
            p = 1.0
        dot = tl.zeros([BLOCK_H], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            hm = hh < H
            g = tl.load(g_ptr + t * H + hh, mask=hm, other=0).to(tl.float32)
            tl.store(dy_ptr + row * H + hh, (g * p).to(dy_ptr.dtype.element_ty), mask=hm)
            if HAS_PROBS:
                dot += tl.load(y_ptr + row * H + hh, mask=hm, other=0).to(tl.float32) * g
        if HAS_PROBS:
            tl.store(dmp_ptr + t * E + e, tl.sum(dot, axis=0).to(dmp_ptr.dtype.element_ty))
    if HAS_PROBS:
        kk = tl.arange(0, BLOCK_E)
        es = tl.load(map_ptr + t * W + E + kk, mask=kk < E, other=0)
        tl.store(dmp_ptr + t * E + es, tl.zeros([BLOCK_E], dmp_ptr.dtype.element_ty), mask=(kk < E) & (kk >= n))


@triton.jit
def combine_bwd_kernel(
    g_ptr, y_ptr, map_ptr, mp_ptr, dy_ptr, E, H, dmp_ptr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr
):
    """dy[row] = g[t] * merging_probs[t, e] (``dy_ptr`` aliased, holes zeroed before);
    dmerging_probs[t, e] = <y[row], g[t]> in fp32, 0 where not routed."""
    t = tl.program_id(0).to(tl.int64)
    _combine_bwd_token(t, g_ptr, y_ptr, map_ptr, mp_ptr, dy_ptr, dmp_ptr, E, H, BLOCK_H, BLOCK_E, True)


@triton.jit
def combine_bwd_noprobs_kernel(g_ptr, map_ptr, dy_ptr, E, H, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    _combine_bwd_token(t, g_ptr, g_ptr, map_ptr, g_ptr, dy_ptr, dy_ptr, E, H, BLOCK_H, BLOCK_E, False)


# ----------------------------------------------------------------------------------------------
# sort_chunks_by_index
# ----------------------------------------------------------------------------------------------


@triton.jit
def chunk_src_kernel(
    src_start_ptr,
    dst_start_ptr,
    dst_end_ptr,
    S,
    N,
    src_ptr,
    map_ptr,
    ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """For each output row r: src[r] = the input row it takes (gather form), and map[src[r]] = r.
    Chunk metadata is per position j of the sorted order (see reference.chunk_layout)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = r < N
    s = tl.arange(0, BLOCK_S)
    ends = tl.load(dst_end_ptr + s, mask=s < S, other=2147483647)
    j = tl.sum((ends[None, :] <= r[:, None]).to(tl.int32), axis=1)
    inside = j < S
    jj = tl.where(inside, j, 0)
    src = (
        tl.load(src_start_ptr + jj, mask=rm & inside, other=0)
        + r
        - tl.load(dst_start_ptr + jj, mask=rm & inside, other=0)
    )
    src = tl.where(inside, src, r)
    tl.store(src_ptr + r, src, mask=rm)
    tl.store(map_ptr + src, r, mask=rm)


@triton.jit
def row_gather_kernel(x_ptr, idx_ptr, N, H, out_ptr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[r] = x[idx[r]]."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = r < N
    src = tl.load(idx_ptr + r, mask=rm, other=0).to(tl.int64)
    r64 = r.to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        m = rm[:, None] & (hh < H)[None, :]
        v = tl.load(x_ptr + src[:, None] * H + hh[None, :], mask=m)
        tl.store(out_ptr + r64[:, None] * H + hh[None, :], v, mask=m)
