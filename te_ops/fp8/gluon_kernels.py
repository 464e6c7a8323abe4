"""Gluon (Hopper) warp-specialized persistent block-scaled FP8 GEMM: the grouped (MoE experts) and,
with one group, the dense block-scaled GEMM on sm_90. Imported only when that kernel runs.

Same contract as ``triton_kernels.grouped_block_scaled_gemm_kernel`` (same arguments, tile schedule,
zero rows past the groups, float32 promotion every 128 elements of K), built like the bf16
``te_ops.grouped_dense.gluon_kernels.grouped_gemm_ws_kernel`` whose producer warp and tile schedule
it reuses:

* **Producer** (one warp, 24 registers): TMA loads of the A tile ``[BM, 128]`` and the B tile
  ``[BN, 128]`` (K-major, as Hopper's FP8 wgmma reads both operands) into a ``STAGES``-deep shared
  memory ring, running ahead across tiles.
* **Consumers** (two warpgroups, each its own partition on 64 rows of a ``128 x 128`` tile): for
  every 128-wide K step one asynchronous wgmma into a fresh float32 partial (``use_acc=False``), a
  wait for it, its stage handed back to the producer, and the promotion ``acc += partial * sa[row] *
  sb`` (the scales of the next step are loaded while this step's wgmma runs). The promotion of one
  warpgroup overlaps the other warpgroup's wgmma on the tensor cores. (Keeping two partials in
  flight within a warpgroup, promoting step k while step k + 1 runs, makes ptxas serialize the
  wgmmas (C7514: accumulator registers read inside the pipeline stage), so it buys nothing.)
* **SCALES_TMA** (a variant, off by default; ``te_ops.fp8.triton.GLUON_SCALES_TMA``): the producer
  (the bf16 ``_producer`` with its own SCALES_TMA) also TMA-loads each step's 128 A row scales into
  the stage, on the same "ready" barrier, and the consumers read theirs from shared memory while the
  wgmma runs, instead of loading them from global memory (as DeepGEMM does); the same partitions,
  only the scale fetch differs. Not yet measured on a GPU.
* **Epilogue**: bias (float32, per group) added to the float32 sum, one rounding to the output
  dtype; whole tiles of a group go out through shared memory and a TMA store, the last partial tile
  of a group and the zero tiles past the groups through a masked store.

The FP8 GEMM itself uses Hopper's FP8 accumulation inside one 128-element K step (as DeepSeek-V3
does), float32 across steps.
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

from te_ops.grouped_dense.gluon_kernels import SCHED_N_TILES, _producer, _schedule, _tile, _wait_ready


@gluon.jit
def _scales(sa_ptr, sb_base, kb, M, rows_ld):
    """Row scales of A's 1 x 128 tiles at K step ``kb`` (sa^T [n_kb, M]) times B's block scale."""
    sa = gl.load(sa_ptr + M.to(gl.int64) * kb + rows_ld)
    sb = gl.load(sb_base + kb)
    return sa * sb


# ------------------------------------------------------------------------------------------------
# Split consumers: the two warpgroups as two partitions, each on its own 64-row half of the tile
# ------------------------------------------------------------------------------------------------
# With both warpgroups in one partition (an earlier variant, removed: 851 vs 913 TFLOP/s at
# 16384x4096x14336 and 813 vs 886 grouped K7168 N4096 G32, H100, 2026-12-06), handing a stage back
# (one mbarrier arrive per partition) put a barrier across both warpgroups after every K step: they
# ran in lockstep and the tensor cores idled while both promoted. Here each warpgroup is its own
# partition with its own 64 rows of A (a slice of the stage's 128 rows) and the whole B tile; the
# "empty" barrier of a stage takes one arrive from each, so a warpgroup waits for the other only when
# the producer needs the stage back, and one's promotion overlaps the other's wgmma.


@gluon.jit
def _half_consumer(
    a_bufs,
    b_bufs,
    ready,
    empty,
    c_bufs,
    out_desc,
    out_ptr,
    sa_ptr,
    sb_ptr,
    bias_ptr,
    gs_ptr,
    M,
    K,
    NOUT,
    G,
    num_programs,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HALF: gl.constexpr,
    sa_bufs,
    SCALES_TMA: gl.constexpr,
):
    HM: gl.constexpr = BM // 2
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    sched, total = _schedule(gs_ptr, G, M, NOUT, BM, BN, BLOCK_G, layout)
    k_iters = gl.cdiv(K, BK)
    zero = gl.zeros([HM, BN], gl.float32, mma_layout)
    c_smem = c_bufs.index(HALF)
    it = 0
    for t in range(gl.program_id(0), total, num_programs):
        in_group, g, row, row_end, nt = _tile(t, sched, G, M, BM, GROUP_M)
        acc = gl.zeros([HM, BN], gl.float32, mma_layout)
        hrow = row + HALF * HM
        rows = hrow + gl.arange(0, HM, layout=row_layout)
        if in_group:
            rows_ld = gl.minimum(rows, M - 1)  # rows past M (last tile): clamped, never stored
            sb_base = sb_ptr + (g.to(gl.int64) * sched[SCHED_N_TILES] + nt) * k_iters  # sb [G, cdiv(NOUT, BN), n_kb]
            if SCALES_TMA:
                # A's row scales of each step are in the stage (the producer's TMA load); B's block
                # scale, one per tile and step, still comes from global memory one step ahead
                sb = gl.load(sb_base)
            else:
                sc = _scales(sa_ptr, sb_base, 0, M, rows_ld)
            for ki in range(k_iters):
                s = _wait_ready(ready, it, STAGES)
                part = warpgroup_mma(
                    a_bufs.index(s).slice(HALF * HM, HM, dim=0),
                    b_bufs.index(s).permute((1, 0)),
                    zero,
                    use_acc=False,
                    is_async=True,
                )
                # the scales, while the wgmma runs: this step's from the stage, or the next step's
                if SCALES_TMA:
                    sc = sa_bufs.index(s).slice(HALF * HM, HM, dim=0).load(row_layout) * sb
                    sb = gl.load(sb_base + gl.minimum(ki + 1, k_iters - 1))
                else:
                    sc_next = _scales(sa_ptr, sb_base, gl.minimum(ki + 1, k_iters - 1), M, rows_ld)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                mbarrier.arrive(empty.index(s))  # after the wgmma (and SCALES_TMA: the scales' read) of the stage
                acc = acc + part * sc[:, None]
                if not SCALES_TMA:
                    sc = sc_next
                it += 1
        cols = nt * BN + gl.arange(0, BN, layout=col_layout)
        if HAS_BIAS:
            bias = gl.load(bias_ptr + g.to(gl.int64) * NOUT + cols, mask=(cols < NOUT) & in_group, other=0.0)
            acc = acc + bias.to(gl.float32)[None, :]
        c = acc.to(out_desc.dtype)
        if in_group & (hrow + HM <= row_end):
            tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
            c_smem.store(c)
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [hrow, nt * BN], c_smem)
        else:
            ptrs = out_ptr + rows.to(gl.int64)[:, None] * NOUT + cols[None, :]
            gl.store(ptrs, c, mask=(rows < row_end)[:, None] & (cols < NOUT)[None, :])
    tma.store_wait(pendings=0)


@gluon.jit
def _half_consumer0(a_bufs, b_bufs, ready, empty, c_bufs, out_desc, out_ptr, sa_ptr, sb_ptr, bias_ptr, gs_ptr, M, K,
                    NOUT, G, num_programs, a_desc, b_desc, sa_desc, sa_bufs, BM: gl.constexpr, BN: gl.constexpr,
                    BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr,
                    HAS_BIAS: gl.constexpr, SCALES_TMA: gl.constexpr):  # fmt: skip
    _half_consumer(a_bufs, b_bufs, ready, empty, c_bufs, out_desc, out_ptr, sa_ptr, sb_ptr, bias_ptr, gs_ptr, M, K,
                   NOUT, G, num_programs, BM, BN, BK, STAGES, GROUP_M, BLOCK_G, HAS_BIAS, 0, sa_bufs,
                   SCALES_TMA)  # fmt: skip


@gluon.jit
def _half_consumer1(a_bufs, b_bufs, ready, empty, c_bufs, out_desc, out_ptr, sa_ptr, sb_ptr, bias_ptr, gs_ptr, M, K,
                    NOUT, G, num_programs, a_desc, b_desc, sa_desc, sa_bufs, BM: gl.constexpr, BN: gl.constexpr,
                    BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr,
                    HAS_BIAS: gl.constexpr, SCALES_TMA: gl.constexpr):  # fmt: skip
    _half_consumer(a_bufs, b_bufs, ready, empty, c_bufs, out_desc, out_ptr, sa_ptr, sb_ptr, bias_ptr, gs_ptr, M, K,
                   NOUT, G, num_programs, BM, BN, BK, STAGES, GROUP_M, BLOCK_G, HAS_BIAS, 1, sa_bufs,
                   SCALES_TMA)  # fmt: skip


@gluon.jit
def _split_producer(a_bufs, b_bufs, ready, empty, c_bufs, out_desc, out_ptr, sa_ptr, sb_ptr, bias_ptr, gs_ptr, M, K,
                    NOUT, G, num_programs, a_desc, b_desc, sa_desc, sa_bufs, BM: gl.constexpr, BN: gl.constexpr,
                    BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr,
                    HAS_BIAS: gl.constexpr, SCALES_TMA: gl.constexpr):  # fmt: skip
    # the bf16 kernels' producer (B K-major), with SCALES_TMA also A's row scales into the stage
    _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, gs_ptr, M, K, NOUT, G, num_programs, BM, BN, BK, STAGES,
              GROUP_M, BLOCK_G, True, sa_desc, sa_bufs, SCALES_TMA)  # fmt: skip


@gluon.jit
def grouped_block_scaled_gemm_split_kernel(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    gs_ptr,
    bias_ptr,
    M,
    K16,
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
    HAS_BIAS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    SCALES_TMA: gl.constexpr,
):
    """a [M, K] FP8 (1 x 128 tiles, inverse scales transposed: sa [cdiv(K, 128), M] float32);
    b [G, NOUT, K] FP8, K-major (128 x 128 blocks, sb [G, cdiv(NOUT, 128), cdiv(K, 128)] float32);
    bias [G, NOUT] float32 (read with HAS_BIAS); out [M, NOUT]. K = 16 * K16 and NOUT = 8 * N8 (TMA
    rows of 16 bytes); K past its end is TMA's zero fill. BM = BN = BK = 128 (one scale per tile and K
    step). ``te_scratch``: the XLA buffer holding the device-side TMA descriptors (graph-safe).
    Launched with num_warps=4 (consumer warpgroup 0: rows 0..63 of each tile), plus a 4-warp consumer
    (rows 64..127) and a 1-warp TMA producer partition. ``SCALES_TMA``: the producer also loads each
    step's A row scales into the stage (``sa_bufs``) and the consumers read them from shared memory
    instead of global memory (the same partitions; off: the measured kernel, unchanged)."""
    K = K16 * 16
    NOUT = N8 * 8
    in_dtype: gl.constexpr = a_ptr.dtype.element_ty
    out_dtype: gl.constexpr = out_ptr.dtype.element_ty
    ab_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    c_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=out_dtype.primitive_bitwidth, rank=2
    )
    a_desc = tma.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK], layout=ab_layout)
    b_desc = tma.make_tensor_descriptor(
        b_ptr, shape=[G * NOUT, K], strides=[K, 1], block_shape=[BN, BK], layout=ab_layout
    )
    out_desc = tma.make_tensor_descriptor(
        out_ptr, shape=[M, NOUT], strides=[NOUT, 1], block_shape=[BM // 2, BN], layout=c_layout
    )
    a_bufs = gl.allocate_shared_memory(in_dtype, [STAGES, BM, BK], ab_layout)
    b_bufs = gl.allocate_shared_memory(b_ptr.dtype.element_ty, [STAGES, BN, BK], ab_layout)
    c_bufs = gl.allocate_shared_memory(out_dtype, [2, BM // 2, BN], c_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrive from each consumer warpgroup
    if SCALES_TMA:
        sa_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
        n_kb = gl.cdiv(K, BK)
        sa_desc = tma.make_tensor_descriptor(sa_ptr, shape=[n_kb * M], strides=[1], block_shape=[BM], layout=sa_layout)
        sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM], sa_layout)
    else:  # constexpr None: no value passed to the partitions (the default kernel, as measured)
        sa_desc: gl.constexpr = None
        sa_bufs: gl.constexpr = None
    # fmt: off
    # (the same arguments for each partition, written out: a tuple assigned to a name would turn its
    # constexprs into tensors)
    gl.warp_specialize(
        [
            (_half_consumer0, (a_bufs, b_bufs, ready, empty, c_bufs, out_desc, out_ptr, sa_ptr, sb_ptr, bias_ptr,
                               gs_ptr, M, K, NOUT, G, num_programs, a_desc, b_desc, sa_desc, sa_bufs, BM, BN, BK,
                               STAGES, GROUP_M, BLOCK_G, HAS_BIAS, SCALES_TMA)),
            (_half_consumer1, (a_bufs, b_bufs, ready, empty, c_bufs, out_desc, out_ptr, sa_ptr, sb_ptr, bias_ptr,
                               gs_ptr, M, K, NOUT, G, num_programs, a_desc, b_desc, sa_desc, sa_bufs, BM, BN, BK,
                               STAGES, GROUP_M, BLOCK_G, HAS_BIAS, SCALES_TMA)),
            (_split_producer, (a_bufs, b_bufs, ready, empty, c_bufs, out_desc, out_ptr, sa_ptr, sb_ptr, bias_ptr,
                               gs_ptr, M, K, NOUT, G, num_programs, a_desc, b_desc, sa_desc, sa_bufs, BM, BN, BK,
                               STAGES, GROUP_M, BLOCK_G, HAS_BIAS, SCALES_TMA)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    # fmt: on
