"""Helper for GPU tests: run tests.gpu.cmdbuf_check in a subprocess with command buffers on."""

import json
import os
import subprocess
import sys

CMDBUF_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_under_command_buffers(builder: str, flags: str = CMDBUF_FLAGS, timeout: int = 300) -> dict:
    """Runs builder ("module:function") in a fresh process with XLA_FLAGS=flags; returns its report."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu.cmdbuf_check", builder],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("CMDBUF_REPORT "):
            return json.loads(line[len("CMDBUF_REPORT ") :])
    raise AssertionError(
        f"no report from subprocess (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


def assert_graph_captured_and_warmed_once(report: dict, handlers: dict[str, int]) -> None:
    """Every handler ran inside a CUDA-graph capture and warmed exactly once per key.

    With fresh input buffers on every call, XLA (jax 0.11.2) runs
    some executions of a command buffer's custom calls eagerly and records others (e.g. 8 executes,
    4 of them under capture, for 4 calls x 2 launches), so we require >= 1 captured execute, not all.
    """
    counters = report["counters"]
    for name, keys in handlers.items():
        c = counters.get(name)
        assert c is not None, f"handler {name} never ran: {counters}"
        assert c["captured_executes"] >= 1, f"{name} never ran inside a CUDA graph capture: {c}"
        assert c["warmups"] == keys, f"{name}: expected {keys} warm-ups (one per key), got {c}"
        assert c["initialize_calls"] >= c["warmups"], c


def assert_triton_in_command_buffers(rep: dict, what: str = "", detail: str = "") -> None:
    """``rep`` (``triton_bridge.command_buffer_report``) shows Triton launches, all inside XLA's command
    buffers. XLA (jax 0.11.2) forms them on the thunk sequence after the HLO passes, so the proof is
    the thunk dump; where its lines carry no HLO names, the kCustomCall thunks are counted instead.
    ``what`` prefixes the messages; ``detail`` is added where no command buffer was formed."""
    tag = f"{what}: " if what else ""
    assert rep["launches"], f"{tag}no Triton launch in the optimized HLO: {rep}"
    assert rep["mode"] != "none", (
        f"{tag}XLA formed no command buffer (no thunk dump after the thunk passes): {rep} {detail}"
    )
    if rep["mode"] == "thunk_kinds":
        assert rep["custom_calls_inside"] >= 1, f"{tag}{rep}"
        if rep["other_custom_calls"] == 0:
            assert rep["custom_calls_outside"] == 0, f"{tag}{rep}"
    else:
        assert rep["captured"] and not rep["not_captured"], f"{tag}launches outside command buffers: {rep}"


def run_script_under_command_buffers(script: str, dump_dir, preallocate: bool | None = False, timeout: int = 300):
    """Runs ``python -c script`` from the repository root with command buffers on and XLA's dumps (the
    thunk sequence) in ``dump_dir``, also passed as TE_CMDBUF_DUMP_DIR; ``preallocate`` False sets
    XLA_PYTHON_CLIENT_PREALLOCATE=false (None leaves it as it is). Returns the CompletedProcess."""
    env = dict(os.environ, XLA_FLAGS=f"{CMDBUF_FLAGS} --xla_dump_to={dump_dir}", TE_CMDBUF_DUMP_DIR=str(dump_dir))
    if preallocate is not None:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = str(preallocate).lower()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)  # fmt: skip
