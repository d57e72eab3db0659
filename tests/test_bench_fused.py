"""bench/bench_fused.py's A/B variants are NVRTC -D switches: a switch the kernels no
longer define would compile as a silent no-op and time the default build twice, so every
switch a variant sets must still be a default the kernel sources define. The report
marks a variant whose outputs differ from the default build's."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_fused  # noqa: E402
from bitsparse_core.backends.cupy.kernels import _source  # noqa: E402


def _variants():
    return [item.partition("=")[::2] for item in bench_fused.DEFAULT_VARIANTS.split(";") if item]


@pytest.mark.parametrize("name,options", _variants())
def test_every_switch_is_one_the_kernels_define(name, options):
    sources = _source("bitsparse_pack.cu") + _source("bitsparse_unpack.cu")
    switches = re.findall(r"-D(\w+)=", options)
    assert switches, name
    for sw in switches:
        assert f"#ifndef {sw}\n#define {sw} " in sources, f"{name}: {sw} is not a kernel switch"


def test_round_tokens_leave_the_nvrtc_options():
    assert bench_fused.split_options("PACK_ROUNDS=2 -DA=1 FUSED_ROUNDS=4 -DB=0") == (
        "-DA=1 -DB=0", {"PACK_ROUNDS": 2, "FUSED_ROUNDS": 4})
    assert bench_fused.split_options("-DA=1") == ("-DA=1", {})


def test_round_tokens_name_abi_constants():
    from bitsparse_core.backends.cuda import abi
    for name in bench_fused.ROUND_TOKENS:
        assert isinstance(getattr(abi, name), int), name


def test_rounds_reach_the_abi_in_a_variant_process(monkeypatch):
    from bitsparse_core.backends.cuda import abi
    monkeypatch.setattr(abi, "PACK_ROUNDS", abi.PACK_ROUNDS)
    monkeypatch.setattr(abi, "FUSED_ROUNDS", abi.FUSED_ROUNDS)
    _, rounds = bench_fused.split_options("PACK_ROUNDS=2 FUSED_ROUNDS=4")
    monkeypatch.setenv(bench_fused.ROUNDS_ENV, json.dumps(rounds))
    bench_fused._apply_rounds()
    assert (abi.PACK_ROUNDS, abi.FUSED_ROUNDS) == (2, 4)


def _summary(digest_of_second: str) -> dict:
    rows = [{"shape": [8, 16], "density": 0.5, "op": op, "us": 10.0, "bytes": 1e6,
             "of_copy": 0.5, "digest": "d"} for op in bench_fused.OPS]
    other = [dict(r, us=15.0, digest=digest_of_second) for r in rows]
    return {"device": "GPU", "torch": "t", "cupy": "c", "date": "now", "reps": 3, "commit": "abc",
            "variants": {"default": {"rows": rows, "copy_bandwidth_Bps": 4e12, "options": ""},
                         "before": {"rows": other, "copy_bandwidth_Bps": 4e12, "options": "-DX=1"}}}


def test_report_gives_ratios_and_flags_differing_outputs():
    same = bench_fused.markdown(_summary("d"))
    assert "| 8x16 | 0.5 | `relu_pack` | 1 | 10.0 | 50% | 15.0 | 50% | 1.50 | yes |" in same
    assert "**NO**" not in same
    assert "**NO**" in bench_fused.markdown(_summary("other"))
