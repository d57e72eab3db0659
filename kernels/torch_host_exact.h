// An exact pack's wait for its count and its shrink (exact_shrink, a function of the
// module torch_ffn_host.cpp makes), for a pack whose allocations come from PyTorch's
// caching allocator on torch's current stream: bitsparse_core/backends/cuda/shrink.py
// calls it in place of the Python steps (slots.wait, host.tail_shrink, the allocation
// and the copies) that the GPU waits for between the pack's kernel and the copies.

#pragma once

#include "torch_host_common.h"
#include "torch_host_slots.h"

#include <chrono>
#include <thread>

namespace {

using CopyDeviceFn = CUresult (*)(uint64_t, uint64_t, size_t, void*);
using StreamQueryFn = CUresult (*)(void*);

struct ExactDriver {
  CopyDeviceFn copy_device = nullptr;   // cuMemcpyDtoDAsync
  StreamQueryFn stream_query = nullptr;
  StreamQueryFn stream_sync = nullptr;
};
ExactDriver exact_driver;

// slots.wait's rule in C++, without the GIL: the slot's two fields once both have
// landed; a look at the stream every so often, so that a failed kernel raises instead of
// hanging, and after a couple of milliseconds a blocking synchronize.
constexpr int kLooksPerQuery = 64;
constexpr auto kSpinFor = std::chrono::microseconds(2000);

std::pair<uint32_t, uint64_t> wait_slot(int64_t slot, void* stream) {
  volatile uint32_t* status = slot_status_at(slot);
  volatile uint64_t* count = slot_count_at(slot);
  const auto deadline = std::chrono::steady_clock::now() + kSpinFor;
  int looks = 0;
  for (;;) {
    const uint32_t s = *status;
    const uint64_t n = *count;
    if (s != kSentinel32 && n != kSentinel64) {
      std::atomic_thread_fence(std::memory_order_acquire);
      return {s, n};
    }
    if (++looks % kLooksPerQuery) continue;
    CUresult rc;
    if (std::chrono::steady_clock::now() > deadline) {
      rc = exact_driver.stream_sync(stream);
    } else {
      rc = exact_driver.stream_query(stream);
      if (rc == kNotReady) {
        std::this_thread::yield();
        continue;
      }
    }
    check(rc, "the exact pack's stream");
    // the stream has run: the kernel wrote the slot, or never will
    const uint32_t s2 = *status;
    const uint64_t n2 = *count;
    TORCH_CHECK(s2 != kSentinel32 && n2 != kSentinel64,
                "bitsparse: the pack kernel finished without writing its count to the host slot");
    return {s2, n2};
  }
}

int64_t align_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

// (status, nnz, tail): the count of the pack queued on ``stream`` that writes ``slot``;
// unless its status carries ``refuse`` bits (a nosign violation: the caller packs again
// or raises), a new uint8 tensor of the exact tail's size on ``device`` (torch's current
// stream there is ``stream``) with the stored values (and signs) copied into it from the
// worst-case tail at ``src_tail``. The exact tail's layout is host.tail_terms' arithmetic:
// values ceil(nnz * value_bits / 8) bytes at 0, signs ceil(nnz * sign_bits / 8) at the
// values' end rounded up to ``align``, from ``src_signs`` in the worst-case tail.
py::tuple exact_shrink(int64_t slot, uint64_t stream_handle, c10::Device dev, uint64_t src_tail,
                       int64_t capacity, int64_t value_bits, int64_t sign_bits, int64_t align,
                       int64_t src_signs, int64_t refuse) {
  TORCH_CHECK(exact_driver.copy_device && exact_driver.stream_query && exact_driver.stream_sync,
              "bitsparse: exact_shrink before set_exact_driver");
  void* stream = reinterpret_cast<void*>(stream_handle);
  uint32_t status;
  uint64_t nnz;
  Tensor tail;
  {
    py::gil_scoped_release no_gil;
    std::tie(status, nnz) = wait_slot(slot, stream);
    if ((status & static_cast<uint32_t>(refuse)) == 0) {
      TORCH_CHECK(nnz <= static_cast<uint64_t>(capacity), "bitsparse: exact_shrink: count ", nnz,
                  " outside the plan's capacity ", capacity);
      const int64_t n = static_cast<int64_t>(nnz);
      const int64_t values = (n * value_bits + 7) / 8;
      const int64_t signs = (n * sign_bits + 7) / 8;
      const int64_t signs_at = align_up(values, align);
      c10::DeviceGuard guard(dev);
      tail = at::empty({signs_at + align_up(signs, align)},
                       at::TensorOptions().dtype(at::kByte).device(dev));
      const uint64_t dst = reinterpret_cast<uint64_t>(tail.data_ptr());
      if (values) {
        check(exact_driver.copy_device(dst, src_tail, static_cast<size_t>(values), stream),
              "cuMemcpyDtoDAsync");
      }
      if (signs) {
        check(exact_driver.copy_device(dst + signs_at, src_tail + src_signs,
                                       static_cast<size_t>(signs), stream),
              "cuMemcpyDtoDAsync");
      }
    }
  }
  return py::make_tuple(status, nnz, tail.defined() ? py::cast(tail) : py::none());
}

}  // namespace
