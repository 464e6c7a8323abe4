#!/usr/bin/env bash
# The one GPU command: build te_ops in place (no build isolation, the image's packages), run the
# GPU-marked tests, run the benchmarks, and collect everything into $OUT (or ./gpu_out).
#
#   bash scripts/gpu_run.sh                      # everything
#   OPS="softmax" STEPS="test:test_softmax_gpu bench:softmax" BENCH_ARGS_softmax=--target-only \
#     bash scripts/gpu_run.sh
#
# Outputs: $OUT/run.log (all output) and $OUT/results.tar.gz holding results/: build.log, the junit XML
# of each test file, and results/<device>/<op>.json, a copy of every benchmark results file this run
# wrote into benchmarks/results/<device>/ (copy those over the checkout's to publish them; logs and XML
# are never committed). A benchmark named again writes results/repeat<k>/<op>.json instead.
# TE_BENCH_COMMIT=<sha> records the commit in the results files where the tree has no .git.
# Wheels for packages missing on the GPU image (e.g. nvidia-cudnn-frontend) are taken from .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT/results"
touch "$OUT/.started"  # benchmark results files newer than this were written by this run
LOG="$OUT/run.log"
exec > >(tee -a "$LOG") 2>&1
# Tests run with XLA_PYTHON_CLIENT_PREALLOCATE=false (several pytest workers share the card).
# Benchmarks run with JAX's default (preallocated pool), as a training job does: without it the
# allocator's "Build buffer allocations" took 5.6 ms of host time per fp8_dense fwd+bwd step
# (H100, 2026-12-06, benchmarks/fp8_profile.py), which left the GPU idle 4 ms of every 12.
# BENCH_PREALLOCATE=false restores the old behaviour.
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
t0=$(date +%s)
stamp() { echo "[gpu_run +$(( $(date +%s) - t0 ))s] $*"; }
# DEADLINE (seconds, default 560): steps that would start later are skipped (and listed), so the
# results gathered so far always come back within one device call's 10-minute limit.
DEADLINE=${DEADLINE:-560}
time_left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
SKIPPED_STEPS=""

stamp "host: $(hostname) $(date -u)"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv || true
# library versions the native modules load (cuDNN from site-packages, cuBLASLt from the toolkit)
$PY - <<'PYEOF' || true
import ctypes, ctypes.util, glob, os
try:
    import nvidia.cudnn as c
    lib = sorted(glob.glob(os.path.join(list(c.__path__)[0], "lib", "libcudnn.so*")))[0]
    print("[gpu_run] cudnn version:", ctypes.CDLL(lib).cudnnGetVersion())
except Exception as e:
    print("[gpu_run] cudnn version: unknown:", e)
import site
libs = [ctypes.util.find_library("cublasLt") or "libcublasLt.so"]
for d in site.getsitepackages():  # pip's NVIDIA wheels (the JAX CUDA plugin's dependencies)
    libs += sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcublasLt.so*")))
for lib in libs:
    try:
        print("[gpu_run] cublasLt version:", ctypes.CDLL(lib).cublasLtGetVersion(), lib)
    except Exception as e:
        print("[gpu_run] cublasLt version: unknown:", lib, e)
PYEOF

