"""CUDA implementation of the softmax family (csrc/softmax): XLA-FFI handlers, graph-safe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_ops._core import native as _native
from te_ops.softmax.reference import Residuals

_MODE = {"none": 0, "causal": 2}
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# The native module's codes (softmax_config, csrc/softmax/softmax_hooks.cc): dtype and mask mode.
_DTYPE_CODE = {"float32": 0, "bfloat16": 1, "float16": 2}
_CONFIG_MODE = {"none": 0, "mask": 1, "causal": 2}


def launch_config(dtype, rows: int, cols: int, mode: str, scale: float = 1.0) -> dict:
    """The launch the native forward picks for ``rows`` rows of ``cols`` elements of ``dtype``
    (kernel, threads per row, vectors per thread, grid, block), under the current tuning hook;
    ``mode`` is "none", "mask" or "causal". A diagnostic for tests and benchmarks."""
    name = jnp.dtype(dtype).name
    if name not in _DTYPE_CODE:
        raise ValueError(f"launch_config: dtype must be one of {sorted(_DTYPE_CODE)}, got {name}")
    if mode not in _CONFIG_MODE:
        raise ValueError(f"launch_config: mode must be one of {sorted(_CONFIG_MODE)}, got {mode!r}")
    return dict(_native.module().softmax_config(_DTYPE_CODE[name], rows, cols, _CONFIG_MODE[mode], scale))


def _as_rows(x: jax.Array) -> jax.Array:
    return x.reshape(1, *x.shape) if x.ndim == 1 else x


def forward(x: jax.Array, mask: jax.Array | None = None, *, mode: str, scale: float):
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if mode == "mask":
        y = _native.ffi_call("te_masked_softmax_fwd", out, x, mask, scale=np.float32(scale))
    else:
        y = _native.ffi_call(
            "te_softmax_fwd",
            jax.ShapeDtypeStruct(_as_rows(x).shape, x.dtype),
            _as_rows(x),
            vmap_method="broadcast_all",
            scale=np.float32(scale),
            mode=np.int32(_MODE[mode]),
        ).reshape(x.shape)
    return y, Residuals(y, mask if mode == "mask" else None)


def backward(res: Residuals, dy: jax.Array, *, mode: str, scale: float) -> jax.Array:
    y = res.y
    out = jax.ShapeDtypeStruct(y.shape, y.dtype)
    dy = dy.astype(y.dtype)
    if mode == "mask":
        return _native.ffi_call("te_masked_softmax_bwd", out, y, dy, res.mask, scale=np.float32(scale))
    return _native.ffi_call(
        "te_softmax_bwd",
        jax.ShapeDtypeStruct(_as_rows(y).shape, y.dtype),
        _as_rows(y),
        _as_rows(dy),
        vmap_method="broadcast_all",
        scale=np.float32(scale),
        mode=np.int32(_MODE[mode]),
    ).reshape(y.shape)


def unsupported_reason(*, dtype, mode: str, x_shape, mask_shape=None, **_) -> str | None:
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
        return f"native softmax supports float32, bfloat16 and float16, got {jnp.dtype(dtype)}"
    if mode == "mask" and len(x_shape) != 4:
        return f"native masked softmax needs x of rank 4, got shape {x_shape}"
    return None
