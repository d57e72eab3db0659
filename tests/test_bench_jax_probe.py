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


def test_temp_probe_compiles_the_step_and_summarises_a_dump(tmp_path, capsys):
    """bench/jax_temp_probe.py: the step's temp size from memory_analysis, and the summary
    of an XLA memory-usage report (a report written the way XLA writes one)."""
    import jax_temp_probe as probe
    report = ["Memory Space: default (color=0)", "Total bytes: 3 (3B)", "  header", "  ----",
              " 2B(67%); 2B; 0; 1; u8[2]", " 3B(100%); 1B; 2; 1; u8[1]"]
    (tmp_path / "module_0007.jit_stack_loss.sm_9.0_gpu_after_optimizations-memory-usage-report.txt"
     ).write_text("\n".join(report) + "\n")
    out = tmp_path / "summary.md"
    probe.main(["--mode", "packed", "--layers", "1", "--d", "64", "--f", "256", "--tokens",
                "128", "--summary", str(tmp_path), "--top", "1", "--out", str(out)])
    rec = json.loads(capsys.readouterr().out.splitlines()[0])
    assert rec["mode"] == "packed" and rec["temp_gib"] > 0
    text = out.read_text()
    assert "u8[2]" in text and "u8[1]" not in text        # the first --top rows only
    assert probe.usage_report(str(tmp_path / "none"), 5) == ("", [])
    from bitsparse_core.jax import ffn
    own = ffn._dw2_first
    probe.main(["--mode", "packed", "--ordering", "as-scheduled", "--layers", "1", "--d", "64",
                "--f", "256", "--tokens", "128"])
    assert ffn._dw2_first is own                          # the adapter's own ordering back
    assert json.loads(capsys.readouterr().out.splitlines()[0])["ordering"] == "as-scheduled"
