"""``fp8_dense``: ``y = x @ kernel`` with FP8 operands in the forward and both backward GEMMs.

Which tensor is quantized how (``E4M3`` for x and the kernel, the recipe's gradient format for dy):

================  ==========================  =======================================================
GEMM              left operand                right operand (``b_t``: [out, reduction])
================  ==========================  =======================================================
y  = x @ w        x, 1 x 128 row tiles        w^T [N, K], 128 x 128 blocks
dx = dy @ w^T     dy, 1 x 128 row tiles       w [K, N], the same 128 x 128 blocks transposed
dw = x^T @ dy     x^T [K, M], 1 x 128 tiles   dy^T [N, M], 128 x 128 blocks
================  ==========================  =======================================================

(block scaling; with current scaling every operand has one scale per tensor). Each GEMM multiplies
the dequantized operands and sums in float32: ``gemm(a, b_t) = dequantize(a) @ dequantize(b_t)^T``.
The transposed copies are quantized from the high-precision tensor, not from its FP8 copy.

``implementation="triton"`` (CUDA GPU): with block scaling, x and dy are each read once for both of
their quantizations (``dual_quantize``), the kernel is quantized untransposed and its FP8 bytes
transposed (exact for square blocks), and the GEMMs run in our block-scaled FP8 GEMM kernel (float32
promotion every 128 of K). With current or delayed scaling the quantization is XLA's fusion of the
jnp code (it measured faster than our per-tensor kernels, which need a separate pass for the
transposed copy: see CURRENT_TRITON_QUANT and DELAYED_TRITON_CAST) and the GEMMs are FP8 dots that
XLA hands to cuBLASLt (:func:`gemm_xla_fp8`; float32 or fast accumulation, as the recipe says).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from te_ops._core.validation import check_float, err, is_master_kernel, static_choice
from te_ops.fp8 import reference as ref
from te_ops.fp8.recipes import BlockScaling, CurrentScaling, DelayedScaling
from te_ops.fp8.reference import DelayedScalingState, QuantizedTensor
from te_ops.fp8.select import resolve, staged

OP = "fp8_dense"
F32 = jnp.float32
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _transpose(q: QuantizedTensor) -> QuantizedTensor:
    """The FP8 transpose of a 2-D tensor with per-tensor or square-block scales (exact: the same
    blocks hold the same values)."""
    if q.block is not None and q.block[0] != q.block[1]:
        raise ValueError(f"only square blocks transpose exactly, got {q.block}")
    sinv = q.scale_inv if q.block is None else q.scale_inv.T
    return QuantizedTensor(q.data.T, sinv, q.block, q.dtype)


def _plus(y, bias):
    return y if bias is None else y + bias.astype(F32)


def gemm_reference(a: QuantizedTensor, b_t: QuantizedTensor, out_dtype, bias=None) -> jax.Array:
    """``dequantize(a) @ dequantize(b_t)^T (+ bias)``, products and sums in float32, one rounding."""
    y = jnp.dot(ref.dequantize(a, F32), ref.dequantize(b_t, F32).T, precision=jax.lax.Precision.HIGHEST)
    return _plus(y, bias).astype(out_dtype)


# How the per-tensor FP8 GEMM is written for XLA, which rewrites an FP8 dot into a cuBLASLt FP8 GEMM
# ("__cublas$lt$matmul$f8"); the forms are timed side by side in benchmarks/fp8.py:
#   "f32": dot of the FP8 operands with float32 output, then * (sa * sb) and the cast;
#   "dequant": dot of the dequantized operands (FP8 -> float32 times the scale), float32 output.
XLA_FP8_FORM = "f32"


def gemm_xla_fp8(
    a: QuantizedTensor, b_t: QuantizedTensor, out_dtype, bias=None, form: str | None = None, fast_accum: bool = False
) -> jax.Array:
    """``dequantize(a) @ dequantize(b_t)^T`` for per-tensor-scaled 2-D operands ([M, K] and [N, K]),
    written so that XLA runs it as one cuBLASLt FP8 GEMM on Hopper (products exact, float32
    accumulation, ``Precision.HIGHEST`` requested); ``bias`` is added in float32 (XLA can fuse it into
    the cuBLASLt epilogue). ``fast_accum=True`` requests ``Precision.DEFAULT`` instead, which lets
    cuBLASLt keep partial sums in the tensor cores' reduced-precision accumulator (timed in
    benchmarks/fp8.py; fp8_dense uses it where the recipe sets ``fast_accumulation``)."""
    dims = (((1,), (1,)), ((), ()))
    hi = jax.lax.Precision.DEFAULT if fast_accum else jax.lax.Precision.HIGHEST
    if (form or XLA_FP8_FORM) == "f32":
        y = jax.lax.dot_general(a.data, b_t.data, dims, precision=hi, preferred_element_type=F32)
        return _plus(y * (a.scale_inv * b_t.scale_inv), bias).astype(out_dtype)
    da = a.data.astype(F32) * a.scale_inv
    db = b_t.data.astype(F32) * b_t.scale_inv
    return _plus(jax.lax.dot_general(da, db, dims, precision=hi, preferred_element_type=F32), bias).astype(out_dtype)


def _q(x, recipe, role, block):
    fmt = recipe.format(role)
    if isinstance(recipe, BlockScaling):
        return ref.quantize_blocks(x, block, fmt, power_of_2=recipe.power_of_2)
    return ref.quantize_tensor(x, fmt, margin=recipe.margin, power_of_2=recipe.power_of_2)


def _reference_ops(recipe):
    act, wblk = (1, 128), (128, 128)
    if isinstance(recipe, BlockScaling):
        act, wblk = recipe.act_block, recipe.weight_block

    def quant_x(x):
        return _q(x, recipe, "x", act), _q(x.T, recipe, "x", act)

    def quant_w_t(w):
        return _q(w.T, recipe, "w", wblk)

    def quant_dy(dy):
        return _q(dy, recipe, "g", act), _q(dy.T, recipe, "g", wblk)

    return quant_x, quant_w_t, quant_dy, gemm_reference


# Current scaling on the Triton path: our amax + cast kernels (then an FP8 transpose), or XLA's
# fusion of the jnp quantization, which writes the transposed copy in the same pass. fp8_dense
# fwd+bwd at 16384x4096x14336: 6.91 ms with our kernels, 6.34 ms with XLA's fusion (H100,
# 2026-12-06, benchmarks/fp8.py), so the fusion is used.
CURRENT_TRITON_QUANT = False


def check_kernel_dtype(op: str, x, kernels, name: str = "kernels") -> None:
    """``kernels`` in x's dtype, or float32 master kernels with a bfloat16 / float16 x (quantized from
    their float32 values, never rounded to x's dtype first; the kernel gradient comes out in
    float32 straight from the weight-gradient GEMM's float32 sum)."""
    if jnp.dtype(x.dtype) != jnp.dtype(kernels.dtype) and not is_master_kernel(x.dtype, kernels.dtype):
        raise TypeError(
            err(op, f"{name} must have x's dtype, or be float32 master kernels with a bfloat16 or float16 x; got x "
                    f"{jnp.dtype(x.dtype)} and {name} {jnp.dtype(kernels.dtype)}.")
        )  # fmt: skip


