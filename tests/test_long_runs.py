"""CPU smoke tests of the GPU measurement scripts benchmarks/fp8_accuracy.py and benchmarks/long_run.py: their
``main([... "--tiny" ...])`` with ``$TE_BENCH_OUT`` in tmp_path, the JSON they write checked against the numbers
it records (means, relative differences, the bar), and their bar logic on hand-made records (NaN, errors)."""

import json
import math
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import fp8_accuracy as fa  # noqa: E402
import long_run as lr  # noqa: E402


def _finite(values):
    return all(v is not None and math.isfinite(v) for v in values)


def _check_header(record, op):
    assert record["op"] == op
    for key in ("date", "commit", "device", "versions", "platform", "xla_flags", "source"):
        assert key in record, key
    assert record["platform"] == "cpu" and record["versions"]["jax"]


def test_fp8_accuracy_tiny(tmp_path, monkeypatch):
    """Two recipes trained (bf16 and block scaling, the one with dimension constraints), one made to fail: the
    failure is recorded and the others still run; the means, relative differences and bar follow from the
    recorded curves."""
    monkeypatch.setenv("TE_BENCH_OUT", str(tmp_path))
    ex = fa.load_example()
    real_main = ex.main

    def main_failing_current(argv):
        if argv[argv.index("--fp8") + 1] == "current":
            raise RuntimeError("injected failure")
        return real_main(argv)

    monkeypatch.setattr(ex, "main", main_failing_current)
    steps, last = 8, 4
    payload = fa.main(["--tiny", "--recipes", "none,current,block", "--steps", str(steps), "--eval-every", "3",
                       "--last-steps", str(last), "--train-every", "1"])  # fmt: skip
    path = tmp_path / "fp8_accuracy.json"
    assert payload["json"] == str(path)
    rec = json.loads(path.read_text())
    _check_header(rec, "fp8_accuracy")
    assert path.stat().st_size < 200_000
    assert rec["config"]["steps"] == steps and rec["config"]["d_model"] % 128 == 0 and rec["config"]["ffn"] % 128 == 0
    assert list(rec["recipes"]) == ["none", "current", "block"]

    cur = rec["recipes"]["current"]
    assert cur["error"] == "RuntimeError: injected failure" and "val_curve" not in cur
    assert rec["bar"]["recipes"]["current"]["within_1pct"] is None and rec["bar"]["recipes"]["current"]["error"]
    assert rec["bar"]["passed"] is False  # a recipe that did not run fails the bar

    for name in ("none", "block"):
        r = rec["recipes"][name]
        assert r["error"] is None and r["no_nan"] is True, r
        assert [s for s, _ in r["val_curve"]] == [0, 3, 6, 8]  # before training, every 3 steps, after the last
        assert [s for s, _ in r["train_curve"]] == list(range(1, steps + 1))
        assert _finite([v for _, v in r["val_curve"]]) and _finite([v for _, v in r["train_curve"]])
        assert r["train_losses_first"] == [v for _, v in r["train_curve"]]
        # evaluations at steps > steps - last: 6 and 8
        assert r["val_steps_in_mean"] == [6, 8]
        assert r["val_loss_last_mean"] == pytest.approx(np.mean([v for s, v in r["val_curve"] if s > steps - last]))
        assert r["final_val_loss"] == r["val_curve"][-1][1]
        assert r["train_steps_in_mean"] == [steps - last + 1, steps]
        assert r["train_loss_last_mean"] == pytest.approx(np.mean([v for s, v in r["train_curve"] if s > steps - last]))
        assert r["train_curve"][0][1] > r["train_curve"][-1][1]  # it trains
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0
    ref, blk = rec["recipes"]["none"], rec["recipes"]["block"]
    assert ref["rel_diff_val_vs_bf16"] == 0.0
    rel = (blk["val_loss_last_mean"] - ref["val_loss_last_mean"]) / ref["val_loss_last_mean"]
    assert blk["rel_diff_val_vs_bf16"] == pytest.approx(rel)
    rel_t = (blk["train_loss_last_mean"] - ref["train_loss_last_mean"]) / ref["train_loss_last_mean"]
    assert blk["rel_diff_train_vs_bf16"] == pytest.approx(rel_t)
    bar = rec["bar"]["recipes"]["block"]
    assert bar["rel_diff_val"] == blk["rel_diff_val_vs_bf16"] and bar["within_1pct"] == (abs(rel) <= 0.01)
    assert bar["no_nan"] is True and rec["bar"]["recipes"]["none"]["no_nan"] is True
    # the same seed and batches: block scaling tracks bf16 closely over a few steps
    assert abs(blk["train_losses_first"][0] - ref["train_losses_first"][0]) < 0.05
    if payload["png"] is not None:
        assert os.path.getsize(payload["png"]) > 1000
    assert rec["complete"] is True and rec["merged_from"] is None

    # --merge: a second invocation runs only "current" (failing again, so nothing is trained) and keeps the
    # other recipes of the first; the bar is over all three
    first = tmp_path / "first.json"
    first.write_text(path.read_text())
    common = ["--tiny", "--steps", str(steps), "--eval-every", "3", "--last-steps", str(last), "--train-every", "1"]
    merged = fa.main(common + ["--recipes", "current", "--merge", str(first)])
    rec2 = json.loads(path.read_text())
    assert list(rec2["recipes"]) == ["none", "current", "block"] and rec2["merged_from"] == str(first)
    assert rec2["recipes"]["block"]["val_curve"] == rec["recipes"]["block"]["val_curve"]
    assert rec2["bar"]["recipes"]["block"] == rec["bar"]["recipes"]["block"] and merged["bar"]["passed"] is False
    # another configuration is not merged, and the JSON says why
    other = fa.main(common[:2] + ["9"] + common[3:] + ["--recipes", "current", "--merge", str(first)])
    assert list(other["recipes"]) == ["current"] and "another configuration" in other["merge_note"]


