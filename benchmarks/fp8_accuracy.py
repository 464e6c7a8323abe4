"""FP8 training accuracy: examples/train_moe.py trained once per FP8 recipe (none = bf16, current, delayed,
block), the same model, seed and batches, with the validation loss on the held-out split compared to bf16.

Bar (issue "FP8 on Hopper"): over 1000 training steps on the example's real-text corpus (CPython's
documentation, examples/python_docs_corpus.py), the validation loss of each FP8 recipe within 1% of bf16
(mean of the last 50 steps), no NaN, curves in the results.

"Mean of the last 50 steps" is measured two ways; the bar uses the first:

* validation: the mean of the validation losses evaluated at steps ``s > steps - 50`` (with ``--eval-every
  10`` and 1000 steps: steps 960, 970, 980, 990, 1000; every evaluation scores the same ``--eval-tokens``
  held-out bytes);
* training: the mean training cross-entropy of steps ``steps - 49 .. steps`` (the batches differ step to
  step but are the same for every recipe).

Relative difference: ``(fp8 - bf16) / bf16``; ``within_1pct``: ``|relative difference| <= 0.01``. ``no_nan``:
every training loss and every validation loss of the run is finite (no NaN, no Inf). Each recipe runs
``examples/train_moe.py``'s ``main()`` in this process (``--dtype bfloat16 --no-checkpoint``, outputs into a
temporary folder); a recipe that raises is recorded with its error and the others still run.

    python benchmarks/fp8_accuracy.py                          # 4 recipes x 1000 steps, d512 L4 E8 top-2 ffn1024
    python benchmarks/fp8_accuracy.py --recipes none,block     # a subset
    python benchmarks/fp8_accuracy.py --recipes current,delayed --merge benchmarks/results/h200/fp8_accuracy.json
    python benchmarks/fp8_accuracy.py --tiny                   # CPU smoke test of this script

Writes results/<device>/fp8_accuracy.json (``$TE_BENCH_OUT`` overrides the folder; ``--tiny``: /tmp) with
the full validation curve and the training loss every 5th step of each recipe, and, when matplotlib is
installed, fp8_accuracy.png (all recipes' curves) next to it. Both are rewritten after every recipe
(``"complete": false`` until the last), so a run stopped part way keeps the recipes it finished.
``--merge JSON`` keeps the recipes of an earlier run of the same configuration that this one does not run
(the bar is computed over all of them), for measuring the recipes in separate invocations.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import traceback

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _timing  # noqa: E402
from _example import load_example  # noqa: E402  (also this module's API: tests call fa.load_example)

RECIPES = ("none", "current", "delayed", "block")
REFERENCE = "none"  # bf16: what every FP8 recipe is compared with
THRESHOLD = 0.01
FIRST_LOSSES = 20  # the first training losses of each run, stored exactly (every step)

# The GPU run. Block scaling quantizes 1x128 / 128x128 blocks: every GEMM dimension it scales (d_model, the
# qkv width (heads + 2 kv_heads) * head_dim, ffn and 2 ffn) is a multiple of 128.
DEFAULTS = dict(steps=1000, batch=32, seq=512, d_model=512, layers=4, heads=8, kv_heads=4, experts=8, topk=2,
                ffn=1024, eval_every=10, eval_tokens=65536, warmup=50, lr=3e-3, dtype="bfloat16", seed=0,
                last_steps=50, train_every=5)  # fmt: skip
# --tiny: a CPU smoke test of this script (seconds per recipe), the dimensions still valid for block scaling.
TINY = dict(DEFAULTS, steps=12, batch=4, seq=64, d_model=128, layers=1, heads=4, kv_heads=2, experts=4, ffn=128,
            eval_every=4, eval_tokens=512, warmup=3, last_steps=8, train_every=2)  # fmt: skip
# The settings passed to the example as --flags, in its spelling.
EXAMPLE_KEYS = ("steps", "batch", "seq", "d_model", "layers", "heads", "kv_heads", "experts", "topk", "ffn",
                "eval_every", "eval_tokens", "warmup", "lr", "dtype", "seed")  # fmt: skip


def add_model_args(ap: argparse.ArgumentParser, defaults: dict) -> None:
    """The run's settings as --flags (default None: taken from ``defaults``, or from TINY with --tiny)."""
    for key, value in defaults.items():
        if key in ("last_steps", "train_every"):
            continue
        kind = float if key == "lr" else str if key == "dtype" else int
        choices = ["float32", "bfloat16"] if key == "dtype" else None
        ap.add_argument("--" + key.replace("_", "-"), type=kind, default=None, choices=choices,
                        help=f"default {value}")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: a tiny model and a few steps")


