#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over every te_ops CUDA and
# Triton/Gluon kernel: the cases of tests/gpu/sanitize_cases.py (one op implementation each, forward
# and backward, small odd shapes, compared loosely with the reference) run under each tool. Any
# sanitizer report, and any case that fails, fails the run. Needs a built te_ops (scripts/gpu_run.sh
# builds it first).
#
#   bash scripts/sanitize.sh                                     # every tool, every case
#   SANITIZE_TOOLS=memcheck SANITIZE_CASES='softmax_*,fp8_dense_*' bash scripts/sanitize.sh
#   python -m tests.gpu.sanitize_cases --list                    # the cases and the kernels they cover
#
# Environment:
#   SANITIZE_TOOLS     tools to run, space- or comma-separated (default: memcheck racecheck initcheck synccheck)
#   SANITIZE_CASES     case names or fnmatch patterns, comma-separated (default: all)
#   SANITIZE_DEADLINE  seconds for the whole script (default 420). A tool that cannot start with
#                      SANITIZE_MIN_TOOL_SECONDS (default 60) left is SKIPPED; a running one is
#                      stopped at the deadline (INCOMPLETE: the cases it did not reach are listed).
#   SANITIZE_JOBS      tools run at the same time (default 4: one process per tool, all in parallel,
#                      each with its own port; the GPU has room for all, and the CPU side (XLA and
#                      Triton compiles, instrumentation) is what takes the time)
#   SANITIZE_SCOPE     which kernels the tools check: default | ours | all (see "Kernel filters")
#   SANITIZE_CASE_TIMEOUT  seconds one case may take (default 240): a hung case ends its process, the
#                      tool's log says which case it was, and the remaining cases run in a new process
#   SANITIZE_EXTRA_ARGS, SANITIZE_EXTRA_ARGS_<tool>  more compute-sanitizer options (word-split)
#   SANITIZE_DRIVER_ARGS   more options for the driver (the CPU test of this script passes --cpu-dry-run)
#   COMPUTE_SANITIZER  the compute-sanitizer binary (default: PATH, $CUDA_HOME/bin, next to nvcc,
#                      /usr/local/cuda*/bin, pip's nvidia/* packages)
#   PYTHON             the interpreter (default python3)
#   OUT                logs go to $OUT/sanitize/ (default ./gpu_out): <tool>.log (and <tool>.partN.log
#                      when a crashed or timed-out process was resumed), canary.log, summary.txt;
#                      all of them also in $OUT/sanitize.tar.gz
#
# Exit status: 0 clean; 1 a sanitizer report or a failed case; 2 a crash (or no compute-sanitizer);
# 3 incomplete: tools SKIPPED or stopped by the deadline, cases not reached or UNAVAILABLE in this
# build, or a kernel filter that could not be verified (no errors seen in what did run).
#
# One process per tool runs every case (--all style: JAX start-up and compiles are paid once per
# tool). If it crashes or hangs, the summary names the case it was in (the driver prints
# SANITIZE-BEGIN/END lines) and the cases after it run in a fresh process (up to 4 processes per tool).
#
# Options, and why:
#   --error-exitcode 1          any report makes the sanitizer's exit status non-zero (the summary
#                               reads the logs' "ERROR SUMMARY: N errors" lines, which count every
#                               report, also those past --print-limit)
#   --print-limit 200           enough to see every distinct report of a run, not a flood
#   --show-backtrace device     device frames (file:line of Triton kernels); host frames of a Python
#                               process are long and say nothing the case name does not
#   --target-processes application-only   the Python process only: Triton and XLA run ptxas/nvlink
#                               as child processes, which use no CUDA
#   --report-api-errors no      JAX/XLA and the CUDA libraries probe APIs that fail by design
#                               (cuGetProcAddress of absent symbols, attribute queries); our handlers
#                               check every CUDA call themselves and a failing one fails its case
#   --check-exit-code no        a failing case is reported by the driver, not as a sanitizer error
#   --launch-timeout 300        Python + JAX start slowly under the tool
#   memcheck: --leak-check no (XLA keeps allocations alive until exit); --padding 512 (every
#     allocation gets 512 invalid bytes after it: with XLA's platform allocator each buffer is its
#     own cudaMalloc, so an overrun past a buffer's end is reported even when the next allocation
#     starts right behind it); --destroy-on-device-error kernel (a memory error ends that kernel,
#     not the CUDA context: the following cases still run and are checked);
#     --track-stream-ordered-races all (jaxlib allocates some Triton scratch with cuMemAllocAsync).
#   racecheck: --racecheck-report analysis (one line per racing pair of source locations, not one
#     per byte); --racecheck-num-workers 4 where supported (four tools share the CPU).
#   initcheck: --check-api-memory-access yes: a device-to-host copy of bytes no kernel wrote is
#     reported, and every case copies its results to the host to compare them: an output element a
#     kernel fails to write is reported (also when the next reader is an XLA kernel, see below).
#     There is no --initcheck-address-reporting option in the CUDA 13 tools;
#     --initcheck-address-space stays at its default, global memory (shared-memory initcheck is
#     new, and Triton's shared-memory pipelines write through asynchronous copies and TMA).
#   synccheck: --destroy-on-device-error kernel (as for memcheck).
#   Options that a given compute-sanitizer version does not list in --help are left out.
#
# Memory: the driver sets XLA_PYTHON_CLIENT_PREALLOCATE=false and XLA_PYTHON_CLIENT_ALLOCATOR=platform
# (every XLA buffer its own allocation, so bounds and initialisation are tracked per buffer; with the
# default pool allocator a pool block is one allocation and freed-then-reused bytes count as
# initialised) and disables XLA command buffers and autotuning (tests/gpu/sanitize_cases.py says why).
# The stream-ordered-allocator and memory-pool caveats of initcheck therefore do not apply to XLA's
# buffers; jaxlib's cuMemAllocAsync scratch (Triton kernels with global scratch) is supported by
# initcheck since CUDA 11.6.
#
# Kernel filters. Ours: native kernels all live in namespace te (mangled names start with
# "_ZN2te<digit>") and Triton/Gluon kernels keep their Python function names (the driver lists them:
# --kernel-regex). An include filter (--kernel-name regex=...) is used, not an exclude list: XLA's
# fusions and cuBLAS/cuDNN kernels have open-ended names, ours are a closed list checked by the CPU
# test (every kernel in te_ops/ and csrc/ is covered by a case).
#   racecheck, synccheck: our kernels only (default). Library kernels are not ours, and racecheck
#     on cuBLAS/cuDNN kernels costs most of the time budget.
#   memcheck: every kernel (default). Checking does not depend on other kernels, and cuBLASLt (dense)
#     and cuDNN (fused_attention) run on the buffers, shapes and workspaces our handlers give them:
#     an out-of-bounds access inside them is most likely our bug. SANITIZE_SCOPE=ours filters it too.
#   initcheck: every kernel, always. A filtered initcheck does not track the writes of the kernels it
#     skips, so every buffer an XLA kernel wrote and ours read would be reported as uninitialised. The
#     summary attributes each report to a kernel (ours / other / host API); "other" reports can be
#     ours too (an XLA kernel reading an output element ours did not write) or false positives: cuBLAS
#     kernels are known to read padding they never use, and device-side TMA descriptors (tensormap
#     instructions, used by the Gluon kernels and the USE_TMA Triton variants) are listed by NVIDIA as
#     a source of initcheck false positives. Both fail the run; the summary names the kernel.
#   A filter that matched nothing would check nothing and report nothing, so when racecheck or
#   synccheck run filtered, a canary process runs under memcheck with the same filter:
#   `sanitize_cases --canary` launches a Triton kernel named te_sanitize_canary_kernel through the
#   bridge (jaxlib's launcher, like every Triton kernel of ours) that reads misaligned and far out
#   of bounds. Unless memcheck reports it precisely (kernel name included), the filtered tools are
#   UNVERIFIED (exit 3).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu_out}
LOGDIR=$OUT/sanitize
mkdir -p "$LOGDIR"
rm -f "$LOGDIR"/*.log "$LOGDIR"/*.meta "$LOGDIR"/summary.txt
DEADLINE=${SANITIZE_DEADLINE:-420}
MIN_TOOL=${SANITIZE_MIN_TOOL_SECONDS:-60}
JOBS=${SANITIZE_JOBS:-4}
SCOPE=${SANITIZE_SCOPE:-default}
CASE_TIMEOUT=${SANITIZE_CASE_TIMEOUT:-240}
TOOLS=$(echo "${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}" | tr ',' ' ')
DRIVER=(-m tests.gpu.sanitize_cases)
t0=$(date +%s)
now() { date +%s; }
left() { echo $(( DEADLINE - ($(now) - t0) )); }
stamp() { echo "[sanitize +$(( $(now) - t0 ))s] $*"; }

for t in $TOOLS; do
  case $t in memcheck|racecheck|initcheck|synccheck) ;; *) stamp "unknown tool '$t'"; exit 2 ;; esac
done
case $SCOPE in default|ours|all) ;; *) stamp "SANITIZE_SCOPE must be default, ours or all, got '$SCOPE'"; exit 2 ;; esac

find_sanitizer() {
  local c d
  for c in "${COMPUTE_SANITIZER:-}" "$(command -v compute-sanitizer 2>/dev/null)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
  done
  for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" "${CUDA_ROOT:-}" \
           "$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /nonexistent/bin/nvcc)")")" \
           /usr/local/cuda $(ls -d /usr/local/cuda-* /opt/nvidia/cuda* 2>/dev/null | sort -rV); do
    [ -n "$d" ] || continue
    for c in "$d/bin/compute-sanitizer" "$d/compute-sanitizer/compute-sanitizer"; do
      if [ -x "$c" ]; then echo "$c"; return 0; fi
    done
  done
  # pip wheels (nvidia-cuda-sanitizer-api-*) put the binary inside site-packages
  c=$($PY - <<'PY' 2>/dev/null
import glob, os, sys
for p in sys.path:
    for m in sorted(glob.glob(os.path.join(p, "nvidia", "**", "compute-sanitizer"), recursive=True)):
        if os.path.isfile(m) and os.access(m, os.X_OK):
            print(m)
            raise SystemExit
PY
)
  if [ -n "$c" ]; then echo "$c"; return 0; fi
  return 1
}

if ! CS=$(find_sanitizer); then
  stamp "compute-sanitizer not found (COMPUTE_SANITIZER, PATH, \$CUDA_HOME/bin, next to nvcc, /usr/local/cuda*/bin)"
  echo "compute-sanitizer not found" > "$LOGDIR/summary.txt"
  exit 2
