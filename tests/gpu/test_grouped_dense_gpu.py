"""GPU tests of te_ops.grouped_dense: the Triton grouped GEMM vs the reference (run on the same GPU
through XLA, fp32 maths), forward and backward, random uneven group sizes with empty groups and
sum < M, bf16 and fp16, with and without bias, every kernel output NaN-poisoned (the bridge honours
native.poisoned_outputs), one compile for many group sizes, and under command buffers (subprocess
with XLA_FLAGS: the Triton launches sit inside a command_buffer computation and replays with new
device-side group sizes stay correct). Budget: < 90 s on an H200."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops._core import native
from te_ops._core import testing as T
from te_ops.grouped_dense import api, grouped_dense
from tests.gpu.cmdbuf import run_script_under_command_buffers

pytestmark = pytest.mark.gpu


def _reason():
    return api.FAMILY.get("triton").available() or native.cuda_device_unavailable_reason()


needs_triton = pytest.mark.skipif(_reason() is not None, reason=f"triton: {_reason()}")


def uneven_sizes(seed, g, m, fill=0.85, zeros=2):
    rng = np.random.default_rng(seed)
    sizes = np.floor(rng.dirichlet(np.full(g, 0.6)) * m * fill).astype(np.int32)
    sizes[rng.choice(g, size=min(zeros, g), replace=False)] = 0
    return jnp.asarray(sizes)


def make(seed, m, k, n, g, dtype):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(ks[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    b = jax.random.normal(ks[2], (g, n), jnp.float32).astype(dtype)
    dy = jax.random.normal(ks[3], (m, n), jnp.float32).astype(dtype)
    return x, w, b, dy


def run(impl, x, w, s, b, dy):
    def step(x, w, s, b, dy):
        if b is None:
            y, vjp = jax.vjp(lambda x, w: grouped_dense(x, w, s, implementation=impl), x, w)
        else:
            y, vjp = jax.vjp(lambda x, w, b: grouped_dense(x, w, s, b, implementation=impl), x, w, b)
        return (y, *vjp(dy))

    with native.poisoned_outputs():
        return jax.jit(step)(x, w, s, b, dy)


def check(got, want, dtype, names=("y", "dx", "dkernels", "dbias")):
    for name, a, e in zip(names, got, want, strict=False):
        a32 = np.asarray(jnp.asarray(a, jnp.float32))
        assert not np.isnan(a32).any(), f"{name}: unwritten (NaN-poisoned) element"
        scale = float(np.abs(np.asarray(jnp.asarray(e, jnp.float32))).max(initial=0.0)) + 1e-6
        T.assert_close(a, e, dtype, scale=max(1.0, scale), err_msg=name)


# (M, K, N, G): multiples of the tiles; K not a multiple of BK (masked K loop); N not a multiple of
# BN (masked columns); many small groups; one group.
BF16, F16 = jnp.bfloat16, jnp.float16
CASES = [
    ((2048, 256, 512, 8), BF16, True),
    ((2048, 256, 512, 8), F16, False),
    ((1000, 136, 200, 5), BF16, False),
    ((1000, 136, 200, 5), F16, True),
    ((4096, 512, 256, 64), BF16, True),
    ((4096, 512, 256, 64), F16, False),
    ((777, 64, 1024, 1), BF16, False),
    ((777, 64, 1024, 1), F16, True),
]


@needs_triton
@pytest.mark.parametrize("shape,dtype,with_bias", CASES)
def test_triton_matches_reference(shape, dtype, with_bias):
    m, k, n, g = shape
    x, w, b, dy = make(sum(shape), m, k, n, g, dtype)
    s = uneven_sizes(m + g, g, m, zeros=min(2, g - 1))
    b = b if with_bias else None
    got = run("triton", x, w, s, b, dy)
    want = run("reference", x, w, s, b, dy)
    check(got, want, dtype)
    used = int(np.minimum(np.cumsum(np.maximum(np.asarray(s), 0)), m)[-1])
    assert np.all(np.asarray(got[0][used:], np.float32) == 0), "tail rows must be zero"
    assert np.all(np.asarray(got[1][used:], np.float32) == 0), "tail rows of dx must be zero"
    empty = np.nonzero(np.asarray(s) == 0)[0]
    assert np.all(np.asarray(got[2][empty], np.float32) == 0), "empty groups must get zero dkernels"


@needs_triton
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_float32_master_kernels(dtype):
    """float32 kernels with a 16-bit x: the Triton path against the reference (dkernels float32,
    written straight from the wgrad kernel's float32 accumulator, NaN-poisoned outputs), and y / dx
    bit-equal to the call with kernels.astype(x.dtype)."""
    m, k, n, g = 1000, 136, 200, 5
    x, w, b, dy = make(17, m, k, n, g, jnp.float32)
    x, b, dy = x.astype(dtype), b.astype(dtype), dy.astype(dtype)
    s = uneven_sizes(m + 1, g, m, zeros=1)
    got = run("triton", x, w, s, b, dy)
    want = run("reference", x, w, s, b, dy)
    assert got[2].dtype == jnp.float32
    check(got, want, dtype)
    cast = run("triton", x, w.astype(dtype), s, b, dy)
    T.assert_same_bytes(got[:2], cast[:2])
    T.assert_close(got[2], cast[2].astype(jnp.float32), dtype, err_msg="dkernels vs the cast call")


# The TMA-descriptor variants of the forward/dx and dkernels kernels (opt-in USE_TMA): K a multiple of
# BK (its precondition) and not (it must fall back to pointer loads), N not a multiple of BN, the
# last group ending at M (TMA zero fill) and before it (tail rows), bias on and off.
TMA_CASES = [((2048, 256, 512, 8), BF16, True), ((1000, 128, 200, 5), F16, False), ((1000, 136, 200, 5), BF16, False)]


def _sizes(m, g, fill):
    s = np.array(uneven_sizes(m + g + 1, g, m, fill=fill, zeros=min(2, g - 1)))  # a writable copy
    if fill == 1.0:
        s[np.argmax(s)] += m - s.sum()  # the groups cover every row
    return jnp.asarray(s)


@needs_triton
@pytest.mark.parametrize("shape,dtype,with_bias", TMA_CASES)
@pytest.mark.parametrize("fill", [0.85, 1.0])
def test_tma_variant_matches_reference(shape, dtype, with_bias, fill):
    from te_ops.grouped_dense import triton as tri

    m, k, n, g = shape
    x, w, b, dy = make(sum(shape) + 1, m, k, n, g, dtype)
    s = _sizes(m, g, fill)
    b = b if with_bias else None
    cfg = tri.GemmConfig(USE_TMA=True)
    with tri.config_override(cfg, cfg, tri.WgradConfig(USE_TMA=True)):
        got = run("triton", x, w, s, b, dy)
    want = run("reference", x, w, s, b, dy)
    check(got, want, dtype)


# The Gluon warp-specialized Hopper kernel (GLUON_WS): the TMA cases (K = 136 is not a multiple of
# BK: the Triton kernel runs instead), both tile shapes it is offered with, and a case with many
# tiles per program (M = 20000) so the stage ring wraps across tiles and groups.
WS_CASES = [*TMA_CASES, ((20000, 512, 1024, 16), BF16, False)]


@needs_triton
@pytest.mark.parametrize("shape,dtype,with_bias", WS_CASES)
@pytest.mark.parametrize("fill", [0.85, 1.0])
@pytest.mark.parametrize("bn,stages,pingpong", [(256, 3, False), (128, 4, False), (128, 4, True)])
def test_gluon_ws_variant_matches_reference(shape, dtype, with_bias, fill, bn, stages, pingpong):
    from te_ops.grouped_dense import triton as tri

    if tri.gluon_ws_unavailable_reason():
        pytest.skip(f"Gluon warp-specialized grouped GEMM unavailable: {tri.gluon_ws_unavailable_reason()}")
    m, k, n, g = shape
    x, w, b, dy = make(sum(shape) + 3, m, k, n, g, dtype)
    s = _sizes(m, g, fill)
    b = b if with_bias else None
    cfg = tri.GemmConfig(BN=bn, num_stages=stages, GLUON_WS=True, PINGPONG=pingpong)
    with tri.config_override(cfg, cfg, None):
        got = run("triton", x, w, s, b, dy)
    want = run("reference", x, w, s, b, dy)
    check(got, want, dtype)


@needs_triton
def test_edge_sizes_one_executable():
    """All rows in one group, all groups empty, sizes summing past M (clipped), tiny groups: one
    compiled executable (sizes are device data, poisoned outputs), each result vs the reference."""
    m, k, n, g = 640, 128, 256, 6
    x, w, b, dy = make(7, m, k, n, g, jnp.bfloat16)

    def step(impl):
        def f(x, w, s, b, dy):
            y, vjp = jax.vjp(lambda x, w, b: grouped_dense(x, w, s, b, implementation=impl), x, w, b)
            return (y, *vjp(dy))

        return f

    s0 = jnp.zeros((g,), jnp.int32)
    with native.poisoned_outputs():  # trace-time setting: lower inside the block
        fn = jax.jit(step("triton")).lower(x, w, s0, b, dy).compile()
    ref = jax.jit(step("reference"))
    all_sizes = (
        [0, 0, 640, 0, 0, 0],
        [0] * 6,
        [300, 300, 300, 0, 0, 0],
        [1, 2, 3, 4, 5, 6],
        [129, 127, 128, 1, 0, 255],
        [100, 500, 60, 90, 0, 10],  # group 2 clipped to [600, 640); groups 3 and 5 start past M
    )
    failures = []  # every size vector is checked; the message names each one that fails
    for sizes in all_sizes:
        s = jnp.asarray(sizes, jnp.int32)
        try:
            check(fn(x, w, s, b, dy), ref(x, w, s, b, dy), jnp.bfloat16)
        except AssertionError as e:
            failures.append(f"sizes={sizes}: {str(e).strip()[:600]}")
    assert not failures, "\n\n".join(failures)


_BIG = 2**31 - 1


@needs_triton
def test_sizes_out_of_range_match_reference():
    """Sizes that cannot be checked at trace time (negative, summing past M, int32 prefix sums that
    would wrap around) give the reference's defined result: one executable, poisoned outputs."""
    m, k, n, g = 640, 128, 256, 6
    x, w, b, dy = make(11, m, k, n, g, jnp.bfloat16)

    def step(impl):
        def f(x, w, s, b, dy):
            y, vjp = jax.vjp(lambda x, w, b: grouped_dense(x, w, s, b, implementation=impl), x, w, b)
            return (y, *vjp(dy))

        return f

    with native.poisoned_outputs():
        fn = jax.jit(step("triton")).lower(x, w, jnp.zeros((g,), jnp.int32), b, dy).compile()
    ref = jax.jit(step("reference"))
    all_sizes = (
        [100, -50, 300, -1, 200, 100],  # negative sizes count as 0; group 4 cut at row 640
        [_BIG, _BIG, 5, 0, 0, 0],  # group 0 owns every row; int32 cumsum wraps at group 1
        [10, _BIG, _BIG, 7, -_BIG, 1],
        [-5, 2**30, 2**30, 2**30, 3, 2],
        [700, 0, 0, 0, 0, 0],
    )
    failures = []
    for sizes in all_sizes:
        s = jnp.asarray(sizes, jnp.int32)
        try:
            check(fn(x, w, s, b, dy), ref(x, w, s, b, dy), jnp.bfloat16)
        except AssertionError as e:
            failures.append(f"sizes={sizes}: {str(e).strip()[:600]}")
    assert not failures, "\n\n".join(failures)


@needs_triton
def test_triton_eager_and_jit():
    """implementation="triton" called eagerly (no jit: each primitive runs on its own) and under jit,
    forward and gradients, against the reference."""
    m, k, n, g = 512, 64, 128, 4
    x, w, b, dy = make(12, m, k, n, g, jnp.bfloat16)
    s = jnp.array([100, 0, 250, 90], jnp.int32)

    def step(impl):
        def f(x, w, s, b, dy):
            y, vjp = jax.vjp(lambda x, w, b: grouped_dense(x, w, s, b, implementation=impl), x, w, b)
            return (y, *vjp(dy))

        return f

    want = jax.jit(step("reference"))(x, w, s, b, dy)
    check(step("triton")(x, w, s, b, dy), want, jnp.bfloat16)
    check(jax.jit(step("triton"))(x, w, s, b, dy), want, jnp.bfloat16)
    y = grouped_dense(x, w, s, implementation="triton")  # eager forward alone, no bias
    check((y,), (grouped_dense(x, w, s, implementation="reference"),), jnp.bfloat16)


@needs_triton
@pytest.mark.parametrize("m,k,n", [(0, 64, 128), (300, 0, 128), (300, 64, 0)])
def test_empty_axes_match_reference(m, k, n):
    """M, K or N of length 0 through the Triton path (K = 0: bias[g] on group g's rows)."""
    g = 3
    x, w, b, dy = make(13, m, k, n, g, jnp.bfloat16)
    s = jnp.array([100, 0, 150], jnp.int32)
    got = run("triton", x, w, s, b, dy)
    want = run("reference", x, w, s, b, dy)
    assert [a.shape for a in got] == [a.shape for a in want]
    check(got, want, jnp.bfloat16)


_CMD_BUFFER_SCRIPT = textwrap.dedent("""
    import json, os
    import jax, jax.numpy as jnp, numpy as np
    from te_ops._core import triton_bridge as tb
    from te_ops.grouped_dense import grouped_dense
    from tests.gpu.cmdbuf import assert_triton_in_command_buffers
    m, k, n, g = 2048, 256, 512, 8
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (g, k, n), jnp.float32) / 16).astype(jnp.bfloat16)
    b = jax.random.normal(ks[2], (g, n), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(ks[3], (m, n), jnp.float32).astype(jnp.bfloat16)
    def step(impl):
        def f(x, w, s, b, dy):
            y, vjp = jax.vjp(lambda x, w, b: grouped_dense(x, w, s, b, implementation=impl), x, w, b)
            return (y, *vjp(dy))
        f.__name__ = f"gd_cmdbuf_{impl}"  # -> XLA module jit_gd_cmdbuf_<impl> in the dump
        return jax.jit(f)
    fn, ref = step("triton"), step("reference")
    s0 = jnp.array([256] * 8, jnp.int32)
    hlo = fn.lower(x, w, s0, b, dy).compile().as_text()
    # XLA (jax 0.11.2) forms command buffers on the thunk sequence after the HLO passes, so the
    # proof is the thunk dump (see docs/triton_bridge.md), not the optimized HLO text.
    rep = tb.command_buffer_report(hlo, tb.find_thunk_dump(os.environ["TE_CMDBUF_DUMP_DIR"], "jit_gd_cmdbuf_triton"))
    print("CMDBUF " + json.dumps(rep))
    assert_triton_in_command_buffers(rep)
    rng = np.random.default_rng(0)
    for i in range(4):  # graph replays with new device-side sizes
        sz = np.floor(rng.dirichlet(np.full(g, 0.6)) * m * 0.9).astype(np.int32); sz[i] = 0
        s = jnp.asarray(sz)
        got, want = fn(x, w, s, b, dy), ref(x, w, s, b, dy)
        for a, e in zip(got, want):
            a = np.asarray(a, np.float32); e = np.asarray(e, np.float32)
            assert not np.isnan(a).any()
            np.testing.assert_allclose(a, e, rtol=3e-2, atol=3e-2 * max(1.0, np.abs(e).max()))
    print("OK cmdbuf")
""")


@needs_triton
def test_under_command_buffers(tmp_path):
    r = run_script_under_command_buffers(_CMD_BUFFER_SCRIPT, tmp_path)
    assert r.returncode == 0 and "OK cmdbuf" in r.stdout, (r.stdout[-3000:], r.stderr[-5000:])
