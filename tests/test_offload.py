"""Compress, then offload (bitsparse_core.torch.offload, its engine in the C++ host path)
on the CPU: training is bit-identical with and without it, blocks come back in backward
order with the next ones fetched ahead, the pool is reused step after step and bounded,
and what cannot be offloaded says why. The CUDA side streams and events are exercised
on the GPU; here copies still running are emulated (the engine's ``emulate_copies``)."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest

torch = pytest.importorskip("torch")

from bitsparse_core.errors import BackendUnavailableError, UnsupportedTransformError  # noqa: E402
from bitsparse_core.torch import native, relu_linear  # noqa: E402
from bitsparse_core.torch.offload import Offloader, pinned_pool, resolve, size_class  # noqa: E402
from torch_models import KINDS, assert_same_training, make_pair, train  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _engine_built():
    """The offload engine lives in the C++ host path: built once (cached), or skipped
    where this machine cannot build it."""
    if native.module() is None:
        pytest.skip(f"the C++ host path could not be built: {native.build_error()}")


def _data(shape, d, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, d, generator=g), torch.randn(*shape, d, generator=g)


def _offloaded(model, off):
    for blk in model.blocks:
        blk.offload = off
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_offloaded_training_is_bit_identical(kind):
    dense, ours = make_pair(kind, "nosign", layers=3)
    off = Offloader(ahead=1)
    _offloaded(ours, off)
    x, target = _data((3, 16), 32)
    steps = 3
    assert_same_training(train(dense, x, target, steps=steps), train(ours, x, target, steps=steps))
    st = off.stats()
    per_layer = 2 if kind == "reglu" else 1          # relu(g) and u: two blocks
    stashed = 3 * per_layer * steps
    assert st["offloaded"] == stashed and st["kept_on_device"] == 0
    # each backward starts with the last block, asked for before anything was fetched;
    # every other block was on its way back when its layer asked for it
    assert st["late"] == steps and st["prefetched"] == stashed - steps
    assert off.pool.free_bytes() == off.pool.held    # every buffer back after backward


@pytest.mark.parametrize("kind", KINDS)
def test_offloaded_blocks_that_overflowed_recompute_and_stay_exact(kind):
    """A density bound far below the batch's: every pack overflows its capacity, the
    offloaded block still goes out and comes back, and the backward recomputes from the
    FFN input, so training stays bit-identical and the overflows are counted."""
    from bitsparse_core.torch.capacity import CapacityPolicy
    dense, ours = make_pair(kind, "nosign", layers=2)
    for blk in ours.blocks:
        blk.capacity_policy = CapacityPolicy(density=0.01)
    off = Offloader(ahead=1)
    _offloaded(ours, off)
    x, target = _data((3, 16), 32)
    assert_same_training(train(dense, x, target, steps=2), train(ours, x, target, steps=2))
    stats = [blk.stats() for blk in ours.blocks]
    assert all(st["overflows"] > 0 and st["recomputes"] > 0 for st in stats)
    assert off.stats()["offloaded"] > 0


def _pending(**kw):
    """An Offloader whose CPU copies out end when the test says (``engine.copies_done``;
    on a GPU: an event on the side stream). ``engine.released_tokens()`` gives the
    number of copies and the tokens let go."""
    off = Offloader(**kw)
    off.engine.emulate_copies(True)
    return off


@pytest.mark.parametrize("hold", [0, 2])
def test_blocks_whose_copy_may_still_run_are_held_and_taken_from_the_device(hold):
    """With every copy still running, the last ``hold`` blocks of each forward stay on
    the device and backward takes them from there; training stays bit-identical and
    every copy's event is let go exactly once."""
    dense, ours = make_pair("relu2", "nosign", layers=3)
    off = _pending(ahead=1, hold=hold)
    _offloaded(ours, off)
    x, target = _data((3, 16), 32)
    steps = 3
    assert_same_training(train(dense, x, target, steps=steps), train(ours, x, target, steps=steps))
    st = off.stats()
    assert st["offloaded"] == 3 * steps and st["taken_on_device"] == hold * steps
    # hold=0: backward asks for the last block before anything was fetched (late), the
    # rest were fetched ahead; hold=2: the last two come from the device, and taking the
    # second of them fetches the first block ahead, so nothing is late
    late, ahead = (1, 2) if hold == 0 else (0, 1)
    assert st["late"] == late * steps and st["prefetched"] == ahead * steps
    gc.collect()
    tokens, released = off.engine.released_tokens()
    assert sorted(released) == list(range(1, tokens + 1))
    assert off.pool.free_bytes() == off.pool.held


