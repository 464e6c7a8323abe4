// cuDNN SDPA forward/backward graph construction and caching (see fused_attention_graphs.h).
#include "fused_attention/fused_attention_graphs.h"

#include <cudnn_frontend.h>

#include "common/ffi_util.h"

#include <cstdio>
#include <map>
#include <unordered_map>
#include <vector>

namespace te::fused_attention {
namespace fe = cudnn_frontend;
using Graph = fe::graph::Graph;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// No iostreams (see csrc/common/ffi_util.h): plain concatenation.
namespace {
template <typename T>
std::string Str(T v) {
  return std::to_string(v);
}
}  // namespace

std::string Config::Key() const {
  char scale_hex[64], drop_hex[64];
  std::snprintf(scale_hex, sizeof(scale_hex), "%a", static_cast<double>(scale));
  std::snprintf(drop_hex, sizeof(drop_hex), "%a", static_cast<double>(dropout));
  return Str(device) + (backward ? "|bwd|" : "|fwd|") + Str(static_cast<int>(io)) + "|" + Str(b) + "," + Str(sq) +
         "," + Str(sk) + "," + Str(hq) + "," + Str(hk) + "," + Str(d) + "," + Str(dv) + "|bias" + Str(bias_b) + "x" +
         Str(bias_h) + "|pad" + Str(static_cast<int>(padding)) + "|lb" + Str(left_bound) + "|rb" + Str(right_bound) +
         "|br" + Str(static_cast<int>(bottom_right)) + "|s" + scale_hex + "|p" + drop_hex + "|st" +
         Str(static_cast<int>(backward || stats)) + "|db" + Str(static_cast<int>(backward && dbias)) + "|det" +
         Str(static_cast<int>(backward && deterministic));
}

std::string Config::Describe() const {
  std::string s = std::string(backward ? "backward" : "forward") + " q[" + Str(b) + ", " + Str(sq) + ", " + Str(hq) +
                  ", " + Str(d) + "] k[" + Str(b) + ", " + Str(sk) + ", " + Str(hk) + ", " + Str(d) + "] v[" + Str(b) +
                  ", " + Str(sk) + ", " + Str(hk) + ", " + Str(dv) + "] " +
                  (io == IoType::kBF16 ? "bfloat16" : "float16");
  if (has_bias()) s += " bias[" + Str(bias_b) + ", " + Str(bias_h) + ", " + Str(sq) + ", " + Str(sk) + "]";
  if (padding) s += " padding";
  if (right_bound >= 0) s += " right_bound=" + Str(right_bound);
  if (left_bound >= 0) s += " left_bound=" + Str(left_bound);
  if (bottom_right && (left_bound >= 0 || right_bound >= 0)) s += " bottom_right";
  if (dropout > 0.f) s += " dropout=" + Str(dropout);
  if (!backward && !stats) s += " inference";
  if (backward && dbias) s += " dbias";
  if (backward && deterministic) s += " deterministic";
  return s;
}

namespace {

// RAII: make `device` current for the calling thread, restore the previous one afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    ok_ = cudaGetDevice(&prev_) == cudaSuccess;
    if (ok_ && prev_ != device) ok_ = cudaSetDevice(device) == cudaSuccess;
    changed_ = ok_ && prev_ != device;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);
  }
  bool ok() const { return ok_; }

 private:
  int prev_ = 0;
  bool ok_ = false;
  bool changed_ = false;
};

std::mutex& HandlesMutex() {
  static std::mutex m;
  return m;
}
std::map<int, cudnnHandle_t>& Handles() {
  static auto* h = new std::map<int, cudnnHandle_t>();
  return *h;
}

// [B, H, S, D] logical dims over the [B, S, H, D] (BSHD) memory layout XLA hands us.
std::vector<int64_t> BshdStride(int64_t s, int64_t h, int64_t d) { return {s * h * d, d, h * d, 1}; }

#define TE_FE_TRY(expr, what)                                                       \
  do {                                                                             \
    auto te_fe_status_ = (expr);                                                   \
    if (te_fe_status_.is_bad()) {                                                  \
      return std::string("cudnn_frontend ") + (what) + ": " + te_fe_status_.get_message(); \
    }                                                                              \
  } while (0)

