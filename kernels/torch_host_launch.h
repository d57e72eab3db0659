// Launch templates (argument records built once in Python) and the table of plans
// the op's handles index (torch_ffn_host.cpp).

#pragma once

#include "torch_host_common.h"

namespace {

// ---------------------------------------------------------------------------
// Launch templates
// ---------------------------------------------------------------------------
// The pointers a call supplies (ROLE_NAMES in native.py lists them in this order): the
// FFN op's, then the planes (address, byte length) of packed tensors that live outside
// the call's block (the public ops' inputs, torch_host_public.h).
enum Role {
  R_X, R_Y, R_SCRATCH, R_G, R_OUT, R_OUT2, R_SLOT,
  R_MASK, R_MASK_LEN, R_OFFSETS, R_VALUES, R_VALUES_LEN, R_SIGNS, R_SIGNS_LEN,
  R_UVALUES, R_UVALUES_LEN, R_USIGNS, R_USIGNS_LEN, R_U, N_ROLES
};
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
    TORCH_CHECK(driver.launch != nullptr && driver.launch_cooperative != nullptr,
                "bitsparse: a launch before set_driver");
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
// A gated op's two plans: relu(g)'s (mode RELU_GATED: its pack reads u and writes
// relu(g) * u), whose ``gated`` launch is the backward's kernel and whose
// ``gated_product`` forms r * u from both blocks (u's values and signs are roles), and
// u's (mode MASKED), whose pack reads relu(g)'s mask (a role, at ``spans``).
struct Plan {
  int64_t numel = 0, nbytes = 0, scratch_bytes = 0, status_offset = 0;
  std::array<int64_t, 4> spans{};   // where the mask, offsets, values and signs start
  Launch pack, unpack, relu2, relu2_and_square, mask_select, gated, gated_product;
};

// Handles index a fixed table, so a backward reads its entry without a lock while another
// thread adds one; entries live until the table is cleared (plans: as long as the process).
// A handle carries the table's generation above its index: one made before a clear finds
// nothing after it, even once its index holds a new entry.
template <typename T>
class HandleTable {
 public:
  static constexpr int kIndexBits = 16;
  static constexpr int64_t kMax = int64_t{1} << kIndexBits;

  // The new entry's handle, or -1 where the table is full (the caller takes the Python path).
  int64_t add(std::unique_ptr<T> entry) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t i = size_.load();
    if (i >= kMax) return -1;
    slots_[i].store(entry.release());
    size_.store(i + 1);
    return (generation_.load() << kIndexBits) | i;
  }

  const T* find(int64_t handle) const {
    if (handle < 0 || (handle >> kIndexBits) != generation_.load()) return nullptr;
    const int64_t i = handle & (kMax - 1);
    return i < size_.load() ? slots_[i].load() : nullptr;
  }

  // Only where no reader can hold an entry (the public ops' callers, under the GIL).
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    generation_.fetch_add(1);
    const int64_t n = size_.exchange(0);
    for (int64_t i = 0; i < n; ++i) delete slots_[i].exchange(nullptr);
  }

 private:
  std::unique_ptr<std::atomic<T*>[]> slots_{new std::atomic<T*>[kMax]()};
  std::atomic<int64_t> size_{0};
  std::atomic<int64_t> generation_{0};
  std::mutex mutex_;
};

HandleTable<Plan> plans;

const Plan& plan_at(int64_t handle) {
  const Plan* plan = plans.find(handle);
  TORCH_CHECK(plan != nullptr, "bitsparse: unknown plan handle ", handle);
  return *plan;
}

int64_t add_plan(int64_t numel, int64_t nbytes, int64_t scratch_bytes, int64_t status_offset,
                 const std::array<int64_t, 4>& spans, const py::dict& launches) {
  auto plan = std::make_unique<Plan>();
  plan->numel = numel;
  plan->nbytes = nbytes;
  plan->scratch_bytes = scratch_bytes;
  plan->status_offset = status_offset;
  plan->spans = spans;
  const std::pair<const char*, Launch*> slots[] = {
      {"pack", &plan->pack}, {"unpack", &plan->unpack}, {"relu2", &plan->relu2},
      {"relu2_and_square", &plan->relu2_and_square}, {"mask_select", &plan->mask_select},
      {"gated", &plan->gated}, {"gated_product", &plan->gated_product}};
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
  return plans.add(std::move(plan));
}

}  // namespace