def resolve(args: argparse.Namespace, defaults: dict, tiny: dict) -> dict:
    """The run's settings: the flags given, the rest from ``tiny`` (--tiny) or ``defaults``."""
    base = tiny if args.tiny else defaults
    cfg = {k: (getattr(args, k, None) if getattr(args, k, None) is not None else v) for k, v in base.items()}
    for k in ("steps", "batch", "seq", "eval_every", "eval_tokens", "last_steps", "train_every"):
        if cfg[k] < 1:
            raise SystemExit(f"--{k.replace('_', '-')} must be >= 1, got {cfg[k]}")
    return cfg


def example_argv(cfg: dict, recipe: str, out: str) -> list[str]:
    """examples/train_moe.py's command line for ``cfg`` and ``--fp8 recipe`` (no checkpoint, outputs in ``out``)."""
    argv = []
    for k in EXAMPLE_KEYS:
        argv += ["--" + k.replace("_", "-"), str(cfg[k])]
    return argv + ["--fp8", recipe, "--no-checkpoint", "--out", out]


@contextlib.contextmanager
def without_plot_if_no_matplotlib(ex):
    """The example always draws its loss curve; without matplotlib that would fail the run after training,
    so the drawing is skipped then (the curves are in the JSON)."""
    if importlib.util.find_spec("matplotlib") is not None:
        yield
        return
    saved = ex.plot_losses
    ex.plot_losses = lambda *a, **k: None
    try:
        yield
    finally:
        ex.plot_losses = saved


def finite(x) -> bool:
    return x is not None and math.isfinite(x)


def num(x):
    """A float for the JSON: None for NaN / Inf (strict JSON has neither; ``no_nan`` says which)."""
    return float(x) if finite(x) else None


def rel_diff(value, ref):
    """``(value - ref) / ref``, None when either is missing or not finite."""
    if not (finite(value) and finite(ref)) or ref == 0:
        return None
    return (value - ref) / ref


def downsample(losses: list[float], every: int) -> list[list]:
    """``[[step, loss], ...]`` for step 1, every ``every``-th step and the last step (steps count from 1)."""
    n = len(losses)
    keep = sorted({1, n, *range(every, n + 1, every)} & set(range(1, n + 1)))
    return [[s, num(losses[s - 1])] for s in keep]


def summarize(summary: dict, cfg: dict) -> dict:
    """The record of one recipe's run from the example's summary: the last-steps means, finiteness, curves."""
    steps, last = cfg["steps"], min(cfg["last_steps"], cfg["steps"])
    losses = [float(v) for v in summary["losses"]]
    val = [(int(s), float(v)) for s, v in summary["val_curve"]]
    cut = steps - last
    val_last = [(s, v) for s, v in val if s > cut]
    bad_train = [i + 1 for i, v in enumerate(losses) if not math.isfinite(v)]
    bad_val = [s for s, v in val if not math.isfinite(v)]
    return {
        "final_val_loss": num(val[-1][1]),
        "val_loss_last_mean": num(float(np.mean([v for _, v in val_last]))) if val_last else None,
        "val_steps_in_mean": [s for s, _ in val_last],
        "train_loss_last_mean": num(float(np.mean(losses[-last:]))),
        "train_steps_in_mean": [steps - last + 1, steps],
        "first_loss": num(summary.get("first_loss")),
        "last_loss": num(summary.get("last_loss")),
        "no_nan": not bad_train and not bad_val,
        "nonfinite_train_steps": bad_train[:20],
        "nonfinite_train_count": len(bad_train),
        "nonfinite_val_steps": bad_val[:20],
        "tokens_per_s": num(summary.get("tokens_per_s")),
        "train_s": num(summary.get("seconds")),
        "params": summary.get("params"),
        "val_curve": [[s, num(v)] for s, v in val],
        "train_curve": downsample(losses, cfg["train_every"]),
        "train_losses_first": [num(v) for v in losses[:FIRST_LOSSES]],
    }


