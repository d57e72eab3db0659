"""PackedTensor: one packed activation, whatever backend made it and wherever it lives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from . import dtypes as _dt
from .errors import CapacityOverflowError, EncodingError
from .spec import format as _fmt


@dataclass(eq=False)
class PackedTensor:
    """A tensor stored as bitmask + chunk offsets + values (+ sign plane).

    The four planes are 1-D arrays on the tensor's device: ``mask``, ``values``
    and ``signs`` are uint8 byte arrays, ``offsets`` is uint32 or uint64 (the
    spec's offset width). Their lengths are exactly the section lengths of
    :func:`bitsparse_core.format.layout` at this tensor's ``capacity``. On the CPU
    they are NumPy arrays; on a GPU, :class:`~bitsparse_core.backends.cuda.interop.DevicePlane`
    views of the tensor's one allocation (DLPack / CUDA-array-interface exports).

    ``nnz`` may be pending on a GPU (packing into a fixed capacity does not wait
    for the count); reading :attr:`nnz` or calling :meth:`check` fetches it.

    ``backend`` is the backend object that made the planes (plain data: no registry
    look-up); it reads the device-side counters and copies planes to the host.
    """

    shape: tuple
    dtype: _dt.DType
    encoding: _fmt.Encoding
    chunk_log2: int
    capacity: int
    mask: Any
    offsets: Any
    values: Any
    signs: Any
    backend: Any = None
    device: tuple = ("cpu", 0)
    _nnz: Optional[int] = None
    # Device-side error word written by GPU kernels (bit 0: a nosign value had its
    # sign bit set). None where the backend raises at pack time instead.
    status: Any = None
    extra: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ sizes
    @property
    def numel(self) -> int:
        return _fmt.numel_of(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def layout(self) -> _fmt.Layout:
        # Every op asks for it: computed once, again only if a field it follows from changed.
        key = (self.shape, self.dtype, self.encoding, self.capacity, self.chunk_log2)
        known = self.__dict__.get("_layout")
        if known is None or known[0] != key:
            try:
                lay = _fmt.cached_layout(*key)
            except TypeError:            # a shape given as a list: not a cache key
                lay = _fmt.layout(*key)
            known = self.__dict__["_layout"] = (key, lay)
        return known[1]

    @property
    def nnz(self) -> int:
        """Number of nonzero bit patterns (may exceed ``capacity`` after an overflow)."""
        if self._nnz is None:
            self._nnz = int(self.backend.read_nnz(self))
        return self._nnz

    @property
    def nbytes(self) -> int:
        """Bytes this tensor occupies: the serialized size at its capacity."""
        return self.layout.total_size

    @property
    def dense_nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def ratio(self) -> float:
        """Dense bytes over packed bytes (> 1 means packing saved memory)."""
        return self.dense_nbytes / self.nbytes

    @property
    def planes(self) -> dict:
        return {"mask": self.mask, "offsets": self.offsets, "values": self.values,
                "signs": self.signs}

    @property
    def overflowed(self) -> bool:
        return self.nnz > self.capacity

    # ------------------------------------------------------------- checking
    def check(self) -> "PackedTensor":
        """Raise if packing lost information; return self otherwise.

        :class:`CapacityOverflowError` when more nonzeros arrived than ``capacity``
        (the first ``capacity`` values are kept and valid), :class:`EncodingError`
        when a GPU kernel saw a set sign bit under ``nosign``.
        """
        if self.status is not None:
            code = int(self.backend.read_status(self))
            if code & 1:
                raise EncodingError("nosign encoding: a stored value has its sign bit set; "
                                    "use encoding='signplane' or 'raw'")
        if self.nnz > self.capacity:
            raise CapacityOverflowError(f"{self.nnz} nonzeros exceed capacity {self.capacity}; "
                                        f"{self.nnz - self.capacity} values were dropped")
        return self

    # ---------------------------------------------------------- serializing
    def to_bytes(self) -> bytes:
        """The format-v1 buffer of docs/format.md (capacity trimmed to nnz)."""
        from .spec.serialize import to_bytes
        return to_bytes(self)

    def __repr__(self) -> str:
        nnz = self._nnz if self._nnz is not None else "pending"
        return (f"PackedTensor(shape={self.shape}, dtype={self.dtype.name}, "
                f"encoding={self.encoding.name.lower()}, nnz={nnz}, capacity={self.capacity}, "
                f"nbytes={self.nbytes}, backend={getattr(self.backend, 'name', None)!r}, device={self.device})")


def host_plane(p: PackedTensor, name: str) -> np.ndarray:
    """A plane of ``p`` as a NumPy array (copies device planes to the host)."""
    return np.asarray(p.backend.to_numpy(getattr(p, name)))
