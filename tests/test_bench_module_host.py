"""bench/module_host.py on the CPU at a tiny size: every variant runs forward and
backward, and the results files say what the bench measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import module_host  # noqa: E402


def test_module_host_cpu_smoke(tmp_path):
    assert module_host.main(["--device", "cpu", "--tokens", "4", "--d", "32", "--ff", "64",
                             "--iters", "3", "--repeats", "1", "--cprofile", "packed-nosign",
                             "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "module_host.json").read_text())
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"dense", "checkpoint", "packed-nosign", "packed-python", "packed-raw",
                         "packed-offload"}
    for r in rows.values():
        assert r["forward_us"] > 0 and r["train_us"] > 0
        assert r["backward_us"] == pytest.approx(r["train_us"] - r["forward_us"])
    assert rows["dense"]["train_x_dense"] == 1.0
    assert "| packed-offload |" in (tmp_path / "module_host.md").read_text()
    assert "## packed-nosign" in (tmp_path / "module_host_cprofile.txt").read_text()


def test_loops_in_turn_rotate_and_time_every_function(monkeypatch):
    """Each repeat times one loop of every function, the order rotated by one per repeat."""
    now = [0.0]
    monkeypatch.setattr(module_host.time, "perf_counter", lambda: now[0])
    order = []

    def fn(name, cost):
        def run():
            order.append(name)
            now[0] += cost
        return run
    out = module_host.loops_in_turn({"a": fn("a", 1e-6), "b": fn("b", 2e-6), "c": fn("c", 3e-6)},
                                    n=2, repeats=3, sync=lambda: None)
    assert order[:6] == ["a", "a", "b", "b", "c", "c"] and order[6:8] == ["b", "b"]
    assert order[12:14] == ["c", "c"]
    assert out == {k: [pytest.approx(v)] * 3 for k, v in (("a", 1.0), ("b", 2.0), ("c", 3.0))}
