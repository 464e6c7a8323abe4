"""Gluon (Hopper, sm_90) dual FP8 quantize: x and x^T from one read, tiles moved through shared memory
with TMA. Imported only when that kernel runs (this module imports triton).

Same contract and the same bytes as ``triton_kernels.dual_quantize_kernel`` (block 128): x [R, C]
16-bit, read once per 128 x 128 tile, written as

* q [R, C] FP8 in 1 x 128 row tiles, sinv [R, cdiv(C, 128)];
* qt [C, R] = x^T FP8 in 1 x 128 row tiles (x's 128 x 1 column tiles), sinvt [C, cdiv(R, 128)], or with
  T_SQUARE x^T in 128 x 128 blocks, sinvt [cdiv(C, 128), cdiv(R, 128)].

Built to overlap the loads with the work (the Triton kernel holds a 128 x 128 float32 tile in
registers per 4-warp program, two programs an SM, and nothing overlaps its loads with its stores):

* **Persistent.** ``num_programs`` programs (one an SM: 160 KiB of shared memory at the default
  configuration) walk the tiles in row-major order, program p taking tiles p, p + num_programs, ...
* **TMA load ring.** The 16-bit tiles go global -> shared by TMA into a ``STAGES``-deep ring
  (128-byte swizzle; two 64-column boxes a tile), one "ready" mbarrier a stage expecting the whole
  32 KiB (TMA's zero fill included). The load of tile i + STAGES is issued as soon as every warp has
  read tile i from its stage, so STAGES - 1 tiles are in flight while a tile is quantized. Rows and
  columns past R and C read as zeros, which cannot change an amax of absolute values.
* **Row tiles** (``ROW``: 16 contiguous columns a thread, 4 threads a row, conflict-free 16-byte
  shared reads): row amax (within the thread, then two shuffles), row scales, q bytes.
* **Column tiles** (``COL``: 16 consecutive rows x 2 columns a thread, a warp's threads on 64
  consecutive columns of the same rows: ``ldmatrix`` reads): column amax (within the thread, then
  across the warps), column scales (T_SQUARE: one for the tile), the bytes quantized by columns and
  transposed in registers (a relabelling), so each thread holds 16 consecutive bytes of a qt row.
* **Stores.** Both FP8 tiles go registers -> shared memory (``OUT_BUFS`` buffers of 2 x 16 KiB)
  -> global by TMA stores, which clip rows and columns past the tensor (partial tiles are exact); a
  buffer is rewritten only after the TMA stores that read it OUT_BUFS tiles ago are done reading
  (``store_wait``). The scales (128 float32 a tile and output, one with T_SQUARE) are plain stores.
  The barriers between the shared-memory writes and reads and the TMA operations (and the proxy
  fences) are the ones Triton's membar pass inserts (read in the sm_90a PTX).

One partition: the TMA loads are issued by the same warps ahead of time, so a separate producer
warp (``gl.warp_specialize``) would only move one elected thread's work; the tile's work is the
consumers' element-wise math, not waiting.

The numbers are the Triton kernel's: ``_quantize_tile`` itself (clip, NaN kept, the FP8 bytes by
``fp8_bytes``: the GPU's ``cvt.rn.satfinite`` with HW), ``_scales`` below (the Triton ``_scales``
with a Gluon ``full``, which needs a layout: the same operations in the same order: correctly rounded
division, MARGIN_MUL, FLT_MAX cap, POW2 by clearing the mantissa bits, scale 1 for a zero, Inf or
NaN amax), and the amax of ``_abs_inf`` (a NaN read as +Inf) computed as the NaN-propagating maximum
of |x| (``max.NaN``, one instruction an element) whose NaN is then read as +Inf: the same value.

TMA needs 16-byte global rows: C % 16 == 0 (x's and q's rows) and R % 16 == 0 (qt's rows); the
launcher (``te_ops.fp8.triton.dual_quantize``) sends other shapes, other blocks and float32 x to the
Triton kernel. Compiled for sm_90a only (no spills: 98 registers a thread at 16 warps, 128 with
T_SQUARE); not yet run on a GPU.
"""

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from te_ops.fp8.triton_kernels import _quantize_tile


