"""FP8 recipes in te_layers: each layer against te_ops.fp8.fp8_dense / fp8_grouped_dense called
directly (forward, gradients, delayed-scaling state), the three front ends against each other, the
fp8_recipe context against the argument, microbatch / scan accumulation of the state, and errors."""

from __future__ import annotations

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_layers
from te_layers import _common as C
from te_layers import eqx as te_eqx
from te_layers import linen as te_linen
from te_layers import nnx as te_nnx
from te_ops._core.testing import assert_close
from te_ops.dense import dense as te_dense
from te_ops.fp8 import BlockScaling, CurrentScaling, DelayedScaling, fp8_dense, fp8_grouped_dense
from te_ops.fp8.dense import DenseScalingState
from te_ops.permutation import token_combine, token_dispatch
from te_ops.router import fused_topk_with_score_function
from tests.te_layers import _adapters as A

KIN, KOUT = 32, 48
RECIPES = {
    "current": CurrentScaling(),
    "block": BlockScaling(act_block=(1, 16), weight_block=(16, 16)),  # several blocks at these small sizes
    "delayed": DelayedScaling(history_len=4),
}
FRAMEWORKS = ("linen", "nnx", "eqx")


def _x(seed, shape=(2, 8, KIN)):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 2.0


def _loss_of(y):
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))


def _exact(a, b, msg=""):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=msg)


def _dense_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"kernel": jax.random.normal(k1, (KIN, KOUT)) / 6.0, "bias": jax.random.normal(k2, (KOUT,)) * 0.1}


def _op_tree(st: DenseScalingState) -> dict:
    return {r: {"amax_history": getattr(st, r).amax_history, "scale": getattr(st, r).scale} for r in ("x", "w", "g")}


class DenseStep:
    """One framework's Dense (fp8 recipe, gelu, bias) as ``step(x) -> (y, dkernel, dbias, state_tree)``
    through that framework's own FP8 helper; the state tree is the state after the step (None
    without delayed scaling)."""

    def __init__(self, framework, recipe, params, state_tree=None, **kw):
        self.fw, self.recipe = framework, recipe
        kw = dict(activation="gelu", fp8=recipe, **kw)
        delayed = isinstance(recipe, DelayedScaling)
        if framework == "linen":
            self.m = te_linen.Dense(KOUT, **kw)
            self.v = {"params": dict(params)}
            if delayed:
                self.v["fp8_state"] = state_tree
        elif framework == "nnx":
            self.m = A.load_nnx(te_nnx.Dense(KIN, KOUT, **kw, rngs=nnx.Rngs(0)), params)
            if delayed:
                self.m.fp8_state.set_value(state_tree)
        else:
            m, self.state = eqx.nn.make_with_state(te_eqx.Dense)(KIN, KOUT, **kw, key=jax.random.key(0))
            self.m = A.load_eqx(m, params)
            if delayed:
                self.state = self.state.set(self.m.fp8_index, state_tree)

    def step(self, x):
        if self.fw == "linen":
            y = self.m.apply(self.v, x)
            _, g, self.v = te_linen.fp8_value_and_grad(lambda v, x: _loss_of(self.m.apply(v, x)))(self.v, x)
            st = self.v.get("fp8_state")
            return y, g["kernel"], g["bias"], st
        if self.fw == "nnx":
            y = self.m(x)
            _, g = te_nnx.fp8_value_and_grad(lambda m, x: _loss_of(m(x)))(self.m, x)
            st = None if self.m.fp8_state is None else self.m.fp8_state.get_value()
            return y, g["kernel"][...], g["bias"][...], st
        y, _ = self.m(x, self.state)

        def loss(m, s, x):
            return _loss_of(m(x, s)[0])

        _, g, self.state = te_eqx.fp8_value_and_grad(loss)(self.m, self.state, x)
        st = None if self.m.fp8_index is None else self.state.get(self.m.fp8_index)
        return y, g.kernel, g.bias, st


def _op_step(recipe, params, op_state, x):
    """The same step with te_ops.fp8.fp8_dense called directly."""

    def loss(k, b, st):
        return _loss_of(fp8_dense(x, k, recipe, bias=b, state=st, activation="gelu"))

    y = fp8_dense(x, params["kernel"], recipe, bias=params["bias"], state=op_state, activation="gelu")
    if op_state is None:
        dk, db = jax.grad(loss, argnums=(0, 1))(params["kernel"], params["bias"], None)
        return y, dk, db, None
    dk, db, new = jax.grad(loss, argnums=(0, 1, 2))(params["kernel"], params["bias"], op_state)
    return y, dk, db, new


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_dense_matches_fp8_dense_over_steps(framework, recipe):
    """Bit-identical to fp8_dense (output, kernel and bias gradients, the delayed state after each of
    three steps on fresh inputs)."""
    r = RECIPES[recipe]
    params = _dense_params()
    op_state = te_layers._fp8.initial_dense_state(r) if isinstance(r, DelayedScaling) else None
    layer = DenseStep(framework, r, params, te_layers._fp8.initial_state_tree(r) if op_state is not None else None)
    for step in range(3):
        x = _x(10 + step)
        y, dk, db, st = layer.step(x)
        wy, wdk, wdb, op_state = _op_step(r, params, op_state, x)
        _exact(y, wy, f"{framework} {recipe} step {step}: y")
        _exact(dk, wdk, f"{framework} {recipe} step {step}: dkernel")
        _exact(db, wdb, f"{framework} {recipe} step {step}: dbias")
        if op_state is None:
            assert st is None
        else:
            msg = f"{framework} step {step}: state"
            jax.tree.map(lambda a, b, msg=msg: _exact(a, b, msg), st, _op_tree(op_state))
            hist = np.asarray(st["x"]["amax_history"])
            assert (hist[: step + 1] > 0).all() and (hist[step + 1 :] == 0).all(), hist
    # FP8 really ran: the high-precision Dense differs.
    hp = C.dense_apply(x, params["kernel"], params["bias"], activation="gelu")
    assert float(jnp.max(jnp.abs(hp - y))) > 1e-3