def _triton_ops(recipe):
    from te_ops.fp8 import triton as tri

    if isinstance(recipe, CurrentScaling) and not CURRENT_TRITON_QUANT:
        return _xla_ops(recipe)
    if isinstance(recipe, CurrentScaling):  # one scale per tensor: the transposes are exact

        def quant(a, role):
            return tri.quantize_tensor(a, recipe.format(role), margin=recipe.margin, power_of_2=recipe.power_of_2)

        def quant_x(x):
            q = quant(x, "x")
            return q, _transpose(q)

        def quant_w_t(w):
            return _transpose(quant(w, "w"))

        def quant_dy(dy):
            q = quant(dy, "g")
            return q, _transpose(q)

        return quant_x, quant_w_t, quant_dy, _per_tensor_gemm(recipe)

    def quant_x(x):
        return tri.dual_quantize(x, 128, recipe.format("x"), power_of_2=recipe.power_of_2)

    def quant_w_t(w):  # square blocks: the FP8 transpose is exact (half the bytes of a bf16 one)
        return _transpose(tri.block_quantize(w, (128, 128), recipe.format("w"), power_of_2=recipe.power_of_2))

    def quant_dy(dy):  # one read: 1 x 128 tiles of dy and 128 x 128 blocks of dy^T
        return tri.dual_quantize(dy, 128, recipe.format("g"), power_of_2=recipe.power_of_2, t_square=True)

    def gemm(a, b_t, out_dtype, bias=None):
        return tri.block_scaled_gemm(a, b_t, out_dtype, bias=bias)

    return quant_x, quant_w_t, quant_dy, gemm


