// Host interface of the softmax kernels (csrc/softmax/softmax_kernels.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace te::softmax {

enum class MaskMode : int { kNone = 0, kMask = 1, kCausal = 2 };
enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// A softmax over the last axis of a [rows, cols] view. For kCausal and kMask, rows are ordered as
// [batch, heads, sq] (row = (b * heads + n) * sq + q). For kMask, `mask` is bool (one byte per
// element) laid out [mb, mn, msq, cols] with strides given in elements (0 on a broadcast axis).
struct Params {
  const void* x = nullptr;     // forward input
  const void* y = nullptr;     // backward: forward output
  const void* dy = nullptr;    // backward: output cotangent
  void* out = nullptr;         // forward: y, backward: dx
  const uint8_t* mask = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t heads = 1;
  int64_t sq = 1;
  int64_t mask_stride_b = 0;
  int64_t mask_stride_n = 0;
  int64_t mask_stride_q = 0;
  float scale = 1.0f;
  MaskMode mode = MaskMode::kNone;
  DType dtype = DType::kF32;
};

// Forward kernel families. kRegister (softmax_kernels.cuh: a group of threads per row, the row held
// in registers; named "register" by softmax_config) is the only backward and the forward for rows of
// at most 128 vectors; kWarpRow (softmax_warp_row.cuh) is the default forward for longer rows where
// it applies (see WarpRowNv); kWarpRowPacked is reachable through SetTuning only.
enum class FwdKernel : int { kRegister = 0, kWarpRow = 1, kWarpRowPacked = 2 };

// Launch configuration chosen for a problem (exposed for tests and the benchmark table).
struct LaunchConfig {
  int vec = 1;               // elements per vector access
  int vectors_per_thread = 1;
  int threads_per_row = 32;  // 0: the long-row (multi-pass, block per row) kernel
  int block = 128;
  int64_t grid = 1;
  FwdKernel kernel = FwdKernel::kRegister;  // forward only; the backward is always kRegister
};

// SetTuning pairs that select the warp-per-row forwards (forward only; the backward keeps the
// heuristic). They apply where the variant supports the problem: 16-byte vectors (cols a multiple
// of 16 / sizeof(T), aligned pointers and mask strides), cols <= 512 vectors (4096 bf16/f16, 2048
// f32), scale != 0; kWarpRowPacked also needs bf16. Elsewhere the heuristic register-kernel launch
// is used.
constexpr int kTuneWarpRowTpr = 32;
constexpr int kTuneWarpRowNv = 16;         // (32, 16): FwdKernel::kWarpRow
constexpr int kTuneWarpRowPackedNv = -16;  // (32, -16): FwdKernel::kWarpRowPacked

// The launch the forward (or, with forward = false, the backward) uses for p.
LaunchConfig ChooseConfig(const Params& p, bool forward = true);

// Benchmark/tuning hook: force (threads_per_row, vectors_per_thread) for the register kernels
// whenever that pair covers the row (0, 0 restores the heuristic), or select a warp-per-row
// forward with the pairs above. Process-wide; not a way to select implementations. Warm-up keys
// include the chosen configuration.
void SetTuning(int threads_per_row, int vectors_per_thread);
void GetTuning(int* threads_per_row, int* vectors_per_thread);

// Enqueue on `stream`; returns the launch error (no synchronisation).
cudaError_t LaunchForward(const Params& p, cudaStream_t stream);
cudaError_t LaunchBackward(const Params& p, cudaStream_t stream);

}  // namespace te::softmax
