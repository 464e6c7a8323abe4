"""fused_attention (``implementation="reference"``) against a numpy (float64) formulation of
docs/semantics.md ("Fused attention", with the softmax rules it refers to), forward and backward.

Compared: the output ``[B, Sq, Hq, Dv]`` and, through ``jax.vjp`` with a random cotangent, dq, dk, dv
and dbias, against the hand-written gradients (dP = dO V^T, dS = P * (dP - rowsum(dO * O)),
dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO, dbias = dS summed over its broadcast axes; dK and dV
summed over the query heads of a key/value group). Drawn: B 1..3; Sq, Sk with 1, odd, primes,
Sq != Sk (0 in a test of its own); MHA / GQA / MQA head counts; D and Dv (multiples of 8 up to 256, D != Dv);
float32 / bfloat16 / float16; every mask type and every allowed combination with packed segment ids
(contiguous packs with padding and length-1 segments, or arbitrary ids) and per-segment positions;
lengths of 0, short, full, past the end and missing; sliding windows with 0, 1, -1 and larger than S;
bias of every broadcast shape and rank, of q's dtype or float32, with -inf entries (whole rows
included); scale None (1 / sqrt(D)), 0, negative; NaN in masked-out q rows, keys, values and bias
entries (which must not matter). Rows with no visible key must be exactly 0 with exactly 0 gradients,
and so must dk, dv of keys no query of their group sees. Each compiled case runs on DRAWS draws of
its arrays. Zero-size axes and the head-dim rule have tests of their own.

Tolerance: the project's table for q's dtype (check_close), with atol relative to the magnitude of
the summed terms rather than of the result (both cancel), each row weighted by the float32 score
error that exp() turns into a relative error of P (np_attention says how). Dropout is left out (its
mask is the implementation's; tests/te_ops covers its statistics); the logsumexp is not returned.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import te_ops
from te_ops._core.testing import TOLERANCES
from tests.property._common import as64, check_close, fuzz, rand, seeds, size

IMPL = "reference"

PADDING_TYPES = ("padding", "padding_causal", "padding_causal_bottom_right")
BOTTOM_RIGHT_TYPES = ("causal_bottom_right", "padding_causal_bottom_right")

# (mask_type, packing) pairs the op accepts: segment ids not with padding mask types; segment
# positions (with segment ids) not with the bottom-right mask types.
MASKINGS = [(m, "none") for m in ("none", "causal", "padding", "padding_causal", "causal_bottom_right",
                                  "padding_causal_bottom_right")]  # fmt: skip
MASKINGS += [(m, "segments") for m in ("none", "causal", "causal_bottom_right")]
MASKINGS += [(m, "positions") for m in ("none", "causal")]

attention_dtypes = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])
head_dims = st.sampled_from([8, 16, 24, 40, 64, 128, 256])
windows = st.one_of(
    st.none(),
    st.sampled_from([(0, 0), (1, 1), (0, -1), (-1, 0), (1, 0), (-1, -1), (2, 5), (100, 100)]),
    st.tuples(st.integers(-1, 40), st.integers(-1, 40)),
)
# Bias: None, or which of [B, Hq, Sq, Sk] it keeps (False: broadcast, size 1), passed with its
# leading size-1 axes dropped when ``rank`` allows.
biases = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        dict(keep=st.tuples(*[st.booleans()] * 4), rank=st.integers(0, 4), f32=st.booleans(), neginf=st.booleans())
    ),
)
scales = st.sampled_from([None, 1.0, 0.125, 0.37, 2.0, -0.5, 0.0])
SEQ = size(40, sizes=(1, 2, 3, 5, 7, 13, 16, 17, 31, 37))  # 0: test_fused_attention_empty_axes

# The strategies of the test (run once per (mask_type, packing) of MASKINGS), importable
# (tests/gpu/test_property_gpu.py can draw from them too).
ATTENTION_ARGS = dict(
    b=st.integers(1, 3),
    sq=SEQ,
    sk=SEQ,
    hk=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 3, 4]),  # Hq = Hk * group: MHA, GQA, MQA (Hk = 1)
    d=head_dims,
    dv=head_dims,
    dtype=attention_dtypes,
    window=windows,
    lengths=st.sampled_from(["both", "q", "kv"]),  # padding mask types: the lengths given (missing: full)
    bias=biases,
    scale=scales,
    garbage=st.booleans(),
    seed=seeds,
)
# Data drawn per compiled case: each case runs its one compiled program on this many draws of the
# arrays (values, lengths, segment ids, positions, -inf and NaN placements), as compiling dominates.
DRAWS = 4


# ----------------------------------------------------------------------------------------------
# The formulation (docs/semantics.md, "Fused attention"), in float64
# ----------------------------------------------------------------------------------------------


def np_visible(b, sq, sk, mask_type, window, q_seqlens=None, kv_seqlens=None, q_seg=None, kv_seg=None, q_pos=None,
               kv_pos=None):  # fmt: skip
    """Bool [B, Sq, Sk]: key j visible to query i of batch entry b under every rule switched on."""
    i = np.arange(sq)[None, :, None]
    j = np.arange(sk)[None, None, :]
    qp = i if q_pos is None else np.asarray(q_pos, np.int64)[:, :, None]
    kp = j if kv_pos is None else np.asarray(kv_pos, np.int64)[:, None, :]
    padding = mask_type in PADDING_TYPES
    # "a missing length means the full length"
    lq = np.full((b,), sq) if q_seqlens is None else np.asarray(q_seqlens, np.int64)
    lk = np.full((b,), sk) if kv_seqlens is None else np.asarray(kv_seqlens, np.int64)
    if mask_type in BOTTOM_RIGHT_TYPES:
        off = (lk - lq)[:, None, None] if padding else sk - sq
    else:
        off = 0
    vis = np.ones((b, sq, sk), bool)
    if mask_type in ("causal", "padding_causal"):
        vis &= kp <= qp
    if mask_type in BOTTOM_RIGHT_TYPES:
        vis &= j <= i + off
    if padding:
        vis &= (i < lq[:, None, None]) & (j < lk[:, None, None])
    if q_seg is not None:
        vis &= np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :]
    if window is not None:
        left, right = window
        if left != -1:
            vis &= qp + off - left <= kp
        if right != -1:
            vis &= kp <= qp + off + right
    return vis


def np_attention(q, k, v, bias4, vis, scale, g, score_err=1.0):
    """Forward and backward in float64 from the (dtype-rounded, finite) inputs. ``bias4`` is None or
    [B|1, Hq|1, Sq|1, Sk|1]; ``vis`` [B, Sq, Sk]; ``g`` the cotangent of the output. Returns out, p,
    dq, dk, dv and ds (the gradient of the scores, for dbias), and the magnitudes of out, dq, dk, dv
    and ds that a rounding error scales with (see below; ``score_err``: the float32 atol over the
    compared dtype's)."""
    b, sq, hq, _ = q.shape
    hk = k.shape[2]
    kv_head = np.arange(hq) // (hq // hk)  # query head h reads key/value head h // (Hq / Hk)
    kk, vv = k[:, :, kv_head], v[:, :, kv_head]
    s = scale * np.einsum("bqhd,bkhd->bhqk", q, kk)
    if bias4 is not None:
        s = s + bias4
    live = vis[:, None] & (s != -np.inf)  # a -inf score acts like a hidden key
    z = np.where(live, s, -np.inf)
    m = np.max(z, axis=-1, keepdims=True, initial=-np.inf)
    e = np.where(live, np.exp(z - np.where(np.isfinite(m), m, 0.0)), 0.0)
    tot = e.sum(-1, keepdims=True)
    p = e / np.where(tot == 0, 1.0, tot)  # no live key: the row is 0
    out = np.einsum("bhqk,bkhd->bqhd", p, vv)

    dp = np.einsum("bqhd,bkhd->bhqk", g, vv)
    delta = np.einsum("bqhd,bqhd->bhq", g, out)[..., None]
    ds = p * (dp - delta)
    dq = scale * np.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk_full = scale * np.einsum("bhqk,bqhd->bkhd", ds, q)
    dv_full = np.einsum("bhqk,bqhd->bkhd", p, g)

    # Magnitudes. (1) Each result is compared relative to the sums of the absolute values of its
    # terms, not to the result: the output and dS = P * (dP - rowsum(dO * O)) cancel (dS exactly, with
    # one visible key). (2) The float32 scores carry an absolute error of about eps32 * |scale| *
    # sum_d |q_d k_d| (+ |bias|), which exp() turns into a relative error of P: rows are weighted by
    # amp = 1 + score_err * that sum (largest over the row's live keys); e.g. scale 1, D 128: ~80.
    s_abs = abs(scale) * np.einsum("bqhd,bkhd->bhqk", np.abs(q), np.abs(kk))
    if bias4 is not None:
        s_abs = s_abs + np.where(np.isfinite(bias4), np.abs(bias4), 0.0)
    amp = 1.0 + score_err * np.max(np.where(live, s_abs, 0.0), axis=-1, keepdims=True, initial=0.0)
    pa = p * amp
    out_mag = np.einsum("bhqk,bkhd->bqhd", pa, np.abs(vv))
    ds_mag = pa * (np.einsum("bqhd,bkhd->bhqk", np.abs(g), np.abs(vv)) + np.abs(delta))
    dq_mag = abs(scale) * np.einsum("bhqk,bkhd->bqhd", ds_mag, np.abs(kk))
    dk_mag_full = abs(scale) * np.einsum("bhqk,bqhd->bkhd", ds_mag, np.abs(q))
    dv_mag_full = np.einsum("bhqk,bqhd->bkhd", pa, np.abs(g))

    def per_kv_head(full, shape):  # sum over the query heads of each key/value group
        out = np.zeros(shape)
        for h in range(hq):
            out[:, :, kv_head[h]] += full[:, :, h]
        return out

    dk, dv = per_kv_head(dk_full, k.shape), per_kv_head(dv_full, v.shape)
    mags = (out_mag, dq_mag, per_kv_head(dk_mag_full, k.shape), per_kv_head(dv_mag_full, v.shape), ds_mag)
    return out, p, dq, dk, dv, ds, mags


# ----------------------------------------------------------------------------------------------
# Inputs of one drawn case
# ----------------------------------------------------------------------------------------------


def _pack(rng, b, sq, sk, positions):
    """Segment ids (and positions) [B, Sq] / [B, Sk]. Half the time contiguous packs: up to 4 segments
    (some of length 0 or 1 on either side), trailing padding with id 0 on the queries and 0 or -1 on
    the keys; kv positions count from 0 in each segment, query positions from a random start (packed
    cross-attention: a chunk of queries against its sequence). Else arbitrary small ids (and arbitrary
    positions)."""
    if rng.random() < 0.5:
        q_seg, kv_seg = rng.integers(0, 3, (b, sq)), rng.integers(0, 3, (b, sk))
        q_pos, kv_pos = rng.integers(0, max(sq, 1), (b, sq)), rng.integers(0, max(sk, 1), (b, sk))
        return (q_seg, kv_seg, q_pos, kv_pos) if positions else (q_seg, kv_seg, None, None)
    q_seg, kv_seg = np.zeros((b, sq), np.int64), np.zeros((b, sk), np.int64)
    q_pos, kv_pos = np.zeros((b, sq), np.int64), np.zeros((b, sk), np.int64)
    for bb in range(b):
        kv_seg[bb] = rng.choice([0, -1])
        n = int(rng.integers(1, 5))
        q_cuts = np.sort(rng.integers(0, sq + 1, n))
        kv_cuts = np.sort(rng.integers(0, sk + 1, n))
        q0 = k0 = 0
        for s in range(n):
            q1, k1 = int(q_cuts[s]), int(kv_cuts[s])
            nq, nk = q1 - q0, k1 - k0
            q_seg[bb, q0:q1] = s + 1
            kv_seg[bb, k0:k1] = s + 1
            kv_pos[bb, k0:k1] = np.arange(nk)
            q_pos[bb, q0:q1] = int(rng.integers(0, max(nk - nq, 0) + 3)) + np.arange(nq)
            q0, k0 = q1, k1
    if not positions:
        q_pos = kv_pos = None
    return q_seg, kv_seg, q_pos, kv_pos


def _lengths(rng, b, s):
    """[B] lengths: 0, 1, short, full or past the end."""
    return np.array([int(rng.choice([0, 1, rng.integers(0, s + 1), s, s, s + 2])) for _ in range(b)])


def attention_inputs(b, sq, sk, hk, group, d, dv, dtype, masking, window, lengths, bias, garbage, seed):
    """The arrays of one drawn case. Returns (args, arrays, arrays64, vis): args = (q, k, v, g, bias)
    as jnp arrays (bias None when not drawn), arrays the integer array arguments of fused_attention
    (lengths, segment ids, positions) by name, arrays64 the float64 values (q, k, v, g, bias4) the
    formulation uses (finite: any NaN put in masked positions is left out of them), vis [B, Sq, Sk].
    Another ``seed`` gives arrays of the same shapes and dtypes."""
    rng = np.random.default_rng(seed)
    hq = hk * group
    mask_type, packing = masking
    q, q64 = rand(rng, (b, sq, hq, d), dtype)
    k, k64 = rand(rng, (b, sk, hk, d), dtype)
    v, v64 = rand(rng, (b, sk, hk, dv), dtype)
    g, g64 = rand(rng, (b, sq, hq, dv), dtype)

    kw = {}
    ql = kl = q_seg = kv_seg = q_pos = kv_pos = None
    if mask_type in PADDING_TYPES:
        if lengths != "kv":
            ql = _lengths(rng, b, sq)
            kw["q_seqlens"] = jnp.asarray(ql, jnp.int32)
        if lengths != "q":
            kl = _lengths(rng, b, sk)
            kw["kv_seqlens"] = jnp.asarray(kl, jnp.int32)
    if packing != "none":
        q_seg, kv_seg, q_pos, kv_pos = _pack(rng, b, sq, sk, packing == "positions")
        kw.update(q_segment_ids=jnp.asarray(q_seg, jnp.int32), kv_segment_ids=jnp.asarray(kv_seg, jnp.int32))
        if packing == "positions":
            kw.update(q_segment_pos=jnp.asarray(q_pos, jnp.int32), kv_segment_pos=jnp.asarray(kv_pos, jnp.int32))
    vis = np_visible(b, sq, sk, mask_type, window, ql, kl, q_seg, kv_seg, q_pos, kv_pos)

    bias_in, bias4 = None, None
    if bias is not None:
        shape4 = tuple(n if keep else 1 for keep, n in zip(bias["keep"], (b, hq, sq, sk), strict=True))
        bdtype = jnp.float32 if bias["f32"] else dtype
        _, bias4 = rand(rng, shape4, bdtype)
        if bias["neginf"]:  # -inf entries act as hidden keys; with Sq kept, one query row entirely -inf
            bias4 = np.where(rng.random(shape4) < 0.3, -np.inf, bias4)
            if shape4[2] > 1:
                bias4[:, :, 0, :] = -np.inf
    if garbage:  # NaN wherever the mask hides everything the value reaches: must not matter
        dead_q = ~vis.any(2)  # [B, Sq]: queries that see no key
        dead_k = ~vis.any(1)  # [B, Sk]: keys no query sees
        q = jnp.where(jnp.asarray(dead_q & (rng.random(dead_q.shape) < 0.5))[:, :, None, None], jnp.nan, q)
        k = jnp.where(jnp.asarray(dead_k & (rng.random(dead_k.shape) < 0.5))[:, :, None, None], jnp.nan, k)
        v = jnp.where(jnp.asarray(dead_k & (rng.random(dead_k.shape) < 0.5))[:, :, None, None], jnp.nan, v)
    if bias is not None:
        b_in = bias4.copy()
        if garbage:  # NaN at bias entries all of whose (query, key) pairs are hidden by the mask
            hidden = np.broadcast_to(~vis[:, None], (b, hq, sq, sk))
            axes = tuple(a for a in range(4) if bias4.shape[a] == 1)
            dead = np.all(hidden, axis=axes, keepdims=True) if axes else hidden
            b_in = np.where(dead & (rng.random(bias4.shape) < 0.5), np.nan, b_in)
        rank = bias["rank"]
        lead = next((a for a in range(4) if bias4.shape[a] != 1), 4)
        rank = max(rank, 4 - lead)  # only leading size-1 axes can be dropped
        bias_in = jnp.asarray(b_in.reshape(bias4.shape[4 - rank :]).astype(np.float32)).astype(bdtype)
    return (q, k, v, g, bias_in), kw, (q64, k64, v64, g64, bias4), vis


@pytest.mark.parametrize("masking", MASKINGS, ids=lambda m: "+".join(m))
@fuzz(3)
@given(**ATTENTION_ARGS)
def test_fused_attention(masking, b, sq, sk, hk, group, d, dv, dtype, window, lengths, bias, scale, garbage, seed):
    def run(q, k, v, g, bias_in, arrays):
        fn = lambda q, k, v, bias_in: te_ops.fused_attention(q, k, v, bias=bias_in, mask_type=masking[0],  # noqa: E731
                                                             window_size=window, scale=scale, implementation=IMPL,
                                                             **arrays)  # fmt: skip
        out, vjp = jax.vjp(fn, q, k, v, bias_in)
        return out, vjp(g)

    run = jax.jit(run)
    for draw in range(DRAWS):
        args, arrays, args64, vis = attention_inputs(b, sq, sk, hk, group, d, dv, dtype, masking, window, lengths,
                                                     bias, garbage, seed + draw)  # fmt: skip
        check_case(run(*args, arrays), args, args64, vis, scale, f"(draw {draw}) {arrays}")


def check_case(results, args, args64, vis, scale, what):
    """The op's output and gradients (``results``) against the formulation."""
    out, (dq, dk, dv_, dbias) = results
    q, k, v, _, bias_in = args
    q64, k64, v64, g64, bias4 = args64
    b, sq, hq, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hk
    dtype = q.dtype
    sc = 1.0 / np.sqrt(d) if scale is None else scale  # the default scale uses D (q/k), not Dv
    score_err = TOLERANCES[jnp.dtype(jnp.float32)][1] / TOLERANCES[jnp.dtype(dtype)][1]  # scores are float32
    want_out, p, want_dq, want_dk, want_dv, ds, mags = np_attention(q64, k64, v64, bias4, vis, sc, g64, score_err)
    tag = f"(B={b} Sq={sq} Sk={sk} Hq={hq} Hk={hk} D={d} Dv={dv} {what})"
    assert out.dtype == jnp.dtype(dtype) and out.shape == (b, sq, hq, dv), tag
    check_close(out, want_out, dtype, what=f"out {tag}", scale=max(1.0, float(mags[0].max(initial=0))))
    empty_rows = ~p.any(-1).transpose(0, 2, 1)  # [B, Sq, Hq]: no key with a finite visible score
    assert np.all(as64(out)[empty_rows] == 0), f"out rows without a visible key must be exactly 0 {tag}"

    # Gradients: atol relative to the largest magnitude of the summed terms (see np_attention) rather
    # than of the result, which can cancel to 0 (dk with one visible key per query).
    for name, a, x, e, mag in zip(("dq", "dk", "dv"), (dq, dk, dv_), (q, k, v), (want_dq, want_dk, want_dv), mags[1:4],
                                  strict=True):  # fmt: skip
        assert a.dtype == x.dtype and a.shape == x.shape, (name, tag)
        check_close(a, e, dtype, what=f"{name} {tag}", scale=max(1.0, float(mag.max(initial=0))))
    assert np.all(as64(dq)[empty_rows] == 0), f"dq of rows without a visible key must be exactly 0 {tag}"
    unseen_kv = np.zeros(k.shape[:3], bool)
    for kh in range(hk):  # keys of a kv head with probability 0 for every query of its group
        unseen_kv[:, :, kh] = ~p[:, kh * group : (kh + 1) * group].any((1, 2))
    assert np.all(as64(dk)[unseen_kv] == 0) and np.all(as64(dv_)[unseen_kv] == 0), f"dk/dv of unseen keys {tag}"

    if bias_in is None:
        assert dbias is None
        return
    axes = tuple(a for a in range(4) if bias4.shape[a] == 1)
    want_db = ds.sum(axes, keepdims=True).reshape(bias_in.shape)
    assert dbias.dtype == bias_in.dtype and dbias.shape == bias_in.shape, tag
    db_mag = mags[4].sum(axes, keepdims=True)
    check_close(dbias, want_db, dtype, what=f"dbias {tag}", scale=max(1.0, float(db_mag.max(initial=0))))


# ----------------------------------------------------------------------------------------------
# Zero-size axes (docs/semantics.md, "Zero-size inputs": allowed, following the formulas)
# ----------------------------------------------------------------------------------------------

EMPTY_ATTENTION_ARGS = dict(
    shape=st.sampled_from([(0, 3, 5, 2, 1), (2, 0, 5, 2, 1), (2, 3, 0, 2, 1), (1, 3, 5, 0, 1), (0, 0, 0, 2, 2)]),
    masking=st.sampled_from(MASKINGS),
    window=st.sampled_from([None, (1, 0)]),
    has_bias=st.booleans(),
    dtype=attention_dtypes,
)


@fuzz(10)
@given(**EMPTY_ATTENTION_ARGS)
def test_fused_attention_empty_axes(shape, masking, window, has_bias, dtype):
    """B, Sq, Sk or Hq of 0: results of the documented shapes, 0 where not empty (Sk = 0: no query
    sees a key), with zero gradients of the documented shapes."""
    b, sq, sk, hq, hk = shape
    (q, k, v, g, bias_in), arrays, _, _ = attention_inputs(
        b, sq, sk, hk, hq // hk, 8, 16, dtype, masking, window, "both",
        dict(keep=(True, True, True, True), rank=4, f32=False, neginf=False) if has_bias else None, False, 0,
    )  # fmt: skip

    def fn(q, k, v, bias_in):
        return te_ops.fused_attention(q, k, v, bias=bias_in, mask_type=masking[0], window_size=window,
                                      implementation=IMPL, **arrays)  # fmt: skip

    out, vjp = jax.vjp(fn, q, k, v, bias_in)
    assert out.shape == (b, sq, hq, 16) and out.dtype == jnp.dtype(dtype)
    assert np.all(as64(out) == 0)
    grads = vjp(g)
    for x, gx in zip((q, k, v, bias_in), grads, strict=True):
        if x is None:
            assert gx is None
            continue
        assert gx.shape == x.shape and gx.dtype == x.dtype
        assert np.all(as64(gx) == 0)


# ----------------------------------------------------------------------------------------------
# Head dims: multiples of 8 up to 256 (MAX_HEAD_DIM) are accepted, others refused at trace time
# ----------------------------------------------------------------------------------------------


@fuzz(10)
@given(d=st.one_of(st.sampled_from([0, 1, 7, 8, 9, 12, 248, 256, 257, 264]), st.integers(0, 300)), on_v=st.booleans())
def test_fused_attention_head_dim_rule(d, on_v):
    q = jax.ShapeDtypeStruct((1, 2, 2, 8 if on_v else d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 3, 1, 8 if on_v else d), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 3, 1, d), jnp.bfloat16)
    fn = lambda q, k, v: te_ops.fused_attention(q, k, v, implementation=IMPL)  # noqa: E731
    if d > 0 and d % 8 == 0 and d <= 256:
        assert jax.eval_shape(fn, q, k, v).shape == (1, 2, 2, d)
    else:
        with pytest.raises(ValueError, match="must be a multiple of 8 and at most 256"):
            jax.eval_shape(fn, q, k, v)
