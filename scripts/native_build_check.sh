#!/usr/bin/env bash
# Compile and link every native module (dense/cuBLASLt, fused_attention/cuDNN, softmax, router) on a
# machine WITHOUT a GPU and without cuBLAS/cuDNN in its CUDA toolkit, against the headers and libraries
# of NVIDIA's pip wheels, then load each module in Python (registrations, no GPU needed). Catches
# compile errors, link errors and undefined symbols before a GPU session is spent on them. Then checks
# that the cuBLASLt FP8 route's rule table (te_ops/fp8/cublaslt_rules.def) as compiled into
# _native_cublaslt answers exactly as Python reads it (tests/te_ops/test_fp8_cublaslt.py -k native_rules).
#
#   bash scripts/native_build_check.sh            # all ops, build tree in /tmp/te_native_check
#   OPS=dense bash scripts/native_build_check.sh  # one op folder
#
# Needs nvcc, cmake, ninja and a Python 3.12 with jax (jaxlib's XLA FFI headers) and nanobind
# (PYTHON, default .venv/bin/python). Downloads (pip download, cached in $WHEELS) nvidia-cublas,
# nvidia-cudnn-cu13 and nvidia-cuda-nvrtc; the cuDNN frontend headers come from .whl/ or
# nvidia-cudnn-frontend. Nothing is installed into the project's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
WORK=${WORK:-/tmp/te_native_check}
WHEELS=${WHEELS:-$WORK/wheels}
SDK=$WORK/sdk
mkdir -p "$WHEELS" "$SDK"

fetch() {  # fetch <distribution>: its wheel in $WHEELS (downloaded once)
  compgen -G "$WHEELS/${1//-/_}-*.whl" > /dev/null || "$PY" -m pip download -q --no-deps -d "$WHEELS" "$1"
  ls "$WHEELS/${1//-/_}"-*.whl | sort | tail -1
}
unpack() {  # unpack <wheel> <pattern>...: members into $SDK
  local whl=$1; shift
  (cd "$SDK" && unzip -q -o "$whl" "$@")
}

unpack "$(fetch nvidia-cublas)" 'nvidia/cu13/include/*' 'nvidia/cu13/lib/libcublasLt.so*'
unpack "$(fetch nvidia-cuda-nvrtc)" 'nvidia/cu13/include/*' 'nvidia/cu13/lib/libnvrtc.so*'
unpack "$(fetch nvidia-cudnn-cu13)" 'nvidia/cudnn/include/*' 'nvidia/cudnn/lib/libcudnn.so.9'
fe_whl=$(ls "$ROOT"/.whl/nvidia_cudnn_frontend-*.whl 2>/dev/null | sort | tail -1 || true)
[ -n "$fe_whl" ] || fe_whl=$(fetch nvidia-cudnn-frontend)
unpack "$fe_whl" 'include/*'
# unversioned names for find_library
ln -sf "$(basename "$(ls "$SDK"/nvidia/cu13/lib/libcublasLt.so.* | head -1)")" "$SDK/nvidia/cu13/lib/libcublasLt.so"
ln -sf "$(basename "$(ls "$SDK"/nvidia/cu13/lib/libnvrtc.so.* | grep -v builtins | head -1)")" "$SDK/nvidia/cu13/lib/libnvrtc.so"
ln -sf libcudnn.so.9 "$SDK/nvidia/cudnn/lib/libcudnn.so"

"$PY" -c "import nanobind" 2>/dev/null || { echo "nanobind missing in $PY (pip install nanobind)"; exit 2; }
BUILD=$WORK/build
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DPython_EXECUTABLE="$PY" \
  -DTE_OPS_ONLY="${OPS:-}" -DTE_OPS_EXCLUDE= -DCMAKE_CUDA_ARCHITECTURES="${ARCH:-90a}" \
  -DTE_CUBLAS_ROOT="$SDK/nvidia/cu13" -DTE_CUDNN_ROOT="$SDK/nvidia/cudnn" \
  -DTE_CUDNN_FRONTEND_INCLUDE="$SDK/include" -DTE_NVRTC_ROOT="$SDK/nvidia/cu13" | grep -E "te_ops|Error" || true
cmake --build "$BUILD" -j"$(nproc)" 2>&1 | grep -vE "api\.h:[0-9]+:[0-9]+: warning: control reaches|In (static )?member function|^In file included|^\s+from|^/.*: In function" | grep -E "error|FAILED|warning" || true
cmake --build "$BUILD" -j"$(nproc)" > /dev/null  # fails the script on a build error

# Load every module (undefined symbols fail here) and list its FFI targets.
export LD_LIBRARY_PATH="$SDK/nvidia/cu13/lib:$SDK/nvidia/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$PY" - "$BUILD" <<'PY'
import glob, importlib.util, os, sys
build = sys.argv[1]
mods = sorted(glob.glob(os.path.join(build, "_native*.so")))
if not mods:
    sys.exit("no module built")
for path in mods:
    name = os.path.basename(path).split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    regs = m.registrations() if callable(m.registrations) else m.registrations
    print(f"{name}: loads; FFI targets: {', '.join(sorted(regs))}")
PY
# The rule table of the cuBLASLt FP8 route, C++ vs Python (te_fp8_cublaslt_block_gemm_static_reason: no GPU)
if compgen -G "$BUILD/_native_cublaslt*.so" > /dev/null; then
  TE_NATIVE_CHECK_BUILD=$BUILD "$PY" -m pytest -q -p no:cacheprovider tests/te_ops/test_fp8_cublaslt.py -k native_rules
fi
echo "native build check: OK"
