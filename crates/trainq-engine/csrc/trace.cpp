// A C entry point to libtorch's Kineto profiler (tch binds none): the CUDA kernels (or, on the
// CPU, the operators) of the work between start and stop, with their start times and durations,
// saved as a Chrome trace.
// `trainq bench train --trace` records one step with it; ops/bench/trace_summary.py reads the
// file (GPU time by kernel family, and how much of the step the GPU sat idle). Errors come back
// as a malloc'd string (trainq_free_message, in offload.cpp).
#include <torch/csrc/autograd/profiler_kineto.h>
#include <set>
#include <string>

#include "guarded.h"

namespace {

using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

ProfilerConfig config() { return ProfilerConfig(ProfilerState::KINETO); }

// CUDA kernels alone on a GPU (the summary reads only those, and the trace stays small), plus
// the CPU operators that launched them when `ops` (the summary then attributes kernels to
// operators; recording them slows the host, so launch gaps read longer); operators on the CPU.
std::set<ActivityType> activities(bool cuda, bool ops) {
  if (cuda && ops) return {ActivityType::CUDA, ActivityType::CPU};
  if (cuda) return {ActivityType::CUDA};
  return {ActivityType::CPU};
}

}  // namespace

extern "C" {

// Starts recording CUDA kernels when `cuda` is non-zero (with the CPU operators too when `ops`
// is non-zero), else CPU operators.
char* trainq_trace_start(int cuda, int ops) {
  return guarded([&] {
    auto which = activities(cuda != 0, ops != 0);
    torch::autograd::profiler::prepareProfiler(config(), which);
    torch::autograd::profiler::enableProfiler(config(), which);
  });
}

// Stops recording and writes the Chrome trace (JSON) to `path`.
char* trainq_trace_stop(const char* path) {
  return guarded([&] { torch::autograd::profiler::disableProfiler()->save(std::string(path)); });
}

}  // extern "C"
