"""CPU tests of token_dispatch / token_combine / sort_chunks_by_index (reference path, dispatch,
gradients, jit, vmap, errors, sharding on 8 virtual CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from te_ops._core import registry
from te_ops._core.testing import assert_close, cpu_mesh, run_sharded
from te_ops.permutation import sort_chunks_by_index, token_combine, token_dispatch


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


def direct_layout(rm, n0, align):
    """Per output row: (token, expert) or -1, from an argsort of the expert-major flattened map."""
    t, e = rm.shape
    flat = rm.T.reshape(-1)
    order = np.argsort(~flat, kind="stable")[: flat.sum()]
    tok, exp = order % t, order // t
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
    pad = padded - counts
    return src_t, src_e, padded, np.cumsum(pad) - pad, n


def direct_dispatch(x, probs, src_t, src_e):
    ok = (src_t >= 0)[:, None]
    out = jnp.where(ok, x[np.maximum(src_t, 0)], 0)
    pp = (
        None if probs is None else jnp.where(src_t >= 0, probs[np.maximum(src_t, 0), np.maximum(src_e, 0)], 0)
    )
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


CASES = [(8, None, False), (8, 4, True), (64, None, True), (64, 8, False)]


@pytest.mark.parametrize("e,align,with_probs", CASES)
def test_dispatch_matches_direct(e, align, with_probs):
    t, h, k = 48, 16, 3
    rm = make_routing(t, e, k)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    probs = jnp.asarray(rng.random((t, e)) * rm, jnp.float32) if with_probs else None
    out, pp, row_id_map, pad_offsets, tpe = token_dispatch(
        x, jnp.asarray(rm), t * k, probs=probs, align_size=align
    )
    src_t, src_e, padded, pad_off, n = direct_layout(rm, t * k, align)
    want_out, want_pp = direct_dispatch(x, probs, src_t, src_e)
    assert out.shape == (n, h)
    np.testing.assert_array_equal(out, want_out)
    if with_probs:
        np.testing.assert_array_equal(pp, want_pp)
    else:
        assert pp is None
    np.testing.assert_array_equal(tpe, padded if align else rm.sum(0))
    if align:
        np.testing.assert_array_equal(pad_offsets, pad_off)
    else:
        assert pad_offsets is None
    # row_id_map layout: rows listed in ascending expert order, then the expert permutation, then n_t
    m = np.asarray(row_id_map)
    assert m.shape == (t, 2 * e + 1) and m.dtype == np.int32
    for tok in range(t):
        n_t = m[tok, 2 * e]
        assert n_t == rm[tok].sum()
        np.testing.assert_array_equal(m[tok, e : e + n_t], np.nonzero(rm[tok])[0])
        np.testing.assert_array_equal(np.sort(m[tok, e : 2 * e]), np.arange(e))
        assert (m[tok, n_t:e] == -1).all()
        for j in range(n_t):
            assert src_t[m[tok, j]] == tok and src_e[m[tok, j]] == m[tok, e + j]


@pytest.mark.parametrize("e,align,with_probs", CASES)
def test_combine_matches_direct(e, align, with_probs):
    t, h, k = 40, 24, 2
    rm = make_routing(t, e, k, seed=3)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    _, _, row_id_map, pad_offsets, _ = token_dispatch(x, jnp.asarray(rm), t * k, align_size=align)
    src_t, src_e, _, _, n = direct_layout(rm, t * k, align)
    y = jnp.asarray(rng.standard_normal((n, h)), jnp.float32)
    mp = jnp.asarray(rng.random((t, e)) * rm, jnp.float32) if with_probs else None
    got = token_combine(y, row_id_map, merging_probs=mp, pad_offsets=pad_offsets)
    assert_close(got, direct_combine(y, mp, src_t, src_e, t), jnp.float32)


def test_roundtrip_and_bf16():
    t, e, h, k = 32, 8, 16, 2
    rm = jnp.asarray(make_routing(t, e, k))
    x = jax.random.normal(jax.random.PRNGKey(0), (t, h), jnp.bfloat16)
    out, _, m, _, _ = token_dispatch(x, rm, t * k, align_size=16)
    assert out.dtype == jnp.bfloat16
    back = token_combine(out, m)
    assert_close(back, x.astype(jnp.float32) * k, jnp.bfloat16, scale=k)


def test_dropped_pairs_and_zero_tail():
    t, e, h, k = 16, 8, 8, 2
    rm = jnp.asarray(make_routing(t, e, k, empty=False))
    x = jax.random.normal(jax.random.PRNGKey(1), (t, h))
    small, _, m_small, _, _ = token_dispatch(x, rm, 20)  # fewer rows than routed pairs: the tail is dropped
    src_t, _, _, _, _ = direct_layout(np.asarray(rm), 20, None)
    np.testing.assert_array_equal(small, direct_dispatch(x, None, src_t, src_t)[0])
    assert int(np.asarray(m_small)[:, 2 * e].sum()) == 20
    big, _, _, _, _ = token_dispatch(x, rm, 40)  # more rows than pairs: the extra rows are zero
    np.testing.assert_array_equal(big[t * k :], 0)


@pytest.mark.parametrize("align,with_probs", [(None, True), (4, True), (None, False)])
def test_gradients_match_direct(align, with_probs):
    t, e, h, k = 24, 8, 8, 2
    rm = make_routing(t, e, k, seed=5)
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    probs = jnp.asarray(rng.random((t, e)) * rm, jnp.float32)
    src_t, src_e, _, _, n = direct_layout(rm, t * k, align)
    w_rows = jnp.asarray(rng.standard_normal((n, h)), jnp.float32)
    w_pp = jnp.asarray(rng.standard_normal((n,)), jnp.float32)

    def ours(x, probs):
        out, pp, m, _, _ = token_dispatch(
            x, jnp.asarray(rm), t * k, probs=probs if with_probs else None, align_size=align
        )
        y = jnp.sin(out) * w_rows
        back = token_combine(y, m, merging_probs=probs)
        loss = jnp.sum(back**2)
        return loss + (jnp.sum(pp * w_pp) if with_probs else 0.0)

    def direct(x, probs):
        out, pp = direct_dispatch(x, probs if with_probs else None, src_t, src_e)
        y = jnp.sin(out) * w_rows
        back = direct_combine(y, probs, src_t, src_e, t)
        loss = jnp.sum(back**2)
        return loss + (jnp.sum(pp * w_pp) if with_probs else 0.0)

    got = jax.grad(ours, argnums=(0, 1))(x, probs)
    want = jax.grad(direct, argnums=(0, 1))(x, probs)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, jnp.float32, scale=10.0)


def test_integer_inputs_get_no_cotangent():
    t, e, h, k = 8, 4, 4, 2
    rm = jnp.asarray(make_routing(t, e, k, empty=False))
    x = jnp.ones((t, h))
    _, vjp = jax.vjp(lambda x, rm: token_dispatch(x, rm, t * k)[0], x, rm)
    dx, drm = vjp(jnp.ones((t * k, h)))
    assert drm.dtype == jax.dtypes.float0
    np.testing.assert_allclose(dx, k)


def test_jit_and_vmap():
    b, t, e, h, k = 3, 16, 8, 8, 2
    rms = jnp.asarray(np.stack([make_routing(t, e, k, seed=s) for s in range(b)]))
    xs = jax.random.normal(jax.random.PRNGKey(2), (b, t, h))
    ps = jax.random.uniform(jax.random.PRNGKey(3), (b, t, e)) * rms

    def f(x, rm, p):
        out, pp, m, _, tpe = token_dispatch(x, rm, t * k, probs=p)
        return token_combine(out * 2, m, merging_probs=p), pp, tpe

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


@pytest.mark.parametrize(
    "sizes,idx", [([3, 0, 5, 4], [2, 0, 3, 1]), ([1, 2, 3, 4, 5, 6, 7, 8], list(range(8))[::-1])]
)
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


def test_errors():
    x = jnp.ones((8, 4))
    rm = jnp.zeros((8, 4), bool)
    with pytest.raises(TypeError, match="routing_map must be bool"):
        token_dispatch(x, rm.astype(jnp.int32), 16)
    with pytest.raises(ValueError, match=r"routing_map must have shape \[T, E\]"):
        token_dispatch(x, rm[:4], 16)
    with pytest.raises(TypeError, match="num_out_tokens must be a static Python int"):
        jax.jit(lambda n: token_dispatch(x, rm, n))(16)
    with pytest.raises(ValueError, match="align_size must be >= 1"):
        token_dispatch(x, rm, 16, align_size=0)
    with pytest.raises(ValueError, match="probs must have shape"):
        token_dispatch(x, rm, 16, probs=jnp.ones((8, 5)))
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        token_dispatch(x.astype(jnp.int32), rm, 16)
    with pytest.raises(ValueError, match="row_id_map must be the int32"):
        token_combine(x, jnp.zeros((8, 4), jnp.int32))
    with pytest.raises(TypeError, match="split_sizes must be a 1-D integer array"):
        sort_chunks_by_index(x, jnp.ones((2,)), jnp.arange(2))
    with pytest.raises(ValueError, match="sorted_indices must have 2 entries"):
        sort_chunks_by_index(x, jnp.ones((2,), jnp.int32), jnp.arange(3))
    with pytest.raises(ValueError, match="unknown implementation"):
        token_dispatch(x, rm, 16, implementation="native")


def test_named_gpu_implementation_raises_on_cpu():
    x = jnp.ones((8, 4))
    rm = jnp.zeros((8, 4), bool).at[:, 0].set(True)
    for impl in ("triton", "gluon"):
        with pytest.raises(registry.ImplementationUnavailableError, match=impl):
            token_dispatch(x, rm, 8, implementation=impl)
    with registry.use_implementation("reference"):
        token_dispatch(x, rm, 8)


@pytest.mark.parametrize("with_probs", [False, True])
def test_sharded_tokens_route_per_shard(with_probs):
    mesh = cpu_mesh((8,), ("dp",))
    t, e, h, k = 64, 8, 8, 2
    rm = jnp.asarray(make_routing(t, e, k, seed=7))
    x = jax.random.normal(jax.random.PRNGKey(6), (t, h))
    p = jax.random.uniform(jax.random.PRNGKey(7), (t, e)) * rm if with_probs else None

    def f(x, rm, *p):
        pr = p[0] if p else None
        out, pp, m, _, tpe = token_dispatch(x, rm, x.shape[0] * k, probs=pr)
        back = token_combine(out * 3, m, merging_probs=pr)
        return (out, m, back, tpe) + ((pp,) if p else ())

    args = [x, rm] + ([p] if with_probs else [])
    specs = [PS("dp"), PS("dp")] + ([PS("dp")] if with_probs else [])
    out_specs = (PS("dp"), PS("dp"), PS("dp"), PS()) + ((PS("dp"),) if with_probs else ())
    sharded, _, counts = run_sharded(f, args, specs, out_specs, mesh=mesh)
    # each shard routes its own tokens: compare with the per-shard results, concatenated
    per = [f(*[a[i * 8 : (i + 1) * 8] for a in args]) for i in range(8)]
    np.testing.assert_array_equal(sharded[0], np.concatenate([q[0] for q in per]))
    np.testing.assert_array_equal(sharded[1], np.concatenate([q[1] for q in per]))
    np.testing.assert_allclose(sharded[2], np.concatenate([q[2] for q in per]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(sharded[3], np.asarray(rm).sum(0))  # global counts
    if with_probs:
        np.testing.assert_array_equal(sharded[4], np.concatenate([q[4] for q in per]))
    # the combine undoes the dispatch shard by shard, so it equals the unsharded round trip
    want = 3 * (x * p.sum(1, keepdims=True) if with_probs else k * x)
    np.testing.assert_allclose(sharded[2], want, rtol=1e-5, atol=1e-5)
    assert counts["all-gather"] == 0 and counts["all-to-all"] == 0
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
    f = lambda x, rm: token_dispatch(x, rm, t * k, align_size=4)[0]  # noqa: E731
    sharded, unsharded, _ = run_sharded(f, [x, rm], [PS("dp"), PS("dp")], mesh=mesh)
    np.testing.assert_array_equal(sharded, unsharded)
    y = jax.random.normal(jax.random.PRNGKey(9), (40, 16))
    s = lambda y: sort_chunks_by_index(y, jnp.array([5, 10, 25]), jnp.array([2, 0, 1]))[0]  # noqa: E731
    sharded, unsharded, _ = run_sharded(s, [y], [PS(None, "dp")], mesh=mesh)
    np.testing.assert_array_equal(sharded, unsharded)
