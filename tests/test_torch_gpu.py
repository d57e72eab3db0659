"""bitsparse_core.torch on CUDA: bit-identical training, saved bytes = packed size,
torch's allocator and streams, hooks, checkpoint, autocast."""

from __future__ import annotations

import contextlib
import os

import pytest

# cuBLAS needs this before its first use to be deterministic under use_deterministic_algorithms.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

torch = pytest.importorskip("torch")

import bitsparse_core as bc  # noqa: E402
from bitsparse_core.torch import compress_saved_tensors, relu_linear  # noqa: E402
from torch_models import (ENCODINGS, KINDS, Hooked, relu_mlp, assert_same_training, make_pair,  # noqa: E402
                          saved_tensors_of, train)

pytestmark = pytest.mark.gpu


def _cuda_backend_ready() -> bool:
    return torch.cuda.is_available() and bc.backend_available("cupy")


@pytest.fixture(autouse=True)
def cuda_deterministic():
    if not _cuda_backend_ready():
        pytest.skip("needs a CUDA GPU, torch with CUDA and the cupy backend")
    prev = torch.are_deterministic_algorithms_enabled()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.use_deterministic_algorithms(prev)
    torch.backends.cuda.matmul.allow_tf32 = tf32


def _data(shape, d, dtype, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, d, generator=g, device="cuda").to(dtype)
    target = torch.randn(*shape, d, generator=g, device="cuda")
    return x, target


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_training_is_bit_identical_cuda(kind, encoding, dtype):
    dense, ours = make_pair(kind, encoding, d=64, f=384, dtype=dtype, device="cuda")
    x, target = _data((4, 96), 64, dtype)
    assert_same_training(train(dense, x, target), train(ours, x, target))


@pytest.mark.parametrize("kind", KINDS)
def test_autocast_bf16_cuda(kind):
    dense, ours = make_pair(kind, "nosign", d=64, f=256, device="cuda")
    x, target = _data((2, 64), 64, torch.float32)
    assert_same_training(train(dense, x, target, autocast=torch.bfloat16),
                         train(ours, x, target, autocast=torch.bfloat16))


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_cuda(kind):
    dense, ours = make_pair(kind, "raw", d=64, f=256, dtype=torch.bfloat16, device="cuda",
                            checkpoint=False)
    x, target = _data((2, 64), 64, torch.bfloat16)
    assert_same_training(train(dense, x, target), train(ours, x, target))


