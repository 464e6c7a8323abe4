"""Public dense op: validation, custom VJP, sharding, vmap and implementation dispatch."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from te_ops._core import partitioning as P
from te_ops._core import registry
from te_ops._core.partitioning import match_vma
from te_ops.dense import native, reference, sharding
from te_ops.dense.reference import ACTIVATIONS, SAVES_PRE_ACTIVATION, Residuals

FAMILY = registry.family("dense")
# implementation=None picks the cuBLASLt handler only for GEMMs where the H200 measured it at or
# above XLA (2026-12-03: 16384x4096x14336 fwd 1.11x, 8192^3 1.05x) and keeps XLA for small ones:
# M=256 ran at 0.73x XLA, and for a router-sized N=16 the weight-gradient GEMM (m=16, k=16384) got
# no cuBLASLt algorithm at all. implementation="native" still takes any shape.
_AUTO_MIN_M, _AUTO_MIN_NK = 1024, 128


def _auto_native(*, x_shape, kernel_shape, **_) -> bool:
    m = math.prod(x_shape[:-1])
    return m >= _AUTO_MIN_M and min(kernel_shape) >= _AUTO_MIN_NK


FAMILY.register(
    registry.Implementation(
        name="native",
        forward=native.forward,
        backward=native.backward,
        unsupported_reason=native.unsupported_reason,
        platform="cuda",
        # Default on CUDA since tests/gpu/test_dense_gpu.py passed 67/67 on the H200 (2026-12-03),
        # for GEMMs large enough to be measured faster than XLA (see _auto_native).
        auto=_auto_native,
        available=registry.native_available("_native_cublaslt", "dense"),
    )
)
FAMILY.register(
    registry.Implementation(
        name=registry.REFERENCE,
        forward=reference.forward,
        backward=reference.backward,
        unsupported_reason=reference.unsupported_reason,
    )
)

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _as_array(name: str, a: Any) -> jax.Array:
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        try:
            a = jnp.asarray(a)
        except TypeError as e:
            raise TypeError(f"te_ops.dense: {name} must be an array, got {type(a).__name__}.") from e
    return a


def _check(x, kernel, bias, activation):
    x = _as_array("x", x)
    kernel = _as_array("kernel", kernel)
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"te_ops.dense: activation must be one of {list(ACTIVATIONS)}, got {activation!r}. "
            "Use activation='gelu' (exact erf GELU), 'gelu_tanh' (jax.nn.gelu's default tanh approximation), "
            "'relu', 'silu', or None and apply other activations yourself."
        )
    if x.ndim < 1:
        raise ValueError(
            f"te_ops.dense: x must have rank >= 1 with the contraction axis last ([..., K]), got a scalar "
            f"of shape {tuple(x.shape)}. Reshape it, e.g. x.reshape(1, -1)."
        )
    if kernel.ndim != 2:
        raise ValueError(
            f"te_ops.dense: kernel must have rank 2 [K, N], got shape {tuple(kernel.shape)}. "
            "For a kernel with several output axes, reshape it to [K, N] and the result back."
        )
    for name, a in (("x", x), ("kernel", kernel)):
        if jnp.dtype(a.dtype) not in _FLOAT_DTYPES:
            raise TypeError(
                f"te_ops.dense: {name} must be float32, bfloat16 or float16, got dtype {jnp.dtype(a.dtype)}. "
                f"Cast it first, e.g. {name}.astype(jnp.bfloat16)."
            )
    if kernel.dtype != x.dtype:
        raise TypeError(
            f"te_ops.dense: x and kernel must have the same dtype (the compute dtype), got x {x.dtype} and "
            f"kernel {kernel.dtype}. Cast one of them, e.g. kernel.astype(x.dtype)."
        )
    if x.shape[-1] != kernel.shape[0]:
        raise ValueError(
            f"te_ops.dense: the last axis of x (K = {x.shape[-1]}, x shape {tuple(x.shape)}) must equal the "
            f"first axis of kernel (got {kernel.shape[0]}, kernel shape {tuple(kernel.shape)}). "
            "The kernel is laid out [K, N] (in_features, out_features); transpose it if it is [N, K]."
        )
    if bias is not None:
        bias = _as_array("bias", bias)
        if bias.dtype != x.dtype:
            raise TypeError(
                f"te_ops.dense: bias must have the compute dtype {x.dtype}, got {bias.dtype}. "
                f"Cast it, e.g. bias.astype(x.dtype)."
            )
        if bias.shape != (kernel.shape[1],):
            raise ValueError(
                f"te_ops.dense: bias must have shape [N] = ({kernel.shape[1]},) (N = kernel.shape[1]), got "
                f"shape {tuple(bias.shape)}. Pass one value per output feature."
            )
    return x, kernel, bias


# ----------------------------------------------------------------------------------------------
# vmap. Forward: the vmapped axis of x is one more leading axis, which dense already handles, so a
# batched x with an unbatched kernel/bias is one call. A batched kernel or bias (a different weight
# per vmapped instance) is a batched GEMM: it runs the reference under jax.vmap (XLA's batched dot).
# Backward: dkernel/dbias are per vmapped instance (a batched GEMM), so the backward under vmap runs
# the reference under jax.vmap as well.
# ----------------------------------------------------------------------------------------------


def _fwd_fold(call, activation, has_bias, mode, n_results):
    def outputs(y, res):
        if n_results == 1:
            return y
        return y, res.saved

    def fold(axis_size, in_batched, *args):
        x_b, k_b = in_batched[0], in_batched[1]
        b_b = in_batched[2] if has_bias else False
        if x_b and not k_b and not b_b:
            out = call(*args)
            return out, (True,) * n_results if n_results > 1 else True

        def one(x, kernel, *bias):
            y, res = reference.forward(
                x, kernel, bias[0] if bias else None, activation=activation, has_bias=has_bias, mode=mode
            )
            return outputs(y, res)

        in_axes = tuple(0 if b else None for b in in_batched)
        out = jax.vmap(one, in_axes=in_axes, axis_size=axis_size)(*args)
        return out, (True,) * n_results if n_results > 1 else True

    return fold


def _bwd_fold(activation, has_bias, has_saved):
    def fold(axis_size, in_batched, *args):
        def one(x, kernel, *rest):
            saved = rest[0] if has_saved else None
            dy = rest[-1]
            dx, dk, db = reference.backward(
                Residuals(x, kernel, saved), dy, activation=activation, has_bias=has_bias
            )
            return (dx, dk, db) if has_bias else (dx, dk)

        in_axes = tuple(0 if b else None for b in in_batched)
        out = jax.vmap(one, in_axes=in_axes, axis_size=axis_size)(*args)
        return out, (True,) * len(out)

    return fold


# ----------------------------------------------------------------------------------------------
# The custom_vjp op, built once per static configuration.
# ----------------------------------------------------------------------------------------------


def _call_desc(x, kernel, activation, has_bias, mode):
    return dict(
        dtype=x.dtype,
        x_shape=tuple(x.shape),
        kernel_shape=tuple(kernel.shape),
        activation=activation,
        has_bias=has_bias,
        mode=mode,
    )


@functools.cache
def _build(activation: str | None, has_bias: bool, implementation: str | None):
    has_saved = activation is not None  # relu saves y, the others z

    def make_fwd(mode: str):
        statics = dict(activation=activation, has_bias=has_bias, mode=mode)
        # relu's residual is y itself, so only the pre-activation activations return a second output
        n_results = 2 if (mode == "train" and activation in SAVES_PRE_ACTIVATION) else 1

        def full(x, kernel, *bias):
            b = bias[0] if bias else None
            desc = _call_desc(x, kernel, activation, has_bias, mode)
            y, res = FAMILY.dispatch(implementation, "forward", (x, kernel, b), statics, desc)
            return (y, res.saved) if n_results == 2 else y

        def row_parallel(k_axes, scatter_dim):
            p_statics = dict(activation=None, has_bias=False, mode="partial")

            def fn(x, kernel, *bias):
                desc = _call_desc(x, kernel, None, False, "partial")
                z, _ = FAMILY.dispatch(implementation, "forward", (x, kernel, None), p_statics, desc)
                if scatter_dim is None:
                    z = jax.lax.psum(z, k_axes)
                else:
                    z = jax.lax.psum_scatter(z, k_axes, scatter_dimension=scatter_dim, tiled=True)
                y, saved = reference.epilogue(
                    z, bias[0] if bias else None, activation=activation, dtype=x.dtype, save=n_results == 2
                )
                return (y, saved) if n_results == 2 else y

            return fn

        part = sharding.forward_partitioned(full, row_parallel, has_bias=has_bias, n_results=n_results)
        return P.batch_folding(part, _fwd_fold(part, activation, has_bias, mode, n_results))

    fwd_primal = make_fwd("primal")
    fwd_train = make_fwd("train")

    bwd_statics = dict(activation=activation, has_bias=has_bias)

    def bwd_full(x, kernel, *rest):
        saved = rest[0] if has_saved else None
        dy = rest[-1]
        res = Residuals(x, kernel, saved)
        desc = _call_desc(x, kernel, activation, has_bias, "train")
        dx, dk, db = FAMILY.dispatch(implementation, "backward", (res, dy), bwd_statics, desc)
        return (dx, dk, db) if has_bias else (dx, dk)

    bwd_part = sharding.backward_partitioned(bwd_full, has_bias=has_bias, has_saved=has_saved)
    bwd_call = P.batch_folding(bwd_part, _bwd_fold(activation, has_bias, has_saved))

    def fwd_args(x, kernel, bias):
        return (x, kernel, bias) if has_bias else (x, kernel)

    @jax.custom_vjp
    def op(x, kernel, bias):
        return fwd_primal(*fwd_args(x, kernel, bias))

    def op_fwd(x, kernel, bias):
        out = fwd_train(*fwd_args(x, kernel, bias))
        if activation in SAVES_PRE_ACTIVATION:
            y, saved = out
        else:
            y, saved = out, (out if activation == "relu" else None)
        return y, (x, kernel, saved)

    def op_bwd(res, g):
        x, kernel, saved = res
        args = (x, kernel) + ((saved,) if has_saved else ()) + (g.astype(x.dtype),)
        grads = bwd_call(*args)
        return (grads[0], grads[1], grads[2] if has_bias else None)

    op.defvjp(op_fwd, op_bwd)
    return op


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    activation: str | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """``activation(x @ kernel + bias)`` with float32 accumulation, output in the compute dtype.

    Equivalent to::

        z = jnp.matmul(x.astype(jnp.float32), kernel.astype(jnp.float32)) + bias.astype(jnp.float32)
        y = act(z).astype(x.dtype)   # act: jax.nn.gelu(z, approximate=False) for "gelu",
                                     # jax.nn.gelu(z) for "gelu_tanh", jax.nn.relu, jax.nn.silu

    On CUDA the native implementation runs one cuBLASLt GEMM with bias (and relu / tanh-GELU) fused
    into its epilogue; the backward returns dx, dkernel and dbias. Sharding: the leading axes of x
    (data parallel), N (column parallel) and K (row parallel: one reduction of partial sums, then
    bias and activation) may be sharded.

    Args:
      x: ``[..., K]`` float32, bfloat16 or float16.
      kernel: ``[K, N]``, same dtype as x.
      bias: ``[N]``, same dtype as x, or None.
      activation: None, "gelu" (exact erf), "gelu_tanh" (tanh approximation), "relu" or "silu".
      implementation: None (best available), "native" or "reference".

    Returns:
      ``[..., N]`` array of x's dtype.
    """
    x, kernel, bias = _check(x, kernel, bias, activation)
    return _build(activation, bias is not None, implementation)(*match_vma(x, kernel, bias))


__all__ = ["dense"]
