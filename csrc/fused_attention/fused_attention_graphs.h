// cuDNN SDPA graphs for te_ops.fused_attention: configuration, graph building and a process-wide
// cache keyed by (device, direction, shape, dtype, config).
//
// Graphs are built with the cuDNN frontend C++ graph API (header-only, cudnn_frontend.h) in the FFI
// initialize stage, outside any CUDA-graph capture, and executed in the execute stage with a variant
// pack of XLA's buffers on XLA's stream. The workspace is an extra FFI result buffer whose size Python
// obtains from te_fused_attention_query() (exported C symbol) when it checks support, so nothing is
// allocated at run time and the call is capturable into XLA's command buffers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include <cudnn.h>

namespace te::fused_attention {

enum class IoType : int { kBF16 = 0, kF16 = 1 };

// Tensor uids in the variant pack.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kBias, kSeqQ, kSeqKV, kSeed, kOffset, kDO, kDQ, kDK, kDV, kDBias
};

struct Config {
  int device = 0;
  IoType io = IoType::kBF16;
  bool backward = false;
  int64_t b = 0, sq = 0, sk = 0, hq = 0, hk = 0, d = 0, dv = 0;
  int64_t bias_b = 0, bias_h = 0;  // bias dims [bias_b, bias_h, sq, sk]; 0 = no bias
  bool padding = false;            // seq_len_q / seq_len_kv int32 [b] tensors
  int64_t left_bound = -1;         // cuDNN diagonal band left bound (keep j > i - left_bound); -1 = none
  int64_t right_bound = -1;        // cuDNN diagonal band right bound (keep j <= i + right_bound); -1 = none
  bool bottom_right = false;       // band aligned at the bottom-right corner: i -> i + (sk - sq), per batch
                                   // entry i + (seq_len_kv - seq_len_q) with padding
  float scale = 1.f;
  float dropout = 0.f;             // probability of dropping; > 0 needs seed/offset int64 [1] tensors
  bool stats = true;               // forward: write the softmax statistics (training); false = inference
  bool dbias = false;              // backward: also compute the bias gradient (only for a user bias)
  bool deterministic = false;      // backward: cuDNN's deterministic algorithm (no atomic dQ accumulation)

  bool has_bias() const { return bias_b > 0; }
  std::string Key() const;
  std::string Describe() const;  // for error messages
};

// A built graph; `graph` is opaque here (cudnn_frontend::graph::Graph).
struct Entry {
  std::shared_ptr<void> graph;
  int64_t workspace = 0;
  std::string error;  // non-empty: cuDNN cannot run this configuration (the frontend's reason)
};

// The cached entry for cfg, built on first use (thread-safe; building happens once per key).
std::shared_ptr<const Entry> GetOrBuild(const Config& cfg);

// The cudnn handle of a device (created on first use) and the mutex that serialises
// cudnnSetStream + execute on it.
cudnnHandle_t Handle(int device, std::string* error);
std::mutex& HandleMutex(int device);

// Executes a built graph on `stream`. `ptrs` maps uids to device pointers (absent uids: not in the graph).
// Returns an empty string on success, else the error text.
std::string Execute(const Config& cfg, const Entry& entry, cudaStream_t stream, void* const* ptrs,
                    void* workspace);

}  // namespace te::fused_attention
