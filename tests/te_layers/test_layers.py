"""Every layer in every framework: init, apply, grad, jit, fp32 and bf16."""

import jax
import jax.numpy as jnp
import pytest

from tests.te_layers import _adapters as A

DTYPES = [jnp.float32, jnp.bfloat16]


def _finite(tree):
    return all(bool(jnp.all(jnp.isfinite(leaf.astype(jnp.float32)))) for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("layer", A.LAYERS)
@pytest.mark.parametrize("framework", A.FRAMEWORKS)
def test_layer_init_apply_grad_jit(framework, layer, dtype):
    params, apply = A.build(framework, layer, dtype)
    x = A.layer_input(layer, dtype)

    def loss(p, x):
        y = apply(p, x)
        return A.scalar_loss(layer, y), y

    # one compile: output, gradients to the parameters and to the input
    (_, y), (g_params, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    main = jax.tree.leaves(A._out(layer, y))[0]
    expect_shape = {
        "Dense": (A.B, A.S, 8),
        "Softmax": (A.B, A.NH, A.S, A.S),
        "DotProductAttention": (A.B, A.S, A.NH, A.D),
        "MultiHeadAttention": (A.B, A.S, A.H),
        "MoEBlock": (A.B, A.S, A.H),
    }
    if layer in expect_shape:
        assert main.shape == expect_shape[layer]
        assert main.dtype == dtype, (main.dtype, dtype)
    assert _finite(y)
    assert _finite(g_params) and _finite(g_x)
    assert any(float(jnp.abs(leaf.astype(jnp.float32)).sum()) > 0 for leaf in jax.tree.leaves(g_x))
    float_params = [p for p in jax.tree.leaves(g_params) if jnp.issubdtype(p.dtype, jnp.floating)]
    if layer not in ("Softmax", "DotProductAttention"):
        assert any(float(jnp.abs(p.astype(jnp.float32)).sum()) > 0 for p in float_params)
