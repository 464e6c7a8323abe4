// XLA-FFI handler of te_ops.fp8's block-scaled FP8 GEMM through cuBLASLt (Hopper, cuBLASLt >= 12.9):
//   te_fp8_cublaslt_block_gemm (a[M,K] fp8, sa_t[cdiv(K,128), M] f32, b[N,K] fp8, sb[cdiv(N,128), L4] f32)
//                       -> y[M,N] (bfloat16 or float32)
// y = dequantize(a) @ dequantize(b)^T, with a in 1 x 128 tiles along K (sa_t: a's inverse scales,
// transposed) and b in 128 x 128 blocks (sb: b's inverse scales, the columns padded to
// L4 = round_up(cdiv(K, 128), 4)). The scales are dequantization multipliers (value = fp8 * scale).
// No bias: cuBLASLt's FP8 bias must be bf16, which would change te_ops.fp8's "float32 bias, one
// rounding" rule; calls with a bias keep the Triton / Gluon kernels.
//
// Which calls the route refuses (sizes, formats, cuBLASLt version) is one table,
// te_ops/fp8/cublaslt_rules.def, compiled in here (StaticReason) and read by te_ops/fp8/cublaslt.py
// only where this module is not loaded; where it is, Python asks te_fp8_cublaslt_block_gemm_static_reason.
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

std::string VersionStr(int64_t v) {
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

struct RuleValue {
  const char* name;
  int64_t value;
};

// A rule's message with its {name} fields replaced by the values ({name:v}: as a cuBLASLt version).
template <size_t N>
std::string FormatRule(const char* msg, const RuleValue (&values)[N]) {
  std::string out;
  for (const char* p = msg; *p != '\0';) {
    const char* close = *p == '{' ? std::strchr(p, '}') : nullptr;
    if (close == nullptr) {
      out += *p++;
      continue;
    }
    std::string field(p + 1, close);
    const bool version = field.size() > 2 && field.compare(field.size() - 2, 2, ":v") == 0;
    if (version) field.resize(field.size() - 2);
    const RuleValue* v = nullptr;
    for (const RuleValue& c : values) v = v == nullptr && field == c.name ? &c : v;
    if (v == nullptr) {
      out.append(p, close + 1);  // not a value: kept as written
    } else {
      out += version ? VersionStr(v->value) : std::to_string(v->value);
    }
    p = close + 1;
  }
  return out;
}

// Why the route refuses y[M, N] = a[M, K] x b[N, K]^T with these formats and output (a_e5m2 / b_e5m2:
// 1 for E5M2, 0 for E4M3; out_bytes 2 bfloat16, 4 float32) with this build's cuBLASLt headers and the
// library loaded now: the first rule of te_ops/fp8/cublaslt_rules.def that holds ("" when none does;
// cuBLASLt's heuristic decides the rest). No GPU needed.
std::string StaticReason(int64_t m, int64_t n, int64_t k, int64_t a_e5m2, int64_t b_e5m2, int64_t out_bytes) {
  const int64_t header = static_cast<int64_t>(CUBLAS_VERSION);
  const int64_t runtime = static_cast<int64_t>(cublasLtGetVersion());
  const RuleValue values[] = {{"m", m},           {"n", n},           {"k", k},
                              {"a_e5m2", a_e5m2}, {"b_e5m2", b_e5m2}, {"out_bytes", out_bytes},
                              {"header", header}, {"runtime", runtime}};
#define TE_FP8_BLOCK_RULE(condition, message) \
  if (condition) return FormatRule(message, values);
#include "../../te_ops/fp8/cublaslt_rules.def"
#undef TE_FP8_BLOCK_RULE
  return "";
}

// v: the six rule values of the ctypes symbols (m, n, k, a_e5m2, b_e5m2, out_bytes): "" when the
// format and output codes are well formed, else why not.
std::string CodeError(const int64_t* v) {
  if (v[3] < 0 || v[3] > 1 || v[4] < 0 || v[4] > 1 || (v[5] != 2 && v[5] != 4)) {
    return "the formats must be 0 (E4M3) or 1 (E5M2) and the output 2 (bfloat16) or 4 (float32) bytes, got " +
           std::to_string(v[3]) + ", " + std::to_string(v[4]) + ", " + std::to_string(v[5]);
  }
  return "";
}

bool Fp8Type(ffi::DataType dt, cudaDataType_t* c) {
  switch (dt) {
    case ffi::DataType::F8E4M3FN: *c = CUDA_R_8F_E4M3; return true;
    case ffi::DataType::F8E5M2: *c = CUDA_R_8F_E5M2; return true;
    default: return false;
  }
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
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != m || yd[1] != n) {
    return InvalidArgument(op, "output y must be [M, N] = [" + std::to_string(m) + ", " + std::to_string(n) +
                                   "], got " + ShapeStr(yd));
  }
  // Python never sends a call the rules refuse (te_ops.fp8.cublaslt.unavailable_reason): a guard
  const std::string why = StaticReason(m, n, k, at == CUDA_R_8F_E5M2, bt == CUDA_R_8F_E5M2, dt == CUDA_R_32F ? 4 : 2);
  if (!why.empty()) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, std::string("te_ops.") + op + ": " + why + " (a " +
                                                          ShapeStr(ad) + ", b " + ShapeStr(bd) + ")");
  }
  GemmSpec spec = Fp8BlockGemmSpec(m, n, k, at, bt, dt);
  // The scale layouts cuBLASLt reads for this spec (dense_gemm.h): cuBLAS's B scales are our a's, its
  // A scales our b's
  const ScaleDims sa_dims = ScaleShape(spec.scale_mode_b, spec.n, spec.k);
  const ScaleDims sb_dims = ScaleShape(spec.scale_mode_a, spec.m, spec.k);
  auto sad = sa_t.dimensions();
  if (sa_t.element_type() != ffi::DataType::F32 || sad.size() != 2 || sad[0] != sa_dims.rows ||
      sad[1] != sa_dims.cols) {
    return InvalidArgument(op, "sa_t (a's 1x128 inverse scales, transposed) must be float32 [cdiv(K, 128), M] = [" +
                                   std::to_string(sa_dims.rows) + ", " + std::to_string(sa_dims.cols) + "], got " +
                                   DTypeName(sa_t.element_type()) + " " + ShapeStr(sad));
  }
  auto sbd = sb.dimensions();
  if (sb.element_type() != ffi::DataType::F32 || sbd.size() != 2 || sbd[0] != sb_dims.rows ||
      sbd[1] != sb_dims.cols) {
    return InvalidArgument(op, "sb (b's 128x128 inverse scales) must be float32 [cdiv(N, 128), round_up(cdiv(K, 128), "
                               "4)] = [" + std::to_string(sb_dims.rows) + ", " + std::to_string(sb_dims.cols) +
                                   "] (pad the columns to a multiple of 4: cuBLASLt's column stride), got " +
                                   DTypeName(sb.element_type()) + " " + ShapeStr(sbd));
  }
  if (Alignment(sa_t.untyped_data()) < 16 || Alignment(sb.untyped_data()) < 16) {
    return InvalidArgument(op, "the scale tensors must be 16-byte aligned (cuBLASLt's rule for block scales)");
  }
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
                          "); te_ops.fp8.cublaslt.unavailable_reason asks beforehand");
  }
  auto launch = [&](cudaStream_t s) { return RunGemm(op, *dev, *plan, ptrs, s); };
  auto key = [&] { return plan->spec.Key() + "|f" + std::to_string(plan->forced); };
  return WarmOrExecute<kStage>(op, stream, device, key, launch);
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

