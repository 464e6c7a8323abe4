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
from te_ops.fp8.recipes import BlockScaling
from te_ops.fp8.reference import QuantizedTensor
from te_ops.grouped_dense import reference as gd_ref

OP = "fp8_grouped_dense"
F32 = jnp.float32
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _t_blocks(q: QuantizedTensor) -> QuantizedTensor:
    """[G, N, K] square-blocked -> [G, K, N] with the same blocks (exact)."""
    return QuantizedTensor(jnp.swapaxes(q.data, 1, 2), jnp.swapaxes(q.scale_inv, 1, 2), q.block, q.dtype)


def _grouped_reference(qa: QuantizedTensor, qb_t: QuantizedTensor, group_sizes, out_dtype):
    """Per group ``dequantize(qa)[rows] @ dequantize(qb_t[g])^T`` in float32; zero rows past the groups."""
    y, _ = gd_ref.forward(ref.dequantize(qa, F32), jnp.swapaxes(ref.dequantize(qb_t, F32), 1, 2), group_sizes,
                          has_bias=False)  # fmt: skip
    return y.astype(out_dtype)


def _ops(recipe, implementation):
    p2 = recipe.power_of_2
    if implementation == "triton":
        from te_ops.fp8 import triton as tri
        from te_ops.grouped_dense import triton as gd_tri

        def quant(a, role, block):
            return tri.block_quantize(a, block, recipe.format(role), power_of_2=p2)

        def gemm(qa, qb_t, gs, dtype):
            return tri.grouped_block_scaled_gemm(qa, qb_t, gs, dtype)

        def wgrad(x, dy, gs, g, dtype):
            return gd_tri.grouped_wgrad(x, dy, gs, g, cfg=gd_tri.DEFAULT_WGRAD, out_dtype=dtype)

    else:

        def quant(a, role, block):
            return ref.quantize_blocks(a, block, recipe.format(role), power_of_2=p2)

        gemm = _grouped_reference

        def wgrad(x, dy, gs, g, dtype):
            w_proto = jnp.zeros((g, x.shape[1], dy.shape[1]), dtype)
            return gd_ref.backward(gd_ref.Residuals(x, w_proto, gs), dy, has_bias=False)[1].astype(dtype)

    return quant, gemm, wgrad


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_grouped(x, kernels, group_sizes, recipe, implementation):
    return _fwd(x, kernels, group_sizes, recipe, implementation)[0]


def _fwd(x, kernels, group_sizes, recipe, implementation):
    quant, gemm, _ = _ops(recipe, implementation)
    qx = quant(x, "x", recipe.act_block)
    qw_t = quant(jnp.swapaxes(kernels, 1, 2), "w", recipe.weight_block)
    y = gemm(qx, qw_t, group_sizes, x.dtype)
    return y, (x, qw_t, group_sizes, jnp.zeros((), kernels.dtype))


def _bwd(recipe, implementation, res, dy):
    x, qw_t, group_sizes, w_proto = res
    quant, gemm, wgrad = _ops(recipe, implementation)
    dx = gemm(quant(dy, "g", recipe.act_block), _t_blocks(qw_t), group_sizes, dy.dtype)
    dk = wgrad(x, dy.astype(x.dtype), group_sizes, qw_t.data.shape[0], w_proto.dtype)
    return dx, dk, None


_fp8_grouped.defvjp(_fwd, _bwd)


def fp8_grouped_dense(x, kernels, group_sizes, recipe: BlockScaling | None = None, *, implementation=None):
    """Grouped GEMM (MoE experts) with FP8 forward and input-gradient GEMMs (block scaling).

    ``y[rows of g] = x[rows of g] @ kernels[g]``; rows past the groups are zero. The forward and dx
    GEMMs use FP8 operands (table in the module docstring); the kernel gradient is computed in x's
    dtype with float32 accumulation.

    Args:
      x: [M, K] float32, bfloat16 or float16.
      kernels: [G, K, N], x's dtype.
      group_sizes: int32 [G] on the device (grouped_dense's rule).
      recipe: :class:`~te_ops.fp8.BlockScaling` with act_block (1, 128) and weight_block (128, 128)
        (default: ``BlockScaling()``).
      implementation: None / "reference" (pure JAX) or "triton" (CUDA GPU, opt-in until it has run
        on a GPU).

    Returns:
      [M, N] in x's dtype.
    """
    recipe = BlockScaling() if recipe is None else recipe
    x = check_float(OP, "x", x, DTYPES, rank=2, layout="[M, K]")
    kernels = check_float(OP, "kernels", kernels, DTYPES, rank=3, layout="[G, K, N]")
    group_sizes = check_int_array(OP, "group_sizes", group_sizes, shape=(kernels.shape[0],))
    if not isinstance(recipe, BlockScaling) or recipe.act_block != (1, 128) or recipe.weight_block != (128, 128):
        raise ValueError(
            err(OP, f"recipe must be BlockScaling with act_block (1, 128) and weight_block (128, 128), got {recipe!r}.")
        )
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
