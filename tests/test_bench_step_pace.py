"""bench/step_pace.py at bench_hf.py's tiny size on the CPU: the turns run, the reports are
written, the GPU columns stay empty off CUDA, and a bad variant list is refused."""

from __future__ import annotations

import json

import pytest
from helpers import run_bench

pytest.importorskip("torch")
pytest.importorskip("transformers")


def _run(tmp_path, *extra):
    return run_bench("step_pace.py", "--device", "cpu", "--small", "--out", str(tmp_path),
                     *extra, timeout=120)


def test_step_pace_small_on_cpu(tmp_path):
    out = _run(tmp_path, "--turns", "3", "--warmup", "1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "step_pace.json").read_text())
    inter = summary["interleaved"]
    assert inter["status"] == "ok" and inter["turns"] == 3
    assert list(inter["variants"]) == ["plain", "hooks", "noop-hooks"]
    for name, rec in inter["variants"].items():
        assert len(rec["step_ms"]) == 3 and rec["median_step_ms"] > 0, name
        assert (name == "plain") == ("median_ratio" not in rec)
    assert summary["gpu"] == {"plain": None, "hooks": None, "noop-hooks": None}
    md = (tmp_path / "step_pace.md").read_text()
    assert md.startswith("# Which side paces the OPT step (cpu)")
    assert "| hooks |" in md and "| noop-hooks |" in md


def test_step_pace_refuses_a_list_without_plain(tmp_path):
    out = _run(tmp_path, "--variants", "hooks,noop-hooks", "--turns", "1")
    assert out.returncode != 0 and "plain" in out.stderr
    assert not (tmp_path / "step_pace.json").exists()
