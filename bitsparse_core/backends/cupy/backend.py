"""The CuPy backend: format v1 on CUDA through RawModule kernels (kernels/*.cu).

Kernels are templates over the element format, the encoding and the fused
operation, compiled on first use for the device's own architecture (CuPy
builds a cubin for the current device) and cached per device. See
:mod:`bitsparse_core.cuda_interop` for the stream, input, allocation and
output contract, and kernels/bitsparse_pack.cu / bitsparse_unpack.cu for the
algorithms.

Packing is one persistent kernel (a cooperative launch, through the driver
API, of as many blocks as fit on the device, taking tiles from a counter) plus
a small kernel that writes the stream words shared by two tiles. Exact packing
(``capacity=None``) runs them into a worst-case scratch layout, syncs once to
read nnz (and the nosign status), then copies the sections into an allocation
of the exact size. Fixed capacity does not sync: overflow and nosign
violations stay on the device (``offsets[-1]`` and ``PackedTensor.status``)
until :meth:`PackedTensor.check`.

``BITSPARSE_CUDA_OPTIONS`` (environment) adds NVRTC options to every kernel
compile, e.g. ``-D`` switches when timing kernel variants (bench/kernel_variants.py).
"""

from __future__ import annotations

import os
import threading

import numpy as np

from ... import dtypes as _dt
from ...errors import CudaDriverError, EncodingError, OutputMismatchError
from ...packed import PackedTensor
from ...spec import format as _fmt
from ..cuda import interop as ci
from ..cuda.sources import read_source

Encoding = _fmt.Encoding

_FMT = {"bfloat16": 0, "float16": 1, "float32": 2, "float8_e4m3fn": 3, "float8_e5m2": 4}
# Plain pack / masked pack / unpack only move bits: one instantiation per width.
_BITS_FMT = {8: 3, 16: 0, 32: 2}
MODE_PACK, MODE_RELU, MODE_RELU2, MODE_MASKED = 0, 1, 2, 3
OP_UNPACK, OP_RELU2, OP_GATED, OP_GATED_DENSE = 0, 1, 2, 3
THREADS = 256
_U64, _I32 = np.uint64, np.int32
# Rounds per warp, i.e. the tile size (8 warps x R x 32 lanes x 16 bytes) of
# each kernel family (bench/NOTES.md). Unpack tiles are whole chunks at the
# default chunk size (4096 elements), so a tile's value range comes straight
# from the offsets table; the fused ops stay at 2.
ROUNDS = {"pack": 4, "unpack": 4, "fused": 2}


def unpack_rounds(dtype: _dt.DType, op: int) -> int:
    """Rounds of an unpack-family kernel. fp32 (4 elements per vector) doubles them so
    that its tiles hold as many elements as 16-bit ones: whole default-size chunks."""
    r = ROUNDS["unpack"] if op == OP_UNPACK else ROUNDS["fused"]
    return 2 * r if dtype.bits == 32 else r


