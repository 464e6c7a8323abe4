"""NormDense (RMSNorm / LayerNorm, then Dense) in Linen, NNX and Equinox: against a plain-jnp
formulation (forward and gradients, tolerances from the one dtype table), the three front ends
against each other, return_normed, parameters / init / axes, the FP8 recipes (the GEMM equals the FP8
Dense applied to the normalized input; delayed-scaling state updated by each framework's helper),
and configuration / input errors."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_layers
from te_layers import _common as C
from te_layers import eqx as te_eqx
from te_layers import linen as te_linen
from te_layers import nnx as te_nnx
from te_ops._core import testing as T
from te_ops.fp8 import BlockScaling, CurrentScaling, DelayedScaling, fp8_dense
from te_ops.fp8.dense import DenseScalingState
from te_ops.normalization import layer_norm, rms_norm
from tests.te_layers import _adapters as A

H, OUT = 32, 48
NORMS = ("rms", "layer")
FRAMEWORKS = ("linen", "nnx", "eqx")
RECIPES = {
    "current": CurrentScaling(),
    "block": BlockScaling(act_block=(1, 16), weight_block=(16, 16)),  # several blocks at these small sizes
    "delayed": DelayedScaling(history_len=4),
}


def _x(seed, shape=(2, 8, H), dtype=jnp.float32):
    return (1.5 * jax.random.normal(jax.random.key(seed), shape) + 0.3).astype(dtype)


def _params(norm, seed=1, use_bias=True):
    ks = jax.random.split(jax.random.key(seed), 4)
    p = {"scale": 1 + 0.2 * jax.random.normal(ks[0], (H,)), "kernel": jax.random.normal(ks[2], (H, OUT)) / 6.0}
    if norm == "layer":
        p["norm_bias"] = 0.3 * jax.random.normal(ks[1], (H,))
    if use_bias:
        p["bias"] = 0.1 * jax.random.normal(ks[3], (OUT,))
    return p


def _reference(norm, p, x, *, eps, zc, activation=None):
    """The layer written out in jnp (float32): (normed, activation(normed @ kernel + bias))."""
    x = x.astype(jnp.float32)
    g = (1.0 + p["scale"]) if zc else p["scale"]
    if norm == "rms":
        normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * g
    else:
        mu = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
        normed = (x - mu) * jax.lax.rsqrt(var + eps) * g + p["norm_bias"]
    y = normed @ p["kernel"]
    if "bias" in p:
        y = y + p["bias"]
    if activation == "gelu":
        y = jax.nn.gelu(y, approximate=False)
    return normed, y


def _apply_fns(norm, **kw):
    """(linen, nnx, eqx) functions ``f(params, x) -> output`` for the same configuration."""
    lin = te_linen.NormDense(OUT, norm=norm, **kw)
    nmod = te_nnx.NormDense(H, OUT, norm=norm, **kw, rngs=nnx.Rngs(0))
    emod = te_eqx.NormDense(H, OUT, norm=norm, **kw, key=jax.random.key(0))
    graphdef, _ = nnx.split(nmod)

    def f_lin(p, x):
        return lin.apply({"params": p}, x)

    def f_nnx(p, x):
        state = jax.tree.map(lambda a: a, nnx.state(nmod))
        nnx.replace_by_pure_dict(state, p)
        return nnx.merge(graphdef, state)(x)

    def f_eqx(p, x):
        m = eqx.tree_at(lambda m: [getattr(m, n) for n in p], emod, list(p.values()))
        return m(x)

    return {"linen": f_lin, "nnx": f_nnx, "eqx": f_eqx}


def _loss_of(out):
    leaves = jax.tree.leaves(out)
    return sum(jnp.sum(jnp.sin(v.astype(jnp.float32) * (i + 1.0))) for i, v in enumerate(leaves))


def _close(a, b, dtype, msg=""):
    """assert_close with the tolerance of ``dtype`` and atol scaled by the magnitude of ``b``."""
    T.assert_close(a, b, dtype, scale=max(1.0, float(jnp.max(jnp.abs(b)))), err_msg=msg)


def _exact(a, b, msg=""):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=msg)


# ----------------------------------------------------------------------------------------------
# High precision: against jnp, and the three front ends against each other
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("zc", [False, True])
def test_matches_jnp_and_front_ends_agree(norm, zc):
    """Output, normalized input and gradients (parameters and x) against the jnp formulation with the
    float32 tolerance; Linen, NNX and Equinox bit-identical with the same parameters."""
    eps = 1e-4
    p = _params(norm, seed=3 + zc)
    if zc:
        p["scale"] = p["scale"] - 1.0  # the same applied scale as without zero_centered_gamma
    x = _x(7 + zc)
    want_normed, want_y = _reference(norm, p, x, eps=eps, zc=zc, activation="gelu")
    want_g = jax.grad(lambda p, x: _loss_of(_reference(norm, p, x, eps=eps, zc=zc, activation="gelu")[::-1]),
                      argnums=(0, 1))(p, x)  # fmt: skip
    fns = _apply_fns(norm, epsilon=eps, zero_centered_gamma=zc, activation="gelu", return_normed=True)
    outs, grads = {}, {}
    for fw, f in fns.items():
        out = jax.jit(f)(p, x)
        assert isinstance(out, te_layers._norm.NormDenseOutput), fw
        _close(out.y, want_y, jnp.float32, f"{fw} y")
        _close(out.normed, want_normed, jnp.float32, f"{fw} normed")
        g = jax.jit(jax.grad(lambda p, x, f=f: _loss_of(f(p, x)), argnums=(0, 1)))(p, x)
        assert set(g[0]) == set(p), fw
        for name in p:
            _close(g[0][name], want_g[0][name], jnp.float32, f"{fw} d{name}")
        _close(g[1], want_g[1], jnp.float32, f"{fw} dx")
        outs[fw], grads[fw] = out, g
    for fw in ("nnx", "eqx"):
        jax.tree.map(lambda a, b, fw=fw: _exact(a, b, f"{fw} vs linen"), outs[fw], outs["linen"])
        jax.tree.map(lambda a, b, fw=fw: _exact(a, b, f"{fw} vs linen grads"), grads[fw], grads["linen"])


@pytest.mark.parametrize("norm", NORMS)
def test_no_bias_default_epsilon_and_plain_output(norm):
    """use_bias=False, the norm's default epsilon, return_normed=False: one array, as the jnp formulation."""
    p = _params(norm, seed=5, use_bias=False)
    x = _x(11, (3, H))
    eps = {"rms": 1e-6, "layer": 1e-5}[norm]
    _, want = _reference(norm, p, x, eps=eps, zc=False)
    for fw, f in _apply_fns(norm, use_bias=False).items():
        y = jax.jit(f)(p, x)
        assert isinstance(y, jax.Array) and y.shape == (3, OUT), fw
        _close(y, want, jnp.float32, fw)


