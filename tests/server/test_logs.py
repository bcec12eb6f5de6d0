"""Log hygiene (logs.py): no WebSocket frame dumps at debug level."""

from __future__ import annotations

import logging

import pytest
from server_harness import RunningServer, chat_turn, connect_chat

from streamkv.server.logs import ServerLogFilter

pytestmark = pytest.mark.timeout(30)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_debug_level_does_not_log_websocket_frames(server: RunningServer) -> None:
    target = logging.getLogger("uvicorn.error")
    handler, level = Records(), target.level
    target.addHandler(handler)
    target.setLevel(logging.DEBUG)  # as --log-level debug does; sockets opened from now on log at debug
    try:
        with connect_chat(server) as ws:
            assert chat_turn(ws, "a secret prompt", params={"max_tokens": 3}).done is not None
    finally:
        target.setLevel(level)
        target.removeHandler(handler)
    messages = [r.getMessage() for r in handler.records]
    assert not [m for m in messages if "TEXT" in m or "secret" in m or m.startswith(("< ", "> "))], messages


def test_filter_keeps_other_debug_lines_and_shortens_the_utf8_traceback() -> None:
    f = ServerLogFilter()

    def record(level: int, msg: str, exc: bool = False) -> logging.LogRecord:
        exc_info = None
        if exc:
            try:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            except UnicodeDecodeError:
                import sys

                exc_info = sys.exc_info()
        return logging.LogRecord("uvicorn.error", level, __file__, 1, msg, None, exc_info)

    assert not f.filter(record(logging.DEBUG, "< TEXT '{\"type\": ...' [40 bytes]"))
    assert not f.filter(record(logging.DEBUG, "= connection is OPEN"))
    assert f.filter(record(logging.DEBUG, "Started server process [1]"))
    assert f.filter(record(logging.INFO, "< looks like a frame but is info"))
    r = record(logging.ERROR, "Invalid UTF-8 sequence received from client.", exc=True)
    assert f.filter(r) and r.exc_info is None and "1007" in r.getMessage() and r.levelname == "WARNING"