@gluon.jit
def _scales(amax, FMAX: gl.constexpr, MARGIN_MUL: gl.constexpr, POW2: gl.constexpr):
    """``triton_kernels._scales`` in Gluon (the same operations; ``full`` takes amax's layout)."""
    ok = (amax > 0.0) & (amax < float("inf"))
    safe = gl.where(ok, amax, 1.0)
    fmax = gl.full(amax.shape, FMAX, gl.float32, amax.type.layout)
    scale = gl.minimum(gl.div_rn(fmax, safe) * MARGIN_MUL, 3.4028234663852886e38)
    if POW2:
        scale = (scale.to(gl.uint32, bitcast=True) & 0xFF800000).to(gl.float32, bitcast=True)
    return gl.where(ok, scale, 1.0)


@gluon.jit
def _max_nan(a, b):
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _amax(x, axis: gl.constexpr):
    """``max(_abs_inf(x), axis)`` (a NaN read as +Inf): the NaN-propagating maximum of |x| (one
    ``max.NaN`` an element, no select), its NaNs then set to +Inf, once per row or column."""
    m = gl.reduce(gl.abs(x), axis, _max_nan)
    return gl.where(m != m, float("inf"), m)


@gluon.jit
def _inv(scale):
    """1 / scale, correctly rounded (the Triton kernel's ``div_rn(full(1.0), scale)``)."""
    return gl.div_rn(gl.full(scale.shape, 1.0, gl.float32, scale.type.layout), scale)


