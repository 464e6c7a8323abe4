"""Triton kernels of grouped_dense. Imported only when the Triton implementation runs (this module
imports triton at module scope; ``te_ops`` itself never imports it).

Two kernels, all sizes runtime scalars (a new M or new group sizes never recompile):

* ``grouped_gemm_kernel``: persistent grouped GEMM ``out[rows of g] = a[rows of g] @ B_g (+ bias[g])``.
  ``num_programs`` programs (one per SM) walk one tile schedule that every program derives on the
  device from ``group_sizes``: group g owns ``cdiv(size_g, BM) * cdiv(NOUT, BN)`` tiles (a prefix
  sum over G inside the kernel), then come the "zero tiles" that write zeros to the rows past
  ``sum(group_sizes)``. Tiles start at each group's first row (not at a global BM grid), so a tile
  never straddles two groups in its output; the A rows it loads past the group's end are clamped to
  the group's last row and never stored (row i of the product depends only on row i of A). Inside
  a group, tiles are ordered in GROUP_M bands (L2 reuse of the B tiles). ``TRANS_B`` reads B_g as
  the transpose of the stored ``[NOUT, KC]`` matrix (dx = dy @ W_g^T) through strides: no transpose
  is materialised.
* ``grouped_wgrad_kernel``: ``dW[g] = x_g^T @ dy_g`` ([K, N] per group). One program per
  (g, K-tile, N-tile) output tile loops over the rows of group g (the M reduction stays inside the
  program: no atomics, deterministic); loads are masked at the group's row range so no other group's
  rows enter the sum; empty groups store zeros.

``te_scratch`` (both kernels): the XLA buffer that holds the TMA descriptors the USE_TMA variants
build on the device (the bridge points Triton's global scratch at it: no allocation per launch,
so the launch can be captured in a CUDA graph); unused without TMA.

Alignment: K and N are passed divided by 8 (``KC8``, ``N8``) and multiplied back inside, so Triton's
alignment analysis knows every row starts on a 16-byte boundary and vectorises the loads (the bridge
does not value-specialise integer arguments). Offsets that scale with M are int64.
"""

import triton
import triton.language as tl

from te_ops._core.triton_math import _act, _dact, _round_to


@triton.jit
def _group_table(gs_ptr, G, M, BLOCK_G: tl.constexpr):
    """Per-group (start, end) rows: sizes clamped >= 0, both bounds clipped at M (matches
    reference.group_bounds: start[g] = end[g-1]). The start is the clipped *exclusive* prefix sum,
    not ``end - size``: once the sum passes M the end is clipped, and ``end - size`` would reach back
    into the previous group (sizes [300, 300, 300] at M=640 would give group 2 rows [340, 640),
    overlapping group 1, whose output rows and dkernels then depend on which tile is written last).
    The prefix sum runs in int64: G <= 1024 sizes below 2**31 cannot overflow it, where an int32
    cumsum wraps around (sizes [2**31 - 1, 2**31 - 1, ...] would give negative ends and leave output
    rows unwritten)."""
    gi = tl.arange(0, BLOCK_G)
    sizes = tl.load(gs_ptr + gi, mask=gi < G, other=0)
    sizes = tl.maximum(sizes, 0).to(tl.int64)
    cum = tl.cumsum(sizes, axis=0)
    end = tl.minimum(cum, M).to(tl.int32)
    start = tl.minimum(cum - sizes, M).to(tl.int32)
    return gi, start, end


@triton.jit
def _schedule(gs_ptr, G, M, n_tiles, BM: tl.constexpr, BLOCK_G: tl.constexpr):
    """The persistent kernels' tile table: group g owns ``cdiv(size_g, BM) * n_tiles`` tiles, then
    come the zero tiles of rows [used_rows, M). Returns (gi, start, end, m_tiles_g, tiles_g, cum,
    group_tiles, used_rows, tail_m_tiles, total)."""
    gi, start, end = _group_table(gs_ptr, G, M, BLOCK_G)
    sizes = end - start
    m_tiles_g = (sizes + BM - 1) // BM
    tiles_g = m_tiles_g * n_tiles
    cum = tl.cumsum(tiles_g, axis=0)
    group_tiles = tl.sum(tiles_g, axis=0)
    used_rows = tl.max(end, axis=0)
    tail_m_tiles = (M - used_rows + BM - 1) // BM
    total = group_tiles + tail_m_tiles * n_tiles
    return gi, start, end, m_tiles_g, tiles_g, cum, group_tiles, used_rows, tail_m_tiles, total


