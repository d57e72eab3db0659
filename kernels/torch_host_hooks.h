// The saved-tensor hooks' first look at every save, in C++ (bitsparse_core/torch/hooks.py).
//
// compress_saved_tensors sees every tensor autograd saves: in a transformer layer about
// thirty, of which a few are worth packing, and deciding that the rest are not took
// microseconds of Python per save. This front makes those decisions and calls the Python
// hooks only for what needs them (a new pack at a site whose capacity has not settled, and
// every save and unpack while other saved-tensor hooks enclose ours):
//
//   * not a candidate (a subclass, small, a leaf that requires grad, a dtype, device, layout
//     or stride the codec does not take): passed through;
//   * a base tensor passed through before (alive and unmodified since): passed through again;
//   * a base tensor packed before: answered by its pack (or a view of it), or passed
//     through where the pack kept the dense tensor;
//   * a new base tensor at a save site that Python told to pass (``skip``): passed
//     through, the site's countdown taken down;
//   * a new base tensor at a site Python packed at and told of (``ready``: its plan, and
//     the site's version then): packed here, as hooks._pack_new would, while the site's
//     version stays (sites.py moves it with every change of what the site would answer).
//
// Unpacks of packs (and of their views) it does itself where Python would only decode or
// hand back the tensor this backward decoded already: a clean pack of these hooks, its block
// a tensor on the stream it was made on, decoded by its plan's handle. The rest (pending,
// dense, offloaded or enclosed packs, another stream, the Python codec) go to hooks.py.
//
// It keeps Python's rules exactly: the base of a view that covers all of it, save sites
// keyed by (ordinal of the new base tensor since the hooks were entered, shape, dtype),
// bases by identity while they live and are unmodified (``_version``). The hooks' Python
// state is not held here (no reference cycle through a C++ object): the pack function holds
// the hooks weakly (autograd calls it only while they are entered), and the unpack
// function calls hooks.py's ``_unpack_saved``, which finds the hooks through what it is
// given.

#pragma once

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include "torch_host_common.h"
#include "torch_host_launch.h"
#include "torch_host_slots.h"

namespace {

// Save sites remembered, as sites.MAX_SITES (past it, forwards that never repeat).
constexpr size_t kMaxSites = 4096;

Tensor hooks_unpack(int64_t handle, const Tensor& block, at::IntArrayRef shape,
                    at::ScalarType dtype);
// A hooks pack queued: its block (undefined where no slot could be taken) and its slot's
// index and generation.
struct HooksPack {
  Tensor block;
  int64_t slot, generation;
};
HooksPack hooks_pack_queued(int64_t handle, const Tensor& a);

// What a weak reference points to (a new reference), or nullptr once it died.
PyObject* referent(PyObject* ref) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* obj = nullptr;
  return PyWeakref_GetRef(ref, &obj) < 0 ? nullptr : obj;
#else
  PyObject* obj = PyWeakref_GetObject(ref);   // borrowed; None once dead
  if (obj == nullptr || obj == Py_None) return nullptr;
  Py_INCREF(obj);
  return obj;
#endif
}