def tile_elems(dtype: _dt.DType, rounds: int) -> int:
    """Elements per block: 8 warps x R rounds x 32 lanes x one 16-byte vector."""
    return 8 * rounds * 32 * (16 // dtype.itemsize)


def stream_width(dtype: _dt.DType, enc: Encoding) -> int:
    return dtype.bits if enc == Encoding.RAW else dtype.bits - 1


# --------------------------------------------------------------------------- #
# Kernel cache                                                                #
# --------------------------------------------------------------------------- #
_KERNELS: dict = {}
_LOCK = threading.Lock()


def _source(file: str) -> str:
    common = read_source("bitsparse_common.cuh").replace("#pragma once", "")
    return common + "\n" + read_source(file)


def kernel_spec(kind: str, *args) -> tuple:
    """(file, name) of a kernel; ``name`` is a name expression for templates."""
    if kind == "pack":
        return "bitsparse_pack.cu", "bitsparse_pack<%d,%d,%d,%d>" % args
    if kind == "unpack":
        return "bitsparse_unpack.cu", "bitsparse_unpack<%d,%d,%d,%d,%d>" % args
    if kind == "mask_select":
        return "bitsparse_unpack.cu", "bitsparse_mask_select<%d>" % args
    if kind == "tile_counts":
        return "bitsparse_unpack.cu", "bitsparse_tile_counts<%d,%d>" % args
    if kind == "zero_tail":
        return "bitsparse_pack.cu", "bitsparse_zero_tail"
    if kind == "stitch":
        return "bitsparse_pack.cu", "bitsparse_stitch"
    raise KeyError(kind)


def get_kernel(device: int, kind: str, *args):
    """The compiled kernel, built for ``device``'s architecture once per device."""
    import cupy
    key = (device, kind) + tuple(args)
    k = _KERNELS.get(key)
    if k is not None:
        return k
    with _LOCK:
        k = _KERNELS.get(key)
        if k is None:
            file, name = kernel_spec(kind, *args)
            templated = "<" in name
            with cupy.cuda.Device(device):
                extra = tuple(os.environ.get("BITSPARSE_CUDA_OPTIONS", "").split())
                mod = cupy.RawModule(code=_source(file), options=("-std=c++17",) + extra,
                                     name_expressions=(name,) if templated else None)
                k = mod.get_function(name)
            _KERNELS[key] = k
    return k


def all_kernel_keys(sweep_rounds=()) -> list:
    """Every kernel the backend can launch (for warming the compile cache),
    plus plain pack / unpack of bf16 and fp8 at ``sweep_rounds`` (the bench)."""
    keys = []
    rp, rf = ROUNDS["pack"], ROUNDS["fused"]
    encs = range(3)
    for name, fmt in _FMT.items():
        dt = _dt.resolve(name)
        ru = unpack_rounds(dt, OP_RELU2)
        for enc in encs:
            for mode in (MODE_RELU, MODE_RELU2):
                keys.append(("pack", fmt, enc, mode, rf))
            keys.append(("unpack", fmt, OP_RELU2, ru, enc, 0))
            keys.append(("unpack", fmt, OP_GATED_DENSE, ru, enc, 0))
            for uenc in encs:
                keys.append(("unpack", fmt, OP_GATED, ru, enc, uenc))
    for bits, fmt in sorted(_BITS_FMT.items()):
        dt = _dt.resolve({8: "float8_e4m3fn", 16: "bfloat16", 32: "float32"}[bits])
        ru = unpack_rounds(dt, OP_UNPACK)
        for enc in encs:
            keys.append(("pack", fmt, enc, MODE_PACK, rp))
            keys.append(("pack", fmt, enc, MODE_MASKED, rp))
            keys.append(("unpack", fmt, OP_UNPACK, ru, enc, 0))
        keys += [("mask_select", fmt), ("tile_counts", fmt, ru),
                 ("tile_counts", fmt, unpack_rounds(dt, OP_RELU2))]
    for r in sweep_rounds:
        for fmt in (0, 3):
            keys += [("pack", fmt, int(Encoding.NOSIGN), MODE_PACK, r),
                     ("unpack", fmt, OP_UNPACK, r, int(Encoding.NOSIGN), 0)]
    keys += [("zero_tail",), ("stitch",)]
    return list(dict.fromkeys(keys))


def _warm_worker(keys):
    import cupy
    for key in keys:
        get_kernel(cupy.cuda.runtime.getDevice(), *key)
    return len(keys)


def warm_cache(processes: int = 8, keys=None, sweep_rounds=()) -> int:
    """Compile kernels in parallel processes so that CuPy's on-disk cache holds
    them; later processes (and this one) then only load cubins."""
    import multiprocessing as mp
    keys = list(keys or all_kernel_keys(sweep_rounds))
    processes = max(1, min(processes, len(keys)))
    parts = [keys[i::processes] for i in range(processes)]
    with mp.get_context("spawn").Pool(processes) as pool:
        return sum(pool.map(_warm_worker, parts))


def _launch(kernel, grid: int, args, stream: int, device: int) -> None:
    import cupy
    if grid <= 0:
        return
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream, device):
        kernel((int(grid),), (THREADS,), args)


_COOP_GRID: dict = {}
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _driver():
    import ctypes
    lib = getattr(_driver, "lib", None)
    if lib is None:
        lib = _driver.lib = ctypes.CDLL("libcuda.so.1")
    return lib


def _check_driver(rc: int, what: str) -> None:
    if rc:
        raise CudaDriverError(f"{what} failed with CUresult {rc}")