@triton.jit
def _tile(t, gi, start, end, m_tiles_g, tiles_g, cum, group_tiles, used_rows, tail_m_tiles, n_tiles, G, M,
          GROUP_M: tl.constexpr):  # fmt: skip
    """(in_group, g, row0, row_end, mt, nt) of tile ``t`` of :func:`_schedule`'s table: its group
    (clamped to G - 1 for the zero tiles), the first row and the row end of the group (of [used_rows,
    M) for a zero tile), and its M and N tile inside the group, in GROUP_M bands (L2 reuse of B)."""
    in_group = t < group_tiles
    # the group of tile t: number of groups whose tiles all come before t
    g = tl.sum((cum <= t).to(tl.int32), axis=0)
    g = tl.minimum(g, G - 1)
    sel = gi == g
    g_first_tile = tl.sum(tl.where(sel, cum - tiles_g, 0), axis=0)
    g_start = tl.sum(tl.where(sel, start, 0), axis=0)
    g_end = tl.sum(tl.where(sel, end, 0), axis=0)
    g_mt = tl.sum(tl.where(sel, m_tiles_g, 0), axis=0)
    # zero tiles (rows past the last group): same decomposition with a "group" [used_rows, M)
    lt = tl.where(in_group, t - g_first_tile, t - group_tiles)
    row0 = tl.where(in_group, g_start, used_rows)
    row_end = tl.where(in_group, g_end, M)
    mt_count = tl.where(in_group, g_mt, tail_m_tiles)
    per_band = GROUP_M * n_tiles
    band = lt // per_band
    first_m = band * GROUP_M
    band_m = tl.minimum(mt_count - first_m, GROUP_M)
    mt = first_m + (lt % per_band) % band_m
    nt = (lt % per_band) // band_m
    return in_group, g, row0, row_end, mt, nt


@triton.jit
def _tile_span(row0, row_end, mt, nt, NCOLS, BM: tl.constexpr, BN: tl.constexpr):
    """(rows, rows_ld, cols, cols_ld) of a tile: its output rows and columns, the rows it loads
    (clamped to the group's last row: never stored, row i of a product depends only on row i of A)
    and the columns it loads (wrapped into [0, NCOLS), aligned for vector loads)."""
    rows = row0 + mt * BM + tl.arange(0, BM)
    rows_ld = tl.minimum(rows, tl.maximum(row_end - 1, 0)).to(tl.int64)
    cols = nt * BN + tl.arange(0, BN)
    cols_ld = tl.max_contiguous(tl.multiple_of(cols % NCOLS, BN), BN)
    return rows, rows_ld, cols, cols_ld


