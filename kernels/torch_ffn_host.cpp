// The CUDA host path of bitsparse's packed ReLU / ReLU² FFN op, in C++.
//
// bitsparse_core/torch/native.py builds this file as a PyTorch C++ extension (no
// CUDA headers or nvcc needed: the kernels are CuPy's, launched through the
// driver entry points Python hands over) and uses it for CUDA tensors. The op's
// semantics are those of bitsparse::relu_linear and
// bitsparse::relu_linear_backward (bitsparse_core/torch/ops.py): the same ATen
// calls in the same order, so the two paths give the same bits. What moves here
// is only the host work: the forward's pack launch and the whole backward run
// as a C++ autograd node in eager mode, and as the dispatcher's CUDA kernels of the two
// ops (registered from here: compiled graphs, CUDA graph captures, torch.ops calls)
// elsewhere. A pack takes its pinned slot from this file's ring and queues its ticket
// for the capacity policy, which drains the queue when it polls; the backward reads the
// pack's count from the slot itself and calls into Python (the policy) only when the
// pack is not known clean there, or every few backwards for the policy's poll.
//
// Launches are templates Python builds once per (plan, device) from the
// argument records of bitsparse_core/backends/cuda/abi.py: the record's bytes
// with the plan's fields set, the offset of every field (the kernel's
// parameter list), the fields that hold an offset into the packed block, and
// the pointer fields a call fills. C++ never restates the kernel ABI.

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
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// ---------------------------------------------------------------------------
// The CUDA driver entry points (addresses from Python's ctypes handle on libcuda)
// ---------------------------------------------------------------------------
using CUresult = int;
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

// ---------------------------------------------------------------------------
// Launch templates
// ---------------------------------------------------------------------------
// The pointers a call supplies (ROLE_NAMES in native.py lists them in this order).
enum Role { R_X, R_Y, R_SCRATCH, R_G, R_OUT, R_OUT2, R_SLOT, N_ROLES };
using Roles = std::array<uint64_t, N_ROLES>;

struct Patch {
  int role;
  int32_t offset;        // the pointer field
  int32_t align_offset;  // its int32 "16-byte aligned" flag, or -1
  bool null_unaligned;   // a null pointer reads as unaligned (the pack's optional y)
};

constexpr size_t kMaxParamBytes = 512;
constexpr size_t kMaxParams = 64;

struct Launch {
  uint64_t func = 0;
  unsigned grid = 0, threads = 0, smem = 0;
  bool cooperative = false;
  std::vector<uint8_t> params;        // the record with the plan's fields set
  std::vector<uint32_t> fields;       // offset of each kernel parameter in params
  std::vector<uint32_t> block_fields; // u64 fields holding an offset into the block
  std::vector<Patch> patches;

  bool present() const { return func != 0; }

  // The parameter bytes of a call (also what the CPU tests compare with Python's record).
  void fill(uint8_t* buf, uint64_t block, const Roles& roles) const {
    std::memcpy(buf, params.data(), params.size());
    for (uint32_t off : block_fields) {
      uint64_t v;
      std::memcpy(&v, buf + off, 8);
      v += block;
      std::memcpy(buf + off, &v, 8);
    }
    for (const Patch& p : patches) {
      const uint64_t v = roles[p.role];
      std::memcpy(buf + p.offset, &v, 8);
      if (p.align_offset >= 0) {
        const int32_t aligned = (v % 16 == 0) && !(p.null_unaligned && v == 0);
        std::memcpy(buf + p.align_offset, &aligned, 4);
      }
    }
  }

  void run(void* stream, uint64_t block, const Roles& roles) const {
    if (grid == 0) return;
    alignas(16) uint8_t buf[kMaxParamBytes];
    fill(buf, block, roles);
    void* args[kMaxParams];
    for (size_t i = 0; i < fields.size(); ++i) args[i] = buf + fields[i];
    if (cooperative) {
      check(driver.launch_cooperative(reinterpret_cast<void*>(func), grid, 1, 1, threads, 1, 1,
                                      smem, stream, args),
            "cuLaunchCooperativeKernel");
    } else {
      check(driver.launch(reinterpret_cast<void*>(func), grid, 1, 1, threads, 1, 1, smem, stream,
                          args, nullptr),
            "cuLaunchKernel");
    }
  }
};

Launch make_launch(const py::tuple& t) {
  // (func, grid, threads, smem, cooperative, params, fields, block_fields, patches)
  TORCH_CHECK(t.size() == 9, "bitsparse: a launch template has 9 entries");
  Launch L;
  L.func = t[0].cast<uint64_t>();
  L.grid = t[1].cast<unsigned>();
  L.threads = t[2].cast<unsigned>();
  L.smem = t[3].cast<unsigned>();
  L.cooperative = t[4].cast<bool>();
  const std::string params = t[5].cast<std::string>();
  L.params.assign(params.begin(), params.end());
  L.fields = t[6].cast<std::vector<uint32_t>>();
  L.block_fields = t[7].cast<std::vector<uint32_t>>();
  for (const auto& p : t[8].cast<std::vector<std::tuple<int, int32_t, int32_t, bool>>>()) {
    TORCH_CHECK(std::get<0>(p) >= 0 && std::get<0>(p) < N_ROLES, "bitsparse: unknown role");
    L.patches.push_back({std::get<0>(p), std::get<1>(p), std::get<2>(p), std::get<3>(p)});
  }
  TORCH_CHECK(L.params.size() <= kMaxParamBytes && L.fields.size() <= kMaxParams,
              "bitsparse: argument record too large");
  const auto inside = [&](int64_t off, int64_t n) {
    return off >= 0 && off + n <= static_cast<int64_t>(L.params.size());
  };
  for (uint32_t f : L.fields) TORCH_CHECK(inside(f, 1), "bitsparse: field outside the record");
  for (uint32_t f : L.block_fields) {
    TORCH_CHECK(inside(f, 8), "bitsparse: field outside the record");
  }
  for (const Patch& p : L.patches) {
    TORCH_CHECK(inside(p.offset, 8) && (p.align_offset < 0 || inside(p.align_offset, 4)),
                "bitsparse: field outside the record");
  }
  return L;
}

// ---------------------------------------------------------------------------
// Plans: one pack plan's block layout and launches on one device
// ---------------------------------------------------------------------------
struct Plan {
  int64_t numel = 0, nbytes = 0, scratch_bytes = 0, status_offset = 0;
  Launch pack, unpack, relu2, relu2_and_square, mask_select;
};

// Handles index a fixed table, so a backward reads its plan without a lock while
// another thread registers one; plans live as long as the process.
constexpr int64_t kMaxPlans = 1 << 16;
std::unique_ptr<std::atomic<Plan*>[]> plans(new std::atomic<Plan*>[kMaxPlans]());
std::atomic<int64_t> n_plans{0};
std::mutex register_mutex;

const Plan& plan_at(int64_t handle) {
  TORCH_CHECK(handle >= 0 && handle < n_plans.load(), "bitsparse: unknown plan handle ", handle);
  return *plans[handle].load();
}

