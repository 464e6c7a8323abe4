"""The performance table, generated from the benchmark results files.

Reads ``benchmarks/results/<device>/<op>.json`` (written by ``benchmarks/<op>.py`` through
``benchmarks/_timing.write_json``) and writes:

* README.md, between ``<!-- perf-table:start -->`` and ``<!-- perf-table:end -->``: the headline
  rows (one or two workloads per op);
* docs/performance.md (the whole file): every row, and per op the date, commit, versions and the
  command that produced it.

Each row is: op, workload, our time, the alternative and its time, the speedup (alternative time /
our time, so > 1 means ours is faster), date and commit.

    python scripts/perf_table.py            # rewrite both
    python scripts/perf_table.py --check    # exit 1 (and say which) if either is out of date

A benchmark may put its own rows in the results file as ``"summary": [{"workload": ..., "ours_ms": ...,
"alternative": ..., "alternative_ms": ..., "headline": bool}, ...]``; otherwise the rows are read from
the op's own payload by the reader registered for it below. Standard library only (no JAX import), so
CI runs it anywhere.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
PERF_PAGE = ROOT / "docs" / "performance.md"
START = "<!-- perf-table:start -->"
END = "<!-- perf-table:end -->"
# Ops in table order; results files of other ops follow alphabetically.
OP_ORDER = ("softmax", "norm", "dense", "router", "attention", "permutation", "grouped_dense", "train_moe")


@dataclass(frozen=True)
class Row:
    op: str
    workload: str
    ours_ms: float
    alternative: str
    alternative_ms: float | None
    headline: bool
    run: str | None = None  # "<date> <time> UTC <commit>" of a row merged from another run (summary "run")


# ------------------------------------------------------------------------------------------------
# Readers: results payload of one op -> rows
# ------------------------------------------------------------------------------------------------


def _softmax(d: dict) -> Iterator[Row]:
    for r in d["rows"]:
        variant = {"masked-causal": "scaled_masked_softmax (causal mask)",
                   "upper-triang": "scaled_upper_triang_masked_softmax"}.get(r["variant"], r["variant"])  # fmt: skip
        workload = f"{variant} {r['shape']} {r['dtype']} {r['mode']}"
        yield Row("softmax", workload, r["ours_ms"], "XLA (jax.nn.softmax)", r.get("xla_ms"),
                  r["variant"] == "masked-causal")  # fmt: skip


def _dense(d: dict) -> Iterator[Row]:
    dtype = d.get("dtype", "")
    for r in d["rows"]:
        stage = {"forward": "fwd", "forward+backward": "fwd+bwd"}.get(r["stage"], r["stage"])
        # The benchmark's "gelu" is the tanh approximation (what its XLA baseline, jax.nn.gelu, computes).
        case = r["case"].replace("+gelu", "+gelu_tanh")
        workload = f"{case} {dtype} {stage}".replace("  ", " ")
        yield Row("dense", workload, r["ours_ms"], "XLA (jnp.matmul + epilogue)", r.get("xla_ms"),
                  r["case"].startswith("mlp"))  # fmt: skip


def _router(d: dict) -> Iterator[Row]:
    for r in d["rows"]:
        # The alternative is the faster of two jnp formulations (the benchmark's own XLA composition
        # and te_ops' pure-JAX reference), both compiled by XLA.
        alts = {"XLA (jnp top-k)": r.get("xla_ms"), "XLA (te_ops reference path)": r.get("te_reference_ms")}
        alts = {k: v for k, v in alts.items() if v is not None}
        name, alt = min(alts.items(), key=lambda kv: kv[1]) if alts else ("XLA", None)
        case = r["case"].replace(" (issue target)", "")
        workload = f"{case} {r['shape']} {r['dtype']} {r['mode']}"
        yield Row("router", workload, r["ours_ms"], name, alt,
                  "(issue target)" in r["case"] and r["mode"] == "fwd+bwd")  # fmt: skip


def _attention(d: dict) -> Iterator[Row]:
    for r in d["rows"]:
        case = r["case"].replace(" (issue target)", "").replace(" causal", "")
        workload = f"{case} {r['shape']} {r['dtype']} {r['mode']}"
        yield Row("attention", workload, r["ours_ms"], "cuDNN via jax.nn.dot_product_attention", r.get("cudnn_ms"),
                  "(issue target)" in r["case"])  # fmt: skip
        if r.get("xla_ms") is not None:
            yield Row("attention", workload, r["ours_ms"], "XLA (jax.nn.dot_product_attention)", r["xla_ms"], False)


def _permutation(d: dict) -> Iterator[Row]:
    names = {"dispatch_fwd": "token_dispatch fwd", "combine_fwd": "token_combine fwd",
             "dispatch_combine_fwd_bwd": "dispatch + combine fwd+bwd"}  # fmt: skip
    for i, w in enumerate(d["workloads"]):
        shape = f"T{w['T']} H{w['H']} E{w['E']} K{w['K']} {w['dtype']}"
        by_op: dict[str, dict[str, float]] = {}
        for r in w["rows"]:
            by_op.setdefault(r["op"], {})[r["impl"]] = r["ms"]
        for op, ms in by_op.items():
            ours = "triton" if "triton" in ms else next((k for k in ms if k != "xla"), None)
            if ours is None:
                continue
            yield Row("permutation", f"{names.get(op, op)} {shape} ({ours})", ms[ours],
                      "XLA (argsort + gather / scatter-add)", ms.get("xla"), i == 0)  # fmt: skip


def _grouped_dense(d: dict) -> Iterator[Row]:
    dtype = d.get("dtype", "")
    table: dict[tuple[str, str], dict[str, float]] = {}
    for r in d["rows"]:
        if r.get("ms") is not None:
            table.setdefault((r["case"], r["stage"]), {})[r["impl"]] = r["ms"]
    for i, ((case, stage), ms) in enumerate(table.items()):
        ours = next((v for k, v in ms.items() if k.startswith("ours")), None)
        if ours is None:
            continue
        st = {"forward": "fwd", "forward+backward": "fwd+bwd"}.get(stage, stage)
        for alt in ("jax.lax.ragged_dot", "batched einsum (equal groups)"):
            if alt in ms:
                # ragged_dot is a dense expansion on GPU, a weak alternative: docs page only
                headline = i < 2 and alt != "jax.lax.ragged_dot"
                yield Row("grouped_dense", f"{case} {dtype} {st}", ours, alt, ms[alt], headline)


def _norm(d: dict) -> Iterator[Row]:
    for r in d["rows"]:
        res = " + residual" if r.get("residual") else ""
        headline = r["mode"] == "fwd+bwd" and r["dtype"] == "bfloat16" and r["shape"] == "16384x4096"
        yield Row("norm", f"{r['op']}{res} {r['mode']} {r['shape']} {r['dtype']}", r["ours_ms"],
                  "XLA (fused jnp)", r.get("xla_ms"), headline)  # fmt: skip


def _train_moe(d: dict) -> Iterator[Row]:
    cfg = d.get("config", {})
    workload = (
        f"MoE LM training step: d{cfg.get('d_model')} L{cfg.get('layers')} "
        f"H{cfg.get('heads')}/KV{cfg.get('kv_heads')} E{cfg.get('experts')} top-{cfg.get('topk')} "
        f"ffn{cfg.get('ffn')} {cfg.get('dtype')}, {d['batch']}x{d['seq']} tokens"
    )
    if "rows" in d:  # one row per baseline: te_layers vs each plain-JAX model, timed in the same process
        for r in d["rows"]:
            if r.get("ours_ms") is not None:
                yield Row("train_moe", workload, r["ours_ms"], r["alternative"], r.get("alternative_ms"),
                          bool(r.get("headline")))  # fmt: skip
        return
    # Earlier layout (before the strong baseline): te_layers and the ragged_dot model as tokens/s. Not a
    # headline: ragged_dot experts are a weak alternative on GPU (docs page only).
    tokens = d["batch"] * d["seq"]
    yield Row("train_moe", workload, tokens / d["te_layers_tokens_per_s"] * 1e3,
              "plain Flax + jnp (XLA attention, argsort dispatch, ragged_dot)",
              tokens / d["baseline_tokens_per_s"] * 1e3, False)  # fmt: skip


READERS: dict[str, Callable[[dict], Iterator[Row]]] = {
    "softmax": _softmax,
    "norm": _norm,
    "dense": _dense,
    "router": _router,
    "attention": _attention,
    "permutation": _permutation,
    "grouped_dense": _grouped_dense,
    "train_moe": _train_moe,
}


def _summary(op: str, d: dict) -> Iterator[Row]:
    for r in d["summary"]:
        yield Row(op, r["workload"], r["ours_ms"], r["alternative"], r.get("alternative_ms"), bool(r.get("headline")),
                  r.get("run"))


# ------------------------------------------------------------------------------------------------
# Loading and rendering
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    op: str
    path: Path
    data: dict
    rows: tuple[Row, ...]


def _op_key(op: str) -> tuple[int, str]:
    return (OP_ORDER.index(op) if op in OP_ORDER else len(OP_ORDER), op)


def load(results_dir: Path = RESULTS) -> dict[str, list[Result]]:
    """{device folder: [Result per op]}; files that no reader understands raise with the file name."""
    out: dict[str, list[Result]] = {}
    for dev_dir in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        results = []
        for path in sorted(dev_dir.glob("*.json")):
            data = json.loads(path.read_text())
            op = data.get("op", path.stem)
            if re.fullmatch(r"train_moe_b\d+", op):  # benchmarks/train_moe.py --batch N: same layout
                op = "train_moe"
            if "summary" in data:
                rows = tuple(_summary(op, data))
            elif op in READERS:
                try:
                    rows = tuple(READERS[op](data))
                except (KeyError, TypeError) as e:
                    raise SystemExit(f"perf_table: cannot read {path.relative_to(ROOT)}: missing {e}") from e
            else:
                continue  # diagnostics (profiles) and ops without a reader are not tabulated
            results.append(Result(op, path, data, rows))
        if results:
            out[dev_dir.name] = sorted(results, key=lambda r: _op_key(r.op))
    return out


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 100 else f"{v:.1f}"


def _speedup(r: Row) -> str:
    if r.alternative_ms is None or not r.ours_ms:
        return "-"
    return f"{r.alternative_ms / r.ours_ms:.2f}x"


def _date(d: dict) -> str:
    return str(d.get("date") or "-").split(" ")[0]


def table(results: list[Result], *, headline_only: bool) -> str:
    lines = [
        "| op | workload | ours (ms) | alternative | alternative (ms) | speedup | date | commit |",
        "|---|---|---:|---|---:|---:|---|---|",
    ]
    for res in results:
        for r in res.rows:
            if headline_only and not r.headline:
                continue
            lines.append(
                f"| {r.op} | {r.workload} | {_ms(r.ours_ms)} | {r.alternative} | {_ms(r.alternative_ms)} | "
                f"{_speedup(r)} | {_date(res.data) if not r.run else r.run.split(' ')[0]} | "
                f"`{res.data.get('commit') or '-' if not r.run else r.run.split(' ')[-1]}` |"
            )
    return "\n".join(lines)


def _device_name(results: list[Result]) -> str:
    return str(results[0].data.get("device") or "unknown device")


def readme_block(loaded: dict[str, list[Result]]) -> str:
    parts = [START, "<!-- Generated by scripts/perf_table.py from benchmarks/results/; do not edit by hand. -->"]
    for dev, results in loaded.items():
        parts += [
            "",
            f"Measured on one {_device_name(results)} (`benchmarks/results/{dev}/`); speedup = alternative time / "
            "our time, both timed in the same process. Every row and the versions: "
            "[docs/performance.md](docs/performance.md).",
            "",
            table(results, headline_only=True),
        ]
    parts += ["", END]
    return "\n".join(parts)


def _versions(d: dict) -> str:
    v = d.get("versions") or {}
    items = [f"{k} {val}" for k, val in v.items() if val is not None]
    missing = [k for k, val in v.items() if val is None]
    text = ", ".join(items) or "-"
    if missing:
        text += f" (not recorded: {', '.join(missing)})"
    return text


def performance_page(loaded: dict[str, list[Result]]) -> str:
    out = [
        "# Performance",
        "",
        "<!-- Generated by scripts/perf_table.py from benchmarks/results/; do not edit by hand. -->",
        "",
        "Each op's benchmark (`benchmarks/<op>.py`) times our implementation and the best XLA / cuDNN / JAX",
        "alternative in the same process, alternating between them round by round, and writes one results file",
        "per op and device, `benchmarks/results/<device>/<op>.json`, replaced by every run. This page and the",
        "table in the README are generated from those files by `python scripts/perf_table.py` (CI runs it",
        "with `--check`, which fails when either is out of date).",
        "",
        "Speedup = alternative time / our time: above 1.00x ours is faster. Times are medians over timing",
        "rounds, in milliseconds; \"fwd+bwd\" is one forward and one backward pass.",
        "How to produce new numbers: [Developers: GPU script](gpu_script.md).",
    ]
    if not loaded:
        out += ["", "No results files yet."]
    for dev, results in loaded.items():
        heading = f"## {_device_name(results)} (`benchmarks/results/{dev}/`)"
        out += ["", heading, "", table(results, headline_only=False)]
        out += ["", "### Where each file comes from", "", "| op | date | commit | versions | produced by |",
                "|---|---|---|---|---|"]  # fmt: skip
        for res in results:
            d = res.data
            commit = f"`{d.get('commit') or '-'}`"
            if d.get("commit_note"):
                commit += f" ({d['commit_note']})"
            out.append(
                f"| {res.op} | {d.get('date') or '-'} | {commit} | {_versions(d)} | {d.get('source') or '-'} |"
            )
    return "\n".join(out) + "\n"


def render_readme(text: str, block: str) -> str:
    if START not in text or END not in text:
        raise SystemExit(f"perf_table: README.md has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + block + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md or docs/performance.md is stale")
    args = ap.parse_args(argv)
    loaded = load()
    targets = {
        README: render_readme(README.read_text(), readme_block(loaded)),
        PERF_PAGE: performance_page(loaded),
    }
    stale = [p for p, text in targets.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"perf_table: {p.relative_to(ROOT)} is out of date; run `python scripts/perf_table.py`.")
        return 1 if stale else 0
    for p in stale:
        p.write_text(targets[p])
        print(f"perf_table: wrote {p.relative_to(ROOT)}")
    if not stale:
        print("perf_table: README.md and docs/performance.md are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