@triton.jit
def grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    gs_ptr,
    M,
    KC8,
    N8,
    G,
    num_programs,
    out_ptr,
    te_scratch,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    TRANS_B: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    FLATTEN: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """a: [M, KC]; b: [G, KC, NOUT] (or [G, NOUT, KC] with TRANS_B); bias: [G, NOUT]; out: [M, NOUT].

    USE_TMA (only with EVEN_K): A and B tiles come through device-side TMA descriptors instead of
    pointer loads. A's rows past the group's end then hold the next group's rows (or TMA's zero fill
    past M): harmless, row i of the product depends only on row i of A and those rows are not
    stored. B is read as a 2D [G * KC, NOUT] (or [G * NOUT, KC]) matrix: with KC a multiple of BK a
    K tile never crosses into the next group, and columns past NOUT are zero-filled (or belong to
    the next group with TRANS_B, and are not stored)."""
    KC = KC8 * 8
    NOUT = N8 * 8
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(NOUT, BN)
    gi, start, end, m_tiles_g, tiles_g, cum, group_tiles, used_rows, tail_m_tiles, total = _schedule(
        gs_ptr, G, M, n_tiles, BM, BLOCK_G
    )
    k_iters = tl.cdiv(KC, BK)
    offs_k = tl.arange(0, BK)
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, KC], strides=[KC, 1], block_shape=[BM, BK])
        if TRANS_B:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[G * NOUT, KC], strides=[KC, 1], block_shape=[BN, BK])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[G * KC, NOUT], strides=[NOUT, 1], block_shape=[BK, BN])
    for t in tl.range(pid, total, num_programs, flatten=FLATTEN):
        in_group, g, row0, row_end, mt, nt = _tile(
            t, gi, start, end, m_tiles_g, tiles_g, cum, group_tiles, used_rows, tail_m_tiles, n_tiles, G, M, GROUP_M
        )
        iters = tl.where(in_group, k_iters, 0)
        rows, rows_ld, cols, cols_ld = _tile_span(row0, row_end, mt, nt, NOUT, BM, BN)
        g64 = g.to(tl.int64)
        a_ptrs = a_ptr + rows_ld[:, None] * KC + offs_k[None, :]
        if TRANS_B:
            b_ptrs = b_ptr + g64 * KC * NOUT + cols_ld[None, :].to(tl.int64) * KC + offs_k[:, None]
            b_step = BK
        else:
            b_ptrs = b_ptr + g64 * KC * NOUT + offs_k[:, None].to(tl.int64) * NOUT + cols_ld[None, :]
            b_step = BK * NOUT
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if USE_TMA:
            a_row = row0 + mt * BM
            for ki in range(0, iters):
                k0 = ki * BK
                a = a_desc.load([a_row, k0])
                if TRANS_B:
                    b = b_desc.load([g * NOUT + nt * BN, k0]).T
                else:
                    b = b_desc.load([g * KC + k0, nt * BN])
                acc = tl.dot(a, b, acc)
        else:
            for ki in range(0, iters):
                if EVEN_K:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs)
                else:
                    k_ok = offs_k < KC - ki * BK
                    a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
                acc = tl.dot(a, b, acc)
                a_ptrs += BK
                b_ptrs += b_step
        if HAS_BIAS:
            bias = tl.load(bias_ptr + g64 * NOUT + cols_ld, mask=(cols < NOUT) & in_group, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        out = acc.to(out_ptr.dtype.element_ty)
        o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * NOUT + cols[None, :]
        tl.store(o_ptrs, out, mask=(rows < row_end)[:, None] & (cols < NOUT)[None, :])


@triton.jit
def grouped_wgrad_kernel(
    x_ptr,
    dy_ptr,
    gs_ptr,
    M,
    K8,
    N8,
    G,
    dw_ptr,
    te_scratch,
    BKO: tl.constexpr,
    BN: tl.constexpr,
    BR: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_K: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """dw[g] = x[rows of g]^T @ dy[rows of g]; x: [M, K], dy: [M, N], dw: [G, K, N] (fp32 accumulation).

    USE_TMA: the whole BR-row steps of the group come through TMA descriptors (no mask needed: every
    row belongs to the group; columns past K / N are zero-filled); the last partial step, whose rows
    must stop at the group's end, keeps the masked pointer loads."""
    K = K8 * 8
    N = N8 * 8
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BKO)
    n_tiles = tl.cdiv(N, BN)
    per_g = k_tiles * n_tiles
    g = pid // per_g
    lt = pid % per_g
    # GROUP_K bands: consecutive programs share the dy tiles of a band
    per_band = GROUP_K * n_tiles
    band = lt // per_band
    first_k = band * GROUP_K
    band_k = tl.minimum(k_tiles - first_k, GROUP_K)
    kt = first_k + (lt % per_band) % band_k
    nt = (lt % per_band) // band_k

    gi, start, end = _group_table(gs_ptr, G, M, BLOCK_G)
    sel = gi == g
    r0 = tl.sum(tl.where(sel, start, 0), axis=0)
    r1 = tl.sum(tl.where(sel, end, 0), axis=0)

    ks = kt * BKO + tl.arange(0, BKO)
    ns = nt * BN + tl.arange(0, BN)
    ks_ld = tl.max_contiguous(tl.multiple_of(ks % K, BKO), BKO)
    ns_ld = tl.max_contiguous(tl.multiple_of(ns % N, BN), BN)
    offs_r = tl.arange(0, BR)
    acc = tl.zeros((BKO, BN), dtype=tl.float32)
    iters = tl.cdiv(r1 - r0, BR)
    i0 = 0
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BR, BKO])
        dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, N], strides=[N, 1], block_shape=[BR, BN])
        i0 = (r1 - r0) // BR
        for i in range(0, i0):
            r = r0 + i * BR
            a = x_desc.load([r, kt * BKO]).T
            b = dy_desc.load([r, nt * BN])
            acc = tl.dot(a, b, acc)
    xt_ptrs = x_ptr + (r0 + i0 * BR + offs_r).to(tl.int64)[None, :] * K + ks_ld[:, None]  # [BKO, BR] view of x^T
    dy_ptrs = dy_ptr + (r0 + i0 * BR + offs_r).to(tl.int64)[:, None] * N + ns_ld[None, :]  # [BR, BN]
    for i in range(i0, iters):
        r_ok = offs_r < r1 - r0 - i * BR
        a = tl.load(xt_ptrs, mask=r_ok[None, :], other=0.0)
        b = tl.load(dy_ptrs, mask=r_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        xt_ptrs += BR * K
        dy_ptrs += BR * N
    out = acc.to(dw_ptr.dtype.element_ty)
    o_ptrs = dw_ptr + g.to(tl.int64) * K * N + ks.to(tl.int64)[:, None] * N + ns[None, :]
    tl.store(o_ptrs, out, mask=(ks < K)[:, None] & (ns < N)[None, :])


# ----------------------------------------------------------------------------------------------
# The bf16 expert FFN (grouped_ffn): the activation in the epilogues of the grouped GEMMs around it
# ----------------------------------------------------------------------------------------------


@triton.jit
def _ffn_tile_mask(rows, row_end, cols, F):
    return (rows < row_end)[:, None] & (cols < F)[None, :]


@triton.jit
def grouped_gemm_act_kernel(
    a_ptr,
    b_ptr,
    gs_ptr,
    M,
    KC8,
    F8,
    G,
    num_programs,
    h_ptr,
    act_ptr,
    te_scratch,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    EVEN_K: tl.constexpr,
    HW: tl.constexpr,
):
    """The first expert GEMM with the activation in its epilogue: h = a @ b_g on the rows of group g
    (b: [G, KC, W], W = 2F gated, else F) and ``act = act(h)`` or, gated, ``act(h[:, :F]) * h[:, F:]``
    ([M, F]), the activation computed in float32 from h rounded to h's dtype (what the unfused
    activation reads) and rounded once to it. Both outputs are zero on the rows past the groups.

    The tile schedule is grouped_gemm_kernel's over F (N tiles of BN columns); gated, a tile
    accumulates its BN activation columns and the BN linear columns F later side by side (two
    accumulators sharing each A tile), so the product of the two halves never leaves registers."""
    KC = KC8 * 8
    F = F8 * 8
    W = 2 * F if GATED else F
    dt = h_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(F, BN)
    gi, start, end, m_tiles_g, tiles_g, cum, group_tiles, used_rows, tail_m_tiles, total = _schedule(
        gs_ptr, G, M, n_tiles, BM, BLOCK_G
    )
    k_iters = tl.cdiv(KC, BK)
    offs_k = tl.arange(0, BK)
    for t in tl.range(pid, total, num_programs):
        in_group, g, row0, row_end, mt, nt = _tile(
            t, gi, start, end, m_tiles_g, tiles_g, cum, group_tiles, used_rows, tail_m_tiles, n_tiles, G, M, GROUP_M
        )
        iters = tl.where(in_group, k_iters, 0)
        rows, rows_ld, cols, cols_ld = _tile_span(row0, row_end, mt, nt, F, BM, BN)
        a_ptrs = a_ptr + rows_ld[:, None] * KC + offs_k[None, :]
        b_ptrs = b_ptr + g.to(tl.int64) * KC * W + offs_k[:, None].to(tl.int64) * W + cols_ld[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(0, iters):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
                if GATED:
                    bu = tl.load(b_ptrs + F)
            else:
                k_ok = offs_k < KC - ki * BK
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
                if GATED:
                    bu = tl.load(b_ptrs + F, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
            if GATED:
                acc_u = tl.dot(a, bu, acc_u)
            a_ptrs += BK
            b_ptrs += BK * W
        mask = _ffn_tile_mask(rows, row_end, cols, F)
        h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * W + cols[None, :]
        z = _round_to(acc, dt, HW)
        tl.store(h_ptrs, z.to(dt), mask=mask)
        y = _act(z, ACT)
        if GATED:
            u = _round_to(acc_u, dt, HW)
            tl.store(h_ptrs + F, u.to(dt), mask=mask)
            y = y * u
        y = _round_to(y, dt, HW)
        tl.store(act_ptr + rows.to(tl.int64)[:, None] * F + cols[None, :], y.to(dt), mask=mask)


@triton.jit
def grouped_gemm_dact_kernel(
    a_ptr,
    b_ptr,
    h_ptr,
    gs_ptr,
    M,
    KC8,
    F8,
    G,
    num_programs,
    dh_ptr,
    te_scratch,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    EVEN_K: tl.constexpr,
    HW: tl.constexpr,
):
    """The second expert GEMM's input gradient with the activation's backward in its epilogue:
    ``da = a @ b_g^T`` on the rows of group g (a = dy [M, KC], b: [G, F, KC] read transposed),
    rounded to h's dtype (the unfused da), then ``dh = da * act'(h)`` or, gated,
    ``[da * h[:, F:] * act'(h[:, :F]), da * act(h[:, :F])]`` (h, dh: [M, W]) in float32, rounded to
    h's dtype: the unfused activation's gradient, without da going to memory. dh is zero on the rows
    past the groups (h is zero there; a zero da times a finite act' gives zero)."""
    KC = KC8 * 8
    F = F8 * 8
    W = 2 * F if GATED else F
    dt = dh_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(F, BN)
    gi, start, end, m_tiles_g, tiles_g, cum, group_tiles, used_rows, tail_m_tiles, total = _schedule(
        gs_ptr, G, M, n_tiles, BM, BLOCK_G
    )
    k_iters = tl.cdiv(KC, BK)
    offs_k = tl.arange(0, BK)
    for t in tl.range(pid, total, num_programs):
        in_group, g, row0, row_end, mt, nt = _tile(
            t, gi, start, end, m_tiles_g, tiles_g, cum, group_tiles, used_rows, tail_m_tiles, n_tiles, G, M, GROUP_M
        )
        iters = tl.where(in_group, k_iters, 0)
        rows, rows_ld, cols, cols_ld = _tile_span(row0, row_end, mt, nt, F, BM, BN)
        a_ptrs = a_ptr + rows_ld[:, None] * KC + offs_k[None, :]
        b_ptrs = b_ptr + g.to(tl.int64) * KC * F + cols_ld[None, :].to(tl.int64) * KC + offs_k[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(0, iters):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k < KC - ki * BK
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK
        mask = _ffn_tile_mask(rows, row_end, cols, F)
        offs = rows.to(tl.int64)[:, None] * W + cols[None, :]
        da = _round_to(acc, dt, HW)
        z = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if GATED:
            u = tl.load(h_ptr + offs + F, mask=mask, other=0.0).to(tl.float32)
            tl.store(dh_ptr + offs + F, _round_to(da * _act(z, ACT), dt, HW).to(dt), mask=mask)
            tl.store(dh_ptr + offs, _round_to(_dact(da * u, z, ACT), dt, HW).to(dt), mask=mask)
        else:
            tl.store(dh_ptr + offs, _round_to(_dact(da, z, ACT), dt, HW).to(dt), mask=mask)
