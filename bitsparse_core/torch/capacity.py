"""Capacity without waiting: device counters read back asynchronously, and the
per-module policy that sizes the next packs from them.

A fixed-capacity pack needs no host sync, but its capacity must come from
somewhere. The pack kernel writes its status word and nonzero count into a slot of
one pinned host slab (:class:`FlagSlab`); the host reads a slot only once both have
landed, which it sees without any CUDA call: both fields are filled with a sentinel
first, and each lands whole (aligned words). A
:class:`CapacityPolicy` (one per module) polls its slots, keeps the largest
density seen recently, and picks the next capacity from a ladder of density
buckets (so allocations and compiled graphs are reused) with a margin.
Overflows are counted and logged, never silent: the ops recompute exactly where
a pack overflowed (see :mod:`.ops`).
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
import threading
import itertools
import time
import weakref

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..backends.cuda import abi

log = logging.getLogger("bitsparse_core.torch")

SENTINEL = abi.SLOT_SENTINEL32  # no status word the kernel writes (bits 0-1 only)
SENTINEL64 = abi.SLOT_SENTINEL64  # no count a pack can have
WAIT_TIMEOUT_S = 60.0          # a pack's count that never lands (a stuck stream): recompute
NO_SLOT = -1                   # no slot taken (CUDA graph capture): state unknown
HOST_FINAL = -2                # CPU pack: the block's own status area is final


class FlagSlab:
    """A ring of pinned 16-byte slots {u32 status, u32 pad, u64 nnz}.

    A pack takes the next slot and gets a *ticket*: a CPU int64 tensor
    ``[index, generation]``, kept beside the pack's block (:class:`BlockTickets`). Reading
    a slot with a stale generation (the ring came round; only for a pack thousands of
    packs old) answers "unknown", which every caller treats as "not known to be clean":
    correct, only slower. A slot whose count has not landed yet is skipped when the ring
    comes round.

    Python takes slots ``[0, slots)``; the C++ host path (:mod:`.native`) runs its own
    ring over ``[slots, slots + native_slots)`` of the same slab, with the same rules.
    """

    def __init__(self, slots: int = 1 << 14, native_slots: int = 1 << 14):
        self.slots = slots
        self.total = slots + native_slots
        self._mem = None
        self._next = 0
        self._gen = np.zeros(self.total, dtype=np.int64)
        # where the generations live, for readers outside Python (the C++ host path)
        self.generations = self._gen.ctypes.data
        self._lock = threading.Lock()

    def _arrays(self):
        if self._mem is None:
            # Pinned where CUDA is (the pack kernels write it); plain host
            # memory elsewhere, where only host packs, which never use a slot, exist.
            self._mem = torch.empty(16 * self.total, dtype=torch.uint8, device="cpu",
                                    pin_memory=torch.cuda.is_available())
            raw = self._mem.numpy()
            self.status, self.nnz = raw.view(np.uint32), raw.view(np.uint64)
            self.status[::4] = 0
        return self.status, self.nnz

    def base(self) -> int:
        """Host address of slot 0 (the slab is allocated on first use)."""
        self._arrays()
        return self._mem.data_ptr()

    def acquire(self):
        """``(host address of the slot, ticket)``; the slot reads as pending until
        the caller's pack writes it."""
        address, i, gen = self.acquire_slot()
        return address, self._new_ticket(i, gen)

    def acquire_slot(self):
        """:meth:`acquire` without the ticket tensor: ``(host address, index,
        generation)``, ``(0, NO_SLOT, 0)`` where every slot is in flight."""
        status, nnz = self._arrays()
        with self._lock:
            for _ in range(self.slots):
                i = self._next
                self._next = (i + 1) % self.slots
                if status[4 * i] != SENTINEL:
                    break
            else:
                return 0, NO_SLOT, 0
            self._gen[i] += 1
            status[4 * i] = SENTINEL
            nnz[2 * i + 1] = SENTINEL64
            gen = int(self._gen[i])
        return self._mem.data_ptr() + 16 * i, i, gen

    @staticmethod
    def _new_ticket(i: int, gen: int) -> torch.Tensor:
        """A tensor of its own: contiguous at storage offset 0, the metadata the ops' fake
        kernels give a ticket (opcheck compares them)."""
        return torch.from_numpy(np.array((i, gen), dtype=np.int64))

    def read(self, ticket: torch.Tensor):
        """``(status, nnz)`` of a ticket's pack once its count has landed, else None."""
        return self.read_slot(*ticket.tolist())

    def read_slot(self, i: int, gen: int):
        """:meth:`read` of the ticket ``[i, gen]``."""
        if not 0 <= i < self.total:   # no slot, or one of another slab
            return None
        status, nnz = self._arrays()
        s, n = int(status[4 * i]), int(nnz[2 * i + 1])
        if s == SENTINEL or n == SENTINEL64 or self._gen[i] != gen:
            return None
        return s, n

    def lost(self, ticket: torch.Tensor) -> bool:
        """Whether a ticket's count can never be read: no slot was taken, or the ring came
        round and the slot was taken again."""
        return self.lost_slot(*ticket.tolist())

    def lost_slot(self, i: int, gen: int) -> bool:
        """:meth:`lost` of the ticket ``[i, gen]``."""
        return not 0 <= i < self.total or self._gen[i] != gen

    def wait(self, ticket: torch.Tensor, timeout_s: float = WAIT_TIMEOUT_S):
        """``(status, nnz)`` of a ticket's pack, watching its slot until the count lands (no
        CUDA call: the GPU runs on while the host waits), or None for a ticket with no
        slot, a stale one, or after ``timeout_s``."""
        return self.wait_slot(*ticket.tolist(), timeout_s=timeout_s)

    def wait_slot(self, i: int, gen: int, timeout_s: float = WAIT_TIMEOUT_S):
        """:meth:`wait` of the ticket ``[i, gen]``."""
        if not 0 <= i < self.total:
            return None
        deadline = time.perf_counter() + timeout_s
        while (state := self.read_slot(i, gen)) is None:
            if self._gen[i] != gen or time.perf_counter() > deadline:
                return None
            time.sleep(0)   # let other threads run (the GIL) between looks
        return state


