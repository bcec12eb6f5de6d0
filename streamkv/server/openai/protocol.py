"""Request bodies of the OpenAI-compatible API as pydantic v2 models.

The shapes follow OpenAI's API reference and vLLM's
``vllm/entrypoints/openai/protocol.py`` (its extensions ``top_k``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``). Unknown fields are
ignored, because clients send many; a known field with a wrong type or range
is refused (strict types: ``"5"`` is not an integer, ``true`` is not a
number, NaN and infinities are not numbers).

:class:`SamplingFields` defines each sampling parameter's type and range
once; ``/ws/chat``'s ``params`` object is validated by the same fields.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from streamkv.sampling_params import MAX_BEAM_WIDTH, MAX_LOGPROBS, SamplingParams

MAX_STOP_STRINGS = 16
MAX_N = 16

# Strict numbers: an int is a number, a bool or a string is not; NaN and +-inf are refused.
Number = Annotated[StrictFloat | StrictInt, Field(allow_inf_nan=False)]
TokenId = Annotated[StrictInt, Field(ge=0)]
Seed = Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)]

_MODEL_CONFIG = ConfigDict(extra="ignore", strict=True, frozen=True)


class SamplingFields(BaseModel):
    """Sampling parameters shared by ``/v1/completions``, ``/v1/chat/completions`` and ``/ws/chat``.

    ``None`` (or an absent field) means the endpoint's default.
    """

    model_config = _MODEL_CONFIG

    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    seed: Seed | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stop: StrictStr | list[StrictStr] | None = None  # count and length: --max-stop-strings, checked by the route
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    # beam search (streamkv's extension; vLLM spells it use_beam_search with n beams)
    beam_width: Annotated[StrictInt, Field(ge=1, le=MAX_BEAM_WIDTH)] | None = None
    length_penalty: Number = 1.0
    early_stopping: StrictBool | Literal["never"] = False

    def sampling_params(
        self, *, default_max_tokens: int | None, default_temperature: float, logprobs: int | None = None
    ) -> SamplingParams:
        """The engine's SamplingParams.

        Raises:
            ValueError: a combination SamplingParams refuses (``top_k`` 0,
                ``min_tokens`` over ``max_tokens``, an empty stop string); the
                message starts with the field name.
        """
        return SamplingParams(
            n=self.n,
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=float(self.temperature) if self.temperature is not None else default_temperature,
            top_p=float(self.top_p) if self.top_p is not None else 1.0,
            top_k=None if self.top_k in (None, -1) else self.top_k,  # -1: vLLM's old spelling of "all"
            seed=self.seed,
            stop=() if self.stop is None else ((self.stop,) if isinstance(self.stop, str) else tuple(self.stop)),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            beam_width=self.beam_width,
            length_penalty=float(self.length_penalty),
            early_stopping=self.early_stopping,
        )


class StreamOptions(BaseModel):
    model_config = _MODEL_CONFIG

    include_usage: StrictBool = False


class _OpenAIRequest(SamplingFields):
    """Fields every generation route accepts."""

    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # Accepted at their neutral values only: the engine has no penalties or logit bias.
    presence_penalty: Annotated[Number, Field(ge=0.0, le=0.0)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=0.0, le=0.0)] | None = None
    repetition_penalty: Annotated[Number, Field(ge=1.0, le=1.0)] | None = None
    logit_bias: Annotated[dict[str, Number], Field(max_length=0)] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


PromptIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_OpenAIRequest):
    """``POST /v1/completions``: ``prompt`` is a string, strings, token ids, or lists of token ids."""

    prompt: (
        StrictStr
        | Annotated[list[StrictStr], Field(min_length=1)]
        | PromptIds
        | Annotated[list[PromptIds], Field(min_length=1)]
    )
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: Annotated[StrictStr, Field(max_length=0)] | None = None  # no fill-in-the-middle

    def prompts(self) -> list[str | list[int]]:
        """Each prompt as a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = _MODEL_CONFIG

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One message; ``content`` is a string or a list of text parts (``developer`` counts as ``system``)."""

    model_config = _MODEL_CONFIG

    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def as_template_message(self) -> dict[str, str]:
        content = self.content
        text = content if isinstance(content, str) else "".join(p.text for p in content or ())
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_OpenAIRequest):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[dict[str, object]], Field(max_length=0)] | None = None  # no tool calling

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered through the chat template (vLLM's shape)."""

    model_config = _MODEL_CONFIG

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text (vLLM's shape)."""

    model_config = _MODEL_CONFIG

    model: StrictStr | None = None
    tokens: list[TokenId]
