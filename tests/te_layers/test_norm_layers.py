"""RMSNorm / LayerNorm layers: the same parameters give the same outputs and gradients in Linen, NNX
and Equinox (and equal te_ops directly), parameter names/shapes/dtypes and logical axes, the
residual option, zero-centred gamma initialisation, compute dtype, and configuration/input errors."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_ops
from te_layers import eqx as te_eqx
from te_layers import linen as te_linen
from te_layers import nnx as te_nnx
from te_ops._core import testing as T

H = 48
LAYERS = ["RMSNorm", "LayerNorm"]


def _x(seed=0, shape=(2, 5, H), dtype=jnp.float32):
    return (1.3 * jax.random.normal(jax.random.key(seed), shape) + 0.2).astype(dtype)


def _params(layer, seed=1):
    ks = jax.random.split(jax.random.key(seed), 2)
    p = {"scale": 1 + 0.2 * jax.random.normal(ks[0], (H,))}
    if layer == "LayerNorm":
        p["bias"] = 0.3 * jax.random.normal(ks[1], (H,))
    return p


def _apply_fns(layer, **kw):
    """(linen, nnx, eqx) functions ``f(params, x, residual) -> output`` for the same configuration."""
    lin = getattr(te_linen, layer)(**kw)
    nmod = getattr(te_nnx, layer)(H, **kw, rngs=nnx.Rngs(0))
    emod = getattr(te_eqx, layer)(H, **kw, key=jax.random.key(0))
    graphdef, _ = nnx.split(nmod)

    def f_lin(p, x, r):
        return lin.apply({"params": p}, x, r)

    def f_nnx(p, x, r):
        state = jax.tree.map(lambda a: a, nnx.state(nmod))
        nnx.replace_by_pure_dict(state, p)
        return nnx.merge(graphdef, state)(x, r)

    def f_eqx(p, x, r):
        m = eqx.tree_at(lambda m: [getattr(m, n) for n in p], emod, list(p.values()))
        return m(x, r)

    return f_lin, f_nnx, f_eqx


def _direct(layer, p, x, r, eps, zc):
    if layer == "RMSNorm":
        return te_ops.rms_norm(x, p["scale"], residual=r, eps=eps, zero_centered_gamma=zc)
    return te_ops.layer_norm(x, p["scale"], p["bias"], residual=r, eps=eps, zero_centered_gamma=zc)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("zc", [False, True])
def test_same_parameters_same_outputs_and_gradients(layer, with_residual, zc):
    p = _params(layer)
    x = _x(2)
    r = _x(3) if with_residual else None
    want = _direct(layer, p, x, r, 1e-4, zc)
    grads = []
    for f in _apply_fns(layer, epsilon=1e-4, zero_centered_gamma=zc):
        out = jax.jit(f)(p, x, r)
        jax.tree.map(lambda a, b: T.assert_close(a, b, jnp.float32), out, want)
        if with_residual:
            assert isinstance(out, te_ops.NormOutput)

        def loss(p, x, f=f):
            o = f(p, x, r)
            leaves = jax.tree.leaves(o)
            return sum(jnp.sum(jnp.sin(v * (i + 1.0))) for i, v in enumerate(leaves))

        grads.append(jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x))
    for g in grads[1:]:
        jax.tree.map(lambda a, b: T.assert_close(a, b, jnp.float32, scale=float(jnp.abs(b).max())), g, grads[0])


@pytest.mark.parametrize("layer", LAYERS)
def test_parameters_names_shapes_init_and_axes(layer):
    x = _x()
    for zc, want in [(False, 1.0), (True, 0.0)]:
        lin = getattr(te_linen, layer)(zero_centered_gamma=zc, param_dtype=jnp.bfloat16, scale_axes=("embed",))
        variables = lin.init(jax.random.key(0), x)
        params = variables["params"]
        names = {"scale", "bias"} if layer == "LayerNorm" else {"scale"}
        assert set(params) == names
        assert nn.get_partition_spec(variables)["params"]["scale"] == jax.sharding.PartitionSpec("embed")
        scale = nn.meta.unbox(params["scale"])
        assert scale.shape == (H,) and scale.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(scale, np.float32), want)
        nmod = getattr(te_nnx, layer)(H, zero_centered_gamma=zc, param_dtype=jnp.bfloat16, scale_axes=("embed",),
                                      rngs=nnx.Rngs(0))  # fmt: skip
        assert nmod.scale[...].shape == (H,) and nmod.scale[...].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(nmod.scale[...], np.float32), want)
        emod = getattr(te_eqx, layer)(H, zero_centered_gamma=zc, param_dtype=jnp.bfloat16, scale_axes=("embed",))
        np.testing.assert_array_equal(np.asarray(emod.scale, np.float32), want)
        axes = te_eqx.logical_axes(emod)
        assert axes.scale == jax.sharding.PartitionSpec("embed")
        if layer == "LayerNorm":
            assert axes.bias == jax.sharding.PartitionSpec("embed")  # bias_axes follows scale_axes


@pytest.mark.parametrize("layer", LAYERS)
def test_compute_dtype_and_low_precision_input(layer):
    x = _x(dtype=jnp.bfloat16)
    r = _x(4, dtype=jnp.float32)
    out = getattr(te_nnx, layer)(H, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))(x, r)
    assert out.y.dtype == jnp.bfloat16 and out.h.dtype == jnp.bfloat16  # the residual is cast to dtype
    y = getattr(te_eqx, layer)(H, dtype=jnp.float32)(x)
    assert y.dtype == jnp.float32
    with jax.enable_x64(True):  # float64 parameters with a bfloat16 input are read as float32
        y64 = getattr(te_eqx, layer)(H, param_dtype=jnp.float64)(x)
    assert y64.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: te_linen.RMSNorm(epsilon=0.0), ValueError, r"te_layers\.RMSNorm: epsilon must be > 0"),
        (
            lambda: te_nnx.LayerNorm(H, epsilon=-1.0, rngs=nnx.Rngs(0)),
            ValueError,
            r"te_layers\.LayerNorm: epsilon must be > 0",
        ),
        (lambda: te_eqx.RMSNorm(0), ValueError, r"te_layers\.RMSNorm: num_features must be a positive int"),
        (lambda: te_eqx.RMSNorm(H, zero_centered_gamma=1), TypeError, "zero_centered_gamma must be a bool"),
        (lambda: te_linen.LayerNorm(dtype=jnp.int32), ValueError, "dtype must be"),
        (lambda: te_nnx.RMSNorm(H, scale_axes=("a", "b"), rngs=nnx.Rngs(0)), ValueError, "scale_axes must be"),
    ],
)
def test_config_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_input_errors():
    m = te_eqx.RMSNorm(H)
    with pytest.raises(ValueError, match=r"te_layers\.RMSNorm: x must have last dimension 48"):
        m(jnp.ones((2, 7)))
    with pytest.raises(ValueError, match=r"te_layers\.RMSNorm: residual must have x's shape"):
        m(jnp.ones((2, H)), jnp.ones((3, H)))
    with pytest.raises(TypeError, match=r"te_layers\.LayerNorm: x must be a floating-point array"):
        te_linen.LayerNorm().init(jax.random.key(0), jnp.ones((2, H), jnp.int32))
