"""Public dense op: validation, custom VJP, sharding, vmap and implementation dispatch."""

from __future__ import annotations

import functools
import math

import jax

from te_ops._core import registry
from te_ops._core.partitioning import batch_folding, match_vma, partitioned
from te_ops._core.validation import check_float, err
from te_ops.dense import native, reference, sharding
from te_ops.dense.reference import ACTIVATIONS, SAVES_PRE_ACTIVATION, Residuals

FAMILY = registry.family("dense")
OP = "dense"
# implementation=None picks the cuBLASLt handler only for GEMMs large enough for it to be measured at
# or above XLA's GEMM, and keeps XLA for the others: for few rows (M < 1024) XLA was faster, and for a
# router-sized N or K (< 128) cuBLASLt may offer no algorithm for the weight-gradient GEMM at all.
# implementation="native" still takes any shape.
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


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _check(x, kernel, bias, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(
            err(
                OP,
                f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}. Use activation='gelu' "
                "(exact erf GELU), 'gelu_tanh' (jax.nn.gelu's default tanh approximation), 'relu', 'silu', "
                "or None and apply other activations yourself.",
            )
        )
    x = check_float(OP, "x", x)
    kernel = check_float(OP, "kernel", kernel)
    if x.ndim < 1:
        raise ValueError(
            err(
                OP,
                "x must have rank >= 1 with the contraction axis last ([..., K]), got a scalar of shape "
                f"{tuple(x.shape)}. Reshape it, e.g. x.reshape(1, -1).",
            )
        )
    if kernel.ndim != 2:
        raise ValueError(
            err(
                OP,
                f"kernel must have rank 2 [K, N], got shape {tuple(kernel.shape)}. For a kernel with several "
                "output axes, reshape it to [K, N] and the result back.",
            )
        )
    if kernel.dtype != x.dtype:
        raise TypeError(
            err(
                OP,
                f"x and kernel must have the same dtype (the compute dtype), got x {x.dtype} and kernel "
                f"{kernel.dtype}. Cast one of them, e.g. kernel.astype(x.dtype).",
            )
        )
    if x.shape[-1] != kernel.shape[0]:
        raise ValueError(
            err(
                OP,
                f"the last axis of x (K = {x.shape[-1]}, x shape {tuple(x.shape)}) must equal the first axis "
                f"of kernel (got {kernel.shape[0]}, kernel shape {tuple(kernel.shape)}). The kernel is laid "
                "out [K, N] (in_features, out_features); transpose it if it is [N, K].",
            )
        )
    if bias is not None:
        bias = check_float(OP, "bias", bias)
        if bias.dtype != x.dtype:
            raise TypeError(
                err(
                    OP,
                    f"bias must have the compute dtype {x.dtype}, got {bias.dtype}. Cast it, e.g. "
                    "bias.astype(x.dtype).",
                )
            )
        if bias.shape != (kernel.shape[1],):
            raise ValueError(
                err(
                    OP,
                    f"bias must have shape [N] = ({kernel.shape[1]},) (N = kernel.shape[1]), got shape "
                    f"{tuple(bias.shape)}. Pass one value per output feature.",
                )
            )
    return x, kernel, bias


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

        def partial_sums(x, kernel):
            desc = _call_desc(x, kernel, None, False, "partial")
            p_statics = dict(activation=None, has_bias=False, mode="partial")
            z, _ = FAMILY.dispatch(implementation, "forward", (x, kernel, None), p_statics, desc)
            return z

        def epilogue(z, bias, dtype):
            y, saved = reference.epilogue(z, bias, activation=activation, dtype=dtype, save=n_results == 2)
            return (y, saved) if n_results == 2 else y

        part = partitioned(
            full,
            rule=functools.partial(sharding.forward_rule, n_results=n_results),
            plan=functools.partial(sharding.forward_plan, partial=partial_sums, epilogue=epilogue, n_results=n_results),
        )
        fold = sharding.forward_fold(part, activation=activation, has_bias=has_bias, mode=mode, n_results=n_results)
        return batch_folding(part, fold)

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

    bwd_part = partitioned(
        bwd_full,
        rule=functools.partial(sharding.backward_rule, has_bias=has_bias),
        plan=functools.partial(sharding.backward_plan, full=bwd_full, has_bias=has_bias),
    )
    bwd_call = batch_folding(
        bwd_part, sharding.backward_fold(activation=activation, has_bias=has_bias, has_saved=has_saved)
    )

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

    Empty axes follow the formula above on every implementation: M = 0 (any leading axis of x of
    length 0) or N = 0 gives an empty output and zero-sized or zero gradients; K = 0 is an empty
    sum, so ``y = activation(bias)`` on every row (``activation(0)`` without a bias), dx and
    dkernel are empty and ``dbias = sum over rows of dy * activation'(bias)``.

    Raises:
      TypeError: x or kernel missing (None), not float32/bfloat16/float16 (integer, bool, complex,
        float64), or of different dtypes; bias not of x's dtype.
      ValueError: a scalar x, a kernel not of rank 2, ``x.shape[-1] != kernel.shape[0]``, a bias not
        of shape ``[N]``, or an unknown activation.

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
