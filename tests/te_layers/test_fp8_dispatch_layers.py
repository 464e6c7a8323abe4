"""MoEBlock with FP8 token dispatch (``fp8_dispatch=True``, the default with FP8 experts): against
the ops composed by hand, against ``fp8_dispatch=False`` (what stays identical and what may not),
the three front ends against each other, the expert-parallel fallback, and the argument check."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_layers
from te_layers import eqx as te_eqx
from te_layers import linen as te_linen
from te_layers import nnx as te_nnx
from te_ops._core.testing import assert_close
from te_ops.dense import dense as te_dense
from te_ops.fp8 import BlockScaling, CurrentScaling, DelayedScaling, fp8_dispatch_grouped_dense, fp8_grouped_dense
from te_ops.permutation import token_combine
from te_ops.router import fused_topk_with_score_function
from tests.te_layers import _adapters as A

RECIPES = {"block": BlockScaling(), "current": CurrentScaling(), "delayed": DelayedScaling(history_len=3)}


def _x(seed, shape=(A.B, A.S, A.H)):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 2.0
    return x.at[0, 3, 5].set(40.0)  # an outlier: small elements of its row tile get few bits


def _loss_of(y):
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))


def _exact(a, b, msg=""):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=msg)


def _by_hand(x, p, recipe, states=(None, None)):
    """MoEBlock's forward with the FP8 dispatch written out with the te_ops ops."""
    x2 = x.reshape(-1, A.H)
    logits = te_dense(x2.astype(jnp.float32), p["router"]["kernel"].astype(jnp.float32))
    probs, rmap = fused_topk_with_score_function(logits, A.K, score_function="softmax")
    d = fp8_dispatch_grouped_dense(x2, rmap, x2.shape[0] * A.K, p["wi"], recipe, state=states[0])
    h = d.out.astype(jnp.float32)
    h = (jax.nn.silu(h[:, : A.F]) * h[:, A.F :]).astype(x.dtype)
    y = fp8_grouped_dense(h, p["wo"], d.tokens_per_expert, recipe, state=states[1])
    return token_combine(y, d.row_id_map, merging_probs=probs).reshape(x.shape)


def _states(variables, recipe):
    if not isinstance(recipe, DelayedScaling):
        return (None, None)
    from te_layers._fp8 import from_tree

    t = variables["fp8_state"]
    return from_tree(t["wi"]), from_tree(t["wo"])


@pytest.mark.parametrize("name", list(RECIPES))
def test_linen_moe_fp8_dispatch_is_the_composed_ops(name):
    """Output, gradients and (delayed) the updated state equal the ops composed by hand, bit for bit."""
    recipe = RECIPES[name]
    m = te_linen.MoEBlock(A.E, A.K, A.F, aux_loss_coeff=0.0, fp8=recipe)
    x = _x(1)
    variables = nn.meta.unbox(jax.jit(m.init)(jax.random.key(2), x))
    _exact(m.apply(variables, x), _by_hand(x, variables["params"], recipe, _states(variables, recipe)), "forward")
    val, g, new = jax.jit(te_linen.fp8_value_and_grad(lambda v, x: _loss_of(m.apply(v, x))))(variables, x)

    def by_hand(p, sts, x):
        return _loss_of(_by_hand(x, p, recipe, sts))

    want_val, (want_g, want_sts) = jax.jit(jax.value_and_grad(by_hand, argnums=(0, 1)))(
        variables["params"], _states(variables, recipe), x
    )
    _exact(val, want_val, "loss")
    jax.tree.map(lambda a, b: _exact(a, b, "gradients"), g, want_g)
    if isinstance(recipe, DelayedScaling):
        jax.tree.map(lambda a, b: _exact(a, b, "state"), _states(new, recipe), want_sts)


