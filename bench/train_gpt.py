"""A GPT with a ReLU² MLP (modded-nanoGPT style; ``--ffn reglu``: a ReGLU MLP, the packed
one ``PackedReGLUFFN``) trained on real text, several ways.

The text is the Python standard library's own source files, read as bytes
(byte-level tokens, vocabulary 256): every machine with Python has it and
nobody here wrote it. In one process, from the same initial weights and on the
same batches, it trains

* ``dense``          -- plain PyTorch (the reference),
* ``checkpoint``     -- torch.utils.checkpoint around every MLP,
* ``ours-raw``, ``ours-nosign`` -- the MLP is ``bitsparse_core.torch.PackedReLU2FFN``
  (activation stored packed, raw or sign-dropped values); ``ours-recompute`` is
  ours-nosign recomputing, rather than waiting for, a count not back yet;
  ``ours-python`` is ours-nosign on the op's Python host path instead of its C++ one
  (``bitsparse_core.torch.native``),
* ``dense-compiled``, ``ours-compiled`` -- ``torch.compile`` of the dense and the
  ``ours-nosign`` model (compared with each other); ``ours-compiled-frozen`` is
  ours-compiled with its capacities frozen after its first ``FREEZE_AFTER`` steps
  (``bitsparse_core.torch.freeze_capacity``: one recompile, then no capacity symbols)
  and ``ours-compiled-recompute`` ours-compiled recomputing a count not back yet, neither
  in the default run,
* ``dense-graphed``, ``ours-graphed`` -- the same under ``torch.compile(mode=
  "reduce-overhead")`` (inductor's CUDA graphs; ours' ops run between them), compared with
  each other; not in the default run,
* ``dense-hooks`` -- the dense model under ``compress_saved_tensors`` (every saved
  tensor, not just the MLP's; packed without a host sync),
* ``ours-offload`` -- ours-nosign with the packed blocks in pinned host memory until
  backward (``offload=True``), ``ours-offload-hold0`` -- the same with an
  ``Offloader(hold=0)`` (no device block kept while its copy out runs),
  ``save-on-cpu`` -- the dense MLP under PyTorch's ``save_on_cpu`` (none of the three in
  the default run: ``--variants``).

Three modes, each writing JSON + Markdown + PNG under ``--out``:

* default: per variant the median step time, host time, peak memory, losses (bit
  for bit against the reference), and host syncs per step from torch.profiler
  (``train_gpt.*``);
* ``--bitident-steps N``: dense, ours-raw and ours-nosign for N steps with the
  deterministic math attention; losses and final parameters must equal dense's
  bit for bit (exit 1 otherwise) (``train_gpt_bitident.*``);
* ``--budget``: under a memory cap that dense does not fit at the preset batch,
  the largest batch each of dense / checkpoint / ours-nosign fits, and tokens/s
  of checkpoint and ours at the largest batch both fit (``train_gpt_budget.*``).

``--interleave N`` then runs N turns with every model resident (``interleaved.py``; one
step of each variant a turn, or ``--interleave-block`` steps in a row, with
``--interleave-streamed`` no device sync between them), and reports the ratios within
turns, each step's host time by phase and the packed modules' counters.

    python bench/train_gpt.py --preset gpt12 --out OUT          # on the GPU
    python bench/train_gpt.py --preset gpt12 --bitident-steps 200 --out OUT
    python bench/train_gpt.py --preset gpt12 --budget --out OUT
    python bench/train_gpt.py --device cpu --small --steps 3 --out /tmp/x   # CPU check
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import sysconfig
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bitsparse_core.torch as bst  # noqa: E402
from bitsparse_core.torch import native  # noqa: E402
from bitsparse_core.torch.offload import Offloader  # noqa: E402
import interleaved  # noqa: E402
from profile_syncs import profile_steps  # noqa: E402
from plotting import pyplot  # noqa: E402

START = time.monotonic()


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    d: int
    heads: int
    d_ff: int
    seq: int
    batch: int
    # the MLP: "relu2", fc2(relu(fc1(x))²); "reglu", down(relu(gate(x)) * up(x)), of
    # d_ff features (the same d_ff: a ReGLU MLP then has 1.5 times the parameters)
    ffn: str = "relu2"


FFNS = ("relu2", "reglu")

PRESETS = {
    "gpt6": Shape(layers=6, d=768, heads=6, d_ff=3072, seq=512, batch=32),
    "gpt12": Shape(layers=12, d=1024, heads=16, d_ff=4096, seq=1024, batch=8),
    # GPU-bound on the H200 (the host issues a step faster than the GPU runs it)
    "gpt16": Shape(layers=16, d=2048, heads=16, d_ff=8192, seq=2048, batch=8),
}
SMALL = Shape(layers=2, d=64, heads=2, d_ff=256, seq=64, batch=4)


@dataclasses.dataclass(frozen=True)
class Variant:
    mlp: str                  # "dense", or the encoding of the PackedReLU2FFN
    reference: str            # the variant whose losses/params this one must equal
    checkpoint: bool = False
    compiled: bool = False
    options: tuple = ()       # (name, value) pairs for the Packed module, beside --ours-kwargs
    hooks: bool = False       # the forward under compress_saved_tensors
    save_on_cpu: bool = False  # every MLP under torch.autograd.graph.save_on_cpu (pinned)
    python_host: bool = False  # the FFN op's Python host path (native.python_path)
    offload_hold: int | None = None   # an Offloader(hold=...) of the model's own
    freeze_after: int | None = None   # freeze_capacity after this many steps (FrozenAfter)
    compile_mode: str | None = None   # torch.compile's mode ("reduce-overhead": CUDA graphs)
    # the whole step (forward, backward, a capturable AdamW) captured once with
    # torch.cuda.graph and replayed: "on", or "recompute" (captured without conditional
    # nodes, so that every backward recomputes, as before session 59)
    step_graph: str | None = None


# Steps ours-compiled-frozen runs adaptive before it freezes (within every mode's warm-up).
FREEZE_AFTER = 2

VARIANTS = {
    "dense": Variant("dense", "dense"),
    "checkpoint": Variant("dense", "dense", checkpoint=True),
    "ours-raw": Variant("raw", "dense"),
    "ours-nosign": Variant("nosign", "dense"),
    # the same with the op's host path in Python rather than C++ (bitsparse_core.torch.native)
    "ours-python": Variant("nosign", "dense", python_host=True),
    # a pending count recomputes instead of being waited for (CapacityPolicy.pending)
    "ours-recompute": Variant("nosign", "dense", options=(("pending", "recompute"),)),
    "dense-compiled": Variant("dense", "dense-compiled", compiled=True),
    "ours-compiled": Variant("nosign", "dense-compiled", compiled=True),
    # the same with the capacities frozen once the densities are known (opt-in)
    "ours-compiled-frozen": Variant("nosign", "dense-compiled", compiled=True,
                                    freeze_after=FREEZE_AFTER),
    # compiled, a pending count recomputed rather than waited for (opt-in)
    "ours-compiled-recompute": Variant("nosign", "dense-compiled", compiled=True,
                                       options=(("pending", "recompute"),)),
    # torch.compile(mode="reduce-overhead"): inductor's CUDA graphs, dense and ours
    "dense-graphed": Variant("dense", "dense-graphed", compiled=True,
                             compile_mode="reduce-overhead"),
    "ours-graphed": Variant("nosign", "dense-graphed", compiled=True,
                            compile_mode="reduce-overhead"),
    # the whole step in one CUDA graph of the user's own (StepGraph)
    "dense-stepgraph": Variant("dense", "dense-stepgraph", step_graph="on"),
    "ours-stepgraph": Variant("nosign", "dense-stepgraph", step_graph="on"),
    "ours-stepgraph-recompute": Variant("nosign", "dense-stepgraph", step_graph="recompute"),
    "dense-hooks": Variant("dense", "dense", hooks=True),
    # the packed blocks in pinned host memory between forward and backward (issue 17),
    # against PyTorch's own offload of the dense MLP's saved tensors
    "ours-offload": Variant("nosign", "dense", options=(("offload", True),)),
    # every device block released as soon as its copy out is queued (no block held)
    "ours-offload-hold0": Variant("nosign", "dense", offload_hold=0),
    "save-on-cpu": Variant("dense", "dense", save_on_cpu=True),
}
# opt-in variants (issue 17): host memory and the host link
OFFLOAD_VARIANTS = ("ours-offload", "ours-offload-hold0", "save-on-cpu")
OPT_IN_VARIANTS = OFFLOAD_VARIANTS + ("ours-compiled-frozen", "ours-compiled-recompute",
                                      "dense-graphed", "ours-graphed", "dense-stepgraph",
                                      "ours-stepgraph", "ours-stepgraph-recompute")
# Eager steps a StepGraph runs before its capture, each on its own batch: enough backwards
# for an adaptive capacity to have polled its counts and settled over the batches' spread
# (the capture keeps the capacity it finds). A run with step graphs warms up past them,
# with a few replays more for adapt_to_replays to act on.
STEP_GRAPH_SETTLE = 16
STEP_GRAPH_WARMUP = STEP_GRAPH_SETTLE + 4
BITIDENT_VARIANTS = ("dense", "ours-raw", "ours-nosign", "ours-offload", "ours-offload-hold0")
BUDGET_VARIANTS = ("dense", "checkpoint", "ours-nosign")
# Profile rows of the library's own ops (CPU self time per op).
OWN_OPS = ("bitsparse",)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Steps of one variant run: warm-up (untimed), timed, then profiled (no per-step sync)."""
    warmup: int
    timed: int
    profiled: int = 0

    @property
    def total(self) -> int:
        return self.warmup + self.timed + self.profiled


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


