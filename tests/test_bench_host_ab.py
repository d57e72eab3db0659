"""bench/host_ab.py on what host_overhead.py prints (two CPU-smoke runs): every timed op
of both runs is read, each label's median and the differences come out of the runs'
own figures, the reports are written, and a log without figures or an unknown base
label is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import run_bench

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import host_ab  # noqa: E402


@pytest.fixture(scope="module")
def two_logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("host_ab")
    logs = []
    for k in range(2):
        out = run_bench("host_overhead.py", "--backends", "numpy", "--modes", "torch",
                        "--cpu-smoke", "--no-plot", "--no-hook", "--out", str(d / f"run{k}"),
                        timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        log = d / f"run{k}.log"
        log.write_text(out.stdout)
        logs.append(log)
    return d, logs


def test_a_b_table_from_host_overhead_logs(two_logs):
    d, (a, b) = two_logs
    runs = [host_ab.read_log(a), host_ab.read_log(b)]
    assert ("numpy", "torch", "pack_fixed") in runs[0]
    assert host_ab.main(["--base", "b", "--out", str(d / "ab"), "--stem", "t",
                         f"a={a}", f"b={b}"]) == 0
    res = json.loads((d / "ab" / "t.json").read_text())
    assert res["labels"] == ["a", "b"] and res["order"] == ["a", "b"]
    ops = {r["op"] for r in res["rows"]}
    assert {"pack_fixed", "unpack", "gated_backward"} <= ops
    assert all(r["backend"] != "torch" for r in res["rows"])       # the host's own ops
    for r in res["rows"]:
        key = (r["backend"], r["mode"], r["op"])
        assert r["median_us"] == {"a": runs[0][key], "b": runs[1][key]}
        assert r["minus_base_us"]["a"] == pytest.approx(runs[0][key] - runs[1][key])
        assert r["x_base"]["a"] == pytest.approx(runs[0][key] / runs[1][key])
    md = (d / "ab" / "t.md").read_text()
    assert "| numpy | torch | pack_fixed |" in md and "a × b" in md


def test_medians_over_several_runs_of_a_label():
    key = ("numba", "torch", "unpack")
    res = host_ab.summarise([("x", {key: 10.0}), ("y", {key: 14.0}), ("y", {key: 12.0}),
                             ("x", {key: 11.0}), ("x", {key: 30.0})], base="y")
    (row,) = res["rows"]
    assert row["median_us"] == {"x": 11.0, "y": 13.0} and row["runs"]["x"] == [10.0, 11.0, 30.0]
    assert row["minus_base_us"] == {"x": -2.0}


def test_refused(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text("nothing timed here\n")
    with pytest.raises(ValueError, match="no host-time targets"):
        host_ab.read_log(empty)
    with pytest.raises(ValueError, match="--base"):
        host_ab.summarise([("a", {("numba", "torch", "unpack"): 1.0})], base="b")
