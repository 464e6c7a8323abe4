"""CPU tests of te_ops.fused_attention: reference vs jax.nn.dot_product_attention (XLA) and direct jnp
formulations, gradients, dropout statistics, jit, vmap, errors and sharding on 8 CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from te_ops._core import registry
from te_ops._core.testing import assert_close, count_collectives, cpu_mesh, run_sharded
from te_ops.fused_attention import fused_attention
from te_ops.fused_attention import reference as ref

F32 = jnp.float32


def _qkv(seed, b=2, sq=16, sk=16, hq=4, hk=4, d=32, dv=None, dtype=F32):
    ks = jax.random.split(jax.random.key(seed), 4)
    dv = dv or d
    q = jax.random.normal(ks[0], (b, sq, hq, d), F32).astype(dtype)
    k = jax.random.normal(ks[1], (b, sk, hk, d), F32).astype(dtype)
    v = jax.random.normal(ks[2], (b, sk, hk, dv), F32).astype(dtype)
    g = jax.random.normal(ks[3], (b, sq, hq, dv), F32).astype(dtype)
    return q, k, v, g


def _grads(fn, q, k, v, g, *extra):
    def loss(q, k, v, *extra):
        return jnp.sum(fn(q, k, v, *extra).astype(F32) * g.astype(F32))

    return jax.jit(jax.grad(loss, argnums=tuple(range(3 + len(extra)))))(q, k, v, *extra)


def _close(a, b, dtype=F32, scale=1.0, msg=""):
    assert_close(a, b, dtype, scale=scale, err_msg=msg)


# ----------------------------------------------------------------------------------------------
# Reference vs jax.nn.dot_product_attention(implementation="xla")
# ----------------------------------------------------------------------------------------------

XLA_CASES = {
    "none": dict(),
    "causal": dict(mask_type="causal"),
    "causal_sq_lt_sk": dict(mask_type="causal", sq=8, sk=24),
    "causal_sq_gt_sk": dict(mask_type="causal", sq=24, sk=8),
    "gqa": dict(mask_type="causal", hq=8, hk=2),
    "mqa": dict(hq=4, hk=1),
    "bias_full": dict(bias="full"),
    "bias_heads": dict(bias="heads", mask_type="causal"),
    "bias_keys_only": dict(bias="keys"),
    "padding": dict(mask_type="padding", lens=True),
    "padding_causal": dict(mask_type="padding_causal", lens=True, hq=4, hk=2),
    "window": dict(window=(3, 2)),
    "window_causal": dict(window=(4, 0), mask_type="causal"),
    "window_left_unbounded": dict(window=(-1, 1)),
    "scale": dict(scale=0.3),
}


def _bias(kind, b, hq, sq, sk, seed=7):
    shape = {"full": (b, hq, sq, sk), "heads": (1, hq, sq, sk), "keys": (sk,)}[kind]
    return jax.random.normal(jax.random.key(seed), shape, F32)


@pytest.mark.parametrize("case", sorted(XLA_CASES))
def test_reference_matches_xla(case):
    c = dict(XLA_CASES[case])
    b, sq, sk = 2, c.pop("sq", 16), c.pop("sk", 16)
    hq, hk, d, dv = c.pop("hq", 4), c.pop("hk", 4), c.pop("d", 32), c.pop("dv", None)
    q, k, v, g = _qkv(1, b, sq, sk, hq, hk, d, dv)
    mask_type = c.pop("mask_type", "none")
    window, scale = c.pop("window", None), c.pop("scale", None)
    bias = _bias(c.pop("bias"), b, hq, sq, sk) if "bias" in c else None
    ql = kl = None
    if c.pop("lens", False):
        ql, kl = jnp.array([sq, sq // 2 + 1], jnp.int32), jnp.array([sk // 3 + 1, sk], jnp.int32)
    assert not c

    def ours(q, k, v, *bias_arg):
        return fused_attention(
            q,
            k,
            v,
            bias=bias_arg[0] if bias_arg else None,
            mask_type=mask_type,
            q_seqlens=ql,
            kv_seqlens=kl,
            window_size=window,
            scale=scale,
            implementation="reference",
        )

    def xla(q, k, v, *bias_arg):
        bb = None
        if bias_arg:
            bb = jnp.broadcast_to(
                bias_arg[0].reshape((1,) * (4 - bias_arg[0].ndim) + bias_arg[0].shape), (b, hq, sq, sk)
            )
        lw = None if window is None else tuple(w if w >= 0 else max(sq, sk) for w in window)
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias=bb,
            is_causal=mask_type in ("causal", "padding_causal"),
            query_seq_lengths=ql,
            key_value_seq_lengths=kl,
            local_window_size=lw,
            scale=scale,
            implementation="xla",
        )

    extra = (bias,) if bias is not None else ()
    rows = jnp.ones((b, sq), bool) if ql is None else jnp.arange(sq)[None] < ql[:, None]
    gm = jnp.where(rows[:, :, None, None], g, 0.0)  # padded query rows: XLA leaves them undefined
    out, want = jax.jit(ours)(q, k, v, *extra), jax.jit(xla)(q, k, v, *extra)
    _close(jnp.where(rows[:, :, None, None], out, 0), jnp.where(rows[:, :, None, None], want, 0), msg=case)
    for got, exp in zip(_grads(ours, q, k, v, gm, *extra), _grads(xla, q, k, v, gm, *extra), strict=True):
        _close(got, exp, scale=4.0, msg=case)


def test_reference_bf16_matches_fp32():
    q, k, v, g = _qkv(2, dtype=jnp.bfloat16)
    out = fused_attention(q, k, v, mask_type="causal", implementation="reference")
    assert out.dtype == jnp.bfloat16
    want = jax.nn.dot_product_attention(q.astype(F32), k.astype(F32), v.astype(F32), is_causal=True)
    _close(out, want, jnp.bfloat16)


# ----------------------------------------------------------------------------------------------
# Packed sequences (segment ids) vs a direct jnp formulation
# ----------------------------------------------------------------------------------------------


def _direct(q, k, v, mask, scale):
    """softmax(scale q k^T) v with a [B, 1|H, Sq, Sk] visibility mask; empty rows -> 0."""
    hq, hk = q.shape[2], k.shape[2]
    kk, vv = jnp.repeat(k, hq // hk, 2), jnp.repeat(v, hq // hk, 2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    s = jnp.where(mask, s, -1e30)
    p = jax.nn.softmax(s, -1) * mask
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vv)


@pytest.mark.parametrize("mask_type,window", [("none", None), ("causal", None), ("none", (2, 2))])
def test_segments_match_direct(mask_type, window):
    q, k, v, g = _qkv(3, b=2, sq=12, sk=12, hq=4, hk=2)
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0, 0], [5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6]], jnp.int32)
    i, j = jnp.arange(12)[:, None], jnp.arange(12)[None]
    mask = (seg[:, :, None] == seg[:, None, :])[:, None]
    if mask_type == "causal":
        mask = mask & (j <= i)
    if window is not None:
        mask = mask & (j >= i - window[0]) & (j <= i + window[1])
    scale = 1 / np.sqrt(32)

    def ours(q, k, v):
        return fused_attention(
            q,
            k,
            v,
            mask_type=mask_type,
            q_segment_ids=seg,
            kv_segment_ids=seg,
            window_size=window,
            implementation="reference",
        )

    def direct(q, k, v):
        return _direct(q, k, v, mask, scale)

    _close(jax.jit(ours)(q, k, v), jax.jit(direct)(q, k, v))
    for got, exp in zip(_grads(ours, q, k, v, g), _grads(direct, q, k, v, g), strict=True):
        _close(got, exp, scale=4.0)


def test_value_head_dim_differs():
    q, k, v, g = _qkv(8, d=32, dv=16, hq=4, hk=2)
    mask = (jnp.arange(16)[None, :] <= jnp.arange(16)[:, None])[None, None]

    def ours(q, k, v):
        return fused_attention(q, k, v, mask_type="causal")

    assert jax.eval_shape(ours, q, k, v).shape == (2, 16, 4, 16)
    _close(jax.jit(ours)(q, k, v), jax.jit(_direct, static_argnums=4)(q, k, v, mask, 1 / np.sqrt(32)))
    for got, exp in zip(
        _grads(ours, q, k, v, g),
        _grads(lambda *a: _direct(*a, mask, 1 / np.sqrt(32)), q, k, v, g),
        strict=True,
    ):
        _close(got, exp, scale=4.0)


def test_fully_masked_rows_give_zeros():
    q, k, v, g = _qkv(4, b=1, sq=8, sk=8)
    qs = jnp.array([[1, 1, 1, 1, 9, 9, 2, 2]], jnp.int32)  # segment 9 has no keys
    ks = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2]], jnp.int32)

    def f(q, k, v):
        return fused_attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks)

    out = jax.jit(f)(q, k, v)
    assert np.all(np.asarray(out[0, 4:6]) == 0)
    statics = dict(mask_type="none", window=None, scale=0.1, dropout_rate=0.0)
    _, res = jax.jit(lambda *a: ref.forward(*a, **statics))(q, k, v, None, None, None, qs, ks, None)
    assert np.all(np.isinf(np.asarray(res.lse[0, :, 4:6])))
    grads = _grads(f, q, k, v, g)
    assert all(np.isfinite(np.asarray(x)).all() for x in grads)
    assert np.all(np.asarray(grads[0][0, 4:6]) == 0)
    # padding with kv length 0 for one batch row
    q2, k2, v2, _ = _qkv(5, b=2, sq=4, sk=4)
    out2 = jax.jit(lambda *a: fused_attention(*a, mask_type="padding", kv_seqlens=jnp.array([0, 4])))(q2, k2, v2)
    assert np.all(np.asarray(out2[0]) == 0) and np.isfinite(np.asarray(out2)).all()


# ----------------------------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------------------------


def test_dropout_statistics_and_determinism():
    b, s, h, d = 2, 64, 4, 16
    q = jnp.zeros((b, s, h, d))  # uniform attention: out = mean over kept keys / (1 - rate)
    k = jax.random.normal(jax.random.key(0), (b, s, h, d))
    v = jnp.ones((b, s, h, d))
    rate = 0.25
    drop = jax.jit(lambda q, k, v, key: fused_attention(q, k, v, dropout_rate=rate, rng=key))
    out = drop(q, k, v, jax.random.key(1))
    assert abs(float(out.mean()) - 1.0) < 0.02
    kept = np.asarray(out[..., 0]) * (1 - rate) * s  # number of kept keys per row
    assert abs(kept.mean() / s - (1 - rate)) < 0.01
    again = drop(q, k, v, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))
    other = drop(q, k, v, jax.random.key(2))
    assert not np.array_equal(np.asarray(out), np.asarray(other))


def test_dropout_gradient_matches_direct():
    q, k, v, g = _qkv(6, b=1, sq=8, sk=8, hq=2, hk=1)
    rate, key = 0.3, jax.random.key(3)
    from te_ops.fused_attention.api import dropout_seeds

    keep = ref.dropout_keep(dropout_seeds(key, 1, 2), (1, 2, 8, 8), rate)
    scale = 1 / np.sqrt(32)

    def direct(q, k, v):
        kk, vv = jnp.repeat(k, 2, 2), jnp.repeat(v, 2, 2)
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, kk) * scale, -1)
        p = jnp.where(keep, p / (1 - rate), 0.0)
        return jnp.einsum("bhqk,bkhd->bqhd", p, vv)

    def ours(q, k, v):
        return fused_attention(q, k, v, dropout_rate=rate, rng=key)

    _close(jax.jit(ours)(q, k, v), jax.jit(direct)(q, k, v))
    for got, exp in zip(_grads(ours, q, k, v, g), _grads(direct, q, k, v, g), strict=True):
        _close(got, exp, scale=4.0)


# ----------------------------------------------------------------------------------------------
# jit, vmap
# ----------------------------------------------------------------------------------------------


def test_jit_and_grad_under_jit():
    q, k, v, g = _qkv(7, hq=4, hk=2)
    bias = _bias("heads", 2, 4, 16, 16)
    f = jax.jit(lambda q, k, v, bias: fused_attention(q, k, v, bias=bias, mask_type="causal"))
    _close(f(q, k, v, bias), fused_attention(q, k, v, bias=bias, mask_type="causal"))
    gj = jax.jit(lambda *a: _grads(lambda q, k, v, bb: fused_attention(q, k, v, bias=bb, mask_type="causal"), *a))(
        q, k, v, g, bias
    )
    ge = _grads(lambda q, k, v, bb: fused_attention(q, k, v, bias=bb, mask_type="causal"), q, k, v, g, bias)
    for a, e in zip(gj, ge, strict=True):
        _close(a, e)


@pytest.mark.parametrize("with_bias", [None, "batched", "shared"])
def test_vmap_matches_loop(with_bias):
    n = 3
    qs, ks, vs, gs = zip(*[_qkv(10 + i, b=2, sq=8, sk=8, hq=4, hk=2, d=16) for i in range(n)], strict=True)
    q, k, v, g = (jnp.stack(x) for x in (qs, ks, vs, gs))
    lens = jnp.array([[8, 5], [3, 8], [6, 6]], jnp.int32)
    if with_bias == "batched":
        bias = jax.random.normal(jax.random.key(1), (n, 1, 4, 8, 8))
        in_axes_bias = 0
    elif with_bias == "shared":
        bias = jax.random.normal(jax.random.key(1), (2, 4, 8, 8))
        in_axes_bias = None
    else:
        bias, in_axes_bias = None, None

    def f(q, k, v, lens_, bb):
        return fused_attention(q, k, v, bias=bb, mask_type="padding_causal", q_seqlens=lens_, kv_seqlens=lens_)

    out = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, in_axes_bias)))(q, k, v, lens, bias)
    fj = jax.jit(f)
    for i in range(n):
        bi = None if bias is None else (bias[i] if in_axes_bias == 0 else bias)
        _close(out[i], fj(q[i], k[i], v[i], lens[i], bi))

    def loss(q, k, v, bb):
        o = jax.vmap(f, in_axes=(0, 0, 0, 0, in_axes_bias))(q, k, v, lens, bb)
        return jnp.sum(o * g)

    argn = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    grads = jax.jit(jax.grad(loss, argnums=argn))(q, k, v, bias)
    for i in range(n):
        bi = None if bias is None else (bias[i] if in_axes_bias == 0 else bias)

        def li(q, k, v, bb, i=i):
            return jnp.sum(f(q, k, v, lens[i], bb) * g[i])

        gi = jax.jit(jax.grad(li, argnums=argn))(q[i], k[i], v[i], bi)
        for a, e in zip(grads[:3], gi[:3], strict=True):
            _close(a[i], e, scale=4.0)
        if with_bias == "batched":
            _close(grads[3][i], gi[3], scale=4.0)
    if with_bias == "shared":
        gb = jax.jit(jax.grad(lambda bb, q, k, v, ln, g: jnp.sum(f(q, k, v, ln, bb) * g)))
        total = sum(gb(bias, q[i], k[i], v[i], lens[i], g[i]) for i in range(n))
        _close(grads[3], total, scale=4.0)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,shapes,match",
    [
        ({}, dict(d=12), r"multiple of 8 and at most 256, got 12"),
        ({}, dict(d=264), r"at most 256, got 264"),
        ({}, dict(hq=6, hk=4), r"Hq=6 must be a multiple of .*Hk=4"),
        ({}, dict(k_b=3), r"batch sizes differ"),
        ({}, dict(v_dtype=jnp.bfloat16), r"share one dtype"),
        (dict(mask_type="causal", q_seqlens=jnp.array([4, 4])), {}, r"mask_type='padding_causal'"),
        (dict(mask_type="padding"), {}, r"needs q_seqlens and/or kv_seqlens"),
        (
            dict(
                mask_type="padding",
                q_seqlens=jnp.array([4, 4]),
                q_segment_ids=jnp.zeros((2, 8), jnp.int32),
                kv_segment_ids=jnp.zeros((2, 8), jnp.int32),
            ),
            {},
            r"segment ids cannot be combined",
        ),
        (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32)), {}, r"must be given together"),
        (dict(dropout_rate=0.1), {}, r"needs rng="),
        (dict(dropout_rate=1.0, rng=jax.random.key(0)), {}, r"dropout_rate must be in \[0.0, 1.0\)"),
        (dict(mask_type="banana"), {}, r"mask_type must be one of"),
        (dict(window_size=(1, -3)), {}, r"window_size must be None or \(left, right\)"),
        (dict(bias=jnp.zeros((2, 4, 7, 8))), {}, r"does not broadcast"),
        (
            dict(mask_type="padding", q_seqlens=jnp.array([4.0, 4.0])),
            {},
            r"q_seqlens must be an integer array",
        ),
    ],
)
def test_errors(kwargs, shapes, match):
    d = shapes.get("d", 16)
    q = jnp.zeros((2, 8, shapes.get("hq", 4), d))
    k = jnp.zeros((shapes.get("k_b", 2), 8, shapes.get("hk", 4), d))
    v = jnp.zeros((shapes.get("k_b", 2), 8, shapes.get("hk", 4), d), shapes.get("v_dtype", F32))
    with pytest.raises((ValueError, TypeError), match=match):
        fused_attention(q, k, v, **kwargs)


def test_native_requested_on_cpu_raises_with_reason():
    q, k, v, _ = _qkv(0, dtype=jnp.bfloat16)
    with pytest.raises(registry.ImplementationUnavailableError, match="fused_attention"):
        fused_attention(q, k, v, implementation="native")


def test_default_on_cpu_is_reference():
    q, k, v, _ = _qkv(0)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda *a: fused_attention(*a, mask_type="causal"))(q, k, v)),
        np.asarray(jax.jit(lambda *a: fused_attention(*a, mask_type="causal", implementation="reference"))(q, k, v)),
    )


# ----------------------------------------------------------------------------------------------
# Sharding over batch and heads on 8 CPU devices
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mha_causal", "gqa_padding_bias", "segments_window", "dropout"])
def test_sharded_matches_unsharded_without_collectives(case):
    mesh = cpu_mesh((2, 4), ("data", "model"))
    b, s, hq, hk, d = 4, 16, 8, 4 if case.startswith("gqa") else 8, 16
    q, k, v, g = _qkv(20, b=b, sq=s, sk=s, hq=hq, hk=hk, d=d)
    kw: dict = {}
    extra, extra_specs = [], []
    if case == "mha_causal":
        kw = dict(mask_type="causal")
    elif case == "gqa_padding_bias":
        kw = dict(mask_type="padding_causal")
        extra = [jnp.array([16, 9, 4, 12], jnp.int32), _bias("full", b, hq, s, s)]
        extra_specs = [PS("data"), PS("data", "model")]
    elif case == "segments_window":
        seg = jnp.repeat(jnp.array([[1, 2, 3, 4]] * b, jnp.int32), 4, axis=1)
        extra = [seg]
        extra_specs = [PS("data")]
        kw = dict(window_size=(3, 1))
    elif case == "dropout":
        kw = dict(dropout_rate=0.2, rng=jax.random.key(5))

    def fn(q, k, v, g, *ex):
        def f(q, k, v, *ex):
            kwargs = dict(kw)
            if case == "gqa_padding_bias":
                kwargs.update(q_seqlens=ex[0], kv_seqlens=ex[0], bias=ex[1])
            elif case == "segments_window":
                kwargs.update(q_segment_ids=ex[0], kv_segment_ids=ex[0])
            return fused_attention(q, k, v, **kwargs)

        out = f(q, k, v, *ex)
        argn = (0, 1, 2, 4) if case == "gqa_padding_bias" else (0, 1, 2)
        grads = jax.grad(lambda *a: jnp.sum(f(*a) * g), argnums=argn)(q, k, v, *ex)
        return out, grads

    spec = PS("data", None, "model", None)
    sharded, unsharded, counts = run_sharded(
        fn, [q, k, v, g, *extra], [spec, spec, spec, spec, *extra_specs], mesh=mesh
    )
    assert sum(counts.values()) == 0, counts
    for a, e in zip(jax.tree.leaves(sharded), jax.tree.leaves(unsharded), strict=True):
        _close(a, e, scale=2.0, msg=case)


def test_count_collectives_helper_sees_hlo():
    assert count_collectives("%x = f32[] all-reduce(%y)")["all-reduce"] == 1


# ----------------------------------------------------------------------------------------------
# The Python glue of the native path (te_ops/fused_attention/native.py) against an emulation of the
# cuDNN handlers' contract: cuDNN mask attributes, rows/keys it may leave undefined (NaN here).
# ----------------------------------------------------------------------------------------------


def _emulated_ffi_call(target, result_shapes, *args, **attrs):

    lb, rb = int(attrs["left_bound"]), int(attrs["right_bound"])
    scale, padding, has_bias = float(attrs["scale"]), int(attrs["padding"]), int(attrs["has_bias"])
    assert float(attrs["dropout"]) == 0.0
    if target == "te_fused_attention_fwd":
        q, k, v, bias, ql, kl, _seed = args
    else:
        q, k, v, out, g, lse, bias, ql, kl, _seed = args
    b, s_q, hq, _ = q.shape
    s_k = k.shape[1]
    br = int(attrs["bottom_right"])
    assert not (br and has_bias and (lb >= 0 or rb >= 0)), "cuDNN's bottom-right band takes no bias"
    i, j = jnp.arange(s_q)[:, None], jnp.arange(s_k)[None]
    if br and (lb >= 0 or rb >= 0):  # BOTTOM_RIGHT: query i sits at key i + (Sk - Sq), per batch with padding
        i = i + ((kl - ql)[:, None, None, None] if padding else s_k - s_q)
    keep = jnp.ones((1, 1, s_q, s_k), bool)
    if rb >= 0:
        keep = keep & (j <= i + rb)
    if lb >= 0:
        keep = keep & (j > i - lb)
    rows_ok = jnp.ones((b, s_q), bool)
    cols_ok = jnp.ones((b, s_k), bool)
    if padding:
        rows_ok, cols_ok = jnp.arange(s_q)[None] < ql[:, None], jnp.arange(s_k)[None] < kl[:, None]
        keep = keep & (rows_ok[:, :, None] & cols_ok[:, None, :])[:, None]
    kk, vv = (jnp.repeat(x, hq // k.shape[2], 2).astype(F32) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(F32), kk) * scale
    if has_bias:
        s = s + bias.astype(F32)
    s = jnp.where(keep, s, -jnp.inf)
    nan = jnp.float32(jnp.nan)
    if target == "te_fused_attention_fwd":
        lse_ = jax.nn.logsumexp(s, -1)  # fully masked rows: -inf, and p = NaN below (undefined)
        p = jnp.exp(s - lse_[..., None])
        o = jnp.einsum("bhqk,bkhd->bqhd", p, vv)
        o = jnp.where(rows_ok[:, :, None, None], o, nan)  # padded rows unwritten
        return o.astype(q.dtype), lse_, jnp.zeros(result_shapes[2].shape, jnp.uint8)
    p = jnp.exp(s - lse[..., None])
    gf = g.astype(F32)
    dp = jnp.einsum("bqhd,bkhd->bhqk", gf, vv)
    delta = jnp.einsum("bqhd,bqhd->bhq", gf, out.astype(F32))[..., None]
    ds = p * (dp - delta)
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    grp = hq // k.shape[2]
    dk = (jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(F32)) * scale).reshape(b, s_k, k.shape[2], grp, -1).sum(3)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, gf).reshape(b, s_k, k.shape[2], grp, -1).sum(3)
    dk = jnp.where(cols_ok[:, :, None, None], dk, nan)  # padded keys unwritten
    dv = jnp.where(cols_ok[:, :, None, None], dv, nan)
    dbias = jnp.zeros(result_shapes[3].shape, F32)
    if int(attrs["need_dbias"]):
        dsb, seen = jnp.where(keep, ds, 0.0), jnp.broadcast_to(keep, ds.shape)
        if bias.shape[0] == 1:
            dsb, seen = dsb.sum(0, keepdims=True), seen.any(0, keepdims=True)
        if bias.shape[1] == 1:
            dsb, seen = dsb.sum(1, keepdims=True), seen.any(1, keepdims=True)
        dbias = jnp.where(seen, dsb, nan)  # positions no batch/head sees: unwritten
    return (
        dq.astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        dbias.astype(result_shapes[3].dtype),
        jnp.zeros(result_shapes[4].shape, jnp.uint8),
    )


GLUE_CASES = {
    "causal_gqa": dict(mask_type="causal", hk=2),
    "causal_sk_gt_sq": dict(mask_type="causal", sk=24),
    "padding_causal_bias_heads": dict(mask_type="padding_causal", lens=True, bias="heads"),
    "padding_bias_full": dict(mask_type="padding", lens=True, bias="full"),
    "window": dict(window=(3, 1)),
    "window_causal_sq_gt_sk": dict(window=(2, -1), mask_type="causal", sk=8),
    "segments": dict(segments=True),
    "segments_causal_bias_heads": dict(segments=True, mask_type="causal", bias="heads"),
}


@pytest.mark.parametrize("case", sorted(GLUE_CASES))
def test_native_glue_with_emulated_cudnn(case, monkeypatch):
    from te_ops._core import native as core_native
    from te_ops.fused_attention import native as nat

    monkeypatch.setattr(core_native, "ffi_call", _emulated_ffi_call)
    monkeypatch.setattr(nat, "query", lambda ints, scale, dropout: (None, 256))
    c = dict(GLUE_CASES[case])
    b, sq, sk, hq, hk, d = 2, 16, c.pop("sk", 16), 4, c.pop("hk", 4), 16
    q, k, v, g = _qkv(30, b, sq, sk, hq, hk, d, dtype=jnp.float16)
    mask_type, window = c.pop("mask_type", "none"), c.pop("window", None)
    bias = _bias(c.pop("bias"), b, hq, sq, sk).astype(jnp.float16) if "bias" in c else None
    ql = kl = qs = ks = None
    if c.pop("lens", False):
        ql, kl = jnp.array([sq, 5], jnp.int32), jnp.array([3, sk], jnp.int32)
    if c.pop("segments", False):
        qs = ks = jnp.array([[1] * 5 + [2] * 6 + [3] * 5, [4] * 16], jnp.int32)[:, :sq]
        ks = jnp.array([[1] * 5 + [2] * 6 + [3] * 5, [4] * 16], jnp.int32)[:, :sk]
    assert not c
    statics = dict(mask_type=mask_type, window=window, scale=0.25, dropout_rate=0.0)
    args = (q, k, v, bias, ql, kl, qs, ks, None)
    # Our sharding rule wraps the glue in custom_partitioning, which rejects closed-over constants
    # (an H200 run failed on exactly that for causal with Sq < Sk).
    consts = jax.make_jaxpr(lambda *a: nat.forward(*a, **statics))(*args).consts
    consts += jax.make_jaxpr(lambda *a: nat.forward(*a, **statics, need_stats=False))(*args).consts
    assert not consts, f"{case}: the native glue closes over constants {[getattr(c, 'shape', c) for c in consts]}"
    out_n, res_n = jax.jit(lambda *a: nat.forward(*a, **statics))(*args)
    out_r, res_r = jax.jit(lambda *a: ref.forward(*a, **statics))(*args)
    _close(out_n, out_r, jnp.float16, msg=case)
    out_i, _ = jax.jit(lambda *a: nat.forward(*a, **statics, need_stats=False))(*args)  # inference graph
    _close(out_i, out_r, jnp.float16, msg=case)
    fin = np.isfinite(np.asarray(res_r.lse))
    np.testing.assert_array_equal(fin, np.isfinite(np.asarray(res_n.lse)))
    _close(jnp.where(fin, res_n.lse, 0), jnp.where(fin, res_r.lse, 0), jnp.float16, msg=case)
    assert not jax.make_jaxpr(lambda r, g: nat.backward(r, g, **statics))(res_n, g).consts, case
    grads_n = jax.jit(lambda r, g: nat.backward(r, g, **statics))(res_n, g)
    grads_r = jax.jit(lambda r, g: ref.backward(r, g, **statics))(res_r, g)
    for gn, gr in zip(grads_n, grads_r, strict=True):
        if gr is None:
            assert gn is None
            continue
        _close(gn, gr, jnp.float16, scale=8.0, msg=case)


# ----------------------------------------------------------------------------------------------
# deterministic=: lowered for CUDA on this CPU machine (nothing runs), the native backward's FFI call
# carries the attribute, and the support query asks cuDNN for the same backward graph.
# ----------------------------------------------------------------------------------------------


def _lower_native_grad(monkeypatch, seq, **kw):
    import re

    from te_ops._core import native as core_native
    from te_ops.fused_attention import native as nat

    monkeypatch.setattr(core_native, "cuda_device_unavailable_reason", lambda: None)
    monkeypatch.setattr(core_native, "native_unavailable_reason", lambda name="_native", op=None: None)
    monkeypatch.setattr(core_native, "ensure_registered", lambda: None)
    asked = []
    monkeypatch.setattr(nat, "query", lambda ints, scale, dropout: asked.append(ints) or (None, 256))
    # each variant its own shape: jax caches traces of the op's inner functions per shape
    q, k, v, _ = _qkv(50, b=2, sq=seq, sk=seq, hq=4, hk=2, d=16, dtype=jnp.bfloat16)

    def loss(q, k, v):
        out = fused_attention(q, k, v, mask_type="causal", implementation="native", **kw)
        return jnp.sum(out.astype(F32))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    calls = {}
    for line in text.splitlines():
        m = re.search(r"(te_fused_attention_(?:fwd|bwd))", line)
        if m and "custom_call" in line:
            calls.setdefault(m.group(1), []).append(line)
    assert set(calls) == {"te_fused_attention_fwd", "te_fused_attention_bwd"}, sorted(calls)
    (bwd,) = calls["te_fused_attention_bwd"]
    found = re.findall(r"deterministic = (-?\d+) : i32", bwd)
    assert len(found) == 1, bwd
    assert not any("deterministic" in line for line in calls["te_fused_attention_fwd"])
    backward_asks = {ints[-1] for ints in asked if ints[2] == 1}
    return int(found[0]), backward_asks


@pytest.mark.parametrize(
    "deterministic, xla_flags, expected, seq",  # each case its own Sq: jax caches the op's inner traces
    [
        (True, None, 1, 8),
        (False, None, 0, 16),
        (None, None, 0, 24),
        (None, "--xla_gpu_autotune_level=0 --xla_gpu_deterministic_ops=true", 1, 32),
        (None, "--xla_gpu_exclude_nondeterministic_ops=true", 1, 40),
        (None, "--xla_gpu_deterministic_ops=false", 0, 48),
        (None, "--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", 0, 56),
        (False, "--xla_gpu_deterministic_ops=true", 0, 64),  # an explicit bool wins over the flag
    ],
    ids=[
        "true",
        "false",
        "none_no_flag",
        "none_flag",
        "none_exclude_flag",
        "none_flag_false",
        "none_last_wins",
        "false_over_flag",
    ],  # fmt: skip
)
def test_native_backward_lowering_carries_deterministic(monkeypatch, deterministic, xla_flags, expected, seq):
    if xla_flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", xla_flags)
    attr, asks = _lower_native_grad(monkeypatch, seq, deterministic=deterministic)
    assert attr == expected
    assert asks == {expected}  # the support query asked for the backward graph that runs


@pytest.mark.parametrize("bad", [1, 0, "true", np.True_, np.array(True), jnp.array(True)], ids=repr)
def test_deterministic_must_be_bool_or_none(bad):
    q, k, v, _ = _qkv(51, b=1, sq=8, sk=8, hq=2, hk=2, d=16)
    with pytest.raises(TypeError, match="deterministic must be a Python bool or None"):
        fused_attention(q, k, v, deterministic=bad)


def test_deterministic_leaves_reference_values_unchanged():
    q, k, v, g = _qkv(52, b=2, sq=16, sk=16, hq=4, hk=2, d=16)
    fns = [
        lambda q, k, v, d=d: fused_attention(q, k, v, mask_type="causal", implementation="reference", deterministic=d)
        for d in (True, False)
    ]
    for a, b in zip(_grads(fns[0], q, k, v, g), _grads(fns[1], q, k, v, g), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_vmap_over_dropout_keys_matches_loop():
    q, k, v, _ = _qkv(40, b=2, sq=8, sk=8, hq=2, hk=2, d=16)
    keys = jax.random.split(jax.random.key(9), 3)
    f = jax.jit(lambda key: fused_attention(q, k, v, dropout_rate=0.3, rng=key))
    out = jax.jit(jax.vmap(lambda key: fused_attention(q, k, v, dropout_rate=0.3, rng=key)))(keys)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(f(keys[i])), rtol=1e-6, atol=1e-6)
