"""Save sites: what :class:`.hooks.compress_saved_tensors` learns about each place in
the forward that saves a tensor, so later steps pack without waiting for the GPU.

A site is one position in the forward, keyed by the ordinal of the save since the
hooks were entered, its shape and its dtype: the same layer saves the same kind of
tensor there step after step. The first pack at a site uses the largest capacity
still worth packing (``1 - min_sparsity`` of the elements); the counts that come back
asynchronously then size the next packs to the smallest ladder bucket above the
densest recent one, with a margin (so the caching allocator sees a few block sizes,
not one per step). A site whose tensors came back too dense passes through for a
while, then is tried again, waiting twice as long after each try that is still too
dense (up to ``MAX_BACKOFF`` times): a dense layer costs a wasted pack rarely, not
every ``RETRY_AFTER`` saves. One whose values have their sign bit set stops using
``nosign``. One whose pack was still on its way when backward unpacked it (the GPU
lagging the host by more than the rest of the forward) passes through for
``RETRY_AFTER`` saves: such a pack saves nothing and holds its block on top of the
dense tensor until then.
"""

from __future__ import annotations

import collections
import math

from ..backends.cuda import abi
from ..spec.format import Encoding
from .capacity import LADDER, sized_bucket

WINDOW = 8          # counts a site sizes its packs from
RETRY_AFTER = 32    # saves a too-dense site passes through before it is tried again
MAX_BACKOFF = 32    # ... times 2 ** (tries in a row still too dense), up to this factor
MAX_SITES = 4096    # sites remembered (the oldest forgotten: a forward that never repeats)

# The encoding a site falls back to after a nosign violation, per requested encoding.
FALLBACK = {"auto": Encoding.RAW, "nosign": Encoding.SIGNPLANE}


class SaveSite:
    """One save site: its encoding, recent densities, pass-through countdown and the
    factor of the next one."""

    __slots__ = ("encoding", "fallback", "recent", "skip", "backoff", "prepared", "version",
                 "asked")

    def __init__(self, encoding: str):
        self.fallback = FALLBACK.get(encoding)
        self.encoding = Encoding.NOSIGN if self.fallback is not None else Encoding.parse(encoding)
        self.recent = collections.deque(maxlen=WINDOW)
        self.skip = 0
        self.backoff = 1
        self.prepared = None   # the hooks' plan and handle for the last capacity used here
        # Bumped by every change of what capacity() answers or of the encoding (the C++
        # front packs at a site whose version it was told, without asking Python, until
        # the version moves); ``asked``: capacity()'s last question and its answer.
        self.version = 0
        self.asked = None

    def capacity(self, numel: int, limit: float, margin: float) -> int | None:
        """The capacity of the next pack here, or None to pass this save through.
        ``limit``: the largest density worth packing."""
        if self.skip:
            self.skip -= 1
            self.version += 1
            return None
        cap = self._sized(numel, limit, margin)
        if cap is None:                     # the recent counts were too dense
            self.skip = RETRY_AFTER * self.backoff - 1   # this save is the first passed through
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
            self.recent.clear()             # then tried again from the largest capacity
            self.version += 1
            return None
        if self.recent:                     # sized from a clean count: no longer backing off
            self.backoff = 1
        self.asked = (numel, limit, margin, cap)
        return cap

    def _sized(self, numel: int, limit: float, margin: float) -> int | None:
        """The capacity the recent counts give (None: too dense to pack)."""
        top = math.ceil(limit * numel)
        if not self.recent:
            return min(numel, top)
        seen = max(self.recent)
        if seen > limit:
            return None
        return min(numel, top, math.ceil(LADDER[sized_bucket(seen, margin)] * numel))

    def late(self) -> None:
        """A pack here had not come back when backward unpacked it: pass the next saves
        through (its count still teaches the site when it lands)."""
        self.skip = max(self.skip, RETRY_AFTER)
        self.version += 1

    def observe(self, status: int, nnz: int, numel: int) -> None:
        """Take in a pack's count (overflowed or not: the kernel counts every nonzero)."""
        self.recent.append(nnz / numel if numel else 0.0)
        if (status & abi.STATUS_NOSIGN_VIOLATION and self.fallback is not None
                and self.encoding != self.fallback):
            self.encoding = self.fallback
            self.version += 1
        if (self.backoff != 1                # the next capacity() resets it
                or (self.asked is not None and self._sized(*self.asked[:3]) != self.asked[3])):
            self.version += 1               # ... or answers otherwise


class Sites:
    """The sites of one hooks object, by key; the oldest forgotten past ``MAX_SITES``."""

    def __init__(self, encoding: str):
        self.encoding = encoding
        self._by_key: dict = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key) -> SaveSite:
        site = self._by_key.get(key)
        if site is None:
            if len(self._by_key) >= MAX_SITES:
                self._by_key.pop(next(iter(self._by_key))).version += 1   # forgotten
            site = self._by_key[key] = SaveSite(self.encoding)
        return site
