"""dense and grouped_dense against numpy formulations of docs/semantics.md ("Dense", "Grouped
GEMM"): bias and activation epilogues, empty axes, zero-size / negative / overflowing group sizes,
forward and hand-derived backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import te_ops
from tests.property._common import ACTIVATIONS, check_close, float_dtypes, fuzz, rand, seeds, size

IMPL = "reference"


# The strategies of each test, importable: tests/gpu/test_property_gpu.py draws from them too.
DENSE_ARGS = dict(
    lead=st.lists(size(17, min_size=0, sizes=(0, 1, 2, 3, 5, 17)), min_size=1, max_size=3),
    k=size(129, min_size=0, sizes=(0, 1, 3, 7, 16, 31, 64, 127, 129)),
    n=size(64, min_size=0, sizes=(0, 1, 2, 5, 13, 33, 64)),
    dtype=float_dtypes,
    has_bias=st.booleans(),
    activation=st.sampled_from(list(ACTIVATIONS)),
    seed=seeds,
)


@fuzz(40)
@given(**DENSE_ARGS)
def test_dense(lead, k, n, dtype, has_bias, activation, seed):
    rng = np.random.default_rng(seed)
    x, x64 = rand(rng, (*lead, k), dtype)
    w, w64 = rand(rng, (k, n), dtype, 1.0 / np.sqrt(max(k, 1)))
    b, b64 = rand(rng, (n,), dtype) if has_bias else (None, np.zeros((n,)))
    act, dact = ACTIVATIONS[activation]

    fn = lambda a, kk, bb: te_ops.dense(a, kk, bb, activation=activation, implementation=IMPL)  # noqa: E731
    y, vjp = jax.vjp(fn, x, w, b)
    z = x64 @ w64 + b64
    assert y.dtype == jnp.dtype(dtype) and y.shape == (*lead, n)
    check_close(y, act(z), dtype, what=f"dense y ({activation}, bias={has_bias})")

    dy, dy64 = rand(rng, y.shape, dtype)
    dx, dw, db = vjp(dy)
    dz = dy64 * dact(z)
    rows = int(np.prod(lead))
    dz2 = dz.reshape(rows, n)
    check_close(dx, dz @ w64.T, dtype, what="dense dx")
    check_close(dw, x64.reshape(rows, k).T @ dz2, dtype, what="dense dkernel")
    if has_bias:
        check_close(db, dz2.sum(0), dtype, what="dense dbias")
    else:
        assert db is None


def _group_bounds(sizes, m):
    """The spec's rule: end = min(running sum of max(sizes, 0), M), start = previous end (in Python ints)."""
    ends, total = [], 0
    for s in sizes:
        total += max(int(s), 0)
        ends.append(min(total, m))
    return [0, *ends[:-1]], ends