// Mask/bias/dropout attributes shared by the forward and backward SDPA nodes.
template <typename Attrs>
void SetCommon(const Config& cfg, Graph& g, Attrs& attrs, TensorPtr* seq_q, TensorPtr* seq_kv, TensorPtr* seed,
               TensorPtr* offset, TensorPtr* bias) {
  attrs.set_attn_scale(cfg.scale);
  if (cfg.right_bound >= 0 || cfg.left_bound >= 0) {
    attrs.set_diagonal_alignment(cfg.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                                  : fe::DiagonalAlignment_t::TOP_LEFT);
  }
  if (cfg.right_bound >= 0) attrs.set_diagonal_band_right_bound(static_cast<int>(cfg.right_bound));
  if (cfg.left_bound >= 0) attrs.set_diagonal_band_left_bound(static_cast<int>(cfg.left_bound));
  if (cfg.has_bias()) {
    *bias = g.tensor(fe::graph::Tensor_attributes()
                         .set_name("bias")
                         .set_uid(kBias)
                         .set_dim({cfg.bias_b, cfg.bias_h, cfg.sq, cfg.sk})
                         .set_stride({cfg.bias_h * cfg.sq * cfg.sk, cfg.sq * cfg.sk, cfg.sk, 1}));
    attrs.set_bias(*bias);
  }
  if (cfg.padding) {
    auto lens = [&](const char* name, int64_t uid) {
      return g.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({cfg.b, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT32));
    };
    *seq_q = lens("seq_len_q", kSeqQ);
    *seq_kv = lens("seq_len_kv", kSeqKV);
    attrs.set_padding_mask(true).set_seq_len_q(*seq_q).set_seq_len_kv(*seq_kv);
  }
  if (cfg.dropout > 0.f) {
    auto scalar = [&](const char* name, int64_t uid) {
      return g.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({1, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT64));
    };
    *seed = scalar("seed", kSeed);
    *offset = scalar("offset", kOffset);
    attrs.set_dropout(cfg.dropout, *seed, *offset);
  }
}

std::string Build(const Config& cfg, cudnnHandle_t handle, Entry* entry) {
  if (cfg.d % 8 != 0 || cfg.dv % 8 != 0 || cfg.d > 256 || cfg.dv > 256) {
    return "head dims must be multiples of 8 and at most 256";
  }
  if (cfg.hk <= 0 || cfg.hq % cfg.hk != 0) return "Hq must be a multiple of Hk";
  auto g = std::make_shared<Graph>();
  const auto io = cfg.io == IoType::kBF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
  g->set_io_data_type(io)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto tensor = [&](const char* name, int64_t uid, std::vector<int64_t> dim, std::vector<int64_t> stride) {
    return g->tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride));
  };
  const int64_t b = cfg.b, sq = cfg.sq, sk = cfg.sk, hq = cfg.hq, hk = cfg.hk, d = cfg.d, dv = cfg.dv;
  auto q = tensor("Q", kQ, {b, hq, sq, d}, BshdStride(sq, hq, d));
  auto k = tensor("K", kK, {b, hk, sk, d}, BshdStride(sk, hk, d));
  auto v = tensor("V", kV, {b, hk, sk, dv}, BshdStride(sk, hk, dv));
  TensorPtr seq_q, seq_kv, seed, offset, bias;

  if (!cfg.backward) {
    auto attrs = fe::graph::SDPA_attributes().set_name("te_sdpa_fwd").set_generate_stats(cfg.stats);
    SetCommon(cfg, *g, attrs, &seq_q, &seq_kv, &seed, &offset, &bias);
    auto outs = g->sdpa(q, k, v, attrs);
    auto o = outs[0];
    auto stats = outs[1];
    o->set_output(true).set_uid(kO).set_dim({b, hq, sq, dv}).set_stride(BshdStride(sq, hq, dv));
    if (cfg.stats) {
      if (!stats) return "cudnn_frontend sdpa returned no stats tensor";
      stats->set_output(true)
          .set_uid(kStats)
          .set_data_type(fe::DataType_t::FLOAT)
          .set_dim({b, hq, sq, 1})
          .set_stride({hq * sq, sq, 1, 1});
    }
  } else {
    auto o = tensor("O", kO, {b, hq, sq, dv}, BshdStride(sq, hq, dv));
    auto d_o = tensor("dO", kDO, {b, hq, sq, dv}, BshdStride(sq, hq, dv));
    auto stats = g->tensor(fe::graph::Tensor_attributes()
                               .set_name("stats")
                               .set_uid(kStats)
                               .set_dim({b, hq, sq, 1})
                               .set_stride({hq * sq, sq, 1, 1})
                               .set_data_type(fe::DataType_t::FLOAT));
    auto attrs = fe::graph::SDPA_backward_attributes().set_name("te_sdpa_bwd");
    SetCommon(cfg, *g, attrs, &seq_q, &seq_kv, &seed, &offset, &bias);
    if (cfg.deterministic) attrs.set_deterministic_algorithm(true);  // ordered dQ accumulation, no atomics
    if (cfg.has_bias() && cfg.dbias) {
      auto dbias = g->tensor(fe::graph::Tensor_attributes()
                                 .set_name("dbias")
                                 .set_uid(kDBias)
                                 .set_dim({cfg.bias_b, cfg.bias_h, sq, sk})
                                 .set_stride({cfg.bias_h * sq * sk, sq * sk, sk, 1}));
      attrs.set_dbias(dbias);
    }
    auto grads = g->sdpa_backward(q, k, v, o, d_o, stats, attrs);
    grads[0]->set_output(true).set_uid(kDQ).set_dim({b, hq, sq, d}).set_stride(BshdStride(sq, hq, d));
    grads[1]->set_output(true).set_uid(kDK).set_dim({b, hk, sk, d}).set_stride(BshdStride(sk, hk, d));
    grads[2]->set_output(true).set_uid(kDV).set_dim({b, hk, sk, dv}).set_stride(BshdStride(sk, hk, dv));
  }

  TE_FE_TRY(g->validate(), "validate");
  TE_FE_TRY(g->build_operation_graph(handle), "build_operation_graph");
  TE_FE_TRY(g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "create_execution_plans");
  TE_FE_TRY(g->check_support(handle), "check_support");
  TE_FE_TRY(g->build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans");
  int64_t ws = 0;
  TE_FE_TRY(g->get_workspace_size(ws), "get_workspace_size");
  entry->workspace = ws;
  entry->graph = g;
  return "";
}

