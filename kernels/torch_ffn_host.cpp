// The CUDA host path of bitsparse's packed ReLU / ReLU² FFN op, in C++.
//
// bitsparse_core/torch/native.py builds this file as a PyTorch C++ extension (no
// CUDA headers or nvcc needed: the kernels are CuPy's, launched through the
// driver entry points Python hands over) and uses it for CUDA tensors. The op's
// semantics are those of bitsparse::relu_linear and
// bitsparse::relu_linear_backward (bitsparse_core/torch/ops.py): the same GEMMs and
// kernels in the same order, so the two paths give the same bits. What moves here
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
//
// The parts: torch_host_common.h (driver entry points, helpers), torch_host_launch.h
// (launch templates, plans), torch_host_slots.h (counts on the host),
// torch_host_offload.h (the offload engine), torch_host_hooks.h (the saved-tensor hooks'
// first look at each save, their packs and unpacks), torch_host_exact.h (an exact pack's
// wait and shrink), torch_host_public.h (the public codec ops' allocations and launches,
// for bitsparse_core/torch/native_codec.py); this file: the op, its autograd node, its dispatcher kernels and the
// module.

#include "torch_host_common.h"
#include "torch_host_exact.h"
#include "torch_host_graphs.h"
#include "torch_host_hooks.h"
#include "torch_host_launch.h"
#include "torch_host_offload.h"
#include "torch_host_public.h"
#include "torch_host_slots.h"

#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

using torch::autograd::variable_list;

