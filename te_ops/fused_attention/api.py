"""Public fused_attention op: validation, custom VJP, sharding, vmap and implementation dispatch."""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_ops._core import partitioning as P
from te_ops._core import registry
from te_ops._core.partitioning import match_vma
from te_ops.fused_attention import native, reference
from te_ops.fused_attention.reference import Residuals

OP = "fused_attention"
FAMILY = registry.family(OP)
FAMILY.register(
    registry.Implementation(
        name="native",
        forward=native.forward,
        backward=native.backward,
        unsupported_reason=native.unsupported_reason,
        platform="cuda",
        # Default on CUDA since tests/gpu/test_fused_attention_gpu.py passed 28/29 on the H200
        # (2026-12-03); the one failure was trace-time glue (fixed, CPU-tested).
        available=registry.native_available(native.MODULE, "fused_attention"),
    )
)
FAMILY.register(
    registry.Implementation(name=registry.REFERENCE, forward=reference.forward, backward=reference.backward)
)

MASK_TYPES = ("none", "causal", "padding", "padding_causal")
MAX_HEAD_DIM = 256
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Optional array operands, in the order every internal function takes them.
OPTIONAL = ("bias", "q_seqlens", "kv_seqlens", "q_segment_ids", "kv_segment_ids", "seed")


def dropout_seeds(rng: jax.Array, b: int, hq: int) -> jax.Array:
    """uint32 [B, Hq, 4]: one seed per (batch, query head), a function of the key only."""
    bits = jax.random.bits(rng, (b, hq, 4), jnp.uint32)
    # bytes 8..15 are cuDNN's int64 Philox offset: keep it a small non-negative number.
    return bits.at[..., 3].set(0).at[..., 2].set(bits[..., 2] >> 8)


def _err(msg: str) -> str:
    return f"te_ops.{OP}: {msg}"


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _as_array(name: str, x: Any) -> jax.Array:
    if x is None:
        raise TypeError(_err(f"{name} is required, got None."))
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else jnp.asarray(x)


def _check_qkv(q, k, v):
    q, k, v = _as_array("q", q), _as_array("k", k), _as_array("v", v)
    for name, x, layout in (
        ("q", q, "[B, Sq, Hq, D]"),
        ("k", k, "[B, Sk, Hk, D]"),
        ("v", v, "[B, Sk, Hk, Dv]"),
    ):
        if x.ndim != 4:
            raise ValueError(_err(f"{name} must have rank 4 {layout}, got shape {tuple(x.shape)}."))
        if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
            raise TypeError(
                _err(
                    f"{name} must be bfloat16, float16 or float32, got dtype {jnp.dtype(x.dtype)}. "
                    "Cast it first."
                )
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            _err(
                f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}. "
                "Cast them to one dtype."
            )
        )
    b, _, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(
            _err(
                f"batch sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                "(axis 0 must match)."
            )
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            _err(
                f"k [B, Sk, Hk, D] and v [B, Sk, Hk, Dv] must agree on B, Sk, Hk; got {tuple(k.shape)} and "
                f"{tuple(v.shape)}."
            )
        )
    if k.shape[3] != d:
        raise ValueError(
            _err(f"q and k must have the same head dim D, got q {tuple(q.shape)} and k {tuple(k.shape)}.")
        )
    hk = k.shape[2]
    if hk == 0 or hq % hk != 0:
        raise ValueError(
            _err(
                f"the number of query heads Hq={hq} must be a multiple of the number of key/value heads "
                f"Hk={hk} "
                "(GQA/MQA); repeat k/v heads or change the head counts."
            )
        )
    for name, dim in (("D (q/k head dim)", d), ("Dv (v head dim)", v.shape[3])):
        if dim <= 0 or dim > MAX_HEAD_DIM or dim % 8 != 0:
            raise ValueError(
                _err(
                    f"head dim {name} must be a multiple of 8 and at most {MAX_HEAD_DIM}, got {dim}. "
                    "Pad the head "
                    "dimension with zeros to a multiple of 8 (and scale= to keep the softmax scale)."
                )
            )
    return q, k, v


