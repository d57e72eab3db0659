"""numcodecs and zarr codecs that store chunks as format-v1 buffers (docs/format.md).

``Bitsparse`` is a :class:`numcodecs.abc.Codec` (``codec_id = "bitsparse"``):
``encode`` returns ``bitsparse_core.pack(x, ...).to_bytes()`` (shape kept; an
F-ordered array is taken, as numcodecs' compressors take it, as its elements in
memory order, 1-D), ``decode`` validates the buffer (every rule of the spec, named
errors) and returns the tensor bit for bit. It is registered through the
``numcodecs.codecs`` entry point, so ``numcodecs.get_codec({"id": "bitsparse"})``
and zarr format 2 arrays (``compressor`` or filter) find it without importing this
module first.

``BitsparseCodec`` is the same codec as a zarr format 3 array-to-bytes codec
(``serializer=``), registered under the name ``"bitsparse"`` through the
``zarr.codecs`` entry point. It is built on first access, so importing this
module does not import zarr.

Element types: float16, float32, bfloat16, float8_e4m3fn and float8_e5m2 arrays
(the last three as ml_dtypes arrays) are encoded as they are. Integer arrays and
plain bytes are taken as the bits of ``dtype`` (a config field): this is how
bfloat16 and float8 live in zarr, which has no such data types (store them as
uint16 / uint8 with ``Bitsparse(dtype="bfloat16")``). ``decode`` returns an array
of the stored dtype and shape; ``decode(buf, out=...)`` writes into any writable
buffer of exactly the tensor's byte size instead.
"""

from __future__ import annotations

import numpy as np
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray, ensure_ndarray_like
from numcodecs.registry import register_codec

from . import dtypes as _dt
from . import from_bytes, pack, unpack
from .errors import NonContiguousError, UnsupportedDTypeError
from .spec.format import DEFAULT_CHUNK_LOG2, check_chunk_log2

ENCODINGS = ("auto", "raw", "nosign", "signplane")


class Bitsparse(Codec):
    """Lossless bitmask + values codec for sparse (ReLU) float data.

    encoding:    ``"auto"`` (nosign when every stored sign bit is 0, else raw),
                 ``"raw"``, ``"nosign"`` or ``"signplane"``.
    chunk_log2:  log2 of the elements per chunk-offset entry (format §3), 9..24.
    dtype:       the element type of integer / byte input (its bits are stored);
                 None takes the dtype of float input and refuses anything else.
    """

    codec_id = "bitsparse"

    def __init__(self, encoding: str = "auto", chunk_log2: int = DEFAULT_CHUNK_LOG2,
                 dtype: str | None = None):
        if not isinstance(encoding, str) or encoding.lower() not in ENCODINGS:
            raise ValueError(f"encoding={encoding!r}; use one of {', '.join(ENCODINGS)}")
        if isinstance(chunk_log2, bool) or not isinstance(chunk_log2, (int, np.integer)):
            raise TypeError(f"chunk_log2 must be an int, not {type(chunk_log2).__name__}")
        self.encoding = encoding.lower()
        self.chunk_log2 = check_chunk_log2(chunk_log2)
        self.dtype = None if dtype is None else _dt.resolve(dtype).name

    # ------------------------------------------------------------------ config
    def get_config(self) -> dict:
        config = {"id": self.codec_id, "encoding": self.encoding, "chunk_log2": self.chunk_log2}
        if self.dtype is not None:
            config["dtype"] = self.dtype
        return config

    @classmethod
    def from_config(cls, config: dict) -> "Bitsparse":
        config = dict(config)
        config.pop("id", None)
        return cls(**config)

    def __repr__(self) -> str:
        args = f"encoding={self.encoding!r}, chunk_log2={self.chunk_log2}"
        if self.dtype is not None:
            args += f", dtype={self.dtype!r}"
        return f"{type(self).__name__}({args})"

    # ------------------------------------------------------------ encode/decode
    def _typed(self, buf):
        """``(array, dtype)`` to pack: float input as it is, integer input as bits."""
        arr = ensure_ndarray_like(buf)
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"{type(self).__name__} encodes host (NumPy) buffers, not "
                            f"{type(arr).__module__}.{type(arr).__name__}")
        if not arr.flags.c_contiguous:
            if not arr.flags.f_contiguous:
                raise NonContiguousError("bitsparse encodes contiguous arrays; "
                                         "pass np.ascontiguousarray(x)")
            # Like every numcodecs compressor: an F-ordered array is its elements in
            # memory order (zarr's order="F" chunks), stored 1-D.
            arr = arr.reshape(-1, order="A")
        try:
            own = _dt.resolve(arr.dtype)
        except UnsupportedDTypeError:
            own = None
        if own is not None:
            if self.dtype is not None and own.name != self.dtype:
                raise UnsupportedDTypeError(f"input is {own.name}, the codec's dtype is "
                                            f"{self.dtype}")
            return arr, own
        if self.dtype is None or arr.dtype.kind not in "ui":
            raise UnsupportedDTypeError(
                f"cannot encode {arr.dtype} data: give float16 / float32 / bfloat16 / float8 "
                "arrays, or integer bits with the codec's dtype= (e.g. Bitsparse(dtype="
                "'bfloat16') for uint16 bits)")
        dt = _dt.resolve(self.dtype)
        if arr.dtype.itemsize != dt.itemsize:  # bytes-like input: one flat run of elements
            flat = arr.reshape(-1).view(np.uint8)
            if flat.size % dt.itemsize:
                raise ValueError(f"{flat.size} bytes are not a whole number of "
                                 f"{dt.itemsize}-byte {dt.name} elements")
            arr = flat
        return arr.view(dt.uint), dt

    def encode(self, buf) -> bytes:
        arr, dt = self._typed(buf)
        return pack(arr, encoding=self.encoding, chunk_log2=self.chunk_log2, dtype=dt,
                       backend="numpy").to_bytes()

    def decode(self, buf, out=None):
        p = from_bytes(ensure_contiguous_ndarray(buf))
        if out is None:
            return np.asarray(unpack(p))
        flat = ensure_contiguous_ndarray(out).view(np.uint8)   # memory order, a view
        if flat.size != p.dense_nbytes:
            raise ValueError(f"out holds {flat.size} bytes; the decoded tensor "
                             f"{p.dtype.name}{tuple(p.shape)} needs {p.dense_nbytes}")
        unpack(p, out=flat.view(p.dtype.numpy).reshape(p.shape))
        return out


