// Softmax forward/backward kernels. The register kernels: one row is owned by a group of `tpr`
// threads (a power of two, 4..1024); each thread holds NV vectors of VEC elements of the row in
// registers, so the row is read once and written once. Rows longer than the register capacity go to
// the long-row kernels below (block per row, one extra pass over global memory).
//
// Semantics (te_ops/softmax/reference.py), per row, with z = scale * x in fp32:
// * masked positions (explicit mask or causal j > i) give probability exactly 0, whatever x holds;
// * a NaN or +inf z on an unmasked position makes every unmasked position NaN (masked ones stay 0);
// * a -inf z is probability 0; a row with no finite unmasked z gives zeros;
// * backward: positions with y == 0 give dx = 0 and take no part in sum(y * dy), whatever dy holds.
// Whole vectors that are masked are not read at all, which halves the input traffic of a causal
// softmax. The kernels work in base 2 (z * log2(e)), so a |z| above FLT_MAX / log2(e) ~ 2.4e38
// already counts as infinite.
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

// Online-softmax pair (max m, sum s of exp2(v - m)). m ignores NaN (fmaxf); s is 0 when nothing
// finite was seen, and NaN once a NaN or +inf value was seen (exp2(NaN), exp2(inf - inf)). The
// s == 0 test (not m == -inf) keeps a NaN s whose m is -inf (a NaN among -infs).
__device__ __forceinline__ void CombinePair(float& m, float& s, float om, float os) {
  const float nm = fmaxf(m, om);
  const float a = s == 0.f ? 0.f : s * exp2f(m - nm);
  const float b = os == 0.f ? 0.f : os * exp2f(om - nm);
  m = nm;
  s = a + b;
}

constexpr uint32_t kQuietNaN = 0x7FC00000u;

// Output of a NaN row (a NaN or +inf logit on an unmasked position) at column `col`: NaN where
// unmasked, exactly 0 where masked. `mrow` is the row's mask (kMask), `q` its query position
// (kCausal). Only such rows get here, so the mask byte is read again from memory (through an
// opaque pointer, so the compiler keeps no mask registers alive for it).
template <MaskMode MODE>
__device__ __forceinline__ float NanRowValue(const uint8_t* mrow, int64_t q, int64_t col) {
  bool masked = false;
  if constexpr (MODE == MaskMode::kCausal) masked = col > q;
  if constexpr (MODE == MaskMode::kMask) {
    asm("" : "+l"(mrow));
    masked = mrow[col] != 0;
  }
  return masked ? 0.f : __uint_as_float(kQuietNaN);
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

// Writes a NaN row of the register kernels: this thread's vectors (columns lane * VEC, stepping by
// tpr * VEC), NaN on unmasked elements, exactly 0 on masked ones. Not inlined: it stays out of the
// fast path's code and registers.
template <typename T, int VEC, MaskMode MODE>
__device__ __noinline__ void WriteNanRow(T* out, const uint8_t* mrow, int64_t q, int lane, int tpr, int64_t cols) {
  for (int64_t col = static_cast<int64_t>(lane) * VEC; col < cols; col += static_cast<int64_t>(tpr) * VEC) {
    Vec<T, VEC> o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = FromF<T>(NanRowValue<MODE>(mrow, q, col + e));
    StoreStream(reinterpret_cast<Vec<T, VEC>*>(out + col), o);
  }
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
  // -inf (masked or not) gives exp2(-inf) = 0. A thread with no finite logit shifts by 0, so a NaN
  // among its -infs stays NaN; with m = +inf the +inf element gives exp2(inf - inf) = NaN. The sum
  // carries the NaN to the row.
  const float shift = m == -INFINITY ? 0.f : m;
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float t = live[i] ? exp2f(v[i][e] - shift) : 0.f;
      v[i][e] = t;
      sum += t;
    }
  }
  // Phase 4: one pair reduction over the row group gives the row's (max, sum).
  float row_m = m, row_s = sum;
  GroupReducePair(row_m, row_s, tpr, smem);
  if (!r.valid) return;
  T* out = static_cast<T*>(p.out) + r.row * p.cols;
  if (isnan(row_s)) {  // a NaN or +inf logit on an unmasked position
    WriteNanRow<T, VEC, MODE>(out, mrow, r.q, lane, tpr, p.cols);
    return;
  }
  // row_s == 0: no finite unmasked logit, zeros.
  const float factor = (m == -INFINITY || !(row_s > 0.f)) ? 0.f : exp2f(m - row_m) / row_s;
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

  // Positions with y == 0 (masked ones among them) get dx = 0 and take no part in the dot product,
  // whatever dy holds there: vectors that are masked everywhere are not read.
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
    for (int e = 0; e < VEC; ++e) {
      const float yy = ToF<T>(yv[i].v[e]);
      dot += yy != 0.f ? yy * ToF<T>(dyv[i].v[e]) : 0.f;  // NaN y counts (a NaN row stays NaN)
    }
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
      const float yy = live[i] ? ToF<T>(yv[i].v[e]) : 0.f;
      o.v[e] = FromF<T>(yy != 0.f ? p.scale * yy * (ToF<T>(dyv[i].v[e]) - dot) : 0.f);
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
    if (t > m) {  // (NaN never is: it goes to the sum below and makes it NaN)
      s = (s == 0.f ? 0.f : s * exp2f(m - t)) + 1.f;  // s == 0, not m == -inf: keeps a NaN s
      m = t;
    } else if (t != -INFINITY) {
      s += exp2f(t - m);
    }
  }
  // Combine (m, s) pairs: first within the warp, then across warps.
  for (int offset = 16; offset > 0; offset /= 2) {
    const float om = __shfl_xor_sync(0xffffffffu, m, offset);
    const float os = __shfl_xor_sync(0xffffffffu, s, offset);
    CombinePair(m, s, om, os);
  }
  const int warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  if (threadIdx.x % 32 == 0) {
    smem_m[warp] = m;
    smem_s[warp] = s;
  }
  __syncthreads();
  m = -INFINITY;
  s = 0.f;
  for (int w = 0; w < nwarps; ++w) CombinePair(m, s, smem_m[w], smem_s[w]);
  // A single +inf leaves s = 1 with m = +inf in its thread; any combination with it gives NaN,
  // but the m test does not rely on that.
  const bool nan_row = isnan(s) || m == INFINITY;
  const float inv = s > 0.f ? 1.f / s : 0.f;
  for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
    float o = 0.f;
    if (!IsMasked(p, r, c, MODE)) {
      if (nan_row) o = __uint_as_float(kQuietNaN);
      else if (s > 0.f) o = exp2f(ToF<T>(x[c]) * scale - m) * inv;  // -inf: 0
    }
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
    const float yy = ToF<T>(y[c]);
    if (yy != 0.f) dot += yy * ToF<T>(dy[c]);  // y == 0 takes no part, whatever dy holds
  }
  dot = GroupReduce<false>(dot, blockDim.x, smem);
  for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
    float o = 0.f;
    if (!IsMasked(p, r, c, MODE)) {
      const float yy = ToF<T>(y[c]);
      if (yy != 0.f) o = p.scale * yy * (ToF<T>(dy[c]) - dot);
    }
    dx[c] = FromF<T>(o);
  }
}

}  // namespace te::softmax
