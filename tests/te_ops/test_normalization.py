"""rms_norm / layer_norm on CPU: the reference vs an independent NumPy float64 formula (forward, and
the backward through the explicit Jacobian), every dtype, residual and zero-centred gamma on/off,
jit, vmap (per-example gradients, batched parameters), sharded vs unsharded on 8 CPU devices with
collective counts, empty inputs, errors, and the Triton kernels under TRITON_INTERPRET=1."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as Ps

import te_ops
from te_ops._core import testing as T
from te_ops._core import triton_bridge

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
KINDS = ["rms", "layer"]
HERE = os.path.dirname(os.path.abspath(__file__))


def _inputs(seed, shape, dtype, kind, has_res, param_dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 6)
    n = shape[-1]
    x = (1.5 * jax.random.normal(ks[0], shape) + 0.3).astype(dtype)
    gamma = (1.0 + 0.5 * jax.random.normal(ks[1], (n,))).astype(param_dtype)
    beta = (0.5 * jax.random.normal(ks[2], (n,))).astype(param_dtype) if kind == "layer" else None
    r = jax.random.normal(ks[3], shape).astype(dtype) if has_res else None
    dy = jax.random.normal(ks[4], shape).astype(dtype)
    dh = jax.random.normal(ks[5], shape).astype(dtype) if has_res else None
    return x, gamma, beta, r, dy, dh


def _call(kind, x, gamma, beta, r, *, eps, zc, impl=None):
    if kind == "rms":
        return te_ops.rms_norm(x, gamma, residual=r, eps=eps, zero_centered_gamma=zc, implementation=impl)
    return te_ops.layer_norm(x, gamma, beta, residual=r, eps=eps, zero_centered_gamma=zc, implementation=impl)


def _f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def _np_h(x, r):
    """h = x + r rounded to x's dtype (the documented rounding), as float64."""
    if r is None:
        return _f64(x)
    return _f64((x.astype(jnp.float32) + r.astype(jnp.float32)).astype(x.dtype))


def _np_forward(kind, h, gamma, beta, eps, zc):
    w = _f64(gamma) + (1.0 if zc else 0.0)
    mu = h.mean(-1, keepdims=True) if kind == "layer" else 0.0
    var = ((h - mu) ** 2).mean(-1, keepdims=True)
    y = (h - mu) / np.sqrt(var + eps) * w
    return y + _f64(beta) if kind == "layer" else y


def _np_backward(kind, h, gamma, dy, eps, zc):
    """dx through the explicit Jacobian dy_j/dh_i (a different route from the reference's
    closed form), dgamma and dbeta by their definitions."""
    n = h.shape[-1]
    w = _f64(gamma) + (1.0 if zc else 0.0)
    rows, g = h.reshape(-1, n), _f64(dy).reshape(-1, n)
    dx, dgamma = np.zeros_like(rows), np.zeros(n)
    eye = np.eye(n)
    for i in range(rows.shape[0]):
        row = rows[i]
        mu = row.mean() if kind == "layer" else 0.0
        rstd = 1.0 / np.sqrt(((row - mu) ** 2).mean() + eps)
        xhat = (row - mu) * rstd
        centring = (1.0 / n) if kind == "layer" else 0.0
        jac = w[None, :] * rstd * (eye - centring - np.outer(xhat, xhat) / n)  # jac[i, j] = dy_j / dh_i
        dx[i] = jac @ g[i]
        dgamma += g[i] * xhat
    return dx.reshape(h.shape), dgamma, g.sum(0)


