#!/usr/bin/env bash
# Crash diagnosis for the cuDNN fused_attention query (run on the GPU machine after the build).
OUT=${OUT:-/tmp}
cd "$(dirname "$0")/../.."
gcc -shared -fPIC -O1 -o /tmp/segv_bt.so scripts/diag/segv_bt.c
echo "g++: $(g++ --version | head -1)"; which gdb && echo "gdb present"
so=$(python3 -c "import te_ops._native_cudnn as m; print(m.__file__)")
ldd "$so" | grep -E "cudnn|stdc|nvrtc|cuda"
cp "$so" "$OUT/" 2>/dev/null
export CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE=stderr CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=stderr
if which gdb >/dev/null 2>&1; then
  timeout 120 gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 scripts/diag/attention_query.py 2>&1 | grep -v "^\[New Thread\|^\[Thread" | tail -150
else
  LD_PRELOAD=/tmp/segv_bt.so timeout 120 python3 scripts/diag/attention_query.py 2>&1 | tail -150
fi
rc1=${PIPESTATUS[0]}
echo "diag rc=$rc1"
# The default build already links _native_cudnn with a private static libstdc++; the relink below is
# only worth its build time when the query above crashed.
[ "$rc1" = 0 ] && { echo "phase 1 ok: no phase 2"; exit 0; }

# Phase 2: relink _native_cudnn with a private static libstdc++ and query again.
echo "=== phase 2: _native_cudnn with static libstdc++ ==="
python3 -m pip install --no-build-isolation --no-deps -e . "-Ccmake.define.TE_OPS_ONLY=${TE_OPS_ONLY:-}" \
  "-Ccmake.define.TE_OPS_EXCLUDE=${TE_OPS_EXCLUDE:-}" "-Ccmake.define.TE_STATIC_LIBSTDCXX_MODULES=_native_cudnn" \
  > "$OUT/build_static.log" 2>&1 || { tail -30 "$OUT/build_static.log"; echo "static rebuild failed"; exit 1; }
grep "libstdc++ linked statically" "$OUT/build_static.log"
ldd "$(python3 -c "import te_ops._native_cudnn as m; print(m.__file__)")" | grep -E "stdc" || echo "no dynamic libstdc++"
for m in none causal; do
  LD_PRELOAD=/tmp/segv_bt.so timeout 120 python3 scripts/diag/attention_query.py $m 2>&1 | grep -v "^I! \|^i! " | tail -40
  echo "phase 2 ($m) rc=${PIPESTATUS[0]}"
done
