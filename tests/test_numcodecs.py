"""The numcodecs codec (``id: "bitsparse"``) and its zarr format 2 / 3 round trips.

numcodecs' own conformance helpers (``numcodecs.tests.common``) are used where they
fit: ``check_encode_decode``, ``check_config``, ``check_repr`` and
``check_backwards_compatibility`` (fixtures frozen in tests/golden/numcodecs/).
Skips cleanly where numcodecs / zarr are not installed (``pip install -e .[numcodecs]``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

numcodecs = pytest.importorskip("numcodecs")
common = pytest.importorskip("numcodecs.tests.common")

import bitsparse_core as bc  # noqa: E402
from bitsparse_core import dtypes as D  # noqa: E402
from bitsparse_core.numcodecs import Bitsparse  # noqa: E402
from helpers import random_tensor, same_bits  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "golden" / "numcodecs"
SHAPE = (37, 29)  # 1073 elements: three chunks at chunk_log2=9, a ragged last mask byte


def relu_like(dtype: D.DType, shape=SHAPE, sparsity=0.8, seed=0) -> np.ndarray:
    return random_tensor(np.random.default_rng(seed), shape, dtype, sparsity, signed=False)


def signed(dtype: D.DType, shape=SHAPE, sparsity=0.7, seed=1) -> np.ndarray:
    return random_tensor(np.random.default_rng(seed), shape, dtype, sparsity)


# ------------------------------------------------------------ encode / decode
@pytest.mark.parametrize("dtype", D.ALL, ids=lambda d: d.name)
@pytest.mark.parametrize("encoding", ["auto", "raw", "nosign", "signplane"])
@pytest.mark.parametrize("order", ["C", "F"])
def test_check_encode_decode(dtype, encoding, order):
    """numcodecs' helper: numpy / bytes / bytearray / array.array in, every buffer type
    out, decode into a numpy array and a bytearray. The codec names the dtype, since
    plain bytes carry none. The helper compares with NumPy, which neither tells -0.0
    from 0.0 nor sees NaN in ml_dtypes arrays: it gets the bits (uint16 for bfloat16),
    which makes its comparison bit-exact."""
    arr = relu_like(dtype) if encoding == "nosign" else signed(dtype)
    codec = Bitsparse(encoding=encoding, chunk_log2=9, dtype=dtype.name)
    common.check_encode_decode(np.asarray(arr.view(dtype.uint), order=order), codec)
    if dtype in (D.FLOAT16, D.FLOAT32) and order == "C":   # NumPy floats as they are
        common.check_encode_decode(arr, codec)


@pytest.mark.parametrize("dtype", D.ALL, ids=lambda d: d.name)
def test_float_input_needs_no_dtype_and_keeps_shape(dtype):
    arr = signed(dtype)
    enc = Bitsparse().encode(arr)
    assert enc == bc.pack(arr).to_bytes()          # the format-v1 buffer, byte for byte
    bc.validate(enc)
    dec = Bitsparse().decode(enc)
    assert isinstance(dec, np.ndarray) and dec.dtype == dtype.numpy and dec.shape == SHAPE
    assert same_bits(dec, arr, dtype)


@pytest.mark.parametrize("dtype", [D.BFLOAT16, D.FLOAT8_E4M3FN, D.FLOAT8_E5M2],
                         ids=lambda d: d.name)
def test_integer_bits_with_dtype(dtype):
    """bfloat16 / float8 as their bits (uint16 / uint8), as zarr stores them."""
    arr = signed(dtype)
    bits = arr.view(dtype.uint)
    codec = Bitsparse(dtype=dtype.name)
    enc = codec.encode(bits)
    assert enc == bc.pack(arr).to_bytes()
    dec = codec.decode(enc)
    assert dec.dtype == dtype.numpy and dec.shape == SHAPE     # the stored dtype
    assert np.array_equal(dec.view(dtype.uint), bits)
    out = np.empty_like(bits)
    assert codec.decode(enc, out=out) is out and np.array_equal(out, bits)


def test_decode_into_out():
    arr = relu_like(D.FLOAT32)
    enc = Bitsparse().encode(arr)
    out = np.full(SHAPE, np.nan, np.float32)
    assert Bitsparse().decode(enc, out=out) is out and same_bits(out, arr, D.FLOAT32)
    flat = np.empty(arr.size, np.float32)               # any shape of the right size
    Bitsparse().decode(enc, out=flat)
    assert same_bits(flat, arr.reshape(-1), D.FLOAT32)
    fortran = np.empty(SHAPE, np.float32, order="F")    # numcodecs: out is a buffer, filled
    Bitsparse().decode(enc, out=fortran)                # in its memory order
    assert same_bits(fortran.reshape(-1, order="A"), arr.reshape(-1), D.FLOAT32)
    with pytest.raises(ValueError, match="needs 4292"):
        Bitsparse().decode(enc, out=np.empty(arr.size + 1, np.float32))


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 5), (1,), (4097,)])
def test_edge_shapes(shape):
    arr = signed(D.FLOAT16, shape=shape)
    dec = Bitsparse().decode(Bitsparse().encode(arr))
    assert dec.shape == shape and same_bits(dec, arr, D.FLOAT16)


def test_encode_errors_are_named():
    x = relu_like(D.FLOAT32)
    with pytest.raises(bc.UnsupportedDTypeError, match="dtype="):
        Bitsparse().encode(x.view(np.uint32))                  # bits without a dtype
    with pytest.raises(bc.UnsupportedDTypeError):
        Bitsparse().encode(np.zeros(3, np.float64))
    with pytest.raises(bc.UnsupportedDTypeError, match="float32.*bfloat16"):
        Bitsparse(dtype="bfloat16").encode(x)                  # float of another dtype
    with pytest.raises(ValueError, match="whole number"):
        Bitsparse(dtype="float32").encode(b"\x00" * 6)
    with pytest.raises(bc.NonContiguousError):
        Bitsparse().encode(x[:, ::2])
    with pytest.raises(ValueError, match="contiguous"):
        Bitsparse().decode(Bitsparse().encode(x), out=np.empty((37, 58), np.float32)[:, ::2])
    with pytest.raises(bc.EncodingError):
        Bitsparse(encoding="nosign").encode(-np.ones(8, np.float32))


def test_decode_errors_are_named():
    enc = bytearray(Bitsparse().encode(relu_like(D.FLOAT16)))
    enc[-1] ^= 1
    with pytest.raises(bc.ChecksumError):
        Bitsparse().decode(enc)
    with pytest.raises(bc.TruncatedBufferError):
        Bitsparse().decode(b"BSPK")


@pytest.mark.parametrize("kwargs, error", [
    (dict(encoding="zip"), ValueError), (dict(encoding=1), ValueError),
    (dict(chunk_log2=8), ValueError), (dict(chunk_log2=25), ValueError),
    (dict(chunk_log2=12.0), TypeError), (dict(chunk_log2=True), TypeError),
    (dict(dtype="float64"), bc.UnsupportedDTypeError), (dict(dtype="uint16"), bc.UnsupportedDTypeError),
])
def test_bad_config_is_refused(kwargs, error):
    with pytest.raises(error):
        Bitsparse(**kwargs)


# --------------------------------------------------------------------- config
@pytest.mark.parametrize("codec", [Bitsparse(), Bitsparse("raw", 9), Bitsparse(dtype="bf16"),
                                   Bitsparse(encoding="SIGNPLANE", chunk_log2=24,
                                             dtype="e5m2")])
def test_check_config(codec):
    common.check_config(codec)   # JSON round trip, then numcodecs.get_codec(config) == codec


def test_config_is_canonical_and_names_dtype_only_when_set():
    assert Bitsparse().get_config() == {"id": "bitsparse", "encoding": "auto", "chunk_log2": 12}
    assert Bitsparse("NoSign", 10, "bf16").get_config() == {
        "id": "bitsparse", "encoding": "nosign", "chunk_log2": 10, "dtype": "bfloat16"}
    assert Bitsparse(dtype="bf16") == Bitsparse(dtype="bfloat16") != Bitsparse()
    assert Bitsparse.from_config({"id": "bitsparse", "dtype": "fp16"}).dtype == "float16"


@pytest.mark.parametrize("stmt", ["Bitsparse(encoding='auto', chunk_log2=12)",
                                  "Bitsparse(encoding='raw', chunk_log2=9, dtype='bfloat16')"])
def test_check_repr(stmt, monkeypatch):
    # numcodecs' helper evals in its own module's namespace: put the class there.
    monkeypatch.setattr(common, "Bitsparse", Bitsparse, raising=False)
    common.check_repr(stmt)


# ---------------------------------------------------------------- frozen data
BACKWARDS = {
    # prefix: (arrays, codecs); every codec must accept every array of its group
    "float": (lambda: [relu_like(D.FLOAT32, (6, 100)), signed(D.FLOAT16, (700,)),
                       signed(D.FLOAT32, (2, 3, 4))],
              [Bitsparse(), Bitsparse("raw"), Bitsparse("signplane", 9)]),
    "bfloat16": (lambda: [relu_like(D.BFLOAT16, (5, 300)).view(np.uint16),
                          signed(D.BFLOAT16, (513,)).view(np.uint16)],
                 [Bitsparse(dtype="bfloat16"), Bitsparse("signplane", 9, "bfloat16")]),
    "float8": (lambda: [relu_like(D.FLOAT8_E4M3FN, (40, 40)).view(np.uint8),
                        signed(D.FLOAT8_E5M2, (1000,)).view(np.uint8)],
               [Bitsparse(dtype="float8_e4m3fn"), Bitsparse("raw", 9, "float8_e5m2")]),
}


@pytest.mark.parametrize("prefix", sorted(BACKWARDS))
def test_check_backwards_compatibility(prefix, monkeypatch):
    """Buffers and configs written once (tests/golden/numcodecs/) must still decode."""
    arrays, codecs = BACKWARDS[prefix]
    fixture = FIXTURES / "fixture" / "bitsparse" / prefix
    # The helper silently writes missing fixtures; frozen ones must already be there.
    assert len(list(fixture.glob("array.*.npy"))) == len(arrays()), fixture
    assert len(list(fixture.glob("codec.*/encoded.*.dat"))) == len(arrays()) * len(codecs)
    monkeypatch.chdir(FIXTURES)
    common.check_backwards_compatibility("bitsparse", arrays(), codecs, prefix=prefix)


# --------------------------------------------------------------- entry points
def _installed_entry_point(group: str) -> bool:
    """Whether the installed metadata (not just pyproject.toml) declares the codec."""
    return any(e.name == "bitsparse" and e.value.startswith("bitsparse_core.")
               for e in metadata.entry_points(group=group))


def _fresh_python(code: str, cwd) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_get_codec_finds_the_entry_point_without_an_import(tmp_path):
    if not _installed_entry_point("numcodecs.codecs"):
        pytest.skip("installed metadata predates the entry point: pip install -e .")
    out = _fresh_python(
        "import sys, numcodecs\n"
        "c = numcodecs.get_codec({'id': 'bitsparse', 'dtype': 'bf16'})\n"
        "print(type(c).__module__, c.dtype, 'bitsparse_core' in sys.modules)\n", tmp_path)
    assert out.split() == ["bitsparse_core.numcodecs", "bfloat16", "True"]


# ------------------------------------------------------------------------ zarr
zarr_param = pytest.mark.parametrize("dtype, zarr_dtype", [
    (D.FLOAT16, "float16"), (D.FLOAT32, "float32"),
    (D.BFLOAT16, "uint16"), (D.FLOAT8_E4M3FN, "uint8"), (D.FLOAT8_E5M2, "uint8")],
    ids=lambda v: getattr(v, "name", v))


def _zarr_data(dtype: D.DType, zarr_dtype: str):
    """An array zarr can hold: floats natively, bfloat16 / float8 as their bits."""
    x = relu_like(dtype, (50, 70))
    native = zarr_dtype.startswith("float")
    return (x if native else x.view(dtype.uint)), (None if native else dtype.name)


def _write(path, data, **kwargs):
    zarr = pytest.importorskip("zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no "not in the zarr spec" or other warnings
        z = zarr.create_array(str(path), shape=data.shape, chunks=(16, 32), dtype=data.dtype,
                              **kwargs)
        z[:] = data
        back = zarr.open_array(str(path), mode="r")[:]
    assert back.dtype == data.dtype and back.tobytes() == data.tobytes()   # bit for bit
    return z


@zarr_param
@pytest.mark.parametrize("role, order", [("compressor", "C"), ("compressor", "F"),
                                         ("filter", "C")])
def test_zarr_format_2(tmp_path, dtype, zarr_dtype, role, order):
    data, name = _zarr_data(dtype, zarr_dtype)
    codec = Bitsparse(dtype=name)
    kwargs = (dict(compressors=codec) if role == "compressor"
              else dict(filters=[codec], compressors=numcodecs.Zstd(level=1)))
    _write(tmp_path / "a", data, zarr_format=2, order=order, **kwargs)
    meta = json.loads((tmp_path / "a" / ".zarray").read_text())
    stored = meta["compressor"] if role == "compressor" else meta["filters"][0]
    assert stored == codec.get_config()
    if role == "compressor":  # each chunk file is one valid format-v1 buffer
        # (an F-ordered chunk is stored as its elements in memory order)
        header = bc.validate((tmp_path / "a" / "0.0").read_bytes())
        assert header.shape == ((16, 32) if order == "C" else (16 * 32,))


@zarr_param
@pytest.mark.parametrize("compressors", ["none", "zstd"])
def test_zarr_format_3_serializer(tmp_path, dtype, zarr_dtype, compressors):
    pytest.importorskip("zarr")
    from bitsparse_core.numcodecs import BitsparseCodec
    data, name = _zarr_data(dtype, zarr_dtype)
    codec = BitsparseCodec(dtype=name)
    _write(tmp_path / "a", data, serializer=codec,
           compressors=None if compressors == "none" else "auto")
    meta = json.loads((tmp_path / "a" / "zarr.json").read_text())
    config = Bitsparse(dtype=name).get_config()
    config.pop("id")
    assert meta["codecs"][0] == {"name": "bitsparse", "configuration": config}
    if compressors == "none":
        chunk = tmp_path / "a" / "c" / "0" / "0"
        assert bc.validate(chunk.read_bytes()).shape == (16, 32)


def test_zarr_format_3_refuses_arrays_it_cannot_store(tmp_path):
    zarr = pytest.importorskip("zarr")
    from bitsparse_core.numcodecs import BitsparseCodec
    with pytest.raises(ValueError, match="float64"):
        zarr.create_array(str(tmp_path / "a"), shape=(4,), dtype="float64",
                          serializer=BitsparseCodec())
    with pytest.raises(ValueError, match="uint16"):          # bits need a dtype
        zarr.create_array(str(tmp_path / "b"), shape=(4,), dtype="uint16",
                          serializer=BitsparseCodec())
    with pytest.raises(ValueError, match="float16"):
        zarr.create_array(str(tmp_path / "c"), shape=(4,), dtype="float16",
                          serializer=BitsparseCodec(dtype="bfloat16"))


def test_zarr_arrays_reopen_in_a_fresh_interpreter(tmp_path):
    """A reader that never imports bitsparse_core finds both codecs by entry point."""
    pytest.importorskip("zarr")
    if not (_installed_entry_point("numcodecs.codecs") and _installed_entry_point("zarr.codecs")):
        pytest.skip("installed metadata predates the entry points: pip install -e .")
    from bitsparse_core.numcodecs import BitsparseCodec
    data, name = _zarr_data(D.BFLOAT16, "uint16")
    _write(tmp_path / "v2", data, zarr_format=2, compressors=Bitsparse(dtype=name))
    _write(tmp_path / "v3", data, serializer=BitsparseCodec(dtype=name), compressors=None)
    np.save(tmp_path / "want.npy", data)
    out = _fresh_python(
        "import numpy as np, zarr\n"
        "want = np.load('want.npy')\n"
        "for fmt in ('v2', 'v3'):\n"
        "    print(fmt, np.array_equal(zarr.open_array(fmt, mode='r')[:], want))\n", tmp_path)
    assert out.split() == ["v2", "True", "v3", "True"]