namespace {

// The views the op's GEMMs take, each made with one as_strided: reshape's and t()'s views
// cost two and three dispatcher round trips, host time every layer pays. Only where both
// sizes exceed 1, so that the strides are the ones those views would have (a size-1
// dimension's stride is free, and cuBLAS's choice of call may read it).
Tensor as_matrix(const Tensor& t, int64_t cols) {
  const int64_t rows = cols > 0 ? t.numel() / cols : 0;
  if (rows < 2 || cols < 2 || !t.is_contiguous()) return t.reshape({-1, cols});
  return t.as_strided({rows, cols}, {cols, 1});
}

Tensor transposed(const Tensor& m) {
  const int64_t rows = m.size(0), cols = m.size(1);
  if (rows < 2 || cols < 2 || m.stride(0) != cols || m.stride(1) != 1) return m.t();
  return m.as_strided({cols, rows}, {1, cols});
}

// PyTorch's linear backward on the 2-D views (ops.py: _linear_weight_grad / _input_grad).
Tensor weight_grad(const Tensor& g2, const Tensor& h, int64_t mm_dtype) {
  const Tensor hm = mm_dtype >= 0 ? h.to(static_cast<at::ScalarType>(mm_dtype)) : h;
  return transposed(g2).mm(as_matrix(hm, hm.size(-1)));
}

Tensor input_grad(const Tensor& g2, const Tensor& weight, at::IntArrayRef a_shape,
                  at::ScalarType a_dtype) {
  Tensor grad_h = g2.mm(weight).view(a_shape);
  return grad_h.scalar_type() == a_dtype ? grad_h : grad_h.to(a_dtype);
}

// at::linear(y, weight, bias) for the forward's y, the first elements of ``ystore`` laid
// out as ``a`` (contiguous). Where linear takes addmm on the 2-D views (a bias, y of 2 or
// 3 dims) this makes that call with the views made directly (as_matrix, transposed): the
// same GEMM on the same strides, with fewer dispatcher round trips a layer.
Tensor forward_linear(const Tensor& ystore, const Tensor& a, const Tensor& weight,
                      const std::optional<Tensor>& bias, int64_t mm_dtype) {
  const at::IntArrayRef shape = a.sizes();
  const int64_t in = shape.empty() ? 0 : shape.back();
  const int64_t rows = in > 0 ? a.numel() / in : 0;
  const bool direct = mm_dtype < 0 && bias.has_value() && bias->defined() &&
                      (shape.size() == 2 || shape.size() == 3) && rows >= 2 && in >= 2 &&
                      weight.dim() == 2 && ystore.scalar_type() == weight.scalar_type();
  if (!direct) {
    const Tensor y = ystore.as_strided(shape, a.strides());
    return at::linear(mm_dtype >= 0 ? y.to(static_cast<at::ScalarType>(mm_dtype)) : y,
                      weight, bias);
  }
  const Tensor out = at::addmm(*bias, ystore.as_strided({rows, in}, {in, 1}, 0),
                               transposed(weight));
  return shape.size() == 2 ? out : out.view({shape[0], shape[1], weight.size(0)});
}

// ---------------------------------------------------------------------------
// The op's two halves (shared by the autograd node and the dispatcher's kernels)
// ---------------------------------------------------------------------------
struct Forward {
  Tensor out, block;
  Ticket ticket;
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
  const Ticket ticket = claim_slot(stream);
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
  Tensor out = forward_linear(ystore, a, weight, bias, mm_dtype);
  return {out, block, ticket, std::move(stash)};
}

// Whether the backward may read the packed values: the slot says clean (and the policy's
// poll is not due), else Python's policy decides (waits, recomputes, or raises where
// there is no recompute source).
bool decide_clean(const Ticket& ticket, int64_t policy, int64_t handle, const Tensor& block,
                  bool recompute_source, bool gated = false) {
  return (slot_shows_clean(ticket) && !poll_due(policy))
         || pack_is_clean(handle, policy, ticket, block, recompute_source, gated);
}

struct Grads {
  Tensor a, weight, bias;   // undefined where not asked for
};

// Backward: PyTorch's linear backward on the 2-D views, relu's (or relu²'s) gradient and
// the second GEMM's input from the packed block when clean, else from the forward's own
// first GEMM recomputed (x, w1, b1). A clean gradient is written over grad_h (its own
// buffer: every thread reads its gradient vector before it stores there) and the
// decoded activation is dropped once the weight gradient is queued, so the backward
// holds no more activation-sized buffers than dense PyTorch's.
Grads backward_impl(const Tensor& grad_out, const Tensor& block, const Tensor& weight,
                    const Tensor& x, const Tensor& w1, const Tensor& b1,
                    at::IntArrayRef a_shape, at::ScalarType a_dtype, const Plan& P, bool clean,
                    bool square, int64_t mm_dtype, bool need_a, bool need_w, bool need_b) {
  Grads g;
  const Tensor g2 = as_matrix(grad_out.contiguous(), grad_out.size(-1));
  if (need_b) g.bias = g2.sum({0}, true).view({g2.size(-1)});
  if (!need_a && !need_w) return g;
  c10::DeviceGuard device_guard(block.device());
  void* stream = current_stream(block.device());
  const uint64_t b = address(block);

  if (clean && square && need_a && need_w) {
    // one decode gives both the input gradient and the second GEMM's input
    const Tensor grad_h = input_grad(g2, weight, a_shape, a_dtype).contiguous();
    const Tensor h = at::empty_like(grad_h);
    P.relu2_and_square.run(stream, b, {0, 0, 0, address(grad_h), address(grad_h), address(h)});
    g.a = grad_h;
    g.weight = weight_grad(g2, h, mm_dtype);
    return g;
  }
  Tensor r;   // a clean gradient reads the packed block: r only for the weight gradient
  if (clean && need_w) {
    r = at::empty(a_shape, grad_out.options().dtype(a_dtype));
    P.unpack.run(stream, b, {0, 0, 0, 0, address(r), 0});
  } else if (!clean) {
    // overflowed or count unknown: the forward's own GEMM, autocast off as there
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    r = at::relu(at::linear(x, w1, maybe(b1)));
  }
  if (need_w) {
    // the forward's relu(a)**2, rounded the same single way; in place where r is
    // not needed again
    g.weight = weight_grad(g2, square ? (clean ? r.mul_(r) : r * r) : r, mm_dtype);
    if (clean) r.reset();   // stream-ordered: grad_h may take its memory next
  }
  if (need_a) {
    const Tensor grad_h = input_grad(g2, weight, a_shape, a_dtype);
    if (clean) {
      const Tensor gh = grad_h.contiguous();
      const Launch& grad_of_mask = square ? P.relu2 : P.mask_select;
      grad_of_mask.run(stream, b, {0, 0, 0, address(gh), address(gh), 0});
      g.a = gh;
    } else if (square) {
      g.a = at::threshold_backward(grad_h * (2 * r), r, 0);
    } else {
      g.a = at::threshold_backward(grad_h, r, 0);
    }
  }
  return g;
}

// The side stream a captured backward's conditional node captures its bodies on, or none
// where the node does not apply: no conditional-node support, the side stream not warmed
// by an eager backward yet, GEMM dtypes that differ from the activation's, or a recompute
// input linear() would not take straight to one GEMM (x contiguous, 2-D or 3-D; each of
// the ``firsts``, the forward's first GEMMs' weights, 2-D).
std::optional<c10::Stream> conditional_side_stream(const c10::Device& device,
                                                   const Tensor& grad_out, const Tensor& weight,
                                                   const Tensor& x,
                                                   std::initializer_list<Tensor> firsts,
                                                   at::ScalarType a_dtype, int64_t mm_dtype,
                                                   void* stream) {
  if (!device.is_cuda() || !graph_driver_ready(device.index()) || !x.defined() ||
      mm_dtype >= 0 || weight.scalar_type() != a_dtype || grad_out.scalar_type() != a_dtype ||
      !x.is_contiguous() || x.dim() < 2 || x.dim() > 3 || x.scalar_type() != a_dtype) {
    return std::nullopt;
  }
  for (const Tensor& w : firsts) {
    if (w.dim() != 2 || w.scalar_type() != a_dtype) return std::nullopt;
  }
  return side_stream(device, a_dtype, stream);
}

// linear(x2, w, b) into the 2-D ``out``, the addmm or mm that linear() makes on 2-D views
// (a recompute body's first GEMM).
void linear_out(Tensor out, const Tensor& x2, const Tensor& w, const Tensor& b) {
  if (b.defined()) {
    at::addmm_out(out, b, x2, transposed(w));
  } else {
    at::mm_out(out, x2, transposed(w));
  }
}

// Where the backward is being captured into a CUDA graph, ``conditional(stream)`` queues it
// as one conditional node (true) or declines, having queued nothing (false); outside a
// capture an eager backward prepares the side stream instead, so that later captures can,
// and this returns false.
template <class Conditional>
bool captured_or_warmed(const Tensor& block, at::ScalarType a_dtype, int64_t policy,
                        Conditional&& conditional) {
  void* stream = current_stream(block.device());
  if (!capturing(stream)) {
    warm_side_stream(block.device(), a_dtype, policy);
    return false;
  }
  return conditional(stream);
}

// Backward within a CUDA graph capture: the clean way and the recompute as the two bodies
// of one conditional node (torch_host_graphs.h), so a replay recomputes only where its own
// pack overflowed. Both bodies write the same outputs, made before the node with every
// buffer either needs; each repeats backward_impl's calls in its out= / in-place forms
// (the same kernels on the same sizes and strides, so the same bits). Returns false, having
// queued nothing, where this does not apply (conditional_side_stream; the caller then
// recomputes as before).
bool backward_conditional(Grads& g, const Tensor& grad_out, const Tensor& block,
                          const Tensor& weight, const Tensor& x, const Tensor& w1,
                          const Tensor& b1, at::IntArrayRef a_shape, at::ScalarType a_dtype,
                          const Plan& P, bool square, int64_t mm_dtype, bool need_a,
                          bool need_w, bool need_b, int64_t policy, void* stream) {
  const c10::Device device = block.device();
  const std::optional<c10::Stream> side =
      conditional_side_stream(device, grad_out, weight, x, {w1}, a_dtype, mm_dtype, stream);
  if (!side) return false;
  const Tensor g2 = as_matrix(grad_out.contiguous(), grad_out.size(-1));
  if (need_b) g.bias = g2.sum({0}, true).view({g2.size(-1)});
  if (!need_a && !need_w) return true;
  const auto opts = grad_out.options().dtype(a_dtype);
  const int64_t f = weight.size(1);
  if (need_a) g.a = at::empty(a_shape, opts);
  if (need_w) g.weight = at::empty(weight.sizes(), weight.options());
  Tensor r = at::empty(a_shape, opts);                          // relu(a), or h
  Tensor tmp = square ? at::empty(a_shape, opts) : Tensor();    // relu² products
  Tensor ga2 = need_a ? as_matrix(g.a, f) : Tensor();
  const Tensor g2t = transposed(g2);
  const uint64_t b = address(block);
  void* body = side->native_handle();

  ConditionalCapture node(stream, b + static_cast<uint64_t>(P.status_offset),
                          replay_counter(policy), *side, device);
  // the pack was clean: the packed block
  if (square && need_a && need_w) {
    at::mm_out(ga2, g2, weight);
    P.relu2_and_square.run(body, b, {0, 0, 0, address(g.a), address(g.a), address(r)});
    at::mm_out(g.weight, g2t, as_matrix(r, f));
  } else {
    if (need_w) {
      P.unpack.run(body, b, {0, 0, 0, 0, address(r), 0});
      if (square) r.mul_(r);
      at::mm_out(g.weight, g2t, as_matrix(r, f));
    }
    if (need_a) {
      at::mm_out(ga2, g2, weight);
      const Launch& grad_of_mask = square ? P.relu2 : P.mask_select;
      grad_of_mask.run(body, b, {0, 0, 0, address(g.a), address(g.a), 0});
    }
  }
  node.otherwise();
  // it overflowed: the forward's first GEMM again (linear's own addmm / mm on the 2-D views)
  {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    linear_out(as_matrix(r, f), as_matrix(x, x.size(-1)), w1, b1);
    r.relu_();
    if (need_w) {
      if (square) at::mul_out(tmp, r, r);
      at::mm_out(g.weight, g2t, as_matrix(square ? tmp : r, f));
    }
    if (need_a) {
      at::mm_out(ga2, g2, weight);
      if (square) {   // threshold_backward(grad_h * (2 * r), r, 0)
        tmp.copy_(r).mul_(2).mul_(g.a);
        at::threshold_backward_out(g.a, tmp, r, 0);
      } else {
        at::threshold_backward_out(g.a, g.a, r, 0);
      }
    }
  }
  node.finish();
  return true;
}

// captured_or_warmed with backward_conditional.
bool backward_captured(Grads& g, const Tensor& grad_out, const Tensor& block,
                       const Tensor& weight, const Tensor& x, const Tensor& w1, const Tensor& b1,
                       at::IntArrayRef a_shape, at::ScalarType a_dtype, const Plan& P,
                       bool square, int64_t mm_dtype, bool need_a, bool need_w, bool need_b,
                       int64_t policy) {
  return captured_or_warmed(block, a_dtype, policy, [&](void* stream) {
    return backward_conditional(g, grad_out, block, weight, x, w1, b1, a_shape, a_dtype, P,
                                square, mm_dtype, need_a, need_w, need_b, policy, stream);
  });
}

// ---------------------------------------------------------------------------
// The gated op's two halves (ReGLU: linear(relu(g) * u)); ops.gated_relu_linear and
// gated_relu_linear_backward in C++, the same kernels and GEMMs in the same order
// ---------------------------------------------------------------------------
struct GatedForward {
  Tensor out, block_r, block_u;
  Ticket ticket;
};

// The roles of a gated op's launches: u's masked pack and unpack read relu(g)'s mask (and
// offsets) from block_r; the gated backward reads u's values and signs from block_u.
Roles gated_roles(const Plan& R, uint64_t br, const Plan& U, uint64_t bu) {
  Roles roles{};
  roles[R_MASK] = br + static_cast<uint64_t>(R.spans[0]);
  roles[R_OFFSETS] = br + static_cast<uint64_t>(R.spans[1]);
  roles[R_UVALUES] = bu + static_cast<uint64_t>(U.spans[2]);
  roles[R_USIGNS] = bu + static_cast<uint64_t>(U.spans[3]);
  return roles;
}

// The roles of the launch that writes r * u from both blocks into ``h``.
Roles gated_product_roles(const Roles& planes, const Tensor& h) {
  Roles roles = planes;
  roles[R_OUT] = address(h);
  return roles;
}

// Forward: take the pack's ticket (tracked for ``policy``), pack relu(g) into block_r (the
// kernel, mode RELU_GATED, writes h = relu(g) * u densely and its count to the ticket's
// slot) and u where g > 0 into block_u (a masked pack reading block_r's mask), then
// return linear(h, weight, bias) and both blocks. One allocation for h and the packs'
// scratch (zeroed before each pack). g and u are contiguous (every caller's check).
GatedForward gated_forward_impl(const Tensor& g, const Tensor& u, const Tensor& weight,
                                const std::optional<Tensor>& bias, const Plan& R,
                                const Plan& U, int64_t policy, int64_t capacity,
                                int64_t mm_dtype) {
  TORCH_CHECK(g.numel() == R.numel && u.numel() == U.numel, "bitsparse: plans of ", R.numel,
              " elements for ", g.numel());
  c10::DeviceGuard device_guard(g.device());
  void* stream = current_stream(g.device());
  const Ticket ticket = claim_slot(stream);
  track(policy, ticket, g.numel(), capacity);
  const int64_t item = g.element_size();
  const int64_t helems = ceil_div(g.numel() * item, 16) * 16 / item;
  const int64_t scratch_bytes = std::max(R.scratch_bytes, U.scratch_bytes);
  Tensor hstore = at::empty({helems + ceil_div(scratch_bytes, item)}, g.options());
  Tensor block_r = at::empty({R.nbytes}, g.options().dtype(at::kByte));
  Tensor block_u = at::empty({U.nbytes}, g.options().dtype(at::kByte));
  const uint64_t h = address(hstore), br = address(block_r), bu = address(block_u);
  const int64_t slot = slot_of(ticket);
  if (R.numel == 0) {
    memset0(br, R.nbytes, stream);
    memset0(bu, U.nbytes, stream);
    if (slot) {
      *slot_count_at(slot) = 0;
      *slot_status_at(slot) = 0;
    }
  } else {
    const uint64_t scratch = h + static_cast<uint64_t>(helems * item);
    memset0(scratch, R.scratch_bytes, stream);
    Roles gate{address(g), h, scratch, 0, 0, 0, static_cast<uint64_t>(slot)};
    gate[R_U] = address(u);
    R.pack.run(stream, br, gate);
    memset0(scratch, U.scratch_bytes, stream);
    Roles roles = gated_roles(R, br, U, bu);
    roles[R_X] = address(u);
    roles[R_SCRATCH] = scratch;
    U.pack.run(stream, bu, roles);
  }
  // the second GEMM as linear() makes it
  Tensor out = forward_linear(hstore, g, weight, bias, mm_dtype);
  return {out, block_r, block_u, ticket};
}

struct GatedGrads {
  Tensor g, u, weight, bias;   // undefined where not asked for
};

// Backward: PyTorch's linear backward on the 2-D views; the second GEMM's input relu(g) * u
// and the gradients of g and u from the packed blocks when clean (the gated kernel writes
// grad_g over grad_h), else from g and u recomputed with the forward's first GEMMs
// (x, wg, bg, wu, bu) and what autograd does for relu(g) * u.
GatedGrads gated_backward_impl(const Tensor& grad_out, const Tensor& block_r,
                               const Tensor& block_u, const Tensor& weight, const Tensor& x,
                               const Tensor& wg, const Tensor& bg, const Tensor& wu,
                               const Tensor& bu, at::IntArrayRef a_shape, at::ScalarType a_dtype,
                               const Plan& R, const Plan& U, bool clean, int64_t mm_dtype,
                               bool need_a, bool need_w, bool need_b) {
  GatedGrads o;
  const Tensor g2 = as_matrix(grad_out.contiguous(), grad_out.size(-1));
  if (need_b) o.bias = g2.sum({0}, true).view({g2.size(-1)});
  if (!need_a && !need_w) return o;
  c10::DeviceGuard device_guard(block_r.device());
  void* stream = current_stream(block_r.device());
  const uint64_t at_r = address(block_r), at_u = address(block_u);
  const Roles planes = gated_roles(R, at_r, U, at_u);
  Tensor r, u;   // recomputed where the pack was not clean
  if (!clean) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    r = at::relu(at::linear(x, wg, maybe(bg)));
    u = at::linear(x, wu, maybe(bu));
  }
  if (need_w) {   // h = r * u, which dies here (stream-ordered: the gradients may take its memory)
    Tensor h;
    if (clean) {   // one kernel forms it from both packed blocks
      h = at::empty(a_shape, grad_out.options().dtype(a_dtype));
      R.gated_product.run(stream, at_r, gated_product_roles(planes, h));
    } else {
      h = r * u;
    }
    o.weight = weight_grad(g2, h, mm_dtype);
  }
  if (need_a) {
    const Tensor grad_h = input_grad(g2, weight, a_shape, a_dtype);
    if (clean) {
      const Tensor gh = grad_h.contiguous();
      const Tensor gu = at::empty_like(gh);
      Roles roles = planes;
      roles[R_G] = roles[R_OUT] = address(gh);
      roles[R_OUT2] = address(gu);
      R.gated.run(stream, at_r, roles);
      o.g = gh;
      o.u = gu;
    } else {
      o.g = at::threshold_backward(grad_h * u, r, 0);
      o.u = grad_h * r;
    }
  }
  return o;
}

