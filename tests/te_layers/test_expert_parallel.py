"""MoEBlock with experts sharded over a mesh axis (all-to-all + sort_chunks_by_index) equals the
unsharded block: outputs, aux loss, token counts and gradients, on 8 CPU devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from te_layers import eqx as te_eqx
from te_layers import linen as te_linen

E, K, F, H = 16, 2, 16, 16


def _mesh(n=8):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices (tests/conftest.py sets 8 virtual CPU devices), got {len(jax.devices())}")
    return Mesh(np.array(jax.devices()[:n]), ("ep",))


@pytest.mark.parametrize(
    "router",
    [dict(score_function="softmax"), dict(score_function="sigmoid", use_expert_bias=True, num_groups=4, group_topk=2)],
    ids=["softmax", "sigmoid-bias-groups"],
)
@pytest.mark.parametrize("fused_ffn", [False, True], ids=["unfused", "fused-ffn"])
def test_expert_parallel_matches_unsharded(router, fused_ffn, monkeypatch):
    """fused-ffn: te_layers._common.BF16_FUSED_FFN on (te_ops.grouped_ffn inside the shard_map)."""
    from te_layers import _common as C

    monkeypatch.setattr(C, "BF16_FUSED_FFN", fused_ffn)
    mesh = _mesh()
    x = jax.random.normal(jax.random.key(0), (4, 16, H))  # 64 tokens, 8 per shard; 2 experts per shard
    common = dict(num_experts=E, topk=K, ffn_dim=F, aux_loss_coeff=0.1, **router)
    ref = te_linen.MoEBlock(**common)
    ep = te_linen.MoEBlock(**common, expert_axis="ep", mesh=mesh)
    variables = jax.jit(lambda k: nn.meta.unbox(ref.init(k, x)))(jax.random.key(1))
    if "router_state" in variables:  # a non-trivial expert bias
        variables = dict(variables, router_state={"router": {"expert_bias": 0.05 * jnp.arange(E, dtype=jnp.float32)}})

    def run(module):
        def f(params, x):
            y, st = module.apply(dict(variables, params=params), x, mutable=["intermediates"])
            aux = te_linen.collect_aux_loss(st["intermediates"])
            tpe = st["intermediates"]["tokens_per_expert"][0]
            return jnp.sum(jnp.sin(y)) + aux, (y, aux, tpe)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

    (_, (y0, aux0, tpe0)), g0 = run(ref)(variables["params"], x)
    fn = run(ep)
    (_, (y1, aux1, tpe1)), g1 = fn(variables["params"], x)
    np.testing.assert_array_equal(np.asarray(tpe1), np.asarray(tpe0))
    assert int(tpe0.sum()) == x.shape[0] * x.shape[1] * K
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(float(aux1), float(aux0), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    hlo = fn.lower(variables["params"], x).compile().as_text()
    assert hlo.count("all-to-all") >= 3, "expected the token, count and return all-to-alls"


def test_expert_parallel_eqx_with_context_mesh():
    mesh = _mesh()
    x = jax.random.normal(jax.random.key(2), (8, 8, H))
    block = te_eqx.MoEBlock(H, E, K, F, activation="gelu", key=jax.random.key(3))
    ep_block = te_eqx.MoEBlock(H, E, K, F, activation="gelu", expert_axis="ep", key=jax.random.key(3))
    y0, aux0 = jax.jit(lambda b, x: b(x))(block, x)
    with jax.set_mesh(mesh):
        y1, aux1 = jax.jit(lambda b, x: b(x))(ep_block, x)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(float(aux1.aux_loss), float(aux0.aux_loss), rtol=1e-5)


def test_expert_parallel_errors():
    mesh = _mesh()
    with pytest.raises(ValueError, match=r"^te_layers\.MoEBlock: num_experts must be a multiple of the 8 shards"):
        te_eqx.MoEBlock(H, 12, K, F, expert_axis="ep", mesh=mesh, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"^te_layers\.MoEBlock: expert_axis must be an axis of the mesh \['ep'\]"):
        te_eqx.MoEBlock(H, E, K, F, expert_axis="tp", mesh=mesh, key=jax.random.key(0))
    block = te_eqx.MoEBlock(H, 12, K, F, expert_axis="ep", key=jax.random.key(0))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"^te_layers\.MoEBlock: num_experts must be a multiple"):
        block(jnp.ones((8, H)))  # the context mesh is checked at call time
    block = te_eqx.MoEBlock(H, E, K, F, expert_axis="ep", mesh=mesh, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"^te_layers\.MoEBlock: x must hold a number of tokens .* divisible by the 8"):
        block(jnp.ones((4, H)))
    block = te_eqx.MoEBlock(H, E, K, F, expert_axis="ep", key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"^te_layers\.MoEBlock: mesh is required with expert_axis"):
        block(jnp.ones((8, H)))
