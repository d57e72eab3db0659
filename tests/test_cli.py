"""The main job: ``bitsparse demo`` / ``python -m bitsparse_core demo`` on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bitsparse_core import demo
from bitsparse_core.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_codec_table_rows_are_exact_and_match_formula(capsys):
    backend, rows = demo.codec_table(numel=5000, seed=3)
    assert len(rows) == len(demo.DTYPES) * len(demo.SPARSITIES)
    assert all(r["exact"] and r["packed"] == r["formula"] for r in rows)
    assert demo.print_codec_table(backend, 5000, rows)
    assert "bit-exact" in capsys.readouterr().out


def test_relu_like_has_the_requested_sparsity():
    import numpy as np
    x = demo.relu_like(np.random.default_rng(0), 100_000, 0.9, demo.DTYPES[0])
    zeros = np.count_nonzero(x.view(np.uint16) == 0) / x.size
    assert abs(zeros - 0.9) < 0.01
    assert not np.any(x.view(np.uint16) >> 15)


def test_python_m_demo_runs_end_to_end():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "bitsparse_core", "demo"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all round trips bit-exact" in out.stdout


def test_cli_rejects_unknown_command(capsys):
    try:
        main(["frobnicate"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("argparse should have exited")
