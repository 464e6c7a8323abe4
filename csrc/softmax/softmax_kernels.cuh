// Softmax forward/backward kernels. One row is owned by a group of `tpr` threads (a power of two,
// 4..1024); each thread holds NV vectors of VEC elements of the row in registers, so the row is read
// once and written once. Rows longer than the register capacity go to the long-row kernels below
// (block per row, one extra pass over global memory).
//
// Masked positions (explicit mask or causal j > i) give probability exactly 0; a row that is
// masked everywhere gives zeros (forward) and a zero gradient (backward). Whole vectors that are
// masked are not read at all, which halves the input traffic of a causal softmax.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cmath>

#include "common/convert.cuh"
#include "softmax/softmax.h"

namespace te::softmax {

constexpr float kLog2e = 1.4426950408889634f;

// Threads per block allowed for NV vectors per thread. __launch_bounds__ caps registers at
// 64K / threads: at 1024 threads (64 registers) the NV=4/8 kernels spilled (ptxas -v), so larger
// NV gets a smaller block and more registers.
__host__ __device__ constexpr int MaxThreadsForNv(int nv) { return nv <= 2 ? 1024 : (nv == 4 ? 512 : 256); }

using te::FromF;
using te::ToF;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Reduction over the `tpr` threads of a row group. Groups of <= 32 threads live inside one warp;
// larger groups combine per-warp partials through shared memory (`smem` holds one float per warp).
template <bool kMax>
__device__ __forceinline__ float Combine(float a, float b) {
  return kMax ? fmaxf(a, b) : a + b;
}

template <bool kMax>
__device__ __forceinline__ float GroupReduce(float v, int tpr, float* smem) {
  const int width = tpr < 32 ? tpr : 32;
  for (int offset = width / 2; offset > 0; offset /= 2) {
    v = Combine<kMax>(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  if (tpr <= 32) return v;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warps_per_group = tpr / 32;
  const int first = (warp / warps_per_group) * warps_per_group;
  // Each kernel reduces through `smem` once, so no barrier is needed before the write.
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float r = smem[first];
  for (int w = 1; w < warps_per_group; ++w) r = Combine<kMax>(r, smem[first + w]);
  return r;
}


// Streaming (evict-first) accesses for x, y, dy and the outputs: each byte is touched once, and
// keeping it out of L2 leaves room for the mask, which every head re-reads.
template <typename V>
__device__ __forceinline__ V LoadStream(const V* ptr) {
  V v;
  if constexpr (sizeof(V) == 16) {
    uint4 r = __ldcs(reinterpret_cast<const uint4*>(ptr));
    memcpy(&v, &r, 16);
  } else if constexpr (sizeof(V) == 8) {
    uint2 r = __ldcs(reinterpret_cast<const uint2*>(ptr));
    memcpy(&v, &r, 8);
  } else if constexpr (sizeof(V) == 4) {
    unsigned int r = __ldcs(reinterpret_cast<const unsigned int*>(ptr));
    memcpy(&v, &r, 4);
  } else if constexpr (sizeof(V) == 2) {
    unsigned short r = __ldcs(reinterpret_cast<const unsigned short*>(ptr));
    memcpy(&v, &r, 2);
  } else {
    v = *ptr;
  }
  return v;
}

template <typename V>
__device__ __forceinline__ void StoreStream(V* ptr, const V& v) {
  if constexpr (sizeof(V) == 16) {
    uint4 r;
    memcpy(&r, &v, 16);
    __stcs(reinterpret_cast<uint4*>(ptr), r);
  } else if constexpr (sizeof(V) == 8) {
    uint2 r;
    memcpy(&r, &v, 8);
    __stcs(reinterpret_cast<uint2*>(ptr), r);
  } else if constexpr (sizeof(V) == 4) {
    unsigned int r;
    memcpy(&r, &v, 4);
    __stcs(reinterpret_cast<unsigned int*>(ptr), r);
  } else if constexpr (sizeof(V) == 2) {
    unsigned short r;
    memcpy(&r, &v, 2);
    __stcs(reinterpret_cast<unsigned short*>(ptr), r);
  } else {
    *ptr = v;
  }
}

// Online-softmax pair (max m, sum s of exp2(v - m)); -inf max means "nothing seen".
__device__ __forceinline__ void CombinePair(float& m, float& s, float om, float os) {
  const float nm = fmaxf(m, om);
  const float a = m == -INFINITY ? 0.f : s * exp2f(m - nm);
  const float b = om == -INFINITY ? 0.f : os * exp2f(om - nm);
  m = nm;
  s = a + b;
}

// One reduction of (m, s) pairs over the row group (one barrier at most).
__device__ __forceinline__ void GroupReducePair(float& m, float& s, int tpr, float2* smem) {
  const int width = tpr < 32 ? tpr : 32;
  for (int offset = width / 2; offset > 0; offset /= 2) {
    const float om = __shfl_xor_sync(0xffffffffu, m, offset);
    const float os = __shfl_xor_sync(0xffffffffu, s, offset);
    CombinePair(m, s, om, os);
  }
  if (tpr <= 32) return;
  const int warp = threadIdx.x / 32;
  const int warps_per_group = tpr / 32;
  const int first = (warp / warps_per_group) * warps_per_group;
  if (threadIdx.x % 32 == 0) smem[warp] = make_float2(m, s);
  __syncthreads();
  float2 r = smem[first];
  for (int w = 1; w < warps_per_group; ++w) CombinePair(r.x, r.y, smem[first + w].x, smem[first + w].y);
  m = r.x;
  s = r.y;
}

struct RowInfo {
  int64_t row;
  bool valid;
  int64_t q;           // query position (causal / mask row)
  int64_t mask_offset; // element offset of the mask row
};

__device__ __forceinline__ RowInfo MakeRow(const Params& p, int64_t row, MaskMode mode) {
  RowInfo r;
  r.row = row;
  r.valid = row < p.rows;
  r.q = 0;
  r.mask_offset = 0;
  if (mode != MaskMode::kNone) {
    const int64_t q = row % p.sq;
    const int64_t bn = row / p.sq;
    r.q = q;
    if (mode == MaskMode::kMask) {
      const int64_t n = bn % p.heads;
      const int64_t b = bn / p.heads;
      r.mask_offset = b * p.mask_stride_b + n * p.mask_stride_n + q * p.mask_stride_q;
    }
  }
  return r;
}

template <typename T, int VEC, int NV, MaskMode MODE>
__global__ void __launch_bounds__(MaxThreadsForNv(NV)) SoftmaxForwardKernel(Params p, int tpr) {
  __shared__ float2 smem[32];
  const int rows_per_block = blockDim.x / tpr;
  const int lane = threadIdx.x % tpr;
  const RowInfo r = MakeRow(p, static_cast<int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / tpr, MODE);
  const T* x = static_cast<const T*>(p.x) + r.row * p.cols;
  const uint8_t* mrow = p.mask + r.mask_offset;
  const float scale = p.scale * kLog2e;  // work in base 2: exp(s*x - m) == exp2(s*log2e*x - m')

  // Phase 1: which vectors hold any unmasked element (mask bytes for all NV vectors are loaded
  // before any x, so the two round trips do not serialise per vector).
  bool live[NV];
  Vec<uint8_t, VEC> mv[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t col = (static_cast<int64_t>(lane) + static_cast<int64_t>(i) * tpr) * VEC;
    live[i] = r.valid && col < p.cols;
    if (MODE == MaskMode::kCausal) live[i] = live[i] && col <= r.q;
    if (MODE == MaskMode::kMask && live[i]) mv[i] = *reinterpret_cast<const Vec<uint8_t, VEC>*>(mrow + col);
  }
  if (MODE == MaskMode::kMask) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (!live[i]) continue;
      bool all = true;
#pragma unroll
      for (int e = 0; e < VEC; ++e) all = all && (mv[i].v[e] != 0);
      live[i] = !all;
    }
  }
  // Phase 2: load the live vectors (all loads issued before any use).
  Vec<T, VEC> xv[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t col = (static_cast<int64_t>(lane) + static_cast<int64_t>(i) * tpr) * VEC;
    if (live[i]) xv[i] = LoadStream(reinterpret_cast<const Vec<T, VEC>*>(x + col));
  }
  // Phase 3: scaled, masked logits and this thread's (max, sum) pair.
  float v[NV][VEC];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t col = (static_cast<int64_t>(lane) + static_cast<int64_t>(i) * tpr) * VEC;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      bool masked = !live[i];
      if (MODE == MaskMode::kCausal) masked = masked || (col + e > r.q);
      if (MODE == MaskMode::kMask) masked = masked || (mv[i].v[e] != 0);
      v[i][e] = masked ? -INFINITY : ToF<T>(xv[i].v[e]) * scale;
      m = fmaxf(m, v[i][e]);
    }
  }
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float t = (!live[i] || m == -INFINITY) ? 0.f : exp2f(v[i][e] - m);  // exp2(-inf) = 0
      v[i][e] = t;
      sum += t;
    }
  }
  // Phase 4: one pair reduction over the row group gives the row's (max, sum).
  float row_m = m, row_s = sum;
  GroupReducePair(row_m, row_s, tpr, smem);
  if (!r.valid) return;
  const float factor = (m == -INFINITY || !(row_s > 0.f)) ? 0.f : exp2f(m - row_m) / row_s;
  T* out = static_cast<T*>(p.out) + r.row * p.cols;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t col = (static_cast<int64_t>(lane) + static_cast<int64_t>(i) * tpr) * VEC;
    if (col >= p.cols) continue;
    Vec<T, VEC> o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = FromF<T>(v[i][e] * factor);
    StoreStream(reinterpret_cast<Vec<T, VEC>*>(out + col), o);
  }
}