int64_t add_plan(int64_t numel, int64_t nbytes, int64_t scratch_bytes, int64_t status_offset,
                 const py::dict& launches) {
  auto plan = std::make_unique<Plan>();
  plan->numel = numel;
  plan->nbytes = nbytes;
  plan->scratch_bytes = scratch_bytes;
  plan->status_offset = status_offset;
  const std::pair<const char*, Launch*> slots[] = {
      {"pack", &plan->pack}, {"unpack", &plan->unpack}, {"relu2", &plan->relu2},
      {"relu2_and_square", &plan->relu2_and_square}, {"mask_select", &plan->mask_select}};
  for (const auto& item : launches) {
    const std::string name = item.first.cast<std::string>();
    bool known = false;
    for (const auto& s : slots) {
      if (name == s.first) {
        *s.second = make_launch(item.second.cast<py::tuple>());
        known = true;
      }
    }
    TORCH_CHECK(known, "bitsparse: unknown launch '", name, "'");
  }
  std::lock_guard<std::mutex> lock(register_mutex);
  const int64_t h = n_plans.load();
  if (h >= kMaxPlans) return -1;   // full: the caller takes the Python path
  plans[h].store(plan.release());
  n_plans.store(h + 1);
  return h;
}

// ---------------------------------------------------------------------------
// Is the pack clean? Read here from its pinned slot, or asked of Python's policy
// ---------------------------------------------------------------------------
py::object* clean_state_fn = nullptr;   // never freed: called until the process ends

constexpr uint64_t kSentinel64 = ~0ull;            // capacity.SENTINEL64 (a count not landed)
// Every this many backwards of one policy go to Python even when the slot shows the pack
// clean: the policy's poll there takes in the counts and moves the capacity.
constexpr int64_t kPollEvery = 8;
std::mutex poll_mutex;
std::unordered_map<int64_t, int64_t> backwards_of_policy;

bool poll_due(int64_t policy) {
  std::lock_guard<std::mutex> lock(poll_mutex);
  return backwards_of_policy[policy]++ % kPollEvery == 0;
}

// The pinned slab of capacity.SLAB (set_slab): slot i is 16 bytes at base + 16 i, its
// generation (capacity.FlagSlab._gen) the i-th int64 at ``generations``. A pack's ticket
// [i, generation] names its slot. Slots [ring_begin, slots) are this file's ring (Python
// takes the ones below).
constexpr uint32_t kSentinel32 = 0xFFFFFFFFu;      // capacity.SENTINEL (a status not landed)
constexpr int64_t kNoSlot = -1;                    // capacity.NO_SLOT
struct Slab {
  int64_t base = 0, generations = 0, slots = 0, ring_begin = 0, next = 0;
  std::mutex mutex;
};
Slab slab;

volatile uint32_t* slot_status_at(int64_t address) {
  return reinterpret_cast<volatile uint32_t*>(address);
}
volatile uint64_t* slot_count_at(int64_t address) {
  return reinterpret_cast<volatile uint64_t*>(address + 8);
}
volatile uint32_t* slot_status(int64_t i) { return slot_status_at(slab.base + 16 * i); }
volatile uint64_t* slot_count(int64_t i) { return slot_count_at(slab.base + 16 * i); }
volatile int64_t* slot_generation(int64_t i) {
  return reinterpret_cast<volatile int64_t*>(slab.generations) + i;
}

// A ticket: a CPU int64 tensor [slot, generation] of its own (what the ops' fake kernels
// describe), as capacity.FlagSlab makes them.
Tensor new_ticket(int64_t slot, int64_t generation) {
  Tensor t = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  int64_t* p = t.data_ptr<int64_t>();
  p[0] = slot;
  p[1] = generation;
  return t;
}

bool capturing(void* stream) {
  int status = 0;   // CU_STREAM_CAPTURE_STATUS_NONE
  if (stream != nullptr && driver.is_capturing != nullptr) {
    check(driver.is_capturing(stream, &status), "cuStreamIsCapturing");
  }
  return status != 0;
}

// The next free slot of the ring (FlagSlab.acquire's rule: a slot whose copy has not
// landed is skipped), its sentinels written before the pack's copy is queued; a NO_SLOT
// ticket while ``stream`` is captured into a CUDA graph (a count cannot be read without
// a sync there) or with every slot in flight. The generation is bumped first: a reader
// of the slot's previous ticket then sees a stale generation, never the new sentinels
// as the old pack's state.
Tensor claim_ticket(void* stream) {
  if (slab.base == 0 || slab.slots <= slab.ring_begin || capturing(stream)) {
    return new_ticket(kNoSlot, 0);
  }
  std::lock_guard<std::mutex> lock(slab.mutex);
  for (int64_t k = slab.ring_begin; k < slab.slots; ++k) {
    const int64_t i = slab.next;
    slab.next = i + 1 == slab.slots ? slab.ring_begin : i + 1;
    if (*slot_status(i) == kSentinel32) continue;
    const int64_t generation = *slot_generation(i) + 1;
    *slot_generation(i) = generation;
    *slot_status(i) = kSentinel32;
    *slot_count(i) = kSentinel64;
    return new_ticket(i, generation);
  }
  return new_ticket(kNoSlot, 0);
}

// The host address of a ticket's slot, 0 for a pack without one (a NO_SLOT ticket, taken
// during a graph capture or with every slot in flight).
int64_t slot_of(const Tensor& ticket) {
  const int64_t i = ticket.data_ptr<int64_t>()[0];
  return (slab.base && i >= 0 && i < slab.slots) ? slab.base + 16 * i : 0;
}

// The slot's {u32 status, u32 pad, u64 nnz} once its copy has landed, when the slot still
// belongs to this pack (its generation): FlagSlab.read's rule.
bool slot_shows_clean(const Tensor& ticket) {
  if (slot_of(ticket) == 0 || slab.generations == 0) return false;
  const int64_t* t = ticket.data_ptr<int64_t>();
  const uint32_t s = *slot_status(t[0]);
  const uint64_t n = *slot_count(t[0]);
  // status 0: landed (the sentinel is all ones) and clean
  return *slot_generation(t[0]) == t[1] && s == 0 && n != kSentinel64;
}

// Packs tracked for their capacity policy (CapacityPolicy.track's records, made here
// without Python): capacity.drain_native_tracks takes them when a policy polls. Bounded
// like the policy's own queue; the pack counts are kept apart, so none is lost.
struct Tracked {
  int64_t policy, slot, generation, numel, capacity;
};
constexpr size_t kMaxTracked = 1 << 16;
std::mutex track_mutex;
std::deque<Tracked> tracked;
std::map<int64_t, int64_t> packs_of_policy;

void track(int64_t policy, const Tensor& ticket, int64_t numel, int64_t capacity) {
  if (policy <= 0) return;   // policy ids start at 1
  const int64_t* t = ticket.data_ptr<int64_t>();
  std::lock_guard<std::mutex> lock(track_mutex);
  ++packs_of_policy[policy];
  if (t[0] < 0) return;      // no slot: nothing will come back
  if (tracked.size() == kMaxTracked) tracked.pop_front();
  tracked.push_back({policy, t[0], t[1], numel, capacity});
}

