"""cuBLASLt route of the dense block-scaled FP8 GEMM (``te_ops.fp8.triton.block_scaled_gemm`` with
``GEMM_KERNEL = "cublaslt"`` or ``kernel_override(dense="cublaslt")``).

``y = dequantize(qa) @ dequantize(qb_t).T`` with qa [M, K] in 1 x 128 tiles and qb_t [N, K] in
128 x 128 blocks, as one cuBLASLt matmul with Hopper's DeepSeek-style block scale modes
(cuBLASLt >= 12.9: ``VEC128_32F`` for qa, ``BLK128x128_32F`` for qb_t; partial sums promoted to
float32 every 128 of K, no fast accumulation). The FFI target ``te_fp8_cublaslt_block_gemm`` lives
in the dense module ``te_ops._native_cublaslt`` (csrc/dense/fp8_block_gemm_ffi.cc) and uses dense's cached,
timed, graph-safe cuBLASLt plans.

Operands as cuBLASLt reads them: qa's scales transposed (``[cdiv(K, 128), M]``, M fastest: what the
Triton and Gluon kernels receive too) and qb_t's scales as stored (``[cdiv(N, 128), cdiv(K, 128)]``,
K-blocks fastest) with the columns zero-padded to a multiple of 4 (cuBLASLt's fixed column stride
for 128 x 128 scales; a few bytes).

Where it applies (:func:`unavailable_reason`): the dense native module is loaded; cuBLASLt 12.9 or
newer (headers and loaded library); a Hopper GPU (compute capability 9.0: the only architecture with
these scale modes); no bias (cuBLASLt's FP8 bias is bf16, which would break te_ops.fp8's "float32
bias, one rounding" rule); M, N, K > 0; E4M3 or E5M2 operands, not both E5M2 (cuBLASLt has no E5M2 x
E5M2 GEMM); K % 16 == 0 (16-byte rows), M % 4 == 0 and N % 4 == 0 (the scale layouts), 16-byte
output rows; and cuBLASLt's heuristic offering an algorithm for the exact shape (asked once per
shape through the ctypes symbol ``te_fp8_cublaslt_block_gemm_query``; this needs the GPU). Elsewhere
``block_scaled_gemm`` takes the Gluon route (and from there the Triton one).

Status: built and syntax-checked without a GPU; not yet run or measured on one.
"""

from __future__ import annotations

import ctypes
import functools
import importlib

import jax
import jax.numpy as jnp

from te_ops._core import native as _native
from te_ops.fp8.recipes import E4M3, E5M2

MODULE = "_native_cublaslt"
TARGET = "te_fp8_cublaslt_block_gemm"
# cuBLASLt version (major * 10000 + minor * 100 + patch) with the FP8 block scale modes
MIN_VERSION = 120900
FORMAT_CODES = {jnp.dtype(E4M3): 0, jnp.dtype(E5M2): 1}
OUT_CODES = {jnp.dtype(jnp.bfloat16): 0, jnp.dtype(jnp.float32): 1}


def version_str(v: int) -> str:
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


@functools.cache
def _lib():
    mod = importlib.import_module(f"te_ops.{MODULE}")
    return ctypes.CDLL(mod.__file__)


@functools.cache
def versions() -> tuple[int, int] | str:
    """(header version the module was built against, version of the cuBLASLt loaded now), or why they
    cannot be read. No GPU needed."""
    try:
        fn = _lib().te_cublaslt_version
    except (ImportError, OSError, AttributeError) as e:
        return f"cannot reach te_cublaslt_version in te_ops.{MODULE}: {e}"
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int]
    return int(fn(0)), int(fn(1))