template <typename T, int VEC, int NV, MaskMode MODE>
__global__ void __launch_bounds__(MaxThreadsForNv(NV)) SoftmaxBackwardKernel(Params p, int tpr) {
  __shared__ float smem[32];
  const int rows_per_block = blockDim.x / tpr;
  const int lane = threadIdx.x % tpr;
  const RowInfo r = MakeRow(p, static_cast<int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / tpr, MODE);
  const T* y = static_cast<const T*>(p.y) + r.row * p.cols;
  const T* dy = static_cast<const T*>(p.dy) + r.row * p.cols;
  const uint8_t* mrow = p.mask + r.mask_offset;

  // Masked positions have y == 0 exactly, so their gradient is 0: vectors that are masked
  // everywhere are not read.
  bool live[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t col = (static_cast<int64_t>(lane) + static_cast<int64_t>(i) * tpr) * VEC;
    live[i] = r.valid && col < p.cols;
    if (MODE == MaskMode::kCausal) live[i] = live[i] && col <= r.q;
  }
  if (MODE == MaskMode::kMask) {
    Vec<uint8_t, VEC> mv[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t col = (static_cast<int64_t>(lane) + static_cast<int64_t>(i) * tpr) * VEC;
      if (live[i]) mv[i] = *reinterpret_cast<const Vec<uint8_t, VEC>*>(mrow + col);
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (!live[i]) continue;
      bool all = true;
#pragma unroll
      for (int e = 0; e < VEC; ++e) all = all && (mv[i].v[e] != 0);
      live[i] = !all;
    }
  }
  Vec<T, VEC> yv[NV];
  Vec<T, VEC> dyv[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t col = (static_cast<int64_t>(lane) + static_cast<int64_t>(i) * tpr) * VEC;
    if (live[i]) {
      yv[i] = LoadStream(reinterpret_cast<const Vec<T, VEC>*>(y + col));
      dyv[i] = LoadStream(reinterpret_cast<const Vec<T, VEC>*>(dy + col));
    }
  }
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (!live[i]) continue;
#pragma unroll
    for (int e = 0; e < VEC; ++e) dot += ToF<T>(yv[i].v[e]) * ToF<T>(dyv[i].v[e]);
  }
  dot = GroupReduce<false>(dot, tpr, smem);
  if (!r.valid) return;
  T* dx = static_cast<T*>(p.out) + r.row * p.cols;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t col = (static_cast<int64_t>(lane) + static_cast<int64_t>(i) * tpr) * VEC;
    if (col >= p.cols) continue;
    Vec<T, VEC> o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      o.v[e] = live[i] ? FromF<T>(p.scale * ToF<T>(yv[i].v[e]) * (ToF<T>(dyv[i].v[e]) - dot)) : FromF<T>(0.f);
    }
    StoreStream(reinterpret_cast<Vec<T, VEC>*>(dx + col), o);
  }
}

