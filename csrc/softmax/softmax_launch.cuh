// Launch-configuration choice and dispatch over (VEC, NV, mode) for one element type T.
// Each csrc/softmax/softmax_<dtype>.cu instantiates this for its T, so the three dtypes compile in
// parallel.
#pragma once

#include <cmath>
#include <type_traits>

#include "softmax/softmax_kernels.cuh"
#include "softmax/softmax_warp_row.cuh"

namespace te::softmax {

constexpr int kMaxNv = 8;

inline int VecFor(const Params& p, int elem_bytes) {
  const int full = 16 / elem_bytes;
  auto aligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) % 16) == 0; };
  const void* ptrs[] = {p.x, p.y, p.dy, p.out};
  bool ok = p.cols % full == 0;
  for (const void* ptr : ptrs) ok = ok && (ptr == nullptr || aligned(ptr));
  if (p.mode == MaskMode::kMask) {
    ok = ok && (reinterpret_cast<uintptr_t>(p.mask) % full == 0) &&
         (p.mask_stride_b % full == 0) && (p.mask_stride_n % full == 0) &&
         (p.mask_stride_q % full == 0);
  }
  return ok ? full : 1;
}

// Vectors per lane of the warp-per-row forward for this problem, or 0 where it does not apply.
inline int WarpRowNv(const Params& p, int elem_bytes, FwdKernel k) {
  const int full = 16 / elem_bytes;
  const float s2 = p.scale * kLog2e;
  if (VecFor(p, elem_bytes) != full || !std::isfinite(s2) || s2 == 0.f) return 0;
  if (k == FwdKernel::kWarpRowPacked && p.dtype != DType::kBF16) return 0;
  const int64_t nvec = p.cols / full;
  if (nvec > 32 * 16) return 0;
  return nvec <= 32 * 4 ? 4 : (nvec <= 32 * 8 ? 8 : 16);
}

// Sets *c to the warp-per-row launch of kernel k (one warp per row, 4 rows per block) and returns
// true, or returns false (c untouched) where k does not apply to p.
inline bool WarpRowConfig(const Params& p, int elem_bytes, FwdKernel k, LaunchConfig* c) {
  const int wnv = WarpRowNv(p, elem_bytes, k);
  if (wnv == 0) return false;
  c->kernel = k;
  c->threads_per_row = 32;
  c->vectors_per_thread = wnv;
  c->block = kWarpRowThreads;
  c->grid = (p.rows + kWarpRowThreads / 32 - 1) / (kWarpRowThreads / 32);
  return true;
}

inline LaunchConfig ChooseConfigFor(const Params& p, int elem_bytes, bool forward = true) {
  LaunchConfig c;
  c.vec = VecFor(p, elem_bytes);
  const int64_t nvec = (p.cols + c.vec - 1) / c.vec;
  int tpr = 4, nv = 1;
  int force_tpr = 0, force_nv = 0;
  GetTuning(&force_tpr, &force_nv);
  if (forward && force_tpr == kTuneWarpRowTpr && (force_nv == kTuneWarpRowNv || force_nv == kTuneWarpRowPackedNv)) {
    const FwdKernel k = force_nv == kTuneWarpRowNv ? FwdKernel::kWarpRow : FwdKernel::kWarpRowPacked;
    if (WarpRowConfig(p, elem_bytes, k, &c)) return c;
  }
  if (force_tpr >= 4 && force_nv >= 1 && force_nv <= kMaxNv && force_tpr <= MaxThreadsForNv(force_nv) &&
      static_cast<int64_t>(force_tpr) * force_nv >= nvec) {
    c.threads_per_row = force_tpr;
    c.vectors_per_thread = force_nv;
    c.block = force_tpr < 128 ? 128 : force_tpr;
    c.grid = (p.rows + c.block / force_tpr - 1) / (c.block / force_tpr);
    return c;
  }
  // Default forward for rows longer than one warp's share of the register kernel (more than 32
  // lanes x 4 vectors, where it would reduce across warps through shared memory): the warp-per-row
  // kernel (exact, no block synchronisation), which measured faster on the H200 for long causal and
  // masked rows. A forced (threads_per_row, vectors_per_thread) pair that covers the row (above)
  // still selects the register kernel.
  if (forward && nvec > 32 * 4 && WarpRowConfig(p, elem_bytes, FwdKernel::kWarpRow, &c)) return c;
  // Grow the row group to a warp first, then the per-thread vectors to 4 (64 bytes in flight per
  // thread), then the group up to the largest block NV=4 allows without spilling (512 threads:
  // rows of up to 16384 2-byte / 8192 4-byte elements stay in registers); longer rows go to the
  // long-row kernel. NV=8 (tpr <= 256) is reachable through SetTuning only: same capacity.
  while (static_cast<int64_t>(tpr) * nv < nvec) {
    if (tpr < 32) tpr *= 2;
    else if (nv < 4) nv *= 2;
    else if (tpr < MaxThreadsForNv(nv)) tpr *= 2;
    else { tpr = 0; break; }
  }
  if (tpr == 0) {
    c.threads_per_row = 0;
    c.vectors_per_thread = 0;
    c.vec = 1;
    c.block = 1024;
    c.grid = p.rows;
    return c;
  }
  c.threads_per_row = tpr;
  c.vectors_per_thread = nv;
  c.block = tpr < 128 ? 128 : tpr;
  const int rows_per_block = c.block / tpr;
  c.grid = (p.rows + rows_per_block - 1) / rows_per_block;
  return c;
}

