"""Dense benchmark: te_ops.dense (cuBLASLt, fused bias+GELU epilogue) vs XLA's jnp formulation.

Both are jitted and timed in the same process, their timing rounds interleaved (ours, XLA, XLA,
ours, ...; benchmarks/_timing.py time_interleaved: warm-up, block_until_ready, median per side), so
the GPU's drift to its power-limited clock during these compute-bound runs does not favour either.
"gelu" here is the tanh approximation (activation="gelu_tanh" for te_ops), since
the XLA baseline is ``jax.nn.gelu(x @ w + b)`` with jax.nn.gelu's default (approximate=True).

Forward: ``jit(f)(x, w, b)``. Forward+backward: ``jit`` of ``y, vjp = jax.vjp(f, x, w, b);
(y, *vjp(dy))`` with a random cotangent dy (so neither side can constant-fold the gradient).

    python benchmarks/dense.py            # prints a table, writes benchmarks/results/<device>/dense.json

With the native module, the MLP case also gets a per-GEMM breakdown of the backward: each cuBLASLt
plan's timed best (te_ops._native_cublaslt.dense_plans(), measured in the initialize stage) next to
XLA's dot_general of the same contraction and XLA's fused dgelu pass, timed alone (--no-breakdown
skips it).
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
from te_ops.dense import dense  # noqa: E402

# (name, M, K, N, bias, activation)
CASES = [
    ("mlp 16384x4096x14336 bias+gelu", 16384, 4096, 14336, True, "gelu_tanh"),
    ("square 8192^3 bias+gelu", 8192, 8192, 8192, True, "gelu_tanh"),
    ("square 8192^3 plain", 8192, 8192, 8192, False, None),
    ("small-batch 256x4096x14336 bias+gelu", 256, 4096, 14336, True, "gelu_tanh"),
]
TARGETS = {"mlp 16384x4096x14336 bias+gelu": {"forward": 1.1, "forward+backward": 1.05}}


def xla_fn(act, has_bias):
    def f(x, w, b):
        z = x @ w
        if has_bias:
            z = z + b
        return jax.nn.gelu(z) if act == "gelu_tanh" else z

    return f


def ours_fn(act, has_bias, impl):
    def f(x, w, b):
        return dense(x, w, b if has_bias else None, activation=act, implementation=impl)

    return f


def fwd_bwd(f):
    def g(x, w, b, dy):
        y, vjp = jax.vjp(f, x, w, b)
        return (y, *vjp(dy))

    return g


def make_args(m, k, n, dtype, n_sets, seed=0):
    sets = []
    for i in range(n_sets):
        ks = jax.random.split(jax.random.key(seed + i), 4)
        x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(dtype)
        w = (jax.random.normal(ks[1], (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
        b = jax.random.normal(ks[2], (n,), jnp.float32).astype(dtype)
        dy = jax.random.normal(ks[3], (m, n), jnp.float32).astype(dtype)
        sets.append((x, w, b, dy))
    return jax.block_until_ready(sets)


def rel_err(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6))


def _dgelu_dbias(dy, z):
    dz = jax.vjp(jax.nn.gelu, z)[1](dy)[0]
    return dz, jnp.sum(dz.astype(jnp.float32), axis=0)


def breakdown(m, k, n, dtype, repeats, calls):
    """Rows comparing, GEMM by GEMM, our cuBLASLt plans for an [m, k] x [k, n] dense with XLA's
    dot_general of the same contraction (no transposes materialised on either side), plus XLA's
    dgelu(+dbias) elementwise pass. Ours come from the plan cache (timed at initialize)."""
    mod = _native._loaded["_native_cublaslt"]
    kx, kw, kd = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    dz = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
    z = dz * 0.5
    dn = lambda lc, rc: ((lc, rc), ((), ()))
    xla = {
        # y = x @ w; dx = dz @ w^T (contract N); dw = x^T @ dz (contract M)
        "fwd x@w": (jax.jit(lambda x, w: jax.lax.dot_general(x, w, dn((1,), (0,)))), (x, w)),
        "dgrad dz@w^T": (jax.jit(lambda dz, w: jax.lax.dot_general(dz, w, dn((1,), (1,)))), (dz, w)),
        "wgrad x^T@dz": (jax.jit(lambda x, dz: jax.lax.dot_general(x, dz, dn((0,), (0,)))), (x, dz)),
        "dgelu+dbias pass": (jax.jit(_dgelu_dbias), (dz, z)),
    }
    rows = []
    for what, (f, a) in xla.items():
        rows.append({"what": what, "side": "xla", "ms": _timing.time_fn(f, [a], repeats=repeats, calls=calls)})
    # Ours: the plans whose column-major (m, n, k) is one of this dense's three GEMMs.
    shapes = {(n, m, k): "fwd x@w", (k, m, n): "dgrad dz@w^T", (n, k, m): "wgrad x^T@dz"}
    for p in mod.dense_plans():
        what = shapes.get((p["m"], p["n"], p["k"]))
        if what is None:
            continue
        timed = [t for t in p["candidate_ms"] if t > 0]
        rows.append(
            {
                "what": what,
                "side": f"ours (epilogue {p['epilogue']})",
                "ms": p["best_ms"],
                "candidates": p["candidates"],
                "own": p["own_candidates"],
                "chosen": p["chosen"],
                "worst_candidate_ms": max(timed) if timed else None,
                "candidate_ms": p["candidate_ms"],
                "algo": p["algo"],
            }
        )
    for r in rows:
        if r["what"] != "dgelu+dbias pass" and r["ms"] and r["ms"] > 0:
            r["TFLOPs"] = 2.0 * m * n * k / r["ms"] / 1e9
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=6, help="interleaved rounds (ours/XLA alternate)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--only", default=None, help="substring of a case name")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the per-GEMM backward breakdown")
    args = parser.parse_args()

    dtype = jnp.bfloat16
    impl = "native" if _native.native_unavailable_reason("_native_cublaslt", "dense") is None else "reference"
    if impl != "native":
        print(
            f"WARNING: native dense unavailable ({_native.native_unavailable_reason('_native_cublaslt', 'dense')}); "
            "timing the reference path"
        )
    rows = []
    for name, m, k, n, has_bias, act in CASES:
        if args.only and args.only not in name:
            continue
        sets = make_args(m, k, n, dtype, n_sets=2)
        fwd_sets = [s[:3] for s in sets]
        ours_f, xla_f = jax.jit(ours_fn(act, has_bias, impl)), jax.jit(xla_fn(act, has_bias))
        ours_g, xla_g = jax.jit(fwd_bwd(ours_fn(act, has_bias, impl))), jax.jit(fwd_bwd(xla_fn(act, has_bias)))
        hlo = ours_f.lower(*fwd_sets[0]).as_text()
        used = "native" if "te_dense_fwd" in hlo else "reference"
        # correctness sanity (bf16 vs bf16: both round once; the baseline rounds x@w before bias/gelu)
        err_f = rel_err(ours_f(*fwd_sets[0]), xla_f(*fwd_sets[0]))
        go, gx = ours_g(*sets[0]), xla_g(*sets[0])
        err_b = max(rel_err(a, b) for a, b in zip(go, gx, strict=True))
        flops = 2.0 * m * n * k
        for stage, fo, fx, fl, arg_sets, err in (
            ("forward", ours_f, xla_f, flops, fwd_sets, err_f),
            ("forward+backward", ours_g, xla_g, 3 * flops, sets, err_b),
        ):
            med, samples = _timing.time_interleaved(
                {"ours": fo, "xla": fx}, arg_sets, repeats=args.repeats, calls=args.calls
            )
            t_ours, t_xla = med["ours"], med["xla"]
            target = TARGETS.get(name, {}).get(stage)
            speedup = t_xla / t_ours
            rows.append(
                {
                    "case": name,
                    "stage": stage,
                    "impl": used,
                    "ours_ms": t_ours,
                    "xla_ms": t_xla,
                    "ours_TFLOPs": fl / t_ours / 1e9,
                    "xla_TFLOPs": fl / t_xla / 1e9,
                    "speedup": speedup,
                    "target": target,
                    "meets_target": None if target is None else bool(speedup >= target),
                    "max_rel_diff_vs_xla": err,
                    "ours_round_ms": samples["ours"],
                    "xla_round_ms": samples["xla"],
                }
            )
            print(
                f"{name:40s} {stage:17s} ours {t_ours:8.3f} ms  xla {t_xla:8.3f} ms  x{speedup:.3f}",
                flush=True,
            )
        del sets, fwd_sets, go, gx
    _timing.print_table(
        "dense (bf16)",
        rows,
        [
            "case",
            "stage",
            "impl",
            "ours_ms",
            "xla_ms",
            "ours_TFLOPs",
            "xla_TFLOPs",
            "speedup",
            "target",
            "max_rel_diff_vs_xla",
        ],
    )
    extra = {}
    mlp = CASES[0]
    if impl == "native" and not args.no_breakdown and (not args.only or args.only in mlp[0]):
        bd = breakdown(mlp[1], mlp[2], mlp[3], dtype, args.repeats, args.calls)
        _timing.print_table(
            f"backward breakdown, {mlp[0]} (ours: cuBLASLt plan timings at initialize)",
            bd,
            ["what", "side", "ms", "TFLOPs", "candidates", "own", "chosen", "worst_candidate_ms"],
        )
        extra["breakdown"] = bd
    _timing.write_json("dense", {"dtype": "bfloat16", "rows": rows, "counters": _native.counters(), **extra})


if __name__ == "__main__":
    main()
