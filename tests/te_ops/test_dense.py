"""CPU tests of te_ops dense: reference vs jnp, gradients, jit, vmap, errors, dispatch, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as Ps

from te_ops._core import registry
from te_ops._core import testing as T
from te_ops.dense import dense
from te_ops.dense import native as dense_native
from te_ops.dense import reference as ref

ACTS = [None, "gelu", "gelu_tanh", "relu", "silu"]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]

_JNP_ACT = {
    None: lambda z: z,
    "gelu": lambda z: jax.nn.gelu(z, approximate=False),
    "gelu_tanh": jax.nn.gelu,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


def jnp_dense(x, w, b, act):
    """The direct jnp formulation in float32 (the oracle)."""
    z = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    if b is not None:
        z = z + b.astype(jnp.float32)
    return _JNP_ACT[act](z)


def inputs(shape_x, n, dtype, seed=0, bias=True):
    k = jax.random.split(jax.random.key(seed), 3)
    K = shape_x[-1]
    x = jax.random.normal(k[0], shape_x, jnp.float32).astype(dtype)
    w = (jax.random.normal(k[1], (K, n), jnp.float32) / np.sqrt(K)).astype(dtype)
    b = jax.random.normal(k[2], (n,), jnp.float32).astype(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_forward_matches_jnp(dtype, act):
    x, w, b = inputs((3, 5, 24), 40, dtype, seed=1)
    y = dense(x, w, b, activation=act)
    assert y.dtype == dtype and y.shape == (3, 5, 40)
    T.assert_close(y, jnp_dense(x, w, b, act), dtype)


@pytest.mark.parametrize("act", ACTS)
def test_forward_no_bias_rank1_and_odd_sizes(act):
    x, w, _ = inputs((7, 13), 11, jnp.float32, seed=2, bias=False)
    T.assert_close(dense(x, w, activation=act), jnp_dense(x, w, None, act))
    T.assert_close(dense(x[0], w, activation=act), jnp_dense(x[0], w, None, act))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_match_jax(dtype, act, bias):
    x, w, b = inputs((2, 6, 16), 24, dtype, seed=3, bias=bias)
    ct = jax.random.normal(jax.random.key(9), (2, 6, 24), jnp.float32)

    def loss_ours(x, w, b):
        return (dense(x, w, b, activation=act).astype(jnp.float32) * ct).sum()

    def loss_jnp(x, w, b):
        return (jnp_dense(x, w, b, act) * ct).sum()

    argnums = (0, 1, 2) if bias else (0, 1)
    g_ours = jax.grad(loss_ours, argnums)(x, w, b)
    # the oracle in float32 from float32 copies of the inputs
    f32 = lambda a: None if a is None else a.astype(jnp.float32)
    g_ref = jax.grad(loss_jnp, argnums)(f32(x), f32(w), f32(b))
    for name, a, e in zip(("dx", "dkernel", "dbias"), g_ours, g_ref, strict=False):
        assert a.dtype == dtype, name
        scale = float(jnp.abs(e).max()) + 1.0
        T.assert_close(a, e, dtype, scale=scale, err_msg=f"{name} act={act}")


def test_backward_formula_direct():
    """reference.backward on hand-built residuals equals jax.vjp of the fp32 formulation."""
    x, w, b = inputs((4, 8), 12, jnp.float32, seed=4)
    for act in ACTS:
        y, res = ref.forward(x, w, b, activation=act, has_bias=True, mode="train")
        dy = jax.random.normal(jax.random.key(5), y.shape)
        dx, dk, db = ref.backward(res, dy, activation=act, has_bias=True)
        _, vjp = jax.vjp(lambda x, w, b, act=act: jnp_dense(x, w, b, act), x, w, b)
        ex, ek, eb = vjp(dy)
        for a, e in ((dx, ex), (dk, ek), (db, eb)):
            T.assert_close(a, e, jnp.float32, scale=10.0)
        if act in ref.SAVES_PRE_ACTIVATION:
            T.assert_close(res.saved, x @ w + b)
        elif act == "relu":
            assert res.saved is y


def test_jit_and_grad_under_jit():
    x, w, b = inputs((4, 16), 8, jnp.bfloat16, seed=6)
    f = jax.jit(lambda x, w, b: dense(x, w, b, activation="gelu_tanh"))
    T.assert_close(f(x, w, b), jnp_dense(x, w, b, "gelu_tanh"), jnp.bfloat16)
    g = jax.jit(jax.grad(lambda x, w, b: dense(x, w, b, activation="silu").astype(jnp.float32).sum(), (0, 1, 2)))
    out = g(x, w, b)
    assert [o.shape for o in out] == [x.shape, w.shape, b.shape]


def test_vmap_over_x_folds_and_matches():
    x, w, b = inputs((3, 4, 16), 8, jnp.float32, seed=7)
    y = jax.vmap(lambda xi: dense(xi, w, b, activation="relu"))(x)
    T.assert_close(y, jnp_dense(x, w, b, "relu"))
    # non-leading vmapped axis
    y1 = jax.vmap(lambda xi: dense(xi, w, b, activation="relu"), in_axes=1, out_axes=1)(x)
    T.assert_close(y1, jnp_dense(x, w, b, "relu"))


def test_vmap_over_kernel_and_bias():
    x, w, b = inputs((4, 16), 8, jnp.float32, seed=8)
    ws = jnp.stack([w, 2 * w, -w])
    bs = jnp.stack([b, -b, 0 * b])
    y = jax.vmap(lambda wi, bi: dense(x, wi, bi, activation="silu"))(ws, bs)
    T.assert_close(y, jax.vmap(lambda wi, bi: jnp_dense(x, wi, bi, "silu"))(ws, bs))


def test_vmap_of_grad_per_example():
    x, w, b = inputs((5, 16), 8, jnp.float32, seed=10)

    def loss(f):
        return lambda xi, w, b: (f(xi, w, b) ** 2).sum()

    ours = jax.vmap(jax.grad(loss(lambda xi, w, b: dense(xi, w, b, activation="gelu")), (1, 2)), (0, None, None))
    theirs = jax.vmap(jax.grad(loss(lambda xi, w, b: jnp_dense(xi, w, b, "gelu")), (1, 2)), (0, None, None))
    for a, e in zip(ours(x, w, b), theirs(x, w, b), strict=True):
        assert a.shape[0] == 5
        T.assert_close(a, e, scale=10.0)
    # grad of a vmapped function: summed over the vmapped axis
    g1 = jax.grad(lambda w: jax.vmap(lambda xi: dense(xi, w, b, activation="gelu"))(x).sum())(w)
    g2 = jax.grad(lambda w: jnp_dense(x, w, b, "gelu").sum())(w)
    T.assert_close(g1, g2, scale=10.0)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

_X = jnp.ones((4, 8))
_W = jnp.ones((8, 6))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (
            lambda: dense(jnp.ones((4, 7)), _W),
            ValueError,
            r"last axis of x \(K = 7.*first axis of kernel \(got 8",
        ),
        (
            lambda: dense(_X, jnp.ones((8,))),
            ValueError,
            r"kernel must have rank 2 \[K, N\], got shape \(8,\)",
        ),
        (lambda: dense(_X, jnp.ones((2, 8, 6))), ValueError, r"kernel must have rank 2"),
        (lambda: dense(jnp.float32(1.0), _W), ValueError, r"x must have rank >= 1"),
        (lambda: dense(_X, _W, activation="tanh"), ValueError, r"activation must be one of .*got 'tanh'"),
        (
            lambda: dense(_X, _W.astype(jnp.bfloat16)),
            TypeError,
            r"same dtype.*x float32.*kernel bfloat16.*astype",
        ),
        (
            lambda: dense(_X, _W, jnp.ones((6,), jnp.bfloat16)),
            TypeError,
            r"bias must have the compute dtype float32",
        ),
        (
            lambda: dense(_X, _W, jnp.ones((5,))),
            ValueError,
            r"bias must have shape \[N\] = \(6,\).*got shape \(5,\)",
        ),
        (lambda: dense(_X, _W, jnp.ones((1, 6))), ValueError, r"bias must have shape"),
        (
            lambda: dense(_X.astype(jnp.int32), _W.astype(jnp.int32)),
            TypeError,
            r"x must be float32, bfloat16",
        ),
    ],
)
def test_bad_input_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize(
    "args, match",
    [
        ((None, _W), r"te_ops\.dense: x is required \(an array\), got None"),
        ((_X, None), r"te_ops\.dense: kernel is required \(an array\), got None"),
        ((_X.astype(jnp.complex64), _W), r"x must be float32, bfloat16 or float16, got dtype complex64"),
        ((_X, _W.astype(jnp.int8)), r"kernel must be float32, bfloat16 or float16, got dtype int8"),
        ((_X > 0, _W), r"x must be float32, bfloat16 or float16, got dtype bool"),
        ((_X, _W, jnp.ones((6,), jnp.int32)), r"bias must be float32, bfloat16 or float16, got dtype int32"),
        (("abc", _W), r"x must be an array, got str"),
    ],
)
def test_missing_integer_and_complex_inputs_are_refused(args, match):
    with pytest.raises(TypeError, match=match):
        dense(*args)


# (x shape, N): M = 0, K = 0, N = 0, a zero-length middle axis, rank-1 x with K = 0
EMPTY_SHAPES = [((0, 8), 6), ((5, 0), 6), ((5, 8), 0), ((2, 0, 3), 5), ((0,), 4)]


@pytest.mark.parametrize("x_shape, n", EMPTY_SHAPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_empty_axes_follow_the_formula(x_shape, n, act):
    """M, K or N of length 0: the result of the jnp formula (K = 0: y = act(bias) on every row, dbias
    = sum of dy * act'(bias)), forward and gradients, eager and under jit."""
    x, w, b = inputs(x_shape, n, jnp.float32, seed=40)
    b = b + 0.5  # away from relu's kink at 0
    ct = jax.random.normal(jax.random.key(41), (*x_shape[:-1], n), jnp.float32)

    def loss(f):
        return lambda x, w, b: (f(x, w, b) * ct).sum()

    ours = lambda x, w, b: dense(x, w, b, activation=act)  # noqa: E731
    theirs = lambda x, w, b: jnp_dense(x, w, b, act)  # noqa: E731
    y = dense(x, w, b, activation=act)
    assert y.shape == (*x_shape[:-1], n) and y.dtype == jnp.float32
    T.assert_close(y, theirs(x, w, b))
    T.assert_close(jax.jit(ours)(x, w, b), theirs(x, w, b))
    want = jax.grad(loss(theirs), (0, 1, 2))(x, w, b)
    for got in (jax.grad(loss(ours), (0, 1, 2))(x, w, b), jax.jit(jax.grad(loss(ours), (0, 1, 2)))(x, w, b)):
        for a, e in zip(got, want, strict=True):
            assert a.shape == e.shape
            T.assert_close(a, e)
    if x_shape[-1] == 0 and n > 0:  # the defined K = 0 result, spelled out
        T.assert_close(y, jnp.broadcast_to(_JNP_ACT[act](b), y.shape))
        assert float(jnp.abs(want[2]).max()) > 0


@pytest.mark.parametrize("x_shape, n", EMPTY_SHAPES, ids=str)
def test_native_glue_computes_empty_axes_without_the_handler(monkeypatch, x_shape, n):
    """cuBLASLt refuses zero-sized matrices: native.py answers empty calls with the reference and
    never calls the FFI handler."""

    def no_ffi(*a, **k):
        raise AssertionError("the FFI handler must not be called for empty operands")

    monkeypatch.setattr(dense_native._native, "ffi_call", no_ffi)
    assert dense_native.unsupported_reason(dtype=jnp.bfloat16, x_shape=x_shape, kernel_shape=(x_shape[-1], n)) is None
    x, w, b = inputs(x_shape, n, jnp.bfloat16, seed=42)
    for act in ACTS:
        y, res = dense_native.forward(x, w, b, activation=act, has_bias=True, mode="train")
        y_ref, res_ref = ref.forward(x, w, b, activation=act, has_bias=True, mode="train")
        T.assert_close(y, y_ref)
        dy = jax.random.normal(jax.random.key(43), y.shape).astype(jnp.bfloat16)
        got = dense_native.backward(res, dy, activation=act, has_bias=True)
        for a, e in zip(got, ref.backward(res_ref, dy, activation=act, has_bias=True), strict=True):
            assert a.shape == e.shape and a.dtype == e.dtype
            T.assert_close(a, e)


def test_named_native_raises_with_reason_on_cpu():
    with pytest.raises(registry.ImplementationUnavailableError, match="implementation='native'"):
        dense(_X, _W, implementation="native")


def test_unknown_implementation_name():
    with pytest.raises(ValueError, match="unknown implementation"):
        dense(_X, _W, implementation="cutlass")


def test_reference_by_name_and_context_manager():
    x, w, b = inputs((4, 8), 6, jnp.float32, seed=11)
    a = dense(x, w, b, activation="gelu", implementation="reference")
    with registry.use_implementation(dense="reference"):
        c = dense(x, w, b, activation="gelu")
    T.assert_close(a, c)


def test_cpu_hlo_has_no_ffi_call():
    x, w, b = inputs((4, 8), 6, jnp.float32, seed=12)
    f = jax.jit(jax.grad(lambda x, w, b: dense(x, w, b, activation="gelu").sum(), (0, 1, 2)))
    text = f.lower(x, w, b).compile().as_text()
    assert "te_dense" not in text


def test_native_unsupported_reason_and_chunks():
    ok = dict(dtype=jnp.bfloat16, x_shape=(4, 8), kernel_shape=(8, 6), activation="gelu")
    assert dense_native.unsupported_reason(**ok) is None
    assert "float64" in dense_native.unsupported_reason(**{**ok, "dtype": jnp.float64})
    assert "unknown activation" in dense_native.unsupported_reason(**{**ok, "activation": "tanh"})
    assert dense_native.partial_chunks(16384, 14336, 2) >= 32
    assert 1 <= dense_native.partial_chunks(1, 5, 4) <= 1


# ----------------------------------------------------------------------------------------------
# Sharding on 8 CPU devices: sharded vs unsharded, with collective counts.
# ----------------------------------------------------------------------------------------------


def _np(a):
    return np.asarray(jax.device_get(a), dtype=np.float32)


def _check_sharded(fn, args, in_specs, out_specs, mesh, expect):
    out, ref_out, counts = T.run_sharded(fn, args, in_specs, out_specs, mesh=mesh)
    for a, e in zip(jax.tree.leaves(out), jax.tree.leaves(ref_out), strict=True):
        np.testing.assert_allclose(_np(a), _np(e), rtol=1e-5, atol=1e-4)
    got = {k: v for k, v in counts.items() if v}
    assert got == expect, got


_SX = (8, 16, 32)
_SN = 64


def _fwd(act="gelu"):
    return lambda x, w, b: dense(x, w, b, activation=act)


def _grad(act="gelu"):
    return lambda x, w, b: jax.grad(lambda x, w, b: (dense(x, w, b, activation=act) ** 2).sum(), (0, 1, 2))(x, w, b)


def test_sharded_data_parallel():
    mesh = T.cpu_mesh((8,), ("d",))
    args = inputs(_SX, _SN, jnp.float32, seed=20)
    _check_sharded(_fwd(), args, (Ps("d"), None, None), Ps("d"), mesh, {})
    # gradients: one all-reduce of dkernel/dbias over the data axis
    _check_sharded(_grad(), args, (Ps("d"), None, None), None, mesh, {"all-reduce": 1})


def test_sharded_sequence_parallel_axis():
    mesh = T.cpu_mesh((8,), ("s",))
    args = inputs(_SX, _SN, jnp.float32, seed=21)
    _check_sharded(_fwd("silu"), args, (Ps(None, "s"), None, None), Ps(None, "s"), mesh, {})


def test_sharded_column_parallel_no_collective():
    mesh = T.cpu_mesh((8,), ("t",))
    args = inputs(_SX, _SN, jnp.float32, seed=22)
    _check_sharded(_fwd(), args, (None, Ps(None, "t"), Ps("t")), Ps(None, None, "t"), mesh, {})
    # backward: dx is a sum over the N shards: one all-reduce
    _check_sharded(_grad(), args, (None, Ps(None, "t"), Ps("t")), None, mesh, {"all-reduce": 1})


@pytest.mark.parametrize("act", ["gelu", "relu", None])
def test_sharded_row_parallel_reduces_before_activation(act):
    mesh = T.cpu_mesh((8,), ("t",))
    args = inputs(_SX, _SN, jnp.float32, seed=23)
    _check_sharded(_fwd(act), args, (Ps(None, None, "t"), Ps("t", None), None), Ps(), mesh, {"all-reduce": 1})
    # the backward of a row-parallel layer needs no collective (dx and dkernel stay sharded on K)
    _check_sharded(_grad(act), args, (Ps(None, None, "t"), Ps("t", None), None), None, mesh, {"all-reduce": 1})


def test_sharded_row_parallel_reduce_scatter_when_output_sharded():
    mesh = T.cpu_mesh((8,), ("t",))
    args = inputs(_SX, _SN, jnp.float32, seed=24)
    spec_in = (Ps(None, None, "t"), Ps("t", None), None)
    _check_sharded(_fwd(), args, spec_in, Ps(None, "t", None), mesh, {"reduce-scatter": 1})
    _check_sharded(_fwd(), args, spec_in, Ps(None, None, "t"), mesh, {"reduce-scatter": 1})


def test_sharded_2d_data_and_tensor_parallel():
    mesh = T.cpu_mesh((2, 4), ("d", "t"))
    args = inputs(_SX, _SN, jnp.float32, seed=25)
    _check_sharded(_fwd(), args, (Ps("d"), Ps(None, "t"), Ps("t")), Ps("d", None, "t"), mesh, {})
    _check_sharded(_fwd(), args, (Ps("d", None, "t"), Ps("t", None), None), Ps("d"), mesh, {"all-reduce": 1})


def test_sharded_bf16_row_parallel_close_to_unsharded():
    mesh = T.cpu_mesh((8,), ("t",))
    args = inputs(_SX, _SN, jnp.bfloat16, seed=26)
    out, ref_out, counts = T.run_sharded(_fwd(), args, (Ps(None, None, "t"), Ps("t", None), None), Ps(), mesh=mesh)
    T.assert_close(out, ref_out, jnp.bfloat16)
    assert counts["all-reduce"] == 1


# ----------------------------------------------------------------------------------------------
# The native Python glue (te_ops/dense/native.py) against an emulation of the FFI contract of
# csrc/dense/dense_ffi.cc, so shapes, scratch outputs, attributes and residual plumbing are checked
# on CPU (the kernels themselves are tested on the GPU).
# ----------------------------------------------------------------------------------------------

_ACT_NAMES = {0: None, 1: "gelu", 2: "gelu_tanh", 3: "relu", 4: "silu"}


def _emulated_ffi_call(target, results, *args, vmap_method="sequential", **attrs):
    for k, v in attrs.items():
        assert isinstance(v, np.int32), (k, type(v))
    act = _ACT_NAMES[int(attrs["activation"])]
    has_bias = bool(attrs["has_bias"])
    if target in ("te_dense_fwd", "te_dense_fwd_aux"):
        x, w, b = args
        mode = int(attrs["mode"])
        assert x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[0] and x.dtype == w.dtype
        m, n = x.shape[0], w.shape[1]
        assert b.shape == ((n,) if has_bias else (0,)) and b.dtype == x.dtype
        z = ref.matmul_f32(x, w)
        if mode == 2:
            assert target == "te_dense_fwd" and act is None and not has_bias
            assert results.shape == (m, n) and results.dtype == jnp.float32
            return z
        y, _ = ref.epilogue(z, b if has_bias else None, activation=act, dtype=x.dtype, save=False)
        if target == "te_dense_fwd":
            assert results.shape == (m, n) and results.dtype == x.dtype
            assert not (mode == 1 and act in ref.SAVES_PRE_ACTIVATION)
            return y
        assert mode == 1 and act in ref.SAVES_PRE_ACTIVATION
        assert [(r.shape, r.dtype) for r in results] == [((m, n), x.dtype)] * 2
        zb = z + b.astype(jnp.float32) if has_bias else z
        return [y, zb.astype(x.dtype)]
    assert target == "te_dense_bwd", target
    x, w, saved, dy = args
    m, k = x.shape
    n = w.shape[1]
    assert dy.shape == (m, n) and dy.dtype == x.dtype
    assert saved.shape == ((m, n) if act is not None else (0,))
    shapes = [(r.shape, r.dtype) for r in results]
    assert shapes[:4] == [
        ((m, k), x.dtype),
        ((k, n), x.dtype),
        ((n,) if has_bias else (0,), x.dtype),
        ((m, n) if act is not None else (0,), x.dtype),
    ], shapes
    p_shape, p_dtype = shapes[4]
    assert p_dtype == jnp.float32
    if has_bias:
        assert len(p_shape) == 2 and p_shape[1] == n and 1 <= p_shape[0] <= 65535
    else:
        assert p_shape == (0,)
    dx, dk, db = ref.backward(
        ref.Residuals(x, w, saved if act is not None else None), dy, activation=act, has_bias=has_bias
    )
    return [
        dx,
        dk,
        db if has_bias else jnp.zeros((0,), x.dtype),
        jnp.zeros(results[3].shape, x.dtype),
        jnp.zeros(p_shape, jnp.float32),
    ]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("x_shape, bias", [((3, 5, 16), True), ((3, 5, 16), False), ((7,), True)])
def test_native_glue_against_emulated_ffi_contract(monkeypatch, act, bias, x_shape):
    monkeypatch.setattr(dense_native._native, "ffi_call", _emulated_ffi_call)
    dtype = jnp.bfloat16
    x, w, b = inputs(x_shape, 24, dtype, seed=30, bias=bias)
    kw = dict(activation=act, has_bias=bias)
    for mode in ("primal", "train", "partial"):
        kw_m = dict(kw, mode=mode) if mode != "partial" else dict(activation=None, has_bias=False, mode=mode)
        y, res = dense_native.forward(x, w, b, **kw_m)
        y_ref, res_ref = ref.forward(x, w, b, **kw_m)
        assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
        T.assert_close(y, y_ref, y.dtype)
        assert (res is None) == (res_ref is None)
        if mode == "train":
            assert (res.saved is None) == (res_ref.saved is None)
            if res.saved is not None:
                assert res.saved.shape == res_ref.saved.shape
                T.assert_close(res.saved, res_ref.saved, dtype)
            dy = jax.random.normal(jax.random.key(31), y.shape).astype(dtype)
            got = dense_native.backward(res, dy, **kw)
            want = ref.backward(res_ref, dy, **kw)
            for a, e in zip(got, want, strict=True):
                if e is None:
                    assert a is None
                else:
                    assert a.shape == e.shape and a.dtype == e.dtype
                    T.assert_close(a, e, dtype, scale=float(jnp.abs(e.astype(jnp.float32)).max()) + 1)


@pytest.fixture
def emulated_native(monkeypatch):
    """implementation='native' runs native.py's glue with the emulated FFI contract on CPU."""
    import dataclasses

    from te_ops.dense import api

    monkeypatch.setattr(dense_native._native, "ffi_call", _emulated_ffi_call)
    impl = api.FAMILY.get("native")
    monkeypatch.setitem(api.FAMILY._impls, "native", dataclasses.replace(impl, available=lambda: None, platform=None))


@pytest.mark.parametrize("act", ACTS)
def test_api_through_native_glue(emulated_native, act):
    x, w, b = inputs((2, 6, 16), 24, jnp.bfloat16, seed=32)

    def loss(impl):
        return lambda x, w, b: (dense(x, w, b, activation=act, implementation=impl).astype(jnp.float32) ** 2).sum()

    for fn in (jax.jit, lambda f: f):
        got = fn(jax.value_and_grad(loss("native"), (0, 1, 2)))(x, w, b)
        want = jax.value_and_grad(loss("reference"), (0, 1, 2))(x, w, b)
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            T.assert_close(a, e, jnp.bfloat16, scale=float(jnp.abs(e.astype(jnp.float32)).max()) + 1)


def test_row_parallel_through_native_glue(emulated_native):
    mesh = T.cpu_mesh((8,), ("t",))
    args = inputs(_SX, _SN, jnp.float32, seed=33)
    fn = _grad("gelu")
    native_fn = lambda x, w, b: jax.grad(
        lambda x, w, b: (dense(x, w, b, activation="gelu", implementation="native") ** 2).sum(), (0, 1, 2)
    )(x, w, b)
    out, _, counts = T.run_sharded(native_fn, args, (Ps(None, None, "t"), Ps("t", None), None), None, mesh=mesh)
    want = jax.jit(fn)(*args)
    for a, e in zip(out, want, strict=True):
        np.testing.assert_allclose(_np(a), _np(e), rtol=1e-5, atol=1e-4)
    assert counts["all-reduce"] == 1


@pytest.mark.parametrize(
    "x_shape, kernel_shape, picked",
    [
        ((16384, 4096), (4096, 14336), True),  # a large MLP
        ((8, 1024, 1024), (1024, 4096), True),
        ((256, 4096), (4096, 14336), False),  # few rows: XLA's GEMM
        ((16384, 1024), (1024, 16), False),  # router-sized N: XLA's GEMM
        ((4096, 64), (64, 4096), False),
        ((0, 4096), (4096, 4096), False),  # empty: nothing to run
        ((4096, 0), (0, 4096), False),
    ],
)
def test_default_picks_native_only_for_large_gemms(x_shape, kernel_shape, picked):
    from te_ops._core import registry

    impl = registry.family("dense").get("native")
    assert impl.auto_for(dict(x_shape=x_shape, kernel_shape=kernel_shape)) is picked


def test_auto_may_be_a_rule():
    from te_ops._core import registry

    impl = registry.Implementation(name="x", forward=None, backward=None, auto=lambda *, n, **_: n > 3)
    assert impl.auto_for({"n": 4}) and not impl.auto_for({"n": 3})
    assert registry.Implementation(name="y", forward=None, backward=None, auto=False).auto_for({}) is False
