"""``response.create`` (WebSocket mode) and ``POST /v1/responses`` bodies as pydantic v2 models.

The fields streamkv reads are OpenAI's: ``model``, ``input`` (a string, or
message items whose ``content`` is a string or ``input_text`` parts),
``instructions``, ``previous_response_id``, ``max_output_tokens``,
``temperature``, ``top_p``, ``store``, ``stream`` (HTTP only), ``stream_id``
(WebSocket only) and ``metadata``, plus vLLM's ``ignore_eos``. Unknown fields are ignored (the SDK sends
many); a known field of the wrong type or range is refused, with the same
strict types as the rest of the API (:mod:`streamkv.server.openai.protocol`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from streamkv.sampling_params import SamplingParams
from streamkv.server.openai.protocol import Number

_MODEL_CONFIG = ConfigDict(extra="ignore", strict=True, frozen=True)

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
MAX_STREAM_ID_CHARS = 64
MAX_RESPONSE_ID_CHARS = 128
# OpenAI's metadata bounds: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS = 16


class InputText(BaseModel):
    model_config = _MODEL_CONFIG

    type: Literal["input_text", "output_text"]
    text: StrictStr


class InputMessage(BaseModel):
    """One message item of ``input`` (``type`` may be omitted, as OpenAI's easy input messages do)."""

    model_config = _MODEL_CONFIG

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[InputText]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


MetadataKey = Annotated[StrictStr, Field(max_length=64)]
MetadataValue = Annotated[StrictStr, Field(max_length=512)]


class ResponseCreate(BaseModel):
    """A ``response.create`` event or a ``POST /v1/responses`` body."""

    model_config = _MODEL_CONFIG

    model: StrictStr | None = None
    input: StrictStr | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: StrictStr | None = None
    previous_response_id: Annotated[StrictStr, Field(min_length=1, max_length=MAX_RESPONSE_ID_CHARS)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, strict=True)] | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    store: StrictBool = True
    stream: StrictBool = False
    stream_id: Annotated[StrictStr, Field(min_length=1, max_length=MAX_STREAM_ID_CHARS)] | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_PAIRS)] | None = None
    tools: Annotated[list[dict[str, object]], Field(max_length=0)] | None = None  # no tool calling
    ignore_eos: StrictBool = False  # vLLM's extension (benchmark clients such as guidellm send it)

    def messages(self) -> list[InputMessage]:
        """``input`` as message items (a string is one user message)."""
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return list(self.input)

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters: one sample, ``max_output_tokens`` (``None``: up to max_model_len)."""
        return SamplingParams(
            n=1,
            max_tokens=self.max_output_tokens,
            temperature=float(self.temperature) if self.temperature is not None else DEFAULT_TEMPERATURE,
            top_p=float(self.top_p) if self.top_p is not None else 1.0,
            ignore_eos=self.ignore_eos,
        )
