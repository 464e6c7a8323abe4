"""fused_attention with NaN / +inf / -inf inputs (CPU, reference path): against a row-by-row numpy
oracle of the documented rules, against jax.nn.dot_product_attention(implementation="xla") where
both define the result, empty rows, and gradients that ignore zero-probability pairs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops._core.testing import tolerance
from te_ops.fused_attention import fused_attention
from te_ops.fused_attention import reference as ref

F32 = jnp.float32


def _qkv(seed, b=2, sq=12, sk=12, hq=4, hk=2, d=16):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (b, sq, hq, d), F32)
    k = jax.random.normal(ks[1], (b, sk, hk, d), F32)
    v = jax.random.normal(ks[2], (b, sk, hk, d), F32)
    g = jax.random.normal(ks[3], (b, sq, hq, d), F32)
    bias = jax.random.normal(ks[4], (b, hq, sq, sk), F32)
    return q, k, v, g, bias


def _sprinkle(x, seed, frac):
    """x with NaN, +inf and -inf at random positions (frac of the elements)."""
    ka, kb = jax.random.split(jax.random.key(seed))
    hit = jax.random.bernoulli(ka, frac, x.shape)
    vals = jnp.array([jnp.nan, jnp.inf, -jnp.inf], x.dtype)[jax.random.randint(kb, x.shape, 0, 3)]
    return jnp.where(hit, vals, x)


def _assert_same_with_nan(got, want, msg=""):
    g = np.asarray(got, np.float64)
    w = np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"NaN positions differ {msg}")
    np.testing.assert_allclose(g, w, equal_nan=True, err_msg=msg, **tolerance(F32))


def _oracle(q, k, v, bias, vis, scale):
    """The documented rules row by row in float64: no visible key or all scores -inf -> 0; a NaN or
    +inf visible score -> NaN row; else softmax over the visible keys and a sum over the pairs with
    non-zero probability (IEEE products and sums there)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, sq, hq, _ = q.shape
    hk, sk = k.shape[2], k.shape[1]
    vis = np.ones((1, 1, sq, sk), bool) if vis is None else np.asarray(vis)
    bias = None if bias is None else np.asarray(bias, np.float64)
    out = np.zeros((b_, sq, hq, v.shape[3]))
    with np.errstate(all="ignore"):
        for b in range(b_):
            for h in range(hq):
                kh = h // (hq // hk)
                for i in range(sq):
                    js = np.nonzero(vis[min(b, vis.shape[0] - 1), min(h, vis.shape[1] - 1), i])[0]
                    if js.size == 0:
                        continue
                    s = scale * (k[b, js, kh] @ q[b, i, h])
                    if bias is not None:
                        s = s + bias[min(b, bias.shape[0] - 1), min(h, bias.shape[1] - 1), i, js]
                    if np.any(np.isnan(s) | np.isposinf(s)):
                        out[b, i, h] = np.nan
                        continue
                    if np.all(np.isneginf(s)):
                        continue
                    e = np.exp(s - s.max())
                    p = e / e.sum()
                    nz = p != 0
                    out[b, i, h] = (p[nz, None] * v[b, js[nz], kh]).sum(0)
    return out


CASES = {
    "none": dict(),
    "causal": dict(mask_type="causal"),
    "causal_sq_gt_sk": dict(mask_type="causal", sq=14, sk=9),  # no empty row; top-left aligned
    "padding": dict(mask_type="padding", lens=True),
    "padding_causal": dict(mask_type="padding_causal", lens=True),
    "window": dict(window=(2, 1)),
    "segments": dict(segments=True),
    "mqa_causal": dict(mask_type="causal", hk=1),
}