# ------------------------------------------------------------------------------------------------
# Forward / backward against NumPy float64
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_res", [False, True])
@pytest.mark.parametrize("zc", [False, True])
def test_forward_matches_numpy(kind, dtype, has_res, zc):
    x, gamma, beta, r, _, _ = _inputs(1, (3, 5, 48), dtype, kind, has_res)
    out = _call(kind, x, gamma, beta, r, eps=1e-5, zc=zc)
    y = out.y if has_res else out
    assert isinstance(out, te_ops.NormOutput) == has_res
    assert y.dtype == dtype and y.shape == x.shape
    h = _np_h(x, r)
    T.assert_close(y, _np_forward(kind, h, gamma, beta, 1e-5, zc), dtype, scale=4.0)
    if has_res:
        assert out.h.dtype == dtype
        np.testing.assert_array_equal(_f64(out.h), h)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_res", [False, True])
@pytest.mark.parametrize("zc", [False, True])
def test_backward_matches_numpy(kind, dtype, has_res, zc):
    x, gamma, beta, r, dy, dh = _inputs(2, (4, 6, 24), dtype, kind, has_res)
    args = (x, gamma, beta, r) if kind == "layer" else (x, gamma, r)

    def f(*a):
        if kind == "layer":
            return _call(kind, *a, eps=1e-5, zc=zc)
        return _call(kind, a[0], a[1], None, a[2], eps=1e-5, zc=zc)

    out, vjp = jax.vjp(f, *args)
    grads = vjp(te_ops.NormOutput(dy, dh) if has_res else dy)
    h = _np_h(x, r)
    dx_ref, dgamma_ref, dbeta_ref = _np_backward(kind, h, gamma, dy, 1e-5, zc)
    if has_res:
        dx_ref = dx_ref + _f64(dh)
    dx = grads[0]
    assert dx.dtype == dtype
    T.assert_close(dx, dx_ref, dtype, scale=float(np.abs(dx_ref).max()))
    T.assert_close(grads[1], dgamma_ref, jnp.float32, scale=float(np.abs(dgamma_ref).max()))
    assert grads[1].dtype == gamma.dtype
    if kind == "layer":
        T.assert_close(grads[2], dbeta_ref, jnp.float32, scale=float(np.abs(dbeta_ref).max()))
    if has_res:
        np.testing.assert_array_equal(np.asarray(grads[-1]), np.asarray(dx))  # d residual == dx


@pytest.mark.parametrize("kind", KINDS)
def test_low_precision_parameters(kind):
    """gamma/beta in bfloat16 with float32 x: maths in float32, gradients in the parameters' dtype."""
    x, gamma, beta, _, dy, _ = _inputs(3, (7, 40), jnp.float32, kind, False, jnp.bfloat16)
    y, vjp = jax.vjp(lambda x, g: _call(kind, x, g, beta, None, eps=1e-6, zc=False), x, gamma)
    T.assert_close(y, _np_forward(kind, _f64(x), gamma, beta, 1e-6, False), jnp.float32, scale=4.0)
    dx, dg = vjp(dy)
    assert dx.dtype == jnp.float32 and dg.dtype == jnp.bfloat16
    _, dg_ref, _ = _np_backward(kind, _f64(x), gamma, dy, 1e-6, False)
    T.assert_close(dg, dg_ref, jnp.bfloat16, scale=float(np.abs(dg_ref).max()))


def test_float64_on_reference():
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(4), (3, 10), jnp.float64)
        g = jnp.linspace(0.5, 1.5, 10, dtype=jnp.float64)
        b = jnp.linspace(-1, 1, 10, dtype=jnp.float64)
        y = te_ops.layer_norm(x, g, b, eps=1e-5)
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(y), _np_forward("layer", np.asarray(x), g, b, 1e-5, False), rtol=1e-12)
        dx = jax.grad(lambda x: jnp.sum(te_ops.rms_norm(x, g) * jnp.arange(10.0)))(x)
        dx_ref, _, _ = _np_backward("rms", np.asarray(x), g, jnp.broadcast_to(jnp.arange(10.0), x.shape), 1e-6, False)
        np.testing.assert_allclose(np.asarray(dx), dx_ref, rtol=1e-10, atol=1e-12)


