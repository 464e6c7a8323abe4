// XLA-FFI handlers of the MoE router ops. Every handler accepts trailing extra operands
// (RemainingArgs) that it ignores: te_ops passes NaN/max-filled buffers there, aliased to the
// results, when tests ask for poisoned outputs. All six are graph-safe (kCmdBufferCompatible):
// they only launch kernels on XLA's stream, use no run-time allocation (the aux loss's scratch is
// an XLA-allocated result) and never synchronise. Each has an initialize stage that warms its
// kernels once per (device, shape/config) key.
#include <string>

#include "common/ffi_util.h"
#include "common/runtime.h"
#include "common/targets.h"
#include "router/router.h"

namespace te::router {
namespace {

using ffi::AnyBuffer;
using ffi::ExecutionStage;
using ffi::Result;

ffi::Error ToDType(const char* op, const char* what, ffi::DataType dt, DType* out) {
  switch (dt) {
    case ffi::DataType::F32: *out = DType::kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: *out = DType::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *out = DType::kF16; return ffi::Error::Success();
    default:
      return InvalidArgument(op, std::string(what) + " must be float32, bfloat16 or float16, got " + DTypeName(dt));
  }
}

ffi::Error CheckRows(const char* op, const char* what, const AnyBuffer& x, RowParams* p) {
  auto dims = x.dimensions();
  if (dims.size() != 2) {
    return InvalidArgument(op, std::string(what) + " must have rank 2 [T, E], got shape " + ShapeStr(dims));
  }
  if (dims[1] < 1 || dims[1] > kMaxExperts) {
    return InvalidArgument(op, "the number of experts must be in [1, " + std::to_string(kMaxExperts) +
                                   "], got shape " + ShapeStr(dims));
  }
  p->rows = dims[0];
  p->experts = static_cast<int>(dims[1]);
  return ToDType(op, what, x.element_type(), &p->dtype);
}

ffi::Error CheckSame(const char* op, const char* what, const AnyBuffer& b, const AnyBuffer& like) {
  if (b.element_type() != like.element_type()) {
    return InvalidArgument(op, std::string(what) + " dtype " + DTypeName(b.element_type()) + " != " +
                                   DTypeName(like.element_type()));
  }
  auto bd = b.dimensions(), ld = like.dimensions();
  bool same = bd.size() == ld.size();
  for (size_t i = 0; same && i < bd.size(); ++i) same = bd[i] == ld[i];
  if (!same) return InvalidArgument(op, std::string(what) + " shape " + ShapeStr(bd) + " != " + ShapeStr(ld));
  return ffi::Error::Success();
}

ffi::Error CheckMap(const char* op, const AnyBuffer& m, const RowParams& p) {
  const int64_t cols = p.compact ? (p.experts + 7) / 8 : p.experts;
  auto d = m.dimensions();
  const auto dt = m.element_type();
  const bool dtype_ok = p.compact ? dt == ffi::DataType::U8 : (dt == ffi::DataType::PRED || dt == ffi::DataType::U8);
  if (!dtype_ok || d.size() != 2 || d[0] != p.rows || d[1] != cols) {
    return InvalidArgument(op, std::string("routing map must be ") + (p.compact ? "uint8" : "bool/uint8") + " [" +
                                   std::to_string(p.rows) + ", " + std::to_string(cols) + "], got " + DTypeName(dt) +
                                   " " + ShapeStr(d));
  }
  return ffi::Error::Success();
}

ffi::Error CheckSelection(const char* op, const RowParams& p) {
  if (p.topk < 1 || p.topk > p.experts || p.topk > kMaxTopk) {
    return InvalidArgument(op, "topk must be in [1, min(E=" + std::to_string(p.experts) + ", " +
                                   std::to_string(kMaxTopk) + ")], got " + std::to_string(p.topk));
  }
  if (p.num_groups > 0) {
    const int g = p.num_groups, gk = p.group_topk;
    const bool ok = g <= kMaxGroups && gk >= 1 && gk <= g && p.experts % g == 0 && p.topk % gk == 0 &&
                    p.topk / gk <= kMaxPerGroupTopk && p.topk / gk <= p.experts / g;
    if (!ok) {
      return InvalidArgument(op, "invalid grouped selection: num_groups=" + std::to_string(g) + ", group_topk=" +
                                     std::to_string(gk) + ", topk=" + std::to_string(p.topk) + ", E=" +
                                     std::to_string(p.experts));
    }
  }
  return ffi::Error::Success();
}

std::string RowKey(const RowParams& p) {
  return std::to_string(static_cast<int>(p.dtype)) + "|" + std::to_string(p.rows) + "x" + std::to_string(p.experts) +
         "|k" + std::to_string(p.topk) + "|s" + std::to_string(static_cast<int>(p.score)) + "|p" +
         std::to_string(p.pre_softmax) + "|a" + std::to_string(p.aux) + "|g" + std::to_string(p.num_groups) + "/" +
         std::to_string(p.group_topk) + "|c" + std::to_string(p.compact) + "|b" + std::to_string(p.bias != nullptr);
}

template <ExecutionStage kStage, typename Launch>
ffi::Error Run(const char* handler, cudaStream_t stream, int device, const std::string& key, Launch&& launch_fn) {
  auto launch = [&](cudaStream_t s) -> ffi::Error {
    cudaError_t st = launch_fn(s);
    if (st != cudaSuccess) return CudaError(handler, st, "kernel launch (" + key + ")");
    return ffi::Error::Success();
  };
  return WarmOrExecute<kStage>(handler, stream, device, [&] { return key; }, launch);
}

template <ExecutionStage kStage>
ffi::Error RunRows(const char* handler, cudaStream_t stream, int device, const RowParams& p, bool backward) {
  return Run<kStage>(handler, stream, device, RowKey(p), [&](cudaStream_t s) {
    return backward ? LaunchRowBackward(p, s) : LaunchRowForward(p, s);
  });
}

ffi::Error SetScore(const char* op, int32_t score_function, RowParams* p) {
  if (score_function != 0 && score_function != 1) {
    return InvalidArgument(op, "score_function must be 0 (softmax) or 1 (sigmoid), got " + std::to_string(score_function));
  }
  p->score = static_cast<Score>(score_function);
  return ffi::Error::Success();
}

// ---- fused_topk_with_score_function ----

template <ExecutionStage kStage>
ffi::Error TopkFwd(cudaStream_t stream, int32_t device, AnyBuffer logits, AnyBuffer bias, ffi::RemainingArgs,
                   Result<AnyBuffer> probs, Result<AnyBuffer> rmap, int32_t topk, int32_t score_function,
                   int32_t use_pre_softmax, int32_t num_groups, int32_t group_topk, float scaling_factor,
                   int32_t compact, int32_t has_bias) {
  const char* op = "router_topk_fwd";
  RowParams p;
  TE_RETURN_IF_ERROR(CheckRows(op, "logits", logits, &p));
  TE_RETURN_IF_ERROR(SetScore(op, score_function, &p));
  p.topk = topk;
  p.pre_softmax = use_pre_softmax != 0;
  p.num_groups = num_groups > 0 ? num_groups : 0;
  p.group_topk = num_groups > 0 ? group_topk : 0;
  p.scaling = scaling_factor;
  p.compact = compact != 0;
  TE_RETURN_IF_ERROR(CheckSelection(op, p));
  if (has_bias) {
    if (bias.element_type() != ffi::DataType::F32 || NumElements(bias) != p.experts) {
      return InvalidArgument(op, "expert_bias must be float32 [" + std::to_string(p.experts) + "], got " +
                                     DTypeName(bias.element_type()) + " " + ShapeStr(bias.dimensions()));
    }
    p.bias = static_cast<const float*>(bias.untyped_data());
  }
  TE_RETURN_IF_ERROR(CheckSame(op, "probs", *probs, logits));
  TE_RETURN_IF_ERROR(CheckMap(op, *rmap, p));
  p.logits = logits.untyped_data();
  p.out = probs->untyped_data();
  p.map_out = static_cast<uint8_t*>(rmap->untyped_data());
  return RunRows<kStage>(op, stream, device, p, /*backward=*/false);
}

template <ExecutionStage kStage>
ffi::Error TopkBwd(cudaStream_t stream, int32_t device, AnyBuffer logits, AnyBuffer rmap, AnyBuffer g,
                   ffi::RemainingArgs, Result<AnyBuffer> dlogits, int32_t topk, int32_t score_function,
                   int32_t use_pre_softmax, float scaling_factor, int32_t compact) {
  const char* op = "router_topk_bwd";
  RowParams p;
  TE_RETURN_IF_ERROR(CheckRows(op, "logits", logits, &p));
  TE_RETURN_IF_ERROR(SetScore(op, score_function, &p));
  p.topk = topk;
  p.pre_softmax = use_pre_softmax != 0;
  p.scaling = scaling_factor;
  p.compact = compact != 0;
  TE_RETURN_IF_ERROR(CheckSelection(op, p));
  TE_RETURN_IF_ERROR(CheckMap(op, rmap, p));
  TE_RETURN_IF_ERROR(CheckSame(op, "d probs", g, logits));
  TE_RETURN_IF_ERROR(CheckSame(op, "d logits", *dlogits, logits));
  p.logits = logits.untyped_data();
  p.map_in = static_cast<const uint8_t*>(rmap.untyped_data());
  p.g = g.untyped_data();
  p.out = dlogits->untyped_data();
  return RunRows<kStage>(op, stream, device, p, /*backward=*/true);
}

// ---- compute_routing_scores_for_aux_loss ----

template <ExecutionStage kStage>
ffi::Error ScoresFwd(cudaStream_t stream, int32_t device, AnyBuffer logits, ffi::RemainingArgs,
                     Result<AnyBuffer> rmap, Result<AnyBuffer> scores, int32_t topk, int32_t score_function,
                     int32_t compact) {
  const char* op = "router_scores_fwd";
  RowParams p;
  TE_RETURN_IF_ERROR(CheckRows(op, "logits", logits, &p));
  TE_RETURN_IF_ERROR(SetScore(op, score_function, &p));
  p.aux = true;
  p.topk = topk;
  p.compact = compact != 0;
  TE_RETURN_IF_ERROR(CheckSelection(op, p));
  TE_RETURN_IF_ERROR(CheckSame(op, "scores", *scores, logits));
  TE_RETURN_IF_ERROR(CheckMap(op, *rmap, p));
  p.logits = logits.untyped_data();
  p.out = scores->untyped_data();
  p.map_out = static_cast<uint8_t*>(rmap->untyped_data());
  return RunRows<kStage>(op, stream, device, p, /*backward=*/false);
}

template <ExecutionStage kStage>
ffi::Error ScoresBwd(cudaStream_t stream, int32_t device, AnyBuffer logits, AnyBuffer g, ffi::RemainingArgs,
                     Result<AnyBuffer> dlogits, int32_t score_function) {
  const char* op = "router_scores_bwd";
  RowParams p;
  TE_RETURN_IF_ERROR(CheckRows(op, "logits", logits, &p));
  TE_RETURN_IF_ERROR(SetScore(op, score_function, &p));
  p.aux = true;
  TE_RETURN_IF_ERROR(CheckSame(op, "d scores", g, logits));
  TE_RETURN_IF_ERROR(CheckSame(op, "d logits", *dlogits, logits));
  p.logits = logits.untyped_data();
  p.g = g.untyped_data();
  p.out = dlogits->untyped_data();
  return RunRows<kStage>(op, stream, device, p, /*backward=*/true);
}

// ---- fused_moe_aux_loss ----

ffi::Error CheckTpe(const char* op, const AnyBuffer& tpe, int experts) {
  if (tpe.element_type() != ffi::DataType::F32 || tpe.dimensions().size() != 1 || NumElements(tpe) != experts) {
    return InvalidArgument(op, "tokens_per_expert must be float32 [" + std::to_string(experts) + "], got " +
                                   DTypeName(tpe.element_type()) + " " + ShapeStr(tpe.dimensions()));
  }
  return ffi::Error::Success();
}

ffi::Error LossShape(const char* op, const char* what, const AnyBuffer& x, LossParams* p) {
  auto d = x.dimensions();
  if (d.size() != 2 || d[1] < 1 || d[1] > 0x7fffffff) {
    return InvalidArgument(op, std::string(what) + " must be [T, E] with E >= 1, got " + ShapeStr(d));
  }
  p->rows = d[0];
  p->experts = static_cast<int>(d[1]);
  DType dt;
  TE_RETURN_IF_ERROR(ToDType(op, what, x.element_type(), &dt));
  p->dtype = dt;
  return ffi::Error::Success();
}

std::string LossKey(const LossParams& p) {
  return std::to_string(static_cast<int>(p.dtype)) + "|" + std::to_string(p.rows) + "x" + std::to_string(p.experts);
}

template <ExecutionStage kStage>
ffi::Error LossFwd(cudaStream_t stream, int32_t device, AnyBuffer probs, AnyBuffer tpe, ffi::RemainingArgs,
                   Result<AnyBuffer> partials, Result<AnyBuffer> out) {
  const char* op = "router_aux_loss_fwd";
  LossParams p;
  TE_RETURN_IF_ERROR(LossShape(op, "probs", probs, &p));
  TE_RETURN_IF_ERROR(CheckTpe(op, tpe, p.experts));
  if (partials->element_type() != ffi::DataType::F32 || NumElements(*partials) != kLossPartials) {
    return InvalidArgument(op, "the scratch result must be float32 [" + std::to_string(kLossPartials) + "], got " +
                                   ShapeStr(partials->dimensions()));
  }
  if (out->element_type() != ffi::DataType::F32 || NumElements(*out) != 1) {
    return InvalidArgument(op, "the result must be a float32 scalar, got " + ShapeStr(out->dimensions()));
  }
  p.probs = probs.untyped_data();
  p.tpe = static_cast<const float*>(tpe.untyped_data());
  p.partials = static_cast<float*>(partials->untyped_data());
  p.out = static_cast<float*>(out->untyped_data());
  return Run<kStage>(op, stream, device, LossKey(p), [&](cudaStream_t s) { return LaunchLossForward(p, s); });
}

template <ExecutionStage kStage>
ffi::Error LossBwd(cudaStream_t stream, int32_t device, AnyBuffer tpe, AnyBuffer g, ffi::RemainingArgs,
                   Result<AnyBuffer> dprobs) {
  const char* op = "router_aux_loss_bwd";
  LossParams p;
  TE_RETURN_IF_ERROR(LossShape(op, "d probs", *dprobs, &p));
  TE_RETURN_IF_ERROR(CheckTpe(op, tpe, p.experts));
  if (g.element_type() != ffi::DataType::F32 || NumElements(g) != 1) {
    return InvalidArgument(op, "the loss cotangent must be a float32 scalar, got " + ShapeStr(g.dimensions()));
  }
  p.tpe = static_cast<const float*>(tpe.untyped_data());
  p.g = static_cast<const float*>(g.untyped_data());
  p.dprobs = dprobs->untyped_data();
  return Run<kStage>(op, stream, device, LossKey(p), [&](cudaStream_t s) { return LaunchLossBackward(p, s); });
}

// ---- bindings ----

template <ExecutionStage kStage>
auto BindTopkFwd() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<AnyBuffer>()  // logits
      .template Arg<AnyBuffer>()  // expert bias (fp32 [E], or a dummy when has_bias == 0)
      .RemainingArgs()            // optional output buffers aliased to the results (tests poison them)
      .template Ret<AnyBuffer>()  // probs
      .template Ret<AnyBuffer>()  // routing map
      .template Attr<int32_t>("topk")
      .template Attr<int32_t>("score_function")
      .template Attr<int32_t>("use_pre_softmax")
      .template Attr<int32_t>("num_groups")
      .template Attr<int32_t>("group_topk")
      .template Attr<float>("scaling_factor")
      .template Attr<int32_t>("compact")
      .template Attr<int32_t>("has_bias");
}

template <ExecutionStage kStage>
auto BindTopkBwd() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<AnyBuffer>()  // logits
      .template Arg<AnyBuffer>()  // routing map
      .template Arg<AnyBuffer>()  // d probs
      .RemainingArgs()
      .template Ret<AnyBuffer>()  // d logits
      .template Attr<int32_t>("topk")
      .template Attr<int32_t>("score_function")
      .template Attr<int32_t>("use_pre_softmax")
      .template Attr<float>("scaling_factor")
      .template Attr<int32_t>("compact");
}