fi
stamp "compute-sanitizer: $CS"
"$CS" --version 2>&1 | sed 's/^/  /'
HELP=$("$CS" --help 2>&1)
has() { grep -q -e "--$1\b" <<<"$HELP"; }

CASE_ARGS=()
[ -n "${SANITIZE_CASES:-}" ] && CASE_ARGS=(--case "$SANITIZE_CASES")
mapfile -t PLAN < <($PY "${DRIVER[@]}" --names ${CASE_ARGS[@]+"${CASE_ARGS[@]}"})
if [ "${#PLAN[@]}" -eq 0 ]; then stamp "no cases selected (SANITIZE_CASES='${SANITIZE_CASES:-}')"; exit 2; fi
$PY "${DRIVER[@]}" --list ${CASE_ARGS[@]+"${CASE_ARGS[@]}"} > "$LOGDIR/cases.txt" 2>&1
TRITON_RE=$($PY "${DRIVER[@]}" --kernel-regex)
stamp "${#PLAN[@]} cases (kernels per case: $LOGDIR/cases.txt), tools: $TOOLS, scope: $SCOPE, deadline ${DEADLINE}s"

# The interpreter binary itself (not a wrapper script): --target-processes application-only tracks
# the process compute-sanitizer starts, and only that one.
PY_EXE=$($PY -c 'import sys; print(sys.executable)')
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform PYTHONUNBUFFERED=1
export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-LAZY} TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}

