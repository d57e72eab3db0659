"""bench/gemm_host.py: each named setting sets the flags train_gpt.py's differ by, and no other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[1] / "bench"

PROBE = """
import json, os, sys
sys.path.insert(0, {bench!r})
import torch, gemm_host
gemm_host.apply_settings({name!r})
print(json.dumps([torch.are_deterministic_algorithms_enabled(),
                  torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
                  os.environ.get("CUBLAS_WORKSPACE_CONFIG")]))
"""


@pytest.mark.parametrize("name, want", [
    ("bench", [True, False, ":4096:8"]),
    ("defaults", [False, True, None]),
    ("no-bf16-reduction", [False, False, None]),
    ("deterministic", [True, True, ":4096:8"]),
])
def test_settings_set_their_flags(name, want, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    out = subprocess.run([sys.executable, "-c", PROBE.format(bench=str(BENCH), name=name)],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want


def test_markdown_has_a_row_per_setting():
    sys.path.insert(0, str(BENCH))
    import gemm_host
    rows = [{"setting": s, "device": "X", "host_us": {"addmm with bias": 1.0, "mm": 2.0,
                                                      "x + x": 3.0}} for s in ("bench", "defaults")]
    text = gemm_host.markdown(rows)
    assert "| bench | 1.0 | 2.0 | 3.0 |" in text and "| defaults |" in text
    with pytest.raises(ValueError, match="unknown setting"):
        gemm_host.apply_settings("fast")
