"""Long-run stability of examples/train_moe.py, determinism under XLA command buffers, and peak device memory
of a training step: te_layers against the strong plain-JAX baseline.

Bar (issue "End-to-end on the H200"): a 2000-step bf16 run of the example on the H200 with no NaN/Inf,
identical losses with and without command buffers for the first 20 steps, and peak GPU memory of a
te_layers step reported beside the plain-JAX model's.

* Part A: examples/train_moe.py ``main()`` in this process, 2000 steps, bf16, d512 L4 8/4 heads E8 top-2
  ffn1024, batch 32 x 512, validation every 100 steps. Checks that every training loss and every
  validation loss is finite; records the first/last losses, the validation curve, the training loss
  every 10th step and tokens/s.
* Part B: the first 20 training steps of that same run (the example's ``main()`` with Part A's command
  line and ``--stop-at 20``: the 2000-step schedule, batches and dropout keys, stopped after step 20) in
  fresh processes, one with ``--xla_gpu_enable_command_buffer=`` (command buffers off) and one with
  ``--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1`` (the flags of
  tests/gpu/cmdbuf.py: fusions and te_ops' custom calls in CUDA graphs), each appended to ``$XLA_FLAGS``.
  Passes when the 20 float32 losses are bit-identical. A second run with command buffers off (the control,
  ``--no-cmdbuf-control`` skips it) tells a command-buffer difference from run-to-run nondeterminism.
  So that only command buffers differ, every child (off, on and the control) is made deterministic run to
  run: ``--xla_gpu_deterministic_ops=true`` (XLA's scatter-adds and other atomics made deterministic, and
  te_ops.fused_attention's cuDNN backward, which follows that flag, uses cuDNN's deterministic algorithm)
  and ``--xla_gpu_autotune_level=0`` (no timed GEMM autotuning) are appended too, and the native dense
  op's timed cuBLASLt candidate choice is pinned to candidate 0 (``dense_force_candidate(0)``, as
  tests/gpu/test_concurrency_gpu.py does). On CPU the flags do nothing; the check still runs.
* Part C: peak device memory of a training step, benchmarks/train_moe.py's configuration (d1024 L4 16/4
  heads E16 top-2 ffn2048 bf16, 16 x 1024 tokens) and models (its ``build_models`` and ``Runner``):
  ``te_layers`` and ``strong_cf1.25`` (cuDNN attention, capacity-padded einsum experts, capacity factor
  1.25), each in a fresh process (``XLA_PYTHON_CLIENT_PREALLOCATE=false``) running a few steps, then
  ``memory_stats()["peak_bytes_in_use"]`` of the device (the process's peak: init, optimizer state and the
  steps; null on CPU, whose devices report no memory statistics) and the compiled step's
  ``memory_analysis()`` (argument, output, alias and temporary bytes; on every backend).

Parts B and C run first, then Part A in this process (which sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
for itself too, unless set: the children never compete with a preallocated parent).

    python benchmarks/long_run.py                  # parts A, B, C
    python benchmarks/long_run.py --parts B,C      # a subset
    python benchmarks/long_run.py --parts A --merge benchmarks/results/h200/long_run.json   # add A to B, C
    python benchmarks/long_run.py --tiny           # CPU smoke test of this script

Writes results/<device>/long_run.json (``$TE_BENCH_OUT`` overrides the folder; ``--tiny``: /tmp) after every
part (``"complete": false`` until the last), and exits with status 1 when Part A saw a NaN/Inf, Part B's
losses differ, or a part failed to run (after writing it). ``--merge JSON`` keeps the parts of an earlier
run of the same configuration that this one does not run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

# This process runs Part A after the child processes of B and C; with preallocation (JAX's default: 75% of the
# GPU's memory at the first use) a child started after that would find little memory left.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.abspath(__file__)
sys.path.insert(0, HERE)
import _timing  # noqa: E402
import fp8_accuracy as fa  # noqa: E402
from _example import load_benchmark, load_example  # noqa: E402

PARTS = ("A", "B", "C")
DEFAULTS = dict(fa.DEFAULTS, steps=2000, eval_every=100, last_steps=100, train_every=10)
TINY = dict(fa.TINY, steps=20, eval_every=5, last_steps=5, train_every=2)
# Part B: command buffers off (an empty list) and on, as tests/gpu/cmdbuf.py's CMDBUF_FLAGS.
CMDBUF_OFF = "--xla_gpu_enable_command_buffer="
CMDBUF_ON = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
# Every Part B child: deterministic run to run (XLA's deterministic ops, which te_ops.fused_attention's cuDNN
# backward follows; no timed GEMM autotuning), so that only the command-buffer flags differ between them. The
# child also pins native dense's timed cuBLASLt candidate (cmdbuf_child).
DETERMINISM_FLAGS = "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
DENSE_CANDIDATE = 0
CMDBUF_RUNS = {
    "off": f"{CMDBUF_OFF} {DETERMINISM_FLAGS}",
    "on": f"{CMDBUF_ON} {DETERMINISM_FLAGS}",
    "off_repeat": f"{CMDBUF_OFF} {DETERMINISM_FLAGS}",
}
MEMORY_MODELS = "te_layers,strong_cf1.25"
CHILD_MARK = "LONG_RUN_CHILD "
DEFINITIONS = {
    "part_a": "examples/train_moe.py main() with config (fp8 none); no_nan: every training and validation loss "
    "finite; train_curve: [step, loss] every train_every steps; train_losses_first: steps 1..20 exactly",
    "part_b": "float32 training losses of steps 1..steps in fresh processes, XLA_FLAGS + flags_appended: the "
    "command-buffer flags (off / on) plus, in every run, --xla_gpu_deterministic_ops=true (XLA's deterministic "
    "ops; te_ops.fused_attention's cuDNN backward follows it with cuDNN's deterministic algorithm) and "
    "--xla_gpu_autotune_level=0 (no timed GEMM autotuning), and native dense's cuBLASLt candidate pinned "
    "(dense_candidate_pinned), so that only command buffers differ; identical: off and on bit-identical; "
    "control_off_repeat_identical: off twice; part_a_first_steps_equal: each run vs Part A's first losses "
    "(Part A ran in the parent with its XLA_FLAGS, without these flags; informational)",
    "part_c": "per model a fresh process (XLA_PYTHON_CLIENT_PREALLOCATE=false): init, then memory_steps training "
    "steps; peak_bytes_in_use: device memory_stats() peak of the process (null: backend without statistics); "
    "memory_analysis: the compiled step's, estimated_peak_bytes = argument + output - alias + temp",
}


# ----------------------------------------------------------------------------------------------
# Child processes (hidden modes of this script)
# ----------------------------------------------------------------------------------------------


def cmdbuf_child(cfg: dict, n: int) -> dict:
    """The training losses of steps 1..n of Part A's run: examples/train_moe.py's ``main()`` with Part A's
    command line (``cfg``, ``--fp8 none``) and ``--stop-at n`` (the schedule, batches and dropout keys of the
    ``cfg["steps"]``-step run, stopped after step n)."""
    import jax

    t0 = time.perf_counter()
    pinned = pin_dense_candidate()
    ex = load_example()
    with tempfile.TemporaryDirectory(prefix="long_run_cmdbuf_") as tmp:
        with fa.without_plot_if_no_matplotlib(ex):
            summary = ex.main(fa.example_argv(cfg, "none", tmp) + ["--stop-at", str(n)])
    return {"losses": [float(v) for v in summary["losses"]], "backend": jax.default_backend(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "seconds": time.perf_counter() - t0,
            "dense_candidate_pinned": pinned}  # fmt: skip


def pin_dense_candidate() -> int | None:
    """Pins native dense's cuBLASLt algorithm to candidate DENSE_CANDIDATE instead of the fastest one it times
    (a timing-based choice that can differ between processes), as tests/gpu/test_concurrency_gpu.py does. The
    candidate pinned, or None where the extension (or the hook) is absent, e.g. on CPU."""
    from te_ops._core import native

    cublaslt = native._loaded.get("_native_cublaslt")
    if not hasattr(cublaslt, "dense_force_candidate"):
        return None
    cublaslt.dense_force_candidate(DENSE_CANDIDATE)
    return DENSE_CANDIDATE


def _memory_stats(dev) -> dict | None:
    try:
        stats = dev.memory_stats()
    except Exception:  # a backend without memory statistics
        return None
    return dict(stats) if stats else None


def memory_child(name: str, tiny: bool, steps: int, seed: int) -> dict:
    """Peak device memory of ``steps`` training steps of benchmarks/train_moe.py's model ``name``."""
    import jax
    import jax.numpy as jnp

    ex = load_example()
    bench = load_benchmark(ex)
    base = bench.TINY_CONFIG if tiny else bench.GPU_CONFIG
    batch, seq = (4, 32) if tiny else (16, 1024)  # benchmarks/train_moe.py's defaults
    cfg = dict(base, aux_coeff=1e-2, dropout=0.0, dtype=jnp.dtype(base["dtype"]))  # as its main() builds it
    model, label, extra = bench.build_models(cfg, [name])[name]
    train = ex.load_data(None, seq)[0]
    it = ex.batches(train, batch, seq, seed + 1)
    batches = [tuple(jax.device_put(a) for a in next(it)) for _ in range(steps)]
    keys = [jax.random.key(i) for i in range(steps)]
    tx = ex.make_optimizer(3e-3, steps, 30)
    dev = jax.devices()[0]
    before = _memory_stats(dev)
    r = bench.Runner(model, batches, keys, tx, seed, context=bench._context(extra))
    jax.block_until_ready((r.params, r.opt_state))
    resident = _memory_stats(dev)
    with r.context():
        compiled = r.step.lower(r.params, r.opt_state, *batches[0], keys[0]).compile()
    analysis = _memory_analysis(compiled)
    jitted, r.step, ran_with = r.step, compiled, "the analysed executable"  # no second compile
    t0 = time.perf_counter()
    try:
        jax.block_until_ready((r.run(1), r.params, r.opt_state))
    except (TypeError, ValueError) as e:  # arguments the executable rejects (checked before it runs): use jit
        r.step, ran_with = jitted, f"jax.jit (the compiled executable refused the arguments: {e!s:.300})"
        jax.block_until_ready((r.run(1), r.params, r.opt_state))
    if steps > 1:
        jax.block_until_ready((r.run(steps - 1), r.params, r.opt_state))
    after = _memory_stats(dev)
    n_params = sum(int(p.size) for p in jax.tree.leaves(r.params))
    return {
        "model": name,
        "label": label,
        **extra,
        "config": {k: (jnp.dtype(v).name if k == "dtype" else v) for k, v in cfg.items()},
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "params": n_params,
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "losses": [float(c) for c in r.ces],
        "steps_s": time.perf_counter() - t0,
        "peak_bytes_in_use": None if after is None else after.get("peak_bytes_in_use"),
        "bytes_in_use_before_init": None if before is None else before.get("bytes_in_use"),
        "bytes_in_use_after_init": None if resident is None else resident.get("bytes_in_use"),
        "bytes_in_use_after_steps": None if after is None else after.get("bytes_in_use"),
        "bytes_limit": None if after is None else after.get("bytes_limit"),
        "memory_analysis": analysis,
        "steps_ran_with": ran_with,
    }