SLAB = FlagSlab()


def fixed_ticket(kind: int) -> torch.Tensor:
    """The ticket of a pack without a slot: ``NO_SLOT`` (its count cannot be read) or
    ``HOST_FINAL`` (a host pack, whose block's status area is final)."""
    return FlagSlab._new_ticket(kind, 0)


class BlockTickets:
    """The ticket of each CUDA block the ops' Python kernels packed, found again from the
    block: the ops carry no ticket output (a CPU output would keep them out of inductor's
    CUDA graphs). Keyed by the block's storage and checked against a weak reference to it,
    which keeps that storage's address from being reused while the entry lives: a copy of
    the block, or a new block at a freed one's address, finds nothing (its count reads
    unknown: waited for or recomputed, never wrong). Entries of freed blocks go in a sweep
    once the table doubles. The C++ host path keeps its own table
    (``kernels/torch_host_slots.h``), which :data:`NATIVE_BLOCK_TICKET` reads."""

    def __init__(self):
        self._entries: dict = {}   # storage's StorageImpl address -> (weak ref, data_ptr, ticket)
        self._sweep_at = 1024
        self._lock = threading.Lock()

    def remember(self, block: torch.Tensor, ticket: torch.Tensor) -> None:
        if ticket.tolist()[0] < 0:
            return
        storage = block.untyped_storage()
        ref = StorageWeakRef(storage)
        with self._lock:
            if len(self._entries) >= self._sweep_at:
                self._entries = {k: e for k, e in self._entries.items() if not e[0].expired()}
                self._sweep_at = max(1024, 2 * len(self._entries))
            self._entries[ref.cdata] = (ref, block.data_ptr(), ticket)

    def ticket(self, block: torch.Tensor) -> torch.Tensor:
        """The block's ticket: this table's, else the C++ path's, else a NO_SLOT one."""
        key = block.untyped_storage()._cdata
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0].expired():
                del self._entries[key]
                entry = None
        if entry is not None and entry[1] == block.data_ptr():
            return entry[2]
        if NATIVE_BLOCK_TICKET is not None:
            i, gen = NATIVE_BLOCK_TICKET(block)
            if i >= 0:
                return FlagSlab._new_ticket(i, gen)
        return fixed_ticket(NO_SLOT)