// ---- Long rows: one block per row, scalar accesses, online max/sum. ----

__device__ __forceinline__ bool IsMasked(const Params& p, const RowInfo& r, int64_t col, MaskMode mode) {
  if (mode == MaskMode::kCausal) return col > r.q;
  if (mode == MaskMode::kMask) return p.mask[r.mask_offset + col] != 0;
  return false;
}

template <typename T, MaskMode MODE>
__global__ void __launch_bounds__(1024) SoftmaxForwardLongKernel(Params p) {
  __shared__ float smem_m[32];
  __shared__ float smem_s[32];
  const RowInfo r = MakeRow(p, blockIdx.x, MODE);
  const T* x = static_cast<const T*>(p.x) + r.row * p.cols;
  T* out = static_cast<T*>(p.out) + r.row * p.cols;
  const float scale = p.scale * kLog2e;
  float m = -INFINITY, s = 0.f;
  for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
    if (IsMasked(p, r, c, MODE)) continue;
    const float t = ToF<T>(x[c]) * scale;
    if (t > m) {
      s = (m == -INFINITY ? 0.f : s * exp2f(m - t)) + 1.f;
      m = t;
    } else if (t != -INFINITY) {
      s += exp2f(t - m);
    }
  }
  // Combine (m, s) pairs: first within the warp, then across warps.
  for (int offset = 16; offset > 0; offset /= 2) {
    const float om = __shfl_xor_sync(0xffffffffu, m, offset);
    const float os = __shfl_xor_sync(0xffffffffu, s, offset);
    const float nm = fmaxf(m, om);
    s = (m == -INFINITY ? 0.f : s * exp2f(m - nm)) + (om == -INFINITY ? 0.f : os * exp2f(om - nm));
    m = nm;
  }
  const int warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  if (threadIdx.x % 32 == 0) {
    smem_m[warp] = m;
    smem_s[warp] = s;
  }
  __syncthreads();
  m = -INFINITY;
  s = 0.f;
  for (int w = 0; w < nwarps; ++w) {
    const float om = smem_m[w], os = smem_s[w];
    const float nm = fmaxf(m, om);
    s = (m == -INFINITY ? 0.f : s * exp2f(m - nm)) + (om == -INFINITY ? 0.f : os * exp2f(om - nm));
    m = nm;
  }
  const float inv = s > 0.f ? 1.f / s : 0.f;
  for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
    float o = 0.f;
    if (m != -INFINITY && !IsMasked(p, r, c, MODE)) o = exp2f(ToF<T>(x[c]) * scale - m) * inv;
    out[c] = FromF<T>(o);
  }
}

template <typename T, MaskMode MODE>
__global__ void __launch_bounds__(1024) SoftmaxBackwardLongKernel(Params p) {
  __shared__ float smem[32];
  const RowInfo r = MakeRow(p, blockIdx.x, MODE);
  const T* y = static_cast<const T*>(p.y) + r.row * p.cols;
  const T* dy = static_cast<const T*>(p.dy) + r.row * p.cols;
  T* dx = static_cast<T*>(p.out) + r.row * p.cols;
  float dot = 0.f;
  for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
    if (IsMasked(p, r, c, MODE)) continue;
    dot += ToF<T>(y[c]) * ToF<T>(dy[c]);
  }
  dot = GroupReduce<false>(dot, blockDim.x, smem);
  for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
    float o = 0.f;
    if (!IsMasked(p, r, c, MODE)) {
      const float yy = ToF<T>(y[c]);
      o = p.scale * yy * (ToF<T>(dy[c]) - dot);
    }
    dx[c] = FromF<T>(o);
  }
}

}  // namespace te::softmax
