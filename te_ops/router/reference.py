"""Pure-JAX MoE router: the specification, the test oracle and the CPU path (fp32 maths).

Follows docs/semantics.md ("Router") exactly, edge cases included (see the public docstrings in
:mod:`te_ops.router.api`). Three op families share this module; their
signatures (every implementation has the same ones, and the same residual layouts)::

    topk_forward(logits, expert_bias, *, <TopkStatics>) -> ((probs, routing_map), TopkResiduals)
    topk_backward(res: TopkResiduals, g_probs, *, <TopkStatics>) -> d_logits

    scores_forward(logits, *, topk, score_function, compact_routing_map)
        -> ((routing_map, scores), ScoresResiduals)
    scores_backward(res: ScoresResiduals, g_scores, *, topk, score_function, compact_routing_map) -> d_logits

    loss_forward(probs, tokens_per_expert) -> (partial, LossResiduals)
        partial = sum_e (sum_t probs[t, e]) * tokens_per_expert[e] over the LOCAL tokens (fp32 scalar);
        the op scales it by E * coeff / (topk * T_global^2) after summing partials over token shards.
    loss_backward(res: LossResiduals, g_scaled, *, shape, dtype) -> d_probs[shape]
        d_probs[t, e] = g_scaled * tokens_per_expert[e], g_scaled = E * coeff / (topk * T^2) * g.

``TopkStatics`` = topk, score_function ("softmax" | "sigmoid"), use_pre_softmax, num_groups,
group_topk (None or ints; grouping is on when group_topk is set), scaling_factor,
compact_routing_map. ``expert_bias`` is None or float32 [E] (sigmoid only).

Routing maps are bool [T, E], or with ``compact_routing_map`` uint8 [T, ceil(E/8)] with expert e in
bit e % 8 of byte e // 8 (see :func:`pack_routing_map`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

SIGMOID_EPS = 1e-20


class TopkResiduals(NamedTuple):
    logits: jax.Array  # [T, E] the forward input (scores are recomputed from it: no extra memory)
    routing_map: jax.Array  # the forward's routing map, bool [T, E] or compact uint8 [T, ceil(E/8)]


class ScoresResiduals(NamedTuple):
    logits: jax.Array  # [T, E] the forward input


class LossResiduals(NamedTuple):
    tokens_per_expert: jax.Array  # float32 [E]


# ----------------------------------------------------------------------------------------------
# Compact routing maps
# ----------------------------------------------------------------------------------------------


def pack_routing_map(routing_map: jax.Array) -> jax.Array:
    """bool [..., E] -> uint8 [..., ceil(E/8)], expert e in bit e % 8 of byte e // 8 (unchecked;
    the public, validating version is :func:`te_ops.router.api.pack_routing_map`)."""
    e = routing_map.shape[-1]
    nb = (e + 7) // 8
    pad = nb * 8 - e
    m = routing_map.astype(jnp.uint8)
    if pad:
        m = jnp.pad(m, [(0, 0)] * (m.ndim - 1) + [(0, pad)])
    m = m.reshape(*m.shape[:-1], nb, 8)
    weights = (jnp.uint8(1) << jnp.arange(8, dtype=jnp.uint8)).astype(jnp.uint8)
    return jnp.sum(m * weights, axis=-1, dtype=jnp.uint8)


def unpack_routing_map(packed: jax.Array, num_experts: int) -> jax.Array:
    """uint8 [..., ceil(E/8)] -> bool [..., E] (inverse of :func:`pack_routing_map`)."""
    bits = (packed[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)) & jnp.uint8(1)
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8)[..., :num_experts].astype(jnp.bool_)


def _finish_map(chosen: jax.Array, compact: bool) -> jax.Array:
    return pack_routing_map(chosen) if compact else chosen


def _chosen(routing_map: jax.Array, num_experts: int, compact: bool) -> jax.Array:
    return unpack_routing_map(routing_map, num_experts) if compact else routing_map.astype(jnp.bool_)


# ----------------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------------


def scores(x: jax.Array, score_function: str, use_pre_softmax: bool) -> jax.Array:
    """Step 1 (docs/semantics.md, "Router"): fp32 scores from fp32 logits."""
    if score_function == "softmax":
        return jax.nn.softmax(x, axis=-1) if use_pre_softmax else x
    return jax.nn.sigmoid(x)


def ordered_key(v: jax.Array) -> jax.Array:
    """float32 -> int32, monotone in the IEEE total order (-NaN < -inf < ... < -0 < +0 < ... < inf
    < +NaN): the order ``lax.top_k`` uses on CPU and the native kernels' selection keys use."""
    b = jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.int32)
    return jnp.where(b < 0, b ^ jnp.int32(0x7FFFFFFF), b)


