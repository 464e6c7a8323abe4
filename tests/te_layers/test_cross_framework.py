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
            x, segment_ids=segment_ids)
        return x + te_linen.MoEBlock(A.E, A.K, A.F, score_function="sigmoid", num_groups=2, group_topk=1,
                                     scaling_factor=2.0, aux_loss_coeff=0.1, name="moe")(x)


class _NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.proj = te_nnx.Dense(A.H, A.H, activation="silu", rngs=rngs)
        self.attn = te_nnx.MultiHeadAttention(A.H, A.NH, A.D, num_kv_heads=A.NKV, use_bias=True, rngs=rngs)
        self.moe = te_nnx.MoEBlock(A.H, A.E, A.K, A.F, score_function="sigmoid", num_groups=2, group_topk=1,
                                   scaling_factor=2.0, aux_loss_coeff=0.1, rngs=rngs)

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
            self.moe = te_eqx.MoEBlock(A.H, A.E, A.K, A.F, score_function="sigmoid", num_groups=2, group_topk=1,
                                       scaling_factor=2.0, aux_loss_coeff=0.1, key=k3)

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
