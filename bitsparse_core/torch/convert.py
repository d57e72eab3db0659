"""``bitsparse_core.torch.convert(model)``: swap the ReLU / ReLU² FFN blocks of existing
model code for the packed path, sharing the weights, and report what was replaced and
what was not.

The ``state_dict`` is unchanged (same keys, same tensors): every replacement keeps the
original ``nn.Linear`` objects under their original attribute names.

* a *block* (``T5DenseActDense``, ``nn.Sequential(Linear, ReLU, Linear)``) is replaced in
  its parent by a :class:`PackedBlock`, which registers the block's own children under
  the block's own names and runs them through the packed FFN;
* a *layer* whose FFN is inline in a bigger forward (``OPTDecoderLayer``:
  ``fc2(activation_fn(fc1 h))`` between attention and residual) stays the same object;
  its class becomes a subclass whose ``forward`` runs the original forward with the
  ``fc1 → activation_fn → fc2`` calls going through the packed FFN (:func:`_inline_class`);
  pickle and ``copy.deepcopy`` rebuild that subclass from the original class.

Rules are tried in order, the user's (:func:`register_rule`) before the built-in ones.
A rule is ``(name, predicate, builder)``: ``predicate(module)`` says the rule is about
this kind of module; ``builder(module, **kwargs)`` returns the replacement module, or
the module itself when it converted it in place, or raises :class:`Skip` with the reason
the conversion would not be bit-identical (a dropout that is active, a GELU, mixed
dtypes, ...). Modules no rule claims are not touched; those that look like an FFN (two
or more ``nn.Linear`` children and an activation child) are reported as unrecognised.

(``bitsparse_core.torch.convert`` is the function; import the rest from this module:
``from bitsparse_core.torch.convert import register_rule, PackedBlock, Skip``.)
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from ._bridge import TORCH_TO_BS
from .modules import PackedReGLUFFN, PackedReLU2FFN, PackedReLUFFN, linear_params

__all__ = ["convert", "register_rule", "unregister_rule", "Rule", "Skip", "ConvertReport", "PackedBlock",
           "RULES", "packed_modules"]

_PACKED_KW = ("encoding", "density", "margin", "pending", "backend", "offload", "initial_density")
_GATED_KW = ("encoding", "u_encoding", "density", "margin", "pending", "backend", "offload",
             "initial_density")


class Skip(Exception):
    """Raised by a rule's builder: the module is of the rule's kind but cannot be converted
    bit-identically; the message is the reason reported."""


@dataclass(frozen=True)
class Rule:
    name: str
    predicate: Callable[[nn.Module], bool]
    builder: Callable[..., nn.Module]


@dataclass
class ConvertReport:
    """``replaced``: ``(path, rule, kind)``; ``skipped``: ``(path, rule, reason)`` (a rule
    recognised the module but declined); ``unrecognised``: ``(path, class name)`` of
    FFN-looking modules no rule claims; ``already``: paths converted by an earlier call."""

    replaced: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    unrecognised: list = field(default_factory=list)
    already: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)}, skipped {len(self.skipped)}, "
                 f"unrecognised {len(self.unrecognised)}, already converted {len(self.already)}"]
        lines += [f"  replaced  {p or '<root>'}: {r} ({k})" for p, r, k in self.replaced]
        lines += [f"  skipped   {p or '<root>'}: {r}: {why}" for p, r, why in self.skipped]
        lines += [f"  unrecognised {p or '<root>'}: {c}" for p, c in self.unrecognised]
        return "\n".join(lines)


# --------------------------------------------------------------------------- helpers

def _activation_kind(act) -> str | None:
    """'relu' / 'relu2' for activations whose output is bit-identical to torch.relu /
    torch.square(torch.relu(.)), else None."""
    if type(act) is nn.ReLU:
        return "relu"
    cls = type(act)
    if cls.__name__ == "ReLUSquaredActivation" and cls.__module__.startswith("transformers."):
        return "relu2"   # forward: torch.square(nn.functional.relu(x))
    return None


def _check_linears(fc1, fc2) -> None:
    for name, lin in (("first", fc1), ("second", fc2)):
        if type(lin) is not nn.Linear:
            raise Skip(f"{name} linear is {type(lin).__name__}, not nn.Linear")
    if fc1.weight.dtype != fc2.weight.dtype:
        raise Skip(f"the two linears have different dtypes ({fc1.weight.dtype}, "
                   f"{fc2.weight.dtype})")
    if fc1.out_features != fc2.in_features:
        raise Skip("the linears' shapes do not chain")
    if fc1.weight.dtype not in TORCH_TO_BS:
        raise Skip(f"dtype {fc1.weight.dtype} is not one the packed path stores")


def _packable(*linears) -> bool:
    """One dtype the packed path stores: checked at every call, since ``.to(dtype)`` or
    ``.double()`` after conversion changes it (the dense forward is then run instead)."""
    dtype = None
    for lin in linears:
        if lin is not None:
            w = linear_params(lin)[0]
            if dtype is None:
                dtype = w.dtype
            elif w.dtype != dtype:
                return False
    return dtype in TORCH_TO_BS


def _packed(kind: str, fc1, fc2, kwargs, up=None):
    if kind == "reglu":
        return PackedReGLUFFN.from_dense(fc1, up, fc2, **{k: v for k, v in kwargs.items()
                                                          if k in _GATED_KW})
    if kind not in ("relu", "relu2"):
        raise ValueError(f"kind={kind!r}; use 'relu', 'relu2' or 'reglu'")
    cls = PackedReLU2FFN if kind == "relu2" else PackedReLUFFN
    return cls.from_dense(fc1, fc2, **{k: v for k, v in kwargs.items() if k in _PACKED_KW})


def _active(dropout) -> bool:
    return dropout.training and dropout.p > 0


class PackedBlock(nn.Module):
    """A converted FFN block: the original block's children under their original names
    (so its ``state_dict`` keys are the block's), computed by a packed FFN that shares the
    two linears (``kind`` ``"relu"`` / ``"relu2"``: ``fc2(act(fc1 x))``; ``"reglu"``:
    ``fc2(relu(fc1 x) * up x)``, ``up=`` naming the third linear). Where the packed path would not be bit-identical at call time (dropout
    switched on after conversion, dtypes changed), it falls back to the original class's
    forward on the same children (dense, exact)."""

    def __init__(self, original: nn.Module, fc1: str, fc2: str, kind: str, *,
                 dropout: str | None = None, up: str | None = None, rule: str = "",
                 **kwargs):
        super().__init__()
        for name, child in original.named_children():
            self.add_module(name, child)
        self.original_class = type(original)
        self.rule, self.kind = rule, kind
        if (kind == "reglu") != (up is not None):
            raise ValueError("up= names the third linear of kind 'reglu' (only)")
        self._names = (fc1, fc2, dropout, up)
        # Not registered as a submodule: its linears are the children above, and a second
        # path to them would add state_dict keys.
        object.__setattr__(self, "packed", _packed(kind, getattr(self, fc1), getattr(self, fc2),
                                                   kwargs, None if up is None else getattr(self, up)))

    def _dense(self) -> bool:
        fc1, fc2, dropout, up = (None if n is None else getattr(self, n) for n in self._names)
        return (dropout is not None and _active(dropout)) or not _packable(fc1, fc2, up)

    def forward(self, x):
        if self._dense():
            return self.original_class.forward(self, x)
        return self.packed(x)

    def stats(self) -> dict:
        return self.packed.stats()

    def extra_repr(self) -> str:
        return f"{self.original_class.__name__} -> {type(self.packed).__name__}, {self.packed.extra_repr()}"


# --------------------------------------------------------------------------- built-in rules

def _is_sequential_ffn(m) -> bool:
    return (type(m) is nn.Sequential and len(m) == 3 and type(m[0]) is nn.Linear
            and type(m[2]) is nn.Linear)


def _build_sequential(m, **kwargs):
    kind = _activation_kind(m[1])
    if kind is None:
        raise Skip(f"activation is {type(m[1]).__name__}, not ReLU / ReLU²")
    _check_linears(m[0], m[2])
    return PackedBlock(m, "0", "2", kind, rule="sequential", **kwargs)


def _is_t5_dense(m) -> bool:
    return (type(m).__name__ in ("T5DenseActDense", "T5DenseGatedActDense", "MT5DenseActDense",
                                 "MT5DenseGatedActDense")
            and type(m).__module__.startswith("transformers."))


def _build_t5(m, **kwargs):
    # forward: wo(dropout(act(wi h)).to(wo.weight.dtype))
    # gated: wo(dropout(act(wi_0 h) * wi_1 h).to(wo.weight.dtype))
    gated = "Gated" in type(m).__name__
    kind = _activation_kind(m.act)
    if kind is None or (gated and kind != "relu"):
        raise Skip(f"activation is {type(m.act).__name__}, not ReLU"
                   + ("" if gated else " / ReLU²"))
    if m.dropout.p > 0:
        raise Skip(f"dropout p={m.dropout.p} between activation and wo (dropout_rate=0 "
                   "converts)")
    if gated:
        _check_linears(m.wi_0, m.wo)
        _check_linears(m.wi_1, m.wo)
        return PackedBlock(m, "wi_0", "wo", "reglu", up="wi_1", dropout="dropout", rule="t5",
                           **kwargs)
    _check_linears(m.wi, m.wo)   # also rules out the int8 / fp32-kept `wo` cases
    return PackedBlock(m, "wi", "wo", kind, dropout="dropout", rule="t5", **kwargs)


def _is_opt_layer(m) -> bool:
    return any(c.__name__ == "OPTDecoderLayer" and c.__module__.startswith("transformers.")
               for c in type(m).__mro__)


_INLINE = re.compile(r"(\w+) = self\.fc1\((\w+)\)\s*\n\s*\1 = self\.activation_fn\(\1\)\s*\n"
                     r"\s*\1 = self\.fc2\(\1\)\s*\n")


class _Pending:
    """What the shadowed ``fc1`` hands on: the FFN input, until ``fc2`` runs the packed FFN."""

    __slots__ = ("x", "activated")

    def __init__(self, x):
        self.x, self.activated = x, False


_SHADOWED = ("fc1", "activation_fn", "fc2")


class _StandIn:
    """One forward's stand-ins for a converted layer's ``fc1``, ``activation_fn`` and
    ``fc2``: ``fc1(h)`` hands on ``h``, ``act`` marks it, ``fc2`` runs ``packed`` on it;
    ``calls`` counts the fc1 calls still without their fc2."""

    __slots__ = ("packed", "calls")

    def __init__(self, packed):
        self.packed, self.calls = packed, 0

    def fc1(self, h):
        self.calls += 1
        return _Pending(h)

    @staticmethod
    def act(p):
        if type(p) is not _Pending:
            raise RuntimeError("bitsparse convert: activation_fn called outside fc1 → "
                               "activation_fn → fc2")
        p.activated = True
        return p

    def fc2(self, p):
        if type(p) is not _Pending or not p.activated:
            raise RuntimeError("bitsparse convert: fc2 called outside fc1 → activation_fn → fc2")
        self.calls -= 1
        return self.packed(p.x)


_SUBCLASSES: dict = {}


def _inline_class(cls):
    """A subclass of ``cls`` (cached) whose ``forward`` runs ``cls.forward`` with ``fc1``,
    ``activation_fn`` and ``fc2`` shadowed, during the call only, by instance attributes:
    ``fc1(h)`` returns a :class:`_Pending` holding ``h``, ``activation_fn`` marks it,
    ``fc2`` computes the packed FFN of ``h``. The registered modules (``_modules``) are
    untouched, so ``state_dict``, ``.to()``, ``parameters()`` and ``layer.fc1`` outside the
    forward see the original linears. A subclass rather than an instance attribute so
    that a checkpointing wrapper of the layer's class (transformers'
    ``GradientCheckpointingLayer`` wraps every subclass's ``forward``) recomputes through
    the same packed path."""
    if cls in _SUBCLASSES:
        return _SUBCLASSES[cls]
    original = cls.forward

    def forward(self, *args, **kwargs):
        d = self.__dict__
        linears = d["_modules"]   # not self.fc1: shadowed while a call is in this forward
        if not _packable(linears["fc1"], linears["fc2"]):
            return original(self, *args, **kwargs)
        stand_in = _StandIn(d["_bitsparse_packed"])
        saved = [(k, d[k]) for k in _SHADOWED if k in d]   # re-entered, or plain attributes
        d["fc1"], d["activation_fn"], d["fc2"] = stand_in.fc1, stand_in.act, stand_in.fc2
        try:
            out = original(self, *args, **kwargs)
        finally:
            for k in _SHADOWED:
                d.pop(k, None)
            d.update(saved)
        if stand_in.calls:
            raise RuntimeError("bitsparse convert: fc1 ran without fc2")
        return out

    def __reduce_ex__(self, protocol):
        # pickle names a class by module and qualname, and this one is made at run time:
        # name the original class instead and rebuild the subclass from it on load.
        return _new_inline, (cls,), self.__getstate__()

    forward.__doc__ = original.__doc__
    sub = type(f"Packed{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__,
                                                 "__qualname__": f"Packed{cls.__name__}",
                                                 "__reduce_ex__": __reduce_ex__})
    _SUBCLASSES[cls] = sub
    return sub


def _new_inline(cls):
    """An empty instance of ``_inline_class(cls)``, filled by ``__setstate__``: how pickle
    and ``copy.deepcopy`` rebuild a converted layer (``torch.load`` included)."""
    sub = _inline_class(cls)
    return sub.__new__(sub)


def _build_opt(m, **kwargs):
    kind = _activation_kind(m.activation_fn)
    if kind is None:
        raise Skip(f"activation_fn is {type(m.activation_fn).__name__}, not ReLU / ReLU²")
    src = inspect.getsource(type(m).forward)
    if not _INLINE.search(src):
        why = ("applies activation_dropout between activation_fn and fc2"
               if "activation_dropout" in src else
               "forward does not call fc1 → activation_fn → fc2 back to back")
        raise Skip(f"this transformers version's {type(m).__name__}.forward {why}")
    _check_linears(m.fc1, m.fc2)
    m.__dict__["_bitsparse_packed"] = _packed(kind, m.fc1, m.fc2, kwargs)
    m.__class__ = _inline_class(type(m))
    return m


RULES: list[Rule] = [
    Rule("opt", _is_opt_layer, _build_opt),
    Rule("t5", _is_t5_dense, _build_t5),
    Rule("sequential", _is_sequential_ffn, _build_sequential),
]
_USER_RULES: list[Rule] = []


def register_rule(name: str, predicate, builder) -> Rule:
    """Add a rule, tried before the built-in ones. ``builder(module, **kwargs)`` gets the
    keyword arguments of :func:`convert` (``encoding=``, ``density=``, ``margin=``,
    ``pending=``, ``backend=``, ``offload=``, ``initial_density=``); a typical builder
    checks the activation and dropout, then returns
    ``PackedBlock(module, "fc1_name", "fc2_name", "relu" | "relu2", **kwargs)``."""
    rule = Rule(name, predicate, builder)
    _USER_RULES.insert(0, rule)
    return rule


def unregister_rule(rule: Rule) -> None:
    """Remove a rule added by :func:`register_rule`."""
    _USER_RULES.remove(rule)


# --------------------------------------------------------------------------- convert

def _converted(m) -> bool:
    return isinstance(m, PackedBlock) or "_bitsparse_packed" in m.__dict__


def packed_modules(model: nn.Module) -> dict:
    """``{path: packed FFN}`` of every converted block or layer of ``model``, for their
    ``stats()`` (a converted OPT layer's packed FFN is not a registered submodule)."""
    return {p: m.packed if isinstance(m, PackedBlock) else m.__dict__["_bitsparse_packed"]
            for p, m in model.named_modules() if _converted(m)}


def _looks_like_ffn(m) -> bool:
    kids = list(m.children())
    return (sum(type(c) is nn.Linear for c in kids) >= 2
            and any(type(c).__module__ in ("torch.nn.modules.activation", "transformers.activations")
                    for c in kids))


def convert(model: nn.Module, *, rules=None, **kwargs) -> ConvertReport:
    """Convert, in place, every FFN of ``model`` a rule recognises to the packed path.

    ``kwargs`` (``encoding=``, ``density=``, ``margin=``, ``pending=``, ``backend=``,
    ``initial_density=``, ``offload=``: True or one :class:`~.offload.Offloader` all of them
    share) go to the packed modules. ``rules`` replaces the rule list (default: registered
    rules, then :data:`RULES`). Returns a :class:`ConvertReport`; calling it again converts nothing
    new. A module that replaced its parent's child is not searched further."""
    unknown = sorted(set(kwargs) - set(_PACKED_KW) - set(_GATED_KW))
    if unknown:
        raise TypeError(f"convert() got unexpected keyword arguments {unknown}; the packed "
                        f"modules take {sorted(set(_PACKED_KW) | set(_GATED_KW))}")
    rules = list(_USER_RULES) + list(RULES) if rules is None else list(rules)
    report = ConvertReport()

    def visit(module, path):
        for name, child in list(module.named_children()):
            p = f"{path}.{name}" if path else name
            if _converted(child):
                report.already.append(p)
                continue
            new = _apply(child, p)
            if new is None:
                visit(child, p)
            elif new is not child:
                setattr(module, name, new)

    def _apply(m, p):
        for rule in rules:
            if not rule.predicate(m):
                continue
            try:
                new = rule.builder(m, **kwargs)
            except Skip as why:
                report.skipped.append((p, rule.name, str(why)))
                return None
            packed = new.packed if isinstance(new, PackedBlock) else new.__dict__["_bitsparse_packed"]
            report.replaced.append((p, rule.name, type(packed).__name__))
            return new
        if _looks_like_ffn(m):
            report.unrecognised.append((p, type(m).__name__))
        return None

    if _converted(model):
        report.already.append("")
        return report
    new = _apply(model, "")
    if new is None:
        visit(model, "")
    elif new is not model:
        # A block rule would replace the module itself, which has no parent here: undo.
        _, rule, _ = report.replaced.pop()
        report.skipped.append(("", rule, "the root module itself: convert its parent"))
    return report
