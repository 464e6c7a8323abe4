"""Triton implementation of rms_norm / layer_norm (kernels in ``triton_kernels.py``), launched through
our Triton bridge (``te_ops._core.triton_bridge.triton_call``). Same signatures and residual layout
as ``reference.py``.

Launch plan (x flattened to ``[ROWS, H]``; the module constants are read when a call is traced, so
benchmarks/norm.py can sweep them):

* H <= :data:`MAX_FUSED_H`: the whole row in registers. Tiles of ``BLOCK_R x BLOCK_H`` with
  ``BLOCK_H = next_pow2(H)`` and ``BLOCK_R`` rows (short rows share a program, so a program always
  moves about :data:`TILE_ELEMS` elements); ``num_warps`` grows with the tile (8 warps for a 4096
  row: 16 elements, two 16-byte bf16 vectors, per thread). Forward: one program per tile. Backward:
  ``G = min(tiles, SMs * BWD_PROGRAMS_PER_SM)`` programs walk the tiles, each keeping its
  dgamma/dbeta partial sums in registers and writing one ``[H]`` row of a ``[G, H]`` float32
  buffer; ``jnp.sum`` over G finishes the reduction (a small fp32 column sum in XLA).
* Longer rows: one row per program in chunks of :data:`LOOP_BLOCK_H` (forward: three passes for
  LayerNorm, two for RMSNorm; backward dx: two passes), and a column-tiled kernel for the partial
  parameter gradients.

When H is a multiple of 16 the bridge is told so (``divisible_by_16=("H",)``): row starts are then
32-byte aligned and the loads and stores become 16-byte vectors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from te_ops._core import triton_bridge as tb
from te_ops.normalization.reference import Residuals

SDS = jax.ShapeDtypeStruct
F32 = jnp.float32
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

MAX_FUSED_H = 8192  # longest row held in registers (16 warps x 16 fp32 values per thread per array)
TILE_ELEMS = 4096  # elements per program for short rows (BLOCK_R = TILE_ELEMS // BLOCK_H rows)
MAX_BLOCK_R = 64
LOOP_BLOCK_H = 4096  # chunk of a long row
ELEMS_PER_THREAD = 16  # in-register kernels: num_warps = tile elements / (32 * ELEMS_PER_THREAD), 1..16
BWD_PROGRAMS_PER_SM = 4  # backward programs per SM (each writes one [H] row of partial sums)
DPARAM_ROW_GROUPS_PER_SM = 2  # long rows: row groups per SM of the column-tiled parameter-gradient kernel


def _k():
    from te_ops.normalization import triton_kernels

    return triton_kernels


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


@functools.cache
def num_sms() -> int:
    """SM count of the first CUDA device (132 on an H100/H200 SXM when it cannot be read)."""
    try:
        return int(getattr(jax.devices("cuda")[0], "core_count", 132) or 132)
    except RuntimeError:
        return 132


def fused_config(h: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_H, num_warps) of the in-register kernels for rows of h <= MAX_FUSED_H."""
    block_h = max(16, _pow2(h))
    block_r = max(1, min(MAX_BLOCK_R, TILE_ELEMS // block_h))
    warps = max(1, min(16, block_r * block_h // (32 * ELEMS_PER_THREAD)))
    return block_r, block_h, warps


def unsupported_reason(*, dtype=None, gamma_dtype=None, beta_dtype=None, rows=None, **_) -> str | None:
    if dtype is not None and jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"the Triton normalization kernels take float32, bfloat16 or float16 x, got {jnp.dtype(dtype)}"
    for name, dt in (("gamma", gamma_dtype), ("beta", beta_dtype)):
        if dt is not None and jnp.dtype(dt) not in SUPPORTED_DTYPES:
            return f"the Triton normalization kernels take float32, bfloat16 or float16 {name}, got {jnp.dtype(dt)}"
    if rows is not None and rows >= 2**31:
        return f"the Triton normalization kernels take fewer than 2**31 rows (int32 row count), got {rows}"
    return None


def _div16(h: int) -> tuple[str, ...]:
    return ("H",) if h % 16 == 0 else ()


def forward(x, gamma, beta=None, residual=None, *, kind: str, eps: float, zero_centered_gamma: bool):
    h_dim = x.shape[-1]
    lead = x.shape[:-1]
    rows = int(np.prod(lead, dtype=np.int64))
    x2 = x.reshape(rows, h_dim)
    r2 = residual.reshape(rows, h_dim) if residual is not None else x2  # placeholder when absent
    is_rms = kind == "rms"
    has_res = residual is not None
    out_shape = [
        SDS((rows, h_dim), x.dtype),
        SDS((rows, h_dim) if has_res else (1,), x.dtype),
        SDS((1,) if is_rms else (rows,), F32),
        SDS((rows,), F32),
    ]
    flags = dict(IS_RMS=is_rms, HAS_RES=has_res, HAS_BETA=beta is not None, ZERO_CENTERED=bool(zero_centered_gamma))
    args = (x2, r2, gamma, beta if beta is not None else gamma, np.int32(rows), np.int32(h_dim), np.float32(eps))
    if h_dim <= MAX_FUSED_H:
        block_r, block_h, warps = fused_config(h_dim)
        outs = tb.triton_call(
            _k().norm_fwd_kernel, *args, out_shape=out_shape, grid=(_cdiv(rows, block_r),),
            constexprs=dict(BLOCK_R=block_r, BLOCK_H=block_h, **flags), num_warps=warps, num_stages=1,
            divisible_by_16=_div16(h_dim), name=f"te_{kind}_norm_fwd",
        )  # fmt: skip
    else:
        outs = tb.triton_call(
            _k().norm_fwd_looped_kernel, *args, out_shape=out_shape, grid=(rows,),
            constexprs=dict(BLOCK_H=LOOP_BLOCK_H, **flags), num_warps=8, num_stages=1,
            divisible_by_16=_div16(h_dim), name=f"te_{kind}_norm_fwd_looped",
        )  # fmt: skip
    y, h, mean, rstd = outs
    h = h.reshape(x.shape) if has_res else x
    mean = None if is_rms else mean.reshape(lead)
    return y.reshape(x.shape), Residuals(h, gamma, mean, rstd.reshape(lead))


def backward(res: Residuals, dy, dh=None, *, kind: str, zero_centered_gamma: bool):
    h_in = res.h
    h_dim = h_in.shape[-1]
    rows = int(np.prod(h_in.shape[:-1], dtype=np.int64))
    is_rms = kind == "rms"
    h2 = h_in.reshape(rows, h_dim)
    dy2 = dy.astype(h_in.dtype).reshape(rows, h_dim)
    dh2 = dh.astype(h_in.dtype).reshape(rows, h_dim) if dh is not None else h2  # placeholder when absent
    rstd = res.rstd.reshape(rows)
    mean = res.mean.reshape(rows) if res.mean is not None else rstd  # placeholder for RMSNorm
    flags = dict(IS_RMS=is_rms, ZERO_CENTERED=bool(zero_centered_gamma))
    if h_dim <= MAX_FUSED_H:
        block_r, block_h, warps = fused_config(h_dim)
        n_prog = min(_cdiv(rows, block_r), num_sms() * BWD_PROGRAMS_PER_SM)
        part = SDS((n_prog, h_dim), F32)
        dx, dw_part, db_part = tb.triton_call(
            _k().norm_bwd_kernel, h2, res.gamma, mean, rstd, dy2, dh2, np.int32(rows), np.int32(h_dim),
            out_shape=[SDS((rows, h_dim), h_in.dtype), part, part if not is_rms else SDS((1,), F32)],
            grid=(n_prog,), constexprs=dict(BLOCK_R=block_r, BLOCK_H=block_h, HAS_DH=dh is not None, **flags),
            num_warps=warps, num_stages=1, divisible_by_16=_div16(h_dim), name=f"te_{kind}_norm_bwd",
        )  # fmt: skip
    else:
        (dx,) = tb.triton_call(
            _k().norm_bwd_looped_kernel, h2, res.gamma, mean, rstd, dy2, dh2, np.int32(rows), np.int32(h_dim),
            out_shape=[SDS((rows, h_dim), h_in.dtype)], grid=(rows,),
            constexprs=dict(BLOCK_H=LOOP_BLOCK_H, HAS_DH=dh is not None, **flags), num_warps=8, num_stages=1,
            divisible_by_16=_div16(h_dim), name=f"te_{kind}_norm_bwd_looped",
        )  # fmt: skip
        block_r, block_h = 8, 512
        n_groups = min(_cdiv(rows, block_r), num_sms() * DPARAM_ROW_GROUPS_PER_SM)
        part = SDS((n_groups, h_dim), F32)
        dw_part, db_part = tb.triton_call(
            _k().norm_dparam_kernel, h2, mean, rstd, dy2, np.int32(rows), np.int32(h_dim),
            out_shape=[part, part if not is_rms else SDS((1,), F32)], grid=(_cdiv(h_dim, block_h), n_groups),
            constexprs=dict(BLOCK_R=block_r, BLOCK_H=block_h, IS_RMS=is_rms), num_warps=4, num_stages=1,
            divisible_by_16=_div16(h_dim), name=f"te_{kind}_norm_dparam",
        )  # fmt: skip
    dgamma = jnp.sum(dw_part, axis=0)
    dbeta = None if is_rms else jnp.sum(db_part, axis=0)
    return dx.reshape(h_in.shape), dgamma, dbeta