def _check_bias(bias, q, k):
    bias = _as_array("bias", bias)
    if jnp.dtype(bias.dtype) not in _FLOAT_DTYPES:
        raise TypeError(
            _err(f"bias must be a float array, got dtype {bias.dtype}. Cast it, e.g. to q.dtype.")
        )
    if bias.ndim > 4:
        raise ValueError(
            _err(f"bias must have rank <= 4 [B|1, Hq|1, Sq|1, Sk|1], got shape {tuple(bias.shape)}.")
        )
    bias = bias.reshape((1,) * (4 - bias.ndim) + tuple(bias.shape))
    full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    if any(b not in (1, f) for b, f in zip(bias.shape, full, strict=True)):
        raise ValueError(
            _err(
                f"bias of shape {tuple(bias.shape)} does not broadcast as [B|1, Hq|1, Sq|1, Sk|1] to {full}."
            )
        )
    # Materialise broadcast query/key axes (outside the custom_vjp, so autodiff sums dbias back).
    return jnp.broadcast_to(bias, bias.shape[:2] + full[2:])


def _check_lengths(name, x, b):
    x = _as_array(name, x)
    if x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(
            _err(f"{name} must be an integer array of shape [B]=({b},), got {x.dtype}{tuple(x.shape)}.")
        )
    return x.astype(jnp.int32)


def _check_segments(name, x, b, s, axis_name):
    x = _as_array(name, x)
    if x.shape != (b, s) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(
            _err(
                f"{name} must be an integer array of shape [B, {axis_name}]=({b}, {s}), got "
                f"{x.dtype}{tuple(x.shape)}."
            )
        )
    return x.astype(jnp.int32)


def _static_float(name, x, lo, hi, hi_open=True):
    if isinstance(x, (jax.Array, jax.core.Tracer)) or isinstance(x, bool):
        raise TypeError(_err(f"{name} must be a static Python float, got {type(x).__name__}."))
    if not isinstance(x, (numbers.Real, np.floating, np.integer)):
        raise TypeError(_err(f"{name} must be a static Python float, got {x!r}."))
    x = float(x)
    if not np.isfinite(x) or x < lo or (x >= hi if hi_open else x > hi):
        raise ValueError(_err(f"{name} must be in [{lo}, {hi}{')' if hi_open else ']'}, got {x}."))
    return x


def _check_window(window):
    if window is None:
        return None
    if isinstance(window, (numbers.Integral, np.integer)) and not isinstance(window, bool):
        window = (int(window), int(window))
    ok = (
        isinstance(window, (tuple, list))
        and len(window) == 2
        and all(
            isinstance(w, (numbers.Integral, np.integer)) and not isinstance(w, bool) and int(w) >= -1
            for w in window
        )
    )
    if not ok:
        raise ValueError(
            _err(
                f"window_size must be None or (left, right) with ints >= -1 (-1 = unbounded), got {window!r}."
            )
        )
    return (int(window[0]), int(window[1]))


# ----------------------------------------------------------------------------------------------
# Sharding: batch and head axes may be sharded (heads as the kv-head factor, so GQA groups stay
# together); sequence and head-dim axes are replicated. A bias broadcast over batch (or heads) keeps
# that axis replicated, so its gradient needs no cross-shard reduction: zero collectives.
# ----------------------------------------------------------------------------------------------


def _factor_strings(shapes, present, stage):
    q_shape, k_shape = shapes[0], shapes[1]
    group = q_shape[2] // k_shape[2]
    qh = "(h g)" if group > 1 else "h"
    bq = "b"
    extra = {"g": group} if group > 1 else {}
    ops = [f"{bq} sq {qh} d", "b sk h d", "b sk h e"]
    if stage == "bwd":
        ops += [f"b sq {qh} e", f"b sq {qh} e", f"b {qh} sq"]  # out, g, lse
    n0 = len(ops)
    names = [n for n, p in zip(OPTIONAL, present, strict=True) if p]
    replicated = ["sq", "sk", "d", "e"]
    for i, name in enumerate(names):
        shape = shapes[n0 + i]
        if name == "bias":
            bb = "b" if shape[0] == q_shape[0] and shape[0] != 1 else "bb"
            bh = qh if shape[1] == q_shape[2] and shape[1] != 1 else "bh"
            ops.append(f"{bb} {bh} sq sk")
            replicated += [f for f in (bb, bh) if f in ("bb", "bh")]
        elif name in ("q_seqlens", "kv_seqlens"):
            ops.append("b")
        elif name == "q_segment_ids":
            ops.append("b sq")
        elif name == "kv_segment_ids":
            ops.append("b sk")
        elif name == "seed":
            ops.append(f"b {qh} r")
            replicated.append("r")
    if stage == "fwd":
        results = [f"b sq {qh} e", f"b {qh} sq"]
    elif stage == "infer":
        results = [f"b sq {qh} e"]
    else:
        results = [f"b sq {qh} d", "b sk h d", "b sk h e"]
        if "bias" in names:
            results.append(ops[n0 + names.index("bias")])
    return ops, results, replicated, extra, names