std::mutex& CacheMutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<std::string, std::shared_ptr<const Entry>>& Cache() {
  static auto* c = new std::unordered_map<std::string, std::shared_ptr<const Entry>>();
  return *c;
}

}  // namespace

cudnnHandle_t Handle(int device, std::string* error) {
  std::lock_guard<std::mutex> lock(HandlesMutex());
  auto it = Handles().find(device);
  if (it != Handles().end()) return it->second;
  DeviceGuard guard(device);
  if (!guard.ok()) {
    *error = "cudaSetDevice(" + std::to_string(device) + ") failed";
    return nullptr;
  }
  cudnnHandle_t h = nullptr;
  cudnnStatus_t st = cudnnCreate(&h);
  if (st != CUDNN_STATUS_SUCCESS) {
    *error = std::string("cudnnCreate failed: ") + cudnnGetErrorString(st);
    return nullptr;
  }
  Handles()[device] = h;
  return h;
}

std::mutex& HandleMutex(int device) {
  static std::mutex guard;
  static auto* m = new std::map<int, std::unique_ptr<std::mutex>>();
  std::lock_guard<std::mutex> lock(guard);
  auto& slot = (*m)[device];
  if (!slot) slot = std::make_unique<std::mutex>();
  return *slot;
}

std::shared_ptr<const Entry> GetOrBuild(const Config& cfg) {
  const std::string key = cfg.Key();
  // One lock for lookups and builds: builds are rare (once per key) and must not race on a handle.
  std::lock_guard<std::mutex> lock(CacheMutex());
  auto it = Cache().find(key);
  if (it != Cache().end()) return it->second;
  auto entry = std::make_shared<Entry>();
  std::string error;
  cudnnHandle_t h = Handle(cfg.device, &error);
  if (h != nullptr) {
    DeviceGuard guard(cfg.device);
    std::lock_guard<std::mutex> hlock(HandleMutex(cfg.device));
    try {
      error = guard.ok() ? Build(cfg, h, entry.get()) : "cudaSetDevice failed";
    } catch (const std::exception& e) {
      error = std::string("exception while building the cuDNN graph: ") + e.what();
    }
  }
  if (!error.empty()) {
    entry->error = error;
    entry->graph.reset();
  }
  Cache()[key] = entry;
  return entry;
}

