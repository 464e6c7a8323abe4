"""Merge a partial benchmark results file (a run of some FP8_BENCH_SECTIONS) into the committed one:
the new run's rows replace rows with the same identity, the others are kept, every row is tagged with
its run ("<date> <commit>"), and the note says which runs the file holds. Then run
``python scripts/perf_table.py``.

    python scripts/merge_results.py benchmarks/results/h200/fp8.json <fetched>/results/h200/fp8.json \
        "Merged: <what the new run covered>."
"""

import json
import sys

old_path, new_path, note = sys.argv[1], sys.argv[2], sys.argv[3]
old, new = json.load(open(old_path)), json.load(open(new_path))
tag = f"{new['date']} {new['commit']}"
KEYS = {
    "rows": ("case", "shape"),
    "gemm_rows": ("gemm", "impl"),
    "dense_rows": ("impl", "shape"),
    "torch_rows": ("gemm", "impl"),
    "summary": ("workload",),
}
for lst, key in KEYS.items():
    kept = {tuple(r.get(k) for k in key): r for r in old.get(lst, [])}
    for r in old.get(lst, []):
        r.setdefault("run", f"{old['date']} {old['commit']}")
    for r in new.get(lst, []):
        r = dict(r, run=tag)
        kept[tuple(r.get(k) for k in key)] = r
    old[lst] = list(kept.values())
for k in ("date", "commit", "versions", "platform", "xla_flags", "device"):
    old[k] = new.get(k, old.get(k))
old["commit_note"] = note + " " + old.get("commit_note", "")
json.dump(old, open(old_path, "w"), indent=1)
print("merged", {k: len(old[k]) for k in KEYS})