// The gated backward within a CUDA graph capture: the clean way and the recompute as the
// two bodies of one conditional node on relu(g)'s pack status (u's pack shares its mask and
// count), as backward_conditional does for ReLU. Returns false, having queued nothing,
// where the node does not apply (the caller then recomputes as before).
bool gated_backward_conditional(GatedGrads& o, const Tensor& grad_out, const Tensor& block_r,
                                const Tensor& block_u, const Tensor& weight, const Tensor& x,
                                const Tensor& wg, const Tensor& bg, const Tensor& wu,
                                const Tensor& bu, at::IntArrayRef a_shape,
                                at::ScalarType a_dtype, const Plan& R, const Plan& U,
                                int64_t mm_dtype, bool need_a, bool need_w, bool need_b,
                                int64_t policy, void* stream) {
  const c10::Device device = block_r.device();
  const std::optional<c10::Stream> side =
      conditional_side_stream(device, grad_out, weight, x, {wg, wu}, a_dtype, mm_dtype, stream);
  if (!side) return false;
  const Tensor g2 = as_matrix(grad_out.contiguous(), grad_out.size(-1));
  if (need_b) o.bias = g2.sum({0}, true).view({g2.size(-1)});
  if (!need_a && !need_w) return true;
  const auto opts = grad_out.options().dtype(a_dtype);
  const int64_t f = weight.size(1);
  if (need_a) {
    o.g = at::empty(a_shape, opts);
    o.u = at::empty(a_shape, opts);
  }
  if (need_w) o.weight = at::empty(weight.sizes(), weight.options());
  Tensor r = at::empty(a_shape, opts), u = at::empty(a_shape, opts);
  Tensor tmp = at::empty(a_shape, opts);   // r * u, the weight gradient's input in either body
  Tensor ga2 = need_a ? as_matrix(o.g, f) : Tensor();
  const Tensor g2t = transposed(g2);
  const uint64_t at_r = address(block_r), at_u = address(block_u);
  const Roles planes = gated_roles(R, at_r, U, at_u);
  void* body = side->native_handle();

  ConditionalCapture node(stream, at_r + static_cast<uint64_t>(R.status_offset),
                          replay_counter(policy), *side, device);
  // the pack was clean: the packed blocks
  if (need_w) {
    R.gated_product.run(body, at_r, gated_product_roles(planes, tmp));
    at::mm_out(o.weight, g2t, as_matrix(tmp, f));
  }
  if (need_a) {
    at::mm_out(ga2, g2, weight);
    Roles roles = planes;
    roles[R_G] = roles[R_OUT] = address(o.g);
    roles[R_OUT2] = address(o.u);
    R.gated.run(body, at_r, roles);
  }
  node.otherwise();
  // it overflowed: the forward's first GEMMs again (linear's own addmm / mm on the 2-D views)
  {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const Tensor x2 = as_matrix(x, x.size(-1));
    linear_out(as_matrix(r, f), x2, wg, bg);
    linear_out(as_matrix(u, f), x2, wu, bu);
    r.relu_();
    if (need_w) {
      at::mul_out(tmp, r, u);
      at::mm_out(o.weight, g2t, as_matrix(tmp, f));
    }
    if (need_a) {   // threshold_backward(grad_h * u, r, 0) and grad_h * r
      at::mm_out(ga2, g2, weight);
      at::mul_out(tmp, o.g, u);
      at::mul_out(o.u, o.g, r);
      at::threshold_backward_out(o.g, tmp, r, 0);
    }
  }
  node.finish();
  return true;
}

