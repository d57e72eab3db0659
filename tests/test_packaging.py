"""What the wheel declares: every package, the license file, the entry points."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _load(spec: str):
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_every_package_of_the_tree_is_in_the_wheel():
    declared = set(PYPROJECT["tool"]["setuptools"]["packages"])
    tree = {".".join(p.parent.relative_to(ROOT).parts)
            for p in (ROOT / "bitsparse_core").rglob("__init__.py")}
    assert tree <= declared, f"missing from [tool.setuptools] packages: {sorted(tree - declared)}"
    assert PYPROJECT["tool"]["setuptools"]["package-dir"]["bitsparse_core._kernels"] == "kernels"


def test_the_kernels_folder_does_not_shadow_a_kernels_package():
    """A checkout's root is first on sys.path when code runs from it; a regular package
    named ``kernels`` there would stand in for the Hugging Face ``kernels`` package, which
    transformers (5.x) imports, and the import would fail. The folder stays a plain one."""
    import subprocess
    import sys
    assert not (ROOT / "kernels" / "__init__.py").exists()
    code = ("import importlib.util, sys; sys.path.insert(0, sys.argv[1]); "
            "s = importlib.util.find_spec('kernels'); print(s.origin if s else None)")
    origin = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    assert origin in ("None", "") or not origin.startswith(str(ROOT / "kernels")), origin


def test_license_is_the_apache_2_text_and_ships():
    text = (ROOT / "LICENSE").read_text()
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert "LICENSE" in PYPROJECT["project"]["license-files"]
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and text.count("\n") == 202


def test_console_script():
    scripts = PYPROJECT["project"]["scripts"]
    from bitsparse_core.cli import main
    assert _load(scripts["bitsparse"]) is main


def test_numcodecs_entry_point():
    pytest.importorskip("numcodecs")
    cls = _load(PYPROJECT["project"]["entry-points"]["numcodecs.codecs"]["bitsparse"])
    assert cls.codec_id == "bitsparse"


def test_zarr_entry_point():
    pytest.importorskip("zarr")
    cls = _load(PYPROJECT["project"]["entry-points"]["zarr.codecs"]["bitsparse"])
    assert cls().to_dict()["name"] == "bitsparse"


def test_ci_installs_the_numcodecs_extra():
    assert "numcodecs" in PYPROJECT["project"]["optional-dependencies"]
    assert '".[numcodecs]"' in (ROOT / ".ci" / "run").read_text()