@pytest.mark.parametrize("norm", NORMS)
def test_bfloat16_compute(norm):
    """A bfloat16 input (dtype None) computes in bfloat16: within the bfloat16 tolerance of the float32
    formulation; dtype=float32 casts it up and meets the float32 tolerance."""
    p = _params(norm, seed=6)
    x = _x(12, dtype=jnp.bfloat16)
    want_normed, want_y = _reference(norm, p, x, eps=1e-5, zc=False)
    out = jax.jit(_apply_fns(norm, epsilon=1e-5, return_normed=True)["nnx"])(p, x)
    assert out.y.dtype == jnp.bfloat16 and out.normed.dtype == jnp.bfloat16
    _close(out.y, want_y, jnp.bfloat16, "y")
    _close(out.normed, want_normed, jnp.bfloat16, "normed")
    y32 = jax.jit(_apply_fns(norm, epsilon=1e-5, dtype=jnp.float32)["eqx"])(p, x)
    assert y32.dtype == jnp.float32
    _close(y32, want_y, jnp.float32, "dtype=float32")


@pytest.mark.parametrize("norm", NORMS)
def test_parameters_names_shapes_init_and_axes(norm):
    P = jax.sharding.PartitionSpec
    x = _x(0)
    for zc, want_scale in [(False, 1.0), (True, 0.0)]:
        kw = dict(norm=norm, zero_centered_gamma=zc, param_dtype=jnp.bfloat16, kernel_axes=("embed", "mlp"))
        lin = te_linen.NormDense(OUT, **kw)
        variables = lin.init(jax.random.key(0), x)
        names = {"scale", "kernel", "bias"} | ({"norm_bias"} if norm == "layer" else set())
        assert set(variables["params"]) == names and set(variables) == {"params"}
        spec = nn.get_partition_spec(variables)["params"]
        assert spec["scale"] == P("embed") and spec["kernel"] == P("embed", "mlp") and spec["bias"] == P("mlp")
        if norm == "layer":
            assert spec["norm_bias"] == P("embed")
        params = nn.meta.unbox(variables["params"])
        assert params["kernel"].shape == (H, OUT) and params["kernel"].dtype == jnp.bfloat16
        assert float(jnp.std(params["kernel"].astype(jnp.float32))) > 0.05  # lecun_normal, as Dense
        np.testing.assert_array_equal(np.asarray(params["scale"], np.float32), want_scale)
        np.testing.assert_array_equal(np.asarray(params["bias"], np.float32), 0.0)

        nmod = te_nnx.NormDense(H, OUT, **kw, rngs=nnx.Rngs(0))
        np.testing.assert_array_equal(np.asarray(nmod.scale[...], np.float32), want_scale)
        assert nmod.kernel[...].shape == (H, OUT) and nmod.scale[...].dtype == jnp.bfloat16
        assert (nmod.norm_bias is None) == (norm == "rms")
        assert nnx.get_partition_spec(nnx.state(nmod))["scale"].get_value() == P("embed")

        emod = te_eqx.NormDense(H, OUT, **kw, key=jax.random.key(0))
        np.testing.assert_array_equal(np.asarray(emod.scale, np.float32), want_scale)
        axes = te_eqx.logical_axes(emod)
        assert axes.scale == P("embed") and axes.kernel == P("embed", "mlp") and axes.bias == P("mlp")
        assert (emod.norm_bias is None) == (norm == "rms")
        if norm == "layer":
            assert axes.norm_bias == P("embed")
    # explicit axes win over the kernel's
    emod = te_eqx.NormDense(H, OUT, norm="layer", scale_axes=("s",), norm_bias_axes=("b",), key=jax.random.key(0))
    axes = te_eqx.logical_axes(emod)
    assert axes.scale == P("s") and axes.norm_bias == P("b") and axes.kernel == P()


