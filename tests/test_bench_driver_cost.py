"""bench/driver_cost.py on the CPU: its report's arithmetic, and its refusal without CUDA."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import driver_cost  # noqa: E402


def test_report_gives_the_driver_share_from_the_fastest_loops():
    summary = {"environment": {"device": "X", "date_utc": "d", "torch": "t", "cupy": "c",
                               "git_commit": "abc"},
               "calls": 10, "repeats": 3,
               "driver": {"cuLaunchKernel, empty kernel": [7.0, 9.0, 8.0]},
               "ops": {"cupy": {"unpack": {"real": [15.0, 14.0, 16.0],
                                           "no_queueing": [9.0, 8.5, 20.0]},
                                "pack_exact": {"real": [60.0, 61.0, 62.0]}},
                       "numba": {"unpack": {"real": [20.0], "no_queueing": [11.0]}}}}
    md = driver_cost.markdown(summary)
    assert "| cuLaunchKernel, empty kernel | 8.00 | 7.00 |" in md
    assert "| cupy | `unpack` | 15.0 / 14.0 | 9.0 / 8.5 | 5.5 |" in md     # fastest 14 and 8.5
    assert "| cupy | `pack_exact` | 61.0 / 60.0 | - | - |" in md
    assert "| numba | `unpack` | 20.0 / 20.0 | 11.0 / 11.0 | 9.0 |" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures on a CUDA machine")
def test_without_cuda_it_exits_2_and_writes_nothing(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "driver_cost.py"),
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "no CUDA device" in run.stderr
    assert not list(tmp_path.iterdir())


def test_no_queueing_covers_every_launch_and_queueing_call_of_the_driver():
    from bitsparse_core.backends.cuda import driver
    queueing = {n for n in vars(driver) if n.startswith("launch") or n in ("memset0", "copy")}
    assert queueing <= set(driver_cost._NoQueueing.NAMES)
    with driver_cost._NoQueueing():
        assert all(getattr(driver, n)(*range(6)) is None for n in driver_cost._NoQueueing.NAMES)
    assert driver.launch_packed.__module__ == driver.__name__
