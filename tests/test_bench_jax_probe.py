"""bench/jax_recompute_probe.py on the CPU at a tiny size: it compiles each candidate
recompute, restores the adapter's own rule afterwards, and reports bit identity (on the
CPU every candidate is identical; the GPU run is what tells them apart)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


def test_probe_reports_each_candidate_and_restores_the_adapter(tmp_path):
    import jax_recompute_probe as probe
    from bitsparse_core.jax import ffn
    own = ffn._recompute_up
    assert probe.main(["--layers", "1", "--d", "64", "--f", "256", "--tokens", "128",
                       "--kinds", "relu,gated", "--contexts", "scan",
                       "--candidates", "current,output-barrier", "--out", str(tmp_path)]) == 0
    assert ffn._recompute_up is own
    rows = json.loads((tmp_path / "jax_recompute_probe.json").read_text())["rows"]
    assert [(r["kind"], r["candidate"]) for r in rows] == [
        ("relu", "current"), ("relu", "output-barrier"), ("gated", "current"),
        ("gated", "output-barrier")]
    assert all(r["bit_identical"] for r in rows)
    assert "| scan | gated | current | True |" in (tmp_path / "jax_recompute_probe.md").read_text()
