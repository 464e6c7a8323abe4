"""Native (cuDNN) fused_attention vs the reference on the GPU, outputs poisoned; dropout statistics;
command buffers. Shapes are modest: the whole file should run in well under a minute on an H200."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops._core import native
from te_ops.fused_attention import fused_attention
from te_ops.fused_attention import native as fa_native
from tests.gpu.cmdbuf import assert_graph_captured_and_warmed_once, run_under_command_buffers

_WHY = native.native_unavailable_reason(fa_native.MODULE, "fused_attention")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_WHY is not None, reason=f"GPU test: {_WHY}")]

F32 = jnp.float32
REL_TOL = {jnp.dtype(jnp.bfloat16): 2.5e-2, jnp.dtype(jnp.float16): 6e-3}


def _rel_err(a, e) -> float:
    a = np.asarray(jnp.asarray(a, F32), np.float64)
    e = np.asarray(jnp.asarray(e, F32), np.float64)
    assert not np.isnan(a).any(), "NaN in native result (unwritten poisoned element or cuDNN NaN)"
    return float(np.linalg.norm(a - e) / (np.linalg.norm(e) + 1e-30))


def _inputs(seed, b, sq, sk, hq, hk, d, dv, dtype):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, sq, hq, d), F32).astype(dtype)
    k = jax.random.normal(ks[1], (b, sk, hk, d), F32).astype(dtype)
    v = jax.random.normal(ks[2], (b, sk, hk, dv), F32).astype(dtype)
    g = jax.random.normal(ks[3], (b, sq, hq, dv), F32).astype(dtype)
    return q, k, v, g


def _fwd_bwd(impl, kw, with_bias):
    def run(q, k, v, g, bias):
        def f(q, k, v, *bb):
            return fused_attention(q, k, v, bias=bb[0] if bb else None, implementation=impl, **kw)

        args = (q, k, v) + ((bias,) if with_bias else ())
        out, vjp = jax.vjp(f, *args)
        return out, vjp(g.astype(out.dtype))

    return jax.jit(run)


CASES = {
    "none": dict(),
    "causal": dict(mask_type="causal"),
    "causal_sq_lt_sk": dict(mask_type="causal", sq=128, sk=320),
    "padding": dict(mask_type="padding", lens=True),
    "padding_causal": dict(mask_type="padding_causal", lens=True),
    "gqa_causal": dict(mask_type="causal", hq=8, hk=2),
    "mqa": dict(hq=4, hk=1),
    "window_causal": dict(mask_type="causal", window=(64, 0)),
    "window_left_right": dict(window=(48, 16)),
    "segments": dict(segments=True),
    "segments_causal": dict(segments=True, mask_type="causal"),
    "bias_full": dict(bias=(2, 4)),
    "bias_heads_causal": dict(bias=(1, 4), mask_type="causal"),
    "bias_padding": dict(bias=(2, 1), mask_type="padding", lens=True),
    "head_dim_256": dict(d=256, mask_type="causal"),
    "dv_64_d_128": dict(d=128, dv=64),
    "odd_lengths": dict(sq=100, sk=77, mask_type="padding_causal", lens=True),
    # bottom-right causal masks (cuDNN BOTTOM_RIGHT band; with a bias: folded into the additive mask)
    "causal_bottom_right_sq_lt_sk": dict(mask_type="causal_bottom_right", sq=128, sk=320),
    "padding_causal_bottom_right_sq_gt_sk": dict(mask_type="padding_causal_bottom_right", sq=256, sk=128, lens=True),
    "causal_bottom_right_window_bias": dict(mask_type="causal_bottom_right", sq=128, sk=320, window=(64, 0),
                                            bias=(1, 4)),
    # packed cross-attention with per-segment positions (folded into the additive mask)
    "packed_positions_causal_window": dict(mask_type="causal", sq=256, sk=320, window=(48, 0), packed=True),
}  # fmt: skip


def _case(name, dtype, seed=0):
    c = dict(CASES[name])
    b, sq, sk = 2, c.pop("sq", 256), c.pop("sk", None)
    sk = sk or sq
    hq, hk, d = c.pop("hq", 4), c.pop("hk", None), c.pop("d", 64)
    hk = hk or hq
    dv = c.pop("dv", d)
    q, k, v, g = _inputs(seed, b, sq, sk, hq, hk, d, dv, dtype)
    kw = {}
    if "mask_type" in c:
        kw["mask_type"] = c.pop("mask_type")
    if "window" in c:
        kw["window_size"] = c.pop("window")
    if c.pop("lens", False):
        kw["q_seqlens"] = jnp.array([sq, sq // 2 + 3], jnp.int32)
        kw["kv_seqlens"] = jnp.array([sk // 3 + 1, sk], jnp.int32)
    if c.pop("segments", False):
        cut = [0, sq // 5, sq // 2, sq // 2 + 7, sq]
        seg = np.zeros((b, sq), np.int32)
        for i in range(len(cut) - 1):
            seg[0, cut[i] : cut[i + 1]] = i + 1
        seg[1] = np.repeat(np.arange(4), sq // 4 + 1)[:sq] + 10
        kw["q_segment_ids"] = kw["kv_segment_ids"] = jnp.asarray(seg)
    if c.pop("packed", False):
        kw.update(_packed(b, sq, sk))
    bias = None
    if "bias" in c:
        bb, bh = c.pop("bias")
        bias = jax.random.normal(jax.random.key(seed + 9), (bb, bh, sq, sk), F32).astype(dtype)
    assert not c, c
    return (q, k, v, g, bias), kw


def _packed(b, sq, sk):
    """Packed cross-attention: 3 segments per row; each query segment is the last tokens of its kv
    segment (query positions continue the kv positions, which restart at 0 per segment)."""
    q_cut, k_cut = [0, sq // 4, sq // 2 + 5, sq], [0, sk // 3, sk // 2 + 20, sk]
    qs, ks = np.zeros((b, sq), np.int32), np.zeros((b, sk), np.int32)
    qp, kp = np.zeros((b, sq), np.int32), np.zeros((b, sk), np.int32)
    for r in range(b):
        for i in range(3):
            nq, nk = q_cut[i + 1] - q_cut[i], k_cut[i + 1] - k_cut[i]
            qs[r, q_cut[i] : q_cut[i + 1]] = ks[r, k_cut[i] : k_cut[i + 1]] = i + 1 + 10 * r
            kp[r, k_cut[i] : k_cut[i + 1]] = np.arange(nk)
            qp[r, q_cut[i] : q_cut[i + 1]] = np.arange(nq) + (nk - nq if r == 0 else 0)
    return dict(q_segment_ids=jnp.asarray(qs), kv_segment_ids=jnp.asarray(ks), q_segment_pos=jnp.asarray(qp),
                kv_segment_pos=jnp.asarray(kp))  # fmt: skip


# Every case in bfloat16; a representative subset in float16 (keeps the file well under a minute).
FP16_CASES = ("causal", "padding_causal", "gqa_causal", "bias_full", "segments", "window_causal")
PARAMS = [(c, jnp.bfloat16) for c in sorted(CASES)] + [(c, jnp.float16) for c in FP16_CASES]


@pytest.mark.parametrize("case,dtype", PARAMS, ids=[f"{c}-{jnp.dtype(d).name}" for c, d in PARAMS])
def test_native_matches_reference(case, dtype):
    (q, k, v, g, bias), kw = _case(case, dtype)
    call = dict(
        dtype=q.dtype,
        q_shape=q.shape,
        k_shape=k.shape,
        v_shape=v.shape,
        bias_shape=None if bias is None else bias.shape,
        has_segments="q_segment_ids" in kw,
        has_positions="q_segment_pos" in kw,
        mask_type=kw.get("mask_type", "none"),
        window=kw.get("window_size"),
        scale=1 / np.sqrt(q.shape[3]),
        dropout_rate=0.0,
    )
    why = fa_native.unsupported_reason(**call)
    if why is not None:
        pytest.skip(f"cuDNN on this machine: {why}")
    with native.poisoned_outputs():
        out, grads = _fwd_bwd("native", kw, bias is not None)(q, k, v, g, bias)
    f32 = lambda x: None if x is None else x.astype(F32)  # noqa: E731
    with jax.default_matmul_precision("highest"):  # an fp32 (not TF32) reference
        want, want_grads = _fwd_bwd("reference", kw, bias is not None)(f32(q), f32(k), f32(v), f32(g), f32(bias))
    tol = REL_TOL[jnp.dtype(dtype)]
    assert _rel_err(out, want) < tol, (case, _rel_err(out, want))
    for name, a, e in zip(("dq", "dk", "dv", "dbias"), grads, want_grads, strict=False):
        assert _rel_err(a, e) < 2 * tol, (case, name, _rel_err(a, e))


def test_deterministic_backward_is_bit_identical_and_matches_default():
    """deterministic=True: cuDNN's deterministic backward algorithm (dQ accumulated in a fixed order, not with
    atomics) gives bit-identical gradients on two runs of the same inputs, and the values of the default
    backward within this file's gradient tolerance. GQA causal bf16 B2 S2048 Hq8 Hk2 D128: each query block's
    dQ sums over up to 16+ key blocks, where the default's atomics make the low bits vary run to run."""
    b, s, hq, hk, d = 2, 2048, 8, 2, 128
    dtype = jnp.bfloat16
    q, k, v, g = _inputs(60, b, s, s, hq, hk, d, d, dtype)
    call = dict(dtype=q.dtype, q_shape=q.shape, k_shape=k.shape, v_shape=v.shape, mask_type="causal",
                scale=1 / np.sqrt(d), dropout_rate=0.0)  # fmt: skip
    for det in (False, True):
        why = fa_native.unsupported_reason(**call, deterministic=det)
        if why is not None:
            pytest.skip(f"cuDNN on this machine (deterministic={det}): {why}")
    det_fn = _fwd_bwd("native", dict(mask_type="causal", deterministic=True), False)
    default_fn = _fwd_bwd("native", dict(mask_type="causal", deterministic=False), False)
    hlo = det_fn.lower(q, k, v, g, None).as_text()
    assert "te_fused_attention_bwd" in hlo and "deterministic = 1 : i32" in hlo
    with native.poisoned_outputs():
        out1, grads1 = jax.block_until_ready(det_fn(q, k, v, g, None))
        out2, grads2 = jax.block_until_ready(det_fn(q, k, v, g, None))
        out0, grads0 = jax.block_until_ready(default_fn(q, k, v, g, None))
    bits = lambda x: np.asarray(x).view(np.uint16)  # noqa: E731
    np.testing.assert_array_equal(bits(out1), bits(out2))
    for name, a, e in zip(("dq", "dk", "dv"), grads1, grads2, strict=True):
        np.testing.assert_array_equal(bits(a), bits(e), err_msg=f"{name}: deterministic runs differ")
    tol = REL_TOL[jnp.dtype(dtype)]
    assert _rel_err(out1, out0) < tol
    for name, a, e in zip(("dq", "dk", "dv"), grads1, grads0, strict=True):
        assert _rel_err(a, e) < 2 * tol, (name, _rel_err(a, e))


