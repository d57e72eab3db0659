// A pack's count on the host: the pinned slab of capacity.SLAB that the pack kernel
// writes, its tickets and ring, the packs tracked for their policy, and whether a
// pack is clean (torch_ffn_host.cpp).

#pragma once

#include "torch_host_common.h"

namespace {

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

// A pack's ticket: its slot of the ring and the generation it took there (slot NO_SLOT:
// none). The eager op's node keeps it; the ops' dispatcher kernels keep it beside the block
// (remember_ticket); Python's policy sees it as a tensor (ticket_tensor).
struct Ticket {
  int64_t slot = kNoSlot, generation = 0;
};

// A ticket as a CPU int64 tensor [slot, generation] of its own (what the ops' fake kernels
// describe), as capacity.FlagSlab makes them.
Tensor ticket_tensor(const Ticket& ticket) {
  Tensor t = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  int64_t* p = t.data_ptr<int64_t>();
  p[0] = ticket.slot;
  p[1] = ticket.generation;
  return t;
}

bool capturing(void* stream) {
  int status = 0;   // CU_STREAM_CAPTURE_STATUS_NONE
  if (stream != nullptr && driver.is_capturing != nullptr) {
    check(driver.is_capturing(stream, &status), "cuStreamIsCapturing");
  }
  return status != 0;
}

// The next free slot of the ring (FlagSlab.acquire's rule: a slot whose count has not
// landed is skipped), its sentinels written before the pack is queued; NO_SLOT while
// ``stream`` is captured into a CUDA graph (a count cannot be read without a sync there) or
// with every slot in flight. The generation is bumped first: a reader of the slot's
// previous ticket then sees a stale generation, never the new sentinels as the old pack's
// state.
Ticket claim_slot(void* stream) {
  if (slab.base == 0 || slab.slots <= slab.ring_begin || capturing(stream)) return {};
  std::lock_guard<std::mutex> lock(slab.mutex);
  for (int64_t k = slab.ring_begin; k < slab.slots; ++k) {
    const int64_t i = slab.next;
    slab.next = i + 1 == slab.slots ? slab.ring_begin : i + 1;
    if (*slot_status(i) == kSentinel32) continue;
    const int64_t generation = *slot_generation(i) + 1;
    *slot_generation(i) = generation;
    *slot_status(i) = kSentinel32;
    *slot_count(i) = kSentinel64;
    return {i, generation};
  }
  return {};
}

// The host address of a ticket's slot, 0 for a pack without one (a NO_SLOT ticket, taken
// during a graph capture or with every slot in flight).
int64_t slot_of(const Ticket& ticket) {
  const int64_t i = ticket.slot;
  return (slab.base && i >= 0 && i < slab.slots) ? slab.base + 16 * i : 0;
}

// The slot's {u32 status, u32 pad, u64 nnz} once the kernel's have landed, when the slot still
// belongs to this pack (its generation): FlagSlab.read's rule.
bool slot_shows_clean(const Ticket& ticket) {
  if (slot_of(ticket) == 0 || slab.generations == 0) return false;
  const uint32_t s = *slot_status(ticket.slot);
  const uint64_t n = *slot_count(ticket.slot);
  // status 0: landed (the sentinel is all ones) and clean
  return *slot_generation(ticket.slot) == ticket.generation && s == 0 && n != kSentinel64;
}

// The ticket of each block the dispatcher's forward kernel made, found again by its backward
// kernel from the block alone: the ops carry no ticket (a CPU output would keep them out of
// inductor's CUDA graphs). Keyed by the block's storage, checked against a weak reference to
// it: the weak reference keeps that StorageImpl's memory from being reused, so a live entry
// names that storage and no other; a copy of the block, or a block freed and another
// allocated at the same address, finds nothing (its count reads unknown: waited for or
// recomputed, never wrong). Entries of freed blocks go in a sweep once the table doubles.
struct BlockTicket {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  uint64_t data;   // the block's address (a view at another offset is not the block)
  Ticket ticket;
};
std::mutex block_tickets_mutex;
std::unordered_map<const c10::StorageImpl*, BlockTicket> block_tickets;
size_t block_tickets_sweep_at = 1024;

void remember_ticket(const Tensor& block, const Ticket& ticket) {
  if (ticket.slot < 0 || !block.defined() || !block.has_storage()) return;
  const c10::Storage& storage = block.storage();
  std::lock_guard<std::mutex> lock(block_tickets_mutex);
  if (block_tickets.size() >= block_tickets_sweep_at) {
    for (auto it = block_tickets.begin(); it != block_tickets.end();) {
      it = it->second.storage.expired() ? block_tickets.erase(it) : std::next(it);
    }
    block_tickets_sweep_at = std::max<size_t>(1024, 2 * block_tickets.size());
  }
  block_tickets.insert_or_assign(
      storage.unsafeGetStorageImpl(),
      BlockTicket{storage.getWeakStorageImpl(), reinterpret_cast<uint64_t>(block.data_ptr()),
                  ticket});
}

// The ticket remember_ticket kept for ``block``; a NO_SLOT one where there is none.
Ticket ticket_of_block(const Tensor& block) {
  if (!block.defined() || !block.has_storage()) return {};
  std::lock_guard<std::mutex> lock(block_tickets_mutex);
  const auto it = block_tickets.find(block.storage().unsafeGetStorageImpl());
  if (it == block_tickets.end()) return {};
  if (it->second.storage.expired()) {
    block_tickets.erase(it);
    return {};
  }
  if (it->second.data != reinterpret_cast<uint64_t>(block.data_ptr())) return {};
  return it->second.ticket;
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

void track(int64_t policy, const Ticket& ticket, int64_t numel, int64_t capacity) {
  if (policy <= 0) return;   // policy ids start at 1
  std::lock_guard<std::mutex> lock(track_mutex);
  ++packs_of_policy[policy];
  if (ticket.slot < 0) return;   // no slot: nothing will come back
  if (tracked.size() == kMaxTracked) tracked.pop_front();
  tracked.push_back({policy, ticket.slot, ticket.generation, numel, capacity});
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

bool pack_is_clean(int64_t handle, int64_t policy, const Ticket& ticket, const Tensor& block,
                   bool recompute_source, bool gated = false) {
  py::gil_scoped_acquire gil;
  TORCH_CHECK(clean_state_fn != nullptr, "bitsparse: native module used before set_state_fn");
  return (*clean_state_fn)(handle, policy, ticket_tensor(ticket), block, recompute_source, gated)
      .cast<bool>();
}

}  // namespace