// captured_or_warmed with gated_backward_conditional.
bool gated_backward_captured(GatedGrads& o, const Tensor& grad_out, const Tensor& block_r,
                             const Tensor& block_u, const Tensor& weight, const Tensor& x,
                             const Tensor& wg, const Tensor& bg, const Tensor& wu,
                             const Tensor& bu, at::IntArrayRef a_shape, at::ScalarType a_dtype,
                             const Plan& R, const Plan& U, int64_t mm_dtype, bool need_a,
                             bool need_w, bool need_b, int64_t policy) {
  return captured_or_warmed(block_r, a_dtype, policy, [&](void* stream) {
    return gated_backward_conditional(o, grad_out, block_r, block_u, weight, x, wg, bg, wu, bu,
                                      a_shape, a_dtype, R, U, mm_dtype, need_a, need_w, need_b,
                                      policy, stream);
  });
}

// ---------------------------------------------------------------------------
// The autograd node (eager mode)
// ---------------------------------------------------------------------------
using torch::autograd::Node;
using torch::autograd::SavedVariable;

// A new node of type T, as this PyTorch's autograd holds nodes (std::shared_ptr in older
// releases, c10::intrusive_ptr in newer ones).
template <class T, class Ptr = decltype(torch::autograd::Edge().function)>
auto new_node() {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

// A node's gradients as its backward returns them: under create_graph (grad mode on, a
// grad_out that requires grad) they carry an error node, since the gradients were computed
// outside autograd (a kernel writes over grad_h in place) and cannot be differentiated.
variable_list once_differentiable(variable_list result, const Tensor& grad_out,
                                  const char* op) {
  if (!at::GradMode::is_enabled() || !grad_out.requires_grad()) return result;
  for (Tensor& t : result) {
    if (t.defined()) t = t.detach().requires_grad_(true);
  }
  const std::string msg = std::string("bitsparse: the packed ") + op +
                          " op's backward is not differentiable (trying to differentiate twice)";
  const int64_t n = static_cast<int64_t>(result.size());
  return torch::autograd::DelayedError(msg, n).apply(std::move(result));
}

// The backward of one eager relu_linear call, written as a node of its own rather than a
// torch::autograd::Function: its edges are a, weight and bias only (the recompute source
// gets its gradients through a), and what backward needs is kept in fields, not in the
// context's string-keyed map; a training step makes one per packed layer.
struct ReLULinearBackward : public Node {
  SavedVariable block, weight, x, w1, b1;
  std::shared_ptr<Stash> stash;   // the block's, when offloaded (``block`` is then empty)
  Ticket ticket;
  std::vector<int64_t> a_shape;
  at::ScalarType a_dtype = at::kFloat;
  bool has_bias = false, square = false;
  int64_t handle = -1, mm_dtype = -1, policy = 0;

  std::string name() const override { return "bitsparse::ReLULinearBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (SavedVariable* v : {&block, &weight, &x, &w1, &b1}) v->reset_data();
    stash.reset();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    variable_list result(3);
    const Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return result;   // the output was not used
    RECORD_FUNCTION("bitsparse::relu_linear_backward", c10::ArrayRef<const c10::IValue>{});
    const bool need_a = task_should_compute_output(0), need_w = task_should_compute_output(1);
    const bool need_b = has_bias && task_should_compute_output(2);
    // weight first: it is always saved, so a second backward through a freed graph
    // raises PyTorch's own error here, before the stash is asked twice
    const Tensor w = weight.unpack();
    const Tensor xs = x.unpack(), w1s = w1.unpack(), b1s = b1.unpack();
    const Tensor packed = stash ? stash->engine->take(stash) : block.unpack();
    Grads g;
    {
      // computed outside autograd (once_differentiable, below)
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      if (!backward_captured(g, grad_out, packed, w, xs, w1s, b1s, a_shape, a_dtype,
                             plan_at(handle), square, mm_dtype, need_a, need_w, need_b,
                             policy)) {
        const bool clean = decide_clean(ticket, policy, handle, packed, true);
        g = backward_impl(grad_out, packed, w, xs, w1s, b1s, a_shape, a_dtype, plan_at(handle),
                          clean, square, mm_dtype, need_a, need_w, need_b);
      }
    }
    result[0] = std::move(g.a);
    result[1] = std::move(g.weight);
    result[2] = std::move(g.bias);
    return once_differentiable(std::move(result), grad_out, "ReLU");
  }
};

// The eager op: the forward outside autograd, then (where a gradient is wanted) the node
// that runs its backward, saving what that needs.
Tensor relu_linear_eager(const Tensor& a, const Tensor& weight, const std::optional<Tensor>& bias,
                         const Tensor& x, const Tensor& w1, const std::optional<Tensor>& b1,
                         int64_t capacity, int64_t handle, bool square, int64_t mm_dtype,
                         int64_t policy, OffloadEngine* offloader) {
  RECORD_FUNCTION("bitsparse::relu_linear", c10::ArrayRef<const c10::IValue>{});
  using torch::autograd::isFwGradDefined;
  TORCH_CHECK(!isFwGradDefined(a) && !isFwGradDefined(weight) && !isFwGradDefined(bias),
              "bitsparse: the packed ReLU op has no forward-mode derivative (jvp); use the "
              "dense FFN under forward-mode AD");
  const bool grad = torch::autograd::compute_requires_grad(a, weight, bias);
  c10::DeviceGuard device_guard(a.device());   // the offloader's calls too
  Forward f;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    f = forward_impl(a, weight, bias, plan_at(handle), policy, capacity, mm_dtype, offloader);
  }
  if (!grad) return f.out;   // nothing to save: the block goes (the pack is still tracked)
  auto node = new_node<ReLULinearBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(a, weight, bias));
  node->block = SavedVariable(f.block, false);
  node->weight = SavedVariable(weight, false);
  node->x = SavedVariable(x, false);
  node->w1 = SavedVariable(w1, false);
  node->b1 = SavedVariable(b1, false);
  node->stash = std::move(f.stash);
  node->ticket = f.ticket;
  node->a_shape = a.sizes().vec();
  node->a_dtype = a.scalar_type();
  node->has_bias = bias.has_value() && bias->defined();
  node->square = square;
  node->handle = handle;
  node->mm_dtype = mm_dtype;
  node->policy = policy;
  torch::autograd::set_history(f.out, node);
  return f.out;
}

