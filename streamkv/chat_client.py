"""``streamkv chat``: a terminal client of ``/ws/chat``.

Interactive: type a line, the answer streams in; the session carries over to
follow-ups. ``/reset`` starts a new conversation, ``/quit`` (or EOF) leaves,
Ctrl-C during an answer cancels it (a second Ctrl-C, or one at the prompt,
quits). One-shot (``-m "question"``): print the answer (and the usage line,
on stderr, as interactive turns do) and exit with 0 (1 on
an error frame, 2 when the server cannot be reached, 130 on Ctrl-C).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from streamkv.server.protocol import WS_MAX_SIZE

EXIT_OK, EXIT_ERROR_FRAME, EXIT_CONNECTION, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclass(frozen=True, slots=True)
class ChatOptions:
    url: str = "ws://127.0.0.1:8000/ws/chat"
    system: str | None = None
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float | None = None
    seed: int | None = None
    session_id: str | None = None
    resumable: bool = False


class ChatClient:
    """One connection: sends turns, streams sample 0's text to ``out``."""

    def __init__(self, ws: ClientConnection, options: ChatOptions, out: TextIO, err: TextIO) -> None:
        self.ws = ws
        self.options = options
        self.out = out
        self.err = err
        self.session_id = options.session_id
        self.answering = False
        self.cancel_requested = asyncio.Event()

    async def ask(self, content: str) -> dict[str, Any]:
        """Send one turn and stream it; returns its ``done`` or ``error`` frame."""
        params: dict[str, Any] = {"max_tokens": self.options.max_tokens, "temperature": self.options.temperature}
        if self.options.top_p is not None:
            params["top_p"] = self.options.top_p
        if self.options.seed is not None:
            params["seed"] = self.options.seed
        frame: dict[str, Any] = {"type": "chat", "content": content, "params": params}
        if self.session_id is not None:
            frame["session_id"] = self.session_id
        elif self.options.system:
            frame["system"] = self.options.system
        if self.options.resumable:
            frame["resumable"] = True
        self.cancel_requested.clear()
        self.answering = True
        watcher = asyncio.create_task(self._cancel_when_asked())
        try:
            await self.ws.send(orjson.dumps(frame).decode())
            while True:
                msg: dict[str, Any] = orjson.loads(await self.ws.recv())
                kind = msg.get("type")
                if kind == "session":
                    self.session_id = msg["session_id"]
                elif kind == "delta" and msg.get("index") == 0:
                    self.out.write(msg["text"])
                    self.out.flush()
                elif kind in ("done", "error"):
                    return msg
        finally:
            self.answering = False
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def reset(self) -> None:
        await self.ws.send(orjson.dumps({"type": "reset"}).decode())
        for _ in range(1000):  # a cancelled turn's done may come first
            if orjson.loads(await self.ws.recv()).get("type") == "reset":
                break
        self.session_id = None

    async def _cancel_when_asked(self) -> None:
        await self.cancel_requested.wait()
        await self.ws.send(orjson.dumps({"type": "cancel"}).decode())

    def report(self, result: dict[str, Any]) -> None:
        if result["type"] == "error":
            self.out.write("\n")
            self.err.write(f"error {result.get('code')}: {result.get('message')}\n")
            return
        self.out.write("\n")
        usage, timings = result.get("usage") or {}, result.get("timings") or {}
        reason = result.get("finish_reason")
        ttft = timings.get("ttft_ms")
        self.err.write(
            f"[{reason}; {usage.get('completion_tokens')} tokens, {usage.get('cached_tokens')} cached"
            f"{'' if ttft is None else f'; ttft {ttft:.0f} ms'}; total {timings.get('total_ms', 0):.0f} ms]\n"
        )
        self.out.flush()
        self.err.flush()


def run_chat(options: ChatOptions, message: str | None = None) -> int:
    """The ``streamkv chat`` command (one-shot when ``message`` is given)."""
    try:
        if message is not None:
            return asyncio.run(one_shot(options, message))
        return asyncio.run(interactive(options, stdin_lines(), prompt=sys.stdin.isatty()))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


async def one_shot(options: ChatOptions, message: str, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        async with connect(options.url, open_timeout=10, max_size=WS_MAX_SIZE) as ws:
            client = ChatClient(ws, options, out, err)
            with _sigint_cancels(client):
                result = await client.ask(message)
            client.report(result)  # the answer's newline, then the usage footer (or the error) on stderr
            if result["type"] == "error":
                return EXIT_ERROR_FRAME
            return EXIT_INTERRUPTED if client.cancel_requested.is_set() else EXIT_OK
    except (OSError, TimeoutError, WebSocketException) as e:
        err.write(f"streamkv chat: {options.url}: {e}\n")
        return EXIT_CONNECTION


async def interactive(
    options: ChatOptions,
    lines: AsyncIterator[str],
    out: TextIO | None = None,
    err: TextIO | None = None,
    *,
    prompt: bool = False,
) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        async with connect(options.url, open_timeout=10, max_size=WS_MAX_SIZE) as ws:
            client = ChatClient(ws, options, out, err)
            err.write(f"connected to {options.url}; /reset starts over, /quit leaves, Ctrl-C stops an answer\n")
            with _sigint_cancels(client):
                while True:
                    if prompt:
                        out.write("> ")
                        out.flush()
                    line = await anext(lines, None)
                    if line is None or line.strip() == "/quit":
                        return EXIT_OK
                    if line.strip() == "/reset":
                        await client.reset()
                        err.write("(new conversation)\n")
                    elif line.strip():
                        client.report(await client.ask(line))
    except asyncio.CancelledError:  # Ctrl-C at the prompt
        out.write("\n")
        return EXIT_INTERRUPTED
    except (OSError, TimeoutError, WebSocketException) as e:
        err.write(f"streamkv chat: {options.url}: {e}\n")
        return EXIT_CONNECTION


@contextlib.contextmanager
def _sigint_cancels(client: ChatClient) -> Iterator[None]:
    """Ctrl-C cancels the answer in flight; at the prompt (or twice) it quits."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def on_sigint() -> None:
        if client.answering and not client.cancel_requested.is_set():
            client.cancel_requested.set()
        elif main is not None:
            main.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)


async def stdin_lines() -> AsyncIterator[str]:
    """Lines of stdin without a reader thread and without making the tty non-blocking
    (stdout usually shares its file description)."""
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    buf = bytearray()

    def on_readable() -> None:
        data = os.read(fd, 65536)  # readable: returns without blocking
        if not data:
            loop.remove_reader(fd)
            if buf:
                queue.put_nowait(buf.decode(errors="replace"))
            queue.put_nowait(None)
            return
        buf.extend(data)
        while (nl := buf.find(b"\n")) >= 0:
            queue.put_nowait(buf[:nl].decode(errors="replace"))
            del buf[: nl + 1]

    try:
        loop.add_reader(fd, on_readable)
    except (OSError, ValueError, NotImplementedError):  # a regular file: reads never block
        for line in sys.stdin:
            yield line.rstrip("\n")
        return
    try:
        while (line := await queue.get()) is not None:
            yield line
    finally:
        loop.remove_reader(fd)
