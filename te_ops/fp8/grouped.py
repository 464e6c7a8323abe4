"""``fp8_grouped_dense``: MoE experts with FP8 forward and input-gradient GEMMs.

``x [M, K]`` rows come in G consecutive groups (``group_sizes`` on the device, grouped_dense's rule:
docs/semantics.md, "Grouped GEMM"; rows past the groups give zero outputs and zero gradients);
group g is multiplied by ``kernels[g]`` (``[K, N]``). Block scaling (E4M3 by default):

================  ==============================  ==========================================
GEMM              left operand                    right operand
================  ==============================  ==========================================
y  = x @ W_g      x, 1 x 128 row tiles            W_g^T [N, K], 128 x 128 blocks per expert
dx = dy @ W_g^T   dy, 1 x 128 row tiles (role g)  the same blocks, transposed (exact)
dW_g = x_g^T dy_g x and dy in their own dtype     (high precision, float32 accumulation)
================  ==============================  ==========================================

The weight gradient stays in high precision for now: in FP8 its reduction runs over the rows of a
group, so its scales would have to tile each group from its own first row (128-aligned groups); that
is the next step. Both FP8 GEMMs multiply dequantized operands and sum in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from te_ops._core.validation import check_float, check_int_array, err, static_choice
from te_ops.fp8 import reference as ref
from te_ops.fp8.recipes import BlockScaling, CurrentScaling
from te_ops.fp8.reference import QuantizedTensor
from te_ops.grouped_dense import reference as gd_ref

OP = "fp8_grouped_dense"
F32 = jnp.float32
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _t_blocks(q: QuantizedTensor) -> QuantizedTensor:
    """[G, N, K] square-blocked (or one scale per expert) -> [G, K, N] with the same scales (exact)."""
    sinv = q.scale_inv if q.block is None else jnp.swapaxes(q.scale_inv, 1, 2)
    return QuantizedTensor(jnp.swapaxes(q.data, 1, 2), sinv, q.block, q.dtype)


def _deq(q: QuantizedTensor) -> jax.Array:
    """float32 values; a [G, ...] tensor with one scale per expert (scale_inv [G]) included."""
    if q.block is None and q.scale_inv.ndim == 1:
        return q.data.astype(F32) * q.scale_inv[:, None, None]
    return ref.dequantize(q, F32)


def _grouped_reference(qa: QuantizedTensor, qb_t: QuantizedTensor, group_sizes, out_dtype):
    """Per group ``dequantize(qa)[rows] @ dequantize(qb_t[g])^T`` in float32; zero rows past the groups."""
    y, _ = gd_ref.forward(_deq(qa), jnp.swapaxes(_deq(qb_t), 1, 2), group_sizes, has_bias=False)
    return y.astype(out_dtype)


def _as_blocks(q: QuantizedTensor, block) -> QuantizedTensor:
    """A per-tensor (x: scale_inv []) or per-expert (w: scale_inv [G]) scaled tensor viewed as
    block-scaled, its scale repeated per block: the grouped block-scaled kernel then serves it."""
    if q.block is not None:
        return q
    r, c = q.data.shape[-2:]
    grid = (-(-r // block[0]), -(-c // block[1]))
    sinv = q.scale_inv.reshape(q.scale_inv.shape + (1, 1))
    return QuantizedTensor(q.data, jnp.broadcast_to(sinv, q.scale_inv.shape + grid), tuple(block), q.dtype)


def _ops(recipe, implementation):
    p2 = recipe.power_of_2
    current = isinstance(recipe, CurrentScaling)
    if implementation == "triton":
        from te_ops.fp8 import triton as tri
        from te_ops.grouped_dense import triton as gd_tri

        def quant(a, role, block):
            fmt = recipe.format(role)
            if not current:
                return tri.block_quantize(a, block, fmt, power_of_2=p2)
            batch = a.shape[0] if a.ndim == 3 else 1  # one scale per expert for the kernels
            return tri.quantize_tensor(a, fmt, margin=recipe.margin, power_of_2=p2, batch=batch)

        def gemm(qa, qb_t, gs, dtype):
            qa, qb_t = _as_blocks(qa, (1, 128)), _as_blocks(qb_t, (128, 128))
            return tri.grouped_block_scaled_gemm(qa, qb_t, gs, dtype)

        def wgrad(x, dy, gs, g, dtype):
            return gd_tri.grouped_wgrad(x, dy, gs, g, cfg=gd_tri.DEFAULT_WGRAD, out_dtype=dtype)

    else:

        def quant(a, role, block):
            fmt = recipe.format(role)
            if not current:
                return ref.quantize_blocks(a, block, fmt, power_of_2=p2)
            one = functools.partial(ref.quantize_tensor, fmt=fmt, margin=recipe.margin, power_of_2=p2)
            return jax.vmap(one)(a) if a.ndim == 3 else one(a)  # one scale per expert for the kernels

        gemm = _grouped_reference

        def wgrad(x, dy, gs, g, dtype):
            w_proto = jnp.zeros((g, x.shape[1], dy.shape[1]), dtype)
            return gd_ref.backward(gd_ref.Residuals(x, w_proto, gs), dy, has_bias=False)[1].astype(dtype)

    return quant, gemm, wgrad


def _blocks(recipe):
    if isinstance(recipe, BlockScaling):
        return recipe.act_block, recipe.weight_block
    return None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_grouped(x, kernels, group_sizes, recipe, implementation):
    return _fwd(x, kernels, group_sizes, recipe, implementation)[0]


def _fwd(x, kernels, group_sizes, recipe, implementation):
    quant, gemm, _ = _ops(recipe, implementation)
    act, wblk = _blocks(recipe)
    qx = quant(x, "x", act)
    qw_t = quant(jnp.swapaxes(kernels, 1, 2), "w", wblk)
    y = gemm(qx, qw_t, group_sizes, x.dtype)
    return y, (x, qw_t, group_sizes, jnp.zeros((), kernels.dtype))


def _bwd(recipe, implementation, res, dy):
    x, qw_t, group_sizes, w_proto = res
    quant, gemm, wgrad = _ops(recipe, implementation)
    dx = gemm(quant(dy, "g", _blocks(recipe)[0]), _t_blocks(qw_t), group_sizes, dy.dtype)
    dk = wgrad(x, dy.astype(x.dtype), group_sizes, qw_t.data.shape[0], w_proto.dtype)
    return dx, dk, None


_fp8_grouped.defvjp(_fwd, _bwd)


def fp8_grouped_dense(
    x, kernels, group_sizes, recipe: BlockScaling | CurrentScaling | None = None, *, implementation=None
):
    """Grouped GEMM (MoE experts) with FP8 forward and input-gradient GEMMs.

    ``y[rows of g] = x[rows of g] @ kernels[g]``; rows past the groups are zero. The forward and dx
    GEMMs use FP8 operands (table in the module docstring); the kernel gradient is computed in x's
    dtype with float32 accumulation.

    Args:
      x: [M, K] float32, bfloat16 or float16.
      kernels: [G, K, N], x's dtype.
      group_sizes: int32 [G] on the device (grouped_dense's rule).
      recipe: :class:`~te_ops.fp8.BlockScaling` with act_block (1, 128) and weight_block (128, 128)
        (default: ``BlockScaling()``), or :class:`~te_ops.fp8.CurrentScaling`: one scale for x (its
        amax over all M rows, rows past the groups included), one for dy, and one per expert for
        the kernels.
      implementation: None / "reference" (pure JAX) or "triton" (CUDA GPU, opt-in: our quantize
        kernels and grouped FP8 GEMM kernel, per-tensor scales repeated per block).

    Returns:
      [M, N] in x's dtype.
    """
    recipe = BlockScaling() if recipe is None else recipe
    x = check_float(OP, "x", x, DTYPES, rank=2, layout="[M, K]")
    kernels = check_float(OP, "kernels", kernels, DTYPES, rank=3, layout="[G, K, N]")
    group_sizes = check_int_array(OP, "group_sizes", group_sizes, shape=(kernels.shape[0],))
    block_ok = isinstance(recipe, BlockScaling) and recipe.act_block == (1, 128) and recipe.weight_block == (128, 128)
    if not (block_ok or isinstance(recipe, CurrentScaling)):
        raise ValueError(
            err(OP, "recipe must be CurrentScaling, or BlockScaling with act_block (1, 128) and weight_block "
                    f"(128, 128), got {recipe!r}.")
        )  # fmt: skip
    if x.shape[1] != kernels.shape[1]:
        raise ValueError(err(OP, f"x's K = {x.shape[1]} must match kernels' K = {kernels.shape[1]} ([G, K, N])."))
    if x.dtype != kernels.dtype:
        raise TypeError(err(OP, f"x and kernels must have the same dtype, got {x.dtype} and {kernels.dtype}."))
    implementation = static_choice(OP, "implementation", implementation, (None, "reference", "triton"))
    if implementation == "triton":  # the kernel gradient runs grouped_dense's Triton wgrad kernel
        from te_ops.grouped_dense import triton as gd_tri

        why = gd_tri.unsupported_reason(dtype=x.dtype, kernels_dtype=kernels.dtype, m=x.shape[0], k=x.shape[1],
                                        n=kernels.shape[2], g=kernels.shape[0])  # fmt: skip
        if why:
            raise ValueError(err(OP, f"implementation='triton' cannot take this call: {why}."))
    return _fp8_grouped(x, kernels, group_sizes.astype(jnp.int32), recipe, implementation or "reference")
