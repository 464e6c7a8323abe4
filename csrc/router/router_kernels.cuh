// MoE router row kernels: one warp per token row, the row in registers, one pass over HBM.
//
// Lane layout, keys, slices and the warp top-k: router_rows.cuh.
//
// Persistent warps. The grid holds as many blocks as fit on the device at once (router_launch.cuh);
// warp w handles rows w, w + W, w + 2W, ... and issues the loads of its NEXT row before working on
// the current one. The old kernels (one row per warp, then exit) had each warp's single row load
// followed by a long dependent top-k/softmax chain, so only a fraction of the resident warps had
// loads in flight at any time (T65536 E256 fp32 forward: 0.132 ms for 151 MB, ~1.1 TB/s). With
// the prefetch every resident warp keeps a row's worth of bytes in flight while it computes.
//
// Kernels are specialised by what they compute (FwdKind / BwdKind) so that the common softmax
// top-k carries no registers or branches of the other variants.
//
// Forward, per row:
//  1. scores s (softmax with pre-softmax: exp / sum over the row; softmax without: the logits;
//     sigmoid: 1 / (1 + exp(-x))), selection scores s + expert bias;
//  2. grouped selection (router_groups.cuh): only the best group_topk groups stay selectable;
//  3. WarpTopK over the selection keys -> per-lane chosen mask;
//  4. weights (softmax over the chosen logits: the max is round 0's winner, no extra reduction;
//     sigmoid: normalised by one warp sum), dense probs / scores (streaming stores), routing map.
// Backward, per row, reads only what the gradient needs: for softmax without pre-softmax and for
// sigmoid the gradient is zero outside the k chosen experts, so only the lanes holding a chosen
// expert read their slice of the logits and of d probs (a 32-byte sector each at E256 fp32); the
// full row is read only for pre-softmax (the logits) and the aux scores (logits and d scores).
#pragma once

#include "router/router_groups.cuh"
#include "router/router_rows.cuh"

namespace te::router {

enum class FwdKind : int {
  kSoftmaxTopk = 0,  // top-k, softmax without pre-softmax, no groups (no bias: sigmoid only)
  kTopk = 1,         // other top-k configurations (pre-softmax, sigmoid, bias, FastGroups groups)
  kTopkGrouped = 2,  // top-k with grouped selection outside FastGroups (shared-memory group scan)
  kAux = 3,          // compute_routing_scores_for_aux_loss
};

enum class BwdKind : int {
  kSparse = 0,      // top-k, softmax without pre-softmax or sigmoid: gradient only at chosen experts
  kPreSoftmax = 1,  // top-k with pre-softmax: dense logits, d probs only at chosen experts
  kAux = 2,         // aux scores: dense logits and d scores
};

// Prefetch the next row only while the raw slice is small (<= 32 bytes per lane: E <= 256 fp32,
// E <= 512 bf16): larger slices would cost more registers than the occupancy they buy back.
template <typename T, int EPT, bool kVec>
constexpr bool kPrefetch = Slice<T, EPT, kVec>::kWords <= 8;

// The lane's slots that hold experts: [0, n), n = clamp(E - e0, 0, EPT). With kVec (E % EPT == 0)
// a slice is all in or all out. Slot tests compare j with n (cheap to recompute, unlike a set of
// mask bits that the compiler would keep live, or spill, across the division slow paths).
struct Slots {
  int n;
  __device__ __forceinline__ bool Has(int j) const { return j < n; }
  __device__ __forceinline__ uint32_t Mask() const { return n >= 32 ? kFull : (1u << n) - 1u; }
};

template <int EPT, bool kVec>
__device__ __forceinline__ Slots LaneSlots(int e0, int E) {
  if constexpr (kVec) return Slots{e0 < E ? EPT : 0};
  return Slots{min(max(E - e0, 0), EPT)};
}

// softmax over the valid slots, in place (invalid slots end up 0). kDivide: exp / sum per element,
// as the forward always computed the scores it selects on; otherwise exp * (1 / sum) (backward:
// no per-element division slow paths, whose calls cost registers and spills; within 2 ulp).
template <int EPT, bool kDivide>
__device__ __forceinline__ void SoftmaxSlots(float (&v)[EPT], Slots valid) {
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < EPT; ++j) {
    if (valid.Has(j)) mx = fmaxf(mx, v[j]);
  }
  mx = WarpMaxF(mx);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < EPT; ++j) {
    v[j] = valid.Has(j) ? expf(v[j] - mx) : 0.f;
    sum += v[j];
  }
  sum = WarpSum(sum);
  if constexpr (kDivide) {
#pragma unroll
    for (int j = 0; j < EPT; ++j) v[j] = v[j] / sum;
  } else {
    const float inv = 1.f / sum;
#pragma unroll
    for (int j = 0; j < EPT; ++j) v[j] *= inv;
  }
}

