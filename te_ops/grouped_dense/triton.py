"""Triton implementation of grouped_dense (kernels in ``triton_kernels.py``), launched through our
Triton bridge (``te_ops._core.triton_bridge.triton_call``). Same signatures and residual layout as
``reference.py``.

Why this engine
---------------
* **Our own Triton grouped GEMM** is the engine: a persistent kernel whose tile schedule is derived
  on the device from ``group_sizes``, so the op has no host synchronisation, a static launch
  (grid = number of SMs) and no run-time allocation: it is CUDA-graph / command-buffer safe (the
  bridge's launches go through jaxlib's ``triton_kernel_call_ffi``, declared kCmdBufferCompatible).
  On Hopper ``tl.dot`` lowers to wgmma with a num_stages-deep cp.async pipeline.
* **CUTLASS grouped GEMM** (device-side problem sizes) is not used: CUTLASS is not on the GPU image
  and the project builds csrc/ without it.
* **cuBLASLt grouped GEMM**: not used. The grouped/batched-pointer-array APIs of the cuBLAS
  releases we can rely on take the per-group problem sizes on the host (a device->host copy of
  group_sizes per call breaks graph capture and stalls the stream). A cuBLASLt grouped GEMM with
  device-side sizes would slot in as a ``native`` implementation.
* ``jax.lax.ragged_dot`` lowers to a dense expansion on GPU (every row times every group's kernel),
  far below the tensor cores' rate: fine for the reference, not as the engine.

Backward: dx is the same persistent kernel with the kernels read transposed (strides, no copy);
dkernels is ``grouped_wgrad_kernel`` (one program per (g, K-tile, N-tile), M reduction inside the
program, zero for empty groups); dbias is a one-hot [G, M] x dy GEMM in XLA (tiny next to the grouped GEMMs).

Configuration: :data:`DEFAULT_FWD`, :data:`DEFAULT_DX`, :data:`DEFAULT_WGRAD`; :func:`config_override`
(trace-time, like ``use_implementation``) lets the benchmark sweep candidates in one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from te_ops._core import triton_bridge as tb
from te_ops.grouped_dense import reference as ref
from te_ops.grouped_dense.reference import Residuals

SDS = jax.ShapeDtypeStruct
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_GROUPS = 1024
# Global scratch reserved per program for kernels that build TMA descriptors on the device (128 bytes
# per descriptor: at most 4, the FP8 Gluon GEMM with SCALES_TMA: a, b, out and the scales); an XLA
# buffer, so the launch stays CUDA-graph safe.
TMA_SCRATCH_BYTES = 512


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile configuration of the persistent grouped GEMM (forward and dx)."""

    BM: int = 128
    BN: int = 256
    BK: int = 64
    GROUP_M: int = 8
    num_warps: int = 8
    num_stages: int = 3
    FLATTEN: bool = False  # let Triton fuse the tile loop with the K loop (overlaps a tile's epilogue)
    # A and B tiles through device-side TMA descriptors (Hopper), where K is a multiple of BK; the
    # pointer-load kernel otherwise. Descriptors are built in the kernel (global scratch memory).
    USE_TMA: bool = False
    # Hopper (sm_90): the Gluon warp-specialized kernel (gluon_kernels.py: a TMA producer warp, two
    # wgmma consumer warpgroups, num_stages-deep ring, TMA-store epilogue) where K is a multiple of
    # BK; needs num_warps=8 and BM=128. Elsewhere (other GPUs, other K) the Triton kernel runs. As
    # grouped_ffn's ffn_act / ffn_dact config: gluon_ffn_kernels.py's versions (BN 64 or 128;
    # num_stages lowered to what fits in shared memory: :func:`_ffn_gluon_stages`).
    GLUON_WS: bool = False
    maxnreg: int = 168  # GLUON_WS: 12 warps x 168 registers fit the register file; setmaxnreg moves them
    # GLUON_WS with PINGPONG: two 4-warp consumer warpgroups on alternate BM x BN tiles (one's epilogue
    # overlaps the other's wgmmas); BM=128 and BN <= 128 (a whole tile's accumulator per warpgroup).
    PINGPONG: bool = False


@dataclasses.dataclass(frozen=True)
class WgradConfig:
    """Tile configuration of the dkernels kernel: output tile BKO x BN, BR rows per step."""

    BKO: int = 128
    BN: int = 256
    BR: int = 64
    GROUP_K: int = 8
    num_warps: int = 8
    num_stages: int = 3
    USE_TMA: bool = False  # whole row steps through TMA descriptors, the group's last partial step masked


