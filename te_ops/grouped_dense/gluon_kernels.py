"""Gluon (Hopper) warp-specialized persistent grouped GEMM: the forward and dx kernel of
grouped_dense on sm_90. Imported only when that kernel runs (this module imports triton).

Same contract as ``triton_kernels.grouped_gemm_kernel`` (same arguments, same tile schedule, same
zero rows past the groups), built the way the fastest Hopper GEMMs are:

* **Warp specialization.** One producer warp issues TMA loads of the A tile ``[BM, BK]`` and the
  B tile (``[BK, BN]``, or ``[BN, BK]`` read transposed for dx) into a ``STAGES``-deep shared
  memory ring; the consumer warps (two warpgroups, ``num_warps=8``) wait on each stage's "ready"
  mbarrier, issue asynchronous wgmma on it and hand the stage back through its "empty" mbarrier
  once the wgmma that read it has retired. The producer runs ahead into the next tile while the
  consumers run the epilogue, so at short K (the MoE expert GEMMs have K = 1024..4096) the
  epilogue no longer stalls the tensor cores; ``setmaxnreg`` gives the producer 24 registers and
  the consumers the rest (the accumulator alone is 128 registers per thread).
* **Epilogue.** A tile whose rows all belong to its group goes out through shared memory and an
  asynchronous TMA store (overlapping the next tile's mainloop; the descriptor clips the columns
  at NOUT); the last, partial tile of a group (and the zero tiles past the groups) use a masked
  store from registers, so no row of the next group is ever written.
* **Reads past a group's rows** are harmless as in the Triton kernel: row i of the product depends
  only on row i of A, and those rows are not stored; A rows past M are TMA's zero fill. B is a 2D
  ``[G * KC, NOUT]`` (or ``[G * NOUT, KC]``) matrix, and KC must be a multiple of BK so a K step
  never crosses into the next group's weights (the launcher checks; other K use the Triton kernel).

Both partitions decode the same tile sequence from ``group_sizes`` on the device (the prefix sums
are recomputed in each partition: a few hundred integer ops per tile), so nothing is synchronised
with the host and the launch is graph-safe.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Positions in the schedule tuple of :func:`_schedule` that loops outside :func:`_tile` read.
SCHED_GROUP_TILES = gl.constexpr(6)  # the number of group tiles (tiles past it are zero tiles)
SCHED_N_TILES = gl.constexpr(9)  # the number of N tiles, cdiv(NOUT, BN)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _schedule(gs_ptr, G, M, NOUT, BM: gl.constexpr, BN: gl.constexpr, BLOCK_G: gl.constexpr, layout: gl.constexpr):
    """Per-group tables and the tile counts: the same rule as ``triton_kernels._group_table`` (sizes
    clamped >= 0, bounds clipped at M, the start is the clipped exclusive prefix sum in int64).
    Returns ``(sched, total)``: the tables as one tuple, which the partitions hand to :func:`_tile`
    whole (so a change to them touches these two functions and the ``SCHED_*`` positions only), and
    the number of tiles."""
    gi = gl.arange(0, BLOCK_G, layout=layout)
    sizes = gl.load(gs_ptr + gi, mask=gi < G, other=0)
    sizes = gl.maximum(sizes, 0).to(gl.int64)
    cum = gl.associative_scan(sizes, 0, _add)
    end = gl.minimum(cum, M).to(gl.int32)
    start = gl.minimum(cum - sizes, M).to(gl.int32)
    n_tiles = gl.cdiv(NOUT, BN)
    m_tiles_g = (end - start + BM - 1) // BM
    tiles_g = m_tiles_g * n_tiles
    cum_tiles = gl.associative_scan(tiles_g, 0, _add)
    group_tiles = gl.sum(tiles_g, axis=0)
    used_rows = gl.max(end, axis=0)
    tail_m_tiles = (M - used_rows + BM - 1) // BM
    total = group_tiles + tail_m_tiles * n_tiles
    # SCHED_GROUP_TILES and SCHED_N_TILES (top of this module) name positions in this tuple
    return (gi, start, end, m_tiles_g, tiles_g, cum_tiles, group_tiles, used_rows, tail_m_tiles, n_tiles), total


@gluon.jit
def _tile(t, sched, G, M, BM: gl.constexpr, GROUP_M: gl.constexpr):
    """(in_group, group, first row, row end, N tile) of tile ``t`` of ``sched`` (from :func:`_schedule`;
    GROUP_M bands inside a group; tiles past the groups cover rows [used_rows, M) with zeros)."""
    gi, start, end, m_tiles_g, tiles_g, cum_tiles, group_tiles, used_rows, tail_m_tiles, n_tiles = sched
    in_group = t < group_tiles
    g = gl.minimum(gl.sum((cum_tiles <= t).to(gl.int32), axis=0), G - 1)
    sel = gi == g
    g_first_tile = gl.sum(gl.where(sel, cum_tiles - tiles_g, 0), axis=0)
    g_start = gl.sum(gl.where(sel, start, 0), axis=0)
    g_end = gl.sum(gl.where(sel, end, 0), axis=0)
    g_mt = gl.sum(gl.where(sel, m_tiles_g, 0), axis=0)
    lt = gl.where(in_group, t - g_first_tile, t - group_tiles)
    row0 = gl.where(in_group, g_start, used_rows)
    row_end = gl.where(in_group, g_end, M)
    mt_count = gl.where(in_group, g_mt, tail_m_tiles)
    per_band = GROUP_M * n_tiles
    first_m = (lt // per_band) * GROUP_M
    band_m = gl.minimum(mt_count - first_m, GROUP_M)
    mt = first_m + (lt % per_band) % band_m
    nt = (lt % per_band) // band_m
    return in_group, g, row0 + mt * BM, row_end, nt


@gluon.jit
def _wait_ready(ready, it, STAGES: gl.constexpr):
    """The ring stage of K step ``it`` (counted over the program's group tiles, as the producer
    counts them), once its TMA loads have landed. The phase waited for is the parity of the ring's
    lap: the producer refills a stage only after its "empty" barrier, so "ready" is never more than
    one lap ahead."""
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    return s


@gluon.jit
def _mma_k_loop(
    a_bufs,
    b_bufs,
    ready,
    empty,
    it,
    acc,
    acc2,
    k_iters,
    STAGES: gl.constexpr,
    TRANS_B: gl.constexpr,
    b2_bufs=None,
    DUAL_B: gl.constexpr = False,
):
    """The consumer's mainloop over one tile's ``k_iters`` K steps from ring position ``it``:
    ``acc += A @ B`` by asynchronous wgmma (B read transposed with TRANS_B; with DUAL_B also ``acc2
    += A @ B2`` from ``b2_bufs``, the gated FFN's linear half; acc2 is None without). Returns (acc,
    the ring position after the tile), with DUAL_B (acc, acc2, the ring position).

    One step's wgmma stays in flight while the next is issued, so a stage is handed back to the
    producer one step late, once the wgmma that read it has retired (the first step has none to hand
    back); the last stage goes back after the final wait.

    The parameter order is deliberate: the loop carries its values in the order their names were
    bound (defaulted parameters first), and ``it``, ``acc``, ``acc2`` without a default give the
    order the consumers' own loops had before they shared this one, so no kernel's PTX changed (with
    acc2 first, the gated FFN act kernel's two accumulators trade PTX registers)."""
    for ki in range(k_iters):
        s = _wait_ready(ready, it, STAGES)
        if TRANS_B:
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
        else:
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
        if DUAL_B:
            acc2 = warpgroup_mma(a_bufs.index(s), b2_bufs.index(s), acc2, is_async=True)
            # both wgmmas of the previous step have retired: its stage can be refilled
            acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
        else:
            # the wgmma of the previous step has retired: its stage can be refilled
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=ki > 0)
        it += 1
    if DUAL_B:
        acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
    # (a constexpr choice of what to return: a None in the returned tuple does not compile)
    if DUAL_B:
        return acc, acc2, it
    else:
        return acc, it