// scale / sum for the softmax over the chosen logits, where sum (of exps <= 1, the largest exactly
// 1) lies in [1, 32]: the approximate division (2 ulp) is safe there, and it has no slow-path call
// (whose calling convention costs registers and caused spills).
__device__ __forceinline__ float SoftmaxScale(float scale, float sum) { return __fdividef(scale, sum); }

// o = scaling * softmax over the chosen slots of the logits logit(j) (0 elsewhere). `first` is the
// top-k's round-0 winner, i.e. the key of the largest chosen logit: the max needs no reduction.
// Every slot's exp is computed, then selected: no branches.
template <int EPT, typename Logit>
__device__ __forceinline__ void ChosenSoftmax(Logit logit, uint32_t chosen, uint32_t first, float scaling,
                                              float (&o)[EPT]) {
  const float mx = KeyFloat(first);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < EPT; ++j) {
    const float ex = ExpNonPos(logit(j) - mx);
    o[j] = ((chosen >> j) & 1u) ? ex : 0.f;
    sum += o[j];
  }
  const float scale = SoftmaxScale(scaling, WarpSum(sum));
  // Only chosen slots are scaled: a NaN scale (a NaN chosen logit) must leave the others at 0.
#pragma unroll
  for (int j = 0; j < EPT; ++j) o[j] = ((chosen >> j) & 1u) ? o[j] * scale : 0.f;
}

// The expert bias of a lane's slots: in registers for small vector slices (E <= 256), re-read per
// row (L1 hits) otherwise, where EPT more live registers would cost occupancy or spill.
template <int EPT, bool kVec>
struct LaneBias {
  static constexpr bool kHoist = kVec && EPT <= 8;
  float v[kHoist ? EPT : 1];
  const float* ptr;

  __device__ __forceinline__ void Init(const float* bias, int e0, Slots valid) {
    ptr = bias + e0;
    if constexpr (kHoist) {
#pragma unroll
      for (int j = 0; j < EPT; ++j) v[j] = valid.Has(j) ? __ldg(ptr + j) : 0.f;
    }
  }
  __device__ __forceinline__ float Get(int j) const {  // only for valid slots
    if constexpr (kHoist) {
      return v[j];
    } else {
      return __ldg(ptr + j);
    }
  }
};

