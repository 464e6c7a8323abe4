"""Kernel-level profile of the fused-attention benchmark cases: every GPU kernel of te_ops'
fused_attention (our cuDNN frontend graphs) next to jax.nn.dot_product_attention(implementation=
"cudnn"), forward and forward+backward, from a jax.profiler trace (benchmarks/_profile.py).

benchmarks/attention.py says which side is faster end to end; this shows the kernels behind it
(cuDNN's kernel names carry the engine configuration, e.g. tile shape and knobs), alternated twice
so clock drift between profiles is visible.

    python benchmarks/attention_profile.py [--steps 10] [--case mha|gqa|both]

Prints one table per (case, side, stage) and writes benchmarks/results/<device>/attention_profile.json.
"""

from __future__ import annotations

import os

if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import argparse  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
import attention as attention_bench  # noqa: E402
from _profile import print_profile, profile  # noqa: E402

from te_ops._core import native as _native  # noqa: E402
from te_ops.fused_attention import native as fa_native  # noqa: E402

# (name, B, S, Hq, Hkv, D): the issue-6 cases of benchmarks/attention.py
CASES = {"mha": ("MHA causal", 4, 4096, 32, 32, 128), "gqa": ("GQA causal", 2, 8192, 32, 8, 128)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20, help="calls per trace (the timing benchmark's window)")
    ap.add_argument("--case", choices=("mha", "gqa", "both"), default="both")
    args = ap.parse_args()
    why = _native.native_unavailable_reason(fa_native.MODULE, "fused_attention")
    if why is not None:
        print(f"attention profile needs the native cuDNN path: {why}")
        return 1
    results = []
    for key in ("mha", "gqa") if args.case == "both" else (args.case,):
        name, b, s, hq, hk, d = CASES[key]
        arg_sets = attention_bench.make_inputs(b, s, hq, hk, d)  # the timing benchmark's inputs
        fns = {side: attention_bench.make_fns(side) for side in ("ours", "cudnn")}
        for stage, idx in (("forward", 0), ("forward+backward", 1)):
            for side in ("ours", "cudnn", "ours", "cudnn"):
                r = profile(fns[side][idx], None, args.steps, arg_sets=arg_sets)
                r.update(case=name, side=side, stage=stage)
                results.append(r)
                print_profile(f"{name} {side} {stage}", r)
    _timing.write_json("attention_profile", {"profiles": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
