// Elementwise kernels of dense (see dense.h): the launches of dense_act.cuh's device code (forward
// activation, backward dz/dbias, dbias reduction, timing-data fill). Vectorised 16-byte accesses when N is a multiple
// of the vector width and the pointers are 16-byte aligned, scalar otherwise.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "common/convert.cuh"
#include "dense/dense.h"
#include "dense/dense_act.cuh"

namespace te::dense {
namespace {

using te::FromF;
using te::ToF;

// The backward kernel's compiled block shapes (threads x, threads y, rows per load batch); one is
// active (SetBackwardVariant; benchmarks/dense_profile.py times each inside the real op and
// benchmarks/micro/dense_act_bwd.cu sweeps more shapes standalone). The dbias reduction's block is
// 32 x kReduceRows.
constexpr BwdVariant kBwdVariants[] = {{32, 8, 4}, {256, 1, 2}, {256, 1, 4}, {128, 2, 2}};
constexpr int kNumBwdVariants = sizeof(kBwdVariants) / sizeof(kBwdVariants[0]);
constexpr int kDefaultBwdVariant = 1;
std::atomic<int> g_bwd_variant{kDefaultBwdVariant};
std::atomic<bool> g_train_forward_split{false};
constexpr int kReduceRows = 8;

}  // namespace

bool TrainForwardSplit() { return g_train_forward_split.load(std::memory_order_relaxed); }
void SetTrainForwardSplit(bool split) { g_train_forward_split.store(split, std::memory_order_relaxed); }

int NumBackwardVariants() { return kNumBwdVariants; }
BwdVariant BackwardVariantAt(int i) { return kBwdVariants[i]; }
int BackwardVariant() { return g_bwd_variant.load(std::memory_order_relaxed); }
bool SetBackwardVariant(int i) {
  if (i < 0 || i >= kNumBwdVariants) return false;
  g_bwd_variant.store(i, std::memory_order_relaxed);
  return true;
}

int64_t BackwardChunks(int64_t m, int64_t n, int vec, int block_x, int64_t max_chunks) {
  // ~2048 blocks (several waves on 132 SMs) but at least 32 rows per chunk, at most max_chunks
  // (the partials scratch's rows: te_ops/dense/native.py partial_chunks(), this rule's bound for
  // the widest block, 256 threads).
  const int64_t cols = int64_t{block_x} * vec;
  const int64_t gx = (n + cols - 1) / cols;
  const int64_t chunks = std::min<int64_t>((2048 + gx - 1) / gx, (m + 31) / 32);
  return std::max<int64_t>(1, std::min<int64_t>({chunks, max_chunks, int64_t{65535}}));
}

namespace {

bool Aligned16(const void* p) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) % 16) == 0; }

template <typename T, int VEC, int ACT>
cudaError_t FwdTyped(const void* z, const void* bias, void* y, void* z_out, int64_t m, int64_t n, cudaStream_t s) {
  // 32 x 8 threads, 2-row load batches: the shape the standalone sweep of the backward kernel
  // (benchmarks/micro/dense_act_bwd.cu) finds fastest for the same access pattern, at the copy ceiling.
  constexpr int kBx = 32, kBy = 8, kU = 2;
  const int64_t chunks = BackwardChunks(m, n, VEC, kBx, 65535);
  const int64_t rows_per_chunk = (m + chunks - 1) / chunks;
  dim3 grid(static_cast<unsigned>((n + kBx * VEC - 1) / (kBx * VEC)), static_cast<unsigned>(chunks));
  act::ActForwardKernel<T, ACT, VEC, kBx, kBy, kU><<<grid, dim3(kBx, kBy), 0, s>>>(
      static_cast<const T*>(z), static_cast<const T*>(bias), static_cast<T*>(y), static_cast<T*>(z_out), m, n,
      rows_per_chunk);
  return cudaGetLastError();
}

template <typename T, int VEC, int ACT, int V>
cudaError_t BwdTyped(const void* dy, const void* saved, void* dz, float* partials, int64_t chunks, int64_t m,
                     int64_t n, cudaStream_t s) {
  constexpr BwdVariant kV = kBwdVariants[V];
  const int64_t gx = (n + kV.bx * VEC - 1) / (kV.bx * VEC);
  const int64_t rows_per_chunk = (m + chunks - 1) / chunks;
  dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(chunks));
  act::ActBackwardKernel<T, ACT, VEC, kV.bx, kV.by, kV.unroll><<<grid, dim3(kV.bx, kV.by), 0, s>>>(
      static_cast<const T*>(dy), static_cast<const T*>(saved), static_cast<T*>(dz), partials, m, n, rows_per_chunk);
  return cudaGetLastError();
}

template <typename Fn>
cudaError_t ByVariant(int v, Fn&& fn) {
  static_assert(kNumBwdVariants == 4, "list every variant below");
  switch (v) {
    case 0: return fn(std::integral_constant<int, 0>{});
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
  }
  return cudaErrorInvalidValue;
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

}  // namespace

cudaError_t LaunchFillUniform(DType dt, void* p, int64_t count, uint32_t seed, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((count + threads - 1) / threads, 132 * 16);
  return ByType(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    act::FillUniformKernel<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(static_cast<T*>(p), count, seed,
                                                                                      1.0f);
    return cudaGetLastError();
  });
}

namespace {
// p[i] = FP8 of 256 * uniform[-1, 1) (saturating; E4M3 or E5M2 bytes): FP8 GEMM timing data whose
// exponents and signs vary like quantized activations' do.
__global__ void FillFp8UniformKernel(uint8_t* p, int64_t count, uint32_t seed, bool e5m2) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const float u =
        static_cast<float>(act::HashIndex(static_cast<uint64_t>(i), seed) >> 8) * (2.0f / 16777216.0f) - 1.0f;
    p[i] = __nv_cvt_float_to_fp8(256.0f * u, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
  }
}
}  // namespace

cudaError_t LaunchFillFp8Uniform(bool e5m2, void* p, int64_t count, uint32_t seed, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((count + threads - 1) / threads, 132 * 16);
  FillFp8UniformKernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(static_cast<uint8_t*>(p), count, seed,
                                                                              e5m2);
  return cudaGetLastError();
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
                              int64_t max_chunks, int64_t m, int64_t n, cudaStream_t stream, int64_t* chunks_used) {
  *chunks_used = 0;
  if (n == 0 || m == 0) return cudaSuccess;
  if (partials != nullptr && (max_chunks <= 0 || max_chunks > 65535)) return cudaErrorInvalidValue;
  if (partials == nullptr) max_chunks = 65535;  // no column sums: the chunking only shapes the grid
  const int v = BackwardVariant();
  return ByType(dt, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = n % kVec == 0 && Aligned16(dy) && Aligned16(saved) && Aligned16(dz);
    const int64_t chunks = BackwardChunks(m, n, vec ? kVec : 1, kBwdVariants[v].bx, max_chunks);
    *chunks_used = chunks;
    return ByAct<T, 1>(act, [&](auto a) -> cudaError_t {
      constexpr int A = decltype(a)::value;
      return ByVariant(v, [&](auto vi) -> cudaError_t {
        constexpr int V = decltype(vi)::value;
        return vec ? BwdTyped<T, kVec, A, V>(dy, saved, dz, partials, chunks, m, n, stream)
                   : BwdTyped<T, 1, A, V>(dy, saved, dz, partials, chunks, m, n, stream);
      });
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
