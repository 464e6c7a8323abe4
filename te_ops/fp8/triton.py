"""Triton implementation of FP8 block quantization (kernels in ``triton_kernels.py``), launched
through our Triton bridge. Same results as :func:`te_ops.fp8.reference.quantize_blocks`, byte for
byte (tests/te_ops/test_fp8.py runs the kernel under Triton's interpreter on the CPU).

Status: correct under the interpreter; not yet run on a GPU, so :func:`te_ops.fp8.quantize` does not
route to it yet (it will, as a registered implementation, once the GPU tests and the bandwidth
benchmark have run).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np

from te_ops._core import triton_bridge as tb
from te_ops.fp8 import sharding
from te_ops.fp8.recipes import E4M3, E5M2, format_max
from te_ops.fp8.reference import QuantizedTensor
from te_ops.grouped_dense.triton import ACT_CODES, FFN_FUSED_ACTIVATIONS

SDS = jax.ShapeDtypeStruct
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# (mantissa bits, smallest normal exponent) of each format
FORMAT_BITS = {E4M3: (3, -6), E5M2: (2, -14)}
ROWS_PER_PROGRAM = 32  # rows of (1 x BC) blocks a program quantizes together
# Launch the kernels through their sharding rules (te_ops.fp8.sharding). The CPU interpreter harness
# (tests/te_ops/_triton_interpret.py runs kernels eagerly on concrete arrays) turns this off.
PARTITION = True


def _k():
    from te_ops.fp8 import triton_kernels

    return triton_kernels


def _is_pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def _quant_constexprs(fmt, power_of_2: bool, margin: int = 0) -> dict:
    """The rounding constants every quantize kernel takes: the format's max, mantissa bits and
    minimum exponent, the margin's factor, power-of-2 scales, the hardware conversion."""
    mbits, emin = FORMAT_BITS[jnp.dtype(fmt)]
    return dict(FMAX=format_max(fmt), MBITS=mbits, EMIN=emin, MARGIN_MUL=2.0**-margin, POW2=bool(power_of_2),
                HW=tb.hardware_conversions())  # fmt: skip


def unsupported_reason(*, dtype=None, block=None, fmt=None, **_) -> str | None:
    if dtype is not None and jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"the Triton FP8 quantize kernel takes float32, bfloat16 or float16, got {jnp.dtype(dtype)}"
    if block is not None and not (all(_is_pow2(v) for v in block) and block[0] * block[1] <= 128 * 128):
        return f"the Triton FP8 quantize kernel needs power-of-two blocks of at most 128 x 128 elements, got {block}"
    if fmt is not None and jnp.dtype(fmt) not in FORMAT_BITS:
        return f"unknown FP8 format {fmt}"
    return None


def block_quantize(x: jax.Array, block: tuple[int, int], fmt, *, power_of_2: bool, margin: int = 0) -> QuantizedTensor:
    """Block scaling of the last two axes of ``x`` (rank >= 2) in one pass over ``x`` (sharded: each
    shard quantizes its whole blocks, :mod:`te_ops.fp8.sharding`)."""
    fmt = jnp.dtype(fmt)
    if x.size == 0:
        return _block_quantize_local(x, tuple(block), fmt, power_of_2, margin)
    q, sinv = _sharded_block_quantize(tuple(block), fmt, bool(power_of_2), margin, PARTITION)(x)
    return QuantizedTensor(q, sinv, tuple(block), jnp.dtype(x.dtype))


@functools.cache
def _sharded_block_quantize(block, fmt, power_of_2, margin, partition):
    def local(x):
        q = _block_quantize_local(x, block, fmt, power_of_2, margin)
        return q.data, q.scale_inv

    return sharding.block_quantize(local, block) if partition else local


