// Shared by the parts of the C++ host path (torch_ffn_host.cpp): the CUDA driver entry
// points Python hands over, and the few stream and tensor helpers every part uses.

#pragma once

#include <ATen/ATen.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using at::Tensor;

namespace {

// ---------------------------------------------------------------------------
// The CUDA driver entry points (addresses from Python's ctypes handle on libcuda)
// ---------------------------------------------------------------------------
using CUresult = int;
constexpr CUresult kNotReady = 600;   // CUDA_ERROR_NOT_READY: a query's "still running"
using LaunchFn = CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, void*, void**, void**);
using CoopLaunchFn = CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, unsigned, void*, void**);
using MemsetFn = CUresult (*)(uint64_t, unsigned char, size_t, void*);
using CopyToHostFn = CUresult (*)(void*, uint64_t, size_t, void*);
using CopyToDeviceFn = CUresult (*)(uint64_t, const void*, size_t, void*);
using ErrorNameFn = CUresult (*)(CUresult, const char**);
using IsCapturingFn = CUresult (*)(void*, int*);
using EventCreateFn = CUresult (*)(void**, unsigned);
using EventRecordFn = CUresult (*)(void*, void*);
using StreamWaitEventFn = CUresult (*)(void*, void*, unsigned);
using EventDestroyFn = CUresult (*)(void*);
using EventQueryFn = CUresult (*)(void*);

struct Driver {
  LaunchFn launch = nullptr;
  CoopLaunchFn launch_cooperative = nullptr;
  MemsetFn memset = nullptr;
  CopyToHostFn copy_to_host = nullptr;
  ErrorNameFn error_name = nullptr;
  IsCapturingFn is_capturing = nullptr;   // absent under host emulation
  // events and the host-to-device copy, for offloading (set_offload_driver)
  EventCreateFn event_create = nullptr;
  EventRecordFn event_record = nullptr;
  StreamWaitEventFn stream_wait_event = nullptr;
  EventDestroyFn event_destroy = nullptr;
  EventQueryFn event_query = nullptr;
  CopyToDeviceFn copy_to_device = nullptr;
};
Driver driver;
// Host tensors with a driver whose entry points run the reference codec on host memory
// (tests/test_torch_native.py): the whole path runs in CI, which has no GPU.
bool host_emulation = false;

void check(CUresult rc, const char* what) {
  if (rc == 0) return;
  const char* name = nullptr;
  if (driver.error_name) driver.error_name(rc, &name);
  TORCH_CHECK(false, "bitsparse: ", what, " failed: ", name ? name : std::to_string(rc));
}

void memset0(uint64_t ptr, int64_t nbytes, void* stream) {
  if (nbytes > 0) check(driver.memset(ptr, 0, static_cast<size_t>(nbytes), stream),
                        "cuMemsetD8Async");
}


void* current_stream(const c10::Device& device) {
  if (!device.is_cuda()) return nullptr;   // host emulation
  c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStream(device).native_handle();
}

uint64_t address(const Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

// An undefined tensor as "no tensor" (ATen reads a present optional's device).
std::optional<Tensor> maybe(const Tensor& t) {
  return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace
