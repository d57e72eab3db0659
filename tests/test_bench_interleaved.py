"""bench/interleaved.py: turn-by-turn step timing, on a fake clock."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import interleaved  # noqa: E402


class Clock:
    """perf_counter for the module under test: steps advance it by what they cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_ratios_within_turns_cancel_the_drift(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(interleaved.time, "perf_counter", clock)
    order = []

    def step(name, cost):
        def run(i):
            order.append((i, name))
            clock.now += cost * (1.0 + 0.5 * (i % 3))   # the host slows and recovers, by turn
        return run
    steps = {"dense": step("dense", 0.010), "ours": step("ours", 0.011),
             "ckpt": step("ckpt", 0.013)}
    res = interleaved.run_turns(steps, "dense", turns=6, warmup=2, sync=lambda: None,
                                own_references={"ckpt": "ours", "ours": "dense"})
    assert res["turns"] == 6 and res["warmup"] == 2
    # each turn runs every variant once, the order rotated by one each turn
    assert [n for i, n in order if i == 0] == ["dense", "ours", "ckpt"]
    assert [n for i, n in order if i == 1] == ["ours", "ckpt", "dense"]
    assert len(res["variants"]["dense"]["step_ms"]) == 6
    ours = res["variants"]["ours"]
    assert len(ours["ratios"]) == 6
    assert "ratios" not in res["variants"]["dense"]
    # the times vary 2x with the host's speed; the ratios within a turn do not
    times = res["variants"]["dense"]["step_ms"]
    assert max(times) / min(times) == pytest.approx(2.0)
    assert ours["ratios"] == pytest.approx([1.1] * 6)
    assert res["variants"]["ckpt"]["median_ratio"] == pytest.approx(1.3)
    # against a variant's own reference too (ours' own is the main one: nothing added)
    assert res["variants"]["ckpt"]["median_ratio_vs_own"] == pytest.approx(1.3 / 1.1)
    assert "own_reference" not in res["variants"]["ours"]
    lines = interleaved.markdown(res)
    assert lines[0] == "## Interleaved steps" and any(line.startswith("| ours |") for line in lines)


def test_blocks_time_a_variants_later_steps(monkeypatch):
    """block=3: each turn runs 3 consecutive steps of a variant (step indices go on from
    turn to turn), the first untimed; the turn's time is the mean of the other two. A
    variant's first step after another's costs more (its caches cold), which the ratio
    of blocks leaves out and single steps do not."""
    clock = Clock()
    monkeypatch.setattr(interleaved.time, "perf_counter", clock)
    order, last = [], [None]

    def step(name, cost, cold):
        def run(i):
            order.append((i, name))
            clock.now += cost + (cold if last[0] != name else 0.0) + 0.001 * (i % 3)
            last[0] = name
        return run
    steps = {"dense": step("dense", 0.010, 0.001), "ours": step("ours", 0.010, 0.004),
             "ckpt": step("ckpt", 0.010, 0.001)}
    res = interleaved.run_turns(steps, "dense", turns=4, warmup=1, sync=lambda: None, block=3)
    assert res["block"] == 3 and res["turns"] == 4
    assert [i for i, n in order if n == "ours"] == list(range(15))
    assert [n for i, n in order[:6]] == ["dense"] * 3 + ["ours"] * 3
    # steps 3j+1 and 3j+2 are timed: 10 + 1 and 10 + 2 ms, mean 11.5, in every variant
    assert res["variants"]["dense"]["step_ms"] == pytest.approx([11.5] * 4)
    assert res["variants"]["ours"]["ratios"] == pytest.approx([1.0] * 4)
    # one step a turn: with three variants in rotation every step follows another
    # variant's, and ours pays its 4 ms against dense's 1
    single = interleaved.run_turns(steps, "dense", turns=4, warmup=1, sync=lambda: None)
    assert single["block"] == 1 and min(single["variants"]["ours"]["ratios"]) > 1.2
    assert [list(interleaved.timed_steps(t, 1, 3)) for t in range(3)] == [[], [4, 5], [7, 8]]
    assert list(interleaved.timed_steps(2, 1, 1)) == [2]
    assert any("3 consecutive steps of every variant" in line
               for line in interleaved.markdown(res))
    with pytest.raises(ValueError, match="block"):
        interleaved.run_turns(steps, "dense", 1, 0, sync=lambda: None, block=0)


def test_streamed_blocks_let_the_host_run_ahead(monkeypatch):
    """A fake GPU: a step costs the host h and queues g of GPU work, which starts once
    issued and after the work before it; a sync waits for it. With a sync around every
    step a step costs h + g, so a larger host cost shows even where the GPU is the slower
    side; in a streamed block (no sync between the timed steps) the host's lead-in is paid
    once a block, and the step time tends to g."""
    clock = Clock()
    monkeypatch.setattr(interleaved.time, "perf_counter", clock)
    gpu = [0.0]

    def step(h, g):
        def run(i):
            clock.now += h
            gpu[0] = max(gpu[0], clock.now) + g
        return run

    def sync():
        clock.now = max(clock.now, gpu[0])
    steps = {"dense": step(0.005, 0.010), "ours": step(0.008, 0.010)}
    synced = interleaved.run_turns(steps, "dense", 3, 1, sync, block=5)
    streamed = interleaved.run_turns(steps, "dense", 3, 1, sync, block=5, step_sync=False)
    assert synced["variants"]["ours"]["ratios"] == pytest.approx([18 / 15] * 3)
    # four timed steps: the GPU ends at 8 + 4 * 10 ms (ours) and 5 + 4 * 10 (dense)
    assert streamed["variants"]["ours"]["ratios"] == pytest.approx([48 / 45] * 3)
    assert streamed["variants"]["ours"]["host_ms"] == pytest.approx([8.0] * 3)
    assert streamed["step_sync"] is False and synced["step_sync"] is True
    assert any("none between the timed steps" in line for line in interleaved.markdown(streamed))
    with pytest.raises(ValueError, match="step_sync"):
        interleaved.run_turns(steps, "dense", 1, 0, sync, step_sync=False)


def test_time_limit_keeps_the_turns_timed(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(interleaved.time, "perf_counter", clock)

    def run(i):
        clock.now += 0.01

    def check_time(where):
        if where == "interleaved turn 4":
            raise RuntimeError("time limit")
    res = interleaved.run_turns({"a": run, "b": run}, "a", turns=10, warmup=1,
                                sync=lambda: None, check_time=check_time)
    assert res["turns"] == 3 and res["variants"]["b"]["median_ratio"] == pytest.approx(1.0)


def test_reference_must_be_a_variant():
    with pytest.raises(ValueError, match="reference"):
        interleaved.run_turns({"a": lambda i: None}, "dense", 1, 0, sync=lambda: None)


def test_median_interval_is_the_binomial_order_statistics():
    """n = 16: x_(4) .. x_(13) covers the median with probability 0.9787 (x_(5) .. x_(12)
    only 0.923); n = 20: x_(6) .. x_(15); too few values: no interval."""
    low, high, cov = interleaved.median_interval(range(16, 0, -1))
    assert (low, high) == (4, 13) and abs(cov - 0.97873) < 1e-4
    assert interleaved.median_interval(range(1, 21))[:2] == (6, 15)
    assert interleaved.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert interleaved.median_interval([1.0] * 6)[:2] == (1.0, 1.0)


def test_trace_ops_self_time_and_difference(tmp_path):
    """bench/trace_ops.py: an op's self time is its duration less what is nested in it on
    its thread (other threads and device events do not count), and two traces compare
    per step."""
    import gzip
    import json
    import trace_ops

    def trace(extra_us):
        ev = [
            {"ph": "X", "cat": "cpu_op", "name": "outer", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
            {"ph": "X", "cat": "cpu_op", "name": "inner", "ts": 10, "dur": 30, "pid": 1, "tid": 1},
            {"ph": "X", "cat": "cuda_runtime", "name": "launch", "ts": 15, "dur": 5,
             "pid": 1, "tid": 1},
            {"ph": "X", "cat": "cpu_op", "name": "inner", "ts": 50, "dur": 20 + extra_us,
             "pid": 1, "tid": 1},
            {"ph": "X", "cat": "cpu_op", "name": "other", "ts": 20, "dur": 500, "pid": 1, "tid": 2},
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 900, "pid": 0, "tid": 7},
        ]
        path = tmp_path / f"t{extra_us}.json.gz"
        with gzip.open(path, "wt") as fh:
            json.dump({"traceEvents": ev}, fh)
        return str(path)
    a = trace_ops.self_times(trace_ops.load(trace(0)))
    assert a == {"outer": (1, 50.0), "inner": (2, 45.0), "launch": (1, 5.0), "other": (1, 500.0)}
    b = trace_ops.self_times(trace_ops.load(trace(8)))
    rows = trace_ops.compare(a, b, steps=2, top=2)        # the two that moved, per step
    assert {r[0]: r[5] for r in rows} == {"inner": 4.0, "outer": -4.0}
    assert rows[0][1:5] in [(2 / 2, 22.5, 2 / 2, 26.5), (1 / 2, 25.0, 1 / 2, 21.0)]
