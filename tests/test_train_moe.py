"""examples/train_moe.py at tiny sizes: the loss falls, and the PNG, checkpoint and baseline timing appear."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_moe_loss_falls(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "examples/train_moe.py", "--steps", "60", "--batch", "8", "--seq", "32", "--d-model", "32",
           "--layers", "1", "--heads", "4", "--kv-heads", "2", "--experts", "4", "--topk", "2", "--ffn", "32",
           "--lr", "1e-2", "--out", str(out), "--baseline", "--baseline-steps", "2"]  # fmt: skip
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", ""))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["last_loss"] < summary["first_loss"] - 1.0, summary  # from ~5.5 (uniform over bytes)
    assert (out / "loss.png").stat().st_size > 1000
    assert summary["checkpoint"] and os.path.exists(summary["checkpoint"])
    assert summary["te_layers_tokens_per_s"] > 0 and summary["baseline_tokens_per_s"] > 0
    assert "tokens/s" in proc.stdout and "baseline" in proc.stdout
