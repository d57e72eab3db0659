"""Drop-in FFN modules: the usual ``nn.Linear`` parameters, the activation stored packed.

Each module has exactly the parameters (names, shapes, init) of the plain
PyTorch FFN written with ``nn.Linear``, so a ``state_dict`` moves between the
two unchanged; :meth:`from_dense` shares an existing module's ``nn.Linear``s.
"""

from __future__ import annotations

import torch
from torch import nn

from .capacity import CapacityPolicy
from .functional import _check_encoding, gated_relu_ffn, relu_ffn
from .offload import resolve as resolve_offload


_LINEAR = nn.Linear


def linear_params(lin: nn.Module):
    """``(lin.weight, lin.bias)``, read from the parameter dict where that is what the two
    attributes give: a plain ``nn.Linear`` (a parametrized or FSDP-sharded one has a class
    of its own) with neither name in its instance dict (where a wrapper may put a view).
    ``Module.__getattr__`` costs ~0.5 µs a read, and a forward reads four or six."""
    if type(lin) is _LINEAR:
        d = lin.__dict__
        p = d["_parameters"]
        if "weight" in p and "bias" in p and "weight" not in d and "bias" not in d:
            return p["weight"], p["bias"]
    return lin.weight, lin.bias


class _PackedFFN(nn.Module):
    def __init__(self, encoding, backend, density=None, margin=0.1, pending="wait",
                 offload=None, initial_density=None):
        super().__init__()
        self.encoding = _check_encoding(encoding)
        self.backend = backend
        self.capacity_policy = CapacityPolicy(density, margin, pending=pending,
                                              initial_density=initial_density)
        # None, or the Offloader every layer of a model shares (True: the process's)
        self.offload = resolve_offload(offload)

    def stats(self) -> dict:
        """Packs made, overflows seen (each recomputed exactly), the densities."""
        return self.capacity_policy.stats()

    def extra_repr(self) -> str:
        off = f", offload={self.offload!r}" if self.offload is not None else ""
        return f"encoding={self.encoding!r}, backend={self.backend!r}{off}"


class PackedReLUFFN(_PackedFFN):
    """``fc2(relu(fc1(x)))`` storing ``relu(fc1(x))`` packed (bitmask + nonzero values)."""

    square = False

    def __init__(self, d_model: int, d_ff: int, bias: bool = True, *, encoding: str = "nosign",
                 density: float | None = None, margin: float = 0.1, pending: str = "wait",
                 backend: str = "auto", offload=None, initial_density: float | None = None,
                 device=None, dtype=None):
        super().__init__(encoding, backend, density, margin, pending, offload, initial_density)
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(d_ff, d_model, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (w1, b1), (w2, b2) = linear_params(self.fc1), linear_params(self.fc2)
        return relu_ffn(x, w1, b1, w2, b2, square=self.square, encoding=self.encoding,
                        policy=self.capacity_policy, backend=self.backend,
                        offload=self.offload)

    @classmethod
    def from_dense(cls, fc1: nn.Linear, fc2: nn.Linear, *, encoding: str = "nosign",
                   density: float | None = None, margin: float = 0.1, pending: str = "wait",
                   backend: str = "auto", offload=None, initial_density: float | None = None):
        """A packed FFN sharing the parameters of two existing ``nn.Linear``s."""
        m = cls.__new__(cls)
        _PackedFFN.__init__(m, encoding, backend, density, margin, pending, offload,
                            initial_density)
        m.fc1, m.fc2 = fc1, fc2
        return m


class PackedReLU2FFN(PackedReLUFFN):
    """``fc2(relu(fc1(x))**2)`` (Primer / modded-nanoGPT) storing ``relu(fc1(x))`` packed;
    backward takes ``2·relu`` from the packed values and recomputes the square for ``dW2``."""

    square = True


class PackedReGLUFFN(_PackedFFN):
    """``down_proj(relu(gate_proj(x)) * up_proj(x))`` storing ``relu(gate)`` packed and
    ``up`` only where ``gate > 0``, both behind one bitmask, at one capacity."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = True, *, encoding: str = "nosign",
                 u_encoding: str | None = None, density: float | None = None,
                 margin: float = 0.1, pending: str = "wait", backend: str = "auto",
                 offload=None, initial_density: float | None = None, device=None, dtype=None):
        super().__init__(encoding, backend, density, margin, pending, offload, initial_density)
        self.u_encoding = u_encoding
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (wg, bg), (wu, bu), (w2, b2) = (linear_params(self.gate_proj),
                                        linear_params(self.up_proj),
                                        linear_params(self.down_proj))
        return gated_relu_ffn(x, wg, bg, wu, bu, w2, b2, encoding=self.encoding,
                              u_encoding=self.u_encoding, policy=self.capacity_policy,
                              backend=self.backend, offload=self.offload)

    @classmethod
    def from_dense(cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, *,
                   encoding: str = "nosign", u_encoding: str | None = None,
                   density: float | None = None, margin: float = 0.1, pending: str = "wait",
                   backend: str = "auto", offload=None, initial_density: float | None = None):
        m = cls.__new__(cls)
        _PackedFFN.__init__(m, encoding, backend, density, margin, pending, offload,
                            initial_density)
        m.u_encoding = u_encoding
        m.gate_proj, m.up_proj, m.down_proj = gate_proj, up_proj, down_proj
        return m