struct SavedHooksFront {
  // what a candidate is (compress_saved_tensors._candidate)
  int64_t min_numel = 1;
  bool on_cuda = false, on_cpu = false;
  std::array<bool, static_cast<size_t>(at::ScalarType::NumOptions)> dtypes{};
  // hooks enclose ours: every call goes to Python, which hands them what it keeps
  bool outer = false;
  PyObject* hooks_ref = nullptr;   // weak reference to the Python hooks object
  PyObject* new_fn = nullptr;      // unbound hooks methods and types (module-level: strong)
  PyObject* pack_fn = nullptr;
  PyObject* poll_fn = nullptr;
  PyObject* unpack_fn = nullptr;   // hooks._unpack_saved
  PyObject* packed_type = nullptr;
  PyObject* view_type = nullptr;
  PyObject* outer_type = nullptr;
  PyObject* clean_state = nullptr;   // hooks.CLEAN, the state of a pack backward may decode
  PyObject* dense_state = nullptr;   // hooks.DENSE, a pack that kept the dense tensor
  // the bases seen (while they live): version and the pack made of it (a weak reference),
  // or none where the save was passed through
  struct Base {
    c10::weak_intrusive_ptr<c10::TensorImpl> impl;
    int64_t version;
    PyObject* packed;   // weak reference, or nullptr
  };
  std::unordered_map<const c10::TensorImpl*, Base> bases;
  // save sites told to pass (by ordinal): their key and how many saves more
  struct Skip {
    std::vector<int64_t> shape;
    at::ScalarType dtype;
    int64_t left;
  };
  std::unordered_map<int64_t, Skip> skips;
  // save sites Python told to pack here (by ordinal): the key and the site's version they
  // were told at, the plan of the pack there (hooks._pack_new's, as long as the site's
  // version stays), and the site and plan objects a pack keeps
  struct Ready {
    std::vector<int64_t> shape;
    at::ScalarType dtype;
    int64_t device, version, handle, nbytes;
    PyObject* site = nullptr;   // strong
    PyObject* plan = nullptr;   // strong
  };
  std::unordered_map<int64_t, Ready> ready;
  int64_t ordinal = 0;
  // saves passed through and shared, packs decoded and decodes reused here (Python adds
  // them to its stats)
  int64_t passed = 0, shared = 0, unpacked = 0, reused = 0, tried = 0;
  // The oldest pack whose count the hooks have not taken in (hooks._flights[0]): every save
  // looks at its pinned slot, as Python's pack hook does, and has Python take the counts
  // in once it has landed (or can never land). kAsk: a count Python looks at itself (one
  // known on the host).
  enum Head { kNone, kSlot, kAsk };
  Head head = kNone;
  int64_t head_status = 0, head_generation_at = 0, head_generation = 0;

  // hooks._tell_head's record of the oldest pack in flight: none (status 0), its slot's
  // host address, the address of the slot's generation and the generation it was taken
  // at, or -1: Python looks itself.
  void show_head(int64_t status, int64_t generation_at, int64_t generation) {
    head = status == 0 ? kNone : status < 0 ? kAsk : kSlot;
    head_status = status;
    head_generation_at = generation_at;
    head_generation = generation;
  }

  bool head_landed() const {
    if (head == kAsk) return true;
    const auto* generation = reinterpret_cast<const volatile int64_t*>(head_generation_at);
    if (*generation != head_generation) return true;   // lost: Python gives up on it
    return *slot_status_at(head_status) != kSentinel32 &&
           *slot_count_at(head_status) != kSentinel64;
  }

  ~SavedHooksFront() {
    for (auto& item : bases) Py_XDECREF(item.second.packed);
    for (auto& item : ready) forget(item.second);
    for (PyObject* p : {hooks_ref, new_fn, pack_fn, poll_fn, unpack_fn, packed_type,
                        view_type, outer_type, clean_state, dense_state}) {
      Py_XDECREF(p);
    }
  }

  bool candidate(PyObject* obj, const Tensor** out) const {
    if (!THPVariable_CheckExact(obj)) return false;
    const Tensor& t = THPVariable_Unpack(obj);
    if (t.numel() < min_numel) return false;
    if (t.requires_grad() && t.is_leaf()) return false;   // parameters stay alive anyway
    if (!dtypes[static_cast<size_t>(t.scalar_type())]) return false;
    const bool device_ok = (t.is_cuda() && on_cuda) || (t.is_cpu() && on_cpu);
    if (!device_ok || t.layout() != at::kStrided || !t.is_contiguous()) return false;
    *out = &t;
    return true;
  }

  // Bases whose tensor died: their entries go (each keeps its TensorImpl's memory through
  // the weak reference).
  void forget_dead() {
    for (auto it = bases.begin(); it != bases.end();) {
      if (it->second.impl.expired()) {
        Py_XDECREF(it->second.packed);
        it = bases.erase(it);
      } else {
        ++it;
      }
    }
  }

  void remember(const Tensor& base, PyObject* packed) {
    if (bases.size() >= 4096) forget_dead();
    PyObject* ref = nullptr;
    if (packed != nullptr && packed != Py_None) {
      ref = PyWeakref_NewRef(packed, nullptr);
      if (ref == nullptr) PyErr_Clear();
    }
    auto found = bases.find(base.unsafeGetTensorImpl());
    if (found != bases.end()) {
      Py_XDECREF(found->second.packed);
      bases.erase(found);
    }
    bases.emplace(base.unsafeGetTensorImpl(),
                  Base{c10::weak_intrusive_ptr<c10::TensorImpl>(base.getIntrusivePtr()),
                       static_cast<int64_t>(base._version()), ref});
  }