if compgen -G ".whl/*.whl" > /dev/null; then
  stamp "installing carried wheels: $(ls .whl)"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/te_site .whl/*.whl \
    && export PYTHONPATH=/tmp/te_site${PYTHONPATH:+:$PYTHONPATH}
fi

stamp "building (pip install --no-build-isolation --no-deps -e .)"
# If an op's sources fail to compile, exclude that op folder and build the rest (up to 3 tries), so
# one broken op does not hide the results of the others; the exclusions are printed.
EXCLUDE=""
OPS=${OPS:-}; OPS=${OPS//,/;}  # op folders, ";"- or ","-separated (empty: all)
for attempt in 1 2 3 4; do
  # Always pass both (possibly empty): CMake caches them in build/, and a stale value from an
  # earlier build would silently drop ops.
  BUILD_ARGS=("-Ccmake.define.TE_OPS_ONLY=${OPS}" "-Ccmake.define.TE_OPS_EXCLUDE=${EXCLUDE}"
              "-Ccmake.define.TE_STATIC_LIBSTDCXX_MODULES=${STATIC_LIBSTDCXX-_native_cudnn}")
  if $PY -m pip install --no-build-isolation --no-deps -e . "${BUILD_ARGS[@]}" > "$OUT/results/build.log" 2>&1; then
    break
  fi
  bad=$(grep -E "^FAILED:|CMake Error at" "$OUT/results/build.log" | grep -oE "csrc/[a-z_]+/" | grep -v "csrc/common/" \
        | sed 's|csrc/||; s|/||' | head -1)
  grep -E "error" "$OUT/results/build.log" | head -20
  if [ -z "$bad" ] || [[ ";$EXCLUDE;" == *";$bad;"* ]]; then tail -60 "$OUT/results/build.log"; stamp "BUILD FAILED"; break; fi
  EXCLUDE="${EXCLUDE:+$EXCLUDE;}$bad"
  stamp "BUILD FAILED in csrc/$bad: retrying without it (excluded: $EXCLUDE)"
done
grep -E "te_ops:|warning|error" "$OUT/results/build.log" | grep -v "^--" | head -40
$PY - <<'PY'
import te_ops
from te_ops._core import native
print("native modules:", {k: v.build_info() for k, v in native._loaded.items()})
print("missing:", native._errors)
print("native_unavailable_reason:", te_ops.native_unavailable_reason())
PY

# STEPS: ordered "test:<file stem>" / "bench:<name>" / "sh:<script>" items (default: every GPU test file, then every
# benchmark). One pytest process per test file, so a crash in one file cannot hide the others.
if [ -z "${STEPS:-}" ]; then
  STEPS=""
  for f in tests/gpu/test_*.py; do STEPS="$STEPS test:$(basename "$f" .py)"; done
  for b in softmax norm router dense attention permutation grouped_dense grouped_ffn fp8 train_moe; do STEPS="$STEPS bench:$b"; done
fi
# Test files compile many kernels: with pytest-xdist available (the .whl/ wheels), run 4 workers per
# file unless PYTEST_ARGS says otherwise (set PYTEST_ARGS= to run serially). PYTEST_ARGS_<file stem>
# (e.g. PYTEST_ARGS_test_fused_attention_gpu="-n 2") and TEST_TIMEOUT_<file stem> override them for one
# file: every xdist worker pays the first cuDNN/Triton initialisation again.
if [ -z "${PYTEST_ARGS+x}" ]; then
  if $PY -c "import xdist" 2>/dev/null; then PYTEST_ARGS="-n 4"; else PYTEST_ARGS=""; fi
  stamp "PYTEST_ARGS defaulted to '${PYTEST_ARGS}'"
fi
# count_run <step name>: the how-many-th time this step is reached, in $run_no (test stems start with
# test_, benchmark names do not, so one counter per name serves both kinds).
count_run() { local v="RUNS_$1"; printf -v "$v" '%d' $(( ${!v:-0} + 1 )); run_no=${!v}; }
test_rc=0
for step in $STEPS; do
  kind=${step%%:*}; name=${step#*:}
  left=$(time_left)
  if [ "$left" -lt 40 ]; then SKIPPED_STEPS="$SKIPPED_STEPS $step"; continue; fi
  if [ "$kind" = test ]; then
    # SIGINT first: pytest then stops like on Ctrl-C and still prints the failures it has seen.
    f="tests/gpu/$name.py"
    stamp "GPU tests: $f"
    v="PYTEST_ARGS_$name"; if [ -n "${!v+x}" ]; then file_args=${!v}; else file_args=${PYTEST_ARGS:-}; fi
    v="TEST_TIMEOUT_$name"; file_timeout=${!v:-${TEST_TIMEOUT:-300}}
    # A test file named again in STEPS runs with PYTEST_ARGS_<name>_repeat / TEST_TIMEOUT_<name>_repeat
    # where set (e.g. the risky cases last, on their own) and reports to <name>.repeat<k>.xml.
    count_run "$name"; truns=$run_no; xml="$name"
    if [ "$truns" -gt 1 ]; then
      xml="$name.repeat$truns"
      v="PYTEST_ARGS_${name}_repeat"; if [ -n "${!v+x}" ]; then file_args=${!v}; fi
      v="TEST_TIMEOUT_${name}_repeat"; file_timeout=${!v:-$file_timeout}
    fi
    eval "file_argv=( ${file_args:-} )"  # shell quoting honoured: -n 3 -k 'ffn or requantize'
    stamp "pytest args: ${file_args:-} (run $truns)"
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT -k 20 $(( left < file_timeout ? left - 25 : file_timeout )) $PY -m pytest -m gpu "$f" -q -rs \
      -p no:cacheprovider -o junit_family=xunit2 --junitxml "$OUT/results/$xml.xml" "${file_argv[@]}" \
      || { rc=$?; test_rc=$rc; stamp "$f rc=$rc"; }
  elif [ "$kind" = sh ]; then
    # sh:<name> runs scripts/<name>.sh (e.g. sh:sanitize, compute-sanitizer over the kernels); its
    # non-zero exit counts as a test failure.
    stamp "script scripts/$name.sh"
    timeout -s INT -k 20 $(( left - 20 )) bash "scripts/$name.sh" || { rc=$?; test_rc=$rc; stamp "scripts/$name.sh rc=$rc"; }
  elif [ -f "benchmarks/$name.py" ]; then
    # The first run of a benchmark writes benchmarks/results/<device>/<name>.json in this tree (or
    # $TE_BENCH_OUT when set); a benchmark named again (a fresh process: plans are timed anew) writes
    # its JSON under $OUT/results/repeat<k>/ and takes BENCH_ARGS_<name>_repeat when that is set.
    count_run "$name"; runs=$run_no
    dir="${TE_BENCH_OUT:-}"; args=$(eval echo "\${BENCH_ARGS_$name:-}")
    if [ "$runs" -gt 1 ]; then
      dir="$OUT/results/repeat$runs"
      args=$(eval echo "\${BENCH_ARGS_${name}_repeat:-$args}")
    fi
    stamp "benchmark $name (run $runs) $args"
    v="BENCH_TIMEOUT_$name"; bt=${!v:-${BENCH_TIMEOUT:-240}}  # per-benchmark limit, e.g. BENCH_TIMEOUT_long_run=300
    XLA_PYTHON_CLIENT_PREALLOCATE=${BENCH_PREALLOCATE:-true} TE_BENCH_OUT="$dir" timeout $(( left < bt ? left - 15 : bt )) \
      $PY "benchmarks/$name.py" $args || stamp "benchmark $name FAILED rc=$?"
  fi
done
[ -n "$SKIPPED_STEPS" ] && stamp "SKIPPED (deadline ${DEADLINE}s):$SKIPPED_STEPS"
# Bring back the results files this run wrote, laid out like benchmarks/results/ (<device>/<op>.json).
while IFS= read -r f; do
  dev=$(basename "$(dirname "$f")"); mkdir -p "$OUT/results/$dev" && cp "$f" "$OUT/results/$dev/"
  stamp "results file: $f -> results/$dev/"
done < <(find benchmarks/results -mindepth 2 -maxdepth 2 -name '*.json' -newer "$OUT/.started" 2>/dev/null)
tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -rf "$OUT/results"
stamp "done (tests rc=$test_rc)"
exit $test_rc