def test_delayed_scale_moves_and_differs_from_initial():
    """The delayed state's scales leave 1 after one step and follow the amax of the tensors."""
    r = RECIPES["delayed"]
    layer = DenseStep("linen", r, _dense_params(), te_layers._fp8.initial_state_tree(r))
    x = _x(3)
    _, _, _, st = layer.step(x)
    assert float(st["x"]["amax_history"][0]) == pytest.approx(float(jnp.max(jnp.abs(x))))
    assert float(st["x"]["scale"]) == pytest.approx(448.0 / float(jnp.max(jnp.abs(x))), rel=1e-6)
    assert float(st["g"]["scale"]) != 1.0 and float(st["w"]["scale"]) != 1.0


def test_linen_optax_training_pattern():
    """The documented Linen step: grads w.r.t. (params, fp8_state); params through optax, fp8_state
    from its 'gradient'. Over 3 steps the params and states equal an op-level loop."""
    r = RECIPES["delayed"]
    m = te_linen.Dense(KOUT, activation="gelu", fp8=r)
    variables = jax.jit(m.init)(jax.random.key(0), _x(0))
    params, fp8_state = variables["params"], variables["fp8_state"]
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    def loss_fn(p, s, x):
        return _loss_of(m.apply({"params": p, "fp8_state": s}, x))

    @jax.jit
    def step(p, s, o, x):
        loss, (gp, gs) = jax.value_and_grad(loss_fn, argnums=(0, 1))(p, s, x)
        upd, o = tx.update(gp, o, p)
        return optax.apply_updates(p, upd), te_linen.fp8_update(s, gs), o, loss

    op_params, op_state, op_opt = dict(params), te_layers._fp8.initial_dense_state(r), tx.init(params)

    @jax.jit
    def op_step(p, st, o, x):
        def loss(p, st):
            return _loss_of(fp8_dense(x, p["kernel"], r, bias=p["bias"], state=st, activation="gelu"))

        gp, st = jax.grad(loss, argnums=(0, 1))(p, st)
        upd, o = tx.update(gp, o, p)
        return optax.apply_updates(p, upd), st, o

    for i in range(3):
        x = _x(20 + i)
        params, fp8_state, opt_state, _ = step(params, fp8_state, opt_state, x)
        op_params, op_state, op_opt = op_step(op_params, op_state, op_opt, x)
    jax.tree.map(lambda a, b: assert_close(a, b), params, op_params)
    jax.tree.map(lambda a, b: assert_close(a, b), fp8_state, _op_tree(op_state))
    assert (np.asarray(fp8_state["w"]["amax_history"])[:3] > 0).all()


def test_unused_layer_keeps_its_state():
    """A layer whose output does not reach the loss gets a zero cotangent: its state is kept, not zeroed."""
    r = RECIPES["delayed"]

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            a = te_linen.Dense(KOUT, fp8=r, name="used")(x)
            te_linen.Dense(KOUT, fp8=r, name="unused")(x)
            return a

    m = Two()
    v = m.init(jax.random.key(0), _x(0))
    _, _, new = te_linen.fp8_value_and_grad(lambda v, x: _loss_of(m.apply(v, x)))(v, _x(1))
    jax.tree.map(_exact, new["fp8_state"]["unused"], v["fp8_state"]["unused"])
    assert float(new["fp8_state"]["used"]["g"]["amax_history"][0]) > 0


# ----------------------------------------------------------------------------------------------
# Microbatches and scans: max of amax, not sum
# ----------------------------------------------------------------------------------------------


def test_microbatch_updates_combine_by_max():
    """Two microbatches' updates (each from the same state) combine into the state of one step over
    both: every history entry and scale as after one step on the concatenated batch (loss = sum, so
    each row's gradient is the same). A sum of the two would double the history."""
    r = RECIPES["delayed"]
    m = te_linen.Dense(KOUT, activation="gelu", fp8=r)
    v = m.init(jax.random.key(0), _x(0))
    # step 1 so that the starting state has a non-trivial history
    _, _, v = te_linen.fp8_value_and_grad(lambda v, x: _loss_of(m.apply(v, x)))(v, _x(1))
    x1, x2 = _x(2), _x(3) * 3.0  # x2 has the larger amax; the gradient amax may come from either
    vg = te_linen.fp8_value_and_grad(lambda v, x: _loss_of(m.apply(v, x)))
    _, g1, v1 = vg(v, x1)
    _, g2, v2 = vg(v, x2)
    both = te_linen.fp8_accumulate(v1["fp8_state"], v2["fp8_state"])
    _, gb, vb = vg(v, jnp.concatenate([x1, x2]))
    jax.tree.map(lambda a, b: assert_close(a, b), both, vb["fp8_state"])
    jax.tree.map(lambda a, b: assert_close(a, b), te_linen.fp8_accumulate(v2["fp8_state"], v1["fp8_state"]), both)
    assert float(both["x"]["amax_history"][0]) == float(jnp.max(jnp.abs(x2)))
    naive_sum = jax.tree.map(jnp.add, v1["fp8_state"], v2["fp8_state"])
    assert not np.allclose(naive_sum["x"]["amax_history"], both["x"]["amax_history"])
    jax.tree.map(lambda a, b, c: assert_close(a + b, c, scale=10.0), g1, g2, gb)


