// Per-handler counters and the warm-once helper used by every graph-warmed handler.
//
// XLA calls a handler's initialize stage before EVERY execution (measured on jax 0.11.2), so the
// warm-up must happen once per (device, handler, shape/config key) and be a cheap no-op afterwards.
// Warming runs the execute path once inside a throwaway relaxed-mode stream capture on a private
// stream: nothing executes, but lazy state (module loading, function attributes, library plans)
// is created before XLA records a CUDA graph around the real execution.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "common/ffi_util.h"

namespace te {

struct HandlerCounters {
  std::atomic<int64_t> initialize_calls{0};  // initialize stage entered
  std::atomic<int64_t> warmups{0};           // throwaway captures actually performed (once per key)
  std::atomic<int64_t> executes{0};          // execute stage entered (graph replays do not enter)
  std::atomic<int64_t> captured_executes{0}; // execute stage entered while its stream was capturing
};

// Counters for a handler name (created on first use; the reference stays valid forever).
HandlerCounters& Counters(const std::string& handler);

// Snapshot of all counters: handler -> {counter name -> value}.
std::map<std::string, std::map<std::string, int64_t>> CountersSnapshot();
void ResetCounters();

// Runs launch(stream) once per (device, handler, key) inside a relaxed-mode capture on a private
// stream, then discards the graph. Thread-safe; later calls with the same key only look up a set.
ffi::Error WarmOnce(const std::string& handler, int device, const std::string& key,
                    const std::function<ffi::Error(cudaStream_t)>& launch);

// Records an execute-stage call; counts it as captured when `stream` is being captured.
void RecordExecute(HandlerCounters& c, cudaStream_t stream);

// The stage tail every graph-warmed handler shares. Initialize: WarmOnce(handler, device, key(),
// launch); the key (a string) is built in this stage only, since XLA enters it before every execution
// and the execute stage needs none. Execute: RecordExecute, then launch(stream) on XLA's stream.
template <ffi::ExecutionStage kStage, typename KeyFn, typename Launch>
ffi::Error WarmOrExecute(const std::string& handler, cudaStream_t stream, int device, KeyFn&& key, Launch&& launch) {
  if constexpr (kStage == ffi::ExecutionStage::kInitialize) {
    return WarmOnce(handler, device, key(), launch);
  } else {
    RecordExecute(Counters(handler), stream);
    return launch(stream);
  }
}

}  // namespace te
