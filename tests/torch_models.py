"""Models shared by the torch adapter tests: the plain PyTorch FFNs and their packed twins.

The dense models are ordinary PyTorch (``nn.Linear`` + ``torch.relu`` /
``torch.square`` / ``*``): the reference our modules must match bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from bitsparse_core.torch import PackedReGLUFFN, PackedReLU2FFN, PackedReLUFFN

KINDS = ("relu", "relu2", "reglu")
ENCODINGS = ("raw", "nosign", "signplane", "auto")


class DenseFFN(nn.Module):
    def __init__(self, kind, d, f, **kw):
        super().__init__()
        self.kind = kind
        if kind == "reglu":
            self.gate_proj = nn.Linear(d, f, **kw)
            self.up_proj = nn.Linear(d, f, **kw)
            self.down_proj = nn.Linear(f, d, **kw)
        else:
            self.fc1 = nn.Linear(d, f, **kw)
            self.fc2 = nn.Linear(f, d, **kw)

    def forward(self, x):
        if self.kind == "relu":
            return self.fc2(torch.relu(self.fc1(x)))
        if self.kind == "relu2":
            return self.fc2(torch.square(torch.relu(self.fc1(x))))
        return self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))


def packed_ffn(kind, d, f, encoding, **kw):
    cls = {"relu": PackedReLUFFN, "relu2": PackedReLU2FFN, "reglu": PackedReGLUFFN}[kind]
    return cls(d, f, encoding=encoding, **kw)


class Net(nn.Module):
    """A residual stack of FFNs and a linear head, wrapped optionally in checkpoints."""

    def __init__(self, blocks, d, checkpoint=None, **kw):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(d, d, **kw)
        self.checkpoint = checkpoint

    def forward(self, x):
        for blk in self.blocks:
            if self.checkpoint is None:
                x = x + blk(x)
            else:
                x = x + torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=self.checkpoint)
        return self.head(x)


def make_pair(kind, encoding, *, d=32, f=96, layers=2, dtype=torch.float32, device="cpu",
              seed=0, neg_bias=0.4, checkpoint=None):
    """(dense, ours) with identical parameters; pre-activation biases pushed negative so
    most activations are zero, as in trained ReLU FFNs."""
    torch.manual_seed(seed)
    kw = dict(dtype=dtype, device=device)
    dense = Net([DenseFFN(kind, d, f, **kw) for _ in range(layers)], d, checkpoint, **kw)
    with torch.no_grad():
        for blk in dense.blocks:
            first = blk.gate_proj if kind == "reglu" else blk.fc1
            first.bias.sub_(neg_bias)
    ours = Net([packed_ffn(kind, d, f, encoding, **kw) for _ in range(layers)], d, checkpoint,
               **kw)
    ours.load_state_dict(dense.state_dict())
    return dense, ours


def train(model, x, target, steps=3, lr=1e-2, autocast=None, eps=1e-8):
    """Losses, gradients and parameters after each step, as lists of detached clones."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, foreach=False)
    record = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if autocast is None:
            loss = (model(x).float() - target).pow(2).mean()
        else:
            with torch.autocast(x.device.type, dtype=autocast):
                loss = (model(x).float() - target).pow(2).mean()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        record.append((loss.detach().clone(), grads, params))
    return record


def assert_same_training(rec_a, rec_b):
    assert len(rec_a) == len(rec_b)
    for step, ((la, ga, pa), (lb, gb, pb)) in enumerate(zip(rec_a, rec_b)):
        assert torch.equal(la, lb), f"step {step}: loss {la.item()} != {lb.item()}"
        assert ga.keys() == gb.keys()
        for n in ga:
            assert ga[n].dtype == gb[n].dtype and torch.equal(ga[n], gb[n]), \
                f"step {step}: grad of {n} differs (max abs diff " \
                f"{(ga[n].float() - gb[n].float()).abs().max().item()})"
            assert torch.equal(pa[n], pb[n]), f"step {step}: parameter {n} differs"


def saved_tensors_of(fn):
    """Run ``fn()`` and return (its result, every tensor autograd saved meanwhile)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def relu_mlp(seed=0, d=32, f=128, shift=0.5):
    """A plain 3-layer ReLU MLP with biases shifted down so that most ReLU outputs are zero."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(d, f), nn.ReLU(), nn.Linear(f, f), nn.ReLU(), nn.Linear(f, d))
    with torch.no_grad():
        m[0].bias.sub_(shift)
        m[2].bias.sub_(0.3)
    return m


class Hooked(nn.Module):
    """Runs ``inner`` with the given saved-tensor hooks active."""

    def __init__(self, inner, hooks):
        super().__init__()
        self.inner, self.hooks = inner, hooks

    def forward(self, x):
        with self.hooks:
            return self.inner(x)
