// Aux-loss kernels, the dtype dispatch of the row kernels and their persistent-grid size.
//
// Forward: kLossPartials blocks each reduce a grid-strided slice of probs[t, e] * tpe[e] into one
// fp32 partial (written to an XLA-allocated scratch result), then one block sums the partials in a
// fixed order: deterministic, no atomics, nothing to zero, graph-safe.
#include <map>
#include <mutex>
#include <tuple>

#include "router/router_launch.cuh"

namespace te::router {

int ElementsPerLane(int experts) {
  int ept = 1;
  while (ept * 32 < experts) ept *= 2;
  return ept;
}

cudaError_t ResidentBlocks(const void* kernel, size_t smem, int64_t* blocks) {
  int device = 0;
  cudaError_t st = cudaGetDevice(&device);
  if (st != cudaSuccess) return st;
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, size_t>, int64_t> cache;  // (kernel, device, smem)
  const auto key = std::make_tuple(kernel, device, smem);
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = cache.find(key);
    if (it != cache.end()) {
      *blocks = it->second;
      return cudaSuccess;
    }
  }
  int per_sm = 0, sms = 0;
  st = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarpsPerBlock * 32, smem);
  if (st != cudaSuccess) return st;
  st = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (st != cudaSuccess) return st;
  *blocks = static_cast<int64_t>(per_sm > 0 ? per_sm : 1) * sms;
  std::lock_guard<std::mutex> lock(mu);
  cache.emplace(key, *blocks);
  return cudaSuccess;
}

cudaError_t LaunchRowForward(const RowParams& p, cudaStream_t s) {
  switch (p.dtype) {
    case DType::kF32: return LaunchRowF32(p, s, false);
    case DType::kBF16: return LaunchRowBF16(p, s, false);
    case DType::kF16: return LaunchRowF16(p, s, false);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchRowBackward(const RowParams& p, cudaStream_t s) {
  switch (p.dtype) {
    case DType::kF32: return LaunchRowF32(p, s, true);
    case DType::kBF16: return LaunchRowBF16(p, s, true);
    case DType::kF16: return LaunchRowF16(p, s, true);
  }
  return cudaErrorInvalidValue;
}

namespace {

constexpr int kLossThreads = 256;

// Sum over the block; the result is valid in thread 0.
__device__ __forceinline__ float BlockSum(float v) {
  __shared__ float red[kLossThreads / 32];
  v = WarpSum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = 0.f;
  if (warp == 0) {
    r = lane < kLossThreads / 32 ? red[lane] : 0.f;
    r = WarpSum(r);
  }
  return r;
}

template <typename T>
__global__ void __launch_bounds__(kLossThreads) LossPartialKernel(const T* probs, const float* tpe, int64_t n,
                                                                   int experts, float* partials) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int e = static_cast<int>(i % experts);                 // expert of element i (row-major [T, E])
  const int step = static_cast<int>(stride % experts);  // advance of e per grid stride
  float acc = 0.f;
  for (; i < n; i += stride) {
    acc += ToF<T>(probs[i]) * tpe[e];
    e += step;
    if (e >= experts) e -= experts;
  }
  const float total = BlockSum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kLossThreads) LossFinalKernel(const float* partials, int count, float* out) {
  float acc = 0.f;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  const float total = BlockSum(acc);
  if (threadIdx.x == 0) out[0] = total;
}

template <typename T>
__global__ void __launch_bounds__(kLossThreads) LossBackwardKernel(const float* tpe, const float* g, int64_t n,
                                                                    int experts, T* dprobs) {
  const float gs = g[0];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int e = static_cast<int>(i % experts);
  const int step = static_cast<int>(stride % experts);
  for (; i < n; i += stride) {
    dprobs[i] = FromF<T>(gs * tpe[e]);
    e += step;
    if (e >= experts) e -= experts;
  }
}

template <typename T>
cudaError_t LossForwardTyped(const LossParams& p, cudaStream_t s) {
  const int64_t n = p.rows * p.experts;
  // Every partial is written (blocks past the data write 0), so the final sum never reads garbage.
  LossPartialKernel<T><<<kLossPartials, kLossThreads, 0, s>>>(static_cast<const T*>(p.probs), p.tpe, n, p.experts,
                                                             p.partials);
  cudaError_t st = cudaGetLastError();
  if (st != cudaSuccess) return st;
  LossFinalKernel<<<1, kLossThreads, 0, s>>>(p.partials, kLossPartials, p.out);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LossBackwardTyped(const LossParams& p, cudaStream_t s) {
  const int64_t n = p.rows * p.experts;
  if (n == 0) return cudaSuccess;
  int64_t blocks = (n + kLossThreads - 1) / kLossThreads;
  if (blocks > 16384) blocks = 16384;
  LossBackwardKernel<T><<<static_cast<unsigned>(blocks), kLossThreads, 0, s>>>(p.tpe, p.g, n, p.experts,
                                                                              static_cast<T*>(p.dprobs));
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchLossForward(const LossParams& p, cudaStream_t s) {
  if (p.experts < 1) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kF32: return LossForwardTyped<float>(p, s);
    case DType::kBF16: return LossForwardTyped<__nv_bfloat16>(p, s);
    case DType::kF16: return LossForwardTyped<__half>(p, s);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchLossBackward(const LossParams& p, cudaStream_t s) {
  if (p.experts < 1) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kF32: return LossBackwardTyped<float>(p, s);
    case DType::kBF16: return LossBackwardTyped<__nv_bfloat16>(p, s);
    case DType::kF16: return LossBackwardTyped<__half>(p, s);
  }
  return cudaErrorInvalidValue;
}

}  // namespace te::router
