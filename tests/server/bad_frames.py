"""Client frames the server must refuse: (id, raw frame, error code, a word the message must contain)."""

from __future__ import annotations

import orjson

from streamkv.server.protocol import MAX_FRAME_BYTES


def _chat(**fields: object) -> str:
    return orjson.dumps({"type": "chat", "content": "hi", **fields}).decode()


def _params(**params: object) -> str:
    return _chat(params=params)


BAD_FRAMES: list[tuple[str, str | bytes, str, str]] = [
    ("not_json", "hello there", "invalid_json", "JSON"),
    ("truncated_json", '{"type": "chat", "content": "hi"', "invalid_json", "JSON"),
    ("json_array", "[1, 2]", "invalid_json", "object"),
    ("json_string", '"chat"', "invalid_json", "object"),
    ("bad_utf8_binary", b"\xff\xfe{}", "invalid_json", "JSON"),
    ("no_type", '{"content": "hi"}', "unknown_type", "type"),
    ("unknown_type", '{"type": "dance"}', "unknown_type", "dance"),
    ("type_not_string", '{"type": 3}', "unknown_type", "3"),
    ("cancel_extra_field", '{"type": "cancel", "now": true}', "invalid_params", "now"),
    ("missing_content", '{"type": "chat"}', "invalid_params", "content"),
    ("content_number", _chat(content=5), "invalid_params", "content"),
    ("content_list", _chat(content=["hi"]), "invalid_params", "content"),
    ("content_empty", _chat(content=""), "invalid_params", "content"),
    ("content_blank", _chat(content="  \n "), "invalid_params", "content"),
    ("unknown_field", _chat(sesion_id="x"), "invalid_params", "sesion_id"),
    ("session_id_number", _chat(session_id=5), "invalid_params", "session_id"),
    ("session_id_empty", _chat(session_id=""), "invalid_params", "session_id"),
    ("system_number", _chat(system=1), "invalid_params", "system"),
    ("resumable_string", _chat(resumable="yes"), "invalid_params", "resumable"),
    ("params_not_object", _chat(params=[1]), "invalid_params", "params"),
    ("unknown_param", _params(best_of=4), "invalid_params", "best_of"),
    ("max_tokens_zero", _params(max_tokens=0), "invalid_params", "max_tokens"),
    ("max_tokens_negative", _params(max_tokens=-5), "invalid_params", "max_tokens"),
    ("max_tokens_bool", _params(max_tokens=True), "invalid_params", "max_tokens"),
    ("max_tokens_float", _params(max_tokens=2.5), "invalid_params", "max_tokens"),
    ("max_tokens_string", _params(max_tokens="8"), "invalid_params", "max_tokens"),
    ("temperature_string", _params(temperature="hot"), "invalid_params", "temperature"),
    ("temperature_bool", _params(temperature=False), "invalid_params", "temperature"),
    ("temperature_negative", _params(temperature=-0.1), "invalid_params", "temperature"),
    ("top_p_zero", _params(top_p=0), "invalid_params", "top_p"),
    ("top_p_above_one", _params(top_p=1.5), "invalid_params", "top_p"),
    ("top_k_zero", _params(top_k=0), "invalid_params", "top_k"),
    ("top_k_float", _params(top_k=1.0), "invalid_params", "top_k"),
    ("n_zero", _params(n=0), "invalid_params", "n"),
    ("n_too_many", _params(n=17), "invalid_params", "n"),
    ("seed_string", _params(seed="42"), "invalid_params", "seed"),
    ("stop_numbers", _params(stop=[1, 2]), "invalid_params", "stop"),
    ("stop_empty_string", _params(stop=[""]), "invalid_params", "stop"),
    ("stop_token_ids_strings", _params(stop_token_ids=["a"]), "invalid_params", "stop_token_ids"),
    ("ignore_eos_int", _params(ignore_eos=1), "invalid_params", "ignore_eos"),
    ("too_large", _chat(content="x" * (MAX_FRAME_BYTES + 1)), "frame_too_large", "limit"),
]
