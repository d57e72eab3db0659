"""bitsparse_core.torch on CPU (reference codec): bit-identical training, saved memory,
hooks, checkpoint, autocast, errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import bitsparse_core as bc  # noqa: E402
from bitsparse_core.torch import (PackedReLUFFN, compress_saved_tensors,  # noqa: E402
                                  gated_relu_linear, relu_linear)
from bitsparse_core.torch import _bridge  # noqa: E402
from torch_models import (ENCODINGS, KINDS, Hooked, assert_same_training,  # noqa: E402
                          make_pair, relu_mlp, saved_tensors_of, train)


@pytest.fixture(autouse=True)
def deterministic():
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(prev)


def pytest_generate_tests(metafunc):
    # every hooks test runs with the C++ front (torch_host_hooks.h) and without it
    if metafunc.function.__name__.startswith("test_hooks_"):
        metafunc.fixturenames.append("hooks_front")
        metafunc.parametrize("hooks_front", ["python", "c++"], indirect=True)


@pytest.fixture
def hooks_front(request):
    from bitsparse_core.torch import native
    if request.param == "python":
        with native.python_path():
            yield None
        return
    mod = native.module()
    if mod is None:
        pytest.skip(f"the C++ extension did not build: {native.build_error()}")
    assert native.hooks_module() is mod
    yield mod


def _data(shape, d, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, d, generator=g).to(dtype)
    target = torch.randn(*shape, d, generator=g)
    return x, target


# --------------------------------------------------------------------------- #
# Import                                                                      #
# --------------------------------------------------------------------------- #
def test_core_imports_without_torch_and_adapter_says_why():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import bitsparse_core\n"
            "try:\n    import bitsparse_core.torch\nexcept ImportError as e:\n"
            "    print('IMPORTERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "IMPORTERROR" in out and "needs PyTorch" in out


# --------------------------------------------------------------------------- #
# Bit-identical training                                                      #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_training_is_bit_identical(kind, encoding, dtype):
    dense, ours = make_pair(kind, encoding, dtype=dtype)
    x, target = _data((3, 16), 32, dtype)
    assert_same_training(train(dense, x, target), train(ours, x, target))


@pytest.mark.parametrize("kind", KINDS)
def test_training_2d_input_fp16(kind):
    dense, ours = make_pair(kind, "nosign", dtype=torch.float16, d=16, f=40)
    x, target = _data((40,), 16, torch.float16)
    # eps=1e-8 underflows in fp16 and turns the update into inf/NaN
    assert_same_training(train(dense, x, target, eps=1e-3), train(ours, x, target, eps=1e-3))


@pytest.mark.parametrize("kind", KINDS)
def test_autocast_bf16_is_bit_identical(kind):
    dense, ours = make_pair(kind, "nosign")
    x, target = _data((2, 24), 32, torch.float32)
    assert_same_training(train(dense, x, target, autocast=torch.bfloat16),
                         train(ours, x, target, autocast=torch.bfloat16))


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_is_bit_identical(kind, reentrant):
    # Reentrant checkpointing sums a block input's gradients in another order than
    # plain autograd (reglu uses x twice), so the reference is checkpointed too.
    dense, ours = make_pair(kind, "nosign", checkpoint=reentrant)
    x, target = _data((2, 16), 32, torch.float32)
    x.requires_grad_(True)  # reentrant checkpoint only backpropagates to inputs needing grad
    assert_same_training(train(dense, x, target), train(ours, x, target))


def test_special_preactivation_values_match_dense():
    """-0.0, +0.0, subnormals and large values in the pre-activation: same output and
    gradients as torch.relu (the packed ReLU stores -0.0 as +0.0, invisibly)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(64, 48, generator=g)
    flat = a.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)
    flat[idx[:200]] = -0.0
    flat[idx[200:400]] = 0.0
    flat[idx[400:450]] = 1e-42   # subnormal
    flat[idx[450:500]] = -1e-42
    flat[idx[500:510]] = 1e18     # large; its square still finite
    w = torch.randn(24, 48, generator=g) * 1e-3
    b = torch.randn(24, generator=g)
    grad = torch.randn(64, 24, generator=g)
    for square in (False, True):
        res = []
        for packed in (False, True):
            a_ = a.clone().requires_grad_(True)
            w_ = w.clone().requires_grad_(True)
            b_ = b.clone().requires_grad_(True)
            if packed:
                out = relu_linear(a_, w_, b_, square=square)
            else:
                h = torch.relu(a_)
                out = torch.nn.functional.linear(torch.square(h) if square else h, w_, b_)
            out.backward(grad)
            res.append((out.detach(), a_.grad, w_.grad, b_.grad))
        for u, v in zip(*res):
            assert torch.equal(u, v)


def test_nan_corners_are_as_documented():
    """ReLU's mask-only gradient passes NaN positions exactly like threshold_backward;
    ReLU²'s gradient is 0 at a NaN activation (PyTorch gives NaN) -- docs/torch.md."""
    a = torch.randn(8, 16)
    a[1, 3] = float("nan")
    w = torch.randn(4, 16)
    grad = torch.randn(8, 4)
    a1 = a.clone().requires_grad_(True)
    relu_linear(a1, w).backward(grad)
    a2 = a.clone().requires_grad_(True)
    torch.nn.functional.linear(torch.relu(a2), w).backward(grad)
    assert torch.equal(a1.grad, a2.grad)
    a3 = a.clone().requires_grad_(True)
    relu_linear(a3, w, square=True).backward(grad)
    a4 = a.clone().requires_grad_(True)
    torch.nn.functional.linear(torch.square(torch.relu(a4)), w).backward(grad)
    keep = torch.ones_like(a, dtype=torch.bool)
    keep[1, 3] = False
    assert torch.equal(a3.grad[keep], a4.grad[keep])
    assert a3.grad[1, 3].item() == 0.0 and torch.isnan(a4.grad[1, 3])


