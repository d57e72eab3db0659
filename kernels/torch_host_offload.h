// Offloading: packed blocks in pinned host memory between forward and backward
// (bitsparse_core/torch/offload.py is its Python face; torch_ffn_host.cpp).

#pragma once

#include "torch_host_common.h"

namespace {

// ---------------------------------------------------------------------------
// Offloading: packed blocks in pinned host memory between forward and backward
// ---------------------------------------------------------------------------
// bitsparse_core/torch/offload.py documents the behaviour (its Offloader is this engine's
// Python face); here is the whole mechanism, so that a stash or a take costs no Python.
// Streams are ordered by events, never by the host. Events are the driver's, as
// backends/cuda/driver.py makes them (CU_EVENT_DISABLE_TIMING).

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

}  // namespace
