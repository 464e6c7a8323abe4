"""CPU tests of token_dispatch / token_combine / sort_chunks_by_index (reference path, dispatch,
gradients, jit, vmap, errors, sharding on 8 virtual CPU devices). Capacity overflow and empty
sizes: test_permutation_capacity.py."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from te_ops._core import registry
from te_ops._core.testing import assert_close, cpu_mesh, run_sharded
from te_ops.permutation import TokenDispatchResult, sort_chunks_by_index, token_combine, token_dispatch


def make_routing(t, e, k, seed=0, empty=True):
    """Uneven top-k routing: the first quarter of the experts is never chosen (empty experts) and
    expert e gets more tokens the larger e is."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((t, e)) + np.linspace(0, 2, e)
    if empty:
        scores[:, : max(1, e // 4)] -= 100.0
    top = np.argsort(-scores, axis=1)[:, :k]
    rm = np.zeros((t, e), bool)
    np.put_along_axis(rm, top, True, axis=1)
    return rm


class Layout(NamedTuple):
    src_t: np.ndarray  # [N] token of each row, -1 where no kept pair
    src_e: np.ndarray  # [N] expert of each row, -1 where no kept pair
    tokens_per_expert: np.ndarray
    pad_offsets: np.ndarray
    num_dropped: int
    n: int
    dropped: np.ndarray  # bool [T, E], routed pairs that did not fit


def direct_layout(rm, n0, align):
    """The capacity layout written out directly: every routed pair in expert-major order gets its
    row in the full padded layout; rows >= N are dropped; tokens_per_expert counts the rows of the
    truncated buffer that belong to each expert's block."""
    t, e = rm.shape
    flat = rm.T.reshape(-1)
    order = np.argsort(~flat, kind="stable")[: flat.sum()]
    tok, exp = order % max(t, 1), order // max(t, 1)
    counts = rm.sum(0)
    a = align or 1
    padded = -(-counts // a) * a
    start = np.cumsum(padded) - padded
    first = np.cumsum(counts) - counts
    rows = start[exp] + np.arange(len(order)) - first[exp]
    n = n0 if not align else ((n0 + e * (align - 1)) // align) * align
    src_t, src_e = np.full(n, -1), np.full(n, -1)
    keep = rows < n
    src_t[rows[keep]], src_e[rows[keep]] = tok[keep], exp[keep]
    owner = np.repeat(np.arange(e), padded)[:n]  # expert block of every buffer row
    tpe = np.bincount(owner, minlength=e)
    kept = np.bincount(exp[keep], minlength=e)
    holes = tpe - kept
    dropped = np.zeros((t, e), bool)
    dropped[tok[~keep], exp[~keep]] = True
    return Layout(src_t, src_e, tpe, np.cumsum(holes) - holes, int((~keep).sum()), n, dropped)


def direct_dispatch(x, probs, src_t, src_e):
    ok = (src_t >= 0)[:, None]
    out = jnp.where(ok, x[np.maximum(src_t, 0)], 0)
    pp = None if probs is None else jnp.where(src_t >= 0, probs[np.maximum(src_t, 0), np.maximum(src_e, 0)], 0)
    return out, pp


def direct_combine(y, mp, src_t, src_e, t):
    w = (
        (src_t >= 0).astype(np.float32)
        if mp is None
        else jnp.where(src_t >= 0, mp[np.maximum(src_t, 0), np.maximum(src_e, 0)], 0)
    )
    return (
        jnp.zeros((t, y.shape[1]), jnp.float32)
        .at[np.where(src_t >= 0, src_t, t)]
        .add(y.astype(jnp.float32) * w[:, None], mode="drop")
        .astype(y.dtype)
    )


def check_row_id_map(m, rm, lay):
    """row_id_map layout: kept rows in ascending expert order, -2 for dropped / -1 for unrouted
    positions, the expert permutation, then n_t."""
    m = np.asarray(m)
    t, e = rm.shape
    assert m.shape == (t, 2 * e + 1) and m.dtype == np.int32
    for tok in range(t):
        n_t = m[tok, 2 * e]
        kept = rm[tok] & ~lay.dropped[tok]
        assert n_t == kept.sum()
        np.testing.assert_array_equal(m[tok, e : e + n_t], np.nonzero(kept)[0])
        np.testing.assert_array_equal(np.sort(m[tok, e : 2 * e]), np.arange(e))
        rest = m[tok, e + n_t : 2 * e]
        np.testing.assert_array_equal(m[tok, n_t:e], np.where(lay.dropped[tok, rest], -2, -1))
        for j in range(n_t):
            assert lay.src_t[m[tok, j]] == tok and lay.src_e[m[tok, j]] == m[tok, e + j]


def check_dispatch(res, x, rm, probs, n0, align):
    lay = direct_layout(rm, n0, align)
    assert isinstance(res, TokenDispatchResult)
    want_out, want_pp = direct_dispatch(x, probs, lay.src_t, lay.src_e)
    assert res.out.shape == (lay.n, x.shape[1])
    np.testing.assert_array_equal(res.out, want_out)
    if probs is not None:
        np.testing.assert_array_equal(res.permuted_probs, want_pp)
    else:
        assert res.permuted_probs is None
    np.testing.assert_array_equal(res.tokens_per_expert, lay.tokens_per_expert)
    assert res.tokens_per_expert.dtype == jnp.int32
    if align:
        np.testing.assert_array_equal(res.pad_offsets, lay.pad_offsets)
    else:
        assert res.pad_offsets is None
    assert res.num_dropped.shape == () and res.num_dropped.dtype == jnp.int32
    assert int(res.num_dropped) == lay.num_dropped
    check_row_id_map(res.row_id_map, rm, lay)
    return lay


CASES = [(8, None, False), (8, 4, True), (64, None, True), (64, 8, False)]


@pytest.mark.parametrize("e,align,with_probs", CASES)
def test_dispatch_matches_direct(e, align, with_probs):
    t, h, k = 48, 16, 3
    rm = make_routing(t, e, k)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    probs = jnp.asarray(rng.random((t, e)) * rm, jnp.float32) if with_probs else None
    res = token_dispatch(x, jnp.asarray(rm), t * k, probs=probs, align_size=align)
    lay = check_dispatch(res, x, rm, probs, t * k, align)
    assert lay.num_dropped == 0
    np.testing.assert_array_equal(res.tokens_per_expert, -(-rm.sum(0) // (align or 1)) * (align or 1))


@pytest.mark.parametrize("e,align,with_probs", CASES)
def test_combine_matches_direct(e, align, with_probs):
    t, h, k = 40, 24, 2
    rm = make_routing(t, e, k, seed=3)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    res = token_dispatch(x, jnp.asarray(rm), t * k, align_size=align)
    lay = direct_layout(rm, t * k, align)
    y = jnp.asarray(rng.standard_normal((lay.n, h)), jnp.float32)
    mp = jnp.asarray(rng.random((t, e)) * rm, jnp.float32) if with_probs else None
    got = token_combine(y, res.row_id_map, merging_probs=mp, pad_offsets=res.pad_offsets)
    assert_close(got, direct_combine(y, mp, lay.src_t, lay.src_e, t), jnp.float32)


def test_roundtrip_and_bf16():
    t, e, h, k = 32, 8, 16, 2
    rm = jnp.asarray(make_routing(t, e, k))
    x = jax.random.normal(jax.random.PRNGKey(0), (t, h), jnp.bfloat16)
    res = token_dispatch(x, rm, t * k, align_size=16)
    assert res.out.dtype == jnp.bfloat16
    back = token_combine(res.out, res.row_id_map)
    assert_close(back, x.astype(jnp.float32) * k, jnp.bfloat16, scale=k)


def test_zero_tail_when_buffer_is_larger():
    t, e, h, k = 16, 8, 8, 2
    rm = jnp.asarray(make_routing(t, e, k, empty=False))
    x = jax.random.normal(jax.random.PRNGKey(1), (t, h))
    big = token_dispatch(x, rm, 40)  # more rows than pairs: the extra rows are zero
    np.testing.assert_array_equal(big.out[t * k :], 0)
    assert int(big.num_dropped) == 0 and int(big.tokens_per_expert.sum()) == t * k


@pytest.mark.parametrize("align,with_probs", [(None, True), (4, True), (None, False)])
def test_gradients_match_direct(align, with_probs):
    t, e, h, k = 24, 8, 8, 2
    rm = make_routing(t, e, k, seed=5)
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    probs = jnp.asarray(rng.random((t, e)) * rm, jnp.float32)
    lay = direct_layout(rm, t * k, align)
    w_rows = jnp.asarray(rng.standard_normal((lay.n, h)), jnp.float32)
    w_pp = jnp.asarray(rng.standard_normal((lay.n,)), jnp.float32)

    def ours(x, probs):
        res = token_dispatch(x, jnp.asarray(rm), t * k, probs=probs if with_probs else None, align_size=align)
        y = jnp.sin(res.out) * w_rows
        back = token_combine(y, res.row_id_map, merging_probs=probs)
        loss = jnp.sum(back**2)
        return loss + (jnp.sum(res.permuted_probs * w_pp) if with_probs else 0.0)

    def direct(x, probs):
        out, pp = direct_dispatch(x, probs if with_probs else None, lay.src_t, lay.src_e)
        y = jnp.sin(out) * w_rows
        back = direct_combine(y, probs, lay.src_t, lay.src_e, t)
        loss = jnp.sum(back**2)
        return loss + (jnp.sum(pp * w_pp) if with_probs else 0.0)

    got = jax.grad(ours, argnums=(0, 1))(x, probs)
    want = jax.grad(direct, argnums=(0, 1))(x, probs)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, jnp.float32, scale=10.0)


def test_integer_inputs_get_no_cotangent():
    t, e, h, k = 8, 4, 4, 2
    rm = jnp.asarray(make_routing(t, e, k, empty=False))
    x = jax.random.normal(jax.random.PRNGKey(11), (t, h))
    _, vjp = jax.vjp(lambda x, rm: token_dispatch(x, rm, t * k).out, x, rm)
    g = jax.random.normal(jax.random.PRNGKey(12), (t * k, h))
    dx, drm = vjp(g)
    assert drm.dtype == jax.dtypes.float0
    lay = direct_layout(np.asarray(rm), t * k, None)
    want = np.zeros((t, h), np.float32)
    np.add.at(want, lay.src_t, np.asarray(g))
    assert_close(dx, want, jnp.float32)


def test_jit_and_vmap():
    b, t, e, h, k = 3, 16, 8, 8, 2
    rms = jnp.asarray(np.stack([make_routing(t, e, k, seed=s) for s in range(b)]))
    xs = jax.random.normal(jax.random.PRNGKey(2), (b, t, h))
    ps = jax.random.uniform(jax.random.PRNGKey(3), (b, t, e)) * rms

    def f(x, rm, p):
        res = token_dispatch(x, rm, t * k, probs=p)
        back = token_combine(res.out * 2, res.row_id_map, merging_probs=p)
        return back, res.permuted_probs, res.tokens_per_expert, res.num_dropped

    batched = jax.jit(jax.vmap(f))(xs, rms, ps)
    for i in range(b):
        one = f(xs[i], rms[i], ps[i])
        for got, want in zip(batched, one, strict=True):
            np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    g = jax.jit(jax.vmap(jax.grad(lambda x, rm, p: jnp.sum(f(x, rm, p)[0] ** 2))))(xs, rms, ps)
    g0 = jax.grad(lambda x: jnp.sum(f(x, rms[0], ps[0])[0] ** 2))(xs[0])
    np.testing.assert_allclose(g[0], g0, rtol=1e-5, atol=1e-5)


def direct_sort(x, sizes, idx):
    x = np.asarray(x)
    total = int(np.sum(sizes))
    chunks = np.split(x[:total], np.cumsum(sizes)[:-1])
    return np.concatenate([chunks[i] for i in idx] + [x[total:]])


@pytest.mark.parametrize("sizes,idx", [([3, 0, 5, 4], [2, 0, 3, 1]), ([1, 2, 3, 4, 5, 6, 7, 8], list(range(8))[::-1])])
def test_sort_chunks(sizes, idx):
    n, h = 40, 8
    x = jax.random.normal(jax.random.PRNGKey(4), (n, h))
    out, row_id_map = sort_chunks_by_index(x, jnp.asarray(sizes), jnp.asarray(idx))
    np.testing.assert_array_equal(out, direct_sort(x, sizes, idx))
    np.testing.assert_array_equal(np.asarray(out)[np.asarray(row_id_map)], x)
    w = jax.random.normal(jax.random.PRNGKey(5), (n, h))
    g = jax.grad(lambda x: jnp.sum(sort_chunks_by_index(x, jnp.asarray(sizes), jnp.asarray(idx))[0] * w))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w)[np.asarray(row_id_map)])
    vm = jax.jit(jax.vmap(lambda x: sort_chunks_by_index(x, jnp.asarray(sizes), jnp.asarray(idx))[0]))(
        jnp.stack([x, 2 * x])
    )
    np.testing.assert_array_equal(vm[1], 2 * np.asarray(out))


def test_named_gpu_implementation_raises_on_cpu():
    x = jax.random.normal(jax.random.PRNGKey(13), (8, 4))
    rm = jnp.zeros((8, 4), bool).at[:, 0].set(True)
    for impl in ("triton", "gluon"):
        with pytest.raises(registry.ImplementationUnavailableError, match=impl):
            token_dispatch(x, rm, 8, implementation=impl)
    with registry.use_implementation("reference"):
        np.testing.assert_array_equal(token_dispatch(x, rm, 8).out, x)


@pytest.mark.parametrize("with_probs", [False, True])
def test_sharded_tokens_route_per_shard(with_probs):
    mesh = cpu_mesh((8,), ("dp",))
    t, e, h, k = 64, 8, 8, 2
    rm = jnp.asarray(make_routing(t, e, k, seed=7))
    x = jax.random.normal(jax.random.PRNGKey(6), (t, h))
    p = jax.random.uniform(jax.random.PRNGKey(7), (t, e)) * rm if with_probs else None

    def f(x, rm, *p):
        pr = p[0] if p else None
        res = token_dispatch(x, rm, x.shape[0] * k, probs=pr)
        back = token_combine(res.out * 3, res.row_id_map, merging_probs=pr)
        return (res.out, res.row_id_map, back, res.tokens_per_expert, res.num_dropped) + (
            (res.permuted_probs,) if p else ()
        )

    args = [x, rm] + ([p] if with_probs else [])
    specs = [PS("dp"), PS("dp")] + ([PS("dp")] if with_probs else [])
    out_specs = (PS("dp"), PS("dp"), PS("dp"), PS(), PS()) + ((PS("dp"),) if with_probs else ())
    sharded, _, counts = run_sharded(f, args, specs, out_specs, mesh=mesh)
    # each shard routes its own tokens: compare with the per-shard results, concatenated
    per = [f(*[a[i * 8 : (i + 1) * 8] for a in args]) for i in range(8)]
    np.testing.assert_array_equal(sharded[0], np.concatenate([q[0] for q in per]))
    np.testing.assert_array_equal(sharded[1], np.concatenate([q[1] for q in per]))
    np.testing.assert_allclose(sharded[2], np.concatenate([q[2] for q in per]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(sharded[3], np.asarray(rm).sum(0))  # global counts (nothing dropped)
    assert int(sharded[4]) == 0
    if with_probs:
        np.testing.assert_array_equal(sharded[5], np.concatenate([q[5] for q in per]))
    # the combine undoes the dispatch shard by shard, so it equals the unsharded round trip
    want = 3 * (x * p.sum(1, keepdims=True) if with_probs else k * x)
    np.testing.assert_allclose(sharded[2], want, rtol=1e-5, atol=1e-5)
    assert counts["all-gather"] == 0 and counts["all-to-all"] == 0
    assert counts["all-reduce"] >= 1  # the per-shard counts are summed
    # gradients flow through the sharded ops
    g = jax.jit(
        jax.grad(lambda x: jnp.sum(f(x, *args[1:])[2] ** 2)),
        in_shardings=jax.sharding.NamedSharding(mesh, PS("dp")),
    )(x)
    g_ref = jax.grad(lambda x: jnp.sum(f(x, *args[1:])[2] ** 2))(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5)


def test_sharded_padding_and_sort_are_exact():
    mesh = cpu_mesh((8,), ("dp",))
    t, e, h, k = 32, 8, 8, 2
    rm = jnp.asarray(make_routing(t, e, k, seed=8))
    x = jax.random.normal(jax.random.PRNGKey(8), (t, h))

    def f(x, rm):
        res = token_dispatch(x, rm, t * k - 20, align_size=4)  # overflows: pairs dropped
        return res.out, res.tokens_per_expert, res.pad_offsets, res.num_dropped

    sharded, unsharded, _ = run_sharded(f, [x, rm], [PS("dp"), PS("dp")], mesh=mesh)
    assert int(unsharded[3]) > 0
    for a, b in zip(sharded, unsharded, strict=True):
        np.testing.assert_array_equal(a, b)
    y = jax.random.normal(jax.random.PRNGKey(9), (40, 16))
    s = lambda y: sort_chunks_by_index(y, jnp.array([5, 10, 25]), jnp.array([2, 0, 1]))[0]  # noqa: E731
    sharded, unsharded, _ = run_sharded(s, [y], [PS(None, "dp")], mesh=mesh)
    np.testing.assert_array_equal(sharded, unsharded)


def test_sharded_overflow_is_per_shard_and_counts_are_summed():
    mesh = cpu_mesh((8,), ("dp",))
    t, e, h, k = 64, 8, 8, 2
    rm = make_routing(t, e, k, seed=9)
    x = jax.random.normal(jax.random.PRNGKey(10), (t, h))
    n0 = 64  # half of T * k: 8 rows per shard for 16 pairs

    def f(x, rm):
        res = token_dispatch(x, rm, n0)
        return res.out, res.tokens_per_expert, res.num_dropped, token_combine(res.out, res.row_id_map)

    sharded, _, _ = run_sharded(
        f, [x, jnp.asarray(rm)], [PS("dp"), PS("dp")], (PS("dp"), PS(), PS(), PS("dp")), mesh=mesh
    )
    lays = [direct_layout(rm[i * 8 : (i + 1) * 8], n0 // 8, None) for i in range(8)]
    np.testing.assert_array_equal(sharded[1], sum(lay.tokens_per_expert for lay in lays))
    assert int(sharded[2]) == sum(lay.num_dropped for lay in lays) > 0
    xs = np.asarray(x)
    for i, lay in enumerate(lays):
        np.testing.assert_array_equal(
            sharded[0][i * 8 : (i + 1) * 8], direct_dispatch(xs[i * 8 :], None, lay.src_t, lay.src_e)[0]
        )
        kept = (rm[i * 8 : (i + 1) * 8] & ~lay.dropped).sum(1)
        np.testing.assert_allclose(
            sharded[3][i * 8 : (i + 1) * 8], xs[i * 8 : (i + 1) * 8] * kept[:, None], rtol=1e-6, atol=1e-6
        )
