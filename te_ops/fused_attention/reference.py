"""Pure-JAX fused attention: the specification, the test oracle and the CPU path (fp32 maths).

Signatures shared by every fused_attention implementation::

    forward(q, k, v, bias, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, seed, *, mask_type,
            window, scale, dropout_rate, need_stats=True) -> (out, Residuals)
    backward(res: Residuals, g, *, mask_type, window, scale, dropout_rate) -> (dq, dk, dv, dbias)

Shapes: ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hk, D]``, ``v [B, Sk, Hk, Dv]``, ``out [B, Sq, Hq, Dv]``;
``bias [B|1, Hq|1, Sq, Sk]`` (already broadcast to full Sq, Sk by the api); ``q_seqlens`` /
``kv_seqlens`` int32 ``[B]``; segment ids int32 ``[B, Sq]`` / ``[B, Sk]``; ``seed`` uint32
``[B, Hq, 4]``: one dropout seed per (batch, query head),
derived from the JAX PRNG key by the api (None when dropout is off), so that a shard of the batch or
head axes holds the seeds of exactly its own rows. Query head ``h`` reads key/value
head ``h // (Hq // Hk)`` (GQA/MQA).

Mask rules (a key j is visible to query i of batch b when ALL that apply hold):

* ``causal`` / ``padding_causal``: ``j <= i`` -- top-left aligned, as in
  ``jax.nn.dot_product_attention(is_causal=True)``: query 0 sees key 0 whatever Sq and Sk are.
* ``padding`` / ``padding_causal``: ``i < q_seqlens[b]`` and ``j < kv_seqlens[b]``.
* segment ids: ``q_segment_ids[b, i] == kv_segment_ids[b, j]``.
* ``window = (left, right)``: ``i - left <= j <= i + right``; -1 on a side means unbounded.

A query with no visible key gets output 0, gradient 0 and logsumexp ``+inf`` (so that any backward that
recomputes ``exp(s - lse)`` from the residuals gets exactly 0 for it).

Dropout (rate p > 0): after the softmax, each probability is kept with probability 1 - p and scaled by
1 / (1 - p); the statistics (logsumexp) are those before dropout. The mask is a function of ``seed`` only,
so the same key gives the same result. The reference draws the mask of (b, h) from ``seed[b, h]`` alone,
so it is the same sharded and unsharded. cuDNN draws one Philox stream per call from the first seed of
its shard: same key, same result for a given sharding, equally distributed otherwise. Different
implementations draw different masks, so a dropout forward must pair with the backward of the same
implementation.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Residuals(NamedTuple):
    q: jax.Array
    k: jax.Array
    v: jax.Array
    bias: jax.Array | None
    out: jax.Array  # forward output, q's dtype
    lse: jax.Array  # [B, Hq, Sq] float32 logsumexp of the masked scaled scores (+inf for empty rows)
    q_seqlens: jax.Array | None
    kv_seqlens: jax.Array | None
    q_segment_ids: jax.Array | None
    kv_segment_ids: jax.Array | None
    seed: jax.Array | None  # uint32[B, Hq, 4] dropout seeds, None without dropout


def visible(
    b: int,
    s_q: int,
    s_k: int,
    *,
    mask_type: str,
    window: tuple[int, int] | None,
    q_seqlens=None,
    kv_seqlens=None,
    q_segment_ids=None,
    kv_segment_ids=None,
) -> jax.Array | None:
    """Bool ``[B|1, 1, Sq, Sk]``: True where key j is visible to query i (None: everything is)."""
    i = jnp.arange(s_q)[:, None]
    j = jnp.arange(s_k)[None, :]
    keep = None

    def both(a, c):
        return c if a is None else a & c

    if mask_type in ("causal", "padding_causal"):
        keep = both(keep, (j <= i)[None, None])
    if window is not None:
        left, right = window
        w = jnp.ones((s_q, s_k), bool)
        if left >= 0:
            w = w & (j >= i - left)
        if right >= 0:
            w = w & (j <= i + right)
        keep = both(keep, w[None, None])
    if mask_type in ("padding", "padding_causal"):
        qv = jnp.arange(s_q)[None, :] < q_seqlens[:, None]  # [B, Sq]
        kv = jnp.arange(s_k)[None, :] < kv_seqlens[:, None]  # [B, Sk]
        keep = both(keep, (qv[:, :, None] & kv[:, None, :])[:, None])
    if q_segment_ids is not None:
        seg = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
        keep = both(keep, seg[:, None])
    del b
    return keep


def dropout_keep(seed: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
    """Bool keep-mask ``[B, Hq, Sq, Sk]``; the slice (b, h) is a function of ``seed[b, h]`` only."""
    s_q, s_k = shape[-2:]

    def one(sd):
        key = jax.random.wrap_key_data(sd[:2], impl="threefry2x32")
        return jax.random.bernoulli(key, 1.0 - rate, (s_q, s_k))

    return jax.vmap(jax.vmap(one))(seed)


def _expand_kv(x: jax.Array, hq: int) -> jax.Array:
    """[B, Sk, Hk, D] -> [B, Sk, Hq, D] (query head h reads kv head h // (Hq // Hk))."""
    return jnp.repeat(x, hq // x.shape[2], axis=2)


def _probs(q, k, bias, keep, scale):
    """fp32 scores [B, Hq, Sq, Sk] -> (p, lse, row_has_key)."""
    hq = q.shape[2]
    kf = _expand_kv(k, hq).astype(jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf) * jnp.float32(scale)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    has = jnp.isfinite(m)
    m = jnp.where(has, m, 0.0)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = jnp.where(has, e / jnp.where(has, total, 1.0), 0.0)
    lse = jnp.where(has, m + jnp.log(jnp.where(has, total, 1.0)), jnp.inf)[..., 0]
    return p, lse, has


def _keep(q, k, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, mask_type, window):
    return visible(
        q.shape[0],
        q.shape[1],
        k.shape[1],
        mask_type=mask_type,
        window=window,
        q_seqlens=q_seqlens,
        kv_seqlens=kv_seqlens,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )


def forward(
    q,
    k,
    v,
    bias=None,
    q_seqlens=None,
    kv_seqlens=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    seed=None,
    *,
    mask_type: str,
    window: tuple[int, int] | None,
    scale: float,
    dropout_rate: float,
    need_stats: bool = True,
):
    del (
        need_stats
    )  # False: the caller discards the statistics (inference); the reference computes them anyway
    keep = _keep(q, k, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, mask_type, window)
    p, lse, _ = _probs(q, k, bias, keep, scale)
    if dropout_rate > 0.0:
        drop = dropout_keep(seed, p.shape, dropout_rate)
        p = jnp.where(drop, p / jnp.float32(1.0 - dropout_rate), 0.0)
    vf = _expand_kv(v, q.shape[2]).astype(jnp.float32)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, vf).astype(q.dtype)
    res = Residuals(q, k, v, bias, out, lse, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, seed)
    return out, res


def backward(res: Residuals, g, *, mask_type: str, window, scale: float, dropout_rate: float):
    q, k, v, bias = res.q, res.k, res.v, res.bias
    b, s_q, hq, _ = q.shape
    hk = k.shape[2]
    keep = _keep(
        q, k, res.q_seqlens, res.kv_seqlens, res.q_segment_ids, res.kv_segment_ids, mask_type, window
    )
    # Recompute P from the saved statistics (as a flash backward does): p = exp(s - lse).
    kf = _expand_kv(k, hq).astype(jnp.float32)
    vf = _expand_kv(v, hq).astype(jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf) * jnp.float32(scale)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    p = jnp.exp(s - res.lse[..., None])  # lse = +inf on empty rows -> 0
    p = jnp.where(jnp.isnan(p), 0.0, p)
    gf = g.astype(jnp.float32)
    dpd = jnp.einsum("bqhd,bkhd->bhqk", gf, vf)  # d(dropped p)
    if dropout_rate > 0.0:
        drop = dropout_keep(res.seed, p.shape, dropout_rate)
        inv = jnp.float32(1.0 / (1.0 - dropout_rate))
        pd = jnp.where(drop, p * inv, 0.0)
        dp = jnp.where(drop, dpd * inv, 0.0)
    else:
        pd, dp = p, dpd
    dv_full = jnp.einsum("bhqk,bqhd->bkhd", pd, gf)
    # softmax backward: ds = p * (dp - sum(p * dp)); sum(p * dp) = sum(dO * O) (with or without dropout).
    delta = jnp.einsum("bqhd,bqhd->bhq", gf, res.out.astype(jnp.float32))[..., None]
    ds = p * (dp - delta)
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kf) * jnp.float32(scale)
    dk_full = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32)) * jnp.float32(scale)
    group = hq // hk
    dk = dk_full.reshape(b, k.shape[1], hk, group, -1).sum(3)
    dv = dv_full.reshape(b, v.shape[1], hk, group, -1).sum(3)
    dbias = None
    if bias is not None:
        dbias = ds
        if bias.shape[0] == 1:
            dbias = dbias.sum(0, keepdims=True)
        if bias.shape[1] == 1:
            dbias = dbias.sum(1, keepdims=True)
        dbias = dbias.astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias
