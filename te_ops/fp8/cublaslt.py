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

Where it applies (:func:`unavailable_reason`): no bias (cuBLASLt's FP8 bias is bf16, which would
break te_ops.fp8's "float32 bias, one rounding" rule); E4M3 or E5M2 operands and a bfloat16 or
float32 output; the rules of ``cublaslt_rules.def`` (next to this file: M, N, K > 0, not both E5M2,
K % 16 == 0, M % 8 == 0 and N % 8 == 0 (so 16-byte output rows), cuBLASLt 12.9 or newer in the build's
headers and the loaded library); the dense native module loaded; a Hopper GPU (compute capability
9.0: the only architecture with these scale modes); and cuBLASLt offering an algorithm for the exact
shape (asked once per shape through the ctypes symbol ``te_fp8_cublaslt_block_gemm_query``; this
needs the GPU). Elsewhere ``block_scaled_gemm`` takes the Gluon route (and from there the Triton
one).

The rule table is one file read twice: compiled into the module (the FFI handler's guard, the
support query, and ``te_fp8_cublaslt_block_gemm_static_reason``, which :func:`static_unavailable_reason`
asks wherever the module is loaded) and read here by :func:`rules_reason` only where it is not (as far
as the rules go without the module's cuBLASLt versions; the CPU tests).

Status: built and syntax-checked without a GPU; not yet run or measured on one.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
import re

import jax
import jax.numpy as jnp

from te_ops._core import native as _native
from te_ops.fp8.recipes import E4M3, E5M2

MODULE = "_native_cublaslt"
TARGET = "te_fp8_cublaslt_block_gemm"
# The native symbols' codes: an operand's format is its a_e5m2 / b_e5m2 value, the output's its out_bytes.
FORMAT_CODES = {jnp.dtype(E4M3): 0, jnp.dtype(E5M2): 1}
OUT_BYTES = {jnp.dtype(jnp.bfloat16): 2, jnp.dtype(jnp.float32): 4}
RULES_FILE = pathlib.Path(__file__).with_name("cublaslt_rules.def")
# The rule table's values: those of a call, in the order of the native symbols' ints, then the two
# cuBLASLt versions only the native module knows.
VALUES = ("m", "n", "k", "a_e5m2", "b_e5m2", "out_bytes")
VERSIONS = ("header", "runtime")


class _Value(int):
    """A rule value in a message: ``{name}`` its decimal, ``{name:v}`` a cuBLASLt version (12.9.0)."""

    def __format__(self, spec: str) -> str:
        if spec == "v":
            return f"{self // 10000}.{self // 100 % 100}.{self % 100}"
        return format(int(self), spec)


@functools.cache
def rules() -> tuple[tuple[str, object, str], ...]:
    """The rule table (``cublaslt_rules.def``) as Python reads it: (condition as written, the
    condition compiled, message) in order."""
    out = []
    for line in RULES_FILE.read_text().splitlines():
        if not line.startswith("TE_FP8_BLOCK_RULE("):
            continue
        match = re.fullmatch(r'TE_FP8_BLOCK_RULE\(([^"]+), "([^"\\]*)"\)', line.strip())
        if match is None:
            raise ValueError(f"{RULES_FILE.name}: cannot read the rule {line!r}")
        cond, msg = match.groups()
        code = compile(cond.replace("||", " or ").replace("&&", " and "), RULES_FILE.name, "eval")
        unknown = set(code.co_names) - {*VALUES, *VERSIONS}
        if unknown:
            raise ValueError(f"{RULES_FILE.name}: the rule {cond!r} names {sorted(unknown)}, not rule values")
        out.append((cond, code, msg))
    return tuple(out)


def rules_reason(values: dict[str, int]) -> str | None:
    """The first rule of the table that holds for ``values`` (names of VALUES and VERSIONS), formatted;
    None when none does. The reading stops at the first rule naming a value not given: without the
    native module the cuBLASLt versions are unknown, and their rules come last."""
    for _, code, msg in rules():
        if not set(code.co_names) <= values.keys():
            return None
        if eval(code, {"__builtins__": {}}, dict(values)):
            return msg.format_map({name: _Value(v) for name, v in values.items()})
    return None


def _ints(m: int, n: int, k: int, out_dtype, a_dtype, b_dtype) -> tuple[int, ...]:
    """The call as the rule values (VALUES order); the dtypes must be ones the route takes."""
    fa, fb = FORMAT_CODES[jnp.dtype(a_dtype)], FORMAT_CODES[jnp.dtype(b_dtype)]
    return int(m), int(n), int(k), fa, fb, OUT_BYTES[jnp.dtype(out_dtype)]


def native_static_reason(ints: tuple[int, ...]) -> str | None:
    """The rule table as compiled into te_ops._native_cublaslt, with its cuBLASLt versions
    (``te_fp8_cublaslt_block_gemm_static_reason``; no GPU needed): the first rule that holds for the
    rule values ``ints``, or None."""
    rc, why = _native.ctypes_query(MODULE, "te_fp8_cublaslt_block_gemm_static_reason", ints)
    return why if rc else None


@functools.cache
def versions() -> tuple[int, int] | str:
    """(header version the module was built against, version of the cuBLASLt loaded now), or why they
    cannot be read. No GPU needed. For diagnostics and tests: the rules ask the module themselves."""
    try:
        fn = _native.ctypes_library(MODULE).te_cublaslt_version
    except (ImportError, OSError, AttributeError) as e:
        return f"cannot reach te_cublaslt_version in te_ops.{MODULE}: {e}"
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int]
    return int(fn(0)), int(fn(1))


def static_unavailable_reason(
    m: int, n: int, k: int, out_dtype, *, a_dtype, b_dtype, has_bias: bool = False
) -> str | None:
    """Why the cuBLASLt route cannot take ``[M, K] x [N, K]^T -> [M, N]`` by the rules that need no
    GPU (None if it can as far as they go): the bias and the dtypes here, then the rule table: the
    module's answer where it is loaded, else this file's reading of it and the module's absence."""
    if has_bias:
        return ("the cuBLASLt route takes no bias (cuBLASLt's FP8 bias is bf16; te_ops.fp8 adds a float32 bias "
                "before the one rounding): the Gluon / Triton kernels take calls with a bias")  # fmt: skip
    for name, dt in (("a", a_dtype), ("b", b_dtype)):
        if jnp.dtype(dt) not in FORMAT_CODES:
            return f"the cuBLASLt route takes float8_e4m3fn or float8_e5m2 operands, got {name} {jnp.dtype(dt)}"
    if jnp.dtype(out_dtype) not in OUT_BYTES:
        return f"the cuBLASLt route writes bfloat16 or float32, got {jnp.dtype(out_dtype)}"
    ints = _ints(m, n, k, out_dtype, a_dtype, b_dtype)
    missing = _native.op_unavailable_reason(MODULE, "dense")
    if missing is None:
        return native_static_reason(ints)
    return rules_reason(dict(zip(VALUES, ints, strict=True))) or missing


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
def query(ints: tuple[int, ...], device: int = -1) -> str | None:
    """cuBLASLt's verdict for one call (the rule values ``ints``) on the GPU
    (te_fp8_cublaslt_block_gemm_query: the rule table, then the candidates the handler's plan would
    time for the exact spec); None when it has one. Cached per call shape."""
    rc, why = _native.ctypes_query(MODULE, "te_fp8_cublaslt_block_gemm_query", (device, *ints))
    return why if rc else None


def unavailable_reason(m: int, n: int, k: int, out_dtype, *, a_dtype, b_dtype, has_bias: bool = False) -> str | None:
    """Why the cuBLASLt route cannot take this call in this process (None if it can): the static rules,
    then the GPU, then cuBLASLt's candidates for the exact shape (asked once per shape)."""
    why = static_unavailable_reason(m, n, k, out_dtype, a_dtype=a_dtype, b_dtype=b_dtype, has_bias=has_bias)
    if why:
        return why
    return _device_reason() or query(_ints(m, n, k, out_dtype, a_dtype, b_dtype))


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
