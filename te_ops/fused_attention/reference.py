"""Pure-JAX fused attention: the specification, the test oracle and the CPU path (fp32 maths).

Signatures shared by every fused_attention implementation::

    forward(q, k, v, bias, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, seed, q_segment_pos,
            kv_segment_pos, *, mask_type, window, scale, dropout_rate, need_stats=True) -> (out, Residuals)
    backward(res: Residuals, g, *, mask_type, window, scale, dropout_rate) -> (dq, dk, dv, dbias)

Shapes: ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hk, D]``, ``v [B, Sk, Hk, Dv]``, ``out [B, Sq, Hq, Dv]``;
``bias [B|1, Hq|1, Sq, Sk]`` (already broadcast to full Sq, Sk by the api); ``q_seqlens`` /
``kv_seqlens`` int32 ``[B]``; segment ids and segment positions int32 ``[B, Sq]`` / ``[B, Sk]``; ``seed`` uint32
``[B, Hq, 4]``: one dropout seed per (batch, query head),
derived from the JAX PRNG key by the api (None when dropout is off), so that a shard of the batch or
head axes holds the seeds of exactly its own rows. Query head ``h`` reads key/value
head ``h // (Hq // Hk)`` (GQA/MQA).

Mask rules (a key j is visible to query i of batch b when ALL that apply hold). Write
``qp = q_segment_pos[b, i]`` and ``kp = kv_segment_pos[b, j]`` when segment positions are given (they
come only with segment ids), else ``qp = i`` and ``kp = j``; and ``off`` for the diagonal offset: 0, or
with a ``*_bottom_right`` mask type ``Sk - Sq`` (``kv_seqlens[b] - q_seqlens[b]`` with padding):

* ``causal`` / ``padding_causal``: ``kp <= qp`` -- top-left aligned, as in
  ``jax.nn.dot_product_attention(is_causal=True)``: query 0 sees key 0 whatever Sq and Sk are.
* ``causal_bottom_right`` / ``padding_causal_bottom_right``: ``j <= i + off`` -- the last query sees
  the last (valid) key, as in TransformerEngine's bottom-right causal masks.
* ``padding`` / ``padding_causal[_bottom_right]``: ``i < q_seqlens[b]`` and ``j < kv_seqlens[b]``.
* segment ids: ``q_segment_ids[b, i] == kv_segment_ids[b, j]``.
* ``window = (left, right)``: ``qp + off - left <= kp <= qp + off + right``; -1 on a side means
  unbounded.

Scores and non-finite values, per query row i (of one batch element and head), with V_i its
visible keys and ``s_ij = scale * (q_i . k_j) + bias_ij`` in fp32 for j in V_i:

* V_i empty, or every ``s_ij`` -inf: output 0, gradient 0, logsumexp ``+inf`` (so that any
  backward that recomputes ``exp(s - lse)`` gets exactly 0 for the row);
* some ``s_ij`` NaN or +inf (a NaN in q_i, in a visible k_j or bias_ij, or an overflow): the whole
  output row is NaN and its logsumexp NaN, as ``jax.nn.dot_product_attention`` gives;
* otherwise ``p_ij = softmax_j(s_ij)`` over V_i (a -inf score gives ``p_ij = 0``) and
  ``out_i = sum_j p_ij v_j`` over the pairs with ``p_ij != 0``.

A pair (i, j) with ``p_ij == 0`` (masked, -inf score, or an underflow) takes no part in the
output or in any gradient, whatever ``q_i``, ``k_j``, ``v_j``, ``bias_ij`` or the cotangent hold:
no ``0 * inf`` or ``0 * NaN`` from it; a pair dropped by dropout takes no part in the output or in
``dv``. Every other product follows IEEE arithmetic: a NaN in ``v_j[e]`` makes ``out_i[e]`` NaN for
every i with ``p_ij != 0``, and a NaN output row gives NaN gradients along its visible pairs.

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
    q_segment_pos: jax.Array | None = None  # int32 [B, Sq] positions inside each packed segment
    kv_segment_pos: jax.Array | None = None  # int32 [B, Sk]


CAUSAL = ("causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right")
PADDING = ("padding", "padding_causal", "padding_causal_bottom_right")
BOTTOM_RIGHT = ("causal_bottom_right", "padding_causal_bottom_right")


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
    q_segment_pos=None,
    kv_segment_pos=None,
) -> jax.Array | None:
    """Bool ``[B|1, 1, Sq, Sk]``: True where key j is visible to query i (None: everything is)."""
    keep = None

    def both(a, c):
        return c if a is None else a & c

    if mask_type in CAUSAL or window is not None:
        # rel[b, i, j] = kp - qp - off (see the module docstring): causal keeps rel <= 0, the window
        # -left <= rel <= right.
        qp = jnp.arange(s_q)[None, :] if q_segment_pos is None else q_segment_pos  # [1|B, Sq]
        kp = jnp.arange(s_k)[None, :] if kv_segment_pos is None else kv_segment_pos  # [1|B, Sk]
        rel = kp[:, None, :] - qp[:, :, None]  # [1|B, Sq, Sk]
        if mask_type in BOTTOM_RIGHT:
            if mask_type in PADDING:
                rel = rel - (kv_seqlens - q_seqlens)[:, None, None]
            else:
                rel = rel - (s_k - s_q)
        if mask_type in CAUSAL:
            keep = both(keep, rel <= 0)
        if window is not None:
            left, right = window
            if left >= 0:
                keep = both(keep, rel >= -left)
            if right >= 0:
                keep = both(keep, rel <= right)
        if keep is not None:
            keep = keep[:, None]
    if mask_type in PADDING:
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


def _scores(q, k, bias, keep, scale):
    """fp32 masked scaled scores ``[B, Hq, Sq, Sk]`` (-inf where masked)."""
    kf = _expand_kv(k, q.shape[2]).astype(jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf) * jnp.float32(scale)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)  # masked: -inf whatever q, k, bias hold
    return s


def _probs(q, k, bias, keep, scale):
    """fp32 probabilities [B, Hq, Sq, Sk] and logsumexp [B, Hq, Sq] (see the module docstring)."""
    s = _scores(q, k, bias, keep, scale)
    # m is NaN for a row holding a NaN score and +inf for one holding +inf: exp() then gives NaN at
    # that position and the NaN sum makes the row NaN. A row with no finite score has m = -inf:
    # shifting by 0 instead gives exp(-inf) = 0 everywhere and a zero sum.
    m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)  # -inf also for Sk = 0 (no key at all)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    empty = total == 0
    p = e / jnp.where(empty, 1.0, total)
    if keep is not None:
        p = jnp.where(keep, p, 0.0)  # exactly 0, also in a NaN row
    lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, total)))[..., 0]
    return p, lse


def contract(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.einsum(eq, a, b)`` in fp32 where the products with ``a == 0`` count as 0 whatever ``b``
    holds (no ``0 * inf`` or ``0 * NaN``); every other product, and the sum, follow IEEE arithmetic.

    ``a`` is a probability-like matrix (exact zeros on masked / zero-probability pairs); ``b`` the
    operand it weights. With a finite ``b`` this is the plain einsum; otherwise the non-finite
    entries of ``b`` are taken out of the einsum and their contributions (NaN, +inf, -inf, or NaN
    where +inf meets -inf) are put back where a non-zero ``a`` reaches them.
    """

    def plain(a, b):
        return jnp.einsum(eq, a, b)

    def with_nonfinite(a, b):
        out = jnp.einsum(eq, a, jnp.where(jnp.isfinite(b), b, 0.0))  # a NaN still gives NaN here
        f32 = jnp.float32
        hit = lambda x, y: jnp.einsum(eq, x.astype(f32), y.astype(f32)) > 0  # noqa: E731
        pos, neg = a > 0, a < 0
        b_pinf, b_ninf = jnp.isposinf(b), jnp.isneginf(b)
        nan = hit(a != 0, jnp.isnan(b))  # a NaN a is != 0 too
        plus = hit(pos, b_pinf) | hit(neg, b_ninf)
        minus = hit(pos, b_ninf) | hit(neg, b_pinf)
        out = jnp.where(plus, jnp.inf, jnp.where(minus, -jnp.inf, out))
        return jnp.where(nan | (plus & minus) | jnp.isnan(out), jnp.nan, out)

    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jax.lax.cond(jnp.all(jnp.isfinite(b)), plain, with_nonfinite, a, b)


