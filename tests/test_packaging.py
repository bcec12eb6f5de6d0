"""The install layout: every package folder is listed, and nothing of ours is importable as ``kernels``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent


def _setuptools_table() -> dict[str, object]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_package_folder_is_in_the_explicit_list() -> None:
    # a new subpackage left out of the list would be missing from a wheel (an editable install hides that)
    table = _setuptools_table()
    on_disk = {
        ".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "streamkv").rglob("__init__.py")
    }
    data_only = {"streamkv.ops.csrc"}  # the C++ sources (package-data), no Python
    assert all(any((REPO / p.replace(".", "/")).glob("*.cpp")) for p in data_only)
    assert set(table["packages"]) == on_disk | data_only  # type: ignore[arg-type]
    assert "package-dir" not in table


def test_the_triton_kernels_are_streamkv_kernels() -> None:
    spec = importlib.util.find_spec("streamkv.kernels")  # imports streamkv only, not triton
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve() == REPO / "streamkv" / "kernels" / "__init__.py"


def test_kernels_is_never_ours_even_from_the_repository_root() -> None:
    # ``kernels`` is a PyPI package that transformers imports when it is installed. A top-level folder of
    # that name shadowed it wherever the repository root is on sys.path (pytest, ``python -m`` from the
    # root), and every transformers model import failed with "cannot import name 'CUDAProperties'".
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s and s.origin else '')"
    for cwd in (REPO, REPO / "tests"):
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        )
        assert out.returncode == 0, out.stderr
        origin = out.stdout.strip()
        ours = Path(origin).resolve().is_relative_to(REPO) and "site-packages" not in Path(origin).parts
        assert not origin or not ours, origin  # absent, or an installed package (the venv may sit in REPO)