@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_dispatch_on_and_off(name):
    """fp8_dispatch=True vs False (top-k routing, nothing dropped): the same output, dx, wo and
    router gradients and delayed state bit for bit; wi's gradient identical with one scale per
    tensor and within the documented second rounding with block scaling."""
    recipe = RECIPES[name]
    on = te_linen.MoEBlock(A.E, A.K, A.F, aux_loss_coeff=0.0, fp8=recipe)
    off = te_linen.MoEBlock(A.E, A.K, A.F, aux_loss_coeff=0.0, fp8=recipe, fp8_dispatch=False)
    x = _x(3)
    variables = nn.meta.unbox(jax.jit(on.init)(jax.random.key(4), x))
    _exact(on.apply(variables, x), off.apply(variables, x), "forward")
    res = []
    for m in (on, off):

        def step(v, x, m=m):
            vg = te_linen.fp8_value_and_grad(lambda v, x: _loss_of(m.apply(v, x)))(v, x)
            return vg, jax.grad(lambda x: _loss_of(m.apply(v, x)))(x)

        res.append(jax.jit(step)(variables, x))
    ((_, g1, n1), dx1), ((_, g0, n0), dx0) = res
    _exact(dx1, dx0, "dx")
    _exact(g1["wo"], g0["wo"], "wo")
    _exact(g1["router"]["kernel"], g0["router"]["kernel"], "router")
    if isinstance(recipe, BlockScaling):
        assert_close(g1["wi"], g0["wi"], jnp.bfloat16, scale=float(jnp.max(jnp.abs(g0["wi"]))))
    else:
        _exact(g1["wi"], g0["wi"], "wi")
    if isinstance(recipe, DelayedScaling):
        jax.tree.map(lambda a, b: _exact(a, b, "state"), n1["fp8_state"], n0["fp8_state"])
    hp = te_linen.MoEBlock(A.E, A.K, A.F, aux_loss_coeff=0.0).apply({"params": variables["params"]}, x)
    assert float(jnp.max(jnp.abs(hp - on.apply(variables, x)))) > 1e-4  # the experts really ran in FP8


@pytest.mark.parametrize("fp8_dispatch", [True, False])
@pytest.mark.parametrize("name", ["block", "delayed"])
def test_three_front_ends_agree(name, fp8_dispatch):
    """Linen, NNX and Equinox MoEBlocks with the same parameters and fp8_dispatch: the same outputs,
    gradients and (delayed) states, through their own fp8_value_and_grad."""
    recipe = RECIPES[name]
    kw = dict(aux_loss_coeff=0.0, fp8_dispatch=fp8_dispatch)
    with te_layers.fp8_recipe(recipe):
        lm = te_linen.MoEBlock(A.E, A.K, A.F, **kw)
        x = _x(5)
        variables = nn.meta.unbox(jax.jit(lm.init)(jax.random.key(0), x))
        nm = A.load_nnx(te_nnx.MoEBlock(A.H, A.E, A.K, A.F, **kw, rngs=nnx.Rngs(1)), variables["params"])
        em, estate = eqx.nn.make_with_state(te_eqx.MoEBlock)(A.H, A.E, A.K, A.F, **kw, key=jax.random.key(2))
        em = A.load_eqx(em, variables["params"])
        ly = lm.apply(variables, x)
        _exact(nm(x), ly, "nnx output")
        _exact((em(x, estate)[0][0] if em.fp8_index is not None else em(x)[0]), ly, "eqx output")
        _, lg, lnew = te_linen.fp8_value_and_grad(lambda v, x: _loss_of(lm.apply(v, x)))(variables, x)
        if isinstance(recipe, DelayedScaling):
            _, ng = te_nnx.fp8_value_and_grad(lambda m, x: _loss_of(m(x)))(nm, x)
            _, eg, estate = te_eqx.fp8_value_and_grad(lambda m, s, x: _loss_of(m(x, s)[0][0]))(em, estate, x)
            jax.tree.map(lambda a, b: _exact(a, b, "nnx state"), nm.fp8_state.get_value(), lnew["fp8_state"])
            jax.tree.map(lambda a, b: _exact(a, b, "eqx state"), estate.get(em.fp8_index), lnew["fp8_state"])
        else:
            ng = nnx.grad(lambda m, x: _loss_of(m(x)))(nm, x)
            eg = eqx.filter_grad(lambda m, x: _loss_of(m(x)[0]))(em, x)
        for key in ("wi", "wo"):
            _exact(ng[key][...], lg[key], f"nnx grad {key}")
            _exact(getattr(eg, key), lg[key], f"eqx grad {key}")