# ----------------------------------------------------------------------------------------------
# FP8: only the GEMM, equal to the FP8 Dense on the normalized input
# ----------------------------------------------------------------------------------------------


def _op_tree(st: DenseScalingState) -> dict:
    return {r: {"amax_history": getattr(st, r).amax_history, "scale": getattr(st, r).scale} for r in ("x", "w", "g")}


def _op_norm(norm, p, x, eps):
    if norm == "rms":
        return rms_norm(x, p["scale"], eps=eps)
    return layer_norm(x, p["scale"], p["norm_bias"], eps=eps)


class NormDenseStep:
    """One framework's NormDense (fp8 recipe, gelu, bias) as ``step(x) -> (y, grads, state_tree)``
    through that framework's own FP8 helper (as Dense's tests do); the state tree is the state after
    the step (None without delayed scaling)."""

    def __init__(self, framework, norm, recipe, params, state_tree=None):
        self.fw = framework
        kw = dict(norm=norm, epsilon=1e-5, activation="gelu", fp8=recipe)
        delayed = isinstance(recipe, DelayedScaling)
        if framework == "linen":
            self.m = te_linen.NormDense(OUT, **kw)
            self.v = {"params": dict(params)}
            if delayed:
                self.v["fp8_state"] = state_tree
        elif framework == "nnx":
            self.m = A.load_nnx(te_nnx.NormDense(H, OUT, **kw, rngs=nnx.Rngs(0)), params)
            if delayed:
                self.m.fp8_state.set_value(state_tree)
        else:
            m, self.state = eqx.nn.make_with_state(te_eqx.NormDense)(H, OUT, **kw, key=jax.random.key(0))
            self.m = A.load_eqx(m, params)
            if delayed:
                self.state = self.state.set(self.m.fp8_index, state_tree)

    def step(self, x, names):
        if self.fw == "linen":
            y = self.m.apply(self.v, x)
            _, g, self.v = te_linen.fp8_value_and_grad(lambda v, x: _loss_of(self.m.apply(v, x)))(self.v, x)
            return y, {n: g[n] for n in names}, self.v.get("fp8_state")
        if self.fw == "nnx":
            y = self.m(x)
            _, g = te_nnx.fp8_value_and_grad(lambda m, x: _loss_of(m(x)))(self.m, x)
            st = None if self.m.fp8_state is None else self.m.fp8_state.get_value()
            return y, {n: g[n][...] for n in names}, st
        y, _ = self.m(x, self.state)
        _, g, self.state = te_eqx.fp8_value_and_grad(lambda m, s, x: _loss_of(m(x, s)[0]))(self.m, self.state, x)
        st = None if self.m.fp8_index is None else self.state.get(self.m.fp8_index)
        return y, {n: getattr(g, n) for n in names}, st