def pack_smem_bytes(dtype: _dt.DType, encoding: int, rounds: int) -> int:
    """Dynamic shared memory of a pack kernel: two BsPackBuf (bitsparse_pack.cu)."""
    bits = 8 * dtype.itemsize
    tile = tile_elems(dtype, rounds)
    w = bits if encoding == Encoding.RAW else bits - 1
    words = (tile * bits // 32 + 4                                           # stage
             + (1 if encoding == Encoding.RAW else tile * w // 32 + 4)      # a
             + (tile // 32 + 4 if encoding == Encoding.SIGNPLANE else 1)    # signs
             + 2 + 8 * rounds)                                             # n, neg, rel
    return 2 * (-(-4 * words // 16) * 16)


def _resident_grid(kernel, smem: int, device: int) -> int:
    """How many blocks of ``kernel`` fit on ``device`` at once (the grid of a
    persistent kernel), asked of the driver once per kernel and device, after
    allowing the kernel ``smem`` bytes of dynamic shared memory."""
    import ctypes
    import cupy
    key = (device, id(kernel), smem)
    g = _COOP_GRID.get(key)
    if g is None:
        with cupy.cuda.Device(device):
            fn = ctypes.c_void_p(kernel.kernel.ptr)
            _check_driver(_driver().cuFuncSetAttribute(fn, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                       ctypes.c_int(smem)), "cuFuncSetAttribute")
            n = ctypes.c_int(0)
            _check_driver(_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(n), fn, THREADS, ctypes.c_size_t(smem)),
                "cuOccupancyMaxActiveBlocksPerMultiprocessor")
            sms = cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
        if n.value < 1:
            raise CudaDriverError(f"a pack block ({smem} bytes of shared memory) does not fit "
                                  f"on device {device}")
        g = _COOP_GRID[key] = n.value * sms
    return g


def _launch_persistent(kernel, n_tiles: int, smem: int, args, stream: int, device: int) -> None:
    """A cooperative launch (every block resident at once, so that none of a
    persistent kernel's blocks waits for a slot) of min(n_tiles, resident)
    blocks; cuLaunchCooperativeKernel through the driver API, as the kernel
    needs no grid-wide sync and so no relocatable device code."""
    import ctypes
    import cupy
    grid = min(n_tiles, _resident_grid(kernel, smem, device))
    ctype = {np.uint64: ctypes.c_uint64, np.int32: ctypes.c_int32}
    vals = [ctype[type(a)](int(a)) for a in args]
    params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
    with cupy.cuda.Device(device):
        _check_driver(_driver().cuLaunchCooperativeKernel(
            ctypes.c_void_p(kernel.kernel.ptr), grid, 1, 1, THREADS, 1, 1, smem,
            ctypes.c_void_p(stream), params), "cuLaunchCooperativeKernel")


def _memset(ptr: int, nbytes: int, stream: int, device: int) -> None:
    if nbytes:
        rt = ci._runtime()
        with _on_device(device):
            rt.memsetAsync(ptr, 0, nbytes, stream)


def _memcpy(dst: int, src: int, nbytes: int, stream: int, device: int) -> None:
    if nbytes:
        rt = ci._runtime()
        with _on_device(device):
            rt.memcpyAsync(dst, src, nbytes, rt.memcpyDeviceToDevice, stream)


class _on_device:
    def __init__(self, device):
        self.device = device

    def __enter__(self):
        rt = ci._runtime()
        self.prev = rt.getDevice()
        rt.setDevice(self.device)

    def __exit__(self, *exc):
        ci._runtime().setDevice(self.prev)


def _read_host(ptr: int, nbytes: int, stream: int, device: int) -> np.ndarray:
    """A small device region copied to the host in stream order (one sync)."""
    out = np.zeros(nbytes, dtype=np.uint8)
    rt = ci._runtime()
    with _on_device(device):
        rt.memcpyAsync(out.ctypes.data, ptr, nbytes, rt.memcpyDeviceToHost, stream)
        rt.streamSynchronize(stream)
    return out


def _cupy_view(ptr: int, nbytes: int, dtype, owner, device: int):
    import cupy
    itemsize = np.dtype(dtype).itemsize
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device)
    return cupy.ndarray((nbytes // itemsize,), dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))


# --------------------------------------------------------------------------- #
# The backend                                                                 #
# --------------------------------------------------------------------------- #
class CupyBackend:
    name = "cupy"
    device_type = "cuda"

    def is_available(self) -> bool:
        try:
            import cupy
            return cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:  # noqa: BLE001 -- no CuPy, no driver, no device: all "unavailable"
            return False

    # ------------------------------------------------------------------ pack
    def pack(self, x, *, dtype=None, encoding="auto", chunk_log2=_fmt.DEFAULT_CHUNK_LOG2,
             capacity=None, stream=None, allocator=None) -> PackedTensor:
        s = ci.stream_handle(stream)
        t = ci.import_cuda(x, dtype=dtype, stream=s)
        return self._pack(t, encoding, chunk_log2, capacity, s, allocator, MODE_PACK)

    def _pack(self, t: ci.CudaTensor, encoding, chunk_log2, capacity, s, allocator, mode,
              y: ci.CudaArray | None = None, in_mask=None) -> PackedTensor:
        chunk_log2 = _fmt.check_chunk_log2(chunk_log2)
        auto = isinstance(encoding, str) and encoding.lower() == "auto"
        enc = Encoding.NOSIGN if auto else Encoding.parse(encoding)
        numel, dev, dt = t.numel, t.device, t.dtype
        if capacity is not None:
            capacity = int(capacity)
            _fmt.layout(t.shape, dt, enc, capacity, chunk_log2)      # range check
        exact = capacity is None
        lay = _fmt.layout(t.shape, dt, enc, numel if exact else capacity, chunk_log2)
        alloc = ci.packed_allocation(lay, dev, s, allocator)
        self._run_pack(t, lay, alloc, s, allocator, mode, y, in_mask)
        if exact or auto:
            head = _read_host(alloc.status_ptr, 16, s, dev)            # the one sync
            status = int(head[:4].view(np.uint32)[0])
            nnz = int(head[8:16].view(np.uint64)[0])
            if status & 1:
                if auto:
                    return self._pack(t, Encoding.RAW, chunk_log2, capacity, s, allocator, mode, y,
                                      in_mask)
                raise EncodingError("nosign encoding: a stored value has its sign bit set; "
                                    "use encoding='signplane' or 'raw'")
            if exact:
                lay, alloc = self._shrink(lay, alloc, nnz, s, allocator)
            return self._packed(t, lay, alloc, s, nnz=nnz, status=False)
        return self._packed(t, lay, alloc, s, nnz=None, status=True)

    def _run_pack(self, t, lay, alloc, s, allocator, mode, y, in_mask):
        dt, dev, numel = t.dtype, t.device, t.numel
        if numel == 0:
            _memset(alloc.buffer.ptr, alloc.buffer.nbytes, s, dev)
            return
        rounds = ROUNDS["pack"] if mode in (MODE_PACK, MODE_MASKED) else ROUNDS["fused"]
        tile = tile_elems(dt, rounds)
        n_tiles = -(-numel // tile)
        # kernels/bitsparse_pack.cu: the tile counter (16 bytes), then per tile an
        # 8-byte count descriptor and a 16-byte edge record.
        scratch = ci.allocate(16 + 8 * (n_tiles + n_tiles % 2) + 16 * n_tiles, dev, s, allocator)
        _memset(scratch.ptr, scratch.nbytes, s, dev)
        fmt = _FMT[dt.name] if mode in (MODE_RELU, MODE_RELU2) else _BITS_FMT[dt.bits]
        kern = get_kernel(dev, "pack", fmt, int(lay.encoding), mode, rounds)
        masked = mode == MODE_MASKED
        mask_ptr = int(in_mask.data.ptr) if masked else alloc.ptr("mask")
        mask_len = lay.mask[1]
        args = (_U64(t.ptr), _U64(numel), _I32(t.aligned16),
                _U64(mask_ptr), _U64(mask_len),
                _U64(0 if masked else alloc.ptr("offsets")), _I32(lay.offset_width == 8),
                _I32(lay.chunk_log2),
                _U64(alloc.ptr("values")), _U64(alloc.ptr("signs")), _U64(lay.capacity),
                _U64(y.ptr if y is not None else 0), _I32(y is not None and y.ptr % 16 == 0),
                _U64(scratch.ptr), _U64(alloc.status_ptr), _U64(n_tiles))
        _launch_persistent(kern, n_tiles, pack_smem_bytes(dt, int(lay.encoding), rounds), args, s, dev)
        w = stream_width(dt, lay.encoding)
        signplane = lay.encoding == Encoding.SIGNPLANE
        _launch(get_kernel(dev, "stitch"), -(-(n_tiles + 1) // THREADS),
                (_U64(scratch.ptr), _U64(n_tiles), _U64(lay.capacity), _I32(w),
                 _U64(alloc.ptr("values")), _I32(signplane), _U64(alloc.ptr("signs"))), s, dev)
        vwords = -(-lay.values[1] // 4)
        swords = -(-lay.signs[1] // 4)
        if mode != MODE_MASKED and lay.capacity < numel and max(vwords, swords):
            grid = min(-(-max(vwords, swords) // THREADS), 4096)
            _launch(get_kernel(dev, "zero_tail"), grid,
                    (_U64(alloc.status_ptr), _U64(lay.capacity), _I32(w), _U64(alloc.ptr("values")),
                     _U64(vwords), _I32(signplane),
                     _U64(alloc.ptr("signs")), _U64(swords)), s, dev)
        alloc.scratch = scratch          # keep alive until the stream has used it

    def _shrink(self, lay, alloc, nnz, s, allocator):
        """Copy the sections of a worst-case layout into an exact-size allocation."""
        exact = _fmt.layout(lay.shape, lay.dtype, lay.encoding, nnz, lay.chunk_log2)
        out = ci.packed_allocation(exact, alloc.buffer.device, s, allocator)
        dev = alloc.buffer.device
        head = alloc.spans["offsets"][0] + alloc.spans["offsets"][1]   # mask + offsets, same spans
        _memcpy(out.buffer.ptr, alloc.buffer.ptr, head, s, dev)
        _memcpy(out.ptr("values"), alloc.ptr("values"), exact.values[1], s, dev)
        _memcpy(out.ptr("signs"), alloc.ptr("signs"), exact.signs[1], s, dev)
        _memcpy(out.status_ptr, alloc.status_ptr, 16, s, dev)
        return exact, out

    def _packed(self, t, lay, alloc, s, *, nnz, status, mask=None, offsets=None, extra=None):
        dev, owner = alloc.buffer.device, alloc.buffer
        planes = {}
        for name, dtype in (("mask", np.uint8), ("offsets", np.dtype(f"<u{lay.offset_width}")),
                            ("values", np.uint8), ("signs", np.uint8)):
            if name in alloc.spans:
                planes[name] = _cupy_view(alloc.ptr(name), alloc.spans[name][1], dtype, owner, dev)
        ex = {"stream": s}
        ex.update(extra or {})
        return PackedTensor(tuple(t.shape), t.dtype, lay.encoding, lay.chunk_log2, lay.capacity,
                            planes["mask"] if mask is None else mask,
                            planes["offsets"] if offsets is None else offsets,
                            planes["values"], planes["signs"], backend=self,
                            device=("cuda", dev), _nnz=nnz,
                            status=(_cupy_view(alloc.status_ptr, 4, np.int32, owner, dev)
                                    if status else None),
                            extra=ex)

    # ---------------------------------------------------------------- unpack
    def unpack(self, p: PackedTensor, *, out=None, stream=None, allocator=None):
        s = ci.stream_handle(stream)
        p.check()
        dev = p.device[1]
        if out is not None:
            o = ci.import_cuda(out, stream=s)
            ci.check_out(o, p.shape, p.dtype, dev)
        else:
            o = ci.CudaArray.empty(p.shape, p.dtype, dev, s, allocator)
        self._run_unpack(p, OP_UNPACK, s, allocator, out=o)
        if out is not None:
            return out
        return o

    def _prefix(self, p, s, allocator, rounds):
        """(mode, pointer, owner): where unpack blocks find their value range.

        Mode 0: every tile is a whole number of chunks, so the offsets table
        has both ends. Mode 2 (chunks larger than a tile): a per-tile count
        kernel and an exclusive cumsum give ``n_tiles + 1`` prefix entries."""
        tile = tile_elems(p.dtype, rounds)
        if (1 << p.chunk_log2) <= tile:
            return 0, 0, None
        import cupy
        dev = p.device[1]
        n_tiles = -(-p.numel // tile)
        counts = ci.allocate(8 * n_tiles, dev, s, allocator)
        _launch(get_kernel(dev, "tile_counts", _BITS_FMT[p.dtype.bits], rounds), n_tiles,
                (_U64(p.mask.data.ptr), _U64(p.mask.size), _U64(p.numel), _U64(counts.ptr)), s, dev)
        with cupy.cuda.Device(dev), cupy.cuda.ExternalStream(s, dev):
            c = _cupy_view(counts.ptr, 8 * n_tiles, np.uint64, counts, dev)
            prefix = cupy.zeros(n_tiles + 1, dtype=np.uint64)
            cupy.cumsum(c, out=prefix[1:])
        return 2, int(prefix.data.ptr), prefix

    @staticmethod
    def _stream_args(p):
        return (_U64(p.values.data.ptr), _U64(p.values.size), _U64(p.signs.data.ptr),
                _U64(p.signs.size))

    def _run_unpack(self, p, op, s, allocator, *, out, grad=None, out2=None, pu=None, udense=None):
        dev = p.device[1]
        if p.numel == 0:
            return
        rounds = unpack_rounds(p.dtype, op)
        pmode, pptr, keep = self._prefix(p, s, allocator, rounds)
        fmt = _BITS_FMT[p.dtype.bits] if op == OP_UNPACK else _FMT[p.dtype.name]
        uenc = int(pu.encoding) if pu is not None else 0
        kern = get_kernel(dev, "unpack", fmt, op, rounds, int(p.encoding), uenc)
        zero_stream = (_U64(0), _U64(0), _U64(0), _U64(0))
        args = ((_U64(p.numel), _I32(p.chunk_log2), _I32(pmode), _U64(p.offsets.data.ptr),
                 _I32(p.offsets.dtype.itemsize == 8), _U64(pptr),
                 _U64(p.mask.data.ptr), _U64(p.mask.size))
                + self._stream_args(p)
                + (self._stream_args(pu) if pu is not None else zero_stream)
                + (_U64(grad.ptr if grad is not None else 0), _I32(grad is not None and grad.aligned16),
                   _U64(udense.ptr if udense is not None else 0),
                   _I32(udense is not None and udense.ptr % 16 == 0),
                   _U64(out.ptr), _I32(out.ptr % 16 == 0),
                   _U64(out2.ptr if out2 is not None else 0),
                   _I32(out2 is not None and out2.ptr % 16 == 0)))
        n_tiles = -(-p.numel // tile_elems(p.dtype, rounds))
        _launch(kern, n_tiles, args, s, dev)
        del keep

    # ------------------------------------------------------------- fused ops
    def relu_pack(self, a, *, square=False, dtype=None, encoding="nosign",
                  chunk_log2=_fmt.DEFAULT_CHUNK_LOG2, capacity=None, stream=None, allocator=None):
        s = ci.stream_handle(stream)
        t = ci.import_cuda(a, dtype=dtype, stream=s)
        y = ci.CudaArray.empty(t.shape, t.dtype, t.device, s, allocator)
        p = self._pack(t, encoding, chunk_log2, capacity, s, allocator,
                       MODE_RELU2 if square else MODE_RELU, y=y)
        return y, p

    def _grad(self, grad, p, s):
        g = ci.import_cuda(grad, stream=s)
        if g.dtype != p.dtype or tuple(g.shape) != tuple(p.shape):
            raise OutputMismatchError(f"grad is {g.dtype.name}{tuple(g.shape)}; the packed "
                                      f"activation is {p.dtype.name}{tuple(p.shape)}")
        if g.device != p.device[1]:
            raise OutputMismatchError(f"grad lives on cuda:{g.device}, the packed tensor on "
                                      f"cuda:{p.device[1]}")
        return g

    def relu_backward(self, grad, p, *, stream=None, allocator=None):
        s = ci.stream_handle(stream)
        g = self._grad(grad, p, s)
        dev = g.device
        out = ci.CudaArray.empty(p.shape, p.dtype, dev, s, allocator)
        if p.numel:
            v = 16 // p.dtype.itemsize
            grid = min(-(-p.numel // (v * THREADS)), 132 * 32)
            _launch(get_kernel(dev, "mask_select", _BITS_FMT[p.dtype.bits]), grid,
                    (_U64(g.ptr), _I32(g.aligned16), _U64(p.mask.data.ptr), _U64(p.mask.size),
                     _U64(p.numel), _U64(out.ptr), _I32(out.ptr % 16 == 0)), s, dev)
        return out

    def relu2_backward(self, grad, p, *, stream=None, allocator=None):
        s = ci.stream_handle(stream)
        p.check()
        g = self._grad(grad, p, s)
        out = ci.CudaArray.empty(p.shape, p.dtype, g.device, s, allocator)
        self._run_unpack(p, OP_RELU2, s, allocator, out=out, grad=g)
        return out

    def masked_pack(self, u, p_mask, *, dtype=None, encoding="signplane", stream=None,
                    allocator=None):
        s = ci.stream_handle(stream)
        t = ci.import_cuda(u, dtype=dtype, stream=s)
        if tuple(t.shape) != tuple(p_mask.shape) or t.dtype != p_mask.dtype:
            raise OutputMismatchError(f"u is {t.dtype.name}{tuple(t.shape)}, mask tensor is "
                                      f"{p_mask.dtype.name}{tuple(p_mask.shape)}")
        if t.device != p_mask.device[1]:
            raise OutputMismatchError(f"u lives on cuda:{t.device}, the mask on cuda:{p_mask.device[1]}")
        enc = Encoding.parse(encoding)
        nnz = p_mask.nnz                    # known after an exact pack; else one sync
        lay = _fmt.layout(t.shape, t.dtype, enc, nnz, p_mask.chunk_log2)
        alloc = ci.packed_allocation(lay, t.device, s, allocator, sections=("values", "signs"))
        self._run_pack(t, lay, alloc, s, allocator, MODE_MASKED, None, p_mask.mask)
        return self._packed(t, lay, alloc, s, nnz=nnz, status=enc == Encoding.NOSIGN,
                            mask=p_mask.mask, offsets=p_mask.offsets,
                            extra={"shares_mask": True})

    def gated_backward(self, grad, p_r, p_u, *, stream=None, allocator=None):
        s = ci.stream_handle(stream)
        p_r.check()
        g = self._grad(grad, p_r, s)
        if tuple(p_u.shape) != tuple(p_r.shape) or p_u.dtype != p_r.dtype:
            raise OutputMismatchError("p_u and p_r differ in shape or dtype")
        dev = g.device
        gg = ci.CudaArray.empty(p_r.shape, p_r.dtype, dev, s, allocator)
        gu = ci.CudaArray.empty(p_r.shape, p_r.dtype, dev, s, allocator)
        shared = (p_u.mask.data.ptr == p_r.mask.data.ptr
                  and p_u.offsets.data.ptr == p_r.offsets.data.ptr)
        if shared:
            self._run_unpack(p_r, OP_GATED, s, allocator, out=gg, out2=gu, grad=g, pu=p_u)
        else:
            u = self.unpack(p_u, stream=s, allocator=allocator)
            self._run_unpack(p_r, OP_GATED_DENSE, s, allocator, out=gg, out2=gu, grad=g,
                             udense=u)
        return gg, gu

    # --------------------------------------------------------------- helpers
    def read_nnz(self, p) -> int:
        s = p.extra.get("stream", 0)
        w = p.offsets.dtype.itemsize
        last = int(p.offsets.data.ptr) + (p.offsets.size - 1) * w
        return int(_read_host(last, w, s, p.device[1]).view(f"<u{w}")[0])

    def read_status(self, p) -> int:
        if p.status is None:
            return 0
        if "status_value" not in p.extra:        # final once the pack has run
            s = p.extra.get("stream", 0)
            p.extra["status_value"] = int(_read_host(int(p.status.data.ptr), 4, s,
                                                     p.device[1]).view(np.int32)[0])
        return p.extra["status_value"]

    def to_numpy(self, array) -> np.ndarray:
        if isinstance(array, ci.CudaArray):
            return array.get()
        import cupy
        cupy.cuda.runtime.deviceSynchronize()
        return cupy.asnumpy(array)
