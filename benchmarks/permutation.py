"""Benchmark: token_dispatch / token_combine (Triton and Gluon) vs the XLA argsort/gather/scatter
formulation, jitted in the same process.

    python benchmarks/permutation.py [--quick]

Workloads: T32768 H7168 E256 K8 bf16 (targets: dispatch fwd >= 1.5x, combine fwd >= 8x,
dispatch+combine fwd+bwd >= 5x) and T16384 H4096 E64 K8. "TB/s" counts the bytes an ideal kernel
moves (rows read + rows written; index maps and probabilities are negligible). Writes
benchmarks/results/<device>/permutation.json (or $TE_BENCH_OUT).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._timing import print_table, time_interleaved, write_json  # noqa: E402
from te_ops.permutation import api, token_combine, token_dispatch  # noqa: E402

TARGETS = {"dispatch_fwd": 1.5, "combine_fwd": 8.0, "dispatch_combine_fwd_bwd": 5.0}


def make_inputs(t, e, k, h, seed=0):
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((t, e)).astype(np.float32)
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    rm = np.zeros((t, e), bool)
    np.put_along_axis(rm, top, True, axis=1)
    probs = np.where(rm, rng.random((t, e)), 0).astype(np.float32)
    x = jax.random.normal(jax.random.PRNGKey(seed), (t, h), jnp.bfloat16)
    return x, jnp.asarray(rm), jnp.asarray(probs)


# ---- the XLA formulation: argsort of the expert-major routing map, gather, scatter-add ----------


def xla_dispatch(x, rm, probs, n):
    t, e = rm.shape
    flat = jnp.logical_not(rm.T.reshape(-1)).astype(jnp.int8)
    order = jnp.argsort(flat, stable=True)[:n]  # routed (t, e) pairs first, expert-major
    valid = jnp.take(rm.T.reshape(-1), order)
    tok = (order % t).astype(jnp.int32)
    exp = (order // t).astype(jnp.int32)
    out = jnp.where(valid[:, None], jnp.take(x, tok, axis=0), 0)
    pp = jnp.where(valid, probs[tok, exp], 0)
    return out, pp, tok, exp, valid


def xla_combine(y, tok, exp, valid, mp, t):
    w = jnp.where(valid, mp[tok, exp], 0)
    return jnp.zeros((t, y.shape[1]), jnp.float32).at[tok].add(y.astype(jnp.float32) * w[:, None]).astype(y.dtype)


def bench_workload(t, h, e, k, impls, quick):
    x, rm, probs = make_inputs(t, e, k, h)
    n = t * k
    rows_bytes = h * x.dtype.itemsize
    ideal = {
        "dispatch_fwd": (t + n) * rows_bytes,
        "combine_fwd": (n + t) * rows_bytes,
        # dispatch fwd + combine fwd + combine bwd (dy write, g read, y read for d probs) + dispatch bwd
        "dispatch_combine_fwd_bwd": ((t + n) + (n + t) + (n + t + n) + (n + t)) * rows_bytes,
    }
    reps = dict(repeats=3, calls=5) if quick else {}
    g = jax.random.normal(jax.random.PRNGKey(1), (t, h), jnp.bfloat16)

    # Every array is a jit argument: a closed-over routing map would be constant-folded by XLA
    # (slow compiles, and the routing work would silently drop out of the timing).
    fns = {}
    fns[("xla", "dispatch_fwd")] = (jax.jit(lambda x, rm, p: xla_dispatch(x, rm, p, n)[:2]), (x, rm, probs))
    _, _, tok, exp, valid = jax.jit(lambda x, rm, p: xla_dispatch(x, rm, p, n))(x, rm, probs)
    y = jax.random.normal(jax.random.PRNGKey(2), (n, h), jnp.bfloat16)
    fns[("xla", "combine_fwd")] = (
        jax.jit(lambda y, p, tok, exp, valid: xla_combine(y, tok, exp, valid, p, t)),
        (y, probs, tok, exp, valid),
    )

    def xla_both(x, p, rm):
        out, pp, tok, exp, valid = xla_dispatch(x, rm, p, n)
        return xla_combine(out, tok, exp, valid, p, t)

    fns[("xla", "dispatch_combine_fwd_bwd")] = (
        jax.jit(lambda x, p, g, rm: jax.vjp(lambda x, p: xla_both(x, p, rm), x, p)[1](g)),
        (x, probs, g, rm),
    )

    row_id_map = jax.jit(lambda x, rm: token_dispatch(x, rm, n, implementation="reference").row_id_map)(x, rm)
    for impl in impls:
        fns[(impl, "dispatch_fwd")] = (
            jax.jit(lambda x, rm, p, impl=impl: token_dispatch(x, rm, n, probs=p, implementation=impl)[:3]),
            (x, rm, probs),
        )
        fns[(impl, "combine_fwd")] = (
            jax.jit(lambda y, p, m, impl=impl: token_combine(y, m, merging_probs=p, implementation=impl)),
            (y, probs, row_id_map),
        )

        def both(x, p, rm, impl=impl):
            d = token_dispatch(x, rm, n, probs=p, implementation=impl)
            out, m = d.out, d.row_id_map
            return token_combine(out, m, merging_probs=p, implementation=impl)

        fns[(impl, "dispatch_combine_fwd_bwd")] = (
            jax.jit(lambda x, p, g, rm, both=both: jax.vjp(lambda x, p: both(x, p, rm), x, p)[1](g)),
            (x, probs, g, rm),
        )

    rows, results = [], {}
    for op in ideal:
        # XLA and every implementation in interleaved rounds (each call with its own arguments)
        calls = {impl: (lambda fn=fns[(impl, op)][0], a=fns[(impl, op)][1]: fn(*a)) for impl in ("xla", *impls)}
        med, _ = time_interleaved(calls, [()], **reps)
        base = med["xla"]
        results[f"xla/{op}"] = base
        rows.append(dict(op=op, impl="xla", ms=base, tbps=ideal[op] / base / 1e9, speedup=1.0))
        for impl in impls:
            ms = med[impl]
            results[f"{impl}/{op}"] = ms
            rows.append(
                dict(
                    op=op,
                    impl=impl,
                    ms=ms,
                    tbps=ideal[op] / ms / 1e9,
                    speedup=base / ms,
                    target=TARGETS.get(op) if (t, h, e) == (32768, 7168, 256) else None,
                )
            )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test of this script)")
    ap.add_argument("--impls", default=None, help="comma-separated implementations (default: available GPU ones)")
    args = ap.parse_args()
    if args.impls:
        impls = args.impls.split(",")
    else:
        impls = [i for i in ("triton", "gluon") if api.DISPATCH.get(i).available() is None]
        if not impls:
            print(f"note: no GPU implementation available ({api.DISPATCH.get('triton').available()})")
    workloads = [(32768, 7168, 256, 8), (16384, 4096, 64, 8)] if not args.tiny else [(256, 64, 8, 2)]
    payload = {"workloads": []}
    for t, h, e, k in workloads:
        rows = bench_workload(t, h, e, k, impls, args.quick)
        title = f"permutation T{t} H{h} E{e} K{k} bf16"
        print_table(title, rows, ["op", "impl", "ms", "tbps", "speedup", "target"])
        payload["workloads"].append({"T": t, "H": h, "E": e, "K": k, "dtype": "bfloat16", "rows": rows})
        jax.clear_caches()
    write_json("permutation", payload, out_dir=os.environ.get("TE_BENCH_OUT") or ("/tmp" if args.tiny else None))


if __name__ == "__main__":
    main()