def _keep(q, k, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, q_segment_pos, kv_segment_pos, mask_type,
          window):  # fmt: skip
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
        q_segment_pos=q_segment_pos,
        kv_segment_pos=kv_segment_pos,
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
    q_segment_pos=None,
    kv_segment_pos=None,
    *,
    mask_type: str,
    window: tuple[int, int] | None,
    scale: float,
    dropout_rate: float,
    need_stats: bool = True,
):
    del need_stats  # False: the caller discards the statistics (inference); the reference computes them anyway
    keep = _keep(
        q, k, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, q_segment_pos, kv_segment_pos, mask_type, window
    )
    p, lse = _probs(q, k, bias, keep, scale)
    if dropout_rate > 0.0:
        drop = dropout_keep(seed, p.shape, dropout_rate)
        p = jnp.where(drop, p / jnp.float32(1.0 - dropout_rate), 0.0)
    vf = _expand_kv(v, q.shape[2])
    out = contract("bhqk,bkhd->bqhd", p, vf).astype(q.dtype)
    res = Residuals(
        q,
        k,
        v,
        bias,
        out,
        lse,
        q_seqlens,
        kv_seqlens,
        q_segment_ids,
        kv_segment_ids,
        seed,
        q_segment_pos,
        kv_segment_pos,
    )
    return out, res


