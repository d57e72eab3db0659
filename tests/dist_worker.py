"""The per-rank side of tests/test_distributed.py (a module of its own so that
``torch.multiprocessing`` spawn can import the worker by name).

Each case trains two copies of one model, wrapped the same way (DDP, or FSDP2
``fully_shard`` per block and on the root): the dense model, and either its
packed twin (the packed FFN modules), the dense model under
``compress_saved_tensors``, or a transformers OPT decoder and its ``convert()``-ed twin. Same init, same per-rank data (different on each
rank, so the gradient reduction matters), a few AdamW steps; every rank checks
that its losses, its (local shards of the) gradients and parameters are
bit-identical, and writes ``{case: {"ok": ..., "error": ...}}`` to
``rank<r>.json`` in the result folder after every case.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import traceback

D, F, STEPS = 16, 64, 3
ENCODING = {"relu": "nosign", "relu2": "raw", "reglu": "nosign"}


# "converted": a transformers OPT decoder stack, and its twin after bitsparse_core.torch.convert
KINDS = ("relu", "relu2", "reglu", "hooks") + (
    ("converted",) if importlib.util.find_spec("transformers") else ())


def _cases():
    """name -> (wrapper, kind, reshard_after_forward, mixed precision)."""
    cases = {}
    for kind in KINDS:
        cases[f"ddp-{kind}"] = ("ddp", kind, None, False)
    for raf in (True, False):
        for kind in KINDS:
            cases[f"fsdp-{kind}-reshard{int(raf)}"] = ("fsdp", kind, raf, False)
    for kind in KINDS:
        cases[f"fsdp-{kind}-bf16mp"] = ("fsdp", kind, True, True)
    return cases


CASES = _cases()
DDP_CASES = [n for n, c in CASES.items() if c[0] == "ddp"]
FSDP_CASES = [n for n, c in CASES.items() if c[0] == "fsdp" and not c[3]]
FSDP_MP_CASES = [n for n, c in CASES.items() if c[0] == "fsdp" and c[3]]


def _local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _train(model, x, target, hooks=None):
    """Losses, local gradients and local parameters after each step (detached clones),
    and the dtypes the model's outputs had."""
    import torch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    record, out_dtypes = [], set()
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        with hooks if hooks is not None else contextlib.nullcontext():
            out = model(x)
            out_dtypes.add(out.dtype)
            loss = (out.float() - target).pow(2).mean()
        loss.backward()
        grads = {n: _local(p.grad).detach().clone() for n, p in model.named_parameters()}
        opt.step()
        params = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
        record.append((loss.detach().clone(), grads, params))
    return record, out_dtypes


def _opt_stack(seed: int = 0):
    """A tiny OPT decoder (ReLU FFN) returning its last hidden state."""
    import torch
    import transformers as tf

    class OPTStack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cfg = tf.OPTConfig(hidden_size=D, ffn_dim=F, num_hidden_layers=2,
                               num_attention_heads=2, vocab_size=50, max_position_embeddings=32,
                               word_embed_proj_dim=D, activation_function="relu", dropout=0.0,
                               attention_dropout=0.0, attn_implementation="eager")
            torch.manual_seed(seed)
            self.opt = tf.OPTModel(cfg)
            self.blocks = self.opt.decoder.layers

        def forward(self, ids):
            return self.opt(input_ids=ids).last_hidden_state

    return OPTStack()


def _packed_ffns(model) -> list:
    """The packed FFN modules inside a model: the modules themselves, or what convert()
    attached to the blocks it converted (not registered as submodules)."""
    from bitsparse_core.torch.modules import _PackedFFN
    found = []
    for m in model.modules():
        for cand in (m, m.__dict__.get("_bitsparse_packed"), m.__dict__.get("packed")):
            if isinstance(cand, _PackedFFN) and all(cand is not f for f in found):
                found.append(cand)
    return found


def _blocks(model):
    """The sub-modules that get their own ``fully_shard``."""
    from torch import nn
    if isinstance(model, nn.Sequential):  # relu_mlp: the Linears
        return [m for m in model if isinstance(m, nn.Linear)]
    return list(model.blocks)


def _wrap(model, wrapper, raf, mixed):
    import torch
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw = {"reshard_after_forward": raf}
    if mixed:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for blk in _blocks(model):
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    return model


def run_case(name, rank, world):
    import torch
    import torch.distributed as dist
    from bitsparse_core.torch import compress_saved_tensors
    from torch_models import assert_same_training, make_pair, relu_mlp

    wrapper, kind, raf, mixed = CASES[name]
    hooks = None
    g = torch.Generator().manual_seed(1000 + rank)  # per-rank data
    if kind == "hooks":
        dense, ours = relu_mlp(d=D, f=F), relu_mlp(d=D, f=F)  # same seed: same init
        hooks = compress_saved_tensors(min_numel=256, min_sparsity=0.5)
        shape = (32,)
    elif kind == "converted":
        from bitsparse_core.torch import convert
        dense, ours = _opt_stack(), _opt_stack()
        report = convert(ours)
        assert len(report.replaced) == 2, report
        shape = (2, 8)
    else:
        dense, ours = make_pair(kind, ENCODING[kind], d=D, f=F, layers=2)
        shape = (2, 8)
    assert all(torch.equal(a, b) for a, b in zip(dense.state_dict().values(),
                                                 ours.state_dict().values()))
    packed_blocks = _packed_ffns(ours)
    assert len(packed_blocks) == (0 if kind == "hooks" else 2), packed_blocks
    x = (torch.randint(0, 50, shape, generator=g) if kind == "converted"
         else torch.randn(*shape, D, generator=g))
    target = torch.randn(*shape, D, generator=g)

    dense = _wrap(dense, wrapper, raf, mixed)
    ours = _wrap(ours, wrapper, raf, mixed)
    rec_dense, dtypes_dense = _train(dense, x, target)
    rec_ours, dtypes_ours = _train(ours, x, target, hooks)
    assert_same_training(rec_dense, rec_ours)
    # mixed precision really computed in bf16 (FSDP2 casts the inputs and parameters)
    want = torch.bfloat16 if mixed else torch.float32
    assert dtypes_dense == dtypes_ours == {want}, (dtypes_dense, dtypes_ours)

    # the packed path really ran
    if hooks is not None:
        assert hooks.stats.packed >= 2 * STEPS and hooks.stats.unpacked >= 2 * STEPS, \
            hooks.stats
    for blk in packed_blocks:
        assert blk.stats()["packs"] >= STEPS, blk.stats()
    # the wrapper really reduced: the ranks saw different data, yet DDP's replicas agree
    # (FSDP: the shards of one parameter differ by rank, nothing to compare)
    if wrapper == "ddp":
        losses = torch.stack([rec[0] for rec in rec_ours])
        other = [torch.empty_like(losses) for _ in range(world)]
        dist.all_gather(other, losses)
        assert not torch.equal(other[0], other[1]), "ranks saw the same data"
        flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        assert all(torch.equal(every[0], e) for e in every[1:]), "DDP replicas differ"


def worker(rank, world, port, names, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    results = {}
    path = os.path.join(outdir, f"rank{rank}.json")

    def dump():
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        for name in names:
            try:
                run_case(name, rank, world)
                results[name] = {"ok": True}
            except Exception:
                results[name] = {"ok": False, "error": traceback.format_exc()}
            dump()
            dist.barrier()  # keep the ranks in step case by case
    finally:
        dump()
        dist.destroy_process_group()