def run_recipe(ex, cfg: dict, recipe: str, tmp: str) -> dict:
    """One recipe's run of the example; ``error`` set (and the traceback printed) when it raised."""
    argv = example_argv(cfg, recipe, os.path.join(tmp, recipe))
    rec = {
        "recipe": recipe,
        "label": ex.describe_fp8(recipe),
        "example_argv": argv,
        "error": None,
        "measured": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": _timing.commit()},
    }
    print(f"\n=== --fp8 {recipe}: python examples/train_moe.py {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    try:
        with without_plot_if_no_matplotlib(ex):
            summary = ex.main(argv)
        rec.update(summarize(summary, cfg))
        rec["corpus"] = {k: summary["corpus"].get(k) for k in ("dir", "train_bytes", "valid_bytes", "python")
                         if k in summary["corpus"]}  # fmt: skip
    except (Exception, SystemExit) as e:  # one failing recipe (OOM, an unsupported kernel) must not hide the others
        traceback.print_exc()
        rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        print(f"--fp8 {recipe}: FAILED {rec['error'][:300]}", flush=True)
    rec["wall_s"] = time.perf_counter() - t0
    gc.collect()
    jax.clear_caches()  # this recipe's executables are not needed again
    return rec


def compare(records: dict[str, dict], threshold: float = THRESHOLD) -> dict:
    """Adds the relative differences vs the reference to every record; returns the ``bar`` block."""
    ref = records.get(REFERENCE)
    ref_ok = ref is not None and ref["error"] is None
    out = {}
    for name, rec in records.items():
        if rec["error"] is None:
            rec["rel_diff_val_vs_bf16"] = (
                rel_diff(rec["val_loss_last_mean"], ref["val_loss_last_mean"]) if ref_ok else None
            )
            rec["rel_diff_train_vs_bf16"] = (
                rel_diff(rec["train_loss_last_mean"], ref["train_loss_last_mean"]) if ref_ok else None
            )
        entry = {"error": rec["error"] is not None, "no_nan": rec.get("no_nan") if rec["error"] is None else None}
        if name != REFERENCE:
            rd = rec.get("rel_diff_val_vs_bf16")
            entry["rel_diff_val"] = rd
            if rec["error"] is not None or not ref_ok:
                entry["within_1pct"] = None  # not measured
            else:
                entry["within_1pct"] = bool(rd is not None and abs(rd) <= threshold)
        out[name] = entry
    fp8 = [n for n in records if n != REFERENCE]
    measured = ref_ok and bool(fp8)
    passed = None
    if measured:
        passed = all(
            not out[n]["error"] and out[n]["no_nan"] and (n == REFERENCE or out[n]["within_1pct"]) for n in records
        )
    return {
        "criterion": f"|mean val loss (evaluations at steps > steps - last_steps) of the FP8 recipe / that of bf16 "
        f"- 1| <= {threshold}, and every training and validation loss finite",
        "threshold": threshold,
        "reference": REFERENCE,
        "recipes": out,
        "passed": passed,
    }


def print_table(records: dict[str, dict], cfg: dict) -> None:
    last = min(cfg["last_steps"], cfg["steps"])
    print(f"\nFP8 accuracy: {cfg['steps']} steps, batch {cfg['batch']} x seq {cfg['seq']}, mean over the last "
          f"{last} steps (validation: evaluations at steps > {cfg['steps'] - last}); relative to --fp8 none "
          "(bf16)")  # fmt: skip
    head = f"  {'recipe':<9}{'val(last)':>10}{'rel':>9}{'train(last)':>12}{'rel':>9}{'val(final)':>11}"
    print(head + f"{'finite':>8}{'tokens/s':>11}{'wall s':>8}  within 1%")
    for name, rec in records.items():
        if rec["error"]:
            print(f"  {name:<9}FAILED: {rec['error'][:120]}")
            continue

        def f(v, pct=False):
            if v is None:
                return "-"
            return f"{100 * v:+.2f}%" if pct else f"{v:.4f}"

        within = (
            "(ref)"
            if name == REFERENCE
            else {True: "yes", False: "NO", None: "-"}[
                None if rec.get("rel_diff_val_vs_bf16") is None else abs(rec["rel_diff_val_vs_bf16"]) <= THRESHOLD
            ]
        )
        tok = "-" if rec["tokens_per_s"] is None else f"{rec['tokens_per_s']:,.0f}"
        print(f"  {name:<9}{f(rec['val_loss_last_mean']):>10}{f(rec.get('rel_diff_val_vs_bf16'), True):>9}"
              f"{f(rec['train_loss_last_mean']):>12}{f(rec.get('rel_diff_train_vs_bf16'), True):>9}"
              f"{f(rec['final_val_loss']):>11}{'yes' if rec['no_nan'] else 'NO':>8}{tok:>11}{rec['wall_s']:>8.1f}"
              f"  {within}")  # fmt: skip


def plot(path: str, records: dict[str, dict], cfg: dict) -> str | None:
    """Validation curves (left) and training losses (right) of every recipe in one PNG; None without
    matplotlib or when drawing fails (the JSON has the curves either way)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (the curves are in the JSON)")
        return None
    try:
        fig, (ax_v, ax_r, ax_t) = plt.subplots(1, 3, figsize=(16, 4))
        ref = records.get(REFERENCE)
        ref_val = dict(ref["val_curve"]) if ref is not None and not ref["error"] else {}
        for name, rec in records.items():
            if rec["error"]:
                continue
            label = "bf16" if name == REFERENCE else f"fp8 {name}"
            vs = [(s, v) for s, v in rec["val_curve"] if v is not None]
            ts = [(s, v) for s, v in rec["train_curve"] if v is not None]
            if vs:
                ax_v.plot(*zip(*vs, strict=True), lw=1.5, label=label)
            if ts:
                ax_t.plot(*zip(*ts, strict=True), lw=1, alpha=0.8, label=label)
            rs = [(s, 100 * (v / ref_val[s] - 1)) for s, v in vs if ref_val.get(s)]
            if rs and name != REFERENCE:
                ax_r.plot(*zip(*rs, strict=True), lw=1.5, label=label)
        ax_r.axhline(0, color="k", lw=0.8)
        for y in (-100 * THRESHOLD, 100 * THRESHOLD):
            ax_r.axhline(y, color="k", lw=0.8, ls="--")
        ce = "cross-entropy (nats / byte)"
        panels = ((ax_v, "validation loss (held-out)", ce),
                  (ax_r, "validation loss vs bf16 (dashed: +-1%)", "relative difference (%)"),
                  (ax_t, f"training loss (every {cfg['train_every']} steps)", ce))  # fmt: skip
        for ax, what, unit in panels:
            ax.set_xlabel("step")
            ax.set_ylabel(unit)
            ax.set_title(what)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        vals = [v for r in records.values() if not r["error"] for _, v in r["val_curve"][len(r["val_curve"]) // 4 :]]
        vals = [v for v in vals if v is not None]
        if vals:  # zoom on the part of the curves where the recipes are compared
            lo, hi = min(vals), max(vals)
            ax_v.set_ylim(lo - 0.05 * (hi - lo + 1e-3), hi + 0.05 * (hi - lo + 1e-3))
        fig.suptitle(f"examples/train_moe.py, {cfg['steps']} steps, batch {cfg['batch']} x {cfg['seq']}, "
                     f"d{cfg['d_model']} L{cfg['layers']} E{cfg['experts']} top-{cfg['topk']}")  # fmt: skip
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    except Exception as e:  # a plot is a convenience; the measurement is in the JSON
        print(f"plot failed: {type(e).__name__}: {e}")
        return None
    print(f"wrote {path}")
    return path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap, DEFAULTS)
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated subset of " + ",".join(RECIPES))
    ap.add_argument("--last-steps", type=int, default=None,
                    help="the means are over the last this many steps (default 50; --tiny: 8)")  # fmt: skip
    ap.add_argument("--train-every", type=int, default=None,
                    help="training loss curve in the JSON: every this many steps (default 5)")  # fmt: skip
    ap.add_argument("--merge", default=None, metavar="JSON",
                    help="an fp8_accuracy.json of the same configuration: its recipes that this run does not run are "
                         "kept, so the four recipes can be measured in separate invocations")  # fmt: skip
    args = ap.parse_args(argv)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in recipes if r not in RECIPES]
    if bad or not recipes:
        ap.error(f"--recipes: unknown {bad}; choose from {','.join(RECIPES)}")
    args.recipe_list = list(dict.fromkeys(recipes))
    return args


def load_previous(path: str | None, cfg: dict, drop: tuple[str, ...]) -> tuple[dict | None, str | None]:
    """``(the results JSON at path, None)`` when its config equals ``cfg`` (the keys in ``drop`` aside), else
    ``(None, why not)``: a run split over several invocations (``--merge``) only combines like with like."""
    if not path:
        return None, None
    if not os.path.exists(path):
        return None, f"--merge {path}: no such file; nothing merged"
    with open(path) as f:
        prev = json.load(f)
    old = {k: v for k, v in prev.get("config", {}).items() if k not in drop}
    new = {k: v for k, v in cfg.items() if k not in drop}
    if old != new:
        diff = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
        return None, f"--merge {path}: another configuration (file vs now: {diff}); nothing merged"
    return prev, None


def main(argv=None):
    args = parse_args(argv)
    cfg = resolve(args, DEFAULTS, TINY)
    prev, merge_note = load_previous(args.merge, cfg, ("recipes",))
    if merge_note:
        print(f"WARNING: {merge_note}")
    ex = load_example()
    records: dict[str, dict] = {}
    if prev is not None:  # the recipes of an earlier invocation that this one does not run again
        records = {r: rec for r, rec in prev["recipes"].items() if r not in args.recipe_list}
        print(f"merging {sorted(records)} from {args.merge}")
    out_dir = os.environ.get("TE_BENCH_OUT") or ("/tmp" if args.tiny else None)
    result = {}
    with tempfile.TemporaryDirectory(prefix="fp8_accuracy_") as tmp:
        for i, recipe in enumerate(args.recipe_list):
            records[recipe] = run_recipe(ex, cfg, recipe, tmp)
            # written after every recipe: a run stopped part way (a time limit, a crash) keeps what it measured
            result = save(records, cfg, out_dir, complete=i == len(args.recipe_list) - 1, merge_note=merge_note,
                          merged_from=args.merge if prev is not None else None)  # fmt: skip
    print_table(result["recipes"], cfg)
    bar = result["bar"]
    print(f"bar ({bar['criterion']}): " + {True: "PASSED", False: "FAILED", None: "not measured"}[bar["passed"]])
    print(f"results: {result['json']}" + (f", {result['png']}" if result["png"] else ""))
    return result


def save(records: dict, cfg: dict, out_dir: str | None, complete: bool, merge_note=None, merged_from=None) -> dict:
    """Writes fp8_accuracy.json (and the PNG) for the recipes run so far; returns the payload."""
    records = {r: records[r] for r in RECIPES if r in records}
    bar = compare(records)
    last = min(cfg["last_steps"], cfg["steps"])
    payload = {
        "config": {**cfg, "recipes": list(records)},
        "complete": complete,
        "merged_from": merged_from,
        "merge_note": merge_note,
        "definitions": {
            "val_loss_last_mean": f"mean of the validation losses at evaluation steps s > {cfg['steps'] - last} "
            f"(steps {cfg['steps'] - last + 1}..{cfg['steps']}; evaluations every {cfg['eval_every']} steps and "
            f"after the last, each over the same {cfg['eval_tokens']} held-out bytes at most); the steps used are "
            "val_steps_in_mean",
            "train_loss_last_mean": f"mean training cross-entropy of steps {cfg['steps'] - last + 1}..{cfg['steps']}",
            "rel_diff": "(recipe - bf16) / bf16 of the mean above",
            "no_nan": "every training loss and validation loss of the run is finite (NaN / Inf stored as null)",
            "train_curve": f"[step, training loss] for step 1, every {cfg['train_every']}th step and the last",
            "train_losses_first": f"the training losses of steps 1..{FIRST_LOSSES}",
            "val_curve": "[step, validation loss], step 0 = before training",
            "complete": "false while recipes of this invocation are still to run",
        },
        "recipes": records,
        "bar": bar,
    }
    path = _timing.write_json("fp8_accuracy", payload, out_dir=out_dir)
    payload["json"] = path
    payload["png"] = plot(os.path.join(os.path.dirname(path), "fp8_accuracy.png"), records, cfg)
    return payload


if __name__ == "__main__":
    main()
