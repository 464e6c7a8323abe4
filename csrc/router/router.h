// Host interface of the MoE router kernels (csrc/router).
//
// Row-wise ops (fused top-k with score function, aux-loss scores): one warp owns one token row of
// E <= kMaxExperts logits at a time (persistent warps walk over the rows); lane l holds the EPT
// contiguous experts [l * EPT, l * EPT + EPT), EPT = ceil(E / 32) rounded up to a power of two,
// moved with 16-byte vectors when E % EPT == 0 (router_rows.cuh, router_kernels.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace te::router {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
enum class Score : int { kSoftmax = 0, kSigmoid = 1 };

constexpr int kMaxExperts = 1024;      // 32 lanes x 32 register slots
constexpr int kMaxTopk = 32;
constexpr int kMaxGroups = 32;         // one group per lane
constexpr int kMaxPerGroupTopk = 16;   // topk / group_topk
constexpr int kWarpsPerBlock = 4;      // warps (rows in flight) per block of the row-wise kernels
constexpr int kLossPartials = 512;     // blocks (and partial sums) of the aux-loss reduction

struct RowParams {
  const void* logits = nullptr;      // [rows, experts], dtype
  const float* bias = nullptr;       // [experts] fp32 expert bias, or null
  const void* g = nullptr;           // backward: cotangent of probs (top-k) or scores (aux), dtype
  const uint8_t* map_in = nullptr;   // top-k backward: the routing map (bool bytes or compact bits)
  void* out = nullptr;               // forward: probs (top-k) / scores (aux); backward: d logits
  uint8_t* map_out = nullptr;        // forward: the routing map (bool bytes or compact bits)
  int64_t rows = 0;
  int experts = 0;
  int topk = 1;
  Score score = Score::kSoftmax;
  bool pre_softmax = false;
  bool aux = false;                  // compute_routing_scores_for_aux_loss instead of the top-k op
  int num_groups = 0;                // 0: no grouped selection
  int group_topk = 0;
  float scaling = 1.f;
  bool compact = false;              // map is uint8 [rows, ceil(E/8)], bit e % 8 of byte e / 8
  DType dtype = DType::kF32;
};

// Elements per lane (1, 2, 4, 8, 16, 32) for `experts` <= kMaxExperts.
int ElementsPerLane(int experts);

cudaError_t LaunchRowForward(const RowParams& p, cudaStream_t stream);
cudaError_t LaunchRowBackward(const RowParams& p, cudaStream_t stream);

struct LossParams {
  const void* probs = nullptr;   // forward: [rows, experts], dtype
  const float* tpe = nullptr;    // [experts] tokens per expert (fp32)
  float* partials = nullptr;     // forward: [kLossPartials] scratch (an XLA-allocated result)
  float* out = nullptr;          // forward: fp32 scalar sum_t sum_e probs[t, e] * tpe[e]
  const float* g = nullptr;      // backward: fp32 scalar (already scaled)
  void* dprobs = nullptr;        // backward: [rows, experts], dtype
  int64_t rows = 0;
  int experts = 0;
  DType dtype = DType::kF32;
};

cudaError_t LaunchLossForward(const LossParams& p, cudaStream_t stream);
cudaError_t LaunchLossBackward(const LossParams& p, cudaStream_t stream);

}  // namespace te::router