def _op_step(norm, recipe, params, op_state, x):
    """The same step written with te_ops: the norm op, then te_ops.fp8.fp8_dense on its output."""

    def fwd(p, st):
        return fp8_dense(_op_norm(norm, p, x, 1e-5), p["kernel"], recipe, bias=p["bias"], state=st, activation="gelu")

    y = fwd(params, op_state)
    if op_state is None:
        return y, jax.grad(lambda p: _loss_of(fwd(p, None)))(params), None
    g, new = jax.grad(lambda p, st: _loss_of(fwd(p, st)), argnums=(0, 1))(params, op_state)
    return y, g, new


@pytest.mark.parametrize(
    "recipe, norm", [("current", "rms"), ("block", "layer"), ("delayed", "rms"), ("delayed", "layer")]
)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_fp8_matches_fp8_dense_on_normed_input(framework, recipe, norm):
    """Output and every parameter gradient bit-identical to fp8_dense(norm(x)); the delayed state
    after each of two steps on fresh inputs equal to the op-level state, through the framework's own
    update (Linen "fp8_state" collection, NNX FP8State, Equinox StateIndex)."""
    r = RECIPES[recipe]
    params = _params(norm, seed=9)
    delayed = isinstance(r, DelayedScaling)
    op_state = te_layers._fp8.initial_dense_state(r) if delayed else None
    layer = NormDenseStep(framework, norm, r, params, te_layers._fp8.initial_state_tree(r) if delayed else None)
    for step in range(2):
        x = _x(20 + step)
        y, g, st = layer.step(x, list(params))
        wy, wg, op_state = _op_step(norm, r, params, op_state, x)
        _exact(y, wy, f"{framework} {recipe} step {step}: y")
        for name in params:
            _exact(g[name], wg[name], f"{framework} {recipe} step {step}: d{name}")
        if not delayed:
            assert st is None
        else:
            msg = f"{framework} step {step}: state"
            jax.tree.map(lambda a, b, msg=msg: _exact(a, b, msg), st, _op_tree(op_state))
            hist = np.asarray(st["x"]["amax_history"])
            assert (hist[: step + 1] > 0).all() and (hist[step + 1 :] == 0).all(), hist
            # the activation amax is the normalized input's, not x's
            normed = _op_norm(norm, params, x, 1e-5)
            assert float(hist[0]) == pytest.approx(float(jnp.max(jnp.abs(normed))))
    # FP8 really ran: the high-precision layer differs.
    hp = _reference(norm, params, x, eps=1e-5, zc=False, activation="gelu")[1]
    assert float(jnp.max(jnp.abs(hp - y))) > 1e-3


@pytest.mark.parametrize("norm", NORMS)
def test_fp8_equals_te_layers_dense_on_normed_output(norm):
    """return_normed with fp8: ``normed`` is the high-precision norm and ``y`` equals te_layers' own FP8
    Dense applied to it (Linen, with the fp8_recipe context)."""
    params, x = _params(norm, seed=2), _x(31)
    r = RECIPES["block"]
    m = te_linen.NormDense(OUT, norm=norm, return_normed=True)
    with te_layers.fp8_recipe(r):
        out = m.apply({"params": params}, x)
        dense_y = te_linen.Dense(OUT).apply({"params": {"kernel": params["kernel"], "bias": params["bias"]}},
                                            out.normed)  # fmt: skip
    _exact(out.normed, _op_norm(norm, params, x, {"rms": 1e-6, "layer": 1e-5}[norm]), "normed in high precision")
    _exact(out.y, dense_y, "y = fp8 Dense(normed)")
    hp = m.apply({"params": params}, x)  # outside the context: high precision
    _exact(hp.normed, out.normed, "the norm does not depend on the recipe")
    assert float(jnp.max(jnp.abs(hp.y - out.y))) > 1e-3
    with te_layers.fp8_recipe(r):
        off = te_linen.NormDense(OUT, norm=norm, fp8=False).apply({"params": params}, x)
    _exact(off, hp.y, "fp8=False: high precision inside a context")
    _exact(C.dense_apply(out.normed, params["kernel"], params["bias"]), hp.y, "high precision = Dense(normed)")


