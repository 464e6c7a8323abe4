// Device code of dense's elementwise passes (forward activation, backward dz/dbias, dbias reduction,
// timing-data fill), shared by csrc/dense/dense_kernels.cu (the launches)
// and benchmarks/micro/dense_act_bwd.cu (a standalone sweep of the backward kernel's block shapes).
// Math in float32; FAST (16-bit outputs) selects the cheap sigmoid forms (see Sigmoid).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/convert.cuh"
#include "dense/dense.h"

namespace te::dense::act {

using te::FromF;  // common/convert.cuh: the element conversions shared by all kernels
using te::ToF;

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

// Math in float32. FAST (16-bit outputs): the sigmoid-based forms with __expf / __fdividef, whose
// ~1e-7 relative error vanishes in the bf16/f16 rounding and which cost a fraction of precise
// tanhf/expf; the backward pass is memory bound only if the math keeps up (H200: 235M GELU
// gradients in ~0.35 ms). float32 outputs keep the precise library functions.
template <bool FAST>
__device__ __forceinline__ float Sigmoid(float v) {
  if constexpr (FAST) {
    return __fdividef(1.0f, 1.0f + __expf(-v));  // v -> -inf: 1 / inf = 0
  } else {
    return 1.0f / (1.0f + expf(-v));
  }
}

template <int ACT, bool FAST>
__device__ __forceinline__ float Activate(float z) {
  if constexpr (ACT == static_cast<int>(Act::kGelu)) {
    return 0.5f * z * (1.0f + erff(z * kInvSqrt2));
  } else if constexpr (ACT == static_cast<int>(Act::kGeluTanh)) {
    const float u = kSqrt2OverPi * z * (1.0f + 0.044715f * z * z);
    if constexpr (FAST) {
      return z * Sigmoid<true>(2.0f * u);  // 0.5 (1 + tanh u) = sigmoid(2u)
    } else {
      return 0.5f * z * (1.0f + tanhf(u));
    }
  } else if constexpr (ACT == static_cast<int>(Act::kRelu)) {
    return z > 0.0f ? z : 0.0f;
  } else if constexpr (ACT == static_cast<int>(Act::kSilu)) {
    return z * Sigmoid<FAST>(z);
  } else {
    return z;
  }
}

// d act / dz from the saved value (y for relu, z otherwise).
template <int ACT, bool FAST>
__device__ __forceinline__ float ActGrad(float s) {
  if constexpr (ACT == static_cast<int>(Act::kGelu)) {
    const float cdf = 0.5f * (1.0f + erff(s * kInvSqrt2));
    return cdf + s * expf(-0.5f * s * s) * kInvSqrt2Pi;
  } else if constexpr (ACT == static_cast<int>(Act::kGeluTanh)) {
    const float u = kSqrt2OverPi * s * (1.0f + 0.044715f * s * s);
    const float du = kSqrt2OverPi * (1.0f + 3.0f * 0.044715f * s * s);
    if constexpr (FAST) {
      // 0.5 (1 + tanh u) = g := sigmoid(2u) and 0.5 (1 - tanh^2 u) = 2 g (1 - g)
      const float g = Sigmoid<true>(2.0f * u);
      return g + 2.0f * s * g * (1.0f - g) * du;
    } else {
      const float t = tanhf(u);
      return 0.5f * (1.0f + t) + 0.5f * s * (1.0f - t * t) * du;
    }
  } else if constexpr (ACT == static_cast<int>(Act::kRelu)) {
    return s > 0.0f ? 1.0f : 0.0f;
  } else if constexpr (ACT == static_cast<int>(Act::kSilu)) {
    const float sig = Sigmoid<FAST>(s);
    return sig * (1.0f + s * (1.0f - sig));
  } else {
    return 1.0f;
  }
}

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

// y = act(z + bias) (bias may be null), z_out = z + bias when non-null. z and y may be the same buffer
// (in place: each element is read, then written, by one thread), hence no __restrict__ on them.
// Same thread layout as ActBackwardKernel: threadIdx.x owns VEC columns (its bias values are loaded
// once), threadIdx.y walks the chunk's rows with stride BY, U rows' loads issued before any math.
template <typename T, int ACT, int VEC, int BX, int BY, int U>
__global__ void __launch_bounds__(BX* BY)
    ActForwardKernel(const T* z, const T* __restrict__ bias, T* y, T* z_out, int64_t m, int64_t n,
                     int64_t rows_per_chunk) {
  using V = Vec<T, VEC>;
  constexpr bool kFast = sizeof(T) < 4;
  const int64_t col = (blockIdx.x * static_cast<int64_t>(BX) + threadIdx.x) * VEC;
  if (col >= n) return;
  float bv[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) bv[j] = bias != nullptr ? ToF(bias[col + j]) : 0.0f;
  const int64_t row0 = blockIdx.y * rows_per_chunk;
  const int64_t row1 = min(m, row0 + rows_per_chunk);
  for (int64_t r = row0 + threadIdx.y; r < row1; r += BY * U) {
    V zv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t ru = r + u * BY;
      if (ru < row1) zv[u] = reinterpret_cast<const V*>(z)[(ru * n + col) / VEC];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t ru = r + u * BY;
      if (ru < row1) {
        V yv, zo;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float f = ToF(zv[u].v[j]) + bv[j];
          zo.v[j] = FromF<T>(f);
          yv.v[j] = FromF<T>(Activate<ACT, kFast>(f));
        }
        const int64_t off = (ru * n + col) / VEC;
        if (z_out != nullptr) reinterpret_cast<V*>(z_out)[off] = zo;
        reinterpret_cast<V*>(y)[off] = yv;
      }
    }
  }
}