def test_rank1_and_special_rows():
    g = jnp.ones((8,))
    x = jnp.arange(8.0)
    y = te_ops.rms_norm(x, g)
    assert y.shape == (8,)
    T.assert_close(y, _np_forward("rms", _f64(x), g, None, 1e-6, False), jnp.float32)
    out = te_ops.layer_norm(x, g, jnp.zeros(8), residual=x)
    assert out.y.shape == (8,) and out.h.shape == (8,)
    # a zero row: RMSNorm gives 0; a constant row: LayerNorm gives beta
    assert float(jnp.abs(te_ops.rms_norm(jnp.zeros((2, 8)), g)).max()) == 0.0
    beta = jnp.linspace(-1, 1, 8)
    np.testing.assert_allclose(
        np.asarray(te_ops.layer_norm(jnp.full((2, 8), 3.0), g, beta)),
        np.broadcast_to(np.asarray(beta), (2, 8)),
        atol=1e-6,
    )
    # non-finite rows: NaN spreads over the row; an infinity gives rstd = 0 (RMSNorm: 0 at the finite
    # positions, NaN at the infinite one; LayerNorm: x - mean is infinite or NaN everywhere -> NaN row)
    assert bool(jnp.isnan(te_ops.rms_norm(x.at[3].set(jnp.nan), g)).all())
    y_inf = np.asarray(te_ops.rms_norm(x.at[3].set(jnp.inf), g))
    assert np.isnan(y_inf[3]) and (np.delete(y_inf, 3) == 0).all()
    assert bool(jnp.isnan(te_ops.layer_norm(x.at[3].set(-jnp.inf), g, beta)).all())


@pytest.mark.parametrize("kind", KINDS)
def test_empty_leading_axes(kind):
    x, gamma, beta, r, _, _ = _inputs(5, (0, 3, 16), jnp.bfloat16, kind, True)
    out = _call(kind, x, gamma, beta, r, eps=1e-5, zc=False)
    assert out.y.shape == (0, 3, 16) and out.h.shape == (0, 3, 16)
    dg = jax.grad(lambda g: jnp.sum(_call(kind, x, g, beta, None, eps=1e-5, zc=False).astype(jnp.float32)))(gamma)
    np.testing.assert_array_equal(np.asarray(dg), 0.0)


# ------------------------------------------------------------------------------------------------
# jit and vmap
# ------------------------------------------------------------------------------------------------


def _loss(kind, zc=False):
    def f(x, gamma, beta, r):
        out = _call(kind, x, gamma, beta, r, eps=1e-5, zc=zc)
        y, h = (out.y, out.h) if r is not None else (out, None)
        total = jnp.sum(jnp.sin(y.astype(jnp.float32) * 3.0))
        return total + (0.0 if h is None else jnp.sum(jnp.cos(h.astype(jnp.float32))))

    return f


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("has_res", [False, True])
def test_jit_matches_eager(kind, has_res):
    x, gamma, beta, r, _, _ = _inputs(6, (4, 32), jnp.bfloat16, kind, has_res)
    f = _loss(kind, zc=True)
    eager = jax.grad(f, argnums=(0, 1))(x, gamma, beta, r)
    jitted = jax.jit(jax.grad(f, argnums=(0, 1)))(x, gamma, beta, r)
    for a, b in zip(eager, jitted, strict=True):
        T.assert_close(a, b, a.dtype, scale=float(jnp.abs(b.astype(jnp.float32)).max()))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("has_res", [False, True])
