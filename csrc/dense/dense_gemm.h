// cuBLASLt plumbing for dense: per-device state (handle + workspace) and cached GEMM plans
// (descriptors, layouts, chosen algorithm). Everything here is created in the FFI initialize stage;
// the execute stage only looks plans up and enqueues cublasLtMatmul on XLA's stream.
//
// Layout convention. JAX arrays are row-major; cuBLAS is column-major. A row-major [R, C] array is
// the column-major C x R matrix with leading dimension C, i.e. its transpose. So for
// y[M, N] = x[M, K] @ w[K, N] we ask cuBLASLt for the column-major product
//     y^T (N x M) = w^T (N x K, ld N) * x^T (K x M, ld K)        (m = N, n = M, k = K, no transposes)
// and the bias (length N) is per row of cuBLAS's D, which is what the BIAS epilogues broadcast.
// Backward:
//     dx^T (K x M) = op_T(w^T) * dz^T           (m = K, n = M, k = N, transa = T)
//     dw^T (N x K) = dz^T * op_T(x^T)           (m = N, n = K, k = M, transb = T; BGRADA = sum_M dz)
// No array is ever transposed in memory: only the cuBLAS op flags change.
//
// FP8 block scaling (te_fp8_cublaslt_block_gemm, fp8_block_gemm_ffi.cc) uses the same plans: a spec with
// scale modes (CUBLASLT_MATMUL_DESC_A/B_SCALE_MODE, cuBLASLt >= 12.9) and the two scale tensors'
// pointers in GemmPtrs. Specs without scale modes (every bf16/f16/f32 dense GEMM) set no scale
// attribute at all, exactly as before the FP8 route existed.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/ffi_util.h"

// cuBLASLt's 128-element 1D (VEC128_32F) and 128x128 2D (BLK128x128_32F) FP8 scale modes exist from
// cuBLAS 12.9 (Hopper only); older headers build the module without the FP8 block-scaled route (the
// route's version rules, te_ops/fp8/cublaslt_rules.def, then refuse every call at run time).
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120900
#define TE_CUBLASLT_BLOCK_SCALING 1
#else
#define TE_CUBLASLT_BLOCK_SCALING 0
#endif

namespace te::dense {

struct DeviceState {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// The device's state, created (handle + cudaMalloc'd workspace) on first use when `create`.
ffi::Error GetDeviceState(const char* op, int device, bool create, DeviceState** out);

struct GemmSpec {
  cudaDataType_t ab_type = CUDA_R_32F;  // A and B
  cudaDataType_t d_type = CUDA_R_32F;   // C and D (and bias / aux / bias gradient)
  bool trans_a = false;
  bool trans_b = false;
  uint64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  int64_t aux_ld = 0;  // GELU_AUX: leading dimension of the aux (pre-activation) matrix
  // Pointer alignments (bytes, capped at 16) the algorithm must accept.
  int align_a = 16, align_b = 16, align_d = 16, align_bias = 16, align_aux = 16;
  // FP8 only: B's cudaDataType_t when it differs from A's (E4M3 x E5M2); -1: B is ab_type too.
  int32_t b_type = -1;
  // FP8 block scaling only: cublasLtMatmulMatrixScale_t of A and B (CUBLASLT_MATMUL_DESC_A/B_SCALE_MODE,
  // with GemmPtrs::scale_a / scale_b); -1: no scale attribute is set (every non-FP8 GEMM).
  int32_t scale_mode_a = -1, scale_mode_b = -1;

  cudaDataType_t BType() const { return b_type < 0 ? ab_type : static_cast<cudaDataType_t>(b_type); }
  bool Scaled() const { return scale_mode_a >= 0 || scale_mode_b >= 0; }

