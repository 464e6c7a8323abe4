"""The FP8 MoE expert FFN in one ``custom_vjp``: dispatch FP8 tokens, first expert GEMM, activation,
second expert GEMM, with the activation fused into the quantizations around it.

:func:`fp8_dispatch_ffn` computes exactly what the unfused FP8 path computes::

    d = fp8_dispatch_grouped_dense(x, routing_map, num_out_tokens, wi, recipe)   # h = d.out
    a = ffn_activation(d.out, activation, gated)                                # in x's dtype
    y = fp8_grouped_dense(a, wo, d.tokens_per_expert, recipe)

but the activation never goes to memory in high precision, nor does its gradient:

* forward: one kernel reads h and writes ``a`` quantized in 1 x 128 row tiles (the second GEMM's
  operand) and ``a^T`` in 1 x 128 tiles (its weight gradient's), instead of the activation writing
  ``a`` and the dual quantize reading it;
* backward: one kernel reads the second GEMM's input gradient ``da`` and h and writes ``dh``
  quantized in 1 x 128 row tiles and ``dh^T`` in 128 x 128 blocks (the first GEMM's dgrad and wgrad
  operands), instead of the activation's backward writing ``dh`` and the dual quantize reading it.

Per row of an FFN of width F (gated: h has 2F columns) in bf16 this saves about 8F bytes of traffic
in the forward and 16F in the backward (4 of the 12 layers' bytes that the unfused path moves through
these two steps; docs/perf_notes.md). Block scaling only (the per-tensor recipes need the whole
tensor's amax before the first byte is written); the values are the unfused path's: the activation
and its gradient are computed in float32 and rounded to x's dtype before they are quantized, so the
reference implementation is bit-identical to the unfused reference path and the Triton kernels differ
from it only where a transcendental's last-ulp rounding moves an FP8 rounding (tested).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from te_ops._core.partitioning import match_vma
from te_ops._core.validation import check_bool, check_float, check_rank, err, static_choice, static_int
from te_ops.dense.reference import ACTIVATIONS
from te_ops.fp8 import dispatch as D
from te_ops.fp8 import grouped as G
from te_ops.fp8 import reference as ref
from te_ops.fp8.recipes import BlockScaling
from te_ops.fp8.select import resolve
from te_ops.grouped_dense.reference import ffn_activation
from te_ops.permutation import token_combine

OP = "fp8_dispatch_ffn"
F32 = jnp.float32
TILE = 128


# ----------------------------------------------------------------------------------------------
# The fused activation + quantize steps, per implementation
# ----------------------------------------------------------------------------------------------


def _act_quant(recipe, activation, gated, name, h):
    """(a in 1 x 128 row tiles, a^T in 1 x 128 row tiles), a = ffn_activation(h)."""
    fx, p2 = recipe.format("x"), recipe.power_of_2
    if name == "triton":
        from te_ops.fp8 import triton as tri

        if tri.ffn_unsupported_reason(h.shape[1], activation, False) is None:
            return tri.ffn_act_dual_quantize(h, activation, gated, fx, power_of_2=p2)
        return tri.dual_quantize(ffn_activation(h, activation, gated), TILE, fx, power_of_2=p2)
    a = ffn_activation(h, activation, gated)
    return ref.quantize_blocks(a, (1, TILE), fx, power_of_2=p2), ref.quantize_blocks(a.T, (1, TILE), fx, power_of_2=p2)


def _dact_quant(recipe, activation, gated, name, da, h):
    """(dh in 1 x 128 row tiles, dh^T in 128 x 128 blocks), dh the gradient of ffn_activation at h
    for the output gradient da, in h's dtype."""
    fg, p2 = recipe.format("g"), recipe.power_of_2
    tri = None
    if name == "triton":
        from te_ops.fp8 import triton as tri

        if tri.ffn_unsupported_reason(da.shape[1], activation, gated) is None:
            return tri.ffn_dact_dual_quantize(da, h, activation, gated, fg, power_of_2=p2)
    dh = jax.vjp(lambda h: ffn_activation(h, activation, gated), h)[1](da.astype(h.dtype))[0]
    if tri is not None:  # the unfused backward (GELUs; a gated F that is not a multiple of 128)
        return tri.dual_quantize(dh, TILE, fg, power_of_2=p2, t_square=True)
    return (ref.quantize_blocks(dh, (1, TILE), fg, power_of_2=p2),
            ref.quantize_blocks(dh.T, (TILE, TILE), fg, power_of_2=p2))  # fmt: skip


