"""Pure-JAX grouped GEMM: the specification, the test oracle and the CPU path (fp32 maths).

Signatures shared by every grouped_dense implementation::

    forward(x, kernels, group_sizes, bias, *, has_bias) -> (y, Residuals)
    backward(res: Residuals, dy, *, has_bias) -> (dx, dkernels, dbias)

Semantics (docs/semantics.md, "Grouped GEMM"): the rows of ``x[M, K]`` come in ``G`` consecutive
groups (int32 sizes, on the device); group ``g`` is multiplied by ``kernels[g]`` (``[K, N]``) and
gets ``bias[g]``; rows of no group are zero (and get a zero ``dx``). Group ``g`` is the rows
``[end[g-1], end[g])`` with ``end[g] = min(S[g], M)`` and ``S`` the exact prefix sum of the sizes
clamped to >= 0 (:func:`group_bounds`): a negative size counts as 0, a sum past M loses the rows
that do not exist, and the prefix sum never wraps around in int32. A group with no rows gets a zero
``dkernels[g]`` and ``dbias[g]``.

Everything here is jit-compatible with device-side sizes: ``jax.lax.ragged_dot`` (a dense expansion
on GPU, fine for an oracle) plus an explicit per-row validity mask from the cumulative sizes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from te_ops.dense.reference import activate

F32 = jnp.float32


class Residuals(NamedTuple):
    x: jax.Array  # [M, K] input rows
    kernels: jax.Array  # [G, K, N]
    group_sizes: jax.Array  # int32 [G]


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """(start, end) int32 [G] row ranges of the groups: ``end[g] = min(S[g], m)`` with ``S`` the exact
    prefix sum of the sizes clamped >= 0, ``start[g] = end[g-1]``.

    A plain int32 cumsum wraps around for large sizes (e.g. two sizes of 2**31 - 1), so the ends come
    from a saturating scan, ``a (+) b = min(a + b, m)``: associative for values in [0, m], exact, and
    in uint32 ``a + b <= 2m`` cannot overflow (m < 2**31)."""
    cap = jnp.uint32(m)
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, m).astype(jnp.uint32)
    end = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, cap), sizes).astype(jnp.int32)
    start = jnp.concatenate([jnp.zeros((1,), jnp.int32), end[:-1]])
    return start, end


def clipped_sizes(group_sizes: jax.Array, m: int) -> jax.Array:
    start, end = group_bounds(group_sizes, m)
    return end - start


def segment_ids(group_sizes: jax.Array, m: int) -> jax.Array:
    """int32 [M]: the group of each row; G for rows past the last group."""
    _, end = group_bounds(group_sizes, m)
    return jnp.searchsorted(end, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def _ragged(lhs, rhs, sizes):
    return jax.lax.ragged_dot(
        lhs.astype(F32),
        rhs.astype(F32),
        sizes,
        preferred_element_type=F32,
        precision=jax.lax.Precision.HIGHEST,
    )


def forward(x, kernels, group_sizes, bias=None, *, has_bias: bool):
    m = x.shape[0]
    g = kernels.shape[0]
    sizes = clipped_sizes(group_sizes, m)
    seg = segment_ids(group_sizes, m)
    valid = (seg < g)[:, None]
    y = _ragged(x, kernels, sizes)
    if has_bias:
        y = y + jnp.take(bias.astype(F32), jnp.minimum(seg, g - 1), axis=0)
    y = jnp.where(valid, y, 0.0)
    return y.astype(x.dtype), Residuals(x, kernels, group_sizes)


def backward(res: Residuals, dy, *, has_bias: bool, wgrad_dtype=None):
    """``wgrad_dtype``: dkernels' dtype (None: the kernels'; float32 for float32 master kernels, which
    the op casts to x's dtype before the forward: dkernels then skips the rounding to x's dtype)."""
    x, kernels, group_sizes = res
    m = x.shape[0]
    g = kernels.shape[0]
    sizes = clipped_sizes(group_sizes, m)
    seg = segment_ids(group_sizes, m)
    valid = (seg < g)[:, None]
    dy32 = jnp.where(valid, dy.astype(F32), 0.0)
    dx = jnp.where(valid, _ragged(dy32, jnp.swapaxes(kernels, 1, 2), sizes), 0.0)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
    )
    dk = jax.lax.ragged_dot_general(
        jnp.where(valid, x.astype(F32), 0.0),
        dy32,
        sizes,
        dims,
        preferred_element_type=F32,
        precision=jax.lax.Precision.HIGHEST,
    )
    db = None
    if has_bias:
        db = jax.ops.segment_sum(dy32, seg, num_segments=g + 1)[:g]
    return dx.astype(x.dtype), dk.astype(wgrad_dtype or kernels.dtype), db


def ffn_activation(h: jax.Array, activation, gated: bool) -> jax.Array:
    """``act(h)`` or, gated, ``act(h[:, :F]) * h[:, F:]`` (h ``[R, 2F]``), in float32, rounded to h's
    dtype: the activation between the two expert GEMMs (grouped_ffn, the FP8 expert FFN and
    te_layers' unfused path). ``activation``: None, one of te_ops.dense's named activations or a
    callable on float32 arrays (te_layers' unfused path passes its own; the fused ops take names)."""
    act = activation if callable(activation) else functools.partial(activate, activation=activation)
    hf = h.astype(F32)
    if gated:
        f = h.shape[-1] // 2
        return (act(hf[:, :f]) * hf[:, f:]).astype(h.dtype)
    return act(hf).astype(h.dtype)


class FFNResiduals(NamedTuple):
    """grouped_ffn's residuals: its inputs, the first GEMM's output h and the activation."""

    x: jax.Array  # [M, H]
    wi: jax.Array  # [G, H, W], cast to x's dtype
    wo: jax.Array  # [G, F, O], cast to x's dtype
    group_sizes: jax.Array  # int32 [G]
    h: jax.Array  # [M, W]
    act: jax.Array  # [M, F]


def ffn_forward(x, wi, wo, group_sizes, *, activation, gated: bool):
    """grouped_ffn's forward: (y, h, act), the two grouped GEMMs and the activation between them."""
    h, _ = forward(x, wi, group_sizes, has_bias=False)
    a = ffn_activation(h, activation, gated)
    y, _ = forward(a, wo, group_sizes, has_bias=False)
    return y, h, a


def ffn_backward(res: FFNResiduals, dy, *, activation, gated: bool, wgrad_dtype=None):
    """grouped_ffn's backward: (dx, dwi, dwo), through the activation's gradient at h."""
    x, wi, wo, gs, h, a = res
    da, dwo, _ = backward(Residuals(a, wo, gs), dy, has_bias=False, wgrad_dtype=wgrad_dtype)
    dh = jax.vjp(lambda h: ffn_activation(h, activation, gated), h)[1](da)[0]
    dx, dwi, _ = backward(Residuals(x, wi, gs), dh, has_bias=False, wgrad_dtype=wgrad_dtype)
    return dx, dwi, dwo