def make_batches(data: np.ndarray, steps: int, batch: int, seq: int, seed: int) -> list:
    """The same (input, target) CPU batches for every variant."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        starts = rng.integers(0, data.size - seq - 1, size=batch)
        block = torch.from_numpy(data[starts[:, None] + np.arange(seq + 1)].astype(np.int64))
        out.append((block[:, :-1], block[:, 1:]))
    return out


# ---------------------------------------------------------------------------- model
class DenseReLU2FFN(nn.Module):
    """fc2(relu(fc1(x))²) in plain PyTorch, with PackedReLU2FFN's parameter names."""

    def __init__(self, d: int, d_ff: int):
        super().__init__()
        self.fc1 = nn.Linear(d, d_ff)
        self.fc2 = nn.Linear(d_ff, d)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)).square())


class DenseReGLUFFN(nn.Module):
    """down_proj(relu(gate_proj(x)) * up_proj(x)) in plain PyTorch, with PackedReGLUFFN's
    parameter names."""

    def __init__(self, d: int, d_ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, d_ff)
        self.up_proj = nn.Linear(d, d_ff)
        self.down_proj = nn.Linear(d_ff, d)

    def forward(self, x):
        return self.down_proj(F.relu(self.gate_proj(x)) * self.up_proj(x))


def make_mlp(kind: str, shape: Shape, ours_kwargs: dict) -> nn.Module:
    """Every variant's MLP is built here (``shape.ffn`` picks ReLU² or ReGLU), so options
    of the Packed module (``--ours-kwargs``) reach each ours variant the same way."""
    gated = shape.ffn == "reglu"
    if kind == "dense":
        return (DenseReGLUFFN if gated else DenseReLU2FFN)(shape.d, shape.d_ff)
    packed = bst.PackedReGLUFFN if gated else bst.PackedReLU2FFN
    return packed(shape.d, shape.d_ff, encoding=kind, **ours_kwargs)


def first_linear(mlp: nn.Module) -> nn.Linear:
    """The linear whose output the MLP's ReLU takes (fc1, or the gate)."""
    return mlp.gate_proj if hasattr(mlp, "gate_proj") else mlp.fc1


class Block(nn.Module):
    def __init__(self, shape: Shape, mlp: nn.Module, checkpoint: bool, save_on_cpu: bool = False,
                 python_host: bool = False):
        super().__init__()
        self.python_host = python_host
        self.heads = shape.heads
        self.norm1 = nn.RMSNorm(shape.d)
        self.qkv = nn.Linear(shape.d, 3 * shape.d, bias=False)
        self.out = nn.Linear(shape.d, shape.d, bias=False)
        self.norm2 = nn.RMSNorm(shape.d)
        self.mlp = mlp
        self.checkpoint = checkpoint
        self.save_on_cpu = save_on_cpu

    def attention(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        h = self.norm2(x)
        if self.checkpoint:
            return x + torch.utils.checkpoint.checkpoint(self.mlp, h, use_reentrant=False)
        if self.save_on_cpu:
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return x + self.mlp(h)
        if self.python_host:
            with native.python_path():
                return x + self.mlp(h)
        return x + self.mlp(h)


class GPT(nn.Module):
    def __init__(self, shape: Shape, variant: Variant, ours_kwargs: dict):
        super().__init__()
        self.embed = nn.Embedding(256, shape.d)
        self.pos = nn.Embedding(shape.seq, shape.d)
        options = {**ours_kwargs, **dict(variant.options)}
        if variant.offload_hold is not None:     # one offloader for the model's layers
            options["offload"] = Offloader(hold=variant.offload_hold)
        self.blocks = nn.ModuleList(
            Block(shape, make_mlp(variant.mlp, shape, options), variant.checkpoint,
                  variant.save_on_cpu, variant.python_host)
            for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.d)
        self.head = nn.Linear(shape.d, 256, bias=False)
        # one hooks object for every step, entered once per forward: its save sites learn
        self.saved_hooks = bst.compress_saved_tensors() if variant.hooks else None

    def forward(self, idx, targets):
        with self.saved_hooks if self.saved_hooks is not None else contextlib.nullcontext():
            x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.norm(x)).float()
            return F.cross_entropy(logits.view(-1, 256), targets.reshape(-1))


def initial_state(shape: Shape, seed: int) -> dict:
    """The one set of initial weights (on the CPU, so it does not depend on the device)."""
    torch.manual_seed(seed)
    return GPT(shape, VARIANTS["dense"], {}).state_dict()


def load_init(model: nn.Module, init_state: dict) -> None:
    """Load the shared initial weights; a module option may add buffers of its own, but
    every parameter must come from ``init_state``."""
    missing, unexpected = model.load_state_dict(init_state, strict=False)
    params = dict(model.named_parameters())
    unset = [k for k in missing if k in params]
    if unset or unexpected:
        raise RuntimeError(f"initial state does not fit: unset {unset}, unexpected {unexpected}")


# -------------------------------------------------------------------------- running
class TimeLimit(Exception):
    """The wall-clock budget (--time-limit) ran out."""


@dataclasses.dataclass
class Bench:
    """What every variant run shares: options, data, initial weights (and, after
    ``--pretrain-steps``, the optimizer's state), device, deadline."""
    args: argparse.Namespace
    shape: Shape
    data: np.ndarray
    init_state: dict
    device: torch.device
    init_opt_state: dict | None = None

    def check_time(self, where: str) -> None:
        if self.remaining() <= 0:
            raise TimeLimit(where)

    def remaining(self) -> float:
        return self.args.time_limit - (time.monotonic() - START)


def attention_backend(name: str):
    """SDPA as PyTorch picks it ('auto': a fused kernel, cuDNN's on an H200), or the math
    backend, whose backward is deterministic (the fused ones' need not be under
    warn-only determinism)."""
    return sdpa_kernel(SDPBackend.MATH) if name == "math" else contextlib.nullcontext()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Drop what the last variant left (compiled graphs, cached blocks) before the next."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build(bench: Bench, name: str):
    """The variant's model (bf16, from the shared initial weights), what to call, and its optimizer."""
    variant = VARIANTS[name]
    with bench.device:
        model = GPT(bench.shape, variant, bench.args.ours_kwargs)
    load_init(model, bench.init_state)
    model.to(dtype=torch.bfloat16)
    # AdamW's default implementation on CUDA (foreach), as users run it
    opt = torch.optim.AdamW(model.parameters(), lr=bench.args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0, capturable=variant.step_graph is not None)
    if bench.init_opt_state is not None:     # a copy: on the CPU the optimizer would keep
        opt.load_state_dict(_to_cpu(bench.init_opt_state))   # these tensors and step them
        if variant.step_graph is not None:   # the loaded groups say not capturable
            make_capturable(opt)
    call = model
    if variant.compiled:
        call = torch.compile(model, fullgraph=bench.args.compile_fullgraph,
                             mode=variant.compile_mode)
    if variant.compile_mode == "reduce-overhead":
        call = GraphedCall(call)
    if variant.freeze_after is not None:
        call = FrozenAfter(call, model, variant.freeze_after)
    return model, call, opt


