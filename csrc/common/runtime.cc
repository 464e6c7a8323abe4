#include "common/runtime.h"
#include "common/targets.h"

#include <memory>
#include <mutex>
#include <unordered_set>

namespace te {
namespace {

std::mutex& CountersMutex() {
  static std::mutex m;
  return m;
}

std::map<std::string, std::unique_ptr<HandlerCounters>>& CountersMap() {
  static auto* m = new std::map<std::string, std::unique_ptr<HandlerCounters>>();
  return *m;
}

std::mutex& WarmMutex() {
  static std::mutex m;
  return m;
}

std::unordered_set<std::string>& WarmedKeys() {
  static auto* s = new std::unordered_set<std::string>();
  return *s;
}

}  // namespace

std::vector<Target>& AllTargets() {
  static auto* t = new std::vector<Target>();
  return *t;
}

HandlerCounters& Counters(const std::string& handler) {
  std::lock_guard<std::mutex> lock(CountersMutex());
  auto& slot = CountersMap()[handler];
  if (!slot) slot = std::make_unique<HandlerCounters>();
  return *slot;
}

std::map<std::string, std::map<std::string, int64_t>> CountersSnapshot() {
  std::lock_guard<std::mutex> lock(CountersMutex());
  std::map<std::string, std::map<std::string, int64_t>> out;
  for (auto& [name, c] : CountersMap()) {
    out[name] = {{"initialize_calls", c->initialize_calls.load()},
                 {"warmups", c->warmups.load()},
                 {"executes", c->executes.load()},
                 {"captured_executes", c->captured_executes.load()}};
  }
  return out;
}

void ResetCounters() {
  std::lock_guard<std::mutex> lock(CountersMutex());
  for (auto& [name, c] : CountersMap()) {
    c->initialize_calls = 0;
    c->warmups = 0;
    c->executes = 0;
    c->captured_executes = 0;
  }
}

void RecordExecute(HandlerCounters& c, cudaStream_t stream) {
  c.executes.fetch_add(1, std::memory_order_relaxed);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
      status == cudaStreamCaptureStatusActive) {
    c.captured_executes.fetch_add(1, std::memory_order_relaxed);
  }
}

ffi::Error WarmOnce(const std::string& handler, int device, const std::string& key,
                    const std::function<ffi::Error(cudaStream_t)>& launch) {
  HandlerCounters& c = Counters(handler);
  c.initialize_calls.fetch_add(1, std::memory_order_relaxed);
  std::string full_key = handler + "|" + std::to_string(device) + "|" + key;
  // Hold the lock across the warm-up: two threads warming the same key must not both capture, and
  // warm-ups are rare (once per key), so serialising them costs nothing in steady state.
  std::lock_guard<std::mutex> lock(WarmMutex());
  if (WarmedKeys().count(full_key)) return ffi::Error::Success();

  cudaStream_t side = nullptr;
  TE_CUDA_CHECK(handler, cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaError_t begin = cudaStreamBeginCapture(side, cudaStreamCaptureModeRelaxed);
  if (begin != cudaSuccess) {
    cudaStreamDestroy(side);
    return CudaError(handler, begin, "cudaStreamBeginCapture (warm-up)");
  }
  ffi::Error launch_err = launch(side);
  cudaGraph_t graph = nullptr;
  cudaError_t end = cudaStreamEndCapture(side, &graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaStreamDestroy(side);
  if (launch_err.failure()) return launch_err;
  if (end != cudaSuccess) return CudaError(handler, end, "cudaStreamEndCapture (warm-up)");
  // A failed launch inside a capture can leave a sticky launch error; surface it here.
  TE_CUDA_CHECK(handler, cudaGetLastError());
  WarmedKeys().insert(full_key);
  c.warmups.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

}  // namespace te
