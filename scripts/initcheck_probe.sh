#!/bin/bash
# compute-sanitizer initcheck over tests/gpu/initcheck_probe.py, XLA's GEMM + fusion and te_ops.dense's
# native split path (see that file for the question it answers). From scripts/gpu_run.sh:
#   STEPS="sh:initcheck_probe" bash scripts/gpu_run.sh
PY=${PY:-python3}
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)}
if [ -z "$CS" ]; then echo "compute-sanitizer not found"; exit 2; fi
echo "compute-sanitizer: $CS"
export XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0"
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
for w in xla te; do
  echo "== initcheck: $w"
  timeout 120 "$CS" --tool initcheck --print-limit 8 "$PY" tests/gpu/initcheck_probe.py "$w" 2>&1 \
    | grep -E "PROBE|Uninitialized|     at |by thread|Address|ERROR SUMMARY"
done