def test_default_dispatch_follows_the_auto_flag():
    """implementation=None picks cuDNN only once it is registered auto=True (after a green run)."""
    from te_ops._core import registry

    (q, k, v, _, _), kw = _case("causal", jnp.bfloat16)
    text = jax.jit(lambda q, k, v: fused_attention(q, k, v, **kw)).lower(q, k, v).as_text()
    auto = registry.family("fused_attention").get("native").auto_for({})
    assert ("te_fused_attention_fwd" in text) == auto


def test_forward_statistics_match_reference_logsumexp():
    from te_ops.fused_attention import reference as ref

    (q, k, v, _, _), kw = _case("padding_causal", jnp.bfloat16)
    statics = dict(mask_type="padding_causal", window=None, scale=0.125, dropout_rate=0.0)
    args = (q, k, v, None, kw["q_seqlens"], kw["kv_seqlens"], None, None, None)
    _, res_n = jax.jit(lambda *a: fa_native.forward(*a, **statics))(*args)
    _, res_r = jax.jit(lambda *a: ref.forward(*a, **statics))(*args)
    fin = np.isfinite(np.asarray(res_r.lse))
    np.testing.assert_array_equal(fin, np.isfinite(np.asarray(res_n.lse)))
    np.testing.assert_allclose(np.asarray(res_n.lse)[fin], np.asarray(res_r.lse)[fin], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dropout_rate_mean_and_backward_consistency(dtype):
    b, h, s = 2, 4, 128
    rate = 0.2
    q, k, _, g = _inputs(3, b, s, s, h, h, 64, 128, dtype)
    # v = one-hot over keys: out[b, i, h, :] is row i of the dropped probability matrix.
    v = jnp.broadcast_to(jnp.eye(s, dtype=dtype)[None, :, None, :], (b, s, h, s))
    kw = dict(dropout_rate=rate, rng=jax.random.key(11))
    call = dict(dtype=q.dtype, q_shape=q.shape, k_shape=k.shape, v_shape=v.shape, scale=0.125, dropout_rate=rate)
    why = fa_native.unsupported_reason(**call)
    if why is not None:
        pytest.skip(f"cuDNN on this machine: {why}")

    def run(q, k, v, g):
        out, vjp = jax.vjp(
            lambda q, k, v: fused_attention(q, k, v, scale=0.125, implementation="native", **kw), q, k, v
        )
        return out, vjp(g)

    with native.poisoned_outputs():
        out, (dq, dk, dv) = jax.jit(run)(q, k, v, g)
        out2, _ = jax.jit(run)(q, k, v, g)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out2, np.float32))  # same key
    pd = np.asarray(out, np.float32)  # [b, i, h, j] dropped, rescaled probabilities
    dropped = (pd == 0).mean()
    assert abs(dropped - rate) < 0.02, dropped
    assert abs(pd.sum(-1).mean() - 1.0) < 0.03, pd.sum(-1).mean()
    # backward uses the same mask: dv[b, j, h, :] = sum_i pd[b, i, h, j] * g[b, i, h, :]
    want_dv = np.einsum("bihj,bihd->bjhd", pd, np.asarray(g, np.float32))
    assert _rel_err(dv, want_dv) < 2 * REL_TOL[jnp.dtype(dtype)]
    for x in (dq, dk):
        assert np.isfinite(np.asarray(x, np.float32)).all()
    other = jax.jit(
        lambda q, k, v: fused_attention(
            q, k, v, scale=0.125, implementation="native", dropout_rate=rate, rng=jax.random.key(12)
        )
    )(q, k, v)
    assert not np.array_equal(np.asarray(other, np.float32), pd)