  PyObject* pass(PyObject* obj) {
    ++passed;
    Py_INCREF(obj);
    return obj;
  }

  PyObject* hooks() const {
    PyObject* h = referent(hooks_ref);
    if (h == nullptr && !PyErr_Occurred()) {
      PyErr_SetString(PyExc_RuntimeError, "bitsparse: saved-tensor hooks used after they died");
    }
    return h;
  }

  PyObject* pack(PyObject* obj) {
    if (outer) {
      PyObject* h = hooks();
      if (h == nullptr) return nullptr;
      PyObject* r = PyObject_CallFunctionObjArgs(pack_fn, h, obj, nullptr);
      Py_DECREF(h);
      return r;
    }
    if (head != kNone && head_landed()) {
      PyObject* h = hooks();
      if (h == nullptr) return nullptr;
      PyObject* r = PyObject_CallOneArg(poll_fn, h);
      Py_DECREF(h);
      if (r == nullptr) return nullptr;
      Py_DECREF(r);
    }
    const Tensor* tp = nullptr;
    if (!candidate(obj, &tp)) return pass(obj);
    const Tensor& t = *tp;
    Tensor base = t;
    if (t.is_view()) base = Tensor(t._base());
    if (!base.is_same(t) && !(base.is_contiguous() && base.numel() == t.numel() &&
                              t.storage_offset() == base.storage_offset())) {
      base = t;   // a proper part of its base: packed as this view alone
    }
    const bool whole = base.is_same(t);
    const auto found = bases.find(base.unsafeGetTensorImpl());
    if (found != bases.end() && !found->second.impl.expired() &&
        found->second.version == static_cast<int64_t>(base._version())) {
      if (found->second.packed == nullptr) return pass(obj);
      PyObject* packed = referent(found->second.packed);
      if (packed == nullptr && PyErr_Occurred()) return nullptr;
      if (packed != nullptr) {
        PyObject* r = share(packed, obj, whole, t);
        Py_DECREF(packed);
        return r;
      }
      // the pack died before its base: a new save of it is a new base
    }
    ++ordinal;
    const auto skip = skips.find(ordinal);
    if (skip != skips.end() && skip->second.left > 0 && skip->second.dtype == base.scalar_type() &&
        base.sizes().equals(skip->second.shape)) {
      --skip->second.left;
      remember(base, nullptr);
      return pass(obj);
    }
    PyObject* h = hooks();
    if (h == nullptr) return nullptr;
    // (the pack made of the base or None, what autograd keeps for this save): here where
    // Python told this site to pack and it has not changed since, else Python's
    PyObject* r = nullptr;
    const auto rd = ready.find(ordinal);
    if (rd != ready.end() && rd->second.dtype == base.scalar_type() &&
        rd->second.device == (base.is_cuda() ? base.get_device() : -1) &&
        base.sizes().equals(rd->second.shape)) {
      r = pack_ready(rd->second, h, base, t, obj, whole);
      if (r == nullptr && PyErr_Occurred()) {
        Py_DECREF(h);
        return nullptr;
      }
    }
    if (r == nullptr) {
      PyObject* base_obj = whole ? (Py_INCREF(obj), obj) : THPVariable_Wrap(base);
      PyObject* ord = base_obj == nullptr ? nullptr : PyLong_FromLongLong(ordinal);
      if (ord != nullptr) r = PyObject_CallFunctionObjArgs(new_fn, h, base_obj, obj, ord, nullptr);
      Py_XDECREF(ord);
      Py_XDECREF(base_obj);
    }
    Py_DECREF(h);
    if (r == nullptr) return nullptr;
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
      Py_DECREF(r);
      PyErr_SetString(PyExc_TypeError, "bitsparse: hooks._front_new must return a pair");
      return nullptr;
    }
    remember(base, PyTuple_GET_ITEM(r, 0));
    PyObject* keep = PyTuple_GET_ITEM(r, 1);
    Py_INCREF(keep);
    Py_DECREF(r);
    return keep;
  }

  // hooks._pack_new for a site Python told to pack here (``R``), unless the site changed
  // since or the hooks' credit throttles it: the pack queued, the pending ``_Packed``
  // that keeps the dense tensor until its count lands, its entry in the flights and the
  // head, ``(packed, keep)`` as ``_front_new`` returns them. nullptr with no error set:
  // Python's ``_front_new`` takes the save.
  PyObject* pack_ready(const Ready& ready_site, PyObject* h, const Tensor& base,
                       const Tensor& t, PyObject* obj, bool whole) {
    static PyObject* const k_version = PyUnicode_InternFromString("version");
    static PyObject* const k_in_flight = PyUnicode_InternFromString("_in_flight");
    static PyObject* const k_credit = PyUnicode_InternFromString("_credit");
    static PyObject* const k_flights = PyUnicode_InternFromString("_flights");
    static PyObject* const k_append = PyUnicode_InternFromString("append");
    // copied and held here: the Python calls below may change the records
    const int64_t handle_id = ready_site.handle, bytes = ready_site.nbytes;
    const py::object site = py::reinterpret_borrow<py::object>(ready_site.site);
    const py::object plan = py::reinterpret_borrow<py::object>(ready_site.plan);
    if (int_attr(site.ptr(), k_version) != ready_site.version || PyErr_Occurred()) {
      return nullptr;
    }
    const int64_t in_flight = int_attr(h, k_in_flight);
    if (PyErr_Occurred()) return nullptr;
    if (in_flight != 0) {   // _pack_new's throttle: Python counts it
      const int64_t credit = int_attr(h, k_credit);
      if (PyErr_Occurred() || in_flight + bytes > credit) return nullptr;
    }
    return guarded([&]() -> PyObject* {
      const Tensor dense = base.detach();   // held while the count is on its way
      const HooksPack q = hooks_pack_queued(handle_id, dense);
      if (!q.block.defined()) {   // no slot for its count: passed through
        ++passed;
        return Py_BuildValue("(OO)", Py_None, obj);
      }
      const auto made = [](PyObject* p) {
        if (p == nullptr) throw python_error();
        return py::reinterpret_steal<py::object>(p);
      };
      const py::object dense_obj = made(THPVariable_Wrap(dense));
      const py::object block = made(THPVariable_Wrap(q.block));
      const py::object key = made(Py_BuildValue("(LL)", static_cast<long long>(q.slot),
                                                static_cast<long long>(q.generation)));
      const py::object stream =
          base.is_cuda() ? made(PyLong_FromUnsignedLongLong(
                               reinterpret_cast<uintptr_t>(current_stream(base.device()))))
                         : py::none();
      const py::object handle = made(PyLong_FromLongLong(handle_id));
      const py::object nbytes = made(PyLong_FromLongLong(bytes));
      const py::object packed = made(PyObject_CallFunctionObjArgs(
          packed_type, h, site.ptr(), block.ptr(), plan.ptr(), handle.ptr(), key.ptr(), Py_None,
          dense_obj.ptr(), stream.ptr(), nbytes.ptr(), nullptr));
      const py::object weak = made(PyWeakref_NewRef(packed.ptr(), nullptr));
      const py::object entry = made(Py_BuildValue(
          "(OOOLOO)", key.ptr(), Py_None, site.ptr(), static_cast<long long>(base.numel()),
          nbytes.ptr(), weak.ptr()));
      const py::object flights = made(PyObject_GetAttr(h, k_flights));
      made(PyObject_CallMethodOneArg(flights.ptr(), k_append, entry.ptr()));
      if (PyObject_Length(flights.ptr()) == 1) {   // hooks._tell_head
        show_head(slab.base + 16 * q.slot, reinterpret_cast<int64_t>(slot_generation(q.slot)),
                  q.generation);
      }
      if (set_int(h, k_in_flight, in_flight + bytes) < 0) throw python_error();
      ++tried;
      const py::object keep = whole ? packed : made(view_of(packed.ptr(), t));
      return Py_BuildValue("(OO)", packed.ptr(), keep.ptr());
    });
  }

  // A _View of ``packed`` for a save of ``t``'s shape.
  PyObject* view_of(PyObject* packed, const Tensor& t) {
    PyObject* shape = PyTuple_New(t.dim());
    if (shape == nullptr) return nullptr;
    for (int64_t i = 0; i < t.dim(); ++i) {
      PyObject* n = PyLong_FromLongLong(t.size(i));
      if (n == nullptr) {
        Py_DECREF(shape);
        return nullptr;
      }
      PyTuple_SET_ITEM(shape, i, n);
    }
    PyObject* view = PyObject_CallFunctionObjArgs(view_type, packed, shape, nullptr);
    Py_DECREF(shape);
    return view;
  }

  static void forget(Ready& r) {
    Py_XDECREF(r.site);
    Py_XDECREF(r.plan);
    r.site = r.plan = nullptr;
  }

  // A save of a base already packed (hooks._share): passed through where its pack
  // kept the dense tensor, else answered by the pack (or a view of it), one more save of it.
  PyObject* share(PyObject* packed, PyObject* obj, bool whole, const Tensor& t) {
    static PyObject* const k_state = PyUnicode_InternFromString("state");
    static PyObject* const k_saves = PyUnicode_InternFromString("saves");
    {
      Attr state(packed, k_state);
      if (state.get() == nullptr) return nullptr;
      if (state.get() == dense_state) return pass(obj);
    }
    const int64_t saves = int_attr(packed, k_saves);
    if (PyErr_Occurred() || set_int(packed, k_saves, saves + 1) < 0) return nullptr;
    ++shared;
    if (whole) {
      Py_INCREF(packed);
      return packed;
    }
    return view_of(packed, t);
  }

  PyObject* unpack(PyObject* obj) {
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
    if (type != packed_type && type != view_type && type != outer_type) {
      Py_INCREF(obj);
      return obj;
    }
    PyObject* r = nullptr;
    if (type == packed_type) {
      r = unpack_here(obj);
    } else if (type == view_type) {   // the base's tensor, viewed as the saved shape
      r = unpack_view_here(obj);
    }
    if (r != nullptr || PyErr_Occurred()) return r;
    return PyObject_CallOneArg(unpack_fn, obj);
  }

  PyObject* unpack_view_here(PyObject* view) {
    static PyObject* const k_base = PyUnicode_InternFromString("base");
    static PyObject* const k_shape = PyUnicode_InternFromString("shape");
    PyObject* base = PyObject_GetAttr(view, k_base);
    if (base == nullptr) return nullptr;
    PyObject* t = Py_TYPE(base) == reinterpret_cast<PyTypeObject*>(packed_type)
                      ? unpack_here(base) : nullptr;
    Py_DECREF(base);
    if (t == nullptr) return nullptr;
    PyObject* shape = PyObject_GetAttr(view, k_shape);
    PyObject* r = shape == nullptr ? nullptr : guarded([&] {
      return THPVariable_Wrap(THPVariable_Unpack(t).view(int_sequence(shape)));
    });
    Py_XDECREF(shape);
    Py_DECREF(t);
    return r;
  }

  // hooks._unpack's common case, without Python: a clean pack of these hooks whose backward
  // decodes it (its block a tensor on the current stream, its plan this extension's), or
  // takes the tensor an earlier node of this backward decoded. nullptr with no error set:
  // Python's _unpack takes it (and looks at the counts in flight itself).
  PyObject* unpack_here(PyObject* packed) {
    static PyObject* const k_owner = PyUnicode_InternFromString("owner");
    static PyObject* const k_state = PyUnicode_InternFromString("state");
    static PyObject* const k_unpacked = PyUnicode_InternFromString("unpacked");
    static PyObject* const k_to_unpack = PyUnicode_InternFromString("to_unpack");
    static PyObject* const k_saves = PyUnicode_InternFromString("saves");
    static PyObject* const k_keep = PyUnicode_InternFromString("keep");
    static PyObject* const k_block = PyUnicode_InternFromString("block");
    static PyObject* const k_handle = PyUnicode_InternFromString("handle");
    static PyObject* const k_stream = PyUnicode_InternFromString("stream");
    static PyObject* const k_shape = PyUnicode_InternFromString("shape");
    static PyObject* const k_dtype = PyUnicode_InternFromString("dtype");
    if (outer) return nullptr;   // no head kept then (hooks._tell_head): Python polls
    PyObject* h = referent(hooks_ref);
    if (h == nullptr) {          // the hooks died: Python's path says so
      PyErr_Clear();
      return nullptr;
    }
    Attr owner(packed, k_owner);
    bool go = owner.get() == h;
    if (go && head != kNone && head_landed()) {   // _unpack's _poll(forward=False)
      PyObject* r = PyObject_CallFunctionObjArgs(poll_fn, h, Py_False, nullptr);
      go = r != nullptr;
      Py_XDECREF(r);
    }
    Py_DECREF(h);
    if (!go) return nullptr;
    if (Attr(packed, k_state).get() != clean_state) return nullptr;
    // the tensor an earlier unpack of this backward made, while alive
    Attr ref(packed, k_unpacked);
    if (ref.get() == nullptr) return nullptr;
    PyObject* alive = ref.get() == Py_None ? nullptr : referent(ref.get());
    if (alive != nullptr) {
      const int64_t left = int_attr(packed, k_to_unpack) - 1;
      if (PyErr_Occurred() || set_int(packed, k_to_unpack, left) < 0 ||
          (left <= 0 && PyObject_SetAttr(packed, k_keep, Py_None) < 0)) {
        Py_DECREF(alive);
        return nullptr;
      }
      ++reused;
      return alive;
    }
    if (PyErr_Occurred()) return nullptr;
    Attr block(packed, k_block), handle(packed, k_handle), stream(packed, k_stream),
        shape(packed, k_shape), dtype(packed, k_dtype);
    if (PyErr_Occurred() || !THPVariable_CheckExact(block.get()) || handle.get() == Py_None ||
        !THPDtype_Check(dtype.get())) {
      return nullptr;
    }
    PyObject* out = guarded([&]() -> PyObject* {
      const Tensor& b = THPVariable_Unpack(block.get());
      if (stream.get() != Py_None) {   // made on another stream: Python orders the read
        const auto made = PyLong_AsUnsignedLongLong(stream.get());
        if (made == static_cast<unsigned long long>(-1) && PyErr_Occurred()) throw python_error();
        if (made != reinterpret_cast<uintptr_t>(current_stream(b.device()))) return nullptr;
      }
      const int64_t id = PyLong_AsLongLong(handle.get());
      if (id == -1 && PyErr_Occurred()) throw python_error();
      return THPVariable_Wrap(hooks_unpack(id, b, int_sequence(shape.get()),
                                           reinterpret_cast<THPDtype*>(dtype.get())->scalar_type));
    });
    if (out == nullptr) return nullptr;
    // held until every other node that saved it has unpacked it (hooks._unpack)
    const int64_t saves = int_attr(packed, k_saves);
    PyObject* weak = PyErr_Occurred() ? nullptr : PyWeakref_NewRef(out, nullptr);
    const bool ok = weak != nullptr && PyObject_SetAttr(packed, k_unpacked, weak) == 0 &&
                    set_int(packed, k_to_unpack, saves - 1) == 0 &&
                    PyObject_SetAttr(packed, k_keep, saves > 1 ? out : Py_None) == 0;
    Py_XDECREF(weak);
    if (!ok) {
      Py_DECREF(out);
      return nullptr;
    }
    ++unpacked;
    return out;
  }

  // An attribute read (a new reference, released at the end of the scope; nullptr with the
  // error set where it failed).
  struct Attr {
    PyObject* obj;
    Attr(PyObject* owner, PyObject* name) : obj(PyObject_GetAttr(owner, name)) {}
    ~Attr() { Py_XDECREF(obj); }
    Attr(const Attr&) = delete;
    Attr& operator=(const Attr&) = delete;
    PyObject* get() const { return obj; }
  };

  // f() with torch's and Python's errors turned into a set Python error and nullptr.
  template <typename F>
  static PyObject* guarded(F f) {
    HANDLE_TH_ERRORS
    return f();
    END_HANDLE_TH_ERRORS_RET(nullptr)
  }

  static int64_t int_attr(PyObject* obj, PyObject* name) {
    PyObject* v = PyObject_GetAttr(obj, name);
    if (v == nullptr) return -1;
    const int64_t n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return n;
  }

  static int set_int(PyObject* obj, PyObject* name, int64_t n) {
    PyObject* v = PyLong_FromLongLong(n);
    if (v == nullptr) return -1;
    const int r = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return r;
  }

  // A shape tuple's sizes (an error set where it is not a sequence of ints).
  static std::vector<int64_t> int_sequence(PyObject* seq) {
    std::vector<int64_t> out;
    PyObject* fast = PySequence_Fast(seq, "bitsparse: a shape must be a sequence");
    if (fast == nullptr) throw python_error();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    out.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      out.push_back(PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i)));
    }
    Py_DECREF(fast);
    if (PyErr_Occurred()) throw python_error();
    return out;
  }
};