def _xla_ops(recipe):
    """Current scaling written in jnp (amax, scale and cast by XLA) with the GEMMs as FP8 dots that XLA
    hands to cuBLASLt: XLA's own FP8 path, and the baseline our fused quantization is measured
    against."""

    def quant_x1(x):
        q = _q(x, recipe, "x", None)
        return q, _transpose(q)

    def quant_w_t1(w):
        return _transpose(_q(w, recipe, "w", None))

    def quant_dy1(dy):
        q = _q(dy, recipe, "g", None)
        return q, _transpose(q)

    return quant_x1, quant_w_t1, quant_dy1, _per_tensor_gemm(recipe)


def _per_tensor_gemm(recipe):
    return functools.partial(gemm_xla_fp8, fast_accum=bool(getattr(recipe, "fast_accumulation", False)))


_OPS = {"reference": _reference_ops, "triton": _triton_ops, "xla": _xla_ops}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fp8_dense(x, w, bias, recipe, implementation, activation=None):
    return _fwd(x, w, bias, recipe, implementation, activation)[0]


def _fwd(x, w, bias, recipe, implementation, activation=None):
    fwd = staged(lambda name: functools.partial(_fwd_impl, recipe=recipe, implementation=name,
                                                activation=activation), implementation)  # fmt: skip
    return fwd(x, w, bias)


def _bwd(recipe, implementation, activation, res, dy):
    return staged(lambda name: functools.partial(_bwd_impl, recipe, name, activation), implementation)(res, dy)


def _activate(z32, activation, dtype):
    """``activation(z)`` of the float32 GEMM output (bias included), one rounding to ``dtype``; and
    z in ``dtype``, the backward's residual (te_ops.dense's rule)."""
    from te_ops.dense.reference import activate

    return activate(z32, activation).astype(dtype), z32.astype(dtype)


def _fwd_impl(x, w, bias, *, recipe, implementation, activation=None):
    quant_x, quant_w_t, _, gemm = _OPS[implementation](recipe)
    qx, qx_t = quant_x(x)
    qw_t = quant_w_t(w)
    if activation is None:
        return gemm(qx, qw_t, x.dtype, bias), (qx_t, qw_t, jnp.zeros((), w.dtype), _proto(bias), None)
    y, z = _activate(gemm(qx, qw_t, F32, bias), activation, x.dtype)
    return y, (qx_t, qw_t, jnp.zeros((), w.dtype), _proto(bias), z)


def _proto(bias):
    return None if bias is None else jnp.zeros((), bias.dtype)


def _dbias(dy, b_proto):
    return None if b_proto is None else jnp.sum(dy.astype(F32), axis=0).astype(b_proto.dtype)


def _bwd_impl(recipe, implementation, activation, res, dy):
    qx_t, qw_t, w_proto, b_proto, z = res
    _, _, quant_dy, gemm = _OPS[implementation](recipe)
    if activation is None:
        qdy, qdy_t = quant_dy(dy)
        dbias = _dbias(dy, b_proto)
    else:  # dz = dy * act'(z), dbias and both quantizations of dz from one fused pass where it can
        from te_ops.fp8.api import dact_dbias_quantize

        dact_impl = "triton" if implementation == "triton" and isinstance(recipe, BlockScaling) else "reference"
        # dact_dbias_quantize returns dbias in its dy's dtype: for a bias of another dtype it gets float32 dy
        # and z (the same dz, the same FP8 operands), so dbias is the float32 sum rounded once to bias's dtype.
        # That case (a direct call with, say, bf16 x and a float32 bias; the layers cast bias to x's dtype)
        # takes the pure-JAX pass: the fused kernel has only been run with dy in x's dtype.
        wide = b_proto is not None and jnp.dtype(b_proto.dtype) != jnp.dtype(dy.dtype)
        dy_, z_ = (dy.astype(F32), z.astype(F32)) if wide else (dy, z)
        dact_impl = "reference" if wide else dact_impl
        qdy, qdy_t, dbias = dact_dbias_quantize(dy_, z_, recipe, activation=activation, implementation=dact_impl)
        qdy, qdy_t = (dataclasses.replace(q, dtype=jnp.dtype(dy.dtype)) for q in (qdy, qdy_t))
        dbias = None if b_proto is None else dbias.astype(b_proto.dtype)
    dx = gemm(qdy, _transpose(qw_t), dy.dtype)  # dz @ w^T: b_t = w [K, N]
    dw = gemm(qx_t, qdy_t, w_proto.dtype)  # x^T @ dz: a = x^T [K, M], b_t = dz^T [N, M]
    return dx, dw, dbias


