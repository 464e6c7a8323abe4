"""token_dispatch / token_combine / sort_chunks_by_index against a numpy formulation of
docs/semantics.md ("Token permutation"): capacity and dropping, align_size padding, row_id_map
layout, empty experts, every token on one expert, zero-size axes; forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import te_ops
from tests.property._common import as64, check_close, float_dtypes, fuzz, rand, seeds, size

IMPL = "reference"


def np_dispatch(rmap, num_out_tokens, align):
    """The capacity rule of the spec. Returns N, the (t, e) -> row dict, tokens_per_expert,
    pad_offsets, num_dropped and row_id_map."""
    t, e = rmap.shape
    a = align or 1
    n = num_out_tokens if align is None else ((num_out_tokens + e * (a - 1)) // a) * a
    c = rmap.sum(0).astype(np.int64)
    p = -(-c // a) * a
    start = np.cumsum(p) - p  # exclusive prefix sums
    room = np.maximum(n - start, 0)
    kept = np.minimum(c, room)
    tpe = np.minimum(p, room)
    pad = np.cumsum(tpe - kept) - (tpe - kept)
    dropped = int((c - kept).sum())
    rows = {}
    for ex in range(e):
        toks = np.nonzero(rmap[:, ex])[0]
        for r, tok in enumerate(toks[: kept[ex]]):
            rows[(int(tok), ex)] = int(start[ex] + r)
    rid = np.zeros((t, 2 * e + 1), np.int64)
    for tok in range(t):
        kept_e = [ex for ex in range(e) if (tok, ex) in rows]
        other = [ex for ex in range(e) if (tok, ex) not in rows]
        nt = len(kept_e)
        rid[tok, :nt] = [rows[(tok, ex)] for ex in kept_e]
        rid[tok, nt:e] = [-2 if rmap[tok, ex] else -1 for ex in other]
        rid[tok, e : 2 * e] = kept_e + other
        rid[tok, 2 * e] = nt
    return n, rows, tpe, pad, dropped, rid


@st.composite
def routing(draw):
    t = draw(size(48, min_size=0, sizes=(0, 1, 2, 5, 13, 48)), label="T")
    e = draw(size(16, min_size=0, sizes=(0, 1, 2, 3, 8, 16)), label="E")
    kind = draw(st.sampled_from(["density", "topk", "one_expert", "empty_experts"]), label="routing")
    rng = np.random.default_rng(draw(seeds, label="map seed"))
    if e == 0:
        return np.zeros((t, 0), bool), 1
    if kind == "one_expert":
        m = np.zeros((t, e), bool)
        m[:, draw(st.integers(0, e - 1))] = True
        return m, 1
    if kind == "topk":
        k = draw(st.integers(1, e))
        m = np.zeros((t, e), bool)
        for i in range(t):
            m[i, rng.choice(e, k, replace=False)] = True
        return m, k
    m = rng.random((t, e)) < draw(st.sampled_from([0.0, 0.2, 0.5, 1.0]))
    if kind == "empty_experts":
        m[:, rng.random(e) < 0.5] = False
    return m, max(1, int(m.sum(1).max(initial=0)))


# The strategies of each test, importable: tests/gpu/test_property_gpu.py draws from them too.
CAPACITIES = ("exact", "short", "long", "zero")
DISPATCH_ARGS = dict(
    rk=routing(),
    h=size(64, min_size=0, sizes=(0, 1, 3, 7, 64)),
    align=st.sampled_from([None, None, 1, 2, 8, 16]),
    with_probs=st.booleans(),
    dtype=float_dtypes,
    seed=seeds,
)


@pytest.mark.parametrize("capacity", CAPACITIES)
@fuzz(7)
@given(**DISPATCH_ARGS)
def test_token_dispatch_and_combine(capacity, rk, h, align, with_probs, dtype, seed):
    rmap, topk = rk
    t, e = rmap.shape
    rng = np.random.default_rng(seed)
    routed = int(rmap.sum())
    num_out = {"exact": t * topk, "short": routed // 2, "long": routed + 5, "zero": 0}[capacity]
    x, x64 = rand(rng, (t, h), dtype)
    probs, p64 = rand(rng, (t, e), jnp.float32) if with_probs else (None, None)

    def dispatch(a, p):
        r = te_ops.token_dispatch(a, jnp.asarray(rmap), num_out, probs=p, align_size=align, implementation=IMPL)
        return (r.out, r.permuted_probs), r

    (out, pprobs), vjp, res = jax.vjp(dispatch, x, probs, has_aux=True)
    n, rows, tpe, pad, dropped, rid = np_dispatch(rmap, num_out, align)
    out_exp = np.zeros((n, h))
    pp_exp = np.zeros((n,))
    for (tok, ex), r in rows.items():
        out_exp[r] = x64[tok]
        if with_probs:
            pp_exp[r] = p64[tok, ex]
    assert out.shape == (n, h) and out.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(as64(out), out_exp, err_msg="dispatched rows (bit-exact copies, zero elsewhere)")
    if with_probs:
        np.testing.assert_array_equal(as64(pprobs), pp_exp, err_msg="permuted_probs")
    else:
        assert res.permuted_probs is None
    np.testing.assert_array_equal(np.asarray(res.row_id_map), rid, err_msg="row_id_map")
    np.testing.assert_array_equal(np.asarray(res.tokens_per_expert), tpe, err_msg="tokens_per_expert")
    assert int(res.num_dropped) == dropped, f"num_dropped {int(res.num_dropped)} != {dropped}"
    if align is None:
        assert res.pad_offsets is None
    else:
        np.testing.assert_array_equal(np.asarray(res.pad_offsets), pad, err_msg="pad_offsets")
    assert int(np.sum(tpe)) <= n

    # Dispatch backward: dx[t] = sum of the gradient rows of t's kept pairs; dprobs at the pair's row.
    gy, gy64 = rand(rng, (n, h), dtype)
    gp, gp64 = rand(rng, (n,), jnp.float32) if with_probs else (None, None)
    dx, dp = vjp((gy, gp))
    dx_exp = np.zeros((t, h))
    dp_exp = np.zeros((t, e))
    for (tok, ex), r in rows.items():
        dx_exp[tok] += gy64[r]
        if with_probs:
            dp_exp[tok, ex] = gp64[r]
    check_close(dx, dx_exp, dtype, what="token_dispatch dx")
    if with_probs:
        np.testing.assert_array_equal(as64(dp), dp_exp, err_msg="token_dispatch dprobs")

    # Combine (with and without weights) reads only the kept rows; unread rows hold garbage here.
    y, y64 = rand(rng, (n, h), dtype)
    mp, mp64 = rand(rng, (t, e), jnp.float32)
    rid_j = res.row_id_map
    for weighted in (False, True):

        def combine(yy, m, weighted=weighted):
            return te_ops.token_combine(yy, rid_j, merging_probs=m if weighted else None, implementation=IMPL)

        c, cvjp = jax.vjp(combine, y, mp)
        c_exp = np.zeros((t, h))
        for (tok, ex), r in rows.items():
            c_exp[tok] += y64[r] * (mp64[tok, ex] if weighted else 1.0)
        assert c.shape == (t, h) and c.dtype == jnp.dtype(dtype)
        check_close(c, c_exp, dtype, what=f"token_combine (weighted={weighted})")
        g, g64 = rand(rng, (t, h), dtype)
        dy, dmp = cvjp(g)
        dy_exp = np.zeros((n, h))
        dmp_exp = np.zeros((t, e))
        for (tok, ex), r in rows.items():
            dy_exp[r] = g64[tok] * (mp64[tok, ex] if weighted else 1.0)
            dmp_exp[tok, ex] = y64[r] @ g64[tok]
        check_close(dy, dy_exp, dtype, what=f"token_combine dy (weighted={weighted})")
        if weighted:
            check_close(dmp, dmp_exp, dtype, what="token_combine dmerging_probs")


SORT_ARGS = dict(
    n=size(64, min_size=0, sizes=(0, 1, 2, 7, 64)),
    h=size(16, min_size=0, sizes=(0, 1, 3, 16)),
    sizes=st.lists(st.integers(-3, 20), min_size=0, max_size=8),
    perm_seed=seeds,
    dtype=float_dtypes,
    seed=seeds,
)


@fuzz(25)
@given(**SORT_ARGS)
def test_sort_chunks_by_index(n, h, sizes, perm_seed, dtype, seed):
    rng = np.random.default_rng(seed)
    s = len(sizes)
    order = np.random.default_rng(perm_seed).permutation(s)
    x, x64 = rand(rng, (n, h), dtype)
    # Chunk bounds: negative sizes count as 0, chunks cut at N rows.
    ends = np.minimum(np.cumsum(np.maximum(sizes, 0)), n).astype(np.int64) if s else np.zeros(0, np.int64)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64) if s else ends
    total = int(ends[-1]) if s else 0
    src = [r for i in order for r in range(starts[i], ends[i])] + list(range(total, n))
    fn = lambda a: te_ops.sort_chunks_by_index(  # noqa: E731
        a, jnp.asarray(sizes, jnp.int32), jnp.asarray(order, jnp.int32), implementation=IMPL
    )
    (out, rid), vjp = jax.vjp(fn, x)
    out_exp = x64[np.asarray(src, np.int64)] if n else np.zeros((0, h))
    np.testing.assert_array_equal(as64(out), out_exp, err_msg="sorted chunks")
    rid_exp = np.zeros(n, np.int64)
    rid_exp[np.asarray(src, np.int64)] = np.arange(n)
    np.testing.assert_array_equal(np.asarray(rid), rid_exp, err_msg="row_id_map: out[row_id_map[i]] = x[i]")
    g, g64 = rand(rng, (n, h), dtype)
    (dx,) = vjp((g, np.zeros((n,), jax.dtypes.float0)))
    np.testing.assert_array_equal(as64(dx), g64[rid_exp] if n else np.zeros((0, h)), err_msg="sort dx")
