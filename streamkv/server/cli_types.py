"""Value types and help formatting of the ``streamkv`` command line (argparse ``type=`` callables).

Each parser raises :class:`argparse.ArgumentTypeError` with a message that
names the bad value, so argparse prints one usage line, not a traceback.
"""

from __future__ import annotations

import argparse
import re

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_UNITS = {"": 1, "b": 1, **{u + s: v for u, v in (_DECIMAL | _BINARY).items() for s in ("", "b")}}
DEFAULT_CHAT_URL = "ws://127.0.0.1:8000/ws/chat"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"512MiB"`` -> 536870912. Binary (KiB, MiB, GiB, TiB; Ki, Mi, Gi) and
    decimal (KB, MB, GB, TB; K, M, G) suffixes, any case; a bare number is bytes."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (examples: 536870912, 512MiB, 1.5GiB)")
    value = float(m.group(1)) * _UNITS[unit]
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte: {text!r}")
    return int(value)


def fraction_or_none(text: str) -> float | None:
    if text.lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` once: not when the help already names its default, not for absent or off flags."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return super()._get_help_string(action) or text


def package_version() -> str:
    """streamkv's installed version, for ``--version``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("streamkv")
    except PackageNotFoundError:
        return "unknown (not installed)"


def int_or_none(text: str) -> int | None:
    if text.lower() in ("none", "off"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def origins(text: str) -> tuple[str, ...]:
    from streamkv.server.origin import OriginPolicy

    entries = tuple(e.strip() for e in text.split(",") if e.strip())
    try:
        OriginPolicy(entries)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("allowed_origins: ")) from None
    return entries


def chat_url(text: str) -> str:
    """The ``/ws/chat`` URL for ``--url``: ``http(s)://host:port[/]`` maps to ``ws(s)://host:port/ws/chat``.

    Raises:
        ValueError: not an http, https, ws or wss URL with a host.
    """
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(text.strip() if "://" in text else f"http://{text.strip()}")
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"--url {text!r}: expected http://host:port or ws://host:port/ws/chat")
    path = parts.path if parts.path not in ("", "/") else "/ws/chat"
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))
