"""ErrorCode is the one list of error codes: the README's table and the code agree with it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from streamkv.errors import EngineError, ErrorCode
from streamkv.metrics import KNOWN_ERROR_CODES

ROOT = Path(__file__).resolve().parent.parent
_ROW = re.compile(r"^\|\s*`([a-z_]+)`\s*\|")


def readme_error_codes() -> list[str]:
    """The first column of the markdown table that follows the README's ``Errors (`` paragraph."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Errors ("))
    codes: list[str] = []
    in_table = False
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            in_table = True
            m = _ROW.match(line)
            if m:
                codes.append(m.group(1))
        elif in_table:
            break
    return codes


def test_readme_error_table_lists_exactly_the_error_codes() -> None:
    codes = readme_error_codes()
    assert len(codes) == len(set(codes)), f"duplicate rows: {codes}"
    assert set(codes) == {c.value for c in ErrorCode}


def test_every_code_is_precreated_in_metrics() -> None:
    assert set(KNOWN_ERROR_CODES) == set(ErrorCode)


def _code_arguments() -> list[tuple[str, int, ast.expr]]:
    """The first argument of every ``EngineError(...)``, ``FrameError(...)`` and ``_send_error(...)`` call."""
    found = []
    for path in sorted((ROOT / "streamkv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in ("EngineError", "FrameError", "_send_error"):
                found.append((str(path.relative_to(ROOT)), node.lineno, node.args[0]))
    return found


def test_the_package_sends_every_error_code_and_no_other() -> None:
    args = _code_arguments()
    assert len(args) >= 20  # the walk found the protocol's, the engine's and the sessions' errors
    used = set()
    for where, line, arg in args:
        if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "ErrorCode":
            used.add(ErrorCode[arg.attr])
        elif isinstance(arg, ast.Attribute) and arg.attr == "code":
            continue  # re-raising a caught error's code
        else:
            pytest.fail(f"{where}:{line}: error code is not an ErrorCode member: {ast.unparse(arg)}")
    assert used == set(ErrorCode), f"codes never sent: {set(ErrorCode) - used}"


def test_an_unknown_code_is_refused() -> None:
    assert EngineError("session_busy", "x").code is ErrorCode.SESSION_BUSY
    with pytest.raises(ValueError):
        EngineError("no_such_code", "x")
