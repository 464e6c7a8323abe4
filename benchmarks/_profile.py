"""Kernel-level profiles from a jax.profiler trace (CUPTI): every GPU kernel a jitted function runs,
with its mean time per step, for the *_profile.py benchmarks (from the .xplane.pb); and GPU time per
step by kernel category (GEMM, attention, ...) from the trace.json.gz, for train_moe.py --profile.
Command buffers should be off in the traced process (set XLA_FLAGS before importing jax) so each
kernel shows up on its own."""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
import time

import jax

# Lines of the GPU plane that summarise rather than list kernels.
_SUMMARY_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Launch Stats", "Steps", "Source code", "Framework")


def kernel_events(trace_dir: str) -> list[tuple[str, float, float]]:
    """(kernel name, start ns, duration ns) of every activity on the GPU streams of the trace."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"no xplane.pb under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(paths[0])
    out = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if any(line.name.startswith(s) for s in _SUMMARY_LINES):
                continue
            for ev in line.events:
                out.append((ev.name, float(ev.start_ns), float(ev.duration_ns)))
    return out


def host_events(trace_dir: str) -> list[tuple[str, float, float]]:
    """(event name, start ns, duration ns) of every TraceMe event on the host threads of the trace
    (XLA's thunk execution, the PJRT client, kernel launches)."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    data = jax.profiler.ProfileData.from_file(paths[0])
    out = []
    for plane in data.planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            for ev in line.events:
                out.append((ev.name, float(ev.start_ns), float(ev.duration_ns)))
    return out


def _gaps(events, steps: int, top: int = 8) -> list[dict]:
    """The GPU's idle intervals between consecutive kernels, summed per (kernel before, kernel after)
    pair: where the span exceeds the busy time."""
    evs = sorted(events, key=lambda e: e[1])
    per = collections.defaultdict(lambda: [0, 0.0])
    end, prev = None, None
    for name, s, d in evs:
        if end is not None and s > end:
            per[(prev, name)][0] += 1
            per[(prev, name)][1] += s - end
        if end is None or s + d >= end:
            end, prev = s + d, name
    rows = [
        {"before": a[:80], "after": b[:80], "gaps_per_step": c / steps, "idle_ms_per_step": t / steps / 1e6}
        for (a, b), (c, t) in per.items()
    ]
    return sorted(rows, key=lambda r: -r["idle_ms_per_step"])[:top]


def _host_top(events, steps: int, top: int = 16) -> list[dict]:
    per = collections.defaultdict(lambda: [0, 0.0])
    for name, _, d in events:
        key = name[:100]
        per[key][0] += 1
        per[key][1] += d
    rows = [{"event": k, "calls_per_step": c / steps, "ms_per_step": t / steps / 1e6} for k, (c, t) in per.items()]
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:top]


def _memory_stats() -> dict:
    """The device allocator's figures (GiB) after the traced steps: in use, peak, limit."""
    try:
        st = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend has them
        return {}
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reserved", "largest_alloc_size")
    return {k: round(st[k] / 2**30, 3) for k in keys if k in st}


def profile(fn, args, steps: int, arg_sets=None) -> dict:
    """Traces ``steps`` back-to-back calls of ``fn`` (after 3 untimed ones): each kernel's mean ms per
    step, the busy time (sum of kernel durations) and the span (first start to last end) per step;
    span - busy is the GPU's idle time between kernels. ``arg_sets`` (optional) rotates several
    argument tuples call by call, as the timing benchmarks do; otherwise every call gets ``args``."""
    sets = list(arg_sets) if arg_sets else [args]
    for i in range(3):
        jax.block_until_ready(fn(*sets[i % len(sets)]))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            out = None
            t_start = time.perf_counter()
            for i in range(steps):
                out = fn(*sets[i % len(sets)])
            t_dispatch = time.perf_counter() - t_start
            jax.block_until_ready(out)
            t_total = time.perf_counter() - t_start
        events = kernel_events(d)
        hosts = host_events(d)
    if not events:
        return {"kernels": [], "busy_ms": None, "span_ms": None}
    per = collections.defaultdict(lambda: [0, 0.0])
    for name, _, dur in events:
        per[name][0] += 1
        per[name][1] += dur
    t0 = min(s for _, s, _ in events)
    t1 = max(s + d for _, s, d in events)
    kernels = sorted(
        (
            {
                "kernel": name,
                "calls_per_step": c / steps,
                "ms_per_step": tot / steps / 1e6,
                "ms_per_call": tot / c / 1e6,
            }
            for name, (c, tot) in per.items()
        ),
        key=lambda r: -r["ms_per_step"],
    )
    busy = sum(d for _, _, d in events) / steps / 1e6
    return {
        "kernels": kernels,
        "busy_ms": busy,
        "span_ms": (t1 - t0) / steps / 1e6,
        # host: wall ms per step of the calls alone (dispatch) and until the results were ready
        "host_dispatch_ms": t_dispatch / steps * 1e3,
        "host_total_ms": t_total / steps * 1e3,
        "gaps": _gaps(events, steps),
        "memory": _memory_stats(),
        "host_events": _host_top(hosts, steps),
    }


