// XLA-FFI handler of te_ops.fp8's block-scaled FP8 GEMM through cuBLASLt (Hopper, cuBLASLt >= 12.9):
//   te_fp8_cublaslt_block_gemm (a[M,K] fp8, sa_t[cdiv(K,128), M] f32, b[N,K] fp8, sb[cdiv(N,128), L4] f32)
//                       -> y[M,N] (bfloat16 or float32)
// y = dequantize(a) @ dequantize(b)^T, with a in 1 x 128 tiles along K (sa_t: a's inverse scales,
// transposed) and b in 128 x 128 blocks (sb: b's inverse scales, the columns padded to
// L4 = round_up(cdiv(K, 128), 4)). The scales are dequantization multipliers (value = fp8 * scale).
// No bias: cuBLASLt's FP8 bias must be bf16, which would change te_ops.fp8's "float32 bias, one
// rounding" rule; calls with a bias keep the Triton / Gluon kernels.
//
// cuBLASLt form. FP8 on Hopper must be "TN" (A transposed, B not). In column-major terms
//     y^T (N x M, ld N) = op_T(b: K x N, ld K) * (a: K x M, ld K)        (m = N, n = M, k = K)
// so cuBLAS's A is our b (2D BLK128x128_32F scales: K-block-major, column stride L4 = our sb
// row-major [cdiv(N,128), L4]) and cuBLAS's B is our a (1D VEC128_32F scales: "N-major", i.e. M
// fastest = our sa_t [cdiv(K,128), M]). cuBLASLt requires M and N multiples of 4 for these layouts,
// 16-byte aligned scale pointers, and refuses E5M2 x E5M2. Partial sums are promoted to float32
// every 128 of K (no fast accumulation with these modes).
//
// Graph safety: exactly dense's plans (dense_gemm.h): the initialize stage creates the plan
// (descriptor with the scale modes, layouts, algorithm timed once on scratch operands and scratch
// scale tensors, never XLA's buffers) and warms the launch once per key in a throwaway capture; the
// execute stage sets the pointers (scale pointers included) under the plan's mutex and enqueues
// cublasLtMatmul on XLA's stream: kCmdBufferCompatible.
#include <cstdint>
#include <cstring>
#include <string>

#include "common/ffi_util.h"
#include "common/runtime.h"
#include "common/targets.h"
#include "dense/dense_gemm.h"