def select(sel: jax.Array, topk: int, num_groups: int | None, group_topk: int | None) -> tuple[jax.Array, jax.Array]:
    """Steps 3-4: (indices [T, K] in selection order, chosen bool [T, E]).

    Ties: larger value first, then the smaller index (``lax.top_k`` keeps the lower index first).
    Always exactly ``topk`` distinct experts per row, NaN rows included (where NaN ranks is
    unspecified by the op; here it is the IEEE total order of ``lax.top_k``).
    """
    t, e = sel.shape
    if group_topk is not None:
        per_group = topk // group_topk
        grouped = sel.reshape(t, num_groups, e // num_groups)
        group_scores = jnp.sum(jax.lax.top_k(grouped, per_group)[0], axis=-1)  # [T, G]
        _, gidx = jax.lax.top_k(group_scores, group_topk)
        gmask = jnp.any(gidx[..., None] == jnp.arange(num_groups), axis=-2)  # [T, G]
        emask = jnp.repeat(gmask, e // num_groups, axis=-1)
        # Experts of dropped groups rank strictly below every allowed expert whatever its score
        # (-inf, and -NaN, which ranks below -inf), as with the native kernels' key 0: masking with
        # -inf could let a dropped group's expert win over an allowed -NaN or tie with an allowed -inf.
        lowest = jnp.iinfo(jnp.int32).min
        key = jnp.where(emask, jnp.maximum(ordered_key(sel), lowest + 1), lowest)
        _, idx = jax.lax.top_k(key, topk)
    else:
        _, idx = jax.lax.top_k(sel, topk)
    chosen = jnp.any(idx[..., None] == jnp.arange(e), axis=-2)
    return idx, chosen


# ----------------------------------------------------------------------------------------------
# fused_topk_with_score_function
# ----------------------------------------------------------------------------------------------


def topk_forward(
    logits: jax.Array,
    expert_bias: jax.Array | None = None,
    *,
    topk: int,
    score_function: str,
    use_pre_softmax: bool,
    num_groups: int | None,
    group_topk: int | None,
    scaling_factor: float,
    compact_routing_map: bool,
):
    x = logits.astype(jnp.float32)
    s = scores(x, score_function, use_pre_softmax)
    sel = s if expert_bias is None else s + expert_bias.astype(jnp.float32)
    idx, chosen = select(sel, topk, num_groups, group_topk)
    if score_function == "softmax" and not use_pre_softmax:
        w = jax.nn.softmax(jnp.take_along_axis(x, idx, axis=-1), axis=-1)
    else:
        w = jnp.take_along_axis(s, idx, axis=-1)
        if score_function == "sigmoid" and topk > 1:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + SIGMOID_EPS)
    # A NaN anywhere in the row poisons every chosen weight, whichever experts were chosen (the
    # order of NaN among the scores is unspecified, so the result must not depend on it).
    w = jnp.where(jnp.any(jnp.isnan(x), axis=-1, keepdims=True), jnp.nan, w)
    probs = jnp.put_along_axis(jnp.zeros_like(x), idx, jnp.float32(scaling_factor) * w, axis=-1, inplace=False)
    rmap = _finish_map(chosen, compact_routing_map)
    return (probs.astype(logits.dtype), rmap), TopkResiduals(logits, rmap)


def topk_backward(
    res: TopkResiduals,
    g: jax.Array,
    *,
    topk: int,
    score_function: str,
    use_pre_softmax: bool,
    num_groups: int | None,
    group_topk: int | None,
    scaling_factor: float,
    compact_routing_map: bool,
) -> jax.Array:
    del num_groups, group_topk  # selection gets no gradient
    x = res.logits.astype(jnp.float32)
    chosen = _chosen(res.routing_map, x.shape[-1], compact_routing_map)
    gs = jnp.float32(scaling_factor) * g.astype(jnp.float32)
    if score_function == "softmax" and not use_pre_softmax:
        mx = jnp.max(jnp.where(chosen, x, -jnp.inf), axis=-1, keepdims=True)
        ex = jnp.where(chosen, jnp.exp(x - mx), 0.0)
        w = ex / jnp.sum(ex, axis=-1, keepdims=True)
        dx = w * (gs - jnp.sum(w * gs, axis=-1, keepdims=True))
    elif score_function == "softmax":
        s = jax.nn.softmax(x, axis=-1)
        ds = jnp.where(chosen, gs, 0.0)
        dx = s * (ds - jnp.sum(s * ds, axis=-1, keepdims=True))
    else:
        sig = jax.nn.sigmoid(x)
        if topk > 1:
            d = jnp.sum(jnp.where(chosen, sig, 0.0), axis=-1, keepdims=True) + SIGMOID_EPS
            dot = jnp.sum(jnp.where(chosen, gs * sig, 0.0), axis=-1, keepdims=True)
            gsig = gs / d - dot / (d * d)
        else:
            gsig = gs
        dx = jnp.where(chosen, gsig * sig * (1.0 - sig), 0.0)
    return dx.astype(res.logits.dtype)


# ----------------------------------------------------------------------------------------------
# compute_routing_scores_for_aux_loss
# ----------------------------------------------------------------------------------------------


def aux_scores(x: jax.Array, score_function: str) -> jax.Array:
    """Dense fp32 aux-loss scores: softmax, or sigmoid normalised over E."""
    if score_function == "softmax":
        return jax.nn.softmax(x, axis=-1)
    sig = jax.nn.sigmoid(x)
    return sig / (jnp.sum(sig, axis=-1, keepdims=True) + SIGMOID_EPS)


def scores_forward(logits: jax.Array, *, topk: int, score_function: str, compact_routing_map: bool):
    s = aux_scores(logits.astype(jnp.float32), score_function)
    _, chosen = select(s, topk, None, None)
    return (_finish_map(chosen, compact_routing_map), s.astype(logits.dtype)), ScoresResiduals(logits)


def scores_backward(
    res: ScoresResiduals, g: jax.Array, *, topk: int, score_function: str, compact_routing_map: bool
) -> jax.Array:
    del topk, compact_routing_map
    x = res.logits.astype(jnp.float32)
    g = g.astype(jnp.float32)
    if score_function == "softmax":
        s = jax.nn.softmax(x, axis=-1)
        dx = s * (g - jnp.sum(s * g, axis=-1, keepdims=True))
    else:
        sig = jax.nn.sigmoid(x)
        d = jnp.sum(sig, axis=-1, keepdims=True) + SIGMOID_EPS
        dsig = g / d - jnp.sum(g * sig, axis=-1, keepdims=True) / (d * d)
        dx = dsig * sig * (1.0 - sig)
    return dx.astype(res.logits.dtype)


# ----------------------------------------------------------------------------------------------
# fused_moe_aux_loss (the per-shard part; the op does the cross-shard sum and the scaling)
# ----------------------------------------------------------------------------------------------


def loss_forward(probs: jax.Array, tokens_per_expert: jax.Array):
    tpe = tokens_per_expert.astype(jnp.float32)
    per_expert = jnp.sum(probs.astype(jnp.float32), axis=0)  # sum over (local) tokens
    return jnp.sum(per_expert * tpe), LossResiduals(tpe)


def loss_backward(res: LossResiduals, g_scaled: jax.Array, *, shape: tuple[int, int], dtype) -> jax.Array:
    d = g_scaled.astype(jnp.float32) * res.tokens_per_expert
    return jnp.broadcast_to(d, shape).astype(dtype)
