"""bench/host_by_op.py at bench_hf.py's tiny size on the CPU: each phase of each variant is
profiled, the converted model's packed ops show up as ops plain does not run, plain's
differences from itself are zero, and a bad variant list is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import run_bench

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def _run(tmp_path, *extra):
    return run_bench("host_by_op.py", "--device", "cpu", "--small", "--out", str(tmp_path),
                     *extra)


def test_host_by_op_small_on_cpu(tmp_path):
    out = _run(tmp_path, "--variants", "plain,converted", "--steps", "2", "--warmup", "1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "host_by_op.json").read_text())
    assert summary["turns"] == 2 and list(summary["variants"]) == ["plain", "converted"]
    plain, conv = summary["variants"]["plain"], summary["variants"]["converted"]
    for phase in ("forward", "backward"):
        assert plain[phase]["minus_base_us"] == 0
        assert all(r["minus_base_us"] == 0 and r["minus_base_calls"] == 0
                   for r in plain[phase]["ops"])
        assert plain[phase]["total_us"] > 0
    by_op = {r["op"]: r for r in conv["forward"]["ops"]}
    # each of the two layers' FFN runs as the packed op, once a step, which plain never calls
    assert by_op["bitsparse::relu_linear"]["calls"] == 2
    assert by_op["bitsparse::relu_linear"]["minus_base_calls"] == 2
    assert {r["op"]: r for r in conv["backward"]["ops"]}[
        "bitsparse::relu_linear_backward"]["calls"] == 2
    md = (tmp_path / "host_by_op.md").read_text()
    assert md.startswith("# Host time by op, each variant against plain (cpu)")
    assert "## converted, forward" in md and "| bitsparse::relu_linear |" in md


def test_compare_sums_per_step_against_plain():
    import host_by_op
    books = {"plain": {"forward": {"aten::relu": [4, 40.0]}, "backward": {}},
             "hooks": {"forward": {"aten::relu": [4, 100.0], "aten::slice": [2, 10.0]},
                       "backward": {}}}
    res = host_by_op.compare(books, turns=2)
    f = res["hooks"]["forward"]
    assert f["minus_base_us"] == 35.0 and f["total_us"] == 55.0
    assert [r["op"] for r in f["ops"]] == ["aten::relu", "aten::slice"]     # by |difference|
    assert f["ops"][0] == {"op": "aten::relu", "calls": 2.0, "us": 50.0, "minus_base_us": 30.0,
                           "minus_base_calls": 0.0}
    assert f["ops"][1]["minus_base_calls"] == 1.0
    assert res["plain"]["forward"]["minus_base_us"] == 0


def test_host_by_op_refuses_a_list_without_plain(tmp_path):
    out = _run(tmp_path, "--variants", "hooks,converted", "--steps", "1")
    assert out.returncode != 0 and "plain" in out.stderr
    assert not (tmp_path / "host_by_op.json").exists()