namespace te::dense {
namespace {

using ffi::AnyBuffer;
using ffi::ExecutionStage;
using ffi::Result;

constexpr ExecutionStage kInit = ExecutionStage::kInitialize;
constexpr ExecutionStage kExec = ExecutionStage::kExecute;
constexpr const char* kOp = "fp8_cublaslt_block_gemm";

int64_t Cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string VersionStr(int64_t v) {
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

bool Fp8Type(ffi::DataType dt, cudaDataType_t* c) {
  switch (dt) {
    case ffi::DataType::F8E4M3FN: *c = CUDA_R_8F_E4M3; return true;
    case ffi::DataType::F8E5M2: *c = CUDA_R_8F_E5M2; return true;
    default: return false;
  }
}

// Why this cuBLASLt cannot run the block-scaled FP8 GEMM at all ("" when it can).
std::string VersionError() {
#if TE_CUBLASLT_BLOCK_SCALING
  const int64_t rt = static_cast<int64_t>(cublasLtGetVersion());
  if (rt < kBlockScalingMinVersion) {
    return "the loaded cuBLASLt is " + VersionStr(rt) + " (built against " + VersionStr(CUBLAS_VERSION) +
           "); its FP8 block scale modes (VEC128_32F / BLK128x128_32F) need 12.9 or newer";
  }
  return "";
#else
  return "te_ops._native_cublaslt was built against cuBLASLt headers " + VersionStr(CUBLAS_VERSION) +
         ", which have no FP8 block scale modes (12.9 or newer needed); rebuild against a newer cuBLAS";
#endif
}

// Why cuBLASLt's block-scaled FP8 GEMM cannot take these sizes and types ("" when it can, as far as
// the documented rules go; the heuristic decides the rest).
std::string ShapeError(int64_t m, int64_t n, int64_t k, cudaDataType_t a, cudaDataType_t b, cudaDataType_t d) {
  const std::string mnk = "M=" + std::to_string(m) + ", N=" + std::to_string(n) + ", K=" + std::to_string(k);
  if (m <= 0 || n <= 0 || k <= 0) return "empty dimensions are not supported by the cuBLASLt route (" + mnk + ")";
  if (a == CUDA_R_8F_E5M2 && b == CUDA_R_8F_E5M2) {
    return "cuBLASLt has no E5M2 x E5M2 FP8 GEMM (one operand must be E4M3)";
  }
  if (k % 16 != 0) return "K must be a multiple of 16 (16-byte rows of a and b for the FP8 kernels), got " + mnk;
  if (m % 4 != 0 || n % 4 != 0) {
    return "M and N must be multiples of 4 (cuBLASLt's block scale layouts), got " + mnk;
  }
  const int64_t d_bytes = d == CUDA_R_32F ? 4 : 2;
  if (n * d_bytes % 16 != 0) {
    return "the output rows must be 16-byte aligned (N * " + std::to_string(d_bytes) + " % 16 == 0), got " + mnk;
  }
  return "";
}

// The column-major GEMM of y[M, N] = a[M, K] x b[N, K]^T (see the top of this file).
GemmSpec Fp8BlockGemmSpec(int64_t m, int64_t n, int64_t k, cudaDataType_t a_type, cudaDataType_t b_type,
                          cudaDataType_t d_type) {
  GemmSpec s;
  s.ab_type = b_type;  // cuBLAS's A is our b
  s.b_type = a_type == b_type ? -1 : static_cast<int32_t>(a_type);
  s.d_type = d_type;
  s.trans_a = true;
  s.m = static_cast<uint64_t>(n);
  s.n = static_cast<uint64_t>(m);
  s.k = static_cast<uint64_t>(k);
  s.lda = k;
  s.ldb = k;
  s.ldd = n;
#if TE_CUBLASLT_BLOCK_SCALING
  s.scale_mode_a = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  s.scale_mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
#else
  s.scale_mode_a = 5;  // never reaches cuBLASLt: CreateDescriptors refuses scale modes on old headers
  s.scale_mode_b = 4;
#endif
  return s;
}

template <ExecutionStage kStage>
ffi::Error Fp8BlockGemm(cudaStream_t stream, int32_t device, AnyBuffer a, AnyBuffer sa_t, AnyBuffer b, AnyBuffer sb,
                        ffi::RemainingArgs, Result<AnyBuffer> y) {
  const char* op = kOp;
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[1]) {
    return InvalidArgument(op, "expected a [M, K] and b [N, K] (the right operand transposed, K-major), got a " +
                                   ShapeStr(ad) + ", b " + ShapeStr(bd));
  }
  cudaDataType_t at, bt, dt;
  if (!Fp8Type(a.element_type(), &at)) {
    return InvalidArgument(op, std::string("a must be float8_e4m3fn or float8_e5m2, got ") +
                                   DTypeName(a.element_type()));
  }
  if (!Fp8Type(b.element_type(), &bt)) {
    return InvalidArgument(op, std::string("b must be float8_e4m3fn or float8_e5m2, got ") +
                                   DTypeName(b.element_type()));
  }
  if (y->element_type() == ffi::DataType::BF16) {
    dt = CUDA_R_16BF;
  } else if (y->element_type() == ffi::DataType::F32) {
    dt = CUDA_R_32F;
  } else {
    return InvalidArgument(op, std::string("output y must be bfloat16 or float32, got ") +
                                   DTypeName(y->element_type()));
  }
  const int64_t m = ad[0], k = ad[1], n = bd[0];
  const int64_t kb = Cdiv(k, 128), kb4 = Cdiv(kb, 4) * 4, nb = Cdiv(n, 128);
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != m || yd[1] != n) {
    return InvalidArgument(op, "output y must be [M, N] = [" + std::to_string(m) + ", " + std::to_string(n) +
                                   "], got " + ShapeStr(yd));
  }
  auto sad = sa_t.dimensions();
  if (sa_t.element_type() != ffi::DataType::F32 || sad.size() != 2 || sad[0] != kb || sad[1] != m) {
    return InvalidArgument(op, "sa_t (a's 1x128 inverse scales, transposed) must be float32 [cdiv(K, 128), M] = [" +
                                   std::to_string(kb) + ", " + std::to_string(m) + "], got " +
                                   DTypeName(sa_t.element_type()) + " " + ShapeStr(sad));
  }
  auto sbd = sb.dimensions();
  if (sb.element_type() != ffi::DataType::F32 || sbd.size() != 2 || sbd[0] != nb || sbd[1] != kb4) {
    return InvalidArgument(op, "sb (b's 128x128 inverse scales) must be float32 [cdiv(N, 128), round_up(cdiv(K, 128), "
                               "4)] = [" + std::to_string(nb) + ", " + std::to_string(kb4) + "] (pad the columns "
                               "to a multiple of 4: cuBLASLt's column stride), got " +
                                   DTypeName(sb.element_type()) + " " + ShapeStr(sbd));
  }
  std::string why = VersionError();
  if (!why.empty()) return ffi::Error(ffi::ErrorCode::kUnimplemented, std::string("te_ops.") + op + ": " + why);
  why = ShapeError(m, n, k, at, bt, dt);
  if (!why.empty()) return InvalidArgument(op, why + " (a " + ShapeStr(ad) + ", b " + ShapeStr(bd) + ")");
  if (Alignment(sa_t.untyped_data()) < 16 || Alignment(sb.untyped_data()) < 16) {
    return InvalidArgument(op, "the scale tensors must be 16-byte aligned (cuBLASLt's rule for block scales)");
  }

