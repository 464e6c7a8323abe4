"""CUDA implementation of dense (csrc/dense): cuBLASLt GEMMs with fused epilogues, graph-safe.

Targets (extension module ``te_ops._native_cublaslt``):

* ``te_dense_fwd(x[M,K], kernel[K,N], bias[N] or [0]) -> y[M,N]`` (mode primal, or partial: float32
  ``x @ kernel`` for row-parallel sharding);
* ``te_dense_fwd_aux(...) -> (y, z)`` (mode train for gelu/gelu_tanh/silu: z is the pre-activation);
* ``te_dense_bwd(x, kernel, saved or [0], dy) -> (dx, dkernel, dbias or [0], dz scratch, partials
  scratch)``. The two scratch results are XLA-allocated temporaries (the handler allocates nothing);
  ``partials`` holds deterministic per-chunk column sums of dz for dbias.

Decisions (details in csrc/dense/dense_ffi.cc and dense_gemm.h):

* Layout: row-major JAX arrays are the transposes of column-major cuBLAS matrices, so the forward
  asks cuBLASLt for ``y^T = w^T x^T`` (m=N, n=M, k=K) and the backward for ``dx^T = op_T(w^T) dz^T``
  and ``dw^T = dz^T op_T(x^T)``: op flags only, no transposed copies.
* Epilogues: bias, ReLU and tanh-GELU are fused (BIAS / RELU_BIAS / GELU_BIAS; training with
  tanh-GELU uses GELU_AUX_BIAS, which also writes the pre-activation z). cuBLASLt has no exact-erf
  GELU and no SiLU epilogue: for those the GEMM fuses the bias and writes z, and a small
  elementwise kernel of ours applies the activation (the native path still wins over the
  reference's separate passes). float32 tanh-GELU uses that kernel too (precise tanhf). When
  cuBLASLt offers no algorithm for a fused epilogue (e.g. GELU_AUX with N % 8 != 0) the same split
  path is used, so odd sizes are supported.
* Backward: cuBLASLt's DGELU/DRELU epilogues apply act' to the OUTPUT of a GEMM, but in dense's
  backward act' multiplies dy, an input (it is the output of the next layer's dgrad GEMM, which
  only a fused-MLP op could use). So dz = dy * act'(saved) is one elementwise kernel fused with
  deterministic dbias partial sums; dx and dkernel are two plain GEMMs. With no activation, dbias
  comes from the BGRADA epilogue of the dkernel GEMM when cuBLASLt offers it.
* Graph safety: handle, workspace (32 MiB, cudaMalloc'd once per device), descriptors, layouts and
  the algorithm (the heuristic's top 8 timed once on scratch buffers in the initialize stage) are
  cached per (device, shape, dtype, epilogue, alignment); execute only enqueues work on XLA's
  stream. The workspace is shared by every dense call on a device, which is safe for work on one
  stream (XLA's compute stream); two streams running dense concurrently on one device would race.
* float32 inputs compute in exact float32 (CUBLAS_COMPUTE_32F, no TF32).
* Empty operands (M, K or N zero): no GEMM to run, and cuBLASLt refuses zero-sized matrices, so the
  reference computes the (trivial) result in XLA: an empty output, or for K = 0 the epilogue of an
  all-zero product (``activation(bias)`` on every row).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from te_ops._core import native as _native
from te_ops.dense import reference
from te_ops.dense.reference import SAVES_PRE_ACTIVATION, Residuals

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_ACT_CODE = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "silu": 4}
_MODE_CODE = {"primal": 0, "train": 1, "partial": 2}


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), dtype)


def partial_chunks(m: int, n: int, itemsize: int) -> int:
    """Rows of the float32 [rows, N] dbias partial-sum scratch: an upper bound of the row chunks the
    backward kernel uses (csrc/dense/dense_kernels.cu BackwardChunks: ~2048 blocks, >= 32 rows per
    chunk), taken for its widest block (256 threads x 16-byte vectors), so every compiled block shape
    fits."""
    vec = 16 // itemsize if n % (16 // itemsize) == 0 else 1
    gx = math.ceil(n / (256 * vec))
    chunks = min(math.ceil(2048 / gx), math.ceil(m / 32))
    return int(max(1, min(chunks, 65535)))


def _empty(x, kernel) -> bool:
    return math.prod(x.shape) == 0 or math.prod(kernel.shape) == 0


def forward(x, kernel, bias=None, *, activation, has_bias: bool, mode: str = "train"):
    if _empty(x, kernel):
        return reference.forward(x, kernel, bias, activation=activation, has_bias=has_bias, mode=mode)
    lead = x.shape[:-1]
    k = x.shape[-1]
    n = kernel.shape[1]
    m = math.prod(lead)
    x2 = x.reshape(m, k)
    b = bias if has_bias and mode != "partial" else jnp.zeros((0,), x.dtype)
    attrs = dict(
        activation=np.int32(_ACT_CODE[activation] if mode != "partial" else 0),
        mode=np.int32(_MODE_CODE[mode]),
        has_bias=np.int32(1 if (has_bias and mode != "partial") else 0),
    )
    if mode == "train" and activation in SAVES_PRE_ACTIVATION:
        y, z = _native.ffi_call(
            "te_dense_fwd_aux", [_sds((m, n), x.dtype), _sds((m, n), x.dtype)], x2, kernel, b, **attrs
        )
        return y.reshape(*lead, n), Residuals(x, kernel, z.reshape(*lead, n))
    out_dtype = jnp.float32 if mode == "partial" else x.dtype
    y = _native.ffi_call("te_dense_fwd", _sds((m, n), out_dtype), x2, kernel, b, **attrs).reshape(*lead, n)
    if mode == "train":
        return y, Residuals(x, kernel, y if activation == "relu" else None)
    return y, None


def backward(res: Residuals, dy, *, activation, has_bias: bool, **_):
    x, kernel = res.x, res.kernel
    if _empty(x, kernel):
        return reference.backward(res, dy, activation=activation, has_bias=has_bias)
    dtype = x.dtype
    k = x.shape[-1]
    n = kernel.shape[1]
    m = math.prod(x.shape[:-1])
    x2 = x.reshape(m, k)
    dy2 = dy.astype(dtype).reshape(m, n)
    saved = res.saved.reshape(m, n) if activation is not None else jnp.zeros((0,), dtype)
    chunks = partial_chunks(m, n, jnp.dtype(dtype).itemsize)
    results = [
        _sds((m, k), dtype),
        _sds((k, n), dtype),
        _sds((n,) if has_bias else (0,), dtype),
        _sds((m, n) if activation is not None else (0,), dtype),
        _sds((chunks, n) if has_bias else (0,), jnp.float32),
    ]
    dx, dk, db, _, _ = _native.ffi_call(
        "te_dense_bwd",
        results,
        x2,
        kernel,
        saved,
        dy2,
        activation=np.int32(_ACT_CODE[activation]),
        has_bias=np.int32(1 if has_bias else 0),
    )
    return dx.reshape(x.shape), dk, (db if has_bias else None)


def unsupported_reason(*, dtype, activation=None, **_) -> str | None:
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"native dense supports float32, bfloat16 and float16, got {jnp.dtype(dtype)}"
    if activation not in _ACT_CODE:
        return f"unknown activation {activation!r}"
    return None