def _summary(losses, val_curve):
    return {"losses": losses, "val_curve": val_curve, "first_loss": losses[0], "last_loss": losses[-1],
            "tokens_per_s": 1.0, "seconds": 1.0, "params": 1}  # fmt: skip


def test_fp8_accuracy_bar_on_made_up_runs():
    """NaN anywhere in a run fails no_nan and within_1pct; the 1% bar is |relative difference| <= 1%; the last
    steps' validation mean uses the evaluations at steps > steps - last_steps; no bf16 run: not measured."""
    cfg = dict(fa.DEFAULTS, steps=100, last_steps=50, train_every=5)
    val = [(s, 4.0 - s / 100) for s in range(0, 101, 10)]
    base = fa.summarize(_summary([3.0] * 100, val), cfg)
    assert base["val_steps_in_mean"] == [60, 70, 80, 90, 100]
    assert base["val_loss_last_mean"] == pytest.approx(np.mean([3.4, 3.3, 3.2, 3.1, 3.0]))
    assert len(base["train_curve"]) == 21 and base["train_curve"][1] == [5, 3.0]  # step 1 and every 5th
    close = fa.summarize(_summary([3.0] * 100, [(s, v * 1.009) for s, v in val]), cfg)
    far = fa.summarize(_summary([3.0] * 100, [(s, v * 0.985) for s, v in val]), cfg)
    nan = fa.summarize(_summary([3.0] * 40 + [float("nan")] + [3.0] * 59, val), cfg)
    assert nan["no_nan"] is False and nan["nonfinite_train_steps"] == [41] and nan["train_loss_last_mean"] == 3.0
    inf_val = fa.summarize(_summary([3.0] * 100, val[:-1] + [(100, float("inf"))]), cfg)
    assert inf_val["no_nan"] is False and inf_val["val_loss_last_mean"] is None and inf_val["final_val_loss"] is None
    records = {name: {"error": None, **r} for name, r in
               (("none", base), ("current", close), ("delayed", far), ("block", nan), ("x", inf_val))}  # fmt: skip
    bar = fa.compare(records)
    assert records["current"]["rel_diff_val_vs_bf16"] == pytest.approx(0.009)
    assert bar["recipes"]["current"] == {"error": False, "no_nan": True, "rel_diff_val": pytest.approx(0.009),
                                         "within_1pct": True}  # fmt: skip
    assert bar["recipes"]["delayed"]["within_1pct"] is False  # 1.5% lower is outside the band as well
    assert bar["recipes"]["block"]["no_nan"] is False
    assert bar["recipes"]["x"]["within_1pct"] is False and bar["recipes"]["x"]["rel_diff_val"] is None
    assert bar["passed"] is False
    assert fa.compare({"none": records["none"], "current": records["current"]})["passed"] is True
    assert fa.compare({"current": records["current"]})["passed"] is None  # no bf16 reference
    failed_ref = {"none": {"error": "boom"}, "current": records["current"]}
    assert fa.compare(failed_ref)["recipes"]["current"]["within_1pct"] is None