_fp8_dense.defvjp(_fwd, _bwd)


# ----------------------------------------------------------------------------------------------
# Delayed scaling: the three tensors' states in, their updates out through the state's cotangent
# ----------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseScalingState:
    """Delayed-scaling states of the three tensors ``fp8_dense`` quantizes: the activation ``x``, the
    kernel ``w`` and the output gradient ``g`` (a pytree)."""

    x: DelayedScalingState
    w: DelayedScalingState
    g: DelayedScalingState


def initial_dense_state(recipe: DelayedScaling) -> DenseScalingState:
    """Fresh states (all-zero histories, scale 1) for ``fp8_dense`` with ``recipe``."""
    return DenseScalingState(ref.initial_state(recipe), ref.initial_state(recipe), ref.initial_state(recipe))


def _quant_delayed(a, st, recipe, role, implementation):
    fmt = recipe.format(role)
    if implementation == "triton" and DELAYED_TRITON_CAST:
        from te_ops.fp8 import triton as tri

        q, a_amax, sinv = tri.tensor_cast(a, st.scale, fmt, with_amax=True)
        return QuantizedTensor(q, sinv, None, jnp.dtype(a.dtype)), ref.update_delayed_state(st, recipe, fmt, a_amax)
    return ref.quantize_delayed(a, st, recipe, fmt)


# Our one-pass cast kernel (cast with the state's scale, amax recorded) or XLA's fusion of the jnp
# quantization on the Triton path of delayed scaling: fp8_dense fwd+bwd at 16384x4096x14336 took
# 6.48 ms with the kernel and 6.24 ms with XLA's fusion, which also writes the transposed copy in
# the same pass (H100, 2026-12-06, benchmarks/fp8.py).
DELAYED_TRITON_CAST = False


def _delayed_gemm(implementation, recipe):
    return gemm_reference if implementation == "reference" else _per_tensor_gemm(recipe)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fp8_dense_delayed(x, w, bias, state, recipe, implementation, activation=None):
    return _dfwd(x, w, bias, state, recipe, implementation, activation)[0]


def _dfwd(x, w, bias, state, recipe, implementation, activation=None):
    fwd = staged(lambda name: lambda x, w, b, st: _dfwd_impl(x, w, b, st, recipe, name, activation), implementation)
    return fwd(x, w, bias, state)


def _dbwd(recipe, implementation, activation, res, dy):
    return staged(lambda name: functools.partial(_dbwd_impl, recipe, name, activation), implementation)(res, dy)


def _dfwd_impl(x, w, bias, state, recipe, implementation, activation=None):
    qx, st_x = _quant_delayed(x, state.x, recipe, "x", implementation)
    qw, st_w = _quant_delayed(w, state.w, recipe, "w", implementation)
    qw_t = _transpose(qw)
    gemm = _delayed_gemm(implementation, recipe)
    z = None
    if activation is None:
        y = gemm(qx, qw_t, x.dtype, bias)
    else:
        y, z = _activate(gemm(qx, qw_t, F32, bias), activation, x.dtype)
    return y, (_transpose(qx), qw_t, st_x, st_w, state.g, jnp.zeros((), w.dtype), _proto(bias), z)


