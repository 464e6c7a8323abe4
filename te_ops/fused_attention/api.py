"""Public fused_attention op: validation, custom VJP, registration and implementation dispatch.

Sharding rules and vmap folds: :mod:`te_ops.fused_attention.sharding`. The exact semantics, masks
and non-finite inputs included: :func:`fused_attention`, ``reference.py`` and docs/semantics.md
("Fused attention").
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_ops._core import registry
from te_ops._core.partitioning import match_vma
from te_ops._core.validation import check_float, check_int_array, err, is_array, static_choice, static_float
from te_ops.fused_attention import native, reference, sharding
from te_ops.fused_attention.reference import Residuals
from te_ops.fused_attention.sharding import OPTIONAL

OP = "fused_attention"
FAMILY = registry.family(OP)
FAMILY.register(
    registry.Implementation(
        name="native",
        forward=native.forward,
        backward=native.backward,
        unsupported_reason=native.unsupported_reason,
        platform="cuda",
        # The default on CUDA: tests/gpu/test_fused_attention_gpu.py checks it against the reference.
        available=registry.native_available(native.MODULE, "fused_attention"),
    )
)
FAMILY.register(
    registry.Implementation(name=registry.REFERENCE, forward=reference.forward, backward=reference.backward)
)

MASK_TYPES = ("none", "causal", "padding", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right")
MAX_HEAD_DIM = 256


def dropout_seeds(rng: jax.Array, b: int, hq: int) -> jax.Array:
    """uint32 [B, Hq, 4]: one seed per (batch, query head), a function of the key only."""
    bits = jax.random.bits(rng, (b, hq, 4), jnp.uint32)
    # bytes 8..15 are cuDNN's int64 Philox offset: keep it a small non-negative number.
    return bits.at[..., 3].set(0).at[..., 2].set(bits[..., 2] >> 8)


def _err(msg: str) -> str:
    return err(OP, msg)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _check_qkv(q, k, v):
    q = check_float(OP, "q", q, rank=4, layout="[B, Sq, Hq, D]")
    k = check_float(OP, "k", k, rank=4, layout="[B, Sk, Hk, D]")
    v = check_float(OP, "v", v, rank=4, layout="[B, Sk, Hk, Dv]")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            _err(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}. Cast them to one dtype.")
        )
    b, _, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(
            _err(f"batch sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (axis 0 must match).")
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            _err(
                f"k [B, Sk, Hk, D] and v [B, Sk, Hk, Dv] must agree on B, Sk, Hk; got {tuple(k.shape)} and "
                f"{tuple(v.shape)}."
            )
        )
    if k.shape[3] != d:
        raise ValueError(_err(f"q and k must have the same head dim D, got q {tuple(q.shape)} and k {tuple(k.shape)}."))
    hk = k.shape[2]
    if hk == 0 or hq % hk != 0:
        raise ValueError(
            _err(
                f"the number of query heads Hq={hq} must be a multiple of the number of key/value heads "
                f"Hk={hk} (GQA/MQA); repeat k/v heads or change the head counts."
            )
        )
    for name, dim in (("D (q/k head dim)", d), ("Dv (v head dim)", v.shape[3])):
        if dim <= 0 or dim > MAX_HEAD_DIM or dim % 8 != 0:
            raise ValueError(
                _err(
                    f"head dim {name} must be a multiple of 8 and at most {MAX_HEAD_DIM}, got {dim}. Pad the "
                    "head dimension with zeros to a multiple of 8 (and pass scale= to keep the softmax scale)."
                )
            )
    return q, k, v


def _check_bias(bias, q, k):
    bias = check_float(OP, "bias", bias)
    if bias.ndim > 4:
        raise ValueError(_err(f"bias must have rank <= 4 [B|1, Hq|1, Sq|1, Sk|1], got shape {tuple(bias.shape)}."))
    bias = bias.reshape((1,) * (4 - bias.ndim) + tuple(bias.shape))
    full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    if any(b not in (1, f) for b, f in zip(bias.shape, full, strict=True)):
        raise ValueError(
            _err(f"bias of shape {tuple(bias.shape)} does not broadcast as [B|1, Hq|1, Sq|1, Sk|1] to {full}.")
        )
    # Materialise broadcast query/key axes (outside the custom_vjp, so autodiff sums dbias back).
    return jnp.broadcast_to(bias, bias.shape[:2] + full[2:])


def _check_ints(name: str, x: Any, shape: tuple[int, ...], layout: str) -> jax.Array:
    x = check_int_array(OP, name, x)
    if tuple(x.shape) != shape:
        raise ValueError(_err(f"{name} must have shape {layout}={shape}, got {tuple(x.shape)}."))
    return x.astype(jnp.int32)


def _check_window(window):
    if window is None:
        return None
    if isinstance(window, (numbers.Integral, np.integer)) and not isinstance(window, bool):
        window = (int(window), int(window))
    ok = (
        isinstance(window, (tuple, list))
        and len(window) == 2
        and all(
            isinstance(w, (numbers.Integral, np.integer)) and not isinstance(w, bool) and int(w) >= -1 for w in window
        )
    )
    if not ok:
        raise ValueError(
            _err(f"window_size must be None or (left, right) with ints >= -1 (-1 = unbounded), got {window!r}.")
        )
    return (int(window[0]), int(window[1]))


# ----------------------------------------------------------------------------------------------
# The custom_vjp op, built once per static configuration.
# ----------------------------------------------------------------------------------------------


def _call_desc(q, k, v, opt, statics):
    bias = opt.get("bias")
    return dict(
        dtype=q.dtype,
        q_shape=tuple(q.shape),
        k_shape=tuple(k.shape),
        v_shape=tuple(v.shape),
        bias_shape=None if bias is None else tuple(bias.shape),
        bias_dtype=None if bias is None else bias.dtype,
        has_seqlens=opt.get("q_seqlens") is not None or opt.get("kv_seqlens") is not None,
        has_segments=opt.get("q_segment_ids") is not None,
        has_positions=opt.get("q_segment_pos") is not None,
        **statics,
    )


def _unpack(present, arrays):
    it = iter(arrays)
    return {n: (next(it) if p else None) for n, p in zip(OPTIONAL, present, strict=True)}


@functools.cache
def _build(mask_type, window, scale, dropout_rate, implementation, present, deterministic):
    statics = dict(mask_type=mask_type, window=window, scale=scale, dropout_rate=dropout_rate)
    bwd_statics = dict(statics, deterministic=deterministic)  # the backward's algorithm choice
    # Every stage's support check sees it: cuDNN may refuse (or size the workspace differently for) the
    # deterministic backward, and forward and backward must then fall back to the reference together.
    desc_statics = bwd_statics

    def fwd_impl(q, k, v, *optional):
        opt = _unpack(present, optional)
        args = (q, k, v, *(opt[n] for n in OPTIONAL))
        out, res = FAMILY.dispatch(implementation, "forward", args, statics, _call_desc(q, k, v, opt, desc_statics))
        return out, res.lse

    def infer_impl(q, k, v, *optional):  # primal outside autodiff: no statistics (cuDNN inference graph)
        opt = _unpack(present, optional)
        args = (q, k, v, *(opt[n] for n in OPTIONAL))
        out, _ = FAMILY.dispatch(
            implementation,
            "forward",
            args,
            {**statics, "need_stats": False},
            _call_desc(q, k, v, opt, desc_statics),
        )
        return out

    def bwd_impl(q, k, v, out, g, lse, *optional):
        opt = _unpack(present, optional)
        res = Residuals(
            q,
            k,
            v,
            opt["bias"],
            out,
            lse,
            opt["q_seqlens"],
            opt["kv_seqlens"],
            opt["q_segment_ids"],
            opt["kv_segment_ids"],
            opt["seed"],
            opt["q_segment_pos"],
            opt["kv_segment_pos"],
        )
        dq, dk, dv, dbias = FAMILY.dispatch(
            implementation, "backward", (res, g), bwd_statics, _call_desc(q, k, v, opt, desc_statics)
        )
        return (dq, dk, dv) + ((dbias,) if opt["bias"] is not None else ())

    fwd_call = sharding.sharded(fwd_impl, present, "fwd")
    bwd_call = sharding.sharded(bwd_impl, present, "bwd")
    infer_call = sharding.sharded(infer_impl, present, "infer")

    @jax.custom_vjp
    def op(q, k, v, optional):
        return infer_call(q, k, v, *optional)

    def op_fwd(q, k, v, optional):
        out, lse = fwd_call(q, k, v, *optional)
        return out, (q, k, v, out, lse, optional)

    def op_bwd(saved, g):
        q, k, v, out, lse, optional = saved
        grads = bwd_call(q, k, v, out, g.astype(out.dtype), lse, *optional)
        names = [n for n, p in zip(OPTIONAL, present, strict=True) if p]
        opt_grads = tuple(grads[3] if n == "bias" else None for n in names)
        return grads[0], grads[1], grads[2], opt_grads

    op.defvjp(op_fwd, op_bwd)
    return op


_DETERMINISM_FLAGS = ("--xla_gpu_deterministic_ops", "--xla_gpu_exclude_nondeterministic_ops")


def xla_deterministic_flag() -> bool:
    """Whether XLA_FLAGS (the environment variable, read now) turns on XLA's GPU determinism:
    ``--xla_gpu_deterministic_ops=true`` or ``--xla_gpu_exclude_nondeterministic_ops=true`` (the last
    occurrence of a flag wins; a bare ``--flag`` means true)."""
    on = dict.fromkeys(_DETERMINISM_FLAGS, False)
    for tok in os.environ.get("XLA_FLAGS", "").split():
        name, eq, value = tok.partition("=")
        if name in on:
            on[name] = (not eq) or value.strip().lower() in ("true", "1")
    return any(on.values())


def _check_deterministic(deterministic: Any) -> bool:
    if deterministic is None:
        return xla_deterministic_flag()
    if not isinstance(deterministic, bool):
        raise TypeError(
            _err(
                f"deterministic must be a Python bool or None (None: follow --xla_gpu_deterministic_ops in "
                f"XLA_FLAGS), got {type(deterministic).__name__} {deterministic!r:.60}. It is static: pass a "
                "Python bool, not an array."
            )
        )
    return bool(deterministic)


def _check_rng(rng: Any) -> jax.Array:
    """A JAX PRNG key: a typed key array of shape () or a raw uint32[2] key."""
    if not is_array(rng):
        raise TypeError(
            _err(f"rng must be a JAX PRNG key (e.g. jax.random.key(0)), got {type(rng).__name__} {rng!r:.60}.")
        )
    rng = jnp.asarray(rng)
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.shape != ():
            raise ValueError(_err(f"rng must be a single PRNG key (shape ()), got a key array of shape {rng.shape}."))
        return rng
    if rng.dtype != jnp.uint32 or rng.shape != (2,):
        raise TypeError(
            _err(
                f"rng must be a JAX PRNG key: a typed key (jax.random.key(0)) or a raw uint32[2] key "
                f"(jax.random.PRNGKey(0)), got {rng.dtype}{list(rng.shape)}."
            )
        )
    return rng


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def fused_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    bias: jax.Array | None = None,
    mask_type: str = "none",
    q_seqlens: jax.Array | None = None,
    kv_seqlens: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_segment_pos: jax.Array | None = None,
    kv_segment_pos: jax.Array | None = None,
    window_size: tuple[int, int] | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    rng: jax.Array | None = None,
    implementation: str | None = None,
    deterministic: bool | None = None,
) -> jax.Array:
    """Scaled dot-product attention, fused: ``softmax(scale * q k^T + bias, masked) v``.

    The native (cuDNN) path keeps only the output and the softmax logsumexp ``[B, Hq, Sq]`` for the
    backward: memory does not grow with ``Sq * Sk`` (except for a ``bias``, which is ``Sq * Sk`` by
    itself, and packed sequences, which cuDNN receives as a ``[B, 1, Sq, Sk]`` additive mask).

    Equivalent to (no dropout, finite inputs; ``visible`` is the mask described below)::

        kk = jnp.repeat(k, Hq // Hk, axis=2); vv = jnp.repeat(v, Hq // Hk, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk).astype(jnp.float32) * scale + bias
        p = jax.nn.softmax(s, axis=-1, where=visible)
        p = jnp.where(visible.any(-1, keepdims=True), p, 0.0)   # rows with no visible key -> 0
        out = jnp.einsum("bhqk,bkhd->bqhd", p, vv).astype(q.dtype)

    Masks (combined with AND), with ``qp, kp`` the positions of query i and key j (``i, j``, or
    ``q_segment_pos[b, i]``, ``kv_segment_pos[b, j]`` when given) and ``off`` the diagonal offset
    (0, or ``Sk - Sq`` for the ``*_bottom_right`` mask types, ``kv_seqlens[b] - q_seqlens[b]`` with
    padding):

    * ``mask_type="causal"``: key j visible to query i iff ``kp <= qp`` (top-left aligned, like
      ``jax.nn.dot_product_attention(is_causal=True)``).
    * ``mask_type="causal_bottom_right"``: iff ``j <= i + off``: aligned at the bottom-right corner
      (TransformerEngine's ``causal_bottom_right``), so the last query sees every key, e.g. new
      queries appended to a cache of ``Sk - Sq`` keys. With ``Sq > Sk`` the first ``Sq - Sk`` queries
      see no key (output 0).
    * ``mask_type="padding"``: iff ``i < q_seqlens[b]`` and ``j < kv_seqlens[b]``;
      ``"padding_causal"`` / ``"padding_causal_bottom_right"``: padding and the causal rule. Queries
      beyond ``q_seqlens`` get output 0.
    * ``q_segment_ids`` / ``kv_segment_ids`` (packed sequences): iff the ids are equal.
    * ``window_size=(left, right)``: iff ``qp + off - left <= kp <= qp + off + right`` (-1:
      unbounded side); with a bottom-right mask type the window follows the shifted diagonal.
    * ``q_segment_pos`` / ``kv_segment_pos`` (with segment ids only): the causal mask and the window
      compare these positions instead of the indices, so that they follow each packed sequence's own
      positions (e.g. packed cross-attention, where segment k of the queries starts at a different
      index than segment k of the keys). Without them, positions are the indices.

    Edge cases and non-finite inputs, per query row i with scores ``s_ij`` over its visible keys:

    * no visible key, or every visible score -inf: output row 0 and zero gradients (not NaN, not a
      uniform average);
    * a NaN or +inf visible score (a NaN in ``q_i``, in a visible ``k_j`` or ``bias_ij``): the whole
      output row is NaN, as with ``jax.nn.dot_product_attention``; a diverging input is not hidden;
    * a -inf visible score (e.g. from the bias) is probability 0, like a masked key;
    * a pair with probability 0 (masked, -inf, underflow) takes no part in the output or the
      gradients, whatever its k, v or bias hold; a NaN in ``v_j[e]`` of a key with non-zero
      probability makes ``out_i[e]`` NaN.

    The native (cuDNN) path works in tiles and cannot exclude everything: a NaN or inf in ``k``,
    ``v`` or ``bias`` at a pair that is masked (or has probability 0) can still reach the rows of
    the same tile as NaN, and with segment ids (applied as an additive -inf mask) a masked NaN
    ``k`` makes the row NaN. Keep padding and masked positions finite when using it. With segment
    positions, or with a bottom-right mask and segment ids or a bias, the causal and window rules go
    into that additive mask too (cuDNN's own masks compare indices, and its bottom-right mask takes no
    bias). Where cuDNN refuses a configuration (e.g. a bottom-right mask with dropout),
    ``implementation=None`` runs the reference.

    Args:
      q: ``[B, Sq, Hq, D]`` bfloat16/float16 (float32 on the reference path only).
      k: ``[B, Sk, Hk, D]`` with ``Hq % Hk == 0`` (GQA/MQA).
      v: ``[B, Sk, Hk, Dv]``. ``D`` and ``Dv`` are multiples of 8, at most 256.
      bias: additive, broadcastable as ``[B|1, Hq|1, Sq|1, Sk|1]``; differentiable.
      mask_type: "none", "causal", "padding", "padding_causal", "causal_bottom_right" or
        "padding_causal_bottom_right".
      q_seqlens, kv_seqlens: int ``[B]`` valid lengths (padding mask types only; a missing one means
        full length).
      q_segment_ids, kv_segment_ids: int ``[B, Sq]`` / ``[B, Sk]`` (together; not with padding).
      q_segment_pos, kv_segment_pos: int ``[B, Sq]`` / ``[B, Sk]`` positions inside the packed
        segments (together, only with segment ids, not with a bottom-right mask); they change the
        causal and window rules only.
      window_size: None or ``(left, right)``.
      scale: static float; default ``1 / sqrt(D)``.
      dropout_rate: static float in [0, 1); needs ``rng``.
      rng: JAX PRNG key (typed or raw uint32[2]); same key, same result.
      implementation: None (best available), "native" or "reference".
      deterministic: static bool or None. True: the native (cuDNN) backward uses cuDNN's
        deterministic algorithm (dQ accumulated in a fixed order instead of with atomics), so
        repeated runs on the same inputs give bit-identical gradients; it can be slower, and where
        cuDNN has no deterministic kernel for the configuration, ``implementation=None`` runs the
        reference. False: cuDNN's default backward, whose dQ may differ in the last bits run to run.
        None (default): True when the XLA_FLAGS environment variable holds
        ``--xla_gpu_deterministic_ops=true`` (or ``--xla_gpu_exclude_nondeterministic_ops=true``) at
        trace time, else False. The reference path ignores it (its XLA ops follow that flag); the
        forward is the same either way.

    Returns:
      ``[B, Sq, Hq, Dv]`` in q's dtype.
    """
    q, k, v = _check_qkv(q, k, v)
    b, s_q, hq, d = q.shape
    s_k = k.shape[1]
    static_choice(OP, "mask_type", mask_type, MASK_TYPES)
    padding = mask_type in reference.PADDING
    has_len = q_seqlens is not None or kv_seqlens is not None
    if has_len and not padding:
        raise ValueError(
            _err(
                f"q_seqlens/kv_seqlens are given but mask_type={mask_type!r} ignores them; use "
                f"mask_type={'padding' if mask_type == 'none' else 'padding_' + mask_type!r}."
            )
        )
    if padding and not has_len:
        raise ValueError(_err(f"mask_type={mask_type!r} needs q_seqlens and/or kv_seqlens (int [B]); got neither."))
    has_seg = q_segment_ids is not None or kv_segment_ids is not None
    if has_seg and (q_segment_ids is None or kv_segment_ids is None):
        raise ValueError(
            _err(
                "q_segment_ids and kv_segment_ids must be given together (pass the same ids twice for self-attention)."
            )
        )
    if has_seg and padding:
        raise ValueError(
            _err(
                f"segment ids cannot be combined with mask_type={mask_type!r}: express padding as its own "
                "segment id (e.g. 0 for padding tokens) and use mask_type='none' or 'causal'."
            )
        )
    has_pos = q_segment_pos is not None or kv_segment_pos is not None
    if has_pos and (q_segment_pos is None or kv_segment_pos is None):
        raise ValueError(
            _err(
                "q_segment_pos and kv_segment_pos must be given together (pass the same positions twice for "
                "self-attention)."
            )
        )
    if has_pos and not has_seg:
        raise ValueError(
            _err(
                "q_segment_pos/kv_segment_pos are positions inside packed segments and need q_segment_ids and "
                "kv_segment_ids; without segments the causal mask and the window use the sequence indices."
            )
        )
    if has_pos and mask_type in reference.BOTTOM_RIGHT:
        raise ValueError(
            _err(
                f"mask_type={mask_type!r} cannot be combined with q_segment_pos/kv_segment_pos: the positions "
                "already place each query relative to its keys; use mask_type='causal' (key visible iff "
                "kv_segment_pos <= q_segment_pos)."
            )
        )
    window = _check_window(window_size)
    deterministic = _check_deterministic(deterministic)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    scale = static_float(OP, "scale", scale)
    dropout_rate = static_float(OP, "dropout_rate", dropout_rate)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(_err(f"dropout_rate must be in [0.0, 1.0), got {dropout_rate}."))
    if dropout_rate > 0.0 and rng is None:
        raise ValueError(
            _err(f"dropout_rate={dropout_rate} needs rng= (a JAX PRNG key, e.g. jax.random.key(0)); got rng=None.")
        )

    opt: dict[str, Any] = dict.fromkeys(OPTIONAL)
    if bias is not None:
        opt["bias"] = _check_bias(bias, q, k)
    if padding:
        opt["q_seqlens"] = (
            _check_ints("q_seqlens", q_seqlens, (b,), "[B]")
            if q_seqlens is not None
            else jnp.full((b,), s_q, jnp.int32)
        )
        opt["kv_seqlens"] = (
            _check_ints("kv_seqlens", kv_seqlens, (b,), "[B]")
            if kv_seqlens is not None
            else jnp.full((b,), s_k, jnp.int32)
        )
    if has_seg:
        opt["q_segment_ids"] = _check_ints("q_segment_ids", q_segment_ids, (b, s_q), "[B, Sq]")
        opt["kv_segment_ids"] = _check_ints("kv_segment_ids", kv_segment_ids, (b, s_k), "[B, Sk]")
    if has_pos:
        opt["q_segment_pos"] = _check_ints("q_segment_pos", q_segment_pos, (b, s_q), "[B, Sq]")
        opt["kv_segment_pos"] = _check_ints("kv_segment_pos", kv_segment_pos, (b, s_k), "[B, Sk]")
    if dropout_rate > 0.0:
        opt["seed"] = dropout_seeds(_check_rng(rng), b, hq)
    present = tuple(opt[n] is not None for n in OPTIONAL)
    optional = tuple(opt[n] for n in OPTIONAL if opt[n] is not None)
    op = _build(mask_type, window, scale, dropout_rate, implementation, present, deterministic)
    return op(*match_vma(q, k, v, optional))
