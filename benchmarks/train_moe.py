"""End-to-end benchmark: training tokens/s of the te_layers MoE language model (examples/train_moe.py)
vs the same architecture in plain Flax + jnp (XLA attention, argsort dispatch, ragged_dot experts),
timed in the same process (``examples/train_moe.py --benchmark-only``). Writes train_moe.json.

    python benchmarks/train_moe.py            # the GPU config below
    python benchmarks/train_moe.py --tiny     # CPU smoke test of this script
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import _timing  # noqa: E402
import train_moe  # noqa: E402

# A small Mixtral-like decoder: 4 layers, d_model 1024, 16 query / 4 KV heads (head dim 64),
# 16 experts top-2 with FFN 2048 (gated SiLU), bf16, 16 x 1024 tokens per step.
GPU_ARGS = ["--batch", "16", "--seq", "1024", "--d-model", "1024", "--layers", "4", "--heads", "16",
            "--kv-heads", "4", "--experts", "16", "--topk", "2", "--ffn", "2048", "--dtype", "bfloat16"]  # fmt: skip
TINY_ARGS = ["--batch", "4", "--seq", "32"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=20, help="timed training steps per model")
    args = ap.parse_args()
    cli = (TINY_ARGS if args.tiny else GPU_ARGS) + ["--benchmark-only", "--baseline-steps", str(args.steps)]
    with tempfile.TemporaryDirectory() as out:
        summary = train_moe.main(cli + ["--out", out])
    summary["argv"] = cli
    _timing.write_json("train_moe", summary, out_dir=os.environ.get("TE_BENCH_OUT") or ("/tmp" if args.tiny else None))


if __name__ == "__main__":
    main()