def backward(
    res: Residuals, g, *, mask_type: str, window, scale: float, dropout_rate: float, deterministic: bool = False
):
    del deterministic  # XLA's ops here: deterministic under --xla_gpu_deterministic_ops, nothing to choose
    q, k, v, bias = res.q, res.k, res.v, res.bias
    b, s_q, hq, _ = q.shape
    hk = k.shape[2]
    keep = _keep(
        q,
        k,
        res.q_seqlens,
        res.kv_seqlens,
        res.q_segment_ids,
        res.kv_segment_ids,
        res.q_segment_pos,
        res.kv_segment_pos,
        mask_type,
        window,
    )
    # Recompute P from the saved statistics (as a flash backward does): p = exp(s - lse); lse = +inf
    # on rows without a finite visible score gives 0, lse = NaN on NaN rows gives NaN.
    s = _scores(q, k, bias, keep, scale)
    p = jnp.exp(s - res.lse[..., None])
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    kf = _expand_kv(k, hq).astype(jnp.float32)
    vf = _expand_kv(v, hq).astype(jnp.float32)
    gf = g.astype(jnp.float32)
    dpd = jnp.einsum("bqhd,bkhd->bhqk", gf, vf)  # d(dropped p)
    if dropout_rate > 0.0:
        drop = dropout_keep(res.seed, p.shape, dropout_rate)
        inv = jnp.float32(1.0 / (1.0 - dropout_rate))
        pd = jnp.where(drop, p * inv, 0.0)
        dp = jnp.where(drop, dpd * inv, 0.0)
    else:
        pd, dp = p, dpd
    dv_full = contract("bhqk,bqhd->bkhd", pd, gf)
    # softmax backward: ds = p * (dp - sum(p * dp)); sum(p * dp) = sum(dO * O) (with or without
    # dropout). Zero-probability pairs get ds = 0 whatever dp holds.
    delta = jnp.einsum("bqhd,bqhd->bhq", gf, res.out.astype(jnp.float32))[..., None]
    ds = jnp.where(p == 0, 0.0, p * (dp - delta))
    dq = contract("bhqk,bkhd->bqhd", ds, kf) * jnp.float32(scale)
    dk_full = contract("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32)) * jnp.float32(scale)
    group = hq // hk
    dk = dk_full.reshape(b, k.shape[1], hk, group, k.shape[3]).sum(3)
    dv = dv_full.reshape(b, v.shape[1], hk, group, v.shape[3]).sum(3)
    dbias = None
    if bias is not None:
        dbias = ds
        if bias.shape[0] == 1:
            dbias = dbias.sum(0, keepdims=True)
        if bias.shape[1] == 1:
            dbias = dbias.sum(1, keepdims=True)
        dbias = dbias.astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias
