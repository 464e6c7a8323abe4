"""CPU tests of token_dispatch's capacity semantics (more routed pairs than rows: the expert-major
tail is dropped, every output stays consistent), empty sizes, and argument errors of the three
permutation ops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops._core.testing import assert_close
from te_ops.permutation import sort_chunks_by_index, token_combine, token_dispatch
from tests.te_ops.test_permutation import (
    check_dispatch,
    direct_combine,
    direct_dispatch,
    direct_layout,
    direct_sort,
    make_routing,
)

# (T, E, K, num_out_tokens, align_size): every case drops pairs
OVERFLOW = [(32, 8, 2, 40, None), (32, 8, 2, 40, 4), (24, 8, 3, 30, 8), (16, 8, 2, 1, None), (16, 8, 2, 0, None)]


def _inputs(t, e, k, seed, h=12):
    rm = make_routing(t, e, k, seed=seed)
    rng = np.random.default_rng(seed + 100)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    probs = jnp.asarray(rng.random((t, e)) * rm + rm * 0.1, jnp.float32)
    return rm, x, probs


@pytest.mark.parametrize("t,e,k,n0,align", OVERFLOW)
@pytest.mark.parametrize("with_probs", [False, True])
def test_overflow_drops_the_expert_major_tail(t, e, k, n0, align, with_probs):
    rm, x, probs = _inputs(t, e, k, seed=t + e + n0)
    probs = probs if with_probs else None
    res = token_dispatch(x, jnp.asarray(rm), n0, probs=probs, align_size=align)
    lay = check_dispatch(res, x, rm, probs, n0, align)
    assert lay.num_dropped > 0
    tpe = np.asarray(res.tokens_per_expert)
    assert tpe.sum() <= lay.n
    if align:
        assert (tpe % align == 0).all()
    # the blocks of tokens_per_expert hold exactly their expert's kept pairs (then zero padding)
    bounds = np.concatenate([[0], np.cumsum(tpe)])
    for ex in range(e):
        block = lay.src_e[bounds[ex] : bounds[ex + 1]]
        assert ((block == ex) | (block == -1)).all()
        assert (block == ex).sum() == (rm[:, ex] & ~lay.dropped[:, ex]).sum()
    np.testing.assert_array_equal(np.asarray(res.out)[bounds[-1] :], 0)
    # dropped pairs are the last ones of the expert-major order
    order = [(ex, tok) for ex in range(e) for tok in range(t) if rm[tok, ex]]
    flags = [lay.dropped[tok, ex] for ex, tok in order]
    assert flags == sorted(flags)


@pytest.mark.parametrize("t,e,k,n0,align", OVERFLOW[:3])
@pytest.mark.parametrize("with_probs", [False, True])
def test_combine_after_overflow_sums_kept_rows_only(t, e, k, n0, align, with_probs):
    rm, x, probs = _inputs(t, e, k, seed=2 * t + e)
    res = token_dispatch(x, jnp.asarray(rm), n0, align_size=align)
    lay = direct_layout(rm, n0, align)
    y = jax.random.normal(jax.random.PRNGKey(t + e), (lay.n, x.shape[1]))
    mp = probs if with_probs else None
    got = token_combine(y, res.row_id_map, merging_probs=mp, pad_offsets=res.pad_offsets)
    assert_close(got, direct_combine(y, mp, lay.src_t, lay.src_e, t), jnp.float32)
    # round trip: each token comes back once per kept pair
    back = token_combine(res.out, res.row_id_map)
    kept = (rm & ~lay.dropped).sum(1)
    assert_close(back, np.asarray(x) * kept[:, None], jnp.float32, scale=k)
    assert (kept < rm.sum(1)).any()


@pytest.mark.parametrize("t,e,k,n0,align", OVERFLOW[:3])
def test_overflow_gradients_are_zero_for_dropped_pairs(t, e, k, n0, align):
    rm, x, probs = _inputs(t, e, k, seed=3 * t + e)
    lay = direct_layout(rm, n0, align)
    rng = np.random.default_rng(7)
    w_rows = jnp.asarray(rng.standard_normal((lay.n, x.shape[1])), jnp.float32)
    w_pp = jnp.asarray(rng.standard_normal((lay.n,)), jnp.float32)
    rmj = jnp.asarray(rm)

    def ours(x, probs, merging):
        res = token_dispatch(x, rmj, n0, probs=probs, align_size=align)
        back = token_combine(jnp.sin(res.out) * w_rows, res.row_id_map, merging_probs=merging)
        return jnp.sum(back**2) + jnp.sum(res.permuted_probs * w_pp)

    def direct(x, probs, merging):
        out, pp = direct_dispatch(x, probs, lay.src_t, lay.src_e)
        back = direct_combine(jnp.sin(out) * w_rows, merging, lay.src_t, lay.src_e, t)
        return jnp.sum(back**2) + jnp.sum(pp * w_pp)

    merging = probs * 2.0
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(x, probs, merging)
    want = jax.grad(direct, argnums=(0, 1, 2))(x, probs, merging)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, jnp.float32, scale=10.0)
    dx, dprobs, dmerging = (np.asarray(g) for g in got)
    assert lay.dropped.any()
    np.testing.assert_array_equal(dprobs[lay.dropped], 0)
    np.testing.assert_array_equal(dmerging[lay.dropped], 0)
    assert (dprobs[rm & ~lay.dropped] != 0).any()
    lost = (rm & ~lay.dropped).sum(1) == 0  # tokens with every pair dropped get no gradient
    np.testing.assert_array_equal(dx[lost], 0)


def test_overflow_under_jit_and_vmap():
    b, t, e, k, n0 = 3, 16, 8, 2, 20
    rms = np.stack([make_routing(t, e, k, seed=s) for s in range(b)])
    xs = jax.random.normal(jax.random.PRNGKey(2), (b, t, 8))
    ps = jax.random.uniform(jax.random.PRNGKey(3), (b, t, e)) * rms

    def f(x, rm, p):
        res = token_dispatch(x, rm, n0, probs=p, align_size=2)
        return (
            res.out,
            res.permuted_probs,
            res.row_id_map,
            res.pad_offsets,
            res.tokens_per_expert,
            res.num_dropped,
            token_combine(res.out, res.row_id_map, merging_probs=p),
        )

    batched = jax.jit(jax.vmap(f))(xs, jnp.asarray(rms), ps)
    assert batched[5].shape == (b,)
    single = jax.jit(lambda x, rm, p: token_dispatch(x, rm, n0, probs=p, align_size=2))
    for i in range(b):
        check_dispatch(single(xs[i], jnp.asarray(rms[i]), ps[i]), xs[i], rms[i], ps[i], n0, 2)
        one = f(xs[i], jnp.asarray(rms[i]), ps[i])
        for got, want in zip(batched, one, strict=True):
            np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
        assert int(batched[5][i]) == direct_layout(rms[i], n0, 2).num_dropped > 0


# ----------------------------------------------------------------------------------------------
# Empty sizes: defined, zero-filled results
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "t,e,h,n0,align",
    [
        (0, 4, 8, 6, None),
        (0, 4, 8, 6, 2),
        (6, 0, 8, 6, None),
        (6, 0, 8, 6, 4),
        (6, 4, 0, 12, None),
        (6, 4, 8, 0, None),
        (6, 4, 8, 0, 2),
    ],
)
def test_empty_sizes(t, e, h, n0, align):
    rm = make_routing(t, e, min(2, e), seed=1) if t and e else np.zeros((t, e), bool)
    x = jax.random.normal(jax.random.PRNGKey(4), (t, h))
    probs = jax.random.uniform(jax.random.PRNGKey(5), (t, e)) * rm
    res = jax.jit(lambda x, p: token_dispatch(x, jnp.asarray(rm), n0, probs=p, align_size=align))(x, probs)
    n = n0 if not align else ((n0 + e * (align - 1)) // align) * align
    assert res.out.shape == (n, h) and res.permuted_probs.shape == (n,)
    assert res.row_id_map.shape == (t, 2 * e + 1) and res.tokens_per_expert.shape == (e,)
    assert int(res.num_dropped) == direct_layout(rm, n0, align).num_dropped
    if n == 0:
        assert int(res.num_dropped) == rm.sum()
    if t and e and n:
        check_dispatch(res, x, rm, probs, n0, align)
    else:
        np.testing.assert_array_equal(res.out, 0)
        np.testing.assert_array_equal(res.tokens_per_expert, 0)
        if t:
            np.testing.assert_array_equal(res.row_id_map[:, 2 * e], 0)
    y = jax.random.normal(jax.random.PRNGKey(6), (n, h))
    back = token_combine(y, res.row_id_map, merging_probs=probs)
    assert back.shape == (t, h)
    if not (t and e and n and h):
        np.testing.assert_array_equal(back, 0)
    dx, dp = jax.grad(
        lambda x, p: jnp.sum(token_dispatch(x, jnp.asarray(rm), n0, probs=p, align_size=align).out ** 2), argnums=(0, 1)
    )(x, probs)
    assert dx.shape == x.shape and dp.shape == probs.shape
    if not (t and e and n and h):
        np.testing.assert_array_equal(dx, 0)


@pytest.mark.parametrize("n,h,sizes", [(0, 4, [0, 0]), (5, 0, [2, 3]), (6, 4, [])])
def test_sort_chunks_empty(n, h, sizes):
    x = jax.random.normal(jax.random.PRNGKey(7), (n, h))
    idx = list(range(len(sizes)))[::-1]
    out, m = sort_chunks_by_index(x, jnp.asarray(sizes, jnp.int32), jnp.asarray(idx, jnp.int32))
    assert out.shape == (n, h) and m.shape == (n,)
    np.testing.assert_array_equal(out, direct_sort(x, sizes, idx))
    np.testing.assert_array_equal(np.asarray(out)[np.asarray(m)], x)
    g = jax.grad(
        lambda x: jnp.sum(sort_chunks_by_index(x, jnp.asarray(sizes, jnp.int32), jnp.asarray(idx, jnp.int32))[0] ** 2)
    )(x)
    assert_close(g, 2 * np.asarray(x), jnp.float32)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

_X = jax.random.normal(jax.random.PRNGKey(8), (8, 4))
_RM = jnp.asarray(make_routing(8, 4, 2, empty=False))
_MAP = token_dispatch(_X, _RM, 16).row_id_map
_ERRORS = [
    (lambda: token_dispatch(None, _RM, 16), TypeError, r"token_dispatch: x is required \(an array\), got None"),
    (lambda: token_dispatch(_X, None, 16), TypeError, "token_dispatch: routing_map is required"),
    (lambda: token_dispatch(_X.astype(jnp.int32), _RM, 16), TypeError, "token_dispatch: x must be float32"),
    (lambda: token_dispatch(_X[0], _RM, 16), ValueError, r"x must have rank 2 \[T, H\]"),
    (lambda: token_dispatch(_X, _RM.astype(jnp.int32), 16), TypeError, "routing_map must be a bool array"),
    (lambda: token_dispatch(_X, _RM[:4], 16), ValueError, r"routing_map must have shape \[T, E\] with T = "),
    (lambda: token_dispatch(_X, _RM[0], 16), ValueError, r"routing_map must have rank 2 \[T, E\]"),
    (lambda: jax.jit(lambda n: token_dispatch(_X, _RM, n))(16), TypeError, "num_out_tokens must be a static"),
    (lambda: token_dispatch(_X, _RM, -1), ValueError, "num_out_tokens must be >= 0, got -1"),
    (lambda: token_dispatch(_X, _RM, 16.0), TypeError, "num_out_tokens must be a static Python int"),
    (lambda: token_dispatch(_X, _RM, 16, align_size=0), ValueError, "align_size must be >= 1"),
    (lambda: token_dispatch(_X, _RM, 16, probs=jnp.ones((8, 5))), ValueError, r"probs must have shape \(8, 4\)"),
    (lambda: token_dispatch(_X, _RM, 16, probs=_RM), TypeError, "probs must be float32"),
    (lambda: token_dispatch(_X, _RM, 16, implementation="native"), ValueError, "unknown implementation"),
    (lambda: token_combine(None, _MAP), TypeError, "token_combine: y is required"),
    (lambda: token_combine(_X, None), TypeError, "token_combine: row_id_map is required"),
    (lambda: token_combine(_X.astype(jnp.int32), _MAP), TypeError, "token_combine: y must be float32"),
    (lambda: token_combine(_X[0], _MAP), ValueError, r"y must have rank 2 \[N, H\]"),
    (lambda: token_combine(_X, _MAP.astype(jnp.float32)), TypeError, "row_id_map must be int32, got dtype float32"),
    (lambda: token_combine(_X, _MAP.astype(jnp.int16)), TypeError, "row_id_map must be int32, got dtype int16"),
    (lambda: token_combine(_X, _MAP[:, :8]), ValueError, r"row_id_map must be the int32 \[T, 2E\+1\] map"),
    (lambda: token_combine(_X, _MAP[0]), ValueError, r"row_id_map must be the int32 \[T, 2E\+1\] map"),
    (
        lambda: token_combine(_X, _MAP, merging_probs=jnp.ones((8, 5))),
        ValueError,
        r"merging_probs must have shape \(8, 4\)",
    ),
    (lambda: token_combine(_X, _MAP, merging_probs=jnp.ones((4,))), ValueError, "merging_probs must have rank 2"),
    (lambda: token_combine(_X, _MAP, merging_probs=_RM), TypeError, "merging_probs must be float32"),
    (
        lambda: token_combine(_X, _MAP, pad_offsets=jnp.zeros((5,), jnp.int32)),
        ValueError,
        r"pad_offsets must have shape \(4,\)",
    ),
    (lambda: token_combine(_X, _MAP, pad_offsets=jnp.zeros((4,))), TypeError, "pad_offsets must be int32"),
    (
        lambda: sort_chunks_by_index(None, jnp.ones(2, jnp.int32), jnp.arange(2)),
        TypeError,
        "sort_chunks_by_index: x is required",
    ),
    (lambda: sort_chunks_by_index(_X, None, jnp.arange(2)), TypeError, "split_sizes is required"),
    (
        lambda: sort_chunks_by_index(_X, jnp.ones((2,)), jnp.arange(2)),
        TypeError,
        "split_sizes must be an integer array, got dtype float32",
    ),
    (
        lambda: sort_chunks_by_index(_X, jnp.ones((2, 2), jnp.int32), jnp.arange(2)),
        ValueError,
        r"split_sizes must have rank 1 \[S\]",
    ),
    (
        lambda: sort_chunks_by_index(_X, jnp.ones((2,), jnp.int32), jnp.arange(3)),
        ValueError,
        r"sorted_indices must have shape \(2,\), got \(3,\)",
    ),
    (
        lambda: sort_chunks_by_index(_X, jnp.ones((2,), jnp.int32), jnp.ones((2,), bool)),
        TypeError,
        "sorted_indices must be an integer array, got dtype bool",
    ),
    (
        lambda: sort_chunks_by_index(_X[0], jnp.ones((2,), jnp.int32), jnp.arange(2)),
        ValueError,
        r"x must have rank 2 \[N, H\]",
    ),
]


@pytest.mark.parametrize("i", range(len(_ERRORS)))
def test_errors_name_the_argument(i):
    fn, exc, pattern = _ERRORS[i]
    with pytest.raises(exc, match=pattern):
        fn()
