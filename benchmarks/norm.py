"""RMSNorm / LayerNorm benchmark: te_ops Triton kernels vs XLA (the same formula written the natural
way in jnp and jitted, which XLA fuses), side by side in one process, forward and forward+backward,
with and without the fused residual addition. Prints a table and writes
benchmarks/results/<device>/norm.json (with a ``summary`` for scripts/perf_table.py).

    python benchmarks/norm.py [--quick] [--target-only]

A launch sweep at the target shape (SWEEP below) times the in-register kernels with other warp counts
and numbers of backward programs, to tune the defaults in te_ops/normalization/triton.py.

Target (issue "[2 of 5] End-to-end MoE training speed"): forward+backward >= 1.5x XLA at
[16384, 4096] bfloat16.
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
from te_ops.normalization import api as norm_api  # noqa: E402

F32 = jnp.float32
TARGET_SHAPE = (16384, 4096)
TARGET = 1.5  # fwd+bwd speedup over XLA at TARGET_SHAPE bf16
L2_BYTES = 60 * 2**20  # H100/H200 L2 is 50-60 MB: rotate inputs until the working set is past it


def xla_norm(kind, x, gamma, beta, residual, eps):
    """The XLA alternative: the documented formula in jnp, statistics in float32."""
    h = x if residual is None else (x.astype(F32) + residual.astype(F32)).astype(x.dtype)
    hf = h.astype(F32)
    if kind == "layer":
        mean = jnp.mean(hf, axis=-1, keepdims=True)
        c = hf - mean
        y = c * jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps) * gamma.astype(F32) + beta.astype(F32)
    else:
        y = hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps) * gamma.astype(F32)
    y = y.astype(x.dtype)
    return y if residual is None else (y, h)


def ours_norm(kind, x, gamma, beta, residual, eps):
    if kind == "layer":
        out = te_ops.layer_norm(x, gamma, beta, residual=residual, eps=eps, implementation="triton")
    else:
        out = te_ops.rms_norm(x, gamma, residual=residual, eps=eps, implementation="triton")
    return out if residual is None else tuple(out)


def _fwd(fn, kind, eps):
    return jax.jit(lambda x, g, b, r, dy, dh: fn(kind, x, g, b, r, eps))


def _fwd_bwd(fn, kind, eps):
    """Gradients of x, gamma (beta) and residual for the cotangents dy (and dh)."""

    def run(x, g, b, r, dy, dh):
        y, vjp = jax.vjp(lambda x, g, b, r: fn(kind, x, g, b, r, eps), x, g, b, r)
        # y is returned as in training (the next layer reads it): XLA may not drop its write
        return y, vjp(dy if r is None else (dy, dh))

    return jax.jit(run)


def _arg_sets(shape, dtype, kind, has_res):
    nbytes = shape[0] * shape[1] * jnp.dtype(dtype).itemsize
    n_sets = max(1, min(8, -(-2 * L2_BYTES // (4 * nbytes))))  # x, r, dy, dh per set
    sets = []
    for s in range(n_sets):
        ks = jax.random.split(jax.random.key(s), 6)
        x = jax.random.normal(ks[0], shape, F32).astype(dtype)
        g = 1 + 0.1 * jax.random.normal(ks[1], shape[-1:], F32)
        b = 0.1 * jax.random.normal(ks[2], shape[-1:], F32) if kind == "layer" else None
        r = jax.random.normal(ks[3], shape, F32).astype(dtype) if has_res else None
        dy = jax.random.normal(ks[4], shape, F32).astype(dtype)
        dh = jax.random.normal(ks[5], shape, F32).astype(dtype) if has_res else None
        sets.append((x, g, b, r, dy, dh))
    return sets, nbytes


def bench_case(kind, shape, dtype, has_res, modes=("fwd", "fwd+bwd"), eps=1e-6):
    sets, nbytes = _arg_sets(shape, dtype, kind, has_res)
    rows = []
    for mode in modes:
        make = _fwd if mode == "fwd" else _fwd_bwd
        fns = {"ours": make(ours_norm, kind, eps), "xla": make(xla_norm, kind, eps)}
        times, _ = _timing.time_interleaved(fns, sets)
        # bytes every implementation must move: fwd reads x (r), writes y (h); bwd reads h, dy (dh),
        # writes dx (the residual gradient is the same array)
        moved = nbytes * ((4 if has_res else 2) + (0 if mode == "fwd" else (4 if has_res else 3)))
        rows.append({
            "kind": kind, "op": "rms_norm" if kind == "rms" else "layer_norm", "mode": mode,
            "shape": "x".join(map(str, shape)), "dtype": jnp.dtype(dtype).name, "residual": has_res,
            "ours_ms": times["ours"], "xla_ms": times["xla"],
            "ours_TBps": moved / times["ours"] / 1e9, "xla_TBps": moved / times["xla"] / 1e9,
            "speedup": times["xla"] / times["ours"],
        })  # fmt: skip
    return rows


# (ELEMS_PER_THREAD, BWD_PROGRAMS_PER_SM) of te_ops/normalization/triton.py; the first is the default.
SWEEP = [(16, 4), (8, 4), (32, 4), (16, 1), (16, 2), (16, 8), (16, 16)]


def sweep(kind, shape, dtype, has_res):
    """fwd and fwd+bwd times of our kernels under each launch configuration (read at trace time, so
    every configuration gets freshly jitted functions), with XLA's times for the same case."""
    from te_ops.normalization import triton as tri

    sets, _ = _arg_sets(shape, dtype, kind, has_res)
    xla = {"fwd": _timing.time_fn(_fwd(xla_norm, kind, 1e-6), sets),
           "fwd+bwd": _timing.time_fn(_fwd_bwd(xla_norm, kind, 1e-6), sets)}  # fmt: skip
    default = (tri.ELEMS_PER_THREAD, tri.BWD_PROGRAMS_PER_SM)
    rows = []
    try:
        for ept, per_sm in SWEEP:
            tri.ELEMS_PER_THREAD, tri.BWD_PROGRAMS_PER_SM = ept, per_sm
            fwd_ms = _timing.time_fn(_fwd(ours_norm, kind, 1e-6), sets)
            both_ms = _timing.time_fn(_fwd_bwd(ours_norm, kind, 1e-6), sets)
            rows.append({"op": kind, "residual": has_res, "elems_per_thread": ept, "bwd_programs_per_sm": per_sm,
                         "warps": tri.fused_config(shape[-1])[2], "fwd_ms": fwd_ms, "fwd+bwd_ms": both_ms,
                         "fwd_speedup": xla["fwd"] / fwd_ms, "fwd+bwd_speedup": xla["fwd+bwd"] / both_ms})  # fmt: skip
    finally:
        tri.ELEMS_PER_THREAD, tri.BWD_PROGRAMS_PER_SM = default
    return rows