def make_capturable(opt: torch.optim.Optimizer) -> None:
    """An optimizer whose state was loaded from a non-capturable one, made capturable: the
    flag set on every group and each ``step`` count moved to its parameter's device as
    float32 (as a capturable optimizer keeps it)."""
    for group in opt.param_groups:
        group["capturable"] = True
        for p in group["params"]:
            state = opt.state.get(p)
            if state and "step" in state:
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32,
                                                device=p.device)


class StepGraph:
    """A whole training step captured with ``torch.cuda.graph`` and replayed, as a user who
    graphs the step does: the first ``settle`` calls run eager steps on a side stream
    (torch.cuda.graph's warm-up; an adaptive capacity settles meanwhile on the densities
    of those calls' batches, and the capture keeps the one it finds), the next captures the
    step on static inputs; every call from then on copies its batch in and replays.
    ``recompute``: capture without conditional nodes (every packed backward in the graph
    recomputes). Each call returns the step's loss.

    After each replay it asks ``bitsparse_core.torch.adapt_to_replays`` whether earlier
    replays recomputed (a batch denser than the capture's capacity): where a capacity
    moved up, the next call captures the step again, as the function's docstring tells a
    user to. ``recaptures`` counts them."""

    def __init__(self, model, opt, settle: int, recompute: bool = False):
        self.model, self.opt, self.settle, self.recompute = model, opt, settle, recompute
        self.graph = self.static = None
        self.calls = self.recaptures = 0

    @classmethod
    def of(cls, name: str, model, opt):
        """The variant's StepGraph, or None for a variant that is not captured whole."""
        mode = VARIANTS[name].step_graph
        return None if mode is None else cls(model, opt, STEP_GRAPH_SETTLE, mode == "recompute")

    def __call__(self, x, y):
        self.calls += 1
        if self.calls <= self.settle:
            return self._eager(x, y)
        if self.graph is None:
            self._capture(x, y)
        sx, sy, loss = self.static
        sx.copy_(x)
        sy.copy_(y)
        self.graph.replay()
        loss = loss.clone()
        # the replays' counters are pinned host memory: reading them makes no CUDA call
        if not self.recompute and bst.adapt_to_replays(self.model):
            self.graph = None
            self.recaptures += 1
        return loss

    def _eager(self, x, y):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loss = train_step(self.model, self.opt, x, y)
        torch.cuda.current_stream().wait_stream(side)
        return loss

    def _capture(self, x, y) -> None:
        if self.static is None:
            sx, sy = x.clone(), y.clone()
        else:       # captured again: the static inputs stay, the old graph goes first
            sx, sy, _ = self.static
            self.static = None
        self.graph = torch.cuda.CUDAGraph()
        scope = native.no_conditional_nodes() if self.recompute else contextlib.nullcontext()
        with scope, torch.cuda.graph(self.graph):
            loss = train_step(self.model, self.opt, sx, sy)
        self.static = (sx, sy, loss)


class GraphedCall:
    """A ``reduce-overhead`` model's call as a training loop makes it: each call starts a
    new step of inductor's CUDA graph trees, and the loss is copied out of the graph's
    static output (the next replay writes over it; the bench keeps every step's loss)."""

    def __init__(self, call):
        self.call = call

    def __call__(self, *args):
        torch.compiler.cudagraph_mark_step_begin()
        return self.call(*args).clone()


class FrozenAfter:
    """A model's call that freezes the model's packed capacities
    (``bitsparse_core.torch.freeze_capacity``) before its call number ``steps`` + 1: the
    first ``steps`` steps adapt them, as a user would let a run settle before freezing."""

    def __init__(self, call, model, steps: int):
        self.call, self.model, self.steps, self.calls = call, model, steps, 0

    def __call__(self, *args):
        if self.calls == self.steps:
            from bitsparse_core.torch import freeze_capacity
            freeze_capacity(self.model)
        self.calls += 1
        return self.call(*args)


def train_step(model, opt, x, y, marks: list | None = None,
               held: list | None = None) -> torch.Tensor:
    """One whole step: forward, backward, optimizer. Returns the loss, left on the device.
    ``marks``: gets the host clock after the forward and after the backward. ``held``
    (CUDA): gets the bytes allocated after the forward less those at the step's start,
    what the forward keeps for the backward (no sync: the allocator's own count)."""
    start = torch.cuda.memory_allocated(x.device) if held is not None else 0
    loss = model(x, y)
    if held is not None:
        held.append(torch.cuda.memory_allocated(x.device) - start)
    if marks is not None:
        marks.append(time.perf_counter())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if marks is not None:
        marks.append(time.perf_counter())
    opt.step()
    return loss.detach()


@torch.no_grad()
def probe_sparsity(model: GPT, x, y) -> list:
    """Each layer's fraction of zeros in relu(fc1(x)) (the gate's, in a ReGLU MLP), from a
    forward pass outside the timed step (a probe inside it would add kernels and syncs to
    the reference)."""
    fractions = []
    hooks = [first_linear(blk.mlp).register_forward_hook(
        lambda mod, inp, out: fractions.append((F.relu(out) == 0).float().mean()))
        for blk in model.blocks]
    try:
        model(x, y)
    finally:
        for h in hooks:
            h.remove()
    return [float(f) for f in fractions]


def run_variant(bench: Bench, name: str, batches: list, plan: Plan):
    """Train one variant on ``batches`` by ``plan``; returns its results and final parameters."""
    device, args = bench.device, bench.args
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, call, opt = build(bench, name)
    probe = name == "dense" and args.sparsity_every > 0 and not args.budget
    losses, times, host, phases, sparsity, first_step_s = [], [], [], [], [], None
    held = [] if device.type == "cuda" else None

    stepper = StepGraph.of(name, model, opt)

    def step(x, y, marks=None, held=None):
        if stepper is None:
            return train_step(call, opt, x, y, marks, held)
        loss = stepper(x, y)   # one replay: no phases, no forward's own allocation
        if marks is not None:
            marks += [time.perf_counter()] * 2
        return loss

    compiles, compiled_before, warmup_peak = {}, None, None
    with attention_backend(args.attn):
        for i, (x, y) in enumerate(batches[:plan.warmup + plan.timed]):
            if i == plan.warmup:
                compiled_before = graphs_compiled()
                warmup_peak = peak_mib(device)
                if device.type == "cuda":   # the timed steps' own peak, apart from the first steps'
                    torch.cuda.reset_peak_memory_stats(device)
            bench.check_time(f"{name} at step {i}")
            x, y = x.to(device), y.to(device)
            sync(device)
            marks = []
            t0 = time.perf_counter()
            losses.append(step(x, y, marks, held if i >= plan.warmup else None))
            t1 = time.perf_counter()
            sync(device)
            t2 = time.perf_counter()
            first_step_s = first_step_s or t2 - t0
            if i >= plan.warmup:
                times.append(t2 - t0)
                host.append(t1 - t0)
                phases.append((marks[0] - t0, marks[1] - marks[0], t1 - marks[1]))
            if probe and i % args.sparsity_every == 0:
                sparsity.append((i, probe_sparsity(model, x, y)))
        if compiled_before is not None:
            compiles["timed"] = graphs_compiled() - compiled_before
        timed_peak = peak_mib(device)
        syncs = None
        if plan.profiled:
            compiles["profiled"] = -graphs_compiled()
            bench.check_time(f"{name} before profiling")
            on_device = [(x.to(device), y.to(device)) for x, y in batches[plan.warmup + plan.timed:]]
            trace = (Path(args.out) / f"train_gpt_{name}_trace.json.gz"
                     if name in args.trace.split(",") else None)
            if trace is not None:
                trace.parent.mkdir(parents=True, exist_ok=True)
            prof_losses, syncs = profile_steps(step, on_device, device, OWN_OPS, trace=trace,
                                               kernel_rows=args.kernel_rows)
            sync(device)
            compiles["profiled"] += graphs_compiled()
            losses += prof_losses
    res = {
        "status": "ok",
        "batch": batches[0][0].shape[0],
        "median_step_ms": 1e3 * statistics.median(times) if times else None,
        "median_host_ms": 1e3 * statistics.median(host) if host else None,
        # host time to issue the forward, the backward and the optimizer step
        "median_host_phase_ms": [1e3 * statistics.median(p) for p in zip(*phases)] if phases
        else None,
        "first_step_s": first_step_s,
        # the whole run's peak, and the timed steps' alone (a packed module's first steps,
        # before any count has come back, take the full capacity unless initial_density=)
        "peak_mib": max(warmup_peak or 0, timed_peak or 0) or None,
        "timed_peak_mib": timed_peak,
        # what the forward keeps for the backward (allocated after it less before it)
        "after_forward_mib": statistics.median(held) / 2**20 if held else None,
        "losses": torch.stack(losses).float().cpu().tolist(),
        "syncs": syncs,
        "sparsity": sparsity,
        # graphs torch.compile compiled in the timed and in the profiled steps (a capacity
        # bucket that moved recompiles once; its time and the compiler's syncs land there)
        "compiles": compiles,
    }
    if args.cprofile_steps and device.type == "cuda":
        res["cprofile"] = cprofile_steps(step, batches[:args.cprofile_steps], device)
    res["capacity"] = capacity_stats(model, plan.total + (args.cprofile_steps or 0))
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return res, params


