"""CPU tests of fused_attention's position-aware masks: per-segment positions (q_segment_pos /
kv_segment_pos) in packed (cross-)attention and the bottom-right-aligned causal mask types, against
an independent float64 numpy oracle (visibility written pair by pair from the documented rules);
gradients against a direct jnp formulation; errors; vmap; sharding; the native glue (mask folding,
cuDNN bottom-right band) against the emulated cuDNN handlers of test_fused_attention.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from te_ops._core.testing import assert_close, cpu_mesh, run_sharded
from te_ops.fused_attention import fused_attention
from te_ops.fused_attention import reference as ref
from tests.te_ops.test_fused_attention import _emulated_ffi_call

F32 = jnp.float32


def _qkv(seed, b, sq, sk, hq=4, hk=2, d=16):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, sq, hq, d), F32)
    k = jax.random.normal(ks[1], (b, sk, hk, d), F32)
    v = jax.random.normal(ks[2], (b, sk, hk, d), F32)
    g = jax.random.normal(ks[3], (b, sq, hq, d), F32)
    return q, k, v, g


# ----------------------------------------------------------------------------------------------
# The oracle: the rules of docs/semantics.md ("Fused attention"), one (query, key) pair at a time.
# ----------------------------------------------------------------------------------------------


def _np_visible(b, sq, sk, *, mask_type="none", window=None, ql=None, kl=None, qseg=None, kseg=None, qpos=None,
                kpos=None):  # fmt: skip
    padding = mask_type.startswith("padding")
    causal = "causal" in mask_type
    vis = np.zeros((b, 1, sq, sk), bool)
    for bb in range(b):
        lq = int(ql[bb]) if padding else sq
        lk = int(kl[bb]) if padding else sk
        off = lk - lq if mask_type.endswith("bottom_right") else 0  # where query i's diagonal meets the keys
        for i in range(sq):
            for j in range(sk):
                qp = i if qpos is None else int(qpos[bb, i])
                kp = j if kpos is None else int(kpos[bb, j])
                ok = True
                if causal:
                    ok &= kp <= qp + off
                if window is not None:
                    left, right = window
                    ok &= left < 0 or kp >= qp + off - left
                    ok &= right < 0 or kp <= qp + off + right
                if padding:
                    ok &= i < lq and j < lk
                if qseg is not None:
                    ok &= int(qseg[bb, i]) == int(kseg[bb, j])
                vis[bb, 0, i, j] = ok
    return vis


def _np_attention(q, k, v, vis, scale):
    """float64 softmax attention over the visible keys; rows without a visible key are 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, rep, 2), np.repeat(v, rep, 2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(vis, np.exp(s - m), 0.0)
    tot = e.sum(-1, keepdims=True)
    p = e / np.where(tot == 0, 1.0, tot)
    return np.einsum("bhqk,bkhd->bqhd", p, vv)


def _direct(q, k, v, mask, scale):
    """Differentiable jnp attention with a fixed boolean mask (for the gradients); empty rows -> 0."""
    rep = q.shape[2] // k.shape[2]
    kk, vv = jnp.repeat(k, rep, 2), jnp.repeat(v, rep, 2)
    s = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, kk) * scale, -1e30)
    p = jax.nn.softmax(s, -1) * mask
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vv)


def _grads(fn, q, k, v, g):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * g), argnums=(0, 1, 2)))(q, k, v)


def _check(kw, q, k, v, g, vis, msg):
    scale = 1 / np.sqrt(q.shape[3])

    def ours(q, k, v):
        return fused_attention(q, k, v, implementation="reference", **kw)

    assert vis.any() and not vis.all(), f"{msg}: the case must mask something"
    out = jax.jit(ours)(q, k, v)
    np.testing.assert_allclose(np.asarray(out, np.float64), _np_attention(q, k, v, vis, scale), rtol=2e-5,
                               atol=2e-5, err_msg=msg)  # fmt: skip
    mask = jnp.asarray(vis)
    for got, want in zip(_grads(ours, q, k, v, g), _grads(lambda *a: _direct(*a, mask, scale), q, k, v, g),
                         strict=True):  # fmt: skip
        assert_close(got, want, F32, scale=4.0, err_msg=msg)


# ----------------------------------------------------------------------------------------------
# Packed (cross-)attention with per-segment positions
# ----------------------------------------------------------------------------------------------


