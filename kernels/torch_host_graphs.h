// A relu_linear backward captured into a CUDA graph, as one conditional node.
//
// A captured backward cannot read its pack's count on the host, so without this it had to
// recompute the activation every replay (the forward's first GEMM again). Here both ways
// go into the graph as the two bodies of an IF/ELSE node (driver 12.8+): the first reads
// the packed block, the second recomputes; a one-thread kernel captured just before the
// node sets its condition from the block's status word, so each replay runs only the way
// its own pack asks for. The bodies are captured on a side stream into the node's body
// graphs (cuStreamBeginCaptureToGraph), as torch's own conditional nodes do in later
// releases; a body may hold only kernels, memsets, copies and child graphs, so everything
// either body writes or needs as scratch is allocated before the node, and the side
// stream's cuBLAS workspaces exist before any capture (warm_side_stream, from an eager
// backward). Where any of this is missing (an older driver, no eager backward yet on the
// device, GEMM dtypes that differ) the capture recomputes as before.

#pragma once

#include "torch_host_common.h"

namespace {

using CaptureInfoFn = CUresult (*)(void* stream, int* status, uint64_t* id, void** graph,
                                   void* const** deps, const void** edges, size_t* count);
using CondHandleCreateFn = CUresult (*)(uint64_t* handle, void* graph, void* ctx,
                                        unsigned default_value, unsigned flags);
using GraphAddNodeFn = CUresult (*)(void** node, void* graph, void* const* deps,
                                    const void* edges, size_t count, void* params);
using UpdateCaptureDepsFn = CUresult (*)(void* stream, void** deps, const void* edges,
                                         size_t count, unsigned flags);
using BeginCaptureToGraphFn = CUresult (*)(void* stream, void* graph, void* const* deps,
                                           const void* edges, size_t count, int mode);
using EndCaptureFn = CUresult (*)(void* stream, void** graph);
using CtxGetCurrentFn = CUresult (*)(void** ctx);

struct GraphDriver {
  CaptureInfoFn capture_info = nullptr;              // cuStreamGetCaptureInfo_v3
  CondHandleCreateFn handle_create = nullptr;        // cuGraphConditionalHandleCreate
  GraphAddNodeFn add_node = nullptr;                 // cuGraphAddNode_v2
  UpdateCaptureDepsFn update_deps = nullptr;         // cuStreamUpdateCaptureDependencies_v2
  BeginCaptureToGraphFn begin_to_graph = nullptr;    // cuStreamBeginCaptureToGraph
  EndCaptureFn end_capture = nullptr;                // cuStreamEndCapture
  CtxGetCurrentFn ctx_current = nullptr;             // cuCtxGetCurrent
  // per device: the CUfunction of kernels/bitsparse_graph.cu's condition kernel (0: none;
  // Python sets it while backwards on other threads read it)
  static constexpr int64_t kMaxDevices = 64;
  std::array<std::atomic<uint64_t>, kMaxDevices> set_condition{};

