"""GPU tests of te_ops dense: the cuBLASLt native path vs the reference, forward and backward, with
poisoned outputs, odd sizes, and under XLA command buffers (CUDA graphs) with the handler counters."""

import json
import os
import subprocess
import sys
import textwrap
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops._core import native
from te_ops._core import testing as T
from te_ops.dense import dense
from te_ops.dense import native as dense_native

_WHY = native.native_unavailable_reason("_native_cublaslt", "dense")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_WHY is not None, reason=f"GPU test: {_WHY}"),
]

ACTS = [None, "gelu", "gelu_tanh", "relu", "silu"]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (x shape, N): aligned; not multiples of 8/16 anywhere (M, K, N odd); rank-1 x.
SHAPES = [((4, 32, 128), 192, True), ((4, 32, 128), 192, False), ((37, 29), 53, True), ((5,), 7, True)]


def _inputs(x_shape, n, dtype, bias, seed):
    k = jax.random.split(jax.random.key(seed), 4)
    kdim = x_shape[-1]
    x = jax.random.normal(k[0], x_shape, jnp.float32).astype(dtype)
    w = (jax.random.normal(k[1], (kdim, n), jnp.float32) / np.sqrt(kdim)).astype(dtype)
    b = jax.random.normal(k[2], (n,), jnp.float32).astype(dtype) if bias else None
    ct = jax.random.normal(k[3], (*x_shape[:-1], n), jnp.float32)
    return x, w, b, ct


def _fwd_bwd(impl, act, has_bias):
    """jit-able (x, w, b, ct) -> (y, (dx, dkernel[, dbias])) through jax.vjp (the training path)."""

    def f(x, w, b, ct):
        args = (x, w, b) if has_bias else (x, w)
        y, vjp = jax.vjp(lambda *a: dense(*a, activation=act, implementation=impl), *args)
        return y, vjp(ct.astype(y.dtype))

    return f


def _scale(a):
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32)), initial=0.0)) + 1.0


