"""Host time of one allocation from PyTorch's caching allocator, by route (issues 14, 20).

An exact pack allocates its values' exact-size block after the count has reached the
host, while the GPU waits; every public call allocates its output. This times, per
allocation and free of a 1 MiB block in a tight loop (median of 5 loops of 2000), on
torch's current stream and on a side stream:

* ``torch.empty``: a uint8 tensor (on a side stream inside ``torch.cuda.stream``);
* ``tensor buffer``: ``interop.torch_tensor_buffer`` (a tensor, as ``torch_allocator``
  returns; a side stream makes an ``ExternalStream`` and enters its context);
* ``block``: ``interop.torch_buffer`` (``caching_allocator_alloc`` by address, no
  tensor, no stream object), the route the backends take for torch data;
* ``caching_allocator_alloc + delete``: torch's two calls alone (the block's floor).

    python bench/alloc_host.py [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def per_call_us(fn, n: int = 2000, loops: int = 5) -> float:
    for _ in range(200):
        fn()
    times = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nbytes", type=int, default=1 << 20)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    import torch

    from bitsparse_core.backends.cuda import interop as ci

    dev = torch.cuda.current_device()
    side = torch.cuda.Stream()
    handles = {"current stream": torch.cuda.current_stream().cuda_stream,
               "side stream": side.cuda_stream}
    x = torch.zeros(4096, device="cuda")
    rows = [{"route": "x + x (scale)", "stream": "current stream",
             "us": per_call_us(lambda: x + x)}]
    for where, h in handles.items():
        if where == "current stream":
            empty = lambda: torch.empty(a.nbytes, dtype=torch.uint8, device="cuda")  # noqa: E731
        else:
            def empty():
                with torch.cuda.stream(side):
                    return torch.empty(a.nbytes, dtype=torch.uint8, device="cuda")
        def public(h=h):
            torch.cuda.caching_allocator_delete(torch.cuda.caching_allocator_alloc(a.nbytes, dev, h))

        for route, fn in (("torch.empty", empty),
                          ("tensor buffer", lambda: ci.torch_tensor_buffer(a.nbytes, dev, h)),
                          ("block", lambda: ci.torch_buffer(a.nbytes, dev, h)),
                          ("caching_allocator_alloc + delete", public)):
            rows.append({"route": route, "stream": where, "us": per_call_us(fn)})
    torch.cuda.synchronize()
    lines = [f"# Host time of one allocation from torch's caching allocator ({torch.cuda.get_device_name()})",
             "", f"{a.nbytes} bytes, allocated and freed in a loop; median of 5 loops of 2000; µs "
             "per allocation (host).", "", "| route | stream | µs |", "|---|---|---|"]
    lines += [f"| {r['route']} | {r['stream']} | {r['us']:.2f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "alloc_host.md").write_text(text)
        (out / "alloc_host.json").write_text(json.dumps({"nbytes": a.nbytes, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