def test_microbatch_accumulation_in_lax_scan():
    """Gradient accumulation in a jitted lax.scan: parameter gradients summed, FP8 states combined by
    fp8_accumulate; equals the Python loop over the same microbatches."""
    r = RECIPES["delayed"]
    m = te_linen.Dense(KOUT, fp8=r)
    v = m.init(jax.random.key(0), _x(0))
    xs = jnp.stack([_x(5 + i) * (1 + i) for i in range(3)])
    vg = te_linen.fp8_value_and_grad(lambda v, x: _loss_of(m.apply(v, x)))

    @jax.jit
    def accumulate(v, xs):
        _, g0, v0 = vg(v, xs[0])

        def body(carry, x):
            g, st = carry
            _, gi, vi = vg(v, x)
            return (jax.tree.map(jnp.add, g, gi), te_linen.fp8_accumulate(st, vi["fp8_state"])), None

        (g, st), _ = jax.lax.scan(body, (g0, v0["fp8_state"]), xs[1:])
        return g, st

    g, st = accumulate(v, xs)
    outs = [vg(v, x) for x in xs]
    want = te_linen.fp8_accumulate(*(o[2]["fp8_state"] for o in outs))
    jax.tree.map(lambda a, b: assert_close(a, b), st, want)
    assert float(st["x"]["amax_history"][0]) == pytest.approx(float(jnp.max(jnp.abs(xs[2]))))


def test_nn_scan_over_layers_keeps_a_state_per_layer():
    """nn.scan over layers with variable_axes={'params': 0, 'fp8_state': 0}: each scanned layer has
    its own state, updated as in the unrolled model."""
    r = RECIPES["delayed"]

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return te_linen.Dense(KIN, activation="gelu", fp8=r, name="d")(x), None

    Scanned = nn.scan(Block, variable_axes={"params": 0, "fp8_state": 0}, split_rngs={"params": True}, length=2)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Scanned(name="layers")(x, None)[0]

    m = Model()
    v = m.init(jax.random.key(0), _x(0))
    assert v["fp8_state"]["layers"]["d"]["x"]["amax_history"].shape == (2, 4)
    x = _x(1)
    _, g, new = te_linen.fp8_value_and_grad(lambda v, x: _loss_of(m.apply(v, x)))(v, x)

    d = te_linen.Dense(KIN, activation="gelu", fp8=r)
    stacked = {"params": v["params"]["layers"]["d"], "fp8_state": v["fp8_state"]["layers"]["d"]}
    layer_v = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(2)]

    def unrolled(vs, x):
        for lv in vs:
            x = d.apply(lv, x)
        return _loss_of(x)

    gu = jax.grad(unrolled)(layer_v, x)
    for i in range(2):
        want_state = te_linen.fp8_update(layer_v[i]["fp8_state"], gu[i]["fp8_state"])
        got_state = jax.tree.map(lambda a, i=i: a[i], new["fp8_state"]["layers"]["d"])
        jax.tree.map(lambda a, b: assert_close(a, b), got_state, want_state)
        got_g = jax.tree.map(lambda a, i=i: a[i], g["layers"]["d"])
        jax.tree.map(lambda a, b: assert_close(a, b, scale=10.0), got_g, gu[i]["params"])
    s = new["fp8_state"]["layers"]["d"]["x"]["amax_history"][:, 0]
    assert float(s[0]) != float(s[1])  # two layers, two different input amaxes


# ----------------------------------------------------------------------------------------------
# MoEBlock experts and MultiHeadAttention projections
# ----------------------------------------------------------------------------------------------

MOE_RECIPES = {"current": CurrentScaling(), "block": BlockScaling()}


def _moe_reference(x, rk, wi, wo, recipe, states=(None, None)):
    """MoEBlock's forward written with the te_ops ops directly (softmax top-k, SwiGLU experts);
    ``states``: the two grouped GEMMs' DenseScalingStates with delayed scaling."""
    x2 = x.reshape(-1, A.H)
    logits = te_dense(x2.astype(jnp.float32), rk.astype(jnp.float32))
    probs, rmap = fused_topk_with_score_function(logits, A.K, score_function="softmax")
    d = token_dispatch(x2, rmap, x2.shape[0] * A.K)
    gs = d.tokens_per_expert.astype(jnp.int32)
    h = fp8_grouped_dense(d.out, wi, gs, recipe, state=states[0]).astype(jnp.float32)
    h = (jax.nn.silu(h[:, : A.F]) * h[:, A.F :]).astype(x.dtype)
    y = fp8_grouped_dense(h, wo, gs, recipe, state=states[1])
    return token_combine(y, d.row_id_map, merging_probs=probs).reshape(x.shape)


@pytest.mark.parametrize("recipe", list(MOE_RECIPES))
def test_moe_experts_match_fp8_grouped_dense(recipe):
    r = MOE_RECIPES[recipe]
    m = te_linen.MoEBlock(A.E, A.K, A.F, aux_loss_coeff=0.0, fp8=r)
    x = _x(4, (A.B, A.S, A.H))
    params = nn.meta.unbox(jax.jit(m.init)(jax.random.key(1), x))["params"]

    def layer(p, x):
        return _loss_of(m.apply({"params": p}, x))

    def ref(p, x):
        return _loss_of(_moe_reference(x, p["router"]["kernel"], p["wi"], p["wo"], r))

    y = m.apply({"params": params}, x)
    _exact(y, _moe_reference(x, params["router"]["kernel"], params["wi"], params["wo"], r), "forward")
    g = jax.grad(layer, argnums=(0, 1))(params, x)
    w = jax.grad(ref, argnums=(0, 1))(params, x)
    jax.tree.map(lambda a, b: _exact(a, b, "gradients"), g, w)
    hp = te_linen.MoEBlock(A.E, A.K, A.F, aux_loss_coeff=0.0).apply({"params": params}, x)
    assert float(jnp.max(jnp.abs(hp - y))) > 1e-4  # the experts really ran in FP8


MOE_DELAYED = DelayedScaling(history_len=3)


def _moe_state_from_tree(tree):
    from te_layers._fp8 import from_tree

    return (from_tree(tree["wi"]), from_tree(tree["wo"]))