def _second(recipe, activation, gated, name, h, wo, gs):
    """The activation and the second expert GEMM: (y, a^T for its weight gradient, wo^T blocks)."""
    qa, qa_t = _act_quant(recipe, activation, gated, name, h)
    qwo_t = G._ops(recipe, name)[1](wo)
    y = G._gemms(name)[0](qa, qwo_t, gs, h.dtype)
    return y, qa_t, qwo_t


def _bwd_impl(recipe, activation, gated, name, qx_t, qwi_t, h, qa_t, qwo_t, gs, w_proto, dy):
    """(dx of the dispatched rows, dwi, dwo)."""
    _, _, quant_dy, gemm, wgrad = G._ops(recipe, name)
    e = qwo_t.data.shape[0]
    qdy, qdy_t = quant_dy(dy)
    da = gemm(qdy, G._t_blocks(qwo_t), gs, dy.dtype)
    dwo = wgrad(qa_t, qdy_t, gs, e, w_proto.dtype)
    qdh, qdh_t = _dact_quant(recipe, activation, gated, name, da, h)
    dxd = gemm(qdh, G._t_blocks(qwi_t), gs, dy.dtype)
    dwi = wgrad(qx_t, qdh_t, gs, e, w_proto.dtype)
    return dxd, dwi, dwo


# ----------------------------------------------------------------------------------------------
# The op
# ----------------------------------------------------------------------------------------------