// dz = dy * act'(saved) with float32 column sums of dz per row chunk (dbias partials).
// Block BX x BY threads: threadIdx.x owns VEC consecutive columns, so a block row covers BX * VEC
// columns (BX * 16 contiguous bytes); threadIdx.y walks the chunk's rows with stride BY, U rows'
// loads issued before any math (memory-level parallelism). grid: (ceil(N / (BX * VEC)), chunks).
// The BY row groups' sums are added in a fixed order through shared memory: one partials row per
// chunk, deterministic, no atomics. partials may be null (dz only); dz may be null (sums only).
template <typename T, int ACT, int VEC, int BX, int BY, int U>
__global__ void __launch_bounds__(BX* BY)
    ActBackwardKernel(const T* __restrict__ dy, const T* __restrict__ saved, T* __restrict__ dz,
                      float* __restrict__ partials, int64_t m, int64_t n, int64_t rows_per_chunk) {
  using V = Vec<T, VEC>;
  constexpr bool kFast = sizeof(T) < 4;
  constexpr bool kSaved = ACT != static_cast<int>(Act::kNone);
  const int64_t col = (blockIdx.x * static_cast<int64_t>(BX) + threadIdx.x) * VEC;
  const bool active = col < n;
  const int64_t row0 = blockIdx.y * rows_per_chunk;
  const int64_t row1 = min(m, row0 + rows_per_chunk);
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
  if (active) {
    for (int64_t r = row0 + threadIdx.y; r < row1; r += BY * U) {
      V g[U];
      V s[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t ru = r + u * BY;
        if (ru < row1) {
          const int64_t off = (ru * n + col) / VEC;
          g[u] = reinterpret_cast<const V*>(dy)[off];
          if constexpr (kSaved) s[u] = reinterpret_cast<const V*>(saved)[off];
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t ru = r + u * BY;
        if (ru < row1) {
          V out;
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            float d = ToF(g[u].v[j]);
            if constexpr (kSaved) d *= ActGrad<ACT, kFast>(ToF(s[u].v[j]));
            acc[j] += d;
            out.v[j] = FromF<T>(d);
          }
          if (dz != nullptr) reinterpret_cast<V*>(dz)[(ru * n + col) / VEC] = out;
        }
      }
    }
  }
  if (partials == nullptr) return;
  if constexpr (BY == 1) {
    if (active) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) partials[blockIdx.y * n + col + j] = acc[j];
    }
  } else {
    __shared__ float sums[BY][BX * VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) sums[threadIdx.y][threadIdx.x * VEC + j] = acc[j];
    __syncthreads();
    if (threadIdx.y == 0 && active) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float t = sums[0][threadIdx.x * VEC + j];
#pragma unroll
        for (int y = 1; y < BY; ++y) t += sums[y][threadIdx.x * VEC + j];
        partials[blockIdx.y * n + col + j] = t;
      }
    }
  }
}

// out[N] = sum over the chunks of partials[chunks, N]. Block 32 x RY: threadIdx.x a column,
// threadIdx.y every RY-th chunk; the RY sums are added in a fixed order (deterministic).
template <typename T, int RY>
__global__ void __launch_bounds__(32 * RY)
    ReducePartialsKernel(const float* __restrict__ partials, int64_t chunks, int64_t n, T* out) {
  const int64_t col = blockIdx.x * int64_t{32} + threadIdx.x;
  float s = 0.0f;
  if (col < n) {
    for (int64_t c = threadIdx.y; c < chunks; c += RY) s += partials[c * n + col];
  }
  __shared__ float sums[RY][32];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    float t = sums[0][threadIdx.x];
#pragma unroll
    for (int y = 1; y < RY; ++y) t += sums[y][threadIdx.x];
    out[col] = FromF<T>(t);
  }
}

__device__ __forceinline__ uint32_t HashIndex(uint64_t i, uint32_t seed) {
  // splitmix64-style finaliser of the index, folded to 32 bits
  uint64_t z = i + 0x9e3779b97f4a7c15ull * (static_cast<uint64_t>(seed) + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<uint32_t>((z ^ (z >> 31)) >> 32);
}

// p[i] = scale * uniform[-1, 1) from a hash of (i, seed): deterministic pseudo-random data.
template <typename T>
__global__ void FillUniformKernel(T* p, int64_t count, uint32_t seed, float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const float u = static_cast<float>(HashIndex(static_cast<uint64_t>(i), seed) >> 8) * (2.0f / 16777216.0f) - 1.0f;
    p[i] = FromF<T>(u * scale);
  }
}

}  // namespace te::dense::act