def test_unsupported_dtype_reason():
    q = jnp.zeros((1, 8, 2, 64), F32)
    with pytest.raises(Exception, match="bfloat16 and float16"):
        fused_attention(q, q, q, implementation="native")


# ---- command buffers --------------------------------------------------------------------------


def build_cmdbuf_step():
    """fwd+bwd of causal GQA attention with a padding mask; 4 calls with fresh inputs, one key each."""
    b, s, hq, hk, d = 2, 256, 8, 2, 64
    lens = jnp.array([256, 131], jnp.int32)

    def make(impl):
        def step(q, k, v, g):
            def f(q, k, v):
                return fused_attention(
                    q, k, v, mask_type="padding_causal", q_seqlens=lens, kv_seqlens=lens, implementation=impl
                )

            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(g)

        return step

    inputs = [_inputs(40 + i, b, s, s, hq, hk, d, d, jnp.bfloat16) for i in range(4)]
    keys = {"fused_attention_fwd": 1, "fused_attention_bwd": 1}
    return make("native"), make("reference"), inputs, keys


def test_under_command_buffers_graph_captured_and_warmed_once():
    report = run_under_command_buffers("tests.gpu.test_fused_attention_gpu:build_cmdbuf_step")
    assert report["xla_flags_ok"]
    assert not report["any_nan"]
    assert report["max_rel_error"] < 3e-2, report
    assert_graph_captured_and_warmed_once(report, report["expected_keys"])