# --------------------------------------------------------------------------- #
# What is saved for backward                                                  #
# --------------------------------------------------------------------------- #
def _activation_sized(saved, numel):
    return [t for t in saved if t.is_floating_point() and t.numel() >= numel]


@pytest.mark.parametrize("encoding", ["raw", "nosign", "signplane"])
@pytest.mark.parametrize("kind", KINDS)
def test_only_packed_planes_are_saved(kind, encoding):
    d, f, n = 32, 96, 48
    dense, ours = make_pair(kind, encoding, d=d, f=f, layers=1)
    x, _ = _data((n,), d, torch.bfloat16)
    x = x.float()
    blk = ours.blocks[0]
    _, saved = saved_tensors_of(lambda: blk(x))
    assert _activation_sized(saved, n * f) == []  # no dense activation survives the forward
    # ... which this check would see in the plain model:
    _, saved_dense = saved_tensors_of(lambda: dense.blocks[0](x))
    assert len(_activation_sized(saved_dense, n * f)) >= (2 if kind == "reglu" else 1)

    # The planes saved are exactly the packed size: the format's section lengths at the
    # module's fixed capacity, plus the status area.
    planes = [t for t in saved if t.dtype in (torch.uint8, torch.uint32, torch.uint64)]
    first = blk.gate_proj if kind == "reglu" else blk.fc1
    a = first(x).detach()
    from bitsparse_core.torch.ops import _plan, _u_plan
    enc = "nosign" if encoding == "auto" else encoding
    cap = blk.capacity_policy.capacity(a.numel())
    want = _plan(a.shape, a.dtype, cap, kind == "relu2", int(bc.Encoding.parse(enc)),
                 bc.DEFAULT_CHUNK_LOG2).nbytes
    if kind == "reglu":   # u's values and signs behind relu(g)'s mask, at the same capacity
        u_enc = "raw" if encoding == "raw" else "signplane"
        want += _u_plan(a.shape, a.dtype, cap, int(bc.Encoding.parse(u_enc)),
                        bc.DEFAULT_CHUNK_LOG2).nbytes
    got = sum(t.numel() * t.element_size() for t in planes)
    assert got == want


# --------------------------------------------------------------------------- #
# compress_saved_tensors                                                      #
# --------------------------------------------------------------------------- #
def test_hooks_context_manager_binds_itself_with_stats():
    m = relu_mlp()
    x, _ = _data((64,), 32, torch.float32)
    with compress_saved_tensors(min_numel=256) as c:
        assert isinstance(c, compress_saved_tensors)
        y = m(x)
        assert c.stats.packed == 2
    y.sum().backward()
    assert c.stats.unpacked >= 2 and 0 < c.stats.packed_bytes < c.stats.dense_bytes


def test_hooks_training_is_bit_identical_and_packs_relu_outputs():
    dense = relu_mlp()
    hooked_inner = relu_mlp()
    hooks = compress_saved_tensors(min_numel=256, min_sparsity=0.5)
    ours = Hooked(hooked_inner, hooks)
    x, target = _data((4, 16), 32, torch.float32)
    rec_dense = train(dense, x, target)
    rec_ours = train(ours, x, target)
    # parameter names differ by the wrapper's prefix
    rec_ours = [(l, {k[len("inner."):]: v for k, v in g.items()},
                 {k[len("inner."):]: v for k, v in p.items()}) for l, g, p in rec_ours]
    assert_same_training(rec_dense, rec_ours)
    s = hooks.stats
    # each step: two ReLU outputs packed once each; the Linear after each saves a
    # reshaped view of the same tensor, which shares the pack
    assert s.packed == 2 * 3 and s.shared == 2 * 3
    assert s.unpacked >= 2 * 3
    assert 0 < s.packed_bytes < s.dense_bytes


class _Recording(torch.nn.Module):
    """Runs ``inner`` under an enclosing saved-tensor hook pair that records what it is
    given (and copies it, as an offloading hook would), with our hooks inside."""

    def __init__(self, inner, hooks):
        super().__init__()
        self.inner, self.hooks, self.seen = inner, hooks, []

    def forward(self, x):
        def pack(t):
            self.seen.append((t.dtype, t.numel()))
            return ("outer", t.clone())

        def unpack(obj):
            assert obj[0] == "outer"
            return obj[1]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), self.hooks:
            return self.inner(x)