def pretrain(bench: Bench, steps: int) -> dict:
    """Train the dense model ``steps`` steps on batches of their own and make its weights
    and optimizer state every variant's starting point: a run in progress rather than
    its first step. The MLP's activations grow sparser as a ReLU² model trains (about half
    zeros at initialization; trained models: 85-95 %), and the packed block, the
    pack's and unpack's bytes with it, shrink. Returns what the summary records."""
    t0 = time.monotonic()
    s, device = bench.shape, bench.device
    model, _, opt = build(bench, "dense")
    batches = make_batches(bench.data, steps, s.batch, s.seq, bench.args.seed + 1)
    loss = None
    with attention_backend(bench.args.attn):
        for i, (x, y) in enumerate(batches):
            bench.check_time(f"pretraining at step {i}")
            loss = train_step(model, opt, x.to(device), y.to(device))
        zeros = probe_sparsity(model, x.to(device), y.to(device)) if steps else []
    bench.init_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    bench.init_opt_state = _to_cpu(opt.state_dict())
    out = {"steps": steps, "seconds": time.monotonic() - t0,
           "final_loss": float(loss) if loss is not None else None, "mlp_zeros": zeros}
    del model, opt
    free_memory(device)
    return out


def _to_cpu(obj):
    """A copy of a state dict with every tensor on the CPU (a variant's build moves it back)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def peak_mib(device: torch.device) -> float | None:
    """The allocator's peak since its last reset, MiB (None off CUDA)."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def graphs_compiled() -> int:
    """How many graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def cprofile_steps(step, batches, device: torch.device, top: int = 45) -> str:
    """The Python functions that take the host's time in a few steps (cProfile,
    sorted by own time, then by cumulative time), with no sync between the steps."""
    import cProfile
    import io
    import pstats
    on_device = [(x.to(device), y.to(device)) for x, y in batches]
    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for x, y in on_device:
        step(x, y)
    prof.disable()
    sync(device)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    buf.write("\nBy cumulative time:\n")
    stats.sort_stats("cumulative").print_stats(top)
    return f"{len(on_device)} steps\n" + buf.getvalue()


def capacity_stats(model: nn.Module, steps: int) -> dict | None:
    """The packed modules' counters summed over layers, per step: backwards that
    recomputed (``unknown``: the count had not come back yet) and overflows; and where
    their capacities stand at the end."""
    stats = [p.stats() for p in bst.capacity_policies(model)]
    if not stats:
        return None
    out = {f"{k}_per_step": v / steps for k, v in policy_counters(stats).items() if k != "packs"}
    out["max_density"] = max(st["max_density"] for st in stats)
    # where the capacities stand at the end: the largest layer's, and whether frozen
    out["capacity_density"] = max(st["capacity_density"] for st in stats)
    out["frozen"] = all(st["frozen"] for st in stats)
    return out


def is_oom(exc: BaseException) -> bool:
    """torch's OOM, or a library's (cuBLAS/cuDNN workspace, CuPy) that says the same."""
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "alloc_failed" in text


def guarded(bench: Bench, name: str, batches: list, plan: Plan):
    """``run_variant``, with a compile failure, an OOM or the time limit recorded as the
    variant's status instead of ending the whole run; memory is freed either way."""
    try:
        return run_variant(bench, name, batches, plan)
    except TimeLimit as exc:
        return {"status": f"skipped: time limit ({exc})"}, None
    except Exception as exc:  # noqa: BLE001 - any failure of one variant is its result
        kind = "oom" if is_oom(exc) else "error"
        return {"status": f"{kind}: {type(exc).__name__}: {str(exc)[:500]}",
                "traceback": traceback.format_exc()[-4000:]}, None
    finally:
        free_memory(bench.device)


