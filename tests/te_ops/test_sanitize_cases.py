"""CPU tests of the compute-sanitizer driver (tests/gpu/sanitize_cases.py) and scripts/sanitize.sh, so
they cannot rot between GPU runs: the case list, kernel coverage (every Triton/Gluon kernel of te_ops
and every __global__ kernel of csrc has a case), the kernel filter regexes, the log summary and
exit statuses, the canary kernel's compilation, and the script end to end with a fake
compute-sanitizer running two cases as CPU dry runs."""

import os
import pathlib
import re
import stat
import subprocess
import sys
import textwrap

import pytest

from tests.gpu import sanitize_cases as sc

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sanitize.sh"


def _driver(*args, timeout=120, env=None):
    return subprocess.run(
        [sys.executable, "-m", "tests.gpu.sanitize_cases", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_list_names_and_regex():
    r = _driver("--list")
    assert r.returncode == 0, r.stderr
    assert "softmax_native_f32_short_rows" in r.stdout and "kernels:" in r.stdout
    r = _driver("--names", "--case", "fp8_*,softmax_native_f32_short_rows")
    names = r.stdout.split()
    assert r.returncode == 0 and "softmax_native_f32_short_rows" in names and len(names) > 5
    assert all(n.startswith("fp8_") or n == "softmax_native_f32_short_rows" for n in names)
    assert _driver("--names", "--case", "no_such_case").returncode != 0
    r = _driver("--kernel-regex")
    assert r.returncode == 0 and r.stdout.strip() == sc.triton_regex()


def test_every_kernel_has_a_case():
    tri = sc.triton_kernels()
    assert "te_ops.grouped_dense.gluon_kernels.grouped_gemm_ws_kernel" in tri and len(tri) >= 30
    covered = {k for c in sc.CASES.values() for k in c.triton}
    assert not set(tri) - covered, f"Triton/Gluon kernels without a sanitizer case: {sorted(set(tri) - covered)}"
    assert not covered - set(tri), f"cases name unknown kernels: {sorted(covered - set(tri))}"
    nat = set(sc.native_kernels())
    assert {"SoftmaxForwardKernel", "RowForwardKernel", "ActBackwardKernel", "LossFinalKernel"} <= nat
    ncov = {k for c in sc.CASES.values() for k in c.native}
    assert not nat - ncov, f"csrc kernels without a sanitizer case: {sorted(nat - ncov)}"
    assert not ncov - nat, f"cases name unknown csrc kernels: {sorted(ncov - nat)}"


def test_kernel_filters_match_ours_only():
    triton_re, native_re = re.compile(sc.triton_regex()), re.compile(sc.NATIVE_REGEX)
    for name in set(sc.triton_kernels().values()) | {sc.CANARY}:
        assert triton_re.search(name), name
    assert native_re.search("_ZN2te7softmax20SoftmaxForwardKernelIfLi1ELi1ELNS0_8MaskModeE0EEEvNS0_6ParamsEi")
    assert native_re.search("_ZN2te6router12_GLOBAL__N_117LossPartialKernelI6__halfEEvPKT_PKflPf")
    others = [
        "loop_add_fusion",
        "input_reduce_fusion_1",
        "gemm_fusion_dot_2",
        "nvjet_hsh_128x64_64x4_1x2_h_bz_TNT",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",
        "cudnn_generated_fort_native_sdpa_sm90",
        "_ZN7cutlass6KernelINS_4gemm6kernelE",
        "_ZN18transformer_engine6kernelE",
    ]
    for other in others:
        assert not triton_re.search(other) and not native_re.search(other), other
    assert sc.is_ours("void te::softmax::SoftmaxForwardKernel<float, (int)1>(te::softmax::Params, int)")
    assert sc.is_ours("norm_fwd_kernel") and sc.is_ours("grouped_gemm_ws_kernel")
    assert not sc.is_ours("void cutlass::Kernel<cutlass_80_tensorop>(Params)") and not sc.is_ours("loop_add_fusion")


_MEMCHECK = """\
========= COMPUTE-SANITIZER
SANITIZE-BEGIN a
========= Invalid __global__ read of size 4 bytes
=========     at norm_fwd_kernel+0x1a0 in triton_kernels.py:60
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7f0000000004 is out of bounds
=========     and is 4 bytes after the nearest allocation at 0x7f0000000000 of size 4 bytes
=========
========= Invalid __global__ write of size 16 bytes
=========     at sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n+0x2f0
=========     by thread (5,0,0) in block (1,0,0)
=========
SANITIZE-END a OK 3.2
SANITIZE-BEGIN b
SANITIZE-END b FAIL 1.0 CaseFailure: dx: max |error| 3 > 0.03 x 1
SANITIZE-DONE ok=1 fail=1 unavailable=0 seconds=4.2
========= ERROR SUMMARY: 2 errors
"""
_RACECHECK = """\
========= COMPUTE-SANITIZER
SANITIZE-BEGIN a
SANITIZE-END a OK 1.0
SANITIZE-BEGIN b
SANITIZE-END b OK 1.0
SANITIZE-DONE ok=2 fail=0 unavailable=0 seconds=2.0
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
_CRASHED = (
    "========= COMPUTE-SANITIZER\nSANITIZE-BEGIN a\nSANITIZE-END a OK 1.0\nSANITIZE-BEGIN b\nSegmentation fault\n"
)
_CANARY = """\
========= Invalid __global__ read of size 4 bytes
=========     at te_sanitize_canary_kernel+0x90 in sanitize_cases.py:700
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7f0000000001 is misaligned
=========
========= ERROR SUMMARY: 1 error
"""


def test_summaries_and_exit_statuses(tmp_path, capsys):
    s = sc.summarize(_MEMCHECK)
    assert s["errors"] == 2 and s["done"] and s["begun"] == ["a", "b"] and s["ended"]["b"][0] == "FAIL"
    assert [(k, ours) for _, k, ours in s["reports"]] == [
        ("norm_fwd_kernel", True),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", False),
    ]
    assert sc.summarize(_RACECHECK)["errors"] == 0 and sc.summarize(_CRASHED)["errors"] is None
    assert sc.summarize(_CANARY)["canary"] and not sc.summarize(_MEMCHECK)["canary"]

    def run(logs, tools, **kw):
        d = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        for name, text in logs.items():
            (d / name).write_text(text)
        canary = d / "canary.log" if "canary.log" in logs else None
        code = sc.report(d, tools, ["a", "b"], kw.get("skipped", []), kw.get("filtered", []), canary, "420")
        return code, capsys.readouterr().out

    clean = {"racecheck.log": _RACECHECK, "racecheck.meta": "part=1 rc=0 seconds=12\n"}
    assert run(clean, ["racecheck"])[0] == 0
    code, out = run(
        {**clean, "canary.log": "========= ERROR SUMMARY: 0 errors\n"}, ["racecheck"], filtered=["racecheck"]
    )
    assert code == 3 and "UNVERIFIED" in out and "NOT matched" in out
    assert run({**clean, "canary.log": _CANARY}, ["racecheck"], filtered=["racecheck"])[0] == 0
    code, out = run({"memcheck.log": _MEMCHECK, **clean}, ["memcheck", "racecheck"])
    assert code == 1 and "ERRORS" in out and "2 (1/1/0)" in out and "case b FAIL" in out and "norm_fwd_kernel" in out
    code, out = run({"initcheck.log": _CRASHED}, ["initcheck"])
    assert code == 2 and "crashed in b" in out
    resumed = "SANITIZE-DONE ok=0 fail=0 unavailable=0 seconds=0\n========= ERROR SUMMARY: 0 errors\n"
    code, out = run({"initcheck.log": _CRASHED, "initcheck.part2.log": resumed}, ["initcheck"])
    assert code == 2 and "crashed in b" in out  # the case that crashed stays reported after a resumed run
    startup = {
        "synccheck.log": "========= COMPUTE-SANITIZER\nImportError: no module\n========= ERROR SUMMARY: 0 errors\n",
        "synccheck.meta": "part=1 rc=1 seconds=3\n",
    }
    code, out = run(startup, ["synccheck"])
    assert code == 2 and "CRASH" in out and "ended before its cases" in out
    hazard = (
        "========= Warning: Potential RAW hazard\n=========     Write Thread (35,0,0) at scan_kernel+0x90 in k.py:4\n"
    )
    assert sc.summarize(hazard)["reports"] == [["Warning: Potential RAW hazard", "scan_kernel", True]]
    code, out = run(clean, ["racecheck", "synccheck"], skipped=["synccheck"])
    assert code == 3 and "SKIPPED" in out
    timed_out = {
        "memcheck.log": "========= COMPUTE-SANITIZER\nSANITIZE-BEGIN a\nSANITIZE-END a OK 1\n",
        "memcheck.meta": "part=1 rc=124 seconds=400\n",
    }
    code, out = run(timed_out, ["memcheck"])
    assert code == 3 and "INCOMPLETE" in out and "cut by the deadline" in out

    (tmp_path / "p1.log").write_text(_CRASHED)
    assert sc.remaining([tmp_path / "p1.log"], ["a", "b", "c"]) == ["c"]
    (tmp_path / "p2.log").write_text(_RACECHECK)
    assert sc.remaining([tmp_path / "p1.log", tmp_path / "p2.log"], ["a", "b", "c"]) == []


def test_a_sticky_cuda_error_ends_the_process(monkeypatch, capsys):
    """After a case fails with an error that poisons the CUDA context (illegal address, hardware
    exception), the driver stops without SANITIZE-DONE, so the script resumes the cases not begun in a
    fresh process (under racecheck on the H200 one such case failed all 44 cases after it)."""
    assert sc.context_lost("JaxRuntimeError: INTERNAL: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access")
    assert sc.context_lost("Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception.")
    assert not sc.context_lost("CaseFailure: max |got - want| 0.5 > tol 0.03")
    ran = []

    class Fake:
        targets, triton = (), ()

        def __init__(self, name, error=None):
            self.name, self.error = name, error

        def run(self, ctx):
            ran.append(self.name)
            if self.error:
                raise RuntimeError(self.error)

    cases = {"a": Fake("a"), "b": Fake("b", "INTERNAL: CUDA error: CUDA_ERROR_ILLEGAL_ADDRESS"), "c": Fake("c"),
             "d": Fake("d", "CaseFailure-like mismatch")}  # fmt: skip
    monkeypatch.setattr(sc, "CASES", cases)
    monkeypatch.setattr(sc, "_record_launches", lambda: set())
    assert sc.run_cases(["a", "b", "c"], True, 0) == 1 and ran == ["a", "b"]
    out = capsys.readouterr().out
    assert "SANITIZE-ABORT b" in out and "SANITIZE-DONE" not in out and "SANITIZE-BEGIN c" not in out
    ran.clear()
    assert sc.run_cases(["d", "a"], True, 0) == 1 and ran == ["d", "a"]  # an ordinary failure: go on
    assert "SANITIZE-DONE ok=1 fail=1" in capsys.readouterr().out


def test_canary_kernel_compiles_for_sm90():
    from te_ops._core import triton_bridge as tb

    if tb.triton_unavailable_reason():
        pytest.skip(tb.triton_unavailable_reason())
    kernel = sc.canary_kernel()
    sig = (("x_ptr", "*i32"), ("far", "i64"), ("out_ptr", "*i32"))
    compiled = tb.compile_kernel(tb.KernelSpec(kernel, sig, (), 1, 1), ("cuda", 90, 32))
    assert compiled.name == sc.CANARY and re.search(sc.triton_regex(), compiled.name)
    ptx = compiled.asm["ptx"]
    assert re.search(r"add\.s64\s+%rd\d+, %rd\d+, 1;", ptx), "the misaligned address (x + 1 byte) is gone"
    assert ptx.count("ld.global") >= 2


_FAKE = """\
#!/usr/bin/env bash
# a stand-in for compute-sanitizer: runs the program after "--" and prints a clean summary
case "${1:-}" in
  --version) echo "fake compute-sanitizer"; exit 0 ;;
  --help) echo "  --tool --kernel-name --padding --report-api-errors --check-exit-code --port"; exit 0 ;;
