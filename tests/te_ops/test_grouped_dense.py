"""CPU tests of te_ops.grouped_dense: reference vs per-group jnp.dot on random uneven sizes (empty
groups, sum < M), gradients vs jax.grad of the per-group formulation, jit, vmap, errors, dispatch,
sharding on 8 virtual CPU devices (expert parallel, tensor parallel) with collective counts, the
Triton kernels' logic under TRITON_INTERPRET=1, and their compilation for sm_90 without a GPU.

Run as a script (``python tests/te_ops/test_grouped_dense.py --interpret``) it is the interpreter
harness: the Triton kernels run eagerly on NumPy buffers (tests/te_ops/_triton_interpret.py, "NumPy
shim, no torch") with NaN-poisoned outputs. fp16 only there: the shim's bfloat16 buffers are not
read correctly by Triton 3.6's interpreter (fp16 runs the same kernel code)."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from te_ops._core import registry
from te_ops._core import testing as T
from te_ops._core import triton_bridge as tb
from te_ops._core.testing import assert_close, cpu_mesh, run_sharded
from te_ops.grouped_dense import grouped_dense

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def direct(x, kernels, sizes, bias=None):
    """Per-group jnp.dot with static (host) sizes: the independent formulation."""
    m, n = x.shape[0], kernels.shape[2]
    out, s = [], 0
    for g, c in enumerate(np.asarray(sizes).tolist()):
        c = max(0, min(c, m - s))
        y = jnp.dot(
            x[s : s + c].astype(jnp.float32),
            kernels[g].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        if bias is not None:
            y = y + bias[g].astype(jnp.float32)
        out.append(y)
        s += c
    out.append(jnp.zeros((m - s, n), jnp.float32))
    return jnp.concatenate(out).astype(x.dtype)


def uneven_sizes(rng, g, m, fill=0.8, zeros=2):
    """Random uneven sizes with `zeros` empty groups and sum about fill * m (<= m)."""
    w = rng.dirichlet(np.full(g, 0.5))
    sizes = np.floor(w * m * fill).astype(np.int32)
    sizes[rng.choice(g, size=min(zeros, g), replace=False)] = 0
    return sizes


def make(rng, m, k, n, g, dtype=jnp.float32, fill=0.8, zeros=2):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), dtype)
    b = jnp.asarray(rng.standard_normal((g, n)), dtype)
    return x, w, jnp.asarray(uneven_sizes(rng, g, m, fill, zeros)), b


@pytest.mark.parametrize(
    "m,k,n,g,fill,zeros",
    [(64, 16, 24, 5, 0.8, 2), (97, 32, 8, 8, 1.0, 3), (40, 8, 16, 3, 0.0, 3), (33, 8, 8, 1, 1.0, 0)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_forward_matches_per_group_dot(m, k, n, g, fill, zeros, with_bias):
    rng = np.random.default_rng(m + k + g)
    x, w, sizes, b = make(rng, m, k, n, g, fill=fill, zeros=zeros)
    b = b if with_bias else None
    got = jax.jit(lambda x, w, s, *b: grouped_dense(x, w, s, *b))(x, w, sizes, *([b] if with_bias else []))
    assert_close(got, direct(x, w, sizes, b), jnp.float32, scale=4)
    assert np.all(np.asarray(got)[int(sizes.sum()) :] == 0)


def test_bf16_and_sum_over_m_clips():
    rng = np.random.default_rng(1)
    x, w, _, _ = make(rng, 48, 16, 16, 4, jnp.bfloat16)
    sizes = jnp.array([10, 0, 30, 20], jnp.int32)  # sum 60 > 48: the last group is clipped at row 48
    got = grouped_dense(x, w, sizes)
    assert got.dtype == jnp.bfloat16
    assert_close(got, direct(x, w, sizes), jnp.bfloat16, scale=4)
    neg = grouped_dense(x, w, jnp.array([10, -5, 30, 0], jnp.int32))  # negative sizes count as 0
    assert_close(neg, direct(x, w, np.array([10, 0, 30, 0])), jnp.bfloat16, scale=4)


@pytest.mark.parametrize("with_bias", [False, True])
def test_gradients_match_per_group_formulation(with_bias):
    rng = np.random.default_rng(2)
    x, w, _, b = make(rng, 70, 16, 24, 6)
    sizes = jnp.array([9, 0, 21, 3, 0, 30], jnp.int32)  # sum 63 < 70, two empty groups
    dy = jnp.asarray(rng.standard_normal((70, 24)), jnp.float32)

    def ours(x, w, b):
        return jnp.sum(grouped_dense(x, w, sizes, b if with_bias else None) * dy)

    def theirs(x, w, b):
        return jnp.sum(direct(x, w, sizes, b if with_bias else None) * dy)

    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(x, w, b)
    want = jax.grad(theirs, argnums=(0, 1, 2))(x, w, b)
    for a, e in zip(got, want, strict=True):
        assert_close(a, e, jnp.float32, scale=8)
    assert np.all(np.asarray(got[1])[[1, 4]] == 0)  # empty groups: zero dkernels
    assert np.all(np.asarray(got[0])[63:] == 0)  # tail rows: zero dx
    if with_bias:
        assert np.all(np.asarray(got[2])[[1, 4]] == 0)
    # group_sizes gets no cotangent (float0)
    gs_grad = jax.grad(lambda x, s: jnp.sum(grouped_dense(x, w, s)), argnums=1, allow_int=True)(x, sizes)
    assert gs_grad.dtype == jax.dtypes.float0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_master_kernels(dtype, with_bias):
    """float32 kernels with a 16-bit x: y and dx equal the call with kernels.astype(x.dtype) bit for
    bit; dkernels is float32, equal to that call's dkernels before its rounding to x's dtype (so it
    rounds to the same bytes) and within float32 accumulation error of the per-group formulation."""
    rng = np.random.default_rng(12)
    x, w, _, b = make(rng, 90, 24, 40, 5)
    x, b = x.astype(dtype), b.astype(dtype)
    sizes = jnp.array([30, 0, 17, 35, 1], jnp.int32)  # sum 83 < 90, an empty group
    dy = jnp.asarray(rng.standard_normal((90, 40)), dtype)
    bias = b if with_bias else None

    def step(cast):
        f = lambda x, w: grouped_dense(x, w.astype(dtype) if cast else w, sizes, bias)  # noqa: E731
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy))

    (y, dx, dk), (y_c, dx_c, dk_c) = jax.jit(lambda: step(False))(), jax.jit(lambda: step(True))()
    assert y.dtype == dtype and dx.dtype == dtype and dk.dtype == jnp.float32
    T.assert_same_bytes((y, dx), (y_c, dx_c))
    T.assert_same_bytes(dk.astype(dtype), dk_c.astype(dtype))
    assert np.any(np.asarray(dk) != np.asarray(dk_c)), "dkernels must not be rounded to x's dtype"
    want = jax.grad(lambda w: jnp.sum(direct(x, w, sizes, bias).astype(jnp.float32) * dy.astype(jnp.float32)))(
        w.astype(dtype).astype(jnp.float32)
    )
    assert_close(dk, want, jnp.float32, scale=8)
    assert np.all(np.asarray(dk)[1] == 0)  # the empty group


def test_jit_with_device_sizes_one_compile():
    rng = np.random.default_rng(3)
    x, w, _, _ = make(rng, 50, 8, 8, 4)
    fn = jax.jit(lambda x, w, s: grouped_dense(x, w, s))
    for sizes in ([10, 10, 10, 10], [0, 50, 0, 0], [1, 2, 3, 4]):
        s = jnp.array(sizes, jnp.int32)
        assert_close(fn(x, w, s), direct(x, w, s), jnp.float32, scale=4)
    assert fn._cache_size() == 1


def test_vmap():
    rng = np.random.default_rng(4)
    xs = jnp.asarray(rng.standard_normal((3, 40, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 16, 8)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    sizes = jnp.array([[10, 0, 20, 5], [40, 0, 0, 0], [1, 2, 3, 4]], jnp.int32)
    got = jax.jit(jax.vmap(lambda x, s: grouped_dense(x, w, s, b)))(xs, sizes)
    for i in range(3):
        assert_close(got[i], direct(xs[i], w, sizes[i], b), jnp.float32, scale=4)
    # vmap of the gradient, kernels batched too
    ws = jnp.stack([w, 2 * w, -w])
    gw = jax.vmap(jax.grad(lambda x, w, s: jnp.sum(grouped_dense(x, w, s) ** 2), argnums=1))(xs, ws, sizes)
    for i in range(3):
        want = jax.grad(lambda w, i=i: jnp.sum(direct(xs[i], w, sizes[i]) ** 2))(ws[i])
        assert_close(gw[i], want, jnp.float32, scale=16)


def test_errors():
    x = jnp.ones((16, 8))
    w = jnp.ones((2, 8, 16))
    s = jnp.array([8, 8], jnp.int32)
    with pytest.raises(ValueError, match="x must have rank 2"):
        grouped_dense(jnp.ones((2, 16, 8)), w, s)
    with pytest.raises(ValueError, match="kernels must have rank 3"):
        grouped_dense(x, jnp.ones((8, 16)), s)
    with pytest.raises(ValueError, match="K = x.shape"):
        grouped_dense(x, jnp.ones((2, 16, 16)), s)
    with pytest.raises(TypeError, match="group_sizes must be int32"):
        grouped_dense(x, w, s.astype(jnp.int64) if jax.config.jax_enable_x64 else s.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"group_sizes must have shape \[G\]"):
        grouped_dense(x, w, jnp.array([8, 4, 4], jnp.int32))
    # float32 kernels with a 16-bit x are master kernels (test_float32_master_kernels); the other mixes
    with pytest.raises(TypeError, match=r"kernels must have x's dtype.*x float32 and kernels bfloat16"):
        grouped_dense(x, w.astype(jnp.bfloat16), s)
    with pytest.raises(TypeError, match=r"x bfloat16 and kernels float16"):
        grouped_dense(x.astype(jnp.bfloat16), w.astype(jnp.float16), s)
    with pytest.raises(TypeError, match="x must be float32"):
        grouped_dense(x.astype(jnp.int32), w.astype(jnp.int32), s)
    with pytest.raises(ValueError, match="bias must have shape"):
        grouped_dense(x, w, s, jnp.ones((2, 8)))
    with pytest.raises(ValueError, match=r"at least one group \(G >= 1\)"):
        grouped_dense(x, jnp.ones((0, 8, 16)), jnp.zeros((0,), jnp.int32))
    with pytest.raises(ValueError, match="unknown implementation"):
        grouped_dense(x, w, s, implementation="cutlass")


@pytest.mark.parametrize(
    "args, match",
    [
        ((None, "w", "s"), r"te_ops\.grouped_dense: x is required \(an array\), got None"),
        (("x", None, "s"), r"kernels is required"),
        (("x", "w", None), r"group_sizes is required"),
        (("xc", "w", "s"), r"x must be float32, bfloat16 or float16, got dtype complex64"),
        (("x", "wi", "s"), r"kernels must be float32, bfloat16 or float16, got dtype int32"),
        (("x", "w", "sb"), r"group_sizes must be int32, got dtype bool"),
        (("x", "w", "s", "bi"), r"bias must be float32, bfloat16 or float16, got dtype int32"),
    ],
)
def test_missing_integer_and_complex_inputs_are_refused(args, match):
    vals = {
        "x": jnp.ones((16, 8)),
        "xc": jnp.ones((16, 8), jnp.complex64),
        "w": jnp.ones((2, 8, 16)),
        "wi": jnp.ones((2, 8, 16), jnp.int32),
        "s": jnp.array([8, 8], jnp.int32),
        "sb": jnp.array([True, False]),
        "bi": jnp.ones((2, 16), jnp.int32),
        None: None,
    }
    with pytest.raises(TypeError, match=match):
        grouped_dense(*[vals[a] for a in args])


def test_k_and_n_not_multiples_of_8():
    """The Triton kernels need K and N multiples of 8; implementation=None then runs the reference
    (also on CUDA), a named "triton" is refused with that reason."""
    from te_ops.grouped_dense import triton as tri

    rng = np.random.default_rng(12)
    x, w, s, b = make(rng, 30, 12, 20, 3)
    assert_close(grouped_dense(x, w, s, b), direct(x, w, s, b), jnp.float32, scale=4)
    why = tri.unsupported_reason(dtype=jnp.bfloat16, kernels_dtype=jnp.bfloat16, m=30, k=12, n=20, g=3)
    assert "multiples of 8" in why and "K=12, N=20" in why
    assert tri.unsupported_reason(dtype=jnp.bfloat16, kernels_dtype=jnp.bfloat16, m=30, k=16, n=24, g=3) is None


@pytest.mark.parametrize("m,k,n", [(0, 8, 16), (40, 0, 16), (40, 8, 0), (0, 0, 0)])
def test_empty_axes_follow_the_definition(m, k, n):
    """M, K or N of length 0: the per-group formula (K = 0: bias[g] on group g's rows), forward and
    gradients, eager and under jit, and under vmap."""
    rng = np.random.default_rng(13)
    x, w, _, b = make(rng, m, k, n, 4)
    sizes = jnp.array([7, 0, 20, 5], jnp.int32)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    y = grouped_dense(x, w, sizes, b)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    assert_close(y, direct(x, w, sizes, b), jnp.float32, scale=4)
    assert_close(jax.jit(grouped_dense)(x, w, sizes, b), direct(x, w, sizes, b), jnp.float32, scale=4)
    if k == 0 and m and n:  # the defined K = 0 result, spelled out
        want = np.zeros((m, n), np.float32)
        want[:7], want[7:27], want[27:32] = b[0], b[2], b[3]
        np.testing.assert_array_equal(np.asarray(y), want)

    def loss(f):
        return lambda x, w, b: jnp.sum(f(x, w, sizes, b) * dy)

    want = jax.grad(loss(direct), argnums=(0, 1, 2))(x, w, b)
    for got in (
        jax.grad(loss(grouped_dense), argnums=(0, 1, 2))(x, w, b),
        jax.jit(jax.grad(loss(grouped_dense), argnums=(0, 1, 2)))(x, w, b),
    ):
        for a, e in zip(got, want, strict=True):
            assert a.shape == e.shape
            assert_close(a, e, jnp.float32, scale=8)
    yv = jax.vmap(lambda x: grouped_dense(x, w, sizes, b))(jnp.stack([x, x]))
    assert yv.shape == (2, m, n)


# sizes that cannot be checked at trace time: negative, summing past M, and large enough that an
# int32 prefix sum would wrap around (2 * (2**31 - 1) and 3 * 2**30 overflow int32)
_BIG = 2**31 - 1
_RUNTIME_SIZES = [
    [10, -5, 30, 0],
    [_BIG, _BIG, 5, 0],
    [10, _BIG, _BIG, 7],
    [-_BIG, 2**30, 2**30, 2**30],
    [3, -1, _BIG, -_BIG],
]


@pytest.mark.parametrize("sizes", _RUNTIME_SIZES, ids=str)
def test_sizes_out_of_range_have_the_defined_result(sizes):
    """Negative sizes count as 0; the group crossing row M is cut there, later groups are empty
    (zero dkernels and dbias); the prefix sum does not wrap around in int32. `direct` computes this
    with Python integers."""
    rng = np.random.default_rng(14)
    x, w, _, b = make(rng, 48, 16, 8, 4)
    s = jnp.asarray(sizes, jnp.int32)
    dy = jnp.asarray(rng.standard_normal((48, 8)), jnp.float32)
    fn = jax.jit(lambda x, w, s, b: grouped_dense(x, w, s, b))
    assert_close(fn(x, w, s, b), direct(x, w, s, b), jnp.float32, scale=4)
    got = jax.jit(jax.grad(lambda x, w, b: jnp.sum(grouped_dense(x, w, s, b) * dy), argnums=(0, 1, 2)))(x, w, b)
    want = jax.grad(lambda x, w, b: jnp.sum(direct(x, w, s, b) * dy), argnums=(0, 1, 2))(x, w, b)
    for a, e in zip(got, want, strict=True):
        assert_close(a, e, jnp.float32, scale=8)
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), 48)
    starts = np.concatenate([[0], ends[:-1]])
    from te_ops.grouped_dense.reference import group_bounds

    start, end = group_bounds(s, 48)
    np.testing.assert_array_equal(np.asarray(start), starts)
    np.testing.assert_array_equal(np.asarray(end), ends)


def test_dispatch_reference_on_cpu_and_triton_refused_without_gpu():
    fam = registry.family("grouped_dense")
    assert set(fam.names) == {"triton", "reference"}
    x, w, s = (
        jnp.ones((16, 8), jnp.bfloat16),
        jnp.ones((2, 8, 16), jnp.bfloat16),
        jnp.array([8, 8], jnp.int32),
    )
    hlo = jax.jit(lambda x: grouped_dense(x, w, s)).lower(x).as_text()
    assert "triton_kernel_call_ffi" not in hlo
    with pytest.raises(registry.ImplementationUnavailableError, match="triton"):
        jax.jit(lambda x: grouped_dense(x, w, s, implementation="triton")).lower(x)
    with registry.use_implementation(grouped_dense="reference"):
        assert grouped_dense(x, w, s).shape == (16, 16)


def _ep_data(rng, shards, m_local, k, n, g_local, exact):
    xs, sizes = [], []
    for _ in range(shards):
        s = uneven_sizes(rng, g_local, m_local, fill=1.0 if exact else 0.7, zeros=1)
        if exact:
            s[np.argmax(s)] += m_local - s.sum()  # each shard's groups fill its rows exactly
        sizes.append(s)
        xs.append(rng.standard_normal((m_local, k)))
    x = jnp.asarray(np.concatenate(xs), jnp.float32)
    w = jnp.asarray(rng.standard_normal((shards * g_local, k, n)) / np.sqrt(k), jnp.float32)
    b = jnp.asarray(rng.standard_normal((shards * g_local, n)), jnp.float32)
    return x, w, jnp.asarray(np.concatenate(sizes)), b


def _fwd_bwd(dy):
    def f(x, w, s, b):
        y, vjp = jax.vjp(lambda x, w, b: grouped_dense(x, w, s, b), x, w, b)
        return (y, *vjp(dy))

    return f


def test_sharded_expert_parallel():
    mesh = cpu_mesh((8,), ("ep",))
    rng = np.random.default_rng(5)
    m_local, k, n, g_local = 24, 16, 8, 2
    # exact fill: the per-shard groups concatenate to the global layout, so unsharded == sharded
    x, w, s, b = _ep_data(rng, 8, m_local, k, n, g_local, exact=True)
    dy = jnp.asarray(rng.standard_normal((8 * m_local, n)), jnp.float32)
    specs = [PS("ep"), PS("ep"), PS("ep"), PS("ep")]
    out_specs = (PS("ep"), PS("ep"), PS("ep"), PS("ep"))
    sharded, unsharded, counts = run_sharded(_fwd_bwd(dy), [x, w, s, b], specs, out_specs, mesh=mesh)
    for a, e in zip(sharded, unsharded, strict=True):
        assert_close(a, e, jnp.float32, scale=8)
    assert sum(counts.values()) == 0, counts
    # with a zero tail per shard: each shard is its own grouped GEMM (the EP contract)
    x, w, s, b = _ep_data(rng, 8, m_local, k, n, g_local, exact=False)
    sharded, _, counts = run_sharded(_fwd_bwd(dy), [x, w, s, b], specs, out_specs, mesh=mesh)
    for i in range(8):
        rows, grp = slice(i * m_local, (i + 1) * m_local), slice(i * g_local, (i + 1) * g_local)
        want = _fwd_bwd(dy[rows])(x[rows], w[grp], s[grp], b[grp])
        got = [sharded[0][rows], sharded[1][rows], sharded[2][grp], sharded[3][grp]]
        for a, e in zip(got, want, strict=True):
            assert_close(a, e, jnp.float32, scale=8)
    assert sum(counts.values()) == 0, counts


@pytest.mark.parametrize("parallel", ["ep", "tp"])
def test_sharded_float32_master_kernels(parallel):
    """bfloat16 x with float32 master kernels, expert or tensor parallel: the sharded result equals
    the unsharded one (dkernels float32), with the collectives of the same-dtype op."""
    mesh = cpu_mesh((8,), (parallel,))
    rng = np.random.default_rng(15)
    if parallel == "ep":
        x, w, s, b = _ep_data(rng, 8, 24, 16, 8, 2, exact=True)
        specs = [PS("ep")] * 4
        out_specs = (PS("ep"),) * 4
    else:
        x, w, s, b = make(rng, 64, 16, 64, 5)
        specs = [None, PS(None, None, "tp"), None, PS(None, "tp")]
        out_specs = (PS(None, "tp"), PS(), PS(None, None, "tp"), PS(None, "tp"))
    x, b = x.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((x.shape[0], w.shape[2])), jnp.bfloat16)
    sharded, unsharded, counts = run_sharded(_fwd_bwd(dy), [x, w, s, b], specs, out_specs, mesh=mesh)
    assert sharded[2].dtype == jnp.float32
    for a, e in zip(sharded, unsharded, strict=True):
        assert_close(a, e, a.dtype, scale=8)
    if parallel == "ep":
        assert sum(counts.values()) == 0, counts
    else:
        assert counts["all-reduce"] == 1 and counts["all-gather"] == 0, counts


def test_sharded_experts_without_sharded_rows_keep_the_unsharded_meaning():
    """kernels sharded on G with x replicated (FSDP-style weights) is not expert parallel: the
    kernels are gathered, the result equals the unsharded one."""
    mesh = cpu_mesh((8,), ("fsdp",))
    rng = np.random.default_rng(8)
    x, w, s, b = make(rng, 96, 16, 8, 8)
    dy = jnp.asarray(rng.standard_normal((96, 8)), jnp.float32)
    sharded, unsharded, counts = run_sharded(
        _fwd_bwd(dy), [x, w, s, b], [None, PS("fsdp"), None, PS("fsdp")], mesh=mesh
    )
    for a, e in zip(sharded, unsharded, strict=True):
        assert_close(a, e, jnp.float32, scale=8)
    assert counts["all-gather"] >= 1, counts


def test_sharded_tensor_parallel():
    mesh = cpu_mesh((8,), ("tp",))
    rng = np.random.default_rng(6)
    x, w, s, b = make(rng, 64, 16, 64, 5)
    dy = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    fwd = lambda x, w, s, b: grouped_dense(x, w, s, b)  # noqa: E731
    sharded, unsharded, counts = run_sharded(
        fwd, [x, w, s, b], [None, PS(None, None, "tp"), None, PS(None, "tp")], PS(None, "tp"), mesh=mesh
    )
    assert_close(sharded, unsharded, jnp.float32, scale=4)
    assert sum(counts.values()) == 0, counts  # forward: no collective
    sharded, unsharded, counts = run_sharded(
        _fwd_bwd(dy),
        [x, w, s, b],
        [None, PS(None, None, "tp"), None, PS(None, "tp")],
        (PS(None, "tp"), PS(), PS(None, None, "tp"), PS(None, "tp")),
        mesh=mesh,
    )
    for a, e in zip(sharded, unsharded, strict=True):
        assert_close(a, e, jnp.float32, scale=8)
    assert counts["all-reduce"] == 1, counts  # dx: one all-reduce over N
    assert counts["all-gather"] == 0 and counts["all-to-all"] == 0, counts


needs_triton = pytest.mark.skipif(
    tb.triton_unavailable_reason() is not None, reason=f"needs Triton: {tb.triton_unavailable_reason()}"
)


def _run_interpreter(mode: str):
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0 and "interpret failures: 0" in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])


@needs_triton
def test_triton_kernels_under_interpreter():
    _run_interpreter("--interpret")


@needs_triton
def test_triton_kernels_edge_sizes_under_interpreter():
    """The size vectors of the GPU test_edge_sizes_one_executable, scaled down: one group owning every
    row, all groups empty, sizes summing past M (a group clipped at M, groups starting at or past M),
    tiny groups, groups ending mid-tile; plus a negative size (clamped to 0). Regression: the kernels'
    group table once put a clipped group's start at ``end - size`` (not the previous group's end), so
    it overlapped the group before it (y, dx and dkernels wrong for [300, 300, 300, ...] at M=640);
    and sizes whose int32 prefix sum wraps around left output rows unwritten."""
    _run_interpreter("--interpret-edge")


@needs_triton
def test_triton_tma_kernels_under_interpreter():
    """The TMA-descriptor variant (GemmConfig.USE_TMA; K a multiple of BK, else the pointer loads) on
    the general and the clipped / negative-size cases: A tiles that run into the next group or past M,
    B tiles read from the 2D [G * K, N] / [G * N, K] view."""
    _run_interpreter("--interpret-tma")


@needs_triton
def test_triton_lowering_for_sm90_without_gpu(stub_triton_launcher):
    """Lowers fwd + bwd for CUDA here (kernels compiled for sm_90, jaxlib's launcher stubbed): the
    kernels compile, use wgmma, fit in shared memory, and a new M reuses the compiled kernels."""
    launches = stub_triton_launcher

    def lower(m):
        k, n, g = 256, 128, 5

        def loss(x, w, b, s):
            return jnp.sum(grouped_dense(x, w, s, b, implementation="triton").astype(jnp.float32))

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        args = (
            jnp.ones((m, k), jnp.bfloat16),
            jnp.ones((g, k, n), jnp.bfloat16),
            jnp.ones((g, n), jnp.bfloat16),
            jnp.ones((g,), jnp.int32),
        )
        with tb.target_override(("cuda", 90, 32)):
            return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    from te_ops.grouped_dense import triton as tri

    # the defaults on sm_90: the Gluon warp-specialized kernel for forward and dx, Triton for dkernels
    txt = lower(1000)
    assert txt.count("triton_kernel_call_ffi") == 3  # forward, dx, dkernels
    names = sorted(n for n, _, _ in launches)
    assert names == ["te_grouped_gemm_ws", "te_grouped_gemm_ws", "te_grouped_wgrad"], names
    # the Triton kernels (as on other GPUs, or where K is not a multiple of BK)
    launches.clear()
    plain = tri.GemmConfig()
    with tri.config_override(plain, plain, None):
        txt = lower(1000)
        names = sorted(n for n, _, _ in launches)
        assert names == ["te_grouped_gemm", "te_grouped_gemm", "te_grouped_wgrad"], names
        for _, compiled, _grid in launches:
            assert "wgmma.mma_async" in compiled.asm["ptx"]
            assert compiled.num_warps == 8 and 0 < compiled.shared <= 227 * 1024
            assert compiled.global_scratch_size == 0
        before = tb.counters()["compiles"]
        lower(3000)
        assert tb.counters()["compiles"] == before, "a new M must not recompile"
    # a tile configuration set with config_override reaches every kernel of the public op
    launches.clear()
    small = tri.GemmConfig(BM=128, BN=128, BK=64, GROUP_M=4, num_warps=4, num_stages=4)
    with tri.config_override(small, small, tri.WgradConfig(128, 128, 64, 4, 4, 4)):
        lower(1000)
    assert [c.num_warps for _, c, _ in launches] == [4, 4, 4]
    assert all(c.shared == (128 * 64 + 64 * 128) * 2 * 4 for _, c, _ in launches), [c.shared for _, c, _ in launches]
    # the Gluon warp-specialized kernel (GLUON_WS) for forward and dx: 8 consumer warps + a producer
    # warpgroup, setmaxnreg, TMA loads and stores, one compile per config; dkernels stays Triton
    launches.clear()
    ws = tri.GemmConfig(GLUON_WS=True)
    with tri.config_override(ws, ws, None):
        txt = lower(1000)
        lower(2500)
    names = sorted(n for n, _, _ in launches)
    assert names == ["te_grouped_gemm_ws"] * 4 + ["te_grouped_wgrad"] * 2, names
    for name, compiled, grid in launches:
        if name != "te_grouped_gemm_ws":
            continue
        ptx = compiled.asm["ptx"]
        assert compiled.num_warps == 12 and "setmaxnreg" in ptx and "wgmma.mma_async" in ptx
        assert "cp.async.bulk.tensor" in ptx and compiled.shared <= 227 * 1024 and grid[0] <= 132
        # the descriptors' global scratch is the te_scratch buffer (the third-from-last parameter),
        # not the hidden one jaxlib would allocate per launch (which breaks command buffers)
        assert compiled.global_scratch_size == 0
        entry = ptx[ptx.index(".entry") : ptx.index(")", ptx.index(".entry"))]
        n = len(re.findall(rf"{compiled.name}_param_\d+", entry))
        assert f"[{compiled.name}_param_{n - 3}]" in ptx and f"[{compiled.name}_param_{n - 2}]" not in ptx
    # 14 programs (M=1000: 8 + 6 tile rows, one N tile) x 512 bytes for the forward and dx launches
    assert txt.count("tensor<7168xui8>") >= 2, re.findall(r"tensor<\d+xui8>", txt)
    # the Triton TMA variants (USE_TMA) build descriptors on the device too: same redirection
    launches.clear()
    tma_cfg = tri.GemmConfig(USE_TMA=True)
    with tri.config_override(tma_cfg, tma_cfg, tri.WgradConfig(USE_TMA=True)):
        lower(1000)
    assert sorted(n for n, _, _ in launches) == ["te_grouped_gemm", "te_grouped_gemm", "te_grouped_wgrad"]
    for _, compiled, _grid in launches:
        ptx = compiled.asm["ptx"]
        entry = ptx[ptx.index(".entry") : ptx.index(")", ptx.index(".entry"))]
        n = len(re.findall(rf"{compiled.name}_param_\d+", entry))
        assert compiled.global_scratch_size == 0 and "cp.async.bulk.tensor" in ptx
        assert f"[{compiled.name}_param_{n - 3}]" in ptx and f"[{compiled.name}_param_{n - 2}]" not in ptx
    # the ping-pong variant: two 4-warp consumer warpgroups and the producer warp (12 warps in all)
    launches.clear()
    pp = tri.GemmConfig(BN=128, num_stages=4, GLUON_WS=True, PINGPONG=True)
    with tri.config_override(pp, pp, None):
        lower(1000)
    names = sorted(n for n, _, _ in launches)
    assert names == ["te_grouped_gemm_pingpong"] * 2 + ["te_grouped_wgrad"], names
    for name, compiled, _grid in launches:
        if name == "te_grouped_gemm_pingpong":
            assert compiled.num_warps == 12 and "setmaxnreg" in compiled.asm["ptx"]
            assert compiled.shared <= 227 * 1024


# ----------------------------------------------------------------------------------------------
# Interpreter harness (run as a script in a subprocess with TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------


_INTERPRET_CASES = [  # (M, K, N, sizes)
    (70, 32, 24, [7, 0, 20, 3, 10]),
    (64, 40, 16, [0, 33, 31]),
    (40, 16, 32, [0, 0, 0]),
    (50, 16, 16, [50]),
    (45, 24, 40, [0, 17, 1, 0, 2]),
    (90, 16, 16, [3, 0, 5, 1, 0, 7, 2, 9, 0, 4, 6, 1, 0, 8, 3, 2, 5, 0, 1, 10]),
]

# tests/gpu/test_grouped_dense_gpu.py::test_edge_sizes_one_executable at 1/16 scale (M=640 -> 40,
# BM=128 -> 16; 300 -> 19 is a group that ends 3 rows into a tile), plus sums past M
_EDGE_CASES = [
    (40, 16, 16, [0, 0, 40, 0, 0, 0]),
    (40, 16, 16, [0] * 6),
    (40, 16, 16, [19, 19, 19, 0, 0, 0]),  # clipped: group 2 is rows [38, 40)
    (40, 16, 16, [1, 2, 3, 4, 5, 6]),
    (40, 16, 16, [9, 7, 8, 1, 0, 15]),
    (40, 16, 16, [10, 25, 7, 5, 0, 3]),  # groups 3 and 5 start past M (empty after clipping)
    (40, 16, 16, [5, -3, 20, 30, 0, 1]),  # negative size -> 0; group 3 clipped
    # an int32 prefix sum of these wraps around; the kernels' int64 one does not
    (40, 16, 16, [2**31 - 1, 2**31 - 1, 5, 0, 0, 0]),
    (40, 16, 16, [10, 2**31 - 1, 2**31 - 1, 7, -(2**31 - 1), 1]),
    (40, 16, 16, [-5, 2**30, 2**30, 2**30, 3, 2]),
]


def _interpret_main(cases=_INTERPRET_CASES, bias_modes=(True, False), tma=False) -> int:
    sys.path.insert(0, ROOT)
    from tests.te_ops import _triton_interpret as ti  # sets TRITON_INTERPRET=1 before triton loads

    jax.config.update("jax_platforms", "cpu")
    ti._fix_interpreter_for_numpy2()
    from te_ops.grouped_dense import reference as ref
    from te_ops.grouped_dense import triton as tri

    tri.tb.triton_call = ti.interpreted_call
    tri.num_sms = lambda: 3  # a few persistent programs, each walking several tiles
    cfg = tri.GemmConfig(BM=16, BN=16, BK=16, GROUP_M=2, num_warps=4, num_stages=2, FLATTEN=True, USE_TMA=tma)
    wcfg = tri.WgradConfig(BKO=16, BN=16, BR=16, GROUP_K=2, num_warps=4, num_stages=2, USE_TMA=tma)
    rng = np.random.default_rng(0)
    failures = 0
    for m, k, n, sizes in cases:
        g = len(sizes)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float16)
        w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float16)
        b = jnp.asarray(rng.standard_normal((g, n)), jnp.float16)
        gs = jnp.array(sizes, jnp.int32)
        dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float16)
        for has_bias in bias_modes:
            with tri.config_override(cfg, cfg, wcfg):
                y, res = tri.forward(x, w, gs, b if has_bias else None, has_bias=has_bias)
                got = tri.backward(res, dy, has_bias=has_bias)
            yr, rres = ref.forward(x, w, gs, b if has_bias else None, has_bias=has_bias)
            want = ref.backward(rres, dy, has_bias=has_bias)
            for name, a, e in [
                ("y", y, yr),
                ("dx", got[0], want[0]),
                ("dk", got[1], want[1]),
                ("db", got[2], want[2]),
            ]:
                if e is None:
                    continue
                a = np.asarray(jnp.asarray(a, jnp.float32))
                e = np.asarray(jnp.asarray(e, jnp.float32))
                ok = not np.isnan(a).any() and np.allclose(a, e, rtol=1e-2, atol=1e-2 * max(1.0, np.abs(e).max()))
                if not ok:
                    failures += 1
                    print(
                        f"FAIL {name} M={m} K={k} N={n} sizes={sizes} bias={has_bias} "
                        f"nan={np.isnan(a).sum()} err={np.nanmax(np.abs(a - e))}"
                    )
    print(f"interpret failures: {failures}")
    return failures


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.exit(1 if _interpret_main() else 0)
if __name__ == "__main__" and "--interpret-edge" in sys.argv:
    sys.exit(1 if _interpret_main(_EDGE_CASES, bias_modes=(True,)) else 0)
if __name__ == "__main__" and "--interpret-tma" in sys.argv:
    sys.exit(1 if _interpret_main(_INTERPRET_CASES + _EDGE_CASES[:7], bias_modes=(True,), tma=True) else 0)
