// MoE router kernels: one warp per token row, the row in registers, a single pass.
//
// Top-k: the selection score of every expert becomes an order-preserving uint32 key (larger key ==
// larger float). Each round, the warp finds the largest key with one redux.sync (sm_80+), then the
// smallest expert index holding it with a second one: ties go to the larger value, then to the
// smaller expert index, exactly like jax.lax.top_k. The winning lane clears its slot and rescans
// its EPT slots. Chosen experts are kept as a per-lane bit mask, so k is a runtime value.
//
// Grouped selection (DeepSeek-V3): the row's selection scores go to shared memory, lane g sums the
// top (topk / group_topk) scores of contiguous group g (G <= 32), the best group_topk groups are
// picked with the same two-redux argmax, and the experts of the other groups get key 0 (never
// chosen: valid experts have keys >= 1).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/convert.cuh"
#include "router/router.h"

namespace te::router {

constexpr unsigned kFull = 0xffffffffu;
constexpr float kSigmoidEps = 1e-20f;

using te::FromF;
using te::ToF;

// Order-preserving float -> uint32 map (a < b  <=>  Key(a) < Key(b) for non-NaN floats).
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Valid experts get keys >= 1; 0 marks "not selectable" (taken, outside the row, masked group).
__device__ __forceinline__ uint32_t SelectKey(float f) {
  const uint32_t k = OrderedKey(f);
  return k == 0u ? 1u : k;
}

__device__ __forceinline__ uint32_t WarpMaxU(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(kFull, v);
#else
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFull, v, o));
  return v;
#endif
}

__device__ __forceinline__ uint32_t WarpMinU(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_min_sync(kFull, v);
#else
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(kFull, v, o));
  return v;
#endif
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// softmax over the valid slots (invalid slots hold -inf and end up 0).
template <int EPT>
__device__ __forceinline__ void SoftmaxInPlace(float (&v)[EPT]) {
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < EPT; ++i) mx = fmaxf(mx, v[i]);
  mx = WarpMax(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    v[i] = expf(v[i] - mx);
    sum += v[i];
  }
  sum = WarpSum(sum);
#pragma unroll
  for (int i = 0; i < EPT; ++i) v[i] = v[i] / sum;
}

template <typename T, int EPT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) RowForwardKernel(RowParams p) {
  extern __shared__ float smem[];  // grouped selection only: kWarpsPerBlock * experts floats
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= p.rows) return;  // warp-uniform: the whole warp leaves together
  const int E = p.experts;
  const T* x = static_cast<const T*>(p.logits) + row * E;

  // 1. Scores (softmax without pre-softmax: the logits themselves).
  float s[EPT];
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int e = i * 32 + lane;
    s[i] = e < E ? ToF<T>(x[e]) : -INFINITY;
  }
  if (p.score == Score::kSoftmax) {
    if (p.pre_softmax || p.aux) SoftmaxInPlace<EPT>(s);
  } else {
#pragma unroll
    for (int i = 0; i < EPT; ++i) s[i] = Sigmoid(s[i]);  // invalid slots: sigmoid(-inf) = 0
    if (p.aux) {
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < EPT; ++i) sum += s[i];
      sum = WarpSum(sum) + kSigmoidEps;
#pragma unroll
      for (int i = 0; i < EPT; ++i) s[i] = s[i] / sum;
    }
  }

  // 2. Selection keys (scores + expert bias).
  const bool grouped = p.num_groups > 0;
  float* buf = smem + static_cast<int64_t>(warp) * E;
  uint32_t key[EPT];
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int e = i * 32 + lane;
    key[i] = 0u;
    if (e < E) {
      const float sel = p.bias != nullptr ? s[i] + p.bias[e] : s[i];
      key[i] = SelectKey(sel);
      if (grouped) buf[e] = sel;
    }
  }

  // 3. Grouped selection: only the best group_topk groups stay selectable.
  if (grouped) {
    __syncwarp();
    const int G = p.num_groups;
    const int gsize = E / G;
    const int m = p.topk / p.group_topk;
    uint32_t gkey = 0u;
    if (lane < G) {
      float top[kMaxPerGroupTopk];
#pragma unroll
      for (int q = 0; q < kMaxPerGroupTopk; ++q) top[q] = -INFINITY;
      const float* grp = buf + lane * gsize;
      // Lane g starts its scan at element g of its group: with 32-float groups the lanes then hit
      // 32 different banks instead of one. The top-m multiset (and its sum) is order-independent.
      int jj = lane % gsize;
      for (int j = 0; j < gsize; ++j) {
        float v = grp[jj];
        if (++jj == gsize) jj = 0;
#pragma unroll
        for (int q = 0; q < kMaxPerGroupTopk; ++q) {
          if (q >= m) break;
          if (v > top[q]) {
            const float t = top[q];
            top[q] = v;
            v = t;
          }
        }
      }
      float gsum = 0.f;  // summed largest first, as the reference sums lax.top_k's output
#pragma unroll
      for (int q = 0; q < kMaxPerGroupTopk; ++q) {
        if (q < m) gsum += top[q];
      }
      gkey = SelectKey(gsum);
    }
    uint32_t gmask = 0u;
    for (int r = 0; r < p.group_topk; ++r) {
      const uint32_t best = WarpMaxU(gkey);
      const uint32_t cand = (gkey != 0u && gkey == best) ? static_cast<uint32_t>(lane) : 0xffffffffu;
      const uint32_t win = WarpMinU(cand) & 31u;
      gmask |= 1u << win;
      if (lane == static_cast<int>(win)) gkey = 0u;
    }
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      const int e = i * 32 + lane;
      if (e < E && !((gmask >> (e / gsize)) & 1u)) key[i] = 0u;
    }
  }

  // 4. Top-k by repeated warp argmax.
  uint32_t ck = 0u;
  int ci = 0;
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    if (key[i] > ck) {
      ck = key[i];
      ci = i;
    }
  }
  uint32_t chosen = 0u;
  for (int r = 0; r < p.topk; ++r) {
    const uint32_t best = WarpMaxU(ck);
    const uint32_t cand = ck == best ? static_cast<uint32_t>(ci * 32 + lane) : 0xffffffffu;
    const uint32_t win = WarpMinU(cand);
    if (static_cast<int>(win & 31u) == lane) {
      const int wi = static_cast<int>(win >> 5);
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        if (i == wi) {
          key[i] = 0u;
          chosen |= 1u << i;
        }
      }
      ck = 0u;
      ci = 0;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        if (key[i] > ck) {
          ck = key[i];
          ci = i;
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    if (i * 32 + lane >= E) chosen &= ~(1u << i);
  }

  // 5-6. Outputs: dense probs (top-k) or scores (aux), then the routing map.
  T* out = static_cast<T*>(p.out) + row * E;
  if (p.aux) {
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      const int e = i * 32 + lane;
      if (e < E) out[e] = FromF<T>(s[i]);
    }
  } else {
    float w[EPT];
    if (p.score == Score::kSoftmax && !p.pre_softmax) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        if ((chosen >> i) & 1u) mx = fmaxf(mx, s[i]);
      }
      mx = WarpMax(mx);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        w[i] = ((chosen >> i) & 1u) ? expf(s[i] - mx) : 0.f;
        sum += w[i];
      }
      sum = WarpSum(sum);