  std::string Key() const;
  std::string Describe() const;  // for error messages
};

struct GemmPtrs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  void* bias = nullptr;  // bias (read) or bias gradient (written)
  void* aux = nullptr;
  const void* scale_a = nullptr;  // FP8 block scaling: A's / B's float32 dequantization scales
  const void* scale_b = nullptr;
};

struct GemmPlan {
  GemmSpec spec;
  int device = 0;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_bytes = 0;
  int candidates = 0;     // heuristic results considered
  int own_candidates = 0;  // of which the first own_candidates are the heuristic's for this epilogue
                           // (the rest: from the simpler epilogues' lists, accepted by AlgoCheck)
  float best_ms = -1.0f;  // timed (initialize stage) or -1 when the heuristic's first choice was taken
  int chosen = 0;         // index of the chosen candidate in the heuristic's order
  int forced = -1;        // the ForcedCandidate() it was created under (-1: chosen by timing)
  std::vector<float> candidate_ms;  // each candidate's best time (-1: refused or not timed)
  std::mutex mu;          // the descriptor's pointer attributes are set per call
  ~GemmPlan();
};

int Alignment(const void* p);

// The cached plan for `spec` on `device`. When missing it is created: descriptors, layouts and the
// heuristic's top candidates (those cublasLtMatmulAlgoCheck accepts within the workspace); when
// `time_candidates` the candidates are timed once on scratch buffers (cudaMalloc'd and freed here,
// never XLA's buffers, which may still be in use by earlier work) and the fastest is kept. *plan is
// null (and the result Success) when cuBLASLt has no algorithm for the spec (e.g. an epilogue it does
// not support for these shapes): the caller falls back.
ffi::Error GetPlan(const char* op, int device, DeviceState& dev, const GemmSpec& spec, const GemmPtrs& ptrs,
                   bool create, bool time_candidates, GemmPlan** plan);

// Test hook (te_ops._native_cublaslt.dense_force_candidate): while >= 0, plans created from then on
// take candidate min(i, candidates - 1) of their list instead of the fastest (cached under their own
// key, so every listed algorithm can be checked against the reference). -1 (default): timing decides.
int ForcedCandidate();
void SetForcedCandidate(int i);

// A chosen algorithm's cuBLASLt configuration (CUBLASLT_ALGO_CONFIG_*; -1 where unreadable).
struct AlgoInfo {
  int64_t id = -1, tile = -1, stages = -1, split_k = -1, reduction_scheme = -1, swizzle = -1, custom = -1,
          cluster_shape = -1;
};

// What the plan cache holds (for diagnostics: te_ops._native_cublaslt.dense_plans()).
struct PlanInfo {
  int device = 0;
  std::string describe;
  uint64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  int epilogue = 0;
  int candidates = 0, own_candidates = 0, chosen = 0, forced = -1;
  float best_ms = -1.0f;
  std::vector<float> candidate_ms;
  AlgoInfo algo;
};
std::vector<PlanInfo> PlanSnapshot();

// Enqueues the GEMM on `stream` (no allocation, no synchronisation).
ffi::Error RunGemm(const char* op, DeviceState& dev, GemmPlan& plan, const GemmPtrs& ptrs, cudaStream_t stream);

// The float32 scale tensor of an FP8 block-scaled operand whose op() is outer x k (outer: m for A, n
// for B), as the row-major [rows, cols] array cuBLASLt reads: VEC128_32F [cdiv(k, 128), outer] (outer
// fastest), BLK128x128_32F [cdiv(outer, 128), round_up(cdiv(k, 128), 4)] (the 128-blocks of k fastest,
// with cuBLASLt's fixed column stride, a multiple of 4); {0, 0} for other modes (and on headers
// without the scale modes).
struct ScaleDims {
  int64_t rows = 0, cols = 0;
  int64_t Elements() const { return rows * cols; }
};
ScaleDims ScaleShape(int32_t mode, uint64_t outer, uint64_t k);

// Support query without XLA buffers or a plan (nothing cached): how many candidates GetPlan would
// consider for `spec` on CUDA device `device` (-1: the current one) before timing them (the
// heuristic's results that cublasLtMatmulAlgoCheck accepts within the workspace: the same helper),
// with 256-byte aligned stand-in pointers (XLA's buffers are aligned at least that much; the spec's
// align_* still cap what the algorithms may assume), into *count (0: none). Uses a process-wide query
// handle (no workspace allocation). Needs a GPU.
ffi::Error CountAlgorithms(const char* op, int device, const GemmSpec& spec, int* count);

}  // namespace te::dense