def _memory_analysis(compiled) -> dict | None:
    """The ``*_in_bytes`` fields of ``compiled.memory_analysis()`` and ``estimated_peak_bytes`` = argument +
    output - alias + temp; ``{"error": ...}`` when the backend cannot say."""
    try:
        ma = compiled.memory_analysis()
        if isinstance(ma, list | tuple):  # one per device in some JAX versions
            ma = ma[0] if ma else None
        if ma is None:
            return None
        out = {k: int(getattr(ma, k)) for k in dir(ma) if k.endswith("_in_bytes") and not k.startswith("_")}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    out["estimated_peak_bytes"] = (
        out.get("argument_size_in_bytes", 0)
        + out.get("output_size_in_bytes", 0)
        - out.get("alias_size_in_bytes", 0)
        + out.get("temp_size_in_bytes", 0)
    )
    return out


def run_child(label: str, argv: list[str], env: dict, timeout: float) -> tuple[dict | None, dict]:
    """Runs this script with ``argv`` in a fresh process; ``(its report or None, {rc, seconds, error})``."""
    t0 = time.perf_counter()
    info = {"argv": argv, "rc": None, "seconds": None, "error": None}
    print(f"  {label}: running in a fresh process ...", flush=True)
    try:
        proc = subprocess.run([sys.executable, SCRIPT, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        info["seconds"] = time.perf_counter() - t0
        info["error"] = f"timed out after {timeout:.0f}s"
        tail = e.stderr or ""
        tail = (tail.decode(errors="replace") if isinstance(tail, bytes) else tail)[-3000:]
        print(f"  {label}: {info['error']}\n{tail}")
        return None, info
    info["seconds"] = time.perf_counter() - t0
    info["rc"] = proc.returncode
    for line in proc.stdout.splitlines():
        if line.startswith(CHILD_MARK):
            return json.loads(line[len(CHILD_MARK) :]), info
    info["error"] = f"no report (exit status {proc.returncode}): {proc.stderr[-1500:]}"
    print(f"  {label}: FAILED (exit status {proc.returncode})\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return None, info


def child_env(extra_flags: str | None = None) -> dict:
    env = dict(os.environ)
    if extra_flags is not None:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + extra_flags).strip()
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def config_argv(cfg: dict) -> list[str]:
    """This script's flags that reproduce ``cfg`` (the example's settings) in a child process."""
    argv = []
    for k in fa.EXAMPLE_KEYS:
        argv += ["--" + k.replace("_", "-"), str(cfg[k])]
    return argv


# ----------------------------------------------------------------------------------------------
# Parts
# ----------------------------------------------------------------------------------------------


def compare_losses(a: list[float] | None, b: list[float] | None) -> dict:
    """Bit equality of two float32 loss lists, the max |a - b| and the first step (1-based) that differs."""
    if a is None or b is None:
        return {"identical": None, "max_abs_diff": None, "first_differing_step": None}
    if len(a) != len(b):
        return {"identical": False, "max_abs_diff": None, "first_differing_step": None, "lengths": [len(a), len(b)]}
    fa32, fb32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    same = fa32.view(np.uint32) == fb32.view(np.uint32)
    diff = np.abs(fa32.astype(np.float64) - fb32.astype(np.float64))
    return {
        "identical": bool(same.all()),
        "max_abs_diff": float(diff.max()) if diff.size and np.isfinite(diff).all() else None,
        "first_differing_step": None if same.all() else int(np.argmin(same)) + 1,
    }


def part_b(cfg: dict, n: int, control: bool, timeout: float) -> dict:
    print(f"\n=== Part B: the first {n} steps in fresh processes, command buffers off and on", flush=True)
    runs = {}
    for name, flags in CMDBUF_RUNS.items():
        if name == "off_repeat" and not control:
            continue
        argv = ["--cmdbuf-child", "--cmdbuf-steps", str(n), *config_argv(cfg)]
        report, info = run_child(f"command buffers {name}", argv, child_env(flags), timeout)
        rep = report or {}
        runs[name] = {
            "flags_appended": flags,
            **info,
            **{k: rep.get(k) for k in ("losses", "xla_flags", "backend", "dense_candidate_pinned")},
        }
        if report is not None:
            print(
                f"  {name:<10} {info['seconds']:.1f}s  losses {report['losses'][0]:.6f} .. {report['losses'][-1]:.6f}"
            )
    cmp = compare_losses(runs["off"]["losses"], runs["on"]["losses"])
    out = {
        "steps": n,
        "runs": runs,
        **cmp,
        "errors": [f"{k}: {r['error']}" for k, r in runs.items() if r["error"]],
    }
    if control:
        ctl = compare_losses(runs["off"]["losses"], runs["off_repeat"]["losses"])
        out["control_off_repeat_identical"] = ctl["identical"]
        out["control_max_abs_diff"] = ctl["max_abs_diff"]
    backends = {r["backend"] for r in runs.values() if r["backend"]}
    if backends and backends != {"gpu"}:
        out["note"] = f"backend {sorted(backends)}: the command-buffer flags have no effect there"
    ctl = f"; control (off twice) identical {out.get('control_off_repeat_identical')}" if control else ""
    print(f"  off vs on: identical {out['identical']}, max |diff| {out['max_abs_diff']}{ctl}")
    return out


def part_c(names: list[str], tiny: bool, steps: int, seed: int, timeout: float) -> dict:
    print(f"\n=== Part C: peak device memory of a training step, {', '.join(names)} (a fresh process each)", flush=True)
    models = {}
    for name in names:
        argv = ["--memory-child", name, "--memory-steps", str(steps), "--seed", str(seed)] + (
            ["--tiny"] if tiny else []
        )
        report, info = run_child(f"memory of {name}", argv, child_env(), timeout)
        models[name] = {"model": name, **info, **(report or {})}
        if report is not None:
            peak = report["peak_bytes_in_use"]
            ma = report["memory_analysis"] or {}
            print(f"  {name:<16} peak {'-' if peak is None else f'{peak / 2**30:.3f} GiB'}  compiled step: temp "
                  f"{ma.get('temp_size_in_bytes', 0) / 2**30:.3f} GiB, arguments "
                  f"{ma.get('argument_size_in_bytes', 0) / 2**30:.3f} GiB")  # fmt: skip
    out = {"models": models, "errors": [f"{k}: {m['error']}" for k, m in models.items() if m["error"]]}
    te, strong = models.get("te_layers"), next((m for k, m in models.items() if k.startswith("strong_cf")), None)
    if te and strong and not te["error"] and not strong["error"]:

        def ratio(a, b):
            return a / b if a is not None and b else None

        ta, sa = te.get("memory_analysis") or {}, strong.get("memory_analysis") or {}
        out["te_layers_vs_" + strong["model"]] = {
            "peak_bytes_ratio": ratio(te["peak_bytes_in_use"], strong["peak_bytes_in_use"]),
            "temp_bytes_ratio": ratio(ta.get("temp_size_in_bytes"), sa.get("temp_size_in_bytes")),
            "estimated_peak_ratio": ratio(ta.get("estimated_peak_bytes"), sa.get("estimated_peak_bytes")),
        }
    if any(m.get("backend") not in (None, "gpu") for m in models.values()):
        out["note"] = "peak_bytes_in_use is null: this backend reports no memory statistics; see memory_analysis"
    return out


def part_a(cfg: dict) -> dict:
    print(f"\n=== Part A: examples/train_moe.py, {cfg['steps']} steps {cfg['dtype']}", flush=True)
    ex = load_example()
    with tempfile.TemporaryDirectory(prefix="long_run_") as tmp:
        rec = fa.run_recipe(ex, cfg, "none", tmp)
    rec.pop("label", None)
    return rec


def judge(payload: dict) -> dict:
    """The bar of the parts that ran: A without NaN/Inf, B bit-identical, C measured; ``passed``: all of them."""
    bar = {}
    if "part_a" in payload:
        a = payload["part_a"]
        bar["a_no_nan_inf"] = a.get("error") is None and a.get("no_nan") is True
    if "part_b" in payload:
        bar["b_identical_losses"] = not payload["part_b"]["errors"] and payload["part_b"]["identical"] is True
    if "part_c" in payload:
        bar["c_memory_reported"] = not payload["part_c"]["errors"]
    bar["passed"] = all(bar.values())
    return bar


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fa.add_model_args(ap, DEFAULTS)
    ap.add_argument("--parts", default="A,B,C", help="comma-separated subset of A, B, C")
    ap.add_argument("--cmdbuf-steps", type=int, default=20,
                    help="Part B: training steps compared (at most --steps, Part A's first steps)")  # fmt: skip
    ap.add_argument("--no-cmdbuf-control", action="store_true",
                    help="Part B: no second run with command buffers off (the nondeterminism control)")  # fmt: skip
    ap.add_argument("--memory-models", default=MEMORY_MODELS,
                    help="Part C: benchmarks/train_moe.py model names, one fresh process each")  # fmt: skip
    ap.add_argument("--memory-steps", type=int, default=3, help="Part C: training steps per model")
    ap.add_argument("--child-timeout", type=float, default=300,
                    help="seconds per child process (a GPU child needs about a minute: compile and a few steps); a "
                         "child past it is killed and recorded as an error")  # fmt: skip
    ap.add_argument("--merge", default=None, metavar="JSON",
                    help="a long_run.json of the same configuration: its parts that this run does not run are kept, "
                         "so the parts can be measured in separate invocations")  # fmt: skip
    ap.add_argument("--cmdbuf-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    parts = [p.strip().upper() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        ap.error(f"--parts: choose from {','.join(PARTS)}, got {args.parts!r}")
    args.part_list = [p for p in PARTS if p in parts]
    for name in ("cmdbuf_steps", "memory_steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    cfg = fa.resolve(args, DEFAULTS, TINY)
    if args.cmdbuf_steps > cfg["steps"]:  # the example's --stop-at ends within its --steps run
        print(f"Part B: --cmdbuf-steps {args.cmdbuf_steps} > --steps {cfg['steps']}: comparing {cfg['steps']} steps")
        args.cmdbuf_steps = cfg["steps"]
    if args.cmdbuf_child:
        print(CHILD_MARK + json.dumps(cmdbuf_child(cfg, args.cmdbuf_steps)), flush=True)
        return None
    if args.memory_child:
        print(CHILD_MARK + json.dumps(memory_child(args.memory_child, args.tiny, args.memory_steps, cfg["seed"])),
              flush=True)  # fmt: skip
        return None

    out_dir = os.environ.get("TE_BENCH_OUT") or ("/tmp" if args.tiny else None)
    prev, merge_note = fa.load_previous(args.merge, cfg, ())
    if merge_note:
        print(f"WARNING: {merge_note}")
    payload = {"config": cfg, "parts": [], "complete": False, "merged_from": args.merge if prev else None,
               "merge_note": merge_note, "definitions": DEFINITIONS}  # fmt: skip
    for part in PARTS:  # the parts of an earlier invocation that this one does not run again
        key = "part_" + part.lower()
        if prev is not None and key in prev and part not in args.part_list:
            payload[key] = prev[key]
            print(f"merging {key} from {args.merge}")

    def save(complete: bool) -> None:
        # written after every part: a run stopped part way (a time limit, a crash) keeps what it measured
        payload["parts"] = [p for p in PARTS if "part_" + p.lower() in payload]
        payload["complete"] = complete
        payload["bar"] = judge(payload)
        record = {k: v for k, v in payload.items() if k != "json"}
        payload["json"] = _timing.write_json("long_run", record, out_dir=out_dir)

    # B and C first: they run in child processes, before this one holds Part A's GPU memory.
    if "B" in args.part_list:
        payload["part_b"] = part_b(cfg, args.cmdbuf_steps, not args.no_cmdbuf_control, args.child_timeout)
        save(complete=False)
    if "C" in args.part_list:
        names = [n.strip() for n in args.memory_models.split(",") if n.strip()]
        payload["part_c"] = part_c(names, args.tiny, args.memory_steps, cfg["seed"], args.child_timeout)
        save(complete=False)
    if "A" in args.part_list:
        try:
            payload["part_a"] = part_a(cfg)
        except Exception as e:  # loading the example failed: still write what B and C measured
            traceback.print_exc()
            payload["part_a"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    a, b = payload.get("part_a"), payload.get("part_b")
    if a is not None and b is not None and a.get("train_losses_first"):
        n = min(len(a["train_losses_first"]), b["steps"])
        # informational: Part A ran in the parent process, with its XLA_FLAGS
        b["part_a_first_steps_equal"] = {
            name: compare_losses(a["train_losses_first"][:n], run["losses"][:n] if run["losses"] else None)["identical"]
            for name, run in b["runs"].items()
        }
    save(complete=True)
    _print_summary(payload)
    print(f"results: {payload['json']}")
    return payload


def _gib(v):
    return "-" if v is None else f"{v / 2**30:.3f} GiB"


def _print_summary(payload: dict) -> None:
    print("\n== long run ==")
    a = payload.get("part_a")
    if a is not None:
        if a.get("error"):
            print(f"  A: FAILED {a['error'][:200]}")
        else:

            def f4(v):
                return "-" if v is None else f"{v:.4f}"

            print(f"  A: {payload['config']['steps']} steps, train loss {f4(a['first_loss'])} -> {f4(a['last_loss'])}, "
                  f"final validation loss {f4(a['final_val_loss'])}, all finite: {a['no_nan']} "
                  f"({a['nonfinite_train_count']} non-finite training losses, non-finite validation at steps "
                  f"{a['nonfinite_val_steps'] or 'none'}), {a['tokens_per_s'] or 0:,.0f} tokens/s, "
                  f"{a['wall_s']:.0f}s")  # fmt: skip
    b = payload.get("part_b")
    if b is not None:
        ctl = b.get("control_off_repeat_identical", "not run")
        print(f"  B: first {b['steps']} losses identical with and without command buffers: {b['identical']} "
              f"(max |diff| {b['max_abs_diff']}); control, off twice, identical: {ctl}; errors "
              f"{b['errors'] or 'none'}")  # fmt: skip
    c = payload.get("part_c")
    if c is not None:
        for name, m in c["models"].items():
            if m["error"]:
                print(f"  C: {name}: FAILED {m['error'][:200]}")
                continue
            ma = m.get("memory_analysis") or {}
            print(f"  C: {name:<16} peak_bytes_in_use {_gib(m['peak_bytes_in_use'])}, compiled step temp "
                  f"{_gib(ma.get('temp_size_in_bytes'))}, arguments + outputs - aliased + temp "
                  f"{_gib(ma.get('estimated_peak_bytes'))}")  # fmt: skip
        for key, ratios in c.items():
            if key.startswith("te_layers_vs_"):
                print(f"  C: {key}: " + ", ".join(f"{k} {'-' if v is None else f'{v:.3f}'}" for k, v in ratios.items()))
    print(f"  bar: {payload['bar']}")


if __name__ == "__main__":
    result = main()
    if result is not None and not result["bar"]["passed"]:
        sys.exit(1)