const char* const kFrontCapsule = "bitsparse.SavedHooksFront";

SavedHooksFront* front_of(PyObject* capsule) {
  return static_cast<SavedHooksFront*>(PyCapsule_GetPointer(capsule, kFrontCapsule));
}

SavedHooksFront& front_at(const py::capsule& capsule) {
  SavedHooksFront* f = front_of(capsule.ptr());
  if (f == nullptr) throw py::error_already_set();
  return *f;
}

PyObject* front_pack(PyObject* capsule, PyObject* obj) {
  SavedHooksFront* f = front_of(capsule);
  return f == nullptr ? nullptr : f->pack(obj);
}

PyObject* front_unpack(PyObject* capsule, PyObject* obj) {
  SavedHooksFront* f = front_of(capsule);
  return f == nullptr ? nullptr : f->unpack(obj);
}

PyMethodDef front_pack_def = {"saved_tensor_pack", front_pack, METH_O,
                              "compress_saved_tensors' pack hook (C++ front)"};
PyMethodDef front_unpack_def = {"saved_tensor_unpack", front_unpack, METH_O,
                                "compress_saved_tensors' unpack hook (C++ front)"};

// ``(capsule, pack, unpack)``: the front's state and the two hooks autograd calls.
py::tuple make_hooks_front(py::object hooks, py::object new_fn,
                           py::object pack_fn, py::object poll_fn, py::object unpack_fn,
                           py::object packed_type, py::object view_type, py::object outer_type,
                           py::object clean_state, py::object dense_state, int64_t min_numel,
                           bool on_cuda, bool on_cpu, const std::vector<py::object>& dtypes) {
  auto* f = new SavedHooksFront();
  py::capsule capsule(f, kFrontCapsule, [](PyObject* c) {
    delete static_cast<SavedHooksFront*>(PyCapsule_GetPointer(c, kFrontCapsule));
  });
  f->hooks_ref = PyWeakref_NewRef(hooks.ptr(), nullptr);
  if (f->hooks_ref == nullptr) throw py::error_already_set();
  for (auto [slot, obj] : {std::pair<PyObject**, py::object*>{&f->new_fn, &new_fn},
                           {&f->pack_fn, &pack_fn}, {&f->poll_fn, &poll_fn},
                           {&f->unpack_fn, &unpack_fn}, {&f->packed_type, &packed_type},
                           {&f->view_type, &view_type}, {&f->outer_type, &outer_type},
                           {&f->clean_state, &clean_state}, {&f->dense_state, &dense_state}}) {
    *slot = obj->inc_ref().ptr();
  }
  f->min_numel = std::max<int64_t>(1, min_numel);
  f->on_cuda = on_cuda;
  f->on_cpu = on_cpu;
  for (const py::object& d : dtypes) {
    TORCH_CHECK(THPDtype_Check(d.ptr()), "bitsparse: a torch.dtype expected");
    f->dtypes[static_cast<size_t>(reinterpret_cast<THPDtype*>(d.ptr())->scalar_type)] = true;
  }
  py::object pack(py::reinterpret_steal<py::object>(
      PyCFunction_New(&front_pack_def, capsule.ptr())));
  py::object unpack(py::reinterpret_steal<py::object>(
      PyCFunction_New(&front_unpack_def, capsule.ptr())));
  if (!pack || !unpack) throw py::error_already_set();
  return py::make_tuple(capsule, pack, unpack);
}