template <typename T, int EPT, bool kVec, FwdKind kKind>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) RowForwardKernel(RowParams p) {
  extern __shared__ float smem[];  // kTopkGrouped only: kWarpsPerBlock * E floats
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int stride = gridDim.x * kWarpsPerBlock;  // the grid is at most the resident blocks
  int64_t row = blockIdx.x * kWarpsPerBlock + warp;
  if (row >= p.rows) return;  // warp-uniform: the whole warp leaves together
  const int E = p.experts;
  const int e0 = lane * EPT;
  const Slots valid = LaneSlots<EPT, kVec>(e0, E);
  const T* x = static_cast<const T*>(p.logits);
  T* out = static_cast<T*>(p.out);

  // Per-lane constants: a lane owns the same experts in every row.
  constexpr bool kTopkKind = kKind == FwdKind::kTopk || kKind == FwdKind::kTopkGrouped;
  LaneBias<EPT, kVec> bias;
  GroupLayout groups{};
  if constexpr (kTopkKind) {
    if (p.bias != nullptr) bias.Init(p.bias, e0, valid);
  }
  if constexpr (kKind == FwdKind::kTopkGrouped) groups = MakeGroupLayout<EPT>(p, e0);

  Slice<T, EPT, kVec> cur;
  cur.Load(x + row * E, e0, E);
  for (;;) {
    const int64_t next = row + stride;
    const bool more = next < p.rows;
    Slice<T, EPT, kVec> nxt;
    if constexpr (kPrefetch<T, EPT, kVec>) {
      if (more) nxt.Load(x + next * E, e0, E);  // in flight while this row is processed
    }

    uint32_t key[EPT];
    uint32_t chosen, first = 0u;
    float o[EPT];  // the dense output row slice: probs (top-k) or scores (aux)
    if constexpr (kKind == FwdKind::kSoftmaxTopk) {
      // Selection on the logits themselves; weights = softmax over the chosen logits.
#pragma unroll
      for (int j = 0; j < EPT; ++j) key[j] = valid.Has(j) ? SelectKey(cur.Get(j)) : 0u;
      chosen = WarpTopK<EPT>(key, LaneBest2<EPT>(key, 0u), p.topk, lane, first);
      ChosenSoftmax<EPT>([&](int j) { return cur.Get(j); }, chosen, first, p.scaling, o);
    } else {
      float s[EPT];
#pragma unroll
      for (int j = 0; j < EPT; ++j) s[j] = cur.Get(j);
      if (p.score == Score::kSoftmax) {
        if (kKind == FwdKind::kAux || p.pre_softmax) SoftmaxSlots<EPT, true>(s, valid);
      } else {
#pragma unroll
        for (int j = 0; j < EPT; ++j) s[j] = valid.Has(j) ? Sigmoid(s[j]) : 0.f;
        if constexpr (kKind == FwdKind::kAux) {
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < EPT; ++j) sum += s[j];
          sum = WarpSum(sum) + kSigmoidEps;
#pragma unroll
          for (int j = 0; j < EPT; ++j) s[j] = s[j] / sum;
        }
      }
      if constexpr (kKind == FwdKind::kAux) {
#pragma unroll
        for (int j = 0; j < EPT; ++j) key[j] = valid.Has(j) ? SelectKey(s[j]) : 0u;
        chosen = WarpTopK<EPT>(key, LaneBest2<EPT>(key, 0u), p.topk, lane, first);
#pragma unroll
        for (int j = 0; j < EPT; ++j) o[j] = s[j];
      } else {
#pragma unroll
        for (int j = 0; j < EPT; ++j) {
          float sel = s[j];  // selection score
          if (p.bias != nullptr && valid.Has(j)) sel += bias.Get(j);
          key[j] = valid.Has(j) ? SelectKey(sel) : 0u;
        }
        Best2 b = LaneBest2<EPT>(key, 0u);
        if constexpr (kKind == FwdKind::kTopkGrouped) {
          MaskGroupsShared<EPT>(p, groups, lane, e0, valid.n, smem + static_cast<int64_t>(warp) * E, key, b);
        } else if (p.num_groups > 0) {
          MaskGroupsFast<EPT>(p, lane, key, b);
        }
        chosen = WarpTopK<EPT>(key, b, p.topk, lane, first);
        if (p.score == Score::kSoftmax && !p.pre_softmax) {  // softmax over the chosen logits
          ChosenSoftmax<EPT>([&](int j) { return s[j]; }, chosen, first, p.scaling, o);
        } else {  // the chosen scores, sigmoid ones normalised to sum 1 (topk > 1)
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < EPT; ++j) {
            o[j] = ((chosen >> j) & 1u) ? s[j] : 0.f;
            sum += o[j];
          }
          float scale = p.scaling;
          if (p.score == Score::kSigmoid && p.topk > 1) scale = p.scaling / (WarpSum(sum) + kSigmoidEps);
          // Only chosen slots are scaled: a NaN scale (a NaN chosen score) must leave the others at 0.
#pragma unroll
          for (int j = 0; j < EPT; ++j) o[j] = ((chosen >> j) & 1u) ? o[j] * scale : 0.f;
        }
      }
    }
    StoreSlice<T, EPT, kVec, /*kStream=*/true>(out + row * E, e0, E, o);
    StoreMap<EPT, kVec>(p.map_out, row, e0, E, chosen, p.compact);

    if (!more) break;
    row = next;
    if constexpr (kPrefetch<T, EPT, kVec>) {
      cur = nxt;
    } else {
      cur.Load(x + row * E, e0, E);
    }
  }
}

// What a backward row needs from memory before any of it can be used: the routing map (top-k),
// the full logits (pre-softmax, aux) and the full d scores (aux).
template <typename T, int EPT, bool kVec, BwdKind kKind>
struct BwdRow {
  MapSlice<EPT, kVec> map;
  Slice<T, EPT, kVec> x, g;

  __device__ __forceinline__ void Load(const RowParams& p, int64_t row, int e0) {
    const int E = p.experts;
    if constexpr (kKind != BwdKind::kAux) map.Load(p.map_in, row, e0, E, p.compact);
    if constexpr (kKind != BwdKind::kSparse) x.Load(static_cast<const T*>(p.logits) + row * E, e0, E);
    if constexpr (kKind == BwdKind::kAux) g.Load(static_cast<const T*>(p.g) + row * E, e0, E);
  }
};

