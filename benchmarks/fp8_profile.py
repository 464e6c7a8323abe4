"""Kernel-level profile of the block-scaled FP8 paths: every GPU kernel of fp8_dense forward+backward
at 16384x4096x14336 and of fp8_grouped_dense forward+backward at K7168 N4096 G32 M65536 (block
scaling, bf16), from a jax.profiler trace (CUPTI), in steady state, command buffers off.

Where benchmarks/fp8.py says how long the whole step takes, this says where the time goes: the
GEMM kernels against the quantize kernels, XLA's transposes and fusions, and the gaps between them.

    python benchmarks/fp8_profile.py [--steps 5]

Prints one table per case and writes benchmarks/results/<device>/fp8_profile.json.
"""

from __future__ import annotations

import os

if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import argparse  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
from _profile import print_profile, profile  # noqa: E402

from te_ops import fp8  # noqa: E402


def _fb(f):
    def run(x, w, dy):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy))

    return jax.jit(run)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cases", default="dense,dense_fwd,gemm,bf16_dense,grouped",
                    help="comma-separated subset of dense, dense_fwd, gemm, bf16_dense, grouped")  # fmt: skip
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    rec = fp8.BlockScaling()
    results = {}

    def run(name, fn, fargs):
        r = profile(fn, fargs, args.steps)
        print_profile(name, r)
        results[name] = r

    m, k, n = 16384, 4096, 14336
    ks = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(ks[2], (m, n), jnp.bfloat16)
    impl = "triton" if jax.default_backend() == "gpu" else "reference"
    if "dense" in cases:
        fn = _fb(lambda x, w: fp8.fp8_dense(x, w, rec, implementation=impl))
        run(f"fp8_dense block fwd+bwd {m}x{k}x{n}", fn, (x, w, dy))
    if "dense_fwd" in cases:
        fn = jax.jit(lambda x, w: fp8.fp8_dense(x, w, rec, implementation=impl))
        run(f"fp8_dense block forward {m}x{k}x{n}", fn, (x, w))
    if "gemm" in cases and impl == "triton":  # the block-scaled GEMM alone on quantized operands
        from te_ops.fp8 import triton as fp8_triton

        qa = fp8.quantize(x, rec, "x", implementation=impl)
        qb = fp8.quantize(w.T, rec, "w", implementation=impl)
        fn = jax.jit(lambda a, b: fp8_triton.block_scaled_gemm(a, b, jnp.bfloat16))
        run(f"block_scaled_gemm alone {m}x{k}x{n}", fn, (qa, qb))
    if "bf16_dense" in cases:
        from te_ops.dense import dense

        fn = _fb(lambda x, w: dense(x, w))
        run(f"bf16 te_ops.dense fwd+bwd {m}x{k}x{n}", fn, (x, w, dy))
    del x, w, dy
    if "grouped" in cases:
        mg, g, kg, ng = 65536, 32, 7168, 4096
        rng = np.random.default_rng(7)
        sizes = jnp.asarray(np.full(g, mg // g, np.int32))
        x = jnp.asarray(rng.standard_normal((mg, kg), np.float32), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((g, kg, ng), np.float32) / kg**0.5, jnp.bfloat16)
        dy = jnp.asarray(rng.standard_normal((mg, ng), np.float32), jnp.bfloat16)
        fn = _fb(lambda x, w: fp8.fp8_grouped_dense(x, w, sizes, rec, implementation=impl))
        run(f"fp8_grouped_dense block fwd+bwd K{kg} N{ng} G{g} M{mg}", fn, (x, w, dy))
    _timing.write_json("fp8_profile", {"cases": results})


if __name__ == "__main__":
    main()
