"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

| status | when                                                        | ``code``                    |
|--------|-------------------------------------------------------------|-----------------------------|
| 400    | malformed JSON                                              | ``invalid_json``            |
| 400    | a field's type or range, an unsupported value               | ``invalid_value``           |
| 400    | prompt over ``max_model_len`` (states the limit and length) | ``context_length_exceeded`` |
| 400    | never fits the KV pool, empty prompt                        | the engine's code           |
| 401    | a missing or wrong API key                                  | ``invalid_api_key``         |
| 404    | a ``model`` that is not served                              | ``model_not_found``         |
| 413    | a body over ``--max-body-bytes``                            | ``request_too_large``       |
| 503    | the engine is not running or has failed                     | ``engine_stopped``          |
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import ValidationError
from starlette.responses import Response

from streamkv.errors import EngineError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}
# Engine codes that mean "the server cannot serve now", not "your request is wrong".
_UNAVAILABLE = frozenset({"engine_stopped", "engine_error"})
_MAX_ECHO = 200  # characters of a client's value quoted back in a message


class APIError(Exception):
    """An HTTP error with an OpenAI-shaped body.

    Args:
        status: HTTP status code.
        message: for people; says what was wrong and the allowed values.
        code: stable machine-readable code (see the module table).
        param: the offending field (dotted path), if any.
    """

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        """The inner ``{"message", "type", "param", "code"}`` object."""
        return error_body(self.status, self.message, self.code, self.param)

    def response(self) -> Response:
        return error_response(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}


def error_response(status: int, message: str, code: str, param: str | None = None) -> Response:
    body = {"error": error_body(status, message, code, param)}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def from_validation(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400, naming the field (``messages.0.role``) and what it must be."""
    errors = exc.errors(include_url=False)
    # A union reports every member's error; the deepest path is the member the value was meant as.
    first = errors[0]["loc"][:1]
    err = max((e for e in errors if e["loc"][:1] == first), key=lambda e: len(e["loc"]))
    loc = [str(p) for p in err["loc"]]
    # Union members add the member's type to the path (``stop.str``); keep the field's own path.
    path = ".".join(p for p in loc if not _is_type_tag(p)) or None
    if err["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err['msg']}", "invalid_json")
    if err["type"] == "model_type" and not loc:
        return APIError(400, "the body must be a JSON object", "invalid_json")
    value = err.get("input")
    shown = "" if err["type"] == "missing" else f" (got {_short(value)})"
    msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
    return APIError(400, f"{path}: {msg}{shown}" if path else msg, "invalid_value", path)


def from_engine(exc: EngineError) -> APIError:
    """An engine refusal: 503 when the engine is down, else 400 with the engine's code."""
    code = str(getattr(exc.code, "value", exc.code))  # a plain str or a str enum
    if code in _UNAVAILABLE:
        return APIError(503, exc.message, "engine_stopped")
    return APIError(400, exc.message, code)


def invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", "invalid_value", param)


def from_params(exc: ValueError) -> APIError:
    """SamplingParams' refusal; its message starts with the field's name."""
    message = str(exc)
    return APIError(400, message, "invalid_value", message.split(" ", 1)[0])


def _is_type_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list[str]", "list[int]", "list[list[int]]", "dict[str,any]"} or (
        part.startswith(("list[", "function-", "constrained-", "Annotated"))
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_ECHO else text[:_MAX_ECHO] + "..."
