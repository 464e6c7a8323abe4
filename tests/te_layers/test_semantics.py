"""The layers against direct jnp formulations, and framework-specific state (aux loss, expert bias)."""

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from te_layers import _common as C
from te_layers import eqx as te_eqx
from te_layers import linen as te_linen
from te_layers import nnx as te_nnx


def _rope(x, theta=10000.0):
    s, half = x.shape[1], x.shape[-1] // 2
    ang = jnp.arange(s)[:, None, None] * theta ** (-jnp.arange(half) / half)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)


def test_mha_matches_jax_attention_gqa_rope_causal():
    b, s, h, nh, nkv, d = 2, 16, 32, 4, 2, 8
    x = jax.random.normal(jax.random.key(0), (b, s, h))
    mha = te_linen.MultiHeadAttention(nh, d, num_kv_heads=nkv, use_bias=True)
    p = nn.meta.unbox(jax.jit(mha.init)(jax.random.key(1), x))["params"]
    p = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(2), a.shape), p)  # non-zero biases
    y = jax.jit(mha.apply)({"params": p}, x)
    qkv = x @ p["qkv"]["kernel"] + p["qkv"]["bias"]
    q, k, v = jnp.split(qkv, [nh * d, (nh + nkv) * d], -1)
    q, k, v = q.reshape(b, s, nh, d), k.reshape(b, s, nkv, d), v.reshape(b, s, nkv, d)
    o = jax.nn.dot_product_attention(_rope(q), _rope(k), v, is_causal=True).reshape(b, s, nh * d)
    ref = o @ p["out"]["kernel"] + p["out"]["bias"]
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_mha_packed_segments_equal_separate_sequences():
    x = jax.random.normal(jax.random.key(3), (1, 16, 32))
    seg = jnp.array([[0] * 6 + [1] * 10])
    mha = te_eqx.MultiHeadAttention(32, 4, 8, num_kv_heads=1, key=jax.random.key(4))
    packed, first, second = eqx.filter_jit(lambda m, x: (m(x, segment_ids=seg), m(x[:, :6]), m(x[:, 6:])))(mha, x)
    np.testing.assert_allclose(np.asarray(packed[:, :6]), np.asarray(first), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(packed[:, 6:]), np.asarray(second), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gated,activation", [(True, "silu"), (False, "gelu")])
def test_moe_matches_dense_formulation(gated, activation):
    t, h, e, k, f = 24, 16, 4, 2, 8
    ks = jax.random.split(jax.random.key(5), 4)
    x = jax.random.normal(ks[0], (t, h))
    rk = jax.random.normal(ks[1], (h, e))
    wi = 0.3 * jax.random.normal(ks[2], (e, h, f * (2 if gated else 1)))
    wo = 0.3 * jax.random.normal(ks[3], (e, f, h))
    cfg = C.MoEConfig(C.RouterConfig(num_experts=e, topk=k, aux_loss_coeff=0.5), f, activation, gated)
    r = jax.jit(lambda x: C.moe_apply(x, rk, wi, wo, cfg))(x)
    logits = x @ rk
    vals, idx = jax.lax.top_k(logits, k)
    probs = jnp.zeros_like(logits).at[jnp.arange(t)[:, None], idx].set(jax.nn.softmax(vals, -1))
    z = jnp.einsum("th,ehf->etf", x, wi)
    act = jax.nn.silu if activation == "silu" else (lambda u: jax.nn.gelu(u, approximate=False))
    z = act(z[..., :f]) * z[..., f:] if gated else act(z)
    y_all = jnp.einsum("etf,efh->eth", z, wo)
    ref = jnp.einsum("te,eth->th", probs, y_all)
    np.testing.assert_allclose(np.asarray(r.out), np.asarray(ref), rtol=1e-4, atol=1e-5)
    scores = jax.nn.softmax(logits, -1)
    tpe = jnp.zeros(e).at[idx.reshape(-1)].add(1.0)
    aux = e * 0.5 / (k * t * t) * jnp.sum(scores.sum(0) * tpe)
    np.testing.assert_allclose(float(r.aux_loss), float(aux), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(r.tokens_per_expert), np.asarray(tpe, np.int32))


def test_expert_bias_update_in_every_framework():
    h, e, k, f = 16, 4, 2, 8
    x = jax.random.normal(jax.random.key(6), (32, h))
    opts = dict(score_function="sigmoid", use_expert_bias=True, expert_bias_update_rate=0.1)
    lin = te_linen.MoEBlock(e, k, f, **opts)
    v = nn.meta.unbox(jax.jit(lin.init)(jax.random.key(7), x))
    apply = jax.jit(lin.apply, static_argnames=("deterministic", "mutable"))
    _, st = apply(v, x, deterministic=False, mutable=("router_state", "intermediates"))
    b_lin = st["router_state"]["router"]["expert_bias"]
    tpe = st["intermediates"]["tokens_per_expert"][0]
    expected = 0.1 * jnp.sign(tpe.mean() - tpe)
    np.testing.assert_allclose(np.asarray(b_lin), np.asarray(expected), atol=1e-7)
    _, st_eval = apply(v, x, deterministic=True, mutable=("router_state", "intermediates"))  # no update
    assert not np.any(np.asarray(st_eval["router_state"]["router"]["expert_bias"]))

    from tests.te_layers._adapters import load_eqx, load_nnx

    m = load_nnx(te_nnx.MoEBlock(h, e, k, f, **opts, rngs=nnx.Rngs(0)), v["params"])
    nnx.jit(nnx.capture(lambda m, x: m(x), te_nnx.AuxLoss))(m, x)
    np.testing.assert_allclose(np.asarray(m.router.expert_bias[...]), np.asarray(b_lin), atol=1e-7)
    assert isinstance(m.router.expert_bias, te_nnx.ExpertBias) and not nnx.state(m, nnx.Param).get("expert_bias")

    q = load_eqx(te_eqx.MoEBlock(h, e, k, f, **opts, key=jax.random.key(0)), v["params"])
    _, aux = eqx.filter_jit(lambda q, x: q(x))(q, x)
    q2 = q.update_expert_bias(aux.tokens_per_expert)
    np.testing.assert_allclose(np.asarray(q2.router.expert_bias), np.asarray(b_lin), atol=1e-7)


def test_router_options_and_errors():
    x = jax.random.normal(jax.random.key(8), (8, 4, 16))
    router = te_eqx.TopKRouter(
        16,
        8,
        4,
        score_function="softmax",
        use_pre_softmax=True,
        num_groups=4,
        group_topk=2,
        scaling_factor=2.0,
        aux_loss_coeff=0.1,
        key=jax.random.key(9),
    )
    r = eqx.filter_jit(lambda m, x: m(x))(router, x)
    assert r.probs.shape == (32, 8) and bool(jnp.all(r.routing_map.sum(1) == 4))
    assert float(r.aux_loss) > 0
    with pytest.raises(ValueError, match="needs score_function='sigmoid'"):
        te_eqx.TopKRouter(16, 8, 2, use_expert_bias=True, key=jax.random.key(0))
    with pytest.raises(ValueError, match="num_kv_heads must divide num_heads=4"):
        te_eqx.MultiHeadAttention(16, 4, 8, num_kv_heads=3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="variant must be one of"):
        te_nnx.Softmax("upper")


def test_partitioning_metadata_in_every_framework():
    from jax.sharding import PartitionSpec as P

    x = jnp.zeros((2, 8, 16))
    rules = (("expert", "ep"), ("embed", None), ("mlp", "tp"), ("heads", "tp"))
    boxed = jax.eval_shape(te_linen.MoEBlock(4, 2, 8).init, jax.random.key(0), x)["params"]
    specs = nn.logical_to_mesh(nn.get_partition_spec(boxed), rules)
    assert specs["wi"] == P("ep", None, "tp") and specs["wo"] == P("ep", "tp", None)

    m = te_nnx.MultiHeadAttention(16, 2, 8, rngs=nnx.Rngs(0))
    nspecs = nnx.get_partition_spec(nnx.state(m, nnx.Param))
    assert nspecs["qkv"]["kernel"].get_value() == P("embed", "heads")
    assert nspecs["out"]["kernel"].get_value() == P("heads", "embed")

    e = te_eqx.logical_axes(te_eqx.MoEBlock(16, 4, 2, 8, key=jax.random.key(0)))
    assert e.wi == P("expert", "embed", "mlp") and e.router.kernel == P("embed", None)


# ----------------------------------------------------------------------------------------------
# NNX: nnx.view(model, deterministic=...) (set_view), as for flax's nnx.Dropout / MultiHeadAttention
# ----------------------------------------------------------------------------------------------


def _nnx_mode_modules():
    """Every te_layers.nnx module with a ``deterministic`` flag, with a call that shows it: dropout on
    (DotProductAttention, MultiHeadAttention), the expert-bias update on (TopKRouter, MoEBlock)."""
    x = jax.random.normal(jax.random.key(20), (2, 8, 16))
    q = jax.random.normal(jax.random.key(21), (2, 8, 2, 8))
    bias = dict(score_function="sigmoid", use_expert_bias=True, expert_bias_update_rate=0.1)
    return {
        "DotProductAttention": (te_nnx.DotProductAttention(dropout_rate=0.5, rngs=nnx.Rngs(0)), lambda m: m(q, q, q)),
        "MultiHeadAttention": (te_nnx.MultiHeadAttention(16, 2, 8, dropout_rate=0.5, rngs=nnx.Rngs(0)),
                               lambda m: m(x)),
        "TopKRouter": (te_nnx.TopKRouter(16, 4, 2, rngs=nnx.Rngs(0), **bias), lambda m: m(x).probs),
        "MoEBlock": (te_nnx.MoEBlock(16, 4, 2, 8, rngs=nnx.Rngs(0), **bias), lambda m: m(x)),
    }  # fmt: skip


def _nnx_changes(mod, call):
    """Whether a call is non-deterministic: two calls differ (dropout) or the expert bias moved."""
    if hasattr(mod, "dropout_rate"):
        return not np.array_equal(np.asarray(call(mod)), np.asarray(call(mod)))
    bias = mod.expert_bias if isinstance(mod, te_nnx.TopKRouter) else mod.router.expert_bias
    before = np.asarray(bias[...])
    nnx.capture(call, te_nnx.AuxLoss)(mod)
    return not np.array_equal(np.asarray(bias[...]), before)


@pytest.mark.parametrize("name", ["DotProductAttention", "MultiHeadAttention", "TopKRouter", "MoEBlock"])
def test_nnx_view_deterministic(name):
    mod, call = _nnx_mode_modules()[name]
    view = nnx.view(mod, deterministic=True)  # raised "Unused keys found in nnx.view: ['deterministic']"
    assert view.deterministic is True and mod.deterministic is False  # a view: the model is untouched
    assert not _nnx_changes(view, call), "deterministic=True view still runs dropout / moves the expert bias"
    assert _nnx_changes(mod, call)
    mod.eval()
    assert _nnx_changes(nnx.view(mod, deterministic=False), call) and mod.deterministic is True
    with pytest.raises(TypeError, match=f"te_layers.{name}: deterministic must be a bool"):
        nnx.view(mod, deterministic=1)


def test_nnx_view_deterministic_on_a_model_equals_eval():
    """On a model holding several te_layers modules (nested, and next to flax's nnx.Dropout) the view
    switches all of them, and its output is model.eval()'s."""

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.attn = te_nnx.MultiHeadAttention(16, 2, 8, dropout_rate=0.5, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.moe = te_nnx.MoEBlock(16, 4, 2, 8, score_function="sigmoid", use_expert_bias=True, rngs=rngs)

        def __call__(self, x):
            return self.moe(self.drop(self.attn(x)))

    x = jax.random.normal(jax.random.key(22), (2, 8, 16))
    model = Model(nnx.Rngs(0))
    view = nnx.view(model, deterministic=True)
    fwd = nnx.jit(nnx.capture(lambda m, x: m(x), te_nnx.AuxLoss))
    (y1, _), (y2, _) = fwd(view, x), fwd(view, x)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    assert not np.any(np.asarray(model.moe.router.expert_bias[...]))
    assert not any(m.deterministic for m in (model.attn, model.drop, model.moe))
    model.eval()
    np.testing.assert_array_equal(np.asarray(fwd(model, x)[0]), np.asarray(y1))


# ----------------------------------------------------------------------------------------------
# NNX: aux losses are sown into nnx.capture only; a call outside it leaves the module unchanged
# ----------------------------------------------------------------------------------------------


def _nnx_snapshot(mod):
    graphdef, state = nnx.split(mod)
    return graphdef, [np.asarray(a) for a in jax.tree.leaves(state)]


@pytest.mark.parametrize("layer", ["MoEBlock", "TopKRouter"])
def test_nnx_aux_loss_outside_capture_leaves_the_module_unchanged(layer):
    x = jax.random.normal(jax.random.key(23), (2, 8, 16))
    if layer == "MoEBlock":
        mod = te_nnx.MoEBlock(16, 4, 2, 8, aux_loss_coeff=0.1, rngs=nnx.Rngs(0))
        want = C.moe_apply(x, mod.router.kernel[...], mod.wi[...], mod.wo[...], mod.cfg).aux_loss
    else:
        mod = te_nnx.TopKRouter(16, 4, 2, aux_loss_coeff=0.1, rngs=nnx.Rngs(0))
        want = C.route(C.router_logits(x.reshape(-1, 16), mod.kernel[...]), mod.cfg).aux_loss
    capture = nnx.jit(nnx.capture(lambda m, x: m(x), te_nnx.AuxLoss, te_nnx.TokensPerExpert))
    _, sown, _ = capture(mod, x)
    np.testing.assert_allclose(float(te_nnx.collect_aux_loss(sown)), float(want), rtol=1e-6)
    assert float(want) > 0

    traces = 0

    @nnx.jit
    def forward(m, x):
        nonlocal traces
        traces += 1
        return m(x)

    before = _nnx_snapshot(mod)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            forward(mod, x)
        mod(x)  # eager too
    assert traces == 1, f"{traces} traces for 4 calls: the module's state changed between calls"
    assert not [w for w in caught if "sow" in str(w.message)], [str(w.message) for w in caught]
    after = _nnx_snapshot(mod)
    assert after[0] == before[0] and not nnx.state(mod, te_nnx.AuxLoss)
    for a, b in zip(after[1], before[1], strict=True):
        np.testing.assert_array_equal(a, b)

    _, sown, counts = capture(mod, x)  # capture is as before: one aux loss (and token count) per call
    assert len(jax.tree.leaves(sown)) == 1 and len(jax.tree.leaves(counts)) == (layer == "MoEBlock")
    np.testing.assert_allclose(float(te_nnx.collect_aux_loss(sown)), float(want), rtol=1e-6)
    with pytest.warns(UserWarning, match="sow their aux loss only inside nnx.capture"):
        assert float(te_nnx.collect_aux_loss(mod)) == 0.0  # nothing on the module: say so, not a silent 0