// The ctypes symbols of te_ops.fp8.cublaslt. Both return 0 when the route can take the call, 1 when
// not (err filled with the reason: te::CopyError), 2 on bad arguments. Their ints after the device:
// m, n, k, a format (0 E4M3, 1 E5M2), b format, output element bytes (2 bfloat16, 4 float32), the
// values of te_ops/fp8/cublaslt_rules.def.
//
// te_fp8_cublaslt_block_gemm_static_reason (ints: the six): the rule table with this build's and the
// loaded cuBLASLt's versions. No GPU needed.
extern "C" __attribute__((visibility("default"))) int te_fp8_cublaslt_block_gemm_static_reason(const int64_t* ints,
                                                                                                int n_ints, char* err,
                                                                                                int err_len) {
  constexpr const char* kSymbol = "te_fp8_cublaslt_block_gemm_static_reason: ";
  if (ints == nullptr || n_ints != 6) return te::CopyError(std::string(kSymbol) + "expected 6 ints", err, err_len, 2);
  std::string why = te::dense::CodeError(ints);
  if (!why.empty()) return te::CopyError(kSymbol + why, err, err_len, 2);
  why = te::dense::StaticReason(ints[0], ints[1], ints[2], ints[3], ints[4], ints[5]);
  return why.empty() ? 0 : te::CopyError(why, err, err_len, 1);
}

// te_fp8_cublaslt_block_gemm_query (ints: CUDA device, -1 the current one, then the six): whether
// te_fp8_cublaslt_block_gemm can run the call on that device: the rule table (again: this symbol
// stands alone), then cuBLASLt's candidates for the exact spec, filtered as the handler's plan filters
// them (CountAlgorithms; nothing is cached or allocated but a process-wide query handle). Needs a GPU.
extern "C" __attribute__((visibility("default"))) int te_fp8_cublaslt_block_gemm_query(const int64_t* ints,
                                                                                        int n_ints, char* err,
                                                                                        int err_len) {
  using namespace te::dense;
  constexpr const char* kSymbol = "te_fp8_cublaslt_block_gemm_query: ";
  if (ints == nullptr || n_ints != 7) return te::CopyError(std::string(kSymbol) + "expected 7 ints", err, err_len, 2);
  const int64_t* v = ints + 1;
  std::string why = CodeError(v);
  if (!why.empty()) return te::CopyError(kSymbol + why, err, err_len, 2);
  why = StaticReason(v[0], v[1], v[2], v[3], v[4], v[5]);
  if (!why.empty()) return te::CopyError(why, err, err_len, 1);
  const auto fmt = [](int64_t e5m2) { return e5m2 == 1 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3; };
  const GemmSpec spec = Fp8BlockGemmSpec(v[0], v[1], v[2], fmt(v[3]), fmt(v[4]), v[5] == 4 ? CUDA_R_32F : CUDA_R_16BF);
  int count = 0;
  te::ffi::Error e = CountAlgorithms(kOp, static_cast<int>(ints[0]), spec, &count);
  if (e.failure()) return te::CopyError(e.message(), err, err_len, 1);
  if (count == 0) {
    return te::CopyError("cuBLASLt returned no algorithm for the block-scaled FP8 " + spec.Describe(), err, err_len, 1);
  }
  return 0;
}

// The cuBLASLt versions (major * 10000 + minor * 100 + patch) of the build's headers (which = 0) and
// of the library loaded now (which = 1; cublasLtGetVersion, no GPU needed), for te_ops.fp8.cublaslt.
extern "C" __attribute__((visibility("default"))) int64_t te_cublaslt_version(int which) {
  return which == 0 ? static_cast<int64_t>(CUBLAS_VERSION) : static_cast<int64_t>(cublasLtGetVersion());
}