# Forward and dx: the Gluon warp-specialized kernel on Hopper where it applies (the Triton kernel with
# the same tiles elsewhere). H200, 2026-12-04, benchmarks/train_moe.py at 16 x 1024 tokens, one
# process: 19.41 ms per training step with it vs 20.01 ms with the Triton kernel (3% faster); correct
# in the GPU tests and inside XLA command buffers (graph-safe scratch).
DEFAULT_FWD = GemmConfig(GLUON_WS=True)
DEFAULT_DX = GemmConfig(GLUON_WS=True)
DEFAULT_WGRAD = WgradConfig()
# grouped_ffn's two fused GEMMs (the Triton kernels; GLUON_WS=True selects the Gluon warp-specialized
# versions in gluon_ffn_kernels.py, opt-in until measured).
# Gated, the forward tile holds BN activation and BN linear columns: 128 x (2 x 128) as the plain
# forward's 128 x 256. The dact epilogue loads two [BM, BN] tiles of h on top of the accumulator.
DEFAULT_FFN_ACT = GemmConfig(BN=128)
DEFAULT_FFN_DACT = GemmConfig(BN=128)

# Activation codes of the Triton kernels' elementwise helpers (te_ops/_core/triton_math.py), and the
# ones the fused FFN epilogues take (the GELUs are left to XLA: ``1 + erf`` and ``1 + tanh`` cancel
# for very negative z, where XLA's erfc and clamped tanh give other values).
ACT_CODES = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "silu": 4}
FFN_FUSED_ACTIVATIONS = (None, "relu", "silu")

_override = threading.local()


@contextlib.contextmanager
def config_override(
    fwd: GemmConfig | None = None,
    dx: GemmConfig | None = None,
    wgrad: WgradConfig | None = None,
    ffn_act: GemmConfig | None = None,
    ffn_dact: GemmConfig | None = None,
):
    """Uses these tile configurations for grouped_dense and grouped_ffn calls traced inside the block
    (benchmarks): forward, dx and dkernels GEMMs, and grouped_ffn's act and dact GEMMs. The ops key
    their cached builds on it, so a new configuration is a new trace."""
    prev = getattr(_override, "value", None)
    _override.value = (fwd, dx, wgrad, ffn_act, ffn_dact)
    try:
        yield
    finally:
        _override.value = prev


def current_override() -> tuple | None:
    """The (fwd, dx, wgrad, ffn_act, ffn_dact) override active now (None outside
    :func:`config_override`)."""
    return getattr(_override, "value", None)


def _configs() -> tuple[GemmConfig, GemmConfig, WgradConfig]:
    fwd, dx, wg, _, _ = getattr(_override, "value", None) or (None,) * 5
    return fwd or DEFAULT_FWD, dx or DEFAULT_DX, wg or DEFAULT_WGRAD


def ffn_configs() -> tuple[GemmConfig, GemmConfig]:
    """grouped_ffn's (act GEMM, dact GEMM) tile configurations: the override's, else the defaults."""
    _, _, _, act, dact = getattr(_override, "value", None) or (None,) * 5
    return act or DEFAULT_FFN_ACT, dact or DEFAULT_FFN_DACT


def _k():
    from te_ops.grouped_dense import triton_kernels

    return triton_kernels


def _gk():
    from te_ops.grouped_dense import gluon_kernels

    return gluon_kernels


def gluon_ws_unavailable_reason() -> str | None:
    """Why the Gluon warp-specialized kernel cannot run here (None if it can): it needs Gluon and
    an sm_90 (Hopper) target, wgmma and setmaxnreg being Hopper instructions."""
    why = tb.unavailable_reason(gluon=True)
    if why:
        return why
    override = getattr(tb._target_override, "value", None)
    if override is not None:
        return None if tuple(override)[:2] == ("cuda", 90) else f"target {override} is not sm_90"
    try:
        cc = str(getattr(jax.devices("cuda")[0], "compute_capability", ""))
    except RuntimeError:
        return "no CUDA device"
    return None if cc == "9.0" else f"compute capability {cc or 'unknown'} is not 9.0 (Hopper)"


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


