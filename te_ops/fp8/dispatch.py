"""FP8 token dispatch: quantize the tokens once, move FP8 rows, run the first expert GEMM on them.

Two public functions:

* :func:`token_dispatch_quantized` moves the rows of an already quantized ``[T, H]`` tensor into
  token_dispatch's expert-major buffer: the FP8 bytes, viewed as bfloat16 pairs (``[T, H/2]``,
  one zero column appended when H is odd), and with block scaling the float32 scale rows
  (``[T, ceil(H / 128)]``), each through :func:`te_ops.permutation.token_dispatch`. No new
  kernel: the dispatch kernels move rows without arithmetic, so every bit pattern comes through
  (tested over all 65536 bfloat16 patterns). Buffer rows that hold no token get FP8 zeros and
  inverse scale 1, which is what quantizing a zero row gives. Not differentiable (FP8 data).
* :func:`fp8_dispatch_grouped_dense` is ``quantize -> token_dispatch -> fp8_grouped_dense``
  (the experts' first GEMM) in one ``custom_vjp``, so the dispatch moves FP8 bytes (about half of
  a bfloat16 dispatch) while the gradient stays in high precision: the backward un-permutes the
  high-precision dx of the expert GEMM with :func:`te_ops.permutation.token_combine` (the dispatch's
  backward: a float32 sum of each token's kept rows). No cotangent ever passes through an FP8 array.

Operands of the three GEMMs (compare :mod:`te_ops.fp8.grouped`):

* Block scaling (1 x 128 tiles): a row's tiles depend only on that row, so the dispatched FP8 rows
  with their scale rows ARE the 1 x 128 quantization of the dispatched tensor, bit for bit; the
  forward GEMM and the dx GEMM are those of ``fp8_grouped_dense``. The weight gradient needs the
  dispatched x^T in 1 x 128 tiles along M (x's 128 x 1 columns). There is no high-precision
  dispatched x, so it is quantized from the dequantized dispatched rows (float32): a second
  rounding, for the weight-gradient operand only. With power-of-two scales (the default) the
  second rounding is exact for every element the column tile keeps in the format's normal range
  (a value with 4 significant bits times a power of two); only elements that the column tile puts
  among the subnormals lose bits (at most half the smallest subnormal times the tile's inverse
  scale). Without power-of-two scales every element may take a second half-ulp error.
* Current / delayed scaling (one scale per tensor): x is quantized once with one scale (current:
  x's amax over all T tokens; delayed: the state's scale, x's amax over all T tokens recorded), the
  FP8 bytes are moved, and x^T for the weight gradient is the exact FP8 transpose of the dispatched
  bytes. The amax covers every token, dropped or unrouted ones included (``fp8_grouped_dense`` on
  the dispatched buffer sees only the kept rows); with top-k routing and no drops the two agree.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from te_ops._core.partitioning import match_vma
from te_ops._core.validation import check_bool, check_float, check_groups, check_rank, err, static_choice, static_int
from te_ops.fp8 import grouped as G
from te_ops.fp8 import reference as ref
from te_ops.fp8.dense import DenseScalingState
from te_ops.fp8.recipes import BlockScaling, CurrentScaling, DelayedScaling
from te_ops.fp8.reference import QuantizedTensor
from te_ops.fp8.select import resolve, staged
from te_ops.permutation import token_combine, token_dispatch

OP = "fp8_dispatch_grouped_dense"
F32 = jnp.float32
TILE = 128


class QuantizedDispatchResult(NamedTuple):
    """What :func:`token_dispatch_quantized` returns (token_dispatch's fields, ``out`` quantized)."""

    out: QuantizedTensor  # [N, H] FP8 rows with their scales
    row_id_map: jax.Array  # int32 [T, 2E + 1], the input of token_combine
    pad_offsets: jax.Array | None  # int32 [E]; None without align_size
    tokens_per_expert: jax.Array  # int32 [E]
    num_dropped: jax.Array  # int32 []


class FP8DispatchResult(NamedTuple):
    """What :func:`fp8_dispatch_grouped_dense` returns."""

    out: jax.Array  # [N, N_out], x's dtype: the experts' first GEMM on the dispatched rows
    row_id_map: jax.Array  # int32 [T, 2E + 1], for token_combine
    pad_offsets: jax.Array | None  # int32 [E]; None without align_size
    tokens_per_expert: jax.Array  # int32 [E], the group sizes of out (and of the next expert GEMM)
    num_dropped: jax.Array  # int32 []


# ----------------------------------------------------------------------------------------------
# Moving FP8 rows with the dispatch kernels
# ----------------------------------------------------------------------------------------------


def _as_pairs(data: jax.Array) -> jax.Array:
    """FP8 [T, H] -> bfloat16 [T, ceil(H / 2)] with the same bytes (one zero column if H is odd)."""
    t, h = data.shape
    # Pad as bytes: XLA:CPU's pad and slice of an E5M2 array rewrite its NaN bytes (0xFE -> 0x7F).
    data = jax.lax.bitcast_convert_type(data, jnp.uint8)
    if h % 2:
        data = jnp.pad(data, ((0, 0), (0, 1)))
    return jax.lax.bitcast_convert_type(data.reshape(t, (h + 1) // 2, 2), jnp.bfloat16)  # no -1: T may be 0


def _from_pairs(pairs: jax.Array, fmt, h: int) -> jax.Array:
    n, h2 = pairs.shape
    data = jax.lax.bitcast_convert_type(pairs, jnp.uint8).reshape(n, 2 * h2)[:, :h]  # no -1: N may be 0
    return jax.lax.bitcast_convert_type(data, fmt)


def _move(q: QuantizedTensor, routing_map, num_out_tokens, align_size, implementation) -> QuantizedDispatchResult:
    kw = dict(align_size=align_size, implementation=implementation)
    d = token_dispatch(_as_pairs(q.data), routing_map, num_out_tokens, **kw)
    data = _from_pairs(d.out, q.data.dtype, q.data.shape[1])
    if q.block is None:
        sinv = q.scale_inv
    else:  # per-row scales: a second dispatch of the float32 scale rows, with a column of ones that marks the
        # rows holding a token (a kept row's inverse scale may itself be 0); holes (zero rows) get 1
        rows = jnp.concatenate([q.scale_inv, jnp.ones((q.scale_inv.shape[0], 1), F32)], axis=1)
        s = token_dispatch(rows, routing_map, num_out_tokens, **kw).out
        sinv = jnp.where(s[:, -1:] == 0, jnp.ones((), F32), s[:, :-1])
    out = QuantizedTensor(data, sinv, q.block, q.dtype)
    return QuantizedDispatchResult(out, d.row_id_map, d.pad_offsets, d.tokens_per_expert, d.num_dropped)


def token_dispatch_quantized(
    q: QuantizedTensor,
    routing_map: jax.Array,
    num_out_tokens: int,
    *,
    align_size: int | None = None,
    implementation: str | None = None,
) -> QuantizedDispatchResult:
    """:func:`te_ops.permutation.token_dispatch` of FP8 rows: moves ``q``'s bytes and scale rows.

    ``q`` is a ``[T, H]`` tensor quantized per tensor (one scale, kept as it is) or in 1 x 128 row
    tiles (``scale_inv [T, ceil(H / 128)]``, moved with the rows). Row layout, capacity, dropping,
    padding and sharding are token_dispatch's. The result equals quantizing the dispatched
    high-precision rows, bit for bit: block scaling because a row's tiles depend only on the row,
    rows that hold no token being FP8 zeros with inverse scale 1 (a quantized zero row); per-tensor
    scaling when ``q``'s scale is the one the dispatched tensor would get (the same amax).

    Not differentiable (the data is FP8); :func:`fp8_dispatch_grouped_dense` is the trainable use.

    Equivalent to (block scaling)::

        d = token_dispatch(dequantize(q), routing_map, num_out_tokens)
        out = quantize_blocks(d.out, (1, 128))        # the same bytes and scales

    Args:
      q: a :class:`~te_ops.fp8.QuantizedTensor` ``[T, H]``, per tensor or with ``block=(1, 128)``.
      routing_map: ``[T, E]`` bool.
      num_out_tokens: static int, token_dispatch's capacity.
      align_size: optional static int, token_dispatch's padding.
      implementation: token_dispatch's implementation (None = best available).

    Returns:
      :class:`QuantizedDispatchResult` ``(out, row_id_map, pad_offsets, tokens_per_expert, num_dropped)``.
    """
    op = "fp8.token_dispatch_quantized"
    if not isinstance(q, QuantizedTensor):
        raise TypeError(err(op, f"q must be a te_ops.fp8.QuantizedTensor (te_ops.fp8.quantize), got {q!r:.80}."))
    if q.data.ndim != 2:
        raise ValueError(err(op, f"q must be a [T, H] quantized tensor, got shape {tuple(q.data.shape)}."))
    if q.block is not None and tuple(q.block) != (1, TILE):
        raise ValueError(
            err(op, f"q must be quantized per tensor or in (1, {TILE}) row tiles (a row's scales move with it), got "
                    f"block={q.block}.")
        )  # fmt: skip
    if q.block is None and jnp.ndim(q.scale_inv) != 0:
        raise ValueError(err(op, f"q.scale_inv must be a scalar without blocks, got shape {jnp.shape(q.scale_inv)}."))
    return _move(q, routing_map, num_out_tokens, align_size, implementation)


# ----------------------------------------------------------------------------------------------
# The fused op
# ----------------------------------------------------------------------------------------------


def _stage(implementation, fn, *args):
    """``fn(name, *args)`` for the implementation, staged per platform for ``"auto"``."""
    return staged(lambda name: functools.partial(fn, name), implementation)(*args)


def _quant_x(recipe, name, x, st):
    """x [T, H] once: 1 x 128 row tiles, or one scale (current: x's amax; delayed: st's scale)."""
    if isinstance(recipe, DelayedScaling):
        return G._quant_delayed(x, st, recipe, "x", name)
    fx, p2 = recipe.format("x"), recipe.power_of_2
    if name == "triton":
        from te_ops.fp8 import triton as tri

        if isinstance(recipe, CurrentScaling):
            return tri.quantize_tensor(x, fx, margin=recipe.margin, power_of_2=p2), st
        return tri.block_quantize(x, (1, TILE), fx, power_of_2=p2), st
    if isinstance(recipe, CurrentScaling):
        return ref.quantize_tensor(x, fx, margin=recipe.margin, power_of_2=p2), st
    return ref.quantize_blocks(x, (1, TILE), fx, power_of_2=p2), st


# The Triton path's block-scaled wgrad operand from one kernel (te_ops.fp8.triton.requantize_t: reads
# the FP8 bytes, writes the transposed tiles; same bytes as XLA's float32 dequantize + block_quantize,
# ~1 GB less traffic per MoE layer at 64 x 1024 tokens). Off until its GPU byte test has run
# (tests/gpu/test_fp8_gpu.py -k requantize; bit-exact under the CPU interpreter); read at trace time.
REQUANTIZE_KERNEL = False


def wgrad_operand(qd: QuantizedTensor, recipe, implementation: str = "reference") -> QuantizedTensor:
    """x^T [H, N] for the weight gradient from the dispatched FP8 rows ``qd`` [N, H]: the exact FP8
    transpose with one scale per tensor; with block scaling the rows dequantized in float32 and
    quantized again in 1 x 128 tiles along N (the second rounding in the module docstring)."""
    if qd.block is None:
        return G._t2(qd)
    fx, p2 = recipe.format("x"), recipe.power_of_2
    if implementation == "triton":
        from te_ops.fp8 import triton as tri

        if REQUANTIZE_KERNEL:  # one read of the FP8 rows, no float32 copy (same bytes)
            return tri.requantize_t(qd, fx, power_of_2=p2)
        return tri.block_quantize(ref.dequantize(qd, F32).T, (1, TILE), fx, power_of_2=p2)
    return ref.quantize_blocks(ref.dequantize(qd, F32).T, (1, TILE), fx, power_of_2=p2)


def _experts(recipe, name, qd, kernels, gs, st_w):
    """Forward GEMM on the dispatched rows; (y, x^T for wgrad, W^T blocks, kernel state)."""
    if isinstance(recipe, DelayedScaling):
        qw, st_w = G._quant_delayed(kernels, st_w, recipe, "w", name, batched=True)
        qw_t = G._t_blocks(qw)
    else:
        qw_t = G._ops(recipe, name)[1](kernels)
    gemm, _ = G._gemms(name)
    y = gemm(qd, qw_t, gs, qd.dtype)
    return y, wgrad_operand(qd, recipe, name), qw_t, st_w


def _experts_bwd(recipe, name, qx_t, qw_t, gs, st_g, w_proto, dy):
    """(dx of the dispatched rows in high precision, dkernels, the gradient's state)."""
    gemm, wgrad = G._gemms(name)
    if isinstance(recipe, DelayedScaling):
        qdy, st_g = G._quant_delayed(dy, st_g, recipe, "g", name)
        qdy_t = G._t2(qdy)
    else:
        qdy, qdy_t = G._ops(recipe, name)[2](dy)
    dxd = gemm(qdy, G._t_blocks(qw_t), gs, dy.dtype)
    dk = wgrad(qx_t, qdy_t, gs, qw_t.data.shape[0], w_proto.dtype)
    return dxd, dk, st_g


def _forward(x, kernels, routing_map, state, statics):
    recipe, num_out_tokens, align_size, impl, dimpl = statics
    delayed = isinstance(recipe, DelayedScaling)
    qx, st_x = _stage(impl, functools.partial(_quant_x, recipe), x, state.x if delayed else None)
    d = _move(qx, routing_map, num_out_tokens, align_size, dimpl)
    gs = d.tokens_per_expert
    st_w = state.w if delayed else None
    y, qx_t, qw_t, st_w = _stage(impl, functools.partial(_experts, recipe), d.out, kernels, gs, st_w)
    out = FP8DispatchResult(y, d.row_id_map, d.pad_offsets, gs, d.num_dropped)
    res = (qx_t, qw_t, gs, d.row_id_map, st_x, st_w, state.g if delayed else None, jnp.zeros((), kernels.dtype))
    return out, res


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(x, kernels, routing_map, state, statics):
    return _forward(x, kernels, routing_map, state, statics)[0]


def _fused_bwd(statics, res, ct):
    recipe, _, _, impl, dimpl = statics
    qx_t, qw_t, gs, row_id_map, st_x, st_w, st_g, w_proto = res
    fn = functools.partial(_experts_bwd, recipe)
    dxd, dk, st_g = _stage(impl, fn, qx_t, qw_t, gs, st_g, w_proto, ct.out)
    dx = token_combine(dxd, row_id_map, implementation=dimpl)  # token_dispatch's backward
    dstate = DenseScalingState(st_x, st_w, st_g) if isinstance(recipe, DelayedScaling) else None
    return dx, dk, None, dstate


_fused.defvjp(_forward, _fused_bwd)


def fp8_dispatch_grouped_dense(
    x: jax.Array,
    routing_map: jax.Array,
    num_out_tokens: int,
    kernels: jax.Array,
    recipe: BlockScaling | CurrentScaling | DelayedScaling | None = None,
    *,
    align_size: int | None = None,
    state: DenseScalingState | None = None,
    implementation: str | None = None,
    dispatch_implementation: str | None = None,
) -> FP8DispatchResult:
    """MoE dispatch of FP8 tokens fused with the experts' first FP8 GEMM.

    ``token_dispatch(x, routing_map, num_out_tokens)`` followed by
    ``fp8_grouped_dense(out, kernels, tokens_per_expert, recipe)``, except that x is quantized
    ONCE, before the dispatch, and the dispatch moves the FP8 rows and their scales (about half the
    bytes of a bfloat16 dispatch; module docstring). The forward output equals the unfused FP8
    path's bit for bit (block scaling; current and delayed scaling when x's amax over all tokens
    equals the dispatched rows', e.g. top-k routing without drops), and so does dx. The kernel
    gradient takes x^T from the dispatched FP8 rows: the exact FP8 transpose with one scale per
    tensor, a second rounding with block scaling (exact in the normal range with power-of-two
    scales; docs/semantics.md, "FP8 token dispatch").

    Gradients: straight through the quantization as in every ``te_ops.fp8`` op; dx is the
    high-precision dx of the expert GEMM summed over each token's kept rows (token_dispatch's
    backward) in float32 and returned in x's dtype; none for routing_map. With DelayedScaling the
    updated state is the cotangent of ``state`` (``fp8_grouped_dense``'s rule and state layout).

    Under token sharding the op is not the unfused pair: call it where the tokens are local (inside
    ``shard_map``, as te_layers' MoEBlock does); :func:`token_dispatch_quantized` alone shards like
    token_dispatch.

    Equivalent to (block scaling, forward)::

        d = token_dispatch(x, routing_map, num_out_tokens, align_size=align_size)
        y = fp8_grouped_dense(d.out, kernels, d.tokens_per_expert, recipe)

    Args:
      x: ``[T, H]`` float32, bfloat16 or float16 tokens.
      routing_map: ``[T, E]`` bool.
      num_out_tokens: static int >= 0, token_dispatch's capacity (normally T * topk).
      kernels: ``[E, H, N]``, x's dtype (or float32 master kernels, as fp8_grouped_dense takes them):
        expert e's first kernel.
      recipe: as ``fp8_grouped_dense`` (default ``BlockScaling()``).
      align_size: optional static int, token_dispatch's padding of each expert's block.
      state: with DelayedScaling, the ``DenseScalingState`` of ``initial_grouped_state(recipe, E)``.
      implementation: the FP8 quantization and GEMMs, as ``fp8_grouped_dense`` (None, "reference",
        "triton").
      dispatch_implementation: token_dispatch / token_combine's implementation (None = best).

    Returns:
      :class:`FP8DispatchResult` ``(out [N, N_out], row_id_map, pad_offsets, tokens_per_expert,
      num_dropped)``: give ``tokens_per_expert`` to the next expert GEMM and ``row_id_map`` to
      token_combine.
    """
    recipe = BlockScaling() if recipe is None else recipe
    x = check_float(OP, "x", x, G.DTYPES, rank=2, layout="[T, H]")
    routing_map = check_bool(OP, "routing_map", routing_map, hint="Convert it, e.g. routing_map = (routing_map != 0).")
    check_rank(OP, "routing_map", routing_map, 2, "[T, E]")
    kernels = check_float(OP, "kernels", kernels, G.DTYPES, rank=3, layout="[E, H, N]")
    why = "It sets the output shape, so it cannot be a traced value; pass e.g. num_out_tokens=T * topk."
    num_out_tokens = static_int(OP, "num_out_tokens", num_out_tokens, minimum=0, why=why)
    align_size = static_int(OP, "align_size", align_size, minimum=1, allow_none=True, why="It sets the output shape.")
    if routing_map.shape[0] != x.shape[0]:
        raise ValueError(
            err(OP, f"routing_map must be [T, E] with T = x.shape[0] = {x.shape[0]}, got {tuple(routing_map.shape)}.")
        )
    check_groups(OP, kernels, "expert", "E")  # fp8_grouped_dense's rule (G >= 1)
    if kernels.shape[0] != routing_map.shape[1]:
        raise ValueError(
            err(OP, f"kernels must hold one kernel per expert ([E, H, N] with E = routing_map.shape[1] = "
                    f"{routing_map.shape[1]}), got {tuple(kernels.shape)}.")
        )  # fmt: skip
    if kernels.shape[1] != x.shape[1]:
        raise ValueError(err(OP, f"x's H = {x.shape[1]} must match kernels' H = {kernels.shape[1]} ([E, H, N])."))
    G.check_kernel_dtype(OP, x, kernels)
    blocks = (getattr(recipe, "act_block", None), getattr(recipe, "weight_block", None))
    block_ok = isinstance(recipe, BlockScaling) and blocks == ((1, TILE), (TILE, TILE))
    if not (block_ok or isinstance(recipe, (CurrentScaling, DelayedScaling))):
        raise ValueError(
            err(OP, "recipe must be CurrentScaling, DelayedScaling, or BlockScaling with act_block (1, 128) and "
                    f"weight_block (128, 128), got {recipe!r}.")
        )  # fmt: skip
    if isinstance(recipe, DelayedScaling):
        G._check_grouped_state(recipe, state, kernels.shape[0], op=OP)
    elif state is not None:
        raise ValueError(err(OP, f"state is only for DelayedScaling; {type(recipe).__name__} takes state=None."))
    implementation = static_choice(OP, "implementation", implementation, (None, "reference", "triton"))
    from te_ops.permutation.reference import out_rows

    rows = out_rows(num_out_tokens, kernels.shape[0], align_size)
    why = G._triton_unsupported(rows, kernels.shape[0]) if implementation != "reference" else None
    if implementation == "triton" and why:
        raise ValueError(err(OP, f"implementation='triton' cannot take this call: {why}."))
    if implementation is None and why:
        implementation = "reference"
    statics = (recipe, num_out_tokens, align_size, resolve(implementation), dispatch_implementation)
    x, kernels, routing_map = match_vma(x, kernels, routing_map)  # inside shard_map: see match_vma
    return _fused(x, kernels, routing_map, state, statics)
