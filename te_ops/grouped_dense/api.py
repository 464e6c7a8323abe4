"""Public grouped_dense op: validation, custom VJP, registration and implementation dispatch.

Sharding rules (expert parallel, tensor parallel) and the vmap behaviour are in ``sharding.py``.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from te_ops._core import registry
from te_ops._core import triton_bridge as tb
from te_ops._core.partitioning import batch_folding, match_vma, partitioned
from te_ops._core.validation import check_float, check_groups, check_int_array, err, is_master_kernel, sequential_fold
from te_ops.grouped_dense import reference as ref
from te_ops.grouped_dense import sharding
from te_ops.grouped_dense import triton as tri
from te_ops.grouped_dense.reference import Residuals

OP = "grouped_dense"
FAMILY = registry.family(OP)
FAMILY.register(
    registry.Implementation(
        name="triton",
        forward=tri.forward,
        backward=tri.backward,
        unsupported_reason=tri.unsupported_reason,
        platform="cuda",
        available=lambda: tb.unavailable_reason(),
    )
)
FAMILY.register(registry.Implementation(name=registry.REFERENCE, forward=ref.forward, backward=ref.backward))


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _validate(x, kernels, group_sizes, bias):
    x = check_float(OP, "x", x)
    kernels = check_float(OP, "kernels", kernels)
    if x.ndim != 2:
        raise ValueError(
            err(
                OP,
                f"x must have rank 2 [M, K], got shape {tuple(x.shape)}. Flatten the token axes first, e.g. "
                "x.reshape(-1, x.shape[-1]).",
            )
        )
    if kernels.ndim != 3:
        raise ValueError(
            err(
                OP,
                f"kernels must have rank 3 [G, K, N], got shape {tuple(kernels.shape)}. Stack one [K, N] "
                "kernel per group.",
            )
        )
    m, k = x.shape
    g, k2, n = kernels.shape
    if k2 != k:
        raise ValueError(
            err(
                OP,
                f"kernels must be [G, K, N] with K = x.shape[1] = {k}, got kernels shape "
                f"{tuple(kernels.shape)}. Transpose the kernels if they are [G, N, K].",
            )
        )
    check_groups(OP, kernels)
    if jnp.dtype(x.dtype) != jnp.dtype(kernels.dtype) and not _master(x, kernels):
        raise TypeError(
            err(
                OP,
                f"kernels must have x's dtype, or be float32 master kernels with a bfloat16 or float16 x; got "
                f"x {jnp.dtype(x.dtype)} and kernels {jnp.dtype(kernels.dtype)}. Cast one of them, e.g. "
                "kernels.astype(x.dtype).",
            )
        )
    group_sizes = check_int_array(OP, "group_sizes", group_sizes, dtype=jnp.int32)
    if group_sizes.shape != (g,):
        raise ValueError(
            err(
                OP,
                f"group_sizes must have shape [G] = ({g},) (one size per kernel), got shape "
                f"{tuple(group_sizes.shape)}.",
            )
        )
    if bias is not None:
        bias = check_float(OP, "bias", bias)
        if bias.shape != (g, n):
            raise ValueError(
                err(OP, f"bias must have shape [G, N] = ({g}, {n}), got {tuple(bias.shape)}. Pass one row per kernel.")
            )
    return x, kernels, group_sizes, bias


# ----------------------------------------------------------------------------------------------
# The custom_vjp op, built once per static configuration.
# ----------------------------------------------------------------------------------------------


def _master(x, kernels) -> bool:
    """float32 kernels with a bfloat16 / float16 x: cast to x's dtype inside the op, float32 dkernels."""
    return is_master_kernel(x.dtype, kernels.dtype)


def _call_desc(x, kernels):
    m, k = x.shape
    g, _, n = kernels.shape
    return dict(dtype=x.dtype, kernels_dtype=kernels.dtype, m=m, k=k, n=n, g=g)