def _forward(x, wi, wo, routing_map, statics):
    recipe, num_out_tokens, align_size, impl, dimpl, activation, gated = statics
    qx, _ = D._stage(impl, functools.partial(D._quant_x, recipe), x, None)
    d = D._move(qx, routing_map, num_out_tokens, align_size, dimpl)
    gs = d.tokens_per_expert
    h, qx_t, qwi_t, _ = D._stage(impl, functools.partial(D._experts, recipe), d.out, wi, gs, None)
    y, qa_t, qwo_t = D._stage(impl, functools.partial(_second, recipe, activation, gated), h, wo, gs)
    out = D.FP8DispatchResult(y, d.row_id_map, d.pad_offsets, gs, d.num_dropped)
    return out, (qx_t, qwi_t, h, qa_t, qwo_t, gs, d.row_id_map, jnp.zeros((), wi.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(x, wi, wo, routing_map, statics):
    return _forward(x, wi, wo, routing_map, statics)[0]


def _fused_bwd(statics, res, ct):
    recipe, _, _, impl, dimpl, activation, gated = statics
    fn = functools.partial(_bwd_impl, recipe, activation, gated)
    dxd, dwi, dwo = D._stage(impl, fn, *res[:6], res[7], ct.out)
    dx = token_combine(dxd, res[6], implementation=dimpl)  # token_dispatch's backward
    return dx, dwi, dwo, None


_fused.defvjp(_forward, _fused_bwd)


def fp8_dispatch_ffn(
    x: jax.Array,
    routing_map: jax.Array,
    num_out_tokens: int,
    wi: jax.Array,
    wo: jax.Array,
    recipe: BlockScaling | None = None,
    *,
    activation: str | None = "silu",
    gated: bool = True,
    align_size: int | None = None,
    implementation: str | None = None,
    dispatch_implementation: str | None = None,
) -> D.FP8DispatchResult:
    """The MoE experts' FFN in FP8 on dispatched tokens, with block scaling, as one op.

    ``y = act(dispatch(x) @ wi[e]) @ wo[e]`` per expert e (gated: ``act(h[:, :F]) * h[:, F:]``
    between the GEMMs), equal to the unfused FP8 path (module docstring): x quantized once and
    dispatched as FP8 rows (:func:`fp8_dispatch_grouped_dense`), the activation computed in float32,
    rounded to x's dtype and quantized in the same kernel (and its gradient likewise in the
    backward), both GEMMs ``fp8_grouped_dense``'s block-scaled grouped GEMMs.

    Gradients: dx (float32 sum of each token's kept rows, in x's dtype), dwi, dwo; none for
    routing_map. As for :func:`fp8_dispatch_grouped_dense`, call it where the tokens are local
    (inside ``shard_map``).

    Args:
      x: ``[T, H]`` float32, bfloat16 or float16 tokens.
      routing_map: ``[T, E]`` bool.
      num_out_tokens: static int >= 0, token_dispatch's capacity (normally T * topk).
      wi: ``[E, H, W]``, x's dtype (or float32 master kernels, as fp8_grouped_dense takes them): the
        first kernels; ``W = 2F`` gated (the activation's input
        in the first F columns, the linear gate in the last F), else ``W = F``.
      wo: ``[E, F, H_out]``, wi's dtype: the second kernels.
      recipe: ``BlockScaling`` with act_block (1, 128) and weight_block (128, 128) (the default).
      activation: static, None, "gelu", "gelu_tanh", "relu" or "silu".
      gated: static bool.
      align_size: optional static int, token_dispatch's padding of each expert's block.
      implementation: None (the Triton kernels where they run, else the reference), "reference",
        "triton".
      dispatch_implementation: token_dispatch / token_combine's implementation (None = best).

    Returns:
      :class:`FP8DispatchResult` ``(out [N, H_out], row_id_map, pad_offsets, tokens_per_expert,
      num_dropped)``: give ``row_id_map`` to token_combine.
    """
    recipe = BlockScaling() if recipe is None else recipe
    x = check_float(OP, "x", x, G.DTYPES, rank=2, layout="[T, H]")
    routing_map = check_bool(OP, "routing_map", routing_map, hint="Convert it, e.g. routing_map = (routing_map != 0).")
    check_rank(OP, "routing_map", routing_map, 2, "[T, E]")
    wi = check_float(OP, "wi", wi, G.DTYPES, rank=3, layout="[E, H, W]")
    wo = check_float(OP, "wo", wo, G.DTYPES, rank=3, layout="[E, F, H_out]")
    why = "It sets the output shape, so it cannot be a traced value; pass e.g. num_out_tokens=T * topk."
    num_out_tokens = static_int(OP, "num_out_tokens", num_out_tokens, minimum=0, why=why)
    align_size = static_int(OP, "align_size", align_size, minimum=1, allow_none=True, why="It sets the output shape.")
    if not isinstance(gated, bool):
        raise TypeError(err(OP, f"gated must be a static bool, got {gated!r:.60}."))
    if not (activation is None or (isinstance(activation, str) and activation in ACTIVATIONS)):
        names = ", ".join(repr(a) for a in ACTIVATIONS if a)
        raise ValueError(err(OP, f"activation must be None or one of {names}, got {activation!r:.60}."))
    t, hdim = x.shape
    e = routing_map.shape[1]
    if routing_map.shape[0] != t:
        raise ValueError(err(OP, f"routing_map must be [T, E] with T = x.shape[0] = {t}, got "
                                 f"{tuple(routing_map.shape)}."))  # fmt: skip
    if wi.shape[0] != e or wo.shape[0] != e:
        raise ValueError(
            err(OP, f"wi and wo must hold one kernel per expert (E = routing_map.shape[1] = {e}), got wi "
                    f"{tuple(wi.shape)} and wo {tuple(wo.shape)}.")
        )  # fmt: skip
    if wi.shape[1] != hdim:
        raise ValueError(err(OP, f"x's H = {hdim} must match wi's H = {wi.shape[1]} ([E, H, W])."))
    f = wo.shape[1]
    if wi.shape[2] != (2 * f if gated else f):
        want = f"2F = {2 * f} (gated)" if gated else f"F = {f}"
        raise ValueError(err(OP, f"wi's W must be {want}, F = wo.shape[1]; got wi {tuple(wi.shape)}, wo "
                                 f"{tuple(wo.shape)}."))  # fmt: skip
    G.check_kernel_dtype(OP, x, wi, "wi")
    if wo.dtype != wi.dtype:
        raise TypeError(err(OP, f"wi and wo must have one dtype (x's, or float32 master kernels), got wi {wi.dtype} "
                                f"and wo {wo.dtype}."))  # fmt: skip
    blocks = (getattr(recipe, "act_block", None), getattr(recipe, "weight_block", None))
    if not (isinstance(recipe, BlockScaling) and blocks == ((1, TILE), (TILE, TILE))):
        raise ValueError(
            err(OP, "recipe must be BlockScaling with act_block (1, 128) and weight_block (128, 128) (the per-tensor "
                    "recipes need a whole tensor's amax before quantizing: use fp8_dispatch_grouped_dense and "
                    f"fp8_grouped_dense), got {recipe!r}.")
        )  # fmt: skip
    implementation = static_choice(OP, "implementation", implementation, (None, "reference", "triton"))
    from te_ops.permutation.reference import out_rows

    rows = out_rows(num_out_tokens, e, align_size)
    why = G._triton_unsupported(rows, e) if implementation != "reference" else None
    if implementation == "triton" and why:
        raise ValueError(err(OP, f"implementation='triton' cannot take this call: {why}."))
    if implementation is None and why:
        implementation = "reference"
    statics = (recipe, num_out_tokens, align_size, resolve(implementation), dispatch_implementation, activation, gated)
    x, wi, wo, routing_map = match_vma(x, wi, wo, routing_map)  # inside shard_map: see match_vma
    return _fused(x, wi, wo, routing_map, statics)