def test_vmap_per_example_gradients(kind, has_res):
    """vmap over the leading axis with shared parameters: per-instance dgamma/dbeta (not summed)."""
    x, gamma, beta, r, _, _ = _inputs(7, (3, 5, 16), jnp.float32, kind, has_res)
    f = _loss(kind)
    per_example = jax.jit(
        jax.vmap(
            jax.grad(f, argnums=(0, 1, 2) if kind == "layer" else (0, 1)),
            in_axes=(0, None, None, 0 if has_res else None),
        )
    )(x, gamma, beta, r)
    for i in range(3):
        one = jax.grad(f, argnums=(0, 1, 2) if kind == "layer" else (0, 1))(
            x[i], gamma, beta, None if r is None else r[i]
        )
        for a, b in zip(per_example, one, strict=True):
            T.assert_close(a[i], b, jnp.float32, scale=float(jnp.abs(b).max()))


@pytest.mark.parametrize("kind", KINDS)
def test_vmap_batched_parameters_and_inner_axis(kind):
    x, gamma, beta, _, _, _ = _inputs(8, (4, 6, 16), jnp.float32, kind, False)
    gammas = gamma[None] * jnp.arange(1.0, 5.0)[:, None]
    betas = None if beta is None else beta[None] + jnp.arange(4.0)[:, None]
    f = lambda x, g, b: _call(kind, x, g, b, None, eps=1e-5, zc=False)  # noqa: E731
    ys = jax.vmap(f, in_axes=(0, 0, 0 if betas is not None else None))(x, gammas, betas)
    for i in range(4):
        T.assert_close(ys[i], f(x[i], gammas[i], None if betas is None else betas[i]), jnp.float32)
    g = jax.vmap(
        jax.grad(lambda x, g, b: jnp.sum(f(x, g, b) ** 3), argnums=1), in_axes=(0, 0, 0 if betas is not None else None)
    )(x, gammas, betas)
    for i in range(4):
        b_i = None if betas is None else betas[i]
        want = jax.grad(lambda g, x_i=x[i], b_i=b_i: jnp.sum(f(x_i, g, b_i) ** 3))(gammas[i])
        T.assert_close(g[i], want, jnp.float32, scale=float(jnp.abs(want).max()))
    # vmap over an inner axis (out_axes=1) is the same op on transposed rows
    y = jax.vmap(lambda r: f(r, gamma, beta), in_axes=1, out_axes=1)(x)
    T.assert_close(y, f(x, gamma, beta), jnp.float32)


# ------------------------------------------------------------------------------------------------
# Sharding on 8 virtual CPU devices
# ------------------------------------------------------------------------------------------------


def _grad_fn(kind, has_res):
    f = _loss(kind)
    argnums = (0, 1, 2) if kind == "layer" else (0, 1)
    if has_res:
        argnums = argnums + (3,)
    return lambda x, g, b, r: jax.grad(f, argnums=argnums)(x, g, b, r)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("has_res", [False, True])
def test_sharded_rows_forward_no_collectives(kind, has_res):
    mesh = T.cpu_mesh((2, 4), ("data", "seq"))
    x, gamma, beta, r, _, _ = _inputs(9, (4, 8, 64), jnp.float32, kind, has_res)
    spec = Ps("data", "seq", None)
    fn = lambda x, g, b, r: _call(kind, x, g, b, r, eps=1e-5, zc=False)  # noqa: E731
    out, ref, counts = T.run_sharded(fn, (x, gamma, beta, r), (spec, None, None, spec if has_res else None),
                                     mesh=mesh)  # fmt: skip
    jax.tree.map(lambda a, b: T.assert_close(a, b, jnp.float32), out, ref)
    assert sum(counts.values()) == 0, counts


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("has_res", [False, True])
def test_sharded_backward_psums_parameter_gradients(kind, has_res):
    """Rows sharded over both mesh axes: dx stays sharded; dgamma (and dbeta) are all-reduced once
    each and equal the unsharded ones."""
    mesh = T.cpu_mesh((2, 4), ("data", "seq"))
    x, gamma, beta, r, _, _ = _inputs(10, (4, 8, 64), jnp.float32, kind, has_res)
    spec = Ps("data", "seq", None)
    out, ref, counts = T.run_sharded(_grad_fn(kind, has_res), (x, gamma, beta, r),
                                     (spec, None, None, spec if has_res else None), mesh=mesh)  # fmt: skip
    for a, b in zip(out, ref, strict=True):
        T.assert_close(a, b, jnp.float32, scale=float(jnp.abs(b).max()))
    n_params = 2 if kind == "layer" else 1
    assert 1 <= counts["all-reduce"] <= n_params, counts
    assert counts["all-gather"] == 0 and counts["all-to-all"] == 0, counts