def _dbwd_impl(recipe, implementation, activation, res, dy):
    qx_t, qw_t, st_x, st_w, st_g, w_proto, b_proto, z = res
    if activation is not None:  # dz = dy * act'(z) (float32), then quantized with the gradient's state
        dz = dy.astype(F32) * ref.act_grad(z, activation)
        dbias = None if b_proto is None else jnp.sum(dz, axis=0).astype(b_proto.dtype)
        qdy, st_g = _quant_delayed(dz, st_g, recipe, "g", implementation)
        qdy = QuantizedTensor(qdy.data, qdy.scale_inv, qdy.block, jnp.dtype(dy.dtype))
    else:
        qdy, st_g = _quant_delayed(dy, st_g, recipe, "g", implementation)
        dbias = _dbias(dy, b_proto)
    gemm = _delayed_gemm(implementation, recipe)
    dx = gemm(qdy, _transpose(qw_t), dy.dtype)  # dz @ w^T
    dw = gemm(qx_t, _transpose(qdy), w_proto.dtype)  # x^T @ dz
    return dx, dw, dbias, DenseScalingState(st_x, st_w, st_g)


_fp8_dense_delayed.defvjp(_dfwd, _dbwd)


def _check_dense_state(recipe: DelayedScaling, state) -> None:
    if not isinstance(state, DenseScalingState):
        raise TypeError(
            err(OP, "DelayedScaling needs state=DenseScalingState (te_ops.fp8.initial_dense_state(recipe)), got "
                    f"{state!r:.80}.")
        )  # fmt: skip
    for name in ("x", "w", "g"):
        st = getattr(state, name)
        hist, sc = jnp.shape(st.amax_history), jnp.shape(st.scale)
        if hist != (recipe.history_len,) or sc != ():
            raise ValueError(
                err(OP, f"state.{name} must hold amax_history [{recipe.history_len}] and a scalar scale "
                        f"(recipe.history_len={recipe.history_len}), got amax_history {hist} and scale {sc}.")
            )  # fmt: skip


