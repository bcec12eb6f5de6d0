"""The install layout: ``kernels/`` installs as ``streamkv.kernels``, and every package folder is listed."""

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
    # setuptools cannot discover a mapped folder, so the list is written out; a new
    # subpackage left out of it would be missing from a wheel (an editable install hides that).
    table = _setuptools_table()
    on_disk = {
        ".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "streamkv").rglob("__init__.py")
    }
    on_disk |= {"streamkv.kernels"} if (REPO / "kernels" / "__init__.py").is_file() else set()
    assert set(table["packages"]) == on_disk  # type: ignore[arg-type]
    assert table["package-dir"] == {"streamkv.kernels": "kernels"}


def test_streamkv_kernels_is_the_top_level_folder() -> None:
    spec = importlib.util.find_spec("streamkv.kernels")  # imports streamkv only, not triton
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve() == REPO / "kernels" / "__init__.py"


def test_no_top_level_kernels_package_is_installed_by_us(tmp_path: Path) -> None:
    # Outside the repository root (which puts its own folders on sys.path), ``kernels``
    # must not be ours: the name belongs to a PyPI package.
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else '')"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    origin = out.stdout.strip()
    assert not origin or not Path(origin).resolve().is_relative_to(REPO)
