// The public codec ops (bitsparse_core.pack, relu_pack, masked_pack, unpack and the fused
// backward ops) on torch CUDA tensors: bitsparse_core/torch/native_codec.py checks the
// arguments and builds the results, and each call's allocation and launch happen here,
// from a launch template Python built once per layout (torch_host_launch.h). Python
// passes the stream (torch's current one, which the caching allocator orders these
// allocations on too); nothing here waits for the GPU.

#pragma once

#include "torch_host_common.h"
#include "torch_host_launch.h"

namespace {

// The templates, by the ids Python holds (torch_host_launch.h's table).
HandleTable<Launch> public_launches;

int64_t add_public_launch(const py::tuple& launch) {
  auto L = std::make_unique<Launch>(make_launch(launch));
  TORCH_CHECK(L->present(), "bitsparse: a public launch template without a kernel");
  return public_launches.add(std::move(L));
}

// Python forgets its ids when its caches fill (shapes or counts that never repeat), and the
// templates go with them: every public_* call holds the GIL, as this does, so none is
// reading the table meanwhile, and an id another thread took before the clear finds
// nothing after it (that call returns None: Python's path runs it).
void forget_public_launches() { public_launches.clear(); }

// Where a call's memory goes: cuda:device, or the host under emulation.
at::TensorOptions bytes_on(int64_t device) {
  const auto opts = at::TensorOptions().dtype(at::kByte);
  return host_emulation ? opts.device(at::kCPU) : opts.device(at::Device(at::kCUDA, device));
}

// A packed tensor's planes (backends/cuda/host.Planes: mask, mask_len, offsets, off64,
// values, values_len, signs, signs_len) into the roles of a call; ``u``: gated's u, whose
// values and signs go to the u roles (its mask is the other tensor's).
void put_planes(Roles& roles, const py::handle& planes, bool u = false) {
  if (planes.is_none()) return;
  const auto t = py::reinterpret_borrow<py::tuple>(planes);
  TORCH_CHECK(t.size() == 8, "bitsparse: planes have 8 entries");
  const auto at = [&](int i) { return t[i].cast<uint64_t>(); };
  if (u) {
    roles[R_UVALUES] = at(4), roles[R_UVALUES_LEN] = at(5);
    roles[R_USIGNS] = at(6), roles[R_USIGNS_LEN] = at(7);
    return;
  }
  roles[R_MASK] = at(0), roles[R_MASK_LEN] = at(1), roles[R_OFFSETS] = at(2);
  roles[R_VALUES] = at(4), roles[R_VALUES_LEN] = at(5);
  roles[R_SIGNS] = at(6), roles[R_SIGNS_LEN] = at(7);
}

// A pack of ``x`` (any mode) into a new block of ``block_bytes``: ``(block, dense)``.
// ``dense_bytes`` > 0 (relu_pack): the activation goes to a new allocation of that many
// bytes, which carries the pack's scratch behind it; else the scratch rides behind the
// block. ``mask_planes``: a masked pack's mask tensor's planes (None otherwise). None
// where ``id`` was forgotten meanwhile (nothing queued).
py::object public_pack(int64_t id, const Tensor& x, int64_t block_bytes, int64_t scratch_bytes,
                       int64_t dense_bytes, const py::handle& mask_planes, uint64_t stream) {
  const Launch* L = public_launches.find(id);
  if (L == nullptr) return py::none();    // forgotten meanwhile
  c10::DeviceGuard device_guard(x.device());
  const auto opts = x.options().dtype(at::kByte);
  Tensor block, dense;
  Roles roles{};
  roles[R_X] = address(x);
  if (dense_bytes > 0) {
    dense = at::empty({dense_bytes + scratch_bytes}, opts);
    block = at::empty({block_bytes}, opts);
    roles[R_Y] = address(dense);
    roles[R_SCRATCH] = roles[R_Y] + static_cast<uint64_t>(dense_bytes);
  } else {
    block = at::empty({block_bytes + scratch_bytes}, opts);
    roles[R_SCRATCH] = address(block) + static_cast<uint64_t>(block_bytes);
  }
  put_planes(roles, mask_planes);
  void* s = reinterpret_cast<void*>(stream);
  memset0(roles[R_SCRATCH], scratch_bytes, s);
  L->run(s, address(block), roles);
  return py::make_tuple(block, dense.defined() ? py::cast(dense) : py::none());
}

// An unpack-family launch over ``planes`` (and ``uplanes``: gated's u, sharing the mask)
// on cuda:device. ``out``: the address to write, or 0 for a new allocation of
// ``out_bytes`` (gated: both results in it, the second at ``out2_offset``); ``g``: the
// gradient's address. Returns the new allocation, True where ``out`` was given, or None
// where ``id`` was forgotten meanwhile (nothing queued).
py::object public_unpack(int64_t id, int64_t device, const py::handle& planes,
                         const py::handle& uplanes, uint64_t g, uint64_t out, int64_t out_bytes,
                         int64_t out2_offset, uint64_t stream) {
  const Launch* L = public_launches.find(id);
  if (L == nullptr) return py::none();    // forgotten meanwhile
  Roles roles{};
  put_planes(roles, planes);
  put_planes(roles, uplanes, true);
  roles[R_G] = g;
  const auto opts = bytes_on(device);
  c10::DeviceGuard device_guard(opts.device());
  Tensor made;
  if (out == 0) {
    made = at::empty({out_bytes}, opts);
    out = address(made);
    if (out2_offset > 0) roles[R_OUT2] = out + static_cast<uint64_t>(out2_offset);
  }
  roles[R_OUT] = out;
  L->run(reinterpret_cast<void*>(stream), 0, roles);
  return made.defined() ? py::cast(made) : py::cast(true);
}

// The parameter bytes a public launch passes for ``roles`` (the CPU tests compare them
// with the record the Python host protocol fills).
py::bytes public_launch_params(int64_t id, uint64_t block, const Roles& roles) {
  const Launch* L = public_launches.find(id);
  TORCH_CHECK(L != nullptr, "bitsparse: unknown public launch ", id);
  std::vector<uint8_t> buf(L->params.size());
  L->fill(buf.data(), block, roles);
  return py::bytes(reinterpret_cast<const char*>(buf.data()), buf.size());
}

void def_public_ops(py::module_& m) {
  m.def("add_public_launch", &add_public_launch);
  m.def("forget_public_launches", &forget_public_launches);
  m.def("public_pack", &public_pack);
  m.def("public_unpack", &public_unpack);
  m.def("public_launch_params", &public_launch_params);
}

}  // namespace