def test_moe_delayed_matches_fp8_grouped_dense():
    """Linen MoEBlock with DelayedScaling over two training steps: the output, the parameter gradients
    and the updated "fp8_state" (wi and wo, the kernels' histories and scales per expert) are
    bit-identical to fp8_grouped_dense called directly with the same states."""
    m = te_linen.MoEBlock(A.E, A.K, A.F, aux_loss_coeff=0.0, fp8=MOE_DELAYED)
    x0 = _x(40, (A.B, A.S, A.H))
    variables = nn.meta.unbox(jax.jit(m.init)(jax.random.key(3), x0))
    tree = variables["fp8_state"]
    assert tree["wi"]["w"]["amax_history"].shape == (A.E, 3) and tree["wo"]["x"]["scale"].shape == ()
    lvg = jax.jit(te_linen.fp8_value_and_grad(lambda v, x: _loss_of(m.apply(v, x))))

    def ref_loss(p, sts, x):
        return _loss_of(_moe_reference(x, p["router"]["kernel"], p["wi"], p["wo"], MOE_DELAYED, sts))

    rvg = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1)))
    for step in range(2):
        x = _x(41 + step, (A.B, A.S, A.H)) * (1 + step)
        p, sts = variables["params"], _moe_state_from_tree(variables["fp8_state"])
        _exact(m.apply(variables, x), _moe_reference(x, p["router"]["kernel"], p["wi"], p["wo"], MOE_DELAYED, sts),
               f"forward, step {step}")  # fmt: skip
        val, g, new_vars = lvg(variables, x)
        want_val, (want_g, want_sts) = rvg(p, sts, x)
        _exact(val, want_val, "loss")
        jax.tree.map(lambda a, b: _exact(a, b, "gradients"), g, want_g)
        got_sts = _moe_state_from_tree(new_vars["fp8_state"])
        jax.tree.map(lambda a, b, s=step: _exact(a, b, f"state, step {s}"), got_sts, want_sts)
        assert float(got_sts[0].w.amax_history[1, step]) > 0 and float(got_sts[1].g.amax_history[step]) > 0
        variables = new_vars
    assert len(set(np.asarray(variables["fp8_state"]["wo"]["w"]["scale"]).tolist())) == A.E  # one per expert


def test_moe_delayed_three_front_ends_agree():
    """MoEBlock experts with DelayedScaling from the fp8_recipe context: Linen ("fp8_state"), NNX
    (FP8State) and Equinox (StateIndex) give the same outputs, gradients and states over two steps
    through their own fp8_value_and_grad."""
    with te_layers.fp8_recipe(MOE_DELAYED):
        lm = te_linen.MoEBlock(A.E, A.K, A.F, aux_loss_coeff=0.0)
        x0 = _x(50, (A.B, A.S, A.H))
        variables = nn.meta.unbox(jax.jit(lm.init)(jax.random.key(0), x0))
        nm = A.load_nnx(te_nnx.MoEBlock(A.H, A.E, A.K, A.F, aux_loss_coeff=0.0, rngs=nnx.Rngs(1)), variables["params"])
        em, estate = eqx.nn.make_with_state(te_eqx.MoEBlock)(A.H, A.E, A.K, A.F, aux_loss_coeff=0.0,
                                                              key=jax.random.key(2))  # fmt: skip
        em = A.load_eqx(em, variables["params"])
        assert isinstance(nm.fp8_state, te_nnx.FP8State) and em.fp8_index is not None
        lvg = te_linen.fp8_value_and_grad(lambda v, x: _loss_of(lm.apply(v, x)))
        nvg = te_nnx.fp8_value_and_grad(lambda m, x: _loss_of(m(x)))
        evg = te_eqx.fp8_value_and_grad(lambda m, s, x: _loss_of(m(x, s)[0][0]))
        for step in range(2):
            x = _x(51 + step, (A.B, A.S, A.H))
            ly = lm.apply(variables, x)
            _exact(nm(x), ly, f"nnx output, step {step}")
            (ey, _), same = em(x, estate)
            assert same is estate
            _exact(ey, ly, f"eqx output, step {step}")
            _, lg, variables = lvg(variables, x)
            _, ng = nvg(nm, x)
            _, eg, estate = evg(em, estate, x)
            for path in (("wi",), ("wo",), ("router", "kernel")):
                want = _get(lg, path)
                _exact(_get(ng, path)[...], want, f"nnx grad {path}")
                _exact(_get(eg, path), want, f"eqx grad {path}")
            want = variables["fp8_state"]
            jax.tree.map(lambda a, b: _exact(a, b, "nnx state"), nm.fp8_state.get_value(), want)
            jax.tree.map(lambda a, b: _exact(a, b, "eqx state"), estate.get(em.fp8_index), want)
            assert float(want["wi"]["g"]["amax_history"][step]) > 0


