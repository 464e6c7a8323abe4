// XLA-FFI handlers for te_ops.fused_attention on cuDNN (te_fused_attention_fwd / _bwd).
//
// Operands are fixed; optional ones (bias, seq lens, dropout seed) are passed by Python as 1-element
// dummies when absent and flagged by attributes. Trailing extra operands (RemainingArgs) are ignored:
// te_ops passes NaN-filled buffers there, aliased to the results, when tests poison outputs.
//
// Stages:
//   initialize: builds (once per key) the cuDNN graph outside any capture, then warms the execute path
//               once per key inside a throwaway relaxed capture (WarmTolerant: te::WarmOnce's contract and
//               counters, but a failed warm-up is only logged), so lazy cuDNN/CUDA state (kernel modules,
//               function attributes) exists before XLA records a CUDA graph.
//   execute:    looks the graph up, sets the per-device cudnn handle to XLA's stream and executes it
//               with XLA's buffers and the workspace result buffer. Same device work every call, no
//               allocation, no host synchronisation: kCmdBufferCompatible.
//
// The dropout seed operand is uint32[4]: bytes 0..7 are cuDNN's int64 seed, bytes 8..15 its int64
// offset (read on device, so a new key needs no new graph and replays stay valid).
#include <array>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_set>

#include "common/ffi_util.h"
#include "common/runtime.h"
#include "common/targets.h"
#include "fused_attention/fused_attention_graphs.h"

namespace te::fused_attention {
namespace {

using ffi::AnyBuffer;
using ffi::ExecutionStage;
using ffi::Result;

constexpr const char* kFwdName = "fused_attention_fwd";
constexpr const char* kBwdName = "fused_attention_bwd";

ffi::Error Invalid(const char* op, const std::string& msg) { return InvalidArgument(op, msg); }

struct Common {
  int32_t has_bias, padding, left_bound, right_bound;
  float scale, dropout;
  int32_t stats = 1;
  int32_t need_dbias = 0;
  int32_t bottom_right = 0;  // diagonal band aligned at the bottom-right corner (TOP_LEFT otherwise)
  int32_t deterministic = 0;  // backward: cuDNN's deterministic algorithm
};

ffi::Error FillConfig(const char* op, int device, bool backward, const AnyBuffer& q, const AnyBuffer& k,
                      const AnyBuffer& v, const AnyBuffer& bias, const AnyBuffer& q_len, const AnyBuffer& kv_len,
                      const AnyBuffer& seed, const Common& c, Config* cfg) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return Invalid(op, "expected q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv]; got " + ShapeStr(qd) + ", " +
                           ShapeStr(kd) + ", " + ShapeStr(vd));
  }
  const auto dt = q.element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) {
    return Invalid(op, std::string("q must be bfloat16 or float16, got ") + DTypeName(dt));
  }
  if (k.element_type() != dt || v.element_type() != dt) {
    return Invalid(op, std::string("q, k, v must share a dtype, got ") + DTypeName(dt) + ", " +
                           DTypeName(k.element_type()) + ", " + DTypeName(v.element_type()));
  }
  if (kd[0] != qd[0] || vd[0] != qd[0] || vd[1] != kd[1] || vd[2] != kd[2] || kd[3] != qd[3] || kd[2] == 0 ||
      qd[2] % kd[2] != 0) {
    return Invalid(op, "inconsistent shapes q " + ShapeStr(qd) + ", k " + ShapeStr(kd) + ", v " + ShapeStr(vd) +
                           " (need equal B, k/v equal Sk and Hk, q/k equal D, Hq a multiple of Hk)");
  }
  cfg->device = device;
  cfg->backward = backward;
  cfg->io = dt == ffi::DataType::BF16 ? IoType::kBF16 : IoType::kF16;
  cfg->b = qd[0];
  cfg->sq = qd[1];
  cfg->hq = qd[2];
  cfg->d = qd[3];
  cfg->sk = kd[1];
  cfg->hk = kd[2];
  cfg->dv = vd[3];
  cfg->scale = c.scale;
  cfg->dropout = c.dropout;
  cfg->left_bound = c.left_bound;
  cfg->right_bound = c.right_bound;
  cfg->bottom_right = c.bottom_right != 0;
  cfg->padding = c.padding != 0;
  cfg->stats = backward || c.stats != 0;
  cfg->dbias = backward && c.has_bias && c.need_dbias != 0;
  cfg->deterministic = backward && c.deterministic != 0;
  if (c.has_bias) {
    auto bd = bias.dimensions();
    if (bd.size() != 4 || (bd[0] != 1 && bd[0] != cfg->b) || (bd[1] != 1 && bd[1] != cfg->hq) || bd[2] != cfg->sq ||
        bd[3] != cfg->sk) {
      return Invalid(op, "bias must be [B|1, Hq|1, Sq, Sk] for q " + ShapeStr(qd) + " and k " + ShapeStr(kd) +
                             ", got " + ShapeStr(bd));
    }
    if (bias.element_type() != dt) {
      return Invalid(op, std::string("bias dtype must equal q's (") + DTypeName(dt) + "), got " +
                             DTypeName(bias.element_type()));
    }
    cfg->bias_b = bd[0];
    cfg->bias_h = bd[1];
  }
  if (cfg->padding) {
    for (const AnyBuffer* len : {&q_len, &kv_len}) {
      if (len->element_type() != ffi::DataType::S32 || NumElements(*len) != cfg->b) {
        return Invalid(op, "q_seqlens / kv_seqlens must be int32 [B]=[" + std::to_string(cfg->b) + "], got " +
                               DTypeName(len->element_type()) + ShapeStr(len->dimensions()));
      }
    }
  }
  if (cfg->dropout > 0.f) {
    if (seed.size_bytes() < 16) {
      return Invalid(op, "dropout seed must be uint32[4] (16 bytes), got " + ShapeStr(seed.dimensions()));
    }
  }
  return ffi::Error::Success();
}