@functools.cache
def num_sms() -> int:
    """SM count of the first CUDA device (132 on an H200/H100 SXM when it cannot be read)."""
    try:
        return int(getattr(jax.devices("cuda")[0], "core_count", 132) or 132)
    except RuntimeError:
        return 132


def unsupported_reason(*, dtype=None, kernels_dtype=None, m=None, k=None, n=None, g=None, **_) -> str | None:
    if dtype is not None and jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"the Triton grouped GEMM supports bfloat16 and float16 inputs, got {jnp.dtype(dtype)}"
    if kernels_dtype is not None and dtype is not None and jnp.dtype(kernels_dtype) != jnp.dtype(dtype):
        return f"x and kernels must have the same dtype, got {jnp.dtype(dtype)} and {jnp.dtype(kernels_dtype)}"
    if k is not None and n is not None and (k % 8 or n % 8):
        return f"the Triton grouped GEMM needs K and N multiples of 8 (16-byte rows), got K={k}, N={n}"
    if g is not None and g > MAX_GROUPS:
        return f"the Triton grouped GEMM supports up to {MAX_GROUPS} groups, got {g}"
    if m is not None and m >= 2**31:
        return f"the Triton grouped GEMM takes M < 2**31 rows (int32 sizes), got M={m}"
    return None


def grouped_gemm(a, b, group_sizes, bias, *, trans_b: bool, cfg: GemmConfig):
    """out[rows of g] = a[rows of g] @ (b[g] or b[g]^T) (+ bias[g]); rows past the groups are zero."""
    m, kc = a.shape
    g = b.shape[0]
    nout = b.shape[1] if trans_b else b.shape[2]
    if m == 0 or nout == 0:
        return jnp.zeros((m, nout), a.dtype)
    n_tiles = _cdiv(nout, cfg.BN)
    max_tiles = (_cdiv(m, cfg.BM) + g + 1) * n_tiles
    grid = max(1, min(num_sms(), max_tiles))
    bias_arg = bias if bias is not None else group_sizes
    args = (a, b, bias_arg, group_sizes.astype(jnp.int32), np.int32(m), np.int32(kc // 8), np.int32(nout // 8),
            np.int32(g), np.int32(grid))  # fmt: skip
    gluon_ok = cfg.GLUON_WS and kc % cfg.BK == 0 and cfg.BM == 128 and not gluon_ws_unavailable_reason()
    if gluon_ok and (cfg.BN <= 128 if cfg.PINGPONG else cfg.num_warps == 8):
        common = dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, STAGES=cfg.num_stages, GROUP_M=cfg.GROUP_M,
                      BLOCK_G=max(16, _pow2(g)), TRANS_B=bool(trans_b), HAS_BIAS=bias is not None)  # fmt: skip
        if cfg.PINGPONG:  # two 4-warp consumer warpgroups + the producer warp
            kernel, warps, extra, name = _gk().grouped_gemm_pingpong_kernel, 4, {"CONSUMER_REGS": 232}, "pingpong"
        else:
            kernel, warps, extra, name = _gk().grouped_gemm_ws_kernel, cfg.num_warps, {"NUM_WARPS": cfg.num_warps}, "ws"
        return tb.triton_call(
            kernel,
            *args,
            out_shape=[SDS((m, nout), a.dtype)],
            grid=(grid,),
            constexprs={**common, **extra},
            num_warps=warps,
            num_stages=1,
            maxnreg=cfg.maxnreg,
            scratch_bytes_per_program=TMA_SCRATCH_BYTES,
            name=f"te_grouped_gemm_{name}",
        )[0]
    use_tma = bool(cfg.USE_TMA) and kc % cfg.BK == 0
    return tb.triton_call(
        _k().grouped_gemm_kernel,
        *args,
        out_shape=[SDS((m, nout), a.dtype)],
        grid=(grid,),
        constexprs=dict(
            BM=cfg.BM,
            BN=cfg.BN,
            BK=cfg.BK,
            GROUP_M=cfg.GROUP_M,
            BLOCK_G=max(16, _pow2(g)),
            TRANS_B=bool(trans_b),
            HAS_BIAS=bias is not None,
            EVEN_K=(kc % cfg.BK == 0),
            FLATTEN=bool(cfg.FLATTEN),
            USE_TMA=use_tma,
        ),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        scratch_bytes_per_program=TMA_SCRATCH_BYTES if use_tma else 0,
        name="te_grouped_gemm",
    )[0]