@pytest.mark.parametrize("outer", ["recording", "save_on_cpu"])
def test_hooks_compose_with_enclosing_hooks(outer):
    """Hooks entered inside other saved-tensor hooks hand those what they keep: the
    packed blocks and the tensors they pass through, never a dense tensor they packed;
    training stays bit-identical."""
    dense, inner = relu_mlp(), relu_mlp()
    hooks = compress_saved_tensors(min_numel=256, min_sparsity=0.5)
    if outer == "recording":
        ours = _Recording(inner, hooks)
    else:
        class OnCpu(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                with torch.autograd.graph.save_on_cpu(pin_memory=False), hooks:
                    return self.inner(x)
        ours = OnCpu()
    x, target = _data((4, 16), 32, torch.float32)
    rec_dense, rec_ours = train(dense, x, target), train(ours, x, target)
    rec_ours = [(l, {k[len("inner."):]: v for k, v in g.items()},
                 {k[len("inner."):]: v for k, v in p.items()}) for l, g, p in rec_ours]
    assert_same_training(rec_dense, rec_ours)
    assert hooks.stats.packed == 2 * 3
    if outer == "recording":
        blocks = [n for dt, n in ours.seen if dt == torch.uint8]
        assert len(blocks) == hooks.stats.packed            # each clean block once
        relu_out = 4 * 16 * 128                              # what the hooks packed
        assert not any(dt == torch.float32 and n == relu_out for dt, n in ours.seen)
        assert any(dt == torch.float32 for dt, _ in ours.seen)   # and what they passed on


def test_hooks_unpack_many_times_retain_graph():
    m = relu_mlp()
    x, _ = _data((64,), 32, torch.float32)
    hooks = compress_saved_tensors(min_numel=256)
    _assert_backwards_match_plain(m, x, Hooked(m, hooks), times=3)
    assert hooks.stats.packed == 2 and hooks.stats.unpacked >= 3 * 2


def _assert_backwards_match_plain(m, x, hooked, times: int):
    """``times`` backwards (retain_graph) through one hooked forward of ``m`` give the
    gradients of a plain forward and backward."""
    y = hooked(x)
    grads = []
    for _ in range(times):
        m.zero_grad(set_to_none=True)
        y.sum().backward(retain_graph=True)
        grads.append([p.grad.clone() for p in m.parameters()])
    m.zero_grad(set_to_none=True)
    m(x).sum().backward()
    ref = [p.grad for p in m.parameters()]
    assert all(torch.equal(a, b) for g in grads for a, b in zip(g, ref))


def _strip(rec):
    return [(l, {k[len("inner."):]: v for k, v in g.items()},
             {k[len("inner."):]: v for k, v in p.items()}) for l, g, p in rec]


def test_hooks_offload_clean_blocks_and_stay_bit_identical():
    """offload=: each clean block goes to the offloader's pool once its count is known,
    comes back for its backward, and training is bit-identical; the pool's buffers are
    reused step after step."""
    from bitsparse_core.torch.offload import Offloader
    off = Offloader(ahead=1)
    hooks = compress_saved_tensors(min_numel=256, min_sparsity=0.5, offload=off)
    assert hooks.offload is off
    x, target = _data((4, 16), 32, torch.float32)
    rec_dense = train(relu_mlp(), x, target)
    rec_ours = train(Hooked(relu_mlp(), hooks), x, target)
    assert_same_training(rec_dense, _strip(rec_ours))
    st = off.stats()
    assert st["offloaded"] == hooks.stats.packed == 2 * 3
    assert st["bytes_offloaded"] == hooks.stats.packed_bytes      # every clean block, whole
    assert st["prefetched"] + st["late"] == st["offloaded"]
    # buffers are taken again by later steps: of each size class (the first step's blocks
    # are larger, sized from min_sparsity) at most the two that one step needs
    free = off.pool.free_buffers()
    assert free and all(n <= 2 for n in free.values()), free
    assert st["pool_held_bytes"] == off.pool.free_bytes()        # all back after backward


def test_hooks_offload_retain_graph_and_under_enclosing_hooks():
    """A block taken back stays on the device for a second backward (retain_graph); with
    enclosing hooks, the offloaded blocks do not reach them (the passed-through tensors
    still do), and gradients match plain."""
    from bitsparse_core.torch.offload import Offloader
    m = relu_mlp()
    x, _ = _data((64,), 32, torch.float32)
    off = Offloader()
    hooks = compress_saved_tensors(min_numel=256, offload=off)
    rec = _Recording(m, hooks)
    _assert_backwards_match_plain(m, x, rec, times=2)
    assert off.stats()["offloaded"] == hooks.stats.packed == 2
    assert not [n for dt, n in rec.seen if dt == torch.uint8]    # no block went outside
    assert any(dt == torch.float32 for dt, _ in rec.seen)


def test_hooks_offload_is_checked():
    with pytest.raises(TypeError):
        compress_saved_tensors(offload="yes")
    assert compress_saved_tensors(offload=False).offload is None
    assert compress_saved_tensors(offload=True).offload is compress_saved_tensors(
        offload=True).offload                         # the process's shared offloader


def test_hooks_pass_through_what_is_not_worth_packing():
    hooks = compress_saved_tensors(min_numel=1000, min_sparsity=0.5)
    dense = torch.randn(4000)
    small = torch.relu(torch.randn(100))
    f64 = torch.relu(torch.randn(4000, dtype=torch.float64))
    ints = torch.zeros(4000, dtype=torch.int32)
    noncontig = torch.relu(torch.randn(100, 80)).t()
    param = torch.nn.Parameter(torch.zeros(4000))
    for t in (dense, small, f64, ints, noncontig, param):
        assert hooks.pack_hook(t) is t
    assert hooks.stats.packed == 0
    sparse = torch.relu(torch.randn(4000) - 1)
    assert hooks.pack_hook(sparse) is not sparse and hooks.stats.packed == 1


def _dense_site_model(seed=0):
    """A ReLU MLP behind a Linear: the input and the Linear's output are saved dense (save
    sites that learn to pass through), beside the MLP's two sparse ReLU outputs."""
    m = relu_mlp(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), m)


