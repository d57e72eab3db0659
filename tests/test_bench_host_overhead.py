"""bench/host_overhead.py's small-tensor loops, taken in turns, on stand-in ops (no GPU,
no torch): the order the loops run in, and what a failing op or a spent time limit
leave in the records."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import host_overhead as ho  # noqa: E402


class _Device:
    def sync(self):
        pass

    def gpu_times_us(self, fn, reps):
        return [1.0] * reps


def _args(repeats=3):
    return SimpleNamespace(warmup=20, repeats=repeats, iters=4, gpu_reps=2)


def test_loops_run_in_turns_and_a_failing_op_stops_alone():
    order, calls = [], {"bad": 0}

    def op(name):
        def fn():
            order.append(name)
        return fn

    def bad():
        calls["bad"] += 1
        if calls["bad"] > 20 + 4:           # its warm-up and first loop pass, then it fails
            raise RuntimeError("an op that fails in its second loop")

    recs = ho.measure_small_in_turns([op("a"), bad, op("b")], _args(), _Device(),
                                     ho.Deadline(60))
    timed = order[2 * 20:]                  # after both warm-ups, the loops alone
    assert timed == (["a"] * 4 + ["b"] * 4) * 3
    for r in (recs[0], recs[2]):
        assert len(r["host_loops_us"]) == 3
        assert r["host_min_us"] == min(r["host_loops_us"]) <= r["host_us"]
        assert r["gpu_us"] == 1.0
    assert "second loop" in recs[1]["error"] and "host_us" not in recs[1]


def test_a_spent_time_limit_skips_what_has_no_loop():
    recs = ho.measure_small_in_turns([lambda: None], _args(), _Device(), ho.Deadline(-1))
    assert recs == [{"skipped": "time limit"}]


def test_a_failing_warm_up_is_an_error_and_the_rest_run():
    def broken():
        raise ValueError("no such op")

    recs = ho.measure_small_in_turns([broken, lambda: None], _args(2), _Device(),
                                     ho.Deadline(60))
    assert "no such op" in recs[0]["error"]
    assert len(recs[1]["host_loops_us"]) == 2
