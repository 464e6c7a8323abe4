#include <atomic>

#include "softmax/softmax_launch.cuh"

namespace te::softmax {

namespace {
std::atomic<int> g_force_tpr{0};
std::atomic<int> g_force_nv{0};
}  // namespace

void SetTuning(int threads_per_row, int vectors_per_thread) {
  g_force_tpr = threads_per_row;
  g_force_nv = vectors_per_thread;
}

void GetTuning(int* threads_per_row, int* vectors_per_thread) {
  *threads_per_row = g_force_tpr.load();
  *vectors_per_thread = g_force_nv.load();
}

LaunchConfig ChooseConfig(const Params& p, bool forward) {
  return ChooseConfigFor(p, p.dtype == DType::kF32 ? 4 : 2, forward);
}

static cudaError_t Launch(const Params& p, cudaStream_t s, bool backward) {
  switch (p.dtype) {
    case DType::kF32: return LaunchF32(p, s, backward);
    case DType::kBF16: return LaunchBF16(p, s, backward);
    case DType::kF16: return LaunchF16(p, s, backward);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchForward(const Params& p, cudaStream_t s) { return Launch(p, s, false); }
cudaError_t LaunchBackward(const Params& p, cudaStream_t s) { return Launch(p, s, true); }

}  // namespace te::softmax