def _setup(case):
    c = dict(CASES[case])
    sq, sk, hk = c.pop("sq", 12), c.pop("sk", 12), c.pop("hk", 2)
    q, k, v, g, bias = _qkv(1, sq=sq, sk=sk, hk=hk)
    kw = dict(mask_type=c.pop("mask_type", "none"), window_size=c.pop("window", None))
    ql = kl = qs = ks = None
    if c.pop("lens", False):
        ql, kl = jnp.array([sq, sq // 2], jnp.int32), jnp.array([sk // 3, sk], jnp.int32)
        kw.update(q_seqlens=ql, kv_seqlens=kl)
    if c.pop("segments", False):
        qs = jnp.array([[1] * 4 + [2] * 5 + [7] * 3, [3] * 6 + [4] * 6], jnp.int32)  # 7: no key
        ks = jnp.array([[1] * 5 + [2] * 4 + [5] * 3, [3] * 6 + [4] * 6], jnp.int32)
        kw.update(q_segment_ids=qs, kv_segment_ids=ks)
    assert not c
    win = kw["window_size"]
    vis = ref.visible(
        2,
        sq,
        sk,
        mask_type=kw["mask_type"],
        window=win,
        q_seqlens=ql,
        kv_seqlens=kl,
        q_segment_ids=qs,
        kv_segment_ids=ks,
    )
    return (q, k, v, g, bias), kw, vis


@pytest.mark.parametrize("where", ["q", "k", "v", "bias", "all"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_rowwise_oracle(case, where):
    (q, k, v, _, bias), kw, vis = _setup(case)
    frac = 0.02
    if where in ("q", "all"):
        q = _sprinkle(q, 10, frac)
    if where in ("k", "all"):
        k = _sprinkle(k, 11, frac)
    if where in ("v", "all"):
        v = _sprinkle(v, 12, frac)
    if where in ("bias", "all"):
        bias = _sprinkle(bias, 13, frac)
        bias = bias.at[0, 0, 3].set(-jnp.inf)  # a row whose visible scores are all -inf
    scale = 0.3
    out = jax.jit(lambda q, k, v, bb: fused_attention(q, k, v, bias=bb, scale=scale, implementation="reference", **kw))(
        q, k, v, bias
    )
    want = _oracle(q, k, v, bias, vis, scale)
    assert np.isnan(want).any() and np.isfinite(want).any(), "the case must hold NaN and finite entries"
    _assert_same_with_nan(out, want, f"{case}/{where}")


@pytest.mark.parametrize("case", ["none", "causal", "bias", "gqa"])
def test_nan_rows_match_jax_xla(case):
    """NaN in q rows and in k rows: jax.nn.dot_product_attention gives the same NaN rows (it masks
    with a select, so masked k rows do not matter there either); NaN in v only without a mask (XLA
    multiplies masked probabilities 0 by v, where we leave the pair out)."""
    q, k, v, _, bias = _qkv(2, hk=4 if case != "gqa" else 2)
    q = q.at[0, 3, 1, 5].set(jnp.nan).at[1, 7, 0, 2].set(jnp.inf)
    k = k.at[0, 9, 0, 1].set(jnp.nan).at[1, 2, 1, 0].set(-jnp.inf)
    if case in ("none", "bias"):
        v = v.at[1, 4, 0, 3].set(jnp.nan)
    causal = case in ("causal", "gqa")
    bb = bias if case == "bias" else None
    ours = fused_attention(q, k, v, bias=bb, mask_type="causal" if causal else "none", implementation="reference")
    want = jax.nn.dot_product_attention(q, k, v, bias=bb, is_causal=causal, implementation="xla")
    assert np.isnan(np.asarray(want)).any()
    _assert_same_with_nan(ours, want, case)


def test_empty_and_all_neg_inf_rows_are_zero_with_zero_gradients():
    q, k, v, g, _ = _qkv(3, b=1, sq=8, sk=8, hq=2, hk=2)
    qs = jnp.array([[1, 1, 1, 1, 9, 9, 2, 2]], jnp.int32)  # segment 9 has no keys
    ks = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2]], jnp.int32)
    q = q.at[0, 4].set(jnp.nan)  # a NaN query row that sees no key: still 0
    bias = jnp.zeros((1, 2, 8, 8)).at[0, 1, 6].set(-jnp.inf)  # row 6 of head 1: every score -inf

    def f(q, k, v, bias):
        return fused_attention(q, k, v, bias=bias, q_segment_ids=qs, kv_segment_ids=ks, implementation="reference")

    out, vjp = jax.vjp(f, q, k, v, bias)
    out = np.asarray(out)
    np.testing.assert_array_equal(out[0, 4:6], 0.0)
    np.testing.assert_array_equal(out[0, 6, 1], 0.0)
    assert np.isfinite(out).all()
    dq, dk, dv, dbias = (np.asarray(x) for x in vjp(g))
    np.testing.assert_array_equal(dq[0, 4:6], 0.0)
    np.testing.assert_array_equal(dq[0, 6, 1], 0.0)
    np.testing.assert_array_equal(dbias[0, 1, 6], 0.0)
    assert all(np.isfinite(x).all() for x in (dq, dk, dv, dbias))
    statics = dict(mask_type="none", window=None, scale=0.25, dropout_rate=0.0)
    _, res = ref.forward(q, k, v, bias, None, None, qs, ks, None, **statics)
    assert np.isposinf(np.asarray(res.lse[0, :, 4:6])).all() and np.isposinf(float(res.lse[0, 1, 6]))


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_masked_garbage_takes_no_part_in_output_or_gradients(mask_type):
    """NaN / inf in k, v and bias at padded positions: output and every gradient equal those with
    zeros there (the padded keys' own gradients are 0)."""
    q, k, v, g, bias = _qkv(4)
    ql, kl = jnp.array([12, 7], jnp.int32), jnp.array([5, 12], jnp.int32)
    pad_k = (jnp.arange(12)[None, :] >= kl[:, None])[:, :, None, None]  # [B, Sk, 1, 1]
    junk = lambda x, seed: jnp.where(pad_k, _sprinkle(jnp.full(x.shape, jnp.nan), seed, 0.6), x)  # noqa: E731
    vis = ref.visible(2, 12, 12, mask_type=mask_type, window=None, q_seqlens=ql, kv_seqlens=kl)
    bias_junk = jnp.where(vis, bias, jnp.nan)

    def run(k, v, bb):
        def f(q, k, v, bb):
            return fused_attention(
                q, k, v, bias=bb, mask_type=mask_type, q_seqlens=ql, kv_seqlens=kl, implementation="reference"
            )

        out, vjp = jax.vjp(f, q, k, v, bb)
        return (out, *vjp(g))

    got = jax.jit(run)(junk(k, 20), junk(v, 21), bias_junk)
    want = jax.jit(run)(jnp.where(pad_k, 0.0, k), jnp.where(pad_k, 0.0, v), jnp.where(vis, bias, 0.0))
    for name, a, e in zip(("out", "dq", "dk", "dv", "dbias"), got, want, strict=True):
        assert np.isfinite(np.asarray(a)).all(), name
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), err_msg=name, **tolerance(F32))
    assert np.all(np.asarray(got[2])[np.broadcast_to(np.asarray(pad_k), got[2].shape)] == 0)