def test_hooks_front_and_python_take_the_same_decisions(hooks_front, monkeypatch):
    """The C++ front and the Python hooks alone pack, share and pass the same saves over
    steps in which save sites learn (dense ones pass for a while, then are tried again),
    and train the same; the front hands Python only the saves that need it: once the
    dense sites pass, the two new packs of each step."""
    import contextlib
    from bitsparse_core.torch import native
    from bitsparse_core.torch.sites import RETRY_AFTER
    if hooks_front is None:
        pytest.skip("compared in the c++ parametrization")
    x, target = _data((4, 16), 32, torch.float32)
    steps = RETRY_AFTER + 3
    per_step = []     # Python calls per forward: _pack (Python path), _front_new (front)

    class Counting(Hooked):
        def forward(self, x):
            per_step.append(0)
            return super().forward(x)

    def counted(fn):
        def call(*args):
            per_step[-1] += 1
            return fn(*args)
        return call
    runs = {}
    for mode in ("python", "c++"):
        per_step.clear()
        with monkeypatch.context() as m:
            # patched before the hooks are made: the front takes the class's functions
            m.setattr(compress_saved_tensors, "_pack", counted(compress_saved_tensors._pack))
            m.setattr(compress_saved_tensors, "_front_new",
                      counted(compress_saved_tensors._front_new))
            hooks = compress_saved_tensors(min_numel=256, min_sparsity=0.5)
            with native.python_path() if mode == "python" else contextlib.nullcontext():
                rec = train(Counting(_dense_site_model(), hooks), x, target, steps=steps)
        runs[mode] = (rec, dataclasses.asdict(hooks.stats), list(per_step))
    (rec_py, stats_py, calls_py), (rec_cpp, stats_cpp, calls_cpp) = runs["python"], runs["c++"]
    assert_same_training(rec_py, rec_cpp)
    assert stats_py == stats_cpp
    assert stats_cpp["packed"] == 2 * steps and stats_cpp["passed"] > 3 * steps
    assert min(calls_py) > 6                          # every save, in Python alone
    # once the first steps have taught the sites (the same steps in both), only the new
    # packs reach Python; the dense sites' tries come back after RETRY_AFTER passes
    assert calls_cpp[3:RETRY_AFTER] == [2] * (RETRY_AFTER - 3)
    assert calls_cpp[0] > 2 and max(calls_cpp[RETRY_AFTER:]) > 2


