"""Every op differentiates inside shard_map with check_vma=True (the default): replicated weights
used with sharded activations get reduced, replicated gradients equal to the unsharded ones."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import te_ops
from te_ops._core import testing as T


@pytest.fixture(scope="module")
def mesh():
    return T.cpu_mesh((8,), ("x",))


def _grads_match(mesh, loss, x, w, reference_loss=None):
    """loss(x, w) summed over shards inside shard_map (x sharded, w replicated) vs unsharded
    (``reference_loss``, default ``loss`` on the whole x)."""
    sharded = jax.jit(
        jax.shard_map(
            jax.grad(lambda x, w: jax.lax.psum(loss(x, w), "x"), argnums=(0, 1)),
            mesh=mesh,
            in_specs=(P("x"), P()),
            out_specs=(P("x"), P()),
        )
    )
    gx, gw = sharded(x, w)
    rx, rw = jax.jit(jax.grad(reference_loss or loss, argnums=(0, 1)))(x, w)
    T.assert_close(gx, rx, jnp.float32, scale=float(jnp.abs(rx).max()))
    T.assert_close(gw, rw, jnp.float32, scale=float(jnp.abs(rw).max()))


def test_dense_in_shard_map(mesh):
    x = jax.random.normal(jax.random.key(0), (16, 8))
    w = jax.random.normal(jax.random.key(1), (8, 8))
    _grads_match(mesh, lambda x, w: jnp.sum(te_ops.dense(x, w, activation="gelu") ** 2), x, w)


def test_softmax_with_replicated_mask_in_shard_map(mesh):
    x = jax.random.normal(jax.random.key(2), (8, 2, 4, 16))
    mask = jax.random.bernoulli(jax.random.key(3), 0.3, (1, 1, 4, 16))

    def loss(x, w):
        return jnp.sum(te_ops.scaled_masked_softmax(x * w[0], mask, 0.5) * w[1])

    _grads_match(mesh, loss, x, jax.random.normal(jax.random.key(4), (2,)))


def test_grouped_dense_in_shard_map(mesh):
    x = jax.random.normal(jax.random.key(5), (64, 16))
    w = jax.random.normal(jax.random.key(6), (2, 16, 8))

    def loss(x, w):  # group sizes are per shard: each shard routes its own 8 rows
        sizes = jnp.array([3, 4], jnp.int32)
        return jnp.sum(te_ops.grouped_dense(x, w, sizes) ** 2)

    def per_shard_reference(x, w):
        return jnp.sum(jax.vmap(lambda xs: loss(xs, w))(x.reshape(8, 8, 16)))

    _grads_match(mesh, loss, x, w, per_shard_reference)


def test_router_in_shard_map(mesh):
    logits = jax.random.normal(jax.random.key(7), (32, 8))

    def loss(logits, w):
        probs, _ = te_ops.fused_topk_with_score_function(logits * w, 2, score_function="softmax")
        return jnp.sum(probs**2)

    _grads_match(mesh, loss, logits, jnp.ones((8,)))
