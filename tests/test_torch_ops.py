"""The sync-free packed FFN path: custom ops, adaptive capacity, exact recompute on
overflow, torch.compile and (GPU) CUDA graphs, each bit-identical to dense PyTorch."""

from __future__ import annotations

import copy
import gc
import logging
import math
import shutil
import time

import pytest

torch = pytest.importorskip("torch")

import bitsparse_core.torch as bst  # noqa: E402
from bitsparse_core.errors import CapacityOverflowError  # noqa: E402
from bitsparse_core.torch import capacity as C  # noqa: E402
from bitsparse_core.torch import ops  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _dense(m, x):
    if isinstance(m, bst.PackedReGLUFFN):
        return m.down_proj(torch.relu(m.gate_proj(x)) * m.up_proj(x))
    h = torch.relu(m.fc1(x))
    return m.fc2(h * h if m.square else h)


FFNS = [bst.PackedReLUFFN, bst.PackedReLU2FFN, bst.PackedReGLUFFN]


def _grads(fn, m, x, steps=2):
    for p in m.parameters():
        p.grad = None
    x.grad = None
    for _ in range(steps):
        out = fn(x)
        out.float().square().sum().backward()
    return out.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None] + [
        x.grad.clone()]


def _model(cls, device, density=None, d=32, f=128, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return cls(d, f, density=density).to(device=device, dtype=dtype)


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", FFNS)
@pytest.mark.parametrize("density", [None, 0.9, 0.01])
def test_bit_identical_to_dense_with_and_without_overflow(device, cls, density):
    m = _model(cls, device, density)
    x = torch.randn(3, 40, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    out, grads = _grads(m, m, x)
    ref, ref_grads = _grads(lambda t: _dense(m, t), m, x)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    st = m.stats()
    assert st["packs"] == 2
    if density == 0.01:            # every batch overflows: counted, recomputed, exact
        if device == "cuda":
            torch.cuda.synchronize()
            m.capacity_policy.poll()
        assert m.stats()["overflows"] == 2 and st["recomputes"] == 2
    elif device == "cpu":
        assert st["overflows"] == 0 and st["recomputes"] == 0


def test_capacity_adapts_to_observed_density():
    pol = C.CapacityPolicy()
    assert pol.capacity(1000) == 1000            # nothing seen yet: cannot overflow
    ticket = torch.tensor([C.HOST_FINAL, 0])
    pol.track(ticket, 1000, 1000, known=(0, 100))
    assert pol.capacity(1000) == 1000            # the bucket moves only when polled
    pol.poll()
    assert 0.11 <= C.LADDER[pol.bucket] < 0.14   # 0.1 * 1.1 rounded up the ladder
    assert pol.capacity(1000) == int(-(-C.LADDER[pol.bucket] * 1000 // 1))
    pol.track(ticket, 1000, 20, known=(2, 300))
    pol.poll()
    assert pol.overflows == 1 and C.LADDER[pol.bucket] >= 0.33
    with pytest.raises(ValueError):
        C.CapacityPolicy(density=1.5)


def test_flag_slab_tickets_read_unknown_until_landed_and_after_reuse():
    slab = C.FlagSlab(slots=2)
    addr, t1 = slab.acquire()
    assert slab.read(t1) is None                 # sentinel: the copy has not landed
    status, nnz = slab._arrays()
    i = int(t1[0])
    nnz[2 * i + 1] = 77
    status[4 * i] = 2
    assert slab.read(t1) == (2, 77)
    _, t2 = slab.acquire()
    _, t3 = slab.acquire()                       # the ring came round to t1's slot
    assert int(t3[0]) == i and slab.read(t1) is None
    assert slab.read(torch.tensor([C.NO_SLOT, 0])) is None


def test_block_tickets_find_the_block_and_nothing_else(monkeypatch):
    """A block's ticket is found from the block (a view at its start too), not from a copy,
    a view elsewhere in it, or a new block once the old one is freed; freed blocks' entries
    go in the sweep. The extension's table is asked where this one has nothing."""
    monkeypatch.setattr(C, "NATIVE_BLOCK_TICKET", None)
    table = C.BlockTickets()
    block = torch.empty(64, dtype=torch.uint8)
    ticket = C.FlagSlab._new_ticket(5, 7)
    table.remember(block, ticket)
    assert table.ticket(block) is ticket and table.ticket(block[:8]) is ticket
    for other in (block.clone(), block[8:]):
        assert table.ticket(other).tolist() == [C.NO_SLOT, 0]
    table.remember(torch.empty(8, dtype=torch.uint8), C.fixed_ticket(C.NO_SLOT))  # no slot: none
    assert len(table._entries) == 1
    del block, other                                      # the view kept it alive
    fresh = torch.empty(64, dtype=torch.uint8)
    assert table.ticket(fresh).tolist() == [C.NO_SLOT, 0]
    table._sweep_at = 1
    table.remember(fresh, ticket)
    assert len(table._entries) == 1                       # the freed block's entry went
    monkeypatch.setattr(C, "NATIVE_BLOCK_TICKET", lambda b: (9, 3))
    assert table.ticket(fresh.clone()).tolist() == [9, 3]


def test_policy_stats_take_replay_recomputes_from_the_device_counters(monkeypatch, caplog):
    """Recomputes in CUDA graph replays are counted by the device; stats() takes them in
    (and logs the new ones), and a policy that is gone gives its counter back."""
    counts, dropped = {}, []
    monkeypatch.setattr(C, "NATIVE_REPLAY_RECOMPUTES", lambda pid: counts.get(pid, 0))
    monkeypatch.setattr(C, "NATIVE_DROP_REPLAY_COUNTERS", dropped.append)
    pol = C.CapacityPolicy(density=0.1)
    assert pol.stats()["replay_recomputes"] == 0
    counts[pol.id] = 3
    logging.disable(logging.NOTSET)
    with caplog.at_level(logging.WARNING, logger="bitsparse_core.torch"):
        assert pol.stats()["replay_recomputes"] == 3
    assert "3 replays" in caplog.text
    pid = pol.id
    del pol
    gc.collect()
    assert pid in dropped


def test_adapt_to_replays_moves_an_adaptive_bucket_up_once_per_batch_of_replays(monkeypatch):
    """Replays that recomputed (counted by the device) move an adaptive policy's bucket one
    step up and keep it there as a floor, which later polls of small densities do not go
    under; no new replay, a fixed density or the top bucket move nothing. The model-level
    function answers how many policies moved; a copy keeps what it had taken in."""
    counts = {}
    monkeypatch.setattr(C, "NATIVE_REPLAY_RECOMPUTES", lambda pid: counts.get(pid, 0))
    m = torch.nn.Sequential(bst.PackedReLU2FFN(8, 32), bst.PackedReLU2FFN(8, 32),
                            bst.PackedReLU2FFN(8, 32, density=0.1))
    pols = [layer.capacity_policy for layer in m]
    pols[0].bucket = pols[1].bucket = 5
    assert bst.adapt_to_replays(m) == 0
    counts[pols[0].id] = counts[pols[2].id] = 2
    assert pols[0].stats()["replay_recomputes"] == 2    # stats() takes none from the adaptation
    assert bst.adapt_to_replays(m) == 1
    assert (pols[0].bucket, pols[0].floor, pols[1].bucket) == (6, 6, 5)
    assert pols[2].capacity(1000) == 100                # a fixed density stays
    assert bst.adapt_to_replays(m) == 0                 # nothing new since
    pols[0]._recent.append(0.001)                       # eager polls: sparse counts
    pols[0].poll()
    assert pols[0].bucket == 6
    counts[pols[0].id] = 3
    clone = copy.deepcopy(pols[0])
    assert pols[0].adapt_to_replays() and pols[0].bucket == 7
    assert clone.bucket == 6 and clone.floor == 6 and clone._replays_adapted == 2
    pols[1].bucket = len(C.LADDER) - 1
    counts[pols[1].id] = 1
    assert not pols[1].adapt_to_replays() and pols[1].bucket == len(C.LADDER) - 1


def test_policy_poll_passes_a_count_that_can_never_be_read(monkeypatch):
    """A pending count whose slot the ring gave to a later pack is lost: poll drops it and
    takes in the counts behind it (it used to stop at it until the queue overflowed)."""
    slab = C.FlagSlab(slots=2)
    monkeypatch.setattr(C, "SLAB", slab)
    status, nnz = slab._arrays()

    def land(ticket, count):
        i = int(ticket[0])
        nnz[2 * i + 1] = count
        status[4 * i] = 0

    pol = C.CapacityPolicy()
    _, t1 = slab.acquire()
    pol.track(t1, 1000, 1000)
    land(t1, 100)
    _, t2 = slab.acquire()
    _, t3 = slab.acquire()              # t1's slot again: t1's count is gone
    assert slab.lost(t1) and not slab.lost(t3)
    pol.track(t3, 1000, 1000)
    land(t3, 300)
    pol.poll()
    assert not pol._pending and pol.max_density == 0.3
    assert C.LADDER[pol.bucket] >= 0.33


def test_flag_slab_tickets_have_the_fake_kernels_metadata():
    """A ticket is what the ops' fake kernels describe: its own (2,) int64 CPU tensor,
    contiguous at storage offset 0 (opcheck and compiled graphs rely on it)."""
    slab = C.FlagSlab(slots=4)
    fake = torch.empty((2,), dtype=torch.int64)
    for _ in range(6):
        _, t = slab.acquire()
        assert t._base is None and t.storage_offset() == 0 and t.is_contiguous()
        assert (t.shape, t.stride(), t.dtype, t.device) == (fake.shape, fake.stride(),
                                                            fake.dtype, fake.device)


def test_flag_slab_wait_sees_a_late_copy_and_gives_up_on_none():
    """A backward that finds its count pending watches the slot: a copy landing later
    (here from another thread, as the GPU's would) is returned; a slot that never
    lands gives None after the timeout; a ticket with no slot gives None at once."""
    import threading
    slab = C.FlagSlab(slots=4)
    _, ticket = slab.acquire()
    status, nnz = slab._arrays()
    i = int(ticket[0])

    def land():
        time.sleep(0.05)
        nnz[2 * i + 1] = 123
        status[4 * i] = 0

    th = threading.Thread(target=land)
    th.start()
    assert slab.wait(ticket, timeout_s=30) == (0, 123)
    th.join()
    _, never = slab.acquire()
    t0 = time.perf_counter()
    assert slab.wait(never, timeout_s=0.05) is None and time.perf_counter() - t0 >= 0.05
    assert slab.wait(torch.tensor([C.NO_SLOT, 0])) is None


def test_policy_pending_modes():
    assert C.CapacityPolicy().pending == "wait"
    pol = C.CapacityPolicy(pending="recompute")
    assert pol.wait(torch.tensor([0, 1])) is None and pol.waits == 0
    with pytest.raises(ValueError, match="pending"):
        C.CapacityPolicy(pending="sometimes")
    m = bst.PackedReLU2FFN(8, 32, pending="recompute")
    assert m.capacity_policy.pending == "recompute"


def test_relu_linear_without_recompute_source_raises_on_overflow():
    torch.manual_seed(0)
    a = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    out = bst.relu_linear(a, w, density=0.01)
    with pytest.raises(CapacityOverflowError, match="recompute"):
        out.float().sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    torch.manual_seed(0)
    a = torch.randn(4, 96, device=device, dtype=torch.bfloat16) - 0.5
    x = torch.randn(4, 48, device=device, dtype=torch.bfloat16)
    w = torch.randn(24, 96, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(96, 48, device=device, dtype=torch.bfloat16)
    args = (a, w, None, x, w1, None, 200, ops.op_config(True, 1, 12, None), 0)
    # On CUDA a block's value slots past its count are never written (nothing reads
    # them), so the AOT check's eager-vs-traced output comparison cannot hold there; the
    # compile tests cover tracing.
    utils = ("test_schema", "test_faketensor") + (("test_aot_dispatch_static",)
                                                  if device == "cpu" else ())
    torch.library.opcheck(torch.ops.bitsparse.relu_linear.default, args, test_utils=utils)
    u = torch.randn(4, 96, device=device, dtype=torch.bfloat16)
    gated = (a, u, w, None, x, w1, None, w1, None, 200, 1, 2, 12, None, 0)
    torch.library.opcheck(torch.ops.bitsparse.gated_relu_linear.default, gated,
                          test_utils=utils)


@pytest.mark.parametrize("device,size", [("cpu", "small"), ("cpu", "large")] + [
    pytest.param("cuda", size, marks=pytest.mark.gpu) for size in ("small", "large")])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("cls", [bst.PackedReLU2FFN, bst.PackedReGLUFFN])
def test_compile_fullgraph_bit_identical_to_compiled_dense(device, size, backend, cls):
    """Large: thousands of tokens, where a reduction's order (the bias gradients) shows in
    the last bits if the two graphs compute it differently."""
    if backend == "inductor" and device == "cpu" and shutil.which("g++") is None:
        pytest.skip("inductor on CPU compiles C++ and no g++ is on PATH")
    torch._dynamo.reset()
    tokens, d, f = (24, 32, 128) if size == "small" else (2048, 128, 512)
    m = _model(cls, device, d=d, f=f)
    x = torch.randn(2, tokens, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    out, grads = _grads(torch.compile(m, backend=backend, fullgraph=True), m, x)
    dense = torch.compile(lambda t: _dense(m, t), backend=backend, fullgraph=True)
    ref, ref_grads = _grads(dense, m, x)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("cls", [bst.PackedReLU2FFN, bst.PackedReGLUFFN])
def test_compiled_graph_is_reused_when_the_capacity_moves(device, backend, cls):
    """An adaptive capacity is a graph input under torch.compile: its bucket moving (as
    the policy's poll moves it, here set before each step: full, sparse enough to
    overflow, sized, full again) compiles nothing new, and the results stay those of
    the dense model, the overflowing step's through its exact recompute. The model is
    built under its device's context, as a model built on the GPU is."""
    if backend == "inductor" and device == "cpu" and shutil.which("g++") is None:
        pytest.skip("inductor on CPU compiles C++ and no g++ is on PATH")
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    with torch.device(device):
        m = _model(cls, device)
    pol = m.capacity_policy
    compiled = torch.compile(m, backend=backend, fullgraph=True)
    dense = torch.compile(lambda t: _dense(m, t), backend=backend, fullgraph=True)
    overflows = pol.overflows
    for bucket in (len(C.LADDER) - 1, 0, 15, len(C.LADDER) - 1, 12):
        torch.manual_seed(bucket)
        x = torch.randn(3, 40, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
        pol.bucket = bucket
        out, grads = _grads(compiled, m, x, steps=1)
        ref, ref_grads = _grads(dense, m, x, steps=1)
        assert torch.equal(out, ref)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert pol.overflows > overflows              # bucket 0 (1/64 of a density) overflowed
    assert counters["stats"]["unique_graphs"] == 2   # the model's graph and dense's


def test_freeze_holds_the_bucket_and_thaw_adapts_again():
    pol = C.CapacityPolicy(initial_density=0.1)
    bucket = pol.bucket
    pol.freeze()
    assert pol.frozen and pol.density == C.LADDER[bucket] and pol.stats()["frozen"]
    assert pol.traced_capacity(12345) == pol.capacity(12345) == math.ceil(
        C.LADDER[bucket] * 12345)
    pol._observe(9000, 10000, 12345)          # a dense batch: counted, the bucket held
    pol.poll()
    assert pol.bucket == bucket and pol.density == C.LADDER[bucket]
    pol.thaw()
    assert not pol.frozen and pol.density is None
    pol.poll()                                # adapts to the dense batch it saw
    assert pol.bucket == C.sized_bucket(0.9, pol.margin) > bucket
    fixed = C.CapacityPolicy(density=0.3)
    fixed.freeze()
    fixed.thaw()
    assert fixed.density == 0.3 and not fixed.frozen    # a given density stays


def test_freeze_capacity_walks_the_model():
    model = torch.nn.Sequential(bst.PackedReLU2FFN(8, 32), bst.PackedReGLUFFN(8, 32),
                                bst.PackedReLUFFN(8, 32, density=0.2), torch.nn.Linear(8, 8))
    assert bst.freeze_capacity(model) == 2 and bst.freeze_capacity(model) == 0
    assert [m.capacity_policy.frozen for m in model[:3]] == [True, True, False]
    assert bst.thaw_capacity(model) == 2
    assert model[0].capacity_policy.density is None and model[2].capacity_policy.density == 0.2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_frozen_capacity_compiles_once_more_and_stays_exact(device, backend):
    """Freezing a compiled model's capacity recompiles it once, to a graph without the
    capacity symbol; it stays bit-identical to compiled dense, a batch that overflows the
    frozen capacity included (recomputed exactly and counted), and thawing goes back to
    the first graph."""
    if backend == "inductor" and device == "cpu" and shutil.which("g++") is None:
        pytest.skip("inductor on CPU compiles C++ and no g++ is on PATH")
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    m = _model(bst.PackedReLU2FFN, device)
    pol = m.capacity_policy
    compiled = torch.compile(m, backend=backend, fullgraph=True)
    dense = torch.compile(lambda t: _dense(m, t), backend=backend, fullgraph=True)

    def step(seed):
        torch.manual_seed(seed)
        x = torch.randn(3, 40, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
        out, grads = _grads(compiled, m, x, steps=1)
        ref, ref_grads = _grads(dense, m, x, steps=1)
        assert torch.equal(out, ref)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))

    bias = m.fc1.bias.detach().clone()
    with torch.no_grad():
        m.fc1.bias.fill_(-100.0)      # a batch of (almost) no nonzeros
    step(0)
    with torch.no_grad():
        m.fc1.bias.copy_(bias)
    assert bst.freeze_capacity(m) == 1    # at the bucket step 0's count gave
    held = pol.density
    assert held == C.LADDER[pol.bucket] < 0.1
    overflows, recomputes = pol.overflows, pol.recomputes
    step(1)                           # about half dense: overflows the frozen capacity
    step(2)
    pol.poll()
    assert pol.overflows > overflows and pol.recomputes > recomputes and pol.density == held
    bst.thaw_capacity(m)
    step(3)
    assert counters["stats"]["unique_graphs"] == 3   # adaptive, frozen, and dense's


def test_density_stand_in_stays_on_the_cpu_under_a_default_device():
    """The stand-in's device is part of dynamo's guards: one made under a ``torch.device``
    context (a model built on the GPU) and its successors after a bucket move must agree,
    or the first move recompiles the model (seen on the H100: 3 graphs where 2 were due)."""
    with torch.device("meta"):
        pol = C.CapacityPolicy()
        first = pol._units
        pol.bucket = 7
    assert first.device.type == "cpu" and pol._units.device.type == "cpu"
    assert first.shape[0] != pol._units.shape[0]


def test_policy_copies_keep_the_bucket_and_make_their_own_density_stand_in():
    """A copy (deepcopy, pickle; also of a state written before the stand-in existed,
    with ``bucket`` as a plain attribute) has the original's bucket, a stand-in of its
    own whose size is that bucket's density, and the same traced capacity."""
    import copy
    import pickle
    pol = C.CapacityPolicy()
    pol.bucket = 7
    units = C._density_units(C.LADDER[7]).shape[0]
    old = pol.__getstate__()
    old["bucket"] = old.pop("_bucket")                  # the layout before the stand-in
    legacy = C.CapacityPolicy.__new__(C.CapacityPolicy)
    legacy.__setstate__(old)
    for twin in (copy.deepcopy(pol), pickle.loads(pickle.dumps(pol)), legacy):
        assert twin.bucket == 7 and twin.id != pol.id
        assert twin._units is not pol._units and twin._units.shape[0] == units
        assert twin.traced_capacity(12345) == pol.traced_capacity(12345)
    assert pol.capacity(12345) <= pol.traced_capacity(12345) <= pol.capacity(12345) + 1
    pol.bucket = len(C.LADDER) - 1                      # density 1: the whole tensor
    assert pol.traced_capacity(12345) == 12345


def test_fake_block_size_is_the_plan_size_at_every_capacity():
    """The fake kernels' size of a block at a symbolic capacity is the size formula's:
    the plan at capacity 0 plus the value and sign sections (checked at concrete ones)."""
    from bitsparse_core.backends.cuda import abi
    from bitsparse_core.spec.format import Encoding
    from bitsparse_core.torch import ops

    class Sym(int):     # not an int by type: takes the symbolic branch, computes as one
        pass
    for mode in (abi.Mode.RELU, abi.Mode.RELU2, abi.Mode.MASKED):
        for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
            for enc in Encoding:
                if mode == abi.Mode.MASKED and enc == Encoding.NOSIGN:
                    continue
                for cap in (0, 1, 7, 8, 63, 64, 65, 511, 998, 3 * 333):
                    plan = ops._plan_of(mode, (3, 333), dtype, cap, int(enc), 12)
                    assert ops._block_nbytes(mode, (3, 333), dtype, Sym(cap), int(enc),
                                             12) == plan.nbytes, (mode, dtype, enc, cap)


@pytest.mark.gpu
@pytest.mark.parametrize("density", [None, 0.01])
@pytest.mark.parametrize("cls", [bst.PackedReLU2FFN, bst.PackedReGLUFFN])
def test_cuda_graph_training_step_replays_bit_identically(density, cls):
    from bitsparse_core.torch import native
    m = _model(cls, "cuda", density)
    ref_m = _model(cls, "cuda", density)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_m.parameters(), lr=0.1)
    xs = [torch.randn(4, 64, 32, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    static_x = xs[0].clone()

    def step(model, optim, x):
        optim.zero_grad(set_to_none=False)
        loss = model(x).float().square().mean()
        loss.backward()
        optim.step()
        return loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):                        # warm up (as torch.cuda.graphs asks)
            step(m, opt, static_x)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(2):
        step(ref_m, ref_opt, static_x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_loss = step(m, opt, static_x)
    before = m.capacity_policy.stats()["replay_recomputes"]
    for x in xs:
        static_x.copy_(x)
        g.replay()
        ref = step(ref_m, ref_opt, x)
        assert torch.equal(static_loss, ref)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref_m.parameters()))
    if density is not None and native.conditional_nodes(static_x.device.index):
        # every replay overflowed and recomputed on the device, which counted it
        torch.cuda.synchronize()
        assert m.capacity_policy.stats()["replay_recomputes"] == before + len(xs)


def _check_captured_backward(forward, backward, forward_other, cap, status, asked, watch):
    """The protocol of the captured-backward tests. ``forward(capacity)`` packs the blocks
    from the FFN input; ``backward(blocks, capacity)`` is the backward op whose recompute
    source is another input; ``forward_other(capacity)`` packs from that other input.
    - Eagerly, a clean pack's backward reads the blocks; an overflowed one (capacity 1)
      recomputes from the other input, so the two give different gradients.
    - A captured backward replays either one bit for bit, as the status word the test
      writes into the first block says.
    - With the forward captured too, the pack's own status picks the way. Without
      conditional nodes, the captured backward recomputes on a clean pack as well.
    ``asked(i)``: whether output i was asked for (else it is empty); ``watch``: an output
    index that differs between the two ways."""
    from bitsparse_core.backends.cuda import abi
    from bitsparse_core.torch import native

    def eager(pack, capacity):   # the count back first: the backward reads it
        blocks = pack(capacity)
        torch.cuda.synchronize()
        return [t.clone() for t in backward(blocks, capacity)]

    clean = eager(forward, cap)            # reads the blocks (and warms the side stream)
    recomputed = eager(forward_other, 1)   # overflows: recomputes from the other input
    blocks = forward(cap)
    torch.cuda.synchronize()
    assert native.conditional_nodes(0), "this GPU's driver takes conditional nodes (12.8+)"

    def capture(with_forward=False):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            outs = backward(forward(cap) if with_forward else blocks, cap)
        return graph, outs

    def replay(graph, outs, overflow=None):
        if overflow is not None:
            blocks[0][status:status + 4].copy_(torch.tensor(
                [abi.STATUS_OVERFLOW if overflow else 0], dtype=torch.int32).view(torch.uint8))
        graph.replay()
        torch.cuda.synchronize()
        return [t.clone() for t in outs]

    graph, outs = capture()
    for overflow in (False, True, False):
        got = replay(graph, outs, overflow)
        want = recomputed if overflow else clean
        for i, (g_, w_) in enumerate(zip(got, want)):
            assert torch.equal(g_, w_), (overflow, i)
            assert (g_.numel() > 0) == bool(asked(i)), i
    got = replay(*capture(with_forward=True))
    assert torch.equal(got[watch], clean[watch])
    with native.no_conditional_nodes():
        assert not native.conditional_nodes(0)
        graph, outs = capture(with_forward=True)
    assert native.conditional_nodes(0)
    got = replay(graph, outs)
    assert torch.equal(got[watch], recomputed[watch])
    assert not torch.equal(got[watch], clean[watch])


@pytest.mark.gpu
@pytest.mark.parametrize("square", [True, False])
@pytest.mark.parametrize("needs", [7, 2, 1])
def test_captured_backward_reads_the_block_where_clean_and_recomputes_where_not(square, needs):
    """A ``relu_linear_backward`` captured into a CUDA graph holds both ways as one
    conditional node: a replay whose pack was clean reads the packed block, one whose
    status word says overflow recomputes from the FFN input. The recompute source here
    differs from what made ``a``, so the two ways give different gradients and each
    replay shows which one ran; each is bit-identical to its eager counterpart. Without
    conditional nodes the captured backward recomputes on a clean pack too."""
    from bitsparse_core.spec.format import DEFAULT_CHUNK_LOG2, Encoding
    from bitsparse_core.torch import native
    if native.cuda_module() is None:
        pytest.skip("the C++ host path is not built")
    torch.manual_seed(0)
    dt, T, d, f = torch.bfloat16, 256, 64, 256
    x = torch.randn(T, d, device="cuda", dtype=dt)
    x_other = torch.randn(T, d, device="cuda", dtype=dt)
    w1 = torch.randn(f, d, device="cuda", dtype=dt) / 8
    b1 = torch.randn(f, device="cuda", dtype=dt) / 8
    w2 = torch.randn(d, f, device="cuda", dtype=dt) / 16
    b2 = torch.randn(d, device="cuda", dtype=dt) / 16
    g_out = torch.randn(T, d, device="cuda", dtype=dt)
    enc, cap = int(Encoding.NOSIGN), T * f
    fwd = ops.op_config(square, enc, DEFAULT_CHUNK_LOG2, None)
    bwd = ops.op_config(square, enc, DEFAULT_CHUNK_LOG2, None, dt, True, needs)

    def forward(source, capacity):
        a = torch.nn.functional.linear(source, w1, b1)
        return torch.ops.bitsparse.relu_linear(a, w2, b2, source, w1, b1, capacity, fwd, 0)[1]

    def backward(block, source, capacity):
        return torch.ops.bitsparse.relu_linear_backward(g_out, block, w2, source, w1,
                                                        b1, capacity, bwd, 0)

    status = ops._plan([T, f], dt, cap, square, enc, DEFAULT_CHUNK_LOG2).status_offset
    _check_captured_backward(lambda c: (forward(x, c),), lambda b, c: backward(b[0], x_other, c),
                             lambda c: (forward(x_other, c),), cap, status,
                             lambda i: needs & (1 << i), 0 if needs & 1 else 1)


CAPTURED_OPS = ("relu_linear", "relu_linear_backward")
GATED_OPS = ("gated_relu_linear", "gated_relu_linear_backward")


def _meta_outputs(name):
    """The op's outputs on meta inputs (its fake kernel): where each would live."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    a, x = torch.empty(4, 96, **meta), torch.empty(4, 48, **meta)
    w, w1 = torch.empty(24, 96, **meta), torch.empty(96, 48, **meta)
    g_out = torch.empty(4, 24, **meta)
    fwd, bwd = ops.op_config(True, 1, 12, None), ops.op_config(True, 1, 12, None,
                                                               torch.bfloat16, False, 3)
    block = torch.empty(64, device="meta", dtype=torch.uint8)
    args = {"relu_linear": (a, w, None, x, w1, None, 200, fwd, 0),
            "relu_linear_backward": (g_out, block, w, x, w1, None, 200, bwd, 0),
            "gated_relu_linear": (a, a, w, None, x, w1, None, w1, None, 200, 1, 2, 12, None, 0),
            "gated_relu_linear_backward": (g_out, block, block, w, x, w1, None, w1, None,
                                           [4, 96], torch.bfloat16, False, 200, 1, 2, 12, None,
                                           0, 3)}[name]
    return getattr(torch.ops.bitsparse, name)(*args)


@pytest.mark.parametrize("name", CAPTURED_OPS + GATED_OPS)
def test_the_ops_outputs_stay_on_the_inputs_device(name):
    """No CPU output (a pack's ticket stays beside its block): inductor would partition its
    CUDA graphs around an op with one."""
    assert all(t.device.type == "meta" for t in _meta_outputs(name))


@pytest.mark.gpu
@pytest.mark.parametrize("needs", [7, 2, 1])
def test_captured_gated_backward_reads_the_blocks_where_clean_and_recomputes_where_not(needs):
    """The ReGLU backward captured into a CUDA graph: one conditional node on relu(g)'s pack
    status, whose first body reads both blocks (relu(g)'s and u's) and whose second
    recomputes g and u from the FFN input. As for ReLU, the recompute source differs from
    what made g and u, so each replay shows which body ran, and each equals its eager
    counterpart bit for bit."""
    from bitsparse_core.spec.format import DEFAULT_CHUNK_LOG2, Encoding
    from bitsparse_core.torch import native
    if native.cuda_module() is None:
        pytest.skip("the C++ host path is not built")
    torch.manual_seed(0)
    dt, T, d, f = torch.bfloat16, 256, 64, 256
    x, x_other = (torch.randn(T, d, device="cuda", dtype=dt) for _ in range(2))
    wg, wu = (torch.randn(f, d, device="cuda", dtype=dt) / 8 for _ in range(2))
    bg, bu = (torch.randn(f, device="cuda", dtype=dt) / 8 for _ in range(2))
    w2 = torch.randn(d, f, device="cuda", dtype=dt) / 16
    b2 = torch.randn(d, device="cuda", dtype=dt) / 16
    g_out = torch.randn(T, d, device="cuda", dtype=dt)
    enc, u_enc, cap = int(Encoding.NOSIGN), int(Encoding.SIGNPLANE), T * f
    chunk = DEFAULT_CHUNK_LOG2

    def forward(source, capacity):
        g = torch.nn.functional.linear(source, wg, bg)
        u = torch.nn.functional.linear(source, wu, bu)
        return torch.ops.bitsparse.gated_relu_linear(g, u, w2, b2, source, wg, bg, wu, bu,
                                                     capacity, enc, u_enc, chunk, None, 0)[1:]

    def backward(blocks, source, capacity):
        return torch.ops.bitsparse.gated_relu_linear_backward(
            g_out, *blocks, w2, source, wg, bg, wu, bu, [T, f], dt, True, capacity, enc, u_enc,
            chunk, None, 0, needs)

    status = ops._plan([T, f], dt, cap, False, enc, chunk).status_offset
    _check_captured_backward(lambda c: forward(x, c), lambda b, c: backward(b, x_other, c),
                             lambda c: forward(x_other, c), cap, status,
                             lambda i: needs & (1 << max(i - 1, 0)), 0 if needs & 1 else 2)


@pytest.mark.skipif(not hasattr(torch.Tag, "cudagraph_unsafe"),
                    reason="this torch has no cudagraph_unsafe tag")
def test_which_ops_inductors_cuda_graphs_capture():
    """Every op goes inside inductor's CUDA graphs (``mode="reduce-overhead"``): a captured
    backward picks the blocks or the recompute on the device. None carries the tag that
    would keep it outside, between partitions."""
    for name in CAPTURED_OPS + GATED_OPS:
        assert torch.Tag.cudagraph_unsafe not in getattr(torch.ops.bitsparse, name).default.tags


@pytest.mark.gpu
@pytest.mark.parametrize("density", [None, 0.01])
@pytest.mark.parametrize("cls", [bst.PackedReLU2FFN, bst.PackedReGLUFFN])
def test_reduce_overhead_training_matches_dense_reduce_overhead(density, cls):
    """``torch.compile(mode="reduce-overhead")``: training steps with an optimizer are
    bit-identical to the dense model compiled the same way, overflowing packs included
    (density 0.01), and inductor skips no CUDA graph. The ops are captured (ReLU²'s and
    ReGLU's): once the graphs replay, the host packs nothing (the policy sees no new
    pack), the device picks each backward's way and counts the replays that recomputed."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    m = _model(cls, "cuda", density, d=64, f=256)
    ref_m = _model(cls, "cuda", density, d=64, f=256)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref_m.parameters(), lr=1e-3)
    call = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    ref_call = torch.compile(lambda t: _dense(ref_m, t), mode="reduce-overhead",
                             fullgraph=True)

    def step(fn, optim, x):
        torch.compiler.cudagraph_mark_step_begin()
        optim.zero_grad(set_to_none=True)
        loss = fn(x).float().square().mean()
        loss.backward()
        optim.step()
        return loss.detach().clone()

    before = None
    for i in range(8):
        torch.manual_seed(i)
        x = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16)
        if i == 5:
            before = m.capacity_policy.stats()
        assert torch.equal(step(call, opt, x), step(ref_call, ref_opt, x)), i
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref_m.parameters()))
    after = m.capacity_policy.stats()
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert after["packs"] == before["packs"], (before, after)   # steps 5-7 replay the graphs
    if density is not None:       # each replay's overflow, counted on the device
        assert after["replay_recomputes"] >= before["replay_recomputes"] + 3


@pytest.mark.gpu
def test_reduce_overhead_records_a_graph_per_capacity_and_stays_exact(monkeypatch):
    """Under ``mode="reduce-overhead"`` the captured ops take the capacity as an input of
    the graph: a capacity that moves (set before each step: sparse enough to overflow,
    sized, full) records a graph per value, and the steps stay those of dense compiled
    the same way, the overflowing one's included (its replay recomputes on the device)."""
    from torch._inductor import cudagraph_trees
    recorded = []
    record = cudagraph_trees.CUDAGraphNode.__init__

    def counting(self, *args, **kwargs):
        recorded.append(1)
        record(self, *args, **kwargs)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphNode, "__init__", counting)
    torch._dynamo.reset()
    m = _model(bst.PackedReLU2FFN, "cuda")
    pol = m.capacity_policy
    call = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    dense = torch.compile(lambda t: _dense(m, t), mode="reduce-overhead", fullgraph=True)

    def step(fn, x):
        torch.compiler.cudagraph_mark_step_begin()
        out, grads = _grads(fn, m, x, steps=1)
        return out.clone(), grads      # the graph's next replay writes over its output

    before = None
    for i, bucket in enumerate((12, 12, 12, 0, 0, 15, len(C.LADDER) - 1, 0)):
        if i == 3:
            before = len(recorded)
        torch.manual_seed(i)
        x = torch.randn(3, 40, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        pol.bucket = bucket
        out, grads = step(call, x)
        ref, ref_grads = step(dense, x)
        assert torch.equal(out, ref), i
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), i
    assert before > 0 and len(recorded) > before


@pytest.mark.gpu
def test_adapt_to_replays_follows_densities_that_grow_under_reduce_overhead():
    """A graph recorded while the activations were sparse replays their small capacity:
    once the batches get denser each replay recomputes (exactly, counted by the device),
    ``adapt_to_replays`` moves the bucket up a step per call until the replays of the
    graphs recorded at the new capacities recompute no more; every step equals dense's."""
    torch._dynamo.reset()
    m = _model(bst.PackedReLU2FFN, "cuda")
    pol = m.capacity_policy
    call = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    dense = torch.compile(lambda t: _dense(m, t), mode="reduce-overhead", fullgraph=True)

    def step(i):
        torch.manual_seed(i)
        x = torch.randn(3, 40, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for fn in (call, dense):
            torch.compiler.cudagraph_mark_step_begin()
            out, grads = _grads(fn, m, x, steps=1)
            if fn is call:
                got = out.clone(), grads
        assert torch.equal(got[0], out), i
        assert all(torch.equal(a, b) for a, b in zip(got[1], grads)), i
        torch.cuda.synchronize()    # the device's replay counts are in host memory now

    with torch.no_grad():
        m.fc1.bias.fill_(-1.0)      # about 4 % of relu(fc1(x)) nonzero
    for i in range(4):              # warm-up, recording (sized by then), replays
        step(i)
    sparse = pol.bucket
    assert bst.adapt_to_replays(m) == 0 and pol.stats()["replay_recomputes"] == 0
    with torch.no_grad():
        m.fc1.bias.zero_()          # about half nonzero: the recorded capacity overflows
    for i in range(4, 7):
        step(i)
    assert pol.stats()["replay_recomputes"] > 0
    rounds = 0
    while bst.adapt_to_replays(m):
        rounds += 1
        assert rounds < len(C.LADDER) and pol.floor == pol.bucket
        for i in range(10 * rounds, 10 * rounds + 4):   # warm-up, recording, replays
            step(i)
    assert rounds > 0 and pol.bucket > sparse
    settled = pol.stats()["replay_recomputes"]
    for i in range(100, 104):
        step(i)
    assert pol.stats()["replay_recomputes"] == settled


def test_torch_func_grad_matches_dense_and_vmap_raises_named_error():
    from bitsparse_core.errors import UnsupportedTransformError
    torch.manual_seed(0)
    x = torch.randn(6, 16)
    w1, w2 = torch.randn(48, 16), torch.randn(8, 48)

    def ours(w1, w2):
        return bst.relu_ffn(x, w1, None, w2, None, square=True).square().sum()

    def dense(w1, w2):
        return torch.nn.functional.linear(torch.relu(x @ w1.t()) ** 2, w2).square().sum()

    got = torch.func.grad(ours, argnums=(0, 1))(w1, w2)
    want = torch.func.grad(dense, argnums=(0, 1))(w1, w2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(UnsupportedTransformError):
        torch.func.vmap(lambda t: bst.relu_ffn(t, w1, None, w2, None))(x.view(2, 3, 16))


@pytest.mark.parametrize("frozen", ["fc1", "fc2"])
def test_only_the_gradients_asked_for_are_computed(frozen):
    m = _model(bst.PackedReLU2FFN, "cpu")
    getattr(m, frozen).requires_grad_(False)
    x = torch.randn(2, 24, 32, dtype=torch.bfloat16, requires_grad=True)
    out, grads = _grads(m, m, x, steps=1)
    ref, ref_grads = _grads(lambda t: _dense(m, t), m, x, steps=1)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert all(p.grad is None for p in getattr(m, frozen).parameters())


@pytest.mark.parametrize("cls", FFNS)
def test_eager_calls_kernels_directly_and_a_dispatch_mode_sees_the_ops(monkeypatch, cls):
    """In plain eager the Packed modules call the ops' kernels without the dispatcher;
    under a dispatch mode the same calls go through torch.ops (so the mode sees them),
    with the same results, forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from bitsparse_core.torch import ops as _ops
    direct = []
    for name, fn in list(_ops.IMPLS.items()):
        monkeypatch.setitem(_ops.IMPLS, name,
                            lambda *a, _n=name, _f=fn: direct.append(_n) or _f(*a))
    torch.manual_seed(0)
    m = cls(16, 64, density=1.0)
    x = torch.randn(4, 16, requires_grad=True)
    eager = _grads(m, m, x, steps=1)
    assert sorted(set(direct)) == sorted(n for n in _ops.IMPLS if n.startswith(
        "gated" if cls is bst.PackedReGLUFFN else "relu"))

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    direct.clear()
    with Log():
        logged = _grads(m, m, x, steps=1)
    assert direct == []
    assert any(s.startswith("bitsparse.") and "backward" in s for s in seen)
    assert any(s.startswith("bitsparse.") and "backward" not in s for s in seen)
    for a, b in zip(eager[1] + [eager[0]], logged[1] + [logged[0]]):
        assert torch.equal(a, b)


def test_a_function_mode_takes_the_dispatcher_path(monkeypatch):
    """Under a TorchFunctionMode (``torch.device(...)``, ``set_default_device``) the forward
    op goes through torch.ops, which runs its kernel outside the mode (the host-side
    tensors it makes stay on the CPU), and training gives what it gives without it."""
    from bitsparse_core.torch import ops as _ops
    direct = []
    for name, fn in list(_ops.IMPLS.items()):
        monkeypatch.setitem(_ops.IMPLS, name,
                            lambda *a, _n=name, _f=fn: direct.append(_n) or _f(*a))
    torch.manual_seed(0)
    m = bst.PackedReLU2FFN(16, 64, density=1.0)
    x = torch.randn(4, 16, requires_grad=True)
    plain = _grads(m, m, x, steps=1)
    assert direct
    direct.clear()
    with torch.device("meta"):
        moded = _grads(m, m, x, steps=1)
    assert "relu_linear" not in direct     # (backward runs outside function modes)
    for a, b in zip(plain[1] + [plain[0]], moded[1] + [moded[0]]):
        assert torch.equal(a, b)


def test_initial_density_sizes_the_first_packs_and_an_overflow_there_is_exact():
    """``initial_density``: the packs before any count has come back take that ladder
    density rather than the full capacity; a first batch denser than it overflows and is
    recomputed (bit-identical to dense), and the bucket then follows the counts."""
    pol = C.CapacityPolicy(initial_density=0.1)
    assert C.LADDER[pol.bucket] == min(d for d in C.LADDER if d >= 0.1)
    assert pol.capacity(1000) == math.ceil(C.LADDER[pol.bucket] * 1000) < 1000
    assert C.CapacityPolicy().capacity(1000) == 1000
    for bad in ({"initial_density": 0.0}, {"initial_density": 1.5},
                {"initial_density": 0.2, "density": 0.3}):
        with pytest.raises(ValueError, match="initial_density"):
            C.CapacityPolicy(**bad)
    torch.manual_seed(0)
    m = bst.PackedReLU2FFN(32, 128, initial_density=0.05).to(torch.bfloat16)
    first = m.capacity_policy.bucket
    x = torch.randn(3, 40, 32, dtype=torch.bfloat16, requires_grad=True)
    out, grads = _grads(m, m, x, steps=1)        # a fresh layer: ~half its activations kept
    ref, ref_grads = _grads(lambda t: _dense(m, t), m, x, steps=1)
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    st = m.stats()
    assert st["overflows"] == 1 and st["recomputes"] == 1
    assert m.capacity_policy.bucket > first      # sized from the count the backward polled
    conv = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    wrapper = torch.nn.Sequential(conv)
    bst.convert(wrapper, initial_density=0.25)
    from bitsparse_core.torch.convert import packed_modules
    (packed,) = packed_modules(wrapper).values()
    assert C.LADDER[packed.capacity_policy.bucket] == min(d for d in C.LADDER if d >= 0.25)