def grouped_wgrad(x, dy, group_sizes, g: int, *, cfg: WgradConfig, out_dtype):
    m, k = x.shape
    n = dy.shape[1]
    if k == 0 or n == 0:
        return jnp.zeros((g, k, n), out_dtype)
    grid = g * _cdiv(k, cfg.BKO) * _cdiv(n, cfg.BN)
    return tb.triton_call(
        _k().grouped_wgrad_kernel,
        x,
        dy,
        group_sizes.astype(jnp.int32),
        np.int32(m),
        np.int32(k // 8),
        np.int32(n // 8),
        np.int32(g),
        out_shape=[SDS((g, k, n), out_dtype)],
        grid=(grid,),
        constexprs=dict(
            BKO=cfg.BKO, BN=cfg.BN, BR=cfg.BR, BLOCK_G=max(16, _pow2(g)), GROUP_K=cfg.GROUP_K, USE_TMA=bool(cfg.USE_TMA)
        ),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        scratch_bytes_per_program=TMA_SCRATCH_BYTES if cfg.USE_TMA else 0,
        name="te_grouped_wgrad",
    )[0]


# Shared memory of one Hopper SM a block may use (227 KB), for the Gluon FFN kernels' STAGES
SMEM_BYTES = 227 * 1024
# Registers of the Gluon FFN kernels' producer warp (setmaxnreg): at the ws kernel's 24 its tile
# schedule spills 12 to 28 bytes a thread (sm_90a, Triton 3.6); at 32 nothing spills, and the consumer
# warps get 232 (12 warps x maxnreg 168, the producer's warpgroup padded to 4 warps).
FFN_PRODUCER_REGS = 32


def _ffn_gluon_stages(cfg: GemmConfig, kc: int, gated: bool, dact: bool, itemsize: int = 2) -> int:
    """STAGES of the Gluon warp-specialized FFN kernel for ``cfg`` (gluon_ffn_kernels.py), or 0 where it
    does not apply (the Triton kernel runs): GLUON_WS set, sm_90 with Gluon, KC a multiple of BK, BM
    128, 8 consumer warps, BN 64 or 128 (gated act: two BM x BN accumulators), BK a multiple of 64
    (128-byte swizzled tiles). cfg.num_stages, lowered to what fits in shared memory with the two
    epilogue tiles (gated act at 128 x 128 x 64: 3 stages of 48 KB + 64 KB); at least 2."""
    if not (cfg.GLUON_WS and cfg.BM == 128 and cfg.num_warps == 8 and cfg.BN in (64, 128) and cfg.BK % 64 == 0):
        return 0
    if kc % cfg.BK or gluon_ws_unavailable_reason():
        return 0
    b_tiles = 2 if gated and not dact else 1
    per_stage = (cfg.BM * cfg.BK + b_tiles * cfg.BK * cfg.BN) * itemsize
    epilogue = (1 if dact and not gated else 2) * cfg.BM * cfg.BN * itemsize
    stages = min(cfg.num_stages, (SMEM_BYTES - 1024 - epilogue) // per_stage)  # 1 KB: barriers, alignment
    return stages if stages >= 2 else 0


def _ffn_launch(kind, a, b, h, group_sizes, f, out_shape, cfg: GemmConfig, activation, gated):
    """Launches grouped_gemm_{kind}_kernel (kind "act" or "dact"), or its Gluon warp-specialized
    version (``_ffn_gluon_stages``)."""
    m, kc = a.shape
    g = b.shape[0]
    grid = max(1, min(num_sms(), (_cdiv(m, cfg.BM) + g + 1) * _cdiv(f, cfg.BN)))
    args = (a, b) + ((h,) if h is not None else ()) + (group_sizes.astype(jnp.int32), np.int32(m), np.int32(kc // 8),
                                                      np.int32(f // 8), np.int32(g), np.int32(grid))  # fmt: skip
    common = dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M, BLOCK_G=max(16, _pow2(g)),
                  ACT=ACT_CODES[activation], GATED=bool(gated))  # fmt: skip
    stages = _ffn_gluon_stages(cfg, kc, gated, kind == "dact", jnp.dtype(a.dtype).itemsize)
    if stages:
        from te_ops.grouped_dense import gluon_ffn_kernels

        return tb.triton_call(
            getattr(gluon_ffn_kernels, f"grouped_gemm_{kind}_ws_kernel"),
            *args,
            out_shape=out_shape,
            grid=(grid,),
            constexprs=dict(common, STAGES=stages, NUM_WARPS=cfg.num_warps, PRODUCER_REGS=FFN_PRODUCER_REGS),
            num_warps=cfg.num_warps,
            num_stages=1,
            maxnreg=cfg.maxnreg,
            scratch_bytes_per_program=TMA_SCRATCH_BYTES,  # 4 descriptors: a, b, h and act / dh
            name=f"te_grouped_gemm_{kind}_ws",
        )
    return tb.triton_call(
        getattr(_k(), f"grouped_gemm_{kind}_kernel"),
        *args,
        out_shape=out_shape,
        grid=(grid,),
        constexprs=dict(common, EVEN_K=(kc % cfg.BK == 0), HW=tb.hardware_conversions()),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        scratch_bytes_per_program=0,  # the te_scratch parameter, unused (no TMA descriptors)
        name=f"te_grouped_gemm_{kind}",
    )


def ffn_act_gemm(x, wi, group_sizes, *, activation, gated: bool, cfg: GemmConfig | None = None):
    """(h, act): ``h = grouped_gemm(x, wi)`` ([M, W]) and the activation of h ([M, F], F = W / 2
    gated), from one kernel (``grouped_gemm_act_kernel``, or with ``cfg.GLUON_WS`` on sm_90
    gluon_ffn_kernels' ``grouped_gemm_act_ws_kernel``); both zero on the rows past the groups.
    ``cfg``: the tiles (default :func:`ffn_configs`)."""
    m = x.shape[0]
    w = wi.shape[2]
    f = w // 2 if gated else w
    if m == 0 or f == 0:
        return jnp.zeros((m, w), x.dtype), jnp.zeros((m, f), x.dtype)
    h, act = _ffn_launch("act", x, wi, None, group_sizes, f, [SDS((m, w), x.dtype), SDS((m, f), x.dtype)],
                         cfg or ffn_configs()[0], activation, gated)  # fmt: skip
    return h, act


def ffn_dact_gemm(dy, wo, h, group_sizes, *, activation, gated: bool, cfg: GemmConfig | None = None):
    """dh ([M, W], h's shape): the gradient of the activation at h for ``da = dy @ wo[g]^T`` (da
    rounded to h's dtype first, as the unfused path stores it), from one kernel
    (``grouped_gemm_dact_kernel``, or with ``cfg.GLUON_WS`` on sm_90 ``grouped_gemm_dact_ws_kernel``);
    zero on the rows past the groups."""
    m, w = h.shape
    f = wo.shape[1]
    if m == 0 or f == 0:
        return jnp.zeros((m, w), h.dtype)
    return _ffn_launch("dact", dy.astype(h.dtype), wo, h, group_sizes, f, [SDS((m, w), h.dtype)],
                       cfg or ffn_configs()[1], activation, gated)[0]  # fmt: skip


def forward(x, kernels, group_sizes, bias=None, *, has_bias: bool):
    fwd_cfg, _, _ = _configs()
    y = grouped_gemm(x, kernels, group_sizes, bias if has_bias else None, trans_b=False, cfg=fwd_cfg)
    return y, Residuals(x, kernels, group_sizes)


def backward(res: Residuals, dy, *, has_bias: bool, wgrad_dtype=None):
    """dx, dkernels (``wgrad_dtype``, default the kernels' dtype: the wgrad kernel rounds its float32
    accumulator once, to that dtype) and dbias."""
    x, kernels, group_sizes = res
    _, dx_cfg, wg_cfg = _configs()
    dy = dy.astype(x.dtype)
    dx = grouped_gemm(dy, kernels, group_sizes, None, trans_b=True, cfg=dx_cfg)
    dk = grouped_wgrad(x, dy, group_sizes, kernels.shape[0], cfg=wg_cfg, out_dtype=wgrad_dtype or kernels.dtype)
    db = None
    if has_bias:
        g = kernels.shape[0]
        # per-group row sums as a [G, M] one-hot GEMM (exact products, fp32 accumulation): a sorted
        # segment_sum lowers to a scatter-add whose atomics all hit the same G rows
        seg = ref.segment_ids(group_sizes, x.shape[0])
        onehot = (seg[None, :] == jnp.arange(g, dtype=jnp.int32)[:, None]).astype(dy.dtype)
        db = jnp.dot(onehot, dy, preferred_element_type=jnp.float32)
    return dx, dk, db