COMMON=(--error-exitcode 1 --print-limit 200 --show-backtrace device)
has target-processes && COMMON+=(--target-processes application-only)
has launch-timeout && COMMON+=(--launch-timeout 300)
has report-api-errors && COMMON+=(--report-api-errors no)
has check-exit-code && COMMON+=(--check-exit-code no)
FILTER=(--kernel-name "regex=^_ZN2te[0-9]" --kernel-name "regex=$TRITON_RE")

filtered() {  # whether tool $1 runs with the kernel filter
  case $SCOPE in
    all) return 1 ;;
    ours) [ "$1" != initcheck ] ;;
    *) [ "$1" = racecheck ] || [ "$1" = synccheck ] ;;
  esac
}

tool_opts() {  # $1 tool, $2 index (port offset): sets OPTS
  local t=$1 v
  OPTS=(--tool "$t")
  case $t in
    memcheck)
      OPTS+=(--leak-check no)
      has padding && OPTS+=(--padding 512)
      has destroy-on-device-error && OPTS+=(--destroy-on-device-error kernel)
      has track-stream-ordered-races && OPTS+=(--track-stream-ordered-races all)
      ;;
    racecheck)
      OPTS+=(--racecheck-report analysis)
      has racecheck-num-workers && OPTS+=(--racecheck-num-workers 4)
      ;;
    initcheck)
      has check-api-memory-access && OPTS+=(--check-api-memory-access yes)
      ;;
    synccheck)
      has destroy-on-device-error && OPTS+=(--destroy-on-device-error kernel)
      ;;
  esac
  if filtered "$t"; then OPTS+=("${FILTER[@]}"); fi
  has port && OPTS+=(--port $((49152 + 32 * $2)))
  # shellcheck disable=SC2206  # word splitting wanted
  OPTS+=(${SANITIZE_EXTRA_ARGS:-})
  v="SANITIZE_EXTRA_ARGS_$t"
  # shellcheck disable=SC2206
  OPTS+=(${!v:-})
}