def compare(res: dict, ref: dict, params: dict, ref_params: dict) -> None:
    """Add to ``res`` whether its losses and final parameters equal the reference's, bit for bit."""
    a, b = res["losses"], ref["losses"]
    res["losses_bit_identical"] = a == b
    res["max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(a, b))
    res["params_bit_identical"] = (ref_params.keys() <= params.keys()
                                   and all(torch.equal(params[n], p) for n, p in ref_params.items()))


def add_ratios(results: dict) -> None:
    """Step time relative to dense, and to the variant's reference where that is another;
    with several rounds also per round (each ratio between runs close in time), and the
    median of those."""
    def ratio(name, ref):
        t, r = results[name].get("median_step_ms"), results.get(ref, {}).get("median_step_ms")
        return t / r if t and r else None
    dense_rounds = results.get("dense", {}).get("round_step_ms") or []
    for name, res in results.items():
        res["step_ratio_vs_dense"] = ratio(name, "dense")
        res["step_ratio_vs_reference"] = ratio(name, VARIANTS[name].reference)
        rounds = res.get("round_step_ms") or []
        per = [t / d for t, d in zip(rounds, dense_rounds) if t and d]
        if len(per) > 1:
            res["round_ratio_vs_dense"] = per
            res["median_round_ratio_vs_dense"] = statistics.median(per)


def _another_round(res: dict, again: dict) -> None:
    """Fold a later round's step times into the first round's results."""
    res.setdefault("round_step_ms", [res.get("median_step_ms")])
    res["round_step_ms"].append(again.get("median_step_ms") if again.get("status") == "ok"
                                else None)


def run_variants(bench: Bench, names: list, plan: Plan, report, rounds: int = 1) -> dict:
    """Run the variants in order on the same batches, comparing each with its reference;
    ``report(results)`` is called after each, so a cut-off run leaves its results written.
    ``rounds`` > 1 runs the whole sequence again (fresh models, same batches) for timing
    only: the host's speed drifts over minutes, and a ratio between runs made next to
    each other shows less of it. Peaks and bit identity are the first round's."""
    s = bench.shape
    batches = make_batches(bench.data, plan.total, s.batch, s.seq, bench.args.seed)
    references = {VARIANTS[n].reference for n in names}
    results, ref_params, longest = {}, {}, 0.0
    for rnd in range(rounds):
        for name in names:
            if bench.remaining() < longest:
                res, params = {"status": "skipped: time limit"}, None
            else:
                t0 = time.monotonic()
                res, params = guarded(bench, name, batches, plan if rnd == 0
                                      else Plan(plan.warmup, plan.timed))
                res["wall_s"] = time.monotonic() - t0
                longest = max(longest, res["wall_s"])
            if rnd > 0:
                _another_round(results[name], res)
            else:
                ref = VARIANTS[name].reference
                if params is not None and name in references:
                    ref_params[name] = params
                if params is not None and ref in ref_params and ref != name:
                    compare(res, results[ref], params, ref_params[ref])
                results[name] = res
            del params
            add_ratios(results)
            print_variant(name, results[name])
            report(results)
    return results


def run_interleaved(bench: Bench, names: list, turns: int, warmup: int, block: int = 1,
                    step_sync: bool = True) -> dict:
    """Every variant built at once from the same initial weights, then ``turns`` turns of
    ``block`` steps each, with or without a device sync between them (``step_sync``;
    :func:`interleaved.run_variants`); ratios to dense, and each variant's to its own
    reference; the timed steps' host time per phase and the packed modules' counters over
    the steps after the warm-up turns."""
    device, s = bench.device, bench.shape
    batches = [(x.to(device), y.to(device)) for x, y in
               make_batches(bench.data, min((turns + warmup) * block, 16), s.batch, s.seq,
                            bench.args.seed)]
    phases, policies, at_warmup, steppers = {}, {}, {}, {}

    def make_step(name):
        model, call, opt = build(bench, name)
        clocks = phases[name] = []
        pols = policies[name] = bst.capacity_policies(model)

        stepper = steppers[name] = StepGraph.of(name, model, opt)

        def step(i):
            t0, marks = time.perf_counter(), []
            if stepper is not None:     # no phases inside a replay: the whole step as one
                loss = stepper(*batches[i % len(batches)])
                marks = [time.perf_counter()] * 2
            else:
                loss = train_step(call, opt, *batches[i % len(batches)], marks=marks)
            clocks.append((t0, *marks, time.perf_counter()))
            if len(clocks) == warmup * block and pols:   # the last warm-up step: not timed
                at_warmup[name] = policy_counters([p.stats() for p in pols])
            return loss
        return step
    compiled_before = graphs_compiled()
    with attention_backend(bench.args.attn):
        result = interleaved.run_variants(names, make_step, "dense", turns, warmup,
                                          lambda: sync(device), bench.check_time,
                                          {n: VARIANTS[n].reference for n in names},
                                          cleanup=lambda: free_memory(device), block=block,
                                          step_sync=step_sync)
    # one graph per compiled variant where nothing recompiled (a capacity move must not)
    result["graphs_compiled"] = graphs_compiled() - compiled_before
    timed = [j for t in range(warmup, warmup + result.get("turns", 0))
             for j in interleaved.timed_steps(t, warmup, block)]
    for name, rec in result.get("variants", {}).items():
        clocks = phases.get(name, [])
        rec["host_phases_ms"] = host_phases_ms([clocks[j] for j in timed if j < len(clocks)])
        if policies.get(name) and name in at_warmup:
            after = policy_counters([p.stats() for p in policies[name]])
            start = at_warmup[name]
            steps = len(clocks) - warmup * block
            rec["capacity"] = {f"{k}_per_step": (after[k] - start[k]) / steps for k in after}
            if steppers.get(name) is not None:   # over the whole run, warm-up turns included
                rec["capacity"]["recaptures"] = steppers[name].recaptures
    return result


def host_phases_ms(clocks: list) -> dict | None:
    """Median host ms of a step's forward, backward and the rest (optimizer step) from
    ``(start, after forward, after backward, end)`` clocks of the steps."""
    if not clocks:
        return None
    return {phase: 1e3 * statistics.median(c[k + 1] - c[k] for c in clocks)
            for k, phase in enumerate(("forward", "backward", "optimizer"))}


def policy_counters(stats: list) -> dict:
    """The counters of capacity policies' ``stats()`` summed: packs, backwards that
    recomputed (``unknown``: the count had not come back yet; ``replay_recomputes``: in
    replays of CUDA graphs), overflows, waits for a count and their seconds."""
    return {k: sum(st[k] for st in stats)
            for k in ("packs", "recomputes", "replay_recomputes", "unknown", "overflows", "waits",
                      "wait_s")}


def print_variant(name: str, res: dict) -> None:
    if res["status"] != "ok":
        print(f"{name:<15} {res['status'][:300]}", flush=True)
        return
    peak = f"{res['peak_mib']:.0f} MiB" if res["peak_mib"] else "n/a"
    ident = {None: "", True: "  = reference", False: "  != reference"}[res.get("losses_bit_identical")]
    step = f"{res['median_step_ms']:.1f} ms" if res["median_step_ms"] else "n/a"
    print(f"{name:<15} final loss {res['losses'][-1]:.4f}  median step {step}  "
          f"peak {peak}{ident}", flush=True)


# --------------------------------------------------------------------------- budget
def largest_batch(fits, start: int, tries: int):
    """The largest batch b >= 1 with ``fits(b)``: double (or halve) from ``start`` until
    the answer flips, then bisect. At most ``tries`` calls, so when they run out the
    answer is the largest seen to fit (0: none did)."""
    lo, hi, b, calls = 0, None, start, 0
    while calls < tries:
        calls += 1
        if fits(b):
            lo = b
        else:
            hi = b
        b = 2 * lo if hi is None else (hi // 2 if lo == 0 else (lo + hi) // 2)
        if b in (0, lo):
            break
    return lo


def budget(bench: Bench, report) -> dict:
    """Largest batch of dense / checkpoint / ours-nosign under a memory cap that dense does
    not fit at the preset batch (``--budget-factor`` of dense's peak there), and tokens/s of
    checkpoint and ours at the largest batch both fit."""
    args, device, s = bench.args, bench.device, bench.shape
    fit_plan, speed_plan = Plan(warmup=1, timed=2), Plan(warmup=args.warmup, timed=args.steps)
    found = {"tries": {n: {} for n in BUDGET_VARIANTS}, "largest_batch": {}, "throughput": {}}

    def attempt(name, batch, plan):
        batches = make_batches(bench.data, plan.total, batch, s.seq, args.seed)
        res, _ = guarded(bench, name, batches, plan)
        res.pop("losses", None)
        return res

    def fits(name):
        def fit(batch):
            res = attempt(name, batch, fit_plan)
            found["tries"][name][batch] = {"status": res["status"], "peak_mib": res.get("peak_mib")}
            report(found)
            if res["status"] == "ok" or res["status"].startswith("oom"):
                return res["status"] == "ok"
            raise RuntimeError(f"{name} at batch {batch}: {res['status']}")
        return fit

    ref = attempt("dense", s.batch, fit_plan)
    if ref["status"] != "ok":
        found["error"] = f"dense at batch {s.batch}: {ref['status']}"
        return found
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = args.budget_factor * ref["peak_mib"] * 2**20 / total
    found.update(dense_peak_mib_at_preset_batch=ref["peak_mib"], memory_fraction=fraction,
                 budget_mib=fraction * total / 2**20)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        for name in BUDGET_VARIANTS:
            try:
                found["largest_batch"][name] = largest_batch(fits(name), s.batch, args.budget_tries)
            except RuntimeError as exc:
                found["largest_batch"][name] = None
                found.setdefault("errors", {})[name] = str(exc)
        common = min(found["largest_batch"].get(n) or 0 for n in ("checkpoint", "ours-nosign"))
        found["common_batch"] = common
        for name, batch in (("checkpoint", common), ("ours-nosign", common),
                            ("dense", found["largest_batch"].get("dense") or 0)):
            if batch:
                res = attempt(name, batch, speed_plan)
                if res.get("median_step_ms"):
                    res["tokens_per_s"] = batch * s.seq / (res["median_step_ms"] / 1e3)
                found["throughput"][name] = res
                report(found)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    return found


# -------------------------------------------------------------------------- reports
def header(bench: Bench, mode: str, plan: Plan | None, pretrained: dict | None = None) -> dict:
    return {"mode": mode,
            "pretrain": pretrained,
            "config": {k: v for k, v in vars(bench.args).items() if k != "out"},
            "shape": dataclasses.asdict(bench.shape),
            "plan": dataclasses.asdict(plan) if plan else None,
            "tokens_of_text": int(bench.data.size),
            "torch": torch.__version__,
            "ffn_host_path": native.host_path(bench.device),
            "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
            "device": torch.cuda.get_device_name(bench.device) if bench.device.type == "cuda" else "cpu"}


def host_link_gbps(device: torch.device, nbytes: int = 256 << 20, reps: int = 5) -> dict:
    """Pinned host <-> device copy bandwidth (GB/s, best of ``reps``), measured in the run
    whose offload variants it bounds."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        best = float("inf")
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        out[name] = nbytes / best / 1e9
    return out


def describe(summary: dict) -> str:
    s, c, p = summary["shape"], summary["config"], summary["plan"]
    mlp = {"relu2": "ReLU²", "reglu": "ReGLU"}[s.get("ffn", "relu2")]
    text = (f"{s['layers']} layers, d={s['d']}, {s['heads']} heads, {mlp} MLP d_ff={s['d_ff']}, "
            f"seq={s['seq']}, batch={s['batch']}, bf16, attention={c['attn']}")
    if p:
        text += f"; steps: {p['warmup']} warm-up + {p['timed']} timed + {p['profiled']} profiled"
    if c["ours_kwargs"]:
        text += f"; ours kwargs {json.dumps(c['ours_kwargs'])}"
    if summary.get("pretrain"):
        text += "; " + pretrained_text(summary["pretrain"])
    if c.get("torch_defaults"):
        text += "; " + TORCH_DEFAULTS_TEXT
    elif "fill_uninitialized_memory" in summary:
        text += ("; deterministic algorithms, new tensors NaN-filled" if summary["fill_uninitialized_memory"]
                 else "; deterministic algorithms, no NaN fill of new tensors")
    if summary.get("ffn_host_path"):
        text += f"; packed FFN op's host path: {summary['ffn_host_path']}"
    if summary.get("host_link_gbps"):
        link = summary["host_link_gbps"]
        text += (f"; pinned host link {link['d2h']:.1f} GB/s device-to-host, "
                 f"{link['h2d']:.1f} GB/s host-to-device")
    return text + "."


# How a --torch-defaults run's record names its settings (step_split.py's too).
TORCH_DEFAULTS_TEXT = "PyTorch's default GEMM and determinism settings"


def pretrained_text(pre: dict) -> str:
    """What :func:`pretrain` recorded, in words."""
    zeros = pre["mlp_zeros"]
    return (f"every variant starts from the dense model trained {pre['steps']} steps (weights "
            f"and optimizer state; loss {_f(pre['final_loss'], '.3f')}, MLP activations "
            f"{min(zeros):.0%}-{max(zeros):.0%} zeros by layer, mean {statistics.mean(zeros):.0%})")


def _f(v, fmt=".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _yes(v) -> str:
    return {None: "-", True: "yes", False: "NO"}[v]


def markdown_variants(summary: dict) -> str:
    """The variants table, the sync table and the library-op table."""
    mlp = {"relu2": "ReLU²", "reglu": "ReGLU"}[summary["shape"].get("ffn", "relu2")]
    out = [f"# GPT with {mlp} MLP on Python stdlib bytes ({summary['device']}, {summary['mode']})",
           "", describe(summary), "",
           "| variant | median step (ms) | host (ms) | × dense | × reference | peak (MiB) | "
           "peak, timed steps (MiB) | kept after forward (MiB) | first step (s) | final loss | "
           "losses = ref | params = ref | max loss diff |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    failed = []
    for name, v in summary["variants"].items():
        if v["status"] != "ok":
            failed.append(f"- {name}: {v['status']}")
            continue
        ref = VARIANTS[name].reference
        out.append(f"| {name} | {_f(v['median_step_ms'])} | {_f(v['median_host_ms'])} | "
                   f"{_f(v.get('step_ratio_vs_dense'), '.2f')} | "
                   f"{_f(v.get('step_ratio_vs_reference'), '.2f') if ref != 'dense' else '-'} | "
                   f"{_f(v['peak_mib'], '.0f')} | {_f(v.get('timed_peak_mib'), '.0f')} | "
                   f"{_f(v.get('after_forward_mib'), '.0f')} | "
                   f"{_f(v['first_step_s'], '.2f')} | "
                   f"{v['losses'][-1]:.4f} | {_yes(v.get('losses_bit_identical'))} | "
                   f"{_yes(v.get('params_bit_identical'))} | {_f(v.get('max_abs_loss_diff'), '.2e')} |")
    out += ["", "Reference: dense, and dense-compiled for the ours-compiled variants. Host = "
            "CPU time to issue a step (from its start to before the closing synchronize). Kept "
            "after forward: memory allocated after the forward less at the step's start "
            "(median of the timed steps), the activations the backward will read. Peak: the "
            "whole run's; timed steps: theirs alone (a packed module's first packs, before "
            "any count is back, take the full capacity unless initial_density= is given)."]
    rounds = [(n, v) for n, v in summary["variants"].items() if v.get("round_step_ms")]
    if rounds:
        out += ["", "Rounds (the variant sequence run again for timing; median step ms per "
                "round, and × dense of the same round): " + "; ".join(
                    f"{n} " + " / ".join(_f(t) for t in v["round_step_ms"])
                    + (f" (× dense {' / '.join(f'{r:.2f}' for r in v['round_ratio_vs_dense'])}"
                       f", median {v['median_round_ratio_vs_dense']:.2f})"
                       if v.get("round_ratio_vs_dense") else "")
                    for n, v in rounds) + "."]
    phases = [(n, v["median_host_phase_ms"]) for n, v in summary["variants"].items()
              if v.get("median_host_phase_ms")]
    if phases:
        out += ["", "Host time per phase (median ms): " + "; ".join(
            f"{n} {f:.1f} / {b:.1f} / {o:.1f}" for n, (f, b, o) in phases)
            + " (forward / backward / optimizer)."]
    if summary["config"]["attn"] == "auto":
        out += ["", "attention=auto lets SDPA pick a fused backend whose backward need not be "
                "deterministic, so losses can differ from the reference in the last bits "
                "(checkpoint too); bit-identity is checked with --bitident-steps (math attention)."]
    if failed:
        out += ["", "Not run to the end:", ""] + failed
    cap = {n: v["capacity"] for n, v in summary["variants"].items() if v.get("capacity")}
    if cap:
        out += ["", "## Packed modules' backward, per step (all layers)", "",
                "| variant | recomputes | of which the count was not back yet | in graph replays "
                "| overflows | waits for a count | host ms waiting | max density |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        out += [f"| {n} | {c['recomputes_per_step']:.2f} | {c['unknown_per_step']:.2f} | "
                f"{c.get('replay_recomputes_per_step', 0):.2f} | "
                f"{c['overflows_per_step']:.2f} | {c['waits_per_step']:.2f} | "
                f"{1e3 * c['wait_s_per_step']:.2f} | {c['max_density']:.3f} |"
                for n, c in cap.items()]
        out += ["", "A wait watches the pinned slot of a pack the GPU has not reached yet, while "
                "the GPU runs the work queued after it (no CUDA call); `ours-recompute` "
                "recomputes instead. Recomputes in graph replays are counted by the device "
                "(the captured backward's condition kernel); the host sees none of their "
                "packs."]
    profiled = {n: v["syncs"] for n, v in summary["variants"].items() if v.get("syncs")}
    if profiled:
        keys = list(next(iter(profiled.values()))["per_step"])
        out += ["", "## Host syncs per step (torch.profiler, no per-step sync of the benchmark)", "",
                "| variant | " + " | ".join(keys) + " | host ms/step (profiled) | "
                "GPU busy ms/step |",
                "| --- " * (len(keys) + 3) + "|"]
        for name, sy in profiled.items():
            out.append(f"| {name} | " + " | ".join(_f(sy["per_step"][k], "g") for k in keys)
                       + f" | {sy['host_ms_per_step']:.1f} | "
                       f"{_f(sy.get('gpu_busy_ms_per_step'))} |")
        recompiled = {n: v["compiles"]["profiled"] for n, v in summary["variants"].items()
                      if n in profiled and v.get("compiles", {}).get("profiled")}
        if recompiled:
            out += ["", "Recompiles inside the profiled steps (a capacity bucket moved; the "
                    "compiler's own syncs and host time are in that row): " + "; ".join(
                        f"{n} {k}" for n, k in recompiled.items()) + "."]
        hidden = {n: sy["copy_overlap"] for n, sy in profiled.items()
                  if sy.get("copy_overlap") is not None}
        if hidden:
            out += ["", "Host-device copies of 5 µs or more that ran while a kernel ran (the "
                    "fraction of their GPU time): " + "; ".join(
                        f"{n} {100 * f:.0f} %" for n, f in hidden.items()) + "."]
        rows = [(n, r) for n, sy in profiled.items() for r in sy["own_ops"]]
        if rows:
            out += ["", "## Library ops, CPU time per step (key_averages rows naming "
                    + " / ".join(OWN_OPS) + ")", "",
                    "| variant | op | calls/step | self CPU (ms) | total CPU (ms) | GPU (ms) |",
                    "| --- | --- | --- | --- | --- | --- |"]
            out += [f"| {n} | `{r['name'][:90]}` | {r['calls_per_step']:g} | "
                    f"{r['self_cpu_ms_per_step']:.2f} | {r['cpu_total_ms_per_step']:.2f} | "
                    f"{r['device_total_ms_per_step']:.2f} |" for n, r in rows]
        kernels = {n: sy["gpu_kernels"] for n, sy in profiled.items() if sy.get("gpu_kernels")}
        if kernels:
            out += ["", "## GPU time per step by kernel (profiled steps; the longest "
                    "first, kernels of replayed CUDA graphs included)", "",
                    "| variant | kernel | ms/step | runs/step |", "| --- | --- | --- | --- |"]
            out += [f"| {n} | `{k['name'][:100]}` | {k['ms_per_step']:.3f} | "
                    f"{k['runs_per_step']:g} |" for n, ks in kernels.items() for k in ks]
        idle = {n: sy["gpu_idle_before"] for n, sy in profiled.items() if sy.get("gpu_idle_before")}
        if idle:
            out += ["", "## GPU idle per step by the work that ends it (profiled steps; each gap "
                    "with no kernel running is put on the kernel that starts after it)", "",
                    "| variant | kernel after the gap | idle ms/step | gaps/step |",
                    "| --- | --- | --- | --- |"]
            out += [f"| {n} | `{k['name'][:100]}` | {k['idle_ms_per_step']:.3f} | "
                    f"{k['gaps_per_step']:g} |" for n, ks in idle.items() for k in ks]
    out += markdown_interleaved(summary.get("interleaved"))
    return "\n".join(out) + "\n"


def markdown_interleaved(result: dict | None) -> list:
    if not result:
        return []
    if result.get("status") != "ok":
        return ["", "## Interleaved steps", "", f"Not run: {result.get('status')}."]
    out = [""] + interleaved.markdown(result)
    out += [f"- {n}: {why}" for n, why in (result.get("failed") or {}).items()]
    if "graphs_compiled" in result:
        out += ["", f"torch.compile compiled {result['graphs_compiled']} graphs in this run "
                "(the variants' builds and warm-up turns included: one per compiled variant "
                "when nothing recompiled, two for one whose capacities were frozen)."]
    rows = [(n, rec) for n, rec in result["variants"].items() if rec.get("host_phases_ms")]
    if rows:
        out += ["", "Host per phase in the timed turns (median ms; a backward's waits for a "
                "pack's count are in its host time) and the packed modules' counters per step "
                "after the warm-up turns; a step graph is captured again, at a capacity a step "
                "higher, where `adapt_to_replays` finds replays that recomputed (a count over "
                "the whole run, warm-up turns included):", "",
                "| variant | forward | backward | optimizer | waits | ms waiting | recomputes "
                "| of which the count was not back | overflows | recomputes in graph replays "
                "| step graph captured again |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, rec in rows:
            ph, c = rec["host_phases_ms"], rec.get("capacity")
            counts = (f"{c['waits_per_step']:.2f} | {1e3 * c['wait_s_per_step']:.2f} | "
                      f"{c['recomputes_per_step']:.2f} | {c['unknown_per_step']:.2f} | "
                      f"{c['overflows_per_step']:.2f} | "
                      f"{c.get('replay_recomputes_per_step', 0):.2f} | "
                      f"{c.get('recaptures', '-')}" if c else "- | - | - | - | - | - | -")
            out.append(f"| {name} | {ph['forward']:.2f} | {ph['backward']:.2f} | "
                       f"{ph['optimizer']:.2f} | {counts} |")
    return out


def markdown_budget(summary: dict) -> str:
    out = [f"# GPT memory budget ({summary['device']})", "", describe(summary), ""]
    if "memory_fraction" in summary:
        out.append(f"Budget {summary['budget_mib']:.0f} MiB (memory fraction "
                   f"{summary['memory_fraction']:.4f}): {summary['config']['budget_factor']} × "
                   f"dense's peak of {summary['dense_peak_mib_at_preset_batch']:.0f} MiB at the "
                   "preset batch.")
    if "error" in summary:
        out.append(f"Stopped: {summary['error']}")
    out += ["", "| variant | largest batch | tries (batch: result, peak MiB) |", "| --- | --- | --- |"]
    for name, tries in summary["tries"].items():
        seen = ", ".join(f"{b}: {t['status'].split(':')[0]} {_f(t['peak_mib'], '.0f')}"
                         for b, t in tries.items())
        out.append(f"| {name} | {_f(summary['largest_batch'].get(name), 'd')} | {seen} |")
    for name, err in summary.get("errors", {}).items():
        out.append(f"\n{name}: {err}")
    if summary["throughput"]:
        out += ["", f"Throughput (checkpoint and ours at batch {summary['common_batch']}, the "
                "largest both fit; dense at its own largest):", "",
                "| variant | batch | median step (ms) | tokens/s | peak (MiB) | status |",
                "| --- | --- | --- | --- | --- | --- |"]
        for name, r in summary["throughput"].items():
            out.append(f"| {name} | {r.get('batch', '-')} | {_f(r.get('median_step_ms'))} | "
                       f"{_f(r.get('tokens_per_s'), '.0f')} | {_f(r.get('peak_mib'), '.0f')} | "
                       f"{r['status'][:80]} |")
    return "\n".join(out) + "\n"


def plot_variants(summary: dict, path: Path, plt) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ok = {n: v for n, v in summary["variants"].items() if v["status"] == "ok"}
    for name, v in ok.items():
        axes[0].plot(v["losses"], label=name, lw=1)
    axes[0].set(title="training loss", xlabel="step", ylabel="loss")
    axes[0].legend()
    sparsity = ok.get("dense", {}).get("sparsity")
    if sparsity:
        per_layer = np.array([sp for _, sp in sparsity])
        for layer in range(per_layer.shape[1]):
            axes[1].plot([s for s, _ in sparsity], per_layer[:, layer], marker=".",
                         label=f"layer {layer}")
        axes[1].set(title="MLP activation sparsity (fraction of zeros)", xlabel="step")
        axes[1].legend(fontsize=7)
    names = list(ok)
    peaks = [ok[n]["peak_mib"] or 0 for n in names]
    axes[2].bar(names, peaks, color="tab:blue")
    axes[2].set(title="peak memory (MiB); median step time in labels")
    axes[2].tick_params(axis="x", labelrotation=30)
    for i, (p, n) in enumerate(zip(peaks, names)):
        axes[2].text(i, p, f"{_f(ok[n]['median_step_ms'], '.0f')} ms", ha="center",
                     va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_budget(summary: dict, path: Path, plt) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(summary["largest_batch"])
    axes[0].bar(names, [summary["largest_batch"][n] or 0 for n in names], color="tab:blue")
    axes[0].set(title=f"largest batch under {summary.get('budget_mib', 0):.0f} MiB")
    tp = {n: r.get("tokens_per_s") or 0 for n, r in summary["throughput"].items()}
    axes[1].bar(list(tp), list(tp.values()), color="tab:green")
    axes[1].set(title="tokens/s under the budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_cprofiles(summary: dict, out: Path, stem: str) -> None:
    texts = [f"## {n}\n{v['cprofile']}" for n, v in summary.get("variants", {}).items()
             if v.get("cprofile")]
    if texts:
        (out / f"{stem}_cprofile.txt").write_text("\n\n".join(texts))


def write_reports(summary: dict, out: Path, stem: str) -> None:
    """``stem``.json, .md and (where matplotlib is installed) .png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    summary["elapsed_s"] = time.monotonic() - START
    write_cprofiles(summary, out, stem)
    slim = dict(summary)
    if "variants" in slim:
        slim["variants"] = {n: {k: x for k, x in v.items() if k != "cprofile"}
                            for n, v in slim["variants"].items()}
    (out / f"{stem}.json").write_text(json.dumps(slim, indent=1, default=str))
    budget_mode = summary["mode"] == "budget"
    (out / f"{stem}.md").write_text(markdown_budget(summary) if budget_mode
                                    else markdown_variants(summary))
    plt = pyplot()
    if plt is None:
        return
    (plot_budget if budget_mode else plot_variants)(summary, out / f"{stem}.png", plt)


# ----------------------------------------------------------------------------- main
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpt6")
    ap.add_argument("--small", action="store_true", help="tiny model for a CPU check")
    for name in ("layers", "d", "heads", "d-ff", "seq", "batch"):
        ap.add_argument(f"--{name}", type=int, help="override the preset")
    ap.add_argument("--ffn", choices=FFNS, help="the MLP, ReLU² (the presets') or ReGLU "
                    "(PackedReGLUFFN against its dense form, the same d_ff)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--trace", default="",
                    help="variants whose profiled steps are written as a Chrome / Perfetto trace "
                         "(OUT/train_gpt_<variant>_trace.json.gz)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the variant sequence this many times (timing; see run_variants)")
    ap.add_argument("--interleave", type=int, default=0,
                    help="then this many turns of one step of every variant each, all models "
                         "resident (bench/interleaved.py): ratios to dense the host's drift "
                         "does not decide")
    ap.add_argument("--interleave-block", type=int, default=1, metavar="STEPS",
                    help="steps of a variant in a row in each turn, the first untimed (a "
                         "model's steady state, as a training loop runs it)")
    ap.add_argument("--interleave-streamed", action="store_true",
                    help="no device sync between a block's timed steps (a loop that does not "
                         "read its loss every step); needs --interleave-block 2 or more")
    ap.add_argument("--kernel-rows", type=int, default=0, metavar="N",
                    help="CUDA: report the GPU time per step of each variant's N longest "
                         "kernels in the profiled steps")
    ap.add_argument("--cprofile-steps", type=int, default=0,
                    help="CUDA: also run this many steps under cProfile (train_gpt_cprofile.txt)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--pretrain-steps", type=int, default=0,
                    help="first train the dense model this many steps; every variant starts "
                         "from its weights and optimizer state (a sparser MLP, as in a run "
                         "in progress)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sparsity-every", type=int, default=10, help="0: no sparsity probe")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", default=",".join(v for v in VARIANTS
                                                   if v not in OPT_IN_VARIANTS))
    ap.add_argument("--attn", choices=("auto", "math"), default="auto")
    ap.add_argument("--compile-fullgraph", action="store_true")
    ap.add_argument("--torch-defaults", action="store_true",
                    help="timing as users train: no deterministic algorithms, bf16 GEMMs with "
                         "PyTorch's default reductions (losses then need not match dense's)")
    ap.add_argument("--ours-kwargs", type=json.loads, default={},
                    help="JSON dict passed to the PackedReLU2FFN constructor")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--bitident-steps", type=int, default=0,
                      help="bit-identity mode: dense, ours-raw, ours-nosign, math attention")
    mode.add_argument("--budget", action="store_true", help="memory-budget mode (CUDA)")
    ap.add_argument("--budget-factor", type=float, default=0.8)
    ap.add_argument("--budget-tries", type=int, default=7, help="fit tries per variant")
    ap.add_argument("--time-limit", type=float, default=500.0, help="seconds; later variants are skipped")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    if not isinstance(args.ours_kwargs, dict):
        ap.error("--ours-kwargs must be a JSON object")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.budget and not args.device.startswith("cuda"):
        ap.error("--budget needs a CUDA device")
    if args.interleave_block < 1 or (args.interleave_streamed and args.interleave_block < 2):
        ap.error("--interleave-block takes 1 or more steps, 2 or more with --interleave-streamed")
    if args.bitident_steps:
        args.attn, args.variants = "math", ",".join(BITIDENT_VARIANTS)
        if args.torch_defaults:
            ap.error("--bitident-steps needs the deterministic settings (no --torch-defaults)")
    return args


