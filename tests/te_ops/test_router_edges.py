"""CPU tests of the router ops' edge cases: argument validation (errors name the op and the
argument), empty inputs, non-finite logits, and the compact routing-map converters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_ops._core.testing import assert_close
from te_ops.router import (
    compute_routing_scores_for_aux_loss,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
    native,
    pack_routing_map,
    unpack_routing_map,
)
from tests.te_ops.test_router import CONFIGS, _split, direct_scores, direct_topk, rand

F32 = jnp.float32
NEG_NAN = np.array(0xFFC00000, np.uint32).view(np.float32)  # a NaN with the sign bit set
POS_NAN = np.array(0x7FC00000, np.uint32).view(np.float32)
TOPK_OP = "te_ops.fused_topk_with_score_function"
SCORES_OP = "te_ops.compute_routing_scores_for_aux_loss"
LOSS_OP = "te_ops.fused_moe_aux_loss"


def _cfg_id(c):
    return "-".join(f"{k}{v}" for k, v in c.items())


def _inject_nans(x, rows, value, seed):
    rng = np.random.default_rng(seed)
    x = np.array(x)
    for r in rows:
        cols = rng.choice(x.shape[1], size=1 + r % 3, replace=False)
        x[r, cols] = value
    return jnp.asarray(x)


# ----------------------------------------------------------------------------------------------
# Non-finite logits
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
@pytest.mark.parametrize("nan", [POS_NAN, NEG_NAN], ids=["pos_nan", "neg_nan"])
def test_topk_nan_rows_poison_every_chosen_prob(cfg, nan):
    t, e = 24, 32
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(21), 3)
    cfg, bias = _split(cfg, e, k2)
    nan_rows = [1, 5, 6, 17]
    x = _inject_nans(rand(k1, (t, e)), nan_rows, nan, seed=3)
    clean = np.setdiff1d(np.arange(t), nan_rows)
    f = lambda x: fused_topk_with_score_function(x, expert_bias=bias, **cfg)
    probs, rmap = jax.jit(f)(x)
    p, m = np.asarray(probs), np.asarray(rmap)
    assert (m.sum(-1) == cfg["topk"]).all()  # exactly topk experts, NaN rows included
    assert np.isnan(p[nan_rows][m[nan_rows]]).all()
    assert (p[~m] == 0).all()  # exactly 0 outside the map
    if cfg.get("group_topk"):  # never more than group_topk groups, NaN rows included
        groups = m.reshape(t, cfg["num_groups"], -1).any(-1).sum(-1)
        assert (groups <= cfg["group_topk"]).all()
    want_p, want_m = direct_topk(x[clean], expert_bias=bias, **cfg)
    np.testing.assert_array_equal(m[clean], np.asarray(want_m))
    assert_close(probs[clean], want_p)
    # rows are independent: the gradient of the clean rows is unaffected by the NaN rows
    w = rand(k3, (t, e))
    g = jax.grad(lambda x: jnp.sum(jnp.where(jnp.isnan(f(x)[0]), 0.0, f(x)[0] * w)))(x)
    g_want = jax.grad(lambda xc: jnp.sum(direct_topk(xc, expert_bias=bias, **cfg)[0] * w[clean]))(x[clean])
    assert_close(g[clean], g_want, scale=4.0)


def test_grouped_selection_never_picks_a_dropped_group():
    # Group 0's score is NaN (3 + -NaN), ranked below group 1's -inf; group 1 must supply both experts
    # even though every score there is -inf and group 0 holds smaller indices.
    row = np.array([[3, NEG_NAN, NEG_NAN, NEG_NAN, -np.inf, -np.inf, -np.inf, -np.inf]], np.float32)
    _, rmap = fused_topk_with_score_function(jnp.asarray(row), 2, num_groups=2, group_topk=1)
    np.testing.assert_array_equal(np.asarray(rmap)[0].nonzero()[0], [4, 5])


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("nan", [POS_NAN, NEG_NAN], ids=["pos_nan", "neg_nan"])
def test_aux_scores_nan_rows_are_all_nan(score_function, nan):
    t, e = 20, 16
    nan_rows = [0, 7, 19]
    x = _inject_nans(rand(jax.random.PRNGKey(22), (t, e)), nan_rows, nan, seed=4)
    rmap, scores = jax.jit(lambda x: compute_routing_scores_for_aux_loss(x, 3, score_function=score_function))(x)
    m, s = np.asarray(rmap), np.asarray(scores)
    assert (m.sum(-1) == 3).all()
    assert np.isnan(s[nan_rows]).all()
    clean = np.setdiff1d(np.arange(t), nan_rows)
    want_m, want_s = direct_scores(x[clean], 3, score_function)
    np.testing.assert_array_equal(m[clean], np.asarray(want_m))
    assert_close(s[clean], want_s)


def test_infinite_logits_follow_the_formulas():
    inf = np.inf
    # softmax without pre-softmax: +inf chosen -> NaN weights (inf - inf); a chosen -inf next to
    # finite logits gets weight exactly 0 yet stays in the routing map; all chosen -inf -> NaN.
    x = jnp.array([[inf, 1.5, 0.25, -1.0], [2.0, -inf, 0.5, 1.0], [-inf, -inf, -inf, -inf]], F32)
    p, m = fused_topk_with_score_function(x[:1], 2)
    np.testing.assert_array_equal(np.asarray(m), [[True, True, False, False]])
    assert np.isnan(np.asarray(p)[0, :2]).all() and (np.asarray(p)[0, 2:] == 0).all()
    p, m = fused_topk_with_score_function(x[1:2], 4)
    assert np.asarray(m).all() and float(p[0, 1]) == 0.0
    assert_close(p[0, [0, 2, 3]], jax.nn.softmax(jnp.array([2.0, 0.5, 1.0])))
    p, m = fused_topk_with_score_function(x[2:], 2)
    assert np.asarray(m).sum() == 2 and np.isnan(np.asarray(p)[np.asarray(m)]).all()
    # pre-softmax: -inf has score 0
    p, m = fused_topk_with_score_function(x[1:2], 4, use_pre_softmax=True)
    assert float(p[0, 1]) == 0.0
    assert_close(p[0], jax.nn.softmax(x[1]))
    # sigmoid maps +inf to 1 and -inf to 0
    p, m = fused_topk_with_score_function(jnp.array([[inf, -inf, 0.5, 1.0]], F32), 2, score_function="sigmoid")
    np.testing.assert_array_equal(np.asarray(m), [[True, False, False, True]])
    s = jnp.array([1.0, jax.nn.sigmoid(1.0)])
    assert_close(p[0, [0, 3]], s / s.sum())


# ----------------------------------------------------------------------------------------------
# Empty inputs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compact", [False, True], ids=["bool", "compact"])
def test_zero_tokens_give_empty_results(compact):
    x = jnp.zeros((0, 12), F32)
    p, m = jax.jit(lambda x: fused_topk_with_score_function(x, 3, compact_routing_map=compact))(x)
    assert p.shape == (0, 12) and m.shape == ((0, 2) if compact else (0, 12))
    g = jax.grad(lambda x: fused_topk_with_score_function(x, 3, score_function="sigmoid")[0].sum())(x)
    assert g.shape == (0, 12)
    m, s = compute_routing_scores_for_aux_loss(x, 3, compact_routing_map=compact)
    assert s.shape == (0, 12) and m.shape == ((0, 2) if compact else (0, 12))
    assert jax.grad(lambda x: compute_routing_scores_for_aux_loss(x, 3)[1].sum())(x).shape == (0, 12)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(0, 16), (5, 0), (0, 0)], ids=["T0", "E0", "T0E0"])
def test_aux_loss_of_empty_probs_is_zero(dtype, shape):
    probs = jnp.zeros(shape, dtype)
    tpe = jnp.arange(shape[1], dtype=jnp.int32) + 3
    f = lambda p: fused_moe_aux_loss(p, tpe, topk=2, coeff=0.01)
    loss, g = jax.jit(jax.value_and_grad(f))(probs)
    assert loss.dtype == dtype and float(loss) == 0.0
    assert g.shape == shape and g.dtype == dtype


def test_native_aux_loss_refuses_zero_experts_with_a_reason():
    assert "E >= 1" in native.loss_unsupported_reason(dtype=F32, shape=(4, 0))
    assert native.loss_unsupported_reason(dtype=F32, shape=(0, 4)) is None  # the kernels handle T == 0


# ----------------------------------------------------------------------------------------------
# Argument errors
# ----------------------------------------------------------------------------------------------


def test_none_arrays_are_required():
    x = rand(jax.random.PRNGKey(25), (4, 8))
    with pytest.raises(TypeError, match=f"{TOPK_OP}: logits is required"):
        fused_topk_with_score_function(None, 2)
    with pytest.raises(TypeError, match=f"{SCORES_OP}: logits is required"):
        compute_routing_scores_for_aux_loss(None, 2)
    with pytest.raises(TypeError, match=f"{LOSS_OP}: probs is required"):
        fused_moe_aux_loss(None, jnp.ones(8), topk=2, coeff=0.1)
    with pytest.raises(TypeError, match=f"{LOSS_OP}: tokens_per_expert is required"):
        fused_moe_aux_loss(x, None, topk=2, coeff=0.1)
    with pytest.raises(TypeError, match="te_ops.pack_routing_map: routing_map is required"):
        pack_routing_map(None)
    with pytest.raises(TypeError, match="te_ops.unpack_routing_map: packed is required"):
        unpack_routing_map(None, 8)


@pytest.mark.parametrize(
    "fn, name",
    [(fused_topk_with_score_function, TOPK_OP), (compute_routing_scores_for_aux_loss, SCORES_OP)],
    ids=["topk", "scores"],
)
def test_expert_count_and_topk_errors(fn, name):
    x = rand(jax.random.PRNGKey(26), (4, 8))
    with pytest.raises(ValueError, match=rf"{name}: logits must have at least 1 expert \(E >= 1\), got shape \(4, 0\)"):
        fn(jnp.zeros((4, 0), F32), 1)
    with pytest.raises(ValueError, match=f"{name}: topk must be >= 1, got 0"):
        fn(x, 0)
    with pytest.raises(ValueError, match=f"{name}: topk must be <= the number of experts E=8, got topk=9"):
        fn(x, 9)
    with pytest.raises(TypeError, match=f"{name}: topk must be a static Python int"):
        jax.jit(fn)(x, 2)
    with pytest.raises(ValueError, match=f"{LOSS_OP}: topk must be >= 1, got 0"):
        fused_moe_aux_loss(x, jnp.ones(8), topk=0, coeff=0.1)


def test_static_argument_errors():
    x = rand(jax.random.PRNGKey(27), (4, 8))
    with pytest.raises(ValueError, match=f"{TOPK_OP}: num_groups must be >= 1, got 0"):
        fused_topk_with_score_function(x, 2, num_groups=0, group_topk=1)
    with pytest.raises(ValueError, match=f"{TOPK_OP}: group_topk must be >= 1, got 0"):
        fused_topk_with_score_function(x, 2, num_groups=2, group_topk=0)
    with pytest.raises(ValueError, match=f"{TOPK_OP}: scaling_factor must be finite, got nan"):
        fused_topk_with_score_function(x, 2, scaling_factor=float("nan"))
    with pytest.raises(TypeError, match=f"{TOPK_OP}: scaling_factor must be a static Python float"):
        fused_topk_with_score_function(x, 2, scaling_factor=jnp.float32(2.0))
    with pytest.raises(TypeError, match=f"{TOPK_OP}: use_pre_softmax must be a static Python bool"):
        fused_topk_with_score_function(x, 2, use_pre_softmax="yes")
    with pytest.raises(TypeError, match=f"{TOPK_OP}: use_pre_softmax must be a static Python bool"):
        fused_topk_with_score_function(x, 2, use_pre_softmax=1)  # 0/1 typos are refused, as in te_layers
    with pytest.raises(TypeError, match=f"{SCORES_OP}: compact_routing_map must be a static Python bool"):
        compute_routing_scores_for_aux_loss(x, 2, compact_routing_map="yes")
    with pytest.raises(ValueError, match=f"{SCORES_OP}: score_function must be one of"):
        compute_routing_scores_for_aux_loss(x, 2, score_function="relu")
    with pytest.raises(
        TypeError, match=f"{TOPK_OP}: expert_bias must be float32, bfloat16, float16 or float64, got dtype int32"
    ):
        fused_topk_with_score_function(x, 2, score_function="sigmoid", expert_bias=jnp.ones(8, jnp.int32))
    with pytest.raises(TypeError, match=f"{LOSS_OP}: tokens_per_expert must be an int or float array, got dtype bool"):
        fused_moe_aux_loss(x, jnp.ones(8, bool), topk=2, coeff=0.1)
    with pytest.raises(ValueError, match=f"{LOSS_OP}: coeff must be finite, got inf"):
        fused_moe_aux_loss(x, jnp.ones(8), topk=2, coeff=float("inf"))
    with pytest.raises(ValueError, match=r"Flatten the leading axes first, e.g. probs.reshape\(-1"):
        fused_moe_aux_loss(jnp.ones((2, 4, 8)), jnp.ones(8), topk=2, coeff=0.1)


# ----------------------------------------------------------------------------------------------
# Compact routing maps
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(5,), (3, 13), (2, 3, 16), (4, 0)], ids=str)
def test_pack_unpack_round_trip(shape):
    m = jax.random.bernoulli(jax.random.PRNGKey(sum(shape) + len(shape)), 0.4, shape)
    packed = jax.jit(pack_routing_map)(m)
    assert packed.dtype == jnp.uint8 and packed.shape == (*shape[:-1], (shape[-1] + 7) // 8)
    np.testing.assert_array_equal(np.asarray(packed), np.packbits(np.asarray(m), axis=-1, bitorder="little"))
    back = jax.jit(unpack_routing_map, static_argnums=1)(packed, shape[-1])
    np.testing.assert_array_equal(np.asarray(back), np.asarray(m))


def test_unpack_ignores_padding_bits():
    packed = jax.random.randint(jax.random.PRNGKey(28), (6, 2), 0, 256).astype(jnp.uint8)  # every bit random
    assert (np.asarray(packed)[:, 1] >> 5).any()  # some padding bits (experts 13..15) are set
    want = np.unpackbits(np.asarray(packed), axis=-1, bitorder="little")[:, :13].astype(bool)
    np.testing.assert_array_equal(np.asarray(unpack_routing_map(packed, 13)), want)


def test_pack_unpack_errors():
    with pytest.raises(
        TypeError,
        match=r"te_ops.pack_routing_map: routing_map must be a bool array, got dtype "
        r"int32. Convert it with routing_map != 0",
    ):
        pack_routing_map(jnp.ones((2, 8), jnp.int32))
    with pytest.raises(ValueError, match="te_ops.pack_routing_map: routing_map must have rank >= 1"):
        pack_routing_map(jnp.array(True))
    packed = jnp.ones((3, 2), jnp.uint8)
    with pytest.raises(TypeError, match="te_ops.unpack_routing_map: packed must be uint8, got dtype int32"):
        unpack_routing_map(packed.astype(jnp.int32), 16)
    with pytest.raises(TypeError, match="te_ops.unpack_routing_map: packed must be uint8, got dtype bool"):
        unpack_routing_map(jnp.ones((3, 16), bool), 16)
    with pytest.raises(ValueError, match="te_ops.unpack_routing_map: packed must have rank >= 1"):
        unpack_routing_map(jnp.uint8(3), 8)
    for bad in (8, 17, 0):
        with pytest.raises(ValueError, match=rf"num_experts={bad} needs .* but packed has 2 .* must be in \[9, 16\]"):
            unpack_routing_map(packed, bad)
    with pytest.raises(ValueError, match="te_ops.unpack_routing_map: num_experts must be >= 0, got -1"):
        unpack_routing_map(packed, -1)
    with pytest.raises(TypeError, match="te_ops.unpack_routing_map: num_experts must be a static Python int"):
        unpack_routing_map(packed, 16.0)
