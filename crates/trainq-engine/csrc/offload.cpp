// Activation offloading on a side stream: layer inputs go to pinned host memory while the
// forward goes on, and come back ahead of the backward walk. Only device-generic c10 interfaces
// are used (the stream pool, c10::Event, StreamGuard, record_stream), so neither CUDA headers
// nor cudart are needed here. Errors come back as a malloc'd string (trainq_free_message).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <cstdlib>
#include <map>
#include <mutex>

#include "guarded.h"

namespace {

// One copy stream per device for the whole process: copies in both directions queue on it in
// order, so a prefetch never overtakes the offload it reads.
c10::Stream side_stream(c10::Device device) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, c10::Stream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = streams.find(device.index());
  if (found != streams.end()) return found->second;
  auto stream = c10::impl::getDeviceGuardImpl(device.type())->getStreamFromGlobalPool(device);
  streams.emplace(device.index(), stream);
  return stream;
}

c10::Stream current_stream(c10::Device device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

}  // namespace

extern "C" {

// Starts copying `src` (CUDA) into a new pinned host tensor once the work queued so far on the
// current stream is done. The caching allocators keep `src` and the host block alive until the
// copy has run. Writes the host tensor to *out.
char* trainq_offload_to_host(const at::Tensor* src, at::Tensor** out) {
  return guarded([&] {
    auto device = src->device();
    auto side = side_stream(device);
    c10::Event produced(device.type());
    produced.record(current_stream(device));
    produced.block(side);
    auto host = at::empty(src->sizes(), src->options().device(at::kCPU).pinned_memory(true));
    {
      c10::StreamGuard guard(side);
      host.copy_(*src, /*non_blocking=*/true);
    }
    src->record_stream(side);
    *out = new at::Tensor(std::move(host));
  });
}

// Starts copying pinned `host` to CUDA device `index` on the side stream. Writes the device
// tensor to *out and an event to *ready: the current stream must wait for it
// (trainq_offload_wait) before using the tensor.
char* trainq_offload_prefetch(const at::Tensor* host, int64_t index, at::Tensor** out, void** ready) {
  return guarded([&] {
    c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
    auto side = side_stream(device);
    at::Tensor copy;
    {
      c10::StreamGuard guard(side);
      copy = at::empty(host->sizes(), host->options().device(device));
      copy.copy_(*host, /*non_blocking=*/true);
    }
    // Used on the current stream from now on: its memory is not reused before that use is done.
    copy.record_stream(current_stream(device));
    auto* event = new c10::Event(device.type());
    event->record(side);
    *out = new at::Tensor(std::move(copy));
    *ready = event;
  });
}

// Makes the current stream of device `index` wait for a prefetch's event, then frees it.
char* trainq_offload_wait(void* ready, int64_t index) {
  auto* event = static_cast<c10::Event*>(ready);
  auto* error = guarded([&] {
    c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
    event->block(current_stream(device));
  });
  delete event;
  return error;
}

// Copies CPU tensor `src` to CUDA device `index` on the current stream without waiting: through a
// pinned staging tensor from the caching host allocator, which keeps the block until the copy has
// run. (A copy from pageable memory waits for all the work already queued on the stream.) Writes
// the device tensor to *out.
char* trainq_upload(const at::Tensor* src, int64_t index, at::Tensor** out) {
  return guarded([&] {
    c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
    auto staged = at::empty(src->sizes(), src->options().pinned_memory(true));
    staged.copy_(*src);
    auto copy = at::empty(src->sizes(), src->options().device(device));
    copy.copy_(staged, /*non_blocking=*/true);
    *out = new at::Tensor(std::move(copy));
  });
}

// Frees an error message returned by any entry point of the shim.
void trainq_free_message(char* message) { free(message); }

// Frees a prefetch's event that nothing waited for.
void trainq_offload_forget(void* ready) { delete static_cast<c10::Event*>(ready); }

}  // extern "C"