def deterministic_algorithms(fill_uninitialized: bool = False) -> None:
    """Deterministic algorithms and the fixed cuBLAS workspace they need (set before the
    first cuBLAS call); new tensors NaN-filled only where ``fill_uninitialized``."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = bool(fill_uninitialized)


def exact_bf16_reductions() -> None:
    """bf16 GEMMs without reduced-precision reductions."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def shape_and_device(args, base: Shape, fill_uninitialized: bool = False):
    """``base`` with the command line's shape overrides, and the device; sets the
    determinism every bit-for-bit comparison here relies on (bench_hf.py shares it).

    Deterministic mode also fills every new tensor of ``torch.empty`` with NaN by default,
    a debugging aid (one fill kernel per allocation: 1.7 ms of GPU time per gpt12 step)
    that no training run pays; it changes no result of code that reads only what it
    wrote, and stays on only where ``fill_uninitialized`` (the bit-identity runs, where a
    read of unwritten memory then shows as a NaN). ``args.torch_defaults`` leaves all of
    this at PyTorch's defaults (a timing run as users train: no bit-for-bit claim)."""
    shape = dataclasses.replace(base, **{k: v for k in ("layers", "d", "heads", "d_ff", "seq", "batch",
                                                         "ffn")
                                         if (v := getattr(args, k, None)) is not None})
    if not getattr(args, "torch_defaults", False):
        deterministic_algorithms(fill_uninitialized)
        exact_bf16_reductions()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # memory calls want an index
    return shape, device