template <typename T, int VEC, MaskMode MODE, bool kBackward>
cudaError_t LaunchNv(const Params& p, const LaunchConfig& c, cudaStream_t s) {
  dim3 grid(static_cast<unsigned>(c.grid)), block(c.block);
#define TE_SOFTMAX_CASE(NV)                                                     \
  case NV:                                                                      \
    if (kBackward)                                                              \
      SoftmaxBackwardKernel<T, VEC, NV, MODE><<<grid, block, 0, s>>>(p, c.threads_per_row); \
    else                                                                        \
      SoftmaxForwardKernel<T, VEC, NV, MODE><<<grid, block, 0, s>>>(p, c.threads_per_row);  \
    break;
  switch (c.vectors_per_thread) {
    TE_SOFTMAX_CASE(1)
    TE_SOFTMAX_CASE(2)
    TE_SOFTMAX_CASE(4)
    TE_SOFTMAX_CASE(8)
    default: return cudaErrorInvalidConfiguration;
  }
#undef TE_SOFTMAX_CASE
  return cudaGetLastError();
}

template <typename T, MaskMode MODE, bool kPacked>
cudaError_t LaunchWarpRow(const Params& p, const LaunchConfig& c, cudaStream_t s) {
  dim3 grid(static_cast<unsigned>(c.grid)), block(c.block);
  switch (c.vectors_per_thread) {
    case 4: SoftmaxForwardWarpRowKernel<T, 4, MODE, kPacked><<<grid, block, 0, s>>>(p); break;
    case 8: SoftmaxForwardWarpRowKernel<T, 8, MODE, kPacked><<<grid, block, 0, s>>>(p); break;
    case 16: SoftmaxForwardWarpRowKernel<T, 16, MODE, kPacked><<<grid, block, 0, s>>>(p); break;
    default: return cudaErrorInvalidConfiguration;
  }
  return cudaGetLastError();
}

template <typename T, MaskMode MODE, bool kBackward>
cudaError_t LaunchMode(const Params& p, cudaStream_t s) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  const LaunchConfig c = ChooseConfigFor(p, sizeof(T), /*forward=*/!kBackward);
  if (c.grid > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  if constexpr (!kBackward) {
    if (c.kernel == FwdKernel::kWarpRow) return LaunchWarpRow<T, MODE, false>(p, c, s);
    if constexpr (sizeof(T) == 2) {
      if (c.kernel == FwdKernel::kWarpRowPacked) {
        if constexpr (std::is_same_v<T, __nv_bfloat16>) return LaunchWarpRow<T, MODE, true>(p, c, s);
        return cudaErrorInvalidConfiguration;  // WarpRowNv admits bf16 only
      }
    }
  }
  if (c.threads_per_row == 0) {
    if (kBackward)
      SoftmaxBackwardLongKernel<T, MODE><<<static_cast<unsigned>(c.grid), c.block, 0, s>>>(p);
    else
      SoftmaxForwardLongKernel<T, MODE><<<static_cast<unsigned>(c.grid), c.block, 0, s>>>(p);
    return cudaGetLastError();
  }
  constexpr int kFull = 16 / sizeof(T);
  if (c.vec == kFull) return LaunchNv<T, kFull, MODE, kBackward>(p, c, s);
  return LaunchNv<T, 1, MODE, kBackward>(p, c, s);
}

template <typename T, bool kBackward>
cudaError_t LaunchTyped(const Params& p, cudaStream_t s) {
  switch (p.mode) {
    case MaskMode::kNone: return LaunchMode<T, MaskMode::kNone, kBackward>(p, s);
    case MaskMode::kMask: return LaunchMode<T, MaskMode::kMask, kBackward>(p, s);
    case MaskMode::kCausal: return LaunchMode<T, MaskMode::kCausal, kBackward>(p, s);
  }
  return cudaErrorInvalidValue;
}

// Defined once per dtype file (softmax_<dtype>.cu).
cudaError_t LaunchF32(const Params& p, cudaStream_t s, bool backward);
cudaError_t LaunchBF16(const Params& p, cudaStream_t s, bool backward);
cudaError_t LaunchF16(const Params& p, cudaStream_t s, bool backward);

}  // namespace te::softmax
