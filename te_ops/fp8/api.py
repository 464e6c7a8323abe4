"""Public FP8 quantization API: :func:`quantize`, :func:`dequantize`, :func:`initial_state`.

This first step is the reference path only (pure JAX, every platform): it defines the quantized
bytes that the fused quantize kernels and the FP8 GEMMs of the FP8 issue must reproduce.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from te_ops._core.validation import check_float, err, static_choice
from te_ops.fp8 import reference as ref
from te_ops.fp8.recipes import ROLES, BlockScaling, CurrentScaling, DelayedScaling
from te_ops.fp8.reference import DelayedScalingState, QuantizedTensor

OP = "fp8.quantize"
INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check_recipe(op: str, recipe: Any) -> None:
    if not isinstance(recipe, (CurrentScaling, DelayedScaling, BlockScaling)):
        raise TypeError(
            err(op, f"recipe must be a te_ops.fp8 CurrentScaling, DelayedScaling or BlockScaling, got {recipe!r:.80}.")
        )


def initial_state(recipe: DelayedScaling) -> DelayedScalingState:
    """A fresh delayed-scaling state for one tensor: an all-zero amax history and scale 1.

    Args:
      recipe: a :class:`~te_ops.fp8.DelayedScaling` (its ``history_len`` sets the history length).

    Returns:
      ``DelayedScalingState(amax_history float32 [history_len], scale float32 [])``.
    """
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(err("fp8.initial_state", f"recipe must be a DelayedScaling, got {recipe!r:.80}."))
    return ref.initial_state(recipe)


def quantize(
    x: jax.Array,
    recipe: CurrentScaling | DelayedScaling | BlockScaling,
    role: str,
    state: DelayedScalingState | None = None,
    *,
    implementation: str | None = None,
) -> QuantizedTensor | tuple[QuantizedTensor, DelayedScalingState]:
    """Quantizes ``x`` to FP8 with ``recipe`` for a tensor ``role`` ("x", "w" or "g").

    Per tensor (current and delayed scaling) or per block (block scaling of the last two axes):
    ``scale = min(fmax / amax / 2**margin, FLT_MAX)`` (1 where amax is 0 or not finite; a power of
    two if the recipe asks), ``data = fp8(clip(x * scale, -fmax, fmax))`` (round to nearest even,
    +-Inf saturate, NaN stays NaN), ``scale_inv = 1 / scale``. docs/semantics.md, "FP8
    quantization", has the full rules, including the delayed-scaling state update.

    Args:
      x: float32, bfloat16 or float16 array; block scaling needs rank >= 2 (blocks tile the last two
        axes; partial edge blocks are allowed).
      recipe: :class:`~te_ops.fp8.CurrentScaling`, :class:`~te_ops.fp8.DelayedScaling` or
        :class:`~te_ops.fp8.BlockScaling` (static: part of the jit cache key).
      role: "x" (activation), "w" (weight) or "g" (gradient): picks the format (and the block shape).
      state: the tensor's :class:`DelayedScalingState` with delayed scaling (required), else None.
      implementation: None (the Triton kernels on a CUDA GPU with FP8 tensor cores where they take
        the call, staged with ``jax.lax.platform_dependent``; the reference elsewhere), "reference"
        (pure JAX, every platform), or "triton" (CUDA GPU): block scaling in one pass
        (power-of-two blocks of at most 128 x 128 elements), delayed scaling in one pass (cast
        with the state's scale, amax recorded), current scaling in two (amax, then cast). Both
        give the same bytes.

    Returns:
      A :class:`QuantizedTensor`; with delayed scaling ``(QuantizedTensor, new state)``.

    Equivalent to (current scaling)::

        fmax = jnp.finfo(fmt).max
        scale = fmax / jnp.max(jnp.abs(x.astype(jnp.float32)))
        data = jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax).astype(fmt)
    """
    x = check_float(OP, "x", x, INPUT_DTYPES)
    _check_recipe(OP, recipe)
    static_choice(OP, "role", role, ROLES)
    if isinstance(recipe, DelayedScaling):
        if not isinstance(state, DelayedScalingState):
            raise TypeError(
                err(
                    OP,
                    "DelayedScaling needs state=DelayedScalingState (te_ops.fp8.initial_state(recipe)), "
                    f"got {state!r:.80}.",
                )
            )
        hist = jnp.shape(state.amax_history)
        if hist != (recipe.history_len,) or jnp.shape(state.scale) != ():
            raise ValueError(
                err(OP, f"state must hold amax_history [{recipe.history_len}] and a scalar scale (recipe.history_len="
                        f"{recipe.history_len}), got amax_history {hist} and scale {jnp.shape(state.scale)}.")
            )  # fmt: skip
    elif state is not None:
        raise ValueError(err(OP, f"state is only for DelayedScaling; {type(recipe).__name__} takes state=None."))
    if isinstance(recipe, BlockScaling) and x.ndim < 2:
        raise ValueError(
            err(OP, f"BlockScaling tiles the last two axes; x must have rank >= 2, got shape {x.shape}. "
                    "Reshape a vector to [1, n].")
        )  # fmt: skip
    static_choice(OP, "implementation", implementation, (None, "reference", "triton"))
    if implementation is None:
        from te_ops.fp8.select import resolve, staged

        impl = resolve(None)
        if impl == "auto" and _triton_reason(x, recipe, role) is None:
            return staged(lambda name: lambda x, st: quantize(x, recipe, role, st, implementation=name), impl)(x, state)
        return ref.quantize(x, recipe, role, state)
    if implementation == "triton":
        from te_ops.fp8 import triton as tri

        fmt = recipe.format(role)
        why = _triton_reason(x, recipe, role)
        if why:
            raise ValueError(err(OP, f"implementation='triton' cannot take this call: {why}."))
        if isinstance(recipe, BlockScaling):
            return tri.block_quantize(x, recipe.block(role), fmt, power_of_2=recipe.power_of_2)
        if isinstance(recipe, DelayedScaling):  # one read: cast with the state's scale, amax recorded
            q, x_amax, sinv = tri.tensor_cast(x, state.scale, fmt, with_amax=True)
            qt = QuantizedTensor(q, sinv, None, jnp.dtype(x.dtype))
            return qt, ref.update_delayed_state(state, recipe, fmt, x_amax)
        return tri.quantize_tensor(x, fmt, margin=recipe.margin, power_of_2=recipe.power_of_2)
    return ref.quantize(x, recipe, role, state)


def _triton_reason(x, recipe, role) -> str | None:
    from te_ops.fp8 import triton as tri

    block = recipe.block(role) if isinstance(recipe, BlockScaling) else None
    return tri.unsupported_reason(dtype=x.dtype, block=block, fmt=recipe.format(role))


def dequantize(q: QuantizedTensor, dtype: Any = None) -> jax.Array:
    """``q.data * q.scale_inv`` (per block for block-scaled tensors), computed in float32.

    Args:
      q: a :class:`QuantizedTensor` from :func:`quantize`.
      dtype: output dtype (default: the dtype the tensor had before quantization).

    Returns:
      An array of ``q``'s shape.
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(err("fp8.dequantize", f"q must be a te_ops.fp8.QuantizedTensor, got {type(q).__name__}."))
    return ref.dequantize(q, dtype)


