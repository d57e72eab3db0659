"""The demo's training comparison: a ReLU² FFN stack trained dense and packed.

Same initial weights, same batches, a few AdamW steps each; reports peak memory
(CUDA), median step time and whether every loss is bit-identical.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from .modules import PackedReLU2FFN


class _DenseReLU2FFN(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.fc1 = nn.Linear(d, f)
        self.fc2 = nn.Linear(f, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)).square())


def _stack(kind: str, layers: int, d: int, f: int, encoding: str) -> nn.Module:
    if kind == "dense":
        blocks = [_DenseReLU2FFN(d, f) for _ in range(layers)]
    else:
        blocks = [PackedReLU2FFN(d, f, encoding=encoding) for _ in range(layers)]
    return nn.Sequential(*blocks)


def _train(model, batches, device):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    losses, times = [], []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for x, target in batches:
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x).float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    times = times[1:] or times  # the first step is warm-up
    return losses, statistics.median(times), peak, times


def run(device: torch.device, steps: int = 6):
    cuda = device.type == "cuda"
    layers, d, f, tokens = (4, 1024, 4096, 8192) if cuda else (2, 64, 256, 256)
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator().manual_seed(0)
    # b1 shifted down so that most pre-activations are negative, as in trained models.
    batches = [(torch.randn(tokens, d, generator=gen).to(device, dtype),
                torch.randn(tokens, d, generator=gen).to(device)) for _ in range(steps)]
    torch.manual_seed(0)
    reference = _stack("dense", layers, d, f, "nosign")
    with torch.no_grad():
        for blk in reference:
            blk.fc1.bias.sub_(0.8 * blk.fc1.weight.norm(dim=1))
    state = reference.state_dict()
    rows = {}
    for kind, enc in (("dense", None), ("packed", "nosign"), ("packed", "raw")):
        model = _stack(kind, layers, d, f, enc or "nosign")
        model.load_state_dict(state)
        model.to(device, dtype)
        name = kind if enc is None else f"packed ({enc})"
        rows[name] = _train(model, batches, device)
    return dict(layers=layers, d=d, f=f, tokens=tokens, dtype=str(dtype).split(".")[-1],
                device=str(device), steps=steps, rows=rows)
