"""CPU tests of the MoE router ops (reference path, dispatch, custom VJPs, vmap, sharding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from te_ops._core.testing import assert_close, cpu_mesh, run_sharded
from te_ops.router import (
    compute_routing_scores_for_aux_loss,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
    pack_routing_map,
    unpack_routing_map,
)

F32 = jnp.float32


# ----------------------------------------------------------------------------------------------
# An independent formulation: stable argsort instead of lax.top_k, dense masked weights.
# ----------------------------------------------------------------------------------------------


def _desc_order(v):
    # Stable ascending sort of -v: larger value first, ties keep the smaller index first
    # (zeros mapped to +0.0 so that -0.0 and +0.0 tie).
    return jnp.argsort(jnp.where(v == 0, 0.0, -v), axis=-1, stable=True)


def _mask_from(order, k, n):
    t = order.shape[0]
    return jnp.zeros((t, n), bool).at[jnp.arange(t)[:, None], order[:, :k]].set(True)


def direct_topk(
    x,
    topk,
    score_function="softmax",
    use_pre_softmax=False,
    num_groups=None,
    group_topk=None,
    scaling_factor=1.0,
    expert_bias=None,
):
    x = x.astype(F32)
    t, e = x.shape
    if score_function == "softmax":
        s = jax.nn.softmax(x, axis=-1) if use_pre_softmax else x
    else:
        s = jax.nn.sigmoid(x)
    sel = jax.lax.stop_gradient(s if expert_bias is None else s + expert_bias.astype(F32))
    if group_topk is not None:
        gs, m = e // num_groups, topk // group_topk
        desc = -jnp.sort(-sel.reshape(t, num_groups, gs), axis=-1)
        gscore = desc[..., :m].sum(-1)
        keep = _mask_from(_desc_order(gscore), group_topk, num_groups)
        sel = jnp.where(jnp.repeat(keep, gs, axis=-1), sel, -jnp.inf)
    chosen = _mask_from(_desc_order(sel), topk, e)
    if score_function == "softmax" and not use_pre_softmax:
        w = jax.nn.softmax(jnp.where(chosen, x, -jnp.inf), axis=-1)
    else:
        w = jnp.where(chosen, s, 0.0)
        if score_function == "sigmoid" and topk > 1:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return scaling_factor * w, chosen


def direct_scores(x, topk, score_function):
    x = x.astype(F32)
    if score_function == "softmax":
        s = jax.nn.softmax(x, axis=-1)
    else:
        sig = jax.nn.sigmoid(x)
        s = sig / (sig.sum(-1, keepdims=True) + 1e-20)
    return _mask_from(_desc_order(jax.lax.stop_gradient(s)), topk, x.shape[1]), s


def direct_loss(probs, tpe, topk, coeff):
    t, e = probs.shape
    return e * coeff / (topk * t * t) * jnp.sum(probs.astype(F32).sum(0) * tpe.astype(F32))


def tied_logits(key, shape, levels=6, step=0.5):
    """Quantised logits: many exact ties (integers / 2, never -0.0)."""
    return jax.random.randint(key, shape, -levels, levels + 1).astype(F32) * step


def rand(key, shape, dtype=F32):
    return jax.random.normal(key, shape, F32).astype(dtype)


CONFIGS = [
    dict(topk=4, score_function="softmax"),
    dict(topk=4, score_function="softmax", use_pre_softmax=True),
    dict(topk=1, score_function="sigmoid"),
    dict(topk=4, score_function="sigmoid", scaling_factor=2.5),
    dict(topk=4, score_function="sigmoid", num_groups=8, group_topk=2, scaling_factor=2.5, bias=True),
    dict(topk=6, score_function="softmax", num_groups=4, group_topk=3),
    dict(topk=3, score_function="sigmoid", bias=True),
]


def _split(cfg, e, key):
    cfg = dict(cfg)
    bias = None
    if cfg.pop("bias", False):
        bias = jax.random.randint(key, (e,), -2, 3).astype(F32) * 0.25
    return cfg, bias


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_topk_matches_direct(cfg, ties):
    t, e = 48, 32
    k1, k2 = jax.random.split(jax.random.PRNGKey(hash((str(cfg), ties)) % 2**31))
    x = tied_logits(k1, (t, e)) if ties else rand(k1, (t, e))
    cfg, bias = _split(cfg, e, k2)
    probs, rmap = jax.jit(lambda x: fused_topk_with_score_function(x, expert_bias=bias, **cfg))(x)
    want_p, want_m = jax.jit(lambda x: direct_topk(x, expert_bias=bias, **cfg))(x)
    assert rmap.dtype == jnp.bool_ and rmap.shape == (t, e)
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(want_m))
    assert_close(probs, want_p)
    assert (np.asarray(rmap).sum(-1) == cfg["topk"]).all()


def test_ties_go_to_smaller_index():
    x = jnp.array([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0]], F32)
    _, rmap = fused_topk_with_score_function(x, 2)
    np.testing.assert_array_equal(np.asarray(rmap), [[False, True, True, False, False, False]])
    # grouped: groups [1,3] [3,2] [3,0] all score 4 with per-group top-1 sum 3 -> groups 0 and 1 win
    _, rmap = fused_topk_with_score_function(x, 2, num_groups=3, group_topk=2)
    np.testing.assert_array_equal(np.asarray(rmap), [[False, True, True, False, False, False]])


def test_grouped_selection_excludes_groups():
    # group 1 holds the single largest score but group 0's top-2 sum is larger.
    x = jnp.array([[5.0, 4.0, 0.0, 0.0, 9.0, -9.0, 0.0, 0.0]], F32)
    _, plain = fused_topk_with_score_function(x, 2)
    _, grouped = fused_topk_with_score_function(x, 2, num_groups=2, group_topk=1)
    np.testing.assert_array_equal(np.asarray(plain)[0].nonzero()[0], [0, 4])
    np.testing.assert_array_equal(np.asarray(grouped)[0].nonzero()[0], [0, 1])


def test_sigmoid_bias_scaling_values():
    x = jnp.array([[0.0, 1.0, -1.0, 2.0]], F32)
    bias = jnp.array([0.0, 0.0, 5.0, 0.0])
    probs, rmap = fused_topk_with_score_function(x, 2, score_function="sigmoid", expert_bias=bias, scaling_factor=2.5)
    np.testing.assert_array_equal(np.asarray(rmap), [[False, False, True, True]])
    sig = jax.nn.sigmoid(jnp.array([-1.0, 2.0]))
    want = 2.5 * sig / (sig.sum() + 1e-20)
    assert_close(probs[0, 2:], want)
    assert float(probs[0, 0]) == 0.0 and float(probs[0, 1]) == 0.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_dtypes(dtype):
    x = rand(jax.random.PRNGKey(1), (32, 64), dtype)
    probs, rmap = fused_topk_with_score_function(x, 8, score_function="sigmoid", num_groups=8, group_topk=4)
    want_p, want_m = direct_topk(x, 8, "sigmoid", num_groups=8, group_topk=4)
    assert probs.dtype == dtype
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(want_m))
    assert_close(probs, want_p, dtype)
    rmap2, scores = compute_routing_scores_for_aux_loss(x, 8)
    assert scores.dtype == dtype
    assert_close(scores, direct_scores(x, 8, "softmax")[1], dtype)


# ----------------------------------------------------------------------------------------------
# Compact routing map
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("e", [8, 13, 32, 70])
def test_compact_map_bit_exact(e):
    x = tied_logits(jax.random.PRNGKey(e), (24, e), levels=3)
    topk = min(5, e)
    probs, rmap = fused_topk_with_score_function(x, topk)
    probs_c, packed = fused_topk_with_score_function(x, topk, compact_routing_map=True)
    assert packed.dtype == jnp.uint8 and packed.shape == (24, (e + 7) // 8)
    want = np.packbits(np.asarray(rmap), axis=-1, bitorder="little")
    np.testing.assert_array_equal(np.asarray(packed), want)
    np.testing.assert_array_equal(np.asarray(unpack_routing_map(packed, e)), np.asarray(rmap))
    np.testing.assert_array_equal(np.asarray(pack_routing_map(rmap)), want)
    np.testing.assert_array_equal(np.asarray(probs_c), np.asarray(probs))
    m2, _ = compute_routing_scores_for_aux_loss(x, topk, compact_routing_map=True)
    m1, _ = compute_routing_scores_for_aux_loss(x, topk)
    np.testing.assert_array_equal(np.asarray(m2), np.packbits(np.asarray(m1), axis=-1, bitorder="little"))


# ----------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, compact",
    [(c, False) for c in CONFIGS] + [(CONFIGS[1], True), (CONFIGS[4], True)],
    ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) if isinstance(c, dict) else ("compact" if c else "bool"),
)
def test_topk_gradient(cfg, compact):
    t, e = 16, 32
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(7), 3)
    x = rand(k1, (t, e))
    cfg, bias = _split(cfg, e, k2)
    w = rand(k3, (t, e))

    def ours(x):
        p, _ = fused_topk_with_score_function(x, expert_bias=bias, compact_routing_map=compact, **cfg)
        return jnp.sum(p * w)

    def theirs(x):
        p, _ = direct_topk(x, expert_bias=bias, **cfg)
        return jnp.sum(p * w)

    assert_close(jax.jit(jax.grad(ours))(x), jax.jit(jax.grad(theirs))(x), scale=4.0)


def test_no_gradient_to_bias():
    x = rand(jax.random.PRNGKey(3), (8, 16))
    bias = jnp.linspace(-1, 1, 16)
    g = jax.grad(lambda b: fused_topk_with_score_function(x, 2, score_function="sigmoid", expert_bias=b)[0].sum())(bias)
    np.testing.assert_array_equal(np.asarray(g), 0.0)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_scores_and_gradient(score_function):
    x = tied_logits(jax.random.PRNGKey(5), (32, 24), levels=4)
    rmap, scores = jax.jit(lambda x: compute_routing_scores_for_aux_loss(x, 3, score_function=score_function))(x)
    want_m, want_s = jax.jit(lambda x: direct_scores(x, 3, score_function))(x)
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(want_m))
    assert_close(scores, want_s)
    w = rand(jax.random.PRNGKey(6), x.shape)
    xr = rand(jax.random.PRNGKey(8), x.shape)
    ours = jax.jit(
        jax.grad(lambda x: jnp.sum(compute_routing_scores_for_aux_loss(x, 3, score_function=score_function)[1] * w))
    )
    theirs = jax.jit(jax.grad(lambda x: jnp.sum(direct_scores(x, 3, score_function)[1] * w)))
    assert_close(ours(xr), theirs(xr), scale=2.0)


def test_aux_loss_value_and_gradient():
    probs = jax.nn.softmax(rand(jax.random.PRNGKey(9), (40, 16)))
    tpe = jax.random.randint(jax.random.PRNGKey(10), (16,), 0, 20)
    loss = fused_moe_aux_loss(probs, tpe, topk=2, coeff=0.01)
    assert loss.shape == () and loss.dtype == F32
    assert_close(loss, direct_loss(probs, tpe, 2, 0.01))
    g = jax.grad(lambda p: fused_moe_aux_loss(p, tpe, topk=2, coeff=0.01))(probs)
    assert_close(g, jax.grad(lambda p: direct_loss(p, tpe, 2, 0.01))(probs))
    tpe_f = tpe.astype(F32)
    g_tpe = jax.grad(lambda c: fused_moe_aux_loss(probs, c, topk=2, coeff=0.01))(tpe_f)
    np.testing.assert_array_equal(np.asarray(g_tpe), 0.0)
    lb = fused_moe_aux_loss(probs.astype(jnp.bfloat16), tpe, topk=2, coeff=0.01)
    assert lb.dtype == jnp.bfloat16
    assert_close(lb, direct_loss(probs.astype(jnp.bfloat16), tpe, 2, 0.01), jnp.bfloat16)


def test_full_router_step_gradient():
    x = rand(jax.random.PRNGKey(11), (32, 16))

    def ours(x):
        probs, rmap = fused_topk_with_score_function(x, 2)
        m, s = compute_routing_scores_for_aux_loss(x, 2)
        return jnp.sum(probs**2) + fused_moe_aux_loss(s, rmap.sum(0), topk=2, coeff=0.1)

    def theirs(x):
        probs, rmap = direct_topk(x, 2)
        _, s = direct_scores(x, 2, "softmax")
        return jnp.sum(probs**2) + direct_loss(s, rmap.sum(0), 2, 0.1)

    assert_close(jax.jit(ours)(x), jax.jit(theirs)(x))
    assert_close(jax.jit(jax.grad(ours))(x), jax.jit(jax.grad(theirs))(x))


# ----------------------------------------------------------------------------------------------
# jit, vmap
# ----------------------------------------------------------------------------------------------


def test_jit_matches_eager():
    x = rand(jax.random.PRNGKey(12), (16, 32))
    f = lambda x: fused_topk_with_score_function(x, 4, score_function="sigmoid", num_groups=4, group_topk=2)
    pe, me = f(x)
    pj, mj = jax.jit(f)(x)
    np.testing.assert_array_equal(np.asarray(me), np.asarray(mj))
    assert_close(pj, pe)


def test_vmap():
    x = rand(jax.random.PRNGKey(13), (3, 8, 16))
    bias = jax.random.normal(jax.random.PRNGKey(14), (3, 16)) * 0.1
    tpe = jnp.arange(16)
    f = lambda x: fused_topk_with_score_function(x, 2, compact_routing_map=True)
    fb = lambda x, b: fused_topk_with_score_function(x, 2, score_function="sigmoid", expert_bias=b)[0]
    gf = jax.grad(lambda x: jnp.sum(f(x)[0] ** 2))
    sf = lambda x: compute_routing_scores_for_aux_loss(x, 2)
    lf = lambda s: fused_moe_aux_loss(s, tpe, topk=2, coeff=0.1)

    @jax.jit
    def batched(x, bias):
        p, m = jax.vmap(f)(x)
        ms, s = jax.vmap(sf)(x)
        return p, m, jax.vmap(fb)(x, bias), jax.vmap(gf)(x), s, jax.vmap(lf)(s), jax.vmap(jax.grad(lf))(s)

    @jax.jit
    def looped(x, bias):
        outs = []
        for i in range(3):
            p, m = f(x[i])
            s = sf(x[i])[1]
            outs.append(
                (
                    p,
                    m,
                    fb(x[i], bias[i]),
                    gf(x[i]),
                    s,
                    lf(s),
                    jax.grad(lambda p: direct_loss(p, tpe, 2, 0.1))(s),
                )
            )
        return tuple(jnp.stack(z) for z in zip(*outs, strict=True))

    for a, b in zip(batched(x, bias), looped(x, bias), strict=True):
        if a.dtype == jnp.uint8:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            assert_close(a, b)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def test_errors():
    x = jnp.zeros((4, 16), F32)
    with pytest.raises(ValueError, match="topk must be <= the number of experts E=16, got topk=17"):
        fused_topk_with_score_function(x, 17)
    with pytest.raises(ValueError, match="topk must be <= the number of experts"):
        compute_routing_scores_for_aux_loss(x, 17)
    with pytest.raises(TypeError, match="logits must be float32, bfloat16 or float16, got dtype int32"):
        fused_topk_with_score_function(jnp.zeros((4, 16), jnp.int32), 2)
    with pytest.raises(ValueError, match=r"logits must have rank 2 \[tokens, experts\], got shape \(2, 4, 16\)"):
        fused_topk_with_score_function(jnp.zeros((2, 4, 16)), 2)
    with pytest.raises(ValueError, match="expert_bias is only supported with score_function='sigmoid'"):
        fused_topk_with_score_function(x, 2, expert_bias=jnp.zeros(16))
    with pytest.raises(ValueError, match=r"expert_bias must have shape \[E\] = \(16,\), got shape \(15,\)"):
        fused_topk_with_score_function(x, 2, score_function="sigmoid", expert_bias=jnp.zeros(15))
    with pytest.raises(ValueError, match="num_groups and group_topk must be given together"):
        fused_topk_with_score_function(x, 2, num_groups=4)
    with pytest.raises(ValueError, match="must be divisible by num_groups"):
        fused_topk_with_score_function(x, 2, num_groups=3, group_topk=1)
    with pytest.raises(ValueError, match="topk must be divisible by group_topk"):
        fused_topk_with_score_function(x, 3, num_groups=4, group_topk=2)
    with pytest.raises(ValueError, match="group_topk must be <= num_groups=4"):
        fused_topk_with_score_function(x, 8, num_groups=4, group_topk=8)
    with pytest.raises(ValueError, match="exceed the group size"):
        fused_topk_with_score_function(x, 6, num_groups=8, group_topk=2)
    with pytest.raises(ValueError, match=r"score_function must be one of \['softmax', 'sigmoid'\], got 'relu'"):
        fused_topk_with_score_function(x, 2, score_function="relu")
    with pytest.raises(TypeError, match="topk must be a static Python int"):
        fused_topk_with_score_function(x, 2.0)
    with pytest.raises(ValueError, match=r"tokens_per_expert must have shape \[E\] = \(16,\)"):
        fused_moe_aux_loss(x, jnp.zeros(8), topk=2, coeff=0.1)
    with pytest.raises(ValueError, match="probs must have rank 2"):
        fused_moe_aux_loss(jnp.zeros(16), jnp.zeros(16), topk=2, coeff=0.1)
    with pytest.raises(TypeError, match="coeff must be a static Python float"):
        fused_moe_aux_loss(x, jnp.zeros(16), topk=2, coeff=jnp.float32(0.1))
    from te_ops._core.registry import ImplementationUnavailableError

    with pytest.raises(ImplementationUnavailableError, match="implementation='native' cannot run"):
        fused_topk_with_score_function(x, 2, implementation="native")


# ----------------------------------------------------------------------------------------------
# Sharding (8 virtual CPU devices)
# ----------------------------------------------------------------------------------------------


def test_topk_sharded_over_tokens_has_no_collectives():
    mesh = cpu_mesh((8,), ("data",))
    x = rand(jax.random.PRNGKey(15), (64, 32))
    bias = jnp.linspace(-0.5, 0.5, 32)

    def fn(x, b):
        p, m = fused_topk_with_score_function(
            x,
            4,
            score_function="sigmoid",
            num_groups=4,
            group_topk=2,
            expert_bias=b,
            compact_routing_map=True,
        )
        g = jax.grad(
            lambda x: jnp.sum(fused_topk_with_score_function(x, 4, score_function="sigmoid", expert_bias=b)[0] ** 2)
        )(x)
        m2, s = compute_routing_scores_for_aux_loss(x, 4)
        gs = jax.grad(lambda x: jnp.sum(compute_routing_scores_for_aux_loss(x, 4)[1] ** 2))(x)
        return p, m, g, m2, s, gs

    spec = PS("data", None)
    out, ref, counts = run_sharded(fn, [x, bias], [spec, PS()], (spec,) * 6, mesh=mesh)
    assert sum(counts.values()) == 0, counts
    for a, b in zip(out, ref, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6, atol=1e-7)


def test_aux_loss_sharded_equals_unsharded():
    mesh = cpu_mesh((8,), ("data",))
    probs = jax.nn.softmax(rand(jax.random.PRNGKey(16), (64, 16)))
    tpe = jax.random.randint(jax.random.PRNGKey(17), (16,), 0, 50)

    def fn(p, c):
        return fused_moe_aux_loss(p, c, topk=2, coeff=0.01)

    out, ref, counts = run_sharded(fn, [probs, tpe], [PS("data", None), PS()], mesh=mesh)
    assert counts["all-reduce"] == 1, counts
    assert sum(counts.values()) == 1, counts
    assert_close(out, ref)
    assert_close(out, direct_loss(probs, tpe, 2, 0.01))

    # gradient: stays sharded over tokens, no collective
    gfn = jax.grad(fn)
    gout, gref, gcounts = run_sharded(gfn, [probs, tpe], [PS("data", None), PS()], PS("data", None), mesh=mesh)
    assert sum(gcounts.values()) == 0, gcounts
    assert_close(gout, gref)


def test_aux_loss_sharded_tokens_and_experts():
    mesh = cpu_mesh((4, 2), ("data", "model"))
    probs = jax.nn.softmax(rand(jax.random.PRNGKey(18), (32, 16)))
    tpe = jax.random.randint(jax.random.PRNGKey(19), (16,), 0, 50)
    fn = lambda p, c: fused_moe_aux_loss(p, c, topk=4, coeff=0.1)
    out, ref, counts = run_sharded(fn, [probs, tpe], [PS("data", "model"), PS("model")], mesh=mesh)
    assert counts["all-reduce"] == 1, counts
    assert_close(out, ref)


# ----------------------------------------------------------------------------------------------
# Native glue on a CPU-only machine: lower the native path for CUDA (nothing runs) and check the
# FFI calls, their attributes and the poisoned-output aliasing.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("poison", [False, True], ids=["plain", "poisoned"])
def test_native_path_lowers_for_cuda(monkeypatch, poison):
    import contextlib
    import re

    from te_ops._core import native as N

    monkeypatch.setattr(N, "cuda_device_unavailable_reason", lambda: None)
    monkeypatch.setattr(N, "native_unavailable_reason", lambda name="_native", op=None: None)
    monkeypatch.setattr(N, "ensure_registered", lambda: None)

    def step(x, b, tpe):
        p, _ = fused_topk_with_score_function(
            x,
            8,
            score_function="sigmoid",
            num_groups=8,
            group_topk=4,
            scaling_factor=2.5,
            expert_bias=b,
            implementation="native",
        )
        p2, _ = fused_topk_with_score_function(x, 8, compact_routing_map=True, implementation="native")
        _, s = compute_routing_scores_for_aux_loss(x, 8, score_function="sigmoid", implementation="native")
        loss = fused_moe_aux_loss(s, tpe, topk=8, coeff=0.01, implementation="native")
        return jnp.sum(p * p) + jnp.sum(p2 * p2) + loss

    # Poisoning is a trace-time setting and jax caches the traces of the op's inner functions per
    # shape, so each variant uses its own token count.
    t = 48 if poison else 64
    x, b, tpe = jnp.ones((t, 256)), jnp.zeros(256), jnp.ones(256, jnp.int32)
    with N.poisoned_outputs() if poison else contextlib.nullcontext():
        traced = jax.jit(jax.value_and_grad(step)).trace(x, b, tpe)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    targets = set(re.findall(r"te_router_\w+", text))
    assert targets == {f"te_router_{n}_{d}" for n in ("topk", "scores", "aux_loss") for d in ("fwd", "bwd")}
    assert "scaling_factor = 2.5" in text and "group_topk = 4 : i32" in text and "num_groups = 8 : i32" in text
    assert ("output_operand_aliases" in text) == poison