def test_long_run_tiny(tmp_path, monkeypatch):
    """Parts A, B, C at tiny sizes: A's losses finite; B's children report the first steps of A's run (the same
    losses), identical with and without the command-buffer flags; C reports each model's compiled memory."""
    monkeypatch.setenv("TE_BENCH_OUT", str(tmp_path))
    real_env = lr.child_env

    # The children (fresh processes) compile with LLVM's optimizations off: several times faster on CPU.
    def fast_env(flags=None):
        env = real_env(flags)
        return dict(env, XLA_FLAGS=(env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip())

    monkeypatch.setattr(lr, "child_env", fast_env)
    payload = lr.main(["--tiny", "--steps", "8", "--eval-every", "4", "--cmdbuf-steps", "5", "--no-cmdbuf-control"])
    rec = json.loads((tmp_path / "long_run.json").read_text())
    _check_header(rec, "long_run")
    assert rec["parts"] == ["A", "B", "C"] and rec["bar"] == payload["bar"]

    a = rec["part_a"]
    assert a["error"] is None and a["no_nan"] is True and a["nonfinite_train_count"] == 0
    assert [s for s, _ in a["val_curve"]] == [0, 4, 8] and _finite([v for _, v in a["val_curve"]])
    assert len(a["train_losses_first"]) == 8 and _finite(a["train_losses_first"]) and a["tokens_per_s"] > 0

    b = rec["part_b"]
    assert b["errors"] == [] and list(b["runs"]) == ["off", "on"] and b["steps"] == 5
    off, on = b["runs"]["off"], b["runs"]["on"]
    assert off["xla_flags"].endswith(lr.CMDBUF_RUNS["off"] + " --xla_backend_optimization_level=0")
    assert lr.CMDBUF_ON in on["xla_flags"] and on["rc"] == 0
    # both children deterministic run to run (only command buffers differ); CPU: no cuBLASLt to pin
    assert all(lr.DETERMINISM_FLAGS in r["xla_flags"] for r in (off, on))
    assert off["dense_candidate_pinned"] is None and on["dense_candidate_pinned"] is None
    assert len(off["losses"]) == 5 and _finite(off["losses"])
    assert b["identical"] is True and b["max_abs_diff"] == 0.0 and off["losses"] == on["losses"]
    # the children ran the first steps of Part A's run (same init, batches, schedule); compiled differently, so
    # equal to a few ulps rather than bitwise
    np.testing.assert_allclose(off["losses"], a["train_losses_first"][:5], rtol=1e-3)
    assert "note" in b  # on CPU the flags do nothing, and the JSON says so

    c = rec["part_c"]
    assert c["errors"] == [] and list(c["models"]) == ["te_layers", "strong_cf1.25"]
    for m in c["models"].values():
        assert m["backend"] == "cpu" and m["peak_bytes_in_use"] is None  # CPU: no memory statistics
        ma = m["memory_analysis"]
        assert ma["temp_size_in_bytes"] > 0 and ma["argument_size_in_bytes"] > 0
        est = ma["argument_size_in_bytes"] + ma["output_size_in_bytes"] - ma["alias_size_in_bytes"]
        assert ma["estimated_peak_bytes"] == est + ma["temp_size_in_bytes"]
        assert len(m["losses"]) == m["steps"] == 3 and _finite(m["losses"])
    ratio = c["te_layers_vs_strong_cf1.25"]
    te, strong = (c["models"][n]["memory_analysis"] for n in ("te_layers", "strong_cf1.25"))
    assert ratio["temp_bytes_ratio"] == pytest.approx(te["temp_size_in_bytes"] / strong["temp_size_in_bytes"])
    assert ratio["peak_bytes_ratio"] is None
    assert rec["bar"] == {"a_no_nan_inf": True, "b_identical_losses": True, "c_memory_reported": True,
                          "passed": True}  # fmt: skip
    assert rec["complete"] is True and b["part_a_first_steps_equal"].keys() == {"off", "on"}

    # --merge: Part B again (here made to report different losses, without running anything), A and C kept
    first = tmp_path / "first.json"
    first.write_text((tmp_path / "long_run.json").read_text())
    monkeypatch.setattr(lr, "part_b", lambda *a, **k: dict(b, identical=False, max_abs_diff=1e-3))
    again = lr.main(["--tiny", "--steps", "8", "--eval-every", "4", "--parts", "B", "--merge", str(first)])
    rec2 = json.loads((tmp_path / "long_run.json").read_text())
    assert rec2["parts"] == ["A", "B", "C"] and rec2["part_a"] == a and rec2["part_c"] == c
    assert rec2["bar"] == again["bar"] == {"a_no_nan_inf": True, "b_identical_losses": False,
                                           "c_memory_reported": True, "passed": False}  # fmt: skip


def test_long_run_bar_and_loss_comparison():
    """Bit comparison of loss lists, and the bar: NaN in A, different losses or a failed child in B, a failed
    model in C each fail it; parts not run are not judged."""
    assert lr.compare_losses([1.0, 2.0], [1.0, 2.0]) == {"identical": True, "max_abs_diff": 0.0,
                                                         "first_differing_step": None}  # fmt: skip
    d = lr.compare_losses([1.0, 2.0, 3.0], [1.0, 2.0 + 2**-20, 3.5])
    assert d["identical"] is False and d["first_differing_step"] == 2 and d["max_abs_diff"] == 0.5
    assert lr.compare_losses([float("nan")], [float("nan")])["identical"] is True  # same bits
    assert lr.compare_losses([1.0], None)["identical"] is None
    assert lr.compare_losses([1.0], [1.0, 2.0])["identical"] is False

    ok_a = {"error": None, "no_nan": True}
    ok_b = {"errors": [], "identical": True}
    ok_c = {"errors": []}
    assert lr.judge({"part_a": ok_a, "part_b": ok_b, "part_c": ok_c})["passed"] is True
    assert lr.judge({"part_a": dict(ok_a, no_nan=False)})["passed"] is False
    assert lr.judge({"part_a": {"error": "ImportError: x"}})["passed"] is False
    assert lr.judge({"part_b": dict(ok_b, identical=False)})["passed"] is False
    assert lr.judge({"part_b": {"errors": ["on: timed out"], "identical": None}})["passed"] is False
    assert lr.judge({"part_c": {"errors": ["te_layers: no report"]}})["passed"] is False
    assert lr.judge({"part_b": ok_b}) == {"b_identical_losses": True, "passed": True}


def test_long_run_uses_the_projects_command_buffer_flags():
    from tests.gpu.cmdbuf import CMDBUF_FLAGS

    assert lr.CMDBUF_ON == CMDBUF_FLAGS
    assert lr.CMDBUF_OFF == "--xla_gpu_enable_command_buffer="
    # every Part B child: XLA's deterministic ops (which fused_attention's cuDNN backward follows) and no timed
    # GEMM autotuning, so that only the command-buffer flags differ between off, on and the control
    assert lr.DETERMINISM_FLAGS.split() == ["--xla_gpu_deterministic_ops=true", "--xla_gpu_autotune_level=0"]
    assert lr.CMDBUF_RUNS == {
        "off": lr.CMDBUF_OFF + " " + lr.DETERMINISM_FLAGS,
        "on": lr.CMDBUF_ON + " " + lr.DETERMINISM_FLAGS,
        "off_repeat": lr.CMDBUF_OFF + " " + lr.DETERMINISM_FLAGS,
    }
