"""Gluon versions of the two hot data-movement kernels (token_dispatch's row scatter and
token_combine's weighted gather), for Hopper. Imported only when implementation="gluon" runs.

Same parameter lists as ``triton_kernels.dispatch_kernel`` / ``combine_kernel`` (plus NUM_WARPS), so
the launch code is shared. Differences from the Triton versions: the register layout is explicit
(each thread owns VEC contiguous elements = 16-byte accesses, warps tile the hidden axis), and
each program handles TOKENS tokens so short hidden sizes still give every warp full vectors.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def dispatch_kernel(
    x_ptr,
    map_ptr,
    out_ptr,
    T,
    E,
    H,
    BLOCK_H: gl.constexpr,
    VEC: gl.constexpr,
    TOKENS: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    layout: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[VEC], threads_per_warp=[32], warps_per_cta=[NUM_WARPS], order=[0]
    )
    W = 2 * E + 1
    for i in range(TOKENS):
        t = gl.program_id(0).to(gl.int64) * TOKENS + i
        if t < T:
            n = gl.load(map_ptr + t * W + 2 * E)
            for h0 in range(0, H, BLOCK_H):
                hh = h0 + gl.arange(0, BLOCK_H, layout=layout)
                hm = hh < H
                v = gl.load(x_ptr + t * H + hh, mask=hm)
                for k in range(n):
                    row = gl.load(map_ptr + t * W + k).to(gl.int64)
                    gl.store(out_ptr + row * H + hh, v, mask=hm)


@gluon.jit
def combine_kernel(
    y_ptr,
    map_ptr,
    mp_ptr,
    T,
    E,
    H,
    out_ptr,
    BLOCK_H: gl.constexpr,
    VEC: gl.constexpr,
    TOKENS: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    HAS_PROBS: gl.constexpr,
):
    layout: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[VEC], threads_per_warp=[32], warps_per_cta=[NUM_WARPS], order=[0]
    )
    W = 2 * E + 1
    for i in range(TOKENS):
        t = gl.program_id(0).to(gl.int64) * TOKENS + i
        if t < T:
            n = gl.load(map_ptr + t * W + 2 * E)
            for h0 in range(0, H, BLOCK_H):
                hh = h0 + gl.arange(0, BLOCK_H, layout=layout)
                hm = hh < H
                acc = gl.zeros([BLOCK_H], gl.float32, layout)
                for k in range(0, n, 2):  # two independent row loads in flight per step
                    has1 = k + 1 < n
                    row0 = gl.load(map_ptr + t * W + k).to(gl.int64)
                    row1 = gl.load(map_ptr + t * W + k + 1, mask=has1, other=0).to(gl.int64)
                    v0 = gl.load(y_ptr + row0 * H + hh, mask=hm, other=0.0).to(gl.float32)
                    v1 = gl.load(y_ptr + row1 * H + hh, mask=hm & has1, other=0.0).to(gl.float32)
                    if HAS_PROBS:
                        e0 = gl.load(map_ptr + t * W + E + k)
                        e1 = gl.load(map_ptr + t * W + E + k + 1, mask=has1, other=0)
                        v0 = v0 * gl.load(mp_ptr + t * E + e0).to(gl.float32)
                        v1 = v1 * gl.load(mp_ptr + t * E + e1, mask=has1, other=0.0).to(gl.float32)
                    acc += v0 + v1
                gl.store(out_ptr + t * H + hh, acc.to(out_ptr.dtype.element_ty), mask=hm)
