#!/usr/bin/env bash
# Named GPU runs: each preset sets the STEPS and arguments of one scripts/gpu_run.sh call that fits in
# one device command (10 minutes), so a short GPU window runs exactly the planned measurement.
#
#   bash scripts/gpu_preset.sh list           # the presets and what each decides
#   bash scripts/gpu_preset.sh switches       # then: bash scripts/gpu_preset.sh fp8_routes, ...
#
# Variables already set in the environment win over a preset's (e.g. DEADLINE=300 for a short window).
# The results come back as gpu_run.sh's $OUT/results.tar.gz; docs/gpu_script.md says how to publish them.
set -euo pipefail
cd "$(dirname "$0")/.."

preset=${1:-list}
set_default() { if [ -z "${!1+x}" ]; then export "$1=$2"; fi; }

case "$preset" in
  list)
    cat <<'EOF'
switches     GPU tests of the off-by-default switches and their end-to-end effect: grouped_ffn (tests and
             benchmarks/grouped_ffn.py) -> te_layers._common.BF16_FUSED_FFN; the FP8 fused FFN and
             requantize tests -> FP8_FUSED_FFN, te_ops.fp8.dispatch.REQUANTIZE_KERNEL; master kernels;
             train_moe with te_layers, te_layers_fused_ffn, strong_cf1.25, te_layers_fp8_block(_fused).
             The Gluon FFN kernels (never yet run on a GPU) are left out until the last step, their tests.
ffn_gluon    The Gluon warp-specialized grouped_ffn kernels: their GPU tests, benchmarks/grouped_ffn.py
             (all variants) and train_moe te_layers vs te_layers_fused_ffn(_gluon) -> DEFAULT_FFN_ACT /
             DEFAULT_FFN_DACT in te_ops/grouped_dense/triton.py.
fp8_routes   The Gluon dense / cuBLASLt FP8 routes and the Gluon dual quantize: test_fp8_cublaslt_gpu and
             benchmarks/fp8.py dense,quant,ffn -> te_ops.fp8.triton GEMM_KERNEL / DUAL_KERNEL.
fp8_model    benchmarks/fp8.py gemm,grouped_model and benchmarks/grouped_dense.py (torch rows).
hardening    Issue 20: benchmarks/long_run.py Part B (merged), the GPU property tests, compute-sanitizer
             racecheck, the concurrency / command-buffer tests, the initcheck probe.
EOF
    exit 0
    ;;
  switches)
    set_default STEPS "test:test_grouped_ffn_gpu bench:grouped_ffn test:test_fp8_gpu test:test_grouped_dense_gpu bench:train_moe test:test_grouped_ffn_gpu"
    set_default PYTEST_ARGS_test_grouped_ffn_gpu "-n 4 -k 'not gluon'"
    set_default TEST_TIMEOUT_test_grouped_ffn_gpu 120
    set_default PYTEST_ARGS_test_grouped_ffn_gpu_repeat "-n 4 -k gluon"
    set_default TEST_TIMEOUT_test_grouped_ffn_gpu_repeat 90
    set_default BENCH_ARGS_grouped_ffn "--skip Gluon"
    set_default BENCH_TIMEOUT_grouped_ffn 90
    set_default PYTEST_ARGS_test_fp8_gpu "-n 4 -k 'gluon_dual or requantize or ffn or grouped_dense_triton_path or fp8_dense_triton_path'"
    set_default TEST_TIMEOUT_test_fp8_gpu 150
    set_default PYTEST_ARGS_test_grouped_dense_gpu "-k master"
    set_default TEST_TIMEOUT_test_grouped_dense_gpu 60
    set_default BENCH_ARGS_train_moe "--models te_layers,te_layers_fused_ffn,strong_cf1.25,te_layers_fp8_block,te_layers_fp8_block_fused --rounds 3"
    set_default BENCH_TIMEOUT_train_moe 230
    ;;
  ffn_gluon)
    set_default STEPS "test:test_grouped_ffn_gpu bench:grouped_ffn bench:train_moe"
    set_default PYTEST_ARGS_test_grouped_ffn_gpu "-n 4 -k gluon"
    set_default TEST_TIMEOUT_test_grouped_ffn_gpu 120
    set_default BENCH_TIMEOUT_grouped_ffn 120
    set_default BENCH_ARGS_train_moe "--models te_layers,te_layers_fused_ffn,te_layers_fused_ffn_gluon,strong_cf1.25 --rounds 3"
    set_default BENCH_TIMEOUT_train_moe 240
    ;;
  fp8_routes)
    set_default STEPS "test:test_fp8_cublaslt_gpu bench:fp8"
    set_default FP8_BENCH_SECTIONS "dense,quant,ffn"
    set_default FP8_DENSE_MATCH "bf16 te_ops,block"
    set_default BENCH_TIMEOUT_fp8 400
    ;;
  fp8_model)
    set_default STEPS "bench:fp8 bench:grouped_dense"
    set_default FP8_BENCH_SECTIONS "gemm,grouped_model"
    set_default BENCH_TIMEOUT_fp8 300
    set_default BENCH_ARGS_grouped_dense "--no-sweep --no-ragged"
    set_default BENCH_TIMEOUT_grouped_dense 200
    ;;
  hardening)
    set_default STEPS "bench:long_run test:test_property_gpu sh:sanitize test:test_concurrency_gpu sh:initcheck_probe"
    set_default BENCH_ARGS_long_run "--parts B --merge benchmarks/results/h200/long_run.json"
    set_default BENCH_TIMEOUT_long_run 150
    set_default TEST_TIMEOUT_test_property_gpu 120
    set_default SANITIZE_TOOLS racecheck
    set_default PYTEST_ARGS_test_concurrency_gpu "-n 1"
    ;;
  *)
    echo "gpu_preset: unknown preset '$preset' (bash scripts/gpu_preset.sh list)" >&2
    exit 2
    ;;
esac
set_default DEADLINE 540
export DEADLINE
if [ -n "${GPU_PRESET_PRINT:-}" ]; then  # show the settings instead of running (tests/te_ops/test_gpu_preset.py)
  env | grep -E '^(STEPS|DEADLINE|PYTEST_ARGS_|TEST_TIMEOUT_|BENCH_ARGS_|BENCH_TIMEOUT_|FP8_|SANITIZE_)' | sort
  exit 0
fi
exec bash scripts/gpu_run.sh