// The hooks' pack of ``a`` by the plain pack plan ``handle``, queued on the current stream
// with its count going to a slot of this file's ring: ``(block, slot index, generation)``,
// the block None where no slot could be taken (a graph capture, every slot in flight; a
// pack whose count cannot come back is of no use to the hooks). One allocation: the pack's
// scratch rides behind the block (ops.pack_plain's layout).
HooksPack hooks_pack_queued(int64_t handle, const Tensor& a) {
  const Plan& P = plan_at(handle);
  TORCH_CHECK(a.numel() == P.numel && P.numel > 0, "bitsparse: plan of ", P.numel,
              " elements for ", a.numel());
  TORCH_CHECK(a.is_contiguous(), "bitsparse: the hooks pack contiguous tensors");
  c10::DeviceGuard device_guard(a.device());
  void* stream = current_stream(a.device());
  const auto [i, generation] = claim_slot(stream);
  if (i < 0) return {Tensor(), i, generation};
  Tensor whole = at::empty({P.nbytes + P.scratch_bytes}, a.options().dtype(at::kByte));
  const uint64_t b = address(whole), scratch = b + static_cast<uint64_t>(P.nbytes);
  memset0(scratch, P.scratch_bytes, stream);
  P.pack.run(stream, b, {address(a), 0, scratch, 0, 0, 0,
                         static_cast<uint64_t>(slab.base + 16 * i)});
  return {whole.narrow(0, 0, P.nbytes), i, generation};
}

