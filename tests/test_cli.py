"""The command line: ``bitsparse demo`` / ``python -m bitsparse_core demo`` (the README's
main command, unchanged), its options and ``--json``, ``inspect FILE`` and ``--version``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


# ------------------------------------------------------------------ --version
def test_version(capsys):
    import bitsparse_core
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"bitsparse_core {bitsparse_core.__version__} (format v1)"


# ---------------------------------------------------------------- demo options
def _json_demo(capsys, *args) -> dict:
    rc = main(["demo", "--json", *args])
    report = json.loads(capsys.readouterr().out)
    assert rc == (0 if report["ok"] else 1)
    return report


def test_demo_options_and_json(capsys):
    report = _json_demo(capsys, "--numel", "3000", "--dtypes", "bf16,float32,e5m2",
                        "--sparsities", "0.5,0.95", "--encoding", "signplane", "--backend",
                        "numpy", "--seed", "7", "--no-training")
    assert report["ok"] and report["backend"] == "numpy" and report["numel"] == 3000
    assert report["training"] is None and report["training_skipped"] == "--no-training"
    rows = report["codec"]
    assert [(r["dtype"], r["sparsity"]) for r in rows] == [
        (d, s) for d in ("bfloat16", "float32", "float8_e5m2") for s in (0.5, 0.95)]
    for r in rows:
        assert r["exact"] and r["packed"] == r["formula"] and r["encoding"] == "signplane"
        assert r["ratio"] == pytest.approx(r["dense"] / r["packed"])
        assert r["dense"] == 3000 * {"bfloat16": 2, "float32": 4, "float8_e5m2": 1}[r["dtype"]]


def test_demo_training_reports_min_and_median_with_pinned_threads(capsys):
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsparse_core.torch")
    threads = torch.get_num_threads()
    report = _json_demo(capsys, "--numel", "1000", "--dtypes", "fp16", "--sparsities", "0.8",
                        "--steps", "3")
    assert torch.get_num_threads() == threads                # restored afterwards
    training = report["training"]
    assert training["steps"] == 3
    if training["device"] == "cpu":
        assert training["threads"] == 1
    assert set(training["rows"]) == {"dense", "packed (nosign)", "packed (raw)"}
    for row in training["rows"].values():
        assert row["losses_equal_dense"] and len(row["losses"]) == 3
        assert 0 < row["min_ms"] <= row["median_ms"]


def test_demo_text_report_names_min_and_median(capsys):
    pytest.importorskip("torch")
    pytest.importorskip("bitsparse_core.torch")
    assert main(["demo", "--numel", "1000", "--dtypes", "fp32", "--sparsities", "0.9",
                 "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "min ms" in out and "median ms" in out and "all round trips bit-exact" in out


@pytest.mark.parametrize("args", [["--sparsities", "1.5"], ["--sparsities", ""],
                                  ["--dtypes", "float64"], ["--numel", "0"],
                                  ["--encoding", "zip"], ["--backend", "tpu"]])
def test_demo_rejects_bad_options(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", *args])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_demo_unavailable_backend_is_a_clean_error(capsys):
    import bitsparse_core as bc
    if bc.backend_available("cupy"):
        pytest.skip("CuPy backend available here")
    assert main(["demo", "--backend", "cupy", "--no-training"]) == 2
    assert "not available" in capsys.readouterr().err


# --------------------------------------------------------------------- inspect
def _buffer(tmp_path, name="t.bspk", **kwargs):
    import numpy as np
    import bitsparse_core as bc
    x = np.zeros((3, 700), np.float32)
    x[0, ::3] = 2.0
    x[2, 5] = -1.0
    buf = bc.pack(x, **kwargs).to_bytes()
    path = tmp_path / name
    path.write_bytes(buf)
    return path, buf


def test_inspect_prints_the_header(tmp_path, capsys):
    path, buf = _buffer(tmp_path, encoding="signplane", chunk_log2=9)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    for text in ("valid format-v1 buffer", "shape:      (3, 700), 2,100 elements",
                 "dtype:      float32", "encoding:   signplane", "nnz:        235 (11.19 %",
                 "capacity:   235", "chunk_log2: 9 (512 elements per chunk",
                 f"total:      {len(buf):,} B (dense 8,400 B)",
                 f"ratio:      {8400 / len(buf):.2f}x", "signs:      30 B at offset"):
        assert text in out, (text, out)


def test_inspect_json_matches_the_spec_reader(tmp_path, capsys):
    import bitsparse_core as bc
    path, buf = _buffer(tmp_path)
    assert main(["inspect", "--json", str(path)]) == 0
    d = json.loads(capsys.readouterr().out)
    h = bc.validate(buf)
    assert d["valid"] and d["shape"] == [3, 700] and d["dtype"] == "float32"
    assert d["encoding"] == h.encoding.name.lower() == "raw"   # auto: a negative value
    assert (d["nnz"], d["capacity"], d["total_size"]) == (h.nnz, h.capacity, len(buf))
    assert [(s["offset"], s["length"]) for s in d["sections"].values()] == list(h.sections)
    assert d["ratio"] == pytest.approx(8400 / len(buf))


def test_inspect_reads_stdin():
    import bitsparse_core as bc
    import numpy as np
    buf = bc.pack(np.ones(5, np.float16)).to_bytes()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "bitsparse_core", "inspect", "-"], input=buf,
                         cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert b"<stdin>: a valid format-v1 buffer" in out.stdout and b"float16" in out.stdout


def _corrupt(buf: bytes, how: str) -> bytes:
    b = bytearray(buf)
    if how == "truncated":
        return bytes(b[:-1])
    if how == "magic":
        b[0] ^= 0xFF
    elif how == "payload":
        b[-1] ^= 0x01
    elif how == "trailing":
        b += b"\0"
    return bytes(b)


@pytest.mark.parametrize("how, error", [("truncated", "TruncatedBufferError"),
                                        ("magic", "BadMagicError"),
                                        ("payload", "ChecksumError"),
                                        ("trailing", "TrailingBytesError"),
                                        ("empty", "TruncatedBufferError")])
def test_inspect_names_the_broken_rule_and_fails(tmp_path, capsys, how, error):
    path, buf = _buffer(tmp_path)
    path.write_bytes(b"" if how == "empty" else _corrupt(buf, how))
    assert main(["inspect", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{path}: invalid buffer: {error}:" in captured.err


def test_inspect_unreadable_file(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.bspk")]) == 2
    assert "cannot read" in capsys.readouterr().err