// Like te::WarmOnce (same counters, once per (device, handler, key)), but a failure of the throwaway
// capture is reported on stderr and otherwise ignored: the graph is already built outside capture, and a
// real problem resurfaces, with cuDNN's message, in the execute stage. (cuDNN engines that cannot be
// captured would make the warm-up fail while plain execution still works.)
ffi::Error WarmTolerant(const char* handler, int device, const std::string& key,
                        const std::function<ffi::Error(cudaStream_t)>& launch) {
  static std::mutex mu;
  static auto* done = new std::unordered_set<std::string>();
  HandlerCounters& c = Counters(handler);
  c.initialize_calls.fetch_add(1, std::memory_order_relaxed);
  const std::string full = std::string(handler) + "|" + key;
  std::lock_guard<std::mutex> lock(mu);
  if (done->count(full)) return ffi::Error::Success();
  cudaStream_t side = nullptr;
  TE_CUDA_CHECK(handler, cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  std::string problem;
  if (cudaStreamBeginCapture(side, cudaStreamCaptureModeRelaxed) == cudaSuccess) {
    ffi::Error err = launch(side);
    if (err.failure()) problem = err.message();
    cudaGraph_t graph = nullptr;
    cudaError_t end = cudaStreamEndCapture(side, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (end != cudaSuccess && problem.empty()) problem = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(end);
  } else {
    problem = "cudaStreamBeginCapture failed";
  }
  cudaGetLastError();  // clear a non-sticky error left by a failed capture
  cudaStreamDestroy(side);
  if (!problem.empty()) {
    std::fprintf(stderr, "te_ops.%s: warm-up capture failed (device %d, %s): %s\n", handler, device, key.c_str(),
                 problem.c_str());
  }
  done->insert(full);
  c.warmups.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

ffi::Error Fail(const char* op, const Config& cfg, const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("te_ops.") + op + ": cuDNN SDPA " + cfg.Describe() +
                                                   ": " + what);
}

// initialize: build + warm once per key. execute: run on XLA's stream.
template <ExecutionStage kStage>
ffi::Error Run(const char* op, cudaStream_t stream, const Config& cfg, const std::array<void*, kDBias + 1>& ptrs,
               AnyBuffer& workspace) {
  auto entry = GetOrBuild(cfg);
  if (!entry->error.empty()) return Fail(op, cfg, entry->error);
  if (static_cast<int64_t>(workspace.size_bytes()) < entry->workspace) {
    return Fail(op, cfg,
                "workspace result has " + std::to_string(workspace.size_bytes()) + " bytes but the plan needs " +
                    std::to_string(entry->workspace) +
                    " (te_ops sizes it from te_fused_attention_query; was the query run on another GPU model?)");
  }
  void* ws = entry->workspace > 0 ? workspace.untyped_data() : nullptr;
  auto launch = [&](cudaStream_t s) -> ffi::Error {
    std::string err = Execute(cfg, *entry, s, ptrs.data(), ws);
    if (!err.empty()) return Fail(op, cfg, err);
    return ffi::Error::Success();
  };
  if constexpr (kStage == ExecutionStage::kInitialize) {
    bool have_ptrs = ptrs[kQ] != nullptr && ptrs[kK] != nullptr && ptrs[kV] != nullptr && ptrs[kO] != nullptr;
    if (!have_ptrs) {  // nothing to warm with: the graph is built, the first execute loads kernels
      return WarmTolerant(op, cfg.device, cfg.Key(), [](cudaStream_t) { return ffi::Error::Success(); });
    }
    return WarmTolerant(op, cfg.device, cfg.Key(), launch);
  } else {
    RecordExecute(Counters(op), stream);
    return launch(stream);
  }
}

template <ExecutionStage kStage>
ffi::Error FwdImpl(cudaStream_t stream, int32_t device, AnyBuffer q, AnyBuffer k, AnyBuffer v, AnyBuffer bias,
                   AnyBuffer q_len, AnyBuffer kv_len, AnyBuffer seed, ffi::RemainingArgs, Result<AnyBuffer> out,
                   Result<AnyBuffer> lse, Result<AnyBuffer> workspace, float scale, float dropout, int32_t has_bias,
                   int32_t padding, int32_t left_bound, int32_t right_bound, int32_t stats,
                   int32_t bottom_right) {
  const char* op = kFwdName;
  Config cfg;
  Common c{has_bias, padding, left_bound, right_bound, scale, dropout, stats};
  c.bottom_right = bottom_right;
  TE_RETURN_IF_ERROR(FillConfig(op, device, false, q, k, v, bias, q_len, kv_len, seed, c, &cfg));
  if (lse->element_type() != ffi::DataType::F32 || NumElements(*lse) != cfg.b * cfg.hq * cfg.sq) {
    return Invalid(op, "lse result must be float32 [B, Hq, Sq], got " + ShapeStr(lse->dimensions()));
  }
  std::array<void*, kDBias + 1> ptrs{};
  ptrs[kQ] = q.untyped_data();
  ptrs[kK] = k.untyped_data();
  ptrs[kV] = v.untyped_data();
  ptrs[kO] = out->untyped_data();
  ptrs[kStats] = lse->untyped_data();
  ptrs[kBias] = bias.untyped_data();
  ptrs[kSeqQ] = q_len.untyped_data();
  ptrs[kSeqKV] = kv_len.untyped_data();
  ptrs[kSeed] = seed.untyped_data();
  ptrs[kOffset] = seed.untyped_data() == nullptr ? nullptr : static_cast<char*>(seed.untyped_data()) + 8;
  return Run<kStage>(op, stream, cfg, ptrs, *workspace);
}

template <ExecutionStage kStage>
ffi::Error BwdImpl(cudaStream_t stream, int32_t device, AnyBuffer q, AnyBuffer k, AnyBuffer v, AnyBuffer out,
                   AnyBuffer d_out, AnyBuffer lse, AnyBuffer bias, AnyBuffer q_len, AnyBuffer kv_len, AnyBuffer seed,
                   ffi::RemainingArgs, Result<AnyBuffer> dq, Result<AnyBuffer> dk, Result<AnyBuffer> dv,
                   Result<AnyBuffer> dbias, Result<AnyBuffer> workspace, float scale, float dropout, int32_t has_bias,
                   int32_t padding, int32_t left_bound, int32_t right_bound, int32_t need_dbias,
                   int32_t bottom_right, int32_t deterministic) {
  const char* op = kBwdName;
  Config cfg;
  Common c{has_bias, padding, left_bound, right_bound, scale, dropout, 1, need_dbias};
  c.bottom_right = bottom_right;
  c.deterministic = deterministic;
  TE_RETURN_IF_ERROR(FillConfig(op, device, true, q, k, v, bias, q_len, kv_len, seed, c, &cfg));
  if (lse.element_type() != ffi::DataType::F32 || NumElements(lse) != cfg.b * cfg.hq * cfg.sq) {
    return Invalid(op, "lse must be float32 [B, Hq, Sq], got " + ShapeStr(lse.dimensions()));
  }
  if (out.element_type() != q.element_type() || d_out.element_type() != q.element_type() ||
      NumElements(out) != cfg.b * cfg.sq * cfg.hq * cfg.dv || NumElements(d_out) != NumElements(out)) {
    return Invalid(op, "out and d_out must be [B, Sq, Hq, Dv] in q's dtype, got " + ShapeStr(out.dimensions()) +
                           " and " + ShapeStr(d_out.dimensions()));
  }
  if (cfg.dbias && NumElements(*dbias) != NumElements(bias)) {
    return Invalid(op, "dbias result must have bias's shape " + ShapeStr(bias.dimensions()) + ", got " +
                           ShapeStr(dbias->dimensions()));
  }
  std::array<void*, kDBias + 1> ptrs{};
  ptrs[kQ] = q.untyped_data();
  ptrs[kK] = k.untyped_data();
  ptrs[kV] = v.untyped_data();
  ptrs[kO] = out.untyped_data();
  ptrs[kDO] = d_out.untyped_data();
  ptrs[kStats] = lse.untyped_data();
  ptrs[kBias] = bias.untyped_data();
  ptrs[kSeqQ] = q_len.untyped_data();
  ptrs[kSeqKV] = kv_len.untyped_data();
  ptrs[kSeed] = seed.untyped_data();
  ptrs[kOffset] = seed.untyped_data() == nullptr ? nullptr : static_cast<char*>(seed.untyped_data()) + 8;
  ptrs[kDQ] = dq->untyped_data();
  ptrs[kDK] = dk->untyped_data();
  ptrs[kDV] = dv->untyped_data();
  ptrs[kDBias] = dbias->untyped_data();
  return Run<kStage>(op, stream, cfg, ptrs, *workspace);
}

template <ExecutionStage kStage>
auto BindFwd() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<AnyBuffer>()  // q
      .template Arg<AnyBuffer>()  // k
      .template Arg<AnyBuffer>()  // v
      .template Arg<AnyBuffer>()  // bias (dummy when has_bias == 0)
      .template Arg<AnyBuffer>()  // q_seqlens (dummy unless padding)
      .template Arg<AnyBuffer>()  // kv_seqlens (dummy unless padding)
      .template Arg<AnyBuffer>()  // seed uint32[4] (dummy unless dropout)
      .RemainingArgs()            // optional output buffers aliased to the results (tests poison them)
      .template Ret<AnyBuffer>()  // out
      .template Ret<AnyBuffer>()  // lse (unwritten when stats == 0)
      .template Ret<AnyBuffer>()  // workspace
      .template Attr<float>("scale")
      .template Attr<float>("dropout")
      .template Attr<int32_t>("has_bias")
      .template Attr<int32_t>("padding")
      .template Attr<int32_t>("left_bound")
      .template Attr<int32_t>("right_bound")
      .template Attr<int32_t>("stats")          // 1: training (write lse), 0: inference
      .template Attr<int32_t>("bottom_right");  // 1: BOTTOM_RIGHT diagonal alignment, 0: TOP_LEFT
}

template <ExecutionStage kStage>
auto BindBwd() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<AnyBuffer>()  // q
      .template Arg<AnyBuffer>()  // k
      .template Arg<AnyBuffer>()  // v
      .template Arg<AnyBuffer>()  // out
      .template Arg<AnyBuffer>()  // d_out
      .template Arg<AnyBuffer>()  // lse
      .template Arg<AnyBuffer>()  // bias
      .template Arg<AnyBuffer>()  // q_seqlens
      .template Arg<AnyBuffer>()  // kv_seqlens
      .template Arg<AnyBuffer>()  // seed
      .RemainingArgs()
      .template Ret<AnyBuffer>()  // dq
      .template Ret<AnyBuffer>()  // dk
      .template Ret<AnyBuffer>()  // dv
      .template Ret<AnyBuffer>()  // dbias (dummy [1] unless need_dbias)
      .template Ret<AnyBuffer>()  // workspace
      .template Attr<float>("scale")
      .template Attr<float>("dropout")
      .template Attr<int32_t>("has_bias")
      .template Attr<int32_t>("padding")
      .template Attr<int32_t>("left_bound")
      .template Attr<int32_t>("right_bound")
      .template Attr<int32_t>("need_dbias")      // the bias is the user's (not only the segment mask)
      .template Attr<int32_t>("bottom_right")    // 1: BOTTOM_RIGHT diagonal alignment, 0: TOP_LEFT
      .template Attr<int32_t>("deterministic");  // 1: cuDNN's deterministic backward (no atomic dQ accumulation)
}

constexpr ExecutionStage kInit = ExecutionStage::kInitialize;
constexpr ExecutionStage kExec = ExecutionStage::kExecute;

}  // namespace

XLA_FFI_DEFINE_HANDLER(kFwdInit, FwdImpl<kInit>, BindFwd<kInit>());
XLA_FFI_DEFINE_HANDLER(kFwdExec, FwdImpl<kExec>, BindFwd<kExec>(), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kBwdInit, BwdImpl<kInit>, BindBwd<kInit>());
XLA_FFI_DEFINE_HANDLER(kBwdExec, BwdImpl<kExec>, BindBwd<kExec>(), {ffi::Traits::kCmdBufferCompatible});

}  // namespace te::fused_attention

namespace te {
namespace {

const TargetRegistrar kRegister({
    {"te_fused_attention_fwd", fused_attention::kFwdInit, fused_attention::kFwdExec},
    {"te_fused_attention_bwd", fused_attention::kBwdInit, fused_attention::kBwdExec},
});

}  // namespace
}  // namespace te
