"""MoE router benchmark: te_ops native fused top-k vs the XLA composition (score function +
lax.top_k + scatter, jitted), side by side in one process. Prints a table and writes
benchmarks/results/<device>/router.json.

    python benchmarks/router.py [--quick]

Cases: T65536 E256 K8 softmax (a targeted case, fp32) and the DeepSeek-V3 config (E256 K8,
8 groups, group_topk 4, sigmoid, expert bias, scaling 2.5), forward and forward+backward.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

import te_ops  # noqa: E402
from te_ops.router import fused_topk_with_score_function  # noqa: E402

TARGET = 4.0  # the speed-up over the XLA composition the fused router aims for (targeted cases)


def xla_router(x, bias, *, topk, score_function="softmax", num_groups=None, group_topk=None, scaling_factor=1.0):
    """What one writes in plain JAX: score function + lax.top_k (+ groups) + scatter (autodiff backward)."""
    t, e = x.shape
    x = x.astype(jnp.float32)
    s = x if score_function == "softmax" else jax.nn.sigmoid(x)
    sel = s if bias is None else s + bias
    if group_topk is not None:
        g = jax.lax.stop_gradient(sel).reshape(t, num_groups, e // num_groups)
        gscore = jax.lax.top_k(g, topk // group_topk)[0].sum(-1)
        _, gidx = jax.lax.top_k(gscore, group_topk)
        gmask = jnp.zeros((t, num_groups), bool).at[jnp.arange(t)[:, None], gidx].set(True)
        sel = jnp.where(jnp.repeat(gmask, e // num_groups, -1), sel, -jnp.inf)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(sel), topk)
    w = jnp.take_along_axis(s, idx, -1)
    if score_function == "softmax":
        w = jax.nn.softmax(w, -1)
    elif topk > 1:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    rows = jnp.arange(t)[:, None]
    probs = jnp.zeros((t, e), jnp.float32).at[rows, idx].set(scaling_factor * w)
    rmap = jnp.zeros((t, e), bool).at[rows, idx].set(True)
    return probs.astype(x.dtype), rmap


def make_fns(cfg, has_bias, impl):
    def fwd(x, bias, ct):
        del ct
        b = bias if has_bias else None
        if impl == "xla":
            return xla_router(x, b, **cfg)
        return fused_topk_with_score_function(x, expert_bias=b, implementation=impl, **cfg)

    def fwd_bwd(x, bias, ct):
        (probs, rmap), vjp = jax.vjp(lambda x: fwd(x, bias, ct), x)
        import numpy as np

        dx = vjp((ct.astype(probs.dtype), np.zeros(rmap.shape, jax.dtypes.float0)))[0]
        return rmap, dx

    return jax.jit(fwd), jax.jit(fwd_bwd)


def bench_case(name, t, e, cfg, has_bias, dtype):
    arg_sets = []
    for i in range(2):  # two input sets, rotated (each is >= L2 at the full size)
        x = jax.random.normal(jax.random.key(i), (t, e), jnp.float32).astype(dtype)
        bias = 0.05 * jax.random.normal(jax.random.key(10 + i), (e,), jnp.float32)
        ct = jax.random.normal(jax.random.key(20 + i), (t, e), jnp.float32).astype(dtype)
        arg_sets.append((x, bias, ct))
    nb = jnp.dtype(dtype).itemsize
    impls = {"ours": "native", "xla": "xla", "te_reference": "reference"}
    fns = {k: make_fns(cfg, has_bias, v) for k, v in impls.items()}
    # correctness spot check before timing: same routing map as the reference
    p, m = fns["ours"][0](*arg_sets[0])
    p_ref, m_ref = fns["te_reference"][0](*arg_sets[0])
    agree = float(jnp.mean(jnp.all(m == m_ref, axis=-1)))
    rows = []
    for mode, idx, moved in (("fwd", 0, (2 * nb + 1) * t * e), ("fwd+bwd", 1, (5 * nb + 2) * t * e)):
        times, _ = _timing.time_interleaved({k: f[idx] for k, f in fns.items()}, arg_sets)
        alt = min(("xla", "te_reference"), key=times.get)
        rows.append(
            {
                "case": name,
                "mode": mode,
                "shape": f"T{t} E{e} K{cfg['topk']}",
                "dtype": jnp.dtype(dtype).name,
                "ours_ms": times["ours"],
                "xla_ms": times["xla"],
                "te_reference_ms": times["te_reference"],
                "best_alt": alt,
                "speedup": times[alt] / times["ours"],
                "speedup_vs_xla": times["xla"] / times["ours"],
                "ours_TBps": moved / times["ours"] / 1e9,
                "map_rows_agree": agree,
            }
        )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    args = ap.parse_args()
    if te_ops.native_unavailable_reason("_native", "router") is not None:
        print(f"router benchmark needs the native GPU path: {te_ops.native_unavailable_reason('_native', 'router')}")
        return 1
    t = 4096 if args.quick else 65536
    softmax = dict(topk=8, score_function="softmax")
    dsv3 = dict(topk=8, score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5)
    rows = []
    rows += bench_case("softmax top-k (issue target)", t, 256, softmax, False, jnp.float32)
    rows += bench_case("DeepSeek-V3 (issue target)", t, 256, dsv3, True, jnp.float32)
    rows += bench_case("DeepSeek-V3 bf16", t, 256, dsv3, True, jnp.bfloat16)
    rows += bench_case("Mixtral E8 K2", t, 8, dict(topk=2, score_function="softmax"), False, jnp.bfloat16)
    cols = [
        "case",
        "mode",
        "shape",
        "dtype",
        "ours_ms",
        "xla_ms",
        "te_reference_ms",
        "speedup_vs_xla",
        "speedup",
        "ours_TBps",
        "map_rows_agree",
    ]
    _timing.print_table("router (te_ops native vs XLA composition, same process)", rows, cols)
    verdict = {
        f"{r['case']} {r['mode']}": {
            "speedup_vs_xla": r["speedup_vs_xla"],
            "target": TARGET,
            "met": r["speedup_vs_xla"] >= TARGET,
        }
        for r in rows
        if "issue target" in r["case"]
    }
    print("targets:", verdict)
    _timing.write_json("router", {"rows": rows, "targets": verdict, "quick": args.quick})
    return 0


if __name__ == "__main__":
    sys.exit(main())
