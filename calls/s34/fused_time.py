"""GPU µs of the fused ops and unpack, per backend and dtype, [8192, 14336], s = 0.9;
hashes of every output (so runs of old and new kernels compare bytes).
usage: fused_time.py BACKENDS DTYPES TAG OUTJSON"""
import hashlib, json, sys, time
import numpy as np, torch
import bitsparse_core as bc
from bitsparse_core.backends.registry import get_backend

backends, dtypes, tag, out = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3], sys.argv[4]
shape = (8192, 14336)
torch.manual_seed(0)
dev = torch.device("cuda")
res = {}
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

def h(t):
    return hashlib.sha1(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:12]

def gpu_us(fn, reps=15):
    ts = []
    for _ in range(reps + 2):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200000)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return float(np.median(ts[2:]))

for dtn in dtypes:
    dt = getattr(torch, dtn)
    pre = torch.randn(shape, device=dev) - 1.2816   # ~10 % positive
    r = torch.relu(pre).to(dt)
    u = torch.randn(shape, device=dev).to(dt)
    g = torch.randn(shape, device=dev).to(dt)
    k = int((r != 0).sum())
    for be in backends:
        B = get_backend(be)
        p = B.pack(r, encoding="nosign", capacity=k)
        pu = B.masked_pack(u, p, encoding="signplane")
        pu_own = B.pack(u, encoding="signplane", capacity=u.numel())
        ops = {
            "unpack": lambda: B.unpack(p),
            "relu_backward": lambda: B.relu_backward(g, p),
            "relu2_backward": lambda: B.relu2_backward(g, p),
            "gated_backward": lambda: B.gated_backward(g, p, pu),
            "gated_backward_own": lambda: B.gated_backward(g, p, pu_own),
        }
        for name, fn in ops.items():
            outv = fn()
            outs = outv if isinstance(outv, tuple) else (outv,)
            hs = [h(o if isinstance(o, torch.Tensor) else torch.from_dlpack(o)) for o in outs]
            t = gpu_us(fn)
            res[f"{tag}/{be}/{dtn}/{name}"] = {"us": t, "hash": hs}
            print(f"{tag:5s} {be:6s} {dtn:9s} {name:20s} {t:8.1f} us  {hs}", flush=True)
    del pre, r, u, g
json.dump(res, open(out, "w"), indent=1)
