"""The same parameters give the same outputs in Linen, NNX and Equinox (one shared-maths contract)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from te_layers import eqx as te_eqx
from te_layers import linen as te_linen
from te_layers import nnx as te_nnx
from tests.te_layers import _adapters as A


class _LinenModel(nn.Module):
    """Dense -> MultiHeadAttention (GQA, RoPE, causal, bias) -> MoEBlock (sigmoid router, groups)."""

    @nn.compact
    def __call__(self, x, segment_ids):
        x = te_linen.Dense(A.H, activation="silu", name="proj")(x)
        x = x + te_linen.MultiHeadAttention(A.NH, A.D, num_kv_heads=A.NKV, use_bias=True, name="attn")(
            x, segment_ids=segment_ids
        )
        return x + te_linen.MoEBlock(
            A.E,
            A.K,
            A.F,
            score_function="sigmoid",
            num_groups=2,
            group_topk=1,
            scaling_factor=2.0,
            aux_loss_coeff=0.1,
            name="moe",
        )(x)


class _NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.proj = te_nnx.Dense(A.H, A.H, activation="silu", rngs=rngs)
        self.attn = te_nnx.MultiHeadAttention(A.H, A.NH, A.D, num_kv_heads=A.NKV, use_bias=True, rngs=rngs)
        self.moe = te_nnx.MoEBlock(
            A.H,
            A.E,
            A.K,
            A.F,
            score_function="sigmoid",
            num_groups=2,
            group_topk=1,
            scaling_factor=2.0,
            aux_loss_coeff=0.1,
            rngs=rngs,
        )

    def __call__(self, x, segment_ids):
        x = self.proj(x)
        x = x + self.attn(x, segment_ids=segment_ids)
        return x + self.moe(x)


def test_same_parameters_same_outputs():
    import equinox as eqx

    class EqxModel(eqx.Module):
        proj: te_eqx.Dense
        attn: te_eqx.MultiHeadAttention
        moe: te_eqx.MoEBlock

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.proj = te_eqx.Dense(A.H, A.H, activation="silu", key=k1)
            self.attn = te_eqx.MultiHeadAttention(A.H, A.NH, A.D, num_kv_heads=A.NKV, use_bias=True, key=k2)
            self.moe = te_eqx.MoEBlock(
                A.H,
                A.E,
                A.K,
                A.F,
                score_function="sigmoid",
                num_groups=2,
                group_topk=1,
                scaling_factor=2.0,
                aux_loss_coeff=0.1,
                key=k3,
            )

        def __call__(self, x, segment_ids):
            x = self.proj(x)
            x = x + self.attn(x, segment_ids=segment_ids)
            y, aux = self.moe(x)
            return x + y, aux.aux_loss

    x = jax.random.normal(jax.random.key(0), (A.B, A.S, A.H))
    seg = jnp.concatenate([jnp.zeros((A.B, 5), jnp.int32), jnp.ones((A.B, A.S - 5), jnp.int32)], axis=1)

    lin = _LinenModel()
    params = jax.jit(lambda k: nn.meta.unbox(lin.init(k, x, seg)))(jax.random.key(42))["params"]
    y_lin, state = jax.jit(lambda p: lin.apply({"params": p}, x, seg, mutable=["intermediates"]))(params)
    aux_lin = te_linen.collect_aux_loss(state["intermediates"])

    nmodel = A.load_nnx(_NNXModel(nnx.Rngs(7)), params)

    @nnx.jit
    def nnx_fwd(m):
        y, losses = nnx.capture(lambda m: m(x, seg), te_nnx.AuxLoss)(m)
        return y, te_nnx.collect_aux_loss(losses)

    y_nnx, aux_nnx = nnx_fwd(nmodel)

    emodel = A.load_eqx(EqxModel(jax.random.key(3)), params)
    y_eqx, aux_eqx = eqx.filter_jit(lambda m: m(x, seg))(emodel)

    # structures agree: every Linen parameter found a home with the same shape
    n_lin = sum(p.size for p in jax.tree.leaves(params))
    n_nnx = sum(p.size for p in jax.tree.leaves(nnx.state(nmodel, nnx.Param)))
    n_eqx = sum(p.size for p in jax.tree.leaves(eqx.filter(emodel, eqx.is_inexact_array)))
    assert n_lin == n_nnx == n_eqx
    np.testing.assert_allclose(np.asarray(y_nnx), np.asarray(y_lin), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y_eqx), np.asarray(y_lin), rtol=1e-6, atol=1e-6)
    assert float(aux_lin) > 0
    np.testing.assert_allclose([float(aux_nnx), float(aux_eqx)], [float(aux_lin)] * 2, rtol=1e-6)


def test_attention_segment_positions_and_bottom_right_agree_across_frameworks():
    """DotProductAttention's q_segment_pos/kv_segment_pos and bottom-right masks, MultiHeadAttention's
    segment_pos: the same keywords in every framework, the same numbers as te_ops.fused_attention."""
    import equinox as eqx

    from te_ops.fused_attention import fused_attention

    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    sq, sk = 8, 12
    q = jax.random.normal(kq, (A.B, sq, A.NH, A.D))
    k = jax.random.normal(kk, (A.B, sk, A.NKV, A.D))
    v = jax.random.normal(kv, (A.B, sk, A.NKV, A.D))
    qseg = jnp.array([[1] * 3 + [2] * 5] * A.B, jnp.int32)
    kseg = jnp.array([[1] * 5 + [2] * 7] * A.B, jnp.int32)
    qpos = jnp.array([[2, 3, 4, 2, 3, 4, 5, 6]] * A.B, jnp.int32)  # queries are the last tokens of each segment
    kpos = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]] * A.B, jnp.int32)
    packed = dict(q_segment_ids=qseg, kv_segment_ids=kseg, q_segment_pos=qpos, kv_segment_pos=kpos)
    for mask_type, call_kw in (("causal", packed), ("causal_bottom_right", {})):
        want = fused_attention(q, k, v, mask_type=mask_type, window_size=(3, 0), **call_kw)
        lin = te_linen.DotProductAttention(mask_type=mask_type, window_size=(3, 0))
        got = [
            lin.apply({}, q, k, v, **call_kw),
            te_nnx.DotProductAttention(mask_type=mask_type, window_size=(3, 0))(q, k, v, **call_kw),
            te_eqx.DotProductAttention(mask_type=mask_type, window_size=(3, 0))(q, k, v, **call_kw),
        ]
        for y in got:
            np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-6, err_msg=mask_type)
    # positions change the mask (the index-based one differs here)
    by_pos = fused_attention(q, k, v, mask_type="causal", window_size=(3, 0), **packed)
    by_index = fused_attention(q, k, v, mask_type="causal", window_size=(3, 0), q_segment_ids=qseg,
                               kv_segment_ids=kseg)  # fmt: skip
    assert not np.allclose(np.asarray(by_index), np.asarray(by_pos))

    # MultiHeadAttention: segment_pos steers the mask (and RoPE); same parameters, same outputs
    x = jax.random.normal(jax.random.key(2), (A.B, A.S, A.H))
    seg = jnp.array([[1] * 6 + [2] * (A.S - 6)] * A.B, jnp.int32)
    spos = jnp.array([list(range(6)) + [i // 2 for i in range(A.S - 6)]] * A.B, jnp.int32)  # pairs share a position
    lin = te_linen.MultiHeadAttention(A.NH, A.D, num_kv_heads=A.NKV, use_bias=True, name="attn")
    params = jax.jit(lambda key: nn.meta.unbox(lin.init(key, x, segment_ids=seg, segment_pos=spos)))(jax.random.key(4))[
        "params"
    ]
    y_lin = lin.apply({"params": params}, x, segment_ids=seg, segment_pos=spos)
    y_plain = lin.apply({"params": params}, x, segment_ids=seg)
    assert not np.allclose(np.asarray(y_lin), np.asarray(y_plain), atol=1e-4)
    n = A.load_nnx(te_nnx.MultiHeadAttention(A.H, A.NH, A.D, num_kv_heads=A.NKV, use_bias=True, rngs=nnx.Rngs(0)),
                   params)  # fmt: skip
    e = A.load_eqx(te_eqx.MultiHeadAttention(A.H, A.NH, A.D, num_kv_heads=A.NKV, use_bias=True,
                                             key=jax.random.key(0)), params)  # fmt: skip
    y_nnx = n(x, segment_ids=seg, segment_pos=spos)
    y_eqx = eqx.filter_jit(lambda m: m(x, segment_ids=seg, segment_pos=spos))(e)
    np.testing.assert_allclose(np.asarray(y_nnx), np.asarray(y_lin), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y_eqx), np.asarray(y_lin), rtol=1e-6, atol=1e-6)
