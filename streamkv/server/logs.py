"""Server log hygiene: no WebSocket frame dumps at debug, no traceback for a client's bad bytes.

uvicorn's websockets-sansio transport hands its ``uvicorn.error`` logger to
the websockets protocol, which at debug level logs every frame and
handshake header (``< TEXT ...``, ``> TEXT ...``, ``= connection is OPEN``):
most of a debug log, and a copy of every prompt and answer. And a text frame
that is not UTF-8 makes uvicorn log a traceback, although it handles it
(close code 1007). ``install_log_filters()`` drops the first and shortens
the second to one line.
"""

from __future__ import annotations

import logging

# The prefixes websockets' protocol logs with: frames, handshake lines, state, faults.
_WEBSOCKETS_DEBUG_PREFIXES = ("< ", "> ", "= ", "! ", "% ", "x ", "- ")
_INVALID_UTF8 = "Invalid UTF-8 sequence received from client."


class ServerLogFilter(logging.Filter):
    """A filter for the ``uvicorn.error`` logger (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if not isinstance(msg, str):
            return True
        if record.levelno <= logging.DEBUG and msg.startswith(_WEBSOCKETS_DEBUG_PREFIXES):
            return False
        if msg == _INVALID_UTF8:
            record.msg = "closed a WebSocket with 1007: a text frame was not valid UTF-8"
            record.args = None
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def install_log_filters() -> None:
    """Add ``ServerLogFilter`` to ``uvicorn.error`` (once) and keep websockets' own loggers at info."""
    target = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, ServerLogFilter) for f in target.filters):
        target.addFilter(ServerLogFilter())
    websockets_logger = logging.getLogger("websockets")
    if websockets_logger.getEffectiveLevel() < logging.INFO:
        websockets_logger.setLevel(logging.INFO)