template <typename T, int EPT, bool kVec, BwdKind kKind>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) RowBackwardKernel(RowParams p) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int stride = gridDim.x * kWarpsPerBlock;  // the grid is at most the resident blocks
  int64_t row = blockIdx.x * kWarpsPerBlock + warp;
  if (row >= p.rows) return;  // warp-uniform
  const int E = p.experts;
  const int e0 = lane * EPT;
  const Slots valid = LaneSlots<EPT, kVec>(e0, E);
  const float sf = p.scaling;
  using Row = BwdRow<T, EPT, kVec, kKind>;
  constexpr bool kPre = kPrefetch<T, EPT, kVec> || kKind == BwdKind::kSparse;  // sparse: just the map

  Row cur;
  cur.Load(p, row, e0);
  for (;;) {
    const int64_t next = row + stride;
    const bool more = next < p.rows;
    Row nxt;
    if constexpr (kPre) {
      if (more) nxt.Load(p, next, e0);
    }

    uint32_t chosen = 0u;
    if constexpr (kKind != BwdKind::kAux) chosen = cur.map.Bits(e0, valid.Mask(), p.compact);
    // Sparse reads: only lanes holding a chosen expert fetch their slice (d probs is zero elsewhere
    // in the gradient formula; the logits are needed only where the weights are).
    if constexpr (kKind == BwdKind::kSparse) cur.x.LoadIf(chosen != 0u, static_cast<const T*>(p.logits) + row * E, e0, E);
    if constexpr (kKind != BwdKind::kAux) cur.g.LoadIf(chosen != 0u, static_cast<const T*>(p.g) + row * E, e0, E);
    float v[EPT], g[EPT], dx[EPT];
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
      const bool use = kKind == BwdKind::kAux ? valid.Has(j) : ((chosen >> j) & 1u);
      g[j] = use ? cur.g.Get(j) : 0.f;
      v[j] = cur.x.Get(j);
    }

    if constexpr (kKind == BwdKind::kSparse) {
      if (p.score == Score::kSoftmax) {
        // w = softmax over the chosen logits; dx = w * (sf g - sum_j w_j sf g_j) at chosen experts.
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < EPT; ++j) {
          if ((chosen >> j) & 1u) mx = fmaxf(mx, v[j]);
        }
        mx = WarpMaxF(mx);
        float sum = 0.f, dot = 0.f;
#pragma unroll
        for (int j = 0; j < EPT; ++j) {
          const float ex = ExpNonPos(v[j] - mx);
          v[j] = ((chosen >> j) & 1u) ? ex : 0.f;
          sum += v[j];
          dot += v[j] * g[j];
        }
        WarpSum2(sum, dot);
        const float inv = SoftmaxScale(1.f, sum);
        dot *= inv;  // sum_j w_j g_j
#pragma unroll
        for (int j = 0; j < EPT; ++j) dx[j] = ((chosen >> j) & 1u) ? (v[j] * inv) * (sf * (g[j] - dot)) : 0.f;
      } else {
        // w = sig / (sum of chosen sig + eps) (topk > 1) or sig; dx through w and the sigmoid.
        float sum = 0.f, dot = 0.f;
#pragma unroll
        for (int j = 0; j < EPT; ++j) {
          v[j] = ((chosen >> j) & 1u) ? Sigmoid(v[j]) : 0.f;
          g[j] *= sf;
          sum += v[j];
          dot += g[j] * v[j];
        }
        float inv = 1.f;
        if (p.topk > 1) {
          WarpSum2(sum, dot);
          inv = 1.f / (sum + kSigmoidEps);
        }
#pragma unroll
        for (int j = 0; j < EPT; ++j) {
          const float gsig = p.topk > 1 ? (g[j] - dot * inv) * inv : g[j];
          dx[j] = ((chosen >> j) & 1u) ? gsig * v[j] * (1.f - v[j]) : 0.f;
        }
      }
    } else if (kKind == BwdKind::kPreSoftmax || p.score == Score::kSoftmax) {
      // s = softmax(x); ds = sf g at chosen experts (pre-softmax) or g (aux); dx = s (ds - <s, ds>).
      SoftmaxSlots<EPT, false>(v, valid);
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < EPT; ++j) {
        if constexpr (kKind == BwdKind::kPreSoftmax) g[j] *= sf;
        dot += v[j] * g[j];
      }
      dot = WarpSum(dot);
#pragma unroll
      for (int j = 0; j < EPT; ++j) dx[j] = v[j] * (g[j] - dot);
    } else {
      // aux sigmoid: s = sig / (sum sig + eps) over the row.
      float sum = 0.f, dot = 0.f;
#pragma unroll
      for (int j = 0; j < EPT; ++j) {
        v[j] = valid.Has(j) ? Sigmoid(v[j]) : 0.f;
        sum += v[j];
        dot += g[j] * v[j];
      }
      WarpSum2(sum, dot);
      const float inv = 1.f / (sum + kSigmoidEps);
      dot *= inv;
#pragma unroll
      for (int j = 0; j < EPT; ++j) {
        const float dsig = (g[j] - dot) * inv;  // g / d - <g, sig> / d^2
        dx[j] = dsig * v[j] * (1.f - v[j]);
      }
    }
    StoreSlice<T, EPT, kVec, /*kStream=*/true>(static_cast<T*>(p.out) + row * E, e0, E, dx);

    if (!more) break;
    row = next;
    if constexpr (kPre) {
      cur = nxt;
    } else {
      cur.Load(p, row, e0);
    }
  }
}

}  // namespace te::router