  uint64_t condition_kernel(int64_t device) const {
    return device >= 0 && device < kMaxDevices ? set_condition[device].load() : 0;
  }
};
GraphDriver graph_driver;

// The driver's CUgraphNodeParams with its conditional member (cuda.h, CUDA 12.4+): 256 bytes.
struct ConditionalNodeParams {
  int type = 13;                 // CU_GRAPH_NODE_TYPE_CONDITIONAL
  int reserved0[3] = {0, 0, 0};
  uint64_t handle = 0;
  int cond_type = 0;             // CU_GRAPH_COND_TYPE_IF
  unsigned size = 0;             // 2: an ELSE body too
  void** bodies_out = nullptr;   // the driver's array of body graphs
  void* ctx = nullptr;
  long long unused[29 - 4] = {};
  long long reserved2 = 0;
};
static_assert(sizeof(ConditionalNodeParams) == 256, "CUgraphNodeParams is 256 bytes");

// native._route_body_allocations(device, begin): while a body is captured, what the side
// stream allocates (cuBLAS's workspaces, made anew where inductor cleared them before its
// recording) goes to a private pool of its own, which nothing else allocates from, so the
// graph's workspace is never handed to a tensor once cuBLAS lets go of it. Never freed.
py::object* body_pool_fn = nullptr;

void route_body_allocations(int64_t device, bool begin) {
  if (body_pool_fn == nullptr) return;
  py::gil_scoped_acquire gil;
  (*body_pool_fn)(device, begin);
}

constexpr int kCaptureActive = 1;       // CU_STREAM_CAPTURE_STATUS_ACTIVE
constexpr unsigned kSetDependencies = 1;  // CU_STREAM_SET_CAPTURE_DEPENDENCIES
constexpr int kCaptureRelaxed = 2;      // CU_STREAM_CAPTURE_MODE_RELAXED

// The side streams the bodies are captured on, two per device from torch's pool (the
// capture's own stream may be one of the pool's: a body takes the other), and whether an
// eager call has made their cuBLAS workspaces (per device and GEMM dtype).
std::mutex side_mutex;
std::map<int64_t, std::array<c10::Stream, 2>> side_streams;
std::map<std::pair<int64_t, int>, bool> side_warm;

// Per policy: a counter of the replays whose captured backward recomputed, one int64 of a
// pinned host table that the condition kernel adds to over the bus and the host reads with
// no CUDA call (a device counter would need a copy back and a wait; and made inside an
// inductor warm-up it would land in the graphs' pool, where inductor allows nothing it
// does not track: bench/NOTES.md, session 60). Guarded by side_mutex; a gone policy's slot
// is given back (drop_replay_counter).
constexpr int64_t kReplayCounterSlots = 1 << 16;
Tensor replay_table;                           // pinned int64[kReplayCounterSlots], made on first use
std::vector<int64_t> replay_free;              // its free slots
std::unordered_map<int64_t, int64_t> replay_slot_of;   // policy -> slot

bool graph_driver_ready(int64_t device) {
  const GraphDriver& d = graph_driver;
  return d.capture_info && d.handle_create && d.add_node && d.update_deps &&
         d.begin_to_graph && d.end_capture && d.ctx_current && d.condition_kernel(device) != 0;
}

// A warmed side stream of ``device`` other than ``stream``, for GEMMs of ``dtype``.
std::optional<c10::Stream> side_stream(const c10::Device& device, at::ScalarType dtype,
                                       void* stream) {
  std::lock_guard<std::mutex> lock(side_mutex);
  const auto it = side_streams.find(device.index());
  if (it == side_streams.end() || !side_warm.count({device.index(), static_cast<int>(dtype)})) {
    return std::nullopt;
  }
  for (const c10::Stream& s : it->second) {
    if (s.native_handle() != stream) return s;
  }
  return std::nullopt;
}

// The address of the policy's replay counter; 0 where it has none (no eager backward of the
// policy before the capture, no policy, or every slot taken).
uint64_t replay_counter(int64_t policy) {
  std::lock_guard<std::mutex> lock(side_mutex);
  const auto it = replay_slot_of.find(policy);
  if (it == replay_slot_of.end()) return 0;
  return reinterpret_cast<uint64_t>(replay_table.data_ptr<int64_t>() + it->second);
}

// A slot of the table for ``policy`` (side_mutex held), zeroed; none where every slot is
// taken. The table is pinned host memory: no device pool is involved.
void add_replay_counter(int64_t policy) {
  if (!replay_table.defined()) {
    replay_table = at::zeros({kReplayCounterSlots},
                             at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    for (int64_t i = kReplayCounterSlots - 1; i >= 0; --i) replay_free.push_back(i);
  }
  if (replay_free.empty()) return;
  const int64_t slot = replay_free.back();
  replay_free.pop_back();
  replay_table.data_ptr<int64_t>()[slot] = 0;
  replay_slot_of[policy] = slot;
}

// The policy's count (volatile: the device writes it); 0 where it has no counter.
int64_t replay_count(int64_t policy) {
  std::lock_guard<std::mutex> lock(side_mutex);
  const auto it = replay_slot_of.find(policy);
  if (it == replay_slot_of.end()) return 0;
  return *(static_cast<volatile int64_t*>(replay_table.data_ptr<int64_t>()) + it->second);
}

// A policy that is gone (its finalizer): its slot goes back.
void drop_replay_counter(int64_t policy) {
  std::lock_guard<std::mutex> lock(side_mutex);
  const auto it = replay_slot_of.find(policy);
  if (it == replay_slot_of.end()) return;
  replay_free.push_back(it->second);
  replay_slot_of.erase(it);
}

// Make the side stream's cuBLAS and cuBLASLt workspaces (torch keeps one per handle and
// stream, allocated on first use, which a capture would forbid), with one small GEMM of
// each kind on it. Called from eager backwards; once per device and dtype.
// Also gives the policy its replay counter. Two lookups under one lock once both exist
// (every eager backward comes here).
void warm_side_stream(const c10::Device& device, at::ScalarType dtype, int64_t policy) {
  if (!device.is_cuda() || !graph_driver_ready(device.index())) return;
  const std::pair<int64_t, int> key{device.index(), static_cast<int>(dtype)};
  std::array<c10::Stream, 2> sides{c10::Stream(c10::Stream::DEFAULT, device),
                                   c10::Stream(c10::Stream::DEFAULT, device)};
  {
    std::lock_guard<std::mutex> lock(side_mutex);
    if (policy > 0 && !replay_slot_of.count(policy)) add_replay_counter(policy);
    if (side_warm.count(key)) return;
    auto it = side_streams.find(device.index());
    if (it == side_streams.end()) {
      c10::impl::VirtualGuardImpl impl(device.type());
      const c10::Stream first = impl.getStreamFromGlobalPool(device, false);
      c10::Stream second = impl.getStreamFromGlobalPool(device, false);
      while (second == first) second = impl.getStreamFromGlobalPool(device, false);
      it = side_streams.emplace(device.index(), std::array<c10::Stream, 2>{first, second}).first;
    }
    sides = it->second;
  }
  for (const c10::Stream& side : sides) {
    c10::StreamGuard guard(side);
    const auto opts = at::TensorOptions().device(device).dtype(dtype);
    const Tensor m = at::zeros({16, 16}, opts), bias = at::zeros({16}, opts);
    at::mm(m, m);
    at::addmm(bias, m, m);
  }
  std::lock_guard<std::mutex> lock(side_mutex);
  side_warm[key] = true;
}

// Adds an IF/ELSE node to the capture on ``stream`` whose condition is "the u32 at
// ``status`` is zero" (where it is not, the pinned int64 at ``recomputes``, unless 0,
// counts the replay) and captures the code between then() and finish() into its bodies on
// the side stream, made torch's current stream meanwhile. Ends every capture it began
// even when the code in a body throws.
class ConditionalCapture {
 public:
  ConditionalCapture(void* stream, uint64_t status, uint64_t recomputes, const c10::Stream& side,
                     const c10::Device& device)
      : side_(side), raw_side_(side.native_handle()), device_(device.index()) {
    const GraphDriver& d = graph_driver;
    int st = 0;
    uint64_t id = 0;
    void* graph = nullptr;
    void* const* deps = nullptr;
    const void* edges = nullptr;
    size_t n = 0;
    check(d.capture_info(stream, &st, &id, &graph, &deps, &edges, &n), "cuStreamGetCaptureInfo");
    TORCH_CHECK(st == kCaptureActive, "bitsparse: a conditional node outside a capture");
    void* ctx = nullptr;
    check(d.ctx_current(&ctx), "cuCtxGetCurrent");
    uint64_t handle = 0;
    check(d.handle_create(&handle, graph, ctx, 0, 0), "cuGraphConditionalHandleCreate");
    void* args[] = {&handle, &status, &recomputes};
    check(driver.launch(reinterpret_cast<void*>(d.condition_kernel(device.index())), 1, 1, 1,
                        1, 1, 1, 0, stream, args, nullptr),
          "cuLaunchKernel (condition)");
    check(d.capture_info(stream, &st, &id, &graph, &deps, &edges, &n), "cuStreamGetCaptureInfo");
    ConditionalNodeParams p;
    p.handle = handle;
    p.size = 2;
    p.ctx = ctx;
    void* node = nullptr;
    check(d.add_node(&node, graph, deps, edges, n, &p), "cuGraphAddNode (conditional)");
    bodies_[0] = p.bodies_out[0];
    bodies_[1] = p.bodies_out[1];
    check(d.update_deps(stream, &node, nullptr, 1, kSetDependencies),
          "cuStreamUpdateCaptureDependencies");
    begin(0);
  }

  ConditionalCapture(const ConditionalCapture&) = delete;
  ConditionalCapture& operator=(const ConditionalCapture&) = delete;

  // Ends the first body (condition true) and begins the second.
  void otherwise() {
    end();
    begin(1);
  }

  void finish() { end(); }

  ~ConditionalCapture() {
    if (capturing_) {
      void* g = nullptr;
      graph_driver.end_capture(raw_side_, &g);   // already unwinding: its error is dropped
      try {
        route_body_allocations(device_, false);
      } catch (...) {   // already unwinding
      }
      guard_.reset();
    }
  }

 private:
  void begin(int i) {
    check(graph_driver.begin_to_graph(raw_side_, bodies_[i], nullptr, nullptr, 0,
                                      kCaptureRelaxed),
          "cuStreamBeginCaptureToGraph");
    capturing_ = true;
    guard_.emplace(side_);
    route_body_allocations(device_, true);   // the side stream is now torch's current
  }

  void end() {
    route_body_allocations(device_, false);
    guard_.reset();
    capturing_ = false;
    void* g = nullptr;
    check(graph_driver.end_capture(raw_side_, &g), "cuStreamEndCapture (conditional body)");
  }

  c10::Stream side_;
  void* raw_side_;
  int64_t device_;
  void* bodies_[2] = {nullptr, nullptr};
  bool capturing_ = false;
  std::optional<c10::StreamGuard> guard_;
};

}  // namespace
