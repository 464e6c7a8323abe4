// XLA-FFI handlers for the softmax family. Every handler accepts trailing extra operands
// (RemainingArgs) that it ignores: te_ops passes NaN-filled buffers there, aliased to the results,
// when tests ask for poisoned outputs, so an element the kernel fails to write shows up as NaN.
// All four are graph-safe (kCmdBufferCompatible): they
// only launch kernels on XLA's stream, allocate nothing and never synchronise. Each has an
// initialize stage that warms its kernel once per (device, shape/config) key.
#include <string>

#include "common/ffi_util.h"
#include "common/runtime.h"
#include "common/targets.h"
#include "softmax/softmax.h"

namespace te::softmax {
namespace {

using ffi::AnyBuffer;
using ffi::ExecutionStage;
using ffi::Result;

ffi::Error ToDType(const char* op, ffi::DataType dt, DType* out) {
  switch (dt) {
    case ffi::DataType::F32: *out = DType::kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: *out = DType::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *out = DType::kF16; return ffi::Error::Success();
    default:
      return InvalidArgument(op, std::string("expected float32, bfloat16 or float16, got ") + DTypeName(dt));
  }
}

std::string Key(const Params& p, const AnyBuffer& x, bool backward) {
  const LaunchConfig c = ChooseConfig(p, /*forward=*/!backward);
  return std::to_string(static_cast<int>(p.dtype)) + "|" + std::to_string(static_cast<int>(p.mode)) + "|" +
         ShapeStr(x.dimensions()) + "|" + std::to_string(c.vec) + "/" + std::to_string(c.vectors_per_thread) +
         "/" + std::to_string(c.threads_per_row) + "/k" + std::to_string(static_cast<int>(c.kernel));
}

// Common tail: initialize warms once per key, execute launches on XLA's stream.
template <ExecutionStage kStage>
ffi::Error Run(const char* handler, cudaStream_t stream, int device, const Params& p, const AnyBuffer& shape_src,
               bool backward) {
  auto launch = [&](cudaStream_t s) -> ffi::Error {
    cudaError_t st = backward ? LaunchBackward(p, s) : LaunchForward(p, s);
    if (st != cudaSuccess) {
      return CudaError(handler, st, "kernel launch for shape " + ShapeStr(shape_src.dimensions()));
    }
    return ffi::Error::Success();
  };
  return WarmOrExecute<kStage>(handler, stream, device, [&] { return Key(p, shape_src, backward); }, launch);
}

ffi::Error FillRowLayout(const char* op, const AnyBuffer& x, int mode, Params* p) {
  auto dims = x.dimensions();
  if (dims.size() < 2) return InvalidArgument(op, "x must have rank >= 2, got shape " + ShapeStr(dims));
  p->cols = dims.back();
  p->rows = NumElements(x) / (p->cols == 0 ? 1 : p->cols);
  if (p->cols == 0) p->rows = 0;
  p->sq = dims[dims.size() - 2];
  if (mode == static_cast<int>(MaskMode::kCausal)) {
    if (p->sq != p->cols) {
      return InvalidArgument(op, "causal softmax needs square trailing axes, got shape " + ShapeStr(dims));
    }
    p->mode = MaskMode::kCausal;
  } else if (mode == static_cast<int>(MaskMode::kNone)) {
    p->mode = MaskMode::kNone;
  } else {
    return InvalidArgument(op, "mode must be 0 (none) or 2 (causal), got " + std::to_string(mode));
  }
  return ToDType(op, x.element_type(), &p->dtype);
}

ffi::Error FillMask(const char* op, const AnyBuffer& x, const AnyBuffer& mask, Params* p) {
  auto xd = x.dimensions();
  auto md = mask.dimensions();
  if (xd.size() != 4 || md.size() != 4) {
    return InvalidArgument(op, "expected x [B, N, Sq, Sk] and mask [B|1, N|1, Sq|1, Sk], got " + ShapeStr(xd) +
                                   " and " + ShapeStr(md));
  }
  if (mask.element_type() != ffi::DataType::PRED) {
    return InvalidArgument(op, std::string("mask must be bool, got ") + DTypeName(mask.element_type()));
  }
  for (int i = 0; i < 3; ++i) {
    if (md[i] != 1 && md[i] != xd[i]) {
      return InvalidArgument(op, "mask shape " + ShapeStr(md) + " does not broadcast to x shape " + ShapeStr(xd));
    }
  }
  if (md[3] != xd[3]) {
    return InvalidArgument(op, "mask last axis must equal Sk; shapes " + ShapeStr(md) + " vs " + ShapeStr(xd));
  }
  p->mode = MaskMode::kMask;
  p->mask = static_cast<const uint8_t*>(mask.untyped_data());
  p->heads = xd[1];
  p->sq = xd[2];
  p->cols = xd[3];
  p->rows = p->cols == 0 ? 0 : NumElements(x) / p->cols;
  const int64_t s_q = md[3];
  const int64_t s_n = md[2] * s_q;
  const int64_t s_b = md[1] * s_n;
  p->mask_stride_q = md[2] == 1 ? 0 : s_q;
  p->mask_stride_n = md[1] == 1 ? 0 : s_n;
  p->mask_stride_b = md[0] == 1 ? 0 : s_b;
  return ToDType(op, x.element_type(), &p->dtype);
}

template <ExecutionStage kStage>
ffi::Error SoftmaxFwd(cudaStream_t stream, int32_t device, AnyBuffer x, ffi::RemainingArgs, Result<AnyBuffer> y, float scale,
                      int32_t mode) {
  const char* op = "scaled_softmax_fwd";
  Params p;
  TE_RETURN_IF_ERROR(FillRowLayout(op, x, mode, &p));
  p.x = x.untyped_data();
  p.out = y->untyped_data();
  p.scale = scale;
  return Run<kStage>(op, stream, device, p, x, /*backward=*/false);
}

template <ExecutionStage kStage>
ffi::Error SoftmaxBwd(cudaStream_t stream, int32_t device, AnyBuffer y, AnyBuffer dy, ffi::RemainingArgs,
                      Result<AnyBuffer> dx,
                      float scale, int32_t mode) {
  const char* op = "scaled_softmax_bwd";
  Params p;
  TE_RETURN_IF_ERROR(FillRowLayout(op, y, mode, &p));
  if (dy.element_type() != y.element_type()) {
    return InvalidArgument(op, std::string("dy dtype ") + DTypeName(dy.element_type()) + " != y dtype " +
                                   DTypeName(y.element_type()));
  }
  p.y = y.untyped_data();
  p.dy = dy.untyped_data();
  p.out = dx->untyped_data();
  p.scale = scale;
  return Run<kStage>(op, stream, device, p, y, /*backward=*/true);
}

template <ExecutionStage kStage>
ffi::Error MaskedSoftmaxFwd(cudaStream_t stream, int32_t device, AnyBuffer x, AnyBuffer mask, ffi::RemainingArgs,
                            Result<AnyBuffer> y,
                            float scale) {
  const char* op = "scaled_masked_softmax_fwd";
  Params p;
  TE_RETURN_IF_ERROR(FillMask(op, x, mask, &p));
  p.x = x.untyped_data();
  p.out = y->untyped_data();
  p.scale = scale;
  return Run<kStage>(op, stream, device, p, x, /*backward=*/false);
}

template <ExecutionStage kStage>
ffi::Error MaskedSoftmaxBwd(cudaStream_t stream, int32_t device, AnyBuffer y, AnyBuffer dy, AnyBuffer mask,
                            ffi::RemainingArgs, Result<AnyBuffer> dx, float scale) {
  const char* op = "scaled_masked_softmax_bwd";
  Params p;
  TE_RETURN_IF_ERROR(FillMask(op, y, mask, &p));
  p.y = y.untyped_data();
  p.dy = dy.untyped_data();
  p.out = dx->untyped_data();
  p.scale = scale;
  return Run<kStage>(op, stream, device, p, y, /*backward=*/true);
}

template <ExecutionStage kStage>
auto BindFwd() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<AnyBuffer>()
      .RemainingArgs()  // optional output buffers aliased to the results (tests poison them)
      .template Ret<AnyBuffer>()
      .template Attr<float>("scale")
      .template Attr<int32_t>("mode");
}

template <ExecutionStage kStage>
auto BindBwd() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>()
      .RemainingArgs()  // optional output buffers aliased to the results (tests poison them)
      .template Ret<AnyBuffer>()
      .template Attr<float>("scale")
      .template Attr<int32_t>("mode");
}