def test_sharded_hidden_axis_is_gathered():
    """The normalised axis sharded: it is gathered (same answer as unsharded)."""
    mesh = T.cpu_mesh((8,), ("model",))
    x, gamma, beta, _, _, _ = _inputs(11, (4, 64), jnp.float32, "layer", False)
    out, ref, counts = T.run_sharded(_grad_fn("layer", False), (x, gamma, beta, None),
                                     (Ps(None, "model"), Ps("model"), Ps("model"), None), mesh=mesh)  # fmt: skip
    for a, b in zip(out, ref, strict=True):
        T.assert_close(a, b, jnp.float32, scale=float(jnp.abs(b).max()))
    assert counts["all-gather"] + counts["all-to-all"] + counts["collective-permute"] >= 1, counts


# ------------------------------------------------------------------------------------------------
# Implementation selection and errors
# ------------------------------------------------------------------------------------------------


def test_named_triton_on_cpu_raises_and_cpu_hlo_has_no_kernel():
    from te_ops._core.native import cuda_device_unavailable_reason

    x, gamma, _, _, _, _ = _inputs(12, (2, 16), jnp.float32, "rms", False)
    text = jax.jit(lambda x: te_ops.rms_norm(x, gamma)).lower(x).as_text()
    assert triton_bridge.FFI_TARGET not in text
    if cuda_device_unavailable_reason() is None:
        pytest.skip("a CUDA device is present: triton can run here")
    with pytest.raises(te_ops.ImplementationUnavailableError, match="triton.*cannot run"):
        te_ops.rms_norm(x, gamma, implementation="triton")
    y1 = te_ops.rms_norm(x, gamma, implementation="reference")
    with te_ops.use_implementation(normalization="reference"):
        T.assert_close(te_ops.rms_norm(x, gamma), y1, jnp.float32)


def test_triton_unsupported_reason():
    from te_ops.normalization import triton as tri

    assert tri.unsupported_reason(dtype=jnp.bfloat16, gamma_dtype=jnp.float32, rows=10) is None
    assert "float64" in tri.unsupported_reason(dtype=jnp.float64)
    assert "gamma" in tri.unsupported_reason(dtype=jnp.float32, gamma_dtype=jnp.float64)