py::tuple drain_tracks() {
  std::deque<Tracked> records;
  std::map<int64_t, int64_t> packs;
  {
    std::lock_guard<std::mutex> lock(track_mutex);
    records.swap(tracked);
    packs.swap(packs_of_policy);
  }
  py::list out;
  for (const Tracked& r : records) {
    out.append(py::make_tuple(r.policy, r.slot, r.generation, r.numel, r.capacity));
  }
  return py::make_tuple(out, packs);
}

bool pack_is_clean(int64_t handle, int64_t policy, const Tensor& ticket, const Tensor& block,
                   bool recompute_source) {
  py::gil_scoped_acquire gil;
  TORCH_CHECK(clean_state_fn != nullptr, "bitsparse: native module used before set_state_fn");
  return (*clean_state_fn)(handle, policy, ticket, block, recompute_source).cast<bool>();
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

// PyTorch's linear backward on the 2-D views (ops.py: _linear_weight_grad / _input_grad).
Tensor weight_grad(const Tensor& g2, const Tensor& h, int64_t mm_dtype) {
  const Tensor hm = mm_dtype >= 0 ? h.to(static_cast<at::ScalarType>(mm_dtype)) : h;
  return g2.t().mm(hm.reshape({-1, hm.size(-1)}));
}

Tensor input_grad(const Tensor& g2, const Tensor& weight, at::IntArrayRef a_shape,
                  at::ScalarType a_dtype) {
  Tensor grad_h = g2.mm(weight).view(a_shape);
  return grad_h.scalar_type() == a_dtype ? grad_h : grad_h.to(a_dtype);
}

// ---------------------------------------------------------------------------
// Offloading: packed blocks in pinned host memory between forward and backward
// ---------------------------------------------------------------------------
// bitsparse_core/torch/offload.py documents the behaviour (its Offloader is this engine's
// Python face); here is the whole mechanism, so that a stash or a take costs no Python.
// Streams are ordered by events, never by the host. Events are the driver's, as
// backends/cuda/driver.py makes them (CU_EVENT_DISABLE_TIMING).
constexpr CUresult kNotReady = 600;   // CUDA_ERROR_NOT_READY

void* record_event(void* stream) {
  TORCH_CHECK(driver.event_create != nullptr, "bitsparse: native module used before "
              "set_offload_driver");
  void* event = nullptr;
  check(driver.event_create(&event, 2), "cuEventCreate");
  const CUresult rc = driver.event_record(event, stream);
  if (rc != 0) driver.event_destroy(event);
  check(rc, "cuEventRecord");
  return event;
}

// ``consumer`` waits for ``event``, which is then released (the driver keeps it until
// the wait is satisfied).
void wait_event(void* consumer, void* event) {
  const CUresult rc = driver.stream_wait_event(consumer, event, 0);
  driver.event_destroy(event);
  check(rc, "cuStreamWaitEvent");
}

// ``side`` runs what is queued next after the work queued so far on ``device``'s
// current stream.
void follow_current(void* side, const c10::Device& device) {
  wait_event(side, record_event(current_stream(device)));
}

// The pinned buffer is in use by ``side`` until the work queued there so far has run:
// torch's pinned allocator must not hand its memory out again before (as copy_ tells it).
void note_host_use(const Tensor& host, const c10::Stream& side) {
  at::getHostAllocator(side.device_type())
      ->record_event(host.storage().mutable_data(), host.storage().data_ptr().get_context(),
                     side);
}

// The buffer size that serves ``nbytes``: the next power of two, at least 4 KiB (torch's
// caching host allocator rounds pinned allocations so anyway).
int64_t size_class(int64_t nbytes) {
  int64_t c = 4096;
  while (c < nbytes) c <<= 1;
  return c;
}

// Host buffers by size class, pinned where CUDA is, reused; at most ``max_bytes`` held (-1:
// no bound). A buffer comes back with the ``lane`` its last copy ran on (one device's
// side stream, -1 for the CPU) and goes out again only for that lane: copies on one
// stream run in order, copies on two do not.
struct PinnedPool {
  const int64_t max_bytes;
  int64_t held = 0;   // bytes allocated, free or in use
  std::map<std::pair<int64_t, int64_t>, std::vector<Tensor>> free;   // (lane, bytes)
  std::mutex mutex;

  explicit PinnedPool(int64_t max) : max_bytes(max) {
    TORCH_CHECK_VALUE(max >= -1, "max_bytes=", max, " must be >= 0 or None (no bound)");
  }

  // A buffer of at least ``nbytes`` free for ``lane``, undefined when the bound leaves
  // no room for one.
  Tensor take(int64_t nbytes, int64_t lane) {
    const int64_t size = size_class(nbytes);
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto it = free.find({lane, size});
      if (it != free.end() && !it->second.empty()) {
        Tensor buf = std::move(it->second.back());
        it->second.pop_back();
        return buf;
      }
      if (max_bytes >= 0 && held + size > max_bytes) {
        evict(held + size - max_bytes);
        if (held + size > max_bytes) return Tensor();
      }
      held += size;
    }
    return at::empty({size}, at::TensorOptions().dtype(at::kByte).pinned_memory(at::hasCUDA()));
  }

  void give(Tensor buf, int64_t lane) {
    std::lock_guard<std::mutex> lock(mutex);
    free[{lane, buf.numel()}].push_back(std::move(buf));
  }

  int64_t free_bytes() {
    std::lock_guard<std::mutex> lock(mutex);
    int64_t n = 0;
    for (const auto& item : free) n += item.first.second * static_cast<int64_t>(item.second.size());
    return n;
  }

 private:
  // Drop free buffers, largest first, until ``need`` bytes are gone (back to torch's
  // pinned-memory cache). Called with the lock held.
  void evict(int64_t need) {
    std::vector<std::pair<int64_t, int64_t>> keys;   // (lane, bytes), largest bytes first
    for (const auto& item : free) keys.push_back(item.first);
    std::stable_sort(keys.begin(), keys.end(),
                     [](const auto& a, const auto& b) { return a.second > b.second; });
    for (const auto& key : keys) {
      auto& bufs = free[key];
      while (!bufs.empty() && need > 0) {
        bufs.pop_back();
        held -= key.second;
        need -= key.second;
      }
      if (need <= 0) break;
    }
  }
};

struct OffloadEngine;

// One packed block between its forward and its backward: its pinned copy (``host``), on
// its way back or back (``back``, readable after ``ready``), or kept on the device
// (``back`` alone: the pool was full). ``block`` is the device block held while its copy
// out may still run (until ``out_done``).
struct Stash {
  std::shared_ptr<OffloadEngine> engine;
  c10::Device device;
  int64_t nbytes;
  Tensor host, back, block;
  void* ready = nullptr;        // the copy back's event
  void* fetched_on = nullptr;   // the stream ``back`` was allocated on
  uint64_t out_done = 0;        // the copy out's event (a token under emulated copies)
  bool taken = false;

  Stash(std::shared_ptr<OffloadEngine> e, c10::Device d, int64_t n)
      : engine(std::move(e)), device(d), nbytes(n) {}
  ~Stash();

  // For tests and reports: where the block is now.
  std::string state() const {
    if (taken) return "taken";
    if (block.defined()) return "held";
    if (back.defined()) return host.defined() ? "fetched" : "kept";
    return "on_host";
  }
};