DACT_OP = "fp8.dact_dbias_quantize"


def dact_dbias_quantize(
    dy: jax.Array,
    z: jax.Array,
    recipe: BlockScaling | CurrentScaling,
    *,
    activation: str | None = "gelu",
    implementation: str | None = None,
) -> tuple[QuantizedTensor, QuantizedTensor, jax.Array]:
    """The backward of ``y = activation(z)``, ``z = x @ w + bias``, straight into the FP8 operands
    of the two backward GEMMs, with the bias gradient.

    ``dz = dy * activation'(z)`` in float32 (never rounded to dy's dtype); then ``dz`` quantized as
    a gradient (role "g") for the dgrad GEMM ``dx = dz @ w^T``, ``dz^T`` for the wgrad GEMM ``dw =
    x^T @ dz``, and ``dbias = sum(dz, rows)`` (float32 sums, in dy's dtype). With block scaling dz
    takes the recipe's ``act_block`` tiles and dz^T its ``weight_block`` blocks; with current
    scaling both share one scale (dz^T is the exact FP8 transpose). The derivatives are those of
    ``te_ops.dense``'s activations: "gelu" (exact erf), "gelu_tanh", "relu" (0 at z <= 0), "silu",
    or None (dz = dy); docs/semantics.md, "FP8 quantization", has the formulas.

    Args:
      dy: [M, N] float32, bfloat16 or float16: the gradient of the activation's output.
      z: [M, N], dy's dtype: the pre-activation saved by the forward.
      recipe: :class:`~te_ops.fp8.BlockScaling` or :class:`~te_ops.fp8.CurrentScaling` (static).
      activation: None, "gelu", "gelu_tanh", "relu" or "silu" (static).
      implementation: None (the fused Triton kernel on a CUDA GPU with FP8 tensor cores where it
        takes the call, staged with ``jax.lax.platform_dependent``; the reference elsewhere),
        "reference" (pure JAX) or "triton" (block scaling with 1 x 128 / 128 x 128 blocks: one read
        of dy and z writes both quantizations and the dbias partials).

    Returns:
      ``(q_dz [M, N], q_dz_t [N, M], dbias [N])``.

    Equivalent to::

        dz = dy.astype(jnp.float32) * activation_derivative(z.astype(jnp.float32))
        q_dz, q_dz_t = quantize(dz, recipe, "g"), quantize(dz.T, ...)   # weight_block for dz^T
        dbias = dz.sum(0).astype(dy.dtype)
    """
    dy = check_float(DACT_OP, "dy", dy, INPUT_DTYPES, rank=2, layout="[M, N]")
    z = check_float(DACT_OP, "z", z, INPUT_DTYPES, rank=2, layout="[M, N]")
    if z.shape != dy.shape or z.dtype != dy.dtype:
        raise ValueError(
            err(DACT_OP, f"z must have dy's shape and dtype {dy.shape} {dy.dtype}, got {z.shape} {z.dtype}.")
        )
    if not isinstance(recipe, (BlockScaling, CurrentScaling)):
        raise TypeError(
            err(DACT_OP, f"recipe must be a te_ops.fp8 BlockScaling or CurrentScaling, got {recipe!r:.80}.")
        )
    static_choice(DACT_OP, "activation", activation, ref.ACT_GRADS)
    static_choice(DACT_OP, "implementation", implementation, (None, "reference", "triton"))
    why = _dact_triton_reason(dy, recipe)
    if implementation == "triton" and why:
        raise ValueError(err(DACT_OP, f"implementation='triton' cannot take this call: {why}."))
    if implementation is None:
        from te_ops.fp8.select import resolve, staged

        impl = resolve(None)
        if impl == "auto" and why is None:
            return staged(
                lambda name: lambda d, zz: dact_dbias_quantize(d, zz, recipe, activation=activation,
                                                               implementation=name), impl)(dy, z)  # fmt: skip
        implementation = "reference"
    if implementation == "triton":
        from te_ops.fp8 import triton as tri

        return tri.dact_dbias_quantize(dy, z, activation, 128, recipe.format("g"), power_of_2=recipe.power_of_2)
    return ref.dact_dbias_quantize(dy, z, activation, recipe)


def _dact_triton_reason(dy, recipe) -> str | None:
    if not isinstance(recipe, BlockScaling) or (recipe.act_block, recipe.weight_block) != ((1, 128), (128, 128)):
        return f"the fused kernel takes BlockScaling with 1 x 128 / 128 x 128 blocks, got {recipe!r}"
    from te_ops.fp8 import triton as tri

    return tri.unsupported_reason(dtype=dy.dtype, block=(128, 128), fmt=recipe.format("g"))