def test_moe_delayed_expert_parallel_state_matches_unsharded():
    """Experts split over 8 CPU devices: each expert's kernel state comes from its own shard, and the
    x / g states (rows split over the shards) are combined by max. The x and w states see the same
    values as the unsharded block's, so they are bit-identical; the g states are amaxes of gradients
    that went through float32 dots of other shapes (each shard's own), which XLA's CPU backend may
    sum in another order (jax 0.12.1 does), so they agree within float32 rounding; outputs and
    gradients agree."""
    from jax.sharding import Mesh

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets 8 virtual CPU devices)")
    mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))
    e, h = 16, 32
    common = dict(num_experts=e, topk=2, ffn_dim=16, aux_loss_coeff=0.0, fp8=MOE_DELAYED)
    ref, ep = te_linen.MoEBlock(**common), te_linen.MoEBlock(**common, expert_axis="ep", mesh=mesh)
    x = _x(60, (4, 16, h))  # 64 tokens, 8 per shard; 2 experts per shard
    variables = nn.meta.unbox(jax.jit(ref.init)(jax.random.key(4), x))
    outs = []
    for mod in (ref, ep):
        vg = jax.jit(te_linen.fp8_value_and_grad(lambda v, x, mod=mod: _loss_of(mod.apply(v, x))))
        outs.append(vg(variables, x))
    (v0, g0, n0), (v1, g1, n1) = outs
    got, want = n1["fp8_state"], n0["fp8_state"]
    for w in ("wi", "wo"):
        for role in ("x", "w", "g"):
            for field in ("amax_history", "scale"):
                a, b, msg = got[w][role][field], want[w][role][field], f"{w} {role} {field}"
                if role == "g":
                    assert_close(a, b, jnp.float32, scale=float(jnp.max(jnp.abs(b))), err_msg=msg)
                else:
                    _exact(a, b, msg)
        assert float(want[w]["g"]["amax_history"][0]) > 0  # the gradients were recorded
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_moe_delayed_state_missing_or_mismatched():
    x = _x(13, (A.B, A.S, A.H))
    m = te_linen.MoEBlock(A.E, A.K, A.F, fp8=MOE_DELAYED)
    v = m.init(jax.random.key(0), x)
    want = r"MoEBlock: fp8 is DelayedScaling\(.*\), which needs the experts' delayed-scaling state in the 'fp8_state'"
    with pytest.raises(ValueError, match=want + " collection passed to apply"):
        m.apply({"params": v["params"]}, x)
    other = te_linen.MoEBlock(A.E + 4, A.K, A.F, fp8=MOE_DELAYED).init(jax.random.key(0), x)["fp8_state"]
    with pytest.raises(ValueError, match=r"'w' with amax_history \[4, 3\] and scale \[4\], one per expert\), got "
                                         r".*'amax_history': \(8, 3\)"):  # fmt: skip
        m.apply({"params": v["params"], "fp8_state": other}, x)
    nm = te_nnx.MoEBlock(A.H, A.E, A.K, A.F, rngs=nnx.Rngs(0))  # built without delayed scaling
    with te_layers.fp8_recipe(MOE_DELAYED), pytest.raises(ValueError, match=r"FP8State variable \(moe.fp8_state\)"):
        nm(x)
    em, state = eqx.nn.make_with_state(te_eqx.MoEBlock)(A.H, A.E, A.K, A.F, fp8=MOE_DELAYED, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"\(out, aux\), state = moe\(x, state\).*no state was passed"):
        em(x)


def test_mha_projections_are_fp8_dense():
    """Linen MultiHeadAttention with fp8: its qkv and out projections are fp8_dense (attention core high precision)."""
    r = RECIPES["current"]
    m = te_linen.MultiHeadAttention(A.NH, A.D, num_kv_heads=A.NKV, use_bias=True, fp8=r)
    x = _x(6, (A.B, A.S, A.H))
    p = nn.meta.unbox(jax.jit(m.init)(jax.random.key(2), x))["params"]
    qkv = fp8_dense(x, p["qkv"]["kernel"], r, bias=p["qkv"]["bias"])
    q, k, v = C.split_qkv(qkv, A.NH, A.NKV, A.D)
    o = C.heads_attention(q, k, v, use_rope=True, rope_theta=10000.0, positions=None, kv_positions=None,
                          segment_ids=None, mask_type="causal")  # fmt: skip
    want = fp8_dense(o, p["out"]["kernel"], r, bias=p["out"]["bias"])
    _exact(m.apply({"params": p}, x), want)


# ----------------------------------------------------------------------------------------------
# The three front ends agree (Dense + MHA with delayed scaling from the context, MoE current)
# ----------------------------------------------------------------------------------------------

DELAYED = DelayedScaling(history_len=4)
MOE_FP8 = CurrentScaling()


class _LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = te_linen.Dense(A.H, activation="silu", name="proj")(x)
        x = x + te_linen.MultiHeadAttention(A.NH, A.D, num_kv_heads=A.NKV, use_bias=True, name="attn")(x)
        return x + te_linen.MoEBlock(A.E, A.K, A.F, aux_loss_coeff=0.0, fp8=MOE_FP8, name="moe")(x)


class _NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.proj = te_nnx.Dense(A.H, A.H, activation="silu", rngs=rngs)
        self.attn = te_nnx.MultiHeadAttention(A.H, A.NH, A.D, num_kv_heads=A.NKV, use_bias=True, rngs=rngs)
        self.moe = te_nnx.MoEBlock(A.H, A.E, A.K, A.F, aux_loss_coeff=0.0, fp8=MOE_FP8, rngs=rngs)

    def __call__(self, x):
        x = self.proj(x)
        x = x + self.attn(x)
        return x + self.moe(x)


class _EqxModel(eqx.Module):
    proj: te_eqx.Dense
    attn: te_eqx.MultiHeadAttention
    moe: te_eqx.MoEBlock

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.proj = te_eqx.Dense(A.H, A.H, activation="silu", key=k1)
        self.attn = te_eqx.MultiHeadAttention(A.H, A.NH, A.D, num_kv_heads=A.NKV, use_bias=True, key=k2)
        self.moe = te_eqx.MoEBlock(A.H, A.E, A.K, A.F, aux_loss_coeff=0.0, fp8=MOE_FP8, key=k3)

    def __call__(self, x, state):
        x, state = self.proj(x, state)
        a, state = self.attn(x, state=state)
        x = x + a
        return x + self.moe(x)[0], state


_STATE_PATHS = (("proj",), ("attn", "qkv"), ("attn", "out"))
_GRAD_PATHS = (("proj", "kernel"), ("attn", "qkv", "kernel"), ("attn", "out", "bias"), ("moe", "wi"),
               ("moe", "wo"), ("moe", "router", "kernel"))  # fmt: skip


def _get(tree, path):
    for k in path:
        tree = tree[k] if isinstance(tree, dict) else getattr(tree, k)
    return tree