def _packed():
    """Two batch rows of packed cross-attention: q [2, 12] and kv [2, 16] segments with their own
    positions. Row 0: each query segment is the last tokens of its kv segment (chunked prefill: query
    positions continue the kv positions). Row 1: query positions restart at 0; kv id 0 is padding
    that no query sees."""
    qseg = np.array([[1] * 4 + [2] * 5 + [3] * 3, [5] * 7 + [6] * 5])
    kseg = np.array([[1] * 6 + [2] * 5 + [3] * 5, [5] * 8 + [6] * 6 + [0] * 2])

    def restart(seg):
        pos = np.zeros_like(seg)
        for bb in range(seg.shape[0]):
            for t in range(1, seg.shape[1]):
                pos[bb, t] = pos[bb, t - 1] + 1 if seg[bb, t] == seg[bb, t - 1] else 0
        return pos

    qpos, kpos = restart(qseg), restart(kseg)
    for sid in (1, 2, 3):  # row 0: shift each query segment to the end of its kv segment
        nq, nk = (qseg[0] == sid).sum(), (kseg[0] == sid).sum()
        qpos[0, qseg[0] == sid] += nk - nq
    return [jnp.asarray(x, jnp.int32) for x in (qseg, kseg, qpos, kpos)]


POS_CASES = {
    "causal": dict(mask_type="causal"),
    "causal_window": dict(mask_type="causal", window=(2, 0)),
    "window_both_sides": dict(window=(2, 1)),
    "window_left_unbounded": dict(window=(-1, 1)),
    "window_right_only": dict(window=(3, -1)),
}


@pytest.mark.parametrize("case", sorted(POS_CASES))
def test_packed_cross_attention_positions_match_oracle(case):
    c = POS_CASES[case]
    qseg, kseg, qpos, kpos = _packed()
    q, k, v, g = _qkv(1, 2, 12, 16)
    mask_type, window = c.get("mask_type", "none"), c.get("window")
    vis = _np_visible(2, 12, 16, mask_type=mask_type, window=window, qseg=np.asarray(qseg), kseg=np.asarray(kseg),
                      qpos=np.asarray(qpos), kpos=np.asarray(kpos))  # fmt: skip
    kw = dict(mask_type=mask_type, window_size=window, q_segment_ids=qseg, kv_segment_ids=kseg, q_segment_pos=qpos,
              kv_segment_pos=kpos)  # fmt: skip
    _check(kw, q, k, v, g, vis, case)
    # the positions matter here: the index-based mask differs
    by_index = _np_visible(2, 12, 16, mask_type=mask_type, window=window, qseg=np.asarray(qseg),
                           kseg=np.asarray(kseg))  # fmt: skip
    assert (by_index != vis).any(), case


def test_positions_equal_to_indices_change_nothing():
    q, k, v, _ = _qkv(2, 2, 12, 12)
    seg = jnp.array([[1] * 5 + [2] * 7, [3] * 12], jnp.int32)
    idx = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    kw = dict(mask_type="causal", window_size=(3, 0), q_segment_ids=seg, kv_segment_ids=seg)
    plain = jax.jit(lambda q, k, v: fused_attention(q, k, v, **kw))(q, k, v)
    pos = jax.jit(lambda q, k, v: fused_attention(q, k, v, q_segment_pos=idx, kv_segment_pos=idx, **kw))(q, k, v)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(pos))


def test_positions_without_causal_or_window_only_segments_count():
    qseg, kseg, qpos, kpos = _packed()
    q, k, v, _ = _qkv(3, 2, 12, 16)
    kw = dict(q_segment_ids=qseg, kv_segment_ids=kseg)
    a = fused_attention(q, k, v, **kw)
    b = fused_attention(q, k, v, q_segment_pos=qpos, kv_segment_pos=kpos, **kw)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------------------------
# Bottom-right causal masks
# ----------------------------------------------------------------------------------------------

BR_CASES = {
    "sq_lt_sk": dict(sq=8, sk=20),
    "sq_gt_sk": dict(sq=20, sk=8),
    "sq_lt_sk_window": dict(sq=8, sk=20, window=(3, -1)),
    "sq_lt_sk_window_right_ignored": dict(sq=8, sk=20, window=(4, 2)),
    "padding": dict(sq=12, sk=16, lens=([12, 5], [9, 16])),
    "padding_sq_gt_sk": dict(sq=16, sk=8, lens=([16, 3], [8, 8])),
    "padding_window": dict(sq=12, sk=16, lens=([12, 5], [9, 16]), window=(2, -1)),
    "segments": dict(sq=8, sk=12, segments=True),
}