def print_profile(title: str, r: dict) -> None:
    busy = "-" if r["busy_ms"] is None else f"{r['busy_ms']:.3f}"
    span = "-" if r["span_ms"] is None else f"{r['span_ms']:.3f}"
    print(f"\n== {title}: kernels busy {busy} ms/step, span {span} ms/step ==")
    for kr in r["kernels"]:
        print(f"  {kr['ms_per_step']:8.3f} ms  x{kr['calls_per_step']:.1f}  {kr['kernel'][:150]}")
    if r.get("gaps"):
        print(f"  host: {r['host_dispatch_ms']:.3f} ms/step dispatching, {r['host_total_ms']:.3f} ms/step until ready")
        print(f"  memory (GiB): {r.get('memory')}")
        print("  largest GPU idle gaps (per step):")
        for g in r["gaps"]:
            pair = f"{g['before'][:60]} -> {g['after'][:60]}"
            print(f"    {g['idle_ms_per_step']:8.3f} ms  x{g['gaps_per_step']:.1f}  {pair}")
        print("  host events (per step):")
        for h in r["host_events"]:
            print(f"    {h['ms_per_step']:8.3f} ms  x{h['calls_per_step']:.1f}  {h['event']}")


# ------------------------------------------------------------------------------------------------
# Kernel categories from a trace.json.gz (benchmarks/train_moe.py --profile)
# ------------------------------------------------------------------------------------------------
# jax.profiler.trace(..., create_perfetto_trace=True) writes, next to the .xplane.pb, the trace in the
# Chrome trace-event JSON format (<host>.trace.json.gz, and perfetto_trace.json.gz without its
# metadata): "ph": "M" events name the processes ("/device:GPU:0", "/host:CPU") and their threads
# (CUDA streams "Stream #N(...)" and summary lines "XLA Ops", "XLA Modules", ...), "ph": "X" events
# are spans with "ts"/"dur" in microseconds and "args" (the XLA op and its name scope where the
# profiler records them). Reading that needs nothing but the standard library.

CATEGORIES = ("GEMM", "grouped GEMM", "fp8 quantize", "attention", "permutation", "router", "norms",
              "optimizer/elementwise", "other")  # fmt: skip
_TE_OPS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "te_ops")


def _jit_kernel_names(*rel_paths: str) -> frozenset[str]:
    """Names of the ``@triton.jit`` / ``@gluon.jit`` kernels (functions named ``*_kernel``) in te_ops
    source files, read with ``ast`` so the lists follow the sources; a launched Triton kernel keeps
    its Python function name, which is what the trace shows."""
    import ast

    names = set()
    for rel in rel_paths:
        path = os.path.join(_TE_OPS, rel)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and node.decorator_list:
                names.add(node.name)
    return frozenset(names)


GROUPED_GEMM_KERNELS = _jit_kernel_names("grouped_dense/triton_kernels.py", "grouped_dense/gluon_kernels.py")
PERMUTATION_KERNELS = _jit_kernel_names("permutation/triton_kernels.py", "permutation/gluon_kernels.py")
NORM_KERNELS = _jit_kernel_names("normalization/triton_kernels.py")
# te_ops.fp8: the block-scaled GEMMs count as (grouped) GEMM, every other kernel (quantize, amax, cast,
# fused activation backward + quantize) as "fp8 quantize"
_FP8_KERNELS = _jit_kernel_names("fp8/triton_kernels.py", "fp8/gluon_kernels.py", "fp8/gluon_quantize.py")
FP8_GEMM_KERNELS = frozenset(k for k in _FP8_KERNELS if "gemm" in k or "wgrad" in k)
FP8_QUANTIZE_KERNELS = _FP8_KERNELS - FP8_GEMM_KERNELS