template <ExecutionStage kStage>
auto BindScoresFwd() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<AnyBuffer>()  // logits
      .RemainingArgs()
      .template Ret<AnyBuffer>()  // routing map
      .template Ret<AnyBuffer>()  // scores
      .template Attr<int32_t>("topk")
      .template Attr<int32_t>("score_function")
      .template Attr<int32_t>("compact");
}

template <ExecutionStage kStage>
auto BindScoresBwd() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<AnyBuffer>()  // logits
      .template Arg<AnyBuffer>()  // d scores
      .RemainingArgs()
      .template Ret<AnyBuffer>()  // d logits
      .template Attr<int32_t>("score_function");
}

template <ExecutionStage kStage>
auto BindLossFwd() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<AnyBuffer>()  // probs
      .template Arg<AnyBuffer>()  // tokens per expert (fp32)
      .RemainingArgs()
      .template Ret<AnyBuffer>()  // partial sums (scratch)
      .template Ret<AnyBuffer>(); // fp32 scalar
}

template <ExecutionStage kStage>
auto BindLossBwd() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<AnyBuffer>()  // tokens per expert (fp32)
      .template Arg<AnyBuffer>()  // scaled cotangent (fp32 scalar)
      .RemainingArgs()
      .template Ret<AnyBuffer>(); // d probs
}

