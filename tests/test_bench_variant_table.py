"""bench/variant_table.py reads kernel_variants.py's output as it prints it, takes each
variant's minimum over its runs and divides by the base's minimum."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import variant_table  # noqa: E402

RUN_A = """(default)                    bfloat16       s=0.5 pack fixed   190.0 us
(default)                    bfloat16       s=0.5 unpack       120.4 us
(default)                    float8_e4m3fn  s=0.9 pack fixed    88.6 us
"""
RUN_B = """-DX=0                        bfloat16       s=0.5 pack fixed   171.0 us
-DX=0                        bfloat16       s=0.5 unpack       121.0 us
-DX=0                        float8_e4m3fn  s=0.9 pack fixed    90.0 us
"""


def test_minimum_per_variant_over_the_base(tmp_path):
    logs = {}
    for name, text in (("a1", RUN_A), ("b1", RUN_B), ("b2", RUN_B.replace("171.0", "169.1")),
                       ("a2", RUN_A.replace("190.0", "195.0"))):
        logs[name] = tmp_path / f"{name}.log"
        logs[name].write_text(text)
    rc = variant_table.main([f"base={logs['a1']}", f"new={logs['b1']}", f"new={logs['b2']}",
                             f"base={logs['a2']}", "--base", "base", "--out", str(tmp_path),
                             "--stem", "t"])
    assert rc == 0
    rows = {(r["kind"], r["dtype"], r["sparsity"]): r["variants"]
            for r in json.loads((tmp_path / "t.json").read_text())["rows"]}
    assert len(rows) == 3
    pack = rows[("pack fixed", "bfloat16", 0.5)]
    assert pack["base"]["runs_us"] == [190.0, 195.0] and pack["base"]["min_us"] == 190.0
    assert pack["new"]["min_us"] == 169.1
    assert pack["new"]["over_base"] == pytest.approx(169.1 / 190.0)
    assert rows[("unpack", "bfloat16", 0.5)]["new"]["over_base"] == pytest.approx(121.0 / 120.4)
    table = (tmp_path / "t.md").read_text()
    assert "| pack fixed | bfloat16 | 0.5 | 190.0 (1.000) | 169.1 (0.890) |" in table


def test_a_row_without_a_base_run_is_refused():
    runs = [("base", variant_table.parse(RUN_A)[:1]), ("new", variant_table.parse(RUN_B))]
    with pytest.raises(SystemExit, match="no 'base' run"):
        variant_table.summarize(runs, "base")