def check_once(kind, shape, dtype, has_res):
    """Largest difference between ours and XLA on one case (printed next to the table)."""
    sets, _ = _arg_sets(shape, dtype, kind, has_res)
    x, g, b, r, dy, dh = sets[0]
    a = jax.tree.leaves(_fwd_bwd(ours_norm, kind, 1e-6)(x, g, b, r, dy, dh))
    e = jax.tree.leaves(_fwd_bwd(xla_norm, kind, 1e-6)(x, g, b, r, dy, dh))
    return max(float(jnp.max(jnp.abs(p.astype(F32) - q.astype(F32))) / (jnp.max(jnp.abs(q.astype(F32))) + 1e-6))
               for p, q in zip(a, e, strict=True))  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--target-only", action="store_true", help="only the issue's [16384, 4096] bf16 cases")
    args = ap.parse_args()
    why = norm_api.FAMILY.reason("triton", dtype=jnp.bfloat16, gamma_dtype=F32, rows=1)
    if why is not None:
        print(f"norm benchmark needs the Triton GPU path: {why}")
        return 1
    bf16 = jnp.bfloat16
    target = (1024, 4096) if args.quick else TARGET_SHAPE
    cases = [(kind, target, bf16, res) for kind in ("rms", "layer") for res in (False, True)]
    if not args.target_only:
        more = [((4096, 1024), bf16), ((2048, 8192), bf16), ((512, 20480), bf16), ((8192, 4096), jnp.float32),
                ((65536, 128), bf16)]  # fmt: skip
        if args.quick:
            more = [((512, 1024), bf16), ((64, 20480), bf16)]
        cases += [(kind, s, d, False) for s, d in more for kind in ("rms", "layer")]
        cases += [("rms", s, d, True) for s, d in more[:2]]
    rows = []
    for case in cases:
        rows += bench_case(*case)
    cols = ["op", "mode", "shape", "dtype", "residual", "ours_ms", "xla_ms", "ours_TBps", "xla_TBps", "speedup"]
    _timing.print_table("rms_norm / layer_norm (te_ops Triton vs XLA fused jnp, same process)", rows, cols)
    sweep_rows = []
    for kind in ("rms", "layer"):
        sweep_rows += sweep(kind, target, bf16, False)
    _timing.print_table(f"launch sweep at {target} bf16 (speedup = XLA ms / ours)", sweep_rows,
                        ["op", "elems_per_thread", "bwd_programs_per_sm", "warps", "fwd_ms", "fwd+bwd_ms",
                         "fwd_speedup", "fwd+bwd_speedup"])  # fmt: skip
    diffs = {f"{k} res={r}": check_once(k, target, bf16, r) for k in ("rms", "layer") for r in (False, True)}
    print("max relative |ours - xla| over outputs and gradients at the target shape:", diffs)
    shape_s = "x".join(map(str, target))
    at_target = [r for r in rows if r["shape"] == shape_s and r["dtype"] == "bfloat16" and r["mode"] == "fwd+bwd"]
    verdict = {f"{r['op']} residual={r['residual']}": {"speedup": r["speedup"], "target": TARGET,
                                                       "met": r["speedup"] >= TARGET} for r in at_target}  # fmt: skip
    print("targets (fwd+bwd):", verdict)
    summary = [{
        "workload": f"{r['op']}{' + residual add' if r['residual'] else ''} {r['shape']} {r['dtype']} {r['mode']}",
        "ours_ms": r["ours_ms"], "alternative": "XLA (fused jnp)", "alternative_ms": r["xla_ms"],
        "headline": r["shape"] == shape_s and r["dtype"] == "bfloat16" and r["mode"] == "fwd+bwd" and not r["residual"],
    } for r in rows]  # fmt: skip
    _timing.write_json("norm", {"rows": rows, "sweep": sweep_rows, "targets": verdict, "max_rel_diff": diffs,
                                "quick": args.quick, "summary": summary})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
