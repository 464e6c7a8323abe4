"""Examples run at small sizes and produce the numbers they claim."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_attention_scores_example_matches_jax():
    proc = subprocess.run(
        [sys.executable, "examples/attention_scores.py", "--seq", "32", "--heads", "2", "--dim", "16"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = float(re.search(r"dot_product_attention\|=([0-9.e+-]+)", proc.stdout).group(1))
    assert err < 5e-2, proc.stdout  # bf16 inputs
