// Elementwise kernels of dense (see dense.h). Math in float32; vectorised 16-byte accesses when N
// is a multiple of the vector width and the pointers are 16-byte aligned, scalar otherwise.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/convert.cuh"
#include "dense/dense.h"

namespace te::dense {
namespace {

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

template <typename T, int ACT, int VEC>
__global__ void ActForwardKernel(const T* z, const T* __restrict__ bias, T* y, T* z_out, int64_t m, int64_t n) {
  using V = Vec<T, VEC>;
  const int64_t nvec = m * n / VEC;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nvec;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t col = (i * VEC) % n;
    V zv = reinterpret_cast<const V*>(z)[i];
    V yv;
    V zo;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float f = ToF(zv.v[j]);
      if (bias != nullptr) f += ToF(bias[col + j]);
      zo.v[j] = FromF<T>(f);
      yv.v[j] = FromF<T>(Activate<ACT, (sizeof(T) < 4)>(f));
    }
    if (z_out != nullptr) reinterpret_cast<V*>(z_out)[i] = zo;
    reinterpret_cast<V*>(y)[i] = yv;
  }
}

// Block: kBwdCols x kBwdRows threads. threadIdx.x owns VEC consecutive columns (a warp covers
// 32 * VEC columns, one contiguous 16-byte-per-lane row segment); threadIdx.y walks the rows of
// the block's chunk with stride kBwdRows, kBwdUnroll rows' loads issued before any math (memory-
// level parallelism). grid: (ceil(N / (32 * VEC)), chunks). Column sums: each thread's running
// float32 sums, then the kBwdRows row groups are added in a fixed order through shared memory:
// one partials row per chunk, deterministic, no atomics.
constexpr int kBwdCols = 32;
constexpr int kBwdRows = 8;
constexpr int kBwdUnroll = 4;

template <typename T, int ACT, int VEC>
__global__ void __launch_bounds__(kBwdCols* kBwdRows)
    ActBackwardKernel(const T* __restrict__ dy, const T* __restrict__ saved, T* __restrict__ dz,
                      float* __restrict__ partials, int64_t m, int64_t n, int64_t rows_per_chunk) {
  using V = Vec<T, VEC>;
  constexpr bool kFast = sizeof(T) < 4;
  constexpr bool kSaved = ACT != static_cast<int>(Act::kNone);
  const int64_t col = (blockIdx.x * static_cast<int64_t>(kBwdCols) + threadIdx.x) * VEC;
  const bool active = col < n;
  const int64_t row0 = blockIdx.y * rows_per_chunk;
  const int64_t row1 = min(m, row0 + rows_per_chunk);
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
  if (active) {
    for (int64_t r = row0 + threadIdx.y; r < row1; r += kBwdRows * kBwdUnroll) {
      V g[kBwdUnroll];
      V s[kBwdUnroll];
#pragma unroll
      for (int u = 0; u < kBwdUnroll; ++u) {
        const int64_t ru = r + u * kBwdRows;
        if (ru < row1) {
          const int64_t off = (ru * n + col) / VEC;
          g[u] = reinterpret_cast<const V*>(dy)[off];
          if constexpr (kSaved) s[u] = reinterpret_cast<const V*>(saved)[off];
        }
      }
#pragma unroll
      for (int u = 0; u < kBwdUnroll; ++u) {
        const int64_t ru = r + u * kBwdRows;
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
  __shared__ float sums[kBwdRows][kBwdCols * VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) sums[threadIdx.y][threadIdx.x * VEC + j] = acc[j];
  __syncthreads();
  if (threadIdx.y == 0 && active) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float t = sums[0][threadIdx.x * VEC + j];
#pragma unroll
      for (int y = 1; y < kBwdRows; ++y) t += sums[y][threadIdx.x * VEC + j];
      partials[blockIdx.y * n + col + j] = t;
    }
  }
}

template <typename T>
__global__ void ReducePartialsKernel(const float* __restrict__ partials, int64_t chunks, int64_t n, T* out) {
  const int64_t col = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (col >= n) return;
  float s = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) s += partials[c * n + col];
  out[col] = FromF<T>(s);
}

}  // namespace

int64_t BackwardChunks(int64_t m, int64_t n, int vec) {
  // ~2048 blocks of kBwdCols x kBwdRows threads (several waves on 132 SMs), but at least 64 rows
  // per chunk so each thread has a few unrolled iterations. te_ops/dense/native.py's
  // partial_chunks() sizes the partials scratch with this same rule (tests/te_ops/test_dense.py).
  const int64_t gx = (n + int64_t{kBwdCols} * vec - 1) / (int64_t{kBwdCols} * vec);
  int64_t chunks = std::min<int64_t>((2048 + gx - 1) / gx, (m + 63) / 64);
  return std::max<int64_t>(1, std::min<int64_t>(chunks, 65535));
}

namespace {

bool Aligned16(const void* p) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) % 16) == 0; }

