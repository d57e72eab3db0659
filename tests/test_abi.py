"""The kernel ABI (bitsparse_core/backends/cuda/abi.py) against the CUDA sources: the
generated header is the one checked in, and every argument record matches its
kernel's parameter list field for field (name order and width)."""

from __future__ import annotations

import ctypes
import re

import pytest

from bitsparse_core.backends.cuda import abi
from bitsparse_core.backends.cuda.sources import kernel_dir, read_source

RECORDS = {
    ("bitsparse_pack.cu", "bitsparse_pack"): abi.PackArgs,
    ("bitsparse_unpack.cu", "bitsparse_unpack"): abi.UnpackArgs,
    ("bitsparse_unpack.cu", "bitsparse_mask_select"): abi.MaskSelectArgs,
    ("bitsparse_unpack.cu", "bitsparse_tile_counts"): abi.TileCountsArgs,
}
_WIDTH = {"u64": ctypes.c_uint64, "int": ctypes.c_int32}


def _params(source: str, kernel: str) -> list:
    """``[(type, name), ...]`` of a ``__global__`` kernel's parameter list."""
    m = re.search(r"\b" + kernel + r"\s*\(([^)]*)\)\s*\{", source)
    assert m, f"{kernel} not found"
    params = []
    for p in m.group(1).split(","):
        typ, name = p.split()
        params.append((typ, name))
    return params


def test_header_file_is_the_generated_one():
    assert (kernel_dir() / "bitsparse_abi.h").read_text() == abi.header()


@pytest.mark.parametrize("where", sorted(RECORDS), ids=lambda w: w[1])
def test_record_matches_kernel_signature(where):
    file, kernel = where
    params = _params(read_source(file), kernel)
    fields = RECORDS[where]._fields_
    assert len(fields) == len(params)
    for (fname, ftype), (ptype, pname) in zip(fields, params):
        assert ftype is _WIDTH[ptype], (fname, pname, ptype)
        # names agree up to the kernels' _ptr suffixes and a few spelled-out ones
        base = pname.removesuffix("_ptr")
        assert fname == base or {fname, base} in ({"width", "w"},), (fname, pname)


def test_warp_tile_prototype_takes_the_pack_record():
    """bench/pack_warp_proto.py launches the prototype with abi.PackArgs."""
    from pathlib import Path
    proto = Path(__file__).resolve().parents[1] / "bench" / "proto" / "pack_warp.cu"
    assert (_params(proto.read_text(), "bitsparse_pack_warp")
            == _params(read_source("bitsparse_pack.cu"), "bitsparse_pack"))


def test_record_pointers_follow_the_fields():
    r = abi.UnpackArgs()
    r.out = 0x1234
    out_index = [n for n, _ in r._fields_].index("out")
    assert ctypes.c_uint64.from_address(r.pointers[out_index]).value == 0x1234