def test_hooks_front_holds_no_reference_to_the_hooks(hooks_front):
    """The C++ front's functions (which autograd keeps with each saved tensor) do not keep
    the hooks alive, and the hooks are collected with nothing left behind."""
    import gc
    import weakref
    if hooks_front is None:
        pytest.skip("Python's own hooks are bound methods: they keep the hooks alive")
    hooks = compress_saved_tensors(min_numel=256, min_sparsity=0.5)
    m = relu_mlp()
    x, _ = _data((64,), 32, torch.float32)
    with hooks:
        y = m(x)
    y.sum().backward()
    pack_hook, unpack_hook = hooks.pack_hook, hooks.unpack_hook
    ref = weakref.ref(hooks)
    del hooks
    gc.collect()
    assert ref() is None
    t = torch.ones(3)
    assert unpack_hook(t) is t        # still callable: what it is given passes back
    with pytest.raises(RuntimeError, match="after they died"):
        pack_hook(torch.relu(torch.randn(4096)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_hooks_roundtrip_is_lossless(dtype, encoding):
    """Signed data, -0.0, NaN payloads, infinities, subnormals come back bit for bit."""
    import numpy as np
    from helpers import random_tensor
    d = _bridge.bs_dtype(dtype)
    arr = random_tensor(np.random.default_rng(5), (37, 129), d, 0.7)
    bits = torch.from_numpy(arr.view({1: "i1", 2: "<i2", 4: "<i4"}[d.itemsize]).copy())
    t = bits.view(dtype)
    hooks = compress_saved_tensors(min_numel=1, min_sparsity=0.5, encoding=encoding)
    # The first save at a site packs under nosign (auto, nosign): the sign bits found there
    # keep that one dense (exact) and switch the site to raw / signplane for the next.
    for _ in range(2):
        with hooks:
            x = t.clone()   # a new tensor, as each step saves
            packed = hooks.pack_hook(x)
    assert hooks.stats.violations == (encoding in ("auto", "nosign"))
    assert packed is not x
    back = hooks.unpack_hook(packed)
    assert back.dtype == dtype and torch.equal(back.view(bits.dtype), bits)
    assert torch.equal(hooks.unpack_hook(packed).view(bits.dtype), bits)  # again


# --------------------------------------------------------------------------- #
# compress_saved_tensors without waiting: counts that come back later         #
# --------------------------------------------------------------------------- #
class _Counts:
    """Stands in for the pinned slots on CPU (where counts are known at once): a pack's
    count lands only after ``looks`` looks at it; ``looks=None`` holds every count back
    until :meth:`release`."""

    def __init__(self, monkeypatch, looks=None):
        from bitsparse_core.torch import hooks as hooks_module
        self.looks, self.seen = looks, {}
        real = hooks_module._landed

        def landed(ticket, known):
            n = self.seen[id(ticket)] = self.seen.get(id(ticket), 0) + 1
            return None if self.looks is None or n <= self.looks else real(ticket, known)

        monkeypatch.setattr(hooks_module, "_landed", landed)

    def release(self):
        self.looks = 0


def _with_density(density, numel=4096, sign=1.0):
    """A float32 tensor with exactly ``density`` of its elements nonzero."""
    t = torch.zeros(numel)
    k = int(density * numel)
    t[torch.randperm(numel, generator=torch.Generator().manual_seed(k))[:k]] = \
        sign * (torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5)
    return t


def _save(hooks, t):
    """One forward's save of ``t`` (the hooks entered anew: the same save site)."""
    with hooks:
        return hooks.pack_hook(t)


def test_hooks_hold_both_while_pending_then_drop_the_dense(monkeypatch):
    import gc
    import weakref
    from bitsparse_core.torch.hooks import _Packed
    counts = _Counts(monkeypatch)
    hooks = compress_saved_tensors(min_numel=256)
    t = _with_density(0.2)
    want = t.clone()
    p = _save(hooks, t)
    assert isinstance(p, _Packed) and p.state == "pending"
    assert p.held is not None and p.block is not None       # both, while the count is away
    assert (hooks.stats.tried, hooks.stats.packed) == (1, 0)
    counts.release()
    assert hooks.pack_hook(torch.zeros(3)) is not None          # any hook call takes counts in
    assert p.state == "clean" and p.held is None and hooks.stats.packed == 1
    alive = weakref.ref(t)
    del t
    gc.collect()
    assert alive() is None                                   # nothing holds the dense tensor
    assert torch.equal(hooks.unpack_hook(p), want)


def test_hooks_pending_at_unpack_use_the_dense_tensor(monkeypatch):
    counts = _Counts(monkeypatch)
    hooks = compress_saved_tensors(min_numel=256)
    t = _with_density(0.2)
    p = _save(hooks, t)
    back = hooks.unpack_hook(p)
    assert back.data_ptr() == t.data_ptr() and torch.equal(back, t)
    s = hooks.stats
    assert (s.pending_at_unpack, s.kept_dense, s.unpacked, s.packed) == (1, 1, 0, 0)
    assert p.block is None                                   # the block is dropped at once
    assert hooks.unpack_hook(p).data_ptr() == t.data_ptr()       # again (retain_graph)
    counts.release()
    hooks._poll()                                            # the late count still teaches
    site = hooks._sites.get((1, tuple(t.shape), t.dtype))
    assert list(site.recent) == [int(0.2 * 4096) / 4096]


def test_hooks_a_site_whose_pack_came_too_late_passes_through_for_a_while(monkeypatch):
    """A pack still on its way at its unpack saved nothing (the GPU lags by more than the
    rest of the forward): its site passes through for RETRY_AFTER saves, then packs
    again, sized from the late count."""
    import math
    from bitsparse_core.torch.capacity import LADDER, bucket_of
    from bitsparse_core.torch.sites import RETRY_AFTER
    counts = _Counts(monkeypatch)
    hooks = compress_saved_tensors(min_numel=256, margin=0.1)
    t = _with_density(0.2)
    assert hooks.unpack_hook(_save(hooks, t)).data_ptr() == t.data_ptr()
    assert hooks.stats.pending_at_unpack == 1
    counts.release()
    for _ in range(RETRY_AFTER):
        t = _with_density(0.2)
        assert _save(hooks, t) is t
    assert (hooks.stats.tried, hooks.stats.passed) == (1, RETRY_AFTER)
    t = _with_density(0.2)
    p = _save(hooks, t)
    assert p.plan.lay.capacity == math.ceil(LADDER[bucket_of(0.2 * 1.1)] * t.numel())
    hooks._poll()
    assert p.state == "clean" and torch.equal(hooks.unpack_hook(p), t)
    assert hooks.stats.tried == 2 and hooks.stats.packed == 1


def test_hooks_capacity_learns_per_site_and_overflow_keeps_the_dense():
    import math
    from bitsparse_core.torch.capacity import LADDER, bucket_of
    numel = 4096
    hooks = compress_saved_tensors(min_numel=256, min_sparsity=0.5, margin=0.1)
    p1 = _save(hooks, _with_density(0.1))
    assert p1.plan.lay.capacity == math.ceil(0.5 * numel)    # step 1: all that is worth it
    t2 = _with_density(0.1)
    p2 = _save(hooks, t2)
    want = math.ceil(LADDER[bucket_of(0.1 * 1.1)] * numel)
    assert p2.plan.lay.capacity == want < numel // 4          # step 2: the density seen
    t3 = _with_density(0.3)                                   # denser than the site learned
    assert _save(hooks, t3) is t3                             # overflowed: kept as it is
    assert hooks.stats.overflowed == 1 and hooks.stats.kept_dense == 1
    t4 = _with_density(0.3)
    p4 = _save(hooks, t4)
    assert p4.plan.lay.capacity >= 0.3 * numel                # and grows back
    assert torch.equal(hooks.unpack_hook(p2), t2) and torch.equal(hooks.unpack_hook(p4), t4)
    assert len(hooks._sites) == 1


@pytest.mark.parametrize("pending", [False, True], ids=["known", "pending"])
def test_hooks_overflow_at_the_learned_capacity_is_exact(monkeypatch, pending):
    hooks = compress_saved_tensors(min_numel=256)
    _save(hooks, _with_density(0.05))                         # the site learns 5 %
    counts = _Counts(monkeypatch) if pending else None
    t = _with_density(0.4)
    p = _save(hooks, t)
    if pending:
        assert p is not t and p.state == "pending"
        counts.release()
    back = hooks.unpack_hook(p) if p is not t else t
    assert torch.equal(back, t) and back.data_ptr() == t.data_ptr()
    assert hooks.stats.overflowed == 1 and hooks.stats.kept_dense == 1


@pytest.mark.parametrize("pending", [False, True], ids=["known", "pending"])
def test_hooks_nosign_violation_keeps_the_dense_then_signplane(monkeypatch, pending):
    from bitsparse_core import Encoding
    counts = _Counts(monkeypatch) if pending else None
    hooks = compress_saved_tensors(min_numel=256, encoding="nosign")
    t = _with_density(0.2, sign=-1.0)
    p = _save(hooks, t)
    if pending:
        counts.release()
        assert p.state == "pending" and hooks.unpack_hook(p).data_ptr() == t.data_ptr()
    else:
        assert p is t
    assert hooks.stats.violations == 1 and hooks.stats.kept_dense == 1
    t2 = _with_density(0.2, sign=-1.0)
    p2 = _save(hooks, t2)
    assert p2.plan.lay.encoding == Encoding.SIGNPLANE and torch.equal(hooks.unpack_hook(p2), t2)


def test_hooks_throttle_while_a_pack_is_in_flight(monkeypatch):
    """A second block in flight beside the first would hold more than plain PyTorch
    (nothing saved yet): that save passes through until the first count is back."""
    counts = _Counts(monkeypatch)
    hooks = compress_saved_tensors(min_numel=256)
    with hooks:
        p = hooks.pack_hook(_with_density(0.1))
        t = _with_density(0.1, numel=8192)
        assert hooks.pack_hook(t) is t and hooks.stats.throttled == 1
        counts.release()
        t2 = _with_density(0.1, numel=8192)
        p2 = hooks.pack_hook(t2)                                    # nothing in flight: queued
        assert p2 is not t2 and hooks.stats.tried == 2
    hooks._poll()
    assert p.state == p2.state == "clean" and hooks.stats.packed == 2
    assert hooks._credit == sum(y.plan.lay.numel * 4 - y.plan.nbytes for y in (p, p2)) > 0
    del p, p2, t2                                               # (a pack lives while its base does)
    assert hooks._credit == 0                                   # the saving dies with its pack


def test_hooks_in_place_change_after_the_save(monkeypatch):
    """The packed copy is the saved value, whenever the dense tensor changes; a dense
    tensor kept (the pack overflowed) and modified in place is refused, as plain
    PyTorch refuses it."""
    from bitsparse_core.errors import SavedTensorModifiedError
    hooks = compress_saved_tensors(min_numel=256)
    t = _with_density(0.2)
    want = t.clone()
    p = _save(hooks, t)
    t.add_(1.0)
    assert torch.equal(hooks.unpack_hook(p), want)
    counts = _Counts(monkeypatch, looks=0)
    for density, clean in ((0.05, True), (0.4, False)):
        hooks = compress_saved_tensors(min_numel=256)
        _save(hooks, _with_density(0.05))                       # the site learns 5 %
        counts.looks = None                                     # counts held back
        t = _with_density(density)
        want = t.clone()
        p = _save(hooks, t)
        t.mul_(3.0)                                             # while its count is away
        if clean:
            assert torch.equal(hooks.unpack_hook(p), want)          # waited for: clean
        else:
            with pytest.raises(SavedTensorModifiedError, match="modified in place"):
                hooks.unpack_hook(p)                                # overflowed: only t was kept
        counts.release()
        assert hooks._sites.get((1, (4096,), torch.float32)).skip   # too late: passing a while


def test_hooks_a_lost_count_keeps_the_dense(monkeypatch):
    """A count that can never be read (its slot taken again) is treated as not clean."""
    from bitsparse_core.torch import hooks as hooks_module
    monkeypatch.setattr(hooks_module, "_landed", lambda ticket, known: hooks_module.LOST)
    hooks = compress_saved_tensors(min_numel=256)
    t = _with_density(0.1)
    assert _save(hooks, t) is t
    assert hooks.stats.kept_dense == 1 and hooks.stats.packed == 0 and not hooks._flights


def test_hooks_a_dense_site_passes_through_then_is_tried_again():
    from bitsparse_core.torch.sites import RETRY_AFTER
    hooks = compress_saved_tensors(min_numel=256)
    assert _save(hooks, _with_density(0.9)) is not None and hooks.stats.tried == 1
    for _ in range(RETRY_AFTER):
        _save(hooks, _with_density(0.9))
    assert hooks.stats.tried == 1                              # passed through meanwhile
    t = _with_density(0.1)
    p = _save(hooks, t)
    assert hooks.stats.tried == 2 and torch.equal(hooks.unpack_hook(p), t)


def test_hooks_a_site_still_dense_when_tried_again_waits_twice_as_long():
    """Each try of a too-dense site that comes back too dense again doubles the saves it
    passes through before the next (up to MAX_BACKOFF times); a clean count resets it."""
    from bitsparse_core.torch.sites import MAX_BACKOFF, RETRY_AFTER, SaveSite
    site, n = SaveSite("auto"), 1000

    def passes_until_tried():
        k = 0
        while site.capacity(n, 0.5, 0.1) is None:
            k += 1
        return k
    assert site.capacity(n, 0.5, 0.1) == 500        # the largest capacity worth packing
    gaps = []
    for _ in range(8):
        site.observe(0, 900, n)                       # too dense again
        gaps.append(passes_until_tried())
    assert gaps == [RETRY_AFTER * min(2 ** i, MAX_BACKOFF) for i in range(8)]
    site.observe(0, 100, n)
    assert site.capacity(n, 0.5, 0.1) is not None     # sized from the clean count
    site.observe(0, 900, n)
    assert passes_until_tried() == RETRY_AFTER


def test_site_version_moves_whenever_its_next_capacity_or_encoding_would():
    """The C++ front packs at a site without asking Python while the site's version stays:
    it must move with every change of what capacity() would answer (a count that moves
    the bucket, a too-dense count, a skip, a late pack, a nosign violation), and only
    then."""
    from bitsparse_core.torch.sites import SaveSite
    from bitsparse_core.backends.cuda import abi
    site, n = SaveSite("auto"), 1000

    def moved(step):
        v = site.version
        step()
        return site.version != v
    first = site.capacity(n, 0.5, 0.1)
    assert first == 500
    assert moved(lambda: site.observe(0, 100, n))            # 500 -> a bucket above 0.1
    cap = site.capacity(n, 0.5, 0.1)
    assert cap < first
    assert not moved(lambda: site.observe(0, 101, n))        # the same bucket
    assert site.capacity(n, 0.5, 0.1) == cap
    assert moved(lambda: site.observe(0, 450, n))            # a bucket up
    assert moved(lambda: site.observe(0, 900, n))            # too dense: the next passes
    assert moved(lambda: site.capacity(n, 0.5, 0.1)) and site.skip > 0
    assert moved(lambda: site.capacity(n, 0.5, 0.1))         # a skip counted down
    site.skip = 0
    site.recent.clear()
    assert site.capacity(n, 0.5, 0.1) == 500 and site.backoff > 1   # tried again
    assert moved(lambda: site.observe(0, 499, n))            # 500 again, but backoff resets
    site.capacity(n, 0.5, 0.1)
    assert site.backoff == 1
    assert moved(site.late)
    site.skip = 0
    site.capacity(n, 0.5, 0.1)
    assert moved(lambda: site.observe(abi.STATUS_NOSIGN_VIOLATION, 10, n))   # nosign -> raw
    site.capacity(n, 0.5, 0.1)
    assert not moved(lambda: site.observe(abi.STATUS_NOSIGN_VIOLATION, 10, n))


@pytest.mark.parametrize("looks", [None, 0, 1, 3], ids=["never", "at-once", "1", "3"])
def test_hooks_training_bit_identical_whenever_counts_land(monkeypatch, looks):
    _Counts(monkeypatch, looks)
    hooks = compress_saved_tensors(min_numel=256, min_sparsity=0.5)
    x, target = _data((4, 16), 32, torch.float32)
    rec_dense = train(relu_mlp(), x, target, steps=4)
    rec_ours = train(Hooked(relu_mlp(), hooks), x, target, steps=4)
    rec_ours = [(l, {k[len("inner."):]: v for k, v in g.items()},
                 {k[len("inner."):]: v for k, v in p.items()}) for l, g, p in rec_ours]
    assert_same_training(rec_dense, rec_ours)
    s = hooks.stats
    assert s.tried >= 1 and s.packed + s.kept_dense <= s.tried
    if looks is None:
        assert s.packed == 0 and s.pending_at_unpack >= 1
    else:
        assert s.packed >= 1


# --------------------------------------------------------------------------- #
# Empty batches                                                               #
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_empty_batches_match_dense(kind, dtype):
    """A zero dimension in the batch ((2, 0, 16): torch strides it (16, 16, 1)) runs
    forward and backward like the dense model: empty outputs, zero gradients."""
    dense, ours = make_pair(kind, "nosign", d=16, f=40, dtype=dtype)
    for shape in ((2, 0, 16), (0, 16), (0, 3, 16)):
        got = []
        for m in (dense, ours):
            m.zero_grad(set_to_none=True)
            x = torch.zeros(*shape, dtype=dtype, requires_grad=True)
            y = m(x)
            y.sum().backward()
            got.append((y, x.grad, [p.grad for p in m.parameters()]))
        (y0, gx0, gp0), (y1, gx1, gp1) = got
        assert y1.shape == y0.shape == shape and torch.equal(gx1, gx0)
        assert all(torch.equal(a, b) for a, b in zip(gp0, gp1))


def test_packed_ffn_modules_take_a_2_0_16_input():
    from bitsparse_core.torch import PackedReGLUFFN, PackedReLU2FFN
    for m in (PackedReLUFFN(16, 32), PackedReLU2FFN(16, 32), PackedReGLUFFN(16, 32)):
        x = torch.randn(2, 0, 16, requires_grad=True)
        y = m(x)
        y.sum().backward()
        assert y.shape == (2, 0, 16) and x.grad.shape == (2, 0, 16)
        assert all(p.grad is not None and not p.grad.any() for p in m.parameters())


# --------------------------------------------------------------------------- #
# Errors and API                                                              #
# --------------------------------------------------------------------------- #
def test_clear_errors():
    w = torch.randn(4, 8)
    with pytest.raises(bc.UnsupportedDTypeError, match="float64"):
        relu_linear(torch.randn(3, 8, dtype=torch.float64), w.double())
    with pytest.raises(bc.UnsupportedDeviceError, match="meta"):
        relu_linear(torch.randn(3, 8, device="meta"), w.to("meta"))
    with pytest.raises(ValueError, match="encoding"):
        relu_linear(torch.randn(3, 8), w, encoding="zip")
    with pytest.raises(ValueError, match="must match"):
        gated_relu_linear(torch.randn(3, 8), torch.randn(3, 7), w)
    with pytest.raises(ValueError):
        compress_saved_tensors(min_sparsity=2)
    with pytest.raises(ValueError, match="margin"):
        compress_saved_tensors(margin=-0.1)
    with pytest.raises(bc.UnsupportedDeviceError, match="backend"):
        compress_saved_tensors(backend="numba")   # the hooks queue the CuPy-built kernels


def test_nosign_refuses_negative_nan():
    """relu keeps -NaN with its sign bit; nosign cannot store it and says so."""
    a = torch.randn(4, 8)
    a[0, 0] = -float("nan")
    with pytest.raises(bc.EncodingError):
        relu_linear(a, torch.randn(3, 8), encoding="nosign")
    relu_linear(a, torch.randn(3, 8), encoding="signplane")  # representable


def test_from_dense_shares_parameters_and_state_dict_matches():
    fc1, fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
    m = PackedReLUFFN.from_dense(fc1, fc2, encoding="raw")
    assert m.fc1 is fc1 and m.fc2 is fc2
    fresh = PackedReLUFFN(8, 16)
    fresh.load_state_dict(m.state_dict())
    x = torch.randn(5, 8)
    assert torch.equal(fresh(x), m(x)) and torch.equal(m(x), fc2(torch.relu(fc1(x))))


def test_modules_read_the_linears_parameters_as_their_attributes_give_them():
    """The modules read a plain nn.Linear's parameters from its parameter dict (the fast
    read); a parametrized linear, a subclass and a weight put in the instance dict are
    read by attribute, so the packed FFN computes with what ``lin.weight`` gives."""
    import torch.nn.utils.parametrize as P
    from bitsparse_core.torch.modules import linear_params

    class Doubled(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    plain, nobias = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16, bias=False)
    w, b = linear_params(plain)
    assert w is plain.weight and b is plain.bias
    assert linear_params(nobias)[1] is None
    param = torch.nn.Linear(8, 16)
    P.register_parametrization(param, "weight", Doubled())
    assert torch.equal(linear_params(param)[0], 2 * param.parametrizations.weight.original)
    shadowed = torch.nn.Linear(8, 16)
    view = torch.zeros(16, 8)
    object.__setattr__(shadowed, "weight", view)   # as a wrapper's unsharded view
    assert linear_params(shadowed)[0] is view

    class Scaled(torch.nn.Linear):
        pass

    sub = Scaled(8, 16)
    Scaled.bias = property(lambda self: self._parameters["bias"] * 3)
    assert torch.equal(linear_params(sub)[1], 3 * sub._parameters["bias"])

    fc2 = torch.nn.Linear(16, 8)
    m = PackedReLUFFN.from_dense(param, fc2, encoding="raw")
    x = torch.randn(5, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    got, want = m(x), fc2(torch.relu(param(x2)))
    assert torch.equal(got, want)
    got.square().sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    for p in m.parameters():
        p.grad = None
    want.square().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, m.parameters()))
    assert torch.equal(x.grad, x2.grad)


def test_grad_only_for_what_needs_it():
    """Frozen weights and inputs without grad: backward computes just what is asked."""
    a = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(4, 16)
    b = torch.randn(4, requires_grad=True)
    relu_linear(a, w, b).sum().backward()
    a2 = a.detach().clone().requires_grad_(True)
    b2 = b.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(torch.relu(a2), w, b2).sum().backward()
    assert torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad)