# ---- non-finite inputs: the cuDNN path against the reference's rules ----------------------------
#
# cuDNN cannot be changed; these tests say where it follows the rules of fused_attention's
# docstring. Rows are checked strictly (NaN positions, inf positions and values) except the rows
# the docstring exempts on the native path: rows with a non-finite k or v at a pair of zero
# probability (masked, or a -inf score), a non-finite bias at a masked pair, or (segment ids, an
# additive mask) a non-finite q with a masked pair, where cuDNN may turn the row (or some of its
# entries) into NaN. There each entry must be the
# reference's value or NaN, and a NaN of the reference must stay NaN.

NONFINITE_CASES = (
    "none",
    "causal",
    "padding_causal",
    "gqa_causal",
    "window_causal",
    "segments",
    "bias_full",
    "bias_heads_causal",
    "odd_lengths",
)
NONFINITE_PARAMS = [
    (c, w, d)
    for c in NONFINITE_CASES
    for w in ("q", "kv", "bias")
    for d in (jnp.bfloat16, jnp.float16)
    if w != "bias" or c.startswith("bias")
]


def _sprinkle(x, seed, frac):
    """x with NaN, +inf and -inf at random elements (frac of them)."""
    ka, kb = jax.random.split(jax.random.key(seed))
    hit = jax.random.bernoulli(ka, frac, x.shape)
    vals = jnp.array([jnp.nan, jnp.inf, -jnp.inf], x.dtype)[jax.random.randint(kb, x.shape, 0, 3)]
    return jnp.where(hit, vals, x)


