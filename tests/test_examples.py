"""Examples run at small sizes and produce the numbers they claim."""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_attention_scores_example_matches_jax():
    proc = subprocess.run(
        [sys.executable, "examples/attention_scores.py", "--seq", "32", "--heads", "2", "--dim", "16"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = float(re.search(r"dot_product_attention\|=([0-9.e+-]+)", proc.stdout).group(1))
    assert err < 5e-2, proc.stdout  # bf16 inputs


def test_python_docs_corpus_split_is_held_out():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import python_docs_corpus as pdc

    train, valid, info = pdc.load()
    manifest = json.loads(open(os.path.join(info["dir"], "manifest.json")).read())
    names_train, names_valid = manifest["documents"]["train"], manifest["documents"]["valid"]
    assert names_valid and not set(names_train) & set(names_valid)
    assert all(pdc.is_held_out(n) for n in names_valid) and not any(pdc.is_held_out(n) for n in names_train)
    assert any(n.startswith("topic:") for n in names_train) and any(n.startswith("module:") for n in names_train)
    assert info["train_bytes"] > 500_000 and 0.01 < info["valid_bytes"] / info["train_bytes"] < 0.2, info
    assert "PSF" in manifest["licence"]
    # held-out text does not appear in the training text (50 random 200-byte passages; one may straddle a
    # paragraph boundary next to shared text)
    train_b, valid_b = train.tobytes(), valid.tobytes()
    rng = np.random.default_rng(0)
    passages = [valid_b[s : s + 200] for s in rng.integers(0, len(valid_b) - 200, 50)]
    assert sum(p in train_b for p in passages) <= 1, [p for p in passages if p in train_b]
    valid_b.decode("utf-8")  # real text, whole UTF-8 documents


def test_train_moe_reports_validation_loss_and_sample_restores(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "examples/train_moe.py", "--steps", "40", "--batch", "8", "--seq", "32", "--d-model", "32",
           "--layers", "1", "--heads", "4", "--kv-heads", "2", "--experts", "4", "--topk", "2", "--ffn", "32",
           "--lr", "1e-2", "--eval-every", "20", "--eval-tokens", "2048", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    curve = summary["val_curve"]
    assert [s for s, _ in curve] == [0, 20, 40], curve
    assert all(math.isfinite(v) for _, v in curve), curve
    assert abs(curve[0][1] - math.log(256)) < 0.3, curve  # untrained: close to uniform over the 256 bytes
    assert curve[-1][1] < curve[0][1] - 1.0, curve
    assert len(re.findall(r"validation loss [0-9.]+ nats/byte", proc.stdout)) == 3, proc.stdout

    ckpt = summary["checkpoint"]
    assert os.path.exists(os.path.join(ckpt, "config.json")), ckpt
    cmd = [sys.executable, "examples/sample.py", "--checkpoint", ckpt, "--prompt", "The import ", "--bytes", "48",
           "--temperature", "0.8", "--top-k", "20"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "generated 48 bytes" in proc.stderr and "on cpu" in proc.stderr, proc.stderr
    assert proc.stdout.startswith("The import ") and len(proc.stdout) > len("The import "), proc.stdout