template <ExecutionStage kStage>
auto BindMaskedFwd() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>()
      .RemainingArgs()  // optional output buffers aliased to the results (tests poison them)
      .template Ret<AnyBuffer>()
      .template Attr<float>("scale");
}

template <ExecutionStage kStage>
auto BindMaskedBwd() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>()
      .RemainingArgs()  // optional output buffers aliased to the results (tests poison them)
      .template Ret<AnyBuffer>()
      .template Attr<float>("scale");
}

constexpr ExecutionStage kInit = ExecutionStage::kInitialize;
constexpr ExecutionStage kExec = ExecutionStage::kExecute;

}  // namespace

XLA_FFI_DEFINE_HANDLER(kSoftmaxFwdInit, SoftmaxFwd<kInit>, BindFwd<kInit>());
XLA_FFI_DEFINE_HANDLER(kSoftmaxFwdExec, SoftmaxFwd<kExec>, BindFwd<kExec>(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kSoftmaxBwdInit, SoftmaxBwd<kInit>, BindBwd<kInit>());
XLA_FFI_DEFINE_HANDLER(kSoftmaxBwdExec, SoftmaxBwd<kExec>, BindBwd<kExec>(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kMaskedFwdInit, MaskedSoftmaxFwd<kInit>, BindMaskedFwd<kInit>());
XLA_FFI_DEFINE_HANDLER(kMaskedFwdExec, MaskedSoftmaxFwd<kExec>, BindMaskedFwd<kExec>(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kMaskedBwdInit, MaskedSoftmaxBwd<kInit>, BindMaskedBwd<kInit>());
XLA_FFI_DEFINE_HANDLER(kMaskedBwdExec, MaskedSoftmaxBwd<kExec>, BindMaskedBwd<kExec>(),
                       {ffi::Traits::kCmdBufferCompatible});

}  // namespace te::softmax

namespace te {
namespace {

const TargetRegistrar kRegister({
    {"te_softmax_fwd", softmax::kSoftmaxFwdInit, softmax::kSoftmaxFwdExec},
    {"te_softmax_bwd", softmax::kSoftmaxBwdInit, softmax::kSoftmaxBwdExec},
    {"te_masked_softmax_fwd", softmax::kMaskedFwdInit, softmax::kMaskedFwdExec},
    {"te_masked_softmax_bwd", softmax::kMaskedBwdInit, softmax::kMaskedBwdExec},
});

}  // namespace
}  // namespace te