def _bias_blocks(shapes, names, n0, q_shape):
    """(replicate batch, replicate heads) because a bias broadcasts over them."""
    if "bias" not in names:
        return False, False
    bshape = shapes[n0 + names.index("bias")]
    return bshape[0] == 1 and q_shape[0] != 1, bshape[1] == 1 and q_shape[2] != 1


def _rule(present, stage):
    def rule(*shapes):
        ops, results, replicated, extra, _ = _factor_strings(shapes, present, stage)
        rule_str = f"{', '.join(ops)} -> {', '.join(results)}"
        # Shardy wants special factors in the order of their indices (first appearance in the rule).
        order = []
        for f in _split(rule_str.replace(",", " ").replace("->", " ").replace("(", " ").replace(")", " ")):
            if f not in order:
                order.append(f)
        need = tuple(f for f in order if f in set(replicated))
        return rule_str, {"need_replication_factors": need, **extra}

    return rule


def _specs(present, stage):
    def specs(arg_specs, shapes):
        ops, results, _, _, names = _factor_strings(shapes, present, stage)
        q_shape = shapes[0]
        q_spec = arg_specs[0]
        rep_b, rep_h = _bias_blocks(shapes, names, 6 if stage == "bwd" else 3, q_shape)
        b_ax = None if rep_b else q_spec[0]
        h_ax = None if rep_h else q_spec[2]
        table = {"b": b_ax, "h": h_ax, "(h g)": h_ax}

        def spec_of(factors):
            return [table.get(f) for f in _split(factors)]

        out_specs = [spec_of(r) for r in results]
        return [spec_of(o) for o in ops], (out_specs[0] if stage == "infer" else out_specs)

    return specs


