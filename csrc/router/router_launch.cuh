// Launch of the router row kernels (router_kernels.cuh), included once per dtype file.
//
// Kernel choice: FwdKind / BwdKind from the op's configuration, EPT from E, kVec when E % EPT == 0
// and every row buffer is 16-byte aligned (XLA's buffers are; the check only keeps the element-wise
// path correct for anything else). Grid: persistent, min(rows / 4, blocks resident on the device at
// once), from the occupancy of the chosen kernel (cached per device, kernel and shared memory size;
// the first query happens in the handler's warm-up, outside any graph capture that matters). The
// same configuration always gives the same launch: graph-safe.
#pragma once

#include <algorithm>

#include "router/router_kernels.cuh"

namespace te::router {

// Blocks of kWarpsPerBlock warps of `kernel` that are resident at once on the current device.
cudaError_t ResidentBlocks(const void* kernel, size_t smem, int64_t* blocks);

template <typename Kernel>
cudaError_t LaunchPersistent(Kernel kernel, const RowParams& p, size_t smem, cudaStream_t s) {
  int64_t resident = 0;
  cudaError_t st = ResidentBlocks(reinterpret_cast<const void*>(kernel), smem, &resident);
  if (st != cudaSuccess) return st;
  const int64_t need = (p.rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t grid = std::max<int64_t>(1, std::min(need, resident));
  kernel<<<static_cast<unsigned>(grid), kWarpsPerBlock * 32, smem, s>>>(p);
  return cudaGetLastError();
}

template <typename T, int EPT, bool kVec>
cudaError_t LaunchRowKind(const RowParams& p, cudaStream_t s, bool backward) {
  if (backward) {
    if (p.aux) return LaunchPersistent(RowBackwardKernel<T, EPT, kVec, BwdKind::kAux>, p, 0, s);
    if (p.score == Score::kSoftmax && p.pre_softmax) {
      return LaunchPersistent(RowBackwardKernel<T, EPT, kVec, BwdKind::kPreSoftmax>, p, 0, s);
    }
    return LaunchPersistent(RowBackwardKernel<T, EPT, kVec, BwdKind::kSparse>, p, 0, s);
  }
  if (p.aux) return LaunchPersistent(RowForwardKernel<T, EPT, kVec, FwdKind::kAux>, p, 0, s);
  if (p.score == Score::kSoftmax && !p.pre_softmax && p.num_groups == 0) {
    return LaunchPersistent(RowForwardKernel<T, EPT, kVec, FwdKind::kSoftmaxTopk>, p, 0, s);
  }
  if (p.num_groups > 0 && !FastGroups(p.experts, p.num_groups, p.topk, p.group_topk, EPT)) {
    const size_t smem = sizeof(float) * kWarpsPerBlock * p.experts;
    return LaunchPersistent(RowForwardKernel<T, EPT, kVec, FwdKind::kTopkGrouped>, p, smem, s);
  }
  return LaunchPersistent(RowForwardKernel<T, EPT, kVec, FwdKind::kTopk>, p, 0, s);
}

inline bool Aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

template <typename T, int EPT>
cudaError_t LaunchRowEpt(const RowParams& p, cudaStream_t s, bool backward) {
  const bool vec = p.experts % EPT == 0 && Aligned16(p.logits) && Aligned16(p.g) && Aligned16(p.map_in) &&
                   Aligned16(p.out) && Aligned16(p.map_out);
  return vec ? LaunchRowKind<T, EPT, true>(p, s, backward) : LaunchRowKind<T, EPT, false>(p, s, backward);
}

template <typename T>
cudaError_t LaunchRowTyped(const RowParams& p, cudaStream_t s, bool backward) {
  if (p.rows == 0) return cudaSuccess;
  if (p.experts < 1 || p.experts > kMaxExperts) return cudaErrorInvalidValue;
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