@pytest.mark.parametrize("kind", ["relu2", "reglu"])
def test_side_stream_matches_default_stream(kind):
    """Forward and backward on a non-default stream: kernels follow torch's current stream."""
    dense, ours = make_pair(kind, "nosign", d=64, f=256, dtype=torch.bfloat16, device="cuda")
    x, target = _data((2, 64), 64, torch.bfloat16)
    ref = train(dense, x, target, steps=2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = train(ours, x, target, steps=2)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert_same_training(ref, got)


def _requested_bytes() -> int:
    return torch.cuda.memory_stats()["requested_bytes.all.current"]


@pytest.mark.parametrize("encoding", ["raw", "nosign", "signplane"])
@pytest.mark.parametrize("kind", KINDS)
def test_saved_bytes_are_the_packed_size(kind, encoding):
    """What one FFN keeps from forward to backward is its packed planes, nothing dense:
    the bytes requested from the caching allocator grow by exactly the planes' buffers
    (plus the output). (memory_allocated would count whole cached blocks: the allocator
    hands out a large block up to 1 MiB bigger than asked without splitting it.)"""
    n, d, f = 4096, 256, 1024
    dense, ours = make_pair(kind, encoding, d=d, f=f, layers=1, dtype=torch.bfloat16,
                            device="cuda", neg_bias=0.8)
    blk = ours.blocks[0]
    x, _ = _data((n,), d, torch.bfloat16)
    for _ in range(2):  # warm up the same path: kernels, cuBLAS workspaces, pinned memory
        saved_tensors_of(lambda: blk(x))[0].float().sum().backward()
    blk.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    cap = blk.capacity_policy.capacity(n * f)
    before = _requested_bytes()
    out, saved = saved_tensors_of(lambda: blk(x))
    grown = _requested_bytes() - before

    planes = [t for t in saved if t.dtype in (torch.uint8, torch.uint32, torch.uint64)]
    assert [t for t in saved if t.is_floating_point() and t.numel() >= n * f] == []
    storages = {}
    for t in planes:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()

    assert grown == out.numel() * out.element_size() + sum(storages.values())
    first = blk.gate_proj if kind == "reglu" else blk.fc1
    a = first(x).detach()
    _, p = bc.relu_pack(a, encoding=encoding, stream=torch.cuda.current_stream().cuda_stream)
    # The sync-free ops save one block at the module's capacity (the planes of the exact
    # pack at their spans, values up to nnz, then the status area) and, for ReGLU, a
    # second one with u's values and signs behind the same mask.
    import cupy
    from bitsparse_core.torch.ops import _plan, _u_plan
    plan = _plan(a.shape, a.dtype, cap, kind == "relu2", int(p.encoding), p.chunk_log2)
    want = [(plan, (p.mask, p.offsets, p.values, p.signs))]
    if kind == "reglu":
        u = blk.up_proj(x).detach()
        u_enc = "raw" if encoding == "raw" else "signplane"
        pu = bc.masked_pack(u, p, encoding=u_enc, stream=torch.cuda.current_stream().cuda_stream)
        want.append((_u_plan(a.shape, a.dtype, cap, int(pu.encoding), p.chunk_log2),
                     (None, None, pu.values, pu.signs)))
    assert [t.numel() for t in planes] == [pl.nbytes for pl, _ in want]
    for t, (pl, exp_planes) in zip(planes, want):
        block = t.cpu().numpy()
        for (off, _), exp in zip(pl.spans, exp_planes):
            if exp is not None:
                e = cupy.asnumpy(exp).view("u1")
                assert block[off:off + e.size].tobytes() == e.tobytes()
    dense_bytes = n * f * 2 * (1 if kind == "relu" else 2)
    assert grown < dense_bytes / 2


@pytest.mark.parametrize("kind,path", [("relu", "native"), ("relu", "python"),
                                       ("relu2", "native"), ("relu2", "python"),
                                       ("reglu", "python")])
def test_backward_holds_no_more_activations_than_dense(kind, path):
    """The packed op's backward buffers: the decoded activation is dropped once the weight
    gradient is queued and the fused gradients are written over grad_h, so the memory its
    backward adds on top of what the forward kept is at most a count of activation-sized
    buffers (ReLU: one at a time; ReLU²'s fused decode and ReGLU: two, the input gradient
    that autograd keeps included), and no more than dense PyTorch's. A = one [n, f]
    activation. The op's inputs are leaves, so that only its own backward is measured (the
    first linear's backward is the same in both and has transients of its own).
    (ReGLU has no C++ path.)"""
    import torch.nn.functional as F
    from bitsparse_core.torch import gated_relu_linear, native
    if path == "native":
        _native_built()
    n, d, f = 4096, 128, 4096
    act = n * f * 2
    dense, _ = make_pair(kind, "nosign", d=d, f=f, layers=1, dtype=torch.bfloat16,
                         device="cuda", neg_bias=0.8)
    blk = dense.blocks[0]
    x, _ = _data((n,), d, torch.bfloat16)
    with torch.no_grad():
        if kind == "reglu":
            first = [blk.gate_proj, blk.up_proj]
            w, b = blk.down_proj.weight, blk.down_proj.bias
        else:
            first = [blk.fc1]
            w, b = blk.fc2.weight, blk.fc2.bias
        # the op's inputs as leaves
        inputs = [m(x).requires_grad_() for m in first]
    source = (x,) + tuple(t for m in first for t in (m.weight, m.bias))

    def ours():
        if kind == "reglu":
            return gated_relu_linear(*inputs, w, b, density=1.0, recompute=source)
        return relu_linear(inputs[0], w, b, square=kind == "relu2", density=1.0,
                           recompute=source)

    def reference():
        r = torch.relu(inputs[0])
        if kind == "relu2":
            r = torch.square(r)
        elif kind == "reglu":
            r = r * inputs[1]
        return F.linear(r, w, b)

    def backward_growth(fn):
        for _ in range(2):      # warm-up: kernels, cuBLAS workspaces, the allocator's pools
            for t in (*inputs, w, b):
                t.grad = None
            out = fn()
            torch.cuda.synchronize()            # the pack's count is back: a clean backward
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    with contextlib.nullcontext() if path == "native" else native.python_path():
        ours_growth = backward_growth(ours)
    dense_growth = backward_growth(reference)
    buffers = 1 if kind == "relu" else 2
    print(f"backward growth in activations: ours {ours_growth / act:.3f}, "
          f"dense {dense_growth / act:.3f}")
    assert ours_growth <= (buffers + 0.25) * act, (ours_growth / act, dense_growth / act)
    assert ours_growth <= dense_growth + 0.25 * act, (ours_growth / act, dense_growth / act)


@contextlib.contextmanager
def _no_syncs():
    """Any CUDA synchronize inside raises (torch's sync debug mode "error")."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def test_hooks_bit_identical_cuda():
    def mlp():
        return relu_mlp(0, 64, 512, shift=0.6).cuda().bfloat16()

    hooks = compress_saved_tensors(min_numel=4096)
    x, target = _data((8, 64), 64, torch.bfloat16)
    ref = train(mlp(), x, target)
    got = train(Hooked(mlp(), hooks), x, target)
    got = [(l, {k[6:]: v for k, v in g.items()}, {k[6:]: v for k, v in p.items()})
           for l, g, p in got]
    assert_same_training(ref, got)
    # How many packs are clean, kept dense or throttled depends on how far the host runs
    # ahead of the GPU (no sync decides it); every one of them is exact.
    s = hooks.stats
    assert s.tried >= 1 and s.packed + s.kept_dense <= s.tried
    assert s.packed == 0 or s.packed_bytes < s.dense_bytes


def test_hooks_unpack_on_another_stream():
    hooks = compress_saved_tensors(min_numel=1)
    t = torch.relu(torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16) - 1)
    want = t.view(torch.int16).clone()
    packed = hooks._pack(t)
    assert packed is not t
    torch.cuda.synchronize()   # the count lands; the next hook call takes it in
    hooks._poll()
    assert packed.state == "clean" and packed.held is None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        back = hooks._unpack(packed)
        # the block freed while the unpack may still run on s: record_stream guards
        del packed, t
        junk = torch.empty(1 << 22, device="cuda", dtype=torch.uint8).fill_(0xFF)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(back.view(torch.int16), want)
    del junk


def test_hooks_offload_cuda_bit_identical_and_sync_free():
    """offload=: clean blocks go to pinned host memory and come back for backward, with
    no synchronize, and training matches plain bit for bit."""
    from bitsparse_core.torch.offload import Offloader

    def mlp():
        return relu_mlp(0, 64, 512, shift=0.6).cuda().bfloat16()

    off = Offloader(ahead=1)
    hooks = compress_saved_tensors(min_numel=4096, offload=off)
    x, target = _data((8, 64), 64, torch.bfloat16)
    ref = train(mlp(), x, target)
    ours = Hooked(mlp(), hooks)
    got = train(ours, x, target)
    got = [(l, {k[6:]: v for k, v in g.items()}, {k[6:]: v for k, v in p.items()})
           for l, g, p in got]
    assert_same_training(ref, got)
    torch.cuda.synchronize()
    with _no_syncs():
        for _ in range(3):
            ours.zero_grad(set_to_none=True)
            (ours(x).float() - target).pow(2).mean().backward()
    st = off.stats()
    # how many packs were clean by the time the next hook call looked depends on how far
    # the host ran ahead; each clean one found then went to the host
    assert st["offloaded"] + st["kept_on_device"] <= hooks.stats.packed
    assert st["offloaded"] == 0 or st["bytes_offloaded"] > 0


def test_hooks_offload_copies_nothing_on_the_compute_stream_cuda():
    """compress_saved_tensors(offload=): the pack kernels write their counts into the
    pinned slots themselves, and the blocks go out on the offloader's stream: no
    device-to-host copy runs on the stream the pack kernels run on, and there is one
    per block offloaded, none per count."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    from bitsparse_core.torch.offload import Offloader
    hooks = compress_saved_tensors(min_numel=4096, offload=Offloader())
    ours = Hooked(relu_mlp(0, 64, 512, shift=0.6).cuda().bfloat16(), hooks)
    x, target = _data((8, 64), 64, torch.bfloat16)

    def step():
        ours.zero_grad(set_to_none=True)
        (ours(x).float() - target).pow(2).mean().backward()
    step()                                   # warm up: kernels loaded, sites sized
    torch.cuda.synchronize()
    before = hooks.offload.stats()["offloaded"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    packs = {e.device_resource_id for e in gpu if "bitsparse_pack" in e.name}
    to_host = [e for e in gpu if e.name.startswith("Memcpy DtoH")]
    assert packs and hooks.stats.tried > 0
    assert len(to_host) == hooks.offload.stats()["offloaded"] - before
    assert not packs & {e.device_resource_id for e in to_host}


def test_hooks_make_no_sync_cuda():
    """Forward and backward under the hooks never synchronize with the GPU."""
    def mlp():
        return relu_mlp(0, 64, 512, shift=0.6).cuda().bfloat16()

    hooks = compress_saved_tensors(min_numel=4096)
    x, target = _data((8, 64), 64, torch.bfloat16)
    ref, ours = mlp(), Hooked(mlp(), hooks)
    train(ours, x, target, steps=1)    # warm-up: kernels compiled, pinned slots allocated
    train(ref, x, target, steps=1)
    with _no_syncs():
        for m in (ref, ours):
            for _ in range(3):
                m.zero_grad(set_to_none=True)
                (m(x).float() - target).pow(2).mean().backward()
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert hooks.stats.tried >= 1


def test_hooks_learn_the_capacity_cuda():
    import math
    from bitsparse_core.torch.capacity import LADDER, bucket_of
    hooks = compress_saved_tensors(min_numel=1, margin=0.1)
    n = 1 << 20
    got = []
    for _ in range(2):
        t = torch.relu(torch.randn(n, device="cuda", dtype=torch.bfloat16) - 1.5)
        with hooks:
            p = hooks._pack(t)
        torch.cuda.synchronize()
        hooks._poll()
        got.append((t, p))
    (t1, p1), (t2, p2) = got
    assert p1.plan.lay.capacity == math.ceil(0.5 * n)
    density = int(torch.count_nonzero(t1)) / n
    assert p2.plan.lay.capacity == math.ceil(LADDER[bucket_of(density * 1.1)] * n)
    assert p2.state == "clean" and p2.held is None
    assert torch.equal(hooks._unpack(p2).view(torch.int16), t2.view(torch.int16))


def test_errors_cuda():
    w = torch.randn(4, 8, device="cuda", dtype=torch.float64)
    with pytest.raises(bc.UnsupportedDTypeError):
        relu_linear(torch.randn(3, 8, device="cuda", dtype=torch.float64), w)
    with pytest.raises(bc.UnsupportedDeviceError):
        relu_linear(torch.randn(3, 8, device="cuda"), torch.randn(4, 8, device="cuda"),
                    backend="numpy")


def test_nosign_refuses_negative_nan_cuda():
    """relu keeps -NaN's sign bit; nosign cannot store it. The sync-free forward does not
    wait for the status word; a backward with no recompute source raises on it."""
    a = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        a.view(torch.int16)[3, 7] = -64  # 0xFFC0: a NaN with its sign bit set
    w = torch.randn(32, 512, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(bc.EncodingError):
        relu_linear(a, w, encoding="nosign").float().sum().backward()
    out = relu_linear(a, w, encoding="signplane")
    assert out.shape == (64, 32)


@pytest.mark.parametrize("kind", KINDS)
def test_offloaded_training_cuda(kind):
    """offload=: bit-identical training with the blocks in pinned host memory, every block
    but each backward's first on its way back before its layer asks, no host sync, and
    less device memory kept for backward than without offloading."""
    from bitsparse_core.torch.offload import Offloader

    def offloaded(model, off):
        for blk in model.blocks:
            blk.offload = off
        return model

    dense, ours = make_pair(kind, "nosign", d=64, f=1024, layers=4, dtype=torch.bfloat16,
                            device="cuda")
    _, kept = make_pair(kind, "nosign", d=64, f=1024, layers=4, dtype=torch.bfloat16,
                        device="cuda")
    off = Offloader(ahead=2, hold=0)      # every block released at once: counts exact
    offloaded(ours, off)
    x, target = _data((8, 128), 64, torch.bfloat16)
    assert_same_training(train(dense, x, target), train(ours, x, target))
    st = off.stats()
    per_layer = 2 if kind == "reglu" else 1
    assert st["offloaded"] == 4 * per_layer * 3 and st["kept_on_device"] == 0
    assert st["late"] == 3 and st["prefetched"] == st["offloaded"] - 3
    assert st["taken_on_device"] == 0
    # held until their copies are seen done (the default): as exact, at most ``hold``
    # blocks per step taken from the device, how many depends on how far copies got
    held = Offloader(ahead=2, hold=2)
    dense2, again = make_pair(kind, "nosign", d=64, f=1024, layers=4, dtype=torch.bfloat16,
                              device="cuda")
    offloaded(again, held)
    assert_same_training(train(dense2, x, target), train(again, x, target))
    assert held.stats()["taken_on_device"] <= 2 * 3

    def saved_bytes(model):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = (model(x).float() - target).pow(2).mean()
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")   # the allocator frees record_stream'd blocks on a malloc
        held = torch.cuda.memory_allocated() - before
        y.backward()
        return held

    saved_bytes(kept)     # warm-up: the capacity policy settles, kernels load
    assert saved_bytes(ours) < saved_bytes(kept)
    with _no_syncs():
        for _ in range(2):
            ours.zero_grad(set_to_none=True)
            (ours(x).float() - target).pow(2).mean().backward()


def test_offloaded_forward_leaves_no_copy_on_the_compute_stream_cuda():
    """An offloaded C++ node's forward: every device-to-host copy (a block's) runs on the
    offloader's stream, none on the stream the kernels run on, and the packs' counts
    need none (the kernel writes each into its pinned slot; a small copy would wait in
    the copy engine behind the previous layer's block copy)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    from bitsparse_core.torch import native
    from bitsparse_core.torch.offload import Offloader
    _native_built()
    _, ours = make_pair("relu2", "nosign", d=64, f=1024, layers=4, dtype=torch.bfloat16,
                        device="cuda")
    off = Offloader(ahead=2)
    for blk in ours.blocks:
        blk.offload = off
    x, _ = _data((8, 128), 64, torch.bfloat16)
    ours(x).float().sum().backward()            # warm up: kernels loaded, pool filled
    torch.cuda.synchronize()
    before = off.stats()["offloaded"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours(x).float().sum().backward()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    packs = {e.device_resource_id for e in gpu if "bitsparse_pack" in e.name}
    to_host = [e for e in gpu if e.name.startswith("Memcpy DtoH")]
    assert native.host_path(x.device) == "c++" and packs
    assert len(to_host) == off.stats()["offloaded"] - before == 4   # a block per layer
    assert not packs & {e.device_resource_id for e in to_host}


def test_offload_refuses_graph_capture_cuda():
    from bitsparse_core.errors import UnsupportedTransformError
    a = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) - 0.5
    w = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    relu_linear(a, w, offload=True).sum().backward()        # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with pytest.raises(UnsupportedTransformError, match="eager mode only"):
            with torch.cuda.graph(g, stream=s):
                relu_linear(a, w, offload=True)


def test_plain_pack_queues_nothing_without_a_slot(monkeypatch):
    """The hooks' pack takes its pinned slot first: with every slot in flight it queues no
    kernel and returns no block (its count could never come back), and the hooks pass
    the save through; with a slot free it packs as before."""
    from bitsparse_core.torch import capacity as C, ops as O
    monkeypatch.setattr(C, "SLAB", C.FlagSlab(slots=1))
    queued = []
    real = O.host.enqueue_pack
    monkeypatch.setattr(O.host, "enqueue_pack", lambda *a, **k: (queued.append(1), real(*a, **k))[1])
    x = torch.relu(torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16))
    plan = O.plain_plan(x.shape, x.dtype, x.numel(), int(bc.Encoding.NOSIGN))
    O.pack_plain(x, plan)                       # the kernel loaded: a first load can outlast
    torch.cuda.synchronize()                    # the sleep below
    queued.clear()
    torch.cuda._sleep(200_000_000)              # the first slot's copy stays pending
    block, key, known = O.pack_plain(x, plan)
    assert block is not None and known is None and not C.SLAB.lost_slot(*key) and queued == [1]
    block2, key2, _ = O.pack_plain(x, plan)
    assert block2 is None and C.SLAB.lost_slot(*key2) and queued == [1]
    torch.cuda.synchronize()
    status, nnz = C.SLAB.read_slot(*key)
    assert status == 0 and nnz == int(torch.count_nonzero(x))
    block3, key3, _ = O.pack_plain(x, plan)  # the slot came back: packs again
    assert block3 is not None and queued == [1, 1]
    torch.cuda.synchronize()
    assert C.SLAB.read_slot(*key3) == (0, nnz)


# --------------------------------------------------------------------------- #
# The C++ host path (bitsparse_core/torch/native.py)                          #
# --------------------------------------------------------------------------- #
def _count_native(monkeypatch, python_only=False):
    """Counts the op calls the C++ path took, by either entry: ``relu_ffn``'s one call
    (``functional._eager_call``: counted where it ran the op, else the call goes on to
    ``relu_linear``) and ``native.relu_linear``; ``python_only`` sends every call to
    Python."""
    from bitsparse_core.torch import functional, native
    taken = []
    inner, inner_call = native.relu_linear, functional._eager_call

    def spy(*args, **kwargs):
        out = None if python_only else inner(*args, **kwargs)
        taken.append(out is not None)
        return out

    def call_spy(*args):
        if python_only:
            return None, None
        out, a = inner_call(*args)
        if out is not None:
            taken.append(True)
        return out, a
    monkeypatch.setattr(native, "relu_linear", spy)
    monkeypatch.setattr(functional, "_eager_call", call_spy)
    return taken


def _native_built():
    from bitsparse_core.torch import native
    if native.cuda_module() is None:
        pytest.fail(f"the C++ path did not build on this GPU machine: {native._built.get('error')}")


@pytest.mark.parametrize("case", ["clean", "overflow", "autocast", "fp32", "no-bias"])
@pytest.mark.parametrize("kind", ["relu", "relu2"])
def test_native_path_matches_python_path_and_dense_cuda(kind, case, monkeypatch):
    """Same bits from the C++ path, the Python path and dense PyTorch, over 3 AdamW steps,
    including batches that overflow the capacity (every backward recomputes)."""
    import copy
    _native_built()
    dtype = torch.float32 if case in ("autocast", "fp32") else torch.bfloat16
    dense, ours = make_pair(kind, "nosign", d=64, f=384, dtype=dtype, device="cuda")
    if case == "no-bias":
        for net in (dense, ours):
            for blk in net.blocks:
                blk.fc1.bias = blk.fc2.bias = None
    if case == "overflow":
        for blk in ours.blocks:
            blk.capacity_policy.density = 0.01
    python = copy.deepcopy(ours)
    x, target = _data((4, 96), 64, dtype)
    autocast = torch.bfloat16 if case == "autocast" else None
    taken = _count_native(monkeypatch)
    native_run = train(ours, x, target, autocast=autocast)
    assert taken and all(taken), "the C++ path was not taken"
    monkeypatch.undo()
    taken = _count_native(monkeypatch, python_only=True)
    python_run = train(python, x, target, autocast=autocast)
    assert taken and not any(taken)
    assert_same_training(native_run, python_run)
    assert_same_training(train(dense, x, target, autocast=autocast), native_run)
    stats = [blk.stats() for blk in ours.blocks]
    if case == "overflow":
        assert all(s["overflows"] > 0 and s["recomputes"] > 0 for s in stats)
    else:
        assert all(s["packs"] == 3 for s in stats)


def test_native_path_makes_no_sync_cuda(monkeypatch):
    """Forward and backward through the C++ path: no CUDA synchronize (the capacity's
    counts come back through the pinned slots)."""
    _native_built()
    dense, ours = make_pair("relu2", "nosign", d=64, f=384, dtype=torch.bfloat16, device="cuda")
    x, target = _data((4, 96), 64, torch.bfloat16)
    taken = _count_native(monkeypatch)
    for _ in range(3):
        with _no_syncs():
            loss = (ours(x).float() - target).pow(2).mean()
            loss.backward()
    assert len(taken) == 6 and all(taken)


def test_native_path_composes_with_saved_tensor_hooks_cuda(monkeypatch):
    """An outer saved_tensors_hooks sees the C++ node's saved tensors (the packed block
    among them) and hands them back: training stays bit-identical."""
    _native_built()
    dense, ours = make_pair("relu", "raw", d=64, f=256, dtype=torch.bfloat16, device="cuda")
    seen = []

    def pack(t):
        seen.append(t.dtype)
        return t
    x, target = _data((2, 64), 64, torch.bfloat16)
    taken = _count_native(monkeypatch)
    hooked = Hooked(ours, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
    plain = Hooked(dense, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    assert_same_training(train(plain, x, target), train(hooked, x, target))
    assert all(taken) and torch.uint8 in seen


def test_native_path_casts_for_autocast_like_python_cuda(monkeypatch):
    """An fp32 activation under bf16 autocast: the second GEMM runs on its bf16 cast
    (``mm_dtype``), on both paths alike."""
    _native_built()
    import torch.nn.functional as F
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(128, 64, device="cuda", generator=g)
    w1 = (torch.randn(256, 64, device="cuda", generator=g) / 8).requires_grad_()
    b1 = (torch.randn(256, device="cuda", generator=g) - 0.5).requires_grad_()
    w2 = (torch.randn(64, 256, device="cuda", generator=g) / 16).requires_grad_()
    b2 = torch.zeros(64, device="cuda", requires_grad=True)

    def grads(python_only):
        with monkeypatch.context() as m:
            taken = _count_native(m, python_only)
            a = F.linear(x, w1, b1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = relu_linear(a, w2, b2, square=True, density=0.5, recompute=(x, w1, b1))
            assert out.dtype == torch.bfloat16 and taken == [not python_only]
            return [out] + list(torch.autograd.grad(out.float().square().sum(), (w1, b1, w2, b2)))
    for got, want in zip(grads(False), grads(True)):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("backend", ["cupy", "numba"])
def test_exact_pack_shrinks_through_the_extension_cuda(backend, monkeypatch):
    """Exact packs of torch tensors on torch's current stream wait for their count and
    shrink in the extension (backends/cuda/shrink.py), on another stream in Python; both
    give the reference's bytes. A nosign violation under ``"auto"`` packs again as raw,
    under ``"nosign"`` raises; the slot goes back to the thread's free list."""
    from bitsparse_core import dtypes as _dt
    from bitsparse_core.backends.cuda import shrink, slots
    from bitsparse_core.errors import EncodingError
    from bitsparse_core.spec import codec as reference
    if not bc.backend_available(backend):
        pytest.skip(f"no {backend} backend")
    _native_built()
    taken = []
    inner = shrink._native
    monkeypatch.setattr(shrink, "_native", lambda *a: taken.append(inner(*a)) or taken[-1])
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.relu(torch.randn(3, 70001, generator=g, device="cuda")).to(torch.bfloat16)
    x[1, :4000] = 0
    want = {enc: reference.pack_array(x.cpu().view(torch.int16).numpy(), _dt.BFLOAT16, enc)
            for enc in ("nosign", "signplane", "raw")}
    free_before = len(slots._free())
    for enc in ("nosign", "signplane", "raw"):
        for stream in (None, torch.cuda.Stream()):
            taken.clear()
            p = bc.pack(x, encoding=enc, backend=backend, stream=stream)
            if stream is not None:
                stream.synchronize()
            assert p.capacity == p.nnz == want[enc].nnz
            assert p.to_bytes() == want[enc].to_bytes(), (enc, stream)
            if stream is None:
                assert len(taken) == 1 and taken[0] is not None and taken[0][2] is not None
            else:
                assert taken == []
    assert len(slots._free()) == free_before
    from bitsparse_core.spec import ops as reference_ops
    taken.clear()
    a = torch.randn(2, 5000, generator=g, device="cuda").to(torch.bfloat16)
    _, p = bc.relu_pack(a, square=True, backend=backend)          # exact: the same route
    _, p_ref = reference_ops.relu_pack(
        a.cpu().view(torch.int16).numpy().view(_dt.BFLOAT16.numpy), _dt.BFLOAT16, square=True)
    assert p.to_bytes() == p_ref.to_bytes() and len(taken) == 1 and taken[0][2] is not None
    y = x.clone()
    y[2, 7] = -1.0
    taken.clear()
    p = bc.pack(y, encoding="auto", backend=backend)
    assert p.encoding.name == "RAW" and taken and taken[0][2] is None
    with pytest.raises(EncodingError):
        bc.pack(y, encoding="nosign", backend=backend)


def test_gated_op_refuses_an_up_tensor_unlike_the_gate():
    """The CUDA gated op's pack reads u beside g (it writes relu(g) * u): called directly
    with a u of another shape or dtype, it raises rather than read past u."""
    from bitsparse_core.torch import native
    g = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.bitsparse.gated_relu_linear
    for u in (torch.randn(64, 128, device="cuda", dtype=torch.bfloat16),
              torch.randn(64, 256, device="cuda", dtype=torch.float16)):
        with native.python_path(), pytest.raises((ValueError, RuntimeError),
                                                 match="gate and up must match"):
            op(g, u, w, None, None, None, None, None, None, g.numel(), 1, 2, 12, None, 0)