register_codec(Bitsparse)


# --------------------------------------------------------------------------- #
# zarr format 3                                                                 #
# --------------------------------------------------------------------------- #
def _zarr3_codec_class():
    from dataclasses import dataclass

    from zarr.abc.codec import ArrayBytesCodec
    from zarr.core.common import parse_named_configuration
    from zarr.registry import register_codec as zarr_register_codec

    @dataclass(frozen=True)
    class BitsparseCodec(ArrayBytesCodec):
        """zarr v3 array-to-bytes codec (``serializer=``); each chunk is one format-v1
        buffer. Configuration as :class:`Bitsparse` (``encoding``, ``chunk_log2``,
        ``dtype`` for arrays holding bfloat16 / float8 bits as uint16 / uint8)."""

        encoding: str = "auto"
        chunk_log2: int = DEFAULT_CHUNK_LOG2
        dtype: str | None = None

        is_fixed_size = False

        def __init__(self, *, encoding: str = "auto", chunk_log2: int = DEFAULT_CHUNK_LOG2,
                     dtype: str | None = None):
            codec = Bitsparse(encoding=encoding, chunk_log2=chunk_log2, dtype=dtype)
            for name in ("encoding", "chunk_log2", "dtype"):
                object.__setattr__(self, name, getattr(codec, name))

        @property
        def numcodec(self) -> Bitsparse:
            return Bitsparse(self.encoding, self.chunk_log2, self.dtype)

        @classmethod
        def from_dict(cls, data):
            _, config = parse_named_configuration(data, "bitsparse",
                                                  require_configuration=False)
            return cls(**(config or {}))

        def to_dict(self):
            config = self.numcodec.get_config()
            config.pop("id")
            return {"name": "bitsparse", "configuration": config}

        def validate(self, *, shape, dtype, chunk_grid):
            native = dtype.to_native_dtype()
            try:
                own = _dt.resolve(native).name
            except UnsupportedDTypeError:
                own = None
            if own is not None and self.dtype not in (None, own):
                raise ValueError(f"bitsparse codec dtype={self.dtype!r} on a {own} array")
            if own is None and (self.dtype is None or native.kind not in "ui"
                                or native.itemsize != _dt.resolve(self.dtype).itemsize):
                raise ValueError(
                    f"bitsparse stores float16 / float32 arrays, or bfloat16 / float8 bits in "
                    f"uint16 / uint8 arrays with dtype=...; this array is {native}"
                    + ("" if self.dtype is None else f" with dtype={self.dtype!r}"))

        async def _encode_single(self, chunk_array, chunk_spec):
            # zarr may hand over a strided view of the written array (zarr 3.1.0 does).
            data = self.numcodec.encode(np.ascontiguousarray(chunk_array.as_numpy_array()))
            return chunk_spec.prototype.buffer.from_bytes(data)

        async def _decode_single(self, chunk_bytes, chunk_spec):
            arr = self.numcodec.decode(chunk_bytes.as_numpy_array())
            arr = arr.view(chunk_spec.dtype.to_native_dtype()).reshape(chunk_spec.shape)
            return chunk_spec.prototype.nd_buffer.from_numpy_array(arr)

        def compute_encoded_size(self, input_byte_length, chunk_spec):
            raise NotImplementedError  # variable size

    BitsparseCodec.__module__ = __name__
    BitsparseCodec.__qualname__ = "BitsparseCodec"
    zarr_register_codec("bitsparse", BitsparseCodec)
    return BitsparseCodec


def __getattr__(name: str):
    if name == "BitsparseCodec":
        cls = _zarr3_codec_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Bitsparse", "BitsparseCodec", "ENCODINGS"]