std::string Execute(const Config& cfg, const Entry& entry, cudaStream_t stream, void* const* ptrs, void* workspace) {
  auto* g = static_cast<Graph*>(entry.graph.get());
  if (g == nullptr) return "graph not built: " + entry.error;
  std::vector<int64_t> uids = {kQ, kK, kV, kO};
  if (cfg.backward || cfg.stats) uids.push_back(kStats);
  if (cfg.backward) uids.insert(uids.end(), {kDO, kDQ, kDK, kDV});
  if (cfg.has_bias()) {
    uids.push_back(kBias);
    if (cfg.backward && cfg.dbias) uids.push_back(kDBias);
  }
  if (cfg.padding) uids.insert(uids.end(), {kSeqQ, kSeqKV});
  if (cfg.dropout > 0.f) uids.insert(uids.end(), {kSeed, kOffset});
  std::unordered_map<int64_t, void*> pack;
  pack.reserve(uids.size());
  for (int64_t uid : uids) pack.emplace(uid, ptrs[uid]);
  std::string error;
  cudnnHandle_t h = Handle(cfg.device, &error);
  if (h == nullptr) return error;
  std::lock_guard<std::mutex> lock(HandleMutex(cfg.device));
  DeviceGuard guard(cfg.device);  // launches must target the stream's device (a no-op when it is current)
  if (!guard.ok()) return "cudaSetDevice(" + std::to_string(cfg.device) + ") failed";
  cudnnStatus_t st = cudnnSetStream(h, stream);
  if (st != CUDNN_STATUS_SUCCESS) return std::string("cudnnSetStream failed: ") + cudnnGetErrorString(st);
  try {
    auto status = g->execute(h, pack, workspace);
    if (status.is_bad()) return "cudnn_frontend execute: " + status.get_message();
  } catch (const std::exception& e) {
    return std::string("exception in cudnn_frontend execute: ") + e.what();
  }
  return "";
}

}  // namespace te::fused_attention

// Support query for Python (te_ops.fused_attention.native, through ctypes): builds (and caches) the
// graph for a configuration on `device` and reports cuDNN's verdict and the workspace size. Exported
// with default visibility so ctypes finds it in the extension module.
//
// ints: device, io (0 bf16, 1 f16), backward, b, sq, sk, hq, hk, d, dv, bias_b, bias_h, padding,
//       left_bound, right_bound, stats (forward: 1 training, 0 inference), dbias (backward: 1 = compute the
//       bias gradient), bottom_right (1: band aligned at the bottom-right corner), deterministic (backward:
//       1 = cuDNN's deterministic algorithm; it can change the workspace size and the verdict). Returns 0 when
//       supported (workspace set), 1 when not (err filled), 2 on bad arguments.
extern "C" __attribute__((visibility("default"))) int te_fused_attention_query(const int64_t* ints, int n_ints,
                                                                                 double scale, double dropout,
                                                                                 int64_t* workspace, char* err,
                                                                                 int err_len) {
  using namespace te::fused_attention;
  if (ints == nullptr || n_ints != 19) {
    return te::CopyError("te_fused_attention_query: expected 19 ints", err, err_len, 2);
  }
  Config cfg;
  cfg.device = static_cast<int>(ints[0]);
  cfg.io = ints[1] == 0 ? IoType::kBF16 : IoType::kF16;
  cfg.backward = ints[2] != 0;
  cfg.b = ints[3];
  cfg.sq = ints[4];
  cfg.sk = ints[5];
  cfg.hq = ints[6];
  cfg.hk = ints[7];
  cfg.d = ints[8];
  cfg.dv = ints[9];
  cfg.bias_b = ints[10];
  cfg.bias_h = ints[11];
  cfg.padding = ints[12] != 0;
  cfg.left_bound = ints[13];
  cfg.right_bound = ints[14];
  cfg.stats = ints[15] != 0;
  cfg.dbias = cfg.backward && cfg.bias_b > 0 && ints[16] != 0;
  cfg.bottom_right = ints[17] != 0;
  cfg.deterministic = cfg.backward && ints[18] != 0;
  cfg.scale = static_cast<float>(scale);
  cfg.dropout = static_cast<float>(dropout);
  auto entry = GetOrBuild(cfg);
  if (!entry->error.empty()) return te::CopyError(entry->error, err, err_len, 1);
  if (workspace != nullptr) *workspace = entry->workspace;
  return 0;
}