struct OffloadStats {
  int64_t offloaded = 0, kept_on_device = 0, prefetched = 0, late = 0, taken_on_device = 0,
          bytes_offloaded = 0;
};

constexpr size_t kPruneMin = 256;   // stash entries before dead ones are dropped

// See offload.py's Offloader: one engine serves every layer of a model, which stashes
// blocks in forward order and takes them back in the reverse order.
struct OffloadEngine : std::enable_shared_from_this<OffloadEngine> {
  const int64_t ahead, hold;
  const std::shared_ptr<PinnedPool> pool;
  // recursive: a Stash whose last owner goes inside a locked section locks it again
  std::recursive_mutex mutex;
  std::vector<std::weak_ptr<Stash>> stashed;   // in stash order
  size_t prune_at = kPruneMin;
  std::deque<std::weak_ptr<Stash>> held;       // stashes holding their device block
  std::map<int, c10::Stream> sides;
  OffloadStats stats;
  // Tests on the CPU, where a copy is done on return: emulated copies end when the test
  // says (in order, as copies on one stream do); their tokens, once released, are noted.
  bool emulate_copies = false;
  uint64_t tokens = 0, done_upto = 0;
  std::vector<uint64_t> released;

  OffloadEngine(int64_t ahead_, int64_t max_bytes, int64_t hold_)
      : ahead(ahead_), hold(hold_), pool(std::make_shared<PinnedPool>(max_bytes)) {
    TORCH_CHECK_VALUE(ahead >= 0, "ahead=", ahead, " must be >= 0");
    TORCH_CHECK_VALUE(hold >= 0, "hold=", hold, " must be >= 0");
  }

  // The side stream of CUDA device ``index``: both directions' copies and the packs'
  // counts of offloaded blocks run there.
  c10::Stream side(int index) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    auto it = sides.find(index);
    if (it == sides.end()) {
      c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
      it = sides.emplace(index, impl.getStreamFromGlobalPool(
                                    c10::Device(c10::DeviceType::CUDA, index))).first;
    }
    return it->second;
  }
  void* side_raw(int index) { return reinterpret_cast<void*>(side(index).native_handle()); }

  static int64_t lane(const c10::Device& d) { return d.is_cuda() ? d.index() : -1; }
  // Blocks on the host under the tests' host emulation go through the driver's copy (its
  // emulation sees them move); plain CPU blocks are copied by ATen.
  static bool emulated_device(const Tensor& t) { return !t.is_cuda() && host_emulation; }

  // ``block`` into ``host``, after the work queued so far on the current stream (its
  // pack); the event after the copy, 0 where it is done on return.
  uint64_t copy_out(const Tensor& block, const Tensor& host) {
    const int64_t n = block.numel();
    if (!block.is_cuda()) {
      if (emulated_device(block)) {
        check(driver.copy_to_host(host.data_ptr(), address(block), n, nullptr), "copy");
      } else {
        host.narrow(0, 0, n).copy_(block);
      }
      return emulate_copies ? ++tokens : 0;
    }
    const int dev = block.device().index();
    const c10::Stream stream = side(dev);
    void* s = reinterpret_cast<void*>(stream.native_handle());
    follow_current(s, block.device());
    check(driver.copy_to_host(host.data_ptr(), address(block), n, s), "cuMemcpyDtoHAsync");
    note_host_use(host, stream);
    return reinterpret_cast<uint64_t>(record_event(s));
  }

  bool copied(const Stash& h) {
    if (h.device.is_cuda()) {
      const CUresult rc = driver.event_query(reinterpret_cast<void*>(h.out_done));
      if (rc == kNotReady) return false;
      check(rc, "cuEventQuery");
      return true;
    }
    return h.out_done <= done_upto;
  }

  void forget(const c10::Device& device, uint64_t event) {
    if (event == 0) return;
    if (device.is_cuda()) {
      driver.event_destroy(reinterpret_cast<void*>(event));
    } else {
      std::lock_guard<std::recursive_mutex> lock(mutex);
      released.push_back(event);
    }
  }

  // Let ``h``'s device block go (once); where its copy out may still run, the caching
  // allocator is told to wait for the side stream first.
  void drop_block(Stash& h, bool was_copied) {
    Tensor block;
    uint64_t event;
    {
      std::lock_guard<std::recursive_mutex> lock(mutex);
      block = std::move(h.block);
      h.block = Tensor();
      event = h.out_done;
      h.out_done = 0;
    }
    if (!block.defined()) return;
    if (!was_copied && block.is_cuda()) block.record_stream(side(block.device().index()));
    forget(h.device, event);
  }

  // Release the held blocks whose copy out has run (in stash order: copies on one stream
  // run in order, so the first still running ends the search).
  void release_copied() {
    while (true) {
      std::shared_ptr<Stash> h;
      {
        std::lock_guard<std::recursive_mutex> lock(mutex);
        if (held.empty()) return;
        h = held.front().lock();
        if (h && h->block.defined() && !copied(*h)) return;
        held.pop_front();
      }
      if (h && h->block.defined()) drop_block(*h, true);
    }
  }

  void track(const std::shared_ptr<Stash>& h) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    if (stashed.size() >= prune_at) {   // forwards whose backward never came
      std::vector<std::weak_ptr<Stash>> live;
      for (auto& w : stashed) {
        if (!w.expired()) live.push_back(std::move(w));
      }
      stashed.swap(live);
      prune_at = std::max(kPruneMin, 2 * stashed.size());
    }
    stashed.push_back(h);
  }

  // Queue ``block``'s copy out; the caller then drops ``block``.
  std::shared_ptr<Stash> stash(const Tensor& block) {
    TORCH_CHECK(block.is_contiguous() && block.scalar_type() == at::kByte && block.dim() == 1,
                "bitsparse: an offloaded block is a contiguous 1-D uint8 tensor");
    c10::DeviceGuard device_guard(block.device());   // events belong to the current device
    release_copied();
    auto h = std::make_shared<Stash>(shared_from_this(), block.device(), block.numel());
    Tensor host = pool->take(h->nbytes, lane(block.device()));
    if (!host.defined()) {   // no room in the pool: it stays on the device
      h->back = block;
      {
        std::lock_guard<std::recursive_mutex> lock(mutex);
        ++stats.kept_on_device;
      }
      track(h);
      return h;
    }
    const uint64_t done = copy_out(block, host);
    h->host = std::move(host);
    track(h);
    std::vector<std::shared_ptr<Stash>> early;
    {
      std::lock_guard<std::recursive_mutex> lock(mutex);
      ++stats.offloaded;
      stats.bytes_offloaded += h->nbytes;
      if (done) {
        h->block = block;
        h->out_done = done;
        held.push_back(h);
        while (static_cast<int64_t>(held.size()) > hold) {
          if (auto s = held.front().lock()) early.push_back(std::move(s));
          held.pop_front();
        }
      }
    }
    for (auto& s : early) drop_block(*s, false);
    return h;
  }

  // Queue ``h``'s copy back (not when it is back, on its way, kept, or holds its block).
  void fetch(Stash& h) {
    if (h.back.defined() || !h.host.defined() || h.block.defined()) return;
    if (!h.device.is_cuda()) {
      Tensor back = at::empty({h.nbytes}, at::TensorOptions().dtype(at::kByte));
      if (host_emulation) {
        check(driver.copy_to_host(back.data_ptr(), address(h.host), h.nbytes, nullptr), "copy");
      } else {
        back.copy_(h.host.narrow(0, 0, h.nbytes));
      }
      h.back = back;
      return;
    }
    TORCH_CHECK(driver.copy_to_device != nullptr, "bitsparse: native module used before "
                "set_offload_driver");
    // ``back`` comes from the compute stream's memory: the side stream writes it after
    // the work queued there so far, the compute stream waits on ``ready`` before it reads
    // it (and should the stash go before its backward, ~Stash keeps the allocator from
    // reusing it under the copy)
    const int dev = h.device.index();
    const c10::Stream stream = side(dev);
    void* s = reinterpret_cast<void*>(stream.native_handle());
    Tensor back = at::empty({h.nbytes}, at::TensorOptions().dtype(at::kByte).device(h.device));
    h.fetched_on = current_stream(h.device);
    follow_current(s, h.device);
    check(driver.copy_to_device(address(back), h.host.data_ptr(), static_cast<size_t>(h.nbytes),
                                s),
          "cuMemcpyHtoDAsync");
    note_host_use(h.host, stream);
    h.ready = record_event(s);
    h.back = back;
  }

  // The block on its device, ordered before what the current stream runs next; the
  // blocks of the next ``ahead`` layers to run backward start on their way back.
  Tensor take(const std::shared_ptr<Stash>& h) {
    TORCH_CHECK(!h->taken, "an offloaded packed block is taken back by one backward only: a "
                "second backward through it (retain_graph=True) needs offload=None");
    h->taken = true;
    c10::DeviceGuard device_guard(h->device);   // events belong to the current device
    const bool on_device = h->block.defined();
    if (on_device) {   // its copy out was not seen to finish: used as it is
      h->back = h->block;
      drop_block(*h, false);
    }
    const bool late = !h->back.defined() && h->host.defined();
    fetch(*h);
    std::vector<std::shared_ptr<Stash>> next;
    {
      std::lock_guard<std::recursive_mutex> lock(mutex);
      // backward takes blocks in the reverse of stash order: ``h`` is (nearly) the last
      // entry, and the next ones to fetch are just before it
      int64_t mine = -1;
      for (int64_t i = static_cast<int64_t>(stashed.size()) - 1; i >= 0; --i) {
        auto s = stashed[i].lock();
        if (mine < 0) {
          if (s == h) mine = i;
        } else if (s) {
          next.push_back(std::move(s));
          if (static_cast<int64_t>(next.size()) == ahead) break;
        }
      }
      if (mine >= 0) stashed.erase(stashed.begin() + mine);
    }
    int64_t fetched = 0;
    for (auto& s : next) {
      if (!s->back.defined() && s->host.defined() && !s->block.defined()) {
        fetch(*s);
        ++fetched;
      }
    }
    Tensor back = std::move(h->back);
    h->back = Tensor();
    void* ready = h->ready;
    h->ready = nullptr;
    if (ready != nullptr) {
      void* cur = current_stream(h->device);
      wait_event(cur, ready);
      if (cur != h->fetched_on) {   // allocated on another stream than the one using it
        c10::impl::VirtualGuardImpl impl(h->device.type());
        back.record_stream(impl.getStream(h->device));
      }
    }
    if (h->host.defined()) {   // its next copy in runs after this one (one stream)
      pool->give(std::move(h->host), lane(h->device));
      h->host = Tensor();
    }
    std::lock_guard<std::recursive_mutex> lock(mutex);
    stats.prefetched += fetched;
    stats.late += late;
    stats.taken_on_device += on_device;
    return back;
  }
};