def main(argv=None) -> int:
    args = parse_args(argv)
    shape, device = shape_and_device(args, SMALL if args.small else PRESETS[args.preset],
                                     fill_uninitialized=bool(args.bitident_steps))
    bench = Bench(args, shape, stdlib_bytes(limit=64 << 20), initial_state(shape, args.seed),
                  device)
    out = Path(args.out)
    pretrained = pretrain(bench, args.pretrain_steps) if args.pretrain_steps else None

    if args.budget:
        summary = header(bench, "budget", None, pretrained)
        summary.update(budget(bench, lambda part: write_reports({**summary, **part}, out,
                                                                "train_gpt_budget")))
        write_reports(summary, out, "train_gpt_budget")
        print(markdown_budget(summary))
        return 0

    names = args.variants.split(",")
    if any(VARIANTS[n].step_graph for n in names) and \
            args.warmup < STEP_GRAPH_WARMUP:
        print(f"warm-up {args.warmup} -> {STEP_GRAPH_WARMUP} steps (turns): the step graphs "
              f"capture after {STEP_GRAPH_SETTLE} eager steps", flush=True)
        args.warmup = STEP_GRAPH_WARMUP
    plan = (Plan(0, args.bitident_steps) if args.bitident_steps
            else Plan(args.warmup, args.steps, args.profile_steps))
    mode, stem = ("bitident", "train_gpt_bitident") if args.bitident_steps else ("train", "train_gpt")
    summary = header(bench, mode, plan, pretrained)
    if device.type == "cuda" and set(OFFLOAD_VARIANTS) & set(names):
        summary["host_link_gbps"] = host_link_gbps(device)

    def report(results):
        write_reports({**summary, "variants": results}, out, stem)

    results = run_variants(bench, names, plan, report,
                           rounds=1 if args.bitident_steps else args.rounds)
    summary["variants"] = results
    if args.interleave and not args.bitident_steps:
        summary["interleaved"] = run_interleaved(bench, names, args.interleave, args.warmup,
                                                 args.interleave_block,
                                                 not args.interleave_streamed)
    write_reports(summary, out, stem)
    print(f"wrote {out / stem}.{{json,md,png}} in {time.monotonic() - START:.0f} s")
    if mode == "bitident":
        ok = all(results[n]["status"] == "ok" and results[n].get("losses_bit_identical")
                 and results[n].get("params_bit_identical") for n in BITIDENT_VARIANTS[1:])
        print("losses and final parameters of ours bit-identical to dense:", ok)
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
