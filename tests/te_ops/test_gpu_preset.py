"""CPU tests of scripts/gpu_preset.sh (the named GPU runs): every preset's steps name a GPU test
file, a benchmark or a script that exists, the environment overrides a preset, and an unknown
preset is refused."""

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_preset.sh"


def _run(*args, **env):
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("STEPS", "DEADLINE", "BENCH_", "PYTEST_ARGS_", "TEST_TIMEOUT_"))}  # fmt: skip
    full.update(GPU_PRESET_PRINT="1", **env)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, timeout=60)


def _presets():
    out = _run("list").stdout
    return [line.split()[0] for line in out.splitlines() if line and not line.startswith(" ")]


def test_list_names_the_presets():
    assert _presets() == ["switches", "ffn_gluon", "fp8_routes", "fp8_model", "hardening"]


@pytest.mark.parametrize("preset", ["switches", "ffn_gluon", "fp8_routes", "fp8_model", "hardening"])
def test_every_step_exists(preset):
    r = _run(preset)
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert int(env["DEADLINE"]) <= 560
    for step in env["STEPS"].split():
        kind, name = step.split(":", 1)
        path = {"test": f"tests/gpu/{name}.py", "bench": f"benchmarks/{name}.py", "sh": f"scripts/{name}.sh"}[kind]
        assert (ROOT / path).exists(), (preset, step)


def test_environment_wins_and_unknown_preset_is_refused():
    r = _run("switches", DEADLINE="300", STEPS="bench:grouped_ffn")
    env = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert env["DEADLINE"] == "300" and env["STEPS"] == "bench:grouped_ffn"
    r = _run("no_such_preset")
    assert r.returncode == 2 and "unknown preset" in r.stderr


def test_switches_runs_the_untried_gluon_ffn_cases_last_and_apart():
    """A hang in the never-run Gluon FFN kernels must not take the switches' other measurements with
    it: the first test step and the benchmark leave them out, the repeated test step (gpu_run.sh's
    PYTEST_ARGS_<name>_repeat) runs only them, last."""
    env = dict(line.split("=", 1) for line in _run("switches").stdout.splitlines())
    steps = env["STEPS"].split()
    assert steps.count("test:test_grouped_ffn_gpu") == 2 and steps[-1] == "test:test_grouped_ffn_gpu"
    assert "not gluon" in env["PYTEST_ARGS_test_grouped_ffn_gpu"]
    assert env["PYTEST_ARGS_test_grouped_ffn_gpu_repeat"].endswith("-k gluon")
    assert env["BENCH_ARGS_grouped_ffn"] == "--skip Gluon"


def test_gpu_run_counts_each_step_name_apart():
    """gpu_run.sh's count_run numbers the runs of each step name on its own (the second run of a test
    file or a benchmark takes its _repeat settings and its own report), in the shell that runs the
    steps, not a subshell."""
    lines = (ROOT / "scripts" / "gpu_run.sh").read_text().splitlines()
    define = [line for line in lines if line.startswith("count_run()")]
    assert len(define) == 1
    script = define[0] + "\n" + "\n".join(
        f'count_run {name}; echo "{name} $run_no"'
        for name in ["test_a", "a", "test_a", "b", "test_a", "a"])
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30).stdout.split("\n")
    assert out[:6] == ["test_a 1", "a 1", "test_a 2", "b 1", "test_a 3", "a 2"]