_x = jnp.ones((2, 8))
_g = jnp.ones((8,))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: te_ops.rms_norm(jnp.ones((2, 8), jnp.int32), _g), TypeError, r"rms_norm: x must be float32.*int32"),
        (lambda: te_ops.rms_norm(None, _g), TypeError, "x is required"),
        (lambda: te_ops.rms_norm(jnp.float32(1.0), jnp.ones((1,))), ValueError, "rank >= 1"),
        (lambda: te_ops.rms_norm(jnp.ones((2, 0)), jnp.ones((0,))), ValueError, "non-empty last axis"),
        (lambda: te_ops.rms_norm(_x, jnp.ones((7,))), ValueError, r"gamma must have shape \[H\] = \(8,\)"),
        (lambda: te_ops.layer_norm(_x, _g, jnp.ones((2, 8))), ValueError, "beta must have shape"),
        (lambda: te_ops.layer_norm(_x, _g, None), TypeError, "beta is required"),
        (lambda: te_ops.rms_norm(_x, _g, residual=jnp.ones((2, 9))), ValueError, "residual must have x's shape"),
        (
            lambda: te_ops.rms_norm(_x, _g, residual=jnp.ones((2, 8), jnp.bfloat16)),
            TypeError,
            "residual must have x's dtype",
        ),
        (lambda: te_ops.rms_norm(_x, _g, eps=0.0), ValueError, "eps must be > 0"),
        (lambda: te_ops.rms_norm(_x, _g, eps=-1e-5), ValueError, "eps must be > 0"),
        (lambda: te_ops.rms_norm(_x, _g, eps=float("inf")), ValueError, "eps must be finite"),
        (lambda: te_ops.rms_norm(_x, _g, eps=jnp.float32(1e-5)), TypeError, "eps must be a static"),
        (lambda: te_ops.layer_norm(_x, _g, _g, zero_centered_gamma=1), TypeError, "zero_centered_gamma must be a bool"),
        (lambda: te_ops.rms_norm(_x, _g.astype(jnp.int32)), TypeError, "gamma must be"),
        (lambda: te_ops.rms_norm(_x, _g, implementation="cutlass"), ValueError, "unknown implementation='cutlass'"),
    ],
)
def test_bad_input_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter
# ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    triton_bridge.triton_unavailable_reason() is not None,
    reason=f"needs Triton: {triton_bridge.triton_unavailable_reason()}",
)
def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.join(HERE, "_triton_interpret_norm.py")], capture_output=True,
                       text=True, env=env, timeout=600, cwd=root)  # fmt: skip
    assert r.returncode == 0 and "interpret failures: 0" in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])


@pytest.mark.skipif(
    triton_bridge.triton_unavailable_reason() is not None,
    reason=f"needs Triton: {triton_bridge.triton_unavailable_reason()}",
)
def test_triton_kernels_compile_for_sm90_with_vector_loads(monkeypatch):
    """Every kernel compiles with the real Triton compiler for sm_90 (no GPU needed), and rows of a
    multiple of 16 elements get 16-byte (v4) global loads."""
    import re

    from te_ops.normalization import reference as ref
    from te_ops.normalization import triton as tri

    seen = {}

    def compile_only(kernel, *args, out_shape, grid, constexprs=None, num_warps=4, num_stages=2,
                     divisible_by_16=(), name=None, **_):  # fmt: skip
        constexprs = dict(constexprs or {})
        names = iter(n for n in kernel.arg_names if n not in constexprs)
        sig = [(next(names), triton_bridge._POINTER_TYPES[jnp.dtype(a.dtype)] if triton_bridge._is_array(a)
                else triton_bridge._scalar_type(a)[1]) for a in args]  # fmt: skip
        sig += [(next(names), triton_bridge._POINTER_TYPES[jnp.dtype(s.dtype)]) for s in out_shape]
        full = dict(sig)
        spec = triton_bridge.KernelSpec(kernel, tuple((n, full.get(n, "constexpr")) for n in kernel.arg_names),
                                        tuple(sorted(constexprs.items())), num_warps, num_stages,
                                        tuple(sorted(divisible_by_16)))  # fmt: skip
        ptx = triton_bridge.compile_kernel(spec, ("cuda", 90, 32)).asm["ptx"]
        seen[(name, constexprs.get("BLOCK_H"))] = len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx))
        return [jnp.zeros(s.shape, s.dtype) for s in out_shape]

    monkeypatch.setattr(tri.tb, "triton_call", compile_only)
    for h in (4096, 20000):
        for kind in KINDS:
            x = jnp.ones((8, h), jnp.bfloat16)
            g = jnp.ones((h,), jnp.float32)
            b = g if kind == "layer" else None
            tri.forward(x, g, b, x, kind=kind, eps=1e-5, zero_centered_gamma=True)
            _, res = ref.forward(x, g, b, x, kind=kind, eps=1e-5, zero_centered_gamma=True)
            tri.backward(res, x, x, kind=kind, zero_centered_gamma=True)
    assert len(seen) == 10, sorted(seen)
    assert all(v > 0 for v in seen.values()), seen