def test_expert_parallel_fp8_dispatch_on_and_off_agree_within_fp8_error():
    """With expert_axis, fp8_dispatch=True sends FP8 rows through the all-to-all (one pmax-reduced
    current scale for the tokens) and False sends high-precision rows, each expert GEMM quantizing
    its own input: both stay FP8-rounding close to the unsharded block and to each other. The
    all-to-all dtypes and the bit-exactness of the FP8 rows are tested in test_fp8_ep_dispatch.py."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))
    common = dict(num_experts=16, topk=2, ffn_dim=16, aux_loss_coeff=0.0, fp8=CurrentScaling())
    x = _x(6, (4, 16, 32))
    ref = te_linen.MoEBlock(**common, fp8_dispatch=False)
    variables = nn.meta.unbox(jax.jit(ref.init)(jax.random.key(4), x))
    ep_on = te_linen.MoEBlock(**common, expert_axis="ep", mesh=mesh)
    ep_off = te_linen.MoEBlock(**common, expert_axis="ep", mesh=mesh, fp8_dispatch=False)
    y_on = np.asarray(jax.jit(ep_on.apply)(variables, x), np.float64)
    y_off = np.asarray(jax.jit(ep_off.apply)(variables, x), np.float64)
    y_ref = np.asarray(jax.jit(ref.apply)(variables, x), np.float64)
    assert np.isfinite(y_on).all() and np.linalg.norm(y_ref) > 0
    for name, y in (("fp8_dispatch on", y_on), ("fp8_dispatch off", y_off)):
        err = np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref)
        assert err <= 0.1, f"expert parallel, {name}: relative error {err:.3f} against the unsharded block"
    assert np.linalg.norm(y_on - y_off) <= 0.1 * np.linalg.norm(y_ref)


@pytest.mark.parametrize("framework", ["linen", "nnx", "eqx"])
def test_fp8_dispatch_must_be_a_bool(framework):
    with pytest.raises(TypeError, match="MoEBlock.*fp8_dispatch must be a bool"):
        if framework == "linen":
            te_linen.MoEBlock(A.E, A.K, A.F, fp8_dispatch=1)
        elif framework == "nnx":
            te_nnx.MoEBlock(A.H, A.E, A.K, A.F, fp8_dispatch="yes", rngs=nnx.Rngs(0))
        else:
            te_eqx.MoEBlock(A.H, A.E, A.K, A.F, fp8_dispatch=None, key=jax.random.key(0))


@pytest.mark.parametrize("activation, gated", [("silu", True), ("relu", False), ("gelu", True)])
def test_fused_ffn_switch_is_the_unfused_path(monkeypatch, activation, gated):
    """te_layers._common.FP8_FUSED_FFN routes block-scaled MoE experts through
    te_ops.fp8.fp8_dispatch_ffn: on the reference path (this CPU) the output and every gradient are
    the unfused path's bit for bit, in Linen, NNX and Equinox, and the fused op really ran."""
    from te_layers import _common as C
    from te_ops.fp8 import ffn

    recipe = RECIPES["block"]
    kw = dict(aux_loss_coeff=0.0, fp8=recipe, activation=activation, gated=gated)
    m = te_linen.MoEBlock(A.E, A.K, A.F, **kw)
    x = _x(7)
    variables = nn.meta.unbox(jax.jit(m.init)(jax.random.key(8), x))
    nm = A.load_nnx(te_nnx.MoEBlock(A.H, A.E, A.K, A.F, **kw, rngs=nnx.Rngs(1)), variables["params"])
    em = A.load_eqx(te_eqx.MoEBlock(A.H, A.E, A.K, A.F, **kw, key=jax.random.key(2)), variables["params"])
    calls = []
    real = ffn._fused
    monkeypatch.setattr(ffn, "_fused", lambda *a: calls.append(1) or real(*a))
    res = {}
    for fused in (False, True):
        monkeypatch.setattr(C, "FP8_FUSED_FFN", fused)
        val, g = jax.value_and_grad(lambda p, x: _loss_of(m.apply({"params": p}, x)), argnums=(0, 1))(
            variables["params"], x
        )
        res[fused] = (val, g, nm(x), em(x)[0])
    assert calls, "fp8_dispatch_ffn was not called with FP8_FUSED_FFN on"
    jax.tree.map(lambda a, b: _exact(a, b, "fused vs unfused"), res[True], res[False])