def static_unavailable_reason(
    m: int, n: int, k: int, out_dtype, *, a_dtype, b_dtype, has_bias: bool = False, cublaslt_versions=None
) -> str | None:
    """Why the cuBLASLt route cannot take ``[M, K] x [N, K]^T -> [M, N]`` by the rules that need no
    GPU (None if it can as far as they go). ``cublaslt_versions`` (header, runtime) overrides the
    module's (tests)."""
    if has_bias:
        return ("the cuBLASLt route takes no bias (cuBLASLt's FP8 bias is bf16; te_ops.fp8 adds a float32 bias "
                "before the one rounding): the Gluon / Triton kernels take calls with a bias")  # fmt: skip
    if m == 0 or n == 0 or k == 0:
        return f"an empty operand (M={m}, N={n}, K={k}): cuBLASLt refuses empty matrices"
    for name, dt in (("a", a_dtype), ("b", b_dtype)):
        if jnp.dtype(dt) not in FORMAT_CODES:
            return f"the cuBLASLt route takes float8_e4m3fn or float8_e5m2 operands, got {name} {jnp.dtype(dt)}"
    if jnp.dtype(a_dtype) == jnp.dtype(E5M2) and jnp.dtype(b_dtype) == jnp.dtype(E5M2):
        return "cuBLASLt has no E5M2 x E5M2 FP8 GEMM (one operand must be E4M3)"
    if jnp.dtype(out_dtype) not in OUT_CODES:
        return f"the cuBLASLt route writes bfloat16 or float32, got {jnp.dtype(out_dtype)}"
    if k % 16:
        return f"the cuBLASLt FP8 GEMM needs K % 16 == 0 (16-byte rows of both operands), got K={k}"
    if m % 4 or n % 4:
        return f"cuBLASLt's block scale layouts need M % 4 == 0 and N % 4 == 0, got M={m}, N={n}"
    if n * jnp.dtype(out_dtype).itemsize % 16:
        return f"the cuBLASLt route needs 16-byte output rows, got N={n} of {jnp.dtype(out_dtype)}"
    why = _native.op_unavailable_reason(MODULE, "dense") if cublaslt_versions is None else None
    if why:
        return why
    vs = versions() if cublaslt_versions is None else cublaslt_versions
    if isinstance(vs, str):
        return vs
    header, runtime = vs
    if header < MIN_VERSION:
        return (f"te_ops.{MODULE} was built against cuBLASLt headers {version_str(header)}, which have no FP8 "
                f"block scale modes (12.9 or newer needed)")  # fmt: skip
    if runtime < MIN_VERSION:
        return f"the loaded cuBLASLt is {version_str(runtime)}; its FP8 block scale modes need 12.9 or newer"
    return None


@functools.cache
def _device_reason() -> str | None:
    why = _native.cuda_device_unavailable_reason()
    if why:
        return why
    cc = str(getattr(jax.devices("cuda")[0], "compute_capability", ""))
    if cc != "9.0":
        return f"cuBLASLt's 128-element FP8 block scaling runs on compute capability 9.0 (Hopper) only, not {cc}"
    return None


@functools.cache
def query(m: int, n: int, k: int, a_code: int, b_code: int, out_code: int, device: int = -1) -> str | None:
    """cuBLASLt's verdict for one shape on the GPU (te_fp8_cublaslt_block_gemm_query: version, size
    rules and the heuristic for the exact spec); None when it offers an algorithm. Cached per shape."""
    try:
        fn = _lib().te_fp8_cublaslt_block_gemm_query
    except (ImportError, OSError, AttributeError) as e:
        return f"cannot reach te_fp8_cublaslt_block_gemm_query in te_ops.{MODULE}: {e}"
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    ints = (device, m, n, k, a_code, b_code, out_code)
    arr = (ctypes.c_int64 * len(ints))(*ints)
    err = ctypes.create_string_buffer(4096)
    rc = fn(arr, len(ints), err, len(err))
    if rc != 0:
        return err.value.decode(errors="replace") or f"te_fp8_cublaslt_block_gemm_query returned {rc}"
    return None


def unavailable_reason(m: int, n: int, k: int, out_dtype, *, a_dtype, b_dtype, has_bias: bool = False) -> str | None:
    """Why the cuBLASLt route cannot take this call in this process (None if it can): the static rules,
    then the GPU, then cuBLASLt's heuristic for the exact shape (asked once per shape)."""
    why = static_unavailable_reason(m, n, k, out_dtype, a_dtype=a_dtype, b_dtype=b_dtype, has_bias=has_bias)
    if why:
        return why
    why = _device_reason()
    if why:
        return why
    fa, fb = FORMAT_CODES[jnp.dtype(a_dtype)], FORMAT_CODES[jnp.dtype(b_dtype)]
    return query(int(m), int(n), int(k), fa, fb, OUT_CODES[jnp.dtype(out_dtype)])


def padded_block_scales(sb: jax.Array) -> jax.Array:
    """qb_t's 128 x 128 scales [cdiv(N, 128), kb] with the columns zero-padded to a multiple of 4
    (cuBLASLt reads them with that column stride; the padding is never used as a scale)."""
    pad = -sb.shape[1] % 4
    sb = sb.astype(jnp.float32)
    return jnp.pad(sb, ((0, 0), (0, pad))) if pad else sb


def block_gemm(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, out_dtype) -> jax.Array:
    """``(a * sa) @ (b * sb)^T`` by cuBLASLt (local shards): a [M, K] FP8 with sa [M, cdiv(K, 128)],
    b [N, K] FP8 with sb [cdiv(N, 128), cdiv(K, 128)]; out_dtype bfloat16 or float32. The caller
    checks :func:`unavailable_reason` first."""
    m, n = a.shape[0], b.shape[0]
    out = jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype))
    return _native.ffi_call(TARGET, out, a, sa.astype(jnp.float32).T, b, padded_block_scales(sb))
