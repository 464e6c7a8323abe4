"""Public softmax ops: validation, custom VJP, registration and implementation dispatch.

Sharding rule and vmap fold: :mod:`te_ops.softmax.sharding`. The exact semantics, non-finite
inputs included: the docstrings below, ``reference.py`` and docs/semantics.md ("Softmax").
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from te_ops._core import registry
from te_ops._core.partitioning import match_vma
from te_ops._core.validation import check_bool, check_float, check_implementation, err, static_float
from te_ops.softmax import native, reference, sharding
from te_ops.softmax.reference import Residuals

FAMILY = registry.family("softmax")
FAMILY.register(
    registry.Implementation(
        name="native",
        forward=native.forward,
        backward=native.backward,
        unsupported_reason=native.unsupported_reason,
        platform="cuda",
        available=registry.native_available("_native", "softmax"),
    )
)
FAMILY.register(
    registry.Implementation(name=registry.REFERENCE, forward=reference.forward, backward=reference.backward)
)

# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

_SCALE_WHY = (
    "The scale is compiled into the kernel; pass a number such as scale=1 / math.sqrt(head_dim), not a traced array."
)


def _implementation(op: str, implementation: str | None, x: jax.Array) -> str | None:
    """The implementation to build: checked by name here (so the message names the public function), and
    the reference for an empty x (no kernel is launched for it; the result is the empty array)."""
    check_implementation(op, implementation, FAMILY.names)
    return registry.REFERENCE if x.size == 0 else implementation


def _check_x(op: str, x: Any, min_rank: int, layout: str) -> jax.Array:
    x = check_float(op, "x", x)
    if x.ndim < min_rank:
        raise ValueError(err(op, f"x must have rank >= {min_rank} {layout}, got shape {tuple(x.shape)}."))
    return x


def _check_mask(op: str, mask: Any, x: jax.Array) -> jax.Array:
    mask = check_bool(op, "mask", mask, hint="True means masked out; convert it, e.g. mask = (mask != 0).")
    if mask.ndim > 4:
        raise ValueError(err(op, f"mask must have rank <= 4 [B|1, N|1, Sq|1, Sk], got shape {tuple(mask.shape)}."))
    mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    ok = mask.shape[3] == x.shape[3] and all(m in (1, d) for m, d in zip(mask.shape[:3], x.shape[:3], strict=True))
    if not ok:
        raise ValueError(
            err(
                op,
                f"mask of shape {tuple(mask.shape)} is not broadcastable as [B or 1, N or 1, Sq or 1, Sk] to x of "
                f"shape {tuple(x.shape)}. Give the mask x's last axis and size 1 or x's size on the others.",
            )
        )
    return mask


# ----------------------------------------------------------------------------------------------
# The custom_vjp op, built once per static configuration.
# ----------------------------------------------------------------------------------------------


def _call_desc(x, mask, mode, scale):
    return dict(
        dtype=x.dtype,
        x_shape=tuple(x.shape),
        mask_shape=None if mask is None else tuple(mask.shape),
        mode=mode,
        scale=scale,
    )


@functools.cache
def _build(mode: str, scale: float, implementation: str | None, has_mask: bool):
    statics = dict(mode=mode, scale=scale)

    def fwd_impl(x, *mask):
        m = mask[0] if mask else None
        y, _ = FAMILY.dispatch(implementation, "forward", (x, m), statics, _call_desc(x, m, mode, scale))
        return y

    def bwd_impl(y, dy, *mask):
        m = mask[0] if mask else None
        res = Residuals(y, m)
        return FAMILY.dispatch(implementation, "backward", (res, dy), statics, _call_desc(y, m, mode, scale))

    fwd_call = sharding.sharded(fwd_impl, mode, n_x_like=1, has_mask=has_mask)
    bwd_call = sharding.sharded(bwd_impl, mode, n_x_like=2, has_mask=has_mask)

    if has_mask:

        @jax.custom_vjp
        def op(x, mask):
            return fwd_call(x, mask)

        def op_fwd(x, mask):
            y = fwd_call(x, mask)
            return y, Residuals(y, mask)

        def op_bwd(res, g):
            return bwd_call(res.y, g, res.mask), None

    else:

        @jax.custom_vjp
        def op(x):
            return fwd_call(x)

        def op_fwd(x):
            y = fwd_call(x)
            return y, Residuals(y, None)

        def op_bwd(res, g):
            return (bwd_call(res.y, g),)

    op.defvjp(op_fwd, op_bwd)
    return op


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def scaled_softmax(x: jax.Array, scale: float = 1.0, *, implementation: str | None = None) -> jax.Array:
    """Softmax of ``scale * x`` over the last axis, in fp32 maths, output in x's dtype.

    Equivalent to::

        jax.nn.softmax(scale * x.astype(jnp.float32), axis=-1).astype(x.dtype)
        # except: a row that is all -inf gives zeros (jax.nn.softmax gives NaN)

    Non-finite inputs, per row, with ``z = scale * float32(x)``: NaN or +inf in an unmasked ``z``
    makes every unmasked position of the row NaN (a diverging input is not hidden); -inf in an
    unmasked ``z`` is probability 0, like a masked position; a row with no finite unmasked ``z``
    (all masked, or all -inf) is all zeros with a zero gradient. Masked positions are exactly 0
    whatever x holds there, NaN rows included. Backward: positions where the output is 0 get a
    zero gradient and take no part in the row sum, whatever ``dy`` holds there; elsewhere
    ``dx = scale * y * (dy - sum(y * dy))``.

    Axes of length 0 are allowed (an empty last axis included) and give an empty result.

    Args:
      x: ``[..., S]`` float32, bfloat16 or float16, rank >= 1.
      scale: static Python float (finite; 0 is allowed and gives a uniform row, or NaN where x is +-inf).
      implementation: None (best available), "native" or "reference".

    Returns:
      ``[..., S]`` array of x's dtype.
    """
    op = "scaled_softmax"
    x = _check_x(op, x, 1, "[..., S]")
    scale = static_float(op, "scale", scale, why=_SCALE_WHY)
    return _build("none", scale, _implementation(op, implementation, x), False)(*match_vma(x))


def scaled_masked_softmax(
    x: jax.Array, mask: jax.Array, scale: float = 1.0, *, implementation: str | None = None
) -> jax.Array:
    """Masked softmax of ``scale * x`` over the last axis; True in ``mask`` means masked out.

    Masked positions get probability exactly 0; a row masked everywhere gives zeros (and a zero
    gradient), not NaN.

    Equivalent to::

        keep = ~mask
        z = scale * x.astype(jnp.float32)
        y = jax.nn.softmax(z, axis=-1, where=keep)           # masked positions -> 0
        empty = ~jnp.any(keep & ~jnp.isneginf(z), axis=-1, keepdims=True)
        y = jnp.where(empty, 0.0, y).astype(x.dtype)          # no finite unmasked element -> 0

    Non-finite inputs, per row, with ``z = scale * float32(x)``: NaN or +inf in an unmasked ``z``
    makes every unmasked position of the row NaN (a diverging input is not hidden); -inf in an
    unmasked ``z`` is probability 0, like a masked position; a row with no finite unmasked ``z``
    (all masked, or all -inf) is all zeros with a zero gradient. Masked positions are exactly 0
    whatever x holds there, NaN rows included. Backward: positions where the output is 0 get a
    zero gradient and take no part in the row sum, whatever ``dy`` holds there; elsewhere
    ``dx = scale * y * (dy - sum(y * dy))``.

    Args:
      x: ``[B, N, Sq, Sk]`` float32, bfloat16 or float16.
      mask: bool, broadcastable as ``[B or 1, N or 1, Sq or 1, Sk]`` (lower rank is left-padded).
      scale: static Python float.
      implementation: None (best available), "native" or "reference".

    Returns:
      ``[B, N, Sq, Sk]`` array of x's dtype.
    """
    op = "scaled_masked_softmax"
    x = check_float(op, "x", x, rank=4, layout="[B, N, Sq, Sk]")
    mask = _check_mask(op, mask, x)
    scale = static_float(op, "scale", scale, why=_SCALE_WHY)
    return _build("mask", scale, _implementation(op, implementation, x), True)(*match_vma(x, mask))


def scaled_upper_triang_masked_softmax(
    x: jax.Array, scale: float = 1.0, *, implementation: str | None = None
) -> jax.Array:
    """Causal softmax of ``scale * x``: position j > i of the trailing ``[S, S]`` block is masked.

    Equivalent to::

        causal = jnp.tril(jnp.ones((S, S), bool))
        z = scale * x.astype(jnp.float32)
        y = jax.nn.softmax(z, axis=-1, where=causal)
        empty = ~jnp.any(causal & ~jnp.isneginf(z), axis=-1, keepdims=True)
        y = jnp.where(empty, 0.0, y).astype(x.dtype)

    Non-finite inputs, per row, with ``z = scale * float32(x)``: NaN or +inf in an unmasked ``z``
    makes every unmasked position of the row NaN (a diverging input is not hidden); -inf in an
    unmasked ``z`` is probability 0, like a masked position; a row with no finite unmasked ``z``
    (all masked, or all -inf) is all zeros with a zero gradient. Masked positions are exactly 0
    whatever x holds there, NaN rows included. Backward: positions where the output is 0 get a
    zero gradient and take no part in the row sum, whatever ``dy`` holds there; elsewhere
    ``dx = scale * y * (dy - sum(y * dy))``.

    Args:
      x: ``[..., S, S]`` float32, bfloat16 or float16.
      scale: static Python float.
      implementation: None (best available), "native" or "reference".

    Returns:
      ``[..., S, S]`` array of x's dtype.
    """
    op = "scaled_upper_triang_masked_softmax"
    x = _check_x(op, x, 2, "[..., S, S]")
    if x.shape[-1] != x.shape[-2]:
        raise ValueError(
            err(op, f"the last two axes of x must be equal (a square [S, S] score block), got shape {tuple(x.shape)}.")
        )
    scale = static_float(op, "scale", scale, why=_SCALE_WHY)
    return _build("causal", scale, _implementation(op, implementation, x), False)(*match_vma(x))