// A stash whose backward never comes (a forward without backward): its device block
// goes, a copy back queued for it finishes before its memory is reused, its buffer goes
// back to the pool.
Stash::~Stash() {
  try {
    if (block.defined()) engine->drop_block(*this, false);
    if (ready != nullptr) {
      driver.event_destroy(ready);
      back.record_stream(engine->side(device.index()));
    }
    if (host.defined()) engine->pool->give(std::move(host), OffloadEngine::lane(device));
  } catch (const std::exception& e) {
    TORCH_WARN("bitsparse: releasing an offloaded block failed: ", e.what());
  }
}

// ---------------------------------------------------------------------------
// The op's two halves (shared by the autograd node and the dispatcher's kernels)
// ---------------------------------------------------------------------------
struct Forward {
  Tensor out, block, ticket;
  std::shared_ptr<Stash> stash;   // the block's, when offloaded (``block`` is then undefined)
};

// Forward: take the pack's ticket (tracked for ``policy``), pack relu(a) into a new block
// (the kernel writes its count to the ticket's slot where it has one) and return
// linear(relu(a)[**2], weight, bias), the block and the ticket. With an ``offloader``, the
// block goes out on its side stream, queued behind the pack and ahead of the GEMM (so the
// copy overlaps it).
Forward forward_impl(const Tensor& a, const Tensor& weight, const std::optional<Tensor>& bias,
                     const Plan& P, int64_t policy, int64_t capacity, int64_t mm_dtype,
                     OffloadEngine* offloader = nullptr) {
  TORCH_CHECK(a.numel() == P.numel, "bitsparse: plan of ", P.numel, " elements for ",
              a.numel());
  c10::DeviceGuard device_guard(a.device());
  void* stream = current_stream(a.device());
  Tensor ticket = claim_ticket(stream);
  track(policy, ticket, a.numel(), capacity);
  const int64_t item = a.element_size();
  const int64_t yelems = ceil_div(a.numel() * item, 16) * 16 / item;
  // One allocation for y and the pack's scratch (dead once the kernel ran; y dies
  // after the second GEMM), one for the block.
  Tensor ystore = at::empty({yelems + ceil_div(P.scratch_bytes, item)}, a.options());
  Tensor block = at::empty({P.nbytes}, a.options().dtype(at::kByte));
  const uint64_t y = address(ystore), b = address(block);
  const int64_t slot = slot_of(ticket);
  if (P.numel == 0) {
    memset0(b, P.nbytes, stream);
    if (slot) {           // nothing to launch: the (empty) pack's count is known here
      *slot_count_at(slot) = 0;
      *slot_status_at(slot) = 0;
    }
  } else {
    const uint64_t scratch = y + static_cast<uint64_t>(yelems * item);
    memset0(scratch, P.scratch_bytes, stream);
    P.pack.run(stream, b, {address(a), y, scratch, 0, 0, 0, static_cast<uint64_t>(slot)});
  }
  std::shared_ptr<Stash> stash;
  if (offloader != nullptr) {
    stash = offloader->stash(block);
    block = Tensor();
  }
  const Tensor yv = ystore.as_strided(a.sizes(), a.strides());
  Tensor out = at::linear(mm_dtype >= 0 ? yv.to(static_cast<at::ScalarType>(mm_dtype)) : yv,
                          weight, bias);
  return {out, block, ticket, std::move(stash)};
}

