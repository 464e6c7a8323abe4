"""Every GPU implementation of every public op runs eagerly (no jit) and under jit, forward and
backward, and matches the reference.

Eager calls take a different path through JAX than jitted ones: each primitive is compiled and run
on its own (``apply_primitive``), so a primitive without an evaluation rule fails only there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_ops
from te_ops._core import registry
from te_ops._core.testing import assert_close, tolerance

pytestmark = pytest.mark.gpu


def _key(i):
    return jax.random.key(i)


def _routing(t, e, k, seed=3):
    logits = jax.random.normal(_key(seed), (t, e), jnp.float32)
    idx = jax.lax.top_k(logits, k)[1]
    routing_map = jnp.zeros((t, e), bool).at[jnp.arange(t)[:, None], idx].set(True)
    probs = jax.nn.softmax(logits, -1) * routing_map
    return routing_map, probs


def _softmax():
    x = jax.random.normal(_key(0), (2, 4, 64, 64), jnp.bfloat16)
    mask = jax.random.bernoulli(_key(1), 0.2, (2, 1, 64, 64))
    return (
        "softmax",
        lambda impl: (
            lambda x: (
                te_ops.scaled_masked_softmax(x, mask, 0.5, implementation=impl)
                + te_ops.scaled_upper_triang_masked_softmax(x, 0.5, implementation=impl)
            )
        ),
        (x,),
    )


def _dense():
    x = jax.random.normal(_key(0), (256, 128), jnp.bfloat16)
    w = jax.random.normal(_key(1), (128, 192), jnp.bfloat16) * 0.1
    b = jax.random.normal(_key(2), (192,), jnp.bfloat16)
    return (
        "dense",
        lambda impl: lambda x, w, b: te_ops.dense(x, w, b, activation="gelu_tanh", implementation=impl),
        (x, w, b),
    )


def _router():
    logits = jax.random.normal(_key(0), (128, 32), jnp.float32)
    return (
        "fused_topk_with_score_function",
        lambda impl: lambda lg: te_ops.fused_topk_with_score_function(lg, 4, implementation=impl)[0],
        (logits,),
    )


def _aux_scores():
    logits = jax.random.normal(_key(0), (128, 32), jnp.float32)
    return (
        "compute_routing_scores_for_aux_loss",
        lambda impl: (
            lambda lg: te_ops.compute_routing_scores_for_aux_loss(lg, 4, score_function="softmax", implementation=impl)[
                1
            ]
        ),
        (logits,),
    )


def _aux_loss():
    probs = jax.nn.softmax(jax.random.normal(_key(0), (128, 32), jnp.float32), -1)
    tpe = jax.random.randint(_key(1), (32,), 0, 40).astype(jnp.int32)
    return (
        "fused_moe_aux_loss",
        lambda impl: lambda p: te_ops.fused_moe_aux_loss(p, tpe, topk=4, coeff=1e-2, implementation=impl),
        (probs,),
    )


def _attention():
    q = jax.random.normal(_key(0), (2, 128, 8, 64), jnp.bfloat16)
    k = jax.random.normal(_key(1), (2, 128, 2, 64), jnp.bfloat16)
    v = jax.random.normal(_key(2), (2, 128, 2, 64), jnp.bfloat16)
    return (
        "fused_attention",
        lambda impl: lambda q, k, v: te_ops.fused_attention(q, k, v, mask_type="causal", implementation=impl),
        (q, k, v),
    )


def _grouped_dense():
    x = jax.random.normal(_key(0), (512, 128), jnp.bfloat16)
    w = jax.random.normal(_key(1), (4, 128, 64), jnp.bfloat16) * 0.1
    sizes = jnp.asarray([100, 0, 250, 130], jnp.int32)
    return "grouped_dense", lambda impl: lambda x, w: te_ops.grouped_dense(x, w, sizes, implementation=impl), (x, w)


def _dispatch_combine():
    t, e, k, h = 96, 8, 2, 128
    routing_map, probs = _routing(t, e, k)
    x = jax.random.normal(_key(0), (t, h), jnp.bfloat16)

    def make(impl):
        def f(x, probs):
            res = te_ops.token_dispatch(x, routing_map, t * k, probs=probs, implementation=impl)
            out, row_id_map = res.out, res.row_id_map
            return te_ops.token_combine(out, row_id_map, merging_probs=probs, implementation=impl)

        return f

    return "token_dispatch", make, (x, probs)


def _sort_chunks():
    x = jax.random.normal(_key(0), (64, 128), jnp.bfloat16)
    split = jnp.asarray([10, 0, 30, 24], jnp.int32)
    order = jnp.asarray([2, 0, 3, 1], jnp.int32)
    return (
        "sort_chunks_by_index",
        lambda impl: lambda x: te_ops.sort_chunks_by_index(x, split, order, implementation=impl)[0],
        (x,),
    )


def _normalization():
    x = jax.random.normal(_key(0), (64, 1024), jnp.bfloat16)
    r = jax.random.normal(_key(1), (64, 1024), jnp.bfloat16)
    gamma = 1 + 0.1 * jax.random.normal(_key(2), (1024,), jnp.float32)
    beta = 0.1 * jax.random.normal(_key(3), (1024,), jnp.float32)

    def make(impl):
        def f(x, r, gamma, beta):
            y, h = te_ops.layer_norm(x, gamma, beta, residual=r, implementation=impl)
            return te_ops.rms_norm(y, gamma, implementation=impl) + h

        return f

    return "normalization", make, (x, r, gamma, beta)


CASES = [
    _softmax,
    _dense,
    _router,
    _aux_scores,
    _aux_loss,
    _attention,
    _grouped_dense,
    _dispatch_combine,
    _sort_chunks,
    _normalization,
]


def _params():
    out = []
    for make in CASES:
        family, _, _ = make()
        for impl in registry.family(family).names:
            if impl == registry.REFERENCE:
                continue
            why = registry.family(family).get(impl).available()
            marks = pytest.mark.skipif(why is not None, reason=f"{family}/{impl}: {why}")
            out.append(pytest.param(make, impl, id=f"{family}-{impl}", marks=marks))
    return out


def _loss(f):
    def loss(*args):
        y = f(*args)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    return loss


def _close(actual, expected, dtype):
    expected = np.asarray(expected, np.float32)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    assert_close(np.asarray(actual, np.float32), expected, dtype=dtype, scale=scale)


@pytest.mark.parametrize("make,impl", _params())
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_runs_eagerly_and_under_jit(make, impl, mode):
    _, build, args = make()
    ours, ref = build(impl), build(registry.REFERENCE)
    wrap = jax.jit if mode == "jit" else (lambda f: f)
    y = wrap(ours)(*args)
    y_ref = jax.jit(ref)(*args)
    _close(y, y_ref, args[0].dtype)
    g = wrap(jax.grad(_loss(ours), argnums=tuple(range(len(args)))))(*args)
    g_ref = jax.jit(jax.grad(_loss(ref), argnums=tuple(range(len(args)))))(*args)
    # A gradient mixes every input: compare it at the tolerance of the least precise one (a float32
    # merging-probs gradient is a dot product of bfloat16 rows, for instance).
    low = max((x.dtype for x in args), key=lambda d: tolerance(d)["rtol"])
    for a, b in zip(g, g_ref, strict=True):
        _close(a, b, low)
