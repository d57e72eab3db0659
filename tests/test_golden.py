"""Frozen buffers in tests/golden/, re-decoded every run: any format change breaks CI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import bitsparse_core as bc

GOLDEN = Path(__file__).resolve().parent / "golden"
NAMES = sorted(p.name[:-5] for p in GOLDEN.glob("*.bspk"))


def test_fixtures_present():
    assert len(NAMES) >= 8


@pytest.mark.parametrize("name", NAMES)
def test_golden_decodes_to_frozen_tensor(name):
    buf = (GOLDEN / f"{name}.bspk").read_bytes()
    bits = np.load(GOLDEN / f"{name}.bits.npy")
    bc.validate(buf)
    p = bc.from_bytes(buf)
    y = np.asarray(bc.unpack(p))
    assert y.shape == bits.shape
    assert np.array_equal(y.view(p.dtype.uint), bits)


@pytest.mark.parametrize("name", NAMES)
def test_golden_reencodes_byte_for_byte(name):
    buf = (GOLDEN / f"{name}.bspk").read_bytes()
    p = bc.from_bytes(buf)
    bits = np.load(GOLDEN / f"{name}.bits.npy")
    again = bc.pack(bits, dtype=p.dtype, encoding=p.encoding, chunk_log2=p.chunk_log2)
    assert again.to_bytes() == buf