run_tool() {  # $1 tool, $2 index, $3 budget (seconds): $LOGDIR/<tool>[.partN].log and <tool>.meta
  local tool=$1 idx=$2 budget=$3 start part=1 log rc secs rest ct t1
  local -a todo next
  start=$(now)
  todo=("${PLAN[@]}")
  tool_opts "$tool" "$idx"
  : > "$LOGDIR/$tool.meta"
  while [ "${#todo[@]}" -gt 0 ] && [ "$part" -le 4 ]; do
    rest=$(( budget - ($(now) - start) ))
    if [ "$rest" -lt 30 ]; then echo "part=$part not_started_deadline" >> "$LOGDIR/$tool.meta"; break; fi
    if [ "$part" -eq 1 ]; then log=$LOGDIR/$tool.log; else log=$LOGDIR/$tool.part$part.log; fi
    ct=$(( CASE_TIMEOUT < rest ? CASE_TIMEOUT : rest ))
    stamp "$tool: part $part, ${#todo[@]} cases, ${rest}s left -> $log"
    t1=$(now)
    # shellcheck disable=SC2086  # SANITIZE_DRIVER_ARGS is word-split on purpose
    timeout -s INT -k 30 "$rest" "$CS" "${COMMON[@]}" "${OPTS[@]}" -- \
      "$PY_EXE" "${DRIVER[@]}" --case "$(IFS=,; echo "${todo[*]}")" --case-timeout "$ct" ${SANITIZE_DRIVER_ARGS:-} \
      > "$log" 2>&1
    rc=$?
    secs=$(( $(now) - t1 ))
    echo "part=$part rc=$rc seconds=$secs" >> "$LOGDIR/$tool.meta"
    stamp "$tool: part $part rc=$rc in ${secs}s: $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY|SANITIZE-DONE' "$log" | tr '\n' ' ')"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then break; fi  # stopped at the deadline
    mapfile -t next < <($PY "${DRIVER[@]}" --remaining "$LOGDIR/$tool".*log --case "$(IFS=,; echo "${PLAN[*]}")")
    [ "${#next[@]}" -eq 0 ] && break  # every case ran
    if [ "${#next[@]}" -ge "${#todo[@]}" ]; then
      stamp "$tool: no case started in part $part; not resuming"
      break
    fi
    stamp "$tool: the process ended early; resuming with ${#next[@]} cases"
    todo=("${next[@]}")
    part=$((part + 1))
  done
}