constexpr ExecutionStage kInit = ExecutionStage::kInitialize;
constexpr ExecutionStage kExec = ExecutionStage::kExecute;

}  // namespace

XLA_FFI_DEFINE_HANDLER(kTopkFwdInit, TopkFwd<kInit>, BindTopkFwd<kInit>());
XLA_FFI_DEFINE_HANDLER(kTopkFwdExec, TopkFwd<kExec>, BindTopkFwd<kExec>(), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kTopkBwdInit, TopkBwd<kInit>, BindTopkBwd<kInit>());
XLA_FFI_DEFINE_HANDLER(kTopkBwdExec, TopkBwd<kExec>, BindTopkBwd<kExec>(), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kScoresFwdInit, ScoresFwd<kInit>, BindScoresFwd<kInit>());
XLA_FFI_DEFINE_HANDLER(kScoresFwdExec, ScoresFwd<kExec>, BindScoresFwd<kExec>(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kScoresBwdInit, ScoresBwd<kInit>, BindScoresBwd<kInit>());
XLA_FFI_DEFINE_HANDLER(kScoresBwdExec, ScoresBwd<kExec>, BindScoresBwd<kExec>(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kLossFwdInit, LossFwd<kInit>, BindLossFwd<kInit>());
XLA_FFI_DEFINE_HANDLER(kLossFwdExec, LossFwd<kExec>, BindLossFwd<kExec>(), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kLossBwdInit, LossBwd<kInit>, BindLossBwd<kInit>());
XLA_FFI_DEFINE_HANDLER(kLossBwdExec, LossBwd<kExec>, BindLossBwd<kExec>(), {ffi::Traits::kCmdBufferCompatible});

}  // namespace te::router

namespace te {
namespace {

const TargetRegistrar kRegister({
    {"te_router_topk_fwd", router::kTopkFwdInit, router::kTopkFwdExec},
    {"te_router_topk_bwd", router::kTopkBwdInit, router::kTopkBwdExec},
    {"te_router_scores_fwd", router::kScoresFwdInit, router::kScoresFwdExec},
    {"te_router_scores_bwd", router::kScoresBwdInit, router::kScoresBwdExec},
    {"te_router_aux_loss_fwd", router::kLossFwdInit, router::kLossFwdExec},
    {"te_router_aux_loss_bwd", router::kLossBwdInit, router::kLossBwdExec},
});

}  // namespace
}  // namespace te