// The backward of one eager gated_relu_linear call (as ReLULinearBackward): edges g, u,
// weight and bias; the recompute source gets its gradients through g and u.
struct GatedReLULinearBackward : public Node {
  SavedVariable block_r, block_u, weight, x, wg, bg, wu, bu;
  Ticket ticket;
  std::vector<int64_t> a_shape;
  at::ScalarType a_dtype = at::kFloat;
  bool has_bias = false;
  int64_t handle_r = -1, handle_u = -1, mm_dtype = -1, policy = 0;

  std::string name() const override { return "bitsparse::GatedReLULinearBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (SavedVariable* v : {&block_r, &block_u, &weight, &x, &wg, &bg, &wu, &bu}) {
      v->reset_data();
    }
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    variable_list result(4);
    const Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return result;   // the output was not used
    RECORD_FUNCTION("bitsparse::gated_relu_linear_backward",
                    c10::ArrayRef<const c10::IValue>{});
    const bool need_g = task_should_compute_output(0), need_u = task_should_compute_output(1);
    const bool need_a = need_g || need_u, need_w = task_should_compute_output(2);
    const bool need_b = has_bias && task_should_compute_output(3);
    const Tensor w = weight.unpack();   // first: a freed graph raises PyTorch's own error
    const Tensor xs = x.unpack(), wgs = wg.unpack(), bgs = bg.unpack(), wus = wu.unpack(),
                 bus = bu.unpack(), br = block_r.unpack(), bu_ = block_u.unpack();
    const Plan& R = plan_at(handle_r);
    const Plan& U = plan_at(handle_u);
    GatedGrads o;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      if (!gated_backward_captured(o, grad_out, br, bu_, w, xs, wgs, bgs, wus, bus, a_shape,
                                   a_dtype, R, U, mm_dtype, need_a, need_w, need_b, policy)) {
        const bool clean = decide_clean(ticket, policy, handle_r, br, xs.defined(), true);
        o = gated_backward_impl(grad_out, br, bu_, w, xs, wgs, bgs, wus, bus, a_shape, a_dtype,
                                R, U, clean, mm_dtype, need_a, need_w, need_b);
      }
    }
    if (need_g) result[0] = std::move(o.g);
    if (need_u) result[1] = std::move(o.u);
    result[2] = std::move(o.weight);
    result[3] = std::move(o.bias);
    return once_differentiable(std::move(result), grad_out, "ReGLU");
  }
};

// The eager gated op: the forward outside autograd, then (where a gradient is wanted) the
// node that runs its backward, saving what that needs.
Tensor gated_relu_linear_eager(const Tensor& g, const Tensor& u, const Tensor& weight,
                               const std::optional<Tensor>& bias, const Tensor& x,
                               const Tensor& wg, const std::optional<Tensor>& bg,
                               const Tensor& wu, const std::optional<Tensor>& bu,
                               int64_t capacity, int64_t handle_r, int64_t handle_u,
                               int64_t mm_dtype, int64_t policy) {
  RECORD_FUNCTION("bitsparse::gated_relu_linear", c10::ArrayRef<const c10::IValue>{});
  using torch::autograd::isFwGradDefined;
  TORCH_CHECK(!isFwGradDefined(g) && !isFwGradDefined(u) && !isFwGradDefined(weight) &&
                  !isFwGradDefined(bias),
              "bitsparse: the packed ReGLU op has no forward-mode derivative (jvp); use the "
              "dense FFN under forward-mode AD");
  const bool grad = torch::autograd::compute_requires_grad(g, u, weight, bias);
  c10::DeviceGuard device_guard(g.device());
  GatedForward f;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    f = gated_forward_impl(g, u, weight, bias, plan_at(handle_r), plan_at(handle_u), policy,
                           capacity, mm_dtype);
  }
  if (!grad) return f.out;   // nothing to save: the blocks go (the pack is still tracked)
  auto node = new_node<GatedReLULinearBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(g, u, weight, bias));
  node->block_r = SavedVariable(f.block_r, false);
  node->block_u = SavedVariable(f.block_u, false);
  node->weight = SavedVariable(weight, false);
  node->x = SavedVariable(x, false);
  node->wg = SavedVariable(wg, false);
  node->bg = SavedVariable(bg, false);
  node->wu = SavedVariable(wu, false);
  node->bu = SavedVariable(bu, false);
  node->ticket = f.ticket;
  node->a_shape = g.sizes().vec();
  node->a_dtype = g.scalar_type();
  node->has_bias = bias.has_value() && bias->defined();
  node->handle_r = handle_r;
  node->handle_u = handle_u;
  node->mm_dtype = mm_dtype;
  node->policy = policy;
  torch::autograd::set_history(f.out, node);
  return f.out;
}

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
  return relu_linear_eager(a, weight, bias, x, w1, b1, capacity, handle, square, mm, policy,
                           off);
}