_RE = dict(
    # cuDNN fused attention (jax's cudnn path and te_ops.fused_attention: "cudnn_generated_..._sdpa_..."),
    # flash / fmha kernels of other libraries, te_ops' softmax kernels (namespace te::softmax).
    attention=re.compile(r"cudnn|fmha|flash|sdpa|te::softmax|attention", re.I),
    router=re.compile(r"te::router|topk|top_k", re.I),  # te_ops router kernels; XLA's TopK kernel
    norms=re.compile(r"te::norm|rms_?norm|layer_?norm", re.I),
    # cuBLAS / cuBLASLt (sm90_xmma_gemm_*, nvjet_*, cublasLt::splitKreduce), CUTLASS, XLA's Triton GEMM fusions.
    gemm=re.compile(r"gemm|gemv|cublas|cutlass|xmma|nvjet|splitk", re.I),
    other=re.compile(r"^(memcpy|memset)|^cuda(memcpy|memset)", re.I),
    sort=re.compile(r"sort", re.I),
)
# Name-scope path components (jax.named_scope / Flax module names) that place an XLA fusion.
_SCOPE = dict(
    attention=re.compile(r"(^|/)(sdpa|dot_product_attention\w*)(/|$)"),
    router=re.compile(r"(^|/)router(/|$)"),
    permutation=re.compile(r"(^|/)(dispatch|combine|permut\w*)(/|$)"),
    norms=re.compile(r"(^|/)(ln\d*|ln_f|\w*(rms|layer)_?norm\w*)(/|$)", re.I),
)


def _base_name(kernel: str) -> str:
    """``"void ns::Foo<int>(Params)"`` -> ``"Foo"``; a plain name stays as it is."""
    base = kernel.strip()
    if base.startswith("void "):
        base = base[5:]
    return base.split("(")[0].split("<")[0].split("::")[-1].strip()


def _scope_path(scope: str) -> str:
    """Name scopes without JAX's transformation wrappers: ``"jit(step)/transpose(jvp(MoELM))/block0/ln1/mul"``
    -> ``"step/MoELM/block0/ln1/mul"``."""
    return re.sub(r"[A-Za-z_]\w*\(", "", scope).replace(")", "")


def classify_kernel(name: str, scope: str = "") -> str:
    """The category (one of ``CATEGORIES``) of a GPU kernel from its name and, for XLA's own
    kernels, the name scope of the op it came from (``scope``: the event's op-name text, may be "").

    Library and te_ops kernels are placed by name first (cuDNN attention, our Triton grouped GEMM,
    permutation and normalization kernels, te_ops router kernels, cuBLAS/CUTLASS GEMMs); XLA fusions
    (``loop_*_fusion``, ``input_*_fusion``, ...) by the scope of their op: attention core, router,
    dispatch/combine, norms; whatever is left (the optimizer update, activations, casts, residual
    adds, the loss) is optimizer/elementwise.
    """
    base = _base_name(name)
    path = _scope_path(scope)
    if _RE["attention"].search(name):
        return "attention"
    if base in GROUPED_GEMM_KERNELS or (base in FP8_GEMM_KERNELS and base.startswith("grouped")):
        return "grouped GEMM"
    if base in FP8_GEMM_KERNELS:
        return "GEMM"
    if base in FP8_QUANTIZE_KERNELS:
        return "fp8 quantize"
    if base in PERMUTATION_KERNELS:
        return "permutation"
    if _RE["router"].search(name):
        return "router"
    if base in NORM_KERNELS or _RE["norms"].search(name):
        return "norms"
    if _SCOPE["attention"].search(path):
        return "attention"  # XLA attention: its batched GEMMs and softmax fusions
    if _RE["gemm"].search(name):
        return "GEMM"
    if _RE["other"].search(name):
        return "other"
    for cat in ("router", "permutation", "norms"):
        if _SCOPE[cat].search(path):
            return cat
    if _RE["sort"].search(name):
        return "permutation"  # argsort of expert ids (baselines' dispatch)
    return "optimizer/elementwise"


class KernelEvent(tuple):
    """``(name, start_us, dur_us, scope)`` of one kernel on a GPU stream."""

    __slots__ = ()

    def __new__(cls, name: str, start_us: float, dur_us: float, scope: str = ""):
        return super().__new__(cls, (name, float(start_us), float(dur_us), scope))

    name = property(lambda self: self[0])
    start_us = property(lambda self: self[1])
    dur_us = property(lambda self: self[2])
    scope = property(lambda self: self[3])


def _event_scope(args: dict) -> str:
    return " ".join(str(v) for k, v in args.items() if k != "kernel_details" and isinstance(v, str))


def trace_json_events(trace: dict) -> list[KernelEvent]:
    """The kernels on GPU streams of a Chrome trace-event dict (``{"traceEvents": [...]}``)."""
    evs = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    gpu_pids, threads = set(), {}
    for e in evs:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name" and re.search(r"/device:GPU:\d+", str(e.get("args", {}).get("name", ""))):
            gpu_pids.add(e.get("pid"))
        elif e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    lines = {k: v for k, v in threads.items() if k[0] in gpu_pids}
    streams = {k for k, v in lines.items() if v.startswith("Stream")}
    if not streams:  # no stream naming: every GPU line that is not a summary line
        streams = {k for k, v in lines.items() if not any(v.startswith(s) for s in _SUMMARY_LINES)}
    out = []
    for e in evs:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams:
            out.append(KernelEvent(e.get("name", ""), e.get("ts", 0.0), e.get("dur", 0.0),
                                   _event_scope(e.get("args") or {})))  # fmt: skip
    return out