def test_three_front_ends_agree_with_fp8():
    with te_layers.fp8_recipe(DELAYED):  # Dense and MHA: delayed from the context; MoE: its own fp8= wins
        lm = _LinenModel()
        x0 = _x(7, (A.B, A.S, A.H))
        variables = nn.meta.unbox(jax.jit(lm.init)(jax.random.key(0), x0))
        nm = A.load_nnx(_NNXModel(nnx.Rngs(1)), variables["params"])
        em, estate = eqx.nn.make_with_state(_EqxModel)(jax.random.key(2))
        em = A.load_eqx(em, variables["params"])
        assert isinstance(nm.proj.fp8_state, te_nnx.FP8State) and em.attn.qkv.fp8_index is not None

        lvg = te_linen.fp8_value_and_grad(lambda v, x: _loss_of(lm.apply(v, x)))
        nvg = te_nnx.fp8_value_and_grad(lambda m, x: _loss_of(m(x)))
        evg = te_eqx.fp8_value_and_grad(lambda m, s, x: _loss_of(m(x, s)[0]))
        for step in range(2):
            x = _x(30 + step, (A.B, A.S, A.H))
            ly = lm.apply(variables, x)
            ny = nm(x)
            ey, _ = em(x, estate)
            lval, lg, variables = lvg(variables, x)
            nval, ng = nvg(nm, x)
            eval_, eg, estate = evg(em, estate, x)
            assert_close(ny, ly, err_msg=f"nnx output, step {step}")
            assert_close(ey, ly, err_msg=f"eqx output, step {step}")
            for path in _GRAD_PATHS:
                want = _get(lg, path)
                assert_close(_get(ng, path)[...], want, scale=10.0, err_msg=f"nnx grad {path}")
                assert_close(_get(eg, path), want, scale=10.0, err_msg=f"eqx grad {path}")
            for path in _STATE_PATHS:
                want = _get(variables["fp8_state"], path)
                got_n = _get(nm, path).fp8_state.get_value()
                got_e = estate.get(_get(em, path).fp8_index)
                jax.tree.map(lambda a, b, p=path: assert_close(a, b, err_msg=f"nnx state {p}"), got_n, want)
                jax.tree.map(lambda a, b, p=path: assert_close(a, b, err_msg=f"eqx state {p}"), got_e, want)
                assert float(want["g"]["amax_history"][step]) > 0


# ----------------------------------------------------------------------------------------------
# Context vs argument
# ----------------------------------------------------------------------------------------------


def _linen_dense(x, params, **kw):
    return te_linen.Dense(KOUT, **kw).apply({"params": params}, x)


def test_context_and_argument():
    params, x = _dense_params(), _x(8)
    cur, blk = RECIPES["current"], RECIPES["block"]
    with_cur = fp8_dense(x, params["kernel"], cur, bias=params["bias"])
    with_blk = fp8_dense(x, params["kernel"], blk, bias=params["bias"])
    hp = _linen_dense(x, params)
    assert te_layers.current_fp8_recipe() is None
    with te_layers.fp8_recipe(cur):
        assert te_layers.current_fp8_recipe() == cur
        _exact(_linen_dense(x, params), with_cur, "context")
        _exact(_linen_dense(x, params, fp8=blk), with_blk, "the argument wins over the context")
        _exact(_linen_dense(x, params, fp8=False), hp, "fp8=False: high precision inside a context")
        with te_layers.fp8_recipe(None):
            _exact(_linen_dense(x, params), hp, "fp8_recipe(None) turns FP8 off")
        _exact(_linen_dense(x, params), with_cur, "the outer context is back")
    assert te_layers.current_fp8_recipe() is None
    assert float(jnp.max(jnp.abs(hp - with_cur))) > 1e-3


def test_context_is_read_at_call_time_nnx_eqx():
    """NNX/Equinox modules built outside a context run in FP8 when called inside one (current
    scaling needs no state); and a jitted function traced inside the context keeps its recipe."""
    params, x = _dense_params(), _x(9)
    cur = RECIPES["current"]
    want = fp8_dense(x, params["kernel"], cur, bias=params["bias"])
    nm = A.load_nnx(te_nnx.Dense(KIN, KOUT, rngs=nnx.Rngs(0)), params)
    em = A.load_eqx(te_eqx.Dense(KIN, KOUT, key=jax.random.key(0)), params)
    hp = nm(x)
    with te_layers.fp8_recipe(cur):
        _exact(nm(x), want, "nnx")
        _exact(em(x), want, "eqx")
    _exact(nm(x), hp, "nnx outside the context")


# ----------------------------------------------------------------------------------------------
# Errors name the argument, the expected and the received value
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_fp8_argument(framework):
    def build(layer, bad):
        if framework == "linen":
            args = {"Dense": (8,), "MultiHeadAttention": (2, 8), "MoEBlock": (4, 2, 16)}[layer]
            return getattr(te_linen, layer)(*args, fp8=bad)
        args = {"Dense": (A.H, 8), "MultiHeadAttention": (A.H, 2, 8), "MoEBlock": (A.H, 4, 2, 16)}[layer]
        extra = {"rngs": nnx.Rngs(0)} if framework == "nnx" else {"key": jax.random.key(0)}
        mod = te_nnx if framework == "nnx" else te_eqx
        return getattr(mod, layer)(*args, fp8=bad, **extra)

    for layer in ("Dense", "MultiHeadAttention", "MoEBlock"):
        for bad in ("current", True, 1):
            with pytest.raises(TypeError, match=rf"te_layers.{layer}: fp8 must be None .*CurrentScaling.*got {bad!r}"):
                build(layer, bad)


