"""The backend registry and the one contract every backend implements.

A backend turns a dense tensor on its device into a :class:`PackedTensor` whose
planes are byte-identical to the NumPy reference codec's, and back. Backends
register a *factory* so that importing bitsparse_core never imports CuPy or
Numba; the factory runs on first use.

Contract (duck-typed; see :class:`Backend`):

``name``            registry key, also stored in ``PackedTensor.backend``.
``device_type``     ``"cpu"`` or ``"cuda"``: the inputs it takes.
``is_available()``  False when its dependencies or device are missing.
``pack(x, *, dtype, encoding, chunk_log2, capacity, stream, allocator)``
    ``x`` is the caller's object (a DLPack producer or a native array), already
    checked to live on ``device_type``. ``encoding`` is an Encoding or ``"auto"``.
    ``capacity=None`` packs exactly (a GPU may sync once to size the values);
    an int packs into a fixed capacity, recording overflow instead of raising.
``unpack(p, *, out, stream, allocator)``   dense array (DLPack-exportable).
``read_nnz(p)`` / ``read_status(p)``      fetch pending device-side counters.
``to_numpy(array)``                        a plane as a host NumPy array.

Fused activation ops (semantics: :mod:`bitsparse_core.reference_ops`, which
every backend must match bit for bit):

``relu_pack(a, *, square, dtype, encoding, chunk_log2, capacity, stream, allocator)``
    -> ``(y, p)``: dense relu(a) (or relu(a)**2) and pack(relu(a)) in one pass.
``relu_backward(grad, p, *, stream, allocator)``   grad where the mask is set.
``relu2_backward(grad, p, *, stream, allocator)``  2·r·grad where r > 0.
``masked_pack(u, p_mask, *, dtype, encoding, stream, allocator)``
    -> u's values at p_mask's set positions, sharing its mask (gated ReLU).
``gated_backward(grad, p_r, p_u, *, stream, allocator)`` -> ``(grad_g, grad_u)``.
"""

from __future__ import annotations

from typing import Callable, Dict, Protocol

from ..errors import BackendUnavailableError, UnsupportedDeviceError


class Backend(Protocol):
    """Every method a caller of a backend uses (the contract above)."""
    name: str
    device_type: str

    def is_available(self) -> bool: ...
    def pack(self, x, *, dtype, encoding, chunk_log2, capacity, stream, allocator): ...
    def unpack(self, p, *, out, stream, allocator): ...
    def read_nnz(self, p) -> int: ...
    def read_status(self, p) -> int: ...
    def to_numpy(self, array): ...
    def relu_pack(self, a, *, square, dtype, encoding, chunk_log2, capacity, stream,
                  allocator): ...
    def relu_backward(self, grad, p, *, stream, allocator): ...
    def relu2_backward(self, grad, p, *, stream, allocator): ...
    def masked_pack(self, u, p_mask, *, dtype, encoding, stream, allocator): ...
    def gated_backward(self, grad, p_r, p_u, *, stream, allocator): ...


_FACTORIES: Dict[str, Callable[[], Backend]] = {}
_DEVICE_TYPES: Dict[str, str] = {}
_INSTANCES: Dict[str, Backend] = {}
_AUTO: Dict[str, Backend] = {}      # device type -> what "auto" chose (asked on every call)


def register_backend(name: str, device_type: str, factory: Callable[[], Backend]) -> None:
    """Register ``factory`` (called once, lazily) under ``name``; later wins."""
    _FACTORIES[name] = factory
    _DEVICE_TYPES[name] = device_type
    _INSTANCES.pop(name, None)
    _AUTO.clear()


def registered_backends() -> dict:
    """``{name: device_type}`` of every registered backend, in priority order."""
    return dict(_DEVICE_TYPES)


def get_backend(name: str) -> Backend:
    if name not in _FACTORIES:
        raise BackendUnavailableError(f"unknown backend {name!r}; registered: {sorted(_FACTORIES)}")
    inst = _INSTANCES.get(name)
    if inst is None:
        try:
            inst = _FACTORIES[name]()
        except ImportError as exc:
            raise BackendUnavailableError(f"backend {name!r} needs a package that is not "
                                          f"installed: {exc}") from exc
        _INSTANCES[name] = inst
    return inst


def backend_available(name: str) -> bool:
    try:
        return get_backend(name).is_available()
    except BackendUnavailableError:
        return False


def select_backend(requested: str, device_type: str) -> Backend:
    """The backend for an input on ``device_type``: ``requested`` or the first available."""
    if requested != "auto":
        be = get_backend(requested)
        if be.device_type != device_type:
            raise UnsupportedDeviceError(f"backend {requested!r} runs on {be.device_type}, "
                                         f"but the input lives on {device_type}")
        if not be.is_available():
            raise BackendUnavailableError(f"backend {requested!r} is not available here")
        return be
    chosen = _AUTO.get(device_type)
    if chosen is not None:
        return chosen
    for name, dev in _DEVICE_TYPES.items():
        if dev == device_type and backend_available(name):
            chosen = _AUTO[device_type] = get_backend(name)
            return chosen
    candidates = [n for n, d in _DEVICE_TYPES.items() if d == device_type]
    raise UnsupportedDeviceError(
        f"no available backend for {device_type} tensors (registered for it: {candidates or 'none'}); "
        "bitsparse_core never copies a device tensor to the host behind your back")
