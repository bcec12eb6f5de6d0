"""Building the C++ ops: a build killed mid-way must not leave every later load waiting forever."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from streamkv.ops.cpu_ops import _build

SOURCE = """
#include <pybind11/pybind11.h>
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""


@pytest.mark.timeout(300)
def test_a_lock_file_left_by_a_killed_build_is_removed_and_the_build_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "answer.cpp"
    source.write_text(SOURCE)
    folder = tmp_path / "build"
    folder.mkdir()
    (folder / "lock").touch()  # what cpp_extension leaves when its process dies mid-build (Ctrl-C, OOM kill)

    with caplog.at_level(logging.WARNING, logger="streamkv.ops.cpu_ops"):
        module = _build("streamkv_test_stale_lock", (source,), folder, "nothing")

    assert module is not None and module.answer() == 42  # without the mend, cpp_extension waits on the file forever
    assert not (folder / "lock").exists()
    assert "left by a build that was killed" in caplog.text