def fp8_dense(
    x: jax.Array,
    kernel: jax.Array,
    recipe: CurrentScaling | DelayedScaling | BlockScaling,
    *,
    bias: jax.Array | None = None,
    state: DenseScalingState | None = None,
    activation: str | None = None,
    implementation=None,
):
    """``activation(x @ kernel (+ bias))`` with FP8 operands in the forward GEMM and in both backward
    GEMMs.

    Each GEMM multiplies dequantized FP8 operands and sums in float32 (module docstring: which
    tensor is quantized with which blocks); the output has x's dtype, the kernel gradient the
    kernel's dtype. Quantization follows :func:`te_ops.fp8.quantize` (docs/semantics.md, "FP8
    quantization").

    Delayed scaling: ``state`` (a :class:`DenseScalingState`, from :func:`initial_dense_state`) gives
    the scales of x, the kernel and the output gradient. The updated state (each tensor's amax
    recorded, the next scales) comes back as the **cotangent of** ``state``: differentiate with
    respect to ``state`` too and use that "gradient" as the next step's state (it is not a
    gradient; do not feed it to an optimizer)::

        loss_and_grads = jax.value_and_grad(loss, argnums=(0, 1))   # loss(params, state, batch)
        loss, (grads, state) = loss_and_grads(params, state, batch)

    A forward-only call uses the state's scales and updates nothing.

    Args:
      x: [..., K] float32, bfloat16 or float16.
      kernel: [K, N], x's dtype; or a float32 master kernel with a bfloat16 / float16 x: quantized
        from its float32 values (never rounded to x's dtype first), its gradient float32 straight
        from the weight-gradient GEMM's float32 sum.
      recipe: :class:`~te_ops.fp8.CurrentScaling`, :class:`~te_ops.fp8.DelayedScaling` or
        :class:`~te_ops.fp8.BlockScaling` (static). With block scaling the weight blocks must be
        square (the dgrad GEMM reuses them transposed).
      bias: optional [N] (any float dtype), added in float32 to the GEMM's float32 sum before the
        one rounding to x's dtype (in the block-scaled kernel's epilogue; an epilogue XLA can fuse
        into cuBLASLt with per-tensor scaling); its gradient is the float32 column sum of dy, in
        bias's dtype.
      state: with DelayedScaling (required), the :class:`DenseScalingState`; else None.
      activation: None, "gelu" (exact erf), "gelu_tanh", "relu" or "silu" (static): applied in
        float32 to the GEMM's float32 sum (bias included), one rounding to x's dtype, as
        ``te_ops.dense`` does. The backward takes ``dz = dy * activation'(z)`` (z, the
        pre-activation in x's dtype, is the residual) and quantizes dz as the gradient: with block
        scaling on the Triton path in one fused pass that also gives dbias
        (:func:`te_ops.fp8.dact_dbias_quantize`).
      implementation: None (the Triton path on a CUDA GPU with FP8 tensor cores where it takes the
        call, staged with ``jax.lax.platform_dependent``; the reference elsewhere), "reference"
        (pure JAX, every platform); "triton" (CUDA GPU; current
        or delayed scaling, or block scaling with 1 x 128 / 128 x 128 blocks: our quantize kernels,
        our block-scaled GEMM or cuBLASLt's per-tensor FP8 GEMM); "xla" (current or delayed
        scaling: quantization in jnp, FP8 dots that XLA runs through cuBLASLt on Hopper).

    Returns:
      [..., N] in x's dtype.

    Equivalent to (current scaling, forward)::

        deq = lambda q: q.data.astype(jnp.float32) * q.scale_inv
        y = deq(quantize(x, recipe, "x")) @ deq(quantize(kernel, recipe, "w"))
    """
    x = check_float(OP, "x", x, DTYPES)
    kernel = check_float(OP, "kernel", kernel, DTYPES, rank=2, layout="[K, N]")
    if not isinstance(recipe, (CurrentScaling, DelayedScaling, BlockScaling)):
        raise TypeError(
            err(OP, f"recipe must be a te_ops.fp8 CurrentScaling, DelayedScaling or BlockScaling, got {recipe!r:.80}.")
        )
    if isinstance(recipe, DelayedScaling):
        _check_dense_state(recipe, state)
    elif state is not None:
        raise ValueError(err(OP, f"state is only for DelayedScaling; {type(recipe).__name__} takes state=None."))
    if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(err(OP, f"x's last axis must match kernel's K = {kernel.shape[0]}, got x shape {x.shape}."))
    if bias is not None:
        bias = check_float(OP, "bias", bias, DTYPES, rank=1, layout="[N]")
        if bias.shape != (kernel.shape[1],):
            raise ValueError(err(OP, f"bias must have shape [N] = ({kernel.shape[1]},), got {bias.shape}."))
    check_kernel_dtype(OP, x, kernel, "kernel")
    if isinstance(recipe, BlockScaling) and recipe.weight_block[0] != recipe.weight_block[1]:
        raise ValueError(err(OP, f"BlockScaling.weight_block must be square for fp8_dense, got {recipe.weight_block}."))
    implementation = static_choice(OP, "implementation", implementation, (None, "reference", "triton", "xla"))
    static_choice(OP, "activation", activation, ref.ACT_GRADS)
    if implementation == "xla" and isinstance(recipe, BlockScaling):
        raise ValueError(
            err(OP, "implementation='xla' takes CurrentScaling or DelayedScaling (XLA has no block-scaled FP8 GEMM), "
                    f"got {recipe!r}.")
        )  # fmt: skip
    if (
        implementation == "triton"
        and isinstance(recipe, BlockScaling)
        and not (recipe.act_block == (1, 128) and recipe.weight_block == (128, 128))
    ):
        raise ValueError(
            err(OP, "implementation='triton' takes CurrentScaling, DelayedScaling, or BlockScaling with act_block "
                    f"(1, 128) and weight_block (128, 128), got {recipe!r}.")
        )  # fmt: skip
    block_ok = not isinstance(recipe, BlockScaling) or (recipe.act_block, recipe.weight_block) == ((1, 128), (128, 128))
    impl = resolve(implementation) if (implementation is not None or block_ok) else "reference"
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), x.shape[-1])  # not -1: that cannot be inferred when K == 0
    if x.shape[-1] == 0:  # an empty contraction: the sum is 0 and y = activation(bias); the kernels want K > 0
        impl = "reference"
    if isinstance(recipe, DelayedScaling):
        y = _fp8_dense_delayed(x2, kernel, bias, state, recipe, impl, activation)
    else:
        y = _fp8_dense(x2, kernel, bias, recipe, impl, activation)
    return y.reshape(*lead, kernel.shape[1])