@functools.cache
def _build(implementation: str | None, has_bias: bool, tuning: tuple | None, master: bool = False):
    """``tuning``: the Triton tile configurations active when the op was called (benchmark sweeps);
    re-entered around the dispatch because the partition callback may trace the impl later.
    ``master``: float32 kernels with a 16-bit x; the op casts them to x's dtype (the forward and dx
    GEMMs and the residual use the cast) and the backward writes dkernels in float32 (the wgrad
    kernel's float32 accumulator rounded once, to float32: no rounding to x's dtype and no separate
    cast pass over the gradient, which is what ``kernels.astype(x.dtype)`` outside the op costs)."""
    statics = dict(has_bias=has_bias)
    bwd_statics = dict(has_bias=has_bias, wgrad_dtype=jnp.dtype(jnp.float32) if master else None)

    def cast(x, kernels):
        return kernels.astype(x.dtype) if master else kernels

    def tuned():
        return tri.config_override(*tuning) if tuning is not None else contextlib.nullcontext()

    def fwd_impl(x, kernels, group_sizes, *bias):
        b = bias[0] if bias else None
        with tuned():
            y, _ = FAMILY.dispatch(
                implementation, "forward", (x, kernels, group_sizes, b), statics, _call_desc(x, kernels)
            )
        return y

    def bwd_impl(x, kernels, group_sizes, dy):
        with tuned():
            dx, dk, db = FAMILY.dispatch(
                implementation,
                "backward",
                (Residuals(x, kernels, group_sizes), dy),
                bwd_statics,
                _call_desc(x, kernels),
            )
        if db is None:
            db = jnp.zeros((kernels.shape[0], dy.shape[1]), jnp.float32)
        return dx, dk, db.astype(jnp.float32)

    fwd_part = partitioned(fwd_impl, rule=sharding.forward_rule, specs=sharding.forward_specs)
    bwd_part = partitioned(
        bwd_impl, rule=sharding.backward_rule, plan=functools.partial(sharding.backward_plan, impl=bwd_impl)
    )
    fwd_call = batch_folding(fwd_part, sequential_fold(fwd_part))
    bwd_call = batch_folding(bwd_part, sequential_fold(bwd_part))

    if has_bias:

        @jax.custom_vjp
        def op(x, kernels, group_sizes, bias):
            return fwd_call(x, cast(x, kernels), group_sizes, bias)

        def op_fwd(x, kernels, group_sizes, bias):
            kernels = cast(x, kernels)
            return fwd_call(x, kernels, group_sizes, bias), (Residuals(x, kernels, group_sizes), bias)

        def op_bwd(saved, dy):
            res, bias = saved
            dx, dk, db = bwd_call(res.x, res.kernels, res.group_sizes, dy)
            return dx, dk, None, db.astype(bias.dtype)

    else:

        @jax.custom_vjp
        def op(x, kernels, group_sizes):
            return fwd_call(x, cast(x, kernels), group_sizes)

        def op_fwd(x, kernels, group_sizes):
            kernels = cast(x, kernels)
            return fwd_call(x, kernels, group_sizes), Residuals(x, kernels, group_sizes)

        def op_bwd(res, dy):
            dx, dk, _ = bwd_call(res.x, res.kernels, res.group_sizes, dy)
            return dx, dk, None

    op.defvjp(op_fwd, op_bwd)
    return op


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def grouped_dense(
    x: jax.Array,
    kernels: jax.Array,
    group_sizes: jax.Array,
    bias: jax.Array | None = None,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """Grouped GEMM for MoE experts: consecutive row groups of ``x``, each times its own kernel.

    Group ``g`` is the rows ``[start[g], end[g])`` of ``x``, multiplied by ``kernels[g]`` (plus
    ``bias[g]``); every other row of the output is zero. With ``S[g]`` the exact prefix sum of
    ``max(group_sizes, 0)`` up to and including ``g``: ``end[g] = min(S[g], M)`` and
    ``start[g] = end[g - 1]`` (``start[0] = 0``). Maths in fp32, output in x's dtype. Gradients: dx
    (zero on the rows of no group), dkernels (per-group ``x_g^T dy_g``), dbias (per-group row sums
    of dy); an empty group gets zero dkernels and dbias; no gradient for ``group_sizes``.

    The sizes live on the device (no host synchronisation: the op is CUDA-graph safe), so they
    cannot be checked when the op is traced. Sizes that do not fit have this defined result on every
    implementation: a negative size counts as 0; when the sizes sum past M, the group that crosses
    row M is cut at M and the groups after it are empty (zero dkernels, zero dbias); the prefix sum
    does not wrap around, whatever the int32 values.

    Equivalent to::

        ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), M)   # (exact, no int32 wrap)
        starts = jnp.concatenate([jnp.zeros(1, int), ends[:-1]])
        y = jnp.zeros((M, N), jnp.float32)
        for g in range(G):
            rows = slice(starts[g], ends[g])
            y = y.at[rows].set(x[rows].astype(jnp.float32) @ kernels[g] + bias[g])
        y = y.astype(x.dtype)

    Empty axes: M = 0 or N = 0 give an empty output; K = 0 gives ``bias[g]`` on the rows of group
    ``g`` (zero without a bias).

    Args:
      x: ``[M, K]`` float32, bfloat16 or float16, rows grouped by expert.
      kernels: ``[G, K, N]`` (G >= 1), x's dtype; or float32 "master" kernels with a bfloat16 or
        float16 x: the op casts them to x's dtype itself (the output equals
        ``grouped_dense(x, kernels.astype(x.dtype), ...)`` bit for bit) and returns dkernels in
        float32, the float32 accumulation not rounded to x's dtype (and no separate cast pass over
        the gradient, which a cast before the call costs).
      group_sizes: int32 ``[G]``, normally ``>= 0`` with ``sum <= M`` (see above otherwise).
      bias: optional ``[G, N]`` float32, bfloat16 or float16.
      implementation: None (best available: "triton" on CUDA for bf16/fp16 with K and N multiples of
        8, else "reference"), "triton" or "reference".

    Returns:
      ``[M, N]`` array of x's dtype.

    Raises:
      TypeError: an argument missing (None) or of the wrong dtype (integer, bool or complex x or
        kernels, x and kernels of different dtypes other than float32 master kernels with a
        16-bit x, group_sizes not int32).
      ValueError: wrong ranks or shapes, or G = 0.

    Sharding: expert parallel (G sharded with x's rows on the same mesh axis, each shard holding its
    local experts' rows) or tensor parallel (N sharded); see ``te_ops/grouped_dense/sharding.py``.
    """
    x, kernels, group_sizes, bias = _validate(x, kernels, group_sizes, bias)
    op = _build(implementation, bias is not None, tri.current_override(), _master(x, kernels))
    if bias is not None:
        return op(*match_vma(x, kernels, group_sizes, bias))
    return op(*match_vma(x, kernels, group_sizes))
