"""What every OpenAI route shares (vLLM's ``OpenAIServing``): body, model, context length, tokenizer.

The engine behind the API is a :class:`ServingEngine` that also exposes its
``tokenizer`` and a chat formatter with ``conversation(messages)``
(``AsyncEngine`` does).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from streamkv.server.engine_api import ChatFormatterLike, ServingEngine
from streamkv.server.openai.errors import APIError, from_validation
from streamkv.server.openai.logprobs import LogprobFormatter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

M = TypeVar("M", bound=BaseModel)

# A body over the limit is still read (and dropped) up to this much, so the
# client finishes sending and can read its 413 instead of a reset connection.
_DRAIN_LIMIT_BYTES = 64 << 20
_DRAIN_TIMEOUT_S = 10.0


class ConversationFormatter(ChatFormatterLike, Protocol):
    def conversation(self, messages: list[dict[str, str]]) -> list[int]: ...


class OpenAIEngine(ServingEngine, Protocol):
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def chat(self) -> ConversationFormatter: ...


class OpenAIServing:
    """Per-app state of the OpenAI routes.

    Args:
        engine: the engine (started by the app's lifespan).
        served_model_name: the ``id`` clients name in ``model``; ``None``: the model's name.
        max_body_bytes: largest request body accepted (413 above).
    """

    def __init__(
        self,
        engine: OpenAIEngine,
        served_model_name: str | None,
        max_body_bytes: int,
        check_stop: Callable[[Sequence[str]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.check_stop: Callable[[Sequence[str]], None] = check_stop or (lambda stop: None)
        self.model_id = served_model_name or engine.model_name
        self.root = engine.config.model.model or engine.model_name
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self._logprobs: LogprobFormatter | None = None

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        tokenizer: PreTrainedTokenizerBase | None = getattr(self.engine, "tokenizer", None)
        if tokenizer is None:
            raise APIError(503, "this engine has no tokenizer", "engine_stopped")
        return tokenizer

    @property
    def logprobs(self) -> LogprobFormatter:
        if self._logprobs is None:
            self._logprobs = LogprobFormatter(self.tokenizer)
        return self._logprobs

    # ------------------------------------------------------------ requests

    async def parse(self, request: Request, model: type[M]) -> M:
        """Read the body (bounded) and validate it as ``model``; 400 / 413 / 404 as :class:`APIError`."""
        body = await self._read_body(request)
        try:
            parsed = model.model_validate_json(body)
        except ValidationError as e:
            raise from_validation(e) from None
        self.check_model(getattr(parsed, "model", None))
        return parsed

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_id:
            raise APIError(
                404, f"The model `{requested}` does not exist (this server serves `{self.model_id}`).",
                "model_not_found", "model",
            )  # fmt: skip

    def check_engine(self) -> None:
        if getattr(self.engine, "error", None) is not None:
            raise APIError(503, "the engine has failed; see the server log", "engine_stopped")

    def check_context_length(self, num_prompt_tokens: int, max_tokens: int | None, what: str = "messages") -> None:
        """vLLM's context-length messages, stating the limit and the request's lengths."""
        limit = self.engine.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{num_prompt_tokens} input tokens. Please reduce the length of the input {what}.",
                "context_length_exceeded", what,
            )  # fmt: skip
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {what}, {max_tokens} in the "
                f"completion). Please reduce the length of the {what} or completion.",
                "context_length_exceeded", what,
            )  # fmt: skip

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text (off the event loop)."""
        tokenizer = self.tokenizer

        def run() -> list[list[int]]:
            return [list(tokenizer(t, add_special_tokens=add_special_tokens)["input_ids"]) for t in texts]

        return await asyncio.to_thread(run)

    async def decode(self, ids: list[int]) -> str:
        tokenizer = self.tokenizer
        text = await asyncio.to_thread(
            tokenizer.decode, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return cast(str, text)  # one flat id list decodes to one string (list[str] is for batches)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = len(self.tokenizer)
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                           "invalid_value", param)  # fmt: skip

    def envelope(self, prefix: str, obj: str) -> dict[str, Any]:
        """The fields every response object starts with."""
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": obj,
            "created": int(time.time()),
            "model": self.model_id,
        }

    async def _read_body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        stream = request.stream()
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _drain(stream)
            raise self._too_large(int(declared))
        chunks: list[bytes] = []
        size = 0
        async for chunk in stream:
            size += len(chunk)
            if size > limit:
                await _drain(stream)
                raise self._too_large(None)
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, size: int | None) -> APIError:
        got = f" ({size} bytes)" if size is not None else ""
        return APIError(413, f"the request body{got} exceeds the limit of {self.max_body_bytes} bytes "
                             "(--max-body-bytes)", "request_too_large")  # fmt: skip


async def _drain(stream: AsyncIterator[bytes]) -> None:
    drained = 0
    try:
        async with asyncio.timeout(_DRAIN_TIMEOUT_S):
            async for chunk in stream:
                drained += len(chunk)
                if drained > _DRAIN_LIMIT_BYTES:
                    return
    except Exception:  # noqa: BLE001 - the client went away or stalls (TimeoutError): the 413 is all it gets
        return