@pytest.mark.parametrize("case", sorted(BR_CASES))
def test_bottom_right_causal_matches_oracle(case):
    c = BR_CASES[case]
    sq, sk, window = c["sq"], c["sk"], c.get("window")
    q, k, v, g = _qkv(4, 2, sq, sk)
    kw = dict(mask_type="causal_bottom_right", window_size=window)
    vis_kw = dict(mask_type="causal_bottom_right", window=window)
    if "lens" in c:
        ql, kl = (jnp.array(x, jnp.int32) for x in c["lens"])
        kw.update(mask_type="padding_causal_bottom_right", q_seqlens=ql, kv_seqlens=kl)
        vis_kw.update(mask_type="padding_causal_bottom_right", ql=np.asarray(ql), kl=np.asarray(kl))
    if c.get("segments"):
        qseg = jnp.array([[1] * 3 + [2] * 5, [4] * 8], jnp.int32)
        kseg = jnp.array([[1] * 7 + [2] * 5, [4] * 6 + [9] * 6], jnp.int32)
        kw.update(q_segment_ids=qseg, kv_segment_ids=kseg)
        vis_kw.update(qseg=np.asarray(qseg), kseg=np.asarray(kseg))
    vis = _np_visible(2, sq, sk, **vis_kw)
    _check(kw, q, k, v, g, vis, case)
    if sq > sk and "lens" not in c:  # the first Sq - Sk queries see no key: exact zeros
        out = fused_attention(q, k, v, **kw)
        assert np.all(np.asarray(out[:, : sq - sk]) == 0)


def test_bottom_right_matches_xla_on_prepended_queries():
    """Bottom-right with Sq < Sk is top-left causal for the last Sq of Sk queries (checked with XLA)."""
    q, k, v, g = _qkv(5, 2, 6, 14, hq=4, hk=4)

    def xla(q, k, v):
        full = jnp.concatenate([jnp.zeros((2, 8, 4, 16), F32), q], axis=1)
        return jax.nn.dot_product_attention(full, k, v, is_causal=True, implementation="xla")[:, 8:]

    def ours(q, k, v):
        return fused_attention(q, k, v, mask_type="causal_bottom_right")

    assert_close(jax.jit(ours)(q, k, v), jax.jit(xla)(q, k, v), F32)
    for got, want in zip(_grads(ours, q, k, v, g), _grads(xla, q, k, v, g), strict=True):
        assert_close(got, want, F32, scale=4.0)


def test_bottom_right_equals_top_left_when_lengths_match():
    q, k, v, _ = _qkv(6, 2, 10, 10)
    ql = kl = jnp.array([10, 6], jnp.int32)
    for tl, br, extra in (
        ("causal", "causal_bottom_right", {}),
        ("padding_causal", "padding_causal_bottom_right", dict(q_seqlens=ql, kv_seqlens=kl)),
    ):
        a = fused_attention(q, k, v, mask_type=tl, window_size=(3, 0), **extra)
        b = fused_attention(q, k, v, mask_type=br, window_size=(3, 0), **extra)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

_SEG = jnp.zeros((2, 8), jnp.int32)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(q_segment_pos=_SEG, kv_segment_pos=_SEG), r"need q_segment_ids and kv_segment_ids"),
        (dict(q_segment_ids=_SEG, kv_segment_ids=_SEG, q_segment_pos=_SEG), r"must be given together"),
        (dict(q_segment_ids=_SEG, kv_segment_ids=_SEG, q_segment_pos=_SEG, kv_segment_pos=_SEG[:, :5]),
         r"kv_segment_pos must have shape \[B, Sk\]=\(2, 8\), got \(2, 5\)"),
        (dict(q_segment_ids=_SEG, kv_segment_ids=_SEG, q_segment_pos=_SEG.astype(F32), kv_segment_pos=_SEG),
         r"q_segment_pos must be an integer array"),
        (dict(q_segment_ids=_SEG, kv_segment_ids=_SEG, q_segment_pos=_SEG, kv_segment_pos=_SEG,
              mask_type="causal_bottom_right"), r"cannot be combined with q_segment_pos"),
        (dict(mask_type="causal_bottom_right", kv_seqlens=jnp.array([4, 4])),
         r"mask_type='padding_causal_bottom_right'"),
        (dict(mask_type="padding_causal_bottom_right"), r"needs q_seqlens and/or kv_seqlens"),
        (dict(mask_type="bottom_right"), r"mask_type must be one of .*causal_bottom_right"),
    ],
)  # fmt: skip
def test_errors(kwargs, match):
    q = jnp.zeros((2, 8, 4, 16))
    with pytest.raises((ValueError, TypeError), match=match):
        fused_attention(q, q, q, **kwargs)