def test_held_blocks_go_once_their_copy_has_run():
    off = _pending(hold=3)
    blocks = [torch.full((64,), i, dtype=torch.uint8) for i in range(3)]
    handles = [off.stash(b) for b in blocks]
    assert [h.state for h in handles] == ["held"] * 3
    off.engine.copies_done(2)      # copies run in stash order: the next stash sees two done
    extra = off.stash(torch.zeros(64, dtype=torch.uint8))
    assert [h.state for h in handles] == ["on_host", "on_host", "held"]
    assert off.engine.released_tokens() == (4, [1, 2])
    assert torch.equal(handles[2].take(), blocks[2])            # still on the device
    assert handles[1].state == "fetched"                        # on its way back
    assert torch.equal(handles[1].take(), blocks[1])            # back from its host copy
    assert handles[1].state == "taken" and off.stats()["taken_on_device"] == 1
    del extra                      # a stash whose backward never comes lets its block go
    gc.collect()
    assert sorted(off.engine.released_tokens()[1]) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="hold"):
        Offloader(hold=-1)
    with pytest.raises(RuntimeError, match="1-D uint8"):
        off.stash(torch.zeros(4, 16))


def test_the_pool_is_reused_step_after_step():
    _, ours = make_pair("relu", "nosign", layers=3)
    off = Offloader()
    _offloaded(ours, off)
    x, target = _data((3, 16), 32)
    held = []
    for _ in range(6):
        ((ours(x) - target) ** 2).mean().backward()
        held.append(off.pool.held)
    # the adaptive capacity settles in the first steps; from then on no new buffer
    assert held[-1] == held[-3] and off.stats()["offloaded"] == 18


def test_blocks_come_back_in_backward_order_with_the_next_ones_ahead():
    off = Offloader(ahead=2)
    blocks = [torch.full((64,), i, dtype=torch.uint8) for i in range(5)]
    handles = [off.stash(b) for b in blocks]
    assert all(h.state == "on_host" for h in handles)
    got = handles[4].take()
    assert torch.equal(got, blocks[4])
    assert [h.state for h in handles[:4]] == ["on_host", "on_host", "fetched", "fetched"]
    assert torch.equal(handles[3].take(), blocks[3])
    assert handles[1].state == "fetched" and handles[0].state == "on_host"
    assert off.stats()["late"] == 1
    for h in (handles[2], handles[1], handles[0]):
        assert torch.equal(h.take(), blocks[handles.index(h)])
    assert off.stats()["late"] == 1 and off.pool.free_bytes() == 5 * size_class(64)


def test_a_full_pool_keeps_blocks_on_the_device_and_stays_exact():
    dense, ours = make_pair("relu2", "nosign", layers=3)
    probe = Offloader()
    _offloaded(ours, probe)
    x, target = _data((3, 16), 32)
    ours(x).sum().backward()
    one_block = probe.stats()["bytes_offloaded"] // 3
    dense, ours = make_pair("relu2", "nosign", layers=3)
    off = Offloader(max_host_bytes=2 * size_class(one_block))   # room for two of the three
    _offloaded(ours, off)
    assert_same_training(train(dense, x, target, steps=2), train(ours, x, target, steps=2))
    st = off.stats()
    assert st["kept_on_device"] >= 1 and st["offloaded"] >= 2
    assert st["kept_on_device"] + st["offloaded"] == 6
    assert st["pool_held_bytes"] <= off.pool.max_bytes


def test_a_block_kept_on_the_device_still_fetches_the_next_ones():
    off = Offloader(ahead=1, max_host_bytes=2 * size_class(64))
    blocks = [torch.full((64,), i, dtype=torch.uint8) for i in range(3)]
    handles = [off.stash(b) for b in blocks]          # the third does not fit: kept
    assert off.stats()["kept_on_device"] == 1 and handles[2].state == "kept"
    assert torch.equal(handles[2].take(), blocks[2])
    assert handles[1].state == "fetched"              # on its way back all the same


