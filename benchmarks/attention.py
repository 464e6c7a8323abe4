"""Fused attention benchmark: te_ops.fused_attention (cuDNN frontend graphs, our FFI handlers) vs
jax.nn.dot_product_attention(implementation="cudnn") and implementation="xla", side by side in one
process. Prints a table and writes benchmarks/results/<device>/attention.json.

    python benchmarks/attention.py [--quick] [--xla-bwd-big]

Cases (issue 6 / ANCHORS): B4 S4096 H32 D128 causal bf16 and B2 S8192 Hq32 Hkv8 D128 causal bf16,
forward and forward+backward. FLOPs: forward 4*B*Hq*Sq*Sk*D, forward+backward 3.5x that (the
backward recomputes S and runs four more matmuls), causal counts half. The XLA implementation
materialises B*H*S*S scores; for the S8192 case only its forward is timed unless --xla-bwd-big.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

from te_ops._core import native as _native  # noqa: E402
from te_ops.fused_attention import fused_attention  # noqa: E402
from te_ops.fused_attention import native as fa_native  # noqa: E402

TARGET = 1.0  # issue 6: >= 1.0x jax.nn.dot_product_attention(implementation="cudnn")


def make_fns(impl: str):
    def fwd(q, k, v, g):
        del g
        if impl == "ours":
            return fused_attention(q, k, v, mask_type="causal", implementation="native")
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    def fwd_bwd(q, k, v, g):
        out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, g), q, k, v)
        return vjp(g)

    return jax.jit(fwd), jax.jit(fwd_bwd)


def _rel(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


def make_inputs(b, s, hq, hk, d, n_sets=2, dtype=jnp.bfloat16):
    """``n_sets`` random (q, k, v, cotangent) tuples in BSHD layout, rotated call by call by the timing."""
    arg_sets = []
    for i in range(n_sets):
        ks = jax.random.split(jax.random.key(100 + i), 4)
        q = jax.random.normal(ks[0], (b, s, hq, d), jnp.float32).astype(dtype)
        k = jax.random.normal(ks[1], (b, s, hk, d), jnp.float32).astype(dtype)
        v = jax.random.normal(ks[2], (b, s, hk, d), jnp.float32).astype(dtype)
        g = jax.random.normal(ks[3], (b, s, hq, d), jnp.float32).astype(dtype)
        arg_sets.append((q, k, v, g))
    return arg_sets


def bench_case(name, b, s, hq, hk, d, *, xla_fwd=True, xla_bwd=True):
    arg_sets = make_inputs(b, s, hq, hk, d)
    fns = {"ours": make_fns("ours"), "cudnn": make_fns("cudnn")}
    if xla_fwd:
        fns["xla"] = make_fns("xla")
    # correctness spot check before timing
    out_ours = fns["ours"][0](*arg_sets[0])
    out_cudnn = fns["cudnn"][0](*arg_sets[0])
    err_fwd = _rel(out_ours, out_cudnn)
    grads_ours = fns["ours"][1](*arg_sets[0])
    grads_cudnn = fns["cudnn"][1](*arg_sets[0])
    err_bwd = max(_rel(a, c) for a, c in zip(grads_ours, grads_cudnn, strict=True))
    del out_ours, out_cudnn, grads_ours, grads_cudnn

    flops_fwd = 4.0 * b * hq * s * s * d / 2  # causal: half
    rows = []
    for mode, idx, flops in (("fwd", 0, flops_fwd), ("fwd+bwd", 1, 3.5 * flops_fwd)):
        runnable = {}
        for key, f in fns.items():
            if key == "xla" and mode == "fwd+bwd" and not xla_bwd:
                continue
            try:
                jax.block_until_ready(f[idx](*arg_sets[0]))
                runnable[key] = f[idx]
            except Exception as e:  # e.g. XLA out of memory on the big case
                print(f"  {name} {mode} {key}: failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        # the runnable ones in interleaved rounds (benchmarks/_timing.py time_interleaved)
        times, _ = _timing.time_interleaved(runnable, arg_sets)
        row = {
            "case": name,
            "mode": mode,
            "shape": f"B{b} S{s} Hq{hq} Hkv{hk} D{d} causal",
            "dtype": "bfloat16",
            "ours_ms": times.get("ours"),
            "cudnn_ms": times.get("cudnn"),
            "xla_ms": times.get("xla"),
            "rel_err_vs_cudnn": err_fwd if mode == "fwd" else err_bwd,
        }
        for key in ("ours", "cudnn", "xla"):
            if times.get(key):
                row[f"{key}_TFLOPs"] = flops / (times[key] * 1e-3) / 1e12
        if times.get("ours") and times.get("cudnn"):
            row["speedup_vs_cudnn"] = times["cudnn"] / times["ours"]
        if times.get("ours") and times.get("xla"):
            row["speedup_vs_xla"] = times["xla"] / times["ours"]
        rows.append(row)
        print(f"  {name} {mode}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--xla-bwd-big", action="store_true", help="also time XLA fwd+bwd at S8192 (needs ~50 GB)")
    args = ap.parse_args()
    why = _native.native_unavailable_reason(fa_native.MODULE, "fused_attention")
    if why is not None:
        print(f"attention benchmark needs the native cuDNN path: {why}")
        return 1
    rows = []
    if args.quick:
        rows += bench_case("MHA causal (quick)", 2, 1024, 8, 8, 128)
        rows += bench_case("GQA causal (quick)", 1, 2048, 8, 2, 128)
    else:
        rows += bench_case("MHA causal (issue target)", 4, 4096, 32, 32, 128)
        rows += bench_case("GQA causal (issue target)", 2, 8192, 32, 8, 128, xla_bwd=args.xla_bwd_big)
    cols = [
        "case",
        "mode",
        "shape",
        "ours_ms",
        "cudnn_ms",
        "xla_ms",
        "ours_TFLOPs",
        "cudnn_TFLOPs",
        "xla_TFLOPs",
        "speedup_vs_cudnn",
        "speedup_vs_xla",
        "rel_err_vs_cudnn",
    ]
    _timing.print_table(
        "fused attention (te_ops cuDNN graphs vs jax.nn.dot_product_attention, same process)", rows, cols
    )
    verdict = {
        f"{r['case']} {r['mode']}": {
            "speedup_vs_cudnn": r.get("speedup_vs_cudnn"),
            "target": TARGET,
            "met": (r.get("speedup_vs_cudnn") or 0) >= TARGET,
        }
        for r in rows
    }
    print("targets:", verdict)
    _timing.write_json(
        "attention", {"rows": rows, "targets": verdict, "quick": args.quick, "counters": _native.counters()}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
