"""Compress, then offload (bitsparse_core.torch.offload) on the CPU: training is
bit-identical with and without it, blocks come back in backward order with the next
ones fetched ahead, the pool is reused step after step and bounded, and what cannot
be offloaded says why. The CUDA side streams and events are exercised on the GPU."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest

torch = pytest.importorskip("torch")

from bitsparse_core.errors import UnsupportedTransformError  # noqa: E402
from bitsparse_core.torch import relu_linear  # noqa: E402
from bitsparse_core.torch.offload import Offloader, PinnedPool, resolve, size_class  # noqa: E402
from torch_models import KINDS, assert_same_training, make_pair, train  # noqa: E402


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


class _PendingCopies(Offloader):
    """CPU copies whose end the test decides: each copy out returns a token that reads
    as not done until the test adds it to ``done`` (on a GPU: an event on the side
    stream). Every token forgotten is recorded."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.done, self.tokens, self.forgotten = set(), 0, []

    def _copy_out(self, block, host):
        assert super()._copy_out(block, host) == 0       # the CPU copy ran
        self.tokens += 1
        return self.tokens

    def _copied(self, event):
        return event in self.done

    def _forget(self, event):
        self.forgotten.append(event)


@pytest.mark.parametrize("hold", [0, 2])
def test_blocks_whose_copy_may_still_run_are_held_and_taken_from_the_device(hold):
    """With every copy still running, the last ``hold`` blocks of each forward stay on
    the device and backward takes them from there; training stays bit-identical and
    every copy's event is let go exactly once."""
    dense, ours = make_pair("relu2", "nosign", layers=3)
    off = _PendingCopies(ahead=1, hold=hold)
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
    assert sorted(off.forgotten) == list(range(1, off.tokens + 1))
    assert off.pool.free_bytes() == off.pool.held


def test_held_blocks_go_once_their_copy_has_run():
    off = _PendingCopies(hold=3)
    blocks = [torch.full((64,), i, dtype=torch.uint8) for i in range(3)]
    handles = [off.stash(b) for b in blocks]
    assert all(h.block is not None for h in handles)
    off.done |= {1, 2}             # copies run in stash order: the next stash sees two done
    extra = off.stash(torch.zeros(64, dtype=torch.uint8))
    assert [h.block is None for h in handles] == [True, True, False]
    assert off.forgotten == [1, 2]
    assert torch.equal(handles[2].take(), blocks[2])            # still on the device
    assert torch.equal(handles[1].take(), blocks[1])            # back from its host copy
    assert off.stats()["taken_on_device"] == 1
    del extra                      # a stash whose backward never comes lets its block go
    gc.collect()
    assert sorted(off.forgotten) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="hold"):
        Offloader(hold=-1)


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
    assert all(h.back is None for h in handles)
    got = handles[4].take()
    assert torch.equal(got, blocks[4])
    assert [h.back is not None for h in handles[:4]] == [False, False, True, True]
    assert torch.equal(handles[3].take(), blocks[3])
    assert handles[1].back is not None and handles[0].back is None
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
    assert off.stats()["kept_on_device"] == 1 and handles[2].host is None
    assert torch.equal(handles[2].take(), blocks[2])
    assert handles[1].back is not None                # on its way back all the same


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
    pool = PinnedPool(max_bytes=200_000)
    a = pool.take(65537)                             # a 131072-byte buffer
    assert a.numel() == 131072 and pool.held == 131072
    assert pool.take(70000) is None                  # a second one would pass the bound
    pool.give(a, "dev0")
    assert pool.take(70000, "dev0") is a             # same class and lane: the same buffer
    pool.give(a, "dev0")
    c = pool.take(70000, "dev1")                     # free, but another lane's: not handed out
    assert c is not a and pool.held == 131072        # (a was dropped to make room for c)
    pool.give(c, "dev1")
    b = pool.take(100_000)                           # the free buffer is dropped for it
    assert b is not None and b.numel() == size_class(100_000) == pool.held
    with pytest.raises(ValueError):
        PinnedPool(max_bytes=-1)


def test_offload_arguments_and_where_it_cannot_run():
    assert resolve(None) is None and resolve(False) is None
    assert resolve(True) is resolve(True)            # one process-wide default
    off = Offloader(ahead=3, max_host_bytes=1 << 20)
    assert resolve(off) is off
    with pytest.raises(TypeError):
        resolve("yes")
    with pytest.raises(ValueError):
        Offloader(ahead=-1)
    # a model's copy shares its offloader; a pickled one gets a fresh one, same settings
    assert copy.deepcopy(off) is off
    again = pickle.loads(pickle.dumps(off))
    assert again is not off and repr(again) == repr(off)
    a = torch.randn(4, 8) - 0.5
    w = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(UnsupportedTransformError, match="eager mode only"):
        torch.func.grad(lambda w: relu_linear(a, w, offload=off).sum())(w)


def test_side_stream_context_sets_and_restores_torchs_current_stream(monkeypatch):
    """The side stream's slim context (torch._C's stream set / get on the current device)
    restores the stream it found, each ``with`` on its own state, and leaves a stream of
    another device to torch's own context. CUDA-free: torch._C's calls are recorded."""
    from types import SimpleNamespace

    from bitsparse_core.torch import offload as O
    calls, current = [], {"dev": 0, "stream": (5, 0, 1)}

    def set_stream(stream_id, device_index, device_type):
        calls.append(("set", stream_id, device_index))
        current["stream"] = (stream_id, device_index, device_type)

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current["dev"], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream",
                        lambda dev: current["stream"], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_setStream", set_stream, raising=False)
    side = O._SideStream(SimpleNamespace(stream_id=9, device_index=0, device_type=1))
    with side.current():
        assert current["stream"] == (9, 0, 1)
        with side.current():                       # nested: restores the side stream
            pass
        assert current["stream"] == (9, 0, 1)
    assert current["stream"] == (5, 0, 1)
    assert calls == [("set", 9, 0), ("set", 9, 0), ("set", 9, 0), ("set", 5, 0)]

    entered = []

    class TorchContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            entered.append(("enter", self.stream.device_index))

        def __exit__(self, *exc):
            entered.append(("exit", self.stream.device_index))
            return False

    monkeypatch.setattr(torch.cuda, "stream", TorchContext)
    other = O._SideStream(SimpleNamespace(stream_id=3, device_index=1, device_type=1))
    calls.clear()
    with other.current():
        pass
    assert entered == [("enter", 1), ("exit", 1)] and calls == []