// Whether the backward may read the packed values: the slot says clean (and the policy's
// poll is not due), else Python's policy decides (waits, recomputes, or raises where
// there is no recompute source).
bool decide_clean(const Tensor& ticket, int64_t policy, int64_t handle, const Tensor& block,
                  bool recompute_source) {
  return (slot_shows_clean(ticket) && !poll_due(policy))
         || pack_is_clean(handle, policy, ticket, block, recompute_source);
}

struct Grads {
  Tensor a, weight, bias;   // undefined where not asked for
};

// Backward: PyTorch's linear backward on the 2-D views, relu's (or relu²'s) gradient and
// the second GEMM's input from the packed block when clean, else from the forward's own
// first GEMM recomputed (x, w1, b1).
Grads backward_impl(const Tensor& grad_out, const Tensor& block, const Tensor& weight,
                    const Tensor& x, const Tensor& w1, const Tensor& b1,
                    at::IntArrayRef a_shape, at::ScalarType a_dtype, const Plan& P, bool clean,
                    bool square, int64_t mm_dtype, bool need_a, bool need_w, bool need_b) {
  Grads g;
  const Tensor g2 = grad_out.contiguous().reshape({-1, grad_out.size(-1)});
  if (need_b) g.bias = g2.sum({0}, true).view({g2.size(-1)});
  if (!need_a && !need_w) return g;
  c10::DeviceGuard device_guard(block.device());
  void* stream = current_stream(block.device());
  const uint64_t b = address(block);

  if (clean && square && need_a && need_w) {
    // one decode gives both the input gradient and the second GEMM's input
    const Tensor grad_h = input_grad(g2, weight, a_shape, a_dtype).contiguous();
    Tensor grad_a = at::empty_like(grad_h), h = at::empty_like(grad_h);
    P.relu2_and_square.run(stream, b, {0, 0, 0, address(grad_h), address(grad_a), address(h)});
    g.a = grad_a;
    g.weight = weight_grad(g2, h, mm_dtype);
    return g;
  }
  Tensor r;
  if (clean) {
    r = at::empty(a_shape, grad_out.options().dtype(a_dtype));
    P.unpack.run(stream, b, {0, 0, 0, 0, address(r), 0});
  } else {   // overflowed or count unknown: the forward's own GEMM, autocast off as there
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    r = at::relu(at::linear(x, w1, maybe(b1)));
  }
  if (need_w) {
    // the forward's relu(a)**2, rounded the same single way; in place where r is
    // not needed again (the clean gradient reads the packed block)
    g.weight = weight_grad(g2, square ? (clean ? r.mul_(r) : r * r) : r, mm_dtype);
  }
  if (need_a) {
    const Tensor grad_h = input_grad(g2, weight, a_shape, a_dtype);
    if (clean) {
      const Tensor gh = grad_h.contiguous();
      Tensor grad_a = at::empty_like(gh);
      const Launch& grad_of_mask = square ? P.relu2 : P.mask_select;
      grad_of_mask.run(stream, b, {0, 0, 0, address(gh), address(grad_a), 0});
      g.a = grad_a;
    } else if (square) {
      g.a = at::threshold_backward(grad_h * (2 * r), r, 0);
    } else {
      g.a = at::threshold_backward(grad_h, r, 0);
    }
  }
  return g;
}

// ---------------------------------------------------------------------------
// The autograd function (eager mode)
// ---------------------------------------------------------------------------
constexpr size_t kInputs = 12;   // forward's arguments after ctx

// An offloaded block between forward and backward, as the node's saved data holds it.
// Dropped with the node when no backward comes (~Stash gives its buffer back).
struct StashHolder : torch::CustomClassHolder {
  std::shared_ptr<Stash> stash;
  explicit StashHolder(std::shared_ptr<Stash> s) : stash(std::move(s)) {}
};

struct ReLULinear : public torch::autograd::Function<ReLULinear> {
  // Optional tensors are std::optional (autograd records an input's metadata, which an
  // undefined tensor does not have). ``offloader``: the model's offload engine, or null.
  static Tensor forward(AutogradContext* ctx, Tensor a, Tensor weight,
                        std::optional<Tensor> bias, Tensor x, Tensor w1, std::optional<Tensor> b1,
                        int64_t capacity, int64_t handle, bool square, int64_t mm_dtype,
                        int64_t policy, OffloadEngine* offloader) {
    RECORD_FUNCTION("bitsparse::relu_linear", c10::ArrayRef<const c10::IValue>{});
    c10::DeviceGuard device_guard(a.device());   // the offloader's calls too
    const Plan& P = plan_at(handle);
    auto [out, block, ticket, stash] =
        forward_impl(a, weight, bias, P, policy, capacity, mm_dtype, offloader);
    if (stash) {   // the block went to the host; backward takes it back
      ctx->saved_data["stash"] =
          c10::IValue::make_capsule(c10::make_intrusive<StashHolder>(std::move(stash)));
    }
    ctx->save_for_backward({block, weight, x, w1, b1.value_or(Tensor())});
    ctx->saved_data["ticket"] = ticket;
    ctx->saved_data["a_shape"] = a.sizes().vec();
    ctx->saved_data["a_dtype"] = static_cast<int64_t>(a.scalar_type());
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["handle"] = handle;
    ctx->saved_data["square"] = square;
    ctx->saved_data["mm_dtype"] = mm_dtype;
    ctx->saved_data["policy"] = policy;
    return out;
  }

  // The offloaded block, back on the device (ordered before this backward's work); a
  // second take, a second backward through the graph, raises.
  static Tensor take_back(const c10::IValue& capsule) {
    auto holder = c10::static_intrusive_pointer_cast<StashHolder>(capsule.toCapsule());
    return holder->stash->engine->take(holder->stash);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(kInputs);
    const Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return result;   // the output was not used
    RECORD_FUNCTION("bitsparse::relu_linear_backward", c10::ArrayRef<const c10::IValue>{});
    const auto saved = ctx->get_saved_variables();
    const auto& data = ctx->saved_data;
    const auto stash = data.find("stash");
    const Tensor block = stash != data.end() ? take_back(stash->second) : saved[0];
    const Tensor &weight = saved[1], &x = saved[2], &w1 = saved[3], &b1 = saved[4];
    const int64_t handle = data.at("handle").toInt(), policy = data.at("policy").toInt();
    const bool clean = decide_clean(data.at("ticket").toTensor(), policy, handle, block, true);
    const Grads g = backward_impl(
        grad_out, block, weight, x, w1, b1, data.at("a_shape").toIntVector(),
        static_cast<at::ScalarType>(data.at("a_dtype").toInt()), plan_at(handle), clean,
        data.at("square").toBool(), data.at("mm_dtype").toInt(), ctx->needs_input_grad(0),
        ctx->needs_input_grad(1), data.at("has_bias").toBool() && ctx->needs_input_grad(2));
    result[0] = g.a;
    result[1] = g.weight;
    result[2] = g.bias;
    return result;
  }
};

void check_input(const Tensor& a) {
  TORCH_CHECK(driver.launch != nullptr, "bitsparse: native module used before set_driver");
  TORCH_CHECK((a.is_cuda() || (host_emulation && a.is_cpu())) && a.is_contiguous(),
              "bitsparse: a must be a contiguous CUDA tensor");
}

