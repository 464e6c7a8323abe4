"""Gluon (Hopper) warp-specialized versions of grouped_ffn's two fused GEMMs (opt-in: an ``ffn_act`` /
``ffn_dact`` GemmConfig with ``GLUON_WS=True``; not yet measured on a GPU). Imported only when one
of them runs (this module imports triton).

Same contracts as ``triton_kernels.grouped_gemm_act_kernel`` and ``grouped_gemm_dact_kernel`` (same
runtime arguments, tile schedule over F, roundings, activation formulas: ``te_ops._core.triton_math``'s
``_act`` / ``_dact`` / ``_round_to`` with the GPU's conversions, and the zero rows past the groups),
built like ``gluon_kernels.grouped_gemm_ws_kernel``, whose schedule (``_schedule``, ``_tile``), TMA
producer warp (``_producer``) and consumer mainloop (``_mma_k_loop``) they reuse:

* **Producer** (one warp, ``PRODUCER_REGS`` registers: the launcher's ``FFN_PRODUCER_REGS``, 32):
  per K step the A tile ``[BM, BK]`` and the B tile(s) into a ``STAGES``-deep ring on one "ready"
  mbarrier. Act, gated: two B tiles ``[BK, BN]`` of
  ``wi[g]`` seen as ``[G * KC, W]``, at columns ``nt * BN`` (activation half) and ``F + nt * BN``
  (linear half). Past F the activation tile reads linear columns and the linear tile TMA's zero
  fill: column j of a product depends only on column j of B, and those columns are not stored.
  Dact: the B tile ``[BN, BK]`` of ``wo`` seen as ``[G * F, KC]``, read transposed (as dx).
* **Consumers** (two warpgroups, ``num_warps=8``): asynchronous wgmma per stage, the stage handed back
  once the wgmma that read it has retired (the ws kernel's arithmetic). Act, gated: two ``[BM, BN]``
  float32 accumulators (activation and linear half; 2 x 64 registers a thread at 128 x 128, the
  plain kernel's 128 x 256 tile).
* **Act epilogue**: ``z = round(acc)`` (h as stored), ``y = round(act(z) [* u])``. Whole tiles (all
  rows in the group, all columns below F) go out through two ``[BM, BN]`` shared-memory buffers and
  TMA stores (h's two halves, then act in the first buffer once its h store has read it); the last
  partial tile of a group and the zero tiles past the groups use masked stores, so no row of
  another group is ever written.
* **Dact epilogue**: the consumer TMA-loads the tile's h (both halves gated) into the two epilogue
  buffers at the start of the tile (on its own mbarrier, under the mainloop), reads it after the
  mainloop, and writes dh into the same buffers and out by TMA store (whole tiles) or a masked store.
  Zero tiles get da = 0 and the h values as the Triton kernel loads them (rows past M: zero).

Shared memory (bf16, BM = 128, BN = 128, BK = 64): act gated 3 stages x 48 KB + 64 KB = 208 KB
(4 stages do not fit: the launcher lowers STAGES to what fits); dact 3 x 32 KB + 64 KB.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from te_ops._core.triton_math import _act, _dact, _round_to
from te_ops.grouped_dense.gluon_kernels import _mma_k_loop, _producer, _schedule, _tile


@gluon.jit
def _dact_g(d, z, ACT: gl.constexpr):
    """triton_math._dact (d * act'(z)); for ACT 0 (act' = 1) written out, as _act_grad's tl.full has no
    Gluon layout."""
    if ACT == 0:
        r = d * 1.0
    else:
        r = _dact(d, z, ACT)
    return r


# ------------------------------------------------------------------------------------------------
# Act GEMM: h = a @ wi[g], act = act(h) (gated: act(h[:, :F]) * h[:, F:])
# ------------------------------------------------------------------------------------------------


@gluon.jit
def _act_consumer(
    a_bufs,
    b_bufs,
    bu_bufs,
    ready,
    empty,
    c_bufs,
    h_desc,
    act_desc,
    h_ptr,
    act_ptr,
    gs_ptr,
    M,
    KC,
    F,
    G,
    num_programs,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    ACT: gl.constexpr,
    GATED: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BN, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    dt: gl.constexpr = h_desc.dtype
    W = 2 * F if GATED else F
    sched, total = _schedule(gs_ptr, G, M, F, BM, BN, BLOCK_G, layout)
    k_iters = gl.cdiv(KC, BK)
    it = 0
    for t in range(gl.program_id(0), total, num_programs):
        in_group, g, row, row_end, nt = _tile(t, sched, G, M, BM, GROUP_M)
        acc = gl.zeros([BM, BN], gl.float32, mma_layout)
        if GATED:
            acc_u = gl.zeros([BM, BN], gl.float32, mma_layout)
        if in_group:
            if GATED:  # the linear half's wgmma beside the activation half's, on the same stage
                acc, acc_u, it = _mma_k_loop(a_bufs, b_bufs, ready, empty, it, acc, acc_u, k_iters, STAGES, False,
                                             bu_bufs, True)  # fmt: skip
            else:
                acc, it = _mma_k_loop(a_bufs, b_bufs, ready, empty, it, acc, None, k_iters, STAGES, False)
        # the Triton kernel's epilogue: h rounded to its dtype, the activation from the rounded values
        z = _round_to(acc, dt, True)
        y = _act(z, ACT)
        if GATED:
            u = _round_to(acc_u, dt, True)
            y = y * u
        y = _round_to(y, dt, True)
        if in_group & (row + BM <= row_end) & (nt * BN + BN <= F):
            tma.store_wait(pendings=0)  # the previous tile's stores have read c_bufs
            c_bufs.index(0).store(z.to(dt))
            if GATED:
                c_bufs.index(1).store(u.to(dt))
                fence_async_shared()
                tma.async_copy_shared_to_global(h_desc, [row, nt * BN], c_bufs.index(0))
                tma.async_copy_shared_to_global(h_desc, [row, F + nt * BN], c_bufs.index(1))
                tma.store_wait(pendings=1)  # the activation half's store has read c_bufs[0]
                c_bufs.index(0).store(y.to(dt))
                fence_async_shared()
                tma.async_copy_shared_to_global(act_desc, [row, nt * BN], c_bufs.index(0))
            else:
                c_bufs.index(1).store(y.to(dt))
                fence_async_shared()
                tma.async_copy_shared_to_global(h_desc, [row, nt * BN], c_bufs.index(0))
                tma.async_copy_shared_to_global(act_desc, [row, nt * BN], c_bufs.index(1))
        else:
            rows = row + gl.arange(0, BM, layout=row_layout)
            cols = nt * BN + gl.arange(0, BN, layout=col_layout)
            mask = (rows < row_end)[:, None] & (cols < F)[None, :]
            h_ptrs = h_ptr + rows.to(gl.int64)[:, None] * W + cols[None, :]
            gl.store(h_ptrs, z.to(dt), mask=mask)
            if GATED:
                gl.store(h_ptrs + F, u.to(dt), mask=mask)
            gl.store(act_ptr + rows.to(gl.int64)[:, None] * F + cols[None, :], y.to(dt), mask=mask)
    tma.store_wait(pendings=0)


@gluon.jit
def _act_producer(
    a_bufs,
    b_bufs,
    bu_bufs,
    ready,
    empty,
    c_bufs,
    a_desc,
    b_desc,
    gs_ptr,
    M,
    KC,
    F,
    G,
    num_programs,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    GATED: gl.constexpr,
):
    # gated: the activation half's B tile and the linear half's, F columns to the right, on one barrier
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
        F,
        G,
        num_programs,
        BM,
        BN,
        BK,
        STAGES,
        GROUP_M,
        BLOCK_G,
        False,
        b2_bufs=bu_bufs,
        DUAL_B=GATED,
    )


@gluon.jit
def grouped_gemm_act_ws_kernel(
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
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    ACT: gl.constexpr,
    GATED: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    """a: [M, KC]; b: [G, KC, W] (W = 2F gated, else F); h: [M, W]; act: [M, F]. KC must be a multiple
    of BK; KC and F multiples of 8 (16-byte rows for TMA). ``te_scratch``: the XLA buffer holding the
    four device-side TMA descriptors (a, b, h, act). ACT: triton.ACT_CODES (0, 3 or 4)."""
    KC = KC8 * 8
    F = F8 * 8
    W = 2 * F if GATED else F
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=dtype.primitive_bitwidth, rank=2
    )
    a_desc = tma.make_tensor_descriptor(a_ptr, shape=[M, KC], strides=[KC, 1], block_shape=[BM, BK], layout=smem_layout)
    b_desc = tma.make_tensor_descriptor(
        b_ptr, shape=[G * KC, W], strides=[W, 1], block_shape=[BK, BN], layout=smem_layout
    )
    h_desc = tma.make_tensor_descriptor(h_ptr, shape=[M, W], strides=[W, 1], block_shape=[BM, BN], layout=smem_layout)
    act_desc = tma.make_tensor_descriptor(
        act_ptr, shape=[M, F], strides=[F, 1], block_shape=[BM, BN], layout=smem_layout
    )
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], smem_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], smem_layout)
    if GATED:
        bu_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], smem_layout)
    else:
        bu_bufs: gl.constexpr = None
    c_bufs = gl.allocate_shared_memory(dtype, [2, BM, BN], smem_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    # fmt: off
    # (the arguments written out per partition: a tuple assigned to a name would turn its constexprs
    # into tensors)
    gl.warp_specialize(
        [
            (_act_consumer, (a_bufs, b_bufs, bu_bufs, ready, empty, c_bufs, h_desc, act_desc, h_ptr, act_ptr, gs_ptr,
                             M, KC, F, G, num_programs, BM, BN, BK, STAGES, GROUP_M, BLOCK_G, ACT, GATED, NUM_WARPS)),
            (_act_producer, (a_bufs, b_bufs, bu_bufs, ready, empty, c_bufs, a_desc, b_desc, gs_ptr, M, KC, F, G,
                             num_programs, BM, BN, BK, STAGES, GROUP_M, BLOCK_G, GATED)),
        ],
        [1],
        [PRODUCER_REGS],
    )
    # fmt: on


# ------------------------------------------------------------------------------------------------
# Dact GEMM: da = a @ wo[g]^T, dh = the activation's gradient at h (da rounded first)
# ------------------------------------------------------------------------------------------------


@gluon.jit
def _dact_consumer(
    a_bufs,
    b_bufs,
    ready,
    empty,
    e_bufs,
    hbar,
    h_desc,
    dh_desc,
    dh_ptr,
    gs_ptr,
    M,
    KC,
    F,
    G,
    num_programs,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    ACT: gl.constexpr,
    GATED: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BN, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    dt: gl.constexpr = dh_desc.dtype
    h_bytes: gl.constexpr = (2 if GATED else 1) * BM * BN * dt.primitive_bitwidth // 8
    W = 2 * F if GATED else F
    sched, total = _schedule(gs_ptr, G, M, F, BM, BN, BLOCK_G, layout)
    k_iters = gl.cdiv(KC, BK)
    it = 0  # ring position (K steps of group tiles)
    j = 0  # tiles of this program: the phase of hbar
    for t in range(gl.program_id(0), total, num_programs):
        in_group, g, row, row_end, nt = _tile(t, sched, G, M, BM, GROUP_M)
        # this tile's h into the epilogue buffers while the mainloop runs (the previous tile's dh
        # stores have read them; rows past M are TMA's zero fill, as the Triton kernel's masked load)
        tma.store_wait(pendings=0)
        mbarrier.expect(hbar, h_bytes)
        tma.async_copy_global_to_shared(h_desc, [row, nt * BN], hbar, e_bufs.index(0))
        if GATED:
            tma.async_copy_global_to_shared(h_desc, [row, F + nt * BN], hbar, e_bufs.index(1))
        acc = gl.zeros([BM, BN], gl.float32, mma_layout)
        if in_group:
            acc, it = _mma_k_loop(a_bufs, b_bufs, ready, empty, it, acc, None, k_iters, STAGES, True)
        # the Triton kernel's epilogue: da rounded to h's dtype, the gradient in float32, rounded
        da = _round_to(acc, dt, True)
        mbarrier.wait(hbar, j & 1)
        z = e_bufs.index(0).load(mma_layout).to(gl.float32)
        if GATED:
            u = e_bufs.index(1).load(mma_layout).to(gl.float32)
            d_lin = _round_to(da * _act(z, ACT), dt, True).to(dt)
            d_act = _round_to(_dact_g(da * u, z, ACT), dt, True).to(dt)
        else:
            d_act = _round_to(_dact_g(da, z, ACT), dt, True).to(dt)
        if in_group & (row + BM <= row_end) & (nt * BN + BN <= F):
            e_bufs.index(0).store(d_act)
            if GATED:
                e_bufs.index(1).store(d_lin)
            fence_async_shared()
            tma.async_copy_shared_to_global(dh_desc, [row, nt * BN], e_bufs.index(0))
            if GATED:
                tma.async_copy_shared_to_global(dh_desc, [row, F + nt * BN], e_bufs.index(1))
        else:
            rows = row + gl.arange(0, BM, layout=row_layout)
            cols = nt * BN + gl.arange(0, BN, layout=col_layout)
            mask = (rows < row_end)[:, None] & (cols < F)[None, :]
            ptrs = dh_ptr + rows.to(gl.int64)[:, None] * W + cols[None, :]
            gl.store(ptrs, d_act, mask=mask)
            if GATED:
                gl.store(ptrs + F, d_lin, mask=mask)
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _dact_producer(
    a_bufs,
    b_bufs,
    ready,
    empty,
    e_bufs,
    hbar,
    a_desc,
    b_desc,
    gs_ptr,
    M,
    KC,
    F,
    G,
    num_programs,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
):
    # the dx kernel's producer: B = wo as [G * F, KC], read transposed
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
        F,
        G,
        num_programs,
        BM,
        BN,
        BK,
        STAGES,
        GROUP_M,
        BLOCK_G,
        True,
    )


@gluon.jit
def grouped_gemm_dact_ws_kernel(
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
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    ACT: gl.constexpr,
    GATED: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    """a (dy): [M, KC]; b (wo): [G, F, KC], read transposed; h, dh: [M, W] (W = 2F gated, else F).
    KC must be a multiple of BK; KC and F multiples of 8. ``te_scratch``: the four device-side TMA
    descriptors (a, b, h, dh). ACT: triton.ACT_CODES (0, 3 or 4)."""
    KC = KC8 * 8
    F = F8 * 8
    W = 2 * F if GATED else F
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=dtype.primitive_bitwidth, rank=2
    )
    a_desc = tma.make_tensor_descriptor(a_ptr, shape=[M, KC], strides=[KC, 1], block_shape=[BM, BK], layout=smem_layout)
    b_desc = tma.make_tensor_descriptor(
        b_ptr, shape=[G * F, KC], strides=[KC, 1], block_shape=[BN, BK], layout=smem_layout
    )
    h_desc = tma.make_tensor_descriptor(h_ptr, shape=[M, W], strides=[W, 1], block_shape=[BM, BN], layout=smem_layout)
    dh_desc = tma.make_tensor_descriptor(dh_ptr, shape=[M, W], strides=[W, 1], block_shape=[BM, BN], layout=smem_layout)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], smem_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], smem_layout)
    e_bufs = gl.allocate_shared_memory(dtype, [2 if GATED else 1, BM, BN], smem_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    hbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(hbar, count=1)
    # fmt: off
    gl.warp_specialize(
        [
            (_dact_consumer, (a_bufs, b_bufs, ready, empty, e_bufs, hbar, h_desc, dh_desc, dh_ptr, gs_ptr, M, KC, F,
                              G, num_programs, BM, BN, BK, STAGES, GROUP_M, BLOCK_G, ACT, GATED, NUM_WARPS)),
            (_dact_producer, (a_bufs, b_bufs, ready, empty, e_bufs, hbar, a_desc, b_desc, gs_ptr, M, KC, F, G,
                              num_programs, BM, BN, BK, STAGES, GROUP_M, BLOCK_G)),
        ],
        [1],
        [PRODUCER_REGS],
    )
    # fmt: on