def trace_dir_events(trace_dir: str) -> list[KernelEvent]:
    """:func:`trace_json_events` of the trace.json.gz (or perfetto_trace.json.gz) under ``trace_dir``."""
    import gzip
    import json

    paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    paths = paths or glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise RuntimeError(
            f"no trace.json.gz under {trace_dir}: trace with jax.profiler.trace(..., create_perfetto_trace=True)"
        )
    with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
        return trace_json_events(json.load(f))


def trace_kernels(run, steps: int) -> list[KernelEvent]:
    """Runs ``run()`` (``steps`` steps; returns what to block on) under jax.profiler.trace and returns
    the GPU kernels of the trace (empty without a GPU)."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(run())
        return trace_dir_events(d)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def breakdown(events: list[KernelEvent], steps: int, step_ms: float | None = None) -> dict:
    """GPU time per step by category (``CATEGORIES``) and idle time.

    ``step_ms``: the step time to split (default: the trace's span, first kernel start to last kernel
    end, over ``steps``). Idle = step time - the time at least one kernel runs (overlapping kernels
    on several streams count once), so busy categories + idle can exceed the step time by the overlap.
    ``top`` lists each category's twenty largest kernels (time per step, launches per step and the
    name scope of the first launch, which says where an XLA fusion came from).
    """
    if not events:
        return {"steps": steps, "kernels": 0, "categories": {}, "busy_ms": None, "span_ms": None,
                "step_ms": step_ms, "idle_ms": None, "top": {}}  # fmt: skip
    cat_us = dict.fromkeys(CATEGORIES, 0.0)
    per_kernel: dict[tuple[str, str], float] = collections.defaultdict(float)
    launches: dict[tuple[str, str], int] = collections.defaultdict(int)
    scopes: dict[tuple[str, str], str] = {}
    for ev in events:
        cat = classify_kernel(ev.name, ev.scope)
        cat_us[cat] += ev.dur_us
        per_kernel[(cat, ev.name)] += ev.dur_us
        launches[(cat, ev.name)] += 1
        scopes.setdefault((cat, ev.name), _scope_path(ev.scope))
    t0 = min(ev.start_us for ev in events)
    t1 = max(ev.start_us + ev.dur_us for ev in events)
    span_ms = (t1 - t0) / steps / 1e3
    busy_ms = _union_us([(ev.start_us, ev.start_us + ev.dur_us) for ev in events]) / steps / 1e3
    step = span_ms if step_ms is None else step_ms
    top: dict[str, list] = collections.defaultdict(list)
    for (cat, name), us in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
        if len(top[cat]) < 20:
            top[cat].append({"kernel": name, "ms_per_step": us / steps / 1e3,
                             "launches_per_step": launches[(cat, name)] / steps,
                             "scope": scopes[(cat, name)][:200]})  # fmt: skip
    return {
        "steps": steps,
        "kernels": len(events),
        "categories": {c: us / steps / 1e3 for c, us in cat_us.items()},
        "busy_ms": busy_ms,
        "span_ms": span_ms,
        "step_ms": step,
        "idle_ms": max(step - busy_ms, 0.0),
        "top": dict(top),
    }


def print_breakdown(title: str, r: dict) -> None:
    if not r["kernels"]:
        print(f"\n== {title}: no GPU kernels in the trace (backend {jax.default_backend()}): nothing to break down ==")
        return
    print(f"\n== {title}: {r['step_ms']:.3f} ms/step, kernels busy {r['busy_ms']:.3f} ms/step ==")
    for cat in CATEGORIES:
        ms = r["categories"].get(cat, 0.0)
        share = 100 * ms / r["step_ms"] if r["step_ms"] else 0.0
        print(f"  {cat:<24}{ms:9.3f} ms  {share:5.1f}%")
        for k in r["top"].get(cat, [])[: 10 if cat == "optimizer/elementwise" else 3]:
            scope = f"  [{k['scope'][-60:]}]" if k.get("scope") else ""
            print(f"      {k['ms_per_step']:8.3f} ms  {k['kernel'][:80]}{scope}")
    print(f"  {'idle':<24}{r['idle_ms']:9.3f} ms  {100 * r['idle_ms'] / r['step_ms']:5.1f}%")
