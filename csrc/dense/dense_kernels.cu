// Elementwise kernels of dense (see dense.h): launches of the device code in dense_act.cuh, plus
// the forward activation and the timing-data fill. Vectorised 16-byte accesses when N is a multiple
// of the vector width and the pointers are 16-byte aligned, scalar otherwise.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/convert.cuh"
#include "dense/dense.h"
#include "dense/dense_act.cuh"

namespace te::dense {
namespace {

using act::Activate;
using act::Vec;
using te::FromF;
using te::ToF;

// The backward kernel's block: 32 x 8 threads (benchmarks/micro/dense_act_bwd.cu sweeps the
// alternatives on the GPU), kBwdUnroll rows per load batch; the dbias reduction's 32 x 8 block.
constexpr int kBwdCols = 32;
constexpr int kBwdRows = 8;
constexpr int kBwdUnroll = 4;
constexpr int kReduceRows = 8;

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
  act::ActBackwardKernel<T, ACT, VEC, kBwdCols, kBwdRows, kBwdUnroll><<<grid, dim3(kBwdCols, kBwdRows), 0, s>>>(static_cast<const T*>(dy), static_cast<const T*>(saved),
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
    const int64_t blocks = (n + 31) / 32;
    act::ReducePartialsKernel<T, kReduceRows><<<static_cast<unsigned>(blocks), dim3(32, kReduceRows), 0, stream>>>(
        partials, chunks, n, static_cast<T*>(out));
    return cudaGetLastError();
  });
}

}  // namespace te::dense