BLOCK_TICKETS = BlockTickets()
# The C++ host path's lookup of the blocks its forward kernel made (:mod:`.native` sets it):
# ``block -> (slot, generation)``, slot NO_SLOT where it has none.
NATIVE_BLOCK_TICKET = None

# The C++ host path's counters of captured backwards that recomputed (:mod:`.native` sets
# both): ``policy id -> count``, and ``policy id -> None``, which gives a gone policy's
# counter back.
NATIVE_REPLAY_RECOMPUTES = None
NATIVE_DROP_REPLAY_COUNTERS = None


def _drop_replay_counters(policy_id: int) -> None:
    if NATIVE_DROP_REPLAY_COUNTERS is not None:
        NATIVE_DROP_REPLAY_COUNTERS(policy_id)


# The C++ host path's queue of tracked packs (:mod:`.native` sets it): a function that
# returns ``([(policy id, slot, generation, numel, capacity), ...], {policy id: packs})``
# and empties the queue.
NATIVE_TRACKS = None


def drain_native_tracks() -> None:
    """Hand the packs the C++ host path tracked to their policies (a policy does it
    before it polls or reports)."""
    if NATIVE_TRACKS is None:
        return
    records, packs = NATIVE_TRACKS()
    for pid, n in packs.items():
        if (pol := POLICIES.get(pid)) is not None:
            pol.packs += n
    for pid, slot, gen, numel, capacity in records:
        if (pol := POLICIES.get(pid)) is not None:
            pol._pending.append((slot, gen, numel, capacity, None))


def claim_slot():
    """``(slot address, ticket)`` for a CUDA pack's count, taken before the pack is queued;
    ``(0, a NO_SLOT ticket)`` while a graph is captured (its count cannot be read without
    a sync) or when every slot is in flight."""
    address, i, gen = claim_slot_key()
    return address, FlagSlab._new_ticket(i, gen)


def claim_slot_key():
    """:func:`claim_slot` for a caller that keeps no ticket tensor (the saved-tensor
    hooks): ``(slot address, index, generation)``, ``(0, NO_SLOT, 0)`` for none."""
    if torch.cuda.is_current_stream_capturing():
        return 0, NO_SLOT, 0
    return SLAB.acquire_slot()
POLICIES: "weakref.WeakValueDictionary[int, CapacityPolicy]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)

PENDING = ("wait", "recompute")

# Densities a capacity may take: 1/64 times powers of 2^(1/3), up to 1.
LADDER = tuple(min(1.0, 2 ** (k / 3) / 64) for k in range(19))


def bucket_of(density: float) -> int:
    """Index of the smallest ladder density at or above ``density`` (the top one above 1)."""
    if not density <= LADDER[-1]:
        return len(LADDER) - 1
    return bisect.bisect_left(LADDER, density)


# Under torch.compile an adaptive capacity is read from the size of a stand-in tensor
# (CapacityPolicy.traced_capacity), its density in units of 2**-UNIT_LOG2.
UNIT_LOG2 = 20


def _density_units(density: float) -> torch.Tensor:
    """A tensor of ``ceil(density * 2**UNIT_LOG2)`` elements and no storage of its own (a
    one-element tensor expanded), its size marked dynamic for torch.compile. Always on the
    CPU: dynamo guards on its device, and a stand-in made under a ``torch.device``
    context (a model built on the GPU) would differ from its successors."""
    units = torch.empty(1, device="cpu").expand(math.ceil(density * (1 << UNIT_LOG2)))
    torch._dynamo.maybe_mark_dynamic(units, 0)
    return units


def sized_bucket(densest: float, margin: float) -> int:
    """The bucket a capacity is sized to from the densest recent count: the smallest
    ladder density at or above it plus ``margin`` (the policy's and the save sites' rule)."""
    return bucket_of(densest * (1 + margin))


