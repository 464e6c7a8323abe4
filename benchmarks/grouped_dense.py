"""Grouped GEMM benchmark: te_ops.grouped_dense (Triton persistent grouped GEMM) vs jax.lax.ragged_dot,
vs torch._grouped_mm (PyTorch's CUTLASS grouped GEMM, when torch is installed: the best grouped GEMM
on Hopper to match) and vs the equal-groups batched einsum (x reshaped [G, M/G, K] @ kernels: the speed of light for a
grouped GEMM of this size), in the same process.

TFLOP/s counts useful FLOPs: 2*M*K*N forward, 3x that for forward+backward (dx, dkernels). Group
sizes are random and uneven (Dirichlet, all > 0, a few small groups) but fixed per case.

A tile-configuration sweep comes first (main case only): every candidate's forward, dx and dkernels
kernels are timed on their own, and the best per kernel is reported (``best``), so one GPU run tells
which configuration to make the default in ``te_ops/grouped_dense/triton.py``; then the public op is
timed with the defaults and with the best combination.

    python benchmarks/grouped_dense.py   # prints tables, writes benchmarks/results/<device>/grouped_dense.json
    python benchmarks/grouped_dense.py --no-sweep --no-ragged
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

from te_ops.grouped_dense import grouped_dense  # noqa: E402
from te_ops.grouped_dense import triton as tri  # noqa: E402

G_ = tri.GemmConfig
W_ = tri.WgradConfig
# (name, fwd/dx config, dkernels config)
CANDIDATES = [  # the first is the current default (the sweep checks the others against it)
    ("128x256x64 w8 s3 gm8", G_(128, 256, 64, 8, 8, 3), W_(128, 256, 64, 8, 8, 3)),
    ("128x256x64 w8 s4 gm8", G_(128, 256, 64, 8, 8, 4), W_(128, 256, 64, 8, 8, 4)),
    ("128x256x64 w8 s3 gm8 flat", G_(128, 256, 64, 8, 8, 3, True), W_(128, 256, 64, 4, 8, 3)),
    ("128x128x64 w4 s4 gm8", G_(128, 128, 64, 8, 4, 4), W_(128, 128, 64, 8, 4, 4)),
    ("128x128x64 w8 s4 gm8 flat", G_(128, 128, 64, 8, 8, 4, True), W_(128, 128, 64, 16, 8, 4)),
    ("128x256x64 w8 s3 gm8 tma", G_(128, 256, 64, 8, 8, 3, USE_TMA=True), W_(128, 256, 64, 8, 8, 3, USE_TMA=True)),
    ("128x256x64 w8 s4 gm8 tma", G_(128, 256, 64, 8, 8, 4, USE_TMA=True), W_(128, 256, 64, 8, 8, 4, USE_TMA=True)),
    (
        "128x256x64 w8 s3 gm8 flat tma",
        G_(128, 256, 64, 8, 8, 3, True, USE_TMA=True),
        W_(128, 256, 64, 4, 8, 3, USE_TMA=True),
    ),
    (
        "128x256x64 w8 s4 gm8 flat tma",
        G_(128, 256, 64, 8, 8, 4, True, USE_TMA=True),
        W_(128, 256, 64, 4, 8, 4, USE_TMA=True),
    ),
    ("128x128x64 w8 s4 gm8 tma", G_(128, 128, 64, 8, 8, 4, USE_TMA=True), W_(128, 128, 64, 8, 8, 4, USE_TMA=True)),
    ("256x128x64 w8 s3 gm8 tma", G_(256, 128, 64, 8, 8, 3, USE_TMA=True), W_(256, 128, 64, 8, 8, 3, USE_TMA=True)),
    ("128x256x128 w8 s2 gm8 tma", G_(128, 256, 128, 8, 8, 2, USE_TMA=True), W_(128, 256, 128, 8, 8, 2, USE_TMA=True)),
    # the Gluon warp-specialized Hopper kernel (forward / dx; the dkernels config is the default's)
    ("ws 128x256x64 s3 gm8", G_(128, 256, 64, 8, 8, 3, GLUON_WS=True), W_(128, 256, 64, 8, 8, 4)),
    ("ws 128x256x64 s3 gm1", G_(128, 256, 64, 1, 8, 3, GLUON_WS=True), W_(128, 256, 64, 8, 8, 4)),
    ("ws 128x128x64 s4 gm8", G_(128, 128, 64, 8, 8, 4, GLUON_WS=True), W_(128, 256, 64, 8, 8, 4)),
    ("ws 128x128x64 s5 gm8", G_(128, 128, 64, 8, 8, 5, GLUON_WS=True), W_(128, 256, 64, 8, 8, 4)),
    # ping-pong: two consumer warpgroups on alternate 128 x 128 tiles
    ("pp 128x128x64 s4 gm8", G_(128, 128, 64, 8, 8, 4, GLUON_WS=True, PINGPONG=True), W_(128, 256, 64, 8, 8, 4)),
    ("pp 128x128x64 s5 gm8", G_(128, 128, 64, 8, 8, 5, GLUON_WS=True, PINGPONG=True), W_(128, 256, 64, 8, 8, 4)),
    ("pp 128x128x64 s4 gm1", G_(128, 128, 64, 1, 8, 4, GLUON_WS=True, PINGPONG=True), W_(128, 256, 64, 8, 8, 4)),
]
# (name, M, K, N, G)
CASES = [
    ("M131072 K4096 N1024 G64", 131072, 4096, 1024, 64),
    ("DeepSeek-like M65536 K7168 N2048 G32", 65536, 7168, 2048, 32),
    # the expert GEMMs of benchmarks/train_moe.py's training step (16 x 1024 tokens, top-2, 16 experts):
    # gate/up projection d1024 -> 2 x 2048 and down projection 2048 -> 1024
    ("train wi M32768 K1024 N4096 G16", 32768, 1024, 4096, 16),
    ("train wo M32768 K2048 N1024 G16", 32768, 2048, 1024, 16),
]
TARGETS = {"M131072 K4096 N1024 G64": {"forward": 570.0, "forward+backward": 500.0}}


def uneven_sizes(m, g, seed=0):
    """Dirichlet sizes, every group > 0, four small groups (1, 7, 33, 100 rows), summing to m."""
    rng = np.random.default_rng(seed)
    small = np.array([1, 7, 33, 100][: max(0, g - 1)])
    rest = m - small.sum()
    w = rng.dirichlet(np.full(g - len(small), 2.0))
    big = np.maximum(1, np.floor(w * rest)).astype(np.int64)
    big[np.argmax(big)] += rest - big.sum()
    sizes = np.concatenate([small, big])
    rng.shuffle(sizes)
    assert sizes.sum() == m and sizes.min() > 0
    return jnp.asarray(sizes, jnp.int32)


def make_args(m, k, n, g, dtype=jnp.bfloat16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(ks[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    dy = jax.random.normal(ks[2], (m, n), jnp.float32).astype(dtype)
    return jax.block_until_ready((x, w, dy))


def fwd_bwd(f):
    def run(x, w, s, dy):
        y, vjp = jax.vjp(lambda x, w: f(x, w, s), x, w)
        return (y, *vjp(dy))

    return run


def ours(x, w, s):
    return grouped_dense(x, w, s, implementation="triton")


def ragged(x, w, s):
    return jax.lax.ragged_dot(x, w, s)


def einsum_equal(x, w, s):
    del s
    g = w.shape[0]
    return jnp.einsum("gmk,gkn->gmn", x.reshape(g, -1, x.shape[1]), w).reshape(x.shape[0], -1)


def rel_err(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6))


def sweep(x, w, s, dy, reps, case=""):
    """Times the forward, dx and dkernels kernels of every candidate on their own."""
    m, k = x.shape
    n = w.shape[2]
    flops = 2.0 * m * k * n
    rows, best, first = [], {}, {}
    for name, gc, wc in CANDIDATES:
        # "_" in a filter matches a space (BENCH_ARGS in scripts/gpu_run.sh are split on spaces)
        if sweep.only and not any(p.replace("_", " ") in name for p in sweep.only):
            continue
        kernels = {
            "fwd": jax.jit(lambda x, w, s, gc=gc: tri.grouped_gemm(x, w, s, None, trans_b=False, cfg=gc)),
            "dx": jax.jit(lambda dy, w, s, gc=gc: tri.grouped_gemm(dy, w, s, None, trans_b=True, cfg=gc)),
            "dkernels": jax.jit(
                lambda x, dy, s, wc=wc: tri.grouped_wgrad(x, dy, s, w.shape[0], cfg=wc, out_dtype=w.dtype)
            ),
        }
        args = {"fwd": (x, w, s), "dx": (dy, w, s), "dkernels": (x, dy, s)}
        for kname, fn in kernels.items():
            row = {"case": case, "config": name, "kernel": kname}
            try:
                out = jax.block_until_ready(fn(*args[kname]))
                if kname not in first:
                    first[kname] = out
                row["rel_diff_vs_first"] = err = rel_err(out, first[kname])
                del out
                t = _timing.time_fn(fn, [args[kname]], repeats=reps[0], calls=reps[1])
                row.update(ms=t, TFLOPs=flops / t / 1e9)
                if err > 1e-2:
                    row["error"] = f"result differs from the first candidate's (max rel diff {err:.2e})"
                elif kname not in best or t < best[kname][1]:
                    best[kname] = (name, t, gc if kname != "dkernels" else wc)
            except Exception as e:  # a candidate that does not compile or launch: report, go on
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                traceback.print_exc()
            rows.append(row)
            print(
                f"sweep {name:24s} {kname:9s} {row.get('ms', float('nan')):8.3f} ms "
                f"{row.get('TFLOPs', float('nan')):7.1f} TFLOP/s {row.get('error', '')}",
                flush=True,
            )
    return rows, best


sweep.only = None


# --- torch._grouped_mm (CUTLASS, in the GPU image's PyTorch) side by side, same process ---------------
# (name, M, K, N, G): equal groups of M / G rows, as measured for the targets, and the same
# shapes with uneven groups.
TORCH_CASES = [
    ("K7168 N4096 G8", 32768, 7168, 4096, 8),
    ("K7168 N4096 G32", 65536, 7168, 4096, 32),
    ("K7168 N4096 G128", 65536, 7168, 4096, 128),
]


def uneven_sizes_aligned(m, g, align=16, seed=0):
    """Dirichlet group sizes (every group >= align rows) that are multiples of ``align`` and sum to m:
    uneven, and valid for torch._grouped_mm's offset alignment."""
    rng = np.random.default_rng(seed)
    units = m // align
    w = rng.dirichlet(np.full(g, 2.0))
    sizes = np.maximum(1, np.floor(w * (units - g)).astype(np.int64) + 1)
    sizes[np.argmax(sizes)] += units - sizes.sum()
    assert sizes.sum() == units and sizes.min() >= 1
    return jnp.asarray(sizes * align, jnp.int32)