Tensor gated_relu_linear(const Tensor& g, const Tensor& u, const Tensor& weight,
                         const std::optional<Tensor>& bias, const Tensor& x, const Tensor& wg,
                         const std::optional<Tensor>& bg, const Tensor& wu,
                         const std::optional<Tensor>& bu, int64_t capacity, int64_t handle_r,
                         int64_t handle_u, const py::handle& mm_dtype, int64_t policy) {
  check_input(g);
  check_input(u);
  const int64_t mm = dtype_code(mm_dtype);
  py::gil_scoped_release no_gil;   // as any ATen call from Python
  return gated_relu_linear_eager(g, u, weight, bias, x, wg, bg, wu, bu, capacity, handle_r,
                                 handle_u, mm, policy);
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

using Result2 = std::tuple<Tensor, Tensor>;
using Result3 = std::tuple<Tensor, Tensor, Tensor>;

std::vector<at::ScalarType> stored_dtypes;   // set_stored_dtypes: _bridge.TORCH_TO_BS's

// The ops' static arguments, one integer (ops.op_config; its CONFIG_FIELDS, from bit 0:
// square 1, encoding 2, chunk_log2 5, mm_dtype 3 (a stored dtype's index + 1, 0: none),
// a_dtype 3 (an index), has_bias 1, needs 3). tests/test_torch_native.py compares this
// decoding with Python's.
struct Config {
  bool square = false, has_bias = false;
  int64_t encoding = 0, chunk_log2 = 0, mm_dtype = -1, needs = 0;   // mm_dtype: -1 none
  at::ScalarType a_dtype = at::kFloat;
};

Config decode_config(int64_t c) {
  auto field = [&c](int bits) {
    const int64_t v = c & ((int64_t{1} << bits) - 1);
    c >>= bits;
    return v;
  };
  auto dtype = [](int64_t i) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(stored_dtypes.size()),
                "bitsparse: op config names dtype ", i, " of ", stored_dtypes.size());
    return stored_dtypes[i];
  };
  Config k;
  k.square = field(1);
  k.encoding = field(2);
  k.chunk_log2 = field(5);
  const int64_t mm = field(3);
  k.mm_dtype = mm == 0 ? -1 : static_cast<int64_t>(dtype(mm - 1));
  k.a_dtype = dtype(field(3));
  k.has_bias = field(1);
  k.needs = field(3);
  TORCH_CHECK(c == 0, "bitsparse: op config has bits past its fields");
  return k;
}

template <class Result>
Result call_python(py::object* fn, const char* what, py::args args) {
  TORCH_CHECK(fn != nullptr, "bitsparse: native module used before set_dispatch (", what, ")");
  return (*fn)(*args).cast<Result>();
}

Result2 relu_linear_kernel(const Tensor& a_in, const Tensor& weight,
                           const std::optional<Tensor>& bias, const std::optional<Tensor>& x,
                           const std::optional<Tensor>& w1, const std::optional<Tensor>& b1,
                           int64_t capacity, int64_t config, int64_t policy) {
  const Config k = decode_config(config);
  int64_t handle = -1;
  Tensor a = a_in;
  if (takes(a, k.chunk_log2)) {
    a = a.contiguous();
    handle = handle_of(k.square, a.sizes(), a.scalar_type(), capacity, k.encoding, a.device());
  }
  if (handle < 0) {
    py::gil_scoped_acquire gil;
    return call_python<Result2>(
        python_forward, "relu_linear",
        py::make_tuple(a_in, weight, bias, x, w1, b1, capacity, config, policy));
  }
  Forward f = forward_impl(a, weight, bias, plan_at(handle), policy, capacity, k.mm_dtype);
  remember_ticket(f.block, f.ticket);
  return {f.out, f.block};
}

Result3 relu_linear_backward_kernel(const Tensor& grad_out, const Tensor& block,
                                    const Tensor& weight,
                                    const std::optional<Tensor>& x,
                                    const std::optional<Tensor>& w1,
                                    const std::optional<Tensor>& b1, int64_t capacity,
                                    int64_t config, int64_t policy) {
  const Config k = decode_config(config);
  // the activation's shape: grad_out's leading dims and the weight's input features
  // (ops.backward_a_shape)
  TORCH_CHECK(grad_out.dim() >= 1 && weight.dim() == 2,
              "bitsparse: relu_linear_backward takes grad_out of 1+ dims and a 2-D weight");
  std::vector<int64_t> a_shape(grad_out.sizes().begin(), grad_out.sizes().end());
  a_shape.back() = weight.size(1);
  const int64_t handle = takes(block, k.chunk_log2)
      ? handle_of(k.square, a_shape, k.a_dtype, capacity, k.encoding, block.device()) : -1;
  if (handle < 0) {
    py::gil_scoped_acquire gil;
    return call_python<Result3>(
        python_backward, "relu_linear_backward",
        py::make_tuple(grad_out, block, weight, x, w1, b1, capacity, config, policy));
  }
  const bool need_a = k.needs & 1, need_w = k.needs & 2, need_b = k.has_bias && (k.needs & 4);
  const Tensor xs = x.value_or(Tensor()), w1s = w1.value_or(Tensor()), b1s = b1.value_or(Tensor());
  Grads g;
  if (!backward_captured(g, grad_out, block, weight, xs, w1s, b1s, a_shape, k.a_dtype,
                         plan_at(handle), k.square, k.mm_dtype, need_a, need_w, need_b,
                         policy)) {
    const bool clean = decide_clean(ticket_of_block(block), policy, handle, block, xs.defined());
    g = backward_impl(grad_out, block, weight, xs, w1s, b1s, a_shape, k.a_dtype,
                      plan_at(handle), clean, k.square, k.mm_dtype, need_a, need_w, need_b);
  }
  // what the op's fake kernel says of a gradient not asked for: an empty tensor
  if (!g.a.defined()) g.a = at::empty({0}, grad_out.options().dtype(k.a_dtype));
  if (!g.weight.defined()) g.weight = at::empty({0}, weight.options());
  if (!g.bias.defined()) g.bias = at::empty({0}, weight.options());
  return {g.a, g.weight, g.bias};
}

// The gated op's plans: ``(relu(g)'s handle, u's handle)`` of one (shape, dtype, capacity,
// encodings, device), registered by Python on first use; -1s where the C++ path does not
// take it.
py::object* gated_handle_fn = nullptr;         // native._gated_handles_for
py::object* python_gated_forward = nullptr;    // ops.gated_relu_linear
py::object* python_gated_backward = nullptr;   // ops.gated_relu_linear_backward
std::map<std::vector<int64_t>, std::pair<int64_t, int64_t>> gated_handles;