def test_fp8_delayed_context_builds_state_in_each_front_end():
    """DelayedScaling from the context at construction gives NNX an FP8State and Equinox a StateIndex;
    Linen init creates the "fp8_state" variables at the module's path. With the same parameters the
    three give the same output."""
    r = RECIPES["delayed"]
    params, x = _params("rms", seed=4), _x(4)
    with te_layers.fp8_recipe(r):
        n = A.load_nnx(te_nnx.NormDense(H, OUT, rngs=nnx.Rngs(0)), params)
        e, state = eqx.nn.make_with_state(te_eqx.NormDense)(H, OUT, key=jax.random.key(0))
        e = A.load_eqx(e, params)
        m = te_linen.NormDense(OUT)
        v = m.init(jax.random.key(0), x)
        y_l = m.apply({"params": params, "fp8_state": v["fp8_state"]}, x)
        y_e, _ = e(x, state)
        y_n = n(x)
    assert isinstance(n.fp8_state, te_nnx.FP8State) and e.fp8_index is not None
    assert set(v["fp8_state"]) == {"x", "w", "g"} and v["fp8_state"]["x"]["amax_history"].shape == (4,)
    _exact(y_e, y_l, "eqx vs linen under the context")
    _exact(y_n, y_l, "nnx vs linen under the context")


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: te_linen.NormDense(OUT, norm="batch"), ValueError,
         r"te_layers\.NormDense: norm must be one of \['rms', 'layer'\], got 'batch'"),
        (lambda: te_nnx.NormDense(H, OUT, epsilon=0.0, rngs=nnx.Rngs(0)), ValueError,
         r"te_layers\.NormDense: epsilon must be > 0, got 0\.0"),
        (lambda: te_eqx.NormDense(H, OUT, return_normed=1, key=jax.random.key(0)), TypeError,
         r"te_layers\.NormDense: return_normed must be a bool \(True or False\), got 1 \(int\)"),
        (lambda: te_eqx.NormDense(H, 0, key=jax.random.key(0)), ValueError,
         r"te_layers\.NormDense: out_features must be a positive int, got 0"),
        (lambda: te_linen.NormDense(OUT, zero_centered_gamma="yes"), TypeError,
         r"te_layers\.NormDense: zero_centered_gamma must be a bool"),
        (lambda: te_nnx.NormDense(H, OUT, norm_bias_axes=("embed",), rngs=nnx.Rngs(0)), ValueError,
         r"te_layers\.NormDense: norm_bias_axes is only used with norm='layer'.*got norm_bias_axes=\('embed',\)"),
        (lambda: te_eqx.NormDense(H, OUT, scale_axes=("a", "b"), key=jax.random.key(0)), ValueError,
         r"te_layers\.NormDense: scale_axes must be"),
        (lambda: te_linen.NormDense(OUT, fp8="e4m3"), TypeError,
         r"te_layers\.NormDense: fp8 must be None .* got 'e4m3' \(str\)"),
        (lambda: te_nnx.NormDense(H, OUT, fp8=BlockScaling(weight_block=(16, 32)), rngs=nnx.Rngs(0)), ValueError,
         r"te_layers\.NormDense: fp8: BlockScaling\.weight_block must be square"),
    ],
)  # fmt: skip
def test_config_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_input_and_state_errors():
    e = te_eqx.NormDense(H, OUT, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"te_layers\.NormDense: x must have last dimension 32 .*got shape \(2, 7\)"):
        e(jnp.ones((2, 7)))
    with pytest.raises(TypeError, match=r"te_layers\.NormDense: x must be a floating-point array, got dtype int32"):
        te_linen.NormDense(OUT).init(jax.random.key(0), jnp.ones((2, H), jnp.int32))
    r = RECIPES["delayed"]
    ed = te_eqx.NormDense(H, OUT, fp8=r, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"te_layers\.NormDense: fp8 is DelayedScaling.*no state was passed"):
        ed(_x(0))
    m = te_linen.NormDense(OUT, fp8=r)
    v = m.init(jax.random.key(0), _x(0))
    with pytest.raises(ValueError, match=r"te_layers\.NormDense: fp8 is DelayedScaling.*'fp8_state' collection"):
        m.apply({"params": v["params"]}, _x(0))
