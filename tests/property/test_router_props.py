"""MoE router ops against a numpy formulation of docs/semantics.md ("Router"): score functions,
pre-softmax, expert bias, grouped selection, ties (to the smaller expert index), scaling, packed
maps; forward and hand-derived backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import te_ops
from tests.property._common import as64, check_close, float_dtypes, fuzz, seeds, sigmoid, size

IMPL = "reference"


def _logits(rng, t, e, dtype, ties: bool):
    """Logits on a coarse grid (many exact ties) or continuous; returned as (jnp, float64)."""
    v = rng.integers(-6, 7, (t, e)) / 2.0 if ties else 2.0 * rng.standard_normal((t, e))
    v = np.asarray(jnp.asarray(v, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)
    return jnp.asarray(v, jnp.float32).astype(dtype), v


def _softmax(z, axis=-1):
    z = z - z.max(axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis, keepdims=True)


def _top(scores_row, k, allowed=None):
    """Indices of the k highest scores; equal scores go to the smaller index (stable sort)."""
    s = scores_row if allowed is None else np.where(allowed, scores_row, -np.inf)
    return np.argsort(-s, kind="stable")[:k]


def np_router(l64, topk, score_function, pre, num_groups, group_topk, sf, bias64):
    t, e = l64.shape
    probs = np.zeros((t, e))
    rmap = np.zeros((t, e), bool)
    chosen_all = []
    for i in range(t):
        row = l64[i]
        if score_function == "sigmoid":
            s = sigmoid(row)
        else:
            s = _softmax(row) if pre else row
        sel = s + (bias64 if bias64 is not None else 0.0)
        allowed = None
        if group_topk is not None:
            per = e // num_groups
            best = topk // group_topk
            gscore = [np.sort(sel[j * per : (j + 1) * per])[::-1][:best].sum() for j in range(num_groups)]
            groups = np.argsort(-np.asarray(gscore), kind="stable")[:group_topk]
            allowed = np.zeros(e, bool)
            for j in groups:
                allowed[j * per : (j + 1) * per] = True
        c = _top(sel, topk, allowed)
        if score_function == "softmax":
            w = s[c] if pre else _softmax(row[c])
        else:
            w = s[c] if topk == 1 else s[c] / (s[c].sum() + 1e-20)
        probs[i, c] = sf * w
        rmap[i, c] = True
        chosen_all.append(c)
    return probs, rmap, chosen_all


def np_router_grad(l64, chosen_all, g64, topk, score_function, pre, sf):
    dl = np.zeros_like(l64)
    for i, c in enumerate(chosen_all):
        row, gc = l64[i], g64[i, c]
        if score_function == "softmax" and not pre:
            w = _softmax(row[c])
            dl[i, c] = sf * w * (gc - (w * gc).sum())
        elif score_function == "softmax":
            p = _softmax(row)
            gf = np.zeros_like(row)
            gf[c] = gc
            dl[i] = sf * p * (gf - (p * gf).sum())
        else:
            s = sigmoid(row[c])
            ds = s * (1.0 - s)
            if topk == 1:
                dl[i, c] = sf * gc * ds
            else:
                den = s.sum() + 1e-20
                dl[i, c] = sf * ds * (gc / den - (gc * s).sum() / den**2)
    return dl


@st.composite
def router_config(draw):
    e = draw(size(64, sizes=(1, 2, 3, 7, 8, 16, 31, 64)), label="E")
    topk = draw(st.integers(1, min(e, 8)), label="topk")
    score_function = draw(st.sampled_from(["softmax", "sigmoid"]), label="score_function")
    grouped = draw(st.booleans(), label="grouped")
    num_groups = group_topk = None
    if grouped:
        options = [
            (ng, gt)
            for ng in range(1, e + 1)
            if e % ng == 0
            for gt in range(1, ng + 1)
            if topk % gt == 0 and topk // gt <= e // ng
        ]
        num_groups, group_topk = draw(st.sampled_from(options), label="(num_groups, group_topk)")
    return e, topk, score_function, num_groups, group_topk


# The strategies of each test, importable: tests/gpu/test_property_gpu.py draws from them too.
TOPK_ARGS = dict(
    cfg=router_config(),
    t=size(33, min_size=0, sizes=(0, 1, 2, 5, 17, 33)),
    pre=st.booleans(),
    with_bias=st.booleans(),
    sf=st.sampled_from([1.0, 2.5, 0.0]),
    compact=st.booleans(),
    ties=st.booleans(),
    dtype=float_dtypes,
    seed=seeds,
)


@fuzz(40)
@given(**TOPK_ARGS)
def test_fused_topk_with_score_function(cfg, t, pre, with_bias, sf, compact, ties, dtype, seed):
    e, topk, score_function, num_groups, group_topk = cfg
    # Group scores that tie are not ordered by the spec: use continuous logits with grouped selection.
    ties = ties and group_topk is None
    rng = np.random.default_rng(seed)
    x, l64 = _logits(rng, t, e, dtype, ties)
    bias = bias64 = None
    if with_bias and score_function == "sigmoid":
        bias64 = rng.integers(-2, 3, (e,)) / 4.0 if ties else 0.1 * rng.standard_normal(e)
        bias64 = np.asarray(np.float32(bias64), np.float64)
        bias = jnp.asarray(bias64, jnp.float32)

    def fn(a):
        return te_ops.fused_topk_with_score_function(
            a,
            topk,
            score_function=score_function,
            use_pre_softmax=pre,
            num_groups=num_groups,
            group_topk=group_topk,
            scaling_factor=sf,
            expert_bias=bias,
            compact_routing_map=compact,
            implementation=IMPL,
        )

    (probs, rmap), vjp = jax.vjp(fn, x)
    p_exp, m_exp, chosen = np_router(l64, topk, score_function, pre, num_groups, group_topk, sf, bias64)
    assert probs.dtype == jnp.dtype(dtype) and probs.shape == (t, e)
    m = np.asarray(rmap)
    if compact:
        assert m.dtype == np.uint8 and m.shape == (t, -(-e // 8))
        np.testing.assert_array_equal(m, np.packbits(m_exp, axis=-1, bitorder="little"))
    else:
        np.testing.assert_array_equal(m, m_exp, err_msg="routing map (ties to the smaller expert index)")
    assert np.all(as64(probs)[~m_exp] == 0), "probs must be exactly 0 off the chosen experts"
    check_close(probs, p_exp, dtype, what="router probs")

    g = jnp.asarray(rng.standard_normal((t, e)), jnp.float32).astype(dtype)
    cot_map = np.zeros(m.shape, jax.dtypes.float0)
    (dl,) = vjp((g, cot_map))
    dl_exp = np_router_grad(l64, chosen, as64(g), topk, score_function, pre and score_function == "softmax", sf)
    check_close(dl, dl_exp, dtype, what="router dlogits")


AUX_SCORES_ARGS = dict(
    e=size(64, sizes=(1, 2, 3, 7, 8, 31, 64)),
    t=size(33, min_size=0, sizes=(0, 1, 2, 5, 33)),
    k_frac=st.floats(0, 1),
    score_function=st.sampled_from(["softmax", "sigmoid"]),
    ties=st.booleans(),
    dtype=float_dtypes,
    seed=seeds,
)


@fuzz(30)
@given(**AUX_SCORES_ARGS)
def test_compute_routing_scores_for_aux_loss(e, t, k_frac, score_function, ties, dtype, seed):
    topk = max(1, min(e, int(round(k_frac * e))))
    rng = np.random.default_rng(seed)
    x, l64 = _logits(rng, t, e, dtype, ties)
    fn = lambda a: te_ops.compute_routing_scores_for_aux_loss(  # noqa: E731
        a, topk, score_function=score_function, implementation=IMPL
    )
    (rmap, scores), vjp = jax.vjp(fn, x)
    if score_function == "softmax":
        s = _softmax(l64) if t else np.zeros((0, e))
    else:
        sg = sigmoid(l64)
        s = sg / (sg.sum(-1, keepdims=True) + 1e-20)
    m_exp = np.zeros((t, e), bool)
    for i in range(t):
        m_exp[i, _top(l64[i], topk)] = True  # both score functions are increasing in the logit
    np.testing.assert_array_equal(np.asarray(rmap), m_exp, err_msg="aux-loss routing map")
    check_close(scores, s, dtype, what="aux-loss scores")

    g = jnp.asarray(rng.standard_normal((t, e)), jnp.float32).astype(dtype)
    (dl,) = vjp((np.zeros((t, e), jax.dtypes.float0), g))
    g64 = as64(g)
    if score_function == "softmax":
        dl_exp = s * (g64 - (s * g64).sum(-1, keepdims=True))
    else:
        ds = sg * (1 - sg)
        den = sg.sum(-1, keepdims=True) + 1e-20
        dl_exp = ds * (g64 / den - (g64 * sg).sum(-1, keepdims=True) / den**2)
    check_close(dl, dl_exp, dtype, what="aux-loss scores dlogits")


AUX_LOSS_ARGS = dict(
    e=size(64, min_size=0, sizes=(0, 1, 2, 7, 64)),
    t=size(64, min_size=0, sizes=(0, 1, 3, 64)),
    topk=st.integers(1, 8),
    coeff=st.sampled_from([1e-2, 1.0, 0.0, -0.5]),
    tpe_dtype=st.sampled_from([np.int32, np.float32]),
    dtype=float_dtypes,
    seed=seeds,
)


@fuzz(25)
@given(**AUX_LOSS_ARGS)
def test_fused_moe_aux_loss(e, t, topk, coeff, tpe_dtype, dtype, seed):
    rng = np.random.default_rng(seed)
    p64 = np.asarray(jnp.asarray(rng.random((t, e)), jnp.float32).astype(dtype).astype(jnp.float32), np.float64)
    probs = jnp.asarray(p64, jnp.float32).astype(dtype)
    tpe = rng.integers(0, 3 * max(t, 1), (e,)).astype(tpe_dtype)
    loss, vjp = jax.vjp(
        lambda p: te_ops.fused_moe_aux_loss(p, jnp.asarray(tpe), topk=topk, coeff=coeff, implementation=IMPL), probs
    )
    c = e * coeff / (topk * t * t) if t else 0.0
    exp = c * (p64.sum(0) * tpe.astype(np.float64)).sum() if t and e else 0.0
    assert loss.shape == () and loss.dtype == jnp.dtype(dtype)
    check_close(loss, exp, dtype, what="aux loss")
    (dp,) = vjp(jnp.asarray(1.0, dtype))
    check_close(dp, np.broadcast_to(c * tpe.astype(np.float64), (t, e)), dtype, what="aux loss dprobs")