# ----------------------------------------------------------------------------------------------
# vmap and sharding
# ----------------------------------------------------------------------------------------------


def test_vmap_over_positions_matches_loop():
    qseg, kseg, qpos, kpos = _packed()
    q, k, v, _ = _qkv(7, 2, 12, 16)
    shifts = jnp.array([0, 1, 3], jnp.int32)
    qp = qpos[None] + shifts[:, None, None]  # [3, B, Sq]: the same packing at other query positions

    def f(qp_):
        return fused_attention(q, k, v, mask_type="causal", window_size=(4, 0), q_segment_ids=qseg,
                               kv_segment_ids=kseg, q_segment_pos=qp_, kv_segment_pos=kpos)  # fmt: skip

    out = jax.jit(jax.vmap(f))(qp)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(jax.jit(f)(qp[i])), rtol=1e-6, atol=1e-6)


def test_sharded_positions_match_unsharded_without_collectives():
    mesh = cpu_mesh((2, 4), ("data", "model"))
    qseg, kseg, qpos, kpos = (jnp.concatenate([x, x]) for x in _packed())  # batch 4
    q, k, v, g = _qkv(8, 4, 12, 16, hq=8, hk=4)

    def fn(q, k, v, g, qseg, kseg, qpos, kpos):
        def f(q, k, v):
            return fused_attention(q, k, v, mask_type="causal", window_size=(3, 0), q_segment_ids=qseg,
                                   kv_segment_ids=kseg, q_segment_pos=qpos, kv_segment_pos=kpos)  # fmt: skip

        return f(q, k, v), jax.grad(lambda *a: jnp.sum(f(*a) * g), argnums=(0, 1, 2))(q, k, v)

    spec = PS("data", None, "model", None)
    sharded, unsharded, counts = run_sharded(
        fn, [q, k, v, g, qseg, kseg, qpos, kpos], [spec] * 4 + [PS("data")] * 4, mesh=mesh
    )
    assert sum(counts.values()) == 0, counts
    for a, e in zip(jax.tree.leaves(sharded), jax.tree.leaves(unsharded), strict=True):
        assert_close(a, e, F32, scale=2.0)


# ----------------------------------------------------------------------------------------------
# Native glue against the emulated cuDNN handlers
# ----------------------------------------------------------------------------------------------

GLUE_CASES = {
    "br_sq_lt_sk": dict(mask_type="causal_bottom_right", sk=24),
    "br_window": dict(mask_type="causal_bottom_right", sk=24, window=(3, -1)),
    "br_padding_sq_gt_sk": dict(mask_type="padding_causal_bottom_right", sk=8, lens=([16, 5], [3, 8])),
    "br_bias_folded": dict(mask_type="causal_bottom_right", sk=24, bias=(1, 4)),
    "br_padding_bias_folded": dict(mask_type="padding_causal_bottom_right", sk=24, lens=([16, 5], [9, 24]),
                                   bias=(1, 4)),
    "br_segments_folded": dict(mask_type="causal_bottom_right", sk=24, segments=True),
    "positions_causal_window_folded": dict(mask_type="causal", window=(3, 0), sk=24, segments=True, positions=True),
    "positions_bias_window_folded": dict(window=(2, 1), sk=24, segments=True, positions=True, bias=(2, 1)),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(GLUE_CASES))