def _split(factors: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in factors:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == " " and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [f for f in out if f]


# ----------------------------------------------------------------------------------------------
# vmap: fold the vmapped axis into the batch axis (axis 0 of every operand, the dropout seeds too).
# ----------------------------------------------------------------------------------------------


def _fold(present, stage):
    n_lead = 6 if stage == "bwd" else 3
    names = [n for n, p in zip(OPTIONAL, present, strict=True) if p]
    kinds = ["x"] * n_lead + names
    bias_idx = n_lead + names.index("bias") if "bias" in names else None

    def fold(axis_size, in_batched, *args):
        vb = axis_size
        batch = args[0].shape[1] if in_batched[0] else args[0].shape[0]
        folded = []
        for kind, a, batched in zip(kinds, args, in_batched, strict=True):
            if kind == "bias" and not batched and a.shape[0] == 1:
                folded.append(a)  # broadcast over the folded batch as it was over the batch
                continue
            if not batched:
                a = jnp.broadcast_to(a, (vb, *a.shape))
            if kind == "bias" and a.shape[1] == 1 and batch != 1:
                a = jnp.broadcast_to(a, (vb, batch, *a.shape[2:]))
            folded.append(a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]))
        outs = fold.fn(*folded)
        single = stage == "infer"
        if single:
            outs = (outs,)
        result, out_batched = [], []
        for i, o in enumerate(outs):
            if stage == "bwd" and i == 3:  # dbias
                bias, b_batched = args[bias_idx], in_batched[bias_idx]
                if not b_batched and bias.shape[0] == 1:
                    result.append(o)
                    out_batched.append(False)
                    continue
                o = o.reshape(vb, o.shape[0] // vb, *o.shape[1:])
                if not b_batched:
                    result.append(o.sum(0))
                    out_batched.append(False)
                    continue
                if bias.shape[1] == 1:
                    o = o.sum(1, keepdims=True)
                result.append(o)
                out_batched.append(True)
                continue
            result.append(o.reshape(vb, o.shape[0] // vb, *o.shape[1:]))
            out_batched.append(True)
        if single:
            return result[0], out_batched[0]
        return tuple(result), tuple(out_batched)

    return fold


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
        **statics,
    )


def _unpack(present, arrays):
    it = iter(arrays)
    return {n: (next(it) if p else None) for n, p in zip(OPTIONAL, present, strict=True)}


@functools.cache
def _build(mask_type, window, scale, dropout_rate, implementation, present):
    statics = dict(mask_type=mask_type, window=window, scale=scale, dropout_rate=dropout_rate)

    def fwd_impl(q, k, v, *optional):
        opt = _unpack(present, optional)
        args = (q, k, v, *(opt[n] for n in OPTIONAL))
        out, res = FAMILY.dispatch(
            implementation, "forward", args, statics, _call_desc(q, k, v, opt, statics)
        )
        return out, res.lse

    def infer_impl(q, k, v, *optional):  # primal outside autodiff: no statistics (cuDNN inference graph)
        opt = _unpack(present, optional)
        args = (q, k, v, *(opt[n] for n in OPTIONAL))
        out, _ = FAMILY.dispatch(
            implementation,
            "forward",
            args,
            {**statics, "need_stats": False},
            _call_desc(q, k, v, opt, statics),
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
        )
        dq, dk, dv, dbias = FAMILY.dispatch(
            implementation, "backward", (res, g), statics, _call_desc(q, k, v, opt, statics)
        )
        return (dq, dk, dv) + ((dbias,) if opt["bias"] is not None else ())

    fwd_part = P.partitioned(fwd_impl, rule=_rule(present, "fwd"), specs=_specs(present, "fwd"))
    bwd_part = P.partitioned(bwd_impl, rule=_rule(present, "bwd"), specs=_specs(present, "bwd"))
    infer_part = P.partitioned(infer_impl, rule=_rule(present, "infer"), specs=_specs(present, "infer"))
    fold_f, fold_b, fold_i = _fold(present, "fwd"), _fold(present, "bwd"), _fold(present, "infer")
    fold_f.fn, fold_b.fn, fold_i.fn = fwd_part, bwd_part, infer_part
    fwd_call = P.batch_folding(fwd_part, fold_f)
    bwd_call = P.batch_folding(bwd_part, fold_b)
    infer_call = P.batch_folding(infer_part, fold_i)

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
    window_size: tuple[int, int] | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    rng: jax.Array | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """Scaled dot-product attention, fused: ``softmax(scale * q k^T + bias, masked) v``.

    The native (cuDNN) path keeps only the output and the softmax logsumexp ``[B, Hq, Sq]`` for the
    backward: memory does not grow with ``Sq * Sk`` (except for a ``bias``, which is ``Sq * Sk`` by
    itself, and packed sequences, which cuDNN receives as a ``[B, 1, Sq, Sk]`` additive mask).

    Equivalent to (no dropout; ``visible`` is the mask described below)::

        kk = jnp.repeat(k, Hq // Hk, axis=2); vv = jnp.repeat(v, Hq // Hk, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk).astype(jnp.float32) * scale + bias
        s = jnp.where(visible, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)                  # rows with no visible key -> 0
        out = jnp.einsum("bhqk,bkhd->bqhd", p, vv).astype(q.dtype)

    Masks (combined with AND):

    * ``mask_type="causal"``: key j visible to query i iff ``j <= i`` (top-left aligned, like
      ``jax.nn.dot_product_attention(is_causal=True)``).
    * ``mask_type="padding"``: iff ``i < q_seqlens[b]`` and ``j < kv_seqlens[b]``;
      ``"padding_causal"``: both. Queries beyond ``q_seqlens`` get output 0.
    * ``q_segment_ids`` / ``kv_segment_ids`` (packed sequences): iff the ids are equal.
    * ``window_size=(left, right)``: iff ``i - left <= j <= i + right`` (-1: unbounded side).

    Args:
      q: ``[B, Sq, Hq, D]`` bfloat16/float16 (float32 on the reference path only).
      k: ``[B, Sk, Hk, D]`` with ``Hq % Hk == 0`` (GQA/MQA).
      v: ``[B, Sk, Hk, Dv]``. ``D`` and ``Dv`` are multiples of 8, at most 256.
      bias: additive, broadcastable as ``[B|1, Hq|1, Sq|1, Sk|1]``; differentiable.
      mask_type: "none", "causal", "padding" or "padding_causal".
      q_seqlens, kv_seqlens: int ``[B]`` valid lengths (padding mask types only; a missing one means
        full length).
      q_segment_ids, kv_segment_ids: int ``[B, Sq]`` / ``[B, Sk]`` (together; not with padding).
      window_size: None or ``(left, right)``.
      scale: static float; default ``1 / sqrt(D)``.
      dropout_rate: static float in [0, 1); needs ``rng``.
      rng: JAX PRNG key (typed or raw uint32[2]); same key, same result.
      implementation: None (best available), "native" or "reference".

    Returns:
      ``[B, Sq, Hq, Dv]`` in q's dtype.
    """
    q, k, v = _check_qkv(q, k, v)
    b, s_q, hq, d = q.shape
    s_k = k.shape[1]
    if mask_type not in MASK_TYPES:
        raise ValueError(_err(f"mask_type must be one of {MASK_TYPES}, got {mask_type!r}."))
    padding = mask_type in ("padding", "padding_causal")
    has_len = q_seqlens is not None or kv_seqlens is not None
    if has_len and not padding:
        raise ValueError(
            _err(
                f"q_seqlens/kv_seqlens are given but mask_type={mask_type!r} ignores them; use "
                f"mask_type={'padding_causal' if mask_type == 'causal' else 'padding'!r}."
            )
        )
    if padding and not has_len:
        raise ValueError(
            _err(f"mask_type={mask_type!r} needs q_seqlens and/or kv_seqlens (int [B]); got neither.")
        )
    has_seg = q_segment_ids is not None or kv_segment_ids is not None
    if has_seg and (q_segment_ids is None or kv_segment_ids is None):
        raise ValueError(
            _err(
                "q_segment_ids and kv_segment_ids must be given together (pass the same ids twice for "
                "self-attention)."
            )
        )
    if has_seg and padding:
        raise ValueError(
            _err(
                f"segment ids cannot be combined with mask_type={mask_type!r}: express padding as its own "
                "segment id (e.g. 0 for padding tokens) and use mask_type='none' or 'causal'."
            )
        )
    window = _check_window(window_size)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    scale = _static_float("scale", scale, -np.inf, np.inf)
    dropout_rate = _static_float("dropout_rate", dropout_rate, 0.0, 1.0)
    if dropout_rate > 0.0 and rng is None:
        raise ValueError(
            _err(
                f"dropout_rate={dropout_rate} needs rng= (a JAX PRNG key, e.g. jax.random.key(0)); "
                "got rng=None."
            )
        )

    opt: dict[str, Any] = dict.fromkeys(OPTIONAL)
    if bias is not None:
        opt["bias"] = _check_bias(bias, q, k)
    if padding:
        opt["q_seqlens"] = (
            _check_lengths("q_seqlens", q_seqlens, b)
            if q_seqlens is not None
            else jnp.full((b,), s_q, jnp.int32)
        )
        opt["kv_seqlens"] = (
            _check_lengths("kv_seqlens", kv_seqlens, b)
            if kv_seqlens is not None
            else jnp.full((b,), s_k, jnp.int32)
        )
    if has_seg:
        opt["q_segment_ids"] = _check_segments("q_segment_ids", q_segment_ids, b, s_q, "Sq")
        opt["kv_segment_ids"] = _check_segments("kv_segment_ids", kv_segment_ids, b, s_k, "Sk")
    if dropout_rate > 0.0:
        opt["seed"] = dropout_seeds(rng, b, hq)
    present = tuple(opt[n] is not None for n in OPTIONAL)
    optional = tuple(opt[n] for n in OPTIONAL if opt[n] is not None)
    return _build(mask_type, window, scale, dropout_rate, implementation, present)(*match_vma(q, k, v, optional))
