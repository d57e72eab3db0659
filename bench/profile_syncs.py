"""Host syncs and host time of a few training steps, counted with torch.profiler.

A host sync (a stream/event/device synchronize, a device-to-host copy, a
``.item()`` of a device tensor, a synchronous ``cudaMemcpy``) stalls the CPU
until the GPU has caught up, so the CPU cannot queue the next step ahead of the
GPU. Counting them per step, and the CPU time of the library's own ops, shows
whether a variant is paced by the host rather than by the GPU. Only host calls
made inside the profiled steps count: the profiler's own synchronize at exit
lies outside every step and is left out.
"""

from __future__ import annotations

import collections
import functools

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

STEP_LABEL = "bench::step"
# Host-side calls counted by exact name. cudaMemcpy (not ...Async) waits for the copy.
HOST_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
              "cudaMemcpy", "cudaMemcpyAsync", "aten::item", "aten::_local_scalar_dense")
# GPU-side copy events, named like "Memcpy DtoH (Device -> Pinned)".
GPU_COPIES = ("Memcpy DtoH", "Memcpy HtoD")


def profile_steps(step_fn, batches, device: torch.device, own_ops=("bitsparse",), top: int = 8,
                  trace=None, kernel_rows: int = 0):
    """Run ``step_fn(x, y)`` on each batch under the profiler, with no sync between steps.

    Returns the step outputs and a summary: sync counts per step, host time per
    step, and the ``top`` host-side rows of ``key_averages()`` whose name contains
    one of ``own_ops`` (case-insensitive), by CPU self time. ``trace``: a path for the
    Chrome / Perfetto trace of the profiled steps (``.json.gz``: compressed).
    ``kernel_rows``: also the GPU time per step of that many kernels (and copies), the
    longest first, kernels inside replayed CUDA graphs included."""
    _warm_profiler(device.type)
    outputs = []
    with profile(activities=_activities(device.type)) as prof:
        for x, y in batches:
            with record_function(STEP_LABEL):
                outputs.append(step_fn(x, y))
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return outputs, summarize(prof, len(batches), own_ops, top, kernel_rows)


def _activities(device_type: str) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])


@functools.cache
def _warm_profiler(device_type: str) -> None:
    """Start and stop the profiler once, so its one-off set-up (CUPTI's, say) is not
    charged to the first variant profiled."""
    with profile(activities=_activities(device_type)):
        torch.zeros(1, device=device_type).add_(1)


def _host_events_in_steps(events):
    """The step ranges, and the host-side events that start inside one (steps excluded)."""
    steps = [(e.time_range.start, e.time_range.end) for e in events
             if e.name == STEP_LABEL and e.device_type == DeviceType.CPU]
    inside = [e for e in events if e.device_type == DeviceType.CPU and e.name != STEP_LABEL
              and any(s <= e.time_range.start <= t for s, t in steps)]
    return steps, inside


def _device_scalars(events) -> int:
    """``aten::_local_scalar_dense`` calls that copy from the device (a runtime memcpy runs
    inside them): the host syncs among the ``.item()`` calls, which also read CPU tensors
    (the optimizer's step counters, say) without any sync."""
    copies = [e for e in events if e.name.startswith("cudaMemcpy")]
    return sum(any(c.thread == e.thread and e.time_range.start <= c.time_range.start
                   <= e.time_range.end for c in copies)
               for e in events if e.name == "aten::_local_scalar_dense")