class CapacityPolicy:
    """Capacity of one call site's packs, adapted from the densities it saw.

    ``density``: a fixed bound (the capacity is ``ceil(density * numel)``), or None
    to adapt: the first packs use the full capacity (they cannot overflow) while
    their counts come back; later ones the smallest ladder density at or above
    ``(1 + margin)`` times the largest density of the last ``window`` packs.
    ``initial_density`` (adaptive only): what the first packs use instead of the full
    capacity, rounded up the ladder. The first steps then hold less (their blocks set a
    run's peak, since a trained model's activations are far sparser than full), and a pack
    it overflows is recomputed exactly like any other.
    Under ``torch.compile`` the capacity is :meth:`traced_capacity`, a symbolic size the
    graph takes as an input, so a move of the bucket reuses the compiled graph instead
    of recompiling (one recompile per bucket and layer, with torch.compile's limit of a
    few recompiles per frame, would leave a model that trains long enough running
    eager). The bucket moves only in :meth:`poll`, which the backward calls: a forward
    and its recompute under activation checkpointing always see the same capacity.

    ``pending``: what a backward does when its pack's count has not come back yet,
    which happens when the host runs ahead of the GPU (a GPU-bound step): ``"wait"``
    watches the pinned slot until it lands (the GPU is then still busy with the work
    queued after that pack, so it does not idle; no CUDA call is made); ``"recompute"``
    recomputes the activation from the FFN input at once (never waits, costs the
    first GEMM again). Inside a CUDA graph capture the count cannot be known, and
    both recompute.

    :meth:`freeze` stops an adaptive policy at its current bucket: from then on its
    capacity is a fixed density, a constant under ``torch.compile``. The graph then has no
    capacity symbol, so each call skips the symbol's guards and size reads (a host-paced
    compiled step's cost; ``bench/NOTES.md``, session 55), at the price of one recompile
    and of no longer following the densities (a later denser batch overflows and is
    recomputed, exactly, and counted). :meth:`thaw` adapts again.

    A CUDA graph replays the capacity its capture found, and the host sees none of its
    packs, so the densities stop coming back. :meth:`adapt_to_replays` takes in the
    replays whose captured backward recomputed (the device counts them) and moves an
    adaptive bucket up a step for the next capture; that step is a floor under the
    bucket from then on.
    """

    def __init__(self, density: float | None = None, margin: float = 0.1, window: int = 64,
                 pending: str = "wait", initial_density: float | None = None):
        if density is not None and not 0.0 <= float(density) <= 1.0:
            raise ValueError(f"density={density!r} must lie in [0, 1]")
        if initial_density is not None:
            if density is not None:
                raise ValueError("initial_density applies to an adaptive capacity "
                                 f"(density=None), not to density={density!r}")
            if not 0.0 < float(initial_density) <= 1.0:
                raise ValueError(f"initial_density={initial_density!r} must lie in (0, 1]")
        if margin < 0:
            raise ValueError(f"margin={margin!r} must be >= 0")
        if pending not in PENDING:
            raise ValueError(f"pending={pending!r}; use one of {', '.join(PENDING)}")
        self._register()
        self.pending = pending
        self.density = None if density is None else float(density)
        self.frozen = False
        self.margin = float(margin)
        self.bucket = (len(LADDER) - 1 if initial_density is None
                       else bucket_of(float(initial_density)))
        self.floor = 0                  # the lowest bucket: raised by adapt_to_replays
        self._recent = collections.deque(maxlen=window)
        self._pending = collections.deque(maxlen=4 * window)
        # recomputes: backwards that recomputed, for an overflow or because the count
        # had not come back yet (``unknown``, the host running ahead of the GPU)
        self.packs = self.overflows = self.recomputes = self.unknown = self.waits = 0
        # replays of captured backwards (CUDA graphs) that recomputed: the device counts them
        self.replay_recomputes = 0
        self._replays_adapted = 0      # of those, the ones adapt_to_replays has taken in
        self.wait_s = 0.0
        self.max_density = 0.0

    def __getstate__(self) -> dict:
        # The counts on their way back are this process's slab slots: a copy (deepcopy,
        # torch.save of a model) starts without them.
        state = dict(self.__dict__)
        state["_pending"] = collections.deque(maxlen=self._pending.maxlen)
        state.pop("_units")         # made anew from the bucket, its dynamic mark with it
        return state

    def __setstate__(self, state: dict) -> None:
        bucket = state.pop("_bucket", None)
        bucket = state.pop("bucket", len(LADDER) - 1) if bucket is None else bucket
        # A copy gets its own id: the ops find their policy by id, and an id taken over
        # from the original would feed the copy's packs to the original (or, loaded in
        # another process, to whichever policy has that number there).
        state.setdefault("frozen", False)   # pickled before freeze() existed
        state.setdefault("replay_recomputes", 0)
        state.setdefault("_replays_adapted", state["replay_recomputes"])
        state.setdefault("floor", 0)
        self.__dict__.update(state)
        self.bucket = bucket
        self._register()

    def _register(self) -> None:
        """A new id, under which the ops find this policy; its replay counter goes with it."""
        self.id = next(_IDS)
        POLICIES[self.id] = self
        weakref.finalize(self, _drop_replay_counters, self.id)

    @property
    def bucket(self) -> int:
        return self._bucket

    @bucket.setter
    def bucket(self, bucket: int) -> None:
        if bucket != getattr(self, "_bucket", None):
            self._bucket = bucket
            self._units = _density_units(LADDER[bucket])

    def freeze(self) -> None:
        """Hold an adaptive capacity where it is: take in the counts that have landed, then
        keep the bucket's density as a fixed one (see the class docstring). A no-op for a
        policy given a ``density`` or already frozen."""
        if self.density is None:
            self.poll()
            self.density, self.frozen = LADDER[self.bucket], True

    def thaw(self) -> None:
        """Adapt again after :meth:`freeze`, from the bucket it held."""
        if self.frozen:
            self.density, self.frozen = None, False

    def capacity(self, numel: int) -> int:
        d = self.density if self.density is not None else LADDER[self.bucket]
        return min(numel, math.ceil(d * numel))

    def traced_capacity(self, numel):
        """The capacity inside a trace (torch.compile, torch.func): an adaptive policy's is
        ``ceil(units * numel / 2**UNIT_LOG2)`` with ``units`` the size of a stand-in tensor
        whose size is dynamic, so the graph takes the capacity as an input (at least
        :meth:`capacity`'s, at most ``numel``); a fixed density's is a constant."""
        if self.density is not None:
            return self.capacity(numel)
        return (self._units.shape[0] * numel + (1 << UNIT_LOG2) - 1) // (1 << UNIT_LOG2)

    def track(self, ticket: torch.Tensor, numel: int, capacity: int, known=None) -> None:
        """Remember a pack whose count is on its way back (called at pack time);
        ``known``: its ``(status, nnz)`` where the pack ran on the host."""
        self.packs += 1
        slot, gen = ticket.tolist()
        if known is not None or slot >= 0:
            self._pending.append((slot, gen, numel, capacity, known))

    def poll(self) -> None:
        """Take in every count that has landed (no CUDA call) and re-pick the bucket."""
        drain_native_tracks()
        while self._pending:
            slot, gen, numel, capacity, known = self._pending[0]
            state = known or SLAB.read_slot(slot, gen)
            if state is None:
                if known is None and SLAB.lost_slot(slot, gen):   # its slot was taken again
                    self._pending.popleft()
                    continue
                break
            self._pending.popleft()
            self._observe(state[1], numel, capacity)
        if self.density is None and self._recent:
            self.bucket = max(sized_bucket(max(self._recent), self.margin), self.floor)

    def wait(self, ticket: torch.Tensor):
        """The pack's ``(status, nnz)``, waiting for it under ``pending="wait"`` (None
        under "recompute", in a graph capture, or past the timeout)."""
        if self.pending != "wait" or torch.cuda.is_current_stream_capturing():
            return None
        t0 = time.perf_counter()
        state = SLAB.wait(ticket)
        self.waits += 1
        self.wait_s += time.perf_counter() - t0
        return state

    def adapt_to_replays(self) -> bool:
        """Take in the replays of captured backwards that recomputed since the last call (no
        CUDA call). Where there are any, the capacity the capture found was too small: an
        adaptive policy moves its bucket one step up and keeps it at least there. A graph
        captured from then on packs at the larger capacity: under ``torch.compile(mode=
        "reduce-overhead")`` the next call records one (the capacity is an input of the
        graph); a ``torch.cuda.graph`` of the user's must be captured again. True where
        the bucket moved."""
        self._take_replay_recomputes()
        new = self.replay_recomputes - self._replays_adapted
        self._replays_adapted = self.replay_recomputes
        if new <= 0 or self.density is not None or self.bucket >= len(LADDER) - 1:
            return False
        self.floor = self.bucket + 1
        self.bucket = self.floor
        log.warning("bitsparse: captured backwards recomputed in %d replays; the next capture "
                    "packs at density %.4f", new, LADDER[self.bucket])
        return True

    def _take_replay_recomputes(self) -> None:
        if NATIVE_REPLAY_RECOMPUTES is None:
            return
        count = NATIVE_REPLAY_RECOMPUTES(self.id)
        if count > self.replay_recomputes:
            log.warning("bitsparse: %d replays of captured backwards recomputed their "
                        "activation exactly (their packs overflowed the capacity the capture "
                        "found)", count - self.replay_recomputes)
            self.replay_recomputes = count

    def _observe(self, nnz: int, numel: int, capacity: int) -> None:
        d = nnz / numel if numel else 0.0
        self._recent.append(d)
        self.max_density = max(self.max_density, d)
        if nnz > capacity:
            self.overflows += 1
            log.warning("bitsparse: %d nonzeros overflowed a capacity of %d (density %.4f); "
                        "that layer's backward recomputes its activation exactly", nnz,
                        capacity, d)

    def stats(self) -> dict:
        """The policy's counters. ``replay_recomputes``: replays of CUDA graphs whose captured
        backward found its pack overflowed and recomputed, counted by the device into pinned
        host memory (those the device has run so far; no wait)."""
        drain_native_tracks()
        self._take_replay_recomputes()
        return {"packs": self.packs, "overflows": self.overflows, "recomputes": self.recomputes,
                "replay_recomputes": self.replay_recomputes,
                "unknown": self.unknown, "waits": self.waits, "wait_s": self.wait_s,
                "max_density": self.max_density, "frozen": self.frozen,
                "capacity_density": self.density if self.density is not None
                else LADDER[self.bucket]}