@pytest.mark.parametrize("kind", ["relu", "reglu"])
def test_a_second_backward_through_an_offloaded_block_says_why(kind):
    _, ours = make_pair(kind, "nosign", layers=1)
    _offloaded(ours, Offloader())
    x, _ = _data((3, 16), 32)
    loss = ours(x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_a_forward_without_backward_gives_its_buffers_back():
    _, ours = make_pair("relu", "nosign", layers=2)
    off = Offloader()
    _offloaded(ours, off)
    x, _ = _data((3, 16), 32)
    y = ours(x)
    assert off.pool.free_bytes() == 0 < off.pool.held
    del y
    gc.collect()
    assert off.pool.free_bytes() == off.pool.held


def test_pool_reuses_size_classes_and_evicts_free_buffers_for_new_ones():
    # power-of-two size classes (torch's pinned allocator rounds to them anyway)
    assert [size_class(n) for n in (1, 4096, 4097, 65536, 65537, 70000)] == [
        4096, 4096, 8192, 65536, 131072, 131072]
    pool = pinned_pool(max_bytes=200_000)
    assert pool.max_bytes == 200_000 and pinned_pool().max_bytes is None
    for n in (1, 4097, 65537):                       # the C++ pool's classes are these
        buf = pinned_pool().take(n)
        assert buf.numel() == size_class(n) and buf.dtype == torch.uint8
    a = pool.take(65537)                             # a 131072-byte buffer
    assert a.numel() == 131072 and pool.held == 131072
    assert pool.take(70000) is None                  # a second one would pass the bound
    pool.give(a, 0)
    assert pool.free_buffers() == {(0, 131072): 1}
    assert pool.take(70000, 0).data_ptr() == a.data_ptr()   # same class and lane: same buffer
    pool.give(a, 0)
    c = pool.take(70000, 1)                          # free, but another lane's: not handed out
    assert c.data_ptr() != a.data_ptr() and pool.free_buffers() == {}
    assert pool.held == 131072                       # (a was dropped to make room for c)
    pool.give(c, 1)
    b = pool.take(100_000)                           # the free buffer is dropped for it
    assert b is not None and b.numel() == size_class(100_000) == pool.held
    assert pool.free_bytes() == 0
    with pytest.raises(ValueError):
        pinned_pool(max_bytes=-1)


def test_offload_arguments_and_where_it_cannot_run():
    assert resolve(None) is None and resolve(False) is None
    assert resolve(True) is resolve(True)            # one process-wide default
    off = Offloader(ahead=3, max_host_bytes=1 << 20)
    assert resolve(off) is off
    with pytest.raises(TypeError):
        resolve("yes")
    with pytest.raises(ValueError):
        Offloader(ahead=-1)
    with pytest.raises(ValueError):
        Offloader(max_host_bytes=-5)
    # a model's copy shares its offloader; a pickled one gets a fresh one, same settings
    assert copy.deepcopy(off) is off
    again = pickle.loads(pickle.dumps(off))
    assert again is not off and repr(again) == repr(off)
    a = torch.randn(4, 8) - 0.5
    w = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(UnsupportedTransformError, match="eager mode only"):
        torch.func.grad(lambda w: relu_linear(a, w, offload=off).sum())(w)


def test_offload_says_why_without_the_cpp_host_path(monkeypatch):
    monkeypatch.setattr(native, "module", lambda: None)
    monkeypatch.setattr(native, "_built", {"error": OSError("no compiler here")})
    with pytest.raises(BackendUnavailableError, match="no compiler here"):
        Offloader()
    with pytest.raises(BackendUnavailableError, match="offload=None"):
        pinned_pool()


def test_pool_evicts_the_largest_free_buffers_first():
    """Room for a new buffer is made from the largest free ones, whatever their lane."""
    pool = pinned_pool(max_bytes=262144 + 8192)
    small = [pool.take(4096, 1) for _ in range(2)]       # lane 1: 2 x 4 KiB
    big = pool.take(131072, 0)                           # lane 0: 128 KiB
    for b in small:
        pool.give(b, 1)
    pool.give(big, 0)
    assert pool.held == 131072 + 2 * 4096
    got = pool.take(131072 + 1, 2)                       # 256 KiB: the 128 KiB one must go
    assert got is not None and got.numel() == 262144
    assert pool.free_buffers() == {(1, 4096): 2}         # the small ones stay