def _block_quantize_local(x, block, fmt, power_of_2, margin) -> QuantizedTensor:
    fmt = jnp.dtype(fmt)
    shape = x.shape
    r, c = shape[-2:]
    b = math.prod(shape[:-2])
    br, bc = block
    nrb, ncb = -(-r // br), -(-c // bc)
    nb = max(1, ROWS_PER_PROGRAM // br)
    if b * r * c == 0:
        return QuantizedTensor(
            jnp.zeros(shape, fmt), jnp.ones(shape[:-2] + (nrb, ncb), jnp.float32), tuple(block), jnp.dtype(x.dtype)
        )
    q, sinv = tb.triton_call(
        _k().block_quantize_kernel,
        x.reshape(b, r, c),
        np.int32(r),
        np.int32(c),
        out_shape=[SDS((b, r, c), jnp.uint8), SDS((b, nrb, ncb), jnp.float32)],
        grid=(b, -(-nrb // nb), ncb),
        constexprs=dict(
            BR=br,
            BC=bc,
            NB=nb,
            **_quant_constexprs(fmt, power_of_2, margin),
        ),
        num_warps=4,
        divisible_by_16=("C",) if c % 16 == 0 else (),  # lets Triton vectorise the row accesses
        name="te_fp8_block_quantize",
    )
    q = jax.lax.bitcast_convert_type(q, fmt)  # the kernel writes the FP8 bytes
    return QuantizedTensor(q.reshape(shape), sinv.reshape(shape[:-2] + (nrb, ncb)), tuple(block), jnp.dtype(x.dtype))


# warps of the 128 x 128-tile fused activation-backward quantize kernel (dact_dbias_quantize)
QUANT_TILE_WARPS = 8
# warps of the 128 x 128-tile dual quantize kernel. Fewer warps, more programs per SM, more loads in
# flight: H100, 2026-12-06 (benchmarks/fp8.py quant, 16384x7168 bf16, commit 71c09b3): 4 warps
# 0.389 ms (1.23 TB/s), 8 warps 0.577 ms, 16 warps 0.646 ms (0.74 TB/s); the persistent variants
# 0.74-1.18 ms (that variant, a persistent loop with loads pipelined across tiles, was removed).
# At 4 warps ptxas spills 208 bytes a thread (484 with square x^T blocks; sm_90a, Triton 3.6); 8 warps
# does not spill.
DUAL_TILE_WARPS = 4
# where the transposed output is transposed: the input tile (16-bit lanes) or the FP8 bytes; timed in
# benchmarks/fp8.py
DUAL_TRANS_WIDE = False
# The dual quantize kernel: "triton" (dual_quantize_kernel above, one 128 x 128 tile a program) or
# "gluon" (te_ops/fp8/gluon_quantize.py: persistent, a TMA load ring of the bf16 tiles, both FP8
# tiles out through shared memory and TMA stores; the same bytes) where it applies: Gluon, an sm_90
# target, block 128, 16-bit x, R and C multiples of 16 (16-byte TMA rows; gluon_dual_unavailable_reason);
# elsewhere the Triton kernel. Both trans_wide settings give the same bytes, so the Gluon kernel takes
# either. Not yet run on a GPU, so "triton". Read at trace time and part of the cached callable's key.
DUAL_KERNEL = "triton"
# (STAGES, num_warps, FP8 output buffers) of the Gluon dual quantize: 3 x 32 KiB bf16 stages + 2 x 2
# x 16 KiB FP8 tiles = 160 KiB of shared memory, one program an SM; 16 warps: 98 registers a thread
# (128 with t_square), no spills (sm_90a, Triton 3.6; 8 warps: 247). Unmeasured; benchmarks/fp8.py
# times a few settings.
GLUON_DUAL_CONFIG = (3, 16, 2)


def gluon_dual_unavailable_reason(
    r: int | None = None, c: int | None = None, dtype=None, block: int = 128
) -> str | None:
    """Why the Gluon dual quantize cannot take this call (None if it can)."""
    from te_ops.grouped_dense import triton as gd

    why = gd.gluon_ws_unavailable_reason()  # Gluon and an sm_90 target
    if why:
        return why
    if block != 128:
        return f"the Gluon dual quantize takes block 128, got {block}"
    if dtype is not None and jnp.dtype(dtype).itemsize != 2:
        return f"the Gluon dual quantize takes a 16-bit x (bfloat16 or float16), got {jnp.dtype(dtype)}"
    if r is not None and c is not None and (r * c == 0 or r % 16 or c % 16):
        return f"the Gluon dual quantize needs R and C multiples of 16 (16-byte TMA rows of q and q^T), got {r}x{c}"
    return None


def dual_quantize(
    x: jax.Array,
    block: int,
    fmt,
    *,
    power_of_2: bool,
    margin: int = 0,
    trans_wide: bool | None = None,
    t_square: bool = False,
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``x [R, C]`` quantized in 1 x ``block`` row tiles and, from the same read, ``x^T [C, R]`` in
    1 x ``block`` row tiles (x's block x 1 column tiles): the forward and the weight-gradient operand
    of a block-scaled GEMM. Equal to ``reference.quantize_blocks(x, (1, block))`` and
    ``reference.quantize_blocks(x.T, (1, block))``; with ``t_square``, the second is x^T in
    ``block x block`` blocks, ``reference.quantize_blocks(x.T, (block, block))`` (the output
    gradient's operand of a weight-gradient GEMM)."""
    fmt = jnp.dtype(fmt)
    wide = DUAL_TRANS_WIDE if trans_wide is None else bool(trans_wide)
    if x.size == 0:
        return _dual_quantize_local(x, block, fmt, power_of_2, margin, wide, bool(t_square))
    # the kernel settings are read when the sharded callable traces: part of its cache key
    tuning = (DUAL_TILE_WARPS, DUAL_KERNEL, tuple(GLUON_DUAL_CONFIG))
    q, s, qt, st = _sharded_dual_quantize(block, fmt, bool(power_of_2), margin, PARTITION, wide, bool(t_square),
                                          tuning)(x)  # fmt: skip
    return (
        QuantizedTensor(q, s, (1, block), jnp.dtype(x.dtype)),
        QuantizedTensor(qt, st, (block, block) if t_square else (1, block), jnp.dtype(x.dtype)),
    )


@functools.cache
def _sharded_dual_quantize(block, fmt, power_of_2, margin, partition, wide=False, t_square=False, tuning=None):
    _, kernel, gcfg = tuning if tuning is not None and len(tuning) == 3 else (None, "triton", GLUON_DUAL_CONFIG)

    def local(x):
        # the Gluon kernel where it takes this shard (shapes known here, at trace time), else Triton's
        if kernel == "gluon" and gluon_dual_unavailable_reason(*x.shape, x.dtype, block) is None:
            a, b = _gluon_dual_quantize_local(x, fmt, power_of_2, margin, t_square, gcfg)
        else:
            a, b = _dual_quantize_local(x, block, fmt, power_of_2, margin, wide, t_square)
        return a.data, a.scale_inv, b.data, b.scale_inv

    return sharding.dual_quantize(local, block, t_square) if partition else local


def _dual_outputs(r: int, c: int, block: int, t_square: bool) -> list:
    """The output shapes of both dual quantize kernels: q [R, C] and q^T [C, R] bytes, sinv
    [R, cdiv(C, block)] and sinvt ([C, cdiv(R, block)], t_square: [cdiv(C, block), cdiv(R, block)])."""
    nrb, ncb = -(-r // block), -(-c // block)
    st_shape = (ncb, nrb) if t_square else (c, nrb)
    return [SDS((r, c), jnp.uint8), SDS((r, ncb), jnp.float32), SDS((c, r), jnp.uint8), SDS(st_shape, jnp.float32)]


def _dual_result(x, fmt, block: int, t_square: bool, q, sinv, qt, sinvt) -> tuple[QuantizedTensor, QuantizedTensor]:
    """A dual quantize kernel's outputs (bytes) as the two QuantizedTensors of ``x``."""
    cast = lambda a: jax.lax.bitcast_convert_type(a, fmt)  # noqa: E731
    return (
        QuantizedTensor(cast(q), sinv, (1, block), jnp.dtype(x.dtype)),
        QuantizedTensor(cast(qt), sinvt, (block, block) if t_square else (1, block), jnp.dtype(x.dtype)),
    )


def _dual_quantize_local(x, block, fmt, power_of_2, margin, wide=False, t_square=False):
    r, c = x.shape
    nrb, ncb = -(-r // block), -(-c // block)
    if r * c == 0:
        zeros = [jnp.zeros(o.shape, jnp.uint8) if o.dtype == jnp.uint8 else jnp.ones(o.shape, jnp.float32)
                 for o in _dual_outputs(r, c, block, t_square)]  # fmt: skip
        return _dual_result(x, fmt, block, t_square, *zeros)
    outs = tb.triton_call(
        _k().dual_quantize_kernel,
        x,
        np.int32(r),
        np.int32(c),
        out_shape=_dual_outputs(r, c, block, t_square),
        grid=(nrb, ncb),
        constexprs=dict(
            B=block,
            **_quant_constexprs(fmt, power_of_2, margin),
            TRANS_WIDE=bool(wide),
            T_SQUARE=bool(t_square),
        ),
        num_warps=DUAL_TILE_WARPS,
        divisible_by_16=tuple(n for n, v in (("R", r), ("C", c)) if v % 16 == 0),
        name="te_fp8_dual_quantize",
    )
    return _dual_result(x, fmt, block, t_square, *outs)


def requantize_t(q: QuantizedTensor, fmt, *, power_of_2: bool, margin: int = 0) -> QuantizedTensor:
    """``q`` (FP8 [R, C] in 1 x ``b`` row tiles) dequantized in float32 and quantized again
    transposed: ``[C, R]`` in 1 x ``b`` row tiles (q's b x 1 column tiles). Equal, byte for byte, to
    ``reference.quantize_blocks(reference.dequantize(q, float32).T, (1, b), fmt)``, from one read of
    the FP8 bytes (no float32 copy in memory). The weight-gradient operand of FP8 rows that have no
    high-precision copy (the dispatched tokens of :mod:`te_ops.fp8.dispatch`)."""
    if q.block is None or q.block[0] != 1 or q.data.ndim != 2:
        raise ValueError(f"requantize_t takes a 2-D tensor in 1 x b row tiles, got shape {q.data.shape} "
                         f"block {q.block}")  # fmt: skip
    fmt = jnp.dtype(fmt)
    block = q.block[1]
    data = jax.lax.bitcast_convert_type(q.data, jnp.uint8)
    if data.size == 0:
        qt, st = _requantize_t_local(data, q.scale_inv, jnp.dtype(q.data.dtype), block, fmt, power_of_2, margin)
    else:
        fn = _sharded_requantize_t(jnp.dtype(q.data.dtype), block, fmt, bool(power_of_2), margin, PARTITION)
        qt, st = fn(data, q.scale_inv)
    # the tensor quantized is the float32 dequantization (its dtype, as the reference's)
    return QuantizedTensor(jax.lax.bitcast_convert_type(qt, fmt), st, (1, block), jnp.dtype(jnp.float32))


@functools.cache
def _sharded_requantize_t(in_fmt, block, fmt, power_of_2, margin, partition):
    def local(data, sinv):
        return _requantize_t_local(data, sinv, in_fmt, block, fmt, power_of_2, margin)

    return sharding.requantize_t(local, block) if partition else local


def _requantize_t_local(data, sinv, in_fmt, block, fmt, power_of_2, margin):
    """data [R, C] uint8 (FP8 bytes of ``in_fmt``), sinv [R, cdiv(C, block)] -> (qt [C, R] uint8,
    sinvt [C, cdiv(R, block)])."""
    r, c = data.shape
    nrb = -(-r // block)
    if r * c == 0:
        return jnp.zeros((c, r), jnp.uint8), jnp.ones((c, nrb), jnp.float32)
    in_mbits, in_emin = FORMAT_BITS[jnp.dtype(in_fmt)]
    return tb.triton_call(
        _k().requantize_t_kernel,
        data,
        sinv,
        np.int32(r),
        np.int32(c),
        out_shape=[SDS((c, r), jnp.uint8), SDS((c, nrb), jnp.float32)],
        grid=(nrb, -(-c // block)),
        constexprs=dict(B=block, **_quant_constexprs(fmt, power_of_2, margin), IN_MBITS=in_mbits, IN_EMIN=in_emin),
        num_warps=DUAL_TILE_WARPS,
        divisible_by_16=tuple(n for n, v in (("R", r), ("C", c)) if v % 16 == 0),
        name="te_fp8_requantize_t",
    )


def _gluon_dual_quantize_local(x, fmt, power_of_2, margin, t_square, gcfg):
    """The Gluon dual quantize (block 128) of x [R, C] (R, C multiples of 16, 16-bit): one persistent
    program an SM (gluon_quantize.py)."""
    from te_ops.fp8 import gluon_quantize
    from te_ops.grouped_dense import triton as gd

    stages, warps, out_bufs = (int(v) for v in gcfg)
    r, c = x.shape
    block = 128
    grid = max(1, min(gd.num_sms(), -(-r // block) * -(-c // block)))
    outs = tb.triton_call(
        gluon_quantize.dual_quantize_tma_kernel,
        x,
        np.int32(r // 16),
        np.int32(c // 16),
        np.int32(grid),
        out_shape=_dual_outputs(r, c, block, t_square),
        grid=(grid,),
        constexprs=dict(
            B=block,
            STAGES=stages,
            OUT_BUFS=out_bufs,
            **_quant_constexprs(fmt, power_of_2, margin),
            T_SQUARE=bool(t_square),
        ),
        num_warps=warps,
        num_stages=1,
        scratch_bytes_per_program=gd.TMA_SCRATCH_BYTES,  # 3 device-side TMA descriptors (x, q, q^T)
        name="te_fp8_dual_quantize_tma",
    )
    return _dual_result(x, fmt, block, t_square, *outs)


def dact_dbias_quantize(
    dy: jax.Array, z: jax.Array, activation, block: int, fmt, *, power_of_2: bool
) -> tuple[QuantizedTensor, QuantizedTensor, jax.Array]:
    """One read of ``dy`` and ``z`` [M, N]: ``dz = dy * act'(z)`` in float32, written as dz in 1 x
    ``block`` row tiles and dz^T in ``block x block`` blocks (the dgrad and wgrad operands of the
    GEMMs behind ``z``), and ``dbias = sum of dz over rows`` (float32 column sums per row block,
    added up in float32; in dy's dtype). Equal to ``reference.dact_dbias_quantize`` up to the
    activation derivative's last-ulp rounding (bit for bit for ReLU and None)."""
    fmt = jnp.dtype(fmt)
    local = _sharded_dact(ACT_CODES[activation], block, fmt, bool(power_of_2), PARTITION, QUANT_TILE_WARPS)
    q, s, qt, st, dbp = local(dy, z)
    dt = jnp.dtype(dy.dtype)
    return (
        QuantizedTensor(q, s, (1, block), dt),
        QuantizedTensor(qt, st, (block, block), dt),
        jnp.sum(dbp, axis=0).astype(dt),
    )


@functools.cache
def _sharded_dact(act, block, fmt, power_of_2, partition, warps=None):  # warps: read at trace time, keyed
    def local(dy, z):
        return _dact_local(dy, z, act, block, fmt, power_of_2)

    return sharding.dact_dbias_quantize(local, block) if partition else local


def _dact_local(dy, z, act, block, fmt, power_of_2):
    r, c = dy.shape
    nrb, ncb = -(-r // block), -(-c // block)
    if r * c == 0:
        return (jnp.zeros((r, c), fmt), jnp.ones((r, ncb), jnp.float32), jnp.zeros((c, r), fmt),
                jnp.ones((ncb, nrb), jnp.float32), jnp.zeros((nrb, c), jnp.float32))  # fmt: skip
    q, sinv, qt, sinvt, dbp = tb.triton_call(
        _k().dact_dbias_quantize_kernel,
        dy,
        z,
        np.int32(r),
        np.int32(c),
        out_shape=[
            SDS((r, c), jnp.uint8),
            SDS((r, ncb), jnp.float32),
            SDS((c, r), jnp.uint8),
            SDS((ncb, nrb), jnp.float32),
            SDS((nrb, c), jnp.float32),
        ],
        grid=(nrb, ncb),
        constexprs=dict(
            ACT=act,
            B=block,
            **_quant_constexprs(fmt, power_of_2),
        ),
        num_warps=QUANT_TILE_WARPS,
        divisible_by_16=tuple(n for n, v in (("R", r), ("C", c)) if v % 16 == 0),
        name="te_fp8_dact_dbias_quantize",
    )
    cast = lambda a: jax.lax.bitcast_convert_type(a, fmt)  # noqa: E731
    return cast(q), sinv, cast(qt), sinvt, dbp


# warps per 128 x 128 tile of the fused FFN kernels (read at trace time, part of the cached callables'
# keys; not yet timed on a GPU). Offline ptxas (sm_90a, Triton 3.6, bf16, 4096 rows): the gated
# forward spills 592 bytes a thread at 4 warps (0 at 8), the gated backward 392 at 8 (it reloads da and
# the gate for its second half: 1192 without).
FFN_ACT_WARPS = 4
FFN_DACT_WARPS = 8


# FFN_FUSED_ACTIVATIONS: the activations the fused FFN kernels compute (te_ops/grouped_dense/triton.py;
# the GELUs run unfused here, ffn_activation + dual_quantize)
def ffn_unsupported_reason(f: int, activation, gated: bool, block: int = 128) -> str | None:
    """Why the fused FFN activation kernels cannot take an activation (None when they can)."""
    if activation not in FFN_FUSED_ACTIVATIONS:
        return f"the fused FFN activation kernels take None, 'relu' or 'silu', got {activation!r}"
    if gated and f % block:
        return f"the gated backward kernel needs the FFN width F to be a multiple of {block}, got F={f}"
    return None


def ffn_act_dual_quantize(
    h: jax.Array, activation, gated: bool, fmt, *, power_of_2: bool, margin: int = 0
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``a = act(h)`` ([R, F]) or gated ``act(h[:, :F]) * h[:, F:]`` (h [R, 2F]), in float32 rounded
    to h's dtype, quantized from one read of h: ``(a in 1 x 128 row tiles, a^T in 1 x 128 row
    tiles)``, equal to ``dual_quantize(a, 128, fmt)`` up to the activation's last-ulp rounding."""
    fmt = jnp.dtype(fmt)
    r, w = h.shape
    f = w // 2 if gated else w
    why = ffn_unsupported_reason(f, activation, False)
    if why:
        raise ValueError(f"ffn_act_dual_quantize: {why}")
    fn = _sharded_ffn_act(ACT_CODES[activation], bool(gated), fmt, bool(power_of_2), margin, PARTITION,
                          FFN_ACT_WARPS)  # fmt: skip
    q, s, qt, st = fn(h) if r * f else _ffn_empty(r, f, False)
    return _dual_result(h, fmt, 128, False, q, s, qt, st)


def ffn_dact_dual_quantize(
    da: jax.Array, h: jax.Array, activation, gated: bool, fmt, *, power_of_2: bool, margin: int = 0
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """The backward of :func:`ffn_act_dual_quantize`'s activation, ``dh`` ([R, F], or [R, 2F]
    gated: ``[da * h[:, F:] * act'(h[:, :F]), da * act(h[:, :F])]``) in float32 rounded to h's
    dtype, quantized from one read of da and h: ``(dh in 1 x 128 row tiles, dh^T in 128 x 128
    blocks)``, equal to ``dual_quantize(dh, 128, fmt, t_square=True)`` up to the activation's
    last-ulp rounding. Gated: F a multiple of 128 (:func:`ffn_unsupported_reason`)."""
    fmt = jnp.dtype(fmt)
    r, f = da.shape
    why = ffn_unsupported_reason(f, activation, gated)
    if why:
        raise ValueError(f"ffn_dact_dual_quantize: {why}")
    fn = _sharded_ffn_dact(ACT_CODES[activation], bool(gated), fmt, bool(power_of_2), margin, PARTITION,
                           FFN_DACT_WARPS)  # fmt: skip
    q, s, qt, st = fn(da, h) if r * f else _ffn_empty(r, h.shape[1], True)
    return _dual_result(h, fmt, 128, True, q, s, qt, st)


def _ffn_empty(r: int, c: int, t_square: bool) -> list:
    return [jnp.zeros(o.shape, jnp.uint8) if o.dtype == jnp.uint8 else jnp.ones(o.shape, jnp.float32)
            for o in _dual_outputs(r, c, 128, t_square)]  # fmt: skip


@functools.cache
def _sharded_ffn_act(act, gated, fmt, power_of_2, margin, partition, warps=None):  # warps: read at trace time, keyed
    def local(h):
        return _ffn_act_local(h, act, gated, fmt, power_of_2, margin)

    return sharding.ffn_act_quantize(local, 128) if partition else local


def _ffn_act_local(h, act, gated, fmt, power_of_2, margin):
    r, w = h.shape
    f = w // 2 if gated else w
    return tb.triton_call(
        _k().ffn_act_dual_quantize_kernel,
        h,
        np.int32(r),
        np.int32(f),
        out_shape=_dual_outputs(r, f, 128, False),
        grid=(-(-r // 128), -(-f // 128)),
        constexprs=dict(ACT=act, GATED=gated, B=128, **_quant_constexprs(fmt, power_of_2, margin)),
        num_warps=FFN_ACT_WARPS,
        divisible_by_16=("F",) if f % 16 == 0 else (),
        name="te_fp8_ffn_act_dual_quantize",
    )


@functools.cache
def _sharded_ffn_dact(act, gated, fmt, power_of_2, margin, partition, warps=None):
    def local(da, h):
        return _ffn_dact_local(da, h, act, gated, fmt, power_of_2, margin)

    return sharding.ffn_dact_quantize(local, 128) if partition else local


def _ffn_dact_local(da, h, act, gated, fmt, power_of_2, margin):
    r, f = da.shape
    return tb.triton_call(
        _k().ffn_dact_dual_quantize_kernel,
        da,
        h,
        np.int32(r),
        np.int32(f),
        out_shape=_dual_outputs(r, h.shape[1], 128, True),
        grid=(-(-r // 128), -(-f // 128)),
        constexprs=dict(ACT=act, GATED=gated, B=128, **_quant_constexprs(fmt, power_of_2, margin)),
        num_warps=FFN_DACT_WARPS,
        divisible_by_16=("F",) if f % 16 == 0 else (),
        name="te_fp8_ffn_dact_dual_quantize",
    )


# (BM, BN, num_warps, num_stages) of block_scaled_gemm; timed in benchmarks/fp8.py
GEMM_CONFIG = (128, 128, 8, 3)
# "tiled": block_scaled_gemm_kernel, one program per output tile; "persistent": the Triton grouped
# kernel's persistent tile loop with one group (GROUPED_GEMM_CONFIG); "gluon": the Gluon
# warp-specialized grouped kernel with one group where it applies (else "tiled"); "cublaslt": one
# cuBLASLt matmul with its Hopper block scale modes (te_ops/fp8/cublaslt.py, cuBLASLt >= 12.9, no
# bias) where it applies (else "gluon", then "tiled"; not yet run on a GPU). Timed side by side in
# benchmarks/fp8.py; kernel_override() switches them for calls traced inside it.
# H100, 2026-12-06: 2.107 ms (913 TFLOP/s) "gluon" vs 3.746 ms (514) "tiled" vs 3.301 ms (583) "persistent"
# at 16384x4096x14336 (forward GEMM, operands quantized).
GEMM_KERNEL = "gluon"

_override = threading.local()


@contextlib.contextmanager
def kernel_override(dense: str | None = None, grouped: str | None = None):
    """Block-scaled GEMM kernels for calls traced inside the block (benchmarks, tests): ``dense`` one
    of "tiled", "persistent", "gluon", "cublaslt"; ``grouped`` "triton" or "gluon"."""
    prev = getattr(_override, "value", None)
    _override.value = (dense, grouped)
    try:
        yield
    finally:
        _override.value = prev


def _kernel_choice() -> tuple[str, str]:
    dense, grouped = getattr(_override, "value", None) or (None, None)
    return dense or GEMM_KERNEL, grouped or GROUPED_GEMM_KERNEL


def block_scaled_gemm(
    qa: QuantizedTensor, qb_t: QuantizedTensor, out_dtype=jnp.bfloat16, config: tuple | None = None, bias=None
) -> jax.Array:
    """``dequantize(qa) @ dequantize(qb_t).T (+ bias)`` with the FP8 operands on the tensor cores.

    qa: [M, K] in 1 x 128 row tiles (scale_inv [M, cdiv(K, 128)]); qb_t: the weight *transposed*,
    [N, K], in 128 x 128 blocks (scale_inv [cdiv(N, 128), cdiv(K, 128)]), K-major as Hopper's FP8
    wgmma reads it. Partial sums are promoted to float32 every 128 elements of K. ``bias`` [N] is
    added in float32 before the one rounding to ``out_dtype``.
    """
    if qa.block != (1, 128) or qb_t.block != (128, 128):
        raise ValueError(f"block_scaled_gemm takes 1x128 x 128x128 blocks, got {qa.block} and {qb_t.block}")
    config = tuple(config or GEMM_CONFIG)
    # the kernel choice is read here, at trace time, and is part of the cached callable's key: the
    # sharded callable's local function is traced once per callable (a later kernel_override would
    # otherwise reuse the first trace's kernel); so are the Gluon kernel's settings
    gemm = _sharded_block_gemm(jnp.dtype(out_dtype), config, bias is not None, PARTITION, _kernel_choice(),
                               _gluon_config())  # fmt: skip
    args = (qa.data, qa.scale_inv, qb_t.data, qb_t.scale_inv) + (() if bias is None else (bias.astype(jnp.float32),))
    return gemm(*args)


@functools.cache
def _sharded_block_gemm(out_dtype, config, has_bias, partition, kernels=None, gluon=None):
    def local(a, sa, b, sb, *bias, dtype):
        return _block_gemm_local(a, sa, b, sb, dtype, config, bias[0] if bias else None, kernels, gluon=gluon)

    if not partition:
        return functools.partial(local, dtype=out_dtype)
    return sharding.block_scaled_gemm(local, out_dtype, has_bias=has_bias)


def _block_gemm_local(a, sa, b, sb, out_dtype, config, bias=None, kernels=None, gluon=None):
    m, k = a.shape
    n = b.shape[0]
    route = (kernels or _kernel_choice())[0]
    if route == "cublaslt":
        from te_ops.fp8 import cublaslt

        why = cublaslt.unavailable_reason(
            m, n, k, out_dtype, a_dtype=a.dtype, b_dtype=b.dtype, has_bias=bias is not None
        )
        if why is None:
            return cublaslt.block_gemm(a, sa, b, sb, out_dtype)
        route = "gluon"  # and on to "tiled" where the Gluon kernel cannot take the call either
    if route == "gluon" and (m == 0 or gluon_gemm_unavailable_reason(
            k, n, out_dtype, a_dtype=a.dtype, b_dtype=b.dtype, has_bias=bias is not None) is not None):  # fmt: skip
        route = "tiled"
    if route in ("persistent", "gluon") and m > 0:  # the grouped kernel with one group of all M rows
        gs = jnp.full((1,), m, jnp.int32)
        bias1 = None if bias is None else bias.astype(jnp.float32)[None]
        kernel = "gluon" if route == "gluon" else "triton"
        return _grouped_gemm_local(a, sa, b[None], sb[None], gs, out_dtype, None, GROUPED_GEMM_CONFIG, bias1, kernel,
                                   gluon=gluon)  # fmt: skip
    bm, bn, warps, stages = config
    bk = 128
    grid = (-(-m // bm) * -(-n // bn),)
    return tb.triton_call(
        _k().block_scaled_gemm_kernel,
        a,
        sa.T,  # [cdiv(K, 128), M]: the kernel loads a tile's row scales contiguously
        b,
        sb,
        sb if bias is None else bias,  # not read without bias
        np.int32(m),
        np.int32(n),
        np.int32(k),
        out_shape=[SDS((m, n), out_dtype)],
        grid=grid,
        constexprs=dict(BM=bm, BN=bn, BK=bk, GROUP_M=8, WB=128, HAS_BIAS=bias is not None),
        num_warps=warps,
        num_stages=stages,
        divisible_by_16=tuple(nm for nm, v in (("K", k), ("N", n)) if v % 16 == 0),
        name="te_fp8_block_gemm",
    )[0]


GROUPED_GEMM_CONFIG = (128, 128, 8, 3)  # (BM, BN, num_warps, num_stages); timed in benchmarks/fp8.py


def grouped_block_scaled_gemm(
    qa: QuantizedTensor,
    qb_t: QuantizedTensor,
    group_sizes: jax.Array,
    out_dtype=jnp.bfloat16,
    num_programs=None,
    config: tuple | None = None,
) -> jax.Array:
    """MoE experts in FP8: ``out[rows of g] = dequantize(qa)[rows of g] @ dequantize(qb_t[g]).T``.

    qa: [M, K] in 1 x 128 row tiles; qb_t: [G, N, K] (each expert's weight transposed, K-major) in
    128 x 128 blocks, scale_inv [G, cdiv(N, 128), cdiv(K, 128)]; group_sizes int32 [G] on the
    device (grouped_dense's rule: rows past the groups are zero).
    """
    if qa.block != (1, 128) or qb_t.block != (128, 128):
        raise ValueError(f"grouped_block_scaled_gemm takes 1x128 x 128x128 blocks, got {qa.block} and {qb_t.block}")
    config = tuple(config or GROUPED_GEMM_CONFIG)
    kernel = "gluon" if config[0] == "gluon" else _kernel_choice()[1]  # read at trace time: part of the key
    gluon = _gluon_config(config[1:] if config[0] == "gluon" else None)  # so are the Gluon kernel's settings
    return _sharded_grouped_gemm(jnp.dtype(out_dtype), num_programs, config, PARTITION, kernel, gluon)(
        qa.data, qa.scale_inv, qb_t.data, qb_t.scale_inv, group_sizes.astype(jnp.int32)
    )


@functools.cache
def _sharded_grouped_gemm(out_dtype, num_programs, config, partition, kernel=None, gluon=None):
    def local(a, sa, b, sb, gs, dtype):
        return _grouped_gemm_local(a, sa, b, sb, gs, dtype, num_programs, config, kernel=kernel, gluon=gluon)

    if not partition:
        return lambda a, sa, b, sb, gs: local(a, sa, b, sb, gs, out_dtype)
    return sharding.grouped_block_scaled_gemm(local, out_dtype)


# The Gluon warp-specialized kernel (gluon_kernels.py: TMA producer warp, two wgmma consumer
# warpgroups on 128 x 128 tiles, float32 promotion every K step) on Hopper where it applies: K a
# multiple of 16, N a multiple of 8 (16-byte TMA rows), 128 x 128 tiles. "triton": always the Triton
# kernel (GROUPED_GEMM_CONFIG). Timed side by side in benchmarks/fp8.py.
GROUPED_GEMM_KERNEL = "gluon"
# (STAGES, GROUP_M, producer registers, maxnreg) of the Gluon kernel (its two consumer warpgroups are
# separate partitions on the tile's two 64-row halves: gluon_kernels.py says why)
# H100, 2026-12-06 (benchmarks/fp8.py): 913 TFLOP/s at 16384x4096x14336, 886 grouped K7168 N4096 G32
# (the variant with both warpgroups in one partition: 851 and 813, removed); 3 or 5 stages within 2%.
# 24 producer registers spill. An optional fifth field overrides GLUON_SCALES_TMA.
GLUON_GEMM_CONFIG = (4, 8, 32, 168)
# The Gluon kernel's variant whose producer warp also TMA-loads each K step's 128 A row scales into the
# stage (as DeepGEMM does), the consumers reading them from shared memory instead of global memory
# (gluon_kernels.py, SCALES_TMA; docs/perf_notes.md). Not yet measured on a GPU, so off. Read at trace
# time and part of the cached callables' keys; a config ("gluon", *GLUON_GEMM_CONFIG, True) forces it
# for one call (benchmarks/fp8.py rows "... scales via TMA ...", tests/gpu/test_fp8_gpu.py).
GLUON_SCALES_TMA = False


def _gluon_config(cfg: tuple | None = None) -> tuple:
    """(STAGES, GROUP_M, producer registers, maxnreg, scales via TMA) of the Gluon kernel: ``cfg`` (4 or 5
    of those fields; None: GLUON_GEMM_CONFIG), the fifth from GLUON_SCALES_TMA where not given."""
    cfg = tuple(GLUON_GEMM_CONFIG if cfg is None else cfg)
    if len(cfg) not in (4, 5):
        raise ValueError(f"a Gluon block-scaled GEMM config is (STAGES, GROUP_M, producer registers, maxnreg"
                         f"[, scales via TMA]), got {cfg}")  # fmt: skip
    return (*cfg[:4], bool(cfg[4] if len(cfg) == 5 else GLUON_SCALES_TMA))


# The Gluon kernel takes every call it can since the GPU tests ran its bias epilogue and E5M2
# operands (H100, 2026-12-06, commit 984acb7: test_block_scaled_gemm_matches_reference[gluon-*] with
# a bias and E5M2, test_fp8_dense_block_gemm_routes_match_reference[gluon]). False: calls with a
# bias or E5M2 operands take the Triton kernels (kept as a switch for bisecting).
GLUON_UNTESTED_OK = True


def gluon_gemm_unavailable_reason(
    k: int | None = None, n: int | None = None, out_dtype=None, *, a_dtype=None, b_dtype=None, has_bias=False
) -> str | None:
    """Why the Gluon block-scaled GEMM cannot take this call (None if it can)."""
    from te_ops.grouped_dense import triton as gd

    why = gd.gluon_ws_unavailable_reason()
    if why:
        return why
    if not GLUON_UNTESTED_OK:
        e4m3 = jnp.dtype(E4M3)
        if has_bias:
            return "the Gluon FP8 GEMM's bias epilogue has not run on a GPU yet"
        if any(d is not None and jnp.dtype(d) != e4m3 for d in (a_dtype, b_dtype)):
            return f"the Gluon FP8 GEMM has run on a GPU with E4M3 operands only, got {a_dtype} x {b_dtype}"
    if k == 0:  # the kernel loads a tile's first scales before its K loop
        return "the Gluon FP8 GEMM needs K > 0, got K=0"
    if k is not None and k % 16:
        return f"the Gluon FP8 GEMM needs K % 16 == 0 (16-byte TMA rows), got K={k}"
    if n is not None and n % 8:
        return f"the Gluon FP8 GEMM needs N % 8 == 0 (16-byte TMA rows of the output), got N={n}"
    if out_dtype is not None and jnp.dtype(out_dtype).itemsize * (n or 8) % 16:
        return f"the Gluon FP8 GEMM needs 16-byte output rows, got N={n} of {jnp.dtype(out_dtype)}"
    return None


def _gk():
    from te_ops.fp8 import gluon_kernels

    return gluon_kernels


def _gluon_grouped_gemm(a, sa_t, b, sb, gs, out_dtype, num_programs, gcfg, bias=None):
    from te_ops.grouped_dense import triton as gd

    m, k = a.shape
    g, n, _ = b.shape
    stages, group_m, producer_regs, maxnreg, scales_tma = _gluon_config(gcfg)
    bm = bn = 128
    grid = num_programs or max(1, min(gd.num_sms(), (-(-m // bm) + g + 1) * -(-n // bn)))
    return tb.triton_call(
        _gk().grouped_block_scaled_gemm_split_kernel,  # one 4-warp default + one 4-warp consumer partition
        a,
        sa_t,
        b,
        sb,
        gs,
        sb if bias is None else bias,  # not read without bias
        np.int32(m),
        np.int32(k // 16),
        np.int32(n // 8),
        np.int32(g),
        np.int32(grid),
        out_shape=[SDS((m, n), out_dtype)],
        grid=(grid,),
        constexprs=dict(
            BM=bm,
            BN=bn,
            BK=128,
            STAGES=stages,
            GROUP_M=group_m,
            BLOCK_G=max(16, 1 << max(0, (g - 1).bit_length())),
            HAS_BIAS=bias is not None,
            PRODUCER_REGS=producer_regs,
            CONSUMER_REGS=256 - producer_regs,
            SCALES_TMA=bool(scales_tma),  # off: the default kernel, as measured
        ),  # fmt: skip
        num_warps=4,
        num_stages=1,
        maxnreg=maxnreg,
        scratch_bytes_per_program=gd.TMA_SCRATCH_BYTES,
        name="te_fp8_grouped_block_gemm_ws",
    )[0]


def _grouped_gemm_local(a, sa, b, sb, gs, out_dtype, num_programs, config, bias=None, kernel=None, gluon=None):
    from te_ops.grouped_dense import triton as gd

    m, k = a.shape
    g, n, _ = b.shape
    # gluon: the Gluon settings the caller read at trace time (its cache key); else read here
    gcfg = gluon or _gluon_config(config[1:] if config[0] == "gluon" else None)
    if config[0] == "gluon":  # ("gluon", *GLUON_GEMM_CONFIG's fields[, scales via TMA]): this Gluon configuration
        kernel, config = "gluon", GROUPED_GEMM_CONFIG
    kernel = kernel or _kernel_choice()[1]
    ok = gluon_gemm_unavailable_reason(k, n, out_dtype, a_dtype=a.dtype, b_dtype=b.dtype, has_bias=bias is not None)
    if m > 0 and n > 0 and kernel == "gluon" and ok is None:
        return _gluon_grouped_gemm(a, sa.T, b, sb, gs, out_dtype, num_programs, gcfg, bias)
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    bm, bn, warps, stages = config
    bk = 128
    n_tiles = -(-n // bn)
    grid = num_programs or max(1, min(gd.num_sms(), (-(-m // bm) + g + 1) * n_tiles))
    return tb.triton_call(
        _k().grouped_block_scaled_gemm_kernel,
        a,
        sa.T,  # [cdiv(K, 128), M]: the kernel loads a tile's row scales contiguously
        b,
        sb,
        gs,
        np.int32(m),
        np.int32(n),
        np.int32(k),
        np.int32(g),
        np.int32(grid),
        sb if bias is None else bias,  # not read without bias
        out_shape=[SDS((m, n), out_dtype)],
        grid=(grid,),
        constexprs=dict(
            BM=bm, BN=bn, BK=bk, BLOCK_G=max(16, 1 << max(0, (g - 1).bit_length())), WB=128, HAS_BIAS=bias is not None
        ),
        num_warps=warps,
        num_stages=stages,
        divisible_by_16=tuple(nm for nm, v in (("K", k), ("N", n)) if v % 16 == 0),
        name="te_fp8_grouped_block_gemm",
    )[0]


WGRAD_CONFIG = (128, 128, 8, 3)  # (BKO, BN, num_warps, num_stages) of grouped_block_scaled_wgrad


def grouped_block_scaled_wgrad(
    qat: QuantizedTensor, qbt: QuantizedTensor, group_sizes: jax.Array, g: int, out_dtype, config=None
) -> jax.Array:
    """FP8 weight gradients of MoE experts: ``out[g] = dequantize(qat)[:, rows of g] @
    dequantize(qbt)[:, rows of g]^T`` ([G, K, N], float32 sums, promoted every 128 rows).

    qat: x^T [K, M] in 1 x 128 tiles along M; qbt: dy^T [N, M] in 128 x 128 blocks (tiles aligned to
    the whole tensor's rows, not to group starts); group_sizes int32 [G] (grouped_dense's rule)."""
    if qat.block != (1, 128) or qbt.block != (128, 128):
        raise ValueError(f"grouped_block_scaled_wgrad takes 1x128 x 128x128 blocks, got {qat.block} and {qbt.block}")
    k, m = qat.data.shape
    n = qbt.data.shape[0]
    if k * n * g == 0 or m == 0:
        return jnp.zeros((g, k, n), out_dtype)
    wgrad = _sharded_wgrad(jnp.dtype(out_dtype), int(g), tuple(config or WGRAD_CONFIG), PARTITION)
    return wgrad(qat.data, qat.scale_inv, qbt.data, qbt.scale_inv, group_sizes.astype(jnp.int32))


@functools.cache
def _sharded_wgrad(out_dtype, g, config, partition):
    def local(at, sat, bt, sbt, gs):
        return _wgrad_local(at, sat, bt, sbt, gs, gs.shape[0], out_dtype, config)

    return sharding.grouped_block_scaled_wgrad(local) if partition else local


def _wgrad_local(at, sat, bt, sbt, gs, g, out_dtype, config):
    k, m = at.shape
    n = bt.shape[0]
    bko, bn, warps, stages = config
    grid = g * -(-k // bko) * -(-n // bn)
    return tb.triton_call(
        _k().grouped_block_scaled_wgrad_kernel,
        at,
        sat,
        bt,
        sbt,
        gs,
        np.int32(m),
        np.int32(k),
        np.int32(n),
        np.int32(g),
        out_shape=[SDS((g, k, n), out_dtype)],
        grid=(grid,),
        constexprs=dict(BKO=bko, BN=bn, BR=128, BLOCK_G=max(16, 1 << max(0, (g - 1).bit_length())), WB=128),
        num_warps=warps,
        num_stages=stages,
        divisible_by_16=tuple(nm for nm, v in (("M", m), ("N", n)) if v % 16 == 0),
        name="te_fp8_grouped_block_wgrad",
    )[0]


ELEMS_PER_PROGRAM = 4096


def tensor_amax(x: jax.Array, batch: int = 1) -> jax.Array:
    """max |x| in float32 (NaN counts as +Inf, 0 for an empty tensor), on the device; with ``batch``
    B > 1, x is B equal slices along its leading axis and the result holds one amax per slice [B].
    Sharded: each shard's amax, then one max over the mesh axes x is sharded on."""
    if x.size == 0:
        return _amax_local(x, batch)
    if batch == 1:
        return _sharded_amax(False, PARTITION)(x)
    return _sharded_amax(True, PARTITION)(
        x.reshape(batch, *x.shape[1:]) if x.shape[0] == batch else x.reshape(batch, -1)
    )


@functools.cache
def _sharded_amax(batched, partition):
    # batched: one amax per slice [B] even where a shard holds one slice (expert parallelism with one
    # expert per shard), so the shards' results concatenate
    local = (lambda x: _amax_local(x, x.shape[0], vector=True)) if batched else (lambda x: _amax_local(x, 1))
    return sharding.amax(local, batched=batched) if partition else local


def _amax_local(x, batch, vector=False):
    n = x.size // batch
    vector = vector or batch != 1
    if n == 0:
        return jnp.zeros((batch,) if vector else (), jnp.float32)
    (bits,) = tb.triton_call(
        _k().amax_kernel,
        x.reshape(batch, n),
        np.int64(n),
        out_shape=[SDS((batch,), jnp.int32)],
        grid=(-(-n // ELEMS_PER_PROGRAM), batch),
        zeroed_outputs=(0,),
        constexprs=dict(BLOCK=ELEMS_PER_PROGRAM),
        num_warps=4,
        name="te_fp8_amax",
    )
    amax = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return amax if vector else amax[0]


def tensor_cast(
    x: jax.Array,
    scale: jax.Array,
    fmt,
    *,
    with_amax: bool,
    from_amax: bool = False,
    margin: int = 0,
    power_of_2: bool = False,
    batch: int = 1,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """FP8 of ``clip(x * scale, -fmax, fmax)`` with a device-side scale: returns (q, amax of x from the
    same read when ``with_amax`` else None, scale_inv as a float32 scalar). ``from_amax``: ``scale``
    is the tensor's amax and the kernel derives the scale from it (current scaling). With ``batch``
    B > 1, x is B equal slices along its leading axis, each with its own scale (``scale`` [B]; the
    amax and scale_inv returned are [B]). Sharded: elementwise; the amax is reduced over the mesh
    axes x is sharded on, and the scale must be replicated."""
    fmt = jnp.dtype(fmt)
    statics = (fmt, bool(with_amax), bool(from_amax), margin, bool(power_of_2))
    if x.size == 0:
        return _tensor_cast_local(x, scale, *statics, batch)
    shape = x.shape
    xb = x if batch == 1 or x.shape[0] == batch else x.reshape(batch, -1)
    outs = _sharded_cast(*statics, batch > 1, PARTITION)(xb, jnp.asarray(scale, jnp.float32))
    amax = outs[1] if with_amax else None
    return outs[0].reshape(shape), amax, outs[-1]


@functools.cache
def _sharded_cast(fmt, with_amax, from_amax, margin, power_of_2, batched, partition):
    def local(x, s):
        q, amax, sinv = _tensor_cast_local(x, s, fmt, with_amax, from_amax, margin, power_of_2,
                                           x.shape[0] if batched else 1, vector=batched)  # fmt: skip
        return (q, amax, sinv) if with_amax else (q, sinv)

    return sharding.tensor_cast(local, with_amax=with_amax, batched=batched) if partition else local


def _tensor_cast_local(x, scale, fmt, with_amax, from_amax, margin, power_of_2, batch, vector=False):
    n = x.size // batch
    vec = (batch,) if vector or batch != 1 else ()
    if n == 0:
        from te_ops.fp8 import reference as ref

        s = ref.compute_scale(scale, format_max(fmt), margin, power_of_2) if from_amax else scale
        return jnp.zeros(x.shape, fmt), (jnp.zeros(vec, jnp.float32) if with_amax else None), 1.0 / s
    q, bits, sinv = tb.triton_call(
        _k().tensor_cast_kernel,
        x.reshape(batch, n),
        jnp.asarray(scale, jnp.float32).reshape(batch),
        np.int64(n),
        out_shape=[SDS((batch, n), jnp.uint8), SDS((batch,), jnp.int32), SDS((batch,), jnp.float32)],
        grid=(-(-n // ELEMS_PER_PROGRAM), batch),
        zeroed_outputs=(1,),
        constexprs=dict(
            BLOCK=ELEMS_PER_PROGRAM,
            WITH_AMAX=bool(with_amax),
            FROM_AMAX=bool(from_amax),
            **_quant_constexprs(fmt, power_of_2, margin),
        ),
        num_warps=4,
        name="te_fp8_tensor_cast",
    )
    q = jax.lax.bitcast_convert_type(q, fmt).reshape(x.shape)
    amax = jax.lax.bitcast_convert_type(bits, jnp.float32).reshape(vec) if with_amax else None
    return q, amax, sinv.reshape(vec)


def quantize_tensor(x: jax.Array, fmt, *, margin: int = 0, power_of_2: bool = False, batch: int = 1) -> QuantizedTensor:
    """Per-tensor current scaling: an amax pass, then a cast pass that derives the scale (reference
    rule, correctly rounded divisions) and writes scale_inv. ``batch`` B > 1: one scale per slice of
    the leading axis (scale_inv [B]; e.g. per expert)."""
    q, _, sinv = tensor_cast(x, tensor_amax(x, batch), fmt, with_amax=False, from_amax=True, margin=margin,
                             power_of_2=power_of_2, batch=batch)  # fmt: skip
    return QuantizedTensor(q, sinv, None, jnp.dtype(x.dtype))


def _as_blocks(q: QuantizedTensor, block: tuple[int, int]) -> QuantizedTensor:
    """A per-tensor-scaled 2-D tensor viewed as block-scaled (its one scale repeated per block): the
    block-scaled GEMM kernel then serves per-tensor scaling too, still promoting every 128 of K."""
    if q.block is not None:
        return q
    r, c = q.data.shape
    grid = (-(-r // block[0]), -(-c // block[1]))
    return QuantizedTensor(q.data, jnp.broadcast_to(q.scale_inv, grid), block, q.dtype)


def scaled_gemm(qa: QuantizedTensor, qb_t: QuantizedTensor, out_dtype=jnp.bfloat16) -> jax.Array:
    """:func:`block_scaled_gemm` for block-scaled (1 x 128, 128 x 128) or per-tensor-scaled operands."""
    return block_scaled_gemm(_as_blocks(qa, (1, 128)), _as_blocks(qb_t, (128, 128)), out_dtype)