def capacity_policies(model: torch.nn.Module) -> list:
    """The capacity policies of ``model``'s packed modules, each once, those it holds as
    plain attributes included (a converted model's packed FFNs are not registered
    submodules): their ``stats()`` are the model's overflows, recomputes and waits."""
    found = {}
    for m in model.modules():
        for owner in (m, *(v for v in vars(m).values() if isinstance(v, torch.nn.Module))):
            pol = getattr(owner, "capacity_policy", None)
            if isinstance(pol, CapacityPolicy):
                found[id(pol)] = pol
    return list(found.values())


def freeze_capacity(model: torch.nn.Module) -> int:
    """:meth:`CapacityPolicy.freeze` the policy of every packed module in ``model``; the
    number of adaptive policies it froze. Call it once the densities have settled (after
    a few hundred steps, say): a compiled model recompiles once, then runs without the
    capacity symbols."""
    policies = [p for p in capacity_policies(model) if p.density is None]
    for p in policies:
        p.freeze()
    return len(policies)


def adapt_to_replays(model: torch.nn.Module) -> int:
    """:meth:`CapacityPolicy.adapt_to_replays` for every packed module in ``model``: the
    number of policies whose capacity moved up. Under ``torch.compile(mode=
    "reduce-overhead")`` call it now and then (every few hundred steps, say, or where the
    logs show replays recomputing): the graphs replay the capacities of their recording,
    and this is how they follow densities that grow. After a ``torch.cuda.graph`` capture
    of the user's, a nonzero answer says: capture again."""
    return sum(p.adapt_to_replays() for p in capacity_policies(model))


def thaw_capacity(model: torch.nn.Module) -> int:
    """:meth:`CapacityPolicy.thaw` every frozen policy in ``model``; the number thawed."""
    policies = [p for p in capacity_policies(model) if p.frozen]
    for p in policies:
        p.thaw()
    return len(policies)