esac
echo "$*" >> "$FAKE_ARGS_LOG"
while [ $# -gt 0 ] && [ "$1" != "--" ]; do shift; done
shift
echo "========= COMPUTE-SANITIZER"
"$@"
rc=$?
echo "========= ERROR SUMMARY: 0 errors"
exit $rc
"""


def test_script_end_to_end_with_a_fake_sanitizer(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(_FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(
        os.environ,
        COMPUTE_SANITIZER=str(fake),
        FAKE_ARGS_LOG=str(tmp_path / "args.log"),
        PYTHON=sys.executable,
        OUT=str(tmp_path / "out"),
        JAX_PLATFORMS="cpu",
        SANITIZE_TOOLS="memcheck,racecheck",
        SANITIZE_SCOPE="ours",
        SANITIZE_CASES="router_aux_loss_native_bf16,fp8_dual_quantize_triton",
        SANITIZE_DRIVER_ARGS="--cpu-dry-run",
        SANITIZE_DEADLINE="240",
    )
    r = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    # the canary needs a GPU: both filtered tools are UNVERIFIED (exit 3), their cases all passed
    assert r.returncode == 3, out
    logs = tmp_path / "out" / "sanitize"
    summary = (logs / "summary.txt").read_text()
    assert re.search(r"memcheck\s+UNVERIFIED\s+2/2\s+0 \(0/0/0\)", summary), summary
    assert re.search(r"racecheck\s+UNVERIFIED\s+2/2", summary), summary
    for tool in ("memcheck", "racecheck"):
        text = (logs / f"{tool}.log").read_text()
        assert "SANITIZE-END fp8_dual_quantize_triton OK" in text and "SANITIZE-DONE ok=2" in text, text[-2000:]
    args = (tmp_path / "args.log").read_text()
    assert "--tool racecheck" in args and "--error-exitcode 1" in args and "regex=^_ZN2te[0-9]" in args
    assert "--padding 512" in args and "--canary" in args and "--report-api-errors no" in args
    assert textwrap.dedent(summary).count("our kernels only") == 2