def test_native_glue_with_emulated_cudnn(case, monkeypatch):
    from te_ops._core import native as core_native
    from te_ops.fused_attention import native as nat

    asked = []

    def query(ints, scale, dropout):
        asked.append(ints)
        return None, 256

    monkeypatch.setattr(core_native, "ffi_call", _emulated_ffi_call)
    monkeypatch.setattr(nat, "query", query)
    c = dict(GLUE_CASES[case])
    b, sq, sk, hq, hk = 2, 16, c.pop("sk"), 4, 2
    q, k, v, g = (x.astype(jnp.float16) for x in _qkv(30, b, sq, sk, hq, hk))
    mask_type, window = c.pop("mask_type", "none"), c.pop("window", None)
    bias = None
    if "bias" in c:
        bias = jax.random.normal(jax.random.key(3), (*c.pop("bias"), sq, sk), F32).astype(jnp.float16)
    ql = kl = qs = ks = qp = kp = None
    if "lens" in c:
        ql, kl = (jnp.array(x, jnp.int32) for x in c.pop("lens"))
    if c.pop("segments", False):
        qs = jnp.array([[1] * 6 + [2] * 10, [3] * 16], jnp.int32)
        ks = jnp.array([[1] * 10 + [2] * 14, [3] * 20 + [0] * 4], jnp.int32)
        if c.pop("positions", False):
            qp = jnp.array([list(range(4, 10)) + list(range(4, 14)), list(range(16))], jnp.int32)
            kp = jnp.array([list(range(10)) + list(range(14)), list(range(24))], jnp.int32)
    assert not c
    statics = dict(mask_type=mask_type, window=window, scale=0.25, dropout_rate=0.0)
    args = (q, k, v, bias, ql, kl, qs, ks, None, qp, kp)
    assert not jax.make_jaxpr(lambda *a: nat.forward(*a, **statics))(*args).consts, case
    out_n, res_n = jax.jit(lambda *a: nat.forward(*a, **statics))(*args)
    out_r, res_r = jax.jit(lambda *a: ref.forward(*a, **statics))(*args)
    assert_close(out_n, out_r, jnp.float16, err_msg=case)
    out_i, _ = jax.jit(lambda *a: nat.forward(*a, **statics, need_stats=False))(*args)
    assert_close(out_i, out_r, jnp.float16, err_msg=case)
    fin = np.isfinite(np.asarray(res_r.lse))
    np.testing.assert_array_equal(fin, np.isfinite(np.asarray(res_n.lse)))
    grads_n = jax.jit(lambda r, g: nat.backward(r, g, **statics))(res_n, g)
    grads_r = jax.jit(lambda r, g: ref.backward(r, g, **statics))(res_r, g)
    for gn, gr in zip(grads_n, grads_r, strict=True):
        assert (gn is None) == (gr is None)
        if gr is not None:
            assert_close(gn, gr, jnp.float16, scale=8.0, err_msg=case)
    # what cuDNN was asked for: 19 ints (te_fused_attention_query's order), a band only when not folded
    assert asked and all(len(i) == 19 for i in asked), asked
    ints = asked[-1]
    left_bound, right_bound, bottom_right = ints[13], ints[14], ints[17]
    if case.endswith("_folded"):
        assert (left_bound, right_bound, bottom_right) == (-1, -1, 0), ints
        assert ints[10] > 0, "folded rules need the additive mask"
    else:
        assert bottom_right == 1 and right_bound == 0, ints


def test_query_ints_follow_the_cpp_order():
    from te_ops.fused_attention import native as nat

    cfg = nat._graph_config(dtype=jnp.float16, q_shape=(2, 16, 8, 64), k_shape=(2, 32, 2, 64),
                            v_shape=(2, 32, 2, 32), bias_shape=None, has_segments=False,
                            mask_type="padding_causal_bottom_right", window=(5, -1))  # fmt: skip
    # device, io, backward, b, sq, sk, hq, hk, d, dv, bias_b, bias_h, padding, left_bound, right_bound, stats,
    # dbias, bottom_right, deterministic
    assert nat._ints(cfg, True, device=3) == (3, 1, 1, 2, 16, 32, 8, 2, 64, 32, 0, 0, 1, 6, 0, 1, 0, 1, 0)
    assert nat._ints(cfg, True, deterministic=True)[-1] == 1
    assert nat._ints(cfg, False, stats=False)[-4:] == (0, 0, 1, 0)
    assert nat._ints(cfg, False, deterministic=True)[-1] == 0  # the forward has no such choice
