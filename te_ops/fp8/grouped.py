"""``fp8_grouped_dense``: MoE experts with FP8 forward and input-gradient GEMMs.

``x [M, K]`` rows come in G consecutive groups (``group_sizes`` on the device, grouped_dense's rule:
docs/semantics.md, "Grouped GEMM"; rows past the groups give zero outputs and zero gradients);
group g is multiplied by ``kernels[g]`` (``[K, N]``). Block scaling (E4M3 by default):

=================  ==============================  ===========================================
GEMM               left operand                    right operand
=================  ==============================  ===========================================
y  = x @ W_g       x, 1 x 128 row tiles            W_g^T [N, K], 128 x 128 blocks per expert
dx = dy @ W_g^T    dy, 1 x 128 row tiles (role g)  the same blocks, transposed (exact)
dW_g = x_g^T dy_g  x^T [K, M], 1 x 128 tiles       dy^T [N, M], 128 x 128 blocks (role g)
                   along M (x's 128 x 1 columns)
=================  ==============================  ===========================================

The weight gradient's operands are tiled along the rows of the whole tensor (multiples of 128 rows
from row 0), not from each group's first row: a tile that straddles two groups has one scale for
both groups' rows, and each group's sum takes only its own rows of it. x^T is quantized from x in the
forward pass (the FP8 copy is the residual, not x) and dy^T from dy, both from the high-precision
tensor. With current scaling every operand has one scale (the kernels one per expert), and the
transposed copies are the exact FP8 transposes. Every GEMM multiplies dequantized operands and sums
in float32.

Delayed scaling (``state=``, a :class:`~te_ops.fp8.DenseScalingState` from
:func:`initial_grouped_state`): x and dy have one delayed scale each, the kernels one per expert
(``state.w``: amax_history ``[G, history_len]``, scale ``[G]``), each quantized and recorded with
:func:`te_ops.fp8.reference.quantize_delayed`'s rules; the updated state is the cotangent of
``state``, as in ``fp8_dense``. Per expert because experts are trained on different tokens and
their weight norms drift apart: one scale for all would be set by the largest expert and waste the
range of the others (current scaling's per-expert kernel scales, for the same reason).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from te_ops._core.validation import check_float, check_groups, check_int_array, err, static_choice
from te_ops.fp8 import reference as ref
from te_ops.fp8.dense import DenseScalingState, check_kernel_dtype
from te_ops.fp8.recipes import BlockScaling, CurrentScaling, DelayedScaling
from te_ops.fp8.reference import DelayedScalingState, QuantizedTensor
from te_ops.fp8.select import resolve, staged
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


def _t2(q: QuantizedTensor) -> QuantizedTensor:
    """The exact FP8 transpose of a per-tensor-scaled 2-D tensor."""
    return QuantizedTensor(q.data.T, q.scale_inv, q.block, q.dtype)


def _wgrad_reference(qx_t: QuantizedTensor, qdy_t: QuantizedTensor, group_sizes, g: int, out_dtype):
    """Per group ``dequantize(qx_t)[:, rows] @ dequantize(qdy_t)[:, rows]^T`` in float32."""
    x = _deq(qx_t).T
    dy = _deq(qdy_t).T
    w_proto = jnp.zeros((g, x.shape[1], dy.shape[1]), F32)
    dk = gd_ref.backward(gd_ref.Residuals(x, w_proto, group_sizes), dy, has_bias=False)[1]
    return dk.astype(out_dtype)


def _gemms(implementation):
    """(gemm, wgrad) of an implementation: the grouped block-scaled Triton kernels (per-tensor and
    per-expert scales repeated per block by :func:`_as_blocks`) or the float32 reference."""
    if implementation != "triton":
        return _grouped_reference, _wgrad_reference
    from te_ops.fp8 import triton as tri

    def gemm(qa, qb_t, gs, dtype):
        return tri.grouped_block_scaled_gemm(_as_blocks(qa, (1, 128)), _as_blocks(qb_t, (128, 128)), gs, dtype)

    def wgrad(qx_t, qdy_t, gs, g, dtype):
        qx_t, qdy_t = _as_blocks(qx_t, (1, 128)), _as_blocks(qdy_t, (128, 128))
        return tri.grouped_block_scaled_wgrad(qx_t, qdy_t, gs, g, dtype)

    return gemm, wgrad


def _ops(recipe, implementation):
    """(quant_x, quant_w_t, quant_dy, gemm, wgrad) of an implementation.

    quant_x(x) -> (x in 1 x 128 row tiles, x^T [K, M] in 1 x 128 tiles along M) and quant_dy(dy) ->
    (dy in 1 x 128 row tiles, dy^T [N, M] in 128 x 128 blocks) with block scaling; with current
    scaling one scale per tensor and the transposes exact."""
    p2 = recipe.power_of_2
    current = isinstance(recipe, CurrentScaling)
    fx, fw, fg = recipe.format("x"), recipe.format("w"), recipe.format("g")
    if implementation == "triton":
        from te_ops.fp8 import triton as tri

        def per_tensor(a, fmt, batch=1):
            return tri.quantize_tensor(a, fmt, margin=recipe.margin, power_of_2=p2, batch=batch)

        if current:

            def quant_x(x):
                q = per_tensor(x, fx)
                return q, _t2(q)

            def quant_w_t(kernels):  # one scale per expert; the exact FP8 transpose
                return _t_blocks(per_tensor(kernels, fw, kernels.shape[0]))

            def quant_dy(dy):
                q = per_tensor(dy, fg)
                return q, _t2(q)

        else:

            def quant_x(x):
                return tri.dual_quantize(x, 128, fx, power_of_2=p2)

            def quant_w_t(kernels):  # square blocks: the FP8 transpose is exact (half the bytes of a bf16 one)
                return _t_blocks(tri.block_quantize(kernels, (128, 128), fw, power_of_2=p2))

            def quant_dy(dy):  # one read: 1 x 128 tiles of dy and 128 x 128 blocks of dy^T
                return tri.dual_quantize(dy, 128, fg, power_of_2=p2, t_square=True)

    else:

        def q_ref(a, fmt, block):
            if current:
                return ref.quantize_tensor(a, fmt, margin=recipe.margin, power_of_2=p2)
            return ref.quantize_blocks(a, block, fmt, power_of_2=p2)

        def quant_x(x):
            q = q_ref(x, fx, (1, 128))
            return q, (_t2(q) if current else q_ref(x.T, fx, (1, 128)))

        def quant_w_t(kernels):
            w_t = jnp.swapaxes(kernels, 1, 2)
            if current:  # one scale per expert
                one = functools.partial(ref.quantize_tensor, fmt=fw, margin=recipe.margin, power_of_2=p2)
                return jax.vmap(one)(w_t)
            return q_ref(w_t, fw, (128, 128))

        def quant_dy(dy):
            q = q_ref(dy, fg, (1, 128))
            return q, (_t2(q) if current else q_ref(dy.T, fg, (128, 128)))

    gemm, wgrad = _gemms(implementation)
    return quant_x, quant_w_t, quant_dy, gemm, wgrad


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_grouped(x, kernels, group_sizes, recipe, implementation):
    return _fwd(x, kernels, group_sizes, recipe, implementation)[0]


def _fwd(x, kernels, group_sizes, recipe, implementation):
    fwd = staged(lambda name: lambda x, k, gs: _fwd_impl(x, k, gs, recipe, name), implementation)
    return fwd(x, kernels, group_sizes)


def _bwd(recipe, implementation, res, dy):
    return staged(lambda name: functools.partial(_bwd_impl, recipe, name), implementation)(res, dy)


def _fwd_impl(x, kernels, group_sizes, recipe, implementation):
    quant_x, quant_w_t, _, gemm, _ = _ops(recipe, implementation)
    qx, qx_t = quant_x(x)
    qw_t = quant_w_t(kernels)
    y = gemm(qx, qw_t, group_sizes, x.dtype)
    return y, (qx_t, qw_t, group_sizes, jnp.zeros((), kernels.dtype))


def _bwd_impl(recipe, implementation, res, dy):
    qx_t, qw_t, group_sizes, w_proto = res
    _, _, quant_dy, gemm, wgrad = _ops(recipe, implementation)
    qdy, qdy_t = quant_dy(dy)
    dx = gemm(qdy, _t_blocks(qw_t), group_sizes, dy.dtype)
    dk = wgrad(qx_t, qdy_t, group_sizes, qw_t.data.shape[0], w_proto.dtype)
    return dx, dk, None


_fp8_grouped.defvjp(_fwd, _bwd)


# ----------------------------------------------------------------------------------------------
# Delayed scaling: x, the kernels (one state per expert) and dy; updates out through the cotangent
# ----------------------------------------------------------------------------------------------


def initial_grouped_state(recipe: DelayedScaling, num_groups: int) -> DenseScalingState:
    """Fresh delayed-scaling states for ``fp8_grouped_dense`` with ``num_groups`` experts.

    The same three-role pytree as :func:`~te_ops.fp8.initial_dense_state` (``x``, ``w``, ``g``):
    ``x`` and ``g`` one state each (amax_history ``[history_len]``, scalar scale), ``w`` one state
    per expert (amax_history ``[num_groups, history_len]``, scale ``[num_groups]``). All-zero
    histories and scales 1, so the first step quantizes with scale 1."""
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(
            err("initial_grouped_state", f"recipe must be a te_ops.fp8.DelayedScaling, got {recipe!r:.80}.")
        )
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(
            err("initial_grouped_state", f"num_groups must be an int >= 1 (the G of kernels [G, K, N]), got "
                                         f"{num_groups!r}.")
        )  # fmt: skip
    one = ref.initial_state(recipe)
    w = DelayedScalingState(jnp.zeros((num_groups, recipe.history_len), F32), jnp.ones((num_groups,), F32))
    return DenseScalingState(one, w, ref.initial_state(recipe))


def _quant_delayed(a, st: DelayedScalingState, recipe: DelayedScaling, role: str, implementation: str,
                   batched: bool = False):  # fmt: skip
    """``a`` quantized with ``st.scale`` and the state after recording its amax
    (:func:`te_ops.fp8.reference.quantize_delayed`). ``batched``: one state per slice of ``a``'s
    leading axis (the experts). The Triton path casts with our per-tensor cast kernel, which takes a
    device-side scale and returns the amax from the same read (current scaling's cast kernel); the
    state update is the reference's."""
    fmt = recipe.format(role)
    dtype = jnp.dtype(a.dtype)
    if implementation == "triton":
        from te_ops.fp8 import triton as tri

        if not batched:
            q, a_amax, sinv = tri.tensor_cast(a, st.scale, fmt, with_amax=True)
            return QuantizedTensor(q, sinv, None, dtype), ref.update_delayed_state(st, recipe, fmt, a_amax)
        g = a.shape[0]
        if g == 1:  # the batched kernel takes B > 1; one expert is one tensor
            q, a_amax, sinv = tri.tensor_cast(a, st.scale[0], fmt, with_amax=True)
            a_amax, sinv = jnp.reshape(a_amax, (1,)), jnp.reshape(sinv, (1,))
        else:
            q, a_amax, sinv = tri.tensor_cast(a, st.scale, fmt, with_amax=True, batch=g)
        new = jax.vmap(lambda s, m: ref.update_delayed_state(s, recipe, fmt, m))(st, a_amax)
        return QuantizedTensor(q, sinv, None, dtype), new
    if not batched:
        return ref.quantize_delayed(a, st, recipe, fmt)
    return jax.vmap(lambda a, s: ref.quantize_delayed(a, s, recipe, fmt))(a, st)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fp8_grouped_delayed(x, kernels, group_sizes, state, recipe, implementation):
    return _dfwd(x, kernels, group_sizes, state, recipe, implementation)[0]


def _dfwd(x, kernels, group_sizes, state, recipe, implementation):
    fwd = staged(lambda name: lambda x, k, gs, st: _dfwd_impl(x, k, gs, st, recipe, name), implementation)
    return fwd(x, kernels, group_sizes, state)


def _dbwd(recipe, implementation, res, dy):
    return staged(lambda name: functools.partial(_dbwd_impl, recipe, name), implementation)(res, dy)


def _dfwd_impl(x, kernels, group_sizes, state, recipe, implementation):
    qx, st_x = _quant_delayed(x, state.x, recipe, "x", implementation)  # amax over all M rows
    qw, st_w = _quant_delayed(kernels, state.w, recipe, "w", implementation, batched=True)
    qw_t = _t_blocks(qw)  # one scale per expert: the exact FP8 transpose
    gemm, _ = _gemms(implementation)
    y = gemm(qx, qw_t, group_sizes, x.dtype)
    return y, (_t2(qx), qw_t, group_sizes, st_x, st_w, state.g, jnp.zeros((), kernels.dtype))


def _dbwd_impl(recipe, implementation, res, dy):
    qx_t, qw_t, group_sizes, st_x, st_w, st_g, w_proto = res
    qdy, st_g = _quant_delayed(dy, st_g, recipe, "g", implementation)  # amax over all M rows
    gemm, wgrad = _gemms(implementation)
    dx = gemm(qdy, _t_blocks(qw_t), group_sizes, dy.dtype)
    dk = wgrad(qx_t, _t2(qdy), group_sizes, qw_t.data.shape[0], w_proto.dtype)
    return dx, dk, None, DenseScalingState(st_x, st_w, st_g)


_fp8_grouped_delayed.defvjp(_dfwd, _dbwd)


def _check_grouped_state(recipe: DelayedScaling, state, g: int, op: str = OP) -> None:
    fix = f"te_ops.fp8.initial_grouped_state(recipe, num_groups={g})"
    if not isinstance(state, DenseScalingState):
        raise TypeError(
            err(op, f"DelayedScaling needs state=DenseScalingState with one kernel state per expert ({fix}), got "
                    f"{state!r:.80}.")
        )  # fmt: skip
    h = recipe.history_len
    want = {"x": ((h,), ()), "w": ((g, h), (g,)), "g": ((h,), ())}
    for name, (w_hist, w_scale) in want.items():
        st = getattr(state, name)
        hist, sc = jnp.shape(st.amax_history), jnp.shape(st.scale)
        if (hist, sc) != (w_hist, w_scale):
            per = " (one per expert of kernels [G, K, N])" if name == "w" else ""
            raise ValueError(
                err(op, f"state.{name} must hold amax_history {list(w_hist)} and scale {list(w_scale)}{per} "
                        f"(recipe.history_len={h}, G={g}), got amax_history {list(hist)} and scale {list(sc)}. "
                        f"Create it with {fix}.")
            )  # fmt: skip


def fp8_grouped_dense(
    x,
    kernels,
    group_sizes,
    recipe: BlockScaling | CurrentScaling | DelayedScaling | None = None,
    *,
    state: DenseScalingState | None = None,
    implementation=None,
):
    """Grouped GEMM (MoE experts) with FP8 forward and input-gradient GEMMs.

    ``y[rows of g] = x[rows of g] @ kernels[g]``; rows past the groups are zero. The forward, dx and
    dkernels GEMMs all use FP8 operands (table in the module docstring) and sum in float32; an empty
    group's kernel gradient is zero.

    Args:
      x: [M, K] float32, bfloat16 or float16.
      kernels: [G, K, N], x's dtype; or float32 master kernels with a bfloat16 / float16 x: they are
        quantized from their float32 values (not rounded to x's dtype first) and their gradient
        comes back in float32 from the weight-gradient kernel's float32 sum (no rounding to x's
        dtype, no separate cast pass).
      group_sizes: int32 [G] on the device (grouped_dense's rule).
      recipe: :class:`~te_ops.fp8.BlockScaling` with act_block (1, 128) and weight_block (128, 128)
        (default: ``BlockScaling()``), or :class:`~te_ops.fp8.CurrentScaling`: one scale for x (its
        amax over all M rows, rows past the groups included), one for dy, and one per expert for
        the kernels; or :class:`~te_ops.fp8.DelayedScaling` (with ``state``): one delayed scale
        for x and one for dy (amaxes over all M rows, as with current scaling), one per expert for
        the kernels. ``fast_accumulation`` has no effect here (the block-scaled kernels promote to
        float32 every 128 of K).
      state: with DelayedScaling (required), a :class:`~te_ops.fp8.DenseScalingState` from
        :func:`initial_grouped_state` (``state.w`` per expert: amax_history [G, history_len],
        scale [G]); else None. The updated state comes back as the **cotangent of** ``state``,
        exactly as with :func:`~te_ops.fp8.fp8_dense`: differentiate with respect to ``state`` too
        and keep that "gradient" as the next state (never give it to an optimizer). x and the
        kernels are recorded in the forward pass, dy in the backward; a forward-only call updates
        nothing.
      implementation: None (the Triton path on a CUDA GPU with FP8 tensor cores, staged with
        ``jax.lax.platform_dependent``; the reference elsewhere), "reference" (pure JAX) or
        "triton" (CUDA GPU: our quantize
        kernels and grouped FP8 GEMM and weight-gradient kernels, per-tensor scales repeated per
        block).

    Returns:
      [M, N] in x's dtype.
    """
    recipe = BlockScaling() if recipe is None else recipe
    x = check_float(OP, "x", x, DTYPES, rank=2, layout="[M, K]")
    kernels = check_float(OP, "kernels", kernels, DTYPES, rank=3, layout="[G, K, N]")
    check_groups(OP, kernels)  # grouped_dense's rule (docs/semantics.md, "Grouped GEMM": G >= 1)
    group_sizes = check_int_array(OP, "group_sizes", group_sizes, shape=(kernels.shape[0],))
    block_ok = isinstance(recipe, BlockScaling) and recipe.act_block == (1, 128) and recipe.weight_block == (128, 128)
    if not (block_ok or isinstance(recipe, (CurrentScaling, DelayedScaling))):
        raise ValueError(
            err(OP, "recipe must be CurrentScaling, DelayedScaling, or BlockScaling with act_block (1, 128) and "
                    f"weight_block (128, 128), got {recipe!r}.")
        )  # fmt: skip
    if isinstance(recipe, DelayedScaling):
        _check_grouped_state(recipe, state, kernels.shape[0])
    elif state is not None:
        raise ValueError(err(OP, f"state is only for DelayedScaling; {type(recipe).__name__} takes state=None."))
    if x.shape[1] != kernels.shape[1]:
        raise ValueError(err(OP, f"x's K = {x.shape[1]} must match kernels' K = {kernels.shape[1]} ([G, K, N])."))
    check_kernel_dtype(OP, x, kernels)
    implementation = static_choice(OP, "implementation", implementation, (None, "reference", "triton"))
    if implementation == "triton":
        why = _triton_unsupported(x.shape[0], kernels.shape[0])
        if why:
            raise ValueError(err(OP, f"implementation='triton' cannot take this call: {why}."))
    if implementation is None and _triton_unsupported(x.shape[0], kernels.shape[0]):
        implementation = "reference"
    group_sizes = group_sizes.astype(jnp.int32)
    if isinstance(recipe, DelayedScaling):
        return _fp8_grouped_delayed(x, kernels, group_sizes, state, recipe, resolve(implementation))
    return _fp8_grouped(x, kernels, group_sizes, recipe, resolve(implementation))


def _triton_unsupported(m: int, g: int) -> str | None:
    from te_ops._core.triton_bridge import triton_unavailable_reason
    from te_ops.grouped_dense.triton import MAX_GROUPS

    if g > MAX_GROUPS:
        return f"the FP8 grouped kernels take up to {MAX_GROUPS} groups, got {g}"
    if m >= 2**31:
        return f"the FP8 grouped kernels take M < 2**31 rows (int32 sizes), got M={m}"
    return triton_unavailable_reason()
