"""Minimal example: causal attention written with te_ops' fused softmax.

Runs on CPU (reference path) or GPU (native kernels), same code:

    python examples/attention_scores.py --batch 2 --heads 4 --seq 256 --dim 64
"""

import argparse
import math
import time

import jax
import jax.numpy as jnp

import te_ops


def attention(q, k, v, implementation=None):
    """q, k, v: [B, S, H, D] -> [B, S, H, D], causal."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    probs = te_ops.scaled_upper_triang_masked_softmax(scores, 1.0 / math.sqrt(q.shape[-1]),
                                                      implementation=implementation)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dim", type=int, default=64)
    args = ap.parse_args()
    shape = (args.batch, args.seq, args.heads, args.dim)
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk_, shape, jnp.bfloat16) for kk_ in (kq, kk, kv))

    loss = lambda q, k, v: jnp.mean(attention(q, k, v).astype(jnp.float32) ** 2)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    val, grads = step(q, k, v)
    jax.block_until_ready(grads)
    t0 = time.perf_counter()
    for _ in range(10):
        val, grads = step(q, k, v)
    jax.block_until_ready(grads)
    dt = (time.perf_counter() - t0) / 10

    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    err = float(jnp.max(jnp.abs(attention(q, k, v).astype(jnp.float32) - ref.astype(jnp.float32))))
    print(f"backend={jax.default_backend()} native={te_ops.native_unavailable_reason() or 'available'}")
    print(f"loss={float(val):.5f}  step={dt * 1e3:.2f} ms  max|ours - jax.nn.dot_product_attention|={err:.3e}")


if __name__ == "__main__":
    main()