def test_packed_sizes_shrink_with_sparsity():
    a = torch.randn(64, 256) - 1.0   # ~84% negative
    _, saved = saved_tensors_of(lambda: relu_linear(a.requires_grad_(), torch.randn(8, 256),
                                                    density=0.2))
    planes = sum(t.numel() * t.element_size() for t in saved if t.dtype in
                 (torch.uint8, torch.uint32))
    dense = a.numel() * 4
    assert planes < dense * 0.3


def test_hooks_unpack_once_while_the_dense_tensor_is_alive():
    """A tensor saved twice by one node is unpacked once: one dense copy, as in plain PyTorch."""
    class SavesTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            r = torch.relu(a)
            ctx.save_for_backward(r, r.view(-1))
            return r * 2

        @staticmethod
        def backward(ctx, g):
            r, flat = ctx.saved_tensors
            assert r.data_ptr() == flat.data_ptr()      # the same dense tensor
            return g * 2 * (r > 0)

    a = (torch.randn(64, 64) - 0.5).requires_grad_()
    with compress_saved_tensors(min_numel=256) as c:
        out = SavesTwice.apply(a)
    out.sum().backward()
    assert c.stats.packed == 1 and c.stats.unpacked == 1 and c.stats.reused == 1
    assert torch.equal(a.grad, 2 * (torch.relu(a.detach()) > 0))


def test_hooks_unpack_once_per_backward_across_nodes():
    """relu saves its output and the matmul after it saves the same tensor; their backwards
    run one after the other, the matmul's unpacked tensor dead before relu's backward asks:
    the hooks hold it meanwhile, so it is decoded once per backward (twice over two)."""
    torch.manual_seed(0)
    a = (torch.randn(64, 256) - 0.5).requires_grad_()
    w = torch.randn(256, 32, requires_grad=True)
    ref_a, ref_w = a.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (torch.relu(ref_a) @ ref_w).square().sum().backward()
    with compress_saved_tensors(min_numel=256) as c:
        out = (torch.relu(a) @ w).square().sum()
    out.backward(retain_graph=True)
    assert (c.stats.packed, c.stats.shared, c.stats.unpacked, c.stats.reused) == (1, 1, 1, 1)
    assert torch.equal(a.grad, ref_a.grad) and torch.equal(w.grad, ref_w.grad)
    out.backward()       # a second backward through the same graph decodes once more
    assert (c.stats.unpacked, c.stats.reused) == (2, 2)
    assert torch.equal(a.grad, 2 * ref_a.grad) and torch.equal(w.grad, 2 * ref_w.grad)