def test_context_rejects_non_recipe():
    with pytest.raises(TypeError, match=r"fp8_recipe: recipe must be None or a te_ops.fp8 .*got 'block' \(str\)"):
        with te_layers.fp8_recipe("block"):
            pass


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_moe_refuses_recipes_fp8_grouped_dense_cannot_take(framework):
    """Blocks other than 1 x 128 / 128 x 128: MoEBlock says so, naming fp8 (or the context)."""
    x = _x(11, (A.B, A.S, A.H))

    def call(fp8):
        if framework == "linen":
            m = te_linen.MoEBlock(A.E, A.K, A.F, fp8=fp8)
            return m.init(jax.random.key(0), x)
        if framework == "nnx":
            return te_nnx.MoEBlock(A.H, A.E, A.K, A.F, fp8=fp8, rngs=nnx.Rngs(0))(x)
        return te_eqx.MoEBlock(A.H, A.E, A.K, A.F, fp8=fp8, key=jax.random.key(0))(x)

    with pytest.raises(ValueError, match=r"MoEBlock: fp8 \(the experts' recipe\) must be CurrentScaling, "
                                         r"DelayedScaling, or BlockScaling with act_block \(1, 128\).*"
                                         r"got BlockScaling\(.*act_block=\(1, 16\).* from fp8="):  # fmt: skip
        call(RECIPES["block"])
    with te_layers.fp8_recipe(RECIPES["block"]):
        with pytest.raises(ValueError, match=r"from the te_layers.fp8_recipe context's recipe\. Pass fp8="):
            call(None)
        call(CurrentScaling())  # its own fp8= wins over the context


def test_dense_refuses_non_square_weight_blocks():
    bad = BlockScaling(weight_block=(128, 64))
    with pytest.raises(ValueError, match=r"Dense: fp8: BlockScaling.weight_block must be square.*got \(128, 64\)"):
        te_linen.Dense(8, fp8=bad).init(jax.random.key(0), _x(0))


def test_delayed_state_missing_or_mismatched():
    x = _x(12)
    r = RECIPES["delayed"]
    m = te_linen.Dense(KOUT, fp8=r)
    params = m.init(jax.random.key(0), x)["params"]
    with pytest.raises(ValueError, match=r"Dense: fp8 is DelayedScaling\(.*\), which needs .*'fp8_state' collection"):
        m.apply({"params": params}, x)
    v = te_linen.Dense(KOUT, fp8=DelayedScaling(history_len=8)).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"amax_history \[4\] and a scalar scale\), got .*8"):
        m.apply(v, x)
    # NNX: built without delayed scaling, called inside a delayed context
    nm = te_nnx.Dense(KIN, KOUT, rngs=nnx.Rngs(0))
    with te_layers.fp8_recipe(r), pytest.raises(ValueError, match=r"FP8State variable \(dense.fp8_state\) .*got None"):
        nm(x)
    # Equinox: no state passed
    em, state = eqx.nn.make_with_state(te_eqx.Dense)(KIN, KOUT, fp8=r, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"y, state = dense\(x, state\).*no state was passed"):
        em(x)
    y, state2 = em(x, state)
    assert state2 is state and y.shape == (2, 8, KOUT)


def test_helpers_reject_wrong_arguments():
    with pytest.raises(TypeError, match=r"fp8_value_and_grad: the first argument must be the variables dict"):
        te_linen.fp8_value_and_grad(lambda v: 0.0)([1, 2])
    with pytest.raises(TypeError, match=r"must be the nnx.Module to differentiate, got dict"):
        te_nnx.fp8_value_and_grad(lambda m: 0.0)({})
    with pytest.raises(TypeError, match=r"second argument must be the eqx.nn.State .* got dict"):
        te_eqx.fp8_value_and_grad(lambda m, s: 0.0)(None, {})
    with pytest.raises(ValueError, match=r"needs at least one"):
        te_linen.fp8_accumulate()


# ----------------------------------------------------------------------------------------------
# A layer holding delayed-scaling state called with no recipe active warns
# ----------------------------------------------------------------------------------------------

_UNUSED = "this layer holds delayed-scaling FP8 state"