  GemmSpec spec = Fp8BlockGemmSpec(m, n, k, at, bt, dt);
  spec.align_a = Alignment(b.untyped_data());
  spec.align_b = Alignment(a.untyped_data());
  spec.align_d = Alignment(y->untyped_data());
  GemmPtrs ptrs;
  ptrs.a = b.untyped_data();
  ptrs.b = a.untyped_data();
  ptrs.d = y->untyped_data();
  ptrs.scale_a = sb.untyped_data();
  ptrs.scale_b = sa_t.untyped_data();

  constexpr bool kCreate = kStage == kInit;
  DeviceState* dev = nullptr;
  TE_RETURN_IF_ERROR(GetDeviceState(op, device, kCreate, &dev));
  bool timing = false;
  if constexpr (kCreate) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    timing = !(cudaStreamIsCapturing(stream, &cs) == cudaSuccess && cs != cudaStreamCaptureStatusNone);
  }
  GemmPlan* plan = nullptr;
  TE_RETURN_IF_ERROR(GetPlan(op, device, *dev, spec, ptrs, /*create=*/true, timing, &plan));
  if (plan == nullptr) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string("te_ops.") + op + ": cuBLASLt returned no algorithm for the block-scaled FP8 " +
                          spec.Describe() + " (a " + ShapeStr(ad) + ", b " + ShapeStr(bd) +
                          "); te_ops.fp8.triton.cublaslt_gemm_unavailable_reason asks beforehand");
  }
  auto launch = [&](cudaStream_t s) { return RunGemm(op, *dev, *plan, ptrs, s); };
  if constexpr (kStage == kInit) {
    return WarmOnce(op, device, plan->spec.Key() + "|f" + std::to_string(plan->forced), launch);
  } else {
    RecordExecute(Counters(op), stream);
    return launch(stream);
  }
}