#pragma unroll
      for (int i = 0; i < EPT; ++i) w[i] = w[i] / sum;
    } else {
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        w[i] = ((chosen >> i) & 1u) ? s[i] : 0.f;
        sum += w[i];
      }
      if (p.score == Score::kSigmoid && p.topk > 1) {
        sum = WarpSum(sum) + kSigmoidEps;
#pragma unroll
        for (int i = 0; i < EPT; ++i) w[i] = w[i] / sum;
      }
    }
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      const int e = i * 32 + lane;
      if (e < E) out[e] = FromF<T>(p.scaling * w[i]);
    }
  }

  if (p.compact) {
    const int nb = (E + 7) >> 3;
    uint8_t* mrow = p.map_out + row * nb;
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      const uint32_t bits = __ballot_sync(kFull, (chosen >> i) & 1u);
      const int byte = i * 4 + lane;
      if (lane < 4 && byte < nb) mrow[byte] = static_cast<uint8_t>((bits >> (8 * lane)) & 0xffu);
    }
  } else {
    uint8_t* mrow = p.map_out + row * E;
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      const int e = i * 32 + lane;
      if (e < E) mrow[e] = static_cast<uint8_t>((chosen >> i) & 1u);
    }
  }
}

template <typename T, int EPT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) RowBackwardKernel(RowParams p) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= p.rows) return;  // warp-uniform
  const int E = p.experts;
  const T* x = static_cast<const T*>(p.logits) + row * E;
  const T* gp = static_cast<const T*>(p.g) + row * E;

  float v[EPT], g[EPT];
  uint32_t chosen = 0u;
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int e = i * 32 + lane;
    v[i] = -INFINITY;
    g[i] = 0.f;
    if (e < E) {
      v[i] = ToF<T>(x[e]);
      g[i] = ToF<T>(gp[e]);
    }
  }
  if (!p.aux) {
    if (p.compact) {
      const int nb = (E + 7) >> 3;
      const uint8_t* mrow = p.map_in + row * nb;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const int e = i * 32 + lane;
        if (e < E && ((mrow[e >> 3] >> (e & 7)) & 1u)) chosen |= 1u << i;
      }
    } else {
      const uint8_t* mrow = p.map_in + row * E;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const int e = i * 32 + lane;
        if (e < E && mrow[e] != 0) chosen |= 1u << i;
      }
    }
  }

  float dx[EPT];
  if (p.aux) {
    if (p.score == Score::kSoftmax) {
      SoftmaxInPlace<EPT>(v);  // v := s
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < EPT; ++i) dot += v[i] * g[i];
      dot = WarpSum(dot);
#pragma unroll
      for (int i = 0; i < EPT; ++i) dx[i] = v[i] * (g[i] - dot);
    } else {
      float sum = 0.f, dot = 0.f;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        v[i] = Sigmoid(v[i]);  // invalid slots: 0
        sum += v[i];
        dot += g[i] * v[i];
      }
      const float d = WarpSum(sum) + kSigmoidEps;
      dot = WarpSum(dot);
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const float dsig = g[i] / d - dot / (d * d);
        dx[i] = dsig * v[i] * (1.f - v[i]);
      }
    }
  } else {
    const float sf = p.scaling;
    if (p.score == Score::kSoftmax && !p.pre_softmax) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        if ((chosen >> i) & 1u) mx = fmaxf(mx, v[i]);
      }
      mx = WarpMax(mx);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        v[i] = ((chosen >> i) & 1u) ? expf(v[i] - mx) : 0.f;
        sum += v[i];
      }
      sum = WarpSum(sum);
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        v[i] = v[i] / sum;  // w
        dot += v[i] * sf * g[i];
      }
      dot = WarpSum(dot);