template <typename T, int VEC, int ACT>
cudaError_t FwdTyped(const void* z, const void* bias, void* y, void* z_out, int64_t m, int64_t n, cudaStream_t s) {
  const int threads = 256;
  const int64_t nvec = m * n / VEC;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((nvec + threads - 1) / threads, 1 << 16));
  ActForwardKernel<T, ACT, VEC><<<static_cast<unsigned>(blocks), threads, 0, s>>>(
      static_cast<const T*>(z), static_cast<const T*>(bias), static_cast<T*>(y), static_cast<T*>(z_out), m, n);
  return cudaGetLastError();
}

template <typename T, int VEC, int ACT>
cudaError_t BwdTyped(const void* dy, const void* saved, void* dz, float* partials, int64_t chunks, int64_t m,
                     int64_t n, cudaStream_t s) {
  const int64_t gx = (n + kBwdCols * VEC - 1) / (kBwdCols * VEC);
  const int64_t rows_per_chunk = (m + chunks - 1) / chunks;
  dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(chunks));
  ActBackwardKernel<T, ACT, VEC><<<grid, dim3(kBwdCols, kBwdRows), 0, s>>>(static_cast<const T*>(dy), static_cast<const T*>(saved),
                                                          static_cast<T*>(dz), partials, m, n, rows_per_chunk);
  return cudaGetLastError();
}

template <typename T, int VEC, typename Fn>
cudaError_t ByAct(Act act, Fn&& fn) {
  switch (act) {
    case Act::kNone: return fn(std::integral_constant<int, 0>{});
    case Act::kGelu: return fn(std::integral_constant<int, 1>{});
    case Act::kGeluTanh: return fn(std::integral_constant<int, 2>{});
    case Act::kRelu: return fn(std::integral_constant<int, 3>{});
    case Act::kSilu: return fn(std::integral_constant<int, 4>{});
  }
  return cudaErrorInvalidValue;
}

template <typename Fn>
cudaError_t ByType(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::kF32: return fn(float{});
    case DType::kBF16: return fn(__nv_bfloat16{});
    case DType::kF16: return fn(__half{});
  }
  return cudaErrorInvalidValue;
}

__device__ __forceinline__ uint32_t HashIndex(uint64_t i, uint32_t seed) {
  // splitmix64-style finaliser of the index, folded to 32 bits
  uint64_t z = i + 0x9e3779b97f4a7c15ull * (static_cast<uint64_t>(seed) + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<uint32_t>((z ^ (z >> 31)) >> 32);
}

template <typename T>
__global__ void FillUniformKernel(T* p, int64_t count, uint32_t seed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const float u = static_cast<float>(HashIndex(static_cast<uint64_t>(i), seed) >> 8) * (2.0f / 16777216.0f) - 1.0f;
    p[i] = FromF<T>(u);
  }
}

}  // namespace

cudaError_t LaunchFillUniform(DType dt, void* p, int64_t count, uint32_t seed, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((count + threads - 1) / threads, 132 * 16);
  return ByType(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    FillUniformKernel<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(static_cast<T*>(p), count, seed);
    return cudaGetLastError();
  });
}

cudaError_t LaunchActForward(DType dt, Act act, const void* z, const void* bias, void* y, void* z_out, int64_t m,
                             int64_t n, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  // z_out may equal z (train mode, bias added here): each element is read, then written, by one thread.
  return ByType(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = n % kVec == 0 && Aligned16(z) && Aligned16(y) && Aligned16(z_out);
    return ByAct<T, 1>(act, [&](auto a) -> cudaError_t {
      constexpr int A = decltype(a)::value;
      return vec ? FwdTyped<T, kVec, A>(z, bias, y, z_out, m, n, stream)
                 : FwdTyped<T, 1, A>(z, bias, y, z_out, m, n, stream);
    });
  });
}

cudaError_t LaunchActBackward(DType dt, Act act, const void* dy, const void* saved, void* dz, float* partials,
                              int64_t chunks, int64_t m, int64_t n, cudaStream_t stream) {
  if (n == 0 || m == 0) return cudaSuccess;
  if (chunks > 65535 || (partials != nullptr && chunks <= 0)) return cudaErrorInvalidValue;
  return ByType(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = n % kVec == 0 && Aligned16(dy) && Aligned16(saved) && Aligned16(dz);
    if (chunks <= 0) {
      // No column sums wanted: the row chunking only sets the grid.
      chunks = BackwardChunks(m, n, vec ? kVec : 1);
    }
    return ByAct<T, 1>(act, [&](auto a) -> cudaError_t {
      constexpr int A = decltype(a)::value;
      return vec ? BwdTyped<T, kVec, A>(dy, saved, dz, partials, chunks, m, n, stream)
                 : BwdTyped<T, 1, A>(dy, saved, dz, partials, chunks, m, n, stream);
    });
  });
}

cudaError_t LaunchReducePartials(DType dt, const float* partials, int64_t chunks, int64_t n, void* out,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return ByType(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    const int threads = 256;
    const int64_t blocks = (n + threads - 1) / threads;
    ReducePartialsKernel<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(partials, chunks, n,
                                                                                     static_cast<T*>(out));
    return cudaGetLastError();
  });
}

}  // namespace te::dense