int64_t dtype_code(const py::handle& dtype) {
  if (dtype.is_none()) return -1;
  TORCH_CHECK(THPDtype_Check(dtype.ptr()), "bitsparse: mm_dtype must be a torch.dtype or None");
  return static_cast<int64_t>(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type);
}

Tensor relu_linear(const Tensor& a, const Tensor& weight, const std::optional<Tensor>& bias,
                   const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1,
                   int64_t capacity, int64_t handle, bool square, const py::handle& mm_dtype,
                   int64_t policy, const std::shared_ptr<OffloadEngine>& offloader) {
  check_input(a);
  const int64_t mm = dtype_code(mm_dtype);
  OffloadEngine* off = offloader.get();   // the caller keeps it
  py::gil_scoped_release no_gil;   // as any ATen call from Python
  return ReLULinear::apply(a, weight, bias, x, w1, b1, capacity, handle, square, mm, policy,
                           off);
}

// ---------------------------------------------------------------------------
// The dispatcher's kernels of bitsparse::relu_linear and relu_linear_backward
// ---------------------------------------------------------------------------
// What torch.compile's graphs, CUDA graph captures and torch.ops calls reach (and the
// Python autograd function, through ops.CUDA_KERNELS): the op's two halves without an
// autograd node, the caller's graph holds it. Same schema as ops.py's definitions. Where
// this path does not apply (python_path(), chunks other than the default, a plan the
// table does not take, tensors on another device) the Python kernel runs.
std::atomic<int> python_path_depth{0};   // native.python_path() blocks open
int64_t default_chunk_log2 = -1;
py::object* handle_fn = nullptr;         // native._handle_for: a plan's handle, or -1
py::object* python_forward = nullptr;    // ops.relu_linear
py::object* python_backward = nullptr;   // ops.relu_linear_backward
std::mutex handles_mutex;
std::map<std::vector<int64_t>, int64_t> handles;

bool takes(const Tensor& t, int64_t chunk_log2) {
  return chunk_log2 == default_chunk_log2 && python_path_depth.load() == 0 &&
         driver.launch != nullptr && (t.is_cuda() || (host_emulation && t.is_cpu()));
}

// The plan handle of one (square, shape, dtype, capacity, encoding, device), registered
// by Python on its first use; -1 where the C++ path does not take it. Python is called
// with no lock of this file held.
int64_t handle_of(bool square, at::IntArrayRef shape, at::ScalarType dtype, int64_t capacity,
                  int64_t encoding, const c10::Device& device) {
  std::vector<int64_t> key = {square, static_cast<int64_t>(dtype), capacity, encoding,
                              device.index()};
  key.insert(key.end(), shape.begin(), shape.end());
  {
    std::lock_guard<std::mutex> lock(handles_mutex);
    const auto it = handles.find(key);
    if (it != handles.end()) return it->second;
  }
  int64_t handle;
  {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(handle_fn != nullptr, "bitsparse: native module used before set_dispatch");
    py::object dt = py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype)));
    handle = (*handle_fn)(square, shape.vec(), dt, capacity, encoding, device.index())
                 .cast<int64_t>();
  }
  std::lock_guard<std::mutex> lock(handles_mutex);
  handles.emplace(key, handle);
  return handle;
}

using Result3 = std::tuple<Tensor, Tensor, Tensor>;

Result3 call_python(py::object* fn, const char* what, py::args args) {
  TORCH_CHECK(fn != nullptr, "bitsparse: native module used before set_dispatch (", what, ")");
  return (*fn)(*args).cast<Result3>();
}

Result3 relu_linear_kernel(const Tensor& a_in, const Tensor& weight,
                           const std::optional<Tensor>& bias, const std::optional<Tensor>& x,
                           const std::optional<Tensor>& w1, const std::optional<Tensor>& b1,
                           int64_t capacity, bool square, int64_t encoding, int64_t chunk_log2,
                           std::optional<at::ScalarType> mm_dtype, int64_t policy) {
  int64_t handle = -1;
  Tensor a = a_in;
  if (takes(a, chunk_log2)) {
    a = a.contiguous();
    handle = handle_of(square, a.sizes(), a.scalar_type(), capacity, encoding, a.device());
  }
  if (handle < 0) {
    py::gil_scoped_acquire gil;
    return call_python(python_forward, "relu_linear",
                       py::make_tuple(a_in, weight, bias, x, w1, b1, capacity, square, encoding,
                                      chunk_log2, mm_dtype, policy));
  }
  Forward f = forward_impl(a, weight, bias, plan_at(handle), policy, capacity,
                           mm_dtype ? static_cast<int64_t>(*mm_dtype) : -1);
  return {f.out, f.block, f.ticket};
}

Result3 relu_linear_backward_kernel(const Tensor& grad_out, const Tensor& block,
                                    const Tensor& ticket, const Tensor& weight,
                                    const std::optional<Tensor>& x,
                                    const std::optional<Tensor>& w1,
                                    const std::optional<Tensor>& b1, at::IntArrayRef a_shape,
                                    at::ScalarType a_dtype, bool has_bias, int64_t capacity,
                                    bool square, int64_t encoding, int64_t chunk_log2,
                                    std::optional<at::ScalarType> mm_dtype, int64_t policy,
                                    int64_t needs) {
  const int64_t handle = takes(block, chunk_log2)
      ? handle_of(square, a_shape, a_dtype, capacity, encoding, block.device()) : -1;
  if (handle < 0) {
    py::gil_scoped_acquire gil;
    return call_python(python_backward, "relu_linear_backward",
                       py::make_tuple(grad_out, block, ticket, weight, x, w1, b1, a_shape.vec(),
                                      a_dtype, has_bias, capacity, square, encoding, chunk_log2,
                                      mm_dtype, policy, needs));
  }
  const bool need_a = needs & 1, need_w = needs & 2, need_b = has_bias && (needs & 4);
  const Tensor xs = x.value_or(Tensor()), w1s = w1.value_or(Tensor()), b1s = b1.value_or(Tensor());
  const bool clean = decide_clean(ticket, policy, handle, block, xs.defined());
  Grads g = backward_impl(grad_out, block, weight, xs, w1s, b1s, a_shape, a_dtype,
                          plan_at(handle), clean, square,
                          mm_dtype ? static_cast<int64_t>(*mm_dtype) : -1, need_a, need_w, need_b);
  // what the op's fake kernel says of a gradient not asked for: an empty tensor
  if (!g.a.defined()) g.a = at::empty({0}, grad_out.options().dtype(a_dtype));
  if (!g.weight.defined()) g.weight = at::empty({0}, weight.options());
  if (!g.bias.defined()) g.bias = at::empty({0}, weight.options());
  return {g.a, g.weight, g.bias};
}

// The kernels registered with the dispatcher, per dispatch key (CUDA; CPU only under the
// tests' host emulation); dropping a key's library unregisters them.
std::map<std::string, std::unique_ptr<torch::Library>> registered;

void register_kernels(const std::string& key) {
  if (registered.count(key)) return;
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "bitsparse",
                                              c10::parseDispatchKey(key), __FILE__, __LINE__);
  lib->impl("relu_linear", TORCH_FN(relu_linear_kernel));
  lib->impl("relu_linear_backward", TORCH_FN(relu_linear_backward_kernel));
  registered[key] = std::move(lib);
}