template <ExecutionStage kStage>
auto BindFp8BlockGemm() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<AnyBuffer>()  // a [M, K] fp8
      .template Arg<AnyBuffer>()  // sa_t [cdiv(K, 128), M] f32
      .template Arg<AnyBuffer>()  // b [N, K] fp8
      .template Arg<AnyBuffer>()  // sb [cdiv(N, 128), round_up(cdiv(K, 128), 4)] f32
      .RemainingArgs()            // optional output buffer aliased to the result (tests poison it)
      .template Ret<AnyBuffer>();  // y [M, N] bf16 / f32
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kFp8BlockGemmInit, Fp8BlockGemm<kInit>, BindFp8BlockGemm<kInit>());
XLA_FFI_DEFINE_HANDLER(kFp8BlockGemmExec, Fp8BlockGemm<kExec>, BindFp8BlockGemm<kExec>(),
                       {ffi::Traits::kCmdBufferCompatible});

}  // namespace te::dense

namespace te {
namespace {

const TargetRegistrar kRegister({
    {"te_fp8_cublaslt_block_gemm", dense::kFp8BlockGemmInit, dense::kFp8BlockGemmExec},
});

}  // namespace
}  // namespace te

// Support query for Python (te_ops.fp8.cublaslt, through ctypes, like te_fused_attention_query):
// whether te_fp8_cublaslt_block_gemm can run y[M, N] = a[M, K] x b[N, K]^T on CUDA device `device`
// (-1: the current one): the cuBLASLt version, the documented size rules, then cuBLASLt's heuristic
// for the exact spec (nothing is cached or allocated but a process-wide query handle; needs a GPU).
//
// ints: device, m, n, k, a format (0 E4M3, 1 E5M2), b format, output (0 bfloat16, 1 float32).
// Returns 0 when supported, 1 when not (err filled with the reason), 2 on bad arguments.
extern "C" __attribute__((visibility("default"))) int te_fp8_cublaslt_block_gemm_query(const int64_t* ints,
                                                                                        int n_ints, char* err,
                                                                                        int err_len) {
  using namespace te::dense;
  auto fail = [&](const std::string& msg, int code) {
    if (err != nullptr && err_len > 0) {
      std::strncpy(err, msg.c_str(), static_cast<size_t>(err_len - 1));
      err[err_len - 1] = '\0';
    }
    return code;
  };
  if (ints == nullptr || n_ints != 7) return fail("te_fp8_cublaslt_block_gemm_query: expected 7 ints", 2);
  const auto fmt = [](int64_t c) { return c == 1 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3; };
  if (ints[4] < 0 || ints[4] > 1 || ints[5] < 0 || ints[5] > 1 || ints[6] < 0 || ints[6] > 1) {
    return fail("te_fp8_cublaslt_block_gemm_query: format codes must be 0 or 1", 2);
  }
  const cudaDataType_t at = fmt(ints[4]), bt = fmt(ints[5]);
  const cudaDataType_t dt = ints[6] == 1 ? CUDA_R_32F : CUDA_R_16BF;
  std::string why = VersionError();
  if (why.empty()) why = ShapeError(ints[1], ints[2], ints[3], at, bt, dt);
  if (!why.empty()) return fail(why, 1);
  const GemmSpec spec = Fp8BlockGemmSpec(ints[1], ints[2], ints[3], at, bt, dt);
  int count = 0;
  te::ffi::Error e = CountAlgorithms(kOp, static_cast<int>(ints[0]), spec, &count);
  if (e.failure()) return fail(e.message(), 1);
  if (count == 0) return fail("cuBLASLt returned no algorithm for the block-scaled FP8 " + spec.Describe(), 1);
  return 0;
}

// The cuBLASLt versions (major * 10000 + minor * 100 + patch) of the build's headers (which = 0) and
// of the library loaded now (which = 1; cublasLtGetVersion, no GPU needed), for te_ops.fp8.cublaslt.
extern "C" __attribute__((visibility("default"))) int64_t te_cublaslt_version(int which) {
  return which == 0 ? static_cast<int64_t>(CUBLAS_VERSION) : static_cast<int64_t>(cublasLtGetVersion());
}