std::pair<int64_t, int64_t> gated_handles_of(at::IntArrayRef shape, at::ScalarType dtype,
                                             int64_t capacity, int64_t encoding,
                                             int64_t u_encoding, const c10::Device& device) {
  std::vector<int64_t> key = {static_cast<int64_t>(dtype), capacity, encoding, u_encoding,
                              device.index()};
  key.insert(key.end(), shape.begin(), shape.end());
  {
    std::lock_guard<std::mutex> lock(handles_mutex);
    const auto it = gated_handles.find(key);
    if (it != gated_handles.end()) return it->second;
  }
  std::pair<int64_t, int64_t> h;
  {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(gated_handle_fn != nullptr,
                "bitsparse: native module used before set_gated_dispatch");
    py::object dt = py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype)));
    h = (*gated_handle_fn)(shape.vec(), dt, capacity, encoding, u_encoding, device.index())
            .cast<std::pair<int64_t, int64_t>>();
  }
  std::lock_guard<std::mutex> lock(handles_mutex);
  gated_handles.emplace(key, h);
  return h;
}

using Result4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;

Result3 gated_relu_linear_kernel(const Tensor& g_in, const Tensor& u_in, const Tensor& weight,
                                 const std::optional<Tensor>& bias,
                                 const std::optional<Tensor>& x, const std::optional<Tensor>& wg,
                                 const std::optional<Tensor>& bg,
                                 const std::optional<Tensor>& wu,
                                 const std::optional<Tensor>& bu, int64_t capacity,
                                 int64_t encoding, int64_t u_encoding, int64_t chunk_log2,
                                 std::optional<at::ScalarType> mm_dtype, int64_t policy) {
  std::pair<int64_t, int64_t> h{-1, -1};
  Tensor g = g_in, u = u_in;
  if (takes(g, chunk_log2) && u.device() == g.device() && u.sizes() == g.sizes() &&
      u.scalar_type() == g.scalar_type()) {
    g = g.contiguous();
    u = u.contiguous();
    h = gated_handles_of(g.sizes(), g.scalar_type(), capacity, encoding, u_encoding,
                         g.device());
  }
  if (h.first < 0 || h.second < 0) {
    py::gil_scoped_acquire gil;
    return call_python<Result3>(
        python_gated_forward, "gated_relu_linear",
        py::make_tuple(g_in, u_in, weight, bias, x, wg, bg, wu, bu, capacity, encoding,
                       u_encoding, chunk_log2, mm_dtype, policy));
  }
  const int64_t mm = mm_dtype ? static_cast<int64_t>(*mm_dtype) : -1;
  GatedForward f = gated_forward_impl(g, u, weight, bias, plan_at(h.first), plan_at(h.second),
                                      policy, capacity, mm);
  remember_ticket(f.block_r, f.ticket);
  return {f.out, f.block_r, f.block_u};
}

Result4 gated_relu_linear_backward_kernel(
    const Tensor& grad_out, const Tensor& block_r, const Tensor& block_u, const Tensor& weight,
    const std::optional<Tensor>& x, const std::optional<Tensor>& wg,
    const std::optional<Tensor>& bg, const std::optional<Tensor>& wu,
    const std::optional<Tensor>& bu, at::IntArrayRef a_shape, at::ScalarType a_dtype,
    bool has_bias, int64_t capacity, int64_t encoding, int64_t u_encoding, int64_t chunk_log2,
    std::optional<at::ScalarType> mm_dtype, int64_t policy, int64_t needs) {
  const std::pair<int64_t, int64_t> h =
      takes(block_r, chunk_log2)
          ? gated_handles_of(a_shape, a_dtype, capacity, encoding, u_encoding, block_r.device())
          : std::pair<int64_t, int64_t>{-1, -1};
  if (h.first < 0 || h.second < 0) {
    py::gil_scoped_acquire gil;
    return call_python<Result4>(
        python_gated_backward, "gated_relu_linear_backward",
        py::make_tuple(grad_out, block_r, block_u, weight, x, wg, bg, wu, bu, a_shape.vec(),
                       a_dtype, has_bias, capacity, encoding, u_encoding, chunk_log2, mm_dtype,
                       policy, needs));
  }
  const bool need_a = needs & 1, need_w = needs & 2, need_b = has_bias && (needs & 4);
  const int64_t mm = mm_dtype ? static_cast<int64_t>(*mm_dtype) : -1;
  const Tensor xs = x.value_or(Tensor()), wgs = wg.value_or(Tensor()), bgs = bg.value_or(Tensor()),
               wus = wu.value_or(Tensor()), bus = bu.value_or(Tensor());
  const Plan& R = plan_at(h.first);
  const Plan& U = plan_at(h.second);
  GatedGrads o;
  if (!gated_backward_captured(o, grad_out, block_r, block_u, weight, xs, wgs, bgs, wus, bus,
                               a_shape, a_dtype, R, U, mm, need_a, need_w, need_b, policy)) {
    const bool clean =
        decide_clean(ticket_of_block(block_r), policy, h.first, block_r, xs.defined(), true);
    o = gated_backward_impl(grad_out, block_r, block_u, weight, xs, wgs, bgs, wus, bus, a_shape,
                            a_dtype, R, U, clean, mm, need_a, need_w, need_b);
  }
  // what the op's fake kernel says of a gradient not asked for: an empty tensor
  const auto empty_a = grad_out.options().dtype(a_dtype);
  if (!o.g.defined()) o.g = at::empty({0}, empty_a);
  if (!o.u.defined()) o.u = at::empty({0}, empty_a);
  if (!o.weight.defined()) o.weight = at::empty({0}, weight.options());
  if (!o.bias.defined()) o.bias = at::empty({0}, weight.options());
  return {o.g, o.u, o.weight, o.bias};
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
  lib->impl("gated_relu_linear", TORCH_FN(gated_relu_linear_kernel));
  lib->impl("gated_relu_linear_backward", TORCH_FN(gated_relu_linear_backward_kernel));
  registered[key] = std::move(lib);
}

// ---------------------------------------------------------------------------
// A module's eager call: the first GEMM and the op in one call from Python
// ---------------------------------------------------------------------------

// What functional._no_modes asks of Python, from the thread-local state it reads: no
// dispatch or function mode, no JIT trace, no functorch transform.
bool plain_eager_state() {
  const c10::DispatchKeySet included = c10::impl::tls_local_dispatch_key_set().included_;
  return c10::impl::TorchDispatchModeTLS::stack_len() == 0 &&
         !at::impl::torch_function_mode_enabled() && !torch::jit::tracer::isTracing() &&
         !included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) &&
         !included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode);
}

// A torch.Tensor or nn.Parameter, not a subclass (None where ``optional``).
bool plain_tensor(py::handle h, bool optional = false) {
  return (optional && h.is_none()) || THPVariable_CheckExact(h.ptr());
}

std::optional<Tensor> optional_tensor(py::handle h) {
  if (h.is_none()) return std::nullopt;
  return THPVariable_Unpack(h.ptr());
}