@gluon.jit
def _producer(
    a_desc,
    b_desc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    gs_ptr,
    M,
    KC,
    NOUT,
    G,
    num_programs,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    TRANS_B: gl.constexpr,
    sa_desc=None,
    sa_bufs=None,
    SCALES_TMA: gl.constexpr = False,
    b2_bufs=None,
    DUAL_B: gl.constexpr = False,
):
    """TMA loads of the A and B tiles of each K step into the ``STAGES``-deep ring, one "ready"
    barrier per stage. ``SCALES_TMA`` (the FP8 GEMM's variant, te_ops/fp8/gluon_kernels.py): also the
    BM float32 row scales of A at the step into ``sa_bufs``, on the same barrier: elements
    ``ki * M + row ..`` of sa^T seen flat (rank-1 ``sa_desc``; past its end TMA's zero fill; rows
    past M or past the group are never stored, so whatever scales they get do not matter).
    ``DUAL_B`` (not with TRANS_B; the gated FFN's act GEMM, gluon_ffn_kernels.py): also the B tile
    NOUT columns to the right (the linear half of ``[G * KC, 2 * NOUT]``) into ``b2_bufs``, on the
    same barrier."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    sched, total = _schedule(gs_ptr, G, M, NOUT, BM, BN, BLOCK_G, layout)
    k_iters = gl.cdiv(KC, BK)
    nbytes: gl.constexpr = (BM * BK + (2 if DUAL_B else 1) * BK * BN) * a_desc.dtype.primitive_bitwidth // 8 + (
        BM * 4 if SCALES_TMA else 0
    )
    it = 0
    for t in range(gl.program_id(0), total, num_programs):
        in_group, g, row, row_end, nt = _tile(t, sched, G, M, BM, GROUP_M)
        if in_group:
            for ki in range(k_iters):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                tma.async_copy_global_to_shared(a_desc, [row, ki * BK], ready.index(s), a_bufs.index(s))
                if TRANS_B:
                    tma.async_copy_global_to_shared(
                        b_desc, [g * NOUT + nt * BN, ki * BK], ready.index(s), b_bufs.index(s)
                    )
                else:
                    tma.async_copy_global_to_shared(
                        b_desc, [g * KC + ki * BK, nt * BN], ready.index(s), b_bufs.index(s)
                    )
                    if DUAL_B:
                        tma.async_copy_global_to_shared(
                            b_desc, [g * KC + ki * BK, NOUT + nt * BN], ready.index(s), b2_bufs.index(s)
                        )
                if SCALES_TMA:
                    tma.async_copy_global_to_shared(sa_desc, [ki * M + row], ready.index(s), sa_bufs.index(s))
                it += 1


@gluon.jit
def _consumer(
    a_bufs,
    b_bufs,
    ready,
    empty,
    c_smem,
    out_desc,
    out_ptr,
    bias_ptr,
    gs_ptr,
    M,
    KC,
    NOUT,
    G,
    num_programs,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    TRANS_B: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BN, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    sched, total = _schedule(gs_ptr, G, M, NOUT, BM, BN, BLOCK_G, layout)
    k_iters = gl.cdiv(KC, BK)
    it = 0
    for t in range(gl.program_id(0), total, num_programs):
        in_group, g, row, row_end, nt = _tile(t, sched, G, M, BM, GROUP_M)
        acc = gl.zeros([BM, BN], gl.float32, mma_layout)
        if in_group:
            acc, it = _mma_k_loop(a_bufs, b_bufs, ready, empty, it, acc, None, k_iters, STAGES, TRANS_B)
        cols = nt * BN + gl.arange(0, BN, layout=col_layout)
        if HAS_BIAS:
            bias = gl.load(bias_ptr + g.to(gl.int64) * NOUT + cols, mask=(cols < NOUT) & in_group, other=0.0)
            acc = acc + bias.to(gl.float32)[None, :]
        c = acc.to(out_desc.dtype)
        if in_group & (row + BM <= row_end):
            tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
            c_smem.store(c)
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [row, nt * BN], c_smem)
        else:
            rows = row + gl.arange(0, BM, layout=row_layout)
            ptrs = out_ptr + rows.to(gl.int64)[:, None] * NOUT + cols[None, :]
            gl.store(ptrs, c, mask=(rows < row_end)[:, None] & (cols < NOUT)[None, :])
    tma.store_wait(pendings=0)


@gluon.jit
def grouped_gemm_ws_kernel(
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
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    TRANS_B: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    """a: [M, KC]; b: [G, KC, NOUT] (or [G, NOUT, KC] with TRANS_B); bias: [G, NOUT]; out: [M, NOUT].
    KC must be a multiple of BK; K and N multiples of 8 (16-byte rows for TMA). ``te_scratch``: the
    XLA buffer that holds the device-side TMA descriptors (the bridge redirects Triton's global
    scratch to it, so the launch allocates nothing and can be captured in a CUDA graph)."""
    KC = KC8 * 8
    NOUT = N8 * 8
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    bits: gl.constexpr = dtype.primitive_bitwidth
    a_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=2)
    b_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=2)
    c_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=2)
    a_desc = tma.make_tensor_descriptor(a_ptr, shape=[M, KC], strides=[KC, 1], block_shape=[BM, BK], layout=a_layout)
    if TRANS_B:
        b_desc = tma.make_tensor_descriptor(
            b_ptr, shape=[G * NOUT, KC], strides=[KC, 1], block_shape=[BN, BK], layout=b_layout
        )
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], b_layout)
    else:
        b_desc = tma.make_tensor_descriptor(
            b_ptr, shape=[G * KC, NOUT], strides=[NOUT, 1], block_shape=[BK, BN], layout=b_layout
        )
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], b_layout)
    out_desc = tma.make_tensor_descriptor(
        out_ptr, shape=[M, NOUT], strides=[NOUT, 1], block_shape=[BM, BN], layout=c_layout
    )
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_layout)
    c_smem = gl.allocate_shared_memory(dtype, [BM, BN], c_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    c_smem,
                    out_desc,
                    out_ptr,
                    bias_ptr,
                    gs_ptr,
                    M,
                    KC,
                    NOUT,
                    G,
                    num_programs,
                    BM,
                    BN,
                    BK,
                    STAGES,
                    GROUP_M,
                    BLOCK_G,
                    TRANS_B,
                    HAS_BIAS,
                    NUM_WARPS,
                ),
            ),
            (
                _producer,
                (
                    a_desc,
                    b_desc,
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    gs_ptr,
                    M,
                    KC,
                    NOUT,
                    G,
                    num_programs,
                    BM,
                    BN,
                    BK,
                    STAGES,
                    GROUP_M,
                    BLOCK_G,
                    TRANS_B,
                ),
            ),
        ],
        [1],
        [24],
    )


# ------------------------------------------------------------------------------------------------
# Ping-pong variant: two consumer warpgroups on alternate tiles
# ------------------------------------------------------------------------------------------------
# In grouped_gemm_ws_kernel both consumer warpgroups work on one 128 x 256 tile, so the tensor cores
# idle while they run its epilogue. Here each consumer warpgroup (4 warps) owns a whole BM x BN tile
# (accumulator 128 registers per thread at 128 x 128) and the two take alternate tiles of the
# program's sequence: while one runs its epilogue the other's wgmmas keep the tensor cores busy (the
# CUTLASS "ping-pong" schedule). The producer fills the stage ring in tile order; consumer c finds
# the ring position of its tile from the number of group tiles before it in the sequence.


@gluon.jit
def _pp_consumer(
    a_desc,
    b_desc,
    out_desc,
    out_ptr,
    bias_ptr,
    a_bufs,
    b_bufs,
    c_bufs,
    ready,
    empty,
    turn,
    gs_ptr,
    M,
    KC,
    NOUT,
    G,
    num_programs,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    TRANS_B: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    WHICH: gl.constexpr,
):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    sched, total = _schedule(gs_ptr, G, M, NOUT, BM, BN, BLOCK_G, layout)
    k_iters = gl.cdiv(KC, BK)
    c_smem = c_bufs.index(WHICH)
    it = 0  # ring position of the next group tile's first K step
    j = 0  # index of the tile in this program's sequence
    for t in range(gl.program_id(0), total, num_programs):
        in_group = t < sched[SCHED_GROUP_TILES]
        if j % 2 == WHICH:
            in_group, g, row, row_end, nt = _tile(t, sched, G, M, BM, GROUP_M)
            acc = gl.zeros([BM, BN], gl.float32, mma_layout)
            # the other warpgroup's mainloop of tile j - 1 is done: the ring is consumed in tile order,
            # so no consumer ever waits more than one lap ahead of the producer (mbarrier phases are
            # parities: a wait two laps ahead would pass on a stale phase)
            if j > 0:
                mbarrier.wait(turn.index(WHICH), ((j - 1) // 2) & 1)
            if in_group:
                for ki in range(k_iters):
                    s = _wait_ready(ready, it + ki, STAGES)
                    if TRANS_B:
                        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                    else:
                        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    mbarrier.arrive(empty.index((it + ki + STAGES - 1) % STAGES), pred=ki > 0)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index((it + k_iters + STAGES - 1) % STAGES))
            mbarrier.arrive(turn.index(1 - WHICH))  # its turn: this tile's epilogue overlaps its mainloop
            cols = nt * BN + gl.arange(0, BN, layout=col_layout)
            if HAS_BIAS:
                bias = gl.load(bias_ptr + g.to(gl.int64) * NOUT + cols, mask=(cols < NOUT) & in_group, other=0.0)
                acc = acc + bias.to(gl.float32)[None, :]
            c = acc.to(out_desc.dtype)
            if in_group & (row + BM <= row_end):
                tma.store_wait(pendings=0)
                c_smem.store(c)
                fence_async_shared()
                tma.async_copy_shared_to_global(out_desc, [row, nt * BN], c_smem)
            else:
                rows = row + gl.arange(0, BM, layout=row_layout)
                ptrs = out_ptr + rows.to(gl.int64)[:, None] * NOUT + cols[None, :]
                gl.store(ptrs, c, mask=(rows < row_end)[:, None] & (cols < NOUT)[None, :])
        if in_group:
            it += k_iters
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _pp_consumer0(
    a_desc,
    b_desc,
    out_desc,
    out_ptr,
    bias_ptr,
    a_bufs,
    b_bufs,
    c_bufs,
    ready,
    empty,
    turn,
    gs_ptr,
    M,
    KC,
    NOUT,
    G,
    num_programs,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    TRANS_B: gl.constexpr,
    HAS_BIAS: gl.constexpr,
):
    _pp_consumer(
        a_desc,
        b_desc,
        out_desc,
        out_ptr,
        bias_ptr,
        a_bufs,
        b_bufs,
        c_bufs,
        ready,
        empty,
        turn,
        gs_ptr,
        M,
        KC,
        NOUT,
        G,
        num_programs,
        BM,
        BN,
        BK,
        STAGES,
        GROUP_M,
        BLOCK_G,
        TRANS_B,
        HAS_BIAS,
        0,
    )


@gluon.jit
def _pp_consumer1(
    a_desc,
    b_desc,
    out_desc,
    out_ptr,
    bias_ptr,
    a_bufs,
    b_bufs,
    c_bufs,
    ready,
    empty,
    turn,
    gs_ptr,
    M,
    KC,
    NOUT,
    G,
    num_programs,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    TRANS_B: gl.constexpr,
    HAS_BIAS: gl.constexpr,
):
    _pp_consumer(
        a_desc,
        b_desc,
        out_desc,
        out_ptr,
        bias_ptr,
        a_bufs,
        b_bufs,
        c_bufs,
        ready,
        empty,
        turn,
        gs_ptr,
        M,
        KC,
        NOUT,
        G,
        num_programs,
        BM,
        BN,
        BK,
        STAGES,
        GROUP_M,
        BLOCK_G,
        TRANS_B,
        HAS_BIAS,
        1,
    )


@gluon.jit
def _pp_producer(
    a_desc,
    b_desc,
    out_desc,
    out_ptr,
    bias_ptr,
    a_bufs,
    b_bufs,
    c_bufs,
    ready,
    empty,
    turn,
    gs_ptr,
    M,
    KC,
    NOUT,
    G,
    num_programs,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    TRANS_B: gl.constexpr,
    HAS_BIAS: gl.constexpr,
):
    _producer(
        a_desc,
        b_desc,
        a_bufs,
        b_bufs,
        ready,
        empty,
        gs_ptr,
        M,
        KC,
        NOUT,
        G,
        num_programs,
        BM,
        BN,
        BK,
        STAGES,
        GROUP_M,
        BLOCK_G,
        TRANS_B,
    )


@gluon.jit
def grouped_gemm_pingpong_kernel(
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
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    TRANS_B: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """Same contract as :func:`grouped_gemm_ws_kernel`; launched with num_warps=4 (consumer 0), plus
    a 4-warp consumer and a 1-warp producer partition."""
    KC = KC8 * 8
    NOUT = N8 * 8
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    bits: gl.constexpr = dtype.primitive_bitwidth
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=2)
    a_desc = tma.make_tensor_descriptor(a_ptr, shape=[M, KC], strides=[KC, 1], block_shape=[BM, BK], layout=smem_layout)
    if TRANS_B:
        b_desc = tma.make_tensor_descriptor(
            b_ptr, shape=[G * NOUT, KC], strides=[KC, 1], block_shape=[BN, BK], layout=smem_layout
        )
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], smem_layout)
    else:
        b_desc = tma.make_tensor_descriptor(
            b_ptr, shape=[G * KC, NOUT], strides=[NOUT, 1], block_shape=[BK, BN], layout=smem_layout
        )
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], smem_layout)
    out_desc = tma.make_tensor_descriptor(
        out_ptr, shape=[M, NOUT], strides=[NOUT, 1], block_shape=[BM, BN], layout=smem_layout
    )
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], smem_layout)
    c_bufs = gl.allocate_shared_memory(dtype, [2, BM, BN], smem_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    gl.warp_specialize(
        [
            (
                _pp_consumer0,
                (
                    a_desc,
                    b_desc,
                    out_desc,
                    out_ptr,
                    bias_ptr,
                    a_bufs,
                    b_bufs,
                    c_bufs,
                    ready,
                    empty,
                    turn,
                    gs_ptr,
                    M,
                    KC,
                    NOUT,
                    G,
                    num_programs,
                    BM,
                    BN,
                    BK,
                    STAGES,
                    GROUP_M,
                    BLOCK_G,
                    TRANS_B,
                    HAS_BIAS,
                ),
            ),
            (
                _pp_consumer1,
                (
                    a_desc,
                    b_desc,
                    out_desc,
                    out_ptr,
                    bias_ptr,
                    a_bufs,
                    b_bufs,
                    c_bufs,
                    ready,
                    empty,
                    turn,
                    gs_ptr,
                    M,
                    KC,
                    NOUT,
                    G,
                    num_programs,
                    BM,
                    BN,
                    BK,
                    STAGES,
                    GROUP_M,
                    BLOCK_G,
                    TRANS_B,
                    HAS_BIAS,
                ),
            ),
            (
                _pp_producer,
                (
                    a_desc,
                    b_desc,
                    out_desc,
                    out_ptr,
                    bias_ptr,
                    a_bufs,
                    b_bufs,
                    c_bufs,
                    ready,
                    empty,
                    turn,
                    gs_ptr,
                    M,
                    KC,
                    NOUT,
                    G,
                    num_programs,
                    BM,
                    BN,
                    BK,
                    STAGES,
                    GROUP_M,
                    BLOCK_G,
                    TRANS_B,
                    HAS_BIAS,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, 24],
    )