@st.composite
def group_sizes(draw, m, g, kind):
    if kind == "zeros":
        return [0] * g
    if kind == "one_group":  # every row to one group (all tokens routed to one expert)
        out = [0] * g
        out[draw(st.integers(0, g - 1))] = m
        return out
    if kind == "fits":  # sum <= M, with empty groups
        cuts = sorted(draw(st.lists(st.integers(0, m), min_size=g, max_size=g)))
        return [cuts[0]] + [cuts[i] - cuts[i - 1] for i in range(1, g)]
    if kind == "negative":
        return draw(st.lists(st.integers(-5, max(m // 2, 1)), min_size=g, max_size=g))
    if kind == "overflow":
        return draw(st.lists(st.integers(0, m + 3), min_size=g, max_size=g))
    return draw(st.lists(st.sampled_from([2**31 - 1, -(2**31), 1, 0, 2**30]), min_size=g, max_size=g))


GROUP_KINDS = ("fits", "zeros", "one_group", "negative", "overflow", "int_extremes")
GROUPED_M = size(256, min_size=0, sizes=(0, 1, 2, 7, 31, 64, 129, 256))
GROUPED_K = size(64, min_size=0, sizes=(0, 1, 3, 8, 13, 64))
GROUPED_N = size(64, min_size=0, sizes=(0, 1, 5, 16, 33))


@st.composite
def grouped_dense_case(draw, kind, m=GROUPED_M, k=GROUPED_K, n=GROUPED_N, dtypes=float_dtypes):
    """(M, K, N, G, group_sizes, dtype, has_bias, seed) of one grouped_dense case with ``kind`` sizes;
    ``m``, ``k``, ``n`` and ``dtypes`` can be narrowed (e.g. to an implementation's shape constraints)."""
    m = draw(m)
    k = draw(k)
    n = draw(n)
    g = draw(st.integers(1, 6))
    sizes = draw(group_sizes(m, g, kind))
    return m, k, n, g, sizes, draw(dtypes), draw(st.booleans()), draw(seeds)


@pytest.mark.parametrize("kind", GROUP_KINDS)
@fuzz(8)
@given(data=st.data())
def test_grouped_dense(kind, data):
    m, k, n, g, sizes, dtype, has_bias, seed = data.draw(grouped_dense_case(kind), label="(M, K, N, G, sizes, ...)")
    rng = np.random.default_rng(seed)

    x, x64 = rand(rng, (m, k), dtype)
    w, w64 = rand(rng, (g, k, n), dtype, 1.0 / np.sqrt(max(k, 1)))
    b, b64 = rand(rng, (g, n), dtype) if has_bias else (None, np.zeros((g, n)))
    gs = jnp.asarray(np.asarray(sizes, np.int64).astype(np.int32))

    starts, ends = _group_bounds(sizes, m)
    y_exp = np.zeros((m, n))
    for i in range(g):
        y_exp[starts[i] : ends[i]] = x64[starts[i] : ends[i]] @ w64[i] + b64[i]

    fn = lambda a, kk, bb: te_ops.grouped_dense(a, kk, gs, bb, implementation=IMPL)  # noqa: E731
    y, vjp = jax.vjp(fn, x, w, b)
    assert y.dtype == jnp.dtype(dtype) and y.shape == (m, n)
    check_close(y, y_exp, dtype, what="grouped_dense y")

    dy, dy64 = rand(rng, (m, n), dtype)
    dx, dw, db = vjp(dy)
    dx_exp = np.zeros((m, k))
    dw_exp = np.zeros((g, k, n))
    db_exp = np.zeros((g, n))
    for i in range(g):
        rows = slice(starts[i], ends[i])
        dx_exp[rows] = dy64[rows] @ w64[i].T
        dw_exp[i] = x64[rows].T @ dy64[rows]
        db_exp[i] = dy64[rows].sum(0)
    check_close(dx, dx_exp, dtype, what="grouped_dense dx (0 on rows of no group)")
    check_close(dw, dw_exp, dtype, what="grouped_dense dkernels (0 for empty groups)")
    if has_bias:
        check_close(db, db_exp, dtype, what="grouped_dense dbias")


# ----------------------------------------------------------------------------------------------
# grouped_ffn: the experts' FFN as one op (docs/semantics.md, "The experts' FFN as one op")
# ----------------------------------------------------------------------------------------------

FFN_F = size(48, min_size=0, sizes=(0, 1, 3, 8, 16, 33))


@st.composite
def grouped_ffn_case(draw, kind, m=GROUPED_M, h=GROUPED_K, f=FFN_F, o=GROUPED_N, dtypes=float_dtypes):
    """(M, H, F, O, G, group_sizes, activation, gated, dtype, seed) of one grouped_ffn case."""
    m_ = draw(m)
    g = draw(st.integers(1, 6))
    sizes = draw(group_sizes(m_, g, kind))
    act = draw(st.sampled_from(list(ACTIVATIONS)))
    return m_, draw(h), draw(f), draw(o), g, sizes, act, draw(st.booleans()), draw(dtypes), draw(seeds)


def grouped_ffn_expected(x64, wi64, wo64, dy64, sizes, activation, gated, dtype):
    """float64 y, dx, dwi, dwo by hand-derived formulas, with the op's two roundings to ``dtype``
    (h and the activation as stored; da and dh as stored in the backward)."""
    from tests.property._common import round_to

    act, dact = ACTIVATIONS[activation]
    m = x64.shape[0]
    g, _, w = wi64.shape
    f, o = wo64.shape[1], wo64.shape[2]
    starts, ends = _group_bounds(sizes, m)
    y, dx = np.zeros((m, o)), np.zeros_like(x64)
    dwi, dwo = np.zeros_like(wi64), np.zeros_like(wo64)
    for i in range(g):
        r = slice(starts[i], ends[i])
        h = round_to(x64[r] @ wi64[i], dtype)
        if gated:
            z, u = h[:, :f], h[:, f:]
            a = round_to(act(z) * u, dtype)
        else:
            a = round_to(act(h), dtype)
        y[r] = a @ wo64[i]
        da = round_to(dy64[r] @ wo64[i].T, dtype)
        dwo[i] = a.T @ dy64[r]
        if gated:
            dh = round_to(np.concatenate([da * u * dact(z), da * act(z)], axis=1), dtype)
        else:
            dh = round_to(da * dact(h), dtype)
        dx[r] = dh @ wi64[i].T
        dwi[i] = x64[r].T @ dh
    return y, dx, dwi, dwo


def grouped_ffn_inputs(m, h, f, o, g, gated, dtype, seed):
    rng = np.random.default_rng(seed)
    x, x64 = rand(rng, (m, h), dtype)
    wi, wi64 = rand(rng, (g, h, 2 * f if gated else f), dtype, 1.0 / np.sqrt(max(h, 1)))
    wo, wo64 = rand(rng, (g, f, o), dtype, 1.0 / np.sqrt(max(f, 1)))
    dy, dy64 = rand(rng, (m, o), dtype)
    return (x, wi, wo, dy), (x64, wi64, wo64, dy64)


@pytest.mark.parametrize("kind", GROUP_KINDS)
@fuzz(6)
@given(data=st.data())
def test_grouped_ffn(kind, data):
    m, h, f, o, g, sizes, activation, gated, dtype, seed = data.draw(grouped_ffn_case(kind), label="case")
    (x, wi, wo, dy), (x64, wi64, wo64, dy64) = grouped_ffn_inputs(m, h, f, o, g, gated, dtype, seed)
    gs = jnp.asarray(np.asarray(sizes, np.int64).astype(np.int32))
    fn = lambda a, b, c: te_ops.grouped_ffn(a, b, c, gs, activation=activation, gated=gated,  # noqa: E731
                                            implementation=IMPL)  # fmt: skip
    y, vjp = jax.vjp(fn, x, wi, wo)
    assert y.dtype == jnp.dtype(dtype) and y.shape == (m, o)
    want = grouped_ffn_expected(x64, wi64, wo64, dy64, sizes, activation, gated, dtype)
    tag = f"({activation}, gated={gated}, {kind} sizes {sizes})"
    # bf16 roundings of h and da move the expected values by an ulp: the GEMM outputs after them
    # are compared at 4x the dtype's tolerance
    for name, a, e in zip(("y", "dx", "dwi", "dwo"), (y, *vjp(dy)), want, strict=True):
        check_close(a, e, dtype, what=f"grouped_ffn {name} {tag}", scale=4 * max(1.0, float(np.abs(e).max(initial=0))))