def _sprinkle_rows(x, seed, n, batch=None):
    """x [B, S, H, D] with one NaN, +inf or -inf element in each of n random (b, s, h) rows (of
    batch element ``batch`` only, when given)."""
    rng = np.random.default_rng(seed)
    b, s, h, d = x.shape
    bs = rng.integers(0, b, n) if batch is None else np.full(n, batch)
    idx = (bs, rng.integers(0, s, n), rng.integers(0, h, n), rng.integers(0, d, n))
    vals = np.array([np.nan, np.inf, -np.inf], np.float32)[rng.integers(0, 3, n)]
    return x.at[idx].set(jnp.asarray(vals, x.dtype))


def _exempt_rows(q, k, v, bias, kw, scale):
    """bool [B, Sq, Hq]: rows the native path may turn NaN (see the comment above)."""
    b, s_q, hq, _ = q.shape
    s_k, hk = k.shape[1], k.shape[2]
    vis = _visible(b, s_q, s_k, kw)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    kk = np.repeat(f32(k), hq // hk, axis=2)
    vv = np.repeat(f32(v), hq // hk, axis=2)
    with np.errstate(all="ignore"):
        s = np.einsum("bqhd,bkhd->bhqk", f32(q), kk) * scale
        if bias is not None:
            s = s + f32(bias)
    vis = np.ones(s.shape, bool) if vis is None else np.broadcast_to(np.asarray(vis), s.shape)
    zero_pair = ~vis | np.isneginf(s)
    bad_kv = (~np.isfinite(kk).all(-1) | ~np.isfinite(vv).all(-1)).transpose(0, 2, 1)[:, :, None, :]  # [B,H,1,Sk]
    exempt = (zero_pair & bad_kv).any(-1)
    if bias is not None:  # a masked non-finite bias entry (added before the mask, or with the -inf segment mask)
        exempt = exempt | (~vis & ~np.isfinite(np.broadcast_to(f32(bias), s.shape))).any(-1)
    if "q_segment_ids" in kw:  # the segment mask is additive: a non-finite q meets -inf at masked pairs
        bad_q = ~np.isfinite(f32(q)).all(-1).transpose(0, 2, 1)  # [B, H, Sq]
        nan_row = (vis & (np.isnan(s) | np.isposinf(s))).any(-1)  # NaN in the reference anyway
        exempt = exempt | (bad_q & (~vis).any(-1) & ~nan_row)
    return exempt.transpose(0, 2, 1)


def _visible(b, s_q, s_k, kw):
    from te_ops.fused_attention import reference as ref

    return ref.visible(
        b,
        s_q,
        s_k,
        mask_type=kw.get("mask_type", "none"),
        window=kw.get("window_size"),
        q_seqlens=kw.get("q_seqlens"),
        kv_seqlens=kw.get("kv_seqlens"),
        q_segment_ids=kw.get("q_segment_ids"),
        kv_segment_ids=kw.get("kv_segment_ids"),
        q_segment_pos=kw.get("q_segment_pos"),
        kv_segment_pos=kw.get("kv_segment_pos"),
    )


def _check_nonfinite(out, want, exempt, dtype, what):
    a = np.asarray(jnp.asarray(out, F32), np.float64)
    e = np.asarray(jnp.asarray(want, F32), np.float64)
    ex = np.broadcast_to(exempt[..., None], a.shape)
    strict = ~ex
    assert np.isnan(e)[strict].any() and np.isfinite(e)[strict].any(), f"{what}: the case must hold strict NaN rows"
    lost = np.isnan(e) & ~np.isnan(a)
    assert not lost.any(), f"{what}: {lost.sum()} NaN entries of the reference are not NaN natively"
    extra = strict & np.isnan(a) & ~np.isnan(e)
    assert not extra.any(), f"{what}: {extra.sum()} NaN entries natively where the reference has none"
    both = ~np.isnan(a) & ~np.isnan(e)
    np.testing.assert_array_equal(np.isposinf(a)[both], np.isposinf(e)[both], err_msg=f"{what}: +inf positions")
    np.testing.assert_array_equal(np.isneginf(a)[both], np.isneginf(e)[both], err_msg=f"{what}: -inf positions")
    fin = both & np.isfinite(e)
    err = np.linalg.norm(a[fin] - e[fin]) / (np.linalg.norm(e[fin]) + 1e-30)
    assert err < REL_TOL[jnp.dtype(dtype)], (what, err)


@pytest.mark.parametrize(
    "case,where,dtype", NONFINITE_PARAMS, ids=[f"{c}-{w}-{jnp.dtype(d).name}" for c, w, d in NONFINITE_PARAMS]
)
def test_native_nonfinite_inputs_follow_the_reference(case, where, dtype):
    (q, k, v, g, bias), kw = _case(case, dtype, seed=5)
    scale = 1 / np.sqrt(q.shape[3])
    call = dict(
        dtype=q.dtype,
        q_shape=q.shape,
        k_shape=k.shape,
        v_shape=v.shape,
        bias_shape=None if bias is None else bias.shape,
        has_segments="q_segment_ids" in kw,
        mask_type=kw.get("mask_type", "none"),
        window=kw.get("window_size"),
        scale=scale,
        dropout_rate=0.0,
    )
    why = fa_native.unsupported_reason(**call)
    if why is not None:
        pytest.skip(f"cuDNN on this machine: {why}")
    if where == "q":
        q = _sprinkle_rows(q, 70, 24)
    elif where == "kv":
        # random rows of batch 0; in batch 1 a NaN in key 0, which every query of a causal, padded,
        # windowed or first segment sees: their rows are NaN, and checked strictly
        k, v = _sprinkle_rows(k, 71, 4, batch=0), _sprinkle_rows(v, 72, 4, batch=0)
        k = k.at[1, 0, 0, 0].set(jnp.nan)
    else:
        bias = _sprinkle(bias, 73, 0.002)
    exempt = _exempt_rows(q, k, v, bias, kw, scale)
    with native.poisoned_outputs():
        train_out, _ = _fwd_bwd("native", kw, bias is not None)(q, k, v, g, bias)
        infer_out = jax.jit(lambda q, k, v, bb: fused_attention(q, k, v, bias=bb, implementation="native", **kw))(
            q, k, v, bias
        )
    f32 = lambda x: None if x is None else x.astype(F32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda q, k, v, bb: fused_attention(q, k, v, bias=bb, implementation="reference", **kw))(
            f32(q), f32(k), f32(v), f32(bias)
        )
    _check_nonfinite(train_out, want, exempt, dtype, f"{case}/{where} training forward")
    _check_nonfinite(infer_out, want, exempt, dtype, f"{case}/{where} inference forward")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_native_rows_without_a_finite_score_are_zero(dtype):
    """Visible rows whose scores are all -inf (a -inf bias on the whole row) give 0, as rows with no
    visible key do; no NaN. (cuDNN's own handling of such rows is what this checks.)"""
    (q, k, v, g, bias), kw = _case("bias_full", dtype, seed=6)
    bias = bias.at[0, 1, 5].set(-jnp.inf).at[1, 3, 100].set(-jnp.inf)
    call = dict(
        dtype=q.dtype,
        q_shape=q.shape,
        k_shape=k.shape,
        v_shape=v.shape,
        bias_shape=bias.shape,
        scale=1 / np.sqrt(q.shape[3]),
        dropout_rate=0.0,
    )
    why = fa_native.unsupported_reason(**call)
    if why is not None:
        pytest.skip(f"cuDNN on this machine: {why}")
    with native.poisoned_outputs():
        out, grads = _fwd_bwd("native", kw, True)(q, k, v, g, bias)
    out = np.asarray(out, np.float32)
    np.testing.assert_array_equal(out[0, 5, 1], 0.0)
    np.testing.assert_array_equal(out[1, 100, 3], 0.0)
    assert np.isfinite(out).all()
    dq = np.asarray(grads[0], np.float32)
    np.testing.assert_array_equal(dq[0, 5, 1], 0.0)
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in grads)