CANARY_LOG=""
FILTERED_TOOLS=""
for t in $TOOLS; do filtered "$t" && FILTERED_TOOLS+="$t "; done
if [ -n "$FILTERED_TOOLS" ]; then
  CANARY_LOG=$LOGDIR/canary.log
  tool_opts memcheck 0
  OPTS+=("${FILTER[@]}")
  budget=$(( $(left) - 30 )); [ "$budget" -gt 180 ] && budget=180
  stamp "canary (memcheck with the kernel filter of: $FILTERED_TOOLS) -> $CANARY_LOG"
  # shellcheck disable=SC2086
  ( timeout -s INT -k 20 "$budget" "$CS" "${COMMON[@]}" "${OPTS[@]}" -- "$PY_EXE" "${DRIVER[@]}" --canary \
      ${SANITIZE_DRIVER_ARGS:-} > "$CANARY_LOG" 2>&1
    stamp "canary: rc=$? $(grep -hE 'ERROR SUMMARY' "$CANARY_LOG" | tr '\n' ' ')" ) &
fi

SKIPPED=()
TOOL_PIDS=()
running() { local n=0 p; for p in ${TOOL_PIDS[@]+"${TOOL_PIDS[@]}"}; do kill -0 "$p" 2>/dev/null && n=$((n + 1)); done; echo "$n"; }
idx=0
for t in $TOOLS; do
  while [ "$(running)" -ge "$JOBS" ]; do sleep 2; done
  budget=$(( $(left) - 30 ))  # 30 s for the summary and for a stopped process to exit
  if [ "$budget" -lt "$MIN_TOOL" ]; then
    SKIPPED+=("$t")
    stamp "SKIPPED $t: ${budget}s left before the ${DEADLINE}s deadline"
    continue
  fi
  idx=$((idx + 1))
  run_tool "$t" "$idx" "$budget" &
  TOOL_PIDS+=($!)
done
wait

$PY "${DRIVER[@]}" --report "$LOGDIR" --tools "$TOOLS" --skipped "${SKIPPED[*]:-}" --filtered "$FILTERED_TOOLS" \
  ${CANARY_LOG:+--canary-log "$CANARY_LOG"} --deadline "$DEADLINE" ${CASE_ARGS[@]+"${CASE_ARGS[@]}"} \
  | tee "$LOGDIR/summary.txt"
rc=${PIPESTATUS[0]}
case $rc in
  0|1|2|3) ;;
  *)  # the summary itself failed: fall back to the raw counts
    stamp "summary failed (rc=$rc); raw counts:"
    grep -HE "ERROR SUMMARY|RACECHECK SUMMARY" "$LOGDIR"/*.log
    if grep -hE "ERROR SUMMARY: [1-9]" "$LOGDIR"/*.log > /dev/null; then rc=1; else rc=2; fi ;;
esac
# one archive of every log too (a device call brings back only a few files of $OUT)
tar -czf "$OUT/sanitize.tar.gz" -C "$OUT" sanitize 2>/dev/null || true
stamp "done: exit $rc (logs in $LOGDIR, also $OUT/sanitize.tar.gz)"
exit "$rc"