@gluon.jit
def dual_quantize_tma_kernel(
    x_ptr,
    R16,
    C16,
    num_programs,
    q_ptr,
    sinv_ptr,
    qt_ptr,
    sinvt_ptr,
    te_scratch,
    B: gl.constexpr,
    STAGES: gl.constexpr,
    OUT_BUFS: gl.constexpr,
    FMAX: gl.constexpr,
    MBITS: gl.constexpr,
    EMIN: gl.constexpr,
    MARGIN_MUL: gl.constexpr,
    POW2: gl.constexpr,
    HW: gl.constexpr,
    T_SQUARE: gl.constexpr,
):
    """x [R, C] (16-bit; R = 16 * R16, C = 16 * C16: 16-byte TMA rows); q [R, C] and qt [C, R] FP8
    bytes (uint8); sinv [R, cdiv(C, B)], sinvt [C, cdiv(R, B)] (T_SQUARE: [cdiv(C, B), cdiv(R, B)])
    float32. B = 128. Grid (num_programs,), num_programs <= the number of tiles. ``te_scratch``: the
    XLA buffer holding the device-side TMA descriptors (graph-safe)."""
    R = R16 * 16
    C = C16 * 16
    NW: gl.constexpr = gl.num_warps()
    in_dtype: gl.constexpr = x_ptr.dtype.element_ty
    # rows of 16 contiguous columns a thread (4 threads a row, 8 rows a warp, the warps stacked)
    ROW: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NW, 1], [1, 0])
    # 16 consecutive rows x 2 columns a thread, a warp's threads along 64 consecutive columns, up to
    # 8 warps stacked along the rows (16 warps: two 64-column halves)
    WR: gl.constexpr = 8 if NW > 8 else NW
    COL: gl.constexpr = gl.BlockedLayout([16, 2], [1, 32], [WR, NW // WR], [0, 1])
    x_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=in_dtype.primitive_bitwidth, rank=2
    )
    q_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    x_desc = tma.make_tensor_descriptor(x_ptr, shape=[R, C], strides=[C, 1], block_shape=[B, B], layout=x_layout)
    q_desc = tma.make_tensor_descriptor(q_ptr, shape=[R, C], strides=[C, 1], block_shape=[B, B], layout=q_layout)
    qt_desc = tma.make_tensor_descriptor(qt_ptr, shape=[C, R], strides=[R, 1], block_shape=[B, B], layout=q_layout)
    x_bufs = gl.allocate_shared_memory(in_dtype, [STAGES, B, B], x_layout)
    q_bufs = gl.allocate_shared_memory(gl.uint8, [OUT_BUFS, B, B], q_layout)
    qt_bufs = gl.allocate_shared_memory(gl.uint8, [OUT_BUFS, B, B], q_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
    nbytes: gl.constexpr = B * B * in_dtype.primitive_bitwidth // 8

    pid = gl.program_id(0)
    nrb = gl.cdiv(R, B)
    ncb = gl.cdiv(C, B)
    n_mine = gl.cdiv(nrb * ncb - pid, num_programs)  # tiles pid, pid + num_programs, ...
    for j in gl.static_range(STAGES):  # the first STAGES tiles' loads
        t = pid + j * num_programs
        ok = j < n_mine
        mbarrier.expect(ready.index(j), nbytes, pred=ok)
        tma.async_copy_global_to_shared(x_desc, [(t // ncb) * B, (t % ncb) * B], ready.index(j), x_bufs.index(j),
                                        pred=ok)  # fmt: skip
    for i in range(n_mine):
        t = pid + i * num_programs
        rb = t // ncb
        cb = t % ncb
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        xs = x_bufs.index(s)

        # row tiles: q and sinv
        x = xs.load(ROW).to(gl.float32)
        srow = _scales(_amax(x, 1), FMAX, MARGIN_MUL, POW2)
        q = _quantize_tile(x, srow[:, None], FMAX, MBITS, EMIN, HW)

        # column tiles: qt (x^T's rows) and sinvt
        xc = xs.load(COL).to(gl.float32)
        cmax = _amax(xc, 0)
        if T_SQUARE:  # one scale for the tile: its amax (>= every column's)
            cmax = gl.maximum(cmax, gl.max(cmax, axis=0))
        scol = _scales(cmax, FMAX, MARGIN_MUL, POW2)
        qc = _quantize_tile(xc, scol[None, :], FMAX, MBITS, EMIN, HW)

        # every warp has read the stage: load tile i + STAGES into it
        nxt = i + STAGES
        tn = pid + nxt * num_programs
        ok = nxt < n_mine
        mbarrier.expect(ready.index(s), nbytes, pred=ok)
        tma.async_copy_global_to_shared(x_desc, [(tn // ncb) * B, (tn % ncb) * B], ready.index(s), xs, pred=ok)

        # the FP8 tiles through shared memory and TMA stores (clipped at R and C)
        ob = i % OUT_BUFS
        tma.store_wait(pendings=2 * (OUT_BUFS - 1))  # the stores of tile i - OUT_BUFS (this buffer) have read it
        q_smem = q_bufs.index(ob)
        qt_smem = qt_bufs.index(ob)
        q_smem.store(q)
        qt_smem.store(gl.permute(qc, (1, 0)))
        fence_async_shared()
        tma.async_copy_shared_to_global(q_desc, [rb * B, cb * B], q_smem)
        tma.async_copy_shared_to_global(qt_desc, [cb * B, rb * B], qt_smem)

        # the scales
        rows = rb * B + gl.arange(0, B, layout=gl.SliceLayout(1, ROW))
        gl.store(sinv_ptr + rows.to(gl.int64) * ncb + cb, _inv(srow), mask=rows < R)
        if T_SQUARE:  # sinvt [cdiv(C, B), cdiv(R, B)]
            gl.store(sinvt_ptr + cb.to(gl.int64) * nrb + rb, gl.max(_inv(scol), axis=0))
        else:  # sinvt [C, cdiv(R, B)]
            cols = cb * B + gl.arange(0, B, layout=gl.SliceLayout(0, COL))
            gl.store(sinvt_ptr + cols.to(gl.int64) * nrb + rb, _inv(scol), mask=cols < C)
    tma.store_wait(pendings=0)