// relu_ffn(x, w1, b1, w2, b2) in plain eager (functional._eager_call: a policy, no
// autocast, no offload, backend "auto"; the trace check stays in Python, which dynamo
// reads), with the rest of the checks the Python path would make: (out, a);
// (None, None) where this path does not take the call (the caller runs relu_ffn's own
// path), (None, a) where it declines after the first GEMM (the caller goes on with a).
// ``capacity``: the policy's for the activation's element count.
std::pair<Tensor, Tensor> relu_ffn_call(py::handle xh, py::handle w1h, py::handle b1h,
                                        py::handle w2h, py::handle b2h, int64_t capacity,
                                        bool square, int64_t encoding, int64_t policy) {
  if (driver.launch == nullptr || python_path_depth.load() != 0 || !plain_eager_state() ||
      !plain_tensor(xh) || !plain_tensor(w1h) || !plain_tensor(w2h) ||
      !plain_tensor(b1h, true) || !plain_tensor(b2h, true)) {
    return {};
  }
  const Tensor& x = THPVariable_Unpack(xh.ptr());
  const Tensor& w1 = THPVariable_Unpack(w1h.ptr());
  const Tensor& w2 = THPVariable_Unpack(w2h.ptr());
  const std::optional<Tensor> b1 = optional_tensor(b1h), b2 = optional_tensor(b2h);
  const auto stored = [](at::ScalarType t) {
    return std::find(stored_dtypes.begin(), stored_dtypes.end(), t) != stored_dtypes.end();
  };
  if (!(x.is_cuda() || (host_emulation && x.is_cpu())) || x.layout() != at::kStrided ||
      !stored(x.scalar_type()) || w1.dim() != 2) {
    return {};
  }
  py::gil_scoped_release no_gil;   // as any ATen call from Python
  Tensor a = at::linear(x, w1, b1);
  if (a.layout() != at::kStrided || !stored(a.scalar_type())) return {Tensor(), a};
  a = a.contiguous();
  const int64_t handle =
      handle_of(square, a.sizes(), a.scalar_type(), capacity, encoding, a.device());
  if (handle < 0) return {Tensor(), a};
  Tensor out = relu_linear_eager(a, w2, b2, x, w1, b1, capacity, handle, square, -1, policy,
                                 nullptr);
  return {out, a};
}

py::bytes launch_params(int64_t handle, const std::string& name, uint64_t block,
                        const std::array<uint64_t, N_ROLES>& roles) {
  const Plan& P = plan_at(handle);
  const Launch* L = name == "pack" ? &P.pack
                    : name == "unpack" ? &P.unpack
                    : name == "relu2" ? &P.relu2
                    : name == "relu2_and_square" ? &P.relu2_and_square
                    : name == "mask_select" ? &P.mask_select
                    : name == "gated" ? &P.gated
                    : name == "gated_product" ? &P.gated_product : nullptr;
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
  m.def("set_graph_driver", [](uint64_t capture_info, uint64_t handle_create, uint64_t add_node,
                               uint64_t update_deps, uint64_t begin_to_graph,
                               uint64_t end_capture, uint64_t ctx_current) {
    graph_driver.capture_info = reinterpret_cast<CaptureInfoFn>(capture_info);
    graph_driver.handle_create = reinterpret_cast<CondHandleCreateFn>(handle_create);
    graph_driver.add_node = reinterpret_cast<GraphAddNodeFn>(add_node);
    graph_driver.update_deps = reinterpret_cast<UpdateCaptureDepsFn>(update_deps);
    graph_driver.begin_to_graph = reinterpret_cast<BeginCaptureToGraphFn>(begin_to_graph);
    graph_driver.end_capture = reinterpret_cast<EndCaptureFn>(end_capture);
    graph_driver.ctx_current = reinterpret_cast<CtxGetCurrentFn>(ctx_current);
  });
  m.def("set_condition_kernel", [](int64_t device, uint64_t func) {
    TORCH_CHECK(device >= 0 && device < GraphDriver::kMaxDevices,
                "bitsparse: device ", device, " past the conditional nodes' table");
    graph_driver.set_condition[device].store(func);
  });
  m.def("graph_conditionals", [](int64_t device) { return graph_driver_ready(device); });
  m.def("replay_count", &replay_count);
  m.def("set_body_pool_fn", [](py::object fn) {
    body_pool_fn = new py::object(std::move(fn));   // never freed: a backward may hold it
  });
  m.def("drop_replay_counter", &drop_replay_counter);
  m.def("set_exact_driver", [](uint64_t copy_device, uint64_t stream_query, uint64_t stream_sync) {
    exact_driver.copy_device = reinterpret_cast<CopyDeviceFn>(copy_device);
    exact_driver.stream_query = reinterpret_cast<StreamQueryFn>(stream_query);
    exact_driver.stream_sync = reinterpret_cast<StreamQueryFn>(stream_sync);
  });
  m.def("exact_shrink", &exact_shrink);
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
  m.def("block_ticket", [](const Tensor& block) {   // ops' Python backward: (slot, generation)
    const Ticket t = ticket_of_block(block);
    return std::make_pair(t.slot, t.generation);
  });
  m.def("set_dispatch", [](py::object handle, py::object forward, py::object backward,
                           int64_t chunk_log2) {
    // never freed: a kernel may be running one (an earlier one stays alive too)
    handle_fn = new py::object(std::move(handle));
    python_forward = new py::object(std::move(forward));
    python_backward = new py::object(std::move(backward));
    default_chunk_log2 = chunk_log2;
  });
  m.def("set_gated_dispatch", [](py::object handles, py::object forward, py::object backward) {
    // never freed, as set_dispatch's
    gated_handle_fn = new py::object(std::move(handles));
    python_gated_forward = new py::object(std::move(forward));
    python_gated_backward = new py::object(std::move(backward));
  });
  m.def("set_python_path_depth", [](int depth) { python_path_depth.store(depth); });
  m.def("forget_handles", [] {
    std::lock_guard<std::mutex> lock(handles_mutex);
    handles.clear();
    gated_handles.clear();
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
  m.def("gated_relu_linear", &gated_relu_linear);
  m.def("relu_ffn_call", &relu_ffn_call);
  m.def("decode_config", [](int64_t config) {   // for the tests: ops.decode_config's
    const Config k = decode_config(config);
    auto dtype = [](at::ScalarType t) {
      return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(t)));
    };
    return py::make_tuple(k.square, k.encoding, k.chunk_log2,
                          k.mm_dtype < 0 ? py::none()
                                         : dtype(static_cast<at::ScalarType>(k.mm_dtype)),
                          dtype(k.a_dtype), k.has_bias, k.needs);
  });
  m.def("set_stored_dtypes", [](const std::vector<py::handle>& dtypes) {
    stored_dtypes.clear();
    for (const py::handle& d : dtypes) stored_dtypes.push_back(
        static_cast<at::ScalarType>(dtype_code(d)));
  });
  m.def("relu_linear_kernel", &relu_linear_kernel, py::call_guard<py::gil_scoped_release>());
  m.def("relu_linear_backward_kernel", &relu_linear_backward_kernel,
        py::call_guard<py::gil_scoped_release>());
  m.def("gated_relu_linear_kernel", &gated_relu_linear_kernel,
        py::call_guard<py::gil_scoped_release>());
  m.def("gated_relu_linear_backward_kernel", &gated_relu_linear_backward_kernel,
        py::call_guard<py::gil_scoped_release>());
  m.def("launch_params", &launch_params);
  def_hooks_front(m);
  def_public_ops(m);
}