def _device_work(events) -> list:
    """The GPU-side events that are work (kernels, copies, memsets): the GPU spans of
    ``record_function`` ranges (user annotations) cover such work and are left out."""
    return [e for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def _busy_ms(events) -> float:
    """Time the GPU spent running kernels or copies (the union of their intervals): beside
    the host time per step, it shows which side paces the step."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in _device_work(events))
    busy, end = 0, None
    for s, t in spans:
        if end is None or s > end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    return busy / 1e3


def _union(spans) -> list:
    """Sorted, disjoint ``(start, end)`` intervals covering ``spans``."""
    out = []
    for s, t in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], t))
        else:
            out.append((s, t))
    return out


def copy_overlap(events, min_us: float = 5.0):
    """Of the GPU time spent in host<->device copies of at least ``min_us`` (an offload's
    blocks, not a 16-byte count), the fraction during which a kernel ran as well:
    1.0 when every copy hid behind compute. None without such copies."""
    gpu = [e for e in events if e.device_type == DeviceType.CUDA]
    copies = [(e.time_range.start, e.time_range.end) for e in gpu
              if e.name.startswith(GPU_COPIES) and e.time_range.end - e.time_range.start >= min_us]
    if not copies:
        return None
    compute = _union((e.time_range.start, e.time_range.end) for e in gpu
                     if not e.name.startswith(("Memcpy", "Memset")))
    total = hidden = 0.0
    for s, t in copies:
        total += t - s
        for a, b in compute:
            if b <= s:
                continue
            if a >= t:
                break
            hidden += min(b, t) - max(a, s)
    return hidden / total


def gpu_time_by_name(events, n_steps: int, rows: int) -> list:
    """The ``rows`` device-side names (kernels, copies, memsets) with the most GPU time:
    ms and runs per step. Where two variants' GPU times differ, the rows show which
    kernels the difference is in."""
    ms, runs = collections.Counter(), collections.Counter()
    for e in _device_work(events):
        ms[e.name] += (e.time_range.end - e.time_range.start) / 1e3 / n_steps
        runs[e.name] += 1 / n_steps
    return [{"name": name, "ms_per_step": t, "runs_per_step": runs[name]}
            for name, t in ms.most_common(rows)]


def gpu_idle_by_next(events, n_steps: int, rows: int) -> list:
    """Where the GPU idles: each gap in its work (no kernel, copy or memset running on any
    stream) is put on the name of the work that ends it, as ms per step; the ``rows``
    names with the most. Where a variant's step is longer than its GPU time, the rows
    show what the GPU waited for before running (a launch, a graph's conditional node,
    the host)."""
    idle, gaps = collections.Counter(), collections.Counter()
    end = None
    for e in sorted(_device_work(events), key=lambda e: e.time_range.start):
        if end is not None and e.time_range.start > end:
            idle[e.name] += (e.time_range.start - end) / 1e3 / n_steps
            gaps[e.name] += 1 / n_steps
        end = e.time_range.end if end is None else max(end, e.time_range.end)
    return [{"name": name, "idle_ms_per_step": t, "gaps_per_step": gaps[name]}
            for name, t in idle.most_common(rows)]


def summarize(prof, n_steps: int, own_ops, top: int, kernel_rows: int = 0) -> dict:
    """Per-step counts and times from a finished profile of ``n_steps`` steps."""
    events = prof.events()
    steps, inside = _host_events_in_steps(events)
    names = [e.name for e in inside]
    counts = {name: names.count(name) / n_steps for name in HOST_CALLS}
    counts["item of a device tensor"] = _device_scalars(inside) / n_steps
    copies = {}
    for e in events:
        if e.name.startswith("Memcpy "):
            copies[e.name] = copies.get(e.name, 0) + 1 / n_steps
    for prefix in GPU_COPIES:
        counts[prefix] = sum(n for name, n in copies.items() if name.startswith(prefix))
    patterns = [p.lower() for p in own_ops]
    rows = [r for r in prof.key_averages() if r.device_type == DeviceType.CPU
            and any(p in r.key.lower() for p in patterns)]
    rows.sort(key=lambda r: r.self_cpu_time_total, reverse=True)
    return {
        "per_step": counts,
        "gpu_busy_ms_per_step": _busy_ms(events) / n_steps,
        "copy_overlap": copy_overlap(events),
        "gpu_copies_per_step": copies,
        "host_ms_per_step": sum(t - s for s, t in steps) / 1e3 / max(len(steps), 1),
        "own_ops": [{"name": r.key, "calls_per_step": r.count / n_steps,
                     "self_cpu_ms_per_step": r.self_cpu_time_total / 1e3 / n_steps,
                     "cpu_total_ms_per_step": r.cpu_time_total / 1e3 / n_steps,
                     "device_total_ms_per_step": r.device_time_total / 1e3 / n_steps}
                    for r in rows[:top]],
        "gpu_kernels": gpu_time_by_name(events, n_steps, kernel_rows) if kernel_rows else [],
        "gpu_idle_before": gpu_idle_by_next(events, n_steps, kernel_rows) if kernel_rows else [],
    }
