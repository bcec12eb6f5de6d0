from __future__ import annotations

import asyncio
from typing import Any, cast

import orjson
import pytest
from starlette.websockets import WebSocket

from streamkv.server.protocol import delta_frame, error_frame
from streamkv.server.writer import FrameWriter


class SlowSocket:
    """send_text blocks until the test opens the gate."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gate = asyncio.Event()
        self.fail = False

    async def send_text(self, text: str) -> None:
        await self.gate.wait()
        if self.fail:
            raise OSError("gone")
        self.sent.append(orjson.loads(text))


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.mark.timeout(5)
def test_deltas_coalesce_per_sample_while_the_client_is_slow() -> None:
    async def main() -> tuple[list[dict[str, Any]], FrameWriter]:
        ws = SlowSocket()
        writer = FrameWriter(cast(WebSocket, ws))
        writer.start()
        writer.send(delta_frame(0, "a", [1]))
        await settle()  # the writer took "a" and is stuck sending it
        for i in range(100):
            writer.send(delta_frame(i % 2, f"<{i}>", [i]))
        writer.send(error_frame("x", "y"))
        writer.send(delta_frame(0, "z", [99]))  # must not jump over the error
        ws.gate.set()
        await settle()
        await writer.aclose()
        return ws.sent, writer

    sent, writer = asyncio.run(main())
    assert [f["type"] for f in sent] == ["delta", "delta", "delta", "error", "delta"]
    assert sent[0]["text"] == "a"
    assert sent[1]["index"] == 0 and sent[1]["token_ids"] == list(range(0, 100, 2))
    assert sent[2]["index"] == 1 and sent[2]["text"] == "".join(f"<{i}>" for i in range(1, 100, 2))
    assert sent[4]["text"] == "z"
    assert writer.num_merged == 98


@pytest.mark.timeout(5)
def test_overflow_when_the_client_never_reads() -> None:
    async def main() -> FrameWriter:
        ws = SlowSocket()
        writer = FrameWriter(cast(WebSocket, ws), max_pending=10)
        writer.start()
        for _ in range(12):
            writer.send(error_frame("x", "y"))
        await settle()
        await writer.aclose()
        return writer

    assert asyncio.run(main()).overflowed


@pytest.mark.timeout(5)
def test_send_failure_closes_quietly() -> None:
    async def main() -> FrameWriter:
        ws = SlowSocket()
        ws.fail = True
        ws.gate.set()
        writer = FrameWriter(cast(WebSocket, ws))
        writer.start()
        writer.send(error_frame("x", "y"))
        await settle()
        writer.send(error_frame("x", "y"))  # dropped, no error
        await writer.aclose()
        return writer

    writer = asyncio.run(main())
    assert writer.closed and writer.num_sent == 0
