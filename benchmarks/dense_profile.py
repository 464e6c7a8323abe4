"""Kernel-level profile of the dense MLP case: every GPU kernel of te_ops.dense's forward and
forward+backward next to XLA's jnp formulation, from a jax.profiler trace (CUPTI), in steady state.

Where benchmarks/dense.py says which side is faster end to end, this says why: each kernel's mean
time per step (the GEMMs, the activation/dbias passes, XLA's fusions) and the gaps between them.
Command buffers are turned off for the traced process (unless XLA_FLAGS already sets them) so each
kernel shows up on its own; kernel durations do not depend on that.

    python benchmarks/dense_profile.py [--m 16384 --k 4096 --n 14336] [--steps 10]

Prints one table per (side, stage) and writes benchmarks/results/<device>/dense_profile.json.
"""

from __future__ import annotations

import os

if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import argparse  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
import dense as dense_bench  # noqa: E402
from _profile import print_profile, profile  # noqa: E402

from te_ops._core import native as _native  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if _native.native_unavailable_reason("_native_cublaslt", "dense") is not None:
        print(f"native dense unavailable: {_native.native_unavailable_reason('_native_cublaslt', 'dense')}")
        return
    m, k, n = args.m, args.k, args.n
    ((x, w, b, dy),) = dense_bench.make_args(m, k, n, jnp.bfloat16, n_sets=1)
    act = "gelu_tanh"
    sides = {
        "ours": dense_bench.ours_fn(act, True, "native"),
        "xla": dense_bench.xla_fn(act, True),
    }
    mod = _native._loaded["_native_cublaslt"]
    info = mod.dense_backward_variants()
    runs = [("forward", "ours", None), ("forward", "xla", None), ("forward+backward", "xla", None)]
    # ours forward+backward once per compiled block shape of the dz/dbias kernel, the default last
    order = [v for v in range(len(info["variants"])) if v != info["active"]] + [info["active"]]
    runs += [("forward+backward", "ours", v) for v in order]
    # the training forward's split path (hook) vs the fused epilogue, alternated twice (GEMM kernel
    # times drift by a few % between profiles), with the default dz kernel
    runs += [("forward+backward", "ours", "split"), ("forward+backward", "ours", "fused")] * 2
    results = []
    for stage, side, variant in runs:
        f = sides[side]
        fn = jax.jit(f) if stage == "forward" else jax.jit(dense_bench.fwd_bwd(f))
        a = (x, w, b) if stage == "forward" else (x, w, b, dy)
        if variant in ("split", "fused"):
            mod.dense_set_forward_split(variant == "split")
            side = f"ours, {variant} training forward"
        elif variant is not None:
            mod.dense_set_backward_variant(variant)
            side = f"ours, dz kernel block {tuple(info['variants'][variant])}" + (
                " (default)" if variant == info["active"] else ""
            )
        r = profile(fn, a, args.steps)
        r.update(side=side, stage=stage)
        results.append(r)
        print_profile(f"{side} {stage}", r)
    mod.dense_set_forward_split(False)
    _timing.write_json(
        "dense_profile",
        {
            "shape": {"m": m, "k": k, "n": n},
            "profiles": results,
            "plans": _native._loaded["_native_cublaslt"].dense_plans(),
        },
    )


if __name__ == "__main__":
    main()
