"""A small GPT with a ReLU² MLP (modded-nanoGPT style) trained on real text, four ways.

The text is the Python standard library's own source files, read as bytes
(byte-level tokens, vocabulary 256): every machine with Python has it and
nobody here wrote it. The same model, initial weights and batches are trained

* ``dense``      -- plain PyTorch (the reference),
* ``checkpoint`` -- torch.utils.checkpoint around every MLP,
* ``ours-raw``, ``ours-nosign`` -- the MLP activation stored packed by
  bitsparse_core (``bitsparse_core.torch``), raw or sign-dropped values.

Per step it records the loss of each variant (ours must equal dense bit for
bit), each layer's activation sparsity, peak memory and step time, and writes
``bench/results/train_gpt.{json,md,png}``.

    python bench/train_gpt.py --steps 200            # on the GPU
    python bench/train_gpt.py --steps 5 --device cpu --small   # a quick CPU check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import bitsparse_core.torch as bst  # noqa: E402

VARIANTS = ("dense", "checkpoint", "ours-raw", "ours-nosign")


# ----------------------------------------------------------------------------- data
def stdlib_bytes(limit: int) -> np.ndarray:
    """Concatenated bytes of the standard library's .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)


def batches(data: np.ndarray, steps: int, batch: int, seq: int, seed: int):
    """The same (input, target) batches for every variant."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, data.size - seq - 1, size=batch)
        idx = starts[:, None] + np.arange(seq + 1)[None, :]
        block = torch.from_numpy(data[idx].astype(np.int64))
        yield block[:, :-1], block[:, 1:]


# ---------------------------------------------------------------------------- model
class MLP(nn.Module):
    """fc -> relu(.)² -> proj. ``mode`` picks how the activation is kept for backward."""

    def __init__(self, d: int, hidden: int, mode: str):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.proj = nn.Linear(hidden, d)
        self.mode = mode
        self.record = False          # dense mode: note the activation's zero fraction
        self.last_sparsity = float("nan")

    def forward(self, x):
        if self.mode.startswith("ours"):
            encoding = self.mode.split("-", 1)[1]
            y = bst.relu_ffn(x, self.fc.weight, self.fc.bias, self.proj.weight,
                             self.proj.bias, square=True, encoding=encoding)
        else:
            h = F.relu(self.fc(x))
            if self.record:
                self.last_sparsity = float((h == 0).float().mean())
            y = self.proj(h.square())
        return y


class Block(nn.Module):
    def __init__(self, d: int, heads: int, mode: str):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.mlp = MLP(d, 4 * d, mode)
        self.checkpoint = mode == "checkpoint"

    def attention(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # Written out (not SDPA) so the backward is deterministic on every device.
        att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // self.heads))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        h = self.norm2(x)
        if self.checkpoint:
            return x + torch.utils.checkpoint.checkpoint(self.mlp, h, use_reentrant=False)
        return x + self.mlp(h)


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, seq: int, mode: str):
        super().__init__()
        self.embed = nn.Embedding(256, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, mode) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, 256, bias=False)

    def forward(self, idx, targets=None, record=False):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            blk.mlp.record = record
            x = blk(x)
        logits = self.head(self.norm(x)).float()
        loss = F.cross_entropy(logits.view(-1, 256), targets.reshape(-1))
        return loss, [blk.mlp.last_sparsity for blk in self.blocks] if record else []


# --------------------------------------------------------------------------- training
def train(variant: str, args, data: np.ndarray, init_state: dict, device: torch.device):
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.d, args.heads, args.seq, variant).to(device)
    model.load_state_dict(init_state)
    model.to(dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0, foreach=False)
    losses, times, sparsity = [], [], []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for step, (x, y) in enumerate(batches(data, args.steps, args.batch, args.seq, args.seed)):
        x, y = x.to(device), y.to(device)
        record = variant == "dense" and step % args.sparsity_every == 0
        t0 = time.perf_counter()
        loss, sp = model(x, y, record=record)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if record:
            sparsity.append((step, sp))
    peak = torch.cuda.max_memory_allocated() if cuda else None
    params = [p.detach().float().cpu() for p in model.parameters()]
    return dict(losses=losses, times=times, sparsity=sparsity, peak_bytes=peak), params


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sparsity-every", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny model for a CPU check")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    if args.small:
        args.layers, args.d, args.heads, args.seq, args.batch = 2, 64, 2, 64, 4
    device = torch.device(args.device)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

    data = stdlib_bytes(limit=64 << 20)
    torch.manual_seed(args.seed)
    init_state = GPT(args.layers, args.d, args.heads, args.seq, "dense").state_dict()
    results, final_params = {}, {}
    for variant in args.variants.split(","):
        res, params = train(variant, args, data, init_state, device)
        results[variant] = res
        final_params[variant] = params
        peak = f"{res['peak_bytes'] / 2**20:.0f} MiB" if res["peak_bytes"] else "n/a"
        print(f"{variant:<12} final loss {res['losses'][-1]:.4f}  "
              f"median step {1e3 * statistics.median(res['times'][2:] or res['times']):.1f} ms  "
              f"peak {peak}", flush=True)

    dense = results["dense"]
    summary = {"config": {k: v for k, v in vars(args).items() if k != "out"},
               "tokens_of_text": int(data.size),
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "variants": {}}
    for name, res in results.items():
        summary["variants"][name] = {
            "median_step_ms": 1e3 * statistics.median(res["times"][2:] or res["times"]),
            "peak_mib": res["peak_bytes"] / 2**20 if res["peak_bytes"] else None,
            "final_loss": res["losses"][-1],
            "losses_bit_identical_to_dense": res["losses"] == dense["losses"],
            "params_bit_identical_to_dense": all(torch.equal(a, b) for a, b in
                                                 zip(final_params[name], final_params["dense"])),
        }
    summary["losses"] = {n: r["losses"] for n, r in results.items()}
    summary["sparsity"] = dense["sparsity"]
    write_reports(summary, Path(args.out))
    ok = all(v["losses_bit_identical_to_dense"] for n, v in summary["variants"].items()
             if n.startswith("ours"))
    print("losses of ours bit-identical to dense:", ok)
    return 0 if ok else 1


def write_reports(summary: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_gpt.json").write_text(json.dumps(summary, indent=1))
    cfg = summary["config"]
    lines = [f"# GPT with ReLU² MLP on Python stdlib bytes ({summary['device']})", "",
             f"{cfg['layers']} layers, d={cfg['d']}, seq={cfg['seq']}, batch={cfg['batch']}, "
             f"{cfg['steps']} steps, bf16.", "",
             "| variant | median step (ms) | peak memory (MiB) | final loss | losses = dense | params = dense |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, v in summary["variants"].items():
        peak = f"{v['peak_mib']:.0f}" if v["peak_mib"] else "-"
        lines.append(f"| {name} | {v['median_step_ms']:.1f} | {peak} | {v['final_loss']:.4f} | "
                     f"{'yes' if v['losses_bit_identical_to_dense'] else 'NO'} | "
                     f"{'yes' if v['params_bit_identical_to_dense'] else 'NO'} |")
    (out / "train_gpt.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, losses in summary["losses"].items():
        axes[0].plot(losses, label=name, lw=1)
    axes[0].set(title="training loss (ours overlaps dense exactly)", xlabel="step", ylabel="loss")
    axes[0].legend()
    if summary["sparsity"]:
        steps = [s for s, _ in summary["sparsity"]]
        per_layer = np.array([sp for _, sp in summary["sparsity"]])
        for layer in range(per_layer.shape[1]):
            axes[1].plot(steps, per_layer[:, layer], label=f"layer {layer}")
        axes[1].set(title="MLP activation sparsity (fraction of zeros)", xlabel="step")
        axes[1].legend(fontsize=7)
    names = list(summary["variants"])
    peaks = [summary["variants"][n]["peak_mib"] or 0 for n in names]
    times = [summary["variants"][n]["median_step_ms"] for n in names]
    axes[2].bar(names, peaks, color="tab:blue")
    axes[2].set(title="peak memory (MiB); step time (ms) in labels")
    for i, (p, t) in enumerate(zip(peaks, times)):
        axes[2].text(i, p, f"{t:.0f} ms", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "train_gpt.png", dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