#pragma unroll
      for (int i = 0; i < EPT; ++i) dx[i] = ((chosen >> i) & 1u) ? v[i] * (sf * g[i] - dot) : 0.f;
    } else if (p.score == Score::kSoftmax) {
      SoftmaxInPlace<EPT>(v);  // v := s
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        g[i] = ((chosen >> i) & 1u) ? sf * g[i] : 0.f;  // ds
        dot += v[i] * g[i];
      }
      dot = WarpSum(dot);
#pragma unroll
      for (int i = 0; i < EPT; ++i) dx[i] = v[i] * (g[i] - dot);
    } else {
      float sum = 0.f, dot = 0.f;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        v[i] = Sigmoid(v[i]);
        g[i] = sf * g[i];
        if ((chosen >> i) & 1u) {
          sum += v[i];
          dot += g[i] * v[i];
        }
      }
      float d = 1.f;
      if (p.topk > 1) {
        d = WarpSum(sum) + kSigmoidEps;
        dot = WarpSum(dot);
      }
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const float gsig = p.topk > 1 ? g[i] / d - dot / (d * d) : g[i];
        dx[i] = ((chosen >> i) & 1u) ? gsig * v[i] * (1.f - v[i]) : 0.f;
      }
    }
  }

  T* out = static_cast<T*>(p.out) + row * E;
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int e = i * 32 + lane;
    if (e < E) out[e] = FromF<T>(dx[i]);
  }
}

template <typename T, int EPT>
cudaError_t LaunchRowEpt(const RowParams& p, cudaStream_t s, bool backward) {
  const int64_t blocks = (p.rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const dim3 grid(static_cast<unsigned>(blocks)), block(kWarpsPerBlock * 32);
  if (backward) {
    RowBackwardKernel<T, EPT><<<grid, block, 0, s>>>(p);
  } else {
    const size_t smem = p.num_groups > 0 ? sizeof(float) * kWarpsPerBlock * p.experts : 0;
    RowForwardKernel<T, EPT><<<grid, block, smem, s>>>(p);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchRowTyped(const RowParams& p, cudaStream_t s, bool backward) {
  if (p.rows == 0) return cudaSuccess;
  if (p.experts < 1 || p.experts > kMaxExperts) return cudaErrorInvalidValue;
  if ((p.rows + kWarpsPerBlock - 1) / kWarpsPerBlock > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  switch (ElementsPerLane(p.experts)) {
    case 1: return LaunchRowEpt<T, 1>(p, s, backward);
    case 2: return LaunchRowEpt<T, 2>(p, s, backward);
    case 4: return LaunchRowEpt<T, 4>(p, s, backward);
    case 8: return LaunchRowEpt<T, 8>(p, s, backward);
    case 16: return LaunchRowEpt<T, 16>(p, s, backward);
    case 32: return LaunchRowEpt<T, 32>(p, s, backward);
    default: return cudaErrorInvalidValue;
  }
}

// Defined once per dtype file (router_<dtype>.cu) so the three compile in parallel.
cudaError_t LaunchRowF32(const RowParams& p, cudaStream_t s, bool backward);
cudaError_t LaunchRowBF16(const RowParams& p, cudaStream_t s, bool backward);
cudaError_t LaunchRowF16(const RowParams& p, cudaStream_t s, bool backward);

}  // namespace te::router