def test_nan_row_gradients_are_nan_along_its_pairs_only():
    q, k, v, g, _ = _qkv(5, b=1, sq=8, sk=8, hq=2, hk=2)
    q = q.at[0, 5, 0, 3].set(jnp.nan)  # query 5, head 0 sees keys 0..5 (causal)
    out, vjp = jax.vjp(
        lambda q, k, v: fused_attention(q, k, v, mask_type="causal", implementation="reference"), q, k, v
    )
    dq, dk, dv = (np.asarray(x) for x in vjp(g))
    out = np.asarray(out)
    assert np.isnan(out[0, 5, 0]).all() and np.isfinite(np.delete(out[0, :, 0], 5, axis=0)).all()
    assert np.isnan(dq[0, 5, 0]).all() and np.isfinite(np.delete(dq[0, :, 0], 5, axis=0)).all()
    assert np.isnan(dk[0, :6, 0]).all() and np.isfinite(dk[0, 6:, 0]).all()  # keys 6, 7: masked for row 5
    assert np.isnan(dv[0, :6, 0]).all() and np.isfinite(dv[0, 6:, 0]).all()
    assert np.isfinite(dq[0, :, 1]).all() and np.isfinite(dk[0, :, 1]).all()  # the other head


def test_contract_leaves_out_zero_weights():
    a = jnp.array([[0.0, 0.5, 0.5], [0.2, 0.0, -0.8], [0.0, 0.0, 0.0]])
    b = jnp.array([[jnp.nan, 1.0], [jnp.inf, 2.0], [-jnp.inf, 3.0]])
    got = np.asarray(ref.contract("ij,jd->id", a, b))
    np.testing.assert_allclose(got[:, 1], [2.5, 0.2 - 2.4, 0.0], rtol=1e-6)
    assert np.isnan(got[0, 0])  # +inf meets -inf
    assert np.isnan(got[1, 0])  # NaN at a non-zero weight
    assert np.isposinf(ref.contract("ij,jd->id", a[1:2], jnp.array([[1.0], [jnp.nan], [-jnp.inf]]))[0, 0])
    assert got[2, 0] == 0.0  # every weight 0: nothing reaches the row
