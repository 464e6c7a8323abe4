// Shared helpers for te_ops XLA-FFI handlers: error conversion, dtype dispatch, shape printing.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace te {

namespace ffi = xla::ffi;

// Note: no iostreams anywhere in csrc/. In XLA's initialize stage on the H200 image, formatting
// through std::ostringstream inside the handler crashed (segfault in basic_ostream::_M_insert),
// while std::to_string/concatenation is safe; keep it that way.

// "[2, 3, 4]" for error messages.
template <typename Dims>
std::string ShapeStr(const Dims& dims) {
  std::string s = "[";
  bool first = true;
  for (auto d : dims) {
    if (!first) s += ", ";
    s += std::to_string(static_cast<long long>(d));
    first = false;
  }
  return s + "]";
}

inline const char* DTypeName(ffi::DataType dt) {
  switch (dt) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    default: return "unsupported dtype";
  }
}

// CUDA status -> ffi::Error naming the op and the failing call.
inline ffi::Error CudaError(std::string_view op, cudaError_t status, std::string_view what) {
  std::string msg = "te_ops." + std::string(op) + ": CUDA error " + cudaGetErrorName(status) + " (" +
                    cudaGetErrorString(status) + ") in " + std::string(what);
  return ffi::Error(ffi::ErrorCode::kInternal, msg);
}

inline ffi::Error InvalidArgument(std::string_view op, const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "te_ops." + std::string(op) + ": " + msg);
}

#define TE_CUDA_CHECK(op, expr)                                   \
  do {                                                            \
    cudaError_t te_status_ = (expr);                              \
    if (te_status_ != cudaSuccess) {                              \
      return ::te::CudaError((op), te_status_, #expr);            \
    }                                                             \
  } while (0)

// After a kernel launch: report launch-configuration errors without synchronising.
#define TE_CHECK_LAUNCH(op) TE_CUDA_CHECK((op), cudaGetLastError())

#define TE_RETURN_IF_ERROR(expr)          \
  do {                                    \
    ::xla::ffi::Error te_err_ = (expr);   \
    if (te_err_.failure()) return te_err_; \
  } while (0)

// Floating dtype dispatch: calls fn(T{}) with T in {float, __nv_bfloat16, __half}.
template <typename Fn>
ffi::Error DispatchFloat(std::string_view op, ffi::DataType dt, Fn&& fn) {
  switch (dt) {
    case ffi::DataType::F32: return fn(float{});
    case ffi::DataType::BF16: return fn(__nv_bfloat16{});
    case ffi::DataType::F16: return fn(__half{});
    default:
      return InvalidArgument(op, std::string("expected float32, bfloat16 or float16, got ") +
                                     DTypeName(dt));
  }
}

// The error path of the ctypes query symbols (te_fused_attention_query, te_fp8_cublaslt_block_gemm_*):
// copies msg into the caller's buffer err[err_len] (truncated, always NUL-terminated; nothing when err
// is null or err_len <= 0) and returns code.
inline int CopyError(const std::string& msg, char* err, int err_len, int code) {
  if (err != nullptr && err_len > 0) {
    std::strncpy(err, msg.c_str(), static_cast<size_t>(err_len - 1));
    err[err_len - 1] = '\0';
  }
  return code;
}

inline int64_t NumElements(const ffi::AnyBuffer& b) {
  int64_t n = 1;
  for (auto d : b.dimensions()) n *= d;
  return n;
}

}  // namespace te