def test_pack_scratch_holds_the_kernels_layout_in_whole_16_byte_rows():
    """bitsparse_pack.cu's scratch: ticket and barrier count, a count descriptor per tile
    (an even count), a 16-byte edge record per tile (bs_edges), a group descriptor per 32
    tiles after them (bs_group_desc). Its size is a multiple of 16: the JAX FFI lays one
    per block back to back, and the next block's edge records must stay aligned."""
    src = read_source("bitsparse_pack.cu")
    assert "scratch_ptr + 16 + 8 * ((n_tiles + 1) & ~1ull) + 16 * n_tiles" in src
    assert "#define BS_GROUP_LOG2 5" in src
    for n in [*range(1, 200), 4095, 4096, 4097, 14336, 1 << 20]:
        end = 16 + 8 * (n + n % 2) + 16 * n + 8 * -(-n // 32)
        size = abi.pack_scratch_bytes(n)
        assert size % 16 == 0 and end <= size < end + 16, n


@pytest.mark.parametrize("mode", list(abi.Mode))
@pytest.mark.parametrize("encoding", ["raw", "nosign", "signplane"])
def test_exact_tail_is_the_tail_of_the_plan_at_the_count(mode, encoding):
    """What tail_shrink works out by arithmetic is what the plan at the count says: the
    tail's size and where its values and signs lie; and that plan keeps the mask, the
    offsets and the status area (the value span's start) where the worst case has them,
    so an exact pack's head needs no plan of its own."""
    import numpy as np

    from bitsparse_core import dtypes as D
    from bitsparse_core.backends.cuda import host
    from bitsparse_core.spec.format import Encoding
    enc = Encoding.parse(encoding)
    rng = np.random.default_rng(int(mode) * 7 + int(enc))
    for dt in (D.BFLOAT16, D.FLOAT32, D.FLOAT8_E4M3FN):
        for shape in [(1,), (3, 333), (8192, 17)]:
            numel = int(np.prod(shape))
            big = host.pack_plan(shape, dt, enc, numel, 12, mode)
            for cap in {0, numel, *rng.integers(0, numel + 1, size=4).tolist()}:
                small = host.pack_plan(shape, dt, enc, cap, 12, mode)
                exact = host.tail_shrink(big, cap)
                assert (exact.nbytes, exact.values_len, exact.signs_offset,
                        exact.signs_len) == (small.tail_bytes, small.spans[2][1],
                                             small.tail_signs_offset, small.spans[3][1])
                assert small.spans[:2] == big.spans[:2] and small.head_bytes == big.head_bytes
                assert small.spans[2][0] == big.spans[2][0]
    with pytest.raises(ValueError, match="outside the plan's capacity"):
        host.tail_shrink(host.pack_plan((64,), D.BFLOAT16, enc, 8, 12, mode), 9)


@pytest.mark.parametrize("encoding", ["raw", "nosign", "signplane"])
def test_split_exact_pack_and_its_tail_shrink(encoding):
    """An exact pack's two allocations (CuPy backend): the head holds the mask and offsets
    where the block has them and the status area where the block's values start; the
    tail holds the values at 0 and the signs after them, and its shrink moves the stored
    values and signs, each from where the worst-case tail holds them."""
    import numpy as np

    from bitsparse_core import dtypes as D
    from bitsparse_core.backends.cuda import host
    from bitsparse_core.spec.format import Encoding
    enc = Encoding.parse(encoding)
    rng = np.random.default_rng(int(enc))
    for dt in (D.BFLOAT16, D.FLOAT32, D.FLOAT8_E4M3FN):
        for shape in [(1,), (3, 333), (8192, 17)]:
            numel = int(np.prod(shape))
            big = host.pack_plan(shape, dt, enc, numel, 12)
            assert big.head_bytes == big.spans[2][0] + abi.STATUS_BYTES
            assert big.tail_signs_offset % 64 == 0 and big.tail_signs_offset >= big.spans[2][1]
            assert big.tail_bytes >= big.tail_signs_offset + big.spans[3][1]
            for cap in {0, numel, *rng.integers(0, numel + 1, size=4).tolist()}:
                small = host.pack_plan(shape, dt, enc, cap, 12)
                exact = host.tail_shrink(big, cap)
                nbytes, copies = exact.nbytes, exact.copies
                src = rng.integers(0, 256, big.tail_bytes, dtype=np.uint8)
                dst = np.zeros(nbytes, dtype=np.uint8)
                for d, s, n in copies:
                    assert d + n <= nbytes and s + n <= big.tail_bytes
                    dst[d:d + n] = src[s:s + n]
                vl, sl = small.spans[2][1], small.spans[3][1]
                assert np.array_equal(dst[:vl], src[:vl])
                so, bso = small.tail_signs_offset, big.tail_signs_offset
                assert np.array_equal(dst[so:so + sl], src[bso:bso + sl])


def test_exact_pack_builds_no_plan_after_its_count(monkeypatch):
    """After the count the GPU waits for the host until the shrink's copies are queued,
    and idles while the host builds the result: the protocol hands the count to the
    shrink, then the shrunk block and the worst-case plan to ``packed``, and lays out
    no plan (no size formula) in between."""
    from bitsparse_core import dtypes as D
    from bitsparse_core.backends.cuda import host, protocol
    from bitsparse_core.spec.format import Encoding
    events = []
    tail_at_count = host.pack_plan((1000,), D.BFLOAT16, Encoding.NOSIGN, 123, 12).tail_bytes

    class Steps:
        def run(self, plan, fixed, count):
            events.append(("run", fixed, count))
            monkeypatch.setattr(protocol, "pack_plan", lambda *a: events.append(("plan",)))
            monkeypatch.setattr(host._fmt, "cached_layout", lambda *a: events.append(("layout",)))
            return "worst-case block"

        def read_head(self, plan, block):
            return 0, 123

        def shrink(self, plan, block, nnz):
            events.append(("shrink", nnz, host.tail_shrink(plan, nnz).nbytes))
            return "exact block"

        def packed(self, plan, block, nnz, pending_status):
            events.append(("packed", plan.lay.capacity, block, nnz))
            return plan

    plan = protocol.pack(Steps(), (1000,), D.BFLOAT16, "nosign", 12, None)
    assert [e[0] for e in events] == ["run", "shrink", "packed"]
    assert events[0] == ("run", False, True)
    assert events[1] == ("shrink", 123, tail_at_count)
    assert events[2] == ("packed", 1000, "exact block", 123)


class _FakeStream:
    """The driver calls slots.wait makes, for a stream whose kernel writes the slot (or
    not) when asked."""

    def __init__(self, monkeypatch, write_after=None, value=(0, 7)):
        import ctypes

        from bitsparse_core.backends.cuda import driver, slots
        self.pages, self.queries, self.syncs = [], 0, 0
        self.write_after, self.value, self.slot = write_after, value, None

        def alloc_host(n):
            buf = ctypes.create_string_buffer(n)
            self.pages.append(buf)
            return ctypes.addressof(buf)

        def stream_done(stream):
            self.queries += 1
            if self.write_after is not None and self.queries >= self.write_after:
                slots.write(self.slot, *self.value)
                return True
            return False

        def sync_stream(stream):
            self.syncs += 1
            if self.write_after is not None:
                slots.write(self.slot, *self.value)

        monkeypatch.setattr(driver, "alloc_host", alloc_host)
        monkeypatch.setattr(driver, "stream_done", stream_done)
        monkeypatch.setattr(driver, "sync_stream", sync_stream)
        monkeypatch.setattr(slots, "_local", __import__("threading").local())


def test_slot_wait_sees_the_kernels_count_and_reuses_the_slot(monkeypatch):
    from bitsparse_core.backends.cuda import slots
    fake = _FakeStream(monkeypatch, write_after=3, value=(2, 12345))
    fake.slot = first = slots.take()
    assert slots.wait(first, 0) == (2, 12345) and fake.queries == 3
    assert slots.take() == first                   # given back once its count came


def test_slot_wait_blocks_on_the_stream_after_spinning(monkeypatch):
    from bitsparse_core.backends.cuda import slots
    fake = _FakeStream(monkeypatch, write_after=10 ** 9, value=(0, 9))   # no query sees it
    monkeypatch.setattr(slots, "_SPIN_S", 0.0)
    fake.slot = slots.take()
    assert slots.wait(fake.slot, 0) == (0, 9) and fake.syncs == 1


def test_slot_never_written_raises_and_is_not_reused(monkeypatch):
    from bitsparse_core.backends.cuda import slots
    from bitsparse_core.errors import CudaDriverError
    fake = _FakeStream(monkeypatch)
    monkeypatch.setattr(slots.driver, "stream_done", lambda stream: True)
    fake.slot = slot = slots.take()
    with pytest.raises(CudaDriverError, match="without writing its count"):
        slots.wait(slot, 0)
    assert slots.take() != slot                    # its kernel may still write it