py::tuple hooks_pack(int64_t handle, const Tensor& a) {
  const HooksPack p = hooks_pack_queued(handle, a);
  if (!p.block.defined()) return py::make_tuple(py::none(), p.slot, p.generation);
  return py::make_tuple(p.block, p.slot, p.generation);
}

// The dense tensor of a block packed by ``handle``'s plan, decoded on the current stream.
Tensor hooks_unpack(int64_t handle, const Tensor& block, at::IntArrayRef shape,
                    at::ScalarType dtype) {
  const Plan& P = plan_at(handle);
  TORCH_CHECK(block.numel() >= P.nbytes, "bitsparse: a block of ", block.numel(),
              " bytes for a plan of ", P.nbytes);
  c10::DeviceGuard device_guard(block.device());
  Tensor out = at::empty(shape, block.options().dtype(dtype));
  TORCH_CHECK(out.numel() == P.numel, "bitsparse: plan of ", P.numel, " elements for ",
              out.numel());
  P.unpack.run(current_stream(block.device()), address(block), {0, 0, 0, 0, address(out), 0});
  return out;
}

void def_hooks_front(py::module_& m) {
  m.def("hooks_pack", &hooks_pack);
  m.def("hooks_unpack", &hooks_unpack);
  m.def("hooks_front", &make_hooks_front);
  // A forward begins: ordinals count from 0; the entries of bases that died go.
  m.def("hooks_front_enter", [](const py::capsule& c, bool outer) {
    SavedHooksFront& f = front_at(c);
    f.outer = outer;
    f.ordinal = 0;
    f.forget_dead();
  });
  m.def("hooks_front_skip", [](const py::capsule& c, int64_t ordinal,
                               std::vector<int64_t> shape, py::object dtype, int64_t left) {
    SavedHooksFront& f = front_at(c);
    TORCH_CHECK(THPDtype_Check(dtype.ptr()), "bitsparse: a torch.dtype expected");
    if (f.skips.size() >= kMaxSites) f.skips.clear();   // forwards that never repeat
    f.skips[ordinal] = SavedHooksFront::Skip{
        std::move(shape), reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type, left};
  });
  // The oldest pack in flight (SavedHooksFront::show_head).
  m.def("hooks_front_head", [](const py::capsule& c, int64_t status, int64_t generation_at,
                               int64_t generation) {
    front_at(c).show_head(status, generation_at, generation);
  });
  // (saves passed through, saves shared, packs decoded, decodes reused, packs tried) since
  // the last call
  m.def("hooks_front_take_counts", [](const py::capsule& c) {
    SavedHooksFront& f = front_at(c);
    const auto counts = py::make_tuple(f.passed, f.shared, f.unpacked, f.reused, f.tried);
    f.passed = f.shared = f.unpacked = f.reused = f.tried = 0;
    return counts;
  });
  // A site where hooks._pack_new just packed by a C++ plan: the next saves there pack here
  // (the site, its version, the plan object, its handle, the block's bytes), until the
  // site's version moves.
  m.def("hooks_front_ready", [](const py::capsule& c, int64_t ordinal, std::vector<int64_t> shape,
                                py::object dtype, int64_t device, py::object site,
                                int64_t version, py::object plan, int64_t handle,
                                int64_t nbytes) {
    SavedHooksFront& f = front_at(c);
    TORCH_CHECK(THPDtype_Check(dtype.ptr()), "bitsparse: a torch.dtype expected");
    if (f.ready.size() >= kMaxSites) {   // forwards that never repeat
      for (auto& item : f.ready) SavedHooksFront::forget(item.second);
      f.ready.clear();
    }
    auto& r = f.ready[ordinal];
    SavedHooksFront::forget(r);
    r = SavedHooksFront::Ready{std::move(shape),
                               reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type, device,
                               version, handle, nbytes, site.inc_ref().ptr(),
                               plan.inc_ref().ptr()};
  });
}

}  // namespace