def _torch_timer(torch, fn, calls):
    """Mean ms per call of ``calls`` back-to-back calls of a torch function (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _jax_timer(fn, args, calls):
    import time

    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) * 1e3 / calls


def _alternatives(torch, x, w, s, dy, tx, tws, tdy, offs, calls, with_einsum):
    """The timed alternatives of one case: name, stage -> a function timing ``calls`` calls (ms each)."""
    fns = {
        ("ours", "forward"): lambda: _jax_timer(jax.jit(ours), (x, w, s), calls),
        ("ours", "forward+backward"): lambda: _jax_timer(jax.jit(fwd_bwd(ours)), (x, w, s, dy), calls),
    }
    if with_einsum:
        fns[("batched einsum (equal groups)", "forward")] = lambda: _jax_timer(jax.jit(einsum_equal), (x, w, s), calls)
        fns[("batched einsum (equal groups)", "forward+backward")] = lambda: _jax_timer(
            jax.jit(fwd_bwd(einsum_equal)), (x, w, s, dy), calls
        )
    for lay, tw in tws.items():
        fns[(f"torch._grouped_mm ({lay})", "forward")] = lambda tw=tw: _torch_timer(
            torch, lambda: torch._grouped_mm(tx, tw, offs=offs), calls
        )

        def torch_fb(tw=tw):
            a = tx.detach().requires_grad_(True)
            b = tw.detach().requires_grad_(True)

            def step():
                torch._grouped_mm(a, b, offs=offs).backward(tdy)

            return _torch_timer(torch, step, calls)

        fns[(f"torch._grouped_mm ({lay})", "forward+backward")] = torch_fb
    return fns


def _rows(label, ms, flops, err):
    rows = []
    for stage in ("forward", "forward+backward"):
        torch_best = min((t for (impl, st), t in ms.items() if st == stage and impl.startswith("torch")), default=None)
        einsum = ms.get(("batched einsum (equal groups)", stage))
        fl = flops * (3 if stage == "forward+backward" else 1)
        for (impl, st), t in ms.items():
            if st != stage:
                continue
            row = {
                "case": label,
                "impl": impl,
                "stage": stage,
                "ms": t,
                "TFLOPs": fl / t / 1e9,
                "vs_torch_best": (torch_best / t) if torch_best else None,
                "vs_einsum": (einsum / t) if einsum else None,
            }
            if impl == "ours":
                row["max_rel_diff_vs_torch"] = err
                if stage == "forward" and torch_best:
                    row.update(target=">= torch._grouped_mm (best layout)", meets_target=bool(t <= torch_best))
                if stage == "forward+backward" and einsum:
                    row.update(target=">= 0.95x batched einsum", meets_target=bool(einsum / t >= 0.95))
            rows.append(row)
            print(f"{label:34s} {impl:34s} {stage:17s} {t:8.3f} ms {fl / t / 1e9:7.1f} TFLOP/s", flush=True)
    return rows


def torch_side_by_side(repeats, calls):
    """ours vs torch._grouped_mm (row-major and column-major weights; the faster one counts) vs the
    equal-groups batched einsum, forward and forward+backward, rounds interleaved (A B, B A, ...)."""
    try:
        import torch
    except ImportError as e:
        print(f"torch is not importable ({e}): no torch._grouped_mm comparison", flush=True)
        return []
    if not hasattr(torch, "_grouped_mm") or not torch.cuda.is_available():
        print("torch._grouped_mm / CUDA not available in torch: no comparison", flush=True)
        return []
    import statistics

    rows = []
    for ci, (name, m, k, n, g) in enumerate(TORCH_CASES):
        x, w, dy = make_args(m, k, n, g, seed=10 + ci)
        # torch gets the same numbers as JAX
        tx = torch.from_numpy(np.asarray(x.astype(jnp.float32))).to("cuda", torch.bfloat16)
        tw_row = torch.from_numpy(np.asarray(w.astype(jnp.float32))).to("cuda", torch.bfloat16)
        tws = {"row-major w": tw_row, "column-major w": tw_row.transpose(-2, -1).contiguous().transpose(-2, -1)}
        tdy = torch.from_numpy(np.asarray(dy.astype(jnp.float32))).to("cuda", torch.bfloat16)
        for groups in ("equal", "uneven"):
            s = jnp.full((g,), m // g, jnp.int32) if groups == "equal" else uneven_sizes_aligned(m, g, seed=ci)
            offs = torch.tensor(np.cumsum(np.asarray(s)), device="cuda", dtype=torch.int32)
            err = rel_err(jax.jit(ours)(x, w, s), torch._grouped_mm(tx, tw_row, offs=offs).float().cpu().numpy())
            fns = _alternatives(torch, x, w, s, dy, tx, tws, tdy, offs, calls, with_einsum=groups == "equal")
            samples = {}
            for key, f in fns.items():  # warm-up (compiles); a failing alternative is reported and left out
                try:
                    f()
                    samples[key] = []
                except Exception as e:
                    print(f"{name} {groups} {key}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            keys = list(samples)
            for r in range(repeats):
                for key in keys if r % 2 == 0 else reversed(keys):
                    samples[key].append(fns[key]())
            ms = {key: statistics.median(v) for key, v in samples.items()}
            rows += _rows(f"{name} M{m} {groups} groups", ms, 2.0 * m * k * n, err)
        del tx, tws, tw_row, tdy
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--only", default=None, help="substring of a case name")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument(
        "--sweep-on",
        default=None,
        help="comma-separated substrings of the case names to sweep (default: the first case)",
    )
    parser.add_argument("--sweep-only", action="store_true", help="stop after the sweeps")
    parser.add_argument(
        "--candidates",
        default=None,
        help="comma-separated substrings (_ matches a space): sweep only the candidates whose name has one",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the torch._grouped_mm comparison")
    parser.add_argument("--no-ragged", action="store_true", help="skip jax.lax.ragged_dot (a dense expansion: slow)")
    args = parser.parse_args()
    sweep.only = args.candidates.split(",") if args.candidates else None
    why = tri.tb.unavailable_reason()
    if why or jax.devices()[0].platform != "gpu":
        print(f"WARNING: the Triton grouped GEMM cannot run here ({why or 'no GPU'}); nothing to time")
        _timing.write_json("grouped_dense", {"skipped": why or "no GPU"})
        return
    print("defaults:", tri.DEFAULT_FWD, tri.DEFAULT_DX, tri.DEFAULT_WGRAD, "SMs:", tri.num_sms(), flush=True)
    rows, sweep_rows, best_cfg = [], [], None
    torch_rows = [] if args.no_torch else torch_side_by_side(args.repeats, args.calls)
    report.torch_rows = torch_rows
    for ci, (name, m, k, n, g) in enumerate(CASES):
        if args.only and args.only not in name:
            continue
        x, w, dy = make_args(m, k, n, g)
        s = uneven_sizes(m, g, seed=ci)
        s_eq = jnp.full((g,), m // g, jnp.int32)
        flops = 2.0 * m * k * n
        swept = (ci == 0) if args.sweep_on is None else any(p in name for p in args.sweep_on.split(","))
        if swept and not args.no_sweep:
            case_rows, best = sweep(x, w, s, dy, (3, args.calls), case=name)
            sweep_rows += case_rows
            if {"fwd", "dx", "dkernels"} <= set(best):
                best_cfg = (best["fwd"][2], best["dx"][2], best["dkernels"][2])
                print(f"best per kernel at {name}:", {k_: v[0] for k_, v in best.items()}, flush=True)
        if args.sweep_only:
            report(rows, sweep_rows, best_cfg, final=False)
            continue
        variants = [("ours (defaults)", None)]
        if best_cfg is not None:
            variants.append(("ours (best per kernel)", best_cfg))
        # correctness sanity: equal groups vs the batched einsum
        err_f = rel_err(jax.jit(ours)(x, w, s_eq), jax.jit(einsum_equal)(x, w, s_eq))
        fb_o, fb_e = jax.jit(fwd_bwd(ours))(x, w, s_eq, dy), jax.jit(fwd_bwd(einsum_equal))(x, w, s_eq, dy)
        err_b = max(rel_err(a, b) for a, b in zip(fb_o, fb_e, strict=True))
        del fb_o, fb_e
        print(f"{name}: max rel diff vs einsum (equal groups) fwd {err_f:.2e} fwd+bwd {err_b:.2e}", flush=True)
        timings = {}
        for vname, cfg in variants:
            for stage, maker, arg_set, fl in (
                ("forward", lambda f: f, (x, w, s), flops),
                ("forward+backward", fwd_bwd, (x, w, s, dy), 3 * flops),
            ):
                if cfg is not None:
                    with tri.config_override(*cfg):
                        fn = jax.jit(maker(lambda x, w, s: ours(x, w, s)))
                        fn = fn.lower(*arg_set).compile()
                else:
                    fn = jax.jit(maker(ours))
                timings[(vname, stage)] = (
                    _timing.time_fn(fn, [arg_set], repeats=args.repeats, calls=args.calls),
                    fl,
                )
        for vname, f, reps in (
            ("batched einsum (equal groups)", einsum_equal, (args.repeats, args.calls)),
            ("jax.lax.ragged_dot", ragged, (2, 2)),
        ):
            if vname.startswith("jax.lax") and args.no_ragged:
                continue
            for stage, maker, arg_set, fl in (
                ("forward", lambda f: f, (x, w, s), flops),
                ("forward+backward", fwd_bwd, (x, w, s, dy), 3 * flops),
            ):
                try:
                    fn = jax.jit(maker(f))
                    timings[(vname, stage)] = (
                        _timing.time_fn(fn, [arg_set], warmup=1, repeats=reps[0], calls=reps[1]),
                        fl,
                    )
                except Exception as e:
                    print(f"{vname} {stage} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        base = {
            st: timings.get(("batched einsum (equal groups)", st), (None,))[0] for st in ("forward", "forward+backward")
        }
        for (vname, stage), (t, fl) in timings.items():
            target = TARGETS.get(name, {}).get(stage) if vname.startswith("ours") else None
            tf = fl / t / 1e9
            rows.append(
                {
                    "case": name,
                    "impl": vname,
                    "stage": stage,
                    "ms": t,
                    "TFLOPs": tf,
                    "vs_einsum": (base[stage] / t) if base[stage] else None,
                    "target_TFLOPs": target,
                    "meets_target": None if target is None else bool(tf >= target),
                    "max_rel_diff_vs_einsum": (err_f if stage == "forward" else err_b)
                    if vname.startswith("ours")
                    else None,
                }
            )
            print(f"{name:38s} {vname:30s} {stage:17s} {t:9.3f} ms {tf:7.1f} TFLOP/s", flush=True)
        del x, w, dy
        report(rows, sweep_rows, best_cfg, final=False)  # partial results survive a timeout
    report(rows, sweep_rows, best_cfg, final=True)


def report(rows, sweep_rows, best_cfg, final):
    best_json = None
    if best_cfg is not None:
        best_json = {k_: dataclasses.asdict(c) for k_, c in zip(("fwd", "dx", "dkernels"), best_cfg, strict=True)}
    if final:
        cols = ["case", "impl", "stage", "ms", "TFLOPs", "vs_einsum", "target_TFLOPs", "meets_target"]
        _timing.print_table("grouped_dense (bf16)", rows, cols)
        if getattr(report, "torch_rows", None):
            _timing.print_table(
                "grouped_dense vs torch._grouped_mm (bf16)",
                report.torch_rows,
                ["case", "impl", "stage", "ms", "TFLOPs", "vs_torch_best", "vs_einsum", "meets_target"],
            )
        if sweep_rows:
            _timing.print_table(
                "tile-configuration sweep",
                sweep_rows,
                ["case", "config", "kernel", "ms", "TFLOPs", "rel_diff_vs_first", "error"],
            )
        if best_json:
            print(
                "best configuration per kernel (make it the default in te_ops/grouped_dense/triton.py):",
                best_json,
            )
    _timing.write_json(
        "grouped_dense",
        {
            "dtype": "bfloat16",
            "complete": final,
            "rows": rows,
            "torch_rows": getattr(report, "torch_rows", []),
            "sweep": sweep_rows,
            "best": best_json,
            "defaults": {
                "fwd": dataclasses.asdict(tri.DEFAULT_FWD),
                "dx": dataclasses.asdict(tri.DEFAULT_DX),
                "dkernels": dataclasses.asdict(tri.DEFAULT_WGRAD),
            },
        },
    )


if __name__ == "__main__":
    main()