def _state_warnings(fn):
    """``fn()``'s result and the messages of the unused-FP8-state warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if _UNUSED in str(w.message)]


def _built_in_context(framework, layer):
    """``call(x)`` of a ``layer`` created (Linen: init-ed) inside fp8_recipe(DelayedScaling()) with fp8=None."""
    x = _x(11, (2, 8, KIN))
    with te_layers.fp8_recipe(RECIPES["delayed"]):
        if framework == "linen":
            mod = {"Dense": te_linen.Dense(KOUT), "NormDense": te_linen.NormDense(KOUT),
                   "MoEBlock": te_linen.MoEBlock(num_experts=4, topk=2, ffn_dim=16)}[layer]  # fmt: skip
            variables = mod.init(jax.random.key(0), x)
            assert "fp8_state" in variables
            return lambda: mod.apply(variables, x, mutable=["intermediates"])
        if framework == "nnx":
            rngs = nnx.Rngs(0)
            mod = {"Dense": lambda: te_nnx.Dense(KIN, KOUT, rngs=rngs),
                   "NormDense": lambda: te_nnx.NormDense(KIN, KOUT, rngs=rngs),
                   "MoEBlock": lambda: te_nnx.MoEBlock(KIN, 4, 2, 16, rngs=rngs)}[layer]()  # fmt: skip
            assert mod.fp8_state is not None
            return lambda: nnx.capture(mod, te_nnx.AuxLoss)(x)
        key = jax.random.key(0)
        cls, args = {"Dense": (te_eqx.Dense, (KIN, KOUT)), "NormDense": (te_eqx.NormDense, (KIN, KOUT)),
                     "MoEBlock": (te_eqx.MoEBlock, (KIN, 4, 2, 16))}[layer]  # fmt: skip
        mod, state = eqx.nn.make_with_state(cls)(*args, key=key)
        assert mod.fp8_index is not None
        return lambda: mod(x, state)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("layer", ["Dense", "NormDense", "MoEBlock"])
def test_delayed_state_called_without_recipe_warns(framework, layer):
    call = _built_in_context(framework, layer)
    _, msgs = _state_warnings(call)
    assert msgs, "no warning for a layer holding delayed-scaling state called outside any fp8_recipe"
    assert msgs[0].startswith(f"te_layers.{layer}: ") and "fp8=" in msgs[0] and "fp8_recipe" in msgs[0], msgs[0]
    for ctx in (RECIPES["delayed"], None):  # inside the context, or high precision on purpose: no warning
        with te_layers.fp8_recipe(ctx):
            _, msgs = _state_warnings(call)
        assert not msgs, (ctx, msgs)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("layer", ["Dense", "MoEBlock"])
@pytest.mark.parametrize("other", ["current", "block"])
def test_delayed_state_called_under_another_recipe_warns(framework, layer, other):
    """Built under DelayedScaling, called inside a CurrentScaling / BlockScaling context: the layer runs
    with that recipe and its delayed state is not used, which now warns naming the recipe."""
    call = _built_in_context(framework, layer)
    recipe = BlockScaling() if (layer, other) == ("MoEBlock", "block") else RECIPES[other]  # grouped: 1x128 only
    with te_layers.fp8_recipe(recipe):
        _, msgs = _state_warnings(call)
    name = type(recipe).__name__
    assert msgs, f"no warning for a layer holding delayed-scaling state called under {name}"
    assert msgs[0].startswith(f"te_layers.{layer}: ") and f"fp8_recipe({name}(...))" in msgs[0], msgs[0]


def test_delayed_state_without_recipe_nnx_step_warns_and_state_stays():
    """The case that used to be silent: an NNX Dense built in the context, stepped outside it, runs in
    high precision and its amax history stays zeros (now with a warning); inside the context the step
    records amaxes, and a layer without state (or built with its own fp8=) never warns."""
    x = _x(12, (4, KIN))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    with te_layers.fp8_recipe(RECIPES["delayed"]):
        d = te_nnx.Dense(KIN, KOUT, rngs=nnx.Rngs(0))
    _, msgs = _state_warnings(lambda: te_nnx.fp8_value_and_grad(loss)(d, x))
    assert len(msgs) == 1 and msgs[0].startswith("te_layers.Dense: ")
    np.testing.assert_array_equal(np.asarray(d.fp8_state.get_value()["x"]["amax_history"]), 0.0)
    with te_layers.fp8_recipe(RECIPES["delayed"]):
        _, msgs = _state_warnings(lambda: te_nnx.fp8_value_and_grad(loss)(d, x))
    assert not msgs and float(d.fp8_state.get_value()["x"]["amax_history"][0]) > 0

    own = te_nnx.Dense(KIN, KOUT, fp8=RECIPES["delayed"], rngs=nnx.Rngs(0))
    plain = te_nnx.Dense(KIN, KOUT, rngs=nnx.Rngs(0))
    for m in (own, plain):
        _, msgs = _state_warnings(lambda m=m: te_nnx.fp8_value_and_grad(loss)(m, x))
        assert not msgs
    with te_layers.fp8_recipe(RECIPES["delayed"]):
        mha = te_nnx.MultiHeadAttention(KIN, 2, 8, rngs=nnx.Rngs(0))
    _, msgs = _state_warnings(lambda: mha(_x(13, (2, 8, KIN))))
    assert msgs and all(m.startswith("te_layers.Dense: ") for m in msgs)  # its projections


# ----------------------------------------------------------------------------------------------
# Equinox: MultiHeadAttention takes the state positionally, like Dense / NormDense / MoEBlock
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused_qkv", [True, False])
def test_eqx_mha_takes_the_state_positionally(fused_qkv):
    x = _x(14, (A.B, A.S, A.H))
    with te_layers.fp8_recipe(DELAYED):
        mha, state = eqx.nn.make_with_state(te_eqx.MultiHeadAttention)(
            A.H, A.NH, A.D, num_kv_heads=A.NKV, fused_qkv=fused_qkv, key=jax.random.key(3))  # fmt: skip
        out_kw, st_kw = mha(x, state=state)
        out_pos, st_pos = mha(x, state)  # was: the state taken as inputs_kv ("inputs_kv must be None ...")
        _exact(out_pos, out_kw)

        def loss(positional):
            def fn(m, st, x):
                return _loss_of((m(x, st) if positional else m(x, state=st))[0])

            leaves, treedef = jax.tree.flatten(state)  # a copy: fp8_update consumes the state it is given
            fresh = jax.tree.unflatten(treedef, leaves)
            return te_eqx.fp8_value_and_grad(fn)(mha, fresh, x)

        (v_pos, g_pos, new_pos), (v_kw, g_kw, new_kw) = loss(True), loss(False)
        _exact(v_pos, v_kw)
        for a, b in zip(jax.tree.leaves((g_pos, new_pos)), jax.tree.leaves((g_kw, new_kw)), strict=True):
            _exact(a, b)
        assert float(new_pos.get(mha.out.fp8_index)["x"]["amax_history"][0]) > 0
        with pytest.raises(TypeError, match=r"MultiHeadAttention: got an eqx.nn.State both as inputs_kv .* state="):
            mha(x, state, state=state)
        if not fused_qkv:  # cross-attention with a state: inputs_kv positional, state keyword
            kv = _x(15, (A.B, A.S + 3, A.H))
            out, _ = mha(x, kv, state=state)
            assert out.shape == x.shape

    plain = te_eqx.MultiHeadAttention(A.H, A.NH, A.D, num_kv_heads=A.NKV, key=jax.random.key(3))
    empty = eqx.nn.State(plain)  # no delayed scaling: the state passes through
    out, st = plain(x, empty)
    _exact(out, plain(x))
    assert st is empty