py::bytes launch_params(int64_t handle, const std::string& name, uint64_t block,
                        const std::array<uint64_t, N_ROLES>& roles) {
  const Plan& P = plan_at(handle);
  const Launch* L = name == "pack" ? &P.pack
                    : name == "unpack" ? &P.unpack
                    : name == "relu2" ? &P.relu2
                    : name == "relu2_and_square" ? &P.relu2_and_square
                    : name == "mask_select" ? &P.mask_select : nullptr;
  TORCH_CHECK(L != nullptr && L->present(), "bitsparse: no launch '", name, "'");
  std::vector<uint8_t> buf(L->params.size());
  L->fill(buf.data(), block, roles);
  return py::bytes(reinterpret_cast<const char*>(buf.data()), buf.size());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "bitsparse_core's eager CUDA host path of the packed ReLU / ReLU² FFN op";
  m.attr("N_ROLES") = static_cast<int>(N_ROLES);
  m.def("set_driver", [](uint64_t launch, uint64_t cooperative, uint64_t memset,
                         uint64_t copy_to_host, uint64_t error_name, uint64_t is_capturing) {
    driver.is_capturing = reinterpret_cast<IsCapturingFn>(is_capturing);
    driver.launch = reinterpret_cast<LaunchFn>(launch);
    driver.launch_cooperative = reinterpret_cast<CoopLaunchFn>(cooperative);
    driver.memset = reinterpret_cast<MemsetFn>(memset);
    driver.copy_to_host = reinterpret_cast<CopyToHostFn>(copy_to_host);
    driver.error_name = reinterpret_cast<ErrorNameFn>(error_name);
  });
  m.def("set_offload_driver", [](uint64_t create, uint64_t record, uint64_t wait,
                                 uint64_t destroy, uint64_t query, uint64_t copy_to_device) {
    driver.event_create = reinterpret_cast<EventCreateFn>(create);
    driver.event_record = reinterpret_cast<EventRecordFn>(record);
    driver.stream_wait_event = reinterpret_cast<StreamWaitEventFn>(wait);
    driver.event_destroy = reinterpret_cast<EventDestroyFn>(destroy);
    driver.event_query = reinterpret_cast<EventQueryFn>(query);
    driver.copy_to_device = reinterpret_cast<CopyToDeviceFn>(copy_to_device);
  });
  m.def("set_host_emulation", [](bool on) { host_emulation = on; });
  m.def("set_state_fn", [](py::object fn) {
    auto* keep = new py::object(std::move(fn));
    std::swap(keep, clean_state_fn);   // an earlier one stays alive: a backward may hold it
  });
  m.def("add_plan", &add_plan);
  m.def("set_slab", [](int64_t base, int64_t generations, int64_t slots, int64_t ring_begin) {
    std::lock_guard<std::mutex> lock(slab.mutex);
    slab.base = base;
    slab.generations = generations;
    slab.slots = slots;
    slab.ring_begin = slab.next = ring_begin;
  });
  m.def("drain_tracks", &drain_tracks);
  m.def("set_dispatch", [](py::object handle, py::object forward, py::object backward,
                           int64_t chunk_log2) {
    // never freed: a kernel may be running one (an earlier one stays alive too)
    handle_fn = new py::object(std::move(handle));
    python_forward = new py::object(std::move(forward));
    python_backward = new py::object(std::move(backward));
    default_chunk_log2 = chunk_log2;
  });
  m.def("set_python_path_depth", [](int depth) { python_path_depth.store(depth); });
  m.def("forget_handles", [] {
    std::lock_guard<std::mutex> lock(handles_mutex);
    handles.clear();
  });
  m.def("register_kernels", &register_kernels);
  m.def("size_class", &size_class);
  m.def("unregister_kernels", [](const std::string& key) { registered.erase(key); });
  // offload.py's Offloader drives these (its docstring says what they do)
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<PinnedPool, std::shared_ptr<PinnedPool>>(m, "PinnedPool")
      .def(py::init<int64_t>(), py::arg("max_bytes") = -1)
      .def("take", [](PinnedPool& p, int64_t nbytes, int64_t lane) -> py::object {
             Tensor t;
             {
               py::gil_scoped_release no_gil;
               t = p.take(nbytes, lane);
             }
             return t.defined() ? py::cast(t) : py::none();
           }, py::arg("nbytes"), py::arg("lane") = -1)
      .def("give", &PinnedPool::give, py::arg("buf"), py::arg("lane") = -1, release())
      .def("free_bytes", &PinnedPool::free_bytes, release())
      .def("free_buffers", [](PinnedPool& p) {
             std::lock_guard<std::mutex> lock(p.mutex);
             std::map<std::pair<int64_t, int64_t>, size_t> out;
             for (const auto& item : p.free) {
               if (!item.second.empty()) out[item.first] = item.second.size();
             }
             return out;
           })
      .def_property_readonly("held", [](PinnedPool& p) {
             std::lock_guard<std::mutex> lock(p.mutex);
             return p.held;
           })
      .def_property_readonly("max_bytes", [](const PinnedPool& p) -> py::object {
             return p.max_bytes < 0 ? py::none() : py::cast(p.max_bytes);
           });
  py::class_<Stash, std::shared_ptr<Stash>>(m, "Stash")
      .def("take", [](const std::shared_ptr<Stash>& h) { return h->engine->take(h); }, release())
      .def_property_readonly("state", &Stash::state)
      .def_readonly("nbytes", &Stash::nbytes);
  py::class_<OffloadEngine, std::shared_ptr<OffloadEngine>>(m, "OffloadEngine")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("ahead"), py::arg("max_bytes"),
           py::arg("hold"))
      .def("stash", [](OffloadEngine& e, const Tensor& block) { return e.stash(block); },
           release())
      .def("stats", [](OffloadEngine& e) {
             std::lock_guard<std::recursive_mutex> lock(e.mutex);
             const OffloadStats& s = e.stats;
             return std::map<std::string, int64_t>{
                 {"offloaded", s.offloaded}, {"kept_on_device", s.kept_on_device},
                 {"prefetched", s.prefetched}, {"late", s.late},
                 {"taken_on_device", s.taken_on_device}, {"bytes_offloaded", s.bytes_offloaded}};
           })
      .def_readonly("pool", &OffloadEngine::pool)
      .def("emulate_copies", [](OffloadEngine& e, bool on) { e.emulate_copies = on; })
      .def("copies_done", [](OffloadEngine& e, uint64_t upto) {
             std::lock_guard<std::recursive_mutex> lock(e.mutex);
             e.done_upto = std::max(e.done_upto, upto);
           })
      .def("released_tokens", [](OffloadEngine& e) {
             std::lock_guard<std::recursive_mutex> lock(e.mutex);
             return std::make_pair(e.tokens, e.released);
           });
  m.def("relu_linear", &relu_linear);
  m.def("relu_linear_kernel", &relu_linear_kernel, py::call_guard<py::gil_scoped_release>());
  m.def("relu_linear_backward_kernel", &relu_linear_backward_kernel,
        py::call_guard<py::gil_scoped_release>());
  m.def("launch_params", &launch_params);
}