def _assert_fwd_bwd_close(y, grads, y_ref, grads_ref, dtype, tag=""):
    """y and (dx, dkernel, dbias) against the reference, each with the dtype's tolerance."""
    T.assert_close(y, y_ref, dtype, scale=_scale(y_ref), err_msg=f"y {tag}")
    names = ("dx", "dkernel", "dbias")[: len(grads)]  # no dbias without a bias
    for name, a, e in zip(names, grads, grads_ref, strict=True):
        T.assert_close(a, e, dtype, scale=_scale(e), err_msg=f"{name} {tag}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("x_shape, n, has_bias", SHAPES, ids=lambda v: str(v))
def test_native_matches_reference_fwd_bwd_poisoned(dtype, act, x_shape, n, has_bias):
    x, w, b, ct = _inputs(
        x_shape, n, dtype, has_bias, seed=zlib.crc32(f"{jnp.dtype(dtype).name}-{act}-{n}".encode()) % 1000
    )
    # Trace inside poisoned_outputs: every native result buffer starts as NaN, so an element the
    # handler fails to write shows up as NaN (assert_close rejects NaN).
    with native.poisoned_outputs():
        ours = jax.jit(_fwd_bwd("native", act, has_bias))
        text = ours.lower(x, w, b, ct).as_text()
        assert "te_dense_fwd" in text and "te_dense_bwd" in text
        y, grads = ours(x, w, b, ct)
    y_ref, grads_ref = jax.jit(_fwd_bwd("reference", act, has_bias))(x, w, b, ct)
    assert y.dtype == dtype and y.shape == y_ref.shape
    T.assert_close(y, y_ref, dtype, scale=_scale(y_ref), err_msg=f"y act={act}")
    assert len(grads) == (3 if has_bias else 2)
    for name, a, e in zip(("dx", "dkernel", "dbias"), grads, grads_ref, strict=False):
        assert a.dtype == dtype and a.shape == e.shape, name
        T.assert_close(a, e, dtype, scale=_scale(e), err_msg=f"{name} act={act}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_native_primal_only_path(dtype):
    """jit(dense) without a gradient uses the primal mode (fused epilogue without aux output)."""
    x, w, b, _ = _inputs((64, 96), 80, dtype, True, seed=3)
    for act in ACTS:
        with native.poisoned_outputs():
            y = jax.jit(lambda x, w, b, act=act: dense(x, w, b, activation=act, implementation="native"))(x, w, b)
        y_ref = dense(x, w, b, activation=act, implementation="reference")
        T.assert_close(y, y_ref, dtype, scale=_scale(y_ref), err_msg=f"act={act}")


def test_native_partial_mode_float32_sums():
    """mode='partial' (row-parallel building block): float32 x @ kernel, no bias, no activation."""
    x, w, _, _ = _inputs((48, 64), 40, jnp.bfloat16, False, seed=4)
    with native.poisoned_outputs():
        z, res = jax.jit(
            lambda x, w: dense_native.forward(x, w, None, activation=None, has_bias=False, mode="partial")
        )(x, w)
    assert res is None and z.dtype == jnp.float32
    expect = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    T.assert_close(z, expect, jnp.float32, scale=_scale(expect))


@pytest.mark.parametrize("x_shape, n", [((8, 16), 24), ((2, 1024, 256), 384), ((4096, 512), 16)])
def test_default_implementation_follows_the_auto_rule(x_shape, n):
    """implementation=None picks native exactly when the registry's auto rule says so (large GEMMs),
    and the default result matches the reference either way."""
    from te_ops._core import registry

    x, w, b, _ = _inputs(x_shape, n, jnp.bfloat16, True, seed=5)
    f = jax.jit(lambda x, w, b: dense(x, w, b, activation="gelu_tanh"))
    text = f.lower(x, w, b).as_text()
    call = dict(x_shape=x.shape, kernel_shape=w.shape)
    assert ("te_dense_fwd" in text) == registry.family("dense").get("native").auto_for(call)
    want = dense(x, w, b, activation="gelu_tanh", implementation="reference")
    T.assert_close(f(x, w, b), want, jnp.bfloat16, scale=_scale(want))


@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
def test_native_tall_skinny_router_gate_shape(has_bias):
    """The MoE router gate (x [16384, 1024] @ w [1024, 16]): cuBLASLt only offers algorithms that need
    a workspace (split-K) for its wgrad (m=16 n=1024 k=16384), so candidates timed without a workspace
    give 'no algorithm'. Forced to native so the auto rule cannot hide it."""
    x, w, b, ct = _inputs((16384, 1024), 16, jnp.bfloat16, has_bias, seed=7)
    with native.poisoned_outputs():
        y, grads = jax.jit(_fwd_bwd("native", None, has_bias))(x, w, b, ct)
    y_ref, grads_ref = jax.jit(_fwd_bwd("reference", None, has_bias))(x, w, b, ct)
    _assert_fwd_bwd_close(y, grads, y_ref, grads_ref, jnp.bfloat16)


@pytest.mark.parametrize("x_shape, n", [((0, 64), 32), ((48, 0), 32), ((48, 64), 0), ((2, 0, 16), 8)], ids=str)
@pytest.mark.parametrize("act", ["gelu_tanh", "relu", None], ids=str)
def test_native_empty_axes_match_reference(x_shape, n, act):
    """M, K or N of length 0 through implementation='native' (eager and jit): the reference's result
    (K = 0: activation(bias) on every row), no handler call for the empty GEMM."""
    x, w, b, ct = _inputs(x_shape, n, jnp.bfloat16, True, seed=13)
    y_ref, grads_ref = jax.jit(_fwd_bwd("reference", act, True))(x, w, b, ct)
    for run in (jax.jit(_fwd_bwd("native", act, True)), _fwd_bwd("native", act, True)):
        y, grads = run(x, w, b, ct)
        assert y.shape == y_ref.shape and [g.shape for g in grads] == [g.shape for g in grads_ref]
        _assert_fwd_bwd_close(y, grads, y_ref, grads_ref, jnp.bfloat16)
    text = jax.jit(_fwd_bwd("native", act, True)).lower(x, w, b, ct).as_text()
    assert "te_dense" not in text


def test_plan_cache_reports_timed_candidates():
    """dense_plans() lists the plans a native call created, each with its timed candidates (the
    fastest chosen) and column-major (m, n, k) = (N, M, K) for the forward."""
    x, w, b, _ = _inputs((640, 384), 512, jnp.bfloat16, True, seed=8)
    jax.block_until_ready(jax.jit(lambda x, w, b: dense(x, w, b, activation="relu", implementation="native"))(x, w, b))
    plans = [p for p in native._loaded["_native_cublaslt"].dense_plans() if (p["m"], p["n"], p["k"]) == (512, 640, 384)]
    assert plans, "no plan for the forward GEMM"
    for p in plans:
        timed = [t for t in p["candidate_ms"] if t > 0]
        assert p["candidates"] == len(p["candidate_ms"]) >= 1 and timed, p
        # the earliest candidate (cuBLASLt's order) within 2% of the fastest
        assert p["best_ms"] == p["candidate_ms"][p["chosen"]] <= 1.02 * min(timed) + 1e-9, p
        assert all(t <= 0 or t > 1.02 * min(timed) for t in p["candidate_ms"][: p["chosen"]]), p


def test_fused_epilogue_plans_widen_their_candidates():
    """A GELU_AUX_BIAS plan (training forward, gelu + bias) lists cuBLASLt's own candidates first and
    may add algorithms from the simpler epilogues' lists (accepted by cublasLtMatmulAlgoCheck)."""
    x, w, b, ct = _inputs((640, 384), 512, jnp.bfloat16, True, seed=9)
    jax.block_until_ready(jax.jit(_fwd_bwd("native", "gelu_tanh", True))(x, w, b, ct))
    plans = [
        p
        for p in native._loaded["_native_cublaslt"].dense_plans()
        if (p["m"], p["n"], p["k"], p["epilogue"]) == (512, 640, 384, 164) and p["forced"] < 0
    ]
    assert plans, "no GELU_AUX_BIAS plan for the training forward"
    for p in plans:
        assert 1 <= p["own_candidates"] <= p["candidates"] == len(p["candidate_ms"]), p


@pytest.mark.parametrize(
    "x_shape, n, dtype, act",
    [
        ((640, 384), 512, jnp.bfloat16, "gelu_tanh"),
        ((37, 29), 53, jnp.float16, "gelu"),
        ((96, 64), 80, jnp.float32, "relu"),
    ],
    ids=str,
)
def test_every_cublaslt_candidate_matches_reference(x_shape, n, dtype, act):
    """Each algorithm a plan may choose (cuBLASLt's own and the borrowed ones), forced one at a time
    through dense_force_candidate for the forward, dgrad and wgrad GEMMs, gives the reference result."""
    mod = native._loaded["_native_cublaslt"]
    x, w, b, ct = _inputs(x_shape, n, dtype, True, seed=10)
    y_ref, grads_ref = jax.jit(_fwd_bwd("reference", act, True))(x, w, b, ct)
    m, k = int(np.prod(x_shape[:-1])), x_shape[-1]
    gemms = {(n, m, k), (k, m, n), (n, k, m), (k, n, m)}  # column-major fwd, dgrad, wgrad (either operand order)
    most, i = 1, 0
    try:
        while i < most:
            mod.dense_force_candidate(i)
            with native.poisoned_outputs():
                y, grads = jax.jit(_fwd_bwd("native", act, True))(x, w, b, ct)  # a fresh closure: a new compile
            mine = [p for p in mod.dense_plans() if p["forced"] == i and (p["m"], p["n"], p["k"]) in gemms]
            assert len(mine) >= 3, mine  # forward, dgrad, wgrad plans created under this index
            for p in mine:
                assert p["chosen"] == min(i, p["candidates"] - 1), p
            most = max(p["candidates"] for p in mine)
            _assert_fwd_bwd_close(y, grads, y_ref, grads_ref, dtype, tag=f"candidate {i}")
            i += 1
    finally:
        mod.dense_force_candidate(-1)
    assert i == most >= 1


def test_plans_accumulate_split_k_in_float32():
    """No cached plan reduces split-K parts in the output type (INPLACE = 1, OUTPUT_TYPE = 4): those
    add bf16/f16 partial sums, and on (37, 29) x 53 relu that flipped ReLU masks near zero."""
    for dtype in (jnp.bfloat16, jnp.float16):
        x, w, b, ct = _inputs((37, 29), 53, dtype, True, seed=3)
        jax.block_until_ready(jax.jit(_fwd_bwd("native", "relu", True))(x, w, b, ct))
    plans = native._loaded["_native_cublaslt"].dense_plans()
    assert plans
    readable = 0
    for p in plans:
        a = p["algo"]
        if a["split_k"] < 0 or a["reduction_scheme"] < 0:
            continue  # config not queryable for this algorithm (seen for float32 plans)
        readable += 1
        assert a["split_k"] == 1 or a["reduction_scheme"] in (0, 2), p
    assert readable > 0, plans


@pytest.mark.parametrize(
    "x_shape, n, dtype, act",
    [
        ((2, 256, 1024), 4096, jnp.bfloat16, "gelu_tanh"),
        ((37, 29), 53, jnp.float16, "silu"),
        ((3, 100, 64), 136, jnp.float32, "gelu"),
    ],
    ids=str,
)
def test_every_backward_block_shape_matches_reference(x_shape, n, dtype, act):
    """Each compiled block shape of the dz/dbias kernel (dense_set_backward_variant, a benchmark
    hook) gives the reference gradients, vectorised and scalar, with poisoned outputs."""
    mod = native._loaded["_native_cublaslt"]
    info = mod.dense_backward_variants()
    x, w, b, ct = _inputs(x_shape, n, dtype, True, seed=11)
    y_ref, grads_ref = jax.jit(_fwd_bwd("reference", act, True))(x, w, b, ct)
    try:
        for v in range(len(info["variants"])):
            mod.dense_set_backward_variant(v)
            with native.poisoned_outputs():
                y, grads = jax.jit(_fwd_bwd("native", act, True))(x, w, b, ct)
            _assert_fwd_bwd_close(y, grads, y_ref, grads_ref, dtype, tag=f"variant {info['variants'][v]}")
    finally:
        mod.dense_set_backward_variant(info["active"])
    with pytest.raises(ValueError, match="variant must be in"):
        mod.dense_set_backward_variant(len(info["variants"]))


@pytest.mark.parametrize(
    "x_shape, n, dtype, act",
    [
        ((2, 256, 1024), 4096, jnp.bfloat16, "gelu_tanh"),
        ((37, 29), 53, jnp.float16, "relu"),
        ((4, 32, 128), 192, jnp.float16, "gelu_tanh"),
    ],
    ids=str,
)
def test_split_training_forward_matches_reference(x_shape, n, dtype, act):
    """The split training forward (dense_set_forward_split: BIAS-epilogue GEMM + our activation
    kernel, in place for relu) gives the reference outputs and gradients."""
    mod = native._loaded["_native_cublaslt"]
    x, w, b, ct = _inputs(x_shape, n, dtype, True, seed=12)
    y_ref, grads_ref = jax.jit(_fwd_bwd("reference", act, True))(x, w, b, ct)
    try:
        mod.dense_set_forward_split(True)
        with native.poisoned_outputs():
            y, grads = jax.jit(_fwd_bwd("native", act, True))(x, w, b, ct)
    finally:
        mod.dense_set_forward_split(False)
    _assert_fwd_bwd_close(y, grads, y_ref, grads_ref, dtype, tag="split forward")


def test_larger_bf16_gelu_tanh_training_shape():
    """A transformer-sized MLP slice (fused GELU_AUX_BIAS forward, dgelu+dbias kernel, two GEMMs)."""
    x, w, b, ct = _inputs((2, 256, 1024), 4096, jnp.bfloat16, True, seed=6)
    with native.poisoned_outputs():
        y, grads = jax.jit(_fwd_bwd("native", "gelu_tanh", True))(x, w, b, ct)
    y_ref, grads_ref = jax.jit(_fwd_bwd("reference", "gelu_tanh", True))(x, w, b, ct)
    _assert_fwd_bwd_close(y, grads, y_ref, grads_ref, jnp.bfloat16)


_CMD_BUFFER_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import jax, jax.numpy as jnp, numpy as np
    import te_ops
    from te_ops._core import native
    from te_ops.dense import dense

    results = {}
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (4, 64, 256), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (256, 384), jnp.float32) / 16).astype(jnp.bfloat16)
    b = jax.random.normal(k[2], (384,), jnp.float32).astype(jnp.bfloat16)
    ct = jax.random.normal(k[3], (4, 64, 384), jnp.float32).astype(jnp.bfloat16)

    def make(impl, act):
        def f(x, w, b, ct):
            y, vjp = jax.vjp(lambda x, w, b: dense(x, w, b, activation=act, implementation=impl), x, w, b)
            return (y,) + tuple(vjp(ct))
        return jax.jit(f)

    native.reset_counters()
    errs = {}
    for act in ("gelu_tanh", "silu", "relu"):
        ours, ref = make("native", act), make("reference", act)
        expect = ref(x, w, b, ct)
        for step in range(4):
            got = ours(x, w, b, ct)
        jax.block_until_ready(got)
        errs[act] = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - e.astype(jnp.float32))) /
                           (float(jnp.max(jnp.abs(e.astype(jnp.float32)))) + 1.0))
                     for g, e in zip(got, expect)]
        errs[act + "_nan"] = any(bool(jnp.isnan(g.astype(jnp.float32)).any()) for g in got)
    results["errors"] = errs
    results["counters"] = {k: v for k, v in native.counters().items() if k.startswith("dense")}
    print("RESULT " + json.dumps(results))
    """
)


def test_command_buffers_capture_and_warm_once():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "")
        + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    ).strip()
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    proc = subprocess.run(
        [sys.executable, "-c", _CMD_BUFFER_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT ") :])
    for act in ("gelu_tanh", "silu", "relu"):
        assert not res["errors"][act + "_nan"], res
        # bf16 outputs (y, dx, dkernel, dbias), errors relative to max|expected| + 1
        assert max(res["errors"][act]) < 3e-2, res["errors"]
    c = res["counters"]
    # gelu_tanh / silu train through te_dense_fwd_aux, relu through te_dense_fwd; all through te_dense_bwd.
    for handler, keys in (("dense_fwd_aux", 2), ("dense_fwd", 1), ("dense_bwd", 3)):
        assert handler in c, c
        assert c[handler]["captured_executes"] >= 1, (handler, c)
        # one warm-up per (shape, config) key, however many times XLA calls initialize
        assert c[handler]["warmups"] == keys, (handler, c)
        assert c[handler]["initialize_calls"] >= c[handler]["warmups"], (handler, c)
